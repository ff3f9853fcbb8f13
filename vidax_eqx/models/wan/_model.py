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
from jax import lax
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray, Real

from ..._shapes import checked
from ... import interop, kernels, nn
from ...nn import functional, sharding
from ...parallel import axis_size
from ...nn.internal import check_text, init, linear
from .._base import AbstractCachedModel
from .._capabilities import Capabilities
from .._checkpoint import load_pretrained, read_config
from .._kv_cache import error_past_reach, KVCache
from .._layers import check_remat, scan_layers, scan_layers_with_outputs
from .._options import attention_keywords, BlockCausal, SlidingTile, VideoSparseTiles
from .._step_cache import cached_blocks, check_step_cache, StepCache, StepDecision
from .._token_layout import AttentionInputs, TokenLayout
from ._blocks import WanBlock, WanBlockInputs, WanHead, WanImageEmbedding
from ._config import WanConfig
from ._names import check_gate_compress, check_layout, rename
from ._text_cache import check_text_cache, WanTextCache


class WanTransformer3D(AbstractCachedModel):
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

    @attention_keywords
    @checked
    def __call__(
        self,
        x: Float[Array, "{self.config.in_channels} F H W"],
        timestep: Real[Array, ""] | Real[Array, " S"],
        context: Float[Array, "L {self.config.text_dim}"],
        *,
        context_image: Float[Array, "L_img {self.config.image_dim}"] | None = None,
        remat: str | None = None,
        attention: SlidingTile | VideoSparseTiles | BlockCausal | None = None,
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
        - `attention`: how every self-attention attends (the tokens' [`TokenLayout`][]):
            `None` (default): full attention, as the reference.
            [`SlidingTile`][]`(tile, window)`: sliding tile attention
            ([`vidax_eqx.kernels.SlidingTileMask`][]`(patch_grid, tile, window)`,
            `window` shared or one per head): the patch tokens and their RoPE tables
            are laid out tile by tile ([`vidax_eqx.kernels.tile_permute`][]) after the
            patch embedding and back before the output, and the hidden tiles are
            skipped. [`VideoSparseTiles`][]`(tile, topk or sparsity)`: video sparse
            attention (VSA, [`vidax_eqx.kernels.video_sparse_attention`][]) on the
            same tile layout: a coarse attention over tile means picks each query
            tile's key tiles, and the output is `out_c * gate + out_fine` with the
            blocks' `to_gate_compress` gate (a model built with
            `WanConfig(gate_compress=True)`, e.g. FastVideo's VSA checkpoints), or
            `out_c + out_fine` without one; an int is `topk` (key tiles per query
            tile), a float the `sparsity` (fraction of key tiles skipped, in [0, 1);
            e.g. `VideoSparseTiles((4, 4, 4), 0.9)`, FastVideo's tiles). Under sequence
            parallelism the tile layout is split by whole tiles (padding tiles are
            empty), and VSA is [`vidax_eqx.parallel.video_sparse_attention`][]. The
            keywords this replaced, `sliding_tile=(tile, window)` and
            `video_sparse=(tile, topk or sparsity)`, still work for a release, with a
            `DeprecationWarning`. [`BlockCausal`][]`(frames_per_block, window)`:
            frame-block causal attention ([`vidax_eqx.kernels.BlockCausalMask`][]), the
            tokens in raster order, each block of latent frames seeing itself and the
            blocks before it (autoregressive video, as CausVid's causal Wan).
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
                                 remat=remat, attention=attention, text_cache=text_cache)

    @attention_keywords
    @checked
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
        attention: SlidingTile | VideoSparseTiles | BlockCausal | None = None,
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
                                 remat=remat, attention=attention, text_cache=text_cache,
                                 step=StepDecision(step_cache, may_reuse, threshold, axis_name))

    def _forward(self, x, timestep, context, *, context_image, remat, attention, text_cache,
                 step=None, e0_shift=None):
        """The forward pass; with `step` (a `StepDecision`), through the step cache,
        returning `(out, cache)`. `e0_shift`: a float32 `(6, dim)` added to every token's
        block modulation `e0` (not to the head's `t`), as SkyReels-V2's fps embedding is."""
        c = self.config
        policy = check_remat(remat)
        self._check_image(context_image)
        parallel = self.parallel
        # The text must come in whole and the same on every device: checked here,
        # once (the blocks see it embedded, by weights FSDP may have gathered).
        check_text("WanTransformer3D", parallel, context)
        if context_image is not None:
            check_text("WanTransformer3D", parallel, context_image)
        # FSDP: everything but the blocks gathered now; the scan gathers one block
        # at a time.
        self, (x, timestep, context, context_image) = sharding.fsdp_gather(
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
            t, e0 = self._time(timestep, e0_shift)
        if text_cache is None:
            context, context_image = self._embed_context(context, context_image, dtype)
        else:
            check_text_cache(text_cache, c, self.parallel, self._text_length(context), context_image,
                             dtype)

        # The patches and every per-token array in the attention's order, this device's
        # rows (padding: zero patches, invisible through segment id -1); a timestep per
        # token is embedded for this device's tokens only.
        layout = TokenLayout(grid, attention, parallel, owner="WanTransformer3D")
        rope = functional.rope_3d(grid, c.head_dim, c.rope_theta)
        if per_token:
            patches, rope, timestep = layout.to_tokens((patches, rope, timestep))
            t, e0 = self._time(timestep, e0_shift)
        else:
            patches, rope = layout.to_tokens((patches, rope))
        tokens = self.patch_embedding.project(patches).astype(jnp.float32)

        inputs = WanBlockInputs(layout.attention_inputs(rope), e0, context, context_image)
        if text_cache is None:
            def block(x, b):
                return b(x, inputs)

            layers = self.blocks
        else:  # one layer's keys and values per step, with its block
            inputs = dataclasses.replace(inputs, context=None, context_image=None)

            def block(x, layer):
                b, kv = layer
                kv = (kv.k, kv.v, kv.k_img, kv.v_img)
                return b(x, dataclasses.replace(inputs, context_kv=kv))

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
            segment_ids = inputs.attention.segment_ids
            valid = None if segment_ids is None else segment_ids >= 0
            tokens, cache = cached_blocks(run, tokens, c.num_layers, cache,
                                          may_reuse=may_reuse, threshold=threshold,
                                          valid=valid, axis_name=axis_name)
        out = layout.from_tokens(self.head(tokens, t))
        out = functional.unpatchify(out, grid, c.patch_size).astype(dtype)
        return out if step is None else (out, cache)

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

    @checked
    def stream(
        self,
        x: Float[Array, "{self.config.in_channels} F H W"],
        timestep: Real[Array, ""] | Real[Array, " S"],
        context: Float[Array, "L {self.config.text_dim}"],
        cache: KVCache,
        *,
        context_image: Float[Array, "L_img {self.config.image_dim}"] | None = None,
        attention: BlockCausal | None = None,
        text_cache: WanTextCache | None = None,
        check_reach: bool = True,
    ) -> tuple[Float[Array, "{self.config.out_channels} F H W"], KVCache]:
        """One chunk of a video generated chunk by chunk (autoregressive video, as CausVid
        and Self-Forcing run Wan): the chunk's latent frames attend to themselves and to
        the cached keys and values of the frames before them, frame-block causally.

            cache = model.kv_cache(60, 104, max_frames=12)
            for chunk in chunks:                       # each a few latent frames
                for t in timesteps:                    # denoise it; the cache is only read
                    v, _ = model.stream(x, t, context, cache)
                    ...
                _, cache = model.stream(x, 0.0, context, cache)   # finished: cache it

        **Arguments:**

        - `x`: the chunk's latents `(C, F, H, W)`, `F` latent frames.
        - `timestep`: a scalar, or one per patch token of the chunk (as `__call__`).
        - `context`, `context_image`, `text_cache`: as `__call__` (a text cache spares
            every chunk and step the text's keys and values).
        - `cache`: the [`KVCache`][] of the frames before the chunk (from
            [`kv_cache`][vidax_eqx.models.WanTransformer3D.kv_cache], then from the
            previous chunk's call).
        - `attention`: the [`BlockCausal`][]`(frames_per_block, window)` the chunks
            attend with; default one block per chunk. `F` and the cache's `max_frames`
            must be multiples of `frames_per_block`; `window` (in blocks) narrows what
            the cache holds.
        - `check_reach`: raise at run time when the stream passes the config's
            `rope_max_seq_len` latent frames (`eqx.error_if`). That check is a host
            callback, which JAX's persistent compilation cache refuses to store:
            `False` when the caller has checked the video's length itself (the
            pipelines' `stream` does), so that the compiled chunk step is cached.

        **Returns:**

        `(out, cache)`: the prediction `(out_channels, F, H, W)`, equal to the model's
        call over the whole video so far with `attention=BlockCausal(...)` on these
        frames (when the cache holds every earlier frame, or the window's), and the
        cache with the chunk's keys and values appended (its oldest frames dropped
        beyond `max_frames`).

        One device, or over a mesh through [`run_sharded`][]`(..., kv_cache=cache)`
        (tensor parallelism, FSDP and Ulysses: the cache split by heads, as each device's
        attention holds them; not a ring). The frames of the whole stream stay below the
        config's `rope_max_seq_len` (the RoPE tables' reach; a chunk beyond it raises at
        run time).
        """
        with jax.named_scope("vidax_eqx.models.WanTransformer3D.stream"):
            return self._stream(x, timestep, context, cache, context_image=context_image,
                                attention=attention, text_cache=text_cache, check_reach=check_reach)

    def _stream(self, x, timestep, context, cache, *, context_image, attention, text_cache,
                e0_shift=None, check_reach=True):
        """`stream`'s forward (SkyReels-V2 adds `e0_shift`, its fps term)."""
        c = self.config
        owner = f"{type(self).__name__}.stream"
        parallel = self.parallel
        if parallel.ring_axis is not None:
            raise NotImplementedError(
                f"{owner}: streaming with a key/value cache runs on one device or over a mesh "
                f"with tensor parallelism, FSDP or Ulysses; not over a ring ({parallel})."
            )
        self._check_image(context_image)
        check_text(owner, parallel, context)
        # FSDP: everything but the blocks gathered now; each block gathers itself.
        self, (x, timestep, context, context_image, e0_shift) = sharding.fsdp_gather(
            self, (x, timestep, context, context_image, e0_shift), exclude=lambda m: m.blocks)
        dtype = self.patch_embedding.weight.dtype
        grid = functional.patch_grid(x.shape, c.patch_size, owner)
        f, h, w = grid
        if h * w != cache.tokens_per_frame:
            raise ValueError(
                f"{owner}: the chunk's frames hold {h * w} patch tokens (patch grid {grid}); "
                f"the cache's {cache.tokens_per_frame}: build the cache for these latents."
            )
        if attention is None:
            attention = BlockCausal(f)
        if not isinstance(attention, BlockCausal):
            raise ValueError(f"{owner}: `attention` must be a models.BlockCausal or None; received "
                             f"{attention!r}.")
        k = attention.frames_per_block
        if f % k or cache.max_frames % k:
            raise ValueError(
                f"{owner}: the chunk's latent frames ({f}) and the cache's max_frames "
                f"({cache.max_frames}) must be multiples of the blocks' frames_per_block={k}."
            )
        S = f * h * w
        if timestep.ndim == 1 and timestep.shape[0] != S:
            raise ValueError(f"{owner}: a per-token `timestep` has one value per patch token of "
                             f"the chunk: {S}; received {timestep.shape[0]}.")
        # Ulysses: this device's contiguous rows of the chunk's tokens (the attention
        # trades them for a head split, the cache holding this device's heads).
        ulysses = parallel.ulysses_axis
        sp = 1 if ulysses is None else axis_size(ulysses, what="Ulysses")
        if S % sp:
            raise ValueError(
                f"{owner}: Ulysses splits the chunk's {S} patch tokens over {ulysses!r} ({sp} "
                "devices); they must divide them (choose chunk_frames so that they do).")
        def local(a):  # this device's rows of a per-token array
            return sharding.shard_tokens(a, parallel)

        if timestep.ndim == 1:
            timestep = local(timestep)
        t, e0 = self._time(timestep, e0_shift)
        if text_cache is None:
            context, context_image = self._embed_context(context, context_image, dtype)
        else:
            check_text_cache(text_cache, c, self.parallel, self._text_length(context), context_image,
                             dtype)
            context = context_image = None
        rope = functional.rope_3d(grid, c.head_dim, c.rope_theta, frame_offset=cache.frame,
                                  max_frames=max(c.rope_max_seq_len, f))
        rope = jax.tree.map(local, rope)
        tokens = self.patch_embedding.project(local(functional.patchify(x.astype(dtype), c.patch_size)))
        # The attention's sequence is [the cache's buffer; the chunk], in time order, the
        # chunk its last tokens (static: the splash kernel serves it on a TPU).
        mask = kernels.BlockCausalMask((cache.max_frames + f, h, w), k, window=attention.window,
                                       query_offset=cache.capacity)
        valid = cache.valid()
        inputs = WanBlockInputs(AttentionInputs(rope, None, mask), e0, context, context_image)

        def block(x, layer):
            b, past_k, past_v, kv = layer
            layer_inputs = inputs if kv is None else dataclasses.replace(
                inputs, context_kv=(kv.k, kv.v, kv.k_img, kv.v_img))
            return b.with_past(x, layer_inputs, past_k, past_v, past_valid=valid)

        tokens, (k_new, v_new) = scan_layers_with_outputs(
            block, tokens.astype(jnp.float32), (self.blocks, cache.k, cache.v, text_cache))
        out = sharding.gather_tokens(self.head(tokens, t), parallel)  # the whole chunk's
        out = functional.unpatchify(out, grid, c.patch_size).astype(dtype)
        cache = cache.append(k_new, v_new, f)
        on_mesh = parallel.tp_axis is not None or parallel.sequence_axes or parallel.fsdp_axes
        if check_reach and not on_mesh:  # (over a mesh, run_sharded checks it, outside shard_map)
            out = error_past_reach(out, cache, c.rope_max_seq_len, owner)
        return out, cache

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
            arrays, static = eqx.partition(self.blocks, eqx.is_array)

            def layer(carry, block_arrays):
                attn = eqx.combine(block_arrays, static).cross_attn
                return carry, attn.project_context(context, context_image=context_image,
                                                   context_copies=True)

            k, v, k_img, v_img = lax.scan(layer, None, arrays)[1]
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
        rename = check_gate_compress(tensors, gate_compress, path)
        config = dataclasses.replace(config, gate_compress=bool(gate_compress))
        return load_pretrained(cls, config, tensors, dtype=dtype,
                               dtype_from="patch_embedding.weight", parallel=parallel,
                               implementation=implementation, mesh=mesh,
                               stacked=cls.stacked_layers, rename=rename)

    def state_dict(self, *, layout: str = "diffusers") -> dict[str, np.ndarray]:
        """The parameters under the checkpoint names of `layout` (`"diffusers"` or
        `"wan"`), one tensor per layer (views, no copies on CPU)."""
        naming = check_layout(layout)
        return interop.state_dict(self, naming=naming, stacked=self.stacked_layers, rename=rename)

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
        os.makedirs(path, exist_ok=True)
        interop.write_checkpoint(path, self.state_dict(layout=layout),
                                 max_shard_bytes=max_shard_bytes)
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
