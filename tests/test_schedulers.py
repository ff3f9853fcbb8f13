"""The schedulers of `vidax_eqx.sampling` against diffusers' and against a float64 oracle.

1. A float64 NumPy oracle, written here from diffusers' `set_timesteps` and `step`
   (a plain Python loop with diffusers' own bookkeeping: UniPC's list of model
   outputs, `lower_order_nums` and `this_order`; the DPM step's
   `old_pred_original_sample` and `timestep_back`), importing nothing from
   vidax_eqx. The schedulers, run in float64 (`jax.enable_x64`), match it to
   `TOL["float64"]`, and in float32 to `TOL["float32"]`.
2. diffusers itself: `tests/fixtures/schedulers/*.npz` (written by
   `scripts/make_scheduler_fixtures.py` with diffusers 0.42.1) hold its timesteps,
   sigmas and every step's output of a whole loop; matched to `TOL[dtype]`
   (1e-6 relative in both dtypes, the parity the issue asks for; diffusers computes
   UniPC's coefficients in float32 even on a float64 sample), the timesteps exactly.
3. A whole loop in `jax.jit` + `lax.fori_loop` with a traced step index equals the
   eager Python loop; it compiles once per number of steps (`steps` is static: the
   plan's arrays have that length), not once per call.
4. Bad input raises (STYLE rule 5: TypeError for a wrong type, ValueError for a bad
   value), naming the argument, what was received and what was expected.

Errors are `max|got - ref| / max(max|ref|, 1)` (`oracle.rel_error`).
"""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jaxtyping import TypeCheckError

import oracle
from vidax_eqx import sampling


FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "schedulers"
TOL = {"float64": 1e-12, "float32": 1e-6}
DIFFUSERS_TOL = {"float64": 1e-6, "float32": 1e-6}
SHAPE = (1, 2, 2, 2, 4)


# -- the float64 oracle: diffusers' schedules and steps, re-derived ------------------


def _f64(x):
    return np.asarray(x, np.float64)


def euler_schedule(shift, n, steps):
    """FlowMatchEulerDiscreteScheduler: __init__'s float32 training sigmas, then
    set_timesteps' float64 linspace between them, shifted (again), to float32."""
    train = np.linspace(1, n, n, dtype=np.float32)[::-1].copy() / np.float32(n)
    train = np.float32(shift) * train / (np.float32(1) + np.float32(shift - 1) * train)
    sigmas = np.linspace(float(train[0]) * n, float(train[-1]) * n, steps) / n
    sigmas = (shift * sigmas / (1 + (shift - 1) * sigmas)).astype(np.float32)
    return sigmas * np.float32(n), np.append(sigmas, np.float32(0))


def euler_loop(cfg, steps, x, model, noise=None):
    _, sigmas = euler_schedule(cfg["shift"], 1000, steps)
    sigmas = _f64(sigmas)
    out = []
    for i in range(steps):
        x = x + (sigmas[i + 1] - sigmas[i]) * model(x, i)
        out.append(x)
    return np.stack(out)


def unipc_schedule(cfg, steps, n=1000):
    shift = cfg["shift"]
    sigmas = np.linspace(1, 1 / n, steps + 1)[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    if np.fabs(sigmas[0] - 1) < 1e-6:
        sigmas[0] -= 1e-6
    timesteps = (sigmas * n).astype(np.int64)
    last = sigmas[-1] if cfg.get("final_sigmas_type", "zero") == "sigma_min" else 0
    return timesteps, np.concatenate([sigmas, [last]]).astype(np.float32)


def _lambda(sigma):
    with np.errstate(divide="ignore"):
        return np.log(1 - sigma) - np.log(sigma)


def _unipc_update(cfg, sigmas, t, s0, x, m0, others, order, model_t=None):
    """diffusers' multistep_uni_p_bh_update (`model_t` None) or _uni_c_ (`model_t`):
    `others` the (sigma index, data prediction) pairs of the earlier steps."""
    with np.errstate(divide="ignore", invalid="ignore"):
        h = _lambda(sigmas[t]) - _lambda(sigmas[s0])
        rks, D1s = [], []
        for si, mi in others[:order - 1]:
            rk = (_lambda(sigmas[si]) - _lambda(sigmas[s0])) / h
            rks.append(rk)
            D1s.append((mi - m0) / rk)
        rks = np.array(rks + [1.0])
        hh = -h
        h_phi_1 = np.expm1(hh)
        h_phi_k = h_phi_1 / hh - 1
        factorial_i = 1
        B_h = hh if cfg.get("solver_type", "bh2") == "bh1" else np.expm1(hh)
        R, b = [], []
        for i in range(1, order + 1):
            R.append(rks ** (i - 1))
            b.append(h_phi_k * factorial_i / B_h)
            factorial_i *= i + 1
            h_phi_k = h_phi_k / hh - 1 / factorial_i
        R, b = np.array(R), np.array(b)
        alpha_t = 1 - sigmas[t]
        x_t_ = sigmas[t] / sigmas[s0] * x - alpha_t * h_phi_1 * m0
        if model_t is None:
            if not D1s:
                return x_t_
            rhos = np.array([0.5]) if order == 2 else np.linalg.solve(R[:-1, :-1], b[:-1])
            return x_t_ - alpha_t * B_h * sum(r * d for r, d in zip(rhos, D1s))
        rhos = np.array([0.5]) if order == 1 else np.linalg.solve(R, b)
        corr = sum(r * d for r, d in zip(rhos[:-1], D1s)) if D1s else 0
        return x_t_ - alpha_t * B_h * (corr + rhos[-1] * (model_t - m0))


def unipc_loop(cfg, steps, x, model, noise=None):
    _, sigmas = unipc_schedule(cfg, steps)
    sigmas = _f64(sigmas)
    p = cfg.get("solver_order", 2)
    model_outputs = [None] * p  # (sigma index, data prediction), oldest first
    last_sample, lower_order_nums, this_order = None, 0, None
    out = []
    for i in range(steps):
        m = x - sigmas[i] * model(x, i)
        if i > 0 and (i - 1) not in cfg.get("disable_corrector", ()) and last_sample is not None:
            earlier = [model_outputs[-(k + 1)] for k in range(1, p)]
            x = _unipc_update(cfg, sigmas, i, i - 1, last_sample, model_outputs[-1][1],
                              [(i - 1 - k, e[1] if e else None) for k, e in zip(range(1, p), earlier)],
                              this_order, model_t=m)
        model_outputs = model_outputs[1:] + [(i, m)]
        order = min(p, steps - i) if cfg.get("lower_order_final", True) else p
        this_order = min(order, lower_order_nums + 1)
        last_sample = x
        earlier = [model_outputs[-(k + 1)] for k in range(1, p)]
        x = _unipc_update(cfg, sigmas, i + 1, i, x, m,
                          [(i - k, e[1] if e else None) for k, e in zip(range(1, p), earlier)],
                          this_order)
        lower_order_nums = min(lower_order_nums + 1, p)
        out.append(x)
    return np.stack(out)


def cogvideox_schedule(cfg, steps, n=1000):
    """`(timesteps, alphas_cumprod, final_alpha_cumprod)` of CogVideoX{DDIM,DPM}Scheduler."""
    betas = np.linspace(cfg.get("beta_start", 0.00085) ** 0.5, cfg.get("beta_end", 0.012) ** 0.5,
                        n, dtype=np.float64) ** 2
    alphas_cumprod = np.cumprod(1.0 - betas, axis=0)
    snr = cfg["snr_shift_scale"]
    alphas_cumprod = alphas_cumprod / (snr + (1 - snr) * alphas_cumprod)
    if cfg.get("rescale_betas_zero_snr", True):
        s = np.sqrt(alphas_cumprod)
        s0, sT = s[0].copy(), s[-1].copy()
        s = s - sT
        s = s * (s0 / (s0 - sT))
        alphas_cumprod = s ** 2
    spacing = cfg.get("timestep_spacing", "trailing")
    if spacing == "trailing":
        timesteps = np.round(np.arange(n, 0, -n / steps)).astype(np.int64) - 1
    elif spacing == "leading":
        timesteps = (np.arange(0, steps) * (n // steps)).round()[::-1].copy().astype(np.int64)
    else:
        timesteps = np.linspace(0, n - 1, steps).round()[::-1].copy().astype(np.int64)
    final = 1.0 if cfg.get("set_alpha_to_one", True) else alphas_cumprod[0]
    return timesteps, alphas_cumprod, final


def _x0(cfg, a_t, x, model_output):
    kind = cfg.get("prediction_type", "v_prediction")
    if kind == "v_prediction":
        return a_t ** 0.5 * x - (1 - a_t) ** 0.5 * model_output
    if kind == "epsilon":
        return (x - (1 - a_t) ** 0.5 * model_output) / a_t ** 0.5
    return model_output


def ddim_loop(cfg, steps, x, model, noise=None):
    timesteps, ac, final = cogvideox_schedule(cfg, steps)
    out = []
    for i, t in enumerate(timesteps):
        prev = t - 1000 // steps
        a_t, a_prev = ac[t], (ac[prev] if prev >= 0 else final)
        x0 = _x0(cfg, a_t, x, model(x, i))
        a = ((1 - a_prev) / (1 - a_t)) ** 0.5
        x = a * x + (a_prev ** 0.5 - a_t ** 0.5 * a) * x0
        out.append(x)
    return np.stack(out)


def dpm_loop(cfg, steps, x, model, noise):
    timesteps, ac, final = cogvideox_schedule(cfg, steps)
    old, out = None, []
    lam = lambda a: np.log((_f64(a) / (1 - _f64(a))) ** 0.5)  # noqa: E731  (float64 NumPy: 1/0 = inf)
    for i, t in enumerate(timesteps):
        prev = t - 1000 // steps
        a_t, a_prev = ac[t], (ac[prev] if prev >= 0 else final)
        x0 = _x0(cfg, a_t, x, model(x, i))
        with np.errstate(divide="ignore", invalid="ignore"):
            h = lam(a_prev) - lam(a_t)
            mult1 = ((1 - a_prev) / (1 - a_t)) ** 0.5 * np.exp(-h)
            mult2 = np.expm1(-2 * h) * a_prev ** 0.5
            mult_noise = (1 - a_prev) ** 0.5 * (1 - np.exp(-2 * h)) ** 0.5
            if old is None or prev < 0:
                d = x0
            else:
                r = (lam(a_t) - lam(ac[timesteps[i - 1]])) / h
                d = (1 + 1 / (2 * r)) * x0 - 1 / (2 * r) * old
        x, old = mult1 * x - mult2 * d + mult_noise * noise(i), x0
        out.append(x)
    return np.stack(out)


# -- the configurations --------------------------------------------------------------

# name: (scheduler, oracle loop, oracle config)
CASES = {
    "euler_shift3": (sampling.FlowMatchEuler(shift=3.0), euler_loop, dict(shift=3.0)),
    "euler_shift5": (sampling.FlowMatchEuler(shift=5.0), euler_loop, dict(shift=5.0)),
    "unipc_shift3": (sampling.UniPC(shift=3.0), unipc_loop, dict(shift=3.0)),
    "unipc_shift5": (sampling.UniPC(shift=5.0), unipc_loop, dict(shift=5.0)),
    "unipc_order1": (sampling.UniPC(solver_order=1), unipc_loop, dict(shift=3.0, solver_order=1)),
    "unipc_order3_bh1": (
        sampling.UniPC(solver_order=3, solver_type="bh1", disable_corrector=[2],
                       final_sigmas_type="sigma_min"),
        unipc_loop, dict(shift=3.0, solver_order=3, solver_type="bh1", disable_corrector=(2,),
                         final_sigmas_type="sigma_min")),
    "unipc_no_lower_order_final": (
        sampling.UniPC(lower_order_final=False, final_sigmas_type="sigma_min"),
        unipc_loop, dict(shift=3.0, lower_order_final=False, final_sigmas_type="sigma_min")),
    "cogvideox_ddim_2b": (sampling.CogVideoXDDIM(), ddim_loop, dict(snr_shift_scale=3.0)),
    "cogvideox_ddim_epsilon": (
        sampling.CogVideoXDDIM(prediction_type="epsilon", rescale_betas_zero_snr=False,
                               timestep_spacing="leading", set_alpha_to_one=False),
        ddim_loop, dict(snr_shift_scale=3.0, prediction_type="epsilon",
                        rescale_betas_zero_snr=False, timestep_spacing="leading",
                        set_alpha_to_one=False)),
    "cogvideox_dpm_5b": (sampling.CogVideoXDPM(), dpm_loop, dict(snr_shift_scale=1.0)),
    "cogvideox_dpm_linspace": (
        sampling.CogVideoXDPM(snr_shift_scale=3.0, timestep_spacing="linspace"),
        dpm_loop, dict(snr_shift_scale=3.0, timestep_spacing="linspace")),
}


def _inputs(steps: int, dtype, seed: int = 0):
    """The initial latents, the per-step model offsets and noises, rounded to `dtype`
    and returned in float64 for the oracle."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(SHAPE).astype(dtype)
    offsets = rng.standard_normal((steps, *SHAPE)).astype(dtype)
    noises = rng.standard_normal((steps, *SHAPE)).astype(dtype)
    return x, offsets, noises


def run_scheduler(scheduler, steps, x, offsets, noises, model_scale=0.5):
    """The eager Python loop: `model_output = model_scale * latents + offsets[i]`."""
    plan = scheduler.plan(steps)
    latents = jnp.asarray(x)
    state = scheduler.init(latents)
    out = []
    for i in range(steps):
        model_output = model_scale * latents + jnp.asarray(offsets[i])
        extra = {"noise": jnp.asarray(noises[i])} if scheduler.stochastic else {}
        latents, state = scheduler.step(plan, state, i, model_output, latents, **extra)
        out.append(np.asarray(latents))
    return np.stack(out)


def run_oracle(loop, cfg, steps, x, offsets, noises, model_scale=0.5):
    return loop(cfg, steps, _f64(x), lambda x, i: model_scale * x + _f64(offsets[i]),
                lambda i: _f64(noises[i]))


# -- 1. the float64 oracle ----------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 4, 20])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_oracle_float64(name, steps):
    scheduler, loop, cfg = CASES[name]
    x, offsets, noises = _inputs(steps, np.float64)
    with jax.enable_x64(True):
        got = run_scheduler(scheduler, steps, x, offsets, noises)
    assert got.dtype == np.float64
    ref = run_oracle(loop, cfg, steps, x, offsets, noises)
    assert np.all(np.isfinite(ref))
    err = oracle.rel_error(got, ref)
    assert err <= TOL["float64"], f"{name}, {steps} steps: float64 error {err:.3g}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_oracle_float32(name):
    scheduler, loop, cfg = CASES[name]
    steps = 20
    x, offsets, noises = _inputs(steps, np.float32, seed=1)
    got = run_scheduler(scheduler, steps, x, offsets, noises)
    assert got.dtype == np.float32
    err = oracle.rel_error(got, run_oracle(loop, cfg, steps, x, offsets, noises))
    assert err <= TOL["float32"], f"{name}: float32 error {err:.3g}"


@pytest.mark.parametrize("name", ["euler_shift3", "unipc_shift5", "unipc_order3_bh1"])
def test_flow_schedule_matches_oracle(name):
    scheduler, _, cfg = CASES[name]
    for steps in (1, 4, 20, 50):
        plan = scheduler.plan(steps)
        schedule = euler_schedule if name.startswith("euler") else unipc_schedule
        timesteps, sigmas = (schedule(cfg["shift"], 1000, steps) if name.startswith("euler")
                             else schedule(cfg, steps))
        np.testing.assert_array_equal(np.asarray(plan.sigmas), sigmas)
        np.testing.assert_array_equal(np.asarray(plan.timesteps), np.float32(timesteps))
        assert plan.steps == steps and plan.coefficients.shape[0] == steps


# -- 2. diffusers' fixtures ----------------------------------------------------------


def _from_diffusers(config: dict):
    """The vidax_eqx scheduler for a fixture's diffusers class and keyword arguments."""
    kw = config["kwargs"]
    if config["class"] == "FlowMatchEulerDiscreteScheduler":
        return sampling.FlowMatchEuler(shift=kw["shift"])
    if config["class"] == "UniPCMultistepScheduler":
        assert kw["prediction_type"] == "flow_prediction" and kw["use_flow_sigmas"] and kw["predict_x0"]
        return sampling.UniPC(
            shift=kw["flow_shift"], num_train_timesteps=kw["num_train_timesteps"],
            solver_order=kw["solver_order"], solver_type=kw["solver_type"],
            lower_order_final=kw["lower_order_final"], disable_corrector=kw["disable_corrector"],
            final_sigmas_type=kw["final_sigmas_type"])
    cls = {"CogVideoXDDIMScheduler": sampling.CogVideoXDDIM,
           "CogVideoXDPMScheduler": sampling.CogVideoXDPM}[config["class"]]
    assert kw["beta_schedule"] == "scaled_linear"
    return cls(**{k: kw[k] for k in (
        "snr_shift_scale", "prediction_type", "timestep_spacing", "rescale_betas_zero_snr",
        "set_alpha_to_one", "beta_start", "beta_end", "num_train_timesteps", "steps_offset")})


def _fixture_runs():
    for path in sorted(FIXTURES.glob("*.npz")):
        with np.load(path) as z:
            for steps in z["steps"].tolist():
                for dtype in ("float32", "float64"):
                    if f"s{steps}_{dtype}_outputs" in z.files:
                        yield pytest.param(path.stem, steps, dtype, id=f"{path.stem}-{steps}-{dtype}")


def test_fixtures_present():
    names = {p.stem for p in FIXTURES.glob("*.npz")}
    assert {"euler_shift3", "euler_shift5", "unipc_shift3", "unipc_shift5",
            "cogvideox_ddim_2b", "cogvideox_dpm_5b"} <= names, names


@pytest.mark.parametrize("name,steps,dtype", list(_fixture_runs()))
def test_matches_diffusers(name, steps, dtype):
    with np.load(FIXTURES / f"{name}.npz") as z:
        z = dict(z)
    scheduler = _from_diffusers(json.loads(str(z["config"])))
    plan = scheduler.plan(steps)
    # The schedule: timesteps exactly, sigmas as diffusers' float32.
    np.testing.assert_array_equal(np.asarray(plan.timesteps, np.float64), z[f"s{steps}_timesteps"])
    if f"s{steps}_sigmas" in z:
        np.testing.assert_array_equal(np.asarray(plan.sigmas, np.float64), z[f"s{steps}_sigmas"])
    else:
        expected = np.sqrt(1 - z[f"s{steps}_alphas_cumprod"])
        assert oracle.rel_error(np.asarray(plan.sigmas[:-1]), expected) <= 1e-7
    # Every step's output of the whole loop, with diffusers' fake model and noise.
    j = np.arange(int(np.prod(SHAPE)), dtype=np.float64)
    f, nf = z["model_freqs"], z["noise_freqs"]
    offsets = np.stack([np.sin(f[0] * j + f[1] * i + f[2]).reshape(SHAPE) for i in range(steps)])
    noises = np.stack([np.cos(nf[0] * j + nf[1] * i + nf[2]).reshape(SHAPE) for i in range(steps)])
    np_dtype = np.dtype(dtype)
    with jax.enable_x64(dtype == "float64"):
        got = run_scheduler(scheduler, steps, z["sample"].astype(np_dtype), offsets.astype(np_dtype),
                            noises.astype(np_dtype), model_scale=float(z["model_scale"]))
    ref = z[f"s{steps}_{dtype}_outputs"]
    assert got.dtype == ref.dtype
    err = oracle.rel_error(got, ref)
    assert err <= DIFFUSERS_TOL[dtype], f"{name}, {steps} steps, {dtype}: error {err:.3g}"


# -- 3. the whole loop in one compiled program ---------------------------------------

TRACES = []


@functools.partial(jax.jit, static_argnums=(0, 1))
def compiled_loop(scheduler, steps, latents, offsets, key):
    """The denoising loop as one program: `lax.fori_loop` over a traced step index."""
    TRACES.append((scheduler, steps))
    plan = scheduler.plan(steps)

    def body(i, carry):
        x, state = carry
        t = scheduler.timestep(plan, i)
        model_output = 0.5 * x + offsets[i] + 0.0 * t
        return scheduler.step(plan, state, i, model_output, x, key=jax.random.fold_in(key, i))

    return lax.fori_loop(0, steps, body, (latents, scheduler.init(latents)))[0]


def eager_loop(scheduler, steps, latents, offsets, key):
    plan = scheduler.plan(steps)
    state = scheduler.init(latents)
    for i in range(steps):
        model_output = 0.5 * latents + offsets[i]
        latents, state = scheduler.step(plan, state, i, model_output, latents,
                                        key=jax.random.fold_in(key, i))
    return latents


LOOP_CASES = ["euler_shift3", "unipc_shift3", "unipc_order3_bh1", "cogvideox_ddim_2b", "cogvideox_dpm_5b"]


@pytest.mark.parametrize("name", LOOP_CASES)
def test_compiled_loop_equals_python_loop(name):
    scheduler = CASES[name][0]
    steps = 6
    x, offsets, _ = _inputs(steps, np.float32, seed=2)
    key = jax.random.key(3)
    got = compiled_loop(scheduler, steps, jnp.asarray(x), jnp.asarray(offsets), key)
    ref = eager_loop(scheduler, steps, jnp.asarray(x), jnp.asarray(offsets), key)
    err = oracle.rel_error(got, ref)
    assert err <= TOL["float32"], f"{name}: compiled loop differs from the Python loop by {err:.3g}"


def test_loop_compiles_once_per_number_of_steps():
    """`steps` is static (the plan's length): one compilation per value, reused for
    any latents; a different number of steps compiles again."""
    scheduler = sampling.UniPC()
    key = jax.random.key(0)
    TRACES.clear()
    for seed in (0, 1):
        x, offsets, _ = _inputs(8, np.float32, seed=seed)
        compiled_loop(scheduler, 5, jnp.asarray(x), jnp.asarray(offsets), key)
    assert len(TRACES) == 1
    # An equal scheduler (hashable, equal fields) hits the same cache entry.
    compiled_loop(sampling.UniPC(shift=3.0), 5, jnp.asarray(x), jnp.asarray(offsets), key)
    assert len(TRACES) == 1
    compiled_loop(scheduler, 7, jnp.asarray(x), jnp.asarray(offsets), key)
    assert len(TRACES) == 2


def test_schedulers_are_static_pytrees():
    for name, (scheduler, _, _) in CASES.items():
        assert jax.tree_util.tree_leaves(scheduler) == [], name
        assert hash(scheduler) == hash(type(scheduler)(**{
            f: getattr(scheduler, f) for f in scheduler.__dataclass_fields__})), name
    assert [s.stochastic for s in (sampling.FlowMatchEuler(), sampling.UniPC(),
                                   sampling.CogVideoXDDIM(), sampling.CogVideoXDPM())] == [
        False, False, False, True]


def test_dtypes():
    """A step returns the latents' dtype and computes (and keeps its state) in at least
    float32."""
    latents = jnp.ones(SHAPE, jnp.bfloat16)
    for scheduler in (sampling.FlowMatchEuler(), sampling.UniPC(), sampling.CogVideoXDDIM(),
                      sampling.CogVideoXDPM()):
        plan, state = scheduler.plan(3), scheduler.init(latents)
        assert state.history.dtype == jnp.float32
        out, state = scheduler.step(plan, state, 0, jnp.ones(SHAPE, jnp.float32), latents,
                                    key=jax.random.key(0))
        assert out.dtype == jnp.bfloat16 and state.history.dtype == jnp.float32
        assert plan.timesteps.dtype == plan.sigmas.dtype == jnp.float32
        out, _ = scheduler.step(plan, scheduler.init(latents.astype(jnp.float32)), 0,
                                jnp.ones(SHAPE, jnp.bfloat16), latents.astype(jnp.float32),
                                key=jax.random.key(0))
        assert out.dtype == jnp.float32


def test_dpm_noise_from_key():
    scheduler = sampling.CogVideoXDPM()
    plan = scheduler.plan(4)
    x = jnp.asarray(_inputs(1, np.float32)[0])
    state = scheduler.init(x)
    step = functools.partial(scheduler.step, plan, state)
    a, _ = step(1, x, x, key=jax.random.key(0))
    b, _ = step(1, x, x, key=jax.random.key(0))
    c, _ = step(1, x, x, key=jax.random.key(1))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    # The drawn noise is the step's `noise` argument.
    noise = jax.random.normal(jax.random.key(0), x.shape, jnp.float32)
    np.testing.assert_array_equal(a, step(1, x, x, noise=noise)[0])
    # The last step adds none: its output is the data prediction.
    d, _ = step(3, x, x, key=jax.random.key(0))
    e, _ = step(3, x, x, key=jax.random.key(1))
    np.testing.assert_array_equal(d, e)


# -- 4. bad input ---------------------------------------------------------------------

BAD = [
    (lambda: sampling.FlowMatchEuler().plan(0), ValueError, r"`steps`.*>= 1.*received 0"),
    (lambda: sampling.UniPC().plan(-2), ValueError, r"`steps`.*>= 1.*received -2"),
    (lambda: sampling.UniPC().plan(4.0), TypeError, r"`steps`.*int.*received 4\.0"),
    (lambda: sampling.UniPC().plan(True), TypeError, r"`steps`.*int.*received True"),
    (lambda: sampling.CogVideoXDDIM().plan(1001), ValueError,
     r"`steps`.*at most num_train_timesteps=1000.*received 1001"),
    (lambda: sampling.FlowMatchEuler(shift=0.0), ValueError, r"`shift`.*> 0.*received 0\.0"),
    (lambda: sampling.UniPC(shift=-3.0), ValueError, r"`shift`.*> 0.*received -3\.0"),
    (lambda: sampling.UniPC(shift=float("nan")), ValueError, r"`shift`.*finite.*received nan"),
    (lambda: sampling.UniPC(shift="3"), TypeError, r"`shift`.*number.*received '3'"),
    (lambda: sampling.FlowMatchEuler(num_train_timesteps=0), ValueError,
     r"`num_train_timesteps`.*>= 1.*received 0"),
    (lambda: sampling.UniPC(solver_order=0), ValueError, r"`solver_order`.*>= 1.*received 0"),
    (lambda: sampling.UniPC(solver_type="bh3"), ValueError,
     r"`solver_type`.*\['bh1', 'bh2'\].*received 'bh3'"),
    (lambda: sampling.UniPC(final_sigmas_type="one"), ValueError,
     r"`final_sigmas_type`.*'sigma_min', 'zero'.*received 'one'"),
    (lambda: sampling.UniPC(lower_order_final=1), TypeError, r"`lower_order_final`.*True or False.*received 1"),
    (lambda: sampling.UniPC(disable_corrector=[-1]), ValueError, r"`disable_corrector.*>= 0.*received -1"),
    (lambda: sampling.UniPC(disable_corrector=3), TypeError, r"`disable_corrector`.*list.*received 3"),
    # Configurations whose update divides by zero (diffusers returns NaN / inf).
    (lambda: sampling.UniPC(lower_order_final=False).plan(10), ValueError,
     r"lower_order_final=False.*divides by zero in step\(s\) \[9\]"),
    (lambda: sampling.UniPC(solver_type="bh1").plan(10), ValueError,
     r"solver_type='bh1'.*divides by zero in step\(s\) \[9\]"),
    (lambda: sampling.CogVideoXDDIM(prediction_type="epsilon").plan(10), ValueError,
     r"prediction_type='epsilon'.*divides by zero in step\(s\) \[0\]"),
    (lambda: sampling.CogVideoXDDIM(prediction_type="x0"), ValueError,
     r"`prediction_type`.*'epsilon', 'sample', 'v_prediction'.*received 'x0'"),
    (lambda: sampling.CogVideoXDPM(timestep_spacing="uniform"), ValueError,
     r"`timestep_spacing`.*'leading', 'linspace', 'trailing'.*received 'uniform'"),
    (lambda: sampling.CogVideoXDPM(snr_shift_scale=0), ValueError, r"`snr_shift_scale`.*> 0.*received 0"),
    (lambda: sampling.CogVideoXDDIM(rescale_betas_zero_snr="yes"), TypeError,
     r"`rescale_betas_zero_snr`.*True or False.*received 'yes'"),
    # A step without its noise, or with another scheduler's state.
    (lambda: sampling.CogVideoXDPM().step(
        sampling.CogVideoXDPM().plan(4), sampling.CogVideoXDPM().init(jnp.ones(SHAPE)), 0,
        jnp.ones(SHAPE), jnp.ones(SHAPE)), ValueError, r"`key`.*or `noise`.*received neither"),
    (lambda: sampling.FlowMatchEuler().step(
        sampling.FlowMatchEuler().plan(4), sampling.UniPC().init(jnp.ones(SHAPE)), 0,
        jnp.ones(SHAPE), jnp.ones(SHAPE)), ValueError,
     r"`state.history` must have shape \(0, 1, 2, 2, 2, 4\).*received \(3, 1, 2, 2, 2, 4\)"),
    # The model output must have the latents' shape (jaxtyping, a TypeError).
    (lambda: sampling.UniPC().step(
        sampling.UniPC().plan(4), sampling.UniPC().init(jnp.ones(SHAPE)), 0,
        jnp.ones((2, 3)), jnp.ones(SHAPE)), TypeCheckError,
     r"`latents` must be a float array \(2, 3\); received float32 \(1, 2, 2, 2, 4\) \(shape = "
     r"\(2, 3\) as in `model_output`\)"),
]


@pytest.mark.parametrize("call,error,message", BAD, ids=range(len(BAD)))
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()
