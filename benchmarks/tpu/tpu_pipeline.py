"""Whole pipeline runs and streamed blocks on one accelerator, under the memory plan.

    python benchmarks/tpu/tpu_pipeline.py pipeline --out DIR   # Wan 2.1 T2V 1.3B, 480p x 81, 50 steps
    python benchmarks/tpu/tpu_pipeline.py stream --out DIR     # Wan 2.1 14B blocks streamed
    python benchmarks/tpu/tpu_pipeline.py pipeline --smoke --out DIR   # tiny, anywhere

`pipeline`: a `WanPipeline` of UMT5-XXL, the Wan 2.1 T2V 1.3B transformer and the Wan
VAE with random weights at their real sizes (bf16; the VAE float32), its components
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


def run_pipeline(args, report, save):
    device = jax.devices()[0]
    key = jax.random.key(0)
    if args.smoke:
        t5 = models.T5EncoderConfig(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
        wan = models.WanConfig(dim=64, ffn_dim=128, num_heads=2, num_layers=2, text_dim=32)
        vae = models.WanVAEConfig.wan21(base_dim=8)
        height, width, frames, steps, length = 32, 48, 5, 2, 16
    else:
        t5, wan = models.T5EncoderConfig(), models.WanConfig.preset("t2v-1.3b")
        vae = models.WanVAEConfig.wan21()
        height, width, frames, steps, length = args.height, args.width, args.frames, args.steps, 512
    abstract = dict(
        text_encoder=eqx.filter_eval_shape(lambda: models.T5Encoder(t5, dtype=BF16, key=key)),
        transformer=eqx.filter_eval_shape(lambda: models.WanTransformer3D(wan, dtype=BF16, key=key)),
        vae=eqx.filter_eval_shape(lambda: models.WanVAE(vae, dtype=F32, key=key)))
    pipe = pipelines.WanPipeline(
        tokenizer=interop.TextTokenizer.from_pretrained(os.path.join(FIXTURE, "tokenizer")),
        scheduler=sampling.scheduler_from_config(os.path.join(FIXTURE, "scheduler")), **abstract)
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
        out = pipe("A cat walks on the grass, realistic", height=height, width=width,
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
        latent = (16, 1 + (args.frames - 1) // 4, args.height // 8, args.width // 8)
        text = (512, base["text_dim"])
    branches = 2 if args.guided else 1  # guided: [conditional; unconditional], as the loop runs it
    x = jax.random.normal(key, (branches, *latent), F32).astype(BF16)
    context = jax.random.normal(key, (branches, *text), F32).astype(BF16)
    t = jnp.asarray(500.0, F32)
    step = eqx.filter_jit(lambda m, x, t, c: jax.vmap(lambda x, c: m(x, t, c))(x, c))

    def measure(layers, streamed):
        config = models.WanConfig(**{**base, "num_layers": layers})
        abstract = eqx.filter_eval_shape(lambda: models.WanTransformer3D(config, dtype=BF16, key=key))
        blocks = {id(a) for a in streamed_leaves(abstract)}
        model = materialize(abstract, lambda a: host if streamed and id(a) in blocks else on_device, key)
        start = time.perf_counter()
        compiled = step.lower(model, x, t, context).compile()
        compile_s = time.perf_counter() - start
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            jax.block_until_ready(compiled(model, x, t, context))
            times.append(time.perf_counter() - start)
        weights = sum(a.size * a.dtype.itemsize for a in streamed_leaves(model))
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
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=8, help="stream: blocks resident and streamed")
    parser.add_argument("--all-blocks", type=int, default=40, help="stream: blocks streamed (14B: 40)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--guided", action="store_true",
                        help="stream: both guidance branches in one step (the sampling loop's batch)")
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
