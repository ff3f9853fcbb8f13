"""A video DiT's public calls, written once: `__call__`, the step-cached `cached_call` and
the chunk-by-chunk `stream`, each one call of the model's one forward pass with the
call's per-call state (a [`CallState`][]: text cache, step cache, key/value cache).

A family subclasses [`AbstractVideoDiT`][] with its `_forward` and its
[`Capabilities`][] record; a variant whose calls take more (SkyReels-V2's `fps` and
timestep per frame) overrides the one hook `_conditioning`.
"""

import abc
import dataclasses
from typing import Any

import jax
from jaxtyping import Array, ArrayLike, Bool, Float, Real

from .._shapes import checked
from ._base import AbstractBatchedInput, AbstractCachedModel
from ._capabilities import require
from ._kv_cache import KVCache
from ._options import attention_keywords, BlockCausal, SlidingTile, VideoSparseTiles
from ._step_cache import StepCache, StepDecision


@dataclasses.dataclass(frozen=True)
class CallState:
    """What one call of a video DiT carries besides its inputs, set by the public call it
    came through (one forward pass serves them all):

    - `text_cache`: the text's keys and values (the model's `text_cache(context)`), or
        `None`: the forward projects the context itself.
    - `step`: a `StepDecision` (`cached_call`: the previous step's [`StepCache`][], the
        reuse decision's inputs), or `None`. The forward then returns `(out, step_cache)`.
    - `kv_cache`: the [`KVCache`][] of the frames before the chunk (`stream`), or
        `None`. The forward then returns `(out, kv_cache)`.
    - `check_reach`: `stream` only: raise at run time past the RoPE tables' reach.
    """

    text_cache: AbstractBatchedInput | None = None
    step: StepDecision | None = None
    kv_cache: KVCache | None = None
    check_reach: bool = True

    def __post_init__(self):
        if self.step is not None and self.kv_cache is not None:
            raise ValueError("CallState: a call is step-cached or streamed with a key/value cache, "
                             "not both.")


@dataclasses.dataclass(frozen=True)
class Conditioning:
    """What the `_conditioning` hook makes of a call's inputs for the forward pass: the
    `timestep` as the forward takes it, the call's `attention`, and the forward's
    model-specific keyword arguments (`inputs`)."""

    timestep: Any
    attention: Any
    inputs: dict = dataclasses.field(default_factory=dict)


class AbstractVideoDiT(AbstractCachedModel):
    """A video DiT on channels-first latents `(C, F, H, W)`: its public calls written once
    over one forward pass.

        out = model(x, timestep, context)                             # __call__
        out, step_cache = model.cached_call(x, timestep, context, step_cache, may_reuse=...)
        out, kv_cache = model.stream(x, timestep, context, kv_cache)  # a chunk

    Each call checks what the model's [`Capabilities`][] record allows (a text cache, step
    caching, streaming: refused in one line naming the model and the capability), builds
    the call's [`CallState`][], passes the inputs through the `_conditioning` hook and
    runs `_forward`.

    **A subclass declares:** what [`AbstractCachedModel`][] does (`config`,
    `stacked_layers`, `capabilities`, the sizes, `parallel`, `linear_layers`,
    `text_cache`), `image_dim`, `kv_cache` (when it streams), and

    - `_forward(x, timestep, context, state, *, context_image, remat, attention, **inputs)`:
        the forward pass under the per-call `state`; returns the prediction, or with
        `state.step` / `state.kv_cache` the pair `(out, cache)`.
    - optionally `_conditioning(x, timestep, attention, *, streaming, **conditions)`: the
        hook that takes the call's model-specific keywords (`conditions`) and returns a
        [`Conditioning`][]. The default takes none.
    """

    @property
    @abc.abstractmethod
    def image_dim(self) -> int | None:
        """The width of the image encoder's features `context_image` takes (`None`: the
        model takes no image features)."""

    @abc.abstractmethod
    def kv_cache(self, height: int, width: int, max_frames: int, *, dtype=None) -> KVCache:
        """An empty [`KVCache`][] for `stream` (latents `height x width`, the last
        `max_frames` latent frames)."""

    @abc.abstractmethod
    def _forward(self, x, timestep, context, state: CallState, *, context_image, remat,
                 attention, **inputs):
        """The forward pass of one example under the per-call `state`."""

    def _conditioning(self, x, timestep, attention, *, streaming: bool, **conditions) -> Conditioning:
        """The hook between a public call and `_forward`: the call's model-specific keywords
        (`conditions`) made into the forward's inputs. Default: none are taken."""
        if conditions:
            raise TypeError(f"{type(self).__name__}: unexpected keyword arguments "
                            f"{sorted(conditions)}.")
        return Conditioning(timestep, attention)

    def _run(self, scope, x, timestep, context, state, *, context_image, remat, attention,
             conditions):
        name = type(self).__name__
        if state.text_cache is not None:
            require(name, self, "text_cache")
        with jax.named_scope(f"vidax_eqx.models.{name}{scope}"):
            cond = self._conditioning(x, timestep, attention, streaming=state.kv_cache is not None,
                                      **conditions)
            return self._forward(x, cond.timestep, context, state, context_image=context_image,
                                 remat=remat, attention=cond.attention, **cond.inputs)

    @attention_keywords
    @checked
    def __call__(
        self,
        x: Float[Array, "{self.in_channels} F H W"],
        timestep: Real[Array, ""] | Real[Array, " N"],
        context: Float[Array, "L {self.text_dim}"],
        *,
        context_image: Float[Array, "L_img {self.image_dim}"] | None = None,
        remat: str | None = None,
        attention: SlidingTile | VideoSparseTiles | BlockCausal | None = None,
        text_cache: AbstractBatchedInput | None = None,
        **conditions,
    ) -> Float[Array, "{self.out_channels} F H W"]:
        """**Arguments:**

        - `x`: the noisy latents `(C, F, H, W)` of one video (the reference's layout
            without the batch axis), `F, H, W` multiples of the patch size. Whole on
            every device under sequence parallelism.
        - `timestep`: the diffusion timestep (0 to 1000): a scalar, or, as the model's
            `capabilities.timestep` says, one per latent frame of the patch grid `(F',)`
            (diffusion forcing, SkyReels-V2) or one per patch token `(S,)`,
            `S = F/pt * H/ph * W/pw`, in the patch order (frame-major; diffusers'
            `(B, seq_len)` timestep without the batch axis), as Wan 2.2 TI2V takes it
            ([`wan_image_timestep`][]). Per token, the time embedding, every block's
            modulation and the head's run per token; under sequence parallelism and
            sliding tile attention the timesteps are laid out, padded and split exactly
            like the tokens. A scalar costs no per-token work.
        - `context`: the text encoder's output `(L, text_dim)`, whole on every device.
        - `context_image`: a model with image features only (`image_dim` set): the image
            encoder's features, e.g. Wan I2V's CLIP features `(257, image_dim)`; FLF2V
            (`pos_embed_seq_len` set): the first frame's then the last frame's.
        - `remat`: the rematerialization policy of each block in the backward pass:
            `None` (store activations), `"full"` (recompute everything), or the name
            of a `jax.checkpoint_policies` policy (e.g. `"dots_saveable"`).
        - `attention`: how every self-attention attends (the tokens' [`TokenLayout`][]):
            `None` (default): full attention, as the reference (a model built
            frame-block causal, SkyReels-V2 with `num_frame_per_block > 1`, attends with
            its own blocks). [`SlidingTile`][]`(tile, window)`: sliding tile attention
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
            (and `context_image`), computed by the model's `text_cache` (inside
            `shard_map`: this device's heads, e.g. by [`sharded_text_cache`][]): used
            instead of projecting the context in every block, with bit for bit the same
            output. `context` (and `context_image`) are still required: their shapes are
            checked against the cache (their values cannot be), and they are not
            otherwise used. `None` (default): the context is projected.
        - `**conditions`: the model's own keywords, taken by its `_conditioning` hook
            (SkyReels-V2: `fps`); a model without any refuses them.

        **Returns:**

        The prediction `(out_channels, F, H, W)` (Wan: the flow velocity), in the
        weights' dtype.
        """
        return self._run("", x, timestep, context, CallState(text_cache=text_cache),
                         context_image=context_image, remat=remat, attention=attention,
                         conditions=conditions)

    @attention_keywords
    @checked
    def cached_call(
        self,
        x: Float[Array, "{self.in_channels} F H W"],
        timestep: Real[Array, ""] | Real[Array, " N"],
        context: Float[Array, "L {self.text_dim}"],
        step_cache: StepCache,
        *,
        may_reuse: Bool[ArrayLike, ""] = False,
        threshold: Real[ArrayLike, ""] | None = None,
        axis_name=None,
        context_image: Float[Array, "L_img {self.image_dim}"] | None = None,
        remat: str | None = None,
        attention: SlidingTile | VideoSparseTiles | BlockCausal | None = None,
        text_cache: AbstractBatchedInput | None = None,
        **conditions,
    ) -> tuple[Float[Array, "{self.out_channels} F H W"], StepCache]:
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
        require(type(self).__name__, self, "step_cache")
        state = CallState(text_cache=text_cache,
                          step=StepDecision(step_cache, may_reuse, threshold, axis_name))
        return self._run(".cached_call", x, timestep, context, state, context_image=context_image,
                         remat=remat, attention=attention, conditions=conditions)

    @checked
    def stream(
        self,
        x: Float[Array, "{self.in_channels} F H W"],
        timestep: Real[Array, ""] | Real[Array, " N"],
        context: Float[Array, "L {self.text_dim}"],
        cache: KVCache,
        *,
        context_image: Float[Array, "L_img {self.image_dim}"] | None = None,
        attention: BlockCausal | None = None,
        text_cache: AbstractBatchedInput | None = None,
        check_reach: bool = True,
        **conditions,
    ) -> tuple[Float[Array, "{self.out_channels} F H W"], KVCache]:
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
        - `timestep`: a scalar, or one per frame or per patch token of the chunk (as
            `__call__`).
        - `context`, `context_image`, `text_cache`, `**conditions`: as `__call__` (a
            text cache spares every chunk and step the text's keys and values).
        - `cache`: the [`KVCache`][] of the frames before the chunk (from the model's
            `kv_cache`, then from the previous chunk's call).
        - `attention`: the [`BlockCausal`][]`(frames_per_block, window)` the chunks
            attend with; default the model's own blocks (SkyReels-V2's
            `num_frame_per_block` when it is above 1), else one block per chunk. `F` and
            the cache's `max_frames` must be multiples of `frames_per_block`; `window`
            (in blocks) narrows what the cache holds.
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
        require(type(self).__name__, self, "streaming")
        state = CallState(text_cache=text_cache, kv_cache=cache, check_reach=check_reach)
        return self._run(".stream", x, timestep, context, state, context_image=context_image,
                         remat=None, attention=attention, conditions=conditions)
