"""The static option that runs a self-attention as video sparse attention (VSA)."""

import dataclasses

from ..kernels._vsa import resolve_topk, VsaLayout


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
