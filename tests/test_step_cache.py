"""Step caching: a denoising step that reuses the block stack's residual of the last
step that ran it (`WanTransformer3D.cached_call`, `run_sharded(step_cache=...)`,
`sampling.sample(caching=Caching(step=...))`), on a tiny random Wan.

1. The decision's statistic, `sum |r - r_last| / sum |r_last|` over the real tokens
   and the whole batch, against a float64 NumPy oracle.
2. The model: a step that runs the blocks is `__call__` bit for bit; reusing the
   residual of the same input reproduces the output; reusing at another timestep
   skips the blocks (the output is not the exact one); the first-block rule reuses
   when the change is below the threshold and not otherwise; one `lax.cond`, under
   `jax.vmap` too.
3. Sharded (8 simulated devices: Ulysses x TP x data, ring, USP with FSDP, sliding
   tile): the same decisions as one device and outputs within 1e-5.
4. `sample`: no reuse is the uncached sampler bit for bit; a static schedule reuses
   exactly its steps; the first-block rule decides alike on one device and sharded;
   Wan 2.2 A14B's experts run every block at the first step after their switch.
5. Bad input.

The speed-up and the latents' difference are measured by `benchmarks/step_cache.py` on
a model trained by `examples/train_wan.py`, not here.
"""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
from vidax_eqx import models, nn, sampling
from vidax_eqx.models._step_cache import relative_change


# Bit-identity between two programs (see conftest's _elemental_emitters_when_fast): XLA's
# default CPU fusion emitters.
XLA_DEFAULT_EMITTERS = True


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
JIT = dict(compiler_options=harness.FAST_COMPILE)


@pytest.fixture(scope="module")
def t2v():
    """`(model, (x, t, c))`: the `t2v` fixture perturbed, a batch of 2 (45 tokens each,
    a number no mesh here divides, so the sharded runs pad)."""
    path = os.path.join(FIXTURES, "wan", "t2v", "diffusers")
    model = harness.perturbed(models.WanTransformer3D.from_pretrained(path), 1)
    rng = np.random.default_rng(2)
    x = jnp.asarray(harness.normal(rng, (2, 4, 3, 6, 10)))
    c = jnp.asarray(harness.normal(rng, (2, 7, model.config.text_dim)))
    return model, (x, jnp.array([700.0, 700.0]), c)


@eqx.filter_jit(**JIT)
def _cached(model, x, t, c, cache, may_reuse, threshold, **kwargs):
    """One device: `cached_call` over the batch (one decision for all), under one jit:
    a program per static configuration, shared by every test of the module."""
    return jax.vmap(lambda x, t, c, k: model.cached_call(
        x, t, c, k, may_reuse=may_reuse, threshold=threshold, axis_name="batch", **kwargs),
        axis_name="batch")(x, t, c, cache)


@eqx.filter_jit(**JIT)
def _sharded(model, x, t, c, cache, may_reuse, threshold, *, mesh, batch_axis, **kwargs):
    return models.run_sharded(model, x, t, c, mesh=mesh, batch_axis=batch_axis,
                              step_cache=cache, may_reuse=may_reuse, threshold=threshold,
                              **kwargs)


@eqx.filter_jit(**JIT)
def _plain(model, x, t, c):
    return jax.vmap(model)(x, t, c)


def _identical(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and np.array_equal(a, b), f"max |diff| {np.max(np.abs(a - b))}"


# -- 1. the statistic --------------------------------------------------------------------


def test_relative_change_oracle():
    rng = np.random.default_rng(0)
    new, old = rng.standard_normal((2, 2, 5, 3)), rng.standard_normal((2, 2, 5, 3))
    valid = np.array([True, True, True, False, False])
    got = jax.vmap(lambda n, o: relative_change(n, o, jnp.asarray(valid), "b"),
                   axis_name="b")(jnp.asarray(new[0], jnp.float32), jnp.asarray(old[0], jnp.float32))
    w = valid[None, :, None]
    ref = np.sum(np.abs(new[0] - old[0]) * w) / np.sum(np.abs(old[0]) * w)
    # One value for the whole batch (every example sees it), padding rows excluded.
    np.testing.assert_allclose(np.asarray(got), [ref, ref], rtol=1e-6)
    assert float(relative_change(jnp.ones((3, 2)), jnp.zeros((3, 2)), None, None)) == np.inf


# -- 2. one device -----------------------------------------------------------------------


def test_compute_is_the_model(t2v):
    model, (x, t, c) = t2v
    ref = _plain(model, x, t, c)
    for threshold in (None, jnp.float32(0.1)):
        out, cache = _cached(model, x, t, c, models.StepCache(), False, threshold)
        _identical(out, ref)
        assert cache.residual.shape == (2, 45, model.config.dim)
        assert not np.any(cache.reused)
        # A step that may reuse but whose rule says no runs the blocks: exact.
        out, _ = _cached(model, x, t * 0.5, c, cache, False, threshold)
        _identical(out, _plain(model, x, t * 0.5, c))


def test_static_reuse(t2v):
    model, (x, t, c) = t2v
    ref = _plain(model, x, t, c)
    _, cache = _cached(model, x, t, c, models.StepCache(), False, None)
    # The residual of this very input: the output again (up to rounding of h + r).
    out, again = _cached(model, x, t, c, cache, True, None)
    assert np.all(again.reused)
    assert harness.max_rel_error(out, ref) < 1e-5
    _identical(again.residual, cache.residual)
    # At another timestep the blocks are skipped: not the exact output.
    out, _ = _cached(model, x, t * 0.5, c, cache, True, None)
    exact = _plain(model, x, t * 0.5, c)
    assert harness.max_rel_error(out, exact) > 1e-3


def test_first_block_rule(t2v):
    model, (x, t, c) = t2v
    ref = _plain(model, x, t, c)
    _, cache = _cached(model, x, t, c, models.StepCache(), False, jnp.float32(0.1))
    # The same input: the first block's residual did not change, so the rest is reused.
    out, again = _cached(model, x, t, c, cache, True, jnp.float32(1e-6))
    assert np.all(again.reused) and harness.max_rel_error(out, ref) < 1e-5
    # Another input with a tiny threshold: it changed, the blocks run (exact).
    x2 = x * 0.7
    out, other = _cached(model, x2, t, c, cache, True, jnp.float32(1e-6))
    assert not np.any(other.reused)
    _identical(out, _plain(model, x2, t, c))
    # A huge threshold reuses anything; `may_reuse=False` still forces the blocks.
    assert np.all(_cached(model, x2, t, c, cache, True, jnp.float32(1e9))[1].reused)
    assert not np.any(_cached(model, x2, t, c, cache, False, jnp.float32(1e9))[1].reused)


def test_one_cond_under_vmap(t2v):
    """The decision is one value for the batch: `lax.cond` stays a cond under vmap
    (a batched predicate would turn it into a select that runs both branches)."""
    model, (x, t, c) = t2v
    _, cache = _cached(model, x, t, c, models.StepCache(), False, None)
    fn = lambda m, x, cache: _cached.__wrapped__(m, x, t, c, cache, True, jnp.float32(0.1))  # noqa: E731
    jaxpr = str(eqx.filter_make_jaxpr(fn)(model, x, cache)[0])
    # The platform's choices (`lax.platform_dependent`: RoPE's TPU form) are conds on
    # `platform_index`, not on data; the step cache's decision is the one other.
    before = [jaxpr[:i][-200:] for i in range(len(jaxpr)) if jaxpr.startswith("cond[", i)]
    decisions = [b for b in before if "platform_index[" not in b.splitlines()[-2]]
    assert len(decisions) == 1 and "select_n" not in decisions[0]


# -- 3. sharded --------------------------------------------------------------------------


SHARDED = {
    "ulysses_tp_dp": (dict(dp=2, sp=2, tp=2), nn.sharding.ParallelConfig(sequence="ulysses", tp_axis="tp"),
                      "dp", {}),
    "ring_tp_dp": (dict(dp=2, sp=2, tp=2), nn.sharding.ParallelConfig(sequence="ring", tp_axis="tp"),
                   "dp", {}),
    "usp_fsdp": (dict(sp=2, ring=2, tp=2), nn.sharding.ParallelConfig(
        sequence="usp", ring_axis="ring", tp_axis="tp", fsdp_axes=("sp", "ring")), None, {}),
    "sliding_tile_ring": (dict(dp=2, sp=2, tp=2), nn.sharding.ParallelConfig(sequence="ring", tp_axis="tp"),
                          "dp", dict(attention=models.SlidingTile((1, 2, 2), (1, 3, 3)))),
}


@pytest.mark.parametrize("name", [
    "ulysses_tp_dp", pytest.param("ring_tp_dp", marks=pytest.mark.slow),
    pytest.param("usp_fsdp", marks=pytest.mark.slow),
    pytest.param("sliding_tile_ring", marks=pytest.mark.slow)])
def test_sharded_matches_one_device(t2v, name):
    """Three steps: a fresh cache, the same input (reused: the change is exactly 0 on
    every device), another input (run): the decisions of one device, outputs to 1e-5."""
    model, (x, t, c) = t2v
    axes, parallel, batch_axis, kwargs = SHARDED[name]
    mesh = harness.mesh(**axes)
    sharded = nn.sharding.with_parallel(model, parallel)
    run = lambda x, cache, may, thr: _sharded(  # noqa: E731
        sharded, x, t, c, cache, may, thr, mesh=mesh, batch_axis=batch_axis, **kwargs)
    one = lambda x, cache, may, thr: _cached(  # noqa: E731
        model, x, t, c, cache, may, thr, **kwargs)
    threshold = jnp.float32(1e-6)
    got, ref = models.StepCache(), models.StepCache()
    for x_i, may in ((x, False), (x, True), (x * 0.7, True)):
        out, got = run(x_i, got, may, threshold)
        expected, ref = one(x_i, ref, may, threshold)
        assert harness.max_rel_error(out, expected) < 1e-5
        _identical(got.reused, ref.reused)
    assert [bool(r) for r in (got.reused[0],)] == [False]


# -- 4. sample ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sample_io(t2v):
    model, _ = t2v
    rng = np.random.default_rng(7)
    return dict(noise=harness.normal(rng, (1, 4, 3, 4, 6)),
                context=harness.normal(rng, (1, 6, model.config.text_dim)),
                negative_context=harness.normal(rng, (1, 6, model.config.text_dim)),
                steps=5, scheduler="unipc")


def test_sample_without_reuse_is_exact(t2v, sample_io):
    model, _ = t2v
    ref = sampling.sample(model, **sample_io)
    for rule in (sampling.StaticStepCache(interval=1), sampling.FirstBlockCache(1e-9)):
        out, reused = harness.sample_reused(model, **sample_io,
                                            caching=sampling.Caching(step=rule))
        assert not np.any(reused)
        _identical(out, ref)


def test_sample_static_schedule(t2v, sample_io):
    model, _ = t2v
    rule = sampling.StaticStepCache(interval=2, warmup=2, cooldown=1)
    np.testing.assert_array_equal(rule.mask(5), [False, False, False, True, False])
    np.testing.assert_array_equal(rule.mask(8), [0, 0, 0, 1, 0, 1, 0, 0])
    out, reused = harness.sample_reused(model, **sample_io, caching=sampling.Caching(step=rule))
    np.testing.assert_array_equal(reused, rule.mask(5))
    ref = sampling.sample(model, **sample_io)
    assert 0 < harness.max_rel_error(out, ref) < 1.0
    explicit = sampling.sample(model, **sample_io,
                               caching=sampling.Caching(step=sampling.StaticStepCache(reuse=(3,))))
    _identical(explicit, out)


def test_sample_first_block_sharded(t2v, sample_io):
    """A threshold the random model's changes straddle: some steps reuse, and the
    sharded sampler reuses the same ones (one decision reduced over every device)."""
    model, _ = t2v
    rule = sampling.FirstBlockCache(1.5)
    out, reused = harness.sample_reused(model, **sample_io, caching=sampling.Caching(step=rule))
    assert 0 < int(np.sum(reused)) < 4
    mesh = harness.mesh(dp=2, sp=2, tp=2)
    sharded = nn.sharding.shard_module(nn.sharding.with_parallel(
        model, nn.sharding.ParallelConfig(sequence="ulysses", tp_axis="tp")), mesh)
    got, got_reused = harness.sample_reused(
        sharded, **sample_io, caching=sampling.Caching(step=rule),
        placement=sampling.Placement(mesh=mesh, cfg_axis="dp"))
    np.testing.assert_array_equal(got_reused, reused)
    assert harness.max_rel_error(got, out) < 1e-5


def test_sample_experts(sample_io):
    """Wan 2.2 A14B: the experts share one cache, and the first step after the switch
    of experts runs every block (the residual there is the other expert's)."""
    experts = models.WanExperts.from_pretrained(os.path.join(FIXTURES, "wan", "a14b", "diffusers"))
    io = dict(sample_io, steps=6, scheduler="euler")
    high = np.asarray(sampling.FlowMatchEuler(shift=3.0).plan(6).timesteps) >= \
        experts.boundary_timestep
    switch = int(np.argmax(high[1:] != high[:-1])) + 1
    assert 1 < switch < 5  # the fixture's boundary falls inside the schedule
    everything = sampling.StaticStepCache(reuse=(1, 2, 3, 4, 5))
    _, reused = harness.sample_reused(experts, **io, caching=sampling.Caching(step=everything))
    expected = np.ones(6, bool)
    expected[[0, switch]] = False
    np.testing.assert_array_equal(reused, expected)
    # No reuse: the uncached sampler bit for bit.
    out = sampling.sample(experts, **io,
                          caching=sampling.Caching(step=sampling.StaticStepCache(interval=1)))
    _identical(out, sampling.sample(experts, **io))


# -- 5. bad input ------------------------------------------------------------------------


def test_bad_input(t2v, sample_io):
    model, _ = t2v
    with pytest.raises(ValueError, match="`step` must be None"):
        sampling.Caching(step=0.1)
    with pytest.raises(ValueError, match=r"reuse.*\[1, 5\)"):
        sampling.sample(model, **sample_io,
                        caching=sampling.Caching(step=sampling.StaticStepCache(reuse=(0, 2))))
    with pytest.raises(ValueError, match="threshold"):
        sampling.FirstBlockCache(0.0)
    with pytest.raises(ValueError, match="warmup"):
        sampling.StaticStepCache(warmup=0)
    with pytest.raises(NotImplementedError, match="cached_call"):
        sampling.sample(lambda x, t, c: x, **sample_io,
                        caching=sampling.Caching(step=sampling.StaticStepCache()))
    x, t, c = t2v[1]
    with pytest.raises(ValueError, match="step_cache"):
        model.cached_call(x[0], t[0], c[0], models.StepCache(jnp.zeros((3, 64)),
                                                              jnp.zeros((3, 64)),
                                                              jnp.asarray(False)))


# -- 6. MagCache: a schedule from calibrated magnitude ratios -----------------------------


def test_magcache_schedule():
    # Worked by hand: from step max(1, int(0.25 * 8)) = 2 on, the running ratio and the
    # summed |1 - ratio|: step 2 (0.97, 0.03) reuses; step 3 (0.9603, 0.0697 > 0.06)
    # runs and restarts; 4 (1.0, 0) reuses; 5 (0.9, 0.1) runs; 6 (0.95, 0.05) reuses;
    # 7 (0.969, 0.081) runs.
    ratios = (1.0, 0.98, 0.97, 0.99, 1.0, 0.9, 0.95, 1.02)
    rule = sampling.MagCache(ratios, max_error=0.06, max_skip=2, retention=0.25)
    np.testing.assert_array_equal(rule.mask(8), [0, 0, 1, 0, 1, 0, 1, 0])
    # At most max_skip steps in a row; the cooldown runs.
    flat = sampling.MagCache((1.0,) * 8, max_error=1.0, max_skip=2, retention=0.0, cooldown=1)
    np.testing.assert_array_equal(flat.mask(8), [0, 1, 1, 0, 1, 1, 0, 0])
    # Another step count takes each step's nearest calibrated ratio.
    np.testing.assert_array_equal(rule.step_ratios(4), [1.0, 0.97, 0.9, 1.02])


def test_magcache_calibrated_and_sampled(t2v, sample_io, tmp_path):
    from vidax_eqx.sampling._loop import denoising_loop
    from vidax_eqx.sampling._sample import prepare

    model, _ = t2v
    rule = sampling.calibrate_magcache(model, **sample_io, max_error=0.5, retention=0.2)
    assert len(rule.ratios) == 5 and rule.ratios[0] == 1.0 and rule.max_error == 0.5
    # The ratios are the loop's residual norms, step over step; the first norm is the
    # block stack's residual of the guided batch at the first timestep (cached_call).
    caching = sampling.Caching(step=sampling.StaticStepCache(interval=1))
    inputs, options = prepare(
        "test", model, sample_io["noise"], sample_io["context"],
        negative_context=sample_io["negative_context"], steps=5, scheduler="unipc",
        guidance=sampling.Guidance(), placement=sampling.Placement(), caching=caching,
        compilation=sampling.Compilation(), condition=None, key=None, model_kwargs={})
    norms = np.asarray(denoising_loop(inputs, options).residual_norms, np.float64)
    np.testing.assert_allclose(rule.ratios[1:], norms[1:] / norms[:-1], rtol=1e-6)
    x = jnp.concatenate([sample_io["noise"]] * 2)
    c = jnp.concatenate([sample_io["context"], sample_io["negative_context"]])
    t0 = options.scheduler.timestep(options.scheduler.plan(5), 0)  # the loop's own scheduler
    _, cache = _cached(model, x, jnp.full((2,), t0), c, models.StepCache(), False, None)
    residual = np.asarray(cache.residual, np.float64)
    np.testing.assert_allclose(norms[0], np.sqrt(np.sum(residual ** 2)), rtol=1e-5)
    # Sampling with the rule reuses exactly its mask's steps; saved and loaded, the same.
    out, reused = harness.sample_reused(model, **sample_io, caching=sampling.Caching(step=rule))
    np.testing.assert_array_equal(reused, rule.mask(5))
    assert reused.any() and np.isfinite(np.asarray(out)).all()
    rule.save(tmp_path / "magcache.json")
    assert sampling.MagCache.load(tmp_path / "magcache.json") == rule
    with pytest.raises(ValueError, match="is not a MagCache file"):
        (tmp_path / "other.json").write_text('{"class": "StaticStepCache"}')
        sampling.MagCache.load(tmp_path / "other.json")
    with pytest.raises(ValueError, match="`ratios` must be a non-empty tuple of positive"):
        sampling.MagCache(())
    with pytest.raises(ValueError, match="max_error"):
        sampling.MagCache((1.0,), max_error=0.0)
    with pytest.raises(ValueError, match=r"`retention` .* must be in \[0, 1\]; received 1.5"):
        sampling.MagCache((1.0,), retention=1.5)
