"""Construction of the modules and models: one key gives one model, the parameters
follow the documented distributions, and the concrete, traced and abstract builds
agree on structure.

A concrete key builds on the host (NumPy draws, seeded from the key; no compile); a
traced one (inside `eqx.filter_jit`, `eqx.filter_eval_shape`) with `jax.random`, and so
does a concrete key while a trace is being built. The values of the two paths differ;
their distributions and every shape, dtype and field do not. No timing here: the
speed is `benchmarks/construction.py`'s.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vidax_eqx import models, nn

import harness


WAN = models.WanConfig(dim=64, ffn_dim=96, num_heads=8, num_layers=2, in_channels=4,
                       out_channels=4, text_dim=32, freq_dim=32)
WAN_I2V = models.WanConfig(dim=32, ffn_dim=64, num_heads=4, num_layers=2, in_channels=4,
                           out_channels=4, text_dim=16, freq_dim=16, image_dim=24,
                           pos_embed_seq_len=6)
COG = models.CogVideoXConfig(num_attention_heads=4, attention_head_dim=16, in_channels=4,
                             out_channels=4, time_embed_dim=32, text_embed_dim=24, num_layers=2,
                             sample_width=8, sample_height=6, sample_frames=9, patch_size=2,
                             max_text_seq_length=5, norm_eps=1e-5)
MAKERS = {
    "wan": lambda key: models.WanTransformer3D(WAN, key=key),
    "wan_i2v_bf16": lambda key: models.WanTransformer3D(WAN_I2V, dtype=jnp.bfloat16, key=key),
    "cogvideox": lambda key: models.CogVideoXTransformer3D(COG, key=key),
}


def _arrays(tree):
    return jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))[0]


def _layout(tree):
    """Every array's path, shape and dtype, and the non-array parts."""
    arrays = [(jax.tree_util.keystr(p), x.shape, jnp.dtype(x.dtype)) for p, x in
              jax.tree_util.tree_flatten_with_path(
                  eqx.filter(tree, lambda x: hasattr(x, "shape")))[0]]
    return arrays, jax.tree.structure(eqx.filter(tree, lambda x: hasattr(x, "shape"),
                                                 inverse=True))


@pytest.fixture(scope="module")
def built():
    """Each model built concretely (host path) from key 0 twice and from key 1."""
    return {name: [make(jax.random.key(s)) for s in (0, 0, 1)] for name, make in MAKERS.items()}


@pytest.mark.parametrize("name", list(MAKERS))
def test_same_key_same_model_other_key_other_model(built, name):
    a, again, other = built[name]
    assert all(isinstance(x, jax.Array) for _, x in _arrays(a)), "parameters are JAX arrays"
    for (path, x), (_, y), (_, z) in zip(_arrays(a), _arrays(again), _arrays(other)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=path)
        random = np.unique(np.asarray(x, np.float32)).size > 1
        assert random == (not np.array_equal(np.asarray(x), np.asarray(z))), path
    assert _layout(a) == _layout(other)


@pytest.mark.parametrize("name", list(MAKERS))
def test_abstract_build_matches_the_concrete_one(built, name):
    abstract = eqx.filter_eval_shape(MAKERS[name], jax.random.key(0))
    assert _layout(abstract) == _layout(built[name][0])


def test_traced_build_matches_the_concrete_one(built):
    """Inside `jit` (a traced key): `jax.random`, on the device; the same arrays'
    paths, shapes and dtypes (the image branch and bfloat16 included)."""
    make = MAKERS["wan_i2v_bf16"]
    arrays = lambda key: eqx.filter(make(key), eqx.is_array)  # noqa: E731
    key = jax.random.key(0)
    traced = jax.jit(arrays).lower(key).compile(harness.FAST_COMPILE)(key)
    assert _layout(traced)[0] == _layout(built["wan_i2v_bf16"][0])[0]
    for path, x in _arrays(traced):
        assert np.isfinite(np.asarray(x, np.float32)).all(), path


def _linears(tree):
    """Every `eqx.nn.Linear` of a model (stacked ones carry a leading layer axis)."""
    return [(jax.tree_util.keystr(p), m) for p, m in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, eqx.nn.Linear))[0] if isinstance(m, eqx.nn.Linear)]


@pytest.mark.parametrize("name", list(MAKERS))
def test_every_linear_is_uniform_in_its_bound(built, name):
    model = built[name][0]
    linears = _linears(model)
    assert len(linears) >= 8
    for path, m in linears:
        bound = 1 / np.sqrt(m.weight.shape[-1])
        for array in (m.weight, m.bias):
            x = np.asarray(array, np.float32)
            assert np.abs(x).max() <= bound * (1 + 2**-7), path  # bfloat16 rounds the bound
            assert np.abs(x).max() > 0.5 * bound, path


def test_norms_and_embeddings_start_as_documented(built):
    wan, cog = built["wan"][0], built["cogvideox"][0]
    block = wan.blocks
    for norm in (block.self_attn.norm_q, block.self_attn.norm_k, block.norm3):
        np.testing.assert_array_equal(np.asarray(norm.weight), 1)
    np.testing.assert_array_equal(np.asarray(block.norm3.bias), 0)
    attn = cog.transformer_blocks.attn1
    np.testing.assert_array_equal(np.asarray(attn.norm_q.weight), 1)
    np.testing.assert_array_equal(np.asarray(attn.norm_q.bias), 0)
    i2v = built["wan_i2v_bf16"][0]
    assert i2v.img_emb.pos_embed.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(i2v.img_emb.pos_embed, np.float32), 0)
    # PatchEmbedding: PyTorch's convolution default, U(+-1/sqrt(C * pt * ph * pw)).
    w = np.asarray(wan.patch_embedding.weight)
    assert np.abs(w).max() <= 1 / np.sqrt(4 * 1 * 2 * 2)
    # Wan's modulations: N(0, 1/dim), 1,536 values.
    mod = np.concatenate([np.asarray(block.modulation).ravel(),
                          np.asarray(wan.head.modulation).ravel()])
    assert abs(mod.std() * np.sqrt(WAN.dim) - 1) < 0.1 and abs(mod.mean()) * np.sqrt(WAN.dim) < 0.1


def test_statistics_of_a_large_layer_on_both_paths():
    """`nn.FeedForward(512, 1024)`: fc1's 524,288 weights, host path and traced path,
    both U(-b, b) with b = 1/sqrt(512): mean 0, std b/sqrt(3), and a flat histogram."""
    make = lambda key: nn.FeedForward(512, 1024, 64, key=key)  # noqa: E731
    b = 1 / np.sqrt(512)
    for ffn in (make(jax.random.key(3)), eqx.filter_jit(make)(jax.random.key(3))):
        w = np.asarray(ffn.fc1.weight, np.float64).ravel()
        assert abs(w.mean()) < 0.01 * b
        assert abs(w.std() / (b / np.sqrt(3)) - 1) < 0.01
        counts, _ = np.histogram(w, bins=16, range=(-b, b))
        assert counts.min() > 0.95 * w.size / 16 and counts.max() < 1.05 * w.size / 16
        assert np.abs(np.asarray(ffn.fc2.weight)).max() <= 1 / np.sqrt(1024)


def test_key_kinds_and_lora():
    # A typed key and the raw key of the same data build the same module.
    a = nn.Attention(32, 4, key=jax.random.key(7))
    b = nn.Attention(32, 4, key=jax.random.PRNGKey(7))
    for (path, x), (_, y) in zip(_arrays(a), _arrays(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=path)
    # with_lora: lora_A in +-1/sqrt(in), lora_B zeros, deterministic in its key.
    lora = nn.with_lora(a.q, 4, key=jax.random.key(1))
    again = nn.with_lora(a.q, 4, key=jax.random.key(1))
    adapter = lora.adapters["default"]
    assert np.abs(np.asarray(adapter.lora_A)).max() <= 1 / np.sqrt(32)
    np.testing.assert_array_equal(np.asarray(adapter.lora_A),
                                  np.asarray(again.adapters["default"].lora_A))
    np.testing.assert_array_equal(np.asarray(adapter.lora_B), 0)


def test_a_concrete_key_inside_a_trace_draws_with_jax_random():
    """A concrete key closed over by a traced function must not draw on the host (an
    abstract build of a 14B model would allocate it): the jaxpr draws with
    `jax.random` and holds no parameter-sized constant."""
    key = jax.random.key(0)
    jaxpr = jax.make_jaxpr(lambda: eqx.filter(nn.Attention(64, 4, key=key), eqx.is_array))()
    assert "random_bits" in str(jaxpr) or "threefry" in str(jaxpr)
    assert all(np.size(c) < 64 * 64 for c in jaxpr.consts)


def test_released_sizes_build_abstractly():
    key = jax.random.key(0)
    for preset, expected in (("t2v-1.3b", 1.42e9), ("t2v-14b", 14.29e9)):
        m = eqx.filter_eval_shape(lambda: models.WanTransformer3D(  # closed-over concrete key
            models.WanConfig.preset(preset), dtype=jnp.bfloat16, key=key))
        leaves = jax.tree.leaves(m)
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves if hasattr(x, "shape"))
        params = sum(x.size for x in leaves if hasattr(x, "shape"))
        assert abs(params / expected - 1) < 0.01, (preset, params)
        assert m.blocks.self_attn.q.weight.dtype == jnp.bfloat16
