"""Image-to-video sampling (`sample(condition=...)`) on the tiny random fixtures,
against a denoising loop written here step by step after diffusers'
`WanImageToVideoPipeline` and `CogVideoXImageToVideoPipeline` (a Python loop of
model calls and `scheduler.step`, the schedulers being checked against diffusers in
`tests/test_schedulers.py`):

1. Wan 2.1 I2V: the condition concatenated along the channels before every call,
   the CLIP features as `context_image` in both guidance halves; one device, and
   sharded (Ulysses x TP, CFG over a mesh axis).
2. Wan 2.2 TI2V: the first latent frame replaced by the image's at every call, its
   tokens at timestep 0, and returned as it is.
3. CogVideoX I2V: the image latents concatenated along the channels, `(B, F, C, H, W)`.
4. Bad input: a missing or misshapen condition.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
from vidax_eqx import models, nn, sampling


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _wan(name):
    return models.WanTransformer3D.from_pretrained(os.path.join(FIXTURES, "wan", name, "diffusers"))


def _reference(model, noise, context, negative, *, steps, scheduler, scale, model_input,
               **kwargs):
    """The pipelines' loop: `model_input(latents, t) -> (x, timestep)`, one model call
    per half (conditional, unconditional), `uncond + scale * (cond - uncond)`."""
    plan, state, latents = scheduler.plan(steps), scheduler.init(noise), noise
    call = jax.jit(jax.vmap(lambda x, t, c, kw: model(x, t, c, **kw), in_axes=(0, None, 0, 0)))
    for i in range(steps):
        t = plan.timesteps[i]
        x, timestep = model_input(latents, t)
        cond = call(x, timestep, context, kwargs)
        uncond = call(x, timestep, negative, kwargs)
        latents, state = scheduler.step(plan, state, i, uncond + scale * (cond - uncond), latents)
    return latents


def _inputs(rng, noise_shape, text_shape):
    return (jnp.asarray(harness.normal(rng, noise_shape)),
            jnp.asarray(harness.normal(rng, text_shape)),
            jnp.asarray(harness.normal(rng, text_shape)))


# -- 1. Wan I2V --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def i2v():
    model = _wan("i2v")
    c = model.config
    rng = np.random.default_rng(0)
    noise, context, negative = _inputs(rng, (1, c.out_channels, 2, 4, 6), (1, 6, c.text_dim))
    condition = jnp.asarray(harness.normal(rng, (1, c.in_channels - c.out_channels, 2, 4, 6)))
    image = jnp.asarray(harness.normal(rng, (1, 5, c.image_dim)))
    return model, dict(noise=noise, context=context, negative_context=negative,
                       condition=condition, context_image=image)


def test_wan_i2v(i2v):
    model, io = i2v
    scheduler = sampling.UniPC(shift=3.0)
    got = sampling.sample(model, **io, steps=3, guidance=sampling.Guidance(scale=5.0),
                          scheduler=scheduler)
    ref = _reference(
        model, io["noise"], io["context"], io["negative_context"], steps=3,
        scheduler=scheduler, scale=5.0, context_image=io["context_image"],
        model_input=lambda x, t: (jnp.concatenate([x, io["condition"]], axis=1), t))
    assert harness.max_rel_error(got, ref) < 1e-5


def test_wan_i2v_sharded(i2v):
    model, io = i2v
    mesh = harness.mesh(dp=2, sp=2, tp=2)
    sharded = nn.sharding.shard_module(nn.sharding.with_parallel(
        model, nn.sharding.ParallelConfig(sequence="ulysses", tp_axis="tp")), mesh)
    kwargs = dict(steps=2, guidance=sampling.Guidance(scale=5.0), scheduler="euler")
    got = sampling.sample(sharded, **io, **kwargs,
                          placement=sampling.Placement(mesh=mesh, cfg_axis="dp"))
    assert harness.max_rel_error(got, sampling.sample(model, **io, **kwargs)) < 1e-5


# -- 2. Wan 2.2 TI2V ---------------------------------------------------------------------


def test_wan_ti2v_first_frame():
    model = _wan("ti2v")
    c = model.config
    rng = np.random.default_rng(1)
    noise, context, negative = _inputs(rng, (1, c.out_channels, 3, 4, 6), (1, 6, c.text_dim))
    image = jnp.asarray(harness.normal(rng, (1, c.out_channels, 1, 4, 6)))
    scheduler = sampling.UniPC(shift=5.0)
    got = sampling.sample(model, noise, context, negative_context=negative, condition=image,
                          steps=3, guidance=sampling.Guidance(scale=5.0), scheduler=scheduler)
    # diffusers: (1 - mask) * condition + mask * latents, timestep mask[0, 0, :, ::2, ::2] * t
    mask = jnp.ones((1, 1, 3, 4, 6)).at[:, :, 0].set(0.0)

    def model_input(latents, t):
        timestep = (mask[0, 0][:, ::2, ::2] * t).reshape(-1)
        return (1 - mask) * image + mask * latents, timestep

    ref = _reference(model, noise, context, negative, steps=3, scheduler=scheduler, scale=5.0,
                     model_input=model_input)
    ref = (1 - mask) * image + mask * ref
    assert harness.max_rel_error(got, ref) < 1e-5
    np.testing.assert_array_equal(got[:, :, :1], image)  # the image's frame, clean


# -- 3. CogVideoX I2V --------------------------------------------------------------------


def test_cogvideox_i2v():
    model = models.CogVideoXTransformer3D.from_pretrained(
        os.path.join(FIXTURES, "cogvideox", "5b_i2v", "diffusers"))
    c = model.config
    rng = np.random.default_rng(2)
    noise, context, negative = _inputs(rng, (1, 3, c.out_channels, 6, 8), (1, 5, c.text_embed_dim))
    # The image's latent frame, then zeros (CogVideoXImageToVideoPipeline's padding).
    image = jnp.asarray(harness.normal(rng, (1, 1, c.in_channels - c.out_channels, 6, 8)))
    condition = jnp.concatenate([image, jnp.zeros((1, 2, *image.shape[2:]))], axis=1)
    scheduler = sampling.CogVideoXDDIM()
    got = sampling.sample(model, noise, context, negative_context=negative, condition=condition,
                          steps=3, guidance=sampling.Guidance(scale=6.0), scheduler=scheduler)
    ref = _reference(model, noise, context, negative, steps=3, scheduler=scheduler, scale=6.0,
                     model_input=lambda x, t: (jnp.concatenate([x, condition], axis=2), t))
    assert harness.max_rel_error(got, ref) < 1e-5


# -- 4. bad input ------------------------------------------------------------------------


def test_bad_condition(i2v):
    model, io = i2v
    kwargs = dict(steps=1, scheduler="euler")
    missing = {k: v for k, v in io.items() if k != "condition"}
    with pytest.raises(ValueError, match="`condition` is required"):
        sampling.sample(model, **missing, **kwargs)
    with pytest.raises(ValueError, match=r"`condition`.*\(1, 8, 2, 4, 6\)"):
        sampling.sample(model, **{**io, "condition": io["condition"][:, :4]}, **kwargs)
    ti2v = _wan("ti2v")
    noise = jnp.zeros((1, 48, 3, 4, 6))
    context = jnp.zeros((1, 6, ti2v.config.text_dim))
    with pytest.raises(ValueError, match="F_c"):
        sampling.sample(ti2v, noise, context, guidance=sampling.Guidance(scale=1.0), **kwargs,
                        condition=jnp.zeros((1, 48, 4, 4, 6)))
    with pytest.raises(ValueError, match="out_channels"):
        sampling.sample(model, **{**io, "noise": jnp.zeros((1, 12, 2, 4, 6))}, **kwargs)
