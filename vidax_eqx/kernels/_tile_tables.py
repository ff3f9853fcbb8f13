"""What the kernels evaluate of a sliding tile mask: per-token features and visibility,
the block and chunk tables that let a kernel (or a ring step) skip hidden blocks, the
static window table, and the validity of a tile layout's slots."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from ._tile import SlidingTileMask, Triple


def q_features(tm: SlidingTileMask, q_pos: jax.Array, kv_heads: int, heads: int):
    """What a tile's query rows need of the mask, computed once per block.

    `q_pos (..., M)` in `_math`'s rows layout (`M = G * T`: row `g * T + t` is query
    head `k * G + g` of kv head `k`). Returns `(text, video, bounds)`: bool `(..., M)`
    and int32 `bounds (..., 6, K|1, M)`, the visible key-tile range `[lo_d, hi_d)` of
    each row along the three dimensions (`lo` then `hi`; `K` for per-head windows).
    """
    text, video, coords = tm.decode(q_pos)
    sizes = np.asarray(tm.windows, np.int32)  # (1 | H, 3)
    M = q_pos.shape[-1]
    if len(sizes) == 1:
        w = sizes[:, None, :]  # (1, 1, 3)
    else:
        G = heads // kv_heads
        head = np.arange(kv_heads)[:, None] * G + np.arange(M)[None, :] // (M // G)
        w = sizes[head]  # (K, M, 3): the window of each row's head
    lo = [jnp.clip(coords[d][..., None, :] - w[..., d] // 2, 0, tm.tiles[d] - w[..., d]) for d in range(3)]
    hi = [lo[d] + w[..., d] for d in range(3)]
    return text, video, jnp.stack(lo + hi, axis=-3).astype(jnp.int32)


def kv_features(tm: SlidingTileMask, kv_pos: jax.Array):
    """What a tile's keys need of the mask: `(text, video, coords)` for `kv_pos (..., U)`,
    bool `(..., U)` and int32 tile coordinates `(..., 3, U)`."""
    text, video, coords = tm.decode(kv_pos)
    return text, video, jnp.stack(coords, axis=-2)


def features_visibility(q, kv):
    """The mask on one tile from `q_features` `(M,)` / `(6, K|1, M)` and `kv_features`
    `(U,)` / `(3, U)`: bool `(1, K|1, M, U)`."""
    q_text, q_video, bounds = q
    k_text, k_video, coords = kv
    box = None
    for d in range(3):
        c = coords[d][None, None, :]
        inside = (c >= bounds[d][..., None]) & (c < bounds[3 + d][..., None])
        box = inside if box is None else box & inside
    k_real = k_text | k_video
    vis = (q_text[:, None] & k_real[None, :])[None] | (
        q_video[None, :, None] & (k_text[None, None, :] | (k_video[None, None, :] & box))
    )
    return vis[None]


def rows_visibility(tm: SlidingTileMask, q_pos: jax.Array, kv_pos: jax.Array, kv_heads: int, heads: int):
    """The mask on one tile in `_math`'s rows layout: bool `(1, K|1, M, U)` for the rows'
    positions `q_pos (M,)` and the keys' `kv_pos (U,)` (see `q_features`)."""
    return features_visibility(q_features(tm, q_pos, kv_heads, heads), kv_features(tm, kv_pos))


def q_block_ranges(tm: SlidingTileMask, q_pos, xp=jnp):
    """Per query block `(n, T)` of positions: `(any_text, any_video, lo, hi)`; for
    each window (head group), the union over the block's video rows of the visible
    key-tile ranges `[lo_d, hi_d)` (each a tuple of three `(n_windows, n)` arrays)."""
    text, video, coords = tm.decode(q_pos, xp)
    starts = tm.window_starts(coords, xp)  # (n_windows, n, T) each
    sizes = np.asarray(tm.windows, np.int32)
    big = np.int32(2**30)
    lo, hi = [], []
    for d in range(3):
        s = starts[d]
        e = s + sizes[:, d].reshape(-1, 1, 1)
        lo.append(xp.min(xp.where(video[None], s, big), axis=-1))
        hi.append(xp.max(xp.where(video[None], e, -big), axis=-1))
    return xp.any(text, axis=-1), xp.any(video, axis=-1), tuple(lo), tuple(hi)


def kv_block_ranges(tm: SlidingTileMask, kv_pos, xp=jnp):
    """Per key block `(n, U)` of positions: `(any_text, any_video, cmin, cmax)`, the
    range of the block's real video keys' tile coordinates along each dimension."""
    text, video, coords = tm.decode(kv_pos, xp)
    big = np.int32(2**30)
    cmin = tuple(xp.min(xp.where(video, c, big), axis=-1) for c in coords)
    cmax = tuple(xp.max(xp.where(video, c, -big), axis=-1) for c in coords)
    return xp.any(text, axis=-1), xp.any(video, axis=-1), cmin, cmax


def block_may_see(q_ranges, kv_ranges, i, j):
    """Whether query block `i` may see some key of block `j` (exact when both are
    whole tiles, conservative otherwise). `i`, `j`: indices or index arrays of one
    shape."""
    q_text, q_video, lo, hi = q_ranges
    k_text, k_video, cmin, cmax = kv_ranges
    box = k_video[j]
    for d in range(3):  # per window: (n_windows, *i.shape)
        box = box & (cmin[d][j] < hi[d][:, i]) & (cmax[d][j] >= lo[d][:, i])
    box = box.any(axis=0)
    return (q_text[i] & (k_text[j] | k_video[j])) | (q_video[i] & (k_text[j] | box))


def tile_block(tm: SlidingTileMask, target: int = 128) -> int:
    """A kernel block size of whole tiles: one tile, or the number of tiles closest
    to `target` tokens when tiles are small."""
    return tm.tile_size * max(1, round(target / tm.tile_size))


def block_map(tm: SlidingTileMask, block_q: int, block_kv: int, q_positions=None, kv_positions=None) -> np.ndarray:
    """Which (query block, key block) pairs a blocked kernel computes, in NumPy:
    bool `(ceil(S_q / block_q), ceil(S_k / block_kv))`, from the same test the
    `"blockwise"` kernel runs (positions default to `arange(seq_len)`; a partial
    last block is padded with positions outside the mask)."""
    q_pos = np.arange(tm.seq_len) if q_positions is None else np.asarray(q_positions)
    kv_pos = np.arange(tm.seq_len) if kv_positions is None else np.asarray(kv_positions)
    blocks = []
    for pos, size in ((q_pos, block_q), (kv_pos, block_kv)):
        n = -(-len(pos) // size)
        blocks.append(np.pad(pos, (0, n * size - len(pos)), constant_values=-1).reshape(n, size))
    qr, kr = q_block_ranges(tm, blocks[0], np), kv_block_ranges(tm, blocks[1], np)
    i, j = np.meshgrid(np.arange(len(blocks[0])), np.arange(len(blocks[1])), indexing="ij")
    return np.asarray(block_may_see(qr, kr, i, j))


def chunk_table(tm: SlidingTileMask, q_starts, q_size: int, kv_starts, kv_size: int) -> np.ndarray:
    """Which chunks of positions may see which, in NumPy: bool `(len(q_starts),
    len(kv_starts))`, entry `(a, b)` whether some query at positions `[q_starts[a],
    q_starts[a] + q_size)` sees some key at `[kv_starts[b], kv_starts[b] + kv_size)`.

    Exact (each chunk is cut at the tile and text boundaries, and the pieces are
    tested as `block_map` tests whole tiles), so ring attention skips exactly the
    steps the mask hides.
    """

    def pieces(starts, size):
        starts = np.asarray(starts, np.int64)
        cuts = [tm.video_start + t * tm.tile_size for t in range(math.prod(tm.tiles) + 1)]
        cuts += [tm.text_start, tm.text_start + tm.text_len]
        # Beyond the mask everything is padding: cut it coarsely.
        hi = int(starts.max()) + size
        cuts += list(range(tm.seq_len, hi + tm.tile_size, max(tm.tile_size, size)))
        cuts = np.asarray(sorted(set(cuts)), np.int64)
        bounds, owner = [], []
        for a, s in enumerate(starts):
            inner = cuts[(cuts > s) & (cuts < s + size)]
            edges = np.concatenate([[s], inner, [s + size]])
            bounds += list(zip(edges[:-1], edges[1:]))
            owner += [a] * (len(edges) - 1)
        width = max(e - s for s, e in bounds)
        pos = np.full((len(bounds), width), -1, np.int64)
        for i, (s, e) in enumerate(bounds):
            pos[i, : e - s] = np.arange(s, e)
        return pos, np.asarray(owner)

    q_pos, q_owner = pieces(q_starts, q_size)
    kv_pos, kv_owner = pieces(kv_starts, kv_size)
    qr, kr = q_block_ranges(tm, q_pos, np), kv_block_ranges(tm, kv_pos, np)
    i, j = np.meshgrid(np.arange(len(q_pos)), np.arange(len(kv_pos)), indexing="ij")
    seen = np.asarray(block_may_see(qr, kr, i, j))
    table = np.zeros((len(q_starts), len(kv_starts)), bool)
    np.logical_or.at(table, (q_owner[:, None], kv_owner[None, :]), seen)
    return table


def window_table(tm: SlidingTileMask) -> np.ndarray:
    """Each video tile's visible video key tiles, in NumPy: int32 `(n_windows,
    n_tiles, n_sel)`, one row per entry of [`windows`][vidax_eqx.kernels.SlidingTileMask.windows],
    the key tiles (indices in the tile layout's raster order) of each query tile's
    window in increasing order, `-1` filling the rows of windows smaller than the
    largest (`n_sel` = the largest window's tile count).

    The static table a gathering kernel reads its key tiles from (STA's window
    count is fixed, so the table is regular).
    """
    tiles = tm.tiles
    coords = np.stack(np.meshgrid(*(np.arange(n) for n in tiles), indexing="ij"), -1).reshape(-1, 3)
    n_sel = max(math.prod(w) for w in tm.windows)
    table = np.full((len(tm.windows), len(coords), n_sel), -1, np.int32)
    for h, window in enumerate(tm.windows):
        starts = np.clip(coords - np.asarray(window) // 2, 0, np.asarray(tiles) - np.asarray(window))
        # Offsets inside the window, raster order: the key tiles come out sorted.
        offs = np.stack(np.meshgrid(*(np.arange(w) for w in window), indexing="ij"), -1).reshape(-1, 3)
        key = starts[:, None, :] + offs[None, :, :]  # (n_tiles, prod(window), 3)
        flat = (key[..., 0] * tiles[1] + key[..., 1]) * tiles[2] + key[..., 2]
        table[h, :, : flat.shape[1]] = flat
    return table


def layout_valid(grid: Triple, tile: Triple) -> np.ndarray:
    """bool NumPy `(video_len,)`: the real (unpadded) tokens of the tile layout of
    [`tile_permute`][]`(x, grid, tile)` (sliding tile attention's and VSA's)."""
    tiles = [-(-g // t) for g, t in zip(grid, tile)]
    f, h, w = ((np.arange(n)[:, None] * t + np.arange(t)[None, :]) < g
               for n, t, g in zip(tiles, tile, grid))  # (n_d, t_d): real along each dimension
    valid = f[:, None, None, :, None, None] & h[None, :, None, None, :, None] & w[None, None, :, None, None, :]
    return valid.reshape(-1)
