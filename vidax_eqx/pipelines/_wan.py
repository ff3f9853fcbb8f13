"""`WanPipeline`: prompt (and image) to video with Wan 2.1 / 2.2, diffusers' `WanPipeline`
and `WanImageToVideoPipeline` in one class, without PyTorch."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import interop, models, sampling
from ._common import (
    check_int, dtype_of, encode_prompts, given_embeddings, image_array, load_text_encoder,
    parallel_for, vae_call,
)
from ._folder import PipelineFolder
from ._output import PipelineOutput, StageTimer


_CLASSES = ("WanPipeline", "WanImageToVideoPipeline")
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


class WanPipeline:
    """Wan 2.1 / 2.2 text-to-video and image-to-video, from a diffusers pipeline folder:
    tokenizer, UMT5 text encoder, transformer (or Wan 2.2 A14B's two experts), VAE,
    scheduler and, for Wan 2.1 I2V / FLF2V, the CLIP image encoder; every stage compiled,
    and sharded over a mesh when one is given.

        pipe = WanPipeline.from_pretrained("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
        out = pipe("A cat walks on the grass", negative_prompt="blurry", height=480,
                   width=832, num_frames=81, guidance_scale=5.0, seed=0)
        save_video(out.frames[0], "cat.mp4", fps=16)

    The call takes diffusers' keyword names and reproduces its numbers from the same
    initial latents (`latents=`): the prompt cleaned, tokenized and encoded, zeroed past
    its length and cast to the transformer's dtype; the negative prompt (default `""`)
    when `guidance_scale > 1`; the scheduler of the folder's `scheduler_config.json`; for
    I2V the image's CLIP features (the penultimate layer's) and its VAE latents beside
    diffusers' mask; the latents denormalized and decoded; frames in [0, 1].

    Where diffusers rounds a size down with a warning (a `height` or `width` that the VAE
    and patch size do not divide, a `num_frames - 1` that is not a multiple of 4), this
    raises, naming the sizes that work.

    **Attributes:** `tokenizer` ([`vidax_eqx.interop.TextTokenizer`][]), `text_encoder`
    ([`vidax_eqx.models.T5Encoder`][]), `transformer`
    ([`vidax_eqx.models.WanTransformer3D`][] or [`vidax_eqx.models.WanExperts`][]),
    `vae` ([`vidax_eqx.models.WanVAE`][]), `scheduler` (a scheduler of
    [`vidax_eqx.sampling`][]), `image_encoder` and `image_processor` (or `None`),
    `expand_timesteps` (Wan 2.2 TI2V), `mesh`.
    """

    def __init__(self, *, tokenizer, text_encoder, transformer, vae, scheduler,
                 image_encoder=None, image_processor=None, expand_timesteps: bool = False,
                 mesh=None, batch_axis=None, cfg_axis=None):
        """**Arguments:** the components (see the class's attributes); `tokenizer` and
        `text_encoder` may be `None` for calls with `prompt_embeds`, `image_encoder` and
        `image_processor` for T2V or a model without an image branch.

        - `expand_timesteps`: Wan 2.2 TI2V's image conditioning (the image's latents
            replace the first latent frame; `model_index.json`'s `expand_timesteps`).
        - `mesh`: run sharded: the transformer must have been placed on it (its
            `ParallelConfig`); the VAE splits frames over two of its axes.
        - `batch_axis`, `cfg_axis`: [`vidax_eqx.sampling.sample`][]'s (default: `"dp"`
            and `"cfg"` when the mesh has them with more than one device).
        """
        self.tokenizer, self.text_encoder = tokenizer, text_encoder
        self.transformer, self.vae, self.scheduler = transformer, vae, scheduler
        self.image_encoder, self.image_processor = image_encoder, image_processor
        self.expand_timesteps = bool(expand_timesteps)
        self.mesh = mesh
        sizes = {} if mesh is None else dict(mesh.shape)
        self.batch_axis = batch_axis if batch_axis is not None else (
            "dp" if sizes.get("dp", 1) > 1 else None)
        self.cfg_axis = cfg_axis if cfg_axis is not None else (
            "cfg" if sizes.get("cfg", 1) > 1 else None)
        config = self.transformer_config
        if config.out_channels != vae.config.z_dim:
            raise ValueError(
                f"WanPipeline: the transformer's out_channels ({config.out_channels}) must be "
                f"the VAE's z_dim ({vae.config.z_dim}): they are not one pipeline's.")

    # -- loading ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path, *, dtype=None, text_encoder_dtype=None,
                        vae_dtype=jnp.float32, mesh=None, parallel=None, scheduler=None,
                        revision: str | None = None, cache_dir=None) -> "WanPipeline":
        """A pipeline folder saved by diffusers' `WanPipeline` or `WanImageToVideoPipeline`
        (`save_pretrained`), or a Hub repository of one (`"Wan-AI/Wan2.1-T2V-14B-Diffusers"`;
        only JSON, safetensors and tokenizer files are fetched).

        **Arguments:**

        - `path`: the folder or Hub repository id.
        - `dtype`: the transformer's parameters' dtype (default the checkpoint's);
            also the text and image encoders' unless `text_encoder_dtype` is given.
        - `text_encoder_dtype`: the UMT5 and CLIP encoders' dtype (default `dtype`, or
            float32).
        - `vae_dtype`: the VAE's (default float32, as diffusers' Wan examples load it).
        - `mesh`: a mesh with the library's axis names (`dp`, `sp`, `tp`, `cfg`:
            [`vidax_eqx.parallel.make_mesh`][]): the transformer loads straight into its
            sharded layout (`parallel`, default Ulysses over `sp` and Megatron over
            `tp`), the encoders and the VAE are placed on it.
        - `parallel`: the transformer's [`vidax_eqx.nn.sharding.ParallelConfig`][]
            (with `mesh`).
        - `scheduler`: a scheduler of [`vidax_eqx.sampling`][] instead of the folder's
            `scheduler/scheduler_config.json`.
        - `revision`, `cache_dir`: for a Hub id.
        """
        folder = PipelineFolder(path, owner="WanPipeline", classes=_CLASSES,
                                revision=revision, cache_dir=cache_dir)
        if parallel is None:
            parallel = parallel_for(mesh)
        encoder_dtype = text_encoder_dtype or dtype or jnp.float32
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
        if scheduler is None:
            scheduler = sampling.scheduler_from_config(
                folder.path("scheduler", needed_for="sampling (pass `scheduler=`)"))
        tokenizer = text_encoder = image_encoder = image_processor = None
        if folder.has("tokenizer"):
            tokenizer = interop.TextTokenizer.from_pretrained(
                folder.path("tokenizer", needed_for="a prompt"))
        if folder.has("text_encoder"):
            text_encoder = load_text_encoder(folder.path("text_encoder", needed_for="a prompt"),
                                             dtype=encoder_dtype, mesh=mesh)
        if folder.has("image_encoder"):
            image_encoder = models.CLIPVisionEncoder.from_pretrained(
                folder.path("image_encoder", needed_for="an image"), dtype=encoder_dtype)
            image_processor = models.CLIPImageProcessor.from_pretrained(
                folder.path("image_processor", needed_for="an image"))
        return cls(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer,
                   vae=vae, scheduler=scheduler, image_encoder=image_encoder,
                   image_processor=image_processor,
                   expand_timesteps=folder.config("expand_timesteps", False), mesh=mesh)

    # -- what the components say --------------------------------------------------------

    @property
    def transformer_config(self):
        """The (first) transformer's `WanConfig`."""
        t = self.transformer
        return t.high_noise.config if isinstance(t, models.WanExperts) else t.config

    @property
    def transformer_dtype(self) -> jnp.dtype:
        return dtype_of(self.transformer)

    @property
    def image_conditioned(self) -> bool:
        """Whether the transformer takes an image: I2V / FLF2V (condition channels) or
        Wan 2.2 TI2V (`expand_timesteps`, image optional)."""
        c = self.transformer_config
        return c.in_channels > c.out_channels or self.expand_timesteps

    def check_size(self, height, width, num_frames) -> tuple[int, int, int]:
        """The latent `(F, h, w)` of a `num_frames x height x width` video; a
        `ValueError` naming the nearest sizes that work when the VAE and the patch size do
        not divide them."""
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

    # -- stages -------------------------------------------------------------------------

    def encode_prompt(self, prompt, negative_prompt=None, *, do_classifier_free_guidance=True,
                      num_videos_per_prompt: int = 1, max_sequence_length: int = 512):
        """diffusers' `WanPipeline.encode_prompt`: `(prompt_embeds, negative_prompt_embeds)`,
        `(B * num_videos_per_prompt, max_sequence_length, text_dim)` in the text
        encoder's dtype, each row zero past its prompt's tokens; the negative `None`
        without guidance. The prompts are cleaned ([`vidax_eqx.interop.prompt_clean`][])
        and encoded in one compiled call (the negative ones with them)."""
        return encode_prompts(_OWNER, self, prompt, negative_prompt,
                              guided=do_classifier_free_guidance,
                              num_videos_per_prompt=num_videos_per_prompt,
                              max_sequence_length=max_sequence_length, clean=True, masked=True)

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

    def decode(self, latents) -> np.ndarray:
        """diffusers' decode and `postprocess_video(output_type="np")`: `(B, F, H, W, 3)`
        float32 in [0, 1], one video at a time through the VAE (split over the mesh)."""
        videos = []
        for z in latents:
            z = self.vae.denormalize_latents(jnp.asarray(z, dtype_of(self.vae)))
            videos.append(interop.video_to_frames(self._vae_call("decode", z)))
        return np.stack(videos)

    def _vae_call(self, method: str, x):
        return vae_call(self.vae, self.mesh, method, x)

    # -- the call -----------------------------------------------------------------------

    def __call__(self, prompt=None, negative_prompt=None, *, image=None, last_image=None,
                 height: int = 480, width: int = 832, num_frames: int = 81,
                 num_inference_steps: int = 50, guidance_scale: float = 5.0,
                 guidance_scale_2: float | None = None, num_videos_per_prompt: int = 1,
                 seed: int = 0, latents=None, prompt_embeds=None, negative_prompt_embeds=None,
                 image_embeds=None, output_type: str = "np", max_sequence_length: int = 512,
                 progress: bool = True, report=None, **sample_kwargs) -> PipelineOutput:
        """Generates videos: text (and image) encoding, the denoising loop and the decode,
        each compiled.

        **Arguments** (diffusers' names and defaults):

        - `prompt`, `negative_prompt`: a str or a list (one video per prompt and
            `num_videos_per_prompt`); the negative prompt is used when
            `guidance_scale > 1` (default `""`), one str for all or one per prompt.
        - `image`: image-to-video: the first frame (a PIL image or an `(H, W, 3)` array,
            uint8 or float in [0, 1]), resized to `height x width` with Lanczos as
            diffusers does. Required by an I2V / FLF2V transformer, optional for Wan 2.2
            TI2V, refused by a T2V one. `last_image`: FLF2V's last frame.
        - `height`, `width`, `num_frames`: the video's size (see the class's note).
        - `num_inference_steps`, `guidance_scale`, `guidance_scale_2` (Wan 2.2 A14B's
            low-noise expert; default `guidance_scale`).
        - `seed`: the initial latents are `jax.random.normal(jax.random.key(seed),
            (B, z, F, h, w), float32)`; or `latents`: those latents, e.g. diffusers' own
            draw, to reproduce a diffusers run.
        - `prompt_embeds`, `negative_prompt_embeds`: `(B, L, text_dim)` embeddings instead
            of `prompt` / `negative_prompt`; `image_embeds`: CLIP features
            `(1 or B, L_img, image_dim)` instead of encoding `image`.
        - `output_type`: `"np"` (frames) or `"latent"` (no decode).
        - `max_sequence_length`: the prompt's token length (512).
        - `progress`: a progress bar over the steps (tqdm, on a terminal).
        - `report`: called as `report(stage, seconds)` after each stage.
        - `**sample_kwargs`: further [`vidax_eqx.sampling.sample`][] options
            (`step_cache`, `max_steps`, ...).

        **Returns:**

        A [`PipelineOutput`][vidax_eqx.pipelines.PipelineOutput]: `frames` `(B, F, H,
        W, 3)` in [0, 1], the final `latents`, the stage `timings`.
        """
        if output_type not in ("np", "latent"):
            raise ValueError(f"WanPipeline: `output_type` must be 'np' or 'latent'; received "
                             f"{output_type!r}.")
        config = self.transformer_config
        f, h, w = self.check_size(height, width, num_frames)
        guided = guidance_scale > 1
        timer = StageTimer(report)
        dtype = self.transformer_dtype

        with timer("text"):
            if prompt_embeds is None:
                n = num_videos_per_prompt
                if negative_prompt_embeds is not None:
                    raise ValueError(f"{_OWNER}: `negative_prompt_embeds` goes with "
                                     "`prompt_embeds`; pass `negative_prompt` with `prompt`.")
                context, negative = self.encode_prompt(
                    prompt, negative_prompt, do_classifier_free_guidance=guided,
                    num_videos_per_prompt=n, max_sequence_length=max_sequence_length)
            else:
                context, negative = given_embeddings(
                    _OWNER, prompt, negative_prompt, prompt_embeds, negative_prompt_embeds,
                    guided=guided, num_videos_per_prompt=num_videos_per_prompt)
            context = jax.block_until_ready(context.astype(dtype))
            negative = None if not guided or negative is None else negative.astype(dtype)
        batch = context.shape[0]

        kwargs = dict(sample_kwargs)
        condition = None
        if image is None and last_image is not None:
            raise ValueError(f"{_OWNER}: `last_image` (FLF2V) needs `image`, the first frame.")
        if last_image is not None and num_frames < 2:
            raise ValueError(f"{_OWNER}: `last_image` needs a video of at least 2 frames (the "
                             f"first and the last); received num_frames={num_frames}.")
        if image is not None or image_embeds is not None:
            if not self.image_conditioned:
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
        if image is not None:
            with timer("image"):
                if config.image_dim is not None:
                    if last_image is not None and config.pos_embed_seq_len is None:
                        raise ValueError(
                            "WanPipeline: `last_image` needs an FLF2V transformer (its "
                            "`pos_embed_seq_len` positions the two images' CLIP tokens); "
                            "this I2V transformer takes one image.")
                    features = (self.encode_image(image, last_image) if image_embeds is None
                                else jnp.asarray(image_embeds))
                    if features.ndim != 3 or features.shape[0] not in (1, batch):
                        raise ValueError(
                            f"WanPipeline: `image_embeds` must be (1 or {batch}, L_img, "
                            f"image_dim); received shape {features.shape}.")
                    kwargs["context_image"] = jnp.broadcast_to(
                        features, (batch, *features.shape[1:])).astype(dtype)
                condition = jax.block_until_ready(self.prepare_condition(
                    image, last_image, height, width, num_frames, batch))

        shape = (batch, config.out_channels, f, h, w)
        if latents is None:
            noise = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
        else:
            noise = jnp.asarray(latents, jnp.float32)
            if noise.shape != shape:
                raise ValueError(
                    f"WanPipeline: `latents` must be the initial latents (B, z, F, h, w) = "
                    f"{shape} for {batch} videos of {num_frames} x {height} x {width}; "
                    f"received shape {noise.shape}.")

        with timer("denoise"):
            out = sampling.sample(
                self.transformer, noise, context, negative_context=negative,
                guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2,
                steps=num_inference_steps, scheduler=self.scheduler, mesh=self.mesh,
                batch_axis=self.batch_axis, cfg_axis=self.cfg_axis if guided else None,
                progress=progress, condition=condition, **kwargs)
            out = np.asarray(jax.device_get(jax.block_until_ready(out)), np.float32)
        frames = None
        if output_type == "np":
            with timer("decode"):
                frames = self.decode(out)
        return PipelineOutput(frames=frames, latents=out, timings=dict(timer.timings))


@eqx.filter_jit
def _encode_image(encoder, pixels):
    return jax.vmap(encoder.penultimate_hidden_states)(pixels)
