"""Sliding tile attention on the gathering kernels of `_gather.py`.

A [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask] without text is a static
tile table: each query tile attends the key tiles of its window (`wf x wh x ww` tiles,
shifted inward at the grid's edges), which in the tile layout's raster order are
`wf * wh` runs of `ww` consecutive key tiles. `tile_table` builds it in NumPy when the
program is traced; the kernels then slice each chunk of a run from the resident K/V
instead of gathering its tiles. Padding tokens (those filling a partial tile) are
hidden keys, and their query rows are dropped (out 0, the empty lse `_math.masked`,
no gradient). Per-head windows run one call per distinct window, over that window's
query heads and their key/value heads (whole GQA groups, or one key/value head per
query head, whose dK/dV the groups then add up).

`PallasTpu` runs these for a mask without text over exactly the layout's tokens (its
`sliding_tile` option; `_implementation.py`). `sliding_tile_fwd` / `sliding_tile_bwd`
follow the fine stage's contract (the empty lse is finite) and `sliding_tile_attention`
is their differentiable form. A window's tiles are not sliced from its runs but
gathered in as few chunks as `_gather_plan.kv_chunk` allows (a 3 x 3 x 3 window
of tiles of up to 85 rows: one chunk forward): wider products, measured faster on a
TPU v5e.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._tile import SlidingTileMask
from .._tile_tables import layout_valid, window_table
from . import _gather as gather


F32 = jnp.float32


def tile_table(tm: SlidingTileMask, head: int = 0) -> tuple[np.ndarray, int]:
    """The static tile table of query head `head`'s window (any head when the window is
    shared) of a sliding tile mask without text.

    **Returns:** `(table, run)`: int32 NumPy `(n_tiles, n_sel)`, each query tile's key
    tiles (tile layout order; `n_sel` the window's tile count, no unused slot), laid out
    as runs of `run = ww` consecutive key tiles (the window clamped to the tile grid).
    """
    if tm.text_len:
        raise ValueError(
            f"tile_table: the gathering kernels serve a SlidingTileMask without text; received "
            f"text_len={tm.text_len}."
        )
    index = 0 if tm.heads is None else head
    window = tm.windows[index]
    table = window_table(tm)[index][:, : math.prod(window)]
    return np.ascontiguousarray(table, np.int32), int(window[2])


class WindowGroup(NamedTuple):
    """The query heads of one distinct window (`None`: all) with its table, and their
    key/value heads (`None`: all; whole GQA groups, or one per query head)."""

    table: np.ndarray
    run: int
    heads: tuple[int, ...] | None
    kv_heads: tuple[int, ...] | None


def window_groups(tm: SlidingTileMask, heads: int, kv_heads: int) -> list[WindowGroup]:
    """One `WindowGroup` per distinct window of `tm` (one for a shared window)."""
    if tm.heads is None or len(set(tm.windows)) == 1:
        return [WindowGroup(*tile_table(tm, 0), None, None)]
    G = heads // kv_heads
    by_window: dict[tuple, list[int]] = {}
    for h in range(heads):
        by_window.setdefault(tm.windows[h], []).append(h)
    groups = []
    for members in by_window.values():
        kv = sorted({h // G for h in members})
        whole = members == [j * G + g for j in kv for g in range(G)]
        groups.append(WindowGroup(*tile_table(tm, members[0]), tuple(members),
                                  tuple(kv) if whole else tuple(h // G for h in members)))
    return groups


def _take(x: jax.Array, heads, axis: int) -> jax.Array:
    return x if heads is None else jnp.take(x, np.asarray(heads), axis=axis)


def _merge(parts: list[jax.Array], groups: list[WindowGroup], axis: int) -> jax.Array:
    """The groups' results back in head order along `axis`."""
    if groups[0].heads is None:
        return parts[0]
    order = np.argsort(np.concatenate([g.heads for g in groups]))
    return jnp.take(jnp.concatenate(parts, axis=axis), order, axis=axis)


def _setup(q, k, tm: SlidingTileMask, where: str):
    """`(q_valid, groups)` after checking the operands against the mask."""
    if tm.text_len:
        raise ValueError(f"{where}: the gathering kernels serve a SlidingTileMask without text; received "
                         f"text_len={tm.text_len}.")
    if q.shape[1] != tm.video_len or k.shape[1] != tm.video_len:
        raise ValueError(
            f"{where}: q, k and v need the mask's {tm.video_len} tokens (its tile layout); received "
            f"q: {q.shape}, k: {k.shape}."
        )
    tm.check_heads(q.shape[2], where)
    return jnp.asarray(layout_valid(tm.grid, tm.tile)), window_groups(tm, q.shape[2], k.shape[2])


def _tiles(group: WindowGroup, batch: int, heads: int) -> jax.Array:
    return jnp.broadcast_to(jnp.asarray(group.table), (batch, heads, *group.table.shape))


def sliding_tile_fwd(q, k, v, tm: SlidingTileMask, *, scale: float, interpret: bool = False,
                     kv_tiles: int | None = None, chains: int | None = None):
    """Sliding tile attention (a mask without text) on the gathering kernels.

    **Arguments:** `q (B, S, H, D)`, `k`, `v (B, S, H_kv, D)` in the mask's tile layout
    (`S = tm.video_len`); `scale`; `interpret` (Pallas interpret mode); `kv_tiles`,
    `chains` (see `_gather_plan.plan`).

    **Returns:** `(out, lse)`, lse float32 `(B, H, S)`; padding rows give 0 and the
    finite empty lse `_math.masked`.
    """
    valid, groups = _setup(q, k, tm, "sliding_tile_fwd")
    outs, lses = [], []
    for g in groups:
        qg = _take(q, g.heads, 2)
        out, lse = gather.sparse_fwd(
            qg, _take(k, g.kv_heads, 2), _take(v, g.kv_heads, 2), _tiles(g, q.shape[0], qg.shape[2]), valid,
            tile_size=tm.tile_size, scale=scale, interpret=interpret, q_valid=valid, run=g.run,
            kv_tiles=kv_tiles, chains=chains,
        )
        outs.append(out)
        lses.append(lse)
    return _merge(outs, groups, 2), _merge(lses, groups, 1)


def sliding_tile_bwd(q, k, v, tm: SlidingTileMask, out, lse, dout, dlse, *, scale: float,
                     interpret: bool = False, kv_tiles: int | None = None, chains: int | None = None):
    """The gradients `(dq, dk, dv)` of `sliding_tile_fwd` from its `(out, lse)` (or those
    of a larger computation) and the cotangents `dout`, `dlse` (or `None`)."""
    valid, groups = _setup(q, k, tm, "sliding_tile_bwd")
    dqs, dk, dv = [], None, None
    for g in groups:
        qg, kg, vg = _take(q, g.heads, 2), _take(k, g.kv_heads, 2), _take(v, g.kv_heads, 2)
        dlse_g = None if dlse is None else _take(dlse, g.heads, 1)
        dq_g, dk_g, dv_g = gather.sparse_bwd(
            qg, kg, vg, _tiles(g, q.shape[0], qg.shape[2]), valid, _take(out, g.heads, 2),
            _take(lse, g.heads, 1), _take(dout, g.heads, 2), dlse_g,
            tile_size=tm.tile_size, scale=scale, interpret=interpret, q_valid=valid, run=g.run,
            kv_tiles=kv_tiles, chains=chains,
        )
        dqs.append(dq_g)
        if g.kv_heads is None:
            dk, dv = dk_g, dv_g
        else:  # groups may share a key/value head: add up
            if dk is None:
                dk, dv = jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32)
            dk = dk.at[:, :, np.asarray(g.kv_heads)].add(dk_g.astype(F32))
            dv = dv.at[:, :, np.asarray(g.kv_heads)].add(dv_g.astype(F32))
    return _merge(dqs, groups, 2), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _sliding(q, k, v, tm, scale, interpret, kv_tiles, chains):
    return sliding_tile_fwd(q, k, v, tm, scale=scale, interpret=interpret, kv_tiles=kv_tiles, chains=chains)


def _sliding_fwd_rule(q, k, v, tm, scale, interpret, kv_tiles, chains):
    out, lse = _sliding(q, k, v, tm, scale, interpret, kv_tiles, chains)
    return (out, lse), (q, k, v, out, lse)


def _sliding_bwd_rule(tm, scale, interpret, kv_tiles, chains, residuals, cotangents):
    q, k, v, out, lse = residuals
    dout, dlse = cotangents
    return sliding_tile_bwd(q, k, v, tm, out, lse, dout, dlse, scale=scale, interpret=interpret,
                            kv_tiles=kv_tiles, chains=chains)


_sliding.defvjp(_sliding_fwd_rule, _sliding_bwd_rule)


def sliding_tile_attention(q, k, v, tm: SlidingTileMask, *, scale: float | None = None,
                           interpret: bool = False, kv_tiles: int | None = None,
                           chains: int | None = None):
    """`sliding_tile_fwd`, differentiable in q, k and v (through `out` and `lse`):
    `(out, lse)`; `scale` defaults to `1 / sqrt(D)`."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _sliding(q, k, v, tm, scale, interpret, kv_tiles, chains)
