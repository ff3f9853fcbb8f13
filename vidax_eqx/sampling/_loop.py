"""The compiled denoising loop and what it takes, by name: its inputs (the model and the
arrays) and the options it is compiled for, as `sample`'s (or `export_sample`'s)
arguments make them."""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .. import models
from . import _forcing
from ._forcing import FINISHED_TIMESTEP, NOT_STARTED_TIMESTEP
from ._guidance import guide
from ._inputs import capabilities_of
from ._progress import SampleStep
from ._schedulers import AbstractScheduler, SchedulerPlan, SchedulerState


class LoopInputs(NamedTuple):
    """The loop's inputs: the model and the arrays (traced by `eqx.filter_jit`; the
    leaves `export_sample` exports the loop over)."""

    model: Any
    noise: Float[Array, "B ..."]
    context: Float[Array, "B L text_dim"]
    negative_context: Float[Array, "B L text_dim"] | None
    """`None` without classifier-free guidance."""
    guidance_scales: Float[Array, "2"]
    """`Guidance.scale`, then the low-noise expert's `Guidance.scale_2`."""
    dynamic_cfg: Float[Array, " steps"] | None
    """Each step's factor of CogVideoX's dynamic guidance, `None` without it."""
    plan: SchedulerPlan
    key: PRNGKeyArray | None
    batched: dict
    """The per-example model arguments, `(B, ...)` arrays by name."""
    reuse: Bool[Array, " steps"] | None
    """The steps that may reuse the step cache, `None` without step caching."""
    count: int | Int[Array, ""]
    """The trip count: a Python int (static), or a traced int32 with `max_steps`."""
    condition: Array | None
    forcing: tuple[Int[Array, "N F"], Bool[Array, "N F"], Bool[Array, "N F"]] | None = None
    """Diffusion forcing: each iteration's per-frame progress and update mask
    (`DiffusionForcing.rows`) and where the reference's aliasing rewrites a frame's last
    sample (`DiffusionForcing.reference_aliasing`); `None` for the ordinary loop."""


class LoopOptions(eqx.Module):
    """What the loop is compiled for (static fields: a change recompiles), and the
    step-cache threshold, traced so that changing it does not recompile."""

    scheduler: AbstractScheduler = eqx.field(static=True)
    mesh: jax.sharding.Mesh | None = eqx.field(static=True)
    batch_axis: str | tuple[str, ...] | None = eqx.field(static=True)
    cfg_axis: str | None = eqx.field(static=True)
    conditioning: tuple | None = eqx.field(static=True)
    """How `condition` enters the model: `None`, `("concat", axis)` or `("frames", n)`."""
    text_cache: bool = eqx.field(static=True)
    """Whether the loop computes the text's keys and values once (asked for, and the
    model's `capabilities.text_cache`)."""
    noised_prefix: tuple[int, float] | None = eqx.field(static=True)
    """Diffusion forcing's `(prefix_frames, addnoise_condition)` when the prefix is shown
    noised (`addnoise_condition > 0`), else `None`."""
    model_static: dict
    """The model's non-array keyword arguments (`remat`, `attention`), passed as
    they are (`eqx.filter_jit` keeps their non-array leaves static)."""
    threshold: Float[Array, ""] | None
    """The threshold of a `FirstBlockCache`, `None` for any other rule or none."""


class LoopResult(NamedTuple):
    latents: Array
    reused: Bool[Array, " steps"] | None
    """Which steps reused the step cache, `None` without step caching."""
    residual_norms: Float[Array, " steps"] | None
    """Each step's block-stack residual norm over the batch (the reused one at a step that
    reused), `None` without step caching: MagCache's calibration."""


_BATCH = "vidax_eqx.sampling.batch"


def _predict(model, x, timestep, context, *, mesh, batch_axis, static, batched, step=None):
    """The model's batched prediction at one scalar timestep (every example's); with
    `step = (cache, may_reuse, threshold)`, through the step cache: `(out, cache)`."""
    B = x.shape[0]
    if mesh is not None:
        t = jnp.broadcast_to(timestep, (B, *timestep.shape))
        cached = {} if step is None else dict(zip(("step_cache", "may_reuse", "threshold"), step))
        return models.run_sharded(model, x, t, context, mesh=mesh, batch_axis=batch_axis,
                                  **static, **cached, **batched)
    if step is not None:  # one decision for the batch: summed over the vmapped axis
        cache, may_reuse, threshold = step
        return jax.vmap(lambda x, c, k, kw: model.cached_call(
            x, timestep, c, k, may_reuse=may_reuse, threshold=threshold, axis_name=_BATCH,
            **static, **kw), axis_name=_BATCH)(x, context, cache, batched)
    # One timestep for the whole batch, kept out of the vmap: an expert model's
    # routing (a lax.cond on the timestep) stays a cond and runs one expert.
    return jax.vmap(lambda x, c, kw: model(x, timestep, c, **static, **kw))(x, context, batched)


class Prepared(NamedTuple):
    """What a call computes once before its steps: the model's context and per-example
    arguments for both guidance halves (with the text cache), the condition as the
    steps take it."""

    context: Array
    batched: dict
    condition: Array | None


def _axis(options: LoopOptions):
    """The guided batch [conditional; unconditional] over cfg_axis (its outer half each),
    and each half over batch_axis."""
    cfg_axis, batch_axis = options.cfg_axis, options.batch_axis
    return (cfg_axis, batch_axis) if None not in (cfg_axis, batch_axis) else (
        cfg_axis if cfg_axis is not None else batch_axis)


def _prepare(inputs: LoopInputs, options: LoopOptions) -> Prepared:
    model, noise, context, batched = inputs.model, inputs.noise, inputs.context, inputs.batched
    condition, mesh = inputs.condition, options.mesh
    if inputs.negative_context is not None:
        context = jnp.concatenate([context, inputs.negative_context])
        batched = jax.tree.map(lambda a: jnp.concatenate([a, a]), batched)
    if options.text_cache:
        # The cross-attention's keys and values of both contexts, once per generation.
        image = batched.get("context_image")
        if mesh is None:
            cache = jax.vmap(lambda c, i: model.text_cache(c, context_image=i))(context, image)
        else:
            cache = models.sharded_text_cache(model, context, mesh=mesh,
                                              batch_axis=_axis(options), context_image=image)
        batched = {**batched, "text_cache": cache}
    mode, arg = options.conditioning or (None, None)
    if mode == "frames":  # TI2V: the first `arg` frames are the condition's
        condition = jnp.pad(condition.astype(noise.dtype),
                            ((0, 0), (0, 0), (0, noise.shape[2] - arg), (0, 0), (0, 0)))
    return Prepared(context, batched, condition)


class _Steps(NamedTuple):
    body: Any
    """`body(i, carry) -> carry`, one denoising step."""
    init: Any
    """`init() -> carry`: the noise, the scheduler's state, the step cache's."""
    finish: Any
    """`finish(carry) -> LoopResult`."""


def _steps(inputs: LoopInputs, options: LoopOptions, prepared: Prepared) -> _Steps:
    model, noise, plan = inputs.model, inputs.noise, inputs.plan
    context, batched, condition, reuse = (prepared.context, prepared.batched,
                                          prepared.condition, inputs.reuse)
    scheduler, threshold = options.scheduler, options.threshold
    guided = inputs.negative_context is not None
    caps = capabilities_of(model)
    boundary = model.boundary_timestep if caps is not None and caps.experts else None
    predict = functools.partial(_predict, mesh=options.mesh, batch_axis=_axis(options),
                                static=options.model_static, batched=batched)
    mode, arg = options.conditioning or (None, None)
    if mode == "frames":
        kept = (jnp.arange(noise.shape[2]) < arg)[None, None, :, None, None]

    def model_input(latents, t):
        """The model's input (both guidance halves) and timestep at the step's `t`."""
        if mode == "concat":
            latents = jnp.concatenate([latents, condition.astype(latents.dtype)], axis=arg)
        elif mode == "frames":  # diffusers' (1 - mask) * condition + mask * latents
            latents = jnp.where(kept, condition, latents)
            t = models.wan_image_timestep(t, noise.shape[2:], patch_size=model.patch_size,
                                          cond_frames=arg)
        return (jnp.concatenate([latents, latents]) if guided else latents), t

    def init():
        cache_carry = None
        if reuse is not None:  # step caching: the cache's shapes from an abstract first step
            x, t0 = model_input(noise, scheduler.timestep(plan, 0))
            shapes = eqx.filter_eval_shape(lambda: predict(
                model, x, t0, context, step=(models.StepCache(), False, threshold))[1])
            cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            cache_carry = (cache, jnp.zeros(plan.steps, bool), jnp.zeros(plan.steps, jnp.float32))
        return noise, scheduler.init(noise), cache_carry

    def body(i, carry):
        latents, state, cache_carry = carry
        shown = latents
        if inputs.forcing is None:
            t = scheduler.timestep(plan, i)
        else:  # each frame's timestep at its own place in the schedule
            progress = inputs.forcing[0][i]
            t = jnp.where(progress == 0, NOT_STARTED_TIMESTEP, jnp.where(
                progress > plan.steps, FINISHED_TIMESTEP,
                plan.timesteps[jnp.clip(progress - 1, 0, plan.steps - 1)]))
            if options.noised_prefix is not None:
                shown, t = _noised_prefix(latents, t, inputs.key, i, *options.noised_prefix)
        x, t_in = model_input(shown, t)
        if cache_carry is None:
            out = predict(model, x, t_in, context)
        else:
            cache, reused, norms = cache_carry
            out, cache = predict(model, x, t_in, context, step=(cache, reuse[i], threshold))
            # The residual's magnitude over the batch: what MagCache calibrates with.
            norm = jnp.sqrt(jnp.sum(jnp.square(cache.residual)))
            cache_carry = cache, reused.at[i].set(cache.reused[0]), norms.at[i].set(norm)
        if guided:
            cond, uncond = jnp.split(out, 2)
            scales = inputs.guidance_scales
            scale = scales[0] if boundary is None else jnp.where(t >= boundary, scales[0], scales[1])
            if inputs.dynamic_cfg is not None:  # CogVideoX's use_dynamic_cfg
                scale = 1 + scale * inputs.dynamic_cfg[i]
            out = guide(cond, uncond, scale.astype(out.dtype))
        if inputs.forcing is not None:
            latents, state = _forcing_step(scheduler, plan, state, *(a[i] for a in inputs.forcing),
                                           out, latents)
            return latents, state, cache_carry
        step_key = None if inputs.key is None else jax.random.fold_in(inputs.key, i)
        latents, state = scheduler.step(plan, state, i, out, latents, key=step_key)
        return latents, state, cache_carry

    def finish(carry):
        latents, _, cache_carry = carry
        if mode == "frames":  # the condition's frames, clean, as diffusers returns them
            latents = jnp.where(kept, condition, latents)
        if cache_carry is None:
            return LoopResult(latents, None, None)
        return LoopResult(latents, cache_carry[1], cache_carry[2])

    return _Steps(body, init, finish)


def _noised_prefix(latents, t, key, i, frames: int, level: float):
    """diffusers' `addnoise_condition`: the model sees the first `frames` latent frames
    as `x (1 - level / 1000) + n level / 1000` at timestep `level`, fresh noise `n` at
    every iteration (the latents themselves are kept)."""
    factor = 0.001 * level
    prefix = latents[:, :, :frames]
    noise = _forcing.condition_noise(key, i, prefix.shape).astype(latents.dtype)
    noised = prefix * (1.0 - factor) + noise * factor
    return latents.at[:, :, :frames].set(noised), t.at[:frames].set(level)


def _forcing_step(scheduler, plan, state, progress, update, alias, out, latents):
    """Diffusion forcing's step of latents `(B, C, F, H, W)`: each frame `f` that `update`
    marks takes step `progress[f] - 1` of the schedule with its own slice of the state
    (the frames' schedulers are independent, as SkyReels-V2's per-frame scheduler copies
    are); the others, and their states, are kept. Where `alias` is set, the frame's last
    sample in the state (`history[0]`, UniPC's) becomes the step's output."""

    def frame(i, history, out, x):
        x, state = scheduler.step(plan, SchedulerState(history), i, out, x)
        return x, state.history

    index = jnp.clip(progress - 1, 0, plan.steps - 1)
    stepped, history = jax.vmap(frame, in_axes=(0, 3, 2, 2), out_axes=(2, 3))(
        index, state.history, out, latents)
    keep = update[:, None, None]
    history = jnp.where(keep, history, state.history)
    if history.shape[0]:
        history = history.at[0].set(jnp.where(alias[:, None, None], stepped, history[0]))
    return jnp.where(keep, stepped, latents), SchedulerState(history)


@eqx.filter_jit
def denoising_loop(inputs: LoopInputs, options: LoopOptions) -> LoopResult:
    """The denoising loop, `inputs.count` of the plan's rows: a Python int (a static
    trip count: `lax.fori_loop` lowers to a scan) or a traced one (a while loop over a
    plan padded to its capacity, one program for any number of steps)."""
    steps = _steps(inputs, options, _prepare(inputs, options))
    return steps.finish(lax.fori_loop(0, inputs.count, steps.body, steps.init()))


# -- the same loop driven from the host, a step at a time --------------------------------


@eqx.filter_jit
def _start(inputs: LoopInputs, options: LoopOptions):
    prepared = _prepare(inputs, options)
    return prepared, _steps(inputs, options, prepared).init()


@eqx.filter_jit
def _segment(inputs: LoopInputs, options: LoopOptions, prepared: Prepared, carry, start, stop):
    """Steps `[start, stop)` (traced: one program for every segment) from `carry`."""
    return lax.fori_loop(start, stop, _steps(inputs, options, prepared).body, carry)


@eqx.filter_jit
def _finish(inputs: LoopInputs, options: LoopOptions, prepared: Prepared, carry) -> LoopResult:
    return _steps(inputs, options, prepared).finish(carry)


def stepwise_loop(inputs: LoopInputs, options: LoopOptions, steps: int,
                  callback: Callable[[SampleStep], None]) -> LoopResult:
    """[`denoising_loop`][]'s steps one program call at a time, each step told to
    `callback` once it is done: the same latents, and no host callback inside the
    compiled programs (so that JAX's persistent compilation cache can keep them; it
    refuses programs with host callbacks). The per-call work before the steps (the
    text cache) is its own program, run once."""
    prepared, carry = _start(inputs, options)
    for i in range(steps):
        start, stop = jax.device_put(np.int32(i)), jax.device_put(np.int32(i + 1))
        carry = _segment(inputs, options, prepared, carry, start, stop)
        if carry[2] is None:
            jax.block_until_ready(carry[0])
            reused = None
        else:
            reused = bool(np.asarray(carry[2][1])[i])
        callback(SampleStep(i, steps, reused))
    return _finish(inputs, options, prepared, carry)
