"""Sampling, the top floor: diffusion schedulers as pure functions of a small state,
above [`vidax_eqx.models`][].

- [`sample`][]: a whole generation (diffusers' `WanPipeline` with
    `output_type="latent"`): the denoising loop with classifier-free guidance, batched
    or over a mesh axis, as one compiled `lax.fori_loop`. Its options come in four
    objects: [`Guidance`][], [`Placement`][], [`Caching`][], [`Compilation`][]; its
    progress goes to a callback of the call, told each [`SampleStep`][]
    ([`ProgressBar`][], [`ProgressLines`][], or any [`AbstractProgress`][] or callable).
- [`sample_stream`][]: streaming generation's loop, chunk by chunk against a key/value
    cache (the same guidance and scheduler steps), each chunk's latents yielded when done.
- [`DiffusionForcing`][]: `sample(forcing=...)`, SkyReels-V2's diffusion forcing loop:
    every latent frame at its own timestep, synchronous or in a staggered wave.
- [`FlowMatchEuler`][], [`UniPC`][]: Wan's flow-matching schedulers (diffusers'
    `FlowMatchEulerDiscreteScheduler` and `UniPCMultistepScheduler` in its
    flow-prediction form, the default of diffusers' Wan pipelines).
- [`FewStep`][]: the few-step sampler of distilled causal video models (CausVid,
    Self-Forcing): a clean prediction at each listed timestep, noised afresh to the next.
- [`CogVideoXDDIM`][], [`CogVideoXDPM`][]: CogVideoX's (diffusers'
    `CogVideoXDDIMScheduler`, CogVideoX-2B's default, and `CogVideoXDPMScheduler`,
    which CogVideoX runs its 5B models with).
- [`scheduler_from_config`][]: the scheduler, with its settings, that a diffusers
    pipeline's `scheduler/scheduler_config.json` describes (`flow_shift`, solver
    options, ...); each scheduler's `from_config` reads its own class's.
- [`export_sample`][], [`ExportedSampler`][]: `sample`'s compiled loop exported
    (`jax.export`) and serialized, for a server that reloads it instead of tracing.
- [`StaticStepCache`][], [`MagCache`][], [`FirstBlockCache`][]: step caching
    (`Caching(step=...)`), the opt-in reuse of the block stack's residual on steps that
    change little (a static schedule; one from the residual's calibrated magnitude
    ratios, [`calibrate_magcache`][]; a data-dependent rule decided once for every
    device).
- [`AbstractScheduler`][]: their contract, `plan` / `init` / `step` / `timestep`;
    [`SchedulerPlan`][] and [`SchedulerState`][] are the arrays a denoising loop
    carries, so that the whole loop is one `lax.fori_loop`.
"""

from ._cogvideox import CogVideoXDDIM as CogVideoXDDIM, CogVideoXDPM as CogVideoXDPM
from ._config import scheduler_from_config as scheduler_from_config
from ._few_step import FewStep as FewStep
from ._flow_match import FlowMatchEuler as FlowMatchEuler, UniPC as UniPC
from ._schedulers import (
    AbstractScheduler as AbstractScheduler,
    SchedulerPlan as SchedulerPlan,
    SchedulerState as SchedulerState,
)
from ._forcing import DiffusionForcing as DiffusionForcing
from ._export import ExportedSampler as ExportedSampler, export_sample as export_sample
from ._options import (
    Caching as Caching,
    Compilation as Compilation,
    Guidance as Guidance,
    Placement as Placement,
)
from ._progress import (
    AbstractProgress as AbstractProgress,
    ProgressBar as ProgressBar,
    ProgressLines as ProgressLines,
    SampleStep as SampleStep,
)
from ._sample import calibrate_magcache as calibrate_magcache, sample as sample
from ._stream import sample_stream as sample_stream
from ._step_cache import (
    FirstBlockCache as FirstBlockCache, MagCache as MagCache, StaticStepCache as StaticStepCache,
)
