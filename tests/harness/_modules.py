"""Equinox modules: their arrays read, replaced and randomized."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


def arrays(module) -> list:
    """The module's arrays (its `ParallelConfig` and other non-array leaves left out)."""
    return jax.tree.leaves(eqx.filter(module, eqx.is_array))


def with_arrays(module, leaves):
    """The module with other arrays in place of its own (float64 NumPy arrays for a
    reference), its non-array leaves kept."""
    params, static = eqx.partition(module, eqx.is_array)
    return eqx.combine(jax.tree.unflatten(jax.tree.structure(params), leaves), static)


def map_arrays(f, tree):
    """`f` applied to every array leaf of `tree`; other leaves (a module's
    `ParallelConfig`) kept as they are."""
    return jax.tree.map(lambda a: f(a) if eqx.is_array(a) else a, tree)


def to64(tree):
    """Every array leaf as NumPy: floating ones in float64, others unchanged."""

    def conv(a):
        a = np.asarray(a)
        return a.astype(np.float64) if np.issubdtype(a.dtype, np.floating) else a

    return map_arrays(conv, tree)


def leaf_names(tree) -> list[str]:
    """The key paths of the array leaves of `tree`, in `arrays` order."""
    return [jax.tree_util.keystr(path)
            for path, _ in jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))]


def perturbed(module, seed: int, scale: float = 0.2):
    """Every array perturbed by `scale` standard normal noise (norm weights away from 1,
    biases away from 0), drawn in NumPy."""
    rng = np.random.default_rng(seed)
    return with_arrays(module, [
        jnp.asarray(np.asarray(x) + scale * rng.standard_normal(x.shape), x.dtype)
        for x in arrays(module)])


def resampled(module, seed: int):
    """Every array replaced by standard normal values (norm weights included)."""
    rng = np.random.default_rng(seed)
    return with_arrays(module, [jnp.asarray(rng.normal(size=x.shape), x.dtype)
                                for x in arrays(module)])
