"""Fully sharded data parallelism (FSDP / ZeRO-3): `nn.sharding.ParallelConfig(fsdp_axes=...)`.

On 8 simulated CPU devices:

1. a training step (loss, every gradient, one `optax.adamw` step) of a tiny Wan 2.1
   and a CogVideoX (the 5B fixture) equals the single-device one, relative 1e-5, with
   FSDP over dp and sp x TP 2 (Ulysses), FSDP alone over dp 8, and FSDP with a zigzag
   ring (x TP for Wan, x dp for CogVideoX); rematerialized (`"full"`) but for one
   configuration of each model (`None`; `"dots_saveable"` with the gathered weights
   kept for the backward pass, `fsdp_regather=False`); and sliding tile attention on a
   zigzag ring with FSDP (loss and gradients);
2. the bytes each device holds of the parameters, the gradients and the AdamW moments
   (read from the arrays' `addressable_shards`) are within 1.05 x total / (FSDP x TP)
   plus what `nn.sharding.replicated_parameters` leaves whole (what Megatron does not split,
   embeddings, modulation, norms, heads, is split over FSDP x TP together);
3. the scanned blocks' gathered weights are not kept for the backward pass: XLA's temp
   bytes of a training step grow with the layers by far less than one block's gathered
   weights under `fsdp_regather=True`, by about a block per layer with `False`; the
   compiled program all-gathers every block twice (forward, backward) or once;
4. the placement rules (the dimension chosen, the stacked layer axis never, what stays
   replicated and why), their errors, `nn.sharding.shard_like` for an optax state, `nn.sharding.fsdp_gather`
   as the identity without shards, and an `nn.Attention` that gathers itself inside
   `nn.sharding.filter_shard_map`.

Each sharded program compiles once (module-scoped results); the single-device step of
each model once for all its configurations.
"""

import dataclasses
import functools
import math
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import harness
import oracle
from benchmarks import _hlo
from vidax_eqx import models, nn


FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
# The Wan fixture (`tests/fixtures/wan/t2v`, diffusers' random init) has this shape.
WAN = models.WanConfig(dim=64, ffn_dim=96, num_heads=8, num_layers=2, in_channels=4,
                       out_channels=4, text_dim=32, freq_dim=32)
BATCH = 8  # dp 8 takes one example per device; the other meshes see the same batch
RTOL = oracle.tolerance(np.float32)  # 1e-5
# The floor of a gradient's scale, as a fraction of the model's largest gradient: a
# gradient that is mathematically zero (CogVideoX's norm_k.bias: LayerNorm's shift
# cancels in the softmax) is float32 noise, compared to the model's scale.
ZERO_GRADIENT = 1e-2
# AdamW's first step is lr * g / (|g| + eps): sign(g) under optax's eps = 1e-8, so
# float32 noise in a gradient near zero would flip a whole step. This eps keeps the step
# a smooth function of the gradient below it.
ADAMW = dict(learning_rate=1e-3, eps=1e-4, weight_decay=0.1)


# -- 1. a training step of whole models ---------------------------------------------------


def _inputs(shapes, seed):
    """Random `(x, timestep, context, target)` of batch BATCH."""
    rng = np.random.default_rng(seed)
    x, context = (jnp.asarray(harness.normal(rng, (BATCH, *s))) for s in shapes)
    timestep = jnp.asarray(rng.uniform(0, 1000, BATCH), jnp.float32)
    target = jnp.asarray(harness.normal(rng, x.shape))
    return x, timestep, context, target


def _wan():
    model = models.WanTransformer3D.from_pretrained(FIXTURES / "wan" / "t2v" / "diffusers")
    assert model.config == WAN
    # 45 patch tokens: padded for every sequence split here.
    return harness.perturbed(model, 1), _inputs(((4, 3, 6, 10), (7, WAN.text_dim)), 2)


def _cogvideox():
    path = FIXTURES / "cogvideox" / "5b"
    model = models.CogVideoXTransformer3D.from_pretrained(path / "diffusers")
    io = np.load(path / "io.npz")
    return harness.perturbed(model, 3), _inputs((io["x"].shape[1:], io["context"].shape[1:]), 4)


MODELS = {"wan": _wan, "cogvideox": _cogvideox}


def _train_step(run, place=lambda model, state: (model, state)):
    """One jitted `step(model, x, t, c, target) -> (loss, grads, params, opt_state)`:
    a fresh AdamW state, `place(model, state)`, the mean squared error of
    `run(model, x, t, c)`, its gradient in every parameter and one AdamW step, in one
    program."""
    optimizer = optax.adamw(**ADAMW)

    @functools.partial(eqx.filter_jit, compiler_options=harness.FAST_COMPILE)
    def step(model, x, t, c, target):
        model, state = place(model, optimizer.init(eqx.filter(model, eqx.is_array)))
        params, static = eqx.partition(model, eqx.is_array)

        def loss(params):
            out = run(eqx.combine(params, static), x, t, c)
            return jnp.mean(jnp.square(out - target))

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return value, grads, optax.apply_updates(params, updates), state

    return step


@pytest.fixture(scope="module")
def single():
    """`get(model name) -> (model, inputs, (loss, grads, params, opt_state))` of the
    single-device step, each model's computed once."""
    cache = {}

    def get(name):
        if name not in cache:
            model, inputs = MODELS[name]()
            step = _train_step(lambda m, x, t, c: jax.vmap(m)(x, t, c))
            cache[name] = model, inputs, step(model, *inputs)
        return cache[name]

    return get


# name: (model, mesh, ParallelConfig, batch axis, remat)
CONFIGS = {
    "wan-dp2-sp2-tp2-ulysses": ("wan", dict(dp=2, sp=2, tp=2), dict(
        sequence="ulysses", tp_axis="tp", fsdp_axes=("dp", "sp")), "dp", "full"),
    "wan-dp8": ("wan", dict(dp=8), dict(fsdp_axes=("dp",)), "dp", None),
    "wan-sp4-tp2-ring-zigzag": ("wan", dict(sp=4, tp=2), dict(
        sequence="ring", layout="zigzag", tp_axis="tp", fsdp_axes=("sp",)), None, "full"),
    "cogvideox-dp2-sp2-tp2-ulysses": ("cogvideox", dict(dp=2, sp=2, tp=2), dict(
        sequence="ulysses", tp_axis="tp", fsdp_axes=("dp", "sp")), "dp", "full"),
    "cogvideox-dp8-keep-gathered": ("cogvideox", dict(dp=8), dict(
        fsdp_axes=("dp",), fsdp_regather=False), "dp", "dots_saveable"),
    "cogvideox-dp2-sp4-ring-zigzag": ("cogvideox", dict(dp=2, sp=4), dict(
        sequence="ring", layout="zigzag", fsdp_axes=("dp", "sp")), "dp", "full"),
}


@pytest.fixture(scope="module")
def sharded(single):
    """`get(config name) -> (model, mesh, (loss, grads, params, opt_state))`: the model
    configured, and the sharded step's results where the step left them, the model and
    its AdamW state placed in the step (`nn.sharding.shard_module`, `nn.sharding.shard_like` inside `jit`:
    one program, where placing outside it runs one per array); each configuration's
    computed once."""
    cache = {}

    def get(name):
        if name not in cache:
            model_name, shape, config, batch_axis, remat = CONFIGS[name]
            model, inputs, _ = single(model_name)
            mesh = harness.mesh(**shape)

            def run(model, x, t, c):
                return models.run_sharded(model, x, t, c, mesh=mesh, batch_axis=batch_axis,
                                          remat=remat)

            def place(model, state):
                return nn.sharding.shard_module(model, mesh), nn.sharding.shard_like(state, model, mesh)

            model = nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(**config))
            cache[name] = model, mesh, _train_step(run, place)(model, *inputs)
        return cache[name]

    return get


def _is_spec(s) -> bool:
    return isinstance(s, P)


def _leaf_errors(got, ref, floor: float = 0.0) -> dict:
    """`{path: max|got - ref| / scale}` over the array leaves of two trees, `scale` the
    leaf's largest magnitude, and at least `floor` x the largest of the whole tree."""
    names = harness.leaf_names(ref)
    ref = [np.asarray(r, np.float64) for r in harness.arrays(ref)]
    got = [np.asarray(g, np.float64) for g in harness.arrays(got)]
    top = max(float(np.max(np.abs(r))) for r in ref)
    return {n: float(np.max(np.abs(g - r))) / max(float(np.max(np.abs(r))), floor * top, 1e-30)
            for n, g, r in zip(names, got, ref)}


def _assert_leaves_close(got, ref, what: str, floor: float = 0.0) -> None:
    errors = _leaf_errors(got, ref, floor)
    bad = {n: e for n, e in errors.items() if not e <= RTOL}
    assert not bad, f"{what}: {len(bad)} of {len(errors)} arrays off (relative): {bad}"


@pytest.mark.slow  # a sharded training step compiled per configuration: 10-20 s each
@pytest.mark.parametrize("name", CONFIGS)
def test_training_step_matches_one_device(name, single, sharded):
    loss1, grads1, params1, state1 = single(CONFIGS[name][0])[2]
    model, mesh, (loss, grads, params, state) = sharded(name)
    assert abs(float(loss) - float(loss1)) <= RTOL * abs(float(loss1)), (loss, loss1)
    _assert_leaves_close(grads, grads1, "gradients", floor=ZERO_GRADIENT)
    _assert_leaves_close(params, params1, "parameters after one AdamW step")
    adam, adam1 = state[0], state1[0]
    _assert_leaves_close(adam.mu, adam1.mu, "AdamW's first moment", floor=ZERO_GRADIENT)
    _assert_leaves_close(adam.nu, adam1.nu, "AdamW's second moment", floor=ZERO_GRADIENT**2)
    assert int(adam.count) == 1
    # The step hands back parameters, gradients and moments placed by the specs (the
    # next step reuses the program).
    specs = nn.sharding.partition_specs(model, mesh)
    for tree in (params, grads, adam.mu, adam.nu):
        _assert_placed_by(tree, specs, mesh)
    assert adam.count.sharding.is_equivalent_to(NamedSharding(mesh, P()), 0)


def _assert_placed_by(tree, specs, mesh) -> None:
    names = harness.leaf_names(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=_is_spec)
    for name, x, spec in zip(names, harness.arrays(tree), spec_leaves, strict=True):
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (
            name, x.sharding, spec)


# -- 2. bytes per device --------------------------------------------------------------------


def _bytes_per_device(tree) -> int:
    """The most bytes of `tree`'s arrays any one device holds (its addressable shards)."""
    per_device = {}
    for x in harness.arrays(tree):
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def _bytes_bound(model, params, mesh) -> tuple[float, int]:
    """`(split, whole)` bytes per device: `split` is total / (FSDP x TP) of what
    `nn.sharding.replicated_parameters` does not list (the issue's bound: what tensor
    parallelism leaves whole is split over FSDP x TP too), `whole` what it lists, as
    those exist on a device (`params`, placed: a tensor-parallel bias is its slice)."""
    config = model.parallel
    fsdp = math.prod(mesh.shape[a] for a in config.fsdp_axes)
    tp = 1 if config.tp_axis is None else mesh.shape[config.tp_axis]
    whole_names = {path for path, _, _ in nn.sharding.replicated_parameters(model, mesh)}
    split, whole = 0.0, 0
    for name, x in zip(harness.leaf_names(params), harness.arrays(params), strict=True):
        if name in whole_names:
            whole += x.addressable_shards[0].data.nbytes
        else:
            split += x.nbytes / (fsdp * tp)
    return split, whole


@pytest.mark.slow  # the sharded steps of test_training_step_matches_one_device
@pytest.mark.parametrize("name", CONFIGS)
def test_bytes_per_device(name, sharded):
    """Parameters, gradients and AdamW's moments each within 1.05 x an even split plus
    what stays whole (without tensor parallelism: 1.05 x total / FSDP + whole)."""
    model, mesh, (_, grads, params, state) = sharded(name)
    split, whole = _bytes_bound(model, params, mesh)
    total = sum(x.nbytes for x in harness.arrays(params))
    for what, tree in (("parameters", params), ("gradients", grads),
                       ("AdamW first moments", state[0].mu), ("AdamW second moments", state[0].nu)):
        got = _bytes_per_device(tree)
        assert got <= 1.05 * split + whole, (what, got, split, whole, total)
    assert whole <= 0.15 * total  # small biases and norms only


# -- 3. the gathered weights are gathered again in the backward pass ------------------


def _compiled_step(num_layers: int, regather: bool):
    """The compiled gradient of a Wan (width 512, 4 tokens: the weights dominate) under
    FSDP over dp 8, from abstract arrays; and its model (abstract)."""
    mesh = harness.mesh(dp=8)
    config = dataclasses.replace(WAN, dim=512, ffn_dim=1024, num_heads=4, num_layers=num_layers)
    parallel = nn.sharding.ParallelConfig(fsdp_axes=("dp",), fsdp_regather=regather)
    model = eqx.filter_eval_shape(
        lambda key: models.WanTransformer3D(config, parallel=parallel, key=key), jax.random.key(0))
    specs = nn.sharding.partition_specs(model, mesh)
    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    params, static = eqx.partition(model, is_abstract)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
        params, specs, is_leaf=is_abstract)
    x = jax.ShapeDtypeStruct((BATCH, WAN.in_channels, 1, 4, 4), jnp.float32)
    t = jax.ShapeDtypeStruct((BATCH,), jnp.float32)
    c = jax.ShapeDtypeStruct((BATCH, 2, WAN.text_dim), jnp.float32)

    def loss(params, x, t, c):
        out = models.run_sharded(eqx.combine(params, static), x, t, c, mesh=mesh,
                                 batch_axis="dp", remat="full")
        return jnp.mean(jnp.square(out))

    compiled = jax.jit(jax.grad(loss)).lower(params, x, t, c).compile(harness.FAST_COMPILE)
    return compiled, model, mesh


def _gathered_counts(model, mesh) -> tuple[int, int, int]:
    """`(outside, per_block, block_bytes)`: the parameters FSDP splits outside the
    scanned blocks and in one block, and one block's weights in bytes, gathered."""
    specs = nn.sharding.partition_specs(model, mesh)
    is_split = lambda s: isinstance(s, P) and "dp" in jax.tree.leaves(tuple(s))  # noqa: E731
    split = [is_split(s) for s in jax.tree.leaves(specs, is_leaf=_is_spec)]
    block_split = [is_split(s) for s in jax.tree.leaves(specs.blocks, is_leaf=_is_spec)]
    L = model.config.num_layers
    blocks = [x for x in jax.tree.leaves(model.blocks) if isinstance(x, jax.ShapeDtypeStruct)]
    block_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in blocks) // L
    return sum(split) - sum(block_split), sum(block_split), block_bytes


@pytest.mark.slow  # three programs compiled: ~25 s
def test_regather_keeps_one_block_gathered():
    """XLA's temp bytes of the gradient of a Wan with L and 2L blocks (fsdp_regather
    True), and 2L with the gathered weights kept; the all-gathers of the compiled 2L
    programs, loops counted by their trip counts (benchmarks/_hlo.py)."""
    L = 2
    steps = {(n, r): _compiled_step(n, r) for n, r in ((L, True), (2 * L, True), (2 * L, False))}
    temp = {k: c.memory_analysis().temp_size_in_bytes for k, (c, _, _) in steps.items()}
    _, model, mesh = steps[2 * L, True]
    outside, per_block, block_bytes = _gathered_counts(model, mesh)
    # Twice the layers, the same temp bytes but for far less than one block gathered ...
    assert temp[2 * L, True] - temp[L, True] < 0.25 * block_bytes, (temp, block_bytes)
    # ... where keeping them (fsdp_regather=False) holds every block's gathered weights.
    assert temp[2 * L, False] - temp[2 * L, True] > (2 * L - 1) * block_bytes, (temp, block_bytes)
    gathers = {r: _hlo.collective_bytes(steps[2 * L, r][0].as_text(), 8)
               for r in (True, False)}
    assert gathers[True]["unknown_trip_counts"] == gathers[False]["unknown_trip_counts"] == 0
    count = {r: g["ops"].get("all-gather", 0) for r, g in gathers.items()}
    forward = outside + per_block * 2 * L  # one gather per split parameter
    assert count[True] >= forward + per_block * 2 * L, (count, outside, per_block)
    assert per_block * 2 * L <= count[False] <= forward, (count, outside, per_block)


# -- 4. the placement rules -------------------------------------------------------------


def _entries(spec) -> tuple:
    """A spec's entries without trailing `None`s (`P(None,)` places like `P()`)."""
    entries = tuple(spec)
    while entries and entries[-1] is None:
        entries = entries[:-1]
    return entries


def _attention(config=None, *, abstract: bool = True):
    """A Wan self-attention (width 64, 8 heads, RMS qk-norm) with `config`: its arrays
    abstract (`jax.ShapeDtypeStruct`, enough for the specs) unless `abstract=False`."""
    make = lambda key: nn.Attention(64, 8, qk_norm="rms", key=key)  # noqa: E731
    m = eqx.filter_eval_shape(make, jax.random.key(5)) if abstract else make(jax.random.key(5))
    return m if config is None else nn.sharding.with_parallel(m, config)


@pytest.fixture(scope="module")
def attention():
    """A Wan self-attention with random weights (one device)."""
    return harness.perturbed(_attention(abstract=False), 7)


def _feedforward(dim: int, hidden: int, config):
    return eqx.filter_eval_shape(lambda key: nn.FeedForward(
        dim, hidden, activation="gelu_tanh", parallel=config, key=key), jax.random.key(6))


def test_specs_take_the_largest_free_dividing_dimension():
    mesh = harness.mesh(dp=2, sp=2, tp=2)
    fsdp = ("dp", "sp")
    specs = nn.sharding.partition_specs(_attention(nn.sharding.ParallelConfig(tp_axis="tp", fsdp_axes=fsdp)), mesh)
    # q (out, in): Megatron splits the rows, FSDP the columns; o the other way round.
    assert specs.q.weight == P("tp", fsdp) and specs.o.weight == P(fsdp, "tp")
    # Whole under TP: split over FSDP x TP together (tp innermost).
    assert specs.o.bias == P((*fsdp, "tp"))
    # A column-parallel bias or norm has no dimension left: replicated over FSDP.
    assert specs.q.bias == P("tp") and specs.norm_q.weight == P("tp")
    # Without TP the largest dimension: fc1 (96, 32) on its rows, fc2 (32, 96) columns;
    # of equal ones the first.
    ffn = _feedforward(32, 96, nn.sharding.ParallelConfig(fsdp_axes=("dp",)))
    specs = nn.sharding.partition_specs(ffn, harness.mesh(dp=2))
    assert specs.fc1.weight == P("dp", None) and specs.fc2.weight == P(None, "dp")
    specs = nn.sharding.partition_specs(_attention(nn.sharding.ParallelConfig(fsdp_axes=("dp",))), harness.mesh(dp=2))
    assert specs.q.weight == P("dp", None) and specs.q.bias == P("dp")
    # Over 3: fc1 (96, 32) still on its 96 rows, fc2 (32, 96) on its 96 columns; fc2's
    # bias (32,) has no dimension 3 divides: replicated.
    specs = nn.sharding.partition_specs(ffn, harness.mesh(dp=3))
    assert specs.fc1.weight == P("dp", None) and specs.fc1.bias == P("dp")
    assert specs.fc2.weight == P(None, "dp") and _entries(specs.fc2.bias) == ()  # 32 % 3
    # Not the largest where it does not divide: (48, 40) over 5 on its columns.
    ffn5 = _feedforward(40, 48, nn.sharding.ParallelConfig(fsdp_axes=("dp",)))
    assert nn.sharding.partition_specs(ffn5, harness.mesh(dp=5)).fc1.weight == P(None, "dp")


def test_stacked_layer_axis_is_never_split():
    # 5 layers over FSDP 5: the layer axis divides, the others (64, 96) do not.
    config = dataclasses.replace(WAN, num_layers=5)
    model = eqx.filter_eval_shape(lambda key: models.WanTransformer3D(
        config, parallel=nn.sharding.ParallelConfig(fsdp_axes=("dp",)), key=key), jax.random.key(0))
    mesh = harness.mesh(dp=5)
    specs = nn.sharding.partition_specs(model, mesh)
    block_specs = jax.tree.leaves(specs.blocks, is_leaf=_is_spec)
    assert block_specs and all(_entries(s) == () for s in block_specs)
    replicated = {path: (shape, reason) for path, shape, reason in
                  nn.sharding.replicated_parameters(model, mesh)}
    shape, reason = replicated[".blocks.self_attn.q.weight"]
    assert shape == (5, 64, 64)
    assert "[64, 64]" in reason and "layer axis" in reason and "FSDP size 5" in reason
    # Over 8 the same layers split on their largest dimension after the layer axis.
    specs = nn.sharding.partition_specs(model, harness.mesh(dp=8))
    assert specs.blocks.self_attn.q.weight == P(None, "dp", None)
    assert specs.blocks.modulation == P(None, None, None, "dp")  # (5, 1, 6, 64)


def test_replicated_parameters_and_their_reasons():
    mesh = harness.mesh(dp=2, sp=2, tp=2)
    m = _attention(nn.sharding.ParallelConfig(tp_axis="tp", fsdp_axes=("dp", "sp")))
    listed = nn.sharding.replicated_parameters(m, mesh)
    assert sorted(path for path, _, _ in listed) == [
        ".k.bias", ".norm_k.weight", ".norm_q.weight", ".q.bias", ".v.bias"]
    for _, shape, reason in listed:  # their one dimension split by TP already
        assert shape == (64,)
        assert "tensor parallelism" in reason and "'tp'" in reason
    assert nn.sharding.replicated_parameters(_attention(nn.sharding.ParallelConfig(tp_axis="tp")), mesh) == []
    # FSDP alone splits them all.
    fsdp_only = _attention(nn.sharding.ParallelConfig(fsdp_axes=("dp", "sp")))
    assert nn.sharding.replicated_parameters(fsdp_only, mesh) == []


def test_placement_errors():
    mesh = harness.mesh(dp=2, sp=2, tp=2)
    with pytest.raises(ValueError, match=r"must not contain the tensor-parallel axis 'tp'"):
        nn.sharding.ParallelConfig(tp_axis="tp", fsdp_axes=("dp", "tp"))
    with pytest.raises(ValueError, match=r"names an axis twice"):
        nn.sharding.ParallelConfig(fsdp_axes=("dp", "dp"))
    with pytest.raises(ValueError, match=r"tuple of mesh axis names"):
        nn.sharding.ParallelConfig(fsdp_axes=("dp", 1))
    fsdp = _attention(nn.sharding.ParallelConfig(fsdp_axes=("data",)))
    with pytest.raises(ValueError, match=r"FSDP axis 'data' .* is not an axis of the mesh"):
        nn.sharding.partition_specs(fsdp, mesh)
    with pytest.raises(ValueError, match=r"needs the mesh .* partition_specs\(module, mesh\)"):
        nn.sharding.partition_specs(fsdp)
    # A parameter too large to stay whole, no dimension of which the FSDP size divides.
    big = _attention(nn.sharding.ParallelConfig(fsdp_axes=("dp",)))
    with pytest.raises(ValueError) as e:
        nn.sharding.partition_specs(big, harness.mesh(dp=3), max_replicated=1000)
    text = str(e.value)
    for part in ("('dp',)", "size 3", ".q.weight", "(64, 64)", "4,096 elements",
                 "max_replicated=1,000", "[64, 64]"):
        assert part in text, (part, text)
    two = (big, _attention(nn.sharding.ParallelConfig(fsdp_axes=("sp",))))
    with pytest.raises(ValueError, match=r"must agree on their ParallelConfig's fsdp_axes"):
        nn.sharding.partition_specs(two, mesh)
    with pytest.raises(ValueError, match=r"must agree"):
        nn.sharding.fsdp_axes_of(two)
    # run_sharded: an FSDP axis that carries neither the batch nor the sequence.
    model = eqx.filter_eval_shape(lambda key: models.WanTransformer3D(
        WAN, parallel=nn.sharding.ParallelConfig(sequence="ulysses", fsdp_axes=("dp", "sp")), key=key),
        jax.random.key(0))
    x, t, c, _ = _inputs(((4, 1, 4, 4), (2, WAN.text_dim)), 0)
    with pytest.raises(ValueError, match=r"FSDP axis 'dp' .* carries neither the batch"):
        models.run_sharded(model, x, t, c, mesh=mesh, batch_axis=None)


def test_shard_like_places_an_adamw_state_and_reshards_it(attention):
    mesh = harness.mesh(dp=2, sp=2, tp=2)
    config = nn.sharding.ParallelConfig(tp_axis="tp", fsdp_axes=("dp", "sp"))
    m = nn.sharding.shard_module(nn.sharding.with_parallel(attention, config), mesh)
    optimizer = optax.adamw(1e-3)
    state = nn.sharding.shard_like(optimizer.init(eqx.filter(m, eqx.is_array)), m, mesh)
    specs = nn.sharding.partition_specs(m, mesh)
    _assert_placed_by(m, specs, mesh)
    for moments in (state[0].mu, state[0].nu):
        _assert_placed_by(moments, specs, mesh)
    assert state[0].count.sharding.is_equivalent_to(NamedSharding(mesh, P()), 0)
    # Another configuration (FSDP over all three axes, no TP): one call reshards.
    state = jax.tree.map(lambda x: x + 1, state)  # not zeros, to see the values travel
    before = jax.device_get(state)
    other = nn.sharding.with_parallel(m, nn.sharding.ParallelConfig(fsdp_axes=("dp", "sp", "tp")))
    moved = nn.sharding.shard_like(state, other, mesh)
    specs = nn.sharding.partition_specs(other, mesh)
    assert specs.q.weight == P(("dp", "sp", "tp"), None)
    for moments in (moved[0].mu, moved[0].nu):
        _assert_placed_by(moments, specs, mesh)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(moved)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_fsdp_gather_without_shards_is_the_identity(attention):
    m = nn.sharding.with_parallel(attention, nn.sharding.ParallelConfig(fsdp_axes=("dp",)))
    x = jnp.ones((4, 64))
    out = nn.sharding.fsdp_gather(m, x)
    assert out[0] is m and out[1] is x  # outside shard_map: nothing is split
    mesh = harness.mesh(dp=2)
    seen = []

    def per_device(m, x):  # replicated weights inside shard_map: no FSDPShard
        got, y = nn.sharding.fsdp_gather(m, x)
        seen.append(got is m and y is x)
        return y

    f = nn.sharding.filter_shard_map(per_device, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P("dp"))
    jaxpr = str(jax.make_jaxpr(lambda x: f(attention, x))(jnp.ones((4, 64))))
    assert seen == [True] and "all_gather" not in jaxpr


def test_attention_gathers_itself_inside_filter_shard_map(attention):
    """An `nn.Attention` with FSDP in_specs (dp, sp) x TP x Ulysses: the float64 oracle's
    output, and the single-device gradients in every weight and in x."""
    mesh = harness.mesh(dp=2, sp=2, tp=2)
    B, S = 2, 12
    single = attention
    m = nn.sharding.with_parallel(single, nn.sharding.ParallelConfig(sequence="ulysses", tp_axis="tp",
                                                   fsdp_axes=("dp", "sp")))
    rng = np.random.default_rng(8)
    x, ct = (jnp.asarray(harness.normal(rng, (B, S, 64))) for _ in range(2))
    seq = P("dp", "sp")
    specs = nn.sharding.partition_specs(m, mesh)
    assert specs.q.weight == P("tp", ("dp", "sp"))  # the module gets FSDPShards
    sharded = nn.sharding.filter_shard_map(lambda m, x: jax.vmap(m)(x), mesh=mesh,
                                  in_specs=(specs, seq), out_specs=seq)

    @functools.partial(eqx.filter_jit, compiler_options=harness.FAST_COMPILE)
    def vjp(f, m, x):
        out, pull = eqx.filter_vjp(f, m, x)
        return out, pull(ct)

    out, (dm, dx) = vjp(sharded, nn.sharding.shard_module(m, mesh), x)
    want = np.stack([oracle.wan_self_attention(harness.to64(single), xb)
                     for xb in np.asarray(x, np.float64)])
    oracle.assert_close(out, want, np.float32, "out")
    out1, (dm1, dx1) = vjp(lambda m, x: jax.vmap(m)(x), single, x)
    _assert_leaves_close(dm, dm1, "weight gradients")
    harness.assert_trees_close(dx, dx1, np.float32, "dx")
    # The weights' gradients leave shard_map split like the weights (reduce-scattered).
    _assert_placed_by(dm, specs, mesh)


@pytest.mark.slow  # a sharded Wan gradient with sliding tile attention: ~15 s
def test_sliding_tile_attention_with_fsdp():
    """Sliding tile attention on a zigzag ring with FSDP over dp x sp: the loss and
    every gradient of the single-device model with the same mask."""
    model, (x, t, c, _) = _wan()
    x, t, c = x[:2], t[:2], c[:2]
    tile = models.SlidingTile((1, 3, 5), (3, 1, 1))  # 9 tiles of 15 tokens, a 3 x 1 x 1 window

    @functools.partial(eqx.filter_jit, compiler_options=harness.FAST_COMPILE)
    def grad(run, model):
        return eqx.filter_value_and_grad(lambda m: jnp.sum(jnp.square(run(m))))(model)

    loss1, grads1 = grad(lambda m: jax.vmap(lambda *a: m(*a, attention=tile))(x, t, c), model)
    mesh = harness.mesh(dp=2, sp=4)
    config = nn.sharding.ParallelConfig(sequence="ring", layout="zigzag", fsdp_axes=("dp", "sp"))
    sharded = nn.sharding.shard_module(nn.sharding.with_parallel(model, config), mesh)
    loss, grads = grad(lambda m: models.run_sharded(
        m, x, t, c, mesh=mesh, batch_axis="dp", remat="full", attention=tile), sharded)
    assert abs(float(loss) - float(loss1)) <= RTOL * abs(float(loss1)), (loss, loss1)
    _assert_leaves_close(eqx.filter(grads, eqx.is_array), eqx.filter(grads1, eqx.is_array),
                         "gradients", floor=ZERO_GRADIENT)
