"""int8 transformers (`models.quantize`, `nn.QuantizedLinear`): the layer against a float64
oracle of its scheme, forward and gradient; a quantized Wan against the float model with
the same (dequantized) weights; sampling, streaming, blocks streamed from host memory,
LoRA on a quantized base and tensor parallelism; the refusals."""

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vidax_eqx import generate, interop, models, nn, parallel, pipelines, sampling
from vidax_eqx.models.internal import HostWords
from vidax_eqx.pipelines._memory import Residency

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAN = os.path.join(ROOT, "tests", "fixtures", "wan", "t2v", "diffusers")
COGVIDEOX = os.path.join(ROOT, "tests", "fixtures", "cogvideox", "2b")
T2V = os.path.join(ROOT, "tests", "fixtures", "wan_pipeline", "t2v")


def _oracle_rows(w):
    """Per-row symmetric int8 of `w`, in float64."""
    w = np.asarray(w, np.float64)
    amax = np.abs(w).max(-1)
    scale = np.where(amax > 0, amax / 127, 1.0)
    return np.clip(np.round(w / scale[..., None]), -127, 127), scale


def _layer(activations, rng):
    w = rng.standard_normal((16, 32)).astype(np.float32)
    w[3] = 0.0  # a row of zeros: scale 1, no division by zero
    linear = eqx.nn.Linear(32, 16, key=jax.random.key(0))
    linear = eqx.tree_at(lambda l: l.weight, linear, jnp.asarray(w))
    return w, linear, nn.QuantizedLinear.from_linear(linear, activations)


@pytest.mark.parametrize("activations", [None, "int8"])
def test_layer_against_the_float64_scheme(activations):
    rng = np.random.default_rng(0)
    w, linear, q = _layer(activations, rng)
    qw, scale = _oracle_rows(w)
    np.testing.assert_array_equal(np.asarray(q.qweight, np.float64), qw)
    np.testing.assert_allclose(np.asarray(q.scale), scale, rtol=1e-7)
    assert np.all(np.abs(w - qw * scale[:, None]) <= scale[:, None] / 2 * (1 + 1e-6))
    assert q.qweight.dtype == jnp.int8 and q.weight.dtype == jnp.float32
    x = rng.standard_normal((5, 32)).astype(np.float32)
    x[2] = 0.0  # a token of zeros stays zero
    deq = qw * scale[:, None]
    if activations is None:
        want = x.astype(np.float64) @ deq.T
    else:
        amax = np.abs(x.astype(np.float64)).max(-1, keepdims=True)
        sx = np.where(amax > 0, amax / 127, 1.0)
        xq = np.clip(np.round(x / sx), -127, 127)
        want = (xq @ qw.T) * sx * scale  # integer products, exact in float64
    want = want + np.asarray(linear.bias, np.float64)
    got = np.asarray(jax.vmap(q)(jnp.asarray(x)), np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    assert np.all(got[2] == np.asarray(linear.bias))
    # The input's gradient is the dequantized weight's (straight through the rounding).
    g = rng.standard_normal((5, 16))
    dx = jax.grad(lambda x: jnp.sum(jax.vmap(q)(x) * g))(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(dx, np.float64), g @ deq, rtol=2e-6, atol=2e-6)


@pytest.fixture(scope="module")
def wan():
    return models.WanTransformer3D.from_pretrained(WAN)


@pytest.fixture(scope="module")
def inputs(wan):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 4, 3, 6, 10)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((2, 7, wan.config.text_dim)), jnp.float32)
    return x, c


def _dequantized(model):
    """The float model with the quantized model's weights (the oracle of int8 weights)."""
    is_q = lambda x: isinstance(x, nn.QuantizedLinear)  # noqa: E731

    def back(layer):
        if not is_q(layer):
            return layer
        linear = eqx.nn.Linear(layer.in_features, layer.out_features, key=jax.random.key(0))
        return eqx.tree_at(lambda l: (l.weight, l.bias), linear, (layer.weight, layer.bias))

    return jax.tree.map(back, model, is_leaf=is_q)


def test_quantized_wan_is_the_float_model_of_its_weights(wan, inputs):
    x, c = inputs
    q = models.quantize(wan)
    assert type(q) is models.WanTransformer3D and type(q.blocks.ffn.fc1).__name__ == "QuantizedLinear"
    assert type(q.head.head) is eqx.nn.Linear  # the output head stays in float
    call = eqx.filter_jit(lambda m: m(x[0], jnp.float32(500.0), c[0]))
    out, ref, full = call(q), call(_dequantized(q)), call(wan)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    rel = float(jnp.linalg.norm(out - full) / jnp.linalg.norm(full))
    assert 0 < rel < 2e-2, rel
    # W8A8: within int8's error of the float model, and finite.
    w8a8 = call(models.quantize(wan, activations="int8"))
    rel8 = float(jnp.linalg.norm(w8a8 - full) / jnp.linalg.norm(full))
    assert rel8 < 3e-2 and np.isfinite(np.asarray(w8a8)).all(), rel8
    # Half the bytes of the blocks' matrices, and a bf16 model's halve too.
    f = lambda m: sum(a.nbytes for a in jax.tree.leaves(eqx.filter(m.blocks, eqx.is_array)))  # noqa: E731
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, wan)
    assert f(models.quantize(bf16)) < 0.6 * f(bf16)


def test_quantized_sampling_streaming_and_blocks_from_host(wan, inputs):
    x, c = inputs
    q = models.quantize(wan, activations="int8")
    run = lambda m: sampling.sample(m, x, c, negative_context=0.3 * c, steps=2, progress=None,  # noqa: E731
                                    caching=sampling.Caching(step=sampling.StaticStepCache()))
    a = run(q)
    assert np.isfinite(np.asarray(a)).all()
    # The int8 matrices stream from host memory as the float ones do, held there as
    # 32-bit words (a TPU copies a layer of those in without re-tiling the stack),
    # unpacked on the device to the same int8 matrices: the same outputs up to the float
    # rounding of another program (the CPU compiler fuses the unpacking's program
    # differently).
    np.testing.assert_array_equal(run(pipelines.stream_blocks(q)), a)  # (a CPU: int8 as is)
    streamed = Residency(None, jax.devices()[0]).put_streamed(q, pack=True)  # (a TPU's words)
    words = streamed.blocks.self_attn.q.qweight
    assert isinstance(words, HostWords) and words.words.sharding.memory_kind == "pinned_host"
    assert words.shape == q.blocks.self_attn.q.qweight.shape
    np.testing.assert_array_equal(words.unpack(), q.blocks.self_attn.q.qweight)
    np.testing.assert_allclose(run(streamed), a, rtol=1e-5, atol=1e-5)
    # Its checkpoint holds the int8 matrices, not the words.
    for name, tensor in streamed.state_dict().items():
        np.testing.assert_array_equal(tensor, q.state_dict()[name])
    chunk = eqx.filter_jit(lambda m, cache: m.stream(x[0][:, :1], jnp.float32(500.0), c[0], cache))
    cache = q.kv_cache(6, 10, max_frames=2)
    (out, kv), (out_s, kv_s) = chunk(q, cache), chunk(streamed, cache)
    assert np.isfinite(np.asarray(out)).all() and kv.k.shape[0] == wan.config.num_layers
    np.testing.assert_allclose(out_s, out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kv_s.k, kv.k, rtol=1e-5, atol=1e-5)


def test_lora_trains_on_a_quantized_base(wan, inputs):
    x, c = inputs
    q = models.quantize(wan)
    lora = lambda m: models.add_lora(m, ["blocks.*.attn1.to_q"], rank=2, key=jax.random.key(3))  # noqa: E731
    adapted, reference = lora(q), lora(_dequantized(q))

    def grads(m):
        params, static = eqx.partition(m, nn.lora_filter(m))
        loss = lambda p: jnp.mean(eqx.combine(p, static)(x[0], jnp.float32(500.0), c[0]) ** 2)  # noqa: E731
        return jax.tree.leaves(eqx.filter_jit(jax.grad(loss))(params))

    for g, r in zip(grads(adapted), grads(reference), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="merge_lora: this adapter's base layer has int8 weights"):
        nn.merge_lora(adapted)


def test_quantized_sharded_equals_one_device(wan, inputs):
    # Ulysses x Megatron TP x FSDP: the int8 matrices split as the float ones, their
    # scales with the output features; a row-parallel layer's token scales are the
    # whole token's (pmax over tp), so W8A8 gives one device's numbers.
    x, c = inputs
    mesh = parallel.make_mesh(sp=2, tp=2)
    q = models.quantize(wan, activations="int8")
    config = nn.sharding.ParallelConfig(sequence="ulysses", tp_axis="tp", fsdp_axes=("sp",))
    sharded = nn.sharding.shard_module(nn.sharding.with_parallel(q, config), mesh)
    spec = lambda a: tuple(a.sharding.spec)  # noqa: E731
    assert spec(sharded.blocks.self_attn.q.qweight) == (None, "tp", "sp")
    assert spec(sharded.blocks.self_attn.q.scale) == (None, "tp")
    assert spec(sharded.blocks.self_attn.o.qweight)[2] == "tp"  # row parallel: the inputs
    t = jnp.full((1,), 500.0)
    out = models.run_sharded(sharded, x[:1], t, c[:1], mesh=mesh)
    ref = eqx.filter_jit(lambda m: m(x[0], jnp.float32(500.0), c[0]))(q)
    np.testing.assert_allclose(out[0], ref, rtol=1e-5, atol=1e-5)


def test_int8_checkpoints(tmp_path):
    # quantize= at load; the int8 weights and scales written, read back as int8 bit for bit.
    q = models.WanTransformer3D.from_pretrained(WAN, quantize="int8")
    assert q.blocks.self_attn.q.activations == "int8" and q.blocks.self_attn.quantize is None
    assert q.blocks.cross_attn.q.activations == "int8"
    q = models.quantize(models.WanTransformer3D.from_pretrained(WAN), activations="int8",
                        attention="int8")  # int8 self-attention asked for by name
    q.save_pretrained(tmp_path / "q")
    with open(tmp_path / "q" / "config.json") as f:
        entry = json.load(f)["quantization_config"]
    assert entry == {"quant_method": "vidax_eqx", "weights": "int8", "activations": "int8",
                     "attention": "int8"}
    back = models.WanTransformer3D.from_pretrained(tmp_path / "q")
    assert back.blocks.ffn.fc1.qweight.dtype == jnp.int8 and back.blocks.self_attn.quantize == "int8"
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)
    assert jax.tree.structure(back) == jax.tree.structure(q)
    with pytest.raises(ValueError, match=r"holds int8 weights of format \('int8', 'int8'\) "
                                         r"\(weights, activations\); received quantize='int8-weights'"):
        models.WanTransformer3D.from_pretrained(tmp_path / "q", quantize="int8-weights")
    entry["quant_method"] = "bitsandbytes"
    with open(tmp_path / "q" / "config.json") as f:
        config = json.load(f)
    with open(tmp_path / "q" / "config.json", "w") as f:
        json.dump({**config, "quantization_config": entry}, f)
    with pytest.raises(ValueError, match="quantized by 'bitsandbytes'"):
        models.WanTransformer3D.from_pretrained(tmp_path / "q")
    with pytest.raises(ValueError, match=r"`quantize` must be one of \(None, 'int8-weights', "
                                         r"'int8'\); received 'int4'"):
        models.WanTransformer3D.from_pretrained(WAN, quantize="int4")
    # CogVideoX: its blocks too, within int8's error of the float model.
    io = dict(np.load(os.path.join(COGVIDEOX, "io.npz")))
    run = eqx.filter_jit(lambda m: jax.vmap(m)(io["x"], io["timestep"], io["context"]))
    float_, int8 = (run(models.CogVideoXTransformer3D.from_pretrained(
        os.path.join(COGVIDEOX, "diffusers"), quantize=mode)) for mode in (None, "int8-weights"))
    rel = float(jnp.linalg.norm(int8 - float_) / jnp.linalg.norm(float_))
    assert 0 < rel < 2e-2, rel
    # Its joint text-video attention has no int8 kernel: int8 attention asked of it is refused.
    cog = models.CogVideoXTransformer3D.from_pretrained(os.path.join(COGVIDEOX, "diffusers"))
    with pytest.raises(ValueError, match="have no self-attention layer that int8 attention serves"):
        models.quantize(cog, attention="int8")


def test_quantized_pipeline_streamed_and_planned(capsys, monkeypatch):
    call = dict(height=32, width=48, num_frames=5, num_inference_steps=2, guidance_scale=5.0,
                max_sequence_length=16, progress=False, seed=0)
    resident = pipelines.WanPipeline.from_pretrained(T2V, quantize="int8-weights")
    streamed = pipelines.WanPipeline.from_pretrained(
        T2V, quantize="int8-weights", offload="blocks", device_memory="50MB", plan_video=(32, 48, 5))
    assert streamed.placement["transformer"] == "streamed"
    assert streamed.transformer.blocks.ffn.fc1.qweight.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(streamed("a cat", **call).frames, resident("a cat", **call).frames)
    # The command plans the int8 bytes (transformer 55.59 KiB against 89.66 KiB in float)
    # before reading a weight.
    monkeypatch.setattr(interop.SafetensorsFile, "read_slice", lambda *a, **k: 1 / 0)
    with pytest.raises(SystemExit):
        generate.main([T2V, "--prompt", "a cat", "--height", "32", "--width", "48", "--num-frames",
                       "5", "--device-memory", "300KB", "--quantize", "int8", "--no-compile-cache"])
    assert "transformer 55.59 KiB" in capsys.readouterr().err


def test_refusals(wan):
    with pytest.raises(ValueError, match=r"quantize: `weights` must be one of \('int8',\); received 'int4'"):
        models.quantize(wan, weights="int4")
    with pytest.raises(ValueError, match=r"quantize: `activations` must be one of \(None, 'int8'\); "
                                         r"received 'fp8'"):
        models.quantize(wan, activations="fp8")
    with pytest.raises(ValueError, match="quantize: this WanTransformer3D is quantized already"):
        models.quantize(models.quantize(wan))
    with pytest.raises(ValueError, match="quantize: `model` must be a transformer of "
                                         "vidax_eqx.models with stacked blocks; received Linear"):
        models.quantize(eqx.nn.Linear(2, 2, key=jax.random.key(0)))
    merged = nn.merge_lora(models.add_lora(wan, ["blocks.*.attn1.to_q"], rank=2, key=jax.random.key(0)))
    with pytest.raises(ValueError, match="holds adapters merged into its weight"):
        models.quantize(merged)
