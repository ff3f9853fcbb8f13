"""Attention math shared by the pure-JAX implementations, on one tile.

A tile is a block of query rows against a block of key columns, in the grouped
layout that serves GQA without repeating k/v:

- `q`, `do`: `(B, K, G, T, D)` with `K = H_kv` groups of `G = H // H_kv` heads;
- `k`, `v`: `(B, K, U, D)`;
- `bias`, `mask`: `(B|1, K|1, G|1, T|1, U|1)`;
- row statistics (`m`, `l`, `lse`, `delta`): `(B, K, G, T)`, float32.

The `"xla"` reference runs these on the whole sequence as one tile; the
`"blockwise"` flash attention runs them per tile with an online softmax.
Logits are `scale * q.k`, then the soft cap `c * tanh(s / c)`, then `+ bias`
(so a large negative bias still masks when a soft cap is set).
"""

import jax
import jax.numpy as jnp

from ._args import Operands, Options


F32 = jnp.float32
NEG_INF = -jnp.inf


# -- layout -----------------------------------------------------------------------


def group_q(q: jax.Array, kv_heads: int) -> jax.Array:
    """`(B, S, H, D)` -> `(B, K, G, S, D)`."""
    B, S, H, D = q.shape
    return q.reshape(B, S, kv_heads, H // kv_heads, D).transpose(0, 2, 3, 1, 4)


def ungroup_q(x: jax.Array) -> jax.Array:
    """`(B, K, G, S, D)` -> `(B, S, H, D)`."""
    B, K, G, S, D = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(B, S, K * G, D)


def group_kv(k: jax.Array) -> jax.Array:
    """`(B, S, K, D)` -> `(B, K, S, D)`."""
    return k.transpose(0, 2, 1, 3)


def ungroup_kv(x: jax.Array) -> jax.Array:
    """`(B, K, S, D)` -> `(B, S, K, D)`."""
    return x.transpose(0, 2, 1, 3)


def group_4d(x: jax.Array | None, kv_heads: int) -> jax.Array | None:
    """Bias or mask `(B|1, H|1, S_q|1, S_k|1)` -> `(B|1, K|1, G|1, S_q|1, S_k|1)`."""
    if x is None:
        return None
    b, h, sq, sk = x.shape
    if h == 1:
        return x.reshape(b, 1, 1, sq, sk)
    return x.reshape(b, kv_heads, h // kv_heads, sq, sk)


def ungroup_4d(x: jax.Array) -> jax.Array:
    b, k, g, sq, sk = x.shape
    return x.reshape(b, k * g, sq, sk)


def group_rows(x: jax.Array, kv_heads: int) -> jax.Array:
    """Row statistic `(B, H, S)` -> `(B, K, G, S)`."""
    B, H, S = x.shape
    return x.reshape(B, kv_heads, H // kv_heads, S)


def ungroup_rows(x: jax.Array) -> jax.Array:
    B, K, G, S = x.shape
    return x.reshape(B, K * G, S)


def reduce_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sums `x` over the axes where `shape` has 1 (the gradient of a broadcast)."""
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


# -- masks ------------------------------------------------------------------------


def _and(a, b):
    return b if a is None else a & b


def visibility(
    opts: Options,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    seg_q: jax.Array | None = None,
    seg_kv: jax.Array | None = None,
    mask: jax.Array | None = None,
    kv_valid: jax.Array | None = None,
) -> jax.Array | None:
    """Boolean `(B|1, 1|K, 1|G, T, U)`: may query t see key u. `None`: all visible.

    `q_pos (T,)`, `kv_pos (U,)`, `seg_q (B, T)`, `seg_kv (B, U)`, `kv_valid (U,)`.
    """
    vis = None
    qp, kp = q_pos[:, None], kv_pos[None, :]
    if opts.causal:
        vis = _and(vis, kp <= qp)
    if opts.window is not None:
        left, right = opts.window
        if left is not None:
            vis = _and(vis, kp >= qp - left)
        if right is not None:
            vis = _and(vis, kp <= qp + right)
    if kv_valid is not None:
        vis = _and(vis, kv_valid[None, :])
    if vis is not None:
        vis = vis[None, None, None]
    if seg_q is not None:
        sq, sk = seg_q[:, None, None, :, None], seg_kv[:, None, None, None, :]
        vis = _and(vis, (sq == sk) & (sq >= 0))
    if mask is not None:
        vis = _and(vis, mask)
    return vis


def logits(
    opts: Options, q: jax.Array, k: jax.Array, bias: jax.Array | None
) -> tuple[jax.Array, jax.Array | None]:
    """Float32 logits `(B, K, G, T, U)` and, with a soft cap, `tanh(s / c)`."""
    s = jnp.einsum("bkgtd,bkud->bkgtu", q, k, preferred_element_type=F32) * opts.scale
    t = None
    if opts.logits_soft_cap is not None:
        t = jnp.tanh(s / opts.logits_soft_cap)
        s = opts.logits_soft_cap * t
    if bias is not None:
        s = s + bias.astype(F32)
    return s, t


# -- forward ----------------------------------------------------------------------


def init_stats(
    shape: tuple[int, ...], head_dim: int, sinks: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Accumulator `o`, running max `m` and denominator `l` for rows `shape = (B, K, G, T)`.

    A sink enters as a key of logit `sinks[h]` and value 0: `m = sink`, `l = 1`.
    `sinks` is grouped `(K, G)`.
    """
    o = jnp.zeros((*shape, head_dim), F32)
    if sinks is None:
        return o, jnp.full(shape, NEG_INF, F32), jnp.zeros(shape, F32)
    m = jnp.broadcast_to(sinks.astype(F32)[None, :, :, None], shape)
    return o, m, jnp.ones(shape, F32)


def softmax_step(
    stats: tuple[jax.Array, jax.Array, jax.Array],
    s: jax.Array,
    vis: jax.Array | None,
    v: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One online-softmax update of `(o, m, l)` with the tile logits `s` and values `v`."""
    o, m, l = stats
    if vis is not None:
        s = jnp.where(vis, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # all -inf so far: keep exp finite
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    l = alpha * l + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgtu,bkud->bkgtd", p.astype(v.dtype), v, preferred_element_type=F32)
    return alpha[..., None] * o + pv, m_new, l


def finalize(
    stats: tuple[jax.Array, jax.Array, jax.Array], dtype
) -> tuple[jax.Array, jax.Array]:
    """`(o, m, l)` -> `(out, lse)`; a row with `l == 0` gives 0 and `-inf`."""
    o, m, l = stats
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    out = (o / l_safe[..., None]).astype(dtype)
    lse = jnp.where(empty, NEG_INF, m + jnp.log(l_safe))
    return out, lse


# -- backward ---------------------------------------------------------------------


def delta(out: jax.Array, dout: jax.Array, dlse: jax.Array | None) -> jax.Array:
    """`rowsum(dout * out) - dlse` as `(B, H, S_q)` float32 (`out`, `dout`: `(B, S_q, H, D)`)."""
    d = jnp.einsum("bshd,bshd->bhs", dout.astype(F32), out.astype(F32))
    return d if dlse is None else d - dlse.astype(F32)


def sinks_grad(sinks: jax.Array, lse: jax.Array, delta_: jax.Array) -> jax.Array:
    """Gradient of the sink logits `(H,)`: `-sum_rows p_sink * delta`."""
    p_sink = jnp.exp(sinks.astype(F32)[None, :, None] - lse)
    return (-jnp.sum(p_sink * delta_, axis=(0, 2))).astype(sinks.dtype)


def safe_lse(lse: jax.Array) -> jax.Array:
    """`-inf` rows (nothing visible) -> 0, so `exp(-inf - lse)` stays 0 rather than NaN."""
    return jnp.where(lse == NEG_INF, 0.0, lse)


def tile_grads(
    opts: Options,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    do: jax.Array,
    lse: jax.Array,
    delta_: jax.Array,
    bias: jax.Array | None,
    vis: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Gradients of one tile: `dq (B,K,G,T,D)`, `dk`, `dv (B,K,U,D)` float32 and the
    bias-shaped `dbias` (`None` without bias). `lse` must already be `safe_lse`-d."""
    s, t = logits(opts, q, k, bias)
    if vis is not None:
        s = jnp.where(vis, s, NEG_INF)
    p = jnp.exp(s - lse[..., None])
    dv = jnp.einsum("bkgtu,bkgtd->bkud", p.astype(do.dtype), do, preferred_element_type=F32)
    dp = jnp.einsum("bkgtd,bkud->bkgtu", do, v, preferred_element_type=F32)
    ds = p * (dp - delta_[..., None])
    dbias = None if bias is None else reduce_to(ds, bias.shape)
    if t is not None:
        ds = ds * (1.0 - t * t)
    ds = ds.astype(q.dtype)
    dq = jnp.einsum("bkgtu,bkud->bkgtd", ds, k, preferred_element_type=F32) * opts.scale
    dk = jnp.einsum("bkgtu,bkgtd->bkud", ds, q, preferred_element_type=F32) * opts.scale
    return dq, dk, dv, dbias


def grouped_sinks(ops: Operands) -> jax.Array | None:
    if ops.sinks is None:
        return None
    K = ops.k.shape[2]
    return ops.sinks.reshape(K, -1)
