"""Sliding tile attention: a structured 3D window mask over a video's token grid.

Video tokens are reordered tile by tile ([`tile_permute`][]), and each query
tile sees the key tiles of a window of tiles centred on it ([`SlidingTileMask`][],
after "Fast Video Generation with Sliding Tile Attention", Zhang et al., ICML
2025). Because the window slides a whole tile at a time, every (query tile, key
tile) pair is either fully visible or fully hidden: a kernel whose blocks are
whole tiles computes the visible blocks and skips the rest, so its time scales
with the mask's density.

The mask is static structure (hashable, like every other attention option),
evaluated on token *positions*: the index of each token in the laid-out
sequence (`[text; video]` or `[video; text]`). Every quantity a kernel needs, a
token's kind and tile coordinates, is integer arithmetic on its position, so no
`(S, S)` array exists outside the materializing `"xla"` reference, and a chunk
of the sequence (ring attention) evaluates the mask from its global positions.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


TEXT_POSITIONS = ("prefix", "suffix")

Triple = tuple[int, int, int]


def triple(name: str, value, *, odd: bool = False, owner: str = "SlidingTileMask") -> Triple:
    """`value` as three positive Python ints, or a `ValueError` naming `owner` and `name`."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{owner}: `{name}` must be concrete Python ints (static structure); received a "
            "traced value."
        )
    try:
        items = tuple(value)
    except TypeError:
        items = None
    ok = items is not None and len(items) == 3 and all(
        not isinstance(x, bool) and isinstance(x, (int, np.integer)) and x >= 1 for x in items
    )
    if not ok:
        raise ValueError(
            f"{owner}: `{name}` must be three positive ints (frames, height, width); "
            f"received {value!r}."
        )
    items = tuple(int(x) for x in items)
    if odd and any(x % 2 == 0 for x in items):
        raise ValueError(
            f"{owner}: window sizes are in tiles and must be odd (a window is centred "
            f"on its query tile); received {name} = {items}."
        )
    return items


def _is_triple(value) -> bool:
    try:
        return len(value) == 3 and all(not isinstance(x, (tuple, list)) for x in value)
    except TypeError:
        return False


@dataclasses.dataclass(frozen=True)
class SlidingTileMask:
    """Sliding tile attention (STA): 3D windows of tiles over a video's token grid.

    The video's `F x H x W` tokens are laid out tile by tile (see
    [`tile_permute`][]): tiles of `tf x th x tw` tokens in raster order of the tile
    grid, tokens in raster order inside a tile, each grid dimension padded up to a
    multiple of its tile size. `text_len` text tokens sit before (`"prefix"`) or
    after (`"suffix"`) the video tokens. The attention's q, k and v follow that
    layout; its sequence length is [`seq_len`][vidax_eqx.kernels.SlidingTileMask.seq_len]
    `= text_len + video_len`.

    **Semantics.** Query tile `(a, b, c)` (tile coordinates) sees the key tiles of
    the `wf x wh x ww` window of tiles centred on it, shifted inward at the grid's
    borders so that it always covers exactly `wf x wh x ww` tiles: along each
    dimension with `n` tiles and window `w`, the keys' tile coordinate lies in
    `[s, s + w)` with `s = clip(a - w // 2, 0, n - w)`. A window larger than the
    grid along a dimension covers that whole dimension. Text queries see every
    token, and every query sees every text token. Padding tokens (those added
    to fill the last tile of a dimension) are invisible: they see nothing,
    nothing sees them (text queries included), and their output is 0.

    The mask is evaluated on token positions: with the default positions
    (`arange`) q and k must have `seq_len` tokens; with `q_positions` /
    `kv_positions` (a chunk of the sequence, as ring attention passes them) each
    token is the one at that position, and a position outside `[0, seq_len)` is
    padding. It combines (logical and) with every other mask feature.

    **Arguments:**

    - `grid`: `(F, H, W)`, the video's token grid (after patchifying).
    - `tile`: `(tf, th, tw)`, tokens per tile along each dimension.
    - `window`: `(wf, wh, ww)`, the window in tiles (odd sizes), shared by every
        head; or a sequence of one such triple per query head (per-head windows,
        as STA's searched per-head strategies use), whose length must then equal
        the attention's number of query heads.
    - `text_len`: the number of text tokens (0: video only).
    - `text_position`: `"prefix"` (text before the video) or `"suffix"` (after).

    Frozen and hashable: it is static configuration, like `causal` or `window`.
    """

    grid: Triple
    tile: Triple
    window: Triple | tuple[Triple, ...]
    text_len: int = 0
    text_position: str = "prefix"

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)
        set_("grid", triple("grid", self.grid))
        set_("tile", triple("tile", self.tile))
        if _is_triple(self.window):
            set_("window", triple("window", self.window, odd=True))
        else:
            try:
                windows = tuple(self.window)
            except TypeError:
                windows = ()
            if not windows:
                raise ValueError(
                    "SlidingTileMask: `window` must be (wf, wh, ww) in tiles, or a non-empty "
                    f"sequence of one such triple per query head; received {self.window!r}."
                )
            set_("window", tuple(triple(f"window[{h}]", w, odd=True) for h, w in enumerate(windows)))
        text_len = self.text_len
        if isinstance(text_len, bool) or not isinstance(text_len, (int, np.integer)) or text_len < 0:
            raise ValueError(
                f"SlidingTileMask: `text_len` must be a non-negative int; received {text_len!r}."
            )
        set_("text_len", int(text_len))
        if self.text_position not in TEXT_POSITIONS:
            raise ValueError(
                f"SlidingTileMask: `text_position` must be one of {TEXT_POSITIONS}; received "
                f"{self.text_position!r}."
            )

    # -- the layout ---------------------------------------------------------------

    @property
    def tiles(self) -> Triple:
        """Tiles along each dimension, `ceil(grid / tile)`."""
        return tuple(-(-g // t) for g, t in zip(self.grid, self.tile))

    @property
    def tile_size(self) -> int:
        """Tokens per tile, `tf * th * tw`."""
        return math.prod(self.tile)

    @property
    def video_len(self) -> int:
        """Video tokens in the tile layout, padding included."""
        return math.prod(self.tiles) * self.tile_size

    @property
    def seq_len(self) -> int:
        """The attention's sequence length: `text_len + video_len`."""
        return self.text_len + self.video_len

    @property
    def video_start(self) -> int:
        """Position of the first video token."""
        return self.text_len if self.text_position == "prefix" else 0

    @property
    def text_start(self) -> int:
        """Position of the first text token."""
        return 0 if self.text_position == "prefix" else self.video_len

    @property
    def heads(self) -> int | None:
        """The number of query heads of a per-head mask; `None` when shared."""
        return None if _is_triple(self.window) else len(self.window)

    @property
    def windows(self) -> tuple[Triple, ...]:
        """The window of each head (one entry when shared), clamped to the tile grid."""
        windows = (self.window,) if _is_triple(self.window) else self.window
        return tuple(tuple(min(w, n) for w, n in zip(win, self.tiles)) for win in windows)

    def select_heads(self, start: int, count: int) -> "SlidingTileMask":
        """The mask of query heads `[start, start + count)` (per-head windows; a
        shared window is returned unchanged)."""
        if self.heads is None:
            return self
        if not (0 <= start and count >= 1 and start + count <= self.heads):
            raise ValueError(
                f"SlidingTileMask.select_heads: heads [{start}, {start + count}) are not within "
                f"the mask's {self.heads} heads."
            )
        windows = self.window[start : start + count]
        if len(set(windows)) == 1:
            windows = windows[0]
        return dataclasses.replace(self, window=windows)

    def check_heads(self, heads: int, where: str = "attention") -> None:
        """Raises a `ValueError` unless a per-head mask has `heads` windows."""
        if self.heads is not None and self.heads != heads:
            raise ValueError(
                f"{where}: a SlidingTileMask with per-head windows needs one window per query "
                f"head; received {self.heads} windows for H = {heads} heads."
            )

    # -- evaluation on positions ----------------------------------------------------

    def decode(self, positions, xp=jnp):
        """Kind and tile coordinates of the tokens at `positions` (int array, any shape).

        **Returns:**

        `(text, video, coords)`: bool arrays `text` (a text token) and `video` (a
        real, unpadded video token) and a tuple of three int32 arrays, the tile
        coordinates along frames, height and width (meaningful where `video`).
        """
        p = xp.asarray(positions).astype(xp.int32)
        text = (p >= self.text_start) & (p < self.text_start + self.text_len)
        v = p - self.video_start
        in_video = (v >= 0) & (v < self.video_len)
        v = xp.where(in_video, v, 0)
        tf, th, tw = self.tile
        nf, nh, nw = self.tiles
        t, r = v // self.tile_size, v % self.tile_size
        coords = (t // (nh * nw), (t // nw) % nh, t % nw)
        inner = (r // (th * tw), (r // tw) % th, r % tw)
        real = in_video
        for c, i, size, g in zip(coords, inner, self.tile, self.grid):
            real = real & (c * size + i < g)
        return text, real, tuple(c.astype(xp.int32) for c in coords)

    def window_starts(self, coords, xp=jnp):
        """Per head, the first visible key tile along each dimension: a tuple of three
        int32 arrays of shape `(n_windows, *coords[0].shape)` (one row per entry of
        [`windows`][vidax_eqx.kernels.SlidingTileMask.windows])."""
        sizes = np.asarray(self.windows, np.int32)  # (n_windows, 3)
        extra = (1,) * np.ndim(coords[0])
        starts = []
        for d in range(3):
            w = sizes[:, d].reshape(-1, *extra)
            c = xp.asarray(coords[d])[None]
            starts.append(xp.clip(c - w // 2, 0, self.tiles[d] - w).astype(xp.int32))
        return tuple(starts)

    def visible(self, q_positions, kv_positions, xp=jnp):
        """The dense mask over these positions: bool `(n_windows, S_q, S_k)`, one row
        block per entry of [`windows`][vidax_eqx.kernels.SlidingTileMask.windows].

        Materializes `S_q x S_k`: the `"xla"` reference and small problems only.
        """
        q_text, q_video, q_coords = self.decode(q_positions, xp)
        k_text, k_video, k_coords = self.decode(kv_positions, xp)
        starts = self.window_starts(q_coords, xp)
        sizes = np.asarray(self.windows, np.int32)
        box = None
        for d in range(3):
            s = starts[d][:, :, None]
            inside = (k_coords[d][None, None, :] >= s) & (k_coords[d][None, None, :] < s + sizes[:, d, None, None])
            box = inside if box is None else box & inside
        k_real = (k_text | k_video)[None, None, :]
        video_rows = q_video[None, :, None] & (k_text[None, None, :] | (k_video[None, None, :] & box))
        return (q_text[None, :, None] & k_real) | video_rows

    def density(self) -> float:
        """The fraction of (query, key) pairs of real tokens that are visible,
        averaged over the heads (computed at tile level, in NumPy)."""
        nf, nh, nw = self.tiles
        # Real tokens per tile: a product of per-dimension counts.
        per_dim = [
            np.minimum(size, g - np.arange(n) * size) for size, g, n in zip(self.tile, self.grid, self.tiles)
        ]
        counts = per_dim[0][:, None, None] * per_dim[1][None, :, None] * per_dim[2][None, None, :]
        real_video = int(counts.sum())
        total = (real_video + self.text_len) ** 2
        text_pairs = self.text_len * (2 * real_video + self.text_len)
        fractions = []
        for window in self.windows:
            seen = counts.astype(np.int64)
            # The real keys inside each query tile's window: box sums, one axis at a time.
            for axis, (w, n) in enumerate(zip(window, self.tiles)):
                start = np.clip(np.arange(n) - w // 2, 0, n - w)
                cum = np.concatenate([np.zeros_like(np.take(seen, [0], axis)), np.cumsum(seen, axis)], axis)
                seen = np.take(cum, start + w, axis) - np.take(cum, start, axis)
            video_pairs = int((counts * seen).sum())
            fractions.append((video_pairs + text_pairs) / total)
        return float(np.mean(fractions))

    def __repr__(self) -> str:
        text = f", text_len={self.text_len}, text_position={self.text_position!r}" if self.text_len else ""
        return f"SlidingTileMask(grid={self.grid}, tile={self.tile}, window={self.window}{text})"


# -- the tile layout ---------------------------------------------------------------


def _layout_args(fn: str, x, grid, tile, axis):
    grid = triple("grid", grid, owner=fn)
    tile = triple("tile", tile, owner=fn)
    x = jnp.asarray(x)
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{fn}: `axis` must be an axis of `x` (ndim {x.ndim}); received {axis!r}.")
    return x, grid, tile, int(axis) % x.ndim


def tile_permute(x, grid, tile, axis: int = 1) -> jax.Array:
    """Raster order `(f, h, w)` -> the tile layout of [`SlidingTileMask`][].

    **Arguments:**

    - `x`: an array whose `axis` holds the `F * H * W` video tokens in raster
        order (frames slowest, width fastest), e.g. q / k / v `(B, S, H, D)`, a
        RoPE table `(S, D // 2)` or positions.
    - `grid`: `(F, H, W)`.
    - `tile`: `(tf, th, tw)`.
    - `axis`: the token axis (default 1, the sequence axis of `(B, S, ...)`).

    **Returns:**

    `x` with that axis in tile order (tiles in raster order of the tile grid,
    tokens in raster order inside a tile), each grid dimension padded with
    zeros up to a multiple of its tile size: length `SlidingTileMask.video_len`.
    Undo with [`tile_unpermute`][].
    """
    x, grid, tile, axis = _layout_args("tile_permute", x, grid, tile, axis)
    F, H, W = grid
    if x.shape[axis] != F * H * W:
        raise ValueError(
            f"tile_permute: axis {axis} of `x` must hold F * H * W = {F * H * W} tokens for "
            f"grid {grid}; received {x.shape[axis]}."
        )
    tiles = [-(-g // t) for g, t in zip(grid, tile)]
    lead, rest = x.shape[:axis], x.shape[axis + 1 :]
    y = x.reshape(*lead, F, H, W, *rest)
    widths = [(0, 0)] * y.ndim
    for d in range(3):
        widths[axis + d] = (0, tiles[d] * tile[d] - grid[d])
    y = jnp.pad(y, widths)
    y = y.reshape(*lead, tiles[0], tile[0], tiles[1], tile[1], tiles[2], tile[2], *rest)
    a = axis
    order = (*range(a), a, a + 2, a + 4, a + 1, a + 3, a + 5, *range(a + 6, y.ndim))
    return y.transpose(order).reshape(*lead, math.prod(tiles) * math.prod(tile), *rest)


def tile_unpermute(x, grid, tile, axis: int = 1) -> jax.Array:
    """The inverse of [`tile_permute`][]: tile layout -> raster order, padding dropped.

    **Arguments:**

    - `x`: an array whose `axis` holds `SlidingTileMask.video_len` tokens in the
        tile layout (e.g. the video part of an attention output).
    - `grid`, `tile`, `axis`: as in [`tile_permute`][].

    **Returns:**

    `x` with that axis in raster order, `F * H * W` tokens.
    """
    x, grid, tile, axis = _layout_args("tile_unpermute", x, grid, tile, axis)
    tiles = [-(-g // t) for g, t in zip(grid, tile)]
    padded = math.prod(tiles) * math.prod(tile)
    if x.shape[axis] != padded:
        raise ValueError(
            f"tile_unpermute: axis {axis} of `x` must hold the {padded} tokens of the tile "
            f"layout of grid {grid} with tile {tile}; received {x.shape[axis]}."
        )
    lead, rest = x.shape[:axis], x.shape[axis + 1 :]
    y = x.reshape(*lead, *tiles, *tile, *rest)
    a = axis
    order = (*range(a), a, a + 3, a + 1, a + 4, a + 2, a + 5, *range(a + 6, y.ndim))
    y = y.transpose(order).reshape(*lead, *(n * t for n, t in zip(tiles, tile)), *rest)
    y = y[(slice(None),) * a + tuple(slice(0, g) for g in grid)]
    return y.reshape(*lead, math.prod(grid), *rest)


def tile_positions(grid, tile) -> np.ndarray:
    """The `(f, h, w)` grid coordinates of each token of the tile layout.

    **Returns:**

    int32 NumPy `(video_len, 3)`, in the order [`tile_permute`][] lays tokens
    out; padding tokens carry their coordinates in the padded grid (beyond
    `grid` along some dimension). Feed them to `nn.functional.rope_3d(positions=)`
    or index raster-order tables with them; or `tile_permute` a raster-order RoPE
    table directly.
    """
    grid = triple("grid", grid)
    tile = triple("tile", tile)
    tiles = [-(-g // t) for g, t in zip(grid, tile)]
    axes = [np.arange(n * t, dtype=np.int32) for n, t in zip(tiles, tile)]
    coords = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1)  # padded grid, raster
    coords = coords.reshape(tiles[0], tile[0], tiles[1], tile[1], tiles[2], tile[2], 3)
    return coords.transpose(0, 2, 4, 1, 3, 5, 6).reshape(-1, 3)
