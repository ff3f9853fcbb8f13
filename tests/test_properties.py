"""Property-based tests: every kernel implementation and every sequence-parallel
path against the float64 oracle, over shapes and options drawn by hypothesis.

Properties, for every drawn request:

- the output, `lse` and the gradients of q, k, v, bias and sinks (by `jax.vjp`
  with a random cotangent, on `out` alone or on `(out, lse)`) agree with
  `oracle.attention` within the dtype's tolerance (`oracle.TOLERANCES`);
- nothing is NaN or infinite for finite inputs (except `lse = -inf` where the
  oracle's is);
- a query row that sees no key gives exactly 0 output, `lse = -inf` (without
  sinks) and exactly 0 `dq`; a key that no query sees gets exactly 0 `dk` and `dv`;
  a bias entry that masks only hidden pairs gets exactly 0 `dbias`.

Kernels (`IMPLEMENTATIONS`): B, S_q != S_k (sizes from a small set, so shapes and
hence compilations repeat), H, H_kv (GQA / MQA), D, float32 / bfloat16 / float16,
causal, windows with `None` sides and 0, soft cap, scale, custom positions,
segment ids (one array or a `SegmentIds` pair, with negative ids, rows that are
all padding and q segments absent from kv), bias and boolean masks of rank 2 / 3 /
4 with 1-sized axes, sinks. Parallel paths (Ulysses, joint Ulysses with a text
prefix, ring contiguous / zigzag with S_k = S_q or not, USP with and without a
text prefix) over 1, 2, 4 or 8 simulated devices, with or without a data-parallel
axis and `check_vma`, each step's kernel drawn from `IMPLEMENTATIONS`.

Hypothesis draws the configuration only (sizes, dtype, options, which layout of
segment ids, ...); the random inputs of a configuration come from a NumPy generator
seeded by the configuration itself. So every example is a new configuration (a
small budget is not spent on the same configuration with other random numbers),
failures shrink to the simplest configuration, and a configuration always sees
the same inputs. Example budgets come from the hypothesis profile
(`tests/_hypothesis.py`): `ci` by default (a fixed set of examples),
`VIDAX_HYPOTHESIS_PROFILE=sweep` for a long search.
"""

import dataclasses
import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, strategies as st
from jax.sharding import PartitionSpec as P

import harness
import oracle
from _hypothesis import examples
from vidax_eqx import kernels, parallel


# Hypothesis searches, a compilation per drawn configuration: ~90 s for the file.
pytestmark = pytest.mark.slow

# Kernel implementations under test; the parallel paths draw their per-step kernel
# from the same list. Small odd blocks make every drawn shape span several ragged
# tiles.
IMPLEMENTATIONS = [
    "xla",
    "blockwise",
    kernels.Blockwise(block_q=5, block_kv=7),
]


def _impl_id(impl) -> str:
    return impl if isinstance(impl, str) else f"{impl.name}{impl.block_q}x{impl.block_kv}"


DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
RING = "ring"
SP = parallel.SP_AXIS


# ---------------------------------------------------------------------------- strategies


window_sides = st.one_of(st.none(), st.sampled_from([0, 1, 3, 8, 40]))
windows = st.one_of(st.none(), st.tuples(window_sides, window_sides))
soft_caps = st.sampled_from([None, None, 1.0, 5.0])
dtypes = st.sampled_from(list(DTYPES))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _broadcast_shape(draw, full: tuple[int, ...]) -> tuple[int, ...]:
    """A shape of rank 2, 3 or 4 that broadcasts to `full` (rank 4), each axis full or 1."""
    rank = draw(st.sampled_from([2, 3, 4]))
    return tuple(n if draw(st.booleans()) else 1 for n in full[4 - rank:])


SEGMENT_LAYOUTS = ("runs", "random", "q_row_padding", "kv_row_padding", "absent_from_kv")


def _segment_ids(layout: str, B: int, S_q: int, S_k: int, shared: bool, rng):
    """Segment ids `(B, S_q)` and `(B, S_k)` (the same array when `shared`) of a layout:

    - `runs`: sorted runs of ids 0..2 and a padded (-1) tail;
    - `random`: ids drawn from -2..3 in any order (negative = padding);
    - `q_row_padding` / `kv_row_padding`: `random`, with the last batch row of q
      (or of kv, which leaves that row's queries nothing to see) all padding;
    - `absent_from_kv`: `random`, with q ids 4 that kv never has.
    """

    def draw(S):
        if layout == "runs":
            ids = np.sort(rng.integers(0, 3, (B, S)), axis=1)
            ids[:, S - S // 4:] = -1
            return ids.astype(np.int32)
        return rng.integers(-2, 4, (B, S)).astype(np.int32)

    seg_q = draw(S_q)
    seg_kv = seg_q if shared else draw(S_k)
    if layout == "q_row_padding":
        seg_q[-1] = -1
    elif layout == "kv_row_padding":
        seg_kv[-1] = -1
    elif layout == "absent_from_kv" and not shared:
        seg_q[:, ::3] = 4
    return seg_q, seg_kv


def _seed(problem) -> int:
    """The data seed of a problem: a function of its configuration, so hypothesis
    explores configurations (each draw is a new one) and shrinks them, while the
    random inputs of a configuration are always the same."""
    return zlib.crc32(repr(problem).encode())


@dataclasses.dataclass
class KernelProblem:
    B: int
    S_q: int
    S_k: int
    H: int
    H_kv: int
    D: int
    dtype: str
    causal: bool
    window: tuple | None
    scale: float | None
    soft_cap: float | None
    segments: str | None  # None | "shared" (one (B, S) array) | "split" (SegmentIds)
    seg_layout: str | None  # one of SEGMENT_LAYOUTS
    positions: str | None  # None | "offset" | "shifted" | "perm"
    bias: tuple | None  # shape
    mask: tuple | None  # shape
    mask_density: float
    sinks: bool
    through: str  # "attention" (cotangent on out) | "attention_fwd" (on out and lse)


SIZES = (5, 16, 33, 1, 300)  # the first is what shrinking goes to; 300 > the default blocks


@st.composite
def kernel_problems(draw):
    B = draw(st.sampled_from([1, 2]))
    S_q = draw(st.sampled_from(SIZES))
    segments = draw(st.sampled_from([None, "shared", "split"]))
    S_k = S_q if segments == "shared" else draw(st.sampled_from(SIZES))
    H_kv = draw(st.sampled_from([1, 2]))
    H = H_kv * draw(st.sampled_from([1, 2, 4]))
    full = (B, H, S_q, S_k)
    D = draw(st.sampled_from([4, 8, 64]))
    dtype = draw(dtypes)
    # Logit scales as multiples of the default 1 / sqrt(D). Low precision stays near
    # the default: all implementations round the logit gradient `ds` to the input
    # dtype before the dq / dk matmuls (as flash attention does), and a sharp
    # softmax (3x the default) can push bfloat16's dq error just past 2e-2 where a
    # row's terms cancel.
    multiples = [None, None, 0.5, 2.0, 4.0] if dtype == "float32" else [None, None, 0.5, 1.5]
    multiple = draw(st.sampled_from(multiples))
    return KernelProblem(
        B=B, S_q=S_q, S_k=S_k, H=H, H_kv=H_kv, D=D, dtype=dtype,
        causal=draw(st.booleans()),
        window=draw(windows),
        scale=None if multiple is None else multiple / math.sqrt(D),
        soft_cap=draw(soft_caps),
        segments=segments,
        seg_layout=draw(st.sampled_from(SEGMENT_LAYOUTS)) if segments else None,
        positions=draw(st.sampled_from([None, None, "offset", "shifted", "perm"])),
        bias=_broadcast_shape(draw, full) if draw(st.booleans()) else None,
        mask=_broadcast_shape(draw, full) if draw(st.booleans()) else None,
        mask_density=draw(st.sampled_from([0.2, 0.8])),
        sinks=draw(st.booleans()),
        through=draw(st.sampled_from(["attention", "attention_fwd"])),
    )


def _draw(rng, shape, dtype):
    """Standard normal values (`harness.normal`), rounded to `dtype` through float32 (the
    oracle sees the rounded values)."""
    return harness.normal(rng, shape).astype(dtype)


def _positions(kind, S_q, S_k, rng):
    if kind == "offset":  # bottom-right aligned queries
        return np.arange(S_q, dtype=np.int32) + max(S_k - S_q, 0), np.arange(S_k, dtype=np.int32)
    if kind == "shifted":  # keys start at 4: causal hides every key from queries 0..3
        return np.arange(S_q, dtype=np.int32), np.arange(S_k, dtype=np.int32) + 4
    if kind == "perm":
        return rng.permutation(S_q).astype(np.int32), (rng.permutation(S_k) + 2).astype(np.int32)
    return None, None


def _kernel_arrays(p: KernelProblem):
    rng = np.random.default_rng(_seed(p))
    dt = DTYPES[p.dtype]
    a = dict(
        q=_draw(rng, (p.B, p.S_q, p.H, p.D), dt),
        k=_draw(rng, (p.B, p.S_k, p.H_kv, p.D), dt),
        v=_draw(rng, (p.B, p.S_k, p.H_kv, p.D), dt),
        dout=_draw(rng, (p.B, p.S_q, p.H, p.D), dt),
        dlse=harness.normal(rng, (p.B, p.H, p.S_q)),
        bias=None if p.bias is None else harness.normal(rng, p.bias),
        mask=None if p.mask is None else rng.random(p.mask) < p.mask_density,
        sinks=harness.normal(rng, (p.H,)) if p.sinks else None,
    )
    a["q_pos"], a["kv_pos"] = _positions(p.positions, p.S_q, p.S_k, rng)
    a["seg_q"] = a["seg_kv"] = None
    if p.segments:
        a["seg_q"], a["seg_kv"] = _segment_ids(p.seg_layout, p.B, p.S_q, p.S_k,
                                               p.segments == "shared", rng)
    return a


# ------------------------------------------------------------------------------ checks


def _compare(name, got, want, dtype, rows_summed: int = 1):
    """`got` against the oracle's `want` within the dtype's tolerance.

    `rows_summed`: how many query rows `(b, h, i)` each entry sums (for a bias
    broadcast over batch, heads or queries). Each row contributes O(1) and its own
    rounding error, so such a sum's natural scale, the floor of the relative error,
    is `sqrt(rows_summed)` instead of 1: a per-query bias `(S_q, 1)` has exactly 0
    gradient (softmax is shift-invariant), and in bfloat16 each of its `B * H` summed
    rows adds ~4e-3 of noise from the rounded `out` in `delta = sum(dout * out)`.
    """
    got = np.asarray(got)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert not np.isnan(got).any(), f"{name} has NaN"
    assert np.isfinite(got[np.isfinite(want)]).all(), f"{name} has Inf where the oracle is finite"
    oracle.assert_close(got, want, dtype, name, factor=math.sqrt(rows_summed))


def _rows_summed(bias_shape, B, H, S_q) -> int:
    """Query rows `(b, h, i)` that one entry of a bias of `bias_shape` receives."""
    b4 = (1,) * (4 - len(bias_shape)) + tuple(bias_shape)
    return (B // b4[0]) * (H // b4[1]) * (S_q // b4[2])


def _check_hidden_exact(vis, out, lse, dq, dk, dv, *, sinks: bool, bias_shape=None, dbias=None):
    """Exact zeros where the oracle's visibility `vis (B, H, S_q, S_k)` hides everything."""
    B, H, S_q, S_k = vis.shape
    empty = ~vis.any(-1)  # (B, H, S_q)
    rows = empty.transpose(0, 2, 1)  # (B, S_q, H)
    assert np.all(np.asarray(out)[rows] == 0), "a row that sees nothing must give exactly 0"
    if lse is not None and not sinks:
        assert np.all(np.asarray(lse)[empty] == -np.inf), "a row that sees nothing has lse -inf"
    if dq is not None:
        assert np.all(np.asarray(dq)[rows] == 0), "dq of a row that sees nothing must be exactly 0"
    H_kv = np.asarray(dk).shape[2] if dk is not None else H
    unseen = (~vis.any(2)).reshape(B, H_kv, H // H_kv, S_k).all(2).transpose(0, 2, 1)  # (B, S_k, H_kv)
    for name, g in (("dk", dk), ("dv", dv)):
        if g is not None:
            assert np.all(np.asarray(g)[unseen] == 0), f"{name} of a key nobody sees must be exactly 0"
    if dbias is not None:
        b4 = (1,) * (4 - len(bias_shape)) + tuple(bias_shape)
        axes = tuple(i for i in range(4) if b4[i] == 1)
        hidden = ~vis.any(axis=axes, keepdims=True).reshape(bias_shape)
        assert np.all(np.asarray(dbias)[hidden] == 0), "dbias of entries that only meet hidden pairs"


# ------------------------------------------------------------------------------ kernels


@functools.partial(jax.jit, static_argnames=("impl", "through", "options"))
def _kernel_vjp(diff, aux, cot, *, impl, through, options):
    """`(out, lse, (dq, dk, dv, dbias, dsinks))` of one request, under one jit.

    `through="attention"`: `jax.vjp` of `attention` with the cotangent `dout`, and the
    forward of `attention_fwd` for `lse`; `"attention_fwd"`: `jax.vjp` of
    `attention_fwd` with the cotangents `(dout, dlse)`.
    """
    kw = dict(aux, **dict(options), implementation=impl)

    def fwd(q, k, v, bias, sinks):
        return kernels.attention_fwd(q, k, v, bias=bias, sinks=sinks, **kw)

    def att(q, k, v, bias, sinks):
        return kernels.attention(q, k, v, bias=bias, sinks=sinks, **kw)

    if through == "attention_fwd":
        (out, lse), vjp = jax.vjp(fwd, *diff)
        return out, lse, vjp(cot)
    out, vjp = jax.vjp(att, *diff)
    return out, fwd(*diff)[1], vjp(cot[0])


def _run_kernel(impl, p: KernelProblem, a: dict):
    aux = {}
    if p.mask is not None:
        aux["mask"] = jnp.asarray(a["mask"])
    if p.segments == "shared":
        aux["segment_ids"] = jnp.asarray(a["seg_q"])
    elif p.segments == "split":
        aux["segment_ids"] = kernels.SegmentIds(q=jnp.asarray(a["seg_q"]), kv=jnp.asarray(a["seg_kv"]))
    if a["q_pos"] is not None:
        aux["q_positions"], aux["kv_positions"] = jnp.asarray(a["q_pos"]), jnp.asarray(a["kv_pos"])
    options = (("causal", p.causal), ("window", p.window), ("scale", p.scale),
               ("logits_soft_cap", p.soft_cap))
    diff = tuple(None if a[n] is None else jnp.asarray(a[n]) for n in ("q", "k", "v", "bias", "sinks"))
    cot = (jnp.asarray(a["dout"]), jnp.asarray(a["dlse"]))
    out, lse, grads = _kernel_vjp(diff, aux, cot, impl=impl, through=p.through, options=options)
    return jax.tree.map(np.asarray, (out, lse, grads))


def _kernel_oracle(p: KernelProblem, a: dict):
    ref = oracle.attention(
        a["q"], a["k"], a["v"], bias=a["bias"], mask=a["mask"], sinks=a["sinks"],
        segment_ids=None if p.segments is None else (a["seg_q"], a["seg_kv"]),
        q_positions=a["q_pos"], kv_positions=a["kv_pos"], causal=p.causal, window=p.window,
        scale=p.scale, logits_soft_cap=p.soft_cap, dout=a["dout"],
        dlse=a["dlse"] if p.through == "attention_fwd" else None,
    )
    vis = oracle.visibility(
        p.B, p.H, p.S_q, p.S_k, mask=a["mask"], seg_q=a["seg_q"], seg_kv=a["seg_kv"],
        q_pos=a["q_pos"], kv_pos=a["kv_pos"], causal=p.causal, window=p.window,
    )
    return ref, vis


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=_impl_id)
@examples(16)
@given(p=kernel_problems())
def test_kernel_matches_oracle(impl, p):
    a = _kernel_arrays(p)
    out, lse, grads = _run_kernel(impl, p, a)
    ref, vis = _kernel_oracle(p, a)
    dt = DTYPES[p.dtype]
    assert out.dtype == np.dtype(dt) and lse.dtype == np.float32
    _compare("out", out, ref.out, dt)
    _compare("lse", lse, ref.lse, dt)
    for name, g in zip(("dq", "dk", "dv", "dbias", "dsinks"), grads):
        want = getattr(ref, name)
        if want is None:
            assert g is None, f"{name} should be None"
        elif name == "dbias":
            _compare(name, g, want, dt, _rows_summed(p.bias, p.B, p.H, p.S_q))
        else:
            _compare(name, g, want, dt)
    dq, dk, dv, dbias, _ = grads
    _check_hidden_exact(vis, out, lse, dq, dk, dv, sinks=p.sinks, bias_shape=p.bias, dbias=dbias)
    event(p.dtype)
    if not vis.any(-1).all():
        event("some rows see nothing")


HIDING = ("mask", "q_padding", "kv_padding", "disjoint_segments", "causal", "window")


@st.composite
def hidden_problems(draw):
    """A request in which no query sees any key, hidden by one of `HIDING`; and how."""
    p = draw(kernel_problems())
    how = draw(st.sampled_from(HIDING))
    p = dataclasses.replace(
        p,
        mask=(1, 1) if how == "mask" else None,
        segments="split" if how in ("q_padding", "kv_padding", "disjoint_segments") else None,
        seg_layout=None,
        positions="far" if how in ("causal", "window") else None,
        causal=True if how == "causal" else p.causal,
        window=(0, 0) if how == "window" else p.window,
    )
    return p, how


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=_impl_id)
@examples(5)
@given(case=hidden_problems())
def test_kernel_every_row_hidden(impl, case):
    """Nothing visible anywhere: out exactly 0, lse -inf (the sink logit with sinks),
    every gradient of q, k, v and bias exactly 0."""
    p, how = case
    a = _kernel_arrays(p)
    if how == "mask":
        a["mask"] = np.zeros((1, 1), bool)
    elif p.segments:
        a["seg_q"] = np.full((p.B, p.S_q), -1 if how == "q_padding" else 0, np.int32)
        a["seg_kv"] = np.full((p.B, p.S_k), -3 if how == "kv_padding" else 1, np.int32)
    else:  # every key after every query, at least one position apart
        a["q_pos"] = np.arange(p.S_q, dtype=np.int32)
        a["kv_pos"] = np.arange(p.S_k, dtype=np.int32) + p.S_q + 1
    ref, vis = _kernel_oracle(p, a)
    assert not vis.any()
    out, lse, (dq, dk, dv, dbias, dsinks) = _run_kernel(impl, p, a)
    assert np.all(out == 0)
    if p.sinks:
        np.testing.assert_array_equal(lse, np.broadcast_to(a["sinks"][None, :, None], lse.shape))
        _compare("dsinks", dsinks, ref.dsinks, DTYPES[p.dtype])
    else:
        assert np.all(lse == -np.inf)
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv), ("dbias", dbias)):
        assert g is None or np.all(g == 0), f"{name} must be exactly 0"


# ------------------------------------------------------------------------ parallel paths


@dataclasses.dataclass
class ParallelProblem:
    path: str  # "ulysses" | "joint" | "ring" | "usp"
    U: int  # Ulysses size (1 for ring)
    R: int  # ring size (1 for Ulysses)
    layout: str
    B: int
    T: int  # replicated text prefix (joint layouts)
    L: int  # visual (sharded) tokens, global
    L_kv: int  # key / value tokens, global: L, or (ring: cross attention) another length
    H: int
    H_kv: int
    D: int
    dtype: str
    causal: bool
    window: tuple | None
    soft_cap: float | None
    segments: str | None  # None | "shared" | "split"; over the global (B, T + L), text first
    seg_layout: str | None  # one of SEGMENT_LAYOUTS
    sinks: bool
    bias: tuple | None  # (joint) Ulysses only: broadcastable to (B, H, T + L, T + L)
    positions: str | None  # (joint) Ulysses only: None | "perm" | "offset"
    implementation: object
    dp: int  # > 1: the batch is sharded over "dp" too
    check_vma: bool  # False: shard_map's other transpose (no varying-axes checks)

    @property
    def n(self) -> int:
        return self.U * self.R


@st.composite
def parallel_problems(draw, path: str):
    n = draw(st.sampled_from([1, 2, 4, 8]))
    if path == "ring":
        U, R = 1, n
    elif path in ("ulysses", "joint"):
        U, R = n, 1
    else:
        U = draw(st.sampled_from(_divisors(n)))
        R = n // U
    layout = draw(st.sampled_from(["contiguous", "zigzag"])) if path in ("ring", "usp") else "contiguous"
    unit = math.lcm(2 * R, n) if layout == "zigzag" else n
    L = unit * draw(st.sampled_from([m for m in (1, 2, 3) if unit * m <= 48]))
    T = 0  # text prefix: the joint layouts
    if path == "joint":
        T = draw(st.sampled_from([1, 2, 5]))
    elif path == "usp":
        T = draw(st.sampled_from([0, 0, 3]))
    H = U * draw(st.sampled_from([1, 2])) if path != "ring" else draw(st.sampled_from([1, 2, 4]))
    L_kv = L
    if path == "ring" and draw(st.booleans()):  # cross attention, S_q != S_k
        L_kv = unit * draw(st.sampled_from([m for m in (1, 2, 3) if unit * m <= 48]))
    B = draw(st.sampled_from([1, 2]))
    segments = draw(st.sampled_from([None, "shared", "split"] if L_kv == L else [None, "split"]))
    bias = positions = None
    if path in ("ulysses", "joint"):
        if draw(st.booleans()):
            bias = _broadcast_shape(draw, (B, H, T + L, T + L))
        positions = draw(st.sampled_from([None, None, "perm", "offset"]))
    return ParallelProblem(
        path=path, U=U, R=R, layout=layout, B=B, T=T, L=L, L_kv=L_kv, H=H,
        H_kv=draw(st.sampled_from(_divisors(H))),
        D=draw(st.sampled_from([4, 8])),
        dtype=draw(dtypes),
        causal=draw(st.booleans()),
        window=draw(windows),
        soft_cap=draw(soft_caps),
        segments=segments,
        seg_layout=draw(st.sampled_from(SEGMENT_LAYOUTS)) if segments else None,
        sinks=draw(st.booleans()),
        bias=bias,
        positions=positions,
        implementation=draw(st.sampled_from(IMPLEMENTATIONS)),
        dp=draw(st.sampled_from([1, 2])) if B == 2 and 2 * n <= 8 else 1,
        check_vma=draw(st.booleans()),
    )


@functools.lru_cache(maxsize=None)
def _parallel_fn(path, U, R, T, layout, implementation, aux_keys, sinks, bias, options, dp,
                 check_vma):
    """A jitted `(q, k, v, sinks, bias, aux, dout) -> (out, (dq, dk, dv, dsinks, dbias))`
    on the per-device layout, sharded ring-major over `make_mesh(dp, sp=U, ring=R)`
    (batch over "dp"). `bias`: None, or its PartitionSpec; `aux`: a dict of the
    non-differentiable per-token options (`aux_keys`: segment ids, positions)."""
    mesh = harness.mesh(dp=dp, sp=U, **{RING: R})
    seq = P("dp" if dp > 1 else None, (RING, SP))
    aux_specs = {key: seq if key == "segment_ids" else P((RING, SP)) for key in aux_keys}

    def local(q, k, v, sinks, bias, aux):
        kw = dict(options, implementation=implementation, **aux)
        if sinks is not None:
            kw["sinks"] = sinks
        if bias is not None:
            kw["bias"] = bias
        if path == "ulysses":
            return parallel.sequence_parallel_self_attention(q, k, v, SP, **kw)
        if path == "joint":
            return parallel.sequence_parallel_joint_self_attention(q, k, v, T, SP, **kw)
        if path == "ring":
            return parallel.ring_attention(q, k, v, ring_axis=RING, layout=layout, **kw)
        return parallel.usp_attention(q, k, v, ulysses_axis=SP, ring_axis=RING, layout=layout,
                                      text_len=T, **kw)

    in_specs = (seq, seq, seq, P() if sinks else None, bias, aux_specs)
    return harness.sharded_vjp(local, mesh, in_specs, seq, (0, 1, 2, 3, 4), check_vma=check_vma)


def _to_devices(p: ParallelProblem, x):
    """Global `(B, T + L, ...)` -> the per-device layout: the visual part zigzag-permuted
    over the ring (zigzag layout), cut in `n` chunks, each after its copy of the text."""
    x = np.asarray(x)
    text, visual = x[:, :p.T], x[:, p.T:]
    if p.layout == "zigzag":
        visual = np.asarray(parallel.zigzag_permute(jnp.asarray(visual), 1, p.R))
    Ll = visual.shape[1] // p.n
    return np.concatenate(
        [np.concatenate([text, visual[:, i * Ll:(i + 1) * Ll]], 1) for i in range(p.n)], 1)


def _from_devices(p: ParallelProblem, x):
    """Per-device layout -> `(text rows of every device (B, n, T, ...), visual (B, L, ...))`."""
    x = np.asarray(x, np.float64)
    blocks = x.reshape(x.shape[0], p.n, -1, *x.shape[2:])
    visual = blocks[:, :, p.T:].reshape(x.shape[0], -1, *x.shape[2:])
    if p.layout == "zigzag":
        visual = np.asarray(parallel.zigzag_unpermute(visual, 1, p.R))
    return blocks[:, :, :p.T], visual


def _check_parallel(p: ParallelProblem):
    rng = np.random.default_rng(_seed(p))
    dt = DTYPES[p.dtype]
    S, S_k = p.T + p.L, p.T + p.L_kv
    q = _draw(rng, (p.B, S, p.H, p.D), dt)
    k = _draw(rng, (p.B, S_k, p.H_kv, p.D), dt)
    v = _draw(rng, (p.B, S_k, p.H_kv, p.D), dt)
    # A random cotangent for every device's rows, text copies included; the
    # single-device cotangent of a text row is the sum over its copies.
    dout_dev = _draw(rng, (p.B, p.n * (p.T + p.L // p.n), p.H, p.D), dt)
    dout_text, dout_vis = _from_devices(p, dout_dev)
    dout = np.concatenate([dout_text.sum(1), dout_vis], 1)
    sinks = harness.normal(rng, (p.H,)) if p.sinks else None
    bias = None if p.bias is None else harness.normal(rng, p.bias)
    seg = seg_q = seg_kv = None
    if p.segments:
        seg_q, seg_kv = _segment_ids(p.seg_layout, p.B, S, S_k, p.segments == "shared", rng)
    aux = {}
    if p.segments == "shared":
        aux["segment_ids"] = jnp.asarray(_to_devices(p, seg_q))
    elif p.segments == "split":
        aux["segment_ids"] = kernels.SegmentIds(q=jnp.asarray(_to_devices(p, seg_q)),
                                                kv=jnp.asarray(_to_devices(p, seg_kv)))
    q_pos = kv_pos = None
    if p.positions == "perm":  # the tokens in another order: the same positions for q and kv
        q_pos = kv_pos = rng.permutation(S).astype(np.int32)
    elif p.positions == "offset":  # queries 3 positions after their keys
        q_pos, kv_pos = np.arange(S, dtype=np.int32) + 3, np.arange(S, dtype=np.int32)
    if p.positions:
        aux["q_positions"] = jnp.asarray(_to_devices(p, q_pos[None])[0])
        aux["kv_positions"] = jnp.asarray(_to_devices(p, kv_pos[None])[0])

    options = (("causal", p.causal), ("window", p.window), ("logits_soft_cap", p.soft_cap))
    bias_spec = None
    if p.bias is not None:  # a bias with a batch axis is sharded like the batch
        bias_spec = P("dp") if p.dp > 1 and len(p.bias) == 4 and p.bias[0] > 1 else P()
    fn = _parallel_fn(p.path, p.U, p.R, p.T, p.layout, p.implementation, tuple(sorted(aux)),
                      p.sinks, bias_spec, options, p.dp, p.check_vma)
    out, grads = fn(*(jnp.asarray(_to_devices(p, x)) for x in (q, k, v)),
                    None if sinks is None else jnp.asarray(sinks),
                    None if bias is None else jnp.asarray(bias), aux, jnp.asarray(dout_dev))
    assert out.dtype == np.dtype(dt)

    ref = oracle.attention(
        q, k, v, segment_ids=None if p.segments is None else (seg_q, seg_kv), sinks=sinks,
        bias=bias, q_positions=q_pos, kv_positions=kv_pos, causal=p.causal, window=p.window,
        logits_soft_cap=p.soft_cap, dout=dout,
    )
    out_text, out_vis = _from_devices(p, out)
    harness.assert_copies_equal(out_text)  # the text rows: the same on every device, bit for bit
    got = {"out": np.concatenate([out_text[:, 0], out_vis], 1)}
    for name, g in zip(("dq", "dk", "dv"), grads[:3]):
        g_text, g_vis = _from_devices(p, g)
        got[name] = np.concatenate([g_text.sum(1), g_vis], 1)
    got["dsinks"], got["dbias"] = grads[3], grads[4]
    _compare("out", got["out"], ref.out, dt)
    for name in ("dq", "dk", "dv", "dsinks"):
        if getattr(ref, name) is not None:
            _compare(name, got[name], getattr(ref, name), dt)
    if p.bias is not None:
        _compare("dbias", got["dbias"], ref.dbias, dt, _rows_summed(p.bias, p.B, p.H, S))
    vis = oracle.visibility(p.B, p.H, S, S_k, seg_q=seg_q, seg_kv=seg_kv, q_pos=q_pos,
                            kv_pos=kv_pos, causal=p.causal, window=p.window)
    _check_hidden_exact(vis, got["out"], None, got["dq"], got["dk"], got["dv"], sinks=p.sinks)
    event(f"{p.dtype}, {p.dp} x {p.U} x {p.R} devices")
    if not vis.any(-1).all():
        event("some rows see nothing")


@examples(6)
@given(p=parallel_problems("ulysses"))
def test_ulysses_matches_oracle(p):
    _check_parallel(p)


@examples(6)
@given(p=parallel_problems("joint"))
def test_joint_ulysses_matches_oracle(p):
    _check_parallel(p)


@examples(8)
@given(p=parallel_problems("ring"))
def test_ring_matches_oracle(p):
    _check_parallel(p)


@examples(8)
@given(p=parallel_problems("usp"))
def test_usp_matches_oracle(p):
    _check_parallel(p)
