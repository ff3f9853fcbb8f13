"""Whole reference models composed from `vidax_eqx.nn`: checkpoints in and out, and one
call that runs a model over a mesh. One folder per model: [`vidax_eqx.models.wan`][],
[`vidax_eqx.models.cogvideox`][], [`vidax_eqx.models.wan_vae`][],
[`vidax_eqx.models.cogvideox_vae`][], [`vidax_eqx.models.t5`][],
[`vidax_eqx.models.clip`][] and [`vidax_eqx.models.skyreels`][]; the names below are
theirs, re-exported.

- [`WanTransformer3D`][]: Wan 2.1's and 2.2's video DiT (T2V, I2V, FLF2V, TI2V with a
    timestep per token), from diffusers or original Wan checkpoints;
    [`wan_image_timestep`][] builds TI2V's per-token timestep.
- [`SkyReelsV2Transformer3D`][]: SkyReels-V2's diffusion forcing DiT (Wan 2.1's, a
    timestep per latent frame, the fps embedding), from diffusers checkpoints.
- [`WanExperts`][]: Wan 2.2 A14B, a high-noise and a low-noise expert routed by the
    timestep.
- [`CogVideoXTransformer3D`][]: CogVideoX 1.0's video DiT (2B and 5B, T2V and I2V),
    from diffusers checkpoints.
- [`WanVAE`][]: Wan 2.1's and 2.2's video VAE ([`WanVAEConfig`][]): video to latents
    ([`GaussianPosterior`][]) and back, time in chunks, frames split over a mesh or
    tiled ([`Tiling`][]), or decoded chunk by chunk as latents stream in
    ([`DecodeStream`][]).
- [`CogVideoXVAE`][]: CogVideoX's video VAE ([`CogVideoXVAEConfig`][]), diffusers'
    frame chunks, frames split over a mesh or tiled.
- [`T5Encoder`][]: the pipelines' text encoders ([`T5EncoderConfig`][]): UMT5 (Wan 2.1 /
    2.2) and T5 v1.1 (CogVideoX), from transformers checkpoints.
- [`CLIPVisionEncoder`][]: Wan 2.1 I2V / FLF2V's image encoder ([`CLIPVisionConfig`][]),
    transformers' `CLIPVisionModelWithProjection`, and [`CLIPImageProcessor`][], its
    `pixel_values` from images as transformers' processor gives them.
- [`run_sharded`][]: a model over a device mesh (sequence, tensor and data parallelism)
    with global inputs and outputs.
- [`WanTextCache`][]: Wan's cross-attention keys and values of a text, computed once
    ([`WanTransformer3D.text_cache`][vidax_eqx.models.WanTransformer3D.text_cache], [`sharded_text_cache`][] over a mesh) and taken
    by every denoising step.
- [`KVCache`][]: the self-attention keys and values of the finished latent frames, what
    streaming generation carries from one chunk to the next
    ([`WanTransformer3D.stream`][vidax_eqx.models.WanTransformer3D.stream]; a rolling
    window of fixed size).
- [`StepCache`][]: step caching, what a denoising loop carries to reuse the block
    stack's residual of an earlier step ([`WanTransformer3D.cached_call`][vidax_eqx.models.WanTransformer3D.cached_call],
    [`run_sharded`][]`(step_cache=...)`).
- [`SlidingTile`][], [`VideoSparseTiles`][], [`BlockCausal`][]: a model call's
    `attention=` option (sparse or frame-block causal attention; `None` is full attention).
- [`TokenLayout`][]: the one token layout of every transformer: patch tokens (and their
    RoPE tables and per-token arrays) into the attention's order, padded and split over
    the sequence axes, and back; [`AttentionInputs`][], what each self-attention takes in
    it; [`WanBlockInputs`][], [`CogVideoXBlockInputs`][]: a block's per-call inputs.
- [`add_lora`][], [`load_lora`][], [`save_lora`][]: LoRA adapters on a model's linear
    layers, by name pattern or from the files people share (diffusers/PEFT,
    ComfyUI/kohya); merged, switched and trained with the functions of
    [`vidax_eqx.nn`][] (`merge_lora`, `set_lora_scale`, `lora_filter`).
- [`save_training_state`][], [`restore_training_state`][]: training checkpoints (the
    model's arrays, the optimizer state, the step) with orbax, restored onto any mesh
    and parallel configuration.
- [`export`][], [`ExportedModel`][]: a function of a model (a forward pass, a training
    step) exported with `jax.export`, the model an argument: serialized without
    weights, for one or several platforms, reloaded and called with a model of the
    same configuration.
- [`AbstractModel`][], [`AbstractCachedModel`][], [`AbstractExperts`][],
    [`AbstractBatchedInput`][], [`AbstractPerExpert`][]: what `run_sharded`, LoRA, the
    caches and the samplers need of a model and of its inputs; a new model subclasses
    them; [`AbstractVideoDiT`][] writes a video DiT's public calls once over its one
    forward (given a [`CallState`][]; a variant's `_conditioning` hook returns a
    [`Conditioning`][]); [`Capabilities`][], the record of what a model class can do (its class
    variable `capabilities`), which the samplers and pipelines read;
    [`capability_table`][], the records as a table.
    [`AbstractVideoVAE`][]: what a pipeline needs of a video VAE.
"""

from . import (
    clip as clip, cogvideox as cogvideox, cogvideox_vae as cogvideox_vae, skyreels as skyreels, t5 as t5,
    wan as wan, wan_vae as wan_vae,
)
from ._base import (
    AbstractBatchedInput as AbstractBatchedInput,
    AbstractCachedModel as AbstractCachedModel,
    AbstractExperts as AbstractExperts,
    AbstractModel as AbstractModel,
    AbstractPerExpert as AbstractPerExpert,
    AbstractVideoVAE as AbstractVideoVAE,
)
from ._capabilities import Capabilities as Capabilities
from ._dit import (
    AbstractVideoDiT as AbstractVideoDiT,
    CallState as CallState,
    Conditioning as Conditioning,
)
from ._table import capability_table as capability_table
from ._export import ExportedModel as ExportedModel, export as export
from ._layers import REMAT_POLICIES as REMAT_POLICIES
from ._lora import add_lora as add_lora, load_lora as load_lora, save_lora as save_lora
from ._quantize import QUANTIZE as QUANTIZE, quantize as quantize
from ._options import (
    BlockCausal as BlockCausal,
    SlidingTile as SlidingTile,
    VideoSparseTiles as VideoSparseTiles,
)
from ._token_layout import AttentionInputs as AttentionInputs, TokenLayout as TokenLayout
from ._run_sharded import run_sharded as run_sharded
from ._kv_cache import KVCache as KVCache
from ._step_cache import StepCache as StepCache
from ._vae import (
    vae_compile_options as vae_compile_options,
    GaussianPosterior as GaussianPosterior,
    Tiling as Tiling,
)
from ._training import (
    restore_training_state as restore_training_state,
    save_training_state as save_training_state,
)
from .cogvideox import (
    CogVideoXBlock as CogVideoXBlock,
    CogVideoXBlockInputs as CogVideoXBlockInputs,
    CogVideoXConfig as CogVideoXConfig,
    CogVideoXTransformer3D as CogVideoXTransformer3D,
    rope_crop_positions as rope_crop_positions,
)
from .wan_vae import DecodeStream as DecodeStream, WanVAE as WanVAE, WanVAEConfig as WanVAEConfig
from .cogvideox_vae import CogVideoXVAE as CogVideoXVAE, CogVideoXVAEConfig as CogVideoXVAEConfig
from .t5 import T5Encoder as T5Encoder, T5EncoderConfig as T5EncoderConfig
from .skyreels import SkyReelsV2Config as SkyReelsV2Config, SkyReelsV2Transformer3D as SkyReelsV2Transformer3D
from .clip import (
    CLIPImageProcessor as CLIPImageProcessor,
    CLIPVisionConfig as CLIPVisionConfig,
    CLIPVisionEncoder as CLIPVisionEncoder,
)
from .wan import (
    sharded_text_cache as sharded_text_cache,
    WanBlock as WanBlock,
    WanBlockInputs as WanBlockInputs,
    WanConfig as WanConfig,
    WanExperts as WanExperts,
    WanExpertsTextCache as WanExpertsTextCache,
    WanHead as WanHead,
    WanImageEmbedding as WanImageEmbedding,
    WanTextCache as WanTextCache,
    WanTransformer3D as WanTransformer3D,
    wan_image_timestep as wan_image_timestep,
)
