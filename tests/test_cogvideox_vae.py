"""`models.CogVideoXVAE`: CogVideoX's VAE against diffusers' `AutoencoderKLCogVideoX`
(fixtures of `scripts/make_cogvideox_vae_fixtures.py`: encode's posterior at 5 and 17
frames, decode at 4 and 5 latent frames, the tiled mode), bfloat16, the frames split over
8 simulated devices against one device and diffusers, `nn.GroupNorm` against a float64
NumPy GroupNorm (whole and split), checkpoints, and bad input."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import harness
from vidax_eqx import nn
from vidax_eqx.models import CogVideoXVAE, CogVideoXVAEConfig, Tiling
from vidax_eqx.nn.sharding import filter_shard_map
from vidax_eqx.parallel import SpatialSplit


ROOT = os.path.join(os.path.dirname(__file__), "fixtures", "cogvideox_vae", "tiny")
TOL = 1e-5  # float32 relative error in norm, against diffusers
SPLIT_TOL = 1e-5  # split over a mesh against one device (measured ~5e-7)


def rel(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def vae():
    return CogVideoXVAE.from_pretrained(os.path.join(ROOT, "diffusers"))


@pytest.fixture(scope="module")
def io():
    return harness.load_io(os.path.join(ROOT, "io.npz"))


@pytest.fixture(scope="module")
def one_device(vae, io):
    """One device's results on the fixtures' inputs, computed once (each a compiled
    program that the split tests compare against)."""
    out = {}
    for frames in (5, 17):
        post = vae.encode(io[f"video_{frames}"])
        out[f"mean_{frames}"], out[f"logvar_{frames}"] = post.mean, post.logvar
    for frames in (4, 5):
        out[f"decoded_{frames}"] = vae.decode(io[f"latents_{frames}"])
    return out


@pytest.mark.parametrize("frames", [5, 17])
def test_encode_matches_diffusers(one_device, io, frames):
    """5 frames: one chunk; 17: diffusers' first chunk of 9 frames, then one of 8."""
    mean, logvar = one_device[f"mean_{frames}"], one_device[f"logvar_{frames}"]
    assert mean.shape == io[f"mean_{frames}"].shape == (4, 1 + (frames - 1) // 4, 2, 4)
    assert rel(mean, io[f"mean_{frames}"]) < TOL
    assert rel(logvar, io[f"logvar_{frames}"]) < TOL


@pytest.mark.parametrize("frames", [4, 5])
def test_decode_matches_diffusers(one_device, io, frames):
    """4 latent frames: chunks of 2 + 2 (16 frames); 5: 3 + 2 (17 frames)."""
    out = one_device[f"decoded_{frames}"]
    assert out.shape == io[f"decoded_{frames}"].shape == (3, {4: 16, 5: 17}[frames], 16, 32)
    assert rel(out, io[f"decoded_{frames}"]) < TOL


def test_tiled_mode_matches_diffusers(vae, io):
    th, tw = (int(v) for v in io["tiling"])
    fh, fw = (float(v) for v in io["overlap"])
    tiling = vae.tiling(th, tw, fh, fw)
    assert tiling == Tiling(32, 32, 24, 16)
    post = vae.encode(io["video_tiled"], tiling=tiling)
    assert rel(post.mean, io["mean_tiled"]) < TOL
    assert rel(post.logvar, io["logvar_tiled"]) < TOL
    assert rel(vae.decode(io["latents_tiled"], tiling=tiling), io["decoded_tiled"]) < TOL


def test_default_tiling_is_diffusers():
    """diffusers' defaults for CogVideoX 1.0 (480 x 720): tiles of 240 x 360 overlapping
    by 1/6 and 1/5, strides 200 and 288 pixels (25 and 36 latent pixels)."""
    vae = jax.eval_shape(lambda: CogVideoXVAE(key=jax.random.key(0)))
    assert vae.tiling() == Tiling(240, 360, 200, 288)
    with pytest.raises(ValueError, match=r"CogVideoXVAE.tiling: a tile 100 pixels height"):
        vae.tiling(100, 360)


def test_bfloat16(vae, io):
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if _float_array(a) else a, vae)
    out = half.decode(io["latents_4"].astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    assert rel(out, io["decoded_4"]) < 2e-2
    post = half.encode(io["video_5"].astype(jnp.bfloat16))
    assert post.mean.dtype == jnp.bfloat16
    assert rel(post.mean, io["mean_5"]) < 2e-2
    assert rel(post.logvar, io["logvar_5"]) < 2e-2


def _float_array(a) -> bool:
    return isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.floating)


# -- the frames split over a mesh --------------------------------------------------------

def test_split_2x4_equals_one_device(vae, io, one_device):
    """Height over 2 devices, width over 4: the 17-frame encode (two chunks, the caches
    carried through the scan) and the 5-latent-frame decode."""
    mesh = jax.make_mesh((2, 4), ("sp", "tp"))
    post = vae.encode(io["video_17"], mesh=mesh, spatial_axes=("sp", "tp"))
    assert post.mean.sharding.spec == P(None, None, "sp", "tp")
    assert rel(post.mean, one_device["mean_17"]) < SPLIT_TOL
    assert rel(post.logvar, one_device["logvar_17"]) < SPLIT_TOL
    assert rel(post.mean, io["mean_17"]) < TOL
    out = vae.decode(io["latents_5"], mesh=mesh, spatial_axes=("sp", "tp"))
    assert out.sharding.spec == P(None, None, "sp", "tp")
    assert rel(out, one_device["decoded_5"]) < SPLIT_TOL
    assert rel(out, io["decoded_5"]) < TOL


def test_split_4x2_equals_one_device(vae, io, one_device):
    """The (4, 2) mesh, the width over its 4 devices and the height over its 2: the
    5-frame encode and the 4-latent-frame decode (chunks of 2 + 2)."""
    mesh = jax.make_mesh((4, 2), ("sp", "tp"))
    post = vae.encode(io["video_5"], mesh=mesh, spatial_axes=("tp", "sp"))
    assert post.mean.sharding.spec == P(None, None, "tp", "sp")
    assert rel(post.mean, one_device["mean_5"]) < SPLIT_TOL
    assert rel(post.logvar, one_device["logvar_5"]) < SPLIT_TOL
    out = vae.decode(io["latents_4"], mesh=mesh, spatial_axes=("tp", "sp"))
    assert rel(out, one_device["decoded_4"]) < SPLIT_TOL
    assert rel(out, io["decoded_4"]) < TOL


# -- nn.GroupNorm --------------------------------------------------------------------------

def _group_norm_f64(x, groups, weight, bias, eps):
    x = np.asarray(x, np.float64)
    g = x.reshape(groups, -1)
    y = ((g - g.mean(1, keepdims=True)) / np.sqrt(g.var(1, keepdims=True) + eps)).reshape(x.shape)
    shape = (-1,) + (1,) * (x.ndim - 1)
    return y * np.asarray(weight, np.float64).reshape(shape) + np.asarray(bias, np.float64).reshape(shape)


def test_group_norm_against_float64_whole_and_split():
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    norm = harness.with_arrays(nn.GroupNorm(2, 6, eps=1e-6), [1 + 0.2 * jax.random.normal(k1, (6,)),
                                      0.1 * jax.random.normal(k2, (6,))])
    x = 3 + 2 * jax.random.normal(k3, (6, 3, 8, 8))
    want = _group_norm_f64(x, 2, norm.weight, norm.bias, 1e-6)
    np.testing.assert_allclose(norm(x), want, rtol=1e-5, atol=1e-5)
    mesh = jax.make_mesh((2, 4), ("sp", "tp"))
    split = SpatialSplit("sp", "tp")
    spec = P(None, None, "sp", "tp")
    got = filter_shard_map(lambda m, x: m(x, split=split), mesh=mesh, in_specs=(P(), spec),
                           out_specs=spec)(norm, jax.device_put(x, NamedSharding(mesh, spec)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"GroupNorm: `num_groups` must divide"):
        nn.GroupNorm(4, 6)
    with pytest.raises(ValueError, match=r"GroupNorm: `x` must have 6 channels"):
        norm(jnp.zeros((5, 2, 2)))


# -- checkpoints and config ------------------------------------------------------------------

def test_save_pretrained_round_trip(vae, tmp_path):
    from safetensors.numpy import load_file
    vae.save_pretrained(tmp_path)
    saved = load_file(os.path.join(tmp_path, "diffusion_pytorch_model.safetensors"))
    theirs = load_file(os.path.join(ROOT, "diffusers", "diffusion_pytorch_model.safetensors"))
    assert set(saved) == set(theirs)
    for k in theirs:
        np.testing.assert_array_equal(saved[k], theirs[k])
    assert CogVideoXVAEConfig.from_file(os.path.join(tmp_path, "config.json")) == vae.config
    assert vae.scaling_factor == 1.15258426
    assert (vae.z_dim, vae.spatial_factor, vae.temporal_factor) == (4, 8, 4)
    z = jnp.arange(4.0).reshape(4, 1, 1, 1)
    np.testing.assert_allclose(vae.normalize_latents(z), z * 1.15258426, rtol=1e-6)
    np.testing.assert_allclose(vae.denormalize_latents(vae.normalize_latents(z)), z, rtol=1e-6)


def test_checkpoint_disagreeing_with_config_names_the_tensor(tmp_path):
    shutil.copytree(os.path.join(ROOT, "diffusers"), tmp_path / "vae")
    path = tmp_path / "vae" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "latent_channels": 8}))
    with pytest.raises(ValueError, match=r"decoder\.conv_in\.conv\.weight"):
        CogVideoXVAE.from_pretrained(tmp_path / "vae")


def test_config():
    assert CogVideoXVAEConfig.cogvideox_5b().scaling_factor == 0.7
    assert CogVideoXVAEConfig.cogvideox_2b() == CogVideoXVAEConfig()
    config = CogVideoXVAEConfig.from_file(os.path.join(ROOT, "diffusers", "config.json"))
    assert CogVideoXVAEConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"unknown config keys \['colour'\]"):
        CogVideoXVAEConfig.from_dict({**config.to_dict(), "colour": 1})
    with pytest.raises(ValueError, match=r"`norm_num_groups` must be a divisor"):
        CogVideoXVAEConfig(norm_num_groups=48)
    with pytest.raises(ValueError, match=r"`temporal_compression_ratio` must be a power of two"):
        CogVideoXVAEConfig(temporal_compression_ratio=3)


# -- bad input -----------------------------------------------------------------------------

def test_bad_input(vae):
    mesh = jax.make_mesh((2, 4), ("sp", "tp"))
    with pytest.raises(ValueError, match=r"`video` must have 3 channels.*received shape \(4, 5, 16, 16\)"):
        vae.encode(jnp.zeros((4, 5, 16, 16)))
    with pytest.raises(ValueError, match=r"`video` must have 1 \+ 4k frames.*received 6 frames"):
        vae.encode(jnp.zeros((3, 6, 16, 16)))
    with pytest.raises(ValueError, match=r"`video`'s height and width must be multiples of the "
                                         r"VAE's spatial factor 8; received 12 x 16"):
        vae.encode(jnp.zeros((3, 5, 12, 16)))
    with pytest.raises(ValueError, match=r"`latents` must have latent_channels = 4 channels.*"
                                         r"received shape \(5, 2, 2, 2\)"):
        vae.decode(jnp.zeros((5, 2, 2, 2)))
    with pytest.raises(ValueError, match=r"one example \(C, F, H, W\)"):
        vae.decode(jnp.zeros((1, 4, 2, 2, 2)))
    with pytest.raises(ValueError, match=r"latents's width 2 cannot be split over mesh axis 'tp' of size 4"):
        vae.decode(jnp.zeros((4, 2, 2, 2)), mesh=mesh, spatial_axes=("sp", "tp"))
    with pytest.raises(ValueError, match=r"video's height 8 cannot be split over mesh axis 'sp' of size 2"):
        vae.encode(jnp.zeros((3, 5, 8, 32)), mesh=mesh, spatial_axes=("sp", "tp"))
    with pytest.raises(ValueError, match=r"`spatial_axes` .* without a `mesh`"):
        vae.decode(jnp.zeros((4, 2, 2, 2)), spatial_axes=("sp", "tp"))
    with pytest.raises(ValueError, match=r"`tiling` runs on one device"):
        vae.decode(jnp.zeros((4, 2, 2, 2)), mesh=mesh, tiling=Tiling())
