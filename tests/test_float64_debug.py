"""The portable implementations take what `jax.nn.dot_product_attention` takes.

- float64: `"xla"` and `"blockwise"` serve float64 inputs with float64 statistics,
  forward, lse and gradients (with random cotangents on `out` and `lse`) within
  1e-12 of the float64 oracle; the vendor kernels refuse float64 by name.
- `jax.debug_infs` / `jax.debug_nans`: `attention` and its gradient, and
  `attention_fwd` wherever no row is empty, create no inf or NaN on `"xla"` and
  `"blockwise"`, over masked, padded (segment id -1, `kv_lengths`) and causal
  requests. `attention_fwd` with a row that sees nothing returns the documented
  `lse = -inf`, which is an inf: that one call raises under `jax.debug_infs`.

x64 is switched on only inside these tests (`jax.enable_x64(True)` as a context
manager), so it does not leak into other test files in the same worker.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
from vidax_eqx import kernels


PORTABLE = {"xla": "xla", "blockwise": kernels.Blockwise(block_q=8, block_kv=8)}
B, S_q, S_k, H, H_kv, D = 2, 13, 19, 4, 2, 8

# name: the options of one request (arrays built by `_options`).
REQUESTS = {
    "plain": {},
    "causal": {"causal": True},
    "mask": {"mask": True},
    "segment_padding": {"segments": True},
    "kv_lengths": {"kv_lengths": [0, 11]},
    "everything": {"bias": True, "sinks": True, "causal": True, "window": (6, 2),
                   "logits_soft_cap": 3.0, "kv_lengths": [19, 9], "segments": True},
}


def _options(name: str, rng, float_dtype):
    opts = dict(REQUESTS[name])
    kw = {}
    if opts.pop("mask", False):
        kw["mask"] = rng.random((B, 1, S_q, S_k)) < 0.6
    if opts.pop("segments", False):
        seg_q = np.array([[0] * 10 + [-1] * 3, [1] * 7 + [0] * 6], np.int32)
        seg_kv = np.array([[0] * 15 + [-1] * 4, [0] * 9 + [1] * 10], np.int32)
        kw["segment_ids"] = kernels.SegmentIds(jax.device_put(seg_q), jax.device_put(seg_kv))
    if opts.pop("bias", False):
        kw["bias"] = jax.device_put(harness.normal(rng, (1, H, S_q, S_k), float_dtype))
    if opts.pop("sinks", False):
        kw["sinks"] = jax.device_put(harness.normal(rng, (H,), float_dtype))
    if "kv_lengths" in opts:
        kw["kv_lengths"] = jax.device_put(np.asarray(opts.pop("kv_lengths"), np.int32))
    return {**kw, **opts}


def _oracle_kwargs(kw):
    out = {n: (np.asarray(x) if isinstance(x, jax.Array) else x) for n, x in kw.items()}
    if "segment_ids" in out:
        out["segment_ids"] = tuple(np.asarray(s) for s in kw["segment_ids"])
    return out


def _inputs(rng, dtype):
    shapes = {"q": (B, S_q, H, D), "k": (B, S_k, H_kv, D), "v": (B, S_k, H_kv, D),
              "dout": (B, S_q, H, D), "dlse": (B, H, S_q)}
    return {n: jax.device_put(harness.normal(rng, s, dtype)) for n, s in shapes.items()}


def _fwd_vjp(impl, a, kw):
    diff = {n: x for n, x in kw.items() if n in ("bias", "sinks")}
    rest = {n: x for n, x in kw.items() if n not in diff}

    def f(q, k, v, d):
        return kernels.attention_fwd(q, k, v, **d, **rest, implementation=impl)

    (out, lse), pull = jax.vjp(f, a["q"], a["k"], a["v"], diff)
    return out, lse, pull((a["dout"], a["dlse"]))


@pytest.mark.parametrize("request_name", ["plain", "everything"])
@pytest.mark.parametrize("impl", list(PORTABLE))
def test_float64_matches_the_oracle(impl, request_name):
    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        a = _inputs(rng, np.float64)
        kw = _options(request_name, rng, np.float64)
        out, lse, (dq, dk, dv, d) = _fwd_vjp(PORTABLE[impl], a, kw)
        assert out.dtype == dq.dtype == dk.dtype == dv.dtype == jnp.float64
        assert lse.dtype == jnp.float64
        ref = oracle.attention(a["q"], a["k"], a["v"], dout=a["dout"], dlse=a["dlse"], **_oracle_kwargs(kw))
        for name, got, want in [("out", out, ref.out), ("lse", lse, ref.lse), ("dq", dq, ref.dq),
                                ("dk", dk, ref.dk), ("dv", dv, ref.dv)]:
            oracle.assert_close(got, want, np.float64, f"{impl}/{request_name} {name}")
        if "bias" in kw:
            oracle.assert_close(d["bias"], ref.dbias, np.float64, "dbias")
            oracle.assert_close(d["sinks"], ref.dsinks, np.float64, "dsinks")
        # attention_bwd from the public (out, lse) agrees with the VJP.
        grads = kernels.attention_bwd(a["q"], a["k"], a["v"], out, lse, a["dout"], dlse=a["dlse"],
                                      **kw, implementation=PORTABLE[impl])
        for got, want in zip(grads[:3], (dq, dk, dv)):
            oracle.assert_close(got, want, np.float64, "attention_bwd")


def test_x64_does_not_leak():
    assert jnp.zeros(1).dtype == jnp.float32


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu", "cudnn"])
def test_vendor_kernels_refuse_float64(impl):
    with jax.enable_x64(True):
        q = jnp.ones((1, 16, 2, 8), jnp.float64)
        chosen = {"pallas_tpu": kernels.PallasTpu(interpret=True),
                  "pallas_gpu": kernels.PallasGpu(interpret=True), "cudnn": "cudnn"}[impl]
        with pytest.raises(NotImplementedError, match=rf"'{impl}' does not support:.*dtype float64"):
            kernels.attention(q, q, q, implementation=chosen)
        # "auto" falls back to a portable implementation on every platform.
        for platform in ("cpu", "gpu", "tpu"):
            assert kernels.select_implementation(q, q, q, platform=platform) in ("xla", "blockwise")


@pytest.mark.parametrize("request_name", list(REQUESTS))
@pytest.mark.parametrize("impl", list(PORTABLE))
def test_clean_under_debug_infs_and_nans(impl, request_name):
    rng = np.random.default_rng(5)
    a = _inputs(rng, np.float32)
    kw = _options(request_name, rng, np.float32)
    ref = oracle.attention(a["q"], a["k"], a["v"], dout=a["dout"], **_oracle_kwargs(kw))
    empty_rows = bool(np.isneginf(ref.lse).any())
    diff = {n: x for n, x in kw.items() if n in ("bias", "sinks")}
    rest = {n: x for n, x in kw.items() if n not in diff}
    loss = lambda q, k, v, d: jnp.sum(
        kernels.attention(q, k, v, **d, **rest, implementation=PORTABLE[impl]) * a["dout"]
    )
    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    with jax.debug_infs(True), jax.debug_nans(True):
        # eager, op by op: no primitive anywhere produces an inf or NaN
        out = kernels.attention(a["q"], a["k"], a["v"], **kw, implementation=PORTABLE[impl])
        dq, dk, dv, d = grad(a["q"], a["k"], a["v"], diff)
        if empty_rows:
            # The documented -inf lse of a row that sees nothing is an inf.
            with pytest.raises(FloatingPointError):
                kernels.attention_fwd(a["q"], a["k"], a["v"], **kw, implementation=PORTABLE[impl])
        else:
            kernels.attention_fwd(a["q"], a["k"], a["v"], **kw, implementation=PORTABLE[impl])
    oracle.assert_close(out, ref.out, np.float32, "out")
    for name, got, want in [("dq", dq, ref.dq), ("dk", dk, ref.dk), ("dv", dv, ref.dv)]:
        oracle.assert_close(got, want, np.float32, name)
    # Both the empty-row branch and the clean branch above are exercised.
    if request_name in ("segment_padding", "kv_lengths"):
        assert empty_rows
    if request_name in ("plain", "causal", "everything"):  # "everything" has sinks
        assert not empty_rows
