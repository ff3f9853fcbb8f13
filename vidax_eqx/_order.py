"""One order for the collectives of a program, the same on every device.

XLA runs the operations of a program that do not depend on each other in any
order, and on its CPU runtime (simulated devices, `jax.distributed` CPU jobs)
concurrently: every collective of a `shard_map` gets the same channel id there,
so two independent collective-permutes (or all-to-alls, all-gathers, psums)
can meet in one rendezvous, or two devices can wait in different collectives
for each other. Either way the runtime aborts the whole process
(`Check failed: id < num_threads` / `Termination timeout for collective permute
RendezvousKey`). Accelerator runtimes issue collectives in their scheduled
order; there the dependences below cost a few bytes and constrain nothing else.

So every collective issued by `vidax_eqx` waits, through a real data
dependence, for the inputs of the function issuing it and for the collective
issued before it (`lax.optimization_barrier` would not do: XLA's CPU pipeline
deletes barriers, order and all). Ring permutes carry tokens of what they wait
for in their own buffer, and their transposes carry their forward result's, at
any order of differentiation ([`ppermute`][]); other collectives get their
operand tied to earlier results ([`after`][], [`Sequence`][]); arrays that
travel together (K and V) share one collective. Sits below `kernels/`,
`parallel/` and `nn/`.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax


def after(x, *deps):
    """`x` (any PyTree), made to depend on every array in `deps` through its data.

    Whatever consumes the result (a collective, typically) runs after `deps` were
    computed. Each floating or integer leaf gets `0 * nan_to_num(token)` added, a
    token being one element of each dep: the values are unchanged (a `-0.0` may
    become `+0.0`), the gradient flows to `x` alone, and XLA cannot drop the
    dependence (it does not fold `y * 0` for floats, and it deletes
    `optimization_barrier`s on CPU). Leaves of `deps` that are not arrays (`None`,
    static structure) are ignored; with no arrays this is `x` itself.
    """
    token = tokens(deps)
    if x is None or not token.size:
        return x
    zero = jnp.sum(jnp.nan_to_num(token)) * 0.0

    def tie(leaf):
        if not isinstance(leaf, jax.Array) or leaf.dtype == jnp.bool_:
            return leaf
        return leaf + zero.astype(leaf.dtype)

    return jax.tree.map(tie, x)


class Sequence:
    """Issues collectives one after another, in the order of the calls.

    `order = Sequence(*inputs)`, then `y = order(lax.all_to_all, x, axis_name, ...)`:
    the collective's operand waits for the previous collective's result (the first
    for `inputs`), so every device issues them in the same order.
    """

    def __init__(self, *deps):
        self.last = deps

    def __call__(self, collective, x, *args, **kwargs):
        y = collective(after(x, self.last), *args, **kwargs)
        self.last = y
        return y


def tokens(deps) -> jax.Array:
    """One float32 element of every array in `deps`: a real data dependence on them.

    XLA (its CPU pipeline at least) deletes `optimization_barrier`s before it runs
    a program, order and all, so a collective that must wait carries these few
    elements in its own buffer instead: nothing can run it before `deps` exist.
    """
    parts = [d.reshape(-1)[:1].astype(jnp.float32)
             for d in jax.tree.leaves(deps) if isinstance(d, jax.Array)]
    return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.float32)


def _packed_ppermute(x, token, axis_name, perm):
    flat = jnp.concatenate([x.reshape(-1), token.astype(x.dtype)])
    return lax.ppermute(flat, axis_name, perm=list(perm))[: x.size].reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _ordered_ppermute(x, token, axis_name, perm):
    return _packed_ppermute(x, token, axis_name, perm)


def _ordered_ppermute_fwd(x, token, axis_name, perm):
    y = _packed_ppermute(x, token, axis_name, perm)
    return y, (tokens(y), jnp.zeros_like(token))


def _ordered_ppermute_bwd(axis_name, perm, residuals, ct):
    # The inverse permute carries its forward permute's result: a transposed
    # collective cannot start before the forward one it mirrors has finished.
    y_token, zero = residuals
    inverse = tuple((dst, src) for src, dst in perm)
    return _ordered_ppermute(ct, y_token, axis_name, inverse), zero


_ordered_ppermute.defvjp(_ordered_ppermute_fwd, _ordered_ppermute_bwd)


def ppermute(x: jax.Array, axis_name, perm, *, deps=()) -> jax.Array:
    """`lax.ppermute(x, axis_name, perm)` that runs after every array in `deps` exists
    (their tokens travel in its buffer), and whose transpose, at any order of
    differentiation, runs after it."""
    perm = tuple((int(a), int(b)) for a, b in perm)
    token = tokens(deps)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return _ordered_ppermute(x, token, axis_name, perm)
    return _packed_ppermute(x, token, axis_name, perm)  # ids: nothing to differentiate
