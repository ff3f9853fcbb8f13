"""`usp_attention` (Ulysses x ring) on simulated CPU devices against the float64 oracle.

Meshes are `make_mesh(dp, sp=U, extra_axes={"ring": R})`; the global sequence is
sharded ring-major, `P(None, ("ring", "sp"))` (zigzag: permuted first with
`zigzag_permute(x, 1, R)` and unpermuted after; a text prefix enters replicated and
every device puts it before its chunk: `harness.joint_vjp`). Every comparison takes
`jax.vjp` with a random cotangent and checks the output and the gradients of q, k, v
(and sinks) against `oracle.attention` on the whole unsharded sequence. Shapes stay
small so the file runs quickly on a 2-core machine; each configuration compiles
once (`_usp_fn` caches it).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import oracle
from vidax_eqx import kernels, parallel


RING = "ring"
ULYSSES = parallel.SP_AXIS


@dataclasses.dataclass(frozen=True)
class Usp:
    """One static configuration (hashable: the cache key of `_usp_fn`)."""

    U: int = 2
    R: int = 4
    dp: int = 1
    layout: str = "contiguous"
    causal: bool = False
    window: tuple | None = None
    soft_cap: float | None = None
    text_len: int = 0
    segments: bool = False
    sinks: bool = False
    implementation: object = "xla"
    check_vma: bool = True

    def mesh(self):
        return harness.mesh(dp=self.dp, sp=self.U, **{RING: self.R})

    def seq(self):
        return P("dp" if self.dp > 1 else None, (RING, ULYSSES))


@functools.lru_cache(maxsize=None)
def _usp_fn(cfg: Usp):
    """A jitted `(q, k, v, seg, sinks, dout) -> (out, (dq, dk, dv, dsinks))` on the
    sharded (per-device) layout (`harness.sequence_vjp`); with a text prefix, the joint
    layout's `(text, visual, seg, sinks, dout) -> (out, grads)` (`harness.joint_vjp`)."""

    def attend(q, k, v, seg, sinks):
        return parallel.usp_attention(
            q, k, v,
            ulysses_axis=ULYSSES,
            ring_axis=RING,
            causal=cfg.causal,
            segment_ids=seg,
            sinks=sinks,
            window=cfg.window,
            logits_soft_cap=cfg.soft_cap,
            layout=cfg.layout,
            text_len=cfg.text_len,
            implementation=cfg.implementation,
        )

    vjp = harness.joint_vjp if cfg.text_len else harness.sequence_vjp
    return vjp(attend, cfg.mesh(), (RING, ULYSSES), batch_axis="dp" if cfg.dp > 1 else None,
               segments="one" if cfg.segments else None, sinks=cfg.sinks, check_vma=cfg.check_vma)


def _inputs(B=2, S=32, T=0, H=4, H_kv=4, D=8, dtype=np.float32, seed=0, segments=False,
            sinks=False):
    """Global arrays: `(B, T + S, ...)`, text first when `T > 0`. q, k, v and dout hold
    values of `dtype` (rounded to it), in float32. Segment ids differ per batch element:
    sorted runs and scattered ids, both with a padded (-1) tail; text ids in {0, 1}."""
    rng = np.random.default_rng(seed)
    a = harness.attention_inputs(B, T + S, H, D, H_kv=H_kv, dtype=dtype, rng=rng, sinks=sinks)
    for name in ("q", "k", "v", "dout"):
        a[name] = a[name].astype(np.float32)  # the rounded values, exactly
    if segments:
        a["seg"] = harness.joint_segment_ids(rng, B, T, S)
    return a


def _run(cfg: Usp, a: dict, repeat: int = 1):
    """Runs `usp_attention` on global arrays `a`; returns global-order results (with a
    text prefix also every device's text rows, `out_text`; the text cotangent split over
    the devices' copies in random shares)."""
    common = dict(zigzag_size=cfg.R if cfg.layout == "zigzag" else 0,
                  segments="one" if cfg.segments else None, sinks=cfg.sinks)
    if cfg.text_len:
        assert repeat == 1
        return harness.run_joint(_usp_fn(cfg), a, cfg.U * cfg.R, cfg.text_len, **common)
    return harness.run_sequence(_usp_fn(cfg), a, repeat=repeat, **common)


def _oracle(cfg: Usp, a: dict):
    return oracle.attention(
        a["q"], a["k"], a["v"],
        segment_ids=a.get("seg") if cfg.segments else None,
        sinks=a.get("sinks") if cfg.sinks else None,
        causal=cfg.causal,
        window=cfg.window,
        logits_soft_cap=cfg.soft_cap,
        dout=a["dout"],
    )


def _check(cfg: Usp, a: dict, dtype=np.float32):
    got, ref = _run(cfg, a), _oracle(cfg, a)
    names = harness.ATTENTION_NAMES + (("dsinks",) if cfg.sinks else ())
    harness.assert_matches(got, ref, dtype, names)
    if cfg.text_len:
        harness.assert_copies_equal(got["out_text"])  # identical on every device


MESHES = [(2, 4, 1), (4, 2, 1), (2, 2, 2)]
MESH_IDS = ["U2xR4", "U4xR2", "dp2xU2xR2"]


# -- output and gradients against the oracle ---------------------------------------


@pytest.mark.parametrize(
    "causal, layout", [(False, "contiguous"), (True, "zigzag")], ids=["full", "causal-zigzag"]
)
@pytest.mark.parametrize("U, R, dp", MESHES, ids=MESH_IDS)
def test_matches_oracle(U, R, dp, causal, layout):
    """GQA with H_kv=2: no repetition for U=2, repetition x2 for U=4. (Causal
    contiguous and non-causal zigzag run in the tests below.)"""
    cfg = Usp(U=U, R=R, dp=dp, layout=layout, causal=causal)
    _check(cfg, _inputs(H=4, H_kv=2, seed=U * 10 + R))


@pytest.mark.parametrize("U, R, layout", [(4, 2, "zigzag"), (2, 4, "contiguous")])
def test_mqa_with_sinks(U, R, layout):
    """One kv head repeated U times; sinks sliced to each device's heads, gradient
    summed once over all devices."""
    cfg = Usp(U=U, R=R, layout=layout, causal=True, sinks=True)
    _check(cfg, _inputs(H=4, H_kv=1, sinks=True, seed=2))


@pytest.mark.parametrize("U, R, dp, layout", [(2, 4, 1, "zigzag"), (2, 2, 2, "contiguous")])
def test_segment_ids_per_batch_with_padding(U, R, dp, layout):
    """Ids that differ per batch element, padding (-1) included, gathered within the
    Ulysses group and then travelling the ring."""
    a = _inputs(segments=True, sinks=True, seed=3)
    assert (a["seg"] < 0).any() and not np.array_equal(a["seg"][0], a["seg"][1])
    _check(Usp(U=U, R=R, dp=dp, layout=layout, causal=True, segments=True, sinks=True), a)


def test_window_soft_cap():
    _check(Usp(U=2, R=4, layout="zigzag", window=(5, 2), soft_cap=3.0), _inputs(seed=4))


def test_sinks_unchecked_shard_map():
    """`check_vma=False`: shard_map's other transpose gives the same sink gradient."""
    _check(Usp(U=4, R=2, causal=True, sinks=True, check_vma=False), _inputs(sinks=True, seed=5))


def test_bfloat16():
    a = _inputs(H_kv=2, dtype=jnp.bfloat16, sinks=True, seed=6)
    _check(Usp(U=2, R=4, layout="zigzag", causal=True, sinks=True), a, dtype=jnp.bfloat16)


def test_blockwise_implementation():
    cfg = Usp(U=2, R=4, layout="zigzag", causal=True, segments=True,
              implementation=kernels.Blockwise(block_q=4, block_kv=4))
    _check(cfg, _inputs(H_kv=2, segments=True, seed=7))  # 4x4 tiles: shares span tiles


@pytest.mark.parametrize("layout, S", [("contiguous", 27), ("zigzag", 21)])
def test_sequence_length_needing_padding(layout, S):
    """Pad to U * R (contiguous) or lcm(2R, U * R) (zigzag), hide the padding with
    segment ids, unpad: equal to the unpadded oracle."""
    U, R = 2, 4
    multiple = U * R if layout == "contiguous" else math.lcm(2 * R, U * R)
    a = _inputs(S=S, seed=8)
    padded = {n: np.asarray(parallel.pad_to_multiple(jnp.asarray(x), multiple, axis=1))
              for n, x in a.items()}
    padded["seg"] = np.asarray(parallel.padding_segment_ids(S, multiple, a["q"].shape[0]))
    got = _run(Usp(U=U, R=R, layout=layout, causal=True, segments=True), padded)
    ref = oracle.attention(a["q"], a["k"], a["v"], causal=True, dout=a["dout"])
    for name in ("out", "dq", "dk", "dv"):
        oracle.assert_close(got[name][:, :S], getattr(ref, name), np.float32, name)


def test_deterministic():
    cfg = Usp(U=2, R=4, layout="zigzag", causal=True)
    first, second = _run(cfg, _inputs(H_kv=2, seed=9), repeat=2)
    for name in ("out", "dq", "dk", "dv"):
        np.testing.assert_array_equal(first[name], second[name])


# -- the joint (text-prefix) layout ---------------------------------------------------


@pytest.mark.parametrize(
    "U, R, dp, layout, causal",
    [(2, 4, 1, "contiguous", False), (4, 2, 1, "zigzag", True), (2, 2, 2, "zigzag", False)],
    ids=MESH_IDS,
)
def test_joint_matches_oracle(U, R, dp, layout, causal):
    """Text (5 tokens, replicated) + 32 visual tokens; GQA, sinks. Text rows equal the
    single-device ones and are bitwise identical on every device."""
    cfg = Usp(U=U, R=R, dp=dp, layout=layout, causal=causal, text_len=5, sinks=True)
    _check(cfg, _inputs(T=5, H_kv=2, sinks=True, seed=20 + U))


def test_joint_segments_window():
    """Per-batch segment ids over text and visual tokens (visual padding included),
    and a window that lets some visual tokens see the text and others not."""
    cfg = Usp(U=2, R=4, layout="zigzag", window=(9, 3), text_len=3, segments=True, sinks=True)
    _check(cfg, _inputs(T=3, H_kv=1, segments=True, sinks=True, seed=30))


def test_joint_bfloat16_unchecked():
    cfg = Usp(U=4, R=2, causal=True, text_len=4, sinks=True, check_vma=False)
    _check(cfg, _inputs(T=4, dtype=jnp.bfloat16, sinks=True, seed=31), dtype=jnp.bfloat16)


def test_joint_text_only():
    """`text_len` equal to the per-device length: no visual tokens."""
    cfg = Usp(U=2, R=4, text_len=6, sinks=True)
    _check(cfg, _inputs(T=6, S=0, H_kv=2, sinks=True, seed=32))


# -- zigzag composition ---------------------------------------------------------------


@pytest.mark.parametrize("U, R", [(2, 4), (4, 2), (3, 2)])
def test_zigzag_share_after_ulysses(U, R):
    """`zigzag_permute(x, 1, R)` sharded ring-major and gathered over the Ulysses
    group gives ring rank r the zigzag chunks r and 2R - 1 - r, in order."""
    S = math.lcm(2 * R, U * R) * 2
    x = np.arange(S)[None]
    z = np.asarray(parallel.zigzag_permute(x, 1, R))
    L = S // (U * R)
    for r in range(R):
        share = np.concatenate([z[0, (r * U + u) * L:(r * U + u + 1) * L] for u in range(U)])
        np.testing.assert_array_equal(share, np.asarray(parallel.ring_positions(U * L, R, r, "zigzag")))


# -- errors -------------------------------------------------------------------------


def _trace(U=2, R=4, S=16, H=4, **kw):
    cfg = Usp(U=U, R=R)
    seq = cfg.seq()
    f = lambda q: parallel.usp_attention(q, q, q, **{"ulysses_axis": ULYSSES, "ring_axis": RING, **kw})  # noqa: E731
    jax.eval_shape(jax.shard_map(f, mesh=cfg.mesh(), in_specs=seq, out_specs=seq),
                   jnp.ones((1, S, H, 8)))


def test_missing_axis():
    x = jnp.ones((1, 8, 4, 8))
    with pytest.raises(ValueError, match=r"^Ulysses axis 'sp' does not exist in the current context\."):
        parallel.usp_attention(x, x, x, ulysses_axis="sp", ring_axis=RING)
    with pytest.raises(ValueError, match=r"^Ring axis 'rnig' does not exist in the current context\."):
        _trace(ring_axis="rnig")
    with pytest.raises(ValueError, match=r"^Ulysses axis 'tp2' does not exist"):
        _trace(ulysses_axis="tp2")


def test_same_axis():
    with pytest.raises(ValueError, match="two different mesh axes"):
        _trace(ring_axis=ULYSSES)


def test_heads_not_divisible():
    with pytest.raises(ValueError, match=r"H=6.*sp=4"):
        _trace(U=4, R=2, H=6)


def test_zigzag_odd_share():
    # 8 tokens over U=1 x R=8 devices: each ring rank's share is one token, which
    # the zigzag layout cannot halve.
    with pytest.raises(ValueError, match=r"lcm\(2 \* R, U \* R\) = 16"):
        _trace(U=1, R=8, S=8, layout="zigzag")


def test_unknown_layout():
    with pytest.raises(ValueError, match="`layout` must be one of"):
        _trace(layout="striped")


@pytest.mark.parametrize("text_len", [-1, 3, 2.0])
def test_bad_text_len(text_len):
    with pytest.raises(ValueError, match="text_len"):
        _trace(text_len=text_len)  # 2 tokens per device


def test_bad_sinks_and_segment_ids():
    with pytest.raises(ValueError, match=r"`sinks` must be a float array of shape \(H,\)"):
        _trace(sinks=jnp.ones((3,)))
    with pytest.raises(ValueError, match=r"`segment_ids` holds this device's tokens"):
        _trace(segment_ids=jnp.zeros((1, 16), jnp.int32))
