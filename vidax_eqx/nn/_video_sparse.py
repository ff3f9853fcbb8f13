"""The static option that runs a self-attention as video sparse attention (VSA), and the
calls of `Attention` it refuses."""

import dataclasses

from ..kernels.internal import resolve_topk, VsaLayout


@dataclasses.dataclass(frozen=True)
class VideoSparse:
    """Video sparse attention (VSA) for a self-attention layer: static, hashable
    configuration passed at call time (`Attention(...)(x, video_sparse=...)`).

    The layer's tokens are then a video of `grid` patches in the tile layout of
    [`vidax_eqx.kernels.tile_permute`][]`(x, grid, tile)`, and its attention is
    [`vidax_eqx.kernels.video_sparse_attention`][] on one device, or
    [`vidax_eqx.parallel.video_sparse_attention`][] under sequence parallelism.

    **Fields:**

    - `grid`: `(F, H, W)`, the video's patch grid.
    - `tile`: tokens per tile `(tf, th, tw)`, default `(4, 4, 4)` (FastVideo's).
    - `topk`: key tiles each query tile attends, in `[1, n_tiles]`; or
    - `sparsity`: the fraction of key tiles skipped, in `[0, 1)`
        (`topk = ceil((1 - sparsity) * n_tiles)`). Exactly one of the two.

    Bad values raise `ValueError` at construction.
    """

    grid: tuple[int, int, int]
    tile: tuple[int, int, int] = (4, 4, 4)
    topk: int | None = None
    sparsity: float | None = None

    def __post_init__(self):
        layout = VsaLayout(self.grid, self.tile)  # validates grid and tile
        object.__setattr__(self, "grid", layout.grid)
        object.__setattr__(self, "tile", layout.tile)
        resolve_topk(self.topk, self.sparsity, layout.n_tiles, where="VideoSparse")

    @property
    def layout(self) -> VsaLayout:
        """The tile layout (`n_tiles`, `tile_size`, `video_len`: the tokens of the
        layout, padding included)."""
        return VsaLayout(self.grid, self.tile)

    @property
    def selected(self) -> int:
        """Key tiles attended per query tile (`topk`, or the one `sparsity` gives)."""
        return resolve_topk(self.topk, self.sparsity, self.layout.n_tiles, where="VideoSparse")


def check_video_sparse(m, x, video_sparse, gate, segment_ids, mask, kv_length) -> None:
    """The combinations `Attention(video_sparse=...)` refuses."""
    if video_sparse is None:
        if gate is not None:
            raise ValueError(
                "Attention: `gate` is the coarse output's gate of video sparse attention; "
                "pass it with `video_sparse=` (received video_sparse=None)."
            )
        return
    if not isinstance(video_sparse, VideoSparse):
        raise ValueError(
            f"Attention: `video_sparse` must be a vidax_eqx.nn.VideoSparse or None; received "
            f"{type(video_sparse).__name__}."
        )
    for name, value in (("mask", mask), ("segment_ids", segment_ids), ("kv_length", kv_length)):
        if value is not None:
            raise ValueError(
                f"Attention: `video_sparse` takes the video's padding from its tile layout and "
                f"cannot be combined with `{name}`; received {name}={type(value).__name__}."
            )
    if gate is not None and m.to_gate_compress is not None:
        raise ValueError(
            "Attention: the module computes the gate with its `to_gate_compress` projection; "
            "received a `gate` too. Pass one or the other."
        )
    n = video_sparse.layout.video_len
    if not m.parallel.sequence_axes and x.shape[0] != n:
        raise ValueError(
            f"Attention: video_sparse={video_sparse} lays the video out as {n} tokens "
            f"(tile_permute(x, grid, tile)); received x with {x.shape[0]} tokens."
        )
