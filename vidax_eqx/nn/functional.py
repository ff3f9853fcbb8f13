"""The pure functions behind `vidax_eqx.nn`: normalization, position and timestep embeddings,
patches.

The Equinox modules of `vidax_eqx.nn` and the linen shim `vidax_eqx.flax` hold
parameters and call these; use them directly in code that keeps its own weights.
"""

from ._norm import (
    channel_rms_norm as channel_rms_norm,
    layer_norm as layer_norm,
    modulated_layer_norm as modulated_layer_norm,
    rms_norm as rms_norm,
    tp_sharded_rms_norm as tp_sharded_rms_norm,
)
from ._rope import (
    apply_rope as apply_rope,
    rope_3d as rope_3d,
    sincos_embedding_3d as sincos_embedding_3d,
    wan_rope_split as wan_rope_split,
)
from ._feedforward import timestep_embedding as timestep_embedding
from ._patch import patch_grid as patch_grid, patchify as patchify, unpatchify as unpatchify
