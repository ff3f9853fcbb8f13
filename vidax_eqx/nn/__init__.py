"""Equinox modules for video diffusion transformers: norms, attention and feed-forward layers.

The math lives in [`vidax_eqx.nn.functional`][]; the modules hold parameters
(arrays) and static configuration, take one example per call and are batched
with `jax.vmap`.
"""

from . import functional as functional
from ._norm import (
    LayerNorm as LayerNorm,
    ModulatedLayerNorm as ModulatedLayerNorm,
    RMSNorm as RMSNorm,
    TPShardedRMSNorm as TPShardedRMSNorm,
)
from ._attention import (
    Attention as Attention,
    CrossAttention as CrossAttention,
    JointAttention as JointAttention,
)
from ._dual_stream import DualStreamAttention as DualStreamAttention
from ._video_sparse import VideoSparse as VideoSparse
from ._feedforward import FeedForward as FeedForward, TimestepEmbedding as TimestepEmbedding
from ._patch import PatchEmbedding as PatchEmbedding
from ._lora import (
    LoRA as LoRA,
    LoRALinear as LoRALinear,
    lora_filter as lora_filter,
    lora_names as lora_names,
    merge_lora as merge_lora,
    remove_lora as remove_lora,
    set_lora_scale as set_lora_scale,
    unmerge_lora as unmerge_lora,
    with_lora as with_lora,
)
from ._fsdp import fsdp_gather as fsdp_gather, FSDPShard as FSDPShard
from ._placement import (
    partition_specs as partition_specs,
    replicated_parameters as replicated_parameters,
    shard_like as shard_like,
    shard_module as shard_module,
    with_parallel as with_parallel,
)
from ._parallel import (
    filter_shard_map as filter_shard_map,
    fsdp_axes_of as fsdp_axes_of,
    gather_tokens as gather_tokens,
    ParallelConfig as ParallelConfig,
    shard_tokens as shard_tokens,
)
