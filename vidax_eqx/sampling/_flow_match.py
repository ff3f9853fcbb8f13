"""The flow-matching schedulers of Wan: diffusers' `FlowMatchEulerDiscreteScheduler`
and `UniPCMultistepScheduler` in its flow-prediction form."""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PRNGKeyArray

from .._shapes import checked
from ._diffusers_keys import build_from_config
from ._schedulers import (
    AbstractScheduler, Latents, SchedulerPlan, SchedulerState, StepIndex, check_bool,
    check_choice, check_finite, check_int, check_positive, check_steps, make_plan, step_inputs,
)


def _step_indices(value) -> tuple:
    """`disable_corrector` as a hashable tuple (diffusers takes a list)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError("UniPC: `disable_corrector` must be a list or tuple of step indices "
                        f"(ints >= 0); received {value!r} of type {type(value).__name__}.")
    return tuple(value)


def _shifted(shift: float, sigmas):
    return shift * sigmas / (1 + (shift - 1) * sigmas)


class FlowMatchEuler(AbstractScheduler):
    """The Euler flow-matching scheduler: diffusers'
    `FlowMatchEulerDiscreteScheduler(shift=shift)` with its other options at their
    defaults (no dynamic shifting, no Karras/exponential/beta sigmas, no terminal
    stretch, deterministic). The model predicts the velocity `v = noise - x0`; step
    `i` is `x + (sigmas[i + 1] - sigmas[i]) * v`.

    The schedule is diffusers', rounding included: `N` = `num_train_timesteps`
    training sigmas `shift * s / (1 + (shift - 1) * s)`, `s = 1, ..., 1/N` (float32);
    `steps` timesteps evenly spaced from `N` times the largest to `N` times the
    smallest of those, shifted again (diffusers shifts the smallest training sigma
    twice), rounded to float32; then a final sigma 0. The model's timestep is `N`
    times the sigma (float32, not an integer).

    **Arguments:**

    - `shift`: the timestep shift (> 0). Default 3.0: Wan 2.1 at 480p; 5.0 for 720p
        (diffusers' own default, 1.0, is no shift).
    - `num_train_timesteps`: the number of training timesteps `N` (default 1000).

    Differences from diffusers' `step`: the result has the dtype of `latents` (diffusers
    casts it to the model output's dtype) and the update is computed in the latents'
    dtype, at least float32 (diffusers casts the sample to float32).
    """

    shift: float = eqx.field(static=True, default=3.0)
    num_train_timesteps: int = eqx.field(static=True, default=1000)

    stochastic = False
    history_size = 0

    def __check_init__(self):
        check_positive("FlowMatchEuler", "shift", self.shift,
                       " (3.0 for Wan 480p, 5.0 for 720p; 1.0 is no shift)")
        check_int("FlowMatchEuler", "num_train_timesteps", self.num_train_timesteps, 1)

    @classmethod
    def from_config(cls, config: dict | str | os.PathLike) -> "FlowMatchEuler":
        """From a diffusers `FlowMatchEulerDiscreteScheduler` config, as
        [`scheduler_from_config`][] reads it: `shift` and `num_train_timesteps` (diffusers'
        defaults, 1.0 and 1000, where a key is absent); the other options at the values
        that change nothing (the dynamic-shifting parameters `base_shift`, `max_shift`,
        `base_image_seq_len`, `max_image_seq_len` and `time_shift_type` are unused without
        `use_dynamic_shifting`). Refused: `use_dynamic_shifting`, `invert_sigmas`,
        `stochastic_sampling`, Karras / exponential / beta sigmas, `shift_terminal`.
        """
        return build_from_config(cls, config)

    def plan(self, steps: int) -> SchedulerPlan:
        """diffusers' `set_timesteps(steps)`; the coefficients are the step sizes
        `sigmas[i + 1] - sigmas[i]`."""
        steps = check_steps("FlowMatchEuler", steps)
        n = self.num_train_timesteps
        f32 = np.float32
        # __init__'s training schedule, in float32 as diffusers computes it in torch.
        train = np.linspace(1, n, n, dtype=f32)[::-1] / f32(n)
        train = f32(self.shift) * train / (f32(1) + f32(self.shift - 1) * train)
        sigma_max, sigma_min = float(train[0]), float(train[-1])
        # set_timesteps: float64, shifted (again), then float32.
        sigmas = np.linspace(sigma_max * n, sigma_min * n, steps) / n
        sigmas = _shifted(self.shift, sigmas).astype(f32)
        timesteps = sigmas * f32(n)
        sigmas = np.concatenate([sigmas, np.zeros(1, f32)])
        dt = np.diff(sigmas.astype(np.float64))[:, None]
        return make_plan(timesteps, sigmas, dt)

    @checked
    def step(self, plan: SchedulerPlan, state: SchedulerState, i: StepIndex,
             model_output: Latents, latents: Latents, *,
             key: PRNGKeyArray | None = None) -> tuple[Latents, SchedulerState]:
        """diffusers' `FlowMatchEulerDiscreteScheduler.step`: `latents + (sigmas[i + 1]
        - sigmas[i]) * model_output`."""
        with jax.named_scope("FlowMatchEuler.step"):
            (dt,), x, v = step_inputs(self, plan, state, i, model_output, latents)
            return (x + dt * v).astype(latents.dtype), state


class UniPC(AbstractScheduler):
    """UniPC multistep in its flow-prediction form, the default scheduler of diffusers'
    Wan pipelines: diffusers' `UniPCMultistepScheduler(prediction_type=
    "flow_prediction", use_flow_sigmas=True, flow_shift=shift, ...)` with the options
    of the Wan 2.1 and 2.2 `scheduler_config.json` as defaults (`solver_order=2`,
    `predict_x0=True`, `solver_type="bh2"`, `lower_order_final=True`,
    `disable_corrector=[]`, `final_sigmas_type="zero"`, no dynamic shifting).

    The model predicts the velocity; the data prediction is `x0 = x - sigma * v`. Each
    step first corrects the latents it receives with the model output at them (UniC,
    from the second step on), then predicts the next latents (UniP) from the last
    `solver_order` data predictions. The orders warm up (1, 2, ...) and, with
    `lower_order_final`, come down again over the last steps, as in diffusers: they
    depend on the step index and the number of steps only, so the plan holds each
    step's coefficients and a step is one branch-free linear combination.

    The schedule: `steps` sigmas evenly spaced from 1 to `1 / num_train_timesteps`,
    shifted by `shift`, the first lowered by 1e-6 (so its log is finite), then the
    final sigma; the model's timestep is `trunc(num_train_timesteps * sigma)`, an
    integer, as diffusers makes it.

    **Arguments:**

    - `shift`: the flow shift (> 0; diffusers' `flow_shift`). Default 3.0 (Wan 2.1
        480p and the Wan pipelines' configs); 5.0 for Wan 720p.
    - `num_train_timesteps`: default 1000.
    - `solver_order`: the order of the multistep solver (>= 1; default 2).
    - `solver_type`: `"bh2"` (default) or `"bh1"`, UniPC's `B(h)`.
    - `lower_order_final`: lower the order over the last steps (default True). With
        `final_sigmas_type="zero"` and `solver_order > 1` it is needed: without it
        the last step divides by zero (diffusers returns NaN), and `plan` raises.
    - `disable_corrector`: the step indices whose following step skips the corrector
        (diffusers' list; default none).
    - `final_sigmas_type`: `"zero"` (default: the last step goes to sigma 0, the data
        prediction) or `"sigma_min"` (it stops at the last sigma).

    `solver_type="bh1"` with `final_sigmas_type="zero"` divides by zero on the last
    step (diffusers returns NaN): `plan` raises.
    """

    shift: float = eqx.field(static=True, default=3.0)
    num_train_timesteps: int = eqx.field(static=True, default=1000)
    solver_order: int = eqx.field(static=True, default=2)
    solver_type: str = eqx.field(static=True, default="bh2")
    lower_order_final: bool = eqx.field(static=True, default=True)
    disable_corrector: tuple[int, ...] = eqx.field(static=True, default=(), converter=_step_indices)
    final_sigmas_type: str = eqx.field(static=True, default="zero")

    stochastic = False

    @property
    def history_size(self) -> int:
        """`solver_order + 1`: the previous corrected latents, then the last
        `solver_order` data predictions, newest first."""
        return self.solver_order + 1

    def __check_init__(self):
        check_positive("UniPC", "shift", self.shift,
                       " (diffusers' flow_shift: 3.0 for Wan 480p, 5.0 for 720p)")
        check_int("UniPC", "num_train_timesteps", self.num_train_timesteps, 1)
        check_int("UniPC", "solver_order", self.solver_order, 1)
        check_choice("UniPC", "solver_type", self.solver_type, {"bh1", "bh2"})
        check_bool("UniPC", "lower_order_final", self.lower_order_final)
        for index in self.disable_corrector:
            check_int("UniPC", "disable_corrector (each step index)", index, 0)
        check_choice("UniPC", "final_sigmas_type", self.final_sigmas_type, {"zero", "sigma_min"})

    @classmethod
    def from_config(cls, config: dict | str | os.PathLike) -> "UniPC":
        """From a diffusers `UniPCMultistepScheduler` config in its flow-prediction form,
        as [`scheduler_from_config`][] reads it: `flow_shift` (the field `shift`),
        `solver_order`, `solver_type` (`"midpoint"`, `"heun"`, `"logrho"` are diffusers'
        aliases of `"bh2"`), `lower_order_final`, `disable_corrector`,
        `final_sigmas_type`, `num_train_timesteps`, diffusers' defaults where a key is
        absent (`flow_shift` 1.0). `prediction_type` must be `"flow_prediction"`,
        `use_flow_sigmas` and `predict_x0` true; the betas (`beta_start`, `beta_end`,
        `beta_schedule`, `trained_betas`, `rescale_betas_zero_snr`), `timestep_spacing`
        and `steps_offset` have no effect on flow sigmas, and are accepted at any of
        diffusers' values. Refused: thresholding, Karras / exponential / beta sigmas,
        dynamic shifting, `shift_terminal`, `solver_p`.
        """
        return build_from_config(cls, config)

    def _sigmas(self, steps: int):
        n = self.num_train_timesteps
        sigmas = _shifted(self.shift, np.linspace(1, 1 / n, steps + 1)[:-1])
        if abs(sigmas[0] - 1) < 1e-6:
            sigmas[0] -= 1e-6
        timesteps = np.trunc(sigmas * n)  # diffusers' .to(torch.int64)
        last = sigmas[-1] if self.final_sigmas_type == "sigma_min" else 0.0
        return timesteps, np.concatenate([sigmas, [last]]).astype(np.float32)

    def _order(self, j: int, steps: int) -> int:
        """The predictor's order at step `j` (the corrector of step `j + 1` uses it)."""
        order = min(self.solver_order, steps - j) if self.lower_order_final else self.solver_order
        return min(order, j + 1)

    def _update(self, lam, sig, t, s0, previous, order, corrector):
        """`(a, b, c, w)` of one UniP / UniC update from `s0` to `t`:
        `a * x - b * m0 - c * (sum_k w_k (m_k - m0) [+ w_t (m_t - m0)])`, the data
        predictions `m_k` at the sigma indices `previous[k - 1]`."""
        alpha = 1 - sig
        with np.errstate(divide="ignore", invalid="ignore"):
            h = lam[t] - lam[s0]
            rks = np.array([(lam[si] - lam[s0]) / h for si in previous[:order - 1]] + [1.0])
            hh = -h
            h_phi_1 = np.expm1(hh)
            h_phi_k = h_phi_1 / hh - 1
            b_h = hh if self.solver_type == "bh1" else np.expm1(hh)
            R, b, factorial = [], [], 1
            for k in range(1, order + 1):
                R.append(rks ** (k - 1))
                b.append(h_phi_k * factorial / b_h)
                factorial *= k + 1
                h_phi_k = h_phi_k / hh - 1 / factorial
            R, b = np.array(R), np.array(b)
            if corrector:
                rhos = np.array([0.5]) if order == 1 else np.linalg.solve(R, b)
            elif order == 1:
                rhos = np.zeros(0)
            else:
                rhos = np.array([0.5]) if order == 2 else np.linalg.solve(R[:-1, :-1], b[:-1])
            w = rhos[:order - 1] / rks[:-1]
            w = np.concatenate([w, np.zeros(self.solver_order - 1 - len(w))])
            a = sig[t] / sig[s0]
            return [a, alpha[t] * h_phi_1, alpha[t] * b_h, *w], rhos

    def plan(self, steps: int) -> SchedulerPlan:
        """diffusers' `set_timesteps(steps)`; the coefficients are each step's corrector
        and predictor coefficients, computed in float64 from the float32 sigmas."""
        steps = check_steps("UniPC", steps)
        timesteps, sigmas = self._sigmas(steps)
        sig = sigmas.astype(np.float64)
        with np.errstate(divide="ignore"):
            lam = np.log(1 - sig) - np.log(sig)
        p = self.solver_order
        rows = []
        for i in range(steps):
            # UniC: corrects the latents of step i, reached from step i - 1.
            corrector = [0.0] * (p + 4)
            if i > 0 and (i - 1) not in self.disable_corrector:
                order = self._order(i - 1, steps)
                coefs, rhos = self._update(lam, sig, i, i - 1, [i - 1 - k for k in range(1, p)],
                                           order, corrector=True)
                corrector = [1.0, *coefs, rhos[-1]]
            # UniP: predicts the latents of step i + 1.
            order = self._order(i, steps)
            predictor, _ = self._update(lam, sig, i + 1, i, [i - k for k in range(1, p)],
                                        order, corrector=False)
            rows.append(corrector + predictor)
        coefficients = np.array(rows, np.float64)
        check_finite("UniPC", coefficients,
                     f"solver_order={p}, solver_type={self.solver_type!r}, lower_order_final="
                     f"{self.lower_order_final}, final_sigmas_type={self.final_sigmas_type!r}")
        return make_plan(timesteps, sigmas, coefficients)

    @checked
    def step(self, plan: SchedulerPlan, state: SchedulerState, i: StepIndex,
             model_output: Latents, latents: Latents, *,
             key: PRNGKeyArray | None = None) -> tuple[Latents, SchedulerState]:
        """diffusers' `UniPCMultistepScheduler.step`: the corrector (UniC) of the
        latents it receives, then the predictor (UniP) of the next."""
        with jax.named_scope("UniPC.step"):
            p = self.solver_order
            c, x, v = step_inputs(self, plan, state, i, model_output, latents)
            m = x - plan.sigmas[i].astype(x.dtype) * v
            last, history = state.history[0], state.history[1:]  # m_{i-1}, ..., m_{i-p}

            # UniC: c[0] says whether it runs; a, b, c, then p - 1 weights and w_t.
            use, a, b, cc = c[0], c[1], c[2], c[3]
            m0 = history[0]
            res = jnp.zeros_like(m)
            for k in range(1, p):
                res = res + c[3 + k] * (history[k] - m0)
            corrected = a * last - b * m0 - cc * (res + c[3 + p] * (m - m0))
            x = jnp.where(use > 0, corrected, x)

            # UniP: a, b, c, then p - 1 weights on m_{i-1}, ..., m_{i-p+1}.
            q = p + 4
            a, b, cc = c[q], c[q + 1], c[q + 2]
            res = jnp.zeros_like(m)
            for k in range(1, p):
                res = res + c[q + 2 + k] * (history[k - 1] - m)
            new = a * x - b * m - cc * res

            state = SchedulerState(jnp.concatenate([x[None], m[None], history[:p - 1]]))
            return new.astype(latents.dtype), state
