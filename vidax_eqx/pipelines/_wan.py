"""`WanPipeline`: prompt (and image) to video with Wan 2.1 / 2.2, diffusers' `WanPipeline`
and `WanImageToVideoPipeline` in one class, without PyTorch."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from collections.abc import Iterator

from .. import interop, models, sampling
from ._common import check_int, dtype_of, image_array, vae_call
from ._pipeline import AbstractVideoPipeline, CallDefaults
from ._stream import check_stream as check_stream_arguments, stream_video, StreamChunk


_OWNER = "WanPipeline"


def image_mask(num_frames: int, temporal: int, latent_frames: int, h: int, w: int,
               last: bool) -> np.ndarray:
    """diffusers' I2V mask `(temporal, F_lat, h, w)`: 1 on the given frames (the first,
    and the last with `last`), each latent frame's `temporal` video frames on the channel
    axis, the first video frame repeated `temporal` times."""
    given = np.zeros(num_frames, np.float32)
    given[0] = 1
    if last:
        given[-1] = 1
    frames = np.concatenate([np.repeat(given[:1], temporal), given[1:]])
    mask = frames.reshape(latent_frames, temporal).T  # (temporal, F_lat)
    return np.broadcast_to(mask[:, :, None, None], (temporal, latent_frames, h, w)).copy()


class WanPipeline(AbstractVideoPipeline):
    """Wan 2.1 / 2.2 text-to-video and image-to-video, from a diffusers pipeline folder
    (diffusers' `WanPipeline` and `WanImageToVideoPipeline`): tokenizer, UMT5 text
    encoder, transformer (or Wan 2.2 A14B's two experts), VAE, scheduler and, for Wan
    2.1 I2V / FLF2V, the CLIP image encoder.

        pipe = WanPipeline.from_pretrained("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
        out = pipe("A cat walks on the grass", negative_prompt="blurry", height=480,
                   width=832, num_frames=81, guidance_scale=5.0, seed=0)
        save_video(out.frames[0], "cat.mp4", fps=16)

    The call takes diffusers' keyword names and reproduces its numbers from the same
    initial latents (`latents=`): the prompt cleaned, tokenized and encoded, zeroed past
    its length and cast to the transformer's dtype; the negative prompt (default `""`)
    when `guidance_scale > 1`; the scheduler of the folder's `scheduler_config.json`; for
    I2V the image's CLIP features (the penultimate layer's) and its VAE latents beside
    diffusers' mask; the latents `(B, z, F, h, w)` denormalized and decoded; frames in
    [0, 1]. Its defaults: 480 x 832, 81 frames, 50 steps, guidance 5.0, 512 tokens, 16
    fps.

    Where diffusers rounds a size down with a warning (a `height` or `width` that the VAE
    and patch size do not divide, a `num_frames - 1` that is not a multiple of 4), this
    raises, naming the sizes that work.

    **Attributes:** those of [`AbstractVideoPipeline`][vidax_eqx.pipelines.AbstractVideoPipeline]
    (`transformer`: a [`vidax_eqx.models.WanTransformer3D`][] or
    [`vidax_eqx.models.WanExperts`][]; `vae`: a [`vidax_eqx.models.WanVAE`][]), and
    `image_encoder` and `image_processor` (or `None`), `expand_timesteps` (Wan 2.2 TI2V).
    """

    defaults = CallDefaults(height=480, width=832, num_frames=81, num_inference_steps=50,
                            guidance_scale=5.0, max_sequence_length=512, fps=16)
    pipeline_classes = ("WanPipeline", "WanImageToVideoPipeline")
    components = ("text_encoder", "image_encoder", "transformer", "vae")
    clean_prompts = True
    masked_text = True
    latent_layout = "(B, z, F, h, w)"

    def __init__(self, *, tokenizer, text_encoder, transformer, vae, scheduler,
                 image_encoder=None, image_processor=None, expand_timesteps: bool = False,
                 mesh=None, batch_axis=None, cfg_axis=None):
        """**Arguments:** those of
        [`AbstractVideoPipeline`][vidax_eqx.pipelines.AbstractVideoPipeline], and:

        - `image_encoder`, `image_processor`: the CLIP encoder and its processor (`None`
            for T2V or a model without an image branch).
        - `expand_timesteps`: Wan 2.2 TI2V's image conditioning (the image's latents
            replace the first latent frame; `model_index.json`'s `expand_timesteps`).
        """
        super().__init__(tokenizer=tokenizer, text_encoder=text_encoder,
                         transformer=transformer, vae=vae, scheduler=scheduler, mesh=mesh,
                         batch_axis=batch_axis, cfg_axis=cfg_axis)
        self.image_encoder, self.image_processor = image_encoder, image_processor
        self.expand_timesteps = bool(expand_timesteps)
        config = self.transformer_config
        if config.out_channels != vae.config.z_dim:
            raise ValueError(
                f"WanPipeline: the transformer's out_channels ({config.out_channels}) must be "
                f"the VAE's z_dim ({vae.config.z_dim}): they are not one pipeline's.")

    @classmethod
    def load_components(cls, folder, *, dtype, vae_dtype, encoder_dtype, parallel, mesh) -> dict:
        """The transformer (two experts for a `transformer_2/`, with the folder's
        `boundary_ratio`), the VAE, the CLIP encoder and processor when the folder has
        them, and `expand_timesteps`."""
        kwargs = dict(dtype=dtype, parallel=parallel, mesh=mesh)
        if folder.has("transformer_2"):
            boundary = folder.config("boundary_ratio")
            transformer = models.WanExperts.from_pretrained(folder.root, boundary=boundary,
                                                            **kwargs)
        else:
            transformer = models.WanTransformer3D.from_pretrained(
                folder.path("transformer", needed_for="every call"), **kwargs)
        vae = models.WanVAE.from_pretrained(folder.path("vae", needed_for="decoding"),
                                            dtype=vae_dtype, mesh=mesh)
        image_encoder = image_processor = None
        if folder.has("image_encoder"):
            image_encoder = models.CLIPVisionEncoder.from_pretrained(
                folder.path("image_encoder", needed_for="an image"), dtype=encoder_dtype)
            image_processor = models.CLIPImageProcessor.from_pretrained(
                folder.path("image_processor", needed_for="an image"))
        return dict(transformer=transformer, vae=vae, image_encoder=image_encoder,
                    image_processor=image_processor,
                    expand_timesteps=folder.config("expand_timesteps", False))

    # -- what the components say --------------------------------------------------------

    @property
    def transformer_config(self):
        """The transformer's `WanConfig` (two experts: the first's, which both share)."""
        return self.transformer.config

    @property
    def image_conditioned(self) -> bool:
        """Whether the transformer takes an image: I2V / FLF2V (condition channels) or
        Wan 2.2 TI2V (`expand_timesteps`, image optional)."""
        c = self.transformer_config
        return c.in_channels > c.out_channels or self.expand_timesteps

    def check_size(self, height, width, num_frames) -> tuple[int, int, int]:
        height = check_int(_OWNER, "height", height, 1)
        width = check_int(_OWNER, "width", width, 1)
        num_frames = check_int(_OWNER, "num_frames", num_frames, 1)
        s, t = self.vae.spatial_factor, self.vae.temporal_factor
        _, ph, pw = self.transformer_config.patch_size
        for name, value, multiple in (("height", height, s * ph), ("width", width, s * pw)):
            if value % multiple:
                lower = value // multiple * multiple
                raise ValueError(
                    f"WanPipeline: `{name}` must be a multiple of {multiple} (the VAE's "
                    f"spatial factor {s} x the patch's {ph if name == 'height' else pw}); "
                    f"received {value}. Use {lower or multiple} or {lower + multiple}.")
        if (num_frames - 1) % t:
            lower = (num_frames - 1) // t * t + 1
            raise ValueError(
                f"WanPipeline: `num_frames` must be 1 + a multiple of {t} (the VAE's temporal "
                f"factor); received {num_frames}. Use {lower} or {lower + t}.")
        return (num_frames - 1) // t + 1, height // s, width // s

    def latent_shape(self, batch: int, grid) -> tuple[int, ...]:
        """`(batch, z, F, h, w)`."""
        return (batch, self.transformer_config.out_channels, *grid)

    # -- stages -------------------------------------------------------------------------

    def encode_image(self, image, last_image=None) -> jax.Array:
        """diffusers' `WanImageToVideoPipeline.encode_image`: the CLIP features of the
        penultimate layer, `(1, L_img, image_dim)` (257 tokens for Wan 2.1's CLIP); with
        `last_image` (FLF2V) the two images' tokens one after the other."""
        if self.image_encoder is None or self.image_processor is None:
            raise ValueError(f"{_OWNER}: the transformer takes CLIP image features, and "
                             "the pipeline has no image_encoder / image_processor; pass "
                             "`image_embeds`.")
        images = [image] if last_image is None else [image, last_image]
        pixels = self.image_processor(images)  # (N, 3, size, size)
        features = _encode_image(self.image_encoder, jnp.asarray(pixels))
        return features.reshape(1, -1, features.shape[-1])

    def prepare_condition(self, image, last_image, height: int, width: int,
                          num_frames: int, batch: int):
        """The image conditioning as [`vidax_eqx.sampling.sample`][] takes it
        (`condition=`): for I2V / FLF2V diffusers' mask (4 channels) then the VAE latents
        of the image followed by zero frames (and the last image), normalized,
        `(batch, 4 + z, F, h, w)`; for Wan 2.2 TI2V the image's normalized latents
        `(batch, z, 1, h, w)`."""
        first = interop.frames_to_video(image_array(_OWNER, "image", image)[None], size=(height, width))
        parts = [first]
        if not self.expand_timesteps:
            gap = num_frames - 1 - (last_image is not None)
            parts.append(np.zeros((3, gap, height, width), np.float32))
            if last_image is not None:
                parts.append(interop.frames_to_video(image_array(_OWNER, "last_image", last_image)[None],
                                                     size=(height, width)))
        video = jnp.asarray(np.concatenate(parts, axis=1), dtype_of(self.vae))
        latents = self.vae.normalize_latents(self._vae_call("encode", video).mode())
        latents = latents.astype(jnp.float32)
        if not self.expand_timesteps:
            f, h, w = latents.shape[1:]
            mask = image_mask(num_frames, self.vae.temporal_factor, f, h, w,
                              last_image is not None)
            latents = jnp.concatenate([jnp.asarray(mask), latents], axis=0)
        return jnp.broadcast_to(latents[None], (batch, *latents.shape))

    def check_image(self, *, image, last_image, image_embeds, image_latents,
                    num_frames: int) -> bool:
        """An I2V / FLF2V transformer needs `image`; a T2V one refuses it (and
        `image_embeds`); `last_image` needs `image` and 2 frames; `image_latents` is
        CogVideoX's. The `"image"` stage runs when `image` is given."""
        config = self.transformer_config
        if image_latents is not None:
            raise ValueError(f"{_OWNER}: `image_latents` is CogVideoXPipeline's; Wan takes "
                             "`image` (and `image_embeds`, its CLIP features).")
        if image is None and last_image is not None:
            raise ValueError(f"{_OWNER}: `last_image` (FLF2V) needs `image`, the first frame.")
        if last_image is not None and num_frames < 2:
            raise ValueError(f"{_OWNER}: `last_image` needs a video of at least 2 frames (the "
                             f"first and the last); received num_frames={num_frames}.")
        if (image is not None or image_embeds is not None) and not self.image_conditioned:
            raise ValueError(
                f"WanPipeline: `image` is for an image-to-video transformer; this "
                f"pipeline's is text-to-video (in_channels {config.in_channels} = "
                f"out_channels, no expand_timesteps). Load an I2V pipeline "
                f"(WanImageToVideoPipeline's folder).")
        if self.image_conditioned and not self.expand_timesteps and image is None:
            raise ValueError(
                f"WanPipeline: this pipeline's transformer is image-to-video (in_channels "
                f"{config.in_channels} = {config.out_channels} latents + "
                f"{config.in_channels - config.out_channels} condition channels): pass "
                f"`image`.")
        if image is not None and last_image is not None and config.image_dim is not None \
                and config.pos_embed_seq_len is None:
            raise ValueError(
                "WanPipeline: `last_image` needs an FLF2V transformer (its "
                "`pos_embed_seq_len` positions the two images' CLIP tokens); "
                "this I2V transformer takes one image.")
        return image is not None

    def image_condition(self, *, image, last_image, image_embeds, image_latents, height,
                        width, num_frames, grid, batch, dtype, key):
        """The CLIP features of `image` (and `last_image`), or `image_embeds`, as the
        model's `context_image` (when the transformer has an image branch), and
        [`prepare_condition`][vidax_eqx.pipelines.WanPipeline.prepare_condition]'s
        condition."""
        config = self.transformer_config
        kwargs = {}
        if config.image_dim is not None:
            features = (self.encode_image(image, last_image) if image_embeds is None
                        else jnp.asarray(image_embeds))
            if features.ndim != 3 or features.shape[0] not in (1, batch):
                raise ValueError(
                    f"WanPipeline: `image_embeds` must be (1 or {batch}, L_img, "
                    f"image_dim); received shape {features.shape}.")
            kwargs["context_image"] = jnp.broadcast_to(
                features, (batch, *features.shape[1:])).astype(dtype)
        condition = self.prepare_condition(image, last_image, height, width, num_frames, batch)
        return condition, kwargs

    def analysis_arguments(self, batch: int) -> dict:
        """The family's model arguments, and the CLIP features an image stage gives a
        transformer with an image branch (257 tokens, FLF2V's `pos_embed_seq_len`)."""
        kwargs = super().analysis_arguments(batch)
        config = self.transformer_config
        if config.image_dim is not None:
            tokens = config.pos_embed_seq_len or 257
            kwargs["context_image"] = jax.ShapeDtypeStruct((batch, tokens, config.image_dim),
                                                           jnp.dtype(self.transformer_dtype))
        return kwargs

    def stream(self, prompt=None, negative_prompt=None, *, height: int | None = None,
               width: int | None = None, num_frames: int | None = None, chunk_frames: int = 3,
               max_cached_frames: int | None = None, window: int | None = None, scheduler=None,
               num_inference_steps: int | None = None, guidance_scale: float = 1.0,
               num_videos_per_prompt: int = 1, seed: int = 0, latents=None, prompt_embeds=None,
               negative_prompt_embeds=None, max_sequence_length: int | None = None,
               output_type: str = "np", family=None, **model_kwargs) -> Iterator[StreamChunk]:
        """Generates a video chunk by chunk, yielding each chunk's frames as soon as they
        are decoded (autoregressive video, as CausVid and Self-Forcing sample it): every
        chunk of `chunk_frames` latent frames is denoised from fresh noise by `scheduler`
        against the key/value cache of the chunks before it (the transformer's
        [`stream`][vidax_eqx.models.WanTransformer3D.stream], frame-block causal with a
        block per chunk), then run once more at timestep 0 to append its keys and values
        to the cache, then decoded by [`vidax_eqx.models.WanVAE.decode_stream`][] with the
        decoder's time caches carried to the next chunk. Memory stays flat however long
        the video: the cache holds at most `max_cached_frames` latent frames.

            for chunk in pipe.stream("A cat walks", num_frames=81, chunk_frames=3):
                writer.write(chunk.frames[0])         # (4 x 3 frames, H, W, 3) each

        **Arguments:**

        - `prompt`, `negative_prompt`, `height`, `width`, `num_frames`,
            `num_videos_per_prompt`, `seed`, `prompt_embeds`, `negative_prompt_embeds`,
            `max_sequence_length`, `output_type`: as the call's. The negative prompt is
            used when `guidance_scale > 1` (each guidance branch then has its own cache).
        - `chunk_frames`: latent frames per chunk (3: CausVid's and Self-Forcing's); it
            must divide the video's latent frames.
        - `max_cached_frames`: the latent frames the cache keeps (a multiple of
            `chunk_frames`); default every earlier frame of the video.
        - `window`: the chunks (blocks) a chunk attends to, its own included (`None`:
            every cached one).
        - `scheduler`, `num_inference_steps`: a [`vidax_eqx.sampling`][] scheduler and its
            steps per chunk; default [`vidax_eqx.sampling.FewStep`][]`()` (four steps).
            Each chunk's noise is drawn from the seed's key folded with the chunk's index,
            or is its frames of `latents`, the whole video's initial latents `(B, z, F,
            h, w)`.
        - `guidance_scale`: classifier-free guidance (default 1.0: none, as distilled
            models run).
        - `family`: the family's options, as the call's.
        - `**model_kwargs`: further arguments of the transformer's `stream` (arrays per
            example, `(B, ...)`).

        **Yields:**

        A [`StreamChunk`][vidax_eqx.pipelines.StreamChunk] per chunk, in order.
        Text-to-video, on one device or the pipeline's mesh (the transformer through
        [`vidax_eqx.models.run_sharded`][]`(kv_cache=...)`: Ulysses over `sp`, Megatron
        over `tp`, the batch over `dp`, each cache split by heads; not a ring).
        """
        owner = f"{type(self).__name__}.stream"
        defaults = self.call_defaults
        height = defaults.height if height is None else height
        width = defaults.width if width is None else width
        num_frames = defaults.num_frames if num_frames is None else num_frames
        length = defaults.max_sequence_length if max_sequence_length is None else max_sequence_length
        if output_type not in ("np", "latent"):
            raise ValueError(f"{owner}: `output_type` must be 'np' or 'latent'; received "
                             f"{output_type!r}.")
        grid = self.check_size(height, width, num_frames)
        self._plan_for_call(height, width, num_frames)
        max_cached_frames, scheduler, steps = self.check_stream(
            grid, chunk_frames=chunk_frames, max_cached_frames=max_cached_frames, window=window,
            scheduler=scheduler, num_inference_steps=num_inference_steps)
        n = check_int(owner, "num_videos_per_prompt", num_videos_per_prompt, 1)
        guided = sampling.Guidance(scale=guidance_scale).guided
        with self._residency.stage(self, "text"):
            context, negative = self._residency.to_device(self.text_context(
                prompt, negative_prompt, prompt_embeds, negative_prompt_embeds, guided=guided,
                num_videos_per_prompt=n, max_sequence_length=length))
        key = jax.random.key(check_int(owner, "seed", seed, 0))
        model_kwargs = {**model_kwargs, **self.model_arguments(context.shape[0], family)}
        if latents is not None:
            latents = jnp.asarray(latents, jnp.float32)
            shape = self.latent_shape(context.shape[0], grid)
            if latents.shape != shape:
                raise ValueError(f"{owner}: `latents` must be the video's initial latents "
                                 f"{self.latent_layout} = {shape}; received shape {latents.shape}.")
        chunks = stream_video(self, context=context, negative=negative, grid=grid,
                            chunk_frames=chunk_frames, max_cached_frames=max_cached_frames,
                            window=window, scheduler=scheduler, steps=steps,
                            guidance_scale=guidance_scale, key=key, latents=latents,
                            output_type=output_type, model_kwargs=model_kwargs)
        # The chunks alternate the transformer and the VAE: both on the device while it runs.
        return self._residency.resident(self, ("denoise", "decode"), chunks)

    def check_stream(self, grid, *, chunk_frames: int = 3, max_cached_frames: int | None = None,
                     window: int | None = None, scheduler=None,
                     num_inference_steps: int | None = None) -> tuple:
        """[`stream`][vidax_eqx.pipelines.WanPipeline.stream]'s checks of its keywords for a
        video of latent `grid` (`check_size`'s) against the transformer's config and
        capabilities (`chunk_frames` divides the latent frames, `max_cached_frames` is a
        multiple of it, the RoPE tables reach every frame, the transformer streams and is
        text-to-video): `(max_cached_frames, scheduler, num_inference_steps)` with their
        defaults. Reads no weight: `vidax-generate` runs it on the folder's configs before
        loading."""
        return check_stream_arguments(f"{type(self).__name__}.stream", self, grid, chunk_frames,
                                      max_cached_frames, window, scheduler, num_inference_steps)

    def decode(self, latents) -> np.ndarray:
        videos = []
        for z in latents:
            z = self.vae.denormalize_latents(jnp.asarray(z, dtype_of(self.vae)))
            videos.append(interop.video_to_frames(self._vae_call("decode", z)))
        return np.stack(videos)

    def _vae_call(self, method: str, x):
        return vae_call(self.vae, self.mesh, method, x)


@eqx.filter_jit
def _encode_image(encoder, pixels):
    return jax.vmap(encoder.penultimate_hidden_states)(pixels)
