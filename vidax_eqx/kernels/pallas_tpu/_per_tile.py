"""VSA's fine stage as Pallas TPU (Mosaic) block-sparse flash attention.

The contract is `_sparse.py`'s: each query tile attends the key tiles listed for
it (per query head) in `tiles (B, H, n_q_tiles, n_sel)` (`-1`: an unused slot),
`kv_valid (S_k,)` hides padding keys, logits are `scale * q.k`, statistics are
float32, and a row that sees nothing gives 0 with the finite empty log-sum-exp
`_math.masked`.

The work is split by *unit*, one batch element and one key/value head with its
`G = H // H_kv` query heads (GQA without repeating K/V), and each unit's query
tiles into `C` chunks: a `lax.map` over the units and, inside, over the chunks
runs one `pallas_call` per chunk, so that the tile tables, which are
scalar-prefetched into SMEM (1 MiB per core from TPU v4 on), stay within
`_SMEM_ENTRIES` int32 entries (`_chunks`). Wan 480p (624 tiles of 64 tokens,
`n_sel = 63`) is one chunk of about 40,000 entries per table; Wan 720p (1,440
tiles, `n_sel = 144`) four chunks of 360 query tiles, whose dK/dV partial sums
are added (a float32 `(S_k, D)` per chunk).

- **forward** and **dQ**: grid `(G, chunk's query tiles, n_sel)`, the slot axis
  `"arbitrary"`. The table drives the K/V (and validity) `BlockSpec` index maps;
  the forward keeps an online softmax in VMEM scratch, the dQ pass recomputes
  the probabilities from the log-sum-exp and accumulates `dS K`.
- **dK/dV**: the table inverted on device. Every `(query head, query tile, slot)`
  pair of the chunk, plus one empty entry per key tile (so that a key tile no
  query selected still gets its zero gradient written), is sorted by key tile
  (`lax.sort`, stable): a list of `G * n_q_chunk * n_sel + n_k_tiles` entries,
  O(n_q * n_sel) rather than an `(n_k, n_q)` padded table. Grid `(entries,)`,
  `"arbitrary"`: consecutive entries of one key tile keep its dK/dV output block
  resident in VMEM (as a grouped matmul does), accumulating `dS^T Q` and
  `P^T dO`; the block is initialized at the first entry of its key tile and
  written at the last. As in splash's dK/dV kernel, keys run along sublanes and
  queries along lanes (`P^T` from `K Q^T` and the query rows' statistics as a lane
  row), so no tile is transposed in the kernel.

An unused slot (and an unused sorted entry) is skipped with `pl.when`; its
index map points at the block the previous step fetched, so it costs no DMA
(the table stores `-(block + 1)` for it). Row statistics travel as `(rows, 128)`
lane-replicated float32 arrays to the forward and dQ kernels, as splash / flash
attention do, and as `(1, T)` rows to the dK/dV kernel.

**Tile sizes** that are not a multiple of 8 (Mosaic's sublane tiling) are padded
per tile with hidden keys and dropped query rows (a copy of q, k, v); head
dimensions are whole blocks. **Not supported**: float64 (Mosaic has none); so many
key tiles and selected tiles that the tables of one query tile exceed
`_SMEM_ENTRIES` (`NotImplementedError`: use `"blockwise"`).
Performance is not measured (no TPU here): every grid step is one `T x T` tile
pair, so tiles of 64 tokens leave the per-step overhead dominant.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..._vma import opaque_to_vma
from .. import _math as m


F32 = jnp.float32
_LANES = 128  # row statistics are lane-replicated, as in splash / flash attention
_SUBLANES = 8  # tile sizes are padded to a multiple of this
# int32 entries of the scalar-prefetched tables of one call (half of TPU v4+'s 1 MiB SMEM).
_SMEM_ENTRIES = 1 << 17
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


# -- layout -------------------------------------------------------------------------


def _pad_tiles(x: jax.Array, tile_size: int, padded: int, axis: int = 1, value=0) -> jax.Array:
    """Pads every tile of `tile_size` entries along `axis` to `padded` entries."""
    if padded == tile_size:
        return x
    shape = x.shape
    n = shape[axis] // tile_size
    x = x.reshape(*shape[:axis], n, tile_size, *shape[axis + 1:])
    widths = [(0, 0)] * x.ndim
    widths[axis + 1] = (0, padded - tile_size)
    x = jnp.pad(x, widths, constant_values=value)
    return x.reshape(*shape[:axis], n * padded, *shape[axis + 1:])


def _unpad_tiles(x: jax.Array, tile_size: int, padded: int, axis: int = 1) -> jax.Array:
    """Inverse of `_pad_tiles`."""
    if padded == tile_size:
        return x
    shape = x.shape
    n = shape[axis] // padded
    x = x.reshape(*shape[:axis], n, padded, *shape[axis + 1:])
    x = lax.slice_in_dim(x, 0, tile_size, axis=axis + 1)
    return x.reshape(*shape[:axis], n * tile_size, *shape[axis + 1:])


def _units_kv(x: jax.Array) -> jax.Array:
    """`(B, S, K, D)` -> `(B * K, S, D)`."""
    B, S, K, D = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B * K, S, D)


def _from_units_kv(x: jax.Array, batch: int) -> jax.Array:
    """Inverse of `_units_kv`."""
    U, S, D = x.shape
    return x.reshape(batch, U // batch, S, D).transpose(0, 2, 1, 3)


def _with_fetch(run: jax.Array, block: jax.Array) -> jax.Array:
    """A scalar table: `block` where `run`, else `-(b + 1)` with `b` the block of the
    last running entry before it along the last axis (0 if none), so that a skipped
    step fetches nothing new."""
    n = run.shape[-1]
    at = jnp.where(run, jnp.arange(n, dtype=jnp.int32), -1)
    last = lax.cummax(at, axis=at.ndim - 1)
    prev = jnp.take_along_axis(block, jnp.maximum(last, 0), axis=-1)
    prev = jnp.where(last >= 0, prev, 0)
    return jnp.where(run, block, -prev - 1).astype(jnp.int32)


def _fetch(e):
    """The block a table entry fetches (see `_with_fetch`)."""
    return jnp.where(e >= 0, e, -e - 1)


def _sorted_table(tiles: jax.Array, n_q: int, n_k: int):
    """The dK/dV pass's table of each unit, from `tiles (U, G, n_q, n_sel)`:
    `(rows, cols)`, int32 `(U, E)` with `E = G * n_q * n_sel + n_k`, sorted by key
    tile. `cols`: the key tile (`n_k` for an unused slot, sorted last); `rows`: the
    query block `g * n_q + i` (in the `(G * S_q)` rows of the unit), with
    `_with_fetch`'s encoding for entries that compute nothing."""
    U, G, _, n_sel = tiles.shape
    rows = jnp.arange(G * n_q, dtype=jnp.int32)[:, None]
    rows = jnp.broadcast_to(rows, (G * n_q, n_sel)).reshape(1, -1)
    cols = tiles.reshape(U, -1)
    cols = jnp.where(cols >= 0, cols, n_k).astype(jnp.int32)
    # One empty entry per key tile, first of its group: every key tile is written.
    empty_cols = jnp.broadcast_to(jnp.arange(n_k, dtype=jnp.int32), (U, n_k))
    cols = jnp.concatenate([empty_cols, cols], axis=1)
    rows = jnp.concatenate(
        [jnp.full((U, n_k), -1, jnp.int32), jnp.broadcast_to(rows, (U, rows.shape[1]))], axis=1
    )
    cols, rows = lax.sort((cols, rows), dimension=1, num_keys=1, is_stable=True)
    run = (rows >= 0) & (cols < n_k)
    return _with_fetch(run, jnp.maximum(rows, 0)), cols


# -- kernels -------------------------------------------------------------------------


def _logits(q_ref, k_ref, valid_ref, scale):
    """`(T, T)` float32 logits of a tile pair and the bool validity of its keys."""
    s = lax.dot_general(q_ref[...], k_ref[...], _NT, preferred_element_type=F32) * scale
    return s, valid_ref[...] > 0.5  # (1, T)


def _fwd_kernel(table_ref, q_ref, k_ref, v_ref, valid_ref, o_ref, lse_ref, m_sc, l_sc, o_sc, *,
                n_q: int, n_sel: int, scale: float):
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    low = m.masked(F32)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, low, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        o_sc[...] = jnp.zeros(o_sc.shape, F32)

    @pl.when(table_ref[(g * n_q + i) * n_sel + j] >= 0)
    def _step():
        s, valid = _logits(q_ref, k_ref, valid_ref, scale)
        s = jnp.where(valid, s, low)
        m_prev = m_sc[...][:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == low, 0.0, m_new)  # nothing seen: every exp is 0
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_prev - m_safe)
        l_new = alpha * l_sc[...][:, :1] + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        pv = lax.dot_general(p.astype(v.dtype), v, _NN, preferred_element_type=F32)
        o_sc[...] = alpha * o_sc[...] + pv
        m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
        l_sc[...] = jnp.broadcast_to(l_new, l_sc.shape)

    @pl.when(j == n_sel - 1)
    def _finish():
        l = l_sc[...][:, :1]
        empty = l == 0.0
        l_safe = jnp.where(empty, 1.0, l)
        o_ref[...] = (o_sc[...] / l_safe).astype(o_ref.dtype)
        lse = jnp.where(empty, low, m_sc[...][:, :1] + jnp.log(l_safe))
        lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def _probabilities(q_ref, k_ref, v_ref, valid_ref, do_ref, lse_ref, delta_ref, scale):
    """`(p, ds)` of a tile pair, recomputed from the log-sum-exp."""
    s, valid = _logits(q_ref, k_ref, valid_ref, scale)
    p = jnp.exp(jnp.where(valid, s - lse_ref[...][:, :1], m.masked(F32)))
    dp = lax.dot_general(do_ref[...], v_ref[...], _NT, preferred_element_type=F32)
    return p, p * (dp - delta_ref[...][:, :1])


def _dq_kernel(table_ref, q_ref, k_ref, v_ref, valid_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_sc, *,
               n_q: int, n_sel: int, scale: float):
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, F32)

    @pl.when(table_ref[(g * n_q + i) * n_sel + j] >= 0)
    def _step():
        _, ds = _probabilities(q_ref, k_ref, v_ref, valid_ref, do_ref, lse_ref, delta_ref, scale)
        k = k_ref[...]
        dq_sc[...] += lax.dot_general(ds.astype(k.dtype), k, _NN, preferred_element_type=F32)

    @pl.when(j == n_sel - 1)
    def _finish():
        dq_ref[...] = (dq_sc[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(rows_ref, cols_ref, q_ref, k_ref, v_ref, valid_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, dk_sc, dv_sc, *, n_k: int, entries: int, scale: float):
    """Keys along sublanes, queries along lanes (as splash's dK/dV kernel): the
    transposed tile `p^T (T_k, T_q)` comes from `k q^T` and the query tile's row
    statistics `(1, T_q)`, and both products are plain matmuls (no transpose)."""
    e = pl.program_id(0)
    col = cols_ref[e]
    real = col < n_k
    first = real & ((e == 0) | (cols_ref[jnp.maximum(e - 1, 0)] != col))
    last = real & ((e == entries - 1) | (cols_ref[jnp.minimum(e + 1, entries - 1)] != col))

    @pl.when(first)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, F32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, F32)

    @pl.when(real & (rows_ref[e] >= 0))
    def _step():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s_t = lax.dot_general(k, q, _NT, preferred_element_type=F32) * scale  # (T_k, T_q)
        valid = valid_ref[...] > 0.5  # (T_k, 1)
        p_t = jnp.exp(jnp.where(valid, s_t - lse_ref[...], m.masked(F32)))
        dp_t = lax.dot_general(v, do, _NT, preferred_element_type=F32)
        ds_t = p_t * (dp_t - delta_ref[...])
        dk_sc[...] += lax.dot_general(ds_t.astype(q.dtype), q, _NN, preferred_element_type=F32)
        dv_sc[...] += lax.dot_general(p_t.astype(do.dtype), do, _NN, preferred_element_type=F32)

    @pl.when(last)
    def _finish():
        dk_ref[...] = (dk_sc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


# -- the calls -------------------------------------------------------------------------


def _chunks(n_q: int, n_k: int, per_tile: int) -> tuple[int, int]:
    """`(C, n_qc)`: the query tiles split into `C` chunks of `n_qc` (the last padded
    with empty tiles) so that one call's scalar tables fit `_SMEM_ENTRIES`: the dK/dV
    pass's two sorted tables of `per_tile * n_qc + n_k` entries each (`per_tile =
    G * n_sel`), the larger of the passes."""
    room = _SMEM_ENTRIES // 2 - n_k
    if room < per_tile:
        raise NotImplementedError(
            f"pallas_tpu: VSA's fine stage scalar-prefetches tile tables into SMEM; with "
            f"{n_k} key tiles and {per_tile} selected tiles per query tile (over the query "
            f"heads of a key/value head) not even one query tile fits its budget of "
            f"{_SMEM_ENTRIES} int32 entries; use implementation='blockwise', fewer "
            "selected tiles or larger tiles."
        )
    C = -(-n_q // min(n_q, room // per_tile))
    return C, -(-n_q // C)


def _fwd_call(table, q, k, v, valid, *, T: int, n_sel: int, scale: float):
    """One unit's forward: `table (G*n_q*n_sel,)`, `q (G, S_q, D)`, `k, v (S_k, D)`,
    `valid (n_k, 1, T)` -> `out (G, S_q, D)`, `lse (G, S_q, 128)`."""
    G, S_q, D = q.shape
    n_q = S_q // T

    def kv_map(g, i, j, tab):
        return _fetch(tab[(g * n_q + i) * n_sel + j]), 0

    def valid_map(g, i, j, tab):
        return _fetch(tab[(g * n_q + i) * n_sel + j]), 0, 0

    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(G, n_q, n_sel),
        in_specs=[
            pl.BlockSpec((None, T, D), lambda g, i, j, tab: (g, i, 0)),
            pl.BlockSpec((T, D), kv_map),
            pl.BlockSpec((T, D), kv_map),
            pl.BlockSpec((None, 1, T), valid_map),
        ],
        out_specs=[
            pl.BlockSpec((None, T, D), lambda g, i, j, tab: (g, i, 0)),
            pl.BlockSpec((None, T, _LANES), lambda g, i, j, tab: (g, i, 0)),
        ],
        scratch_shapes=[
            pltpu.VMEM((T, _LANES), F32),
            pltpu.VMEM((T, _LANES), F32),
            pltpu.VMEM((T, D), F32),
        ],
    )
    return pl.pallas_call(
        functools.partial(_fwd_kernel, n_q=n_q, n_sel=n_sel, scale=scale),
        grid_spec=spec,
        out_shape=[
            jax.ShapeDtypeStruct((G, S_q, D), q.dtype),
            jax.ShapeDtypeStruct((G, S_q, _LANES), F32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        name="vidax_vsa_fine_fwd",
    )(table, q, k, v, valid)


def _dq_call(table, q, k, v, valid, do, lse, delta, *, T: int, n_sel: int, scale: float):
    """One unit's dQ (float32 `(G, S_q, D)`)."""
    G, S_q, D = q.shape
    n_q = S_q // T

    def kv_map(g, i, j, tab):
        return _fetch(tab[(g * n_q + i) * n_sel + j]), 0

    def valid_map(g, i, j, tab):
        return _fetch(tab[(g * n_q + i) * n_sel + j]), 0, 0

    row = lambda g, i, j, tab: (g, i, 0)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(G, n_q, n_sel),
        in_specs=[
            pl.BlockSpec((None, T, D), row),
            pl.BlockSpec((T, D), kv_map),
            pl.BlockSpec((T, D), kv_map),
            pl.BlockSpec((None, 1, T), valid_map),
            pl.BlockSpec((None, T, D), row),
            pl.BlockSpec((None, T, _LANES), row),
            pl.BlockSpec((None, T, _LANES), row),
        ],
        out_specs=pl.BlockSpec((None, T, D), row),
        scratch_shapes=[pltpu.VMEM((T, D), F32)],
    )
    return pl.pallas_call(
        functools.partial(_dq_kernel, n_q=n_q, n_sel=n_sel, scale=scale),
        grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((G, S_q, D), F32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        name="vidax_vsa_fine_dq",
    )(table, q, k, v, valid, do, lse, delta)


def _dkv_call(rows, cols, q, k, v, valid, do, lse, delta, *, T: int, scale: float):
    """One unit's dK, dV (float32 `(S_k, D)`) from its sorted table `(rows, cols)`;
    `q`, `do` `(G * S_q, D)`; `valid (n_k, T, 1)`, a column per key tile; `lse`,
    `delta` `(G * n_q, 1, T)`, a row per query tile."""
    S_k, D = k.shape
    n_k = S_k // T
    entries = rows.shape[0]

    def q_map(e, rows, cols):
        return _fetch(rows[e]), 0

    def row_map(e, rows, cols):
        return _fetch(rows[e]), 0, 0

    def kv_map(e, rows, cols):
        return jnp.minimum(cols[e], n_k - 1), 0

    def valid_map(e, rows, cols):
        return jnp.minimum(cols[e], n_k - 1), 0, 0

    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(entries,),
        in_specs=[
            pl.BlockSpec((T, D), q_map),
            pl.BlockSpec((T, D), kv_map),
            pl.BlockSpec((T, D), kv_map),
            pl.BlockSpec((None, T, 1), valid_map),
            pl.BlockSpec((T, D), q_map),
            pl.BlockSpec((None, 1, T), row_map),
            pl.BlockSpec((None, 1, T), row_map),
        ],
        out_specs=[pl.BlockSpec((T, D), kv_map), pl.BlockSpec((T, D), kv_map)],
        scratch_shapes=[pltpu.VMEM((T, D), F32), pltpu.VMEM((T, D), F32)],
    )
    return pl.pallas_call(
        functools.partial(_dkv_kernel, n_k=n_k, entries=entries, scale=scale),
        grid_spec=spec,
        out_shape=[jax.ShapeDtypeStruct((S_k, D), F32)] * 2,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        name="vidax_vsa_fine_dkv",
    )(rows, cols, q, k, v, valid, do, lse, delta)


# -- the contract ------------------------------------------------------------------------


class _Layout:
    """The units' layout of one call: tiles padded to `T` tokens (a multiple of 8),
    units of one batch element and key/value head, their query tiles in `C` chunks of
    `n_qc` (padded with empty tiles)."""

    def __init__(self, q, k, tiles, tile_size: int):
        self.B, self.S_q, self.H, self.D = q.shape
        self.K = k.shape[2]
        self.G = self.H // self.K
        self.size = tile_size
        self.T = -(-tile_size // _SUBLANES) * _SUBLANES
        self.n_q, self.n_k = self.S_q // tile_size, k.shape[1] // tile_size
        self.n_sel = tiles.shape[-1]
        self.C, self.n_qc = _chunks(self.n_q, self.n_k, self.G * self.n_sel)
        self.L = self.n_qc * self.T  # query rows of a chunk

    def _pad_q(self, x, axis: int, value=0):
        """Tiles padded to `T`, query tiles to `C * n_qc` along `axis`."""
        x = _pad_tiles(x, self.size, self.T, axis=axis, value=value)
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, self.C * self.L - x.shape[axis])
        return jnp.pad(x, widths, constant_values=value)

    def queries(self, x):
        """`(B, S_q, H, D)` -> `(B*K, C, G, L, D)`."""
        B, K, G, C, D = self.B, self.K, self.G, self.C, self.D
        x = self._pad_q(x, 1).reshape(B, C, self.L, K, G, D)
        return x.transpose(0, 3, 1, 4, 2, 5).reshape(B * K, C, G, self.L, D)

    def from_queries(self, x):
        """Inverse of `queries`."""
        B, K, G, C, D = self.B, self.K, self.G, self.C, self.D
        x = x.reshape(B, K, C, G, self.L, D).transpose(0, 2, 4, 1, 3, 5).reshape(B, C * self.L, self.H, D)
        return _unpad_tiles(x[:, : self.n_q * self.T], self.size, self.T)

    def rows(self, x):
        """Row statistic `(B, H, S_q)` -> float32 `(B*K, C, G, L)`."""
        B, K, G, C = self.B, self.K, self.G, self.C
        x = self._pad_q(x.astype(F32), 2).reshape(B, K, G, C, self.L)
        return x.transpose(0, 1, 3, 2, 4).reshape(B * K, C, G, self.L)

    def from_rows(self, x):
        """Inverse of `rows`."""
        B, K, G, C = self.B, self.K, self.G, self.C
        x = x.reshape(B, K, C, G, self.L).transpose(0, 1, 3, 2, 4).reshape(B, self.H, C * self.L)
        return _unpad_tiles(x[:, :, : self.n_q * self.T], self.size, self.T, axis=2)

    def table(self, tiles):
        """`(B, H, n_q, n_sel)` -> int32 `(B*K, C, G, n_qc, n_sel)`; padding rows -1."""
        B, K, G, C = self.B, self.K, self.G, self.C
        t = jnp.pad(tiles.astype(jnp.int32), ((0, 0), (0, 0), (0, C * self.n_qc - self.n_q), (0, 0)),
                    constant_values=-1)
        t = t.reshape(B, K, G, C, self.n_qc, self.n_sel).transpose(0, 1, 3, 2, 4, 5)
        return t.reshape(B * K, C, G, self.n_qc, self.n_sel)

    def keys(self, x):
        """`(B, S_k, K, D)` -> `(B*K, S_k', D)`, tiles padded to `T`."""
        return _units_kv(_pad_tiles(x, self.size, self.T))

    def from_keys(self, x):
        return _unpad_tiles(_from_units_kv(x, self.B), self.size, self.T)

    def valid(self, kv_valid):
        """float32 `(n_k, T)`: 1 for a real key (padding of the tiles: 0)."""
        return _pad_tiles(kv_valid.astype(F32), self.size, self.T, axis=0).reshape(self.n_k, self.T)


def _scope(interpret: bool):
    return pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()


def sparse_fwd(q, k, v, tiles, kv_valid, *, tile_size: int, scale: float, interpret: bool = False):
    """The fine stage's forward: `(out (B, S_q, H, D), lse (B, H, S_q) float32)`."""

    def compute(q, k, v, tiles, kv_valid):
        lay = _Layout(q, k, tiles, tile_size)
        T, n_sel = lay.T, lay.n_sel
        table = lay.table(tiles).reshape(lay.B * lay.K, lay.C, -1)
        table = _with_fetch(table >= 0, jnp.maximum(table, 0))
        valid = lay.valid(kv_valid)[:, None, :]

        def unit(xs):  # one batch element and key/value head
            tables, qs, kx, vx = xs

            def chunk(ys):  # one chunk of its query tiles
                tab, qx = ys
                out, lse = _fwd_call(tab, qx, kx, vx, valid, T=T, n_sel=n_sel, scale=scale)
                return out, lse[..., 0]

            return lax.map(chunk, (tables, qs))

        with _scope(interpret):
            out, lse = lax.map(unit, (table, lay.queries(q), lay.keys(k), lay.keys(v)))
        return lay.from_queries(out), lay.from_rows(lse)

    return opaque_to_vma(compute, q, k, v, tiles, kv_valid)


def sparse_bwd(q, k, v, tiles, kv_valid, out, lse, dout, dlse, *, tile_size: int, scale: float,
               interpret: bool = False):
    """The fine stage's backward: `(dq, dk, dv)` in the dtypes of q, k, v; `lse` may be
    that of a larger computation (a ring), `dlse` may be `None`."""
    delta = m.delta(out, dout, dlse)
    lse = m.safe_lse(lse)

    def compute(q, k, v, tiles, kv_valid, lse, delta, dout):
        lay = _Layout(q, k, tiles, tile_size)
        T, G, D, n_qc, n_k, n_sel = lay.T, lay.G, lay.D, lay.n_qc, lay.n_k, lay.n_sel
        U, C = lay.B * lay.K, lay.C
        tiles_u = lay.table(tiles)
        rows, cols = _sorted_table(tiles_u.reshape(U * C, G, n_qc, n_sel), n_qc, n_k)
        rows, cols = rows.reshape(U, C, -1), cols.reshape(U, C, -1)
        table = tiles_u.reshape(U, C, -1)
        table = _with_fetch(table >= 0, jnp.maximum(table, 0))
        valid = lay.valid(kv_valid)
        lse_r, delta_r = lay.rows(lse), lay.rows(delta)  # (U, C, G, L)
        # Row statistics as lane-replicated columns (forward-like dQ pass) and as
        # rows of a query tile (dK/dV pass).
        lanes = lambda x: jnp.broadcast_to(x[..., None], (*x.shape, _LANES))
        tile_rows = lambda x: x.reshape(U, C, G * n_qc, 1, T)
        xs = (table, rows, cols, lay.queries(q), lay.keys(k), lay.keys(v),
              lay.queries(dout.astype(q.dtype)), lanes(lse_r), lanes(delta_r),
              tile_rows(lse_r), tile_rows(delta_r))

        def unit(xs):  # one batch element and key/value head
            tab, r, c, qs, kx, vx, dos, lx, dx, lr, dr = xs

            def chunk(carry, ys):  # one chunk of its query tiles
                tab, r, c, qx, dox, lx, dx, lr, dr = ys
                dq = _dq_call(tab, qx, kx, vx, valid[:, None, :], dox, lx, dx, T=T, n_sel=n_sel,
                              scale=scale)
                flat = lambda x: x.reshape(G * n_qc * T, D)
                dk, dv = _dkv_call(r, c, flat(qx), kx, vx, valid[:, :, None], flat(dox), lr, dr,
                                   T=T, scale=scale)
                return (carry[0] + dk, carry[1] + dv), dq

            zeros = jnp.zeros(kx.shape, F32)
            (dk, dv), dq = lax.scan(chunk, (zeros, zeros), (tab, r, c, qs, dos, lx, dx, lr, dr))
            return dq, dk, dv

        with _scope(interpret):
            dq, dk, dv = lax.map(unit, xs)
        return (lay.from_queries(dq).astype(q.dtype), lay.from_keys(dk).astype(k.dtype),
                lay.from_keys(dv).astype(v.dtype))

    return opaque_to_vma(compute, q, k, v, tiles, kv_valid, lse, delta, dout)
