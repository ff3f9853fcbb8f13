"""Varying-manual-axes bookkeeping for code that runs inside `jax.shard_map`.

Under `shard_map(check_vma=True)` every value carries the set of mesh axes it
varies over. Loop carries that start as constants, and replicated operands that
meet device-varying data inside a `custom_vjp`, must be cast to varying first;
the transpose of that cast is a `psum`, which is exactly the gradient of a
replicated input. Outside `shard_map` both functions are no-ops. Shared by
`kernels/` and `parallel/` (this module sits below both).
"""

import jax

from . import _jax_private


def varying_axes(*xs) -> frozenset:
    """The mesh axes any of `xs` (arrays or `None`) varies over; empty outside `shard_map`."""
    axes = set()
    for x in xs:
        if x is None:
            continue
        aval = jax.typeof(x)
        vma = getattr(aval, "vma", None)
        if vma is None:  # jax >= 0.10 keeps it on the manual axis type
            vma = getattr(getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None), "varying", ())
        axes.update(vma)
    return frozenset(axes)


def as_varying(tree, axes: frozenset):
    """Casts every array of `tree` to vary over `axes` (a no-op where it already does)."""
    if not axes:
        return tree

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x), key=str))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def opaque_to_vma(fn, *args):
    """Calls `fn(*args)`, a function whose Pallas kernels declare no varying axes
    for their outputs, from inside `shard_map(check_vma=True)`.

    JAX's Pallas attention kernels build their `out_shape`s without varying
    axes, which `check_vma=True` rejects. A kernel is per-device by nature: `fn`
    runs with the check off, and its outputs are marked as varying over the axes
    its inputs vary over. Not for functions that communicate across devices.
    Outside `shard_map` this is `fn(*args)`.
    """
    axes = varying_axes(*jax.tree.leaves(args))
    if not axes:
        return fn(*args)
    with _jax_private.check_vma(False):  # the switch `shard_map` sets
        out = fn(*args)
    return as_varying(out, axes)


def manual_axes() -> frozenset:
    """The mesh axes the surrounding `shard_map` is manual over; empty outside one."""
    return frozenset(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())


def tracks_vma() -> bool:
    """Whether values here carry their varying axes: inside `shard_map(check_vma=True)`.

    With `check_vma=False` every value reports no varying axes, so nothing can be
    concluded from `varying_axes` there.
    """
    if not manual_axes():
        return False
    return bool(_jax_private.check_vma.value)  # the switch `shard_map` sets


def explicit_axes(*xs) -> list:
    """The Explicit mesh axes any of `xs` is sharded over (sharding in types)."""
    axes = set()
    for x in xs:
        if x is None:
            continue
        sharding = getattr(jax.typeof(x), "sharding", None)
        spec = getattr(sharding, "spec", None) or ()
        mesh = getattr(sharding, "mesh", None)
        types = dict(zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())))
        for entry in spec:
            for name in (entry if isinstance(entry, tuple) else (entry,)):
                if name is not None and types.get(name) == jax.sharding.AxisType.Explicit:
                    axes.add(name)
    return sorted(axes, key=str)


def replicated_axes(x, axes) -> list:
    """The axes of `axes` over which `x` is the same on every device although the
    surrounding `shard_map` splits them over more than one: manual, of size > 1, and
    absent from `x`'s varying axes. Empty where values carry no axes (`tracks_vma`)."""
    if not tracks_vma():
        return []
    manual, vma = manual_axes(), varying_axes(x)
    return [a for a in axes if a in manual and a not in vma and jax.lax.axis_size(a) > 1]
