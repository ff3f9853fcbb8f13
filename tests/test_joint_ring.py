"""`ring_attention(..., text_len=T)`: the joint (CogVideoX) layout on a pure ring.

Each device holds `[text prefix (T tokens, the same everywhere); its chunk of the
visual sequence]`. The text q/k/v (and text segment ids) enter `jax.shard_map` as
**replicated** arrays (`PartitionSpec()`) and are put before the device's visual
chunk inside it, so the gradient `shard_map` returns for them is already the sum
over devices, which must equal the single-device one (the text counted once). The
visual arrays are sharded over the ring (zigzag: `zigzag_permute(x, 1, n)` first).
The text output rows are copies, one per device; the text cotangent is split over
them in random shares that sum to the true cotangent (see `ring_attention`'s
"Joint layout, how it runs and its gradients").

Everything is compared with `oracle.attention` over `[text; visual]`, forward and
gradients of q, k, v (text rows included) and sinks, with a random cotangent.
Shapes stay tiny and each configuration compiles once (`_joint_fn` caches it).
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import oracle
from vidax_eqx import kernels, parallel


SP = parallel.SP_AXIS


@dataclasses.dataclass(frozen=True)
class Joint:
    """One static configuration (hashable: the cache key of `_joint_fn`)."""

    n: int = 8  # ring size
    dp: int = 1  # > 1: the batch is sharded over "dp" too
    text_len: int = 4
    layout: str = "contiguous"
    causal: bool = False
    window: tuple | None = None
    segments: str | None = None  # None | "shared" (one (B, S) array) | "pair" (SegmentIds)
    sinks: bool = False
    check_vma: bool = True

    def mesh(self):
        return harness.mesh(dp=self.dp, sp=self.n)


def _attend(cfg: Joint, q, k, v, seg, sinks):
    """Inside `shard_map`, on `[text; visual chunk]` per device: the joint ring."""
    if cfg.segments == "pair":
        seg = kernels.SegmentIds(q=seg[0], kv=seg[1])
    return parallel.ring_attention(
        q, k, v, ring_axis=SP, causal=cfg.causal, segment_ids=seg, sinks=sinks,
        window=cfg.window, layout=cfg.layout, text_len=cfg.text_len, implementation="xla",
    )


def _segments(cfg: Joint):
    return {None: None, "shared": "one", "pair": "pair"}[cfg.segments]


@functools.lru_cache(maxsize=None)
def _joint_fn(cfg: Joint):
    """A jitted `(text, visual, seg, sinks, dout) -> (out, grads)` on the sharded layout
    (`harness.joint_vjp`): `text = (qt, kt, vt)` replicated, `visual = (qv, kv, vv)`
    sharded, `out` the per-device `[text; visual]` rows side by side, `grads` of text,
    visual and sinks."""
    return harness.joint_vjp(
        functools.partial(_attend, cfg), cfg.mesh(), SP, batch_axis="dp" if cfg.dp > 1 else None,
        segments=_segments(cfg), sinks=cfg.sinks, check_vma=cfg.check_vma,
    )


def _inputs(B=2, T=4, S=16, H=4, H_kv=2, D=8, seed=0, segments=False, sinks=False):
    """Global float32 arrays over `[text (T); visual (S)]`. Segment ids: text ids in
    {0, 1}; visual ids per batch element (sorted runs, scattered), each with a padded
    (-1) tail; kv ids equal to q ids but for a few tokens."""
    rng = np.random.default_rng(seed)
    a = harness.attention_inputs(B, T + S, H, D, H_kv=H_kv, rng=rng, sinks=sinks)
    if segments:
        a["seg"] = harness.joint_segment_ids(rng, B, T, S, pad=(max(S // 5, 1), max(S // 8, 1)))
        seg_kv = a["seg"].copy()
        flip = rng.random(seg_kv.shape) < 0.15
        seg_kv[flip] = rng.integers(0, 2, flip.sum())
        a["seg_kv"] = seg_kv
    return a


def _run(cfg: Joint, a: dict):
    """Runs the joint ring on global arrays `a` (`harness.run_joint`: the text cotangent
    split over the n copies in random shares that sum to it); global-order NumPy
    results, plus the text output rows of every device (`out_text`, `(B, n, T, H, D)`)."""
    return harness.run_joint(_joint_fn(cfg), a, cfg.n, cfg.text_len,
                             zigzag_size=cfg.n if cfg.layout == "zigzag" else 0,
                             segments=_segments(cfg), sinks=cfg.sinks)


def _check(cfg: Joint, a: dict):
    seg = None
    if cfg.segments:
        seg = a["seg"] if cfg.segments == "shared" else (a["seg"], a["seg_kv"])
    ref = oracle.attention(a["q"], a["k"], a["v"], segment_ids=seg, sinks=a.get("sinks"),
                           causal=cfg.causal, window=cfg.window, dout=a["dout"])
    got = _run(cfg, a)
    harness.assert_matches(got, ref, np.float32,
                           harness.ATTENTION_NAMES + (("dsinks",) if cfg.sinks else ()))
    harness.assert_copies_equal(got["out_text"])  # the text rows: bitwise the same everywhere


# -- output and gradients against the oracle ---------------------------------------


@pytest.mark.parametrize(
    "cfg, shape",
    [
        # Padding (-1) in the visual ids, text ids of their own; GQA; sinks.
        (Joint(n=8, text_len=5, segments="shared", sinks=True), dict(T=5, S=16, H_kv=2)),
        # Causal: the text (positions 0..T-1) sees no visual key. MQA, unchecked
        # shard_map (its other transpose), sinks.
        (Joint(n=8, text_len=3, layout="zigzag", causal=True, sinks=True, check_vma=False),
         dict(T=3, S=32, H_kv=1)),
        # A window that lets some visual tokens see the text and some text see
        # visual tokens; SegmentIds(q=..., kv=...); batch over "dp" on a 2 x 4 mesh.
        (Joint(n=4, dp=2, text_len=4, layout="zigzag", window=(6, 2), segments="pair"),
         dict(T=4, S=8, H_kv=2)),
    ],
    ids=["contiguous-segments-gqa-sinks", "zigzag-causal-mqa-sinks-unchecked", "dp2-zigzag-window-pair"],
)
def test_joint_matches_oracle(cfg, shape):
    a = _inputs(**shape, segments=cfg.segments is not None, sinks=cfg.sinks, seed=cfg.n + cfg.text_len)
    if cfg.segments:
        assert (a["seg"][:, shape["T"]:] < 0).any()  # padding tokens in the visual part
    _check(cfg, a)


def test_text_only():
    """`text_len == q.shape[1]`: no visual tokens, no communication."""
    cfg = Joint(n=8, text_len=4, causal=True, segments="shared", sinks=True)
    _check(cfg, _inputs(T=4, S=0, H_kv=2, segments=True, sinks=True, seed=40))


def test_text_len_zero_is_plain_ring():
    """`text_len=0` lowers to exactly the program of a call without it, and matches
    the oracle through this file's harness."""
    mesh = harness.mesh(sp=4)
    x = jnp.ones((1, 8, 4, 8))

    def lowered(**kw):
        f = lambda q: parallel.ring_attention(q, q, q, ring_axis=SP, causal=True, **kw)  # noqa: E731
        g = jax.shard_map(f, mesh=mesh, in_specs=P(None, SP), out_specs=P(None, SP))
        return jax.jit(jax.grad(lambda q: g(q).sum())).lower(x).as_text()

    assert lowered(text_len=0) == lowered()
    cfg = Joint(n=4, text_len=0, causal=True, segments="shared", sinks=True)
    _check(cfg, _inputs(T=0, S=16, H_kv=2, segments=True, sinks=True, seed=41))


# -- communication: the text never travels the ring ---------------------------------


def test_text_never_travels_the_ring():
    """Every collective-permute of the forward + backward program carries a visual
    block only: K/V (stacked), their segment ids, or dK/dV, each of the visual local
    length L, plus the few ordering-token elements `vidax_eqx._order` packs into
    the same flat buffer. A block with the text would be much larger."""
    cfg = Joint(n=4, text_len=5, segments="shared", sinks=True)
    B, T, L, H, H_kv, D = 2, 5, 2, 4, 2, 8
    a = _inputs(B=B, T=T, S=cfg.n * L, H=H, H_kv=H_kv, D=D, segments=True, sinks=True)
    text = tuple(jnp.asarray(a[x][:, :T]) for x in ("q", "k", "v"))
    visual = tuple(jnp.asarray(a[x][:, T:]) for x in ("q", "k", "v"))
    seg = (jnp.asarray(a["seg"][:, :T]), jnp.asarray(a["seg"][:, T:]))
    dout = jnp.ones((B, cfg.n * (T + L), H, D))
    hlo = _joint_fn(cfg).lower(text, visual, seg, jnp.asarray(a["sinks"]), dout).as_text()

    tokens = 8  # at most this many ordering elements ride along
    visual_sizes = {"f32": 2 * B * L * H_kv * D, "i32": B * L}  # K/V (dK/dV) stacked; ids
    with_text = {"f32": 2 * B * (T + L) * H_kv * D, "i32": B * (T + L)}
    for dtype in visual_sizes:  # the shapes tell the two apart
        assert with_text[dtype] > visual_sizes[dtype] + tokens
    permutes = re.findall(r"collective_permute.*?:\s*\(tensor<(\d+)x(f32|i32)>\)", hlo)
    assert {dtype for _, dtype in permutes} == {"f32", "i32"}, permutes  # K/V and ids travel
    for size, dtype in permutes:
        assert 0 <= int(size) - visual_sizes[dtype] <= tokens, (size, dtype)
    assert "all_gather" in hlo  # the text rows' partial results over the visual chunks


# -- errors -------------------------------------------------------------------------


def _trace(n=4, S_local=6, H=4, H_kv=4, L_k=None, **kw):
    """Traces `ring_attention` on a ring of `n` with per-device length `S_local`."""
    mesh = harness.mesh(sp=n)
    L_k = S_local if L_k is None else L_k
    f = lambda q, k: parallel.ring_attention(q, k, k, ring_axis=SP, **kw)  # noqa: E731
    g = jax.shard_map(f, mesh=mesh, in_specs=(P(None, SP),) * 2, out_specs=P(None, SP))
    jax.eval_shape(g, jnp.ones((1, n * S_local, H, 8)), jnp.ones((1, n * L_k, H_kv, 8)))


@pytest.mark.parametrize(
    "text_len, match",
    [(-1, r"`text_len` must be between 0 and the per-device sequence length 6 .*received text_len=-1"),
     (7, r"`text_len` must be between 0 and the per-device sequence length 6 .*received text_len=7"),
     (2.0, r"`text_len` must be a Python int .*received float 2\.0"),
     (True, r"`text_len` must be a Python int .*received bool True")],
)
def test_bad_text_len(text_len, match):
    with pytest.raises(ValueError, match=match):
        _trace(text_len=text_len)


def test_zigzag_odd_visual_length():
    with pytest.raises(ValueError, match=r"even visual local length q\.shape\[1\] - text_len .*"
                                         r"received 3\. Pad the global visual sequence to a "
                                         r"multiple of 2 \* sp_size = 8"):
        _trace(S_local=6, text_len=3, layout="zigzag")
    _trace(S_local=7, text_len=3, layout="zigzag")  # an odd text is fine: 4 visual tokens


def test_joint_needs_self_attention_shapes():
    with pytest.raises(ValueError, match=r"ring_attention: self-attention needs `q` and `k`/`v`"):
        _trace(S_local=6, L_k=5, text_len=2)


def test_joint_bad_segment_ids_and_sinks():
    with pytest.raises(ValueError, match="segment_ids"):
        _trace(text_len=2, segment_ids=jnp.zeros((1, 4), jnp.int32))  # the visual part only
    with pytest.raises(ValueError, match=r"`sinks` must be a float array of shape \(H,\)"):
        _trace(text_len=2, sinks=jnp.ones((3,)))
