"""Placement of module parameters on a mesh (Megatron tensor parallelism and FSDP, as each
layer declares its split), and the swap of a module tree's [`ParallelConfig`][]."""

import dataclasses
import math

import equinox as eqx
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from ._config import agreed, check_parallel, fsdp_axes_of, ParallelConfig
from .._lora import is_lora_linear
from .._quantized import QuantizedLinear
from ._parallel_layer import AbstractParallelLayer


FSDP_MAX_REPLICATED = 1 << 20
"""The default of `partition_specs(max_replicated=)`: a parameter of more elements that
FSDP cannot split raises instead of staying whole on every device."""


def _is_parameter(x) -> bool:
    """An array, or its abstract stand-in (a model built with `eqx.filter_eval_shape`)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _is_parallel(x) -> bool:
    return isinstance(x, AbstractParallelLayer)


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
    column, row, norms, vocab = type(m).megatron

    def spec(x, *axes):
        # Leading axes beyond the parameter's own are stacked layers (`eqx.filter_vmap`
        # construction, scanned over): never sharded.
        return P(*(None,) * (len(x.shape) - len(axes)), *axes)

    where, values = [], []
    for name in column:
        lin = getattr(m, name)
        if lin is None:
            continue
        for w in _weights(lin):  # split over the output features (an int8 scale's only axis)
            own = len(w(lin).shape) - _stack(lin)
            where.append(lambda s, n=name, w=w: w(getattr(s, n)))
            values.append(spec(w(lin), tp, *(None,) * (own - 1)))
        if lin.bias is not None:
            where.append(lambda s, n=name: getattr(s, n).bias)
            values.append(spec(lin.bias, tp))
        for a in _adapters(lin):  # B holds the output features: split like them
            where.append(lambda s, n=name, a=a: getattr(s, n).adapters[a].lora_B)
            values.append(spec(lin.adapters[a].lora_B, tp, None))
    for name in row:
        lin = getattr(m, name)
        if lin is None:
            continue
        weight, *scale = _weights(lin)  # the input features split; an int8 scale whole
        where.append(lambda s, n=name, w=weight: w(getattr(s, n)))
        values.append(spec(weight(lin), None, tp))
        for w in scale:
            where.append(lambda s, n=name, w=w: w(getattr(s, n)))
            values.append(P())
        if lin.bias is not None:
            where.append(lambda s, n=name: getattr(s, n).bias)
            values.append(P())
        for a in _adapters(lin):  # A takes the input features: split like them
            where.append(lambda s, n=name, a=a: getattr(s, n).adapters[a].lora_A)
            values.append(spec(lin.adapters[a].lora_A, None, tp))
    for name in norms:
        if getattr(m, name) is not None:
            where.append(lambda s, n=name: getattr(s, n).weight)
            values.append(spec(getattr(m, name).weight, tp))
    for name in vocab:
        if getattr(m, name) is not None:
            where.append(lambda s, n=name: getattr(s, n).weight)
            values.append(spec(getattr(m, name).weight, tp, None))
    return eqx.tree_at(lambda s: [w(s) for w in where], specs, values)


def _weights(lin) -> list:
    """Getters of a linear layer's weight arrays: its `weight`, or an int8 layer's
    `qweight` and `scale` (through a `LoRALinear`'s base)."""
    base = (lambda l: l.base) if is_lora_linear(lin) else (lambda l: l)
    if isinstance(base(lin), QuantizedLinear):
        return [lambda l: base(l).qweight, lambda l: base(l).scale]
    return [lambda l: base(l).weight]


def _stack(lin) -> int:
    """The stacked (leading layer) axes of a linear layer's weight."""
    return len(_weights(lin)[0](lin).shape) - 2


def _adapters(lin) -> list[str]:
    return sorted(lin.adapters) if is_lora_linear(lin) else []


def partition_specs(module, mesh=None, *, max_replicated: int = FSDP_MAX_REPLICATED):
    """The `PartitionSpec` of every parameter of `module`: Megatron tensor parallelism
    and fully sharded data parallelism (FSDP).

    **Tensor parallelism.** For every attention module and [`FeedForward`][] inside
    `module` (any PyTree: one layer or a whole model) whose `parallel.tp_axis` is set:
    q/k/v (`to_q`/`to_k`/`to_v`) weights `P(tp, None)` and biases `P(tp)`
    (column-parallel: each device holds its heads' output features); `o` / `to_out`
    weight `P(None, tp)` (row-parallel) and bias `P()`; Wan's `norm_q` / `norm_k`
    weights, over the inner dim, `P(tp)`; CogVideoX's per-head LayerNorms `P()`;
    [`DualStreamAttention`][]'s six q/k/v projections (video and text) column-parallel,
    `to_out` and `to_add_out` row-parallel, its per-head RMSNorms `P()`; a
    [`FeedForward`][]'s `fc1` column-parallel and `fc2` row-parallel likewise; a
    layer's vocabulary-parallel embedding tables (its
    [`MegatronSplit`][vidax_eqx.nn.sharding.MegatronSplit]`.vocab`, T5's token
    embedding) `P(tp, None)`, split over their rows.
    Sequence parallelism never shards a parameter. A [`LoRALinear`][]'s adapters
    follow their layer: column-parallel, `lora_B` `P(tp, None)` (its output
    features) and `lora_A` whole; row-parallel, `lora_A` `P(None, tp)` (its input
    features) and `lora_B` whole.

    **FSDP.** When the modules' [`ParallelConfig`][] has `fsdp_axes` (all of them must
    agree), *every* parameter of `module`, inside those modules or not (embeddings,
    norms, heads), is split over those axes on one dimension: the largest one that
    tensor parallelism does not split and that the FSDP size (the product of their
    sizes in `mesh`) divides, the first of equal ones. A parameter that tensor
    parallelism does not split at all is split over the FSDP axes and `tp_axis`
    together (`P(("dp", "sp", "tp"))`, when that size divides a dimension), so that
    with `tp` every device still holds `1 / (fsdp x tp)` of the model. A parameter with no such
    dimension stays replicated when it has at most `max_replicated` elements
    ([`replicated_parameters`][] lists those and why) and is an error otherwise.

    Layers stacked with `eqx.filter_vmap` (to `lax.scan` over them; a module lists
    such fields in its class variable `stacked_layers`) keep their leading layer axis
    unsharded: a stacked q weight `(L, dim, dim)` gets `P(None, tp, None)`.

    **Arguments:**

    - `module`: a PyTree of Equinox modules.
    - `mesh`: the `jax.sharding.Mesh` (or `AbstractMesh`) the module runs on; needed
        with FSDP, for the axes' sizes (without it, FSDP raises).
    - `max_replicated`: the largest parameter (in elements) that may stay replicated
        under FSDP because no dimension divides.

    **Returns:**

    A PyTree of the same structure with a `PartitionSpec` per array (or
    `jax.ShapeDtypeStruct`: a model built with `eqx.filter_eval_shape` gets the specs
    of its real twin) and `None` at every other leaf (the [`ParallelConfig`][] included), for
    [`filter_shard_map`][vidax_eqx.nn.sharding.filter_shard_map]`(..., in_specs=(partition_specs(module, mesh), ...))`, or,
    mapped to `NamedSharding(mesh, spec)`, for `eqx.filter_shard`. It is also the spec
    of the module's arrays part (`eqx.partition(module, eqx.is_array)[0]`), and, since
    the configuration is a leaf, of every [`with_parallel`][] variant with the same
    `tp_axis` and `fsdp_axes`. Call it on the whole module: the configuration decides
    the specs.
    """

    tp_specs = _tp_specs(module)
    axes = fsdp_axes_of(module)
    if not axes:
        return tp_specs
    plan = _fsdp_plan(module, tp_specs, axes, mesh, max_replicated, "partition_specs")
    return jax.tree.map(lambda spec, entry: spec if entry is None else entry[0], tp_specs, plan,
                        is_leaf=lambda s: s is None or isinstance(s, P))


def replicated_parameters(module, mesh, *, max_replicated: int = FSDP_MAX_REPLICATED):
    """The parameters of `module` that FSDP leaves whole on every device, and why.

    [`partition_specs`][] splits every parameter over the FSDP axes on one dimension
    that tensor parallelism does not split and that the FSDP size divides; those with
    no such dimension (small biases or norm scales of an odd width, a `(1, 6, dim)`
    modulation over 7 devices, ...) stay replicated. Their bytes are the per-device
    remainder on top of `total / (fsdp x tp)`.

    **Arguments:**

    - `module`, `mesh`, `max_replicated`: as for [`partition_specs`][].

    **Returns:**

    A list of `(path, shape, reason)`, `path` as `jax.tree_util.keystr` writes it;
    empty without FSDP or when every parameter is split.
    """
    axes = fsdp_axes_of(module)
    if not axes:
        return []
    plan = _fsdp_plan(module, _tp_specs(module), axes, mesh, max_replicated,
                      "replicated_parameters")
    flat = jax.tree_util.tree_flatten_with_path(
        plan, is_leaf=lambda s: s is None or isinstance(s, tuple))[0]
    return [(jax.tree_util.keystr(path), entry[1], entry[2]) for path, entry in flat
            if entry is not None and entry[2] is not None]


def _tp_specs(module):
    """The Megatron specs: `_module_specs` of each parallel module, `P()` for every other
    array, `None` elsewhere."""

    def specs(x):
        if _is_parallel(x):
            return _module_specs(x)
        return P() if _is_parameter(x) else None

    return jax.tree.map(specs, module, is_leaf=_is_parallel)


def _fsdp_size(axes, mesh, owner) -> int:
    if mesh is None:
        raise ValueError(
            f"{owner}: the modules are fully sharded (fsdp_axes={axes}), which needs the mesh "
            f"to size the split; pass the mesh: {owner}(module, mesh)."
        )
    shape = dict(mesh.shape)
    missing = [a for a in axes if a not in shape]
    if missing:
        raise ValueError(
            f"{owner}: the FSDP axis {missing[0]!r} (fsdp_axes={axes}) is not an axis of the "
            f"mesh {shape}. Name axes of the mesh, or add the axis to it."
        )
    return math.prod(shape[a] for a in axes)


def _stacked_depths(module):
    """For each array leaf (flattened order): how many leading axes are stacked layers
    (fields named in a module's `stacked_layers` class variable, on the way to it)."""
    def depth(path):
        node, n = module, 0
        for key in path:
            if isinstance(node, eqx.Module) and isinstance(key, jax.tree_util.GetAttrKey):
                if key.name in getattr(type(node), "stacked_layers", ()):
                    n += 1
                node = getattr(node, key.name)
            elif isinstance(key, jax.tree_util.SequenceKey):
                node = node[key.idx]
            elif isinstance(key, jax.tree_util.DictKey):
                node = node[key.key]
            else:
                return n
        return n

    flat = jax.tree_util.tree_flatten_with_path(module)[0]
    return {jax.tree_util.keystr(path): depth(path) for path, _ in flat}


def _fsdp_plan(module, tp_specs, axes, mesh, max_replicated, owner):
    """Per array: `(spec, shape, reason)` (reason `None` when split) or `None`.

    A parameter that tensor parallelism does not split is split over the FSDP axes and
    the tensor-parallel axis together (innermost), so that no device of `tp` holds a
    copy another one holds too; one that it splits, over the FSDP axes on another
    dimension."""
    n = _fsdp_size(axes, mesh, owner)
    tp = _tp_axis(module, mesh)
    n_tp = dict(mesh.shape)[tp] if tp is not None else 1
    depths = _stacked_depths(module)

    def plan(path, spec, x):
        if not isinstance(spec, P) or not _is_parameter(x):
            return None
        shape = tuple(x.shape)
        if n == 1:
            return spec, shape, None
        first = depths.get(jax.tree_util.keystr(path), 0)
        entries = tuple(spec) + (None,) * (len(shape) - len(spec))
        free = [d for d in range(first, len(shape)) if entries[d] is None]
        whole = all(e is None for e in entries) and n_tp > 1
        for over, size in ([(axes + (tp,), n * n_tp)] if whole else []) + [(axes, n)]:
            fits = [d for d in free if shape[d] % size == 0]
            if fits:
                d = max(fits, key=lambda d: (shape[d], -d))
                entry = over[0] if len(over) == 1 else tuple(over)
                return P(*entries[:d], entry, *entries[d + 1:]), shape, None
        name = jax.tree_util.keystr(path)
        size = math.prod(shape)
        free_sizes = [shape[d] for d in free]
        if free_sizes:
            reason = (f"none of its dimensions {free_sizes} that neither the layer axis nor "
                      f"tensor parallelism takes is a multiple of the FSDP size {n}")
        else:
            reason = ("every dimension is the layer axis or split by tensor parallelism "
                      f"({spec})")
        if size > max_replicated:
            raise ValueError(
                f"{owner}: FSDP over {axes} (size {n}) cannot split the parameter {name} of "
                f"shape {shape} ({size:,} elements, more than max_replicated="
                f"{max_replicated:,} may stay whole on every device): {reason}. Use an FSDP "
                f"size that divides one of {free_sizes} (e.g. "
                f"{sorted({math.gcd(n, s) for s in free_sizes} - {1}) or 'none > 1'}), or "
                "raise max_replicated."
            )
        return P(*entries), shape, reason

    return jax.tree_util.tree_map_with_path(
        lambda path, spec, x: plan(path, spec, x), tp_specs, module,
        is_leaf=lambda s: s is None or isinstance(s, P))


def _tp_axis(module, mesh):
    """The tensor-parallel axis of the modules of `module` (they must agree), or `None`;
    also `None` when the mesh lacks it (the Megatron specs name it anyway)."""
    tp = agreed(module, "tp_axis")
    return tp if tp in dict(mesh.shape) else None


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
    return jax.tree.map(lambda m: replace_fields(m, parallel=parallel) if _is_parallel(m) else m,
                        module, is_leaf=_is_parallel)


def replace_fields(module, **fields):
    """`module` with `fields` replaced, static ones included, the rest the same objects.
    Equinox rebuilds modules the same way when unflattening: fields set on a new
    instance without running `__init__`."""
    new = object.__new__(type(module))
    for field in dataclasses.fields(module):
        object.__setattr__(new, field.name, fields.get(field.name, getattr(module, field.name)))
    return new


def shard_module(module, mesh):
    """`module` with every array placed on `mesh` by [`partition_specs`][].

    `eqx.filter_shard(module, NamedSharding(mesh, spec) per array)`: outside `jit` it
    moves the weights (each device receives its own Megatron and FSDP slice), inside
    it constrains them. Place a model once before running it sharded, so that every
    call does not reshard its weights.

    **Arguments:**

    - `module`: a PyTree of Equinox modules, with its [`ParallelConfig`][]s (their
        `tp_axis` and `fsdp_axes` decide the specs).
    - `mesh`: a `jax.sharding.Mesh` with the configured axes.

    **Returns:**

    The same structure with its arrays placed.
    """
    return _place(module, partition_specs(module, mesh), mesh)


def shard_like(tree, module, mesh, *, filter_spec=None):
    """`tree` placed on `mesh` like the parameters of `module`: for optimizer states.

    Every part of `tree` with the structure of `module`'s arrays
    (`eqx.filter(module, eqx.is_array)`: an optax state's moments, a gradient, an
    EMA of the weights) is placed by [`partition_specs`][]`(module, mesh)`, so its
    arrays are split exactly like the parameters they follow (FSDP and Megatron);
    every other array (AdamW's step `count`, a learning-rate schedule's state) is
    replicated over the whole mesh. That is where a sharded training step returns
    them, so the step compiles once.

        opt_state = nn.sharding.shard_like(optimizer.init(eqx.filter(model, eqx.is_array)), model, mesh)

    Also the one call that reshards a state after [`with_parallel`][] moved its model
    to another configuration or mesh. Outside `jit` the arrays move; inside, they are
    constrained.

    **Arguments:**

    - `tree`: any PyTree of arrays (e.g. an optax state).
    - `module`: the model whose parameters `tree` follows.
    - `mesh`: the `jax.sharding.Mesh`.
    - `filter_spec`: for the state of an optimizer that trains part of the model
        (`optimizer.init(eqx.filter(model, filter_spec))`, e.g.
        `filter_spec=nn.lora_filter(model)`): the parts of `tree` with the structure
        of `eqx.filter(module, filter_spec)` are placed like those parameters.

    **Returns:**

    `tree`, placed.
    """
    specs = partition_specs(module, mesh)
    is_spec = lambda s: s is None or isinstance(s, P)  # noqa: E731
    if filter_spec is None:
        params = eqx.filter(module, _is_parameter)
        arrays_specs = eqx.filter(specs, lambda s: isinstance(s, P),
                                  is_leaf=lambda s: isinstance(s, P))
    else:
        params = eqx.filter(module, filter_spec)
        arrays_specs = jax.tree.map(lambda s, keep: s if keep else None, specs, filter_spec,
                                    is_leaf=is_spec)
    structure = jax.tree.structure(params)
    is_params = lambda node: (  # noqa: E731
        node is not None and not _is_parameter(node) and jax.tree.structure(node) == structure
    )

    def place(node):
        if is_params(node):
            return _place(node, arrays_specs, mesh)
        if _is_parameter(node):
            return _put(node, NamedSharding(mesh, P()))
        return node

    return jax.tree.map(place, tree, is_leaf=lambda n: is_params(n) or _is_parameter(n))


def _place(tree, specs, mesh):
    """Each array of `tree` on `mesh` by its spec in `specs` (same structure)."""
    shardings = jax.tree.map(
        lambda s: None if s is None else NamedSharding(mesh, s), specs,
        is_leaf=lambda s: s is None or isinstance(s, P),
    )
    arrays, static = eqx.partition(tree, eqx.is_array)
    arrays = jax.tree.map(
        lambda x, s: x if s is None else _put(x, s), arrays, shardings,
        is_leaf=lambda x: x is None,
    )
    return eqx.combine(arrays, static)


def _put(x, sharding):
    """`x` placed by `sharding`: moved outside `jit` (a transfer, no compilation),
    constrained inside."""
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, sharding)
    return jax.device_put(x, sharding)
