"""Whole models: fixtures' inputs and outputs, errors against a reference, the loss and
its gradient, every parameter's error against its own scale."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import oracle

from ._modules import arrays, leaf_names


def load_io(path) -> dict:
    """The arrays of an `io.npz` fixture as JAX arrays."""
    return {k: jnp.asarray(v) for k, v in np.load(path).items()}


def max_rel_error(out, ref) -> float:
    """`max|out - ref| / max|ref|` in float64: a whole model's output against its
    reference (relative to the output's largest magnitude)."""
    ref = np.asarray(ref)
    return float(np.max(np.abs(np.asarray(out, np.float64) - ref)) / np.max(np.abs(ref)))


def loss_and_grad(run):
    """A filtered-jitted `(arrays, static, x, t, c, target) -> (loss, grad)` of the mean
    squared error of `run(model, x, t, c)` against `target`, with respect to `arrays`."""

    def loss(params, static, x, t, c, target):
        model = eqx.combine(params, static)
        return jnp.mean(jnp.square(run(model, x, t, c) - target))

    return eqx.filter_jit(jax.value_and_grad(loss))


def same_arrays(a, b) -> bool:
    """The same arrays (dtypes and values) in the same order."""
    la, lb = arrays(a), arrays(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
    )


def leaf_errors(got, ref, floor: float = 0.0) -> dict:
    """`{path: max|got - ref| / scale}` over the array leaves of two trees of the same
    structure (a model's gradients, sharded or not), `scale` the leaf's largest magnitude
    in `ref`, and at least `floor` x the largest of the whole tree (a leaf whose values
    are float32 noise around zero is judged against the model's scale)."""
    names = leaf_names(ref)
    ref = [np.asarray(r, np.float64) for r in arrays(ref)]
    got = [np.asarray(g, np.float64) for g in arrays(got)]
    assert len(got) == len(ref), (len(got), len(ref))
    top = max(float(np.max(np.abs(r))) for r in ref)
    return {n: float(np.max(np.abs(g - r))) / max(float(np.max(np.abs(r))), floor * top, 1e-30)
            for n, g, r in zip(names, got, ref, strict=True)}


def assert_leaves_close(got, ref, what: str, floor: float = 0.0, dtype=np.float32) -> None:
    """Every entry of `leaf_errors(got, ref, floor)` within the dtype's tolerance."""
    tol = oracle.tolerance(dtype)
    errors = leaf_errors(got, ref, floor)
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"{what}: {len(bad)} of {len(errors)} arrays off (relative): {bad}"
