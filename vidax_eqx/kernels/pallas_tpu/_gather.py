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

Tuning knobs (`plan`): `kv_tiles` (tiles per chunk; default: the selection in the
fewest chunks of at most `KV_KEYS_FWD` / `KV_KEYS_BWD` keys) and `chains`: a loop with a
dynamic trip count is not unrolled, so each iteration runs `chains` consecutive chunks
as independent computations the scheduler can interleave (the forward keeps an online
softmax per chain and merges them at the end; a remainder of fewer than `chains`
chunks runs one per iteration); `GATHER` and `UNROLL` (module attributes). Measured on
a TPU v5e (`benchmarks/tpu/tpu_sparse.py`, docs/benchmarks.md): stacking the loads instead
of copying through VMEM took 5% off the fine stage's forward at VSA's Wan 480p problem,
unrolling 15% more; 4 chains gained nothing over 2 once unrolled. Wider chunks gained
most: 2,048 keys instead of 512 halved the forward at sparsity 0.9 (each chunk's work
grows, its fixed latency does not); sliding tile attention's 27-tile window as one
chunk, gathered, instead of 9 chunks sliced from its runs of 3 tiles, likewise. Where a
tile's selection is one chunk (up to `KV_KEYS_WHOLE` keys), `ROWS` query tiles a step,
side by side: the forward of 72-token tiles at Wan 480p from 0.199 to 0.168 of dense
(2 tiles: 0.179, 8: 0.164), of 128-token tiles on (24, 32, 64) from 0.130 (two chunks,
one tile a step) to 0.099; a one-chunk dQ pass was slower (0.204 against 0.197
forward+backward at 480p), so the backward keeps its widths.
"""

import contextlib
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..._vma import opaque_to_vma
from .. import _math as m
from . import _per_tile


F32 = jnp.float32
_LANES = 128  # row statistics of the forward / dQ passes are lane-replicated
_MiB = 1 << 20
# int32 entries of the tables one (unit, chunk) holds in SMEM (half of TPU v4+'s 1 MiB).
SMEM_ENTRIES = 1 << 17
# Bytes of VMEM the resident arrays of one call may take (the chip has 128 MiB); above
# it the per-tile kernels of `_per_tile.py` run instead.
VMEM_BUDGET = 80 * _MiB
_VMEM_CAP = 100 * _MiB  # the scoped VMEM limit asked for, at most
# Keys per chunk of the inner loops (the width of their matrix products), at most: the
# forward's, and the dQ and dK/dV passes' (query tiles per chunk there). Measured on a TPU
# v5e at VSA's Wan 480p problem (docs/benchmarks.md): 512 -> 2,048 keys took the forward
# from 0.40 to 0.20 of dense attention at sparsity 0.9, the backward is fastest at 1,024.
KV_KEYS_FWD = 2304
KV_KEYS_BWD = 1024
# A forward selection of at most this many keys runs as one chunk (sliding tile
# attention's 3 x 3 x 3 window of 128-token tiles: 0.130 -> 0.099 of dense, measured).
KV_KEYS_WHOLE = 3456
CHAINS = 2  # chunks per iteration of the inner loops
# Query tiles per step of the forward and dQ passes when a tile's selection is one chunk
# (no chains within a tile): that many independent chains, one per tile.
ROWS = 4
GATHER = "load"  # a gathered chunk: "load" (tiles stacked in vregs) or "copy" (through VMEM)
UNROLL = True  # forward / dQ: a row that uses every slot runs its chunks unrolled
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def kv_chunk(T: int, n_sel: int, keys: int) -> int:
    """Selected key tiles per chunk of the inner loop: the `n_sel` selected tiles in the
    fewest chunks of at most `keys` keys (one tile at least), split evenly; with more than
    one chunk, rounded up to a multiple of `128 / gcd(T, 128)` tiles (whole 128-lane
    vregs) where that stays within `keys`."""
    most = max(1, keys // T)
    chunks = max(1, _ceil(n_sel, most))
    CH = _ceil(n_sel, chunks)
    base = _LANES // math.gcd(T, _LANES)
    if chunks > 1 and _ceil(CH, base) * base <= most:
        CH = _ceil(CH, base) * base
    return CH


class Plan(NamedTuple):
    """The static layout of one problem (see `plan`)."""

    T: int  # tokens per padded tile
    CH: int  # key tiles (forward, dQ) or query tiles (dK/dV) per chunk
    n_selp: int  # table slots per query tile, padded to whole chunks
    C: int  # chunks of a unit's query tiles (each with its tables and resident Q/dO)
    n_qc: int  # query tiles per chunk
    direct: bool  # every chunk lies inside a run: K/V sliced, not gathered
    chains: int  # chunks per loop iteration, independent until the end
    R: int  # query tiles per step of the forward / dQ passes (`n_qc` a multiple of it)
    vmem_fwd: int  # the scoped VMEM limits of the calls
    vmem_dkv: int

    @property
    def W(self) -> int:
        return self.CH * self.T


def _limit(nbytes: int) -> int:
    return int(min(_VMEM_CAP, max(32 * _MiB, nbytes * 5 // 4 + 8 * _MiB)))


def plan(q_shape, k_shape, dtype, n_sel: int, tile_size: int, run: int = 1,
         kv_tiles: int | None = None, chains: int | None = None, keys: int | None = None,
         whole: int = 0) -> Plan | None:
    """The layout of a problem, or `None` when its resident arrays do not fit
    `VMEM_BUDGET` or one query tile's tables do not fit `SMEM_ENTRIES`.

    `run`: the table's used slots come in runs of that many consecutive key tiles (a
    chunk that divides a run is sliced, not gathered); `kv_tiles`: tiles per chunk;
    else `kv_chunk` of at most `keys` keys (default `KV_KEYS_FWD`), halved until the
    resident arrays fit, or the whole selection in one chunk where it has at most
    `whole` keys and that fits; `chains`: chunks per iteration of the inner loops,
    independent computations the compiler can interleave (default `CHAINS`, at most the
    chunks of the selection).
    """
    T = _padded_tile(tile_size, dtype)
    if kv_tiles is not None:
        return _plan(q_shape, k_shape, dtype, n_sel, tile_size, run, max(1, int(kv_tiles)), chains)
    if n_sel * T <= whole:
        found = _plan(q_shape, k_shape, dtype, n_sel, tile_size, run, n_sel, chains)
        if found is not None:
            return found
    keys = KV_KEYS_FWD if keys is None else int(keys)
    while True:
        found = _plan(q_shape, k_shape, dtype, n_sel, tile_size, run, kv_chunk(T, n_sel, keys), chains)
        if found is not None or keys <= T:
            return found
        keys //= 2


def _padded_tile(tile_size: int, dtype) -> int:
    """A tile's rows padded to its sublane tiling: 8 rows of 32 bits (16 for 16-bit dtypes)."""
    sub = 8 * max(1, 4 // jnp.dtype(dtype).itemsize)
    return _ceil(tile_size, sub) * sub


def _plan(q_shape, k_shape, dtype, n_sel: int, tile_size: int, run: int, CH: int,
          chains: int | None) -> Plan | None:
    _, S_q, H, D = q_shape
    S_k, K = k_shape[1], k_shape[2]
    G = H // K
    size = jnp.dtype(dtype).itemsize
    T = _padded_tile(tile_size, dtype)
    W = CH * T
    chains = max(1, min(int(CHAINS if chains is None else chains), _ceil(n_sel, CH)))
    n_selp = _ceil(n_sel, CH) * CH
    n_q, n_k = S_q // tile_size, S_k // tile_size
    Dp = _ceil(D, _LANES) * _LANES
    rows = lambda n: n * 8 * W * 4  # (n, 1, W) float32 rows: 8 sublanes each in VMEM
    # Forward / dQ: resident K, V and key validity; per query tile of a step, its gathered
    # chunks and small blocks.
    resident = 2 * n_k * T * Dp * size + rows(n_k + 1)
    per_tile = chains * (2 * W * Dp * size + 16 * T * Dp * 4)
    # One chunk a tile (no chains within it): up to `ROWS` tiles a step, a chain each.
    R = max(1, min(ROWS, (VMEM_BUDGET - resident) // per_tile)) if n_selp == CH else 1
    fwd = resident + R * per_tile
    if fwd > VMEM_BUDGET:
        return None
    # dK/dV: resident Q, dO, lse and delta rows, per query tile of a chunk.
    per_q = G * (2 * T * Dp * size + 2 * 8 * W * 4)
    fixed = rows(2) + chains * 2 * W * Dp * size + 16 * T * Dp * 4
    room_vmem = (VMEM_BUDGET - fixed) // per_q
    # SMEM per query tile: the forward's table row and count; the CSR entries of dK/dV.
    room_smem = min((SMEM_ENTRIES - n_k - 1) // (G * n_selp), SMEM_ENTRIES // (G * (n_selp + 1)))
    room = min(room_vmem, room_smem)
    if room < 1:
        return None
    if room < R:
        R, fwd = 1, resident + per_tile
    room = room // R * R
    n_qr = _ceil(n_q, R) * R  # chunks of whole steps
    C = _ceil(n_qr, min(n_qr, room))
    n_qc = _ceil(_ceil(n_qr, C), R) * R
    dkv = fixed + per_q * n_qc
    direct = run > 1 and run % CH == 0
    return Plan(T, CH, n_selp, C, n_qc, direct, chains, R, _limit(fwd), _limit(dkv))


def fits(q, k, tiles, tile_size: int, run: int = 1) -> bool:
    """Whether the gathering kernels take this problem's forward (else:
    `_per_tile`)."""
    return plan(q.shape, k.shape, q.dtype, tiles.shape[-1], tile_size, run) is not None


# -- kernels ----------------------------------------------------------------------------


def _chunk_row(rows_ref, index, W: int, T: int):
    """`(1, W)` float32: lanes `[j T, (j + 1) T)` from row `index[j]` of `rows_ref
    (n, 1, W)` (each row holds its tile's `T` values repeated along the lanes)."""
    lane = lax.broadcasted_iota(jnp.int32, (1, W), 1)
    row = rows_ref[index[0]]
    for j in range(1, len(index)):
        row = jnp.where(lane >= j * T, rows_ref[index[j]], row)
    return row


def _gather(src_ref, dst_ref, tiles, T: int, direct: bool):
    """The chunk of `len(tiles)` tiles of `T` rows of `src_ref`: sliced from the
    resident array when `direct` (consecutive tiles); else each tile loaded and the
    loads stacked along the sublanes (whole vregs: `T` is a multiple of the sublane
    tiling), or, with `GATHER = "copy"`, copied into `dst_ref` and read back."""
    if direct:
        start = pl.multiple_of(tiles[0] * T, T)
        return src_ref[pl.ds(start, len(tiles) * T), :]
    if GATHER == "load":
        return jnp.concatenate([src_ref[pl.ds(pl.multiple_of(t * T, T), T), :] for t in tiles], axis=0)
    for j, t in enumerate(tiles):
        dst_ref[pl.ds(j * T, T), :] = src_ref[pl.ds(pl.multiple_of(t * T, T), T), :]
    return dst_ref[...]


def _kv_chunk(table_ref, base, k_res, v_res, valid_res, kc_ref, vc_ref, *, CH, T, n_k, direct):
    """Chunk `base` of a query tile's slots: `(k, v, valid (1, CH*T) bool)`."""
    ids = [table_ref[base + j] for j in range(CH)]
    safe = [jnp.maximum(t, 0) for t in ids]
    valid = _chunk_row(valid_res, [jnp.where(t < 0, n_k, t) for t in ids], CH * T, T) > 0.5
    return (_gather(k_res, kc_ref, safe, T, direct), _gather(v_res, vc_ref, safe, T, direct), valid)


def _copy_when(cond, pairs, sem):
    """Copies each `(src, dst)` pair (HBM -> VMEM or SMEM) when `cond` holds: DMAs on
    `sem`, all started, then all waited for (what `pltpu.sync_copy` does, without its
    scoped semaphore, whose lowering needs the TPU generation)."""

    @pl.when(cond)
    def _():
        copies = [pltpu.make_async_copy(src, dst, sem) for src, dst in pairs]
        for copy in copies:
            copy.start()
        for copy in copies:
            copy.wait()


def _load_fwd(C: int, table_hbm, count_hbm, k_hbm, v_hbm, valid_hbm, table_ref, count_ref, k_res, v_res,
              valid_res, sem):
    """The forward / dQ grid `(unit, chunk, head, query tile)`: key validity at the first
    step, the unit's K and V at its first step, the chunk's tables at its first step."""
    u, c, g, i = (pl.program_id(d) for d in range(4))
    chunk_first = (g == 0) & (i == 0)
    _copy_when(chunk_first & (c == 0) & (u == 0), [(valid_hbm, valid_res)], sem)
    _copy_when(chunk_first & (c == 0), [(k_hbm.at[u], k_res), (v_hbm.at[u], v_res)], sem)
    _copy_when(chunk_first, [(table_hbm.at[u * C + c], table_ref), (count_hbm.at[u * C + c], count_ref)], sem)
    return g, i


def _run_chunks(n, chains: int, chunk, commit, full: int | None = None):
    """Chunks `0 .. n - 1` (`n` dynamic): `chains` consecutive ones per iteration (chunk
    `it * chains + h` on chain `h`), the remainder one per iteration on chain 0.
    `chunk(j, h)` computes chunk `j` and returns its parts; `commit(parts)` adds up those
    of one iteration.

    With `full` (and `UNROLL`), a row of exactly `full` chunks (VSA's: every row selects
    the same number of tiles) runs them unrolled, in the same order on the same chains,
    so that the compiler can overlap one chunk's softmax with the next one's matmuls;
    other rows take the loop."""
    if full is not None and UNROLL:

        @pl.when(n == full)
        def _():
            for it in range(full // chains):
                commit([chunk(it * chains + h, h) for h in range(chains)])
            for j in range(full // chains * chains, full):
                commit([chunk(j, 0)])

        @pl.when(n != full)
        def _():
            _run_chunks(n, chains, chunk, commit)

        return

    def group(it, carry):
        commit([chunk(it * chains + h, h) for h in range(chains)])
        return carry

    full = lax.div(n, chains)
    lax.fori_loop(0, full, group, 0)
    if chains > 1:

        def single(j, carry):
            commit([chunk(j, 0)])
            return carry

        lax.fori_loop(full * chains, n, single, 0)


def _run_rows(ns, chains: int, chunk, commit, full: int):
    """`_run_chunks` for each of a step's query tiles, tile `r` with `ns[r]` chunks:
    `chunk(r, j, h)`, `commit(r, parts)`. When every tile has exactly `full` chunks (and
    `UNROLL`), all of them unrolled in one region, the tiles' chains side by side, so that
    the compiler can overlap one tile's softmax with another's matmuls."""
    if len(ns) > 1 and UNROLL:
        every = functools.reduce(jnp.logical_and, [n == full for n in ns])

        @pl.when(every)
        def _():
            for it in range(full // chains):
                for r in range(len(ns)):
                    commit(r, [chunk(r, it * chains + h, h) for h in range(chains)])
            for j in range(full // chains * chains, full):
                for r in range(len(ns)):
                    commit(r, [chunk(r, j, 0)])

        @pl.when(jnp.logical_not(every))
        def _():
            _run_rows_apart(ns, chains, chunk, commit, full)

        return
    _run_rows_apart(ns, chains, chunk, commit, full)


def _run_rows_apart(ns, chains, chunk, commit, full):
    for r, n in enumerate(ns):
        _run_chunks(n, chains, functools.partial(chunk, r), functools.partial(commit, r), full)


def _fwd_kernel(table_hbm, count_hbm, q_ref, k_hbm, v_hbm, valid_hbm, o_ref, lse_ref,
                table_ref, count_ref, k_res, v_res, valid_res, kc_ref, vc_ref, m_sc, l_sc, o_sc, sem, *,
                C: int, n_qc: int, n_selp: int, CH: int, T: int, n_k: int, scale: float, direct: bool,
                chains: int, R: int):
    """`R` query tiles a step; an online softmax per (tile, chain), merged at the end."""
    g, i = _load_fwd(C, table_hbm, count_hbm, k_hbm, v_hbm, valid_hbm, table_ref, count_ref, k_res, v_res,
                     valid_res, sem)
    low = m.masked(F32)
    m_sc[...] = jnp.full(m_sc.shape, low, F32)
    l_sc[...] = jnp.zeros(l_sc.shape, F32)
    o_sc[...] = jnp.zeros(o_sc.shape, F32)
    rows = [g * n_qc + i * R + r for r in range(R)]
    qs = [q_ref[r * T:(r + 1) * T, :] for r in range(R)]

    def chunk(r, j, h):
        k, v, valid = _kv_chunk(table_ref, rows[r] * n_selp + j * CH, k_res, v_res, valid_res, kc_ref.at[h],
                                vc_ref.at[h], CH=CH, T=T, n_k=n_k, direct=direct)
        s = lax.dot_general(qs[r], k, _NT, preferred_element_type=F32) * scale
        s = jnp.where(valid, s, low)
        c = r * chains + h
        m_prev = m_sc[c][:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == low, 0.0, m_new)  # nothing seen yet: every exp is 0
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_prev - m_safe)
        l_new = alpha * l_sc[c][:, :1] + jnp.sum(p, axis=1, keepdims=True)
        pv = lax.dot_general(p.astype(v.dtype), v, _NN, preferred_element_type=F32)
        o_sc[c] = alpha * o_sc[c] + pv
        m_sc[c] = jnp.broadcast_to(m_new, m_sc.shape[1:])
        l_sc[c] = jnp.broadcast_to(l_new, l_sc.shape[1:])

    _run_rows([lax.div(count_ref[row] + CH - 1, CH) for row in rows], chains, chunk, lambda r, parts: None,
              n_selp // CH)
    for r in range(R):
        ms = [m_sc[r * chains + h][:, :1] for h in range(chains)]
        mx = functools.reduce(jnp.maximum, ms)
        m_safe = jnp.where(mx == low, 0.0, mx)
        scales = [jnp.exp(x - m_safe) for x in ms]
        l = sum(a * l_sc[r * chains + h][:, :1] for h, a in enumerate(scales))
        acc = sum(a * o_sc[r * chains + h] for h, a in enumerate(scales))
        empty = l == 0.0
        l_safe = jnp.where(empty, 1.0, l)
        o_ref[r * T:(r + 1) * T, :] = (acc / l_safe).astype(o_ref.dtype)
        lse = jnp.where(empty, low, mx + jnp.log(l_safe))
        lse_ref[r * T:(r + 1) * T, :] = jnp.broadcast_to(lse, (T, lse_ref.shape[1]))


def _add_to(*refs):
    """`commit` for `_run_chunks`: adds each chain's parts into `refs`."""

    def commit(parts):
        for n, ref in enumerate(refs):
            ref[...] += functools.reduce(jnp.add, [x[n] for x in parts])

    return commit


def _dq_kernel(table_hbm, count_hbm, q_ref, do_ref, lse_ref, delta_ref, k_hbm, v_hbm, valid_hbm, dq_ref,
               table_ref, count_ref, k_res, v_res, valid_res, kc_ref, vc_ref, dq_sc, sem, *,
               C: int, n_qc: int, n_selp: int, CH: int, T: int, n_k: int, scale: float, direct: bool,
               chains: int, R: int):
    """`R` query tiles a step, as the forward."""
    g, i = _load_fwd(C, table_hbm, count_hbm, k_hbm, v_hbm, valid_hbm, table_ref, count_ref, k_res, v_res,
                     valid_res, sem)
    dq_sc[...] = jnp.zeros(dq_sc.shape, F32)
    rows = [g * n_qc + i * R + r for r in range(R)]
    tile = lambda ref, r: ref[r * T:(r + 1) * T, :]

    def chunk(r, j, h):
        k, v, valid = _kv_chunk(table_ref, rows[r] * n_selp + j * CH, k_res, v_res, valid_res, kc_ref.at[h],
                                vc_ref.at[h], CH=CH, T=T, n_k=n_k, direct=direct)
        lse, delta = tile(lse_ref, r)[:, :1], tile(delta_ref, r)[:, :1]
        s = lax.dot_general(tile(q_ref, r), k, _NT, preferred_element_type=F32) * scale
        p = jnp.exp(jnp.where(valid, s - lse, m.masked(F32)))
        dp = lax.dot_general(tile(do_ref, r), v, _NT, preferred_element_type=F32)
        ds = p * (dp - delta)
        return (lax.dot_general(ds.astype(k.dtype), k, _NN, preferred_element_type=F32),)

    commit = lambda r, parts: _add_to(dq_sc.at[r])(parts)
    _run_rows([lax.div(count_ref[row] + CH - 1, CH) for row in rows], chains, chunk, commit, n_selp // CH)
    for r in range(R):
        dq_ref[r * T:(r + 1) * T, :] = dq_sc[r] * scale


def _dkv_kernel(offsets_hbm, entries_hbm, k_ref, v_ref, valid_ref, q_hbm, do_hbm, lse_hbm, delta_hbm,
                dk_ref, dv_ref, offsets_ref, entries_ref, q_res, do_res, lse_res, delta_res, qc_ref, doc_ref,
                dk_sc, dv_sc, sem, *, C: int, CH: int, T: int, n_rows: int, entries: int, scale: float,
                chains: int):
    """Grid `(unit, chunk, key tile)`. Keys along sublanes, queries along lanes (as
    splash's dK/dV kernel): `p^T (T_k, CH*T_q)` from `k q^T` and the queries'
    statistics as a lane row, and both products plain matmuls (no transpose)."""
    u, c, kt = (pl.program_id(d) for d in range(3))
    _copy_when(kt == 0, [
        (offsets_hbm.at[u * C + c], offsets_ref), (entries_hbm.at[u * C + c], entries_ref),
        (q_hbm.at[u, c], q_res), (do_hbm.at[u, c], do_res), (lse_hbm.at[u, c], lse_res),
        (delta_hbm.at[u, c], delta_res),
    ], sem)
    dk_sc[...] = jnp.zeros(dk_sc.shape, F32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, F32)
    start, end = offsets_ref[kt], offsets_ref[kt + 1]
    k, v = k_ref[...], v_ref[...]
    valid = valid_ref[...] > 0.5  # (T, 1)

    def chunk(j, h):
        at = [start + j * CH + e for e in range(CH)]
        rows = [jnp.where(e < end, entries_ref[jnp.minimum(e, entries - 1)], n_rows) for e in at]
        safe = [jnp.minimum(r, n_rows - 1) for r in rows]
        qc = _gather(q_res, qc_ref.at[h], safe, T, False)
        doc = _gather(do_res, doc_ref.at[h], safe, T, False)
        lse = _chunk_row(lse_res, rows, CH * T, T)  # (1, W); PAD_LSE past the entries
        delta = _chunk_row(delta_res, rows, CH * T, T)
        s_t = lax.dot_general(k, qc, _NT, preferred_element_type=F32) * scale  # (T_k, W)
        p_t = jnp.exp(jnp.where(valid, s_t - lse, m.masked(F32)))
        dp_t = lax.dot_general(v, doc, _NT, preferred_element_type=F32)
        ds_t = p_t * (dp_t - delta)
        return (lax.dot_general(ds_t.astype(qc.dtype), qc, _NN, preferred_element_type=F32),
                lax.dot_general(p_t.astype(doc.dtype), doc, _NN, preferred_element_type=F32))

    _run_chunks(lax.div(end - start + CH - 1, CH), chains, chunk, _add_to(dk_sc, dv_sc))
    dk_ref[...] = dk_sc[...] * scale
    dv_ref[...] = dv_sc[...]


# -- the calls ---------------------------------------------------------------------------


def _any():
    return pl.BlockSpec(memory_space=pl.ANY)


def _params(vmem: int, axes: int):
    return pltpu.CompilerParams(dimension_semantics=("arbitrary",) * axes, vmem_limit_bytes=vmem)


def _fwd_scratch(table, counts, k, v, valid, p: Plan):
    W, D = p.W, k.shape[-1]
    return [
        pltpu.SMEM(table.shape[1:], jnp.int32),
        pltpu.SMEM(counts.shape[1:], jnp.int32),
        pltpu.VMEM(k.shape[1:], k.dtype),
        pltpu.VMEM(v.shape[1:], v.dtype),
        pltpu.VMEM(valid.shape, F32),
        pltpu.VMEM((p.chains, W, D), k.dtype),
        pltpu.VMEM((p.chains, W, D), v.dtype),
    ]


def _fwd_call(table, counts, q, k, v, valid, *, p: Plan, n_k: int, scale: float):
    """`table (U*C, G*n_qc*n_selp)`, `counts (U*C, G*n_qc)`, `q (U, C, G, L, D)`, `k, v
    (U, S_k, D)`, `valid (n_k + 1, 1, W)` -> `out (U, C, G, L, D)`, `lse (U, C, G, L, 128)`."""
    U, C, G, L, D = q.shape
    T, R = p.T, p.R
    block = lambda u, c, g, i: (u, c, g, i, 0)
    kernel = functools.partial(_fwd_kernel, C=C, n_qc=p.n_qc, n_selp=p.n_selp, CH=p.CH, T=T, n_k=n_k,
                               scale=scale, direct=p.direct, chains=p.chains, R=R)
    return pl.pallas_call(
        kernel,
        grid=(U, C, G, p.n_qc // R),
        in_specs=[_any(), _any(), pl.BlockSpec((None, None, None, R * T, D), block), _any(), _any(), _any()],
        out_specs=[pl.BlockSpec((None, None, None, R * T, D), block),
                   pl.BlockSpec((None, None, None, R * T, _LANES), block)],
        scratch_shapes=[
            *_fwd_scratch(table, counts, k, v, valid, p),
            pltpu.VMEM((R * p.chains, T, _LANES), F32),
            pltpu.VMEM((R * p.chains, T, _LANES), F32),
            pltpu.VMEM((R * p.chains, T, D), F32),
            pltpu.SemaphoreType.DMA(()),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((U, C, G, L, _LANES), F32)],
        compiler_params=_params(p.vmem_fwd, 4),
        name="vidax_tile_gather_fwd",
    )(table, counts, q, k, v, valid)


def _dq_call(table, counts, q, do, lse, delta, k, v, valid, *, p: Plan, n_k: int, scale: float):
    """dQ, float32 `(U, C, G, L, D)`; `lse`, `delta` `(U, C, G, L, 128)`."""
    U, C, G, L, D = q.shape
    T, R = p.T, p.R
    block = lambda u, c, g, i: (u, c, g, i, 0)
    rows = pl.BlockSpec((None, None, None, R * T, D), block)
    stats = pl.BlockSpec((None, None, None, R * T, _LANES), block)
    kernel = functools.partial(_dq_kernel, C=C, n_qc=p.n_qc, n_selp=p.n_selp, CH=p.CH, T=T, n_k=n_k,
                               scale=scale, direct=p.direct, chains=p.chains, R=R)
    return pl.pallas_call(
        kernel,
        grid=(U, C, G, p.n_qc // R),
        in_specs=[_any(), _any(), rows, rows, stats, stats, _any(), _any(), _any()],
        out_specs=rows,
        scratch_shapes=[*_fwd_scratch(table, counts, k, v, valid, p), pltpu.VMEM((R, T, D), F32),
                        pltpu.SemaphoreType.DMA(())],
        out_shape=jax.ShapeDtypeStruct(q.shape, F32),
        compiler_params=_params(p.vmem_fwd, 4),
        name="vidax_tile_gather_dq",
    )(table, counts, q, do, lse, delta, k, v, valid)


def _dkv_call(offsets, entries, k, v, valid, q, do, lse, delta, *, p: Plan, scale: float):
    """dK, dV per chunk, float32 `(U, C, S_k, D)`, from the CSR tables `offsets (U*C,
    n_k + 1)`, `entries (U*C, E)` (rows `g * n_qc + i`); `q`, `do` `(U, C, G * L, D)`;
    `valid (n_k, T, 1)`; `lse`, `delta` `(U, C, G * n_qc + 1, 1, W)` rows (the last: the
    padding)."""
    U, S_k, D = k.shape
    C = q.shape[1]
    T, W = p.T, p.W
    n_k = S_k // T
    key = pl.BlockSpec((None, T, D), lambda u, c, t: (u, t, 0))
    out = pl.BlockSpec((None, None, T, D), lambda u, c, t: (u, c, t, 0))
    kernel = functools.partial(_dkv_kernel, C=C, CH=p.CH, T=T, n_rows=lse.shape[2] - 1,
                               entries=entries.shape[1], scale=scale, chains=p.chains)
    return pl.pallas_call(
        kernel,
        grid=(U, C, n_k),
        in_specs=[_any(), _any(), key, key, pl.BlockSpec((None, T, 1), lambda u, c, t: (t, 0, 0)),
                  _any(), _any(), _any(), _any()],
        out_specs=[out, out],
        scratch_shapes=[
            pltpu.SMEM(offsets.shape[1:], jnp.int32),
            pltpu.SMEM(entries.shape[1:], jnp.int32),
            pltpu.VMEM(q.shape[2:], q.dtype),
            pltpu.VMEM(do.shape[2:], do.dtype),
            pltpu.VMEM(lse.shape[2:], F32),
            pltpu.VMEM(delta.shape[2:], F32),
            pltpu.VMEM((p.chains, W, D), q.dtype),
            pltpu.VMEM((p.chains, W, D), do.dtype),
            pltpu.VMEM((T, D), F32),
            pltpu.VMEM((T, D), F32),
            pltpu.SemaphoreType.DMA(()),
        ],
        out_shape=[jax.ShapeDtypeStruct((U, C, S_k, D), F32)] * 2,
        compiler_params=_params(p.vmem_dkv, 3),
        name="vidax_tile_gather_dkv",
    )(offsets, entries, k, v, valid, q, do, lse, delta)


# -- layout --------------------------------------------------------------------------------


def _pad_tiles(x: jax.Array, tile_size: int, padded: int, axis: int = 1, value=0) -> jax.Array:
    """Pads every tile of `tile_size` entries along `axis` to `padded` entries."""
    if padded == tile_size:
        return x
    shape = x.shape
    x = x.reshape(*shape[:axis], shape[axis] // tile_size, tile_size, *shape[axis + 1:])
    widths = [(0, 0)] * x.ndim
    widths[axis + 1] = (0, padded - tile_size)
    x = jnp.pad(x, widths, constant_values=value)
    return x.reshape(*shape[:axis], -1, *shape[axis + 1:])


def _unpad_tiles(x: jax.Array, tile_size: int, padded: int, axis: int = 1) -> jax.Array:
    """Inverse of `_pad_tiles`."""
    if padded == tile_size:
        return x
    shape = x.shape
    x = x.reshape(*shape[:axis], shape[axis] // padded, padded, *shape[axis + 1:])
    x = lax.slice_in_dim(x, 0, tile_size, axis=axis + 1)
    return x.reshape(*shape[:axis], -1, *shape[axis + 1:])


class _Layout:
    """One problem in the kernels' layout: units of one batch element and key/value
    head, their query tiles in `C` chunks of `n_qc` (padded with empty tiles), tiles
    padded to `T` tokens."""

    def __init__(self, q, k, tiles, tile_size: int, p: Plan):
        self.B, self.S_q, self.H, self.D = q.shape
        self.K = k.shape[2]
        self.G = self.H // self.K
        self.U = self.B * self.K
        self.size, self.p = tile_size, p
        self.T, self.C, self.n_qc, self.CH = p.T, p.C, p.n_qc, p.CH
        self.n_q, self.n_k = self.S_q // tile_size, k.shape[1] // tile_size
        self.n_sel = tiles.shape[-1]
        self.L = self.n_qc * self.T

    def _pad_q(self, x, axis: int, value=0):
        x = _pad_tiles(x, self.size, self.T, axis=axis, value=value)
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, self.C * self.L - x.shape[axis])
        return jnp.pad(x, widths, constant_values=value)

    def queries(self, x):
        """`(B, S_q, H, D)` -> `(U, C, G, L, D)`."""
        B, K, G, C, D = self.B, self.K, self.G, self.C, self.D
        x = self._pad_q(x, 1).reshape(B, C, self.L, K, G, D)
        return x.transpose(0, 3, 1, 4, 2, 5).reshape(self.U, C, G, self.L, D)

    def from_queries(self, x):
        B, K, G, C, D = self.B, self.K, self.G, self.C, self.D
        x = x.reshape(B, K, C, G, self.L, D).transpose(0, 2, 4, 1, 3, 5).reshape(B, C * self.L, self.H, D)
        return _unpad_tiles(x[:, : self.n_q * self.T], self.size, self.T)

    def rows(self, x, value=0.0):
        """Row statistic `(B, H, S_q)` -> float32 `(U, C, G, L)`."""
        B, K, G, C = self.B, self.K, self.G, self.C
        x = self._pad_q(x.astype(F32), 2, value).reshape(B, K, G, C, self.L)
        return x.transpose(0, 1, 3, 2, 4).reshape(self.U, C, G, self.L)

    def from_rows(self, x):
        B, K, G, C = self.B, self.K, self.G, self.C
        x = x.reshape(B, K, C, G, self.L).transpose(0, 1, 3, 2, 4).reshape(B, self.H, C * self.L)
        return _unpad_tiles(x[:, :, : self.n_q * self.T], self.size, self.T, axis=2)

    def tile_rows(self, x, pad: float):
        """`(U, C, G, L)` -> `(U, C, G * n_qc + 1, 1, W)`: each query tile's row, its
        `T` values repeated `CH` times, and a last row of `pad`."""
        U, C, G = self.U, self.C, self.G
        x = jnp.tile(x.reshape(U, C, G * self.n_qc, self.T), (1, 1, 1, self.CH))
        x = jnp.concatenate([x, jnp.full((U, C, 1, self.p.W), pad, F32)], axis=2)
        return x[:, :, :, None, :]

    def table(self, tiles, compact: bool):
        """`(B, H, n_q, n_sel)` -> int32 `(U, C, G, n_qc, n_selp)`, -1 padded; with
        `compact`, each row's used slots first."""
        B, K, G, C = self.B, self.K, self.G, self.C
        t = tiles.astype(jnp.int32)
        if compact:
            t = jnp.sort(jnp.where(t < 0, self.n_k, t), axis=-1)
            t = jnp.where(t >= self.n_k, -1, t)
        t = jnp.pad(t, ((0, 0), (0, 0), (0, C * self.n_qc - self.n_q), (0, self.p.n_selp - self.n_sel)),
                    constant_values=-1)
        t = t.reshape(B, K, G, C, self.n_qc, self.p.n_selp).transpose(0, 1, 3, 2, 4, 5)
        return t.reshape(self.U, C, G, self.n_qc, self.p.n_selp)

    def keys(self, x):
        """`(B, S_k, K, D)` -> `(U, S_k', D)`, tiles padded to `T`."""
        x = _pad_tiles(x, self.size, self.T)
        B, S, K, D = x.shape
        return x.transpose(0, 2, 1, 3).reshape(B * K, S, D)

    def from_keys(self, x):
        U, S, D = x.shape
        x = x.reshape(self.B, U // self.B, S, D).transpose(0, 2, 1, 3)
        return _unpad_tiles(x, self.size, self.T)

    def valid(self, kv_valid):
        """float32 `(n_k, T)`: 1 for a real key (padding of the tiles: 0)."""
        return _pad_tiles(kv_valid.astype(F32), self.size, self.T, axis=0).reshape(self.n_k, self.T)

    def valid_rows(self, kv_valid):
        """`(n_k + 1, 1, W)`: each key tile's validity repeated `CH` times along the
        lanes, and a last row of zeros (an unused slot)."""
        x = jnp.tile(self.valid(kv_valid), (1, self.CH))
        return jnp.concatenate([x, jnp.zeros((1, self.p.W), F32)])[:, None, :]


_PACKED_MAX = 2**31 - 1  # `_csr` packs a key tile and a row into one int32 up to this


def _csr(table: jax.Array, n_k: int):
    """The dK/dV pass's table of one (unit, chunk) from its `(G, n_qc, n_selp)` table:
    `(offsets (n_k + 1,), entries (G * n_qc * n_selp,))`, the rows `g * n_qc + i` that
    selected each key tile, sorted by key tile (then row); key tile `t`'s rows are
    `entries[offsets[t] : offsets[t + 1]]` (unused slots sort last, past `offsets[n_k]`).

    One sort of int32 `key * rows + row` and a binary search for each key tile's first
    entry: no scatter (a TPU runs a scatter-add of the counts one update at a time, 10 ms
    for VSA 0.75's 1.2 million slots at Wan 480p, a tenth of the fine stage)."""
    G, n_qc, n_selp = table.shape
    n_rows = G * n_qc
    keys = jnp.where(table >= 0, table, n_k).reshape(-1).astype(jnp.int32)
    rows = jnp.broadcast_to(jnp.arange(n_rows, dtype=jnp.int32)[:, None], (n_rows, n_selp)).reshape(-1)
    if (n_k + 1) * n_rows <= _PACKED_MAX:
        packed = jnp.sort(keys * n_rows + rows)
        keys, rows = packed // n_rows, packed % n_rows
    else:  # too many for one int32 key: sort the pairs
        keys, rows = lax.sort((keys, rows), num_keys=2)
    return _first_at_least(keys, jnp.arange(n_k + 1, dtype=jnp.int32)), rows


def _first_at_least(ordered: jax.Array, targets: jax.Array) -> jax.Array:
    """int32: for each of `targets`, the index of the first entry of the sorted 1-D
    `ordered` that is `>=` it (`len(ordered)` if none). A binary search unrolled over
    the bits of the length, one gather per step (`jnp.searchsorted` of JAX 0.12 is a
    primitive that does not lower for a TPU from another host)."""
    n = ordered.shape[0]
    lo = jnp.zeros(targets.shape, jnp.int32)
    hi = jnp.full(targets.shape, n, jnp.int32)
    for _ in range(n.bit_length()):  # each step at least halves every interval
        active = lo < hi
        mid = (lo + hi) // 2
        below = ordered[jnp.minimum(mid, max(n - 1, 0))] < targets
        lo = jnp.where(active & below, mid + 1, lo)
        hi = jnp.where(active & ~below, mid, hi)
    return lo


def _scope(interpret: bool):
    return pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()


# -- the contract ----------------------------------------------------------------------


def _forward(q, k, v, tiles, kv_valid, *, tile_size, scale, p: Plan, run: int):
    lay = _Layout(q, k, tiles, tile_size, p)
    table = lay.table(tiles, compact=run == 1)  # (U, C, G, n_qc, n_selp)
    counts = jnp.sum(table >= 0, axis=-1, dtype=jnp.int32).reshape(lay.U * lay.C, -1)
    out, lse = _fwd_call(table.reshape(lay.U * lay.C, -1), counts, lay.queries(q), lay.keys(k), lay.keys(v),
                         lay.valid_rows(kv_valid), p=p, n_k=lay.n_k, scale=scale)
    return lay.from_queries(out), lay.from_rows(lse[..., 0])


def _backward(q, k, v, tiles, kv_valid, lse, delta, dout, *, tile_size, scale, p: Plan, run: int):
    """`(dq, dk, dv)` from `lse` ready for `exp(s - lse)` (empty rows: 0; rows to drop:
    `PAD_LSE`) and `delta`."""
    lay = _Layout(q, k, tiles, tile_size, p)
    U, C, G, D = lay.U, lay.C, lay.G, lay.D
    table = lay.table(tiles, compact=run == 1)  # (U, C, G, n_qc, n_selp)
    counts = jnp.sum(table >= 0, axis=-1, dtype=jnp.int32).reshape(U * C, -1)
    offsets, entries = jax.vmap(lambda t: _csr(t, lay.n_k))(table.reshape(U * C, *table.shape[2:]))
    qs, dos, ks, vs = lay.queries(q), lay.queries(dout.astype(q.dtype)), lay.keys(k), lay.keys(v)
    lse_r, delta_r = lay.rows(lse, m.PAD_LSE), lay.rows(delta)  # (U, C, G, L)
    lanes = lambda x: jnp.broadcast_to(x[..., None], (*x.shape, _LANES))
    dq = _dq_call(table.reshape(U * C, -1), counts, qs, dos, lanes(lse_r), lanes(delta_r), ks, vs,
                  lay.valid_rows(kv_valid), p=p, n_k=lay.n_k, scale=scale)
    flat = lambda x: x.reshape(U, C, G * lay.L, D)
    dk, dv = _dkv_call(offsets, entries, ks, vs, lay.valid(kv_valid)[:, :, None], flat(qs), flat(dos),
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
    p = _opts(q, k, tiles, tile_size, run, kv_tiles, chains, KV_KEYS_FWD, KV_KEYS_WHOLE)
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
    p = _opts(q, k, tiles, tile_size, run, kv_tiles, chains, KV_KEYS_BWD)
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
