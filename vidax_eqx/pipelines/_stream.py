"""Streaming generation: a video chunk by chunk, each chunk denoised against the key/value
cache of the chunks before it and decoded as soon as it is finished."""

import dataclasses
import time
from collections.abc import Iterator

import jax
import numpy as np

from .. import interop, sampling
from ..models.internal import require_capability, vae_jit
from ._common import check_int, dtype_of


@dataclasses.dataclass(frozen=True)
class StreamChunk:
    """One finished chunk of a streamed generation ([`WanPipeline.stream`][vidax_eqx.pipelines.WanPipeline.stream]).

    **Fields:**

    - `index`: the chunk's place in the video (0 first).
    - `frames`: `(B, F, H, W, 3)` float32 NumPy in [0, 1], the chunk's video frames
        (`1 + 4 (f - 1)` for the first chunk of `f` latent frames, `4 f` after it);
        `None` with `output_type="latent"`.
    - `latents`: `(B, z, f, h, w)` float32 NumPy, the chunk's final latents (the
        transformer's layout, not denormalized).
    - `seconds`: from the call's start (the first chunk: compilation included) to this
        chunk's frames being ready.
    """

    index: int
    frames: np.ndarray | None
    latents: np.ndarray
    seconds: float


@vae_jit
def _decode(vae, latents, states):
    """The chunk's frames `(B, 3, F, H, W)` and the VAE's next states, one example at a
    time (`states` `None` for the first chunk)."""
    def one(z, state):
        return vae.decode_stream(vae.denormalize_latents(z.astype(dtype_of(vae))), state)

    if states is None:
        return jax.vmap(lambda z: one(z, None))(latents)
    return jax.vmap(one)(latents, states)


def stream_video(pipe, *, context, negative, grid, chunk_frames: int, max_cached_frames,
                 window, scheduler, steps, guidance_scale: float, key, latents, output_type: str,
                 model_kwargs: dict) -> Iterator[StreamChunk]:
    """The loop of `WanPipeline.stream` (its arguments checked there): each chunk's latents
    from [`sampling.sample_stream`][vidax_eqx.sampling.sample_stream], decoded."""
    start = time.perf_counter()
    mesh = pipe.mesh
    chunks = sampling.sample_stream(
        pipe.transformer, context, grid, chunk_frames=chunk_frames,
        max_cached_frames=max_cached_frames, scheduler=scheduler, steps=steps, key=key,
        negative_context=negative, guidance_scale=guidance_scale, window=window, noise=latents,
        mesh=mesh, batch_axis=None if mesh is None else pipe.batch_axis, **model_kwargs)
    states = None
    for index, out in enumerate(chunks):
        frames = None
        if output_type == "np":
            video, states = _decode(pipe.vae, out, states)
            frames = np.stack([interop.video_to_frames(v) for v in video])
        out = np.asarray(jax.device_get(out), np.float32)
        yield StreamChunk(index, frames, out, time.perf_counter() - start)


def check_stream(owner: str, pipe, grid, chunk_frames, max_cached_frames, window, scheduler, steps):
    """The stream's arguments checked against the pipeline: `(max_cached_frames,
    scheduler, steps)` with their defaults."""
    F = grid[0]
    chunk_frames = check_int(owner, "chunk_frames", chunk_frames, 1)
    if F % chunk_frames:
        raise ValueError(
            f"{owner}: `chunk_frames` ({chunk_frames} latent frames) must divide the video's "
            f"{F} latent frames; e.g. {', '.join(str(d) for d in range(1, F + 1) if F % d == 0)}.")
    if max_cached_frames is None:
        max_cached_frames = F - chunk_frames
    max_cached_frames = check_int(owner, "max_cached_frames", max_cached_frames, 0)
    if max_cached_frames % chunk_frames:
        raise ValueError(f"{owner}: `max_cached_frames` ({max_cached_frames}) must be a multiple "
                         f"of `chunk_frames` ({chunk_frames}): the cache holds whole chunks.")
    if window is not None:
        check_int(owner, "window", window, 1)
    reach = pipe.transformer_config.rope_max_seq_len
    if F > reach:  # checked here, so that the compiled chunk step holds no host callback
        raise ValueError(
            f"{owner}: the video's {F} latent frames pass the transformer's rope_max_seq_len "
            f"({reach} latent frames), the reach of its RoPE tables; generate at most "
            f"{(reach - 1) * pipe.vae.temporal_factor + 1} frames.")
    require_capability(owner, pipe.transformer, "streaming")
    if pipe.image_conditioned:
        raise NotImplementedError(f"{owner}: streaming generation is text-to-video; this "
                                  "transformer takes an image.")
    scheduler = sampling.FewStep() if scheduler is None else scheduler
    if not isinstance(scheduler, sampling.AbstractScheduler):
        raise ValueError(f"{owner}: `scheduler` must be a vidax_eqx.sampling scheduler; received "
                         f"{type(scheduler).__name__}.")
    if steps is None:
        if not isinstance(scheduler, sampling.FewStep):
            raise ValueError(f"{owner}: `num_inference_steps` is needed with a "
                             f"{type(scheduler).__name__} (FewStep's are its timesteps).")
        steps = len(scheduler.timesteps)
    return max_cached_frames, scheduler, steps
