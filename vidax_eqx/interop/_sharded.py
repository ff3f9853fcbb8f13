"""Building a sharded `jax.Array` from the blocks its process's devices hold.

A checkpoint loaded into a sharded layout (FSDP, Megatron) never needs a whole tensor
in one process: each process reads the blocks of its own (addressable) devices, each
distinct block once however many of its devices hold it (a replicated parameter is
read once per process, not once per device), and assembles the global array with
`jax.make_array_from_single_device_arrays`. In a multi-process `jax.distributed` job
every process does the same for its devices; nothing crosses processes.
"""

from collections.abc import Callable, Sequence

import jax
import numpy as np

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
