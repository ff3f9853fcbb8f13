"""Key-only padding as segment ids: keys hidden from every query, every query computed.

`kv_lengths` (keys at a global index `>= kv_lengths[b]` invisible) and `text_lengths`
(text keys at an index `>= text_lengths[b]` within the text block invisible) hide
keys only: a hidden key is seen by no query, and every query row, its own
included, is still computed. Where the hidden keys are the tail of what one kernel
call sees (the whole sequence after Ulysses' all-to-all with `kv_lengths` or a text
suffix; the text block of the joint layouts), the kernels' own `kv_lengths` serves
them. Elsewhere (a ring's blocks, a zigzag layout, a text prefix under Ulysses) the
parallel layer gives the hidden keys the segment id `-1` and the queries keep theirs
(`0` when the caller gave none): separate query and key ids, which every kernel
implementation takes and which travel the ring with their K/V block. `-1` never
equals a query's id, and a query's own id is untouched, so no query row is emptied
by this.
"""

import jax.numpy as jnp

from .._vma import as_varying, varying_axes


def hide_keys(seg_q, seg_kv, visible, q_len: int):
    """`(seg_q, seg_kv)` int32 with the keys where `visible` (bool `(B, L_k)`) is
    False given the id -1; a missing side becomes zeros (`seg_q`: `(B, q_len)`).
    `visible=None` returns the ids unchanged."""
    if visible is None:
        return seg_q, seg_kv
    B, L_k = visible.shape
    axes = varying_axes(visible, seg_q, seg_kv)
    if seg_kv is None:
        seg_kv = jnp.zeros((B, L_k), jnp.int32)
    if seg_q is None:
        seg_q = jnp.zeros((B, q_len), jnp.int32)
    seg_kv = jnp.where(visible, seg_kv.astype(jnp.int32), -1)
    return as_varying((seg_q.astype(jnp.int32), seg_kv), axes)


def below(lengths, index):
    """bool `(B, len(index))`: `index < lengths[b]` (`lengths` int `(B,)`, `index` int
    `(L,)` global key indices); `None` when `lengths` is `None`."""
    if lengths is None:
        return None
    return jnp.asarray(index, jnp.int32)[None, :] < lengths[:, None]
