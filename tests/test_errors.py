"""Invalid requests raise `ValueError` / `TypeError` naming the argument and what was
received; a valid request an explicitly named implementation cannot serve raises
`NotImplementedError` naming the implementation and the feature.

Validation happens before anything is traced or compiled, so these tests are fast.
Every check runs through all four public entry points.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
from vidax_eqx import kernels


B, S_q, S_k, H, H_kv, D = 2, 7, 5, 4, 2, 8


def _qkv(q_shape=(B, S_q, H, D), k_shape=(B, S_k, H_kv, D), v_shape=None, dtype=jnp.float32,
         k_dtype=None):
    rng = np.random.default_rng(0)
    q = jnp.asarray(harness.normal(rng, q_shape), dtype)
    k = jnp.asarray(harness.normal(rng, k_shape), k_dtype or dtype)
    v = jnp.asarray(harness.normal(rng, v_shape or k_shape), k_dtype or dtype)
    return q, k, v


def _call_attention(q, k, v, **kw):
    return kernels.attention(q, k, v, **kw)


def _call_fwd(q, k, v, **kw):
    return kernels.attention_fwd(q, k, v, **kw)


def _call_bwd(q, k, v, **kw):
    shape = tuple(np.shape(q))
    out = jnp.ones(shape, jnp.float32)
    lse = jnp.zeros((shape[0], shape[2], shape[1]) if len(shape) == 4 else (1,), jnp.float32)
    return kernels.attention_bwd(q, k, v, out, lse, out, **kw)


def _call_select(q, k, v, **kw):
    return kernels.select_implementation(q, k, v, **kw)


ENTRY_POINTS = [
    pytest.param(_call_attention, id="attention"),
    pytest.param(_call_fwd, id="attention_fwd"),
    pytest.param(_call_bwd, id="attention_bwd"),
    pytest.param(_call_select, id="select_implementation"),
]
entry_points = pytest.mark.parametrize("call", ENTRY_POINTS)


# -- q, k, v ------------------------------------------------------------------------------


@entry_points
@pytest.mark.parametrize(
    "which, shapes",
    [
        ("q", dict(q_shape=(B, S_q, H * D))),
        ("q", dict(q_shape=(B, S_q, H, D, 1))),
        ("k", dict(k_shape=(B, S_k, D), v_shape=(B, S_k, D))),
        ("v", dict(v_shape=(B, S_k * H_kv * D))),
    ],
    ids=["q_rank3", "q_rank5", "k_rank3", "v_rank2"],
)
def test_wrong_rank(call, which, shapes):
    q, k, v = _qkv(**shapes)
    bad = {"q": q, "k": k, "v": v}[which]
    with pytest.raises(ValueError, match=rf"`{which}` must have rank 4.*{harness.shape_re(bad.shape)}"):
        call(q, k, v)


@entry_points
def test_head_dim_mismatch(call):
    q, k, v = _qkv(k_shape=(B, S_k, H_kv, D + 1))
    with pytest.raises(ValueError, match=rf"head_dim.*{harness.shape_re(q.shape)}.*{harness.shape_re(k.shape)}"):
        call(q, k, v)


@entry_points
def test_k_v_shape_mismatch(call):
    q, k, v = _qkv(v_shape=(B, S_k + 1, H_kv, D))
    with pytest.raises(ValueError, match=rf"`k` and `v`.*{harness.shape_re(k.shape)}.*{harness.shape_re(v.shape)}"):
        call(q, k, v)


@entry_points
def test_batch_mismatch(call):
    q, k, v = _qkv(k_shape=(B + 1, S_k, H_kv, D))
    with pytest.raises(ValueError, match=rf"batch.*{harness.shape_re(q.shape)}.*{harness.shape_re(k.shape)}"):
        call(q, k, v)


@entry_points
def test_heads_not_divisible(call):
    q, k, v = _qkv(k_shape=(B, S_k, 3, D))
    with pytest.raises(ValueError, match=rf"multiple.*heads.*H=4.*{harness.shape_re(k.shape)}.*H_kv=3"):
        call(q, k, v)


@entry_points
def test_integer_q(call):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"`q` must have a floating dtype.*int32"):
        call(q.astype(jnp.int32), k, v)


@entry_points
def test_dtype_mismatch(call):
    q, k, v = _qkv(k_dtype=jnp.bfloat16)
    with pytest.raises(TypeError, match=r"`q`, `k` and `v` must share one dtype.*q: float32, k: bfloat16"):
        call(q, k, v)


@entry_points
def test_empty_sequence(call):
    q, k, v = _qkv(k_shape=(B, 0, H_kv, D))
    with pytest.raises(ValueError, match=r"non-empty"):
        call(q, k, v)


# -- bias and mask --------------------------------------------------------------------------


@entry_points
@pytest.mark.parametrize("name", ["bias", "mask"])
@pytest.mark.parametrize(
    "shape",
    [(B, H, S_q, S_k + 1), (3, 1, 1, S_k), (1, H_kv, S_q, S_k), (S_q + 1, S_k), (1, B, H, S_q, S_k), (S_q,)],
    ids=["S_k+1", "B=3", "H_kv_heads", "rank2_S_q+1", "rank5", "rank1_S_q"],
)
def test_bias_mask_not_broadcastable(call, name, shape):
    q, k, v = _qkv()
    x = jnp.ones(shape, jnp.float32 if name == "bias" else jnp.bool_)
    with pytest.raises(ValueError, match=rf"`{name}` must broadcast to \(B, H, S_q, S_k\).*received shape"):
        call(q, k, v, **{name: x})


@entry_points
def test_mask_not_bool(call):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"`mask` must be boolean.*float32"):
        call(q, k, v, mask=jnp.ones((S_q, S_k), jnp.float32))
    with pytest.raises(TypeError, match=r"`mask` must be boolean.*int32"):
        call(q, k, v, mask=jnp.ones((S_q, S_k), jnp.int32))


@entry_points
def test_bias_not_float(call):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"`bias` must have a floating dtype.*bool"):
        call(q, k, v, bias=jnp.ones((S_q, S_k), bool))


# -- segment ids, sinks, positions --------------------------------------------------------------


@entry_points
def test_segment_ids_errors(call):
    q, k, v = _qkv()
    seg = kernels.SegmentIds
    with pytest.raises(ValueError, match=rf"`segment_ids.q` must have shape.*{harness.shape_re((B, S_q + 1))}"):
        call(q, k, v, segment_ids=seg(jnp.zeros((B, S_q + 1), jnp.int32), jnp.zeros((B, S_k), jnp.int32)))
    with pytest.raises(ValueError, match=rf"`segment_ids.kv` must have shape.*{harness.shape_re((S_k,))}"):
        call(q, k, v, segment_ids=seg(jnp.zeros((B, S_q), jnp.int32), jnp.zeros((S_k,), jnp.int32)))
    with pytest.raises(TypeError, match=r"`segment_ids.q` must have an integer dtype.*float32"):
        call(q, k, v, segment_ids=seg(jnp.zeros((B, S_q), jnp.float32), jnp.zeros((B, S_k), jnp.int32)))
    # One array for both sides needs S_q == S_k.
    with pytest.raises(ValueError, match=rf"single `segment_ids` array needs S_q == S_k.*S_q={S_q}, S_k={S_k}"):
        call(q, k, v, segment_ids=jnp.zeros((B, S_q), jnp.int32))
    q2, k2, v2 = _qkv(k_shape=(B, S_q, H_kv, D))
    with pytest.raises(ValueError, match=rf"`segment_ids` must have shape.*{harness.shape_re((B + 1, S_q))}"):
        call(q2, k2, v2, segment_ids=jnp.zeros((B + 1, S_q), jnp.int32))
    with pytest.raises(TypeError, match=r"`segment_ids` must have an integer dtype.*float32"):
        call(q2, k2, v2, segment_ids=jnp.zeros((B, S_q), jnp.float32))


@entry_points
@pytest.mark.parametrize("shape", [(H_kv,), (1, H), (H + 1,), ()], ids=str)
def test_sinks_wrong_shape(call, shape):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"`sinks` must have shape \(H,\) = \({H},\).*{harness.shape_re(shape)}"):
        call(q, k, v, sinks=jnp.ones(shape, jnp.float32))


@entry_points
def test_sinks_not_float(call):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"`sinks` must have a floating dtype"):
        call(q, k, v, sinks=jnp.ones((H,), jnp.int32))


@entry_points
def test_positions_errors(call):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"`q_positions` must have shape \({S_q},\).*{harness.shape_re((S_q + 1,))}"):
        call(q, k, v, q_positions=jnp.arange(S_q + 1))
    with pytest.raises(ValueError, match=rf"`kv_positions` must have shape \({S_k},\).*{harness.shape_re((1, S_k))}"):
        call(q, k, v, kv_positions=jnp.arange(S_k)[None])
    with pytest.raises(TypeError, match=r"`q_positions` must have an integer dtype.*float32"):
        call(q, k, v, q_positions=jnp.arange(S_q, dtype=jnp.float32), kv_positions=jnp.arange(S_k))


# -- static options ---------------------------------------------------------------------------


@entry_points
@pytest.mark.parametrize(
    "window, pattern",
    [
        ((-1, 2), r"`window` left size must be >= 0.*-1"),
        ((2, -3), r"`window` right size must be >= 0.*-3"),
        ((1, 2, 3), r"`window` must be a pair.*\(1, 2, 3\)"),
        ((4,), r"`window` must be a pair.*\(4,\)"),
        (3, r"`window` must be a pair.*3"),
        ((1.5, 2), r"`window` left size must be a non-negative int or None.*1\.5"),
        ((1, 2.0), r"`window` right size must be a non-negative int or None.*2\.0"),
        ((True, 2), r"`window` left size must be a non-negative int or None.*True"),
    ],
    ids=["neg_left", "neg_right", "len3", "len1", "int", "float_left", "float_right", "bool"],
)
def test_bad_window(call, window, pattern):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=pattern):
        call(q, k, v, window=window)


@entry_points
@pytest.mark.parametrize("cap", [0.0, -1.0, 0])
def test_non_positive_soft_cap(call, cap):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"`logits_soft_cap` must be > 0.*{float(cap)}"):
        call(q, k, v, logits_soft_cap=cap)


@entry_points
def test_non_finite_scale(call):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"`scale` must be finite.*inf"):
        call(q, k, v, scale=float("inf"))


@entry_points
def test_causal_not_bool(call):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"`causal` must be a bool.*1"):
        call(q, k, v, causal=1)


@entry_points
@pytest.mark.parametrize("name", ["flash", "XLA", ""])
def test_unknown_implementation(call, name):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"`implementation` must be 'auto', 'portable', one of .*'blockwise'.*'xla'.*received '{name}'"):
        call(q, k, v, implementation=name)


@pytest.mark.parametrize("name", ["scale", "logits_soft_cap"])
def test_traced_static_float(name):
    q, k, v = _qkv()

    def f(x):
        return kernels.attention(q, k, v, **{name: x})

    with pytest.raises(TypeError, match=rf"`{name}` must be a concrete Python number.*traced"):
        jax.jit(f)(1.0)
    # A concrete value works, also under jit when it is static.
    jax.jit(f, static_argnums=0)(1.0)


def test_attention_bwd_residual_shapes():
    q, k, v = _qkv()
    out, lse = kernels.attention_fwd(q, k, v)
    dout = jnp.ones_like(out)
    bad_lse = lse[:, :, :-1]
    with pytest.raises(ValueError, match=rf"`lse` must have shape {harness.shape_re(lse.shape)}.*{harness.shape_re(bad_lse.shape)}"):
        kernels.attention_bwd(q, k, v, out, bad_lse, dout)
    with pytest.raises(ValueError, match=rf"`out` must have shape.*{harness.shape_re(out[:1].shape)}"):
        kernels.attention_bwd(q, k, v, out[:1], lse, dout)
    with pytest.raises(ValueError, match=rf"`dout` must have shape.*{harness.shape_re(out[..., :1].shape)}"):
        kernels.attention_bwd(q, k, v, out, lse, dout[..., :1])
    with pytest.raises(ValueError, match=rf"`dlse` must have shape.*{harness.shape_re(lse[0].shape)}"):
        kernels.attention_bwd(q, k, v, out, lse, dout, dlse=lse[0])


@pytest.mark.parametrize("field", ["block_q", "block_kv"])
@pytest.mark.parametrize("value", [0, -16, 16.0])
def test_blockwise_block_sizes(field, value):
    with pytest.raises(ValueError, match=rf"`{field}` must be a positive int.*{value}"):
        kernels.Blockwise(**{field: value})


# -- an implementation that cannot serve a request ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Limited(kernels.AbstractImplementation):
    """A test-only implementation that serves float32 without sinks or windows (it
    delegates the math to the reference)."""

    name = "limited_for_tests"
    capabilities = kernels.Capabilities(platforms=("cpu", "gpu", "tpu"), dtypes=("float32",), sinks=False,
                                        window=False, max_head_dim=8)

    def fwd(self, ops, opts):
        return kernels.Xla().fwd(ops, opts)

    def bwd(self, ops, opts, out, lse, dout, dlse):
        return kernels.Xla().bwd(ops, opts, out, lse, dout, dlse)


@entry_points
def test_named_implementation_that_cannot_serve_raises(call):
    q, k, v = _qkv()
    impl = _Limited()
    with pytest.raises(NotImplementedError, match=r"'limited_for_tests' does not support: attention sinks"):
        call(q, k, v, sinks=jnp.zeros((H,)), implementation=impl)
    with pytest.raises(NotImplementedError, match=r"'limited_for_tests' does not support: sliding window"):
        call(q, k, v, window=(1, 1), implementation=impl)
    with pytest.raises(NotImplementedError, match=r"'limited_for_tests' does not support: dtype bfloat16"):
        call(*(x.astype(jnp.bfloat16) for x in (q, k, v)), implementation=impl)
    q16, k16, v16 = _qkv(q_shape=(B, S_q, H, 16), k_shape=(B, S_k, H_kv, 16))
    with pytest.raises(NotImplementedError, match=r"'limited_for_tests' does not support: head_dim 16 > 8"):
        call(q16, k16, v16, implementation=impl)


def test_limited_implementation_serves_what_it_can():
    q, k, v = _qkv()
    out = kernels.attention(q, k, v, causal=True, implementation=_Limited())
    ref = kernels.attention(q, k, v, causal=True, implementation="xla")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    assert kernels.select_implementation(q, k, v, implementation=_Limited()) == "limited_for_tests"
