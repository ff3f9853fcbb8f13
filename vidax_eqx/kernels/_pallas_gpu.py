"""`"pallas_gpu"`: JAX's Pallas GPU (Triton) flash attention behind the common contract.

The forward is `jax.experimental.pallas.ops.gpu.attention.mha` with its
residuals (the log-sum-exp, in base 2); the backward is that module's fused
`mha_backward_kernel`, launched here with the contract's (possibly ring-merged)
`lse` and `delta - dlse` instead of the ones it would recompute, so
`attention_bwd` and ring attention run on it. `_adapt` supplies the rest: GQA by
repeating K/V heads, padding to the tiles (excluded through segment ids),
rows that see nothing, and sinks.

The kernel takes one segment-id array for queries and keys alike, so it serves
segment ids passed as one `(B, S)` array, and a cross-attention (`S_q != S_k`)
only where the keys need no padding; its causal loop assumes `S_q <= S_k`.

Key-only padding (`kv_lengths`) cannot be said with one segment-id array (a query
and the key at its own index always share an id), so it enters as a key bias
through one extra head-dim channel: `q` gets a column of ones, `k` a column that
is 0 for valid keys and `-_KEY_PAD` (about `-4e36 / scale`) for padded ones, `v`
a column of zeros. Every valid logit is unchanged (`1 * 0` adds exactly 0) and a
padded key's probability is exactly 0, forward and backward; a row that sees no
valid key has an lse near `-4e36`, which `_adapt.finish` reads as empty. The cost:
the kernel pads the head dim to a power of two, so `D + 1` doubles the work when
`D` is one (64, 128); `D = 256` is refused (257 > the kernel's 256), and float16
too (the padding logit does not fit it).

`jax.experimental.pallas.ops` is undocumented: `mha`, `mha_backward_kernel` and
`BlockSizes` (and `next_power_of_2`, exported by Pallas but absent from its API
reference) come through `vidax_eqx._jax_private`, where each call we rely on is
recorded and tested; a JAX without one of them leaves `"pallas_gpu"`
unregistered rather than broken.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .._jax_private import GpuBlockSizes, gpu_mha, gpu_mha_backward_kernel, next_power_of_2
from .._vma import opaque_to_vma
from . import _adapt as a
from ._args import Operands, Options, valid_keys
from ._base import AbstractImplementation, Capabilities, Request


F32 = jnp.float32
_MIN_TILE = 16  # Triton's smallest dot tile
_LN2 = math.log(2.0)
# The natural-log logit that key-only padding gives a padded key (before the
# kernel's own masks): far below any real logit, above the kernel's mask value.
_KEY_PAD_LOGIT = 4e36


def _key_pad(opts: Options) -> float:
    """The value of a padded key's extra channel: `-_KEY_PAD_LOGIT / scale`, at most
    1e38 in magnitude (representable in bfloat16 and float32)."""
    return -min(_KEY_PAD_LOGIT / opts.scale, 1e38)


def _with_key_channel(ops: Operands, opts: Options, q, k, v):
    """`(q, k, v)` with the extra head-dim channel of key-only padding (see the module
    docstring), or unchanged without `kv_lengths`. `k`, `v`: `(B, S_k, H, D)`."""
    if ops.kv_lengths is None:
        return q, k, v
    S_k = k.shape[1]
    valid = valid_keys(ops.kv_lengths, S_k)  # (B, S_k)
    column = jnp.where(valid, 0.0, _key_pad(opts)).astype(k.dtype)
    q = jnp.concatenate([q, jnp.ones((*q.shape[:-1], 1), q.dtype)], axis=-1)
    k = jnp.concatenate([k, jnp.broadcast_to(column[:, :, None, None], (*k.shape[:-1], 1))], axis=-1)
    v = jnp.concatenate([v, jnp.zeros((*v.shape[:-1], 1), v.dtype)], axis=-1)
    return q, k, v


def _pow2_divisor(n: int, limit: int) -> int:
    """The largest power of two <= `limit` dividing `n` (at least 1)."""
    t = 1
    while t * 2 <= limit and n % (t * 2) == 0:
        t *= 2
    return t


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2_tile(n: int, block: int) -> tuple[int, int]:
    """`(tile, padded_length)`: Triton tiles are powers of two, >= 16, <= `block`."""
    t = min(block, max(_MIN_TILE, _next_pow2(n)))
    return t, a.round_up(n, t)


@dataclasses.dataclass(frozen=True)
class PallasGpu(AbstractImplementation):
    """JAX's Pallas GPU (Triton) flash attention kernel.

    **Arguments:**

    - `block_q`, `block_k`: forward tile sizes (powers of two >= 16).
    - `block_bwd`: the backward's key tile (its query tile follows from it).
    - `num_warps`, `num_stages`: Triton launch parameters (`None`: the kernel's default).
    - `interpret`: run in Pallas interpret mode (on any platform; slow).
    """

    block_q: int = 128
    block_k: int = 128
    block_bwd: int = 64
    num_warps: int | None = None
    num_stages: int = 2
    interpret: bool = False

    name = "pallas_gpu"
    capabilities = Capabilities(
        platforms=("gpu",),
        max_head_dim=256,
        bias=False,
        mask=False,
        window=False,
        positions=False,
        logits_soft_cap=False,
        kv_lengths=True,
        notes=(
            "segment ids only as one (B, S) array for queries and keys (so not in ring attention)",
            "kv_lengths through an extra head-dim channel (a key bias): D + 1 is padded to a "
            "power of two, so D = 64 / 128 cost twice; not with D = 256 nor float16",
            "S_q != S_k only with S_k a multiple of 16, and causal only with S_q <= S_k",
        ),
    )

    def __post_init__(self):
        for field in ("block_q", "block_k", "block_bwd"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < _MIN_TILE or value & (value - 1):
                raise ValueError(
                    f"PallasGpu `{field}` must be a power of two >= {_MIN_TILE}; received {value!r}."
                )

    def unsupported(self, request: Request) -> list[str]:
        missing = self.capabilities.unsupported(request, any_platform=self.interpret)
        if request.segment_ids and not request.shared_segment_ids:
            missing.append(
                "separate q / kv segment ids (the Triton kernel takes one (B, S) array for both)"
            )
        if request.cross and request.seq_k % _MIN_TILE:
            missing.append(
                f"S_q != S_k with S_k = {request.seq_k} not a multiple of {_MIN_TILE} "
                "(its keys could only be padded through shared segment ids)"
            )
        if request.kv_lengths and request.head_dim + 1 > (self.capabilities.max_head_dim or 0):
            missing.append(
                f"kv_lengths with head_dim {request.head_dim} (served through one extra head-dim "
                f"channel: head_dim + 1 <= {self.capabilities.max_head_dim})"
            )
        if request.kv_lengths and request.dtype == "float16":
            missing.append("kv_lengths in float16 (the padded keys' logit channel does not fit float16)")
        if request.causal and request.seq_q > request.seq_k:
            missing.append(
                "causal with S_q > S_k (the kernel's causal loop assumes no more queries than keys)"
            )
        return missing

    def _layout(self, ops: Operands):
        """`(S_q_pad, S_k_pad, block_q, block_k, segment ids)` of the forward."""
        S_q, S_k = ops.q.shape[1], ops.k.shape[1]
        if S_q == S_k:
            bq, S_p = _pow2_tile(S_q, min(self.block_q, self.block_k))
            return S_p, S_p, bq, bq, a.shared_segment_ids(ops, S_p)
        bq, S_qp = _pow2_tile(S_q, self.block_q)
        return S_qp, S_k, bq, _pow2_divisor(S_k, self.block_k), None

    def fwd(self, ops: Operands, opts: Options) -> tuple[jax.Array, jax.Array]:
        B, S_q, H, D = ops.q.shape
        S_qp, S_kp, bq, bk, seg = self._layout(ops)
        q, k, v = _with_key_channel(ops, opts, ops.q, a.repeat_kv(ops.k, H), a.repeat_kv(ops.v, H))
        q = a.pad_axis(q, 1, S_qp)
        k = a.pad_axis(k, 1, S_kp)
        v = a.pad_axis(v, 1, S_kp)
        mha = functools.partial(
            gpu_mha,
            sm_scale=opts.scale,
            causal=opts.causal,
            block_sizes=GpuBlockSizes(block_q=bq, block_k=bk),
            num_warps=self.num_warps,
            num_stages=self.num_stages,
            interpret=self.interpret,
            return_residuals=True,
        )
        out, lse2 = opaque_to_vma(mha, q, k, v, seg)
        empty_below = a.MASKED_LSE if ops.kv_lengths is None else 0.5 * _key_pad(opts) * opts.scale
        return a.finish(ops, out[:, :S_q, :, :D], lse2[:, :, :S_q] * _LN2, empty_below)

    def bwd(self, ops, opts, out, lse, dout, dlse):
        B, S_q, H, D = ops.q.shape
        S_k, K = ops.k.shape[1], ops.k.shape[2]
        kernel_lse, delta, dsinks = a.backward_stats(ops, out, lse, dout, dlse)
        # The fused kernel's grid serves a dK/dV tile and a dQ tile per program:
        # queries and keys must split into the same number of tiles.
        if S_q == S_k:
            bk, S_kp = _pow2_tile(S_k, self.block_bwd)
            bq, S_qp = bk, S_kp
            seg = a.shared_segment_ids(ops, S_kp)
        else:
            bk, S_kp = _pow2_divisor(S_k, self.block_bwd), S_k
            n = S_k // bk
            bq = max(_MIN_TILE, _next_pow2(-(-S_q // n)))
            S_qp, seg = n * bq, None
        q, k, v = _with_key_channel(ops, opts, ops.q, a.repeat_kv(ops.k, H), a.repeat_kv(ops.v, H))
        do = dout.astype(ops.q.dtype)
        if ops.kv_lengths is not None:
            do = jnp.concatenate([do, jnp.zeros((*do.shape[:-1], 1), do.dtype)], axis=-1)
        q = a.pad_axis(q, 1, S_qp)
        k = a.pad_axis(k, 1, S_kp)
        v = a.pad_axis(v, 1, S_kp)
        do = a.pad_axis(do, 1, S_qp)
        lse2 = a.pad_axis(kernel_lse / _LN2, 2, S_qp, jnp.inf)
        delta = a.pad_axis(delta, 2, S_qp)
        call = functools.partial(self._backward_call, opts=opts, bq=bq, bk=bk)
        dq, dk, dv = opaque_to_vma(call, q, k, v, seg, do, lse2, delta)
        dk = a.reduce_kv(dk[:, :S_k, :, :D], K)
        dv = a.reduce_kv(dv[:, :S_k, :, :D], K)
        return (
            dq[:, :S_q, :, :D].astype(ops.q.dtype),
            dk.astype(ops.k.dtype),
            dv.astype(ops.v.dtype),
            None,
            dsinks,
        )

    def _backward_call(self, q, k, v, seg, do, lse2, delta, opts: Options, bq: int, bk: int):
        """`mha_backward_kernel` over the grid `(B, H, S_k / bk)`, as `_mha_backward`
        launches it, with our `lse2` (base 2) and `delta`."""
        B, S_q, H, D = q.shape
        S_k = k.shape[1]
        Dp = next_power_of_2(D)
        whole_q = pl.BlockSpec((None, S_q, None, Dp), lambda b, h, _: (b, 0, h, 0))
        whole_k = pl.BlockSpec((None, S_k, None, Dp), lambda b, h, _: (b, 0, h, 0))
        rows = pl.BlockSpec((None, None, S_q), lambda b, h, _: (b, h, 0))
        seg_spec = None if seg is None else pl.BlockSpec((None, S_k), lambda b, h, _: (b, 0))
        kernel = functools.partial(
            gpu_mha_backward_kernel,
            sm_scale=opts.scale,
            causal=opts.causal,
            block_q_dkv=bq,
            block_kv_dkv=bk,
            block_q_dq=bq,
            block_kv_dq=bk,
            head_dim=D,
        )
        num_warps = self.num_warps if self.num_warps is not None else (4 if bq * bk < 128 * 128 else 8)
        return pl.pallas_call(
            kernel,
            grid=(B, H, S_k // bk),
            in_specs=[whole_q, whole_k, whole_k, seg_spec, whole_q, whole_q, rows, rows],
            out_specs=[
                pl.BlockSpec((None, bq, None, Dp), lambda b, h, i: (b, i, h, 0)),
                pl.BlockSpec((None, bk, None, Dp), lambda b, h, i: (b, i, h, 0)),
                pl.BlockSpec((None, bk, None, Dp), lambda b, h, i: (b, i, h, 0)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct(q.shape, F32),
                jax.ShapeDtypeStruct(k.shape, F32),
                jax.ShapeDtypeStruct(v.shape, F32),
            ],
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=self.num_stages),
            interpret=self.interpret,
            name="vidax_mha_backward",
        )(q, k, v, seg, do, do, lse2, delta)
