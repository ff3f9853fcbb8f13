"""Wan and CogVideoX attention layers, with sequence and tensor parallelism.

Three final Equinox modules, one example per call (`(S, dim)`; `jax.vmap` for a
batch):

- [`Attention`][]: Wan's `WanSelfAttention` (`q`, `k`, `v`, `o`, `norm_q`, `norm_k`).
- [`CrossAttention`][]: Wan's `WanT2VCrossAttention` (queries from the video tokens,
    keys and values from the text context).
- [`JointAttention`][]: CogVideoX's `Attention` + `CogVideoXAttnProcessor2_0`
    (`to_q`, `to_k`, `to_v`, `to_out`, per-head `norm_q` / `norm_k`) over
    `[context; x]`.

Parameters always have their global (single-device) shapes. A [`ParallelConfig`][]
(a non-array leaf of the module, so that every configuration of the same weights has
one tree structure and one optimizer state) chooses how the module runs over a mesh:
the same parameters, placed by [`partition_specs`][], run inside `jax.shard_map`
([`filter_shard_map`][]) with the sequence split
(Ulysses, ring, or both) and the heads split over a tensor-parallel axis
(Megatron: q/k/v column-parallel, the output projection row-parallel), and give
the single-device numbers. The attention itself is `vidax_eqx.kernels` or
`vidax_eqx.parallel`; the norms and RoPE are `vidax_eqx.nn.functional`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from beartype import beartype
from jaxtyping import Array, Bool, Float, Int, jaxtyped, PRNGKeyArray

from .. import kernels
from .._order import after
from ..parallel._rank_masks import RankMasks, with_rank_mask
from ..parallel import (
    ring_attention,
    sequence_parallel_joint_self_attention,
    sequence_parallel_self_attention,
    usp_attention,
    video_sparse_attention as parallel_video_sparse_attention,
)
from .._checks import check_positive
from ._checks import check_eps, check_heads
from ._fsdp import fsdp_gather
from . import _init as init
from ._layers import linear, local_heads, row_parallel, tp_input
from ._norm import LayerNorm, RMSNorm, tp_sharded_rms_norm
from ._padding import check_length, key_padding_ids
from ._parallel import check_context, check_parallel, check_text, ParallelConfig
from ._rope import apply_rope
from ._video_sparse import VideoSparse


# (cos, sin), each (S, head_dim // 2): this device's tokens, as `rope_3d` returns them.
_Rope = tuple[Float[Array, "S {self.head_dim//2}"], Float[Array, "S {self.head_dim//2}"]]


# -- what the three modules share ------------------------------------------------------


def _qk_rms_norm(norm: RMSNorm | None, x: Array, m) -> Array:
    """Wan's q/k RMSNorm over the whole inner dim; over a feature shard under TP."""
    if norm is None:
        return x
    if m.parallel.tp_axis is None:
        return norm(x)
    return tp_sharded_rms_norm(x, norm.weight, m.dim, m.eps, axis_name=m.parallel.tp_axis)


def _after_tp(x: Array, q: Array, m) -> Array:
    """Under TP, `norm_k`'s psum waits for `norm_q`'s (one collective order on every
    device, see `vidax_eqx._order`)."""
    return x if m.parallel.tp_axis is None else after(x, q)


def _tile_mask(cls: str, mask, m, heads_local: int):
    """The call's `SlidingTileMask` for this device's heads: under tensor parallelism
    per-head windows follow the heads to their TP rank (`RankMasks`)."""
    if mask is None:
        return None
    if not isinstance(mask, kernels.SlidingTileMask):
        raise TypeError(
            f"{cls}: `mask` must be a vidax_eqx.kernels.SlidingTileMask or None; received "
            f"{type(mask).__name__}."
        )
    mask.check_heads(m.num_heads, cls)
    tp_axis = m.parallel.tp_axis
    if mask.heads is None or tp_axis is None:
        return mask
    masks = RankMasks.of(mask, heads_local, tp_axis, m.num_heads // heads_local)
    if isinstance(masks, RankMasks) and m.parallel.sequence in ("ulysses", "usp"):
        raise NotImplementedError(
            f"{cls}: per-head SlidingTileMask windows that differ between tensor-parallel "
            f"ranks under sequence={m.parallel.sequence!r} are not supported (both split the "
            "heads); use one window for all heads, equal windows per TP rank, or "
            "sequence='ring'."
        )
    return masks


def _attend(q, k, v, parallel: ParallelConfig, implementation, *, text_len: int | None = None,
            segment_ids=None, mask=None, kv_length=None):
    """`(S, H, D)` attention of one example with the configured sequence parallelism: the
    one switch over `parallel.sequence`.

    `text_len=None`: self-attention over this device's tokens (`Attention`); an int:
    joint attention over `[text; this device's tokens]`, the text a replicated prefix
    of `text_len` tokens (`JointAttention`). `mask`: a `SlidingTileMask`, or `RankMasks`
    of them, or None. `kv_length`: an int32 scalar, key-only padding at global indices
    (the kernels' and parallel functions' `kv_lengths`), or None.
    """
    q, k, v = q[None], k[None], v[None]
    segment_ids = jax.tree.map(lambda a: a[None], segment_ids)  # an array or SegmentIds
    opts = dict(segment_ids=segment_ids, mask=mask, implementation=implementation)
    if kv_length is not None:
        opts["kv_lengths"] = kv_length[None]
    text = {} if text_len is None else {"text_len": text_len}
    mode = parallel.sequence
    if mode == "none":
        out = with_rank_mask(kernels.attention, q, k, v, **opts)
    elif mode == "ulysses":
        if text_len is None:
            out = sequence_parallel_self_attention(q, k, v, parallel.sp_axis, **opts)
        else:
            out = sequence_parallel_joint_self_attention(q, k, v, text_len, parallel.sp_axis,
                                                         **opts)
    elif mode == "ring":
        out = ring_attention(q, k, v, axis_name=parallel.sp_axis, layout=parallel.layout,
                             **text, **opts)
    else:
        out = usp_attention(q, k, v, ulysses_axis=parallel.sp_axis, ring_axis=parallel.ring_axis,
                            layout=parallel.layout, **text, **opts)
    return out[0]


def _attend_sparse(q, k, v, gate, parallel: ParallelConfig, implementation,
                   video_sparse: VideoSparse):
    """`(S, H, D)` video sparse attention of one example (tokens in the tile layout)
    with the configured sequence parallelism; `gate` `(S, H, D)` or None."""
    q, k, v = q[None], k[None], v[None]
    opts = dict(topk=video_sparse.topk, sparsity=video_sparse.sparsity, tile=video_sparse.tile,
                gate=None if gate is None else gate[None], implementation=implementation)
    mode = parallel.sequence
    if mode == "none":
        out = kernels.video_sparse_attention(q, k, v, video_sparse.grid, **opts)
    else:
        axes = {
            "ulysses": dict(ulysses_axis=parallel.sp_axis),
            "ring": dict(ring_axis=parallel.sp_axis),
            "usp": dict(ulysses_axis=parallel.sp_axis, ring_axis=parallel.ring_axis),
        }[mode]
        out = parallel_video_sparse_attention(q, k, v, video_sparse.grid, layout=parallel.layout,
                                              **axes, **opts)
    return out[0]


def _check_video_sparse(m, x, video_sparse, gate, segment_ids, mask, kv_length) -> None:
    """The combinations `Attention(video_sparse=...)` refuses."""
    if video_sparse is None:
        if gate is not None:
            raise ValueError(
                "Attention: `gate` is the coarse output's gate of video sparse attention; "
                "pass it with `video_sparse=` (received video_sparse=None)."
            )
        return
    if not isinstance(video_sparse, VideoSparse):
        raise ValueError(
            f"Attention: `video_sparse` must be a vidax_eqx.nn.VideoSparse or None; received "
            f"{type(video_sparse).__name__}."
        )
    for name, value in (("mask", mask), ("segment_ids", segment_ids), ("kv_length", kv_length)):
        if value is not None:
            raise ValueError(
                f"Attention: `video_sparse` takes the video's padding from its tile layout and "
                f"cannot be combined with `{name}`; received {name}={type(value).__name__}."
            )
    if gate is not None and m.to_gate_compress is not None:
        raise ValueError(
            "Attention: the module computes the gate with its `to_gate_compress` projection; "
            "received a `gate` too. Pass one or the other."
        )
    n = video_sparse.layout.video_len
    if m.parallel.sequence == "none" and x.shape[0] != n:
        raise ValueError(
            f"Attention: video_sparse={video_sparse} lays the video out as {n} tokens "
            f"(tile_permute(x, grid, tile)); received x with {x.shape[0]} tokens."
        )


def _local_gate(gate, m, H: int):
    """A given `(S, dim)` gate's columns of this device's heads (under TP)."""
    tp_axis = m.parallel.tp_axis
    if tp_axis is None:
        return gate
    width = H * m.head_dim
    return lax.dynamic_slice_in_dim(gate, lax.axis_index(tp_axis) * width, width, axis=1)


# -- Wan --------------------------------------------------------------------------------


class Attention(eqx.Module):
    """Wan self-attention (`WanSelfAttention` of Wan2.1's `wan/modules/model.py`).

    `q = norm_q(q(x))`, `k = norm_k(k(x))`, `v = v(x)`, split into heads, RoPE on `q`
    and `k`, softmax attention (scale `1 / sqrt(head_dim)`), then `o`. The parameter
    names are the reference's, so a Wan checkpoint maps one to one.

    **Parallelism** (`parallel=`, a [`ParallelConfig`][]): the call runs inside
    `jax.shard_map` with the module placed by [`partition_specs`][]`(module)` and `x`
    this device's chunk of the sequence (`P(sp_axis)`; `P((ring_axis, sp_axis))` for
    usp). Under tensor parallelism each device computes `num_heads / tp` heads: q/k/v
    are column-parallel, `o` row-parallel (one `psum` over `tp_axis`, `o`'s bias added
    once after it), and `norm_q` / `norm_k` hold the global `RMSNorm(dim)` whose
    weight is sharded with the features; the statistic over the whole inner dim is
    then [`vidax_eqx.nn.functional.tp_sharded_rms_norm`][] (a `psum` of the local
    sums of squares), so one module class serves both cases.

    **Video sparse attention** (`video_sparse=`, a [`VideoSparse`][], at call time):
    the tokens are a video in the tile layout and the attention is VSA
    ([`vidax_eqx.kernels.video_sparse_attention`][]): `out_c * gate + out_fine`, where
    the per-token, per-head `gate` is `to_gate_compress(x)` (FastVideo's VSA Wan
    blocks; built with `gate_compress=True`), a `gate` passed in, or ones (ungated).

    **Fields:** `q`, `k`, `v`, `o` (`eqx.nn.Linear(dim, dim)`, with bias), `norm_q`,
    `norm_k` ([`RMSNorm`][]`(dim)`, or `None` without qk-norm), `to_gate_compress`
    (`eqx.nn.Linear(dim, dim)`, with bias, column-parallel like `q`; or `None`),
    `parallel` (a [`ParallelConfig`][], a non-array leaf), and the static
    configuration `dim`, `num_heads`, `head_dim`, `qk_norm`, `eps`, `implementation`.
    """

    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    norm_q: RMSNorm | None
    norm_k: RMSNorm | None
    to_gate_compress: eqx.nn.Linear | None
    dim: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    qk_norm: str | None = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    parallel: ParallelConfig
    implementation: str | kernels.AbstractImplementation = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        qk_norm: str | None = "rms",
        eps: float = 1e-6,
        parallel: ParallelConfig = ParallelConfig(),
        implementation: str | kernels.AbstractImplementation = "auto",
        gate_compress: bool = False,
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `dim`: the model width (inner dim = `dim`, as in Wan).
        - `num_heads`: the number of heads; `head_dim = dim / num_heads`.
        - `qk_norm`: `"rms"` (Wan's `qk_norm=True`) or `None` (identity).
        - `eps`: the RMSNorm epsilon.
        - `parallel`: a [`ParallelConfig`][]; default: one device.
        - `implementation`: the kernel implementation (`vidax_eqx.kernels.attention`).
        - `gate_compress`: also build `to_gate_compress`, the gate of video sparse
            attention's coarse output, zero-initialized (the coarse term starts off, so
            that a dense model's weights give the fine attention alone).
        - `dtype`: the parameters' dtype.
        - `key`: a PRNG key for the linear layers' initialization.
        """
        self.head_dim = check_heads("Attention", dim, num_heads)
        eps = check_eps("Attention", eps)
        check_parallel("Attention", parallel)
        if qk_norm not in ("rms", None):
            raise ValueError(f"Attention: `qk_norm` must be 'rms' or None; received {qk_norm!r}.")
        kq, kk, kv, ko = init.split(key, 4)
        self.q = init.linear(dim, dim, dtype=dtype, key=kq)
        self.k = init.linear(dim, dim, dtype=dtype, key=kk)
        self.v = init.linear(dim, dim, dtype=dtype, key=kv)
        self.o = init.linear(dim, dim, dtype=dtype, key=ko)
        norm = (lambda: RMSNorm(dim, eps, dtype=dtype)) if qk_norm == "rms" else (lambda: None)
        self.norm_q, self.norm_k = norm(), norm()
        self.to_gate_compress = None
        if gate_compress:
            zeros = (init.zeros((dim, dim), dtype), init.zeros((dim,), dtype))
            self.to_gate_compress = eqx.tree_at(lambda lin: (lin.weight, lin.bias), self.q, zeros)
        self.dim, self.num_heads, self.qk_norm, self.eps = dim, num_heads, qk_norm, eps
        self.parallel, self.implementation = parallel, implementation

    @jaxtyped(typechecker=beartype)
    def __call__(
        self,
        x: Float[Array, "S {self.dim}"],
        *,
        rope: _Rope | None = None,
        segment_ids: Int[Array, " S"] | None = None,
        mask: kernels.SlidingTileMask | None = None,
        kv_length: Array | int | None = None,
        video_sparse: VideoSparse | None = None,
        gate: Float[Array, "S {self.dim}"] | None = None,
    ) -> Float[Array, "S {self.dim}"]:
        """**Arguments:**

        - `x`: the tokens `(S, dim)` of one example: the whole sequence on one
            device, this device's chunk under sequence parallelism.
        - `rope`: `(cos, sin)`, each `(S, head_dim // 2)` for the same tokens as `x`
            (e.g. from [`vidax_eqx.nn.functional.rope_3d`][], sharded like `x`),
            rotating adjacent pairs of `q` and `k`; `None`: no RoPE.
        - `segment_ids`: int `(S,)`, sharded like `x`: tokens attend within equal ids
            and a negative id is padding (attends to nothing, seen by nothing; its
            attention output is 0). This is how Wan's `seq_lens` is expressed.
        - `mask`: a [`vidax_eqx.kernels.SlidingTileMask`][] (sliding tile attention)
            over the whole sequence: `x` (and `rope`) in the tile layout of
            [`vidax_eqx.kernels.tile_permute`][], padded to whole tiles (and, sharded,
            to the devices as the parallel function asks); the hidden tiles are
            skipped. Per-head windows follow their heads (under tensor parallelism
            too). `None`: full attention.
        - `kv_length`: key-only padding: an int scalar (a 0-d integer array, one per
            example under `jax.vmap`, or a Python int), the number of real tokens; the
            tokens at index `>= kv_length` of the whole sequence (global indices under
            sequence parallelism, in the unpermuted order under zigzag) are invisible
            as keys to every query, but every query is still computed (its row is a
            real attention output). This differs from `segment_ids` padding (-1),
            where a padded token also sees nothing and its attention output is 0.
            Combines with `segment_ids`. Served by the kernels' and the parallel
            functions' `kv_lengths`. `None`: no key-only padding.
        - `video_sparse`: a [`VideoSparse`][]`(grid, tile, topk=|sparsity=)`: video
            sparse attention (VSA). `x` (and `rope`) are the video's tokens in the tile
            layout of [`vidax_eqx.kernels.tile_permute`][]`(x, grid, tile)`: on one
            device all `VideoSparse.layout.video_len` of them; under sequence
            parallelism this device's chunk of that layout padded with whole empty
            tiles (see [`vidax_eqx.parallel.video_sparse_attention`][], which serves
            the modes "ulysses", "ring" and "usp"). Not combined with `mask`,
            `segment_ids` or `kv_length` (the padding is the layout's). `None`: the
            attention above.
        - `gate`: `(S, dim)`, the coarse output's gate (per token; heads as in `q`'s
            columns) for a module without `to_gate_compress`; with it, the module
            computes `to_gate_compress(x)` itself. `None`: ungated (or the module's).

        **Returns:**

        `(S, dim)`, the same tokens as `x`.
        """
        with jax.named_scope("vidax_eqx.nn.Attention"):
            check_context("Attention", self.parallel, x)
            _check_video_sparse(self, x, video_sparse, gate, segment_ids, mask, kv_length)
            kv_length = check_length("Attention", "kv_length", kv_length,
                                     x.shape[0] if self.parallel.sequence == "none" else None)
            self, (x, rope) = fsdp_gather(self, (x, rope))
            H = local_heads("Attention", self, self.q)
            S = x.shape[0]
            x = tp_input(x, self.parallel.tp_axis)
            q = _qk_rms_norm(self.norm_q, linear(self.q, x), self).reshape(S, H, self.head_dim)
            k = _qk_rms_norm(self.norm_k, _after_tp(linear(self.k, x), q, self), self)
            k = k.reshape(S, H, self.head_dim)
            v = linear(self.v, x).reshape(S, H, self.head_dim)
            if rope is not None:
                q = apply_rope(q, *rope)
                k = apply_rope(k, *rope)
            if video_sparse is not None:
                if self.to_gate_compress is not None:
                    gate = linear(self.to_gate_compress, x)
                elif gate is not None:
                    gate = _local_gate(gate, self, H)
                if gate is not None:
                    gate = gate.reshape(S, H, self.head_dim)
                out = _attend_sparse(q, k, v, gate, self.parallel, self.implementation,
                                     video_sparse)
                return row_parallel(self.o, out.reshape(S, H * self.head_dim),
                                    self.parallel.tp_axis)
            mask = _tile_mask("Attention", mask, self, H)
            out = _attend(q, k, v, self.parallel, self.implementation, segment_ids=segment_ids,
                          mask=mask, kv_length=kv_length)
            return row_parallel(self.o, out.reshape(S, H * self.head_dim), self.parallel.tp_axis)


class CrossAttention(eqx.Module):
    """Wan text cross-attention (`WanT2VCrossAttention` of Wan2.1's `wan/modules/model.py`).

    Queries from the video tokens `x`, keys and values from the text `context`:
    `q = norm_q(q(x))`, `k = norm_k(k(context))`, `v = v(context)`, softmax attention
    without RoPE, then `o`.

    **Text padding:** Wan pads the text to a fixed length with zero embeddings and
    attends to the padding (its model passes `context_lens=None`). That is the
    default here; `context_mask` hides padded text tokens instead.

    **Parallelism:** under sequence parallelism (any mode) each device attends its
    own chunk of queries to the whole, replicated `context` (in_spec `P()`): no
    sequence communication. Tensor parallelism splits the heads as in [`Attention`][].

    **Image branch** (Wan's I2V `WanI2VCrossAttention`, `image_context_dim` set): the
    same queries also attend to the image context through `k_img`, `v_img` and
    `norm_k_img` (diffusers' `add_k_proj`, `add_v_proj`, `norm_added_k`), and the two
    attention outputs are added before `o`.

    **Precomputed keys and values:** the text does not change across denoising steps,
    so its keys and values can be computed once: [`project_context`][] returns them
    (this device's heads), and `__call__(x, context_kv=...)` uses them instead of
    projecting `context`, with bit for bit the same result.

    **Fields:** `q` (`Linear(dim, dim)`), `k`, `v` (`Linear(context_dim, dim)`), `o`
    (`Linear(dim, dim)`), all with bias; `norm_q`, `norm_k` ([`RMSNorm`][]`(dim)` or
    `None`); `k_img`, `v_img` (`Linear(image_context_dim, dim)`), `norm_k_img`, or
    `None` without the image branch; `parallel` (a leaf, as in [`Attention`][]);
    static `dim`, `context_dim`, `image_context_dim`, `num_heads`, `head_dim`,
    `qk_norm`, `eps`, `implementation`.
    """

    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    norm_q: RMSNorm | None
    norm_k: RMSNorm | None
    k_img: eqx.nn.Linear | None
    v_img: eqx.nn.Linear | None
    norm_k_img: RMSNorm | None
    dim: int = eqx.field(static=True)
    context_dim: int = eqx.field(static=True)
    image_context_dim: int | None = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    qk_norm: str | None = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    parallel: ParallelConfig
    implementation: str | kernels.AbstractImplementation = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        context_dim: int | None = None,
        image_context_dim: int | None = None,
        qk_norm: str | None = "rms",
        eps: float = 1e-6,
        parallel: ParallelConfig = ParallelConfig(),
        implementation: str | kernels.AbstractImplementation = "auto",
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `dim`, `num_heads`, `qk_norm`, `eps`, `parallel`, `implementation`, `dtype`:
            as in [`Attention`][].
        - `context_dim`: the width of the text context, default `dim` (Wan embeds the
            text to `dim` before its blocks).
        - `image_context_dim`: the width of the image context of Wan's I2V models (Wan
            embeds it to `dim`), or `None` (text-to-video: no image branch).
        - `key`: a PRNG key for the linear layers' initialization.
        """
        self.head_dim = check_heads("CrossAttention", dim, num_heads)
        eps = check_eps("CrossAttention", eps)
        check_parallel("CrossAttention", parallel)
        if qk_norm not in ("rms", None):
            raise ValueError(
                f"CrossAttention: `qk_norm` must be 'rms' or None; received {qk_norm!r}."
            )
        context_dim = dim if context_dim is None else context_dim
        check_positive("CrossAttention", context_dim=context_dim)
        if image_context_dim is not None:
            check_positive("CrossAttention", image_context_dim=image_context_dim)
        kq, kk, kv, ko, kki, kvi = init.split(key, 6)
        self.q = init.linear(dim, dim, dtype=dtype, key=kq)
        self.k = init.linear(context_dim, dim, dtype=dtype, key=kk)
        self.v = init.linear(context_dim, dim, dtype=dtype, key=kv)
        self.o = init.linear(dim, dim, dtype=dtype, key=ko)
        norm = (lambda: RMSNorm(dim, eps, dtype=dtype)) if qk_norm == "rms" else (lambda: None)
        self.norm_q, self.norm_k = norm(), norm()
        if image_context_dim is None:
            self.k_img = self.v_img = self.norm_k_img = None
        else:
            self.k_img = init.linear(image_context_dim, dim, dtype=dtype, key=kki)
            self.v_img = init.linear(image_context_dim, dim, dtype=dtype, key=kvi)
            self.norm_k_img = norm()
        self.image_context_dim = image_context_dim
        self.dim, self.context_dim, self.num_heads = dim, context_dim, num_heads
        self.qk_norm, self.eps = qk_norm, eps
        self.parallel, self.implementation = parallel, implementation

    def project_context(
        self,
        context: Float[Array, "S_ctx {self.context_dim}"],
        *,
        context_image: Float[Array, "S_img {self.image_context_dim}"] | None = None,
        context_copies: bool = False,
    ) -> tuple:
        """The keys and values of the context, as `__call__` computes them: to compute
        once and pass as `__call__(..., context_kv=...)` while the context does not
        change (the text across denoising steps).

        **Arguments:**

        - `context`, `context_image`, `context_copies`: as for `__call__`.

        **Returns:**

        `(k, v, k_img, v_img)`: `k`, `v` of shape `(S_ctx, H, head_dim)` (`k` after
        `norm_k`), `k_img`, `v_img` `(S_img, H, head_dim)` with the image branch, else
        `None`. `H` is this device's number of heads: `num_heads`, or `num_heads / tp`
        under tensor parallelism (computed inside `shard_map` as `__call__` computes
        them, `norm_k`'s statistics summed over `tp_axis`).
        """
        with jax.named_scope("vidax_eqx.nn.CrossAttention.project_context"):
            self._check_image(context_image)
            if not context_copies:
                check_text("CrossAttention", self.parallel, context)
                if context_image is not None:
                    check_text("CrossAttention", self.parallel, context_image)
            self, (context, context_image) = fsdp_gather(self, (context, context_image))
            return self._context_kv(context, context_image, None)

    def _check_image(self, context_image) -> None:
        if (self.k_img is None) != (context_image is None):
            raise ValueError(
                "CrossAttention: `context_image` is required with the image branch "
                "(image_context_dim set) and refused without it; received image_context_dim="
                f"{self.image_context_dim}, context_image="
                f"{None if context_image is None else context_image.shape}."
            )

    def _context_kv(self, context, context_image, q):
        """`(k, v, k_img, v_img)` of this device's heads (weights already gathered).
        `q`: the queries `norm_k`'s collective waits for under TP, or `None` (the
        context itself: the same `+ 0` on the values, see `_order.after`)."""
        H = local_heads("CrossAttention", self, self.q)
        S_ctx = context.shape[0]
        wait = context if q is None else q
        context = tp_input(context, self.parallel.tp_axis)
        k = _qk_rms_norm(self.norm_k, _after_tp(linear(self.k, context), wait, self), self)
        k = k.reshape(S_ctx, H, self.head_dim)
        v = linear(self.v, context).reshape(S_ctx, H, self.head_dim)
        if context_image is None:
            return k, v, None, None
        S_img = context_image.shape[0]
        context_image = tp_input(context_image, self.parallel.tp_axis)
        k_img = linear(self.k_img, context_image)
        k_img = _qk_rms_norm(self.norm_k_img, _after_tp(k_img, k, self), self)
        k_img = k_img.reshape(S_img, H, self.head_dim)
        v_img = linear(self.v_img, context_image).reshape(S_img, H, self.head_dim)
        return k, v, k_img, v_img

    def _check_kv(self, context_kv, H: int) -> None:
        """Raises unless `context_kv` is `(k, v, k_img, v_img)` of this module's
        local heads, the image part present exactly with the image branch."""
        def shape(a):
            return None if a is None else tuple(getattr(a, "shape", ()))

        ok = isinstance(context_kv, tuple) and len(context_kv) == 4
        if ok:
            k, v, k_img, v_img = context_kv
            pairs = [(k, v)] + ([(k_img, v_img)] if self.k_img is not None else [])
            ok = (self.k_img is not None) or (k_img is None and v_img is None)
            for a, b in pairs:
                ok = ok and all(
                    eqx.is_array(t) and t.ndim == 3 and t.shape[1:] == (H, self.head_dim)
                    for t in (a, b)) and shape(a) == shape(b)
        if not ok:
            image = "" if self.k_img is None else " and (S_img, H, head_dim) image keys/values"
            received = (tuple(shape(a) for a in context_kv) if isinstance(context_kv, tuple)
                        else type(context_kv).__name__)
            raise ValueError(
                f"CrossAttention: `context_kv` must be (k, v, k_img, v_img) as project_context "
                f"returns them: (S_ctx, H, head_dim) text keys/values{image} with this "
                f"device's H={H} heads and head_dim={self.head_dim}"
                + ("" if self.k_img is not None else ", k_img = v_img = None (no image branch)")
                + f"; received {received}."
            )

    @jaxtyped(typechecker=beartype)
    def __call__(
        self,
        x: Float[Array, "S {self.dim}"],
        context: Float[Array, "S_ctx {self.context_dim}"] | None = None,
        *,
        context_mask: Bool[Array, " S_ctx"] | None = None,
        context_image: Float[Array, "S_img {self.image_context_dim}"] | None = None,
        context_copies: bool = False,
        context_kv: tuple | None = None,
        context_length: Array | int | None = None,
    ) -> Float[Array, "S {self.dim}"]:
        """**Arguments:**

        - `x`: the video tokens `(S, dim)` of one example (this device's chunk under
            sequence parallelism).
        - `context`: the text tokens `(S_ctx, context_dim)`, whole on every device;
            `None` with `context_kv`.
        - `context_mask`: optional bool `(S_ctx,)`, `True` for real text tokens.
            `None` (the reference's behaviour) attends to every text token. A query
            whose mask hides every token gets 0 before `o`.
        - `context_image`: the image tokens `(S_img, image_context_dim)` of the image
            branch, whole on every device; required with the branch, refused without
            (`None` with `context_kv`).
        - `context_copies`: `True` when `context` (and `context_image`) are this
            device's copies of text a model embedded on every device with its own
            (possibly FSDP-gathered) weights: equal in value, but typed as varying over
            the FSDP axes, so the check that the text is whole and the same on every
            device (which refuses a text sharded like `x`) is skipped; the model checks
            its raw text input instead.
        - `context_kv`: the precomputed keys and values `(k, v, k_img, v_img)` of
            [`project_context`][] (this device's heads), used instead of `context` and
            `context_image` (which must then be `None`): the same result, bit for bit,
            without projecting the context. `k`, `v` are not checked against a context.
        - `context_length`: key-only padding of the text: an int scalar (a 0-d integer
            array, one per example under `jax.vmap`, or a Python int), the number of
            real text tokens; the text tokens at index `>= context_length` are hidden
            from every query (the kernels' `kv_lengths`, which the fast kernels serve;
            nothing the padded rows hold reaches the output), and every query is still
            computed. Cross-attention queries are video tokens, so this is the text
            padding mask of a model that pads its prompt (`context_mask` with a prefix
            of `True`, as a length, without the mask's move to the portable kernels).
            It differs from `segment_ids` padding (-1) in the self-attention modules,
            where a padded token also sees nothing. Combines with `context_mask`; the
            image branch is not affected. `None`: every text token is a key.

        **Returns:**

        `(S, dim)`.
        """
        with jax.named_scope("vidax_eqx.nn.CrossAttention"):
            if context_kv is not None and (context is not None or context_image is not None):
                raise ValueError(
                    "CrossAttention: `context_kv` (precomputed keys and values) replaces "
                    "`context` and `context_image`; pass them as None with it. Received "
                    f"context={None if context is None else context.shape}, context_image="
                    f"{None if context_image is None else context_image.shape}."
                )
            if context_kv is None and context is None:
                raise ValueError(
                    "CrossAttention: one of `context` (the text tokens) and `context_kv` "
                    "(their precomputed keys and values) is required; received neither."
                )
            if context_kv is None:
                check_context("CrossAttention", self.parallel, x,
                              context=None if context_copies else context, sharded_x=False)
                if context_image is not None and not context_copies:
                    check_context("CrossAttention", self.parallel, x, context=context_image,
                                  sharded_x=False)
                self._check_image(context_image)
            else:
                check_context("CrossAttention", self.parallel, x, sharded_x=False)
            self, (x, context, context_image, context_kv) = fsdp_gather(
                self, (x, context, context_image, context_kv))
            H = local_heads("CrossAttention", self, self.q)
            S = x.shape[0]
            q = _qk_rms_norm(self.norm_q, linear(self.q, x), self).reshape(S, H, self.head_dim)
            if context_kv is None:
                context_kv = self._context_kv(context, context_image, q)
            else:
                self._check_kv(context_kv, H)
            k, v, k_img, v_img = context_kv
            if context_mask is not None and context_mask.shape[0] != k.shape[0]:
                raise ValueError(
                    f"CrossAttention: `context_mask` has one entry per text token ({k.shape[0]}); "
                    f"received shape {context_mask.shape}."
                )
            mask = None if context_mask is None else context_mask[None, None, None, :]
            context_length = check_length("CrossAttention", "context_length", context_length,
                                          k.shape[0])
            out = kernels.attention(
                q[None], k[None], v[None], mask=mask, implementation=self.implementation,
                kv_lengths=None if context_length is None else context_length[None],
            )[0]
            if k_img is not None:
                out = out + kernels.attention(
                    q[None], k_img[None], v_img[None], implementation=self.implementation
                )[0]
            return row_parallel(self.o, out.reshape(S, H * self.head_dim), self.parallel.tp_axis)


# -- CogVideoX --------------------------------------------------------------------------


class JointAttention(eqx.Module):
    """CogVideoX joint attention (diffusers' `Attention` with `CogVideoXAttnProcessor2_0`).

    The text `context` and the video tokens `x` go through the same projections as
    one sequence `[context; x]`: `to_q`, `to_k`, `to_v`, per-head `norm_q` / `norm_k`
    (LayerNorm over `head_dim`, diffusers' `qk_norm="layer_norm"`), RoPE on the video
    tokens of `q` and `k` only, softmax attention over the whole sequence, `to_out`
    (diffusers' `to_out[0]`; its dropout `to_out[1]` is the identity at inference),
    and the result is split back into `(x_out, context_out)`.

    **Parallelism:** with sequence parallelism `x` is this device's chunk of the video
    tokens and `context` the whole text on every device (in_spec `P()`); the attention
    is `vidax_eqx.parallel.sequence_parallel_joint_self_attention` (`"ulysses"`),
    `ring_attention(..., text_len=T)` (`"ring"`: the text never travels the ring) or
    `usp_attention(..., text_len=T)` (`"usp"`). `context_out` is then computed on every device, identical copies: as the
    parallel functions document, the cotangents given to the copies must add up to
    the true cotangent (give it all to one copy, or split it), never count it once
    per device. Tensor parallelism splits the heads (q/k/v column-parallel, `to_out`
    row-parallel); the per-head LayerNorms are replicated.

    **Fields:** `to_q`, `to_k`, `to_v`, `to_out` (`eqx.nn.Linear(dim, dim)`, with
    bias), `norm_q`, `norm_k` ([`LayerNorm`][]`(head_dim)` with weight and bias, or
    `None`); `parallel` (a leaf, as in [`Attention`][]); static `dim`, `num_heads`,
    `head_dim`, `qk_norm`, `eps`, `implementation`.
    """

    to_q: eqx.nn.Linear
    to_k: eqx.nn.Linear
    to_v: eqx.nn.Linear
    to_out: eqx.nn.Linear
    norm_q: LayerNorm | None
    norm_k: LayerNorm | None
    dim: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    qk_norm: str | None = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    parallel: ParallelConfig
    implementation: str | kernels.AbstractImplementation = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        qk_norm: str | None = "layer_norm",
        eps: float = 1e-6,
        parallel: ParallelConfig = ParallelConfig(),
        implementation: str | kernels.AbstractImplementation = "auto",
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `dim`: the model width (CogVideoX: `num_heads * attention_head_dim`).
        - `num_heads`: the number of heads; `head_dim = dim / num_heads`.
        - `qk_norm`: `"layer_norm"` (CogVideoX) or `None`.
        - `eps`: the LayerNorm epsilon (CogVideoX: 1e-6).
        - `parallel`, `implementation`, `dtype`: as in [`Attention`][].
        - `key`: a PRNG key for the linear layers' initialization.
        """
        self.head_dim = check_heads("JointAttention", dim, num_heads)
        eps = check_eps("JointAttention", eps)
        check_parallel("JointAttention", parallel)
        if qk_norm not in ("layer_norm", None):
            raise ValueError(
                f"JointAttention: `qk_norm` must be 'layer_norm' or None; received {qk_norm!r}."
            )
        kq, kk, kv, ko = init.split(key, 4)
        self.to_q = init.linear(dim, dim, dtype=dtype, key=kq)
        self.to_k = init.linear(dim, dim, dtype=dtype, key=kk)
        self.to_v = init.linear(dim, dim, dtype=dtype, key=kv)
        self.to_out = init.linear(dim, dim, dtype=dtype, key=ko)
        if qk_norm == "layer_norm":
            self.norm_q = LayerNorm(self.head_dim, eps, dtype=dtype)
            self.norm_k = LayerNorm(self.head_dim, eps, dtype=dtype)
        else:
            self.norm_q = self.norm_k = None
        self.dim, self.num_heads, self.qk_norm, self.eps = dim, num_heads, qk_norm, eps
        self.parallel, self.implementation = parallel, implementation

    @jaxtyped(typechecker=beartype)
    def __call__(
        self,
        x: Float[Array, "S {self.dim}"],
        context: Float[Array, "T {self.dim}"],
        *,
        rope: _Rope | None = None,
        segment_ids: Int[Array, " T+S"] | None = None,
        context_copies: bool = False,
        mask: kernels.SlidingTileMask | None = None,
        context_length: Array | int | None = None,
    ) -> tuple[Float[Array, "S {self.dim}"], Float[Array, "T {self.dim}"]]:
        """**Arguments:**

        - `x`: the video tokens `(S, dim)` of one example (this device's chunk under
            sequence parallelism).
        - `context`: the text tokens `(T, dim)`, whole on every device.
        - `rope`: `(cos, sin)`, each `(S, head_dim // 2)`, for the video tokens of `x`
            only (sharded like `x`); `None`: no RoPE.
        - `segment_ids`: optional int `(T + S,)`, the segment ids of `[context; x]` (the
            text's, the same on every device, then this device's video tokens'): tokens
            attend only within equal ids, and a negative id is padding (it sees nothing
            and nothing sees it; its output row is `to_out`'s bias). A sharded model
            hides the padding of a token count that does not divide the devices so.
        - `context_copies`: `True` when `context` is this device's copy of a text stream
            that an earlier joint layer computed on every device (a stack of joint
            blocks): the copies are equal in value but vary in type over the sequence
            axes, so the check that the text is whole and the same on every device
            (which refuses a text sharded like `x`, a wrong answer) is skipped. The
            caller checks the stream's first input instead.
        - `mask`: a [`vidax_eqx.kernels.SlidingTileMask`][] over `[context; x]`: its
            `text_len` is `T` (`"prefix"`), and `x` (and `rope`) are the video tokens
            in the tile layout of [`vidax_eqx.kernels.tile_permute`][]. `None`: full
            attention.
        - `context_length`: key-only padding of the text: an int scalar (a 0-d integer
            array, one per example under `jax.vmap`, or a Python int), the number of
            real text tokens; the text tokens at index `>= context_length` are
            invisible as keys to every query (text and video), and every query is still
            computed. This differs from `segment_ids` padding (-1), where a padded
            token also sees nothing (its output row is `to_out`'s bias). Combines with
            `segment_ids`. `None`: every text token is a key.

        **Returns:**

        `(x_out, context_out)`, `(S, dim)` and `(T, dim)`: diffusers' processor's
        `(hidden_states, encoder_hidden_states)`.
        """
        with jax.named_scope("vidax_eqx.nn.JointAttention"):
            check_context("JointAttention", self.parallel, x,
                          context=None if context_copies else context)
            self, (x, context, rope) = fsdp_gather(self, (x, context, rope))
            H = local_heads("JointAttention", self, self.to_q)
            T, S = context.shape[0], x.shape[0]
            h = jnp.concatenate([context, x], axis=0)
            h = tp_input(h, self.parallel.tp_axis)
            q = linear(self.to_q, h).reshape(T + S, H, self.head_dim)
            k = linear(self.to_k, h).reshape(T + S, H, self.head_dim)
            v = linear(self.to_v, h).reshape(T + S, H, self.head_dim)
            if self.norm_q is not None:
                q, k = self.norm_q(q), self.norm_k(k)
            if rope is not None:
                q = jnp.concatenate([q[:T], apply_rope(q[T:], *rope)], axis=0)
                k = jnp.concatenate([k[:T], apply_rope(k[T:], *rope)], axis=0)
            mask = _tile_mask("JointAttention", mask, self, H)
            context_length = check_length("JointAttention", "context_length", context_length, T)
            if context_length is not None:
                # The text's indices, and -1 (always below the length) for the video.
                indices = jnp.concatenate([jnp.arange(T, dtype=jnp.int32),
                                           jnp.full((S,), -1, jnp.int32)])
                segment_ids = key_padding_ids(indices, context_length, segment_ids)
            out = _attend(q, k, v, self.parallel, self.implementation, text_len=T,
                          segment_ids=segment_ids, mask=mask)
            out = row_parallel(self.to_out, out.reshape(T + S, H * self.head_dim),
                                self.parallel.tp_axis)
            return out[T:], out[:T]
