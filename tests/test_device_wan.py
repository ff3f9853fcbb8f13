"""A whole Wan 2.1 model on a TPU against the same model on the CPU, in one process.

Marked `device`: skipped unless `VIDAX_TEST_DEVICE=1` on a TPU (`harness/_device.py`);
`VIDAX_TEST_DEVICE=interpret` runs the same body on the CPU, the TPU side's kernels in
Pallas interpret mode, at smaller sizes (`interpret-full`: at these).

`models.WanTransformer3D` with two blocks at Wan's head size (2 heads of 128), float32, on
a video of 3 x 10 x 12 patches (360 tokens: not a multiple of the kernels' 128) and 20
text tokens: its patch embedding, time embedding and modulation, RoPE, the blocks'
self-attention and cross-attention on `"pallas_tpu"` (the splash kernel, which `"auto"`
takes on a TPU), the FFN, and the head. The output and the gradients of every parameter
and of the latents (a random cotangent on the output) must equal those of the same model
on the CPU backend (`"auto"` there: the XLA reference attention), both under
`jax.default_matmul_precision("highest")`; with full attention and with sliding tile
attention (`sliding_tile=`: the splash kernel with the mask's block-sparse structure).
"""

import equinox as eqx
import jax
import numpy as np
import pytest

import harness
from vidax_eqx import models


pytestmark = pytest.mark.device

XLA_OPTIMIZED = harness.on_chip()  # on the chip, compiled as XLA does by default
CHIP_SIZES = harness.chip_sizes()

if CHIP_SIZES:
    CONFIG = models.WanConfig(dim=256, ffn_dim=512, num_heads=2, num_layers=2, text_dim=64)
    LATENTS = (16, 3, 20, 24)  # patches (1, 2, 2): a 3 x 10 x 12 grid, 360 tokens
    SLIDING_TILE = ((1, 5, 4), (3, 1, 3))  # 20-token tiles, 3 x 2 x 3 of them
else:  # interpret mode: 2 heads of 16, a 2 x 4 x 5 grid (40 tokens)
    CONFIG = models.WanConfig(dim=32, ffn_dim=64, num_heads=2, num_layers=2, text_dim=16)
    LATENTS = (16, 2, 8, 10)
    SLIDING_TILE = ((1, 2, 2), (1, 1, 3))
TEXT_LEN = 20

# The tolerance, relative to each result's largest magnitude (the output, the latents'
# gradient; each parameter's gradient, at least 1e-3 of the largest gradient: a leaf whose
# gradient is float32 noise around zero, as the key biases' nearly are, is judged against
# the model's scale). Both sides compute in float32 with float32 products ("highest"), so
# each is within a few float32 roundings of the exact result, relative to the magnitudes
# it sums; they differ only in how they round: the order of the sums (the kernels' online
# softmax over blocks of keys against XLA's whole rows; the TPU's matrix units and
# reductions against the CPU's) and the transcendentals (exp, tanh, rsqrt: a few ulp each,
# other polynomials). The Pallas TPU kernel (interpret mode) against XLA, both on the CPU,
# differ by at most 6e-6 at these sizes (2.2e-6 at the small ones), the key biases' gradients
# the largest; 1e-4 leaves a margin of about 15 for the TPU's own rounding, the bound
# tests/test_wan.py puts on sharded gradients against one device's. A real fault (a dropped
# key block, a wrong mask, a lost gradient term) is O(1e-2) or more.
RTOL = 1e-4
FLOOR = 1e-3
# The three weights of the timestep's path get their own bound. Their gradients are sums over
# every token and block of the modulation's gradient (shift, scale, gate), large sums that
# cancel, so the order in which the chip adds them shows more in them: measured on a TPU
# v5e (2026-12-06) at 1.4e-4 to 7.5e-4, every other result under 1e-4. Not the chip's sin
# and cos of the sinusoidal embedding: at these arguments (`t * freq` up to 500 radians)
# they were 7.4e-8 from float64 there, 3.2e-8 on the CPU.
TIMESTEP_LEAVES = (".time_embedding.linear_1.weight", ".time_embedding.linear_2.weight",
                   ".time_projection.weight")
RTOL_TIMESTEP = 2e-3


@pytest.fixture(autouse=True, scope="module")
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _on(device, tree):
    """`tree` with its arrays on `device` (a module's static parts kept)."""
    arrays, static = eqx.partition(tree, eqx.is_array)
    return eqx.combine(jax.device_put(arrays, device), static)


@eqx.filter_jit
def _forward_and_grads(model, x, timestep, context, cotangent, sliding_tile):
    """The output and the gradients of `sum(out * cotangent)` with respect to every
    parameter and to the latents."""
    attention = None if sliding_tile is None else models.SlidingTile(*sliding_tile)
    out, vjp = eqx.filter_vjp(lambda m, x: m(x, timestep, context, attention=attention), model, x)
    return out, vjp(cotangent)


def _rel_error(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("attention", ["full", "sliding_tile"])
def test_wan_matches_cpu(attention):
    cpu = harness.cpu()
    with jax.default_device(cpu):  # both built on one backend: the same bits
        device_model = models.WanTransformer3D(CONFIG, implementation=harness.pallas_tpu(),
                                               key=jax.random.key(0))
        cpu_model = models.WanTransformer3D(CONFIG, implementation="auto", key=jax.random.key(0))
    assert harness.same_arrays(device_model, cpu_model)
    rng = np.random.default_rng(1)
    x = harness.normal(rng, LATENTS)
    context = harness.normal(rng, (TEXT_LEN, CONFIG.text_dim))
    cotangent = harness.normal(rng, (CONFIG.out_channels, *LATENTS[1:]))
    timestep = np.asarray(500.0, np.float32)
    sliding_tile = SLIDING_TILE if attention == "sliding_tile" else None
    inputs = (x, timestep, context, cotangent)

    got = _forward_and_grads(_on(harness.accelerator(), device_model),
                             *_on(harness.accelerator(), inputs), sliding_tile)
    ref = _forward_and_grads(_on(cpu, cpu_model), *_on(cpu, inputs), sliding_tile)
    (out, (grads, dx)), (ref_out, (ref_grads, ref_dx)) = jax.tree.map(np.asarray, (got, ref))
    assert out.shape == ref_out.shape and out.dtype == np.float32
    errors = {"out": _rel_error(out, ref_out), "d latents": _rel_error(dx, ref_dx)}
    errors.update(harness.leaf_errors(grads, ref_grads, floor=FLOOR))
    bad = {name: e for name, e in errors.items() if not e <= (RTOL_TIMESTEP if name in TIMESTEP_LEAVES else RTOL)}
    assert not bad, f"{len(bad)} of {len(errors)} results off (relative): {bad}"
