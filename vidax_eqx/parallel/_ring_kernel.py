"""`make_ring_attention`: ring attention as a kernel object built once from a 2D mask.

The API of the splash-based ring attention kernels (`make_ring_attention(mask,
...)`, then `kernel(q, k, v, segment_ids=..., sinks=...)` inside `shard_map`), on
top of [`ring_attention`][]: the kernel is an `eqx.Module`, so a PyTree whose mask
arrays are leaves and whose options are static, and it can be passed through
`jax.jit` or closed over.

Masks are over **global positions** of one sequence attending to itself
(`mask[i, j]`: may the query at position `i` see the key at position `j`):

- a dense `(S, S)` boolean NumPy array ([`DenseMask`][]);
- structured masks that never materialize `(S, S)`: [`FullMask`][],
  [`CausalMask`][], [`LocalMask`][], and their combinations with `&` and `|`
  ([`LogicalAnd`][], [`LogicalOr`][]), dense arrays included.

How a mask runs. Full, causal and local masks, and any `&` / `|` of them, are one
window on `kv_pos - q_pos` (every such window contains the diagonal, so the union
of two is again a window): they run exactly as `ring_attention(causal=...,
window=...)`, from positions alone. A mask with a dense part is split into the
positional factors of its top-level `&` (still given to the kernel as `causal` /
`window`) and the rest, whose `(query part, key part)` sub-block at the global
positions of each step is passed to the kernel as `mask=`; the backward step
calls the same function with the same positions, so it sees the same block. The
ring's step plan comes from which blocks of the whole mask hold some / only
`True` ([`AbstractMask.block_visibility`][]): key blocks (in the zigzag layout,
half-blocks) that the mask hides entirely are skipped, and blocks it does not
touch run without `mask=` (as fast as no mask); the blockwise kernel then skips
hidden tiles inside the blocks that get one.
"""

import abc
import functools
from collections.abc import Hashable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .. import kernels
from ._checks import check_sp_size
from ._layout import check_layout, check_zigzag_length, layout_parts
from ._mesh import axis_size
from ._ring_engine import run_ring
from ._schedule import plan_from_table, plan_work, ring_work, tile_plan


_INT32_MAX = 2**31 - 1
Window = tuple[int | None, int | None]  # (left, right): -left <= kv_pos - q_pos <= right


# -- masks --------------------------------------------------------------------------


def _xp(*xs):
    """`np` when every array is a NumPy array (static), else `jnp`."""
    return np if all(isinstance(x, np.ndarray) for x in xs) else jnp


def _check_shape(shape, what: str) -> tuple[int, int] | None:
    if shape is None:
        return None
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        shape = None
    if shape is None or len(shape) != 2 or shape[0] != shape[1] or shape[0] < 1:
        raise ValueError(
            f"{what} `shape` must be (S, S), the global sequence attending to itself, or None "
            f"(any length); received {shape!r}."
        )
    return shape


def _check_window(window) -> Window:
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(
            f"`LocalMask(window=...)` must be a pair (left, right) of non-negative ints or None "
            f"(unbounded); received {window!r}."
        )
    sides = []
    for side, w in zip(("left", "right"), window):
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 0):
            raise ValueError(
                f"`LocalMask(window=...)` {side} size must be a non-negative int or None "
                f"(unbounded); received {w!r}."
            )
        # No two int32 positions are farther apart: a side this large excludes nothing.
        sides.append(None if w is None or w >= _INT32_MAX else int(w))
    return sides[0], sides[1]


def _intersect(a: Window, b: Window) -> Window:
    return tuple(x if y is None else y if x is None else min(x, y) for x, y in zip(a, b))


def _union(a: Window, b: Window) -> Window:
    return tuple(None if x is None or y is None else max(x, y) for x, y in zip(a, b))


def _window_block(window: Window, q_pos, kv_pos):
    xp = _xp(q_pos, kv_pos)
    d = kv_pos[None, :] - q_pos[:, None]  # a difference: no int32 overflow
    vis = xp.ones(d.shape, bool)
    left, right = window
    if left is not None:
        vis = vis & (d >= -left)
    if right is not None:
        vis = vis & (d <= right)
    return vis


class AbstractMask(eqx.Module):
    """A boolean attention mask over the global positions of one sequence.

    `True` may attend: entry `(i, j)` says whether the query at global position `i`
    may see the key at global position `j`. Combine masks with `&` and `|` (a
    boolean NumPy array on either side becomes a [`DenseMask`][]). Concrete masks:
    [`FullMask`][], [`CausalMask`][], [`LocalMask`][], [`DenseMask`][],
    [`LogicalAnd`][], [`LogicalOr`][].
    """

    # `np_array & mask` must reach `mask.__rand__` instead of broadcasting elementwise.
    __array_ufunc__ = None

    @abc.abstractmethod
    def block(
        self, q_positions: Int[Array, " M"], kv_positions: Int[Array, " N"]
    ) -> Bool[Array, "M N"]:
        """The mask at the given global positions: `(len(q_positions),
        len(kv_positions))`, NumPy when everything involved is NumPy, else JAX."""

    @abc.abstractmethod
    def window(self) -> Window | None:
        """The mask as one window `(left, right)` on `kv_pos - q_pos` (`None` on a side:
        unbounded), or `None` when it is not positional (it has a dense part)."""

    @abc.abstractmethod
    def seq_len(self) -> int | None:
        """The global sequence length the mask is made for, or `None` (any)."""

    @abc.abstractmethod
    def _split(self) -> tuple[Window, "AbstractMask | None"]:
        """`(window, rest)` with `self == window & rest` (`rest` `None`: all True)."""

    @abc.abstractmethod
    def _materialize(self, seq_len: int, xp):
        """The whole `(S, S)` mask (only for masks that hold one anyway)."""

    def block_visibility(self, seq_len: int, block_size: int) -> Bool[Array, "S/b S/b"]:
        """Which `(query block, key block)` pairs hold at least one `True`.

        **Arguments:**

        - `seq_len`: the global sequence length `S`.
        - `block_size`: positions per block `b`; it must divide `S`. Block `a` holds
            the positions `[a * b, (a + 1) * b)`.

        **Returns:**

        bool `(S / b, S / b)`. For a positional mask (`window()` not `None`) it is
        computed from the blocks' position ranges, without materializing anything;
        otherwise from the whole mask, as NumPy when its arrays are concrete and as
        a traced JAX array when they are traced.
        """
        return self._block_tables(seq_len, block_size)[0]

    def _block_tables(self, seq_len: int, block_size: int):
        """`(any, all)`: `block_visibility`, and which blocks are entirely `True`."""
        seq_len, block_size = int(seq_len), int(block_size)
        if block_size < 1 or seq_len % block_size:
            raise ValueError(
                f"`block_size` must divide `seq_len`; received seq_len={seq_len}, "
                f"block_size={block_size}."
            )
        nb = seq_len // block_size
        window = self.window()
        if window is not None:
            start = np.arange(nb, dtype=np.int64) * block_size
            d_lo = start[None, :] - start[:, None] - (block_size - 1)  # of kv_pos - q_pos
            d_hi = d_lo + 2 * (block_size - 1)
            some, every = np.ones((nb, nb), bool), np.ones((nb, nb), bool)
            left, right = window
            if left is not None:
                some, every = some & (d_hi >= -left), every & (d_lo >= -left)
            if right is not None:
                some, every = some & (d_lo <= right), every & (d_hi <= right)
            return some, every
        leaves = jax.tree.leaves(self)
        concrete = not any(isinstance(x, jax.core.Tracer) for x in leaves)
        full = self._materialize(seq_len, np if concrete else jnp)
        blocks = full.reshape(nb, block_size, nb, block_size)
        return blocks.any(axis=(1, 3)), blocks.all(axis=(1, 3))

    def __and__(self, other) -> "LogicalAnd":
        return LogicalAnd(self, other)

    def __rand__(self, other) -> "LogicalAnd":
        return LogicalAnd(other, self)

    def __or__(self, other) -> "LogicalOr":
        return LogicalOr(self, other)

    def __ror__(self, other) -> "LogicalOr":
        return LogicalOr(other, self)


def _as_mask(x) -> AbstractMask:
    if isinstance(x, AbstractMask):
        return x
    if isinstance(x, (np.ndarray, jax.Array)):
        return DenseMask(x)
    if isinstance(x, kernels.SlidingTileMask):
        return _TileMask(x)
    raise TypeError(
        f"a mask must be an AbstractMask (FullMask, CausalMask, LocalMask, ...), a "
        f"kernels.SlidingTileMask or a boolean (S, S) array; received {type(x).__name__}."
    )


class _PositionalMask(AbstractMask):
    """Shared behaviour of masks that are a window on `kv_pos - q_pos` (abstract)."""

    def block(self, q_positions, kv_positions):
        return _window_block(self.window(), q_positions, kv_positions)

    def _split(self):
        return self.window(), None

    def _materialize(self, seq_len, xp):
        pos = xp.arange(seq_len, dtype=xp.int32)
        return self.block(pos, pos)


class FullMask(_PositionalMask):
    """Every query sees every key.

    **Arguments:**

    - `shape`: optional `(S, S)`, checked against the global sequence at call time.
    """

    shape: tuple[int, int] | None = eqx.field(static=True)

    def __init__(self, shape: tuple[int, int] | None = None):
        self.shape = _check_shape(shape, "FullMask")

    def window(self):
        return None, None

    def seq_len(self):
        return None if self.shape is None else self.shape[0]


class CausalMask(_PositionalMask):
    """A query sees the keys at or before its global position (`kv_pos <= q_pos`).

    **Arguments:**

    - `shape`: optional `(S, S)`, checked against the global sequence at call time.
    """

    shape: tuple[int, int] | None = eqx.field(static=True)

    def __init__(self, shape: tuple[int, int] | None = None):
        self.shape = _check_shape(shape, "CausalMask")

    def window(self):
        return None, 0

    def seq_len(self):
        return None if self.shape is None else self.shape[0]


class LocalMask(_PositionalMask):
    """A sliding window: `q_pos - left <= kv_pos <= q_pos + right`.

    **Arguments:**

    - `window`: `(left, right)`, non-negative ints; `None` on a side is unbounded
        (`(None, 0)` is causal).
    - `shape`: optional `(S, S)`, checked against the global sequence at call time.
    """

    window_size: Window = eqx.field(static=True)
    shape: tuple[int, int] | None = eqx.field(static=True)

    def __init__(self, window: Window, shape: tuple[int, int] | None = None):
        self.window_size = _check_window(window)
        self.shape = _check_shape(shape, "LocalMask")

    def window(self):
        return self.window_size

    def seq_len(self):
        return None if self.shape is None else self.shape[0]


class DenseMask(AbstractMask):
    """An explicit boolean `(S, S)` mask over the global sequence.

    **Arguments:**

    - `array`: boolean `(S, S)`; NumPy (or a concrete JAX array, converted to NumPy)
        keeps the ring's block skipping static. It is the PyTree leaf of the mask, so
        a kernel passed through `jax.jit` carries it as a traced argument (then the
        skipping is decided on device, from the traced mask).

    Every device holds the whole array (`S^2` bytes): for long sequences prefer the
    structured masks.
    """

    array: Bool[Array, "S S"] | np.ndarray

    def __init__(self, array):
        if not isinstance(array, jax.core.Tracer):
            array = np.asarray(array)
        if array.dtype != np.bool_:
            raise TypeError(
                f"a dense mask must be boolean (True = may attend); received dtype {array.dtype}. "
                "Convert it with `mask.astype(bool)`."
            )
        if array.ndim != 2 or array.shape[0] != array.shape[1]:
            raise ValueError(
                "a dense mask must be 2D (S, S) over the global sequence (one mask for every "
                f"batch element and head); received shape {tuple(array.shape)}."
            )
        self.array = array

    def block(self, q_positions, kv_positions):
        array = self.array if _xp(q_positions, kv_positions, self.array) is np else jnp.asarray(self.array)
        return array[q_positions[:, None], kv_positions[None, :]]

    def window(self):
        return None

    def seq_len(self):
        return self.array.shape[0]

    def _split(self):
        return (None, None), self

    def _materialize(self, seq_len, xp):
        return self.array if xp is np else jnp.asarray(self.array)


class _TileMask(AbstractMask):
    """A [`kernels.SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask] as a ring mask
    (what `_as_mask` makes of one). Alone, or `&`-ed with positional masks, it runs
    as `ring_attention(mask=...)`: every step's kernel evaluates it at the step's
    global positions, nothing is materialized. Inside other combinations its
    blocks are materialized (shared windows only)."""

    tile: kernels.SlidingTileMask = eqx.field(static=True)

    def block(self, q_positions, kv_positions):
        if self.tile.heads is not None:
            raise NotImplementedError(
                "make_ring_attention: a SlidingTileMask with per-head windows runs alone or "
                "`&`-ed with FullMask / CausalMask / LocalMask; combined with a dense mask or "
                "with `|` it would need one 2D mask for every head."
            )
        xp = _xp(q_positions, kv_positions)
        return self.tile.visible(q_positions, kv_positions, xp)[0]

    def window(self):
        return None

    def seq_len(self):
        return self.tile.seq_len

    def _split(self):
        return (None, None), self

    def _materialize(self, seq_len, xp):
        pos = xp.arange(seq_len, dtype=xp.int32)
        return self.block(pos, pos)


def _combined_seq_len(left: AbstractMask, right: AbstractMask) -> int | None:
    a, b = left.seq_len(), right.seq_len()
    if a is not None and b is not None and a != b:
        raise ValueError(
            f"masks combined with & or | must cover the same sequence; received lengths {a} "
            f"and {b}."
        )
    return a if a is not None else b


class LogicalAnd(AbstractMask):
    """Visible where both masks are (`left & right`).

    **Arguments:**

    - `left`, `right`: masks, or boolean `(S, S)` arrays.
    """

    left: AbstractMask
    right: AbstractMask

    def __init__(self, left, right):
        self.left, self.right = _as_mask(left), _as_mask(right)
        _combined_seq_len(self.left, self.right)

    def block(self, q_positions, kv_positions):
        return self.left.block(q_positions, kv_positions) & self.right.block(q_positions, kv_positions)

    def window(self):
        a, b = self.left.window(), self.right.window()
        return None if a is None or b is None else _intersect(a, b)

    def seq_len(self):
        return _combined_seq_len(self.left, self.right)

    def _split(self):
        (wa, ra), (wb, rb) = self.left._split(), self.right._split()
        rest = ra if rb is None else rb if ra is None else LogicalAnd(ra, rb)
        return _intersect(wa, wb), rest

    def _materialize(self, seq_len, xp):
        return self.left._materialize(seq_len, xp) & self.right._materialize(seq_len, xp)


class LogicalOr(AbstractMask):
    """Visible where either mask is (`left | right`).

    **Arguments:**

    - `left`, `right`: masks, or boolean `(S, S)` arrays.
    """

    left: AbstractMask
    right: AbstractMask

    def __init__(self, left, right):
        self.left, self.right = _as_mask(left), _as_mask(right)
        _combined_seq_len(self.left, self.right)

    def block(self, q_positions, kv_positions):
        return self.left.block(q_positions, kv_positions) | self.right.block(q_positions, kv_positions)

    def window(self):
        a, b = self.left.window(), self.right.window()
        # Both windows hold the diagonal, so they overlap: their union is one window.
        return None if a is None or b is None else _union(a, b)

    def seq_len(self):
        return _combined_seq_len(self.left, self.right)

    def _split(self):
        window = self.window()
        return (window, None) if window is not None else ((None, None), self)

    def _materialize(self, seq_len, xp):
        return self.left._materialize(seq_len, xp) | self.right._materialize(seq_len, xp)


# -- the step mask the ring runs ----------------------------------------------------


class _StepMask(eqx.Module):
    """The step mask of one ring call (see `_ring_engine._step_plan`): the part of the
    mask handed to the kernel as `mask=`, and the ring's plan for the whole mask,
    static (`static_plan`) or traced (`traced_plan`)."""

    rest: AbstractMask
    traced_plan: Int[Array, "n n"] | None
    static_plan: tuple[tuple[int, ...], ...] | None = eqx.field(static=True)

    def plan(self):
        if self.static_plan is not None:
            return np.asarray(self.static_plan, np.int32)
        return self.traced_plan

    def block(self, q_pos, kv_pos):
        return self.rest.block(q_pos, kv_pos)


def _kernel_window(window: Window) -> tuple[bool, Window | None]:
    """A window on `kv_pos - q_pos` as the kernel's `(causal, window)` options."""
    if window == (None, None):
        return False, None
    if window == (None, 0):
        return True, None
    return False, window


def _mask_plan(mask: AbstractMask, layout: str, n: int, L: int):
    """The ring's `(n, n)` plan for `mask` (NumPy when decided statically): hidden
    steps skipped, steps the mask does not touch run without `mask=`."""
    some, every = mask._block_tables(n * L, L // layout_parts(layout))
    xp = np if isinstance(some, np.ndarray) else jnp
    return plan_from_table(layout, n, some, xp, full_table=every)


# -- the kernel object --------------------------------------------------------------


def _check_block_sizes(block_sizes) -> tuple[int, int] | None:
    if block_sizes is None:
        return None
    if isinstance(block_sizes, (tuple, list)):
        sizes = tuple(block_sizes)
    elif hasattr(block_sizes, "block_q") and hasattr(block_sizes, "block_kv"):
        sizes = (block_sizes.block_q, block_sizes.block_kv)
    else:
        sizes = None
    if (
        sizes is None
        or len(sizes) != 2
        or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1 for s in sizes)
    ):
        raise ValueError(
            "`block_sizes` must be None, a pair (block_q, block_kv) of positive ints, or an "
            "object with positive int attributes `block_q` and `block_kv` (such as splash "
            f"attention's BlockSizes); received {block_sizes!r}."
        )
    return int(sizes[0]), int(sizes[1])


class RingAttentionKernel(eqx.Module):
    """Ring attention with a fixed mask, callable inside `jax.shard_map`.

    Build it with [`make_ring_attention`][] (which documents the options). It is an
    `eqx.Module`: its mask arrays are PyTree leaves and its options static, so it
    can be closed over or passed as an argument through `jax.jit`.
    """

    mask: AbstractMask
    ring_axis: Hashable = eqx.field(static=True)
    layout: str = eqx.field(static=True)
    is_mqa: bool = eqx.field(static=True)
    scale: float | None = eqx.field(static=True)
    logits_soft_cap: float | None = eqx.field(static=True)
    block_sizes: tuple[int, int] | None = eqx.field(static=True)
    mask_value: float | None = eqx.field(static=True)
    q_seq_shards: int = eqx.field(static=True)
    implementation: str | kernels.AbstractImplementation = eqx.field(static=True)

    def __init__(
        self,
        mask,
        *,
        block_sizes=None,
        is_mqa: bool = False,
        mask_value: float | None = None,
        logits_soft_cap: float | None = None,
        ring_axis: Hashable = "sp",
        q_seq_shards: int = 1,
        implementation: str | kernels.AbstractImplementation = "auto",
        layout: str = "contiguous",
        scale: float | None = None,
    ):
        """**Arguments:** as for [`make_ring_attention`][], which builds it."""
        self.mask = _as_mask(mask)
        if not isinstance(is_mqa, (bool, np.bool_)):
            raise ValueError(f"`is_mqa` must be a bool; received {is_mqa!r}.")
        if mask_value is not None:
            try:
                mask_value = float(mask_value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"`mask_value` must be a number or None; received {mask_value!r}."
                ) from None
        if isinstance(q_seq_shards, bool) or not isinstance(q_seq_shards, (int, np.integer)) or q_seq_shards < 1:
            raise ValueError(f"`q_seq_shards` must be a positive int; received {q_seq_shards!r}.")
        if q_seq_shards != 1:
            raise NotImplementedError(
                f"make_ring_attention: q_seq_shards={q_seq_shards} is not supported; the ring "
                "splits the sequence over `ring_axis` only (q_seq_shards=1). Shard heads or "
                "batch over other mesh axes instead."
            )
        self.block_sizes = _check_block_sizes(block_sizes)
        if self.block_sizes is not None and isinstance(implementation, kernels.AbstractImplementation):
            raise ValueError(
                "give the block sizes once: either `block_sizes=` or a configured "
                f"`implementation=` instance; received both ({block_sizes!r}, {implementation!r})."
            )
        self.layout = check_layout(layout)
        self.ring_axis = ring_axis
        self.is_mqa = bool(is_mqa)
        self.mask_value = mask_value
        self.q_seq_shards = int(q_seq_shards)
        self.scale = None if scale is None else float(scale)
        self.logits_soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
        self.implementation = implementation

    def _implementation(self):
        """The kernel each ring step runs: `block_sizes` configure the blockwise one."""
        if self.block_sizes is not None and self.implementation in ("auto", "blockwise"):
            return kernels.Blockwise(block_q=self.block_sizes[0], block_kv=self.block_sizes[1])
        return self.implementation

    def _seq_len(self, seq_len: int | None) -> int:
        expected = self.mask.seq_len()
        if seq_len is not None and expected is not None and seq_len != expected:
            raise ValueError(
                f"the mask covers a global sequence of {expected} tokens, but the ring holds "
                f"{seq_len} (sp_size x local length). Build the mask for the global (padded) "
                "sequence, or shard the sequence it was built for."
            )
        return expected if seq_len is None else seq_len

    def __call__(
        self,
        q: Float[Array, "B L H D"],
        k: Float[Array, "B L H_kv D"] | Float[Array, "B L D"],
        v: Float[Array, "B L H_kv D"] | Float[Array, "B L D"],
        segment_ids: kernels.SegmentIds | Int[Array, "B L"] | None = None,
        sinks: Float[Array, " H"] | None = None,
    ) -> Float[Array, "B L H D"]:
        """Ring attention of this device's block of the global sequence.

        **Arguments:**

        - `q`: this device's queries `(B, L, H, D)`.
        - `k`, `v`: `(B, L, H_kv, D)` with `H % H_kv == 0`; with `is_mqa=True`,
            `H_kv` must be 1 (a `(B, L, D)` array is taken as that one head).
        - `segment_ids`: this device's ids, `(B, L)` or `SegmentIds(q=..., kv=...)`;
            ANDed with the mask. Negative ids are padding.
        - `sinks`: per-head sink logits `(H,)`, usually replicated.

        **Returns:**

        This device's output `(B, L, H, D)` in `q`'s dtype; a row that sees nothing
        gives 0.

        Raises `ValueError("Ring axis 'sp' does not exist in the current context. ...")`
        outside a `shard_map` that binds `ring_axis`, and when the shapes do not fit
        the mask.
        """
        n = axis_size(self.ring_axis, what="Ring")
        q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
        if self.is_mqa:
            if k.ndim == 3 and v.ndim == 3:
                k, v = k[:, :, None], v[:, :, None]
            if k.ndim != 4 or k.shape[2] != 1 or v.shape != k.shape:
                raise ValueError(
                    "is_mqa=True means one key/value head: k and v must be (B, L, 1, D) or "
                    f"(B, L, D); received k: {k.shape}, v: {v.shape}. Use is_mqa=False for GQA."
                )
        if q.ndim == 4 and k.ndim == 4 and q.shape[1] != k.shape[1]:
            raise ValueError(
                "the kernel attends one global sequence to itself: q and k must hold the same "
                f"local length L; received q: {q.shape}, k: {k.shape}."
            )
        window, tile_mask = self._tile_split()
        step_mask = None
        if tile_mask is not None:  # ring_attention(mask=...), which checks the length
            causal, window = _kernel_window(window)
        elif self.mask.window() is not None:  # positional: causal / window, no mask array
            self._seq_len(n * q.shape[1])
            causal, window = _kernel_window(self.mask.window())
        else:  # the positional factors as causal / window, the rest as `mask=` blocks
            self._seq_len(n * q.shape[1])
            window, rest = self.mask._split()
            causal, window = _kernel_window(window)
            step_mask = functools.partial(self._step_mask, rest)
        with jax.named_scope("vidax_ring_attention_kernel"):
            return run_ring(
                q, k, v, axis_name=self.ring_axis, causal=causal, segment_ids=segment_ids,
                sinks=sinks, window=window, scale=self.scale,
                logits_soft_cap=self.logits_soft_cap, layout=self.layout,
                implementation=self._implementation(), step_mask=step_mask, tile_mask=tile_mask,
            )

    def _tile_split(self) -> tuple[Window, "kernels.SlidingTileMask | None"]:
        """`(window, tile_mask)` when the mask is a sliding tile mask `&`-ed with positional
        masks only (it then runs from positions alone), else `(_, None)`."""
        window, rest = self.mask._split()
        if isinstance(rest, _TileMask):
            return window, rest.tile
        return window, None

    def _step_mask(self, rest: AbstractMask, n: int, L: int) -> _StepMask:
        plan = _mask_plan(self.mask, self.layout, n, L)
        if isinstance(plan, np.ndarray):
            return _StepMask(rest, None, tuple(map(tuple, plan.tolist())))
        return _StepMask(rest, plan, None)

    def work(self, sp_size: int, seq_len: int | None = None) -> np.ndarray:
        """Per-device work of the forward ring, as it schedules this mask.

        Like [`ring_work`][]: for each device, the (query, key) pairs of the blocks
        handed to the attention kernel over all ring steps, after the ring skipped
        the blocks (zigzag: half-blocks) the mask hides entirely. The backward
        schedules the same blocks.

        **Arguments:**

        - `sp_size`: the number of devices on the ring.
        - `seq_len`: the global sequence length; default the mask's.

        **Returns:**

        int64 NumPy array `(sp_size,)`. Needs a concrete mask (not traced).
        """
        n = check_sp_size(sp_size)
        S = self._seq_len(seq_len)
        if S is None:
            raise ValueError("this mask has no length of its own: pass `seq_len`.")
        if S % n:
            raise ValueError(f"`seq_len` must be a multiple of sp_size={n}; received {S}.")
        L = S // n
        window, tile_mask = self._tile_split()
        if tile_mask is not None:
            causal, window = _kernel_window(window)
            plan = tile_plan(tile_mask, self.layout, n, L, L, causal, window)
            return plan_work(plan, self.layout, n, L)
        window = self.mask.window()
        if window is not None:
            causal, window = _kernel_window(window)
            return ring_work(S, n, layout=self.layout, causal=causal, window=window)
        if self.layout == "zigzag":
            check_zigzag_length(L, "local length", f"Use a multiple of 2 * sp_size = {2 * n}.")
        plan = _mask_plan(self.mask, self.layout, n, L)
        if not isinstance(plan, np.ndarray):
            raise ValueError("`work` needs a concrete mask; this one is traced.")
        return plan_work(plan, self.layout, n, L)


def make_ring_attention(
    mask,
    *,
    block_sizes=None,
    is_mqa: bool = False,
    mask_value: float | None = None,
    logits_soft_cap: float | None = None,
    ring_axis: Hashable = "sp",
    q_seq_shards: int = 1,
    implementation: str | kernels.AbstractImplementation = "auto",
    layout: str = "contiguous",
    scale: float | None = None,
) -> RingAttentionKernel:
    """Builds a ring attention kernel for a fixed 2D mask (the splash ring API).

    ```python
    kernel = make_ring_attention(CausalMask() & LocalMask((1024, 0)), ring_axis="sp")

    @jax.jit
    def step(kernel, q, k, v, seg):
        f = lambda q, k, v, seg: kernel(q, k, v, segment_ids=seg)
        return jax.shard_map(f, mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q, k, v, seg)
    ```

    The kernel runs [`ring_attention`][] with the mask: each ring step hands the
    kernel only its `(query block, key block)` sub-mask at the blocks' global
    positions (the backward step the same one), and key blocks the mask hides
    entirely are skipped. Gradients with respect to `q`, `k`, `v` and `sinks` equal
    single-device attention's with the same global mask.

    **Arguments:**

    - `mask`: over the global positions of the sequence (`True` = may attend): a
        boolean `(S, S)` NumPy array, or a mask object ([`FullMask`][],
        [`CausalMask`][], [`LocalMask`][], [`DenseMask`][], and their `&` / `|`), or a
        [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask] (sliding tile
        attention; alone or `&`-ed with positional masks it runs as
        `ring_attention(mask=...)`, never materialized, per-head windows allowed, and
        the global sequence may be its `seq_len` padded by less than a tile per chunk).
        There is no `causal` flag: causal attention is a `CausalMask` (with a dense
        mask: `dense & CausalMask()`). Segment ids given at call time are ANDed
        with the mask. One mask serves every batch element and head.
    - `block_sizes`: the tile sizes `(block_q, block_kv)` of the blockwise kernel
        each step runs, as a pair or an object with `block_q` and `block_kv` (such as
        splash's `BlockSizes`; its other fields are ignored: the blockwise backward
        uses the same tiles). With `implementation="auto"` or `"blockwise"` the steps
        run `kernels.Blockwise(block_q, block_kv)`; another named implementation
        (the `"xla"` reference has no tiles) accepts and ignores them.
    - `is_mqa`: one key/value head: `k`, `v` are `(B, L, 1, D)` (or `(B, L, D)`);
        checked at call time. Without it, any GQA `H % H_kv == 0` works.
    - `mask_value`: accepted for compatibility and ignored: vidax masks exactly
        (hidden logits are `-inf`, a row that sees nothing gives 0, never NaN), so
        no finite stand-in value is needed. Must be a number or `None`.
    - `logits_soft_cap`: `c` applies `c * tanh(s / c)` to the scaled logits.
    - `ring_axis`: the mesh axis of the ring.
    - `q_seq_shards`: must be 1 (the ring shards the sequence over `ring_axis`
        alone); other values raise `NotImplementedError`.
    - `implementation`: the kernel of each ring step, as in
        `vidax_eqx.kernels.attention` (it must serve boolean masks when the mask has
        a dense part).
    - `layout`: `"contiguous"` (rank `r` holds the `r`-th block) or `"zigzag"` (rank
        `r` holds chunks `r` and `2n - 1 - r` of `2n`), as in [`ring_attention`][].
        The mask stays in global order in both: with zigzag, permute q, k, v and
        segment ids with `zigzag_permute` (never the mask) and unpermute the
        output; the kernel takes each block's sub-mask at its global positions, and
        skips hidden half-blocks.
    - `scale`: the logit scale, default `1 / sqrt(D)` as everywhere in vidax. The
        splash kernels do not scale: pass `scale=1.0` for queries scaled beforehand.

    **Returns:**

    A [`RingAttentionKernel`][]: call it as `kernel(q, k, v, segment_ids=None,
    sinks=None)` inside `jax.shard_map` with this device's `(B, L, H, D)` blocks
    (the global length `S = sp_size * L` must be the mask's). Outside a context
    that binds `ring_axis` it raises `ValueError("Ring axis 'sp' does not exist in
    the current context. ...")`.

    **Skipping and cost:** positional masks (full, causal, local and their `&` /
    `|`, which are always one window on `kv_pos - q_pos`) run from positions alone,
    exactly as `ring_attention(causal=..., window=...)`. A mask with a dense part
    plans each step from its block visibility: a block it hides entirely is
    skipped, a block it does not touch runs without a mask (as fast as no mask),
    any other gets its sub-mask (and the blockwise kernel skips the hidden tiles
    in it). The plan is made at trace time when the arrays are concrete (closed
    over, or built from NumPy), so skipped steps are not even traced; on device,
    from the traced mask, when the kernel is a `jax.jit` argument (every step then
    sits behind a `lax.switch`). A dense mask is `S^2` bytes on every device.
    """
    return RingAttentionKernel(
        mask,
        block_sizes=block_sizes,
        is_mqa=is_mqa,
        mask_value=mask_value,
        logits_soft_cap=logits_soft_cap,
        ring_axis=ring_axis,
        q_seq_shards=q_seq_shards,
        implementation=implementation,
        layout=layout,
        scale=scale,
    )
