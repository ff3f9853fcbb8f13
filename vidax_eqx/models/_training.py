"""Training checkpoints: a model's arrays, its optimizer state and the step, saved with
orbax from a sharded run and restored onto any mesh and parallel configuration."""

import math
import os

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import nn
from .._jax_private import single_device_sharding


_KEYS = ("model", "opt_state", "step")


def _orbax(owner: str):
    """`orbax.checkpoint`, or an ImportError that says how to install it."""
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            f"{owner} writes and reads orbax checkpoints, and orbax-checkpoint is not "
            "installed: pip install 'vidax_eqx[train]' (optax and orbax-checkpoint), or "
            "pip install orbax-checkpoint."
        ) from e
    return ocp


def _checkpointer(ocp):
    """A synchronous orbax PyTree checkpointer for arrays (sharded or not) and scalars.

    Orbax's default array handler saves replica-parallel: every replicated array is
    sliced on device, one small compilation per slice and device (12 s against 0.4 s
    for a tiny model on 8 simulated CPU devices). Here the first replica of each shard
    writes it whole, which is what a sharded (FSDP) state mostly is anyway.
    """
    handlers = ocp.type_handlers
    registry = handlers.create_type_handler_registry(
        (int, handlers.ScalarHandler()),
        (float, handlers.ScalarHandler()),
        (np.number, handlers.ScalarHandler()),
        (np.ndarray, handlers.NumpyHandler()),
        (jax.Array, handlers.ArrayHandler(use_replica_parallel=False)),
    )
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry))


def _path(path) -> str:
    """An absolute local path (orbax wants one), or a URL (`gs://...`) as it is."""
    path = os.fspath(path)
    return path if "://" in path else os.path.abspath(path)


def _is_parameter(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _names(tree) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def save_training_state(path, model, opt_state, step: int, *, overwrite: bool = False) -> None:
    """Writes a training checkpoint: the arrays of `model`, the optimizer state and the
    step, with orbax, to the directory `path`.

    Call it from every process of the job at once, with the same arguments (each
    process writes the shards its devices hold, the first replica of each; `path`
    must be on storage every process sees). The arrays are written as global arrays,
    whatever their sharding: [`restore_training_state`][] reads them back onto any
    mesh and parallel configuration. The model's non-array parts (its config, its
    [`vidax_eqx.nn.sharding.ParallelConfig`][]) are not saved: the restore takes them from its
    template.

    Returns when the checkpoint is complete on disk (orbax writes into a temporary
    directory and renames it, so a crash leaves no half checkpoint at `path`).

        models.save_training_state(f"{root}/step_{step}", model, opt_state, step)

    **Arguments:**

    - `path`: the checkpoint directory (a `str` or `os.PathLike`; made absolute; a
        URL such as `gs://bucket/run/step_1000` is passed to orbax as it is).
    - `model`: the model (any PyTree; only its arrays are saved).
    - `opt_state`: the optimizer state (e.g. optax's), or `None` for weights only.
    - `step`: the training step, an `int`.
    - `overwrite`: replace an existing checkpoint at `path` instead of raising.

    **Returns:**

    `None`.
    """
    ocp = _orbax("save_training_state")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise ValueError(
            f"save_training_state: `step` must be an int (the training step); received "
            f"{step!r} of type {type(step).__name__}. Pass int(step)."
        )
    for what, tree in (("model", model), ("opt_state", opt_state)):
        abstract = [
            jax.tree_util.keystr(p)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if isinstance(x, jax.ShapeDtypeStruct)
        ]
        if abstract:
            raise ValueError(
                f"save_training_state: `{what}` has abstract arrays (jax.ShapeDtypeStruct, "
                f"e.g. at {abstract[0]}): there is nothing to save. Pass the trained "
                f"{what}, not a template from eqx.filter_eval_shape."
            )
    target = _path(path)
    if not overwrite and os.path.exists(target):
        raise ValueError(
            f"save_training_state: {target} exists already. Save each step to a directory "
            "of its own, or pass overwrite=True to replace it."
        )
    state = {"model": eqx.filter(model, eqx.is_array), "opt_state": opt_state, "step": int(step)}
    with _checkpointer(ocp) as checkpointer:
        checkpointer.save(target, args=ocp.args.PyTreeSave(state), force=overwrite)


def restore_training_state(path, model, opt_state=None, *, mesh=None):
    """Reads a checkpoint of [`save_training_state`][] onto `mesh`, laid out for the
    parallel configuration of `model`.

    The templates give the structure, shapes and dtypes; the mesh and the template
    model's [`vidax_eqx.nn.sharding.ParallelConfig`][] give the placement: the model's arrays
    by [`vidax_eqx.nn.sharding.partition_specs`][]`(model, mesh)`, the optimizer state as
    [`vidax_eqx.nn.sharding.shard_like`][] places it (the parts shaped like the parameters like
    them, the rest replicated), which is where a sharded training step returns them:
    a step already compiled for that placement runs on without compiling again, and
    a new one compiles on its first call only. The
    checkpoint may come from any mesh and configuration (saved with FSDP over 8
    devices, restored as FSDP 4 x tensor parallel 2; saved sharded, restored on one
    device); every array is read bit for bit, each process reading only its devices'
    shards. Call it from every process of the job at once.

    The templates may be real (the arrays' values are ignored) or abstract, which
    costs no memory and no initialization:

        def init():
            model = nn.sharding.with_parallel(models.WanTransformer3D(config, key=key), parallel)
            return model, optimizer.init(eqx.filter(model, eqx.is_array))

        model, opt_state = eqx.filter_eval_shape(init)
        model, opt_state, step = models.restore_training_state(
            path, model, opt_state, mesh=mesh)

    Before reading anything it checks that the checkpoint holds exactly the
    templates' arrays, with their shapes and dtypes, and that the mesh's axes divide
    every array as the specs split it; a mismatch is a `ValueError` naming the array.

    **Arguments:**

    - `path`: the checkpoint directory, as given to [`save_training_state`][].
    - `model`: the template model (real or from `eqx.filter_eval_shape`), with the
        [`vidax_eqx.nn.sharding.ParallelConfig`][] to restore into (set it with
        [`vidax_eqx.nn.sharding.with_parallel`][]); its non-array parts are the result's.
    - `opt_state`: the optimizer-state template (real, or
        `eqx.filter_eval_shape(optimizer.init, ...)`), or `None` to read the model
        alone (the stored optimizer state is skipped, e.g. to fine-tune or sample).
    - `mesh`: the `jax.sharding.Mesh` to restore onto, with the axes of the model's
        configuration; `None`: everything on the first device (single-process only).

    **Returns:**

    `(model, opt_state, step)`: the model (the template's non-array parts with the
    stored arrays), the optimizer state (`None` when `opt_state` is `None`) and the
    step, an `int`.
    """
    ocp = _orbax("restore_training_state")
    target = _path(path)
    if "://" not in target and not os.path.isdir(target):
        raise ValueError(
            f"restore_training_state: no checkpoint at {target} (not a directory). Pass a "
            "directory written by save_training_state."
        )
    if mesh is None and jax.process_count() > 1:
        raise ValueError(
            f"restore_training_state: mesh=None restores onto one device, which a job of "
            f"{jax.process_count()} processes cannot share. Pass the job's mesh."
        )
    arrays, static = eqx.partition(model, _is_parameter)
    model_shardings = _model_shardings(model, mesh)
    templates = {"model": arrays}
    shardings = {"model": model_shardings}
    if opt_state is not None:
        templates["opt_state"] = opt_state
        shardings["opt_state"] = _state_shardings(opt_state, model, model_shardings, mesh)

    with _checkpointer(ocp) as checkpointer:
        stored = checkpointer.metadata(target)
        stored = getattr(stored, "item_metadata", stored)  # orbax >= 0.11: a StepMetadata
        stored = getattr(stored, "tree", stored)
        _check_stored(ocp, target, stored, templates, shardings, mesh)
        item = {
            name: jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                templates[name], shardings[name],
            )
            for name in templates
        }
        item["step"] = 0
        state = checkpointer.restore(target, args=ocp.args.PyTreeRestore(
            item=item,
            restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=opt_state is None,
        ))
    restored = eqx.combine(state["model"], static)
    return restored, state.get("opt_state"), int(state["step"])


def _model_shardings(model, mesh):
    """A sharding per array of `model` (the arrays part's structure)."""
    arrays = eqx.filter(model, _is_parameter)
    if mesh is None:
        device = single_device_sharding(jax.devices()[0])
        return jax.tree.map(lambda _: device, arrays)
    specs = nn.sharding.partition_specs(model, mesh)
    specs = eqx.filter(specs, lambda s: isinstance(s, P), is_leaf=lambda s: isinstance(s, P))
    missing = sorted({a for s in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
                      for a in _spec_axes(s)} - set(mesh.shape))
    if missing:
        raise ValueError(
            f"restore_training_state: the model's parallel configuration shards over the "
            f"axis {missing[0]!r}, which the mesh {dict(mesh.shape)} does not have. Restore "
            "onto a mesh with that axis, or set the configuration with nn.sharding.with_parallel for "
            "this mesh."
        )
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda s: isinstance(s, P))


def _state_shardings(opt_state, model, model_shardings, mesh):
    """A sharding per array of `opt_state`, as `nn.sharding.shard_like(opt_state, model, mesh)`
    places it: a subtree shaped like the model's arrays gets their shardings, every
    other array is replicated (on the one device without a mesh)."""
    structure = jax.tree.structure(eqx.filter(model, _is_parameter))
    replicated = (single_device_sharding(jax.devices()[0]) if mesh is None
                  else NamedSharding(mesh, P()))

    def is_params(node):
        return (node is not None and not _is_parameter(node)
                and jax.tree.structure(node) == structure)

    def sharding(node):
        if is_params(node):
            return model_shardings
        if _is_parameter(node):
            return replicated
        raise ValueError(
            f"restore_training_state: the optimizer-state template holds {node!r} (a "
            f"{type(node).__name__}), which is neither an array nor shaped like the model's "
            "arrays. Pass a template whose leaves are arrays or jax.ShapeDtypeStructs, e.g. "
            "eqx.filter_eval_shape(optimizer.init, params)."
        )

    return jax.tree.map(sharding, opt_state, is_leaf=lambda n: is_params(n) or _is_parameter(n))


def _spec_axes(spec) -> list[str]:
    axes = []
    for entry in spec:
        if entry is None:
            continue
        axes += list(entry) if isinstance(entry, tuple) else [entry]
    return axes


def _check_stored(ocp, target, stored, templates, shardings, mesh) -> None:
    """Raises a ValueError naming the first array the restore would get wrong."""
    if not isinstance(stored, dict) or "model" not in stored or "step" not in stored:
        holds = (f"its top level holds {sorted(stored)}" if isinstance(stored, dict)
                 else "it holds no orbax PyTree checkpoint")
        raise ValueError(
            f"restore_training_state: {target} is not a checkpoint of save_training_state "
            f"({holds}, not {list(_KEYS)}). Pass the directory of one checkpoint, as given "
            "to save_training_state (e.g. .../step_1000, not its parent)."
        )
    if "opt_state" in templates and stored.get("opt_state") is None:
        raise ValueError(
            f"restore_training_state: {target} holds no optimizer state (it was saved with "
            "opt_state=None). Pass opt_state=None to restore the model alone, and initialize "
            "the optimizer afresh."
        )
    for name, template in templates.items():
        flat_stored = ocp.tree.to_flat_dict(stored[name])
        flat_template = ocp.tree.to_flat_dict(template)
        flat_shardings = ocp.tree.to_flat_dict(shardings[name])
        # The templates' arrays named as jax.tree_util.keystr writes them (the same
        # flattening order); a stored array the template lacks, by its orbax key.
        paths = {key: f"{name}{path}" for key, path in zip(flat_template, _names(template))}
        label = lambda key: paths.get(key) or ".".join((name, *key))  # noqa: E731
        missing = [k for k in flat_template if k not in flat_stored]
        extra = [k for k in flat_stored if k not in flat_template]
        if missing or extra:
            what = (f"has no array {label(missing[0])} of the template" if missing
                    else f"holds {label(extra[0])}, which the template lacks")
            raise ValueError(
                f"restore_training_state: the checkpoint {what} ({len(missing)} of the "
                f"template's arrays missing, {len(extra)} extra): it was saved from another "
                f"{'model' if name == 'model' else 'optimizer'}. Build the template with the "
                "configuration (and optimizer) the checkpoint was trained with."
            )
        for key, x in flat_template.items():
            meta = flat_stored[key]
            shape = tuple(getattr(meta, "shape", ()) or ())
            dtype = getattr(meta, "dtype", None)
            if shape != tuple(x.shape) or (dtype is not None and np.dtype(dtype) != np.dtype(x.dtype)):
                raise ValueError(
                    f"restore_training_state: the array {label(key)} is stored as "
                    f"{np.dtype(dtype) if dtype is not None else '?'}{list(shape)}, the "
                    f"template has {np.dtype(x.dtype)}{list(x.shape)}. Build the template "
                    "with the configuration (and dtypes) the checkpoint was trained with."
                )
            sharding = flat_shardings[key]
            if not isinstance(sharding, NamedSharding):
                continue
            for dim, entry in enumerate(sharding.spec):
                axes = _spec_axes(P(entry))
                size = math.prod(mesh.shape[a] for a in axes)
                if size > 1 and shape[dim] % size:
                    raise ValueError(
                        f"restore_training_state: the array {label(key)} of shape "
                        f"{shape} cannot be split over {axes} (size {size}) on its dimension "
                        f"{dim} ({shape[dim]}), as the model's parallel configuration asks "
                        f"on the mesh {dict(mesh.shape)}. Use mesh axes whose sizes divide "
                        "it (e.g. a tensor-parallel size that divides the heads), or a "
                        "configuration that does not split it."
                    )
