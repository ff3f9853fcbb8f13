"""The attention kernels on a TPU: the case matrix of `cases.py` with the real Pallas kernels.

Marked `device`: skipped unless `VIDAX_TEST_DEVICE=1` on a TPU (`harness/_device.py`);
`VIDAX_TEST_DEVICE=interpret` runs the same bodies on the CPU with the kernels in Pallas
interpret mode (`interpret-full`: at the chip's sizes). `tests/test_pallas.py` checks the
kernels' logic in interpret mode on every CI run; here Mosaic compiles them and the chip
runs them, under `jax.default_matmul_precision("highest")` (float32 products as float32:
otherwise the TPU's matrix units take them in bfloat16 and they agree with the oracle to
about three digits), against the float64 oracle with the suite's tolerance table
(`oracle.TOLERANCES`):

- every case of `cases.CASES`, float32, on `"pallas_tpu"` and on `"auto"`: forward, lse
    and the gradients of q, k, v, bias and sinks (a random cotangent); where the capability
    flags say `"pallas_tpu"` cannot serve a case (`kernels.implementation_report`), it must
    raise `NotImplementedError` naming every reason; `"auto"` serves them all;
- a subset in bfloat16, on both;
- the gradient through the lse (`attention_fwd` with `dlse`: the path ring attention takes);
- sequences over several kernel blocks with ragged ends (128-token blocks, and the
    registered blocks over a longer sequence), rows that see nothing, head size 64,
    determinism;
- the forward alone (`kernels.attention` outside a gradient: splash without its lse
    residual) against the oracle and bit for bit against the forward a gradient runs.

On the chip the cases run at Wan's head size (`D = 128`) and the registered `"pallas_tpu"`'s
own blocks; in interpret mode at their own (`D = 16`) and 128-token blocks, so that the
whole file stays about two minutes on a CPU.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
from cases import CASES, CASES_BY_NAME, Case, check_all, empty_row_inputs, kernel_kwargs, reference, run
from vidax_eqx import kernels


pytestmark = pytest.mark.device

# On the chip, compiled as XLA does by default (conftest's `_fast_compile` turns the CPU
# backend's LLVM optimizations off elsewhere; on a TPU that flag would slow every program).
XLA_OPTIMIZED = harness.on_chip()
CHIP_SIZES = harness.chip_sizes()
PALLAS = harness.pallas_tpu()
IMPLS = {"pallas_tpu": PALLAS, "auto": "auto"}


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _sized(case: Case) -> Case:
    """The case at Wan's head size on the chip (the MXU's 128 lanes), as it is in
    interpret mode."""
    return dataclasses.replace(case, D=128) if CHIP_SIZES else case


def _operands(case: Case, arrays, static):
    """`(q, k, v, kw)`: the arguments of `kernels.attention`, bias and sinks included."""
    kw = kernel_kwargs(arrays, static, case.segments)
    for n in ("bias", "sinks"):
        if n in arrays:
            kw[n] = jnp.asarray(arrays[n])
    return (*(jnp.asarray(arrays[n]) for n in "qkv"), kw)


def _refusals(case: Case, arrays, static) -> list[str]:
    """What the capability flags say `"pallas_tpu"` cannot serve in `case` (on a TPU)."""
    q, k, v, kw = _operands(case, arrays, static)
    return kernels.implementation_report(q, k, v, platform="tpu", **kw)["pallas_tpu"]


def _check_case(impl_name: str, case: Case, dtype, seed: int = 0, dlse: bool = False):
    """`case` on `impl_name` against the oracle, or (`"pallas_tpu"` where the flags say
    it cannot serve it) the `NotImplementedError` that names every reason."""
    impl = IMPLS[impl_name]
    arrays, static = case.inputs(dtype, seed)
    reasons = _refusals(case, arrays, static) if impl_name == "pallas_tpu" else []
    if reasons:
        q, k, v, kw = _operands(case, arrays, static)
        with pytest.raises(NotImplementedError) as err:
            kernels.attention(q, k, v, implementation=impl, **kw)
        assert "pallas_tpu" in str(err.value)
        for reason in reasons:
            assert reason in str(err.value), (reason, str(err.value))
        return
    _, _, res = run(impl, case, dtype=dtype, seed=seed, arrays=arrays, static=static, dlse=dlse)
    check_all(arrays, static, res, dtype, dlse=dlse)


MATRIX = [pytest.param(name, _sized(case), id=f"{name}-{case.name}") for name in IMPLS for case in CASES]


@pytest.mark.parametrize("impl_name, case", MATRIX)
def test_matches_oracle_or_refuses(impl_name, case):
    _check_case(impl_name, case, np.float32)


def test_refusals_are_the_documented_ones():
    """The cases `"pallas_tpu"` refuses are those of its documented limits (no custom
    positions; neither a window nor a soft cap with a bias or mask), and no others."""
    refused = {c.name for c in CASES if _refusals(_sized(c), *_sized(c).inputs())}
    documented = {
        c.name for c in CASES
        if c.positions is not None
        or ((c.bias is not None or c.mask is not None) and (c.window is not None or c.soft_cap is not None))
    }
    assert refused == documented


LOW_PRECISION = [CASES_BY_NAME[n] for n in (
    "gqa", "causal_q_gt_k", "segments_split", "bias_BHqk", "mask_1Hq1", "sinks",
    "causal+segments+sinks+softcap+gqa")]


@pytest.mark.parametrize("case", [_sized(c) for c in LOW_PRECISION], ids=str)
@pytest.mark.parametrize("impl_name", list(IMPLS))
def test_bfloat16(impl_name, case):
    _check_case(impl_name, case, jnp.bfloat16, seed=1)


DLSE = [CASES_BY_NAME[n] for n in (
    "gqa", "causal_q_gt_k", "sinks", "causal+segments+sinks+softcap+gqa", "bias_qk", "mask_1Hq1")]


@pytest.mark.parametrize("case", [_sized(c) for c in DLSE], ids=str)
def test_lse_gradient(case):
    """Gradients through both outputs of `attention_fwd`: the kernels' backward from
    `delta - dlse`."""
    _check_case("pallas_tpu", case, np.float32, seed=4, dlse=True)


# -- several blocks -------------------------------------------------------------------------

# (case, blocks): `None` takes the registered "pallas_tpu" and its own blocks, over a
# sequence longer than them at the chip's sizes (ragged: 1100 tokens).
LONG = 1100 if CHIP_SIZES else 300
TILED = [
    pytest.param(Case("splash_128_blocks", B=1, S_q=300, S_k=260, H=4, H_kv=2, D=16, causal=True,
                      window=(90, 0), segments="split", sinks=True, soft_cap=5.0), (128, 128),
                 id="splash_128_blocks"),
    pytest.param(Case("flash_128_blocks", B=1, S_q=260, S_k=300, H=2, H_kv=1, D=16, causal=True,
                      bias=(1, 2, 260, 300), mask=(1, 1, 260, 300), segments="split"), (128, 128),
                 id="flash_128_blocks"),
    pytest.param(Case("registered_blocks", B=1, S_q=LONG, S_k=LONG, H=4, H_kv=2, D=16, causal=True,
                      segments="shared", sinks=True), None, id="registered_blocks"),
]


@pytest.mark.parametrize("case, blocks", TILED)
def test_several_blocks(case, blocks):
    case = _sized(case)
    arrays, static, res = run(harness.pallas_tpu(blocks), case, dlse=True)
    check_all(arrays, static, res, np.float32, dlse=True)


@pytest.mark.parametrize("kind", ["segments", "mask"])
def test_rows_that_see_nothing(kind):
    """Rows with no visible key: exactly 0, lse -inf, no NaN in the gradients."""
    case, arrays, static = empty_row_inputs(kind)
    if CHIP_SIZES:  # the same visibility, q / k / v / dout drawn again at Wan's head size
        case = _sized(case)
        arrays.update(harness.attention_inputs(case.B, case.S_q, case.H, case.D, H_kv=case.H_kv,
                                               S_k=case.S_k, seed=5))
    ref = reference(arrays, static)
    empty = ~np.isfinite(ref.lse)
    assert empty.any()
    _, _, res = run(PALLAS, case, arrays=arrays, static=static, dlse=True)
    assert np.all(res["out"][np.transpose(empty, (0, 2, 1))] == 0.0)
    assert np.all(res["lse"][empty] == -np.inf)
    check_all(arrays, static, res, np.float32, dlse=True)


def test_head_dim_64():
    """CogVideoX's head size (64: half the MXU's lanes) on the splash kernel."""
    case = dataclasses.replace(CASES_BY_NAME["causal+segments+sinks+softcap+gqa"], D=64 if CHIP_SIZES else 16)
    _check_case("pallas_tpu", case, np.float32, seed=2, dlse=True)


def test_deterministic():
    """The same compiled call twice gives bitwise-equal outputs and gradients."""
    case = _sized(CASES_BY_NAME["causal+segments+sinks+softcap+gqa"])
    arrays, static = case.inputs()
    kw = kernel_kwargs(arrays, static, case.segments)

    @jax.jit
    def f(q, k, v, sinks, dout, dlse):
        fwd = lambda q, k, v, s: kernels.attention_fwd(q, k, v, sinks=s, implementation=PALLAS, **kw)
        outs, vjp = jax.vjp(fwd, q, k, v, sinks)
        return outs, vjp((dout, dlse))

    args = [jnp.asarray(arrays[n]) for n in ("q", "k", "v", "sinks", "dout", "dlse")]
    first = jax.tree.map(np.asarray, f(*args))
    second = jax.tree.map(np.asarray, f(*args))
    jax.tree.map(np.testing.assert_array_equal, first, second)


FORWARD_ALONE = [
    pytest.param(Case("full", B=1, S_q=LONG, S_k=LONG, H=4, H_kv=2, D=16), np.float32, id="full-float32"),
    pytest.param(Case("full", B=1, S_q=LONG, S_k=LONG, H=4, H_kv=4, D=16), jnp.bfloat16, id="full-bfloat16"),
    pytest.param(Case("causal", B=1, S_q=LONG, S_k=LONG, H=4, H_kv=2, D=16, causal=True), np.float32,
                 id="causal-float32"),
    pytest.param(Case("causal", B=1, S_q=LONG, S_k=LONG, H=4, H_kv=4, D=16, causal=True), jnp.bfloat16,
                 id="causal-bfloat16"),
]


@pytest.mark.parametrize("case, dtype", FORWARD_ALONE)
def test_forward_alone(case, dtype):
    """`kernels.attention` outside a gradient (`fwd_out`: the kernel that writes no lse,
    or, for full attention in 16-bit inputs at a padded length, the forward with it)
    against the oracle, and bit for bit against `attention_fwd`'s output, over the
    registered blocks and a ragged length."""
    case = _sized(case)
    arrays, static = case.inputs(dtype, seed=6)
    q, k, v, kw = _operands(case, arrays, static)
    alone = jax.jit(lambda q, k, v: kernels.attention(q, k, v, implementation=PALLAS, **kw))
    with_lse = jax.jit(lambda q, k, v: kernels.attention_fwd(q, k, v, implementation=PALLAS, **kw)[0])
    out = np.asarray(alone(q, k, v).astype(jnp.float32))
    np.testing.assert_array_equal(out, np.asarray(with_lse(q, k, v).astype(jnp.float32)))
    assert np.all(np.isfinite(out))
    oracle.assert_close(out, reference(arrays, static).out, dtype, "forward alone")
