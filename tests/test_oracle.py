"""The oracle checks itself: its backward against central finite differences in
float64, and its forward against `jax.nn.dot_product_attention` (not vidax_eqx)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle


def _loss(inputs, dout, dlse, kw):
    r = oracle.attention(inputs["q"], inputs["k"], inputs["v"], bias=inputs.get("bias"),
                         sinks=inputs.get("sinks"), **kw)
    finite = np.isfinite(r.lse)
    return np.sum(r.out * dout) + np.sum(np.where(finite, r.lse, 0.0) * dlse)


@pytest.mark.parametrize("bias_shape", [(1, 4, 5, 6), (6,), (5, 1)])
def test_oracle_gradients_match_finite_differences(bias_shape):
    rng = np.random.default_rng(0)
    B, S_q, S_k, H, H_kv, D = 1, 5, 6, 4, 2, 3
    inputs = dict(
        q=rng.standard_normal((B, S_q, H, D)),
        k=rng.standard_normal((B, S_k, H_kv, D)),
        v=rng.standard_normal((B, S_k, H_kv, D)),
        bias=rng.standard_normal(bias_shape),
        sinks=rng.standard_normal((H,)),
    )
    seg_q = np.array([[0, 0, 1, 1, 2]])  # id 2 is absent from kv: that row sees only the sink
    seg_kv = np.array([[0, 1, 1, 0, 1, -1]])
    mask = rng.random((1, H, S_q, S_k)) < 0.8
    kw = dict(segment_ids=(seg_q, seg_kv), mask=mask, logits_soft_cap=1.5, scale=0.9,
              q_positions=np.array([4, 0, 3, 1, 2]), kv_positions=np.arange(S_k), causal=True,
              window=(3, None))
    dout = rng.standard_normal((B, S_q, H, D))
    dlse = rng.standard_normal((B, H, S_q))
    r = oracle.attention(inputs["q"], inputs["k"], inputs["v"], bias=inputs["bias"],
                         sinks=inputs["sinks"], dout=dout, dlse=dlse, **kw)
    eps = 1e-6
    for name, grad in (("q", r.dq), ("k", r.dk), ("v", r.dv), ("bias", r.dbias), ("sinks", r.dsinks)):
        x = inputs[name]
        assert grad.shape == x.shape, name
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + eps
            hi = _loss(inputs, dout, dlse, kw)
            x[idx] = old - eps
            lo = _loss(inputs, dout, dlse, kw)
            x[idx] = old
            numeric[idx] = (hi - lo) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, atol=1e-7, rtol=1e-6, err_msg=name)


def test_oracle_empty_rows():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 3, 2, 4))
    k = rng.standard_normal((1, 4, 2, 4))
    seg = (np.array([[0, 5, -1]]), np.array([[0, 0, 1, 1]]))
    dout = rng.standard_normal(q.shape)
    r = oracle.attention(q, k, k, segment_ids=seg, dout=dout, dlse=np.ones((1, 2, 3)))
    assert np.all(r.out[0, 1:] == 0) and np.all(r.lse[0, :, 1:] == -np.inf)
    assert np.all(np.isfinite(r.lse[0, :, 0]))
    for g in (r.dq, r.dk, r.dv):
        assert np.all(np.isfinite(g))
    assert np.all(r.dq[0, 1:] == 0)


@pytest.mark.parametrize("causal", [False, True])
def test_oracle_forward_matches_jax_nn(causal):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 9, 4, 8)).astype(np.float32)
    k = rng.standard_normal((2, 9, 2, 8)).astype(np.float32)
    v = rng.standard_normal((2, 9, 2, 8)).astype(np.float32)
    bias = rng.standard_normal((1, 4, 9, 9)).astype(np.float32)
    want = jax.nn.dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                        bias=jnp.asarray(bias), is_causal=causal)
    got = oracle.attention(q, k, v, bias=bias, causal=causal).out
    oracle.assert_close(np.asarray(want), got, np.float32, "jax.nn vs oracle", factor=10)
