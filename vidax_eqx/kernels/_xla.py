"""`"xla"`: the materializing reference implementation.

Computes the whole `(B, H, S_q, S_k)` score matrix with a float32 softmax.
Memory is O(S_q * S_k); for short sequences it is also the fastest choice on
CPU, which is why `"auto"` picks it there.
"""

import dataclasses

import jax
import jax.numpy as jnp

from . import _math as m
from ._args import Operands, Options
from ._base import AbstractImplementation, Capabilities


def _positions(ops: Operands) -> tuple[jax.Array, jax.Array]:
    if ops.q_pos is not None:
        return ops.q_pos, ops.kv_pos
    return (
        jnp.arange(ops.q.shape[1], dtype=jnp.int32),
        jnp.arange(ops.k.shape[1], dtype=jnp.int32),
    )


def _visibility(ops: Operands, opts: Options, kv_heads: int) -> jax.Array | None:
    q_pos, kv_pos = _positions(ops)
    return m.visibility(
        opts, q_pos, kv_pos, ops.seg_q, ops.seg_kv, m.group_4d(ops.mask, kv_heads)
    )


@dataclasses.dataclass(frozen=True)
class Xla(AbstractImplementation):
    """The exact, materializing reference (einsum and a float32 softmax)."""

    name = "xla"
    capabilities = Capabilities(platforms=("cpu", "gpu", "tpu"), memory="O(S^2)")

    def fwd(self, ops: Operands, opts: Options) -> tuple[jax.Array, jax.Array]:
        K = ops.k.shape[2]
        q, k, v = m.group_q(ops.q, K), m.group_kv(ops.k), m.group_kv(ops.v)
        s, _ = m.logits(opts, q, k, m.group_4d(ops.bias, K))
        stats = m.init_stats(q.shape[:-1], q.shape[-1], m.grouped_sinks(ops))
        stats = m.softmax_step(stats, s, _visibility(ops, opts, K), v)
        out, lse = m.finalize(stats, ops.q.dtype)
        return m.ungroup_q(out), m.ungroup_rows(lse)

    def bwd(self, ops, opts, out, lse, dout, dlse):
        K = ops.k.shape[2]
        q, k, v = m.group_q(ops.q, K), m.group_kv(ops.k), m.group_kv(ops.v)
        delta = m.delta(out, dout, dlse)
        bias = m.group_4d(ops.bias, K)
        dq, dk, dv, dbias = m.tile_grads(
            opts,
            q,
            k,
            v,
            m.group_q(dout.astype(ops.q.dtype), K),
            m.group_rows(m.safe_lse(lse), K),
            m.group_rows(delta, K),
            bias,
            _visibility(ops, opts, K),
        )
        dsinks = None if ops.sinks is None else m.sinks_grad(ops.sinks, lse, delta)
        return (
            m.ungroup_q(dq).astype(ops.q.dtype),
            m.ungroup_kv(dk).astype(ops.k.dtype),
            m.ungroup_kv(dv).astype(ops.v.dtype),
            None if dbias is None else m.ungroup_4d(dbias).astype(ops.bias.dtype),
            dsinks,
        )
