"""CogVideoX's joint attention layer: the text and the video through the same
projections, one attention over `[text; video]`."""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._shapes import checked
from .. import kernels
from .sharding._call_checks import check_context
from ._checks import check_attention
from .sharding._config import ParallelConfig
from .sharding._fsdp import fsdp_gather
from . import _init as init
from ._layers import linear, local_heads, row_parallel, tp_input
from ._norm import LayerNorm
from ._padding import check_length
from .sharding._parallel_layer import AbstractParallelLayer, MegatronSplit
from ._rope import apply_rope, Rope
from .sharding._sequence import attend, check_tile_mask


class JointAttention(AbstractParallelLayer):
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
    megatron: ClassVar[MegatronSplit] = MegatronSplit(
        column=("to_q", "to_k", "to_v"), row=("to_out",))

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
        self.head_dim, eps = check_attention(
            "JointAttention", dim, num_heads, eps=eps, parallel=parallel, qk_norm=qk_norm,
            qk_norms=("layer_norm", None))
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

    @checked
    def __call__(
        self,
        x: Float[Array, "S {self.dim}"],
        context: Float[Array, "T {self.dim}"],
        *,
        rope: Rope | None = None,
        segment_ids: Int[Array, " T+S"] | None = None,
        context_copies: bool = False,
        mask: kernels.SlidingTileMask | kernels.BlockCausalMask | None = None,
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
            check_tile_mask("JointAttention", mask, self.num_heads)
            context_length = check_length("JointAttention", "context_length", context_length, T)
            out = attend(q, k, v, self.parallel, self.implementation, text_len=T,
                         text_lengths=context_length, segment_ids=segment_ids, mask=mask)
            out = row_parallel(self.to_out, out.reshape(T + S, H * self.head_dim),
                                self.parallel.tp_axis)
            return out[T:], out[:T]
