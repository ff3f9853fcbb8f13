"""`SkyReelsV2DiffusionForcingPipeline`: prompt to video with SkyReels-V2's diffusion
forcing models, diffusers' pipeline of that name, without PyTorch."""

import jax.numpy as jnp

from .. import models, sampling
from ._common import check_int
from ._pipeline import CallDefaults
from ._wan import WanPipeline


_OWNER = "SkyReelsV2DiffusionForcingPipeline"


class SkyReelsV2DiffusionForcingPipeline(WanPipeline):
    """SkyReels-V2 text-to-video by diffusion forcing, from a diffusers
    `SkyReelsV2DiffusionForcingPipeline` folder (e.g.
    `Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers`): Wan's tokenizer, UMT5 text encoder,
    VAE and scheduler, and a [`vidax_eqx.models.SkyReelsV2Transformer3D`][].

        pipe = SkyReelsV2DiffusionForcingPipeline.from_pretrained(folder)
        out = pipe("A cat walks on the grass", height=544, width=960, num_frames=97,
                   ar_step=5, fps=24, seed=0)

    A [`WanPipeline`][vidax_eqx.pipelines.WanPipeline] whose denoising loop is
    [`vidax_eqx.sampling.sample`][]`(forcing=DiffusionForcing(ar_step, causal_block_size))`:
    every latent frame at its own timestep, all at once (`ar_step=0`) or in a staggered
    wave, with the fps conditioning. The call takes diffusers' keyword names and
    reproduces its frames from the same initial latents; its defaults are diffusers':
    544 x 960, 97 frames, 50 steps, guidance 6.0, 24 fps.

    `causal_block_size > 1` runs the transformer's attention frame-block causal
    ([`vidax_eqx.models.BlockCausal`][]). **Not yet** (raises): long videos in windows
    (`overlap_history` with `num_frames > base_num_frames`), and so
    `addnoise_condition`, which only acts on the overlapping frames of a window.
    """

    defaults = CallDefaults(height=544, width=960, num_frames=97, num_inference_steps=50,
                            guidance_scale=6.0, max_sequence_length=512, fps=24)
    pipeline_classes = ("SkyReelsV2DiffusionForcingPipeline",)

    @classmethod
    def load_components(cls, folder, *, dtype, vae_dtype, encoder_dtype, parallel, mesh) -> dict:
        """The SkyReels-V2 transformer and the Wan VAE."""
        transformer = models.SkyReelsV2Transformer3D.from_pretrained(
            folder.path("transformer", needed_for="every call"), dtype=dtype, parallel=parallel,
            mesh=mesh)
        vae = models.WanVAE.from_pretrained(folder.path("vae", needed_for="decoding"),
                                            dtype=vae_dtype, mesh=mesh)
        return dict(transformer=transformer, vae=vae)

    def __call__(self, prompt=None, negative_prompt=None, *, ar_step: int = 0,
                 causal_block_size: int | None = None, fps: int = 24,
                 overlap_history: int | None = None, addnoise_condition: float = 0,
                 base_num_frames: int = 97, **kwargs):
        """**Arguments:** those of [`WanPipeline`][vidax_eqx.pipelines.WanPipeline]'s call
        (text-to-video: no image), and diffusers' diffusion forcing keywords:

        - `ar_step`: the iterations a block of frames lags the one before it (0: all
            frames at once, the synchronous schedule).
        - `causal_block_size`: the frames of a block (default: the transformer's
            `num_frame_per_block`): the schedule's blocks and, above 1, the transformer's
            frame-block causal attention ([`vidax_eqx.models.BlockCausal`][]), as
            diffusers sets it. It must divide the latent frames.
        - `fps`: the video's frame rate as the model is conditioned on it (16, or any
            other value for its second entry), when it has the fps embedding.
        - `overlap_history`, `base_num_frames`, `addnoise_condition`: long videos in
            overlapping windows; a video within `base_num_frames` (or without
            `overlap_history`) is generated in one window, as in diffusers.
        """
        check_int(_OWNER, "ar_step", ar_step, 0)
        config = self.transformer_config
        block = config.num_frame_per_block if causal_block_size is None else causal_block_size
        check_int(_OWNER, "causal_block_size", block, 1)
        if isinstance(fps, bool) or not isinstance(fps, (int, float)):
            raise ValueError(f"{_OWNER}: `fps` must be a number (frames per second); received {fps!r}.")
        num_frames = kwargs.get("num_frames") or self.call_defaults.num_frames
        if overlap_history is not None and num_frames > base_num_frames:
            raise NotImplementedError(
                f"{_OWNER}: a long video ({num_frames} frames over base_num_frames="
                f"{base_num_frames} with overlap_history={overlap_history}) is generated in "
                "overlapping windows, which this library does not run yet; generate at most "
                "base_num_frames frames, or leave overlap_history out.")
        forcing = sampling.DiffusionForcing(ar_step=ar_step, causal_block_size=block)
        return super().__call__(prompt, negative_prompt, forcing=forcing,
                                skyreels_fps=0 if fps == 16 else 1, skyreels_block=block, **kwargs)

    def stream(self, prompt=None, negative_prompt=None, *, fps: int = 24, **kwargs):
        """[`WanPipeline.stream`][vidax_eqx.pipelines.WanPipeline.stream] with the fps
        conditioning (a transformer with the fps embedding): generation chunk by chunk
        against the key/value cache, diffusers' `causal_block_size` being the chunk's
        `chunk_frames`."""
        if isinstance(fps, bool) or not isinstance(fps, (int, float)):
            raise ValueError(f"{_OWNER}.stream: `fps` must be a number (frames per second); "
                             f"received {fps!r}.")
        return super().stream(prompt, negative_prompt, skyreels_fps=0 if fps == 16 else 1, **kwargs)

    def model_arguments(self, batch: int, call: dict) -> dict:
        """The fps index of every example (for a transformer with the fps embedding), and
        the frame-block causal attention of `causal_block_size` when it is not the
        transformer's own blocks (diffusers sets them on its model, `_set_ar_attention`)."""
        index, block = call.pop("skyreels_fps", 1), call.pop("skyreels_block", None)
        config = self.transformer_config
        arguments = {}
        if block is not None and block != config.num_frame_per_block:
            arguments["attention"] = models.BlockCausal(block)
        if config.inject_sample_info:
            arguments["fps"] = jnp.full((batch,), index, jnp.int32)
        return arguments
