"""The DiT layers of `vidax_eqx.nn` that whole models are built from: `FeedForward`
(with Megatron TP), the timestep embedding, `ModulatedLayerNorm`, `PatchEmbedding` /
`unpatchify`, the I2V image branch of `CrossAttention`, and `gather_tokens`.

Each against a float64 NumPy re-derivation written here (forward, and gradients as
directional central differences), and the tensor-parallel `FeedForward` sharded on 8
simulated devices against one device.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import oracle
from oracle import f64
from vidax_eqx import nn


F32 = np.float32
_GELU_TANH = lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))  # noqa: E731
_ERF = np.vectorize(__import__("math").erf)
_ACT = {
    "gelu_tanh": _GELU_TANH,
    "gelu": lambda x: 0.5 * x * (1 + _ERF(x / np.sqrt(2))),
    "silu": lambda x: x / (1 + np.exp(-x)),
}


def ref_feed_forward(m, x):
    return oracle.linear(_ACT[m.activation](oracle.linear(x, m.fc1)), m.fc2)


@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu", "silu"])
def test_feed_forward_matches_reference(activation):
    m = harness.perturbed(nn.FeedForward(12, 20, 8, activation=activation, key=jax.random.key(0)), 1)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 12)).astype(F32)
    ct = rng.standard_normal((5, 8)).astype(F32)

    def loss(mx):
        out = mx[0](mx[1])
        return jnp.sum(out * ct), out

    (_, out), (gm, gx) = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))((m, x))
    oracle.assert_close(out, ref_feed_forward(m, f64(x)), F32, "out")

    def ref_loss(a):
        return float(np.sum(ref_feed_forward(harness.with_arrays(m, a[:-1]), a[-1]) * ct))

    harness.check_grads_fd(ref_loss, [*harness.arrays(m), x], [*harness.arrays(gm), gx],
                           [*harness.leaf_names(m), "x"], seed=3)


def test_feed_forward_tensor_parallel_equals_single_device():
    dim, hidden, S = 16, 32, 8
    m = harness.perturbed(nn.FeedForward(dim, hidden, key=jax.random.key(0)), 1)
    x = jax.random.normal(jax.random.key(1), (2, S, dim))
    ct = jax.random.normal(jax.random.key(2), (2, S, dim))

    def loss(mx):
        return jnp.sum(jax.vmap(mx[0])(mx[1]) * ct)

    ref, (g_ref_m, g_ref_x) = eqx.filter_jit(eqx.filter_value_and_grad(loss))((m, x))
    mesh = harness.mesh(sp=2, tp=4)
    tp = nn.sharding.with_parallel(m, nn.sharding.ParallelConfig(sequence="ulysses", tp_axis="tp"))
    specs = nn.sharding.partition_specs(tp)
    assert specs.fc1.weight == P("tp", None) and specs.fc1.bias == P("tp")
    assert specs.fc2.weight == P(None, "tp") and specs.fc2.bias == P()
    run = nn.sharding.filter_shard_map(lambda m, x: jax.vmap(m)(x), mesh=mesh,
                              in_specs=(specs, P(None, "sp")), out_specs=P(None, "sp"))

    def sharded_loss(mx):
        return jnp.sum(run(*mx) * ct)

    got, (g_m, g_x) = eqx.filter_jit(eqx.filter_value_and_grad(sharded_loss))((tp, x))
    oracle.assert_close(got, ref, F32, "loss")
    oracle.assert_close(g_x, g_ref_x, F32, "dx")
    for name, a, b in zip(harness.leaf_names(m), harness.arrays(g_m), harness.arrays(g_ref_m)):
        oracle.assert_close(a, b, F32, name)


def test_feed_forward_placed_for_tp_without_tp_axis_raises():
    m = nn.FeedForward(8, 16, parallel=nn.sharding.ParallelConfig(tp_axis="tp"), key=jax.random.key(0))
    mesh = harness.mesh(tp=2)
    plain = nn.sharding.with_parallel(m, nn.sharding.ParallelConfig())  # specs of the TP twin, config without
    run = nn.sharding.filter_shard_map(lambda m, x: m(x), mesh=mesh,
                              in_specs=(nn.sharding.partition_specs(m), P()), out_specs=P())
    with pytest.raises(ValueError, match="rows of fc1"):
        eqx.filter_jit(run)(plain, jnp.ones((3, 8)))
    with pytest.raises(ValueError, match="activation"):
        nn.FeedForward(8, 16, activation="relu6", key=jax.random.key(0))


def ref_timestep_embedding(t, dim, flip=True, shift=0.0):
    half = dim // 2
    freqs = np.exp(-np.log(10000.0) * np.arange(half) / (half - shift))
    args = np.asarray(t, np.float64)[..., None] * freqs
    parts = [np.cos(args), np.sin(args)] if flip else [np.sin(args), np.cos(args)]
    if dim % 2:
        parts.append(np.zeros((*args.shape[:-1], 1)))
    return np.concatenate(parts, -1)


@pytest.mark.parametrize("dim,flip,shift", [(32, True, 0.0), (17, False, 1.0)])
def test_timestep_embedding(dim, flip, shift):
    t = np.array([0.0, 1.0, 137.0, 999.0], F32)
    got = nn.functional.timestep_embedding(jnp.asarray(t), dim, flip_sin_to_cos=flip,
                                           downscale_freq_shift=shift)
    assert got.shape == (4, dim) and got.dtype == jnp.float32
    # float32 arguments of sin/cos up to 1000 rad: absolute error ~ 1000 * 2**-24
    np.testing.assert_allclose(got, ref_timestep_embedding(t, dim, flip, shift), atol=1e-4)
    m = harness.perturbed(nn.TimestepEmbedding(dim, 24, key=jax.random.key(0)), 1)
    emb = ref_timestep_embedding(t, dim, flip, shift)
    ref = oracle.linear(_ACT["silu"](oracle.linear(emb, m.linear_1)), m.linear_2)
    if flip and not shift:
        oracle.assert_close(jax.vmap(m)(jnp.asarray(t)), ref, F32, "TimestepEmbedding", factor=10)
    assert m(jnp.asarray(3)).shape == (24,)  # integer timesteps


@pytest.mark.parametrize("affine", [False, True])
def test_modulated_layer_norm(affine):
    rng = np.random.default_rng(0)
    m = nn.ModulatedLayerNorm(16, 1e-6, elementwise_affine=affine)
    if affine:
        m = harness.perturbed(m, 1)
    x = jnp.asarray(rng.standard_normal((6, 16)), F32)
    shift, scale = jnp.asarray(rng.standard_normal((2, 16)), F32)
    y = oracle.layer_norm(x, m.weight, m.bias, 1e-6)  # no affine part: weight, bias None
    ref = y * (1 + f64(scale)) + f64(shift)
    oracle.assert_close(m(x, shift, scale), ref, F32, "out")
    half = m(jnp.asarray(x, jnp.bfloat16), shift, scale)
    assert half.dtype == jnp.float32  # the modulation stays float32, as Wan's autocast


def test_patch_embedding_and_unpatchify():
    C, dim, patch = 3, 8, (2, 2, 3)
    m = nn.PatchEmbedding(C, dim, patch, key=jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((C, 4, 6, 9)), F32)
    # Conv3d with kernel == stride, written as the sum over the kernel window
    w, b = f64(m.weight), f64(m.bias)
    grid = (2, 3, 3)
    ref = np.zeros((*grid, dim))
    for f in range(grid[0]):
        for h in range(grid[1]):
            for ww in range(grid[2]):
                window = f64(x)[:, 2 * f:2 * f + 2, 2 * h:2 * h + 2, 3 * ww:3 * ww + 3]
                ref[f, h, ww] = np.einsum("cijk,ocijk->o", window, w) + b
    oracle.assert_close(m(x), ref.reshape(-1, dim), F32, "tokens")
    # unpatchify is the inverse of the (pt, ph, pw, C) patch order
    tokens = f64(x).reshape(C, 2, 2, 3, 2, 3, 3).transpose(1, 3, 5, 2, 4, 6, 0).reshape(18, -1)
    np.testing.assert_array_equal(nn.functional.unpatchify(jnp.asarray(tokens, F32), grid, patch),
                                  np.asarray(x))
    with pytest.raises(ValueError, match="multiples of patch_size"):
        m(x[:, :3])


def test_cross_attention_image_branch_matches_reference():
    S, T, I, dim, H = 6, 5, 4, 16, 4
    m = harness.perturbed(nn.CrossAttention(dim, H, image_context_dim=12, key=jax.random.key(0)), 1)
    rng = np.random.default_rng(2)
    x, ctx, img = (jnp.asarray(rng.standard_normal(s), F32) for s in ((S, dim), (T, dim), (I, 12)))
    out = m(x, ctx, context_image=img)
    # Wan's WanI2VCrossAttention: the same queries attend to the text and to the image
    q = oracle.rms_norm(oracle.linear(f64(x), m.q), m.norm_q.weight, m.eps).reshape(S, H, -1)
    k_img = oracle.rms_norm(oracle.linear(f64(img), m.k_img), m.norm_k_img.weight, m.eps)
    v_img = oracle.linear(f64(img), m.v_img)
    image = oracle.example_attention(q, k_img.reshape(I, H, -1), v_img.reshape(I, H, -1))
    image = image.reshape(S, dim)
    ref = oracle.wan_cross_attention(m, f64(x), f64(ctx)) + image @ f64(m.o.weight).T
    oracle.assert_close(out, ref, F32, "out")
    specs = nn.sharding.partition_specs(nn.sharding.with_parallel(m, nn.sharding.ParallelConfig(tp_axis="tp")))
    assert specs.k_img.weight == P("tp", None) and specs.norm_k_img.weight == P("tp")
    with pytest.raises(ValueError, match="context_image"):
        m(x, ctx)


@pytest.mark.parametrize("config,mesh_axes", [
    (dict(sequence="ulysses"), dict(sp=8)),
    (dict(sequence="ring", layout="zigzag"), dict(sp=4, tp=2)),
    (dict(sequence="usp", ring_axis="ring"), dict(sp=2, ring=4)),
    (dict(sequence="usp", ring_axis="ring", layout="zigzag"), dict(sp=4, ring=2)),
])
def test_gather_tokens_inverts_shard_tokens(config, mesh_axes):
    parallel_config = nn.sharding.ParallelConfig(**config)
    mesh = harness.mesh(**mesh_axes)
    x = jax.random.normal(jax.random.key(0), (32, 3))
    ct = jax.random.normal(jax.random.key(1), (32, 3))

    def round_trip(x):
        def per_device(x):
            local = nn.sharding.shard_tokens(x, parallel_config) * 2.0
            return nn.sharding.gather_tokens(local, parallel_config)

        return jax.shard_map(per_device, mesh=mesh, in_specs=P(), out_specs=P())(x)

    np.testing.assert_array_equal(jax.jit(round_trip)(x), 2 * x)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(round_trip(x) * ct)))(x)
    np.testing.assert_allclose(grad, 2 * ct, rtol=1e-6)
