"""Sliding tile attention (`kernels.SlidingTileMask`) against the float64 oracle.

The mask's dense form is built by `oracle.sliding_tile_dense`, from the documented semantics
and nothing of `vidax_eqx`: the video's tokens laid out tile by tile, each grid
dimension padded to whole tiles, text before or after the video; query tile
`(a, b, c)` sees the key tiles whose coordinate along each dimension lies in
`[s, s + w)`, `s = clip(a - w // 2, 0, n - w)`, `w = min(window, n)`; text sees
and is seen by every real token; padding sees nothing and is seen by nothing.
`oracle.attention` takes it as a boolean mask.

Checked, for `"xla"` and `Blockwise` with small blocks (several blocks, the text
filler path): forward `out` / `lse` and the gradients of q, k, v and sinks (by
`jax.vjp` of `attention_fwd` with a random cotangent on `(out, lse)`), on grids
that do and do not divide the tiles, text prefix / suffix, shared and per-head
windows, GQA, windows larger than the grid, segment ids with padding, sinks, and
explicit positions (a chunk of the sequence). Then `block_map` against the dense
mask, the tile layout (`tile_permute`, `tile_unpermute`, `tile_positions`),
`density`, the errors, and a hypothesis property over drawn masks.
"""

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import harness
import oracle
from _hypothesis import examples
from vidax_eqx import kernels
from vidax_eqx.kernels._tile_tables import block_map


F32 = np.float32
BLOCKWISE = kernels.Blockwise(block_q=16)
IMPLS = [pytest.param("xla", id="xla"), pytest.param(BLOCKWISE, id="blockwise16")]


# ------------------------------------------------------------------ the dense oracle mask


sta_dense = oracle.sliding_tile_dense
dense_of = oracle.sliding_tile_of  # the mask's configuration, read from its fields only


def test_dense_oracle_by_hand():
    """`sta_dense` on a case small enough to write out: a 1 x 1 x 5 grid of
    2-token tiles (three tiles, the last half padding), window 1, one text token."""
    vis = sta_dense((1, 1, 5), (1, 1, 2), [(1, 1, 1)], text_len=1)[0]
    # Positions: text, tile 0 = (1, 2), tile 1 = (3, 4), tile 2 = (5, padding 6).
    want = np.zeros((7, 7), bool)
    want[0, :6] = want[:6, 0] = True
    for block in ((1, 2), (3, 4)):
        want[np.ix_(block, block)] = True
    want[5, 5] = True
    np.testing.assert_array_equal(vis, want)
    # Window 3 over three tiles covers everything real; suffix text moves to the end.
    vis = sta_dense((1, 1, 5), (1, 1, 2), [(1, 1, 3)], text_len=1, text_position="suffix")[0]
    real = np.array([1, 1, 1, 1, 1, 0, 1], bool)
    np.testing.assert_array_equal(vis, real[:, None] & real[None, :])


# --------------------------------------------------------------------- inputs and runs


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    grid: tuple
    tile: tuple
    window: tuple  # one triple, or one per query head
    text_len: int = 0
    text_position: str = "prefix"
    B: int = 1
    H: int = 2
    H_kv: int = 2
    D: int = 8
    segments: bool = False
    sinks: bool = False

    def mask(self) -> kernels.SlidingTileMask:
        return kernels.SlidingTileMask(
            self.grid, self.tile, self.window, text_len=self.text_len, text_position=self.text_position
        )


CONFIGS = [
    # Dividing grid; a text prefix of 5 (filler up to the 16-token block boundary);
    # window wider than the grid along W; GQA; segment ids; sinks.
    Config("divides-prefix-gqa-segments-sinks", (4, 6, 4), (2, 2, 2), (1, 1, 3), text_len=5,
           B=2, H=4, H_kv=2, segments=True, sinks=True),
    # Ragged grid (5 and 3 are not multiples of 2); 18 tiles of 4 tokens, so the
    # suffix starts mid-block (filler); per-head windows with GQA; segment ids.
    Config("ragged-suffix-perhead-gqa-segments", (3, 5, 3), (1, 2, 2),
           ((1, 1, 1), (3, 1, 1), (1, 3, 1), (3, 3, 5)), text_len=3, text_position="suffix",
           B=2, H=4, H_kv=2, segments=True),
]


def _seed(obj) -> int:
    return zlib.crc32(repr(obj).encode())


def _segment_ids(rng, B: int, S: int) -> np.ndarray:
    """Sorted runs of ids 0..2 with a few negative (padding) ids scattered in."""
    ids = harness.segment_ids(rng, B, S, scattered=False, pad=(0, 0), holes=0.1)
    ids[:, -2:] = -3
    return ids


# The property test's programs (each example is a new static mask, hence a new
# compilation) compile with `harness.FAST_COMPILE`, which halves the compile time of a
# blockwise program and changes no semantics. The fixed cases compile as users do.


def run_kernel(impl, tm, a, q_pos=None, kv_pos=None, grads=True, compiler_options=None):
    """`out, lse` of `attention_fwd` and the VJP of `(out, lse)` w.r.t. q, k, v, sinks
    with cotangent `(dout, dlse)` (`None` unless `grads`), in one jitted program;
    NumPy results."""
    kw = {"mask": tm, "implementation": impl}
    if "seg" in a:
        kw["segment_ids"] = jnp.asarray(a["seg"])
    if q_pos is not None:
        kw["q_positions"], kw["kv_positions"] = jnp.asarray(q_pos), jnp.asarray(kv_pos)

    def f(q, k, v, sinks, dout, dlse):
        fwd = lambda q, k, v, sinks: kernels.attention_fwd(q, k, v, sinks=sinks, **kw)
        if not grads:
            return *fwd(q, k, v, sinks), None
        (out, lse), vjp = jax.vjp(fwd, q, k, v, sinks)
        return out, lse, vjp((dout, dlse))

    args = [jnp.asarray(a[n]) if n in a else None for n in ("q", "k", "v", "sinks", "dout", "dlse")]
    res = jax.jit(f).lower(*args).compile(compiler_options)(*args)
    return jax.tree.map(np.asarray, res)


def run_oracle(a, dense):
    """`oracle.attention` with the dense mask `(n_windows, S_q, S_k)`: one window is
    broadcast over the heads, several are one per head."""
    mask = dense[0] if len(dense) == 1 else dense
    seg = (a["seg"], a["seg"]) if "seg" in a else None
    return oracle.attention(a["q"], a["k"], a["v"], mask=mask, sinks=a.get("sinks"), segment_ids=seg,
                            dout=a["dout"], dlse=a["dlse"])


def check(got, ref, sinks: bool):
    out, lse, grads = got
    assert out.dtype == F32 and lse.dtype == F32
    oracle.assert_close(out, ref.out, F32, "out")
    oracle.assert_close(lse, ref.lse, F32, "lse")
    if grads is None:
        return
    dq, dk, dv, dsinks = grads
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv), ("dsinks", dsinks)):
        want = getattr(ref, name)
        if want is None:
            assert g is None and not sinks, name
            continue
        assert np.all(np.isfinite(g)), f"{name} has non-finite values"
        oracle.assert_close(g, want, F32, name)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_matches_oracle(impl, cfg):
    tm = cfg.mask()
    S = tm.seq_len
    rng = np.random.default_rng(_seed(cfg))
    a = harness.attention_inputs(cfg.B, S, cfg.H, cfg.D, H_kv=cfg.H_kv, rng=rng, dlse=True,
                                 sinks=cfg.sinks)
    if cfg.segments:
        a["seg"] = _segment_ids(rng, cfg.B, S)
    dense = dense_of(tm)
    assert dense.any() and not dense.all()  # a mask with something to skip
    got = run_kernel(impl, tm, a)
    check(got, run_oracle(a, dense), cfg.sinks)
    # Padding tokens (of a grid the tiles do not divide): exactly 0 output and -inf lse.
    _, real = oracle.video_layout(tm.grid, tm.tile)
    pad = np.flatnonzero(~real) + (tm.text_len if tm.text_position == "prefix" else 0)
    assert (pad.size > 0) == any(g % t for g, t in zip(tm.grid, tm.tile))
    assert np.all(got[0][:, pad] == 0)
    if not cfg.sinks:
        assert np.all(got[1][:, :, pad] == -np.inf)


def test_sinks_gradient_with_text_filler():
    """The gradient of the sinks where `Blockwise` inserts filler after a text prefix
    (here 1 text token, blocks of 2): the filler rows must not contribute."""
    tm = kernels.SlidingTileMask((1, 1, 4), (1, 1, 2), (1, 1, 1), text_len=1)
    a = harness.attention_inputs(1, tm.seq_len, 1, 8, dlse=True, sinks=True, seed=2)
    check(run_kernel(kernels.Blockwise(block_q=2), tm, a), run_oracle(a, dense_of(tm)), sinks=True)


# A chunk of the sequence by explicit positions (as ring attention passes them):
# queries running past the end (positions >= seq_len are padding), keys in two
# pieces, the first starting before 0 and the second running past the end.
CHUNK_MASK = kernels.SlidingTileMask((3, 5, 3), (1, 2, 2), ((1, 3, 1), (3, 1, 3)), text_len=4)
CHUNK_Q = np.arange(30, CHUNK_MASK.seq_len + 4, dtype=np.int32)
CHUNK_KV = np.concatenate([np.arange(-3, 20), np.arange(60, CHUNK_MASK.seq_len + 2)]).astype(np.int32)


def test_positions_dense_oracle():
    """The oracle at explicit positions is the full mask's rows and columns, with
    positions outside the sequence hidden."""
    S = CHUNK_MASK.seq_len
    full = np.pad(dense_of(CHUNK_MASK), ((0, 0), (0, 1), (0, 1)))  # index S: padding
    rows = np.where((CHUNK_Q >= 0) & (CHUNK_Q < S), CHUNK_Q, S)
    cols = np.where((CHUNK_KV >= 0) & (CHUNK_KV < S), CHUNK_KV, S)
    np.testing.assert_array_equal(dense_of(CHUNK_MASK, CHUNK_Q, CHUNK_KV), full[:, rows][:, :, cols])


@pytest.mark.parametrize("impl", IMPLS)
def test_positions_chunk(impl):
    a = harness.attention_inputs(1, len(CHUNK_Q), 2, 8, H_kv=1, S_k=len(CHUNK_KV), dlse=True,
                                 sinks=True, seed=1)
    dense = dense_of(CHUNK_MASK, CHUNK_Q, CHUNK_KV)
    assert not dense[:, -4:].any() and not dense[:, :, :3].any()
    check(run_kernel(impl, CHUNK_MASK, a, CHUNK_Q, CHUNK_KV), run_oracle(a, dense), sinks=True)


# ------------------------------------------------------------------------- block_map


BLOCK_MASKS = [
    kernels.SlidingTileMask((4, 6, 4), (2, 2, 2), (1, 1, 3)),
    kernels.SlidingTileMask((5, 3, 7), (2, 2, 3), ((1, 1, 1), (3, 1, 1), (1, 3, 3)), text_len=12),
    kernels.SlidingTileMask((3, 5, 3), (1, 2, 2), (1, 3, 1), text_len=8, text_position="suffix"),
    kernels.SlidingTileMask((6, 1, 6), (3, 1, 2), (1, 1, 5), text_len=6, text_position="suffix"),
]


def _blocks_any(dense, bq, bk):
    """Whether each (query block, key block) pair holds a visible pair, union over heads."""
    vis = dense.any(axis=0)
    S_q, S_k = vis.shape
    vis = np.pad(vis, ((0, -S_q % bq), (0, -S_k % bk)))
    return vis.reshape(oracle.ceil_div(S_q, bq), bq, oracle.ceil_div(S_k, bk), bk).any(axis=(1, 3))


@pytest.mark.parametrize("tm", BLOCK_MASKS, ids=repr)
def test_block_map(tm):
    T = tm.tile_size
    dense = dense_of(tm)
    # Whole tiles (text a whole number of tiles): exact.
    got = block_map(tm, T, T)
    np.testing.assert_array_equal(got, _blocks_any(dense, T, T))
    assert not got.all()
    # Blocks of several tiles, or not of whole tiles: never misses a visible pair.
    for bq, bk in ((2 * T, T), (T + 1, 2 * T - 1), (5, 7)):
        got = block_map(tm, bq, bk)
        assert np.all(got | ~_blocks_any(dense, bq, bk)), (bq, bk)
    # At explicit positions (a chunk): exact again when the chunk starts on a tile.
    q_pos = np.arange(2 * T, tm.seq_len)
    kv_pos = np.arange(-T, tm.seq_len - 3 * T)
    got = block_map(tm, T, T, q_positions=q_pos, kv_positions=kv_pos)
    np.testing.assert_array_equal(got, _blocks_any(dense_of(tm, q_pos, kv_pos), T, T))


# ------------------------------------------------------------------- the tile layout


def _layout_index(grid, tile):
    """For each slot of the tile layout, the raster index of its token, or -1 for padding."""
    _, H, W = grid
    coords, real = oracle.video_layout(grid, tile)
    return np.where(real, coords[:, 0] * H * W + coords[:, 1] * W + coords[:, 2], -1), coords


_permute = jax.jit(kernels.tile_permute, static_argnames=("grid", "tile", "axis"))
_unpermute = jax.jit(kernels.tile_unpermute, static_argnames=("grid", "tile", "axis"))


@pytest.mark.parametrize("grid, tile", [((2, 3, 4), (1, 3, 2)), ((3, 5, 2), (2, 2, 3))])
def test_tile_layout(grid, tile):
    n = int(np.prod(grid))
    index, coords = _layout_index(grid, tile)
    assert len(index) == kernels.SlidingTileMask(grid, tile, (1, 1, 1)).video_len
    assert (index < 0).any() == any(g % t for g, t in zip(grid, tile))
    rng = np.random.default_rng(_seed((grid, tile)))
    for shape, axis in (((n,), 0), ((2, n, 3), 1), ((2, 3, n), -1), ((1, n, 2, 4), None)):
        kw = {"grid": grid, "tile": tile} if axis is None else {"grid": grid, "tile": tile, "axis": axis}
        axis = 1 if axis is None else axis  # the default: (B, S, H, D)
        x = rng.standard_normal(shape).astype(F32) + 5.0  # never 0, so padding is visible
        y = np.asarray(_permute(x, **kw))
        want = np.take(x, np.maximum(index, 0), axis=axis)
        where = [1] * x.ndim
        where[axis] = len(index)
        want = np.where(index.reshape(where) >= 0, want, 0)  # padding is zeros
        np.testing.assert_array_equal(y, want)
        np.testing.assert_array_equal(np.asarray(_unpermute(y, **kw)), x)
    np.testing.assert_array_equal(kernels.tile_positions(grid, tile), coords)


@pytest.mark.parametrize("tm", BLOCK_MASKS + [CHUNK_MASK, CONFIGS[1].mask()], ids=repr)
def test_density(tm):
    dense = dense_of(tm)
    _, real_video = oracle.video_layout(tm.grid, tm.tile)
    real = np.ones(tm.seq_len, bool)
    start = tm.text_len if tm.text_position == "prefix" else 0
    real[start:start + tm.video_len] = real_video
    want = np.mean([d[np.ix_(real, real)].mean() for d in dense])
    assert tm.density() == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs, match", [
    ({"window": (2, 1, 1)}, "odd"),
    ({"window": ((1, 1, 1), (1, 4, 1))}, "odd"),
    ({"window": ()}, "window"),
    ({"grid": (0, 4, 4)}, "grid"),
    ({"grid": (4, 4)}, "grid"),
    ({"tile": (1, 2.0, 1)}, "tile"),
    ({"tile": (1, -2, 1)}, "tile"),
    ({"text_len": -1}, "text_len"),
    ({"text_position": "middle"}, "text_position"),
])
def test_invalid_mask(kwargs, match):
    base = {"grid": (4, 4, 4), "tile": (2, 2, 2), "window": (1, 1, 1)}
    with pytest.raises(ValueError, match=match):
        kernels.SlidingTileMask(**{**base, **kwargs})


def _qkv(S, H=2, H_kv=2):
    q = jnp.zeros((1, S, H, 8), F32)
    k = jnp.zeros((1, S, H_kv, 8), F32)
    return q, k, k


def test_invalid_requests():
    tm = kernels.SlidingTileMask((3, 4, 4), (2, 2, 2), (1, 1, 1), text_len=3)
    S = tm.seq_len
    for S_q, S_k in ((S - 1, S - 1), (S + 2, S + 2), (S, S - 1)):
        q, k, v = _qkv(S_q)
        with pytest.raises(ValueError, match=f"S_q == S_k == {S}; received S_q={S_q}, S_k={S_k}"):
            kernels.attention(q, k[:, :S_k], v[:, :S_k], mask=tm)
    per_head = kernels.SlidingTileMask((3, 4, 4), (2, 2, 2), [(1, 1, 1)] * 3)
    with pytest.raises(ValueError, match=r"3 windows for H = 2 heads"):
        kernels.attention(*_qkv(per_head.seq_len), mask=per_head)
    for impl in ("pallas_gpu", "cudnn", kernels.PallasGpu(interpret=True)):
        with pytest.raises(NotImplementedError, match="sliding tile mask"):
            kernels.attention(*_qkv(S), mask=tm, implementation=impl)
    # "auto" picks an implementation that serves the mask, on GPU too (where the
    # vendor kernels, which do not, come first).
    for needs_lse, platform in ((False, None), (True, None), (True, "gpu")):
        name = kernels.select_implementation(*_qkv(S), mask=tm, needs_lse=needs_lse, platform=platform)
        assert kernels.implementations()[name].capabilities.tile_mask, name


# ------------------------------------------------------------------------- property


@st.composite
def sta_problems(draw):
    grid = tuple(draw(st.integers(1, 6)) for _ in range(3))
    tile = tuple(draw(st.integers(1, 3)) for _ in range(3))
    video = int(np.prod([oracle.ceil_div(g, t) * t for g, t in zip(grid, tile)]))
    text_len = draw(st.integers(0, 5))
    # Keep shapes small: a large draw's grid is cut down along frames, then height.
    while video + text_len > 150:
        grid = (max(1, grid[0] - 1), *grid[1:]) if grid[0] > 1 else (grid[0], max(1, grid[1] - 1), grid[2])
        video = int(np.prod([oracle.ceil_div(g, t) * t for g, t in zip(grid, tile)]))
    odd = st.sampled_from([1, 3, 5])
    triple = st.tuples(odd, odd, odd)
    window = draw(st.one_of(triple, st.tuples(triple, triple)))
    position = draw(st.sampled_from(["prefix", "suffix"]))
    return kernels.SlidingTileMask(grid, tile, window, text_len=text_len, text_position=position)


@examples(8)
@given(tm=sta_problems(), grads=st.booleans())
def test_property_blockwise(tm, grads):
    """Blockwise with 8-token blocks (whole tiles) against the oracle: the forward
    always, the gradients in some examples (a compilation of its own)."""
    a = harness.attention_inputs(1, tm.seq_len, 2, 8, H_kv=1, dlse=True, seed=_seed(tm))
    impl = kernels.Blockwise(block_q=8)
    got = run_kernel(impl, tm, a, grads=grads, compiler_options=harness.FAST_COMPILE)
    check(got, run_oracle(a, dense_of(tm)), sinks=False)


# ------------------------------------------------- the static-table path (Blockwise.sta_table)


TABLE_CONFIGS = [
    # Ragged grid (padding query and key rows), a text prefix that is not whole
    # tiles, per-head windows with GQA: the table's -1 slots and its text tiles.
    Config("table-ragged-prefix-perhead-gqa", (3, 5, 3), (1, 2, 2),
           ((1, 1, 1), (3, 1, 1), (1, 3, 1), (3, 3, 5)), text_len=5, H=4, H_kv=2),
    # Dividing grid, a text suffix, one window, two batch rows.
    Config("table-divides-suffix", (4, 6, 4), (2, 2, 2), (3, 1, 3), text_len=3,
           text_position="suffix", B=2),
]
LOOP = kernels.Blockwise(block_q=16, sta_table=False)


@pytest.mark.parametrize("impl", [pytest.param(BLOCKWISE, id="table"), pytest.param(LOOP, id="loop")])
@pytest.mark.parametrize("cfg", TABLE_CONFIGS, ids=lambda c: c.name)
def test_table_path_matches_oracle(impl, cfg):
    """A sliding tile mask on default positions without other features runs from the
    static table of window tiles (text queries by the loop); `sta_table=False` keeps
    the tile-pair loop: both equal the oracle (out, lse, dq, dk, dv)."""
    from vidax_eqx.kernels._args import normalize

    tm = cfg.mask()
    rng = np.random.default_rng(_seed(cfg))
    a = harness.attention_inputs(cfg.B, tm.seq_len, cfg.H, cfg.D, H_kv=cfg.H_kv, rng=rng, dlse=True)
    ops, opts = normalize(jnp.asarray(a["q"]), jnp.asarray(a["k"]), jnp.asarray(a["v"]), mask=tm)
    assert (impl._table_plan(ops, opts) is not None) == impl.sta_table
    seg = jnp.zeros((cfg.B, tm.seq_len), jnp.int32)
    ops_seg, opts_seg = normalize(ops.q, ops.k, ops.v, mask=tm, segment_ids=seg)
    assert impl._table_plan(ops_seg, opts_seg) is None  # segment ids: the loop
    got = run_kernel(impl, tm, a)
    check(got, run_oracle(a, dense_of(tm)), sinks=False)
    _, real = oracle.video_layout(tm.grid, tm.tile)
    pad = np.flatnonzero(~real) + tm.video_start
    assert np.all(got[0][:, pad] == 0) and np.all(got[1][:, :, pad] == -np.inf)


@pytest.mark.parametrize("kw", [dict(q_tiles=2, lanes=2, kv_tiles=2), dict(q_tiles=3, lanes=2, kv_tiles=3)],
                         ids=["2x2x2", "3x2x3"])
def test_gather_chunks_and_lanes(kw):
    """`_sparse.gather_fwd/bwd` with several lanes per step and several key-tile chunks
    (an online softmax across them), -1 slots, an empty row of tiles, padding keys and
    padding query rows (`q_valid`), against the oracle with the table's dense mask."""
    from vidax_eqx.kernels import _sparse

    B, H, K, D, T, n = 2, 4, 2, 8, 4, 6
    S = n * T
    rng = np.random.default_rng(7)
    a = harness.attention_inputs(B, S, H, D, H_kv=K, rng=rng, dlse=True)
    tiles = np.argsort(rng.random((B, H, n, n)), -1)[..., :5].astype(np.int32)
    tiles[0, 0, 0, 2:] = -1
    tiles[1, 2, 3, :] = -1
    kv_valid = rng.random(S) > 0.2
    q_valid = rng.random(S) > 0.2
    hit = np.zeros((B, H, n, n), bool)
    bi, hi, qi, si = np.nonzero(tiles >= 0)
    hit[bi, hi, qi, tiles[bi, hi, qi, si]] = True
    dense = np.repeat(np.repeat(hit, T, 2), T, 3) & kv_valid & q_valid[:, None]
    a["dout"] = a["dout"] * q_valid[:, None, None]
    a["dlse"] = a["dlse"] * q_valid
    ref = oracle.attention(a["q"], a["k"], a["v"], mask=dense, dout=a["dout"], dlse=a["dlse"])
    q, k, v, dout, dlse = (jnp.asarray(a[x]) for x in ("q", "k", "v", "dout", "dlse"))
    args = dict(tile_size=T, scale=D**-0.5, q_valid=jnp.asarray(q_valid), **kw)

    @jax.jit
    def run(q, k, v, dout, dlse):
        out, lse = _sparse.gather_fwd(q, k, v, jnp.asarray(tiles), jnp.asarray(kv_valid), **args)
        grads = _sparse.gather_bwd(q, k, v, jnp.asarray(tiles), jnp.asarray(kv_valid), out, lse, dout, dlse,
                                   **args)
        return out, lse, grads

    out, lse, (dq, dk, dv) = jax.tree.map(np.asarray, run(q, k, v, dout, dlse))
    seen = dense.any(-1)
    oracle.assert_close(out, ref.out, F32, "out")
    oracle.assert_close(np.where(seen, lse, 0), np.where(seen, ref.lse, 0), F32, "lse")
    assert np.all(np.where(seen, True, lse <= np.finfo(F32).min))  # the empty lse sentinel
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        oracle.assert_close(g, getattr(ref, name), F32, name)


def test_sta_table_flag_checked():
    with pytest.raises(ValueError, match="sta_table"):
        kernels.Blockwise(sta_table="yes")
