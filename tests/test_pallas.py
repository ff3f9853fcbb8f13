"""The accelerator implementations, tested on CPU.

`"pallas_tpu"` and `"pallas_gpu"` run in Pallas interpret mode
(`PallasTpu(interpret=True)`, `PallasGpu(interpret=True)`) through the case
matrix of `cases.py` (as `test_kernels` runs it) against the float64 oracle: forward, lse, gradients
(with and without `dlse`), padding of odd lengths, rows that see nothing. Every
case an implementation cannot serve must raise `NotImplementedError` naming the
feature; which features those are is written out here from the kernels'
documented limits, independently of the capability flags. `"cudnn"` needs a GPU:
here its dispatch and errors are checked. Then `"auto"` per platform, and
`core.dot_product_attention`'s dispatch rules.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

import harness
import oracle
from cases import CASES, CASES_BY_NAME, Case, check_all, empty_row_inputs, kernel_kwargs, reference, run
from vidax_eqx import core, kernels, parallel
from vidax_eqx.kernels import _cudnn, _registry
from vidax_eqx.kernels._args import normalize


TPU = kernels.PallasTpu(interpret=True, block_q=128, block_kv=128)
# 16-token tiles: the short test sequences span several tiles, with padding.
GPU = kernels.PallasGpu(interpret=True, block_q=16, block_k=16, block_bwd=16)
PALLAS = [pytest.param(TPU, id="pallas_tpu"), pytest.param(GPU, id="pallas_gpu")]


def _expected_unsupported(impl, case: Case) -> list[str]:
    """What `impl` must refuse in `case`, from the kernels' documented limits."""
    missing = []
    if case.positions is not None:
        missing.append("custom positions")
    if impl is TPU:
        masked = case.bias is not None or case.mask is not None
        if masked and case.window is not None:
            missing.append("sliding window together with")
        if masked and case.soft_cap is not None:
            missing.append("logit soft cap together with")
    else:
        if case.bias is not None:
            missing.append("additive bias")
        if case.mask is not None:
            missing.append("boolean mask")
        if case.window is not None:
            missing.append("sliding window")
        if case.soft_cap is not None:
            missing.append("logit soft cap")
        if case.segments == "split":
            missing.append("separate q / kv segment ids")
        if case.S_q != case.S_k and case.S_k % 16:
            missing.append("not a multiple of 16")
        if case.causal and case.S_q > case.S_k:
            missing.append("causal with S_q > S_k")
    return missing


def _raises_naming(impl, case: Case, missing: list[str]):
    arrays, static = case.inputs()
    kw = kernel_kwargs(arrays, static, case.segments)
    for n in ("bias", "sinks"):
        if n in arrays:
            kw[n] = jnp.asarray(arrays[n])
    q, k, v = (jnp.asarray(arrays[n]) for n in "qkv")
    with pytest.raises(NotImplementedError) as err:
        kernels.attention(q, k, v, implementation=impl, **kw)
    message = str(err.value)
    assert impl.name in message
    for feature in missing:
        assert feature in message, (feature, message)


MATRIX = [pytest.param(impl, case, id=f"{impl_id}-{case.name}")
          for impl, impl_id in ((TPU, "pallas_tpu"), (GPU, "pallas_gpu")) for case in CASES]


@pytest.mark.parametrize("impl, case", MATRIX)
def test_matches_oracle_or_refuses(impl, case):
    missing = _expected_unsupported(impl, case)
    if missing:
        _raises_naming(impl, case, missing)
        return
    arrays, static, res = run(impl, case)
    check_all(arrays, static, res, np.float32)


DLSE_CASES = [
    pytest.param(TPU, CASES_BY_NAME[n], id=f"pallas_tpu-{n}")
    for n in ("gqa", "causal_q_gt_k", "sinks", "causal+segments+sinks+softcap+gqa", "bias_qk", "mask_1Hq1")
] + [
    pytest.param(GPU, case, id=f"pallas_gpu-{case.name}")
    for case in (
        CASES_BY_NAME["gqa"],
        Case("gpu_causal_segments_sinks", S_q=77, S_k=77, H_kv=2, causal=True, segments="shared", sinks=True),
        Case("gpu_cross_q_gt_k", S_q=100, S_k=48, H_kv=1, sinks=True),
        Case("gpu_cross_q_lt_k_causal", S_q=20, S_k=64, H_kv=2, causal=True),
    )
]


@pytest.mark.parametrize("impl, case", DLSE_CASES)
def test_lse_gradient_matches_oracle(impl, case):
    """Gradients through both outputs of `attention_fwd`: the kernels' backward runs
    from `delta - dlse`, the path ring attention takes."""
    assert not _expected_unsupported(impl, case)
    arrays, static, res = run(impl, case, seed=4, dlse=True)
    check_all(arrays, static, res, np.float32, dlse=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("impl", PALLAS)
def test_low_precision(impl, dtype):
    case = dataclasses.replace(CASES_BY_NAME["causal+segments+sinks+softcap+gqa"], soft_cap=None)
    arrays, static, res = run(impl, case, dtype=dtype, seed=1)
    check_all(arrays, static, res, dtype)


@pytest.mark.parametrize(
    "case",
    [
        # Several 128-token tiles with ragged ends, on both TPU kernels.
        Case("tpu_tiles_splash", B=1, S_q=300, S_k=260, H=4, H_kv=2, D=16, causal=True, window=(90, 0),
             segments="split", sinks=True, soft_cap=5.0),
        Case("tpu_tiles_flash", B=1, S_q=260, S_k=300, H=2, H_kv=1, D=16, causal=True,
             bias=(1, 2, 260, 300), mask=(1, 1, 260, 300), segments="split"),
    ],
    ids=str,
)
def test_pallas_tpu_multiple_tiles(case):
    arrays, static, res = run(TPU, case, dlse=True)
    check_all(arrays, static, res, np.float32, dlse=True)


# A configuration with every knob of the table (separate backward tiles, key sub-blocks,
# the fused backward): 128-token tiles so that these short sequences span several.
_SPLIT = kernels.SplashBlocks(128, 256, 128, block_q_dkv=256, block_kv_dkv=256, block_kv_dkv_compute=128,
                              block_q_dq=128, block_kv_dq=256)
_FUSED = kernels.SplashBlocks(256, 256, 128, block_q_dkv=128, block_kv_dkv=256, block_kv_dkv_compute=128,
                              fused_bwd=True)


@pytest.mark.parametrize("blocks", [_SPLIT, _FUSED], ids=["split", "fused"])
@pytest.mark.parametrize(
    "case",
    [
        # Full attention of 16-bit inputs, keys padded: the padding keys are copies of the
        # last key, taken out of the result (`_remove_copies`); the last key dominates
        # some rows (its share of the copies' correction is largest there).
        Case("tpu_copied_padding", B=1, S_q=300, S_k=390, H=4, H_kv=2, D=16, sinks=True, soft_cap=30.0),
        Case("tpu_causal_window", B=1, S_q=390, S_k=390, H=2, H_kv=2, D=16, causal=True, window=(200, 0)),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
def test_pallas_tpu_configurations(blocks, case, dtype):
    """The table's kinds of configuration against the oracle, forward and backward."""
    impl = kernels.PallasTpu(blocks=blocks, interpret=True)
    arrays, static = case.inputs(dtype, 7)
    if case.name == "tpu_copied_padding":
        # The last key aligned with the queries' mean: it takes most of the weight of
        # many rows, where the correction of the copies is largest.
        q, k = np.asarray(arrays["q"], np.float32), np.array(arrays["k"], np.float32)
        mean = q.mean(axis=1).reshape(q.shape[0], case.H_kv, -1, q.shape[-1]).mean(axis=2)
        k[:, -1] = 3.0 * mean / np.linalg.norm(mean, axis=-1, keepdims=True) * np.sqrt(q.shape[-1])
        arrays = dict(arrays, k=k.astype(np.asarray(arrays["k"]).dtype))
    arrays, static, res = run(impl, case, dtype=dtype, arrays=arrays, static=static, dlse=True)
    check_all(arrays, static, res, dtype, dlse=True)


def test_copied_padding_is_taken_only_where_exact():
    """Keys padded with copies of the last key only for full attention of 16-bit inputs
    (float32, masks, segment ids and key lengths hide the padding with the mask)."""
    from vidax_eqx.kernels.pallas_tpu._implementation import _copied_padding

    q16 = jnp.zeros((1, 300, 2, 16), jnp.bfloat16)
    q32 = q16.astype(jnp.float32)
    assert _copied_padding(*normalize(q16, q16, q16))
    assert not _copied_padding(*normalize(q32, q32, q32))
    assert not _copied_padding(*normalize(q16, q16, q16, causal=True))
    assert not _copied_padding(*normalize(q16, q16, q16, window=(8, 8)))
    assert not _copied_padding(*normalize(q16, q16, q16, segment_ids=jnp.zeros((1, 300), jnp.int32)))
    assert not _copied_padding(*normalize(q16, q16, q16, kv_lengths=jnp.array([200], jnp.int32)))


def _pallas_outputs(jaxpr) -> list[list[str]]:
    """The output types of every `pallas_call` in `jaxpr` (nested jaxprs included)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append([str(v.aval) for v in eqn.outvars])
        for sub in jaxprs_in_params(eqn.params):
            found += _pallas_outputs(sub)
    return found


@pytest.mark.parametrize("S, causal, with_lse", [(256, False, False), (256, True, False), (200, True, False),
                                                 (200, False, True)])
def test_forward_alone_writes_no_lse(S, causal, with_lse):
    """`attention` outside a gradient runs splash without its lse residual (float32
    `(H, S, 128)` lanes) in full and causal attention, except full attention at a
    padded length, whose copied keys the lse takes out; its output is `attention_fwd`'s
    bit for bit, and its gradients are those of `attention_fwd`'s output."""
    H = 2
    q, k, v = (jax.random.normal(key, (1, S, H, 128), jnp.bfloat16) for key in jax.random.split(jax.random.key(S), 3))
    impl = kernels.PallasTpu(interpret=True)
    alone = lambda q, k, v: kernels.attention(q, k, v, causal=causal, implementation=impl)  # noqa: E731
    both = lambda q, k, v: kernels.attention_fwd(q, k, v, causal=causal, implementation=impl)[0]  # noqa: E731
    lse_lanes = f"float32[{H},256,128]"
    calls = _pallas_outputs(jax.make_jaxpr(alone)(q, k, v).jaxpr)
    assert calls and all((lse_lanes in outs) == with_lse for outs in calls), calls
    assert all(lse_lanes in outs for outs in _pallas_outputs(jax.make_jaxpr(both)(q, k, v).jaxpr))
    np.testing.assert_array_equal(np.asarray(alone(q, k, v), np.float32), np.asarray(both(q, k, v), np.float32))
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)  # noqa: E731
    for got, want in zip(jax.grad(loss(alone), (0, 1, 2))(q, k, v), jax.grad(loss(both), (0, 1, 2))(q, k, v)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_rows_may_be_empty_only_where_a_feature_can_hide_every_key():
    """The splash forward selects the rows that see nothing (a pass over the output) only
    where a feature can hide every key of a row; a window that does still gives them 0
    and lse -inf."""
    from vidax_eqx.kernels._adapt import rows_may_be_empty

    q, k = jnp.zeros((1, 100, 2, 16)), jnp.zeros((1, 7, 2, 16))
    assert not rows_may_be_empty(*normalize(q, q, q))
    assert not rows_may_be_empty(*normalize(q, k, k, causal=True))  # key 0: seen by every query
    hiding = [dict(window=(0, 0)), dict(segment_ids=jnp.zeros((1, 100), jnp.int32)),
              dict(kv_lengths=jnp.array([50], jnp.int32)), dict(bias=jnp.zeros((100, 100))),
              dict(mask=jnp.ones((100, 100), bool)),
              dict(mask=kernels.SlidingTileMask((4, 5, 5), (1, 5, 5), (3, 1, 1)))]
    for kw in hiding:
        assert rows_may_be_empty(*normalize(q, q, q, **kw)), kw
    assert rows_may_be_empty(*normalize(q, q, q, q_positions=jnp.arange(100), kv_positions=jnp.arange(100)))
    # Queries 7.. of a (0, 0) window over 7 keys see nothing.
    rng = np.random.default_rng(0)
    qa, ka = (jnp.asarray(harness.normal(rng, s)) for s in ((1, 100, 2, 16), (1, 7, 2, 16)))
    out, lse = kernels.attention_fwd(qa, ka, ka, window=(0, 0), implementation=TPU)
    assert np.all(np.asarray(out)[:, 7:] == 0.0) and np.all(np.asarray(lse)[:, :, 7:] == -np.inf)
    assert np.all(np.isfinite(np.asarray(lse)[:, :, :7]))


@pytest.mark.parametrize("dtype, want", [(jnp.bfloat16, "DEFAULT"), (jnp.float32, "HIGHEST")])
def test_kernel_precision_under_highest(dtype, want):
    """A caller's `default_matmul_precision("highest")` reaches the kernels' matmuls of
    float32 inputs, not those of 16-bit ones (Mosaic refuses a float32 contract precision
    on 16-bit operands: seen compiling for a TPU v5e, every pallas_tpu kernel)."""
    import re

    q = jnp.zeros((1, 256, 2, 128), dtype)
    with jax.default_matmul_precision("highest"):
        text = str(jax.make_jaxpr(jax.grad(
            lambda q: kernels.attention(q, q, q, implementation=TPU).astype(jnp.float32).sum()))(q))
    assert set(re.findall(r"precision=\(Precision\.(\w+)", text)) == {want}


def test_splash_blocks_choice():
    """The table's row for a problem, fitted: tiles no longer than the sequence, halved
    where padding to them would cost more than their speed gains, the fused backward
    switched off above its memory budget; explicit tiles and interpret mode as given."""
    from vidax_eqx.kernels.pallas_tpu._tuning import choose_blocks, TABLES

    kw = dict(batch=1, heads=12, head_dim=128, itemsize=2, kind="TPU v5 lite")
    big = choose_blocks(mask="full", S_q=32760, S_k=32760, **kw)
    assert big.padded(32760, 32760) == (32768, 32768)
    assert big == TABLES["TPU v5 lite"].lookup("full", 32760).fit(32760, 32760)
    short = choose_blocks(mask="full", S_q=300, S_k=300, **kw)
    assert max(short.q_tiles + short.kv_tiles) == 384 or short.padded(300, 300)[0] <= 512
    odd = choose_blocks(mask="causal", S_q=33000, S_k=33000, **kw)
    assert odd.padded(33000, 33000)[0] <= 33792  # not 34816 (2048-token tiles)
    if big.fused_bwd:
        assert not choose_blocks(mask="full", S_q=32760, S_k=32760, fused_bwd_max_bytes=0, **kw).fused_bwd
    # a frame-block causal mask has its own row (a window: the local one's)
    grid = (21, 30, 52)
    q_bc = jax.ShapeDtypeStruct((1, 32760, 12, 128), jnp.bfloat16)
    for window, row in ((None, "block_causal"), (6, "local")):
        bc = kernels.BlockCausalMask(grid, 1, window=window)
        chosen = kernels.splash_blocks(q_bc, q_bc, q_bc, mask=bc, implementation=kernels.PallasTpu())
        assert chosen == choose_blocks(mask=row, S_q=32760, S_k=32760, **kw)
    q = jnp.zeros((1, 1000, 2, 128), jnp.bfloat16)
    assert kernels.splash_blocks(q, q, q, implementation=kernels.PallasTpu(block_q=256, block_kv=512)) == \
        kernels.SplashBlocks(256, 512)
    assert kernels.splash_blocks(q, q, q, implementation=kernels.PallasTpu(interpret=True)) == kernels.SplashBlocks(512, 512)
    assert kernels.splash_blocks(q, q, q, bias=jnp.zeros((1, 1, 1000, 1000))) is None
    with pytest.raises(ValueError, match="block_kv_compute` must divide"):
        kernels.SplashBlocks(512, 512, 384)
    with pytest.raises(ValueError, match="not both"):
        kernels.PallasTpu(block_q=256, blocks=kernels.SplashBlocks())


def test_pallas_gpu_default_tiles():
    """The default 128-token (power-of-two) tiles over a ragged length, forward and backward."""
    case = Case("gpu_default_tiles", B=1, S_q=300, S_k=300, H=2, H_kv=1, D=16, causal=True,
                segments="shared", sinks=True)
    arrays, static, res = run(kernels.PallasGpu(interpret=True), case, dlse=True)
    check_all(arrays, static, res, np.float32, dlse=True)


@pytest.mark.parametrize("kind", ["segments", "mask"])
def test_pallas_tpu_rows_that_see_nothing(kind):
    """Rows with no visible key give exactly 0 and lse -inf, and no NaN in gradients
    (the kernels themselves would average over masked keys)."""
    case, arrays, static = empty_row_inputs(kind)
    ref = reference(arrays, static)
    empty = ~np.isfinite(ref.lse)
    assert empty.any()
    _, _, res = run(TPU, case, arrays=arrays, static=static, dlse=True)
    assert np.all(res["out"][np.transpose(empty, (0, 2, 1))] == 0.0)
    assert np.all(res["lse"][empty] == -np.inf)
    check_all(arrays, static, res, np.float32, dlse=True)


def test_pallas_gpu_rows_that_see_nothing():
    """Shared segment ids with padding (-1) and ids absent elsewhere in the row's causal past."""
    case = Case("gpu_empty", B=2, S_q=50, S_k=50, H=2, H_kv=1, D=16, causal=True, segments="shared",
                sinks=True)
    arrays, static = case.inputs(seed=5)
    seg = np.random.default_rng(5).integers(0, 3, (2, 50)).astype(np.int32)
    seg[0, 10:20] = -1
    seg[1, 0] = 9  # sees only itself
    seg[1, 30:] = -1
    arrays.update(seg_q=seg, seg_kv=seg)
    _, _, res = run(GPU, case, arrays=arrays, static=static, dlse=True)
    pad = np.broadcast_to((seg < 0)[:, :, None], res["out"].shape[:3])
    assert np.all(res["out"][pad] == 0.0)
    check_all(arrays, static, res, np.float32, dlse=True)


@pytest.mark.parametrize("impl", PALLAS)
def test_attention_bwd_direct_with_external_lse(impl):
    """`attention_bwd` with an `lse` that is not the kernel's own (as a ring step gets
    it): probabilities are `exp(s - lse)`, whatever produced `lse`."""
    case = CASES_BY_NAME["causal+segments+sinks+softcap+gqa"]
    if impl is GPU:
        case = dataclasses.replace(case, soft_cap=None)
    arrays, static = case.inputs(seed=6)
    kw = kernel_kwargs(arrays, static, case.segments)
    q, k, v, dout = (jnp.asarray(arrays[n]) for n in ("q", "k", "v", "dout"))
    sinks = jnp.asarray(arrays["sinks"])
    out, lse = kernels.attention_fwd(q, k, v, sinks=sinks, implementation="xla", **kw)
    shift = 0.25  # a larger normalizer: every probability scaled by exp(-shift)
    args = (q, k, v, out, lse + shift, dout)
    want = kernels.attention_bwd(*args, sinks=sinks, implementation="xla", dlse=jnp.asarray(arrays["dlse"]), **kw)
    got = kernels.attention_bwd(*args, sinks=sinks, implementation=impl, dlse=jnp.asarray(arrays["dlse"]), **kw)
    for g, w in zip(got, want):
        if w is not None:
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


# -- cuDNN and dispatch -------------------------------------------------------------------


def _request(platform: str, dtype=jnp.bfloat16, S=64, needs_lse=False, **kw):
    q = jnp.zeros((1, S, 4, 64), dtype)
    ops, opts = normalize(q, q, q, **kw)
    return dataclasses.replace(kernels.Request.of(ops, opts, needs_lse=needs_lse), platform=platform)


def test_cudnn_needs_a_gpu_and_half_precision():
    q = jnp.ones((1, 8, 2, 16), jnp.float32)
    with pytest.raises(NotImplementedError, match=r"'cudnn'.*platform 'cpu'.*dtype float32"):
        kernels.attention(q, q, q, implementation="cudnn")


@pytest.fixture
def gpu_host(monkeypatch):
    """Dispatch as on a GPU host (where jax.nn's cuDNN path can be traced)."""
    monkeypatch.setattr(_cudnn, "_gpu_host", lambda: True)


def test_cudnn_is_not_traced_without_a_gpu():
    """Off a GPU host, a GPU lowering cannot trace jax.nn's cuDNN path (it reads the
    cuDNN version when traced): "auto" takes the Triton kernel there instead."""
    req = _request("gpu")
    assert any("from a host without one" in r for r in kernels.implementations()["cudnn"].unsupported(req))
    assert _registry.resolve("auto", req).name == "pallas_gpu"
    q = jax.ShapeDtypeStruct((1, 64, 4, 64), jnp.bfloat16)
    assert kernels.select_implementation(q, q, q, platform="cuda") == "pallas_gpu"


def test_cudnn_never_serves_the_lse_contract(gpu_host):
    req = _request("gpu", needs_lse=True)
    missing = kernels.implementations()["cudnn"].unsupported(req)
    assert missing == ["a float32 log-sum-exp with gradient (attention_fwd / attention_bwd / ring)"]
    with pytest.raises(NotImplementedError, match="float32 log-sum-exp"):
        kernels.attention_fwd(*(jnp.ones((1, 8, 2, 16), jnp.bfloat16),) * 3, implementation="cudnn")


@pytest.mark.parametrize(
    "platform, dtype, kw, needs_lse, want",
    [
        ("gpu", jnp.bfloat16, {}, False, "cudnn"),
        ("gpu", jnp.bfloat16, {"causal": True}, False, "cudnn"),
        ("gpu", jnp.bfloat16, {}, True, "pallas_gpu"),  # attention_fwd / ring: f32 lse needed
        ("gpu", jnp.float32, {}, False, "pallas_gpu"),  # cuDNN: half precision only
        ("gpu", jnp.bfloat16, {"window": (8, 8)}, False, "xla"),  # neither vendor kernel has it
        ("gpu", jnp.bfloat16, {"sinks": jnp.zeros(4)}, False, "pallas_gpu"),
        ("tpu", jnp.bfloat16, {"window": (8, 0), "logits_soft_cap": 30.0}, True, "pallas_tpu"),
        ("tpu", jnp.float32, {"bias": jnp.zeros((64, 64))}, False, "pallas_tpu"),
        ("tpu", jnp.float32, {"q_positions": jnp.arange(64)}, False, "xla"),  # positions: portable
        ("cpu", jnp.float32, {}, False, "xla"),
    ],
)
def test_auto_per_platform(platform, dtype, kw, needs_lse, want, gpu_host):
    req = _request(platform, dtype, needs_lse=needs_lse, **kw)
    assert _registry.resolve("auto", req).name == want
    assert _registry.resolve("portable", req).name in ("xla", "blockwise")


def test_auto_falls_back_to_blockwise_for_long_sequences_without_a_vendor_kernel():
    req = _request("gpu", jnp.float32, S=4096, window=(128, 128))
    assert _registry.resolve("auto", req).name == "blockwise"


def test_implementation_report_explains_every_fallback():
    q = jnp.ones((1, 40, 4, 16), jnp.float32)
    report = kernels.implementation_report(q, q, q, q_positions=jnp.arange(40))
    assert list(report)[:2] == ["xla", "blockwise"]  # the CPU order
    assert report["xla"] == [] and report["blockwise"] == []
    assert "custom positions" in report["pallas_tpu"] and "platform 'cpu' (serves tpu)" in report["pallas_tpu"]
    assert any("dtype float32" in r for r in report["cudnn"])
    assert kernels.select_implementation(q, q, q) == "xla"
    assert kernels.select_implementation(q, q, q, needs_lse=True) == "xla"


@pytest.mark.parametrize(
    "impl, kwargs, match",
    [
        (kernels.PallasTpu, {"block_q": 100}, "multiple of 128"),
        (kernels.PallasGpu, {"block_k": 24}, "power of two"),
        (kernels.PallasGpu, {"block_bwd": 8}, "power of two >= 16"),
    ],
)
def test_bad_block_sizes(impl, kwargs, match):
    with pytest.raises(ValueError, match=match):
        impl(**kwargs)


def test_default_instances_need_their_platform():
    q = jnp.ones((1, 8, 2, 16), jnp.float32)
    for name, platform in (("pallas_tpu", "tpu"), ("pallas_gpu", "gpu")):
        with pytest.raises(NotImplementedError, match=f"platform 'cpu' \\(serves {platform}\\)"):
            kernels.attention(q, q, q, implementation=name)


# -- ring attention on the vendor kernels --------------------------------------------------


@pytest.mark.parametrize(
    "impl, layout, causal",
    [
        pytest.param(TPU, "zigzag", True, id="pallas_tpu-zigzag-causal"),
        pytest.param(TPU, "contiguous", False, id="pallas_tpu-contiguous-full"),
        # The ring passes each step its own q / kv segment ids: not for the Triton kernel.
        pytest.param(GPU, "contiguous", True, id="pallas_gpu-contiguous-causal"),
    ],
)
def test_ring_attention_runs_on_the_kernels(impl, layout, causal):
    """Every step of a causal (or full) ring is position-free, so the explicitly named
    kernel serves it: forward merge and backward ring run on its `(out, lse)` and
    `attention_bwd`, with sinks (and segment ids where the kernel takes them)."""
    segments = impl is TPU
    # JAX's HLO interpreter for GPU kernels (interpret mode only) trips over varying
    # axes while lowering inside shard_map(check_vma=True): test it with the check off.
    a = harness.attention_inputs(2, 64, 4, 16, H_kv=2, segments=segments, sinks=True, seed=7)
    _check_ring(impl, a, layout=layout, causal=causal, segments=segments, sinks=True,
                check_vma=impl is TPU)


def _ring(impl, a, *, layout="contiguous", causal=False, window=None, segments=False,
          sinks=False, check_vma=True):
    """`ring_attention` over 4 devices on the global arrays `a`: global-order results."""
    def attend(q, k, v, seg, s):
        return parallel.ring_attention(q, k, v, ring_axis="sp", causal=causal, window=window,
                                       segment_ids=seg, sinks=s, layout=layout,
                                       implementation=impl)

    seg = "one" if segments else None
    fn = harness.sequence_vjp(attend, harness.mesh(sp=4), "sp", segments=seg, sinks=sinks,
                              check_vma=check_vma)
    return harness.run_sequence(fn, a, zigzag_size=4 if layout == "zigzag" else 0,
                                segments=seg, sinks=sinks)


def _check_ring(impl, a, *, causal=False, window=None, segments=False, sinks=False, **kw):
    got = _ring(impl, a, causal=causal, window=window, segments=segments, sinks=sinks, **kw)
    ref = oracle.attention(a["q"], a["k"], a["v"], segment_ids=a["seg"] if segments else None,
                           sinks=a["sinks"] if sinks else None, causal=causal, window=window,
                           dout=a["dout"])
    harness.assert_matches(got, ref, np.float32, harness.ATTENTION_NAMES + (("dsinks",) if sinks else ()))


def test_ring_with_a_window_needs_positions():
    """A window makes some steps position-dependent: a kernel without positions
    is refused by name, and "auto" takes a portable one."""
    with pytest.raises(NotImplementedError, match="custom positions"):
        _ring(TPU, harness.attention_inputs(2, 64, 4, 8), causal=True, window=(5, 0))
    _check_ring("auto", harness.attention_inputs(2, 64, 4, 8, seed=8), causal=True, window=(5, 0))


# -- core.dot_product_attention: the documented dispatch rules ------------------------------


@pytest.mark.parametrize(
    "devices, with_mask, with_bias, want",
    [
        (1, False, False, "auto"),  # flash (the platform's fastest) without a boolean mask
        (1, False, True, "auto"),
        (1, True, False, "portable"),  # a boolean mask: the portable path
        (8, False, False, "portable"),  # several devices, no mesh: what XLA partitions
        (8, False, True, "portable"),  # ... bias included
    ],
)
def test_core_dot_product_attention_dispatch(monkeypatch, devices, with_mask, with_bias, want):
    seen = []

    def spy(*args, implementation, **kwargs):
        seen.append(implementation)
        return kernels.attention(*args, implementation=implementation, **kwargs)

    monkeypatch.setattr(core.attention, "_attention", spy)  # (the kernels' entry, in core.attention)
    monkeypatch.setattr(jax, "device_count", lambda *a: devices)
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 24, 2, 8)), jnp.float32)
    mask = jnp.tril(jnp.ones((24, 24), bool)) if with_mask else None
    bias = jnp.ones((24, 24)) if with_bias else None
    out = core.dot_product_attention(q, q, q, bias=bias, mask=mask)
    assert seen == [want]
    ref = oracle.attention(*(np.asarray(q),) * 3, mask=None if mask is None else np.asarray(mask),
                           bias=None if bias is None else np.asarray(bias))
    oracle.assert_close(out, ref.out, np.float32, "dot_product_attention")
    assert kernels.select_implementation(q, q, q, bias=bias, mask=mask, implementation=want) == "xla"


def test_core_dot_product_attention_with_mesh_takes_the_megatron_path(monkeypatch):
    calls = []
    original = core.attention.tensor_parallel_attention
    monkeypatch.setattr(core.attention, "tensor_parallel_attention",
                        lambda *a, **kw: calls.append(kw) or original(*a, **kw))
    q = jnp.asarray(np.random.default_rng(1).standard_normal((2, 24, 4, 8)), jnp.float32)
    bias = jnp.asarray(np.random.default_rng(2).standard_normal((2, 4, 24, 24)), jnp.float32)
    out = core.dot_product_attention(q, q, q, bias=bias, mesh=harness.mesh(dp=2, tp=4))
    assert len(calls) == 1 and calls[0]["bias"] is bias
    ref = oracle.attention(*(np.asarray(q),) * 3, bias=np.asarray(bias))
    oracle.assert_close(out, ref.out, np.float32, "dot_product_attention(mesh=)")
