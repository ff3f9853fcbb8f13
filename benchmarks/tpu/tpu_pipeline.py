"""Whole pipeline runs and streamed blocks on one accelerator, under the memory plan.

    python benchmarks/tpu/tpu_pipeline.py pipeline --out DIR   # Wan 2.1 T2V 1.3B, 480p x 81, 50 steps
    python benchmarks/tpu/tpu_pipeline.py stream --out DIR     # Wan 2.1 14B blocks streamed
    python benchmarks/tpu/tpu_pipeline.py pipeline --smoke --out DIR   # tiny, anywhere
    python benchmarks/tpu/tpu_pipeline.py pipeline --model i2v-14b --steps 3 --out DIR

`pipeline`: a `WanPipeline` of UMT5-XXL, the Wan 2.1 T2V 1.3B transformer (or
`--model`'s: T2V / I2V 14B with CLIP, Wan 2.2 TI2V-5B at 720p x 121 with its VAE, T2V
A14B's two experts) and the Wan VAE with random weights at their real sizes (bf16; the VAE float32), its components
planned by `plan_memory("auto")` before any array exists and made where the plan puts
them (nothing is ever all on the chip); then whole calls (text, denoise, decode) of
480p x 81 frames, 50 guided steps, timed per stage: the first call (compiling), then
warm calls; the chip's peak memory after each.

`stream`: the host-to-chip bandwidth (`device_put` of 1 GiB from pinned host memory),
then one forward of a Wan 2.1 14B transformer (one guidance branch, or with `--guided`
both, batched as the sampling loop runs them; 480p x 81) with its
blocks resident and streamed from host memory at the same block count (`--blocks`,
what fits resident), and streamed with all 40 blocks (28 GB of bf16, more than the
chip holds): the streamed step against the same step's compute.

`--quantize int8-weights|int8`: the transformer in int8 (`from_pretrained(quantize=)`'s
formats; its int8 matrices are zeros here, which costs the same as any values).
"""

import argparse
import dataclasses
import datetime
import functools
import json
import os
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import write_json  # noqa: E402  (also puts this checkout first on sys.path)
from vidax_eqx import interop, models, pipelines, sampling  # noqa: E402
from vidax_eqx.models.internal import quantize_to  # noqa: E402
from vidax_eqx.pipelines import streamed_leaves  # noqa: E402
from vidax_eqx.pipelines._memory import Residency  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "wan_pipeline", "t2v")


def materialize(abstract, sharding_of, key):
    """`abstract`'s arrays made where `sharding_of(leaf)` says, one array at a time, by a
    compiled program whose output lands there (random normal x 0.02; zeros on the host
    CPU, where drawing billions of numbers would take minutes); one program per shape."""
    leaves, treedef = jax.tree.flatten(abstract, is_leaf=lambda a: isinstance(a, jax.ShapeDtypeStruct))
    out = []
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            out.append(leaf)
            continue
        maker = _maker(leaf.shape, jnp.dtype(leaf.dtype), sharding_of(leaf))
        out.append(jax.block_until_ready(maker(jax.random.fold_in(key, i))))
    return jax.tree.unflatten(treedef, out)


@functools.cache
def _maker(shape, dtype, sharding):
    if next(iter(sharding.device_set)).platform == "cpu" or not jnp.issubdtype(dtype, jnp.floating):
        return jax.jit(lambda k: jnp.zeros(shape, dtype), out_shardings=sharding)
    return jax.jit(lambda k: (0.02 * jax.random.normal(k, shape, F32)).astype(dtype),
                   out_shardings=sharding)


def peak_gib(device) -> float:
    stats = device.memory_stats() or {}
    return stats.get("peak_bytes_in_use", 0) / 2**30


# The Wan pipelines `pipeline --model` builds: the transformer's preset, the VAE, the
# default video (height, width, frames), an image (I2V: CLIP; TI2V: the first frame),
# and Wan 2.2 A14B's expert boundary.
PIPELINES = {
    "t2v-1.3b": dict(vae="wan21", video=(480, 832, 81)),
    "t2v-14b": dict(vae="wan21", video=(480, 832, 81)),
    "i2v-14b": dict(vae="wan21", video=(480, 832, 81), clip=True),
    "ti2v-5b": dict(vae="wan22", video=(704, 1280, 121), expand=True),
    "t2v-a14b": dict(vae="wan21", video=(480, 832, 81), boundary=0.875),
}
# Their tiny stand-ins (`--smoke`): the same structure, a few KiB.
SMOKE = dict(dim=64, ffn_dim=128, num_heads=2, num_layers=2, text_dim=32)


def abstract_components(name: str, smoke: bool, key, quantize=None) -> tuple[dict, dict]:
    """`name`'s components as `ShapeDtypeStruct` trees (nothing allocated), the
    transformer in the format of the `quantize=` option `quantize`, and the pipeline's
    other arguments."""
    spec = PIPELINES[name]
    preset = models.WanConfig.preset(name if name != "t2v-a14b" else "t2v-14b")
    # Wan 2.2's VAE takes its latent statistics from its checkpoint: here, the identity.
    statistics = {} if spec["vae"] == "wan21" else dict(latents_mean=(0.0,) * 48, latents_std=(1.0,) * 48)
    if smoke:
        channels = dict(in_channels=preset.in_channels, out_channels=preset.out_channels)
        wan = models.WanConfig(**SMOKE, **channels, image_dim=64 if spec.get("clip") else None)
        t5 = models.T5EncoderConfig(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
        clip = models.CLIPVisionConfig(hidden_size=64, intermediate_size=128, projection_dim=32,
                                       num_hidden_layers=2, num_attention_heads=2, image_size=32,
                                       patch_size=16)
        small = dict(base_dim=8) if spec["vae"] == "wan21" else dict(base_dim=8, decoder_base_dim=16)
        vae = getattr(models.WanVAEConfig, spec["vae"])(**small, **statistics)
    else:
        wan, t5, clip = preset, models.T5EncoderConfig(), models.CLIPVisionConfig()
        vae = getattr(models.WanVAEConfig, spec["vae"])(**statistics)
    shape = lambda make: eqx.filter_eval_shape(make)  # noqa: E731
    if "boundary" in spec:
        transformer = shape(lambda: models.WanExperts(
            models.WanTransformer3D(wan, dtype=BF16, key=key),
            models.WanTransformer3D(wan, dtype=BF16, key=jax.random.fold_in(key, 1)),
            boundary=spec["boundary"]))
    else:
        transformer = shape(lambda: models.WanTransformer3D(wan, dtype=BF16, key=key))
    transformer = quantize_to(transformer, quantize, "tpu_pipeline")
    components = dict(text_encoder=shape(lambda: models.T5Encoder(t5, dtype=BF16, key=key)),
                      transformer=transformer,
                      vae=shape(lambda: models.WanVAE(vae, dtype=F32, key=key)))
    extra = dict(expand_timesteps=bool(spec.get("expand")))
    if spec.get("clip"):
        components["image_encoder"] = shape(lambda: models.CLIPVisionEncoder(clip, dtype=BF16, key=key))
        extra["image_processor"] = models.CLIPImageProcessor.from_pretrained(
            os.path.join(ROOT, "tests", "fixtures", "wan_pipeline", "i2v", "image_processor"))
    return components, extra


def run_pipeline(args, report, save):
    device = jax.devices()[0]
    key = jax.random.key(0)
    spec = PIPELINES[args.model]
    if args.smoke:
        (height, width, frames), steps, length = (32, 64, 5), min(args.steps, 2), 16
    else:
        height, width, frames = (args.height or spec["video"][0], args.width or spec["video"][1],
                                 args.frames or spec["video"][2])
        steps, length = args.steps, 512
    abstract, extra = abstract_components(args.model, args.smoke, key, args.quantize)
    image = None
    if spec.get("clip") or spec.get("expand"):  # the first frame, random pixels
        image = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    pipe = pipelines.WanPipeline(
        tokenizer=interop.TextTokenizer.from_pretrained(os.path.join(FIXTURE, "tokenizer")),
        scheduler=sampling.scheduler_from_config(os.path.join(FIXTURE, "scheduler")),
        **abstract, **extra)
    start = time.perf_counter()
    plan = pipe.plan_memory(args.offload, args.device_memory, height=height, width=width,
                            num_frames=frames)
    report["plan_s"] = time.perf_counter() - start
    report["plan"] = plan.describe()
    report["working_gib"] = {k: v / 2**30 for k, v in plan.working.items()}
    print(report["plan"], f"({report['plan_s']:.1f} s)", flush=True)
    save()
    start = time.perf_counter()
    residency = Residency(plan, device)  # each array made where the plan keeps it
    for name in plan.placement:
        component = abstract[name]
        setattr(pipe, name, materialize(component, residency.sharding_of(name, component),
                                        jax.random.fold_in(key, len(name))))
    pipe.apply_memory_plan(plan)
    report["build_s"] = time.perf_counter() - start
    report["after_build_peak_gib"] = peak_gib(device)
    save()
    runs = []
    for i in range(args.runs):
        timings = {}
        start = time.perf_counter()
        out = pipe("A cat walks on the grass, realistic", image=image, height=height, width=width,
                   num_frames=frames, num_inference_steps=steps, guidance_scale=5.0,
                   max_sequence_length=length, progress=False,
                   report=lambda stage, s: timings.__setitem__(stage, s))
        runs.append(dict(total_s=time.perf_counter() - start, stages=timings,
                         peak_gib=peak_gib(device), frames=list(out.frames.shape),
                         finite=bool(np.isfinite(out.frames).all())))
        report["runs"] = runs
        print(json.dumps(runs[-1]), flush=True)
        save()
        if time.perf_counter() - report["t0"] > args.budget_s:
            break


def run_stream(args, report, save):
    device = jax.devices()[0]
    host = Residency(None, device).host_sharding()  # the plan's: the traced step sees it
    on_device = SingleDeviceSharding(device)
    n = 2**30 if not args.smoke else 2**20
    a = jax.block_until_ready(jax.device_put(np.ones(n // 2, np.float16), host))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        b = jax.block_until_ready(jax.device_put(a, on_device))
        best = min(best, time.perf_counter() - start)
        del b
    report["host_to_device_gb_s"] = n / best / 1e9
    print("host to device", report["host_to_device_gb_s"], "GB/s", flush=True)
    del a
    save()
    key = jax.random.key(0)
    if args.smoke:
        base = dict(dim=64, ffn_dim=128, num_heads=2, text_dim=32)
        latent, text = (16, 2, 4, 8), (8, 32)
    else:
        base = dataclasses.asdict(models.WanConfig.preset("t2v-14b"))
        base.pop("num_layers")
        height, width, frames = args.height or 480, args.width or 832, args.frames or 81
        latent = (16, 1 + (frames - 1) // 4, height // 8, width // 8)
        text = (512, base["text_dim"])
    branches = 2 if args.guided else 1  # guided: [conditional; unconditional], as the loop runs it
    x = jax.random.normal(key, (branches, *latent), F32).astype(BF16)
    context = jax.random.normal(key, (branches, *text), F32).astype(BF16)
    t = jnp.asarray(500.0, F32)
    step = eqx.filter_jit(lambda m, x, t, c: jax.vmap(lambda x, c: m(x, t, c))(x, c))

    def measure(layers, streamed):
        config = models.WanConfig(**{**base, "num_layers": layers})
        abstract = eqx.filter_eval_shape(lambda: models.WanTransformer3D(config, dtype=BF16, key=key))
        abstract = quantize_to(abstract, args.quantize, "tpu_pipeline")
        blocks = {id(a) for a in streamed_leaves(abstract)}
        model = materialize(abstract, lambda a: host if streamed and id(a) in blocks else on_device, key)
        if streamed:  # as the plan streams them (int8 matrices as words on a TPU)
            model = Residency(None, device).put_streamed(model)
        start = time.perf_counter()
        compiled = step.lower(model, x, t, context).compile()
        compile_s = time.perf_counter() - start
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            jax.block_until_ready(compiled(model, x, t, context))
            times.append(time.perf_counter() - start)
        weights = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(streamed_leaves(model)))
        row = dict(layers=layers, streamed=streamed, branches=branches, compile_s=compile_s, step_s=min(times),
                   steps_s=times, block_bytes=weights, peak_gib=peak_gib(device),
                   stream_gb_s=weights / min(times) / 1e9 if streamed else None)
        del model, compiled
        print(json.dumps(row), flush=True)
        return row

    rows = report.setdefault("steps", [])
    for layers, streamed in ((args.blocks, False), (args.blocks, True), (args.all_blocks, True)):
        try:
            rows.append(measure(layers, streamed))
        except Exception as error:  # noqa: BLE001  (a measurement that fails is reported)
            rows.append(dict(layers=layers, streamed=streamed, error=repr(error)[:500]))
        save()
        if time.perf_counter() - report["t0"] > args.budget_s:
            break
    resident = next((r for r in rows if not r["streamed"] and "step_s" in r), None)
    for r in rows:
        if r["streamed"] and "step_s" in r and resident:
            r["vs_compute"] = r["step_s"] / (resident["step_s"] * r["layers"] / resident["layers"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("pipeline", "stream"))
    parser.add_argument("--offload", default="auto")
    parser.add_argument("--device-memory", default=None)
    parser.add_argument("--model", choices=sorted(PIPELINES), default="t2v-1.3b",
                        help="pipeline: the Wan pipeline (default t2v-1.3b)")
    parser.add_argument("--height", type=int, default=None, help="default: the model's video")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=8, help="stream: blocks resident and streamed")
    parser.add_argument("--all-blocks", type=int, default=40, help="stream: blocks streamed (14B: 40)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--guided", action="store_true",
                        help="stream: both guidance branches in one step (the sampling loop's batch)")
    parser.add_argument("--quantize", default=None, choices=[q for q in models.QUANTIZE if q],
                        help="the transformer in int8 (from_pretrained's quantize=)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting new runs after")
    parser.add_argument("--compile-cache", metavar="DIR", default=None)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=".", metavar="DIR")
    args = parser.parse_args()
    if args.compile_cache:
        pipelines.enable_compile_cache(args.compile_cache)
    report = dict(date=datetime.date.today().isoformat(), jax=jax.__version__,
                  device=jax.devices()[0].device_kind, what=args.what, t0=time.perf_counter(),
                  args={k: v for k, v in vars(args).items() if k != "out"})
    path = os.path.join(args.out, f"tpu_pipeline_{args.what}.json")
    save = lambda: write_json(path, {k: v for k, v in report.items() if k != "t0"})  # noqa: E731
    (run_pipeline if args.what == "pipeline" else run_stream)(args, report, save)
    save()


if __name__ == "__main__":
    sys.exit(main())
