"""Wan 2.2 on tiny random models: a timestep per token, sharded; TI2V's timestep
pattern; Wan 2.1 FLF2V's image position embedding; the two experts of A14B.

The models are the `t2v` and `flf2v` fixtures' weights (diffusers' random
initialization; loading compiles nothing) perturbed, without their reference outputs
(diffusers' are `test_wan22_parity.py`'s): the reference here is the single-device
float32 model call, or the routing written out in Python. Sharded results must be
within `oracle.tolerance(float32)` of it (outputs relative to their largest magnitude,
gradients per parameter relative to the parameter's gradient, floored at
`ZERO_GRADIENT` of the model's largest). On 8 simulated CPU devices:

1. a per-token timestep that is not constant (TI2V's pattern for one example, random
   for the other) on 45 patch tokens (3 x 3 x 5: padded on every mesh) equals one
   device under Ulysses x TP, a zigzag ring x dp, USP with a zigzag ring x TP, sliding
   tile attention on a ring x TP, and FSDP over dp x sp (x TP, Ulysses): the output,
   and for Ulysses x TP and USP the gradient of every parameter with a random
   cotangent; a scalar timestep equals the same value repeated per token;
2. `wan_image_timestep` against Wan 2.2's construction (a mask over the latent frames,
   subsampled on the patch grid: `(mask[:, ::2, ::2] * t).flatten()`);
3. FLF2V: the position embedding is added to the image features (a model with it
   equals one without it on the features plus the embedding, and differs from one
   without it on the features alone); both checkpoint layouts keep it, by its names;
4. `WanExperts`: a traced timestep routes one call (the boundary itself is high noise);
   the compiled program is a `conditional` whose branches each hold one expert's
   matmuls and nothing of them outside; `run_sharded` routes a batch that agrees or
   mixes on dp x sp x TP; a training step through `route` changes one expert and its
   Adam state (the loss is the selected expert's) and leaves the other's bit for bit
   (on one device, and with `run_sharded` inside the step on dp x sp);
   checkpoints in both layouts keep the experts and the boundary, and Wan 2.2's own
   layout defaults the boundary by `model_type`;
5. bad inputs raise `ValueError`s that name the argument and what was received.

Each program compiles once (module-scoped fixtures; `FAST_COMPILE`).
"""

import dataclasses
import functools
import json
import pathlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import harness
import oracle
from benchmarks import _hlo
from vidax_eqx import models, nn


FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "wan"
# The shape of the Wan fixture `t2v` (diffusers' random initialization): the models here
# are it, perturbed (loading costs no compile, an initialization does).
CONFIG = models.WanConfig(dim=64, ffn_dim=96, num_heads=8, num_layers=2, in_channels=4,
                          out_channels=4, text_dim=32, freq_dim=32)
VIDEO = (4, 3, 6, 10)  # patch grid 3 x 3 x 5 = 45 tokens: divides no mesh here
GRID = (3, 3, 5)
TOKENS = 45
RTOL = oracle.tolerance(np.float32)  # 1e-5
# The floor of a gradient's scale, as a fraction of the model's largest gradient: a
# parameter whose gradient is tiny is judged against the model's scale, not its own.
ZERO_GRADIENT = 1e-2
JIT = functools.partial(eqx.filter_jit, compiler_options=harness.FAST_COMPILE)


def _image_timestep(t, latent_grid, patch_size=(1, 2, 2), cond_frames=1):
    """Wan 2.2's TI2V timestep, as its `generate` builds it: a mask over the latent
    frames (the first `cond_frames` clean), subsampled on the patch grid, times `t`."""
    mask = np.ones(latent_grid, np.float32)
    mask[:cond_frames] = 0
    pt, ph, pw = patch_size
    return (mask[::pt, ::ph, ::pw] * np.float32(t)).flatten()


def _random_wan(seed: int):
    """A random Wan of `CONFIG`: the `t2v` fixture with every array perturbed (norms
    and biases away from 1 and 0; different seeds, different models)."""
    model = models.WanTransformer3D.from_pretrained(FIXTURES / "t2v" / "diffusers")
    assert model.config == CONFIG
    return harness.perturbed(model, seed)


def _batched(model, x, t, c, **kwargs):
    return jax.vmap(lambda x, t, c: model(x, t, c, **kwargs))(x, t, c)


@JIT
def _forward(run, model, x, t, c):
    return run(model, x, t, c)


@JIT
def _vjp(run, model, x, t, c, cotangent):
    """`(out, grads)`: `run(model, x, t, c)` and its VJP with respect to the model."""
    out, pull = eqx.filter_vjp(lambda m: run(m, x, t, c), model)
    return out, pull(cotangent)[0]


# -- 1. a timestep per token, sharded ---------------------------------------------------


@pytest.fixture(scope="module")
def wan():
    """`(model, (x, t, c), cotangent)`: a random model (norms and biases perturbed) and
    a batch of 2 with per-token timesteps: TI2V's pattern, then random."""
    model = _random_wan(1)
    rng = np.random.default_rng(2)
    x = jnp.asarray(harness.normal(rng, (2, *VIDEO)))
    c = jnp.asarray(harness.normal(rng, (2, 7, CONFIG.text_dim)))
    t = np.stack([_image_timestep(700.0, VIDEO[1:]), rng.uniform(0, 1000, TOKENS)])
    cotangent = jnp.asarray(harness.normal(rng, x.shape))
    return model, (x, jnp.asarray(t, jnp.float32), c), cotangent


def test_inputs_are_not_constant(wan):
    _, (_, t, _), _ = wan
    assert t.shape == (2, TOKENS)
    per_frame = GRID[1] * GRID[2]
    assert (t[0, :per_frame] == 0).all() and (t[0, per_frame:] == 700).all()
    assert len(np.unique(np.asarray(t[1]))) == TOKENS


# A window of 3 x 1 x 1 tiles over the tile grid 3 x 2 x 2 (tiles of 1 x 2 x 3 tokens
# that divide neither the height nor the width of the patch grid: the tile layout pads).
TILE = models.SlidingTile((1, 2, 3), (3, 1, 1))

# name: (mesh axes, ParallelConfig, batch axis, sliding tile, gradients too). The
# gradients of two (an FSDP gradient compiles for ~15 s here; tests/test_fsdp.py has them).
SHARDED = {
    "ulysses-sp4-tp2": (dict(sp=4, tp=2), dict(sequence="ulysses", tp_axis="tp"),
                        None, None, True),
    "ring-zigzag-dp2-sp4": (dict(dp=2, sp=4), dict(sequence="ring", layout="zigzag"),
                            "dp", None, False),
    "usp-zigzag-sp2-ring2-tp2": (dict(sp=2, tp=2, ring=2), dict(
        sequence="usp", ring_axis="ring", layout="zigzag", tp_axis="tp"), None, None, True),
    "tile-ring-sp4-tp2": (dict(sp=4, tp=2), dict(sequence="ring", tp_axis="tp"),
                          None, TILE, False),
    "fsdp-dp2-sp2-tp2-ulysses": (dict(dp=2, sp=2, tp=2), dict(
        sequence="ulysses", tp_axis="tp", fsdp_axes=("dp", "sp")), "dp", None, False),
}


@pytest.fixture(scope="module")
def reference(wan):
    """`get(attention) -> (out, grads or None)` on one device, each computed once:
    with gradients for full attention (the configurations with gradients use it)."""
    model, args, cotangent = wan
    cache = {}

    def get(attention):
        if attention not in cache:
            if attention is None:
                cache[None] = _vjp(_batched, model, *args, cotangent)
            else:
                run = functools.partial(_batched, attention=attention)
                cache[attention] = _forward(run, model, *args), None
        return cache[attention]

    return get


@pytest.mark.parametrize("name", SHARDED)
def test_per_token_timestep_sharded_equals_one_device(wan, reference, name):
    mesh_axes, config, batch_axis, attention, gradients = SHARDED[name]
    model, args, cotangent = wan
    mesh = harness.mesh(**mesh_axes)
    sharded = nn.sharding.shard_module(nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(**config)), mesh)
    run = functools.partial(models.run_sharded, mesh=mesh, batch_axis=batch_axis,
                            attention=attention)
    out1, grads1 = reference(attention)
    if gradients:
        out, grads = _vjp(run, sharded, *args, cotangent)
        harness.assert_leaves_close(grads, grads1, f"{name}: gradients", ZERO_GRADIENT)
    else:
        out = _forward(run, sharded, *args)
    assert out.shape == (2, *VIDEO)
    assert harness.max_rel_error(out, out1) < RTOL


def test_scalar_timestep_is_a_constant_per_token_one(wan, reference):
    model, (x, _, c), cotangent = wan
    t = jnp.array([700.0, 131.5])
    scalar = _forward(_batched, model, x, t, c)
    # The reference's program (a VJP), on the same value for every token.
    per_token, _ = _vjp(_batched, model, x, jnp.repeat(t[:, None], TOKENS, axis=1), c, cotangent)
    assert harness.max_rel_error(per_token, scalar) < RTOL
    # ... and the per-token timesteps of the fixture are not: its output differs.
    assert harness.max_rel_error(reference(None)[0], scalar) > 1e-2


# -- 2. wan_image_timestep ----------------------------------------------------------------


@pytest.mark.parametrize("patch_size, latent_grid", [((1, 2, 2), (3, 6, 10)),
                                                     ((2, 2, 2), (4, 4, 6))])
@pytest.mark.parametrize("cond_frames", [0, 1, 2])
def test_wan_image_timestep_is_wans_mask(patch_size, latent_grid, cond_frames):
    got = models.wan_image_timestep(700.0, latent_grid, patch_size=patch_size,
                                    cond_frames=cond_frames)
    want = _image_timestep(700.0, latent_grid, patch_size, cond_frames)
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), want)
    # The latents' shape (C, F, H, W) is taken too, and a traced timestep.
    traced = jax.jit(lambda t: models.wan_image_timestep(
        t, (48, *latent_grid), patch_size=patch_size, cond_frames=cond_frames))(jnp.float32(700))
    np.testing.assert_array_equal(np.asarray(traced), want)


def test_wan_image_timestep_is_the_models_token_order():
    # Token i of the model is patch (f, h, w) in frame-major order: with cond_frames=1
    # the first H/ph * W/pw tokens are the first frame's.
    t = np.asarray(models.wan_image_timestep(500.0, VIDEO, cond_frames=1))
    assert t.shape == (TOKENS,)
    np.testing.assert_array_equal(t.reshape(GRID)[0], 0)
    np.testing.assert_array_equal(t.reshape(GRID)[1:], 500)


# -- 3. FLF2V ------------------------------------------------------------------------------


# The shape of the Wan fixture `flf2v` (diffusers' random initialization).
FLF2V = models.WanConfig(dim=32, ffn_dim=96, num_heads=4, num_layers=2, in_channels=12,
                         out_channels=4, text_dim=16, freq_dim=32, image_dim=24,
                         pos_embed_seq_len=10)


@pytest.fixture(scope="module")
def flf2v():
    """`(model, (x, t, c, image))`: the `flf2v` fixture perturbed (its position embedding
    random) and one example with the image features of two frames (5 + 5 tokens)."""
    model = models.WanTransformer3D.from_pretrained(FIXTURES / "flf2v" / "diffusers")
    assert model.config == FLF2V
    model = harness.perturbed(model, 4)
    rng = np.random.default_rng(5)
    x = jnp.asarray(harness.normal(rng, (1, FLF2V.in_channels, 2, 4, 4)))
    c = jnp.asarray(harness.normal(rng, (1, 5, FLF2V.text_dim)))
    image = jnp.asarray(harness.normal(rng, (1, 10, 24)))
    return model, (x, jnp.array([600.0]), c, image)


@JIT
def _flf2v_forward(model, x, t, c, image):
    return jax.vmap(lambda x, t, c, i: model(x, t, c, context_image=i))(x, t, c, image)


def test_flf2v_adds_the_position_embedding(flf2v):
    model, (x, t, c, image) = flf2v
    pos = model.img_emb.pos_embed
    assert pos.shape == (1, 10, 24) and float(jnp.abs(pos).min()) > 0
    without = eqx.tree_at(lambda m: m.img_emb.pos_embed, model, jnp.zeros_like(pos))
    out = _flf2v_forward(model, x, t, c, image)
    # The embedding is added to the features before the projection: the same as a
    # model without it on the features plus it ...
    moved = _flf2v_forward(without, x, t, c, image + pos)
    assert harness.max_rel_error(out, moved) < RTOL
    # ... and not the same as a model without it on the features alone.
    assert harness.max_rel_error(_flf2v_forward(without, x, t, c, image), out) > 1e-3


@pytest.mark.parametrize("layout, name", [("diffusers", "condition_embedder.image_embedder.pos_embed"),
                                          ("wan", "img_emb.emb_pos")])
def test_flf2v_checkpoint_keeps_the_position_embedding(flf2v, tmp_path, layout, name):
    model, _ = flf2v
    state = model.state_dict(layout=layout)
    assert state[name].shape == (1, 10, 24)
    np.testing.assert_array_equal(state[name], np.asarray(model.img_emb.pos_embed))
    model.save_pretrained(tmp_path, layout=layout)
    loaded = models.WanTransformer3D.from_pretrained(tmp_path)
    assert loaded.config == FLF2V
    assert harness.same_arrays(loaded, model)


# -- 4. the two experts of A14B ------------------------------------------------------------


BOUNDARY = 0.875
# One example per row: high noise, the boundary itself (high), just below it, low noise.
ROUTED = (950.0, 875.0, 874.5, 300.0)
EXPERT_VIDEO = (4, 2, 4, 4)  # 8 patch tokens


@pytest.fixture(scope="module")
def experts():
    """`(experts, (x, c), expert_outputs)`: two random experts (different weights), a
    batch of 4 examples, and each expert's output on the batch at `ROUTED`
    (`(high, low)`, one device)."""
    high, low = _random_wan(11), _random_wan(13)
    e = models.WanExperts(high, low, BOUNDARY)
    rng = np.random.default_rng(14)
    x = jnp.asarray(harness.normal(rng, (4, *EXPERT_VIDEO)))
    c = jnp.asarray(harness.normal(rng, (4, 5, CONFIG.text_dim)))
    t = jnp.asarray(ROUTED)
    return e, (x, c), tuple(np.asarray(_forward(_batched, m, x, t, c)) for m in e.experts)


def _per_example(t, expert_outputs):
    """Each example's output from the expert its timestep selects, as diffusers'
    `WanPipeline` chooses it (`t >= boundary * num_train_timesteps`: high noise)."""
    high, low = expert_outputs
    pick = np.asarray(t) >= BOUNDARY * 1000
    return np.where(pick.reshape(-1, 1, 1, 1, 1), high, low)


@pytest.fixture(scope="module")
def routed(experts):
    """The compiled single-example call of the experts, `(arrays, x, t, c) -> out`, the
    timestep an argument (traced): `jax.jit` of the call on the experts' arrays, as
    `eqx.filter_jit` runs it, lowered and compiled once to be run and read."""
    e, (x, c), _ = experts
    arrays, static = eqx.partition(e, eqx.is_array)
    call = jax.jit(lambda a, x, t, c: eqx.combine(a, static)(x, t, c))
    return call.lower(arrays, x[0], jnp.float32(0), c[0]).compile(harness.FAST_COMPILE)


def test_experts_route_a_traced_timestep(experts, routed):
    e, (x, c), outputs = experts
    arrays = eqx.filter(e, eqx.is_array)
    for i, t in enumerate(ROUTED):
        out = routed(arrays, x[i], jnp.float32(t), c[i])
        chosen, other = (0, 1) if t >= BOUNDARY * 1000 else (1, 0)
        assert harness.max_rel_error(out, outputs[chosen][i]) < RTOL, t
        assert harness.max_rel_error(out, outputs[other][i]) > 1e-2, t
    assert e.boundary_timestep == 875.0
    # A per-token timestep routes by its largest value.
    assert bool(e.is_high_noise(jnp.array([0.0, 875.0]))) is True
    assert bool(e.is_high_noise(jnp.array([874.0, 0.0]))) is False


def _branch_flops(compiled) -> tuple[float, list[float]]:
    """`(flops, [flops of each branch])` of the one `conditional` of a compiled
    program: its dot FLOPs (a conditional counting its costliest branch), and each
    branch's."""
    module = _hlo.parse(compiled.as_text())
    conditionals = [i for instrs in module.computations.values() for i in instrs
                    if i.opcode == "conditional"]
    assert len(conditionals) == 1, [i.rest[:200] for i in conditionals]
    names = [b.strip().lstrip("%") for b in
             conditionals[0].rest.split("branch_computations={", 1)[1].split("}", 1)[0].split(",")]
    branches = [_hlo.dot_flops(module._replace(entry=n))["flops"] for n in names]
    return _hlo.dot_flops(module)["flops"], branches


def test_compiled_experts_run_one_expert(experts, routed):
    e, (x, c), _ = experts
    arrays, static = eqx.partition(e.high_noise, eqx.is_array)
    one = jax.jit(lambda a, x, t, c: eqx.combine(a, static)(x, t, c)).lower(
        arrays, x[0], jnp.float32(0), c[0]).compile(harness.FAST_COMPILE)
    expert = _hlo.dot_flops(one.as_text())["flops"]
    assert expert > 0
    total, branches = _branch_flops(routed)
    # Two branches, each one expert's matmuls; the program's whole work is one branch's:
    # nothing of an expert outside the conditional.
    assert branches == [expert, expert]
    assert total == expert


# A batch of 4 over dp 2 (2 examples per device): all high, all low, mixed on every
# device, and each device agreeing with itself but not with the other.
BATCHES = {
    "high": (950.0, 900.0, 875.0, 999.0),
    "low": (300.0, 874.0, 0.0, 500.0),
    "mixed": (950.0, 300.0, 100.0, 900.0),
    "split": (950.0, 900.0, 300.0, 100.0),
}
EXPERT_MESH = dict(dp=2, sp=2, tp=2)
EXPERT_PARALLEL = nn.sharding.ParallelConfig(sequence="ulysses", tp_axis="tp")


@pytest.fixture(scope="module")
def sharded_experts(experts):
    """The experts placed on dp x sp x TP (Ulysses), the mesh, and their compiled
    `run_sharded` over a batch of 4 split over dp, `(arrays, x, t, c) -> out`."""
    e, (x, c), _ = experts
    mesh = harness.mesh(**EXPERT_MESH)
    placed = nn.sharding.shard_module(nn.sharding.with_parallel(e, EXPERT_PARALLEL), mesh)
    arrays, static = eqx.partition(placed, eqx.is_array)
    call = jax.jit(lambda a, x, t, c: models.run_sharded(
        eqx.combine(a, static), x, t, c, mesh=mesh, batch_axis="dp"))
    compiled = call.lower(arrays, x, jnp.zeros(4), c).compile(harness.FAST_COMPILE)
    return placed, mesh, compiled


@pytest.mark.parametrize("batch", BATCHES)
def test_run_sharded_routes_the_batch(experts, sharded_experts, batch):
    e, (x, c), _ = experts
    placed, _, compiled = sharded_experts
    t = jnp.asarray(BATCHES[batch])
    want = _per_example(t, tuple(_forward(_batched, m, x, t, c) for m in e.experts))
    out = compiled(eqx.filter(placed, eqx.is_array), x, t, c)
    assert harness.max_rel_error(out, want) < RTOL


def test_run_sharded_runs_both_experts_only_for_a_mixed_batch(sharded_experts):
    _, _, compiled = sharded_experts
    total, (high, low, mixed) = _branch_flops(compiled)
    assert high == low > 0 and mixed == 2 * high
    assert total == mixed


# Adam's first step is lr * g / (|g| + eps): with optax's eps = 1e-8 a sign, which float32
# noise in a gradient near zero would flip; this eps keeps the step smooth below it.
ADAM = optax.adam(1e-3, eps=1e-4)


def _train_step(run):
    """A jitted `(experts, states, x, t, c, target) -> (experts, states, loss)`: one Adam
    step on the mean squared error of `run(expert, x, t, c)` for the expert the scalar
    `t` selects (`route`), every example at `t`."""

    @JIT
    def step(experts, states, x, t, c, target):
        def train(expert, i, states):
            params, static = eqx.partition(expert, eqx.is_array)

            def loss(p):
                out = run(eqx.combine(p, static), x, jnp.full(x.shape[:1], t), c)
                return jnp.mean(jnp.square(out - target))

            value, grads = jax.value_and_grad(loss)(params)
            updates, state = ADAM.update(grads, states[i], params)
            states = states[:i] + (state,) + states[i + 1:]
            return experts.with_expert(i, eqx.apply_updates(expert, updates)), states, value

        return experts.route(t, train, states)

    return step


def _adam_states(e):
    return tuple(ADAM.init(eqx.filter(m, eqx.is_array)) for m in e.experts)


@pytest.fixture(scope="module")
def trained(experts):
    """`{t: (experts, states, loss)}` after one step on one device from the fresh
    experts, for a high-noise and a low-noise timestep; and the target."""
    e, (x, c), _ = experts
    target = jnp.asarray(harness.normal(np.random.default_rng(15), x.shape))
    step = _train_step(_batched)
    return {t: step(e, _adam_states(e), x, jnp.float32(t), c, target) for t in (950.0, 300.0)}, target


def _assert_one_expert_trained(before, states_before, after, states, chosen):
    other = 1 - chosen
    assert harness.same_arrays(after.experts[other], before.experts[other])
    assert harness.same_arrays(states[other], states_before[other])
    assert int(states[other][0].count) == 0 and int(states[chosen][0].count) == 1
    # Adam's first step moves every weight whose gradient is not zero.
    changed = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
        harness.arrays(after.experts[chosen]), harness.arrays(before.experts[chosen]))]
    assert all(changed), harness.leaf_names(after.experts[chosen])
    assert not harness.same_arrays(states[chosen], states_before[chosen])


@pytest.mark.parametrize("t, chosen", [(950.0, 0), (300.0, 1)])
def test_route_trains_one_expert(experts, trained, t, chosen):
    e, (x, c), _ = experts
    steps, target = trained
    after, states, loss = steps[t]
    _assert_one_expert_trained(e, _adam_states(e), after, states, chosen)
    # The loss is the selected expert's.
    out = _forward(_batched, e.experts[chosen], x, jnp.full(4, t, jnp.float32), c)
    want = float(jnp.mean(jnp.square(out - target)))
    assert abs(float(loss) - want) <= RTOL * want


@pytest.mark.slow  # both experts' sharded gradients compiled: 10-15 s
def test_route_trains_one_expert_sharded(experts, trained):
    """The step with `run_sharded` inside each branch, the experts on dp x sp (Ulysses):
    the single-device step's loss, first moment and trained expert; the other expert
    and its state untouched."""
    e, (x, c), _ = experts
    mesh = harness.mesh(dp=2, sp=2)
    placed = nn.sharding.shard_module(nn.sharding.with_parallel(e, nn.sharding.ParallelConfig(sequence="ulysses")), mesh)
    steps, target = trained
    t = 300.0  # the low-noise expert
    expert_run = functools.partial(models.run_sharded, mesh=mesh, batch_axis="dp")
    states = nn.sharding.shard_like(_adam_states(e), placed.high_noise, mesh)
    after, new_states, loss = _train_step(expert_run)(placed, states, x, jnp.float32(t), c, target)
    _assert_one_expert_trained(placed, states, after, new_states, 1)
    want, want_states, want_loss = steps[t]
    assert abs(float(loss) - float(want_loss)) <= RTOL * abs(float(want_loss))
    harness.assert_leaves_close(new_states[1][0].mu, want_states[1][0].mu, "Adam's first moment",
                                ZERO_GRADIENT)
    harness.assert_leaves_close(after.low_noise, want.low_noise, "the trained expert")


@pytest.mark.parametrize("layout", ["diffusers", "wan"])
def test_experts_checkpoint_roundtrip(experts, tmp_path, layout):
    e, _, _ = experts
    e = models.WanExperts(e.high_noise, e.low_noise, 0.8)  # not Wan's
    e.save_pretrained(tmp_path, layout=layout)
    folders = {"diffusers": ["model_index.json", "transformer", "transformer_2"],
               "wan": ["high_noise_model", "low_noise_model"]}[layout]
    assert sorted(p.name for p in tmp_path.iterdir()) == folders
    loaded = models.WanExperts.from_pretrained(tmp_path)
    assert loaded.boundary == 0.8 and loaded.num_train_timesteps == 1000
    assert harness.same_arrays(loaded.high_noise, e.high_noise)
    assert harness.same_arrays(loaded.low_noise, e.low_noise)
    assert not harness.same_arrays(loaded.high_noise, e.low_noise)
    assert models.WanExperts.from_pretrained(tmp_path, boundary=0.5).boundary == 0.5


@pytest.mark.parametrize("model_type, boundary", [("t2v", 0.875), ("i2v", 0.9)])
def test_wan_layout_default_boundary(experts, tmp_path, model_type, boundary):
    """Wan 2.2's own release carries no boundary: it comes from `model_type`, as Wan
    2.2's configs set it."""
    e, _, _ = experts
    e.save_pretrained(tmp_path, layout="wan")
    for folder in ("high_noise_model", "low_noise_model"):
        path = tmp_path / folder / "config.json"
        config = json.loads(path.read_text())
        del config["boundary_ratio"]
        path.write_text(json.dumps({**config, "model_type": model_type}))
    loaded = models.WanExperts.from_pretrained(tmp_path)
    assert loaded.boundary == boundary
    assert loaded.config.image_dim is None  # A14B I2V: no CLIP branch
    assert harness.same_arrays(loaded.low_noise, e.low_noise)


# -- 5. bad inputs -------------------------------------------------------------------------


def _abstract(config=CONFIG, parallel=nn.sharding.ParallelConfig()):
    return eqx.filter_eval_shape(lambda key: models.WanTransformer3D(
        config, parallel=parallel, key=key), jax.random.key(0))


def test_wrong_per_token_timestep_length(wan):
    model, (x, t, c), _ = wan
    with pytest.raises(ValueError, match=r"per-token `timestep`.* 45 for the latent grid "
                                         r"\(3, 6, 10\) \(patch grid \(3, 3, 5\).*received 44"):
        eqx.filter_eval_shape(model, x[0], t[0, :44], c[0])


@pytest.mark.parametrize("boundary", [0, 1, 1.5, -0.1])
def test_boundary_outside_zero_one(boundary):
    m = _abstract()
    with pytest.raises(ValueError, match=rf"`boundary`.*must be in \(0, 1\); received "
                                         rf"{re.escape(repr(float(boundary)))}\.$"):
        models.WanExperts(m, m, boundary)


@pytest.mark.parametrize("field, value", [("in_channels", 8), ("patch_size", (2, 2, 2))])
def test_experts_must_take_the_same_inputs(field, value):
    other = _abstract(dataclasses.replace(CONFIG, **{field: value}))
    want = (f"`{field}`; received high_noise {getattr(CONFIG, field)!r}, "
            f"low_noise {value!r}.")
    with pytest.raises(ValueError, match=re.escape(want)):
        models.WanExperts(_abstract(), other, 0.875)


def test_experts_must_share_their_parallel_config():
    ulysses = _abstract(parallel=nn.sharding.ParallelConfig(sequence="ulysses"))
    with pytest.raises(ValueError, match=r"ParallelConfigs must be equal.*nn.sharding.with_parallel"):
        models.WanExperts(_abstract(), ulysses, 0.875)
    with pytest.raises(ValueError, match=r"`index` must be 0 .* or 1 .*; received 2"):
        models.WanExperts(_abstract(), _abstract(), 0.875).with_expert(2, _abstract())


def test_route_branches_must_agree_on_their_static_parts():
    e = models.WanExperts(_abstract(), _abstract(), 0.875)
    with pytest.raises(ValueError, match=r"WanExperts.route: both experts' branches must "
                                         r"return the same non-array parts"):
        e.route(jnp.float32(900), lambda expert, i: (jnp.zeros(3), i))


@pytest.mark.parametrize("present, absent", [("transformer", "transformer_2"),
                                             ("high_noise_model", "low_noise_model")])
def test_experts_directory_with_one_expert(tmp_path, present, absent):
    (tmp_path / present).mkdir()
    (tmp_path / present / "config.json").write_text("{}")
    (tmp_path / "README.md").write_text("")
    with pytest.raises(ValueError, match=rf"lacks {absent}/ and holds \['README.md', '{present}'\]"):
        models.WanExperts.from_pretrained(tmp_path, boundary=0.875)


def test_experts_directory_without_a_boundary(experts, tmp_path):
    e, _, _ = experts
    e.save_pretrained(tmp_path, layout="diffusers")
    index = json.loads((tmp_path / "model_index.json").read_text())
    del index["boundary_ratio"]
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"no boundary_ratio in model_index.json.*pass `boundary=`"):
        models.WanExperts.from_pretrained(tmp_path)
    assert models.WanExperts.from_pretrained(tmp_path, boundary=0.9).boundary == 0.9
    with pytest.raises(ValueError, match=r"absent'.* gives neither"):
        models.WanExperts.from_pretrained(tmp_path / "absent")
    with pytest.raises(ValueError, match=r"`layout` must be 'diffusers' or 'wan'; received 'comfy'"):
        e.save_pretrained(tmp_path, layout="comfy")


@pytest.mark.parametrize("length", [9, 11])
def test_flf2v_wrong_image_length(flf2v, length):
    model, (x, t, c, _) = flf2v
    image = jnp.zeros((length, 24))
    with pytest.raises(ValueError, match=rf"10 tokens \(pos_embed_seq_len\); received {length}"):
        eqx.filter_eval_shape(model, x[0], t[0], c[0], context_image=image)


def test_bad_configs():
    with pytest.raises(ValueError, match=r"`pos_embed_seq_len`.* needs `image_dim`.*"
                                         r"received pos_embed_seq_len=5, image_dim=None"):
        models.WanConfig(pos_embed_seq_len=5)
    with pytest.raises(ValueError, match=r"`pos_embed_seq_len` must be None or a positive int; "
                                         r"received 0"):
        models.WanConfig(image_dim=24, pos_embed_seq_len=0)
    with pytest.raises(ValueError, match=r"preset: `name` must be one of \[.*'ti2v-5b'.*\]; "
                                         r"received 'nope'"):
        models.WanConfig.preset("nope")


def test_presets():
    ti2v = models.WanConfig.preset("ti2v-5b")
    assert (ti2v.dim, ti2v.ffn_dim, ti2v.num_heads, ti2v.num_layers) == (3072, 14336, 24, 30)
    assert (ti2v.in_channels, ti2v.out_channels, ti2v.image_dim) == (48, 48, None)
    flf2v = models.WanConfig.preset("flf2v-14b", num_layers=2)
    assert (flf2v.num_layers, flf2v.image_dim, flf2v.pos_embed_seq_len) == (2, 1280, 514)
    assert models.WanConfig.preset("t2v-a14b") == models.WanConfig.preset("t2v-14b")


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(cond_frames=-1), r"`cond_frames` must be an int in \[0, 3\].*received -1",
                 id="cond_frames=-1"),
    pytest.param(dict(cond_frames=4), r"`cond_frames` must be an int in \[0, 3\].*received 4",
                 id="cond_frames=4"),
    pytest.param(dict(cond_frames=1.0), r"`cond_frames` must be an int .*received 1.0",
                 id="cond_frames=1.0"),
    pytest.param(dict(cond_frames=True), r"`cond_frames` must be an int .*received True",
                 id="cond_frames=True"),
    pytest.param(dict(grid=(3, 5, 10)), r"`grid` must be .* multiple of patch_size="
                 r"\(1, 2, 2\); received \(3, 5, 10\)", id="grid-not-a-multiple"),
    pytest.param(dict(grid=(4, 4, 6), patch_size=(3, 2, 2)),
                 r"patch_size=\(3, 2, 2\); received \(4, 4, 6\)", id="frames-not-a-multiple"),
    pytest.param(dict(grid=(6, 10)), r"`grid` must be the latent \(F, H, W\).*received \(6, 10\)",
                 id="grid-2d"),
    pytest.param(dict(timestep=jnp.zeros(2)), r"`timestep` must be a scalar; received shape \(2,\)",
                 id="timestep-vector"),
])
def test_bad_wan_image_timestep(kwargs, match):
    args = dict(timestep=700.0, grid=(3, 6, 10)) | kwargs
    with pytest.raises(ValueError, match=match):
        models.wan_image_timestep(args.pop("timestep"), args.pop("grid"), **args)
