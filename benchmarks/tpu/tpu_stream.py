"""Streaming generation with a key/value cache on an accelerator: a Wan chunk step against
recomputing the prefix, and the cache's memory against the video's length.

    python benchmarks/tpu/tpu_stream.py --out DIR      # Wan 2.1 1.3B, 480p, chunks of 3 latent frames
    python benchmarks/tpu/tpu_stream.py --smoke --out DIR
    python benchmarks/tpu/tpu_stream.py --first-frame --compile-cache /tmp/cc --out DIR  # twice
    python benchmarks/tpu/tpu_stream.py --one-length --seconds 20 --window 6 --out DIR

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
2 bytes). Every call is compiled ahead of time and timed as the best of 3. Results to
stdout and `DIR/tpu_stream.json`. The peak memory of those rows is the process's, set by
the largest row before it; `--one-length` measures it per length.

Two more modes, each one section in its own process (run them one process at a time),
through the pipeline's own streaming loop: `WanPipeline.stream` (`stream_video` in
`vidax_eqx/pipelines/_stream.py`) with random-weight components, given prompt
embeddings (the 512-token text, no text encoder), FewStep's 4 steps, no guidance:

- `--first-frame`: the seconds to the first decoded frame, from the call of `stream` (its
  text cache built in it) to the first chunk's frames decoded by `WanVAE.decode_stream`
  and on the host (NumPy), over a video of `--latent-frames` (default 3: one chunk, an
  empty key/value cache; 9, three chunks, also compiles and times the decode's second
  program, every chunk's after the first). The VAE is a `models.WanVAE` of the default
  config (Wan 2.1's) with random weights, in `--vae-dtype` (default float32, the
  pipelines' default; on v5e with 9 latent frames its first decode program did not fit
  beside the transformer and a 6-frame cache, see `docs/benchmarks.md`). The loop's three
  compiled functions (`_text_caches`, `_denoise`, `_decode`) are wrapped, not changed:
  each call's dispatch time is recorded (tracing and compiling, or loading from the
  compilation cache, happen there; the device's work is not waited for, so the loop's
  timing is the pipeline's) with JAX's compile events during it; after the first chunk
  each is timed again on its recorded arguments, best of 3, compiled (steady state), and
  the decode programs' `memory_analysis` is reported at the end. With
  `--compile-cache DIR` (`vidax_eqx.pipelines.enable_compile_cache`) the run is *cold*
  when DIR is empty and *warm* when an earlier process filled it. Results to
  `DIR/tpu_stream_first_frame_{cold,warm}.json`, rewritten after each stage.
- `--one-length`: one video length (`--seconds`, one value; latent frames
  `3 ceil(4 s / 3)` at 16 fps) in chunks, `output_type="latent"` (no decode), the cache
  holding `--window` latent frames (default 6; 0: every earlier frame, the pipeline's
  default), and the device's `peak_bytes_in_use` at the end: with one length per
  process, each length gets its own peak. Results to
  `DIR/tpu_stream_length_{S}s_{window}.json`.
"""

import argparse
import collections
import contextlib
import datetime
import json
import math
import os
import sys
import time

PROCESS_START = time.perf_counter()  # before JAX's import

import equinox as eqx
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the shared harness
from _harness import write_json  # noqa: E402  (also puts this checkout first on sys.path)
from vidax_eqx import models, pipelines, sampling  # noqa: E402
from vidax_eqx.pipelines import _stream  # noqa: E402


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


def memory() -> dict:
    """The device's allocator figures now (`bytes_in_use`, `peak_bytes_in_use` and
    `bytes_limit`, GiB); empty where the backend has none (the CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return {f"{k}_gib": stats[k] / 2**30 for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
            if k in stats}


def build_pipeline(config, *, vae: bool, vae_dtype, smoke: bool, key, quantize: bool = False):
    """A `WanPipeline` of random-weight components (no tokenizer or text encoder: the
    calls take prompt embeddings); `vae=False` keeps only the VAE's config (its shapes,
    no weights on the device) for `output_type="latent"`."""
    k1, k2 = jax.random.split(key)
    # Op by op: ~20 s on v5e; one compiled call was slower there (46 s, its compile).
    transformer = models.WanTransformer3D(config, dtype=BF16, key=k1)
    if quantize:  # W8A8: a chunk's attention over its cache stays in bf16
        transformer = models.quantize(transformer, activations="int8")
    transformer = jax.block_until_ready(transformer)
    vae_config = models.WanVAEConfig.wan21(base_dim=8, num_res_blocks=1) if smoke else None
    if vae:
        decoder = jax.block_until_ready(models.WanVAE(vae_config, dtype=vae_dtype, key=k2))
    else:
        decoder = eqx.filter_eval_shape(lambda k: models.WanVAE(vae_config, dtype=vae_dtype, key=k), k2)
    return pipelines.WanPipeline(tokenizer=None, text_encoder=None, transformer=transformer,
                                 vae=decoder, scheduler=sampling.FewStep())


class _Timed:
    """One of the streaming loop's compiled functions, wrapped: each call's dispatch
    time (tracing and compiling, or loading, happen in it; the device's work is not
    waited for) and the compile events during it, and its arguments for re-timing."""

    def __init__(self, name, fn, log):
        self.name, self.fn, self.log, self.calls = name, fn, log, []

    def __call__(self, *args):
        self.log.phase = f"{self.name}[{len(self.calls)}]"
        self.log.events[self.log.phase] = collections.defaultdict(float)
        start = time.perf_counter()
        out = self.fn(*args)
        self.calls.append(dict(args=args, dispatch_s=time.perf_counter() - start))
        self.log.phase = None
        return out


class _CompileLog:
    """JAX's compile events (seconds, summed) per wrapped call, by `jax.monitoring`."""

    NAMES = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
             "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
             "/jax/core/compile/backend_compile_duration": "compile_or_load_s",
             "/jax/compilation_cache/cache_retrieval_time_sec": "cache_load_s"}

    def __init__(self):
        self.phase, self.events = None, {}

    def __call__(self, event, duration, **_):
        name = self.NAMES.get(event)
        if name is not None and self.phase is not None:
            self.events[self.phase][name] += duration


@contextlib.contextmanager
def timed_loop(log):
    """`_stream`'s `_text_caches`, `_denoise` and `_decode` wrapped for the duration (the
    loop looks them up at each call), restored after."""
    names = ("_text_caches", "_denoise", "_decode")
    saved = {n: getattr(_stream, n) for n in names}
    wrapped = {n: _Timed(n.strip("_"), saved[n], log) for n in names}
    for n, w in wrapped.items():
        setattr(_stream, n, w)
    jax.monitoring.register_event_duration_secs_listener(log)
    try:
        yield {n.strip("_"): w for n, w in wrapped.items()}
    finally:
        for n, f in saved.items():
            setattr(_stream, n, f)
        jax.monitoring.unregister_event_duration_listener(log)


def first_frame(args, config, h, w, text, chunk, report, out_path) -> int:
    """`--first-frame`: the seconds to the first decoded frame of `WanPipeline.stream`,
    cold or warm, its split, and the compiled pieces' steady-state times."""
    cache_dir = None
    if args.compile_cache:
        entries = os.listdir(args.compile_cache) if os.path.isdir(args.compile_cache) else []
        cache_dir = pipelines.enable_compile_cache(args.compile_cache)
        report.update(compile_cache=cache_dir, cache_entries_at_start=len(entries),
                      start="warm" if entries else "cold")
    else:
        report.update(compile_cache=None, start="cold (no persistent cache)")
    vae_dtype = jnp.dtype(args.vae_dtype)
    F = args.latent_frames
    report.update(latent_frames=F, num_frames=1 + 4 * (F - 1), vae_dtype=vae_dtype.name,
                  steps=len(sampling.FewStep().timesteps), rows=[])

    def row(**r):
        report["rows"].append(r)
        print(json.dumps(r), flush=True)
        write_json(out_path, report)

    start = time.perf_counter()
    pipe = build_pipeline(config, vae=True, vae_dtype=vae_dtype, smoke=args.smoke, quantize=args.quantize,
                          key=jax.random.key(0))
    embeds = jax.random.normal(jax.random.key(1), (1, *text), F32).astype(BF16)
    row(kind="setup", build_s=time.perf_counter() - start,
        since_process_start_s=time.perf_counter() - PROCESS_START, **memory())
    log = _CompileLog()
    try:
        return _first_frame_loop(pipe, embeds, h, w, F, chunk, log, row)
    except Exception as e:  # recorded (e.g. a program that does not fit), then raised
        row(kind="error", error=f"{type(e).__name__}: {str(e)[:600]}", events={
            k: dict(v) for k, v in log.events.items()}, **memory())
        raise


def _first_frame_loop(pipe, embeds, h, w, F, chunk, log, row) -> int:
    with timed_loop(log) as fns:
        t0 = time.perf_counter()
        chunks = pipe.stream(prompt_embeds=embeds, height=8 * h, width=8 * w,
                             num_frames=1 + 4 * (F - 1), chunk_frames=chunk, seed=0)
        durations, resume = [], t0  # each chunk's seconds, this loop's own work left out
        for index, c in enumerate(chunks):
            durations.append(time.perf_counter() - resume)
            if index == 0:
                calls = {n: f.calls[0] for n, f in fns.items()}
                row(kind="first_frame", seconds=durations[0], chunk_seconds=c.seconds,
                    frames=int(c.frames.shape[1]), frame_shape=list(c.frames.shape[2:]),
                    **{f"{n}_dispatch_s": calls[n]["dispatch_s"] for n in calls},
                    events={n: dict(log.events[f"{n}[0]"]) for n in calls})
                # The pieces compiled: their run times on the same arguments, best of 3.
                steady = {n: best(fns[n].fn, *calls[n]["args"]) for n in calls}
                row(kind="steady_first_chunk", **{f"{n}_s": t for n, t in steady.items()},
                    sum_s=sum(steady.values()))
            resume = time.perf_counter()
    row(kind="chunks", chunk_s=durations,
        dispatch_s={n: [c["dispatch_s"] for c in f.calls] for n, f in fns.items()},
        events={k: dict(v) for k, v in log.events.items()})
    if len(fns["decode"].calls) > 1:  # a later chunk's decode (the state carried in)
        later = fns["decode"].calls[-1]["args"]
        denoise = fns["denoise"].calls[-1]["args"]
        row(kind="steady_later_chunk", decode_s=best(fns["decode"].fn, *later),
            denoise_s=best(fns["denoise"].fn, *denoise))
    # The decode programs' memory (compiled again: from the compilation cache when on).
    for i, call in enumerate(fns["decode"].calls[:2]):
        analysis = fns["decode"].fn.lower(*call["args"]).compile().compiled.memory_analysis()
        row(kind="decode_memory", program="first chunk" if i == 0 else "later chunks",
            **{k.removesuffix("_size_in_bytes") + "_gib": getattr(analysis, k) / 2**30
               for k in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                         "generated_code_size_in_bytes")})
    row(kind="end", process_s=time.perf_counter() - PROCESS_START, **memory())
    return 0


def one_length(args, config, h, w, text, chunk, report, out_path) -> int:
    """`--one-length`: one video length in chunks, `output_type="latent"`, and the
    device's peak memory at the end of the process."""
    if len(args.seconds) != 1:
        raise SystemExit("--one-length takes one --seconds value")
    if args.compile_cache:
        report.update(compile_cache=pipelines.enable_compile_cache(args.compile_cache))
    seconds = args.seconds[0]
    F = chunk * math.ceil(4 * seconds / chunk)
    window = args.window or None
    report.update(seconds=seconds, latent_frames=F, num_frames=1 + 4 * (F - 1),
                  max_cached_frames=window if window else F - chunk, rows=[])

    def row(**r):
        report["rows"].append(r)
        print(json.dumps(r), flush=True)
        write_json(out_path, report)

    pipe = build_pipeline(config, vae=False, vae_dtype=F32, smoke=args.smoke, key=jax.random.key(0),
                          quantize=args.quantize)
    embeds = jax.random.normal(jax.random.key(1), (1, *text), F32).astype(BF16)
    row(kind="setup", **memory())
    ends = []
    for c in pipe.stream(prompt_embeds=embeds, height=8 * h, width=8 * w, num_frames=1 + 4 * (F - 1),
                         chunk_frames=chunk, max_cached_frames=window, seed=0, output_type="latent"):
        ends.append(c.seconds)
    times = [b - a for a, b in zip([0.0] + ends, ends)]
    steady = min(times[1:]) if len(times) > 1 else times[0]
    cache_frames = report["max_cached_frames"]
    row(kind="length", chunks=len(times), first_chunk_s=times[0], steady_chunk_s=steady,
        total_s=ends[-1], video_fps=chunk * 4 / steady,
        cache_gib=config.num_layers * 2 * cache_frames * (h // 2) * (w // 2) * config.dim * 2 / 2**30,
        **memory())
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, nargs="*", default=[5, 20, 60],
                        help="video lengths of the chunked runs (16 fps)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=".", metavar="DIR")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--first-frame", action="store_true",
                      help="only the seconds to the first decoded frame (WanPipeline.stream)")
    mode.add_argument("--one-length", action="store_true",
                      help="only one --seconds length in chunks, and the device's peak at the end")
    parser.add_argument("--latent-frames", type=int, default=3,
                        help="--first-frame: the video's latent frames, a multiple of 3 (3: one "
                             "chunk, no key/value cache, the first decode program only)")
    parser.add_argument("--vae-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="--first-frame: the VAE's parameters")
    parser.add_argument("--window", type=int, default=6,
                        help="--one-length: latent frames the cache holds (0: every earlier one)")
    parser.add_argument("--compile-cache", metavar="DIR",
                        help="JAX's persistent compilation cache in DIR (enable_compile_cache)")
    parser.add_argument("--quantize", action="store_true",
                        help="--first-frame / --one-length: the transformer in W8A8 (models.quantize("
                             "activations='int8'); a chunk's attention over its cache stays bf16)")
    args = parser.parse_args()
    if args.smoke:
        config = models.WanConfig(dim=64, ffn_dim=128, num_heads=2, num_layers=2, text_dim=32)
        h, w, text, chunk, prefixes, window = 4, 8, (8, 32), 3, (0, 3, 6), 3
        seconds_list = args.seconds[:1] if args.one_length else [1.0]
    else:
        config = models.WanConfig.preset("t2v-1.3b")
        h, w, text, chunk, prefixes, window = 60, 104, (512, config.text_dim), 3, (0, 6, 18), 6
        seconds_list = args.seconds
    tokens_per_frame = (h // 2) * (w // 2)
    report = dict(date=datetime.date.today().isoformat(), jax=jax.__version__,
                  device=jax.devices()[0].device_kind, latent_hw=(h, w), chunk_frames=chunk,
                  tokens_per_frame=tokens_per_frame, quantize="w8a8" if args.quantize else None, rows=[])
    print({k: v for k, v in report.items() if k != "rows"}, flush=True)
    if args.first_frame or args.one_length:
        args.seconds = seconds_list
        os.makedirs(args.out, exist_ok=True)
    if args.first_frame:
        name = "first_frame_" + ("warm" if args.compile_cache and os.path.isdir(args.compile_cache)
                                 and os.listdir(args.compile_cache) else "cold")
        return first_frame(args, config, h, w, text, chunk, report,
                           os.path.join(args.out, f"tpu_stream_{name}.json"))
    if args.one_length:
        name = f"length_{args.seconds[0]:g}s_{args.window or 'all'}"
        return one_length(args, config, h, w, text, chunk, report,
                          os.path.join(args.out, f"tpu_stream_{name}.json"))
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
