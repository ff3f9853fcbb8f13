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
    `unpinned_host` memory kind): a streamed block's weights. A traced program sees the
    memory kind of an argument placed with a `NamedSharding` (JAX 0.10 puts no memory
    space in the type of one placed with a `SingleDeviceSharding`):
    `vidax_eqx.pipelines`' plan places them so."""
    return getattr(jax.typeof(a), "memory_space", None) == jax.memory.Space.Host


class HostWords(eqx.Module):
    """An int8 matrix streamed from host memory, held there as 32-bit words: four int8
    values a word along the last axis (`(..., n)` int8 as `(..., n // 4)` uint32).

    XLA's TPU backend cannot copy one layer of an int8 stack out of host memory with the
    layout it computes on (int8's tiling differs between the two), and instead copies
    the whole stack to the chip, re-tiles it and writes it back to host memory on every
    call (measured on a TPU v5e: 0.4 GB/s in place of 14 GB/s, the copy not hidden). A
    stack of words has one tiling everywhere: each layer's words are copied in as a
    bfloat16 matrix is, and turned back into int8 on the chip by a bitcast (exact: the
    same bits). [`pack_int8`][] makes one; [`scan`][] unpacks each layer's."""

    words: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.words.shape[:-1], 4 * self.words.shape[-1])

    def unpack(self) -> jax.Array:
        return lax.bitcast_convert_type(self.words, jnp.int8).reshape(self.shape)


def packable(a) -> bool:
    """Whether `a` is an int8 matrix [`pack_int8`][] stores as words."""
    return a.dtype == jnp.int8 and a.ndim >= 2 and a.shape[-1] % 4 == 0


@jax.jit
def _words(a):
    return lax.bitcast_convert_type(a.reshape(*a.shape[:-1], a.shape[-1] // 4, 4), jnp.uint32)


def _computable(a: jax.Array) -> jax.Array:
    """`a`, on its device when it is in host memory (where nothing computes)."""
    if getattr(a.sharding, "memory_kind", None) in ("pinned_host", "unpinned_host"):
        return jax.device_put(a, a.sharding.with_memory_kind("device"))
    return a


def pack_int8(a: jax.Array, sharding) -> HostWords:
    """The int8 array `a` (see [`packable`][]) as [`HostWords`][] placed by `sharding`
    (host memory), packed where `a` lives (on its device when it is in host memory)."""
    return HostWords(jax.device_put(_words(_computable(a)), sharding))


def unpacked(tree):
    """`tree` with each [`HostWords`][] as its int8 matrix, in the memory the words were
    in (words in host memory are unpacked on their device): what a checkpoint or any
    code outside the blocks' scan reads."""
    is_words = lambda x: isinstance(x, HostWords)  # noqa: E731
    return jax.tree.map(
        lambda w: jax.device_put(HostWords(_computable(w.words)).unpack(), w.words.sharding)
        if is_words(w) else w, tree, is_leaf=is_words)


def partition_layers(layers):
    """`eqx.partition(layers, eqx.is_array)`, a [`HostWords`][] whole on the arrays'
    side (its layers unpacked in [`scan`][] stand where it stood)."""
    is_words = lambda x: isinstance(x, HostWords)  # noqa: E731
    return eqx.partition(layers, lambda x: is_words(x) or eqx.is_array(x), is_leaf=is_words)


def scan(step, carry, xs):
    """`lax.scan(step, carry, xs)` over the leading (layer) axis of `xs`, where the leaves
    of `xs` in host memory (blocks streamed from the host: [`in_host_memory`][]) reach
    `step` on the device: each step's slice is copied in (`jax.device_put` to device
    memory inside the loop, which XLA turns into a copy from host memory), and a
    [`HostWords`][] reaches it as its int8 matrix (`xs` from [`partition_layers`][]).
    Without host leaves this is `lax.scan`. Inference: the copies have no transpose into host
    memory. (On a TPU v5e, Wan 14B's guided step at 480p runs at 0.999x its resident
    time: XLA overlaps each block's copy with the step before it; `docs/benchmarks.md`.)"""
    is_words = lambda a: isinstance(a, HostWords)  # noqa: E731
    if not any(is_words(a) or in_host_memory(a) for a in jax.tree.leaves(xs, is_leaf=is_words)):
        return lax.scan(step, carry, xs)

    def to_device(a):
        return jax.device_put(a, jax.memory.Space.Device) if in_host_memory(a) else a

    def body(carry, layer):
        layer = jax.tree.map(lambda a: HostWords(to_device(a.words)).unpack() if is_words(a)
                             else to_device(a), layer, is_leaf=is_words)
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
    arrays, static = partition_layers(layers)

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
    arrays, static = partition_layers(layers)

    def step(x, layer_arrays):
        return fn(x, eqx.combine(layer_arrays, static))

    return scan(step, x, arrays)
