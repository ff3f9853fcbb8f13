"""The ring's step schedule: which part of each step's block is computed.

Token positions are a static function of (rank, step) (`_layout.py`), so which
blocks the causal mask or window hides is tabulated at trace time: a plan is an
`(n, n)` table of `BRANCHES` indices (device `r`, step `t`), and each ring step
runs the one branch its entry names through `scheduled` (`lax.switch` on the
traced rank, over the branches that occur). In the `"zigzag"` layout each local
block is two chunks of the global sequence (`r` and `2n - 1 - r`) and the skip
works per chunk: every causal step after the first computes exactly half a
block, on every device, so the work is balanced ([`ring_work`][] reports it).

Plans come from the causal mask and window (`relation_plan`, which also records
which steps may run their kernel without positions), from a sliding tile mask
(`tile_plan`), or from chunk visibility tables of a 2D mask (`plan_from_table`,
for `make_ring_attention`'s kernels). Tiles that segment ids hide are not part of
the plan: the blockwise kernel skips them.
"""

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..kernels.internal import chunk_table
from ._checks import check_sp_size
from ._layout import block_positions, check_layout, check_zigzag_length, layout_parts, part_slices
from ._rank_masks import tile_masks


# -- the schedule: which part of each step's block is computed ----------------------
#
# Positions are a static function of (rank, step), so which (part of a) block the
# causal mask or window hides is decided at trace time for every device and step:
# `_plan` is an `(n, n)` table of `BRANCHES` indices. Inside the ring a device
# looks up its row with its traced rank.


# A step computes one of these (query part, key part) pairs, `None` = all parts.
# Index 0 is "skip". With one part per block only the first two occur.
BRANCHES: tuple[tuple[int | None, int | None] | None, ...] = (
    None,  # nothing visible: skip
    (None, None),  # the whole block
    (None, 0),  # every query against the first key chunk
    (None, 1),  # every query against the second key chunk
    (1, None),  # the second query chunk against every key
    (0, None),  # the first query chunk against every key
)
SKIP, FULL = 0, 1
# A step mask's plan (see `_ring_engine._step_plan`) may add `UNMASKED` to a branch
# index: the mask hides nothing in that step's block, so the kernel runs without
# `mask=`.
UNMASKED = len(BRANCHES)


def may_see(causal: bool, window, q_pos: np.ndarray, kv_pos: np.ndarray) -> bool:
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
    """The `BRANCHES` index for a `parts x parts` table: `visible[a][b]` is
    whether query part `a` may see key part `b`. Prefers the smallest block that
    covers every visible pair."""
    if not any(x for row in visible for x in row):
        return SKIP
    if len(visible) == 1:
        return FULL
    (v00, v01), (v10, v11) = visible
    if not (v01 or v11):
        return 2
    if not (v00 or v10):
        return 3
    if not (v00 or v01):
        return 4
    if not (v10 or v11):
        return 5
    return FULL


@functools.lru_cache(maxsize=256)
def _plan(layout: str, n: int, L_q: int, L_k: int, causal: bool, window) -> np.ndarray:
    """int `(n, n)`: the `BRANCHES` index of device `r` at step `t` (holding the
    key/value block of rank `(r - t) mod n`)."""
    parts = layout_parts(layout)
    plan = np.full((n, n), FULL, np.int32)
    if not causal and window is None:
        return plan
    for r in range(n):
        q_pos = block_positions(np, L_q, n, r, layout)
        for t in range(n):
            kv_pos = block_positions(np, L_k, n, (r - t) % n, layout)
            visible = [
                [may_see(causal, window, q_pos[a], kv_pos[b]) for b in part_slices(L_k, parts)]
                for a in part_slices(L_q, parts)
            ]
            plan[r, t] = _choose(visible)
    return plan


# How the query and key positions of a step's computed block relate, added to the
# plan index in multiples of `RELATION` (see `relation_plan`). The last two let
# the step call its kernel without positions, which the vendor kernels
# (`"pallas_tpu"`, `"pallas_gpu"`) need: the ring runs on them where every
# computed step is one of those (always, for causal or full attention).
GENERAL, ALL_VISIBLE, SAME_POSITIONS = 0, 1, 2
RELATION = 2 * UNMASKED


def _relation(causal: bool, window, q_pos: np.ndarray, kv_pos: np.ndarray) -> int:
    """`ALL_VISIBLE`: causal and window hide no pair (the kernel needs neither);
    `SAME_POSITIONS`: queries and keys are the same increasing positions, and
    contiguous if there is a window (both then act on indices as on positions)."""
    q_lo, q_hi, k_lo, k_hi = (int(x) for x in (q_pos.min(), q_pos.max(), kv_pos.min(), kv_pos.max()))
    every = not causal or k_hi <= q_lo
    if window is not None:
        left, right = window
        every = every and (left is None or k_lo >= q_hi - left)
        every = every and (right is None or k_hi <= q_lo + right)
    if every:
        return ALL_VISIBLE
    if np.array_equal(q_pos, kv_pos) and (window is None or np.all(np.diff(q_pos) == 1)):
        return SAME_POSITIONS
    return GENERAL


@functools.lru_cache(maxsize=256)
def relation_plan(layout: str, n: int, L_q: int, L_k: int, causal: bool, window) -> np.ndarray:
    """`_plan` with each computed entry's `_relation` added (times `RELATION`)."""
    parts = layout_parts(layout)
    plan = _plan(layout, n, L_q, L_k, causal, window).copy()
    for r in range(n):
        q_pos = block_positions(np, L_q, n, r, layout)
        for t in range(n):
            if plan[r, t] == SKIP:
                continue
            qs, ks = branch_slices(int(plan[r, t]), parts, L_q, L_k)
            kv_pos = block_positions(np, L_k, n, (r - t) % n, layout)
            plan[r, t] += RELATION * _relation(causal, window, q_pos[qs], kv_pos[ks])
    return plan


@functools.lru_cache(maxsize=64)
def tile_plan(tile_mask, layout: str, n: int, L_q: int, L_k: int, causal: bool, window) -> np.ndarray:
    """The `_plan` of a ring whose steps also carry a sliding tile mask: a (half-)block
    is skipped when the tile mask, or the causal mask / window, hides it entirely
    (decided per chunk of global positions, exactly: `kernels.internal.chunk_table`).
    Every computed step passes positions to its kernel."""
    parts = layout_parts(layout)
    cq, ck = L_q // parts, L_k // parts
    chunks = np.arange(n * parts)
    table = np.zeros((n * parts, n * parts), bool)
    for mask in tile_masks(tile_mask):  # RankMasks: a step is computed if any rank needs it
        table |= chunk_table(mask, chunks * cq, cq, chunks * ck, ck)
    if causal or window is not None:
        q_pos = [np.arange(a * cq, (a + 1) * cq) for a in chunks]
        kv_pos = [np.arange(b * ck, (b + 1) * ck) for b in chunks]
        table &= np.array([[may_see(causal, window, q, kv) for kv in kv_pos] for q in q_pos])
    return plan_from_table(layout, n, table, np)


def position_free(plan) -> bool:
    """Whether every computed step of a (static) plan can run without positions."""
    if not isinstance(plan, np.ndarray):
        return False
    computed = plan[plan != SKIP]
    return bool(np.all(computed // RELATION != GENERAL))


def branch_slices(index: int, parts: int, length_q: int, length_k: int) -> tuple[slice, slice]:
    a, b = BRANCHES[index % UNMASKED]
    full = slice(None)
    qs = full if a is None else part_slices(length_q, parts)[a]
    ks = full if b is None else part_slices(length_k, parts)[b]
    return qs, ks


def scheduled(plan, rank, t, steps, compute, skip, *operands, branches=None):
    """Runs step `t` of the ring on this device: `compute(index, *operands)` for
    its `plan` entry, or `skip(*operands)`.

    `steps` are the static step numbers this code serves (one for a peeled step,
    a range for a loop body), so only the branches that occur in them are traced.
    A traced `plan` (a mask that is data, see `_ring_engine._step_plan`) cannot be
    read at trace time: then every index in `branches` is traced.

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
        return skip(*operands) if used[0] == SKIP else compute(used[0], *operands)
    index = jnp.asarray(plan)[rank, t]
    remap = np.zeros(3 * RELATION, np.int32)
    remap[used] = np.arange(len(used))
    fns = [skip if i == SKIP else functools.partial(compute, i) for i in used]
    return lax.switch(jnp.asarray(remap)[index], fns, *operands)


def _choose_table(visible, xp):
    """`_choose` for a whole table: `visible (..., parts, parts)` bool, in `xp`
    (`np`, or `jnp` for a traced table) -> int32 `(...)` `BRANCHES` indices."""
    any_visible = visible.any(axis=(-2, -1))
    if visible.shape[-1] == 1:
        return xp.where(any_visible, FULL, SKIP).astype(xp.int32)
    v00, v01 = visible[..., 0, 0], visible[..., 0, 1]
    v10, v11 = visible[..., 1, 0], visible[..., 1, 1]
    index = xp.full(any_visible.shape, FULL, xp.int32)
    # In reverse order of `_choose`'s tests, so that its first match wins.
    for branch, hidden in ((5, ~(v10 | v11)), (4, ~(v00 | v01)), (3, ~(v00 | v10)), (2, ~(v01 | v11))):
        index = xp.where(hidden, branch, index)
    return xp.where(any_visible, index, SKIP).astype(xp.int32)


def plan_from_table(layout: str, n: int, table, xp, full_table=None):
    """int32 `(n, n)` plan (as `_plan`) from chunk visibility tables.

    `table (n * parts, n * parts)` bool (NumPy, or a traced array with `xp=jnp`):
    `table[a, b]` says whether some query of global chunk `a` may see some key of
    global chunk `b`, chunks being `L / parts` consecutive global positions.
    `full_table`, the same shape, says whether every query of chunk `a` sees every
    key of chunk `b`; where that holds for the whole part of the block a step
    computes, its index is offset by `UNMASKED`.
    """
    parts = layout_parts(layout)
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
    for index in range(1, UNMASKED) if parts == 2 else (FULL,):
        a, b = BRANCHES[index]
        region = np.zeros((parts, parts), bool)
        region[slice(None) if a is None else a, slice(None) if b is None else b] = True
        covered = (full | ~region).all(axis=(-2, -1))
        unmasked = unmasked | ((plan == index) & covered)
    return xp.where(unmasked, plan + UNMASKED, plan).astype(xp.int32)


def plan_work(plan: np.ndarray, layout: str, n: int, L: int) -> np.ndarray:
    """Per-device (query, key) pairs a static `plan` hands to the kernel."""
    parts = layout_parts(layout)
    work = np.zeros(n, np.int64)
    for r in range(n):
        for t in range(n):
            if plan[r, t] != SKIP:
                qs, ks = branch_slices(int(plan[r, t]), parts, L, L)
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
    check_layout(layout)
    n = check_sp_size(sp_size)
    if seq_len % n:
        raise ValueError(
            f"`seq_len` must be a multiple of sp_size={n}; received {seq_len}."
        )
    L = seq_len // n
    if layout == "zigzag":
        check_zigzag_length(L, "local length", f"Use a multiple of 2 * sp_size = {2 * n}.")
    plan = _plan(layout, n, L, L, bool(causal), None if window is None else tuple(window))
    return plan_work(plan, layout, n, L)
