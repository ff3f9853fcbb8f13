"""The parts of CogVideoX's transformer: the patch embedding, the adaptive norms and one
block of joint attention, with diffusers' field names."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ..._deprecation import warn_deprecated
from ... import nn
from ...nn import sharding
from ...nn import functional
from ...nn.internal import init
from .._token_layout import AttentionInputs
from ._config import _ACTIVATIONS, CogVideoXConfig


class CogVideoXPatchEmbed(eqx.Module):
    """The patch and text embedding (diffusers' `CogVideoXPatchEmbed`): `proj`, a
    per-frame `Conv2d` as a [`vidax_eqx.nn.PatchEmbedding`][]; `text_proj`, a Linear;
    and, for 5B-I2V, the learned `pos_embedding` over `[text; video]`."""

    proj: nn.PatchEmbedding
    text_proj: eqx.nn.Linear
    pos_embedding: Float[Array, "1 N dim"] | None

    def __init__(self, config: CogVideoXConfig, *, dtype, key: PRNGKeyArray):
        c = config
        k1, k2 = init.split(key)
        p = c.patch_size
        self.proj = nn.PatchEmbedding(c.in_channels, c.dim, (p, p), dtype=dtype, key=k1)
        self.text_proj = init.linear(c.text_embed_dim, c.dim, dtype=dtype, key=k2)
        if c.use_learned_positional_embeddings:  # initialized as diffusers: zeros + sin-cos
            sincos = functional.sincos_embedding_3d(
                c.sample_grid, c.dim, spatial_interpolation_scale=c.spatial_interpolation_scale,
                temporal_interpolation_scale=c.temporal_interpolation_scale,
            )
            text = jnp.zeros((c.max_text_seq_length, c.dim), jnp.float32)
            self.pos_embedding = jnp.concatenate([text, sincos])[None].astype(dtype)
        else:
            self.pos_embedding = None


class CogVideoXLayerNormZero(eqx.Module):
    """CogVideoX's `LayerNormZero`: from the timestep embedding, `linear(silu(temb))`
    gives `(shift, scale, gate)` for the video and for the text; both are normalized by
    one affine LayerNorm and modulated ([`vidax_eqx.nn.ModulatedLayerNorm`][], float32,
    cast back to the compute dtype)."""

    linear: eqx.nn.Linear
    norm: nn.ModulatedLayerNorm

    def __init__(self, config: CogVideoXConfig, *, dtype, key: PRNGKeyArray):
        c = config
        self.linear = init.linear(c.time_embed_dim, 6 * c.dim, dtype=dtype, key=key)
        self.norm = nn.ModulatedLayerNorm(c.dim, c.norm_eps,
                                          elementwise_affine=c.norm_elementwise_affine, dtype=dtype)

    def __call__(self, x, context, temb):
        """`(norm x, norm context, video gate, text gate)`, in `x`'s dtype."""
        shift, scale, gate, c_shift, c_scale, c_gate = jnp.split(
            self.linear(jax.nn.silu(temb)), 6
        )
        x_n = self.norm(x, shift, scale).astype(x.dtype)
        c_n = self.norm(context, c_shift, c_scale).astype(x.dtype)
        return x_n, c_n, gate, c_gate


class CogVideoXBlockInputs(eqx.Module):
    """What every [`CogVideoXBlock`][] of a [`CogVideoXTransformer3D`][] takes in one
    call besides the video and text streams, as one value (the model builds it once
    per call).

    **Fields:**

    - `attention`: the joint attention's [`AttentionInputs`][] (the video tokens' RoPE
        tables, the segment ids of `[context; x]`, the sliding tile mask over
        `[context; x]`), from the call's [`TokenLayout`][] with its text prefix: the
        rows of this device's video tokens, in its order.
    - `temb`: the timestep embedding `(time_embed_dim,)`.
    """

    attention: AttentionInputs
    temb: Float[Array, " time_embed_dim"]


class CogVideoXBlock(eqx.Module):
    """One CogVideoX block (diffusers' `CogVideoXBlock`), on the video `x` and the text
    `context` side by side:

        x_n, c_n, g, g_c = norm1(x, context, temb)
        a_x, a_c = attn1(x_n, c_n, rope)          # joint attention over [context; x]
        x, context = x + g * a_x, context + g_c * a_c
        x_n, c_n, g, g_c = norm2(x, context, temb)
        f = ff([c_n; x_n])                        # tanh-GELU MLP, 4 * dim
        x, context = x + g * f[T:], context + g_c * f[:T]

    In the weights' dtype throughout, as diffusers computes it (the norms' statistics
    in float32). Field names are diffusers'.
    """

    norm1: CogVideoXLayerNormZero
    attn1: nn.JointAttention
    norm2: CogVideoXLayerNormZero
    ff: nn.FeedForward

    def __init__(self, config: CogVideoXConfig, *, parallel: sharding.ParallelConfig, implementation,
                 dtype, key: PRNGKeyArray):
        """**Arguments:**

        - `config`: a [`CogVideoXConfig`][].
        - `parallel`: the [`vidax_eqx.nn.sharding.ParallelConfig`][] of the attention and FFN
            modules.
        - `implementation`: the attention kernel, as for
            [`vidax_eqx.kernels.attention`][].
        - `dtype`: the parameters' dtype.
        - `key`: a PRNG key for the initialization.
        """
        c = config
        k1, k2, k3, k4 = init.split(key, 4)
        self.norm1 = CogVideoXLayerNormZero(c, dtype=dtype, key=k1)
        self.attn1 = nn.JointAttention(c.dim, c.num_attention_heads, qk_norm="layer_norm",
                                       eps=1e-6, parallel=parallel,
                                       implementation=implementation, dtype=dtype, key=k2)
        self.norm2 = CogVideoXLayerNormZero(c, dtype=dtype, key=k3)
        self.ff = nn.FeedForward(c.dim, 4 * c.dim, activation=_ACTIVATIONS[c.activation_fn],
                                 parallel=parallel, dtype=dtype, key=k4)

    def __call__(self, x: Float[Array, "S dim"], context: Float[Array, "T dim"],
                 inputs: CogVideoXBlockInputs = None, *deprecated_args, **deprecated_kwargs):
        """**Arguments:**

        - `x`: the video tokens `(S, dim)`: the whole sequence on one device, this
            device's chunk under sequence parallelism.
        - `context`: the text tokens `(T, dim)`: this device's copy of the text stream,
            the same on every device.
        - `inputs`: the block's [`CogVideoXBlockInputs`][] of this call (required): the
            timestep embedding and what the joint attention takes in the tokens'
            layout.

        The call before 0.2.0, `block(x, context, temb, rope, segment_ids, mask=None)`,
        still works for a release, with a `DeprecationWarning`.

        **Returns:**

        `(x, context)` after the block, `(S, dim)` and `(T, dim)`.
        """
        if deprecated_args or deprecated_kwargs or not isinstance(inputs, CogVideoXBlockInputs):
            old = () if inputs is None else (inputs,)
            inputs = _deprecated_inputs(*old, *deprecated_args, **deprecated_kwargs)
        with jax.named_scope("vidax_eqx.models.CogVideoXBlock"):
            attention = inputs.attention
            self, (x, context, temb, rope) = sharding.fsdp_gather(
                self, (x, context, inputs.temb, attention.rope))
            attention = dataclasses.replace(attention, rope=rope)
            T = context.shape[0]
            x_n, c_n, gate, c_gate = self.norm1(x, context, temb)
            a_x, a_c = self.attn1(x_n, c_n, context_copies=True, **attention.kwargs())
            x, context = x + gate * a_x, context + c_gate * a_c
            x_n, c_n, gate, c_gate = self.norm2(x, context, temb)
            f = self.ff(jnp.concatenate([c_n, x_n]))
            return x + gate * f[T:], context + c_gate * f[:T]


def _deprecated_inputs(temb=None, rope=None, segment_ids=None, mask=None):
    """The `CogVideoXBlockInputs` of the call before 0.2.0,
    `block(x, context, temb, rope, segment_ids, mask=None)`, with its warning."""
    if temb is None:
        raise TypeError("CogVideoXBlock.__call__() missing its `inputs` (a "
                        "models.CogVideoXBlockInputs).")
    # warn_deprecated <- here <- CogVideoXBlock.__call__ <- the block's caller
    warn_deprecated("CogVideoXBlock(x, context, temb, rope, segment_ids, mask)",
                    "CogVideoXBlock(x, context, models.CogVideoXBlockInputs(attention, temb))",
                    stacklevel=3)
    return CogVideoXBlockInputs(AttentionInputs(rope, segment_ids, mask), temb)


class CogVideoXAdaLayerNorm(eqx.Module):
    """The output norm (diffusers' `AdaLayerNorm` with `chunk_dim=1`): `linear(silu(temb))`
    gives `(shift, scale)` of a modulated affine LayerNorm."""

    linear: eqx.nn.Linear
    norm: nn.ModulatedLayerNorm

    def __init__(self, config: CogVideoXConfig, *, dtype, key: PRNGKeyArray):
        c = config
        self.linear = init.linear(c.time_embed_dim, 2 * c.dim, dtype=dtype, key=key)
        self.norm = nn.ModulatedLayerNorm(c.dim, c.norm_eps,
                                          elementwise_affine=c.norm_elementwise_affine, dtype=dtype)

    def __call__(self, x, temb):
        shift, scale = jnp.split(self.linear(jax.nn.silu(temb)), 2)
        return self.norm(x, shift, scale).astype(x.dtype)
