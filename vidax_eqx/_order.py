"""One order for the collectives of a program, the same on every device.

XLA runs the operations of a program that do not depend on each other in any
order, and on its CPU runtime (simulated devices, `jax.distributed` CPU jobs)
concurrently: every collective of a `shard_map` gets the same channel id there,
so two independent collective-permutes (or all-to-alls, all-gathers, psums)
can meet in one rendezvous, or two devices can wait in different collectives
for each other. Either way the runtime aborts the whole process
(`Check failed: id < num_threads` / `Termination timeout for collective permute
RendezvousKey`). Accelerator runtimes order their collectives themselves, but
a single program order costs nothing there either.

So every collective issued by `vidax_eqx` waits, through a data dependence, for
the inputs of the function issuing it and for the collective issued before it:
[`after`][] ties an operand to earlier results with `lax.optimization_barrier`,
which XLA cannot see through or reorder, and which differentiates (and
transposes) into barriers too, so gradients and second-order gradients keep an
order as well. Sits below `kernels/`, `parallel/` and `nn/`.
"""

import jax
from jax import lax


def after(x, *deps):
    """`x` (any PyTree), made to depend on every array in `deps`.

    Whatever consumes the result (a collective, typically) runs after `deps` were
    computed. The values are unchanged; leaves of `deps` that are not arrays
    (`None`, static structure) are ignored, and with no arrays this is `x` itself.
    """
    # One element of each stands for the whole array: its producer must have run,
    # and the barrier's transpose then instantiates a scalar zero, not a copy.
    tokens = [d.reshape(-1)[:1] for d in jax.tree.leaves(deps) if isinstance(d, jax.Array)]
    if x is None or not tokens:
        return x
    x, _ = lax.optimization_barrier((x, tokens))
    return x


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
