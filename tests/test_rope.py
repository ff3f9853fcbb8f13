"""3D RoPE against a float64 NumPy re-implementation of Wan 2.1's complex formulation.

Wan (`wan/modules/model.py`) builds `freqs = cat([rope_params(1024, d - 4*(d//6)),
rope_params(1024, 2*(d//6)), rope_params(1024, 2*(d//6))], dim=1)` with
`rope_params(n, dim) = polar(1, outer(arange(n), 1 / theta ** (arange(0, dim, 2) / dim)))`,
and `rope_apply` splits the `c = d // 2` columns as `[c - 2*(c//3), c//3, c//3]`,
broadcasts them over the `(f, h, w)` grid, and multiplies
`view_as_complex(x.reshape(seq, n, -1, 2))` by them. The oracle below does the
same with NumPy complex128; it imports nothing from `vidax_eqx`.
"""

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

import harness
import oracle
from vidax_eqx.nn.functional import apply_rope, rope_3d


# ---------------------------------------------------------------------------- oracle


def _rope_params(max_seq_len, dim, theta=10000.0):
    assert dim % 2 == 0
    freqs = np.outer(
        np.arange(max_seq_len), 1.0 / np.power(theta, np.arange(0, dim, 2).astype(np.float64) / dim)
    )
    return np.ones_like(freqs) * np.exp(1j * freqs)  # torch.polar(ones, freqs)


def _wan_freqs(d, theta=10000.0, parts=None):
    """Wan's `freqs` table `(1024, d // 2)` complex128; `parts` are rope_params dims."""
    if parts is None:
        parts = (d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))
    return np.concatenate([_rope_params(1024, p, theta) for p in parts], axis=1)


def _wan_multipliers(grid, d, theta=10000.0, split=None):
    """The per-token complex multipliers `(seq, c)` of Wan's rope_apply."""
    c = d // 2
    if split is None:
        split = (c - 2 * (c // 3), c // 3, c // 3)
        freqs = _wan_freqs(d, theta)
    else:
        freqs = _wan_freqs(d, theta, parts=tuple(2 * s for s in split))
    f0, f1, f2 = np.split(freqs, np.cumsum(split)[:2], axis=1)
    f, h, w = grid
    mult = np.concatenate(
        [
            np.broadcast_to(f0[:f].reshape(f, 1, 1, -1), (f, h, w, split[0])),
            np.broadcast_to(f1[:h].reshape(1, h, 1, -1), (f, h, w, split[1])),
            np.broadcast_to(f2[:w].reshape(1, 1, w, -1), (f, h, w, split[2])),
        ],
        axis=-1,
    )
    return mult.reshape(f * h * w, c)


def _wan_rope_apply(x, mult):
    """x `(..., seq, n, d)` float64 times the multipliers, pairs `(2i, 2i+1)` as complex."""
    x = np.asarray(x, np.float64)
    xc = x.reshape(*x.shape[:-1], -1, 2)
    xc = xc[..., 0] + 1j * xc[..., 1]
    out = xc * mult[:, None, :]
    return np.stack([out.real, out.imag], axis=-1).reshape(x.shape)


# ---------------------------------------------------------------------------- tables


@pytest.mark.parametrize("head_dim", [10, 12, 14, 128])
def test_rope_3d_matches_wan_tables(head_dim):
    grid = (3, 4, 5)
    cos, sin = rope_3d(grid, head_dim)
    assert cos.shape == sin.shape == (60, head_dim // 2)
    assert cos.dtype == sin.dtype == jnp.float32
    mult = _wan_multipliers(grid, head_dim)
    np.testing.assert_allclose(np.asarray(cos), mult.real, rtol=0, atol=1e-7)
    np.testing.assert_allclose(np.asarray(sin), mult.imag, rtol=0, atol=1e-7)


def test_rope_3d_token_order_is_frame_height_width():
    """Token (f, h, w) sits at f*H*W + h*W + w; its time part depends on f only, and so on."""
    F, H, W = 2, 3, 4
    cos, _ = rope_3d((F, H, W), 12)  # split (2, 2, 2)
    cos = np.asarray(cos).reshape(F, H, W, 6)
    assert np.all(cos[0, ..., :2] == 1) and np.all(cos[:, 0, :, 2:4] == 1) and np.all(cos[..., 0, 4:] == 1)
    assert np.all(cos[1, ..., :2] == cos[1, 0, 0, :2])
    assert np.all(cos[:, 2, :, 2:4] == cos[0, 2, 0, 2:4])
    assert np.all(cos[..., 3, 4:] == cos[0, 0, 3, 4:])


def test_rope_3d_custom_split_and_theta():
    grid = (2, 3, 2)
    cos, sin = rope_3d(grid, 16, theta=500.0, split=(4, 2, 2))
    mult = _wan_multipliers(grid, 16, theta=500.0, split=(4, 2, 2))
    np.testing.assert_allclose(np.asarray(cos), mult.real, rtol=0, atol=1e-7)
    np.testing.assert_allclose(np.asarray(sin), mult.imag, rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(grid=(2, 3, 4), head_dim=11), "even"),
        (dict(grid=(2, 3, 4), head_dim=0), "even"),
        (dict(grid=(2, 3), head_dim=12), "three positive ints"),
        (dict(grid=(2, 0, 4), head_dim=12), "three positive ints"),
        (dict(grid=(2, 3, 4), head_dim=12, split=(2, 2, 3)), r"summing to head_dim // 2 = 6"),
        (dict(grid=(2, 3, 4), head_dim=12, split=(4, 4)), r"summing to head_dim // 2 = 6"),
    ],
)
def test_rope_3d_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rope_3d(**kwargs)


# ---------------------------------------------------------------------------- apply_rope


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_apply_rope_matches_complex_multiplication(dtype):
    grid, d = (2, 3, 5), 24
    rng = np.random.default_rng(0)
    x, x64 = harness.rounded(rng, (2, 30, 3, d), dtype)
    cos, sin = rope_3d(grid, d)
    ref = _wan_rope_apply(x64, _wan_multipliers(grid, d))
    got = jax.jit(apply_rope)(x, cos, sin)
    assert got.dtype == dtype and got.shape == x.shape
    oracle.assert_close(got, ref, dtype, "apply_rope")
    # One example (no batch axis), as the Equinox modules call it.
    oracle.assert_close(apply_rope(x[1], cos, sin), ref[1], dtype, "apply_rope unbatched")


def test_apply_rope_gradient_is_the_inverse_rotation():
    grid, d = (1, 2, 3), 12
    rng = np.random.default_rng(1)
    x = jnp.asarray(harness.normal(rng, (6, 2, d)))
    ct = rng.standard_normal((6, 2, d))
    cos, sin = rope_3d(grid, d)
    dx = jax.grad(lambda x: jnp.sum(apply_rope(x, cos, sin) * jnp.asarray(ct, jnp.float32)))(x)
    ref = _wan_rope_apply(ct, np.conj(_wan_multipliers(grid, d)))
    oracle.assert_close(dx, ref, jnp.float32, "dx")


def test_apply_rope_wrong_shapes_raise():
    cos, sin = rope_3d((1, 2, 3), 12)
    with pytest.raises(jaxtyping.TypeCheckError):
        apply_rope(jnp.ones((6, 2, 10)), cos, sin)  # D // 2 != 6
    with pytest.raises(jaxtyping.TypeCheckError):
        apply_rope(jnp.ones((5, 2, 12)), cos, sin)  # S != 6
    with pytest.raises(ValueError, match="even"):
        apply_rope(jnp.ones((6, 2, 13)), cos, sin)
