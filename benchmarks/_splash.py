"""JAX's splash attention called directly, as a user of it would: the TPU peer of the
benchmarks (`tpu/tpu_attention.py`, `accelerator_check.py`).

`attend(S, H, causal, block_sizes)` builds splash's own kernel (`make_splash_mha`, its own
custom VJP) for `(B, H, S, D)` arrays; `block_sizes_of` turns the library's
[`SplashBlocks`][vidax_eqx.kernels.SplashBlocks] into splash's `BlockSizes`, so that a
measured configuration runs both ways. Larger tiles need a scoped VMEM limit above the
compiler's default: `compile_with(fn, args, vmem)` traces and compiles inside the
library's `splash_vmem_limit` (the one private hook both sides share, which a direct
user would set with `--xla_tpu_scoped_vmem_limit_kib` instead).
"""

import jax
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from vidax_eqx import kernels
from vidax_eqx._jax_private import splash_vmem_limit


VMEM = 64 * 2**20  # the scoped VMEM limit the larger tiles run with


def block_sizes_of(blocks: kernels.SplashBlocks) -> sk.BlockSizes:
    """Splash's `BlockSizes` of one of the library's configurations."""
    dq = {} if blocks.fused_bwd else dict(block_q_dq=blocks.block_q_dq, block_kv_dq=blocks.block_kv_dq)
    return sk.BlockSizes(
        block_q=blocks.block_q, block_kv=blocks.block_kv, block_kv_compute=blocks.block_kv_compute,
        block_q_dkv=blocks.block_q_dkv, block_kv_dkv=blocks.block_kv_dkv,
        block_kv_dkv_compute=blocks.block_kv_dkv_compute, use_fused_bwd_kernel=blocks.fused_bwd, **dq)


def attend(S: int, H: int, causal: bool, block_sizes=None, *, interpret: bool = False):
    """`f(q, k, v)` on `(B, H, S, D)`: splash's kernel for a full or causal mask, vmapped
    over the batch; `block_sizes` `None`: JAX's defaults (128)."""
    mask = sm.CausalMask((S, S)) if causal else sm.FullMask((S, S))
    kernel = sk.make_splash_mha(sm.MultiHeadMask([mask] * H), block_sizes=block_sizes,
                                head_shards=1, q_seq_shards=1, interpret=interpret)
    return jax.vmap(kernel)


def compile_with(fn, args, vmem: int | None = VMEM):
    """`jax.jit(fn)` compiled for `args` with the splash kernels' VMEM limit at `vmem`."""
    with splash_vmem_limit(vmem):
        return jax.jit(fn).lower(*args).compile()
