"""`make_ring_attention` kernels on simulated CPU devices against the float64 oracle.

Each comparison builds a kernel from a mask over the global sequence, runs it
inside `jax.shard_map` over `make_mesh(sp=4)` on the sharded sequence (zigzag:
permuted with `zigzag_permute` first and unpermuted after; the mask never is),
takes `jax.vjp` with a random cotangent, and compares the output and the
gradients of q, k, v (and sinks) with `oracle.attention` given the same global
mask, written out here in NumPy. Shapes stay small (S = 32, so 8 tokens per
device) for a 2-core machine.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import oracle
from vidax_eqx import kernels, parallel
from vidax_eqx.parallel import CausalMask, DenseMask, FullMask, LocalMask, make_ring_attention


SEQ = P(None, "sp")
SP, S = 4, 32
# Every input has sinks and segment ids (even batch elements: sorted runs with a padded
# tail; odd ones: ids in random order).
INPUTS = dict(sinks=True, segments=True, pad=(S // 6, 0))


def _dense(seed=0, S=S, density=0.4):
    """A random mask with fully masked rows, a fully masked column and fully masked
    blocks at the ring's granularity (8 x 8) and the zigzag's (4 x 4)."""
    rng = np.random.default_rng(100 + seed)
    m = rng.random((S, S)) < density
    m[[2, 19]] = False
    m[:, 5] = False
    m[8:16, 16:24] = False  # a whole ring step of device 1
    m[24:32, 0:8] = False  # and one of device 3
    m[0:4, 28:32] = False  # a zigzag half-block
    return m


def _block_sparse(density_blocks: float, layout: str, S=S, sp=SP, seed=0):
    """A dense mask over the global sequence whose visible entries fill whole ring
    steps: each device's queries see `density_blocks * sp` of the key blocks (their
    own among them), blocks being the devices' local blocks in `layout`."""
    L = S // sp
    rng = np.random.default_rng(seed)
    blocks = np.zeros((sp, sp), bool)
    per_row = max(1, int(round(density_blocks * sp)))
    for r in range(sp):
        others = rng.permutation([c for c in range(sp) if c != r])[: per_row - 1]
        blocks[r, [r, *others]] = True
    m = np.kron(blocks, np.ones((L, L), bool)).astype(bool)  # in the layout's order
    if layout == "zigzag":  # back to global order, rows and columns
        m = np.asarray(parallel.zigzag_unpermute(parallel.zigzag_unpermute(m, 0, sp), 1, sp))
    return m


def _mixed(layout: str, seed=0):
    """Whole visible ring steps (which run without a mask), partially visible ones
    (which get their block of the mask) and hidden ones (skipped), at random."""
    rng = np.random.default_rng(200 + seed)
    L = S // SP
    kinds = rng.integers(0, 3, (SP, SP))  # 0 hidden, 1 whole, 2 partial
    kinds[0, :3] = [0, 1, 2]
    ones = np.ones((L, L), bool)
    m = np.kron(kinds == 1, ones) | (np.kron(kinds == 2, ones) & (rng.random((S, S)) < 0.5))
    m = m.astype(bool)  # in the layout's order
    if layout == "zigzag":
        m = np.asarray(parallel.zigzag_unpermute(parallel.zigzag_unpermute(m, 0, SP), 1, SP))
    return m


def _causal(S=S):
    return np.tril(np.ones((S, S), bool))


def _local(left, right, S=S):
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    ok = np.ones((S, S), bool)
    if left is not None:
        ok &= j >= i - left
    if right is not None:
        ok &= j <= i + right
    return ok


@dataclasses.dataclass(frozen=True)
class Run:
    layout: str = "contiguous"
    segments: bool = False
    sinks: bool = False
    as_argument: bool = False  # the kernel is a `jax.jit` argument (else closed over)
    check_vma: bool = True


def _run(kernel, cfg: Run, a: dict):
    """The kernel's output and (dq, dk, dv, dsinks) in global order, as NumPy."""
    segments = "one" if cfg.segments else None

    def vjp(kernel, jit):
        def attend(q, k, v, seg, sinks):
            return kernel(q, k, v, segment_ids=seg, sinks=sinks)

        return harness.sequence_vjp(attend, harness.mesh(sp=SP), "sp", segments=segments,
                                    sinks=cfg.sinks, check_vma=cfg.check_vma, jit=jit)

    if cfg.as_argument:  # the kernel a traced argument of the jitted program
        program = jax.jit(lambda kernel, *xs: vjp(kernel, jit=False)(*xs))
        fn = lambda *xs: program(kernel, *xs)  # noqa: E731
    else:
        fn = vjp(kernel, jit=True)
    return harness.run_sequence(fn, a, zigzag_size=SP if cfg.layout == "zigzag" else 0,
                                segments=segments, sinks=cfg.sinks)


def _check(kernel, global_mask: np.ndarray, cfg: Run = Run(), a: dict | None = None, soft_cap=None):
    a = harness.attention_inputs(2, S, 4, 8, H_kv=2, **INPUTS) if a is None else a
    got = _run(kernel, cfg, a)
    ref = oracle.attention(
        a["q"], a["k"], a["v"], mask=global_mask,
        segment_ids=a["seg"] if cfg.segments else None,
        sinks=a["sinks"] if cfg.sinks else None, logits_soft_cap=soft_cap, dout=a["dout"],
    )
    names = harness.ATTENTION_NAMES + (("dsinks",) if cfg.sinks else ())
    harness.assert_matches(got, ref, np.float32, names)


PLAIN = Run()
SEG_SINKS = Run(segments=True, sinks=True)


# -- every mask kind, with and without segment ids and sinks -------------------------


@pytest.mark.parametrize("cfg", [PLAIN, SEG_SINKS], ids=["plain", "seg+sinks"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_dense(layout, cfg):
    m = _dense(seed=1)
    assert not m.any(axis=1).all() and not m[8:16, 16:24].any()
    cfg = dataclasses.replace(cfg, layout=layout)
    _check(make_ring_attention(m, implementation="xla", layout=layout), m, cfg)


@pytest.mark.parametrize("cfg", [PLAIN, SEG_SINKS], ids=["plain", "seg+sinks"])
def test_causal(cfg):
    kernel = make_ring_attention(CausalMask(shape=(S, S)), implementation="xla")
    _check(kernel, _causal(), cfg)


@pytest.mark.parametrize("cfg", [PLAIN, SEG_SINKS], ids=["plain", "seg+sinks"])
def test_local(cfg):
    cfg = dataclasses.replace(cfg, layout="zigzag")
    kernel = make_ring_attention(LocalMask((5, 3)), implementation="xla", layout="zigzag")
    _check(kernel, _local(5, 3), cfg)


@pytest.mark.parametrize("cfg", [PLAIN, SEG_SINKS], ids=["plain", "seg+sinks"])
def test_causal_and_local(cfg):
    mask = CausalMask() & LocalMask((6, None))
    assert mask.window() == (6, 0)  # positional: runs as the kernel's window
    _check(make_ring_attention(mask, implementation="xla"), _causal() & _local(6, None), cfg)


@pytest.mark.parametrize("cfg", [PLAIN, SEG_SINKS], ids=["plain", "seg+sinks"])
def test_local_or_dense(cfg):
    """A dense part under `|`: the whole mask goes to the kernel block by block."""
    dense = _dense(seed=2, density=0.1)
    cfg = dataclasses.replace(cfg, layout="zigzag")
    kernel = make_ring_attention(LocalMask((1, 1)) | dense, implementation="xla", layout="zigzag")
    _check(kernel, _local(1, 1) | dense, cfg)


def test_causal_and_dense_blockwise_tiles():
    """Causal & dense: causal goes to the kernel as `causal=True`, the dense part as
    per-step blocks; 4 x 4 tiles make the blockwise kernel skip hidden tiles inside
    a step as well."""
    dense = _dense(seed=3)
    kernel = make_ring_attention(
        dense & CausalMask(), block_sizes=(4, 4), implementation="blockwise", layout="zigzag"
    )
    assert kernel._implementation() == kernels.Blockwise(block_q=4, block_kv=4)
    _check(kernel, dense & _causal(), Run(layout="zigzag", segments=True, sinks=True))


def test_or_of_positional_masks_is_a_window():
    mask = LocalMask((2, 0)) | LocalMask((0, 3)) | CausalMask()
    assert mask.window() == (None, 3)
    kernel = make_ring_attention(mask, implementation="xla", logits_soft_cap=3.0)
    _check(kernel, _causal() | _local(0, 3), Run(sinks=True), soft_cap=3.0)


def test_full_mask():
    kernel = make_ring_attention(FullMask(), implementation="xla")
    _check(kernel, np.ones((S, S), bool), Run(layout="contiguous", segments=True))


# -- MQA / GQA ----------------------------------------------------------------------


@pytest.mark.parametrize("H_kv", [1, 2, 4], ids=["mqa", "gqa", "mha"])
def test_heads(H_kv):
    m = _mixed("contiguous", seed=4)
    kernel = make_ring_attention(m & CausalMask(), is_mqa=H_kv == 1, implementation="xla")
    a = harness.attention_inputs(2, S, 4, 8, H_kv=H_kv, seed=4, **INPUTS)
    _check(kernel, m & _causal(), Run(sinks=True), a=a)


def test_mqa_three_dimensional_kv():
    """`is_mqa=True` also takes the splash layout of one kv head, `(B, L, D)`."""
    a = harness.attention_inputs(2, S, 4, 8, H_kv=1, seed=5, **INPUTS)
    kernel = make_ring_attention(CausalMask(), is_mqa=True, implementation="xla")
    mesh = harness.mesh(sp=SP)
    f = jax.jit(jax.shard_map(kernel, mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ))
    got = f(jnp.asarray(a["q"]), jnp.asarray(a["k"][:, :, 0]), jnp.asarray(a["v"][:, :, 0]))
    ref = oracle.attention(a["q"], a["k"], a["v"], mask=_causal())
    oracle.assert_close(got, ref.out, np.float32, "out")


# -- the kernel object through jit and shard_map ---------------------------------------


def test_is_a_pytree():
    m = _dense()
    kernel = make_ring_attention(m & CausalMask(), ring_axis="sp", block_sizes=(8, 8))
    leaves, treedef = jax.tree.flatten(kernel)
    assert len(leaves) == 1 and leaves[0] is kernel.mask.left.array
    assert jax.tree.leaves(make_ring_attention(CausalMask() & LocalMask((4, 0)))) == []
    # Options are static: they are part of the tree structure.
    other = make_ring_attention(m & CausalMask(), ring_axis="ring", block_sizes=(8, 8))
    assert jax.tree.structure(other) != treedef
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt.ring_axis == "sp" and rebuilt.block_sizes == (8, 8)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_kernel_as_jit_argument(layout):
    """Passed through `jax.jit`, the dense mask is traced: the ring decides on device
    which steps to skip, from the same mask, and closes over it in `shard_map`."""
    m = _mixed(layout, seed=6)
    kernel = make_ring_attention(m & CausalMask(), implementation="xla", layout=layout)
    _check(kernel, m & _causal(), Run(layout=layout, segments=True, sinks=True, as_argument=True))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_mixed_static(layout):
    """The same kind of mask closed over: the plan is static."""
    m = _mixed(layout, seed=9)
    _check(make_ring_attention(m, implementation="xla", layout=layout), m, Run(layout=layout, sinks=True))


def test_kernel_as_shard_map_argument():
    """The kernel as a replicated `shard_map` operand (`P()`) of a jitted function."""
    m = _dense(seed=7)
    kernel = make_ring_attention(m, implementation="xla")
    a = harness.attention_inputs(2, S, 4, 8, H_kv=2, seed=7, **INPUTS)
    mesh = harness.mesh(sp=SP)
    f = jax.shard_map(lambda kern, q, k, v: kern(q, k, v), mesh=mesh,
                      in_specs=(P(), SEQ, SEQ, SEQ), out_specs=SEQ)
    got = jax.jit(f)(kernel, *(jnp.asarray(a[n]) for n in ("q", "k", "v")))
    oracle.assert_close(got, oracle.attention(a["q"], a["k"], a["v"], mask=m).out, np.float32, "out")


def test_check_vma_false():
    m = _dense(seed=8)
    kernel = make_ring_attention(m, implementation="xla")
    _check(kernel, m, Run(sinks=True, check_vma=False))


# -- skipping -----------------------------------------------------------------------


_CALLS: list[tuple[str, int, int, bool]] = []  # (fwd | bwd, rank, query x key pairs, masked)


@dataclasses.dataclass(frozen=True)
class _CountingXla(kernels.AbstractImplementation):
    """Delegates to `"xla"` and records, at run time, every call that executes."""

    name = "counting_xla"
    capabilities = kernels.Xla.capabilities

    def _record(self, kind, ops):
        pairs, masked = ops.q.shape[1] * ops.k.shape[1], ops.mask is not None
        jax.debug.callback(lambda r: _CALLS.append((kind, int(r), pairs, masked)), jax.lax.axis_index("sp"))

    def fwd(self, ops, opts):
        self._record("fwd", ops)
        return kernels.Xla().fwd(ops, opts)

    def bwd(self, ops, opts, out, lse, dout, dlse):
        self._record("bwd", ops)
        return kernels.Xla().bwd(ops, opts, out, lse, dout, dlse)


@pytest.mark.parametrize("layout, as_argument", [("contiguous", False), ("zigzag", True)])
def test_hidden_blocks_are_skipped(layout, as_argument):
    """The kernel calls that run on each device are exactly the work `kernel.work`
    reports, forward and backward, also when the mask is traced; a block-sparse mask
    at 25% block density hands the kernel 25% of the full ring's pairs, and no mask
    (its computed blocks are entirely visible)."""
    m = _block_sparse(0.25, layout)
    kernel = make_ring_attention(m, implementation=_CountingXla(), layout=layout)
    expected = kernel.work(SP)
    full = make_ring_attention(FullMask(), layout=layout).work(SP, seq_len=S)
    assert expected.sum() * 4 == full.sum()
    _CALLS.clear()
    _check(kernel, m, Run(layout=layout, as_argument=as_argument))
    jax.effects_barrier()
    for kind in ("fwd", "bwd"):
        per_device = np.zeros(SP, np.int64)
        for k, rank, pairs, _ in _CALLS:
            if k == kind:
                per_device[rank] += pairs
        np.testing.assert_array_equal(per_device, expected, err_msg=kind)
    assert _CALLS and not any(masked for *_, masked in _CALLS)


def test_partially_visible_blocks_get_the_mask():
    m = _mixed("contiguous", seed=10)
    kernel = make_ring_attention(m, implementation=_CountingXla())
    _CALLS.clear()
    _check(kernel, m, Run())
    jax.effects_barrier()
    masked = {(k, rank, pairs) for k, rank, pairs, with_mask in _CALLS if with_mask}
    unmasked = {(k, rank, pairs) for k, rank, pairs, with_mask in _CALLS if not with_mask}
    assert masked and unmasked
    np.testing.assert_array_equal(
        np.bincount([r for k, r, *_ in _CALLS if k == "fwd"], minlength=SP) * 64, kernel.work(SP)
    )


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_dense_plan_matches_positional_plan(layout):
    """A causal mask given densely skips exactly what `CausalMask` (and
    `ring_attention(causal=True)`) skip."""
    dense = make_ring_attention(_causal() & FullMask(), layout=layout)
    assert dense.mask.window() is None  # the dense path
    expected = parallel.ring_work(S, SP, layout=layout, causal=True)
    np.testing.assert_array_equal(dense.work(SP), expected)
    np.testing.assert_array_equal(make_ring_attention(CausalMask(), layout=layout).work(SP, S), expected)


def test_static_plan_traces_only_what_runs():
    """A concrete mask is planned at trace time: a dense mask that hides nothing
    traces no `cond` and no mask at all (like `FullMask`); one that hides blocks
    traces the switch. Passed through `jit`, the plan is data: always the switch."""
    mesh = harness.mesh(sp=SP)
    x = jnp.ones((1, S, 2, 8))

    def jaxpr(kernel, as_argument=False):
        f = lambda kern, q: jax.shard_map(lambda q: kern(q, q, q), mesh=mesh, in_specs=SEQ, out_specs=SEQ)(q)
        if as_argument:
            return str(jax.make_jaxpr(f)(kernel, x))
        return str(jax.make_jaxpr(lambda q: f(kernel, q))(x))

    assert "cond[" not in jaxpr(make_ring_attention(np.ones((S, S), bool)))
    assert "gather" not in jaxpr(make_ring_attention(np.ones((S, S), bool)))
    assert "cond[" in jaxpr(make_ring_attention(_block_sparse(0.5, "contiguous")))
    assert "cond[" in jaxpr(make_ring_attention(np.ones((S, S), bool)), as_argument=True)


def test_block_visibility():
    masks = {
        "causal": (CausalMask(), _causal()),
        "local": (LocalMask((3, 9)), _local(3, 9)),
        "local|causal": (LocalMask((0, 2)) | CausalMask(), _local(0, 2) | _causal()),
        "dense&local": (DenseMask(_dense()) & LocalMask((4, 4)), _dense() & _local(4, 4)),
    }
    for name, (mask, full) in masks.items():
        for b in (1, 4, 8):
            want = full.reshape(S // b, b, S // b, b).any(axis=(1, 3))
            np.testing.assert_array_equal(mask.block_visibility(S, b), want, err_msg=f"{name} b={b}")
            every = full.reshape(S // b, b, S // b, b).all(axis=(1, 3))
            np.testing.assert_array_equal(mask._block_tables(S, b)[1], every, err_msg=f"{name} b={b}")
        pos = np.array([3, 17, 30])
        np.testing.assert_array_equal(mask.block(pos, pos), full[np.ix_(pos, pos)], err_msg=name)


# -- errors -------------------------------------------------------------------------


def test_missing_axis():
    x = jnp.ones((1, 8, 2, 8))
    kernel = make_ring_attention(CausalMask())
    with pytest.raises(ValueError, match=r"^Ring axis 'sp' does not exist in the current context\."):
        kernel(x, x, x)
    with pytest.raises(ValueError, match=r"^Ring axis 'ring' does not exist in the current context\."):
        make_ring_attention(_dense(), ring_axis="ring")(x, x, x)


def _trace(kernel, S=S, H_kv=2):
    mesh = harness.mesh(sp=SP)
    q, kv = jnp.ones((1, S, 4, 8)), jnp.ones((1, S, H_kv, 8))
    f = jax.shard_map(lambda q, k: kernel(q, k, k), mesh=mesh, in_specs=(SEQ, SEQ), out_specs=SEQ)
    jax.eval_shape(f, q, kv)


def test_mask_length_must_match_the_ring():
    with pytest.raises(ValueError, match=r"the mask covers a global sequence of 32 tokens, but the ring holds 64"):
        _trace(make_ring_attention(_dense()), S=64)
    with pytest.raises(ValueError, match=r"covers a global sequence of 16 tokens"):
        _trace(make_ring_attention(CausalMask(shape=(16, 16))))


def test_is_mqa_needs_one_kv_head():
    with pytest.raises(ValueError, match=r"is_mqa=True means one key/value head"):
        _trace(make_ring_attention(CausalMask(), is_mqa=True), H_kv=2)


def test_unsupported_q_seq_shards():
    with pytest.raises(NotImplementedError, match=r"q_seq_shards=2 is not supported"):
        make_ring_attention(CausalMask(), q_seq_shards=2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_sizes=(8,)), "`block_sizes` must be None, a pair"),
        (dict(block_sizes=(8, 8), implementation=kernels.Blockwise()), "give the block sizes once"),
        (dict(mask_value="big"), "`mask_value` must be a number"),
        (dict(layout="striped"), "`layout` must be one of"),
        (dict(is_mqa=1), "`is_mqa` must be a bool"),
    ],
)
def test_invalid_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_ring_attention(CausalMask(), **kwargs)


def test_accepted_compatibility_options():
    """Splash's keyword values are accepted: `mask_value` is ignored (exact masking),
    `block_sizes` objects with `block_q` / `block_kv` configure the blockwise tiles."""

    @dataclasses.dataclass
    class BlockSizes:
        block_q: int = 16
        block_kv: int = 8
        block_q_dkv: int = 128

    kernel = make_ring_attention(CausalMask(), block_sizes=BlockSizes(), mask_value=-0.7 * 3.4e38)
    assert kernel._implementation() == kernels.Blockwise(block_q=16, block_kv=8)
    assert make_ring_attention(CausalMask(), block_sizes=(4, 4), implementation="xla")._implementation() == "xla"


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: DenseMask(np.ones((4, 4), np.int32)), TypeError, "must be boolean"),
        (lambda: DenseMask(np.ones((4, 5), bool)), ValueError, r"must be 2D \(S, S\)"),
        (lambda: LocalMask((-1, 2)), ValueError, "left size must be a non-negative int"),
        (lambda: CausalMask(shape=(4, 8)), ValueError, r"`shape` must be \(S, S\)"),
        (lambda: CausalMask(shape=(8, 8)) & np.ones((4, 4), bool), ValueError, "same sequence"),
        (lambda: CausalMask() & "causal", TypeError, "a mask must be an AbstractMask"),
    ],
)
def test_invalid_masks(make, error, match):
    with pytest.raises(error, match=match):
        make()
