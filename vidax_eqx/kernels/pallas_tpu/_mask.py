"""Splash attention masks and the splash kernels of one static mask, cached.

Two masks, each with its block-sparse structure computed at trace time from intervals
and token classes (fully hidden blocks skipped, fully visible ones unmasked, the mask
evaluated in the kernel only on partially visible blocks), never materialized:

- `SplashPositionsMask`: a causal mask or sliding window on positions, and the padding
  keys beyond the real length (a sequence padded to the kernels' tiles costs one column
  of partially visible blocks, not a segment-id comparison on every block);
- `SplashTileMask`: the sliding tile mask;
- `SplashBlockCausalMask`: the frame-block causal mask (causal attention on the
  tokens' block keys).

`splash_kernel_for` builds the kernels (forward, dQ and dK/dV, or the fused backward)
of one mask at one configuration ([`SplashBlocks`][vidax_eqx.kernels.SplashBlocks]),
cached; `in_program` gives the traced call the mask's per-query ids computed in the
program instead of the cached constant.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..._jax_private import (
    SPLASH_DEFAULT_MASK_VALUE,
    SplashAttentionKernel,
    SplashBlockSizes,
    SplashComputableMask,
    SplashMaskInfo,
)
from .._block_causal import BlockCausalMask
from .._tile import SlidingTileMask
from ._tuning import SplashBlocks


def _tile_mask_function(tm: SlidingTileMask, local):
    """`mask_function(q_ids, kv_ids)` of one head's sliding tile mask, in the kernel.

    Integer arithmetic on positions (their tile coordinates by division by constants;
    comparisons), elementwise on any two arrays of one shape: splash runs it on the
    `(block_q, block_kv)` positions of a partially visible block, keys along lanes
    (forward, dQ) or sublanes (dK/dV). Division is by non-negative operands only,
    so truncating `lax.div` / `lax.rem` are floor division. `local`: `(left, right)`
    of a window on positions ANDed in (`None` side: unbounded), or `None`.
    """
    (window,) = tm.windows
    tiles = _, nh, nw = tm.tiles
    size, V, vs = tm.tile_size, tm.video_len, tm.video_start
    T, ts = tm.text_len, tm.text_start
    # Dimensions the window restricts (a window as wide as the grid covers it), and
    # dimensions whose last tile holds padding.
    narrow = [d for d in range(3) if window[d] < tiles[d]]
    ragged = [d for d in range(3) if tm.grid[d] % tm.tile[d]]
    strides = (nh * nw, nw, 1)  # of tile coordinates in the tile index
    inner_strides = (tm.tile[1] * tm.tile[2], tm.tile[2], 1)
    div, rem = jax.lax.div, jax.lax.rem

    def coordinate(x, d, stride, count):
        x = div(x, stride) if stride > 1 else x
        return rem(x, count) if d > 0 else x

    def decode(p, dims):
        v = p - vs
        video = (v >= 0) & (v < V)
        v = jnp.maximum(v, 0)
        t = div(v, size)
        coords = {d: coordinate(t, d, strides[d], tiles[d]) for d in set(dims) | set(ragged)}
        if ragged:
            r = rem(v, size)
            for d in ragged:  # a padding token lies beyond the grid along d
                inner = coordinate(r, d, inner_strides[d], tm.tile[d])
                video = video & (coords[d] * tm.tile[d] + inner < tm.grid[d])
        text = (p >= ts) & (p < ts + T) if T else None
        return text, video, coords

    def mask_function(q_ids, kv_ids):
        q_text, q_video, q_coords = decode(q_ids, narrow)
        k_text, k_video, k_coords = decode(kv_ids, narrow)
        seen = k_video
        for d in narrow:
            w = window[d]
            start = jnp.clip(q_coords[d] - w // 2, 0, tiles[d] - w)
            seen = seen & (k_coords[d] >= start) & (k_coords[d] < start + w)
        vis = q_video & seen
        if T:
            vis = vis | (q_video & k_text) | (q_text & (k_text | k_video))
        if local is not None:
            left, right = local
            if left is not None:
                vis = vis & (kv_ids >= q_ids - left)
            if right is not None:
                vis = vis & (kv_ids <= q_ids + right)
        return vis

    return mask_function


class _Classes(NamedTuple):
    """The tokens of a range of positions, by class: text, padding, or one video tile
    (the tile mask is constant over each class), run-length encoded. `runs`: the
    class of each run of tokens, `lengths`: its length; per class, `text` and
    `video` (its kind), `coords` and `starts` (its tile coordinates and window
    starts, three arrays each)."""

    runs: np.ndarray
    lengths: np.ndarray
    text: np.ndarray
    video: np.ndarray
    coords: tuple
    starts: tuple


def _constant_block(shape: tuple[int, int], value: bool) -> np.ndarray:
    """A read-only block of `value`, shared (splash only reads the blocks)."""
    block = _CONSTANT_BLOCKS.get((shape, value))
    if block is None:
        block = np.full(shape, value, np.bool_)
        block.flags.writeable = False
        _CONSTANT_BLOCKS[(shape, value)] = block
    return block


_CONSTANT_BLOCKS: dict = {}


class SplashTileMask(SplashComputableMask):
    """One head's [`SlidingTileMask`][] (a shared window), ANDed with a window on
    positions, as a splash mask over the kernel's padded lengths (positions beyond
    `seq_len` are padding: the tile mask hides them).

    In the kernel, `mask_function` evaluates it on partially visible blocks only. At
    trace time every `(q block, kv block)` pair is classified as hidden, fully
    visible or partial (`block_kinds`, from which `_mask_info` builds the
    kernel's block-sparse structure), at the level of token classes (text, padding,
    each video tile; a block holds a few): a few small NumPy operations per block,
    remembered. `mask[q_slice, kv_slice]` (what splash's own `process_mask` reads)
    is the dense block: a shared read-only constant for a hidden or fully visible
    block, the expansion of the class table for a partial one.
    """

    def __init__(self, tile_mask: SlidingTileMask, shape: tuple[int, int], local=None):
        if tile_mask.heads is not None:
            raise ValueError("SplashTileMask: one head's mask (a shared window) is needed.")
        self.tile_mask = tile_mask
        self.local = local
        self._key = (type(self), tile_mask, tuple(shape), local)
        (self._window,) = tile_mask.windows
        self._classes_of: dict[tuple[int, int], _Classes] = {}
        self._blocks: dict[tuple, object] = {}
        super().__init__(tuple(shape), _tile_mask_function(tile_mask, local))

    def __eq__(self, other):
        if not isinstance(other, SplashTileMask):
            return NotImplemented
        return self._key == other._key

    def __hash__(self):
        return hash(self._key)

    def __repr__(self):
        return f"SplashTileMask({self.tile_mask!r}, shape={self.shape}, local={self.local})"

    def _classes(self, start: int, stop: int) -> _Classes:
        found = self._classes_of.get((start, stop))
        if found is None:
            tm = self.tile_mask
            text, video, coords = tm.decode(np.arange(start, stop), np)
            _, nh, nw = tm.tiles
            code = np.where(text, -1, np.where(video, (coords[0] * nh + coords[1]) * nw + coords[2], -2))
            run_starts = np.concatenate([[0], np.flatnonzero(code[1:] != code[:-1]) + 1])
            lengths = np.diff(np.append(run_starts, len(code)))
            _, first, runs = np.unique(code[run_starts], return_index=True, return_inverse=True)
            at = run_starts[first]  # one token of each class
            coords = tuple(c[at] for c in coords)
            starts = tuple(s[0] for s in tm.window_starts(coords, np))
            found = _Classes(runs.reshape(-1), lengths, text[at], video[at], coords, starts)
            self._classes_of[(start, stop)] = found
        return found

    def _table(self, rows: _Classes, cols: _Classes) -> np.ndarray:
        """The mask between the runs, bool `(row runs, column runs)`."""
        box = cols.video[None, :]
        for d, w in enumerate(self._window):
            start = rows.starts[d][:, None]
            box = box & (cols.coords[d][None, :] >= start) & (cols.coords[d][None, :] < start + w)
        k_real = (cols.text | cols.video)[None, :]
        table = (rows.text[:, None] & k_real) | (rows.video[:, None] & (cols.text[None, :] | box))
        return table[np.ix_(rows.runs, cols.runs)]

    def _local(self, q: tuple[int, int], k: tuple[int, int]):
        """The window on positions over the block: `True` (all of it visible),
        `False` (none), or the dense block."""
        if self.local is None:
            return True
        left, right = self.local
        (q0, q1), (k0, k1) = q, k
        last_q, last_k = q1 - 1, k1 - 1
        if (left is not None and last_k < q0 - left) or (right is not None and k0 > last_q + right):
            return False
        if (left is None or k0 >= last_q - left) and (right is None or last_k <= q0 + right):
            return True
        q_ids, kv_ids = np.arange(q0, q1)[:, None], np.arange(k0, k1)[None, :]
        vis = np.ones((q1 - q0, k1 - k0), np.bool_)
        if left is not None:
            vis &= kv_ids >= q_ids - left
        if right is not None:
            vis &= kv_ids <= q_ids + right
        return vis

    def __getitem__(self, idx) -> np.ndarray:
        bounds = _bounds(idx, self.shape)
        (q0, q1), (k0, k1) = bounds
        kind = self._kind(q0, q1, k0, k1)
        if kind is not None:
            return _constant_block((q1 - q0, k1 - k0), kind)
        rows, cols = self._classes(q0, q1), self._classes(k0, k1)
        block = np.repeat(np.repeat(self._table(rows, cols), cols.lengths, axis=1), rows.lengths, axis=0)
        local = self._local(*bounds)
        return block if local is True else block & local

    def _kind(self, q0: int, q1: int, k0: int, k1: int) -> bool | None:
        """Block `[q0, q1) x [k0, k1)`: hidden (`False`), fully visible (`True`) or
        partially visible (`None`); remembered."""
        key = (q0, q1, k0, k1)
        kind = self._blocks.get(key, "new")
        if kind == "new":
            table = self._table(self._classes(q0, q1), self._classes(k0, k1))
            local = self._local((q0, q1), (k0, k1))
            if local is False or not table.any():
                kind = False
            elif local is True and table.all():
                kind = True
            else:
                kind = None
            self._blocks[key] = kind
        return kind

    def block_kinds(self, block_q: int, block_kv: int) -> np.ndarray:
        """Every `(q block, kv block)` pair as splash's `block_mask` marks it: int32
        `(S_q / block_q, S_k / block_kv)`, 0 hidden, 1 partially visible (the mask
        evaluated in the kernel), 2 fully visible."""
        S_q, S_k = self.shape
        code = {False: 0, None: 1, True: 2}
        return np.asarray(
            [
                [code[self._kind(i, i + block_q, j, j + block_kv)] for j in range(0, S_k, block_kv)]
                for i in range(0, S_q, block_q)
            ],
            np.int32,
        )


class SplashPositionsMask(SplashComputableMask):
    """A window on positions (`(left, right)`, a `None` side unbounded; causal is
    `(None, 0)`; `None`: no window) and the padding keys at index `>= kv_len`, as a
    splash mask over the kernels' padded `shape`.

    Its blocks are classified from intervals (`block_kinds`); `mask_function`
    evaluates it in the kernel on the partially visible ones. `mask[q_slice, kv_slice]`
    (splash's `process_mask` reads it; the tests compare) is the dense block.
    """

    def __init__(self, shape: tuple[int, int], kv_len: int, window=None):
        self.kv_len = int(kv_len)
        self.window = window
        self._key = (type(self), tuple(shape), self.kv_len, window)
        left, right = (None, None) if window is None else window
        kv_len = self.kv_len

        def mask_function(q_ids, kv_ids):
            vis = kv_ids < kv_len
            if left is not None:
                vis = vis & (kv_ids >= q_ids - left)
            if right is not None:
                vis = vis & (kv_ids <= q_ids + right)
            return vis

        super().__init__(tuple(shape), mask_function)

    def __eq__(self, other):
        if not isinstance(other, SplashPositionsMask):
            return NotImplemented
        return self._key == other._key

    def __hash__(self):
        return hash(self._key)

    def __repr__(self):
        return f"SplashPositionsMask(shape={self.shape}, kv_len={self.kv_len}, window={self.window})"

    def __getitem__(self, idx) -> np.ndarray:
        (q0, q1), (k0, k1) = _bounds(idx, self.shape)
        block = self.mask_function(np.arange(q0, q1)[:, None], np.arange(k0, k1)[None, :])
        return np.broadcast_to(block, (q1 - q0, k1 - k0))

    def block_kinds(self, block_q: int, block_kv: int) -> np.ndarray:
        """As `SplashTileMask.block_kinds`: int32 `(S_q / block_q, S_k / block_kv)`, 0
        hidden, 1 partially visible, 2 fully visible."""
        S_q, S_k = self.shape
        q0 = np.arange(0, S_q, block_q)[:, None]
        q1 = q0 + block_q - 1  # last query of the block
        k0 = np.arange(0, S_k, block_kv)[None, :]
        k1 = k0 + block_kv - 1
        hidden = np.broadcast_to(k0 >= self.kv_len, (len(q0), k0.shape[1]))
        full = np.broadcast_to(k1 < self.kv_len, hidden.shape)
        left, right = (None, None) if self.window is None else self.window
        if left is not None:  # visible keys: k >= q - left
            hidden = hidden | (k1 < q0 - left)
            full = full & (k0 >= q1 - left)
        if right is not None:  # and k <= q + right
            hidden = hidden | (k0 > q1 + right)
            full = full & (k1 <= q0 + right)
        return np.where(hidden, 0, np.where(full, 2, 1)).astype(np.int32)


class SplashBlockCausalMask(SplashComputableMask):
    """A [`BlockCausalMask`][] as a splash mask over the kernels' padded `shape`
    (positions beyond `seq_len` are padding: the mask hides them; the queries start at
    its `query_offset`).

    The kernel takes one int per query (splash's `q_sequence`, here [`query_ids`][]
    instead of the positions): the end of the video keys it sees, `video_start + (b + 1)
    * block_len` for a query of block `b`, `video_start + video_len` for a text query
    (it sees every video key), -1 for padding. Its `mask_function(ends, kv_ids)` is then
    a few comparisons per element on the partially visible blocks: key positions
    below the end (and, with a window, at or above `end - window * block_len`), inside
    the video, or text to a real query. (Computing each token's block in the kernel
    takes an integer division, which the TPU's vector unit does not have: the forward at
    Wan 480p ran at 0.74 of full attention that way, measured on v5e.) At trace time
    `block_kinds` classifies every `(q block, kv block)` pair from the ranges of the
    blocks' keys, so the kernel never visits the hidden ones; `mask[q_slice,
    kv_slice]` is the dense block over positions.
    """

    def __init__(self, block_causal: BlockCausalMask, shape: tuple[int, int]):
        self.block_causal = block_causal
        self._key = (type(self), block_causal, tuple(shape))
        bc = block_causal
        size, vs, V, T, left = bc.block_len, bc.video_start, bc.video_len, bc.text_len, bc.left
        suffix = T and bc.text_position == "suffix"
        ts = bc.text_start

        def mask_function(ends, kv_ids):
            vis = (kv_ids < ends) & (kv_ids < vs + V)  # earlier video (and a prefix text)
            if left is not None:  # the window's first key (no text beside a window)
                vis = vis & (kv_ids >= ends - (left + 1) * size)
            if suffix:  # the text after the video, seen by every real query
                vis = vis | ((kv_ids >= ts) & (kv_ids < ts + T) & (ends >= 0))
            return vis

        super().__init__(tuple(shape), mask_function)

    def query_ids(self, xp=np):
        """What the kernel's `mask_function` takes per query (splash's `q_sequence`):
        int32 `(S_q,)`, the end of the video keys each query sees (-1: padding); in
        NumPy, or with `xp=jnp` computed in the program from an iota (`in_program`)."""
        bc = self.block_causal
        q_keys, _ = bc.keys(bc.query_offset + xp.arange(self.shape[0]), xp.zeros(1, xp.int32), xp)
        ends = xp.where(q_keys >= 0, bc.video_start + (xp.minimum(q_keys, bc.blocks - 1) + 1) * bc.block_len, -1)
        text = q_keys == bc.blocks
        return xp.where(text, bc.video_start + bc.video_len, ends).astype(xp.int32)

    def __eq__(self, other):
        if not isinstance(other, SplashBlockCausalMask):
            return NotImplemented
        return self._key == other._key

    def __hash__(self):
        return hash(self._key)

    def __repr__(self):
        return f"SplashBlockCausalMask({self.block_causal!r}, shape={self.shape})"

    def __getitem__(self, idx) -> np.ndarray:
        (q0, q1), (k0, k1) = _bounds(idx, self.shape)
        offset = self.block_causal.query_offset
        return np.asarray(self.block_causal.visible(offset + np.arange(q0, q1), np.arange(k0, k1), np))

    def block_kinds(self, block_q: int, block_kv: int) -> np.ndarray:
        """As `SplashTileMask.block_kinds`: int32 `(S_q / block_q, S_k / block_kv)`, 0
        hidden, 1 partially visible, 2 fully visible; from each block's key range."""
        S_q, S_k = self.shape
        bc = self.block_causal
        q_keys, kv_keys = bc.keys(bc.query_offset + np.arange(S_q), np.arange(S_k), np)
        q_keys, kv_keys = q_keys.reshape(-1, block_q), kv_keys.reshape(-1, block_kv)
        # Fully visible: every pair, padding included (a padding row or column is not).
        full = kv_keys.max(1)[None, :] <= q_keys.min(1)[:, None]
        # Hidden: no pair of real tokens visible. Their keys in a block are a run of
        # consecutive blocks (and, without a window, possibly text), so the ranges decide
        # exactly: query keys [lo, hi] see the keys [lo - left, hi].
        q_real, kv_real = q_keys >= -1, kv_keys <= bc.blocks
        big = np.iinfo(np.int32).max
        q_lo = np.where(q_real, q_keys, big).min(1)[:, None]
        q_hi = np.where(q_real, q_keys, -big).max(1)[:, None]
        k_lo = np.where(kv_real, kv_keys, big).min(1)[None, :]
        k_hi = np.where(kv_real, kv_keys, -big).max(1)[None, :]
        hidden = k_lo > q_hi
        if bc.left is not None:
            hidden = hidden | (k_hi < q_lo - bc.left)
            full = full & (kv_keys.min(1)[None, :] >= q_keys.max(1)[:, None] - bc.left)
        return np.where(hidden, 0, np.where(full, 2, 1)).astype(np.int32)


def _bounds(idx, shape) -> list[tuple[int, int]]:
    """The `(start, stop)` of a 2D slice of a mask of `shape` (splash reads blocks so)."""
    if not (isinstance(idx, tuple) and len(idx) == 2 and all(isinstance(i, slice) for i in idx)):
        raise NotImplementedError(f"Unsupported slice: {idx}")
    bounds = []
    for i, n in zip(idx, shape):
        start = 0 if i.start is None else i.start
        stop = n if i.stop is None else i.stop
        if i.step not in (None, 1) or not 0 <= start <= stop <= n:
            raise NotImplementedError(f"Unsupported slice: {idx}")
        bounds.append((start, stop))
    return bounds


def _downcast(x: np.ndarray) -> np.ndarray:
    """The smallest of int8 / int16 / int32 that holds `x` (splash's scalar-memory
    arrays, as its `process_mask` downcasts them)."""
    top = int(x.max()) if x.size else 0
    for dtype in (np.int8, np.int16):
        if top <= np.iinfo(dtype).max:
            return x.astype(dtype)
    return x.astype(np.int32)


def _mask_info(kinds: np.ndarray, q_ids: np.ndarray, dkv: bool, shrink: bool = True):
    """Splash's `MaskInfo` of one mask shared by every head and computed in the
    kernel (`mask_function`), from its block kinds (`block_kinds`).

    What splash's `process_mask` (forward, dQ) / `process_mask_dkv` (dK/dV) return
    for such a mask (one head shard, one query shard, the grid shrunk to the
    visible blocks; `tests/test_sparse_pallas.py` checks the two agree), without
    materializing and hashing every partially visible `(block_q, block_kv)` block
    in NumPy, as splash does before throwing them away for a mask computed in the
    kernel: 6 s and 1.3 GB of host memory at Wan 480p, against 0.4 s here.

    Forward / dQ: row `i` lists the visible kv blocks `j` of query block `i`
    (`data_next`) with their kinds (`block_mask`), left-aligned and padded with 0.
    dK/dV: column `j` lists the visible query blocks of kv block `j`, bottom-aligned;
    unshrunk (`shrink=False`, what the fused backward needs: it writes one partial dQ
    per grid step, at the step's own query block), every query block in order.
    """
    lines = kinds.T if dkv else kinds
    if not shrink:
        # Every block in grid order (lines outer); a hidden one points at the next visible
        # block in that order (wrapping to the first), whose data the kernel prefetches.
        visible = np.flatnonzero(lines.reshape(-1))
        data = np.zeros(lines.size, np.int32)
        if len(visible):
            at = np.searchsorted(visible, np.arange(lines.size))
            data = visible[np.where(at == len(visible), 0, at)] % lines.shape[1]
        data = data.reshape(lines.shape)
        block = lines
        if dkv:
            block, data = block.T, data.T
        return _info(data, block, q_ids)
    visible = [np.flatnonzero(line) for line in lines]
    width = max(1, max(len(v) for v in visible))
    index = np.full((len(lines), width), -1, np.int32)
    for n, v in enumerate(visible):
        if dkv:
            index[n, width - len(v):] = v
        else:
            index[n, : len(v)] = v
    block = np.where(index >= 0, np.take_along_axis(lines, np.maximum(index, 0), axis=1), 0)
    data = np.maximum(index, 0)
    if dkv:
        block, data = block.T, data.T
    return _info(data, block, q_ids)


def _info(data: np.ndarray, block: np.ndarray, q_ids: np.ndarray):
    """A `MaskInfo` of one head shard from its `data_next` and `block_mask` tables, with
    `q_ids` what the mask function takes per query (the positions, but for a
    `SplashBlockCausalMask`)."""
    return SplashMaskInfo(
        data_next=_downcast(np.ascontiguousarray(data[None]).astype(np.int32)),
        mask_next=None,
        block_mask=_downcast(np.ascontiguousarray(block[None]).astype(np.int32)),
        partial_mask_blocks=None,
        q_sequence=np.asarray(q_ids, np.int32),
    )


def _splash_block_sizes(blocks: SplashBlocks):
    """Splash's `BlockSizes` of a configuration."""
    dq = {} if blocks.fused_bwd else dict(block_q_dq=blocks.block_q_dq, block_kv_dq=blocks.block_kv_dq)
    return SplashBlockSizes(
        block_q=blocks.block_q,
        block_kv=blocks.block_kv,
        block_kv_compute=blocks.block_kv_compute,
        block_q_dkv=blocks.block_q_dkv,
        block_kv_dkv=blocks.block_kv_dkv,
        block_kv_dkv_compute=blocks.block_kv_dkv_compute,
        use_fused_bwd_kernel=blocks.fused_bwd,
        **dq,
    )


def _kernel(mask, blocks: SplashBlocks, soft_cap, interpret: bool):
    """The splash kernel of `mask` (one head's; the kernel serves any number of heads
    with it) at `blocks`, its mask infos built by `_mask_info` from the mask's block
    kinds; the mask is evaluated in the kernel only where a block is partially visible
    (no `mask_function` at all when none is)."""
    specs = {
        "fwd": ((blocks.block_q, blocks.block_kv), False, True),
        "dkv": ((blocks.block_q_dkv, blocks.block_kv_dkv), True, not blocks.fused_bwd),
    }
    if not blocks.fused_bwd:
        specs["dq"] = ((blocks.block_q_dq, blocks.block_kv_dq), False, True)
    kinds = {shape: mask.block_kinds(*shape) for shape, _, _ in specs.values()}
    q_ids = mask.query_ids() if isinstance(mask, SplashBlockCausalMask) else np.arange(mask.shape[0], dtype=np.int32)
    infos = {name: _mask_info(kinds[shape], q_ids, dkv, shrink) for name, (shape, dkv, shrink) in specs.items()}
    partial = any((k == 1).any() for k in kinds.values())
    if not partial:  # no mask in the kernel: splash then takes no query positions either
        infos = {name: info._replace(q_sequence=None) for name, info in infos.items()}
    infos = {name: jax.tree.map(jnp.array, info) for name, info in infos.items()}
    return SplashAttentionKernel(
        infos["fwd"],
        infos.get("dq"),
        infos["dkv"],
        block_sizes=_splash_block_sizes(blocks),
        is_mqa=False,
        save_residuals=True,
        mask_value=SPLASH_DEFAULT_MASK_VALUE,
        attn_logits_soft_cap=soft_cap,
        residual_checkpoint_name=None,
        mask_function=mask.mask_function if partial else None,
        interpret=interpret,
    )


def in_program(kernel, block_causal: BlockCausalMask | None = None):
    """`kernel` (of [`splash_kernel_for`][], `block_causal` as given to it) with what
    its mask function takes per query (splash's `q_sequence`: the positions, or a
    `SplashBlockCausalMask`'s `query_ids`) computed in the program from an iota.

    The cached kernel holds them as an array made at trace time, which a traced program
    carries as a constant of one int32 per query: an exported model grew with the token
    count (4 bytes a query for each distinct mask, 19 of 103 KB at 2,304 tokens of a
    tiny Wan). Call it where the kernel is traced; the values are the same."""
    info = kernel.fwd_mask_info
    if info.q_sequence is None:  # no mask evaluated in the kernel
        return kernel
    S_q = info.q_sequence.shape[0]
    if block_causal is None:
        ids = jax.lax.iota(jnp.int32, S_q)
    else:  # its query ids depend on the query length alone
        ids = SplashBlockCausalMask(block_causal, (S_q, S_q)).query_ids(jnp)
    infos = [None if i is None else i._replace(q_sequence=ids)
             for i in (info, kernel.dq_mask_info, kernel.dkv_mask_info)]
    return type(kernel)(*infos, **kernel.kwargs)


@functools.lru_cache(maxsize=64)
def splash_kernel_for(
    shape: tuple[int, int],
    kv_len: int,
    causal: bool,
    window,
    soft_cap: float | None,
    blocks: SplashBlocks,
    interpret: bool,
    tile_mask: SlidingTileMask | None = None,
    block_causal: BlockCausalMask | None = None,
):
    """A splash kernel (forward with lse; dK/dV and dQ, or fused, backward blocks) for
    one static mask over the kernels' padded `shape`, at `blocks`.

    `kv_len`: the real key length (keys beyond it are padding, hidden by the mask);
    `tile_mask`: one head's sliding tile mask (a shared window; it hides the padding
    itself), ANDed with the causal mask / window, for every head of the kernel;
    `block_causal`: a frame-block causal mask (it hides the padding itself; no causal
    mask or window beside it).
    """
    left, right = (None, None) if window is None else window
    if causal:  # causal and a window: the window with its right side cut at 0
        right = 0 if right is None else min(right, 0)
    local = None if left is None and right is None else (left, right)
    if block_causal is not None:
        assert local is None and tile_mask is None, "normalize refuses these beside a BlockCausalMask"
        mask = SplashBlockCausalMask(block_causal, shape)
    elif tile_mask is not None:
        mask = SplashTileMask(tile_mask, shape, local)
    else:
        mask = SplashPositionsMask(shape, kv_len, local)
    # The mask metadata are constants: built eagerly even when first asked for
    # under a trace, so the cached kernel holds no tracer.
    with jax.ensure_compile_time_eval():
        return _kernel(mask, blocks, soft_cap, interpret)
