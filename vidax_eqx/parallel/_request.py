"""The one check of a sequence-parallel request: every argument of an attention over a
sequence split by role (Ulysses, a ring, both, or none), checked once, before any
worker runs.

[`sequence_attention`][] and its documented fronts (`sequence_parallel_self_attention`,
`sequence_parallel_joint_self_attention`, `ring_attention`, `usp_attention`) call
`check_attention_request` with their own name, so that a message names the function
the user called; it returns a `Request` holding the checked values, and the workers
(`_ulysses.ulysses`, `_ring_engine.ring`, `_joint.ring_joint`, `_usp.usp`) compute
without checking again. What the workers still ask is whether the kernel serves the
calls they make (`kernels.internal.check_request` on their own operands): that depends
on how they split the work, not on the arguments. `check_ring` is also what
`make_ring_attention`'s kernels check before they run the ring.

Each rule is stated once, here or in `_checks.py` / `_layout.py` / `_mesh.py`, with one
message: the rule, what was received, the fix.
"""

import dataclasses
from collections.abc import Hashable
from typing import Any

import jax.numpy as jnp
import numpy as np

from .. import kernels
from ..kernels.internal import check_request  # what `kernels.attention` would raise, once
from ..kernels.internal import STRUCTURED_MASKS
from .._checks import static_int
from ._checks import (
    check_head_split, check_lengths, check_no_text_lengths, check_qkv, check_sinks,
    check_text_position, check_tile_mask,
)
from ._layout import check_layout, check_zigzag_length, layout_parts
from ._mesh import axis_size, check_sharded
from ._rank_masks import RankMasks, tile_masks


# The keyword options of a ring (and of USP) besides the request's own.
RING_OPTIONS = ("causal", "segment_ids", "sinks", "window", "scale", "logits_soft_cap",
                "implementation", "kv_lengths")


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
    """A checked request: the mode's axes and their sizes (`U`, `R`: 1 without the axis),
    the joint layout, the key-only padding as int32 `(B,)` arrays (or `None`), the
    sliding tile mask as this device's tensor-parallel rank sees it, and the remaining
    kernel options (checked: `sinks` an array)."""

    fn: str
    ulysses_axis: Hashable | None
    ring_axis: Hashable | None
    U: int
    R: int
    layout: str
    text_len: int
    text_position: str
    text_lengths: Any
    kv_lengths: Any
    mask: Any
    options: dict


def _local_tile_mask(fn: str, mask, heads_local: int, tp_axis, ulysses_axis):
    """A `SlidingTileMask` with per-head windows, as the heads of this device's
    tensor-parallel rank see it (`RankMasks` when the ranks' windows differ)."""
    tp = 1 if tp_axis is None else axis_size(tp_axis, what="Tensor-parallel")
    mask.check_heads(heads_local * tp, fn)
    if mask.heads is None or tp == 1:
        return mask
    masks = RankMasks.of(mask, heads_local, tp_axis, tp)
    if isinstance(masks, RankMasks) and ulysses_axis is not None:
        raise NotImplementedError(
            f"{fn}: per-head SlidingTileMask windows that differ between tensor-parallel "
            "ranks under Ulysses (both split the heads) are not supported; use one window "
            "for all heads, equal windows per TP rank, or a ring alone."
        )
    return masks


def _check_text_len(fn: str, text_len: int, S_local: int, text_position: str) -> None:
    if not 0 <= text_len <= S_local:
        side = ("text prefix + visual chunk" if text_position == "prefix"
                else "visual chunk + text suffix")
        raise ValueError(
            f"{fn}: `text_len` must be between 0 and the per-device sequence length "
            f"{S_local} ({side}, q.shape[1]); received text_len={text_len}."
        )


def _check_suffix_tile_mask(fn: str, text_len: int, text_position: str, mask, causal,
                            window) -> None:
    """A text suffix runs a `SlidingTileMask` as the prefix layout with the text moved:
    no positional mask can go with it."""
    if text_len and text_position == "suffix" and mask is not None and (
            causal or window is not None):
        raise NotImplementedError(
            f"{fn}: the joint layout with text_position='suffix' and a SlidingTileMask does not "
            f"serve causal or window masks (received causal={bool(causal)}, window={window}); "
            "use text_position='prefix' for that combination."
        )


def _ring_options(fn: str, options: dict) -> None:
    if options.get("quantize") is not None:
        raise NotImplementedError(
            f"{fn}: int8 attention (quantize={options['quantize']!r}) runs on one device or "
            "under Ulysses (ulysses_axis=...), not on a ring; received a ring_axis.")
    options.pop("quantize", None)
    extra = sorted(set(options) - set(RING_OPTIONS))
    if extra:
        raise TypeError(
            f"{fn}: a ring takes the kernel options {RING_OPTIONS} besides the request's own; "
            f"received {extra}. Run a bias or positions with Ulysses alone (ulysses_axis=...)."
        )


def check_attention_request(
    fn: str, q, k, v, *, ulysses_axis=None, ring_axis=None, tp_axis=None,
    layout: str = "contiguous", text_len: int = 0, text_position: str = "prefix",
    text_lengths=None, options: dict,
) -> Request:
    """Checks the arguments of [`sequence_attention`][] (called as `fn`) and returns them
    as a `Request`; raises as the function documents."""
    options = dict(options)
    if ulysses_axis is not None and ulysses_axis == ring_axis:
        raise ValueError(
            f"{fn}: `ulysses_axis` and `ring_axis` must be two different mesh axes; received "
            f"{ulysses_axis!r} for both. Give one of them for one axis."
        )
    text_len = static_int("text_len", text_len)
    check_text_position(fn, text_position)
    mask = options.pop("mask", None)
    if isinstance(mask, kernels.SlidingTileMask) and (
            tp_axis is not None or (ulysses_axis is None and ring_axis is None)):
        mask = _local_tile_mask(fn, mask, jnp.shape(q)[2], tp_axis, ulysses_axis)
    if not text_len:
        check_no_text_lengths(fn, text_lengths)
    request = dict(fn=fn, ulysses_axis=ulysses_axis, ring_axis=ring_axis, U=1, R=1,
                   layout=layout, text_len=text_len, text_position=text_position)
    if ulysses_axis is None and ring_axis is None:
        if text_len:
            _check_text_len(fn, text_len, jnp.shape(q)[1], text_position)
            text_lengths = check_lengths(fn, "text_lengths", text_lengths, jnp.shape(q)[0],
                                         text_len, "text tokens per device")
        return Request(**request, text_lengths=text_lengths, kv_lengths=None, mask=mask,
                       options=options)
    if ring_axis is None:
        return _ulysses_request(request, q, k, v, text_lengths, mask, options)
    _ring_options(fn, options)
    if ulysses_axis is None and not text_len:
        R = axis_size(ring_axis, what="Ring")
        kv_lengths, sinks = check_ring(
            fn, q, k, v, axis_name=ring_axis, sp_size=R, layout=layout,
            segment_ids=options.get("segment_ids"), causal=options.get("causal", False),
            window=options.get("window"), scale=options.get("scale"),
            logits_soft_cap=options.get("logits_soft_cap"), tile_mask=mask,
            kv_lengths=options.pop("kv_lengths", None), sinks=options.get("sinks"),
        )
        options["sinks"] = sinks
        return Request(**dict(request, R=R), text_lengths=None, kv_lengths=kv_lengths,
                       mask=mask, options=options)
    return _ring_joint_or_usp_request(request, q, k, v, text_lengths, mask, options)


def _ulysses_request(request: dict, q, k, v, text_lengths, mask, options: dict) -> Request:
    """DeepSpeed-Ulysses, with or without a text: the heads split over the axis, every
    per-token option over the whole sequence after the `all_to_all`."""
    fn, axis, text_len = request["fn"], request["ulysses_axis"], request["text_len"]
    suffix = request["text_position"] == "suffix"
    U = axis_size(axis, what="Sequence-parallel")
    check_qkv(q, k, v, fn)
    B, S_local, H, _ = jnp.shape(q)
    _check_text_len(fn, text_len, S_local, request["text_position"])
    check_head_split(H, U, axis, fn)
    L_local = S_local - text_len
    if L_local:
        check_sharded(fn, (axis,), q=q, k=k, v=v)
    S = text_len + U * L_local
    text_lengths = check_lengths(fn, "text_lengths", text_lengths, B, text_len,
                                 "text tokens per device")
    kv_lengths = check_lengths(fn, "kv_lengths", options.pop("kv_lengths", None), B, S,
                               "keys of the whole sequence: text_len + sp * visual local length")
    if isinstance(mask, STRUCTURED_MASKS):
        _check_suffix_tile_mask(fn, text_len, request["text_position"], mask,
                                options.get("causal"), options.get("window"))
        _check_ulysses_tile_mask(fn, mask, S, H, U, text_len, request["text_position"])
    _check_per_token_options(fn, dict(options, mask=mask), B=B, S_local=S_local, S=S, H=H)
    return Request(**dict(request, U=U), text_lengths=text_lengths, kv_lengths=kv_lengths,
                   mask=mask, options=options)


def _check_ulysses_tile_mask(fn: str, tile_mask, S: int, H: int, sp: int, text_len: int,
                             position: str) -> None:
    """A structured mask (`SlidingTileMask`, `BlockCausalMask`) over the whole gathered
    sequence `[text_len text; visual]` (or `[visual; text]`) of `S` tokens: the mask's
    layout, the video padded at its end by fewer than `sp` tokens."""
    tile_mask.check_heads(H, fn)
    kind = type(tile_mask).__name__
    if text_len and (tile_mask.text_len != text_len or tile_mask.text_position != position):
        raise ValueError(
            f"{fn}: the joint layout puts a text {position} of text_len={text_len} tokens "
            f"{'before' if position == 'prefix' else 'after'} the video, so the {kind} "
            f"needs text_len={text_len}, text_position={position!r}; received "
            f"text_len={tile_mask.text_len}, text_position={tile_mask.text_position!r}."
        )
    if not tile_mask.seq_len <= S < tile_mask.seq_len + sp:
        raise ValueError(
            f"{fn}: the {kind} lays out {tile_mask.seq_len} tokens ({tile_mask!r}), but the "
            f"devices hold {S} in all. The whole sequence must be the mask's, padded at the end "
            f"to a multiple of sp={sp} (pad_to_multiple; padding is invisible)."
        )


def _check_per_token_options(fn: str, opts: dict, *, B: int, S_local: int, S: int,
                             H: int) -> None:
    """Ulysses' per-device kernel options, before they become the options of the one
    kernel call over the whole sequence: segment ids and positions of this device's
    tokens, sinks of every head, a bias or mask over the whole sequence."""
    seg = opts.get("segment_ids")
    if seg is not None:
        pairs = (("segment_ids.q", seg.q), ("segment_ids.kv", seg.kv)) if isinstance(
            seg, kernels.SegmentIds) else (("segment_ids", seg),)
        for name, s in pairs:
            if jnp.shape(s) != (B, S_local):
                raise ValueError(
                    f"{fn}: `{name}` holds this device's tokens, shape (B, S_local) = "
                    f"{(B, S_local)} (the same tokens as `q`); received {jnp.shape(s)}. Shard "
                    "segment ids exactly as the sequence (e.g. in_specs P(None, 'sp'))."
                )
    for name in ("q_positions", "kv_positions"):
        pos = opts.get(name)
        if pos is not None and jnp.shape(pos) != (S_local,):
            raise ValueError(
                f"{fn}: `{name}` holds this device's token positions, shape (S_local,) = "
                f"({S_local},); received {jnp.shape(pos)}. Omit it for the default "
                "(the global arange of the whole sequence)."
            )
    sinks = opts.get("sinks")
    if sinks is not None and jnp.shape(sinks) != (H,):
        raise ValueError(
            f"{fn}: `sinks` must have shape (H,) = ({H},), one logit per query head; "
            f"received {jnp.shape(sinks)}."
        )
    for name in ("bias", "mask"):
        x = opts.get(name)
        if x is None or isinstance(x, STRUCTURED_MASKS):
            continue
        shape = jnp.shape(x)
        full = (B, H, S, S)
        if len(shape) > 4 or any(got not in (1, want) for got, want in zip(shape[::-1], full[::-1])):
            raise ValueError(
                f"{fn}: `{name}` is over the whole sequence after the all_to_all: it must "
                f"broadcast to (B, H, S, S) = {full} (S = text_len + sp * L_visual_local, "
                f"every device passing the same array); received shape {shape}. A bias over "
                "this device's chunk only cannot be expressed; use segment ids for padding."
            )


def check_ring(
    fn: str, q, k, v, *, axis_name, sp_size: int, layout, segment_ids, causal, window, scale,
    logits_soft_cap, tile_mask, kv_lengths, sinks, step_mask: bool = False,
):
    """The checks of a ring without a text (`ring_attention`, `make_ring_attention`'s
    kernels): returns `(kv_lengths, sinks)` checked. `step_mask`: the call adds a boolean
    mask to every step's kernel (the kernel must serve `mask=`)."""
    n = sp_size
    check_layout(layout)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    L_q, L_k = q.shape[1], k.shape[1]
    check_tile_mask(fn, tile_mask, n * L_q, q.shape[2], layout_parts(layout) * n)
    if tile_mask is not None and L_q != L_k:
        raise ValueError(
            f"{fn}: a {type(tile_masks(tile_mask)[0]).__name__} is a self-attention mask: q "
            f"and k/v must hold the same local length; received q: {q.shape}, k: {k.shape}."
        )
    check_sharded(fn, (axis_name,), q=q if L_q else None, k=k if L_k else None,
                  v=v if L_k else None)
    kv_lengths = check_lengths(fn, "kv_lengths", kv_lengths, k.shape[0], n * L_k,
                               "keys of the whole sequence: sp_size * local length of k")
    # The arguments themselves, as given (xla serves every feature): messages name them.
    check_request(
        q, k, v, segment_ids=segment_ids,
        q_positions=jnp.arange(L_q, dtype=jnp.int32), kv_positions=jnp.arange(L_k, dtype=jnp.int32),
        causal=causal, window=window, scale=scale, logits_soft_cap=logits_soft_cap,
        mask=jnp.ones((1, 1), bool) if step_mask else tile_masks(tile_mask)[0],
        implementation="xla", needs_lse=True,
    )
    if layout == "zigzag":
        for what, length in (("local length of q", L_q), ("local length of k/v", L_k)):
            check_zigzag_length(
                length, what,
                f"Pad the global sequence to a multiple of 2 * sp_size = {2 * n} before "
                "zigzag_permute (pad_to_multiple, padding_segment_ids).",
            )
    return kv_lengths, check_sinks(fn, sinks, q.shape[2])


def check_joint_tile_mask(fn: str, tile_mask, text_len: int, visual_len: int, heads: int,
                          unit: int, text_position: str = "prefix") -> None:
    """A `SlidingTileMask` for the joint layout: text of `text_len` tokens on the side
    `text_position` says, and the global visual sequence (`visual_len`) its video,
    padded by fewer than `unit` tiles."""
    if tile_mask is None:
        return
    if isinstance(tile_mask, RankMasks):
        for mask in tile_mask.masks:
            check_joint_tile_mask(fn, mask, text_len, visual_len, heads, unit, text_position)
        return
    check_tile_mask(fn, tile_mask, visual_len, heads, unit, what="video")
    if tile_mask.text_len != text_len or (text_len and tile_mask.text_position != text_position):
        raise ValueError(
            f"{fn}: in the joint layout the text is a {text_position} of text_len={text_len} "
            f"tokens, so the SlidingTileMask needs text_len={text_len}, "
            f"text_position={text_position!r}; received text_len={tile_mask.text_len}, "
            f"text_position={tile_mask.text_position!r}."
        )


def _ring_joint_or_usp_request(request: dict, q, k, v, text_lengths, mask,
                               options: dict) -> Request:
    """A ring with a text (the joint layout), or USP (Ulysses within each ring rank's
    group, with or without a text): self-attention, the text never travelling."""
    fn, text_len, position = request["fn"], request["text_len"], request["text_position"]
    ulysses_axis, ring_axis, layout = (request["ulysses_axis"], request["ring_axis"],
                                       request["layout"])
    U = 1 if ulysses_axis is None else axis_size(ulysses_axis, what="Ulysses")
    R = axis_size(ring_axis, what="Ring")
    check_layout(layout)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    check_qkv(q, k, v, fn)
    B, S_local, H, _ = q.shape
    if ulysses_axis is not None:
        check_head_split(H, U, ulysses_axis, fn)
    _check_text_len(fn, text_len, S_local, position)
    L = S_local - text_len  # this device's visual tokens
    text_lengths = check_lengths(fn, "text_lengths", text_lengths, B, text_len,
                                 "text tokens per device")
    devices = "sp_size" if ulysses_axis is None else "U * R"
    kv_lengths = check_lengths(
        fn, "kv_lengths", options.pop("kv_lengths", None), B, text_len + U * R * L,
        f"keys of the whole sequence: text_len + {devices} * visual local length")
    if L:
        check_sharded(fn, tuple(a for a in (ring_axis, ulysses_axis) if a is not None),
                      q=q, k=k, v=v)
    segment_ids = options.get("segment_ids")
    if ulysses_axis is not None:
        _check_usp_segment_ids(fn, segment_ids, B, S_local)
    # The arguments themselves, as given (xla serves every feature): messages name them.
    pos = jnp.arange(S_local, dtype=jnp.int32)
    check_request(
        q, k, v, segment_ids=segment_ids, q_positions=pos, kv_positions=pos,
        causal=options.get("causal", False), window=options.get("window"),
        scale=options.get("scale"), logits_soft_cap=options.get("logits_soft_cap"),
        implementation="xla", needs_lse=True,
    )
    if layout == "zigzag":
        if ulysses_axis is None:
            check_zigzag_length(
                L, "visual local length q.shape[1] - text_len",
                f"Pad the global visual sequence to a multiple of 2 * sp_size = {2 * R} before "
                "zigzag_permute (pad_to_multiple, padding_segment_ids); the text is "
                "neither padded nor permuted.",
            )
        elif (U * L) % 2:
            raise ValueError(
                f"{fn}: the zigzag layout cuts each ring rank's share (U * L_local = {U} * {L} "
                f"tokens) into two halves, so it must be even; received {U * L}. Pad the global "
                f"(visual) sequence to a multiple of lcm(2 * R, U * R) = {np.lcm(2 * R, U * R)} "
                "(pad_to_multiple, padding_segment_ids) before zigzag_permute(x, 1, R)."
            )
    options["sinks"] = check_sinks(fn, options.get("sinks"), H)
    if mask is not None:
        if not L:
            raise ValueError(f"{fn}: a SlidingTileMask needs video tokens; this call holds "
                             "text only.")
        unit = layout_parts(layout) * R * U  # at most one tile per device and chunk
        if text_len:
            check_joint_tile_mask(fn, mask, text_len, R * U * L, H, unit, position)
        else:
            check_tile_mask(fn, mask, R * U * L, H, unit)
        _check_suffix_tile_mask(fn, text_len, position, mask, options.get("causal"),
                                options.get("window"))
    return Request(**dict(request, U=U, R=R), text_lengths=text_lengths, kv_lengths=kv_lengths,
                   mask=mask, options=options)


def _check_usp_segment_ids(fn: str, segment_ids, B: int, S_local: int) -> None:
    """USP gathers the visual ids over the Ulysses group as int32."""
    if segment_ids is None:
        return
    if isinstance(segment_ids, kernels.SegmentIds):
        pairs = (("segment_ids.q", segment_ids.q), ("segment_ids.kv", segment_ids.kv))
    else:
        pairs = (("segment_ids", segment_ids),)
    for name, s in pairs:
        s = jnp.asarray(s)
        if (s.shape != (B, S_local) or not jnp.issubdtype(s.dtype, jnp.integer)
                or jnp.iinfo(s.dtype).max > 2**31 - 1):  # uint32 ids would wrap to padding
            raise ValueError(
                f"{fn}: `{name}` holds this device's tokens: ints that fit int32, (B, S_local) = "
                f"{(B, S_local)}, sharded exactly like `q` (text prefix included in the joint "
                f"layout); received {s.dtype} {s.shape}."
            )

