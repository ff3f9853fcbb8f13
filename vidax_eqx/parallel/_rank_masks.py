"""Per-rank sliding tile masks: the windows of the heads each device holds.

With per-head windows, a device's heads (and so its windows) depend on its rank
along the axis that splits the heads (Ulysses, or Megatron's TP). `RankMasks`
holds one `kernels.SlidingTileMask` per rank and `with_rank_mask` picks this
device's inside a kernel call.
"""

import dataclasses
import functools
from collections.abc import Hashable

from jax import lax

from .. import kernels


# -- sliding tile masks whose windows depend on a device's heads --------------------


@dataclasses.dataclass(frozen=True)
class RankMasks:
    """One `kernels.SlidingTileMask` per rank of `axis_name`: the windows of the heads
    each device holds there (USP with per-head windows: the heads follow the Ulysses
    rank). Every kernel call picks its rank's mask with a `lax.switch` around the
    call alone (no collective inside it)."""

    masks: tuple
    axis_name: Hashable

    @classmethod
    def of(cls, tile_mask, heads_local: int, axis_name: Hashable, size: int):
        """The per-rank masks of `tile_mask` when rank `u` holds query heads
        `[u * heads_local, (u + 1) * heads_local)`; the mask itself when every rank
        gets the same windows."""
        masks = tuple(tile_mask.select_heads(u * heads_local, heads_local) for u in range(size))
        return masks[0] if len(set(masks)) == 1 else cls(masks, axis_name)


def tile_masks(tile_mask) -> tuple:
    return tile_mask.masks if isinstance(tile_mask, RankMasks) else (tile_mask,)


def with_rank_mask(fn, *args, mask=None, **kwargs):
    """`fn(*args, mask=mask, **kwargs)`, selecting this device's mask of `RankMasks`."""
    if not isinstance(mask, RankMasks):
        return fn(*args, mask=mask, **kwargs)
    branches = [functools.partial(fn, mask=m, **kwargs) for m in mask.masks]
    return lax.switch(lax.axis_index(mask.axis_name), branches, *args)


def attention_fwd(*args, **kwargs):
    """`kernels.attention_fwd`, with `mask=` possibly `RankMasks`."""
    return with_rank_mask(kernels.attention_fwd, *args, **kwargs)


def attention_bwd(*args, **kwargs):
    """`kernels.attention_bwd`, with `mask=` possibly `RankMasks`."""
    return with_rank_mask(kernels.attention_bwd, *args, **kwargs)
