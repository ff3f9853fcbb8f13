"""2D ("USP") sequence parallelism: Ulysses over one mesh axis, ring over another.

Ulysses splits heads, so its degree is capped by the head count; ring attention
splits the sequence but moves K/V around the whole ring. `usp_attention` runs
both at once on a mesh with a Ulysses axis of size `U` and a ring axis of size
`R` (`U * R` devices for one sequence):

1. the global sequence is sharded over both axes, ring-major
   (`PartitionSpec(None, (ring_axis, ulysses_axis))`: the device with ring rank
   `r` and Ulysses rank `u` holds chunk `r * U + u`);
2. an `all_to_all` inside each Ulysses group trades the sequence split for a
   head split: the device then holds ring rank `r`'s contiguous share of the
   sequence (`U` chunks, in order) for `H / U` heads;
3. [`ring_attention`][] over `ring_axis` attends that share to the whole
   sequence, for those heads;
4. the inverse `all_to_all` gives the output back the input's layout.

The joint (CogVideoX) layout, a replicated text prefix before each device's
visual chunk, is served by the same steps for the visual tokens plus text
blocks that never travel: after step 2 each device runs the joint core that
`ring_attention(..., text_len=...)` runs (`_joint.py`) on its heads; see
[`usp_attention`][].

This file is the worker, `usp`, that [`sequence_attention`][] calls on a checked request
(`_request.py`); the documented front is in `_fronts.py`.
"""

import jax
import jax.numpy as jnp
from jax import lax

from .. import kernels
from .._order import Sequence
from ._joint import join_joint, joint_attention, split_joint
from ._rank_masks import RankMasks
from ._ring_engine import ring
from ._ulysses import kv_head_repeats, local_heads, match_vma


def _split_segments(segment_ids, *, text_len: int, ulysses_axis, order,
                    text_position: str = "prefix"):
    """This device's ids `(B, text_len + L)` -> `(text q, text kv, visual q, visual kv)`,
    the visual parts gathered over the Ulysses group to `(B, U * L)`."""
    if segment_ids is None:
        return None, None, None, None
    if isinstance(segment_ids, kernels.SegmentIds):
        pairs = (segment_ids.q, segment_ids.kv)
    else:
        pairs = (segment_ids,)
    parts = []
    for s in pairs:
        s = jnp.asarray(s)
        text, visual = split_joint(s.astype(jnp.int32), text_len, text_position)
        visual = order(lax.all_gather, visual, ulysses_axis, axis=1, tiled=True)
        parts.append((text, visual))
    (tq, vq), (tkv, vkv) = parts[0], parts[-1]
    return tq, tkv, vq, vkv


def usp(q, k, v, *, ulysses_axis, ring_axis, U: int, R: int, causal, segment_ids, sinks,
        window, scale, logits_soft_cap, layout, text_len: int, mask, implementation,
        text_position: str, text_lengths, kv_lengths):
    """The USP worker of [`sequence_attention`][] (`usp_attention`), on a checked request
    (`_request.py`): `U`, `R` the sizes of `ulysses_axis` and `ring_axis`, `sinks` an
    array or `None`, the key-only padding int32 `(B,)` or `None`."""
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    B, S_local, H, D = q.shape
    H_kv = k.shape[2]
    L = S_local - text_len  # this device's visual tokens
    heads_local = H // U
    if mask is not None:
        # Per-head windows follow their heads to the Ulysses ranks.
        mask = RankMasks.of(mask, heads_local, ulysses_axis, U)
    repeats = kv_head_repeats(H, H_kv, U)
    if repeats > 1:  # consecutive copies: query head h keeps kv head h // (H // H_kv)
        k, v = jnp.repeat(k, repeats, axis=2), jnp.repeat(v, repeats, axis=2)
    kv_heads_local = H_kv * repeats // U

    def text_heads(x, n):
        return local_heads(split_joint(x, text_len, text_position)[0], 2, n, ulysses_axis)

    # Every collective below waits for the one before it (`vidax_eqx._order`); the
    # ring's own permutes wait for its inputs.
    order = Sequence(q, k, v, sinks, jax.tree.leaves(segment_ids))

    def seq_to_heads(x):
        """(B, L, H, D) visual -> (B, U * L, H / U, D): ring rank r's share."""
        return order(lax.all_to_all, split_joint(x, text_len, text_position)[1], ulysses_axis,
                     split_axis=2, concat_axis=1, tiled=True)

    sq_t, skv_t, sq_v, skv_v = _split_segments(
        segment_ids, text_len=text_len, ulysses_axis=ulysses_axis, order=order,
        text_position=text_position,
    )
    if sinks is not None:
        sinks = local_heads(match_vma(sinks, q), 0, heads_local, ulysses_axis)
    opts = dict(causal=bool(causal), window=None if window is None else tuple(window),
                scale=scale, logits_soft_cap=logits_soft_cap, implementation=implementation)

    with jax.named_scope("vidax_usp_attention"):
        if L == 0:  # text only: every device attends its heads of the text to itself
            lengths = text_lengths
            if kv_lengths is not None:
                lengths = kv_lengths if lengths is None else jnp.minimum(lengths, kv_lengths)
            out_t = kernels.attention(
                text_heads(q, heads_local), text_heads(k, kv_heads_local),
                text_heads(v, kv_heads_local), sinks=sinks,
                segment_ids=None if sq_t is None else kernels.SegmentIds(q=sq_t, kv=skv_t),
                kv_lengths=lengths, **opts,
            )
            return order(lax.all_gather, out_t, ulysses_axis, axis=2, tiled=True)

        q_v, k_v, v_v = seq_to_heads(q), seq_to_heads(k), seq_to_heads(v)
        if text_len == 0:
            seg = None if sq_v is None else kernels.SegmentIds(q=sq_v, kv=skv_v)
            out_v = ring(q_v, k_v, v_v, axis_name=ring_axis, sp_size=R, segment_ids=seg,
                         sinks=sinks, layout=layout, tile_mask=mask, kv_lengths=kv_lengths,
                         **opts)
        else:
            out_t, out_v = joint_attention(
                text_heads(q, heads_local), text_heads(k, kv_heads_local),
                text_heads(v, kv_heads_local), q_v, k_v, v_v, sinks, sq_t, skv_t, sq_v, skv_v,
                text_len=text_len, axis_name=ring_axis, sp_size=R, layout=layout,
                tile_mask=mask, text_position=text_position, text_lengths=text_lengths,
                kv_lengths=kv_lengths, **opts,
            )
        out_v = order(lax.all_to_all, out_v, ulysses_axis, split_axis=1, concat_axis=2,
                      tiled=True)
        if text_len == 0:
            return out_v
        out_t = order(lax.all_gather, out_t, ulysses_axis, axis=2, tiled=True)
        return join_joint(out_t, out_v, text_position)
