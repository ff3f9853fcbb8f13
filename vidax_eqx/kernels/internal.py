"""The internals of [`vidax_eqx.kernels`][] that the floors above it (`parallel`, `nn`)
build with: the one documented door into the kernels' private modules, as
`equinox.internal` is Equinox's. Not part of the public API.

- `check_request`: what `kernels.attention` would raise for a request, checked once
    before a sharded function splits it (errors name the caller's shapes).
- `check_window`: the validation of a `window=(left, right)` argument.
- `chunk_table`: a structured mask's (a sliding tile mask's, a frame-block causal
    mask's) visibility of key chunks by query chunk (the ring's schedule skips hidden
    steps with it).
- `STRUCTURED_MASKS`: the structured kernel masks, passed as `mask=` and evaluated on
    positions (`SlidingTileMask`, `BlockCausalMask`).
- `is_empty_lse`, `masked`: the float32 softmax helpers (a row with nothing to attend
    to; probabilities of hidden keys set to 0).
- Video sparse attention's stages, for `parallel` to put collectives between them:
    `VsaLayout`, `resolve_topk`, `tile_means`, `coarse_attention`, `select_tiles`,
    `sparse_fwd`, `sparse_bwd`, `combine`.
"""

from ._api import check_request as check_request
from ._args import check_window as check_window
from ._math import is_empty_lse as is_empty_lse, masked as masked
from ._block_causal import BlockCausalMask
from ._tile import SlidingTileMask
from ._tile_tables import chunk_table as _tile_chunk_table
from ._vsa import (
    coarse_attention as coarse_attention,
    combine as combine,
    resolve_topk as resolve_topk,
    select_tiles as select_tiles,
    sparse_bwd as sparse_bwd,
    sparse_fwd as sparse_fwd,
    tile_means as tile_means,
    VsaLayout as VsaLayout,
)


STRUCTURED_MASKS = (SlidingTileMask, BlockCausalMask)


def chunk_table(mask, q_starts, q_size: int, kv_starts, kv_size: int):
    """Which chunks of positions may see which under a structured mask: bool
    `(len(q_starts), len(kv_starts))` (`_tile_tables.chunk_table`,
    `BlockCausalMask.chunk_table`)."""
    if isinstance(mask, BlockCausalMask):
        return mask.chunk_table(q_starts, q_size, kv_starts, kv_size)
    return _tile_chunk_table(mask, q_starts, q_size, kv_starts, kv_size)
