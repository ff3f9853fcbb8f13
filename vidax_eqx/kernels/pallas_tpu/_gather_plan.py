"""The tile-gathering kernels' plan: the static layout of one problem (`Plan`: tokens
per padded tile, tiles per chunk, chunks of query tiles, query tiles per step, the
scoped VMEM limits), chosen when a call is traced, and the knobs it reads.

The knobs are this module's attributes, read when a call is traced (a benchmark or a
test may set them): `SMEM_ENTRIES` and `VMEM_BUDGET` (what one call's tables and
resident arrays may take), `KV_KEYS_FWD`, `KV_KEYS_BWD` and `KV_KEYS_WHOLE` (keys per
chunk), `CHAINS`, `ROWS`, and `GATHER` and `UNROLL`, which the kernels read
(`_gather_kernels.py`).

`plan`'s own knobs: `kv_tiles` (tiles per chunk; default: the selection in the fewest
chunks of at most `KV_KEYS_FWD` / `KV_KEYS_BWD` keys) and `chains`: a loop with a
dynamic trip count is not unrolled, so each iteration runs `chains` consecutive chunks
as independent computations the scheduler can interleave (the forward keeps an online
softmax per chain and merges them at the end; a remainder of fewer than `chains` chunks
runs one per iteration); `GATHER` and `UNROLL`. Measured on a TPU v5e
(`benchmarks/tpu/tpu_sparse.py`, docs/benchmarks.md): stacking the loads instead of
copying through VMEM took 5% off the fine stage's forward at VSA's Wan 480p problem,
unrolling 15% more; 4 chains gained nothing over 2 once unrolled. Wider chunks gained
most: 2,048 keys instead of 512 halved the forward at sparsity 0.9 (each chunk's work
grows, its fixed latency does not); sliding tile attention's 27-tile window as one
chunk, gathered, instead of 9 chunks sliced from its runs of 3 tiles, likewise. Where a
tile's selection is one chunk (up to `KV_KEYS_WHOLE` keys), `ROWS` query tiles a step,
side by side: the forward of 72-token tiles at Wan 480p from 0.199 to 0.168 of dense (2
tiles: 0.179, 8: 0.164), of 128-token tiles on (24, 32, 64) from 0.130 (two chunks, one
tile a step) to 0.099; a one-chunk dQ pass was slower (0.204 against 0.197
forward+backward at 480p), so the backward keeps its widths.
"""

import math
from typing import NamedTuple

import jax.numpy as jnp


LANES = 128  # a vreg's lanes: the row statistics of the forward / dQ passes are lane-replicated
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
    base = LANES // math.gcd(T, LANES)
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
    Dp = _ceil(D, LANES) * LANES
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
