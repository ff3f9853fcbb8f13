"""Sequence layouts of the ring: which global positions each rank's block holds.

`"contiguous"`: rank `r` holds the `r`-th block of the global sequence.
`"zigzag"`: the global sequence is cut into `2n` chunks and rank `r` holds chunks
`r` and `2n - 1 - r` (an early and a late part, which balances causal work);
[`zigzag_permute`][] / [`zigzag_unpermute`][] move a global array in and out of
that order. A block's positions are a static function of (rank, layout), so they
never travel the ring, and the ring's schedule (`_schedule.py`) is decided from
them at trace time, per part of a block (a zigzag block has two).
"""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from ._checks import check_sp_size


LAYOUTS = ("contiguous", "zigzag")
"""The sequence layouts of a ring, what `layout=` takes: `"contiguous"` (rank `r`
holds the `r`-th block of the global sequence) and `"zigzag"` (the sequence cut into
`2n` chunks, rank `r` holding chunks `r` and `2n - 1 - r`, which balances causal
work; [`zigzag_permute`][] puts a global array in that order)."""


def check_layout(layout) -> str:
    """`layout`, or a `ValueError` unless it is one of `LAYOUTS`."""
    if layout not in LAYOUTS:
        raise ValueError(
            f"`layout` must be one of {LAYOUTS}; received {layout!r}."
        )
    return layout


def check_zigzag_length(length: int, what: str, fix: str) -> None:
    """A `ValueError` (naming `what`, suggesting `fix`) unless the zigzag layout can
    cut `length` into two halves."""
    if length % 2:
        raise ValueError(
            f"the zigzag layout needs an even {what} (each device holds two half-chunks); "
            f"received {length}. {fix}"
        )


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
    check_layout(layout)
    n = check_sp_size(sp_size)
    if layout == "zigzag":
        check_zigzag_length(length, "local length", "Pad the sequence to a multiple of 2 * sp_size.")
    return block_positions(jnp, length, n, rank, layout)


def block_positions(xp, length: int, n: int, rank, layout: str):
    """`ring_positions` in `xp` (`jnp`, or `np` for a static rank), unchecked."""
    if layout == "contiguous":
        return rank * length + xp.arange(length, dtype=xp.int32)
    c = length // 2
    local = xp.arange(c, dtype=xp.int32)
    return xp.concatenate([rank * c + local, (2 * n - 1 - rank) * c + local])


def layout_parts(layout: str) -> int:
    """Chunks per local block: the granularity of the ring-level skip."""
    return 2 if layout == "zigzag" else 1


def part_slices(length: int, parts: int) -> list[slice]:
    """The `parts` equal slices of a local block of `length` tokens, in local order."""
    c = length // parts
    return [slice(i * c, (i + 1) * c) for i in range(parts)]


def _zigzag_order(sp_size: int) -> np.ndarray:
    """Chunk order of the zigzag layout: `[0, 2n-1, 1, 2n-2, ...]`."""
    n = sp_size
    return np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1).reshape(-1)


def _permute_chunks(x, axis: int, sp_size: int, order: np.ndarray, name: str):
    n = check_sp_size(sp_size)
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
