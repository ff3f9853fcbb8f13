"""`CogVideoXPipeline`: prompt (and image) to video with CogVideoX 1.0, diffusers'
`CogVideoXPipeline` and `CogVideoXImageToVideoPipeline` in one class, without PyTorch."""


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


_CLASSES = ("CogVideoXPipeline", "CogVideoXImageToVideoPipeline")
_OWNER = "CogVideoXPipeline"
# What `seed` draws besides the initial latents: the streams folded into its key.
_POSTERIOR_STREAM, _SCHEDULER_STREAM = 1, 2


def _nearest(value: int, multiple: int, offset: int) -> str:
    """The sizes `offset + k * multiple` (k >= 0, at least `multiple` for offset 0)
    just below and above `value`, as text."""
    lower = (value - offset) // multiple * multiple + offset
    sizes = sorted({max(lower, offset or multiple), lower + multiple})
    return " or ".join(str(v) for v in sizes)


class CogVideoXPipeline:
    """CogVideoX 1.0 (2B, 5B) text-to-video and image-to-video, from a diffusers pipeline
    folder: tokenizer, T5 v1.1 text encoder, transformer, VAE and scheduler; every stage
    compiled, and sharded over a mesh when one is given.

        pipe = CogVideoXPipeline.from_pretrained("THUDM/CogVideoX-2b")
        out = pipe("A panda plays a guitar in a bamboo forest", num_inference_steps=50,
                   guidance_scale=6.0, seed=0)
        save_video(out.frames[0], "panda.mp4", fps=8)

    The call takes diffusers' keyword names and reproduces its numbers from the same
    initial latents (`latents=`): the prompt tokenized to `max_sequence_length` (226)
    tokens and encoded as diffusers does it for CogVideoX (no prompt cleaning, no
    attention mask: the encoder sees the padding, and its output there is kept), cast to
    the transformer's dtype; the negative prompt (default `""`) when `guidance_scale > 1`;
    the scheduler of the folder's `scheduler_config.json` (`CogVideoXDDIM` or
    `CogVideoXDPM`); the latents in diffusers' layout `(B, F, C, h, w)`, scaled by the
    scheduler's `init_noise_sigma` (1 for both); the positional information (the 2B's
    sin-cos embedding, the 5B's 3D RoPE with the pipeline's crop region, 5B-I2V's learned
    embedding) computed by the transformer itself; for I2V the image's VAE latents
    (one frame, times the VAE's `scaling_factor`) followed by zero frames, concatenated
    to the latents' channels at every step; the final latents divided by the
    `scaling_factor` and decoded in the VAE's chunks of frames; frames in [0, 1].

    **Randomness.** diffusers draws three things from its `generator`: the initial
    latents, the I2V image's latents (a sample of the VAE's posterior, not its mean:
    `retrieve_latents` with `sample_mode="sample"`) and `CogVideoXDPMScheduler`'s noise in
    every step. Here `seed` draws them from `jax.random.key(seed)`: the latents from the
    key itself, the posterior sample from `fold_in(key, 1)`, the DPM steps from
    `fold_in(key, 2)` (as [`vidax_eqx.sampling.sample`][]'s `key=`). A diffusers run is
    reproduced by passing its initial `latents` and, for I2V, its `image_latents`; the
    DPM scheduler's noise cannot be (use `CogVideoXDDIM`, the 2B's default, for parity).

    **Differences from diffusers, on purpose.** Where diffusers rounds a size down or
    fails later (a `height` or `width` that the VAE and patch size do not divide, a
    `num_frames - 1` that is not a multiple of 4), this raises, naming the sizes that
    work; so it does for a `num_frames` whose latent frame count is even, which
    diffusers' VAE decodes to `4 F` frames instead of `num_frames` (13 frames give 16):
    `num_frames` is `1 + 8k` (49 is CogVideoX's). A transformer with a positional
    embedding (2B, 5B-I2V) needs `max_sequence_length` equal to its
    `max_text_seq_length` (diffusers fails on a shape mismatch). diffusers ignores
    `num_videos_per_prompt` (its call sets it to 1); here it repeats each prompt's
    embeddings, and a single I2V image serves every video of the batch. CogVideoX 1.5
    (`patch_size_t`, `ofs_embed_dim`) is refused when the transformer loads.

    **Attributes:** `tokenizer` ([`vidax_eqx.interop.TextTokenizer`][]), `text_encoder`
    ([`vidax_eqx.models.T5Encoder`][]), `transformer`
    ([`vidax_eqx.models.CogVideoXTransformer3D`][]), `vae`
    ([`vidax_eqx.models.CogVideoXVAE`][]), `scheduler` (a scheduler of
    [`vidax_eqx.sampling`][]), `mesh`.
    """

    def __init__(self, *, tokenizer, text_encoder, transformer, vae, scheduler, mesh=None,
                 batch_axis=None, cfg_axis=None):
        """**Arguments:** the components (see the class's attributes); `tokenizer` and
        `text_encoder` may be `None` for calls with `prompt_embeds`.

        - `mesh`: run sharded: the transformer must have been placed on it (its
            `ParallelConfig`); the VAE splits frames over two of its axes.
        - `batch_axis`, `cfg_axis`: [`vidax_eqx.sampling.sample`][]'s (default: `"dp"`
            and `"cfg"` when the mesh has them with more than one device).
        """
        self.tokenizer, self.text_encoder = tokenizer, text_encoder
        self.transformer, self.vae, self.scheduler = transformer, vae, scheduler
        self.mesh = mesh
        sizes = {} if mesh is None else dict(mesh.shape)
        self.batch_axis = batch_axis if batch_axis is not None else (
            "dp" if sizes.get("dp", 1) > 1 else None)
        self.cfg_axis = cfg_axis if cfg_axis is not None else (
            "cfg" if sizes.get("cfg", 1) > 1 else None)
        config = transformer.config
        if config.out_channels != vae.z_dim:
            raise ValueError(
                f"{_OWNER}: the transformer's out_channels ({config.out_channels}) must be the "
                f"VAE's latent_channels ({vae.z_dim}): they are not one pipeline's.")
        if config.in_channels not in (config.out_channels, 2 * config.out_channels):
            raise ValueError(
                f"{_OWNER}: the transformer's in_channels must be its out_channels "
                f"({config.out_channels}, text-to-video) or twice them (image-to-video: the "
                f"latents and the image's); received {config.in_channels}.")
        if text_encoder is not None and text_encoder.config.d_model != config.text_embed_dim:
            raise ValueError(
                f"{_OWNER}: the text encoder's width d_model ({text_encoder.config.d_model}) "
                f"must be the transformer's text_embed_dim ({config.text_embed_dim}): they "
                "are not one pipeline's.")

    # -- loading ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path, *, dtype=None, text_encoder_dtype=None,
                        vae_dtype=jnp.float32, mesh=None, parallel=None, scheduler=None,
                        revision: str | None = None, cache_dir=None) -> "CogVideoXPipeline":
        """A pipeline folder saved by diffusers' `CogVideoXPipeline` or
        `CogVideoXImageToVideoPipeline` (`save_pretrained`), or a Hub repository of one
        (`"THUDM/CogVideoX-5b"`; only JSON, safetensors and tokenizer files are fetched).

        **Arguments:**

        - `path`: the folder or Hub repository id.
        - `dtype`: the transformer's parameters' dtype (default the checkpoint's); also
            the text encoder's unless `text_encoder_dtype` is given.
        - `text_encoder_dtype`: the T5 encoder's dtype (default `dtype`, or float32).
        - `vae_dtype`: the VAE's (default float32).
        - `mesh`: a mesh with the library's axis names (`dp`, `sp`, `tp`, `cfg`:
            [`vidax_eqx.parallel.make_mesh`][]): the transformer loads straight into its
            sharded layout (`parallel`, default Ulysses over `sp` and Megatron over
            `tp`); the VAE splits each frame over the mesh.
        - `parallel`: the transformer's [`vidax_eqx.nn.sharding.ParallelConfig`][]
            (with `mesh`).
        - `scheduler`: a scheduler of [`vidax_eqx.sampling`][] instead of the folder's
            `scheduler/scheduler_config.json`.
        - `revision`, `cache_dir`: for a Hub id.
        """
        folder = PipelineFolder(path, owner=_OWNER, classes=_CLASSES, revision=revision,
                                cache_dir=cache_dir)
        if parallel is None:
            parallel = parallel_for(mesh)
        transformer = models.CogVideoXTransformer3D.from_pretrained(
            folder.path("transformer", needed_for="every call"), dtype=dtype,
            parallel=parallel, mesh=mesh)
        vae = models.CogVideoXVAE.from_pretrained(
            folder.path("vae", needed_for="decoding"), dtype=vae_dtype, mesh=mesh)
        if scheduler is None:
            scheduler = sampling.scheduler_from_config(
                folder.path("scheduler", needed_for="sampling (pass `scheduler=`)"))
        tokenizer = text_encoder = None
        if folder.has("tokenizer"):
            tokenizer = interop.TextTokenizer.from_pretrained(
                folder.path("tokenizer", needed_for="a prompt"))
        if folder.has("text_encoder"):
            text_encoder = load_text_encoder(folder.path("text_encoder", needed_for="a prompt"),
                                             dtype=text_encoder_dtype or dtype or jnp.float32,
                                             mesh=mesh)
        return cls(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer,
                   vae=vae, scheduler=scheduler, mesh=mesh)

    # -- what the components say --------------------------------------------------------

    @property
    def transformer_dtype(self) -> jnp.dtype:
        return dtype_of(self.transformer)

    @property
    def image_conditioned(self) -> bool:
        """Whether the transformer takes an image (I2V: `in_channels` twice
        `out_channels`)."""
        c = self.transformer.config
        return c.in_channels > c.out_channels

    @property
    def positional_text_length(self) -> int | None:
        """The text length a transformer with a positional embedding over `[text; video]`
        (2B's sin-cos, 5B-I2V's learned) requires: its `max_text_seq_length`; `None` for
        the 5B T2V (RoPE only), which takes any."""
        c = self.transformer.config
        if c.use_rotary_positional_embeddings and not c.use_learned_positional_embeddings:
            return None
        return c.max_text_seq_length

    def check_size(self, height, width, num_frames) -> tuple[int, int, int]:
        """The latent `(F, h, w)` of a `num_frames x height x width` video; a
        `ValueError` naming the nearest sizes that work when the VAE and the patch size do
        not divide them, when the VAE would decode another number of frames, or when a
        learned positional embedding (5B-I2V) fixes the size."""
        height = check_int(_OWNER, "height", height, 1)
        width = check_int(_OWNER, "width", width, 1)
        num_frames = check_int(_OWNER, "num_frames", num_frames, 1)
        config = self.transformer.config
        s, t, p = self.vae.spatial_factor, self.vae.temporal_factor, config.patch_size
        for name, value in (("height", height), ("width", width)):
            if value % (s * p):
                raise ValueError(
                    f"{_OWNER}: `{name}` must be a multiple of {s * p} (the VAE's spatial "
                    f"factor {s} x the patch size {p}); received {value}. Use "
                    f"{_nearest(value, s * p, 0)}.")
        if (num_frames - 1) % (2 * t):
            raise ValueError(
                f"{_OWNER}: `num_frames` must be 1 + a multiple of {2 * t}: 1 + a multiple of "
                f"the VAE's temporal factor {t}, with an odd number of latent frames "
                f"((num_frames - 1) / {t} + 1; the VAE decodes an even number F of them to "
                f"{t} F frames, not num_frames); received {num_frames}. Use "
                f"{_nearest(num_frames, 2 * t, 1)}.")
        if config.use_learned_positional_embeddings:
            expected = (config.sample_height * s, config.sample_width * s)
            if (height, width) != expected:
                raise ValueError(
                    f"{_OWNER}: this transformer's learned positional embedding "
                    f"(CogVideoX-5B-I2V) fixes the video's size to its training resolution, "
                    f"as in diffusers: (height, width) = {expected}; received "
                    f"{(height, width)}.")
        return (num_frames - 1) // t + 1, height // s, width // s

    def _check_text_length(self, name: str, length: int) -> None:
        expected = self.positional_text_length
        if expected is not None and length != expected:
            raise ValueError(
                f"{_OWNER}: `{name}` must be the transformer's max_text_seq_length "
                f"({expected}): its positional embedding covers that many text tokens "
                f"(diffusers fails on any other length); received {length}.")

    # -- stages -------------------------------------------------------------------------

    def encode_prompt(self, prompt, negative_prompt=None, *, do_classifier_free_guidance=True,
                      num_videos_per_prompt: int = 1, max_sequence_length: int = 226):
        """diffusers' `CogVideoXPipeline.encode_prompt`: `(prompt_embeds,
        negative_prompt_embeds)`, `(B * num_videos_per_prompt, max_sequence_length,
        text_dim)` in the text encoder's dtype; the negative `None` without guidance.
        The prompts are tokenized as they are (no cleaning), padded to
        `max_sequence_length` and encoded without an attention mask, so every position,
        padding included, holds the encoder's output (as in diffusers); the negative
        prompts are encoded in the same compiled call."""
        return encode_prompts(_OWNER, self, prompt, negative_prompt,
                              guided=do_classifier_free_guidance,
                              num_videos_per_prompt=num_videos_per_prompt,
                              max_sequence_length=max_sequence_length, clean=False,
                              masked=False)

    def encode_image(self, image, height: int, width: int, *, key=None) -> jax.Array:
        """The image's latents as diffusers' `CogVideoXImageToVideoPipeline.prepare_latents`
        makes them, `(1, 1, C, h, w)` float32: the image resized to `height x width`
        (Pillow's Lanczos, as diffusers resizes a PIL image), in [-1, 1], encoded by the
        VAE as a one-frame video, times the VAE's `scaling_factor` (divided by it with
        the VAE's `invert_scale_latents`, as diffusers).

        **Arguments:**

        - `image`: a PIL image or an `(H, W, 3)` array, uint8 or float in [0, 1].
        - `height`, `width`: the video's size.
        - `key`: a PRNG key: the latents are a sample of the VAE's posterior, as
            diffusers draws them with its `generator`; `None`: the posterior's mean.
        """
        pixels = interop.frames_to_video(image_array(_OWNER, "image", image)[None], size=(height, width))
        video = jnp.asarray(pixels, dtype_of(self.vae))
        dist = self._vae_call("encode", video)
        latents = dist.mode() if key is None else dist.sample(key)
        latents = latents.astype(jnp.float32)
        factor = self.vae.scaling_factor
        latents = latents / factor if self.vae.config.invert_scale_latents else latents * factor
        return jnp.transpose(latents, (1, 0, 2, 3))[None]

    @staticmethod
    def prepare_condition(image_latents, num_frames: int, batch: int) -> jax.Array:
        """The image conditioning as [`vidax_eqx.sampling.sample`][] takes it
        (`condition=`), diffusers' padded `image_latents`: the image's latents
        `(1 or batch, 1, C, h, w)` followed by zero frames up to the `num_frames` latent
        frames, `(batch, num_frames, C, h, w)`."""
        latents = jnp.asarray(image_latents, jnp.float32)
        pad = jnp.zeros((latents.shape[0], num_frames - latents.shape[1], *latents.shape[2:]),
                        latents.dtype)
        latents = jnp.concatenate([latents, pad], axis=1)
        return jnp.broadcast_to(latents, (batch, *latents.shape[1:]))

    def decode(self, latents) -> np.ndarray:
        """diffusers' `decode_latents` and `postprocess_video(output_type="np")`: the
        latents `(B, F, C, h, w)` divided by the VAE's `scaling_factor`, decoded one video
        at a time (in the VAE's chunks of frames, split over the mesh), `(B, 4 (F - 1) +
        1, H, W, 3)` float32 in [0, 1]."""
        videos = []
        for z in latents:
            z = jnp.transpose(jnp.asarray(z, dtype_of(self.vae)), (1, 0, 2, 3))
            z = self.vae.denormalize_latents(z)
            videos.append(interop.video_to_frames(self._vae_call("decode", z)))
        return np.stack(videos)

    def _vae_call(self, method: str, x):
        return vae_call(self.vae, self.mesh, method, x)

    # -- the call -----------------------------------------------------------------------

    def __call__(self, prompt=None, negative_prompt=None, *, image=None, height: int = 480,
                 width: int = 720, num_frames: int = 49, num_inference_steps: int = 50,
                 guidance_scale: float = 6.0, use_dynamic_cfg: bool = False,
                 num_videos_per_prompt: int = 1, seed: int = 0, latents=None,
                 prompt_embeds=None, negative_prompt_embeds=None, image_latents=None,
                 output_type: str = "np", max_sequence_length: int = 226,
                 progress: bool = True, report=None, **sample_kwargs) -> PipelineOutput:
        """Generates videos: text (and image) encoding, the denoising loop and the decode,
        each compiled.

        **Arguments** (diffusers' names and defaults):

        - `prompt`, `negative_prompt`: a str or a list (one video per prompt and
            `num_videos_per_prompt`); the negative prompt is used when
            `guidance_scale > 1` (default `""`), one str for all or one per prompt.
        - `image`: image-to-video: the first frame (a PIL image or an `(H, W, 3)` array,
            uint8 or float in [0, 1]), resized to `height x width`. Required by an I2V
            transformer, refused by a T2V one.
        - `height`, `width`, `num_frames`: the video's size (480 x 720, 49 frames:
            CogVideoX's; see the class's note).
        - `num_inference_steps`, `guidance_scale`; `use_dynamic_cfg`: CogVideoX's
            cosine guidance schedule (diffusers' expression, as
            [`vidax_eqx.sampling.sample`][] computes it).
        - `seed`: the initial latents are `jax.random.normal(jax.random.key(seed),
            (B, F, C, h, w), float32)` (the image's posterior sample and the DPM
            scheduler's noise come from keys folded from it: see the class's note); or
            `latents`: those latents, e.g. diffusers' own draw, to reproduce a diffusers
            run.
        - `prompt_embeds`, `negative_prompt_embeds`: `(B, L, text_dim)` embeddings instead
            of `prompt` / `negative_prompt`.
        - `image_latents`: the image's scaled latents instead of encoding `image`:
            `(1 or B, 1, C, h, w)` (the encoded frame, as
            [`encode_image`][vidax_eqx.pipelines.CogVideoXPipeline.encode_image] returns
            it) or `(1 or B, F, C, h, w)` (diffusers' padded `image_latents`); with them
            `image` may be left out.
        - `output_type`: `"np"` (frames) or `"latent"` (no decode).
        - `max_sequence_length`: the prompt's token length (226).
        - `progress`: a progress bar over the steps (tqdm, on a terminal).
        - `report`: called as `report(stage, seconds)` after each stage.
        - `**sample_kwargs`: further [`vidax_eqx.sampling.sample`][] options
            (`max_steps`, `remat`, ...; `key` replaces the DPM scheduler's key).

        **Returns:**

        A [`PipelineOutput`][vidax_eqx.pipelines.PipelineOutput]: `frames` `(B, F, H,
        W, 3)` in [0, 1], the final `latents` in CogVideoX's layout `(B, F_lat, C, h,
        w)`, the stage `timings`.
        """
        if output_type not in ("np", "latent"):
            raise ValueError(f"{_OWNER}: `output_type` must be 'np' or 'latent'; received "
                             f"{output_type!r}.")
        config = self.transformer.config
        f, h, w = self.check_size(height, width, num_frames)
        n = check_int(_OWNER, "num_videos_per_prompt", num_videos_per_prompt, 1)
        seed_key = jax.random.key(check_int(_OWNER, "seed", seed, 0))
        guided = guidance_scale > 1
        if (image is not None or image_latents is not None) and not self.image_conditioned:
            raise ValueError(
                f"{_OWNER}: `image` is for an image-to-video transformer; this pipeline's is "
                f"text-to-video (in_channels {config.in_channels} = out_channels). Load an "
                f"I2V pipeline (CogVideoXImageToVideoPipeline's folder, e.g. "
                f"THUDM/CogVideoX-5b-I2V).")
        if self.image_conditioned and image is None and image_latents is None:
            raise ValueError(
                f"{_OWNER}: this pipeline's transformer is image-to-video (in_channels "
                f"{config.in_channels} = {config.out_channels} latents + "
                f"{config.in_channels - config.out_channels} image latents): pass `image`.")
        timer = StageTimer(report)
        dtype = self.transformer_dtype

        with timer("text"):
            if prompt_embeds is None:
                if negative_prompt_embeds is not None:
                    raise ValueError(f"{_OWNER}: `negative_prompt_embeds` goes with "
                                     "`prompt_embeds`; pass `negative_prompt` with `prompt`.")
                self._check_text_length("max_sequence_length", max_sequence_length)
                context, negative = self.encode_prompt(
                    prompt, negative_prompt, do_classifier_free_guidance=guided,
                    num_videos_per_prompt=n, max_sequence_length=max_sequence_length)
            else:
                context, negative = given_embeddings(
                    _OWNER, prompt, negative_prompt, prompt_embeds, negative_prompt_embeds,
                    guided=guided, num_videos_per_prompt=n)
                self._check_text_length("prompt_embeds.shape[1]", context.shape[1])
            context = jax.block_until_ready(context.astype(dtype))
            negative = None if not guided or negative is None else negative.astype(dtype)
        batch = context.shape[0]

        kwargs = dict(sample_kwargs)
        condition = None
        if self.image_conditioned:
            with timer("image"):
                if image_latents is None:
                    image_latents = self.encode_image(
                        image, height, width, key=jax.random.fold_in(seed_key, _POSTERIOR_STREAM))
                image_latents = jnp.asarray(image_latents, jnp.float32)
                c = config.out_channels
                if (image_latents.ndim != 5 or image_latents.shape[0] not in (1, batch)
                        or image_latents.shape[1] not in (1, f)
                        or image_latents.shape[2:] != (c, h, w)):
                    first = "1" if batch == 1 else f"1 or {batch}"
                    raise ValueError(
                        f"{_OWNER}: `image_latents` must be ({first}, 1 or {f}, {c}, {h}, {w}) "
                        f"(the image's frame, or diffusers' padded image_latents) for "
                        f"{batch} videos of {num_frames} x {height} x {width}; received shape "
                        f"{image_latents.shape}.")
                condition = jax.block_until_ready(self.prepare_condition(image_latents, f, batch))

        shape = (batch, f, config.out_channels, h, w)
        if latents is None:
            noise = jax.random.normal(seed_key, shape, jnp.float32)
        else:
            noise = jnp.asarray(latents, jnp.float32)
            if noise.shape != shape:
                raise ValueError(
                    f"{_OWNER}: `latents` must be the initial latents (B, F, C, h, w) = "
                    f"{shape} for {batch} videos of {num_frames} x {height} x {width}; "
                    f"received shape {noise.shape}.")
        # diffusers scales the latents by the scheduler's `init_noise_sigma`, 1.0 for both
        # CogVideoX schedulers.
        if self.scheduler.stochastic:
            kwargs.setdefault("key", jax.random.fold_in(seed_key, _SCHEDULER_STREAM))

        with timer("denoise"):
            out = sampling.sample(
                self.transformer, noise, context, negative_context=negative,
                guidance_scale=guidance_scale, steps=num_inference_steps,
                scheduler=self.scheduler, mesh=self.mesh, batch_axis=self.batch_axis,
                cfg_axis=self.cfg_axis if guided else None, use_dynamic_cfg=use_dynamic_cfg,
                progress=progress, condition=condition, **kwargs)
            out = np.asarray(jax.device_get(jax.block_until_ready(out)), np.float32)
        frames = None
        if output_type == "np":
            with timer("decode"):
                frames = self.decode(out)
        return PipelineOutput(frames=frames, latents=out, timings=dict(timer.timings))
