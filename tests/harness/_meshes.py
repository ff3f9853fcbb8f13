"""Meshes, built once per shape, and the zigzag layout of a ring."""

import functools

import jax.numpy as jnp
import numpy as np


@functools.cache
def _mesh(dp: int, sp: int, tp: int, extra: tuple):
    from vidax_eqx import parallel

    return parallel.make_mesh(dp=dp, sp=sp, tp=tp, extra_axes=dict(extra) or None)


def mesh(dp: int = 1, sp: int = 1, tp: int = 1, **extra_axes: int):
    """`parallel.make_mesh(dp=dp, sp=sp, tp=tp, extra_axes=extra_axes)` over the first
    devices, built once per shape: `mesh(sp=2, ring=2)` is 2D sequence parallelism."""
    return _mesh(dp, sp, tp, tuple(extra_axes.items()))


def zigzag(x, n: int, axis: int = 1):
    """`x` (global order) as a JAX array in the zigzag layout of a ring of `n`; `n = 0`:
    the contiguous layout (`x` as it is)."""
    from vidax_eqx import parallel

    x = jnp.asarray(x)
    return parallel.zigzag_permute(x, axis, n) if n else x


def unzigzag(x, n: int, axis: int = 1) -> np.ndarray:
    """The inverse of `zigzag`, as NumPy."""
    from vidax_eqx import parallel

    return np.asarray(parallel.zigzag_unpermute(x, axis, n) if n else x)
