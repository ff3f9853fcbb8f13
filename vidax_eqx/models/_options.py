"""A model call's sparse attention options, as small named types: `SlidingTile` (sliding
tile attention) and `VideoSparseTiles` (video sparse attention), and the masks and
layer options they become over a model's patch grid."""

from typing import NamedTuple

from .. import kernels, nn


class SlidingTile(NamedTuple):
    """A model call's `sliding_tile=`: every self-attention as sliding tile attention
    ([`vidax_eqx.kernels.SlidingTileMask`][]) over the model's patch grid, tokens laid
    out tile by tile. A plain pair `(tile, window)` is taken as one.

    **Fields:** `tile`, the tokens of a tile `(tf, th, tw)`; `window`, the tiles each
    query tile sees `(wf, wh, ww)`, or one such window per head.
    """

    tile: tuple[int, int, int]
    window: tuple


class VideoSparseTiles(NamedTuple):
    """A model call's `video_sparse=`: every self-attention as video sparse attention
    ([`vidax_eqx.kernels.video_sparse_attention`][]) over the model's patch grid. A
    plain pair `(tile, topk or sparsity)` is taken as one.

    **Fields:** `tile`, the tokens of a tile `(tf, th, tw)` (FastVideo's: `(4, 4, 4)`);
    `topk_or_sparsity`, an int: the key tiles each query tile attends (`topk`), or a
    float in `[0, 1)`: the fraction of key tiles skipped (`sparsity`).
    """

    tile: tuple[int, int, int]
    topk_or_sparsity: int | float


def sliding_tile_mask(owner: str, sliding_tile, grid, text_len: int = 0):
    """The `kernels.SlidingTileMask` of a model's `sliding_tile` (a [`SlidingTile`][] or
    a pair `(tile, window)`) over its patch `grid` (after a text prefix of `text_len`
    tokens), or `None`."""
    if sliding_tile is None:
        return None
    if not isinstance(sliding_tile, (tuple, list)) or len(sliding_tile) != 2:
        raise ValueError(
            f"{owner}: `sliding_tile` must be a pair (tile, window), e.g. ((3, 6, 8), (3, 3, 3)); "
            f"received {sliding_tile!r}."
        )
    tile, window = SlidingTile(*sliding_tile)
    return kernels.SlidingTileMask(tuple(grid), tile, window, text_len=text_len)


def video_sparse_option(owner: str, video_sparse, grid, sliding_tile=None):
    """The [`vidax_eqx.nn.VideoSparse`][] of a model's `video_sparse` (a
    [`VideoSparseTiles`][] or a pair `(tile, topk or sparsity)`: an int is `topk`, a
    float `sparsity`) over its patch `grid`, or `None`."""
    if video_sparse is None:
        return None
    if sliding_tile is not None:
        raise ValueError(
            f"{owner}: `video_sparse` and `sliding_tile` are two kinds of sparse attention; "
            f"pass one of them; received video_sparse={video_sparse!r}, "
            f"sliding_tile={sliding_tile!r}."
        )
    ok = isinstance(video_sparse, (tuple, list)) and len(video_sparse) == 2
    amount = video_sparse[1] if ok else None
    if not ok or isinstance(amount, bool) or not isinstance(amount, (int, float)):
        raise ValueError(
            f"{owner}: `video_sparse` must be a pair (tile, topk or sparsity): an int "
            "is the number of key tiles each query tile attends, a float in [0, 1) the "
            "fraction skipped, e.g. ((4, 4, 4), 0.9) or ((2, 2, 2), 3); received "
            f"{video_sparse!r}."
        )
    tile, amount = VideoSparseTiles(*video_sparse)
    kind = "topk" if isinstance(amount, int) else "sparsity"
    return nn.VideoSparse(tuple(grid), tile, **{kind: amount})
