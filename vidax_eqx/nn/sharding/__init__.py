"""How the layers of [`vidax_eqx.nn`][] run over a device mesh, and where their
parameters go: every placement name in one place.

- [`ParallelConfig`][]: the role of each mesh axis for a layer (sequence split over a
    Ulysses and/or a ring axis, heads over a tensor-parallel axis, parameters over FSDP
    axes); [`with_parallel`][] sets it on every layer of a model.
- [`partition_specs`][], [`shard_module`][], [`shard_like`][],
    [`replicated_parameters`][]: the `PartitionSpec` of every parameter (Megatron, FSDP),
    and arrays placed by them (a model, an optimizer state).
- [`filter_shard_map`][]: `jax.shard_map` for arguments that hold modules.
- [`shard_tokens`][], [`gather_tokens`][]: a per-token array's share of each device in
    the configuration's layout, and the whole sequence back.
- [`fsdp_gather`][], [`FSDPShard`][]: FSDP inside `shard_map`, each layer's weights
    gathered just before use.
- [`AbstractParallelLayer`][], [`MegatronSplit`][]: what a layer declares so that the
    functions above place it (subclass it for a layer of your own).

Meshes and the array-level pieces (`make_mesh`, the axis names, padding, zigzag) are in
[`vidax_eqx.parallel`][].
"""

from ._config import fsdp_axes_of as fsdp_axes_of, ParallelConfig as ParallelConfig
from ._fsdp import fsdp_gather as fsdp_gather, FSDPShard as FSDPShard
from ._parallel_layer import (
    AbstractParallelLayer as AbstractParallelLayer,
    MegatronSplit as MegatronSplit,
)
from ._placement import (
    partition_specs as partition_specs,
    replicated_parameters as replicated_parameters,
    shard_like as shard_like,
    shard_module as shard_module,
    with_parallel as with_parallel,
)
from ._shard_map import filter_shard_map as filter_shard_map
from ._tokens import gather_tokens as gather_tokens, shard_tokens as shard_tokens
