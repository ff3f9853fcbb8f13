"""Equinox modules for video diffusion transformers: norms, attention and feed-forward
layers, and LoRA adapters.

The math lives in [`vidax_eqx.nn.functional`][]; how a layer runs over a mesh and how
its parameters are placed lives in [`vidax_eqx.nn.sharding`][]. The modules hold
parameters (arrays) and static configuration, take one example per call and are batched
with `jax.vmap`.

The placement names that 0.1.0 exported here (`nn.ParallelConfig`, `nn.with_parallel`,
`nn.partition_specs`, ...) live in [`vidax_eqx.nn.sharding`][]; the old spellings still
work until 0.3.0, with a `DeprecationWarning`.
"""

from .._deprecation import moved

from . import functional as functional, sharding as sharding
from ._norm import (
    ChannelRMSNorm as ChannelRMSNorm,
    LayerNorm as LayerNorm,
    ModulatedLayerNorm as ModulatedLayerNorm,
    RMSNorm as RMSNorm,
    TPShardedRMSNorm as TPShardedRMSNorm,
)
from ._self_attention import Attention as Attention
from ._cross_attention import ContextKV as ContextKV, CrossAttention as CrossAttention
from ._joint_attention import JointAttention as JointAttention
from ._dual_stream import DualStreamAttention as DualStreamAttention
from ._video_sparse import VideoSparse as VideoSparse
from ._feedforward import FeedForward as FeedForward, TimestepEmbedding as TimestepEmbedding
from ._patch import PatchEmbedding as PatchEmbedding
from ._conv import CausalConv3d as CausalConv3d, FrameConv2d as FrameConv2d
from ._group_norm import GroupNorm as GroupNorm
from ._quantized import (
    QUANTIZED_ACTIVATIONS as QUANTIZED_ACTIVATIONS,
    product as product,
    QuantizedLinear as QuantizedLinear,
)
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


# 0.1.0 spellings: the placement names moved to `nn.sharding` (removed in 0.3.0).
__getattr__ = moved(__name__, {
    name: f"vidax_eqx.nn.sharding.{name}"
    for name in (
        "FSDPShard", "ParallelConfig", "filter_shard_map", "fsdp_axes_of", "fsdp_gather",
        "gather_tokens", "partition_specs", "replicated_parameters", "shard_like",
        "shard_module", "shard_tokens", "with_parallel",
    )
})
