"""What `sample`'s compiled denoising loop takes, by name: its inputs (the model and
the arrays) and the options it is compiled for, as `prepare` makes them from
`sample`'s (or `export_sample`'s) arguments."""

from typing import Any, NamedTuple

import equinox as eqx
import jax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._schedulers import AbstractScheduler, SchedulerPlan


class LoopInputs(NamedTuple):
    """The loop's inputs: the model and the arrays (traced by `eqx.filter_jit`; the
    leaves `export_sample` exports the loop over)."""

    model: Any
    noise: Float[Array, "B ..."]
    context: Float[Array, "B L text_dim"]
    negative_context: Float[Array, "B L text_dim"] | None
    """`None` without classifier-free guidance."""
    guidance_scales: Float[Array, "2"]
    """`guidance_scale`, then the low-noise expert's `guidance_scale_2`."""
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


class LoopOptions(eqx.Module):
    """What the loop is compiled for (static fields: a change recompiles), and the
    step-cache threshold, traced so that changing it does not recompile."""

    scheduler: AbstractScheduler = eqx.field(static=True)
    mesh: jax.sharding.Mesh | None = eqx.field(static=True)
    batch_axis: str | tuple[str, ...] | None = eqx.field(static=True)
    cfg_axis: str | None = eqx.field(static=True)
    conditioning: tuple | None = eqx.field(static=True)
    """How `condition` enters the model: `None`, `("concat", axis)` or `("frames", n)`."""
    progress: bool = eqx.field(static=True)
    text_cache: bool = eqx.field(static=True)
    return_reused: bool = eqx.field(static=True)
    model_static: dict
    """The model's non-array keyword arguments (`remat`, `sliding_tile`), passed as
    they are (`eqx.filter_jit` keeps their non-array leaves static)."""
    threshold: Float[Array, ""] | None
    """The threshold of a `FirstBlockCache`, `None` for any other rule or none."""
