"""The T5 text encoders (`models.T5Encoder`): UMT5 (Wan) and T5 v1.1 (CogVideoX) against
transformers' `UMT5EncoderModel` / `T5EncoderModel`.

The fixtures (`tests/fixtures/t5/{umt5,t5}/`, written by `scripts/make_t5_fixtures.py`)
are tiny random encoders saved by transformers and its float32 `last_hidden_state` of
two examples, the second padded. Every position is compared, padded ones included:
transformers masks keys only, so a padded position attends to the valid tokens, as here.
"""

import functools
import json
import os
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vidax_eqx import models
from vidax_eqx.models import T5Encoder, T5EncoderConfig


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "t5")
NAMES = ("umt5", "t5")


def _load(name, dtype=jnp.float32):
    folder = os.path.join(FIXTURES, name)
    io = dict(np.load(os.path.join(folder, "io.npz")))
    return T5Encoder.from_pretrained(folder, dtype=dtype), io


def _relative(out, ref):
    return float(np.max(np.abs(np.asarray(out, np.float32) - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("name", NAMES)
def test_parity_float32_and_vmap(name):
    model, io = _load(name)
    assert model.config.per_layer_bias == (name == "umt5")
    ids, mask, ref = io["input_ids"], io["attention_mask"], io["last_hidden_state"]
    for b in range(2):
        out = model(jnp.asarray(ids[b]), jnp.asarray(mask[b]))
        assert out.dtype == jnp.float32 and out.shape == ref[b].shape
        assert _relative(out, ref[b]) < 1e-5
    batched = jax.jit(jax.vmap(model))(jnp.asarray(ids), jnp.asarray(mask).astype(bool))
    for b in range(2):
        assert _relative(batched[b], ref[b]) < 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_parity_bfloat16(name):
    model, io = _load(name, jnp.bfloat16)
    out = jax.vmap(model)(jnp.asarray(io["input_ids"]), jnp.asarray(io["attention_mask"]))
    assert out.dtype == jnp.bfloat16
    # transformers' own bfloat16 forward is 4.2% (umt5) and 2.2% (t5) off its float32
    # on these fixtures by this measure (the largest error over the largest value):
    # bfloat16's rounding, not the port. This port is as close (4.1%, 2.0%); the
    # mean error over the mean value is 2.4% and 1.7%.
    for b in range(2):
        ref = io["last_hidden_state"][b]
        assert _relative(out[b], ref) < 5e-2
        err = np.abs(np.asarray(out[b], np.float32) - ref)
        assert float(err.mean() / np.abs(ref).mean()) < 3e-2


def test_export():
    model, io = _load("umt5")
    ids, mask = jnp.asarray(io["input_ids"][1]), jnp.asarray(io["attention_mask"][1])
    exported = jax.export.export(jax.jit(lambda i, m: model(i, m)))(
        jax.ShapeDtypeStruct(ids.shape, ids.dtype), jax.ShapeDtypeStruct(mask.shape, mask.dtype))
    np.testing.assert_allclose(exported.call(ids, mask), model(ids, mask), rtol=1e-6, atol=1e-6)
    again = models.export(lambda m, i, k: m(i, k), model, ids, mask)
    np.testing.assert_allclose(again(model, ids, mask), model(ids, mask), rtol=1e-6, atol=1e-6)


def test_bad_inputs():
    model = T5Encoder(T5EncoderConfig(vocab_size=16, d_model=8, d_kv=4, d_ff=12,
                                      num_layers=1, num_heads=2), key=jax.random.PRNGKey(0))
    ids = jnp.arange(5)
    with pytest.raises(ValueError, match="`input_ids`.*jax.vmap"):
        model(ids[None], jnp.ones((1, 5), int))
    with pytest.raises(ValueError, match="`input_ids` must be an int"):
        model(ids.astype(jnp.float32), jnp.ones(5, int))
    with pytest.raises(ValueError, match="`attention_mask`.*\\(5,\\)"):
        model(ids, jnp.ones(4, int))
    with pytest.raises(ValueError, match="`attention_mask` must be an int or bool"):
        model(ids, jnp.ones(5))
    with pytest.raises(ValueError, match="`input_ids` must lie in \\[0, 16\\)"):
        model(ids + 12, jnp.ones(5, int))
    assert model(ids).shape == (5, 8)  # no mask: every token valid


def test_config_refusals(tmp_path):
    with open(os.path.join(FIXTURES, "umt5", "config.json")) as f:
        raw = json.load(f)
    assert T5EncoderConfig.from_dict(raw).per_layer_bias
    for key, value in [("feed_forward_proj", "relu"), ("model_type", "bert"),
                       ("dense_act_fn", "gelu"), ("is_decoder", True)]:
        with pytest.raises(ValueError, match=f"`{key}`"):
            T5EncoderConfig.from_dict({**raw, key: value})
    # a tensor that disagrees with config.json is refused by name
    folder = tmp_path / "bad"
    shutil.copytree(os.path.join(FIXTURES, "umt5"), folder)
    (folder / "config.json").write_text(json.dumps({**raw, "d_ff": 40}))
    with pytest.raises(ValueError, match="wi_0"):
        T5Encoder.from_pretrained(folder)


def test_sharded_with_tied_embed_tokens(tmp_path):
    """Shards with an index, and the tied `encoder.embed_tokens.weight` copy stored."""
    from vidax_eqx import interop
    model, _ = _load("t5")
    tensors = dict(interop.open_checkpoint(os.path.join(FIXTURES, "t5")))
    tensors["encoder.embed_tokens.weight"] = tensors["shared.weight"]
    folder = tmp_path / "sharded"
    files = interop.write_checkpoint(folder, tensors, name="model", max_shard_bytes=20_000)
    assert len(files) > 2
    shutil.copy(os.path.join(FIXTURES, "t5", "config.json"), folder)
    assert eqx.tree_equal(T5Encoder.from_pretrained(folder), model)


# -- over a mesh: tensor parallelism and FSDP ------------------------------------------


@functools.cache
def _one_device(name):
    """The fixture's encoder and its one-device output of both examples (one compile)."""
    model, io = _load(name)
    ids, mask = jnp.asarray(io["input_ids"]), jnp.asarray(io["attention_mask"])
    return model, ids, mask, np.asarray(jax.jit(lambda i, m: model.encode(i, m))(ids, mask))


def _placed_as_specs(model, mesh) -> bool:
    from jax.sharding import PartitionSpec as P
    from vidax_eqx.nn import sharding

    specs = sharding.partition_specs(model, mesh)
    placed = jax.tree.map(
        lambda spec, x: spec is None or (x.sharding.mesh == mesh and x.sharding.spec == spec),
        specs, model, is_leaf=lambda s: s is None or isinstance(s, P))
    return all(jax.tree.leaves(placed))


# (fixture, mesh sizes, tp_axis, fsdp_axes, batch_axis): Megatron over 2 and 4 devices;
# FSDP over 8 with the batch over 2 of them; tp=2 x fsdp=4 with the batch on every
# device (the FSDP devices encode the same texts), and with it over dp (T5's shared bias).
SHARDED = [
    ("umt5", dict(tp=2), "tp", (), None),
    ("umt5", dict(tp=4), "tp", (), None),
    ("umt5", dict(dp=2, sp=4), None, ("dp", "sp"), "dp"),
    ("umt5", dict(sp=4, tp=2), "tp", ("sp",), None),
    ("t5", dict(dp=2, sp=2, tp=2), "tp", ("dp", "sp"), "dp"),
]


@pytest.mark.parametrize("name, sizes, tp_axis, fsdp_axes, batch_axis", SHARDED)
def test_sharded_equals_one_device(name, sizes, tp_axis, fsdp_axes, batch_axis):
    """from_pretrained(mesh=) places every parameter as partition_specs says (the token
    table split over every device of the mesh), and encode over the mesh gives the one-device
    output on both examples (the second padded)."""
    from harness import mesh as make_mesh
    from vidax_eqx.nn import sharding

    _, ids, mask, ref = _one_device(name)
    mesh = make_mesh(**sizes)
    parallel = sharding.ParallelConfig(tp_axis=tp_axis, fsdp_axes=fsdp_axes)
    placed = T5Encoder.from_pretrained(os.path.join(FIXTURES, name), parallel=parallel, mesh=mesh)
    assert placed.parallel == parallel and _placed_as_specs(placed, mesh)
    table = placed.embeddings.shared.weight
    assert table.addressable_shards[0].data.size * mesh.size == table.size
    out = eqx.filter_jit(lambda m, i, k: m.encode(i, k, mesh=mesh, batch_axis=batch_axis))(
        placed, ids, mask)
    assert out.shape == ref.shape and out.dtype == jnp.float32
    for b in range(2):
        assert _relative(out[b], ref[b]) < 1e-5


def test_parallel_refusals(tmp_path):
    from harness import mesh as make_mesh
    from vidax_eqx.nn import sharding

    folder = os.path.join(FIXTURES, "umt5")
    model, io = _load("umt5")
    ids = jnp.asarray(io["input_ids"])
    tp = sharding.ParallelConfig(tp_axis="tp")
    # 4 heads, d_ff 48, vocab 64 do not split over 3 devices
    sizes = "num_heads=4, d_ff=48, vocab_size=64 \\(num_heads, vocab_size not\\)"
    with pytest.raises(ValueError, match=f"3 devices of the axis 'tp'.*{sizes}.*\\(2, 4\\)"):
        T5Encoder.from_pretrained(folder, parallel=tp, mesh=make_mesh(tp=3))
    with pytest.raises(ValueError, match=sizes):
        sharding.with_parallel(model, tp).encode(ids, mesh=make_mesh(tp=3))
    with pytest.raises(NotImplementedError, match="sequence parallelism.*fsdp_axes=\\('sp',\\)"):
        T5Encoder.from_pretrained(folder, parallel=sharding.ParallelConfig(ulysses_axis="sp"))
    with pytest.raises(ValueError, match="configured for a mesh.*pass mesh="):
        sharding.with_parallel(model, tp).encode(ids)
    with pytest.raises(ValueError, match="`batch_axis` 'tp' contains the tensor-parallel axis"):
        sharding.with_parallel(model, tp).encode(ids, mesh=make_mesh(tp=2), batch_axis="tp")
    with pytest.raises(ValueError, match="names the axis 'tp', which the mesh.*lacks"):
        other = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
        sharding.with_parallel(model, tp).encode(ids, mesh=other)
    with pytest.raises(ValueError, match="`input_ids` must be a batch"):
        model.encode(ids[0])
    # with the tied copy of shared.weight stored (left unread), the names are checked
    from vidax_eqx import interop
    tensors = dict(interop.open_checkpoint(folder))
    tensors["encoder.embed_tokens.weight"] = tensors.pop("shared.weight")
    interop.write_checkpoint(tmp_path, tensors, name="model")
    shutil.copy(os.path.join(folder, "config.json"), tmp_path)
    with pytest.raises(ValueError, match="Missing \\(1\\): \\['shared.weight'\\]"):
        T5Encoder.from_pretrained(tmp_path)


# -- building in bounded memory (models/t5/_init.py) ---------------------------------------

def test_bounded_build_gives_the_plain_draws(monkeypatch):
    """The leaves drawn in row blocks (a small BLOCK, so that the table is cut, its last
    block short) and the layers stacked one at a time equal `jax.random`'s whole draws
    and `eqx.filter_vmap`'s stack bit for bit, float32 and bfloat16, typed and raw keys."""
    from vidax_eqx.models.t5 import _init

    monkeypatch.setattr(_init, "BLOCK", 300)
    key, raw = jax.random.key(3), jax.random.PRNGKey(3)
    assert _init.bounded(key) and _init.bounded(raw)
    assert not jax.jit(lambda k: jnp.asarray(_init.bounded(k)))(key)
    for dtype in (jnp.float32, jnp.bfloat16):
        np.testing.assert_array_equal(_init.normal_table(key, (97, 8), dtype),
                                      jax.random.normal(key, (97, 8), dtype))
        np.testing.assert_array_equal(_init.uniform_table(raw, (97, 8), dtype, -0.3, 0.3),
                                      jax.random.uniform(raw, (97, 8), dtype, -0.3, 0.3))
    config = T5EncoderConfig(d_model=32, d_kv=4, d_ff=40, num_heads=4, num_layers=2,
                             vocab_size=101)
    built = T5Encoder(config, dtype=jnp.bfloat16, key=key)
    monkeypatch.setattr(_init, "bounded", lambda key: False)  # the plain draws
    plain = T5Encoder(config, dtype=jnp.bfloat16, key=key)
    for a, b in zip(jax.tree.leaves(built), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(a, b)
