"""`ring_attention` on simulated CPU devices against the float64 oracle.

Every comparison runs the ring inside `jax.shard_map` over `make_mesh(sp=n)` on
the sharded global sequence (`harness.sequence_vjp`, `harness.run_sequence`;
zigzag: permuted with `zigzag_permute` first and unpermuted after), takes
`jax.vjp` with a random cotangent, and compares the output and the gradients of
q, k, v (and sinks) with `oracle.attention` on the whole unsharded sequence.
Shapes stay small (S <= 32) so the file runs quickly on a 2-core machine; each
configuration compiles once (`_ring_fn` caches it).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import oracle
from vidax_eqx import kernels, parallel


SEQ = P(None, "sp")  # (B, S, ...) arrays: the sequence axis over the ring


@dataclasses.dataclass(frozen=True)
class Ring:
    """One static ring configuration (hashable: the cache key of `_ring_fn`)."""

    sp: int = 4
    dp: int = 1  # > 1: the batch is sharded over "dp" too
    layout: str = "contiguous"
    causal: bool = False
    window: tuple | None = None
    soft_cap: float | None = None
    implementation: object = "xla"
    segments: bool = False
    sinks: bool = False
    check_vma: bool = True  # JAX's default; `False` exercises shard_map's other transpose


@functools.lru_cache(maxsize=None)
def _ring_fn(cfg: Ring):
    """A jitted `(q, k, v, seg, sinks, dout) -> (out, (dq, dk, dv, dsinks))` on the
    sharded layout (`harness.sequence_vjp`)."""

    def attend(q, k, v, seg, sinks):
        return parallel.ring_attention(
            q, k, v,
            ring_axis="sp",
            causal=cfg.causal,
            segment_ids=seg,
            sinks=sinks,
            window=cfg.window,
            logits_soft_cap=cfg.soft_cap,
            layout=cfg.layout,
            implementation=cfg.implementation,
        )

    return harness.sequence_vjp(
        attend, harness.mesh(dp=cfg.dp, sp=cfg.sp), "sp", batch_axis="dp" if cfg.dp > 1 else None,
        segments="one" if cfg.segments else None, sinks=cfg.sinks, check_vma=cfg.check_vma,
    )


def _run(cfg: Ring, a: dict, repeat: int = 1):
    """Runs the ring on global arrays `a`; returns global-order NumPy results."""
    return harness.run_sequence(
        _ring_fn(cfg), a, zigzag_size=cfg.sp if cfg.layout == "zigzag" else 0,
        segments="one" if cfg.segments else None, sinks=cfg.sinks, repeat=repeat,
    )


def _oracle(cfg: Ring, a: dict):
    return oracle.attention(
        a["q"], a["k"], a["v"],
        segment_ids=a.get("seg") if cfg.segments else None,
        sinks=a.get("sinks") if cfg.sinks else None,
        causal=cfg.causal,
        window=cfg.window,
        logits_soft_cap=cfg.soft_cap,
        dout=a["dout"],
    )


def _check(cfg: Ring, a: dict, dtype=np.float32):
    names = harness.ATTENTION_NAMES + (("dsinks",) if cfg.sinks else ())
    harness.assert_matches(_run(cfg, a), _oracle(cfg, a), dtype, names)


# -- output and gradients against the oracle ---------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sp", [2, 4, 8])
def test_matches_oracle(sp, causal, layout):
    cfg = Ring(sp=sp, layout=layout, causal=causal)
    _check(cfg, harness.attention_inputs(2, 32, 4, 8, H_kv=2, seed=sp))


def test_odd_ring_size():
    """sp=3: a ring with no middle loop in the backward (steps 0, 1 and last)."""
    a = harness.attention_inputs(2, 24, 4, 8, sinks=True, seed=12)
    _check(Ring(sp=3, layout="zigzag", causal=True, sinks=True), a)


@pytest.mark.parametrize(
    "layout, causal, window",
    [("contiguous", False, (5, 3)), ("zigzag", False, (2, None)), ("zigzag", True, (9, None))],
)
def test_window(layout, causal, window):
    _check(Ring(layout=layout, causal=causal, window=window), harness.attention_inputs(2, 32, 4, 8))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_segment_ids_per_batch_with_padding(layout):
    a = harness.attention_inputs(2, 32, 4, 8, segments=True, seed=3)
    assert (a["seg"] < 0).any() and not np.array_equal(a["seg"][0], a["seg"][1])
    _check(Ring(layout=layout, causal=True, segments=True), a)


def test_segment_ids_as_pair():
    """`SegmentIds(q=..., kv=...)`: the kv ids travel with their block."""
    a = harness.attention_inputs(2, 32, 4, 8, segments=True, seed=4)
    mesh = harness.mesh(sp=4)

    def attend(q, k, v, seg):
        ids = kernels.SegmentIds(q=seg, kv=seg)
        return parallel.ring_attention(q, k, v, ring_axis="sp", segment_ids=ids, implementation="xla")

    f = jax.jit(jax.shard_map(attend, mesh=mesh, in_specs=(SEQ,) * 4, out_specs=SEQ))
    got = f(*(jnp.asarray(a[n]) for n in ("q", "k", "v", "seg")))
    ref = oracle.attention(a["q"], a["k"], a["v"], segment_ids=a["seg"])
    oracle.assert_close(got, ref.out, np.float32, "out")


@pytest.mark.parametrize(
    "layout, causal, check_vma",
    [("contiguous", True, True), ("zigzag", True, True), ("zigzag", False, False)],
)
def test_sinks_replicated(layout, causal, check_vma):
    """Sinks enter once per row, and the gradient of the replicated (`P()`) input
    sums every device's rows exactly once, with and without `check_vma`."""
    a = harness.attention_inputs(2, 32, 4, 8, sinks=True, seed=5)
    _check(Ring(layout=layout, causal=causal, sinks=True, check_vma=check_vma), a)


def test_sinks_replicated_over_data_and_ring_axes():
    """Batch over "dp", sequence over "sp", sinks replicated over both: the sink
    gradient sums all eight devices' rows once."""
    cfg = Ring(dp=2, sp=4, layout="zigzag", causal=True, segments=True, sinks=True)
    _check(cfg, harness.attention_inputs(2, 32, 4, 8, segments=True, sinks=True, seed=13))


@pytest.mark.parametrize("H_kv, layout", [(2, "zigzag"), (1, "contiguous")], ids=["gqa", "mqa"])
def test_gqa_mqa(H_kv, layout):
    _check(Ring(layout=layout, causal=True), harness.attention_inputs(2, 32, 4, 8, H_kv=H_kv, seed=6))


def test_bfloat16():
    a = harness.attention_inputs(2, 32, 4, 8, dtype=jnp.bfloat16, sinks=True, seed=7)
    _check(Ring(layout="zigzag", causal=True, sinks=True), a, dtype=jnp.bfloat16)


def test_soft_cap():
    a = harness.attention_inputs(2, 32, 4, 8, seed=8)
    _check(Ring(layout="contiguous", causal=True, soft_cap=2.0), a)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize(
    "implementation", ["xla", kernels.Blockwise(block_q=8, block_kv=8)], ids=["xla", "blockwise8x8"]
)
def test_implementations(implementation, layout):
    """Both kernels serve every step; 8x8 tiles make each local block span tiles
    (and the blockwise kernel skip hidden tiles inside a step)."""
    cfg = Ring(sp=4, layout=layout, causal=True, segments=True, sinks=True, implementation=implementation)
    _check(cfg, harness.attention_inputs(2, 64, 4, 8, segments=True, sinks=True, seed=9))


@pytest.mark.parametrize("layout, S", [("contiguous", 30), ("zigzag", 27)])
def test_sequence_not_dividing_sp(layout, S):
    """Pad to a multiple of the ring size (2x for zigzag), hide the padding with
    segment ids, unpad: equal to the unpadded oracle."""
    sp = 4
    multiple = sp if layout == "contiguous" else 2 * sp
    a = harness.attention_inputs(2, S, 4, 8, seed=10)
    padded = {n: np.asarray(parallel.pad_to_multiple(jnp.asarray(x), multiple, axis=1)) for n, x in a.items()}
    padded["seg"] = np.asarray(parallel.padding_segment_ids(S, multiple, a["q"].shape[0]))
    got = _run(Ring(sp=sp, layout=layout, causal=True, segments=True), padded)
    ref = oracle.attention(a["q"], a["k"], a["v"], causal=True, dout=a["dout"])
    for name in ("out", "dq", "dk", "dv"):
        unpadded = np.asarray(parallel.unpad(jnp.asarray(got[name]), S, axis=1))
        oracle.assert_close(unpadded, getattr(ref, name), np.float32, name)


def test_deterministic():
    cfg = Ring(sp=8, layout="zigzag", causal=True)
    first, second = _run(cfg, harness.attention_inputs(2, 32, 4, 8, H_kv=2, seed=8), repeat=2)
    for name in ("out", "dq", "dk", "dv"):
        np.testing.assert_array_equal(first[name], second[name])


# -- work skipping and balance ------------------------------------------------------


_CALLS: list[tuple[str, int, int]] = []  # (fwd | bwd, rank, query x key pairs)


@dataclasses.dataclass(frozen=True)
class _CountingXla(kernels.AbstractImplementation):
    """Delegates to `"xla"` and records, at run time, every call that executes."""

    name = "counting_xla"
    capabilities = kernels.Xla.capabilities

    def _record(self, kind, ops):
        pairs = ops.q.shape[1] * ops.k.shape[1]
        rank = jax.lax.axis_index("sp")
        jax.debug.callback(lambda r: _CALLS.append((kind, int(r), pairs)), rank)

    def fwd(self, ops, opts):
        self._record("fwd", ops)
        return kernels.Xla().fwd(ops, opts)

    def bwd(self, ops, opts, out, lse, dout, dlse):
        self._record("bwd", ops)
        return kernels.Xla().bwd(ops, opts, out, lse, dout, dlse)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_hidden_blocks_are_skipped(layout):
    """Counts the kernel calls that actually run on each device: exactly the work
    `ring_work` reports, for the forward and again for the backward; causal work is
    `(n + 1) / 2n` of the full ring's, and zigzag spreads it evenly."""
    sp, S = 4, 32
    cfg = Ring(sp=sp, layout=layout, causal=True, implementation=_CountingXla())
    _CALLS.clear()
    _check(cfg, harness.attention_inputs(2, S, 4, 8, seed=11))
    jax.effects_barrier()
    expected = parallel.ring_work(S, sp, layout=layout, causal=True)
    for kind in ("fwd", "bwd"):
        per_device = np.zeros(sp, np.int64)
        for k, rank, pairs in _CALLS:
            if k == kind:
                per_device[rank] += pairs
        np.testing.assert_array_equal(per_device, expected, err_msg=kind)
    full = parallel.ring_work(S, sp, layout=layout)
    assert expected.sum() / full.sum() == (sp + 1) / (2 * sp)
    balance = expected.max() / expected.mean()
    assert balance == (1.0 if layout == "zigzag" else 2 * sp / (sp + 1))


def test_ring_work_balance():
    for sp in (2, 4, 8):
        S = 16 * sp
        full = parallel.ring_work(S, sp, layout="contiguous")
        np.testing.assert_array_equal(full, np.full(sp, (S // sp) * S))
        zig = parallel.ring_work(S, sp, layout="zigzag", causal=True)
        assert zig.max() == zig.min()  # balanced
        contiguous = parallel.ring_work(S, sp, layout="contiguous", causal=True)
        # Half of the n^2 blocks, plus half of the n diagonal ones; at sp=8: 0.5625.
        assert contiguous.sum() == zig.sum() == full.sum() * (sp + 1) // (2 * sp)
        assert contiguous.max() / contiguous.mean() == pytest.approx(2 * sp / (sp + 1))


def test_jaxpr_has_skip_only_when_masked():
    """A `cond` (switch) guards the steps only when the mask structure can hide one."""
    mesh = harness.mesh(sp=4)
    x = jnp.ones((1, 16, 2, 8))

    def jaxpr(**kw):
        f = lambda q, k, v: parallel.ring_attention(q, k, v, ring_axis="sp", implementation="xla", **kw)
        g = jax.shard_map(f, mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
        return str(jax.make_jaxpr(lambda q: jax.vjp(g, q, q, q)[1](q))(x))

    assert "cond[" not in jaxpr()
    assert "cond[" in jaxpr(causal=True)
    assert "cond[" in jaxpr(window=(2, 2), layout="zigzag")


def _ppermute_bytes(jaxpr, times=1) -> int:
    """Bytes one device sends by `ppermute` in `jaxpr` (scan bodies times their length)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            total += times * sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars)
        inner = times * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else times
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    total += _ppermute_bytes(sub, inner)
    return total


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_communication_is_minimal(layout):
    """Forward: n - 1 hops of K/V. Forward + backward: that, n - 1 hops of K/V
    again and n - 1 hops of the float32 dK/dV; no wasted transfer beyond the
    ordering tokens (`vidax_eqx._order`: a few float32 elements per permute)."""
    for sp in (2, 3, 4, 8):
        mesh = harness.mesh(sp=sp)
        x = jnp.ones((1, 4 * sp, 2, 8), jnp.float32)
        f = lambda q, k, v: parallel.ring_attention(
            q, k, v, ring_axis="sp", causal=True, layout=layout, implementation="xla"
        )
        g = jax.shard_map(f, mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
        block = 4 * 2 * 8 * 4  # one local k (or v, dk, dv) in bytes
        fwd = jax.make_jaxpr(g)(x, x, x).jaxpr
        both = jax.make_jaxpr(lambda q: jax.vjp(g, q, q, q)[1](q))(x).jaxpr
        # K and V travel stacked (one permute per hop), so at most 8 token elements a
        # hop; the minimum itself must be there.
        tokens = 8 * 4
        assert 0 <= _ppermute_bytes(fwd) - 2 * (sp - 1) * block <= (sp - 1) * tokens
        assert 0 <= _ppermute_bytes(both) - 6 * (sp - 1) * block <= 4 * (sp - 1) * tokens


# -- layout helpers -----------------------------------------------------------------


@pytest.mark.parametrize("sp", [1, 2, 4, 8])
def test_zigzag_permute_layout(sp):
    S = 4 * sp
    x = np.arange(2 * S).reshape(2, S)
    z = np.asarray(parallel.zigzag_permute(x, 1, sp))
    c = S // (2 * sp)
    for r in range(sp):
        local = z[0, r * 2 * c : (r + 1) * 2 * c]
        expected = np.concatenate([np.arange(r * c, (r + 1) * c), np.arange((2 * sp - 1 - r) * c, (2 * sp - r) * c)])
        np.testing.assert_array_equal(local, expected)
        np.testing.assert_array_equal(local, np.asarray(parallel.ring_positions(2 * c, sp, r, "zigzag")))
        np.testing.assert_array_equal(
            np.asarray(parallel.ring_positions(2 * c, sp, r)), np.arange(r * 2 * c, (r + 1) * 2 * c)
        )
    np.testing.assert_array_equal(np.asarray(parallel.zigzag_unpermute(z, -1, sp)), x)


# -- errors -------------------------------------------------------------------------


def test_missing_axis():
    x = jnp.ones((1, 8, 2, 8))
    with pytest.raises(ValueError, match=r"^Ring axis 'sp' does not exist in the current context\."):
        parallel.ring_attention(x, x, x, ring_axis="sp")


def _trace_in_ring(sp=2, S=8, **kw):
    mesh = harness.mesh(sp=sp)
    f = lambda q: parallel.ring_attention(q, q, q, ring_axis="sp", **kw)
    jax.eval_shape(jax.shard_map(f, mesh=mesh, in_specs=SEQ, out_specs=SEQ), jnp.ones((1, S, 2, 8)))


def test_unknown_layout():
    with pytest.raises(ValueError, match="`layout` must be one of"):
        _trace_in_ring(layout="striped")


def test_zigzag_odd_local_length():
    with pytest.raises(ValueError, match=r"even local length of q \(each device holds two half-chunks\); received 3\."):
        _trace_in_ring(S=6, layout="zigzag")


def test_zigzag_permute_uneven():
    with pytest.raises(ValueError, match=r"2 \* sp_size = 8 equal chunks; received size 12"):
        parallel.zigzag_permute(jnp.ones((1, 12)), 1, 4)


def test_bad_sinks_shape():
    with pytest.raises(ValueError, match=r"`sinks` must be a float array of shape \(H,\)"):
        _trace_in_ring(sinks=jnp.ones((3,)))


def test_kernel_errors_pass_through():
    with pytest.raises(ValueError, match="`window`"):
        _trace_in_ring(window=(-1, 2))
