"""Wan's text K/V cache: the blocks' cross-attention keys and values computed once
(`WanTransformer3D.text_cache`, `models.sharded_text_cache`) and taken by the model
(`text_cache=`, `sample`'s `Caching(text=...)`) instead of projecting the context every call, on tiny random models.

1. Cached and uncached calls give the same output bit for bit (`np.array_equal`): one
   device (T2V and I2V), and on 8 simulated devices through `run_sharded` (Ulysses x
   TP with data parallelism, and FSDP over the batch and over the sequence axis).
2. A gradient with respect to the model runs through the cached path; with the cache
   computed inside the differentiated function it equals the uncached gradient.
3. `sampling.sample` (which caches by default) gives the latents of `Caching(text=False)`
   (every step projecting the text) bit for bit, one device and sharded.
4. A cache of another model or context raises a ValueError naming `text_cache`.
5. Wan 2.2 A14B: each expert takes its own cache; sampling equals the uncached one
   bit for bit, one device and sharded.

The per-step time saved is measured by `benchmarks/text_cache.py`, not here.
"""

import dataclasses
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
from vidax_eqx import models, nn, sampling


# Bit-identity between two programs (see conftest's _elemental_emitters_when_fast): XLA's
# default CPU fusion emitters.
XLA_DEFAULT_EMITTERS = True


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
JIT = dict(compiler_options=harness.FAST_COMPILE)
ULYSSES_TP = nn.sharding.ParallelConfig(sequence="ulysses", tp_axis="tp")


def _model(name: str, seed: int):
    path = os.path.join(FIXTURES, "wan", name, "diffusers")
    return harness.perturbed(models.WanTransformer3D.from_pretrained(path), seed)


@pytest.fixture(scope="module")
def t2v():
    """`(model, (x, t, c))`: the `t2v` fixture perturbed, a batch of 2 (45 tokens each,
    a number no mesh here divides; 7 text tokens)."""
    model = _model("t2v", 1)
    rng = np.random.default_rng(2)
    x = jnp.asarray(harness.normal(rng, (2, 4, 3, 6, 10)))
    c = jnp.asarray(harness.normal(rng, (2, 7, model.config.text_dim)))
    return model, (x, jnp.array([700.0, 250.0]), c)


@pytest.fixture(scope="module")
def i2v():
    """`(model, (x, t, c, image))`: the `i2v` fixture perturbed, one example with 6
    image tokens."""
    model = _model("i2v", 3)
    c = model.config
    rng = np.random.default_rng(4)
    x = jnp.asarray(harness.normal(rng, (1, c.in_channels, 2, 4, 6)))
    text = jnp.asarray(harness.normal(rng, (1, 5, c.text_dim)))
    image = jnp.asarray(harness.normal(rng, (1, 6, c.image_dim)))
    return model, (x, jnp.array([600.0]), text, image)


@eqx.filter_jit(**JIT)
def _uncached(model, x, t, c, image=None):
    return jax.vmap(lambda x, t, c, i: model(x, t, c, context_image=i))(x, t, c, image)


@eqx.filter_jit(**JIT)
def _cached(model, x, t, c, image=None):
    cache = jax.vmap(lambda c, i: model.text_cache(c, context_image=i))(c, image)
    return jax.vmap(lambda x, t, c, i, k: model(x, t, c, context_image=i, text_cache=k))(
        x, t, c, image, cache)


@eqx.filter_jit(**JIT)
def _run_sharded(model, x, t, c, *, mesh, batch_axis, cached: bool):
    kwargs = {}
    if cached:
        kwargs["text_cache"] = models.sharded_text_cache(model, c, mesh=mesh,
                                                         batch_axis=batch_axis)
    return models.run_sharded(model, x, t, c, mesh=mesh, batch_axis=batch_axis, **kwargs)


def _assert_identical(got, ref):
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert np.array_equal(got, ref), f"max |diff| {np.max(np.abs(got - ref))}"


# -- 1. bit for bit ----------------------------------------------------------------------


def test_cache_layout(t2v, i2v):
    model, (_, _, c) = t2v
    cfg = model.config
    cache = model.text_cache(c[0])
    assert cache.k.shape == cache.v.shape == (cfg.num_layers, 7, cfg.num_heads, cfg.head_dim)
    assert cache.k_img is None and cache.v_img is None
    model, (_, _, c, image) = i2v
    cache = model.text_cache(c[0], context_image=image[0])
    assert cache.k_img.shape == (model.config.num_layers, 6, model.config.num_heads,
                                 model.config.head_dim)
    # The keys and values differ between layers and are not the context's embedding.
    assert not np.array_equal(cache.k[0], cache.k[1])


def test_one_device_t2v(t2v):
    model, (x, t, c) = t2v
    _assert_identical(_cached(model, x, t, c), _uncached(model, x, t, c))


def test_one_device_i2v(i2v):
    model, args = i2v
    _assert_identical(_cached(model, *args), _uncached(model, *args))


@pytest.mark.parametrize("fsdp_axes", [
    (), pytest.param(("dp",), marks=pytest.mark.slow), pytest.param(("sp",), marks=pytest.mark.slow),
], ids=["no_fsdp", "fsdp_dp", "fsdp_sp"])
def test_sharded_ulysses_tp(t2v, fsdp_axes):
    """dp 2 x sp 2 x tp 2: the cache holds each device's heads (TP-sharded `norm_k`),
    computed and placed as the model runs; under FSDP its weights are gathered."""
    model, (x, t, c) = t2v
    mesh = harness.mesh(dp=2, sp=2, tp=2)
    model = nn.sharding.with_parallel(model, dataclasses.replace(ULYSSES_TP, fsdp_axes=fsdp_axes))
    run = lambda cached: _run_sharded(model, x, t, c, mesh=mesh, batch_axis="dp",  # noqa: E731
                                      cached=cached)
    _assert_identical(run(True), run(False))


def test_sharded_cache_is_the_global_cache(t2v):
    """The global array `sharded_text_cache` returns is the one-device cache (heads in
    order); one-device and sharded `norm_k` sum in different orders, hence allclose."""
    model, (_, _, c) = t2v
    mesh = harness.mesh(dp=2, sp=2, tp=2)
    sharded = models.sharded_text_cache(nn.sharding.with_parallel(model, ULYSSES_TP), c, mesh=mesh,
                                        batch_axis="dp")
    one = jax.vmap(model.text_cache)(c)
    for got, ref in ((sharded.k, one.k), (sharded.v, one.v)):
        assert harness.max_rel_error(got, ref) < 1e-5


# -- 2. gradients ------------------------------------------------------------------------


@pytest.mark.slow
def test_gradient_through_the_cache(t2v):
    model, (x, t, c) = t2v
    x, t, c = x[:1], t[:1], c[:1]

    def loss(model, cached):
        if cached:
            cache = jax.vmap(model.text_cache)(c)
            out = jax.vmap(lambda x, t, c, k: model(x, t, c, text_cache=k))(x, t, c, cache)
        else:
            out = jax.vmap(model)(x, t, c)
        return jnp.sum(out * x[:, :4])

    grad = eqx.filter_jit(eqx.filter_grad(loss), **JIT)
    got, ref = grad(model, True), grad(model, False)
    leaves = lambda g: jax.tree.leaves(eqx.filter(g, eqx.is_array))  # noqa: E731
    scale = max(float(np.max(np.abs(r))) for r in leaves(ref))
    for a, b in zip(leaves(got), leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale)
    # A cache given from outside is an input: the key/value weights get no gradient.
    cache = jax.vmap(model.text_cache)(c)
    outside = eqx.filter_jit(eqx.filter_grad(lambda m, cache: jnp.sum(
        jax.vmap(lambda x, t, c, k: m(x, t, c, text_cache=k))(x, t, c, cache) * x[:, :4])),
        **JIT)(model, cache)
    assert not np.any(outside.blocks.cross_attn.k.weight)
    assert np.any(outside.blocks.cross_attn.q.weight)


# -- 3. sampling -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sample_io(t2v):
    model, _ = t2v
    rng = np.random.default_rng(7)
    return dict(noise=harness.normal(rng, (1, 4, 3, 4, 6)),
                context=harness.normal(rng, (1, 6, model.config.text_dim)),
                negative_context=harness.normal(rng, (1, 6, model.config.text_dim)))


@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "sp_tp"])
def test_sample_equals_uncached(t2v, sample_io, sharded):
    model, _ = t2v
    kwargs = dict(steps=3, scheduler="unipc", guidance=sampling.Guidance(scale=5.0))
    if sharded:
        mesh = harness.mesh(sp=4, tp=2)
        model = nn.sharding.shard_module(nn.sharding.with_parallel(model, ULYSSES_TP), mesh)
        kwargs["placement"] = sampling.Placement(mesh=mesh)
    cached = sampling.sample(model, **sample_io, **kwargs)
    uncached = sampling.sample(model, **sample_io, caching=sampling.Caching(text=False), **kwargs)
    _assert_identical(cached, uncached)


def test_sample_cfg_axis_equals_uncached(t2v, sample_io):
    model, _ = t2v
    mesh = harness.mesh(sp=2, tp=2, cfg=2)
    model = nn.sharding.shard_module(nn.sharding.with_parallel(model, ULYSSES_TP), mesh)
    kwargs = dict(steps=2, scheduler="euler",
                  placement=sampling.Placement(mesh=mesh, cfg_axis="cfg"))
    _assert_identical(sampling.sample(model, **sample_io, **kwargs),
                      sampling.sample(model, **sample_io, caching=sampling.Caching(text=False),
                                      **kwargs))


# -- 4. bad inputs -----------------------------------------------------------------------


def _call(model, x, t, c, cache, image=None):
    return model(x[0], t[0], c[0], context_image=image, text_cache=cache)


def test_bad_caches(t2v, i2v):
    model, (x, t, c) = t2v
    cache = model.text_cache(c[0])
    # Another text length.
    with pytest.raises(ValueError, match="`text_cache`"):
        _call(model, x, t, c[:, :5], cache)
    # Another config (the I2V model: other layers' widths, an image part).
    other, (_, _, ci, image) = i2v
    with pytest.raises(ValueError, match="`text_cache`"):
        _call(model, x, t, c, other.text_cache(ci[0], context_image=image[0]))
    # A model with fewer heads.
    with pytest.raises(ValueError, match="`text_cache`"):
        _call(model, x, t, c, models.WanTextCache(cache.k[:, :, :4], cache.v[:, :, :4], None, None))
    # Another dtype.
    with pytest.raises(ValueError, match="`text_cache`"):
        _call(model, x, t, c, jax.tree.map(lambda a: a.astype(jnp.bfloat16), cache))
    # Not a cache: refused by the annotation's check (jaxtyping's TypeCheckError, a
    # TypeError naming the argument), or with JAXTYPING_DISABLE=1 by the model.
    with pytest.raises((TypeError, ValueError), match="text_cache"):
        _call(model, x, t, c, (cache.k, cache.v))
    # An I2V cache without its image part.
    _, (xi, ti, ci, image) = i2v
    good = other.text_cache(ci[0], context_image=image[0])
    with pytest.raises(ValueError, match="`text_cache`"):
        _call(other, xi, ti, ci, models.WanTextCache(good.k, good.v, None, None), image[0])


def test_sharded_cache_needs_a_wan_model():
    experts = object()
    with pytest.raises(NotImplementedError, match="sharded_text_cache"):
        models.sharded_text_cache(experts, None, mesh=harness.mesh(sp=2))


def test_cross_attention_context_kv_rules(t2v):
    model, (x, _, c) = t2v
    attn = jax.tree.map(lambda a: a[0] if eqx.is_array(a) else a, model.blocks).cross_attn
    h = jnp.ones((5, model.config.dim))
    ctx = jnp.ones((4, model.config.dim))
    kv = attn.project_context(ctx)
    np.testing.assert_array_equal(attn(h, context_kv=kv), attn(h, ctx))
    with pytest.raises(ValueError, match="`context_kv`"):
        attn(h, ctx, context_kv=kv)
    with pytest.raises(ValueError, match="`context_kv`"):
        attn(h, context_kv=(kv[0][:, :4], kv[1][:, :4], None, None))
    with pytest.raises(ValueError, match="`context`"):
        attn(h)


# -- 5. Wan 2.2 A14B ---------------------------------------------------------------------


@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "sp_tp_cfg"])
def test_experts_sample_equals_uncached(sharded):
    """Each expert takes its own cache (`WanExpertsTextCache`), on both sides of the
    boundary: the latents of `text_cache=False` bit for bit."""
    experts = models.WanExperts.from_pretrained(os.path.join(FIXTURES, "wan", "a14b", "diffusers"))
    c = experts.config
    rng = np.random.default_rng(8)
    io = dict(noise=harness.normal(rng, (1, c.out_channels, 3, 4, 6)),
              context=harness.normal(rng, (1, 6, c.text_dim)),
              negative_context=harness.normal(rng, (1, 6, c.text_dim)),
              steps=4, scheduler="euler", guidance=sampling.Guidance(scale=5.0, scale_2=3.0))
    cache = experts.text_cache(jnp.asarray(io["context"][0]))
    assert isinstance(cache, models.WanExpertsTextCache)
    assert not np.array_equal(cache.high_noise.k, cache.low_noise.k)  # their own weights
    if sharded:
        mesh = harness.mesh(sp=2, tp=2, cfg=2)
        experts = nn.sharding.shard_module(nn.sharding.with_parallel(experts, ULYSSES_TP), mesh)
        io.update(placement=sampling.Placement(mesh=mesh, cfg_axis="cfg"))
    _assert_identical(sampling.sample(experts, **io),
                      sampling.sample(experts, **io, caching=sampling.Caching(text=False)))
