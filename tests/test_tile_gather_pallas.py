"""The tile-gathering Pallas TPU kernels (`kernels/pallas_tpu/_gather.py`: VSA's fine
stage over resident K/V; `kernels/pallas_tpu/_sliding.py`: sliding tile attention on
them), in Pallas interpret mode on CPU, against the float64 oracle.

- the fine stage (`_gather.sparse_fwd` / `sparse_bwd`): out, lse and the
  gradients of q, k, v with random cotangents on out and lse, GQA (G = 2), unused (-1)
  slots before and after used ones, a query tile with no used slot (its rows: 0 and the
  empty lse), padding keys and a key tile of padding only, a key tile nobody selects
  (dK = dV = 0), a last chunk of the inner loop only partly used; float32 in tiles of 8
  with one chain and the query tiles in two calls' worth of chunks (a small SMEM
  budget), bfloat16 in tiles of 12 (padded to 16) with the default chunks and chains,
  and the whole selection in one chunk (two query tiles a step, an odd count padded);
- sliding tile attention (`sliding_tile_fwd` / `sliding_tile_bwd`) against the
  oracle's dense sliding tile mask (`oracle.sliding_tile_of`): a ragged grid (padding
  keys hidden, padding rows dropped) with a shared window whose runs of 3 key tiles are
  sliced, not gathered, and GQA; per-head windows (one call per window, GQA groups
  split, their dK/dV added up);
- without running a kernel: the tile table against the mask, the CSR inversion, the
  plan at Wan's sizes, `PallasTpu` choosing the old per-tile kernels when the resident
  arrays do not fit, and the refusal of a mask with text.

`tests/test_vsa_pallas.py` runs the public `video_sparse_attention` through
`PallasTpu(interpret=True)`, which takes these kernels.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
from vidax_eqx import kernels
from vidax_eqx.kernels.pallas_tpu import _gather, _gather_layout, _gather_plan, _sliding


def _empty_to_inf(lse) -> np.ndarray:
    """The contract's empty lse (the finite `masked` sentinel) as the oracle's -inf."""
    lse = np.asarray(lse, np.float64)
    return np.where(lse <= np.finfo(np.float32).min, -np.inf, lse)


def _dense_mask(tiles: np.ndarray, kv_valid: np.ndarray, T: int) -> np.ndarray:
    """The token mask of a tile table: bool `(B, H, nq*T, nk*T)`."""
    B, H, nq, _ = tiles.shape
    nk = kv_valid.shape[0] // T
    hit = np.zeros((B, H, nq, nk), bool)
    for b, h, i, s in np.ndindex(tiles.shape):
        if tiles[b, h, i, s] >= 0:
            hit[b, h, i, tiles[b, h, i, s]] = True
    return np.repeat(np.repeat(hit, T, axis=2), T, axis=3) & kv_valid[None, None, None, :]


def _check(out, lse, grads, ref, dtype):
    lse_dtype = np.float32 if dtype == jnp.float32 else dtype
    oracle.assert_close(out, ref.out, dtype, "out")
    oracle.assert_close(_empty_to_inf(lse), ref.lse, lse_dtype, "lse")
    for name, got in zip(("dq", "dk", "dv"), grads):
        oracle.assert_close(got, getattr(ref, name), dtype, name)


# -- the fine stage -----------------------------------------------------------------------

# One batch element, H=4 query heads over 2 kv heads, D=16, 5 query and 7 key tiles, 3 slots.
H, K, D, NQ, NK, NSEL = 4, 2, 16, 5, 7, 3
UNSELECTED = 5  # a key tile no query tile selects


def _fine_case(T: int, dtype, seed: int):
    rng = np.random.default_rng(seed)
    S_q, S_k = NQ * T, NK * T
    q, q64 = harness.rounded(rng, (1, S_q, H, D), dtype)
    k, k64 = harness.rounded(rng, (1, S_k, K, D), dtype)
    v, v64 = harness.rounded(rng, (1, S_k, K, D), dtype)
    dout, dout64 = harness.rounded(rng, (1, S_q, H, D), dtype)
    dlse = harness.normal(rng, (1, H, S_q))
    choices = [t for t in range(NK) if t != UNSELECTED]
    tiles = np.stack([rng.permutation(choices)[:NSEL] for _ in range(H * NQ)]).reshape(1, H, NQ, NSEL)
    tiles[0, 0, 1, 1:] = -1  # unused slots after a used one
    tiles[0, 3, 0, 0] = -1  # an unused slot before used ones
    tiles[0, 1, 2, :] = -1  # a query tile that sees nothing
    tiles[0, 2, 4] = [NK - 1, -1, -1]  # only the last key tile, which is all padding
    kv_valid = np.ones(S_k, bool)
    kv_valid[(NK - 1) * T:] = False  # the last key tile: padding only
    kv_valid[T + 1: T + 3] = False  # and two padding keys inside tile 1
    tiles = tiles.astype(np.int32)
    scale = 0.7 / math.sqrt(D)
    ref = oracle.attention(q64, k64, v64, mask=_dense_mask(tiles, kv_valid, T), scale=scale,
                           dout=dout64, dlse=dlse)
    arrays = dict(q=q, k=k, v=v, tiles=jnp.asarray(tiles), kv_valid=jnp.asarray(kv_valid), dout=dout,
                  dlse=jnp.asarray(dlse))
    return arrays, scale, ref


FINE = [
    # Tiles of 8 float32 rows, chunks of 2 key tiles, one chain: 3 slots are a full and a
    # half-used chunk; an SMEM budget for 3 query tiles a call: 2 chunks (the last padded).
    pytest.param(8, jnp.float32, dict(kv_tiles=2, chains=1), (NK + 1 + 2 * 3 * 2) * 2, {}, (2, 3, 1),
                 id="float32-chunked"),
    # Tiles of 12 bfloat16 rows padded to 16, chunks of one key tile in 2 chains: the
    # second iteration's second chain is unused; chunks gathered through VMEM copies.
    pytest.param(12, jnp.bfloat16, dict(kv_tiles=1, chains=2), None, {"GATHER": "copy"}, (1, NQ, 1),
                 id="bfloat16-padded"),
    # Rows that use all 3 slots (2 chunks of 2) run unrolled on 2 chains, the others loop.
    pytest.param(8, jnp.float32, dict(kv_tiles=2, chains=2), None, {"UNROLL": True}, (1, NQ, 1),
                 id="float32-unrolled"),
    # The whole selection one chunk: 2 query tiles a step of the forward and dQ passes (5
    # padded to 6), unrolled side by side where both use every slot, else one by one.
    pytest.param(8, jnp.float32, dict(kv_tiles=3), None, {"UNROLL": True, "ROWS": 2}, (1, NQ + 1, 2),
                 id="float32-two-tiles-a-step"),
]


@pytest.mark.parametrize("T, dtype, knobs, smem, attrs, layout", FINE)
def test_fine_stage_against_oracle(T, dtype, knobs, smem, attrs, layout, monkeypatch):
    for name, value in attrs.items():
        monkeypatch.setattr(_gather_plan, name, value)
    if smem is not None:
        monkeypatch.setattr(_gather_plan, "SMEM_ENTRIES", smem)
    p = _gather_plan.plan((1, NQ * T, H, D), (1, NK * T, K, D), dtype, NSEL, T, **knobs)
    assert (p.C, p.n_qc, p.R) == layout
    a, scale, ref = _fine_case(T, dtype, seed=T)
    kw = dict(tile_size=T, scale=scale, interpret=True, **knobs)

    @jax.jit
    def run(q, k, v, tiles, kv_valid, dout, dlse):
        out, lse = _gather.sparse_fwd(q, k, v, tiles, kv_valid, **kw)
        return out, lse, _gather.sparse_bwd(q, k, v, tiles, kv_valid, out, lse, dout, dlse, **kw)

    out, lse, grads = run(**a)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    assert tuple(g.dtype for g in grads) == (dtype,) * 3
    _check(out, lse, grads, ref, dtype)
    # The query tile that sees nothing and the one that sees only padding: output 0, the
    # empty lse, dq 0; padding keys and the unselected key tile: no gradient.
    dq, dk, dv = (np.asarray(g, np.float32) for g in grads)
    for h, i in ((1, 2), (2, 4)):
        rows = np.s_[i * T: (i + 1) * T]
        assert not np.any(np.asarray(out[0, rows, h], np.float32)) and not np.any(dq[0, rows, h])
        assert np.all(np.asarray(lse[0, h, rows]) == kernels.internal.masked(jnp.float32))
    for tile in (UNSELECTED, NK - 1):
        assert not np.any(dk[:, tile * T:(tile + 1) * T]) and not np.any(dv[:, tile * T:(tile + 1) * T])


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "pairs"])
def test_csr_table(packed, monkeypatch):
    """The dK/dV pass's inversion: key tile `t`'s rows are `entries[offsets[t]:
    offsets[t + 1]]`, every used `(head, query tile)` once, in increasing order, unused
    slots past the end; the same with the key tile and row packed into one int32 and
    sorted as pairs (a selection too large to pack)."""
    table = np.array([[[2, 0, -1], [-1, -1, -1], [0, 3, -1]], [[1, 2, -1], [2, -1, -1], [3, 1, 0]]], np.int32)
    n_k = 5
    if not packed:
        monkeypatch.setattr(_gather_layout, "_PACKED_MAX", 0)
    offsets, entries = (np.asarray(x) for x in _gather_layout.csr(jnp.asarray(table), n_k))
    assert offsets.shape == (n_k + 1,) and entries.shape == (table.size,)
    assert offsets[0] == 0 and offsets[-1] == np.sum(table >= 0)
    for t in range(n_k):
        want = sorted(g * 3 + i for g, i, s in np.ndindex(table.shape) if table[g, i, s] == t)
        assert entries[offsets[t]:offsets[t + 1]].tolist() == want
    assert offsets[4] == offsets[5]  # key tile 4: nobody selected it


@pytest.mark.parametrize("n", [0, 1, 2, 7, 64, 1000])
def test_first_at_least(n):
    """The CSR offsets' binary search is `np.searchsorted(side="left")`: targets below,
    inside, between and above the entries, repeated entries included."""
    rng = np.random.default_rng(n)
    ordered = np.sort(rng.integers(0, 20, n)).astype(np.int32)
    targets = np.arange(-2, 23, dtype=np.int32)
    got = np.asarray(_gather_layout._first_at_least(jnp.asarray(ordered), jnp.asarray(targets)))
    np.testing.assert_array_equal(got, np.searchsorted(ordered, targets, side="left"))


def test_plan_and_dispatch(monkeypatch):
    """Wan 1.3B at sparsity 0.9 (bf16, 12 heads of 128, tiles of 64, 63 selected): at
    480p the forward's chunks are 32 key tiles (2,048 keys: the selection in two chunks
    of whole vregs), the backward's 16; at 720p the resident arrays do not fit with such
    chunks, which shrink until they do (forward 9 tiles, backward 8), in two calls'
    worth of query tiles. `PallasTpu` runs these kernels, and the per-tile kernels when
    the resident arrays do not fit at all."""
    for n, fwd, bwd in ((624, (2, 32), (1, 16)), (1440, (2, 9), (2, 8))):
        shape = (1, n * 64, 12, 128)
        for keys, (chunks, tiles) in ((None, fwd), (_gather_plan.KV_KEYS_BWD, bwd)):
            p = _gather_plan.plan(shape, shape, jnp.bfloat16, math.ceil(0.1 * n), 64, keys=keys)
            assert (p.C, p.T, p.CH, p.W) == (chunks, 64, tiles, tiles * 64)
            assert p.vmem_fwd <= 100 * 2**20 and p.vmem_dkv <= 100 * 2**20
    # Sliding tile attention's window of 27 tiles of 80 rows: one chunk forward, three backward.
    assert _gather_plan.kv_chunk(80, 27, 2304) == 27 and _gather_plan.kv_chunk(80, 27, 1024) == 9
    # The forward's whole window in one chunk, `ROWS` query tiles a step: 72-token tiles at
    # Wan 480p, and 128-token tiles (3,456 keys: `KV_KEYS_WHOLE`) on (24, 32, 64), where the
    # resident K/V leave room for 4 tiles a step; without `whole`, 2 chunks of 14 tiles.
    whole = _gather_plan.KV_KEYS_WHOLE
    for n, size, plans in ((455, 72, ((27, 4), (27, 4))), (384, 128, ((14, 1), (27, 4)))):
        shape = (1, n * size, 12, 128)
        for w, (CH, R) in zip((0, whole), plans):
            p = _gather_plan.plan(shape, shape, jnp.bfloat16, 27, size, run=3, whole=w)
            assert (p.CH, p.R, p.n_qc % p.R) == (CH, R, 0) and p.vmem_fwd <= 100 * 2**20
    assert _gather_plan.kv_chunk(64, 63, 2304) == 32 and _gather_plan.kv_chunk(512, 27, 256) == 1
    q = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
    tiles = jax.ShapeDtypeStruct((1, 2, 4, 2), jnp.int32)
    valid = jax.ShapeDtypeStruct((64,), jnp.bool_)
    tpu = kernels.PallasTpu(interpret=True)

    def kernel_names():
        f = lambda q, t, m: tpu.sparse_fwd(q, q, q, t, m, tile_size=16, scale=1.0)
        text = str(jax.make_jaxpr(f)(q, tiles, valid))
        return {name for name in ("vidax_tile_gather_fwd", "vidax_vsa_fine_fwd") if name in text}

    assert kernel_names() == {"vidax_tile_gather_fwd"} and _gather_plan.fits(q, q, tiles, 16)
    monkeypatch.setattr(_gather_plan, "VMEM_BUDGET", 1024)
    assert kernel_names() == {"vidax_vsa_fine_fwd"} and not _gather_plan.fits(q, q, tiles, 16)


# -- sliding tile attention -----------------------------------------------------------------


def test_tile_table_matches_mask():
    """Each query tile's row lists exactly the key tiles its window sees, in runs of
    `window_w` consecutive tiles; a mask with text is refused."""
    tm = kernels.SlidingTileMask((5, 6, 14), (2, 2, 3), ((3, 1, 3), (1, 3, 5)))
    dense = oracle.sliding_tile_of(tm)
    T, n = tm.tile_size, math.prod(tm.tiles)
    for head in (0, 1):
        table, run = _sliding.tile_table(tm, head)
        assert run == tm.windows[head][2] and table.shape == (n, math.prod(tm.windows[head]))
        runs = table.reshape(n, -1, run)
        assert np.all(np.diff(runs, axis=-1) == 1)
        seen = dense[head].reshape(n, T, n, T).any(axis=(1, 3))
        for i in range(n):
            assert sorted(table[i].tolist()) == np.flatnonzero(seen[i]).tolist()
    with pytest.raises(ValueError, match="without text"):
        _sliding.tile_table(kernels.SlidingTileMask((2, 2, 2), (1, 1, 1), (1, 1, 1), text_len=4))


SLIDING = [
    # Ragged along every dimension (tiles of 6 tokens, padded to 8), GQA, a shared
    # window whose runs of 3 key tiles are the chunks (sliced from the resident K/V).
    pytest.param(kernels.SlidingTileMask((3, 3, 8), (1, 2, 3), (3, 1, 3)), 2, 1, id="shared-ragged-runs"),
    # Per-head windows: two calls, each over query heads of both kv heads (groups split).
    pytest.param(kernels.SlidingTileMask((2, 4, 5), (1, 2, 2), ((1, 3, 1), (3, 1, 3), (1, 3, 1), (3, 1, 3))),
                 4, 2, id="per-head-windows"),
]


@pytest.mark.parametrize("tm, heads, kv_heads", SLIDING)
def test_sliding_tile_against_oracle(tm, heads, kv_heads):
    rng = np.random.default_rng(tm.video_len)
    S = tm.video_len
    q, q64 = harness.rounded(rng, (1, S, heads, 8))
    k, k64 = harness.rounded(rng, (1, S, kv_heads, 8))
    v, v64 = harness.rounded(rng, (1, S, kv_heads, 8))
    dout, dout64 = harness.rounded(rng, (1, S, heads, 8))
    dlse = harness.normal(rng, (1, heads, S))
    dense = oracle.sliding_tile_of(tm)
    mask = dense[0] if len(dense) == 1 else dense[None]
    ref = oracle.attention(q64, k64, v64, mask=mask, dout=dout64, dlse=dlse)
    groups = _sliding.window_groups(tm, heads, kv_heads)
    assert [g.run for g in groups] == ([3] if tm.heads is None else [1, 3])

    @jax.jit
    def run(q, k, v, dout, dlse):
        f = lambda q, k, v: _sliding.sliding_tile_attention(q, k, v, tm, interpret=True)
        (out, lse), vjp = jax.vjp(f, q, k, v)
        return out, lse, vjp((dout, dlse))

    out, lse, grads = run(q, k, v, dout, jnp.asarray(dlse))
    _check(out, lse, grads, ref, np.float32)
