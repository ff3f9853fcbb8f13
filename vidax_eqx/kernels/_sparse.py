"""Block-sparse attention over whole tiles: the fine stage of video sparse attention.

Each query tile attends the key tiles listed for it (per query head) in a table
`tiles (B, H, n_q_tiles, n_sel)` of key-tile indices, `-1` marking an unused
slot; `kv_valid (S_k,)` hides padding keys. Logits are `scale * q.k`, softmax
statistics are float32 (float64 for float64 inputs), and a row that sees no key
gives 0 with the finite empty log-sum-exp `_math.masked`.

Two pure-JAX implementations serve the `sparse_fwd` / `sparse_bwd` contract of
implementations whose `Capabilities.video_sparse` is set:

- `dense_fwd` / `dense_bwd` (`"xla"`): the token-level mask of the table, one
  materialized `(B, H, S_q, S_k)` softmax. The reference, and fastest for short
  sequences.
- `gather_fwd` / `gather_bwd` (`"blockwise"`): a loop over groups of query
  tiles; each step gathers its selected key/value tiles, a chunk of about
  `KV_TARGET` keys at a time under an online softmax, so time and memory scale
  with `n_sel`, not with `S_k` (a chunk of unused slots is skipped at run time).
  The backward recomputes the probabilities from the log-sum-exp and
  scatter-adds the selected tiles' dK/dV into float32 accumulators.
"""

import jax
import jax.numpy as jnp
from jax import lax

from . import _math as m


def _dims(q, k, tiles, tile_size: int):
    B, S_q, H, D = q.shape
    S_k, K = k.shape[1], k.shape[2]
    return B, S_q, S_k, H, K, D, S_q // tile_size, S_k // tile_size, tiles.shape[-1]


def _heads_q(x: jax.Array, tile_size: int) -> jax.Array:
    """`(B, n*T, H, D)` -> `(B, H, n, T, D)`."""
    B, S, H, D = x.shape
    return x.reshape(B, S // tile_size, tile_size, H, D).transpose(0, 3, 1, 2, 4)


def _unheads_q(x: jax.Array) -> jax.Array:
    """Inverse of `_heads_q`."""
    B, H, n, T, D = x.shape
    return x.transpose(0, 2, 3, 1, 4).reshape(B, n * T, H, D)


def _rows(x: jax.Array, tile_size: int) -> jax.Array:
    """Row statistic `(B, H, n*T)` -> `(B, H, n, T)`."""
    B, H, S = x.shape
    return x.reshape(B, H, S // tile_size, tile_size)


def _visibility(tiles: jax.Array, kv_valid: jax.Array, tile_size: int, n_k: int) -> jax.Array:
    """The token-level mask of a tile table: bool `(B, H, S_q, S_k)`."""
    hit = jnp.any(tiles[..., None] == jnp.arange(n_k, dtype=tiles.dtype), axis=-2)  # (B, H, nq, nk)
    vis = jnp.repeat(jnp.repeat(hit, tile_size, axis=2), tile_size, axis=3)
    return vis & kv_valid[None, None, None, :]


def _expand_kv(x: jax.Array, heads: int) -> jax.Array:
    """`(B, S, K, D)` -> `(B, H, S, D)`, each kv head repeated for its query heads."""
    return jnp.repeat(x.transpose(0, 2, 1, 3), heads // x.shape[2], axis=1)


def dense_fwd(q, k, v, tiles, kv_valid, *, tile_size: int, scale: float):
    """The fine stage with the whole mask materialized: `(out, lse)`."""
    B, S_q, S_k, H, K, D, nq, nk, _ = _dims(q, k, tiles, tile_size)
    acc = m.stat_dtype(q.dtype)
    vis = _visibility(tiles, kv_valid, tile_size, nk)
    s = jnp.einsum("bqhd,bhkd->bhqk", q, _expand_kv(k, H), preferred_element_type=acc) * scale
    stats = m.init_stats((B, H, S_q), D, None, acc)
    out, lse = m.finalize(m.softmax_step(stats, s, vis, _expand_kv(v, H).astype(acc)), q.dtype)
    return out.transpose(0, 2, 1, 3), lse


def dense_bwd(q, k, v, tiles, kv_valid, out, lse, dout, dlse, *, tile_size: int, scale: float):
    """The gradients `(dq, dk, dv)` of `dense_fwd` given `(out, lse)` and cotangents."""
    B, S_q, S_k, H, K, D, nq, nk, _ = _dims(q, k, tiles, tile_size)
    acc = m.stat_dtype(q.dtype)
    vis = _visibility(tiles, kv_valid, tile_size, nk)
    ke, ve = _expand_kv(k, H).astype(acc), _expand_kv(v, H).astype(acc)
    qh, do = q.transpose(0, 2, 1, 3).astype(acc), dout.transpose(0, 2, 1, 3).astype(acc)
    s = jnp.einsum("bhqd,bhkd->bhqk", qh, ke) * scale
    p = jnp.where(vis, jnp.exp(jnp.where(vis, s, 0.0) - m.safe_lse(lse)[..., None]), 0.0)
    ds = p * (jnp.einsum("bhqd,bhkd->bhqk", do, ve) - m.delta(out, dout, dlse)[..., None])
    dq = jnp.einsum("bhqk,bhkd->bqhd", ds, ke) * scale
    group = lambda x: x.reshape(B, K, H // K, S_k, D).sum(axis=2).transpose(0, 2, 1, 3)
    dk = group(jnp.einsum("bhqk,bhqd->bhkd", ds, qh) * scale)
    dv = group(jnp.einsum("bhqk,bhqd->bhkd", p, do))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _gather_plan(q, k, tiles, kv_valid, tile_size: int, q_tiles: int):
    """What both passes of the gather kernel share: the query-tile groups and, per
    group, the clamped key-tile indices and the validity of the gathered keys."""
    B, S_q, S_k, H, K, D, nq, nk, n_sel = _dims(q, k, tiles, tile_size)
    qg = max(1, min(q_tiles, nq))
    while nq % qg:
        qg -= 1
    groups = nq // qg
    # (groups, B, H, qg, n_sel): the table of each step.
    table = tiles.reshape(B, H, groups, qg, n_sel).transpose(2, 0, 1, 3, 4)
    valid_tiles = kv_valid.reshape(nk, tile_size)
    return qg, groups, table, valid_tiles


def _gather(x_tiles: jax.Array, idx: jax.Array, heads: int) -> jax.Array:
    """The selected tiles of `x_tiles (B, K, nk, T, D)` for `idx (B, H, qg, n_sel)`
    (clamped to valid indices): `(B, H, qg, n_sel * T, D)`."""
    B, K = x_tiles.shape[:2]
    b = jnp.arange(B)[:, None, None, None]
    h = (jnp.arange(heads) // (heads // K))[None, :, None, None]
    sel = x_tiles[b, h, idx]  # (B, H, qg, n_sel, T, D)
    return sel.reshape(*sel.shape[:3], -1, sel.shape[-1])


def _step_mask(idx: jax.Array, valid_tiles: jax.Array, q_ok: jax.Array | None = None) -> jax.Array:
    """bool `(B, H, qg, 1|T, n_sel * T)`: the gathered keys that are real and selected
    (and, with `q_ok (qg, T)`, only for the real query rows)."""
    keys = valid_tiles[jnp.maximum(idx, 0)] & (idx >= 0)[..., None]
    keys = keys.reshape(*idx.shape[:3], 1, -1)
    return keys if q_ok is None else keys & q_ok[None, None, :, :, None]


def _q_rows(q_valid: jax.Array | None, groups: int, qg: int, tile_size: int) -> jax.Array | None:
    """`q_valid (S_q,)` per step: `(groups, qg, T)`, or None."""
    return None if q_valid is None else q_valid.reshape(groups, qg, tile_size)


KV_TARGET = 512  # keys per inner step of the gathering kernel (benchmarks/NOTES.md)


def kv_chunk(n_sel: int, tile_size: int, target: int | None = None) -> int:
    """Key tiles per inner step: about `target` keys (default `KV_TARGET`; at least two
    tiles), the count in `[max // 2, max]` that pads `n_sel` least (ties: the larger)."""
    hi = max(2, round((KV_TARGET if target is None else target) / tile_size))
    if n_sel <= hi:
        return max(1, n_sel)
    return min(range(max(1, hi // 2), hi + 1), key=lambda c: (-(-n_sel // c) * c, -c))


def _chunks(idx: jax.Array, c: int) -> jax.Array:
    """`idx (B, H, g, n_sel)` -> `(n_chunks, B, H, g, c)`, padded with -1."""
    n_sel = idx.shape[-1]
    pad = (-n_sel) % c
    if pad:
        idx = jnp.concatenate([idx, jnp.full((*idx.shape[:-1], pad), -1, idx.dtype)], axis=-1)
    return jnp.moveaxis(idx.reshape(*idx.shape[:-1], -1, c), -2, 0)


def _skip_unused(chunk):
    """`chunk`, skipped at run time (`lax.cond`) when every slot of the chunk is unused
    (`-1`): a table whose rows list their used slots first (a ring step's share of a
    selection, `parallel/_vsa_ring.py`) then costs what it uses, not its width."""

    def run(carry, ic):
        return lax.cond(jnp.any(ic >= 0), lambda c: chunk(c, ic)[0], lambda c: c, carry), None

    return run


def _lanes(qg: int, lanes: int) -> list[slice]:
    """`qg` query tiles cut into `lanes` (at most; as even as possible) slices."""
    n = max(1, min(lanes, qg))
    edges = [round(i * qg / n) for i in range(n + 1)]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]


def _kv_tiles(x: jax.Array, tile_size: int) -> jax.Array:
    """`(B, n*T, K, D)` -> `(B, K, n, T, D)`."""
    return _heads_q(x, tile_size)


def gather_fwd(q, k, v, tiles, kv_valid, *, tile_size: int, scale: float, q_tiles: int = 2,
               q_valid=None, lanes: int = 1, kv_tiles: int | None = None):
    """The fine stage by gathering each step's selected key/value tiles: `(out, lse)`.

    `q_tiles`: query tiles per step (they share one loop iteration, not their keys).
    `q_valid`: optional bool `(S_q,)`; a query row where it is False sees nothing
    (out 0, the empty lse), as sliding tile attention's padding rows. `lanes`: the
    step's query tiles split into that many independent computations. `kv_tiles`:
    selected key tiles per inner step (default `kv_chunk`: about 512 keys).
    """
    B, S_q, S_k, H, K, D, nq, nk, n_sel = _dims(q, k, tiles, tile_size)
    acc = m.stat_dtype(q.dtype)
    qg, groups, table, valid_tiles = _gather_plan(q, k, tiles, kv_valid, tile_size, q_tiles)
    kt, vt = _kv_tiles(k, tile_size), _kv_tiles(v, tile_size)
    qh = _heads_q(q, tile_size).reshape(B, H, groups, qg, tile_size, D).transpose(2, 0, 1, 3, 4, 5)
    q_ok = _q_rows(q_valid, groups, qg, tile_size)

    low = m.masked(acc)
    c = kv_chunk(n_sel, tile_size) if kv_tiles is None else max(1, min(kv_tiles, n_sel))

    def one(q_i, idx, ok):
        # An online softmax over chunks of `c` selected key tiles: each chunk's logits
        # stay small (cache-sized), whatever the selection's size.
        def chunk(stats, ic):
            o, mx, l = stats
            safe = jnp.maximum(ic, 0)
            k_sel, v_sel = _gather(kt, safe, H), _gather(vt, safe, H)
            s = jnp.einsum("bhgtd,bhgud->bhgtu", q_i, k_sel, preferred_element_type=acc) * scale
            s = jnp.where(_step_mask(ic, valid_tiles, ok), s, low)
            mx_new = jnp.maximum(mx, jnp.max(s, axis=-1))
            m_safe = jnp.where(mx_new == low, 0.0, mx_new)  # hidden logits: exp(low) = 0
            corr = jnp.exp(mx - m_safe)
            p = jnp.exp(s - m_safe[..., None])
            pv = jnp.einsum("bhgtu,bhgud->bhgtd", p.astype(v.dtype), v_sel, preferred_element_type=acc)
            return (o * corr[..., None] + pv, mx_new, l * corr + jnp.sum(p, axis=-1)), None

        rows = q_i.shape[:-1]
        stats = (jnp.zeros((*rows, D), acc), jnp.full(rows, low, acc), jnp.zeros(rows, acc))
        stats = m.as_varying(stats, m.varying_axes(q_i, idx))
        stats, _ = lax.scan(_skip_unused(chunk), stats, _chunks(idx, c))
        return m.finalize(stats, q.dtype)

    def step(xs):
        q_i, idx, ok = xs  # (B, H, qg, T, D), (B, H, qg, n_sel), (qg, T) | None
        # `lanes` independent chains per step (not one batched op): XLA's CPU runtime
        # runs independent operations concurrently, one batched chain on one core.
        parts = [one(q_i[:, :, sl], idx[:, :, sl], None if ok is None else ok[sl]) for sl in _lanes(qg, lanes)]
        return tuple(jnp.concatenate(x, axis=2) for x in zip(*parts))

    out, lse = lax.map(step, (qh, table, q_ok))  # (groups, B, H, qg, T, ...)
    out = _unheads_q(out.transpose(1, 2, 0, 3, 4, 5).reshape(B, H, nq, tile_size, D))
    lse = lse.transpose(1, 2, 0, 3, 4).reshape(B, H, S_q)
    return out, lse


def gather_bwd(q, k, v, tiles, kv_valid, out, lse, dout, dlse, *, tile_size: int, scale: float,
               q_tiles: int = 2, q_valid=None, stat_grads: bool = False, lanes: int = 1,
               kv_tiles: int | None = None):
    """The gradients `(dq, dk, dv)` of `gather_fwd`: a scan over the query-tile groups
    that recomputes each step's probabilities and scatter-adds the selected tiles'
    dK / dV into accumulators of the key tiles.

    `q_valid`, `lanes`, `kv_tiles`: as in `gather_fwd`. `stat_grads`: return dK / dV in the statistics
    dtype (float32; for a caller that adds another part before rounding).
    """
    B, S_q, S_k, H, K, D, nq, nk, n_sel = _dims(q, k, tiles, tile_size)
    T = tile_size
    acc = m.stat_dtype(q.dtype)
    qg, groups, table, valid_tiles = _gather_plan(q, k, tiles, kv_valid, tile_size, q_tiles)
    kt, vt = _kv_tiles(k, T), _kv_tiles(v, T)
    per_step = lambda x: x.reshape(B, H, groups, qg, T, *x.shape[4:]).transpose(2, 0, 1, 3, 4, *range(5, x.ndim + 1))
    qh = per_step(_heads_q(q, T))
    do = per_step(_heads_q(dout.astype(q.dtype), T))
    lse_s = per_step(_rows(m.safe_lse(lse), T)[..., None])[..., 0]
    delta_s = per_step(_rows(m.delta(out, dout, dlse), T)[..., None])[..., 0]
    q_ok = _q_rows(q_valid, groups, qg, T)
    b = jnp.arange(B)[:, None, None, None]
    h = (jnp.arange(H) // (H // K))[None, :, None, None]

    c = kv_chunk(n_sel, T) if kv_tiles is None else max(1, min(kv_tiles, n_sel))

    def grads(acc_kv, q_i, do_i, lse_i, delta_i, idx, ok):
        # Chunks of `c` key tiles, as in `gather_fwd`: dQ accumulates over them, each
        # chunk's dK / dV are scatter-added at once.
        def chunk(carry, ic):
            dq, (dk_acc, dv_acc) = carry
            safe = jnp.maximum(ic, 0)
            k_sel, v_sel = _gather(kt, safe, H), _gather(vt, safe, H)
            s = jnp.einsum("bhgtd,bhgud->bhgtu", q_i, k_sel, preferred_element_type=acc) * scale
            vis = _step_mask(ic, valid_tiles, ok)
            p = jnp.where(vis, jnp.exp(jnp.where(vis, s, 0.0) - lse_i[..., None]), 0.0)
            dp = jnp.einsum("bhgtd,bhgud->bhgtu", do_i, v_sel, preferred_element_type=acc)
            ds = p * (dp - delta_i[..., None])
            dq = dq + jnp.einsum("bhgtu,bhgud->bhgtd", ds.astype(q.dtype), k_sel, preferred_element_type=acc)
            dk_sel = jnp.einsum("bhgtu,bhgtd->bhgud", ds.astype(q.dtype), q_i, preferred_element_type=acc) * scale
            dv_sel = jnp.einsum("bhgtu,bhgtd->bhgud", p.astype(q.dtype), do_i, preferred_element_type=acc)
            # Unused slots have p = 0, so their (clamped) tile receives exactly 0.
            shape = (*ic.shape, T, D)
            dk_acc = dk_acc.at[b, h, safe].add(dk_sel.reshape(shape))
            dv_acc = dv_acc.at[b, h, safe].add(dv_sel.reshape(shape))
            return (dq, (dk_acc, dv_acc)), None

        dq0 = m.as_varying(jnp.zeros(q_i.shape, acc), m.varying_axes(q_i, idx, *acc_kv))
        (dq, acc_kv), _ = lax.scan(_skip_unused(chunk), (dq0, acc_kv), _chunks(idx, c))
        return dq * scale, acc_kv

    lane_slices = _lanes(qg, lanes)

    def step(carry, xs):
        q_i, do_i, lse_i, delta_i, idx, ok = xs
        # Independent lanes, as in `gather_fwd`, each with dK / dV accumulators of its
        # own (summed at the end), so that nothing orders one lane after another.
        dqs, out = [], []
        for sl, acc_kv in zip(lane_slices, carry):
            dq, acc_kv = grads(acc_kv, q_i[:, :, sl], do_i[:, :, sl], lse_i[:, :, sl], delta_i[:, :, sl],
                               idx[:, :, sl], None if ok is None else ok[sl])
            dqs.append(dq)
            out.append(acc_kv)
        return tuple(out), jnp.concatenate(dqs, axis=2)

    zeros = jnp.zeros((B, K, nk, T, D), acc)
    zeros = m.as_varying(zeros, m.varying_axes(q, k, v, tiles))
    carry, dq = lax.scan(step, tuple((zeros, zeros) for _ in lane_slices),
                         (qh, do, lse_s, delta_s, table, q_ok))
    dk, dv = (sum(x[i] for x in carry[1:]) + carry[0][i] for i in range(2))
    dq = _unheads_q(dq.transpose(1, 2, 0, 3, 4, 5).reshape(B, H, nq, T, D))
    dk, dv = _unheads_q(dk), _unheads_q(dv)
    if not stat_grads:
        dk, dv = dk.astype(k.dtype), dv.astype(v.dtype)
    return dq.astype(q.dtype), dk, dv
