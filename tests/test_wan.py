"""The Wan 2.1 transformer (`models.WanTransformer3D`) against diffusers, and its checkpoints.

The fixtures under `tests/fixtures/wan/` come from `scripts/make_wan_fixtures.py`
(run by hand with torch + diffusers): tiny random diffusers `WanTransformer3DModel`s
(2 layers, width 64, 8 heads; T2V with patch (1, 2, 2) and (2, 2, 2), T2V without
qk-norm, I2V) saved in
diffusers' and Wan's layouts, with inputs and diffusers' float32 outputs. Here,
without torch:

1. every model in both layouts matches diffusers (float32, rtol 1e-5 of the output's
   scale), and `pad_text=True` matches diffusers run on the text zero-padded to 512
   tokens (what Wan's own forward does);
2. the sharded run (`models.run_sharded`) on 8 simulated devices matches diffusers in
   every configuration: Ulysses, ring (both layouts), USP, with and without TP, and a
   data-parallel axis; token counts that do not divide the devices are padded;
3. the gradient with respect to every parameter of a sharded training loss (USP with a
   zigzag ring, x TP, rematerialized) equals the single-device one;
4. load -> save -> load is bit-exact in both layouts and as shards; the diffusers save
   has exactly diffusers' tensor names; a bfloat16 checkpoint stays bfloat16;
   a checkpoint that does not fit raises one message listing every problem.
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
from vidax_eqx import interop, models, nn


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "wan")
RTOL = oracle.tolerance(np.float32)  # relative to the output's largest magnitude


def _io(name):
    return harness.load_io(os.path.join(FIXTURES, name, "io.npz"))


def _load(name, layout="diffusers", **kwargs):
    return models.WanTransformer3D.from_pretrained(os.path.join(FIXTURES, name, layout), **kwargs)


def _call_args(io):
    kwargs = {"context_image": io["context_image"]} if "context_image" in io else {}
    return (io["x"], io["timestep"], io["context"]), kwargs


@eqx.filter_jit
def _single(model, x, timestep, context, **kwargs):
    return jax.vmap(lambda x, t, c, **k: model(x, t, c, **k))(x, timestep, context, **kwargs)


@pytest.fixture(scope="module")
def t2v():
    return _load("t2v")


# -- 1. one device ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["diffusers", "wan"])
@pytest.mark.parametrize("name", ["t2v", "t2v_patch2", "t2v_no_qk_norm", "i2v"])
def test_matches_diffusers(name, layout):
    io = _io(name)
    args, kwargs = _call_args(io)
    out = _single(_load(name, layout), *args, **kwargs)
    assert out.shape == io["out"].shape and out.dtype == jnp.float32
    assert harness.max_rel_error(out, io["out"]) < RTOL


def test_pad_text_is_wans_forward():
    io = _io("t2v")
    model = _load("t2v", "wan", pad_text=True)
    assert model.config.text_len == 512
    out = _single(model, io["x"], io["timestep"], io["context"])
    assert harness.max_rel_error(out, io["out_padded"]) < RTOL
    with pytest.raises(ValueError, match="text_len=512"):
        model(io["x"][0], io["timestep"][0], jnp.zeros((513, model.config.text_dim)))


# -- 2. sharded ------------------------------------------------------------------------


_CONFIGS = {
    "ulysses-sp8": (dict(sp=8), dict(sequence="ulysses"), None),
    "ring-sp8": (dict(sp=8), dict(sequence="ring"), None),
    "ring-zigzag-sp4-tp2": (dict(sp=4, tp=2), dict(sequence="ring", layout="zigzag", tp_axis="tp"), None),
    "ulysses-sp4-tp2": (dict(sp=4, tp=2), dict(sequence="ulysses", tp_axis="tp"), None),
    "usp-2x2-tp2": (dict(sp=2, tp=2, ring=2),
                    dict(sequence="usp", ring_axis="ring", tp_axis="tp"), None),
    "usp-zigzag-2x2-tp2": (dict(sp=2, tp=2, ring=2),
                           dict(sequence="usp", ring_axis="ring", layout="zigzag", tp_axis="tp"), None),
    "usp-zigzag-2x2-dp2": (dict(dp=2, sp=2, ring=2),
                           dict(sequence="usp", ring_axis="ring", layout="zigzag"), "dp"),
    "dp2-ulysses-sp2-tp2": (dict(dp=2, sp=2, tp=2), dict(sequence="ulysses", tp_axis="tp"), "dp"),
    "tp8": (dict(tp=8), dict(tp_axis="tp"), None),
}


def _sharded(model, name, **kwargs):
    mesh_axes, config, batch_axis = _CONFIGS[name]
    mesh = harness.mesh(**mesh_axes)
    model = nn.sharding.shard_module(nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(**config)), mesh)
    run = eqx.filter_jit(lambda m, *a, **k: models.run_sharded(
        m, *a, mesh=mesh, batch_axis=batch_axis, **kwargs, **k))
    return model, run


@pytest.mark.parametrize("config", sorted(_CONFIGS))
def test_sharded_matches_diffusers(t2v, config):
    io = _io("t2v")  # 3 x 3 x 5 = 45 tokens: padded on every mesh
    model, run = _sharded(t2v, config)
    out = run(model, io["x"], io["timestep"], io["context"])
    assert harness.max_rel_error(out, io["out"]) < RTOL


def test_sharded_i2v_matches_diffusers():
    io = _io("i2v")
    model, run = _sharded(_load("i2v"), "ulysses-sp4-tp2")
    (x, t, c), kwargs = _call_args(io)
    assert harness.max_rel_error(run(model, x, t, c, **kwargs), io["out"]) < RTOL


# -- 3. gradients ----------------------------------------------------------------------


@pytest.mark.slow  # a whole model's sharded forward and backward compiled: ~15 s
def test_sharded_gradients_equal_single(t2v):
    # One configuration with every kind of communication (a compile costs ~30 s here):
    # Ulysses all_to_all, a zigzag ring with its backward ring, Megatron psums, the
    # padded token split and the final gather, under rematerialization.
    config = "usp-zigzag-2x2-tp2"
    io = _io("t2v")
    target = jax.random.normal(jax.random.key(0), io["out"].shape)
    args = (io["x"], io["timestep"], io["context"], target)

    arrays, static = eqx.partition(t2v, eqx.is_array)
    single = harness.loss_and_grad(lambda m, x, t, c: jax.vmap(lambda x, t, c: m(x, t, c, remat="full"))(x, t, c))
    loss_1, grad_1 = single(arrays, static, *args)

    model, run = _sharded(t2v, config, remat="dots_saveable")
    arrays_n, static_n = eqx.partition(model, eqx.is_array)
    loss_n, grad_n = harness.loss_and_grad(run)(arrays_n, static_n, *args)

    assert abs(float(loss_n) - float(loss_1)) <= RTOL * abs(float(loss_1))
    flat_1 = jax.tree_util.tree_leaves_with_path(grad_1)
    flat_n = jax.tree.leaves(grad_n)
    assert len(flat_1) == len(flat_n) == len(jax.tree.leaves(arrays))
    for (path, g1), gn in zip(flat_1, flat_n):
        scale = float(jnp.max(jnp.abs(g1)))
        err = float(jnp.max(jnp.abs(g1 - gn)))
        assert err <= 1e-4 * scale + 1e-9, (jax.tree_util.keystr(path), err, scale)


# -- 4. checkpoints --------------------------------------------------------------------


def test_save_load_roundtrip(t2v, tmp_path):
    diffusers_names = set(interop.open_checkpoint(os.path.join(FIXTURES, "t2v", "diffusers")))
    wan_names = set(interop.open_checkpoint(os.path.join(FIXTURES, "t2v", "wan")))
    for layout, names in (("diffusers", diffusers_names), ("wan", wan_names)):
        path = tmp_path / layout
        t2v.save_pretrained(path, layout=layout)
        assert set(interop.open_checkpoint(path)) == names
        assert harness.same_arrays(models.WanTransformer3D.from_pretrained(path), t2v)
    sharded = tmp_path / "shards"
    t2v.save_pretrained(sharded, max_shard_bytes=100_000)
    index = json.loads((sharded / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert harness.same_arrays(models.WanTransformer3D.from_pretrained(sharded), t2v)


def test_bfloat16_stays_bfloat16(t2v, tmp_path):
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_array(a) else a, t2v)
    half.save_pretrained(tmp_path)
    loaded = models.WanTransformer3D.from_pretrained(tmp_path)
    assert {a.dtype for a in jax.tree.leaves(eqx.filter(loaded, eqx.is_array))} == {jnp.dtype(jnp.bfloat16)}
    assert harness.same_arrays(loaded, half)
    as_f32 = models.WanTransformer3D.from_pretrained(tmp_path, dtype=jnp.float32)
    assert as_f32.blocks.self_attn.q.weight.dtype == jnp.float32


def test_checkpoint_that_does_not_fit(tmp_path):
    source = os.path.join(FIXTURES, "t2v", "diffusers")
    shutil.copy(os.path.join(source, "config.json"), tmp_path / "config.json")
    tensors = dict(interop.open_checkpoint(source))
    del tensors["blocks.1.attn1.to_q.weight"]
    tensors["blocks.0.ffn.net.2.weight"] = tensors["blocks.0.ffn.net.2.weight"][:, :5]
    tensors["blocks.0.extra"] = np.zeros(3, np.float32)
    interop.write_checkpoint(tmp_path, tensors)
    with pytest.raises(ValueError) as info:
        models.WanTransformer3D.from_pretrained(tmp_path)
    message = str(info.value)
    for part in ("nothing was loaded", "'blocks.1.attn1.to_q.weight'", "'blocks.0.extra'",
                 "'blocks.0.ffn.net.2.weight': got (64, 5), expected (64, 96)"):
        assert part in message
    with pytest.raises(ValueError, match="checkpoint directory holding config.json"):
        models.WanTransformer3D.from_pretrained(tmp_path / "absent")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="neither a diffusers"):
        models.WanTransformer3D.from_pretrained(tmp_path)


def test_wan_config_inferred_from_tensors():
    path = os.path.join(FIXTURES, "t2v_patch2", "wan")
    raw = json.loads(open(os.path.join(path, "config.json")).read())
    assert not {"text_dim", "patch_size", "qk_norm", "cross_attn_norm"} & set(raw)
    config = models.WanConfig.from_wan(raw, interop.open_checkpoint(path))
    assert config.patch_size == (2, 2, 2) and config.text_dim == 32
    assert config.cross_attn_norm is False and config.qk_norm is True


def test_diffusers_config_round_trips():
    """Every key of a diffusers config.json comes back from `to_diffusers`, the RoPE table
    length included (it was always written as 1024)."""
    raw = {**models.WanConfig(dim=32, num_heads=2).to_diffusers(), "rope_max_seq_len": 2048}
    config = models.WanConfig.from_diffusers(raw)
    assert config.rope_max_seq_len == 2048 and config.to_diffusers() == raw
    with pytest.raises(ValueError, match=r"`rope_max_seq_len` must be a positive int; received 0"):
        models.WanConfig(rope_max_seq_len=0)


def test_bad_calls(t2v):
    io = _io("t2v")
    x, t, c = io["x"][0], io["timestep"][0], io["context"][0]
    with pytest.raises(ValueError, match="multiples of patch_size"):
        t2v(x[:, :, :5], t, c)
    with pytest.raises(Exception, match="context_image"):  # T2V: no image branch
        t2v(x, t, c, context_image=jnp.zeros((3, 8)))
    with pytest.raises(ValueError, match="`remat` must be None or one of"):
        t2v(x, t, c, remat="sometimes")
    with pytest.raises(Exception, match="text_dim|L"):  # jaxtyping: wrong text width
        t2v(x, t, c[:, :5])


def test_experts_from_a_hub_repository(tmp_path, monkeypatch):
    """Wan 2.2 A14B from a Hub cache (offline), in either layout: both experts' folders
    and the pipeline's model_index.json (its boundary) come from the snapshot."""
    constants = pytest.importorskip("huggingface_hub.constants")
    revision = "0123456789abcdef0123456789abcdef01234567"
    for layout, repo in (("diffusers", "tiny-a14b-diffusers"), ("wan", "tiny-a14b")):
        snapshot = tmp_path / f"models--vidax--{repo}" / "snapshots" / revision
        shutil.copytree(os.path.join(FIXTURES, "a14b", layout), snapshot)
        (tmp_path / f"models--vidax--{repo}" / "refs").mkdir()
        (tmp_path / f"models--vidax--{repo}" / "refs" / "main").write_text(revision)
    # The pipeline's boundary is read from its model_index.json (here made 0.5); Wan's
    # layout gets Wan 2.2's T2V default.
    index = tmp_path / "models--vidax--tiny-a14b-diffusers" / "snapshots" / revision
    index = index / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "boundary_ratio": 0.5}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    local = models.WanExperts.from_pretrained(os.path.join(FIXTURES, "a14b", "diffusers"))
    hub = models.WanExperts.from_pretrained("vidax/tiny-a14b-diffusers", cache_dir=tmp_path)
    assert hub.boundary == 0.5 and harness.same_arrays(hub, local)
    wan = models.WanExperts.from_pretrained("vidax/tiny-a14b", cache_dir=tmp_path)
    assert wan.boundary == 0.875 and harness.same_arrays(wan, local)
    with pytest.raises(ValueError, match=r"transformer/ and transformer_2/ \(diffusers\) or "
                                         r"high_noise_model/ and low_noise_model/"):
        models.WanExperts.from_pretrained("vidax/missing", cache_dir=tmp_path)
