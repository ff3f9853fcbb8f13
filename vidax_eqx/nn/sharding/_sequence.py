"""The one switch from a `ParallelConfig` to the attention that runs: every attention layer
of `vidax_eqx.nn` calls these with its configuration, and nothing else reads the
configuration's sequence axes to choose a function.

One example per call, `(S, H, D)` (the batched functions below take `(1, S, H, D)`).
"""

import jax

from ... import kernels
from ... import parallel as par
from ._config import ParallelConfig
from .._video_sparse import VideoSparse


def check_tile_mask(owner: str, mask, num_heads: int) -> None:
    """Raises unless `mask` (an argument of the attention layer `owner` of `num_heads`
    heads) is `None`, a `kernels.SlidingTileMask` with one window or one per head, or a
    `kernels.BlockCausalMask`."""
    if mask is None:
        return
    if not isinstance(mask, (kernels.SlidingTileMask, kernels.BlockCausalMask)):
        raise TypeError(
            f"{owner}: `mask` must be a vidax_eqx.kernels.SlidingTileMask, a "
            f"vidax_eqx.kernels.BlockCausalMask or None; received {type(mask).__name__}."
        )
    mask.check_heads(num_heads, owner)


def attend(q, k, v, parallel: ParallelConfig, implementation, *, text_len: int = 0,
           text_position: str = "prefix", text_lengths=None, segment_ids=None, mask=None,
           kv_length=None, quantize=None):
    """`(S, H, D)` attention of one example over the sequence as `parallel` splits it:
    [`vidax_eqx.parallel.sequence_attention`][] with the configuration's axes.

    `text_len`: `0` for self-attention over this device's tokens; else a joint layout,
    a replicated text of `text_len` tokens before (`"prefix"`, CogVideoX) or after
    (`"suffix"`, MMDiT) this device's tokens, `text_lengths` its key-only padding (an
    int32 scalar). `mask`: a `SlidingTileMask` over the whole sequence (per-head windows
    follow the heads to their tensor-parallel rank) or a `BlockCausalMask`. `kv_length`: an int32 scalar,
    key-only padding at global indices. `quantize`: the kernel's `quantize=` (int8).
    """
    segment_ids = jax.tree.map(lambda a: a[None], segment_ids)  # an array or SegmentIds
    opts = dict(segment_ids=segment_ids, mask=mask, implementation=implementation)
    if quantize is not None:
        opts["quantize"] = quantize
    if kv_length is not None:
        opts["kv_lengths"] = kv_length[None]
    if text_len:
        opts.update(text_len=text_len, text_position=text_position,
                    text_lengths=None if text_lengths is None else text_lengths[None])
    out = par.sequence_attention(q[None], k[None], v[None], ulysses_axis=parallel.ulysses_axis,
                                 ring_axis=parallel.ring_axis, tp_axis=parallel.tp_axis,
                                 layout=parallel.layout, **opts)
    return out[0]


def attend_sparse(q, k, v, gate, parallel: ParallelConfig, implementation,
                  video_sparse: VideoSparse):
    """`(S, H, D)` video sparse attention of one example (tokens in the tile layout) over
    the sequence as `parallel` splits it; `gate` `(S, H, D)` or None."""
    opts = dict(topk=video_sparse.topk, sparsity=video_sparse.sparsity, tile=video_sparse.tile,
                gate=None if gate is None else gate[None], implementation=implementation)
    if not parallel.sequence_axes:
        out = kernels.video_sparse_attention(q[None], k[None], v[None], video_sparse.grid,
                                             **opts)
    else:
        out = par.video_sparse_attention(q[None], k[None], v[None], video_sparse.grid,
                                         ulysses_axis=parallel.ulysses_axis,
                                         ring_axis=parallel.ring_axis, layout=parallel.layout,
                                         **opts)
    return out[0]


def replicated_text(x, parallel: ParallelConfig):
    """`x` (a joint layout's text rows, computed equally on every device of the sequence
    axes) typed as the same there ([`vidax_eqx.parallel.replicated`][]: device 0's copy,
    one `psum`), so that it leaves `shard_map` with an out_spec that does not name them."""
    axes = parallel.sequence_axes
    if not axes:
        return x
    return par.replicated(x, axes[0] if len(axes) == 1 else axes)

