"""Megatron-style attention over a mesh: heads over the tensor-parallel axis,
batch over the data-parallel axis, the whole sequence on every device.

Unlike the sequence-parallel functions, this one takes the mesh and wraps the
kernel in `jax.shard_map` itself: it is what `core.dot_product_attention(...,
mesh=mesh)` runs. Attention heads are independent, so no communication is
needed beyond placing the inputs.
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, Float

from .._jax_private import refuse_empty_shard_map_inputs
from ..kernels import attention, SegmentIds, SlidingTileMask
from ..kernels.internal import check_request  # what `attention` would raise, once
from ._mesh import DP_AXIS, TP_AXIS
from ._rank_masks import RankMasks, with_rank_mask
from ._ulysses import kv_head_repeats


def _lift_4d(x):
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.ndim > 4:
        return x  # the kernel's validation names the problem
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _check_global(q, k, v, bias, mask, segment_ids, sinks, kernel_options) -> None:
    """Validates the request on the global shapes, as the kernel would, before any
    sharding: errors then name the shapes the caller passed, not one device's slice.
    Traced abstractly (`jax.eval_shape`), so nothing is computed."""

    tile_mask = mask if isinstance(mask, SlidingTileMask) else None  # static, not an array

    def check(q, k, v, bias, mask, segment_ids, sinks):
        check_request(q, k, v, bias=bias, mask=tile_mask or mask, segment_ids=segment_ids,
                      sinks=sinks, **kernel_options)
        return jnp.zeros(())

    jax.eval_shape(check, q, k, v, bias, None if tile_mask else mask, segment_ids, sinks)


def tensor_parallel_attention(
    q: Float[Array, "B S_q H D"],
    k: Float[Array, "B S_k H_kv D"],
    v: Float[Array, "B S_k H_kv D"],
    *,
    mesh: Mesh,
    bias: Float[Array, "#B #H #S_q #S_k"] | None = None,
    mask: Bool[Array, "#B #H #S_q #S_k"] | None = None,
    segment_ids=None,
    sinks: Float[Array, "H"] | None = None,
    tp_axis: str = TP_AXIS,
    dp_axis: str = DP_AXIS,
    **kernel_options,
) -> Float[Array, "B S_q H D"]:
    """Attention with heads sharded over `tp_axis` and batch over `dp_axis`.

    Called outside `shard_map` with global arrays; returns the global output,
    sharded like `q`. Other mesh axes (e.g. `"sp"`) see replicated work.

    **Arguments:**

    - `q`, `k`, `v`: `(B, S_q, H, D)`, `(B, S_k, H_kv, D)`, global.
    - `mesh`: the device mesh; an axis it lacks counts as size 1.
    - `bias`, `mask`: broadcastable to `(B, H, S_q, S_k)`; sharded on their
        batch / head axes when those are full. `mask` may be a
        [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask]: per-head windows
        follow their heads to the TP ranks.
    - `segment_ids`: [`SegmentIds`][] or one `(B, S)` array; sharded on batch.
    - `sinks`: `(H,)`, sharded with the heads.
    - `tp_axis`, `dp_axis`: the mesh axis names to shard heads / batch over.
    - `**kernel_options`: the rest of [`vidax_eqx.kernels.attention`][]'s options
        (`causal`, `window`, `scale`, positions, `logits_soft_cap`,
        `implementation`).

    GQA: key/value heads that do not split over the TP size are repeated by the
    smallest factor that does ([`kv_head_repeats`][]); their gradients sum back.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"`mesh` must be a jax.sharding.Mesh (e.g. vidax_eqx.parallel.make_mesh(tp=...)); "
            f"received {type(mesh).__name__}."
        )
    for name, axis, default in (("tp_axis", tp_axis, TP_AXIS), ("dp_axis", dp_axis, DP_AXIS)):
        # The default names may be absent (size 1); a name given explicitly must exist.
        if axis != default and axis not in mesh.shape:
            raise ValueError(
                f"`{name}`={axis!r} is not an axis of the mesh, whose axes are "
                f"{tuple(mesh.axis_names)}. Pass one of them, or leave the default "
                f"{default!r} (an absent default axis counts as size 1)."
            )
    _check_global(q, k, v, bias, mask, segment_ids, sinks, kernel_options)
    tp = mesh.shape.get(tp_axis, 1)
    dp = mesh.shape.get(dp_axis, 1)
    B, _, H, _ = jnp.shape(q)
    H_kv = jnp.shape(k)[2]
    if H % tp:
        raise ValueError(
            f"tensor parallelism splits the {H} query heads over the {tp} devices of axis "
            f"{tp_axis!r}; H must be a multiple of it (received H={H}, tp={tp})."
        )
    if B % dp:
        raise ValueError(
            f"data parallelism splits the batch of {B} over the {dp} devices of axis "
            f"{dp_axis!r}; B must be a multiple of it (received B={B}, dp={dp})."
        )
    if tp > 1 and H % H_kv == 0:
        r = kv_head_repeats(H, H_kv, tp)
        if r > 1:
            k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    b_ax = dp_axis if dp > 1 else None
    h_ax = tp_axis if tp > 1 else None

    def spec_4d(x):
        if x is None or x.ndim != 4:
            return P()
        return P(b_ax if x.shape[0] > 1 else None, h_ax if x.shape[1] > 1 else None)

    tile_mask = None
    if isinstance(mask, SlidingTileMask):  # static: each device takes its heads' windows
        tile_mask = RankMasks.of(mask, H // tp, tp_axis, tp) if tp > 1 else mask
        mask = None
    bias, mask = _lift_4d(bias), _lift_4d(mask)
    if isinstance(segment_ids, SegmentIds):
        seg_spec = SegmentIds(P(b_ax), P(b_ax))
    else:
        seg_spec = P(b_ax)
    qkv_spec = P(b_ax, None, h_ax)
    operands = (q, k, v, bias, mask, segment_ids, sinks)
    specs = (qkv_spec, qkv_spec, qkv_spec, spec_4d(bias), spec_4d(mask), seg_spec, P(h_ax))

    def local(q, k, v, bias, mask, segment_ids, sinks):
        return with_rank_mask(
            attention, q, k, v, bias=bias, mask=mask if tile_mask is None else tile_mask,
            segment_ids=segment_ids, sinks=sinks, **kernel_options,
        )

    # `None` operands are empty pytrees: give them an empty spec.
    specs = tuple(None if x is None else s for x, s in zip(operands, specs))
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        # `jax.make_mesh`'s default: shard_map does not move Explicit-sharded inputs.
        operands = tuple(
            None if x is None else jax.tree.map(
                lambda a, sp: jax.sharding.reshard(a, NamedSharding(mesh, sp)), x, s)
            for x, s in zip(operands, specs)
        )
    refuse_empty_shard_map_inputs("tensor_parallel_attention", mesh, operands)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=qkv_spec)(*operands)
