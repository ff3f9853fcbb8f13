"""Streaming generation: a video chunk by chunk, each chunk denoised against the key/value
cache of the chunks before it and decoded as soon as it is finished."""

import dataclasses
import time
from collections.abc import Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import interop, models, sampling
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


class _Branch(eqx.Module):
    """One guidance branch's text and key/value caches (one per example, stacked)."""

    context: jax.Array  # (B, L, text_dim)
    text: object  # the transformer's text cache of `context`, (B, ...)
    cache: models.KVCache  # (B, ...)


@eqx.filter_jit
def _denoise(model, scheduler, plan, noise, branches, scale, key, kwargs, placement):
    """A chunk from its noise: every step of `scheduler` against the branches' caches (the
    cache only read), guided when there are two branches; then the finished chunk at
    timestep 0, whose keys and values are appended to each branch's cache. Over
    `placement = (mesh, batch_axis)` (mesh `None`: one device) through
    `models.run_sharded(kv_cache=...)`."""
    static, arrays = kwargs
    mesh, batch_axis = placement

    def velocity(x, t, branch):
        if mesh is not None:
            t = jnp.broadcast_to(t, (x.shape[0],))
            return models.run_sharded(model, x, t, branch.context, mesh=mesh, batch_axis=batch_axis,
                                      kv_cache=branch.cache, text_cache=branch.text, check_reach=False,
                                      **static, **arrays)

        def one(x, context, text, cache, arrays):  # the reach checked on the host (`check_stream`)
            return model.stream(x, t, context, cache, text_cache=text, check_reach=False, **static,
                                **arrays)

        return jax.vmap(one)(x, branch.context, branch.text, branch.cache, arrays)

    def guided(x, t):
        outs = [velocity(x, t, b) for b in branches]
        v = outs[0][0]
        if len(outs) == 2:
            v = outs[1][0] + scale * (v - outs[1][0])
        return v

    x, state = noise, scheduler.init(noise)
    for i in range(plan.steps):  # a few steps: unrolled
        v = guided(x, scheduler.timestep(plan, i))
        x, state = scheduler.step(plan, state, i, v, x, key=jax.random.fold_in(key, i))
    x = x.astype(noise.dtype)
    clean = jnp.zeros((), jnp.float32)
    caches = tuple(dataclasses.replace(b, cache=velocity(x, clean, b)[1]) for b in branches)
    return x, caches


@eqx.filter_jit
def _text_caches(model, context):
    """The transformer's text cache of each example's context."""
    return jax.vmap(model.text_cache)(context)


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
    """The loop of `WanPipeline.stream` (its arguments checked there)."""
    start = time.perf_counter()
    model, vae = pipe.transformer, pipe.vae
    F, h, w = grid
    batch = context.shape[0]
    attention = models.BlockCausal(chunk_frames, window)
    static = {k: v for k, v in model_kwargs.items() if not eqx.is_array(v)}
    arrays = {k: v for k, v in model_kwargs.items() if eqx.is_array(v)}
    empty = model.kv_cache(h, w, max_cached_frames)

    mesh = pipe.mesh
    batch_axis = None if mesh is None else pipe.batch_axis

    def branch(ctx):
        text = _text_caches(model, ctx) if mesh is None else models.sharded_text_cache(
            model, ctx, mesh=mesh, batch_axis=batch_axis)
        cache = jax.tree.map(lambda a: jnp.broadcast_to(a, (batch, *a.shape)), empty)
        return _Branch(ctx, text, cache)

    branches = tuple(branch(c) for c in (context, negative) if c is not None)
    plan = scheduler.plan(steps)
    shape = pipe.latent_shape(batch, (chunk_frames, h, w))
    states = None
    for index in range(F // chunk_frames):
        chunk_key = jax.random.fold_in(key, index)
        if latents is None:
            noise = jax.random.normal(jax.random.fold_in(chunk_key, 0), shape, jnp.float32)
        else:
            noise = latents[:, :, index * chunk_frames:(index + 1) * chunk_frames]
        out, branches = _denoise(model, scheduler, plan, noise, branches,
                                 jnp.float32(guidance_scale), jax.random.fold_in(chunk_key, 1),
                                 (dict(static, attention=attention), arrays), (mesh, batch_axis))
        frames = None
        if output_type == "np":
            video, states = _decode(vae, out, states)
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
