"""Placement of module parameters on a mesh (Megatron tensor parallelism), and the
swap of a module tree's [`ParallelConfig`][]."""

import dataclasses

import equinox as eqx
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from ._attention import Attention, CrossAttention, JointAttention
from ._feedforward import FeedForward
from ._parallel import check_parallel, ParallelConfig


# The modules that hold a ParallelConfig, and their Megatron split: (column-parallel
# linears, row-parallel linears, norms sharded with the features). A field that is
# None (an absent qk-norm or image branch) is skipped.
_MEGATRON = {
    Attention: (("q", "k", "v"), ("o",), ("norm_q", "norm_k")),
    CrossAttention: (("q", "k", "v", "k_img", "v_img"), ("o",), ("norm_q", "norm_k", "norm_k_img")),
    JointAttention: (("to_q", "to_k", "to_v"), ("to_out",), ()),
    FeedForward: (("fc1",), ("fc2",), ()),
}
_PARALLEL = tuple(_MEGATRON)


def _is_parameter(x) -> bool:
    """An array, or its abstract stand-in (a model built with `eqx.filter_eval_shape`)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _is_parallel(x) -> bool:
    return isinstance(x, _PARALLEL)


def _module_specs(m):
    if not isinstance(m.parallel, ParallelConfig):
        raise ValueError(
            f"partition_specs: the {type(m).__name__} holds no ParallelConfig (received "
            f"parallel={m.parallel!r}): the configuration decides the specs. Call "
            "partition_specs on the whole module, before `eqx.partition`; the specs then "
            "match the arrays part too (both have None at the configuration)."
        )
    specs = jax.tree.map(lambda x: P() if _is_parameter(x) else None, m)
    tp = m.parallel.tp_axis
    if tp is None:
        return specs
    column, row, norms = _MEGATRON[type(m)]

    def spec(x, *axes):
        # Leading axes beyond the parameter's own are stacked layers (`eqx.filter_vmap`
        # construction, scanned over): never sharded.
        return P(*(None,) * (len(x.shape) - len(axes)), *axes)

    where, values = [], []
    for name in column:
        lin = getattr(m, name)
        if lin is None:
            continue
        where += [lambda s, n=name: getattr(s, n).weight, lambda s, n=name: getattr(s, n).bias]
        values += [spec(lin.weight, tp, None), spec(lin.bias, tp)]
    for name in row:
        lin = getattr(m, name)
        if lin is None:
            continue
        where += [lambda s, n=name: getattr(s, n).weight, lambda s, n=name: getattr(s, n).bias]
        values += [spec(lin.weight, None, tp), P()]
    for name in norms:
        if getattr(m, name) is not None:
            where.append(lambda s, n=name: getattr(s, n).weight)
            values.append(spec(getattr(m, name).weight, tp))
    return eqx.tree_at(lambda s: [w(s) for w in where], specs, values)


def partition_specs(module):
    """The `PartitionSpec` of every parameter of `module` (Megatron tensor parallelism).

    For every attention module and [`FeedForward`][] inside `module` (any PyTree:
    one layer or a whole model) whose `parallel.tp_axis` is set: q/k/v (`to_q`/`to_k`/`to_v`) weights
    `P(tp, None)` and biases `P(tp)` (column-parallel: each device holds its heads'
    output features); `o` / `to_out` weight `P(None, tp)` (row-parallel) and bias `P()`;
    Wan's `norm_q` / `norm_k` weights, over the inner dim, `P(tp)`; CogVideoX's per-head
    LayerNorms `P()`; a [`FeedForward`][]'s `fc1` column-parallel and `fc2`
    row-parallel likewise. Every other array, and everything when `tp_axis` is `None`, is
    replicated, `P()`; non-array leaves get `None`. Sequence parallelism never shards a
    parameter. Layers stacked with `eqx.filter_vmap` (to `lax.scan` over them) keep their
    leading layer axes unsharded: a stacked q weight `(L, dim, dim)` gets `P(None, tp, None)`.

    **Arguments:**

    - `module`: a PyTree of Equinox modules.

    **Returns:**

    A PyTree of the same structure with a `PartitionSpec` per array (or
    `jax.ShapeDtypeStruct`: a model built with `eqx.filter_eval_shape` gets the specs
    of its real twin) and `None` at every other leaf (the [`ParallelConfig`][] included), for
    [`filter_shard_map`][]`(..., in_specs=(partition_specs(module), ...))`, or, mapped to
    `NamedSharding(mesh, spec)`, for `eqx.filter_shard`. It is also the spec of the
    module's arrays part (`eqx.partition(module, eqx.is_array)[0]`), and, since the
    configuration is a leaf, of every [`with_parallel`][] variant with the same
    `tp_axis`. Call it on the whole module: the configuration decides the specs.
    """

    def specs(x):
        if _is_parallel(x):
            return _module_specs(x)
        return P() if _is_parameter(x) else None

    return jax.tree.map(specs, module, is_leaf=_is_parallel)


def with_parallel(module, parallel: ParallelConfig):
    """`module` with the `parallel` configuration of every attention module and
    [`FeedForward`][] replaced.

    The parameters are shared, not copied: the single-device model and its sharded
    twin are the same arrays. Works on one layer or any PyTree containing them.

    **Arguments:**

    - `module`: a PyTree of Equinox modules.
    - `parallel`: the new [`ParallelConfig`][].

    **Returns:**

    A PyTree of the same structure.
    """
    check_parallel("with_parallel", parallel)

    def swap(m):
        if not _is_parallel(m):
            return m
        # Equinox rebuilds modules the same way when unflattening: fields set on a new
        # instance without running `__init__`. Only the configuration leaf changes.
        new = object.__new__(type(m))
        for field in dataclasses.fields(m):
            value = parallel if field.name == "parallel" else getattr(m, field.name)
            object.__setattr__(new, field.name, value)
        return new

    return jax.tree.map(swap, module, is_leaf=_is_parallel)


def shard_module(module, mesh):
    """`module` with every array placed on `mesh` by [`partition_specs`][].

    `eqx.filter_shard(module, NamedSharding(mesh, spec) per array)`: outside `jit` it
    moves the weights (each device receives its own Megatron shard), inside it
    constrains them. Place a model once before running it sharded, so that every
    call does not reshard its weights.

    **Arguments:**

    - `module`: a PyTree of Equinox modules, with its [`ParallelConfig`][]s (their
        `tp_axis` decides the specs).
    - `mesh`: a `jax.sharding.Mesh` with the configured axes.

    **Returns:**

    The same structure with its arrays placed.
    """
    specs = partition_specs(module)
    shardings = jax.tree.map(
        lambda s: None if s is None else NamedSharding(mesh, s), specs,
        is_leaf=lambda s: s is None or isinstance(s, P),
    )
    arrays, static = eqx.partition(module, eqx.is_array)
    arrays = jax.tree.map(
        lambda x, s: x if s is None else eqx.filter_shard(x, s), arrays, shardings,
        is_leaf=lambda x: x is None,
    )
    return eqx.combine(arrays, static)
