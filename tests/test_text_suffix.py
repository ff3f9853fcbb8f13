"""The joint layouts with the text after the video, key-only padding through `parallel/`.

- `text_position="suffix"`: every device holds `[its video chunk; text (replicated)]`, and
  Ulysses (`sequence_parallel_joint_self_attention`), the ring (contiguous and zigzag) and
  USP must equal single-device attention over `[video; text]`, video at positions
  `0 .. L-1` and text at `L .. L+T-1` (causal masks and windows included).
- `text_lengths`: text keys at an index `>= text_lengths[b]` within the text are hidden
  from every query, every query (the padded text rows included) still computed.
- `kv_lengths`: keys at a global index `>= kv_lengths[b]` hidden, every query computed,
  on the plain layouts (Ulysses, ring contiguous / zigzag, USP).
- `parallel.replicated`: the text rows returned with `out_specs=P()`.

Everything against the float64 oracle (`oracle.attention` with separate query / key ids,
the key ids -1 where a key is hidden: `harness.key_only_ids`), forward and gradients of
q, k, v (text and video rows) and sinks with a random cotangent, and some configurations
against one device (`kernels.attention`). Tiny shapes; each configuration compiles once.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import oracle
from vidax_eqx import kernels, parallel


SP = parallel.SP_AXIS
B, T, V, H, H_KV, D = 2, 3, 16, 4, 2, 8  # V: global video tokens
TEXT_LENGTHS = np.array([1, 3], np.int32)  # batch 0: two padded text keys; batch 1: none


@dataclasses.dataclass(frozen=True)
class Case:
    """One static configuration (hashable: the cache key of `_fn`)."""

    kind: str  # "ulysses" | "ring" | "usp"
    text_position: str = "suffix"
    layout: str = "contiguous"
    causal: bool = False
    window: tuple | None = None
    sinks: bool = False
    segments: bool = False
    lengths: bool = True  # text_lengths given

    @property
    def n(self) -> int:
        return 8 if self.kind == "usp" else 4

    @property
    def axes(self):
        return ("ring", SP) if self.kind == "usp" else SP

    def mesh(self):
        return harness.mesh(sp=2, ring=4) if self.kind == "usp" else harness.mesh(sp=4)

    @property
    def zigzag_size(self) -> int:
        return 0 if self.layout == "contiguous" else 4


def _attend(case: Case, q, k, v, seg, sinks, lengths):
    opts = dict(causal=case.causal, window=case.window, sinks=sinks, segment_ids=seg,
                text_position=case.text_position, text_lengths=lengths, implementation="xla")
    if case.kind == "ulysses":
        return parallel.sequence_parallel_joint_self_attention(q, k, v, T, SP, **opts)
    if case.kind == "ring":
        return parallel.ring_attention(q, k, v, ring_axis=SP, text_len=T, layout=case.layout, **opts)
    return parallel.usp_attention(q, k, v, ulysses_axis=SP, ring_axis="ring", text_len=T,
                                  layout=case.layout, **opts)


@functools.lru_cache(maxsize=None)
def _fn(case: Case):
    return harness.text_joint_vjp(
        functools.partial(_attend, case), case.mesh(), case.axes,
        text_position=case.text_position, segments=case.segments, sinks=case.sinks,
        lengths=case.lengths, compiler_options=harness.FAST_COMPILE,
    )


def _inputs(case: Case, seed: int = 0) -> dict:
    a = harness.attention_inputs(B, T + V, H, D, H_kv=H_KV, seed=seed, sinks=case.sinks)
    if case.segments:  # video ids with padding, text ids 0 / 1
        rng = np.random.default_rng(seed + 1)
        video = harness.segment_ids(rng, B, V, pad=(2, 0))
        text = rng.integers(0, 2, (B, T)).astype(np.int32)
        a["seg"] = np.concatenate([text, video] if case.text_position == "prefix" else [video, text], 1)
    return a


def _reference(case: Case, a: dict):
    seg = harness.key_only_ids(B, T + V, seg=a.get("seg"), text_len=T,
                               text_position=case.text_position,
                               text_lengths=TEXT_LENGTHS if case.lengths else None)
    return oracle.attention(a["q"], a["k"], a["v"], segment_ids=seg, sinks=a.get("sinks"),
                            causal=case.causal, window=case.window, dout=a["dout"])


def _check(case: Case, seed: int = 0) -> dict:
    a = _inputs(case, seed)
    got = harness.run_text_joint(_fn(case), a, case.n, T, text_position=case.text_position,
                                 zigzag_size=case.zigzag_size,
                                 lengths=TEXT_LENGTHS if case.lengths else None)
    ref = _reference(case, a)
    names = harness.ATTENTION_NAMES + (("dsinks",) if case.sinks else ())
    harness.assert_matches(got, ref, np.float32, names)
    harness.assert_copies_equal(got["out_text"])
    return got


CASES = [
    Case("ulysses", sinks=True, segments=True),
    Case("ulysses", causal=True),
    Case("ulysses", text_position="prefix", sinks=True),
    Case("ring", sinks=True, segments=True),
    Case("ring", causal=True),
    Case("ring", layout="zigzag", causal=True, sinks=True),
    Case("ring", layout="zigzag", window=(3, 2), lengths=False),
    Case("ring", text_position="prefix", layout="zigzag", segments=True),
    Case("usp", sinks=True, segments=True),
    Case("usp", layout="zigzag", causal=True),
    Case("usp", text_position="prefix", window=(2, 1)),
]


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_joint_matches_oracle(case):
    _check(case)


@pytest.mark.parametrize("kind", ["ulysses", "ring", "usp"])
def test_suffix_equals_one_device(kind):
    """Sharded against `kernels.attention` on one device over `[video; text]` (key-only
    padding as separate query / key ids), forward and gradients, in float32."""
    case = Case(kind, sinks=True)
    a = _inputs(case, seed=3)
    got = harness.run_text_joint(_fn(case), a, case.n, T, text_position="suffix",
                                 lengths=TEXT_LENGTHS)
    seg_q, seg_kv = harness.key_only_ids(B, T + V, text_len=T, text_position="suffix",
                                         text_lengths=TEXT_LENGTHS)
    single = harness.vjp(lambda q, k, v, s: kernels.attention(
        q, k, v, sinks=s, segment_ids=kernels.SegmentIds(q=jnp.asarray(seg_q), kv=jnp.asarray(seg_kv)),
        implementation="xla"))
    out, grads = single(*(jnp.asarray(a[n]) for n in ("q", "k", "v", "sinks", "dout")))
    harness.assert_trees_close([got[n] for n in ("out", "dq", "dk", "dv", "dsinks")],
                               [out, *grads], np.float32, f"{kind} vs one device: ")


def test_padded_text_rows_are_computed():
    """Key-only padding: the padded text tokens' own rows are full attention rows (not 0),
    and no query sees a padded text key (changing those keys' values changes nothing)."""
    case = Case("ring")
    a = _inputs(case)
    got = _check(case)
    padded = got["out"][0, V + TEXT_LENGTHS[0]:]  # batch 0's padded text rows
    assert np.all(np.abs(padded).max(axis=(-2, -1)) > 1e-3)
    b = dict(a)
    for name in ("k", "v"):
        b[name] = a[name].copy()
        b[name][0, V + TEXT_LENGTHS[0]:] += 5.0
    other = harness.run_text_joint(_fn(case), b, case.n, T, text_position="suffix",
                                   lengths=TEXT_LENGTHS)
    np.testing.assert_allclose(other["out"], got["out"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["ulysses", "ring"])
def test_text_lengths_varying_over_devices(kind):
    """`text_lengths` typed as varying over the axis (computed inside `shard_map`): served
    by key segment ids instead of the kernels' `kv_lengths`, with the same numbers."""
    case = Case(kind)
    a = _inputs(case, seed=4)

    def attend(q, k, v, seg, sinks, lengths):
        return _attend(case, q, k, v, seg, sinks, jax.lax.pcast(lengths, SP, to="varying"))

    fn = harness.text_joint_vjp(attend, case.mesh(), SP, text_position="suffix", lengths=True,
                                compiler_options=harness.FAST_COMPILE)
    got = harness.run_text_joint(fn, a, case.n, T, text_position="suffix", lengths=TEXT_LENGTHS)
    harness.assert_matches(got, _reference(case, a), np.float32)


# -- a sliding tile mask with the text after the video -----------------------------------


TILE = kernels.SlidingTileMask(grid=(2, 3, 2), tile=(1, 2, 2), window=(1, 3, 1), text_len=T,
                               text_position="suffix")  # video_len 16: 2 x 2 x 1 tiles of 4


@pytest.mark.parametrize("kind", ["ulysses", "ring"])
def test_tile_mask_suffix(kind):
    """A `SlidingTileMask(text_position="suffix")` through Ulysses and the ring, with
    padded text, against the oracle's dense sliding tile mask."""
    a = harness.attention_inputs(B, T + V, H, D, H_kv=H_KV, seed=5)

    def attend(q, k, v, seg, sinks, lengths):
        opts = dict(mask=TILE, text_position="suffix", text_lengths=lengths, implementation="xla")
        if kind == "ulysses":
            return parallel.sequence_parallel_joint_self_attention(q, k, v, T, SP, **opts)
        return parallel.ring_attention(q, k, v, ring_axis=SP, text_len=T, **opts)

    fn = harness.text_joint_vjp(attend, harness.mesh(sp=4), SP, text_position="suffix",
                                lengths=True, compiler_options=harness.FAST_COMPILE)
    got = harness.run_text_joint(fn, a, 4, T, text_position="suffix", lengths=TEXT_LENGTHS)
    seg = harness.key_only_ids(B, T + V, text_len=T, text_position="suffix",
                               text_lengths=TEXT_LENGTHS)
    dense = oracle.sliding_tile_of(TILE)[0]
    ref = oracle.attention(a["q"], a["k"], a["v"], mask=dense, segment_ids=seg, dout=a["dout"])
    harness.assert_matches(got, ref, np.float32)


def test_tile_mask_suffix_padded_video_ulysses():
    """Ulysses cuts the video's padding (to a multiple of sp) from between the video and
    the text before the kernel: a 14-token video padded to 16, with padded text (the
    kernels' `kv_lengths`, shifted by the cut)."""
    mask = kernels.SlidingTileMask(grid=(1, 1, 14), tile=(1, 1, 2), window=(1, 1, 3), text_len=T,
                                   text_position="suffix")  # video_len 14, padded to 16
    assert mask.video_len == 14
    a = harness.attention_inputs(B, T + V, H, D, seed=6)
    pad = np.zeros((B, T + V), np.int32)
    pad[:, 14:V] = -1  # the padded video tokens: invisible both ways

    def attend(q, k, v, seg, sinks, lengths):
        return parallel.sequence_parallel_joint_self_attention(
            q, k, v, T, SP, mask=mask, segment_ids=seg, text_position="suffix",
            text_lengths=lengths, implementation="xla")

    fn = harness.text_joint_vjp(attend, harness.mesh(sp=4), SP, text_position="suffix",
                                segments=True, lengths=True, compiler_options=harness.FAST_COMPILE)
    got = harness.run_text_joint(fn, dict(a, seg=pad), 4, T, text_position="suffix",
                                 lengths=TEXT_LENGTHS)
    keep = np.r_[0:14, V:V + T]
    dense = np.zeros((T + V, T + V), bool)
    dense[np.ix_(keep, keep)] = oracle.sliding_tile_of(mask)[0]
    seg = harness.key_only_ids(B, T + V, text_len=T, text_position="suffix",
                               text_lengths=TEXT_LENGTHS)
    ref = oracle.attention(a["q"], a["k"], a["v"], mask=dense, segment_ids=seg, dout=a["dout"])
    harness.assert_matches(got, ref, np.float32)


# -- kv_lengths on the plain layouts -------------------------------------------------------


KV_LENGTHS = np.array([11, 16], np.int32)


@pytest.mark.parametrize("kind,layout", [("ulysses", "contiguous"), ("ring", "contiguous"),
                                         ("ring", "zigzag"), ("usp", "zigzag")])
def test_kv_lengths(kind, layout):
    """Keys at a global index >= kv_lengths[b] hidden from every query, every query
    computed, forward and gradients against the oracle (with sinks)."""
    zig = 4 if layout == "zigzag" else 0  # the ring's size (USP: R = 4)
    a = harness.attention_inputs(B, V, H, D, H_kv=H_KV, seed=7, sinks=True)
    lengths = jnp.asarray(KV_LENGTHS)

    def attend(q, k, v, seg, sinks):
        opts = dict(sinks=sinks, kv_lengths=lengths, implementation="xla")
        if kind == "ulysses":
            return parallel.sequence_parallel_self_attention(q, k, v, SP, **opts)
        if kind == "ring":
            return parallel.ring_attention(q, k, v, ring_axis=SP, layout=layout, **opts)
        return parallel.usp_attention(q, k, v, ulysses_axis=SP, ring_axis="ring", layout=layout,
                                      **opts)

    mesh, axes = (harness.mesh(sp=2, ring=4), ("ring", SP)) if kind == "usp" else (harness.mesh(sp=4), SP)
    fn = harness.sequence_vjp(attend, mesh, axes, sinks=True, compiler_options=harness.FAST_COMPILE)
    got = harness.run_sequence(fn, a, zigzag_size=zig, sinks=True)
    seg = harness.key_only_ids(B, V, kv_lengths=KV_LENGTHS)
    ref = oracle.attention(a["q"], a["k"], a["v"], segment_ids=seg, sinks=a["sinks"], dout=a["dout"])
    harness.assert_matches(got, ref, np.float32, harness.ATTENTION_NAMES + ("dsinks",))


def test_kv_lengths_joint_ring():
    """`kv_lengths` in the joint layout counts the single-device sequence `[video; text]`:
    hiding the last keys of a suffix hides the tail of the text."""
    case = Case("ring", lengths=False)
    a = _inputs(case, seed=8)
    kvl = jnp.asarray([V + 1, V - 5], jnp.int32)

    def attend(q, k, v, seg, sinks, lengths):
        return parallel.ring_attention(q, k, v, ring_axis=SP, text_len=T, text_position="suffix",
                                       kv_lengths=kvl, implementation="xla")

    fn = harness.text_joint_vjp(attend, case.mesh(), SP, text_position="suffix",
                                compiler_options=harness.FAST_COMPILE)
    got = harness.run_text_joint(fn, a, 4, T, text_position="suffix")
    seg = harness.key_only_ids(B, T + V, kv_lengths=np.asarray(kvl))
    ref = oracle.attention(a["q"], a["k"], a["v"], segment_ids=seg, dout=a["dout"])
    harness.assert_matches(got, ref, np.float32)


# -- parallel.replicated --------------------------------------------------------------------


def test_replicated_out_spec():
    """The text rows returned with `out_specs=P()` (check_vma on): forward equal to the
    oracle's text rows, and the gradients (the text cotangent given once) the oracle's."""
    a = harness.attention_inputs(B, T + V, H, D, seed=9)
    mesh = harness.mesh(sp=4)
    L = V // 4

    def local(qt, kt, vt, qv, kv, vv):
        cat = lambda x, t: jnp.concatenate([x, jax.lax.pcast(t, SP, to="varying")], 1)  # noqa: E731
        out = parallel.ring_attention(cat(qv, qt), cat(kv, kt), cat(vv, vt), ring_axis=SP,
                                      text_len=T, text_position="suffix", implementation="xla")
        return out[:, :L], parallel.replicated(out[:, L:], SP)

    seq = P(None, SP)
    f = jax.shard_map(local, mesh=mesh, in_specs=(P(),) * 3 + (seq,) * 3, out_specs=(seq, P()))
    args = [jnp.asarray(a[n][:, V:]) for n in "qkv"] + [jnp.asarray(a[n][:, :V]) for n in "qkv"]
    dout = (jnp.asarray(a["dout"][:, :V]), jnp.asarray(a["dout"][:, V:]))
    (out_v, out_t), grads = harness.vjp(f)(*args, dout)
    ref = oracle.attention(a["q"], a["k"], a["v"], dout=a["dout"])
    got = dict(out=np.concatenate([out_v, out_t], 1))
    for i, name in enumerate(("dq", "dk", "dv")):
        got[name] = np.concatenate([grads[3 + i], grads[i]], 1)
    harness.assert_matches(got, ref, np.float32)


def test_replicated_usp_axes_and_invariant_input():
    """Over two axes (USP's text rows), and a value already replicated is returned as it
    is; outside `shard_map` the axis is a clear error."""
    mesh = harness.mesh(sp=2, ring=4)

    def local(x, y):
        return (parallel.replicated(jax.lax.pcast(x, ("ring", SP), to="varying"), ("ring", SP)),
                parallel.replicated(y, ("ring", SP)))

    x = jnp.arange(6.0).reshape(2, 3)
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P())))
    rx, ry = f(x, x + 1)
    np.testing.assert_array_equal(rx, x)
    np.testing.assert_array_equal(ry, x + 1)
    with pytest.raises(ValueError, match="'sp'"):
        parallel.replicated(x, SP)


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ulysses", "ring", "usp"])
@pytest.mark.parametrize("kwargs,error,match", [
    (dict(text_len=T + 5), ValueError, r"`text_len` must be between 0 and .* 7 \(visual chunk \+ text suffix"),
    (dict(text_position="middle"), ValueError, r"`text_position` must be one of .*'middle'"),
    (dict(text_lengths=np.array([1, 4], np.int32)), ValueError, r"`text_lengths` must lie in \[0, 3\].*\[1, 4\]"),
    (dict(text_lengths=np.array([-1, 0], np.int32)), ValueError, r"`text_lengths` must lie in \[0, 3\]"),
    (dict(text_lengths=np.array([1, 2, 3], np.int32)), ValueError, r"`text_lengths` must be an integer array of shape \(B,\) = \(2,\).*\(3,\)"),
    (dict(text_lengths=np.array([1.0, 2.0], np.float32)), ValueError, r"`text_lengths` .*float32"),
    (dict(text_len=0, text_lengths=np.array([1, 2], np.int32)), ValueError, r"`text_lengths` pads the text .*text_len=0"),
    (dict(kv_lengths=np.array([3, 99], np.int32)), ValueError, r"`kv_lengths` must lie in \[0, \d+\].*99"),
])
def test_bad_input(kind, kwargs, error, match):
    mesh = harness.mesh(sp=2, ring=4) if kind == "usp" else harness.mesh(sp=4)
    axes = ("ring", SP) if kind == "usp" else SP
    kw = dict(text_len=T, text_position="suffix", text_lengths=None, kv_lengths=None)
    kw.update(kwargs)
    n = 8 if kind == "usp" else 4
    q = jnp.ones((B, n * (4 + T), H, D))

    def local(q):
        if kind == "ulysses":
            return parallel.sequence_parallel_joint_self_attention(
                q, q, q, kw.pop("text_len"), SP, implementation="xla", **kw)
        if kind == "ring":
            return parallel.ring_attention(q, q, q, ring_axis=SP, implementation="xla", **kw)
        return parallel.usp_attention(q, q, q, ulysses_axis=SP, ring_axis="ring",
                                      implementation="xla", **kw)

    f = jax.shard_map(local, mesh=mesh, in_specs=P(None, axes), out_specs=P(None, axes))
    with pytest.raises(error, match=match):
        jax.eval_shape(f, q)


@pytest.mark.parametrize("kind", ["ulysses", "ring"])
def test_suffix_tile_mask_with_causal_is_refused(kind):
    mesh = harness.mesh(sp=4)
    q = jnp.ones((B, V + 4 * T, H, D))

    def local(q):
        opts = dict(mask=TILE, text_position="suffix", causal=True, implementation="xla")
        if kind == "ulysses":
            return parallel.sequence_parallel_joint_self_attention(q, q, q, T, SP, **opts)
        return parallel.ring_attention(q, q, q, ring_axis=SP, text_len=T, **opts)

    f = jax.shard_map(local, mesh=mesh, in_specs=P(None, SP), out_specs=P(None, SP))
    with pytest.raises(NotImplementedError, match="text_position='suffix'.*SlidingTileMask"):
        jax.eval_shape(f, q)
