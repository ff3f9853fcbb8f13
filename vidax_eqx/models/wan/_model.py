"""Wan 2.1's and 2.2's video DiT (`WanModel` of Wan's `wan/modules/model.py`; diffusers'
`WanTransformer3DModel`), composed from `vidax_eqx.nn`."""

import dataclasses
import json
import os
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from ..._shapes import checked
from ... import interop, nn
from ...nn import functional, sharding
from ...nn.internal import check_text, init, linear
from .._capabilities import Capabilities
from .._checkpoint import load_pretrained, read_config
from .._quantize import quantization_config
from .._dit import AbstractVideoDiT, CallState
from .._kv_cache import error_past_reach, KVCache, StreamLayout
from .._layers import (
    check_remat, partition_layers, scan as scan_layer_arrays, scan_layers, scan_layers_with_outputs,
    unpacked)
from .._step_cache import cached_blocks, check_step_cache
from .._token_layout import TokenLayout
from ._blocks import WanBlock, WanBlockInputs, WanHead, WanImageEmbedding
from ._config import WanConfig
from ._names import check_gate_compress, check_layout, rename
from ._text_cache import check_text_cache, WanTextCache


class WanTransformer3D(AbstractVideoDiT):
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

    **Calls:** `__call__`, `cached_call` (step caching) and `stream` (a chunk with a
    key/value cache), [`AbstractVideoDiT`][]'s, all one forward pass; `text_cache`
    computes the text's keys and values once per generation.

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
    capabilities: ClassVar[Capabilities] = Capabilities(
        latents="CFHW", timestep="token", text_cache=True, step_cache=True, streaming=True,
        experts=False, image=frozenset({"channels", "frames", "embedding"}))

    def __init__(
        self,
        config: WanConfig,
        *,
        parallel: sharding.ParallelConfig = sharding.ParallelConfig(),
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
    def parallel(self) -> sharding.ParallelConfig:
        """The [`vidax_eqx.nn.sharding.ParallelConfig`][] the model runs with."""
        return self.blocks.self_attn.parallel

    in_channels = property(lambda self: self.config.in_channels)
    out_channels = property(lambda self: self.config.out_channels)
    patch_size = property(lambda self: tuple(self.config.patch_size))
    text_dim = property(lambda self: self.config.text_dim)
    image_dim = property(lambda self: self.config.image_dim)

    def _forward(self, x, timestep, context, state: CallState, *, context_image, remat, attention,
                 e0_shift=None):
        """The one forward pass of [`AbstractVideoDiT`][]'s calls: with `state.step` (a
        `StepDecision`) through the step cache, returning `(out, step_cache)`; with
        `state.kv_cache` a streamed chunk ([`StreamLayout`][]), returning `(out, kv_cache)`.
        `e0_shift`: a float32 `(6, dim)` added to every token's block modulation `e0` (not
        to the head's `t`), as SkyReels-V2's fps embedding is."""
        c = self.config
        streaming = state.kv_cache is not None
        owner = f"{type(self).__name__}.stream" if streaming else "WanTransformer3D"
        policy = check_remat(remat)
        self._check_image(context_image)
        parallel = self.parallel
        # The text must come in whole and the same on every device: checked here,
        # once (the blocks see it embedded, by weights FSDP may have gathered).
        check_text(owner, parallel, context)
        if context_image is not None:
            check_text(owner, parallel, context_image)
        # FSDP: everything but the blocks gathered now; the scan gathers one block
        # at a time.
        self, (x, timestep, context, context_image, e0_shift) = sharding.fsdp_gather(
            self, (x, timestep, context, context_image, e0_shift), exclude=lambda m: m.blocks)
        dtype = self.patch_embedding.weight.dtype
        grid = functional.patch_grid(x.shape, c.patch_size, owner)
        patches = functional.patchify(x.astype(dtype), c.patch_size)
        if timestep.ndim == 1 and timestep.shape[0] != int(np.prod(grid)):
            raise ValueError(
                f"{owner}: a per-token `timestep` has one value per patch token: "
                f"{int(np.prod(grid))} for the latent grid {tuple(x.shape[1:])} (patch grid "
                f"{tuple(grid)}, patch_size {c.patch_size}); received {timestep.shape[0]}."
            )
        text_cache = state.text_cache
        if text_cache is not None:
            check_text_cache(text_cache, c, parallel, self._text_length(context), context_image,
                             dtype)

        # The patches and every per-token array in the attention's order, this device's
        # rows (padding: zero patches, invisible through segment id -1); a timestep per
        # token is embedded for this device's tokens only. A streamed chunk's RoPE tables
        # start at the cache's frame.
        if streaming:
            layout = StreamLayout(grid, state.kv_cache, attention, parallel, owner)
            rope = functional.rope_3d(grid, c.head_dim, c.rope_theta, frame_offset=state.kv_cache.frame,
                                      max_frames=max(c.rope_max_seq_len, grid[0]))
        else:
            layout = TokenLayout(grid, attention, parallel, owner="WanTransformer3D")
            rope = functional.rope_3d(grid, c.head_dim, c.rope_theta)
        if timestep.ndim == 1:
            patches, rope, timestep = layout.to_tokens((patches, rope, timestep))
        else:
            patches, rope = layout.to_tokens((patches, rope))
        t, e0 = self._time(timestep, e0_shift)
        if text_cache is None:
            context, context_image = self._embed_context(context, context_image, dtype)
        else:
            context = context_image = None
        tokens = self.patch_embedding.project(patches).astype(jnp.float32)
        inputs = WanBlockInputs(layout.attention_inputs(rope), e0, context, context_image)

        def with_text(kv):  # a block's inputs, with its layer of the text cache
            return inputs if kv is None else dataclasses.replace(
                inputs, context_kv=(kv.k, kv.v, kv.k_img, kv.v_img))

        cache = state.kv_cache if streaming else state.step
        if streaming:
            valid = cache.valid()

            def block(x, layer):
                b, past_k, past_v, kv = layer
                return b.with_past(x, with_text(kv), past_k, past_v, past_valid=valid)

            tokens, (k_new, v_new) = scan_layers_with_outputs(
                block, tokens, (self.blocks, cache.k, cache.v, text_cache))
            cache = cache.append(k_new, v_new, grid[0])
        else:
            def block(x, layer):
                b, kv = layer
                return b(x, with_text(kv))

            layers = (self.blocks, text_cache)

            def run(x, start, stop):  # blocks [start, stop)
                if (start, stop) != (0, c.num_layers):
                    arrays, static = eqx.partition(layers, eqx.is_array)
                    sliced = jax.tree.map(lambda a: a[start:stop], arrays)
                    return scan_layers(block, x, eqx.combine(sliced, static), policy)
                return scan_layers(block, x, layers, policy)

            if cache is None:
                tokens = run(tokens, 0, c.num_layers)
            else:
                step_cache, may_reuse, threshold, axis_name = cache
                check_step_cache("WanTransformer3D.cached_call", step_cache, tokens, may_reuse,
                                 threshold)
                segment_ids = inputs.attention.segment_ids
                tokens, cache = cached_blocks(run, tokens, c.num_layers, step_cache,
                                              may_reuse=may_reuse, threshold=threshold,
                                              valid=None if segment_ids is None else segment_ids >= 0,
                                              axis_name=axis_name)
        out = layout.from_tokens(self.head(tokens, t))
        out = functional.unpatchify(out, grid, c.patch_size).astype(dtype)
        on_mesh = parallel.tp_axis is not None or parallel.sequence_axes or parallel.fsdp_axes
        if streaming and state.check_reach and not on_mesh:
            # (over a mesh, run_sharded checks it, outside shard_map)
            out = error_past_reach(out, cache, c.rope_max_seq_len, owner)
        return out if cache is None else (out, cache)

    # -- streaming: chunk by chunk with a key/value cache ----------------------------------

    def kv_cache(self, height: int, width: int, max_frames: int, *, dtype=None) -> KVCache:
        """An empty [`KVCache`][] for [`stream`][vidax_eqx.models.WanTransformer3D.stream]:
        the self-attention keys and values of the last `max_frames` latent frames of a video
        of latents `height x width`, in the weights' dtype (or `dtype`). Its size is fixed:
        `num_layers x max_frames * tokens_per_frame x num_heads x head_dim`, twice."""
        c = self.config
        _, ph, pw = c.patch_size
        if height % ph or width % pw or height < 1 or width < 1:
            raise ValueError(
                f"WanTransformer3D.kv_cache: the latents' height and width must be positive "
                f"multiples of the patch {(ph, pw)}; received {height} x {width}."
            )
        return KVCache.empty(layers=c.num_layers, max_frames=max_frames,
                             tokens_per_frame=(height // ph) * (width // pw), heads=c.num_heads,
                             head_dim=c.head_dim,
                             dtype=self.patch_embedding.weight.dtype if dtype is None else dtype)

    def _check_image(self, context_image):
        if (self.img_emb is None) != (context_image is None):
            raise ValueError(
                "WanTransformer3D: `context_image` is required by an I2V model (image_dim "
                f"set) and refused otherwise; the model has image_dim={self.config.image_dim}, "
                f"received context_image={None if context_image is None else context_image.shape}."
            )

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

    @checked
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
            self, (context, context_image) = sharding.fsdp_gather(
                self, (context, context_image), exclude=lambda m: m.blocks)
            dtype = self.patch_embedding.weight.dtype
            context, context_image = self._embed_context(context, context_image, dtype)
            arrays, static = partition_layers(self.blocks)

            def layer(carry, block_arrays):
                attn = eqx.combine(block_arrays, static).cross_attn
                return carry, attn.project_context(context, context_image=context_image,
                                                   context_copies=True)

            k, v, k_img, v_img = scan_layer_arrays(layer, None, arrays)[1]
            return WanTextCache(k, v, k_img, v_img)

    def _time(self, timestep, e0_shift=None):
        """`(t, e0)`: the float32 time embedding `(..., dim)` and its projection
        `(..., 6, dim)` of a scalar timestep or of one per token `(S,)`, plus `e0_shift`
        `(6, dim)` when given."""
        t = self.time_embedding(timestep)
        # A scalar's projection is the Linear's own `W @ x` (what it always was: the same
        # program and bits); per token, `x @ W.T` on the (S, dim) rows.
        project = self.time_projection if timestep.ndim == 0 else (
            lambda h: linear(self.time_projection, h))
        e0 = project(jax.nn.silu(t))
        e0 = e0.reshape(*t.shape[:-1], 6, self.config.dim).astype(jnp.float32)
        return t.astype(jnp.float32), e0 if e0_shift is None else e0 + e0_shift

    # -- checkpoints --------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path,
        *,
        dtype=None,
        parallel: sharding.ParallelConfig = sharding.ParallelConfig(),
        implementation="auto",
        pad_text: bool = False,
        gate_compress: bool = False,
        mesh=None,
        subfolder: str | None = None,
        revision: str | None = None,
        cache_dir=None,
        quantize: str | None = None,
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
        - `quantize`: `"int8-weights"` or `"int8"` (weights and activations): the
            model's block layers in int8 once loaded ([`vidax_eqx.models.quantize`][]).
            A checkpoint written by a quantized model (its `config.json` has a
            `quantization_config`) loads as int8 without it, bit for bit.

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
        rename = check_gate_compress(tensors, gate_compress, path)
        config = dataclasses.replace(config, gate_compress=bool(gate_compress))
        return load_pretrained(cls, config, tensors, dtype=dtype,
                               dtype_from="patch_embedding.weight", parallel=parallel,
                               implementation=implementation, mesh=mesh,
                               stacked=cls.stacked_layers, quantize=quantize,
                               quantization=raw.get("quantization_config"), rename=rename)

    def state_dict(self, *, layout: str = "diffusers") -> dict[str, np.ndarray]:
        """The parameters under the checkpoint names of `layout` (`"diffusers"` or
        `"wan"`), one tensor per layer (views, no copies on CPU)."""
        naming = check_layout(layout)
        return interop.state_dict(unpacked(self), naming=naming, stacked=self.stacked_layers,
                                  rename=rename)

    def linear_layers(self) -> list[interop.LinearName]:
        """Every linear layer with its checkpoint names (Wan's and diffusers', one per
        layer of the stacked blocks): what [`vidax_eqx.models.add_lora`][] patterns and
        LoRA files name."""
        return interop.linear_layers(self, stacked=self.stacked_layers, rename=rename)

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
        config = self.config.to_diffusers() if check_layout(layout) == "diffusers" else self.config.to_wan()
        if (quantized := quantization_config(self)) is not None:  # int8 weights and scales
            config["quantization_config"] = quantized
        os.makedirs(path, exist_ok=True)
        interop.write_checkpoint(path, self.state_dict(layout=layout),
                                 max_shard_bytes=max_shard_bytes)
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
