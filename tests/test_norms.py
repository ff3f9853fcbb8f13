"""Norms against float64 NumPy re-derivations of the reference models' math.

`RMSNorm` is Wan's `WanRMSNorm`: `x.float() * rsqrt(mean(x.float() ** 2) + eps)`,
cast back to `x`'s dtype, times `weight`. `LayerNorm` is `torch.nn.LayerNorm`
(CogVideoX's per-head q/k norm). Gradients are checked against analytic float64
formulas; `TPShardedRMSNorm` inside `jax.shard_map` against `RMSNorm` on the full
width. The references (`oracle.rms_norm`, `oracle.layer_norm` and their gradients)
import nothing from `vidax_eqx`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import oracle
from vidax_eqx import core
from vidax_eqx.nn import functional, LayerNorm, RMSNorm, TPShardedRMSNorm
from vidax_eqx.parallel import TP_AXIS


EPS = 1e-6


# ---------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize(
    "x_dtype, w_dtype, out_dtype",
    [
        (jnp.float32, jnp.float32, jnp.float32),
        (jnp.bfloat16, jnp.float32, jnp.float32),
        (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
        (jnp.float32, jnp.bfloat16, jnp.float32),
    ],
)
def test_rms_norm_forward(x_dtype, w_dtype, out_dtype):
    rng = np.random.default_rng(0)
    x, x64 = harness.rounded(rng, (3, 5, 48), x_dtype)
    w, w64 = harness.rounded(rng, (48,), w_dtype)
    ref = oracle.rms_norm(x64, w64)
    for got in (functional.rms_norm(x, w), eqx.tree_at(lambda m: m.weight, RMSNorm(48), w)(x)):
        assert got.dtype == out_dtype
        oracle.assert_close(got, ref, x_dtype if x_dtype != jnp.float32 else w_dtype, "rms_norm")


def test_rms_norm_casts_to_input_dtype_before_the_weight():
    """Wan's order: the normalized value is rounded to x's dtype, then scaled."""
    rng = np.random.default_rng(1)
    x, _ = harness.rounded(rng, (4, 64), jnp.bfloat16)
    w = jnp.asarray(2.0 ** rng.integers(-3, 4, size=64), jnp.float32)  # exact multiplies
    got = np.asarray(functional.rms_norm(x, w))
    assert got.dtype == np.float32
    y = got / np.asarray(w)
    assert np.array_equal(np.asarray(jnp.asarray(y).astype(jnp.bfloat16).astype(jnp.float32)), y)
    oracle.assert_close(y, oracle.rms_norm(np.asarray(x.astype(jnp.float32)), np.ones(64)), jnp.bfloat16)


def test_rms_norm_gradients():
    rng = np.random.default_rng(2)
    x, x64 = harness.rounded(rng, (2, 7, 40), jnp.float32)
    w, w64 = harness.rounded(rng, (40,), jnp.float32)
    ct, ct64 = harness.rounded(rng, (2, 7, 40), jnp.float32)
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(functional.rms_norm(x, w) * ct), argnums=(0, 1)))(x, w)
    dx_ref, dw_ref = oracle.rms_norm_grads(x64, w64, ct64)
    oracle.assert_close(dx, dx_ref, jnp.float32, "dx")
    oracle.assert_close(dw, dw_ref, jnp.float32, "dw")
    # The module's weight gradient, through eqx.filter_grad.
    m = eqx.tree_at(lambda m: m.weight, RMSNorm(40), w)
    gm = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(x) * ct)))(m)
    oracle.assert_close(gm.weight, dw_ref, jnp.float32, "module dw")


def test_rms_norm_module_vmap_jit_and_fields():
    m = RMSNorm(16, eps=1e-5)
    assert m.weight.shape == (16,) and m.weight.dtype == jnp.float32
    assert np.all(np.asarray(m.weight) == 1.0)
    assert RMSNorm(16, dtype=jnp.bfloat16).weight.dtype == jnp.bfloat16
    assert jax.tree.leaves(m) == [m.weight]  # dim, eps are static
    rng = np.random.default_rng(3)
    x, x64 = harness.rounded(rng, (4, 9, 16), jnp.float32)
    out = jax.jit(jax.vmap(m))(x)
    oracle.assert_close(out, oracle.rms_norm(x64, np.ones(16), eps=1e-5), jnp.float32)
    assert core.RMSNorm is RMSNorm and core.TPShardedRMSNorm is TPShardedRMSNorm


def test_rms_norm_wrong_shape_names_the_dimension():
    with pytest.raises(jaxtyping.TypeCheckError, match=r"^RMSNorm\(dim=8\): `x` must be a float "
                                                       r"array \(\.\.\., 8\); received float32 \(3, 7\)"):
        RMSNorm(8)(jnp.ones((3, 7)))
    with pytest.raises(jaxtyping.TypeCheckError, match=r"`x` must be a float array \(\.\.\., 4\)"):
        TPShardedRMSNorm(4, 8)(jnp.ones((2, 5)))
    with pytest.raises(jaxtyping.TypeCheckError, match=r"^rms_norm: `weight` must be a float array "
                                                       r"\(8,\); received float32 \(7,\) \(dim = 8 as in `x`\)"):
        functional.rms_norm(jnp.ones((3, 8)), jnp.ones((7,)))


@pytest.mark.parametrize("dim", [0, -1, 2.0, True])
def test_rms_norm_bad_dim_raises(dim):
    with pytest.raises(ValueError, match="positive int"):
        RMSNorm(dim)


# ---------------------------------------------------------------------------- layer_norm


@pytest.mark.parametrize(
    "x_dtype, p_dtype, out_dtype",
    [
        (jnp.float32, jnp.float32, jnp.float32),
        (jnp.bfloat16, jnp.float32, jnp.float32),
        (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
    ],
)
def test_layer_norm_forward(x_dtype, p_dtype, out_dtype):
    rng = np.random.default_rng(4)
    x, x64 = harness.rounded(rng, (6, 3, 24), x_dtype, offset=1.5)  # (S, heads, head_dim), nonzero mean
    w, w64 = harness.rounded(rng, (24,), p_dtype)
    b, b64 = harness.rounded(rng, (24,), p_dtype)
    m = eqx.tree_at(lambda m: (m.weight, m.bias), LayerNorm(24), (w, b))
    tol_dtype = jnp.bfloat16 if jnp.bfloat16 in (x_dtype, p_dtype) else jnp.float32
    for got in (functional.layer_norm(x, w, b), m(x)):
        assert got.dtype == out_dtype
        oracle.assert_close(got, oracle.layer_norm(x64, w64, b64), tol_dtype, "layer_norm")


def test_layer_norm_without_affine():
    m = LayerNorm(24, elementwise_affine=False)
    assert m.weight is None and m.bias is None and jax.tree.leaves(m) == []
    rng = np.random.default_rng(5)
    x, x64 = harness.rounded(rng, (5, 24), jnp.bfloat16, offset=-2.0)
    got = m(x)
    assert got.dtype == jnp.bfloat16
    oracle.assert_close(got, oracle.layer_norm(x64, None, None), jnp.bfloat16)
    d = LayerNorm(24)
    assert np.all(np.asarray(d.weight) == 1) and np.all(np.asarray(d.bias) == 0)


def test_layer_norm_gradients():
    rng = np.random.default_rng(6)
    x, x64 = harness.rounded(rng, (4, 2, 16), jnp.float32, offset=0.7)
    w, w64 = harness.rounded(rng, (16,), jnp.float32)
    b, _ = harness.rounded(rng, (16,), jnp.float32)
    ct, ct64 = harness.rounded(rng, (4, 2, 16), jnp.float32)
    grads = jax.jit(jax.grad(
        lambda x, w, b: jnp.sum(functional.layer_norm(x, w, b) * ct), argnums=(0, 1, 2)
    ))(x, w, b)
    for got, ref, name in zip(grads, oracle.layer_norm_grads(x64, w64, ct64), ("dx", "dw", "db")):
        oracle.assert_close(got, ref, jnp.float32, name)


# ---------------------------------------------------------------------------- TP-sharded


def _sharded(n, dim, eps=EPS):
    """Global `(x, weight) -> out` through a `TPShardedRMSNorm` inside shard_map over tp=n."""
    mesh = harness.mesh(tp=n)

    def local(m, x):
        return jax.vmap(jax.vmap(m))(x)

    # The module holds the full (dim,) weight outside shard_map; P("tp") hands each
    # device its (dim // n,) slice, which is what TPShardedRMSNorm(dim // n, dim) holds.
    template = TPShardedRMSNorm(dim // n, dim, eps)

    def f(x, w):
        m = eqx.tree_at(lambda m: m.weight, template, w)
        return jax.shard_map(
            local, mesh=mesh, in_specs=(P(TP_AXIS), P(None, None, TP_AXIS)),
            out_specs=P(None, None, TP_AXIS),
        )(m, x)

    return f


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tp_sharded_rms_norm_equals_full_width(n, dtype):
    rng = np.random.default_rng(7 + n)
    dim = 48
    x, x64 = harness.rounded(rng, (2, 5, dim), dtype)
    w, w64 = harness.rounded(rng, (dim,), jnp.float32)
    ct, ct64 = harness.rounded(rng, (2, 5, dim), jnp.float32)
    f = jax.jit(_sharded(n, dim))
    full = eqx.tree_at(lambda m: m.weight, RMSNorm(dim), w)

    out = f(x, w)
    assert out.dtype == jnp.float32 and out.shape == x.shape
    oracle.assert_close(out, oracle.rms_norm(x64, w64), dtype, "sharded vs oracle")
    oracle.assert_close(out, jax.vmap(jax.vmap(full))(x), dtype, "sharded vs RMSNorm")

    if dtype == jnp.float32:
        dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) * ct), argnums=(0, 1)))(x, w)
        dx_ref, dw_ref = oracle.rms_norm_grads(x64, w64, ct64)
        oracle.assert_close(dx, dx_ref, dtype, "dx")
        oracle.assert_close(dw, dw_ref, dtype, "dw")
        gfull = jax.jit(
            jax.grad(lambda x, m: jnp.sum(jax.vmap(jax.vmap(m))(x) * ct), argnums=(0, 1))
        )(x, full)
        oracle.assert_close(dx, gfull[0], dtype, "dx vs RMSNorm")
        oracle.assert_close(dw, gfull[1].weight, dtype, "dw vs RMSNorm")


def test_tp_sharded_rms_norm_functional_in_shard_map():
    rng = np.random.default_rng(11)
    x, x64 = harness.rounded(rng, (3, 32), jnp.float32)
    w, w64 = harness.rounded(rng, (32,), jnp.float32)
    out = jax.shard_map(
        lambda x, w: functional.tp_sharded_rms_norm(x, w, 32, axis_name=TP_AXIS),
        mesh=harness.mesh(tp=4), in_specs=(P(None, TP_AXIS), P(TP_AXIS)), out_specs=P(None, TP_AXIS),
    )(x, w)
    oracle.assert_close(out, oracle.rms_norm(x64, w64), jnp.float32)


def test_tp_sharded_rms_norm_bad_dims_raise():
    with pytest.raises(ValueError, match=r"multiple of dim_local.*dim_local=3, global_dim=8"):
        TPShardedRMSNorm(3, 8)
    with pytest.raises(ValueError, match="positive int"):
        TPShardedRMSNorm(0, 8)
    # dim_local * tp != global_dim: 4 * 2 != 16.
    m = TPShardedRMSNorm(4, 16)
    with pytest.raises(ValueError, match=r"dim_local=4, axis_size=2, global_dim=16"):
        jax.shard_map(
            m, mesh=harness.mesh(tp=2), in_specs=P(None, TP_AXIS), out_specs=P(None, TP_AXIS)
        )(jnp.ones((2, 8)))
    # Outside shard_map the tp axis is missing.
    with pytest.raises(ValueError, match=r"axis 'tp' does not exist"):
        TPShardedRMSNorm(4, 8)(jnp.ones((2, 4)))
    with pytest.raises(ValueError, match=r"axis 'model' does not exist"):
        functional.tp_sharded_rms_norm(jnp.ones((2, 4)), jnp.ones(4), 8, axis_name="model")
