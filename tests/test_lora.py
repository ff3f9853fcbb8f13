"""LoRA: `nn.LoRALinear` and its functions, `models.add_lora` / `load_lora` / `save_lora`.

1. `nn.LoRALinear` (two adapters, one merged) against a float64 NumPy oracle, forward
   and the gradients of x, A and B;
2. parity with diffusers (`tests/fixtures/lora`, from `scripts/make_lora_fixtures.py`):
   the Wan 2.1 T2V test model with a PEFT LoRA loaded by diffusers' `load_lora_weights`,
   at weight 1 and 0.5, with a second adapter, fused, and the same adapter in the
   kohya and ComfyUI layouts, all within 1e-5 relative of diffusers' float32 outputs,
   unmerged and merged;
3. merge / unmerge: bit for bit with `keep_originals`, within one rounding without;
   into the stacked blocks and into each Wan 2.2 expert;
4. files written by `save_lora` (both layouts) read back to the same adapters, a layer
   of a stack without an adapter left out;
5. training only the adapters on 8 simulated devices (dp x sp x tp with FSDP, and a
   zigzag ring x tp) equals one device: loss, gradients, the AdamW step; the
   optimizer state holds the adapters' arrays only;
6. placement (column / row parallel), CogVideoX, and every bad input named.
"""

import functools
import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import harness
import oracle
from vidax_eqx import interop, models, nn
from vidax_eqx.interop._safetensors import write_safetensors
from vidax_eqx.nn._layers import linear


FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
LORA = FIXTURES / "lora"
WAN = FIXTURES / "wan" / "t2v" / "diffusers"
RTOL = oracle.tolerance(np.float32)  # 1e-5
TARGETS = ["blocks.*.attn1.to_*", "blocks.*.attn2.to_[qo]*", "blocks.*.ffn.*",
           "condition_embedder.time_proj"]


def _rel(got, ref) -> float:
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


def _with_random_b(model, seed: int, std: float = 0.05):
    """Every adapter's `lora_B` random (they start at zero), so that both A and B
    matter and get gradients; a stacked layer's zero A (no adapter there) stays zero."""
    count = iter(range(10_000))

    def one(a):
        if not isinstance(a, nn.LoRA):
            return a
        b = std * jax.random.normal(jax.random.key(seed * 1000 + next(count)), a.lora_B.shape)
        keep = jnp.any(a.lora_A != 0, axis=(-2, -1), keepdims=True)
        return eqx.tree_at(lambda a: a.lora_B, a, jnp.where(keep, b, 0).astype(a.lora_B.dtype))

    return jax.tree.map(one, model, is_leaf=lambda x: isinstance(x, nn.LoRA))


@functools.partial(eqx.filter_jit, compiler_options=harness.FAST_COMPILE)
def _forward(model, x, t, c):
    return jax.vmap(model)(x, t, c)


@pytest.fixture(scope="module")
def io():
    return dict(np.load(LORA / "io.npz"))


@pytest.fixture(scope="module")
def wan():
    return models.WanTransformer3D.from_pretrained(WAN)


def _run(model, io):
    return _forward(model, io["x"], io["timestep"], io["context"])


# -- 1. the layer against a float64 oracle --------------------------------------------------


def test_lora_linear_matches_float64_oracle():
    rng = np.random.default_rng(0)
    n_in, n_out, S = 12, 10, 7
    layer = eqx.nn.Linear(n_in, n_out, key=jax.random.key(0))
    layer = nn.with_lora(layer, 3, alpha=6.0, name="a", key=jax.random.key(1))
    layer = nn.with_lora(layer, 2, name="b", key=jax.random.key(2))
    layer = nn.with_lora(layer, 4, name="m", key=jax.random.key(3))
    layer = _with_random_b(layer, 1, std=0.3)
    layer = nn.set_lora_scale(layer, {"b": 0.7})
    layer = nn.merge_lora(layer, "m")  # folded into the weight: the forward skips it
    assert layer.merged == ("m",) and [a.rank for a in layer.active()] == [3, 2]
    x = jnp.asarray(harness.normal(rng, (S, n_in)))
    cot = harness.normal(rng, (S, n_out))
    a, b = layer.adapters["a"], layer.adapters["b"]
    out, vjp = jax.vjp(lambda x, aa, ab, ba, bb: nn.LoRALinear.__call__(
        eqx.tree_at(lambda l: (l.adapters["a"].lora_A, l.adapters["a"].lora_B,
                               l.adapters["b"].lora_A, l.adapters["b"].lora_B),
                    layer, (aa, ab, ba, bb)), x),
        x, a.lora_A, a.lora_B, b.lora_A, b.lora_B)
    grads = vjp(jnp.asarray(cot))

    f64 = lambda v: np.asarray(v, np.float64)  # noqa: E731
    W, bias = f64(layer.weight), f64(layer.bias)
    A1, B1, A2, B2 = f64(a.lora_A), f64(a.lora_B), f64(b.lora_A), f64(b.lora_B)
    X, G = f64(x), cot.astype(np.float64)
    s1, s2 = 1.0 * 6.0 / 3, 0.7 * 2.0 / 2
    ref = X @ W.T + bias + s1 * (X @ A1.T) @ B1.T + s2 * (X @ A2.T) @ B2.T
    ref_grads = (
        G @ W + s1 * (G @ B1) @ A1 + s2 * (G @ B2) @ A2,  # x
        s1 * (G @ B1).T @ X, s1 * G.T @ (X @ A1.T),  # A1, B1
        s2 * (G @ B2).T @ X, s2 * G.T @ (X @ A2.T),  # A2, B2
    )
    assert _rel(out, ref) <= RTOL
    for name, g, r in zip(("x", "A1", "B1", "A2", "B2"), grads, ref_grads):
        assert _rel(g, r) <= RTOL, name
    # A vector, as eqx.nn.Linear takes it; the linear of nn's modules agrees.
    np.testing.assert_allclose(layer(x[0]), out[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(linear(layer, x), out, rtol=1e-5, atol=1e-6)


def test_with_lora_initialises_as_peft():
    layer = eqx.nn.Linear(64, 32, key=jax.random.key(0))
    lora = nn.with_lora(layer, 8, key=jax.random.key(1)).adapters["default"]
    assert lora.lora_A.shape == (8, 64) and lora.lora_B.shape == (32, 8)
    assert float(jnp.max(jnp.abs(lora.lora_A))) <= 1 / 8 and float(jnp.std(lora.lora_A)) > 0.03
    assert not np.any(np.asarray(lora.lora_B)) and float(lora.alpha) == 8.0


# -- 2. parity with diffusers -----------------------------------------------------------------


def test_base_model_matches_diffusers(wan, io):
    assert _rel(_run(wan, io), io["out_base"]) <= RTOL


@pytest.fixture(scope="module")
def lora_a(wan):
    return models.load_lora(wan, LORA / "peft")


def test_peft_lora_matches_diffusers(lora_a, io):
    out = _run(lora_a, io)
    assert _rel(out, io["out_a"]) <= RTOL
    assert _rel(io["out_a"], io["out_base"]) > 0.05  # the adapter matters
    assert _rel(_run(nn.set_lora_scale(lora_a, {"default": 0.5}), io), io["out_a_half"]) <= RTOL


def test_two_adapters_with_weights_match_diffusers(lora_a, io):
    both = models.load_lora(lora_a, LORA / "peft_b", name="b", scale=0.7)
    assert nn.lora_names(both) == ["b", "default"]
    assert _rel(_run(both, io), io["out_ab"]) <= RTOL
    # b's file covers one block: the stacked adapter holds zeros for the other.
    qb = both.blocks.self_attn.q.adapters["b"]
    assert not np.any(np.asarray(qb.lora_A[0])) and np.any(np.asarray(qb.lora_A[1]))


def test_merged_lora_matches_diffusers_fused(lora_a, io):
    merged = nn.merge_lora(lora_a)
    assert merged.blocks.self_attn.q.merged == ("default",)
    assert _rel(_run(merged, io), io["out_a_fused"]) <= RTOL
    # the loader's merge=True is the same thing
    direct = models.load_lora(models.WanTransformer3D.from_pretrained(WAN), LORA / "peft",
                              merge=True)
    assert harness.same_arrays(eqx.filter(direct, eqx.is_array), eqx.filter(merged, eqx.is_array))


@pytest.mark.parametrize("layout", ["kohya", "comfy"])
def test_kohya_and_comfy_layouts_give_the_peft_adapter(wan, lora_a, io, layout):
    other = models.load_lora(wan, LORA / layout / "lora.safetensors")
    assert harness.same_arrays(eqx.filter(other, eqx.is_array), eqx.filter(lora_a, eqx.is_array))
    assert _rel(io["out_" + layout], io["out_a"]) <= 1e-6


# -- 3. merge and unmerge ---------------------------------------------------------------------


def _weights(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def test_unmerge_restores_the_weights(lora_a):
    merged, originals = nn.merge_lora(lora_a, keep_originals=True)
    assert len(originals) == 11 and all(isinstance(v, np.ndarray) for v in originals.values())
    exact = nn.unmerge_lora(merged, originals=originals)
    assert exact.blocks.self_attn.q.merged == ()
    assert all(np.array_equal(a, b) for a, b in zip(_weights(exact), _weights(lora_a)))
    # Without the originals: subtracted in float32, within one rounding of the merge.
    approx = nn.unmerge_lora(merged)
    for a, b in zip(_weights(approx), _weights(lora_a)):
        np.testing.assert_allclose(a, b, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(b).max())


def test_merge_into_each_wan22_expert():
    experts = models.WanExperts.from_pretrained(FIXTURES / "wan" / "a14b" / "diffusers")
    experts = _with_random_b(models.add_lora(experts, ["*.ffn.*", "blocks.*.attn1.to_v"], 2,
                                             key=jax.random.key(0)), 2, std=0.2)
    assert all(isinstance(e.blocks.ffn.fc1, nn.LoRALinear) for e in experts.experts)
    merged, originals = nn.merge_lora(experts, keep_originals=True)
    for e, m in zip(experts.experts, merged.experts):
        w, delta = e.blocks.ffn.fc1.weight, e.blocks.ffn.fc1.adapters["default"].delta()
        np.testing.assert_allclose(m.blocks.ffn.fc1.weight, w + delta, rtol=1e-6, atol=1e-7)
    restored = nn.unmerge_lora(merged, originals=originals)
    assert all(np.array_equal(a, b) for a, b in zip(_weights(restored), _weights(experts)))


# -- 4. files written and read back -----------------------------------------------------------


@pytest.mark.parametrize("layout", ["diffusers", "kohya"])
def test_saved_lora_reads_back(wan, tmp_path, layout):
    # blocks.1 only for the feed-forward: blocks.0's rows of that stack stay empty
    model = models.add_lora(wan, ["blocks.1.ffn.*", "blocks.*.attn2.to_k",
                                  "condition_embedder.time_proj"], 3, alpha=5.0,
                            key=jax.random.key(0))
    model = _with_random_b(model, 3)
    models.save_lora(model, tmp_path, layout=layout)
    found = interop.read_lora(tmp_path)
    naming = {"diffusers": "blocks.1.ffn.net.0.proj", "kohya": "blocks_1_ffn_0"}[layout]
    assert naming in found.layers and not found.unused
    assert len(found.layers) == 2 + 2 + 1  # no blocks.0 ffn
    assert all(t.alpha == 5.0 for t in found.layers.values())
    back = models.load_lora(wan, tmp_path)
    assert harness.same_arrays(eqx.filter(back, eqx.is_array), eqx.filter(model, eqx.is_array))


def test_saved_diffusers_file_holds_peft_config(wan, tmp_path):
    model = models.add_lora(wan, "blocks.*.attn1.to_q", 2, alpha=4.0, key=jax.random.key(0))
    models.save_lora(model, tmp_path)
    f = interop.open_safetensors(tmp_path / interop.LORA_FILE)
    assert sorted(f) == [f"transformer.blocks.{i}.attn1.to_q.lora_{ab}.weight"
                         for i in (0, 1) for ab in "AB"]
    config = json.loads(f.metadata["lora_adapter_metadata"])
    assert config["transformer.r"] == 2 and config["transformer.lora_alpha"] == 4.0
    assert config["transformer.target_modules"] == ["blocks.0.attn1.to_q", "blocks.1.attn1.to_q"]


# -- 5. training the adapters, sharded ----------------------------------------------------


ADAMW = dict(learning_rate=1e-3, eps=1e-4, weight_decay=0.1)
BATCH = 4


def _train_step(run, place=lambda model: model):
    """One jitted step training only the adapters: `(loss, grads, new adapters, state)`."""
    optimizer = optax.adamw(**ADAMW)

    @functools.partial(eqx.filter_jit, compiler_options=harness.FAST_COMPILE)
    def step(model, x, t, c, target):
        model = place(model)
        trainable, frozen = eqx.partition(model, nn.lora_filter(model))
        state = optimizer.init(trainable)

        def loss(trainable):
            out = run(eqx.combine(trainable, frozen), x, t, c)
            return jnp.mean(jnp.square(out - target))

        value, grads = jax.value_and_grad(loss)(trainable)
        updates, state = optimizer.update(grads, state, trainable)
        return value, grads, optax.apply_updates(trainable, updates), state

    return step


@pytest.fixture(scope="module")
def training(wan):
    """The model with adapters, inputs, and the single-device step's results."""
    model = _with_random_b(models.add_lora(wan, TARGETS, 4, alpha=8.0, key=jax.random.key(0)), 4)
    rng = np.random.default_rng(5)
    x = jnp.asarray(harness.normal(rng, (BATCH, 4, 3, 6, 10)))
    c = jnp.asarray(harness.normal(rng, (BATCH, 7, 32)))
    t = jnp.asarray(rng.uniform(0, 1000, BATCH), jnp.float32)
    target = jnp.asarray(harness.normal(rng, x.shape))
    inputs = (x, t, c, target)
    return model, inputs, _train_step(lambda m, x, t, c: jax.vmap(m)(x, t, c))(model, *inputs)


SHARDED = {
    "dp2-sp2-tp2-ulysses-fsdp": (dict(dp=2, sp=2, tp=2), dict(
        sequence="ulysses", tp_axis="tp", fsdp_axes=("dp", "sp")), "dp"),
    "sp4-tp2-ring-zigzag": (dict(sp=4, tp=2), dict(
        sequence="ring", layout="zigzag", tp_axis="tp"), None),
}


@pytest.mark.slow  # a sharded training step per configuration
@pytest.mark.parametrize("name", SHARDED)
def test_training_adapters_sharded_equals_one_device(training, name):
    model, inputs, (loss1, grads1, params1, state1) = training
    shape, config, batch_axis = SHARDED[name]
    mesh = harness.mesh(**shape)
    sharded = nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(**config))
    step = _train_step(
        lambda m, x, t, c: models.run_sharded(m, x, t, c, mesh=mesh, batch_axis=batch_axis,
                                              remat="full"),
        lambda m: nn.sharding.shard_module(m, mesh))
    loss, grads, params, state = step(sharded, *inputs)
    assert abs(float(loss) - float(loss1)) <= RTOL * abs(float(loss1))
    harness.assert_leaves_close(grads, grads1, "adapter gradients")
    harness.assert_leaves_close(params, params1, "adapters after one AdamW step")
    harness.assert_leaves_close(state[0].mu, state1[0].mu, "AdamW's first moment")


def test_optimizer_state_holds_only_the_adapters(training):
    model, _, (_, grads, params, state) = training
    adapters = [x for x in jax.tree.leaves(eqx.filter(model, nn.lora_filter(model)))]
    shapes = sorted(x.shape for x in adapters)
    assert sorted(x.shape for x in jax.tree.leaves(grads)) == shapes
    moments = [x for x in jax.tree.leaves(state) if x.ndim]
    assert sorted(x.shape for x in moments) == sorted(shapes * 2)  # mu and nu
    adapter_bytes = sum(x.nbytes for x in adapters)
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    assert sum(x.nbytes for x in moments) == 2 * adapter_bytes < model_bytes / 3


# -- 6. placement, CogVideoX, bad input ------------------------------------------------------


def test_adapters_follow_the_tensor_parallel_split():
    attn = nn.Attention(32, 4, parallel=nn.sharding.ParallelConfig(tp_axis="tp"), key=jax.random.key(0))
    attn = eqx.tree_at(lambda a: (a.q, a.o), attn,
                       (nn.with_lora(attn.q, 2, key=jax.random.key(1)),
                        nn.with_lora(attn.o, 2, key=jax.random.key(2))))
    specs = nn.sharding.partition_specs(attn)
    q, o = specs.q.adapters["default"], specs.o.adapters["default"]
    assert (q.lora_A, q.lora_B) == (P(), P("tp", None))  # column-parallel: B's rows
    assert (o.lora_A, o.lora_B) == (P(None, "tp"), P())  # row-parallel: A's columns
    assert specs.q.weight == P("tp", None) and specs.o.weight == P(None, "tp")


def test_optimizer_state_placed_like_the_adapters(training):
    model = training[0]
    mesh = harness.mesh(sp=4, tp=2)
    model = nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(sequence="ulysses", tp_axis="tp"))
    spec = nn.lora_filter(model)
    state = optax.adamw(1e-3).init(eqx.filter(model, spec))
    placed = nn.sharding.shard_like(state, model, mesh, filter_spec=spec)
    mu = placed[0].mu.blocks.self_attn
    assert mu.q.adapters["default"].lora_B.sharding.spec == P(None, "tp", None)
    assert mu.o.adapters["default"].lora_A.sharding.spec == P(None, None, "tp")
    assert placed[0].count.sharding.spec == P()


def test_cogvideox_adapters_round_trip(tmp_path):
    model = models.CogVideoXTransformer3D.from_pretrained(FIXTURES / "cogvideox" / "5b" / "diffusers")
    names = {n for t in model.linear_layers() for n in t.names}
    assert "transformer_blocks.0.attn1.to_q" in names
    lora = _with_random_b(models.add_lora(model, "transformer_blocks.*.attn1.to_[qkv]", 2,
                                          key=jax.random.key(0)), 5)
    models.save_lora(lora, tmp_path)
    back = models.load_lora(model, tmp_path)
    assert harness.same_arrays(eqx.filter(back, eqx.is_array), eqx.filter(lora, eqx.is_array))


def test_bad_input(wan, tmp_path):
    layer = eqx.nn.Linear(4, 4, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"`rank` must be a positive integer; received -2"):
        nn.with_lora(layer, -2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"`rank` must be a positive integer; received 0"):
        models.add_lora(wan, "blocks.*.attn1.to_q", 0, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"pattern 'blocks\.\*\.attn9\.\*' selects no linear "
                                         r"layer of WanTransformer3D(.|\n)*blocks\.0\.attn1\.to_q"):
        models.add_lora(wan, ["blocks.*.attn1.to_q", "blocks.*.attn9.*"], 2, key=jax.random.key(0))
    with_a = models.add_lora(wan, "blocks.*.attn1.to_q", 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"already has an adapter named 'default'"):
        models.add_lora(with_a, "blocks.*.attn1.to_k", 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"adapters \['default'\] that are not merged"):
        with_a.state_dict()
    with pytest.raises(ValueError, match=r"no adapter named \['nope'\]; the tree has \['default'\]"):
        nn.set_lora_scale(with_a, {"nope": 0.5})
    with pytest.raises(ValueError, match=r"merged into the weights; unmerge_lora them first"):
        nn.remove_lora(nn.merge_lora(with_a))
    assert nn.remove_lora(with_a).blocks.self_attn.q.__class__ is eqx.nn.Linear

    # A file: every bad key listed in one error, nothing loaded.
    good = dict(interop.open_safetensors(LORA / "peft" / interop.LORA_FILE))
    bad = dict(good)
    bad["transformer.blocks.7.attn1.to_q.lora_A.weight"] = np.zeros((4, 64), np.float32)
    bad["transformer.blocks.7.attn1.to_q.lora_B.weight"] = np.zeros((64, 4), np.float32)
    bad["transformer.blocks.0.norm2.diff"] = np.zeros((64,), np.float32)
    bad["transformer.blocks.0.attn2.to_q.lora_A.weight"] = np.zeros((4, 65), np.float32)
    with pytest.raises(ValueError) as error:
        models.load_lora(wan, bad)
    message = str(error.value)
    assert "3 key(s) of the LoRA file cannot be loaded" in message
    assert "blocks.7.attn1.to_q: matches no linear layer of WanTransformer3D" in message
    assert "blocks.0.norm2.diff: a full-weight or bias delta" in message
    assert "blocks.0.attn2.to_q: lora_A [4, 65] and lora_B [64, 4] do not fit the layer's " \
           "weight (out=64, in=64)" in message
    # `ignore` skips keys knowingly; a wrong output size is named too
    del bad["transformer.blocks.0.attn2.to_q.lora_A.weight"]
    bad["transformer.blocks.0.attn2.to_q.lora_A.weight"] = good[
        "transformer.blocks.0.attn2.to_q.lora_A.weight"]
    ok = models.load_lora(wan, bad, ignore=["*.diff", "transformer.blocks.7.*"])
    assert nn.lora_names(ok) == ["default"]
    bad["transformer.blocks.0.attn2.to_q.lora_B.weight"] = np.zeros((32, 4), np.float32)
    with pytest.raises(ValueError, match=r"lora_B \[32, 4\] do not fit the layer's weight "
                                         r"\(out=64, in=64\)"):
        models.load_lora(wan, bad, ignore=["*.diff", "transformer.blocks.7.*"])
    rank = dict(good)
    rank["transformer.blocks.0.attn1.to_q.lora_B.weight"] = np.zeros((64, 3), np.float32)
    with pytest.raises(ValueError, match=r"'transformer\.blocks\.0\.attn1\.to_q\.lora_A\.weight' "
                                         r"\[4, 64\] and .* \[64, 3\] are not a low-rank pair"):
        models.load_lora(wan, rank)
    with pytest.raises(ValueError, match=r"no LoRA file at"):
        models.load_lora(wan, tmp_path)
    merged, originals = nn.merge_lora(with_a, keep_originals=True)
    with pytest.raises(ValueError, match=r"`originals` has no weight for the merged layer"):
        nn.unmerge_lora(merged, originals={})


def test_peft_config_alpha_rslora_and_dora(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {f"transformer.blocks.{i}.attn1.to_q.lora_{ab}.weight":
               harness.normal(rng, (2, 64) if ab == "A" else (64, 2)) for i in (0, 1) for ab in "AB"}

    def write(config):
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.safetensors"
        meta = {"lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()})}
        write_safetensors(path, tensors, meta)
        return path

    found = interop.read_lora(write({"r": 2, "lora_alpha": 4, "alpha_pattern": {
        r"blocks\.1\.attn1\.to_q": 8}}))
    assert [found.layers[f"blocks.{i}.attn1.to_q"].alpha for i in (0, 1)] == [4.0, 8.0]
    found = interop.read_lora(write({"r": 2, "lora_alpha": 4, "use_rslora": True}))
    assert found.layers["blocks.0.attn1.to_q"].alpha == pytest.approx(4 * 2 ** 0.5)
    assert interop.read_lora(tensors).layers["blocks.0.attn1.to_q"].alpha is None  # rank
    with pytest.raises(ValueError, match=r"DoRA adapter .* only plain LoRA is supported"):
        interop.read_lora(write({"r": 2, "lora_alpha": 4, "use_dora": True}))
