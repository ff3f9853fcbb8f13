"""Wan 2.1's and 2.2's video DiT (`WanModel` of Wan's `wan/modules/model.py`; diffusers'
`WanTransformer3DModel`), composed from `vidax_eqx.nn`."""

import dataclasses
import json
import math
import os
import re
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike, Bool, Float, jaxtyped, PRNGKeyArray, Real

from .. import interop, kernels, nn
from .._vma import varying_axes
from ..parallel import axis_size
from ..nn import functional
from ..nn.internal import init
from ..nn.internal import linear
from ..nn.internal import check_text, padded_tokens
from ._common import (
    AbstractExperts,
    batch_axes,
    check_batch_axis,
    check_fsdp_axes,
    check_remat,
    load_pretrained,
    read_config,
    scan_layers,
    sliding_tile_mask,
    video_sparse_option,
)
from ._step_cache import cached_blocks, check_step_cache, StepCache


@dataclasses.dataclass(frozen=True)
class WanConfig:
    """The shape of a Wan 2.1 or 2.2 transformer (immutable, hashable: a static field).

    The defaults are Wan 2.1 T2V 1.3B. Wan 14B: `dim=5120, ffn_dim=13824,
    num_heads=40, num_layers=40`. Build one from a checkpoint's `config.json` with
    [`WanConfig.from_diffusers`][] or [`WanConfig.from_wan`][] (what
    [`WanTransformer3D.from_pretrained`][] does).

    **Fields:**

    - `dim`, `ffn_dim`, `num_heads`, `num_layers`: width, MLP width, heads, blocks.
    - `in_channels`, `out_channels`: latent channels in and out (16; I2V takes 36 in).
    - `patch_size`: `(pt, ph, pw)`, default `(1, 2, 2)`.
    - `text_dim`: the text encoder's width (umT5: 4096); `freq_dim`: the timestep
        sinusoid's width (256).
    - `eps`: the norms' epsilon.
    - `qk_norm`: RMSNorm on queries and keys (Wan 2.1: always).
    - `cross_attn_norm`: the affine LayerNorm before the cross-attention.
    - `image_dim`: the CLIP image feature width of the I2V models (1280), or `None`
        (text-to-video: no image branch).
    - `text_len`: `None` uses the text context as given (diffusers' transformer);
        an int zero-pads it to that many tokens before the text embedding, as Wan's
        own `WanModel.forward` does (`text_len=512`), so that the model also attends
        to the embedded padding. The two differ in their numbers.
    - `rope_theta`: the RoPE base (10000).
    - `pos_embed_seq_len`: Wan 2.1 FLF2V (first-last-frame to video): the length of
        the learned position embedding added to the image features (514: the CLIP
        tokens of the first frame, then the last frame's), or `None`. Needs `image_dim`.
    - `gate_compress`: each block's self-attention has the `to_gate_compress`
        projection of FastVideo's video sparse attention (VSA) Wan models: the gate of
        VSA's coarse output (`blocks.N.to_gate_compress.*` in a diffusers checkpoint).
        Not a field of the reference configs: `from_pretrained(gate_compress=True)`.

    The released models, as [`WanConfig.preset`][] names them:

    | preset | dim | ffn_dim | heads | layers | channels in / out | image_dim | pos_embed_seq_len |
    |---|---|---|---|---|---|---|---|
    | `"t2v-1.3b"` (Wan 2.1) | 1536 | 8960 | 12 | 30 | 16 / 16 | - | - |
    | `"t2v-14b"` (Wan 2.1) | 5120 | 13824 | 40 | 40 | 16 / 16 | - | - |
    | `"i2v-14b"` (Wan 2.1) | 5120 | 13824 | 40 | 40 | 36 / 16 | 1280 | - |
    | `"flf2v-14b"` (Wan 2.1) | 5120 | 13824 | 40 | 40 | 36 / 16 | 1280 | 514 |
    | `"ti2v-5b"` (Wan 2.2) | 3072 | 14336 | 24 | 30 | 48 / 48 | - | - |
    | `"t2v-a14b"` (Wan 2.2, each expert) | 5120 | 13824 | 40 | 40 | 16 / 16 | - | - |
    | `"i2v-a14b"` (Wan 2.2, each expert) | 5120 | 13824 | 40 | 40 | 36 / 16 | - | - |

    All use patch `(1, 2, 2)`, `text_dim` 4096 (umT5) and `freq_dim` 256. Wan 2.2's
    TI2V-5B takes a timestep per token ([`wan_image_timestep`][]); its 48 latent
    channels are those of the Wan 2.2 VAE. The A14B models are two experts
    ([`WanExperts`][]).
    """

    dim: int = 1536
    ffn_dim: int = 8960
    num_heads: int = 12
    num_layers: int = 30
    in_channels: int = 16
    out_channels: int = 16
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 4096
    freq_dim: int = 256
    eps: float = 1e-6
    qk_norm: bool = True
    cross_attn_norm: bool = True
    image_dim: int | None = None
    text_len: int | None = None
    rope_theta: float = 10000.0
    pos_embed_seq_len: int | None = None
    gate_compress: bool = False

    def __post_init__(self):
        for name in ("dim", "ffn_dim", "num_heads", "num_layers", "in_channels", "out_channels",
                     "text_dim", "freq_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"WanConfig: `{name}` must be a positive int; received {value!r}.")
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 2:
            raise ValueError(
                "WanConfig: `dim` must be a multiple of `num_heads` with an even head_dim; "
                f"received dim={self.dim}, num_heads={self.num_heads}."
            )
        if self.pos_embed_seq_len is not None:
            value = self.pos_embed_seq_len
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"WanConfig: `pos_embed_seq_len` must be None or a positive int; received {value!r}."
                )
            if self.image_dim is None:
                raise ValueError(
                    "WanConfig: `pos_embed_seq_len` (FLF2V's image position embedding) needs "
                    f"`image_dim` (the image branch); received pos_embed_seq_len={value}, "
                    "image_dim=None."
                )
        if not isinstance(self.gate_compress, bool):
            raise ValueError(
                f"WanConfig: `gate_compress` must be a bool; received {self.gate_compress!r}."
            )
        object.__setattr__(self, "patch_size", tuple(self.patch_size))

    @classmethod
    def preset(cls, name: str, **overrides) -> "WanConfig":
        """The configuration of a released Wan model (the table above), e.g.
        `WanConfig.preset("ti2v-5b")`; `overrides` replace fields (e.g. `num_layers=2`
        for a test)."""
        if name not in _PRESETS:
            raise ValueError(f"WanConfig.preset: `name` must be one of {sorted(_PRESETS)}; "
                             f"received {name!r}.")
        return cls(**{**_PRESETS[name], **overrides})

    @property
    def head_dim(self) -> int:
        """The attention head size, `dim // num_heads`."""
        return self.dim // self.num_heads

    @classmethod
    def from_diffusers(cls, config: dict, **overrides) -> "WanConfig":
        """From a diffusers `WanTransformer3DModel` `config.json` (as a dict)."""
        heads, head_dim = config.get("num_attention_heads", 40), config.get("attention_head_dim", 128)
        dim = heads * head_dim
        image_dim = config.get("image_dim")
        added = config.get("added_kv_proj_dim")
        if (image_dim is None) != (added is None) or added not in (None, dim):
            raise ValueError(
                "WanConfig: an I2V config has image_dim and added_kv_proj_dim == the model "
                f"width ({dim}); received image_dim={image_dim}, added_kv_proj_dim={added}."
            )
        fields = dict(
            dim=dim,
            ffn_dim=config.get("ffn_dim", 13824),
            num_heads=heads,
            num_layers=config.get("num_layers", 40),
            in_channels=config.get("in_channels", 16),
            out_channels=config.get("out_channels") or config.get("in_channels", 16),
            patch_size=tuple(config.get("patch_size", (1, 2, 2))),
            text_dim=config.get("text_dim", 4096),
            freq_dim=config.get("freq_dim", 256),
            eps=config.get("eps", 1e-6),
            qk_norm=config.get("qk_norm", "rms_norm_across_heads") is not None,
            cross_attn_norm=config.get("cross_attn_norm", True),
            image_dim=image_dim,
            pos_embed_seq_len=config.get("pos_embed_seq_len"),
        )
        return cls(**{**fields, **overrides})

    @classmethod
    def from_wan(cls, config: dict, tensors=None, **overrides) -> "WanConfig":
        """From an original Wan 2.1 or 2.2 `config.json` (`dim`, `ffn_dim`, `num_heads`, ...).

        `model_type` `"t2v"`, `"i2v"`, `"flf2v"` (Wan 2.1) and `"ti2v"` (Wan 2.2) are
        read. Wan 2.2's I2V experts have no image branch (no CLIP features): with
        `tensors`, the branch is there when its weights are; without, `"i2v"` means
        Wan 2.1's (CLIP features of width 1280). Real Wan configs leave out `text_dim`, `patch_size`, `qk_norm`,
        `cross_attn_norm` and `window_size`: they are read off the checkpoint's tensor
        shapes when `tensors` (a mapping with `shape(name)`, e.g.
        [`vidax_eqx.interop.open_checkpoint`][]) is given, and take Wan's defaults
        otherwise.
        """
        model_type = config.get("model_type", "t2v")
        if model_type not in ("t2v", "i2v", "flf2v", "ti2v"):
            raise NotImplementedError(
                f"WanConfig: model_type={model_type!r} is not implemented (t2v, i2v, flf2v "
                "and ti2v are)."
            )
        window = tuple(config.get("window_size", (-1, -1)))
        if window != (-1, -1):
            raise NotImplementedError(
                f"WanConfig: window_size={window} (local attention on flattened tokens) is not "
                "implemented; Wan 2.1's released models use (-1, -1)."
            )
        def shape(name):  # None: no tensors given, or no such tensor
            return tensors.shape(name) if tensors is not None and name in tensors else None

        def has(name):  # None: no tensors given
            return None if tensors is None else name in tensors

        patch = shape("patch_embedding.weight")
        text = shape("text_embedding.0.weight")
        image = shape("img_emb.proj.0.weight")
        position = shape("img_emb.emb_pos")
        if model_type in ("t2v", "ti2v") or (tensors is not None and image is None):
            image_dim = None  # Wan 2.2's I2V experts: no image branch
        else:
            image_dim = 1280 if image is None else image[0]
        fields = dict(
            dim=config.get("dim", 2048),
            ffn_dim=config.get("ffn_dim", 8192),
            num_heads=config.get("num_heads", 16),
            num_layers=config.get("num_layers", 32),
            in_channels=config.get("in_dim", 16 if patch is None else patch[1]),
            out_channels=config.get("out_dim", 16),
            patch_size=tuple(config.get("patch_size", (1, 2, 2) if patch is None else patch[2:])),
            text_dim=config.get("text_dim", 4096 if text is None else text[1]),
            freq_dim=config.get("freq_dim", 256),
            eps=config.get("eps", 1e-6),
            qk_norm=config.get("qk_norm", has("blocks.0.self_attn.norm_q.weight") is not False),
            cross_attn_norm=config.get("cross_attn_norm", has("blocks.0.norm3.weight") is not False),
            image_dim=image_dim,
            pos_embed_seq_len=(None if model_type != "flf2v" or image_dim is None
                               else 514 if position is None else position[1]),
        )
        return cls(**{**fields, **overrides})

    def to_diffusers(self) -> dict:
        """The diffusers `config.json` of this model."""
        return {
            "_class_name": "WanTransformer3DModel",
            "patch_size": list(self.patch_size),
            "num_attention_heads": self.num_heads,
            "attention_head_dim": self.head_dim,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "text_dim": self.text_dim,
            "freq_dim": self.freq_dim,
            "ffn_dim": self.ffn_dim,
            "num_layers": self.num_layers,
            "cross_attn_norm": self.cross_attn_norm,
            "qk_norm": "rms_norm_across_heads" if self.qk_norm else None,
            "eps": self.eps,
            "image_dim": self.image_dim,
            "added_kv_proj_dim": None if self.image_dim is None else self.dim,
            "rope_max_seq_len": 1024,
            "pos_embed_seq_len": self.pos_embed_seq_len,
        }

    def to_wan(self) -> dict:
        """The original Wan `config.json` of this model (with every key it may omit)."""
        return {
            "_class_name": "WanModel",
            "model_type": ("flf2v" if self.pos_embed_seq_len is not None
                           else "i2v" if self.image_dim is not None
                           or self.in_channels != self.out_channels else "t2v"),
            "patch_size": list(self.patch_size),
            "text_len": 512 if self.text_len is None else self.text_len,
            "in_dim": self.in_channels,
            "dim": self.dim,
            "ffn_dim": self.ffn_dim,
            "freq_dim": self.freq_dim,
            "text_dim": self.text_dim,
            "out_dim": self.out_channels,
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "window_size": [-1, -1],
            "qk_norm": self.qk_norm,
            "cross_attn_norm": self.cross_attn_norm,
            "eps": self.eps,
        }


_WAN_14B = dict(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)
_PRESETS = {
    "t2v-1.3b": dict(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30),
    "t2v-14b": _WAN_14B,
    "i2v-14b": dict(_WAN_14B, in_channels=36, image_dim=1280),
    "flf2v-14b": dict(_WAN_14B, in_channels=36, image_dim=1280, pos_embed_seq_len=514),
    "ti2v-5b": dict(dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, in_channels=48,
                    out_channels=48),
    "t2v-a14b": _WAN_14B,
    "i2v-a14b": dict(_WAN_14B, in_channels=36),
}


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

    def __init__(self, config: WanConfig, *, parallel: nn.sharding.ParallelConfig, implementation,
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

    def __call__(self, x, e0, context, rope, segment_ids, context_image, mask=None,
                 context_kv=None, video_sparse=None):
        """**Arguments:**

        - `x`: the float32 residual stream `(S, dim)`: the whole sequence on one device,
            this device's chunk under sequence parallelism.
        - `e0`: the float32 time projection `(6, dim)`, added to `modulation` for the
            shift, scale and gate of the self-attention and the FFN; with a timestep
            per token (Wan 2.2), `(S, 6, dim)`, rows like the tokens of `x`.
        - `context`: the embedded text `(L, dim)`, whole on every device.
        - `rope`: `(cos, sin)`, each `(S, head_dim // 2)`, for the tokens of `x`.
        - `segment_ids`: int `(S,)` or `None`, as for [`vidax_eqx.nn.Attention`][]
            (negative ids are padding).
        - `context_image`: I2V: the embedded image features `(L_img, dim)`; else `None`.
        - `mask`: the self-attention's `SlidingTileMask` (tokens in its tile layout), or
            `None` for full attention.
        - `context_kv`: this block's precomputed cross-attention keys and values
            (`(k, v, k_img, v_img)`, see [`vidax_eqx.nn.CrossAttention`][]`.project_context`),
            used instead of `context` and `context_image` (then `None`); under FSDP the
            cross-attention's key and value weights are then not gathered.
        - `video_sparse`: a [`vidax_eqx.nn.VideoSparse`][]: the self-attention is
            video sparse attention (tokens in its tile layout; `segment_ids` and `mask`
            are then not used by it), gated by its `to_gate_compress` when it has one.

        **Returns:**

        The float32 residual stream `(S, dim)` after the block.
        """
        with jax.named_scope("vidax_eqx.models.WanBlock"):
            unused = None if context_kv is None else (lambda b: _context_weights(b.cross_attn))
            self, (x, e0, context, rope, context_image) = nn.sharding.fsdp_gather(
                self, (x, e0, context, rope, context_image), exclude=unused)
            dtype = self.self_attn.q.weight.dtype
            e = self.modulation[0].astype(jnp.float32) + e0  # (6, dim) or (S, 6, dim)
            shift1, scale1, gate1, shift2, scale2, gate2 = jnp.moveaxis(e, -2, 0)
            h = self.norm1(x, shift1, scale1).astype(dtype)
            if video_sparse is None:
                y = self.self_attn(h, rope=rope, segment_ids=segment_ids, mask=mask)
            else:
                y = self.self_attn(h, rope=rope, video_sparse=video_sparse)
            x = x + y.astype(jnp.float32) * gate1
            h = x if self.norm3 is None else self.norm3(x)
            y = self.cross_attn(h.astype(dtype), context, context_image=context_image,
                                context_copies=True, context_kv=context_kv)
            x = x + y.astype(jnp.float32)
            h = self.norm2(x, shift2, scale2).astype(dtype)
            return x + self.ffn(h).astype(jnp.float32) * gate2


def _context_weights(attn: nn.CrossAttention):
    """The weights of a cross-attention that only its keys and values use."""
    return (attn.k, attn.v, attn.norm_k, attn.k_img, attn.v_img, attn.norm_k_img)


class WanTextCache(eqx.Module):
    """The keys and values of every block's cross-attention for one text (and image)
    context: what [`WanTransformer3D.text_cache`][] computes once and
    `WanTransformer3D.__call__(..., text_cache=...)` takes instead of projecting the
    context in every block at every denoising step (the text does not change across
    steps). Exact: the model gives bit for bit the output it gives without it.

    Arrays stacked over the layers like the blocks (one slice per step of the blocks'
    `lax.scan`), heads last but one; `jax.vmap` adds a leading batch axis:

    - `k`, `v`: `(num_layers, L, H, head_dim)`, the text's (`k` after `norm_k`), `L`
        the text length the blocks see (the config's `text_len` when it pads);
    - `k_img`, `v_img`: I2V: `(num_layers, L_img, H, head_dim)`, the image context's;
        else `None`.

    `H` is `num_heads`; inside `shard_map` under tensor parallelism, this device's
    `num_heads / tp` (a global cache splits its heads over `tp_axis`:
    [`partition_specs`][WanTextCache.partition_specs], [`sharded_text_cache`][]).

    Inference only: the keys and values are inputs, so a gradient through a call that
    takes them reaches neither the text nor the cross-attention's `k`, `v` (`k_img`,
    `v_img`, `norm_k`, `norm_k_img`) weights unless the cache was computed inside the
    differentiated function.

    CogVideoX has no equivalent: its text goes through joint self-attention with the
    video and changes in every block, so its keys and values cannot be cached exactly.
    """

    k: Array
    v: Array
    k_img: Array | None
    v_img: Array | None

    def partition_specs(self, parallel: nn.sharding.ParallelConfig, batch_axis=None) -> "WanTextCache":
        """The `shard_map` specs of a batched cache `(B, num_layers, L, H, head_dim)` for
        a model configured with `parallel`: the batch over `batch_axis`, the heads over
        `parallel.tp_axis` (each device gets its heads), the rest whole. What
        [`run_sharded`][] gives its `text_cache` argument."""
        spec = P(batch_axis, None, None, parallel.tp_axis, None)
        image = None if self.k_img is None else spec
        return WanTextCache(spec, spec, image, image)


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
            self, (x, e) = nn.sharding.fsdp_gather(self, (x, e))
            e = self.modulation[0].astype(jnp.float32) + e[..., None, :]  # (2, dim) or (S, 2, dim)
            shift, scale = jnp.moveaxis(e, -2, 0)
            h = self.norm(x, shift, scale).astype(self.head.weight.dtype)
            return linear(self.head, h)


# Checkpoint names: the fields carry Wan's names, except where a module of `nn` serves a
# role that Wan spells as a `Sequential` index; diffusers renames most of the model.
# (pattern, wan replacement, diffusers replacement), applied to the generated names.
_NAMES = (
    (r"^time_projection\.", "time_projection.1.", "condition_embedder.time_proj."),
    (r"^time_embedding\.", "time_embedding.", "condition_embedder.time_embedder."),
    (r"^text_embedding\.net\.0\.proj\.", None, "condition_embedder.text_embedder.linear_1."),
    (r"^text_embedding\.net\.2\.", None, "condition_embedder.text_embedder.linear_2."),
    (r"^img_emb\.pos_embed$", "img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"),
    (r"^img_emb\.norm1\.", "img_emb.proj.0.", "condition_embedder.image_embedder.norm1."),
    (r"^img_emb\.ff\.0\.", "img_emb.proj.1.", None),
    (r"^img_emb\.ff\.2\.", "img_emb.proj.3.", None),
    (r"^img_emb\.ff\.", None, "condition_embedder.image_embedder.ff."),
    (r"^img_emb\.norm2\.", "img_emb.proj.4.", "condition_embedder.image_embedder.norm2."),
    # FastVideo's VSA Wan: the gate of the coarse output, a block-level name.
    (r"^(blocks\.\d+\.)self_attn\.to_gate_compress\.", None, r"\1to_gate_compress."),
    (r"^(blocks\.\d+\.)self_attn\.", None, r"\1attn1."),
    (r"^(blocks\.\d+\.)cross_attn\.", None, r"\1attn2."),
    (r"^(blocks\.\d+\.)norm3\.", None, r"\1norm2."),
    (r"^(blocks\.\d+\.)modulation$", None, r"\1scale_shift_table"),
    (r"^head\.head\.", None, "proj_out."),
    (r"^head\.modulation$", None, "scale_shift_table"),
)
_STACKED = ("blocks",)


def _rename(name: str, naming: str, rules=_NAMES) -> str:
    column = 1 if naming == "wan" else 2
    for rule in rules:
        if rule[column] is not None and re.match(rule[0], name):
            return re.sub(rule[0], rule[column], name)
    return name


class WanTransformer3D(eqx.Module):
    """The Wan 2.1 / 2.2 video DiT, one example per call (`jax.vmap` for a batch).

        tokens = patch_embedding(x)                       # (S, dim), S = F/pt * H/ph * W/pw
        t = time_embedding(sinusoid(timestep));  e0 = time_projection(silu(t))  # (6, dim)
                                                # per-token timestep (S,): (S, dim), (S, 6, dim)
        context = text_embedding(context)                 # (+ img_emb(context_image): I2V)
        tokens = blocks(tokens, e0, context, rope_3d)     # lax.scan over stacked blocks
        out = unpatchify(head(tokens, t))                 # (C_out, F, H, W)

    Built from [`vidax_eqx.nn`][]: [`vidax_eqx.nn.PatchEmbedding`][],
    [`vidax_eqx.nn.TimestepEmbedding`][], [`vidax_eqx.nn.FeedForward`][],
    [`vidax_eqx.nn.Attention`][] with 3D RoPE, [`vidax_eqx.nn.CrossAttention`][],
    [`vidax_eqx.nn.ModulatedLayerNorm`][]. The blocks are one [`WanBlock`][] whose
    arrays carry a leading layer axis (built with `eqx.filter_vmap`), run by
    `lax.scan`; checkpoints name them per layer (`blocks.0.`, ...), and
    [`from_pretrained`][WanTransformer3D.from_pretrained] / [`save_pretrained`][]
    stack and unstack them.

    **Parallelism:** the [`vidax_eqx.nn.sharding.ParallelConfig`][] of the attention and FFN
    modules (set with [`vidax_eqx.nn.sharding.with_parallel`][]) decides. Inside
    `jax.shard_map` with `x` whole on every device (see [`run_sharded`][], the one
    call that does all of it), a sequence-parallel model cuts the video into patches,
    keeps its own share (padded to a multiple of the devices; the padding is invisible
    through segment ids) and embeds only those, takes its rows of the RoPE tables,
    runs its blocks on its chunk, and gathers the output tokens before unpatchify; a tensor-parallel one splits
    heads and MLP features (weights placed by [`vidax_eqx.nn.sharding.partition_specs`][]).

    **Fields:** `patch_embedding`, `text_embedding`, `time_embedding`,
    `time_projection`, `img_emb` (I2V, else `None`), `blocks`, `head`, and the static
    `config` ([`WanConfig`][]).
    """

    patch_embedding: nn.PatchEmbedding
    text_embedding: nn.FeedForward
    time_embedding: nn.TimestepEmbedding
    time_projection: eqx.nn.Linear
    img_emb: WanImageEmbedding | None
    blocks: WanBlock
    head: WanHead
    config: WanConfig = eqx.field(static=True)
    stacked_layers: ClassVar[tuple[str, ...]] = ("blocks",)

    def __init__(
        self,
        config: WanConfig,
        *,
        parallel: nn.sharding.ParallelConfig = nn.sharding.ParallelConfig(),
        implementation="auto",
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `config`: a [`WanConfig`][].
        - `parallel`: the [`vidax_eqx.nn.sharding.ParallelConfig`][] of every attention and FFN
            module; default one device.
        - `implementation`: the attention kernel (`vidax_eqx.kernels.attention`).
        - `dtype`: the parameters' dtype (the computation's, outside the float32
            residual stream and modulation).
        - `key`: a PRNG key for the initialization.
        """
        if not isinstance(config, WanConfig):
            raise ValueError(f"WanTransformer3D: `config` must be a WanConfig; received {config!r}.")
        c = config
        keys = init.split(key, 7)
        self.patch_embedding = nn.PatchEmbedding(c.in_channels, c.dim, c.patch_size, dtype=dtype,
                                                 key=keys[0])
        self.text_embedding = nn.FeedForward(c.text_dim, c.dim, c.dim, activation="gelu_tanh",
                                             dtype=dtype, key=keys[1])
        self.time_embedding = nn.TimestepEmbedding(c.freq_dim, c.dim, dtype=dtype, key=keys[2])
        self.time_projection = init.linear(c.dim, 6 * c.dim, dtype=dtype, key=keys[3])
        self.img_emb = (None if c.image_dim is None
                        else WanImageEmbedding(c.image_dim, c.dim,
                                               pos_embed_seq_len=c.pos_embed_seq_len,
                                               dtype=dtype, key=keys[4]))

        def make_block(k):
            return WanBlock(c, parallel=parallel, implementation=implementation, dtype=dtype, key=k)

        self.blocks = init.stacked(make_block, init.split(keys[5], c.num_layers))
        self.head = WanHead(c, dtype=dtype, key=keys[6])
        self.config = c

    @property
    def parallel(self) -> nn.sharding.ParallelConfig:
        """The [`vidax_eqx.nn.sharding.ParallelConfig`][] the model runs with."""
        return self.blocks.self_attn.parallel

    @jaxtyped(typechecker=beartype)
    def __call__(
        self,
        x: Float[Array, "{self.config.in_channels} F H W"],
        timestep: Real[Array, ""] | Real[Array, " S"],
        context: Float[Array, "L {self.config.text_dim}"],
        *,
        context_image: Float[Array, "L_img {self.config.image_dim}"] | None = None,
        remat: str | None = None,
        sliding_tile: tuple | None = None,
        video_sparse: tuple | None = None,
        text_cache: WanTextCache | None = None,
    ) -> Float[Array, "{self.config.out_channels} F H W"]:
        """**Arguments:**

        - `x`: the noisy latents `(C, F, H, W)` of one video (the reference's layout
            without the batch axis), `F, H, W` multiples of the patch size. Whole on
            every device under sequence parallelism.
        - `timestep`: the diffusion timestep (0 to 1000 in Wan): a scalar, or one per
            patch token `(S,)`, `S = F/pt * H/ph * W/pw`, in the patch order
            (frame-major; diffusers' `(B, seq_len)` timestep without the batch axis),
            as Wan 2.2 TI2V takes it ([`wan_image_timestep`][]). Per token, the time
            embedding, every block's modulation and the head's run per token; under
            sequence parallelism and sliding tile attention the timesteps are laid out,
            padded and split exactly like the tokens. A scalar costs no per-token work.
        - `context`: the text encoder's output `(L, text_dim)`, whole on every device.
        - `context_image`: I2V only: the CLIP image features `(257, image_dim)`; FLF2V
            (`pos_embed_seq_len` set): the first frame's then the last frame's,
            `(pos_embed_seq_len, image_dim)`.
        - `remat`: the rematerialization policy of each block in the backward pass:
            `None` (store activations), `"full"` (recompute everything), or the name
            of a `jax.checkpoint_policies` policy (e.g. `"dots_saveable"`).
        - `sliding_tile`: `(tile, window)` runs every self-attention as sliding tile
            attention ([`vidax_eqx.kernels.SlidingTileMask`][]`(patch_grid, tile,
            window)`, `window` shared or one per head): the patch tokens and their
            RoPE tables are laid out tile by tile ([`vidax_eqx.kernels.tile_permute`][])
            after the patch embedding and back before the output, and the hidden
            tiles are skipped. `None` (default): full attention, as the reference.
        - `video_sparse`: `(tile, topk or sparsity)` runs every self-attention as video
            sparse attention (VSA, [`vidax_eqx.kernels.video_sparse_attention`][]): the
            tokens and RoPE tables are laid out tile by tile as for `sliding_tile`
            (exclusive with it), a coarse attention over tile means picks each query
            tile's key tiles, and the output is `out_c * gate + out_fine` with the
            blocks' `to_gate_compress` gate (a model built with
            `WanConfig(gate_compress=True)`, e.g. FastVideo's VSA checkpoints), or
            `out_c + out_fine` without one. An int is `topk` (key tiles per query
            tile), a float the `sparsity` (fraction of key tiles skipped, in [0, 1);
            e.g. `((4, 4, 4), 0.9)`, FastVideo's tiles). Under sequence parallelism
            the layout is split by whole tiles (padding tiles are empty) and the
            attention is [`vidax_eqx.parallel.video_sparse_attention`][].
        - `text_cache`: the blocks' cross-attention keys and values of this `context`
            (and `context_image`), a [`WanTextCache`][] computed by
            [`text_cache`][WanTransformer3D.text_cache] (inside `shard_map`: this
            device's heads, e.g. by [`sharded_text_cache`][]): used instead of
            projecting the context in every block, with bit for bit the same output.
            `context` (and `context_image`) are still required: their shapes are
            checked against the cache (their values cannot be), and they are not
            otherwise used. `None` (default): the context is projected.

        **Returns:**

        The prediction `(out_channels, F, H, W)` (Wan: the flow velocity), in the
        weights' dtype.
        """
        with jax.named_scope("vidax_eqx.models.WanTransformer3D"):
            return self._forward(x, timestep, context, context_image=context_image,
                                 remat=remat, sliding_tile=sliding_tile,
                                 video_sparse=video_sparse, text_cache=text_cache)

    @jaxtyped(typechecker=beartype)
    def cached_call(
        self,
        x: Float[Array, "{self.config.in_channels} F H W"],
        timestep: Real[Array, ""] | Real[Array, " S"],
        context: Float[Array, "L {self.config.text_dim}"],
        step_cache: StepCache,
        *,
        may_reuse: Bool[ArrayLike, ""] = False,
        threshold: Real[ArrayLike, ""] | None = None,
        axis_name=None,
        context_image: Float[Array, "L_img {self.config.image_dim}"] | None = None,
        remat: str | None = None,
        sliding_tile: tuple | None = None,
        video_sparse: tuple | None = None,
        text_cache: WanTextCache | None = None,
    ) -> tuple[Float[Array, "{self.config.out_channels} F H W"], StepCache]:
        """`__call__` with step caching: a denoising step that may reuse the residual of
        the block stack from the last step that ran it, instead of running the blocks
        (MagCache's static schedules; TeaCache's and first-block cache's data-dependent
        rule). Approximate by design when it reuses; exactly `__call__` when it runs
        the blocks.

        **Arguments:**

        - `x`, `timestep`, `context` and the keywords of `__call__`: as there.
        - `step_cache`: the [`StepCache`][] the previous step returned, or the empty
            `StepCache()` (the first step: every block runs).
        - `may_reuse`: whether this step may reuse the residual (a bool scalar, the
            same on every device: e.g. a static schedule's entry for this step). False
            forces the blocks to run.
        - `threshold`: `None`: a static schedule, the whole stack is skipped when
            `may_reuse`. A number: the first-block rule: the first block always runs,
            and the others are skipped when `may_reuse` and the relative L1 change of
            the first block's residual (`sum |r - r_last| / sum |r_last|` over the real
            tokens, `r_last` that of the last step that ran every block) is below it.
        - `axis_name`: the axes the change is summed over besides this example's
            tokens, so that one decision holds everywhere: the vmapped batch's axis
            name and every mesh axis inside `shard_map` ([`run_sharded`][] passes
            them). Under `jax.vmap` the decision must be summed over the vmapped axis
            (else it is one per example and `lax.cond` runs both branches).

        **Returns:**

        `(out, step_cache)`: the prediction, as `__call__` returns it, and the cache
        for the next step (its `reused` says whether this step reused).
        """
        with jax.named_scope("vidax_eqx.models.WanTransformer3D.cached_call"):
            return self._forward(x, timestep, context, context_image=context_image,
                                 remat=remat, sliding_tile=sliding_tile,
                                 video_sparse=video_sparse, text_cache=text_cache,
                                 step=(step_cache, may_reuse, threshold, axis_name))

    def _forward(self, x, timestep, context, *, context_image, remat, sliding_tile,
                 video_sparse, text_cache, step=None):
        """The forward pass; with `step = (cache, may_reuse, threshold, axis_name)`,
        through the step cache, returning `(out, cache)`."""
        c = self.config
        policy = check_remat(remat)
        if (self.img_emb is None) != (context_image is None):
            raise ValueError(
                "WanTransformer3D: `context_image` is required by an I2V model (image_dim "
                f"set) and refused otherwise; the model has image_dim={c.image_dim}, "
                f"received context_image={None if context_image is None else context_image.shape}."
            )
        parallel = self.parallel
        # The text must come in whole and the same on every device: checked here,
        # once (the blocks see it embedded, by weights FSDP may have gathered).
        check_text("WanTransformer3D", parallel, context)
        if context_image is not None:
            check_text("WanTransformer3D", parallel, context_image)
        # FSDP: everything but the blocks gathered now; the scan gathers one block
        # at a time.
        self, (x, timestep, context, context_image) = nn.sharding.fsdp_gather(
            self, (x, timestep, context, context_image), exclude=lambda m: m.blocks)
        dtype = self.patch_embedding.weight.dtype
        grid = functional.patch_grid(x.shape, c.patch_size, "WanTransformer3D")
        patches = functional.patchify(x.astype(dtype), c.patch_size)

        per_token = timestep.ndim == 1
        if per_token and timestep.shape[0] != int(np.prod(grid)):
            raise ValueError(
                "WanTransformer3D: a per-token `timestep` has one value per patch token: "
                f"{int(np.prod(grid))} for the latent grid {tuple(x.shape[1:])} (patch grid "
                f"{tuple(grid)}, patch_size {c.patch_size}); received {timestep.shape[0]}."
            )
        if not per_token:
            t, e0 = self._time(timestep)
        if text_cache is None:
            context, context_image = self._embed_context(context, context_image, dtype)
        else:
            self._check_text_cache(text_cache, context, context_image, dtype)

        rope = functional.rope_3d(grid, c.head_dim, c.rope_theta)
        sparse = video_sparse_option("WanTransformer3D", video_sparse, grid, sliding_tile)
        mask = sliding_tile_mask("WanTransformer3D", sliding_tile, grid)
        tile = mask.tile if mask is not None else sparse.tile if sparse is not None else None
        # A timestep per token is laid out, padded and split like the tokens; its
        # embedding is computed for this device's tokens only.
        per_token_arrays = (rope, timestep) if per_token else rope
        if tile is not None:  # tile layout: tiles in raster order, zero padding rows
            patches, per_token_arrays = jax.tree.map(
                lambda a: kernels.tile_permute(a, grid, tile, axis=0),
                (patches, per_token_arrays),
            )
        # Each device embeds only its share of the patches (padding: zero patches,
        # invisible through segment id -1).
        patches, per_token_arrays, segment_ids, n = padded_tokens(
            patches, per_token_arrays, parallel,
            tile_size=1 if tile is None else math.prod(tile), video_sparse=sparse,
        )
        if per_token:
            rope, timestep = per_token_arrays
            t, e0 = self._time(timestep)
        else:
            rope = per_token_arrays
        tokens = self.patch_embedding.project(patches).astype(jnp.float32)

        if text_cache is None:
            def block(x, b):
                return b(x, e0, context, rope, segment_ids, context_image, mask,
                         video_sparse=sparse)

            layers = self.blocks
        else:  # one layer's keys and values per step, with its block
            def block(x, layer):
                b, kv = layer
                return b(x, e0, None, rope, segment_ids, None, mask,
                         context_kv=(kv.k, kv.v, kv.k_img, kv.v_img), video_sparse=sparse)

            layers = (self.blocks, text_cache)

        def run(x, start, stop):  # blocks [start, stop)
            if (start, stop) != (0, c.num_layers):
                arrays, static = eqx.partition(layers, eqx.is_array)
                sliced = jax.tree.map(lambda a: a[start:stop], arrays)
                return scan_layers(block, x, eqx.combine(sliced, static), policy)
            return scan_layers(block, x, layers, policy)

        if step is None:
            tokens = run(tokens, 0, c.num_layers)
        else:
            cache, may_reuse, threshold, axis_name = step
            check_step_cache("WanTransformer3D.cached_call", cache, tokens, may_reuse,
                             threshold)
            valid = None if segment_ids is None else segment_ids >= 0
            tokens, cache = cached_blocks(run, tokens, c.num_layers, cache,
                                          may_reuse=may_reuse, threshold=threshold,
                                          valid=valid, axis_name=axis_name)
        out = self.head(tokens, t)
        out = nn.sharding.gather_tokens(out, parallel)[:n]
        if tile is not None:
            out = kernels.tile_unpermute(out, grid, tile, axis=0)
        out = functional.unpatchify(out, grid, c.patch_size).astype(dtype)
        return out if step is None else (out, cache)

    def _embed_context(self, context, context_image, dtype):
        """The text padded to `text_len` (when the config pads) and embedded, and the
        image context embedded (I2V)."""
        c = self.config
        if self._text_length(context) != context.shape[0]:
            context = jnp.pad(context, ((0, c.text_len - context.shape[0]), (0, 0)))
        context = self.text_embedding(context.astype(dtype))
        if context_image is not None:
            context_image = self.img_emb(context_image.astype(dtype))
        return context, context_image

    def _text_length(self, context) -> int:
        """The text length the blocks see: the config's `text_len` when it pads."""
        c = self.config
        if c.text_len is None:
            return context.shape[0]
        if context.shape[0] > c.text_len:
            raise ValueError(
                f"WanTransformer3D: the config pads the text to text_len={c.text_len} "
                f"tokens (Wan's forward); received {context.shape[0]} tokens."
            )
        return c.text_len

    def _check_text_cache(self, cache, context, context_image, dtype) -> None:
        """Raises unless `cache` is a `WanTextCache` of this model's shapes for this
        context, with this device's heads."""
        c = self.config
        if not isinstance(cache, WanTextCache):
            raise ValueError(
                "WanTransformer3D: `text_cache` must be a WanTextCache (from "
                f"model.text_cache(context)) or None; received {type(cache).__name__}."
            )
        tp_axis = self.parallel.tp_axis
        tp = 1 if tp_axis is None else axis_size(tp_axis, what="Tensor-parallel")
        heads = c.num_heads // tp if c.num_heads % tp == 0 else c.num_heads
        L = self._text_length(context)
        expected = {"k": (c.num_layers, L, heads, c.head_dim)}
        expected["v"] = expected["k"]
        if context_image is not None:
            expected["k_img"] = (c.num_layers, context_image.shape[0], heads, c.head_dim)
            expected["v_img"] = expected["k_img"]
        received = {name: getattr(cache, name) for name in ("k", "v", "k_img", "v_img")}
        bad = [name for name, a in received.items()
               if (a is None) != (name not in expected)
               or (a is not None and (not eqx.is_array(a) or a.shape != expected[name]
                                      or a.dtype != dtype))]
        if bad:
            shapes = {n: None if a is None else (tuple(getattr(a, "shape", ())),
                                                 str(getattr(a, "dtype", type(a).__name__)))
                      for n, a in received.items()}
            raise ValueError(
                "WanTransformer3D: `text_cache` must hold the keys and values of this model "
                "for this context, (num_layers, L, heads, head_dim) in the weights' dtype "
                f"{jnp.dtype(dtype).name}: {expected}"
                + ("" if context_image is not None else " (no image keys/values: T2V)")
                + (f", heads this device's share under tp_axis={tp_axis!r}" if tp_axis else "")
                + f"; received {shapes} (field {bad[0]!r}). Compute it with "
                "model.text_cache(context, context_image=...) for this model and context "
                "(sharded: models.sharded_text_cache)."
            )

    @jaxtyped(typechecker=beartype)
    def text_cache(
        self,
        context: Float[Array, "L {self.config.text_dim}"],
        *,
        context_image: Float[Array, "L_img {self.config.image_dim}"] | None = None,
    ) -> WanTextCache:
        """The keys and values of every block's cross-attention for `context` (and
        `context_image`), computed exactly as `__call__` computes them: pass them as
        `__call__(..., text_cache=...)` with the same context at every denoising step.

        **Arguments:**

        - `context`, `context_image`: as for `__call__` (one example; `jax.vmap` for a
            batch).

        **Returns:**

        A [`WanTextCache`][]. Inside `shard_map` under tensor parallelism it holds this
        device's heads, and must be computed there, as the model runs (`norm_k`'s
        statistics are summed over `tp_axis`): [`sharded_text_cache`][] does it from
        global inputs.
        """
        with jax.named_scope("vidax_eqx.models.WanTransformer3D.text_cache"):
            if (self.img_emb is None) != (context_image is None):
                raise ValueError(
                    "WanTransformer3D.text_cache: `context_image` is required by an I2V model "
                    f"(image_dim set) and refused otherwise; the model has image_dim="
                    f"{self.config.image_dim}, received context_image="
                    f"{None if context_image is None else context_image.shape}."
                )
            check_text("WanTransformer3D", self.parallel, context)
            if context_image is not None:
                check_text("WanTransformer3D", self.parallel, context_image)
            self, (context, context_image) = nn.sharding.fsdp_gather(
                self, (context, context_image), exclude=lambda m: m.blocks)
            dtype = self.patch_embedding.weight.dtype
            context, context_image = self._embed_context(context, context_image, dtype)
            arrays, static = eqx.partition(self.blocks, eqx.is_array)

            def layer(carry, block_arrays):
                attn = eqx.combine(block_arrays, static).cross_attn
                return carry, attn.project_context(context, context_image=context_image,
                                                   context_copies=True)

            k, v, k_img, v_img = lax.scan(layer, None, arrays)[1]
            return WanTextCache(k, v, k_img, v_img)

    def _time(self, timestep):
        """`(t, e0)`: the float32 time embedding `(..., dim)` and its projection
        `(..., 6, dim)` of a scalar timestep or of one per token `(S,)`."""
        t = self.time_embedding(timestep)
        # A scalar's projection is the Linear's own `W @ x` (what it always was: the same
        # program and bits); per token, `x @ W.T` on the (S, dim) rows.
        project = self.time_projection if timestep.ndim == 0 else (
            lambda h: linear(self.time_projection, h))
        e0 = project(jax.nn.silu(t))
        return t.astype(jnp.float32), e0.reshape(*t.shape[:-1], 6, self.config.dim).astype(jnp.float32)

    # -- checkpoints --------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path,
        *,
        dtype=None,
        parallel: nn.sharding.ParallelConfig = nn.sharding.ParallelConfig(),
        implementation="auto",
        pad_text: bool = False,
        gate_compress: bool = False,
        mesh=None,
        subfolder: str | None = None,
        revision: str | None = None,
        cache_dir=None,
    ) -> "WanTransformer3D":
        """Loads a Wan 2.1 checkpoint: a diffusers directory or the original Wan layout.

        The directory holds `config.json` and `diffusion_pytorch_model.safetensors`
        (or the shards of `diffusion_pytorch_model.safetensors.index.json`). The
        layout is told by the config: diffusers' (`num_attention_heads`, ...;
        tensors `condition_embedder.*`, `blocks.0.attn1.to_q.weight`, ...) or Wan's
        (`dim`, `num_heads`, ...; tensors `time_embedding.0.weight`,
        `blocks.0.self_attn.q.weight`, `head.head.weight`, ...), whose missing keys
        are read off the tensors' shapes. The model is built abstractly (no random
        weights), every tensor's shape is checked before any is read, missing and
        unexpected names are listed together, nothing is partially loaded, and
        tensors are read one at a time: peak host memory stays near the model's size.
        No pickle.

        With `mesh`, the model loads straight into its sharded layout: every
        parameter placed by [`vidax_eqx.nn.sharding.partition_specs`][]`(model, mesh)` under
        `parallel` (FSDP over its `fsdp_axes`, Megatron over its `tp_axis`), as
        [`vidax_eqx.nn.sharding.shard_module`][] would place it, and each process reads only
        the blocks of each tensor that its own devices hold (each once): peak host
        memory per process is about its share of the model plus one tensor. Every
        process of a multi-process `jax.distributed` job makes the same call.

        **Arguments:**

        - `path`: the checkpoint directory, or a Hugging Face Hub repository id
            (`"owner/name"`, read from the local Hub cache or downloaded; needs
            `huggingface_hub`), see [`vidax_eqx.interop.resolve_checkpoint`][].
        - `dtype`: the parameters' dtype; default: the checkpoint's (a bfloat16
            checkpoint stays bfloat16).
        - `parallel`, `implementation`: as for the constructor.
        - `pad_text`: zero-pad the text context to the config's `text_len` (Wan's
            own forward, 512 tokens) instead of using it as given (diffusers').
        - `gate_compress`: the checkpoint is a video sparse attention (VSA) Wan, as
            FastVideo distills them: every block has a `to_gate_compress` projection
            (`blocks.N.to_gate_compress.weight` / `.bias`; `blocks.N.attn1.
            to_gate_compress.*` is read too), loaded into its self-attention (run the
            model with `video_sparse=`). A checkpoint with those tensors loaded without
            it, or one without them loaded with it, raises `ValueError`.
        - `mesh`: a `jax.sharding.Mesh` with the axes `parallel` names: load sharded
            (above). Default: unsharded.
        - `subfolder`: the folder of `path` holding the checkpoint, e.g.
            `"transformer"` for a diffusers pipeline (`Wan-AI/Wan2.1-T2V-1.3B-Diffusers`).
        - `revision`, `cache_dir`: the Hub revision and cache directory (Hub ids only).

        **Returns:**

        The loaded model: its arrays uncommitted on the default device, or with
        `mesh` placed on it (`NamedSharding(mesh, spec)`).
        """
        raw, tensors = read_config(path, "WanTransformer3D", subfolder=subfolder,
                                   revision=revision, cache_dir=cache_dir)
        if "num_attention_heads" in raw or raw.get("_class_name") == "WanTransformer3DModel":
            config = WanConfig.from_diffusers(raw)
        elif "dim" in raw or raw.get("_class_name") == "WanModel":
            config = WanConfig.from_wan(raw, tensors)
        else:
            raise ValueError(
                f"WanTransformer3D.from_pretrained: {os.fspath(path)!r}/config.json is neither a "
                "diffusers WanTransformer3DModel config (num_attention_heads, ...) nor a Wan "
                f"2.1 config (dim, num_heads, ...); its keys are {sorted(raw)[:12]}."
            )
        if pad_text:
            config = dataclasses.replace(config, text_len=raw.get("text_len", 512))
        rename = _check_gate_compress(tensors, gate_compress, path)
        config = dataclasses.replace(config, gate_compress=bool(gate_compress))
        return load_pretrained(cls, config, tensors, dtype=dtype,
                               dtype_from="patch_embedding.weight", parallel=parallel,
                               implementation=implementation, mesh=mesh, stacked=_STACKED,
                               rename=rename)

    def state_dict(self, *, layout: str = "diffusers") -> dict[str, np.ndarray]:
        """The parameters under the checkpoint names of `layout` (`"diffusers"` or
        `"wan"`), one tensor per layer (views, no copies on CPU)."""
        naming = _layout(layout)
        return interop.state_dict(self, naming=naming, stacked=_STACKED, rename=_rename)

    def linear_layers(self) -> list[interop.LinearName]:
        """Every linear layer with its checkpoint names (Wan's and diffusers', one per
        layer of the stacked blocks): what [`vidax_eqx.models.add_lora`][] patterns and
        LoRA files name."""
        return interop.linear_layers(self, stacked=_STACKED, rename=_rename)

    def with_gate_compress(self) -> "WanTransformer3D":
        """A copy whose blocks have a zero `to_gate_compress` (the gate of video sparse
        attention's coarse output, as FastVideo's VSA Wan has), e.g. to distill a VSA
        model from a dense checkpoint: with zero gates, `video_sparse=` runs the fine
        attention alone, and at full density (`topk` = every tile) the dense model.
        A model that has the gates is returned as it is.

        **Returns:**

        The model with `config.gate_compress=True`; the new arrays are uncommitted on
        the default device (place the model again, e.g. with
        [`vidax_eqx.nn.sharding.shard_module`][], if it was placed).
        """
        if self.blocks.self_attn.to_gate_compress is not None:
            return self
        q = self.blocks.self_attn.q  # stacked: (L, dim, dim), (L, dim)
        dim, dtype = self.config.dim, q.weight.dtype
        template = eqx.filter_eval_shape(eqx.nn.Linear, dim, dim, dtype=dtype,
                                         key=jax.random.key(0))  # no adapters, no arrays
        gate = eqx.tree_at(lambda lin: (lin.weight, lin.bias), template,
                           (jnp.zeros(q.weight.shape, dtype), jnp.zeros(q.bias.shape, dtype)))
        new = eqx.tree_at(lambda m: m.blocks.self_attn.to_gate_compress, self, gate,
                          is_leaf=lambda x: x is None)
        # The configuration is static: set on the new copy (tree_at built it).
        object.__setattr__(new, "config", dataclasses.replace(self.config, gate_compress=True))
        return new

    def save_pretrained(self, path, *, layout: str = "diffusers",
                        max_shard_bytes: int | None = None) -> None:
        """Writes `config.json` and the weights as safetensors in `layout`.

        **Arguments:**

        - `path`: the directory (created if needed).
        - `layout`: `"diffusers"` (loadable by diffusers'
            `WanTransformer3DModel.from_pretrained`) or `"wan"` (Wan 2.1's names and
            config keys).
        - `max_shard_bytes`: split the weights into shards of at most this size with an
            index, as large releases are; default one file.

        `from_pretrained(path)` gives back the same arrays bit for bit.
        """
        config = self.config.to_diffusers() if _layout(layout) == "diffusers" else self.config.to_wan()
        os.makedirs(path, exist_ok=True)
        interop.write_checkpoint(path, self.state_dict(layout=layout),
                                 max_shard_bytes=max_shard_bytes)
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)


def sharded_text_cache(model: WanTransformer3D, context, *, mesh, batch_axis=None,
                       context_image=None) -> WanTextCache:
    """[`WanTransformer3D.text_cache`][] of a batch over `mesh`, computed on each device
    as [`run_sharded`][] runs the model (tensor-parallel heads, FSDP-gathered weights),
    global inputs in, a global cache out: pass it to `run_sharded(..., text_cache=...)`
    for bit for bit the output of a call without it.

    **Arguments:**

    - `model`: a [`WanTransformer3D`][] configured for the mesh, as for `run_sharded`;
        or a [`WanExperts`][]: each expert's cache, a [`WanExpertsTextCache`][].
    - `context`: the text embeddings `(B, L, text_dim)`.
    - `mesh`, `batch_axis`: as for `run_sharded`.
    - `context_image`: I2V: the image features `(B, L_img, image_dim)`; else `None`.

    **Returns:**

    The batched [`WanTextCache`][] `(B, num_layers, L, num_heads, head_dim)`, placed by
    [`WanTextCache.partition_specs`][]: the batch over `batch_axis`, the heads over the
    model's `tp_axis`. Devices that hold the same heads of the same examples computed
    equal copies (the same text and weights); under FSDP, where these are typed as
    varying over the FSDP axes, one `lax.pmax` over those axes (exact on equal values)
    makes them one array.
    """
    if isinstance(model, AbstractExperts):  # one cache per expert
        caches = [sharded_text_cache(e, context, mesh=mesh, batch_axis=batch_axis,
                                     context_image=context_image) for e in model.experts]
        return model.text_cache_type(*caches)
    if not isinstance(model, WanTransformer3D):
        raise NotImplementedError(
            "sharded_text_cache: the text cache is implemented for a WanTransformer3D and "
            f"WanExperts; received a {type(model).__name__}."
        )
    batch_axis = check_batch_axis("sharded_text_cache", mesh, batch_axis, context.shape[0])
    check_fsdp_axes("sharded_text_cache", model, mesh, batch_axis)
    parallel = model.parallel
    batch = P(batch_axis)
    keep = {parallel.tp_axis, *batch_axes(batch_axis)}
    image = None if context_image is None else batch
    shape = WanTextCache(0, 0, None if context_image is None else 0, None)

    def per_device(model, context, context_image):
        cache = jax.vmap(lambda c, i: model.text_cache(c, context_image=i))(
            context, context_image)

        def invariant(a):  # FSDP: equal copies typed as varying over the FSDP axes
            extra = tuple(sorted(varying_axes(a) - keep, key=str))
            return lax.pmax(a, extra) if extra else a

        return jax.tree.map(invariant, cache)

    run = nn.sharding.filter_shard_map(
        per_device, mesh=mesh,
        in_specs=(nn.sharding.partition_specs(model, mesh), batch, image),
        out_specs=shape.partition_specs(parallel, batch_axis),
    )
    return run(model, context, context_image)


_GATE_COMPRESS = re.compile(r"^blocks\.\d+\.(attn1\.|self_attn\.)?to_gate_compress\.")


def _check_gate_compress(tensors, gate_compress, path):
    """The `rename` of a checkpoint: whether its `to_gate_compress` tensors (FastVideo's
    VSA Wan) and `gate_compress` agree (else `ValueError`), and where they are named."""
    if not isinstance(gate_compress, bool):
        raise ValueError(
            "WanTransformer3D.from_pretrained: `gate_compress` must be a bool; received "
            f"{gate_compress!r}."
        )
    gates = sorted((k for k in tensors if _GATE_COMPRESS.match(k)),
                   key=lambda k: [int(t) if t.isdigit() else t for t in k.split(".")])
    where = f"{os.fspath(path)!r}" if isinstance(path, (str, os.PathLike)) else repr(path)
    if gates and not gate_compress:
        raise ValueError(
            f"WanTransformer3D.from_pretrained: the checkpoint {where} is a video sparse "
            f"attention (VSA) Wan: it has {len(gates)} `to_gate_compress` tensors "
            f"({', '.join(repr(g) for g in gates[:2])}, ...), the gate of VSA's coarse "
            "output. Load it with from_pretrained(..., gate_compress=True) and run it with "
            "video_sparse=(tile, topk or sparsity), e.g. ((4, 4, 4), 0.9)."
        )
    if gate_compress and not gates:
        raise ValueError(
            f"WanTransformer3D.from_pretrained: gate_compress=True expects a video sparse "
            f"attention Wan checkpoint with `blocks.N.to_gate_compress.weight` / `.bias` "
            f"tensors; {where} has none. Load it without gate_compress (a dense Wan), "
            "and run it with video_sparse=... ungated, or add zero gates with "
            "WanTransformer3D.with_gate_compress() to distill one."
        )
    if any(".attn1.to_gate_compress." in g for g in gates):
        rules = tuple((p, w, r"\1attn1.to_gate_compress.") if "to_gate_compress" in p
                      else (p, w, d) for p, w, d in _NAMES)
        return lambda name, naming: _rename(name, naming, rules)
    return _rename


def _layout(layout: str) -> str:
    if layout not in ("diffusers", "wan"):
        raise ValueError(f"`layout` must be 'diffusers' or 'wan'; received {layout!r}.")
    return layout
