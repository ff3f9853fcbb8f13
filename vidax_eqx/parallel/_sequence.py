"""The one sequence-parallel entry: attention over a sequence split by the role of each
mesh axis (Ulysses, ring, both, or none), with a replicated text joined to it."""

from collections.abc import Hashable

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .. import kernels
from ._checks import check_text_position
from ._mesh import axis_size
from ._rank_masks import RankMasks, with_rank_mask
from ._ring import ring_attention
from ._ulysses import sequence_parallel_joint_self_attention, sequence_parallel_self_attention
from ._usp import usp_attention


_FN = "sequence_attention"


def _local_tile_mask(mask, heads_local: int, tp_axis, ulysses_axis):
    """A `SlidingTileMask` with per-head windows, as the heads of this device's
    tensor-parallel rank see it (`RankMasks` when the ranks' windows differ)."""
    if not isinstance(mask, kernels.SlidingTileMask):
        return mask
    tp = 1 if tp_axis is None else axis_size(tp_axis, what="Tensor-parallel")
    mask.check_heads(heads_local * tp, _FN)
    if mask.heads is None or tp == 1:
        return mask
    masks = RankMasks.of(mask, heads_local, tp_axis, tp)
    if isinstance(masks, RankMasks) and ulysses_axis is not None:
        raise NotImplementedError(
            f"{_FN}: per-head SlidingTileMask windows that differ between tensor-parallel "
            "ranks under Ulysses (both split the heads) are not supported; use one window "
            "for all heads, equal windows per TP rank, or a ring alone."
        )
    return masks


def _one_device(q, k, v, *, text_len: int, text_position: str, text_lengths, kv_lengths,
                segment_ids, mask, **kernel_options):
    """The joint layout on one device: one kernel call over the whole sequence, the text
    padding as the keys it hides."""
    if text_lengths is not None:
        S = q.shape[1]
        if text_position == "suffix":  # the padded text keys are the sequence's tail
            tail = S - text_len + text_lengths
            kv_lengths = tail if kv_lengths is None else jnp.minimum(kv_lengths, tail)
        else:  # a prefix: key segment ids -1 on the padded text keys
            ids = (jnp.zeros((q.shape[0], S), jnp.int32) if segment_ids is None
                   else segment_ids)
            q_ids = ids.q if isinstance(ids, kernels.SegmentIds) else ids
            kv_ids = ids.kv if isinstance(ids, kernels.SegmentIds) else ids
            index = jnp.arange(kv_ids.shape[1])
            hidden = (index < text_len) & (index >= text_lengths[:, None])
            segment_ids = kernels.SegmentIds(q=q_ids.astype(jnp.int32),
                                             kv=jnp.where(hidden, -1, kv_ids).astype(jnp.int32))
    return with_rank_mask(kernels.attention, q, k, v, kv_lengths=kv_lengths,
                          segment_ids=segment_ids, mask=mask, **kernel_options)


def sequence_attention(
    q: Float[Array, "B S_local H D"],
    k: Float[Array, "B S_local H_kv D"],
    v: Float[Array, "B S_local H_kv D"],
    *,
    ulysses_axis: Hashable | None = None,
    ring_axis: Hashable | None = None,
    tp_axis: Hashable | None = None,
    layout: str = "contiguous",
    text_len: int = 0,
    text_position: str = "prefix",
    text_lengths: Int[Array, " B"] | None = None,
    **kernel_options,
) -> Float[Array, "B S_local H D"]:
    """Self-attention over a sequence split over mesh axes by role, inside
    `jax.shard_map`: the one sequence-parallel entry.

    | axes given | runs |
    |---|---|
    | none | [`vidax_eqx.kernels.attention`][] (one device, or a replicated sequence) |
    | `ulysses_axis` | DeepSpeed-Ulysses: [`sequence_parallel_self_attention`][], or [`sequence_parallel_joint_self_attention`][] with a text |
    | `ring_axis` | [`ring_attention`][] |
    | both | USP, [`usp_attention`][]: Ulysses within a group, the ring across groups |

    The result (and its gradients) equals single-device attention over the whole
    sequence. This is what every attention layer of [`vidax_eqx.nn`][] calls, with the
    axes its [`vidax_eqx.nn.sharding.ParallelConfig`][] names.

    **Arguments:**

    - `q`, `k`, `v`: this device's tokens `(B, S_local, H, D)` and
        `(B, S_local, H_kv, D)` (GQA: `H % H_kv == 0`); with a text (`text_len > 0`),
        `[text; this device's video chunk]` (or `[chunk; text]` for a suffix), the text
        the same on every device.
    - `ulysses_axis`, `ring_axis`: the mesh axes the sequence is split over (two
        different ones, or one, or none); with both it is sharded ring-major,
        `PartitionSpec(None, (ring_axis, ulysses_axis))`.
    - `tp_axis`: the tensor-parallel axis whose ranks hold different heads (`q`, `k`,
        `v` are this device's heads of a Megatron split), or `None`: a
        [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask] with per-head windows
        then gives each device its heads' windows. Nothing else depends on it.
    - `layout`: `"contiguous"` or `"zigzag"` (a ring's layout; see
        [`ring_attention`][]); ignored without a ring.
    - `text_len`, `text_position`, `text_lengths`: the joint layout (a replicated
        text of `text_len` tokens before or after this device's video chunk, its
        key-only padding), as in [`ring_attention`][] and
        [`sequence_parallel_joint_self_attention`][]; on one device the text padding
        hides the padded text keys (the sequence's tail for a suffix, through
        `kv_lengths`; key segment ids -1 for a prefix).
    - `**kernel_options`: the options of [`vidax_eqx.kernels.attention`][]
        (`segment_ids`, `mask`, `kv_lengths`, `causal`, `window`, `sinks`, `scale`,
        `logits_soft_cap`, `implementation`, ...), in this device's layout as the
        function that runs documents them.

    **Returns:**

    This device's output, `q`'s shape and dtype.

    **Raises:**

    `ValueError` for an axis that is not bound, the same axis for both roles, and
    whatever the function that runs raises; `NotImplementedError` for per-head tile
    windows that differ between tensor-parallel ranks under Ulysses.
    """
    if ulysses_axis is not None and ulysses_axis == ring_axis:
        raise ValueError(
            f"{_FN}: `ulysses_axis` and `ring_axis` must be two different mesh axes; "
            f"received {ulysses_axis!r} for both."
        )
    check_text_position(_FN, text_position)
    mask = _local_tile_mask(kernel_options.pop("mask", None), jnp.shape(q)[2], tp_axis,
                            ulysses_axis)
    text = {} if not text_len else dict(text_len=text_len, text_position=text_position,
                                        text_lengths=text_lengths)
    if ulysses_axis is None and ring_axis is None:
        kv_lengths = kernel_options.pop("kv_lengths", None)
        segment_ids = kernel_options.pop("segment_ids", None)
        return _one_device(q, k, v, text_len=text_len, text_position=text_position,
                           text_lengths=text_lengths, kv_lengths=kv_lengths,
                           segment_ids=segment_ids, mask=mask, **kernel_options)
    if ring_axis is None:
        if not text_len:
            return sequence_parallel_self_attention(q, k, v, ulysses_axis, mask=mask,
                                                    **kernel_options)
        text.pop("text_len")
        return sequence_parallel_joint_self_attention(q, k, v, text_len, ulysses_axis,
                                                      mask=mask, **text, **kernel_options)
    if ulysses_axis is None:
        return ring_attention(q, k, v, ring_axis=ring_axis, layout=layout, mask=mask, **text,
                              **kernel_options)
    return usp_attention(q, k, v, ulysses_axis=ulysses_axis, ring_axis=ring_axis,
                         layout=layout, mask=mask, **text, **kernel_options)

