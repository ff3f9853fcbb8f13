"""`models.TokenLayout`, the token layout every transformer shares, and the spellings it
replaced.

1. `to_tokens` gives each device the rows an independent NumPy construction gives it
   (the tile order built token by token, zero rows for the padding, contiguous or
   zigzag chunks) for full attention, sliding tiles and video sparse tiles, on one
   device, Ulysses, a zigzag ring and USP; `from_tokens` undoes it exactly; the
   segment ids mark exactly the padding (after a text prefix);
2. `AttentionInputs` hands each kind of attention what it takes;
3. bad options raise, naming the argument (and video sparse attention over a joint
   text prefix is not implemented);
4. the deprecated spellings keep working for a release, each warning with the new
   spelling and giving the same numbers bit for bit: a block's positional call
   (`WanBlock`, `CogVideoXBlock`), and `sliding_tile=` / `video_sparse=` on
   `WanTransformer3D.cached_call` and `WanExperts` (the model's `__call__` and
   `run_sharded`: `test_sparse_models.py`, `test_vsa_models.py`).
"""

import functools
import itertools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
from vidax_eqx import models, nn


GRID = (3, 4, 5)  # 60 tokens: tiles of (2, 2, 2) are partial on every axis
S = math.prod(GRID)
TILE = (2, 2, 2)
OPTIONS = {
    "full": None,
    "sliding": models.SlidingTile(TILE, (1, 3, 3)),
    "vsa": models.VideoSparseTiles(TILE, 2),
}
# name: (mesh axes, ParallelConfig, the sequence's mesh axes ring-major, zigzag ring size)
PARALLEL = {
    "one": (None, nn.sharding.ParallelConfig(), (), 0),
    "ulysses8": (dict(sp=8), nn.sharding.ParallelConfig(sequence="ulysses"), ("sp",), 0),
    "ring4-zigzag": (dict(sp=4), nn.sharding.ParallelConfig(sequence="ring", layout="zigzag"),
                     ("sp",), 4),
    "usp2x2": (dict(sp=2, ring=2), nn.sharding.ParallelConfig(sequence="usp", ring_axis="ring"),
               ("ring", "sp"), 0),
}


def _tile_order(grid, tile) -> np.ndarray:
    """The raster index of the token at each slot of the tile layout, -1 for a slot that
    fills a partial tile: tiles in raster order of the tile grid, tokens in raster order
    inside a tile (written out token by token)."""
    F, H, W = grid
    tiles = [-(-g // t) for g, t in zip(grid, tile)]
    order = []
    for a, b, c in itertools.product(*(range(n) for n in tiles)):
        for i, j, k in itertools.product(*(range(t) for t in tile)):
            f, h, w = a * tile[0] + i, b * tile[1] + j, c * tile[2] + k
            order.append(f * H * W + h * W + w if f < F and h < H and w < W else -1)
    return np.asarray(order)


def _device_rows(values: np.ndarray, order, total: int, devices: int, zigzag: int):
    """Each device's rows, as a list: `values` in `order` (zeros at -1), zero rows to
    `total`, then contiguous chunks, or for a zigzag ring of `n` the chunks `r` and
    `2n - 1 - r` of `2n`."""
    rows = np.zeros((total, *values.shape[1:]), values.dtype)
    rows[: len(order)] = np.where((order >= 0)[:, None], values[np.maximum(order, 0)], 0)
    if zigzag:
        halves = np.split(rows, 2 * zigzag)
        return [np.concatenate([halves[r], halves[2 * zigzag - 1 - r]]) for r in range(zigzag)]
    return np.split(rows, devices)


def _run(layout: models.TokenLayout, name: str, fn, *args):
    """`fn(*args)` inside `shard_map` over the layout's mesh (replicated inputs), each
    device's rows concatenated along axis 0 in rank order; or on one device."""
    axes, _, seq_axes, _ = PARALLEL[name]
    if axes is None:
        return jax.jit(fn)(*args)
    mesh = harness.mesh(**axes)
    spec = P(seq_axes[0] if len(seq_axes) == 1 else seq_axes)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=spec,
                                 check_vma=False))(*args)


# Each option on one device and on the layouts that pad it differently (the models' tests
# run every option sharded through a whole model).
CASES = [("full", "ring4-zigzag"), ("sliding", "one"), ("sliding", "ulysses8"),
         ("sliding", "usp2x2"), ("vsa", "one"), ("vsa", "ring4-zigzag")]


@pytest.mark.parametrize("option, name", CASES)
def test_rows_and_round_trip(option, name):
    _, parallel, _, zigzag = PARALLEL[name]
    layout = models.TokenLayout(GRID, OPTIONS[option], parallel)
    values = np.random.default_rng(0).standard_normal((S, 3)).astype(np.float32) + 5.0
    pair = (jnp.asarray(values), jnp.asarray(values[:, 0]))  # any PyTree of per-token arrays

    def there(v):
        rows, rows_1d = layout.to_tokens(v)
        ids = layout.segment_ids()
        ids = jnp.zeros(rows.shape[0], jnp.int32) if ids is None else ids
        back, back_1d = layout.from_tokens((rows, rows_1d))
        return rows, rows_1d, ids, back[None], back_1d[None]

    rows, rows_1d, ids, back, back_1d = _run(layout, name, there, pair)
    devices = back.shape[0]
    # Every device gets the whole video back, bit for bit.
    np.testing.assert_array_equal(back, np.broadcast_to(values, back.shape))
    np.testing.assert_array_equal(back_1d, np.broadcast_to(values[:, 0], back_1d.shape))
    np.testing.assert_array_equal(rows[:, 0], rows_1d)
    order = np.arange(S) if option == "full" else _tile_order(GRID, TILE)
    assert layout.length == len(order)
    total = rows.shape[0]
    assert total % devices == 0 and total >= len(order)
    multiple = devices * (2 if zigzag else 1)
    if option != "full" and parallel.ring_axis is not None:  # whole tiles per chunk
        multiple *= math.prod(TILE)
    if option == "vsa":  # whole tiles per device on any mesh (VSA's own padding)
        multiple = math.lcm(multiple, devices * math.prod(TILE))
        assert total % multiple == 0
    else:
        assert total == -(-len(order) // multiple) * multiple
    want = _device_rows(values, order, total, devices, zigzag)
    got = np.split(rows, devices)
    for r, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, err_msg=f"device {r}")
    # The padding rows (beyond the layout's length) and only they are segment id -1.
    want_ids = _device_rows(np.where(np.arange(total) < len(order), 0, -1)[:, None],
                            np.arange(total), total, devices, zigzag)
    np.testing.assert_array_equal(ids, np.concatenate(want_ids)[:, 0] if parallel.sequence_axes
                                  else np.zeros(total))


def test_text_prefix_and_attention_inputs():
    rope = (jnp.ones((S, 4)), jnp.zeros((S, 4)))
    parallel = PARALLEL["ring4-zigzag"][1]
    layout = models.TokenLayout(GRID, OPTIONS["sliding"], parallel, text_len=3)
    assert layout.mask.text_len == 3 and layout.mask.tile == TILE and layout.video_sparse is None

    def there():
        inputs = layout.attention_inputs(layout.to_tokens(rope))
        return inputs.segment_ids, inputs.rope[0]

    ids, cos = _run(layout, "ring4-zigzag", there)
    per_device = np.split(np.asarray(ids), 4)
    assert all((d[:3] == 0).all() for d in per_device)  # the text is never padding
    video = [d[3:] for d in per_device]
    assert cos.shape[0] == sum(v.size for v in video) == 128  # 96, padded to 2 x 4 tiles
    want = _device_rows(np.where(np.arange(128) < layout.length, 0, -1)[:, None],
                        np.arange(128), 128, 4, 4)
    np.testing.assert_array_equal(np.concatenate(video), np.concatenate(want)[:, 0])
    # What each kind of attention takes.
    one = models.TokenLayout(GRID, OPTIONS["sliding"], text_len=3)
    kw = one.attention_inputs(rope).kwargs()
    assert set(kw) == {"rope", "segment_ids", "mask"} and kw["mask"] == layout.mask
    vsa = models.TokenLayout(GRID, OPTIONS["vsa"]).attention_inputs(rope).kwargs()
    assert set(vsa) == {"rope", "video_sparse"} and vsa["video_sparse"].selected == 2
    full = models.TokenLayout(GRID).attention_inputs(None).kwargs()
    assert full == dict(rope=None, segment_ids=None, mask=None)


def test_bad_layouts_raise():
    with pytest.raises(ValueError, match="`attention` must be models.SlidingTile.*plain pair"):
        models.TokenLayout(GRID, (TILE, (1, 3, 3)))
    with pytest.raises(ValueError, match="`attention` must be"):
        models.TokenLayout(GRID, "sliding")
    with pytest.raises(ValueError, match="`grid`"):
        models.TokenLayout((3, 4), None)
    with pytest.raises(ValueError, match="`text_len`"):
        models.TokenLayout(GRID, None, text_len=-1)
    with pytest.raises(ValueError, match="`parallel`"):
        models.TokenLayout(GRID, None, "ulysses")
    with pytest.raises(ValueError, match="odd"):
        models.TokenLayout(GRID, models.SlidingTile(TILE, (2, 3, 3)))
    with pytest.raises(NotImplementedError, match="CogVideoXTransformer3D: .*text prefix"):
        models.TokenLayout(GRID, OPTIONS["vsa"], text_len=4, owner="CogVideoXTransformer3D")


# -- 4. the deprecated spellings ----------------------------------------------------------
# Each old spelling and its new one run in one compiled program (one compile per test);
# the warning is raised while it is traced.


WAN = models.WanConfig(dim=32, ffn_dim=48, num_heads=4, num_layers=1, in_channels=4,
                       out_channels=4, text_dim=16, freq_dim=16)
JIT = functools.partial(eqx.filter_jit, compiler_options=harness.FAST_COMPILE)


def _normal(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _assert_same(old, new):
    old, new = jax.tree.leaves(old), jax.tree.leaves(new)
    assert len(old) == len(new)
    for a, b in zip(old, new):
        np.testing.assert_array_equal(a, b)


def test_deprecated_wan_block_call():
    block = models.WanBlock(WAN, parallel=nn.sharding.ParallelConfig(), implementation="xla",
                            dtype=jnp.float32, key=jax.random.key(0))
    grid = (2, 2, 3)
    layout = models.TokenLayout(grid, models.SlidingTile((1, 2, 2), (1, 1, 1)))
    rope = layout.to_tokens(nn.functional.rope_3d(grid, WAN.head_dim, WAN.rope_theta))
    x = _normal(1, (layout.length, WAN.dim))
    e0, context = 0.1 * _normal(2, (6, WAN.dim)), _normal(3, (5, WAN.dim))

    @JIT
    def run(block, x, e0, context, rope):
        new = block(x, models.WanBlockInputs(layout.attention_inputs(rope), e0, context))
        old = block(x, e0, context, rope, None, None, layout.mask)
        by_name = block(x, e0=e0, context=context, rope=rope, segment_ids=None,
                        context_image=None, mask=layout.mask)
        return new, old, by_name

    with pytest.warns(DeprecationWarning, match=r"WanBlock\(x, e0, .*use WanBlock\(x, "
                      r"models\.WanBlockInputs") as record:
        new, old, by_name = run(block, x, e0, context, rope)
    assert len(record) == 2 and record[0].filename == __file__
    _assert_same(old, new)
    _assert_same(by_name, new)
    with pytest.raises(TypeError, match="missing its `inputs`"):
        block(x)


def test_deprecated_cogvideox_block_call():
    config = models.CogVideoXConfig(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                    out_channels=4, time_embed_dim=8, text_embed_dim=8,
                                    num_layers=1, max_text_seq_length=3)
    block = models.CogVideoXBlock(config, parallel=nn.sharding.ParallelConfig(),
                                  implementation="xla", dtype=jnp.float32, key=jax.random.key(0))
    x, context, temb = _normal(1, (12, 16)), _normal(2, (3, 16)), _normal(3, (8,))
    rope = nn.functional.rope_3d((1, 3, 4), 8)

    @JIT
    def run(block, x, context, temb, rope):
        inputs = models.CogVideoXBlockInputs(models.AttentionInputs(rope, None), temb)
        return block(x, context, inputs), block(x, context, temb, rope, None)

    with pytest.warns(DeprecationWarning, match=r"CogVideoXBlock\(x, context, temb, .*"
                      r"models\.CogVideoXBlockInputs"):
        new, old = run(block, x, context, temb, rope)
    _assert_same(old, new)


@pytest.fixture(scope="module")
def wan_and_inputs():
    model = models.WanTransformer3D(WAN, implementation="xla", key=jax.random.key(0))
    x = _normal(1, (2, 4, 2, 4, 6))  # patch grid 2 x 2 x 3
    return model, x, jnp.array([900.0, 850.0]), _normal(2, (2, 5, 16))


TILES = models.SlidingTile((1, 2, 2), (1, 1, 1))


def test_deprecated_keyword_of_cached_call(wan_and_inputs):
    model, x, t, context = wan_and_inputs

    @JIT
    def run(model):
        def both(x, t, c):
            cache = models.StepCache()
            return (model.cached_call(x, t, c, cache, attention=TILES),
                    model.cached_call(x, t, c, cache, sliding_tile=tuple(TILES)))

        return jax.vmap(both)(x, t, context)

    with pytest.warns(DeprecationWarning, match=r"WanTransformer3D\.cached_call\(sliding_tile="
                      r"\.\.\.\) is deprecated.*attention=models\.SlidingTile") as record:
        new, old = run(model)
    assert record[0].filename == __file__  # the caller's line, past Equinox's wrappers
    _assert_same(old, new)


def test_deprecated_keyword_of_experts(wan_and_inputs):
    model, x, t, context = wan_and_inputs
    low = models.WanTransformer3D(WAN, implementation="xla", key=jax.random.key(5))
    experts = models.WanExperts(model, low, 0.875)

    @JIT
    def run(experts):
        def both(x, t, c):
            return (experts(x, t, c, attention=TILES),
                    experts(x, t, c, sliding_tile=tuple(TILES)))

        return jax.vmap(both)(x, t, context)

    with pytest.warns(DeprecationWarning, match=r"WanExperts\(sliding_tile=\.\.\.\)") as record:
        new, old = run(experts)
    assert len(record) == 1 and record[0].filename == __file__
    _assert_same(old, new)
