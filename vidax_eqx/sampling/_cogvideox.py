"""CogVideoX's schedulers: diffusers' `CogVideoXDDIMScheduler` (CogVideoX-2B's) and
`CogVideoXDPMScheduler` (the one CogVideoX's own demos run the 5B models with)."""

import os

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PRNGKeyArray

from .._shapes import checked
from ._diffusers_keys import build_from_config
from ._schedulers import (
    AbstractScheduler, Latents, SchedulerPlan, SchedulerState, StepIndex, check_bool,
    check_choice, check_finite, check_int, check_positive, check_steps, make_plan, step_inputs,
)


_PREDICTIONS = {"v_prediction", "epsilon", "sample"}
_SPACINGS = {"trailing", "leading", "linspace"}


def _check_schedule(s) -> None:
    owner = type(s).__name__
    check_choice(owner, "prediction_type", s.prediction_type, _PREDICTIONS)
    check_int(owner, "num_train_timesteps", s.num_train_timesteps, 2)
    check_positive(owner, "beta_start", s.beta_start)
    check_positive(owner, "beta_end", s.beta_end)
    check_positive(owner, "snr_shift_scale", s.snr_shift_scale,
                   " (3.0 for CogVideoX-2B, 1.0 for the 5B models)")
    check_bool(owner, "rescale_betas_zero_snr", s.rescale_betas_zero_snr)
    check_bool(owner, "set_alpha_to_one", s.set_alpha_to_one)
    check_choice(owner, "timestep_spacing", s.timestep_spacing, _SPACINGS)
    check_int(owner, "steps_offset", s.steps_offset, 0)


def _alphas_cumprod(s):
    """diffusers' `alphas_cumprod` (float64: scaled-linear betas, the SNR shift, the
    zero-terminal-SNR rescale) and `final_alpha_cumprod`."""
    n = s.num_train_timesteps
    betas = np.linspace(s.beta_start ** 0.5, s.beta_end ** 0.5, n, dtype=np.float64) ** 2
    cumprod = np.cumprod(1.0 - betas)
    shift = s.snr_shift_scale
    cumprod = cumprod / (shift + (1 - shift) * cumprod)
    if s.rescale_betas_zero_snr:
        root = np.sqrt(cumprod)
        first, last = root[0], root[-1]
        root = (root - last) * (first / (first - last))
        cumprod = root ** 2
    final = 1.0 if s.set_alpha_to_one else cumprod[0]
    return cumprod, final


def _tables(s, steps):
    """`(timesteps, alphas_cumprod at them, at each step's target, targets, sigmas)`
    after diffusers' `set_timesteps(steps)`. The target of a step is
    `t - num_train_timesteps // steps`, diffusers' rule (the next timestep when `steps`
    divides `num_train_timesteps`)."""
    n = s.num_train_timesteps
    steps = check_steps(type(s).__name__, steps, maximum=n)
    if s.timestep_spacing == "linspace":
        t = np.linspace(0, n - 1, steps).round()[::-1].astype(np.int64)
    elif s.timestep_spacing == "leading":
        t = (np.arange(0, steps) * (n // steps)).round()[::-1].astype(np.int64) + s.steps_offset
    else:
        t = np.round(np.arange(n, 0, -n / steps)).astype(np.int64) - 1
    cumprod, final = _alphas_cumprod(s)
    target = t - n // steps
    now = cumprod[t]
    after = np.where(target >= 0, cumprod[np.maximum(target, 0)], final)
    sigmas = np.sqrt(1 - np.concatenate([now, after[-1:]]))
    return t, now, after, target, sigmas


def _x0_coefficients(prediction_type: str, now):
    """`(p0, p1)` with `x0 = p0 * x + p1 * model_output`."""
    with np.errstate(divide="ignore"):
        if prediction_type == "v_prediction":
            return np.sqrt(now), -np.sqrt(1 - now)
        if prediction_type == "epsilon":
            return 1 / np.sqrt(now), -np.sqrt(1 - now) / np.sqrt(now)
        return np.zeros_like(now), np.ones_like(now)


def _describe(s) -> str:
    return (f"prediction_type={s.prediction_type!r}, rescale_betas_zero_snr="
            f"{s.rescale_betas_zero_snr}, timestep_spacing={s.timestep_spacing!r}")


class CogVideoXDDIM(AbstractScheduler):
    """CogVideoX's DDIM scheduler, the default of CogVideoX-2B: diffusers'
    `CogVideoXDDIMScheduler`. Deterministic: like diffusers', its step has no `eta`
    (diffusers accepts and ignores one) and does not clip.

    Step `i`, from timestep `t` to `t' = t - num_train_timesteps // steps` (diffusers'
    rule; the next timestep when `steps` divides `num_train_timesteps`), with
    `a = alphas_cumprod`:

        x0 = sqrt(a_t) x - sqrt(1 - a_t) v                    (v-prediction)
        x' = sqrt((1 - a_t') / (1 - a_t)) x
             + (sqrt(a_t') - sqrt(a_t) sqrt((1 - a_t') / (1 - a_t))) x0

    **Arguments** (the defaults are CogVideoX-2B's `scheduler_config.json`; the 5B
    models ship the same with `snr_shift_scale=1.0`):

    - `snr_shift_scale`: the SNR shift of the schedule (> 0): 3.0 for CogVideoX-2B,
        1.0 for CogVideoX-5B.
    - `prediction_type`: `"v_prediction"` (default, CogVideoX's), `"epsilon"` or
        `"sample"`. `"epsilon"` at a timestep whose `alphas_cumprod` is 0 (the first
        step with `rescale_betas_zero_snr` and trailing spacing) divides by zero:
        `plan` raises.
    - `timestep_spacing`: `"trailing"` (default), `"leading"` or `"linspace"`.
    - `rescale_betas_zero_snr`: rescale to zero terminal SNR (default True).
    - `set_alpha_to_one`: the last step goes to `alphas_cumprod = 1` (default True).
    - `beta_start`, `beta_end`: the range of the `"scaled_linear"` betas (defaults
        0.00085 and 0.012).
    - `num_train_timesteps`: default 1000.
    - `steps_offset`: added to the `"leading"` timesteps (default 0).
    """

    snr_shift_scale: float = eqx.field(static=True, default=3.0)
    prediction_type: str = eqx.field(static=True, default="v_prediction")
    timestep_spacing: str = eqx.field(static=True, default="trailing")
    rescale_betas_zero_snr: bool = eqx.field(static=True, default=True)
    set_alpha_to_one: bool = eqx.field(static=True, default=True)
    beta_start: float = eqx.field(static=True, default=0.00085)
    beta_end: float = eqx.field(static=True, default=0.012)
    num_train_timesteps: int = eqx.field(static=True, default=1000)
    steps_offset: int = eqx.field(static=True, default=0)

    stochastic = False
    history_size = 0

    def __check_init__(self):
        _check_schedule(self)

    @classmethod
    def from_config(cls, config: dict | str | os.PathLike) -> "CogVideoXDDIM":
        """From a diffusers `CogVideoXDDIMScheduler` config, as
        [`scheduler_from_config`][] reads it: every field above, under its own name,
        diffusers' defaults where a key is absent (`prediction_type="epsilon"`,
        `timestep_spacing="leading"`, `rescale_betas_zero_snr=False`,
        `snr_shift_scale=3.0`: not CogVideoX's). `beta_schedule` must be
        `"scaled_linear"` and `trained_betas` null; `clip_sample`, `clip_sample_range`
        and `sample_max_value` have no effect (diffusers' step does not clip).
        """
        return build_from_config(cls, config)

    def plan(self, steps: int) -> SchedulerPlan:
        """diffusers' `set_timesteps(steps)`, `sigmas = sqrt(1 - alphas_cumprod)`; the
        coefficients are the update's four scalars (float64, from diffusers' float64
        `alphas_cumprod`)."""
        t, now, after, _, sigmas = _tables(self, steps)
        p0, p1 = _x0_coefficients(self.prediction_type, now)
        a = np.sqrt((1 - after) / (1 - now))
        b = np.sqrt(after) - np.sqrt(now) * a
        coefficients = np.stack([p0, p1, a, b], axis=1)
        check_finite("CogVideoXDDIM", coefficients, _describe(self))
        return make_plan(t, sigmas, coefficients)

    @checked
    def step(self, plan: SchedulerPlan, state: SchedulerState, i: StepIndex,
             model_output: Latents, latents: Latents, *,
             key: PRNGKeyArray | None = None) -> tuple[Latents, SchedulerState]:
        """diffusers' `CogVideoXDDIMScheduler.step`."""
        with jax.named_scope("CogVideoXDDIM.step"):
            (p0, p1, a, b), x, v = step_inputs(self, plan, state, i, model_output, latents)
            x0 = p0 * x + p1 * v
            return (a * x + b * x0).astype(latents.dtype), state


class CogVideoXDPM(AbstractScheduler):
    """CogVideoX's DPM-Solver++ (2M, SDE) scheduler, the one CogVideoX's own
    demos run the 5B models with: diffusers' `CogVideoXDPMScheduler`, as
    `CogVideoXPipeline` drives it (the previous step's data prediction carried in the
    state; `timestep_back` the previous step's timestep). Stochastic: each step adds
    Gaussian noise (diffusers' step always does; its `eta` is not used), except the last
    with `set_alpha_to_one`, so `step` takes a `key`, or the `noise` itself.

    Step `i`, from timestep `t` to `t' = t - num_train_timesteps // steps`, with
    `lambda = log sqrt(a / (1 - a))`, `h = lambda_t' - lambda_t`:

        x0 = sqrt(a_t) x - sqrt(1 - a_t) v                    (v-prediction)
        d  = x0                                        (first and last step)
        d  = (1 + 1 / 2r) x0 - (1 / 2r) x0_previous,   r = (lambda_t - lambda_back) / h
        x' = sqrt((1 - a_t') / (1 - a_t)) e^-h x - (e^-2h - 1) sqrt(a_t') d
             + sqrt(1 - a_t') sqrt(1 - e^-2h) noise

    **Arguments:** those of [`CogVideoXDDIM`][], with the defaults of CogVideoX-5B's
    `scheduler_config.json` (CogVideoX-2B's with `snr_shift_scale=1.0`).
    """

    snr_shift_scale: float = eqx.field(static=True, default=1.0)
    prediction_type: str = eqx.field(static=True, default="v_prediction")
    timestep_spacing: str = eqx.field(static=True, default="trailing")
    rescale_betas_zero_snr: bool = eqx.field(static=True, default=True)
    set_alpha_to_one: bool = eqx.field(static=True, default=True)
    beta_start: float = eqx.field(static=True, default=0.00085)
    beta_end: float = eqx.field(static=True, default=0.012)
    num_train_timesteps: int = eqx.field(static=True, default=1000)
    steps_offset: int = eqx.field(static=True, default=0)

    stochastic = True
    history_size = 1

    def __check_init__(self):
        _check_schedule(self)

    @classmethod
    def from_config(cls, config: dict | str | os.PathLike) -> "CogVideoXDPM":
        """From a diffusers `CogVideoXDPMScheduler` config, read as
        [`CogVideoXDDIM.from_config`][] reads `CogVideoXDDIMScheduler`'s.
        """
        return build_from_config(cls, config)

    def plan(self, steps: int) -> SchedulerPlan:
        """As [`CogVideoXDDIM.plan`][]; the coefficients are the update's seven scalars,
        the second-order weights zero where diffusers takes a first-order step."""
        t, now, after, target, sigmas = _tables(self, steps)
        p0, p1 = _x0_coefficients(self.prediction_type, now)
        with np.errstate(divide="ignore", invalid="ignore"):
            lam = np.log(np.sqrt(now / (1 - now)))
            lam_next = np.log(np.sqrt(after / (1 - after)))
            h = lam_next - lam
            mult1 = np.sqrt((1 - after) / (1 - now)) * np.exp(-h)
            mult2 = np.expm1(-2 * h) * np.sqrt(after)
            noise = np.sqrt(1 - after) * np.sqrt(1 - np.exp(-2 * h))
            # The second-order correction: every step but the first and those whose
            # target is past the end (diffusers' `prev_timestep < 0`); r is infinite
            # after a zero-SNR first timestep, and 1 / (2 r) then 0, as in diffusers.
            second = (np.arange(len(t)) > 0) & (target >= 0)
            r = np.concatenate([[1.0], lam[1:] - lam[:-1]]) / h
            half_inverse_r = np.where(second, 1 / (2 * r), 0.0)
        coefficients = np.stack(
            [p0, p1, mult1, mult2, 1 + half_inverse_r, half_inverse_r, noise], axis=1)
        check_finite("CogVideoXDPM", coefficients, _describe(self))
        return make_plan(t, sigmas, coefficients)

    @checked
    def step(self, plan: SchedulerPlan, state: SchedulerState, i: StepIndex,
             model_output: Latents, latents: Latents, *, noise: Latents | None = None,
             key: PRNGKeyArray | None = None) -> tuple[Latents, SchedulerState]:
        """diffusers' `CogVideoXDPMScheduler.step`, with one more argument:

        - `noise`: the step's standard normal noise (the latents' shape), diffusers'
            `randn_tensor` draw, instead of a draw from `key` (which it makes
            unnecessary).
        """
        with jax.named_scope("CogVideoXDPM.step"):
            coefficients, x, v = step_inputs(self, plan, state, i, model_output, latents)
            if noise is None:
                if key is None:
                    raise ValueError(
                        "CogVideoXDPM.step: this scheduler adds noise in every step; pass "
                        "`key` (a PRNG key, a different one each step) or `noise` (the "
                        "latents' shape); received neither.")
                noise = jax.random.normal(key, latents.shape, x.dtype)
            p0, p1, mult1, mult2, mult3, mult4, mult_noise = coefficients
            x0 = p0 * x + p1 * v
            d = mult3 * x0 - mult4 * state.history[0]
            new = mult1 * x - mult2 * d + mult_noise * noise.astype(x.dtype)
            return new.astype(latents.dtype), SchedulerState(x0[None])

