"""`parallel.halo_exchange`: a frame split over height and width on a (2, 4) mesh, each
device's block with its neighbours' rows attached, then a `"VALID"` convolution, equals
the zero-padded (`"SAME"`) convolution of the whole frame: forward against a float64
NumPy convolution, gradients against one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import oracle
from vidax_eqx import parallel

C, O, H, W = 3, 2, 8, 12  # channels in / out, the frame


def _conv_same(x, w):
    """float64 zero-padded 2-D convolution (cross-correlation) of `x (C, H, W)` with
    `w (O, C, kh, kw)`, odd kernels."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    kh, kw = w.shape[2:]
    xp = np.pad(x, ((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2)))
    out = np.zeros((w.shape[0], x.shape[1], x.shape[2]))
    for i in range(kh):
        for j in range(kw):
            out += np.einsum("oc,chw->ohw", w[:, :, i, j], xp[:, i:i + x.shape[1], j:j + x.shape[2]])
    return out


def _conv_valid(x, w):
    return jax.lax.conv_general_dilated(x[None], w, (1, 1), "VALID")[0]


@pytest.mark.parametrize("k", [3, 5])
def test_split_convolution_equals_one_device(k):
    rng = np.random.default_rng(k)
    x = rng.standard_normal((C, H, W)).astype(np.float32)
    w = rng.standard_normal((O, C, k, k)).astype(np.float32)
    dout = rng.standard_normal((O, H, W)).astype(np.float32)
    mesh = harness.mesh(sp=2, tp=4)
    halo = k // 2

    def per_device(x, w):
        x = parallel.halo_exchange(x, "sp", axis=1, before=halo, after=halo)
        x = parallel.halo_exchange(x, "tp", axis=-1, before=halo, after=halo)
        return _conv_valid(x, w)

    spec = P(None, "sp", "tp")
    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(spec, P()), out_specs=spec)
    out, grads = harness.vjp(sharded)(x, w, dout)
    oracle.assert_close(np.asarray(out, np.float64), _conv_same(x, w), np.float32, "out")

    def one_device(x, w):
        return jax.lax.conv_general_dilated(x[None], w, (1, 1), "SAME")[0]

    want = harness.vjp(one_device)(x, w, dout)
    harness.assert_trees_close((out, grads), want, np.float32, "split vs one device: ")


def test_ends_are_zeros_and_errors():
    mesh = harness.mesh(sp=4)
    x = jnp.arange(8.0).reshape(1, 8) + 1  # blocks [1 2] [3 4] [5 6] [7 8]
    f = jax.shard_map(lambda x: parallel.halo_exchange(x, "sp", axis=1, before=1, after=2),
                      mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    np.testing.assert_array_equal(np.asarray(f(x)).reshape(4, 5), [
        [0, 1, 2, 3, 4], [2, 3, 4, 5, 6], [4, 5, 6, 7, 8], [6, 7, 8, 0, 0]])
    bad = jax.shard_map(lambda x: parallel.halo_exchange(x, "sp", axis=1, before=3, after=0),
                        mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    with pytest.raises(ValueError, match=r"`before` must be an int in \[0, 2\].*received 3"):
        jax.eval_shape(bad, x)
    with pytest.raises(ValueError, match=r"axis 'sp' does not exist"):
        parallel.halo_exchange(x, "sp", axis=1, before=1, after=1)
