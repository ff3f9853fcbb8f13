"""The documented API of the original `vidax.core`, with its import paths.

`from vidax_eqx.core import ...` and `from vidax_eqx.core.attention import ...` give the
seven names of the `vidax.core` attention and norms page, layout `(B, S, H, D)`. The
math lives in `vidax_eqx.kernels` and `vidax_eqx.parallel`; `dot_product_attention` and
`local_attention` map the documented argument names and defaults onto them;
`sequence_parallel_self_attention`, `sequence_parallel_joint_self_attention` and
`chunk_by_rank` are the `vidax_eqx.parallel` functions themselves. `RMSNorm` and
`TPShardedRMSNorm` are the Equinox modules of `vidax_eqx.nn`: the linen classes of the
page (with `.init` / `.apply`) are `vidax_eqx.flax.RMSNorm` and
`vidax_eqx.flax.TPShardedRMSNorm`, and calling a linen method on the Equinox ones says
so. The page's `build_tpu_mesh` and `shard_wan_params` are here too.
"""

from . import attention as attention
from ._placement import build_tpu_mesh as build_tpu_mesh, shard_wan_params as shard_wan_params
from .attention import (
    chunk_by_rank as chunk_by_rank,
    dot_product_attention as dot_product_attention,
    local_attention as local_attention,
    RMSNorm as RMSNorm,
    sequence_parallel_joint_self_attention as sequence_parallel_joint_self_attention,
    sequence_parallel_self_attention as sequence_parallel_self_attention,
    TPShardedRMSNorm as TPShardedRMSNorm,
)
