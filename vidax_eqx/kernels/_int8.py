"""int8 attention: the quantization scheme, and its XLA reference.

`attention(..., quantize="int8")` computes the forward pass with the matrix units' int8
products, as SageAttention does on GPUs:

- **Q.Kᵀ in int8.** K's mean over the (valid) keys is subtracted first, per batch, key
  head and channel: every logit of a query row moves by the same `q . mean(k)`, which
  softmax ignores (it is added back to the row's log-sum-exp, so that `lse` is the float
  attention's and ring merges stay exact). Q and the centred K are then rounded to int8
  with one scale per token and head (`max |x| / 127`; the softmax scale folded into
  Q's), and their product summed in int32.
- **P.V in int8** (`"int8"`; `"int8-qk"` keeps P.V in Q's dtype). The probabilities are
  scaled per block of keys: within each block of `block_kv` keys, `p = exp(s - m_b)`
  with `m_b` the row's largest logit in that block (so each row of each block spans
  `[0, 1]` exactly), rounded to `floor(255 p + 1/2)`, 8 bits, held as that minus 128
  in int8 (the 128 comes back as `128 * sum(v)` over the block); V, centred on its mean
  over the keys (added back to the output: the probabilities sum to one), rounded to
  int8 with one scale per channel. The blocks combine in float32 with the weights
  `exp(m_b - m)`, and the row's denominator is the sum of the rounded probabilities, so
  that the output is an exact weighted mean of the rounded values.

The scheme is defined by `block_kv` alone, so the XLA reference here and the Pallas TPU
kernel compute the same quantities (up to the order of float32 sums). Error against
float64 (tests): cosine >= 0.999 and relative L2 <= 2e-2, on random inputs and on keys
with a large per-channel offset.

The backward pass is the float attention's (its own implementation's, from the int8
forward's output and log-sum-exp): the rounding has no useful derivative.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import _math as m
from ._args import valid_keys

BLOCK_KV = 512
"""The keys one probability scale covers (the Pallas TPU kernel's key block)."""

F32 = jnp.float32
_QMAX = 127.0
_PMAX = 255.0


class Int8Operands(NamedTuple):
    """Q, K (and V) of a request in the scheme's int8, in the `(B, S, H, D)` layout.

    `q` int8 `(B, S_q, H, D)`, `q_scale` `(B, S_q, H)` (the softmax scale folded in);
    `k` int8 `(B, S_k, K, D)` centred, `k_scale` `(B, S_k, K)`; `shift` `(B, S_q, H)`,
    the logit shift the centring took out (`scale * q . mean(k)`); `v` int8 centred
    with `v_scale` and `v_mean` `(B, 1, K, D)`, or (`"int8-qk"`) V as it was and
    `None`s."""

    q: jax.Array
    q_scale: jax.Array
    k: jax.Array
    k_scale: jax.Array
    shift: jax.Array
    v: jax.Array
    v_scale: jax.Array | None
    v_mean: jax.Array | None


def _round_rows(x: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """`(x8, scale)`: symmetric int8 with one scale over `axis` (`max |x| / 127`; 1 for
    all zeros)."""
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / _QMAX, 1.0)
    return jnp.clip(jnp.round(x / scale), -_QMAX, _QMAX).astype(jnp.int8), scale


def _keys_seen(ops) -> jax.Array | None:
    """`(B, S_k)` True for the keys any query may see (`kv_lengths`, segment id >= 0):
    the keys the means and scales are taken over. `None` when all are."""
    valid = None if ops.kv_lengths is None else valid_keys(ops.kv_lengths, ops.k.shape[1])
    if ops.seg_kv is not None:
        valid = ops.seg_kv >= 0 if valid is None else valid & (ops.seg_kv >= 0)
    return valid


def quantize_operands(ops, scale: float, mode: str) -> Int8Operands:
    """`ops`' q, k, v in the scheme of `mode` (see the module's text)."""
    valid = _keys_seen(ops)
    q, k, v = ops.q.astype(F32), ops.k.astype(F32), ops.v.astype(F32)
    if valid is not None:  # invisible keys: never read (a NaN there stays out)
        k = jnp.where(valid[:, :, None, None], k, 0.0)
        v = jnp.where(valid[:, :, None, None], v, 0.0)
        count = jnp.maximum(jnp.sum(valid, axis=1), 1).astype(F32)[:, None, None, None]
    else:
        count = F32(k.shape[1])

    def centred(x):
        mean = jnp.sum(x, axis=1, keepdims=True) / count
        x = x - mean
        return (x if valid is None else jnp.where(valid[:, :, None, None], x, 0.0)), mean

    k, k_mean = centred(k)
    H, K = q.shape[2], k.shape[2]
    # The logit shift the centring took out, per query row: scale * q . mean(k).
    k_mean_per_head = jnp.repeat(k_mean, H // K, axis=2)  # (B, 1, H, D)
    shift = scale * jnp.sum(q * k_mean_per_head, axis=-1)
    q8, q_scale = _round_rows(q)
    k8, k_scale = _round_rows(k)
    if mode == "int8":
        v, v_mean = centred(v)
        v8, v_scale = _round_rows(v, axis=1)
    else:
        v8, v_scale, v_mean = ops.v, None, None
    return Int8Operands(q8, scale * q_scale[..., 0], k8, k_scale[..., 0], shift, v8, v_scale, v_mean)


def reference(ops, opts, mode: str, vis: jax.Array | None, block_kv: int = BLOCK_KV):
    """`(out, lse)` of the scheme, materialized (the `"xla"` implementation's): `vis`, the
    visibility `(B|1, K|1, G*S_q|1, S_k)` in `_math`'s rows layout (`None`: all)."""
    B, S_q, H, D = ops.q.shape
    S_k, K = ops.k.shape[1], ops.k.shape[2]
    x = quantize_operands(ops, opts.scale, mode)
    rows = lambda a: m.split_rows(jnp.swapaxes(a, 1, 2), K, S_q)[0]  # noqa: E731  (B, S, H) -> (B, K, M)
    q8 = m.split_q(x.q, K, S_q)[0]  # (B, K, M, D)
    k8 = m.split_kv(x.k, S_k)[0]  # (B, K, S_k, D)
    s = jnp.einsum("bkmd,bksd->bkms", q8, k8, preferred_element_type=jnp.int32).astype(F32)
    s = s * rows(x.q_scale)[..., None] * jnp.swapaxes(x.k_scale, 1, 2)[:, :, None, :]
    if vis is None:
        vis = jnp.ones((1, 1, 1, S_k), bool)
    vis = jnp.broadcast_to(vis, s.shape)
    # Blocks of `block_kv` keys (the last padded with invisible keys).
    n = -(-S_k // block_kv)
    pad = n * block_kv - S_k
    s = jnp.pad(s, ((0, 0),) * 3 + ((0, pad),)).reshape(*s.shape[:3], n, block_kv)
    vis = jnp.pad(vis, ((0, 0),) * 3 + ((0, pad),)).reshape(s.shape)
    v = m.split_kv(jnp.pad(x.v, ((0, 0), (0, pad), (0, 0), (0, 0))), n * block_kv)[0]
    v = v.reshape(B, K, n, block_kv, D)
    seen = jnp.any(vis, axis=-1)  # (B, K, M, n)
    m_b = jnp.max(jnp.where(vis, s, m.masked(F32)), axis=-1)
    m_b = jnp.where(seen, m_b, 0.0)
    p = jnp.where(vis, jnp.exp(s - m_b[..., None]), 0.0)
    if mode == "int8":
        u = jnp.floor(p * _PMAX + 0.5)  # 8 bits: the kernel's int8 round(255 p) - 128, plus 128
        pv = jnp.einsum("bkmnj,bknjd->bkmnd", u.astype(jnp.int32), v.astype(jnp.int32),
                        preferred_element_type=jnp.int32).astype(F32)
        l_b = jnp.sum(u, axis=-1)
    else:
        pv = jnp.einsum("bkmnj,bknjd->bkmnd", p, v.astype(F32))
        l_b = jnp.sum(p, axis=-1)
    top = jnp.max(jnp.where(seen, m_b, m.masked(F32)), axis=-1)  # (B, K, M)
    any_seen = jnp.any(seen, axis=-1)
    top = jnp.where(any_seen, top, 0.0)
    w = jnp.where(seen, jnp.exp(m_b - top[..., None]), 0.0)
    acc = jnp.sum(w[..., None] * pv, axis=3)
    l = jnp.sum(w * l_b, axis=-1)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    out = acc / l_safe[..., None]
    out = m.merge_q(out[None], H)  # (B, S_q, H, D)
    if mode == "int8":
        out = out * per_head(x.v_scale, H) + per_head(x.v_mean, H)
        l_safe = l_safe / _PMAX
    out = jnp.where(m.merge_q(empty[None, ..., None], H), 0.0, out).astype(ops.q.dtype)
    lse = top + jnp.log(l_safe) + rows(x.shift)
    lse = jnp.where(empty, m.masked(F32), lse)
    return out, m.merge_rows(lse[None], H)


def per_head(x: jax.Array, heads: int) -> jax.Array:
    """A per key/value head `(B, 1, K, D)` array for each query head `(B, 1, H, D)`."""
    return jnp.repeat(x, heads // x.shape[2], axis=2)
