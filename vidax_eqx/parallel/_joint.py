"""The joint (CogVideoX) layout on a ring: a text prefix that never travels.

Each device holds `[text prefix (text_len tokens, the same on every device); this
device's share of the visual sequence]`, the visual sequence alone sharded over
the ring (contiguous or zigzag). Single-device attention over `[text; visual]`
splits into four kinds of blocks, and each runs where its data already is:

- visual q x visual kv: the ring ([`ring_attention`][]'s engine, `_ring_engine.ring_forward`
  / `ring_backward`): only the visual K/V (and their segment ids) travel;
- visual q x text kv: one local kernel call per device (its own visual rows
  against the text keys it holds);
- text q x visual kv: one local kernel call per device against its own visual
  share; the `n` partial `(out, lse)` are all-gathered over the ring and merged
  in a fixed order (rank 0, 1, ...), so every device gets bitwise the same text
  rows;
- text q x text kv: one local kernel call, the same on every device.

All partial results are merged by log-sum-exp in float32. The custom VJP runs
each block's `attention_bwd` (and the ring backward) with the merged, global
`out` and `lse`, which makes every gradient exact. The text output rows are
copies, one per device: the backward first sums their cotangents over the ring
(`psum`), and keeps the text x text block's gradient on rank 0 only, so that the
sum over devices of the text gradients (what `shard_map` gives for a replicated
input) counts that block once; the text q x visual kv block's gradients are
per device already (each device's own visual share).

Text positions are `arange(text_len)`, visual ones `text_len + ring_positions(...)`;
the ring itself sees visual positions without the offset, which changes no mask
(causal masks and windows depend on position differences only). Whether the
text may see some visual token, and the reverse, is decided at trace time from
the positions of every rank (`_joint_visibility`): a causal mask hides all the
visual keys from the text rows, and that block is never computed.

Used by [`ring_attention`][] (`text_len > 0`, through the worker `ring_joint`) and
by [`usp_attention`][] (`joint_attention` on each device's heads after the
Ulysses step).
"""

import dataclasses
import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import kernels
from ..kernels.internal import check_request  # what `kernels.attention` would raise, once
from .._order import after
from .._vma import as_varying, varying_axes
from ._layout import block_positions, ring_positions
from ._rank_masks import attention_bwd, attention_fwd, RankMasks, tile_masks
from ._keys import below, hide_keys
from ._ring_engine import merge, ring_backward, ring_forward, RingConfig, seg_arg, segments
from ._schedule import may_see


F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Joint:
    """Static configuration of the joint core (hashable)."""

    ring: RingConfig
    text_len: int
    sees_visual: bool  # some text query may see some visual key
    seen_by_visual: bool  # some visual query may see some text key
    # The `SlidingTileMask` over `[text; visual]` (the ring's steps carry its
    # visual part, `text_len=0`), or None.
    tile_mask: object = None
    # Positions: text `0 .. T-1` before the visual sequence (True), or the visual
    # sequence `0 .. n L - 1` first and the text after it (False, a text suffix).
    text_first: bool = True

    def kernel_options(self) -> dict:
        """The options of the local (text) blocks' kernel calls."""
        options = self.ring.kernel_options()
        if self.tile_mask is not None:
            options["mask"] = self.tile_mask
        return options


def _joint_positions(cfg: _Joint, L_v: int, rank):
    T, n = cfg.text_len, cfg.ring.sp_size
    visual = ring_positions(L_v, n, rank, cfg.ring.layout)
    if cfg.text_first:
        return jnp.arange(T, dtype=jnp.int32), T + visual
    return n * L_v + jnp.arange(T, dtype=jnp.int32), visual


def _joint_visibility(causal, window, text_len: int, L_v: int, n: int, layout: str,
                      text_first: bool = True):
    """(text sees visual, visual sees text) for some device, decided statically."""
    text = np.arange(text_len) + (0 if text_first else n * L_v)
    sees = seen = False
    for r in range(n):
        visual = (text_len if text_first else 0) + block_positions(np, L_v, n, r, layout)
        sees = sees or may_see(causal, window, text, visual)
        seen = seen or may_see(causal, window, visual, text)
    return sees, seen


def _seg(sq, skv, q, k):
    """The kernels' `segment_ids=` of one block: `None` when neither side has ids, a
    missing side as zeros (key-only padding gives the keys ids and not the queries)."""
    if sq is None and skv is None:
        return None
    axes = varying_axes(q, k, sq, skv)
    if sq is None:
        sq = as_varying(jnp.zeros(q.shape[:2], jnp.int32), axes)
    if skv is None:
        skv = as_varying(jnp.zeros(k.shape[:2], jnp.int32), axes)
    return kernels.SegmentIds(q=sq, kv=skv)


def _joint_forward(cfg: _Joint, q_t, k_t, v_t, q_v, k_v, v_v, sinks, sq_t, skv_t, sq_v, skv_v,
                   tkv_len):
    """`(out_t, out_v)` in `q`'s dtype and their float32 `(lse_t, lse_v)`."""
    rc = cfg.ring
    rank = lax.axis_index(rc.axis_name)
    t_pos, v_pos = _joint_positions(cfg, q_v.shape[1], rank)
    opts = cfg.kernel_options()

    out_v, lse_v = ring_forward(rc, q_v, k_v, v_v, sinks, sq_v, skv_v)
    if cfg.seen_by_visual:
        o, l = attention_fwd(
            q_v, k_t, v_t, segment_ids=_seg(sq_v, skv_t, q_v, k_t), kv_lengths=tkv_len, q_positions=v_pos,
            kv_positions=t_pos, **opts,
        )
        out_v, lse_v = merge(out_v, lse_v, o, l)

    out_t, lse_t = attention_fwd(
        q_t, k_t, v_t, segment_ids=_seg(sq_t, skv_t, q_t, k_t), kv_lengths=tkv_len, sinks=sinks,
        q_positions=t_pos,
        kv_positions=t_pos, **opts,
    )
    out_t = out_t.astype(F32)
    if cfg.sees_visual:
        o, l = attention_fwd(
            q_t, k_v, v_v, segment_ids=_seg(sq_t, skv_v, q_t, k_v), q_positions=t_pos,
            kv_positions=v_pos, **opts,
        )
        # Every device merges all ring ranks' partials in the same order: the text
        # rows come out bitwise identical on every device.
        # After the ring's permutes, one gather after the other (`vidax_eqx._order`).
        o_all = lax.all_gather(after(o, out_v), rc.axis_name, axis=0)
        l_all = lax.all_gather(after(l, o_all), rc.axis_name, axis=0)
        for i in range(rc.sp_size):
            out_t, lse_t = merge(out_t, lse_t, o_all[i], l_all[i])
    return (out_t.astype(q_t.dtype), out_v.astype(q_v.dtype)), (lse_t, lse_v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _joint(cfg: _Joint, q_t, k_t, v_t, q_v, k_v, v_v, sinks, sq_t, skv_t, sq_v, skv_v, tkv_len):
    out, _ = _joint_forward(cfg, q_t, k_t, v_t, q_v, k_v, v_v, sinks, sq_t, skv_t, sq_v, skv_v,
                            tkv_len)
    return out


def _joint_fwd_rule(cfg, *args):
    (out_t, out_v), (lse_t, lse_v) = _joint_forward(cfg, *args)
    return (out_t, out_v), (args, out_t, out_v, lse_t, lse_v)


def _sinks_grad(sinks, lse, out, dout):
    """`-sum_rows p_sink * delta` over these rows, `(H,)` float32."""
    delta = jnp.einsum("bshd,bshd->bhs", dout.astype(F32), out.astype(F32))
    return -jnp.sum(jnp.exp(sinks.astype(F32)[None, :, None] - lse) * delta, axis=(0, 2))


def _joint_bwd_rule(cfg, residuals, cotangents):
    args, out_t, out_v, lse_t, lse_v = residuals
    q_t, k_t, v_t, q_v, k_v, v_v, sinks, sq_t, skv_t, sq_v, skv_v, tkv_len = args
    rc = cfg.ring
    axes = varying_axes(q_v)
    rank = lax.axis_index(rc.axis_name)
    first = rank == 0
    t_pos, v_pos = _joint_positions(cfg, q_v.shape[1], rank)
    opts = cfg.kernel_options()
    ct_t, ct_v = cotangents
    # Every ring rank's text rows are the same function of the same inputs, so the
    # cotangent of the text rows is the sum of all the copies'.
    dout_t = lax.psum(after(ct_t.astype(F32), ct_v), rc.axis_name)
    dout_t = as_varying(dout_t.astype(q_t.dtype), axes)
    dout_v = after(ct_v.astype(q_v.dtype), dout_t)  # the ring's permutes after the psum

    with jax.named_scope("vidax_joint_attention_bwd"):
        dq_v, dk_v, dv_v = ring_backward(
            rc, q_v, k_v, v_v, sq_v, skv_v, out_v, lse_v, dout_v
        )
        dk_t = dv_t = as_varying(jnp.zeros(k_t.shape, F32), axes)
        if cfg.seen_by_visual:
            dq, dk, dv, _, _ = attention_bwd(
                q_v, k_t, v_t, out_v, lse_v, dout_v, segment_ids=_seg(sq_v, skv_t, q_v, k_t),
                kv_lengths=tkv_len,
                q_positions=v_pos, kv_positions=t_pos, **opts,
            )
            dq_v, dk_t, dv_t = dq_v + dq.astype(F32), dk_t + dk.astype(F32), dv_t + dv.astype(F32)

        # The text x text block is computed on every ring rank; count it once.
        dq_t, dk, dv, _, ds_t = attention_bwd(
            q_t, k_t, v_t, out_t, lse_t, dout_t, segment_ids=_seg(sq_t, skv_t, q_t, k_t), sinks=sinks,
            kv_lengths=tkv_len,
            q_positions=t_pos, kv_positions=t_pos, **opts,
        )
        once = lambda x: jnp.where(first, x.astype(F32), 0.0)  # noqa: E731
        dq_t, dk_t, dv_t = once(dq_t), dk_t + once(dk), dv_t + once(dv)
        if cfg.sees_visual:
            dq, dk, dv, _, _ = attention_bwd(
                q_t, k_v, v_v, out_t, lse_t, dout_t, segment_ids=_seg(sq_t, skv_v, q_t, k_v),
                q_positions=t_pos, kv_positions=v_pos, **opts,
            )
            dq_t, dk_v, dv_v = dq_t + dq.astype(F32), dk_v + dk.astype(F32), dv_v + dv.astype(F32)

        dsinks = None
        if sinks is not None:
            dsinks = _sinks_grad(sinks, lse_v, out_v, dout_v) + once(ds_t)
            dsinks = as_varying(dsinks.astype(sinks.dtype), axes)

    cast = lambda d, x: as_varying(d.astype(x.dtype), axes)  # noqa: E731
    return (
        cast(dq_t, q_t), cast(dk_t, k_t), cast(dv_t, v_t),
        cast(dq_v, q_v), cast(dk_v, k_v), cast(dv_v, v_v),
        dsinks, None, None, None, None, None,
    )


_joint.defvjp(_joint_fwd_rule, _joint_bwd_rule)


# -- entry points ---------------------------------------------------------------------


def _visual_mask(tile_mask):
    """The video part of a joint layout's mask (or `RankMasks` of them): the ring's."""
    if tile_mask is None:
        return None
    if isinstance(tile_mask, RankMasks):
        return RankMasks(tuple(map(_visual_mask, tile_mask.masks)), tile_mask.axis_name)
    return dataclasses.replace(tile_mask, text_len=0)


def _as_prefix(tile_mask):
    """A suffix layout's `SlidingTileMask` (or `RankMasks`) as the same mask over
    `[text; video]`: text sees everything and is seen by everything, video tiles see
    their windows, whatever side the text is on, so only the positions change."""
    if tile_mask is None:
        return None
    if isinstance(tile_mask, RankMasks):
        return RankMasks(tuple(map(_as_prefix, tile_mask.masks)), tile_mask.axis_name)
    return dataclasses.replace(tile_mask, text_position="prefix")


def joint_indices(text_len: int, L_v: int, sp_size: int, rank, layout: str, text_position: str):
    """`(text, visual)` int32: the global indices of the text tokens and of this device's
    visual share in the single-device sequence (`[text; visual]` for a prefix,
    `[visual; text]` for a suffix)."""
    visual = ring_positions(L_v, sp_size, rank, layout)
    text = jnp.arange(text_len, dtype=jnp.int32)
    if text_position == "prefix":
        return text, text_len + visual
    return sp_size * L_v + text, visual


def joint_attention(q_t, k_t, v_t, q_v, k_v, v_v, sinks, sq_t, skv_t, sq_v, skv_v, *,
                    text_len: int, axis_name: Hashable, sp_size: int, layout: str, causal,
                    window, scale, logits_soft_cap, implementation, tile_mask=None,
                    text_position: str = "prefix", text_lengths=None, kv_lengths=None):
    """`(out_t, out_v)`: the joint core on split inputs (of `ring_joint`, and of USP after
    its Ulysses step).

    `q_t, k_t, v_t`: the text `(B, text_len, H(_kv), D)`; `q_v, k_v, v_v`: this
    device's visual share `(B, L, H(_kv), D)` on the ring `axis_name` of `sp_size`
    devices; segment ids int32 `(B, text_len)` / `(B, L)` or all `None`; `sinks`
    `(H,)` or `None`. The arguments are checked by the caller (`_request.py`); this
    checks that the kernel serves the options (with positions, as the text blocks need).
    `tile_mask`: a `SlidingTileMask` over the single-device sequence (text on the
    side `text_position` says), checked by the caller. `text_position`: the text
    before (`"prefix"`) or after (`"suffix"`) the global visual sequence.
    `text_lengths`, `kv_lengths`: int32 `(B,)` or `None`, checked by the caller:
    key-only padding of the text keys at index `>= text_lengths` within the text, and
    of the keys at a global index `>= kv_lengths` (`joint_indices`).
    """
    L_v = q_v.shape[1]
    text_first = text_position == "prefix"
    if not text_first and tile_mask is not None:
        # No positional mask (`_request.py` refuses one): the suffix is the prefix layout
        # with the text moved.
        tile_mask, text_first = _as_prefix(tile_mask), True

    # Key-only padding. The hidden text keys are a tail of the text block (the kv of
    # the text blocks): the kernels' `kv_lengths` there. The hidden visual keys: key
    # segment ids -1 (`_keys.py`), which travel the ring with their block.
    tkv_len = text_lengths
    if kv_lengths is not None:
        rank = lax.axis_index(axis_name)
        t_idx, v_idx = joint_indices(text_len, L_v, sp_size, rank, layout, text_position)
        start = 0 if text_position == "prefix" else sp_size * L_v  # the text's first index
        in_text = jnp.clip(kv_lengths - start, 0, text_len)
        tkv_len = in_text if tkv_len is None else jnp.minimum(tkv_len, in_text)
        sq_v, skv_v = hide_keys(sq_v, skv_v, below(kv_lengths, v_idx), L_v)

    pos = jnp.arange(L_v, dtype=jnp.int32)
    visual_mask = _visual_mask(tile_mask)
    check_request(
        q_v, k_v, v_v, segment_ids=seg_arg(sq_v, skv_v), q_positions=pos,
        kv_positions=pos, causal=causal, window=window, scale=scale,
        logits_soft_cap=logits_soft_cap, implementation=implementation, needs_lse=True,
        mask=None if visual_mask is None else tile_masks(visual_mask)[0],
    )
    window = None if window is None else tuple(window)
    rc = RingConfig(
        axis_name=axis_name,
        sp_size=sp_size,
        layout=layout,
        causal=bool(causal),
        window=window,
        scale=None if scale is None else float(scale),
        logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        implementation=implementation,
        tile_mask=visual_mask,
    )
    sees, seen = _joint_visibility(bool(causal), window, text_len, L_v, sp_size, layout,
                                   text_first)
    cfg = _Joint(ring=rc, text_len=text_len, sees_visual=sees, seen_by_visual=seen,
                 tile_mask=tile_mask, text_first=text_first)
    args = (q_t, k_t, v_t, q_v, k_v, v_v, sinks, sq_t, skv_t, sq_v, skv_v)
    # Everything that meets inside the core varies along the same axes (the
    # replicated text and sinks included), so replicated inputs get summed gradients.
    # The text's key count stays as it is (replicated): it is no operand of a product.
    axes = varying_axes(*args) | frozenset({axis_name})
    return _joint(cfg, *as_varying(args, axes), tkv_len)


def split_joint(x, text_len: int, text_position: str, axis: int = 1):
    """`(text, visual)` of a per-device array in the joint layout (`None`: both `None`)."""
    if x is None:
        return None, None
    size = x.shape[axis]
    cut = text_len if text_position == "prefix" else size - text_len
    first = lax.slice_in_dim(x, 0, cut, axis=axis)
    second = lax.slice_in_dim(x, cut, size, axis=axis)
    return (first, second) if text_position == "prefix" else (second, first)


def join_joint(text, visual, text_position: str, axis: int = 1):
    """The inverse of `split_joint`."""
    parts = [text, visual] if text_position == "prefix" else [visual, text]
    return jnp.concatenate(parts, axis=axis)


def ring_joint(q, k, v, *, axis_name, sp_size: int, causal, segment_ids, sinks, window,
               scale, logits_soft_cap, layout, text_len: int, implementation, tile_mask=None,
               text_position: str = "prefix", text_lengths=None, kv_lengths=None):
    """The joint-layout ring worker of [`sequence_attention`][] (`ring_attention` with
    `text_len > 0`), on a checked request (`_request.py`): the per-device
    `[text; visual share]` (or `[visual share; text]`) arrays split for the core."""
    n = sp_size
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    T, L = text_len, q.shape[1] - text_len
    seg_q, seg_kv = segments(segment_ids)
    opts = dict(causal=bool(causal), window=None if window is None else tuple(window),
                scale=scale, logits_soft_cap=logits_soft_cap, implementation=implementation)

    with jax.named_scope("vidax_ring_attention"):
        if L == 0:  # text only: every device attends the text to itself, no communication
            axes = varying_axes(q, k, v) | frozenset({axis_name})
            lengths = text_lengths
            if kv_lengths is not None:
                lengths = kv_lengths if lengths is None else jnp.minimum(lengths, kv_lengths)
            q, k, v, sinks, seg_q, seg_kv = as_varying((q, k, v, sinks, seg_q, seg_kv), axes)
            pos = None if tile_mask is None else jnp.arange(T, dtype=jnp.int32)
            return kernels.attention(q, k, v, segment_ids=seg_arg(seg_q, seg_kv),
                                     sinks=sinks, mask=tile_mask, q_positions=pos,
                                     kv_positions=pos, kv_lengths=lengths, **opts)
        split = lambda x: split_joint(x, T, text_position)  # noqa: E731
        (q_t, q_v), (k_t, k_v), (v_t, v_v) = split(q), split(k), split(v)
        (sq_t, sq_v), (skv_t, skv_v) = split(seg_q), split(seg_kv)
        out_t, out_v = joint_attention(
            q_t, k_t, v_t, q_v, k_v, v_v, sinks, sq_t, skv_t, sq_v, skv_v,
            text_len=T, axis_name=axis_name, sp_size=n, layout=layout, tile_mask=tile_mask,
            text_position=text_position, text_lengths=text_lengths, kv_lengths=kv_lengths,
            **opts,
        )
        return join_joint(out_t, out_v, text_position)
