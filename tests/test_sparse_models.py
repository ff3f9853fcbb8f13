"""Whole models with sliding tile attention (`attention=models.SlidingTile(tile, window)`).

The attention itself is checked against the float64 oracle in `test_sparse.py` and
`test_sparse_parallel.py`; here, that the models lay their tokens out correctly:

1. a window that covers the whole tile grid, with tiles that do not divide the patch
   grid (so the layout pads), gives exactly the model's full attention: the tile
   layout, its padding and the way back are invisible;
2. with real (per-head) windows the result differs from full attention, and the
   sharded run (`models.run_sharded`: ring with TP, Ulysses, USP with a zigzag ring)
   equals the single-device one, padding to whole tiles per device included;
3. the keyword it replaced, `sliding_tile=(tile, window)`, warns and gives the same
   numbers bit for bit (the model, `run_sharded`).
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
from vidax_eqx import models, nn, ShapeError


def _wan():
    config = models.WanConfig(dim=32, ffn_dim=64, num_heads=4, num_layers=1, in_channels=4,
                              out_channels=4, text_dim=16, freq_dim=16, patch_size=(1, 2, 2))
    model = models.WanTransformer3D(config, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, 4, 3, 8, 10))  # patch grid 3 x 4 x 5
    return model, x, jax.random.normal(jax.random.key(2), (1, 5, 16))


def _cogvideox():
    config = models.CogVideoXConfig(
        num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
        time_embed_dim=16, text_embed_dim=12, num_layers=1, sample_width=16, sample_height=12,
        sample_frames=9, patch_size=2, max_text_seq_length=5,
        use_rotary_positional_embeddings=True,
    )
    model = models.CogVideoXTransformer3D(config, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, 3, 4, 12, 16))  # patch grid 3 x 6 x 8
    return model, x, jax.random.normal(jax.random.key(2), (1, 5, 12))


MODELS = {"wan": functools.cache(_wan), "cogvideox": functools.cache(_cogvideox)}
TIMESTEP = jnp.array([500.0])
# Tiles that divide no dimension of either patch grid; per-head windows.
WINDOWS = models.SlidingTile((1, 3, 2), ((1, 1, 1), (3, 1, 3), (1, 3, 1), (3, 3, 3)))


@eqx.filter_jit
def _run(model, x, context, attention=None):
    return jax.vmap(lambda x, t, c: model(x, t, c, attention=attention))(x, TIMESTEP, context)


@functools.cache
def _reference(name):
    return _run(*MODELS[name](), WINDOWS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_window_over_the_whole_grid_is_full_attention(name):
    model, x, context = MODELS[name]()
    full = _run(model, x, context)
    whole = _run(model, x, context, models.SlidingTile((2, 4, 3), (5, 5, 5)))  # clamped
    np.testing.assert_allclose(whole, full, atol=2e-6 * float(jnp.abs(full).max()))
    sparse = _reference(name)
    assert float(jnp.abs(sparse - full).max()) > 1e-3  # the windows change the answer


CONFIGS = {
    "ring-tp": (dict(sp=2, tp=2), dict(sequence="ring", tp_axis="tp")),
    "usp-zigzag": (dict(sp=2, ring=2),
                   dict(sequence="usp", ring_axis="ring", layout="zigzag")),
}


# Every path (and per-head windows under each) is checked against the oracle in
# `test_sparse_parallel.py`; here one model-level run per model: USP with a zigzag
# ring for Wan, the joint text-prefix ring under TP (per-head windows per TP rank)
# for CogVideoX.
@pytest.mark.parametrize("name, config", [("wan", "usp-zigzag"), ("cogvideox", "ring-tp")])
def test_sharded_equals_single_device(name, config):
    model, x, context = MODELS[name]()
    mesh_axes, parallel_config = CONFIGS[config]
    mesh = harness.mesh(**mesh_axes)  # the first devices
    ref = _reference(name)
    sharded = nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(**parallel_config))
    run = eqx.filter_jit(models.run_sharded)
    out = run(sharded, x, TIMESTEP, context, mesh=mesh, attention=WINDOWS)
    np.testing.assert_allclose(out, ref, atol=2e-6 * float(jnp.abs(ref).max()))


def test_bad_attention_names_the_argument():
    model, x, context = _wan()
    # A plain pair (what `sliding_tile=` took) says neither which option: refused by
    # the call's type check (TokenLayout's ValueError says how to wrap it).
    with pytest.raises(ShapeError, match="`attention` must be SlidingTile or VideoSparseTiles "
                       "or BlockCausal or None; received a tuple"):
        _run(model, x, context, ((1, 2, 2), (1, 1, 1)))
    with pytest.raises(ValueError, match="odd"):
        _run(model, x, context, models.SlidingTile((1, 2, 2), (2, 1, 1)))


# -- 3. the deprecated keyword -------------------------------------------------------------


@eqx.filter_jit
def _run_old(model, x, context, sliding_tile):
    return jax.vmap(lambda x, t, c: model(x, t, c, sliding_tile=sliding_tile))(x, TIMESTEP, context)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_deprecated_sliding_tile_keyword(name):
    model, x, context = MODELS[name]()
    with pytest.warns(DeprecationWarning, match=r"sliding_tile=\.\.\.\) is deprecated.*"
                      r"attention=models\.SlidingTile"):
        old = _run_old(model, x, context, tuple(WINDOWS))  # a plain pair, as it took
    np.testing.assert_array_equal(old, _reference(name))
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="sliding_tile"):
        _run_old(model, x, context, ((1, 2, 2),))
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="pass `attention` only"):
        model(x[0], TIMESTEP[0], context[0], sliding_tile=WINDOWS, attention=WINDOWS)


def test_deprecated_sliding_tile_keyword_of_run_sharded():
    model, x, context = MODELS["wan"]()
    mesh = harness.mesh(sp=2)
    sharded = nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(sequence="ring"))

    @eqx.filter_jit
    def run(m, x, c):  # both spellings in one program: one compile
        return (models.run_sharded(m, x, TIMESTEP, c, mesh=mesh, attention=WINDOWS),
                models.run_sharded(m, x, TIMESTEP, c, mesh=mesh, sliding_tile=tuple(WINDOWS)))

    with pytest.warns(DeprecationWarning, match=r"run_sharded\(sliding_tile=\.\.\.\)"):
        new, old = run(sharded, x, context)
    np.testing.assert_array_equal(old, new)
