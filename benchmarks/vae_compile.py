"""The Wan VAE's cold start on this machine's default device: the compile time and the
steady-state time of a decode (and optionally an encode) at real size, per chunk size, in
one process.

Wan 2.1's VAE at its real width (`WanVAEConfig.wan21()`, random weights), latents
`(16, 1 + (frames - 1) / 4, height / 8, width / 8)` (480p x 81 frames by default: 21 x 60 x
104). Each chunk size's program (`models.internal.vae_program`, the body of
`WanVAE.decode`) is lowered and compiled ahead of time (`compile s`: `lower().compile()`,
JAX's persistent compilation cache switched off so that every compile is a cold one),
then run once (`first run s`) and `--rounds` more times (`steady s`: the median). Also
printed: the optimized HLO's instruction count and `while` loops (the decode is one
`lax.scan` whatever the chunk), XLA's temp memory, and the device's peak memory where it
reports one (TPU, GPU). Works on any backend; on a CPU use small sizes
(`--frames 9 --height 64 --width 64`).

    python benchmarks/vae_compile.py                                  # 480p x 81, chunks 1 and 3, bfloat16
    python benchmarks/vae_compile.py --frames 9 --height 64 --width 64 --dtype float32
    python benchmarks/vae_compile.py --ops decode encode --chunks 1
    python benchmarks/vae_compile.py --efforts 0 -1      # XLA's default optimization effort, then the least

`--efforts` compiles each program at each of XLA's `exec_time_optimization_effort` values
(-1 to 1; 0 is XLA's default, `default` the library's own choice for the program), and
`max diff` compares each result with the first effort's (largest absolute difference).
"""

import argparse
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402,F401  (this checkout's vidax_eqx first on the path)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from vidax_eqx.models import WanVAE, WanVAEConfig  # noqa: E402
from vidax_eqx.models.internal import vae_program  # noqa: E402


def _peak_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def measure(vae, op: str, x, chunk: int, rounds: int, effort: str) -> dict:
    fn, args = vae_program(vae, op, x, chunk)
    options = {} if effort == "default" else {"exec_time_optimization_effort": float(effort)}
    t = time.perf_counter()
    compiled = fn.lower(*args).compile(compiler_options=options)
    compile_s = time.perf_counter() - t
    hlo = compiled.as_text()
    instructions = sum(1 for line in hlo.splitlines() if re.match(r"\s*(ROOT\s+)?%?[\w.\-]+\s*=", line))
    loops = len(re.findall(r"\bwhile\(", hlo))
    memory = compiled.memory_analysis()
    t = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    first_s = time.perf_counter() - t
    steady = []
    for _ in range(rounds):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        steady.append(time.perf_counter() - t)
    return dict(out=out, compile_s=compile_s, first_s=first_s,
                steady_s=statistics.median(steady) if steady else float("nan"),
                instructions=instructions, loops=loops,
                temp=getattr(memory, "temp_size_in_bytes", None), peak=_peak_bytes())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=81, help="video frames, 1 + 4k")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--ops", nargs="+", default=["decode"], choices=["decode", "encode"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--efforts", nargs="+", default=["default"],
                        help="XLA exec_time_optimization_effort values (-1 to 1) or `default`")
    parser.add_argument("--rounds", type=int, default=2, help="steady-state runs after the first")
    args = parser.parse_args(argv)
    if (args.frames - 1) % 4 or args.height % 8 or args.width % 8:
        parser.error("--frames must be 1 + 4k and --height / --width multiples of 8")
    jax.config.update("jax_enable_compilation_cache", False)
    dtype = jnp.dtype(args.dtype)
    config = WanVAEConfig.wan21()
    t = time.perf_counter()
    vae = jax.block_until_ready(WanVAE(config, dtype=dtype, key=jax.random.key(0)))
    build_s = time.perf_counter() - t
    latents = (config.z_dim, 1 + (args.frames - 1) // 4, args.height // 8, args.width // 8)
    inputs = {
        "decode": jax.random.normal(jax.random.key(1), latents, dtype),
        "encode": jax.random.uniform(jax.random.key(2), (3, args.frames, args.height, args.width),
                                     dtype, -1, 1),
    }
    device = jax.devices()[0]
    print(f"# Wan 2.1 VAE cold start, jax {jax.__version__}, {device.platform} ({device.device_kind}), "
          f"{args.dtype}, {args.frames} frames at {args.height} x {args.width} (latents "
          f"{latents}), random weights built in {build_s:.1f} s")
    print("| op | chunk | effort | compile s | first run s | steady s | max diff | HLO instructions "
          "| while loops | XLA temp GiB | device peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    gib = lambda b: "–" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    for op in args.ops:
        for chunk in args.chunks:
            first = None
            for effort in args.efforts:
                r = measure(vae, op, inputs[op], chunk, args.rounds, effort)
                out = np.asarray(r.pop("out").astype(jnp.float32))  # on the host: the chip's memory
                first = out if first is None else first
                diff = float(np.max(np.abs(out - first)))
                print(f"| {op} | {chunk} | {effort} | {r['compile_s']:.1f} | {r['first_s']:.2f} "
                      f"| {r['steady_s']:.2f} | {diff:.2e} | {r['instructions']} | {r['loops']} "
                      f"| {gib(r['temp'])} | {gib(r['peak'])} |", flush=True)
                del out


if __name__ == "__main__":
    main()
