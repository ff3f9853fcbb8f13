"""`jax.shard_map` for arguments that hold Equinox modules."""

import equinox as eqx
import jax

from ..._jax_private import refuse_empty_shard_map_inputs
from ._config import fsdp_axes_of
from ._fsdp import unwrap_shards, wrap_shards


def filter_shard_map(fn, *, mesh, in_specs, out_specs, **kwargs):
    """`jax.shard_map` for arguments that hold Equinox modules: the Equinox idiom
    (`eqx.filter_jit`, `eqx.filter_grad`) for `shard_map`.

    A module's non-array leaves (its [`ParallelConfig`][vidax_eqx.nn.sharding.ParallelConfig], activation functions) are
    not JAX types, so `jax.shard_map` cannot take them; here every argument is
    split with `eqx.partition(args, eqx.is_array)`, only the arrays cross the
    `shard_map` boundary, and `fn` gets the modules back whole on every device.
    [`partition_specs`][vidax_eqx.nn.sharding.partition_specs]`(module, mesh)` is the in_spec of a module (its non-array
    leaves get `None`, which matches). Under FSDP (`fsdp_axes`), a parameter whose
    in_spec names an FSDP axis reaches `fn` as an [`FSDPShard`][vidax_eqx.nn.sharding.FSDPShard] (which the modules
    gather just before use, [`fsdp_gather`][vidax_eqx.nn.sharding.fsdp_gather]), and any `FSDPShard` `fn` returns (e.g.
    in gradients) leaves as its local slice. `fn` must return arrays (or `None` leaves,
    as `eqx.filter_grad`'s gradients have).

    **Arguments:**

    - `fn`: the per-device function.
    - `mesh`, `in_specs`, `out_specs`, `**kwargs`: as for `jax.shard_map`; `in_specs`
        is a tuple with one entry per positional argument.

    **Returns:**

    A function of the same arguments as `fn`, callable under `eqx.filter_jit`, or
    under `jax.jit` when it closes over the modules.
    """

    in_specs = tuple(in_specs)

    def call(*args):
        dynamic, static = eqx.partition(args, eqx.is_array)
        refuse_empty_shard_map_inputs("filter_shard_map", mesh, dynamic)
        fsdp = [fsdp_axes_of(arg) for arg in args]

        def per_device(*dynamic):
            # Parameters split over FSDP axes enter as `FSDPShard`s (their in_spec says
            # which dimension), for the modules to gather just before use.
            args = eqx.combine(dynamic, static)
            if len(in_specs) == len(args):
                args = tuple(wrap_shards(a, spec, axes) if axes else a
                             for a, spec, axes in zip(args, in_specs, fsdp))
            return unwrap_shards(fn(*args))

        return jax.shard_map(
            per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kwargs
        )(*dynamic)

    return call
