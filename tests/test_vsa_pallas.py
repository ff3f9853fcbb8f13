"""Video sparse attention on `"pallas_tpu"`, in Pallas interpret mode on CPU: the
per-tile block-sparse Mosaic kernels of VSA's fine stage (`kernels/pallas_tpu/_per_tile.py`,
which `PallasTpu` runs when the tile-gathering kernels' resident arrays do not fit), and
the public function through `PallasTpu`, which runs the tile-gathering kernels
(`kernels/pallas_tpu/_gather.py`, tested on their own in `test_tile_gather_pallas.py`).

Against the float64 oracle (`oracle.attention` with the dense token mask that a tile
table means, built here from the documented semantics):

- the per-tile fine stage (`_per_tile.sparse_fwd` / `sparse_bwd`): out, lse and the
  gradients of q, k, v with a random cotangent on out and on lse, with GQA, unused
  (-1) slots, a row that sees nothing (every slot -1), a query tile whose selected
  key tiles hold only padding keys, padded keys, in float32 and bfloat16;
- the public `video_sparse_attention(..., implementation=PallasTpu(interpret=True))`
  on a grid with partial tiles, GQA and a gate, in tiles of 12 tokens (not a multiple
  of 8: padded per tile in the kernel), the query tiles in 3 calls' worth of chunks
  (a small SMEM budget): out and the gradients of q, k, v and gate against a float64 VSA oracle written here (coarse means, coarse softmax,
  top-k, the fine stage and its gradients through `oracle.attention` twice);
- the dK/dV pass's sorted table, and the refusals (float64; a table too large for
  SMEM).

The lowering for TPU at Wan 480p is in `tests/test_cross_lowering.py`.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
from vidax_eqx import kernels
from vidax_eqx.kernels import _vsa
from vidax_eqx.kernels.pallas_tpu import _gather_plan, _per_tile
from vidax_eqx.kernels._base import Request


TPU = kernels.PallasTpu(interpret=True)


def _empty_to_inf(lse) -> np.ndarray:
    """The contract's empty lse (the finite `masked` sentinel or -inf) as -inf."""
    lse = np.asarray(lse, np.float64)
    return np.where(lse <= np.finfo(np.float32).min, -np.inf, lse)


def _dense_mask(tiles: np.ndarray, kv_valid: np.ndarray, T: int) -> np.ndarray:
    """The token mask of a tile table: bool `(B, H, nq*T, nk*T)`; query token `i`
    sees key `j` iff `j`'s tile is listed for `i`'s tile (per head) and `j` is real."""
    B, H, nq, _ = tiles.shape
    nk = kv_valid.shape[0] // T
    hit = np.zeros((B, H, nq, nk), bool)
    for b, h, i, s in np.ndindex(tiles.shape):
        if tiles[b, h, i, s] >= 0:
            hit[b, h, i, tiles[b, h, i, s]] = True
    tokens = np.repeat(np.repeat(hit, T, axis=2), T, axis=3)
    return tokens & kv_valid[None, None, None, :]


# -- the fine stage -----------------------------------------------------------------------

# B=2, H=4 query heads over 2 kv heads, D=16, 5 query and 6 key tiles of 8 tokens, 3 slots.
B, H, K, D, T, NQ, NK, NSEL = 2, 4, 2, 16, 8, 5, 6, 3


def _fine_case(T: int, dtype, seed: int):
    """Inputs, the table (with -1 slots, an empty row, a padding-only key tile), and the
    oracle's result on the inputs as rounded to `dtype`."""
    rng = np.random.default_rng(seed)
    S_q, S_k = NQ * T, NK * T
    q, q64 = harness.rounded(rng, (B, S_q, H, D), dtype)
    k, k64 = harness.rounded(rng, (B, S_k, K, D), dtype)
    v, v64 = harness.rounded(rng, (B, S_k, K, D), dtype)
    dout, dout64 = harness.rounded(rng, (B, S_q, H, D), dtype)
    dlse = harness.normal(rng, (B, H, S_q))
    tiles = np.stack([rng.permutation(NK)[:NSEL] for _ in range(B * H * NQ)]).reshape(B, H, NQ, NSEL)
    tiles[0, 0, 1, 1:] = -1  # unused slots
    tiles[1, 3, 0, 0] = -1  # an unused slot before used ones
    tiles[0, 1, 2, :] = -1  # a row that sees nothing
    tiles[1, 2, 4] = [NK - 1, -1, -1]  # only the last key tile, which is all padding
    kv_valid = np.ones(S_k, bool)
    kv_valid[(NK - 1) * T:] = False  # the last key tile: padding only
    kv_valid[T + 1: T + 3] = False  # and two padding keys inside tile 1
    tiles = tiles.astype(np.int32)
    scale = 0.7 / math.sqrt(D)
    ref = oracle.attention(q64, k64, v64, mask=_dense_mask(tiles, kv_valid, T), scale=scale,
                           dout=dout64, dlse=dlse)
    arrays = dict(q=q, k=k, v=v, tiles=jax.device_put(tiles), kv_valid=jax.device_put(kv_valid),
                  dout=dout, dlse=jax.device_put(dlse))
    return arrays, scale, ref


@functools.partial(jax.jit, static_argnames=("T", "scale", "smem"))
def _fine(q, k, v, tiles, kv_valid, dout, dlse, *, T, scale, smem):
    del smem  # a static argument only: a program per SMEM budget
    kw = dict(tile_size=T, scale=scale, interpret=True)
    out, lse = _per_tile.sparse_fwd(q, k, v, tiles, kv_valid, **kw)
    grads = _per_tile.sparse_bwd(q, k, v, tiles, kv_valid, out, lse, dout, dlse, **kw)
    return out, lse, grads


# An SMEM budget that splits the 5 query tiles into 3 chunks of 2 (the last padded):
# room for (36 / 2 - 6 key tiles) // (2 heads x 3 slots) = 2 query tiles per call.
SMALL_SMEM = 2 * (NK + 2 * (H // K) * NSEL)


@pytest.mark.parametrize(
    "T, dtype, smem",
    [(8, jnp.float32, None), (8, jnp.bfloat16, SMALL_SMEM)],
    ids=["float32", "bfloat16-chunked"],
)
def test_fine_stage_against_oracle(T, dtype, smem, monkeypatch):
    if smem is not None:
        monkeypatch.setattr(_per_tile, "_SMEM_ENTRIES", smem)
        assert _per_tile._chunks(NQ, NK, (H // K) * NSEL) == (3, 2)
    a, scale, ref = _fine_case(T, dtype, seed=T)
    out, lse, (dq, dk, dv) = _fine(**a, T=T, scale=scale, smem=smem)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype,) * 3
    oracle.assert_close(out, ref.out, dtype, "out")
    oracle.assert_close(_empty_to_inf(lse), ref.lse, np.float32 if dtype == jnp.float32 else dtype, "lse")
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        oracle.assert_close(got, getattr(ref, name), dtype, name)
    # The empty row and the padding-only one: output 0, lse empty, dq 0; the
    # padding keys get no gradient.
    rows = np.s_[2 * T: 3 * T]
    assert np.all(np.asarray(out[0, rows, 1]) == 0) and np.all(np.asarray(dq[0, rows, 1]) == 0)
    assert np.all(np.isneginf(_empty_to_inf(lse[1, 2, 4 * T:])))
    assert not np.any(np.asarray(dk[:, (NK - 1) * T:], np.float32))
    assert not np.any(np.asarray(dv[:, (NK - 1) * T:], np.float32))


def test_sorted_table():
    """The dK/dV pass's table: every used `(head, query tile, slot)` once, one entry per
    key tile, sorted by key tile, unused slots last; skipped entries fetch the block
    of the last used entry before them."""
    tiles = np.array([[[[2, 0], [-1, -1], [0, -1]], [[1, 2], [2, -1], [-1, 1]]]], np.int32)  # (1, 2, 3, 2)
    n_q, n_k = 3, 4
    rows, cols = (np.asarray(x) for x in _per_tile._sorted_table(jnp.asarray(tiles), n_q, n_k))
    assert rows.shape == cols.shape == (1, 2 * 3 * 2 + n_k)
    assert np.all(np.diff(cols[0]) >= 0)
    used = sorted(zip(cols[0][rows[0] >= 0].tolist(), rows[0][rows[0] >= 0].tolist()))
    expected = sorted((int(t), g * n_q + i) for g, i, s in np.ndindex(2, 3, 2) if (t := tiles[0, g, i, s]) >= 0)
    assert used == expected
    assert set(cols[0]) == set(range(n_k + 1))  # every key tile, and the unused tail
    # A skipped entry fetches the previous used entry's query block (0 before any).
    for e in np.flatnonzero(rows[0] < 0):
        before = np.flatnonzero(rows[0][:e] >= 0)
        assert -rows[0][e] - 1 == (rows[0][before[-1]] if len(before) else 0)


def test_refusals():
    """float64 is not served (Mosaic has none); a query tile whose tables alone exceed
    the SMEM budget raises naming it and the way out."""
    q = jax.ShapeDtypeStruct((1, 16, 1, 8), jnp.float32)
    tiles = jax.ShapeDtypeStruct((1, 1, 2, 1), jnp.int32)
    valid = jax.ShapeDtypeStruct((16,), jnp.bool_)
    request = Request.sparse(q, q, platform="tpu")
    assert TPU.unsupported(request) == []
    f64_request = Request.sparse(jax.ShapeDtypeStruct((1, 16, 1, 8), np.float64), q, platform="tpu")
    assert any("float64" in m for m in TPU.unsupported(f64_request))
    n_q = 1 << 16  # key tiles alone fill the dK/dV tables' budget
    big_q = jax.ShapeDtypeStruct((1, n_q * 8, 1, 8), jnp.float32)
    big_tiles = jax.ShapeDtypeStruct((1, 1, n_q, 1), jnp.int32)
    big_valid = jax.ShapeDtypeStruct((n_q * 8,), jnp.bool_)
    with pytest.raises(NotImplementedError, match="pallas_tpu.*SMEM.*blockwise"):
        jax.eval_shape(lambda q, t, m: TPU.sparse_fwd(q, q, q, t, m, tile_size=8, scale=1.0),
                       big_q, big_tiles, big_valid)
    jax.eval_shape(lambda q, t, m: TPU.sparse_fwd(q, q, q, t, m, tile_size=8, scale=1.0), q, tiles, valid)


# -- the public function ------------------------------------------------------------------

GRID, TILE, TOPK = (3, 5, 6), (2, 2, 3), 4  # 2 x 3 x 2 tiles of 12 tokens, partial along F and H


def test_video_sparse_attention_against_oracle(monkeypatch):
    """The public function with the Pallas TPU fine stage (interpret mode: the
    tile-gathering kernels): out, the fine stage's lse and the gradients of q, k, v and
    gate (random cotangents on out and lse), GQA, partial tiles (12-token tiles: padded
    to 16 in the kernel), the 12 query tiles in 3 chunks of 4 (a small SMEM budget),
    against the float64 VSA oracle (`oracle.video_sparse_attention`)."""
    S = _vsa.VsaLayout(GRID, TILE).video_len
    monkeypatch.setattr(_gather_plan, "SMEM_ENTRIES", 48)
    p = _gather_plan.plan((1, S, 4, 8), (1, S, 2, 8), jnp.float32, TOPK, 12)
    assert (p.T, p.C, p.n_qc) == (16, 3, 4)
    rng = np.random.default_rng(1)  # a seed whose top-k margin is clear (1.2e-3)
    q, q64 = harness.rounded(rng, (1, S, 4, 8))
    k, k64 = harness.rounded(rng, (1, S, 2, 8))
    v, v64 = harness.rounded(rng, (1, S, 2, 8))
    gate, gate64 = harness.rounded(rng, (1, S, 4, 8))
    dout, dout64 = harness.rounded(rng, (1, S, 4, 8))
    dlse = harness.normal(rng, (1, 4, S))
    ref = oracle.video_sparse_attention(q64, k64, v64, GRID, TILE, TOPK, gate64, dout=dout64, dlse=dlse)
    assert ref.margin > 1e-4  # float32 scores cannot select differently from float64

    def f(q, k, v, gate):
        return kernels.video_sparse_attention(q, k, v, GRID, topk=TOPK, tile=TILE, gate=gate,
                                              return_lse=True, implementation=TPU)

    @jax.jit
    def forward_and_vjp(q, k, v, gate, dout, dlse):  # one program
        (out, lse), vjp = jax.vjp(f, q, k, v, gate)
        return out, lse, vjp((dout, jnp.where(jnp.isfinite(lse), dlse, 0.0)))

    out, lse, grads = forward_and_vjp(q, k, v, gate, dout, jax.device_put(dlse))
    oracle.assert_close(out, ref.out, np.float32, "out")
    oracle.assert_close(lse, ref.lse, np.float32, "lse")
    for name, got in zip(("dq", "dk", "dv", "dgate"), grads):
        oracle.assert_close(got, getattr(ref, name), np.float32, name)
