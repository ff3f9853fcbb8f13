"""Equinox modules for video diffusion transformers: norms, RoPE and attention layers.

The math lives in [`vidax_eqx.nn.functional`][]; the modules hold parameters
(arrays) and static configuration, take one example per call and are batched
with `jax.vmap`.
"""

from . import functional as functional
from ._norm import (
    LayerNorm as LayerNorm,
    RMSNorm as RMSNorm,
    TPShardedRMSNorm as TPShardedRMSNorm,
)
from ._attention import (
    Attention as Attention,
    CrossAttention as CrossAttention,
    JointAttention as JointAttention,
    partition_specs as partition_specs,
    with_parallel as with_parallel,
)
from ._parallel import (
    filter_shard_map as filter_shard_map,
    ParallelConfig as ParallelConfig,
    shard_tokens as shard_tokens,
)
