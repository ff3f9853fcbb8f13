"""The one sequence-parallel entry: attention over a sequence split by the role of each
mesh axis (Ulysses, ring, both, or none), with a replicated text joined to it.

`attend` checks the request once (`_request.py`) and calls the worker of its mode:
the kernel alone (`_one_device`, here), Ulysses (`_ulysses.ulysses`), a ring
(`_ring_engine.ring`, or `_joint.ring_joint` with a text) or USP (`_usp.usp`).
[`sequence_attention`][] is `attend` under its own name; the documented fronts
(`_fronts.py`) are `attend` under theirs, so that an error names the function called.
"""

from collections.abc import Hashable

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .. import kernels
from ._joint import ring_joint
from ._rank_masks import with_rank_mask
from ._request import check_attention_request
from ._ring_engine import ring
from ._ulysses import ulysses
from ._usp import usp


_FN = "sequence_attention"


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

    Every argument is checked once, before anything runs: `ValueError` for an axis that
    is not bound, the same axis for both roles, `text_lengths` without a text, and the
    errors of the mode's documented front (the table above) for the rest; `TypeError`
    for a kernel option that a ring does not take (`bias`, positions); the kernel's
    errors for what its implementation cannot serve; `NotImplementedError` for per-head
    tile windows that differ between tensor-parallel ranks under Ulysses.
    """
    return attend(_FN, q, k, v, ulysses_axis=ulysses_axis, ring_axis=ring_axis,
                  tp_axis=tp_axis, layout=layout, text_len=text_len,
                  text_position=text_position, text_lengths=text_lengths, **kernel_options)


def attend(fn: str, q, k, v, *, ulysses_axis=None, ring_axis=None, tp_axis=None,
           layout: str = "contiguous", text_len: int = 0, text_position: str = "prefix",
           text_lengths=None, **kernel_options):
    """[`sequence_attention`][] called as `fn` (its own name, or a front's): the request
    checked once, then the worker of its mode."""
    r = check_attention_request(
        fn, q, k, v, ulysses_axis=ulysses_axis, ring_axis=ring_axis, tp_axis=tp_axis,
        layout=layout, text_len=text_len, text_position=text_position,
        text_lengths=text_lengths, options=kernel_options,
    )
    options = r.options
    if ulysses_axis is None and ring_axis is None:
        kv_lengths = options.pop("kv_lengths", None)
        segment_ids = options.pop("segment_ids", None)
        return _one_device(q, k, v, text_len=r.text_len, text_position=text_position,
                           text_lengths=r.text_lengths, kv_lengths=kv_lengths,
                           segment_ids=segment_ids, mask=r.mask, **options)
    if ring_axis is None:
        scale = options.pop("scale", None)
        if r.mask is not None:
            options["mask"] = r.mask
        return ulysses(q, k, v, sp_axis_name=ulysses_axis, sp=r.U, text_len=r.text_len,
                       text_position=text_position, text_lengths=r.text_lengths,
                       kv_lengths=r.kv_lengths, scale=scale, kernel_options=options)
    ring_options = dict(causal=False, segment_ids=None, sinks=None, window=None, scale=None,
                        logits_soft_cap=None, implementation="auto")
    ring_options.update(options)
    if ulysses_axis is not None:
        return usp(q, k, v, ulysses_axis=ulysses_axis, ring_axis=ring_axis, U=r.U, R=r.R,
                   layout=layout, text_len=r.text_len, mask=r.mask,
                   text_position=text_position, text_lengths=r.text_lengths,
                   kv_lengths=r.kv_lengths, **ring_options)
    if r.text_len:
        return ring_joint(q, k, v, axis_name=ring_axis, sp_size=r.R, layout=layout,
                          text_len=r.text_len, tile_mask=r.mask, text_position=text_position,
                          text_lengths=r.text_lengths, kv_lengths=r.kv_lengths, **ring_options)
    return ring(q, k, v, axis_name=ring_axis, sp_size=r.R, layout=layout, tile_mask=r.mask,
                kv_lengths=r.kv_lengths, **ring_options)
