"""`"cudnn"`: cuDNN's fused flash attention through `jax.nn.dot_product_attention`.

cuDNN is one fused call with its own VJP. It returns no float32 log-sum-exp
(`jax.nn` hands back its residual in the input dtype and without a gradient),
and its backward cannot start from an external `(out, lse, dlse)`, so its
`capabilities.float32_lse` is False: [`attention`][] may use it, while
`attention_fwd`, `attention_bwd` and ring attention never do.
"""

import dataclasses
import functools

import jax

from ._args import Operands, Options
from ._base import AbstractImplementation, Capabilities, Request


@functools.cache
def _gpu_host() -> bool:
    """Whether this process has a GPU backend: `jax.nn`'s cuDNN path reads the cuDNN
    version and the GPU's compute capability when it is traced, so it can be traced
    (and lowered for GPU) only on a GPU host."""
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@dataclasses.dataclass(frozen=True)
class Cudnn(AbstractImplementation):
    """cuDNN flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`).

    Serves GQA, bias, boolean masks, causal masks and key-only padding
    (`kv_lengths`, as `key_value_seq_lengths`: every query row is computed) in
    bfloat16 / float16 with `head_dim <= 128`; differentiated by `jax.nn`'s own VJP.
    """

    name = "cudnn"
    capabilities = Capabilities(
        platforms=("gpu",),
        dtypes=("bfloat16", "float16"),
        max_head_dim=128,
        segment_ids=False,
        window=False,
        positions=False,
        sinks=False,
        logits_soft_cap=False,
        kv_lengths=True,
        float32_lse=False,
        notes=(
            "no float32 lse: `attention` only; `attention_fwd`, `attention_bwd` and ring "
            "attention take another implementation",
        ),
    )

    def unsupported(self, request: Request) -> list[str]:
        missing = self.capabilities.unsupported(request)
        if request.platform == "gpu" and not _gpu_host():
            missing.append(
                "lowering for GPU from a host without one (jax.nn's cuDNN path reads the "
                "cuDNN version and compute capability when traced)"
            )
        return missing

    def fwd(self, ops: Operands, opts: Options) -> tuple[jax.Array, None]:
        """`(out, None)`: `out` is differentiable through `jax.nn`'s VJP; no lse."""
        out = jax.nn.dot_product_attention(
            ops.q,
            ops.k,
            ops.v,
            bias=None if ops.bias is None else ops.bias.astype(ops.q.dtype),
            mask=ops.mask,
            scale=opts.scale,
            is_causal=opts.causal,
            key_value_seq_lengths=ops.kv_lengths,  # query_seq_lengths: None, all rows computed
            implementation="cudnn",
        )
        return out, None

    def bwd(self, ops, opts, out, lse, dout, dlse):
        raise NotImplementedError(
            "implementation 'cudnn' has no backward from an external (out, lse): it is "
            "differentiated through jax.nn.dot_product_attention's own VJP."
        )
