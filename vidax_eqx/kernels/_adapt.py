"""Adapting fused vendor kernels (Pallas TPU / GPU) to the `(out, lse)` contract.

The vendor kernels differ from the contract of [`AbstractImplementation`][] in
the same few ways, handled here once:

- they need sequence lengths that are multiples of their tiles: the adapters pad
  and exclude the padded keys with segment ids (padded queries are sliced off);
  key-only padding (`kv_lengths`) is folded into the keys' segment ids the same
  way ([`kernel_segment_ids`][]);
- they mask with a large finite logit, so a row that sees no key comes back as
  an average over masked keys with a hugely negative lse: [`finish`][] turns
  such rows into `out = 0`, `lse = -inf`;
- they know no attention sinks: a sink only adds `exp(sink)` to each row's
  denominator, so [`finish`][] rescales `out` by `exp(lse - logaddexp(lse, sink))`;
- their backward recomputes the probabilities as `exp(s - m) / l` from saved
  row statistics and takes `delta = rowsum(dout * out)` as an input: passing the
  (possibly external, ring-merged) `lse` as `m` with `l = 1`, and
  `delta - dlse` as `delta`, makes it the backward of the contract, `dlse`
  included ([`backward_stats`][]).
"""

import jax
import jax.numpy as jnp

from . import _math as m
from ._args import Operands, valid_keys


F32 = jnp.float32

# The vendor kernels mask with -0.7 * float32 max; logits the adapters mask
# themselves (a boolean mask folded into a bias) get `MASKED_LOGIT`. A row whose
# lse is below `MASKED_LSE` therefore saw no key.
MASKED_LOGIT = -1e37
MASKED_LSE = -1e36

# Segment ids given to a kernel for tokens that must match nothing: padding
# queries and padding keys get different ids, and real ids are >= 0.
Q_PAD, KV_PAD = -1, -2


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def tile(n: int, block: int, quantum: int) -> tuple[int, int]:
    """`(tile, padded_length)` for a sequence of `n` tokens: the tile is `block`,
    shrunk for short sequences, and a multiple of `quantum`."""
    t = min(block, round_up(n, quantum))
    return t, round_up(n, t)


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """Pads `x` at the end of `axis` to `size` with `value`."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def kernel_segment_ids(ops: Operands, S_q_pad: int, S_k_pad: int):
    """`(seg_q, seg_kv)` int32 `(B, S_q_pad)`, `(B, S_k_pad)` for a kernel, or `None`.

    Padding (negative ids, padded tokens, and keys at index `>= kv_lengths[b]`)
    maps to ids no real token has; `None` when nothing must be excluded (no segment
    ids, no key lengths and no padded keys: padded queries are harmless, they are
    sliced off).
    """
    B, S_q = ops.q.shape[:2]
    S_k = ops.k.shape[1]
    if ops.seg_q is None:
        if S_k == S_k_pad and ops.kv_lengths is None:
            return None
        seg_q, seg_kv = jnp.zeros((B, S_q), jnp.int32), jnp.zeros((B, S_k), jnp.int32)
    else:
        seg_q = jnp.where(ops.seg_q < 0, Q_PAD, ops.seg_q)
        seg_kv = jnp.where(ops.seg_kv < 0, KV_PAD, ops.seg_kv)
    if ops.kv_lengths is not None:
        seg_kv = jnp.where(valid_keys(ops.kv_lengths, S_k), seg_kv, KV_PAD)
    return pad_axis(seg_q, 1, S_q_pad, Q_PAD), pad_axis(seg_kv, 1, S_k_pad, KV_PAD)


def shared_segment_ids(ops: Operands, S_pad: int):
    """One int32 `(B, S_pad)` array for kernels whose queries and keys share one
    array (`S_q == S_k`), or `None`. Padding maps to `Q_PAD`; rows with it are
    zeroed by [`finish`][] (they may see other padding keys inside the kernel)."""
    B, S = ops.q.shape[:2]
    if ops.seg_q is None:
        if S == S_pad:
            return None
        seg = jnp.zeros((B, S), jnp.int32)
    else:
        seg = jnp.where(ops.seg_q < 0, Q_PAD, ops.seg_q)
    return pad_axis(seg, 1, S_pad, Q_PAD)


def finish(
    ops: Operands, out: jax.Array, lse: jax.Array, empty_below: float = MASKED_LSE,
    rows_may_be_empty: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """A kernel's `(out (B, S_q, H, D), lse (B, H, S_q))` -> the contract's: rows that
    see nothing (lse below `empty_below`) give 0 and `-inf`, and the sinks join each
    row's denominator. `rows_may_be_empty=False` (the caller knows that every row sees
    a key: `rows_may_be_empty`) skips the selection, a pass over `out`."""
    if rows_may_be_empty:
        hidden = lse < min(MASKED_LSE, empty_below)
        if ops.seg_q is not None:
            hidden = hidden | (ops.seg_q < 0)[:, None, :]
        lse = jnp.where(hidden, -jnp.inf, lse.astype(F32))
        rows = jnp.swapaxes(hidden, 1, 2)[..., None]
        out = jnp.where(rows, jnp.zeros((), out.dtype), out)
    else:
        lse = lse.astype(F32)
    if ops.sinks is not None:
        total = jnp.logaddexp(lse, ops.sinks.astype(F32)[None, :, None])
        keep = jnp.swapaxes(jnp.exp(lse - total), 1, 2)[..., None]
        out = (out.astype(F32) * keep).astype(out.dtype)
        lse = total
    return out, lse


def rows_may_be_empty(ops: Operands, opts) -> bool:
    """Whether a row of the request may see no key. Not in full or causal attention over
    the default positions without segment ids, key lengths, a bias or mask, a window or a
    tile mask: every query then sees key 0 at least."""
    plain = (
        opts.default_positions and ops.q_pos is None and ops.kv_pos is None and ops.seg_q is None
        and ops.seg_kv is None and ops.kv_lengths is None and ops.bias is None and ops.mask is None
        and opts.window is None and opts.tile_mask is None and opts.block_causal is None
        and ops.k.shape[1] > 0
    )
    return not plain


def backward_stats(ops: Operands, out, lse, dout, dlse):
    """`(kernel_lse, delta, dsinks)` for a kernel's backward (see the module docstring).

    `kernel_lse` is `lse` with `+inf` on rows that see nothing (lse `-inf`) or are
    padding (negative segment id: with a shared segment array a kernel may pair
    them with padding keys), so that `exp(s - lse)` vanishes there even for the
    finite masked logits of a kernel.
    """
    delta = m.delta(out, dout, dlse)
    hidden = m.is_empty_lse(lse)
    if ops.seg_q is not None:
        hidden = hidden | (ops.seg_q < 0)[:, None, :]
    kernel_lse = jnp.where(hidden, jnp.inf, lse.astype(F32))
    dsinks = None if ops.sinks is None else m.sinks_grad(ops.sinks, lse, delta)
    return kernel_lse, delta, dsinks


def repeat_kv(x: jax.Array, heads: int) -> jax.Array:
    """`(B, S, H_kv, D)` -> `(B, S, H, D)` for kernels without GQA."""
    return jnp.repeat(x, heads // x.shape[2], axis=2)


def reduce_kv(dx: jax.Array, kv_heads: int) -> jax.Array:
    """The gradient of [`repeat_kv`][]: `(B, S, H, D)` -> `(B, S, H_kv, D)`."""
    B, S, H, D = dx.shape
    return dx.reshape(B, S, kv_heads, H // kv_heads, D).sum(axis=3, dtype=F32)
