"""`"blockwise"`: portable flash attention in pure JAX.

The forward maps over query blocks and scans over key/value blocks with an
online softmax; the backward scans over key/value blocks (carrying their dK/dV)
and, inside, over query blocks (accumulating dQ in place), recomputing each
tile's probabilities from the saved `lse`. Nothing of size `S_q * S_k` exists
at any point unless the caller passes a full-size bias or mask.

Sequences of any length are padded up to a multiple of the block size; padded
keys are invisible (through the segment ids when given, else a validity row)
and padded query rows are dropped. A tile that the causal / window / segment /
mask structure hides entirely is skipped by `lax.cond`, not computed and
discarded.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import _math as m
from ._args import Operands, Options
from ._base import AbstractImplementation, Capabilities


class _Blocks(NamedTuple):
    """Per-block views of the operands, leading axis = block index."""

    # query side: (nq, ...)
    q: jax.Array  # (nq, B, K, G, bq, D)
    q_pos: jax.Array  # (nq, bq)
    seg_q: jax.Array | None  # (nq, B, bq)
    # key side: (nk, ...)
    k: jax.Array  # (nk, B, K, bk, D)
    v: jax.Array
    kv_pos: jax.Array  # (nk, bk)
    seg_kv: jax.Array | None  # (nk, B, bk)
    kv_valid: jax.Array | None  # (nk, bk)
    # 2D-blocked operands are sliced per tile: (B|1, K|1, G|1, Sq_pad|1, Sk_pad|1)
    bias: jax.Array | None
    mask: jax.Array | None


def _pad_axis(x: jax.Array, axis: int, size: int, mode="constant", value=0) -> jax.Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    if mode == "edge":
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def _split(x: jax.Array, axis: int, block: int) -> jax.Array:
    """Splits `axis` (a multiple of `block`) into blocks, moving the block index first."""
    shape = x.shape[:axis] + (x.shape[axis] // block, block) + x.shape[axis + 1 :]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _merge(x: jax.Array, axis: int) -> jax.Array:
    """Inverse of `_split`: `(n, ..., b, ...)` with `b` at `axis + 1` -> `(..., n*b, ...)`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2 :])


def _tile(x: jax.Array | None, i, j, bq: int, bk: int) -> jax.Array | None:
    """Tile `(i, j)` of a bias / mask whose last two axes are full or 1."""
    if x is None:
        return None
    *lead, sq, sk = x.shape
    start = (0,) * len(lead) + (i * bq if sq > 1 else 0, j * bk if sk > 1 else 0)
    size = tuple(lead) + (bq if sq > 1 else 1, bk if sk > 1 else 1)
    return lax.dynamic_slice(x, start, size)


def _tile_add(acc: jax.Array, update: jax.Array, i, j, bq: int, bk: int) -> jax.Array:
    *lead, sq, sk = acc.shape
    start = (0,) * len(lead) + (i * bq if sq > 1 else 0, j * bk if sk > 1 else 0)
    return lax.dynamic_update_slice(acc, lax.dynamic_slice(acc, start, update.shape) + update, start)


def _range(x: jax.Array, axis) -> tuple[jax.Array, jax.Array]:
    return jnp.min(x, axis=axis), jnp.max(x, axis=axis)


@dataclasses.dataclass(frozen=True)
class Blockwise(AbstractImplementation):
    """Flash attention in pure JAX: O(S) memory forward and backward, every feature.

    **Arguments:**

    - `block_q`: query rows per tile.
    - `block_kv`: key/value columns per tile.

    Sequences shorter than a block use one block of their own length. The
    defaults were chosen by `benchmarks/attention.py` on a 2-core CPU
    (see `benchmarks/NOTES.md`).
    """

    block_q: int = 256
    block_kv: int = 512

    name = "blockwise"
    capabilities = Capabilities(platforms=("cpu", "gpu", "tpu"), memory="O(S)")

    def __post_init__(self):
        for field in ("block_q", "block_kv"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{field}` must be a positive int; received {value!r}.")

    def _sizes(self, ops: Operands) -> tuple[int, int, int, int]:
        S_q, S_k = ops.q.shape[1], ops.k.shape[1]
        bq, bk = min(self.block_q, S_q), min(self.block_kv, S_k)
        return bq, bk, math.ceil(S_q / bq), math.ceil(S_k / bk)

    def _blocks(self, ops: Operands, opts: Options) -> _Blocks:
        B, S_q, H, D = ops.q.shape
        S_k, K = ops.k.shape[1], ops.k.shape[2]
        bq, bk, nq, nk = self._sizes(ops)
        Pq, Pk = nq * bq, nk * bk
        q = _split(_pad_axis(m.group_q(ops.q, K), 3, Pq), 3, bq)
        k = _split(_pad_axis(m.group_kv(ops.k), 2, Pk), 2, bk)
        v = _split(_pad_axis(m.group_kv(ops.v), 2, Pk), 2, bk)
        if ops.q_pos is None:
            q_pos = jnp.arange(Pq, dtype=jnp.int32).reshape(nq, bq)
            kv_pos = jnp.arange(Pk, dtype=jnp.int32).reshape(nk, bk)
        else:  # edge padding keeps each block's position range tight
            q_pos = _pad_axis(ops.q_pos, 0, Pq, "edge").reshape(nq, bq)
            kv_pos = _pad_axis(ops.kv_pos, 0, Pk, "edge").reshape(nk, bk)
        seg_q = seg_kv = kv_valid = None
        if ops.seg_q is not None:
            seg_q = _split(_pad_axis(ops.seg_q, 1, Pq, value=-1), 1, bq)
            seg_kv = _split(_pad_axis(ops.seg_kv, 1, Pk, value=-1), 1, bk)
        elif Pk != S_k:
            kv_valid = (jnp.arange(Pk) < S_k).reshape(nk, bk)

        def pad2d(x):
            if x is None:
                return None
            x = m.group_4d(x, K)
            if x.shape[3] > 1:
                x = _pad_axis(x, 3, Pq)
            if x.shape[4] > 1:
                x = _pad_axis(x, 4, Pk)
            return x

        return _Blocks(q, q_pos, seg_q, k, v, kv_pos, seg_kv, kv_valid, pad2d(ops.bias), pad2d(ops.mask))

    def _may_see(self, opts: Options, blocks: _Blocks, i, j, q_range, kv_range, seg_ranges):
        """Whether tile `(i, j)` can contain a visible pair (a conservative test), or
        `None` when the request has no structure that could hide a whole tile."""
        tests = []
        q_lo, q_hi = q_range[0][i], q_range[1][i]
        k_lo, k_hi = kv_range[0][j], kv_range[1][j]
        if opts.causal:
            tests.append(k_lo <= q_hi)
        if opts.window is not None:
            left, right = opts.window
            if left is not None:
                tests.append(k_hi >= q_lo - left)
            if right is not None:
                tests.append(k_lo <= q_hi + right)
        if seg_ranges is not None:
            (sq_lo, sq_hi), (sk_lo, sk_hi) = seg_ranges
            tests.append(jnp.any((sq_hi[i] >= sk_lo[j]) & (sq_lo[i] <= sk_hi[j])))
        if blocks.mask is not None and blocks.mask.shape[3] > 1 and blocks.mask.shape[4] > 1:
            bq, bk = blocks.q.shape[4], blocks.k.shape[3]
            tests.append(jnp.any(_tile(blocks.mask, i, j, bq, bk)))
        if not tests:
            return None
        return jnp.all(jnp.stack(tests))

    def _structure(self, blocks: _Blocks):
        """Per-block position and segment ranges for `_may_see`."""
        q_range = _range(blocks.q_pos, 1)
        kv_range = _range(blocks.kv_pos, 1)
        seg_ranges = None
        if blocks.seg_q is not None:
            big = jnp.iinfo(jnp.int32).max

            def seg_range(s):  # ignore padding (negative ids)
                lo = jnp.min(jnp.where(s >= 0, s, big), axis=-1)
                hi = jnp.max(s, axis=-1)
                return lo, hi

            seg_ranges = (seg_range(blocks.seg_q), seg_range(blocks.seg_kv))
        return q_range, kv_range, seg_ranges

    def _tile_inputs(self, opts, blocks: _Blocks, i, j, q_pos, kv_pos, seg_q, seg_kv, kv_valid):
        bq, bk = blocks.q.shape[4], blocks.k.shape[3]
        vis = m.visibility(
            opts, q_pos, kv_pos, seg_q, seg_kv, _tile(blocks.mask, i, j, bq, bk), kv_valid
        )
        return vis, _tile(blocks.bias, i, j, bq, bk)

    def fwd(self, ops: Operands, opts: Options) -> tuple[jax.Array, jax.Array]:
        blocks = self._blocks(ops, opts)
        structure = self._structure(blocks)
        sinks = m.grouped_sinks(ops)
        nq, nk = blocks.q.shape[0], blocks.k.shape[0]
        kv_xs = (blocks.k, blocks.v, blocks.kv_pos, blocks.seg_kv, blocks.kv_valid, jnp.arange(nk))

        def q_block(xs):
            q, q_pos, seg_q, i = xs

            def kv_step(stats, ys):
                k, v, kv_pos, seg_kv, kv_valid, j = ys

                def compute(stats):
                    vis, bias = self._tile_inputs(
                        opts, blocks, i, j, q_pos, kv_pos, seg_q, seg_kv, kv_valid
                    )
                    s, _ = m.logits(opts, q, k, bias)
                    return m.softmax_step(stats, s, vis, v)

                may_see = self._may_see(opts, blocks, i, j, *structure)
                if may_see is None:
                    return compute(stats), None
                return lax.cond(may_see, compute, lambda st: st, stats), None

            stats = m.init_stats(q.shape[:-1], q.shape[-1], sinks)
            stats, _ = lax.scan(kv_step, stats, kv_xs)
            return m.finalize(stats, ops.q.dtype)

        out, lse = lax.map(q_block, (blocks.q, blocks.q_pos, blocks.seg_q, jnp.arange(nq)))
        S_q = ops.q.shape[1]
        out = m.ungroup_q(_merge(out, 3)[:, :, :, :S_q])
        lse = m.ungroup_rows(_merge(lse, 3)[..., :S_q])
        return out, lse

    def bwd(self, ops, opts, out, lse, dout, dlse):
        blocks = self._blocks(ops, opts)
        structure = self._structure(blocks)
        K = ops.k.shape[2]
        bq, bk, nq, nk = self._sizes(ops)
        Pq = nq * bq
        delta = m.delta(out, dout, dlse)
        # Row quantities in the blocked query layout (padded rows: do = 0, delta = 0).
        do = _split(_pad_axis(m.group_q(dout.astype(ops.q.dtype), K), 3, Pq), 3, bq)
        lse_b = _split(_pad_axis(m.group_rows(m.safe_lse(lse), K), 3, Pq), 3, bq)
        delta_b = _split(_pad_axis(m.group_rows(delta, K), 3, Pq), 3, bq)
        q_xs = (blocks.q, do, lse_b, delta_b, blocks.q_pos, blocks.seg_q, jnp.arange(nq))
        kv_xs = (blocks.k, blocks.v, blocks.kv_pos, blocks.seg_kv, blocks.kv_valid, jnp.arange(nk))
        dq0 = jnp.zeros(blocks.q.shape, m.F32)
        dbias0 = None if blocks.bias is None else jnp.zeros(blocks.bias.shape, m.F32)

        def kv_block(carry, ys):
            dq_acc, dbias_acc = carry
            k, v, kv_pos, seg_kv, kv_valid, j = ys

            def q_step(inner, xs):
                q, do, lse, delta, q_pos, seg_q, i = xs

                def compute(inner):
                    dk_acc, dv_acc, dq_acc, dbias_acc = inner
                    vis, bias = self._tile_inputs(
                        opts, blocks, i, j, q_pos, kv_pos, seg_q, seg_kv, kv_valid
                    )
                    dq, dk, dv, dbias = m.tile_grads(opts, q, k, v, do, lse, delta, bias, vis)
                    dq_acc = lax.dynamic_update_index_in_dim(dq_acc, dq_acc[i] + dq, i, 0)
                    if dbias is not None:
                        dbias_acc = _tile_add(dbias_acc, dbias, i, j, bq, bk)
                    return dk_acc + dk, dv_acc + dv, dq_acc, dbias_acc

                may_see = self._may_see(opts, blocks, i, j, *structure)
                if may_see is None:
                    return compute(inner), None
                return lax.cond(may_see, compute, lambda c: c, inner), None

            zeros = jnp.zeros(k.shape, m.F32)
            (dk, dv, dq_acc, dbias_acc), _ = lax.scan(
                q_step, (zeros, zeros, dq_acc, dbias_acc), q_xs
            )
            return (dq_acc, dbias_acc), (dk, dv)

        (dq, dbias), (dk, dv) = lax.scan(kv_block, (dq0, dbias0), kv_xs)
        S_q, S_k = ops.q.shape[1], ops.k.shape[1]
        dq = m.ungroup_q(_merge(dq, 3)[:, :, :, :S_q]).astype(ops.q.dtype)
        dk = m.ungroup_kv(_merge(dk, 2)[:, :, :S_k]).astype(ops.k.dtype)
        dv = m.ungroup_kv(_merge(dv, 2)[:, :, :S_k]).astype(ops.v.dtype)
        if dbias is not None:
            dbias = m.ungroup_4d(dbias[..., : ops.bias.shape[2], : ops.bias.shape[3]])
            dbias = dbias.astype(ops.bias.dtype)
        dsinks = None if ops.sinks is None else m.sinks_grad(ops.sinks, lse, delta)
        return dq, dk, dv, dbias, dsinks
