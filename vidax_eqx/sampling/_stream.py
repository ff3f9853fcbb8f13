"""Streaming generation's denoising: a video chunk by chunk, each chunk denoised against the
key/value cache of the chunks before it (the same guidance and scheduler steps as
[`sample`][]), its final latents handed to the caller as soon as they are ready."""

import dataclasses
from collections.abc import Iterator

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import models
from ..models.internal import require_capability
from ._guidance import guide
from ._progress import SampleStep
from ._schedulers import AbstractScheduler


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

        def one(x, context, text, cache, arrays):  # the reach checked on the host
            return model.stream(x, t, context, cache, text_cache=text, check_reach=False, **static,
                                **arrays)

        return jax.vmap(one)(x, branch.context, branch.text, branch.cache, arrays)

    def guided(x, t):
        outs = [velocity(x, t, b)[0] for b in branches]
        return outs[0] if len(outs) == 1 else guide(outs[0], outs[1], scale)

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


def sample_stream(model, context, grid: tuple[int, int, int], *, chunk_frames: int,
                  max_cached_frames: int, scheduler: AbstractScheduler, steps: int, key,
                  negative_context=None, guidance_scale: float = 1.0, window: int | None = None,
                  noise=None, mesh=None, batch_axis=None, progress=None,
                  **model_kwargs) -> Iterator[jax.Array]:
    """Generates latents chunk by chunk with a key/value cache (autoregressive video, as
    CausVid and Self-Forcing run Wan): each chunk of `chunk_frames` latent frames is
    denoised by `steps` steps of `scheduler`, attending frame-block causally to itself and
    to the cached keys and values of the chunks before it; then its keys and values are
    appended to the cache. A generator: the chunks' final latents, one at a time, as soon
    as each is finished (what [`WanPipeline.stream`][vidax_eqx.pipelines.WanPipeline.stream]
    decodes and yields).

    **Arguments:**

    - `model`: a model whose `capabilities.streaming` is true
        ([`WanTransformer3D`][vidax_eqx.models.WanTransformer3D],
        [`SkyReelsV2Transformer3D`][vidax_eqx.models.SkyReelsV2Transformer3D]).
    - `context`: the text embeddings `(B, L, text_dim)`; `negative_context` those of the
        negative prompt, used when `guidance_scale > 1` (each branch has its own caches).
    - `grid`: the video's latent `(frames, height, width)`; `chunk_frames` divides the
        frames; `max_cached_frames` (a multiple of `chunk_frames`) the frames the cache
        holds; `window` (in chunks) narrows what each chunk sees of them.
    - `scheduler`, `steps`: each chunk's denoising steps (e.g. `FewStep()` and its 4).
    - `key`: the PRNG key of the chunks' noise and stochastic steps; `noise`, the video's
        initial latents `(B, C, F, H, W)` instead of drawing each chunk's.
    - `mesh`, `batch_axis`: run over a mesh (through
        [`run_sharded`][vidax_eqx.models.run_sharded]`(kv_cache=...)`).
    - `progress`: called with a [`SampleStep`][] (`index` the chunk, `total` the chunks)
        as each chunk is finished.
    - `**model_kwargs`: further arguments of the model's `stream` (arrays per example).

    **Returns:**

    An iterator of each chunk's latents `(B, C, chunk_frames, H, W)`, in the model's
    layout.
    """
    require_capability("sampling.sample_stream", model, "streaming")
    F, h, w = grid
    batch = context.shape[0]
    attention = models.BlockCausal(chunk_frames, window)
    static = {k: v for k, v in model_kwargs.items() if not eqx.is_array(v)}
    arrays = {k: v for k, v in model_kwargs.items() if eqx.is_array(v)}
    empty = model.kv_cache(h, w, max_cached_frames)

    def branch(ctx):
        text = _text_caches(model, ctx) if mesh is None else models.sharded_text_cache(
            model, ctx, mesh=mesh, batch_axis=batch_axis)
        cache = jax.tree.map(lambda a: jnp.broadcast_to(a, (batch, *a.shape)), empty)
        return _Branch(ctx, text, cache)

    guided = guidance_scale > 1 and negative_context is not None
    branches = tuple(branch(c) for c in ((context, negative_context) if guided else (context,)))
    plan = scheduler.plan(steps)
    shape = (batch, model.out_channels, chunk_frames, h, w)
    chunks = F // chunk_frames
    for index in range(chunks):
        chunk_key = jax.random.fold_in(key, index)
        if noise is None:
            chunk = jax.random.normal(jax.random.fold_in(chunk_key, 0), shape, jnp.float32)
        else:
            chunk = noise[:, :, index * chunk_frames:(index + 1) * chunk_frames]
        out, branches = _denoise(model, scheduler, plan, chunk, branches,
                                 jnp.float32(guidance_scale), jax.random.fold_in(chunk_key, 1),
                                 (dict(static, attention=attention), arrays), (mesh, batch_axis))
        if progress is not None:
            progress(SampleStep(index, chunks, None))
        yield out
