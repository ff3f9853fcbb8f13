"""The Flax linen shim: same numbers as the Equinox modules, and the kernels inside linen.

The linen norms must give bit-identical output to the Equinox norms with the same
weights (they call the same functions); `attention_fn` inside
`flax.linen.MultiHeadDotProductAttention` is checked against the float64 oracle
applied to the projections computed in NumPy from the module's parameters.
"""

import functools
import os
import subprocess
import sys

import equinox as eqx
import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import oracle
import vidax_eqx.flax as vflax
from vidax_eqx import core, nn
from vidax_eqx.parallel import TP_AXIS


# ---------------------------------------------------------------------------- names


def test_documented_names():
    for name in (
        "dot_product_attention",
        "local_attention",
        "sequence_parallel_self_attention",
        "sequence_parallel_joint_self_attention",
        "chunk_by_rank",
    ):
        assert getattr(vflax, name) is getattr(core, name)
    assert issubclass(vflax.RMSNorm, linen.Module)
    assert issubclass(vflax.TPShardedRMSNorm, linen.Module)
    assert vflax.RMSNorm(8).eps == 1e-6 and vflax.TPShardedRMSNorm(4, 8).eps == 1e-6


def test_import_vidax_eqx_does_not_import_flax():
    code = "import sys, vidax_eqx, vidax_eqx.core, vidax_eqx.nn; assert 'flax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------- norms


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linen_rms_norm_bit_identical_to_equinox(dtype):
    rng = np.random.default_rng(0)
    x, x64 = harness.rounded(rng, (3, 5, 32), dtype)
    lin = vflax.RMSNorm(32)
    variables = lin.init(jax.random.key(0), x)
    assert variables["params"]["scale"].shape == (32,)
    assert np.all(np.asarray(variables["params"]["scale"]) == 1)
    w, w64 = harness.rounded(rng, (32,))
    variables = {"params": {"scale": w}}
    eqx_m = vflax.rms_norm_from_linen(lin, variables)
    assert isinstance(eqx_m, nn.RMSNorm) and eqx_m.dim == 32 and eqx_m.eps == 1e-6
    got_linen = jax.jit(lin.apply)(variables, x)
    got_eqx = eqx.filter_jit(lambda m, x: m(x))(eqx_m, x)
    assert got_linen.dtype == got_eqx.dtype == jnp.float32
    assert np.array_equal(np.asarray(got_linen), np.asarray(got_eqx))
    assert np.array_equal(np.asarray(lin.apply(variables, x)), np.asarray(eqx_m(x)))
    oracle.assert_close(got_linen, oracle.rms_norm(x64, w64), dtype)
    # And back.
    back = vflax.rms_norm_to_linen(eqx_m)
    assert back["params"]["scale"] is eqx_m.weight


def test_linen_rms_norm_param_dtype_keeps_bfloat16():
    x = jnp.ones((2, 8), jnp.bfloat16)
    lin = vflax.RMSNorm(8, param_dtype=jnp.bfloat16)
    variables = lin.init(jax.random.key(0), x)
    assert lin.apply(variables, x).dtype == jnp.bfloat16


def test_converters_check_shapes_and_types():
    with pytest.raises(ValueError, match=r"shape \(8,\).*received \(7,\)"):
        vflax.rms_norm_from_linen(vflax.RMSNorm(8), {"params": {"scale": jnp.ones(7)}})
    with pytest.raises(ValueError, match="scale"):
        vflax.rms_norm_from_linen(vflax.RMSNorm(8), {"params": {}})
    with pytest.raises(TypeError):
        vflax.rms_norm_to_linen(nn.LayerNorm(8))
    m = vflax.rms_norm_from_linen(vflax.TPShardedRMSNorm(4, 8), {"scale": jnp.ones(8)})
    assert isinstance(m, nn.TPShardedRMSNorm) and m.global_dim == 8 and m.weight.shape == (8,)


@pytest.mark.parametrize("n", [2, 4])
def test_linen_tp_sharded_rms_norm_in_shard_map(n):
    rng = np.random.default_rng(n)
    dim = 32
    x, x64 = harness.rounded(rng, (2, 3, dim))
    w, w64 = harness.rounded(rng, (dim,))
    mesh = harness.mesh(tp=n)
    lin = vflax.TPShardedRMSNorm(dim // n, dim)
    eqx_m = vflax.rms_norm_from_linen(lin, {"params": {"scale": w}})  # global weight

    spec_x = P(None, None, TP_AXIS)
    got_linen = jax.jit(jax.shard_map(
        lambda v, x: lin.apply(v, x), mesh=mesh,
        in_specs=({"params": {"scale": P(TP_AXIS)}}, spec_x), out_specs=spec_x,
    ))({"params": {"scale": w}}, x)
    got_eqx = jax.jit(jax.shard_map(
        lambda m, x: m(x), mesh=mesh, in_specs=(P(TP_AXIS), spec_x), out_specs=spec_x,
    ))(eqx_m, x)
    assert np.array_equal(np.asarray(got_linen), np.asarray(got_eqx))
    oracle.assert_close(got_linen, oracle.rms_norm(x64, w64), jnp.float32)

    # init inside shard_map gives each device a (dim_local,) slice of ones.
    init = jax.jit(jax.shard_map(
        lambda x: lin.init(jax.random.key(0), x), mesh=mesh, in_specs=spec_x,
        out_specs={"params": {"scale": P(TP_AXIS)}},
    ))(x)
    assert init["params"]["scale"].shape == (dim,)
    # Outside shard_map, and with inconsistent dims, it raises.
    with pytest.raises(ValueError, match="does not exist"):
        lin.apply({"params": {"scale": w[: dim // n]}}, x[..., : dim // n])
    bad = vflax.TPShardedRMSNorm(dim // n, 2 * dim)
    with pytest.raises(ValueError, match=f"global_dim={2 * dim}"):
        jax.shard_map(
            lambda v, x: bad.apply(v, x), mesh=mesh,
            in_specs=({"params": {"scale": P(TP_AXIS)}}, spec_x), out_specs=spec_x,
        )({"params": {"scale": w}}, x)


# ---------------------------------------------------------------------------- attention_fn


def _mha_reference(params, xq, xkv, mask):
    """MultiHeadDotProductAttention's math in float64 with the oracle as the attention."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])

    def proj(x, name):
        return np.einsum("...f,fhd->...hd", x, p[name]["kernel"]) + p[name]["bias"]

    q, k, v = proj(xq, "query"), proj(xkv, "key"), proj(xkv, "value")
    batch = q.shape[:-3]
    fold = lambda a: a.reshape((-1,) + a.shape[len(batch):])  # noqa: E731
    m = np.broadcast_to(mask, batch + mask.shape[len(batch):])
    out = oracle.attention(fold(q), fold(k), fold(v), mask=fold(m)).out.reshape(q.shape)
    return np.einsum("...hd,hdf->...f", out, p["out"]["kernel"]) + p["out"]["bias"]


def test_attention_fn_inside_multi_head_dot_product_attention():
    rng = np.random.default_rng(0)
    xq, xq64 = harness.rounded(rng, (2, 3, 7, 16))  # two batch axes
    xkv, xkv64 = harness.rounded(rng, (2, 3, 9, 12))
    mask = rng.random((2, 1, 1, 7, 9)) < 0.7  # (batch..., #heads, q, kv)
    mask[..., 0] = True  # every query sees at least one key (Flax differs on empty rows)
    kwargs = dict(num_heads=4, qkv_features=32, out_features=16)
    ours = linen.MultiHeadDotProductAttention(**kwargs, attention_fn=vflax.attention_fn)
    theirs = linen.MultiHeadDotProductAttention(**kwargs)
    params = jax.jit(theirs.init)(jax.random.key(1), xq, xkv, mask=jnp.asarray(mask))
    got = jax.jit(ours.apply)(params, xq, xkv, mask=jnp.asarray(mask))
    assert got.shape == (2, 3, 7, 16) and got.dtype == jnp.float32
    oracle.assert_close(got, _mha_reference(params, xq64, xkv64, mask), jnp.float32, "vs oracle")
    flax_out = jax.jit(theirs.apply)(params, xq, xkv, mask=jnp.asarray(mask))
    oracle.assert_close(got, flax_out, jnp.float32, "vs flax", factor=10)
    # Dropout configured but deterministic: fine.
    drop = linen.MultiHeadDotProductAttention(
        **kwargs, attention_fn=vflax.attention_fn, dropout_rate=0.1, deterministic=True
    )
    got_drop = jax.jit(drop.apply)(params, xq, xkv, mask=jnp.asarray(mask))
    assert np.array_equal(np.asarray(got_drop), np.asarray(got))


def test_attention_fn_bias_gqa_and_blockwise():
    rng = np.random.default_rng(1)
    q, q64 = harness.rounded(rng, (2, 5, 4, 8))
    k, k64 = harness.rounded(rng, (2, 6, 2, 8))
    v, v64 = harness.rounded(rng, (2, 6, 2, 8))
    bias, b64 = harness.rounded(rng, (1, 4, 5, 6))
    ref = oracle.attention(q64, k64, v64, bias=b64).out
    for impl in ("xla", "blockwise"):
        got = jax.jit(functools.partial(vflax.attention_fn, implementation=impl))(q, k, v, bias)
        oracle.assert_close(got, ref, jnp.float32, impl)
    # No batch axes, and a computation dtype.
    got = jax.jit(functools.partial(vflax.attention_fn, dtype=jnp.bfloat16))(q[0], k[0], v[0], bias[0])
    assert got.dtype == jnp.bfloat16
    oracle.assert_close(got, ref[0], jnp.bfloat16, "unbatched bf16")


def test_attention_fn_unsupported_requests_raise():
    x = jnp.ones((1, 4, 8))
    mha = linen.MultiHeadDotProductAttention(
        num_heads=2, attention_fn=vflax.attention_fn, dropout_rate=0.1, deterministic=False
    )
    params = jax.jit(linen.MultiHeadDotProductAttention(num_heads=2).init)(jax.random.key(0), x)
    with pytest.raises(NotImplementedError, match="dropout"):
        mha.apply(params, x, rngs={"dropout": jax.random.key(1)})
    plain = linen.MultiHeadDotProductAttention(num_heads=2, attention_fn=vflax.attention_fn)
    with pytest.raises(NotImplementedError, match="sow_weights"):
        plain.apply(params, x, sow_weights=True, mutable=["intermediates"])
    q = jnp.ones((1, 4, 2, 4))
    with pytest.raises(NotImplementedError, match="precision"):
        vflax.attention_fn(q, q, q, precision=jax.lax.Precision.HIGHEST)
    with pytest.raises(NotImplementedError, match="einsum"):
        vflax.attention_fn(q, q, q, qk_attn_weights_einsum=jnp.einsum)
    with pytest.raises(ValueError, match="broadcastable"):
        vflax.attention_fn(q, q, q, mask=jnp.ones((1, 1, 1, 2, 4, 4), bool))
