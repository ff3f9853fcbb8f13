"""CogVideoX's video DiT (diffusers' `CogVideoXTransformer3DModel`, CogVideoX 1.0: 2B
and 5B, T2V and I2V), composed from `vidax_eqx.nn`."""

import dataclasses
import json
import os
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jaxtyping import Array, Float, jaxtyped, PRNGKeyArray, Real

from .. import interop, kernels, nn
from .._vma import as_varying, varying_axes
from ..nn.internal import init
from ..nn.internal import linear
from ..nn.internal import check_text, padded_tokens
from ..nn import functional
from ._common import (
    check_remat,
    load_pretrained,
    read_config,
    scan_layers,
    sliding_tile_mask,
)


_ACTIVATIONS = {"gelu-approximate": "gelu_tanh", "gelu": "gelu"}


@dataclasses.dataclass(frozen=True)
class CogVideoXConfig:
    """The shape of a CogVideoX 1.0 transformer (immutable, hashable: a static field).

    The field names and defaults are those of diffusers' `CogVideoXTransformer3DModel`
    `config.json` (CogVideoX-2B); build one from a checkpoint's with
    [`CogVideoXConfig.from_diffusers`][]. CogVideoX-5B: `num_attention_heads=48,
    num_layers=42, use_rotary_positional_embeddings=True`; 5B-I2V adds
    `in_channels=32, use_learned_positional_embeddings=True`.

    **Fields:**

    - `num_attention_heads`, `attention_head_dim`: heads and head size (width
        `dim = num_attention_heads * attention_head_dim`).
    - `in_channels`, `out_channels`: latent channels in and out.
    - `flip_sin_to_cos`, `freq_shift`: the timestep sinusoid's options.
    - `time_embed_dim`: the timestep embedding's width (the blocks' conditioning).
    - `text_embed_dim`: the text encoder's width (T5-XXL: 4096).
    - `num_layers`: the number of blocks.
    - `sample_width`, `sample_height`, `sample_frames`: the training resolution
        (latent width and height; frames before temporal compression). They fix the
        positional embedding's base grid and the RoPE crop region.
    - `patch_size`: the spatial patch size (a per-frame `Conv2d`).
    - `temporal_compression_ratio`: the VAE's (4): latent frames = `(sample_frames -
        1) // ratio + 1`.
    - `max_text_seq_length`: the text length of the positional embedding (226).
    - `activation_fn`: the FFN's, `"gelu-approximate"` or `"gelu"`.
    - `norm_elementwise_affine`, `norm_eps`: the blocks' and final LayerNorms'.
    - `spatial_interpolation_scale`, `temporal_interpolation_scale`: the 2B's sin-cos
        embedding's coordinate divisors.
    - `use_rotary_positional_embeddings`: 3D RoPE on the video tokens (5B) instead of
        the sin-cos embedding (2B).
    - `use_learned_positional_embeddings`: a learned embedding over `[text; video]`
        at the training resolution (5B-I2V).
    """

    num_attention_heads: int = 30
    attention_head_dim: int = 64
    in_channels: int = 16
    out_channels: int = 16
    flip_sin_to_cos: bool = True
    freq_shift: float = 0.0
    time_embed_dim: int = 512
    text_embed_dim: int = 4096
    num_layers: int = 30
    sample_width: int = 90
    sample_height: int = 60
    sample_frames: int = 49
    patch_size: int = 2
    temporal_compression_ratio: int = 4
    max_text_seq_length: int = 226
    activation_fn: str = "gelu-approximate"
    norm_elementwise_affine: bool = True
    norm_eps: float = 1e-5
    spatial_interpolation_scale: float = 1.875
    temporal_interpolation_scale: float = 1.0
    use_rotary_positional_embeddings: bool = False
    use_learned_positional_embeddings: bool = False

    def __post_init__(self):
        for name in ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels",
                     "time_embed_dim", "text_embed_dim", "num_layers", "sample_width",
                     "sample_height", "sample_frames", "patch_size", "temporal_compression_ratio",
                     "max_text_seq_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"CogVideoXConfig: `{name}` must be a positive int; received {value!r}."
                )
        if self.activation_fn not in _ACTIVATIONS:
            raise NotImplementedError(
                f"CogVideoXConfig: activation_fn={self.activation_fn!r} is not implemented "
                f"(one of {sorted(_ACTIVATIONS)})."
            )
        if self.use_learned_positional_embeddings and not self.use_rotary_positional_embeddings:
            raise ValueError(
                "CogVideoXConfig: use_learned_positional_embeddings needs "
                "use_rotary_positional_embeddings (as in diffusers: no CogVideoX has the "
                "learned embedding without RoPE)."
            )
        if self.use_rotary_positional_embeddings and self.attention_head_dim % 16:
            raise ValueError(
                "CogVideoXConfig: 3D RoPE splits the head into dim // 4 (time) and "
                "3 * dim // 8 (height, width) features of even size, so attention_head_dim "
                f"must be a multiple of 16; received {self.attention_head_dim}."
            )
        if not self.use_rotary_positional_embeddings and self.dim % 16:
            raise ValueError(
                "CogVideoXConfig: the 3D sin-cos embedding needs a width (num_attention_heads "
                f"* attention_head_dim) that is a multiple of 16; received {self.dim}."
            )

    @property
    def dim(self) -> int:
        """The model width, `num_attention_heads * attention_head_dim`."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def sample_grid(self) -> tuple[int, int, int]:
        """The token grid `(frames, height, width)` of the training resolution."""
        frames = (self.sample_frames - 1) // self.temporal_compression_ratio + 1
        p = self.patch_size
        return frames, self.sample_height // p, self.sample_width // p

    @classmethod
    def from_diffusers(cls, config: dict, **overrides) -> "CogVideoXConfig":
        """From a diffusers `CogVideoXTransformer3DModel` `config.json` (as a dict).

        Raises `NotImplementedError` for what the model does not implement: CogVideoX
        1.5 (`patch_size_t`, `ofs_embed_dim`), projections without bias
        (`attention_bias`, `patch_bias` false), a timestep activation other than SiLU.
        """
        unsupported = {
            "patch_size_t": (config.get("patch_size_t"), None),
            "ofs_embed_dim": (config.get("ofs_embed_dim"), None),
            "attention_bias": (config.get("attention_bias", True), True),
            "patch_bias": (config.get("patch_bias", True), True),
            "timestep_activation_fn": (config.get("timestep_activation_fn", "silu"), "silu"),
        }
        for name, (value, expected) in unsupported.items():
            if value != expected and not (value in (0, None) and expected is None):
                raise NotImplementedError(
                    f"CogVideoXConfig: {name}={value!r} is not implemented (CogVideoX 1.0 has "
                    f"{expected!r}); CogVideoX 1.5's temporal patches and ofs embedding are not "
                    "supported."
                )
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in config.items() if k in names}
        if fields.get("out_channels") is None:
            fields["out_channels"] = config.get("in_channels", 16)
        return cls(**{**fields, **overrides})

    def to_diffusers(self) -> dict:
        """The diffusers `config.json` of this model."""
        return {
            "_class_name": "CogVideoXTransformer3DModel",
            **dataclasses.asdict(self),
            "ofs_embed_dim": None,
            "dropout": 0.0,
            "attention_bias": True,
            "patch_size_t": None,
            "timestep_activation_fn": "silu",
            "patch_bias": True,
        }


def rope_crop_positions(grid: tuple[int, int, int], config: CogVideoXConfig):
    """The coordinates of CogVideoX-5B's 3D RoPE, as the diffusers CogVideoX pipeline
    computes them (`_prepare_rotary_positional_embeddings`).

    The `(height, width)` token grid is fitted inside the base grid of the training
    resolution (`sample_height // p`, `sample_width // p`) keeping its aspect ratio
    (`get_resize_crop_region_for_grid`, rounding as the pipeline does: Python's
    `round`) and centred; row `i` then sits at `linspace(top, bottom * (h - 1) / h,
    h)[i]`, and likewise for columns; frames at `0, 1, ...`.

    **Returns:** three float64 arrays `(frames,)`, `(height,)`, `(width,)` for
    [`vidax_eqx.nn.functional.rope_3d`][]`(positions=...)`.
    """
    f, h, w = grid
    th, tw = config.sample_height // config.patch_size, config.sample_width // config.patch_size
    if h / w > th / tw:
        rh, rw = th, int(round(th / h * w))
    else:
        rw, rh = tw, int(round(tw / w * h))
    top, left = int(round((th - rh) / 2.0)), int(round((tw - rw) / 2.0))
    rows = np.linspace(top, (top + rh) * (h - 1) / h, h)
    cols = np.linspace(left, (left + rw) * (w - 1) / w, w)
    return np.arange(f, dtype=np.float64), rows, cols


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

    def __init__(self, config: CogVideoXConfig, *, parallel: nn.sharding.ParallelConfig, implementation,
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

    def __call__(self, x, context, temb, rope, segment_ids, mask=None):
        """**Arguments:**

        - `x`: the video tokens `(S, dim)`: the whole sequence on one device, this
            device's chunk under sequence parallelism.
        - `context`: the text tokens `(T, dim)`: this device's copy of the text stream,
            the same on every device.
        - `temb`: the timestep embedding `(time_embed_dim,)`.
        - `rope`: `(cos, sin)`, each `(S, head_dim // 2)`, for the video tokens of `x`;
            `None`: no RoPE (2B).
        - `segment_ids`: int `(T + S,)` or `None`, the segment ids of `[context; x]`,
            as for [`vidax_eqx.nn.JointAttention`][].
        - `mask`: the attention's `SlidingTileMask` over `[context; x]` (video tokens in
            its tile layout), or `None` for full attention.

        **Returns:**

        `(x, context)` after the block, `(S, dim)` and `(T, dim)`.
        """
        with jax.named_scope("vidax_eqx.models.CogVideoXBlock"):
            self, (x, context, temb, rope) = nn.sharding.fsdp_gather(self, (x, context, temb, rope))
            T = context.shape[0]
            x_n, c_n, gate, c_gate = self.norm1(x, context, temb)
            a_x, a_c = self.attn1(x_n, c_n, rope=rope, segment_ids=segment_ids,
                                  context_copies=True, mask=mask)
            x, context = x + gate * a_x, context + c_gate * a_c
            x_n, c_n, gate, c_gate = self.norm2(x, context, temb)
            f = self.ff(jnp.concatenate([c_n, x_n]))
            return x + gate * f[T:], context + c_gate * f[:T]


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


_STACKED = ("transformer_blocks",)


class CogVideoXTransformer3D(eqx.Module):
    """The CogVideoX 1.0 video DiT, one example per call (`jax.vmap` for a batch).

        temb = time_embedding(sinusoid(timestep))              # (time_embed_dim,)
        context = patch_embed.text_proj(context)               # (T, dim)
        x = patch_embed.proj(x) (+ sin-cos / learned positions) # (S, dim), S = F * H/p * W/p
        x, context = transformer_blocks(x, context, temb, rope) # lax.scan, joint attention
        x = norm_out(norm_final(x), temb)
        out = unpatchify(proj_out(x))                          # (F, C_out, H, W)

    Built from [`vidax_eqx.nn`][]: [`vidax_eqx.nn.PatchEmbedding`][] (a per-frame
    `Conv2d`), [`vidax_eqx.nn.TimestepEmbedding`][], [`vidax_eqx.nn.JointAttention`][]
    with per-head LayerNorms and (5B) 3D RoPE on the video tokens,
    [`vidax_eqx.nn.FeedForward`][], [`vidax_eqx.nn.ModulatedLayerNorm`][]. The model
    computes its own positional information from the input's shape: the 5B's RoPE
    tables exactly as the diffusers CogVideoX pipeline prepares them
    ([`rope_crop_positions`][]), the 2B's sin-cos embedding as diffusers'
    `CogVideoXPatchEmbed` (recomputed for the input's grid), or the learned
    embedding of 5B-I2V. The blocks are one [`CogVideoXBlock`][] with a leading
    layer axis, run by `lax.scan`; checkpoints name them per layer
    (`transformer_blocks.0.`, ...).

    **Parallelism** (as [`WanTransformer3D`][], through [`run_sharded`][]): the video
    tokens are split over the sequence axes after the patch embedding (padded to a
    multiple of the devices, the padding invisible through segment ids); the text
    tokens stay whole on every device (the joint layout of
    [`vidax_eqx.nn.JointAttention`][]: Ulysses, ring or USP); TP splits the heads
    and the MLP. Each device carries the text stream (identical copies); its output
    is not returned.

    **Fields:** `patch_embed`, `time_embedding`, `transformer_blocks`, `norm_final`,
    `norm_out`, `proj_out` (diffusers' names), and the static `config`
    ([`CogVideoXConfig`][]).
    """

    patch_embed: CogVideoXPatchEmbed
    time_embedding: nn.TimestepEmbedding
    transformer_blocks: CogVideoXBlock
    norm_final: nn.LayerNorm
    norm_out: CogVideoXAdaLayerNorm
    proj_out: eqx.nn.Linear
    config: CogVideoXConfig = eqx.field(static=True)
    stacked_layers: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    def __init__(
        self,
        config: CogVideoXConfig,
        *,
        parallel: nn.sharding.ParallelConfig = nn.sharding.ParallelConfig(),
        implementation="auto",
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `config`: a [`CogVideoXConfig`][].
        - `parallel`: the [`vidax_eqx.nn.sharding.ParallelConfig`][] of every attention and FFN
            module; default one device.
        - `implementation`: the attention kernel (`vidax_eqx.kernels.attention`).
        - `dtype`: the parameters' and the computation's dtype.
        - `key`: a PRNG key for the initialization.
        """
        if not isinstance(config, CogVideoXConfig):
            raise ValueError(
                f"CogVideoXTransformer3D: `config` must be a CogVideoXConfig; received {config!r}."
            )
        c = config
        keys = init.split(key, 5)
        self.patch_embed = CogVideoXPatchEmbed(c, dtype=dtype, key=keys[0])
        self.time_embedding = nn.TimestepEmbedding(
            c.dim, c.time_embed_dim, flip_sin_to_cos=c.flip_sin_to_cos,
            downscale_freq_shift=c.freq_shift, dtype=dtype, key=keys[1],
        )

        def make_block(k):
            return CogVideoXBlock(c, parallel=parallel, implementation=implementation,
                                  dtype=dtype, key=k)

        self.transformer_blocks = init.stacked(make_block, init.split(keys[2], c.num_layers))
        self.norm_final = nn.LayerNorm(c.dim, c.norm_eps,
                                       elementwise_affine=c.norm_elementwise_affine, dtype=dtype)
        self.norm_out = CogVideoXAdaLayerNorm(c, dtype=dtype, key=keys[3])
        self.proj_out = init.linear(c.dim, c.patch_size**2 * c.out_channels, dtype=dtype,
                                    key=keys[4])
        self.config = c

    @property
    def parallel(self) -> nn.sharding.ParallelConfig:
        """The [`vidax_eqx.nn.sharding.ParallelConfig`][] the model runs with."""
        return self.transformer_blocks.attn1.parallel

    def _positions(self, frames: int, grid, T: int):
        """`(rope, video positional embedding, text positional embedding)`, each or None."""
        c = self.config
        rope = video = text = None
        if c.use_rotary_positional_embeddings:
            d = c.attention_head_dim
            rope = functional.rope_3d(grid, d, split=(d // 8, 3 * d // 16, 3 * d // 16),
                                      positions=rope_crop_positions(grid, c))
        learned = self.patch_embed.pos_embedding
        p = c.patch_size
        if learned is not None and (grid[1] * p, grid[2] * p) != (c.sample_height, c.sample_width):
            raise ValueError(
                "CogVideoXTransformer3D: a model with a learned positional embedding "
                "(5B-I2V) runs at its training resolution only, as in diffusers: latent "
                f"(height, width) = {(c.sample_height, c.sample_width)}; received "
                f"{(grid[1] * p, grid[2] * p)}."
            )
        # diffusers uses the learned table when the video has the training frame count
        # (frames before compression), and the sin-cos embedding of this grid otherwise.
        if learned is not None and (frames - 1) * c.temporal_compression_ratio + 1 == c.sample_frames:
            if T != c.max_text_seq_length:
                raise ValueError(
                    "CogVideoXTransformer3D: the learned positional embedding covers "
                    f"max_text_seq_length = {c.max_text_seq_length} text tokens; received "
                    f"{T}. Pad the text embeddings to that length, as the pipeline does."
                )
            text, video = learned[0, :T], learned[0, T:]
        elif learned is not None or not c.use_rotary_positional_embeddings:
            # The sin-cos embedding of this grid; the text's part is zero.
            video = functional.sincos_embedding_3d(
                grid, c.dim, spatial_interpolation_scale=c.spatial_interpolation_scale,
                temporal_interpolation_scale=c.temporal_interpolation_scale,
            )
        return rope, video, text

    @jaxtyped(typechecker=beartype)
    def __call__(
        self,
        x: Float[Array, "F {self.config.in_channels} H W"],
        timestep: Real[Array, ""],
        context: Float[Array, "T {self.config.text_embed_dim}"],
        *,
        remat: str | None = None,
        sliding_tile: tuple | None = None,
    ) -> Float[Array, "F {self.config.out_channels} H W"]:
        """**Arguments:**

        - `x`: the noisy latents `(F, C, H, W)` of one video (diffusers' layout without
            the batch axis), `H, W` multiples of the patch size. Whole on every device
            under sequence parallelism.
        - `timestep`: the diffusion timestep, a scalar (0 to 1000).
        - `context`: the text encoder's output `(T, text_embed_dim)` (226 T5 tokens in
            the pipeline), whole on every device.
        - `remat`: the rematerialization policy of each block in the backward pass, as
            for [`WanTransformer3D`][].
        - `sliding_tile`: `(tile, window)`: sliding tile attention over the video
            tokens, the text a prefix every token sees and that sees every token
            ([`vidax_eqx.kernels.SlidingTileMask`][]`(patch_grid, tile, window,
            text_len=T)`), as for [`WanTransformer3D`][]. `None`: full attention.

        **Returns:**

        The prediction `(F, out_channels, H, W)` (CogVideoX: v-prediction), in the
        weights' dtype.
        """
        with jax.named_scope("vidax_eqx.models.CogVideoXTransformer3D"):
            c = self.config
            policy = check_remat(remat)
            parallel = self.parallel
            # The text must come in whole and the same on every device: checked here,
            # once, before weights (FSDP-gathered ones, typed as varying) touch it.
            check_text("CogVideoXTransformer3D", parallel, context)
            # FSDP: everything but the blocks gathered now; the scan gathers one block
            # at a time.
            self, (x, timestep, context) = nn.sharding.fsdp_gather(
                self, (x, timestep, context), exclude=lambda m: m.transformer_blocks)
            dtype = self.proj_out.weight.dtype
            p = (1, c.patch_size, c.patch_size)
            video = jnp.transpose(x, (1, 0, 2, 3)).astype(dtype)  # (C, F, H, W)
            grid = functional.patch_grid(video.shape, p, "CogVideoXTransformer3D")
            patches = functional.patchify(video, p)
            T = context.shape[0]
            rope, pos_video, pos_text = self._positions(x.shape[0], grid, T)

            temb = self.time_embedding(timestep)
            context = linear(self.patch_embed.text_proj, context.astype(dtype))
            if pos_text is not None:
                context = context + pos_text.astype(dtype)
            mask = sliding_tile_mask("CogVideoXTransformer3D", sliding_tile, grid, T)
            if mask is not None:  # tile layout: tiles in raster order, zero padding rows
                patches, rope, pos_video = jax.tree.map(
                    lambda a: kernels.tile_permute(a, grid, mask.tile, axis=0),
                    (patches, rope, pos_video),
                )
            # Each device embeds only its share of the patches (padding: zero patches,
            # invisible through segment id -1), with its rows of the positions.
            patches, (rope, pos_video), segment_ids, n = padded_tokens(
                patches, (rope, pos_video), parallel,
                tile_size=1 if mask is None else mask.tile_size,
            )
            tokens = self.patch_embed.proj.project(patches)
            if pos_video is not None:
                tokens = tokens + pos_video.astype(dtype)
            if segment_ids is not None:  # the text is never padding
                segment_ids = jnp.concatenate([jnp.zeros((T,), jnp.int32), segment_ids])

            # Every device carries a copy of the text stream. The joint attention makes
            # the copies vary (in type) over the sequence axes; the scan carry starts so,
            # and the copies' gradients are summed by that cast's transpose.
            context = as_varying(context, varying_axes(tokens, context))

            def block(carry, b):
                return b(*carry, temb, rope, segment_ids, mask)

            tokens, _ = scan_layers(block, (tokens, context), self.transformer_blocks, policy)
            tokens = self.norm_out(self.norm_final(tokens), temb)
            out = linear(self.proj_out, tokens)
            out = nn.sharding.gather_tokens(out, parallel)[:n]
            if mask is not None:
                out = kernels.tile_unpermute(out, grid, mask.tile, axis=0)
            out = functional.unpatchify(out, grid, p, channels_first=True)
            return jnp.transpose(out, (1, 0, 2, 3)).astype(dtype)

    # -- checkpoints --------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path,
        *,
        dtype=None,
        parallel: nn.sharding.ParallelConfig = nn.sharding.ParallelConfig(),
        implementation="auto",
        mesh=None,
        subfolder: str | None = None,
        revision: str | None = None,
        cache_dir=None,
    ) -> "CogVideoXTransformer3D":
        """Loads a diffusers CogVideoX checkpoint (`CogVideoXTransformer3DModel`).

        The directory holds `config.json` and `diffusion_pytorch_model.safetensors`
        (or the shards of `diffusion_pytorch_model.safetensors.index.json`, as the 5B
        releases are). As for [`WanTransformer3D.from_pretrained`][]: the model is
        built abstractly, every tensor's shape is checked before any is read, missing
        and unexpected names are listed together, nothing is partially loaded, tensors
        are read one at a time, no pickle; with `mesh` it loads straight into its
        sharded layout, each process reading only its devices' blocks.

        **Arguments:**

        - `path`: the checkpoint directory (a diffusers `transformer/` folder), or a
            Hugging Face Hub repository id (needs `huggingface_hub`).
        - `dtype`: the parameters' dtype; default the checkpoint's.
        - `parallel`, `implementation`: as for the constructor.
        - `mesh`: a `jax.sharding.Mesh`: place every parameter by
            [`vidax_eqx.nn.sharding.partition_specs`][] under `parallel` while loading.
        - `subfolder`: the folder of `path` holding the checkpoint, e.g.
            `"transformer"` for a pipeline repository (`THUDM/CogVideoX-2b`).
        - `revision`, `cache_dir`: the Hub revision and cache directory (Hub ids only).

        **Returns:**

        The loaded model: its arrays uncommitted on the default device, or with
        `mesh` placed on it.
        """
        raw, tensors = read_config(path, "CogVideoXTransformer3D", subfolder=subfolder,
                                   revision=revision, cache_dir=cache_dir)
        if raw.get("_class_name", "CogVideoXTransformer3DModel") != "CogVideoXTransformer3DModel":
            raise ValueError(
                f"CogVideoXTransformer3D.from_pretrained: {os.fspath(path)!r}/config.json is a "
                f"{raw['_class_name']!r} config, not a CogVideoXTransformer3DModel's."
            )
        config = CogVideoXConfig.from_diffusers(raw)
        return load_pretrained(cls, config, tensors, dtype=dtype, dtype_from="proj_out.weight",
                               parallel=parallel, implementation=implementation, mesh=mesh,
                               stacked=_STACKED)

    def state_dict(self) -> dict[str, np.ndarray]:
        """The parameters under diffusers' names, one tensor per layer."""
        return interop.state_dict(self, naming="diffusers", stacked=_STACKED)

    def linear_layers(self) -> list[interop.LinearName]:
        """Every linear layer with its checkpoint name (diffusers', one per layer of the
        stacked blocks): what [`vidax_eqx.models.add_lora`][] patterns and LoRA files
        name."""
        return interop.linear_layers(self, stacked=_STACKED)

    def save_pretrained(self, path, *, max_shard_bytes: int | None = None) -> None:
        """Writes `config.json` and the weights as safetensors in diffusers' layout
        (loadable by diffusers' `CogVideoXTransformer3DModel.from_pretrained`).

        **Arguments:**

        - `path`: the directory (created if needed).
        - `max_shard_bytes`: split the weights into shards of at most this size with an
            index; default one file.

        `from_pretrained(path)` gives back the same arrays bit for bit.
        """
        os.makedirs(path, exist_ok=True)
        interop.write_checkpoint(path, self.state_dict(), max_shard_bytes=max_shard_bytes)
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(self.config.to_diffusers(), f, indent=2)
