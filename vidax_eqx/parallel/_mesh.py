"""Meshes, axis checks, chunking and padding: the pieces every parallel path shares."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

from .._checks import positive_int
from .._vma import replicated_axes


DP_AXIS = "dp"
"""The data-parallel mesh axis name of [`vidax_eqx.parallel.make_mesh`][]: the batch."""
SP_AXIS = "sp"
"""The sequence-parallel mesh axis name of [`vidax_eqx.parallel.make_mesh`][]: tokens."""
TP_AXIS = "tp"
"""The tensor-parallel mesh axis name of [`vidax_eqx.parallel.make_mesh`][]: heads and
features (innermost)."""


def make_mesh(
    dp: int = 1,
    sp: int = 1,
    tp: int = 1,
    *,
    devices=None,
    extra_axes: dict[str, int] | None = None,
) -> Mesh:
    """A device mesh with axes `("dp", "sp", "tp")`, tensor parallelism innermost.

    **Arguments:**

    - `dp`, `sp`, `tp`: data-, sequence- and tensor-parallel sizes.
    - `devices`: the devices to use (default: the first `dp * sp * tp` of
        `jax.devices()`).
    - `extra_axes`: further named axes inserted between `sp` and `tp`, in order,
        e.g. `{"ring": 2}` for 2D sequence parallelism (`usp_attention`).

    **Returns:**

    A `jax.sharding.Mesh` whose axes are `Auto`, so `jax.shard_map` reshards its
    inputs as the in-specs ask.
    """
    clash = sorted({DP_AXIS, SP_AXIS, TP_AXIS} & set(extra_axes or {}))
    if clash:
        raise ValueError(
            f"`extra_axes` adds axes beside ('dp', 'sp', 'tp') and cannot redefine them; received "
            f"extra_axes={extra_axes!r} (clashes: {clash}). Set those sizes with dp=, sp=, tp=, "
            "or give the extra axis another name (e.g. 'ring')."
        )
    sizes = {DP_AXIS: dp, SP_AXIS: sp, **(extra_axes or {}), TP_AXIS: tp}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"mesh axis {name!r} must have a positive int size; received {size!r}.")
    need = math.prod(sizes.values())
    if devices is None:
        available = jax.devices()
        if need > len(available):
            raise ValueError(
                f"a mesh of {dict(sizes)} needs {need} devices; {len(available)} are available. "
                "On CPU, simulate more with XLA_FLAGS=--xla_force_host_platform_device_count=N "
                "set before JAX is imported."
            )
        devices = available[:need]
    devices = np.asarray(devices, dtype=object).reshape(-1)
    if devices.size != need:
        raise ValueError(
            f"a mesh of {dict(sizes)} needs {need} devices; received {devices.size}."
        )
    return Mesh(
        devices.reshape(tuple(sizes.values())),
        tuple(sizes),
        axis_types=(AxisType.Auto,) * len(sizes),
    )


def axis_size(axis_name: str, *, what: str = "Mesh") -> int:
    """The size of mesh axis `axis_name` in the current `shard_map` context.

    Raises `ValueError("{what} axis 'sp' does not exist in the current context.")`
    when the axis is not bound (called outside `shard_map`, or a typo).
    """
    try:
        return jax.lax.axis_size(axis_name)
    except (NameError, ValueError):  # ValueError: an int name JAX reads as a position
        raise ValueError(
            f"{what} axis {axis_name!r} does not exist in the current context. Call this "
            "inside `jax.shard_map` over a mesh that has that axis."
        ) from None


def _check_axis(x, axis, fn: str) -> int:
    """`axis` as a non-negative index of `x`'s axes; out of range is an error, not a wrap."""
    ndim = jnp.ndim(x)
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
        raise ValueError(
            f"{fn}: `axis` must be an int in [-{ndim}, {ndim}) for `x` of shape {jnp.shape(x)}; "
            f"received {axis!r}."
        )
    return int(axis) % ndim


def chunk_by_rank(x: jax.Array, axis: int, sp_size: int, rank) -> jax.Array:
    """This rank's contiguous share of `x` along `axis`.

    **Arguments:**

    - `x`: the full array.
    - `axis`: the axis to split.
    - `sp_size`: the number of ranks (static).
    - `rank`: this rank, an int or a traced scalar (e.g. `jax.lax.axis_index("sp")`).

    **Returns:**

    `x` sliced to `x.shape[axis] // sp_size` elements starting at
    `rank * x.shape[axis] // sp_size`. An uneven split raises `ValueError`: pad
    first with [`pad_to_multiple`][].
    """
    if isinstance(sp_size, bool) or not isinstance(sp_size, (int, np.integer)) or sp_size < 1:
        raise ValueError(f"`sp_size` must be a positive int; received {sp_size!r}.")
    axis = _check_axis(x, axis, "chunk_by_rank")
    # A concrete rank outside [0, sp_size) would be clamped by dynamic_slice to the
    # last chunk: a wrong answer, not an error. (A traced rank cannot be checked.)
    if isinstance(rank, (int, np.integer)) and not isinstance(rank, bool) and not 0 <= rank < sp_size:
        raise ValueError(
            f"chunk_by_rank: `rank` must be in [0, sp_size) = [0, {sp_size}); received {rank}."
        )
    n = x.shape[axis]
    if n % sp_size:
        raise ValueError(
            f"`x` axis {axis} has size {n}, which does not split evenly over sp_size={sp_size}; "
            f"pad it first (pad_to_multiple(x, {sp_size}, axis={axis}))."
        )
    size = n // sp_size
    return jax.lax.dynamic_slice_in_dim(x, rank * size, size, axis)


def gather_chunks(x: jax.Array, axis: int, axis_name: str) -> jax.Array:
    """Inverse of `chunk_by_rank` inside `shard_map`: all ranks' chunks, in rank order."""
    axis_size(axis_name)
    return jax.lax.all_gather(x, axis_name, axis=_check_axis(x, axis, "gather_chunks"), tiled=True)


def pad_to_multiple(x: jax.Array, multiple: int, axis: int = 1, value=0) -> jax.Array:
    """Pads `x` at the end of `axis` up to a multiple of `multiple`."""
    multiple = positive_int("pad_to_multiple", "multiple", multiple)
    axis = _check_axis(x, axis, "pad_to_multiple")
    extra = -x.shape[axis] % multiple
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def unpad(x: jax.Array, length: int, axis: int = 1) -> jax.Array:
    """Drops what [`pad_to_multiple`][] added: the first `length` entries of `axis`."""
    axis = _check_axis(x, axis, "unpad")
    size = x.shape[axis]
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or not 0 <= length <= size:
        raise ValueError(
            f"unpad: `length` (the true length before padding) must be an int in [0, {size}] for "
            f"axis {axis} of `x` of shape {x.shape}; received {length!r}."
        )
    return jax.lax.slice_in_dim(x, 0, int(length), axis=axis)


def padding_segment_ids(
    length: int, multiple: int, batch: int, segment_ids: jax.Array | None = None
) -> jax.Array:
    """Segment ids `(batch, padded_length)` that make padding invisible.

    Real tokens keep `segment_ids` (default: all 0); the padding added by
    [`pad_to_multiple`][] gets id -1, which attends to nothing and is seen by
    nothing, so any token count can be split over any number of devices.
    """
    fn = "padding_segment_ids"
    length = positive_int(fn, "length", length)
    multiple = positive_int(fn, "multiple", multiple)
    batch = positive_int(fn, "batch", batch)
    if segment_ids is None:
        segment_ids = jnp.zeros((batch, length), jnp.int32)
    segment_ids = jnp.asarray(segment_ids)
    if segment_ids.shape != (batch, length) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(
            f"{fn}: `segment_ids` must be the unpadded ids, int (batch, length) = "
            f"{(batch, length)}; received {segment_ids.dtype} {segment_ids.shape}."
        )
    return pad_to_multiple(segment_ids.astype(jnp.int32), multiple, axis=1, value=-1)


def check_sharded(fn: str, axes, **arrays) -> None:
    """Raises if an array that must be this device's chunk of a sequence sharded over
    `axes` is the same on every device of one of them (replicated).

    Only inside `shard_map(check_vma=True)`, where values know the axes they vary
    over; elsewhere nothing is known and nothing is checked. A replicated sequence
    passed as a chunk would be attended to once per device: a wrong answer.
    """
    for name, x in arrays.items():
        if x is None:
            continue
        for axis in replicated_axes(x, axes)[:1]:
            raise ValueError(
                f"{fn}: `{name}` must be this device's chunk of a sequence sharded over "
                f"the mesh axis {axis!r}, but it is the same on every device of {axis!r} "
                f"(replicated): the sequence would be counted once per device. Shard it "
                f"over {axis!r} (in_specs P(None, {axis!r}) for (B, S, H, D)), or call "
                "single-device attention (vidax_eqx.kernels.attention) on a replicated "
                "sequence."
            )
