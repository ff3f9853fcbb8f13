"""`"pallas_tpu"`: JAX's Pallas TPU attention kernels behind the kernels' contract.

- `_implementation.py`: [`PallasTpu`][vidax_eqx.kernels.PallasTpu], the splash and flash
  kernels adapted to the contract;
- `_tuning.py`: [`SplashBlocks`][vidax_eqx.kernels.SplashBlocks] and the splash tiles
  measured per chip;
- `_mask.py`: splash masks built from block kinds (positions, sliding tiles, frame
  blocks) and their kernels;
- `_gather.py`: the tile-gathering kernels of VSA's fine stage (their contract; the plan
  and knobs in `_gather_plan.py`, the layout in `_gather_layout.py`, the Pallas bodies
  and calls in `_gather_kernels.py`); `_sliding.py`: sliding tile attention on them;
  `_per_tile.py`: the per-tile kernels, when the resident arrays do not fit VMEM.

Only `SplashBlocks` is re-exported here. `PallasTpu` reaches private JAX entry points
that a JAX version may lack, so `kernels/_registry.py` imports it from its module under
a guard (without them `"pallas_tpu"` is simply absent); importing this package needs
none of them.
"""

from ._tuning import SplashBlocks as SplashBlocks
