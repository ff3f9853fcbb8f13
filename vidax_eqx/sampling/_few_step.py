"""The few-step sampler of distilled causal video models (CausVid, Self-Forcing)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PRNGKeyArray

from .._checks import is_real
from .._shapes import checked
from ._flow_match import _shifted
from ._schedulers import (
    AbstractScheduler, Latents, SchedulerPlan, SchedulerState, StepIndex, check_int, check_positive,
    check_steps, make_plan, step_inputs,
)


class FewStep(AbstractScheduler):
    """The few-step sampler of distilled causal video models, as CausVid and Self-Forcing
    sample each chunk (their DMD generators): at each listed timestep the model's
    velocity gives the clean prediction `x0 = x - sigma * v`, and the next step starts
    from it noised afresh to the next sigma, `(1 - sigma') x0 + sigma' eps` with new
    noise `eps`; the last step returns `x0`.

    The timesteps are warped by the flow shift as those models' `warp_denoising_step`
    does: timestep `t` (of `num_train_timesteps`) has sigma `shift * s / (1 + (shift - 1)
    s)`, `s = t / num_train_timesteps`, and the model takes `num_train_timesteps * sigma`
    (Self-Forcing's default list `(1000, 750, 500, 250)` with shift 5 gives 1000, 937.5,
    833.3, 625). Stochastic: each step but the last draws its noise from the step's key.
    In streaming generation the finished chunk then runs once more at timestep 0 to fill
    the key/value cache (the pipelines' `stream` does).

    **Arguments:**

    - `timesteps`: the steps' timesteps before the shift, strictly decreasing in
        `(0, num_train_timesteps]` (default `(1000, 750, 500, 250)`); `plan(steps)`
        takes `steps = len(timesteps)`.
    - `shift`: the flow shift (> 0; default 5.0, Self-Forcing's and CausVid's).
    - `num_train_timesteps`: default 1000.
    """

    timesteps: tuple[float, ...] = eqx.field(static=True, default=(1000.0, 750.0, 500.0, 250.0))
    shift: float = eqx.field(static=True, default=5.0)
    num_train_timesteps: int = eqx.field(static=True, default=1000)

    stochastic = True
    history_size = 0

    def __check_init__(self):
        owner = "FewStep"
        check_positive(owner, "shift", self.shift, " (Self-Forcing and CausVid: 5.0)")
        check_int(owner, "num_train_timesteps", self.num_train_timesteps, 1)
        t = self.timesteps
        ok = isinstance(t, tuple) and len(t) >= 1 and all(is_real(x) and not isinstance(x, bool) for x in t)
        if ok:
            values = np.asarray(t, np.float64)
            ok = bool(np.all(values > 0) and np.all(values <= self.num_train_timesteps)
                      and np.all(np.diff(values) < 0))
        if not ok:
            raise ValueError(
                f"{owner}: `timesteps` must be a non-empty tuple of numbers, strictly decreasing, in "
                f"(0, num_train_timesteps={self.num_train_timesteps}]; received {t!r}."
            )

    def plan(self, steps: int) -> SchedulerPlan:
        """The warped timesteps and their sigmas, then a final sigma 0; the coefficients
        of step `i` are `(sigma_i, sigma_{i+1})`. `steps` must be `len(timesteps)`."""
        steps = check_steps("FewStep", steps)
        if steps != len(self.timesteps):
            raise ValueError(
                f"FewStep.plan: `steps` must be the number of its timesteps, {len(self.timesteps)} "
                f"({self.timesteps}); received {steps}."
            )
        n = self.num_train_timesteps
        sigmas = _shifted(self.shift, np.asarray(self.timesteps, np.float64) / n)
        sigmas = np.concatenate([sigmas, [0.0]])
        return make_plan(n * sigmas[:-1], sigmas, np.stack([sigmas[:-1], sigmas[1:]], axis=1))

    @checked
    def step(self, plan: SchedulerPlan, state: SchedulerState, i: StepIndex,
             model_output: Latents, latents: Latents, *,
             key: PRNGKeyArray | None = None) -> tuple[Latents, SchedulerState]:
        """`x0 = latents - sigma_i * model_output`, then `(1 - sigma_{i+1}) x0 +
        sigma_{i+1} eps` with `eps` standard normal from `key` (`x0` at the last step)."""
        if key is None:
            raise ValueError("FewStep.step: a stochastic scheduler needs a `key` per step (the "
                             "noise of the next step's latents).")
        with jax.named_scope("FewStep.step"):
            (sigma, sigma_next), x, v = step_inputs(self, plan, state, i, model_output, latents)
            x0 = x - sigma * v
            eps = jax.random.normal(key, x.shape, x.dtype)
            out = jnp.where(sigma_next > 0, (1 - sigma_next) * x0 + sigma_next * eps, x0)
            return out.astype(latents.dtype), state
