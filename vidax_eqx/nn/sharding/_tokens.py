"""The token split of a `ParallelConfig`: each device's share of a per-token array
and the whole sequence back from the shares, in the layout its sequence axes say; and a
model's tokens padded to the devices."""

import math

import jax
import jax.numpy as jnp
from jax import lax

from ...parallel import axis_size, chunk_by_rank, vsa_padded_length, zigzag_permute, zigzag_unpermute
from ._config import check_parallel, ParallelConfig
from .._video_sparse import VideoSparse


def _split(fn: str, parallel: ParallelConfig):
    """How `parallel` splits a sequence on this device: `(axes, rank, n, zigzag_n)` (the
    mesh axes, this device's chunk among `n`, the ring size of the zigzag), or `None`
    for one device."""
    check_parallel(fn, parallel)
    axes = parallel.sequence_axes
    if not axes:
        return None
    sizes = [axis_size(a, what="Ring" if a == parallel.ring_axis else "Sequence-parallel")
             for a in axes]
    rank = 0
    for a, size in zip(axes, sizes):  # ring-major: chunk ring_rank * n_ulysses + ulysses_rank
        rank = rank * size + lax.axis_index(a)
    ring = 1 if parallel.ring_axis is None else sizes[0]
    return axes, rank, math.prod(sizes), ring


def shard_tokens(x, parallel: ParallelConfig, *, axis: int = 0):
    """This device's share of a per-token array, in the layout `parallel` shards `x` in.

    Call it inside `jax.shard_map` with `x` whole (the same on every device, e.g. a
    closed-over constant or in_spec `P()`): RoPE tables, segment ids, positions, or the
    tokens themselves. It returns exactly the rows a module configured with `parallel`
    expects next to its `x`, so the tables always follow the tokens: contiguous chunks
    of the sequence axis for Ulysses and ring; for `layout="zigzag"` the
    [`vidax_eqx.parallel.zigzag_permute`][]d sequence, chunked; for `"usp"` ring-major
    chunks over `(ring_axis, ulysses_axis)` (zigzag over the ring). A mismatch here is not
    detectable afterwards (a RoPE table is just numbers), which is why this one call
    exists: `rope = nn.sharding.shard_tokens(nn.functional.rope_3d(grid, head_dim), parallel)`.

    **Arguments:**

    - `x`: an array, or a PyTree of arrays (e.g. the `(cos, sin)` pair), each with the
        whole sequence along `axis`.
    - `parallel`: the [`ParallelConfig`][] of the module the result is for.
    - `axis`: the sequence axis of every array.

    **Returns:**

    The same structure with `S / n` rows along `axis` (`n` the number of devices the
    sequence is split over); `x` itself for `sequence="none"`. `S` must be a multiple of
    `n` (`2n` for zigzag): pad first with [`vidax_eqx.parallel.pad_to_multiple`][].
    """
    split = _split("shard_tokens", parallel)
    if split is None:
        return x
    _, rank, n, zigzag_n = split

    def shard(a):
        if parallel.layout == "zigzag":
            a = zigzag_permute(a, axis, zigzag_n)
        return chunk_by_rank(a, axis, n, rank)

    return jax.tree.map(shard, x)


def gather_tokens(x, parallel: ParallelConfig, *, axis: int = 0):
    """The inverse of [`shard_tokens`][]: the whole sequence from every device's share.

    Call it inside `jax.shard_map` on per-token arrays sharded as `parallel` shards
    `x` (a module's output, e.g. a DiT's last hidden states before unpatchify): every
    device's rows, in the layout's order, with the zigzag undone. The result is the
    same on every device of the sequence axes, and known to be (it is a `psum`, so it
    may leave `shard_map` with an out_spec that does not name those axes); its
    gradient gives each device the cotangent of its own rows. It moves `n` times the
    rows of an `all_gather`: gather small arrays (a model's output projection, not
    its hidden states).

    **Arguments:**

    - `x`: an array, or a PyTree of arrays, each this device's rows along `axis`.
    - `parallel`: the [`ParallelConfig`][] the rows were sharded by.
    - `axis`: the sequence axis of every array.

    **Returns:**

    The same structure with `n` times the rows along `axis`, in global order; `x`
    itself for `sequence="none"`.
    """
    split = _split("gather_tokens", parallel)
    if split is None:
        return x
    axes, rank, n, zigzag_n = split

    def gather(a):
        # A psum of each device's rows placed in a zero buffer: unlike all_gather, its
        # result is known to be the same on every device (replicated under check_vma,
        # so it can leave shard_map with an unsharded out_spec); its transpose hands
        # each device the cotangent of its own rows.
        rows = a.shape[axis]
        shape = (*a.shape[:axis], n * rows, *a.shape[axis + 1:])
        start = [0] * a.ndim
        start[axis] = rank * rows
        a = lax.psum(lax.dynamic_update_slice(jnp.zeros(shape, a.dtype), a, start), axes)
        if parallel.layout == "zigzag":
            a = zigzag_unpermute(a, axis, zigzag_n)
        return a

    return jax.tree.map(gather, x)


def sequence_multiple(parallel: ParallelConfig) -> int:
    """The multiple a sharded sequence is padded to: the number of devices it is split
    over, twice that for the zigzag layout (two chunks per ring rank); `1` on one
    device. Inside `shard_map` (it reads the axes' sizes)."""
    n = math.prod(axis_size(a, what="Ring" if a == parallel.ring_axis else "Sequence-parallel")
                  for a in parallel.sequence_axes)
    return 2 * n if parallel.layout == "zigzag" else n


def padded_tokens(tokens, per_token, parallel: ParallelConfig, *, tile_size: int = 1,
                  video_sparse: VideoSparse | None = None):
    """This device's tokens (or patches) and rows of the per-token arrays (RoPE tables,
    position embeddings) under `parallel`, and the padding's segment ids.

    The sequence is padded with zero rows to a multiple of [`sequence_multiple`][], the
    padding given segment id -1 (invisible to attention) and the rest 0, and each array
    is split by [`shard_tokens`][]. `per_token` is any PyTree of
    `(S, ...)` arrays. Returns `(tokens, per_token, segment_ids, n)`: `segment_ids` is
    `None` when nothing is padded, `n` the real token count. `tile_size`: the tokens
    of a sliding tile mask's tile; ring attention then gets whole tiles per chunk.
    `video_sparse`: the tokens are its tile layout, padded with whole (empty) tiles to
    [`vidax_eqx.parallel.vsa_padded_length`][], what video sparse attention takes.
    """
    n = tokens.shape[0]
    if not parallel.sequence_axes:
        return tokens, per_token, None, n
    if video_sparse is not None:
        size = lambda a: 1 if a is None else axis_size(a)  # noqa: E731
        total = vsa_padded_length(video_sparse.grid, video_sparse.tile,
                                  ulysses_size=size(parallel.ulysses_axis),
                                  ring_size=size(parallel.ring_axis), layout=parallel.layout)
    else:
        multiple = sequence_multiple(parallel)
        if parallel.ring_axis is not None:
            multiple *= tile_size
        total = -(-n // multiple) * multiple
    segment_ids = None
    if total != n:
        pad = lambda a: jnp.pad(a, ((0, total - n),) + ((0, 0),) * (a.ndim - 1))  # noqa: E731
        tokens, per_token = pad(tokens), jax.tree.map(pad, per_token)
        segment_ids = jnp.where(jnp.arange(total) < n, 0, -1).astype(jnp.int32)
    tokens, per_token, segment_ids = shard_tokens((tokens, per_token, segment_ids), parallel)
    return tokens, per_token, segment_ids, n
