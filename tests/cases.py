"""Attention test cases: a curated list of feature combinations and their inputs.

Each `Case` describes one request; `Case.inputs(dtype, seed)` draws random
inputs (never zeros) as NumPy arrays and returns the keyword arguments for
`vidax_eqx.kernels` and for the float64 oracle. Sequence lengths are chosen
not to be multiples of any block size (1, 7, 33, 77, 100).
"""

import dataclasses

import numpy as np


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
        a = {}
        a["q"] = rng.standard_normal((B, S_q, H, D)).astype(dtype)
        a["k"] = rng.standard_normal((B, S_k, H_kv, D)).astype(dtype)
        a["v"] = rng.standard_normal((B, S_k, H_kv, D)).astype(dtype)
        a["dout"] = rng.standard_normal((B, S_q, H, D)).astype(dtype)
        a["dlse"] = rng.standard_normal((B, H, S_q)).astype(np.float32)
        if self.bias is not None:
            a["bias"] = (self.bias_offset + rng.standard_normal(self.bias)).astype(np.float32)
        if self.mask is not None:
            a["mask"] = rng.random(self.mask) < 0.7
        if self.sinks:
            a["sinks"] = rng.standard_normal((H,)).astype(np.float32)
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
    """Per-batch-element segment ids that differ across the batch, with padding.

    Element 0: sorted runs of ids 0..2 and a padded (-1) tail; element 1: ids
    drawn at random from {0, 1, 2} (not contiguous), with a padded tail too.
    For `split`, q and kv get ids of their own lengths from the same set.
    """

    def draw(S, b):
        if b % 2 == 0:
            ids = np.sort(rng.integers(0, 3, S))
            pad = max(1, S // 6) if S > 1 else 0
        else:
            ids = rng.integers(0, 3, S)
            pad = max(1, S // 10) if S > 1 else 0
        if pad:
            ids[S - pad :] = -1
        return ids

    seg_q = np.stack([draw(S_q, b) for b in range(B)]).astype(np.int32)
    if shared:
        return seg_q, seg_q
    seg_kv = np.stack([draw(S_k, b) for b in range(B)]).astype(np.int32)
    return seg_q, seg_kv


def kernel_kwargs(arrays, static, segments_mode):
    """Keyword arguments for `vidax_eqx.kernels.attention` (non-differentiable parts).

    `bias` and `sinks` are left out: the tests pass them as differentiable inputs.
    """
    import jax.numpy as jnp

    from vidax_eqx import kernels

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
