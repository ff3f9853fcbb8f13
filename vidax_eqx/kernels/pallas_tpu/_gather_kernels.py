"""The tile-gathering kernels' Pallas TPU (Mosaic) bodies, forward, dQ and dK/dV, and
the `pallas_call` of each: the grids, block specs and scratch of a `Plan`
(`_gather_plan.py`) over the arrays in the layout of `_gather_layout.py`. How they work is
`_gather.py`'s docstring.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import _math as m
from . import _gather_plan as knobs
from ._gather_plan import LANES, Plan


F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


def _chunk_row(rows_ref, index, W: int, T: int):
    """`(1, W)` float32: lanes `[j T, (j + 1) T)` from row `index[j]` of `rows_ref
    (n, 1, W)` (each row holds its tile's `T` values repeated along the lanes)."""
    lane = lax.broadcasted_iota(jnp.int32, (1, W), 1)
    row = rows_ref[index[0]]
    for j in range(1, len(index)):
        row = jnp.where(lane >= j * T, rows_ref[index[j]], row)
    return row


def _gather(src_ref, dst_ref, tiles, T: int, direct: bool):
    """The chunk of `len(tiles)` tiles of `T` rows of `src_ref`: sliced from the
    resident array when `direct` (consecutive tiles); else each tile loaded and the
    loads stacked along the sublanes (whole vregs: `T` is a multiple of the sublane
    tiling), or, with `GATHER = "copy"`, copied into `dst_ref` and read back."""
    if direct:
        start = pl.multiple_of(tiles[0] * T, T)
        return src_ref[pl.ds(start, len(tiles) * T), :]
    if knobs.GATHER == "load":
        return jnp.concatenate([src_ref[pl.ds(pl.multiple_of(t * T, T), T), :] for t in tiles], axis=0)
    for j, t in enumerate(tiles):
        dst_ref[pl.ds(j * T, T), :] = src_ref[pl.ds(pl.multiple_of(t * T, T), T), :]
    return dst_ref[...]


def _kv_chunk(table_ref, base, k_res, v_res, valid_res, kc_ref, vc_ref, *, CH, T, n_k, direct):
    """Chunk `base` of a query tile's slots: `(k, v, valid (1, CH*T) bool)`."""
    ids = [table_ref[base + j] for j in range(CH)]
    safe = [jnp.maximum(t, 0) for t in ids]
    valid = _chunk_row(valid_res, [jnp.where(t < 0, n_k, t) for t in ids], CH * T, T) > 0.5
    return (_gather(k_res, kc_ref, safe, T, direct), _gather(v_res, vc_ref, safe, T, direct), valid)


def _copy_when(cond, pairs, sem):
    """Copies each `(src, dst)` pair (HBM -> VMEM or SMEM) when `cond` holds: DMAs on
    `sem`, all started, then all waited for (what `pltpu.sync_copy` does, without its
    scoped semaphore, whose lowering needs the TPU generation)."""

    @pl.when(cond)
    def _():
        copies = [pltpu.make_async_copy(src, dst, sem) for src, dst in pairs]
        for copy in copies:
            copy.start()
        for copy in copies:
            copy.wait()


def _load_fwd(C: int, table_hbm, count_hbm, k_hbm, v_hbm, valid_hbm, table_ref, count_ref, k_res, v_res,
              valid_res, sem):
    """The forward / dQ grid `(unit, chunk, head, query tile)`: key validity at the first
    step, the unit's K and V at its first step, the chunk's tables at its first step."""
    u, c, g, i = (pl.program_id(d) for d in range(4))
    chunk_first = (g == 0) & (i == 0)
    _copy_when(chunk_first & (c == 0) & (u == 0), [(valid_hbm, valid_res)], sem)
    _copy_when(chunk_first & (c == 0), [(k_hbm.at[u], k_res), (v_hbm.at[u], v_res)], sem)
    _copy_when(chunk_first, [(table_hbm.at[u * C + c], table_ref), (count_hbm.at[u * C + c], count_ref)], sem)
    return g, i


def _run_chunks(n, chains: int, chunk, commit, full: int | None = None):
    """Chunks `0 .. n - 1` (`n` dynamic): `chains` consecutive ones per iteration (chunk
    `it * chains + h` on chain `h`), the remainder one per iteration on chain 0.
    `chunk(j, h)` computes chunk `j` and returns its parts; `commit(parts)` adds up those
    of one iteration.

    With `full` (and `UNROLL`), a row of exactly `full` chunks (VSA's: every row selects
    the same number of tiles) runs them unrolled, in the same order on the same chains,
    so that the compiler can overlap one chunk's softmax with the next one's matmuls;
    other rows take the loop."""
    if full is not None and knobs.UNROLL:

        @pl.when(n == full)
        def _():
            for it in range(full // chains):
                commit([chunk(it * chains + h, h) for h in range(chains)])
            for j in range(full // chains * chains, full):
                commit([chunk(j, 0)])

        @pl.when(n != full)
        def _():
            _run_chunks(n, chains, chunk, commit)

        return

    def group(it, carry):
        commit([chunk(it * chains + h, h) for h in range(chains)])
        return carry

    full = lax.div(n, chains)
    lax.fori_loop(0, full, group, 0)
    if chains > 1:

        def single(j, carry):
            commit([chunk(j, 0)])
            return carry

        lax.fori_loop(full * chains, n, single, 0)


def _run_rows(ns, chains: int, chunk, commit, full: int):
    """`_run_chunks` for each of a step's query tiles, tile `r` with `ns[r]` chunks:
    `chunk(r, j, h)`, `commit(r, parts)`. When every tile has exactly `full` chunks (and
    `UNROLL`), all of them unrolled in one region, the tiles' chains side by side, so that
    the compiler can overlap one tile's softmax with another's matmuls."""
    if len(ns) > 1 and knobs.UNROLL:
        every = functools.reduce(jnp.logical_and, [n == full for n in ns])

        @pl.when(every)
        def _():
            for it in range(full // chains):
                for r in range(len(ns)):
                    commit(r, [chunk(r, it * chains + h, h) for h in range(chains)])
            for j in range(full // chains * chains, full):
                for r in range(len(ns)):
                    commit(r, [chunk(r, j, 0)])

        @pl.when(jnp.logical_not(every))
        def _():
            _run_rows_apart(ns, chains, chunk, commit, full)

        return
    _run_rows_apart(ns, chains, chunk, commit, full)


def _run_rows_apart(ns, chains, chunk, commit, full):
    for r, n in enumerate(ns):
        _run_chunks(n, chains, functools.partial(chunk, r), functools.partial(commit, r), full)


def _fwd_kernel(table_hbm, count_hbm, q_ref, k_hbm, v_hbm, valid_hbm, o_ref, lse_ref,
                table_ref, count_ref, k_res, v_res, valid_res, kc_ref, vc_ref, m_sc, l_sc, o_sc, sem, *,
                C: int, n_qc: int, n_selp: int, CH: int, T: int, n_k: int, scale: float, direct: bool,
                chains: int, R: int):
    """`R` query tiles a step; an online softmax per (tile, chain), merged at the end."""
    g, i = _load_fwd(C, table_hbm, count_hbm, k_hbm, v_hbm, valid_hbm, table_ref, count_ref, k_res, v_res,
                     valid_res, sem)
    low = m.masked(F32)
    m_sc[...] = jnp.full(m_sc.shape, low, F32)
    l_sc[...] = jnp.zeros(l_sc.shape, F32)
    o_sc[...] = jnp.zeros(o_sc.shape, F32)
    rows = [g * n_qc + i * R + r for r in range(R)]
    qs = [q_ref[r * T:(r + 1) * T, :] for r in range(R)]

    def chunk(r, j, h):
        k, v, valid = _kv_chunk(table_ref, rows[r] * n_selp + j * CH, k_res, v_res, valid_res, kc_ref.at[h],
                                vc_ref.at[h], CH=CH, T=T, n_k=n_k, direct=direct)
        s = lax.dot_general(qs[r], k, _NT, preferred_element_type=F32) * scale
        s = jnp.where(valid, s, low)
        c = r * chains + h
        m_prev = m_sc[c][:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == low, 0.0, m_new)  # nothing seen yet: every exp is 0
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_prev - m_safe)
        l_new = alpha * l_sc[c][:, :1] + jnp.sum(p, axis=1, keepdims=True)
        pv = lax.dot_general(p.astype(v.dtype), v, _NN, preferred_element_type=F32)
        o_sc[c] = alpha * o_sc[c] + pv
        m_sc[c] = jnp.broadcast_to(m_new, m_sc.shape[1:])
        l_sc[c] = jnp.broadcast_to(l_new, l_sc.shape[1:])

    _run_rows([lax.div(count_ref[row] + CH - 1, CH) for row in rows], chains, chunk, lambda r, parts: None,
              n_selp // CH)
    for r in range(R):
        ms = [m_sc[r * chains + h][:, :1] for h in range(chains)]
        mx = functools.reduce(jnp.maximum, ms)
        m_safe = jnp.where(mx == low, 0.0, mx)
        scales = [jnp.exp(x - m_safe) for x in ms]
        l = sum(a * l_sc[r * chains + h][:, :1] for h, a in enumerate(scales))
        acc = sum(a * o_sc[r * chains + h] for h, a in enumerate(scales))
        empty = l == 0.0
        l_safe = jnp.where(empty, 1.0, l)
        o_ref[r * T:(r + 1) * T, :] = (acc / l_safe).astype(o_ref.dtype)
        lse = jnp.where(empty, low, mx + jnp.log(l_safe))
        lse_ref[r * T:(r + 1) * T, :] = jnp.broadcast_to(lse, (T, lse_ref.shape[1]))


def _add_to(*refs):
    """`commit` for `_run_chunks`: adds each chain's parts into `refs`."""

    def commit(parts):
        for n, ref in enumerate(refs):
            ref[...] += functools.reduce(jnp.add, [x[n] for x in parts])

    return commit


def _dq_kernel(table_hbm, count_hbm, q_ref, do_ref, lse_ref, delta_ref, k_hbm, v_hbm, valid_hbm, dq_ref,
               table_ref, count_ref, k_res, v_res, valid_res, kc_ref, vc_ref, dq_sc, sem, *,
               C: int, n_qc: int, n_selp: int, CH: int, T: int, n_k: int, scale: float, direct: bool,
               chains: int, R: int):
    """`R` query tiles a step, as the forward."""
    g, i = _load_fwd(C, table_hbm, count_hbm, k_hbm, v_hbm, valid_hbm, table_ref, count_ref, k_res, v_res,
                     valid_res, sem)
    dq_sc[...] = jnp.zeros(dq_sc.shape, F32)
    rows = [g * n_qc + i * R + r for r in range(R)]
    tile = lambda ref, r: ref[r * T:(r + 1) * T, :]

    def chunk(r, j, h):
        k, v, valid = _kv_chunk(table_ref, rows[r] * n_selp + j * CH, k_res, v_res, valid_res, kc_ref.at[h],
                                vc_ref.at[h], CH=CH, T=T, n_k=n_k, direct=direct)
        lse, delta = tile(lse_ref, r)[:, :1], tile(delta_ref, r)[:, :1]
        s = lax.dot_general(tile(q_ref, r), k, _NT, preferred_element_type=F32) * scale
        p = jnp.exp(jnp.where(valid, s - lse, m.masked(F32)))
        dp = lax.dot_general(tile(do_ref, r), v, _NT, preferred_element_type=F32)
        ds = p * (dp - delta)
        return (lax.dot_general(ds.astype(k.dtype), k, _NN, preferred_element_type=F32),)

    commit = lambda r, parts: _add_to(dq_sc.at[r])(parts)
    _run_rows([lax.div(count_ref[row] + CH - 1, CH) for row in rows], chains, chunk, commit, n_selp // CH)
    for r in range(R):
        dq_ref[r * T:(r + 1) * T, :] = dq_sc[r] * scale


def _dkv_kernel(offsets_hbm, entries_hbm, k_ref, v_ref, valid_ref, q_hbm, do_hbm, lse_hbm, delta_hbm,
                dk_ref, dv_ref, offsets_ref, entries_ref, q_res, do_res, lse_res, delta_res, qc_ref, doc_ref,
                dk_sc, dv_sc, sem, *, C: int, CH: int, T: int, n_rows: int, entries: int, scale: float,
                chains: int):
    """Grid `(unit, chunk, key tile)`. Keys along sublanes, queries along lanes (as
    splash's dK/dV kernel): `p^T (T_k, CH*T_q)` from `k q^T` and the queries'
    statistics as a lane row, and both products plain matmuls (no transpose)."""
    u, c, kt = (pl.program_id(d) for d in range(3))
    _copy_when(kt == 0, [
        (offsets_hbm.at[u * C + c], offsets_ref), (entries_hbm.at[u * C + c], entries_ref),
        (q_hbm.at[u, c], q_res), (do_hbm.at[u, c], do_res), (lse_hbm.at[u, c], lse_res),
        (delta_hbm.at[u, c], delta_res),
    ], sem)
    dk_sc[...] = jnp.zeros(dk_sc.shape, F32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, F32)
    start, end = offsets_ref[kt], offsets_ref[kt + 1]
    k, v = k_ref[...], v_ref[...]
    valid = valid_ref[...] > 0.5  # (T, 1)

    def chunk(j, h):
        at = [start + j * CH + e for e in range(CH)]
        rows = [jnp.where(e < end, entries_ref[jnp.minimum(e, entries - 1)], n_rows) for e in at]
        safe = [jnp.minimum(r, n_rows - 1) for r in rows]
        qc = _gather(q_res, qc_ref.at[h], safe, T, False)
        doc = _gather(do_res, doc_ref.at[h], safe, T, False)
        lse = _chunk_row(lse_res, rows, CH * T, T)  # (1, W); PAD_LSE past the entries
        delta = _chunk_row(delta_res, rows, CH * T, T)
        s_t = lax.dot_general(k, qc, _NT, preferred_element_type=F32) * scale  # (T_k, W)
        p_t = jnp.exp(jnp.where(valid, s_t - lse, m.masked(F32)))
        dp_t = lax.dot_general(v, doc, _NT, preferred_element_type=F32)
        ds_t = p_t * (dp_t - delta)
        return (lax.dot_general(ds_t.astype(qc.dtype), qc, _NN, preferred_element_type=F32),
                lax.dot_general(p_t.astype(doc.dtype), doc, _NN, preferred_element_type=F32))

    _run_chunks(lax.div(end - start + CH - 1, CH), chains, chunk, _add_to(dk_sc, dv_sc))
    dk_ref[...] = dk_sc[...] * scale
    dv_ref[...] = dv_sc[...]


# -- the calls ---------------------------------------------------------------------------


def _any():
    return pl.BlockSpec(memory_space=pl.ANY)


def _params(vmem: int, axes: int):
    return pltpu.CompilerParams(dimension_semantics=("arbitrary",) * axes, vmem_limit_bytes=vmem)


def _fwd_scratch(table, counts, k, v, valid, p: Plan):
    W, D = p.W, k.shape[-1]
    return [
        pltpu.SMEM(table.shape[1:], jnp.int32),
        pltpu.SMEM(counts.shape[1:], jnp.int32),
        pltpu.VMEM(k.shape[1:], k.dtype),
        pltpu.VMEM(v.shape[1:], v.dtype),
        pltpu.VMEM(valid.shape, F32),
        pltpu.VMEM((p.chains, W, D), k.dtype),
        pltpu.VMEM((p.chains, W, D), v.dtype),
    ]


def fwd_call(table, counts, q, k, v, valid, *, p: Plan, n_k: int, scale: float):
    """`table (U*C, G*n_qc*n_selp)`, `counts (U*C, G*n_qc)`, `q (U, C, G, L, D)`, `k, v
    (U, S_k, D)`, `valid (n_k + 1, 1, W)` -> `out (U, C, G, L, D)`, `lse (U, C, G, L, 128)`."""
    U, C, G, L, D = q.shape
    T, R = p.T, p.R
    block = lambda u, c, g, i: (u, c, g, i, 0)
    kernel = functools.partial(_fwd_kernel, C=C, n_qc=p.n_qc, n_selp=p.n_selp, CH=p.CH, T=T, n_k=n_k,
                               scale=scale, direct=p.direct, chains=p.chains, R=R)
    return pl.pallas_call(
        kernel,
        grid=(U, C, G, p.n_qc // R),
        in_specs=[_any(), _any(), pl.BlockSpec((None, None, None, R * T, D), block), _any(), _any(), _any()],
        out_specs=[pl.BlockSpec((None, None, None, R * T, D), block),
                   pl.BlockSpec((None, None, None, R * T, LANES), block)],
        scratch_shapes=[
            *_fwd_scratch(table, counts, k, v, valid, p),
            pltpu.VMEM((R * p.chains, T, LANES), F32),
            pltpu.VMEM((R * p.chains, T, LANES), F32),
            pltpu.VMEM((R * p.chains, T, D), F32),
            pltpu.SemaphoreType.DMA(()),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((U, C, G, L, LANES), F32)],
        compiler_params=_params(p.vmem_fwd, 4),
        name="vidax_tile_gather_fwd",
    )(table, counts, q, k, v, valid)


def dq_call(table, counts, q, do, lse, delta, k, v, valid, *, p: Plan, n_k: int, scale: float):
    """dQ, float32 `(U, C, G, L, D)`; `lse`, `delta` `(U, C, G, L, 128)`."""
    U, C, G, L, D = q.shape
    T, R = p.T, p.R
    block = lambda u, c, g, i: (u, c, g, i, 0)
    rows = pl.BlockSpec((None, None, None, R * T, D), block)
    stats = pl.BlockSpec((None, None, None, R * T, LANES), block)
    kernel = functools.partial(_dq_kernel, C=C, n_qc=p.n_qc, n_selp=p.n_selp, CH=p.CH, T=T, n_k=n_k,
                               scale=scale, direct=p.direct, chains=p.chains, R=R)
    return pl.pallas_call(
        kernel,
        grid=(U, C, G, p.n_qc // R),
        in_specs=[_any(), _any(), rows, rows, stats, stats, _any(), _any(), _any()],
        out_specs=rows,
        scratch_shapes=[*_fwd_scratch(table, counts, k, v, valid, p), pltpu.VMEM((R, T, D), F32),
                        pltpu.SemaphoreType.DMA(())],
        out_shape=jax.ShapeDtypeStruct(q.shape, F32),
        compiler_params=_params(p.vmem_fwd, 4),
        name="vidax_tile_gather_dq",
    )(table, counts, q, do, lse, delta, k, v, valid)


def dkv_call(offsets, entries, k, v, valid, q, do, lse, delta, *, p: Plan, scale: float):
    """dK, dV per chunk, float32 `(U, C, S_k, D)`, from the CSR tables `offsets (U*C,
    n_k + 1)`, `entries (U*C, E)` (rows `g * n_qc + i`); `q`, `do` `(U, C, G * L, D)`;
    `valid (n_k, T, 1)`; `lse`, `delta` `(U, C, G * n_qc + 1, 1, W)` rows (the last: the
    padding)."""
    U, S_k, D = k.shape
    C = q.shape[1]
    T, W = p.T, p.W
    n_k = S_k // T
    key = pl.BlockSpec((None, T, D), lambda u, c, t: (u, t, 0))
    out = pl.BlockSpec((None, None, T, D), lambda u, c, t: (u, c, t, 0))
    kernel = functools.partial(_dkv_kernel, C=C, CH=p.CH, T=T, n_rows=lse.shape[2] - 1,
                               entries=entries.shape[1], scale=scale, chains=p.chains)
    return pl.pallas_call(
        kernel,
        grid=(U, C, n_k),
        in_specs=[_any(), _any(), key, key, pl.BlockSpec((None, T, 1), lambda u, c, t: (t, 0, 0)),
                  _any(), _any(), _any(), _any()],
        out_specs=[out, out],
        scratch_shapes=[
            pltpu.SMEM(offsets.shape[1:], jnp.int32),
            pltpu.SMEM(entries.shape[1:], jnp.int32),
            pltpu.VMEM(q.shape[2:], q.dtype),
            pltpu.VMEM(do.shape[2:], do.dtype),
            pltpu.VMEM(lse.shape[2:], F32),
            pltpu.VMEM(delta.shape[2:], F32),
            pltpu.VMEM((p.chains, W, D), q.dtype),
            pltpu.VMEM((p.chains, W, D), do.dtype),
            pltpu.VMEM((T, D), F32),
            pltpu.VMEM((T, D), F32),
            pltpu.SemaphoreType.DMA(()),
        ],
        out_shape=[jax.ShapeDtypeStruct((U, C, S_k, D), F32)] * 2,
        compiler_params=_params(p.vmem_dkv, 3),
        name="vidax_tile_gather_dkv",
    )(offsets, entries, k, v, valid, q, do, lse, delta)
