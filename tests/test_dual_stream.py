"""`nn.DualStreamAttention` (HunyuanVideo / MMDiT joint attention), and key-only padding
(`kv_length` / `context_length`) through `nn.Attention`, `nn.CrossAttention`,
`nn.JointAttention`.

1. One device against a float64 NumPy re-derivation of diffusers'
   `HunyuanVideoAttnProcessor2_0` written here (`dual_stream_reference`): separate
   video / text projections, per-head RMSNorm over head_dim, RoPE on the video tokens
   only, one softmax over `[video; text]` with the padded text keys masked, separate
   output projections. Output, and gradients with respect to every parameter and
   input (a random cotangent) as directional central differences of the reference.
   Padded text rows holding NaN do not reach the real outputs.
2. Sharded on 8 simulated devices (Ulysses, ring, USP, with tensor parallelism, and
   FSDP on one path), padded text: equal to one device, output and gradients; the
   text output leaves `shard_map` with a replicated out_spec.
3. Key-only padding in `Attention`, `CrossAttention` and `JointAttention` against the
   reference modules of `oracle` with the padded keys masked (every query computed).
4. Bad input raises, naming the argument.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jaxtyping import TypeCheckError

import harness
import oracle
from vidax_eqx import nn, parallel


F32 = np.float32
SP, TP, DP, RING = parallel.SP_AXIS, parallel.TP_AXIS, parallel.DP_AXIS, "ring"
B, S, T, DIM, CDIM, H = 2, 16, 6, 64, 24, 8  # head_dim 8
LENGTHS = np.array([4, 6], np.int32)  # the second example's text is not padded


# -- the float64 reference ---------------------------------------------------------------


def dual_stream_reference(m, x, context, rope_tables=None, length=None):
    """diffusers' `HunyuanVideoAttnProcessor2_0.__call__` (with `add_q_proj`) for one
    example in float64: `(x_out (S, dim), context_out (T, dim))`. `length`: the text
    tokens at index >= length are masked as keys (HunyuanVideo's attention mask)."""
    S_, T_, Hh, D = x.shape[0], context.shape[0], m.num_heads, m.head_dim

    def heads(lin, norm, tokens):
        y = oracle.linear(tokens, lin).reshape(tokens.shape[0], Hh, D)
        return y if norm is None else oracle.rms_norm(y, norm.weight, m.eps)

    q, k, v = heads(m.to_q, m.norm_q, x), heads(m.to_k, m.norm_k, x), heads(m.to_v, None, x)
    if rope_tables is not None:
        q, k = oracle.rope(q, *rope_tables), oracle.rope(k, *rope_tables)
    q_t = heads(m.add_q_proj, m.norm_added_q, context)
    k_t = heads(m.add_k_proj, m.norm_added_k, context)
    v_t = heads(m.add_v_proj, None, context)
    q, k, v = (np.concatenate(p) for p in ((q, q_t), (k, k_t), (v, v_t)))  # [video; text]
    visible = np.ones(S_ + T_, bool)
    if length is not None:
        visible[S_ + int(length):] = False
    s = np.einsum("ihd,jhd->hij", q, np.where(visible[:, None, None], k, 0.0)) / np.sqrt(D)
    s = np.where(visible[None, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("hij,jhd->ihd", p, np.where(visible[:, None, None], v, 0.0))
    out = out.reshape(S_ + T_, Hh * D)
    return oracle.linear(out[:S_], m.to_out), oracle.linear(out[S_:], m.to_add_out)


def rope_tables(seed):
    angles = np.random.default_rng(seed).uniform(-np.pi, np.pi, (S, DIM // H // 2))
    return (np.cos(angles), np.sin(angles)), (jnp.asarray(np.cos(angles), F32),
                                              jnp.asarray(np.sin(angles), F32))


def inputs(seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, S, DIM)).astype(F32),
            rng.standard_normal((B, T, CDIM)).astype(F32),
            rng.standard_normal((B, S, DIM)).astype(F32),
            rng.standard_normal((B, T, DIM)).astype(F32))


@pytest.fixture(scope="module")
def single():
    return harness.perturbed(nn.DualStreamAttention(DIM, H, context_dim=CDIM,
                                                    key=jax.random.key(0)), 1)


def call(m, x, c, cos, sin, lengths):
    return jax.vmap(lambda x, c, n: m(x, c, rope=(cos, sin), context_length=n))(x, c, lengths)


@eqx.filter_jit
def value_and_grad(m, x, c, ct_x, ct_c, cos, sin, lengths):
    def loss(mxc):
        xo, co = call(*mxc, cos, sin, lengths)
        return jnp.sum(xo * ct_x) + jnp.sum(co * ct_c), (xo, co)

    return eqx.filter_value_and_grad(loss, has_aux=True)((m, x, c))


# -- 1. one device against the reference ------------------------------------------------


def test_dual_stream_matches_reference(single):
    m = single
    x, c, ct_x, ct_c = inputs(2)
    tables, rope = rope_tables(3)
    lengths = jnp.asarray(LENGTHS)
    (_, (xo, co)), (gm, gx, gc) = value_and_grad(m, x, c, ct_x, ct_c, *rope, lengths)

    def ref(mm, xx, cc):
        outs = [dual_stream_reference(mm, xx[b], cc[b], tables, LENGTHS[b]) for b in range(B)]
        return np.stack([o[0] for o in outs]), np.stack([o[1] for o in outs])

    rx, rc = ref(m, x, c)
    oracle.assert_close(xo, rx, F32, "x_out")
    oracle.assert_close(co, rc, F32, "context_out")  # padded text rows included

    def ref_loss(a):
        rx, rc = ref(harness.with_arrays(m, a[:-2]), a[-2], a[-1])
        return float(np.sum(rx * ct_x) + np.sum(rc * ct_c))

    harness.check_grads_fd(ref_loss, [*harness.arrays(m), x, c], [*harness.arrays(gm), gx, gc],
                           [*harness.leaf_names(m), "x", "context"], seed=4)
    # The padded text tokens are not keys: nothing flows back to their inputs through
    # the keys and values, only through their own queries.
    assert np.any(np.asarray(gc[0, LENGTHS[0]:]) != 0)


def test_padded_text_nan_does_not_leak(single):
    m = single
    x, c, ct_x, ct_c = inputs(2)
    tables, rope = rope_tables(3)
    c_nan = c.copy()
    c_nan[0, LENGTHS[0]:] = np.nan
    (_, (xo, co)), _ = value_and_grad(m, x, c_nan, ct_x, ct_c, *rope, jnp.asarray(LENGTHS))
    rx, rc = dual_stream_reference(m, x[0], c[0], tables, LENGTHS[0])
    oracle.assert_close(xo[0], rx, F32, "x_out")
    oracle.assert_close(co[0, :LENGTHS[0]], rc[:LENGTHS[0]], F32, "real text rows")
    assert np.all(np.isfinite(np.asarray(co[1])))


def test_dual_stream_without_qk_norm_or_padding():
    m = harness.perturbed(nn.DualStreamAttention(32, 4, qk_norm=None, key=jax.random.key(5)), 6)
    rng = np.random.default_rng(7)
    x, c = rng.standard_normal((9, 32)).astype(F32), rng.standard_normal((5, 32)).astype(F32)
    xo, co = eqx.filter_jit(lambda m, x, c: m(x, c))(m, x, c)
    rx, rc = dual_stream_reference(m, x, c)
    oracle.assert_close(xo, rx, F32, "x_out")
    oracle.assert_close(co, rc, F32, "context_out")


# -- 2. sharded == one device ------------------------------------------------------------


SHARDED_CASES = {
    "ulysses-sp4-tp2": ("ulysses", "contiguous", dict(sp=4, tp=2), ()),
    "ring-zigzag-sp4-tp2": ("ring", "zigzag", dict(sp=4, tp=2), ()),
    "usp-sp2-ring2-tp2": ("usp", "contiguous", dict(sp=2, ring=2, tp=2), ()),
    "ulysses-sp4-tp2-fsdp": ("ulysses", "contiguous", dict(sp=4, tp=2), (SP,)),
}


@pytest.mark.parametrize("case", list(SHARDED_CASES))
def test_dual_stream_sharded_equals_single_device(single, case):
    mode, layout, sizes, fsdp = SHARDED_CASES[case]
    cfg = nn.sharding.ParallelConfig(sequence=mode, layout=layout,
                            ring_axis=RING if mode == "usp" else None, tp_axis=TP,
                            fsdp_axes=fsdp)
    sharded = nn.sharding.with_parallel(single, cfg)
    mesh = harness.mesh(**sizes)
    x, c, ct_x, ct_c = inputs(8)
    _, rope = rope_tables(9)
    lengths = jnp.asarray(LENGTHS)

    def per_device(m, x, c, cos, sin, lengths):
        cos, sin, x = nn.sharding.shard_tokens((cos, sin, x), cfg, axis=0)
        x = jnp.swapaxes(x, 0, 1)
        xo, co = call(m, x, c, cos, sin, lengths)
        return nn.sharding.gather_tokens(xo, cfg, axis=1), co  # both whole and replicated

    f = nn.sharding.filter_shard_map(per_device, mesh=mesh,
                            in_specs=(nn.sharding.partition_specs(sharded, mesh), P(), P(), P(), P(), P()),
                            out_specs=(P(), P()))

    def sharded_call(m, x, c, cos, sin, lengths):
        return f(m, jnp.swapaxes(x, 0, 1), c, cos, sin, lengths)

    @eqx.filter_jit
    def sharded_value_and_grad(m, x, c):
        def loss(mxc):
            xo, co = sharded_call(*mxc, *rope, lengths)
            return jnp.sum(xo * ct_x) + jnp.sum(co * ct_c), (xo, co)

        return eqx.filter_value_and_grad(loss, has_aux=True)((m, x, c))

    placed = nn.sharding.shard_module(sharded, mesh)
    (_, (xo_s, co_s)), g_s = sharded_value_and_grad(placed, x, c)
    (_, (xo_1, co_1)), g_1 = value_and_grad(single, x, c, ct_x, ct_c, *rope, lengths)
    oracle.assert_close(xo_s, xo_1, F32, "x_out")
    oracle.assert_close(co_s, co_1, F32, "context_out")
    harness.assert_trees_close(g_s, g_1, F32, "grad")


# -- 3. key-only padding in Attention, CrossAttention, JointAttention ---------------------


def key_mask(n_q, n_k, length, offset=0):
    """`(n_q, n_k)`: keys at index `offset + length` and beyond (the first `offset` keys
    are never padding) hidden from every query."""
    visible = np.ones(n_k, bool)
    visible[offset + int(length):] = False
    return np.broadcast_to(visible, (n_q, n_k))


def wan_self_attention_padded(m, x, length):
    """Wan's self-attention (`oracle.wan_self_attention` without RoPE) with the keys at
    index >= length masked, every query computed."""
    S_, Hh, D = x.shape[0], m.num_heads, m.head_dim
    q = oracle.rms_norm(oracle.linear(x, m.q), m.norm_q.weight, m.eps).reshape(S_, Hh, D)
    k = oracle.rms_norm(oracle.linear(x, m.k), m.norm_k.weight, m.eps).reshape(S_, Hh, D)
    v = oracle.linear(x, m.v).reshape(S_, Hh, D)
    out = oracle.example_attention(q, k, v, mask=key_mask(S_, S_, length))
    return oracle.linear(out.reshape(S_, Hh * D), m.o)


def cogvideox_attention_padded(m, x, context, length):
    """diffusers' CogVideoX joint attention (`oracle.cogvideox_attention` without RoPE)
    over `[context; x]` with the text keys at index >= length masked."""
    T_, Hh, D = context.shape[0], m.num_heads, m.head_dim
    h = np.concatenate([oracle.f64(context), oracle.f64(x)])
    n = h.shape[0]
    q, k, v = (oracle.linear(h, lin).reshape(n, Hh, D) for lin in (m.to_q, m.to_k, m.to_v))
    q = oracle.layer_norm(q, m.norm_q.weight, m.norm_q.bias, m.eps)
    k = oracle.layer_norm(k, m.norm_k.weight, m.norm_k.bias, m.eps)
    visible = np.ones(n, bool)
    visible[int(length):T_] = False
    out = oracle.example_attention(q, k, v, mask=np.broadcast_to(visible, (n, n)))
    out = oracle.linear(out.reshape(n, Hh * D), m.to_out)
    return out[T_:], out[:T_]


def check_module_padding(m, keyword, args, lengths, ref, names, seed):
    """The batched `m(*args, keyword=length)` against `ref(m, *args_b, length_b)` (one or two
    outputs): output, and gradients of every parameter and input (random cotangent)
    against central differences of the reference."""
    rng = np.random.default_rng(seed)
    def apply(m, *a):
        return m(*a[:-1], **{keyword: a[-1]})

    outs = jax.eval_shape(lambda a, n: jax.vmap(lambda *a: apply(m, *a))(*a, n), args, lengths)
    cts = jax.tree.map(lambda o: rng.standard_normal(o.shape).astype(F32), outs)

    @eqx.filter_jit
    def run(m, args):
        def loss(ma):
            o = jax.vmap(lambda *a: apply(ma[0], *a))(*ma[1], jnp.asarray(lengths))
            return sum(jnp.sum(a * b) for a, b in zip(jax.tree.leaves(o), jax.tree.leaves(cts))), o
        return eqx.filter_value_and_grad(loss, has_aux=True)((m, args))

    (_, out), (gm, gargs) = run(m, args)

    def reference(mm, aa):
        per = [ref(mm, *(a[b] for a in aa), lengths[b]) for b in range(B)]
        return jax.tree.map(lambda *o: np.stack(o), *per)

    for got, want, name in zip(jax.tree.leaves(out), jax.tree.leaves(reference(m, args)), names):
        oracle.assert_close(got, want, F32, name)

    def ref_loss(a):
        n = len(harness.arrays(m))
        o = reference(harness.with_arrays(m, a[:n]), a[n:])
        return float(sum(np.sum(x * c) for x, c in zip(jax.tree.leaves(o), jax.tree.leaves(cts))))

    params, grads = [*harness.arrays(m), *args], [*harness.arrays(gm), *gargs]
    names = [*harness.leaf_names(m), *(f"input {i}" for i in range(len(args)))]
    # A bias added to every key of a head shifts each softmax row by a constant: its
    # exact gradient is 0, and the float32 one rounding noise (no relative check).
    zero = [i for i, n in enumerate(names) if n.endswith("norm_k.bias")]
    for i in zero:
        assert np.max(np.abs(np.asarray(grads[i]))) < 1e-4, names[i]

    def kept(a):
        return [x for i, x in enumerate(a) if i not in zero]

    def ref_loss_kept(a):
        full = list(params)
        for i, x in zip([i for i in range(len(params)) if i not in zero], a):
            full[i] = x
        return ref_loss(full)

    harness.check_grads_fd(ref_loss_kept, kept(params), kept(grads), kept(names), seed=seed + 1)


def test_attention_kv_length():
    m = harness.perturbed(nn.Attention(32, 4, key=jax.random.key(20)), 21)
    x = np.random.default_rng(22).standard_normal((B, 11, 32)).astype(F32)
    check_module_padding(
        m, "kv_length", (x,), np.array([7, 11], np.int32),
        lambda mm, x, n: wan_self_attention_padded(mm, x, n), ["out"], 23)


@pytest.mark.parametrize("mode,layout", [("ring", "zigzag"), ("ulysses", "contiguous")])
def test_attention_kv_length_sharded(mode, layout):
    """`kv_length` counts global indices in the unpermuted sequence, also under a
    zigzag ring: the sharded module equals the single-device one."""
    single = harness.perturbed(nn.Attention(32, 4, key=jax.random.key(24)), 25)
    cfg = nn.sharding.ParallelConfig(sequence=mode, layout=layout)
    sharded = nn.sharding.with_parallel(single, cfg)
    x = np.random.default_rng(26).standard_normal((B, 16, 32)).astype(F32)
    lengths = jnp.asarray(np.array([5, 13], np.int32))

    def call(m, x, n):
        return jax.vmap(lambda x, n: m(x, kv_length=n))(x, n)

    def per_device(m, x, n):
        x = jnp.swapaxes(nn.sharding.shard_tokens(jnp.swapaxes(x, 0, 1), cfg), 0, 1)
        return nn.sharding.gather_tokens(call(m, x, n), cfg, axis=1)

    f = nn.sharding.filter_shard_map(per_device, mesh=harness.mesh(sp=4),
                            in_specs=(nn.sharding.partition_specs(sharded), P(), P()), out_specs=P())
    got = eqx.filter_jit(f)(sharded, x, lengths)
    want = eqx.filter_jit(call)(single, x, lengths)
    oracle.assert_close(got, want, F32, "out")
    ref = np.stack([wan_self_attention_padded(single, x[b], lengths[b]) for b in range(B)])
    oracle.assert_close(got, ref, F32, "out vs reference")


def test_cross_attention_context_length():
    m = harness.perturbed(nn.CrossAttention(32, 4, context_dim=24, key=jax.random.key(30)), 31)
    rng = np.random.default_rng(32)
    x = rng.standard_normal((B, 9, 32)).astype(F32)
    c = rng.standard_normal((B, 7, 24)).astype(F32)
    lengths = np.array([3, 7], np.int32)

    def ref(mm, x, c, n):
        return oracle.wan_cross_attention(mm, x, c, context_mask=np.arange(7) < n)

    check_module_padding(m, "context_length", (x, c), lengths, ref, ["out"], 33)
    # NaN in the padded text rows does not reach the output.
    c_nan = c.copy()
    c_nan[0, 3:] = np.nan
    out = eqx.filter_jit(lambda m, x, c: m(x, c, context_length=3))(m, x[0], c_nan[0])
    oracle.assert_close(out, ref(m, x[0], c[0], 3), F32, "out with NaN padding")


def test_joint_attention_context_length():
    m = harness.perturbed(nn.JointAttention(32, 4, key=jax.random.key(40)), 41)
    rng = np.random.default_rng(42)
    x = rng.standard_normal((B, 9, 32)).astype(F32)
    c = rng.standard_normal((B, 5, 32)).astype(F32)
    check_module_padding(m, "context_length", (x, c), np.array([2, 5], np.int32),
                         cogvideox_attention_padded,
                         ["x_out", "context_out"], 43)


# -- 4. bad input ------------------------------------------------------------------------


def test_bad_input_raises(single):
    m = single
    x = jnp.zeros((S, DIM))
    c = jnp.zeros((T, CDIM))
    with pytest.raises(TypeCheckError, match="context"):
        m(x, jnp.zeros((T, DIM)))  # the text width is context_dim, not dim
    with pytest.raises(TypeCheckError, match="x"):
        m(jnp.zeros((S, CDIM)), c)
    with pytest.raises(ValueError, match="context_length.*shape \\(6,\\)"):
        m(x, c, context_length=jnp.ones((T,), jnp.int32))  # a mask is not a length
    with pytest.raises(ValueError, match="context_length.*float32"):
        m(x, c, context_length=jnp.float32(3))
    with pytest.raises(ValueError, match="context_length.*\\[0, 6\\].*received 7"):
        m(x, c, context_length=7)
    with pytest.raises(ValueError, match="context_length.*received -1"):
        m(x, c, context_length=-1)
    with pytest.raises(ValueError, match="qk_norm"):
        nn.DualStreamAttention(DIM, H, qk_norm="layer_norm", key=jax.random.key(0))
    a = nn.Attention(32, 4, key=jax.random.key(0))
    with pytest.raises(ValueError, match="kv_length.*received 13"):
        a(jnp.zeros((12, 32)), kv_length=13)
    cross = nn.CrossAttention(32, 4, key=jax.random.key(0))
    with pytest.raises(ValueError, match="context_length.*shape \\(2,\\)"):
        cross(jnp.zeros((5, 32)), jnp.zeros((4, 32)), context_length=jnp.array([1, 2]))


def test_partition_specs_dual_stream(single):
    cfg = nn.sharding.ParallelConfig(sequence="ulysses", tp_axis=TP)
    specs = nn.sharding.partition_specs(nn.sharding.with_parallel(single, cfg))
    for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
        assert getattr(specs, name).weight == P(TP, None), name
        assert getattr(specs, name).bias == P(TP), name
    for name in ("to_out", "to_add_out"):
        assert getattr(specs, name).weight == P(None, TP), name
        assert getattr(specs, name).bias == P(), name
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        assert getattr(specs, name).weight == P(), name


def test_core_dot_product_attention_kv_lengths():
    """`vidax_eqx.core.dot_product_attention(kv_lengths=)` (and so `vidax_eqx.flax`'s) on
    one device and on the Megatron path, against the float64 oracle with the padded
    keys masked, every query computed."""
    from vidax_eqx import core

    rng = np.random.default_rng(50)
    q, k, v = (rng.standard_normal((2, 9, 4, 8)).astype(F32) for _ in range(3))
    lengths = np.array([3, 9], np.int32)
    mask = np.arange(9)[None, None, None, :] < lengths[:, None, None, None]
    ref = oracle.attention(q, k, v, mask=mask).out
    one = core.dot_product_attention(q, k, v, kv_lengths=jnp.asarray(lengths))
    oracle.assert_close(one, ref, F32, "one device")
    tp = core.dot_product_attention(q, k, v, mesh=harness.mesh(tp=4),
                                    kv_lengths=jnp.asarray(lengths))
    oracle.assert_close(tp, ref, F32, "mesh")


def test_joint_attention_context_length_sharded():
    """JointAttention's text padding under a zigzag ring equals one device (forward)."""
    single = harness.perturbed(nn.JointAttention(32, 4, key=jax.random.key(60)), 61)
    cfg = nn.sharding.ParallelConfig(sequence="ring", layout="zigzag")
    sharded = nn.sharding.with_parallel(single, cfg)
    rng = np.random.default_rng(62)
    x = rng.standard_normal((B, 16, 32)).astype(F32)
    c = rng.standard_normal((B, 5, 32)).astype(F32)
    lengths = jnp.asarray(np.array([2, 5], np.int32))

    def call(m, x, c, n):
        return jax.vmap(lambda x, c, n: m(x, c, context_length=n))(x, c, n)

    def per_device(m, x, c, n):
        x = jnp.swapaxes(nn.sharding.shard_tokens(jnp.swapaxes(x, 0, 1), cfg), 0, 1)
        xo, co = call(m, x, c, n)
        return nn.sharding.gather_tokens(xo, cfg, axis=1), parallel.replicated(co, SP)

    f = nn.sharding.filter_shard_map(per_device, mesh=harness.mesh(sp=4),
                            in_specs=(nn.sharding.partition_specs(sharded), P(), P(), P()),
                            out_specs=(P(), P()))
    got = eqx.filter_jit(f)(sharded, x, c, lengths)
    want = eqx.filter_jit(call)(single, x, c, lengths)
    harness.assert_trees_close(got, want, F32, "sharded vs one device: ")
    ref = [cogvideox_attention_padded(single, x[b], c[b], lengths[b]) for b in range(B)]
    oracle.assert_close(got[0], np.stack([r[0] for r in ref]), F32, "x_out vs reference")
