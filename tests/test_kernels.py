"""`vidax_eqx.kernels` against the float64 oracle: forward, lse, gradients.

`"xla"` and `Blockwise(16, 32)` (which makes the small shapes span many tiles,
with ragged last tiles) run the cases of `cases.CASES`; the default-configured
`"blockwise"` runs a representative subset. Gradients are taken with `jax.vjp`
and a random cotangent through `attention` (out only), through `attention_fwd`
(out and lse, so the `dlse` path is exercised) on a subset, and by calling
`attention_bwd` directly. Then: rows and tiles with nothing to attend to,
low-precision inputs, determinism, dispatch, `core.py`, and window sizes at the
edge of int32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
from cases import CASES, CASES_BY_NAME, Case, check_all, check_grads, empty_row_inputs, kernel_kwargs, reference, run
from vidax_eqx import core, kernels


# Compiled as XLA does by default (conftest's `_fast_compile` turns LLVM's optimizations
# off elsewhere): the optimized code of every kernel path is checked against the oracle.
XLA_OPTIMIZED = True

IMPLS = [
    pytest.param("xla", id="xla"),
    pytest.param("blockwise", id="blockwise"),
    pytest.param(kernels.Blockwise(block_q=16, block_kv=32), id="blockwise16x32"),
]
# The full case list runs on "xla" and on 16x32 tiles (which exercise every tiling
# path); the default-configured "blockwise" sees these short sequences as one tile,
# so a representative subset suffices for it.
BLOCKWISE_DEFAULT_CASES = {
    "plain", "gqa", "cross_q_gt_k", "causal_q_lt_k", "positions_perm_causal_window", "segments_split",
    "bias_B11k", "sinks", "causal+segments+sinks+softcap+gqa", "window+bias+mask", "everything_mqa",
}
# Cases that change nothing about tiling (a different scale; a window unbounded on
# both sides) run on "xla" only.
XLA_ONLY_CASES = {"scale", "window_None_None"}
MATRIX = [
    pytest.param(impl, case, id=f"{impl_id}-{case.name}")
    for impl, impl_id in (("xla", "xla"), (kernels.Blockwise(block_q=16, block_kv=32), "blockwise16x32"),
                          ("blockwise", "blockwise"))
    for case in CASES
    if impl_id == "xla"
    or (impl_id == "blockwise16x32" and case.name not in XLA_ONLY_CASES)
    or (impl_id == "blockwise" and case.name in BLOCKWISE_DEFAULT_CASES)
]


@pytest.mark.parametrize("impl, case", MATRIX)
def test_matches_oracle_float32(impl, case):
    arrays, static, res = run(impl, case)
    check_all(arrays, static, res, np.float32)


DLSE_CASES = [CASES_BY_NAME[n] for n in (
    "causal_bottom_right", "bias_qk", "sinks", "everything_mqa")]


@pytest.mark.parametrize("case", DLSE_CASES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_lse_gradient_matches_oracle(impl, case):
    """Gradients through both outputs of `attention_fwd` (the `dlse` path)."""
    arrays, static, res = run(impl, case, seed=4, dlse=True)
    check_all(arrays, static, res, np.float32, dlse=True)


LOW_PRECISION_CASES = [CASES_BY_NAME[n] for n in (
    "causal+segments+sinks+softcap+gqa", "window+bias+mask")]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_oracle_low_precision(impl, case, dtype):
    arrays, static, res = run(impl, case, dtype=dtype, seed=1)
    check_all(arrays, static, res, dtype)


@pytest.mark.parametrize(
    "case", [CASES_BY_NAME[n] for n in ("bias_qk", "everything_mqa")], ids=str
)
@pytest.mark.parametrize("impl", IMPLS)
def test_attention_bwd_direct(impl, case):
    """`attention_bwd` from the saved `(out, lse)`, with and without `dlse`."""
    arrays, static = case.inputs(np.float32, seed=2)
    kw = kernel_kwargs(arrays, static, case.segments)
    for n in ("bias", "sinks"):
        if n in arrays:
            kw[n] = jnp.asarray(arrays[n])
    q, k, v, dout = (jnp.asarray(arrays[n]) for n in ("q", "k", "v", "dout"))
    out, lse = kernels.attention_fwd(q, k, v, implementation=impl, **kw)
    for use_dlse in (False, True):
        dlse = jnp.asarray(arrays["dlse"]) if use_dlse else None
        grads = kernels.attention_bwd(q, k, v, out, lse, dout, dlse=dlse, implementation=impl, **kw)
        assert len(grads) == 5
        grads = [None if g is None else np.asarray(g) for g in grads]
        check_grads(grads, reference(arrays, static, dlse=use_dlse), arrays, np.float32,
                     f"attention_bwd(dlse={use_dlse})")


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_bwd_without_bias_or_sinks_returns_none(impl):
    arrays, _ = CASES_BY_NAME["plain"].inputs()
    q, k, v, dout = (jnp.asarray(arrays[n]) for n in ("q", "k", "v", "dout"))
    out, lse = kernels.attention_fwd(q, k, v, implementation=impl)
    dq, dk, dv, dbias, dsinks = kernels.attention_bwd(q, k, v, out, lse, dout, implementation=impl)
    assert dbias is None and dsinks is None
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


# -- rows and tiles with nothing to attend to -------------------------------------------


@pytest.mark.parametrize("kind", ["segments", "causal_positions", "causal_positions_sinks", "mask", "window"])
@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_rows(impl, kind):
    case, arrays, static = empty_row_inputs(kind)
    ref = reference(arrays, static)
    empty = ~np.isfinite(ref.lse)  # (B, H, S_q)
    if case.sinks:
        vis = oracle.visibility(case.B, case.H, case.S_q, case.S_k, q_pos=arrays["q_pos"],
                                kv_pos=arrays["kv_pos"], causal=True)
        no_key = ~vis.any(-1)
        assert no_key.any() and not empty.any()
    else:
        assert empty.any() and not empty.all(), "the case must have some empty rows"
    _, _, res = run(impl, case, arrays=arrays, static=static, dlse=True)
    empty_rows = np.transpose(empty, (0, 2, 1))  # (B, S_q, H)
    assert np.all(res["out"][empty_rows] == 0.0), "a row with nothing visible must give exactly 0"
    assert np.all(res["lse"][empty] == -np.inf)
    if case.sinks:
        # Nothing visible but the sink: out 0, lse = the sink logit.
        rows = np.transpose(no_key, (0, 2, 1))
        assert np.all(res["out"][rows] == 0.0)
        sink_lse = np.broadcast_to(arrays["sinks"][None, :, None], no_key.shape)
        np.testing.assert_allclose(res["lse"][no_key], sink_lse[no_key], rtol=1e-6)
    for g in res["grads"]:
        assert g is None or not np.any(np.isnan(g))
    check_all(arrays, static, res, np.float32, dlse=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_every_row_masked(impl):
    """No query sees any key: out is all 0, lse all -inf, gradients all 0."""
    arrays, static = Case("none", S_q=33, S_k=77).inputs()
    arrays["mask"] = np.zeros((1, 1, 33, 77), bool)
    arrays["bias"] = harness.normal(np.random.default_rng(0), (2, 4, 33, 77))
    case = Case("none", S_q=33, S_k=77, mask=(1, 1, 33, 77), bias=(2, 4, 33, 77))
    for dlse in (False, True):
        _, _, res = run(impl, case, arrays=arrays, static=static, dlse=dlse)
        assert np.all(res["out"] == 0) and np.all(res["lse"] == -np.inf)
        for g in res["grads"]:
            assert g is None or np.all(g == 0)


# -- padding of ragged tiles --------------------------------------------------------------


@pytest.mark.parametrize(
    "impl, S_q",
    [
        pytest.param("xla", 33, id="xla"),
        pytest.param("blockwise", 300, id="blockwise"),  # > block_q=256, not a multiple
        pytest.param(kernels.Blockwise(block_q=16, block_kv=32), 33, id="blockwise16x32"),
    ],
)
def test_large_key_bias_with_ragged_query_tiles(impl, S_q):
    """A key bias `(B, 1, 1, S_k)` with values near 95 (valid: softmax is shift-invariant
    within a row, and exp(95) overflows float32 only if the row's lse is ignored).

    Regression test: padded query rows of a ragged last tile must not turn such a
    bias into inf * 0 = NaN in dk, dv or dbias.
    """
    case = Case("large_key_bias", B=1, S_q=S_q, S_k=40, H=2, H_kv=1, D=8, bias=(1, 1, 1, 40),
                bias_offset=95.0)
    arrays, static, res = run(impl, case)
    check_all(arrays, static, res, np.float32)


# -- determinism, dispatch, the public surface --------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic(impl):
    """The same jitted call twice gives bitwise-equal outputs and gradients."""
    case = CASES_BY_NAME["everything_mqa"]
    arrays, static = case.inputs()
    kw = kernel_kwargs(arrays, static, case.segments)

    @jax.jit
    def f(q, k, v, bias, sinks, dout, dlse):
        fwd = lambda *a: kernels.attention_fwd(*a[:3], bias=a[3], sinks=a[4], implementation=impl, **kw)
        outs, vjp = jax.vjp(fwd, q, k, v, bias, sinks)
        return outs, vjp((dout, dlse))

    args = [jnp.asarray(arrays[n]) for n in ("q", "k", "v", "bias", "sinks", "dout", "dlse")]
    first = jax.tree.map(np.asarray, f(*args))
    second = jax.tree.map(np.asarray, f(*args))
    jax.tree.map(np.testing.assert_array_equal, first, second)


def test_implementations_and_feature_table():
    impls = kernels.implementations()
    assert {"xla", "blockwise"} <= set(impls)
    assert impls["xla"].name == "xla" and impls["blockwise"].name == "blockwise"
    assert isinstance(impls["blockwise"], kernels.Blockwise)
    table = kernels.feature_table()
    lines = table.splitlines()
    assert "`xla`" in lines[0] and "`blockwise`" in lines[0]
    columns = [c.strip(" `") for c in lines[0].split("|")[2:-1]]
    assert columns == list(impls)
    for label in ("GQA / MQA", "S_q != S_k", "additive bias", "boolean mask", "segment ids",
                  "causal", "sliding window", "custom positions", "attention sinks", "soft cap"):
        row = next(l for l in lines if label in l)
        cells = [c.strip() for c in row.split("|")[2:-1]]
        # The portable implementations serve everything; the others follow their flags.
        assert cells[columns.index("xla")] == cells[columns.index("blockwise")] == "yes", row
        assert len(cells) == len(impls)
    memory = next(l for l in lines if l.startswith("| memory"))
    assert "O(S^2)" in memory and "O(S)" in memory


def _select(S_q, S_k, B=1, H=1, H_kv=1, D=8, **kw):
    """`select_implementation` on abstract arrays: it only looks at shapes, so nothing
    of size `S_q * S_k` is ever allocated."""
    names = []

    def f(q, k, v):
        names.append(kernels.select_implementation(q, k, v, **kw))
        return q

    q = jax.ShapeDtypeStruct((B, S_q, H, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, S_k, H_kv, D), jnp.float32)
    jax.eval_shape(f, q, kv, kv)
    return names[0]


def test_select_implementation_by_score_size():
    limit = kernels.AUTO_XLA_MAX_SCORE_BYTES
    S_q = 1024
    S_k = limit // (4 * S_q)  # float32 score matrix of exactly <= limit bytes
    assert 4 * S_q * S_k <= limit < 4 * S_q * (S_k + 1)
    assert _select(8, 8) == "xla"
    assert _select(S_q, S_k) == "xla"
    assert _select(S_q, S_k + 1) == "blockwise"
    assert _select(S_q, S_k // 2 + 1, B=2) == "blockwise"  # batch and heads count too
    assert _select(S_q, S_k // 4 + 1, H=4, H_kv=2) == "blockwise"
    assert _select(S_q, S_k + 1, implementation="xla") == "xla"  # explicit choice wins
    assert _select(8, 8, implementation="blockwise") == "blockwise"
    assert _select(8, 8, implementation=kernels.Blockwise(block_q=16, block_kv=32)) == "blockwise"


def test_select_implementation_concrete_arrays():
    x = jnp.ones((1, 7, 2, 8), jnp.float32)
    assert kernels.select_implementation(x, x, x) == "xla"
    assert kernels.select_implementation(x, x, x, causal=True, implementation="blockwise") == "blockwise"


def test_auto_matches_oracle():
    case = CASES_BY_NAME["causal+segments+sinks+softcap+gqa"]
    arrays, static, res = run("auto", case)
    check_all(arrays, static, res, np.float32)


# -- core.py --------------------------------------------------------------------------------


def test_core_dot_product_attention():
    case = Case("core", S_q=33, S_k=77, H_kv=2, bias=(2, 4, 33, 77), mask=(2, 1, 1, 77))
    arrays, _ = case.inputs(seed=5)
    q, k, v = (jnp.asarray(arrays[n]) for n in ("q", "k", "v"))
    bias, mask = jnp.asarray(arrays["bias"]), jnp.asarray(arrays["mask"])
    for scale in (None, 1.0):
        ref = oracle.attention(arrays["q"], arrays["k"], arrays["v"], bias=arrays["bias"],
                               mask=arrays["mask"], scale=scale)
        out = core.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale)
        oracle.assert_close(out, ref.out, np.float32, f"dot_product_attention(scale={scale})")
    # Positional arguments in the documented order, and gradients.
    ref = oracle.attention(arrays["q"], arrays["k"], arrays["v"], bias=arrays["bias"],
                           dout=arrays["dout"])
    out, vjp = jax.vjp(lambda q, k, v, b: core.dot_product_attention(q, k, v, b), q, k, v, bias)
    oracle.assert_close(out, ref.out, np.float32, "dot_product_attention positional")
    for name, g in zip(("dq", "dk", "dv", "dbias"), vjp(jnp.asarray(arrays["dout"]))):
        oracle.assert_close(g, getattr(ref, name), np.float32, f"dot_product_attention {name}")


def test_core_local_attention():
    arrays, _ = Case("local", S_q=33, S_k=77, H_kv=1).inputs(seed=6)
    q, k, v = (jnp.asarray(arrays[n]) for n in ("q", "k", "v"))
    for scale in (None, 0.5):
        ref = oracle.attention(arrays["q"], arrays["k"], arrays["v"], scale=scale)
        oracle.assert_close(core.local_attention(q, k, v, scale=scale), ref.out, np.float32, "local_attention")
        oracle.assert_close(core.local_attention(q, k, v, scale), ref.out, np.float32, "local_attention")


def test_core_mesh():
    """`mesh=` runs the Megatron path (heads over "tp", batch over "dp") and gives the
    single-device numbers; a one-device mesh works too."""
    assert jax.device_count() == 8, "tests/conftest.py must force 8 host devices before JAX loads"
    case = Case("mesh", S_q=7, S_k=33, H_kv=2, bias=(2, 4, 7, 33), mask=(2, 1, 1, 33))
    arrays, _ = case.inputs(seed=7)
    q, k, v, bias, mask = (jnp.asarray(arrays[n]) for n in ("q", "k", "v", "bias", "mask"))
    ref = oracle.attention(arrays["q"], arrays["k"], arrays["v"], bias=arrays["bias"], mask=arrays["mask"])
    devices = np.array(jax.devices())
    for shape in ((2, 4), (1, 1)):
        mesh = jax.sharding.Mesh(devices[: np.prod(shape)].reshape(shape), ("dp", "tp"))
        out = core.dot_product_attention(q, k, v, bias=bias, mask=mask, mesh=mesh)
        oracle.assert_close(out, ref.out, np.float32, f"dot_product_attention(mesh={shape})")
    too_many = jax.sharding.Mesh(devices.reshape(1, 8), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"H must be a multiple.*H=4, tp=8"):
        core.dot_product_attention(q, k, v, mesh=too_many)


# -- window sizes at the edge of int32 ---------------------------------------------------


@pytest.mark.parametrize("window", [(None, 2**31 - 1), (2**31 - 1, 2**31 - 1), (4, 2**31 - 1)], ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_window_sides_up_to_int32_max(impl, window):
    """Window sides are validated as any non-negative int; one as large as the int32
    maximum must behave as (effectively) unbounded, not wrap around.

    Regression test: `q_pos + right` computed in int32 overflows for q_pos >= 1.
    """
    arrays, _ = Case("w", B=1, S_q=33, S_k=33, H=2, H_kv=2, D=8).inputs()
    q, k, v = (jnp.asarray(arrays[n]) for n in ("q", "k", "v"))
    ref = oracle.attention(arrays["q"], arrays["k"], arrays["v"], window=window)
    out = kernels.attention(q, k, v, window=window, implementation=impl)
    oracle.assert_close(out, ref.out, np.float32, f"window={window}")


@pytest.mark.parametrize("impl", IMPLS)
def test_window_side_beyond_int32(impl):
    """A window side the validation accepts but int32 positions cannot hold either works
    (as unbounded) or is rejected with a `ValueError` naming `window`, never an
    obscure overflow from inside the kernel."""
    arrays, _ = Case("w", B=1, S_q=7, S_k=7, H=2, H_kv=2, D=8).inputs()
    q, k, v = (jnp.asarray(arrays[n]) for n in ("q", "k", "v"))
    window = (3, 2**40)
    try:
        out = kernels.attention(q, k, v, window=window, implementation=impl)
    except ValueError as e:
        assert "window" in str(e)
    else:
        ref = oracle.attention(arrays["q"], arrays["k"], arrays["v"], window=window)
        oracle.assert_close(out, ref.out, np.float32, f"window={window}")
