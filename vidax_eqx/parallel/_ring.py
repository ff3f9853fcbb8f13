"""Ring attention: K/V blocks travel a ring of devices while each merges `(out, lse)`.

Every device keeps its queries; the key/value blocks (with their segment ids)
move one hop per step by `jax.lax.ppermute`, so after `n` steps every device has
attended to the whole sequence (a block's positions follow from its rank and the
layout, so they need not travel). Each step is one call of
`vidax_eqx.kernels.attention_fwd` on global token positions, and the partial
results are merged in float32 by their log-sum-exp. The backward is a second
ring: K/V travel again, and their dK/dV accumulators travel behind them, one
hop later, so that the transfer overlaps the next step's compute.

Steps whose block the mask hides entirely are skipped (`lax.switch`), not
computed and masked. Token positions are a static function of (rank, step),
so which blocks the causal mask or window hides is tabulated at trace time
(`_plan`); tiles that segment ids hide are skipped inside the blockwise
kernel. In the `"zigzag"` layout each local block is two chunks of the global
sequence (`r` and `2n - 1 - r`) and the skip works per chunk: every causal step
after the first computes exactly half a block, on every device, so the work is
balanced ([`ring_work`][] reports it).

Communication is the minimum: `n - 1` K/V hops forward; `n - 1` K/V hops and
`n - 1` dK/dV hops backward (the local block's gradients never travel).

The joint (CogVideoX) layout (`text_len > 0`: a replicated text prefix before
each device's visual chunk) runs this ring for the visual tokens and the text
blocks locally, in `_joint.py`; the text K/V never travel.
"""

import dataclasses
import functools
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from .. import kernels
from ..kernels._api import check_request  # what `kernels.attention` would raise, once
from ..kernels._tile import chunk_table
from .._order import ppermute as ordered_ppermute
from .._vma import as_varying, varying_axes
from ._mesh import axis_size, check_sharded
from ._ulysses import _static_int
from ._rank_masks import attention_bwd, attention_fwd, RankMasks, tile_masks as _tile_masks, with_rank_mask as _with_mask


F32 = jnp.float32
LAYOUTS = ("contiguous", "zigzag")


# -- layouts ------------------------------------------------------------------------


def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(
            f"`layout` must be one of {LAYOUTS}; received {layout!r}."
        )
    return layout


def _check_sp_size(sp_size) -> int:
    if isinstance(sp_size, bool) or not isinstance(sp_size, (int, np.integer)) or sp_size < 1:
        raise ValueError(f"`sp_size` must be a positive int; received {sp_size!r}.")
    return int(sp_size)


def _check_zigzag_length(length: int, what: str, fix: str) -> None:
    if length % 2:
        raise ValueError(
            f"the zigzag layout needs an even {what} (each device holds two half-chunks); "
            f"received {length}. {fix}"
        )


def check_sinks(fn: str, sinks, H: int):
    """`sinks` as an array, or a `ValueError` unless it is float `(H,)` (or `None`)."""
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)
    if sinks.shape != (H,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(
            f"{fn}: `sinks` must be a float array of shape (H,) = ({H},), one logit per "
            f"query head; received shape {sinks.shape}, dtype {sinks.dtype}."
        )
    return sinks


def ring_positions(
    length: int, sp_size: int, rank, layout: str = "contiguous"
) -> Int[Array, " length"]:
    """The global token positions of one rank's local block, for a sequence layout.

    **Arguments:**

    - `length`: the local (per-device) sequence length `L`.
    - `sp_size`: the number of devices `n` on the ring.
    - `rank`: the device's index on the ring, an int or a traced scalar
        (`jax.lax.axis_index(axis_name)`).
    - `layout`: `"contiguous"`: rank `r` holds global tokens `[r * L, (r + 1) * L)`.
        `"zigzag"`: the global sequence is cut into `2n` chunks of `L / 2`, and rank
        `r` holds chunks `r` and `2n - 1 - r` (`L` must be even); see
        [`zigzag_permute`][].

    **Returns:**

    int32 `(L,)`.
    """
    _check_layout(layout)
    n = _check_sp_size(sp_size)
    if layout == "zigzag":
        _check_zigzag_length(length, "local length", "Pad the sequence to a multiple of 2 * sp_size.")
    return _positions(jnp, length, n, rank, layout)


def _positions(xp, length: int, n: int, rank, layout: str):
    """`ring_positions` in `xp` (`jnp`, or `np` for a static rank), unchecked."""
    if layout == "contiguous":
        return rank * length + xp.arange(length, dtype=xp.int32)
    c = length // 2
    local = xp.arange(c, dtype=xp.int32)
    return xp.concatenate([rank * c + local, (2 * n - 1 - rank) * c + local])


def _zigzag_order(sp_size: int) -> np.ndarray:
    """Chunk order of the zigzag layout: `[0, 2n-1, 1, 2n-2, ...]`."""
    n = sp_size
    return np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1).reshape(-1)


def _permute_chunks(x, axis: int, sp_size: int, order: np.ndarray, name: str):
    n = _check_sp_size(sp_size)
    x = jnp.asarray(x)
    axis = axis % x.ndim
    size = x.shape[axis]
    if size % (2 * n):
        raise ValueError(
            f"`{name}` needs axis {axis} to split into 2 * sp_size = {2 * n} equal chunks; "
            f"received size {size}. Pad it first (pad_to_multiple(x, {2 * n}, axis={axis}), "
            "with padding_segment_ids to keep the padding invisible)."
        )
    c = size // (2 * n)
    chunks = x.reshape(*x.shape[:axis], 2 * n, c, *x.shape[axis + 1 :])
    chunks = jnp.take(chunks, jnp.asarray(order), axis=axis)
    return chunks.reshape(x.shape)


def zigzag_permute(x: Array, axis: int, sp_size: int) -> Array:
    """Reorders a sequence into the zigzag layout of [`ring_attention`][].

    The sequence axis is cut into `2 * sp_size` equal chunks and reordered as
    `[0, 2n-1, 1, 2n-2, ..., n-1, n]`, so that the contiguous sharding of the result
    over `sp_size` devices (`PartitionSpec` on that axis) gives rank `r` the chunks
    `r` and `2n - 1 - r`: an early and a late part of the sequence, which balances
    causal attention's work across devices.

    **Arguments:**

    - `x`: the full (global) array.
    - `axis`: the sequence axis.
    - `sp_size`: the number of devices on the ring.

    **Returns:**

    `x` with the sequence axis permuted. Its length must be a multiple of
    `2 * sp_size` (pad first with `pad_to_multiple`). Undo with
    [`zigzag_unpermute`][]. Apply the same permutation to everything indexed by
    sequence position (q, k, v, segment ids); positions are implied by the layout.
    """
    return _permute_chunks(x, axis, sp_size, _zigzag_order(sp_size), "zigzag_permute")


def zigzag_unpermute(x: Array, axis: int, sp_size: int) -> Array:
    """The inverse of [`zigzag_permute`][]: zigzag layout -> global sequence order.

    **Arguments:**

    - `x`: an array in the zigzag layout (e.g. the gathered output of
        `ring_attention(..., layout="zigzag")`).
    - `axis`: the sequence axis.
    - `sp_size`: the number of devices on the ring.

    **Returns:**

    `x` in global sequence order.
    """
    inverse = np.argsort(_zigzag_order(sp_size))
    return _permute_chunks(x, axis, sp_size, inverse, "zigzag_unpermute")


# -- the schedule: which part of each step's block is computed ----------------------
#
# Positions are a static function of (rank, step), so which (part of a) block the
# causal mask or window hides is decided at trace time for every device and step:
# `_plan` is an `(n, n)` table of `_BRANCHES` indices. Inside the ring a device
# looks up its row with its traced rank.


def _parts(layout: str) -> int:
    """Chunks per local block: the granularity of the ring-level skip."""
    return 2 if layout == "zigzag" else 1


def _part_slices(length: int, parts: int) -> list[slice]:
    c = length // parts
    return [slice(i * c, (i + 1) * c) for i in range(parts)]


# A step computes one of these (query part, key part) pairs, `None` = all parts.
# Index 0 is "skip". With one part per block only the first two occur.
_BRANCHES: tuple[tuple[int | None, int | None] | None, ...] = (
    None,  # nothing visible: skip
    (None, None),  # the whole block
    (None, 0),  # every query against the first key chunk
    (None, 1),  # every query against the second key chunk
    (1, None),  # the second query chunk against every key
    (0, None),  # the first query chunk against every key
)
_SKIP, _FULL = 0, 1
# A step mask's plan (see `_step_plan`) may add `_UNMASKED` to a branch index: the
# mask hides nothing in that step's block, so the kernel runs without `mask=`.
_UNMASKED = len(_BRANCHES)


def _may_see(causal: bool, window, q_pos: np.ndarray, kv_pos: np.ndarray) -> bool:
    """Whether some query at `q_pos` may see some key at `kv_pos` under the causal
    mask and window (from the position ranges; exact for contiguous ranges)."""
    # Python ints: no int32 overflow for windows up to 2**31 - 1.
    q_lo, q_hi, k_lo, k_hi = (int(x) for x in (q_pos.min(), q_pos.max(), kv_pos.min(), kv_pos.max()))
    ok = not causal or k_lo <= q_hi
    if window is not None:
        left, right = window
        ok = ok and (left is None or k_hi >= q_lo - left)
        ok = ok and (right is None or k_lo <= q_hi + right)
    return bool(ok)


def _choose(visible: list[list[bool]]) -> int:
    """The `_BRANCHES` index for a `parts x parts` table: `visible[a][b]` is
    whether query part `a` may see key part `b`. Prefers the smallest block that
    covers every visible pair."""
    if not any(x for row in visible for x in row):
        return _SKIP
    if len(visible) == 1:
        return _FULL
    (v00, v01), (v10, v11) = visible
    if not (v01 or v11):
        return 2
    if not (v00 or v10):
        return 3
    if not (v00 or v01):
        return 4
    if not (v10 or v11):
        return 5
    return _FULL


@functools.lru_cache(maxsize=256)
def _plan(layout: str, n: int, L_q: int, L_k: int, causal: bool, window) -> np.ndarray:
    """int `(n, n)`: the `_BRANCHES` index of device `r` at step `t` (holding the
    key/value block of rank `(r - t) mod n`)."""
    parts = _parts(layout)
    plan = np.full((n, n), _FULL, np.int32)
    if not causal and window is None:
        return plan
    for r in range(n):
        q_pos = _positions(np, L_q, n, r, layout)
        for t in range(n):
            kv_pos = _positions(np, L_k, n, (r - t) % n, layout)
            visible = [
                [_may_see(causal, window, q_pos[a], kv_pos[b]) for b in _part_slices(L_k, parts)]
                for a in _part_slices(L_q, parts)
            ]
            plan[r, t] = _choose(visible)
    return plan


# How the query and key positions of a step's computed block relate, added to the
# plan index in multiples of `_RELATION` (see `_relation_plan`). The last two let
# the step call its kernel without positions, which the vendor kernels
# (`"pallas_tpu"`, `"pallas_gpu"`) need: the ring runs on them where every
# computed step is one of those (always, for causal or full attention).
_GENERAL, _ALL_VISIBLE, _SAME_POSITIONS = 0, 1, 2
_RELATION = 2 * _UNMASKED


def _relation(causal: bool, window, q_pos: np.ndarray, kv_pos: np.ndarray) -> int:
    """`_ALL_VISIBLE`: causal and window hide no pair (the kernel needs neither);
    `_SAME_POSITIONS`: queries and keys are the same increasing positions, and
    contiguous if there is a window (both then act on indices as on positions)."""
    q_lo, q_hi, k_lo, k_hi = (int(x) for x in (q_pos.min(), q_pos.max(), kv_pos.min(), kv_pos.max()))
    every = not causal or k_hi <= q_lo
    if window is not None:
        left, right = window
        every = every and (left is None or k_lo >= q_hi - left)
        every = every and (right is None or k_hi <= q_lo + right)
    if every:
        return _ALL_VISIBLE
    if np.array_equal(q_pos, kv_pos) and (window is None or np.all(np.diff(q_pos) == 1)):
        return _SAME_POSITIONS
    return _GENERAL


@functools.lru_cache(maxsize=256)
def _relation_plan(layout: str, n: int, L_q: int, L_k: int, causal: bool, window) -> np.ndarray:
    """`_plan` with each computed entry's `_relation` added (times `_RELATION`)."""
    parts = _parts(layout)
    plan = _plan(layout, n, L_q, L_k, causal, window).copy()
    for r in range(n):
        q_pos = _positions(np, L_q, n, r, layout)
        for t in range(n):
            if plan[r, t] == _SKIP:
                continue
            qs, ks = _branch_slices(int(plan[r, t]), parts, L_q, L_k)
            kv_pos = _positions(np, L_k, n, (r - t) % n, layout)
            plan[r, t] += _RELATION * _relation(causal, window, q_pos[qs], kv_pos[ks])
    return plan


@functools.lru_cache(maxsize=64)
def _tile_plan(tile_mask, layout: str, n: int, L_q: int, L_k: int, causal: bool, window) -> np.ndarray:
    """The `_plan` of a ring whose steps also carry a sliding tile mask: a (half-)block
    is skipped when the tile mask, or the causal mask / window, hides it entirely
    (decided per chunk of global positions, exactly: `kernels._tile.chunk_table`).
    Every computed step passes positions to its kernel."""
    parts = _parts(layout)
    cq, ck = L_q // parts, L_k // parts
    chunks = np.arange(n * parts)
    table = np.zeros((n * parts, n * parts), bool)
    for mask in _tile_masks(tile_mask):  # RankMasks: a step is computed if any rank needs it
        table |= chunk_table(mask, chunks * cq, cq, chunks * ck, ck)
    if causal or window is not None:
        q_pos = [np.arange(a * cq, (a + 1) * cq) for a in chunks]
        kv_pos = [np.arange(b * ck, (b + 1) * ck) for b in chunks]
        table &= np.array([[_may_see(causal, window, q, kv) for kv in kv_pos] for q in q_pos])
    return _plan_from_table(layout, n, table, np)


def _position_free(plan) -> bool:
    """Whether every computed step of a (static) plan can run without positions."""
    if not isinstance(plan, np.ndarray):
        return False
    computed = plan[plan != _SKIP]
    return bool(np.all(computed // _RELATION != _GENERAL))


def _branch_slices(index: int, parts: int, length_q: int, length_k: int) -> tuple[slice, slice]:
    a, b = _BRANCHES[index % _UNMASKED]
    full = slice(None)
    qs = full if a is None else _part_slices(length_q, parts)[a]
    ks = full if b is None else _part_slices(length_k, parts)[b]
    return qs, ks


def _scheduled(plan, rank, t, steps, compute, skip, *operands, branches=None):
    """Runs step `t` of the ring on this device: `compute(index, *operands)` for
    its `plan` entry, or `skip(*operands)`.

    `steps` are the static step numbers this code serves (one for a peeled step,
    a range for a loop body), so only the branches that occur in them are traced.
    A traced `plan` (a mask that is data, see `_step_plan`) cannot be read at
    trace time: then every index in `branches` is traced.

    Segment ids do not steer this choice: under `jax.vmap` a segment-derived
    index would be batched, and JAX lowers a batched `switch` to a `select` that
    breaks the varying-axes typing of the branches inside `shard_map`. Tiles that
    segment ids hide are still skipped inside the blockwise kernel.
    """
    if isinstance(plan, np.ndarray):
        used = sorted({int(i) for i in np.unique(plan[:, list(steps)])})
    else:
        used = sorted(branches)
    if len(used) == 1:
        return skip(*operands) if used[0] == _SKIP else compute(used[0], *operands)
    index = jnp.asarray(plan)[rank, t]
    remap = np.zeros(3 * _RELATION, np.int32)
    remap[used] = np.arange(len(used))
    fns = [skip if i == _SKIP else functools.partial(compute, i) for i in used]
    return lax.switch(jnp.asarray(remap)[index], fns, *operands)


def _choose_table(visible, xp):
    """`_choose` for a whole table: `visible (..., parts, parts)` bool, in `xp`
    (`np`, or `jnp` for a traced table) -> int32 `(...)` `_BRANCHES` indices."""
    any_visible = visible.any(axis=(-2, -1))
    if visible.shape[-1] == 1:
        return xp.where(any_visible, _FULL, _SKIP).astype(xp.int32)
    v00, v01 = visible[..., 0, 0], visible[..., 0, 1]
    v10, v11 = visible[..., 1, 0], visible[..., 1, 1]
    index = xp.full(any_visible.shape, _FULL, xp.int32)
    # In reverse order of `_choose`'s tests, so that its first match wins.
    for branch, hidden in ((5, ~(v10 | v11)), (4, ~(v00 | v01)), (3, ~(v00 | v10)), (2, ~(v01 | v11))):
        index = xp.where(hidden, branch, index)
    return xp.where(any_visible, index, _SKIP).astype(xp.int32)


def _plan_from_table(layout: str, n: int, table, xp, full_table=None):
    """int32 `(n, n)` plan (as `_plan`) from chunk visibility tables.

    `table (n * parts, n * parts)` bool (NumPy, or a traced array with `xp=jnp`):
    `table[a, b]` says whether some query of global chunk `a` may see some key of
    global chunk `b`, chunks being `L / parts` consecutive global positions.
    `full_table`, the same shape, says whether every query of chunk `a` sees every
    key of chunk `b`; where that holds for the whole part of the block a step
    computes, its index is offset by `_UNMASKED`.
    """
    parts = _parts(layout)
    ranks = np.arange(n)
    # The global chunks of each rank's block, in local order.
    chunks = ranks[:, None] if parts == 1 else np.stack([ranks, 2 * n - 1 - ranks], axis=1)
    held = (ranks[:, None] - ranks[None, :]) % n  # rank whose K/V device r holds at step t
    pairs = (chunks[:, None, :, None], chunks[held][:, :, None, :])
    plan = _choose_table(table[pairs], xp)
    if full_table is None:
        return plan
    full = full_table[pairs]  # (n, n, parts, parts)
    unmasked = xp.zeros(plan.shape, bool)
    for index in range(1, _UNMASKED) if parts == 2 else (_FULL,):
        a, b = _BRANCHES[index]
        region = np.zeros((parts, parts), bool)
        region[slice(None) if a is None else a, slice(None) if b is None else b] = True
        covered = (full | ~region).all(axis=(-2, -1))
        unmasked = unmasked | ((plan == index) & covered)
    return xp.where(unmasked, plan + _UNMASKED, plan).astype(xp.int32)


def _work(plan: np.ndarray, layout: str, n: int, L: int) -> np.ndarray:
    """Per-device (query, key) pairs a static `plan` hands to the kernel."""
    parts = _parts(layout)
    work = np.zeros(n, np.int64)
    for r in range(n):
        for t in range(n):
            if plan[r, t] != _SKIP:
                qs, ks = _branch_slices(int(plan[r, t]), parts, L, L)
                work[r] += len(range(L)[qs]) * len(range(L)[ks])
    return work


def ring_work(
    seq_len: int,
    sp_size: int,
    *,
    layout: str = "contiguous",
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
) -> np.ndarray:
    """Per-device work of [`ring_attention`][]'s forward, as the ring schedules it.

    Counts, for each device, the (query, key) pairs of the blocks handed to the
    attention kernel over all ring steps, after the ring-level skipping of hidden
    blocks (and, in the zigzag layout, hidden half-blocks), with the same decision
    code the ring runs. The kernel may skip further tiles inside a block. The
    backward schedules the same blocks.

    **Arguments:**

    - `seq_len`: the global sequence length (a multiple of `sp_size`, and of
        `2 * sp_size` for zigzag).
    - `sp_size`: the number of devices on the ring.
    - `layout`, `causal`, `window`: as in [`ring_attention`][].

    **Returns:**

    int64 NumPy array `(sp_size,)`. Its `max / mean` is the work balance: the
    contiguous causal ring gives `2n / (n + 1)`, the zigzag one 1.
    """
    _check_layout(layout)
    n = _check_sp_size(sp_size)
    if seq_len % n:
        raise ValueError(
            f"`seq_len` must be a multiple of sp_size={n}; received {seq_len}."
        )
    L = seq_len // n
    if layout == "zigzag":
        _check_zigzag_length(L, "local length", f"Use a multiple of 2 * sp_size = {2 * n}.")
    plan = _plan(layout, n, L, L, bool(causal), None if window is None else tuple(window))
    return _work(plan, layout, n, L)


# -- the ring -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
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


# A step mask (`step_mask=` of `_ring_forward`, `_ring_backward` and `_ring`) adds
# an arbitrary boolean mask on global positions to the `causal` / `window` of the
# `_Config` (the two are ANDed). It is a PyTree (its arrays travel through the
# custom VJP as operands, its structure is static) with two methods:
#
# - `plan()`: the `(n, n)` `_BRANCHES` table of this ring (as `_plan`), for the
#   whole mask, where an index offset by `_UNMASKED` marks a step whose computed
#   block the mask does not hide at all (it runs without `mask=`): NumPy when
#   decided at trace time, or a traced int array (a mask that is data), in which
#   case every branch of the layout is traced;
# - `block(q_pos, kv_pos)`: bool `(len(q_pos), len(kv_pos))`, the mask over those
#   global positions, passed to the kernel as `mask=`. Forward and backward steps
#   call it with the same positions, so each backward step sees exactly the mask
#   block of the forward step it mirrors.


def _step_plan(cfg: "_Config", L_q: int, L_k: int, step_mask):
    """`(plan, branches)` of this ring for `_scheduled`."""
    if step_mask is None and cfg.tile_mask is not None:
        return _tile_plan(cfg.tile_mask, cfg.layout, cfg.sp_size, L_q, L_k, cfg.causal, cfg.window), None
    if step_mask is None:
        return _relation_plan(cfg.layout, cfg.sp_size, L_q, L_k, cfg.causal, cfg.window), None
    plan = step_mask.plan()
    if isinstance(plan, np.ndarray):
        return plan, None
    computed = range(1, _UNMASKED) if _parts(cfg.layout) == 2 else (_FULL,)
    return plan, (_SKIP, *computed, *(i + _UNMASKED for i in computed))


def _block_mask(cfg: "_Config", step_mask, index: int, q_pos, kv_pos):
    """The `mask=` of a step's kernel: its block of the step mask, or the ring's
    sliding tile mask (evaluated by the kernel at the step's positions)."""
    if step_mask is None:
        return cfg.tile_mask
    if index >= _UNMASKED:
        return None
    return step_mask.block(q_pos, kv_pos)


def _step_kernel_options(cfg: "_Config", index: int, q_pos, kv_pos) -> dict:
    """The kernel options of a step with plan entry `index`: positions only where
    its relation needs them."""
    relation = index // _RELATION
    options = cfg.kernel_options()
    if relation == _ALL_VISIBLE:
        options.update(causal=False, window=None)
    elif relation == _GENERAL:
        options.update(q_positions=q_pos, kv_positions=kv_pos)
    return options


def _segments(segment_ids):
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, kernels.SegmentIds):
        return jnp.asarray(segment_ids.q, jnp.int32), jnp.asarray(segment_ids.kv, jnp.int32)
    seg = jnp.asarray(segment_ids, jnp.int32)
    return seg, seg


def _seg_arg(seg_q, seg_kv):
    return None if seg_q is None else kernels.SegmentIds(q=seg_q, kv=seg_kv)


def _ppermute(x, cfg: _Config, *, deps=()):
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


def _merge(out_acc, lse_acc, out, lse):
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


def _ring_forward(cfg: _Config, q, k, v, sinks, seg_q, seg_kv, step_mask=None):
    """`(out float32, lse)` of the whole ring, merged over all steps (`step_mask`:
    see `_step_plan`)."""
    n, parts = cfg.sp_size, _parts(cfg.layout)
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
        qs, ks = _branch_slices(index, parts, L_q, L_k)
        out, lse = attention_fwd(
            q[:, qs], k_blk[:, ks], v_blk[:, ks],
            segment_ids=_seg_arg(None if seg_q is None else seg_q[:, qs],
                                 None if seg_blk is None else seg_blk[:, ks]),
            mask=_block_mask(cfg, step_mask, index, q_pos[qs], kv_pos[ks]),
            **_step_kernel_options(cfg, index, q_pos[qs], kv_pos[ks]),
        )
        o, l = _merge(out_acc[:, qs], lse_acc[:, :, qs], out, lse)
        if qs == slice(None):
            return o, l
        return out_acc.at[:, qs].set(o), lse_acc.at[:, :, qs].set(l)

    def step(t, steps, blk, acc):
        """Step `t` (traced, or static) of the static `steps`."""
        kv_pos = ring_positions(L_k, n, (rank - t) % n, cfg.layout)
        compute_t = lambda index, acc, blk: compute(index, acc, blk, kv_pos)
        skip = lambda acc, blk: acc
        return _scheduled(plan, rank, t, steps, compute_t, skip, acc, blk, branches=branches)

    def body(t, carry):
        blk, acc = carry
        nxt = _ppermute(blk, cfg, deps=inputs)  # first: independent of this step's compute
        return nxt, step(t, range(n - 1), blk, acc)

    blk, acc = (k, v, seg_kv), (out0, lse0)
    inputs = (q, sinks, seg_q, step_mask)
    if n > 1:
        blk, acc = lax.fori_loop(0, n - 1, body, (blk, acc))
    return step(n - 1, [n - 1], blk, acc)


def _ring_backward(cfg: _Config, q, k, v, seg_q, seg_kv, out, lse, dout, step_mask=None):
    """`(dq, dk, dv)` float32: the second ring, dK/dV travelling behind K/V."""
    n, parts = cfg.sp_size, _parts(cfg.layout)
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
        qs, ks = _branch_slices(index, parts, L_q, L_k)
        dq, dk, dv, _, _ = attention_bwd(
            q[:, qs], k_blk[:, ks], v_blk[:, ks], out[:, qs], lse[:, :, qs], dout[:, qs],
            segment_ids=_seg_arg(None if seg_q is None else seg_q[:, qs],
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
        return _scheduled(plan, rank, t, steps, compute_t, skip, dq_acc, blk, branches=branches)

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
def _ring(cfg: _Config, q, k, v, sinks, seg_q, seg_kv, step_mask):
    out, _ = _ring_forward(cfg, q, k, v, sinks, seg_q, seg_kv, step_mask)
    return out.astype(q.dtype)


def _ring_fwd_rule(cfg, q, k, v, sinks, seg_q, seg_kv, step_mask):
    out, lse = _ring_forward(cfg, q, k, v, sinks, seg_q, seg_kv, step_mask)
    out = out.astype(q.dtype)
    return out, (q, k, v, sinks, seg_q, seg_kv, step_mask, out, lse)


def _ring_bwd_rule(cfg, residuals, dout):
    q, k, v, sinks, seg_q, seg_kv, step_mask, out, lse = residuals
    dout = dout.astype(q.dtype)
    with jax.named_scope("vidax_ring_attention_bwd"):
        dq, dk, dv = _ring_backward(cfg, q, k, v, seg_q, seg_kv, out, lse, dout, step_mask)
    dsinks = None
    if sinks is not None:
        # This device's rows only: `sinks` entered the custom_vjp already cast to
        # vary over the ring, so the transpose of that cast sums the devices.
        delta = jnp.einsum("bshd,bshd->bhs", dout.astype(F32), out.astype(F32))
        p_sink = jnp.exp(sinks.astype(F32)[None, :, None] - lse)
        dsinks = (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dsinks, None, None, None


_ring.defvjp(_ring_fwd_rule, _ring_bwd_rule)


def ring_attention(
    q: Float[Array, "B L H D"],
    k: Float[Array, "B L_k H_kv D"],
    v: Float[Array, "B L_k H_kv D"],
    *,
    axis_name: Hashable,
    causal: bool = False,
    segment_ids: kernels.SegmentIds | Int[Array, "B L"] | None = None,
    sinks: Float[Array, " H"] | None = None,
    window: tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    layout: str = "contiguous",
    text_len: int = 0,
    mask: kernels.SlidingTileMask | None = None,
    implementation: str | kernels.AbstractImplementation = "auto",
) -> Float[Array, "B L H D"]:
    """Ring attention over the sequence axis, inside `jax.shard_map`.

    Each device holds a block of the sequence. K/V blocks travel the ring of
    `axis_name` by `ppermute` (the next transfer is issued before the current
    step's kernel, so communication overlaps compute); each step calls
    `vidax_eqx.kernels.attention_fwd` on the global positions of the tokens
    involved and merges the partial `(out, lse)` in float32. Blocks (or, in the
    zigzag layout, half-blocks) that the mask hides entirely are skipped. The
    result equals single-device attention over the whole sequence.

    Differentiable in `q`, `k`, `v` and `sinks` by a `jax.custom_vjp` whose
    backward is a second ring: K/V travel again with their float32 dK/dV
    accumulators and each step calls `vidax_eqx.kernels.attention_bwd` with the
    globally merged `out` and `lse`.

    **Arguments:**

    - `q`: this device's queries `(B, L, H, D)`.
    - `k`, `v`: this device's keys and values `(B, L_k, H_kv, D)`, `H % H_kv == 0`
        (GQA / MQA: they travel with `H_kv` heads).
    - `axis_name`: the mesh axis of the ring.
    - `causal`: a token attends to global positions at or before its own.
    - `segment_ids`: this device's ids, one `(B, L)` array or
        `SegmentIds(q=(B, L), kv=(B, L_k))`; the kv ids travel with their block.
        Negative ids are padding (see `pad_to_multiple` / `padding_segment_ids` for
        sequence lengths that do not divide the number of devices).
    - `sinks`: per-head sink logits `(H,)`, usually replicated (`PartitionSpec()`);
        counted once per row, not once per step. Its gradient is summed over the
        devices.
    - `window`: `(left, right)` sliding window on global positions.
    - `scale`: logit scale, default `1 / sqrt(D)`.
    - `logits_soft_cap`: `c` applies `c * tanh(s / c)` to the scaled logits.
    - `layout`: how the global sequence is laid out over the devices (see
        [`ring_positions`][]). `"contiguous"`: rank `r` holds the `r`-th block.
        `"zigzag"`: rank `r` holds chunks `r` and `2n - 1 - r` of `2n` (`L` even);
        permute the global sequence with [`zigzag_permute`][] before sharding and
        undo with [`zigzag_unpermute`][]. Zigzag balances causal work.
    - `text_len`: the joint (CogVideoX) layout when `> 0`: each device's `q`, `k`,
        `v` are `(B, text_len + L, H(_kv), D)`, `[text prefix (text_len tokens, the
        same on every device); this device's chunk of the visual sequence]`, and
        the visual sequence alone is sharded over `axis_name` (and, for zigzag,
        permuted with `zigzag_permute(visual, 1, n)`; the text is not). The result
        equals single-device attention over `[text; visual]`, text at positions
        `0 .. text_len - 1` and visual tokens after it (so `causal=True` lets the
        text see no visual token). `segment_ids` follow the same per-device layout,
        `(B, text_len + L)`. Self-attention only: `k`, `v` have `q`'s length.
        `text_len == q.shape[1]` (no visual tokens) is local attention over the
        text. `0` (the default) is plain ring attention.
    - `mask`: a [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask] (sliding
        tile attention) over the global sequence, evaluated at each step's global
        positions; ANDed with `causal`, `window` and segment ids. The global
        sequence (`sp_size x L`, in global order before any `zigzag_permute`) is
        the mask's `seq_len` tokens, padded at the end by fewer than one tile per
        chunk (the padding is invisible). Steps (zigzag: half-blocks) it hides
        entirely are skipped, and each step's kernel skips the hidden tiles; give
        each device whole tiles (a local length, or zigzag half-length, that is a
        multiple of the tile size, and a text prefix in the joint layout, not in the
        ring) so that kernel blocks are whole tiles. In the joint layout
        (`text_len > 0`) the mask's `text_len` must equal it (`"prefix"`), and the
        visual sequence is its video tokens.
    - `implementation`: the kernel implementation of each step, as in
        `vidax_eqx.kernels.attention`.

    **Returns:**

    This device's output `(B, L, H, D)` in `q`'s dtype (`(B, text_len + L, H, D)`
    in the joint layout, its first `text_len` rows the text output, bitwise
    identical on every device). A row that sees nothing gives 0.

    **Joint layout, how it runs and its gradients:** the text K/V never travel
    the ring, only the visual K/V do. Visual queries meet the text keys in one
    local kernel call; text queries meet this device's visual chunk in one local
    kernel call whose partial `(out, lse)` are all-gathered over the ring and
    merged in a fixed order (so every device gets bitwise the same text rows);
    the text x text block is computed locally. Everything is merged by
    log-sum-exp in float32, and the backward runs every block's backward (and the
    ring's) with the merged `out` and `lse`. The text output rows are copies: the
    cotangent of the text output is the **sum** of the copies' cotangents (give
    every copy its share, or the whole cotangent to one copy; never the whole
    cotangent to every copy), and the gradient with respect to the text inputs is
    the sum over the devices' copies (what `shard_map` gives for a replicated
    input): the text x text block's part of it is kept on rank 0 only, so it
    counts once. As in [`usp_attention`][] with `text_len`.

    **Raises:**

    `ValueError` when `axis_name` is not bound (outside `shard_map`), for an
    unknown `layout`, an odd local length with `layout="zigzag"` (in the joint
    layout: an odd visual length `q.shape[1] - text_len`), a `text_len` that is
    not a Python int in `[0, q.shape[1]]`, or (joint layout) shapes that are not
    self-attention; the kernel's errors for invalid or unsupported options.
    """
    text_len = _static_int("text_len", text_len)
    if text_len:
        from ._joint import ring_joint_attention  # _joint builds on this module

        return ring_joint_attention(
            q, k, v, axis_name=axis_name, causal=causal, segment_ids=segment_ids, sinks=sinks,
            window=window, scale=scale, logits_soft_cap=logits_soft_cap, layout=layout,
            text_len=text_len, implementation=implementation, tile_mask=mask,
        )
    return _ring_attention(
        q, k, v, axis_name=axis_name, causal=causal, segment_ids=segment_ids, sinks=sinks,
        window=window, scale=scale, logits_soft_cap=logits_soft_cap, layout=layout,
        implementation=implementation, tile_mask=mask,
    )


def check_tile_mask(fn: str, tile_mask, global_len: int, heads: int, unit: int, what: str = "sequence"):
    """Raises a `ValueError` unless `tile_mask` (a `kernels.SlidingTileMask` or None) fits
    a global sequence of `global_len` tokens and `heads` query heads: the sequence is
    the mask's, padded by fewer than `unit` tiles' tokens (positions past the mask's
    `seq_len` are padding)."""
    if tile_mask is None:
        return
    if isinstance(tile_mask, RankMasks):
        for mask in tile_mask.masks:
            check_tile_mask(fn, mask, global_len, heads, unit, what)
        return
    if not isinstance(tile_mask, kernels.SlidingTileMask):
        raise TypeError(
            f"{fn}: `mask` must be a kernels.SlidingTileMask (or None); received "
            f"{type(tile_mask).__name__}."
        )
    tile_mask.check_heads(heads, fn)
    need = tile_mask.seq_len if what == "sequence" else tile_mask.video_len
    slack = unit * tile_mask.tile_size
    if not need <= global_len < need + slack:
        raise ValueError(
            f"{fn}: the SlidingTileMask lays out {need} tokens ({what}; grid {tile_mask.grid}, "
            f"tile {tile_mask.tile}, text_len {tile_mask.text_len}), but the devices hold "
            f"{global_len} in all (sp_size x local length). The global {what} must be the "
            f"mask's, padded at the end by fewer than {slack} tokens (pad to whole tiles per "
            "device; padding is invisible)."
        )


def _ring_attention(
    q, k, v, *, axis_name, causal, segment_ids, sinks, window, scale, logits_soft_cap, layout,
    implementation, step_mask=None, tile_mask=None, tile_unit=None,
):
    """`ring_attention`, and more: `step_mask(sp_size, L)`, when given, builds the
    step mask of this call (see `_step_plan`) once the arguments are validated;
    `make_ring_attention`'s kernels use it. `tile_mask`: a `SlidingTileMask` over
    the global positions, given to every step's kernel; `tile_unit`: the padding it
    allows, in tiles (default one per chunk; USP pads to whole tiles per device)."""
    n = axis_size(axis_name, what="Ring")
    _check_layout(layout)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    L_q, L_k = q.shape[1], k.shape[1]
    check_tile_mask("ring_attention", tile_mask, n * L_q, q.shape[2], tile_unit or _parts(layout) * n)
    if tile_mask is not None and L_q != L_k:
        raise ValueError(
            "ring_attention: a SlidingTileMask is a self-attention mask: q and k/v must hold "
            f"the same local length; received q: {q.shape}, k: {k.shape}."
        )
    check_sharded("ring_attention", (axis_name,), q=q if L_q else None, k=k if L_k else None,
                  v=v if L_k else None)
    # Validate the options once, exactly as every step's kernel call will see them.
    seg_q, seg_kv = _segments(segment_ids)

    def validate(implementation, positions: bool, as_given: bool = False):
        check_request(
            q, k, v,
            # As given (validated before any cast, with messages naming the argument),
            # or as the steps pass them.
            segment_ids=segment_ids if as_given else _seg_arg(seg_q, seg_kv),
            q_positions=jnp.arange(L_q, dtype=jnp.int32) if positions else None,
            kv_positions=jnp.arange(L_k, dtype=jnp.int32) if positions else None,
            causal=causal, window=window, scale=scale, logits_soft_cap=logits_soft_cap,
            # A step mask reaches every kernel call as `mask=`: the kernel must serve it.
            mask=_tile_masks(tile_mask)[0] if step_mask is None else jnp.ones((1, 1), bool),
            implementation=implementation,
            needs_lse=True,
        )

    validate("xla", positions=True, as_given=True)  # the arguments themselves (xla serves every feature)
    if layout == "zigzag":
        for what, length in (("local length of q", L_q), ("local length of k/v", L_k)):
            _check_zigzag_length(
                length, what,
                f"Pad the global sequence to a multiple of 2 * sp_size = {2 * n} before "
                "zigzag_permute (pad_to_multiple, padding_segment_ids).",
            )
    # Steps pass positions to their kernel unless the static plan shows that none
    # needs them (see `_relation_plan`): then a kernel without positions serves.
    positions = step_mask is not None or tile_mask is not None or not _position_free(
        _relation_plan(layout, n, L_q, L_k, bool(causal), None if window is None else tuple(window))
    )
    validate(implementation, positions)
    sinks = check_sinks("ring_attention", sinks, q.shape[2])
    cfg = _Config(
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
