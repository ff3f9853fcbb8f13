"""int8 attention (`kernels.attention(..., quantize=)`): the XLA reference and the Pallas
TPU kernel (interpret mode; compiled by Mosaic on a TPU in the device test mode) against
a float64 oracle of the scheme written here, and
against float64 attention (the error targets: cosine >= 0.999, relative L2 <= 2e-2, on
random keys and on keys with a large per-channel offset); the lse; the gradient (the
float attention's at the int8 forward); masks on the reference; the models' option; the
refusals."""

import harness

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vidax_eqx import kernels, models

F64 = np.float64
BLOCK = 128  # the scheme's key block in these tests (the kernel's int8_blocks[1])
PALLAS = kernels.PallasTpu(interpret=True, int8_blocks=(64, BLOCK))


def _inputs(offset: float, *, B=1, S=300, H=4, K=2, D=64, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, S, H, D)).astype(np.float32)
    k = rng.standard_normal((B, S, K, D)).astype(np.float32)
    k += offset * rng.standard_normal((1, 1, K, D)).astype(np.float32)  # a per-channel offset
    v = rng.standard_normal((B, S, K, D)).astype(np.float32) + 0.5
    return q, k, v


def _round8(x, axis):
    amax = np.abs(x).max(axis=axis, keepdims=True)
    scale = np.where(amax > 0, amax / 127, 1.0)
    return np.clip(np.round(x / scale), -127, 127), scale


def _oracle(q, k, v, mode, block=BLOCK):
    """The scheme in float64, per batch and head: `(out, lse)`."""
    q, k, v = (np.asarray(a, F64) for a in (q, k, v))
    B, S_q, H, D = q.shape
    S_k, K = k.shape[1], k.shape[2]
    scale = D ** -0.5
    out = np.zeros((B, S_q, H, D))
    lse = np.zeros((B, H, S_q))
    for b in range(B):
        for h in range(H):
            kh, vh, qh = k[b, :, h * K // H], v[b, :, h * K // H], q[b, :, h]
            k_mean = kh.mean(0)
            q8, sq = _round8(qh, 1)
            k8, sk = _round8(kh - k_mean, 1)
            s = (q8 @ k8.T) * sq * sk.T * scale
            num, den, top = 0.0, 0.0, s.max(1, keepdims=True)
            if mode == "int8":
                v_mean = vh.mean(0)
                v8, sv = _round8(vh - v_mean, 0)
            for j in range(0, S_k, block):
                sb = s[:, j:j + block]
                m_b = sb.max(1, keepdims=True)
                p = np.exp(sb - m_b)
                w = np.exp(m_b - top)
                if mode == "int8":
                    u = np.floor(255 * p + 0.5)
                    num = num + w * (u @ v8[j:j + block])
                    den = den + w * u.sum(1, keepdims=True) / 255
                else:
                    num = num + w * (p @ vh[j:j + block])
                    den = den + w * p.sum(1, keepdims=True)
            o = num / den
            if mode == "int8":
                o = o / 255 * sv + v_mean
            out[b, :, h] = o
            lse[b, h] = (top + np.log(den))[:, 0] + scale * (qh @ k_mean)
    return out, lse


def _exact(q, k, v, **options):
    """Float attention in float64: `(out, lse)`."""
    with jax.enable_x64(True):
        out, lse = kernels.attention_fwd(*(jnp.asarray(a, F64) for a in (q, k, v)),
                                         implementation="xla", **options)
        return np.asarray(out), np.asarray(lse)


def _errors(a, b):
    a, b = np.asarray(a, F64).ravel(), np.asarray(b, F64).ravel()
    return np.linalg.norm(a - b) / np.linalg.norm(b), a @ b / (np.linalg.norm(a) * np.linalg.norm(b))


@pytest.fixture(scope="module", params=[0.0, 8.0], ids=["random", "k-offset"])
def case(request):
    q, k, v = _inputs(request.param)
    return (q, k, v), _exact(q, k, v)


@pytest.mark.parametrize("mode", ["int8-qk", "int8"])
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_the_scheme_against_float64(case, mode, implementation):
    (q, k, v), (exact, exact_lse) = case
    impl = PALLAS if implementation == "pallas" else kernels.Xla()
    if implementation == "xla":  # the reference's key block is the kernel's default
        want, want_lse = _oracle(q, k, v, mode, block=512)
    else:
        want, want_lse = _oracle(q, k, v, mode)
    out, lse = kernels.attention_fwd(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), quantize=mode,
                                     implementation=impl)
    assert out.dtype == jnp.float32 and lse.shape == (1, 4, 300)
    # The scheme, up to float32 sums (and the rare probability rounded the other way).
    rel, _ = _errors(out, want)
    assert rel < 2e-4, rel
    np.testing.assert_allclose(lse, want_lse, rtol=1e-4, atol=2e-4)
    # The targets against float attention; the lse is the float one's (K's mean back in).
    rel, cos = _errors(out, exact)
    assert rel <= 2e-2 and cos >= 0.999, (rel, cos)
    assert rel > 5e-4  # (int8 it is: not the float path, 1e-7 from float64)
    np.testing.assert_allclose(lse, exact_lse, atol=2e-2)


def test_bf16_inputs_and_the_output_alone():
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in _inputs(8.0))
    exact, _ = _exact(*(np.asarray(a, np.float32) for a in (q, k, v)))
    for impl in (kernels.Xla(), PALLAS):
        out = kernels.attention(q, k, v, quantize="int8", implementation=impl)
        assert out.dtype == jnp.bfloat16
        rel, cos = _errors(out, exact)
        assert rel <= 2e-2 and cos >= 0.999, (impl.name, rel, cos)


def test_gradient_is_the_float_attentions():
    q, k, v = (jnp.asarray(a) for a in _inputs(0.0, S=200))
    g = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    loss = lambda impl, quantize: lambda q, k, v: jnp.sum(  # noqa: E731
        g * kernels.attention(q, k, v, quantize=quantize, implementation=impl))
    with jax.enable_x64(True):
        exact = jax.grad(loss("xla", None), argnums=(0, 1, 2))(*(jnp.asarray(a, F64) for a in (q, k, v)))
        exact = [np.asarray(a) for a in exact]
    for impl in (kernels.Xla(), PALLAS):
        grads = jax.grad(loss(impl, "int8"), argnums=(0, 1, 2))(q, k, v)
        for got, want in zip(grads, exact):
            rel, cos = _errors(got, want)
            assert rel < 5e-2 and cos > 0.998, (impl.name, rel, cos)


def test_masks_on_the_reference():
    # Key lengths (NaN past them never read), segment ids and a causal mask: each
    # within the targets of the float attention with the same mask.
    q, k, v = _inputs(8.0, B=2, S=260)
    k[1, 200:] = np.nan
    v[1, 200:] = np.nan
    lengths = jnp.asarray([260, 200], jnp.int32)
    seg = np.zeros((2, 260), np.int32)
    seg[:, 130:] = 1
    clean = [np.nan_to_num(a) for a in (q, k, v)]
    for options in (dict(kv_lengths=lengths), dict(segment_ids=jnp.asarray(seg)), dict(causal=True)):
        given = (q, k, v) if "kv_lengths" in options else clean
        out = kernels.attention(*map(jnp.asarray, given), quantize="int8", implementation="xla",
                                **options)
        exact = _exact(*clean, **options)[0]
        assert np.isfinite(np.asarray(out)).all()
        rel, cos = _errors(out, exact)
        assert rel <= 2e-2 and cos >= 0.999, (list(options), rel, cos)


def test_refusals():
    q, k, v = (jnp.asarray(a) for a in _inputs(0.0, S=64))
    with pytest.raises(ValueError, match=r"`quantize` must be one of \(None, 'int8-qk', 'int8'\); "
                                         r"received 'fp8'"):
        kernels.attention(q, k, v, quantize="fp8")
    with pytest.raises(NotImplementedError, match=r"quantize='int8' with causal \(the int8 kernel "
                                                  r"computes full attention\)"):
        kernels.attention(q, k, v, quantize="int8", causal=True, implementation=PALLAS)
    with pytest.raises(NotImplementedError, match=r"quantize='int8' with a bias"):
        kernels.attention(q, k, v, quantize="int8", bias=jnp.zeros((1, 1, 64, 64)), implementation="xla")
    with pytest.raises(NotImplementedError, match=r"quantize='int8-qk'"):
        kernels.attention(q, k, v, quantize="int8-qk", implementation="blockwise")
    assert kernels.select_implementation(q, k, v, quantize="int8", platform="tpu") == "pallas_tpu"
    assert kernels.select_implementation(q, k, v, quantize="int8", platform="cpu") == "xla"
    # A long masked int8 request no kernel serves is refused, not materialized (51 GB here).
    long = jax.ShapeDtypeStruct((1, 32760, 12, 128), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=r"pallas_tpu: quantize='int8' with causal"):
        kernels.select_implementation(long, long, long, quantize="int8", causal=True, platform="tpu")


def test_a_model_with_int8_attention():
    config = models.WanConfig(dim=64, ffn_dim=96, num_heads=2, num_layers=2, in_channels=4,
                              out_channels=4, text_dim=16)
    wan = models.WanTransformer3D(config, key=jax.random.key(0))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 5, 8, 12)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((7, 16)), jnp.float32)
    call = eqx.filter_jit(lambda m: m(x, jnp.float32(500.0), c))
    q = models.quantize(wan, activations="int8", attention="int8")
    assert q.blocks.self_attn.quantize == "int8" and wan.blocks.self_attn.quantize is None
    w8a8 = models.quantize(wan, activations="int8")
    rel, cos = _errors(call(q), call(w8a8))
    assert 0 < rel < 2e-2 and cos > 0.999, (rel, cos)
    with pytest.raises(ValueError, match=r"quantize: `attention` must be one of \(None, 'int8-qk', "
                                         r"'int8'\); received 'int4'"):
        models.quantize(wan, attention="int4")


@pytest.mark.device
@pytest.mark.parametrize("mode", ["int8-qk", "int8"])
def test_the_kernel_on_the_chip(mode):
    # On a TPU: Mosaic's kernel at Wan's head size and its own blocks (1024 x 512), over
    # 4,100 tokens (a ragged last block); in interpret mode the small case above.
    big = harness.chip_sizes()
    q, k, v = _inputs(8.0, S=4100 if big else 300, H=4, K=2, D=128 if big else 64)
    impl = kernels.PallasTpu(interpret=not harness.on_chip(), int8_blocks=(1024, 512) if big else (64, BLOCK))
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))
    given = [np.asarray(a, np.float32) for a in (q, k, v)]
    want, _ = _oracle(*given, mode, block=impl.int8_blocks[1])
    exact, _ = _exact(*given)
    out = kernels.attention(q, k, v, quantize=mode, implementation=impl)
    assert out.dtype == jnp.bfloat16
    rel, cos = _errors(out, exact)
    assert rel <= 2e-2 and cos >= 0.999, (rel, cos)
    rel, _ = _errors(out, want)
    assert rel <= 5e-3, rel  # the scheme, up to its bfloat16 output
