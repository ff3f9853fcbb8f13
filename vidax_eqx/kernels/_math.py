"""Attention math shared by the pure-JAX implementations, on one tile.

A tile is a block of `T` query positions against a block of `U` key positions,
in a "rows" layout that serves GQA without repeating k/v: the `G = H // H_kv`
query heads that share one kv head become `M = G * T` rows of one matmul.

- `q`, `do`: `(B, K, M, D)` with `K = H_kv`; row `g * T + t` is head `g`, position `t`;
- `kt`, `vt`: keys / values transposed, `(B, K, D, U)`; `k`, `v`: `(B, K, U, D)`;
- `bias`, `mask`: `(B|1, K|1, M|1, U|1)` (see `rows_4d`);
- row statistics (`m`, `l`, `lse`, `delta`): `(B, K, M)`, float32;
- `q_pos (M,)`, `seg_q (B, M)` repeat the block's positions / ids once per head.

Every dot is then a plain rank-4 batched matmul whose output XLA lays out
row-major, so the elementwise fusions read it without a relayout copy.

The `"xla"` reference runs these on the whole sequence as one tile; the
`"blockwise"` flash attention runs them per tile with an online softmax.
Logits are `scale * q.k`, then the soft cap `c * tanh(s / c)`, then `+ bias`
(so a large negative bias still masks when a soft cap is set).
"""

import math

import jax
import jax.numpy as jnp

from .._vma import as_varying as as_varying, varying_axes as varying_axes
from ._args import Options, valid_keys
from ._tile_tables import features_visibility, rows_visibility


F32 = jnp.float32
# The log-sum-exp given to the padded query rows of a backward: finite (no inf
# anywhere, so `jax_debug_infs` stays quiet) and large enough that `exp(s - lse)`
# is exactly 0 for any real logit, yet small enough that `masked(dtype) - PAD_LSE`
# does not overflow (it is below half an ulp of the largest float32).
PAD_LSE = 1e30


def stat_dtype(dtype) -> jnp.dtype:
    """The dtype of softmax statistics and accumulators for inputs of `dtype`: float32,
    or float64 for float64 inputs ("float32 statistics" means at least float32)."""
    return jnp.promote_types(dtype, F32)


def masked(dtype) -> float:
    """The logit of a hidden key and the running max before any key, in statistics of
    `dtype`: the lowest finite value, not `-inf`, so no intermediate is infinite
    (`jax_debug_infs`). `exp(masked - m)` is exactly 0 for every real `m`, and a row
    whose max is still `masked` saw nothing (`finalize`)."""
    return float(jnp.finfo(dtype).min)


def is_empty_lse(lse: jax.Array) -> jax.Array:
    """Rows whose `lse` says they saw nothing: `-inf` (the public contract, and the
    vendor kernels) or the finite sentinel `masked` of the portable implementations."""
    return lse <= masked(lse.dtype)


# -- layout: (B, S, H, D) <-> blocks of rows --------------------------------------


def split_q(q: jax.Array, kv_heads: int, block: int) -> jax.Array:
    """`(B, n*block, H, D)` -> `(n, B, K, G*block, D)`."""
    B, S, H, D = q.shape
    G, n = H // kv_heads, S // block
    x = q.reshape(B, n, block, kv_heads, G, D).transpose(1, 0, 3, 4, 2, 5)
    return x.reshape(n, B, kv_heads, G * block, D)


def merge_q(x: jax.Array, heads: int) -> jax.Array:
    """Inverse of `split_q`."""
    n, B, K, M, D = x.shape
    G = heads // K
    x = x.reshape(n, B, K, G, M // G, D).transpose(1, 0, 4, 2, 3, 5)
    return x.reshape(B, n * (M // G), heads, D)


def split_rows(x: jax.Array, kv_heads: int, block: int) -> jax.Array:
    """Row statistic `(B, H, n*block)` -> `(n, B, K, G*block)`."""
    B, H, S = x.shape
    G, n = H // kv_heads, S // block
    x = x.reshape(B, kv_heads, G, n, block).transpose(3, 0, 1, 2, 4)
    return x.reshape(n, B, kv_heads, G * block)


def merge_rows(x: jax.Array, heads: int) -> jax.Array:
    """Inverse of `split_rows`."""
    n, B, K, M = x.shape
    G = heads // K
    x = x.reshape(n, B, K, G, M // G).transpose(1, 2, 3, 0, 4)
    return x.reshape(B, heads, n * (M // G))


def split_kv(k: jax.Array, block: int) -> jax.Array:
    """`(B, n*block, K, D)` -> `(n, B, K, block, D)`."""
    B, S, K, D = k.shape
    return k.reshape(B, S // block, block, K, D).transpose(1, 0, 3, 2, 4)


def merge_kv(x: jax.Array) -> jax.Array:
    """Inverse of `split_kv`."""
    n, B, K, U, D = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(B, n * U, K, D)


def rows_4d(x: jax.Array | None, kv_heads: int, heads: int, block_q: int) -> jax.Array | None:
    """A bias / mask tile `(B|1, H|1, T|1, U|1)` -> rows layout `(B|1, K|1, M|1, U|1)`."""
    if x is None:
        return None
    b, h, t, u = x.shape
    G = heads // kv_heads
    if t == 1 and h == 1:
        return x.reshape(b, 1, 1, u)
    k = kv_heads if h > 1 else 1
    x = x.reshape(b, k, h // k, t, u)
    x = jnp.broadcast_to(x, (b, k, G, block_q, u))
    return x.reshape(b, k, G * block_q, u)


def reduce_rows_4d(ds: jax.Array, shape: tuple[int, int, int, int], heads: int) -> jax.Array:
    """The gradient of `rows_4d`: `(B, K, M, U)` -> `shape = (B|1, H|1, T|1, U|1)`."""
    B, K, M, U = ds.shape
    G = heads // K
    ds = ds.reshape(B, K, G, M // G, U)
    b, h, t, u = shape
    grouped = (b, K if h > 1 else 1, G if h > 1 else 1, t, u)
    return reduce_to(ds, grouped).reshape(shape)


def rows_sinks(sinks: jax.Array | None, kv_heads: int, block_q: int) -> jax.Array | None:
    """Sink logits `(H,)` -> per row `(K, M)`."""
    if sinks is None:
        return None
    x = sinks.reshape(kv_heads, -1, 1)
    return jnp.broadcast_to(x, (*x.shape[:2], block_q)).reshape(kv_heads, -1)


def repeat_rows(x: jax.Array | None, heads_per_kv: int) -> jax.Array | None:
    """Per-position `(..., T)` (positions, segment ids) -> per row `(..., G*T)`."""
    if x is None:
        return None
    return jnp.tile(x, (1,) * (x.ndim - 1) + (heads_per_kv,))


def reduce_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sums `x` over the axes where `shape` has 1 (the gradient of a broadcast)."""
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """`(B, K, M, X) @ (B, K, X, N)` with float32 (float64 inputs: float64) accumulation."""
    return jnp.einsum("bkmx,bkxn->bkmn", a, b, preferred_element_type=stat_dtype(a.dtype))


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
    *,
    kv_heads: int = 1,
    heads: int = 1,
    tile=None,
    kv_lengths: jax.Array | None = None,
    kv_index: jax.Array | None = None,
) -> jax.Array | None:
    """Boolean `(B|1, K|1, M, U)`: may row m see key u. `None`: all visible.

    `q_pos (M,)`, `kv_pos (U,)`, `seg_q (B, M)`, `seg_kv (B, U)`, `kv_valid (U,)`,
    `mask (B|1, K|1, M|1, U|1)`; `kv_heads`, `heads` (K and H) place the rows'
    heads for a sliding tile mask with per-head windows (`opts.tile_mask`), and
    `tile` is that mask's `(_tile.q_features, _tile.kv_features)` of this tile when
    computed beforehand. `kv_lengths (B,)` with `kv_index (U,)`, the keys' indices
    along the sequence axis: key u is visible only where `kv_index[u] < kv_lengths[b]`
    (key-only padding).
    """
    vis = None
    qp, kp = q_pos[:, None], kv_pos[None, :]
    if opts.causal:
        vis = _and(vis, kp <= qp)
    if opts.window is not None:
        left, right = opts.window
        d = kp - qp  # compared as a difference: `qp + right` could overflow int32
        if left is not None:
            vis = _and(vis, d >= -left)
        if right is not None:
            vis = _and(vis, d <= right)
    if kv_valid is not None:
        vis = _and(vis, kv_valid[None, :])
    if vis is not None:
        vis = vis[None, None]
    if kv_lengths is not None:
        vis = _and(vis, valid_keys(kv_lengths, kv_index)[:, None, None, :])
    if seg_q is not None:
        sq, sk = seg_q[:, None, :, None], seg_kv[:, None, None, :]
        vis = _and(vis, (sq == sk) & (sq >= 0))
    if mask is not None:
        vis = _and(vis, mask)
    if tile is not None:
        vis = _and(vis, features_visibility(*tile))
    elif opts.tile_mask is not None:
        vis = _and(vis, rows_visibility(opts.tile_mask, q_pos, kv_pos, kv_heads, heads))
    return vis


def fold_scale(opts: Options, q: jax.Array) -> tuple[jax.Array, float]:
    """Folds the logit scale (and `1 / soft_cap`) into `q` where that is exact enough.

    Returns `(q_scaled, rest)` with `scale * q.k / cap == rest * (q_scaled . k)`
    (no `/ cap` without a soft cap). Folding saves one pass over every score
    tile; it is done for float32 inputs and for power-of-two factors, where it
    adds no rounding beyond float32's. Otherwise `rest` carries the factor.
    """
    factor = opts.scale
    if opts.logits_soft_cap is not None:
        factor = factor / opts.logits_soft_cap
    mantissa, _ = math.frexp(factor)
    if q.dtype in (F32, jnp.float64) or mantissa == 0.5:
        return (q.astype(stat_dtype(q.dtype)) * factor).astype(q.dtype), 1.0
    return q, factor


def logits(
    opts: Options,
    qs: jax.Array,
    kt: jax.Array,
    bias: jax.Array | None,
    rest: float,
) -> tuple[jax.Array, jax.Array | None]:
    """Float32 (float64 inputs: float64) logits `(B, K, M, U)` and, with a soft cap,
    `tanh(s / c)`.

    `qs, rest = fold_scale(opts, q)`; `kt` is `k` transposed, `(B, K, D, U)`.
    """
    s = _dot(qs, kt)
    if rest != 1.0:
        s = s * rest
    t = None
    if opts.logits_soft_cap is not None:
        t = jnp.tanh(s)
        s = opts.logits_soft_cap * t
    if bias is not None:
        s = s + bias.astype(s.dtype)
    return s, t


# -- forward ----------------------------------------------------------------------


def init_stats(
    shape: tuple[int, ...], head_dim: int, sinks: jax.Array | None, dtype=F32
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Accumulator `o`, running max `m` and denominator `l` for rows `shape = (B, K, M)`,
    in the statistics dtype `dtype` (`stat_dtype` of the inputs).

    The running max starts at the finite `masked` logit. A sink enters as a key of
    logit `sinks` (per row, `(K, M)`) and value 0: `m = sink`, `l = 1`.
    """
    o = jnp.zeros((*shape, head_dim), dtype)
    if sinks is None:
        return o, jnp.full(shape, masked(dtype), dtype), jnp.zeros(shape, dtype)
    m = jnp.broadcast_to(sinks.astype(dtype)[None], shape)
    return o, m, jnp.ones(shape, dtype)


def softmax_step(
    stats: tuple[jax.Array, jax.Array, jax.Array],
    s: jax.Array,
    vis: jax.Array | None,
    v: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One online-softmax update of `(o, m, l)` with the tile logits `s` and values `v`."""
    o, m, l = stats
    low = masked(m.dtype)
    if vis is not None:
        s = jnp.where(vis, s, low)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    # Nothing seen so far: subtract 0, so every hidden logit's exp is exactly 0.
    m_safe = jnp.where(m_new == low, 0.0, m_new)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    l = alpha * l + jnp.sum(p, axis=-1)
    return alpha[..., None] * o + _dot(p.astype(v.dtype), v), m_new, l


def finalize(
    stats: tuple[jax.Array, jax.Array, jax.Array], dtype
) -> tuple[jax.Array, jax.Array]:
    """`(o, m, l)` -> `(out, lse)`; a row with `l == 0` gives 0 and lse `masked`
    (finite: the public `attention_fwd` turns it into `-inf`)."""
    o, m, l = stats
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    out = (o / l_safe[..., None]).astype(dtype)
    lse = jnp.where(empty, masked(m.dtype), m + jnp.log(l_safe))
    return out, lse


# -- backward ---------------------------------------------------------------------


def delta(out: jax.Array, dout: jax.Array, dlse: jax.Array | None) -> jax.Array:
    """`rowsum(dout * out) - dlse` as `(B, H, S_q)` float32 (float64 for float64
    inputs; `out`, `dout`: `(B, S_q, H, D)`)."""
    dtype = stat_dtype(out.dtype)
    d = jnp.einsum("bshd,bshd->bhs", dout.astype(dtype), out.astype(dtype))
    return d if dlse is None else d - dlse.astype(dtype)


def sinks_grad(sinks: jax.Array, lse: jax.Array, delta_: jax.Array) -> jax.Array:
    """Gradient of the sink logits `(H,)`: `-sum_rows p_sink * delta`."""
    p_sink = jnp.exp(sinks.astype(lse.dtype)[None, :, None] - lse)
    return (-jnp.sum(p_sink * delta_, axis=(0, 2))).astype(sinks.dtype)


def safe_lse(lse: jax.Array) -> jax.Array:
    """Rows that saw nothing (lse `-inf` or `masked`) -> 0, so the `exp(s - lse)` of
    their hidden logits stays exactly 0 rather than NaN."""
    return jnp.where(is_empty_lse(lse), jnp.zeros((), lse.dtype), lse)


def tile_grads(
    opts: Options,
    qt: jax.Array,
    qs: jax.Array,
    rest: float,
    kt: jax.Array,
    k: jax.Array,
    vt: jax.Array,
    do: jax.Array,
    dot_: jax.Array,
    lse: jax.Array,
    delta_: jax.Array,
    bias: jax.Array | None,
    vis: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Gradients of one tile: `dq (B, K, M, D)` and the transposed `dk^T`, `dv^T`
    `(B, K, D, U)`, float32, plus `ds`, the gradient of the logits (for the bias;
    `None` without bias).

    Arguments: `qt` (`q` transposed, `(B, K, D, M)`) and the `fold_scale`-d `qs,
    rest`; `kt`, `vt` are `k`, `v` transposed, `(B, K, D, U)`; `do` and its
    transpose `dot_`. `lse` must already be `safe_lse`-d. Every operand arrives
    in the layout its matmul reads (contracting over the lhs's last axis and
    the rhs's second-to-last), which is what XLA's fast CPU matmul path takes
    without a per-tile transpose.
    """
    s, t = logits(opts, qs, kt, bias, rest)
    if vis is not None:
        s = jnp.where(vis, s, masked(s.dtype))
    p = jnp.exp(s - lse[..., None])
    dvt = _dot(dot_, p.astype(do.dtype))
    ds = p * (_dot(do, vt) - delta_[..., None])
    dbias = None if bias is None else ds
    if t is not None:
        ds = ds * (1.0 - t * t)
    ds = ds.astype(qt.dtype)
    dq = _dot(ds, k) * opts.scale
    dkt = _dot(qt, ds) * opts.scale
    return dq, dkt, dvt, dbias
