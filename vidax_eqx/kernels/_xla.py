"""`"xla"`: the materializing reference implementation.

Computes the whole `(B, H, S_q, S_k)` score matrix with a float32 softmax, as
one tile of the shared math in `_math`. Memory is O(S_q * S_k); for short
sequences it is also the fastest choice on CPU, which is why `"auto"` picks it
there.
"""

import dataclasses

import jax
import jax.numpy as jnp

from . import _int8
from . import _math as m
from . import _sparse
from ._block_causal import lower
from ._args import Operands, Options
from ._base import AbstractImplementation, Capabilities, Request


@dataclasses.dataclass(frozen=True)
class Xla(AbstractImplementation):
    """The exact, materializing reference (einsum and a float32 softmax)."""

    name = "xla"
    capabilities = Capabilities(
        platforms=("cpu", "gpu", "tpu"),
        dtypes=("float32", "bfloat16", "float16", "float64"),
        portable=True,
        tile_mask=True,
        block_causal=True,
        kv_lengths=True,
        video_sparse=True,
        quantize=("int8-qk", "int8"),
        memory="O(S^2)",
        notes=("int8: the scheme's reference; no bias, sinks or soft cap",),
    )

    def unsupported(self, request: Request) -> list[str]:
        missing = self.capabilities.unsupported(request)
        if request.quantize is not None:
            missing += [f"quantize={request.quantize!r} with {what}" for what, asked in (
                ("a bias", request.bias), ("sinks", request.sinks),
                ("a logit soft cap", request.logits_soft_cap)) if asked]
        return missing

    def sparse_fwd(self, q, k, v, tiles, kv_valid, *, tile_size: int, scale: float):
        """VSA's fine stage with its mask materialized (`_sparse.dense_fwd`)."""
        return _sparse.dense_fwd(q, k, v, tiles, kv_valid, tile_size=tile_size, scale=scale)

    def sparse_bwd(self, q, k, v, tiles, kv_valid, out, lse, dout, dlse, *, tile_size: int, scale: float):
        """The gradients of `sparse_fwd` (`_sparse.dense_bwd`)."""
        return _sparse.dense_bwd(q, k, v, tiles, kv_valid, out, lse, dout, dlse, tile_size=tile_size, scale=scale)

    @staticmethod
    def _tile(ops: Operands, opts: Options):
        """The whole problem as one tile: `(q, kt, v, bias, vis)` in the rows layout."""
        B, S_q, H, _ = ops.q.shape
        S_k, K = ops.k.shape[1], ops.k.shape[2]
        if ops.q_pos is None:
            q_pos, kv_pos = jnp.arange(S_q, dtype=jnp.int32), jnp.arange(S_k, dtype=jnp.int32)
        else:
            q_pos, kv_pos = ops.q_pos, ops.kv_pos
        vis = m.visibility(
            opts,
            m.repeat_rows(q_pos, H // K),
            kv_pos,
            m.repeat_rows(ops.seg_q, H // K),
            ops.seg_kv,
            m.rows_4d(ops.mask, K, H, S_q),
            kv_heads=K,
            heads=H,
            kv_lengths=ops.kv_lengths,
            kv_index=jnp.arange(S_k, dtype=jnp.int32),
        )
        q = m.split_q(ops.q, K, S_q)[0]
        return q, m.split_kv(ops.k, S_k)[0], m.rows_4d(ops.bias, K, H, S_q), vis

    def fwd(self, ops: Operands, opts: Options) -> tuple[jax.Array, jax.Array]:
        ops, opts = lower(ops, opts)
        H, K = ops.q.shape[2], ops.k.shape[2]
        q, k, bias, vis = self._tile(ops, opts)
        if opts.quantize is not None:
            return _int8.reference(ops, opts, opts.quantize, vis)
        qs, rest = m.fold_scale(opts, q)
        s, _ = m.logits(opts, qs, jnp.swapaxes(k, -1, -2), bias, rest)
        sinks = m.rows_sinks(ops.sinks, K, ops.q.shape[1])
        stats = m.init_stats(q.shape[:-1], q.shape[-1], sinks, m.stat_dtype(ops.q.dtype))
        stats = m.softmax_step(stats, s, vis, m.split_kv(ops.v, ops.k.shape[1])[0])
        out, lse = m.finalize(stats, ops.q.dtype)
        return m.merge_q(out[None], H), m.merge_rows(lse[None], H)

    def bwd(self, ops, opts, out, lse, dout, dlse):
        ops, opts = lower(ops, opts)
        S_q, H = ops.q.shape[1], ops.q.shape[2]
        S_k, K = ops.k.shape[1], ops.k.shape[2]
        q, k, bias, vis = self._tile(ops, opts)
        delta = m.delta(out, dout, dlse)
        v = m.split_kv(ops.v, S_k)[0]
        do = m.split_q(dout.astype(ops.q.dtype), K, S_q)[0]
        dq, dkt, dvt, ds = m.tile_grads(
            opts,
            jnp.swapaxes(q, -1, -2),
            *m.fold_scale(opts, q),
            jnp.swapaxes(k, -1, -2),
            k,
            jnp.swapaxes(v, -1, -2),
            do,
            jnp.swapaxes(do, -1, -2),
            m.split_rows(m.safe_lse(lse), K, S_q)[0],
            m.split_rows(delta, K, S_q)[0],
            bias,
            vis,
        )
        dbias = None
        if ops.bias is not None:
            dbias = m.reduce_rows_4d(ds, ops.bias.shape, H).astype(ops.bias.dtype)
        dsinks = None if ops.sinks is None else m.sinks_grad(ops.sinks, lse, delta)
        return (
            m.merge_q(dq[None], H).astype(ops.q.dtype),
            m.merge_kv(jnp.swapaxes(dkt, -1, -2)[None]).astype(ops.k.dtype),
            m.merge_kv(jnp.swapaxes(dvt, -1, -2)[None]).astype(ops.v.dtype),
            dbias,
            dsinks,
        )
