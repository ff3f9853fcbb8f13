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
"""

from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from .. import kernels
from .._order import Sequence
from ._checks import (
    check_head_split, check_lengths, check_no_text_lengths, check_qkv, check_sinks,
    check_text_position, check_tile_mask,
)
from .._checks import static_int
from ._joint import check_joint_tile_mask, join_joint, joint_attention, split_joint
from ._layout import check_layout, layout_parts
from ._mesh import axis_size, check_sharded
from ._rank_masks import RankMasks
from ._ring_engine import run_ring
from ._ulysses import kv_head_repeats, local_heads, match_vma


_FN = "usp_attention"


# -- the public function -------------------------------------------------------------


def _split_segments(segment_ids, *, B: int, S_local: int, text_len: int, ulysses_axis, order,
                    text_position: str = "prefix"):
    """This device's ids `(B, text_len + L)` -> `(text q, text kv, visual q, visual kv)`,
    the visual parts gathered over the Ulysses group to `(B, U * L)`."""
    if segment_ids is None:
        return None, None, None, None
    if isinstance(segment_ids, kernels.SegmentIds):
        pairs = (("segment_ids.q", segment_ids.q), ("segment_ids.kv", segment_ids.kv))
    else:
        pairs = (("segment_ids", segment_ids),)
    parts = []
    for name, s in pairs:
        s = jnp.asarray(s)
        if (s.shape != (B, S_local) or not jnp.issubdtype(s.dtype, jnp.integer)
                or jnp.iinfo(s.dtype).max > 2**31 - 1):  # uint32 ids would wrap to padding
            raise ValueError(
                f"{_FN}: `{name}` holds this device's tokens: ints that fit int32, (B, S_local) = "
                f"{(B, S_local)}, sharded exactly like `q` (text prefix included in the joint "
                f"layout); received {s.dtype} {s.shape}."
            )
        text, visual = split_joint(s.astype(jnp.int32), text_len, text_position)
        visual = order(lax.all_gather, visual, ulysses_axis, axis=1, tiled=True)
        parts.append((text, visual))
    (tq, vq), (tkv, vkv) = parts[0], parts[-1]
    return tq, tkv, vq, vkv


def usp_attention(
    q: Float[Array, "B S_local H D"],
    k: Float[Array, "B S_local H_kv D"],
    v: Float[Array, "B S_local H_kv D"],
    *,
    ulysses_axis: Hashable,
    ring_axis: Hashable,
    causal: bool = False,
    segment_ids: kernels.SegmentIds | Int[Array, "B S_local"] | None = None,
    sinks: Float[Array, " H"] | None = None,
    window: tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    layout: str = "contiguous",
    text_len: int = 0,
    mask: kernels.SlidingTileMask | None = None,
    implementation: str | kernels.AbstractImplementation = "auto",
    text_position: str = "prefix",
    text_lengths: Int[Array, " B"] | None = None,
    kv_lengths: Int[Array, " B"] | None = None,
) -> Float[Array, "B S_local H D"]:
    """2D sequence-parallel self-attention: Ulysses over `ulysses_axis`, ring over
    `ring_axis`, inside `jax.shard_map`.

    For meshes where the sequence-parallel degree exceeds what either method
    serves alone (Ulysses is capped by the head count). With `U` and `R` the sizes
    of the two axes, the global sequence is sharded over both, **ring-major**:
    `in_specs=PartitionSpec(None, (ring_axis, ulysses_axis))`, so the device with
    ring rank `r` and Ulysses rank `u` holds chunk `r * U + u`. An `all_to_all`
    within the Ulysses group gives each device ring rank `r`'s contiguous share of
    the sequence for `H / U` heads, [`ring_attention`][] over `ring_axis` attends
    it to the whole sequence, and the inverse `all_to_all` restores the layout.
    The result and its gradients equal single-device attention over the whole
    sequence.

    **Arguments:**

    - `q`: this device's queries `(B, S_local, H, D)`; `H` must be a multiple of `U`.
    - `k`, `v`: `(B, S_local, H_kv, D)`, GQA / MQA with `H % H_kv == 0`: kv heads are
        repeated only as far as the Ulysses split needs ([`kv_head_repeats`][] with
        `U`), and travel the ring with `H_kv * repeats / U` heads.
    - `ulysses_axis`, `ring_axis`: two different mesh axes, e.g. from
        `make_mesh(sp=U, extra_axes={"ring": R})`: `SP_AXIS` and `"ring"`.
    - `causal`, `window`, `scale`, `logits_soft_cap`, `implementation`: as in
        [`ring_attention`][], on global token positions.
    - `segment_ids`: this device's ids, `(B, S_local)` or `SegmentIds(q=..., kv=...)`,
        sharded exactly like `q`; negative ids are padding.
    - `sinks`: per-head sink logits `(H,)`, replicated (`PartitionSpec()`); each
        device uses its heads' slice; the gradient is the single-device one.
    - `layout`: `"contiguous"`, or `"zigzag"` to balance causal work over the ring.
        For zigzag, permute every global sequence-indexed array (q, k, v, segment
        ids, the output cotangent) with `zigzag_permute(x, 1, R)` (the **ring**
        size, not `U * R`) before sharding it ring-major, and undo with
        `zigzag_unpermute(out, 1, R)`. Then ring rank `r`'s `U` devices hold, in
        Ulysses order, the two zigzag chunks `r` and `2R - 1 - r`, which is what
        the ring expects after the `all_to_all`.
    - `text_len`: the joint (CogVideoX) layout when `> 0`: each device's arrays are
        `[text prefix (text_len tokens, the same on every device); this device's
        visual chunk]`, and the visual sequence alone is sharded (and, for zigzag,
        permuted) as above. The result equals single-device attention over
        `[text; visual]`, text at positions `0 .. text_len - 1`. Segment ids follow
        the same per-device layout.
    - `mask`: a [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask] over the
        global sequence (in the joint layout its `text_len` is the prefix's), as
        in [`ring_attention`][]; per-head windows follow their heads to the
        Ulysses ranks (each kernel call picks its rank's windows).
    - `text_position`: `"prefix"` (default) or `"suffix"`, as in [`ring_attention`][]:
        with `"suffix"` each device's arrays are `[its visual chunk; text]` and the result
        equals single-device attention over `[visual; text]`.
    - `text_lengths`: int `(B,)`, key-only padding of the text, as in
        [`ring_attention`][].
    - `kv_lengths`: int `(B,)`, keys at a global index `>= kv_lengths[b]` (in the
        single-device sequence, ring-major order undone) invisible to every query, every
        query computed, as in [`ring_attention`][].

    **Returns:**

    This device's output `(B, S_local, H, D)` in `q`'s dtype. In the joint layout
    its first `text_len` rows (last, for a suffix) are the text output, bitwise
    identical on every device; [`replicated`][] with `(ring_axis, ulysses_axis)`
    returns them from `shard_map` with `out_specs=P()`.

    **Any token count:** pad the global (visual) sequence to a multiple of `U * R`
    (contiguous) or `lcm(2 * R, U * R)` (zigzag) with `pad_to_multiple`, hide the
    padding with `padding_segment_ids(length, multiple, batch)` and `unpad` the
    output.

    **Joint layout, how it runs and its gradients:** the text tokens never travel.
    Each device takes its heads of the text (no communication); visual queries
    meet the text keys in one local kernel call; text queries meet this device's
    visual share in one local kernel call whose partial `(out, lse)` are
    all-gathered over the ring and merged in a fixed order (so all devices agree
    bitwise); the text x text block is computed locally. All partial results are
    merged by log-sum-exp in float32, and a custom VJP runs every block's backward
    (and the ring backward) with the merged `out` and `lse`, so gradients are
    exact. As in `sequence_parallel_joint_self_attention`, the text rows are
    copies: the gradient with respect to the replicated text inputs is the sum over
    the devices' copies (what `shard_map` gives for a replicated input), and the
    cotangent of the text output is the sum of the copies' cotangents (give every
    copy its share, or the whole cotangent to one copy; never count it once per
    device). The text x text gradient is kept on ring rank 0 only.

    **Raises:**

    `ValueError` when either axis is not bound in the current `shard_map` (naming
    it), when both names are the same axis, when `H` is not a multiple of `U`, for
    an unknown `layout`, a zigzag share of odd length, a bad `text_len`, an unknown
    `text_position`, `text_lengths` / `kv_lengths` that are not integer `(B,)` arrays in
    range, or shapes that do not fit; the kernel's errors for invalid options.
    """
    U = axis_size(ulysses_axis, what="Ulysses")
    R = axis_size(ring_axis, what="Ring")
    if ulysses_axis == ring_axis:
        raise ValueError(
            f"{_FN}: `ulysses_axis` and `ring_axis` must be two different mesh axes; received "
            f"{ulysses_axis!r} for both. Use `sequence_parallel_self_attention` or "
            "`ring_attention` for one axis."
        )
    check_layout(layout)
    text_len = static_int("text_len", text_len)
    check_text_position(_FN, text_position)
    if not text_len:
        check_no_text_lengths(_FN, text_lengths)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    check_qkv(q, k, v, _FN)
    B, S_local, H, D = q.shape
    H_kv = k.shape[2]
    check_head_split(H, U, ulysses_axis, _FN)
    side = "text prefix + visual chunk" if text_position == "prefix" else "visual chunk + text suffix"
    if not 0 <= text_len <= S_local:
        raise ValueError(
            f"{_FN}: `text_len` must be between 0 and the per-device sequence length "
            f"{S_local} ({side}, q.shape[1]); received text_len={text_len}."
        )
    L = S_local - text_len  # this device's visual tokens
    text_lengths = check_lengths(_FN, "text_lengths", text_lengths, B, text_len,
                                 "text tokens per device")
    kv_lengths = check_lengths(_FN, "kv_lengths", kv_lengths, B, text_len + U * R * L,
                               "keys of the whole sequence: text_len + U * R * visual local length")
    if L:
        check_sharded(_FN, (ring_axis, ulysses_axis), q=q, k=k, v=v)
    if layout == "zigzag" and (U * L) % 2:
        multiple = np.lcm(2 * R, U * R)
        raise ValueError(
            f"{_FN}: the zigzag layout cuts each ring rank's share (U * L_local = {U} * {L} "
            f"tokens) into two halves, so it must be even; received {U * L}. Pad the global "
            f"(visual) sequence to a multiple of lcm(2 * R, U * R) = {multiple} "
            "(pad_to_multiple, padding_segment_ids) before zigzag_permute(x, 1, R)."
        )
    sinks = check_sinks(_FN, sinks, H)

    heads_local = H // U
    unit = None
    if mask is not None:
        unit = layout_parts(layout) * R * U  # at most one tile per device and chunk
        if text_len:
            check_joint_tile_mask(_FN, mask, text_len, R * U * L, H, unit, text_position)
        else:
            check_tile_mask(_FN, mask, R * U * L, H, unit)
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
        segment_ids, B=B, S_local=S_local, text_len=text_len, ulysses_axis=ulysses_axis,
        order=order, text_position=text_position,
    )
    if sinks is not None:
        sinks = local_heads(match_vma(sinks, q), 0, heads_local, ulysses_axis)
    opts = dict(causal=bool(causal), window=None if window is None else tuple(window),
                scale=scale, logits_soft_cap=logits_soft_cap, implementation=implementation)

    with jax.named_scope("vidax_usp_attention"):
        if L == 0:  # text only: every device attends its heads of the text to itself
            if mask is not None:
                raise ValueError(
                    f"{_FN}: a SlidingTileMask needs video tokens; this call holds text only."
                )
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
            out_v = run_ring(q_v, k_v, v_v, axis_name=ring_axis, segment_ids=seg, sinks=sinks,
                             layout=layout, tile_mask=mask, tile_unit=unit,
                             kv_lengths=kv_lengths, **opts)
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
