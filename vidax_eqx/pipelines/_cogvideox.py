"""`CogVideoXPipeline`: prompt (and image) to video with CogVideoX 1.0, diffusers'
`CogVideoXPipeline` and `CogVideoXImageToVideoPipeline` in one class, without PyTorch."""


import jax
import jax.numpy as jnp
import numpy as np

from .. import interop, models
from ._common import check_int, dtype_of, image_array, vae_call
from ._pipeline import AbstractVideoPipeline, CallDefaults


_OWNER = "CogVideoXPipeline"
# What `seed` draws besides the initial latents (from the key itself) and a stochastic
# scheduler's noise (the template's stream 2): the I2V posterior sample.
_POSTERIOR_STREAM = 1


def _nearest(value: int, multiple: int, offset: int) -> str:
    """The sizes `offset + k * multiple` (k >= 0, at least `multiple` for offset 0)
    just below and above `value`, as text."""
    lower = (value - offset) // multiple * multiple + offset
    sizes = sorted({max(lower, offset or multiple), lower + multiple})
    return " or ".join(str(v) for v in sizes)


class CogVideoXPipeline(AbstractVideoPipeline):
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

    Its defaults: 480 x 720, 49 frames, 50 steps, guidance 6.0, 226 tokens (the
    transformer's `max_text_seq_length` when it has a positional embedding over the
    text), 8 fps.

    **Attributes:** those of [`AbstractVideoPipeline`][vidax_eqx.pipelines.AbstractVideoPipeline]
    (`transformer`: a [`vidax_eqx.models.CogVideoXTransformer3D`][]; `vae`: a
    [`vidax_eqx.models.CogVideoXVAE`][]).
    """


    defaults = CallDefaults(height=480, width=720, num_frames=49, num_inference_steps=50,
                            guidance_scale=6.0, max_sequence_length=226, fps=8)
    pipeline_classes = ("CogVideoXPipeline", "CogVideoXImageToVideoPipeline")
    clean_prompts = False
    masked_text = False
    latent_layout = "(B, F, C, h, w)"

    def __init__(self, *, tokenizer, text_encoder, transformer, vae, scheduler, mesh=None,
                 batch_axis=None, cfg_axis=None):
        """**Arguments:** those of
        [`AbstractVideoPipeline`][vidax_eqx.pipelines.AbstractVideoPipeline]."""
        super().__init__(tokenizer=tokenizer, text_encoder=text_encoder,
                         transformer=transformer, vae=vae, scheduler=scheduler, mesh=mesh,
                         batch_axis=batch_axis, cfg_axis=cfg_axis)
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

    @classmethod
    def load_components(cls, folder, *, dtype, vae_dtype, encoder_dtype, parallel, mesh) -> dict:
        """The transformer and the VAE."""
        transformer = models.CogVideoXTransformer3D.from_pretrained(
            folder.path("transformer", needed_for="every call"), dtype=dtype,
            parallel=parallel, mesh=mesh)
        vae = models.CogVideoXVAE.from_pretrained(
            folder.path("vae", needed_for="decoding"), dtype=vae_dtype, mesh=mesh)
        return dict(transformer=transformer, vae=vae)

    # -- what the components say --------------------------------------------------------

    @property
    def transformer_config(self):
        """The transformer's `CogVideoXConfig`."""
        return self.transformer.config

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

    @property
    def fixed_text_length(self) -> int | None:
        return self.positional_text_length

    def check_size(self, height, width, num_frames) -> tuple[int, int, int]:
        """As [`check_size`][vidax_eqx.pipelines.AbstractVideoPipeline.check_size]; also
        raises when the VAE would decode another number of frames, or when a
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

    def latent_shape(self, batch: int, grid) -> tuple[int, ...]:
        """`(batch, F, C, h, w)`, diffusers' CogVideoX layout."""
        f, h, w = grid
        return (batch, f, self.transformer.config.out_channels, h, w)

    # -- stages -------------------------------------------------------------------------

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

    def check_image(self, *, image, last_image, image_embeds, image_latents,
                    num_frames: int) -> bool:
        """An I2V transformer needs `image` (or `image_latents`), a T2V one refuses
        them; `last_image` and `image_embeds` are Wan's. The `"image"` stage runs for
        an I2V transformer."""
        config = self.transformer.config
        for name, value in (("last_image", last_image), ("image_embeds", image_embeds)):
            if value is not None:
                raise ValueError(f"{_OWNER}: `{name}` is WanPipeline's; CogVideoX takes `image` "
                                 "(or `image_latents`).")
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
        return self.image_conditioned

    def image_condition(self, *, image, last_image, image_embeds, image_latents, height,
                        width, num_frames, grid, batch, dtype, key):
        """`image_latents`, or the image encoded (a sample of the VAE's posterior from
        `fold_in(key, 1)`), padded with zero frames
        ([`prepare_condition`][vidax_eqx.pipelines.CogVideoXPipeline.prepare_condition])."""
        f, h, w = grid
        if image_latents is None:
            image_latents = self.encode_image(
                image, height, width, key=jax.random.fold_in(key, _POSTERIOR_STREAM))
        image_latents = jnp.asarray(image_latents, jnp.float32)
        c = self.transformer.config.out_channels
        if (image_latents.ndim != 5 or image_latents.shape[0] not in (1, batch)
                or image_latents.shape[1] not in (1, f)
                or image_latents.shape[2:] != (c, h, w)):
            first = "1" if batch == 1 else f"1 or {batch}"
            raise ValueError(
                f"{_OWNER}: `image_latents` must be ({first}, 1 or {f}, {c}, {h}, {w}) "
                f"(the image's frame, or diffusers' padded image_latents) for "
                f"{batch} videos of {num_frames} x {height} x {width}; received shape "
                f"{image_latents.shape}.")
        return self.prepare_condition(image_latents, f, batch), {}

    def decode(self, latents) -> np.ndarray:
        """As [`decode`][vidax_eqx.pipelines.AbstractVideoPipeline.decode]: the latents `(B, F, C, h, w)` divided by the VAE's `scaling_factor`, decoded in
        the VAE's chunks of frames, `(B, 4 (F - 1) + 1, H, W, 3)`."""
        videos = []
        for z in latents:
            z = jnp.transpose(jnp.asarray(z, dtype_of(self.vae)), (1, 0, 2, 3))
            z = self.vae.denormalize_latents(z)
            videos.append(interop.video_to_frames(self._vae_call("decode", z)))
        return np.stack(videos)

    def _vae_call(self, method: str, x):
        return vae_call(self.vae, self.mesh, method, x)
