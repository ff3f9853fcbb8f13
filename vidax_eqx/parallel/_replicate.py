"""Returning a value that every device of an axis holds (the joint layouts' text rows)
from `jax.shard_map` with a replicated out-spec."""

from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from .._vma import tracks_vma, varying_axes
from ._mesh import axis_size


def replicated(x, axis_name: Hashable | tuple[Hashable, ...]):
    """Types a value held identically by every device of `axis_name` as replicated over
    it, so that `jax.shard_map` returns it with an out-spec that does not name the axis
    (`out_specs=P()`, or `P("dp")` for a batch sharded elsewhere).

    The joint layouts ([`sequence_parallel_joint_self_attention`][],
    [`ring_attention`][] and [`usp_attention`][] with `text_len > 0`) compute the text
    output rows on every device, bitwise identical, but typed as *varying* over the
    sequence axis (they come from device-varying data), so `out_specs=P()` fails JAX's
    varying-axes check (`check_vma=True`, the default). This returns **device 0's copy
    on every device** (device 0 along each axis of `axis_name`), typed as invariant:
    for identical copies that is the value itself, and for copies that differ it is
    still one well-defined value, never a mix. Inside `shard_map` with
    `check_vma=False` it computes the same thing.

    Gradients: the cotangent of the returned value (replicated) goes to device 0's copy
    whole and to the other copies as 0, which is what the joint functions expect of
    their text rows (the cotangent of the copies is their sum).

    **Cost:** one all-reduce (`psum`) of `x` over `axis_name` (the other devices add
    zeros, so the result is exact): about twice `x`'s bytes on the wire per device, for
    the text rows of a joint layout a few hundred tokens; nothing when `x` is already
    replicated over the axis (as JAX's varying-axes types show under `check_vma=True`).

    **Arguments:**

    - `x`: an array (or a PyTree of arrays) inside `jax.shard_map`, the same on every
        device of `axis_name`.
    - `axis_name`: a mesh axis name, or a tuple of them (USP: `(ring_axis,
        ulysses_axis)`).

    **Returns:**

    `x` typed as invariant over `axis_name` (device 0's value).

    **Raises:**

    `ValueError` when an axis is not bound in the surrounding `shard_map`.

    ```python
    def joint(text, video):        # text: P(), video: P(None, "sp")
        q, k, v = (jnp.concatenate([x, t], axis=1) for t, x in zip(text, video))
        out = parallel.ring_attention(q, k, v, ring_axis="sp", text_len=T,
                                      text_position="suffix")
        L = video[0].shape[1]
        return out[:, :L], parallel.replicated(out[:, L:], "sp")

    jax.shard_map(joint, mesh=mesh, in_specs=(P(), P(None, "sp")),
                  out_specs=(P(None, "sp"), P()))
    ```
    """
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    for name in names:
        axis_size(name, what="Replicated-output")

    def one(leaf):
        leaf = jnp.asarray(leaf)
        axes = names
        if tracks_vma():
            axes = tuple(a for a in names if a in varying_axes(leaf))
        if not axes:
            return leaf
        first = True
        for a in axes:
            first = first & (lax.axis_index(a) == 0)
        if leaf.dtype == jnp.bool_:
            picked = jnp.where(first, leaf, False).astype(jnp.int32)
            return lax.psum(picked, axes).astype(jnp.bool_)
        return lax.psum(jnp.where(first, leaf, jnp.zeros((), leaf.dtype)), axes)

    return jax.tree.map(one, x)
