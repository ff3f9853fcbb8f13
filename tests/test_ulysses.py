"""Ulysses sequence parallelism against the float64 oracle on the unsharded arrays.

Every test shards the global arrays over a mesh of simulated CPU devices with
`jax.shard_map(..., in_specs=P(None, "sp"), out_specs=P(None, "sp"))` (the
default `check_vma=True`), and compares the output and the gradients of q, k, v
(and sinks / bias) from `jax.vjp` with a random cotangent against
`oracle.attention` on the full, unsharded inputs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import oracle
from vidax_eqx import kernels
from vidax_eqx.parallel import (
    DP_AXIS,
    kv_head_repeats,
    make_mesh,
    pad_to_multiple,
    padding_segment_ids,
    sequence_parallel_joint_self_attention,
    sequence_parallel_self_attention,
    SP_AXIS,
    unpad,
)


# ---------------------------------------------------------------------------- helpers


def _draw(rng, shape, dtype):
    """Standard normal in `dtype`, and the same (rounded) values as float64."""
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    return x, np.asarray(x.astype(jnp.float32), np.float64)


def _segments(rng, B, S):
    """Per-batch-element segment ids: sorted runs, different for each row, with a
    padding run (-1) in the middle of the last row."""
    ids = np.sort(rng.integers(0, 3, size=(B, S)), axis=1).astype(np.int32)
    ids[0] = np.sort(rng.integers(0, 4, size=S))
    ids[-1, S // 3: S // 3 + 3] = -1
    return ids


def _inputs(B, S, H, H_kv, D, dtype=jnp.float32, seed=0, sinks=False):
    rng = np.random.default_rng(seed)
    j, n = {}, {}
    for name, shape in (("q", (B, S, H, D)), ("k", (B, S, H_kv, D)), ("v", (B, S, H_kv, D)),
                        ("dout", (B, S, H, D))):
        j[name], n[name] = _draw(rng, shape, dtype)
    if sinks:
        j["sinks"], n["sinks"] = _draw(rng, (H,), jnp.float32)
    return rng, j, n


def _run(f, diff, nondiff, dout, repeat=1):
    """`jax.vjp` of `f(*diff, *nondiff)` w.r.t. `diff`, under one `jax.jit`; with
    `repeat > 1`, a list of the results of that many calls of the compiled function."""

    @jax.jit
    def run(diff, nondiff, dout):
        out, vjp = jax.vjp(lambda *d: f(*d, *nondiff), *diff)
        return out, vjp(dout)

    res = [jax.tree.map(np.asarray, run(diff, nondiff, dout)) for _ in range(repeat)]
    return res[0] if repeat == 1 else res


def _check(out, grads, ref, dtype, names=("dq", "dk", "dv", "dsinks")):
    assert np.all(np.isfinite(out))
    oracle.assert_close(out, ref.out, dtype, "out")
    for name, got in zip(names, grads):
        want = getattr(ref, name)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        assert np.all(np.isfinite(got)), f"{name} has non-finite values"
        oracle.assert_close(got, want, dtype, name)


def _ulysses(mesh, spec, **opts):
    """Global `(q, k, v[, sinks][, segment_ids])` -> global out, through shard_map."""
    has_sinks = "sinks" in opts
    has_seg = "segment_ids" in opts
    opts = {k: v for k, v in opts.items() if k not in ("sinks", "segment_ids")}

    def local(q, k, v, *rest):
        rest = list(rest)
        kw = dict(opts)
        if has_sinks:
            kw["sinks"] = rest.pop(0)
        if has_seg:
            kw["segment_ids"] = rest.pop(0)
        return sequence_parallel_self_attention(q, k, v, SP_AXIS, **kw)

    in_specs = (spec, spec, spec) + ((P(),) if has_sinks else ()) + ((spec,) if has_seg else ())
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=spec)


# ---------------------------------------------------------------------- plain Ulysses


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sp", [2, 4, 8])
def test_matches_oracle(sp, causal):
    """GQA with H_kv=4: no repetition for sp 2 and 4, repetition x2 for sp 8."""
    B, S, H, H_kv, D = 2, 32, 8, 4, 16
    _, j, n = _inputs(B, S, H, H_kv, D, seed=sp)
    f = _ulysses(make_mesh(sp=sp), P(None, SP_AXIS), causal=causal)
    out, grads = _run(f, (j["q"], j["k"], j["v"]), (), j["dout"])
    ref = oracle.attention(n["q"], n["k"], n["v"], causal=causal, dout=n["dout"])
    _check(out, grads, ref, np.float32)


def test_mqa_repeats_kv_heads_with_sinks():
    """H_kv=1 over sp=4 repeats the one kv head 4 times; sinks and their gradient."""
    B, S, H, H_kv, D = 2, 32, 8, 1, 16
    assert kv_head_repeats(H, H_kv, 4) == 4
    _, j, n = _inputs(B, S, H, H_kv, D, seed=1, sinks=True)
    f = _ulysses(make_mesh(sp=4), P(None, SP_AXIS), causal=True, sinks=True)
    out, grads = _run(f, (j["q"], j["k"], j["v"], j["sinks"]), (), j["dout"])
    ref = oracle.attention(n["q"], n["k"], n["v"], sinks=n["sinks"], causal=True, dout=n["dout"])
    _check(out, grads, ref, np.float32)


@pytest.mark.parametrize(
    "H, H_kv, sp, r",
    [(8, 8, 8, 1), (8, 4, 4, 1), (8, 4, 8, 2), (8, 2, 4, 2), (8, 1, 4, 4), (12, 6, 4, 2),
     (12, 3, 4, 4), (24, 6, 4, 2), (8, 1, 8, 8)],
)
def test_kv_head_repeats_is_minimal(H, H_kv, sp, r):
    assert kv_head_repeats(H, H_kv, sp) == r
    assert (H_kv * r) % sp == 0 and H % (H_kv * r) == 0
    assert all((H_kv * s) % sp or H % (H_kv * s) for s in range(1, r))


def test_segments_per_batch_sinks_window_softcap():
    """Segment ids that differ per batch element (with padding inside a row), sinks,
    a sliding window, a soft cap and a custom scale, GQA needing repetition."""
    B, S, H, H_kv, D = 2, 48, 8, 2, 16
    rng, j, n = _inputs(B, S, H, H_kv, D, seed=2, sinks=True)
    seg = _segments(rng, B, S)
    assert not np.array_equal(seg[0], seg[1])
    static = dict(causal=True, window=(9, 0), logits_soft_cap=4.0, scale=0.3)
    f = _ulysses(make_mesh(sp=8), P(None, SP_AXIS), sinks=True, segment_ids=True, **static)
    out, grads = _run(f, (j["q"], j["k"], j["v"], j["sinks"]), (jnp.asarray(seg),), j["dout"])
    ref = oracle.attention(n["q"], n["k"], n["v"], sinks=n["sinks"], segment_ids=seg,
                           dout=n["dout"], **static)
    _check(out, grads, ref, np.float32)


def test_segment_ids_pair():
    """`SegmentIds(q=..., kv=...)` is gathered field by field."""
    B, S, H, H_kv, D = 2, 32, 4, 4, 8
    rng, j, n = _inputs(B, S, H, H_kv, D, seed=3)
    seg_q, seg_kv = _segments(rng, B, S), _segments(rng, B, S)
    spec = P(None, SP_AXIS)

    def local(q, k, v, sq, skv):
        return sequence_parallel_self_attention(
            q, k, v, SP_AXIS, segment_ids=kernels.SegmentIds(q=sq, kv=skv))

    f = jax.shard_map(local, mesh=make_mesh(sp=4), in_specs=(spec,) * 5, out_specs=spec)
    out, grads = _run(f, (j["q"], j["k"], j["v"]), (jnp.asarray(seg_q), jnp.asarray(seg_kv)),
                      j["dout"])
    ref = oracle.attention(n["q"], n["k"], n["v"], segment_ids=(seg_q, seg_kv), dout=n["dout"])
    _check(out, grads, ref, np.float32)


def test_bfloat16():
    B, S, H, H_kv, D = 2, 32, 8, 2, 16
    rng, j, n = _inputs(B, S, H, H_kv, D, dtype=jnp.bfloat16, seed=4, sinks=True)
    seg = _segments(rng, B, S)
    f = _ulysses(make_mesh(sp=4), P(None, SP_AXIS), causal=True, sinks=True, segment_ids=True)
    out, grads = _run(f, (j["q"], j["k"], j["v"], j["sinks"]), (jnp.asarray(seg),), j["dout"])
    assert out.dtype == jnp.bfloat16 and grads[0].dtype == jnp.bfloat16
    ref = oracle.attention(n["q"], n["k"], n["v"], sinks=n["sinks"], segment_ids=seg,
                           causal=True, dout=n["dout"])
    _check(out, grads, ref, jnp.bfloat16)


def test_data_and_sequence_parallel():
    """A (dp=2, sp=4) mesh: batch over dp, sequence over sp; sinks replicated."""
    B, S, H, H_kv, D = 2, 32, 4, 1, 8
    rng, j, n = _inputs(B, S, H, H_kv, D, seed=5, sinks=True)
    seg = _segments(rng, B, S)
    f = _ulysses(make_mesh(dp=2, sp=4), P(DP_AXIS, SP_AXIS), causal=True, sinks=True,
                 segment_ids=True)
    out, grads = _run(f, (j["q"], j["k"], j["v"], j["sinks"]), (jnp.asarray(seg),), j["dout"])
    ref = oracle.attention(n["q"], n["k"], n["v"], sinks=n["sinks"], segment_ids=seg,
                           causal=True, dout=n["dout"])
    _check(out, grads, ref, np.float32)


@pytest.mark.parametrize(
    "check_vma",
    [True, False],
    ids=["checked", "unchecked"],
)
def test_blockwise_implementation_and_determinism(check_vma):
    """Kernel options pass through (`implementation`); repeated runs are bitwise equal."""
    B, S, H, H_kv, D = 1, 64, 4, 2, 16
    _, j, n = _inputs(B, S, H, H_kv, D, seed=6)
    impl = kernels.Blockwise(block_q=16, block_kv=16)
    spec = P(None, SP_AXIS)
    f = jax.shard_map(
        lambda q, k, v: sequence_parallel_self_attention(q, k, v, SP_AXIS, causal=True,
                                                         implementation=impl),
        mesh=make_mesh(sp=2), in_specs=(spec,) * 3, out_specs=spec, check_vma=check_vma)
    (out, grads), (out2, grads2) = _run(f, (j["q"], j["k"], j["v"]), (), j["dout"], repeat=2)
    ref = oracle.attention(n["q"], n["k"], n["v"], causal=True, dout=n["dout"])
    _check(out, grads, ref, np.float32)
    np.testing.assert_array_equal(out, out2)
    for a, b in zip(grads, grads2):
        np.testing.assert_array_equal(a, b)


def test_local_positions_are_gathered():
    """Per-device `q_positions` / `kv_positions` are gathered along the sequence:
    reversed global positions turn `causal` into 'see only later tokens'."""
    B, S, H, H_kv, D = 1, 32, 4, 4, 8
    _, j, n = _inputs(B, S, H, H_kv, D, seed=7)
    pos = jnp.arange(S, dtype=jnp.int32)[::-1]
    spec = P(None, SP_AXIS)

    def local(q, k, v, p):
        return sequence_parallel_self_attention(q, k, v, SP_AXIS, causal=True, q_positions=p,
                                                kv_positions=p)

    f = jax.shard_map(local, mesh=make_mesh(sp=4), in_specs=(spec, spec, spec, P(SP_AXIS)),
                      out_specs=spec)
    out, grads = _run(f, (j["q"], j["k"], j["v"]), (pos,), j["dout"])
    ref = oracle.attention(n["q"], n["k"], n["v"], causal=True, q_positions=np.asarray(pos),
                           kv_positions=np.asarray(pos), dout=n["dout"])
    _check(out, grads, ref, np.float32)


def test_head_bias_is_sliced():
    """A replicated bias over the whole sequence with a full head axis: each device
    uses its heads; the bias gradient is the single-device one."""
    B, S, H, H_kv, D = 1, 16, 4, 2, 8
    rng, j, n = _inputs(B, S, H, H_kv, D, seed=8)
    jb, nb = _draw(rng, (1, H, S, S), jnp.float32)
    spec = P(None, SP_AXIS)

    def local(q, k, v, b):
        return sequence_parallel_self_attention(q, k, v, SP_AXIS, bias=b)

    f = jax.shard_map(local, mesh=make_mesh(sp=2), in_specs=(spec, spec, spec, P()),
                      out_specs=spec)
    out, grads = _run(f, (j["q"], j["k"], j["v"], jb), (), j["dout"])
    ref = oracle.attention(n["q"], n["k"], n["v"], bias=nb, dout=n["dout"])
    _check(out, grads, ref, np.float32, names=("dq", "dk", "dv", "dbias"))


def test_unchecked_shard_map():
    """`check_vma=False` gives the same numbers (the vma casts are skipped there)."""
    B, S, H, H_kv, D = 1, 16, 4, 1, 8
    _, j, n = _inputs(B, S, H, H_kv, D, seed=9, sinks=True)
    spec = P(None, SP_AXIS)

    def local(q, k, v, s):
        return sequence_parallel_self_attention(q, k, v, SP_AXIS, sinks=s, causal=True)

    f = jax.shard_map(local, mesh=make_mesh(sp=4), in_specs=(spec, spec, spec, P()),
                      out_specs=spec, check_vma=False)
    out, grads = _run(f, (j["q"], j["k"], j["v"], j["sinks"]), (), j["dout"])
    ref = oracle.attention(n["q"], n["k"], n["v"], sinks=n["sinks"], causal=True, dout=n["dout"])
    _check(out, grads, ref, np.float32)


# -------------------------------------------------------- any token count: the recipe


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_padding_recipe(causal):
    """30 tokens over 4 devices: pad to 32, hide the padding with segment ids, unpad.
    Output and gradients of all 30 real tokens equal the unpadded single-device ones
    (no token dropped, none leaked), with the user's own per-batch segment ids kept."""
    B, S, H, H_kv, D, sp = 2, 30, 4, 2, 8, 4
    rng, j, n = _inputs(B, S, H, H_kv, D, seed=10, sinks=True)
    user_seg = _segments(rng, B, S)
    mesh = make_mesh(sp=sp)
    spec = P(None, SP_AXIS)

    def local(q, k, v, s, seg):
        return sequence_parallel_self_attention(q, k, v, SP_AXIS, sinks=s, segment_ids=seg,
                                                causal=causal)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, P(), spec),
                            out_specs=spec)

    def f(q, k, v, sinks, user_seg):
        qp, kp, vp = (pad_to_multiple(x, sp, axis=1) for x in (q, k, v))
        seg = padding_segment_ids(S, sp, batch=B, segment_ids=user_seg)
        assert qp.shape[1] == 32 and seg.shape == (B, 32)
        return unpad(sharded(qp, kp, vp, sinks, seg), S, axis=1)

    out, grads = _run(f, (j["q"], j["k"], j["v"], j["sinks"]), (jnp.asarray(user_seg),),
                      j["dout"])
    assert out.shape == (B, S, H, D)
    ref = oracle.attention(n["q"], n["k"], n["v"], sinks=n["sinks"], segment_ids=user_seg,
                           causal=causal, dout=n["dout"])
    _check(out, grads, ref, np.float32)


# ------------------------------------------------------------------------- joint layout


def _joint_case(B, T, L, H, H_kv, D, sp, seed, sinks=False, segments=False, dtype=jnp.float32):
    """Global text `(B, T, ...)` and visual `(B, L, ...)` inputs, the per-device layout
    `concat_i [text; visual chunk i]` as one global array sharded over sp, and a random
    cotangent for every device's copy of the text rows."""
    rng = np.random.default_rng(seed)
    Ll = L // sp
    j, n = {}, {}
    for name, h in (("q", H), ("k", H_kv), ("v", H_kv)):
        jt, nt = _draw(rng, (B, T, h, D), dtype)
        jv, nv = _draw(rng, (B, L, h, D), dtype)
        j[name] = jnp.concatenate(
            [jnp.concatenate([jt, jv[:, i * Ll:(i + 1) * Ll]], axis=1) for i in range(sp)], 1)
        n[name] = np.concatenate([nt, nv], axis=1)
    jd, nd = _draw(rng, (B, sp, T + Ll, H, D), dtype)
    j["dout"] = jd.reshape(B, sp * (T + Ll), H, D)
    # The single-device cotangent: the text copies' cotangents summed, the visual
    # chunks concatenated.
    n["dout"] = np.concatenate([nd[:, :, :T].sum(1), nd[:, :, T:].reshape(B, L, H, D)], axis=1)
    if sinks:
        j["sinks"], n["sinks"] = _draw(rng, (H,), jnp.float32)
    if segments:
        seg_t = rng.integers(0, 2, size=(B, T)).astype(np.int32)
        seg_v = _segments(rng, B, L)
        n["seg"] = np.concatenate([seg_t, seg_v], axis=1)
        j["seg"] = jnp.asarray(np.concatenate(
            [np.concatenate([seg_t, seg_v[:, i * Ll:(i + 1) * Ll]], 1) for i in range(sp)], 1))
    return j, n


def _split_joint(x, B, T, sp):
    """Global per-device layout -> (text rows per device (B, sp, T, ...), visual (B, L, ...))."""
    x = np.asarray(x, np.float64)
    blocks = x.reshape(B, sp, -1, *x.shape[2:])
    return blocks[:, :, :T], blocks[:, :, T:].reshape(B, -1, *x.shape[2:])


def _check_joint(out, grads, ref, B, T, sp, dtype, dsinks=None):
    out_t, out_v = _split_joint(out, B, T, sp)
    for i in range(sp):  # identical on every device and equal to single-device
        np.testing.assert_array_equal(out_t[:, i], out_t[:, 0])
        oracle.assert_close(out_t[:, i], ref.out[:, :T], dtype, f"text out, device {i}")
    oracle.assert_close(out_v, ref.out[:, T:], dtype, "visual out")
    for name, g in zip(("dq", "dk", "dv"), grads):
        g_t, g_v = _split_joint(g, B, T, sp)
        assert np.all(np.isfinite(g_t)) and np.all(np.isfinite(g_v))
        # The gradient of the (replicated) text is the sum over its copies.
        oracle.assert_close(np.concatenate([g_t.sum(1), g_v], 1), getattr(ref, name), dtype, name)
    if dsinks is not None:
        oracle.assert_close(dsinks, ref.dsinks, dtype, "dsinks")


@pytest.mark.parametrize(
    "sp, T, H_kv, causal",
    [(2, 5, 4, False), (4, 5, 1, True), (8, 5, 4, True), (4, 0, 2, False)],
)
def test_joint_matches_oracle(sp, T, H_kv, causal):
    B, L, H, D = 2, 32, 8, 16
    j, n = _joint_case(B, T, L, H, H_kv, D, sp, seed=20 + sp + T, sinks=True)
    spec = P(None, SP_AXIS)

    def local(q, k, v, s):
        return sequence_parallel_joint_self_attention(q, k, v, T, SP_AXIS, sinks=s, causal=causal)

    f = jax.shard_map(local, mesh=make_mesh(sp=sp), in_specs=(spec, spec, spec, P()),
                      out_specs=spec)
    out, grads = _run(f, (j["q"], j["k"], j["v"], j["sinks"]), (), j["dout"])
    ref = oracle.attention(n["q"], n["k"], n["v"], sinks=n["sinks"], causal=causal,
                           dout=n["dout"])
    _check_joint(out, grads[:3], ref, B, T, sp, np.float32, dsinks=grads[3])


def test_joint_segments_bfloat16():
    B, T, L, H, H_kv, D, sp = 2, 5, 32, 8, 2, 16, 4
    j, n = _joint_case(B, T, L, H, H_kv, D, sp, seed=30, segments=True, dtype=jnp.bfloat16)
    spec = P(None, SP_AXIS)

    def local(q, k, v, seg):
        return sequence_parallel_joint_self_attention(q, k, v, T, SP_AXIS, segment_ids=seg)

    f = jax.shard_map(local, mesh=make_mesh(sp=sp), in_specs=(spec,) * 4, out_specs=spec)
    out, grads = _run(f, (j["q"], j["k"], j["v"]), (j["seg"],), j["dout"])
    assert out.dtype == jnp.bfloat16
    ref = oracle.attention(n["q"], n["k"], n["v"], segment_ids=n["seg"], dout=n["dout"])
    _check_joint(out, grads, ref, B, T, sp, jnp.bfloat16)


def test_joint_text_only():
    """`text_len` equal to the per-device length: no visual tokens, text attends to itself."""
    B, T, H, D, sp = 1, 6, 4, 8, 2
    j, n = _joint_case(B, T, 0, H, 2, D, sp, seed=31)
    spec = P(None, SP_AXIS)
    f = jax.shard_map(lambda q, k, v: sequence_parallel_joint_self_attention(q, k, v, T, SP_AXIS),
                      mesh=make_mesh(sp=sp), in_specs=(spec,) * 3, out_specs=spec)
    out, grads = _run(f, (j["q"], j["k"], j["v"]), (), j["dout"])
    ref = oracle.attention(n["q"], n["k"], n["v"], dout=n["dout"])
    _check_joint(out, grads, ref, B, T, sp, np.float32)


def test_joint_padding_recipe(causal=True):
    """Text 5 + 30 visual tokens over 4 devices: the visual sequence is padded to 32,
    padding gets segment id -1 (text and real visual 0), and is dropped after."""
    B, T, L, H, H_kv, D, sp = 2, 5, 30, 4, 1, 8, 4
    rng = np.random.default_rng(40)
    jt = {x: _draw(rng, (B, T, h, D), jnp.float32) for x, h in (("q", H), ("k", H_kv), ("v", H_kv))}
    jv = {x: _draw(rng, (B, L, h, D), jnp.float32) for x, h in (("q", H), ("k", H_kv), ("v", H_kv))}
    dout_t, n_dout_t = _draw(rng, (B, T, H, D), jnp.float32)
    dout_v, n_dout_v = _draw(rng, (B, L, H, D), jnp.float32)
    Lp = L + (-L % sp)
    Ll = Lp // sp
    spec = P(None, SP_AXIS)

    def local(q, k, v, seg):
        return sequence_parallel_joint_self_attention(q, k, v, T, SP_AXIS, segment_ids=seg,
                                                      causal=causal)

    sharded = jax.shard_map(local, mesh=make_mesh(sp=sp), in_specs=(spec,) * 4, out_specs=spec)

    def to_devices(text, visual):
        """(B, T, ...), (B, Lp, ...) -> concat_i [text; visual chunk i]."""
        return jnp.concatenate(
            [jnp.concatenate([text, visual[:, i * Ll:(i + 1) * Ll]], 1) for i in range(sp)], 1)

    def f(qt, kt, vt, qv, kv, vv):
        vis_seg = padding_segment_ids(L, sp, batch=B)  # (B, 32), -1 on padding
        seg = to_devices(jnp.zeros((B, T), jnp.int32), vis_seg)
        args = [to_devices(t, pad_to_multiple(x, sp, axis=1))
                for t, x in ((qt, qv), (kt, kv), (vt, vv))]
        out = sharded(*args, seg).reshape(B, sp, T + Ll, H, D)
        # One device's text rows (all are equal), and the visual rows unpadded.
        return out[:, 0, :T], unpad(out[:, :, T:].reshape(B, Lp, H, D), L, axis=1)

    diff = tuple(jt[x][0] for x in "qkv") + tuple(jv[x][0] for x in "qkv")
    (out_t, out_v), grads = _run(f, diff, (), (dout_t, dout_v))
    ref = oracle.attention(*(np.concatenate([jt[x][1], jv[x][1]], 1) for x in "qkv"),
                           causal=causal, dout=np.concatenate([n_dout_t, n_dout_v], 1))
    oracle.assert_close(out_t, ref.out[:, :T], np.float32, "text out")
    oracle.assert_close(out_v, ref.out[:, T:], np.float32, "visual out")
    for i, name in enumerate(("dq", "dk", "dv")):
        got = np.concatenate([grads[i], grads[i + 3]], axis=1)
        oracle.assert_close(got, getattr(ref, name), np.float32, name)


# ------------------------------------------------------------------------------ errors


def _shard(fn, sp=4, n_in=3, spec=P(None, SP_AXIS)):
    return jax.shard_map(fn, mesh=make_mesh(sp=sp), in_specs=(spec,) * n_in, out_specs=spec)


def test_heads_not_divisible_raises():
    q = jnp.ones((1, 8, 6, 4))
    with pytest.raises(ValueError, match=r"H=6.*sp=4"):
        _shard(lambda q, k, v: sequence_parallel_self_attention(q, k, v, SP_AXIS))(q, q, q)
    with pytest.raises(ValueError, match=r"H=6.*sp=4"):
        _shard(lambda q, k, v: sequence_parallel_joint_self_attention(q, k, v, 0, SP_AXIS))(q, q, q)


def test_missing_axis_raises():
    q = jnp.ones((1, 8, 4, 4))
    with pytest.raises(ValueError, match="'sp' does not exist"):
        sequence_parallel_self_attention(q, q, q, SP_AXIS)
    with pytest.raises(ValueError, match="'sp' does not exist"):
        sequence_parallel_joint_self_attention(q, q, q, 2, SP_AXIS)
    with pytest.raises(ValueError, match="'ring' does not exist"):
        _shard(lambda q, k, v: sequence_parallel_self_attention(q, k, v, "ring"))(q, q, q)


@pytest.mark.parametrize("text_len", [-1, 3, 2.0])
def test_bad_text_len_raises(text_len):
    q = jnp.ones((1, 8, 4, 4))  # 2 tokens per device over sp=4
    with pytest.raises(ValueError, match="text_len"):
        _shard(lambda q, k, v: sequence_parallel_joint_self_attention(q, k, v, text_len, SP_AXIS))(
            q, q, q)


def test_bad_shapes_raise():
    q = jnp.ones((1, 8, 4, 4))
    k3 = jnp.ones((1, 8, 3, 4))
    with pytest.raises(ValueError, match="GQA"):
        _shard(lambda q, k, v: sequence_parallel_self_attention(q, k, v, SP_AXIS))(q, k3, k3)
    with pytest.raises(ValueError, match="segment_ids"):
        _shard(lambda q, k, v: sequence_parallel_self_attention(
            q, k, v, SP_AXIS, segment_ids=jnp.zeros((1, 8), jnp.int32)))(q, q, q)
    with pytest.raises(ValueError, match="sinks"):
        _shard(lambda q, k, v: sequence_parallel_self_attention(
            q, k, v, SP_AXIS, sinks=jnp.zeros((2,))))(q, q, q)


def test_local_bias_raises():
    """A bias over the local chunk cannot be expressed after the all_to_all."""
    q = jnp.ones((1, 8, 4, 4))
    with pytest.raises(ValueError, match="bias"):
        _shard(lambda q, k, v: sequence_parallel_self_attention(
            q, k, v, SP_AXIS, bias=jnp.zeros((1, 4, 2, 2))))(q, q, q)
