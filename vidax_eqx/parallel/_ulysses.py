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
[`sequence_parallel_self_attention`][]'s docstring).
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._order import Sequence
from .._vma import as_varying, varying_axes
from ..kernels import attention, SegmentIds, SlidingTileMask
from ._checks import (
    check_head_split, check_lengths, check_no_text_lengths, check_qkv, check_text_position,
)
from .._checks import static_int
from ._keys import hide_keys
from ._mesh import axis_size, check_sharded


_WHAT = "Sequence-parallel"


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
    opts: dict[str, Any], *, fn: str, B: int, S_local: int, S: int, H: int, sp: int,
    text_len: int, sp_axis_name: str, like: jax.Array, order: Sequence, suffix: bool = False,
    visible=None,
) -> dict[str, Any]:
    """Turns the per-device kernel options into the options of the one kernel call
    over the whole sequence and this device's `H / sp` heads. `visible`: bool
    `(B, S)` over the whole sequence, or `None`: key-only padding, the hidden keys'
    segment ids -1 (`_keys.py`)."""
    opts = dict(opts)
    heads_local = H // sp
    gather = lambda x: _gather_tokens(x, 1, text_len, sp_axis_name, order, suffix)  # noqa: E731

    seg = opts.get("segment_ids")
    if seg is not None:
        pairs = (("segment_ids.q", seg.q), ("segment_ids.kv", seg.kv)) if isinstance(
            seg, SegmentIds) else (("segment_ids", seg),)
        for name, s in pairs:
            if jnp.shape(s) != (B, S_local):
                raise ValueError(
                    f"{fn}: `{name}` holds this device's tokens, shape (B, S_local) = "
                    f"{(B, S_local)} (the same tokens as `q`); received {jnp.shape(s)}. Shard "
                    "segment ids exactly as the sequence (e.g. in_specs P(None, 'sp'))."
                )
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
            if jnp.shape(pos) != (S_local,):
                raise ValueError(
                    f"{fn}: `{name}` holds this device's token positions, shape (S_local,) = "
                    f"({S_local},); received {jnp.shape(pos)}. Omit it for the default "
                    "(the global arange of the whole sequence)."
                )
            opts[name] = _gather_tokens(pos, 0, text_len, sp_axis_name, order, suffix)

    sinks = opts.get("sinks")
    if sinks is not None:
        if jnp.shape(sinks) != (H,):
            raise ValueError(
                f"{fn}: `sinks` must have shape (H,) = ({H},), one logit per query head; "
                f"received {jnp.shape(sinks)}."
            )
        opts["sinks"] = local_heads(match_vma(jnp.asarray(sinks), like), 0, heads_local,
                                     sp_axis_name)

    for name in ("bias", "mask"):
        x = opts.get(name)
        if x is None or isinstance(x, SlidingTileMask):  # a tile mask: see `_attend_heads`
            continue
        x = jnp.asarray(x)
        full = (B, H, S, S)
        if x.ndim > 4 or any(
            got not in (1, want) for got, want in zip(x.shape[::-1], full[::-1])
        ):
            raise ValueError(
                f"{fn}: `{name}` is over the whole sequence after the all_to_all: it must "
                f"broadcast to (B, H, S, S) = {full} (S = text_len + sp * L_visual_local, "
                f"every device passing the same array); received shape {x.shape}. A bias over "
                "this device's chunk only cannot be expressed; use segment ids for padding."
            )
        x = x.reshape((1,) * (4 - x.ndim) + x.shape)
        if x.shape[1] == H and heads_local != H:
            x = local_heads(x, 1, heads_local, sp_axis_name)
        if name == "bias":
            x = match_vma(x, like)
        opts[name] = x
    return opts


def _check_tile_mask(fn: str, tile_mask: SlidingTileMask, S: int, H: int, sp: int, text_len: int,
                     position: str = "prefix") -> None:
    """A `SlidingTileMask` over the whole gathered sequence `[text_len text; visual]` (or
    `[visual; text]`) of `S` tokens: the mask's layout, the video padded at its end by
    fewer than `sp` tokens."""
    tile_mask.check_heads(H, fn)
    if text_len and (tile_mask.text_len != text_len or tile_mask.text_position != position):
        raise ValueError(
            f"{fn}: the joint layout puts a text {position} of text_len={text_len} tokens "
            f"{'before' if position == 'prefix' else 'after'} the video, so the SlidingTileMask "
            f"needs text_len={text_len}, text_position={position!r}; received "
            f"text_len={tile_mask.text_len}, text_position={tile_mask.text_position!r}."
        )
    if not tile_mask.seq_len <= S < tile_mask.seq_len + sp:
        raise ValueError(
            f"{fn}: the SlidingTileMask lays out {tile_mask.seq_len} tokens (grid "
            f"{tile_mask.grid}, tile {tile_mask.tile}, text_len {tile_mask.text_len}), but the "
            f"devices hold {S} in all. The whole sequence must be the mask's, padded at the end "
            f"to a multiple of sp={sp} (pad_to_multiple; padding is invisible)."
        )


def _attend_heads(q, k, v, opts: dict, *, fn: str, H: int, sp: int, text_len: int, sp_axis_name,
                  suffix: bool = False):
    """The one kernel call over the whole sequence and this device's heads.

    With a `SlidingTileMask` (`opts["mask"]`): each device takes its heads' windows
    (a `lax.switch` on the rank when the devices' windows differ), and the padding
    past the mask (the sequence padded to a multiple of sp) is cut off before the
    kernel and its rows' output set to 0, so the kernel sees exactly the mask's
    layout (and its default positions, with whole-tile blocks). With a text suffix
    that padding lies between the video and the text, and is cut from there.
    """
    tile_mask = opts.get("mask")
    if not isinstance(tile_mask, SlidingTileMask):
        return attention(q, k, v, **opts)
    S = q.shape[1]
    _check_tile_mask(fn, tile_mask, S, H, sp, text_len, "suffix" if suffix else "prefix")
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


def _ulysses(q, k, v, text_len: int, sp_axis_name: str, scale, kernel_options, fn: str,
             text_position: str = "prefix", text_lengths=None, kv_lengths=None):
    sp = axis_size(sp_axis_name, what=_WHAT)
    check_qkv(q, k, v, fn)
    B, S_local, H, D = q.shape
    H_kv = k.shape[2]
    check_head_split(H, sp, sp_axis_name, fn)
    L_local = S_local - text_len
    if L_local:
        check_sharded(fn, (sp_axis_name,), q=q, k=k, v=v)
    S = text_len + sp * L_local
    heads_local = H // sp
    suffix = text_position == "suffix"
    text_lengths = check_lengths(fn, "text_lengths", text_lengths, B, text_len,
                                 "text tokens per device")
    kv_lengths = check_lengths(fn, "kv_lengths", kv_lengths, B, S,
                               "keys of the whole sequence: text_len + sp * visual local length")
    if (suffix and text_len and isinstance(kernel_options.get("mask"), SlidingTileMask)
            and (kernel_options.get("causal") or kernel_options.get("window") is not None)):
        raise NotImplementedError(
            f"{fn}: the joint layout with text_position='suffix' and a SlidingTileMask does not "
            f"serve causal or window masks (received causal={kernel_options.get('causal')}, "
            f"window={kernel_options.get('window')}); use text_position='prefix' for that "
            "combination."
        )
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
        kernel_options, fn=fn, B=B, S_local=S_local, S=S, H=H, sp=sp, text_len=text_len,
        sp_axis_name=sp_axis_name, like=q, order=order, suffix=suffix, visible=visible,
    )
    if kv_lengths is not None:
        opts["kv_lengths"] = kv_lengths
    out = _attend_heads(
        seq_to_heads(q, heads_local),
        seq_to_heads(k, kv_heads_local),
        seq_to_heads(v, kv_heads_local),
        dict(opts, scale=scale), fn=fn, H=H, sp=sp, text_len=text_len, sp_axis_name=sp_axis_name,
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


def sequence_parallel_self_attention(
    q: Float[Array, "B L_local H D"],
    k: Float[Array, "B L_local H_kv D"],
    v: Float[Array, "B L_local H_kv D"],
    sp_axis_name: str,
    scale: float | None = None,
    *,
    kv_lengths: Int[Array, " B"] | None = None,
    **kernel_options,
) -> Float[Array, "B L_local H D"]:
    """DeepSpeed-Ulysses self-attention over the mesh axis `sp_axis_name`.

    Call inside `jax.shard_map`, with the sequence split contiguously over
    `sp_axis_name` (device `i` holds tokens `[i * L_local, (i + 1) * L_local)`).
    Two `all_to_all`s turn `(B, L_local, H, D)` into `(B, L, H / sp, D)`, one
    [`vidax_eqx.kernels.attention`][] call attends over the whole sequence for
    this device's heads, and a last `all_to_all` returns `(B, L_local, H, D)`.
    The result (and its gradient) equals single-device attention over the
    concatenated sequence.

    **Arguments:**

    - `q`: this device's queries `(B, L_local, H, D)`; `H` must be a multiple of
        the SP size.
    - `k`, `v`: this device's keys and values `(B, L_local, H_kv, D)`, GQA with
        `H % H_kv == 0`. When `H_kv` does not split over the SP size, each kv head is
        repeated (consecutive copies, so query head `h` keeps kv head
        `h // (H // H_kv)`) by the smallest factor that does, see
        [`kv_head_repeats`][]; MQA with `sp = 4` repeats the one head 4 times.
    - `sp_axis_name`: the sequence-parallel mesh axis, e.g. `SP_AXIS`.
    - `scale`: logit scale, default `1 / sqrt(D)`.
    - `kv_lengths`: int `(B,)`, key-only padding: keys at a global index
        `>= kv_lengths[b]` (in the whole sequence, padding to the SP size included) are
        invisible to every query; every query is computed. Replicated
        (`PartitionSpec()`); after the `all_to_all` every device holds the whole
        sequence, so it goes to the kernel's `kv_lengths` unchanged (the fast kernels
        serve it).
    - `**kernel_options`: the keyword options of [`vidax_eqx.kernels.attention`][]:
        `causal`, `window`, `logits_soft_cap`, `implementation` pass through
        unchanged; the rest are adapted to the split:
        - `segment_ids`: this device's ids `(B, L_local)` (or a `SegmentIds` of
            two), sharded like the sequence; they are all-gathered to `(B, L)`.
        - `sinks`: the global `(H,)`, the same on every device; each device uses
            its heads' slice, and the gradient (summed over the axis by
            `shard_map` for a replicated input) is the single-device one.
        - `q_positions`, `kv_positions`: this device's positions `(L_local,)`,
            all-gathered; the default is the global `arange(L)`.
        - `bias`, `mask`: over the *whole* sequence, broadcastable to
            `(B, H, L, L)` and the same on every device (a head axis of size `H`
            is sliced to this device's heads). A bias over the local chunk only is
            a `ValueError`: after the `all_to_all` there is no local chunk.
            `mask` may be a [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask]
            over the whole sequence (padded at the end to a multiple of the SP size,
            the padding invisible): per-head windows follow their heads.

    **Returns:**

    This device's output `(B, L_local, H, D)` in `q`'s dtype.

    **Any token count** (the padding recipe): pad the global sequence to a
    multiple of the SP size and hide the padding with segment ids, then drop it:

    ```python
    S = q.shape[1]                                  # e.g. 30 tokens over sp = 4
    qp, kp, vp = (pad_to_multiple(x, sp, axis=1) for x in (q, k, v))
    seg = padding_segment_ids(S, sp, batch=q.shape[0])   # (B, 32), -1 on padding
    f = lambda q, k, v, s: sequence_parallel_self_attention(
        q, k, v, SP_AXIS, segment_ids=s, causal=True)
    out = jax.shard_map(f, mesh=mesh, in_specs=P(None, SP_AXIS),
                        out_specs=P(None, SP_AXIS))(qp, kp, vp, seg)
    out = unpad(out, S, axis=1)                     # (B, 30, H, D)
    ```

    Padded tokens attend to nothing and are seen by nothing, so no real token
    is dropped or changed (pass your own segment ids through
    `padding_segment_ids(..., segment_ids=...)` to keep them).

    **Raises:**

    `ValueError` when `sp_axis_name` is not a bound mesh axis (outside
    `shard_map`, or a typo), when `H` is not a multiple of the SP size, for
    `kv_lengths` that is not an integer `(B,)` array in range, or for shapes that do
    not fit.
    """
    return _ulysses(q, k, v, 0, sp_axis_name, scale, kernel_options,
                    "sequence_parallel_self_attention", kv_lengths=kv_lengths)


def sequence_parallel_joint_self_attention(
    q: Float[Array, "B S_local H D"],
    k: Float[Array, "B S_local H_kv D"],
    v: Float[Array, "B S_local H_kv D"],
    text_len: int,
    sp_axis_name: str,
    scale: float | None = None,
    *,
    text_position: str = "prefix",
    text_lengths: Int[Array, " B"] | None = None,
    kv_lengths: Int[Array, " B"] | None = None,
    **kernel_options,
) -> Float[Array, "B S_local H D"]:
    """Ulysses joint attention over replicated text and sharded video tokens.

    The CogVideoX layout: each device's `q`, `k`, `v` are
    `(B, text_len + L_local, H, D)`, a text prefix of `text_len` tokens that is
    the same on every device, followed by this device's contiguous chunk of the
    visual tokens. The result equals single-device attention over
    `[text; visual chunk 0; ...; visual chunk sp-1]`, with the text counted once.
    With `text_position="suffix"` (MMDiT models: HunyuanVideo, Flux-style blocks)
    the text comes after: `[visual chunk; text]` per device, the whole sequence
    `[visual chunk 0; ...; visual chunk sp-1; text]`.

    The visual parts go through the Ulysses `all_to_all`; the text part needs no
    communication on the way in (each device takes its own heads of it); one
    kernel call attends over `[text; all visual]` for this device's heads; the
    text rows are all-gathered over heads and the visual rows return by the
    inverse `all_to_all`.

    **Arguments:**

    - `q`, `k`, `v`: `(B, text_len + L_local, H, D)` and `(B, text_len + L_local, H_kv, D)`,
        as in [`sequence_parallel_self_attention`][].
    - `text_len`: the length of the replicated text, `0 <= text_len <=
        q.shape[1]` (`0` is plain Ulysses).
    - `sp_axis_name`, `scale`: as in [`sequence_parallel_self_attention`][].
    - `text_position`: `"prefix"` (default: `[text; visual chunk]` per device) or
        `"suffix"` (`[visual chunk; text]`, and the result laid out the same way).
        With a suffix the default positions put the video at `0 .. L - 1` and the
        text at `L .. L + text_len - 1` (`L = sp * L_local`), so `causal=True` lets
        every text token see the whole video. A `SlidingTileMask` must say the same
        `text_position`; with a suffix it cannot be combined with `causal` /
        `window` (`NotImplementedError`).
    - `text_lengths`: int `(B,)`, key-only padding of the text: text keys at an index
        `>= text_lengths[b]` within the text are invisible to every query, every query
        (the padded text rows included) is computed; `0 <= text_lengths[b] <=
        text_len`, replicated. With a suffix the padded keys are the sequence's tail,
        served by the kernel's `kv_lengths` (the fast kernels take it); with a prefix,
        by key segment ids -1.
    - `kv_lengths`: int `(B,)`, keys at an index `>= kv_lengths[b]` of the whole
        sequence (`[text; visual]` or `[visual; text]`, visual padding included)
        invisible to every query, as in [`sequence_parallel_self_attention`][].
    - `**kernel_options`: as in [`sequence_parallel_self_attention`][], with the
        per-token ones (`segment_ids`, `q_positions`, `kv_positions`) given in this
        device's layout, `(B, text_len + L_local)` / `(text_len + L_local,)`, text
        part identical on every device; `bias` / `mask` broadcast to `(B, H, S, S)`
        with `S = text_len + sp * L_local`. Positions default to `arange(S)`, so
        `causal=True` lets the text see no video token.

    **Returns:**

    `(B, text_len + L_local, H, D)`: the text rows, identical on every device and
    equal to the single-device text output, then this device's visual rows (the
    other way round for a suffix). [`replicated`][] returns the text rows from
    `shard_map` with `out_specs=P()`.

    **Gradients:** the text rows are copies. A copy's output cotangent reaches the
    devices that own its heads, and the gradient with respect to a copy of the text
    input holds that device's heads only, so summing over the SP axis (what
    `shard_map` does for a text computed from replicated values) gives the
    single-device gradient. Give every copy's cotangent, or the whole cotangent to
    one copy; never count it once per device.

    Any visual token count works with the padding recipe of
    [`sequence_parallel_self_attention`][] applied to the visual sequence (text
    segment ids 0, padding -1).

    **Raises:**

    `ValueError` for a negative `text_len` or one longer than the sequence, an
    unknown `text_position`, `text_lengths` that is not an integer `(B,)` array in
    `[0, text_len]` (or given with `text_len=0`), and as
    [`sequence_parallel_self_attention`][].
    """
    fn = "sequence_parallel_joint_self_attention"
    text_len = static_int("text_len", text_len)
    check_text_position(fn, text_position)
    axis_size(sp_axis_name, what=_WHAT)
    check_qkv(q, k, v, fn)
    S_local = q.shape[1]
    if not 0 <= text_len <= S_local:
        side = "text prefix + visual chunk" if text_position == "prefix" else "visual chunk + text suffix"
        raise ValueError(
            f"{fn}: `text_len` must be between 0 and the per-device sequence length "
            f"{S_local} ({side}, q.shape[1]); received text_len={text_len}."
        )
    if not text_len:
        check_no_text_lengths(fn, text_lengths)
    return _ulysses(q, k, v, text_len, sp_axis_name, scale, kernel_options, fn,
                    text_position=text_position, text_lengths=text_lengths, kv_lengths=kv_lengths)
