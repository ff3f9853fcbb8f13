"""Key-only padding: `kv_lengths=` on every implementation that serves it.

Keys at index `>= kv_lengths[b]` are invisible to every query; every query row is
computed (unlike segment id -1, whose padded tokens also see nothing). Checked
against the float64 oracle (`oracle.attention(kv_lengths=...)`): forward, lse and the
gradients of `attention_fwd` (dq, dk, dv, dbias, dsinks) with random cotangents on
`out` and `lse`, for `"xla"`, `"blockwise"`, `"pallas_tpu"` and `"pallas_gpu"` (both in
Pallas interpret mode); lengths 0, S_k and in between; lengths that are not multiples
of any block; GQA; combined with causal masks, segment ids, bias, sinks, windows and
soft caps. Then: NaN in padded keys does not leak; bad `kv_lengths` raise naming
the argument; `"auto"` at 33k tokens picks the fast kernel on GPU and TPU; cuDNN
receives the lengths as `key_value_seq_lengths`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
from vidax_eqx import kernels
from vidax_eqx.kernels import _cudnn
from vidax_eqx.kernels._args import normalize


IMPLS = {
    "xla": "xla",
    "blockwise": kernels.Blockwise(block_q=8, block_kv=8),
    "pallas_tpu": kernels.PallasTpu(interpret=True, block_q=128, block_kv=128),
    "pallas_gpu": kernels.PallasGpu(interpret=True, block_q=16, block_k=16, block_bwd=16),
}

# name: (B, S_q, S_k, H, H_kv, D, lengths, options). Lengths include 0, S_k and values
# that are multiples of no block size.
CASES = {
    # S_q != S_k, GQA, a bias (with gradient) and sinks (with gradient)
    "cross_bias_sinks": (3, 13, 19, 4, 2, 8, [0, 19, 7], {"bias": True, "sinks": True}),
    # shared segment ids with padding, causal, GQA, S not a multiple of 16
    "causal_segments": (3, 21, 21, 4, 2, 8, [5, 21, 0], {"segments": True, "causal": True}),
    # self-attention, GQA, S_k a multiple of the blocks (the Triton kernel's cross case)
    "plain": (2, 32, 32, 2, 1, 16, [17, 32], {}),
    "window_soft_cap": (2, 24, 24, 2, 2, 8, [11, 24], {"window": (5, 3), "logits_soft_cap": 2.0}),
    "mask": (2, 12, 20, 2, 1, 8, [9, 0], {"mask": True}),
}


def _inputs(name: str):
    B, S_q, S_k, H, H_kv, D, lengths, opts = CASES[name]
    rng = np.random.default_rng(len(name))
    a = {
        "q": harness.normal(rng, (B, S_q, H, D)),
        "k": harness.normal(rng, (B, S_k, H_kv, D)),
        "v": harness.normal(rng, (B, S_k, H_kv, D)),
        "dout": harness.normal(rng, (B, S_q, H, D)),
        "dlse": harness.normal(rng, (B, H, S_q)),
    }
    kw = {"kv_lengths": np.asarray(lengths, np.int32)}
    if opts.get("bias"):
        kw["bias"] = harness.normal(rng, (B, 1, S_q, S_k))
    if opts.get("sinks"):
        kw["sinks"] = harness.normal(rng, (H,))
    if opts.get("segments"):
        kw["segment_ids"] = harness.segment_ids(rng, B, S_q, ids=2, scattered=False)
    if opts.get("mask"):
        kw["mask"] = rng.random((B, 1, S_q, S_k)) < 0.7
    for key in ("causal", "window", "logits_soft_cap"):
        if key in opts:
            kw[key] = opts[key]
    return a, kw


def _reference(a, kw):
    kw = dict(kw)
    return oracle.attention(a["q"], a["k"], a["v"], dout=a["dout"], dlse=a["dlse"], **kw)


def _run(impl, a, kw):
    """`attention_fwd`'s `(out, lse)` and the VJP with the cotangent `(dout, dlse)`."""
    arrays = {n: x for n, x in kw.items() if isinstance(x, np.ndarray)}
    static = {n: x for n, x in kw.items() if n not in arrays}
    diff = ("bias", "sinks")

    @jax.jit
    def run(q, k, v, arrays, dout, dlse):
        const = {n: x for n, x in arrays.items() if n not in diff}

        def f(q, k, v, d):
            return kernels.attention_fwd(q, k, v, **d, **const, **static, implementation=impl)

        d = {n: x for n, x in arrays.items() if n in diff}
        out, pull = jax.vjp(f, q, k, v, d)
        return out, pull((dout, dlse))

    put = lambda x: jax.device_put(x)
    return run(*map(put, (a["q"], a["k"], a["v"])), jax.tree.map(put, arrays), put(a["dout"]), put(a["dlse"]))


def _unsupported(impl, a, kw) -> list[str]:
    """What `impl` cannot serve of the case (on CPU; the Pallas kernels interpret)."""
    impl = kernels.implementations()[impl] if isinstance(impl, str) else impl
    ops, opts = normalize(a["q"], a["k"], a["v"], **kw)
    return impl.unsupported(kernels.Request.of(ops, opts, needs_lse=True))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", list(IMPLS))
def test_matches_oracle(impl, case):
    a, kw = _inputs(case)
    missing = _unsupported(IMPLS[impl], a, kw)
    if missing:
        # A refusal must be for another feature of the case, never for kv_lengths itself.
        assert not any("kv_lengths" in r for r in missing), missing
        with pytest.raises(NotImplementedError):
            kernels.attention_fwd(a["q"], a["k"], a["v"], **kw, implementation=IMPLS[impl])
        pytest.skip(f"{impl} does not serve {case}: {missing}")
    (out, lse), (dq, dk, dv, d) = _run(IMPLS[impl], a, kw)
    ref = _reference(a, kw)
    lengths = kw["kv_lengths"]
    for name, got, want in [("out", out, ref.out), ("lse", lse, ref.lse), ("dq", dq, ref.dq),
                            ("dk", dk, ref.dk), ("dv", dv, ref.dv)]:
        oracle.assert_close(got, want, np.float32, f"{impl}/{case} {name}")
    if "bias" in kw:
        oracle.assert_close(d["bias"], ref.dbias, np.float32, f"{impl}/{case} dbias")
    if "sinks" in kw:
        oracle.assert_close(d["sinks"], ref.dsinks, np.float32, f"{impl}/{case} dsinks")
    # Padded keys get exactly zero gradient; every query row is computed.
    padded = np.arange(a["k"].shape[1])[None, :] >= lengths[:, None]
    assert np.all(np.asarray(dk)[padded] == 0) and np.all(np.asarray(dv)[padded] == 0)


def test_every_query_is_computed_unlike_segment_padding():
    """The two padding semantics side by side: with `kv_lengths` a query row past the
    length is computed over the valid keys; with segment id -1 it is 0."""
    rng = np.random.default_rng(1)
    q, k, v = (jax.device_put(harness.normal(rng, (1, 8, 2, 4))) for _ in range(3))
    out = kernels.attention(q, k, v, kv_lengths=jnp.array([5]), implementation="xla")
    seg = jnp.array([[0] * 5 + [-1] * 3])
    seg_out = kernels.attention(q, k, v, segment_ids=seg, implementation="xla")
    ref = oracle.attention(q, k, v, kv_lengths=[5])
    oracle.assert_close(out, ref.out, np.float32, "out")
    assert np.all(np.asarray(seg_out)[:, 5:] == 0)
    assert np.abs(np.asarray(out)[:, 5:]).min() > 0
    np.testing.assert_allclose(np.asarray(out)[:, :5], np.asarray(seg_out)[:, :5], atol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "blockwise", "pallas_tpu", "pallas_gpu"])
def test_nan_in_padded_keys_does_not_leak(impl):
    a, kw = _inputs("plain")
    clean = _run(IMPLS[impl], a, kw)
    lengths = kw["kv_lengths"]
    dirty = dict(a)
    for name in ("k", "v"):
        x = a[name].copy()
        for b, n in enumerate(lengths):
            x[b, n:] = np.nan if name == "k" else np.inf
        dirty[name] = x
    got = _run(IMPLS[impl], dirty, kw)
    for c, g in zip(jax.tree.leaves(clean), jax.tree.leaves(got)):
        assert np.isfinite(np.asarray(g)[np.isfinite(np.asarray(c))]).all()
        np.testing.assert_array_equal(np.asarray(g), np.asarray(c))


@pytest.mark.parametrize(
    "lengths, match",
    [
        (np.array([-1, 3], np.int32), r"`kv_lengths` must lie in \[0, S_k\] = \[0, 6\].*received \[-1, 3\]"),
        (np.array([2, 7], np.int32), r"`kv_lengths` must lie in \[0, S_k\] = \[0, 6\].*received \[2, 7\]"),
        (np.array([2, 3, 4], np.int32), r"`kv_lengths` must have shape \(B,\) = \(2,\).*received shape \(3,\)"),
        (np.array([[2, 3]], np.int32), r"`kv_lengths` must have shape \(B,\) = \(2,\).*received shape \(1, 2\)"),
        (np.array([2.0, 3.0], np.float32), r"`kv_lengths` must have an integer dtype.*float32"),
    ],
)
def test_bad_kv_lengths(lengths, match):
    q = jnp.ones((2, 6, 2, 4))
    with pytest.raises(ValueError, match=match):
        kernels.attention(q, q, q, kv_lengths=lengths)


def test_traced_kv_lengths_are_clipped():
    """Traced lengths cannot be checked at trace time: they act as clipped to [0, S_k]
    (a runtime check would put a host callback into the program, which neither
    `jax.export` nor `shard_map`'s varying-axes check accepts)."""
    q = jnp.asarray(np.random.default_rng(0).normal(size=(2, 6, 2, 4)).astype(np.float32))
    f = jax.jit(lambda q, n: kernels.attention(q, q, q, kv_lengths=n, implementation="xla"))
    clipped = f(q, jnp.array([-2, 9], jnp.int32))
    np.testing.assert_array_equal(np.asarray(clipped), np.asarray(f(q, jnp.array([0, 6], jnp.int32))))


def test_kv_lengths_varying_over_a_mesh_axis():
    """Inside shard_map, lengths that differ per device (batch sharded) are served."""
    from jax.sharding import PartitionSpec as P

    mesh = harness.mesh(dp=4)
    q = jnp.asarray(np.random.default_rng(1).normal(size=(4, 6, 2, 4)).astype(np.float32))
    lengths = jnp.array([3, 5, 6, 0], jnp.int32)
    attend = lambda q, n: kernels.attention(q, q, q, kv_lengths=n, implementation="xla")
    sharded = jax.jit(jax.shard_map(attend, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P("dp")))
    np.testing.assert_allclose(np.asarray(sharded(q, lengths)), np.asarray(attend(q, lengths)), rtol=1e-6, atol=1e-6)


@pytest.fixture
def gpu_host(monkeypatch):
    """Dispatch as on a GPU host (where jax.nn's cuDNN path can be traced)."""
    monkeypatch.setattr(_cudnn, "_gpu_host", lambda: True)


# Wan 1.3B attention at 33k tokens: 12 heads of 128, bfloat16.
_LONG = jax.ShapeDtypeStruct((1, 33_000, 12, 128), jnp.bfloat16)
_LENGTHS = jax.ShapeDtypeStruct((1,), jnp.int32)


@pytest.mark.parametrize("platform, needs_lse, want", [
    ("gpu", False, "pallas_gpu"),  # no GPU here: cuDNN cannot be traced, the Triton kernel serves
    ("gpu", True, "pallas_gpu"),
    ("tpu", False, "pallas_tpu"),
    ("tpu", True, "pallas_tpu"),
])
def test_auto_picks_the_fast_kernel_at_33k(platform, needs_lse, want):
    q = _LONG
    got = kernels.select_implementation(q, q, q, kv_lengths=_LENGTHS, platform=platform, needs_lse=needs_lse)
    assert got == want
    report = kernels.implementation_report(q, q, q, kv_lengths=_LENGTHS, platform=platform)
    assert not any("kv_lengths" in r for reasons in report.values() for r in reasons), report


def test_auto_picks_cudnn_on_a_gpu_host(gpu_host):
    q = _LONG
    assert kernels.select_implementation(q, q, q, kv_lengths=_LENGTHS, platform="gpu") == "cudnn"
    assert kernels.select_implementation(q, q, q, kv_lengths=_LENGTHS, causal=True, platform="gpu") == "cudnn"


def test_cudnn_receives_the_key_lengths(monkeypatch):
    """cuDNN cannot be traced without a GPU: its argument mapping is checked on a spy
    standing in for `jax.nn.dot_product_attention`."""
    seen = {}

    def spy(q, k, v, bias=None, mask=None, **kwargs):
        seen.update(kwargs)
        return jnp.zeros_like(q)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    q = jnp.ones((2, 16, 4, 8), jnp.bfloat16)
    k = jnp.ones((2, 24, 2, 8), jnp.bfloat16)
    lengths = jnp.array([3, 24], jnp.int32)
    ops, opts = normalize(q, k, k, kv_lengths=lengths, causal=True)
    kernels.Cudnn().fwd(ops, opts)
    assert seen["implementation"] == "cudnn"
    assert seen["is_causal"] is True
    np.testing.assert_array_equal(np.asarray(seen["key_value_seq_lengths"]), [3, 24])
    assert seen.get("query_seq_lengths") is None  # every query row computed


def test_the_gpu_kernel_refuses_what_its_key_channel_cannot_carry():
    gpu = kernels.PallasGpu(interpret=True)
    for shape, dtype, words in [((1, 32, 2, 256), jnp.bfloat16, "head_dim 256"),
                                ((1, 32, 2, 64), jnp.float16, "float16")]:
        q = jnp.ones(shape, dtype)
        with pytest.raises(NotImplementedError, match=rf"'pallas_gpu'.*kv_lengths.*{words}|{words}.*kv_lengths"):
            kernels.attention(q, q, q, kv_lengths=jnp.array([3]), implementation=gpu)
