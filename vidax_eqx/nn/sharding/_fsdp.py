"""Fully sharded parameters (FSDP / ZeRO-3) inside `shard_map`: the marker a sharded
parameter carries there, the gather each module does just before it uses its weights,
and the rematerialization policy that gathers them again in the backward pass.

Outside `shard_map` a parameter is always a global array, placed by
[`vidax_eqx.nn.sharding.partition_specs`][] with the FSDP axes of its
[`ParallelConfig`][vidax_eqx.nn.sharding.ParallelConfig] on one of its dimensions.
[`vidax_eqx.nn.sharding.filter_shard_map`][] hands every device its slice wrapped in an
[`FSDPShard`][] that records that dimension and those axes (read off the in_spec,
so no rule has to be inverted from a local shape), and modules call
[`fsdp_gather`][] on themselves first: one `all_gather` per parameter, issued in one
order on every device (`vidax_eqx._order`), whose transpose reduce-scatters the
gradient, so a device only ever holds its slice of the gradients.
"""

import equinox as eqx
import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from ..._order import after, Sequence, tokens
from ..._vma import varying_axes


GATHERED = "vidax_eqx.fsdp_gathered"
"""The `checkpoint_name` of every weight [`fsdp_gather`][] returns: the backward
pass gathers it again instead of keeping it (see [`regather_policy`][])."""


class FSDPShard(eqx.Module):
    """This device's slice of a parameter split over FSDP axes, inside `shard_map`.

    Made by [`vidax_eqx.nn.sharding.filter_shard_map`][] from the parameter's in_spec and
    turned back into the whole parameter by [`vidax_eqx.nn.sharding.fsdp_gather`][]. `dim` counts from the
    end (negative), so the slice of a stacked layer taken by `lax.scan` keeps it.

    **Fields:** `shard` (the local slice), static `dim`, `axes` (the FSDP mesh axes the
    slice is taken over, major to minor, as in its `PartitionSpec` entry) and
    `inner_axes` (further axes of the same entry, innermost: the tensor-parallel axis
    for a parameter that tensor parallelism does not split otherwise; its devices see
    the same data, so that part is gathered into a value that does not vary over
    them, and its transpose is a slice, no communication).
    """

    shard: jax.Array
    dim: int = eqx.field(static=True)
    axes: tuple[str, ...] = eqx.field(static=True)
    inner_axes: tuple[str, ...] = eqx.field(static=True, default=())

    @property
    def dtype(self):
        return self.shard.dtype


def is_shard(x) -> bool:
    return isinstance(x, FSDPShard)


def has_shards(tree) -> bool:
    """Whether `tree` holds any [`FSDPShard`][] (a module inside `shard_map` whose
    weights are still split)."""
    return any(is_shard(leaf) for leaf in jax.tree.leaves(tree, is_leaf=is_shard))


def fsdp_gather(tree, inputs=None, *, exclude=None):
    """The whole weights of `tree` (a module, or any PyTree of them), gathered over their
    FSDP axes, and `inputs` made to wait for them.

    Call it first thing in a module's `__call__` inside `jax.shard_map`:
    `self, x = fsdp_gather(self, x)`. Every [`FSDPShard`][] leaf becomes the global
    parameter (its Megatron slice under tensor parallelism) by one tiled `all_gather`
    over its axes, named for the models' rematerialization policy (which never keeps
    it for the backward pass, but gathers it again there); everything else
    is returned as it is, so with no shards (one device, replicated weights, or weights
    an enclosing module already gathered) this is `(tree, inputs)` and costs nothing.

    The order is the library's one collective order (`vidax_eqx._order`): the first
    gather waits for `inputs`, each gather for the one before, and `inputs` come back
    tied to all of them. So the module's own collectives run after its gathers, and in
    the backward pass the reduce-scatters (the gathers' transposes) run after every
    collective of the module's backward and before the backward of what produced
    `inputs`.

    **Arguments:**

    - `tree`: a PyTree (usually a module, `self`).
    - `inputs`: any PyTree of arrays the module computes from (its activations).
    - `exclude`: `None`, or a function of `tree` returning a part of it to leave split
        (a model's stacked blocks, which its `lax.scan` gathers one at a time).

    **Returns:**

    `(tree, inputs)`, the first with whole weights.
    """
    if not has_shards(tree):
        return tree, inputs
    skip = set()
    if exclude is not None:
        skip = {id(leaf) for leaf in jax.tree.leaves(exclude(tree), is_leaf=is_shard)}
    shards = [leaf for leaf in jax.tree.leaves(tree, is_leaf=is_shard)
              if is_shard(leaf) and id(leaf) not in skip]
    if not shards:
        return tree, inputs
    # One chain of gathers, each waiting for the one before: first the shards that
    # vary over the FSDP axes only, then those a tensor-parallel axis also splits, so
    # that no link of the chain makes a weight vary (in type) over an axis it does not.
    fsdp = frozenset(a for leaf in shards for a in leaf.axes)
    shards.sort(key=lambda leaf: len(varying_axes(leaf.shard) - fsdp - set(leaf.inner_axes)))
    order = Sequence(inputs)
    full = {}
    for leaf in shards:
        axis = leaf.shard.ndim + leaf.dim
        w = leaf.shard
        if leaf.inner_axes:  # innermost: devices with the same data (tp)
            w = order(lax.all_gather, w, _names(leaf.inner_axes), axis=axis, tiled=True,
                      to="invarying")
        w = order(lax.all_gather, w, _names(leaf.axes), axis=axis, tiled=True)
        full[id(leaf)] = checkpoint_name(w, GATHERED)
    # The inputs wait for the last gather. Its token varies over the tensor-parallel
    # axis where that weight is split; a psum of the one-element token (in the chain)
    # keeps the inputs from varying over it. In the backward pass its transpose is a
    # cast, and the reduce-scatters wait for the inputs' cotangents.
    token = tokens(order.last)
    extra = tuple(sorted(varying_axes(token) - fsdp - varying_axes(*jax.tree.leaves(inputs)),
                         key=str))
    if extra:
        token = lax.psum(token, extra)
    tree = jax.tree.map(lambda leaf: full.get(id(leaf), leaf), tree, is_leaf=is_shard)
    return tree, after(inputs, token)


def _names(axes: tuple[str, ...]):
    return axes[0] if len(axes) == 1 else axes


def regather_policy(policy, *, keep: bool = False):
    """The `jax.checkpoint` policy of a scanned block with FSDP shards: `policy` (a
    `jax.checkpoint_policies` policy; `None` for "full", which saves nothing anyway),
    except that a gathered weight ([`GATHERED`][], or an `all_gather`'s output) is never
    saved for the backward pass: it is gathered again there (ZeRO-3). `keep=True`
    returns a policy that saves the gathered weights in addition (fewer gathers, the
    whole model gathered by the end of the forward)."""

    def saveable(prim, *args, **params):
        if prim.name == "all_gather":
            return keep
        if prim.name == "all_gather_invariant":  # the inner (tp) half: recomputed, or
            return False  # not needed once the whole weight is kept
        if prim.name == "name" and params.get("name") == GATHERED:
            # Never the named copy: with keep=True the gather's own output is the one
            # saved (the collective order's tokens are computed from it), and saving
            # both kept every gathered weight twice.
            return False
        return False if policy is None else policy(prim, *args, **params)

    if policy is None and not keep:
        return None
    return saveable


def wrap_shards(tree, specs, fsdp_axes):
    """Inside `shard_map`: every array of `tree` whose in_spec (`specs`, a prefix tree
    of `PartitionSpec`s and `None`) names an axis of `fsdp_axes` on a dimension, as an
    [`FSDPShard`][] of that dimension and those axes."""
    fsdp = set(fsdp_axes)

    def wrap(spec, sub):
        if not isinstance(spec, P):
            return sub

        def one(x):
            if not eqx.is_array(x):
                return x
            found = []
            for d, entry in enumerate(spec):
                names = entry if isinstance(entry, tuple) else (entry,)
                if any(n in fsdp for n in names if n is not None):
                    names = tuple(n for n in names if n is not None)
                    k = next(i for i, n in enumerate(names) if n not in fsdp) if any(
                        n not in fsdp for n in names) else len(names)
                    if any(n in fsdp for n in names[k:]):
                        raise ValueError(
                            f"filter_shard_map: the in_spec {spec} splits one dimension over "
                            f"the FSDP axes {sorted(fsdp)} and the axes {list(names[k:])}, "
                            "which must come after (innermost); use nn.sharding.partition_specs("
                            "module, mesh)."
                        )
                    found.append((d, names[:k], names[k:]))
            if not found:
                return x
            if len(found) > 1:
                raise ValueError(
                    f"filter_shard_map: the in_spec {spec} splits a parameter over the FSDP "
                    f"axes on {len(found)} dimensions; FSDP takes one (use "
                    "nn.sharding.partition_specs(module, mesh))."
                )
            d, outer, inner = found[0]
            return FSDPShard(x, d - x.ndim, outer, inner)

        return jax.tree.map(one, sub)

    return jax.tree.map(wrap, specs, tree, is_leaf=lambda s: s is None or isinstance(s, P))


def unwrap_shards(tree):
    """`tree` with every [`FSDPShard`][] replaced by its local slice (what leaves
    `shard_map`, e.g. gradients computed inside it, which are sharded like the
    parameters)."""
    return jax.tree.map(lambda x: x.shard if is_shard(x) else x, tree, is_leaf=is_shard)
