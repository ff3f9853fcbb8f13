"""The documented fronts of [`sequence_attention`][]: DeepSpeed-Ulysses
([`sequence_parallel_self_attention`][], [`sequence_parallel_joint_self_attention`][]),
ring attention ([`ring_attention`][]) and 2D sequence parallelism ([`usp_attention`][]).

Each is one call of the entry (`_sequence.attend`) under its own name: the request is
checked once there (`_request.py`), and the worker of the mode runs (`_ulysses.py`,
`_ring_engine.py`, `_joint.py`, `_usp.py`). What a front adds is its signature (the
seed APIs' positional `sp_axis_name` and `scale`, the ring's keyword list) and its
documentation.

Ring attention, how it runs: every device keeps its queries; the key/value blocks
(with their segment ids) move one hop per step by `jax.lax.ppermute`, so after `n`
steps every device has attended to the whole sequence. Each step is one call of
`vidax_eqx.kernels.attention_fwd` on global token positions, and the partial results
are merged in float32 by their log-sum-exp; the backward is a second ring in which
dK/dV accumulators travel behind their K/V blocks. Steps whose block the mask hides
entirely are skipped (`lax.switch`), not computed and masked; in the `"zigzag"` layout
each local block is two chunks of the global sequence (`r` and `2n - 1 - r`), so every
causal step after the first computes exactly half a block on every device
([`ring_work`][] reports it). The ring lives in `_layout.py` (layouts, zigzag,
positions), `_schedule.py` (the step plans), `_rank_masks.py` (per-rank sliding tile
masks), `_ring_engine.py` (the forward and backward rings and their custom VJP) and
`_joint.py` (the joint layout on that engine: the text K/V never travel).
"""

from collections.abc import Hashable

from jaxtyping import Array, Float, Int

from .. import kernels
from .._deprecation import renamed_keywords
from ._sequence import attend


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
    return attend("sequence_parallel_self_attention", q, k, v, ulysses_axis=sp_axis_name,
                  scale=scale, kv_lengths=kv_lengths, **kernel_options)


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
    return attend("sequence_parallel_joint_self_attention", q, k, v, ulysses_axis=sp_axis_name,
                  text_len=text_len, text_position=text_position, text_lengths=text_lengths,
                  scale=scale, kv_lengths=kv_lengths, **kernel_options)


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
    return attend("ring_attention", q, k, v, ring_axis=ring_axis, layout=layout,
                  text_len=text_len, text_position=text_position, text_lengths=text_lengths,
                  causal=causal, segment_ids=segment_ids, sinks=sinks, window=window,
                  scale=scale, logits_soft_cap=logits_soft_cap, mask=mask,
                  implementation=implementation, kv_lengths=kv_lengths)


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
    return attend("usp_attention", q, k, v, ulysses_axis=ulysses_axis, ring_axis=ring_axis,
                  layout=layout, text_len=text_len, text_position=text_position,
                  text_lengths=text_lengths, causal=causal, segment_ids=segment_ids,
                  sinks=sinks, window=window, scale=scale, logits_soft_cap=logits_soft_cap,
                  mask=mask, implementation=implementation, kv_lengths=kv_lengths)
