"""`vidax_eqx.ring_splash`: the splash ring API's call sites, unchanged, on 8 simulated
devices against the float64 oracle with unscaled logits, forward and gradients.

The original's layout: one example's `q (H, L, D)` per device, a batch through
`jax.vmap(kernel)`, 1-D `SegmentIds(q=(L,), kv=(L,))`, MQA keys `(L, D)`, sinks `(H,)`.
Its mask is the `(L, L)` block every ring step applies, so the global mask of a local
mask `m` is `m` tiled over the `(n, n)` device blocks (`np.tile`), which the oracle takes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import oracle
from vidax_eqx import parallel, ring_splash
from vidax_eqx.ring_splash import (
    BlockSizes, DEFAULT_MASK_VALUE, make_ring_attention, ring_splash_attention,
    RingSplashAttentionKernel, SegmentIds,
)

N, B, H, L, D = 8, 2, 4, 16, 16
S = N * L
SEQ = P(None, None, "sp")  # (B, H, S, D): the sequence split over the ring
ROWS = P(None, "sp")  # (B, S) ids, (B, S, D) MQA keys


def _heads_first(x):
    return None if x is None else np.swapaxes(np.asarray(x), 1, 2)


def _reference(a, *, mask=None, causal=False, seg=None, sinks=None, cap=None, mqa=False):
    """The oracle in the original's layout: `{out, dq, dk, dv, dsinks}`."""
    k, v = (a["k"][:, :, :1] if mqa else a["k"]), (a["v"][:, :, :1] if mqa else a["v"])
    ref = oracle.attention(a["q"], k, v, mask=mask, causal=causal, segment_ids=seg,
                           sinks=sinks, scale=1.0, logits_soft_cap=cap, dout=a["dout"])
    dk, dv = (ref.dk[:, :, 0], ref.dv[:, :, 0]) if mqa else (_heads_first(ref.dk), _heads_first(ref.dv))
    return {"out": _heads_first(ref.out), "dq": _heads_first(ref.dq), "dk": dk, "dv": dv,
            "dsinks": ref.dsinks}


def _inputs(seed, *, sinks=False, segments=False, mqa=False):
    a = harness.attention_inputs(B, S, H, D, H_kv=None, seed=seed, sinks=sinks, segments=segments)
    args = [_heads_first(a["q"])]
    args += [a["k"][:, :, 0], a["v"][:, :, 0]] if mqa else [_heads_first(a["k"]), _heads_first(a["v"])]
    return a, args


def _check(kernel_call, a, args, ref, *, seg=False, sinks=False, mqa=False):
    """`kernel_call(q, k, v, segment_ids, sinks)` per example, vmapped over the batch inside
    `shard_map`; forward and gradients of q, k, v (and sinks) against `ref`."""
    kv_spec = ROWS if mqa else SEQ

    def local(q, k, v, seg_ids, s):
        ids = None if seg_ids is None else SegmentIds(q=seg_ids, kv=seg_ids)
        return jax.vmap(kernel_call, in_axes=(0, 0, 0, 0, None))(q, k, v, ids, s)

    extra = [a["seg"] if seg else None, a["sinks"] if sinks else None]
    names = ("out", "dq", "dk", "dv") + (("dsinks",) if sinks else ())
    harness.check_sharded(
        local, harness.mesh(sp=N), (SEQ, kv_spec, kv_spec, ROWS, P()), SEQ,
        (*args, *extra), _heads_first(a["dout"]), argnums=(0, 1, 2, 4) if sinks else (0, 1, 2),
        ref=ref, names=names)


def test_full_mask_vmapped_unscaled():
    """`make_ring_attention(np.ones((L, L)))`, `jax.vmap(kernel)`: the logits are not
    scaled (the library's own ring would scale by 1/sqrt(D) = 0.25 here)."""
    a, args = _inputs(0)
    kernel = make_ring_attention(np.ones((L, L), bool), ring_axis="sp")
    _check(lambda q, k, v, seg, s: kernel(q, k, v), a, args, _reference(a))


def test_causal_segments_sinks():
    """`ring_splash_attention(..., causal=True)` with 1-D segment ids and sinks."""
    a, args = _inputs(1, sinks=True, segments=True)

    def call(q, k, v, seg, s):
        return ring_splash_attention(np.ones((L, L), bool), None, q, k, v, seg, s, is_mqa=False,
                                     block_sizes=BlockSizes.get_default(), causal=True)

    ref = _reference(a, causal=True, seg=a["seg"], sinks=a["sinks"])
    _check(call, a, args, ref, seg=True, sinks=True)


def test_mqa_soft_cap_block_sizes():
    """MQA keys `(L, D)`, a logit soft cap, splash block sizes (the blockwise kernel's tiles)."""
    a, args = _inputs(2, mqa=True)
    a["q"] = a["q"] * 2.0  # logits past the cap
    args[0] = _heads_first(a["q"])
    kernel = make_ring_attention(np.ones((L, L), bool), is_mqa=True, logits_soft_cap=5.0,
                                 block_sizes=BlockSizes(block_q=8, block_kv=8))
    _check(lambda q, k, v, seg, s: kernel(q, k, v), a, args, _reference(a, cap=5.0, mqa=True),
           mqa=True)


def test_block_sparse_local_mask_through_jit():
    """A block-sparse (L, L) mask applied at every ring step (the original's semantics:
    the global mask is its (n, n) tiling); the kernel passed as a `jax.jit` argument, so
    its mask is traced and the ring's plan decided on device."""
    rng = np.random.default_rng(3)
    blocks = rng.random((L // 4, L // 4)) < 0.5
    np.fill_diagonal(blocks, True)  # every row sees something
    local = np.kron(blocks, np.ones((4, 4), bool))
    a, args = _inputs(3)
    kernel = make_ring_attention(local)

    @jax.jit
    def run(kernel, *args):
        def per_device(q, k, v):
            return jax.vmap(kernel)(q, k, v)
        out, pull = jax.vjp(lambda *x: jax.shard_map(per_device, mesh=harness.mesh(sp=N),
                                                     in_specs=SEQ, out_specs=SEQ)(*x), *args[:3])
        return (out, *pull(args[3]))

    got = run(kernel, *map(jnp.asarray, args), jnp.asarray(_heads_first(a["dout"])))
    ref = _reference(a, mask=np.tile(local, (N, N)))
    harness.assert_matches(dict(zip(("out", "dq", "dk", "dv"), got)), ref, np.float32,
                           ("out", "dq", "dk", "dv"))


def test_kernel_object_as_the_original_builds_it():
    """`RingSplashAttentionKernel(fwd, dkv, ring_axis=, causal=True, ...)` (the original's
    constructor), a JAX splash mask object, and a PyTree round trip."""
    splash = pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask")
    a, args = _inputs(4)
    kernel = RingSplashAttentionKernel(splash.CausalMask((L, L)), None, ring_axis="sp",
                                       causal=True, is_mqa=False)
    leaves, tree = jax.tree.flatten(kernel)
    again = jax.tree.unflatten(tree, leaves)
    assert again.kwargs == {"causal": True, "is_mqa": False} and again.ring_axis == "sp"
    _check(lambda q, k, v, seg, s: again(q, k, v), a, args, _reference(a, causal=True))


def test_names_the_original_exports():
    assert DEFAULT_MASK_VALUE == -0.7 * float(np.finfo(np.float32).max)
    assert ring_splash.RING_AXIS == "sp"
    assert parallel.SegmentIds is SegmentIds
    sizes = BlockSizes.get_default()
    assert (sizes.block_q, sizes.block_kv, sizes.has_backward_blocks) == (128, 128, True)


# -- errors -------------------------------------------------------------------------------


def _trace(fn, *arrays, spec=SEQ):
    return jax.eval_shape(jax.shard_map(fn, mesh=harness.mesh(sp=N), in_specs=spec,
                                        out_specs=spec), *arrays)


def test_errors():
    q = jnp.ones((B, H, S, D))
    kernel = make_ring_attention(np.ones((L, L), bool))
    with pytest.raises(ValueError, match=r"Ring axis 'sp' does not exist in the current context"):
        kernel(q[0, :, :L], q[0, :, :L], q[0, :, :L])
    with pytest.raises(ValueError, match=r"one example's \(H, L, D\).*jax\.vmap.*\(2, 4, 16, 16\)"):
        _trace(lambda q: kernel(q, q, q), q)
    wrong = make_ring_attention(np.ones((S, S), bool))
    with pytest.raises(ValueError, match=r"\(L, L\) block every ring step.*L = 16.*\(128, 128\).*"
                                         r"parallel\.make_ring_attention"):
        _trace(lambda q: jax.vmap(wrong)(q, q, q), q)
    with pytest.raises(TypeError, match=r"received the library's CausalMask.*parallel\.make_ring_attention"):
        make_ring_attention(parallel.CausalMask())
    hiding = RingSplashAttentionKernel(np.eye(L, dtype=bool), None, causal=True)
    with pytest.raises(ValueError, match=r"causal=True .* does not apply the mask"):
        _trace(lambda q: jax.vmap(hiding)(q, q, q), q)
    mqa = make_ring_attention(np.ones((L, L), bool), is_mqa=True)
    with pytest.raises(ValueError, match=r"is_mqa=True: `k` and `v` must be \(L, D\) = \(16, 16\)"):
        _trace(lambda q: jax.vmap(mqa)(q, q, q), q)
    with pytest.raises(ValueError, match=r"`q_seq_shards` must be a positive int; received 0"):
        make_ring_attention(np.ones((L, L), bool), q_seq_shards=0)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['scale'\]"):
        RingSplashAttentionKernel(np.ones((L, L), bool), None, scale=1.0)
