"""A Wan denoising step on an accelerator: where its time goes, and the 50-step estimate.

    python benchmarks/tpu/tpu_wan_step.py --out DIR                   # Wan 2.1 1.3B, 480p x 81
    python benchmarks/tpu/tpu_wan_step.py --model 14b --layers 1 --out DIR   # one 14B block
    python benchmarks/tpu/tpu_wan_step.py --smoke --out DIR           # tiny, anywhere

One forward of `models.WanTransformer3D` (random weights at the real size, bf16) on one
video latent `(16, F, H/8, W/8)` with the 512-token text context, as a sampler runs it
per step and guidance branch, compiled once and timed (best of 3); then the same model
with its attention replaced by a stand-in that returns q (`--ablate`, the default): the
difference is the attention's share. The step's dot FLOPs (`_model_flops.wan_flops`)
against the bf16 matmul rate measured in the same process give the fraction of the
chip's limit; `50 steps x 2 branches` of the step estimate a guided 50-step video.
`--quantize none,int8-weights,w8a8,int8-qk,int8` times the same step with the model
quantized (`models.quantize`: int8 weights; W8A8; W8A8 with Q.Kᵀ in int8; W8A8 with int8
attention, `from_pretrained(quantize="int8")`) in the same process, each against the bf16 step:
its time, the relative error and cosine of its output, and for each block the cosine and
relative error of the block's update (output minus input) from the quantized block
against the float block, both given the float model's input to that block.
`--loop STEPS` also runs each quantized model's whole guided loop (`sampling.sample`,
STEPS steps, both branches batched), `--loop-runs` times (default 2: its first call,
compiling, and a warm one).
`--profile DIR` also writes a `jax.profiler` trace of two steps; `--compile-cache DIR`
switches on JAX's persistent compilation cache there (a second process then loads the
step's program instead of compiling it: its `compile_s`).
"""

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the shared harness
from _harness import write_json  # noqa: E402  (also puts this checkout first on sys.path)
from _model_flops import wan_flops  # noqa: E402
from vidax_eqx import kernels, models, sampling  # noqa: E402
from vidax_eqx.models.wan import _model as wan_model  # noqa: E402  (block_errors' scan)


BF16, F32 = jnp.bfloat16, jnp.float32


@dataclasses.dataclass(frozen=True)
class StandIn(kernels.AbstractImplementation):
    """Attention replaced by `out = q` (lse 0): the step without its attention."""

    name = "stand_in"
    capabilities = kernels.Capabilities(platforms=("cpu", "gpu", "tpu"), tile_mask=True, kv_lengths=True)

    def fwd(self, ops, opts):
        B, S, H, D = ops.q.shape
        return ops.q, jnp.zeros((B, H, S), F32)

    def bwd(self, ops, opts, out, lse, dout, dlse):
        return dout.astype(ops.q.dtype), jnp.zeros_like(ops.k), jnp.zeros_like(ops.v), None, None


def seconds(fn, args, reps=3) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


STEP = eqx.filter_jit(lambda m, x, t, c: m(x, t, c))
# `--quantize` modes: models.quantize's (weights, activations, attention).
MODES = {"int8-weights": ("int8", None, None), "w8a8": ("int8", "int8", None),
         "int8-qk": ("int8", "int8", "int8-qk"), "int8": ("int8", "int8", "int8")}


def matmul_tflops(n: int, dtype=BF16) -> float:
    """The chip's matmul rate (TFLOP/s; int8: TOP/s with an int32 sum) at `n x n x n`."""
    a = jax.random.normal(jax.random.key(0), (n, n), F32).astype(dtype)
    f = jax.jit(lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.int32 if dtype == jnp.int8 else dtype))
    jax.block_until_ready(f(a, a))
    start = time.perf_counter()
    for _ in range(10):
        out = f(a, a)
    jax.block_until_ready(out)
    return 2.0 * n**3 * 10 / (time.perf_counter() - start) / 1e12


def relative_l2(a, b):
    return jnp.linalg.norm(a - b) / jnp.linalg.norm(b)


def cosine(a, b):
    return jnp.vdot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b))


def tree_bytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def block_errors(model, quantized, x, t, context) -> list[tuple[float, float]]:
    """`[(cosine, relative L2)]` of each block's update (output minus input) from
    `quantized`'s block against `model`'s, both given `model`'s input to that block.

    The float model's forward runs with its block scan replaced (in this process only)
    by one that also runs the quantized block on the same input and reports the two
    updates' agreement through a host callback."""
    rows = {}
    q_arrays, q_static = eqx.partition(quantized.blocks, eqx.is_array)

    def paired_scan(fn, x, layers, policy):
        blocks, text_cache = layers
        f_arrays, f_static = eqx.partition(blocks, eqx.is_array)

        def step(carry, arrays):
            i, f_layer, q_layer = arrays
            y = fn(carry, (eqx.combine(f_layer, f_static), None))
            y_q = fn(carry, (eqx.combine(q_layer, q_static), None))
            d, d_q = (y - carry).astype(F32), (y_q - carry).astype(F32)
            jax.debug.callback(lambda i, c, r: rows.__setitem__(int(i), (float(c), float(r))),
                               i, cosine(d_q, d), relative_l2(d_q, d))
            return y, None

        index = jnp.arange(jax.tree.leaves(f_arrays)[0].shape[0])
        return jax.lax.scan(step, x, (index, f_arrays, q_arrays))[0]

    original, wan_model.scan_layers = wan_model.scan_layers, paired_scan
    try:
        # a new jit: STEP's cached trace of `model` would skip the replaced scan
        jax.block_until_ready(eqx.filter_jit(lambda m, x, t, c: m(x, t, c))(model, x, t, context))
    finally:
        wan_model.scan_layers = original
    return [rows[i] for i in sorted(rows)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="1.3b", choices=("1.3b", "14b"))
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: the model's)")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--no-ablate", dest="ablate", action="store_false")
    parser.add_argument("--profile", metavar="DIR", default=None)
    parser.add_argument("--compile-cache", metavar="DIR", default=None,
                        help="JAX's persistent compilation cache in DIR (run twice: the second "
                             "process's compile_s is its load from the cache)")
    parser.add_argument("--quantize", default="none",
                        help="comma-separated: none, int8-weights, w8a8, int8-qk, int8")
    parser.add_argument("--loop", type=int, default=0, metavar="STEPS",
                        help="also run sampling.sample's guided loop of STEPS steps with each "
                             "quantized model, twice (first call, warm)")
    parser.add_argument("--loop-runs", type=int, default=2, help="--loop: calls of the loop (the first compiles)")
    parser.add_argument("--no-block-errors", dest="block_errors", action="store_false",
                        help="skip the per-block comparison of the quantized blocks")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=".", metavar="DIR")
    args = parser.parse_args()
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    preset = {"1.3b": "t2v-1.3b", "14b": "t2v-14b"}[args.model]
    overrides = {} if args.layers is None else dict(num_layers=args.layers)
    if args.smoke:
        config = models.WanConfig(dim=64, ffn_dim=128, num_heads=2, num_layers=2, text_dim=32)
        latent = (16, 2, 4, 8)
        text = (8, 32)
    else:
        config = models.WanConfig.preset(preset, **overrides)
        latent = (16, 1 + (args.frames - 1) // 4, args.height // 8, args.width // 8)
        text = (512, config.text_dim)
    grid = (latent[1], latent[2] // 2, latent[3] // 2)
    tokens = math.prod(grid)
    stamp = dict(date=datetime.date.today().isoformat(), jax=jax.__version__,
                 device=jax.devices()[0].device_kind, model=preset, layers=config.num_layers,
                 latent=latent, tokens=tokens)
    print(stamp, flush=True)
    matmul = matmul_tflops(1024 if args.smoke else 8192)
    print(f"bf16 matmul {matmul:.1f} TFLOP/s", flush=True)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], latent, F32).astype(BF16)
    context = jax.random.normal(keys[1], text, F32).astype(BF16)
    t = jnp.asarray(500.0, F32)
    flops = wan_flops(dict(dim=config.dim, ffn_dim=config.ffn_dim, num_layers=config.num_layers,
                           num_heads=config.num_heads), tokens)["fwd_total"]
    attn_flops = config.num_layers * 4 * tokens * tokens * config.dim
    report = dict(stamp, matmul_tflops=matmul, fwd_flops=flops, attention_flops=attn_flops)

    def step_of(implementation):
        start = time.perf_counter()
        model = models.WanTransformer3D(config, implementation=implementation, dtype=BF16, key=keys[2])
        model = jax.block_until_ready(model)
        built = time.perf_counter() - start
        start = time.perf_counter()
        compiled = STEP.lower(model, x, t, context).compile()
        compile_s = time.perf_counter() - start
        return model, compiled, built, compile_s

    model, compiled, built, compile_s = step_of("auto")
    step_s = seconds(lambda *a: compiled(*a), (model, x, t, context))
    report.update(build_s=built, compile_s=compile_s, step_s=step_s, tflops=flops / step_s / 1e12,
                  of_matmul=flops / step_s / 1e12 / matmul, guided_50_steps_s=100 * step_s,
                  limit_50_steps_s=100 * flops / (matmul * 1e12))
    print(json.dumps(report), flush=True)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        with jax.profiler.trace(args.profile):
            for _ in range(2):
                jax.block_until_ready(compiled(model, x, t, context))
    reference = compiled(model, x, t, context).astype(F32)
    del compiled
    modes = [m for m in args.quantize.split(",") if m != "none"]
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"tpu_wan_step: --quantize takes {sorted(MODES)} and none; received {mode!r}")
    if modes:
        report["int8_matmul_tops"] = matmul_tflops(1024 if args.smoke else 8192, jnp.int8)
    for mode in modes:
        quantized = models.quantize(model, *MODES[mode])
        compiled = STEP.lower(quantized, x, t, context).compile()
        q_step_s = seconds(lambda *a: compiled(*a), (quantized, x, t, context))
        out = compiled(quantized, x, t, context).astype(F32)
        per_block = block_errors(model, quantized, x, t, context) if args.block_errors else [(None, None)]
        report.setdefault("quantized", {})[mode] = dict(
            step_s=q_step_s, of_bf16=q_step_s / step_s, guided_50_steps_s=100 * q_step_s,
            out_rel_l2=float(relative_l2(out, reference)), out_cosine=float(cosine(out, reference)),
            block_update_cosine_min=min((c for c, _ in per_block if c is not None), default=None),
            block_update_rel_l2_max=max((r for _, r in per_block if r is not None), default=None),
            blocks=per_block,
            weight_bytes=tree_bytes(quantized), bf16_weight_bytes=tree_bytes(model))
        print(mode, json.dumps({k: v for k, v in report["quantized"][mode].items() if k != "blocks"}),
              flush=True)
        del compiled
        if args.loop:  # the whole guided loop, compiled once: its first and second calls
            runs = []
            for _ in range(args.loop_runs):
                start = time.perf_counter()
                jax.block_until_ready(sampling.sample(
                    quantized, x[None], context[None], negative_context=0.5 * context[None],
                    steps=args.loop, progress=None))
                runs.append(time.perf_counter() - start)
            report["quantized"][mode].update(loop_steps=args.loop, loop_runs_s=runs)
            print(mode, f"{args.loop} guided steps: {runs} s (the first compiles)", flush=True)
        del quantized
    del model
    if args.ablate:
        model, compiled, _, _ = step_of(StandIn())
        rest_s = seconds(lambda *a: compiled(*a), (model, x, t, context))
        rest_flops = flops - attn_flops
        report.update(without_attention_s=rest_s, attention_s=step_s - rest_s,
                      without_attention_tflops=rest_flops / rest_s / 1e12,
                      without_attention_of_matmul=rest_flops / rest_s / 1e12 / matmul,
                      attention_tflops=attn_flops / max(step_s - rest_s, 1e-9) / 1e12)
        del model, compiled
    print(json.dumps(report), flush=True)
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, f"tpu_wan_step_{args.model}_{config.num_layers}.json"), report)


if __name__ == "__main__":
    sys.exit(main())
