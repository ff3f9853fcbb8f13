"""Dispatch decided for the platform a program is lowered for, from this CPU host.

- `"auto"` lowered for TPU / GPU picks what a TPU / GPU host would (its custom
  call is in the module), and a CPU program never traces those kernels;
- one `jax.export` for CPU, TPU and CUDA holds every platform's choice, and the
  artifact run here gives the float64 oracle's forward and gradients;
- a named vendor kernel lowers for its platform from any host and raises a clear
  `NotImplementedError` where it is compiled for a platform it does not serve;
- `select_implementation` / `implementation_report` answer for a `platform=`.

Small shapes: only lowering is exercised off-device (tests/test_cross_lowering.py
lowers the real model sizes).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import harness
import oracle
from vidax_eqx import kernels, parallel
from vidax_eqx.kernels import _registry, PallasGpu, PallasTpu


B, S, H, H_KV, D = 1, 200, 4, 2, 32  # GQA, S not a multiple of any tile
# The calls are causal with sinks: features every kernel (CPU, Mosaic, Triton) serves.
TPU, TRITON = "tpu_custom_call", "__gpu$xla.gpu.triton"
# Pallas kernels carry no compatibility guarantee across jaxlib versions: an export
# holding them states that it knows (jax.export refuses them otherwise).
UNSTABLE_KERNELS = [export.DisabledSafetyCheck.custom_call(TRITON)]


def _inputs(seed=0):
    """`(q, k, v, sinks, dout)` as JAX arrays (`harness.attention_inputs`)."""
    a = harness.attention_inputs(B, S, H, D, H_kv=H_KV, seed=seed, sinks=True)
    return tuple(jnp.asarray(a[n]) for n in ("q", "k", "v", "sinks", "dout"))


def _loss(implementation="auto"):
    def loss(q, k, v, sinks, dout):
        out = kernels.attention(
            q, k, v, sinks=sinks, causal=True, implementation=implementation
        )
        return jnp.sum(out * dout)

    return loss


def _lowered(fn, args, platform) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize(
    "platform, present, absent",
    [("cpu", (), (TPU, TRITON)), ("tpu", (TPU,), (TRITON,)), ("cuda", (TRITON,), (TPU,))],
)
def test_auto_lowers_the_kernel_of_the_lowering_platform(platform, present, absent):
    args = _inputs()
    text = _lowered(jax.grad(_loss(), argnums=(0, 1, 2, 3)), args, platform)
    for target in present:
        assert target in text, f"{target} missing from the {platform} lowering"
    for target in absent:
        assert target not in text, f"{target} in the {platform} lowering"


def test_one_export_for_every_platform_runs_here_like_the_oracle():
    q, k, v, sinks, dout = args = _inputs(1)
    grad = jax.jit(jax.value_and_grad(_loss(), argnums=(0, 1, 2, 3)))
    exported = export.export(grad, platforms=("cpu", "tpu", "cuda"), disabled_checks=UNSTABLE_KERNELS)(*args)
    text = exported.mlir_module()
    assert TPU in text and TRITON in text  # each platform's choice is in the artifact
    # Serialized and read back, as a program shipped to another host would be.
    restored = export.deserialize(exported.serialize())
    assert restored.platforms == ("cpu", "tpu", "cuda")
    _, (dq, dk, dv, ds) = restored.call(*args)
    ref = oracle.attention(q, k, v, sinks=sinks, causal=True, dout=dout)
    for name, got, want in (("dq", dq, ref.dq), ("dk", dk, ref.dk), ("dv", dv, ref.dv), ("dsinks", ds, ref.dsinks)):
        oracle.assert_close(got, want, jnp.float32, name)
    out = export.export(
        jax.jit(lambda q, k, v, s: kernels.attention(q, k, v, sinks=s, causal=True)),
        platforms=("cpu", "tpu", "cuda"), disabled_checks=UNSTABLE_KERNELS,
    )(q, k, v, sinks).call(q, k, v, sinks)
    oracle.assert_close(out, ref.out, jnp.float32, "out")


def test_a_cpu_program_never_traces_the_vendor_kernels(monkeypatch):
    """The TPU / GPU branches are traced only when the program is lowered for them."""

    def refuse(*args, **kwargs):
        raise AssertionError("a vendor kernel was traced for a CPU program")

    monkeypatch.setattr(PallasTpu, "fwd", refuse)
    monkeypatch.setattr(PallasGpu, "fwd", refuse)
    monkeypatch.setattr(PallasTpu, "bwd", refuse)
    monkeypatch.setattr(PallasGpu, "bwd", refuse)
    args = _inputs(2)
    value = jax.jit(jax.grad(_loss(), argnums=(0, 1, 2, 3)))(*args)
    assert all(np.isfinite(np.asarray(g)).all() for g in value)
    with pytest.raises(AssertionError, match="vendor kernel was traced"):
        _lowered(jax.grad(_loss()), args, "tpu")


@pytest.mark.parametrize("name, platform, target", [("pallas_tpu", "tpu", TPU), ("pallas_gpu", "cuda", TRITON)])
def test_a_named_vendor_kernel_lowers_for_its_platform_from_any_host(name, platform, target):
    q, k, v, _, dout = _inputs(3)
    loss = lambda q, k, v, dout: jnp.sum(kernels.attention(q, k, v, causal=True, implementation=name) * dout)
    g = jax.grad(loss, argnums=(0, 1, 2))
    assert target in _lowered(g, (q, k, v, dout), platform)
    # Compiled for this CPU host (where it cannot run): a clear error at lowering.
    with pytest.raises(NotImplementedError, match=rf"'{name}' does not support: platform 'cpu'.*lowering for cpu"):
        jax.jit(g)(q, k, v, dout)
    # Eagerly, on CPU arrays, the platform is known when the call is made.
    with pytest.raises(NotImplementedError, match=rf"'{name}' does not support: platform 'cpu'"):
        kernels.attention(q, k, v, implementation=name)


def test_a_named_vendor_kernel_in_a_ring_lowers_for_its_platform():
    mesh = harness.mesh(sp=4)
    spec = jax.P(None, "sp")
    ring = jax.shard_map(
        lambda q, k, v: parallel.ring_attention(q, k, v, ring_axis="sp", causal=True, implementation="pallas_tpu"),
        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
    )
    x = jax.ShapeDtypeStruct((1, 4 * 256, 4, 128), jnp.bfloat16)
    text = _lowered(jax.grad(lambda q, k, v: ring(q, k, v).astype(jnp.float32).sum()), (x, x, x), "tpu")
    assert TPU in text and "collective_permute" in text


def test_select_implementation_and_report_take_a_platform():
    x = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    assert kernels.select_implementation(x, x, x, platform="tpu") == "pallas_tpu"
    assert kernels.select_implementation(x, x, x, platform="cuda") == "pallas_gpu"  # no cuDNN off a GPU host
    assert kernels.select_implementation(x, x, x, platform="cpu") == "blockwise"
    assert kernels.select_implementation(x, x, x) == "blockwise"  # this host
    assert kernels.select_implementation(x, x, x, platform="tpu", window=(64, 64), needs_lse=True) == "pallas_tpu"
    report = kernels.implementation_report(x, x, x, platform="tpu")
    assert list(report)[0] == "pallas_tpu" and report["pallas_tpu"] == []
    assert any("platform 'tpu'" in r for r in report["pallas_gpu"])
    with pytest.raises(NotImplementedError, match="platform 'cpu'"):
        kernels.select_implementation(x, x, x, platform="cpu", implementation="pallas_tpu")
    with pytest.raises(ValueError, match=r"`platform` must be one of .*received 'metal'"):
        kernels.select_implementation(x, x, x, platform="metal")


def test_vmapped_attention_dispatches_per_platform():
    """The dispatch primitive's batching rule: `vmap` over a kernel call."""
    q, k, v, sinks, dout = _inputs(4)
    one = lambda q, k, v: kernels.attention(q[None], k[None], v[None], causal=True)[0]
    batched = jax.vmap(one)
    xs = [jnp.concatenate([x, x * 0.5]) for x in (q, k, v)]  # a batch of 2 examples
    got = jax.jit(batched)(*xs)
    want = jax.jit(lambda q, k, v: kernels.attention(q, k, v, causal=True))(*xs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert TPU in _lowered(batched, xs, "tpu")


@dataclasses.dataclass(frozen=True)
class _FusedForTests(kernels.AbstractImplementation):
    """A GPU kernel differentiated by its own VJP (like cuDNN): no float32 lse."""

    name = "fused_for_tests"
    capabilities = kernels.Capabilities(platforms=("gpu",), float32_lse=False, sinks=False, window=False,
                                        segment_ids=False, positions=False, logits_soft_cap=False)

    def fwd(self, ops, opts):
        out = jax.nn.dot_product_attention(ops.q, ops.k, ops.v, scale=opts.scale, is_causal=opts.causal)
        return jnp.cos(jnp.zeros((), out.dtype)) * out, None  # the cosine marks it in the lowering

    def bwd(self, *args):
        raise NotImplementedError


def test_a_fused_kernel_with_its_own_vjp_is_chosen_per_platform(monkeypatch):
    """Where a platform's choice has no float32 lse (cuDNN on a GPU host), `attention`
    stages it outside the custom VJP; the other platforms run through it."""
    monkeypatch.setitem(_registry._REGISTRY, _FusedForTests.name, _FusedForTests())
    monkeypatch.setitem(_registry._VENDOR_PREFERENCE, "gpu", (_FusedForTests.name, "pallas_gpu"))
    q, k, v, _, dout = _inputs(5)
    loss = lambda q, k, v: jnp.sum(kernels.attention(q, k, v, causal=True) * dout)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    assert "cosine" in _lowered(grad, (q, k, v), "cuda")
    assert "cosine" not in _lowered(grad, (q, k, v), "cpu") and TPU in _lowered(grad, (q, k, v), "tpu")
    ref = oracle.attention(q, k, v, causal=True, dout=dout)
    for name, got, want in zip(("dq", "dk", "dv"), jax.jit(grad)(q, k, v), (ref.dq, ref.dk, ref.dv)):
        oracle.assert_close(got, want, jnp.float32, name)
