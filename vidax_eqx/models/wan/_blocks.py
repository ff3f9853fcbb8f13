"""The parts of Wan's transformer: the per-token timestep of image-to-video, the image
embedding, one block and the output head, each as Wan's own code names its fields."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from ..._deprecation import warn_deprecated
from ... import nn
from ...nn import sharding
from ...nn.internal import init, linear
from .._token_layout import AttentionInputs
from ._config import WanConfig


def wan_image_timestep(timestep, grid, *, patch_size=(1, 2, 2), cond_frames: int = 1):
    """The per-token timestep of image-to-video with Wan 2.2 TI2V: the tokens of the
    first `cond_frames` latent frames (the encoded image, kept clean) at 0, the rest at
    `timestep`, in the model's patch order (frame-major), as Wan 2.2's own code and
    diffusers' `expand_timesteps` build it.

    **Arguments:**

    - `timestep`: the denoising step's timestep, a scalar (traced or not).
    - `grid`: the latent grid `(F, H, W)` (or the latents' shape `(C, F, H, W)`).
    - `patch_size`: the model's `(pt, ph, pw)`.
    - `cond_frames`: the number of conditioning latent frames at the start (a patch
        is clean when its first latent frame is one of them).

    **Returns:**

    `(S,)`, `S = F/pt * H/ph * W/pw`, float32 (float64 for a float64 `timestep`):
    the `timestep` argument of [`WanTransformer3D`][].
    """
    grid = tuple(grid)[-3:]
    patch_size = tuple(patch_size)
    if len(grid) != 3 or any(g % p for g, p in zip(grid, patch_size)):
        raise ValueError(
            f"wan_image_timestep: `grid` must be the latent (F, H, W), each a multiple of "
            f"patch_size={patch_size}; received {grid}."
        )
    if isinstance(cond_frames, bool) or not isinstance(cond_frames, int) or not 0 <= cond_frames <= grid[0]:
        raise ValueError(
            f"wan_image_timestep: `cond_frames` must be an int in [0, {grid[0]}] (the latent "
            f"frames); received {cond_frames!r}."
        )
    timestep = jnp.asarray(timestep, jnp.result_type(timestep, jnp.float32))
    if timestep.ndim:
        raise ValueError(f"wan_image_timestep: `timestep` must be a scalar; received shape "
                         f"{timestep.shape}.")
    f, h, w = (g // p for g, p in zip(grid, patch_size))
    clean = jnp.arange(f) * patch_size[0] < cond_frames
    per_frame = jnp.where(clean, jnp.zeros_like(timestep), timestep)
    return jnp.repeat(per_frame, h * w)


class WanImageEmbedding(eqx.Module):
    """Wan I2V's projection of CLIP image features (`MLPProj`; diffusers'
    `WanImageEmbedding`): LayerNorm, Linear, GELU, Linear, LayerNorm (eps 1e-5); FLF2V
    first adds a learned position embedding (`pos_embed`; Wan's `emb_pos`) to the
    features of the first and the last frame, concatenated."""

    norm1: nn.LayerNorm
    ff: nn.FeedForward
    norm2: nn.LayerNorm
    pos_embed: Float[Array, "1 L_img image_dim"] | None

    def __init__(self, image_dim: int, dim: int, *, pos_embed_seq_len: int | None = None,
                 dtype=jnp.float32, key: PRNGKeyArray):
        """**Arguments:**

        - `image_dim`: the size of the CLIP image features (1280 in Wan 2.1 I2V).
        - `dim`: the model width.
        - `pos_embed_seq_len`: FLF2V: the number of image tokens (514), which get a
            learned position embedding (zeros at initialization, as in Wan); `None`:
            none.
        - `dtype`: the parameters' dtype.
        - `key`: a PRNG key for the initialization.
        """
        self.norm1 = nn.LayerNorm(image_dim, 1e-5, dtype=dtype)
        self.ff = nn.FeedForward(image_dim, image_dim, dim, activation="gelu", dtype=dtype, key=key)
        self.norm2 = nn.LayerNorm(dim, 1e-5, dtype=dtype)
        self.pos_embed = (None if pos_embed_seq_len is None
                          else init.zeros((1, pos_embed_seq_len, image_dim), dtype))

    def __call__(self, x):
        """**Arguments:**

        - `x`: the CLIP image features `(L_img, image_dim)` (257 tokens in Wan 2.1 I2V;
            FLF2V: the first frame's 257 then the last frame's, `pos_embed_seq_len`).

        **Returns:**

        `(L_img, dim)`, the image context of the blocks' cross-attention.
        """
        if self.pos_embed is not None:
            if x.shape[0] != self.pos_embed.shape[1]:
                raise ValueError(
                    f"WanImageEmbedding: an FLF2V model takes the image features of the first "
                    f"and the last frame, concatenated: {self.pos_embed.shape[1]} tokens "
                    f"(pos_embed_seq_len); received {x.shape[0]}."
                )
            x = x + self.pos_embed[0].astype(x.dtype)
        return self.norm2(self.ff(self.norm1(x)))


class WanBlockInputs(eqx.Module):
    """What every [`WanBlock`][] of a [`WanTransformer3D`][] takes in one call besides
    its residual stream, as one value (the model builds it once per call; the text
    cache's keys and values are set per block).

    **Fields:**

    - `attention`: the self-attention's [`AttentionInputs`][] (RoPE tables, segment
        ids, the sliding tile mask or the video sparse option), from the call's
        [`TokenLayout`][]: the rows of this device's tokens, in its order.
    - `e0`: the float32 time projection `(6, dim)`, added to each block's
        `modulation` for the shift, scale and gate of the self-attention and the FFN;
        with a timestep per token (Wan 2.2), `(S, 6, dim)`, rows like the tokens.
    - `context`: the embedded text `(L, dim)`, whole on every device; `None` with
        `context_kv`.
    - `context_image`: I2V: the embedded image features `(L_img, dim)`; else `None`.
    - `context_kv`: this block's precomputed cross-attention keys and values
        (`(k, v, k_img, v_img)`, see
        [`vidax_eqx.nn.CrossAttention`][]`.project_context`), used instead of `context`
        and `context_image` (then `None`); under FSDP the cross-attention's key and
        value weights are then not gathered. Default `None`.
    """

    attention: AttentionInputs
    e0: Float[Array, "*S 6 dim"]
    context: Float[Array, "L dim"] | None
    context_image: Float[Array, "L_img dim"] | None = None
    context_kv: tuple | None = None


class WanBlock(eqx.Module):
    """One Wan 2.1 block (`WanAttentionBlock`; diffusers' `WanTransformerBlock`).

        e = modulation + e0                 # float32 (6, dim), or (S, 6, dim) per token
        x = x + self_attn(norm1(x) * (1 + e[1]) + e[0], rope) * e[2]
        x = x + cross_attn(norm3(x), context)
        x = x + ffn(norm2(x) * (1 + e[4]) + e[3]) * e[5]

    The residual stream `x` and the modulation are float32 (Wan runs them under
    `autocast(float32)`); the attention and FFN inputs are cast to the weights' dtype
    and their outputs back to float32. Field names are Wan's.
    """

    norm1: nn.ModulatedLayerNorm
    self_attn: nn.Attention
    norm3: nn.LayerNorm | None
    cross_attn: nn.CrossAttention
    norm2: nn.ModulatedLayerNorm
    ffn: nn.FeedForward
    modulation: Float[Array, "1 6 dim"]

    def __init__(self, config: WanConfig, *, parallel: sharding.ParallelConfig, implementation,
                 dtype, key: PRNGKeyArray):
        """**Arguments:**

        - `config`: a [`WanConfig`][].
        - `parallel`: the [`vidax_eqx.nn.sharding.ParallelConfig`][] of the attention and FFN
            modules.
        - `implementation`: the attention kernel, as for
            [`vidax_eqx.kernels.attention`][].
        - `dtype`: the parameters' dtype.
        - `key`: a PRNG key for the initialization.
        """
        c = config
        k1, k2, k3, k4 = init.split(key, 4)
        qk_norm = "rms" if c.qk_norm else None
        self.norm1 = nn.ModulatedLayerNorm(c.dim, c.eps)
        self.self_attn = nn.Attention(c.dim, c.num_heads, qk_norm=qk_norm, eps=c.eps,
                                      parallel=parallel, implementation=implementation,
                                      gate_compress=c.gate_compress, dtype=dtype, key=k1)
        self.norm3 = nn.LayerNorm(c.dim, c.eps, dtype=dtype) if c.cross_attn_norm else None
        self.cross_attn = nn.CrossAttention(
            c.dim, c.num_heads, image_context_dim=None if c.image_dim is None else c.dim,
            qk_norm=qk_norm, eps=c.eps, parallel=parallel, implementation=implementation,
            dtype=dtype, key=k2,
        )
        self.norm2 = nn.ModulatedLayerNorm(c.dim, c.eps)
        self.ffn = nn.FeedForward(c.dim, c.ffn_dim, activation="gelu_tanh", parallel=parallel,
                                  dtype=dtype, key=k3)
        self.modulation = init.normal(k4, (1, 6, c.dim), dtype, std=c.dim**-0.5)

    def __call__(self, x: Float[Array, "S dim"], inputs: WanBlockInputs = None,
                 *deprecated_args, **deprecated_kwargs) -> Float[Array, "S dim"]:
        """**Arguments:**

        - `x`: the float32 residual stream `(S, dim)`: the whole sequence on one device,
            this device's chunk under sequence parallelism.
        - `inputs`: the block's [`WanBlockInputs`][] of this call (required): the time
            projection, the text (or this block's precomputed keys and values), and
            what the self-attention takes in the tokens' layout.

        The call before 0.2.0, `block(x, e0, context, rope, segment_ids, context_image,
        mask=None, context_kv=None, video_sparse=None)`, still works for a release, with
        a `DeprecationWarning`.

        **Returns:**

        The float32 residual stream `(S, dim)` after the block.
        """
        if deprecated_args or deprecated_kwargs or not isinstance(inputs, WanBlockInputs):
            old = () if inputs is None else (inputs,)
            inputs = _deprecated_inputs(*old, *deprecated_args, **deprecated_kwargs)
        with jax.named_scope("vidax_eqx.models.WanBlock"):
            return self._run(x, inputs, lambda attn, h, a: (attn(h, **a.kwargs()), None))[0]

    def with_past(self, x: Float[Array, "S dim"], inputs: WanBlockInputs, past_k, past_v, *,
                  past_valid=None):
        """The block on new tokens whose self-attention also sees earlier tokens' keys and
        values (a key/value cache, [`vidax_eqx.nn.Attention.with_past`][]): `inputs` as
        for the call (its `attention.mask` a `BlockCausalMask` over `[past; new]` with
        `query_offset = P`, or `None`); `past_k`, `past_v` `(P, H, head_dim)`;
        `past_valid` bool `(P,)`, the past slots that hold a token.

        **Returns:** `(x, (k, v))`: the residual stream after the block and the new
        tokens' keys and values `(S, H, head_dim)`."""
        with jax.named_scope("vidax_eqx.models.WanBlock.with_past"):
            def attend(attn, h, a):
                y, k, v = attn.with_past(h, past_k, past_v, rope=a.rope, mask=a.mask,
                                         past_valid=past_valid)
                return y, (k, v)

            return self._run(x, inputs, attend)

    def _run(self, x, inputs: WanBlockInputs, attend):
        """The block, its self-attention `attend(self_attn, h, attention_inputs) -> (y,
        extra)`; returns `(x, extra)`."""
        unused = None if inputs.context_kv is None else (lambda b: _context_weights(b.cross_attn))
        attention = inputs.attention
        self, (x, e0, context, rope, context_image) = sharding.fsdp_gather(
            self, (x, inputs.e0, inputs.context, attention.rope, inputs.context_image),
            exclude=unused)
        attention = dataclasses.replace(attention, rope=rope)
        dtype = self.self_attn.q.weight.dtype
        e = self.modulation[0].astype(jnp.float32) + e0  # (6, dim) or (S, 6, dim)
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.moveaxis(e, -2, 0)
        h = self.norm1(x, shift1, scale1).astype(dtype)
        y, extra = attend(self.self_attn, h, attention)
        x = x + y.astype(jnp.float32) * gate1
        h = x if self.norm3 is None else self.norm3(x)
        y = self.cross_attn(h.astype(dtype), context, context_image=context_image,
                            context_copies=True, context_kv=inputs.context_kv)
        x = x + y.astype(jnp.float32)
        h = self.norm2(x, shift2, scale2).astype(dtype)
        return x + self.ffn(h).astype(jnp.float32) * gate2, extra


def _deprecated_inputs(e0=None, context=None, rope=None, segment_ids=None, context_image=None,
                       mask=None, context_kv=None, video_sparse=None):
    """The `WanBlockInputs` of the call before 0.2.0,
    `block(x, e0, context, rope, segment_ids, context_image, mask=None, context_kv=None,
    video_sparse=None)`, with its warning."""
    if e0 is None:
        raise TypeError("WanBlock.__call__() missing its `inputs` (a models.WanBlockInputs).")
    # warn_deprecated <- here <- WanBlock.__call__ <- the block's caller
    warn_deprecated("WanBlock(x, e0, context, rope, segment_ids, context_image, ...)",
                    "WanBlock(x, models.WanBlockInputs(attention, e0, context, "
                    "context_image, context_kv))", stacklevel=3)
    attention = AttentionInputs(rope, segment_ids, mask, video_sparse)
    return WanBlockInputs(attention, e0, context, context_image, context_kv)


def _context_weights(attn: nn.CrossAttention):
    """The weights of a cross-attention that only its keys and values use."""
    return (attn.k, attn.v, attn.norm_k, attn.k_img, attn.v_img, attn.norm_k_img)


class WanHead(eqx.Module):
    """Wan's output head: modulated LayerNorm (float32), then `head` to patch values."""

    norm: nn.ModulatedLayerNorm
    head: eqx.nn.Linear
    modulation: Float[Array, "1 2 dim"]

    def __init__(self, config: WanConfig, *, dtype, key: PRNGKeyArray):
        """**Arguments:**

        - `config`: a [`WanConfig`][].
        - `dtype`: the parameters' dtype.
        - `key`: a PRNG key for the initialization.
        """
        c = config
        k1, k2 = init.split(key)
        out = c.out_channels * int(np.prod(c.patch_size))
        self.norm = nn.ModulatedLayerNorm(c.dim, c.eps)
        self.head = init.linear(c.dim, out, dtype=dtype, key=k1)
        self.modulation = init.normal(k2, (1, 2, c.dim), dtype, std=c.dim**-0.5)

    def __call__(self, x, e):
        """**Arguments:**

        - `x`: the float32 residual stream `(S, dim)` after the last block.
        - `e`: the float32 time embedding `(dim,)`, added to `modulation` for the
            shift and scale of the norm; `(S, dim)` with a timestep per token.

        **Returns:**

        The patch values `(S, out_channels * prod(patch_size))`, in the weights' dtype.
        """
        with jax.named_scope("vidax_eqx.models.WanHead"):
            self, (x, e) = sharding.fsdp_gather(self, (x, e))
            e = self.modulation[0].astype(jnp.float32) + e[..., None, :]  # (2, dim) or (S, 2, dim)
            shift, scale = jnp.moveaxis(e, -2, 0)
            h = self.norm(x, shift, scale).astype(self.head.weight.dtype)
            return linear(self.head, h)
