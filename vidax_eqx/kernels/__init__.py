"""Single-device attention: one interface, several implementations.

`attention`, `attention_fwd` and `attention_bwd` take the same arguments and
dispatch to a registered implementation, chosen by `implementation=` or
automatically per platform and problem size: `"xla"` (the materializing
reference), `"blockwise"` (portable flash attention in pure JAX), `"pallas_tpu"`
(Pallas TPU splash / flash kernels), `"pallas_gpu"` (Pallas Triton flash kernel)
and `"cudnn"` (cuDNN through `jax.nn`). The Pallas kernels run on any platform
in interpret mode (`PallasTpu(interpret=True)`, `PallasGpu(interpret=True)`).
`SlidingTileMask` (with `tile_permute` / `tile_unpermute` / `tile_positions`) is
sliding tile attention: a 3D window mask over a video's tile layout, passed as
`mask=`, whose hidden tiles the kernels skip; `BlockCausalMask` is frame-block
causal attention (autoregressive video), passed the same way. `video_sparse_attention` is video sparse
attention (VSA): a coarse tile-level attention selects, per query tile, the key
tiles a block-sparse fine attention computes. `gpu_target` names the GPU a program is
lowered for from a host without one.
"""

from ._api import (
    attention as attention,
    attention_bwd as attention_bwd,
    attention_fwd as attention_fwd,
    implementation_report as implementation_report,
    select_implementation as select_implementation,
    splash_blocks as splash_blocks,
)
from ._args import QUANTIZE as QUANTIZE, SegmentIds as SegmentIds
from ._base import (
    AbstractImplementation as AbstractImplementation,
    Capabilities as Capabilities,
    Request as Request,
)
from ._block_causal import BlockCausalMask as BlockCausalMask
from ._blockwise import Blockwise as Blockwise
from ._cudnn import Cudnn as Cudnn
from ._dispatch import gpu_target as gpu_target
from ._registry import (
    AUTO_XLA_MAX_SCORE_BYTES as AUTO_XLA_MAX_SCORE_BYTES,
    implementations as implementations,
    register as register,
)
from ._registry import PallasGpu as PallasGpu, PallasTpu as PallasTpu
from .pallas_tpu import SplashBlocks as SplashBlocks
from ._table import feature_table as feature_table
from ._tile import (
    SlidingTileMask as SlidingTileMask,
    tile_permute as tile_permute,
    tile_positions as tile_positions,
    tile_unpermute as tile_unpermute,
)
from ._vsa import video_sparse_attention as video_sparse_attention
from ._xla import Xla as Xla
