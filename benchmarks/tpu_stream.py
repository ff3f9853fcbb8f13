"""Streaming generation with a key/value cache on an accelerator: a Wan chunk step against
recomputing the prefix, and the cache's memory against the video's length.

    python benchmarks/tpu_stream.py --out DIR      # Wan 2.1 1.3B, 480p, chunks of 3 latent frames
    python benchmarks/tpu_stream.py --smoke --out DIR

`models.WanTransformer3D` (random weights at the real size, bf16) with the 512-token text
as a text cache, as a streaming generation runs it (`WanTransformer3D.stream`,
frame-block causal, a block per chunk):

- **cached chunk**: one chunk of 3 latent frames (4,680 tokens at 480p) against a cache
  holding `P` earlier latent frames, for P = 0, 6, 18 (the last chunk of an 81-frame
  video), and with a rolling window of 6 frames (what every chunk of a longer video
  costs, whatever its length);
- **recomputed prefix**: the same chunk by the model's ordinary call over the `P` earlier
  frames and the chunk (`attention=BlockCausal(3)`), what a generation without a cache
  runs at every step;
- **a video in chunks**: the few-step sampler's 4 steps and the pass at timestep 0 per
  chunk (`sampling.FewStep`), timed chunk by chunk over a video of `--seconds` (16 fps;
  each latent frame is 4 video frames), with a rolling window of 6 latent frames: seconds
  to the first chunk's latents (compilation excluded, then included) and video frames per
  second in steady state; the device's peak memory after each length.

The cache's size is also reported analytically (layers x 2 x tokens x heads x head_dim x
2 bytes). Every call is compiled ahead of time and timed as the best of 3. The VAE's
streamed decode is not timed here (its compile alone exceeds this script's budget on
v5e, see `docs/benchmarks.md`). Results to stdout and `DIR/tpu_stream.json`.
"""

import argparse
import datetime
import json
import os
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp

from _harness import write_json  # also puts this checkout first on sys.path
from vidax_eqx import models, sampling


BF16, F32 = jnp.bfloat16, jnp.float32


def best(fn, *args, reps: int = 3) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def peak_gib() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, nargs="*", default=[5, 20, 60],
                        help="video lengths of the chunked runs (16 fps)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=".", metavar="DIR")
    args = parser.parse_args()
    if args.smoke:
        config = models.WanConfig(dim=64, ffn_dim=128, num_heads=2, num_layers=2, text_dim=32)
        h, w, text, chunk, prefixes, window = 4, 8, (8, 32), 3, (0, 3, 6), 3
        seconds_list = [1.0]
    else:
        config = models.WanConfig.preset("t2v-1.3b")
        h, w, text, chunk, prefixes, window = 60, 104, (512, config.text_dim), 3, (0, 6, 18), 6
        seconds_list = args.seconds
    tokens_per_frame = (h // 2) * (w // 2)
    report = dict(date=datetime.date.today().isoformat(), jax=jax.__version__,
                  device=jax.devices()[0].device_kind, latent_hw=(h, w), chunk_frames=chunk,
                  tokens_per_frame=tokens_per_frame, rows=[])
    print({k: v for k, v in report.items() if k != "rows"}, flush=True)
    keys = jax.random.split(jax.random.key(0), 4)
    model = jax.block_until_ready(models.WanTransformer3D(config, dtype=BF16, key=keys[0]))
    context = jax.random.normal(keys[1], text, F32).astype(BF16)
    text_cache = jax.block_until_ready(eqx.filter_jit(lambda m, c: m.text_cache(c))(model, context))
    x = jax.random.normal(keys[2], (16, chunk, h, w), F32).astype(BF16)
    t = jnp.asarray(500.0, F32)
    attention = models.BlockCausal(chunk)
    stream = eqx.filter_jit(lambda m, x, t, c, cache, tc: m.stream(x, t, c, cache, text_cache=tc,
                                                                   attention=attention))
    full = eqx.filter_jit(lambda m, x, t, c, tc: m(x, t, c, text_cache=tc, attention=attention))

    def row(**r):
        report["rows"].append(r)
        print(json.dumps(r), flush=True)

    for P in prefixes:
        cache = model.kv_cache(h, w, max_frames=max(P, chunk))
        for _ in range(P // chunk):  # fill it with P frames
            _, cache = stream(model, x, t, context, cache, text_cache)
        cache = jax.block_until_ready(cache)
        start = time.perf_counter()
        compiled = stream.lower(model, x, t, context, cache, text_cache).compile()
        compile_s = time.perf_counter() - start
        cached = best(compiled, model, x, t, context, cache, text_cache)
        video = jax.random.normal(keys[3], (16, P + chunk, h, w), F32).astype(BF16)
        recompute = best(full, model, video, t, context, text_cache)
        row(kind="chunk", prefix_frames=P, cached_s=cached, recompute_s=recompute,
            recompute_over_cached=recompute / cached, compile_s=compile_s,
            cache_gib=2 * cache.k.nbytes / 2**30)
        del cache
    # The cache's size against the video's length, analytically (latent frames = 4 s fps / 4).
    for s in (5, 20, 60):
        frames = int(s * 16 / 4)
        full_gib = config.num_layers * 2 * frames * tokens_per_frame * config.dim * 2 / 2**30
        window_gib = config.num_layers * 2 * window * tokens_per_frame * config.dim * 2 / 2**30
        row(kind="cache_size", seconds=s, latent_frames=frames, all_frames_gib=full_gib,
            window_gib=window_gib)
    # A video in chunks: FewStep's 4 steps and the clean pass per chunk, a rolling window.
    scheduler = sampling.FewStep()
    plan = scheduler.plan(len(scheduler.timesteps))

    @eqx.filter_jit
    def chunk_of(m, noise, c, cache, tc, key):
        x, state = noise, scheduler.init(noise)
        for i in range(plan.steps):
            v, _ = m.stream(x.astype(BF16), scheduler.timestep(plan, i), c, cache, text_cache=tc,
                            attention=attention)
            x, state = scheduler.step(plan, state, i, v.astype(F32), x, key=jax.random.fold_in(key, i))
        _, cache = m.stream(x.astype(BF16), jnp.zeros((), F32), c, cache, text_cache=tc, attention=attention)
        return x, cache

    for s in seconds_list:
        chunks = max(1, int(s * 16 / 4) // chunk)
        cache = model.kv_cache(h, w, max_frames=window)
        start = time.perf_counter()
        times = []
        for i in range(chunks):
            t0 = time.perf_counter()
            noise = jax.random.normal(jax.random.fold_in(keys[3], i), (16, chunk, h, w), F32)
            out, cache = chunk_of(model, noise, context, cache, text_cache, jax.random.fold_in(keys[2], i))
            jax.block_until_ready((out, cache))
            times.append(time.perf_counter() - t0)
        steady = min(times[1:]) if len(times) > 1 else times[0]
        row(kind="video", seconds=s, chunks=chunks, window_frames=window,
            first_chunk_s=times[0], steady_chunk_s=steady, total_s=time.perf_counter() - start,
            video_fps=chunk * 4 / steady, peak_gib=peak_gib())
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "tpu_stream.json"), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
