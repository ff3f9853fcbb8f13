"""`sample`'s options, grouped by what they decide, as Diffrax groups `diffeqsolve`'s
(`saveat=SaveAt(...)`, `stepsize_controller=...`): guidance, placement, caching and
compilation. Each is a small immutable object that checks its own fields."""

import math

import equinox as eqx
import jax

from .._checks import is_int, is_real
from ._step_cache import FirstBlockCache, MagCache, StaticStepCache


def _check_scale(owner: str, name: str, value, required: bool = True) -> None:
    if value is None and not required:
        return
    if not is_real(value) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{owner}: `{name}` (the classifier-free guidance scale) must be a finite Python "
            f"number >= 0 (1.0 or less: no guidance; Wan uses 5.0); received {value!r}.")


class Guidance(eqx.Module):
    """Classifier-free guidance: each step's prediction is
    `uncond + scale * (cond - uncond)`, the conditional and unconditional passes batched
    into one model call of batch `2B` (or split over a mesh axis: [`Placement`][]).

    **Fields:**

    - `scale`: the guidance scale (>= 0); guidance runs when it is > 1, as in diffusers
        (`do_classifier_free_guidance`); then `sample` needs `negative_context`.
        The scale is traced: changing it does not recompile.
    - `scale_2`: Wan 2.2 A14B: the scale of the steps whose timestep is below the
        model's `boundary_timestep` (the low-noise expert's; diffusers'
        `guidance_scale_2`); `None`: `scale`. Refused for a model without experts.
    - `dynamic`: CogVideoX's dynamic guidance (diffusers'
        `CogVideoXPipeline(use_dynamic_cfg=True)`): the scale of the step at timestep
        `t` is `1 + scale * (1 - cos(pi * ((steps - t) / steps) ** 5)) / 2`, computed
        as diffusers does (float64 on the host; `t` the timestep, as there).
    """

    scale: float = eqx.field(static=True, default=5.0)
    scale_2: float | None = eqx.field(static=True, default=None)
    dynamic: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        _check_scale("Guidance", "scale", self.scale)
        _check_scale("Guidance", "scale_2", self.scale_2, required=False)
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"Guidance: `dynamic` (CogVideoX's dynamic guidance) must be True "
                             f"or False; received {self.dynamic!r}.")

    @property
    def guided(self) -> bool:
        """Whether guidance runs (`scale > 1`)."""
        return self.scale > 1


class Placement(eqx.Module):
    """Where the loop runs: one device, or a mesh.

    **Fields:**

    - `mesh`: a `jax.sharding.Mesh`: each step's model call runs through
        [`vidax_eqx.models.run_sharded`][] (the model's own sequence, TP and FSDP
        parallelism as its `ParallelConfig` says); `None`: one device.
    - `batch_axis`: the mesh axis the batch (the guided batch of `2B`) is
        split over.
    - `cfg_axis`: CFG parallelism: a mesh axis of size 2 whose first half runs the
        conditional pass and the second the unconditional one. With `batch_axis` as
        well, each half's `B` examples are split over `batch_axis` (the guided batch
        over `(cfg_axis, batch_axis)`). Needs guidance (`Guidance.scale > 1`).
    """

    mesh: jax.sharding.Mesh | None = eqx.field(static=True, default=None)
    batch_axis: str | None = eqx.field(static=True, default=None)
    cfg_axis: str | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        if self.mesh is not None and not isinstance(self.mesh, jax.sharding.Mesh):
            raise ValueError(f"Placement: `mesh` must be a jax.sharding.Mesh or None; received "
                             f"a {type(self.mesh).__name__}.")


class Caching(eqx.Module):
    """What the loop computes once and reuses.

    **Fields:**

    - `text`: for a [`vidax_eqx.models.WanTransformer3D`][] (or each expert of a
        [`vidax_eqx.models.WanExperts`][]), compute the blocks' cross-attention keys and
        values of `context` and `negative_context` (and `context_image`) once, before
        the loop ([`vidax_eqx.models.WanTransformer3D.text_cache`][]; with a mesh,
        [`vidax_eqx.models.sharded_text_cache`][]), instead of in every step: the same
        latents, bit for bit. `False`: every step projects the text. Ignored for
        CogVideoX, whose text goes through joint self-attention with the video and
        changes in every block (its keys and values cannot be cached exactly).
    - `step`: step caching, off by default: a [`StaticStepCache`][] (a fixed set of
        steps reuse the residual of the whole block stack from the last step that ran
        it), a [`MagCache`][] (such a schedule from the residual's calibrated
        magnitude ratios) or a [`FirstBlockCache`][] (every step runs the first block,
        and skips the others when their input changed by less than a threshold). An approximation,
        traded for speed: the steps that run every block are exact. One decision per
        step for the whole batch (guidance's two halves included), reduced over every
        device when sharded; a progress callback sees each step's decision
        ([`SampleStep.reused`][vidax_eqx.sampling.SampleStep]). For a
        [`vidax_eqx.models.WanTransformer3D`][] (any sequence mode, TP, FSDP; with the
        text cache) and [`vidax_eqx.models.WanExperts`][] (the first step after the
        switch of experts runs every block); not for CogVideoX yet.
    """

    text: bool = eqx.field(static=True, default=True)
    step: StaticStepCache | FirstBlockCache | MagCache | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        if not isinstance(self.text, bool):
            raise ValueError(f"Caching: `text` (the text cache) must be True or False; received "
                             f"{self.text!r}.")
        if self.step is not None and not isinstance(self.step, (StaticStepCache, FirstBlockCache,
                                                                MagCache)):
            raise ValueError(
                "Caching: `step` must be None, a sampling.StaticStepCache, a "
                f"sampling.FirstBlockCache or a sampling.MagCache; received "
                f"{type(self.step).__name__}.")


class Compilation(eqx.Module):
    """How the loop is compiled.

    **Fields:**

    - `max_steps`: `None` (default): the loop's trip count is `steps`, static (the loop
        lowers to a scan, which can be differentiated; one compilation per number of
        steps). An int >= `steps`: the plan is padded to `max_steps` rows and the trip
        count is traced, so that one compiled program serves every number of steps up
        to `max_steps` (a while loop; the same latents).
    """

    max_steps: int | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        if self.max_steps is not None and (not is_int(self.max_steps) or self.max_steps < 1):
            raise ValueError(
                f"Compilation: `max_steps` (the most steps the compiled loop serves) must be "
                f"None or a Python int >= 1; received {self.max_steps!r}.")
