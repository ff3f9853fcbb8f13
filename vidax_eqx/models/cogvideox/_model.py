"""CogVideoX's video DiT (diffusers' `CogVideoXTransformer3DModel`, CogVideoX 1.0: 2B
and 5B, T2V and I2V), composed from `vidax_eqx.nn`."""

import json
import os
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray, Real

from ..._shapes import checked
from ... import interop, nn
from ..._vma import as_varying, varying_axes
from ...nn import functional, sharding
from ...nn.internal import check_text, init, linear
from .._base import AbstractModel
from .._capabilities import Capabilities
from .._checkpoint import load_pretrained, read_config
from .._quantize import quantization_config
from .._layers import check_remat, scan_layers, unpacked
from .._options import attention_keywords, BlockCausal, SlidingTile, VideoSparseTiles
from .._token_layout import TokenLayout
from ._blocks import (
    CogVideoXAdaLayerNorm, CogVideoXBlock, CogVideoXBlockInputs, CogVideoXPatchEmbed,
)
from ._config import CogVideoXConfig, rope_crop_positions


class CogVideoXTransformer3D(AbstractModel):
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
    # No text cache (the text is a stream of the joint attention, changed by every
    # block), no step cache, no streaming, one timestep per video.
    capabilities: ClassVar[Capabilities] = Capabilities(
        latents="FCHW", timestep="video", text_cache=False, step_cache=False, streaming=False,
        experts=False, image=frozenset({"channels"}))

    def __init__(
        self,
        config: CogVideoXConfig,
        *,
        parallel: sharding.ParallelConfig = sharding.ParallelConfig(),
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
    def parallel(self) -> sharding.ParallelConfig:
        """The [`vidax_eqx.nn.sharding.ParallelConfig`][] the model runs with."""
        return self.transformer_blocks.attn1.parallel

    in_channels = property(lambda self: self.config.in_channels)
    out_channels = property(lambda self: self.config.out_channels)
    patch_size = property(lambda self: (1, self.config.patch_size, self.config.patch_size))
    text_dim = property(lambda self: self.config.text_embed_dim)

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

    @attention_keywords
    @checked
    def __call__(
        self,
        x: Float[Array, "F {self.config.in_channels} H W"],
        timestep: Real[Array, ""],
        context: Float[Array, "T {self.config.text_embed_dim}"],
        *,
        remat: str | None = None,
        attention: SlidingTile | VideoSparseTiles | BlockCausal | None = None,
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
        - `attention`: `None` (default): full attention.
            [`SlidingTile`][]`(tile, window)`: sliding tile attention over the video
            tokens, the text a prefix every token sees and that sees every token
            ([`vidax_eqx.kernels.SlidingTileMask`][]`(patch_grid, tile, window,
            text_len=T)`), the tokens laid out as for [`WanTransformer3D`][] (the
            call's [`TokenLayout`][]). [`VideoSparseTiles`][] raises
            `NotImplementedError` (video sparse attention over a joint text prefix is
            not implemented). The keyword this replaced, `sliding_tile=(tile,
            window)`, still works for a release, with a `DeprecationWarning`.

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
            self, (x, timestep, context) = sharding.fsdp_gather(
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
            # The patches and their positions in the attention's order, this device's
            # rows (padding: zero patches, invisible through segment id -1); the text is
            # the joint sequence's prefix, whole on every device.
            layout = TokenLayout(grid, attention, parallel, text_len=T,
                                 owner="CogVideoXTransformer3D")
            patches, rope, pos_video = layout.to_tokens((patches, rope, pos_video))
            tokens = self.patch_embed.proj.project(patches)
            if pos_video is not None:
                tokens = tokens + pos_video.astype(dtype)
            inputs = CogVideoXBlockInputs(layout.attention_inputs(rope), temb)

            # Every device carries a copy of the text stream. The joint attention makes
            # the copies vary (in type) over the sequence axes; the scan carry starts so,
            # and the copies' gradients are summed by that cast's transpose.
            context = as_varying(context, varying_axes(tokens, context))

            def block(carry, b):
                return b(*carry, inputs)

            tokens, _ = scan_layers(block, (tokens, context), self.transformer_blocks, policy)
            tokens = self.norm_out(self.norm_final(tokens), temb)
            out = layout.from_tokens(linear(self.proj_out, tokens))
            out = functional.unpatchify(out, grid, p, channels_first=True)
            return jnp.transpose(out, (1, 0, 2, 3)).astype(dtype)

    # -- checkpoints --------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path,
        *,
        dtype=None,
        parallel: sharding.ParallelConfig = sharding.ParallelConfig(),
        implementation="auto",
        mesh=None,
        subfolder: str | None = None,
        revision: str | None = None,
        cache_dir=None,
        quantize: str | None = None,
    ) -> "CogVideoXTransformer3D":
        """Loads a diffusers CogVideoX checkpoint (`CogVideoXTransformer3DModel`).

        The directory holds `config.json` and `diffusion_pytorch_model.safetensors`
        (or the shards of `diffusion_pytorch_model.safetensors.index.json`, as the 5B
        releases are). As for [`WanTransformer3D.from_pretrained`][vidax_eqx.models.WanTransformer3D.from_pretrained]: the model is
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
        - `quantize`: `"int8-weights"` or `"int8"` (weights and activations): the
            model's block layers in int8 once loaded ([`vidax_eqx.models.quantize`][]).
            A checkpoint written by a quantized model (its `config.json` has a
            `quantization_config`) loads as int8 without it, bit for bit.

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
                               stacked=cls.stacked_layers, quantize=quantize,
                               quantization=raw.get("quantization_config"))

    def state_dict(self) -> dict[str, np.ndarray]:
        """The parameters under diffusers' names, one tensor per layer."""
        return interop.state_dict(unpacked(self), naming="diffusers", stacked=self.stacked_layers)

    def linear_layers(self) -> list[interop.LinearName]:
        """Every linear layer with its checkpoint name (diffusers', one per layer of the
        stacked blocks): what [`vidax_eqx.models.add_lora`][] patterns and LoRA files
        name."""
        return interop.linear_layers(self, stacked=self.stacked_layers)

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
        config = self.config.to_diffusers()
        if (quantized := quantization_config(self)) is not None:  # int8 weights and scales
            config["quantization_config"] = quantized
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
