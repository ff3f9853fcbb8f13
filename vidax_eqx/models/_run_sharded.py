"""`run_sharded`: a whole model over a mesh, global inputs in, global outputs out; and its
checks of the batch and FSDP axes."""

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ..nn import sharding
from ._base import AbstractBatchedInput, AbstractModel, expert_kwargs
from ._kv_cache import error_past_reach, KVCache
from ._options import attention_keywords, check_attention, BlockCausal, SlidingTile, VideoSparseTiles
from ._step_cache import step_cache_specs


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
    axes = sharding.fsdp_axes_of(model)
    if not axes:
        return
    parallel = model.parallel if isinstance(model, AbstractModel) else sharding.ParallelConfig()
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


def _kwarg_specs(value, parallel: sharding.ParallelConfig, batch_axis, batch):
    """The in_spec of a keyword input of `run_sharded`: `batch`, or the specs of a value
    that places itself (an `AbstractBatchedInput`)."""
    if not isinstance(value, AbstractBatchedInput):
        return batch
    return value.partition_specs(parallel, batch_axis)


_BATCH = "vidax_eqx.batch"
"""The axis name `run_sharded` vmaps the batch with (a step cache sums over it)."""


@attention_keywords
def run_sharded(model, x, timestep, context, *, mesh,
                batch_axis: str | tuple[str, ...] | None = None,
                remat: str | None = None,
                attention: SlidingTile | VideoSparseTiles | BlockCausal | None = None,
                step_cache=None, may_reuse=False, threshold=None, kv_cache=None, **kwargs):
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

    - `model`: an [`AbstractModel`][], e.g. a [`WanTransformer3D`][], configured for
        the mesh; or the
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
    - `attention`: the model's attention option (see
        [`WanTransformer3D.__call__`][vidax_eqx.models.WanTransformer3D.__call__]):
        `None` (full attention), a [`SlidingTile`][] or a [`VideoSparseTiles`][]. With
        video sparse attention over a ring (sequence `"ring"` or `"usp"`) the examples
        of a device run one after the other (`lax.map`, not `jax.vmap`), so that the
        ring skips at run time the steps none of an example's query tiles selected
        (under `jax.vmap` the skip would become a select that computes both
        branches). The keywords this replaced, `sliding_tile=` and `video_sparse=`,
        still work for a release, with a `DeprecationWarning`.
    - `step_cache`: step caching (a [`StepCache`][], batched and global: the
        previous step's, or `StepCache()` for the first step): the model's
        `cached_call` runs instead of the model, with `may_reuse` and `threshold` (see
        [`WanTransformer3D.cached_call`][vidax_eqx.models.WanTransformer3D.cached_call]), the change behind the decision summed over
        the batch and every mesh axis, so that every device takes the same branch.
    - `kv_cache`: streaming (a [`KVCache`][], batched: `(B, ...)` leaves, e.g. the
        model's `kv_cache(...)` broadcast over the batch): the model's `stream` runs on
        the chunk `x` instead of its call (`attention` a [`BlockCausal`][] or `None`),
        the cache split by heads over `tp` then the Ulysses axis
        ([`KVCache.partition_specs`][]); not over a ring, nor with `remat` or
        `step_cache`.
    - `**kwargs`: further batched array inputs of the model (e.g. `context_image`, or
        `text_cache`: an [`AbstractBatchedInput`][], a [`WanTextCache`][], is placed by
        the specs its `partition_specs` returns, e.g. heads over `tp`).

    **Returns:**

    The batched output, sharded over `batch_axis` (`PartitionSpec(batch_axis)`); with
    `step_cache`, `(output, step_cache)`, the cache's tokens split over the sequence
    axes; with `kv_cache`, `(output, kv_cache)`, the cache with the chunk appended.
    """
    if not isinstance(model, AbstractModel):
        raise ValueError(
            "run_sharded: `model` must be a whole model of vidax_eqx.models (a "
            "models.AbstractModel: WanTransformer3D, WanExperts, CogVideoXTransformer3D, "
            f"...); received a {type(model).__name__}. Run a layer over a mesh with "
            "nn.sharding.filter_shard_map."
        )
    batch_axis = check_batch_axis("run_sharded", mesh, batch_axis, x.shape[0])
    check_fsdp_axes("run_sharded", model, mesh, batch_axis)
    batch = P(batch_axis)
    attention = check_attention("run_sharded", attention)
    static = {} if attention is None else {"attention": attention}
    cached = step_cache is not None
    streaming = kv_cache is not None
    if streaming:
        _check_streaming(model, kv_cache, attention, remat, cached)
        kwargs = {**kwargs, "kv_cache": kv_cache}
    if cached:
        kwargs = {**kwargs, "step_cache": step_cache}
    if streaming and "check_reach" in kwargs:  # a keyword of stream, not an array
        static["check_reach"] = kwargs.pop("check_reach")
    names = sorted(kwargs)
    if cached and not model.capabilities.step_cache:
        raise ValueError(
            f"run_sharded: `step_cache` needs a model with step caching "
            f"(capabilities.step_cache: WanTransformer3D, WanExperts); received a "
            f"{type(model).__name__}.")
    decision = (jnp.asarray(may_reuse, bool),
                None if threshold is None else jnp.asarray(threshold, jnp.float32))

    def per_device(model, x, timestep, context, decision, *extra):
        def batch(model, index=None):
            def one(x, timestep, context, *extra):
                kw = dict(zip(names, extra))
                if index is not None:  # an expert: its own of what holds one per expert
                    kw = expert_kwargs(kw, index)
                if streaming:
                    cache = kw.pop("kv_cache")
                    return model.stream(x, timestep, context, cache, **static, **kw)
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

        if model.capabilities.experts:  # one expert per batch that agrees (AbstractExperts)
            return model.route_batch(batch, timestep, axis_name=batch_axis)
        return batch(model)

    parallel = model.parallel
    # Video sparse attention over a ring skips, at run time, the steps no local query
    # tile selected (a `lax.cond` on the selection); under `jax.vmap` that cond would
    # become a select computing both branches, so the examples run one by one.
    ring_skips = (isinstance(attention, VideoSparseTiles) and not cached
                  and parallel.ring_axis is not None)
    run = sharding.filter_shard_map(
        per_device,
        mesh=mesh,
        in_specs=(sharding.partition_specs(model, mesh), batch, batch, batch, P(),
                  *(_kwarg_specs(kwargs[n], parallel, batch_axis, batch) for n in names)),
        out_specs=((batch, step_cache_specs(parallel, batch_axis)) if cached else
                   (batch, kv_cache.partition_specs(parallel, batch_axis)) if streaming else batch),
        # A step cache's decision sums over the vmapped batch's axis, a collective
        # that shard_map's varying-axes checks do not take inside vmap.
        check_vma=not cached,
    )
    result = run(model, x, timestep, context, decision, *(kwargs[n] for n in names))
    if streaming and static.get("check_reach", True):  # the RoPE tables' reach, outside shard_map
        out, cache = result
        return error_past_reach(out, cache, model.config.rope_max_seq_len, "run_sharded"), cache
    return result


def _check_streaming(model, kv_cache, attention, remat, cached) -> None:
    """Raises unless `run_sharded(kv_cache=...)` can run the model's `stream`."""
    if not isinstance(kv_cache, KVCache):
        raise ValueError(f"run_sharded: `kv_cache` must be a models.KVCache (batched) or None; "
                         f"received a {type(kv_cache).__name__}.")
    if not model.capabilities.streaming:
        raise ValueError(f"run_sharded: `kv_cache` streams a model with a key/value cache "
                         f"(capabilities.streaming: WanTransformer3D, SkyReelsV2Transformer3D); "
                         f"received a {type(model).__name__}.")
    for name, given in (("step_cache", cached), ("remat", remat is not None),
                        ("attention (other than BlockCausal)",
                         attention is not None and not isinstance(attention, BlockCausal))):
        if given:
            raise ValueError(f"run_sharded: `kv_cache` (streaming) does not take `{name}`.")
