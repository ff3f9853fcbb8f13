"""Sequence and tensor parallelism over a device mesh, built on `vidax_eqx.kernels`.

Every function here runs inside `jax.shard_map` and takes the mesh axis name
as an argument; a missing axis raises a `ValueError` naming it.
"""

from ..kernels import SegmentIds as SegmentIds  # (the ring's segment ids, as the splash ring API had them)
from ._mesh import (
    axis_size as axis_size,
    chunk_by_rank as chunk_by_rank,
    DP_AXIS as DP_AXIS,
    gather_chunks as gather_chunks,
    make_mesh as make_mesh,
    pad_to_multiple as pad_to_multiple,
    padding_segment_ids as padding_segment_ids,
    SP_AXIS as SP_AXIS,
    TP_AXIS as TP_AXIS,
    unpad as unpad,
)
from ._halo import halo_exchange as halo_exchange, SpatialSplit as SpatialSplit
from ._megatron import tensor_parallel_attention as tensor_parallel_attention
from ._fronts import (
    ring_attention as ring_attention,
    sequence_parallel_joint_self_attention as sequence_parallel_joint_self_attention,
    sequence_parallel_self_attention as sequence_parallel_self_attention,
    usp_attention as usp_attention,
)
from ._ulysses import kv_head_repeats as kv_head_repeats
from ._layout import (
    LAYOUTS as LAYOUTS,
    ring_positions as ring_positions,
    zigzag_permute as zigzag_permute,
    zigzag_unpermute as zigzag_unpermute,
)
from ._replicate import replicated as replicated
from ._schedule import ring_work as ring_work
from ._sequence import sequence_attention as sequence_attention
from ._masks import (
    AbstractMask as AbstractMask,
    CausalMask as CausalMask,
    DenseMask as DenseMask,
    FullMask as FullMask,
    LocalMask as LocalMask,
    LogicalAnd as LogicalAnd,
    LogicalOr as LogicalOr,
)
from ._ring_kernel import (
    make_ring_attention as make_ring_attention,
    RingAttentionKernel as RingAttentionKernel,
)
from ._vsa import (
    video_sparse_attention as video_sparse_attention,
    vsa_pad as vsa_pad,
    vsa_padded_length as vsa_padded_length,
    vsa_unpad as vsa_unpad,
)
