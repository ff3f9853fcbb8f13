"""HunyuanVideo / MMDiT dual-stream joint attention: separate projections for the video
and the text, one joint attention over `[video; text]`.

[`DualStreamAttention`][] is diffusers' `Attention(added_kv_proj_dim=...)` with
`HunyuanVideoAttnProcessor2_0` (the dual-stream blocks of HunyuanVideo; Flux and SD3's
MMDiT blocks have the same shape): the video tokens go through `to_q`, `to_k`,
`to_v`, the text through `add_q_proj`, `add_k_proj`, `add_v_proj`, each stream through
its own per-head RMSNorms, RoPE rotates the video tokens only, one softmax attention
runs over the concatenation `[video; text]` (text after the video, as HunyuanVideo
concatenates), and the two parts of the result leave through `to_out` and
`to_add_out`.
"""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._shapes import checked
from .. import kernels
from .._checks import check_positive
from .sharding._call_checks import check_context
from ._checks import check_attention
from .sharding._config import ParallelConfig
from . import _init as init
from .sharding._fsdp import fsdp_gather
from ._layers import linear, local_heads, row_parallel, tp_input
from ._norm import RMSNorm
from ._padding import check_length
from .sharding._parallel_layer import AbstractParallelLayer, MegatronSplit
from ._rope import apply_rope, Rope
from .sharding._sequence import attend, replicated_text


class DualStreamAttention(AbstractParallelLayer):
    """HunyuanVideo / MMDiT dual-stream joint attention (diffusers' `Attention` with
    `added_kv_proj_dim` and `HunyuanVideoAttnProcessor2_0`).

    For the video tokens `x (S, dim)` and the text tokens `context (T, context_dim)`:

    - video `q, k, v = to_q(x), to_k(x), to_v(x)`, split into heads, `norm_q(q)`,
        `norm_k(k)` (RMSNorm over `head_dim`, one weight shared by the heads), then
        RoPE on `q` and `k`;
    - text `add_q_proj`, `add_k_proj`, `add_v_proj`, `norm_added_q`, `norm_added_k`, no
        RoPE;
    - one softmax attention (scale `1 / sqrt(head_dim)`) of every query of
        `[video; text]` over every key of `[video; text]`;
    - the video rows through `to_out` (diffusers' `to_out[0]`; its dropout is the
        identity at inference), the text rows through `to_add_out`.

    The parameter names are diffusers', so a HunyuanVideo dual-stream block's
    `attn.*` weights map one to one (`to_out.0` is `to_out` here).

    **Text padding** (`context_length`): HunyuanVideo pads its prompt to a fixed length
    and masks the padded text tokens as *keys* only: no query (video or text) sees
    them, but every text query is still computed (its `context_out` row is a real
    attention output, unused downstream). This is key-only padding, not the
    segment-id padding of [`Attention`][] (`segment_ids=-1`: a padded token sees
    nothing and nothing sees it, so its row is 0 before the output projection). The
    kernels zero the padded tokens' keys and values (as they do every hidden key of
    `kv_lengths`), so whatever they hold (NaN included) never reaches a real token's
    output.

    **Parallelism** (`parallel=`, a [`ParallelConfig`][]): under sequence parallelism
    (`"ulysses"`, `"ring"`, `"usp"`) `x` is this device's chunk of the video tokens (and
    `rope` its rows, [`shard_tokens`][vidax_eqx.nn.sharding.shard_tokens]) and `context` the whole text on every device
    (in_spec `P()`). The text never travels: the joint functions of
    [`vidax_eqx.parallel`][] attend over `[video; text]` with `text_position="suffix"`
    (each device holds `[its video chunk; the text]`) and the padding as
    `text_lengths`. `context_out` is returned *replicated*: the same on every device
    and typed so ([`vidax_eqx.parallel.replicated`][]: device 0's copy, one `psum` of
    `(T, dim)` over the sequence axes), so it leaves `shard_map` with an out_spec that
    does not name the sequence axes and feeds the next block as its `context`; its
    cotangent is counted once. On one device the padded text keys are the tail of
    `[video; text]`, the kernels' `kv_lengths`, which the fast kernels serve. Tensor
    parallelism splits the heads: the six q/k/v projections column-parallel, `to_out`
    and `to_add_out` row-parallel, the per-head norms replicated. FSDP (`fsdp_axes`)
    gathers the weights at the call ([`fsdp_gather`][]). [`partition_specs`][vidax_eqx.nn.sharding.partition_specs] places
    the module for all of these.

    **Fields:** `to_q`, `to_k`, `to_v`, `to_out` (`eqx.nn.Linear(dim, dim)`), `add_q_proj`,
    `add_k_proj`, `add_v_proj` (`eqx.nn.Linear(context_dim, dim)`), `to_add_out`
    (`eqx.nn.Linear(dim, dim)`), all with bias; `norm_q`, `norm_k`, `norm_added_q`,
    `norm_added_k` ([`RMSNorm`][]`(head_dim)`, or `None` without qk-norm); `parallel` (a
    [`ParallelConfig`][], a non-array leaf); static `dim`, `context_dim`, `num_heads`,
    `head_dim`, `qk_norm`, `eps`, `implementation`.
    """

    to_q: eqx.nn.Linear
    to_k: eqx.nn.Linear
    to_v: eqx.nn.Linear
    to_out: eqx.nn.Linear
    add_q_proj: eqx.nn.Linear
    add_k_proj: eqx.nn.Linear
    add_v_proj: eqx.nn.Linear
    to_add_out: eqx.nn.Linear
    norm_q: RMSNorm | None
    norm_k: RMSNorm | None
    norm_added_q: RMSNorm | None
    norm_added_k: RMSNorm | None
    dim: int = eqx.field(static=True)
    context_dim: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    qk_norm: str | None = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    parallel: ParallelConfig
    implementation: str | kernels.AbstractImplementation = eqx.field(static=True)
    megatron: ClassVar[MegatronSplit] = MegatronSplit(
        column=("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"),
        row=("to_out", "to_add_out"))

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        context_dim: int | None = None,
        qk_norm: str | None = "rms",
        eps: float = 1e-6,
        parallel: ParallelConfig = ParallelConfig(),
        implementation: str | kernels.AbstractImplementation = "auto",
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `dim`: the model width (HunyuanVideo: `num_heads * attention_head_dim`, 24 x 128).
        - `num_heads`: the number of heads; `head_dim = dim / num_heads`.
        - `context_dim`: the width of the text tokens (diffusers' `added_kv_proj_dim`);
            default `dim` (HunyuanVideo embeds its text to `dim` first).
        - `qk_norm`: `"rms"` (HunyuanVideo's `qk_norm="rms_norm"`: RMSNorm over
            `head_dim` with a weight) or `None`.
        - `eps`: the RMSNorm epsilon (HunyuanVideo: 1e-6).
        - `parallel`: a [`ParallelConfig`][]; default: one device.
        - `implementation`: the kernel implementation (`vidax_eqx.kernels.attention`).
        - `dtype`: the parameters' dtype.
        - `key`: a PRNG key for the linear layers' initialization.
        """
        self.head_dim, eps = check_attention(
            "DualStreamAttention", dim, num_heads, eps=eps, parallel=parallel, qk_norm=qk_norm,
            qk_norms=("rms", None))
        context_dim = dim if context_dim is None else context_dim
        check_positive("DualStreamAttention", context_dim=context_dim)
        keys = init.split(key, 8)

        def lin(i, d_in):
            return init.linear(d_in, dim, dtype=dtype, key=keys[i])

        self.to_q, self.to_k, self.to_v, self.to_out = (lin(i, dim) for i in range(4))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (lin(i, context_dim)
                                                             for i in range(4, 7))
        self.to_add_out = lin(7, dim)
        if qk_norm == "rms":
            norms = [RMSNorm(self.head_dim, eps, dtype=dtype) for _ in range(4)]
        else:
            norms = [None] * 4
        self.norm_q, self.norm_k, self.norm_added_q, self.norm_added_k = norms
        self.dim, self.context_dim, self.num_heads = dim, context_dim, num_heads
        self.qk_norm, self.eps = qk_norm, eps
        self.parallel, self.implementation = parallel, implementation

    @checked
    def __call__(
        self,
        x: Float[Array, "S {self.dim}"],
        context: Float[Array, "T {self.context_dim}"],
        *,
        rope: Rope | None = None,
        context_length: Array | int | None = None,
    ) -> tuple[Float[Array, "S {self.dim}"], Float[Array, "T {self.dim}"]]:
        """**Arguments:**

        - `x`: the video tokens `(S, dim)` of one example: the whole sequence on one
            device, this device's chunk under sequence parallelism.
        - `context`: the text tokens `(T, context_dim)`, whole on every device.
        - `rope`: `(cos, sin)`, each `(S, head_dim // 2)`, for the video tokens of `x`
            only (sharded like `x`), rotating adjacent pairs (diffusers'
            `apply_rotary_emb(use_real_unbind_dim=-1)`, whose tables repeat each angle
            twice); `None`: no RoPE.
        - `context_length`: key-only padding of the text: an int scalar (a 0-d integer
            array, one per example under `jax.vmap`, or a Python int), the number of
            real text tokens; text tokens at index `>= context_length` are invisible
            as keys to every query, every text query is still computed. `None`: every
            text token is a key. A concrete value must lie in `[0, T]`; a traced value
            outside it acts as clipped to it.

        **Returns:**

        `(x_out, context_out)`, `(S, dim)` and `(T, dim)`: diffusers' processor's
        `(hidden_states, encoder_hidden_states)`. Under sequence parallelism `x_out`
        is this device's rows and `context_out` the whole text output, replicated.
        """
        with jax.named_scope("vidax_eqx.nn.DualStreamAttention"):
            T = context.shape[0]
            context_length = check_length("DualStreamAttention", "context_length",
                                          context_length, T)
            check_context("DualStreamAttention", self.parallel, x, context=context)
            self, (x, context, rope) = fsdp_gather(self, (x, context, rope))
            H = local_heads("DualStreamAttention", self, self.to_q)
            S, D = x.shape[0], self.head_dim
            tp_axis = self.parallel.tp_axis
            x, context = tp_input(x, tp_axis), tp_input(context, tp_axis)

            def heads(layer, norm, tokens):
                y = linear(layer, tokens).reshape(tokens.shape[0], H, D)
                return y if norm is None else norm(y)

            q = heads(self.to_q, self.norm_q, x)
            k = heads(self.to_k, self.norm_k, x)
            v = heads(self.to_v, None, x)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            q_t = heads(self.add_q_proj, self.norm_added_q, context)
            k_t = heads(self.add_k_proj, self.norm_added_k, context)
            v_t = heads(self.add_v_proj, None, context)
            # One joint attention over [video; text], the text whole on every device and
            # after the video (HunyuanVideo's order), its padding key-only.
            out = attend(jnp.concatenate([q, q_t]), jnp.concatenate([k, k_t]),
                         jnp.concatenate([v, v_t]), self.parallel, self.implementation,
                         text_len=T, text_position="suffix", text_lengths=context_length)
            out, out_t = out[:S], out[S:]
            x_out = row_parallel(self.to_out, out.reshape(S, H * D), tp_axis)
            context_out = row_parallel(self.to_add_out, out_t.reshape(T, H * D), tp_axis)
            return x_out, replicated_text(context_out, self.parallel)

