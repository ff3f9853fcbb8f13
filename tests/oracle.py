"""An independent float64 NumPy oracle for attention, and the tolerance table.

Imports nothing from `vidax_eqx`: it materializes the whole `(B, H, S_q, S_k)`
score matrix in float64 and implements the documented semantics directly.

- Layout: `q (B, S_q, H, D)`, `k`/`v (B, S_k, H_kv, D)`; query head `h` uses
  key/value head `h // (H // H_kv)`.
- Logits: `s = scale * q.k`; with a soft cap `c`: `s = c * tanh(s / c)`; then
  `s += bias`.
- Visible `(b, h, i, j)`: `mask & seg_q[b, i] == seg_kv[b, j] & seg_q[b, i] >= 0
  & (not causal or kv_pos[j] <= q_pos[i]) & window`, where the window
  `(left, right)` is `q_pos[i] - left <= kv_pos[j] <= q_pos[i] + right`.
- Key-only padding `kv_lengths (B,)`: key `j` of batch row `b` is visible only
  where `j < kv_lengths[b]` (its index along the key axis, whatever its position).
- Sinks `(H,)`: an extra logit per head in each row's softmax with value 0.
- `lse (B, H, S_q)` includes the sink; a row with nothing visible and no sink has
  out 0 and lse -inf.

`sliding_tile_dense` builds the dense mask of sliding tile attention (the
documented semantics of `kernels.SlidingTileMask`, by enumerating the tile layout
token by token), to hand to the oracle as `mask`; `sliding_tile_of` does it for a
mask object, reading its fields only. `block_causal_dense` does the same for the
frame-block causal mask of `kernels.BlockCausalMask` (frames enumerated in raster order).

The layers (`linear`, `rms_norm`, `layer_norm`, `rope`, and the attention modules
`wan_self_attention`, `wan_cross_attention`, `cogvideox_attention`) are float64
re-derivations of the PyTorch reference models' math; the modules are read by
attribute (`m.q.weight`, `m.eps`, ...), so any object of that shape will do.

The backward is derived analytically (softmax Jacobian including the sink
column) and is itself checked against finite differences in the test suite.
"""

import dataclasses
import itertools

import numpy as np


# One tolerance per dtype, and nothing else: a result passes when
# `max|got - ref| <= TOL[dtype] * max(max|ref|, 1)` (see `rel_error`). The floor
# of 1 is the natural scale of these quantities (inputs are standard normal, so
# outputs and gradients are O(1)); without it a gradient that is exactly 0 in
# exact arithmetic (one visible key per row: a saturated softmax) would be judged
# on pure float32 rounding noise. float32 is close to exact; the low-precision
# dtypes are dominated by rounding of the inputs to the matmuls and of the output.
TOLERANCES: dict[str, float] = {
    "float32": 1e-5,
    "bfloat16": 2e-2,
    "float16": 5e-3,
    # float64 inputs run float64 statistics ("xla", "blockwise"): close to exact.
    "float64": 1e-12,
}


# float32 on a TPU (the device tests, `VIDAX_TEST_DEVICE=1`: conftest's `_chip_tolerance`).
# There the kernels compiled by Mosaic agree with the oracle to 8.9e-5 at most (every case
# of `cases.CASES`, forward and gradients, at the highest matmul precision; lse 2.0e-5),
# 1.7e-4 with a soft cap (the chip's tanh), on a TPU v5e on 2026-12-06, where the same
# kernels in interpret mode on the CPU stay under 1e-6: the chip's own exp, log and tanh,
# and its float32 products. 5e-4 keeps a margin of 3 over the worst; a real fault (a dropped
# key block, a wrong mask, a lost gradient term) is O(1e-2) or more.
CHIP_FLOAT32 = 5e-4


def tolerance(dtype) -> float:
    return TOLERANCES[np.dtype(dtype).name]


# `[file, test id]`: where `assert_close` records each comparison (set per test by
# conftest's `_chip_tolerance` from `VIDAX_TEST_DEVICE_ERRORS`), or `[None, ""]`.
ERRORS_LOG: list = [None, ""]


def rel_error(got, ref) -> float:
    """`max|got - ref| / max(max|ref|, 1)` in float64; infinities must agree exactly."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    finite = np.isfinite(ref)
    if not np.array_equal(finite, np.isfinite(got)):
        return np.inf
    if not np.array_equal(got[~finite], ref[~finite]):
        return np.inf
    if not finite.any():
        return 0.0
    err = np.max(np.abs(got[finite] - ref[finite]))
    return float(err / max(np.max(np.abs(ref[finite])), 1.0))


def assert_close(got, ref, dtype, name: str = "", factor: float = 1.0) -> None:
    tol = factor * tolerance(dtype)
    err = rel_error(got, ref)
    if ERRORS_LOG[0]:  # the device tests' record of every comparison (conftest)
        with open(ERRORS_LOG[0], "a") as f:
            f.write(f"{ERRORS_LOG[1]}\t{name}\t{np.dtype(dtype).name}\t{err:.3e}\t{tol:.1e}\n")
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g} (dtype {np.dtype(dtype).name})"


@dataclasses.dataclass
class Result:
    out: np.ndarray  # (B, S_q, H, D)
    lse: np.ndarray  # (B, H, S_q)
    dq: np.ndarray | None = None
    dk: np.ndarray | None = None
    dv: np.ndarray | None = None
    dbias: np.ndarray | None = None  # bias's own shape
    dsinks: np.ndarray | None = None  # (H,)


def f64(x):
    """`x` as a float64 NumPy array (`None` stays `None`)."""
    return None if x is None else np.asarray(x, dtype=np.float64)


def visibility(B, H, S_q, S_k, *, mask=None, seg_q=None, seg_kv=None, q_pos=None,
               kv_pos=None, causal=False, window=None, kv_lengths=None) -> np.ndarray:
    """Boolean `(B, H, S_q, S_k)`: may query `i` of head `h` see key `j`."""
    q_pos = np.arange(S_q) if q_pos is None else np.asarray(q_pos, np.int64)
    kv_pos = np.arange(S_k) if kv_pos is None else np.asarray(kv_pos, np.int64)
    vis = np.ones((B, H, S_q, S_k), bool)
    if mask is not None:
        mask = np.asarray(mask, bool)
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        vis &= np.broadcast_to(mask, vis.shape)
    if seg_q is not None:
        sq = np.asarray(seg_q)[:, None, :, None]
        sk = np.asarray(seg_kv)[:, None, None, :]
        vis &= (sq == sk) & (sq >= 0)
    qp, kp = q_pos[:, None], kv_pos[None, :]
    if causal:
        vis &= kp <= qp
    if window is not None:
        left, right = window
        if left is not None:
            vis &= kp >= qp - left
        if right is not None:
            vis &= kp <= qp + right
    if kv_lengths is not None:
        lengths = np.asarray(kv_lengths, np.int64)
        vis &= (np.arange(S_k)[None, :] < lengths[:, None])[:, None, None, :]
    return vis


def attention(q, k, v, *, bias=None, mask=None, segment_ids=None, sinks=None,
              q_positions=None, kv_positions=None, causal=False, window=None,
              scale=None, logits_soft_cap=None, dout=None, dlse=None, kv_lengths=None) -> Result:
    """Forward `(out, lse)` and, when `dout` is given, the gradients of
    `sum(out * dout) + sum(lse * dlse)` with respect to q, k, v, bias and sinks.

    `segment_ids` is `None`, one `(B, S)` array, or a pair `(seg_q, seg_kv)`.
    """
    q, k, v = f64(q), f64(k), f64(v)
    B, S_q, H, D = q.shape
    _, S_k, H_kv, _ = k.shape
    G = H // H_kv
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    heads = np.arange(H) // G
    kf, vf = k[:, :, heads], v[:, :, heads]  # (B, S_k, H, D)

    seg_q = seg_kv = None
    if segment_ids is not None:
        if isinstance(segment_ids, tuple):
            seg_q, seg_kv = segment_ids
        else:
            seg_q = seg_kv = segment_ids
    vis = visibility(B, H, S_q, S_k, mask=mask, seg_q=seg_q, seg_kv=seg_kv,
                     q_pos=q_positions, kv_pos=kv_positions, causal=causal, window=window,
                     kv_lengths=kv_lengths)

    raw = np.einsum("bihd,bjhd->bhij", q, kf) * scale
    t = None
    s = raw
    if logits_soft_cap is not None:
        c = float(logits_soft_cap)
        t = np.tanh(raw / c)
        s = c * t
    bias_shape = None
    if bias is not None:
        bias = f64(bias)
        bias_shape = bias.shape
        bias4 = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
        s = s + bias4
    z = np.where(vis, s, -np.inf)
    if sinks is not None:
        sink_col = np.broadcast_to(f64(sinks)[None, :, None, None], (B, H, S_q, 1))
        z = np.concatenate([z, sink_col], axis=-1)
    m = np.max(z, axis=-1, keepdims=True)
    empty = m == -np.inf  # (B, H, S_q, 1)
    m_safe = np.where(empty, 0.0, m)
    e = np.exp(z - m_safe)
    l = np.sum(e, axis=-1, keepdims=True)
    P = np.where(empty, 0.0, e / np.where(empty, 1.0, l))
    lse = np.where(empty, -np.inf, m_safe + np.log(np.where(empty, 1.0, l)))[..., 0]
    Pk = P[..., :S_k]
    out = np.einsum("bhij,bjhd->bihd", Pk, vf)
    res = Result(out=out, lse=lse)
    if dout is None:
        return res

    dout = f64(dout)
    dlse = np.zeros((B, H, S_q)) if dlse is None else f64(dlse)
    dlse = np.where(np.isfinite(lse), dlse, 0.0)
    # dL/dP over the real keys and the sink (whose value is 0).
    dP = np.einsum("bihd,bjhd->bhij", dout, vf)
    if sinks is not None:
        dP = np.concatenate([dP, np.zeros((B, H, S_q, 1))], axis=-1)
    # Softmax Jacobian: dz_j = P_j (dP_j - sum_i P_i dP_i) + dlse * P_j.
    rowdot = np.sum(P * dP, axis=-1, keepdims=True)
    dz = P * (dP - rowdot + dlse[..., None])
    ds = dz[..., :S_k]
    res.dsinks = None if sinks is None else dz[..., S_k].sum(axis=(0, 2))
    if bias is not None:
        b4 = (1,) * (4 - len(bias_shape)) + bias_shape
        axes = tuple(i for i in range(4) if b4[i] == 1 and ds.shape[i] != 1)
        res.dbias = ds.sum(axis=axes, keepdims=True).reshape(bias_shape)
    draw = ds if t is None else ds * (1.0 - t * t)
    res.dq = scale * np.einsum("bhij,bjhd->bihd", draw, kf)
    dkf = scale * np.einsum("bhij,bihd->bjhd", draw, q)
    dvf = np.einsum("bhij,bihd->bjhd", Pk, dout)
    res.dk = dkf.reshape(B, S_k, H_kv, G, D).sum(axis=3)
    res.dv = dvf.reshape(B, S_k, H_kv, G, D).sum(axis=3)
    return res


# -- sliding tile attention ---------------------------------------------------------


def ceil_div(a: int, b: int) -> int:
    """`ceil(a / b)` for ints."""
    return -(-a // b)


def video_layout(grid, tile):
    """Per video slot of the tile layout: `(coords (n, 3), real (n,))`, the token's
    grid coordinates and whether it lies inside the grid, by explicit enumeration."""
    tiles = [ceil_div(g, t) for g, t in zip(grid, tile)]
    coords = [
        [a * t + i for a, i, t in zip(tile_idx, inner, tile)]
        for tile_idx in itertools.product(*(range(n) for n in tiles))
        for inner in itertools.product(*(range(t) for t in tile))
    ]
    coords = np.asarray(coords, np.int64).reshape(-1, 3)
    real = np.all(coords < np.asarray(grid), axis=1)
    return coords, real


def sliding_tile_dense(grid, tile, windows, text_len=0, text_position="prefix", q_pos=None, kv_pos=None):
    """The sliding tile mask as bool `(len(windows), S_q, S_k)`: one `(wf, wh, ww)`
    per entry of `windows`, evaluated at positions (default `arange(seq_len)`;
    a position outside `[0, seq_len)` is padding)."""
    coords, real = video_layout(grid, tile)
    V = len(real)
    S = text_len + V
    kind = np.full(S, 2)  # 0 text, 1 real video, 2 padding
    tcoord = np.zeros((S, 3), np.int64)
    video = slice(text_len, S) if text_position == "prefix" else slice(0, V)
    text = slice(0, text_len) if text_position == "prefix" else slice(V, S)
    kind[video] = np.where(real, 1, 2)
    kind[text] = 0
    tcoord[video] = coords // np.asarray(tile)
    tiles = np.asarray([ceil_div(g, t) for g, t in zip(grid, tile)])

    def at(pos):
        pos = np.arange(S) if pos is None else np.asarray(pos, np.int64)
        inside = (pos >= 0) & (pos < S)
        p = np.where(inside, pos, 0)
        return np.where(inside, kind[p], 2), tcoord[p]

    qk, qc = at(q_pos)
    kk, kc = at(kv_pos)
    out = []
    for window in windows:
        w = np.minimum(np.asarray(window), tiles)
        s = np.clip(qc - w // 2, 0, tiles - w)  # (S_q, 3)
        box = np.all((kc[None] >= s[:, None]) & (kc[None] < (s + w)[:, None]), axis=-1)
        q_text, q_video = (qk == 0)[:, None], (qk == 1)[:, None]
        k_text, k_video = (kk == 0)[None], (kk == 1)[None]
        out.append((q_text & (k_text | k_video)) | (q_video & (k_text | (k_video & box))))
    return np.stack(out)


def sliding_tile_of(mask, q_pos=None, kv_pos=None):
    """`sliding_tile_dense` with the configuration of a `SlidingTileMask`-like object
    (read from its fields `grid, tile, window, text_len, text_position` only)."""
    windows = [mask.window] if isinstance(mask.window[0], int) else list(mask.window)
    return sliding_tile_dense(mask.grid, mask.tile, windows, mask.text_len, mask.text_position,
                              q_pos, kv_pos)


def block_causal_dense(grid, frames_per_block, window=None, text_len=0, text_position="prefix",
                       q_pos=None, kv_pos=None):
    """The frame-block causal mask as bool `(S_q, S_k)`: the `F x H x W` video tokens in
    raster order (frame `t // (H * W)` of video token `t`), text before or after them; a
    video query of frame `f` sees the video keys of frame `g` when `g // k <= f // k`
    (and, with a `window` of blocks, `g // k > f // k - window`); text sees and is seen
    by every token; positions outside `[0, seq_len)` are padding, seeing nothing and
    seen by nothing."""
    F, H, W = grid
    V = F * H * W
    S = text_len + V
    kind = np.zeros(S, np.int64)  # 0 text, 1 video
    block = np.zeros(S, np.int64)
    video = slice(text_len, S) if text_position == "prefix" else slice(0, V)
    kind[video] = 1
    block[video] = (np.arange(V) // (H * W)) // frames_per_block

    def at(pos):
        pos = np.arange(S) if pos is None else np.asarray(pos, np.int64)
        inside = (pos >= 0) & (pos < S)
        p = np.where(inside, pos, 0)
        return np.where(inside, kind[p], 2), block[p]

    qk, qb = at(q_pos)
    kk, kb = at(kv_pos)
    seen = kb[None] <= qb[:, None]
    if window is not None:
        seen &= kb[None] > qb[:, None] - window
    q_text, q_video = (qk == 0)[:, None], (qk == 1)[:, None]
    k_text, k_video = (kk == 0)[None], (kk == 1)[None]
    return (q_text & (k_text | k_video)) | (q_video & (k_text | (k_video & seen)))


# -- layers of the reference models ---------------------------------------------------


def linear(x, lin):
    """`torch.nn.Linear`: `x @ W.T + b` (`lin.weight (out, in)`, `lin.bias`)."""
    return f64(x) @ f64(lin.weight).T + f64(lin.bias)


def rms_norm(x, weight, eps=1e-6):
    """WanRMSNorm: `x * rsqrt(mean(x**2, -1) + eps) * weight`."""
    x = f64(x)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * r * f64(weight)


def rms_norm_grads(x, weight, ct, eps=1e-6):
    """`(dx, dw)` of `sum(ct * rms_norm(x, w))`: `dx = r g - r^3 x (g.x) / D`, `g = ct w`."""
    x, w, ct = f64(x), f64(weight), f64(ct)
    D = x.shape[-1]
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    g = ct * w
    dx = r * g - r**3 * x * np.sum(g * x, axis=-1, keepdims=True) / D
    dw = np.sum((ct * x * r).reshape(-1, D), axis=0)
    return dx, dw


def layer_norm(x, weight=None, bias=None, eps=1e-6):
    """`torch.nn.LayerNorm` over the last axis (biased variance); no weight / bias: no
    affine part."""
    x = f64(x)
    mu = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mu) ** 2, axis=-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps)
    if weight is not None:
        y = y * f64(weight)
    if bias is not None:
        y = y + f64(bias)
    return y


def layer_norm_grads(x, weight, ct, eps=1e-6):
    """`(dx, dw, db)` of `sum(ct * layer_norm(x, w, b))`:
    `dx = r (g - mean(g) - xhat mean(g xhat))`, `g = ct w`; `dw = sum ct xhat`; `db = sum ct`."""
    x, w, ct = f64(x), f64(weight), f64(ct)
    D = x.shape[-1]
    mu = np.mean(x, axis=-1, keepdims=True)
    r = 1.0 / np.sqrt(np.mean((x - mu) ** 2, axis=-1, keepdims=True) + eps)
    xhat = (x - mu) * r
    g = ct * w
    dx = r * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    return dx, np.sum((ct * xhat).reshape(-1, D), 0), np.sum(ct.reshape(-1, D), 0)


def rope(x, cos, sin):
    """Wan's rope_apply: adjacent pairs as complex numbers times `cos + i sin`;
    `x (..., S, H, D)`, `cos` / `sin (S, D / 2)`."""
    x = f64(x)
    xc = x[..., 0::2] + 1j * x[..., 1::2]
    yc = xc * (f64(cos) + 1j * f64(sin))[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = yc.real, yc.imag
    return out


def example_attention(q, k, v, **kwargs):
    """`attention` of one example, `q (S_q, H, D)`: its output `(S_q, H, D)`."""
    return attention(q[None], k[None], v[None], **kwargs).out[0]


def wan_self_attention(m, x, rope_tables=None, segment_ids=None):
    """Wan2.1's `WanSelfAttention.forward` for one example, `x (S, dim)`; `rope_tables`
    `(cos, sin)`, `segment_ids (S,)`."""
    S, H, D = x.shape[0], m.num_heads, m.head_dim
    q, k = linear(x, m.q), linear(x, m.k)
    if m.norm_q is not None:
        q, k = rms_norm(q, m.norm_q.weight, m.eps), rms_norm(k, m.norm_k.weight, m.eps)
    q, k, v = q.reshape(S, H, D), k.reshape(S, H, D), linear(x, m.v).reshape(S, H, D)
    if rope_tables is not None:
        q, k = rope(q, *rope_tables), rope(k, *rope_tables)
    seg = None if segment_ids is None else np.asarray(segment_ids)[None]
    return linear(example_attention(q, k, v, segment_ids=seg).reshape(S, H * D), m.o)


def wan_cross_attention(m, x, context, context_mask=None):
    """Wan2.1's `WanT2VCrossAttention.forward` for one example (`context_lens=None`
    when no mask)."""
    S, T, H, D = x.shape[0], context.shape[0], m.num_heads, m.head_dim
    q, k = linear(x, m.q), linear(context, m.k)
    if m.norm_q is not None:
        q, k = rms_norm(q, m.norm_q.weight, m.eps), rms_norm(k, m.norm_k.weight, m.eps)
    v = linear(context, m.v)
    vis = None if context_mask is None else np.broadcast_to(np.asarray(context_mask)[None], (S, T))
    out = example_attention(q.reshape(S, H, D), k.reshape(T, H, D), v.reshape(T, H, D), mask=vis)
    return linear(out.reshape(S, H * D), m.o)


def cogvideox_attention(m, x, context, rope_tables=None):
    """diffusers' `CogVideoXAttnProcessor2_0.__call__` for one example: `(x_out,
    context_out)`; the rotary embedding on the video tokens only."""
    T, H, D = context.shape[0], m.num_heads, m.head_dim
    h = np.concatenate([f64(context), f64(x)], axis=0)
    n = h.shape[0]
    q, k, v = (linear(h, lin).reshape(n, H, D) for lin in (m.to_q, m.to_k, m.to_v))
    if m.norm_q is not None:
        q = layer_norm(q, m.norm_q.weight, m.norm_q.bias, m.eps)
        k = layer_norm(k, m.norm_k.weight, m.norm_k.bias, m.eps)
    if rope_tables is not None:
        q = np.concatenate([q[:T], rope(q[T:], *rope_tables)])
        k = np.concatenate([k[:T], rope(k[T:], *rope_tables)])
    out = linear(example_attention(q, k, v).reshape(n, H * D), m.to_out)
    return out[T:], out[:T]


# -- video sparse attention (VSA) ---------------------------------------------------------


def vsa_layout(grid, tile):
    """The tile layout of VSA, by enumeration (`video_layout`): `(real (S,), tile_of
    (S,), counts (n_tiles,))`: whether each slot is a real token, the index of its
    tile (slots are enumerated tile by tile, so `slot // tile_size`), and the real
    tokens per tile."""
    _, real = video_layout(grid, tile)
    T = int(np.prod(tile))
    n = len(real) // T
    tile_of = np.repeat(np.arange(n), T)
    counts = np.bincount(tile_of, weights=real.astype(np.float64), minlength=n).astype(np.int64)
    return real, tile_of, counts


def vsa_topk(n_tiles: int, topk=None, sparsity=None) -> int:
    """`topk`, or `ceil((1 - sparsity) * n_tiles)` (FastVideo's rule), at least 1."""
    if topk is not None:
        return int(topk)
    return max(1, min(n_tiles, int(np.ceil((1.0 - float(sparsity)) * n_tiles))))


@dataclasses.dataclass
class VsaResult:
    out: np.ndarray  # (B, S, H, D), 0 on padding tokens
    lse: np.ndarray  # (B, H, S): the fine stage's; -inf on padding tokens
    selected: np.ndarray  # int (B, H, nq, topk): key tiles by descending coarse score
    out_c: np.ndarray  # (B, nq, H, D): the coarse output per query tile
    scores: np.ndarray  # (B, H, nq, nk): scale * q_c k_c^T (-inf for an empty key tile)
    margin: float  # min over rows of (topk-th score - (topk+1)-th score); inf if topk = nk
    dq: np.ndarray | None = None
    dk: np.ndarray | None = None
    dv: np.ndarray | None = None
    dgate: np.ndarray | None = None


def _tile_means(x, real, tile_of, counts):
    """`(B, S, Hx, D)` -> `(B, n, Hx, D)`: means over each tile's real tokens."""
    W = (tile_of[None, :] == np.arange(len(counts))[:, None]) * real[None, :]
    W = W / np.maximum(counts, 1)[:, None]  # (n, S)
    return np.einsum("ts,bshd->bthd", W, x), W


def video_sparse_attention(q, k, v, grid, tile, topk=None, gate=None, scale=None, *,
                           sparsity=None, tiles=None, dout=None, dlse=None) -> VsaResult:
    """VSA in float64, by its documented semantics, and (with `dout`) the gradients of
    `sum(out * dout) + sum(lse * dlse)` with respect to q, k, v and gate.

    `q (B, S, H, D)`, `k`/`v (B, S, K, D)` in the tile layout of `grid`/`tile`
    (`video_layout`); `gate (B, S, H, D)` or `None`. The selection (`topk`, or
    `sparsity`) is computed first from the float64 coarse scores, or forced with
    `tiles` (int `(B, H, nq, n_sel)`, `-1` unused); no gradient flows through it.
    Coarse: `attention` of the tile means (empty key tiles hidden); fine: `attention`
    with the dense `(B, H, S, S)` mask "key real and in a selected tile of the
    query's tile, query real"; out = `(out_c * gate + out_fine)` on real tokens, 0
    on padding. The coarse stage's gradients flow back through the means.
    """
    q, k, v, gate = f64(q), f64(k), f64(v), f64(gate)
    B, S, H, D = q.shape
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    real, tile_of, counts = vsa_layout(grid, tile)
    assert len(real) == S, (len(real), S)
    n = len(counts)
    n_sel = vsa_topk(n, topk, sparsity)

    # coarse
    q_c, W = _tile_means(q, real, tile_of, counts)
    k_c, _ = _tile_means(k, real, tile_of, counts)
    v_c, _ = _tile_means(v, real, tile_of, counts)
    seen = counts > 0
    coarse = attention(q_c, k_c, v_c, mask=seen[None, :], scale=scale)
    G = H // k.shape[2]
    scores = np.einsum("bqhd,bkhd->bhqk", q_c, k_c[:, :, np.arange(H) // G]) * scale
    scores = np.where(seen, scores, -np.inf)

    # selection (descending score; ties to the lower index, as lax.top_k)
    order = np.argsort(-scores, axis=-1, kind="stable")
    ranked = np.take_along_axis(scores, order, axis=-1)
    selected = np.where(np.isfinite(ranked[..., :n_sel]), order[..., :n_sel], -1)
    margin = np.inf
    if n_sel < n:
        gap = ranked[..., n_sel - 1] - ranked[..., n_sel]
        gap = gap[np.isfinite(gap)]
        margin = float(gap.min()) if gap.size else np.inf
    use = selected if tiles is None else np.asarray(tiles, np.int64)

    # fine: dense mask from the selection
    chosen = np.zeros((B, H, n, n), bool)  # (b, h, query tile, key tile)
    b_i, h_i, t_i, s_i = np.nonzero(use >= 0)
    chosen[b_i, h_i, t_i, use[b_i, h_i, t_i, s_i]] = True
    mask = chosen[:, :, tile_of][:, :, :, tile_of] & real[None, None, None, :] & real[None, None, :, None]

    out_c_tok = coarse.out[:, tile_of]  # (B, S, H, D)
    keep = real[None, :, None, None]
    g = np.ones_like(q) if gate is None else gate
    if dout is None:
        fine = attention(q, k, v, mask=mask, scale=scale)
    else:
        dout = f64(dout) * keep
        fine = attention(q, k, v, mask=mask, scale=scale, dout=dout, dlse=dlse)
    out = np.where(keep, out_c_tok * g + fine.out, 0.0)
    res = VsaResult(out=out, lse=fine.lse, selected=selected, out_c=coarse.out, scores=scores,
                    margin=margin)
    if dout is None:
        return res

    d_outc = np.einsum("ts,bshd->bthd", (tile_of[None, :] == np.arange(n)[:, None]) * 1.0, dout * g)
    cg = attention(q_c, k_c, v_c, mask=seen[None, :], scale=scale, dout=d_outc)
    back = lambda d: np.einsum("ts,bthd->bshd", W, d)  # transpose of the tile means
    res.dq = fine.dq + back(cg.dq)
    res.dk = fine.dk + back(cg.dk)
    res.dv = fine.dv + back(cg.dv)
    res.dgate = None if gate is None else dout * out_c_tok
    return res
