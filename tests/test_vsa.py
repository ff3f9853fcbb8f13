"""`kernels.video_sparse_attention` (VSA) on one device against the float64 oracle
(`oracle.video_sparse_attention`): forward, fine-stage lse and the gradients in q, k,
v and gate, for partial tiles, GQA, several `topk` / `sparsity`, with and without a
gate, the "xla" and "blockwise" fine stages, float32 and bfloat16; padding tokens,
determinism, jit / filter_jit, the selection itself, and every bad input.

Selection: the kernel picks tiles with `lax.top_k` on float32 coarse scores, the
oracle on float64 ones; inputs are drawn (seed after seed) until the gap between the
`topk`-th and the next coarse score is > 1e-3 in every row, and the kernel's own
selection (`kernels._vsa` package API) is asserted equal to the oracle's.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
from vidax_eqx.kernels import _vsa
from vidax_eqx.kernels import video_sparse_attention


GRID, TILE = (3, 5, 6), (2, 2, 4)  # partial tiles along every dimension
REAL, TILE_OF, COUNTS = oracle.vsa_layout(GRID, TILE)
S, N_TILES, T = len(REAL), len(COUNTS), int(np.prod(TILE))  # 192 slots, 12 tiles of 16
B, H, D = 2, 4, 8
MARGIN = 1e-3

# name: (K, topk, sparsity, gate, dtype, scale)
CASES = {
    "gqa_top3_gate": (2, 3, None, True, jnp.float32, None),
    "mqa_top1_scale": (1, 1, None, False, jnp.float32, 0.3),
    "mha_all_tiles_gate": (4, N_TILES, None, True, jnp.float32, None),
    "gqa_sparsity": (2, None, 0.6, False, jnp.float32, None),  # ceil(0.4 * 12) = 5 tiles
    "gqa_top3_gate_bf16": (2, 3, None, True, jnp.bfloat16, None),
}


def _tile_structured(rng, shape, dtype):
    """Normal values plus a per-tile component (constant over a tile's tokens), so that
    the coarse scores are spread and their ranking is far from ties."""
    per_tile = rng.standard_normal((shape[0], N_TILES) + shape[2:])
    x = rng.standard_normal(shape) + 1.5 * per_tile[:, TILE_OF]
    x = x.astype(dtype)
    return x, oracle.f64(x.astype(np.float32))


@functools.cache
def inputs(K, n_sel, dtype, scale):
    """Inputs whose float64 coarse ranking has a margin > MARGIN at `n_sel`, as
    `(jax arrays, float64 NumPy arrays)` of `q, k, v, gate, dout, dlse`."""
    dt = jnp.dtype(dtype)
    for seed in range(100):
        rng = np.random.default_rng(seed)
        q, q64 = _tile_structured(rng, (B, S, H, D), dt)
        k, k64 = _tile_structured(rng, (B, S, K, D), dt)
        v, v64 = (lambda x: (x, oracle.f64(x.astype(np.float32))))(harness.normal(rng, (B, S, K, D), dt))
        gate = harness.normal(rng, (B, S, H, D), dt)
        dout = harness.normal(rng, (B, S, H, D), dt)
        dlse = harness.normal(rng, (B, H, S), np.float32)
        ref = oracle.video_sparse_attention(q64, k64, v64, GRID, TILE, n_sel, scale=scale)
        if ref.margin > MARGIN:
            host = (q, k, v, gate, dout, dlse)
            ref64 = (q64, k64, v64, oracle.f64(gate.astype(np.float32)),
                     oracle.f64(dout.astype(np.float32)), oracle.f64(dlse))
            return tuple(jax.device_put(x) for x in host), ref64
    raise AssertionError("no inputs with a clear top-k margin")


@functools.cache
def compiled(implementation, K, topk, sparsity, gated, dtype, scale):
    """One jitted VJP per case: `(q, k, v, gate, (dout, dlse)) -> ((out, lse), grads)`."""

    def fn(q, k, v, gate):
        return video_sparse_attention(
            q, k, v, GRID, topk=topk, sparsity=sparsity, tile=TILE,
            gate=gate if gated else None, scale=scale, return_lse=True,
            implementation=implementation,
        )

    return harness.vjp(fn, compiler_options=harness.FAST_COMPILE)


@functools.cache
def reference(name):
    K, topk, sparsity, gated, dtype, scale = CASES[name]
    n_sel = oracle.vsa_topk(N_TILES, topk, sparsity)
    arrays, (q, k, v, gate, dout, dlse) = inputs(K, n_sel, dtype, scale)
    ref = oracle.video_sparse_attention(
        q, k, v, GRID, TILE, n_sel, gate if gated else None, scale, dout=dout, dlse=dlse
    )
    return arrays, ref


def _assert_padding_zero(name, x):
    x = np.asarray(x.astype(jnp.float32))
    assert np.all(x[:, ~REAL] == 0), f"{name} nonzero on padding tokens"


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
@pytest.mark.parametrize("name", list(CASES))
def test_against_oracle(name, implementation):
    K, topk, sparsity, gated, dtype, scale = CASES[name]
    (q, k, v, gate, dout, dlse), ref = reference(name)
    f = compiled(implementation, K, topk, sparsity, gated, jnp.dtype(dtype).name, scale)
    (out, lse), (dq, dk, dv, dgate) = f(q, k, v, gate, (dout, dlse))
    assert out.dtype == dtype and out.shape == (B, S, H, D)
    assert lse.dtype == jnp.float32 and lse.shape == (B, H, S)

    oracle.assert_close(out, ref.out, dtype, "out")
    lse = np.asarray(lse)
    oracle.assert_close(lse[:, :, REAL], ref.lse[:, :, REAL], dtype, "lse")
    assert np.all(lse[:, :, ~REAL] == -np.inf), "lse of padding tokens"
    for g, r, n in [(dq, ref.dq, "dq"), (dk, ref.dk, "dk"), (dv, ref.dv, "dv")]:
        oracle.assert_close(g, r, dtype, n)
    if gated:
        oracle.assert_close(dgate, ref.dgate, dtype, "dgate")
    else:
        assert not np.any(np.asarray(dgate.astype(jnp.float32))), "an unused gate got a gradient"
    for n, x in [("out", out), ("dq", dq), ("dk", dk), ("dv", dv), ("dgate", dgate)]:
        _assert_padding_zero(n, x)

    # determinism: the same program twice, bit for bit
    (out2, lse2), grads2 = f(q, k, v, gate, (dout, dlse))
    for a, b_, n in zip((out, lse, dq, dk, dv, dgate), (out2, lse2, *grads2),
                        ("out", "lse", "dq", "dk", "dv", "dgate")):
        assert np.array_equal(np.asarray(a), np.asarray(b_)), f"{n} differs between two runs"


@functools.cache
def _selection_fn(n_sel, scale):
    def select(q, k, v):
        valid = REAL
        q_c, k_c, v_c = (_vsa.tile_means(x, valid, T) for x in (q, k, v))
        s = 1.0 / np.sqrt(D) if scale is None else scale
        _, scores = _vsa.coarse_attention(q_c, k_c, v_c, COUNTS, s)
        return _vsa.select_tiles(scores, n_sel)

    return jax.jit(select, compiler_options=harness.FAST_COMPILE)


@pytest.mark.parametrize("name", list(CASES))
def test_selection_matches_oracle(name):
    """The kernel's selected tiles (as sets) are the oracle's, on inputs with a clear
    margin; the oracle's selection is what the forward above was checked with."""
    K, topk, sparsity, gated, dtype, scale = CASES[name]
    (q, k, v, *_), ref = reference(name)
    n_sel = oracle.vsa_topk(N_TILES, topk, sparsity)
    got = np.asarray(_selection_fn(n_sel, scale)(q, k, v))
    assert got.shape == (B, H, N_TILES, n_sel) == ref.selected.shape
    assert np.array_equal(np.sort(got, axis=-1), np.sort(ref.selected, axis=-1))
    if n_sel < N_TILES:  # the selection differs across heads / batch rows
        assert len({tuple(np.sort(r)) for r in got.reshape(-1, n_sel)}) > 1


def test_filter_jit_default_call():
    """`eqx.filter_jit`, default arguments (`return_lse=False`, implementation "auto",
    default scale), a sparsity and no gate."""
    (q, k, v, *_), (q64, k64, v64, *_) = inputs(2, 5, "float32", None)
    f = eqx.filter_jit(lambda q, k, v: video_sparse_attention(q, k, v, GRID, sparsity=0.6, tile=TILE))
    out = f(q, k, v)
    ref = oracle.video_sparse_attention(q64, k64, v64, GRID, TILE, sparsity=0.6)
    assert ref.selected.shape[-1] == 5
    oracle.assert_close(out, ref.out, np.float32, "out")
    _assert_padding_zero("out", out)


def test_layout_and_topk_rule():
    """The package's layout (`_vsa.VsaLayout`) is the oracle's enumeration; `sparsity`
    gives `ceil((1 - sparsity) * n_tiles)` key tiles (at least one)."""
    layout = _vsa.VsaLayout(GRID, TILE)
    assert (layout.n_tiles, layout.tile_size, layout.video_len) == (N_TILES, T, S)
    assert np.array_equal(layout.token_valid(), REAL)
    assert np.array_equal(layout.tile_counts(), COUNTS)
    for sparsity, expected in [(0.0, 12), (0.5, 6), (0.6, 5), (0.75, 3), (0.95, 1), (0.999, 1)]:
        assert layout.topk(None, sparsity) == oracle.vsa_topk(N_TILES, sparsity=sparsity) == expected
    assert layout.topk(N_TILES, None) == N_TILES


# -- the oracle itself --------------------------------------------------------------------


def test_oracle_gradients_by_finite_differences():
    grid, tile = (3, 3, 2), (2, 2, 2)  # 2 x 2 x 1 = 4 tiles of 8, partial
    real, _, counts = oracle.vsa_layout(grid, tile)
    n = len(real)
    rng = np.random.default_rng(3)
    q, gate, dout = (rng.standard_normal((1, n, 2, 4)) for _ in range(3))
    k, v = (rng.standard_normal((1, n, 1, 4)) for _ in range(2))
    dlse = rng.standard_normal((1, 2, n))
    ref = oracle.video_sparse_attention(q, k, v, grid, tile, 2, gate, dout=dout, dlse=dlse)
    assert ref.margin > 1e-4

    def loss(p):
        r = oracle.video_sparse_attention(*p[:3], grid, tile, 2, p[3], tiles=ref.selected)
        return np.sum(r.out * dout) + np.sum(np.where(np.isfinite(r.lse), r.lse * dlse, 0.0))

    harness.check_grads_fd(loss, [q, k, v, gate], [ref.dq, ref.dk, ref.dv, ref.dgate],
                           ["dq", "dk", "dv", "dgate"], seed=4)


def test_oracle_by_enumeration():
    """The oracle's coarse output and selection against loops over tiles and tokens,
    and, with every tile selected and a zero gate, plain attention over the real tokens."""
    grid, tile = (3, 3, 2), (2, 2, 2)
    coords, real = oracle.video_layout(grid, tile)
    n = len(real)
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, n, 1, 4)) for _ in range(3))
    ref = oracle.video_sparse_attention(q, k, v, grid, tile, 2)
    # tile of each real token from its grid coordinates
    tiles_per = [oracle.ceil_div(g, t) for g, t in zip(grid, tile)]
    t_of = [int(np.ravel_multi_index(tuple(c // np.asarray(tile)), tiles_per)) for c in coords]
    means = {x: np.stack([np.mean([xx[0, i, 0] for i in range(n) if real[i] and t_of[i] == t], axis=0)
                          for t in range(4)]) for x, xx in (("q", q), ("k", k), ("v", v))}
    s = means["q"] @ means["k"].T / 2.0
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(ref.out_c[0, :, 0], p @ means["v"], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ref.scores[0, 0], s, rtol=1e-12)
    for t in range(4):
        assert set(ref.selected[0, 0, t]) == set(np.argsort(-s[t])[:2])

    full = oracle.video_sparse_attention(q, k, v, grid, tile, 4, np.zeros_like(q))
    plain = oracle.attention(q, k, v, mask=np.outer(real, real))
    np.testing.assert_allclose(full.out[0, real], plain.out[0, real], rtol=1e-12, atol=1e-12)
    assert np.all(full.out[0, ~real] == 0)


# -- bad input ----------------------------------------------------------------------------


def _z(*shape):
    return np.zeros(shape, np.float32)


Q, KV = _z(1, S, 4, 8), _z(1, S, 2, 8)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(topk=0), r"`topk`.*\[1, 12\].*received 0"),
        (dict(topk=N_TILES + 1), r"`topk`.*\[1, 12\].*received 13"),
        (dict(topk=2.0), r"`topk`.*received 2\.0"),
        (dict(sparsity=-0.1), r"`sparsity`.*\[0, 1\).*received -0\.1"),
        (dict(sparsity=1.0), r"`sparsity`.*\[0, 1\).*received 1\.0"),
        (dict(topk=3, sparsity=0.5), r"exactly one of `topk`.*`sparsity`"),
        (dict(), r"exactly one of `topk`.*`sparsity`"),
        (dict(topk=3, gate=_z(1, S, 4, 4)), r"`gate`.*\(1, 192, 4, 8\).*\(1, 192, 4, 4\)"),
        (dict(topk=3, gate=_z(1, S, 2, 8)), r"`gate`"),
        (dict(topk=3, tile=(2, 0, 4)), r"`tile`.*received \(2, 0, 4\)"),
        (dict(topk=3, grid=(5, 5, 6)), r"`grid`.*S = 288.*received"),
        (dict(topk=3, grid=(3, 5, 0)), r"`grid`.*received \(3, 5, 0\)"),
        (dict(topk=3, q=_z(1, S, 3, 8)), r"multiple of the number of key/value heads"),
        (dict(topk=3, q=_z(1, S - 16, 4, 8), k=_z(1, S - 16, 2, 8), v=_z(1, S - 16, 2, 8)),
         r"`grid`.*S = 192"),
    ],
)
def test_bad_input(kwargs, match):
    kwargs = dict(kwargs)
    q, k, v = kwargs.pop("q", Q), kwargs.pop("k", KV), kwargs.pop("v", KV)
    grid = kwargs.pop("grid", GRID)
    kwargs.setdefault("tile", TILE)
    with pytest.raises(ValueError, match=match):
        video_sparse_attention(q, k, v, grid, **kwargs)
