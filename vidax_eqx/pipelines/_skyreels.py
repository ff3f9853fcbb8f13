"""`SkyReelsV2DiffusionForcingPipeline`: prompt (and image, or video) to video with
SkyReels-V2's diffusion forcing models, diffusers' T2V, I2V and V2V pipelines of that
name, long videos in overlapping windows included, without PyTorch."""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import interop, models, sampling
from ._common import check_int, dtype_of, image_array
from ._pipeline import CallDefaults
from ._wan import WanPipeline


_OWNER = "SkyReelsV2DiffusionForcingPipeline"

# The stream folded into a call's seed key for `addnoise_condition`'s noise (window `w`
# folds `w` into it).
ADDNOISE_STREAM = 3


@dataclasses.dataclass(frozen=True)
class Window:
    """One window of a diffusion forcing call, in latent frames: `frames` generated
    together (the given ones included), the first `prefix` of them given (the image's,
    the video's, or the end of the window before)."""

    frames: int
    prefix: int


def plan_windows(latent_frames: int, *, base: int | None, overlap: int | None,
                 block: int, first_prefix: int = 0, video: bool = False) -> list[Window]:
    """diffusers' windows of a diffusion forcing call over `latent_frames` latent frames
    (its `n_iter` and `prepare_latents`): one window when the video fits in `base`
    latent frames (or without `overlap`); else a first window of `base` frames, then
    windows that each start with the last `overlap` frames of the video so far (cut to
    a multiple of `block`: only those are given) and add at most `base - overlap` new
    ones. `first_prefix`: the first window's given frames (I2V's image). `video` (V2V):
    the first window already starts with the input video's last `overlap` latent frames
    (cut to a multiple of `block`), counted in `latent_frames`."""
    if overlap is None or (not video and (base is None or latent_frames <= base)):
        return [Window(latent_frames, first_prefix)]
    base = latent_frames if base is None else base
    if not 0 < overlap < base:
        raise ValueError(
            f"{_OWNER}: `overlap_history` must leave new frames in a window: its latent "
            f"frames ({overlap}) must be in [1, {base - 1}] for base_num_frames' {base}.")
    given = overlap - overlap % block
    count = 1 + (latent_frames - base - 1) // (base - overlap) + 1
    windows = []
    for i in range(count):
        if i == 0 and not video:
            windows.append(Window(base, first_prefix))
            continue
        finished = i * (base - overlap) + overlap
        windows.append(Window(min(latent_frames - finished + overlap, base), given))
    return windows


class Windows(NamedTuple):
    """A diffusion forcing call's windows and what each is given."""

    windows: list
    """`plan_windows`' windows, one `sample` call each."""
    overlap: int | None
    """Latent frames a window shares with the one before it."""
    last: bool
    """Whether a last image is given after the last window (I2V)."""
    video: np.ndarray | None
    """V2V: the input video's frames `(F, H, W, 3)`."""
    overlap_history: int | None
    """V2V: the input video's frames continued."""


@dataclasses.dataclass(frozen=True)
class SkyReelsOptions:
    """SkyReels-V2's own options of a call (the pipeline template's `family=`), read by
    its hooks: the fps embedding's index, the frame blocks, and diffusion forcing's
    schedule and windows (`None` in a stream)."""

    fps_index: int
    block: int | None = None
    forcing: sampling.DiffusionForcing | None = None
    windows: Windows | None = None


def _fps_index(fps, owner: str = _OWNER) -> int:
    """The fps embedding's index of a frame rate: 0 for 16 frames per second, else 1."""
    if isinstance(fps, bool) or not isinstance(fps, (int, float)):
        raise ValueError(f"{owner}: `fps` must be a number (frames per second); received {fps!r}.")
    return 0 if fps == 16 else 1


def _video_frames(video) -> np.ndarray:
    """V2V's `video`: a list of PIL images or frames `(F, H, W, 3)` as a NumPy array."""
    if isinstance(video, (list, tuple)):
        video = np.stack([image_array(_OWNER, f"video[{i}]", x) for i, x in enumerate(video)])
    video = np.asarray(video)
    if video.ndim != 4 or video.shape[-1] != 3 or len(video) == 0:
        raise ValueError(f"{_OWNER}: `video` must be RGB frames (F, H, W, 3), uint8 or float in "
                         f"[0, 1], or a list of PIL images; received shape {video.shape}.")
    return video


class SkyReelsV2DiffusionForcingPipeline(WanPipeline):
    """SkyReels-V2 by diffusion forcing, from a diffusers folder of
    `SkyReelsV2DiffusionForcingPipeline` (e.g. `Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers`)
    or its `ImageToVideo` / `VideoToVideo` siblings: Wan's tokenizer, UMT5 text encoder,
    VAE and scheduler, and a [`vidax_eqx.models.SkyReelsV2Transformer3D`][].

        pipe = SkyReelsV2DiffusionForcingPipeline.from_pretrained(folder)
        out = pipe("A cat walks on the grass", height=544, width=960, num_frames=97,
                   ar_step=5, causal_block_size=5, fps=24, seed=0)
        long = pipe("A cat walks on the grass", num_frames=257, base_num_frames=97,
                    overlap_history=17, addnoise_condition=20, ar_step=5,
                    causal_block_size=5)                     # three windows
        i2v = pipe("The cat turns its head", image=first_frame)      # diffusers' I2V
        v2v = pipe("The cat keeps walking", video=frames, overlap_history=17)  # V2V

    A [`WanPipeline`][vidax_eqx.pipelines.WanPipeline] whose denoising loop is
    [`vidax_eqx.sampling.sample`][]`(forcing=DiffusionForcing(ar_step, causal_block_size))`:
    every latent frame at its own timestep, all at once (`ar_step=0`) or in a staggered
    wave, with the fps conditioning; `causal_block_size > 1` runs the transformer's
    attention frame-block causal ([`vidax_eqx.models.BlockCausal`][]). The call takes
    diffusers' keyword names and reproduces its frames from the same initial latents;
    its defaults are diffusers' T2V ones: 544 x 960, 97 frames, 50 steps, guidance 6.0,
    24 fps (diffusers' I2V pipeline defaults to guidance 5.0 and its V2V one to 120
    frames: pass them).

    **Image and video to video** (diffusers' `SkyReelsV2DiffusionForcingImageToVideoPipeline`
    and `...VideoToVideoPipeline`, the same components): `image=` (and `last_image=`)
    gives the first (and last) latent frame, encoded by the VAE; `video=` (frames `(F,
    H, W, 3)`) continues a video from its last `overlap_history` frames, and the output
    is the input video's frames followed by the decoded new latents (as diffusers').

    **Long videos** (`num_frames > base_num_frames` with `overlap_history`): windows of
    `base_num_frames`, each starting from the last `overlap_history` frames of the one
    before (given, not generated), with their frames shown noised by
    `addnoise_condition` ([`vidax_eqx.sampling.DiffusionForcing`][]). `latents=` (to
    reproduce a diffusers run) is then every window's initial noise, one after the other
    on the frame axis ([`noise_shape`][vidax_eqx.pipelines.SkyReelsV2DiffusionForcingPipeline.noise_shape]).
    """

    defaults = CallDefaults(height=544, width=960, num_frames=97, num_inference_steps=50,
                            guidance_scale=6.0, max_sequence_length=512, fps=24)
    pipeline_classes = ("SkyReelsV2DiffusionForcingPipeline",
                        "SkyReelsV2DiffusionForcingImageToVideoPipeline",
                        "SkyReelsV2DiffusionForcingVideoToVideoPipeline")

    @classmethod
    def load_components(cls, folder, *, dtype, vae_dtype, encoder_dtype, parallel, mesh) -> dict:
        """The SkyReels-V2 transformer and the Wan VAE."""
        transformer = models.SkyReelsV2Transformer3D.from_pretrained(
            folder.path("transformer", needed_for="every call"), dtype=dtype, parallel=parallel,
            mesh=mesh)
        vae = models.WanVAE.from_pretrained(folder.path("vae", needed_for="decoding"),
                                            dtype=vae_dtype, mesh=mesh)
        return dict(transformer=transformer, vae=vae)

    @property
    def image_conditioned(self) -> bool:
        """Whether the transformer has an image branch (SkyReels-V2 I2V, not diffusion
        forcing's); diffusion forcing's `image=` conditions through the latents."""
        config = self.transformer_config
        return config.in_channels > config.out_channels

    def __call__(self, prompt=None, negative_prompt=None, *, image=None, last_image=None,
                 video=None, ar_step: int = 0, causal_block_size: int | None = None,
                 fps: int = 24, overlap_history: int | None = None,
                 addnoise_condition: float = 0, base_num_frames: int | None = 97, **kwargs):
        """**Arguments:** those of [`WanPipeline`][vidax_eqx.pipelines.WanPipeline]'s call,
        and diffusers' diffusion forcing keywords:

        - `image`, `last_image`: image to video (diffusers' DF I2V): the first (and
            last) frame, a PIL image or `(H, W, 3)` array resized to `height x width`;
            its VAE latents are the first (and an extra last) latent frame, given.
        - `video`: video to video (diffusers' DF V2V): frames `(F, H, W, 3)` (uint8 or
            float in [0, 1], or a list of PIL images), resized to `height x width`; its
            last `overlap_history` frames (required) are encoded and continued, and
            `num_frames` counts them. The output frames are `video`'s followed by the
            decoded latents.
        - `ar_step`: the iterations a block of frames lags the one before it (0: all
            frames at once, the synchronous schedule).
        - `causal_block_size`: the frames of a block (default: the transformer's
            `num_frame_per_block`): the schedule's blocks and, above 1, the transformer's
            frame-block causal attention ([`vidax_eqx.models.BlockCausal`][]), as
            diffusers sets it. It must divide each window's latent frames.
        - `fps`: the video's frame rate as the model is conditioned on it (16, or any
            other value for its second entry), when it has the fps embedding.
        - `overlap_history`, `base_num_frames`: a video longer than `base_num_frames`
            is generated in windows of `base_num_frames` frames overlapping by
            `overlap_history` (required then, as diffusers requires it; 17 or 37
            recommended); `base_num_frames=None`: one window, whatever the length.
        - `addnoise_condition`: the noise level (a timestep, 20 recommended, at most 60
            advised) the overlapping frames of a window are shown at; 0: clean.
        """
        options = self.forcing_options(
            height=kwargs.get("height"), width=kwargs.get("width"),
            num_frames=kwargs.get("num_frames"), image=image, last_image=last_image, video=video,
            ar_step=ar_step, causal_block_size=causal_block_size, fps=fps,
            overlap_history=overlap_history, addnoise_condition=addnoise_condition,
            base_num_frames=base_num_frames)
        out = super().__call__(prompt, negative_prompt, image=image, last_image=last_image,
                               family=options, **kwargs)
        frames = options.windows.video
        if frames is not None and out.frames is not None:  # diffusers' [video; generated]
            defaults = self.call_defaults
            height = kwargs.get("height") or defaults.height
            width = kwargs.get("width") or defaults.width
            given = interop.video_to_frames(interop.frames_to_video(frames, size=(height, width)))
            out = dataclasses.replace(out, frames=np.concatenate(
                [np.broadcast_to(given, (out.frames.shape[0], *given.shape)), out.frames], axis=1))
        return out

    def forcing_options(self, *, height: int | None = None, width: int | None = None,
                        num_frames: int | None = None, image=None, last_image=None, video=None,
                        ar_step: int = 0, causal_block_size: int | None = None, fps: int = 24,
                        overlap_history: int | None = None, addnoise_condition: float = 0,
                        base_num_frames: int | None = 97) -> SkyReelsOptions:
        """A call's diffusion forcing options (the template's `family=`), from the call's
        keywords: the schedule, the windows and what each is given, every keyword checked
        against the transformer's and the VAE's configs before any stage runs (the
        video's size; each window's latent frames against `causal_block_size`, which the
        denoising loop would refuse after the text stage). Reads no weight: `vidax-generate`
        runs it on the folder's configs before loading. Raises as the call does."""
        defaults = self.call_defaults
        num_frames = defaults.num_frames if num_frames is None else num_frames
        self.check_size(defaults.height if height is None else height,
                        defaults.width if width is None else width, num_frames)
        check_int(_OWNER, "ar_step", ar_step, 0)
        config = self.transformer_config
        block = config.num_frame_per_block if causal_block_size is None else causal_block_size
        check_int(_OWNER, "causal_block_size", block, 1)
        fps_index = _fps_index(fps)
        # The schedule (and addnoise_condition's check); each window adds its given frames.
        forcing = sampling.DiffusionForcing(ar_step=ar_step, causal_block_size=block,
                                            addnoise_condition=addnoise_condition)
        if overlap_history is not None:
            check_int(_OWNER, "overlap_history", overlap_history, 1)
        if base_num_frames is not None:
            check_int(_OWNER, "base_num_frames", base_num_frames, 1)
        if video is not None and image is not None:
            raise ValueError(f"{_OWNER}: `video` (V2V) and `image` (I2V) are two modes; pass "
                             "one of them.")
        if video is not None and overlap_history is None:
            raise ValueError(f"{_OWNER}: `video` is continued from its last `overlap_history` "
                             "frames; pass overlap_history (17 or 37 recommended).")
        t = self.vae.temporal_factor
        latent = lambda frames: (frames - 1) // t + 1
        overlap = None if overlap_history is None else latent(overlap_history)
        base = None if base_num_frames is None else latent(base_num_frames)
        frames = None
        if video is not None:
            frames = _video_frames(video)
            if len(frames) < overlap_history:
                raise ValueError(f"{_OWNER}: `video` must have at least overlap_history "
                                 f"({overlap_history}) frames; received {len(frames)}.")
        if overlap_history is None and base_num_frames is not None and num_frames > base_num_frames:
            raise ValueError(
                f"{_OWNER}: a video of {num_frames} frames, longer than base_num_frames "
                f"({base_num_frames}), is generated in overlapping windows: pass "
                "overlap_history (17 or 37 recommended), or base_num_frames=None for one "
                "window of the whole video.")
        windows = plan_windows(latent(num_frames), base=base, overlap=overlap, block=block,
                               first_prefix=int(image is not None), video=video is not None)
        if image is not None and len(windows) > 1 and last_image is not None:
            raise NotImplementedError(
                f"{_OWNER}: `last_image` with a long video (windows): diffusers' pipeline "
                "cuts the last window's overlap from the end of the video there, not the "
                "last image; generate at most base_num_frames frames with it.")
        for i, window in enumerate(windows):  # each window's schedule as `denoise` runs it
            end = int(last_image is not None and i == len(windows) - 1)  # the last image's frame
            dataclasses.replace(forcing, prefix_frames=window.prefix, suffix_frames=end).rows(
                window.frames + end, 1)  # raises unless its blocks divide its latent frames
        return SkyReelsOptions(
            fps_index=fps_index, block=block, forcing=forcing,
            windows=Windows(windows, overlap, last_image is not None, frames, overlap_history))

    def check_image(self, *, image, last_image, image_embeds, image_latents,
                    num_frames: int) -> bool:
        """Diffusion forcing's `image` (and `last_image`) are latent frames, for its
        text-to-video transformer; `image_embeds` and `image_latents` are refused."""
        for name, value in (("image_embeds", image_embeds), ("image_latents", image_latents)):
            if value is not None:
                raise ValueError(f"{_OWNER}: `{name}` is not taken by diffusion forcing; pass "
                                 "`image` (its VAE latents are the first latent frame).")
        if self.image_conditioned:
            raise ValueError(
                f"{_OWNER}: the transformer has an image branch (in_channels "
                f"{self.transformer_config.in_channels}): it is SkyReels-V2's I2V model, not "
                "a diffusion forcing one.")
        if image is None and last_image is not None:
            raise ValueError(f"{_OWNER}: `last_image` needs `image`, the first frame.")
        return image is not None

    def image_condition(self, *, image, last_image, image_embeds, image_latents, height,
                        width, num_frames, grid, batch, dtype, key):
        """The normalized VAE latents of `image` (and of `last_image`, after it),
        `(batch, z, 1 or 2, h, w)`, each image encoded alone as diffusers' DF I2V
        pipeline does."""
        latents = [self._encode_frames(image_array(_OWNER, name, x)[None], height, width)
                   for name, x in (("image", image), ("last_image", last_image)) if x is not None]
        latents = jnp.concatenate(latents, axis=1)
        return jnp.broadcast_to(latents[None], (batch, *latents.shape)), {}

    def _encode_frames(self, frames, height: int, width: int) -> jax.Array:
        """Frames `(F, H, W, 3)` resized and encoded: the normalized latents `(z, F_lat,
        h, w)`, float32 (the posterior's mode, as diffusers' `sample_mode="argmax"`)."""
        video = jnp.asarray(interop.frames_to_video(frames, size=(height, width)), dtype_of(self.vae))
        return self.vae.normalize_latents(self._vae_call("encode", video).mode()).astype(jnp.float32)

    def noise_shape(self, batch: int, grid, family) -> tuple[int, ...]:
        """Every window's initial noise, one after the other on the frame axis:
        `(batch, z, sum of the windows' latent frames, h, w)`, the video's latents for a
        call in one window; a window's given frames (image, video, overlap) are then
        written over its noise, as diffusers does."""
        if family is None or family.windows is None:
            return self.latent_shape(batch, grid)
        _, h, w = grid
        return self.latent_shape(batch, (sum(x.frames for x in family.windows.windows), h, w))

    def denoise(self, noise, *, condition, seed_key, family, call: dict, sample) -> jax.Array:
        """The windows one after the other, each a
        [`vidax_eqx.sampling.sample`][]`(forcing=DiffusionForcing(..., prefix_frames,
        suffix_frames, addnoise_condition))` call from its noise with its given frames
        written in: the first window's from `image` or `video`, a later one's the last
        `overlap` latent frames of the video so far; the last image appended to the
        last window. The video is the first window and every later one's frames past its
        overlap (diffusers')."""
        plan, forcing = family.windows, family.forcing
        call = dict(call)
        key = call.pop("key", None)  # addnoise_condition's draws: this key's, else the seed's
        key = jax.random.fold_in(seed_key, ADDNOISE_STREAM) if key is None else key
        windows, overlap = plan.windows, plan.overlap
        given = condition
        if plan.video is not None:  # V2V: the input video's last overlap_history frames
            _, _, _, h, w = noise.shape
            s = self.vae.spatial_factor
            latents = self._encode_frames(plan.video[-plan.overlap_history:], h * s, w * s)
            given = jnp.broadcast_to(latents[None], (noise.shape[0], *latents.shape))
        end = None
        if plan.last:  # I2V's last image: given after the last window
            given, end = given[:, :, :1], given[:, :, 1:]
        video, start = None, 0
        for i, window in enumerate(windows):
            x = noise[:, :, start:start + window.frames]
            start += window.frames
            prefix = given if i == 0 else video[:, :, -overlap:]
            prefix = None if prefix is None else prefix[:, :, :window.prefix]
            if prefix is not None and window.prefix:
                x = x.at[:, :, :window.prefix].set(prefix.astype(x.dtype))
            suffix = end if i == len(windows) - 1 else None
            if suffix is not None:
                x = jnp.concatenate([x, suffix.astype(x.dtype)], axis=2)
            schedule = dataclasses.replace(forcing, prefix_frames=window.prefix,
                                           suffix_frames=0 if suffix is None else suffix.shape[2])
            out = sample(x, condition=None, forcing=schedule,
                         key=jax.random.fold_in(key, i) if schedule.addnoise_condition > 0 else None,
                         **call)
            if suffix is not None:
                out = out[:, :, :x.shape[2] - suffix.shape[2]]
            video = out if video is None else jnp.concatenate([video, out[:, :, overlap:]], axis=2)
        return video

    def stream(self, prompt=None, negative_prompt=None, *, fps: int = 24, **kwargs):
        """[`WanPipeline.stream`][vidax_eqx.pipelines.WanPipeline.stream] with the fps
        conditioning (a transformer with the fps embedding): generation chunk by chunk
        against the key/value cache, diffusers' `causal_block_size` being the chunk's
        `chunk_frames`."""
        options = SkyReelsOptions(fps_index=_fps_index(fps, f"{_OWNER}.stream"))
        return super().stream(prompt, negative_prompt, family=options, **kwargs)

    def model_arguments(self, batch: int, family) -> dict:
        """The fps index of every example (for a transformer with the fps embedding), and
        the frame-block causal attention of `causal_block_size` when it is not the
        transformer's own blocks (diffusers sets them on its model, `_set_ar_attention`)."""
        family = SkyReelsOptions(fps_index=1) if family is None else family
        index, block = family.fps_index, family.block
        config = self.transformer_config
        arguments = {}
        if block is not None and block != config.num_frame_per_block:
            arguments["attention"] = models.BlockCausal(block)
        if config.inject_sample_info:
            arguments["fps"] = jnp.full((batch,), index, jnp.int32)
        return arguments
