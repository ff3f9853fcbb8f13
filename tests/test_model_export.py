"""A whole model through `jax.export` (`models.export`, `models.ExportedModel`), on tiny
random Wan and CogVideoX models.

1. Round trip: a Wan forward and an AdamW training step exported, serialized,
   deserialized and called give bit for bit what the direct (`eqx.filter_jit`) call
   gives: the export is the same program, so the direct call is the reference here
   (the models' numerics are checked against the reference models elsewhere:
   tests/test_wan.py, tests/test_cogvideox.py). A LoRA-wrapped Wan and a CogVideoX
   (2B: the sin-cos embedding; 5B: RoPE) export and round-trip too, and the bytes
   reload and run in a fresh process that builds its own model.
2. Size: the RoPE tables and the sin-cos embedding are computed in the program from
   per-axis float64 tables, bit for bit the full-grid tables computed in NumPy; the
   exported module holds no constant with a token axis, so the serialized size grows
   with the token count only by the per-axis tables (O(f + h + w)); in the lowerings for
   cpu + tpu + cuda too (the TPU kernels' per-query mask ids among them).
3. Multi-platform: cpu + tpu + cuda from this CPU host; the Triton custom-call check
   disabled for exactly that target; the CPU part runs after a round trip. A model
   sharded over 8 simulated devices (`run_sharded` in the exported function) too.
4. Bad input: a model of another configuration, another input shape, a model without
   its LoRA adapters, bytes that are not an export, a non-module model, an output that
   cannot be rebuilt.
"""

import dataclasses
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import harness
from vidax_eqx import models, nn
from vidax_eqx.nn import functional


# Bit-identity between two programs (see conftest's _elemental_emitters_when_fast): XLA's
# default CPU fusion emitters.
XLA_DEFAULT_EMITTERS = True


WAN = models.WanConfig(dim=32, ffn_dim=64, num_heads=4, num_layers=2, in_channels=4,
                       out_channels=4, text_dim=16, freq_dim=16)
LATENTS = (4, 2, 6, 10)  # (C, F, H, W): patch grid 2 x 3 x 5, 30 tokens
TEXT = (7, 16)
TRITON, MOSAIC = "__gpu$xla.gpu.triton", "tpu_custom_call"


def _forward(model, x, timestep, context):
    return model(x, timestep, context)


def _roundtrip(exported) -> models.ExportedModel:
    return models.ExportedModel.deserialize(exported.serialize())


def _identical(a, b):
    a, b = eqx.filter(a, eqx.is_array), eqx.filter(b, eqx.is_array)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and np.array_equal(x, y), f"max |diff| {np.max(np.abs(x - y))}"


@pytest.fixture(scope="module")
def wan():
    return harness.perturbed(models.WanTransformer3D(WAN, key=jax.random.key(0)), 1)


@pytest.fixture(scope="module")
def abstract():
    """The tiny Wan as shapes (`eqx.filter_eval_shape`): exporting needs no weights."""
    return eqx.filter_eval_shape(models.WanTransformer3D, WAN, key=jax.random.key(0))


@pytest.fixture(scope="module")
def io():
    rng = np.random.default_rng(3)
    return (jax.device_put(harness.normal(rng, LATENTS)), jax.device_put(np.float32(640.0)),
            jax.device_put(harness.normal(rng, TEXT)))


@pytest.fixture(scope="module")
def forward(wan, io):
    """The forward exported for cpu, tpu and cuda, reloaded from bytes."""
    exported = models.export(_forward, wan, *io, platforms=("cpu", "tpu", "cuda"))
    return exported, _roundtrip(exported)


@pytest.fixture(scope="module")
def direct(wan, io):
    return eqx.filter_jit(_forward)(wan, *io)


# -- 1. round trip -------------------------------------------------------------------------


def test_forward_round_trip(forward, wan, io, direct):
    exported, reloaded = forward
    _identical(reloaded(wan, *io), direct)
    assert reloaded.platforms == ("cpu", "tpu", "cuda")
    # The weights are arguments: other weights, the same program.
    other = harness.perturbed(wan, 2)
    _identical(reloaded(other, *io), eqx.filter_jit(_forward)(other, *io))


_CHILD = """
import sys
import equinox as eqx, jax, numpy as np
from vidax_eqx import models
config = models.WanConfig(dim=32, ffn_dim=64, num_heads=4, num_layers=2, in_channels=4,
                          out_channels=4, text_dim=16, freq_dim=16)
model = models.WanTransformer3D(config, key=jax.random.key(0))
io = np.load(sys.argv[2])
args = [jax.device_put(io[k]) for k in ("x", "t", "c")]
with open(sys.argv[1], "rb") as f:
    exported = models.ExportedModel.deserialize(f.read())
out = exported(model, *args)
ref = eqx.filter_jit(lambda m, x, t, c: m(x, t, c))(model, *args)
print("bitwise", np.array_equal(np.asarray(out), np.asarray(ref)))
"""


def test_reloaded_in_another_process(wan, io, tmp_path):
    """Serialized here, deserialized and called in a fresh process that builds the model
    again: the signature (configuration, activations, ParallelConfig) holds no
    per-process text, and the reloaded program is bitwise the direct call there."""
    assert WAN == models.WanConfig(dim=32, ffn_dim=64, num_heads=4, num_layers=2, in_channels=4,
                                   out_channels=4, text_dim=16, freq_dim=16)
    (tmp_path / "f.bin").write_bytes(models.export(_forward, wan, *io).serialize())
    np.savez(tmp_path / "io.npz", **dict(zip(("x", "t", "c"), map(np.asarray, io))))
    child = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "f.bin"),
                            str(tmp_path / "io.npz")], env=harness.child_env(1),
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip().endswith("bitwise True"), child.stdout


def test_training_step_round_trip(wan, io):
    optimizer = optax.adamw(1e-2)
    x, timestep, context = io
    target = jax.device_put(harness.normal(np.random.default_rng(5), LATENTS))

    def step(model, opt_state, x, timestep, context, target):
        def loss_fn(model):
            return jnp.mean((model(x, timestep, context) - target) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    opt_state = optimizer.init(eqx.filter(wan, eqx.is_array))
    batch = (x, timestep, context, target)
    exported = _roundtrip(models.export(step, wan, opt_state, *batch))
    direct = eqx.filter_jit(step)
    got, want = exported(wan, opt_state, *batch), direct(wan, opt_state, *batch)
    assert isinstance(got[0], models.WanTransformer3D) and got[0].config == WAN
    _identical(got, want)
    # A second step from the first's outputs (the rebuilt model and optimizer state).
    _identical(exported(*got[:2], *batch), direct(*want[:2], *batch))


def test_lora_model_round_trip(wan, io):
    lora = models.add_lora(wan, "blocks.*.self_attn.[qkvo]", rank=2, key=jax.random.key(4))
    lora = harness.perturbed(lora, 6)  # lora_B away from zero
    exported = _roundtrip(models.export(_forward, lora, *io))
    _identical(exported(lora, *io), eqx.filter_jit(_forward)(lora, *io))
    with pytest.raises(ValueError, match=r"model\.blocks\.self_attn\.q: exported LoRALinear, "
                                         r"received Linear"):
        exported(wan, *io)


@pytest.mark.parametrize("rope", [False, True], ids=["2b_sincos", "5b_rope"])
def test_cogvideox_round_trip(rope):
    config = models.CogVideoXConfig(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        time_embed_dim=16, text_embed_dim=16, num_layers=1, sample_width=8, sample_height=8,
        sample_frames=5, max_text_seq_length=4, use_rotary_positional_embeddings=rope)
    model = harness.perturbed(models.CogVideoXTransformer3D(config, key=jax.random.key(0)), 1)
    rng = np.random.default_rng(8)
    args = (jax.device_put(harness.normal(rng, (2, 4, 6, 8))), jax.device_put(np.float32(300.0)),
            jax.device_put(harness.normal(rng, (4, 16))))
    exported = models.export(_forward, model, *args)
    assert not _token_constants(exported.exported.mlir_module(), 2 * 3 * 4)
    _identical(_roundtrip(exported)(model, *args), eqx.filter_jit(_forward)(model, *args))


# -- 2. tables in the program, size independent of the token count --------------------------


def _full_grid_rope(grid, head_dim, split, positions, theta=10000.0):
    """The (S, head_dim // 2) tables over the whole grid in NumPy float64, rounded to
    float32 (the tables as they were computed before they moved into the program)."""
    f, h, w = grid
    parts = []
    for axis, (n, pos) in enumerate(zip(split, positions)):
        freqs = 1.0 / np.power(theta, np.arange(0, 2 * n, 2, dtype=np.float64) / (2 * n))
        angles = np.outer(np.asarray(pos, np.float64), freqs)
        shape = [1, 1, 1, n]
        shape[axis] = len(pos)
        parts.append(np.broadcast_to(angles.reshape(shape), (f, h, w, n)))
    angles = np.concatenate(parts, axis=-1).reshape(f * h * w, -1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _full_grid_sincos(grid, dim, spatial_scale, temporal_scale):
    def sincos(pos, n):
        omega = 1.0 / 10000.0 ** (np.arange(n // 2, dtype=np.float64) / (n / 2.0))
        a = np.outer(pos, omega)
        return np.concatenate([np.sin(a), np.cos(a)], axis=1)

    f, h, w = grid
    t = sincos(np.arange(f) / temporal_scale, dim // 4)
    y = sincos(np.arange(h) / spatial_scale, 3 * dim // 8)
    x = sincos(np.arange(w) / spatial_scale, 3 * dim // 8)
    table = np.concatenate([np.broadcast_to(t[:, None, None], (f, h, w, t.shape[1])),
                            np.broadcast_to(x[None, None, :], (f, h, w, x.shape[1])),
                            np.broadcast_to(y[None, :, None], (f, h, w, y.shape[1]))], axis=-1)
    return table.reshape(f * h * w, dim).astype(np.float32)


def _token_constants(text: str, tokens: int) -> list[str]:
    """The constants of a StableHLO module with an axis of at least `tokens` elements."""
    types = re.findall(r"stablehlo\.constant dense<.*?> : tensor<([\dx]*)[a-z]\w*>", text)
    return [t for t in types if any(int(d) >= tokens for d in t.split("x") if d)]


@pytest.mark.parametrize("case", ["wan", "wan_odd_split", "cogvideox_crop"])
def test_rope_tables_bitwise(case):
    grid, head_dim = (3, 5, 7), 24
    split, positions = functional.wan_rope_split(head_dim), [np.arange(n) for n in grid]
    kwargs = {}
    if case == "wan_odd_split":
        head_dim, split = 14, (3, 2, 2)
        kwargs = dict(split=split, theta=500.0)
    elif case == "cogvideox_crop":
        head_dim = 32
        split = (head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16)
        positions = [np.arange(3), np.linspace(0.5, 4.5, 5), np.linspace(0.0, 8.25, 7)]
        kwargs = dict(split=split, positions=positions)
    want = _full_grid_rope(grid, head_dim, split, positions, kwargs.get("theta", 10000.0))
    got = functional.rope_3d(grid, head_dim, **kwargs)
    traced = jax.jit(lambda: functional.rope_3d(grid, head_dim, **kwargs))
    for table in (got, traced()):
        for a, b in zip(table, want):
            assert a.dtype == jnp.float32 and np.array_equal(np.asarray(a), b)
    assert not _token_constants(traced.lower().as_text(), 3 * 5 * 7)


def test_sincos_embedding_bitwise():
    grid, dim = (3, 4, 5), 32
    want = _full_grid_sincos(grid, dim, 1.875, 1.0)
    fn = jax.jit(lambda: functional.sincos_embedding_3d(grid, dim, spatial_interpolation_scale=1.875))
    assert np.array_equal(np.asarray(fn()), want)
    assert np.array_equal(np.asarray(functional.sincos_embedding_3d(
        grid, dim, spatial_interpolation_scale=1.875)), want)
    assert not _token_constants(fn.lower().as_text(), 3 * 4 * 5)


def test_serialized_size_independent_of_tokens(abstract):
    """Exported abstractly (`eqx.filter_eval_shape`, `jax.ShapeDtypeStruct`s) at 2 and 8
    frames: 4x the tokens; the module grows by the per-frame rotary tables only."""
    t = jax.ShapeDtypeStruct((), jnp.float32)
    c = jax.ShapeDtypeStruct(TEXT, jnp.float32)
    sizes = {}
    for frames in (2, 8):
        x = jax.ShapeDtypeStruct((4, frames, 16, 16), jnp.float32)  # 128, 512 tokens
        exported = models.export(_forward, abstract, x, t, c)
        assert not _token_constants(exported.exported.mlir_module(), frames * 64)
        sizes[frames] = len(exported.serialize())
    pairs_t = functional.wan_rope_split(WAN.dim // WAN.num_heads)[0]
    per_axis = 2 * 4 * 6 * pairs_t  # cos + sin, float32, 6 more frames
    dense = 2 * 4 * (512 - 128) * (WAN.dim // WAN.num_heads // 2)  # the (S, c) tables
    assert sizes[8] - sizes[2] <= per_axis + 64, sizes  # and a few bytes of shape text
    assert sizes[8] - sizes[2] < dense // 20, sizes


def test_serialized_size_flat_on_every_platform(abstract):
    """Exported for cpu + tpu + cuda at 3x16x16 and 9x32x32 latents (192 and 2,304
    tokens): no constant with a token axis in any lowering (the TPU kernels' mask takes
    an int per query, 4 bytes a query per mask as a constant), and the serialized size
    within 1.2x (12x the tokens)."""
    t = jax.ShapeDtypeStruct((), jnp.float32)
    c = jax.ShapeDtypeStruct(TEXT, jnp.float32)
    sizes = []
    for latents in ((3, 16, 16), (9, 32, 32)):
        x = jax.ShapeDtypeStruct((WAN.in_channels, *latents), jnp.float32)
        exported = models.export(_forward, abstract, x, t, c, platforms=("cpu", "tpu", "cuda"))
        tokens = int(np.prod([n // p for n, p in zip(latents, WAN.patch_size)]))
        found = _token_constants(exported.exported.mlir_module(), tokens)
        assert not found, (latents, found)
        sizes.append(len(exported.serialize()))
    assert sizes[1] <= 1.2 * sizes[0], sizes


# -- 3. multi-platform ----------------------------------------------------------------------


def test_multi_platform_export(forward, abstract):
    exported, _ = forward
    text = exported.exported.mlir_module()
    assert f"custom_call @{TRITON}(" in text and f"custom_call @{MOSAIC}(" in text
    assert exported.exported.disabled_safety_checks == (
        jax.export.DisabledSafetyCheck.custom_call(TRITON),)
    io = (jax.ShapeDtypeStruct(LATENTS, jnp.float32), jax.ShapeDtypeStruct((), jnp.float32),
          jax.ShapeDtypeStruct(TEXT, jnp.float32))
    cpu_only = models.export(_forward, abstract, *io, platforms="cpu")
    assert cpu_only.exported.disabled_safety_checks == ()
    assert "custom_call" not in cpu_only.exported.mlir_module()


def test_sharded_model_round_trip(wan):
    """A model placed on 8 simulated devices (dp x sp x tp, Ulysses + Megatron), run by
    `run_sharded` inside `fn`: the exported program is the 8-device one."""
    mesh = harness.mesh(dp=2, sp=2, tp=2)
    config = nn.sharding.ParallelConfig(sequence="ulysses", tp_axis="tp")
    sharded = nn.sharding.shard_module(nn.sharding.with_parallel(wan, config), mesh)
    rng = np.random.default_rng(9)
    args = (jax.device_put(harness.normal(rng, (2, *LATENTS))),
            jax.device_put(np.array([900.0, 100.0], np.float32)),
            jax.device_put(harness.normal(rng, (2, *TEXT))))

    def run(model, x, t, context):
        return models.run_sharded(model, x, t, context, mesh=mesh, batch_axis="dp")

    exported = _roundtrip(models.export(run, sharded, *args))
    assert exported.exported.nr_devices == 8
    _identical(exported(sharded, *args), eqx.filter_jit(run)(sharded, *args))
    with pytest.raises(ValueError, match=r"model\.blocks\.self_attn\.parallel: exported "
                                         r"ParallelConfig\(sequence='ulysses'"):
        exported(nn.sharding.with_parallel(sharded, nn.sharding.ParallelConfig()), *args)


# -- 4. bad input ---------------------------------------------------------------------------


def test_other_configuration_is_refused(forward, io):
    _, reloaded = forward
    other = models.WanTransformer3D(dataclasses.replace(WAN, num_heads=2), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"model\.config\.num_heads: exported 4, received 2"):
        reloaded(other, *io)


def test_other_input_shape_is_refused(forward, wan, io):
    _, reloaded = forward
    x, t, c = io
    with pytest.raises(ValueError, match=re.escape(
            "args[0]: exported float32[4, 2, 6, 10], received float32[4, 1, 6, 10]")):
        reloaded(wan, x[:, :1], t, c)
    with pytest.raises(ValueError, match=re.escape("args[1]: exported float32[], received 640.0")):
        reloaded(wan, x, 640.0, c)


def test_bad_export_arguments_raise(wan, io):
    with pytest.raises(ValueError, match="not an exported model function"):
        models.ExportedModel.deserialize(b"\x05\x00\x00\x00\x00\x00\x00\x00hello")
    with pytest.raises(ValueError, match="`model` must be an Equinox module.*received dict"):
        models.export(_forward, {"w": io[0]}, *io)
    with pytest.raises(ValueError, match="output 1 of `fn` holds non-array values"):
        models.export(lambda m, x: (x, "text"), wan, io[0])
