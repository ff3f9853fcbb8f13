"""One call that samples: the whole denoising loop of a Wan or CogVideoX model,
classifier-free guidance batched or over a mesh axis, in one compiled `lax.fori_loop`;
its options in four objects, its progress through a callback of the call."""

import dataclasses
import math

import equinox as eqx
import jax
import numpy as np

from .. import models
from .._checks import is_int
from .._deprecation import warn_deprecated
from ._inputs import (
    capabilities_of, check_inputs, check_placement, check_step_cache, conditioning_of,
    expert_switches, scheduler_of,
)
from ._flow_match import UniPC
from ._forcing import DiffusionForcing
from ._loop import denoising_loop, LoopInputs, LoopOptions, stepwise_loop
from ._options import Caching, Compilation, Guidance, Placement
from ._progress import AbstractProgress, default_progress
from ._step_cache import MagCache, StaticStepCache


# The keywords `sample` took before 0.2.0, each now a field of one of its option objects.
OLD_KEYWORDS = {
    "guidance_scale": ("guidance", Guidance, "scale"),
    "guidance_scale_2": ("guidance", Guidance, "scale_2"),
    "use_dynamic_cfg": ("guidance", Guidance, "dynamic"),
    "mesh": ("placement", Placement, "mesh"),
    "batch_axis": ("placement", Placement, "batch_axis"),
    "cfg_axis": ("placement", Placement, "cfg_axis"),
    "text_cache": ("caching", Caching, "text"),
    "step_cache": ("caching", Caching, "step"),
    "max_steps": ("compilation", Compilation, "max_steps"),
}


def options_from_old_keywords(owner: str, groups: dict, kwargs: dict) -> dict:
    """The option objects `groups` (`{"guidance": Guidance(...), ...}`) with the old
    keywords found in `kwargs` (removed from it) applied, each with a deprecation
    warning pointing at the caller of `owner`. An old keyword beside an explicit object
    of its group is a `TypeError`."""
    fields: dict[str, dict] = {}
    names: dict[str, list] = {}
    for old in [k for k in kwargs if k in OLD_KEYWORDS]:
        group, cls, field = OLD_KEYWORDS[old]
        warn_deprecated(f"{owner}({old}=...)", f"`{group}=sampling.{cls.__name__}({field}=...)`",
                        stacklevel=3)
        fields.setdefault(group, {})[field] = kwargs.pop(old)
        names.setdefault(group, []).append(old)
    groups = dict(groups)
    for group, values in fields.items():
        cls = next(c for g, c, _ in OLD_KEYWORDS.values() if g == group)
        if groups[group] != cls():
            raise TypeError(
                f"{owner}() got `{group}=` and the deprecated keywords {names[group]} of the "
                f"same group: pass `{group}={cls.__name__}(...)` only.")
        groups[group] = cls(**values)
    return groups


def old_return_reused(owner: str, kwargs: dict) -> bool:
    """The deprecated `return_reused` keyword (removed from `kwargs`), `False` if absent."""
    if "return_reused" not in kwargs:
        return False
    value = kwargs.pop("return_reused")
    warn_deprecated(f"{owner}(return_reused=...)",
                    "a `progress=` callback (each step's `SampleStep.reused`)", stacklevel=3)
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: `return_reused` must be True or False; received {value!r}.")
    return value


def sample(model, noise, context, *, negative_context=None, steps: int = 50, scheduler=None,
           guidance: Guidance = Guidance(), placement: Placement = Placement(),
           caching: Caching = Caching(), compilation: Compilation = Compilation(),
           condition=None, key=None, progress=None, forcing: DiffusionForcing | None = None,
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
    per number of steps (once for every number up to `compilation.max_steps` with it),
    scheduler, mesh and input shapes, and the guidance scales are traced (changing them
    does not recompile). `sample` itself works inside a caller's `eqx.filter_jit` too;
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
        `context`; required with guidance (`guidance.scale > 1`: diffusers' pipeline
        encodes an empty or negative prompt then: pass its embeddings).
    - `steps`: the number of denoising steps, an int >= 1 (static).
    - `scheduler`: a scheduler of `vidax_eqx.sampling` ([`UniPC`][], [`FlowMatchEuler`][],
        ...), or one of the names `"unipc"` / `"euler"` (shift 3.0) /
        `"cogvideox_ddim"` / `"cogvideox_dpm"` (defaults); `None`: `UniPC(shift=3.0)`,
        Wan 2.1's shipped configuration at 480p (720p uses shift 5.0).
    - `guidance`: classifier-free guidance, a [`Guidance`][] (default scale 5.0).
    - `placement`: one device or a mesh, a [`Placement`][].
    - `caching`: the text cache (on) and step caching (off), a [`Caching`][].
    - `compilation`: one program for several numbers of steps, a [`Compilation`][].
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
    - `key`: a PRNG key, required by a stochastic scheduler (`CogVideoXDPM`) and by
        diffusion forcing's `addnoise_condition`: step `i` draws with
        `jax.random.fold_in(key, i)`.
    - `progress`: this call's progress: a callable told each finished step, in order,
        as a [`SampleStep`][] of Python values (an [`AbstractProgress`][] such as
        [`ProgressBar`][] or [`ProgressLines`][] is also told when the call begins and
        ends); `True`: a [`ProgressBar`][] when stderr is a terminal and tqdm is
        installed; `None` / `False`: none. With a callback the steps run one compiled
        call at a time from the host (the same latents, bit for bit; the call returns
        when they are done), the per-call work before them (the text cache) once;
        inside a caller's trace only `True` (then ignored) or `None` are accepted.
    - `forcing`: diffusion forcing, a [`DiffusionForcing`][] (SkyReels-V2's
        `SkyReelsV2DiffusionForcingPipeline` loop, `output_type="latent"`): every latent
        frame at its own timestep, synchronous (`ar_step=0`) or staggered, each frame
        stepped by its own scheduler state; the model takes a timestep per latent frame
        ([`vidax_eqx.models.SkyReelsV2Transformer3D`][], its `fps` a model argument).
        The loop runs `DiffusionForcing.rows(frames, steps)`' iterations; given frames
        (`prefix_frames`, `suffix_frames`: an image's, a video's, the window before)
        are in `noise` in place of noise and come back unchanged; not with
        `condition`, step caching, `compilation.max_steps`, a stochastic scheduler or
        two experts. `None` (default): one timestep per step.
    - `**model_kwargs`: further model arguments: arrays are per example `(B, ...)` and
        repeated for the unconditional pass (e.g. `context_image`); anything else
        (`remat`, `attention`) is passed as it is.

    **Returns:**

    The final latents, the shape and dtype of `noise`.

    **Deprecated keywords** (until 0.3.0, each with a `DeprecationWarning`):
    `guidance_scale`, `guidance_scale_2`, `use_dynamic_cfg` ([`Guidance`][]); `mesh`,
    `batch_axis`, `cfg_axis` ([`Placement`][]); `text_cache`, `step_cache`
    ([`Caching`][]); `max_steps` ([`Compilation`][]); `return_reused=True` returned
    `(latents, reused)` (each step's `reused` now comes to the `progress` callback).
    """
    groups = options_from_old_keywords("sample", dict(
        guidance=guidance, placement=placement, caching=caching, compilation=compilation),
        model_kwargs)
    return_reused = old_return_reused("sample", model_kwargs)
    callback = default_progress(progress)
    if callback is not None and any(isinstance(a, jax.core.Tracer) for a in (noise, context)):
        if progress is not True:
            raise ValueError(
                "sample: a `progress` callback is told the steps as the call runs them, which "
                "a caller's trace (jit, vmap, grad) does not; pass progress=None inside a "
                "traced function.")
        callback = None
    inputs, options = prepare(
        "sample", model, noise, context, negative_context=negative_context, steps=steps,
        scheduler=scheduler, condition=condition, key=key, model_kwargs=model_kwargs,
        forcing=forcing, **groups)
    if return_reused and inputs.reuse is None:
        raise ValueError("sample: `return_reused` reports which steps reused the step "
                         "cache; it needs `caching=Caching(step=...)`, which is None.")
    if callback is None:
        result = denoising_loop(inputs, options)
    else:
        iterations = inputs.count  # the steps; diffusion forcing's iterations
        if isinstance(callback, AbstractProgress):
            callback.begin(iterations)
        try:
            result = stepwise_loop(inputs, options, iterations, callback)
        finally:
            if isinstance(callback, AbstractProgress):
                callback.end()
    return (result.latents, result.reused) if return_reused else result.latents


def prepare(owner, model, noise, context, *, negative_context, steps, scheduler, guidance,
            placement, caching, compilation, condition, key,
            model_kwargs, forcing=None) -> tuple[LoopInputs, LoopOptions]:
    """`sample`'s arguments checked and turned into `denoising_loop`'s:
    `(inputs, options)`."""
    for name, value, cls in (("guidance", guidance, Guidance), ("placement", placement, Placement),
                             ("caching", caching, Caching),
                             ("compilation", compilation, Compilation)):
        if not isinstance(value, cls):
            raise ValueError(f"{owner}: `{name}` must be a sampling.{cls.__name__}; received a "
                             f"{type(value).__name__}.")
    if not is_int(steps) or steps < 1:
        raise ValueError(f"{owner}: `steps` (the number of denoising steps) must be a Python "
                         f"int >= 1; received {steps!r}.")
    max_steps = compilation.max_steps
    if max_steps is not None and max_steps < steps:
        raise ValueError(
            f"{owner}: `compilation.max_steps` (the most steps the compiled loop serves) must "
            f"be None or a Python int >= steps ({steps}); received {max_steps!r}.")
    scheduler = scheduler_of(owner, scheduler)
    caps = capabilities_of(model)
    experts = caps is not None and caps.experts
    if guidance.scale_2 is not None and not experts:
        raise ValueError(
            f"{owner}: `guidance.scale_2` is the low-noise expert's guidance scale of a "
            f"two-expert model (models.WanExperts); received {guidance.scale_2!r} for a "
            f"{type(model).__name__}. Drop it.")
    guided = guidance.guided
    if guided and negative_context is None:
        raise ValueError(
            f"{owner}: `negative_context` is required with classifier-free guidance "
            f"(guidance.scale > 1; received {guidance.scale!r}): pass the embeddings of "
            "the negative (or empty) prompt, or Guidance(scale=1.0) for none.")
    check_inputs(model, noise, context, negative_context)
    conditioning = conditioning_of(model, noise, condition)
    check_placement(placement, guided, noise.shape[0])
    if scheduler.stochastic and key is None:
        raise ValueError(f"{owner}: `key` (a PRNG key) is required by the stochastic "
                         f"scheduler {type(scheduler).__name__}; received None.")
    reuse = check_step_cache(model, caching.step, steps)
    batched = {k: v for k, v in model_kwargs.items() if eqx.is_array(v)}
    static = {k: v for k, v in model_kwargs.items() if not eqx.is_array(v)}
    for name, value in batched.items():
        if value.ndim == 0 or value.shape[0] != noise.shape[0]:
            raise ValueError(
                f"{owner}: the model argument `{name}` must be per example, (B, ...) with "
                f"B = {noise.shape[0]}; received shape {value.shape}.")
    scale = guidance.scale
    scale_2 = scale if guidance.scale_2 is None else guidance.scale_2
    # Host values go in with device_put (jnp.asarray compiles a small program per shape).
    scales = jax.device_put(np.asarray([scale, scale_2], np.float32))
    plan = scheduler.plan(steps)
    if reuse is not None:  # the mask on the host; a switch of experts runs every block
        switches = expert_switches(model, plan)
        reuse = jax.device_put(reuse if switches is None else reuse & ~switches)
    dynamic = None
    if guidance.dynamic:  # on the host in float64, as diffusers computes it (math.cos)
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
    rows = noised_prefix = None
    if forcing is not None:
        rows = _forcing_rows(owner, forcing, model, noise, steps, scheduler, plan, caching,
                             compilation, condition, experts, static)
        count = rows[0].shape[0]
        if forcing.addnoise_condition > 0 and forcing.prefix_frames > 0:
            if key is None:
                raise ValueError(
                    f"{owner}: `forcing.addnoise_condition` ({forcing.addnoise_condition}) "
                    "shows the prefix frames with fresh noise at every iteration; pass `key` "
                    "(a PRNG key) to draw it.")
            noised_prefix = (forcing.prefix_frames, float(forcing.addnoise_condition))
    inputs = LoopInputs(
        model=model, noise=noise, context=context,
        negative_context=negative_context if guided else None, guidance_scales=scales,
        dynamic_cfg=dynamic, plan=plan, key=key, batched=batched, reuse=reuse, count=count,
        condition=condition, forcing=rows)
    options = LoopOptions(
        scheduler=scheduler, mesh=placement.mesh, batch_axis=placement.batch_axis,
        cfg_axis=placement.cfg_axis, conditioning=conditioning,
        text_cache=caching.text and caps is not None and caps.text_cache,
        noised_prefix=noised_prefix, model_static=static,
        threshold=_threshold(caching.step))
    return inputs, options


def _forcing_rows(owner, forcing, model, noise, steps, scheduler, plan, caching, compilation,
                  condition, experts, model_static):
    """Diffusion forcing's iterations, checked against what the loop can run with them."""
    if not isinstance(forcing, DiffusionForcing):
        raise ValueError(f"{owner}: `forcing` must be a sampling.DiffusionForcing or None; "
                         f"received a {type(forcing).__name__}.")
    refused = [name for name, on in (
        ("`condition`", condition is not None), ("step caching", caching.step is not None),
        ("`compilation.max_steps`", compilation.max_steps is not None),
        (f"the stochastic scheduler {type(scheduler).__name__}", scheduler.stochastic),
        ("two experts", experts)) if on]
    if refused:
        raise ValueError(f"{owner}: diffusion forcing (`forcing`) runs without "
                         f"{', '.join(refused)}; received them.")
    if noise.ndim != 5:
        raise ValueError(f"{owner}: diffusion forcing takes latents (B, C, F, H, W); received "
                         f"shape {noise.shape}.")
    caps = capabilities_of(model)
    if caps is not None and caps.timestep != "frame":
        raise ValueError(
            f"{owner}: diffusion forcing needs a model that takes a timestep per latent frame "
            f"(capabilities.timestep 'frame', models.SkyReelsV2Transformer3D); received a "
            f"{type(model).__name__}, whose capabilities.timestep is {caps.timestep!r}.")
    if caps is not None and model.patch_size[0] != 1:
        raise ValueError(f"{owner}: diffusion forcing steps each latent frame; the model's "
                         f"temporal patch is {model.patch_size[0]}, not 1.")
    # A model with a timestep per frame attends in blocks of frames (its config's).
    block = None if caps is None else model.config.num_frame_per_block
    attention = model_static.get("attention")
    if isinstance(attention, models.BlockCausal):  # the call sets the model's blocks
        block = attention.frames_per_block
    if block is not None and forcing.causal_block_size != block:
        raise ValueError(
            f"{owner}: `forcing.causal_block_size` ({forcing.causal_block_size}) must be the "
            f"model's num_frame_per_block ({block}), the frames of its causal attention "
            "blocks (pass attention=models.BlockCausal(causal_block_size) to set them).")
    progress, update = forcing.rows(noise.shape[2], steps)
    alias = np.zeros_like(update)
    if forcing.reference_aliasing and isinstance(scheduler, UniPC):
        # The steps whose corrector does not run (a frame's first; after a disabled one).
        uncorrected = np.asarray(plan.coefficients)[:, 0] == 0
        alias = update & uncorrected[np.clip(progress - 1, 0, steps - 1)]
    return tuple(jax.device_put(a) for a in (progress, update, alias))


def _threshold(step_cache):
    """The data-dependent rule's threshold as a traced scalar (changing it does not
    recompile), or `None` (a static schedule, or no step caching)."""
    threshold = getattr(step_cache, "threshold", None)
    return None if threshold is None else jax.device_put(np.float32(threshold))



def calibrate_magcache(model, noise, context, *, negative_context=None, steps: int = 50,
                       scheduler=None, guidance: Guidance = Guidance(),
                       placement: Placement = Placement(), condition=None, key=None,
                       **kwargs) -> MagCache:
    """A [`MagCache`][] for `model` at `steps` steps, measured on one generation: `sample`'s
    loop with every block run at every step, each step's residual of the block stack
    (over the batch, guidance's two halves included) divided by the previous step's.
    MagCache's observation is that these ratios barely depend on the prompt and the
    noise: calibrate once (a few prompts' ratios may be averaged: `MagCache(ratios=...)`)
    and reuse the rule for every generation of that model and step count.

    **Arguments:** `sample`'s (the text cache on; no step caching or diffusion forcing);
    `kwargs`: `MagCache`'s `max_error`, `max_skip`, `retention`, `cooldown`, and the
    model's keyword arguments.

    **Returns:** `MagCache(ratios=...)`, the first ratio 1.
    """
    fields = {f.name for f in dataclasses.fields(MagCache)} - {"ratios"}
    rule = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
    inputs, options = prepare(
        "calibrate_magcache", model, noise, context, negative_context=negative_context,
        steps=steps, scheduler=scheduler, guidance=guidance, placement=placement,
        caching=Caching(step=StaticStepCache(interval=1)), compilation=Compilation(),
        condition=condition, key=key, model_kwargs=kwargs)
    norms = np.asarray(denoising_loop(inputs, options).residual_norms, np.float64)
    if not np.all(np.isfinite(norms)) or np.any(norms <= 0):
        raise ValueError(f"calibrate_magcache: the block stack's residual norms must be finite "
                         f"and positive to take their ratios; received {norms.tolist()}.")
    ratios = np.concatenate([[1.0], norms[1:] / norms[:-1]])
    return MagCache(ratios=tuple(float(r) for r in ratios), **rule)
