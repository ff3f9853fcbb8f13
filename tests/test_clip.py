"""The CLIP image encoder (`models.CLIPVisionEncoder`) and its processor
(`models.CLIPImageProcessor`) against transformers' `CLIPVisionModelWithProjection` and
`CLIPImageProcessor`, as diffusers' Wan 2.1 I2V / FLF2V pipelines use them.

The fixtures (`tests/fixtures/clip/`, written by `scripts/make_clip_fixtures.py`) are a
tiny random encoder (Wan's exact GELU, 26 tokens: a 5 x 5 grid of 6-pixel patches of a
32 x 32 image, the last 2 rows and columns unused) and processor saved by transformers,
two non-square uint8 images and transformers' float32 outputs for them. Both activations
are also checked against an independent float64 forward written here.
"""

import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from vidax_eqx import interop, ShapeError
from vidax_eqx.models import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionEncoder


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "clip")
ENCODER = os.path.join(FIXTURES, "encoder")
PROCESSOR = os.path.join(FIXTURES, "processor")
# max |error| / max |reference|, by dtype. Measured: float32 4.1e-7 (hidden_states[-2]),
# 3.6e-7 (last_hidden_state), 2.6e-7 (image_embeds); bfloat16 0.93%, 1.3%, 0.78%, where
# transformers' own bfloat16 forward is 0.81%, 0.83%, 0.39% off its float32.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def io():
    return dict(np.load(os.path.join(FIXTURES, "io.npz")))


@pytest.fixture(scope="module")
def model():
    return CLIPVisionEncoder.from_pretrained(ENCODER)


def _encoder_config() -> dict:
    with open(os.path.join(ENCODER, "config.json")) as f:
        return json.load(f)


def _relative(out, ref):
    return float(np.max(np.abs(np.asarray(out, np.float32) - ref)) / np.max(np.abs(ref)))


# -- the processor ----------------------------------------------------------------------


def test_processor_equals_transformers(io):
    processor = CLIPImageProcessor.from_pretrained(PROCESSOR)
    assert processor.size == {"shortest_edge": 35} and processor.resample == 3
    images = [io["image_0"], io["image_1"]]
    out = processor(images)
    assert out.dtype == np.float32 and out.shape == (2, 3, 32, 32)
    np.testing.assert_array_equal(out, io["pixel_values"])  # bit for bit
    for b, image in enumerate(images):  # one image; a Pillow image
        np.testing.assert_array_equal(processor(image), io["pixel_values"][b])
        np.testing.assert_array_equal(processor(Image.fromarray(image)), io["pixel_values"][b])
    # transparency composited onto white, as transformers' convert_to_rgb
    rgba = Image.fromarray(io["image_rgba"], "RGBA")
    np.testing.assert_array_equal(processor(rgba), io["pixel_values_rgba"])


def test_processor_torchvision_backend_gap(io):
    """With torchvision installed, transformers 5's `CLIPImageProcessor` resizes with
    torchvision: not Pillow's rounding, a few levels of 255 apart (documented)."""
    if "pixel_values_torchvision" not in io:
        pytest.skip("the fixtures were written without torchvision")
    gap = np.abs(io["pixel_values_torchvision"] - io["pixel_values"])
    assert 0 < gap.max() < 4.5 / 255 / min(CLIPImageProcessor().image_std)
    assert (gap > 1e-4).mean() < 0.3


def test_processor_refusals(io):
    processor = CLIPImageProcessor.from_pretrained(PROCESSOR)
    bad = [(io["image_0"].astype(np.float32) / 255, "uint8"),
           (io["image_rgba"], r"\(H, W, 3\)"),
           (io["image_0"][..., 0], r"received uint8 \(45, 70\)"),
           ([], "empty list")]
    for image, match in bad:
        with pytest.raises(ValueError, match=match):
            processor(image)
    with open(os.path.join(PROCESSOR, "preprocessor_config.json")) as f:
        raw = json.load(f)
    for key, value in [("size", {"shortest_edge": 8, "longest_edge": 16}),
                       ("crop_size", {"height": 0, "width": 4}), ("resample", 7),
                       ("image_std", [0.5, 0.0, 0.5]), ("image_mean", [0.5, 0.5]),
                       ("do_resize", 1), ("do_pad", True)]:
        with pytest.raises(ValueError, match=f"`?{key}"):
            CLIPImageProcessor.from_dict({**raw, key: value})
    # transformers' other spellings: an int size (shortest edge) and crop size (square)
    assert CLIPImageProcessor.from_dict({**raw, "size": 35, "crop_size": 32}) == processor
    no_crop = CLIPImageProcessor.from_dict({**raw, "do_center_crop": False})
    assert no_crop(io["image_0"]).shape == (3, 35, 54)
    with pytest.raises(ValueError, match="one shape"):
        no_crop([io["image_0"], io["image_1"]])


# -- the encoder ------------------------------------------------------------------------


def test_parity_float32(model, io):
    assert model.config.hidden_act == "gelu" and model.config.num_positions == 26
    pixels, hidden = io["pixel_values"], io["hidden_states"]
    x = jnp.asarray(pixels[0])  # eagerly once; then compiled
    out = model.hidden_states(x)  # diffusers' hidden_states[-2]
    assert out.dtype == jnp.float32 and out.shape == (26, 32)
    assert _relative(out, hidden[-2, 0]) < TOLERANCE[jnp.float32]
    np.testing.assert_array_equal(model.penultimate_hidden_states(x), out)
    call, embeds = jax.jit(lambda x: model(x)), jax.jit(lambda x: model.image_embeds(x))
    features = jax.jit(lambda x, layer: model.hidden_states(x, layer), static_argnums=1)
    for b in range(2):
        x = jnp.asarray(pixels[b])
        out = features(x, -2)
        assert out.dtype == jnp.float32 and out.shape == (26, 32)
        assert _relative(out, hidden[-2, b]) < TOLERANCE[jnp.float32]
        assert _relative(call(x), io["last_hidden_state"][b]) < TOLERANCE[jnp.float32]
        assert _relative(embeds(x), io["image_embeds"][b]) < TOLERANCE[jnp.float32]
    for layer in range(-4, 4):  # every index of transformers' tuple
        assert _relative(features(x, layer), hidden[layer, 1]) < TOLERANCE[jnp.float32]


def test_vmap_jit(model, io):
    pixels = jnp.asarray(io["pixel_values"])
    features = jax.jit(jax.vmap(model.hidden_states))(pixels)
    embeds = jax.jit(jax.vmap(model.image_embeds))(pixels)
    last = jax.jit(jax.vmap(model))(pixels)
    for b in range(2):
        assert _relative(features[b], io["hidden_states"][-2, b]) < TOLERANCE[jnp.float32]
        assert _relative(embeds[b], io["image_embeds"][b]) < TOLERANCE[jnp.float32]
        assert _relative(last[b], io["last_hidden_state"][b]) < TOLERANCE[jnp.float32]


def test_parity_bfloat16(io):
    model = CLIPVisionEncoder.from_pretrained(ENCODER, dtype=jnp.bfloat16)
    pixels = jnp.asarray(io["pixel_values"])
    features = jax.jit(jax.vmap(model.hidden_states))(pixels)
    assert features.dtype == jnp.bfloat16
    embeds = jax.jit(jax.vmap(model.image_embeds))(pixels)
    last = jax.jit(jax.vmap(model))(pixels)
    for b in range(2):
        assert _relative(features[b], io["hidden_states"][-2, b]) < TOLERANCE[jnp.bfloat16]
        assert _relative(last[b], io["last_hidden_state"][b]) < TOLERANCE[jnp.bfloat16]
        assert _relative(embeds[b], io["image_embeds"][b]) < TOLERANCE[jnp.bfloat16]


def test_bad_inputs(model, io):
    x = jnp.asarray(io["pixel_values"][0])
    for bad in (x[:, :31], jnp.concatenate([x, x[:1]]), x[None], x.astype(jnp.int32)):
        with pytest.raises(ShapeError, match="pixel_values"):
            model(bad)
    with pytest.raises(ShapeError, match=r"\(3, 32, 32\)"):
        model.hidden_states(x[:2])
    with pytest.raises(ShapeError, match="jax.vmap"):
        model.image_embeds(x[None])
    for layer in (4, -5):
        with pytest.raises(ValueError, match="`layer` must be an int index into the 4"):
            model.hidden_states(x, layer)


def test_config_refusals():
    raw = _encoder_config()
    assert CLIPVisionConfig.from_dict(raw) == CLIPVisionConfig(
        hidden_size=32, intermediate_size=40, projection_dim=16, num_hidden_layers=3,
        num_attention_heads=4, image_size=32, patch_size=6)
    # transformers' defaults for the keys a file omits (ViT-B/32, quick_gelu)
    assert CLIPVisionConfig.from_dict({}).hidden_act == "quick_gelu"
    for key, value, match in [("hidden_act", "relu", "`hidden_act`.*'relu'"),
                              ("hidden_act", "gelu_new", "`hidden_act`.*'gelu_new'"),
                              ("model_type", "clip", "`model_type`"),
                              ("hidden_size", 30, "`hidden_size` must be a multiple"),
                              ("patch_size", 40, "`patch_size`"),
                              ("num_hidden_layers", 0, "`num_hidden_layers`"),
                              ("layer_norm_eps", -1.0, "`layer_norm_eps`")]:
        with pytest.raises(ValueError, match=match):
            CLIPVisionConfig.from_dict({**raw, key: value})


def test_checkpoint_refusals(tmp_path, io):
    raw = _encoder_config()
    folder = tmp_path / "bad"
    shutil.copytree(ENCODER, folder)
    (folder / "config.json").write_text(json.dumps({**raw, "intermediate_size": 48}))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.fc1\.weight.*expected \(48, 32\)"):
        CLIPVisionEncoder.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match=r"unexpected.*layers\.2\."):
        CLIPVisionEncoder.from_pretrained(folder)
    # a pipeline's folder: the encoder is in image_encoder/
    pipeline = tmp_path / "pipeline"
    shutil.copytree(ENCODER, pipeline / "image_encoder")
    with pytest.raises(ValueError, match="subfolder='image_encoder'"):
        CLIPVisionEncoder.from_pretrained(pipeline)
    assert CLIPVisionEncoder.from_pretrained(pipeline, subfolder="image_encoder").config.image_size == 32


def test_checkpoint_variants(tmp_path, model, io):
    """Shards with an index and an older transformers' `position_ids` buffer; a
    `CLIPVisionModel` checkpoint (no `visual_projection`)."""
    tensors = dict(interop.open_checkpoint(ENCODER))
    x = jnp.asarray(io["pixel_values"][0])
    sharded = dict(tensors, **{"vision_model.embeddings.position_ids": np.arange(26)[None]})
    folder = tmp_path / "sharded"
    assert len(interop.write_checkpoint(folder, sharded, name="model",
                                        max_shard_bytes=20_000)) > 2
    shutil.copy(os.path.join(ENCODER, "config.json"), folder)
    np.testing.assert_array_equal(CLIPVisionEncoder.from_pretrained(folder).image_embeds(x),
                                  model.image_embeds(x))
    folder = tmp_path / "no_projection"
    del tensors["visual_projection.weight"]
    interop.write_checkpoint(folder, tensors, name="model")
    shutil.copy(os.path.join(ENCODER, "config.json"), folder)
    bare = CLIPVisionEncoder.from_pretrained(folder)
    assert bare.visual_projection is None
    np.testing.assert_array_equal(bare.hidden_states(x), model.hidden_states(x))
    with pytest.raises(ValueError, match="no `visual_projection`"):
        bare.image_embeds(x)


def _oracle(model, pixels, num_layers):
    """transformers' CLIP vision forward in float64 NumPy, from the module's arrays:
    the hidden state after `num_layers` layers."""
    c, f = model.config, (lambda a: np.asarray(a, np.float64))
    p, g, d, heads = c.patch_size, c.image_size // c.patch_size, c.hidden_size, c.num_attention_heads
    x = f(pixels)[:, :g * p, :g * p].reshape(c.num_channels, g, p, g, p)
    patches = x.transpose(1, 3, 0, 2, 4).reshape(g * g, -1)
    h = np.concatenate([f(model.class_embedding)[None],
                        patches @ f(model.patch_embedding).reshape(d, -1).T])
    h = h + f(model.position_embedding)

    def norm(h, w, b):
        mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
        return (h - mu) / np.sqrt(var + c.layer_norm_eps) * f(w) + f(b)

    def act(h):
        if c.hidden_act == "quick_gelu":
            return h / (1 + np.exp(-1.702 * h))
        return 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))

    h = norm(h, model.pre_layrnorm.weight, model.pre_layrnorm.bias)
    s = h.shape[0]
    for i in range(num_layers):
        layer = jax.tree.map(lambda a: f(a[i]), model.layers)
        dense = lambda lin, a: a @ lin.weight.T + lin.bias  # noqa: E731
        a = norm(h, layer.layer_norm1.weight, layer.layer_norm1.bias)
        q, k, v = (dense(lin, a).reshape(s, heads, -1).transpose(1, 0, 2) for lin in
                   (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj))
        logits = q @ k.transpose(0, 2, 1) / math.sqrt(d // heads)
        prob = np.exp(logits - logits.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        h = h + dense(layer.self_attn.out_proj, (prob @ v).transpose(1, 0, 2).reshape(s, d))
        a = norm(h, layer.layer_norm2.weight, layer.layer_norm2.bias)
        h = h + dense(layer.mlp.fc2, act(dense(layer.mlp.fc1, a)))
    return h


@pytest.mark.parametrize("hidden_act", ["quick_gelu", "gelu"])
def test_against_float64_oracle(hidden_act):
    """Both activations (the fixture has Wan's `gelu` only), an image size that the
    patches divide, against an independent float64 forward."""
    config = CLIPVisionConfig(hidden_size=24, intermediate_size=36, projection_dim=8,
                              num_hidden_layers=2, num_attention_heads=3, image_size=20,
                              patch_size=5, hidden_act=hidden_act)
    model = CLIPVisionEncoder(config, key=jax.random.PRNGKey(3))
    x = jax.random.normal(jax.random.PRNGKey(4), (3, 20, 20))
    features = jax.jit(lambda x: model.penultimate_hidden_states(x))(x)
    assert features.shape == (17, 24)
    assert _relative(features, _oracle(model, x, 1)) < TOLERANCE[jnp.float32]
    assert _relative(jax.jit(lambda x: model(x))(x), _oracle(model, x, 2)) < TOLERANCE[jnp.float32]
