"""Ulysses sequence parallelism against the float64 oracle on the unsharded arrays.

Every test shards the global arrays over a mesh of simulated CPU devices with
`jax.shard_map(..., in_specs=P(None, "sp"), out_specs=P(None, "sp"))` (the
default `check_vma=True`), and compares the output and the gradients of q, k, v
(and sinks / bias) from `jax.vjp` with a random cotangent against
`oracle.attention` on the full, unsharded inputs (`harness.check_sharded`). The joint
layout runs through `harness.joint_vjp`: the text prefix replicated, put before every
device's chunk inside `shard_map`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import oracle
from vidax_eqx import kernels
from vidax_eqx.parallel import (
    DP_AXIS,
    kv_head_repeats,
    pad_to_multiple,
    padding_segment_ids,
    sequence_parallel_joint_self_attention,
    sequence_parallel_self_attention,
    SP_AXIS,
    unpad,
)


# ---------------------------------------------------------------------------- helpers


SEQ = P(None, SP_AXIS)


def _segments(rng, B, S):
    """Per-batch-element segment ids (`harness.segment_ids`: sorted runs, ids in random
    order), different for each row, with a padding run (-1) in the middle of the last row."""
    ids = harness.segment_ids(rng, B, S, pad=(0, 0))
    ids[-1, S // 3: S // 3 + 3] = -1
    return ids


def _ulysses(spec=SEQ, **opts):
    """`(local, in_specs)`: `local(q, k, v[, sinks][, segment_ids])` runs Ulysses inside
    `shard_map`, the arrays placed by `spec`, sinks replicated."""
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
    return local, in_specs


def _qkv(a):
    return a["q"], a["k"], a["v"]


# ---------------------------------------------------------------------- plain Ulysses


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sp", [2, 4, 8])
def test_matches_oracle(sp, causal):
    """GQA with H_kv=4: no repetition for sp 2 and 4, repetition x2 for sp 8."""
    B, S, H, H_kv, D = 2, 32, 8, 4, 16
    a = harness.attention_inputs(B, S, H, D, H_kv=H_kv, seed=sp)
    local, specs = _ulysses(causal=causal)
    ref = oracle.attention(*_qkv(a), causal=causal, dout=a["dout"])
    harness.check_sharded(local, harness.mesh(sp=sp), specs, SEQ, _qkv(a), a["dout"], ref=ref)


def test_mqa_repeats_kv_heads_with_sinks():
    """H_kv=1 over sp=4 repeats the one kv head 4 times; sinks and their gradient."""
    B, S, H, H_kv, D = 2, 32, 8, 1, 16
    assert kv_head_repeats(H, H_kv, 4) == 4
    a = harness.attention_inputs(B, S, H, D, H_kv=H_kv, seed=1, sinks=True)
    local, specs = _ulysses(causal=True, sinks=True)
    ref = oracle.attention(*_qkv(a), sinks=a["sinks"], causal=True, dout=a["dout"])
    harness.check_sharded(local, harness.mesh(sp=4), specs, SEQ, (*_qkv(a), a["sinks"]),
                          a["dout"], ref=ref)


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
    rng = np.random.default_rng(2)
    a = harness.attention_inputs(B, S, H, D, H_kv=H_kv, rng=rng, sinks=True)
    seg = _segments(rng, B, S)
    assert not np.array_equal(seg[0], seg[1])
    static = dict(causal=True, window=(9, 0), logits_soft_cap=4.0, scale=0.3)
    local, specs = _ulysses(sinks=True, segment_ids=True, **static)
    ref = oracle.attention(*_qkv(a), sinks=a["sinks"], segment_ids=seg, dout=a["dout"], **static)
    harness.check_sharded(local, harness.mesh(sp=8), specs, SEQ, (*_qkv(a), a["sinks"], seg),
                          a["dout"], argnums=(0, 1, 2, 3), ref=ref)


def test_segment_ids_pair():
    """`SegmentIds(q=..., kv=...)` is gathered field by field."""
    B, S, H, H_kv, D = 2, 32, 4, 4, 8
    rng = np.random.default_rng(3)
    a = harness.attention_inputs(B, S, H, D, H_kv=H_kv, rng=rng)
    seg_q, seg_kv = _segments(rng, B, S), _segments(rng, B, S)

    def local(q, k, v, sq, skv):
        return sequence_parallel_self_attention(
            q, k, v, SP_AXIS, segment_ids=kernels.SegmentIds(q=sq, kv=skv))

    ref = oracle.attention(*_qkv(a), segment_ids=(seg_q, seg_kv), dout=a["dout"])
    harness.check_sharded(local, harness.mesh(sp=4), (SEQ,) * 5, SEQ, (*_qkv(a), seg_q, seg_kv),
                          a["dout"], argnums=(0, 1, 2), ref=ref)


def test_bfloat16():
    B, S, H, H_kv, D = 2, 32, 8, 2, 16
    rng = np.random.default_rng(4)
    a = harness.attention_inputs(B, S, H, D, H_kv=H_kv, dtype=jnp.bfloat16, rng=rng, sinks=True)
    seg = _segments(rng, B, S)
    local, specs = _ulysses(causal=True, sinks=True, segment_ids=True)
    ref = oracle.attention(*_qkv(a), sinks=a["sinks"], segment_ids=seg, causal=True,
                           dout=a["dout"])
    out, grads = harness.check_sharded(local, harness.mesh(sp=4), specs, SEQ,
                                       (*_qkv(a), a["sinks"], seg), a["dout"],
                                       argnums=(0, 1, 2, 3), ref=ref, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16 and grads[0].dtype == jnp.bfloat16


def test_data_and_sequence_parallel():
    """A (dp=2, sp=4) mesh: batch over dp, sequence over sp; sinks replicated."""
    B, S, H, H_kv, D = 2, 32, 4, 1, 8
    rng = np.random.default_rng(5)
    a = harness.attention_inputs(B, S, H, D, H_kv=H_kv, rng=rng, sinks=True)
    seg = _segments(rng, B, S)
    spec = P(DP_AXIS, SP_AXIS)
    local, specs = _ulysses(spec, causal=True, sinks=True, segment_ids=True)
    ref = oracle.attention(*_qkv(a), sinks=a["sinks"], segment_ids=seg, causal=True,
                           dout=a["dout"])
    harness.check_sharded(local, harness.mesh(dp=2, sp=4), specs, spec,
                          (*_qkv(a), a["sinks"], seg), a["dout"], argnums=(0, 1, 2, 3), ref=ref)


@pytest.mark.parametrize(
    "check_vma",
    [True, False],
    ids=["checked", "unchecked"],
)
def test_blockwise_implementation_and_determinism(check_vma):
    """Kernel options pass through (`implementation`); repeated runs are bitwise equal."""
    B, S, H, H_kv, D = 1, 64, 4, 2, 16
    a = harness.attention_inputs(B, S, H, D, H_kv=H_kv, seed=6)
    impl = kernels.Blockwise(block_q=16, block_kv=16)
    local = lambda q, k, v: sequence_parallel_self_attention(  # noqa: E731
        q, k, v, SP_AXIS, causal=True, implementation=impl)
    run = harness.sharded_vjp(local, harness.mesh(sp=2), (SEQ,) * 3, SEQ, check_vma=check_vma)
    (out, grads), (out2, grads2) = (run(*_qkv(a), a["dout"]) for _ in range(2))
    ref = oracle.attention(*_qkv(a), causal=True, dout=a["dout"])
    harness.assert_matches(harness.named(out, grads), ref, np.float32)
    np.testing.assert_array_equal(out, out2)
    for x, y in zip(grads, grads2):
        np.testing.assert_array_equal(x, y)


def test_local_positions_are_gathered():
    """Per-device `q_positions` / `kv_positions` are gathered along the sequence:
    reversed global positions turn `causal` into 'see only later tokens'."""
    B, S, H, H_kv, D = 1, 32, 4, 4, 8
    a = harness.attention_inputs(B, S, H, D, H_kv=H_kv, seed=7)
    pos = np.arange(S, dtype=np.int32)[::-1]

    def local(q, k, v, p):
        return sequence_parallel_self_attention(q, k, v, SP_AXIS, causal=True, q_positions=p,
                                                kv_positions=p)

    ref = oracle.attention(*_qkv(a), causal=True, q_positions=pos, kv_positions=pos,
                           dout=a["dout"])
    harness.check_sharded(local, harness.mesh(sp=4), (SEQ, SEQ, SEQ, P(SP_AXIS)), SEQ,
                          (*_qkv(a), pos), a["dout"], argnums=(0, 1, 2), ref=ref)


def test_head_bias_is_sliced():
    """A replicated bias over the whole sequence with a full head axis: each device
    uses its heads; the bias gradient is the single-device one."""
    B, S, H, H_kv, D = 1, 16, 4, 2, 8
    rng = np.random.default_rng(8)
    a = harness.attention_inputs(B, S, H, D, H_kv=H_kv, rng=rng)
    bias = harness.normal(rng, (1, H, S, S))

    def local(q, k, v, b):
        return sequence_parallel_self_attention(q, k, v, SP_AXIS, bias=b)

    ref = oracle.attention(*_qkv(a), bias=bias, dout=a["dout"])
    harness.check_sharded(local, harness.mesh(sp=2), (SEQ, SEQ, SEQ, P()), SEQ,
                          (*_qkv(a), bias), a["dout"], ref=ref,
                          names=("out", "dq", "dk", "dv", "dbias"))


def test_unchecked_shard_map():
    """`check_vma=False` gives the same numbers (the vma casts are skipped there)."""
    B, S, H, H_kv, D = 1, 16, 4, 1, 8
    a = harness.attention_inputs(B, S, H, D, H_kv=H_kv, seed=9, sinks=True)

    def local(q, k, v, s):
        return sequence_parallel_self_attention(q, k, v, SP_AXIS, sinks=s, causal=True)

    ref = oracle.attention(*_qkv(a), sinks=a["sinks"], causal=True, dout=a["dout"])
    harness.check_sharded(local, harness.mesh(sp=4), (SEQ, SEQ, SEQ, P()), SEQ,
                          (*_qkv(a), a["sinks"]), a["dout"], ref=ref, check_vma=False)


# -------------------------------------------------------- any token count: the recipe


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_padding_recipe(causal):
    """30 tokens over 4 devices: pad to 32, hide the padding with segment ids, unpad.
    Output and gradients of all 30 real tokens equal the unpadded single-device ones
    (no token dropped, none leaked), with the user's own per-batch segment ids kept."""
    B, S, H, H_kv, D, sp = 2, 30, 4, 2, 8, 4
    rng = np.random.default_rng(10)
    a = harness.attention_inputs(B, S, H, D, H_kv=H_kv, rng=rng, sinks=True)
    user_seg = _segments(rng, B, S)

    def local(q, k, v, s, seg):
        return sequence_parallel_self_attention(q, k, v, SP_AXIS, sinks=s, segment_ids=seg,
                                                causal=causal)

    sharded = jax.shard_map(local, mesh=harness.mesh(sp=sp), in_specs=(SEQ, SEQ, SEQ, P(), SEQ),
                            out_specs=SEQ)

    def f(q, k, v, sinks, user_seg):
        qp, kp, vp = (pad_to_multiple(x, sp, axis=1) for x in (q, k, v))
        seg = padding_segment_ids(S, sp, batch=B, segment_ids=user_seg)
        assert qp.shape[1] == 32 and seg.shape == (B, 32)
        return unpad(sharded(qp, kp, vp, sinks, seg), S, axis=1)

    out, grads = harness.vjp(f, (0, 1, 2, 3))(*_qkv(a), a["sinks"], user_seg, a["dout"])
    assert out.shape == (B, S, H, D)
    ref = oracle.attention(*_qkv(a), sinks=a["sinks"], segment_ids=user_seg, causal=causal,
                           dout=a["dout"])
    harness.assert_matches(harness.named(out, grads), ref, np.float32,
                           harness.ATTENTION_NAMES + ("dsinks",))


# ------------------------------------------------------------------------- joint layout


def _check_joint(local, sp, T, a, ref, dtype=np.float32, segments=False, sinks=False):
    """`local(q, k, v, seg, sinks)` on the joint layout (`harness.joint_vjp`) of the
    global arrays `a` over `[text (T); visual]` against `ref`: the text rows of every
    device bitwise equal, and equal to the single-device ones; the text gradients (the
    sum over the copies) and the visual ones."""
    seg = "one" if segments else None
    fn = harness.joint_vjp(local, harness.mesh(sp=sp), SP_AXIS, segments=seg, sinks=sinks)
    got = harness.run_joint(fn, a, sp, T, segments=seg, sinks=sinks)
    harness.assert_copies_equal(got["out_text"])
    names = harness.ATTENTION_NAMES + (("dsinks",) if sinks else ())
    harness.assert_matches(got, ref, dtype, names)
    return got


@pytest.mark.parametrize(
    "sp, T, H_kv, causal",
    [(2, 5, 4, False), (4, 5, 1, True), (8, 5, 4, True), (4, 0, 2, False)],
)
def test_joint_matches_oracle(sp, T, H_kv, causal):
    B, L, H, D = 2, 32, 8, 16
    a = harness.attention_inputs(B, T + L, H, D, H_kv=H_kv, seed=20 + sp + T, sinks=True)

    def local(q, k, v, seg, s):
        return sequence_parallel_joint_self_attention(q, k, v, T, SP_AXIS, sinks=s, causal=causal)

    ref = oracle.attention(*_qkv(a), sinks=a["sinks"], causal=causal, dout=a["dout"])
    _check_joint(local, sp, T, a, ref, sinks=True)


def test_joint_segments_bfloat16():
    B, T, L, H, H_kv, D, sp = 2, 5, 32, 8, 2, 16, 4
    rng = np.random.default_rng(30)
    a = harness.attention_inputs(B, T + L, H, D, H_kv=H_kv, dtype=jnp.bfloat16, rng=rng)
    a["seg"] = harness.joint_segment_ids(rng, B, T, L)

    def local(q, k, v, seg, s):
        return sequence_parallel_joint_self_attention(q, k, v, T, SP_AXIS, segment_ids=seg)

    ref = oracle.attention(*_qkv(a), segment_ids=a["seg"], dout=a["dout"])
    got = _check_joint(local, sp, T, a, ref, jnp.bfloat16, segments=True)
    assert got["out"].dtype == jnp.bfloat16


def test_joint_text_only():
    """`text_len` equal to the per-device length: no visual tokens, text attends to itself."""
    B, T, H, D, sp = 1, 6, 4, 8, 2
    a = harness.attention_inputs(B, T, H, D, H_kv=2, seed=31)
    local = lambda q, k, v, seg, s: sequence_parallel_joint_self_attention(  # noqa: E731
        q, k, v, T, SP_AXIS)
    _check_joint(local, sp, T, a, oracle.attention(*_qkv(a), dout=a["dout"]))


def test_joint_padding_recipe(causal=True):
    """Text 5 + 30 visual tokens over 4 devices: the visual sequence is padded to 32,
    padding gets segment id -1 (text and real visual 0), and is dropped after."""
    B, T, L, H, H_kv, D, sp = 2, 5, 30, 4, 1, 8, 4
    rng = np.random.default_rng(40)
    text = harness.attention_inputs(B, T, H, D, H_kv=H_kv, rng=rng)
    visual = harness.attention_inputs(B, L, H, D, H_kv=H_kv, rng=rng)
    Lp = L + (-L % sp)
    Ll = Lp // sp

    def local(q, k, v, seg):
        return sequence_parallel_joint_self_attention(q, k, v, T, SP_AXIS, segment_ids=seg,
                                                      causal=causal)

    sharded = jax.shard_map(local, mesh=harness.mesh(sp=sp), in_specs=(SEQ,) * 4, out_specs=SEQ)

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

    (out_t, out_v), grads = harness.vjp(f)(*_qkv(text), *_qkv(visual),
                                           (text["dout"], visual["dout"]))
    ref = oracle.attention(*(np.concatenate([text[x], visual[x]], 1) for x in "qkv"),
                           causal=causal, dout=np.concatenate([text["dout"], visual["dout"]], 1))
    oracle.assert_close(out_t, ref.out[:, :T], np.float32, "text out")
    oracle.assert_close(out_v, ref.out[:, T:], np.float32, "visual out")
    for i, name in enumerate(("dq", "dk", "dv")):
        got = np.concatenate([grads[i], grads[i + 3]], axis=1)
        oracle.assert_close(got, getattr(ref, name), np.float32, name)


# ------------------------------------------------------------------------------ errors


def _shard(fn, sp=4, n_in=3, spec=SEQ):
    return jax.shard_map(fn, mesh=harness.mesh(sp=sp), in_specs=(spec,) * n_in, out_specs=spec)


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
