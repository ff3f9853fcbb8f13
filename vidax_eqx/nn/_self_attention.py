"""Wan's self-attention layer (`WanSelfAttention`), with sequence and tensor parallelism
and video sparse attention."""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._shapes import checked
from .. import kernels
from ..parallel import axis_size
from .sharding._call_checks import check_context
from ._checks import check_attention
from .sharding._config import ParallelConfig
from .sharding._fsdp import fsdp_gather
from . import _init as init
from ._layers import after_tp, linear, local_columns, local_heads, qk_rms_norm, row_parallel, tp_input
from ._norm import RMSNorm
from ._padding import check_length
from .sharding._parallel_layer import AbstractParallelLayer, MegatronSplit
from .sharding._placement import replace_fields
from ._rope import apply_rope, Rope
from .sharding._sequence import attend, attend_sparse, check_tile_mask
from ._video_sparse import check_video_sparse, VideoSparse


class Attention(AbstractParallelLayer):
    """Wan self-attention (`WanSelfAttention` of Wan2.1's `wan/modules/model.py`).

    `q = norm_q(q(x))`, `k = norm_k(k(x))`, `v = v(x)`, split into heads, RoPE on `q`
    and `k`, softmax attention (scale `1 / sqrt(head_dim)`), then `o`. The parameter
    names are the reference's, so a Wan checkpoint maps one to one.

    **Parallelism** (`parallel=`, a [`ParallelConfig`][]): the call runs inside
    `jax.shard_map` with the module placed by [`partition_specs`][vidax_eqx.nn.sharding.partition_specs]`(module)` and `x`
    this device's chunk of the sequence (`P(parallel.sequence_axes)`: `P(ulysses_axis)`,
    `P(ring_axis)`, or `P((ring_axis, ulysses_axis))` for usp). Under tensor parallelism each device computes `num_heads / tp` heads: q/k/v
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
    quantize: str | None = eqx.field(static=True)
    megatron: ClassVar[MegatronSplit] = MegatronSplit(
        column=("q", "k", "v", "to_gate_compress"), row=("o",), sharded_norms=("norm_q", "norm_k"))

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        qk_norm: str | None = "rms",
        eps: float = 1e-6,
        parallel: ParallelConfig = ParallelConfig(),
        implementation: str | kernels.AbstractImplementation = "auto",
        quantize: str | None = None,
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
        - `quantize`: the attention's `quantize=` (`None`, `"int8-qk"`, `"int8"`: Q.Kᵀ and
            P.V on int8, `vidax_eqx.kernels.attention`); the full (bidirectional) self-
            attention only: a streamed chunk's attention over its cache stays in float.
            Set on a whole model by `vidax_eqx.models.quantize(..., attention=)`.
        - `gate_compress`: also build `to_gate_compress`, the gate of video sparse
            attention's coarse output, zero-initialized (the coarse term starts off, so
            that a dense model's weights give the fine attention alone).
        - `dtype`: the parameters' dtype.
        - `key`: a PRNG key for the linear layers' initialization.
        """
        self.head_dim, eps = check_attention(
            "Attention", dim, num_heads, eps=eps, parallel=parallel, qk_norm=qk_norm,
            qk_norms=("rms", None))
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
        self.quantize = check_quantize("Attention", quantize)

    @checked
    def __call__(
        self,
        x: Float[Array, "S {self.dim}"],
        *,
        rope: Rope | None = None,
        segment_ids: Int[Array, " S"] | None = None,
        mask: kernels.SlidingTileMask | kernels.BlockCausalMask | None = None,
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
            too). Or a [`vidax_eqx.kernels.BlockCausalMask`][] (frame-block causal
            attention) over the whole sequence in raster order, padded as the parallel
            function asks. `None`: full attention.
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
            check_video_sparse(self, x, video_sparse, gate, segment_ids, mask, kv_length)
            check_tile_mask("Attention", mask, self.num_heads)
            kv_length = check_length("Attention", "kv_length", kv_length,
                                     None if self.parallel.sequence_axes else x.shape[0])
            self, (x, rope) = fsdp_gather(self, (x, rope))
            H = local_heads("Attention", self, self.q)
            x = tp_input(x, self.parallel.tp_axis)
            q, k, v = self._project(x, rope, H)
            S = x.shape[0]
            if video_sparse is not None:
                if self.to_gate_compress is not None:
                    gate = linear(self.to_gate_compress, x)
                elif gate is not None:
                    gate = local_columns(gate, self, H)
                if gate is not None:
                    gate = gate.reshape(S, H, self.head_dim)
                out = attend_sparse(q, k, v, gate, self.parallel, self.implementation,
                                    video_sparse)
                return row_parallel(self.o, out.reshape(S, H * self.head_dim),
                                    self.parallel.tp_axis)
            out = attend(q, k, v, self.parallel, self.implementation, segment_ids=segment_ids,
                         mask=mask, kv_length=kv_length, quantize=self.quantize)
            return row_parallel(self.o, out.reshape(S, H * self.head_dim), self.parallel.tp_axis)

    def _project(self, x, rope, H: int):
        """`(q, k, v)`, each `(S, H, head_dim)` (`H` this device's heads), normed and
        rotated; `x` the layer's input after `tp_input`."""
        S = x.shape[0]
        q = qk_rms_norm(self.norm_q, linear(self.q, x), self).reshape(S, H, self.head_dim)
        k = qk_rms_norm(self.norm_k, after_tp(linear(self.k, x), q, self), self)
        k = k.reshape(S, H, self.head_dim)
        v = linear(self.v, x).reshape(S, H, self.head_dim)
        if rope is not None:
            q = apply_rope(q, *rope)
            k = apply_rope(k, *rope)
        return q, k, v

    @checked
    def with_past(
        self,
        x: Float[Array, "S {self.dim}"],
        past_k: Float[Array, "P H D"],
        past_v: Float[Array, "P H D"],
        *,
        rope: Rope | None = None,
        mask: kernels.BlockCausalMask | None = None,
        past_valid: Bool[Array, " P"] | None = None,
    ) -> tuple[Float[Array, "S {self.dim}"], Float[Array, "T H D"], Float[Array, "T H D"]]:
        """Attention of new tokens to themselves and to the keys and values of earlier ones
        (a key/value cache: streaming generation, chunk by chunk).

        **Arguments:**

        - `x`: the new tokens `(S, dim)` of one example: whole on this device, or under
            Ulysses this device's contiguous `S = T / sp` of the `T` new tokens.
        - `past_k`, `past_v`: `(P, H, head_dim)`, the earlier tokens' keys (normed and
            rotated, as this method returns them) and values; `H` this device's heads
            (under Ulysses, its share of them after the `all_to_all`: `num_heads / (tp
            sp)`, the cache split by heads).
        - `rope`: `(cos, sin)` of the new tokens (`(S, head_dim // 2)` each), or `None`.
        - `mask`: a [`vidax_eqx.kernels.BlockCausalMask`][] over the keys `[past; new]`
            with `query_offset = P` (the new tokens are its last ones), or `None`: every
            key visible.
        - `past_valid`: bool `(P,)`, the past slots that hold a token (an empty slot of a
            cache is invisible); `None`: every one.

        **Returns:**

        `(out, k, v)`: the attention output `(S, dim)` and the new tokens' keys and
        values `(T, H, head_dim)` (every new token, this device's heads), to append to
        the cache.

        One device, tensor parallelism (the cache holds this device's heads), FSDP, and
        Ulysses: an `all_to_all` trades the new tokens' split for a head split, so each
        device attends every new token to the cache of its heads, and a last one gives
        the output back the tokens' split. Not over a ring (`NotImplementedError`).
        """
        with jax.named_scope("vidax_eqx.nn.Attention.with_past"):
            parallel = self.parallel
            if parallel.ring_axis is not None:
                raise NotImplementedError(
                    "Attention.with_past: a key/value cache runs on one device, under tensor "
                    f"parallelism, FSDP or Ulysses; not over a ring ({parallel})."
                )
            self, (x, rope) = fsdp_gather(self, (x, rope))
            H = local_heads("Attention", self, self.q)
            x = tp_input(x, parallel.tp_axis)
            q, k, v = self._project(x, rope, H)
            S = x.shape[0]
            ulysses = parallel.ulysses_axis
            if ulysses is not None:  # (S, H, D) -> (T, H / sp, D)
                sp = axis_size(ulysses, what="Ulysses")
                if H % sp:
                    raise ValueError(
                        f"Attention.with_past: Ulysses splits this device's {H} heads over "
                        f"{ulysses!r} ({sp} devices); they must divide them.")
                H //= sp
                q, k, v = (jax.lax.all_to_all(a, ulysses, split_axis=1, concat_axis=0, tiled=True)
                           for a in (q, k, v))
            T = q.shape[0]
            if past_k.shape[1:] != k.shape[1:] or past_v.shape != past_k.shape:
                raise ValueError(
                    f"Attention.with_past: `past_k` and `past_v` must be (P, H, head_dim) = "
                    f"(P, {H}, {self.head_dim}) (this device's heads); received "
                    f"{past_k.shape} and {past_v.shape}."
                )
            keys = jnp.concatenate([past_k.astype(k.dtype), k])
            values = jnp.concatenate([past_v.astype(v.dtype), v])
            segment_ids = None
            if past_valid is not None:  # empty slots: segment -1, invisible
                seg_kv = jnp.concatenate([jnp.where(past_valid, 0, -1), jnp.zeros(T, jnp.int32)])
                segment_ids = kernels.SegmentIds(q=jnp.zeros((1, T), jnp.int32),
                                                 kv=seg_kv.astype(jnp.int32)[None])
            out = kernels.attention(q[None], keys[None], values[None], mask=mask,
                                    segment_ids=segment_ids, implementation=self.implementation)[0]
            if ulysses is not None:  # (T, H / sp, D) -> (S, H, D)
                out = jax.lax.all_to_all(out, ulysses, split_axis=0, concat_axis=1, tiled=True)
                H *= sp
            return row_parallel(self.o, out.reshape(S, H * self.head_dim), parallel.tp_axis), k, v


def check_quantize(owner: str, quantize):
    """`quantize`, an attention's `quantize=` mode (`vidax_eqx.kernels.attention`)."""
    if quantize not in kernels.QUANTIZE:
        raise ValueError(f"{owner}: `quantize` must be one of {kernels.QUANTIZE}; received "
                         f"{quantize!r}.")
    return quantize


def with_quantized_attention(tree, quantize):
    """`tree` with every [`Attention`][] in it computing its attention in the
    `quantize=` mode `quantize` (its arrays the same)."""
    check_quantize("with_quantized_attention", quantize)
    is_attention = lambda m: isinstance(m, Attention)  # noqa: E731
    return jax.tree.map(lambda m: replace_fields(m, quantize=quantize) if is_attention(m) else m,
                        tree, is_leaf=is_attention)
