"""`parallel.video_sparse_attention`: VSA under Ulysses, ring (contiguous, zigzag) and USP.

On the 8 simulated devices, forward and the gradients of q, k, v and gate (a random
cotangent) against the float64 oracle (`oracle.video_sparse_attention`), on a video
grid with partial tiles whose tile count needs empty padding tiles for every device
count used, with GQA and several `topk` (one as a `sparsity`); one mode without a
gate. The ring's run-time skip: a selection that touches only each device's own
tiles gives the oracle's result (every later step takes the skip branch), and the
compiled program holds the fine stage's matmuls inside `conditional`s whose other
branch has none. Every bad-input rule raises, naming the argument.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import oracle
from benchmarks import _hlo
from vidax_eqx import parallel


GRID, TILE = (3, 5, 6), (2, 2, 2)  # 2 x 3 x 3 = 18 tiles of 8 tokens, partial at two edges
B, H, H_KV, D = 1, 4, 2, 8


def _video_len() -> int:
    return math.prod(-(-g // t) for g, t in zip(GRID, TILE)) * math.prod(TILE)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(15)  # coarse scores of the topk used >= 5e-4 from a tie
    N = _video_len()
    return dict(
        q=harness.normal(rng, (B, N, H, D)), k=harness.normal(rng, (B, N, H_KV, D)),
        v=harness.normal(rng, (B, N, H_KV, D)), gate=harness.normal(rng, (B, N, H, D)),
        dout=harness.normal(rng, (B, N, H, D)),
    )


def _axes(U: int, R: int):
    """`(mesh, ulysses_axis, ring_axis, spec)`: ring-major over both axes for USP."""
    if U > 1 and R > 1:
        return harness.mesh(sp=U, ring=R), "sp", "ring", P(None, ("ring", "sp"))
    mesh = harness.mesh(sp=U * R)
    return mesh, ("sp" if U > 1 else None), ("sp" if R > 1 else None), P(None, "sp")


def _reference(a: dict, *, topk=None, sparsity=None, gated: bool = True):
    """The float64 oracle on the video's tokens (its selection away from ties, so that
    float32 selects the same tiles)."""
    ref = oracle.video_sparse_attention(
        a["q"], a["k"], a["v"], GRID, TILE, topk=topk, sparsity=sparsity,
        gate=a["gate"] if gated else None, dout=a["dout"],
    )
    assert ref.margin > 1e-4, ref.margin  # float32 scores err ~1e-6
    return ref


def _sharded(a: dict, U: int, R: int, layout: str, *, topk=None, sparsity=None,
             gated: bool = True, hlo: bool = False):
    """The sharded VJP on the padded (and, for zigzag, permuted) global arrays; returns
    `dict(out, dq, dk, dv, dgate)` on the video's tokens, in global order (and the
    compiled program's HLO text with `hlo=True`)."""
    mesh, ua, ra, spec = _axes(U, R)
    zz = R if layout == "zigzag" else 0

    def to(x):
        x = parallel.vsa_pad(jnp.asarray(x), GRID, TILE, ulysses_size=U, ring_size=R,
                             layout=layout)
        return harness.zigzag(x, zz)

    def back(x):
        return np.asarray(parallel.vsa_unpad(harness.unzigzag(x, zz), GRID, TILE))

    def local(q, k, v, gate):
        return parallel.video_sparse_attention(
            q, k, v, GRID, ulysses_axis=ua, ring_axis=ra, layout=layout, topk=topk,
            sparsity=sparsity, tile=TILE, gate=gate,
        )

    run = harness.sharded_vjp(local, mesh, (spec, spec, spec, spec if gated else None), spec,
                              (0, 1, 2, 3) if gated else (0, 1, 2),
                              compiler_options=harness.FAST_COMPILE)
    args = (to(a["q"]), to(a["k"]), to(a["v"]), to(a["gate"]) if gated else None, to(a["dout"]))
    compiled = run.lower(*args).compile(harness.FAST_COMPILE)
    out, grads = compiled(*args)
    names = ("dq", "dk", "dv", "dgate")[: len(grads)]
    got = dict(out=back(out), **{n: back(g) for n, g in zip(names, grads)})
    return (got, compiled.as_text()) if hlo else got


CASES = {
    # (U, R, layout, topk, sparsity, gated): padding tiles in every case (18 tiles of the
    # video, padded to 20 for 4 devices, 24 for a zigzag ring of 4).
    "ulysses4": (4, 1, "contiguous", 3, None, True),
    "ring4": (1, 4, "contiguous", 5, None, True),
    "ring4_zigzag": (1, 4, "zigzag", None, 0.6, True),  # topk = ceil(0.4 * 18) = 8
    "usp2x2": (2, 2, "contiguous", 2, None, False),
    "usp2x4_zigzag": (2, 4, "zigzag", 3, None, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_oracle(data, case):
    U, R, layout, topk, sparsity, gated = CASES[case]
    got = _sharded(data, U, R, layout, topk=topk, sparsity=sparsity, gated=gated)
    ref = _reference(data, topk=topk, sparsity=sparsity, gated=gated)
    harness.assert_matches(got, ref, np.float32, tuple(got))


# -- the ring's run-time skip ------------------------------------------------------------


@pytest.fixture(scope="module")
def local_selection():
    """Inputs whose coarse top-1 key tile of every query tile is itself: q and k of tile
    `j` are `3 u_j` plus a little noise (`u_j` random unit vectors), so on a ring every
    device's query tiles select only its own key tiles."""
    rng = np.random.default_rng(11)
    _, real = oracle.video_layout(GRID, TILE)
    T = math.prod(TILE)
    n = len(real) // T
    u = rng.standard_normal((n, D))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    base = np.repeat(3.0 * u, T, axis=0)[None, :, None, :]  # (1, N, 1, D)
    noise = lambda h: 0.05 * harness.normal(rng, (B, len(real), h, D))  # noqa: E731
    a = dict(q=(base + noise(H)).astype(np.float32), k=(base + noise(H_KV)).astype(np.float32),
             v=harness.normal(rng, (B, len(real), H_KV, D)),
             gate=harness.normal(rng, (B, len(real), H, D)),
             dout=harness.normal(rng, (B, len(real), H, D)))
    # The premise, in float64: each query tile's top-1 key tile is itself.
    ref = _reference(a, topk=1)
    assert (ref.selected[..., 0] == np.arange(n)).all()
    return a


def test_ring_skips_unselected_steps(local_selection):
    """Every step after the first selects nothing on any device: the result is still the
    oracle's (the skip branch keeps the accumulators), and the compiled forward and
    backward rings run the fine stage inside `conditional`s whose skip branch holds no
    matmul."""
    a = local_selection
    got, text = _sharded(a, 1, 4, "contiguous", topk=1, hlo=True)
    harness.assert_matches(got, _reference(a, topk=1), np.float32, tuple(got))
    module = _hlo.parse(text)
    conditionals = [i for instrs in module.computations.values() for i in instrs
                    if i.opcode == "conditional"]
    assert len(conditionals) == 4  # forward and backward: the loop's step and the last
    for cond in conditionals:
        names = [b.strip().lstrip("%") for b in
                 cond.rest.split("branch_computations={", 1)[1].split("}", 1)[0].split(",")]
        flops = sorted(_hlo.dot_flops(module._replace(entry=n))["flops"] for n in names)
        assert flops[0] == 0 and flops[-1] > 0, flops


# -- padding helpers and bad input -------------------------------------------------------


def test_padded_length():
    N = _video_len()  # 144 = 18 tiles of 8
    assert parallel.vsa_padded_length(GRID, TILE) == N
    assert parallel.vsa_padded_length(GRID, TILE, ulysses_size=4) == 20 * 8
    assert parallel.vsa_padded_length(GRID, TILE, ring_size=4, layout="zigzag") == 24 * 8
    assert parallel.vsa_padded_length(GRID, TILE, ulysses_size=2, ring_size=4,
                                      layout="zigzag") == 24 * 8
    assert parallel.vsa_padded_length(GRID, TILE, ulysses_size=3, ring_size=2,
                                      layout="zigzag") == 24 * 8  # lcm(4, 6) = 12 tiles
    x = jnp.ones((1, N, 2))
    padded = parallel.vsa_pad(x, GRID, TILE, ring_size=4)
    assert padded.shape == (1, 160, 2) and float(padded[:, N:].sum()) == 0.0
    np.testing.assert_array_equal(parallel.vsa_unpad(padded, GRID, TILE), x)


def _trace(U, R, *, q_shape=None, kv_heads=H_KV, heads=H, gate="ok", **kwargs):
    """Traces one sharded call (no compile) on the padded shapes of `(U, R)`."""
    mesh, ua, ra, spec = _axes(U, R)
    kwargs = dict(dict(ulysses_axis=ua, ring_axis=ra, topk=2, tile=TILE), **kwargs)
    S = parallel.vsa_padded_length(GRID, TILE, ulysses_size=U, ring_size=R,
                                   layout=kwargs.get("layout", "contiguous"))
    q = jax.ShapeDtypeStruct(q_shape or (B, S, heads, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, q.shape[1], kv_heads, D), jnp.float32)
    g = {"ok": q, "none": None, "bad": jax.ShapeDtypeStruct((B, q.shape[1], heads, D + 1),
                                                           jnp.float32)}[gate]
    f = jax.shard_map(
        lambda q, k, v, g: parallel.video_sparse_attention(q, k, v, GRID, gate=g, **kwargs),
        mesh=mesh, in_specs=(spec, spec, spec, None if g is None else spec), out_specs=spec)
    return jax.eval_shape(f, q, kv, kv, g)


def test_traces():
    assert _trace(2, 2).shape == (B, 160, H, D)


@pytest.mark.parametrize("kwargs, match", [
    (dict(ring_axis="nope"), "Ring axis 'nope' does not exist"),
    (dict(ulysses_axis=None, ring_axis=None), "pass `ulysses_axis`, `ring_axis` or both"),
    (dict(ulysses_axis="sp", ring_axis="sp"), "two different mesh axes"),
    (dict(layout="spiral"), "`layout` must be one of"),
    (dict(topk=19), "`topk` must be an int in \\[1, 18\\]"),
    (dict(topk=None, sparsity=1.0), "`sparsity` must be a float in \\[0, 1\\)"),
    (dict(tile=(2, 0, 2)), "tile"),
    (dict(q_shape=(B, 144, H, D)), "S_local = 40; received S_local = 36"),
    (dict(gate="bad"), "`gate` must have q's shape"),
    (dict(heads=6, kv_heads=2, U=4, R=1), "multiple of the SP size"),
])
def test_bad_input(kwargs, match):
    U, R = kwargs.pop("U", 1), kwargs.pop("R", 4)
    with pytest.raises(ValueError, match=match):
        _trace(U, R, **kwargs)


def test_vsa_pad_bad_length():
    with pytest.raises(ValueError, match="`x` must hold the tile layout"):
        parallel.vsa_pad(jnp.ones((1, 100, 2)), GRID, TILE, ring_size=4)
