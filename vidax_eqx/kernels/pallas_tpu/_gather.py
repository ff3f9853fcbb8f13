"""Tile-sparse attention as Pallas TPU (Mosaic) kernels whose work follows the
selected tiles: VSA's fine stage (and sliding tile attention, `_sliding.py`).

The contract is `kernels/_sparse.py`'s (and `_per_tile.py`'s, whose kernels stay the
fallback): each query tile attends the key tiles listed for it (per query head) in
`tiles (B, H, n_q_tiles, n_sel)` (`-1`: an unused slot), `kv_valid (S_k,)` hides
padding keys, logits are `scale * q.k`, statistics are float32, and a row that sees
nothing gives 0 with the finite empty log-sum-exp `_math.masked`.

Work is split by *unit*, one batch element and one key/value head with its
`G = H // H_kv` query heads (GQA without repeating K/V), and each unit's query tiles
into `C` chunks of `n_qc` (padded with empty tiles). Each pass is ONE `pallas_call`
whose grid walks the units and chunks (every axis `"arbitrary"`: the steps run in
order on one core). Tiles are padded to `T` tokens, a multiple of the sublane tiling
(8 rows of 32 bits: 16 for 16-bit dtypes), the padding hidden / dropped.

- **Resident operands.** What a step reads at table-driven places stays in VMEM: given
  in HBM (`memory_space=pl.ANY`) and copied (a DMA, waited for) into VMEM scratch at
  the first step that needs it: the forward and dQ passes hold the unit's K and V
  `(S_k, D)` (copied once per unit), the dK/dV pass the chunk's Q and dO
  `(G * n_qc * T, D)` (once per chunk), so HBM traffic is each operand once, not once
  per selected tile. The tables are copied the same way into SMEM scratch per (unit,
  chunk) (int32; `C` is chosen so that one chunk's tables fit `SMEM_ENTRIES` and its
  resident arrays `VMEM_BUDGET`). `vmem_limit_bytes` is set from the sizes; a problem
  whose K/V do not fit `VMEM_BUDGET` runs the per-tile kernels of
  `_per_tile.py` instead (`plan` returns `None`).
- **Forward and dQ**: grid `(unit, chunk, G, n_qc / R)`, `R` query tiles `(T, D)` per
  step: one (`R = 1`), or, when a tile's whole selection is one chunk (sliding tile
  attention's window forward), up to `ROWS` of them (as many as VMEM holds), each a
  chain of its own. A `lax.fori_loop` whose trip count is read from SMEM (the query
  tile's used slots, rounded up to chunks: unused slots cost nothing) runs over chunks
  of `CH` selected key tiles (`kv_chunk`: at most `KV_KEYS_FWD` keys, or the whole
  selection up to `KV_KEYS_WHOLE`; `KV_KEYS_BWD` in dQ). Each chunk
  gathers its key and value tiles from the resident K/V (`pl.ds(tile * T, T)`), loaded
  and stacked along the sublanes into `(CH * T, D)` values (`GATHER`), or, when the
  table comes in runs of consecutive tiles (`run`: sliding tile attention's windows
  along w) and each chunk lies inside one run, slices `pl.ds(start * T, CH * T)`
  directly; then ONE `(T, CH * T)` logits matmul, the online softmax (float32 `m`, `l`,
  `acc` in scratch) and ONE `p @ v` matmul (dQ: `dp = do v^T`, `ds = p (dp - delta)`,
  `dq += ds k`). Rows with `-1` slots are first ordered used-first (`run == 1`). A
  query tile whose slots are all used (every row of VSA's top-k) runs its chunks
  unrolled instead (`UNROLL`), so that one chunk's softmax overlaps the next one's
  products.
- **dK/dV**: the table inverted on device into CSR form per (unit, chunk): the rows
  `g * n_qc + i` that selected each key tile, sorted by key tile (one sort of packed
  int32 keys), and each key tile's offset (a binary search; no scatter). Grid `(unit,
  chunk, key tile)`: every key tile's gradient is written (zeros when nothing selected
  it; the chunks' partial sums are added). Per key tile a loop with a dynamic trip
  count runs over its rows in chunks of `CH` query tiles gathered from the resident Q
  and dO; keys run along sublanes and queries along lanes (as splash's dK/dV kernel):
  `s^T = k q^T`, `p^T = exp(s^T - lse)`, `dp^T = v do^T`, `ds^T = p^T (dp^T - delta)`,
  `dk += ds^T q`, `dv += p^T do`; no tile is transposed.
- **Rows of a chunk** (key validity; the dK/dV pass's lse and delta) come from
  resident `(n, 1, CH * T)` float32 arrays, each tile's `T` values repeated `CH` times
  along the lanes, so that a chunk's row is `CH` dynamic row loads and lane-range
  selects (no lane shifts). An unused slot reads an extra row: zeros (hidden keys) or
  `_math.PAD_LSE` (probabilities exactly 0).

The code: `_gather_plan.py` (the plan of a problem and the knobs), `_gather_layout.py`
(the arrays in the kernels' layout, the dK/dV pass's table), `_gather_kernels.py` (the
kernels and their calls) and here the contract, `sparse_fwd` and `sparse_bwd`; the knobs
and their measured effect are `_gather_plan.py`'s docstring.
"""

import contextlib

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from ..._vma import opaque_to_vma
from .. import _math as m
from . import _gather_plan as knobs
from . import _per_tile
from ._gather_kernels import dkv_call, dq_call, fwd_call
from ._gather_layout import csr, Layout
from ._gather_plan import LANES, Plan, plan


F32 = jnp.float32


def _scope(interpret: bool):
    return pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()


# -- the contract ----------------------------------------------------------------------


def _forward(q, k, v, tiles, kv_valid, *, tile_size, scale, p: Plan, run: int):
    lay = Layout(q, k, tiles, tile_size, p)
    table = lay.table(tiles, compact=run == 1)  # (U, C, G, n_qc, n_selp)
    counts = jnp.sum(table >= 0, axis=-1, dtype=jnp.int32).reshape(lay.U * lay.C, -1)
    out, lse = fwd_call(table.reshape(lay.U * lay.C, -1), counts, lay.queries(q), lay.keys(k), lay.keys(v),
                         lay.valid_rows(kv_valid), p=p, n_k=lay.n_k, scale=scale)
    return lay.from_queries(out), lay.from_rows(lse[..., 0])


def _backward(q, k, v, tiles, kv_valid, lse, delta, dout, *, tile_size, scale, p: Plan, run: int):
    """`(dq, dk, dv)` from `lse` ready for `exp(s - lse)` (empty rows: 0; rows to drop:
    `PAD_LSE`) and `delta`."""
    lay = Layout(q, k, tiles, tile_size, p)
    U, C, G, D = lay.U, lay.C, lay.G, lay.D
    table = lay.table(tiles, compact=run == 1)  # (U, C, G, n_qc, n_selp)
    counts = jnp.sum(table >= 0, axis=-1, dtype=jnp.int32).reshape(U * C, -1)
    offsets, entries = jax.vmap(lambda t: csr(t, lay.n_k))(table.reshape(U * C, *table.shape[2:]))
    qs, dos, ks, vs = lay.queries(q), lay.queries(dout.astype(q.dtype)), lay.keys(k), lay.keys(v)
    lse_r, delta_r = lay.rows(lse, m.PAD_LSE), lay.rows(delta)  # (U, C, G, L)
    lanes = lambda x: jnp.broadcast_to(x[..., None], (*x.shape, LANES))
    dq = dq_call(table.reshape(U * C, -1), counts, qs, dos, lanes(lse_r), lanes(delta_r), ks, vs,
                  lay.valid_rows(kv_valid), p=p, n_k=lay.n_k, scale=scale)
    flat = lambda x: x.reshape(U, C, G * lay.L, D)
    dk, dv = dkv_call(offsets, entries, ks, vs, lay.valid(kv_valid)[:, :, None], flat(qs), flat(dos),
                       lay.tile_rows(lse_r, m.PAD_LSE), lay.tile_rows(delta_r, 0.0), p=p, scale=scale)
    return (lay.from_queries(dq).astype(q.dtype), lay.from_keys(dk.sum(axis=1)).astype(k.dtype),
            lay.from_keys(dv.sum(axis=1)).astype(v.dtype))


def _opts(q, k, tiles, tile_size, run, kv_tiles, chains, keys, whole=0) -> Plan | None:
    return plan(q.shape, k.shape, q.dtype, tiles.shape[-1], tile_size, run, kv_tiles, chains, keys, whole)


def sparse_fwd(q, k, v, tiles, kv_valid, *, tile_size: int, scale: float, interpret: bool = False,
               q_valid=None, run: int = 1, kv_tiles: int | None = None, chains: int | None = None):
    """The fine stage's forward: `(out (B, S_q, H, D), lse (B, H, S_q) float32)`.

    `q_valid`: optional bool `(S_q,)`; a row where it is False is dropped (out 0, the
    empty lse), as sliding tile attention's padding rows. `run`: the table's used slots
    come in runs of `run` consecutive key tiles, used slots first (a promise: chunks
    inside a run are sliced, not gathered; with `run == 1` the kernels order each row's
    slots themselves). `kv_tiles`, `chains`: see `plan`. A problem that does not fit
    (`plan`) runs `_per_tile.sparse_fwd`.
    """
    p = _opts(q, k, tiles, tile_size, run, kv_tiles, chains, knobs.KV_KEYS_FWD, knobs.KV_KEYS_WHOLE)
    if p is None:
        out, lse = _per_tile.sparse_fwd(q, k, v, tiles, kv_valid, tile_size=tile_size, scale=scale,
                                        interpret=interpret)
    else:

        def compute(q, k, v, tiles, kv_valid):
            with _scope(interpret):
                return _forward(q, k, v, tiles, kv_valid, tile_size=tile_size, scale=scale, p=p, run=run)

        out, lse = opaque_to_vma(compute, q, k, v, tiles, kv_valid)
    if q_valid is None:
        return out, lse
    out = jnp.where(q_valid[None, :, None, None], out, jnp.zeros((), out.dtype))
    return out, jnp.where(q_valid[None, None, :], lse, m.masked(F32))


def sparse_bwd(q, k, v, tiles, kv_valid, out, lse, dout, dlse, *, tile_size: int, scale: float,
               interpret: bool = False, q_valid=None, run: int = 1, kv_tiles: int | None = None,
               chains: int | None = None):
    """The fine stage's backward: `(dq, dk, dv)` in the dtypes of q, k, v; `lse` may be
    that of a larger computation (a ring), `dlse` may be `None`. `q_valid`, `run`,
    `kv_tiles`, `chains`: as in `sparse_fwd` (a dropped row gets no gradient and gives
    none)."""
    if q_valid is not None:  # dropped rows: no cotangent, so nothing flows through them
        dout = jnp.where(q_valid[None, :, None, None], dout, jnp.zeros((), dout.dtype))
        dlse = None if dlse is None else jnp.where(q_valid[None, None, :], dlse, 0.0)
    p = _opts(q, k, tiles, tile_size, run, kv_tiles, chains, knobs.KV_KEYS_BWD)
    if p is None:
        return _per_tile.sparse_bwd(q, k, v, tiles, kv_valid, out, lse, dout, dlse,
                                    tile_size=tile_size, scale=scale, interpret=interpret)
    delta = m.delta(out, dout, dlse)
    lse = m.safe_lse(lse)
    if q_valid is not None:  # and probabilities exactly 0
        lse = jnp.where(q_valid[None, None, :], lse, m.PAD_LSE)

    def compute(q, k, v, tiles, kv_valid, lse, delta, dout):
        with _scope(interpret):
            return _backward(q, k, v, tiles, kv_valid, lse, delta, dout, tile_size=tile_size, scale=scale,
                             p=p, run=run)

    return opaque_to_vma(compute, q, k, v, tiles, kv_valid, lse, delta, dout)
