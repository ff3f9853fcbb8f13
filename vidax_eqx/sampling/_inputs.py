"""`sample`'s inputs checked: the scheduler, the shapes of the latents, text and
condition against the model, the mesh axes, the step-cache rule."""

import numpy as np

from .. import models
from ..models.internal import require_capability
from ._cogvideox import CogVideoXDDIM, CogVideoXDPM
from ._flow_match import FlowMatchEuler, UniPC
from ._schedulers import AbstractScheduler


SCHEDULERS = {
    "unipc": lambda: UniPC(shift=3.0),
    "euler": lambda: FlowMatchEuler(shift=3.0),
    "cogvideox_ddim": CogVideoXDDIM,
    "cogvideox_dpm": CogVideoXDPM,
}
"""The scheduler names `sample` accepts, and what each name builds."""


def scheduler_of(owner: str, scheduler) -> AbstractScheduler:
    """`sample`'s `scheduler`: an object, a name of `SCHEDULERS`, or `None` (UniPC)."""
    if scheduler is None:
        return UniPC(shift=3.0)
    if isinstance(scheduler, str):
        if scheduler not in SCHEDULERS:
            raise ValueError(
                f"{owner}: `scheduler` must be a scheduler object or one of the names "
                f"{sorted(SCHEDULERS)}; received {scheduler!r}.")
        return SCHEDULERS[scheduler]()
    if not isinstance(scheduler, AbstractScheduler):
        raise ValueError(
            f"{owner}: `scheduler` must be a vidax_eqx.sampling scheduler (e.g. UniPC(shift=3.0)), "
            f"one of the names {sorted(SCHEDULERS)}, or None (UniPC(shift=3.0)); received "
            f"{type(scheduler).__name__}.")
    return scheduler


def _shape(x):
    return tuple(getattr(x, "shape", ()))


def capabilities_of(model):
    """The [`Capabilities`][vidax_eqx.models.Capabilities] of a model of
    `vidax_eqx.models`, `None` for any other callable (a function of the caller's, whose
    inputs are not checked against a record)."""
    return model.capabilities if isinstance(model, models.AbstractModel) else None


def _layout(model):
    """`(channel axis, (pt, ph, pw), text width, layout)` of the batched latents of a
    model of `vidax_eqx.models`, `None` for any other callable."""
    caps = capabilities_of(model)
    if caps is None:
        return None
    return (1 + caps.channel_axis, model.patch_size, model.text_dim,
            "(B, " + ", ".join(caps.latents) + ")")


def check_inputs(model, noise, context, negative_context) -> None:
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
    if layout is not None:
        if C != model.out_channels:
            raise ValueError(
                f"sample: `noise` must have the model's {model.out_channels} latent channels "
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


def conditioning_of(model, noise, condition):
    """How `condition` enters the model: `None` (no condition), `("concat", axis)`
    (concatenated to the latents along the channel axis before every call: Wan I2V /
    FLF2V, CogVideoX I2V, any model whose `in_channels` exceed its `out_channels`), or
    `("frames", n)` (the first `n` latent frames replaced by the condition's, their
    tokens at timestep 0: Wan 2.2 TI2V); raises on a condition that does not fit."""
    layout = _layout(model)
    axis, patch, _, names = layout or (1, None, None, "(B, C, F, H, W)")
    extra = 0 if layout is None else model.in_channels - model.out_channels
    if condition is None:
        if extra:
            raise ValueError(
                f"sample: `condition` is required by an image-conditioned model (in_channels "
                f"{model.in_channels} = the latents' {model.out_channels} + {extra} condition "
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
    if "frames" not in capabilities_of(model).image:
        raise ValueError(
            f"sample: `condition` for a model whose in_channels equal its out_channels "
            f"replaces the first latent frames (Wan 2.2 TI2V), which a {type(model).__name__} "
            "does not take (its capabilities.image has no 'frames'); received a condition.")
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


def check_placement(placement, guided: bool, batch: int) -> None:
    """The mesh axes of a `Placement` against the mesh, the batch and guidance."""
    mesh, batch_axis, cfg_axis = placement.mesh, placement.batch_axis, placement.cfg_axis
    if mesh is None:
        if batch_axis is not None or cfg_axis is not None:
            raise ValueError(
                "sample: `placement.batch_axis` and `placement.cfg_axis` name axes of "
                f"`placement.mesh`, which is None; received batch_axis={batch_axis!r}, "
                f"cfg_axis={cfg_axis!r}. Pass the mesh.")
        return
    axes = dict(mesh.shape)
    if batch_axis is not None:
        if batch_axis not in axes:
            raise ValueError(f"sample: `placement.batch_axis` must be an axis of the mesh "
                             f"{axes}; received {batch_axis!r}.")
        if batch % axes[batch_axis]:
            raise ValueError(
                f"sample: the batch of `noise` ({batch}) must be a multiple of the size of "
                f"`placement.batch_axis` {batch_axis!r} ({axes[batch_axis]}).")
    if cfg_axis is not None:
        if cfg_axis not in axes or axes[cfg_axis] != 2:
            raise ValueError(
                f"sample: `placement.cfg_axis` must be an axis of size 2 of the mesh {axes} "
                f"(one half runs the conditional pass, the other the unconditional); "
                f"received {cfg_axis!r}.")
        if not guided:
            raise ValueError(
                "sample: `placement.cfg_axis` splits the conditional and unconditional passes "
                "of classifier-free guidance, which runs only when the guidance scale is > 1; "
                "received cfg_axis with no guidance. Drop cfg_axis or raise the scale.")
        if batch_axis == cfg_axis:
            raise ValueError(
                f"sample: `placement.cfg_axis` and `placement.batch_axis` must be two "
                f"different mesh axes; received {cfg_axis!r} for both.")


def check_step_cache(model, step_cache, steps: int):
    """The `(steps,)` bool array of the steps that may reuse, or `None` without step
    caching; raises on a model that cannot."""
    if step_cache is None:
        return None
    if capabilities_of(model) is None:
        raise NotImplementedError(
            f"sample: step caching runs through a model's cached_call (a model of "
            f"vidax_eqx.models whose capabilities.step_cache is True); received a "
            f"{type(model).__name__}.")
    require_capability("sample", model, "step_cache")
    return step_cache.mask(steps)


def expert_switches(model, plan) -> np.ndarray | None:
    """`(steps,)` bool: the steps whose expert differs from the previous step's (a
    cached residual is the other expert's there), or `None` for a one-expert model."""
    caps = capabilities_of(model)
    if caps is None or not caps.experts:
        return None
    high = np.asarray(plan.timesteps) >= model.boundary_timestep
    return np.concatenate([[False], high[1:] != high[:-1]])
