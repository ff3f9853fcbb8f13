"""Halo exchange: a spatially split array borrows the edge rows of its neighbours.

A convolution over an axis split into contiguous blocks over a mesh axis needs, on each
device, the rows of the neighbouring blocks that its window reaches. `halo_exchange`
prepends the previous device's last `before` rows and appends the next device's first
`after` rows (one `ppermute` each way), with zeros past the ends of the global axis, so
a convolution with `"VALID"` padding on the result equals the zero-padded convolution of
the whole array, block by block. Splitting two axes (height and width) is two calls, one
per axis: the second carries the first one's halo rows, so the corners are right too.
"""

from collections.abc import Hashable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .._checks import is_int
from ._mesh import axis_size


def halo_exchange(x: jax.Array, axis_name: Hashable, axis: int, before: int, after: int) -> jax.Array:
    """This device's block of an array split along `axis` over the mesh axis `axis_name`,
    with its neighbours' edge rows attached.

    Call it inside `jax.shard_map`, where device `r` of `axis_name` holds block `r` of the
    global axis (contiguous blocks, in order). Differentiable: the gradient of the
    borrowed rows flows back to the device that owns them.

    **Arguments:**

    - `x`: this device's block.
    - `axis_name`: the mesh axis the array's `axis` is split over.
    - `axis`: the split axis of `x` (negative counts from the end).
    - `before`, `after`: how many rows of the previous and the next device to attach (a
        convolution of width `k` with `"SAME"` padding needs `(k - 1) // 2` and `k // 2`);
        each at most the block's length.

    **Returns:**

    `x` with `before` rows in front and `after` behind along `axis`: the neighbours' rows,
    zeros at the ends of the global axis (the first device's front, the last one's back).
    """
    x = jnp.asarray(x)
    if not is_int(axis) or not -x.ndim <= axis < x.ndim:
        raise ValueError(
            f"halo_exchange: `axis` must be an int in [-{x.ndim}, {x.ndim}) for `x` of shape "
            f"{x.shape}; received {axis!r}."
        )
    axis = int(axis) % x.ndim
    length = x.shape[axis]
    for name, rows in (("before", before), ("after", after)):
        if not is_int(rows) or not 0 <= rows <= length:
            raise ValueError(
                f"halo_exchange: `{name}` must be an int in [0, {length}] (this device's block of "
                f"axis {axis} holds {length} rows; a wider halo would need more than one "
                f"neighbour); received {rows!r}."
            )
    n = axis_size(axis_name)

    def shift(rows, perm):
        return jax.lax.ppermute(rows, axis_name, perm) if n > 1 else jnp.zeros_like(rows)

    parts = []
    if before:  # device r receives the last `before` rows of device r - 1
        tail = jax.lax.slice_in_dim(x, length - before, length, axis=axis)
        parts.append(shift(tail, [(r, r + 1) for r in range(n - 1)]))
    parts.append(x)
    if after:  # ... and the first `after` rows of device r + 1
        head = jax.lax.slice_in_dim(x, 0, after, axis=axis)
        parts.append(shift(head, [(r + 1, r) for r in range(n - 1)]))
    return jnp.concatenate(parts, axis=axis) if len(parts) > 1 else x


class SpatialSplit(NamedTuple):
    """Where a frame's height and width are split over mesh axes: what a convolutional
    layer needs to run on its block of a frame inside `jax.shard_map`.

    Device `(i, j)` of the two axes holds the contiguous block `i` of the rows and `j`
    of the columns. A field of `None` is an axis that is not split (one device, or the
    whole extent on every device): padding there is plain zeros. The default
    `SpatialSplit()` is one device.

    **Fields:**

    - `height_axis`: the mesh axis the rows are split over, or `None`.
    - `width_axis`: the mesh axis the columns are split over, or `None`.
    """

    height_axis: Hashable | None = None
    width_axis: Hashable | None = None

    @property
    def axes(self) -> tuple:
        """The mesh axes that split the frame (height first), for collectives over the
        whole frame (a GroupNorm's statistics, attention over a frame's tokens)."""
        return tuple(a for a in (self.height_axis, self.width_axis) if a is not None)

    def pad(self, x: jax.Array, height: tuple[int, int] = (0, 0),
            width: tuple[int, int] = (0, 0)) -> jax.Array:
        """`x` (height and width its last two axes) with `height = (top, bottom)` rows
        and `width = (left, right)` columns attached: the neighbours' edge rows over a
        split axis ([`halo_exchange`][]), zeros at the frame's edges and over an axis
        that is not split. A convolution with `"VALID"` padding on the result equals the
        zero-padded convolution of the whole frame, block by block."""
        for axis, name, (before, after) in ((-2, self.height_axis, height),
                                            (-1, self.width_axis, width)):
            if not (before or after):
                continue
            if name is None:
                pads = [(0, 0)] * x.ndim
                pads[axis] = (before, after)
                x = jnp.pad(x, pads)
            else:
                x = halo_exchange(x, name, axis, before, after)
        return x

    def sum(self, x: jax.Array) -> jax.Array:
        """`x` summed over the devices that hold the frame's blocks (the identity on one
        device): the frame-wide total of a per-block partial sum."""
        return jax.lax.psum(x, self.axes) if self.axes else x
