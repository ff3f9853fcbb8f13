"""Scanned layers: a model's stacked blocks run by `lax.scan`, with rematerialization,
FSDP's gather of one block at a time, and blocks streamed from host memory."""

import equinox as eqx
import jax
import jax.numpy as jnp
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
    `unpinned_host` memory kind): a streamed block's weights."""
    return getattr(jax.typeof(a), "memory_space", None) == jax.memory.Space.Host


def scan(step, carry, xs):
    """`lax.scan(step, carry, xs)` over the leading (layer) axis of `xs`, where the leaves
    of `xs` in host memory (blocks streamed from the host: [`in_host_memory`][]) reach
    `step` on the device, double-buffered: layer `i + 1`'s weights are copied in while
    layer `i` computes (the copy depends on nothing the step computes, so XLA overlaps
    the two), one layer's copy in flight and one in use. Without host leaves this is
    `lax.scan`. Inference: the copies have no transpose into host memory."""
    leaves, treedef = jax.tree.flatten(xs)
    host = [in_host_memory(a) for a in leaves]
    if not any(host):
        return lax.scan(step, carry, xs)
    n = leaves[host.index(True)].shape[0]

    def fetch(i):  # layer i of every host leaf, on the device
        return [jax.device_put(lax.dynamic_index_in_dim(a, i, keepdims=False), jax.memory.Space.Device)
                for a, h in zip(leaves, host) if h]

    def merge(device_layer, scanned):
        it, jt = iter(device_layer), iter(scanned)
        return jax.tree.unflatten(treedef, [next(it) if h else next(jt) for h in host])

    def body(state, scanned):
        carry, current, i = state
        following = fetch(jnp.minimum(i + 1, n - 1))  # in flight while this layer computes
        carry, y = step(carry, merge(current, scanned))
        return (carry, following, i + 1), y

    rest = [a for a, h in zip(leaves, host) if not h]
    (carry, _, _), ys = lax.scan(body, (carry, fetch(0), jnp.int32(0)), rest, length=n)
    return carry, ys


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
