"""`parallel.tensor_parallel_attention` and `core.dot_product_attention(mesh=...)`:
heads over "tp", batch over "dp", against the float64 oracle (output and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
from vidax_eqx import core, kernels, parallel


@pytest.mark.parametrize(
    "dp,tp,H,H_kv",
    [(2, 4, 4, 4), (2, 4, 8, 2), (1, 8, 8, 1), (4, 2, 4, 1), (8, 1, 2, 2)],
    ids=["dp2-tp4", "dp2-tp4-gqa", "tp8-mqa", "dp4-tp2-mqa", "dp8"],
)
def test_matches_oracle_with_gradients(dp, tp, H, H_kv):
    B, S, D = 8, 19, 8
    rng = np.random.default_rng(dp * 10 + tp)
    a = harness.attention_inputs(B, S, H, D, H_kv=H_kv, rng=rng)
    q, k, v, dout = a["q"], a["k"], a["v"], a["dout"]
    bias = harness.normal(rng, (1, H, S, S))
    sinks = harness.normal(rng, (H,))
    seg = np.repeat(np.array([[0] * 9 + [1] * 10]), B, axis=0)
    seg[::3, -2:] = -1  # padding in some batch rows
    mesh = harness.mesh(dp=dp, tp=tp)

    def f(q, k, v, bias, sinks):
        return parallel.tensor_parallel_attention(
            q, k, v, mesh=mesh, bias=bias, sinks=sinks, segment_ids=jnp.asarray(seg), causal=True
        )

    out, grads = harness.vjp(f)(q, k, v, bias, sinks, dout)
    ref = oracle.attention(q, k, v, bias=bias, sinks=sinks, segment_ids=seg, causal=True, dout=dout)
    names = ("out", "dq", "dk", "dv", "dbias", "dsinks")
    harness.assert_matches(harness.named(out, grads, names), ref, np.float32, names)


def test_core_dot_product_attention_mesh_with_bias_and_mask():
    B, S, H, D = 4, 13, 4, 8
    rng = np.random.default_rng(3)
    a = harness.attention_inputs(B, S, H, D, rng=rng)
    q, k, v = a["q"], a["k"], a["v"]
    bias = harness.normal(rng, (B, 1, S, S))  # T5-style, per batch
    mask = rng.random((B, 1, S, S)) < 0.8
    mesh = harness.mesh(dp=2, tp=4)
    out = core.dot_product_attention(q, k, v, bias, jnp.asarray(mask), 1.0, mesh)
    ref = oracle.attention(q, k, v, bias=bias, mask=mask, scale=1.0)
    oracle.assert_close(out, ref.out, np.float32, "dot_product_attention(mesh)")
    # The same call without a mesh gives the same numbers.
    single = core.dot_product_attention(q, k, v, bias, jnp.asarray(mask), 1.0)
    np.testing.assert_allclose(np.asarray(out), np.asarray(single), rtol=0, atol=1e-6)


def test_output_is_sharded_over_heads_and_batch():
    a = harness.attention_inputs(4, 8, 4, 8, seed=1)
    q, k, v = a["q"], a["k"], a["v"]
    mesh = harness.mesh(dp=2, tp=4)
    out = jax.jit(lambda q, k, v: parallel.tensor_parallel_attention(q, k, v, mesh=mesh))(q, k, v)
    assert out.sharding.spec[0] == "dp" and out.sharding.spec[2] == "tp"


@pytest.mark.parametrize(
    "shape,match",
    [((3, 8, 4, 8), "batch of 3"), ((4, 8, 6, 8), "6 query heads")],
)
def test_errors(shape, match):
    q = jnp.ones(shape)
    mesh = harness.mesh(dp=2, tp=4)
    with pytest.raises(ValueError, match=match):
        core.dot_product_attention(q, q, q, mesh=mesh)


def test_single_device_mesh_is_plain_attention():
    a = harness.attention_inputs(2, 7, 2, 8, seed=5)
    q, k, v = a["q"], a["k"], a["v"]
    one = harness.mesh()
    out = core.dot_product_attention(q, k, v, mesh=one)
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(kernels.attention(q, k, v)), rtol=0, atol=1e-6
    )
