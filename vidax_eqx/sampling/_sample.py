"""One call that samples: the whole denoising loop of a Wan model, classifier-free
guidance batched or over a mesh axis, in one compiled `lax.fori_loop`."""

import functools
import math
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import models
from .._checks import is_int, is_real
from ._cogvideox import CogVideoXDDIM, CogVideoXDPM
from ._flow_match import FlowMatchEuler, UniPC
from ._options import LoopInputs, LoopOptions
from ._schedulers import AbstractScheduler
from ._step_cache import FirstBlockCache, StaticStepCache


SCHEDULERS = {
    "unipc": lambda: UniPC(shift=3.0),
    "euler": lambda: FlowMatchEuler(shift=3.0),
    "cogvideox_ddim": CogVideoXDDIM,
    "cogvideox_dpm": CogVideoXDPM,
}
"""The scheduler names `sample` accepts, and what each name builds."""


def _scheduler(scheduler) -> AbstractScheduler:
    if scheduler is None:
        return UniPC(shift=3.0)
    if isinstance(scheduler, str):
        if scheduler not in SCHEDULERS:
            raise ValueError(
                f"sample: `scheduler` must be a scheduler object or one of the names "
                f"{sorted(SCHEDULERS)}; received {scheduler!r}.")
        return SCHEDULERS[scheduler]()
    if not isinstance(scheduler, AbstractScheduler):
        raise ValueError(
            "sample: `scheduler` must be a vidax_eqx.sampling scheduler (e.g. UniPC(shift=3.0)), "
            f"one of the names {sorted(SCHEDULERS)}, or None (UniPC(shift=3.0)); received "
            f"{type(scheduler).__name__}.")
    return scheduler


def _check_scale(name: str, value, required: bool = True) -> None:
    if value is None and not required:
        return
    if not is_real(value) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"sample: `{name}` (the classifier-free guidance scale) must be a finite Python "
            f"number >= 0 (1.0 or less: no guidance; Wan uses 5.0); received {value!r}.")


def _shape(x):
    return tuple(getattr(x, "shape", ()))


def _layout(model):
    """`(channel axis, (pt, ph, pw), text width, layout)` of the latents of a known
    model, `None` for any other callable."""
    if isinstance(model, models.CogVideoXTransformer3D):  # diffusers' CogVideoX layout
        p = model.config.patch_size
        return 2, (1, p, p), model.config.text_embed_dim, "(B, F, C, H, W)"
    if isinstance(model, (models.WanTransformer3D, models.WanExperts)):
        return 1, tuple(model.config.patch_size), model.config.text_dim, "(B, C, F, H, W)"
    return None


def _check_inputs(model, noise, context, negative_context) -> None:
    """The shapes `sample` needs: 5D noise fitting the model's channels and patch size
    (`(B, C, F, H, W)` for Wan, `(B, F, C, H, W)` for CogVideoX), `(B, L, text_dim)`
    embeddings with one row per example."""
    layout = _layout(model)
    axis, patch, text_dim, names = layout or (1, None, None, "(B, C, F, H, W)")
    if getattr(noise, "ndim", None) != 5:
        raise ValueError(
            f"sample: `noise` must be the initial latents {names}; received shape "
            f"{_shape(noise)}.")
    B, C = noise.shape[0], noise.shape[axis]
    config = getattr(model, "config", None)
    if layout is not None:
        if C != config.out_channels:
            raise ValueError(
                f"sample: `noise` must have the model's {config.out_channels} latent channels "
                f"(out_channels; axis {axis} of {names}); received shape {noise.shape}.")
        grid = [noise.shape[a] for a in range(1, 5) if a != axis]  # F, H, W
        if any(n % p for n, p in zip(grid, patch)):
            raise ValueError(
                f"sample: the latent frames, height and width of `noise` {names} must be "
                f"multiples of the model's patch size {patch} (F, H, W); received shape "
                f"{noise.shape}.")
    if getattr(context, "ndim", None) != 3 or context.shape[0] != B or (
            text_dim is not None and context.shape[2] != text_dim):
        width = "text_dim" if text_dim is None else text_dim
        raise ValueError(
            f"sample: `context` must be the text embeddings (B, L, text_dim) = ({B}, L, "
            f"{width}), one row per example of `noise` {noise.shape}; received shape "
            f"{_shape(context)}.")
    if negative_context is not None and _shape(negative_context) != context.shape:
        raise ValueError(
            f"sample: `negative_context` must have the shape of `context` {context.shape} "
            f"(pad or cut both to the same text length); received shape "
            f"{_shape(negative_context)}.")


def _conditioning(model, noise, condition):
    """How `condition` enters the model: `None` (no condition), `("concat", axis)`
    (concatenated to the latents along the channel axis before every call: Wan I2V /
    FLF2V, CogVideoX I2V, any model whose `in_channels` exceed its `out_channels`), or
    `("frames", n)` (the first `n` latent frames replaced by the condition's, their
    tokens at timestep 0: Wan 2.2 TI2V); raises on a condition that does not fit."""
    layout = _layout(model)
    axis, patch, _, names = layout or (1, None, None, "(B, C, F, H, W)")
    config = getattr(model, "config", None)
    extra = 0 if layout is None else config.in_channels - config.out_channels
    if condition is None:
        if extra:
            raise ValueError(
                f"sample: `condition` is required by an image-conditioned model (in_channels "
                f"{config.in_channels} = the latents' {config.out_channels} + {extra} condition "
                f"channels: Wan I2V, CogVideoX I2V): the {names} latents concatenated to the "
                "noisy latents at every step (diffusers' `condition` / `image_latents`).")
        return None
    shape = _shape(condition)
    if extra or layout is None:
        expected = list(noise.shape)
        expected[axis] = extra if extra else (shape[axis] if len(shape) == 5 else "C")
        if list(shape) != expected:
            raise ValueError(
                f"sample: `condition` must be the condition latents {names} concatenated to "
                f"the noisy latents along axis {axis}: shape {tuple(expected)}; received "
                f"{shape}.")
        return ("concat", axis)
    if not isinstance(model, models.WanTransformer3D):
        raise ValueError(
            f"sample: `condition` for a model whose in_channels equal its out_channels "
            f"replaces the first latent frames (Wan 2.2 TI2V), which a {type(model).__name__} "
            "does not take; received a condition.")
    B, C, F, H, W = noise.shape
    if len(shape) != 5 or (shape[0], shape[1], shape[3], shape[4]) != (B, C, H, W) or not (
            1 <= shape[2] <= F):
        raise ValueError(
            f"sample: `condition` of Wan 2.2 TI2V must be the clean latents of the first "
            f"frames, (B, C, F_c, H, W) = ({B}, {C}, F_c, {H}, {W}) with 1 <= F_c <= {F} "
            f"(the encoded image: F_c = 1); received {shape}.")
    if shape[2] % patch[0]:
        raise ValueError(
            f"sample: the condition's {shape[2]} frames must be whole patches of "
            f"{patch[0]} frames; received {shape}.")
    return ("frames", shape[2])


def _check_mesh(mesh, batch_axis, cfg_axis, guided: bool, batch: int) -> None:
    if mesh is None:
        if batch_axis is not None or cfg_axis is not None:
            raise ValueError(
                "sample: `batch_axis` and `cfg_axis` name axes of `mesh`, which is None; "
                f"received batch_axis={batch_axis!r}, cfg_axis={cfg_axis!r}. Pass the mesh.")
        return
    axes = dict(mesh.shape)
    if batch_axis is not None:
        if batch_axis not in axes:
            raise ValueError(f"sample: `batch_axis` must be an axis of the mesh {axes}; "
                             f"received {batch_axis!r}.")
        if batch % axes[batch_axis]:
            raise ValueError(
                f"sample: the batch of `noise` ({batch}) must be a multiple of the size of "
                f"`batch_axis` {batch_axis!r} ({axes[batch_axis]}).")
    if cfg_axis is not None:
        if cfg_axis not in axes or axes[cfg_axis] != 2:
            raise ValueError(
                f"sample: `cfg_axis` must be an axis of size 2 of the mesh {axes} (one half "
                f"runs the conditional pass, the other the unconditional); received "
                f"{cfg_axis!r}.")
        if not guided:
            raise ValueError(
                "sample: `cfg_axis` splits the conditional and unconditional passes of "
                "classifier-free guidance, which runs only when guidance_scale > 1; "
                "received cfg_axis with no guidance. Drop cfg_axis or raise guidance_scale.")
        if batch_axis == cfg_axis:
            raise ValueError(
                f"sample: `cfg_axis` and `batch_axis` must be two different mesh axes; "
                f"received {cfg_axis!r} for both.")


# -- progress ----------------------------------------------------------------------------


class _Bars:
    """The host side of `progress=True`: one tqdm bar per run of a compiled loop, opened
    by step 0 and closed by the last (the callback is compiled once and reused)."""

    bar = None

    def advance(self, i, steps):
        i = int(i)
        if i == 0 or self.bar is None:
            if self.bar is not None:
                self.bar.close()
            import tqdm

            self.bar = tqdm.tqdm(total=steps, desc="sample", leave=True)
        self.bar.update(max(0, i + 1 - self.bar.n))  # unordered callbacks: never back
        if i + 1 == steps:
            self.bar.close()
            self.bar = None


_BARS = _Bars()


def _progress_wanted(progress) -> bool:
    if not progress:
        return False
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return sys.stdout.isatty()


# -- the loop ----------------------------------------------------------------------------


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


@eqx.filter_jit
def denoising_loop(inputs: LoopInputs, options: LoopOptions):
    """The denoising loop, `inputs.count` of the plan's rows: a Python int (a static
    trip count: `lax.fori_loop` lowers to a scan) or a traced one (a while loop over a
    plan padded to its capacity, one program for any number of steps)."""
    model, noise, plan, steps = inputs.model, inputs.noise, inputs.plan, inputs.count
    context, batched, condition, reuse = (inputs.context, inputs.batched, inputs.condition,
                                          inputs.reuse)
    scheduler, mesh, threshold = options.scheduler, options.mesh, options.threshold
    guided = inputs.negative_context is not None
    boundary = getattr(model, "boundary_timestep", None)
    if guided:
        context = jnp.concatenate([context, inputs.negative_context])
        batched = jax.tree.map(lambda a: jnp.concatenate([a, a]), batched)
    # The guided batch [conditional; unconditional] over cfg_axis (its outer half each),
    # and each half over batch_axis.
    cfg_axis, batch_axis = options.cfg_axis, options.batch_axis
    axis = (cfg_axis, batch_axis) if None not in (cfg_axis, batch_axis) else (
        cfg_axis if cfg_axis is not None else batch_axis)
    if options.text_cache and isinstance(model, (models.WanTransformer3D, models.WanExperts)):
        # The cross-attention's keys and values of both contexts, once per generation.
        image = batched.get("context_image")
        if mesh is None:
            cache = jax.vmap(lambda c, i: model.text_cache(c, context_image=i))(context, image)
        else:
            cache = models.sharded_text_cache(model, context, mesh=mesh, batch_axis=axis,
                                              context_image=image)
        batched = {**batched, "text_cache": cache}

    predict = functools.partial(_predict, mesh=mesh, batch_axis=axis,
                                static=options.model_static, batched=batched)
    mode, arg = options.conditioning or (None, None)
    if mode == "frames":  # TI2V: the first `arg` frames are the condition's
        kept = (jnp.arange(noise.shape[2]) < arg)[None, None, :, None, None]
        condition = jnp.pad(condition.astype(noise.dtype),
                            ((0, 0), (0, 0), (0, noise.shape[2] - arg), (0, 0), (0, 0)))

    def model_input(latents, t):
        """The model's input (both guidance halves) and timestep at the step's `t`."""
        if mode == "concat":
            latents = jnp.concatenate([latents, condition.astype(latents.dtype)], axis=arg)
        elif mode == "frames":  # diffusers' (1 - mask) * condition + mask * latents
            latents = jnp.where(kept, condition, latents)
            t = models.wan_image_timestep(t, noise.shape[2:], patch_size=model.config.patch_size,
                                          cond_frames=arg)
        return (jnp.concatenate([latents, latents]) if guided else latents), t

    cache = None
    if reuse is not None:  # step caching: the cache's shapes from an abstract first step
        x, t0 = model_input(noise, scheduler.timestep(plan, 0))
        shapes = eqx.filter_eval_shape(
            lambda: predict(model, x, t0, context, step=(models.StepCache(), False, threshold))[1])
        cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        reused = jnp.zeros(plan.steps, bool)

    def body(i, carry):
        latents, state, cache_carry = carry
        t = scheduler.timestep(plan, i)
        x, t_in = model_input(latents, t)
        if cache_carry is None:
            out = predict(model, x, t_in, context)
        else:
            cache, reused = cache_carry
            out, cache = predict(model, x, t_in, context, step=(cache, reuse[i], threshold))
            cache_carry = cache, reused.at[i].set(cache.reused[0])
        if guided:
            cond, uncond = jnp.split(out, 2)
            scales = inputs.guidance_scales
            scale = scales[0] if boundary is None else jnp.where(t >= boundary, scales[0], scales[1])
            if inputs.dynamic_cfg is not None:  # CogVideoX's use_dynamic_cfg
                scale = 1 + scale * inputs.dynamic_cfg[i]
            out = uncond + scale.astype(out.dtype) * (cond - uncond)
        step_key = None if inputs.key is None else jax.random.fold_in(inputs.key, i)
        latents, state = scheduler.step(plan, state, i, out, latents, key=step_key)
        if options.progress:
            jax.debug.callback(_BARS.advance, i, steps)
        return latents, state, cache_carry

    carry = (noise, scheduler.init(noise), None if cache is None else (cache, reused))
    latents, _, cache_carry = lax.fori_loop(0, steps, body, carry)
    if mode == "frames":  # the condition's frames, clean, as diffusers returns them
        latents = jnp.where(kept, condition, latents)
    return (latents, cache_carry[1]) if options.return_reused else latents


def sample(model, noise, context, *, negative_context=None, guidance_scale=5.0,
           guidance_scale_2=None, steps: int = 50, scheduler=None, mesh=None,
           batch_axis=None, cfg_axis=None, use_dynamic_cfg: bool = False, key=None,
           progress: bool = False, text_cache: bool = True, step_cache=None,
           return_reused: bool = False, max_steps: int | None = None, condition=None,
           **model_kwargs):
    """Generates latents: the whole denoising loop of diffusers' `WanPipeline`
    (`output_type="latent"`), or `CogVideoXPipeline`'s for a CogVideoX model, as one
    compiled program.

        for i in range(steps):                      # lax.fori_loop, i traced
            t = scheduler.timestep(plan, i)
            cond, uncond = model([x; x], t, [context; negative_context])  # one call, 2B
            v = uncond + scale * (cond - uncond)
            x = scheduler.step(plan, state, i, v, x)

    The loop runs under `eqx.filter_jit` (the model is an argument): it compiles once
    per number of steps (once for every number up to `max_steps` with it), scheduler,
    mesh and input shapes, and the guidance scales are traced (changing them does not
    recompile). `sample` itself works inside a caller's `eqx.filter_jit` too;
    [`export_sample`][] exports the compiled loop for a server to reload.

    **Arguments:**

    - `model`: a [`vidax_eqx.models.WanTransformer3D`][],
        [`vidax_eqx.models.WanExperts`][] (Wan 2.2 A14B) or
        [`vidax_eqx.models.CogVideoXTransformer3D`][], or any callable with their
        one-example signature `model(x, timestep, context, **kwargs)` (then the shapes
        are not checked against a config).
    - `noise`: the initial latents (standard normal), in the model's layout: Wan's
        `(B, C, F, H, W)`, CogVideoX's `(B, F, C, H, W)` (diffusers'); `C` the model's
        `out_channels`, `F, H, W` multiples of its patch size.
    - `context`: the text embeddings `(B, L, text_dim)`.
    - `negative_context`: the unconditional (negative prompt) embeddings, the shape of
        `context`; required when `guidance_scale > 1` (diffusers' pipeline encodes
        an empty or negative prompt then: pass its embeddings).
    - `guidance_scale`: the classifier-free guidance scale (>= 0); guidance runs
        when it is > 1, as in diffusers (`do_classifier_free_guidance`).
    - `guidance_scale_2`: Wan 2.2 A14B: the scale of the steps whose timestep is below
        the model's `boundary_timestep` (the low-noise expert's); `None`: the same as
        `guidance_scale`. Refused for a model without experts.
    - `steps`: the number of denoising steps, an int >= 1 (static).
    - `scheduler`: a scheduler of `vidax_eqx.sampling` ([`UniPC`][], [`FlowMatchEuler`][],
        ...), or one of the names `"unipc"` / `"euler"` (shift 3.0) /
        `"cogvideox_ddim"` / `"cogvideox_dpm"` (defaults); `None`: `UniPC(shift=3.0)`,
        Wan 2.1's shipped configuration at 480p (720p uses shift 5.0).
    - `mesh`: a `jax.sharding.Mesh`: each step's model call runs through
        [`vidax_eqx.models.run_sharded`][] (the model's own sequence, TP and FSDP
        parallelism as its `ParallelConfig` says); `None`: one device.
    - `batch_axis`: the mesh axis the batch (the guided batch of `2B`) is split over.
    - `cfg_axis`: CFG parallelism: a mesh axis of size 2 whose first half runs the
        conditional pass and the second the unconditional one. With `batch_axis` as
        well, each half's `B` examples are split over `batch_axis` (the guided batch
        over `(cfg_axis, batch_axis)`).
    - `use_dynamic_cfg`: CogVideoX's dynamic guidance (diffusers'
        `CogVideoXPipeline(use_dynamic_cfg=True)`): the scale of the step at timestep
        `t` is `1 + guidance_scale * (1 - cos(pi * ((steps - t) / steps) ** 5)) / 2`,
        computed as diffusers does (float64 on the host; `t` the timestep, as there).
    - `key`: a PRNG key, required by a stochastic scheduler (`CogVideoXDPM`): step `i`
        draws with `jax.random.fold_in(key, i)`.
    - `progress`: a tqdm bar advanced by every step from inside the compiled loop
        (`jax.debug.callback`), when tqdm is installed and stdout is a terminal.
    - `text_cache`: for a [`vidax_eqx.models.WanTransformer3D`][] (or each expert of
        a [`vidax_eqx.models.WanExperts`][]), compute the blocks' cross-attention
        keys and values of `context` and `negative_context` (and `context_image`)
        once, before the loop ([`vidax_eqx.models.WanTransformer3D.text_cache`][];
        with `mesh`, [`vidax_eqx.models.sharded_text_cache`][]), instead of in every
        step: the same latents, bit for bit. `False`: every step projects the text.
        Ignored for CogVideoX, whose text goes through joint self-attention with the
        video and changes in every block (its keys and values cannot be cached
        exactly).
    - `step_cache`: step caching, off by default: a [`StaticStepCache`][] (a fixed
        set of steps reuse the residual of the whole block stack from the last step
        that ran it) or a [`FirstBlockCache`][] (every step runs the first block, and
        skips the others when their input changed by less than a threshold). An
        approximation, traded for speed: the steps that run every block are exact.
        One decision per step for the whole batch (guidance's two halves included),
        reduced over every device when sharded. For a
        [`vidax_eqx.models.WanTransformer3D`][] (any sequence mode, TP, FSDP; with
        the text cache) and [`vidax_eqx.models.WanExperts`][] (the first step after
        the switch of experts runs every block); not for CogVideoX yet.
    - `return_reused`: with `step_cache`, return `(latents, reused)`: `reused` a
        `(steps,)` bool array, which steps reused.
    - `condition`: image-to-video, the encoded image (the VAE stays outside, like the
        text encoder), as diffusers' `WanImageToVideoPipeline` and
        `CogVideoXImageToVideoPipeline` build it:
        - a model whose `in_channels` exceed its `out_channels` (Wan 2.1 I2V and
          FLF2V, Wan 2.2 A14B I2V, CogVideoX I2V): the latents concatenated to the
          noisy latents along the channel axis before every model call, the shape of
          `noise` with `in_channels - out_channels` channels (Wan: diffusers'
          `condition`, the 4 mask channels then the image's 16; CogVideoX: its
          `image_latents`, the image's frame then zeros);
        - Wan 2.2 TI2V (`in_channels == out_channels`): the clean latents of the first
          `F_c` frames `(B, C, F_c, H, W)` (the image: `F_c = 1`): every call sees them
          in place of those frames, with their tokens at timestep 0
          ([`vidax_eqx.models.wan_image_timestep`][]), and the returned latents hold
          them (diffusers' `expand_timesteps`).
        Pass the CLIP features of an I2V model as `context_image=` (a model argument).
    - `max_steps`: `None` (default): the loop's trip count is `steps`, static (the
        loop lowers to a scan, which can be differentiated). An int >= `steps`: the
        plan is padded to `max_steps` rows and the trip count is traced, so that one
        compiled program serves every number of steps up to `max_steps` (a while
        loop; the same latents).
    - `**model_kwargs`: further model arguments: arrays are per example `(B, ...)` and
        repeated for the unconditional pass (e.g. `context_image`); anything else
        (`remat`, `sliding_tile`) is passed as it is.

    **Returns:**

    The final latents, the shape and dtype of `noise` (and `reused`, see
    `return_reused`).
    """
    return denoising_loop(*prepare("sample", **locals()))  # every argument, by name


def prepare(owner, model, noise, context, *, negative_context, guidance_scale,
            guidance_scale_2, steps, max_steps, scheduler, mesh, batch_axis, cfg_axis,
            use_dynamic_cfg, key, progress, text_cache, step_cache, return_reused,
            condition, model_kwargs) -> tuple[LoopInputs, LoopOptions]:
    """`sample`'s arguments checked and turned into `denoising_loop`'s:
    `(inputs, options)`."""
    if not is_int(steps) or steps < 1:
        raise ValueError(f"{owner}: `steps` (the number of denoising steps) must be a Python "
                         f"int >= 1; received {steps!r}.")
    if max_steps is not None and (not is_int(max_steps) or max_steps < steps):
        raise ValueError(
            f"{owner}: `max_steps` (the most steps the compiled loop serves) must be None or "
            f"a Python int >= steps ({steps}); received {max_steps!r}.")
    scheduler = _scheduler(scheduler)
    _check_scale("guidance_scale", guidance_scale)
    _check_scale("guidance_scale_2", guidance_scale_2, required=False)
    experts = isinstance(model, models.AbstractExperts)
    if guidance_scale_2 is not None and not experts:
        raise ValueError(
            "sample: `guidance_scale_2` is the low-noise expert's guidance scale of a "
            f"two-expert model (models.WanExperts); received {guidance_scale_2!r} for a "
            f"{type(model).__name__}. Drop it.")
    guided = guidance_scale > 1
    if guided and negative_context is None:
        raise ValueError(
            f"sample: `negative_context` is required when guidance_scale > 1 (classifier-free "
            f"guidance; received guidance_scale={guidance_scale!r}): pass the embeddings of "
            "the negative (or empty) prompt, or guidance_scale=1.0 for none.")
    _check_inputs(model, noise, context, negative_context)
    conditioning = _conditioning(model, noise, condition)
    _check_mesh(mesh, batch_axis, cfg_axis, guided, noise.shape[0])
    if not isinstance(use_dynamic_cfg, bool):
        raise ValueError(f"sample: `use_dynamic_cfg` must be True or False; received "
                         f"{use_dynamic_cfg!r}.")
    if not isinstance(text_cache, bool):
        raise ValueError(f"sample: `text_cache` must be True or False; received {text_cache!r}.")
    if scheduler.stochastic and key is None:
        raise ValueError(f"sample: `key` (a PRNG key) is required by the stochastic scheduler "
                         f"{type(scheduler).__name__}; received None.")
    reuse = _check_step_cache(model, step_cache, return_reused, steps)
    batched = {k: v for k, v in model_kwargs.items() if eqx.is_array(v)}
    static = {k: v for k, v in model_kwargs.items() if not eqx.is_array(v)}
    for name, value in batched.items():
        if value.ndim == 0 or value.shape[0] != noise.shape[0]:
            raise ValueError(
                f"sample: the model argument `{name}` must be per example, (B, ...) with "
                f"B = {noise.shape[0]}; received shape {value.shape}.")
    scale_2 = guidance_scale if guidance_scale_2 is None else guidance_scale_2
    # Host values go in with device_put (jnp.asarray compiles a small program per shape).
    scales = jax.device_put(np.asarray([guidance_scale, scale_2], np.float32))
    plan = scheduler.plan(steps)
    if reuse is not None:  # the mask on the host; a switch of experts runs every block
        switches = _expert_switches(model, plan)
        reuse = jax.device_put(reuse if switches is None else reuse & ~switches)
    dynamic = None
    if use_dynamic_cfg:  # on the host in float64, as diffusers computes it (math.cos)
        dynamic = jax.device_put(np.asarray(
            [(1 - math.cos(math.pi * ((steps - t) / steps) ** 5.0)) / 2
             for t in np.asarray(plan.timesteps, np.float64).tolist()], np.float32))
    count = steps
    if max_steps is not None:  # one program for any steps <= max_steps: a traced count
        plan, count = plan.padded(max_steps), jax.device_put(np.int32(steps))
        if dynamic is not None:
            dynamic = jax.device_put(np.pad(np.asarray(dynamic), (0, max_steps - steps),
                                            mode="edge"))
        if reuse is not None:
            reuse = jax.device_put(np.pad(np.asarray(reuse), (0, max_steps - steps)))
    inputs = LoopInputs(
        model=model, noise=noise, context=context,
        negative_context=negative_context if guided else None, guidance_scales=scales,
        dynamic_cfg=dynamic, plan=plan, key=key, batched=batched, reuse=reuse, count=count,
        condition=condition)
    options = LoopOptions(
        scheduler=scheduler, mesh=mesh, batch_axis=batch_axis, cfg_axis=cfg_axis,
        conditioning=conditioning, progress=_progress_wanted(progress),
        text_cache=text_cache, return_reused=return_reused, model_static=static,
        threshold=_threshold(step_cache))
    return inputs, options


def _threshold(step_cache):
    """The data-dependent rule's threshold as a traced scalar (changing it does not
    recompile), or `None` (a static schedule, or no step caching)."""
    threshold = getattr(step_cache, "threshold", None)
    return None if threshold is None else jax.device_put(np.float32(threshold))


def _check_step_cache(model, step_cache, return_reused, steps: int):
    """The `(steps,)` bool array of the steps that may reuse, or `None` without step
    caching; raises on a rule or model that cannot."""
    if not isinstance(return_reused, bool):
        raise ValueError(f"sample: `return_reused` must be True or False; received "
                         f"{return_reused!r}.")
    if step_cache is None:
        if return_reused:
            raise ValueError("sample: `return_reused` reports which steps reused the step "
                             "cache; it needs `step_cache`, which is None.")
        return None
    if not isinstance(step_cache, (StaticStepCache, FirstBlockCache)):
        raise ValueError(
            "sample: `step_cache` must be None, a sampling.StaticStepCache or a "
            f"sampling.FirstBlockCache; received {type(step_cache).__name__}.")
    if not isinstance(model, models.AbstractCachedModel):
        raise NotImplementedError(
            f"sample: step caching runs through the model's cached_call (WanTransformer3D, "
            f"WanExperts); a {type(model).__name__} has none (CogVideoX: not yet).")
    return step_cache.mask(steps)


def _expert_switches(model, plan) -> np.ndarray | None:
    """`(steps,)` bool: the steps whose expert differs from the previous step's (a
    cached residual is the other expert's there), or `None` for a one-expert model."""
    boundary = getattr(model, "boundary_timestep", None)
    if boundary is None:
        return None
    high = np.asarray(plan.timesteps) >= boundary
    return np.concatenate([[False], high[1:] != high[:-1]])
