"""Scanned layers: a model's stacked blocks run by `lax.scan`, with rematerialization,
FSDP's gather of one block at a time, and blocks streamed from host memory."""

import equinox as eqx
import jax
from jax import lax

from ..nn import sharding
from ..nn.internal import has_shards, regather_policy


REMAT_POLICIES = (
    "full",
    "everything_saveable",
    "nothing_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
)
"""The rematerialization policies a model's `remat=` accepts besides `None` (store
activations): `"full"` (save nothing, recompute everything) and the policies of
`jax.checkpoint_policies` that take no argument."""
_NO_REMAT = object()


def check_remat(remat):
    """`remat` as a `jax.checkpoint` policy: `_NO_REMAT` for None, `None` for "full"."""
    if remat is None:
        return _NO_REMAT
    if remat not in REMAT_POLICIES:
        raise ValueError(
            f"`remat` must be None or one of {REMAT_POLICIES}; received {remat!r}."
        )
    return None if remat == "full" else getattr(jax.checkpoint_policies, remat)


def in_host_memory(a) -> bool:
    """Whether the array (or tracer) `a` lives in host memory (a `pinned_host` /
    `unpinned_host` memory kind): a streamed block's weights. A traced program sees the
    memory kind of an argument placed with a `NamedSharding` (JAX 0.10 puts no memory
    space in the type of one placed with a `SingleDeviceSharding`):
    `vidax_eqx.pipelines`' plan places them so."""
    return getattr(jax.typeof(a), "memory_space", None) == jax.memory.Space.Host


def scan(step, carry, xs):
    """`lax.scan(step, carry, xs)` over the leading (layer) axis of `xs`, where the leaves
    of `xs` in host memory (blocks streamed from the host: [`in_host_memory`][]) reach
    `step` on the device: each step's slice is copied in (`jax.device_put` to device
    memory inside the loop, which XLA turns into a copy from host memory). Without host
    leaves this is `lax.scan`. Inference: the copies have no transpose into host
    memory. (On a TPU v5e, Wan 14B's guided step at 480p runs at 0.999x its resident
    time: XLA overlaps each block's copy with the step before it; `docs/benchmarks.md`.)"""
    if not any(in_host_memory(a) for a in jax.tree.leaves(xs)):
        return lax.scan(step, carry, xs)

    def body(carry, layer):
        layer = jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device)
                             if in_host_memory(a) else a, layer)
        return step(carry, layer)

    return lax.scan(body, carry, xs)


def scan_layers(fn, x, layers, policy):
    """`x = fn(x, layer)` for each layer of a stacked module (arrays with a leading layer
    axis, e.g. built with `eqx.filter_vmap`), by `lax.scan`, each step under
    `jax.checkpoint(policy=policy)` unless `policy` is `_NO_REMAT`.

    With FSDP (the layers' weights are [`vidax_eqx.nn.sharding.FSDPShard`][]s inside
    `shard_map`) every step is checkpointed, with `policy` (everything saveable for
    `_NO_REMAT`) made to never save a gathered weight: one block is gathered at a time,
    and gathered again in the backward pass (unless the configuration's
    `fsdp_regather` is `False`)."""
    arrays, static = eqx.partition(layers, eqx.is_array)

    def step(x, layer_arrays):
        return fn(x, eqx.combine(layer_arrays, static)), None

    if has_shards(layers):
        # FSDP: each step gathers its block's weights (the block's own fsdp_gather);
        # the backward pass gathers them again instead of keeping every block's.
        keep = not all(c.fsdp_regather for c in jax.tree.leaves(layers)
                       if isinstance(c, sharding.ParallelConfig))
        base = jax.checkpoint_policies.everything_saveable if policy is _NO_REMAT else policy
        policy = regather_policy(base, keep=keep)
        step = jax.checkpoint(step, policy=policy)
    elif policy is not _NO_REMAT:
        step = jax.checkpoint(step, policy=policy)
    return scan(step, x, arrays)[0]


def scan_layers_with_outputs(fn, x, layers):
    """`x, y = fn(x, layer)` for each layer of a stacked module, by `lax.scan`: the final
    `x` and the `y`s stacked over the layers (inference: no rematerialization, no FSDP)."""
    arrays, static = eqx.partition(layers, eqx.is_array)

    def step(x, layer_arrays):
        return fn(x, eqx.combine(layer_arrays, static))

    return scan(step, x, arrays)
