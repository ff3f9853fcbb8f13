"""A model call's attention option, as small named types: `SlidingTile` (sliding tile
attention), `VideoSparseTiles` (video sparse attention) and `BlockCausal` (frame-block
causal attention, autoregressive video), the check of a call's
`attention=`, and the keywords it replaced (`sliding_tile=`, `video_sparse=`), kept
working for a release."""

import functools
import os
import sys
from typing import NamedTuple

import equinox as eqx

from .._deprecation import warn_deprecated


_EQUINOX = os.path.dirname(eqx.__file__) + os.sep


class SlidingTile(NamedTuple):
    """A model call's `attention=SlidingTile(tile, window)`: every self-attention as
    sliding tile attention ([`vidax_eqx.kernels.SlidingTileMask`][]) over the model's
    patch grid, tokens laid out tile by tile ([`TokenLayout`][]).

    **Fields:** `tile`, the tokens of a tile `(tf, th, tw)`; `window`, the tiles each
    query tile sees `(wf, wh, ww)`, or one such window per head.
    """

    tile: tuple[int, int, int]
    window: tuple


class VideoSparseTiles(NamedTuple):
    """A model call's `attention=VideoSparseTiles(tile, topk_or_sparsity)`: every
    self-attention as video sparse attention
    ([`vidax_eqx.kernels.video_sparse_attention`][]) over the model's patch grid,
    tokens laid out tile by tile ([`TokenLayout`][]).

    **Fields:** `tile`, the tokens of a tile `(tf, th, tw)` (FastVideo's: `(4, 4, 4)`);
    `topk_or_sparsity`, an int: the key tiles each query tile attends (`topk`), or a
    float in `[0, 1)`: the fraction of key tiles skipped (`sparsity`).
    """

    tile: tuple[int, int, int]
    topk_or_sparsity: int | float


class BlockCausal(NamedTuple):
    """A model call's `attention=BlockCausal(frames_per_block, window)`: every
    self-attention as frame-block causal attention
    ([`vidax_eqx.kernels.BlockCausalMask`][]) over the model's patch grid, tokens in
    raster order: the latent frames in blocks of `frames_per_block`, each block seeing
    itself and the blocks before it (autoregressive video: SkyReels-V2's diffusion
    forcing, CausVid, Self-Forcing).

    **Fields:** `frames_per_block`, latent frames per block (after the patch
    embedding's temporal patch); `window`, the key blocks a block sees, its own
    included (`None`: every earlier block; a rolling key/value cache of that many
    blocks attends so).
    """

    frames_per_block: int
    window: int | None = None


def check_attention(owner: str, attention):
    """`attention` (a [`SlidingTile`][], a [`VideoSparseTiles`][], a [`BlockCausal`][]
    or `None`) after checking its type; a `ValueError` naming `owner` otherwise. The
    values inside are checked where they are used (`kernels.SlidingTileMask`,
    `nn.VideoSparse`, `kernels.BlockCausalMask`)."""
    if attention is None or isinstance(attention, (SlidingTile, BlockCausal)):
        return attention
    if isinstance(attention, VideoSparseTiles):
        amount = attention.topk_or_sparsity
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise ValueError(
                f"{owner}: `attention=VideoSparseTiles(tile, topk_or_sparsity)` takes an int "
                "(the key tiles each query tile attends) or a float in [0, 1) (the fraction "
                f"skipped), e.g. VideoSparseTiles((4, 4, 4), 0.9); received {attention!r}."
            )
        return attention
    hint = ""
    if isinstance(attention, (tuple, list)) and len(attention) == 2:
        hint = (" A plain pair says neither which: wrap it, SlidingTile(*pair) or "
                "VideoSparseTiles(*pair).")
    raise ValueError(
        f"{owner}: `attention` must be models.SlidingTile(tile, window), "
        f"models.VideoSparseTiles(tile, topk_or_sparsity), models.BlockCausal(frames_per_block) "
        f"or None (full attention); "
        f"received {attention!r}.{hint}"
    )


def attention_keywords(fn):
    """Decorates a model call taking `attention=` (outermost, so that a warning points
    at the caller's line): the keywords it replaced keep working for a release, with a
    `DeprecationWarning`. `sliding_tile=(tile, window)` is
    `attention=SlidingTile(tile, window)` and `video_sparse=(tile, topk or sparsity)`
    is `attention=VideoSparseTiles(tile, topk or sparsity)`; each also takes a plain
    pair, as they did, and `None` (full attention)."""
    method = fn.__qualname__.rpartition(".")[2]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if "sliding_tile" in kwargs or "video_sparse" in kwargs:
            # The class of the model called (a base's method names its subclass).
            is_method = "." in fn.__qualname__ and args and isinstance(args[0], eqx.Module)
            owner = (f"{type(args[0]).__name__}.{method}" if is_method
                     else fn.__qualname__).removesuffix(".__call__")
            kwargs["attention"] = _from_deprecated(owner, kwargs, _wrapper_frames())
        return fn(*args, **kwargs)

    return call


def _wrapper_frames() -> int:
    """The frames of Equinox's bound-method wrappers between the caller of the
    decorated call and the call (a module's method called as `model.method(...)`), so
    that the warning points at the user's line however the method was reached."""
    frame, n = sys._getframe(2), 0
    while frame is not None and frame.f_code.co_filename.startswith(_EQUINOX):
        frame, n = frame.f_back, n + 1
    return n


def _from_deprecated(owner: str, kwargs: dict, wrappers: int = 0):
    """The `attention=` of a call's `sliding_tile=` / `video_sparse=` (popped from
    `kwargs`), with their warnings and their checks as they were."""
    old = {name: kwargs.pop(name) for name in ("sliding_tile", "video_sparse") if name in kwargs}
    new = {"sliding_tile": "SlidingTile(tile, window)",
           "video_sparse": "VideoSparseTiles(tile, topk_or_sparsity)"}
    for name in old:
        # warn_deprecated <- here <- attention_keywords' call <- [Equinox's method
        # wrappers] <- the model call's caller
        warn_deprecated(f"{owner}({name}=...)", f"`attention=models.{new[name]}`",
                        stacklevel=3 + wrappers)
    if "attention" in kwargs:
        raise TypeError(
            f"{owner}() got both `{'` and `'.join(old)}` (deprecated) and `attention`: pass "
            "`attention` only."
        )
    sliding_tile, video_sparse = old.get("sliding_tile"), old.get("video_sparse")
    if video_sparse is not None and sliding_tile is not None:
        raise ValueError(
            f"{owner}: `video_sparse` and `sliding_tile` are two kinds of sparse attention; "
            f"pass one of them; received video_sparse={video_sparse!r}, "
            f"sliding_tile={sliding_tile!r}."
        )
    if sliding_tile is not None:
        if not isinstance(sliding_tile, (tuple, list)) or len(sliding_tile) != 2:
            raise ValueError(
                f"{owner}: `sliding_tile` must be a pair (tile, window), e.g. ((3, 6, 8), "
                f"(3, 3, 3)); received {sliding_tile!r}."
            )
        return SlidingTile(*sliding_tile)
    if video_sparse is not None:
        ok = isinstance(video_sparse, (tuple, list)) and len(video_sparse) == 2
        amount = video_sparse[1] if ok else None
        if not ok or isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise ValueError(
                f"{owner}: `video_sparse` must be a pair (tile, topk or sparsity): an int "
                "is the number of key tiles each query tile attends, a float in [0, 1) the "
                "fraction skipped, e.g. ((4, 4, 4), 0.9) or ((2, 2, 2), 3); received "
                f"{video_sparse!r}."
            )
        return VideoSparseTiles(*video_sparse)
    return None
