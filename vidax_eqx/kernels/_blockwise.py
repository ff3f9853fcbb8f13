"""`"blockwise"`: portable flash attention in pure JAX.

The forward maps over query blocks and scans over key/value blocks with an
online softmax; the backward scans over key/value blocks (carrying their dK/dV)
and, inside, over query blocks (accumulating dQ in place), recomputing each
tile's probabilities from the saved `lse`. Nothing of size `S_q * S_k` exists
at any point unless the caller passes a full-size bias or mask.

Sequences of any length are padded up to a multiple of the block size; padded
keys are invisible (through the segment ids when given, else a validity row)
and padded query rows are dropped. Key-only padding (`kv_lengths`) hides keys by
index; key blocks beyond every batch row's length are skipped. A tile that the causal / window / segment /
mask structure hides entirely is skipped by `lax.cond`, not computed and
discarded.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _math as m
from . import _sparse
from ._args import Operands, Options
from ._base import AbstractImplementation, Capabilities
from ._block_causal import lower as lower_block_causal
from ._tile_tables import (
    block_may_see, kv_block_ranges, kv_features, q_block_ranges, layout_valid, q_features, tile_block,
    window_table,
)


class _Blocks(NamedTuple):
    """The operands cut into blocks (leading axis = block index), rows layout."""

    q: jax.Array  # (nq, B, K, M, D), M = G * bq
    qs: jax.Array  # q with the logit scale folded in (`_math.fold_scale`)
    q_pos: jax.Array  # (nq, M)
    seg_q: jax.Array | None  # (nq, B, M)
    k: jax.Array  # (nk, B, K, bk, D)
    kt: jax.Array  # (nk, B, K, D, bk)
    v: jax.Array  # (nk, B, K, bk, D)
    vt: jax.Array  # (nk, B, K, D, bk)
    kv_pos: jax.Array  # (nk, bk)
    seg_kv: jax.Array | None  # (nk, B, bk)
    kv_valid: jax.Array | None  # (nk, bk), only when S_k was padded without segment ids
    # Sliced per tile: (B|1, H|1, Sq_pad|1, Sk_pad|1).
    bias: jax.Array | None
    mask: jax.Array | None
    # A sliding tile mask's `_tile.q_features` / `kv_features` per block, or None.
    tile_q: tuple | None = None
    tile_kv: tuple | None = None
    kv_lengths: jax.Array | None = None  # (B,) int32, key-only padding


class _TablePlan(NamedTuple):
    """A sliding tile mask on default positions, served by `_sparse`'s gathering kernel
    from a static table of each video query tile's visible key tiles (its window,
    then the text, padded to whole tiles, as extra key tiles)."""

    video: slice  # the video tokens along the sequence
    text: slice  # the text tokens (empty without text)
    text_pad: int  # invisible keys completing the last text tile
    tiles: np.ndarray  # int32 (1|H, n_video_tiles, n_sel)
    kv_valid: np.ndarray  # bool (video_len + text_len + text_pad,)
    q_valid: np.ndarray | None  # bool (video_len,); None when every video token is real


class _Ranges(NamedTuple):
    """Per-block ranges of positions and segment ids, for skipping hidden tiles."""

    q_pos: tuple[jax.Array, jax.Array]  # (lo, hi), each (nq,)
    kv_pos: tuple[jax.Array, jax.Array]  # (nk,)
    seg_q: tuple[jax.Array, jax.Array] | None  # (nq, B)
    seg_kv: tuple[jax.Array, jax.Array] | None  # (nk, B)
    tile_q: tuple | None  # `_tile.q_block_ranges`, with a sliding tile mask
    tile_kv: tuple | None  # `_tile.kv_block_ranges`


def _pad(x: jax.Array | None, axis: int, size: int, *, value=0, edge=False) -> jax.Array | None:
    if x is None or x.shape[axis] in (1, size):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    if edge:
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def _tile(x: jax.Array | None, i, j, bq: int, bk: int) -> jax.Array | None:
    """Tile `(i, j)` of a rank-4 bias / mask whose last two axes are full or 1."""
    if x is None:
        return None
    b, h, sq, sk = x.shape
    start = (0, 0, i * bq if sq > 1 else 0, j * bk if sk > 1 else 0)
    return lax.dynamic_slice(x, start, (b, h, min(sq, bq), min(sk, bk)))


def _tile_add(acc: jax.Array, update: jax.Array, i, j, bq: int, bk: int) -> jax.Array:
    _, _, sq, sk = acc.shape
    start = (0, 0, i * bq if sq > 1 else 0, j * bk if sk > 1 else 0)
    return lax.dynamic_update_slice(acc, lax.dynamic_slice(acc, start, update.shape) + update, start)


def _insert(x: jax.Array, axis: int, at: int, count: int, *, value=0) -> jax.Array:
    """`x` with `count` copies of `value` inserted before index `at` of `axis` (an axis
    of size 1, broadcast, is left alone)."""
    if x.shape[axis] == 1:
        return x
    shape = list(x.shape)
    shape[axis] = count
    filler = jnp.full(shape, value, x.dtype)
    head, tail = jnp.split(x, [at], axis=axis)
    return jnp.concatenate([head, filler, tail], axis=axis)


def _remove(x: jax.Array, axis: int, at: int, count: int) -> jax.Array:
    """The inverse of `_insert`."""
    if x.shape[axis] == 1:
        return x
    head, _, tail = jnp.split(x, [at, at + count], axis=axis)
    return jnp.concatenate([head, tail], axis=axis)


def _kv_index(j, bk: int) -> jax.Array:
    """The sequence indices `(bk,)` of the keys of block `j`."""
    return j * bk + jnp.arange(bk, dtype=jnp.int32)


def _block(x: jax.Array, i) -> jax.Array:
    """Block `i` of blocked operands (leading axis = block index)."""
    return lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _seg_range(seg: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per block and batch row: (min, max) of the non-negative ids (empty: lo > hi)."""
    big = jnp.iinfo(jnp.int32).max
    return jnp.min(jnp.where(seg >= 0, seg, big), axis=-1), jnp.max(seg, axis=-1)


@dataclasses.dataclass(frozen=True)
class Blockwise(AbstractImplementation):
    """Flash attention in pure JAX: O(S) memory forward and backward, every feature.

    **Arguments:**

    - `block_q`: query positions per tile (each tile holds `block_q * H // H_kv`
        rows, the query heads that share a kv head).
    - `block_kv`: key/value positions per tile.
    - `sta_table`: serve a sliding tile mask on default positions (the whole
        sequence, no segment ids, key-only padding, bias, dense mask, sinks,
        causal / window mask or soft cap) from a static table of each video query
        tile's visible key tiles: every step gathers all of its window's key tiles
        (and the text's) and runs one softmax over them, the path of video sparse
        attention's fine stage, which keeps the cores busier than a loop over tile
        pairs. Text queries, and every request the table does not serve, run the
        tile-skipping loop. `False`: always the loop (for comparison).

    Sequences shorter than a block use one block of their own length. The
    defaults were chosen by `benchmarks/attention.py` on a 2-core CPU
    (see `benchmarks/NOTES.md`). With a [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask]
    both blocks are whole tiles instead (one tile, or about 128 tokens of small
    tiles) and a text prefix is followed by invisible filler up to a block
    boundary, so that every (query block, key block) pair is entirely visible or
    entirely hidden and the hidden ones are skipped: the time scales with the
    mask's density.
    """

    block_q: int = 256
    block_kv: int = 512
    sta_table: bool = True

    name = "blockwise"
    capabilities = Capabilities(
        platforms=("cpu", "gpu", "tpu"),
        dtypes=("float32", "bfloat16", "float16", "float64"),
        portable=True,
        tile_mask=True,
        block_causal=True,
        kv_lengths=True,
        video_sparse=True,
        memory="O(S)",
    )

    def __post_init__(self):
        for field in ("block_q", "block_kv"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{field}` must be a positive int; received {value!r}.")
        if not isinstance(self.sta_table, bool):
            raise ValueError(f"`sta_table` must be a bool; received {self.sta_table!r}.")

    def _blocks(self, ops: Operands, opts: Options) -> tuple[_Blocks, float]:
        """The blocked operands and the logit factor `fold_scale` left over.

        Keys and values come in both layouts, `(bk, D)` and transposed `(D, bk)`,
        so no tile transposes anything inside the loops (XLA drops unused ones).
        """
        B, S_q, H, D = ops.q.shape
        S_k, K = ops.k.shape[1], ops.k.shape[2]
        G = H // K
        bq, bk = self._block_sizes(opts)
        bq, bk = min(bq, S_q), min(bk, S_k)
        nq, nk = math.ceil(S_q / bq), math.ceil(S_k / bk)
        Pq, Pk = nq * bq, nk * bk

        q = m.split_q(_pad(ops.q, 1, Pq), K, bq)
        qs, rest = m.fold_scale(opts, q)
        k = m.split_kv(_pad(ops.k, 1, Pk), bk)
        v = m.split_kv(_pad(ops.v, 1, Pk), bk)
        if ops.q_pos is None:
            q_pos = jnp.arange(Pq, dtype=jnp.int32)
            kv_pos = jnp.arange(Pk, dtype=jnp.int32)
        else:  # edge padding keeps each block's position range tight
            q_pos = _pad(ops.q_pos, 0, Pq, edge=True)
            kv_pos = _pad(ops.kv_pos, 0, Pk, edge=True)
        seg_q = seg_kv = kv_valid = None
        if ops.seg_q is not None:
            seg_q = _pad(ops.seg_q, 1, Pq, value=-1).reshape(B, nq, bq).transpose(1, 0, 2)
            seg_kv = _pad(ops.seg_kv, 1, Pk, value=-1).reshape(B, nk, bk).transpose(1, 0, 2)
        elif Pk != S_k:
            kv_valid = (jnp.arange(Pk) < S_k).reshape(nk, bk)
        blocks = _Blocks(
            q=q,
            qs=qs,
            q_pos=m.repeat_rows(q_pos.reshape(nq, bq), G),
            seg_q=m.repeat_rows(seg_q, G),
            k=k,
            kt=jnp.swapaxes(k, -1, -2),
            v=v,
            vt=jnp.swapaxes(v, -1, -2),
            kv_pos=kv_pos.reshape(nk, bk),
            seg_kv=seg_kv,
            kv_valid=kv_valid,
            bias=_pad(_pad(ops.bias, 2, Pq), 3, Pk),
            mask=_pad(_pad(ops.mask, 2, Pq), 3, Pk),
            kv_lengths=ops.kv_lengths,
        )
        if opts.tile_mask is not None:
            blocks = blocks._replace(
                tile_q=q_features(opts.tile_mask, blocks.q_pos, K, H),
                tile_kv=kv_features(opts.tile_mask, blocks.kv_pos),
            )
        return blocks, rest

    def sparse_fwd(self, q, k, v, tiles, kv_valid, *, tile_size: int, scale: float):
        """VSA's fine stage: each step gathers the selected key/value tiles of at least
        two query tiles (about `block_q` query positions, at most 128), in two
        independent lanes (`_sparse.gather_fwd`)."""
        return _sparse.gather_fwd(q, k, v, tiles, kv_valid, tile_size=tile_size, scale=scale,
                                  **self._gather_args(tile_size))

    def sparse_bwd(self, q, k, v, tiles, kv_valid, out, lse, dout, dlse, *, tile_size: int, scale: float):
        """The gradients of `sparse_fwd` (`_sparse.gather_bwd`)."""
        return _sparse.gather_bwd(q, k, v, tiles, kv_valid, out, lse, dout, dlse, tile_size=tile_size,
                                  scale=scale, **self._gather_args(tile_size))

    def _gather_args(self, tile_size: int) -> dict:
        # Measured on 2 CPU cores (benchmarks/NOTES.md): two query tiles per step in two
        # independent lanes beat one tile per step and one batched lane of two.
        return {"q_tiles": max(2, round(min(self.block_q, 128) / tile_size)), "lanes": 2}

    def _block_sizes(self, opts: Options) -> tuple[int, int]:
        if opts.tile_mask is None:
            return self.block_q, self.block_kv
        block = tile_block(opts.tile_mask, min(self.block_q, 128))
        return block, block

    @staticmethod
    def _ranges(ops: Operands, opts: Options, blocks: _Blocks) -> _Ranges:
        bq = blocks.q.shape[3] // (ops.q.shape[2] // ops.k.shape[2])
        q_pos = blocks.q_pos[:, :bq]  # one head's copy suffices
        seg_q = None if blocks.seg_q is None else blocks.seg_q[..., :bq]
        tm = opts.tile_mask
        return _Ranges(
            q_pos=(jnp.min(q_pos, axis=1), jnp.max(q_pos, axis=1)),
            kv_pos=(jnp.min(blocks.kv_pos, axis=1), jnp.max(blocks.kv_pos, axis=1)),
            seg_q=None if seg_q is None else _seg_range(seg_q),
            seg_kv=None if blocks.seg_kv is None else _seg_range(blocks.seg_kv),
            tile_q=None if tm is None else q_block_ranges(tm, q_pos),
            tile_kv=None if tm is None else kv_block_ranges(tm, blocks.kv_pos),
        )

    def _aligned(self, ops: Operands, opts: Options) -> tuple[Operands, tuple[int, int]]:
        """With a sliding tile mask on default positions whose first part (the text
        prefix, or the video before a suffix) does not fill whole blocks: `ops`
        with `gap` invisible tokens (position -1, outside the mask) inserted after
        it, so that each block of the second part starts at a block boundary.
        Returns the operands and `(first, gap)` (`gap == 0`: unchanged)."""
        tm = opts.tile_mask
        if tm is None or ops.q_pos is not None or tm.text_len == 0:
            return ops, (0, 0)
        block = min(self._block_sizes(opts)[0], ops.q.shape[1])
        first = tm.text_len if tm.text_position == "prefix" else tm.video_len
        gap = (-first) % block
        if gap == 0:
            return ops, (0, 0)
        S = ops.q.shape[1]
        positions = jnp.concatenate(
            [jnp.arange(first, dtype=jnp.int32), jnp.full((gap,), -1, jnp.int32),
             jnp.arange(first, S, dtype=jnp.int32)]
        )
        seg = lambda x: None if x is None else _insert(x, 1, first, gap, value=-1)
        seg_q = seg(ops.seg_q)
        bias = ops.bias
        if bias is not None:
            bias = _insert(_insert(bias, 2, first, gap), 3, first, gap)
        ops = ops._replace(
            q=_insert(ops.q, 1, first, gap),
            k=_insert(ops.k, 1, first, gap),
            v=_insert(ops.v, 1, first, gap),
            bias=bias,
            seg_q=seg_q,
            seg_kv=seg_q if ops.seg_kv is ops.seg_q else seg(ops.seg_kv),
            q_pos=positions,
            kv_pos=positions,
        )
        if ops.kv_lengths is not None:  # keys after the gap moved `gap` indices on
            lengths = ops.kv_lengths
            ops = ops._replace(kv_lengths=jnp.where(lengths > first, lengths + gap, lengths))
        return ops, (first, gap)

    # -- sliding tile attention from a static table of key tiles ----------------------

    def _table_plan(self, ops: Operands, opts: Options) -> _TablePlan | None:
        """The table path's plan, or None when the request has anything it does not
        serve (positions of a chunk, segment ids, key-only padding, bias, a dense mask,
        sinks, causal / window masks, a soft cap): those run the tile-skipping loop."""
        tm = opts.tile_mask
        if (
            tm is None or not self.sta_table or ops.q_pos is not None or opts.causal
            or opts.window is not None or opts.logits_soft_cap is not None
            or any(x is not None for x in (ops.bias, ops.mask, ops.seg_q, ops.sinks, ops.kv_lengths))
            or ops.q.shape[1] != tm.seq_len or ops.k.shape[1] != tm.seq_len
        ):
            return None
        T = tm.tile_size
        video = slice(tm.video_start, tm.video_start + tm.video_len)
        text = slice(tm.text_start, tm.text_start + tm.text_len)
        text_pad = (-tm.text_len) % T
        n_video = tm.video_len // T
        table = window_table(tm)
        if tm.text_len:  # every video query sees every text key: whole extra key tiles
            n_text = (tm.text_len + text_pad) // T
            text_tiles = np.broadcast_to(np.arange(n_video, n_video + n_text, dtype=np.int32),
                                         (*table.shape[:2], n_text))
            table = np.concatenate([table, text_tiles], axis=-1)
        real = layout_valid(tm.grid, tm.tile)
        kv_valid = np.concatenate([real, np.ones(tm.text_len, bool), np.zeros(text_pad, bool)])
        return _TablePlan(video, text, text_pad, table, kv_valid, None if real.all() else real)

    def _table_operands(self, ops: Operands, plan: _TablePlan):
        """The gathering kernel's keys and values (video, then the padded text) and
        its `(B, H, n_video_tiles, n_sel)` table."""
        B, _, H, _ = ops.q.shape
        pad = lambda x: jnp.pad(x[:, plan.text], ((0, 0), (0, plan.text_pad), (0, 0), (0, 0)))
        k, v = ops.k[:, plan.video], ops.v[:, plan.video]
        if plan.text.stop > plan.text.start:
            k, v = jnp.concatenate([k, pad(ops.k)], axis=1), jnp.concatenate([v, pad(ops.v)], axis=1)
        tiles = jnp.broadcast_to(jnp.asarray(plan.tiles), (B, H, *plan.tiles.shape[1:]))
        tiles = m.as_varying(tiles, m.varying_axes(ops.q, ops.k, ops.v))
        q_valid = None if plan.q_valid is None else jnp.asarray(plan.q_valid)
        return k, v, tiles, jnp.asarray(plan.kv_valid), q_valid

    @staticmethod
    def _text_rows(ops: Operands, plan: _TablePlan) -> Operands:
        """The text queries over every key: the tile-skipping loop on their positions
        (text queries see every real token, so it skips nothing and needs no table)."""
        S = ops.k.shape[1]
        t = plan.text
        return ops._replace(q=ops.q[:, t], q_pos=jnp.arange(t.start, t.stop, dtype=jnp.int32),
                            kv_pos=jnp.arange(S, dtype=jnp.int32))

    def _table_fwd(self, ops: Operands, opts: Options, plan: _TablePlan):
        k, v, tiles, kv_valid, q_valid = self._table_operands(ops, plan)
        out, lse = _sparse.gather_fwd(
            ops.q[:, plan.video], k, v, tiles, kv_valid, tile_size=opts.tile_mask.tile_size,
            scale=opts.scale, q_valid=q_valid, **self._gather_args(opts.tile_mask.tile_size),
        )
        if plan.text.stop == plan.text.start:
            return out, lse
        out_t, lse_t = self._fwd(self._text_rows(ops, plan), opts)
        parts = [(out_t, lse_t), (out, lse)]
        if plan.text.start > plan.video.start:
            parts.reverse()
        return (jnp.concatenate([p[0] for p in parts], axis=1),
                jnp.concatenate([p[1] for p in parts], axis=2))

    def _table_bwd(self, ops, opts, plan: _TablePlan, out, lse, dout, dlse):
        k, v, tiles, kv_valid, q_valid = self._table_operands(ops, plan)
        vid, txt = plan.video, plan.text
        dq, dk, dv = _sparse.gather_bwd(
            ops.q[:, vid], k, v, tiles, kv_valid, out[:, vid], lse[:, :, vid], dout[:, vid],
            None if dlse is None else dlse[:, :, vid], tile_size=opts.tile_mask.tile_size,
            scale=opts.scale, q_valid=q_valid, stat_grads=True, **self._gather_args(opts.tile_mask.tile_size),
        )
        if txt.stop == txt.start:
            return dq, dk.astype(ops.k.dtype), dv.astype(ops.v.dtype), None, None
        n_video = vid.stop - vid.start
        n_text = txt.stop - txt.start
        dq_t, dk_t, dv_t, _, _ = self._bwd(
            self._text_rows(ops, plan), opts, out[:, txt], lse[:, :, txt], dout[:, txt],
            None if dlse is None else dlse[:, :, txt],
        )

        def keys(d, d_t, like):  # the gathered layout (video, text, pad) back to the sequence's
            parts = [d[:, :n_video], d[:, n_video : n_video + n_text]]
            if txt.start < vid.start:
                parts.reverse()
            return (jnp.concatenate(parts, axis=1) + d_t.astype(d.dtype)).astype(like.dtype)

        parts = [dq_t, dq] if txt.start < vid.start else [dq, dq_t]
        return (jnp.concatenate(parts, axis=1), keys(dk, dk_t, ops.k), keys(dv, dv_t, ops.v),
                None, None)

    @staticmethod
    def _may_see(opts: Options, blocks: _Blocks, ranges: _Ranges, i, j, bq: int, bk: int):
        """Whether tile `(i, j)` can hold a visible pair (a conservative test), or
        `None` when the request has no structure that could hide a whole tile."""
        tests = []
        q_lo, q_hi = ranges.q_pos[0][i], ranges.q_pos[1][i]
        k_lo, k_hi = ranges.kv_pos[0][j], ranges.kv_pos[1][j]
        if opts.causal:
            tests.append(k_lo <= q_hi)
        if opts.window is not None:
            left, right = opts.window
            if left is not None:  # differences, not sums: no int32 overflow
                tests.append(k_hi - q_lo >= -left)
            if right is not None:
                tests.append(k_lo - q_hi <= right)
        if ranges.seg_q is not None:
            (sq_lo, sq_hi), (sk_lo, sk_hi) = ranges.seg_q, ranges.seg_kv
            tests.append(jnp.any((sq_hi[i] >= sk_lo[j]) & (sq_lo[i] <= sk_hi[j])))
        if ranges.tile_q is not None:
            tests.append(block_may_see(ranges.tile_q, ranges.tile_kv, i, j))
        if blocks.mask is not None and blocks.mask.shape[2] > 1 and blocks.mask.shape[3] > 1:
            tests.append(jnp.any(_tile(blocks.mask, i, j, bq, bk)))
        if blocks.kv_lengths is not None:  # key block wholly beyond every row's length
            tests.append(j * bk < jnp.max(blocks.kv_lengths))
        if not tests:
            return None
        return jnp.all(jnp.stack(tests))

    @staticmethod
    def _skip_hidden(may_see, compute, carry):
        """`compute(carry)`, or `carry` unchanged when the tile is entirely hidden."""
        if may_see is None:
            return compute(carry)
        return lax.cond(may_see, compute, lambda c: c, carry)

    def fwd(self, ops: Operands, opts: Options) -> tuple[jax.Array, jax.Array]:
        ops, opts = lower_block_causal(ops, opts)
        plan = self._table_plan(ops, opts)
        if plan is not None:
            return self._table_fwd(ops, opts, plan)
        ops, (first, gap) = self._aligned(ops, opts)
        out, lse = self._fwd(ops, opts)
        if gap:
            out, lse = _remove(out, 1, first, gap), _remove(lse, 2, first, gap)
        return out, lse

    def bwd(self, ops, opts, out, lse, dout, dlse):
        ops, opts = lower_block_causal(ops, opts)
        plan = self._table_plan(ops, opts)
        if plan is not None:
            return self._table_bwd(ops, opts, plan, out, lse, dout, dlse)
        ops, (first, gap) = self._aligned(ops, opts)
        if not gap:
            return self._bwd(ops, opts, out, lse, dout, dlse)
        out, dout = _insert(out, 1, first, gap), _insert(dout, 1, first, gap)
        # Filler rows: lse = +inf gives them probability 0, the sink's included.
        lse = _insert(lse, 2, first, gap, value=m.PAD_LSE)
        dlse = None if dlse is None else _insert(dlse, 2, first, gap)
        dq, dk, dv, dbias, dsinks = self._bwd(ops, opts, out, lse, dout, dlse)
        dq, dk, dv = (_remove(x, 1, first, gap) for x in (dq, dk, dv))
        if dbias is not None:
            dbias = _remove(_remove(dbias, 2, first, gap), 3, first, gap)
        return dq, dk, dv, dbias, dsinks

    def _fwd(self, ops: Operands, opts: Options) -> tuple[jax.Array, jax.Array]:
        B, S_q, H, D = ops.q.shape
        K = ops.k.shape[2]
        blocks, rest = self._blocks(ops, opts)
        ranges = self._ranges(ops, opts, blocks)
        nq, nk = blocks.q.shape[0], blocks.k.shape[0]
        bq, bk = blocks.q.shape[3] // (H // K), blocks.k.shape[3]
        sinks = m.rows_sinks(ops.sinks, K, bq)
        axes = m.varying_axes(*jax.tree.leaves(blocks))
        # Everything the tile-skipping `lax.cond` touches varies over the same mesh axes
        # (tile indices included): under `vmap`, JAX turns a batched cond into a select
        # that would otherwise make an invariant operand varying behind the branch's back.
        blocks = m.as_varying(blocks, axes)
        q_idx, kv_idx = m.as_varying((jnp.arange(nq), jnp.arange(nk)), axes)
        # The scans carry only the small per-block metadata; a tile's K / V blocks are
        # read inside the skipping cond, so a hidden tile copies nothing.
        kv_xs = (blocks.kv_pos, blocks.seg_kv, blocks.kv_valid, blocks.tile_kv, kv_idx)

        def q_block(xs):
            qs, q_pos, seg_q, tile_q, i = xs

            def kv_step(stats, ys):
                kv_pos, seg_kv, kv_valid, tile_kv, j = ys

                def compute(stats):
                    kt, v = _block(blocks.kt, j), _block(blocks.v, j)
                    mask = m.rows_4d(_tile(blocks.mask, i, j, bq, bk), K, H, bq)
                    vis = m.visibility(
                        opts, q_pos, kv_pos, seg_q, seg_kv, mask, kv_valid,
                        tile=None if tile_q is None else (tile_q, tile_kv),
                        kv_lengths=blocks.kv_lengths, kv_index=_kv_index(j, bk),
                    )
                    bias = m.rows_4d(_tile(blocks.bias, i, j, bq, bk), K, H, bq)
                    s, _ = m.logits(opts, qs, kt, bias, rest)
                    return m.softmax_step(stats, s, vis, v)

                may_see = self._may_see(opts, blocks, ranges, i, j, bq, bk)
                return self._skip_hidden(may_see, compute, stats), None

            stats = m.init_stats(qs.shape[:-1], D, sinks, m.stat_dtype(ops.q.dtype))
            stats = m.as_varying(stats, axes)
            stats, _ = lax.scan(kv_step, stats, kv_xs)
            return m.finalize(stats, ops.q.dtype)

        out, lse = lax.map(q_block, (blocks.qs, blocks.q_pos, blocks.seg_q, blocks.tile_q, q_idx))
        return m.merge_q(out, H)[:, :S_q], m.merge_rows(lse, H)[..., :S_q]

    def _bwd(self, ops, opts, out, lse, dout, dlse):
        B, S_q, H, D = ops.q.shape
        S_k, K = ops.k.shape[1], ops.k.shape[2]
        blocks, rest = self._blocks(ops, opts)
        ranges = self._ranges(ops, opts, blocks)
        nq, nk = blocks.q.shape[0], blocks.k.shape[0]
        bq, bk = blocks.q.shape[3] // (H // K), blocks.k.shape[3]
        Pq = nq * bq
        delta = m.delta(out, dout, dlse)
        # Row quantities in the blocked rows layout. Padded rows get the huge finite
        # lse `PAD_LSE`, so their probabilities are exactly 0 (not exp(s) * 0, which a
        # large bias turns into inf * 0 = NaN; and no inf under jax_debug_infs), and
        # do = 0, delta = 0.
        do = m.split_q(_pad(dout.astype(ops.q.dtype), 1, Pq), K, bq)
        qt, dot_ = jnp.swapaxes(blocks.q, -1, -2), jnp.swapaxes(do, -1, -2)
        lse_b = m.split_rows(_pad(m.safe_lse(lse), 2, Pq, value=m.PAD_LSE), K, bq)
        delta_b = m.split_rows(_pad(delta, 2, Pq), K, bq)
        axes = m.varying_axes(*jax.tree.leaves((blocks, do, lse_b, delta_b)))
        # One set of varying axes for everything the tile-skipping cond touches (`fwd`).
        blocks, qt, do, dot_, lse_b, delta_b = m.as_varying(
            (blocks, qt, do, dot_, lse_b, delta_b), axes
        )
        q_idx, kv_idx = m.as_varying((jnp.arange(nq), jnp.arange(nk)), axes)
        # The inner scan carries only the small per-block metadata; a tile's q / dO /
        # row statistics are read inside the skipping cond (a hidden tile copies nothing).
        q_xs = (blocks.q_pos, blocks.seg_q, blocks.tile_q, q_idx)
        kv_xs = (blocks.kt, blocks.k, blocks.vt, blocks.kv_pos, blocks.seg_kv, blocks.kv_valid,
                 blocks.tile_kv, kv_idx)
        acc = m.stat_dtype(ops.q.dtype)
        dq0 = jnp.zeros(blocks.q.shape, acc)
        dbias0 = None if blocks.bias is None else jnp.zeros(blocks.bias.shape, acc)
        dq0, dbias0 = m.as_varying((dq0, dbias0), axes)

        def kv_block(carry, ys):
            kt, k, vt, kv_pos, seg_kv, kv_valid, tile_kv, j = ys

            def q_step(inner, xs):
                q_pos, seg_q, tile_q, i = xs

                def compute(inner):
                    dk_acc, dv_acc, dq_acc, dbias_acc = inner
                    qt_i, qs, do_i, dot_i, lse, delta = (
                        _block(x, i) for x in (qt, blocks.qs, do, dot_, lse_b, delta_b)
                    )
                    mask = m.rows_4d(_tile(blocks.mask, i, j, bq, bk), K, H, bq)
                    vis = m.visibility(
                        opts, q_pos, kv_pos, seg_q, seg_kv, mask, kv_valid,
                        tile=None if tile_q is None else (tile_q, tile_kv),
                        kv_lengths=blocks.kv_lengths, kv_index=_kv_index(j, bk),
                    )
                    bias_tile = _tile(blocks.bias, i, j, bq, bk)
                    bias = m.rows_4d(bias_tile, K, H, bq)
                    dq, dkt, dvt, ds = m.tile_grads(
                        opts, qt_i, qs, rest, kt, k, vt, do_i, dot_i, lse, delta, bias, vis
                    )
                    dq_acc = lax.dynamic_update_index_in_dim(dq_acc, dq_acc[i] + dq, i, 0)
                    if ds is not None:
                        dbias = m.reduce_rows_4d(ds, bias_tile.shape, H)
                        dbias_acc = _tile_add(dbias_acc, dbias, i, j, bq, bk)
                    return dk_acc + dkt, dv_acc + dvt, dq_acc, dbias_acc

                may_see = self._may_see(opts, blocks, ranges, i, j, bq, bk)
                return self._skip_hidden(may_see, compute, inner), None

            zeros = m.as_varying(jnp.zeros(kt.shape, acc), axes)  # dK^T, dV^T accumulators
            (dk, dv, *carry), _ = lax.scan(q_step, (zeros, zeros, *carry), q_xs)
            return tuple(carry), (dk, dv)

        (dq, dbias), (dk, dv) = lax.scan(kv_block, (dq0, dbias0), kv_xs)
        dq = m.merge_q(dq, H)[:, :S_q].astype(ops.q.dtype)
        dk = m.merge_kv(jnp.swapaxes(dk, -1, -2))[:, :S_k].astype(ops.k.dtype)
        dv = m.merge_kv(jnp.swapaxes(dv, -1, -2))[:, :S_k].astype(ops.v.dtype)
        if dbias is not None:
            dbias = dbias[:, :, : ops.bias.shape[2], : ops.bias.shape[3]].astype(ops.bias.dtype)
        dsinks = None if ops.sinks is None else m.sinks_grad(ops.sinks, lse, delta)
        return dq, dk, dv, dbias, dsinks
