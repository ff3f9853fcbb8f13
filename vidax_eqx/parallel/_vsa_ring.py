"""Video sparse attention (VSA) on a ring: global top-k, a fine stage that skips.

Each device of the ring holds a block of whole tiles of the global tile-layout
sequence (contiguous, or the zigzag chunks `r` and `2n - 1 - r`), the sequence
padded at its end with empty tiles. Per call:

1. **coarse, local and gathered**: each device takes the means of its q, k, v
    tiles over their real tokens (validity from the tiles' *global* indices);
    the key/value means (`tile_size` times smaller than K/V) are all-gathered over
    the ring, so each device attends its query tiles' means to every key tile's
    and picks, per query head and tile, the **global** top-k key tiles
    (`kernels._vsa.coarse_attention`, `select_tiles`). The gathered tile order is
    rank-major: gathered tile `g` is local tile `g % n_local` of rank
    `g // n_local`, which is exactly where the ring will bring it.
2. **fine, on the ring**: K/V blocks travel by ordered `ppermute`; at each step
    the selection is converted to the visiting block's local tile indices (`-1`
    elsewhere) and the fine stage (`kernels._vsa.sparse_fwd`) runs on it, its
    `(out, lse)` merged in float32 (`_ring_engine.merge`). A step that no local
    query tile selected is skipped at run time (`lax.cond`); its K/V still travel.
3. The custom VJP's backward is a second ring: `sparse_bwd` per step with the
    merged `out` and `lse`, the dK/dV accumulators travelling with their block and
    arriving home one hop after the last step. The coarse stage differentiates by
    autodiff (the all-gather transposes to a reduce-scatter).

Collective order (`vidax_eqx._order`): the ring's permutes wait for the gathered
coarse keys (through the selection) and, in the backward, the reduce-scatter
waits for the ring backward's gradients (`after`), so every device issues them
in one order.
"""

import dataclasses
import functools
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._order import after, ppermute as ordered_ppermute
from .._vma import as_varying, varying_axes
from ..kernels.internal import (
    coarse_attention, is_empty_lse, masked, select_tiles, sparse_bwd, sparse_fwd, tile_means,
    VsaLayout,
)
from ._layout import block_positions
from ._ring_engine import merge


F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class VsaRing:
    """Static configuration of one ring VSA call (hashable)."""

    axis_name: Hashable
    sp_size: int
    layout: str
    video: VsaLayout
    n_local: int  # tiles per device
    topk: int
    scale: float
    implementation: Any

    @property
    def tile_size(self) -> int:
        return self.video.tile_size

    def tile_ids(self, rank, xp=jnp):
        """Global tile indices of `rank`'s local tiles, `(n_local,)`."""
        return block_positions(xp, self.n_local, self.sp_size, rank, self.layout)

    def valid_table(self) -> np.ndarray:
        """bool `(sp_size * n_local, tile_size)`: real tokens of every global tile, the
        padding tiles empty."""
        n_pad = self.sp_size * self.n_local
        table = np.zeros((n_pad, self.tile_size), bool)
        table[: self.video.n_tiles] = self.video.token_valid().reshape(self.video.n_tiles, -1)
        return table

    def local_valid(self, rank) -> jax.Array:
        """bool `(n_local * tile_size,)`: the real tokens of `rank`'s block."""
        return jnp.take(jnp.asarray(self.valid_table()), self.tile_ids(rank), axis=0).reshape(-1)

    def gathered_counts(self) -> np.ndarray:
        """int `(sp_size * n_local,)`: real tokens of the gathered (rank-major) tiles."""
        counts = self.valid_table().sum(axis=1)
        order = np.concatenate([self.tile_ids(r, np) for r in range(self.sp_size)])
        return counts[order]


def _hop(xs: tuple, cfg: VsaRing, deps) -> tuple:
    """Arrays of one shape and dtype, stacked, one hop along the ring after `deps`."""
    n = cfg.sp_size
    perm = tuple((i, (i + 1) % n) for i in range(n))
    y = ordered_ppermute(jnp.stack(xs), cfg.axis_name, perm, deps=deps)
    return tuple(y[i] for i in range(len(xs)))


def _step_tiles(cfg: VsaRing, sel, src):
    """The selection as the local tile indices of `src`'s block: per row its tiles in
    that block first, then `-1`, `min(topk, n_local)` slots. The fine stage skips
    chunks of unused slots at run time, so a step costs the tiles it holds of the
    selection, not the selection's width."""
    nl = cfg.n_local
    local = jnp.where((sel >= 0) & (sel // nl == src), sel % nl, -1).astype(jnp.int32)
    local = -jnp.sort(-local, axis=-1)  # used slots (>= 0) first
    return local[..., : min(cfg.topk, nl)]


def fine_forward(cfg: VsaRing, q, k, v, sel):
    """`(out float32, lse float32)` of the fine stage over the whole ring."""
    n, T = cfg.sp_size, cfg.tile_size
    B, L, H, D = q.shape
    axes = varying_axes(q, k, v, sel)
    rank = lax.axis_index(cfg.axis_name)
    out0 = as_varying(jnp.zeros((B, L, H, D), F32), axes)
    lse0 = as_varying(jnp.full((B, H, L), -jnp.inf, F32), axes)

    def step(t, kv, acc):
        src = (rank - t) % n
        tiles = _step_tiles(cfg, sel, src)
        # Varying like the operands before the cond: under vmap a batched predicate
        # turns the cond into a select, and a cast inside it would be stale.
        kv_valid = as_varying(cfg.local_valid(src), axes)

        def compute(acc):
            o, l = sparse_fwd(q, kv[0], kv[1], tiles, kv_valid, tile_size=T, scale=cfg.scale,
                              implementation=cfg.implementation)
            l = jnp.where(is_empty_lse(l), -jnp.inf, l.astype(F32))
            return merge(*acc, o, l)

        return lax.cond(jnp.any(tiles >= 0), compute, lambda acc: acc, acc)

    def body(t, carry):
        kv, acc = carry
        nxt = _hop(kv, cfg, deps=(kv, q, sel))  # first: independent of this step's compute
        return nxt, step(t, kv, acc)

    kv, acc = (k, v), (out0, lse0)
    if n > 1:
        kv, acc = lax.fori_loop(0, n - 1, body, (kv, acc))
    return step(n - 1, kv, acc)


def fine_backward(cfg: VsaRing, q, k, v, sel, out, lse, dout):
    """`(dq, dk, dv)` float32: the second ring, dK/dV travelling with their block."""
    n, T = cfg.sp_size, cfg.tile_size
    axes = varying_axes(q, k, v, sel, out, lse, dout)
    rank = lax.axis_index(cfg.axis_name)
    lse = jnp.where(lse == -jnp.inf, masked(lse.dtype), lse)  # rows that saw nothing
    zeros_q = as_varying(jnp.zeros(q.shape, F32), axes)
    zeros_kv = as_varying(jnp.zeros(k.shape, F32), axes)

    def grads(t, kv, dq):
        src = (rank - t) % n
        tiles = _step_tiles(cfg, sel, src)
        # Varying like the operands before the cond: under vmap a batched predicate
        # turns the cond into a select, and a cast inside it would be stale.
        kv_valid = as_varying(cfg.local_valid(src), axes)

        def compute(dq):
            gq, gk, gv = sparse_bwd(q, kv[0], kv[1], tiles, kv_valid, out, lse, dout, None,
                                    tile_size=T, scale=cfg.scale, implementation=cfg.implementation)
            return dq + gq.astype(F32), gk.astype(F32), gv.astype(F32)

        return lax.cond(jnp.any(tiles >= 0), compute, lambda dq: (dq, zeros_kv, zeros_kv), dq)

    inputs = (q, sel, out, lse, dout)

    def body(t, carry):
        kv, dkv, dq = carry
        nxt = _hop(kv, cfg, deps=(dkv, inputs))  # after the last dK/dV hop
        dq, gk, gv = grads(t, kv, dq)
        dkv = _hop((dkv[0] + gk, dkv[1] + gv), cfg, deps=nxt)
        return nxt, dkv, dq

    kv, dkv, dq = (k, v), (zeros_kv, zeros_kv), zeros_q
    if n > 1:
        kv, dkv, dq = lax.fori_loop(0, n - 1, body, (kv, dkv, dq))
    dq, gk, gv = grads(n - 1, kv, dq)
    # The last hop brings every block's accumulators home.
    dk, dv = _hop((dkv[0] + gk, dkv[1] + gv), cfg, deps=(kv, inputs))
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fine(cfg: VsaRing, q, k, v, sel):
    out, _ = fine_forward(cfg, q, k, v, sel)
    return out.astype(q.dtype)


def _fine_fwd_rule(cfg, q, k, v, sel):
    out, lse = fine_forward(cfg, q, k, v, sel)
    out = out.astype(q.dtype)
    return out, (q, k, v, sel, out, lse)


def _fine_bwd_rule(cfg, residuals, dout):
    q, k, v, sel, out, lse = residuals
    with jax.named_scope("vidax_vsa_ring_bwd"):
        dq, dk, dv = fine_backward(cfg, q, k, v, sel, out, lse, dout.astype(q.dtype))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_fine.defvjp(_fine_fwd_rule, _fine_bwd_rule)


def ring_vsa(cfg: VsaRing, q, k, v):
    """The ring's part of VSA on this device's block (whole tiles, global tile layout):
    `(out_c, out_fine, q_valid)` for `kernels._vsa.combine`: the coarse output
    `(B, n_local, H, D)` float32, the fine output `(B, L, H, D)` in q's dtype, and the
    real tokens of the block, bool `(L,)`."""
    T = cfg.tile_size
    rank = lax.axis_index(cfg.axis_name)
    axes = varying_axes(q, k, v) | frozenset({cfg.axis_name})
    q, k, v = as_varying((q, k, v), axes)
    valid = cfg.local_valid(rank)
    q_c = tile_means(q, valid, T)
    kv_c = after(jnp.stack([tile_means(k, valid, T), tile_means(v, valid, T)]), (q, k, v))
    kv_all = lax.all_gather(kv_c, cfg.axis_name, axis=2, tiled=True)  # (2, B, n * n_local, K, D)
    out_c, scores = coarse_attention(q_c, kv_all[0], kv_all[1], cfg.gathered_counts(), cfg.scale)
    sel = select_tiles(scores, cfg.topk)
    # The ring's permutes wait for the gather (through `sel`); in the backward the
    # gather's reduce-scatter waits for the ring's gradients (through `after`).
    q_r, k_r, v_r = after((q, k, v), kv_all)
    out = _fine(cfg, q_r, k_r, v_r, sel)
    return out_c, out, valid
