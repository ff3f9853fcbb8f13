"""Comparisons: results against the float64 oracle within the dtype's tolerance
(`oracle.TOLERANCES` is the suite's one tolerance table), trees against trees, the
sharded check in one call, gradients against finite differences."""

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

import oracle

from ._runs import sharded_vjp, vjp


ATTENTION_NAMES = ("out", "dq", "dk", "dv")


def named(out, grads, names=("out", "dq", "dk", "dv", "dsinks")) -> dict:
    """`(out, grads)` of a VJP as a dict: `names` label the output, then the gradients."""
    return dict(zip(names, (out, *grads)))


def _get(ref, name):
    return ref[name] if isinstance(ref, Mapping) else getattr(ref, name)


def assert_matches(got, ref, dtype, names=ATTENTION_NAMES, *, factor: float = 1.0) -> None:
    """`got[name]` against `ref`'s `name` (an `oracle.Result` or a mapping) for every
    name: finite, of the reference's shape, within `factor` times the dtype's tolerance."""
    for name in names:
        g = np.asarray(_get(got, name)).astype(np.float64)
        want = _get(ref, name)
        assert np.isfinite(g).all(), f"{name} has non-finite values"
        assert g.shape == np.shape(want), (name, g.shape, np.shape(want))
        oracle.assert_close(g, want, dtype, name, factor=factor)


def shape_re(shape) -> str:
    """A regex matching `shape` as Python prints a tuple (for error messages)."""
    if not shape:
        return r"\(\)"
    return r"\(" + r",\s*".join(str(s) for s in shape) + (r",\)" if len(shape) == 1 else r"\)")


def assert_trees_close(got, ref, dtype=np.float32, what: str = "", factor: float = 1.0) -> None:
    """Every array leaf of `got` against the same leaf of `ref` (the same number of
    leaves, the same shapes), within `factor` times the dtype's tolerance."""
    got_leaves, ref_leaves = jax.tree.leaves(got), jax.tree.leaves(ref)
    assert len(got_leaves) == len(ref_leaves), (what, len(got_leaves), len(ref_leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(got)]
    for path, g, r in zip(paths, got_leaves, ref_leaves):
        assert np.shape(g) == np.shape(r), f"{what}{path}: shape {np.shape(g)} != {np.shape(r)}"
        oracle.assert_close(g, r, dtype, f"{what}{path}", factor=factor)


def assert_copies_equal(copies, what: str = "text rows") -> None:
    """`copies (B, n, ...)`: every device's copy bitwise equal to device 0's."""
    copies = np.asarray(copies)
    for i in range(1, copies.shape[1]):
        np.testing.assert_array_equal(copies[:, i], copies[:, 0], err_msg=f"{what}, device {i}")


def check_sharded(local, mesh, in_specs, out_specs, args, cotangent, *, argnums=None,
                  ref=None, names=("out", "dq", "dk", "dv", "dsinks"), single=None,
                  dtype=np.float32, check_vma: bool = True, compiler_options=None):
    """The sharded check: `local` under `jax.shard_map` over `mesh` on the global `args`,
    its VJP with respect to `args[argnums]` (default all) pulled back with `cotangent`,
    against `ref` (an `oracle.Result` or a mapping; `names` label the output and then
    the gradients, in order) and / or against `single`, the same computation on one
    device (`single(*args)`, its own VJP). Returns the sharded `(out, grads)`."""
    args = tuple(None if x is None else jnp.asarray(x) for x in args)
    cotangent = jax.tree.map(jnp.asarray, cotangent)
    out, grads = sharded_vjp(local, mesh, in_specs, out_specs, argnums, check_vma=check_vma,
                             compiler_options=compiler_options)(*args, cotangent)
    if ref is not None:
        got = named(out, grads, names)
        assert_matches(got, ref, dtype, names[:len(got)])
    if single is not None:
        want = vjp(single, argnums, compiler_options=compiler_options)(*args, cotangent)
        assert_trees_close((out, grads), want, dtype, "sharded vs one device: ")
    return out, grads


def check_grads_fd(ref_loss, params, grads, names, seed: int, tol: float = 2e-5) -> None:
    """Gradients against directional central differences of the float64 `ref_loss(list
    of arrays)`: for each array, two random directions `d`, `<grad, d>` against
    `(L(p + eps d) - L(p - eps d)) / 2 eps`, relative to `sum |grad * d|`."""
    rng = np.random.default_rng(seed)
    params = [oracle.f64(p) for p in params]
    eps = 1e-6
    for i, (g, name) in enumerate(zip(grads, names)):
        g = oracle.f64(g)
        for _ in range(2):
            d = rng.standard_normal(g.shape)
            plus = [p + eps * d if j == i else p for j, p in enumerate(params)]
            minus = [p - eps * d if j == i else p for j, p in enumerate(params)]
            fd = (ref_loss(plus) - ref_loss(minus)) / (2 * eps)
            got = float(np.sum(g * d))
            scale = float(np.sum(np.abs(g * d))) + 1e-12
            assert abs(got - fd) <= tol * max(scale, abs(fd)), (
                f"{name}: <grad, d> = {got:.8g}, finite difference {fd:.8g}"
            )
