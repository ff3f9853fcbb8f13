"""Sliding tile attention (`kernels.SlidingTileMask`) on the sharded paths, against
the float64 oracle.

The mask's dense form is built by `oracle.sliding_tile_of` (as in `test_sparse.py`),
from the documented semantics and nothing of `vidax_eqx`: the video's tokens laid out tile by
tile, each grid dimension padded to whole tiles, a text prefix; query tile `(a, b, c)`
sees the key tiles whose coordinate along each dimension lies in `[s, s + w)`,
`s = clip(a - w // 2, 0, n - w)`, `w = min(window, n)`; text sees and is seen by
every real token; padding (the tiles' and the global sequence's past `seq_len`)
sees nothing and is seen by nothing. `oracle.attention` takes it as a boolean mask
over the whole padded sequence `[text; video]`.

Every sharded path runs inside `jax.shard_map` on 4 simulated CPU devices in one
shape: each device holds `[text prefix (replicated input, empty without text);
its chunk of the visual sequence]` (zigzag: permuted first; `harness.joint_vjp`).
The text cotangent is split over the devices' copies of the text rows in random
shares, the gradients of the replicated text inputs are summed over the devices by
`shard_map`. Forward and gradients of
q, k, v and sinks (random cotangent) are compared with the oracle for:

1. `ring_attention`: contiguous / zigzag, shared / per-head windows, GQA, a grid
   that does not divide the tile, the global sequence padded, the joint layout
   (text prefix), sinks; then the ring's plan (skipped steps for a local window,
   its work below full attention's and equal to the visible chunks'; zigzag
   balancing a causal tile mask).
2. Ulysses (`sequence_parallel_self_attention` with padding and segment ids,
   `sequence_parallel_joint_self_attention`), 8 per-head windows on 4 devices.
3. USP (`U = R = 2`), plain (zigzag) and joint, per-head windows.
4. `make_ring_attention` with the tile mask, `CausalMask() & tm`, `DenseMask & tm`.
5. `nn.Attention` (ring x TP, per-head windows; forward) and `nn.JointAttention`
   (Ulysses; forward and gradients) with `mask=` equal to the unsharded module call.
6. The errors.

Shapes stay tiny (D = 8, at most 8 heads, < 100 tokens) and each configuration
compiles once (`_sharded_fn` caches it).
"""

import dataclasses
import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import oracle
from vidax_eqx import kernels, nn, parallel
from vidax_eqx.parallel import _schedule


F32 = np.float32
SP, TP, RING = parallel.SP_AXIS, parallel.TP_AXIS, "ring"
SEQ = P(None, SP)  # (B, S, ...) arrays: the sequence over "sp"
N = 4  # devices on the sequence (U * R for USP)
B, D = 2, 8
# Tiles (3, 2, 3): height and width do not divide the tile; 72 video tokens.
GRID, TILE = (3, 3, 5), (1, 2, 2)
# Tiles (3, 3, 2) of 3 tokens: 54 video tokens, not a multiple of the 4 devices.
TILE3 = (1, 1, 3)
PER_HEAD = ((1, 1, 3), (3, 1, 1), (1, 1, 1), (3, 3, 3))
PER_HEAD8 = PER_HEAD + ((1, 3, 1), (3, 3, 1), (1, 1, 3), (3, 1, 3))  # 4 ranks, 4 pairs
TEXT = 3


# ------------------------------------------------------------------ the dense oracle mask


def _multiple(need: int, m: int) -> int:
    """The smallest multiple of `m` that is at least `need`."""
    return oracle.ceil_div(need, m) * m


def _tm(window, text_len=0, tile=TILE):
    return kernels.SlidingTileMask(GRID, tile, window, text_len)


def _dense(window, text_len=0, tile=TILE, length=None):
    """The sliding tile mask (`oracle.sliding_tile_of`) as bool `(n_windows, length,
    length)` over `[text prefix; video]`: positions at or past the layout's length
    (`length`, default that length) are padding."""
    pos = None if length is None else np.arange(length)
    return oracle.sliding_tile_of(_tm(window, text_len, tile), pos, pos)


# A dense (S, S) mask for `DenseMask & tm`: fixed, random, about 70% of pairs visible.
_S_KERNEL = _tm((3, 1, 1)).seq_len
DENSE = np.random.default_rng(7).random((_S_KERNEL, _S_KERNEL)) < 0.7


# ------------------------------------------------------------------ the sharded runner


@dataclasses.dataclass(frozen=True)
class Case:
    """One static configuration (hashable: the cache key of `_sharded_fn`)."""

    path: str  # "ring" | "ulysses" | "usp" | "kernel" (make_ring_attention)
    window: tuple  # one triple, or one per head
    length: int  # the global visual length, padding included
    layout: str = "contiguous"
    text_len: int = 0
    tile: tuple = TILE
    heads: tuple = (4, 2)  # (H, H_kv)
    sinks: bool = False
    segments: bool = False
    kernel_mask: str = "tile"  # "kernel" path: "tile" | "causal" | "dense"

    @property
    def mask(self):
        return _tm(self.window, self.text_len, self.tile)

    @property
    def axes(self):
        return (RING, SP) if self.path == "usp" else SP

    def mesh(self):
        if self.path == "usp":
            return harness.mesh(sp=2, **{RING: 2})
        return harness.mesh(sp=N)

    def zigzag_size(self):
        """`zigzag_permute`'s size (the ring's), or 0 for the contiguous layout."""
        if self.layout != "zigzag":
            return 0
        return 2 if self.path == "usp" else N


def _kernel(case: Case):
    tm = case.mask
    mask = {"tile": lambda: tm,
            "causal": lambda: parallel.CausalMask() & tm,
            "dense": lambda: parallel.DenseMask(DENSE) & tm}[case.kernel_mask]()
    return parallel.make_ring_attention(mask, ring_axis=SP, layout=case.layout,
                                        implementation="xla")


def _attend(case: Case, q, k, v, seg, sinks):
    tm, T = case.mask, case.text_len
    common = {"segment_ids": seg, "sinks": sinks, "implementation": "xla"}
    if case.path == "ring":
        return parallel.ring_attention(q, k, v, ring_axis=SP, mask=tm, layout=case.layout,
                                       text_len=T, **common)
    if case.path == "ulysses":
        if T:
            return parallel.sequence_parallel_joint_self_attention(q, k, v, T, SP, mask=tm,
                                                                   **common)
        return parallel.sequence_parallel_self_attention(q, k, v, SP, mask=tm, **common)
    if case.path == "usp":
        return parallel.usp_attention(q, k, v, ulysses_axis=SP, ring_axis=RING, mask=tm,
                                      layout=case.layout, text_len=T, **common)
    assert T == 0
    return _kernel(case)(q, k, v, segment_ids=seg, sinks=sinks)


@functools.cache
def _sharded_fn(case: Case):
    """A jitted `(text, visual, seg, sinks, dout) -> (out, grads)` (`harness.joint_vjp`):
    `text = (qt, kt, vt)` replicated (empty without text), `visual = (qv, kv, vv)`
    sharded, `seg = (seg_t, seg_v)` or None; `out` the per-device `[text; visual chunk]`
    rows side by side."""
    return harness.joint_vjp(functools.partial(_attend, case), case.mesh(), case.axes,
                             segments="one" if case.segments else None, sinks=case.sinks,
                             compiler_options=harness.FAST_COMPILE)  # tiny programs


def _inputs(case: Case, seed: int = 0) -> dict:
    """Global float32 arrays over `[text; visual (padded)]`. Segment ids: sorted runs of
    two ids over the real tokens, padding (-1) on the last few real tokens and on the
    global sequence's padding."""
    rng = np.random.default_rng(seed)
    H, H_kv = case.heads
    S = case.text_len + case.length
    a = harness.attention_inputs(B, S, H, D, H_kv=H_kv, rng=rng, sinks=case.sinks)
    if case.segments:
        a["seg"] = harness.segment_ids(rng, B, S, ids=2, scattered=False, pad=(0, 0))
        a["seg"][:, case.mask.seq_len - 5:] = -1
    return a


def _run(case: Case, a: dict) -> dict:
    """Runs the case on global arrays `a` (`harness.run_joint`; the text cotangent split
    over the devices' copies of the text rows); global-order NumPy results, and the text
    rows of every device (`out_text`, `(B, N, T, H, D)`)."""
    return harness.run_joint(_sharded_fn(case), a, N, case.text_len,
                             zigzag_size=case.zigzag_size(),
                             segments="one" if case.segments else None, sinks=case.sinks)


def _oracle_mask(case: Case) -> np.ndarray:
    S = case.text_len + case.length
    mask = _dense(case.window, case.text_len, case.tile, S)
    if case.path == "kernel" and case.kernel_mask == "causal":
        mask = mask & np.tril(np.ones((S, S), bool))
    if case.path == "kernel" and case.kernel_mask == "dense":
        mask = mask & DENSE
    return mask


def _check(case: Case, seed: int = 0):
    a = _inputs(case, seed)
    ref = oracle.attention(a["q"], a["k"], a["v"], mask=_oracle_mask(case),
                           segment_ids=a.get("seg"), sinks=a.get("sinks"), dout=a["dout"])
    got = _run(case, a)
    names = harness.ATTENTION_NAMES + (("dsinks",) if case.sinks else ())
    harness.assert_matches(got, ref, F32, names)
    harness.assert_copies_equal(got["out_text"])  # the text rows: bitwise the same everywhere


def _ring_length(need: int, layout: str) -> int:
    """The global length: whole tiles per device (zigzag: per half), padded at the end."""
    parts = 2 if layout == "zigzag" else 1
    return _multiple(need, parts * N * math.prod(TILE))


VIDEO = _tm((1, 1, 1)).video_len  # 72
VIDEO3 = _tm((1, 1, 1), tile=TILE3).video_len  # 54


# -- 1. ring_attention --------------------------------------------------------------------


RING_CASES = {
    # 72 -> 80 tokens (20 per device), GQA, one window for all heads, sinks.
    "contiguous-shared-gqa-sinks": Case("ring", (3, 1, 3), _ring_length(VIDEO, "contiguous"),
                                        sinks=True),
    # 72 -> 96 tokens (half-chunks of 3 tiles), per-head windows, GQA.
    "zigzag-per-head-gqa": Case("ring", PER_HEAD, _ring_length(VIDEO, "zigzag"), layout="zigzag"),
    # [text (3); visual 72 -> 80], per-head windows, MQA.
    "joint-contiguous-per-head": Case("ring", PER_HEAD, _ring_length(VIDEO, "contiguous"),
                                      text_len=TEXT, heads=(4, 1)),
    # [text (3); visual 72 -> 96], zigzag, shared window, sinks.
    "joint-zigzag-shared-sinks": Case("ring", (1, 1, 3), _ring_length(VIDEO, "zigzag"),
                                      layout="zigzag", text_len=TEXT, sinks=True),
}


@pytest.mark.parametrize("name", list(RING_CASES))
def test_ring_matches_oracle(name):
    case = RING_CASES[name]
    assert case.length > case.mask.video_len  # the global sequence is padded
    _check(case)


# A long frame axis of one-tile frames: a local window hides most of the ring.
FRAMES = kernels.SlidingTileMask((16, 2, 2), (1, 2, 2), (3, 1, 1))  # 16 tiles, 64 tokens


def _visible_chunks(dense: np.ndarray, chunks: int) -> np.ndarray:
    """`(chunks, chunks)`: whether any (query, key) pair of a chunk pair is visible."""
    S = dense.shape[-1]
    c = S // chunks
    return dense.any(0).reshape(chunks, c, chunks, c).any(axis=(1, 3))


def test_ring_plan_skips_the_steps_a_local_window_hides():
    S = FRAMES.seq_len
    L = S // N
    dense = oracle.sliding_tile_of(FRAMES)
    plan = _schedule.tile_plan(FRAMES, "contiguous", N, L, L, False, None)
    assert plan.shape == (N, N) and (plan == _schedule.SKIP).any()
    # Contiguous: each device computes exactly the key blocks the mask does not hide.
    work = parallel.make_ring_attention(FRAMES, ring_axis=SP).work(N)
    table = _visible_chunks(dense, N)
    np.testing.assert_array_equal(work, L * L * table.sum(1))
    assert (table.sum(1) < N).any()
    full = parallel.ring_work(S, N)
    assert work.sum() < full.sum() and (work <= full).all()
    # Zigzag: hidden half-blocks are skipped too (a step computes the smallest of its
    # block, one query half, or one key half that covers the visible half-blocks).
    zz = parallel.make_ring_attention(FRAMES, ring_axis=SP, layout="zigzag").work(N)
    halves = _visible_chunks(dense, 2 * N)
    exact = np.array([halves[[r, 2 * N - 1 - r]].sum() for r in range(N)]) * (L // 2) ** 2
    assert (zz >= exact).all() and zz.sum() < full.sum()


def test_zigzag_balances_causal_tile_work():
    """A causal tile mask (a window of 9 of the 16 frames): the contiguous ring loads
    the last device most, the zigzag one spreads the work evenly. (A local window
    alone leaves the two ends of the sequence with less work, and zigzag gives both
    to device 0: no layout balances that.)"""
    tm = dataclasses.replace(FRAMES, window=(9, 1, 1))
    mask = parallel.CausalMask() & tm
    contiguous = parallel.make_ring_attention(mask, ring_axis=SP).work(N)
    zigzag = parallel.make_ring_attention(mask, ring_axis=SP, layout="zigzag").work(N)
    balance = lambda w: w.max() / w.mean()
    assert balance(zigzag) <= 1.1 < balance(contiguous), (zigzag, contiguous)
    # Full attention's work, for scale: both skip what the causal tile mask hides.
    full = parallel.ring_work(tm.seq_len, N).sum()
    assert zigzag.sum() < full and contiguous.sum() < full


# -- 2. Ulysses -----------------------------------------------------------------------


ULYSSES_CASES = {
    # 54 tokens padded to 56 (pad < sp), segment ids with padding, 8 heads (2 per device,
    # every device its own windows), GQA with kv repetition.
    "plain-padded-segments": Case("ulysses", PER_HEAD8, _multiple(VIDEO3, N), tile=TILE3,
                                  heads=(8, 2), segments=True),
    # [text (3); visual 54 -> 56], per-head windows, sinks.
    "joint-sinks": Case("ulysses", PER_HEAD8, _multiple(VIDEO3, N), tile=TILE3,
                        text_len=TEXT, heads=(8, 4), sinks=True),
}


@pytest.mark.parametrize("name", list(ULYSSES_CASES))
def test_ulysses_matches_oracle(name):
    _check(ULYSSES_CASES[name])


# -- 3. USP ---------------------------------------------------------------------------


USP_CASES = {
    # U = R = 2, zigzag over the ring: 72 -> 80 (half-chunks of 5 tiles), sinks.
    "plain-zigzag-sinks": Case("usp", PER_HEAD, 80, layout="zigzag", sinks=True),
    # [text (3); visual 72 -> 76]: a multiple of U * R, padded by less than R tiles;
    # per-head windows, the same on both Ulysses ranks (no switch: half the compile).
    "joint-contiguous": Case("usp", PER_HEAD[:2] * 2, 76, text_len=TEXT),
}


@pytest.mark.parametrize("name", list(USP_CASES))
def test_usp_matches_oracle(name):
    _check(USP_CASES[name])


# -- 4. make_ring_attention -----------------------------------------------------------


KERNEL_CASES = {
    # Per-head windows, the global sequence padded (72 -> 80), sinks.
    "tile": Case("kernel", PER_HEAD, 80, sinks=True),
    "causal&tile": Case("kernel", PER_HEAD, VIDEO, kernel_mask="causal"),
    "dense&tile": Case("kernel", (3, 1, 1), VIDEO, kernel_mask="dense", heads=(2, 2)),
}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_make_ring_attention_matches_oracle(name):
    _check(KERNEL_CASES[name])


# -- 5. nn modules --------------------------------------------------------------------


DIM, HEADS = 32, 4  # head_dim = D


def test_attention_module_ring_tp_per_head_windows():
    """`sequence="ring"` x TP = 2: heads 0-1 on TP rank 0, 2-3 on rank 1, each rank its
    own windows (a switch on the TP rank around every step's kernel; its gradient is
    the one USP's per-Ulysses-rank windows check above). Sharded equal to unsharded."""
    tm = _tm(PER_HEAD)
    attn = nn.Attention(DIM, HEADS, implementation="xla", key=jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, tm.seq_len, DIM)), F32)
    call = lambda m, x: jax.vmap(lambda x: m(x, mask=tm))(x)
    sharded = nn.sharding.with_parallel(attn, nn.sharding.ParallelConfig(sequence="ring", tp_axis=TP))
    f = nn.sharding.filter_shard_map(call, mesh=harness.mesh(sp=2, tp=2),
                            in_specs=(nn.sharding.partition_specs(sharded), SEQ), out_specs=SEQ)
    run = functools.partial(eqx.filter_jit, compiler_options=harness.FAST_COMPILE)
    oracle.assert_close(run(f)(sharded, x), run(call)(attn, x), F32, "ring x tp")


def test_joint_attention_module_ulysses_shared_window():
    """`sequence="ulysses"`, a shared window over `[context; x]`: the video output, every
    device's copy of the text output, and the gradients of `x` and `context`."""
    tm = _tm((3, 1, 3), text_len=TEXT)
    joint = nn.JointAttention(DIM, HEADS, implementation="xla", key=jax.random.key(2))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((1, tm.video_len, DIM)), F32)
    c = jnp.asarray(rng.standard_normal((1, TEXT, DIM)), F32)
    ct_x = jnp.asarray(rng.standard_normal(x.shape), F32)
    ct_c = jnp.asarray(rng.standard_normal(c.shape), F32)
    call = lambda m, x, c: jax.vmap(lambda x, c: m(x, c, mask=tm))(x, c)
    sharded = nn.sharding.with_parallel(joint, nn.sharding.ParallelConfig(sequence="ulysses"))

    def per_device(m, x, c):
        xo, co = call(m, x, c)
        return xo, co[None]  # every device's copy of the text output

    f = nn.sharding.filter_shard_map(per_device, mesh=harness.mesh(sp=N),
                            in_specs=(nn.sharding.partition_specs(sharded), SEQ, P()),
                            out_specs=(SEQ, P(SP)))

    @functools.partial(eqx.filter_jit, compiler_options=harness.FAST_COMPILE)
    def run(fn, m, copies):
        def loss(x, c):
            xo, co = fn(m, x, c)
            text = co[0] if copies else co  # the whole text cotangent on device 0's copy
            return jnp.sum(xo * ct_x) + jnp.sum(text * ct_c), (xo, co)
        return jax.grad(loss, argnums=(0, 1), has_aux=True)(x, c)

    (dx, dc), (xo, copies) = run(f, sharded, True)
    (dx_1, dc_1), (xo_1, co_1) = run(call, joint, False)
    harness.assert_trees_close((xo, dx, dc), (xo_1, dx_1, dc_1), F32,
                               "joint ulysses: (x_out, dx, dcontext)")
    for i in range(copies.shape[0]):
        oracle.assert_close(copies[i], co_1, F32, f"context_out copy {i}")


# -- 6. errors ------------------------------------------------------------------------


def _trace(fn, mesh, *arrays, spec=SEQ):
    """Traces `fn` inside `shard_map` (no compilation): raises what tracing raises."""
    return jax.eval_shape(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec), *arrays)


def _zeros(S, H=4, H_kv=None):
    return (jax.ShapeDtypeStruct((1, S, H, D), F32),
            *[jax.ShapeDtypeStruct((1, S, H if H_kv is None else H_kv, D), F32)] * 2)


def test_wrong_global_length_raises():
    tm = _tm((3, 1, 1))  # 72 tokens; the ring pads by fewer than 4 tiles (16 tokens)
    mesh = harness.mesh(sp=N)
    ring = lambda q, k, v: parallel.ring_attention(q, k, v, ring_axis=SP, mask=tm)
    for S in (64, 88):
        with pytest.raises(ValueError, match=r"ring_attention: the SlidingTileMask lays out 72"):
            _trace(ring, mesh, *_zeros(S))
    uly = lambda q, k, v: parallel.sequence_parallel_self_attention(q, k, v, SP, mask=tm)
    with pytest.raises(ValueError, match=r"SlidingTileMask lays out 72"):
        _trace(uly, mesh, *_zeros(76))
    kernel = parallel.make_ring_attention(tm, ring_axis=SP)
    with pytest.raises(ValueError, match=r"SlidingTileMask"):
        _trace(lambda q, k, v: kernel(q, k, v), mesh, *_zeros(96))


def test_joint_layout_needs_the_masks_text_len():
    tm = _tm((3, 1, 1), text_len=TEXT - 1)
    mesh = harness.mesh(sp=N)
    arrays = _zeros(N * (TEXT + 19))  # visual 76: fits every path's padding
    fns = {
        "ring_attention": lambda q, k, v: parallel.ring_attention(
            q, k, v, ring_axis=SP, mask=tm, text_len=TEXT),
        "sequence_parallel_joint_self_attention": lambda q, k, v:
            parallel.sequence_parallel_joint_self_attention(q, k, v, TEXT, SP, mask=tm),
    }
    for name, fn in fns.items():
        with pytest.raises(ValueError, match=rf"{name}.*needs text_len={TEXT}"):
            _trace(fn, mesh, *arrays)
    usp = lambda q, k, v: parallel.usp_attention(
        q, k, v, ulysses_axis=SP, ring_axis=RING, mask=tm, text_len=TEXT)
    with pytest.raises(ValueError, match=rf"needs text_len={TEXT}"):
        _trace(usp, harness.mesh(sp=2, **{RING: 2}), *arrays,
               spec=P(None, (RING, SP)))


def test_per_head_window_count_must_be_the_head_count():
    tm = _tm(PER_HEAD)  # 4 windows
    mesh = harness.mesh(sp=N)
    fns = {
        "ring_attention": lambda q, k, v: parallel.ring_attention(q, k, v, ring_axis=SP, mask=tm),
        "sequence_parallel_self_attention": lambda q, k, v:
            parallel.sequence_parallel_self_attention(q, k, v, SP, mask=tm),
    }
    for name, fn in fns.items():
        with pytest.raises(ValueError, match=rf"{name}: .*received 4 windows for H = 8 heads"):
            _trace(fn, mesh, *_zeros(80, H=8, H_kv=2))
    attn = nn.Attention(DIM, 8, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"Attention: .*received 4 windows for H = 8 heads"):
        jax.eval_shape(lambda x: attn(x, mask=tm), jax.ShapeDtypeStruct((tm.seq_len, DIM), F32))


def test_differing_per_tp_rank_windows_under_ulysses_raise():
    tm = _tm(PER_HEAD)  # TP rank 0: heads 0-1, rank 1: heads 2-3, other windows
    attn = nn.sharding.with_parallel(nn.Attention(DIM, HEADS, key=jax.random.key(0)),
                            nn.sharding.ParallelConfig(sequence="ulysses", tp_axis=TP))
    f = nn.sharding.filter_shard_map(lambda m, x: jax.vmap(lambda x: m(x, mask=tm))(x),
                            mesh=harness.mesh(sp=2, tp=2),
                            in_specs=(nn.sharding.partition_specs(attn), SEQ), out_specs=SEQ)
    x = jax.ShapeDtypeStruct((1, tm.seq_len, DIM), F32)
    with pytest.raises(NotImplementedError, match=r"differ between tensor-parallel ranks"):
        eqx.filter_eval_shape(f, attn, x)


def test_dense_and_per_head_tile_mask_raises():
    tm = _tm(PER_HEAD)
    kernel = parallel.make_ring_attention(parallel.DenseMask(DENSE) & tm, ring_axis=SP)
    with pytest.raises(NotImplementedError, match=r"per-head windows runs alone"):
        _trace(lambda q, k, v: kernel(q, k, v), harness.mesh(sp=N), *_zeros(VIDEO))


def test_documented_api_entry_points_take_the_mask():
    """`core.dot_product_attention` (one device and the Megatron `mesh=` path, per-head
    windows following the TP ranks) and the linen shim's `attention_fn` take it."""
    from vidax_eqx import core, flax as vflax

    tm = kernels.SlidingTileMask((3, 4, 4), (1, 2, 2), [(3, 1, 1), (1, 1, 3), (1, 1, 1), (3, 3, 3)])
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, tm.seq_len, 4, 8)), jnp.float32)
    ref = kernels.attention(q, q, q, mask=tm, implementation="xla")
    mesh = harness.mesh(dp=2, tp=2)
    for out in (core.dot_product_attention(q, q, q, mask=tm, mesh=mesh),
                core.dot_product_attention(q, q, q, mask=tm),
                vflax.attention_fn(q, q, q, mask=tm)):
        np.testing.assert_allclose(out, ref, atol=1e-5)
