"""DeepSpeed-Ulysses sequence parallelism: all_to_all around one kernel call.

Each device of the sequence-parallel axis holds a contiguous chunk of the
sequence with every head, `(B, L_local, H, D)`. One `all_to_all` per operand
trades the sequence split for a head split, `(B, L, H / sp, D)`: every device
then holds the *whole* sequence, in order, for its own heads, runs one
single-device [`vidax_eqx.kernels.attention`][] call, and a last `all_to_all`
gives the output back the input's layout. Because each device sees the whole
sequence, positions are the plain `arange(L)` and causal / window / segment
masks mean exactly what they mean on one device.

Any token count works through the public padding helpers (the recipe is in
`sequence_parallel_self_attention`'s docstring).

This file is the worker, `ulysses`, that [`sequence_attention`][] calls on a checked
request (`_request.py`), and the pieces USP shares (`kv_head_repeats`, `local_heads`,
`match_vma`); the documented fronts are in `_fronts.py`.
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._order import Sequence
from .._vma import as_varying, varying_axes
from ..kernels import attention, SegmentIds
from ..kernels.internal import STRUCTURED_MASKS
from ._keys import hide_keys


def kv_head_repeats(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """How many times Ulysses repeats each key/value head for an SP size.

    The smallest `r` such that `num_kv_heads * r` splits evenly over `sp_size`
    devices and still divides `num_heads` (so query head `h` keeps key/value head
    `h // (num_heads // num_kv_heads)`). It exists whenever `num_heads` is a
    multiple of both `num_kv_heads` and `sp_size`: `r = lcm(H_kv, sp) / H_kv`.
    `r == 1` (no repetition) when `sp_size` divides `num_kv_heads`.
    """
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("sp_size", sp_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"kv_head_repeats: `{name}` must be a positive int; received {value!r}.")
    r = math.lcm(num_kv_heads, sp_size) // num_kv_heads
    if num_heads % (num_kv_heads * r):
        raise ValueError(
            f"no repetition of {num_kv_heads} key/value heads splits over sp={sp_size} "
            f"and divides H={num_heads}; H must be a multiple of both H_kv and sp."
        )
    return r


def match_vma(x: jax.Array, like: jax.Array) -> jax.Array:
    """Marks `x` as varying over every mesh axis `like` varies over.

    Under `shard_map(check_vma=True)` a differentiable operand that is invariant
    (replicated) but meets device-varying data inside the kernel's custom VJP
    would get a varying cotangent; casting it first makes the transpose a `psum`,
    which is the correct gradient of a replicated input.
    """
    return as_varying(x, varying_axes(like))


def _split(x, axis: int, text_len: int, suffix: bool):
    """`(text, visual)` of a per-device array along `axis`: `[text; visual chunk]`, or
    `[visual chunk; text]` for a text suffix."""
    axis = axis % jnp.ndim(x)
    size = x.shape[axis]
    cut = size - text_len if suffix else text_len
    first = jax.lax.slice_in_dim(x, 0, cut, axis=axis)
    second = jax.lax.slice_in_dim(x, cut, size, axis=axis)
    return (second, first) if suffix else (first, second)


def _join(text, visual, axis: int, suffix: bool):
    if not text.shape[axis % jnp.ndim(text)]:
        return visual
    return jnp.concatenate([visual, text] if suffix else [text, visual], axis=axis)


def _gather_tokens(x, axis: int, text_len: int, sp_axis_name: str, order: Sequence,
                   suffix: bool = False):
    """A per-token array of this device, `[text; visual chunk]` along `axis` (or
    `[visual chunk; text]`), to the whole sequence `[text; all visual chunks]` (or
    `[all visual chunks; text]`), the text once."""
    text, visual = _split(x, axis, text_len, suffix)
    visual = order(jax.lax.all_gather, visual, sp_axis_name, axis=axis, tiled=True)
    return _join(text, visual, axis, suffix)


def local_heads(x, axis: int, heads_local: int, sp_axis_name: str):
    rank = jax.lax.axis_index(sp_axis_name)
    return jax.lax.dynamic_slice_in_dim(x, rank * heads_local, heads_local, axis)


def _per_token_options(
    opts: dict[str, Any], *, S: int, H: int, sp: int, text_len: int, sp_axis_name: str,
    like: jax.Array, order: Sequence, suffix: bool = False, visible=None,
) -> dict[str, Any]:
    """Turns the per-device kernel options (checked: `_request.py`) into the options of
    the one kernel call over the whole sequence and this device's `H / sp` heads.
    `visible`: bool `(B, S)` over the whole sequence, or `None`: key-only padding, the
    hidden keys' segment ids -1 (`_keys.py`)."""
    opts = dict(opts)
    heads_local = H // sp
    gather = lambda x: _gather_tokens(x, 1, text_len, sp_axis_name, order, suffix)  # noqa: E731

    seg = opts.get("segment_ids")
    if seg is not None:
        if isinstance(seg, SegmentIds):
            opts["segment_ids"] = SegmentIds(q=gather(seg.q), kv=gather(seg.kv))
        else:
            opts["segment_ids"] = gather(seg)
    if visible is not None:
        seg = opts.get("segment_ids")
        seg_q, seg_kv = (seg.q, seg.kv) if isinstance(seg, SegmentIds) else (seg, seg)
        seg_q, seg_kv = hide_keys(seg_q, seg_kv, visible, S)
        opts["segment_ids"] = SegmentIds(q=seg_q, kv=seg_kv)

    for name in ("q_positions", "kv_positions"):
        pos = opts.get(name)
        if pos is not None:
            opts[name] = _gather_tokens(pos, 0, text_len, sp_axis_name, order, suffix)

    sinks = opts.get("sinks")
    if sinks is not None:
        opts["sinks"] = local_heads(match_vma(jnp.asarray(sinks), like), 0, heads_local,
                                     sp_axis_name)

    for name in ("bias", "mask"):
        x = opts.get(name)
        if x is None or isinstance(x, STRUCTURED_MASKS):  # see `_attend_heads`
            continue
        x = jnp.asarray(x)
        x = x.reshape((1,) * (4 - x.ndim) + x.shape)
        if x.shape[1] == H and heads_local != H:
            x = local_heads(x, 1, heads_local, sp_axis_name)
        if name == "bias":
            x = match_vma(x, like)
        opts[name] = x
    return opts


def _attend_heads(q, k, v, opts: dict, *, H: int, sp: int, text_len: int, sp_axis_name,
                  suffix: bool = False):
    """The one kernel call over the whole sequence and this device's heads.

    With a structured mask (`opts["mask"]`, a `SlidingTileMask` or `BlockCausalMask`,
    checked against the sequence): each device takes its heads' windows (a `lax.switch`
    on the rank when the devices' windows differ), and the padding past the mask (the
    sequence padded to a multiple of sp) is cut off before the kernel and its rows'
    output set to 0, so the kernel sees exactly the mask's layout (and its default
    positions, with whole-tile blocks). With a text
    suffix that padding lies between the video and the text, and is cut from there.
    """
    tile_mask = opts.get("mask")
    if not isinstance(tile_mask, STRUCTURED_MASKS):
        return attention(q, k, v, **opts)
    S = q.shape[1]
    cut = S
    if S > tile_mask.seq_len and opts.get("q_positions") is None and opts.get("kv_positions") is None:
        cut = tile_mask.seq_len
        # Keep the mask's tokens: [0, cut) for a prefix; the video's [0, video_len) and
        # the text's [S - text_len, S) for a suffix.
        lo, hi = (cut, S) if not suffix else (tile_mask.video_len, S - text_len)

        def keep(x, axis):
            axis = axis % jnp.ndim(x)
            if x.shape[axis] != S:  # broadcast axis of a bias / mask
                return x
            return jnp.concatenate([jax.lax.slice_in_dim(x, 0, lo, axis=axis),
                                    jax.lax.slice_in_dim(x, hi, S, axis=axis)], axis=axis)

        q, k, v = keep(q, 1), keep(k, 1), keep(v, 1)
        seg = opts.get("segment_ids")
        if isinstance(seg, SegmentIds):
            opts["segment_ids"] = SegmentIds(q=keep(seg.q, 1), kv=keep(seg.kv, 1))
        elif seg is not None:
            opts["segment_ids"] = keep(seg, 1)
        bias = opts.get("bias")
        if bias is not None:
            opts["bias"] = keep(keep(bias, -2), -1)
        kv_lengths = opts.get("kv_lengths")
        if kv_lengths is not None:  # global key counts, less the keys cut before them
            opts["kv_lengths"] = kv_lengths - jnp.clip(kv_lengths - lo, 0, hi - lo)
    heads_local = H // sp
    masks = [tile_mask.select_heads(r * heads_local, heads_local) for r in range(sp)]
    if len(set(masks)) == 1:
        out = attention(q, k, v, **dict(opts, mask=masks[0]))
    else:
        rank = jax.lax.axis_index(sp_axis_name)
        branches = [lambda q, k, v, m=m: attention(q, k, v, **dict(opts, mask=m)) for m in masks]
        out = jax.lax.switch(rank, branches, q, k, v)
    if cut < S:  # the padding's rows: 0
        out = jnp.concatenate([out[:, :lo], jnp.zeros((out.shape[0], S - cut, *out.shape[2:]),
                                                      out.dtype), out[:, lo:]], axis=1)
    return out


def ulysses(q, k, v, *, sp_axis_name, sp: int, text_len: int, text_position: str,
            text_lengths, kv_lengths, scale, kernel_options: dict):
    """The Ulysses worker of [`sequence_attention`][], on a checked request
    (`_request.py`): `q, k, v` this device's `(B, text_len + L_local, H(_kv), D)`
    (`[visual chunk; text]` for a suffix), `sp` the size of `sp_axis_name`, the text's
    key-only padding `text_lengths` and the whole sequence's `kv_lengths` int32 `(B,)`
    or `None`, `kernel_options` the rest (this device's layout)."""
    B, S_local, H, D = q.shape
    H_kv = k.shape[2]
    L_local = S_local - text_len
    S = text_len + sp * L_local
    heads_local = H // sp
    suffix = text_position == "suffix"
    # Key-only padding over the whole sequence (`[text; visual]` or `[visual; text]`):
    # the kernels' `kv_lengths` where the hidden keys are a tail (`kv_lengths`, a text
    # suffix's padding), key segment ids -1 for a text prefix's padding (`_keys.py`).
    visible = None
    if text_lengths is not None and suffix:
        tail = sp * L_local + text_lengths
        kv_lengths = tail if kv_lengths is None else jnp.minimum(kv_lengths, tail)
    elif text_lengths is not None:
        index = jnp.arange(S, dtype=jnp.int32)[None, :]
        visible = (index < text_lengths[:, None]) | (index >= text_len)

    r = kv_head_repeats(H, H_kv, sp)
    if r > 1:
        # Consecutive copies: kv' head m is kv head m // r, so query head h still
        # reads kv head h // (H // H_kv). The transpose of repeat sums the copies.
        k = jnp.repeat(k, r, axis=2)
        v = jnp.repeat(v, r, axis=2)
    kv_heads_local = H_kv * r // sp
    # Every collective below waits for the one before it (`vidax_eqx._order`).
    order = Sequence(q, k, v, jax.tree.leaves(kernel_options))

    def seq_to_heads(x, n_local):
        """(B, text + L_local, H, D) -> (B, text + L, H / sp, D) (the text after the
        visual tokens for a suffix)."""
        text, visual = _split(x, 1, text_len, suffix)
        if L_local:
            visual = order(
                jax.lax.all_to_all, visual, sp_axis_name, split_axis=2, concat_axis=1, tiled=True
            )
        else:
            visual = visual[:, :, :n_local]
        if not text_len:
            return visual
        return _join(local_heads(text, 2, n_local, sp_axis_name), visual, 1, suffix)

    opts = _per_token_options(
        kernel_options, S=S, H=H, sp=sp, text_len=text_len, sp_axis_name=sp_axis_name,
        like=q, order=order, suffix=suffix, visible=visible,
    )
    if kv_lengths is not None:
        opts["kv_lengths"] = kv_lengths
    out = _attend_heads(
        seq_to_heads(q, heads_local),
        seq_to_heads(k, kv_heads_local),
        seq_to_heads(v, kv_heads_local),
        dict(opts, scale=scale), H=H, sp=sp, text_len=text_len, sp_axis_name=sp_axis_name,
        suffix=suffix,
    )  # (B, S, H / sp, D)

    text_out, visual_out = _split(out, 1, text_len, suffix)
    if L_local:
        visual_out = order(
            jax.lax.all_to_all, visual_out, sp_axis_name, split_axis=1, concat_axis=2, tiled=True
        )
    else:
        visual_out = jnp.zeros((B, 0, H, D), out.dtype)
    if not text_len:
        return visual_out
    # Every device computed the text rows for its own heads; gather all heads so
    # the text output is the same, complete, single-device result everywhere.
    text_out = order(jax.lax.all_gather, text_out, sp_axis_name, axis=2, tiled=True)
    return _join(text_out, visual_out, 1, suffix)
