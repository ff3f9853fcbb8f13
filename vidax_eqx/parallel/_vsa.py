"""Video sparse attention (VSA) under sequence parallelism: Ulysses, ring, USP.

The global sequence is the video's tile layout (`kernels.tile_permute(x, grid,
tile)`, `VsaLayout(grid, tile).video_len` tokens) padded at its end with whole
**empty** tiles (no real token: hidden from the coarse stage, never selected) up
to what the devices split evenly ([`vsa_padded_length`][], [`vsa_pad`][],
[`vsa_unpad`][]).

- **Ulysses** (`ulysses_axis` only): an `all_to_all` per operand trades the
    sequence split for a head split; each device runs the single-device
    [`vidax_eqx.kernels.video_sparse_attention`][] over the whole video for its
    heads (the coarse stage is local), and a last `all_to_all` restores the layout.
- **Ring** (`ring_axis` only): the coarse keys are all-gathered, every device
    picks its query tiles' global top-k, and the fine stage runs on a ring that
    skips the steps none of its query tiles selected (`_vsa_ring.py`).
- **USP** (both): Ulysses inside each group, then the ring over `ring_axis`, with
    the ring-major sharding of [`usp_attention`][].
"""

import math
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from .. import kernels
from .._order import Sequence
from ..kernels.internal import combine, VsaLayout
from ._checks import check_head_split, check_qkv
from ._layout import check_layout
from ._mesh import axis_size, check_sharded, pad_to_multiple
from ._ulysses import kv_head_repeats
from ._vsa_ring import ring_vsa, VsaRing


_FN = "video_sparse_attention"


def _size(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"vsa_padded_length: `{name}` must be a positive int; received {value!r}.")
    return int(value)


def _tile_multiple(ulysses_size: int, ring_size: int, layout: str) -> int:
    """The padded sequence's tile count is a multiple of this: whole tiles per device
    (and per zigzag chunk of the ring)."""
    devices = ulysses_size * ring_size
    if ring_size > 1 and layout == "zigzag":
        return math.lcm(2 * ring_size, devices)
    return devices


def vsa_padded_length(
    grid: tuple[int, int, int],
    tile: tuple[int, int, int] = (4, 4, 4),
    *,
    ulysses_size: int = 1,
    ring_size: int = 1,
    layout: str = "contiguous",
) -> int:
    """The global sequence length of
    [`video_sparse_attention`][vidax_eqx.parallel.video_sparse_attention] for a mesh.

    The video's tile layout (`VsaLayout(grid, tile).video_len` tokens) padded at its
    end with whole empty tiles, up to a multiple of the device count
    (`ulysses_size * ring_size`) times the tile size; with a zigzag ring
    (`ring_size > 1`), up to `lcm(2 * ring_size, ulysses_size * ring_size)` tiles,
    so that each of the ring's `2 * ring_size` chunks holds whole tiles.

    **Arguments:**

    - `grid`: `(F, H, W)`, the video's token grid.
    - `tile`: tokens per tile `(tf, th, tw)`.
    - `ulysses_size`, `ring_size`: the sizes of the Ulysses and ring mesh axes
        (1 for an axis not used).
    - `layout`: the ring's layout, `"contiguous"` or `"zigzag"`.

    **Returns:**

    The padded global length, an int: each device holds `length / (ulysses_size *
    ring_size)` tokens.
    """
    check_layout(layout)
    u, r = _size("ulysses_size", ulysses_size), _size("ring_size", ring_size)
    video = VsaLayout(grid, tile)
    multiple = _tile_multiple(u, r, layout)
    return -(-video.n_tiles // multiple) * multiple * video.tile_size


def vsa_pad(
    x: Array,
    grid: tuple[int, int, int],
    tile: tuple[int, int, int] = (4, 4, 4),
    *,
    ulysses_size: int = 1,
    ring_size: int = 1,
    layout: str = "contiguous",
    axis: int = 1,
) -> Array:
    """Pads a tile-layout array with empty tiles to [`vsa_padded_length`][].

    **Arguments:**

    - `x`: an array whose `axis` holds the video's tile layout
        (`kernels.tile_permute(x, grid, tile)`, `VsaLayout(grid, tile).video_len`
        tokens), e.g. q, k, v or the gate `(B, S, H, D)`.
    - `grid`, `tile`, `ulysses_size`, `ring_size`, `layout`: as in
        [`vsa_padded_length`][].
    - `axis`: the sequence axis.

    **Returns:**

    `x` padded with zeros at the end of `axis`. For a zigzag ring, apply
    `zigzag_permute(x, axis, ring_size)` to the result before sharding it.
    """
    video = VsaLayout(grid, tile)
    size = jnp.shape(x)[axis] if -jnp.ndim(x) <= axis < jnp.ndim(x) else None
    if size != video.video_len:
        raise ValueError(
            f"vsa_pad: `x` must hold the tile layout of grid {video.grid} with tile {video.tile}, "
            f"{video.video_len} tokens along axis {axis}; received shape {jnp.shape(x)}."
        )
    length = vsa_padded_length(grid, tile, ulysses_size=ulysses_size, ring_size=ring_size,
                               layout=layout)
    return pad_to_multiple(x, length, axis=axis)


def vsa_unpad(x: Array, grid: tuple[int, int, int], tile: tuple[int, int, int] = (4, 4, 4),
              *, axis: int = 1) -> Array:
    """The inverse of [`vsa_pad`][]: the first `VsaLayout(grid, tile).video_len` entries
    of `axis` (the video's tile layout; undo a zigzag permutation first).

    **Arguments:**

    - `x`: a padded array (e.g. the gathered output of
        [`video_sparse_attention`][vidax_eqx.parallel.video_sparse_attention]).
    - `grid`, `tile`: the video's grid and tile.
    - `axis`: the sequence axis.

    **Returns:**

    `x` without the padding tiles.
    """
    video = VsaLayout(grid, tile)
    size = jnp.shape(x)[axis] if -jnp.ndim(x) <= axis < jnp.ndim(x) else None
    if size is None or size < video.video_len:
        raise ValueError(
            f"vsa_unpad: `x` must hold at least the {video.video_len} tokens of the tile layout "
            f"(grid {video.grid}, tile {video.tile}) along axis {axis}; received shape "
            f"{jnp.shape(x)}."
        )
    return lax.slice_in_dim(x, 0, video.video_len, axis=axis)


def _ulysses_kernel(q, k, v, gate, video: VsaLayout, *, topk: int, scale: float, implementation):
    """The single-device kernel over the whole (padded) sequence: the padding tiles cut
    off before it, their rows 0 after it."""
    S, n = q.shape[1], video.video_len
    cut = lambda x: None if x is None else x[:, :n]  # noqa: E731
    out = kernels.video_sparse_attention(
        cut(q), cut(k), cut(v), video.grid, topk=topk, tile=video.tile, gate=cut(gate),
        scale=scale, implementation=implementation,
    )
    return pad_to_multiple(out, S, axis=1) if S > n else out


def _check_gate(gate, q):
    if gate is None:
        return None
    if not hasattr(gate, "shape") or tuple(gate.shape) != tuple(jnp.shape(q)):
        raise ValueError(
            f"{_FN}: `gate` must have q's shape (B, S_local, H, D) = {tuple(jnp.shape(q))} (this "
            f"device's tokens, every head, sharded like q); received "
            f"{getattr(gate, 'shape', type(gate).__name__)}."
        )
    return jnp.asarray(gate)


def video_sparse_attention(
    q: Float[Array, "B S_local H D"],
    k: Float[Array, "B S_local H_kv D"],
    v: Float[Array, "B S_local H_kv D"],
    grid: tuple[int, int, int],
    *,
    ulysses_axis: Hashable | None = None,
    ring_axis: Hashable | None = None,
    layout: str = "contiguous",
    topk: int | None = None,
    sparsity: float | None = None,
    tile: tuple[int, int, int] = (4, 4, 4),
    gate: Float[Array, "B S_local H D"] | None = None,
    scale: float | None = None,
    implementation: str | kernels.AbstractImplementation = "auto",
) -> Float[Array, "B S_local H D"]:
    """Video sparse attention (VSA) under sequence parallelism, inside `jax.shard_map`.

    The sharded form of [`vidax_eqx.kernels.video_sparse_attention`][]: the global
    sequence is the video's tile layout (`kernels.tile_permute(x, grid, tile)`)
    padded at its end with empty tiles to [`vsa_padded_length`][] ([`vsa_pad`][]),
    and each device holds its share of it. The result (and its gradients in q, k,
    v, gate) equals the single-device call on the video's tokens; the padding
    tokens' outputs are 0.

    - `ulysses_axis` only (**Ulysses**): `all_to_all`s give each device the whole
        sequence for `H / U` heads; the single-device kernel runs there (the coarse
        stage is local) and a last `all_to_all` restores the layout.
    - `ring_axis` only (**ring**): each device takes its tiles' means; the coarse
        key/value means (a tile's size smaller than K/V) are all-gathered, every
        device selects its query tiles' global top-k key tiles, and K/V blocks travel
        the ring while the fine stage runs on the tiles each block holds of the
        selection; a step that none of the device's query tiles selected is skipped
        at run time (the block still travels). Custom VJP: a second ring for the fine
        stage, autodiff (a reduce-scatter) for the coarse one.
    - both (**USP**): sharded ring-major as in [`usp_attention`][]
        (`PartitionSpec(None, (ring_axis, ulysses_axis))`), Ulysses within each
        group, then the ring over `ring_axis`.

    **Arguments:**

    - `q`: this device's queries `(B, S_local, H, D)`; with `ulysses_axis`, `H` a
        multiple of its size `U`.
    - `k`, `v`: `(B, S_local, H_kv, D)`, `H % H_kv == 0` (GQA: query head `h` uses kv
        head `h // (H // H_kv)`; kv heads are repeated only as far as the Ulysses
        split needs, [`kv_head_repeats`][]).
    - `grid`: `(F, H, W)`, the video's token grid.
    - `ulysses_axis`, `ring_axis`: the mesh axes (at least one; two different ones).
    - `layout`: the ring's layout: `"contiguous"`, or `"zigzag"` (rank `r` holds
        chunks `r` and `2R - 1 - r` of `2R`, each of whole tiles): permute the padded
        global arrays with `zigzag_permute(x, 1, R)` (`R` the ring size) before
        sharding and undo with `zigzag_unpermute`. Ignored without a ring.
    - `topk`: key tiles per query tile, in `[1, n_tiles]` (the video's tiles); or
    - `sparsity`: the fraction of key tiles skipped, in `[0, 1)`.
    - `tile`: tokens per tile `(tf, th, tw)`.
    - `gate`: `(B, S_local, H, D)`, sharded like `q`: the coarse output's gate; `None`
        adds it ungated.
    - `scale`: logit scale, default `1 / sqrt(D)`.
    - `implementation`: the fine stage's implementation, as in
        [`vidax_eqx.kernels.video_sparse_attention`][].

    **Returns:**

    This device's output `(B, S_local, H, D)` in `q`'s dtype.

    **Raises:**

    `ValueError` when an axis is not bound (or neither is given, or both are the
    same), for an unknown `layout`, `H` not a multiple of the Ulysses size, a local
    length whose total is not [`vsa_padded_length`][], a `gate` of the wrong shape,
    and the kernel's errors for `grid`, `tile`, `topk` and `sparsity`.
    """
    if ulysses_axis is None and ring_axis is None:
        raise ValueError(
            f"{_FN}: pass `ulysses_axis`, `ring_axis` or both (the mesh axes the sequence is "
            "split over); received neither. On one device use "
            "vidax_eqx.kernels.video_sparse_attention."
        )
    if ulysses_axis is not None and ulysses_axis == ring_axis:
        raise ValueError(
            f"{_FN}: `ulysses_axis` and `ring_axis` must be two different mesh axes; received "
            f"{ulysses_axis!r} for both."
        )
    U = 1 if ulysses_axis is None else axis_size(ulysses_axis, what="Ulysses")
    R = 1 if ring_axis is None else axis_size(ring_axis, what="Ring")
    check_layout(layout)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    check_qkv(q, k, v, _FN)
    B, S_local, H, D = q.shape
    H_kv = k.shape[2]
    if ulysses_axis is not None:
        check_head_split(H, U, ulysses_axis, _FN)
    gate = _check_gate(gate, q)
    video = VsaLayout(grid, tile)
    n_sel = video.topk(topk, sparsity)
    layout = layout if R > 1 else "contiguous"
    length = vsa_padded_length(video.grid, video.tile, ulysses_size=U, ring_size=R, layout=layout)
    if S_local * U * R != length:
        raise ValueError(
            f"{_FN}: the global sequence must be the tile layout of grid {video.grid} with tile "
            f"{video.tile} ({video.video_len} tokens) padded with empty tiles to {length} tokens "
            f"(vsa_padded_length for {U * R} devices, layout {layout!r}), so `q` needs "
            f"S_local = {length // (U * R)}; received S_local = {S_local} ({S_local * U * R} in "
            "all). Pad with vsa_pad before sharding."
        )
    axes = tuple(a for a in (ring_axis, ulysses_axis) if a is not None)
    check_sharded(_FN, axes, q=q, k=k, v=v)
    scale = 1.0 / math.sqrt(D) if scale is None else scale

    with jax.named_scope("vidax_parallel_video_sparse_attention"):
        if U > 1:
            repeats = kv_head_repeats(H, H_kv, U)
            if repeats > 1:  # consecutive copies: query head h keeps kv head h // (H // H_kv)
                k, v = jnp.repeat(k, repeats, axis=2), jnp.repeat(v, repeats, axis=2)
            # Every collective waits for the one before it (`vidax_eqx._order`).
            order = Sequence(q, k, v, gate)
            to_heads = lambda x: order(lax.all_to_all, x, ulysses_axis, split_axis=2,  # noqa: E731
                                       concat_axis=1, tiled=True)
            q, k, v = to_heads(q), to_heads(k), to_heads(v)
        if R == 1:
            if U > 1 and gate is not None:
                gate = to_heads(gate)
            out = _ulysses_kernel(q, k, v, gate, video, topk=n_sel, scale=scale,
                                  implementation=implementation)
        else:
            cfg = VsaRing(axis_name=ring_axis, sp_size=R, layout=layout, video=video,
                          n_local=q.shape[1] // video.tile_size, topk=n_sel, scale=float(scale),
                          implementation=implementation)
            out_c, out_f, valid = ring_vsa(cfg, q, k, v)
            if U > 1 and gate is not None:
                # After the ring: in the backward its all_to_all comes before the ring's.
                order.last = out_f
                gate = to_heads(gate)
            out = combine(out_c, out_f, gate, valid, video.tile_size)
        if U > 1:
            out = order(lax.all_to_all, out, ulysses_axis, split_axis=1, concat_axis=2,
                        tiled=True)
        return out
