"""The CogVideoX transformer (`models.CogVideoXTransformer3D`) against diffusers, and its
checkpoints.

The fixtures under `tests/fixtures/cogvideox/` come from
`scripts/make_cogvideox_fixtures.py` (run by hand with torch + diffusers): tiny random
diffusers `CogVideoXTransformer3DModel`s (2 layers, 4 heads of 16) in the styles of
CogVideoX-2B (3D sin-cos positions), 5B (3D RoPE, tables from the diffusers pipeline's
own code, on a grid that needs its crop region) and 5B-I2V (RoPE + learned positions),
with inputs and diffusers' float32 outputs. Here, without torch:

1. every model matches diffusers on one device (float32, rtol 1e-5 of the output's
   scale), the model computing its positions from the input's shape alone;
2. the sharded run (`models.run_sharded`) on 8 simulated devices matches diffusers:
   Ulysses, the joint ring (both layouts), USP, with and without TP, with a
   data-parallel axis, token counts that do and do not divide the devices;
3. the gradient of every parameter under the joint zigzag ring x TP (padded tokens,
   rematerialized) equals the single-device one;
4. load -> save -> load is bit-exact (one file and shards), bfloat16 stays bfloat16,
   and what the model cannot serve raises.
"""

import json
import os
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
from vidax_eqx import ShapeError, interop, models, nn


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "cogvideox")
RTOL = oracle.tolerance(np.float32)  # relative to the output's largest magnitude


def _io(name):
    return harness.load_io(os.path.join(FIXTURES, name, "io.npz"))


def _path(name):
    return os.path.join(FIXTURES, name, "diffusers")


@pytest.fixture(scope="module")
def loaded():
    return {name: models.CogVideoXTransformer3D.from_pretrained(_path(name))
            for name in ("2b", "5b", "5b_i2v")}


@eqx.filter_jit
def _single(model, x, timestep, context):
    return jax.vmap(model)(x, timestep, context)


# -- 1. one device ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["2b", "5b", "5b_i2v"])
def test_matches_diffusers(loaded, name):
    io = _io(name)
    out = _single(loaded[name], io["x"], io["timestep"], io["context"])
    assert out.shape == io["out"].shape and out.dtype == jnp.float32
    assert harness.max_rel_error(out, io["out"]) < RTOL


def test_rope_crop_region_rounds_as_the_pipeline():
    config = models.CogVideoXConfig(sample_height=6, sample_width=8, patch_size=2)
    # A (2, 4) grid in the (3, 4) base grid: resized to (2, 4), top = round(0.5) = 0
    # (round half to even; half up would give rows [1, 1.5]).
    f, rows, cols = models.rope_crop_positions((3, 2, 4), config)
    np.testing.assert_array_equal(f, [0, 1, 2])
    np.testing.assert_allclose(rows, [0.0, 1.0])
    np.testing.assert_allclose(cols, [0.0, 1.0, 2.0, 3.0])
    # The CogVideoX-5B default 480 x 720 video on its own base grid: no crop.
    config = models.CogVideoXConfig()
    _, rows, cols = models.rope_crop_positions((13, 30, 45), config)
    np.testing.assert_allclose(rows, np.arange(30))
    np.testing.assert_allclose(cols, np.arange(45))


# -- 2. sharded ------------------------------------------------------------------------


_CONFIGS = {  # name: (model, mesh axes, ParallelConfig, batch axis)
    "5b-ulysses-dp2-sp4": ("5b", dict(dp=2, sp=4), dict(sequence="ulysses"), "dp"),
    "5b-ring-sp8": ("5b", dict(sp=8), dict(sequence="ring"), None),
    "5b-usp-zigzag-2x2-tp2": ("5b", dict(sp=2, tp=2, ring=2),
                              dict(sequence="usp", ring_axis="ring", layout="zigzag",
                                   tp_axis="tp"), None),
    "2b-ring-zigzag-sp4-tp2": ("2b", dict(sp=4, tp=2),
                               dict(sequence="ring", layout="zigzag", tp_axis="tp"), None),
    "2b-ulysses-sp2-tp2-dp2": ("2b", dict(dp=2, sp=2, tp=2),
                               dict(sequence="ulysses", tp_axis="tp"), "dp"),
    "5b_i2v-ring-sp4-tp2": ("5b_i2v", dict(sp=4, tp=2), dict(sequence="ring", tp_axis="tp"),
                            None),
}


def _sharded(model, config, **kwargs):
    _, mesh_axes, parallel_config, batch_axis = _CONFIGS[config]
    mesh = harness.mesh(**mesh_axes)
    model = nn.sharding.shard_module(nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(**parallel_config)), mesh)
    run = eqx.filter_jit(lambda m, *a: models.run_sharded(
        m, *a, mesh=mesh, batch_axis=batch_axis, **kwargs))
    return model, run


@pytest.mark.parametrize("config", sorted(_CONFIGS))
def test_sharded_matches_diffusers(loaded, config):
    # 5b: 3 x 2 x 4 = 24 video tokens; 2b: 2 x 3 x 5 = 30, padded on these meshes.
    name = _CONFIGS[config][0]
    io = _io(name)
    model, run = _sharded(loaded[name], config)
    out = run(model, io["x"], io["timestep"], io["context"])
    assert harness.max_rel_error(out, io["out"]) < RTOL


# -- 3. gradients ----------------------------------------------------------------------


@pytest.mark.slow  # a whole model's sharded forward and backward compiled: ~15 s
def test_sharded_gradients_equal_single(loaded):
    # The joint zigzag ring (text counted once, its K/V never on the ring) x Megatron,
    # padded tokens (30 on 4 x 2 chunks), under rematerialization.
    config, model = "2b-ring-zigzag-sp4-tp2", loaded["2b"]
    io = _io("2b")
    target = jax.random.normal(jax.random.key(0), io["out"].shape)
    args = (io["x"], io["timestep"], io["context"], target)

    arrays, static = eqx.partition(model, eqx.is_array)
    single = harness.loss_and_grad(lambda m, x, t, c: jax.vmap(lambda x, t, c: m(x, t, c, remat="full"))(x, t, c))
    loss_1, grad_1 = single(arrays, static, *args)

    sharded, run = _sharded(model, config, remat="dots_saveable")
    arrays_n, static_n = eqx.partition(sharded, eqx.is_array)
    loss_n, grad_n = harness.loss_and_grad(run)(arrays_n, static_n, *args)

    assert abs(float(loss_n) - float(loss_1)) <= RTOL * abs(float(loss_1))
    flat_1 = jax.tree_util.tree_leaves_with_path(grad_1)
    flat_n = jax.tree.leaves(grad_n)
    assert len(flat_1) == len(flat_n) == len(jax.tree.leaves(arrays))
    # A gradient that is zero in exact arithmetic (norm_k's bias: a shift of every key
    # leaves the softmax unchanged) is float noise on both sides: the floor is relative
    # to the largest gradient of all.
    floor = 1e-6 * max(float(jnp.max(jnp.abs(g))) for _, g in flat_1)
    for (path, g1), gn in zip(flat_1, flat_n):
        scale = float(jnp.max(jnp.abs(g1)))
        err = float(jnp.max(jnp.abs(g1 - gn)))
        assert err <= 1e-4 * scale + floor, (jax.tree_util.keystr(path), err, scale)


# -- 4. checkpoints and errors ---------------------------------------------------------


def test_save_load_roundtrip(loaded, tmp_path):
    model = loaded["5b_i2v"]
    model.save_pretrained(tmp_path / "one")
    assert set(interop.open_checkpoint(tmp_path / "one")) == set(interop.open_checkpoint(_path("5b_i2v")))
    saved = json.loads((tmp_path / "one" / "config.json").read_text())
    original = json.loads(open(os.path.join(_path("5b_i2v"), "config.json")).read())
    assert {k: v for k, v in saved.items() if not k.startswith("_")} == {
        k: v for k, v in original.items() if not k.startswith("_")}
    assert harness.same_arrays(models.CogVideoXTransformer3D.from_pretrained(tmp_path / "one"), model)
    model.save_pretrained(tmp_path / "shards", max_shard_bytes=100_000)
    index = json.loads((tmp_path / "shards" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert harness.same_arrays(models.CogVideoXTransformer3D.from_pretrained(tmp_path / "shards"), model)


def test_bfloat16_stays_bfloat16(loaded, tmp_path):
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_array(a) else a, loaded["2b"])
    half.save_pretrained(tmp_path)
    back = models.CogVideoXTransformer3D.from_pretrained(tmp_path)
    assert {a.dtype for a in jax.tree.leaves(eqx.filter(back, eqx.is_array))} == {jnp.dtype(jnp.bfloat16)}
    io = _io("2b")
    out = _single(back, io["x"], io["timestep"], io["context"])
    assert out.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(out)))
    assert harness.max_rel_error(out.astype(jnp.float32), io["out"]) < 0.1


def test_checkpoint_that_does_not_fit(tmp_path):
    source = _path("5b")
    shutil.copy(os.path.join(source, "config.json"), tmp_path / "config.json")
    tensors = dict(interop.open_checkpoint(source))
    del tensors["transformer_blocks.1.attn1.to_q.weight"]
    tensors["patch_embed.proj.weight"] = tensors["patch_embed.proj.weight"][:, :, :1]
    interop.write_checkpoint(tmp_path, tensors)
    with pytest.raises(ValueError) as info:
        models.CogVideoXTransformer3D.from_pretrained(tmp_path)
    message = str(info.value)
    for part in ("nothing was loaded", "'transformer_blocks.1.attn1.to_q.weight'",
                 "'patch_embed.proj.weight': got (64, 4, 1, 2), expected (64, 4, 2, 2)"):
        assert part in message
    config = json.loads(open(os.path.join(source, "config.json")).read())
    for key, value in (("patch_size_t", 2), ("ofs_embed_dim", 512), ("attention_bias", False)):
        (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(NotImplementedError, match=key):
            models.CogVideoXTransformer3D.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
    with pytest.raises(ValueError, match="not a CogVideoXTransformer3DModel"):
        models.CogVideoXTransformer3D.from_pretrained(tmp_path)


def test_bad_calls(loaded):
    io = _io("5b_i2v")
    model = loaded["5b_i2v"]
    x, t, c = io["x"][0], io["timestep"][0], io["context"][0]
    with pytest.raises(ValueError, match="training resolution"):
        model(x[:, :, :4], t, c)
    with pytest.raises(ValueError, match="max_text_seq_length = 5"):
        model(x, t, c[:4])
    with pytest.raises(ValueError, match="multiples of patch_size"):
        loaded["5b"](x[:, :4, :, :7], t, c)
    with pytest.raises(ValueError, match="`remat` must be None or one of"):
        model(x, t, c, remat="sometimes")
    with pytest.raises(ShapeError, match=r"^CogVideoXTransformer3D: `x` must be a float array "
                                         r"\(F, 8, H, W\); received float32 \(3, 4, 6, 8\)"):
        model(x[:, :4], t, c)
    with pytest.raises(ValueError, match="multiple of 16"):
        models.CogVideoXConfig(attention_head_dim=24, use_rotary_positional_embeddings=True)
