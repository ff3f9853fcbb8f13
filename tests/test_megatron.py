"""`parallel.tensor_parallel_attention` and `core.dot_product_attention(mesh=...)`:
heads over "tp", batch over "dp", against the float64 oracle (output and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from vidax_eqx import core, kernels, parallel


def _inputs(B, S, H, H_kv, D, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, S, H, D)).astype(np.float32)
    k = rng.standard_normal((B, S, H_kv, D)).astype(np.float32)
    v = rng.standard_normal((B, S, H_kv, D)).astype(np.float32)
    dout = rng.standard_normal((B, S, H, D)).astype(np.float32)
    return rng, q, k, v, dout


@pytest.mark.parametrize(
    "dp,tp,H,H_kv",
    [(2, 4, 4, 4), (2, 4, 8, 2), (1, 8, 8, 1), (4, 2, 4, 1), (8, 1, 2, 2)],
    ids=["dp2-tp4", "dp2-tp4-gqa", "tp8-mqa", "dp4-tp2-mqa", "dp8"],
)
def test_matches_oracle_with_gradients(dp, tp, H, H_kv):
    B, S, D = 8, 19, 8
    rng, q, k, v, dout = _inputs(B, S, H, H_kv, D, seed=dp * 10 + tp)
    bias = rng.standard_normal((1, H, S, S)).astype(np.float32)
    sinks = rng.standard_normal((H,)).astype(np.float32)
    seg = np.repeat(np.array([[0] * 9 + [1] * 10]), B, axis=0)
    seg[::3, -2:] = -1  # padding in some batch rows
    mesh = parallel.make_mesh(dp=dp, tp=tp)

    def f(q, k, v, bias, sinks):
        return parallel.tensor_parallel_attention(
            q, k, v, mesh=mesh, bias=bias, sinks=sinks, segment_ids=jnp.asarray(seg), causal=True
        )

    out, vjp = jax.vjp(jax.jit(f), q, k, v, bias, sinks)
    grads = vjp(jnp.asarray(dout))
    ref = oracle.attention(q, k, v, bias=bias, sinks=sinks, segment_ids=seg, causal=True, dout=dout)
    oracle.assert_close(out, ref.out, np.float32, "out")
    for name, got in zip(("dq", "dk", "dv", "dbias", "dsinks"), grads):
        oracle.assert_close(got, getattr(ref, name), np.float32, name)


def test_core_dot_product_attention_mesh_with_bias_and_mask():
    B, S, H, D = 4, 13, 4, 8
    rng, q, k, v, dout = _inputs(B, S, H, H, D, seed=3)
    bias = rng.standard_normal((B, 1, S, S)).astype(np.float32)  # T5-style, per batch
    mask = rng.random((B, 1, S, S)) < 0.8
    mesh = parallel.make_mesh(dp=2, tp=4)
    out = core.dot_product_attention(q, k, v, bias, jnp.asarray(mask), 1.0, mesh)
    ref = oracle.attention(q, k, v, bias=bias, mask=mask, scale=1.0)
    oracle.assert_close(out, ref.out, np.float32, "dot_product_attention(mesh)")
    # The same call without a mesh gives the same numbers.
    single = core.dot_product_attention(q, k, v, bias, jnp.asarray(mask), 1.0)
    np.testing.assert_allclose(np.asarray(out), np.asarray(single), rtol=0, atol=1e-6)


def test_output_is_sharded_over_heads_and_batch():
    _, q, k, v, _ = _inputs(4, 8, 4, 4, 8, seed=1)
    mesh = parallel.make_mesh(dp=2, tp=4)
    out = jax.jit(lambda q, k, v: parallel.tensor_parallel_attention(q, k, v, mesh=mesh))(q, k, v)
    assert out.sharding.spec[0] == "dp" and out.sharding.spec[2] == "tp"


@pytest.mark.parametrize(
    "shape,match",
    [((3, 8, 4, 8), "batch of 3"), ((4, 8, 6, 8), "6 query heads")],
)
def test_errors(shape, match):
    q = jnp.ones(shape)
    mesh = parallel.make_mesh(dp=2, tp=4)
    with pytest.raises(ValueError, match=match):
        core.dot_product_attention(q, q, q, mesh=mesh)


def test_single_device_mesh_is_plain_attention():
    _, q, k, v, _ = _inputs(2, 7, 2, 2, 8, seed=5)
    one = parallel.make_mesh(devices=jax.devices()[:1])
    out = core.dot_product_attention(q, k, v, mesh=one)
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(kernels.attention(q, k, v)), rtol=0, atol=1e-6
    )
