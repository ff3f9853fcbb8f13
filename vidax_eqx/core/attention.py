"""`vidax.core.attention`: the original page's source module (`src/vidax/core/attention.py`),
its names at the same import path. The documented function API, as thin adapters.

Layout `(B, S, H, D)` throughout. The math lives in `vidax_eqx.kernels` and
`vidax_eqx.parallel`; this module only maps the documented argument names and
defaults onto them. `sequence_parallel_self_attention`,
`sequence_parallel_joint_self_attention` and `chunk_by_rank` are the
`vidax_eqx.parallel` functions themselves (same names, arguments and defaults).
`RMSNorm` and `TPShardedRMSNorm` are the Equinox modules of `vidax_eqx.nn`; the
linen classes of the same names live in `vidax_eqx.flax` (the only module that
needs flax).
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._vma import explicit_axes, tracks_vma, varying_axes
from ..kernels import attention as _attention, SlidingTileMask
from ..nn import RMSNorm as RMSNorm, TPShardedRMSNorm as TPShardedRMSNorm
from ..parallel import (
    chunk_by_rank as chunk_by_rank,
    SP_AXIS,
    sequence_parallel_joint_self_attention as sequence_parallel_joint_self_attention,
    sequence_parallel_self_attention as sequence_parallel_self_attention,
    tensor_parallel_attention,
)


def dot_product_attention(
    q: Float[Array, "B S_q H D"],
    k: Float[Array, "B S_k H_kv D"],
    v: Float[Array, "B S_k H_kv D"],
    bias: Float[Array, "#B #H #S_q #S_k"] | None = None,
    mask: Bool[Array, "#B #H #S_q #S_k"] | SlidingTileMask | None = None,
    scale: float | None = None,
    mesh: jax.sharding.Mesh | None = None,
    *,
    kv_lengths: Int[Array, " B"] | None = None,
) -> Float[Array, "B S_q H D"]:
    """Scaled dot-product attention, choosing the fastest implementation.

    The dispatch rules of the original `vidax.core`:

    - without a boolean mask, on one device: `implementation="auto"`, the fastest
        kernel for this platform (the Pallas / cuDNN flash kernels on TPU / GPU);
    - with a boolean mask: the portable path (`"portable"`: the exact `"xla"`
        kernel for short sequences, the O(S) `"blockwise"` one for long ones);
    - on more than one device without a `mesh`: the portable path too, which XLA
        partitions however the arrays are sharded (the fused kernels run per
        device, so they need the mesh to be given), bias included;
    - with a `mesh`: the Megatron path below, each device running `"auto"` on
        its heads (bias and mask sharded with them).

    [`vidax_eqx.kernels.select_implementation`][] tells which implementation a
    call runs (`implementation="portable"` or `"auto"` as above).

    **Arguments:**

    - `q`, `k`, `v`: `(B, S_q, H, D)` and `(B, S_k, H_kv, D)`.
    - `bias`: additive logit bias broadcastable to `(B, H, S_q, S_k)`, e.g. a T5
        relative-position bias (T5 does not scale logits: pass `scale=1.0`).
    - `mask`: boolean, broadcastable to `(B, H, S_q, S_k)`, `True` may attend. It
        only steers the choice of implementation away from those that cannot take
        a mask; the flash-style `"blockwise"` path takes one. Or a
        [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask] (sliding tile
        attention, hidden tiles skipped; per-head windows follow the heads to the
        TP ranks with `mesh`).
    - `scale`: logit scale, default `1 / sqrt(D)`.
    - `mesh`: a device mesh to run the Megatron path over: heads sharded over its
        `"tp"` axis, batch over its `"dp"` axis, the whole sequence on every
        device ([`vidax_eqx.parallel.tensor_parallel_attention`][]). Call it
        outside `shard_map` with global arrays. `None`: single-device.
    - `kv_lengths`: optional int `(B,)`, key-only padding (not in the original
        `vidax.core`; keyword-only): keys at index `>= kv_lengths[b]` are invisible to
        every query, and every query is still computed (unlike segment-id padding,
        where a padded token also sees nothing). On one device it goes to
        [`vidax_eqx.kernels.attention`][]'s `kv_lengths`, which the fast kernels serve;
        with `mesh` it becomes a boolean key mask `(B, 1, 1, S_k)` ANDed with `mask`
        (a [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask] cannot take it there:
        `NotImplementedError`).

    **Returns:**

    `(B, S_q, H, D)` in `q`'s dtype.
    """
    if mesh is not None:
        if kv_lengths is not None:
            if isinstance(mask, SlidingTileMask):
                raise NotImplementedError(
                    "dot_product_attention: with `mesh`, `kv_lengths` is served as a boolean "
                    "key mask, which a SlidingTileMask `mask` cannot be combined with; pass "
                    "mesh=None, or no kv_lengths."
                )
            keys = (jnp.arange(k.shape[1]) < jnp.asarray(kv_lengths)[:, None])[:, None, None, :]
            mask = keys if mask is None else jnp.logical_and(mask, keys)
        return tensor_parallel_attention(q, k, v, mesh=mesh, bias=bias, mask=mask, scale=scale)
    explicit = explicit_axes(q, k, v, bias, None if isinstance(mask, SlidingTileMask) else mask)
    if explicit:
        raise ValueError(
            "dot_product_attention: the inputs are sharded over the Explicit mesh axes "
            f"{explicit} (`jax.make_mesh`'s default axis type), and attention over a sharded "
            "sequence or head axis needs a plan: pass `mesh=` (heads over its 'tp' axis, "
            "batch over 'dp'), call the sequence-parallel functions inside `jax.shard_map`, "
            "or replicate the inputs first (`jax.sharding.reshard(x, P())`)."
        )
    if SP_AXIS in (varying_axes(q) if tracks_vma() else ()):
        raise ValueError(
            f"dot_product_attention: `q` varies over the mesh axis {SP_AXIS!r} (its sequence "
            "is sharded), but this function attends over the whole sequence on one device: "
            "each device would attend only to its own chunk. Call "
            "sequence_parallel_self_attention(q, k, v, 'sp') inside the shard_map, or "
            "local_attention(q, k, v) if per-chunk attention is really meant."
        )
    portable = mask is not None or jax.device_count() > 1
    implementation = "portable" if portable else "auto"
    return _attention(q, k, v, bias=bias, mask=mask, scale=scale, implementation=implementation,
                     kv_lengths=kv_lengths)


def local_attention(
    q: Float[Array, "B S_q H D"],
    k: Float[Array, "B S_k H_kv D"],
    v: Float[Array, "B S_k H_kv D"],
    scale: float | None = None,
) -> Float[Array, "B S_q H D"]:
    """Plain attention over the sequences this device holds (no communication).

    **Arguments:**

    - `q`, `k`, `v`: `(B, S_q, H, D)` and `(B, S_k, H_kv, D)`.
    - `scale`: logit scale, default `1 / sqrt(D)`.

    **Returns:**

    `(B, S_q, H, D)` in `q`'s dtype.
    """
    return _attention(q, k, v, scale=scale)
