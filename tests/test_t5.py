"""The T5 text encoders (`models.T5Encoder`): UMT5 (Wan) and T5 v1.1 (CogVideoX) against
transformers' `UMT5EncoderModel` / `T5EncoderModel`.

The fixtures (`tests/fixtures/t5/{umt5,t5}/`, written by `scripts/make_t5_fixtures.py`)
are tiny random encoders saved by transformers and its float32 `last_hidden_state` of
two examples, the second padded. Every position is compared, padded ones included:
transformers masks keys only, so a padded position attends to the valid tokens, as here.
"""

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
