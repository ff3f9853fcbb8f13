"""The 2D mask algebra of `make_ring_attention`: masks over a sequence's global positions.

Masks are over **global positions** of one sequence attending to itself
(`mask[i, j]`: may the query at position `i` see the key at position `j`):

- a dense `(S, S)` boolean NumPy array ([`DenseMask`][]);
- structured masks that never materialize `(S, S)`: [`FullMask`][],
  [`CausalMask`][], [`LocalMask`][], and their combinations with `&` and `|`
  ([`LogicalAnd`][], [`LogicalOr`][]), dense arrays included.

Full, causal and local masks, and any `&` / `|` of them, are one window on
`kv_pos - q_pos` (every such window contains the diagonal, so the union of two is
again a window): `AbstractMask.window()` returns it. Any other mask is the
positional factors of its top-level `&` and a rest (`split`), evaluated at given
global positions (`AbstractMask.block`) and tabulated per block of positions
([`AbstractMask.block_visibility`][], `block_tables`). How the ring runs them is
`_ring_kernel.py`'s.

**Two mask vocabularies, on purpose.** `vidax_eqx.kernels` has its own structured
mask, [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask] (sliding tile
attention, per-head windows), which every kernel call takes as `mask=` beside a
boolean array, and which `ring_attention(mask=...)`, `usp_attention(mask=...)` and
`RankMasks` (`_rank_masks.py`: one `SlidingTileMask` per rank when heads are split
over a mesh axis) pass down unchanged. The two are not merged:

- `kernels` sits below `parallel` and cannot import it, so a `SlidingTileMask`
  cannot be an `AbstractMask`; and the kernels' `mask=` accepting `AbstractMask`
  would move this algebra into `kernels` and widen what every implementation
  validates and serves.
- They are different kinds of objects. A `SlidingTileMask` is hashable static
  structure (a frozen dataclass: it keys `_schedule.tile_plan`'s cache, and is a
  static field of the ring's configuration), decoded per tile inside the kernels.
  An `AbstractMask` is an `eqx.Module` PyTree whose dense arrays are leaves, so a
  [`RingAttentionKernel`][] can carry a traced mask through `jax.jit`, and it only
  ever reaches a kernel as plain boolean `mask=` blocks (or as `causal` / `window`).

They meet in one place: a `SlidingTileMask` given to `make_ring_attention` becomes
an `AbstractMask` by `as_mask` (a private wrapper), so it combines with the masks
here. Alone or `&`-ed with positional masks, `RingAttentionKernel` takes it back
out (`sliding_tile`) and runs `ring_attention(mask=...)`, so the kernels evaluate
it natively (per-head windows allowed, nothing materialized); in any other
combination its blocks are materialized from `SlidingTileMask.visible` (shared
windows only).
"""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from .. import kernels
# The kernels' rule for every `window=` (private to kernels/_args.py, which has no public name for it).
from ..kernels.internal import check_window as _kernel_check_window


Window = tuple[int | None, int | None]  # (left, right): -left <= kv_pos - q_pos <= right


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
    """`LocalMask`'s window: the kernels' rule for `window=`, with messages that name
    `LocalMask`, and no `None` (a `LocalMask` always has a window)."""
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(
            f"`LocalMask(window=...)` must be a pair (left, right) of non-negative ints or None "
            f"(unbounded); received {window!r}."
        )
    sides = []
    for side, w in zip(("left", "right"), window):
        try:
            sides.append(_kernel_check_window((w, None))[0])
        except ValueError:
            raise ValueError(
                f"`LocalMask(window=...)` {side} size must be a non-negative int or None "
                f"(unbounded); received {w!r}."
            ) from None
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


def as_mask(x) -> AbstractMask:
    """`x` as a mask: an `AbstractMask` itself, a boolean array as a [`DenseMask`][], a
    `kernels.SlidingTileMask` wrapped (see the module docstring), or a `TypeError`."""
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
    (what `as_mask` makes of one). Alone, or `&`-ed with positional masks, it runs
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
        self.left, self.right = as_mask(left), as_mask(right)
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
        self.left, self.right = as_mask(left), as_mask(right)
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


# -- what the ring kernel object reads of a mask ----------------------------------------


def split(mask: AbstractMask) -> tuple[Window, AbstractMask | None]:
    """`(window, rest)` with `mask == window & rest`: the positional factors of its
    top-level `&` as one window on `kv_pos - q_pos`, and the rest (`None`: all True)."""
    return mask._split()


def block_tables(mask: AbstractMask, seq_len: int, block_size: int):
    """`(any, all)` bool `(S / b, S / b)`: [`AbstractMask.block_visibility`][], and which
    `(query block, key block)` pairs are entirely `True` (NumPy, or traced JAX arrays
    for a traced mask)."""
    return mask._block_tables(seq_len, block_size)


def sliding_tile(mask: AbstractMask | None) -> kernels.SlidingTileMask | None:
    """The `kernels.SlidingTileMask` that `mask` wraps, when `as_mask` made it from one."""
    return mask.tile if isinstance(mask, _TileMask) else None
