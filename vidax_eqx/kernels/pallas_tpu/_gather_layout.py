"""One problem in the tile-gathering kernels' layout (`Layout`: units of one batch
element and key/value head, their query tiles in chunks, tiles padded to `T` rows), and
the dK/dV pass's table of each key tile's rows (`csr`).
"""

import jax
import jax.numpy as jnp
from jax import lax

from ._gather_plan import Plan


F32 = jnp.float32


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


class Layout:
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


_PACKED_MAX = 2**31 - 1  # `csr` packs a key tile and a row into one int32 up to this


def csr(table: jax.Array, n_k: int):
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
