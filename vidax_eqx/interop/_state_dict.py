"""PyTorch-style state dicts <-> Equinox modules: the checked, one-shot load (sharded
when asked) and the state dict and safetensors written from a module."""

import contextlib
import contextvars
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import nn
from ._checkpoint import open_checkpoint, open_safetensors, SafetensorsShards
from ._naming import check_naming, is_linear, is_parameter, named_parameters
from ._safetensors import SafetensorsFile, write_safetensors
from ._sharded import layer_sharding, place_sharded, place_stacked_sharded, set_layer
from ._slices import normalize_index


_LAZY = (SafetensorsFile, SafetensorsShards)  # read on access, shape/dtype from headers


def _dtype_of(value) -> np.dtype | None:
    """`value.dtype` as a NumPy dtype (NumPy, JAX, or a torch tensor's dtype), or None."""
    dtype = getattr(value, "dtype", None)
    try:
        return np.dtype(dtype)
    except TypeError:
        pass
    name = str(dtype).removeprefix("torch.")
    try:
        return np.dtype(getattr(ml_dtypes, name, name))
    except TypeError:
        return None


def _is_torch(value) -> bool:
    return type(value).__module__.split(".")[0] == "torch" and hasattr(value, "numpy")


def _to_numpy(value) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if _is_torch(value):  # duck-typed: torch is never imported here
        value = value.detach().cpu()
        try:
            return value.numpy()
        except TypeError:  # bfloat16, float8: no NumPy dtype in torch; exact in float32
            return value.float().numpy()
    return np.asarray(value)


def _describe(value) -> tuple[tuple[int, ...] | None, np.dtype | None]:
    shape = getattr(value, "shape", None)
    try:
        shape = tuple(int(d) for d in shape)
    except TypeError:
        shape = None
    return shape, _dtype_of(value)


def _is_float(dtype) -> bool:
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _sharding_of(like):
    """Where a new array replacing the leaf `like` goes: `like`'s sharding when that was
    committed (`device_put`, `filter_shard`) or given (a `ShapeDtypeStruct`'s); `None`
    (uncommitted on the default device, so that `jit` may still place it anywhere)
    otherwise."""
    if isinstance(like, jax.ShapeDtypeStruct):
        return like.sharding
    if isinstance(like, jax.Array) and not isinstance(like, jax.core.Tracer) and like.committed:
        return like.sharding
    return None


def _place_stacked(like, sharding, layers):
    """A stacked leaf `(L, ...)` on the device (`sharding`), filled one layer at a time.

    `layers` yields `(index, NumPy array)`; each is copied into a device buffer that
    is updated in place (donated), so host memory holds one layer besides the model,
    never a second copy of the stack."""
    stack = jnp.zeros(like.shape, like.dtype, device=sharding)
    for index, array in layers:
        # Wait for each copy: dispatch is asynchronous, and every update in flight
        # would hold its layer's host array.
        stack = jax.block_until_ready(set_layer(stack, array, np.int32(index)))
    return stack


def _mesh_shardings(module, mesh) -> list:
    """`NamedSharding(mesh, spec)` of each leaf of `module` (flattened as
    `named_parameters` does) from `nn.sharding.partition_specs(module, mesh)`; `None` at leaves
    that are not parameters."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(
            f"`mesh` must be a jax.sharding.Mesh (e.g. vidax_eqx.parallel.make_mesh(...)) or "
            f"None; received {type(mesh).__name__}."
        )
    specs = nn.sharding.partition_specs(module, mesh)  # raises for FSDP axes the mesh lacks, misfits
    is_spec = lambda s: isinstance(s, P)  # noqa: E731
    axes = {a for s in jax.tree.leaves(specs, is_leaf=is_spec) if is_spec(s)
            for entry in s if entry is not None
            for a in (entry if isinstance(entry, tuple) else (entry,))}
    missing = sorted(axes - set(mesh.axis_names))
    if missing:
        raise ValueError(
            f"`mesh` has the axes {tuple(mesh.axis_names)}, but the modules' ParallelConfig "
            f"places parameters over {missing}. Pass a mesh with those axes, or a ParallelConfig "
            "that names the mesh's (tp_axis, fsdp_axes)."
        )
    treedef = jax.tree_util.tree_structure(
        module, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return [NamedSharding(mesh, spec) if is_spec(spec) else None
            for spec in treedef.flatten_up_to(specs)]


def _fmt_keys(keys, limit=20, sep=", ") -> str:
    """At most `limit` keys: a forged or mismatched file can hold a hundred thousand."""
    shown = sep.join(keys[:limit])
    return shown if len(keys) <= limit else f"{shown}, ... ({len(keys) - limit} more)"


ABSTRACT = "abstract"
"""[`loading`][]'s target that reads no tensor: the load returns the module abstract."""

_TARGET = contextvars.ContextVar("vidax_eqx_load_target", default=None)


@contextlib.contextmanager
def loading(target):
    """Where the loads inside the block put their tensors: every
    [`load_state_dict`][] without a `mesh` or a placement of its own (a module built
    abstractly, as `from_pretrained` builds it) asks `target(module)`:

    - `None`: as without the block (uncommitted on the default device);
    - a `jax.Device`: uncommitted on that device (e.g. the host CPU's, for weights
        that a memory plan keeps in host memory or computes there);
    - `ABSTRACT`: nothing is read: every name, shape and dtype is checked against
        the file's header as a load checks them, and the module comes back abstract
        (`jax.ShapeDtypeStruct` leaves), e.g. to plan memory before loading.

    What a pipeline's memory plan loads through, so that every model's
    `from_pretrained` places its weights where the plan says without a keyword of
    its own."""
    token = _TARGET.set(target)
    try:
        yield
    finally:
        _TARGET.reset(token)


def load_state_dict(module, source, *, prefix: str = "", strict: bool = True, stacked=(),
                    rename=None, mesh=None):
    """Loads PyTorch weights into an Equinox module: a new module, every parameter replaced.

    Parameter names are PyTorch's: a module's array fields joined by dots
    (`q.weight`, `norm_q.weight`, `self_attn.o.bias`; list and
    `eqx.nn.Sequential` children by index, `ffn.0.weight`). The attention
    modules accept both namings of their projections: Wan's reference names
    `q, k, v, o` and diffusers' `to_q, to_k, to_v, to_out.0` (`norm_q` and
    `norm_k` are the same in both). A PyTorch `Linear.weight` `(out, in)` is
    `eqx.nn.Linear.weight` as is. Works on any module tree whose field names
    follow the PyTorch model, e.g. a whole DiT block with `prefix="blocks.0."`.

    Every shape is checked; tensors of any floating dtype (float16, bfloat16,
    float32, float64, float8) are cast to the dtype of the parameter they
    replace, i.e. the module's dtype (build the module with `dtype=` to choose
    it). Integer, boolean and complex tensors are rejected. Each new array is
    placed as the array it replaces: with its sharding where that was committed
    (`jax.device_put`, `eqx.filter_shard`) or given (a `jax.ShapeDtypeStruct`'s
    `sharding`), uncommitted on the default device otherwise; with `mesh`, by
    [`vidax_eqx.nn.sharding.partition_specs`][] on that mesh. Nothing is partially
    loaded: every check runs, and every new array is built, before the new
    module is assembled; on any error the module you passed is untouched.

    **Sharded loading.** An array with a sharding is assembled from the blocks of
    this process's own devices (`jax.make_array_from_single_device_arrays`): each
    distinct block is read once per process (a replicated parameter once, not once
    per device), and from a safetensors file only its bytes
    ([`SafetensorsFile.read_slices`][vidax_eqx.interop.SafetensorsFile.read_slices]).
    So a model fully sharded over a mesh (FSDP) loads with host memory per process
    near its share of the model plus one tensor, and in a multi-process
    `jax.distributed` job every process reads only its own share.

    A module built abstractly (`eqx.filter_eval_shape(Module, ..., key=...)`,
    whose leaves are `jax.ShapeDtypeStruct`) works too: it is filled without
    ever allocating random initial weights.

    **Arguments:**

    - `module`: the module to fill (an `eqx.Module` or any pytree of them).
    - `source`: a mapping of names to arrays (NumPy, JAX, or `torch.Tensor`,
        which is duck-typed; torch is never imported), or a path to a
        `.safetensors` file (read by [`open_safetensors`][]: lazily and without
        pickle), a `*.safetensors.index.json` of shards, or a checkpoint directory
        (both read by [`open_checkpoint`][], as lazily). Pickle-based `.pt` / `.bin`
        checkpoints are refused.
    - `prefix`: prepended to every parameter name, e.g. `"blocks.0.self_attn."`;
        keys of `source` that do not start with it are ignored.
    - `strict`: with `True`, every parameter must be found exactly once and
        every key under `prefix` must be used. With `False`, missing parameters
        keep their current values and unused keys are ignored (but at least one
        key must match, and shapes and dtypes are still checked).
    - `stacked`: field paths (e.g. `("blocks",)`) of layers stacked along a leading
        axis (built with `eqx.filter_vmap`, run with `lax.scan`): each of their arrays
        `(L, ...)` is read from the checkpoint's per-layer tensors, `blocks.0.<name>`
        ... `blocks.{L-1}.<name>`, one tensor at a time into one buffer.
    - `rename`: `rename(name, naming) -> str`, applied to each generated name under
        each naming (`"wan"`, `"diffusers"`), for a model whose checkpoint names
        differ from its field names beyond the attention projections.
    - `mesh`: a `jax.sharding.Mesh`: every parameter is placed on it by
        [`vidax_eqx.nn.sharding.partition_specs`][]`(module, mesh)` (the modules'
        [`vidax_eqx.nn.sharding.ParallelConfig`][] decides: Megatron over `tp_axis`, FSDP over
        `fsdp_axes`, replicated otherwise), read as above. Default: as the arrays
        it replaces.

    **Returns:**

    A new module of the same structure with the loaded arrays.

    **Raises:**

    `ValueError` listing, in one message, every missing, unexpected, doubly
    given (both namings), mis-shaped and wrongly typed tensor by name; or for a
    malformed `.safetensors` file.
    """
    if not isinstance(prefix, str):
        raise ValueError(f"`prefix` must be a string; received {prefix!r}.")
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        source = (open_checkpoint(text) if os.path.isdir(text) or text.endswith(".json")
                  else open_safetensors(text))
    elif not isinstance(source, Mapping):
        raise ValueError(
            "`source` must be a mapping of names to arrays or a path to a .safetensors file; "
            f"received {type(source).__name__}."
        )
    leaves, entries, treedef = named_parameters(module, stacked, rename)
    shardings = ([_sharding_of(leaf) if is_parameter(leaf) else None for leaf in leaves]
                 if mesh is None else _mesh_shardings(module, mesh))
    target = _TARGET.get()
    if target is not None and (mesh is not None or any(s is not None for s in shardings)):
        target = None  # placed by the caller
    target = None if target is None else target(module)
    what = type(module).__name__ + (f" (prefix={prefix!r})" if prefix else "")
    lazy = isinstance(source, _LAZY)

    keys = {}
    unexpected = []
    for key in source.keys():
        if isinstance(key, str) and key.startswith(prefix):
            keys[key[len(prefix):]] = key
        elif not isinstance(key, str):
            unexpected.append(repr(key))
    used = set()
    missing, doubled, wrong_shape, wrong_dtype = [], [], [], []
    matched = {}  # entry index -> key of source
    for e, entry in enumerate(entries):
        candidates = list(dict.fromkeys(entry.names))
        hits = [keys[c] for c in candidates if c in keys]
        used.update(hits)
        if not hits:
            missing.append(" or ".join(repr(prefix + c) for c in candidates))
        elif len(hits) > 1:
            doubled.append(" and ".join(repr(h) for h in hits))
        else:
            matched[e] = hits[0]
    unexpected += [repr(k) for k in keys.values() if k not in used]

    values = {}
    for e, key in matched.items():
        entry = entries[e]
        leaf = leaves[entry.leaf]
        expected = tuple(leaf.shape) if entry.layer is None else tuple(leaf.shape[1:])
        if lazy:  # check from the header; read later
            shape, dtype = source.shape(key), source.dtype(key)
        else:
            values[e] = source[key]
            if not hasattr(values[e], "shape"):
                values[e] = np.asarray(values[e])
            shape, dtype = _describe(values[e])
        if shape != expected:
            wrong_shape.append(f"{key!r}: got {shape}, expected {expected}")
        want_float = _is_float(leaf.dtype)
        if (want_float and not _is_float(dtype)) or (not want_float and dtype != leaf.dtype):
            want = "a floating dtype" if want_float else str(np.dtype(leaf.dtype))
            wrong_dtype.append(f"{key!r}: got {dtype if dtype is not None else 'no dtype'}, "
                               f"expected {want}")

    partial = {}  # stacked abstract leaves of which only some layers are given
    for e in matched:
        entry = entries[e]
        if entry.layer is not None and isinstance(leaves[entry.leaf], jax.ShapeDtypeStruct):
            partial.setdefault(entry.leaf, []).append(matched[e])
    partial = [f"{names[0]!r} ({len(names)} of {leaves[i].shape[0]} layers)"
               for i, names in partial.items() if len(names) < leaves[i].shape[0]]

    unplaceable = []  # shardings that do not split their parameter evenly
    for i in sorted({entries[e].leaf for e in matched}):
        if shardings[i] is None:
            continue
        try:
            shardings[i].shard_shape(tuple(leaves[i].shape))
        except ValueError:
            name = next(matched[e] for e in matched if entries[e].leaf == i)
            where = shardings[i]
            if isinstance(where, NamedSharding):
                where = f"{where.spec} over {dict(where.mesh.shape)}"
            unplaceable.append(f"{name!r} {tuple(leaves[i].shape)} by {where}")

    problems = []
    if unplaceable:
        problems.append(
            f"not split evenly by their placement ({len(unplaceable)}; choose mesh axis sizes "
            f"that divide these dimensions): {_fmt_keys(unplaceable, sep='; ')}"
        )
    if partial and not strict:
        problems.append(
            f"some layers of an abstract stacked parameter, which has no values to keep for "
            f"the others ({len(partial)}): {_fmt_keys(partial, sep='; ')}"
        )
    if strict:
        if missing:
            problems.append(f"missing ({len(missing)}): {_fmt_keys(missing)}")
        if unexpected:
            problems.append(f"unexpected ({len(unexpected)}): {_fmt_keys(unexpected)}")
    elif missing and not matched and not doubled:
        problems.append(f"no parameter matched a key of `source` (missing: {_fmt_keys(missing)})")
    if doubled:
        problems.append(f"given under both namings ({len(doubled)}): {_fmt_keys(doubled)}")
    if wrong_shape:
        problems.append(f"wrong shape ({len(wrong_shape)}): {_fmt_keys(wrong_shape, sep='; ')}")
    if wrong_dtype:
        problems.append(f"wrong dtype ({len(wrong_dtype)}): {_fmt_keys(wrong_dtype, sep='; ')}")
    if problems:
        hints = []
        if strict and missing and not matched:
            sample = _fmt_keys([repr(k) for k in source.keys()], 3)
            hints.append(f"No parameter was found: is `prefix` right? The source's keys start "
                         f"with: {sample}.")
        if strict and (missing or unexpected):
            hints.append("Pass strict=False to keep missing parameters and ignore unused keys.")
        raise ValueError(
            f"load_state_dict: the tensors do not fit {what}; nothing was loaded.\n  "
            + "\n  ".join(problems)
            + ("\n" + " ".join(hints) if hints else "")
        )

    if target == ABSTRACT:
        return module
    if target is not None:
        with jax.default_device(target):
            return _fill(leaves, entries, treedef, matched, values, shardings, source, lazy)
    return _fill(leaves, entries, treedef, matched, values, shardings, source, lazy)


def _fill(leaves, entries, treedef, matched, values, shardings, source, lazy):
    """The checked load's reads: each matched entry's tensor into its leaf."""

    def read(e):
        """Entry `e`'s tensor as a fresh NumPy array in its leaf's dtype."""
        dtype = np.dtype(leaves[entries[e].leaf].dtype)
        if lazy:  # a fresh buffer that nothing else holds
            return source[matched[e]].astype(dtype, copy=False)
        # copy: on CPU, device_put may alias the caller's NumPy memory
        return np.array(_to_numpy(values.pop(e)), dtype=dtype, copy=True)

    def read_blocks(e, indices):
        """Blocks (tuples of slices) of entry `e`'s tensor, fresh arrays in its leaf's
        dtype: from a file, only their bytes."""
        dtype = np.dtype(leaves[entries[e].leaf].dtype)
        if lazy:
            return source.read_slices(matched[e], indices, dtype)
        array = _to_numpy(values.pop(e))
        return [np.array(array[index], dtype=dtype, copy=True) for index in indices]

    def read_stacked(group, indices):
        """Blocks of a stacked leaf `(L, ...)`: each layer's part read from its tensor."""
        like = leaves[entries[group[0]].leaf]
        blocks = [normalize_index(index, tuple(like.shape), matched[group[0]]) for index in indices]
        outs = [np.empty(tuple(b - a for a, b in block), np.dtype(like.dtype)) for block in blocks]
        for e in group:  # one layer's blocks in flight at a time
            layer = entries[e].layer
            wanted = [j for j, block in enumerate(blocks) if block[0][0] <= layer < block[0][1]]
            if not wanted:
                continue
            parts = read_blocks(e, [tuple(slice(a, b) for a, b in blocks[j][1:]) for j in wanted])
            for j, part in zip(wanted, parts):
                outs[j][layer - blocks[j][0][0]] = part
        return outs

    def place(i, group, sharding):
        """Leaf `i` placed by `sharding`, from the blocks of this process's devices."""
        name = repr(matched[group[0]])
        like = leaves[i]
        if entries[group[0]].layer is None:
            return place_sharded(tuple(like.shape), sharding,
                                 lambda indices: read_blocks(group[0], indices), name)
        if layer_sharding(sharding) is not None:  # one layer's blocks on the host at a time
            by_layer = {entries[e].layer: e for e in group}
            return place_stacked_sharded(
                tuple(like.shape), like.dtype, sharding,
                lambda layer, indices: read_blocks(by_layer[layer], indices), name)
        return place_sharded(tuple(like.shape), sharding,
                             lambda indices: read_stacked(group, indices), name)

    new_leaves = list(leaves)
    by_leaf: dict[int, list[int]] = {}
    for e in matched:
        by_leaf.setdefault(entries[e].leaf, []).append(e)
    for i, group in by_leaf.items():
        sharding = shardings[i]
        layered = entries[group[0]].layer is not None
        if sharding is not None and not (layered and len(group) < leaves[i].shape[0]):
            # Placed: each process reads only the blocks its devices hold.
            new_leaves[i] = place(i, group, sharding)
        elif not layered:  # one host array in flight at a time
            new_leaves[i] = jax.block_until_ready(jax.device_put(read(group[0]), sharding))
        elif len(group) < leaves[i].shape[0]:  # strict=False: some layers keep their values
            array = np.array(leaves[i], copy=True)
            for e in group:
                array[entries[e].layer] = read(e)
            new_leaves[i] = jax.device_put(array, sharding)
        else:  # stacked: one device buffer, filled one layer (one tensor read) at a time
            new_leaves[i] = _place_stacked(leaves[i], sharding,
                                           ((entries[e].layer, read(e)) for e in group))
    return jax.tree_util.tree_unflatten(treedef, new_leaves)


def state_dict(module, *, naming: str = "wan", prefix: str = "", stacked=(),
               rename=None) -> dict[str, np.ndarray]:
    """The module's parameters as a PyTorch-style state dict of NumPy arrays.

    **Arguments:**

    - `module`: an `eqx.Module` (or any pytree of them) with concrete arrays.
    - `naming`: `"wan"` (attention projections `q, k, v, o`) or `"diffusers"`
        (`to_q, to_k, to_v, to_out.0`); see [`load_state_dict`][].
    - `prefix`: prepended to every name.
    - `stacked`, `rename`: as for [`load_state_dict`][]; a stacked array gives one
        tensor per layer (a view).

    **Returns:**

    A dict from name to a read-only NumPy array of each parameter, in its own
    dtype (bfloat16 as `ml_dtypes.bfloat16`; a view of the device buffer where
    the platform allows, so no copy on CPU). `load_state_dict(module, state_dict(module))`
    gives back the same parameters.
    """
    index = check_naming(naming)
    active = sorted({n for layer in jax.tree.leaves(module, is_leaf=is_linear)
                     if isinstance(layer, nn.LoRALinear) for n in layer.adapters
                     if n not in layer.merged})
    if active:
        raise ValueError(
            f"state_dict: the module has LoRA adapters {active} that are not merged into its "
            "weights, and a checkpoint holds the base weights only. Merge them first "
            "(nn.merge_lora), remove them (nn.remove_lora), or save the adapters on their "
            "own (models.save_lora)."
        )
    leaves, entries, _ = named_parameters(module, stacked, rename)
    out = {}
    for entry in entries:
        leaf = leaves[entry.leaf]
        name = prefix + entry.names[index]
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise ValueError(
                f"state_dict needs concrete arrays; parameter {name!r} is an "
                "abstract jax.ShapeDtypeStruct (from eval_shape). Load or initialize it first."
            )
        array = np.asarray(leaf)
        out[name] = array if entry.layer is None else array[entry.layer]
    return out


def save_safetensors(module, path, *, naming: str = "wan", prefix: str = "", metadata=None,
                     stacked=(), rename=None) -> None:
    """Writes the module's parameters to a `.safetensors` file.

    The names are those of [`state_dict`][]; the file reads back with
    [`load_state_dict`][], and with the `safetensors` package (and so PyTorch).
    The file is written beside `path` and renamed into place.

    **Arguments:**

    - `module`: an `eqx.Module` with concrete arrays, or any pytree of arrays (a
        dict of names to arrays is written under those names).
    - `path`: the file to write.
    - `naming`: `"wan"` or `"diffusers"`.
    - `prefix`: prepended to every name.
    - `metadata`: optional `dict[str, str]` stored as the file's `__metadata__`.
    - `stacked`, `rename`: as for [`load_state_dict`][].
    """
    write_safetensors(
        path, state_dict(module, naming=naming, prefix=prefix, stacked=stacked, rename=rename),
        metadata,
    )
