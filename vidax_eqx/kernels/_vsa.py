"""Video sparse attention (VSA): a coarse tile-level attention picks, per query tile,
the key tiles a fine block-sparse attention computes.

After "VSA: Faster Video Diffusion with Trainable Sparse Attention" (Zhang et al.,
2025; FastVideo). Tokens are in the tile layout of [`tile_permute`][]; per head:

- **coarse**: the means `q_c, k_c, v_c` of q, k and v over each tile's real tokens
  (padding excluded); `out_c = softmax(scale * q_c k_c^T) v_c`, broadcast to every
  token of the query tile (a key tile without a real token is hidden);
- **selection**: for each query tile, the `topk` key tiles of highest coarse score
  (no gradient through the choice);
- **fine**: each query token attends the real tokens of its selected key tiles
  (`_sparse.py`, or a vendor kernel through the implementation's `sparse_fwd` /
  `sparse_bwd`);
- **output**: `out_c * gate + out_fine` (`out_c + out_fine` without a gate);
  padding tokens give 0.

The stages are package API so that `parallel/` can put collectives between them
(ring attention all-gathers the coarse keys and runs the fine stage per step).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from . import _math as m
from ._args import normalize
from ._base import AbstractImplementation, Request
from .._vma import as_varying, varying_axes
from ._dispatch import Plan, run
from ._registry import choices
from ._tile import Triple, triple
from ._tile_tables import layout_valid


@dataclasses.dataclass(frozen=True)
class VsaLayout:
    """The tile layout VSA runs on: `grid (F, H, W)` tokens in tiles of `tile`
    (static, hashable)."""

    grid: Triple
    tile: Triple

    def __post_init__(self):
        object.__setattr__(self, "grid", triple("grid", self.grid, owner="video_sparse_attention"))
        object.__setattr__(self, "tile", triple("tile", self.tile, owner="video_sparse_attention"))

    @property
    def tiles(self) -> Triple:
        """Tiles along each dimension, `ceil(grid / tile)`."""
        return tuple(-(-g // t) for g, t in zip(self.grid, self.tile))

    @property
    def n_tiles(self) -> int:
        return math.prod(self.tiles)

    @property
    def tile_size(self) -> int:
        return math.prod(self.tile)

    @property
    def video_len(self) -> int:
        """Tokens of the tile layout, padding included."""
        return self.n_tiles * self.tile_size

    def token_valid(self) -> np.ndarray:
        """bool `(video_len,)`: the real (unpadded) tokens of the tile layout."""
        return layout_valid(self.grid, self.tile)

    def tile_counts(self) -> np.ndarray:
        """int `(n_tiles,)`: real tokens per tile."""
        return self.token_valid().reshape(self.n_tiles, self.tile_size).sum(axis=1)

    def topk(self, topk, sparsity) -> int:
        """The number of selected key tiles of `topk=` or `sparsity=` (exactly one of
        them): `topk` in `[1, n_tiles]`, or `ceil((1 - sparsity) * n_tiles)` for a
        sparsity in `[0, 1)` (FastVideo's rule)."""
        return resolve_topk(topk, sparsity, self.n_tiles)


def resolve_topk(topk, sparsity, n_tiles: int, where: str = "video_sparse_attention") -> int:
    """`topk=` or `sparsity=` (exactly one) as a number of key tiles in `[1, n_tiles]`."""
    if (topk is None) == (sparsity is None):
        raise ValueError(
            f"{where}: pass exactly one of `topk` (key tiles per query tile) or `sparsity` "
            f"(the fraction of key tiles skipped); received topk={topk!r}, sparsity={sparsity!r}."
        )
    if topk is not None:
        if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or not 1 <= topk <= n_tiles:
            raise ValueError(
                f"{where}: `topk` must be an int in [1, {n_tiles}] (the number of key tiles); "
                f"received {topk!r}."
            )
        return int(topk)
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float, np.floating)) or not 0 <= sparsity < 1:
        raise ValueError(
            f"{where}: `sparsity` must be a float in [0, 1) (the fraction of key tiles "
            f"skipped); received {sparsity!r}."
        )
    return max(1, min(n_tiles, math.ceil((1.0 - float(sparsity)) * n_tiles)))


# -- the stages ------------------------------------------------------------------------


def tile_means(x: jax.Array, valid, tile_size: int) -> jax.Array:
    """`(B, n*T, Hx, D)` -> `(B, n, Hx, D)`: the mean over each tile's `valid` tokens
    (bool `(n*T,)`), in float32 (float64 for float64 inputs); 0 for an empty tile."""
    B, S, Hx, D = x.shape
    n = S // tile_size
    w = jnp.asarray(valid, m.stat_dtype(x.dtype)).reshape(n, tile_size)
    count = jnp.maximum(w.sum(axis=1), 1.0)
    xs = x.reshape(B, n, tile_size, Hx, D).astype(w.dtype)
    return jnp.einsum("bnthd,nt->bnhd", xs, w) / count[None, :, None, None]


def coarse_attention(q_c, k_c, v_c, k_counts, scale: float):
    """Attention of the query tiles' means over the key tiles' means.

    **Arguments:** `q_c (B, nq, H, D)`, `k_c`, `v_c (B, nk, K, D)` (`tile_means`),
    `k_counts (nk,)`: real tokens per key tile (0: hidden).

    **Returns:** `(out_c (B, nq, H, D), scores (B, H, nq, nk))`, both in the
    statistics dtype; `scores` of hidden key tiles are `_math.masked`.
    """
    B, nq, H, D = q_c.shape
    nk, K = k_c.shape[1], k_c.shape[2]
    qg = q_c.reshape(B, nq, K, H // K, D)
    s = jnp.einsum("bqkgd,bnkd->bkgqn", qg, k_c).reshape(B, H, nq, nk) * scale
    seen = jnp.asarray(k_counts)[None, None, None, :] > 0
    low = m.masked(s.dtype)
    s = jnp.where(seen, s, low)
    p = jnp.where(seen, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
    p = p / jnp.maximum(p.sum(axis=-1, keepdims=True), jnp.finfo(p.dtype).tiny)
    out = jnp.einsum("bkgqn,bnkd->bqkgd", p.reshape(B, K, H // K, nq, nk), v_c)
    return out.reshape(B, nq, H, D), s


def select_tiles(scores: jax.Array, topk: int) -> jax.Array:
    """The `topk` key tiles of highest score per query head and tile: int32
    `(B, H, nq, topk)`, `-1` where only hidden tiles remain. No gradient."""
    s = lax.stop_gradient(scores)
    values, index = lax.top_k(s, topk)
    return jnp.where(values > m.masked(s.dtype), index, -1).astype(jnp.int32)


def combine(out_c, out_fine, gate, q_valid, tile_size: int):
    """`out_c * gate + out_fine` per token, padding tokens 0, in `out_fine`'s dtype.

    `out_c (B, nq, H, D)` is broadcast to the tokens of its tile; `gate` is
    `(B, S, H, D)` or `None` (a gate of ones); `q_valid` bool `(S,)`."""
    coarse = jnp.repeat(out_c, tile_size, axis=1)
    if gate is not None:
        coarse = coarse * gate.astype(coarse.dtype)
    total = coarse + out_fine.astype(coarse.dtype)
    keep = jnp.asarray(q_valid)[None, :, None, None]
    return jnp.where(keep, total, 0.0).astype(out_fine.dtype)


# -- the fine stage: dispatch and custom VJP ---------------------------------------------


def _sparse_plan(q, k, implementation) -> Plan:
    return choices(implementation, Request.sparse(q, k))


def _call_fwd(static):
    tile_size, scale = static

    def fwd(impl, q, k, v, tiles, kv_valid):
        with jax.named_scope(f"vidax_vsa_fine_{impl.name}"):
            return impl.sparse_fwd(q, k, v, tiles, kv_valid, tile_size=tile_size, scale=scale)

    return fwd


def _call_bwd(static):
    tile_size, scale = static

    def bwd(impl, q, k, v, tiles, kv_valid, out, lse, dout, dlse):
        with jax.named_scope(f"vidax_vsa_fine_{impl.name}_bwd"):
            return impl.sparse_bwd(
                q, k, v, tiles, kv_valid, out, lse, dout, dlse, tile_size=tile_size, scale=scale
            )

    return bwd


def _check_fine(q, k, v, tiles, kv_valid, tile_size: int) -> None:
    B, S_q, H, _ = q.shape
    S_k = k.shape[1]
    if S_q % tile_size or S_k % tile_size:
        raise ValueError(
            f"the fine stage needs whole tiles of {tile_size} tokens; received S_q={S_q}, S_k={S_k}."
        )
    if tiles.ndim != 4 or tiles.shape[:3] != (B, H, S_q // tile_size):
        raise ValueError(
            f"`tiles` must be int (B, H, n_q_tiles, n_sel) = ({B}, {H}, {S_q // tile_size}, n_sel); "
            f"received shape {tiles.shape}."
        )
    if kv_valid.shape != (S_k,):
        raise ValueError(f"`kv_valid` must be bool ({S_k},); received shape {kv_valid.shape}.")


def sparse_fwd(q, k, v, tiles, kv_valid, *, tile_size: int, scale: float, implementation="auto"):
    """The fine stage's forward without autodiff: `(out, lse)` (lse in the statistics
    dtype, the finite `_math.masked` for rows that see nothing)."""
    _check_fine(q, k, v, tiles, kv_valid, tile_size)
    ops = as_varying((q, k, v, tiles, kv_valid), varying_axes(q, k, v, tiles))
    return run(_sparse_plan(q, k, implementation), _call_fwd((tile_size, scale)), *ops)


def sparse_bwd(q, k, v, tiles, kv_valid, out, lse, dout, dlse, *, tile_size: int, scale: float,
               implementation="auto"):
    """The fine stage's backward: `(dq, dk, dv)` from `(out, lse)` (possibly those of a
    larger computation, e.g. a ring) and the cotangents `dout`, `dlse` (or `None`)."""
    _check_fine(q, k, v, tiles, kv_valid, tile_size)
    ops = (q, k, v, tiles, kv_valid, out, lse, dout, dlse)
    ops = as_varying(ops, varying_axes(*jax.tree.leaves(ops)))
    return run(_sparse_plan(q, k, implementation), _call_bwd((tile_size, scale)), *ops)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sparse(plan, static, q, k, v, tiles, kv_valid):
    return run(plan, _call_fwd(static), q, k, v, tiles, kv_valid)


def _sparse_fwd_rule(plan, static, q, k, v, tiles, kv_valid):
    out, lse = _sparse(plan, static, q, k, v, tiles, kv_valid)
    return (out, lse), (q, k, v, tiles, kv_valid, out, lse)


def _sparse_bwd_rule(plan, static, residuals, cotangents):
    dout, dlse = cotangents
    dq, dk, dv = run(plan, _call_bwd(static), *residuals, dout, dlse)
    return dq, dk, dv, None, None


_sparse.defvjp(_sparse_fwd_rule, _sparse_bwd_rule)


def sparse_attention(q, k, v, tiles, kv_valid, *, tile_size: int, scale: float, implementation="auto"):
    """The fine stage, differentiable in q, k, v (and through `lse`): `(out, lse)`.

    `tiles` int32 `(B, H, n_q_tiles, n_sel)`: per query head and query tile, the key
    tiles it attends (`-1`: an unused slot); `kv_valid` bool `(S_k,)`: real keys.
    """
    _check_fine(q, k, v, tiles, kv_valid, tile_size)
    ops = as_varying((q, k, v, tiles, kv_valid), varying_axes(q, k, v, tiles))
    return _sparse(_sparse_plan(q, k, implementation), (tile_size, scale), *ops)


# -- the public function ------------------------------------------------------------------


def _check_gate(gate, q) -> None:
    if gate is None:
        return
    if not hasattr(gate, "shape") or tuple(gate.shape) != tuple(q.shape):
        raise ValueError(
            "video_sparse_attention: `gate` must have q's shape (B, S, H, D) = "
            f"{tuple(q.shape)} (per token and head, in the tile layout); received "
            f"{getattr(gate, 'shape', type(gate).__name__)}."
        )


def video_sparse_attention(
    q: Float[Array, "B S H D"],
    k: Float[Array, "B S H_kv D"],
    v: Float[Array, "B S H_kv D"],
    grid: tuple[int, int, int],
    *,
    topk: int | None = None,
    sparsity: float | None = None,
    tile: tuple[int, int, int] = (4, 4, 4),
    gate: Float[Array, "B S H D"] | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    implementation: str | AbstractImplementation = "auto",
) -> Float[Array, "B S H D"] | tuple[Float[Array, "B S H D"], Float[Array, "B H S"]]:
    """Video sparse attention (VSA): trainable, content-dependent block sparsity.

    The video's tokens are in the tile layout of [`tile_permute`][]`(x, grid, tile)`
    (tiles of `tile` tokens, each grid dimension padded to whole tiles). Per head:

    1. **coarse**: the means of q, k and v over each tile's real tokens (padding
        excluded); `out_c = softmax(scale * q_c k_c^T) v_c`, given to every token of
        the query tile;
    2. **selection**: for each query tile, the `topk` key tiles of highest coarse
        score (no gradient flows through the choice);
    3. **fine**: each query token attends the real tokens of its selected key tiles;
    4. **output**: `out_c * gate + out_fine` (`out_c + out_fine` without `gate`);
        padding tokens give 0.

    Time and memory of the fine stage scale with `topk` (its implementation is
    chosen like [`attention`][]'s: `"xla"` materializes the mask, `"blockwise"`
    gathers the selected tiles, `"pallas_tpu"` is a block-sparse TPU kernel driven
    by the selected indices). Differentiable in q, k, v and gate.

    **Arguments:**

    - `q`: `(B, S, H, D)`, `S` the tile layout's length (video tokens only).
    - `k`, `v`: `(B, S, H_kv, D)`, `H % H_kv == 0` (GQA: query head `h` uses kv
        head `h // (H // H_kv)`; selection is per query head).
    - `grid`: `(F, H, W)`, the video's token grid.
    - `topk`: key tiles per query tile, in `[1, n_tiles]`; or
    - `sparsity`: the fraction of key tiles skipped, in `[0, 1)`:
        `topk = ceil((1 - sparsity) * n_tiles)` (FastVideo's configs).
    - `tile`: tokens per tile `(tf, th, tw)`, default `(4, 4, 4)`.
    - `gate`: `(B, S, H, D)`, the coarse output's gate (a model's
        `to_gate_compress` projection); `None` adds `out_c` ungated.
    - `scale`: logit scale, default `1 / sqrt(D)` (both stages).
    - `return_lse`: also return the fine stage's log-sum-exp `(B, H, S)` in
        float32 (float64 for float64 inputs; `-inf` for padding tokens).
    - `implementation`: the fine stage's implementation, as in [`attention`][].

    **Returns:**

    `out (B, S, H, D)` in q's dtype, or `(out, lse)`.
    """
    ops, opts = normalize(q, k, v, scale=scale)
    q, k, v = ops.q, ops.k, ops.v
    layout = VsaLayout(grid, tile)
    if q.shape[1] != layout.video_len or k.shape[1] != layout.video_len:
        raise ValueError(
            f"video_sparse_attention: `grid` {layout.grid} with tile {layout.tile} lays out "
            f"{layout.n_tiles} tiles x {layout.tile_size} = {layout.video_len} tokens, so q, k "
            f"and v need S = {layout.video_len}; received q: {q.shape}, k: {k.shape}. Lay the "
            "video out with tile_permute(x, grid, tile)."
        )
    n_sel = layout.topk(topk, sparsity)
    _check_gate(gate, q)
    with jax.named_scope("vidax_video_sparse_attention"):
        valid = layout.token_valid()
        T = layout.tile_size
        q_c, k_c, v_c = (tile_means(x, valid, T) for x in (q, k, v))
        out_c, scores = coarse_attention(q_c, k_c, v_c, layout.tile_counts(), opts.scale)
        tiles = select_tiles(scores, n_sel)
        out, lse = sparse_attention(
            q, k, v, tiles, jnp.asarray(valid), tile_size=T, scale=opts.scale,
            implementation=implementation,
        )
        out = combine(out_c, out, gate, valid, T)
        if not return_lse:
            return out
        empty = m.is_empty_lse(lse) | ~jnp.asarray(valid)[None, None, :]
        return out, jnp.where(empty, -jnp.inf, lse)
