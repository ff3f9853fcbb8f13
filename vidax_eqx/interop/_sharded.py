"""Building a sharded `jax.Array` from the blocks its process's devices hold.

A checkpoint loaded into a sharded layout (FSDP, Megatron) never needs a whole tensor
in one process: each process reads the blocks of its own (addressable) devices, each
distinct block once however many of its devices hold it (a replicated parameter is
read once per process, not once per device), and assembles the global array with
`jax.make_array_from_single_device_arrays`. In a multi-process `jax.distributed` job
every process does the same for its devices; nothing crosses processes.

A stacked parameter `(L, ...)` (layers built with `eqx.filter_vmap`, one checkpoint
tensor per layer) whose layer axis is not split is filled one layer at a time into a
placed buffer updated in place, so the host holds one layer's blocks at a time, never
this process's share of the whole stack.
"""

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ._slices import normalize_index


def place_sharded(shape: tuple[int, ...], sharding: jax.sharding.Sharding,
                  read: Callable[[Sequence[tuple]], list[np.ndarray]], what: str) -> jax.Array:
    """The global array of `shape` placed by `sharding`, its addressable shards from `read`.

    **Arguments:**

    - `shape`: the global shape.
    - `sharding`: where the array lives (e.g. `NamedSharding(mesh, spec)`), splitting
        `shape` evenly; only its addressable devices are filled.
    - `read`: `read(indices) -> arrays`: the blocks (tuples of slices, as
        `Sharding.addressable_devices_indices_map` gives) as new NumPy arrays in the
        array's dtype. Called once, with each distinct block once.
    - `what`: the parameter's name, for errors.

    **Returns:**

    A committed `jax.Array` with `sharding`.
    """
    shape = tuple(shape)
    index_map = sharding.addressable_devices_indices_map(shape)
    shard_shape = sharding.shard_shape(shape)  # load_state_dict checked that it divides
    blocks: dict[tuple, tuple[tuple, list]] = {}
    for device, index in index_map.items():
        key = normalize_index(index, shape, what)
        blocks.setdefault(key, (index, []))[1].append(device)
    arrays = read([index for index, _ in blocks.values()])
    buffers = []
    for (_, devices), array in zip(blocks.values(), arrays):
        if array.shape != shard_shape:  # pragma: no cover - a reader's bug
            raise ValueError(f"{what}: read a block of shape {array.shape}, expected {shard_shape}.")
        buffers += [jax.device_put(array, device) for device in devices]
    # Wait for the copies, so the host blocks can go before the next parameter's.
    jax.block_until_ready(buffers)
    return jax.make_array_from_single_device_arrays(shape, sharding, buffers)


@functools.partial(jax.jit, donate_argnums=0)
def set_layer(stack, layer, index):
    """`stack` with `stack[index] = layer`, in place (the old buffer is donated)."""
    return jax.lax.dynamic_update_index_in_dim(stack, layer, index, 0)


def layer_sharding(sharding: jax.sharding.Sharding) -> NamedSharding | None:
    """The sharding of one layer of an array placed by `sharding` when its leading
    (layer) axis is not split: the same mesh and spec without its first entry; `None`
    otherwise (then the layers cannot be placed one at a time)."""
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec)
    if spec and spec[0] is not None:
        return None
    return NamedSharding(sharding.mesh, P(*spec[1:]), memory_kind=sharding.memory_kind)


def place_stacked_sharded(shape: tuple[int, ...], dtype, sharding: NamedSharding,
                          read_layer: Callable[[int, Sequence[tuple]], list[np.ndarray]],
                          what: str) -> jax.Array:
    """The stacked array of `shape` `(L, ...)` placed by `sharding` (layer axis not
    split: [`layer_sharding`][] is not `None`), filled one layer at a time.

    **Arguments:**

    - `shape`, `dtype`: the stacked array's.
    - `sharding`: its placement.
    - `read_layer`: `read_layer(layer, indices) -> arrays`: the blocks of one layer's
        tensor, as `read` of [`place_sharded`][].
    - `what`: the parameter's name, for errors.

    **Returns:**

    A committed `jax.Array` with `sharding`.
    """
    one = layer_sharding(sharding)
    stack = jnp.zeros(shape, dtype, device=sharding)
    for layer in range(shape[0]):
        array = place_sharded(tuple(shape[1:]), one, functools.partial(read_layer, layer), what)
        # Wait for each update: the next layer's blocks come only after this one's went.
        stack = jax.block_until_ready(set_layer(stack, array, np.int32(layer)))
    return stack
