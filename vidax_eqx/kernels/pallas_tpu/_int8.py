"""The int8 attention kernel of `"pallas_tpu"` (`attention(..., quantize=...)`).

One flash-attention forward over a grid `(B, H, query blocks, key blocks)`, the key
blocks innermost, on the operands `_int8.quantize_operands` made (the scheme and its
XLA reference: `kernels/_int8.py`): Q.Kᵀ as an int8 x int8 -> int32 product scaled by
the tokens' scales; each row's probabilities scaled by its largest logit in the key
block (`p = exp(s - m_b)`, in `[0, 1]`); P.V as the int8 `round(255 p) - 128` times
int8 V (plus `128 * sum(v)` of the block, precomputed) in `"int8"`, or `p` in V's dtype
times V in `"int8-qk"`; blocks combined in float32 by `exp(m_b - m)`. The keys past
the sequence's end (padding to whole blocks) are hidden by comparing their index in the
last block.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import _int8
from .. import _math as m
from .._args import Operands, Options


F32 = jnp.float32
_LANES = 128
_TRANS_B = (((1,), (1,)), ((), ()))
_PLAIN = (((1,), (0,)), ((), ()))


def _kernel(q_ref, qs_ref, k_ref, ks_ref, v_ref, *rest, mode, block_kv, kv_len, with_lse):
    vsum_ref = rest[0] if mode == "int8" else None
    rest = rest[1:] if mode == "int8" else rest
    (o_ref, lse_ref, m_scr, l_scr, acc_scr) = rest if with_lse else (rest[0], None, *rest[1:])
    j = pl.program_id(3)

    @pl.when(j == 0)
    def _start():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, F32)
        l_scr[...] = jnp.zeros(l_scr.shape, F32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, F32)

    s = lax.dot_general(q_ref[...], k_ref[...], _TRANS_B, preferred_element_type=jnp.int32)
    s = s.astype(F32) * ks_ref[...] * qs_ref[...]  # (bq, bk) * (1, bk) * (bq, 1)
    if kv_len % block_kv:  # padding keys in the last block
        column = j * block_kv + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(column < kv_len, s, -jnp.inf)
    m_b = jnp.max(s, axis=1, keepdims=True)  # (bq, 1): every block has a real key
    p = jnp.exp(s - m_b)
    if mode == "int8":
        t = jnp.floor(p * 255.0 + 0.5) - 128.0  # int8 range; a hidden key: -128 (255 p = 0)
        l_b = jnp.sum(t, axis=1, keepdims=True) + 128.0 * block_kv
        pv = lax.dot_general(t.astype(jnp.int8), v_ref[...], _PLAIN, preferred_element_type=jnp.int32)
        pv = pv.astype(F32) + 128.0 * vsum_ref[...]
    else:
        l_b = jnp.sum(p, axis=1, keepdims=True)
        pv = lax.dot_general(p.astype(v_ref.dtype), v_ref[...], _PLAIN, preferred_element_type=F32)
    m_prev = m_scr[...]  # (bq, 128), every lane the same
    m_new = jnp.maximum(m_prev, m_b)
    alpha = jnp.exp(m_prev - m_new)
    beta = jnp.exp(m_b - m_new)
    l_scr[...] = alpha * l_scr[...] + beta * l_b
    m_scr[...] = m_new
    D = acc_scr.shape[-1]
    widen = (lambda x: x) if D == _LANES else (lambda x: pltpu.repeat(x, D // _LANES, 1))
    acc_scr[...] = widen(alpha) * acc_scr[...] + widen(beta) * pv

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        l = l_scr[...]
        o_ref[...] = (acc_scr[...] / widen(l)).astype(o_ref.dtype)
        if with_lse:
            scale = 255.0 if mode == "int8" else 1.0
            lse_ref[...] = m_scr[...] + jnp.log(l / scale)


def _pad(x, axis, length):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, pad)


def int8_attention(ops: Operands, opts: Options, *, block_q: int, block_kv: int,
                   with_lse: bool, interpret: bool):
    """`(out, lse)` (`lse` `None` without `with_lse`) of the int8 scheme `opts.quantize`
    on a full-attention request (no mask, segment ids, positions, bias, sinks or soft
    cap), by the kernel above."""
    mode = opts.quantize
    B, S_q, H, D = ops.q.shape
    S_k, K = ops.k.shape[1], ops.k.shape[2]
    G = H // K
    x = _int8.quantize_operands(ops, opts.scale, mode)
    block_q = min(block_q, -(-S_q // 8) * 8)
    block_kv = min(block_kv, -(-S_k // _LANES) * _LANES)
    n_q, n_kv = -(-S_q // block_q), -(-S_k // block_kv)
    D_pad = -(-D // _LANES) * _LANES
    heads = lambda a, length: _pad(_pad(jnp.swapaxes(a, 1, 2), 2, length), 3, D_pad)  # noqa: E731
    q8 = heads(x.q, n_q * block_q)  # (B, H, S, D_pad)
    qs = _pad(jnp.swapaxes(x.q_scale, 1, 2), 2, n_q * block_q)[..., None]  # (B, H, S, 1)
    k8 = heads(x.k, n_kv * block_kv)
    ks = _pad(jnp.swapaxes(x.k_scale, 1, 2), 2, n_kv * block_kv)[:, :, None, :]  # (B, K, 1, S)
    v = heads(x.v, n_kv * block_kv)
    inputs = [q8, qs, k8, ks, v]
    q_block = lambda b, h, i, j: (b, h, i, 0)  # noqa: E731
    kv_block = lambda b, h, i, j: (b, lax.div(h, G), j, 0)  # noqa: E731
    in_specs = [
        pl.BlockSpec((None, None, block_q, D_pad), q_block),
        pl.BlockSpec((None, None, block_q, 1), q_block),
        pl.BlockSpec((None, None, block_kv, D_pad), kv_block),
        pl.BlockSpec((None, None, 1, block_kv), lambda b, h, i, j: (b, lax.div(h, G), 0, j)),
        pl.BlockSpec((None, None, block_kv, D_pad), kv_block),
    ]
    if mode == "int8":  # each key block's sum of int8 V, for the 128 the kernel's P omits
        vsum = v.astype(jnp.int32).reshape(B, K, n_kv, block_kv, D_pad).sum(3).astype(F32)
        inputs.append(vsum[:, :, :, None, :])  # (B, K, n_kv, 1, D_pad)
        in_specs.append(pl.BlockSpec((None, None, None, 1, D_pad), lambda b, h, i, j: (b, lax.div(h, G), j, 0, 0)))
    out_shape = [jax.ShapeDtypeStruct((B, H, n_q * block_q, D_pad), F32)]
    out_specs = [pl.BlockSpec((None, None, block_q, D_pad), q_block)]
    if with_lse:
        out_shape.append(jax.ShapeDtypeStruct((B, H, n_q * block_q, _LANES), F32))
        out_specs.append(pl.BlockSpec((None, None, block_q, _LANES), q_block))
    kernel = functools.partial(_kernel, mode=mode, block_kv=block_kv, kv_len=S_k, with_lse=with_lse)
    results = pl.pallas_call(
        kernel,
        grid=(B, H, n_q, n_kv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((block_q, _LANES), F32), pltpu.VMEM((block_q, _LANES), F32),
                        pltpu.VMEM((block_q, D_pad), F32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name=f"vidax_{mode.replace('-', '_')}_attention",
    )(*inputs)
    out = jnp.swapaxes(results[0][:, :, :S_q, :D], 1, 2)  # (B, S_q, H, D)
    if mode == "int8":
        out = out * _int8.per_head(x.v_scale, H) + _int8.per_head(x.v_mean, H)
    out = out.astype(ops.q.dtype)
    if not with_lse:
        return out, None
    lse = results[1][:, :, :S_q, 0] + jnp.swapaxes(x.shift, 1, 2)
    return out, lse.astype(m.stat_dtype(ops.q.dtype))
