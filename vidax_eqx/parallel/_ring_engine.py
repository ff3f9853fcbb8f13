"""The ring engine: K/V blocks travel a ring of devices while each merges `(out, lse)`.

Every device keeps its queries; the key/value blocks (with their segment ids)
move one hop per step by `jax.lax.ppermute`, so after `n` steps every device has
attended to the whole sequence (a block's positions follow from its rank and the
layout, `_layout.py`, so they need not travel). Each step is one call of
`vidax_eqx.kernels.attention_fwd` on global token positions, and the partial
results are merged in float32 by their log-sum-exp. The backward is a second
ring: K/V travel again, and their dK/dV accumulators travel behind them, one
hop later, so that the transfer overlaps the next step's compute. Which part of
each step's block is computed, if any, is the schedule's (`_schedule.py`).

Communication is the minimum: `n - 1` K/V hops forward; `n - 1` K/V hops and
`n - 1` dK/dV hops backward (the local block's gradients never travel).

This module holds the static configuration (`RingConfig`), the two rings
(`ring_forward`, `ring_backward`), the log-sum-exp `merge`, the custom VJP, and
`ring`: the worker that [`sequence_attention`][] (for [`ring_attention`][]), USP
(`_usp.py`) and `make_ring_attention`'s kernels (`_ring_kernel.py`) call on arguments
checked once (`_request.py`). The joint layout (`_joint.py`) builds on `ring_forward` /
`ring_backward`.
"""

import dataclasses
import functools
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import kernels
from ..kernels.internal import check_request  # what `kernels.attention` would raise, once
from .._order import ppermute as ordered_ppermute
from .._vma import as_varying, varying_axes
from ._keys import below, hide_keys
from ._layout import layout_parts, ring_positions
from ._rank_masks import attention_bwd, attention_fwd, tile_masks
from ._schedule import (
    ALL_VISIBLE,
    branch_slices,
    FULL,
    GENERAL,
    position_free,
    RELATION,
    relation_plan,
    scheduled,
    SKIP,
    tile_plan,
    UNMASKED,
)


F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Static configuration of one ring attention call (hashable)."""

    axis_name: Hashable
    sp_size: int
    layout: str
    causal: bool
    window: tuple[int | None, int | None] | None
    scale: float | None
    logits_soft_cap: float | None
    implementation: Any
    # A `kernels.SlidingTileMask` over the ring's global positions (every step's
    # kernel evaluates it at the step's positions), or None.
    tile_mask: Any = None

    def kernel_options(self) -> dict:
        """The options of every step's kernel call, but `mask=` (see `_block_mask`)."""
        return dict(
            causal=self.causal,
            window=self.window,
            scale=self.scale,
            logits_soft_cap=self.logits_soft_cap,
            implementation=self.implementation,
        )


# A step mask (`step_mask=` of `ring_forward`, `ring_backward` and `_ring`) adds
# an arbitrary boolean mask on global positions to the `causal` / `window` of the
# `RingConfig` (the two are ANDed). It is a PyTree (its arrays travel through the
# custom VJP as operands, its structure is static) with two methods:
#
# - `plan()`: the `(n, n)` `BRANCHES` table of this ring (as `_schedule._plan`),
#   for the whole mask, where an index offset by `UNMASKED` marks a step whose
#   computed block the mask does not hide at all (it runs without `mask=`): NumPy
#   when decided at trace time, or a traced int array (a mask that is data), in
#   which case every branch of the layout is traced;
# - `block(q_pos, kv_pos)`: bool `(len(q_pos), len(kv_pos))`, the mask over those
#   global positions, passed to the kernel as `mask=`. Forward and backward steps
#   call it with the same positions, so each backward step sees exactly the mask
#   block of the forward step it mirrors.


def _step_plan(cfg: "RingConfig", L_q: int, L_k: int, step_mask):
    """`(plan, branches)` of this ring for `scheduled`."""
    if step_mask is None and cfg.tile_mask is not None:
        return tile_plan(cfg.tile_mask, cfg.layout, cfg.sp_size, L_q, L_k, cfg.causal, cfg.window), None
    if step_mask is None:
        return relation_plan(cfg.layout, cfg.sp_size, L_q, L_k, cfg.causal, cfg.window), None
    plan = step_mask.plan()
    if isinstance(plan, np.ndarray):
        return plan, None
    computed = range(1, UNMASKED) if layout_parts(cfg.layout) == 2 else (FULL,)
    return plan, (SKIP, *computed, *(i + UNMASKED for i in computed))


def _block_mask(cfg: "RingConfig", step_mask, index: int, q_pos, kv_pos):
    """The `mask=` of a step's kernel: its block of the step mask, or the ring's
    sliding tile mask (evaluated by the kernel at the step's positions)."""
    if step_mask is None:
        return cfg.tile_mask
    if index >= UNMASKED:
        return None
    return step_mask.block(q_pos, kv_pos)


def _step_kernel_options(cfg: "RingConfig", index: int, q_pos, kv_pos) -> dict:
    """The kernel options of a step with plan entry `index`: positions only where
    its relation needs them."""
    relation = index // RELATION
    options = cfg.kernel_options()
    if relation == ALL_VISIBLE:
        options.update(causal=False, window=None)
    elif relation == GENERAL:
        options.update(q_positions=q_pos, kv_positions=kv_pos)
    return options


def segments(segment_ids):
    """`(seg_q, seg_kv)` int32 from `segment_ids` (one array for both, `SegmentIds`, or
    `None`: `(None, None)`)."""
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, kernels.SegmentIds):
        return jnp.asarray(segment_ids.q, jnp.int32), jnp.asarray(segment_ids.kv, jnp.int32)
    seg = jnp.asarray(segment_ids, jnp.int32)
    return seg, seg


def seg_arg(seg_q, seg_kv):
    """The kernels' `segment_ids=` of `(seg_q, seg_kv)` (both `None`: `None`)."""
    return None if seg_q is None else kernels.SegmentIds(q=seg_q, kv=seg_kv)


def _ppermute(x, cfg: RingConfig, *, deps=()):
    """`x` (a PyTree) one hop along the ring, after `deps` (see `vidax_eqx._order`).

    Arrays of one shape, dtype and varying axes (K and V; dK and dV) travel stacked
    in one collective-permute; any further group waits for the one before it, so
    every device issues the same permutes in the same order.
    """
    n = cfg.sp_size
    perm = tuple((i, (i + 1) % n) for i in range(n))
    leaves, treedef = jax.tree.flatten(x)
    groups: dict = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault((leaf.shape, leaf.dtype, varying_axes(leaf)), []).append(i)
    out = [None] * len(leaves)
    last = deps
    for idx in groups.values():
        last = ordered_ppermute(jnp.stack([leaves[i] for i in idx]), cfg.axis_name, perm,
                                deps=last)
        for j, i in enumerate(idx):
            out[i] = last[j]
    return jax.tree.unflatten(treedef, out)


def merge(out_acc, lse_acc, out, lse):
    """Merges two partial softmax results by their log-sum-exp, in float32.

    `out (B, S, H, D)`, `lse (B, H, S)`; a side with `lse = -inf` contributes
    nothing, and two such sides give `(0, -inf)`, never NaN.
    """
    lse = lse.astype(F32)
    m = jnp.maximum(lse_acc, lse)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    w_acc, w = jnp.exp(lse_acc - m_safe), jnp.exp(lse - m_safe)
    total = w_acc + w
    lse_new = jnp.where(total == 0.0, -jnp.inf, m_safe + jnp.log(jnp.where(total == 0.0, 1.0, total)))
    inv = jnp.where(total == 0.0, 0.0, 1.0 / jnp.where(total == 0.0, 1.0, total))
    a = jnp.swapaxes(w_acc * inv, 1, 2)[..., None]  # (B, S, H, 1)
    b = jnp.swapaxes(w * inv, 1, 2)[..., None]
    return a * out_acc + b * out.astype(F32), lse_new


def ring_forward(cfg: RingConfig, q, k, v, sinks, seg_q, seg_kv, step_mask=None):
    """`(out float32, lse)` of the whole ring, merged over all steps (`step_mask`:
    see `_step_plan`)."""
    n, parts = cfg.sp_size, layout_parts(cfg.layout)
    B, L_q, H, D = q.shape
    L_k = k.shape[1]
    axes = varying_axes(q)
    rank = lax.axis_index(cfg.axis_name)
    q_pos = ring_positions(L_q, n, rank, cfg.layout)
    plan, branches = _step_plan(cfg, L_q, L_k, step_mask)
    out0 = as_varying(jnp.zeros((B, L_q, H, D), F32), axes)
    if sinks is None:
        lse0 = as_varying(jnp.full((B, H, L_q), -jnp.inf, F32), axes)
    else:  # the sink enters once, as the starting point of the merge
        lse0 = jnp.broadcast_to(sinks.astype(F32)[None, :, None], (B, H, L_q))

    def compute(index, acc, blk, kv_pos):
        out_acc, lse_acc = acc
        k_blk, v_blk, seg_blk = blk
        qs, ks = branch_slices(index, parts, L_q, L_k)
        out, lse = attention_fwd(
            q[:, qs], k_blk[:, ks], v_blk[:, ks],
            segment_ids=seg_arg(None if seg_q is None else seg_q[:, qs],
                                 None if seg_blk is None else seg_blk[:, ks]),
            mask=_block_mask(cfg, step_mask, index, q_pos[qs], kv_pos[ks]),
            **_step_kernel_options(cfg, index, q_pos[qs], kv_pos[ks]),
        )
        o, l = merge(out_acc[:, qs], lse_acc[:, :, qs], out, lse)
        if qs == slice(None):
            return o, l
        return out_acc.at[:, qs].set(o), lse_acc.at[:, :, qs].set(l)

    def step(t, steps, blk, acc):
        """Step `t` (traced, or static) of the static `steps`."""
        kv_pos = ring_positions(L_k, n, (rank - t) % n, cfg.layout)
        compute_t = lambda index, acc, blk: compute(index, acc, blk, kv_pos)
        skip = lambda acc, blk: acc
        return scheduled(plan, rank, t, steps, compute_t, skip, acc, blk, branches=branches)

    def body(t, carry):
        blk, acc = carry
        nxt = _ppermute(blk, cfg, deps=inputs)  # first: independent of this step's compute
        return nxt, step(t, range(n - 1), blk, acc)

    blk, acc = (k, v, seg_kv), (out0, lse0)
    inputs = (q, sinks, seg_q, step_mask)
    if n > 1:
        blk, acc = lax.fori_loop(0, n - 1, body, (blk, acc))
    return step(n - 1, [n - 1], blk, acc)


def ring_backward(cfg: RingConfig, q, k, v, seg_q, seg_kv, out, lse, dout, step_mask=None):
    """`(dq, dk, dv)` float32: the second ring, dK/dV travelling behind K/V."""
    n, parts = cfg.sp_size, layout_parts(cfg.layout)
    B, L_q, H, D = q.shape
    L_k = k.shape[1]
    axes = varying_axes(q)
    rank = lax.axis_index(cfg.axis_name)
    q_pos = ring_positions(L_q, n, rank, cfg.layout)
    plan, branches = _step_plan(cfg, L_q, L_k, step_mask)
    zeros_q = as_varying(jnp.zeros(q.shape, F32), axes)
    zeros_kv = as_varying(jnp.zeros(k.shape, F32), axes)

    def compute(index, dq_acc, blk, kv_pos):
        k_blk, v_blk, seg_blk = blk
        qs, ks = branch_slices(index, parts, L_q, L_k)
        dq, dk, dv, _, _ = attention_bwd(
            q[:, qs], k_blk[:, ks], v_blk[:, ks], out[:, qs], lse[:, :, qs], dout[:, qs],
            segment_ids=seg_arg(None if seg_q is None else seg_q[:, qs],
                                 None if seg_blk is None else seg_blk[:, ks]),
            mask=_block_mask(cfg, step_mask, index, q_pos[qs], kv_pos[ks]),
            **_step_kernel_options(cfg, index, q_pos[qs], kv_pos[ks]),
        )
        dq, dk, dv = dq.astype(F32), dk.astype(F32), dv.astype(F32)
        dq_acc = dq_acc + dq if qs == slice(None) else dq_acc.at[:, qs].add(dq)
        if ks != slice(None):
            dk, dv = zeros_kv.at[:, ks].set(dk), zeros_kv.at[:, ks].set(dv)
        return dq_acc, dk, dv

    def grads(t, steps, blk, dq_acc):
        """Step `t` of the static `steps`: its dq added to `dq_acc`, and the
        block's fresh dk, dv (added to the travelling accumulators by the caller,
        so that this compute does not wait for their transfer)."""
        kv_pos = ring_positions(L_k, n, (rank - t) % n, cfg.layout)
        compute_t = lambda index, dq_acc, blk: compute(index, dq_acc, blk, kv_pos)
        skip = lambda dq_acc, blk: (dq_acc, zeros_kv, zeros_kv)
        return scheduled(plan, rank, t, steps, compute_t, skip, dq_acc, blk, branches=branches)

    blk = (k, v, seg_kv)
    if n == 1:
        return grads(0, [0], blk, zeros_q)
    # Every permute waits for the one issued before it (`_ppermute`'s `deps`), the
    # first for every input, so all devices issue them in one order.
    # Step 0: the local block; its dK/dV stay home.
    nxt = _ppermute(blk, cfg, deps=(q, out, lse, dout, seg_q, step_mask))
    dq, dk_home, dv_home = grads(0, [0], blk, zeros_q)
    blk = nxt
    # Step 1: the first travelling accumulators start here (nothing to receive).
    if n > 2:
        nxt = _ppermute(blk, cfg)
    dq, dk, dv = grads(1, [1], blk, dq)

    def body(t, carry):
        blk, dk, dv, dq = carry
        nxt = _ppermute(blk, cfg, deps=(dk, dv))  # after the last step's dK/dV hop
        dk, dv = _ppermute((dk, dv), cfg, deps=nxt)  # in flight during this step's compute
        dq, gk, gv = grads(t, range(2, n - 1), blk, dq)
        return nxt, dk + gk, dv + gv, dq

    if n > 2:
        blk = nxt
        if n > 3:
            blk, dk, dv, dq = lax.fori_loop(2, n - 1, body, (blk, dk, dv, dq))
        # Last step: no K/V to send on.
        rk, rv = _ppermute((dk, dv), cfg, deps=blk)
        dq, gk, gv = grads(n - 1, [n - 1], blk, dq)
        dk, dv = rk + gk, rv + gv
    # One more hop brings each block's accumulators home.
    dk, dv = _ppermute((dk, dv), cfg, deps=blk)
    return dq, dk_home + dk, dv_home + dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: RingConfig, q, k, v, sinks, seg_q, seg_kv, step_mask):
    out, _ = ring_forward(cfg, q, k, v, sinks, seg_q, seg_kv, step_mask)
    return out.astype(q.dtype)


def _ring_fwd_rule(cfg, q, k, v, sinks, seg_q, seg_kv, step_mask):
    out, lse = ring_forward(cfg, q, k, v, sinks, seg_q, seg_kv, step_mask)
    out = out.astype(q.dtype)
    return out, (q, k, v, sinks, seg_q, seg_kv, step_mask, out, lse)


def _ring_bwd_rule(cfg, residuals, dout):
    q, k, v, sinks, seg_q, seg_kv, step_mask, out, lse = residuals
    dout = dout.astype(q.dtype)
    with jax.named_scope("vidax_ring_attention_bwd"):
        dq, dk, dv = ring_backward(cfg, q, k, v, seg_q, seg_kv, out, lse, dout, step_mask)
    dsinks = None
    if sinks is not None:
        # This device's rows only: `sinks` entered the custom_vjp already cast to
        # vary over the ring, so the transpose of that cast sums the devices.
        delta = jnp.einsum("bshd,bshd->bhs", dout.astype(F32), out.astype(F32))
        p_sink = jnp.exp(sinks.astype(F32)[None, :, None] - lse)
        dsinks = (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dsinks, None, None, None


_ring.defvjp(_ring_fwd_rule, _ring_bwd_rule)


def ring(
    q, k, v, *, axis_name, sp_size: int, causal, segment_ids, sinks, window, scale,
    logits_soft_cap, layout, implementation, step_mask=None, tile_mask=None, kv_lengths=None,
):
    """The ring worker of [`sequence_attention`][] (and of USP, and of
    `make_ring_attention`'s kernels), on checked arguments (`_request.check_ring`):
    `sp_size` the size of `axis_name`, `sinks` an array or `None`. `step_mask(sp_size,
    L)`, when given, builds the step mask of this call (see `_step_plan`);
    `make_ring_attention`'s kernels use it. `tile_mask`: a `SlidingTileMask` over the
    global positions (or `RankMasks`), given to every step's kernel. `kv_lengths`: int32
    `(B,)`, key-only padding of the keys at a global index (their ring position)
    `>= kv_lengths[b]`.

    What it asks of the kernel: that the implementation serves every step's call, with
    positions where the steps pass them (an explicit implementation that cannot raises
    here, naming the feature)."""
    n = sp_size
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    L_q, L_k = q.shape[1], k.shape[1]
    seg_q, seg_kv = segments(segment_ids)
    if kv_lengths is not None:  # key-only padding: those keys' ids -1 (`_keys.py`)
        index = ring_positions(L_k, n, lax.axis_index(axis_name), layout)
        seg_q, seg_kv = hide_keys(seg_q, seg_kv, below(kv_lengths, index), L_q)
    # Steps pass positions to their kernel unless the static plan shows that none
    # needs them (see `relation_plan`): then a kernel without positions serves.
    positions = step_mask is not None or tile_mask is not None or not position_free(
        relation_plan(layout, n, L_q, L_k, bool(causal), None if window is None else tuple(window))
    )
    check_request(
        q, k, v, segment_ids=seg_arg(seg_q, seg_kv),
        q_positions=jnp.arange(L_q, dtype=jnp.int32) if positions else None,
        kv_positions=jnp.arange(L_k, dtype=jnp.int32) if positions else None,
        causal=causal, window=window, scale=scale, logits_soft_cap=logits_soft_cap,
        # A step mask reaches every kernel call as `mask=`: the kernel must serve it.
        mask=tile_masks(tile_mask)[0] if step_mask is None else jnp.ones((1, 1), bool),
        implementation=implementation,
        needs_lse=True,
    )
    cfg = RingConfig(
        axis_name=axis_name,
        sp_size=n,
        layout=layout,
        causal=bool(causal),
        window=None if window is None else tuple(window),
        scale=None if scale is None else float(scale),
        logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        implementation=implementation,
        tile_mask=tile_mask,
    )
    # Everything that meets inside the ring varies along the same axes; a replicated
    # input (sinks, usually) is cast here, so its gradient is summed over devices.
    axes = varying_axes(q, k, v) | frozenset({axis_name})
    q, k, v, sinks, seg_q, seg_kv = as_varying((q, k, v, sinks, seg_q, seg_kv), axes)
    if step_mask is not None:
        step_mask = step_mask(n, L_q)
    with jax.named_scope("vidax_ring_attention"):
        return _ring(cfg, q, k, v, sinks, seg_q, seg_kv, step_mask)
