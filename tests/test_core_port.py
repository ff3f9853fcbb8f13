"""Code written against the `vidax.core` page runs with its import line changed.

A linen program as the page writes it (`RMSNorm(dim).init(rng, x)` / `.apply`, T5-style
attention with a bias and `scale=1.0`, Ulysses inside `shard_map` over a
`build_tpu_mesh` mesh, `TPShardedRMSNorm` initialised and applied inside one, the
sequence chunked by `chunk_by_rank`) against `vidax_eqx.flax`, compared with the float64
oracle; the page's import paths (`vidax_eqx.core.attention`); and the errors a port
meets: linen methods on the Equinox norms, `TPShardedRMSNorm.init` outside `shard_map`.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import oracle
from vidax_eqx import core, nn

linen = pytest.importorskip("flax.linen")
# The page's import line, with `vidax` changed (the linen classes live in vidax_eqx.flax).
from vidax_eqx.flax import (  # noqa: E402
    chunk_by_rank, dot_product_attention, RMSNorm, sequence_parallel_self_attention,
    TPShardedRMSNorm,
)

B, S, H, D = 2, 32, 4, 8
DIM = H * D


def _rms(x, w, eps=1e-6):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(w, np.float64)


class T5Block(linen.Module):
    """The page's pieces in a linen module: RMSNorm, then attention with a relative
    position bias and `scale=1.0` (T5 attention)."""

    @linen.compact
    def __call__(self, x, bias):
        h = RMSNorm(dim=DIM)(x)
        q, k, v = (linen.Dense(DIM, use_bias=False, name=n)(h).reshape(B, S, H, D)
                   for n in ("q", "k", "v"))
        return dot_product_attention(q, k, v, bias=bias, scale=1.0).reshape(B, S, DIM)


def test_linen_program_from_the_page():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, S, DIM)).astype(np.float32)
    bias = rng.standard_normal((1, H, S, S)).astype(np.float32)
    block = T5Block()
    params = block.init(jax.random.key(0), x, bias)
    out = jax.jit(block.apply)(params, x, bias)
    p = jax.tree.map(np.asarray, params["params"])
    h = _rms(x, p["RMSNorm_0"]["scale"])
    q, k, v = (np.einsum("bsi,io->bso", h, p[n]["kernel"]).reshape(B, S, H, D) for n in "qkv")
    ref = oracle.attention(q, k, v, bias=bias, scale=1.0)
    oracle.assert_close(np.asarray(out, np.float64), ref.out.reshape(B, S, DIM), np.float32, "out")


def test_sharded_program_from_the_page():
    """Ulysses over the `'sp'` axis of a `build_tpu_mesh` mesh, with the sequence chunked by
    `chunk_by_rank`, and `TPShardedRMSNorm` initialised and applied inside `shard_map`."""
    sp, tp = 4, 2
    mesh = core.build_tpu_mesh(sp=sp, tp=tp)
    assert dict(mesh.shape) == {"dp": 1, "sp": sp, "tp": tp}
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((B, S, H, D)).astype(np.float32) for _ in range(3))
    x = rng.standard_normal((B, S, DIM)).astype(np.float32)
    norm = TPShardedRMSNorm(dim_local=DIM // tp, global_dim=DIM)

    def per_device(q, k, v, x):
        rank = jax.lax.axis_index("sp")
        q, k, v = (chunk_by_rank(a, 1, sp, rank) for a in (q, k, v))
        attn = sequence_parallel_self_attention(q, k, v, "sp")
        params = norm.init(jax.random.key(0), x)
        return attn, norm.apply(params, x)

    attn, normed = jax.jit(jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(), P(), P(), P(None, None, "tp")),
        out_specs=(P(None, "sp"), P(None, None, "tp")), check_vma=False))(q, k, v, x)
    oracle.assert_close(np.asarray(attn, np.float64), oracle.attention(q, k, v).out, np.float32, "attn")
    oracle.assert_close(np.asarray(normed, np.float64), _rms(x, np.ones(DIM)), np.float32, "norm")


def test_the_pages_import_paths():
    from vidax_eqx.core.attention import (  # noqa: F401  (the page's second import path)
        chunk_by_rank, dot_product_attention, local_attention, RMSNorm,
        sequence_parallel_joint_self_attention, sequence_parallel_self_attention, TPShardedRMSNorm,
    )

    assert importlib.import_module("vidax_eqx.core.attention").RMSNorm is core.RMSNorm is nn.RMSNorm
    assert core.shard_wan_params(nn.RMSNorm(4), core.build_tpu_mesh()).weight.shape == (4,)


@pytest.mark.parametrize("cls, args", [(core.RMSNorm, (64,)), (core.TPShardedRMSNorm, (32, 64))])
@pytest.mark.parametrize("method", ["init", "apply"])
def test_linen_method_on_the_equinox_norm_names_the_linen_class(cls, args, method):
    name = cls.__name__
    with pytest.raises(AttributeError, match=rf"'{name}' object has no attribute '{method}': "
                                             rf"vidax_eqx\.nn\.{name} .* is vidax_eqx\.flax\.{name}\."):
        getattr(cls(*args), method)
    with pytest.raises(AttributeError, match=r"^'RMSNorm' object has no attribute 'nope'$"):
        core.RMSNorm(4).nope  # noqa: B018  (any other name: the usual error)


def test_tp_sharded_init_outside_shard_map_says_what_to_do():
    norm = TPShardedRMSNorm(dim_local=16, global_dim=64)
    with pytest.raises(ValueError, match=r"TPShardedRMSNorm\(dim_local=16, global_dim=64\)\.init: the "
                                         r"mesh axis 'tp' does not exist in the current context\. Call \.init and \.apply "
                                         r"inside jax\.shard_map.*\{'params': \{'scale': jnp\.ones\(\(16,\)\)\}\}"):
        norm.init(jax.random.key(0), jnp.ones((2, 16)))
    with pytest.raises(ValueError, match=r"\.apply: the mesh axis 'tp' does not exist"):
        norm.apply({"params": {"scale": jnp.ones(16)}}, jnp.ones((2, 16)))
