"""Ring attention: K/V blocks travel a ring of devices while each merges `(out, lse)`.

Every device keeps its queries; the key/value blocks (with their segment ids)
move one hop per step by `jax.lax.ppermute`, so after `n` steps every device has
attended to the whole sequence (a block's positions follow from its rank and the
layout, so they need not travel). Each step is one call of
`vidax_eqx.kernels.attention_fwd` on global token positions, and the partial
results are merged in float32 by their log-sum-exp. The backward is a second
ring: K/V travel again, and their dK/dV accumulators travel behind them, one
hop later, so that the transfer overlaps the next step's compute.

Steps whose block the mask hides entirely are skipped (`lax.switch`), not
computed and masked. Token positions are a static function of (rank, step),
so which blocks the causal mask or window hides is tabulated at trace time; tiles
that segment ids hide are skipped inside the blockwise kernel. In the `"zigzag"`
layout each local block is two chunks of the global sequence (`r` and
`2n - 1 - r`) and the skip works per chunk: every causal step after the first
computes exactly half a block, on every device, so the work is balanced
([`ring_work`][] reports it).

Communication is the minimum: `n - 1` K/V hops forward; `n - 1` K/V hops and
`n - 1` dK/dV hops backward (the local block's gradients never travel).

The joint (CogVideoX) layout (`text_len > 0`: a replicated text prefix before
each device's visual chunk) runs this ring for the visual tokens and the text
blocks locally, in `_joint.py`; the text K/V never travel.

This file is the public entry, [`ring_attention`][], and its dispatch. The ring
lives one floor down, in files that never import this one: `_layout.py` (layouts,
zigzag, positions), `_schedule.py` (the step plans, [`ring_work`][]),
`_rank_masks.py` (per-rank sliding tile masks), `_ring_engine.py` (the forward and
backward rings, their custom VJP, and the validated `run_ring`) and `_joint.py`
(the joint layout on that engine).
"""

from collections.abc import Hashable

from jaxtyping import Array, Float, Int

from .. import kernels
from .._checks import static_int
from .._deprecation import renamed_keywords
from ._checks import check_no_text_lengths, check_text_position
from ._joint import ring_joint_attention
from ._ring_engine import run_ring


@renamed_keywords(axis_name="ring_axis")  # 0.1.0's spelling, removed in 0.3.0
def ring_attention(
    q: Float[Array, "B L H D"],
    k: Float[Array, "B L_k H_kv D"],
    v: Float[Array, "B L_k H_kv D"],
    *,
    ring_axis: Hashable,
    causal: bool = False,
    segment_ids: kernels.SegmentIds | Int[Array, "B L"] | None = None,
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
) -> Float[Array, "B L H D"]:
    """Ring attention over the sequence axis, inside `jax.shard_map`.

    Each device holds a block of the sequence. K/V blocks travel the ring of
    `ring_axis` by `ppermute` (the next transfer is issued before the current
    step's kernel, so communication overlaps compute); each step calls
    `vidax_eqx.kernels.attention_fwd` on the global positions of the tokens
    involved and merges the partial `(out, lse)` in float32. Blocks (or, in the
    zigzag layout, half-blocks) that the mask hides entirely are skipped. The
    result equals single-device attention over the whole sequence.

    Differentiable in `q`, `k`, `v` and `sinks` by a `jax.custom_vjp` whose
    backward is a second ring: K/V travel again with their float32 dK/dV
    accumulators and each step calls `vidax_eqx.kernels.attention_bwd` with the
    globally merged `out` and `lse`.

    **Arguments:**

    - `q`: this device's queries `(B, L, H, D)`.
    - `k`, `v`: this device's keys and values `(B, L_k, H_kv, D)`, `H % H_kv == 0`
        (GQA / MQA: they travel with `H_kv` heads).
    - `ring_axis`: the mesh axis of the ring (`axis_name=`, its 0.1.0 spelling, still
        works until 0.3.0, with a `DeprecationWarning`).
    - `causal`: a token attends to global positions at or before its own.
    - `segment_ids`: this device's ids, one `(B, L)` array or
        `SegmentIds(q=(B, L), kv=(B, L_k))`; the kv ids travel with their block.
        Negative ids are padding (see `pad_to_multiple` / `padding_segment_ids` for
        sequence lengths that do not divide the number of devices).
    - `sinks`: per-head sink logits `(H,)`, usually replicated (`PartitionSpec()`);
        counted once per row, not once per step. Its gradient is summed over the
        devices.
    - `window`: `(left, right)` sliding window on global positions.
    - `scale`: logit scale, default `1 / sqrt(D)`.
    - `logits_soft_cap`: `c` applies `c * tanh(s / c)` to the scaled logits.
    - `layout`: how the global sequence is laid out over the devices (see
        [`ring_positions`][]). `"contiguous"`: rank `r` holds the `r`-th block.
        `"zigzag"`: rank `r` holds chunks `r` and `2n - 1 - r` of `2n` (`L` even);
        permute the global sequence with [`zigzag_permute`][] before sharding and
        undo with [`zigzag_unpermute`][]. Zigzag balances causal work.
    - `text_len`: the joint (CogVideoX) layout when `> 0`: each device's `q`, `k`,
        `v` are `(B, text_len + L, H(_kv), D)`, `[text prefix (text_len tokens, the
        same on every device); this device's chunk of the visual sequence]`, and
        the visual sequence alone is sharded over `ring_axis` (and, for zigzag,
        permuted with `zigzag_permute(visual, 1, n)`; the text is not). The result
        equals single-device attention over `[text; visual]`, text at positions
        `0 .. text_len - 1` and visual tokens after it (so `causal=True` lets the
        text see no visual token). `segment_ids` follow the same per-device layout,
        `(B, text_len + L)`. Self-attention only: `k`, `v` have `q`'s length.
        `text_len == q.shape[1]` (no visual tokens) is local attention over the
        text. `0` (the default) is plain ring attention.
    - `mask`: a [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask] (sliding
        tile attention) over the global sequence, evaluated at each step's global
        positions; ANDed with `causal`, `window` and segment ids. The global
        sequence (`sp_size x L`, in global order before any `zigzag_permute`) is
        the mask's `seq_len` tokens, padded at the end by fewer than one tile per
        chunk (the padding is invisible). Steps (zigzag: half-blocks) it hides
        entirely are skipped, and each step's kernel skips the hidden tiles; give
        each device whole tiles (a local length, or zigzag half-length, that is a
        multiple of the tile size, and a text prefix in the joint layout, not in the
        ring) so that kernel blocks are whole tiles. In the joint layout
        (`text_len > 0`) the mask's `text_len` must equal it (`"prefix"`), and the
        visual sequence is its video tokens.
    - `implementation`: the kernel implementation of each step, as in
        `vidax_eqx.kernels.attention`.
    - `text_position`: where the text sits in the joint layout (`text_len > 0`):
        `"prefix"` (the default, `[text; visual chunk]`, CogVideoX) or `"suffix"`:
        each device's arrays (and segment ids, and the result) are `[this device's
        visual chunk; text (text_len tokens, the same on every device)]`, and the result
        equals single-device attention over `[visual; text]`: the visual tokens at
        positions `0 .. n L - 1`, the text at `n L .. n L + text_len - 1` (MMDiT
        models: HunyuanVideo, Flux-style blocks). Causal masks and windows act on those
        positions (a causal suffix lets every text token see the whole video, and no
        video token see the text). A `SlidingTileMask` must then say
        `text_position="suffix"`; it cannot be combined with `causal` / `window` here
        (`NotImplementedError`).
    - `text_lengths`: int `(B,)`, the joint layout's key-only text padding: the text
        keys at an index `>= text_lengths[b]` within the text block are invisible to
        every query (video and text); every query, the padded text rows included, is
        still computed. `0 <= text_lengths[b] <= text_len`; replicated
        (`PartitionSpec()`). Served by key segment ids -1 (the queries keep theirs).
    - `kv_lengths`: int `(B,)`, key-only padding of the whole sequence: keys at a
        **global** index `>= kv_lengths[b]` are invisible to every query, every query is
        computed. The global index is the token's place in the single-device sequence
        (its ring position; in the joint layout `[text; visual]` or `[visual; text]`),
        padding to the device count included, so `0 <= kv_lengths[b] <= ` the global key
        count. Each device turns it into key segment ids -1 for its own keys
        (contiguous or zigzag), which travel the ring with their block.

    **Returns:**

    This device's output `(B, L, H, D)` in `q`'s dtype (`(B, text_len + L, H, D)`
    in the joint layout, its first `text_len` rows the text output, bitwise
    identical on every device; its last for a suffix). A row that sees nothing gives
    0. [`replicated`][] returns the text rows from `shard_map` with `out_specs=P()`.

    **Joint layout, how it runs and its gradients:** the text K/V never travel
    the ring, only the visual K/V do. Visual queries meet the text keys in one
    local kernel call; text queries meet this device's visual chunk in one local
    kernel call whose partial `(out, lse)` are all-gathered over the ring and
    merged in a fixed order (so every device gets bitwise the same text rows);
    the text x text block is computed locally. Everything is merged by
    log-sum-exp in float32, and the backward runs every block's backward (and the
    ring's) with the merged `out` and `lse`. The text output rows are copies: the
    cotangent of the text output is the **sum** of the copies' cotangents (give
    every copy its share, or the whole cotangent to one copy; never the whole
    cotangent to every copy), and the gradient with respect to the text inputs is
    the sum over the devices' copies (what `shard_map` gives for a replicated
    input): the text x text block's part of it is kept on rank 0 only, so it
    counts once. As in [`usp_attention`][] with `text_len`.

    **Raises:**

    `ValueError` when `ring_axis` is not bound (outside `shard_map`), for an
    unknown `layout`, an odd local length with `layout="zigzag"` (in the joint
    layout: an odd visual length `q.shape[1] - text_len`), a `text_len` that is
    not a Python int in `[0, q.shape[1]]`, or (joint layout) shapes that are not
    self-attention, an unknown `text_position`, `text_lengths` or `kv_lengths` that are
    not an integer `(B,)` array within their range (`text_lengths` without a joint
    layout included); the kernel's errors for invalid or unsupported options.
    """
    text_len = static_int("text_len", text_len)
    check_text_position("ring_attention", text_position)
    if text_len:
        return ring_joint_attention(
            q, k, v, axis_name=ring_axis, causal=causal, segment_ids=segment_ids, sinks=sinks,
            window=window, scale=scale, logits_soft_cap=logits_soft_cap, layout=layout,
            text_len=text_len, implementation=implementation, tile_mask=mask,
            text_position=text_position, text_lengths=text_lengths, kv_lengths=kv_lengths,
        )
    check_no_text_lengths("ring_attention", text_lengths)
    return run_ring(
        q, k, v, axis_name=ring_axis, causal=causal, segment_ids=segment_ids, sinks=sinks,
        window=window, scale=scale, logits_soft_cap=logits_soft_cap, layout=layout,
        implementation=implementation, tile_mask=mask, kv_lengths=kv_lengths,
    )
