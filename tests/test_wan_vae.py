"""`models.WanVAE`: Wan 2.1's and 2.2's VAE against diffusers' `AutoencoderKLWan`
(fixtures of `scripts/make_vae_fixtures.py`: encode's posterior and decode at two frame
counts each, the tiled mode), chunk sizes, bfloat16, the original Wan names, the frames
split over 8 simulated devices against one device (forward and gradients), the causal
convolution's chunked caches against a float64 NumPy convolution of the whole video, and
bad input."""

import dataclasses
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
from vidax_eqx import models, nn
from vidax_eqx.models import Tiling, WanVAE, WanVAEConfig
from vidax_eqx.models.internal import vae_jit, vae_program


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "wan_vae")
TOL = 1e-5  # float32 relative error in norm, against diffusers


def rel(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module", params=["wan21", "wan22"])
def case(request):
    root = os.path.join(FIXTURES, request.param)
    return request.param, WanVAE.from_pretrained(os.path.join(root, "diffusers")), harness.load_io(
        os.path.join(root, "io.npz"))


@pytest.mark.parametrize("frames", [5, 9])
def test_encode_matches_diffusers(case, frames):
    name, vae, io = case
    post = vae.encode(jnp.asarray(io[f"video_{frames}"]))
    assert post.mean.shape == io[f"mean_{frames}"].shape
    assert rel(post.mean, io[f"mean_{frames}"]) < TOL, name
    assert rel(post.logvar, io[f"logvar_{frames}"]) < TOL, name


@pytest.mark.parametrize("frames", [2, 3])
def test_decode_matches_diffusers(case, frames):
    name, vae, io = case
    out = vae.decode(jnp.asarray(io[f"latents_{frames}"]))
    assert out.shape == io[f"decoded_{frames}"].shape == (3, 1 + 4 * (frames - 1), *out.shape[2:])
    assert rel(out, io[f"decoded_{frames}"]) < TOL, name


def test_chunks_change_nothing(case):
    """Two latent frames per scan step (the last step padded with a zero frame) and three
    give diffusers' numbers too."""
    name, vae, io = case
    assert rel(vae.decode(jnp.asarray(io["latents_3"]), chunk=2), io["decoded_3"]) < TOL, name
    post = vae.encode(jnp.asarray(io["video_9"]), chunk=3)
    assert rel(post.mean, io["mean_9"]) < TOL, name


def test_tiled_mode_matches_diffusers(case):
    name, vae, io = case
    tiling = Tiling(*(int(v) for v in io["tiling"]))
    post = vae.encode(jnp.asarray(io["video_tiled"]), tiling=tiling)
    assert rel(post.mean, io["mean_tiled"]) < TOL, name
    assert rel(post.logvar, io["logvar_tiled"]) < TOL, name
    assert rel(vae.decode(jnp.asarray(io["latents_tiled"]), tiling=tiling), io["decoded_tiled"]) < TOL, name


def test_bfloat16(case):
    name, vae, io = case
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx_array(a) else a, vae)
    out = half.decode(jnp.asarray(io["latents_2"], jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    assert rel(out, io["decoded_2"]) < 2e-2, name
    post = half.encode(jnp.asarray(io["video_5"], jnp.bfloat16))
    assert rel(post.mean, io["mean_5"]) < 2e-2, name


def eqx_array(a) -> bool:
    return isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.floating)


def test_posterior_sample_and_statistics(case):
    name, vae, io = case
    post = vae.encode(jnp.asarray(io["video_5"]))
    a, b = post.sample(jax.random.key(0)), post.sample(jax.random.key(0))
    np.testing.assert_array_equal(a, b)
    noise = (np.asarray(a) - np.asarray(post.mean)) / np.asarray(post.std)
    assert abs(noise.mean()) < 0.2 and 0.7 < noise.std() < 1.3
    z = jnp.asarray(io["latents_2"])
    np.testing.assert_allclose(vae.denormalize_latents(vae.normalize_latents(z)), z, atol=1e-5)
    assert vae.latents_mean.shape == (vae.config.z_dim,)


@pytest.mark.parametrize("name", ["wan21", "wan22"])
def test_original_wan_names(name):
    """The original Wan releases' tensor names (Wan 2.1's flat sequences, Wan 2.2's
    per-level blocks) load to the same model."""
    root = os.path.join(FIXTURES, name)
    io = harness.load_io(os.path.join(root, "io.npz"))
    config = WanVAEConfig.from_file(os.path.join(root, "diffusers", "config.json"))
    file = "Wan2.2_VAE.safetensors" if config.is_residual else "Wan2.1_VAE.safetensors"
    vae = WanVAE.from_pretrained(os.path.join(root, "wan", file), config=config)
    ref = WanVAE.from_pretrained(os.path.join(root, "diffusers"))
    for a, b in zip(jax.tree.leaves(vae), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(a, b)


def test_save_pretrained(tmp_path):
    """save_pretrained writes diffusers' names and config, which load back."""
    root = os.path.join(FIXTURES, "wan21")
    config = WanVAEConfig.from_file(os.path.join(root, "diffusers", "config.json"))
    vae = WanVAE.from_pretrained(os.path.join(root, "diffusers"))
    vae.save_pretrained(tmp_path)
    from safetensors.numpy import load_file
    saved = load_file(os.path.join(tmp_path, "diffusion_pytorch_model.safetensors"))
    theirs = load_file(os.path.join(root, "diffusers", "diffusion_pytorch_model.safetensors"))
    assert set(saved) == set(theirs)
    for k in theirs:
        np.testing.assert_array_equal(saved[k], theirs[k])
    assert WanVAEConfig.from_file(os.path.join(tmp_path, "config.json")) == config


# -- the streaming decode ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["wan21", "wan22"])
def test_decode_stream_equals_the_whole_decode(name):
    """Latents decoded in chunks of 2, 1 and 2 latent frames, the decoder's time caches
    carried across the calls: the frames of `decode` on all five at once (1 + 4 (2 - 1)
    frames first, then 4 per latent frame); the state is refused when it is not one."""
    vae = WanVAE.from_pretrained(os.path.join(FIXTURES, name, "diffusers"))
    z = jax.random.normal(jax.random.key(0), (vae.z_dim, 5, 4, 6))
    with jax.default_matmul_precision("highest"):
        whole = vae.decode(z)
        parts, state = [], None
        for a, b in ((0, 2), (2, 3), (3, 5)):
            video, state = vae.decode_stream(z[:, a:b], state)
            parts.append(video)
    assert [p.shape[1] for p in parts] == [5, 4, 8]
    assert rel(jnp.concatenate(parts, axis=1), whole) < TOL
    with pytest.raises(ValueError, match=r"`state` must be None \(the first chunk\) or the DecodeStream"):
        vae.decode_stream(z[:, :1], {"cache": 0})


# -- the frames split over a mesh --------------------------------------------------------

@pytest.fixture(scope="module")
def wan21():
    return WanVAE.from_pretrained(os.path.join(FIXTURES, "wan21", "diffusers"))


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_split_decode_equals_one_device(wan21, shape):
    mesh = jax.make_mesh(shape, ("h", "w"))
    z = jax.random.normal(jax.random.key(0), (wan21.config.z_dim, 3, 4, 8))
    out = wan21.decode(z, mesh=mesh, spatial_axes=("h", "w"))
    assert out.sharding.spec == jax.sharding.PartitionSpec(None, None, "h", "w")
    assert rel(out, wan21.decode(z)) < TOL


def test_split_encode_equals_one_device_wan22():
    vae = WanVAE.from_pretrained(os.path.join(FIXTURES, "wan22", "diffusers"))
    mesh = jax.make_mesh((2, 4), ("h", "w"))
    video = jax.random.uniform(jax.random.key(1), (3, 5, 32, 64), minval=-1, maxval=1)
    ref = vae.encode(video)
    post = vae.encode(video, mesh=mesh, spatial_axes=("h", "w"))
    assert rel(post.mean, ref.mean) < TOL and rel(post.logvar, ref.logvar) < TOL


def test_split_over_one_axis_and_gradients(wan21):
    """Height only, the width whole: the decode and its gradient with respect to the
    latents equal one device's."""
    mesh = jax.make_mesh((2, 4), ("h", "w"))
    z = jax.random.normal(jax.random.key(2), (wan21.config.z_dim, 2, 4, 2))
    cot = jax.random.normal(jax.random.key(3), (3, 5, 32, 16))

    def loss(z, **kw):
        return jnp.sum(wan21.decode(z, **kw) * cot)

    g_one = jax.grad(loss)(z)
    with jax.set_mesh(mesh):  # the split decode's output lives on the mesh
        g_split = jax.grad(lambda z: loss(z, mesh=mesh, spatial_axes=("h", None)))(z)
    assert rel(g_split, g_one) < TOL


# -- the causal convolution's caches -----------------------------------------------------

def _causal_conv_f64(x, w, b):
    """float64: `x (C, T, H, W)` zero-padded by kt - 1 frames before and (kh // 2,
    kw // 2) around, convolved (cross-correlation) with `w (O, C, kt, kh, kw)`."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    kt, kh, kw = w.shape[2:]
    xp = np.pad(x, ((0, 0), (kt - 1, 0), (kh // 2, kh // 2), (kw // 2, kw // 2)))
    t, h, wd = x.shape[1:]
    out = np.zeros((w.shape[0], t, h, wd)) + np.asarray(b, np.float64)[:, None, None, None]
    for a in range(kt):
        for i in range(kh):
            for j in range(kw):
                out += np.einsum("oc,cthw->othw", w[:, :, a, i, j], xp[:, a:a + t, i:i + h, j:j + wd])
    return out


def test_causal_conv_chunks_equal_the_whole_video():
    conv = nn.CausalConv3d(3, 4, 3, padding=1, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (3, 7, 5, 6))
    want = _causal_conv_f64(x, conv.weight, conv.bias)
    pieces, cache = [], None
    for start, stop in ((0, 1), (1, 3), (3, 7)):
        y, cache = conv(x[:, start:stop], cache)
        pieces.append(y)
    got = np.concatenate(pieces, axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert cache.shape == (3, 2, 5, 6)


# -- bad input -----------------------------------------------------------------------------

def test_bad_input(wan21):
    z_dim = wan21.config.z_dim
    mesh = jax.make_mesh((2, 4), ("h", "w"))
    with pytest.raises(ValueError, match=r"`video` must have 1 \+ 4k frames.*received 6 frames"):
        wan21.encode(jnp.zeros((3, 6, 16, 16)))
    with pytest.raises(ValueError, match=r"multiples of the VAE's spatial factor 8; received 12 x 16"):
        wan21.encode(jnp.zeros((3, 5, 12, 16)))
    with pytest.raises(ValueError, match=r"`video` must have 3 channels"):
        wan21.encode(jnp.zeros((4, 5, 16, 16)))
    with pytest.raises(ValueError, match=rf"`latents` must have z_dim = {z_dim} channels"):
        wan21.decode(jnp.zeros((z_dim + 1, 2, 2, 2)))
    with pytest.raises(ValueError, match=r"one example \(C, F, H, W\)"):
        wan21.decode(jnp.zeros((1, z_dim, 2, 2, 2)))
    with pytest.raises(ValueError, match=r"latents's width 6 cannot be split over mesh axis 'w' of size 4"):
        wan21.decode(jnp.zeros((z_dim, 2, 2, 6)), mesh=mesh, spatial_axes=("h", "w"))
    with pytest.raises(ValueError, match=r"video's height 16 cannot be split over mesh axis 'h'"):
        wan21.encode(jnp.zeros((3, 5, 16, 64)), mesh=jax.make_mesh((4, 2), ("h", "w")),
                     spatial_axes=("h", "w"))
    with pytest.raises(ValueError, match=r"'x' of `spatial_axes` is not an axis of `mesh`"):
        wan21.decode(jnp.zeros((z_dim, 2, 2, 4)), mesh=mesh, spatial_axes=("x", "w"))
    with pytest.raises(ValueError, match=r"`spatial_axes` must be \(height_axis, width_axis\)"):
        wan21.decode(jnp.zeros((z_dim, 2, 2, 4)), mesh=mesh, spatial_axes="h")
    with pytest.raises(ValueError, match=r"`chunk` .* must be an int >= 1; received 0"):
        wan21.decode(jnp.zeros((z_dim, 2, 2, 4)), chunk=0)
    with pytest.raises(ValueError, match=r"`tiling` runs on one device"):
        wan21.decode(jnp.zeros((z_dim, 2, 2, 4)), mesh=mesh, spatial_axes=("h", "w"), tiling=Tiling())
    with pytest.raises(ValueError, match=r"unknown config keys \['bogus'\]"):
        WanVAEConfig.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match=r"`temperal_downsample` must be 3 flags"):
        WanVAEConfig(temperal_downsample=(True,))


def test_checkpoint_that_disagrees_with_its_config_names_the_tensor():
    root = os.path.join(FIXTURES, "wan22", "diffusers")
    config = WanVAEConfig.from_file(os.path.join(FIXTURES, "wan21", "diffusers", "config.json"))
    with pytest.raises(ValueError, match=r"encoder\.conv_in\.weight"):
        WanVAE.from_pretrained(os.path.join(root, "diffusion_pytorch_model.safetensors"), config=config)


def test_max_frames_gives_the_same_video(wan21):
    """One program for any frame count up to `max_frames`: zero frames after the video
    change none of its outputs."""
    io = harness.load_io(os.path.join(FIXTURES, "wan21", "io.npz"))
    out = wan21.decode(jnp.asarray(io["latents_2"]), max_frames=3)
    assert out.shape == io["decoded_2"].shape and rel(out, io["decoded_2"]) < TOL
    post = wan21.encode(jnp.asarray(io["video_5"]), max_frames=9)
    assert post.mean.shape == io["mean_5"].shape and rel(post.mean, io["mean_5"]) < TOL
    with pytest.raises(ValueError, match=r"`max_frames` must be None or an int of the form 1 \+ 4k"):
        wan21.encode(jnp.asarray(io["video_5"]), max_frames=8)
    with pytest.raises(ValueError, match=r"at least the input's 2; received 1"):
        wan21.decode(jnp.asarray(io["latents_2"]), max_frames=1)


def test_frame_attention_is_no_vendor_kernel_on_a_tpu():
    """The VAE's frame attention runs the portable kernels on a TPU, never the splash
    kernel: beside the splash kernel's call the TPU compiler rewrites the next
    convolutions into a form it takes minutes to compile (the decoder's mid block: 129 s
    against 10 s). Lowered for a TPU from this host, abstract weights."""
    config = dataclasses.replace(WanVAEConfig.wan21(), base_dim=8)
    vae = eqx.filter_eval_shape(WanVAE, config, key=jax.random.key(0))
    for op, shape in (("decode", (16, 2, 4, 4)), ("encode", (3, 5, 32, 32))):
        fn, args = vae_program(vae, op, jax.ShapeDtypeStruct(shape, jnp.float32), 1)
        tpu = fn.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
        assert "stablehlo.convolution" in tpu and "tpu_custom_call" not in tpu, op


def test_vae_programs_compile_at_low_effort_on_a_tpu_only(monkeypatch):
    """`vae_jit` compiles with XLA's lower `exec_time_optimization_effort` for a call whose
    arrays or mesh are on a TPU, with XLA's defaults elsewhere (a CPU program is the one
    it always was) and inside a trace (JAX refuses options on a nested `jit`), and leaves
    the effort to a user who set JAX's own option."""
    from vidax_eqx.models import _vae

    seen = []
    real_filter_jit = eqx.filter_jit

    def filter_jit(fn, **kwargs):
        seen.append(kwargs.get("compiler_options"))
        return real_filter_jit(fn, **kwargs)

    monkeypatch.setattr(_vae.eqx, "filter_jit", filter_jit)
    double = vae_jit(lambda vae, x, mesh=None: vae * jnp.sin(x))
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(double(2.0, x), 2 * jnp.sin(x))
    np.testing.assert_array_equal(double(2.0, x, jax.make_mesh((1,), ("s",))), 2 * jnp.sin(x))
    assert seen == [None]  # one program, XLA's default options, for every CPU call
    low = {"exec_time_optimization_effort": _vae.TPU_COMPILE_EFFORT}
    assert _vae.vae_compile_options("tpu") == low and _vae.vae_compile_options("cpu") == {}
    assert models.vae_compile_options is _vae.vae_compile_options  # for a caller's own jit
    assert -1 <= _vae.TPU_COMPILE_EFFORT < 0
    # As on a TPU (a CPU compiles with the option as without it): the options at the top
    # level only; under jit, grad and vmap the call works as any other.
    monkeypatch.setattr(_vae, "_platform", lambda args: "tpu")
    np.testing.assert_array_equal(double(2.0, x), 2 * jnp.sin(x))
    assert seen == [None, low]
    np.testing.assert_allclose(jax.jit(lambda x: double(2.0, x))(x), 2 * jnp.sin(x))
    np.testing.assert_allclose(jax.jit(lambda: double(2.0, x))(), 2 * jnp.sin(x))  # x closed over
    np.testing.assert_allclose(jax.grad(lambda x: double(2.0, x).sum())(x), 2 * jnp.cos(x), rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(lambda x: double(2.0, x))(x[:, None])[:, 0], 2 * jnp.sin(x))
    assert seen == [None, low]
    jax.config.update("jax_exec_time_optimization_effort", 0.25)
    try:
        assert _vae.vae_compile_options("tpu") == {}
    finally:
        jax.config.update("jax_exec_time_optimization_effort", 0.0)
