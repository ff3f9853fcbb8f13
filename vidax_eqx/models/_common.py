"""What the whole models share: checkpoint directories, the token split of a sharded
run, scanned layers with rematerialization, and the one call that runs a model over a mesh."""

import abc
import json
import math
import os

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from .. import interop, kernels, nn
from ..nn.internal import has_shards, regather_policy
from ._step_cache import step_cache_specs


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
                       if isinstance(c, nn.sharding.ParallelConfig))
        base = jax.checkpoint_policies.everything_saveable if policy is _NO_REMAT else policy
        policy = regather_policy(base, keep=keep)
        step = jax.checkpoint(step, policy=policy)
    elif policy is not _NO_REMAT:
        step = jax.checkpoint(step, policy=policy)
    return lax.scan(step, x, arrays)[0]


def sliding_tile_mask(owner: str, sliding_tile, grid, text_len: int = 0):
    """The `kernels.SlidingTileMask` of a model's `sliding_tile=(tile, window)` over its
    patch `grid` (after a text prefix of `text_len` tokens), or `None`."""
    if sliding_tile is None:
        return None
    if not isinstance(sliding_tile, (tuple, list)) or len(sliding_tile) != 2:
        raise ValueError(
            f"{owner}: `sliding_tile` must be a pair (tile, window), e.g. ((3, 6, 8), (3, 3, 3)); "
            f"received {sliding_tile!r}."
        )
    tile, window = sliding_tile
    return kernels.SlidingTileMask(tuple(grid), tile, window, text_len=text_len)


def video_sparse_option(owner: str, video_sparse, grid, sliding_tile=None):
    """The [`vidax_eqx.nn.VideoSparse`][] of a model's `video_sparse=(tile, topk or
    sparsity)` over its patch `grid` (an int: `topk`, a float: `sparsity`), or `None`."""
    if video_sparse is None:
        return None
    if sliding_tile is not None:
        raise ValueError(
            f"{owner}: `video_sparse` and `sliding_tile` are two kinds of sparse attention; "
            f"pass one of them; received video_sparse={video_sparse!r}, "
            f"sliding_tile={sliding_tile!r}."
        )
    ok = isinstance(video_sparse, (tuple, list)) and len(video_sparse) == 2
    amount = video_sparse[1] if ok else None
    if not ok or isinstance(amount, bool) or not isinstance(amount, (int, float)):
        raise ValueError(
            f"{owner}: `video_sparse` must be a pair (tile, topk or sparsity): an int "
            "is the number of key tiles each query tile attends, a float in [0, 1) the "
            "fraction skipped, e.g. ((4, 4, 4), 0.9) or ((2, 2, 2), 3); received "
            f"{video_sparse!r}."
        )
    tile = video_sparse[0]
    kind = "topk" if isinstance(amount, int) else "sparsity"
    return nn.VideoSparse(tuple(grid), tile, **{kind: amount})


def read_config(path, owner: str, *, subfolder=None, revision=None, cache_dir=None):
    """`(config.json as a dict, the lazy tensor mapping)` of a checkpoint directory, or
    of a Hugging Face Hub repository's (resolved by
    [`vidax_eqx.interop.resolve_checkpoint`][] with `subfolder`, `revision`, `cache_dir`)."""
    try:
        text = interop.resolve_checkpoint(path, subfolder=subfolder, revision=revision,
                                          cache_dir=cache_dir)
    except ValueError as e:
        raise ValueError(f"{owner}.from_pretrained: {e}") from e.__cause__
    config_path = os.path.join(text, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(
            f"{owner}.from_pretrained: {text!r} must be a checkpoint directory holding "
            "config.json and the safetensors weights (diffusers' save_pretrained layout, or "
            "a Wan 2.1 release)"
            + ("" if subfolder else "; for a diffusers pipeline pass subfolder='transformer'")
            + "."
        )
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{owner}.from_pretrained: {config_path!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{owner}.from_pretrained: {config_path!r} must hold a JSON object.")
    return raw, interop.open_checkpoint(text)


def load_pretrained(cls, config, tensors, *, dtype, dtype_from: str, parallel,
                    implementation, mesh=None, **load_kwargs):
    """`cls(config, ...)` built abstractly (no random weights) in `dtype` (default: the
    checkpoint's dtype of the tensor `dtype_from`, else float32) and filled from
    `tensors` by [`vidax_eqx.interop.load_state_dict`][] (`load_kwargs`: `stacked=`,
    `rename=`); with `mesh`, every parameter placed by
    [`vidax_eqx.nn.sharding.partition_specs`][]`(model, mesh)` under `parallel`, each process
    reading only the blocks its devices hold."""
    if dtype is None:  # a missing tensor is reported by the load
        dtype = tensors.dtype(dtype_from) if dtype_from in tensors else jnp.float32
    model = eqx.filter_eval_shape(
        cls, config, parallel=parallel, implementation=implementation, dtype=dtype,
        key=jax.random.PRNGKey(0),
    )
    try:
        return interop.load_state_dict(model, tensors, mesh=mesh, **load_kwargs)
    except ValueError as e:
        if mesh is None or str(e).startswith("load_state_dict"):
            raise
        # The placement's errors (nn.sharding.partition_specs: an FSDP size that divides nothing,
        # axes the mesh lacks) name the model's call, not the loader's.
        raise ValueError(f"{cls.__name__}.from_pretrained(mesh=...): {e}") from None


class AbstractExperts(eqx.Module):
    """A model made of experts, one chosen per call by the timestep (Wan 2.2 A14B's
    [`vidax_eqx.models.WanExperts`][]): [`run_sharded`][] runs a batch through
    `route_batch` instead of `jax.vmap`, which would run every expert."""

    @abc.abstractmethod
    def route_batch(self, fn, timestep, *, axis_name=None):
        """`fn(expert, index)` (a batched call of one expert) for the experts the
        batch's `timestep` selects; inside `shard_map` the devices along `axis_name`
        (the batch axis) choose together."""


def batch_axes(batch_axis) -> tuple:
    """`batch_axis` (`None`, one mesh axis name or a tuple of them) as a tuple of names."""
    if batch_axis is None:
        return ()
    return tuple(batch_axis) if isinstance(batch_axis, (tuple, list)) else (batch_axis,)


def check_batch_axis(owner: str, mesh, batch_axis, batch: int):
    """`batch_axis` of a sharded call (`None`, a mesh axis name, or a tuple or list of
    them) as `P` takes it, after checking it names distinct axes of `mesh` whose
    devices divide the `batch`; a `ValueError` naming `owner` otherwise."""
    if isinstance(batch_axis, list):
        batch_axis = tuple(batch_axis)
    axes = batch_axes(batch_axis)
    if batch_axis is not None and not axes:
        raise ValueError(
            f"{owner}: `batch_axis` is a mesh axis name, a non-empty tuple of them, or "
            "None; received (). Pass None to keep the batch on every device."
        )
    for a in axes:
        if a not in mesh.shape:
            raise ValueError(
                f"{owner}: every axis of `batch_axis` must be an axis of the mesh "
                f"{tuple(mesh.shape)}; {a!r} (of batch_axis={batch_axis!r}) is not. Add it "
                f"to the mesh or leave it out of batch_axis."
            )
    if len(set(axes)) != len(axes):
        repeated = sorted({a for a in axes if axes.count(a) > 1})
        raise ValueError(
            f"{owner}: the axes of `batch_axis` must be distinct; received "
            f"batch_axis={batch_axis!r}, which repeats {', '.join(map(repr, repeated))}. "
            f"Name each axis once."
        )
    if axes:
        sizes = [mesh.shape[a] for a in axes]
        devices = math.prod(sizes)
        if batch % devices:
            split = " x ".join(f"{a!r} ({n})" for a, n in zip(axes, sizes))
            raise ValueError(
                f"{owner}: the batch must be a multiple of the number of devices it is "
                f"split over, the size of `batch_axis` {batch_axis!r}: {split} = {devices}; "
                f"received a batch of {batch}. Pad the batch or split it over fewer "
                f"devices."
            )
    return batch_axis


def check_fsdp_axes(owner: str, model, mesh, batch_axis) -> None:
    """Raises unless each FSDP axis of `model` carries different data: the batch (any
    axis of `batch_axis`, one mesh axis name or a tuple of them) or the model's
    sequence. Along any other axis the devices would compute the same thing, and the
    output (computed with weights gathered over that axis) could not leave `shard_map`
    as replicated."""
    axes = nn.sharding.fsdp_axes_of(model)
    if not axes:
        return
    parallel = model.parallel if hasattr(model, "parallel") else nn.sharding.ParallelConfig()
    sequence = parallel.sequence_axes
    data = {*batch_axes(batch_axis), *sequence} - {None}
    idle = [a for a in axes if a not in data and mesh.shape.get(a, 1) > 1]
    if idle:
        raise ValueError(
            f"{owner}: the FSDP axis {idle[0]!r} (fsdp_axes={axes}) carries neither the batch "
            f"(batch_axis={batch_axis!r}) nor the sequence (sequence={parallel.sequence!r}, "
            f"axes {sequence}): its devices would compute the same thing. Split the batch or "
            f"the sequence over it, or leave it out of fsdp_axes."
        )


def _kwarg_specs(value, model, batch_axis, batch):
    """The in_spec of a keyword input of `run_sharded`: `batch`, or the specs of a value
    that places itself (`value.partition_specs(parallel, batch_axis)`)."""
    if not hasattr(value, "partition_specs"):
        return batch
    return value.partition_specs(getattr(model, "parallel", nn.sharding.ParallelConfig()), batch_axis)


_BATCH = "vidax_eqx.batch"
"""The axis name `run_sharded` vmaps the batch with (a step cache sums over it)."""


def run_sharded(model, x, timestep, context, *, mesh,
                batch_axis: str | tuple[str, ...] | None = None,
                remat: str | None = None, sliding_tile=None, video_sparse=None,
                step_cache=None,
                may_reuse=False, threshold=None, **kwargs):
    """Runs a whole model over `mesh`, global (batched) inputs in, global outputs out.

    `jax.shard_map` of `jax.vmap(model)`: the weights placed by
    [`vidax_eqx.nn.sharding.partition_specs`][] (Megatron shards when the model's
    `parallel.tp_axis` is set; place them once beforehand with
    [`vidax_eqx.nn.sharding.shard_module`][] to avoid a reshard per call), the batch split over
    `batch_axis` (data parallelism, and classifier-free guidance's conditional and
    unconditional halves over an axis of their own), everything else whole on every
    device. Inside,
    the model splits its own tokens over its sequence axes after the patch embedding
    and gathers them before unpatchify, as its [`vidax_eqx.nn.sharding.ParallelConfig`][]
    says (set it with [`vidax_eqx.nn.sharding.with_parallel`][]). Works under `eqx.filter_jit`
    and `eqx.filter_grad` (the model is an argument), and gives the single-device
    numbers.

    **Arguments:**

    - `model`: e.g. a [`WanTransformer3D`][], configured for the mesh; or the
        experts of [`WanExperts`][], the whole (local) batch routed to one expert
        when its timesteps agree (all devices of the batch axes agreeing), to both
        (each example's output from its own) when they do not.
    - `x`, `timestep`, `context`: batched inputs `(B, ...)`, as `jax.vmap(model)` takes.
    - `mesh`: a `jax.sharding.Mesh` with the model's axes (and `batch_axis`).
    - `batch_axis`: the mesh axis the batch is split over; or a tuple of distinct mesh
        axes, the batch split over their product, the first outermost (as in
        `PartitionSpec(("cfg", "dp"))`: with 2 x 2 devices, `cfg` index 0 holds the
        first half of the batch); or `None` (the batch on every device). `B` must be a
        multiple of the number of devices it is split over.
    - `remat`: the model's rematerialization policy (see its `__call__`).
    - `sliding_tile`: `(tile, window)`: sliding tile attention (see the model's
        `__call__`); `None`: full attention.
    - `video_sparse`: `(tile, topk or sparsity)`: video sparse attention (see
        [`WanTransformer3D.__call__`][]); `None`: full attention. Over a ring
        (sequence `"ring"` or `"usp"`) the examples of a device run one after the
        other (`lax.map`, not `jax.vmap`), so that the ring skips at run time the
        steps none of an example's query tiles selected (under `jax.vmap` the skip
        would become a select that computes both branches).
    - `step_cache`: step caching (a [`StepCache`][], batched and global: the
        previous step's, or `StepCache()` for the first step): the model's
        `cached_call` runs instead of the model, with `may_reuse` and `threshold` (see
        [`WanTransformer3D.cached_call`][]), the change behind the decision summed over
        the batch and every mesh axis, so that every device takes the same branch.
    - `**kwargs`: further batched array inputs of the model (e.g. `context_image`, or
        `text_cache`: a value with a `partition_specs(parallel, batch_axis)` method, a
        [`WanTextCache`][], is placed by the specs it returns, e.g. heads over `tp`).

    **Returns:**

    The batched output, sharded over `batch_axis` (`PartitionSpec(batch_axis)`); with
    `step_cache`, `(output, step_cache)`, the cache's tokens split over the sequence
    axes.
    """
    batch_axis = check_batch_axis("run_sharded", mesh, batch_axis, x.shape[0])
    check_fsdp_axes("run_sharded", model, mesh, batch_axis)
    batch = P(batch_axis)
    static = {} if sliding_tile is None else {"sliding_tile": sliding_tile}
    if video_sparse is not None:
        static["video_sparse"] = video_sparse
    cached = step_cache is not None
    if cached:
        kwargs = {**kwargs, "step_cache": step_cache}
    names = sorted(kwargs)
    if cached and not hasattr(model, "cached_call"):
        raise ValueError(
            f"run_sharded: `step_cache` needs a model with step caching (cached_call: "
            f"WanTransformer3D); received a {type(model).__name__}.")
    decision = (jnp.asarray(may_reuse, bool),
                None if threshold is None else jnp.asarray(threshold, jnp.float32))

    def per_device(model, x, timestep, context, decision, *extra):
        def batch(model, index=None):
            def one(x, timestep, context, *extra):
                kw = dict(zip(names, extra))
                if index is not None:  # an expert: its own of what holds one per expert
                    kw = {k: v.for_expert(index) if hasattr(v, "for_expert") else v
                          for k, v in kw.items()}
                if not cached:
                    return model(x, timestep, context, remat=remat, **static, **kw)
                cache = kw.pop("step_cache")
                return model.cached_call(
                    x, timestep, context, cache, may_reuse=decision[0],
                    threshold=decision[1], axis_name=(_BATCH, *mesh.axis_names),
                    remat=remat, **static, **kw)

            if ring_skips:  # one example at a time: each ring step's skip stays a cond
                return lax.map(lambda args: one(*args), (x, timestep, context, *extra))
            return jax.vmap(one, axis_name=_BATCH)(x, timestep, context, *extra)

        if isinstance(model, AbstractExperts):  # one expert per batch that agrees
            return model.route_batch(batch, timestep, axis_name=batch_axis)
        return batch(model)

    parallel = getattr(model, "parallel", nn.sharding.ParallelConfig())
    # Video sparse attention over a ring skips, at run time, the steps no local query
    # tile selected (a `lax.cond` on the selection); under `jax.vmap` that cond would
    # become a select computing both branches, so the examples run one by one.
    ring_skips = (video_sparse is not None and not cached
                  and parallel.sequence in ("ring", "usp"))
    run = nn.sharding.filter_shard_map(
        per_device,
        mesh=mesh,
        in_specs=(nn.sharding.partition_specs(model, mesh), batch, batch, batch, P(),
                  *(_kwarg_specs(kwargs[n], model, batch_axis, batch) for n in names)),
        out_specs=(batch, step_cache_specs(parallel, batch_axis)) if cached else batch,
        # A step cache's decision sums over the vmapped batch's axis, a collective
        # that shard_map's varying-axes checks do not take inside vmap.
        check_vma=not cached,
    )
    return run(model, x, timestep, context, decision, *(kwargs[n] for n in names))
