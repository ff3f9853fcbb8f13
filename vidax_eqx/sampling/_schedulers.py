"""The scheduler contract: a plan of arrays for a number of steps, a state of arrays,
and one pure step; and what the schedulers share: the start of a step and the
validators."""

import abc
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._checks import is_int, is_real


Latents = Float[Array, "*shape"]
"""The annotation of latents and of a model output of their shape (`step`'s)."""
StepIndex = Int[ArrayLike, ""]
"""The annotation of a step index: a Python int or a traced integer scalar."""


class SchedulerPlan(eqx.Module):
    """The arrays of a schedule of `steps` denoising steps, made by a scheduler's
    `plan(steps)` on the host (NumPy, float64) and read by its `step`. A PyTree of
    arrays: it can be closed over, passed into `jax.jit`, or carried by a loop.

    **Fields:**

    - `timesteps`: `(steps,)` float32, the model's timestep input at each step, as the
        diffusers scheduler's `timesteps` (integers for UniPC and CogVideoX, stored as
        float32, which holds them exactly).
    - `sigmas`: `(steps + 1,)` float32, the noise level of the sample entering each
        step, then of the last step's output: `sigma` in `x = (1 - sigma) x0 +
        sigma noise` for flow matching (diffusers' `sigmas`), `sqrt(1 - alphas_cumprod)`
        in `x = sqrt(alphas_cumprod) x0 + sqrt(1 - alphas_cumprod) noise` for the
        CogVideoX schedulers.
    - `coefficients`: `(steps, k)`, the scalars each step combines its arrays with
        (specific to the scheduler: read by its `step` only), computed in float64 and
        stored in JAX's default float dtype (float64 when `jax_enable_x64` is on).
    """

    timesteps: Float[Array, " steps"]
    sigmas: Float[Array, " steps_plus_one"]
    coefficients: Float[Array, "steps k"]

    @property
    def steps(self) -> int:
        """The number of denoising steps (static: the arrays' length)."""
        return self.timesteps.shape[0]

    def padded(self, capacity: int) -> "SchedulerPlan":
        """This plan's arrays padded to `capacity >= steps` steps (by repeating their
        last row), so that one compiled loop of `capacity` rows runs any number of
        steps up to it, the count passed separately (`sample(max_steps=...)`): step
        `i < steps` reads exactly this plan's row `i`."""
        extra = capacity - self.steps
        if extra < 0:
            raise ValueError(f"SchedulerPlan.padded: `capacity` ({capacity}) must be at least "
                             f"the plan's {self.steps} steps.")
        def pad(a):  # on the host: no program per capacity
            a = np.asarray(a)
            return jnp.asarray(np.pad(a, ((0, extra),) + ((0, 0),) * (a.ndim - 1), mode="edge"))

        return SchedulerPlan(pad(self.timesteps), pad(self.sigmas), pad(self.coefficients))


class SchedulerState(eqx.Module):
    """What a scheduler carries from one step to the next: `history`, `(n, *shape)`
    arrays of the latents' shape in the step's float dtype (at least float32). `n` is
    0 for the one-step schedulers ([`FlowMatchEuler`][], [`CogVideoXDDIM`][]); for
    [`UniPC`][] of order `p` it is `p + 1` (the previous step's corrected sample, then
    the data predictions of the last `p` steps); for [`CogVideoXDPM`][] 1 (the previous
    step's data prediction). Fixed shapes, so a whole loop runs in `lax.fori_loop`."""

    history: Float[Array, "n *shape"]


class AbstractScheduler(eqx.Module):
    """A diffusion scheduler as pure functions: every configuration field is static
    (a scheduler is hashable and has no array leaves), every array lives in the
    [`SchedulerPlan`][] or the [`SchedulerState`][]. A denoising loop:

        plan = scheduler.plan(steps)            # static steps, host-side NumPy
        state = scheduler.init(latents)         # latents: the initial noise
        for i in range(steps):                  # or lax.fori_loop, i traced
            t = scheduler.timestep(plan, i)
            model_output = model(latents, t)
            latents, state = scheduler.step(plan, state, i, model_output, latents,
                                            key=jax.random.fold_in(key, i))

    The initial latents are standard normal noise (diffusers' `init_noise_sigma` is 1
    for all of these) and the model takes the latents unscaled (their
    `scale_model_input` is the identity). A stochastic scheduler (`stochastic`) draws
    its noise from `key`, one key per step; the others ignore `key`. `history_size`
    is the number `n` of arrays its [`SchedulerState`][] carries.

    In the signatures, `Latents` is `Float[Array, "*shape"]` (any shape, the same for
    every such argument of a call) and `StepIndex` is `Int[ArrayLike, ""]`.
    """

    stochastic: eqx.AbstractClassVar[bool]
    history_size: eqx.AbstractVar[int]

    @abc.abstractmethod
    def plan(self, steps: int) -> SchedulerPlan:
        """The schedule of `steps` denoising steps: diffusers' `timesteps` and `sigmas`
        after `set_timesteps(steps)`, and each step's coefficients.

        **Arguments:**

        - `steps`: the number of denoising steps (diffusers' `num_inference_steps`),
            a Python int >= 1 (at most `num_train_timesteps` for the CogVideoX
            schedulers). Static: a compiled loop is specialized to it.

        **Returns:**

        A [`SchedulerPlan`][].

        **Raises:**

        `TypeError` unless `steps` is a Python int; `ValueError` if it is out of range,
        or if the scheduler's configuration divides by zero in some step (where
        diffusers' step returns inf or NaN; the scheduler's documentation names the
        option).
        """

    def init(self, latents: Latents) -> SchedulerState:
        """The state before the first step.

        **Arguments:**

        - `latents`: the initial latents (any shape, e.g. `(B, C, F, H, W)`); only their
            shape and dtype are read.

        **Returns:**

        A [`SchedulerState`][] of zeros: `history` of shape `(history_size, *shape)`,
        in the latents' float dtype, at least float32.
        """
        return SchedulerState(jnp.zeros((self.history_size, *latents.shape),
                                        compute_dtype(latents)))

    @abc.abstractmethod
    def step(
        self,
        plan: SchedulerPlan,
        state: SchedulerState,
        i: StepIndex,
        model_output: Latents,
        latents: Latents,
        *,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Latents, SchedulerState]:
        """One denoising step: the latents of step `i + 1` from those of step `i`,
        computed in the latents' float dtype, at least float32.

        **Arguments:**

        - `plan`: this scheduler's [`SchedulerPlan`][].
        - `state`: the [`SchedulerState`][] from `init` or the previous step.
        - `i`: the step index in `[0, plan.steps)`, a Python int or a traced integer
            scalar.
        - `model_output`: the model's prediction at `(latents, timestep(plan, i))`, the
            latents' shape: the velocity for flow matching, of `prediction_type` for
            the CogVideoX schedulers.
        - `latents`: the latents of step `i`.
        - `key`: a PRNG key for the step's noise, a different one each step (e.g.
            `jax.random.fold_in(key, i)`); needed by a stochastic scheduler, unused by
            the others (which accept it so that one loop serves every scheduler).

        **Returns:**

        `(latents, state)`: the latents of step `i + 1` (the dtype of `latents`) and the
        next state.

        **Raises:**

        `ValueError` if `state` is not the one `init` makes for these latents (another
        scheduler's, or other latents'), or if a stochastic scheduler receives no
        `key`; jaxtyping's `TypeCheckError` if `model_output` does not have the
        latents' shape.
        """

    def timestep(self, plan: SchedulerPlan, i: StepIndex) -> Float[Array, ""]:
        """The model's timestep input at step `i`.

        **Arguments:**

        - `plan`: the scheduler's [`SchedulerPlan`][].
        - `i`: the step index in `[0, plan.steps)`, a Python int or a traced integer
            scalar.

        **Returns:**

        A float32 scalar, diffusers' `timesteps[i]`.
        """
        return plan.timesteps[i]


def compute_dtype(latents) -> jnp.dtype:
    """The dtype a step computes in: the latents' float dtype, at least float32."""
    return jnp.promote_types(latents.dtype, jnp.float32)


def make_plan(timesteps, sigmas, coefficients) -> SchedulerPlan:
    """A plan from host arrays: timesteps and sigmas as float32, coefficients in JAX's
    default float dtype."""
    return SchedulerPlan(
        # device_put: jnp.asarray would compile a small program per shape.
        timesteps=jax.device_put(np.asarray(timesteps, np.float32)),
        sigmas=jax.device_put(np.asarray(sigmas, np.float32)),
        coefficients=jax.device_put(np.asarray(np.asarray(coefficients, np.float64),
                                               jax.dtypes.canonicalize_dtype(np.float64))),
    )


def step_inputs(scheduler: AbstractScheduler, plan: SchedulerPlan, state: SchedulerState,
                i, model_output, latents):
    """The start every `step` shares: raises unless `state` is the one `scheduler.init`
    makes for these latents; returns `(coefficients, x, model_output)`, the plan's row
    `i`, the latents and the model output, in the step's dtype (`compute_dtype`)."""
    expected = (scheduler.history_size, *latents.shape)
    if state.history.shape != expected:
        raise ValueError(
            f"{type(scheduler).__name__}.step: `state.history` must have shape {expected} "
            f"(the state `init` makes for latents of shape {latents.shape}); received "
            f"{state.history.shape}. Start the loop with `state = scheduler.init(latents)`.")
    dtype = compute_dtype(latents)
    return plan.coefficients[i].astype(dtype), latents.astype(dtype), model_output.astype(dtype)


def check_steps(owner: str, steps, maximum: int | None = None) -> int:
    """`steps` as an int: a TypeError unless it is one, a ValueError unless in range."""
    bound = "" if maximum is None else f" and at most num_train_timesteps={maximum}"
    rule = f"`steps` (the number of denoising steps) must be a Python int >= 1{bound}"
    if not is_int(steps):
        raise TypeError(f"{owner}.plan: {rule}; received {steps!r} of type "
                        f"{type(steps).__name__}. It is static: pass an int, not an array.")
    if steps < 1 or (maximum is not None and steps > maximum):
        raise ValueError(f"{owner}.plan: {rule}; received {steps}.")
    return int(steps)


def check_positive(owner: str, name: str, value, hint: str = "") -> None:
    """Raises unless `value` is a finite real number > 0."""
    rule = f"`{name}` must be a finite number > 0{hint}"
    if not is_real(value):
        raise TypeError(f"{owner}: {rule}; received {value!r} of type {type(value).__name__}.")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{owner}: {rule}; received {value!r}.")


def check_int(owner: str, name: str, value, minimum: int) -> None:
    """Raises unless `value` is a Python int >= `minimum`."""
    if not is_int(value):
        raise TypeError(f"{owner}: `{name}` must be an int >= {minimum}; received {value!r} "
                        f"of type {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"{owner}: `{name}` must be an int >= {minimum}; received {value!r}.")


def check_choice(owner: str, name: str, value, choices) -> None:
    """Raises unless `value` is one of `choices`."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{owner}: `{name}` must be one of {sorted(choices)}; received {value!r}.")


def check_bool(owner: str, name: str, value) -> None:
    """Raises unless `value` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: `{name}` must be True or False; received {value!r} of type "
                        f"{type(value).__name__}.")


def check_finite(owner: str, coefficients, config: str) -> None:
    """Raises if a plan's coefficients are not finite: a configuration whose update
    divides by zero (where diffusers' step returns inf or NaN)."""
    if not np.all(np.isfinite(coefficients)):
        rows = sorted(set(np.nonzero(~np.isfinite(coefficients))[0].tolist()))
        raise ValueError(
            f"{owner}.plan: this configuration ({config}) divides by zero in step(s) {rows} "
            "(diffusers' step returns inf or NaN there). Change the option named in the "
            "scheduler's documentation.")
