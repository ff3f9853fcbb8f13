"""Attention test cases: a curated list of feature combinations, their inputs, and the
runner that checks an implementation on them (`tests/test_kernels.py`,
`tests/test_pallas.py`).

Each `Case` describes one request; `Case.inputs(dtype, seed)` draws random
inputs (never zeros) as NumPy arrays and returns the keyword arguments for
`vidax_eqx.kernels` and for the float64 oracle. Sequence lengths are chosen
not to be multiples of any block size (1, 7, 33, 77, 100). `run` runs one case
and its VJP under one `jax.jit`, `check_all` compares everything with the oracle,
`empty_row_inputs` builds cases where some query rows see nothing.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import harness
import oracle
from vidax_eqx import kernels


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    B: int = 2
    S_q: int = 33
    S_k: int = 33
    H: int = 4
    H_kv: int = 4
    D: int = 16
    bias: tuple[int, ...] | None = None  # bias shape, broadcastable to (B, H, S_q, S_k)
    mask: tuple[int, ...] | None = None  # mask shape
    segments: str | None = None  # None | "shared" (one (B, S) array) | "split" (SegmentIds)
    sinks: bool = False
    positions: str | None = None  # None | "perm" | "offset"
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    scale: float | None = None
    soft_cap: float | None = None
    bias_offset: float = 0.0  # added to the bias (large values test overflow)

    def __str__(self) -> str:
        return self.name

    def inputs(self, dtype=np.float32, seed: int = 0):
        """Returns `(arrays, static)`.

        `arrays`: dict with `q, k, v, dout, dlse` and the optional `bias, sinks,
        mask, seg_q, seg_kv, q_pos, kv_pos` (NumPy; q/k/v/dout in `dtype`, bias
        and sinks float32). `static`: `causal, window, scale, logits_soft_cap`.
        """
        rng = np.random.default_rng(seed)
        B, S_q, S_k, H, H_kv, D = self.B, self.S_q, self.S_k, self.H, self.H_kv, self.D
        a = harness.attention_inputs(B, S_q, H, D, H_kv=H_kv, S_k=S_k, dtype=dtype, rng=rng, dlse=True)
        if self.bias is not None:
            a["bias"] = harness.normal(rng, self.bias, offset=self.bias_offset)
        if self.mask is not None:
            a["mask"] = rng.random(self.mask) < 0.7
        if self.sinks:
            a["sinks"] = harness.normal(rng, (H,))
        if self.segments is not None:
            a["seg_q"], a["seg_kv"] = _segments(rng, B, S_q, S_k, shared=self.segments == "shared")
        if self.positions == "perm":
            a["q_pos"] = rng.permutation(S_q).astype(np.int32)
            a["kv_pos"] = (rng.permutation(S_k) + 3).astype(np.int32)
        elif self.positions == "offset":  # bottom-right aligned queries
            a["q_pos"] = (np.arange(S_q) + S_k - S_q).astype(np.int32)
            a["kv_pos"] = np.arange(S_k, dtype=np.int32)
        static = dict(
            causal=self.causal, window=self.window, scale=self.scale, logits_soft_cap=self.soft_cap
        )
        return a, static


def _segments(rng, B, S_q, S_k, shared):
    """Per-batch-element segment ids that differ across the batch, with padding
    (`harness.segment_ids`): even elements sorted runs of ids 0..2, odd ones ids drawn
    at random from {0, 1, 2} (not contiguous), each with a padded (-1) tail. For
    `split`, q and kv get ids of their own lengths from the same set."""

    def draw(S):
        return harness.segment_ids(rng, B, S, pad=(max(1, S // 6), max(1, S // 10)) if S > 1 else (0, 0))

    seg_q = draw(S_q)
    if shared:
        return seg_q, seg_q
    return seg_q, draw(S_k)


def kernel_kwargs(arrays, static, segments_mode):
    """Keyword arguments for `vidax_eqx.kernels.attention` (non-differentiable parts).

    `bias` and `sinks` are left out: the tests pass them as differentiable inputs.
    """
    kw = dict(static)
    if "mask" in arrays:
        kw["mask"] = jnp.asarray(arrays["mask"])
    if "seg_q" in arrays:
        if segments_mode == "shared":
            kw["segment_ids"] = jnp.asarray(arrays["seg_q"])
        else:
            kw["segment_ids"] = kernels.SegmentIds(
                q=jnp.asarray(arrays["seg_q"]), kv=jnp.asarray(arrays["seg_kv"])
            )
    if "q_pos" in arrays:
        kw["q_positions"] = jnp.asarray(arrays["q_pos"])
        kw["kv_positions"] = jnp.asarray(arrays["kv_pos"])
    return kw


def oracle_kwargs(arrays, static):
    kw = dict(static)
    for src, dst in (("bias", "bias"), ("mask", "mask"), ("sinks", "sinks"),
                     ("q_pos", "q_positions"), ("kv_pos", "kv_positions")):
        if src in arrays:
            kw[dst] = arrays[src]
    if "seg_q" in arrays:
        kw["segment_ids"] = (arrays["seg_q"], arrays["seg_kv"])
    return kw


CASES = [
    Case("plain"),
    Case("gqa", S_q=77, S_k=77, H=4, H_kv=2),
    Case("mqa", S_q=33, S_k=100, H=4, H_kv=1),
    Case("cross_q_lt_k", S_q=7, S_k=100),
    Case("cross_q_gt_k", S_q=100, S_k=7, H_kv=2),
    Case("q_len_1", S_q=1, S_k=77),
    Case("kv_len_1", S_q=33, S_k=1),
    Case("scale", scale=0.3),
    Case("causal", S_q=77, S_k=77, causal=True),
    Case("causal_q_lt_k", S_q=33, S_k=77, causal=True),
    Case("causal_q_gt_k", S_q=77, S_k=33, causal=True),
    Case("causal_bottom_right", S_q=33, S_k=77, positions="offset", causal=True),
    Case("window_3_5", S_q=77, S_k=77, window=(3, 5)),
    Case("window_0_0", S_q=77, S_k=77, window=(0, 0)),
    Case("window_None_3", S_q=77, S_k=77, window=(None, 3)),
    Case("window_8_None_causal", S_q=77, S_k=77, window=(8, None), causal=True),
    Case("window_None_None", S_q=33, S_k=33, window=(None, None)),
    Case("positions_perm", S_q=33, S_k=77, positions="perm"),
    Case("positions_perm_causal_window", S_q=33, S_k=77, positions="perm", causal=True, window=(10, 10)),
    Case("segments_shared", S_q=77, S_k=77, segments="shared"),
    Case("segments_split", S_q=33, S_k=100, segments="split"),
    Case("bias_BHqk", S_q=33, S_k=77, bias=(2, 4, 33, 77)),
    Case("bias_1Hqk", S_q=33, S_k=77, H_kv=2, bias=(1, 4, 33, 77)),
    Case("bias_B11k", S_q=33, S_k=77, bias=(2, 1, 1, 77)),
    Case("bias_qk", S_q=33, S_k=77, bias=(33, 77)),
    Case("bias_1H1k", S_q=33, S_k=77, H_kv=1, bias=(1, 4, 1, 77)),
    Case("mask_BHqk", S_q=33, S_k=77, mask=(2, 4, 33, 77)),
    Case("mask_B11k", S_q=33, S_k=77, mask=(2, 1, 1, 77)),
    Case("mask_qk", S_q=33, S_k=77, mask=(33, 77)),
    Case("mask_1Hq1", S_q=33, S_k=77, H_kv=2, mask=(1, 4, 33, 1)),
    Case("sinks", S_q=33, S_k=77, H_kv=2, sinks=True),
    Case("soft_cap", S_q=33, S_k=77, scale=1.0, soft_cap=2.0),
    Case(
        "causal+segments+sinks+softcap+gqa",
        S_q=77, S_k=77, H_kv=2, causal=True, segments="shared", sinks=True, soft_cap=3.0, scale=0.7,
    ),
    Case("window+bias+mask", S_q=77, S_k=100, window=(5, 9), bias=(2, 4, 77, 100), mask=(2, 1, 77, 100)),
    Case(
        "everything_mqa",
        S_q=33, S_k=100, H_kv=1, positions="perm", causal=True, window=(30, 2), segments="split",
        bias=(2, 1, 33, 100), mask=(1, 4, 33, 100), sinks=True, soft_cap=4.0,
    ),
]
CASES_BY_NAME = {c.name: c for c in CASES}


# -- running a case ------------------------------------------------------------------


GRAD_NAMES = ("dq", "dk", "dv", "dbias", "dsinks")


def run(impl, case: Case, dtype=np.float32, seed=0, arrays=None, static=None, dlse=False):
    """Runs one attention request and its VJP under a single `jax.jit`.

    `dlse=False`: `jax.vjp` of `attention` (cotangent `dout`), plus the forward of
    `attention_fwd` for `lse`. `dlse=True`: `jax.vjp` of `attention_fwd` with
    cotangents `(dout, dlse)`. Returns `(arrays, static, result)` with NumPy
    `out`, `lse` and `grads` (the 5-tuple for q, k, v, bias, sinks).
    """
    if arrays is None:
        arrays, static = case.inputs(dtype, seed)
    kw = kernel_kwargs(arrays, static, case.segments)

    def att(q, k, v, bias, sinks):
        return kernels.attention(q, k, v, bias=bias, sinks=sinks, implementation=impl, **kw)

    def fwd(q, k, v, bias, sinks):
        return kernels.attention_fwd(q, k, v, bias=bias, sinks=sinks, implementation=impl, **kw)

    @jax.jit
    def f(q, k, v, bias, sinks, dout, dlse_):
        if dlse:
            (out, lse), vjp = jax.vjp(fwd, q, k, v, bias, sinks)
            return dict(out=out, lse=lse, grads=vjp((dout, dlse_)))
        out, vjp = jax.vjp(att, q, k, v, bias, sinks)
        _, lse = fwd(q, k, v, bias, sinks)
        return dict(out=out, lse=lse, grads=vjp(dout))

    args = [jnp.asarray(arrays[n]) if n in arrays else None for n in ("q", "k", "v", "bias", "sinks")]
    res = f(*args, jnp.asarray(arrays["dout"]), jnp.asarray(arrays["dlse"]))
    return arrays, static, jax.tree.map(np.asarray, res)


def reference(arrays, static, dlse=False):
    """The float64 oracle on a case's arrays, gradients included (of `dlse` too if asked)."""
    return oracle.attention(
        arrays["q"], arrays["k"], arrays["v"], dout=arrays["dout"],
        dlse=arrays["dlse"] if dlse else None, **oracle_kwargs(arrays, static),
    )


def check_grads(grads, ref, arrays, dtype, label):
    """The 5 gradients (q, k, v, bias, sinks) against the oracle's: `None` where it has
    none, else finite, of its shape, within the dtype's tolerance; q/k/v's dtypes kept."""
    for name, got in zip(GRAD_NAMES, grads):
        want = getattr(ref, name)
        if want is None:
            assert got is None, f"{label}: {name} should be None"
            continue
        assert got.shape == want.shape, (label, name, got.shape, want.shape)
        assert np.all(np.isfinite(got)), f"{label}: {name} has non-finite values"
        oracle.assert_close(got, want, dtype, f"{label} {name}")
    assert grads[0].dtype == arrays["q"].dtype
    assert grads[1].dtype == arrays["k"].dtype and grads[2].dtype == arrays["v"].dtype


def check_all(arrays, static, res, dtype, dlse=False):
    """`run`'s result against the oracle: out, lse (dtypes and shapes too), gradients."""
    B, S_q, H, D = arrays["q"].shape
    ref = reference(arrays, static, dlse=dlse)
    assert res["out"].dtype == arrays["q"].dtype and res["out"].shape == (B, S_q, H, D)
    assert res["lse"].dtype == np.float32 and res["lse"].shape == (B, H, S_q)
    assert np.all(np.isfinite(res["out"]))
    assert not np.any(np.isnan(res["lse"]))
    oracle.assert_close(res["out"], ref.out, dtype, "out")
    oracle.assert_close(res["lse"], ref.lse, dtype, "lse")
    label = "vjp(attention_fwd) with dlse" if dlse else "vjp(attention)"
    check_grads(res["grads"], ref, arrays, dtype, label)


def empty_row_inputs(kind: str, seed=3):
    """Inputs where some query rows (and, with 16x32 tiles, whole tiles) see nothing."""
    rng = np.random.default_rng(seed)
    B, S_q, S_k, H, H_kv, D = 2, 77, 100, 4, 2, 16
    case = Case(kind, B=B, S_q=S_q, S_k=S_k, H=H, H_kv=H_kv, D=D)
    arrays, static = case.inputs(np.float32, seed)
    if kind == "segments":
        # q has ids 0..2, 7 (absent from kv) and -1 (padding); kv has ids 0..2 and -1.
        seg_q = rng.integers(0, 3, (B, S_q)).astype(np.int32)
        seg_q[0, :20] = 7
        seg_q[1, 40:] = -1
        seg_q[1, 5] = 7
        seg_kv = rng.integers(0, 3, (B, S_k)).astype(np.int32)
        seg_kv[:, 90:] = -1
        arrays.update(seg_q=seg_q, seg_kv=seg_kv)
        case = Case(kind, B=B, S_q=S_q, S_k=S_k, H=H, H_kv=H_kv, D=D, segments="split")
    elif kind in ("causal_positions", "causal_positions_sinks"):
        # Queries 0..39 precede every key: causal hides all keys from them.
        arrays.update(q_pos=np.arange(S_q, dtype=np.int32), kv_pos=np.arange(40, 40 + S_k, dtype=np.int32))
        static["causal"] = True
        case = Case(kind, B=B, S_q=S_q, S_k=S_k, H=H, H_kv=H_kv, D=D, positions="given", causal=True,
                    sinks=kind.endswith("sinks"))
        if case.sinks:
            arrays["sinks"] = harness.normal(rng, (H,))
    elif kind == "mask":
        mask = rng.random((B, 1, S_q, S_k)) < 0.5
        mask[0, :, :35] = False  # more than two full 16-row tiles
        mask[1, :, 50:60] = False
        arrays["mask"] = mask
        arrays["bias"] = harness.normal(rng, (B, H, S_q, S_k))
        case = Case(kind, B=B, S_q=S_q, S_k=S_k, H=H, H_kv=H_kv, D=D, mask=mask.shape, bias=(B, H, S_q, S_k))
    elif kind == "window":
        # Keys sit at even positions 0, 2, ...; window (0, 0) leaves odd queries empty.
        arrays.update(q_pos=np.arange(S_q, dtype=np.int32), kv_pos=2 * np.arange(S_k, dtype=np.int32))
        static["window"] = (0, 0)
        case = Case(kind, B=B, S_q=S_q, S_k=S_k, H=H, H_kv=H_kv, D=D, positions="given", window=(0, 0))
    return case, arrays, static
