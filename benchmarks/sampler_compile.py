"""Start-up cost of the sampler: a cold `sampling.sample` (trace, lower, XLA compile,
run) against a reloaded export (`sampling.export_sample` serialized to a file,
`ExportedSampler.deserialize` in a fresh process: no tracing or lowering of the model,
XLA still compiles), and against the reloaded export with JAX's persistent
compilation cache warm (no compile at all), each in a fresh process.

A small random Wan (`WanTransformer3D`, float32; default dim 256, ffn 512, 4 heads,
8 layers, latents (16, 4, 16, 24): 384 video tokens, 64 text tokens), guidance (a
batch of 2), UniPC, a plan padded to `max_steps` 50 and runs of `steps` 4. Every case
runs in its own child process (`_harness.run_child`), which times its first call
(start-up: everything a server does before its first latents, loading the export
included) and its second call (the run itself); the start-up cost is first minus
second. Each case is repeated `--repeats` times, interleaved, and the medians are
reported with the ratios to the cold start. One compiled program served 4 and then 9
steps in the `max_steps` children (the compile count is reported).

    python benchmarks/sampler_compile.py --quick   # tiny model, 1 repeat
    python benchmarks/sampler_compile.py           # the sizes above, 3 repeats
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from _harness import emit, run_child


def _model_and_inputs(a):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from vidax_eqx import models

    config = models.WanConfig(dim=a.dim, ffn_dim=a.ffn, num_heads=a.heads, num_layers=a.layers,
                              in_channels=a.latents[0], out_channels=a.latents[0],
                              text_dim=a.dim, freq_dim=64)
    model = models.WanTransformer3D(config, key=jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    io = dict(noise=jnp.asarray(rng.standard_normal((1, *a.latents), np.float32)),
              context=jnp.asarray(rng.standard_normal((1, a.text_len, a.dim), np.float32)),
              negative_context=jnp.asarray(rng.standard_normal((1, a.text_len, a.dim),
                                                               np.float32)))
    return model, io


def child(a) -> None:
    """One case in this (fresh) process: `emit`s its first and second call times."""
    if a.case == "warm_cache":
        import jax

        jax.config.update("jax_compilation_cache_dir", a.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import jax

    from vidax_eqx import sampling

    model, io = _model_and_inputs(a)
    jax.block_until_ready((model, io))
    compiles = []  # XLA compilations from here on (persistent-cache hits included)
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, d, **k: compiles.append(d)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    if a.case == "make":  # write the file the other cases load
        exported = sampling.export_sample(model, **io, steps=a.steps, max_steps=a.max_steps)
        with open(a.path, "wb") as f:
            f.write(exported.serialize())
        emit({"case": "make", "bytes": os.path.getsize(a.path)})
        return
    if a.case == "cold":
        run = lambda steps: sampling.sample(model, **io, steps=steps,  # noqa: E731
                                            max_steps=a.max_steps)
    else:
        t0 = time.perf_counter()
        with open(a.path, "rb") as f:
            sampler = sampling.ExportedSampler.deserialize(f.read())
        run = lambda steps: sampler(model, **io, steps=steps)  # noqa: E731
    t0 = time.perf_counter() if a.case == "cold" else t0
    jax.block_until_ready(run(a.steps))
    first = time.perf_counter() - t0
    n_first = len(compiles)
    t0 = time.perf_counter()
    jax.block_until_ready(run(a.steps))
    second = time.perf_counter() - t0
    jax.block_until_ready(run(a.steps + 5))  # another number of steps: no new compile
    emit({"case": a.case, "first": first, "second": second, "startup": first - second,
          "compiles_first": n_first, "compiles_after": len(compiles) - n_first})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--text-len", type=int, default=64)
    p.add_argument("--latents", type=int, nargs=4, default=(16, 4, 16, 24))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.dim, a.ffn, a.layers, a.text_len, a.latents, a.repeats = 64, 128, 2, 16, (16, 2, 8, 8), 1
    if a.case:
        return child(a)

    size = ["--dim", a.dim, "--ffn", a.ffn, "--heads", a.heads, "--layers", a.layers,
            "--text-len", a.text_len, "--latents", *a.latents, "--steps", a.steps,
            "--max-steps", a.max_steps]
    with tempfile.TemporaryDirectory() as tmp:
        common = [*size, "--path", os.path.join(tmp, "sampler.bin"),
                  "--cache-dir", os.path.join(tmp, "cache")]
        made = run_child(__file__, ["--case", "make", *common], devices=1)
        if made.returncode != 0:
            sys.exit(f"export failed: {made.reason}")
        # Fill the persistent cache once (its first run compiles and writes it).
        filled = run_child(__file__, ["--case", "warm_cache", *common], devices=1)
        if filled.returncode != 0:
            sys.exit(f"warm_cache failed: {filled.reason}")
        results = {"cold": [], "export": [], "warm_cache": []}
        for _ in range(a.repeats):
            for case in results:
                r = run_child(__file__, ["--case", case, *common], devices=1)
                if r.returncode != 0:
                    sys.exit(f"{case} failed: {r.reason}")
                results[case].append(r.records[-1])
    cold = statistics.median(r["startup"] for r in results["cold"])
    print(f"export: {made.records[-1]['bytes']} bytes (no weights)\n")
    print("| start | start-up s (first - second call) | vs cold | run s (second call) "
          "| XLA compiles for another number of steps |")
    print("|---|---|---|---|---|")
    names = {"cold": "cold `sample`", "export": "reloaded export",
             "warm_cache": "reloaded export + warm persistent cache"}
    for case, rows in results.items():
        startup = statistics.median(r["startup"] for r in rows)
        run = statistics.median(r["second"] for r in rows)
        print(f"| {names[case]} | {startup:.2f} | {startup / cold:.2f}x | {run:.3f} | "
              f"{rows[-1]['compiles_after']} |")
        emit({"case": case, "startup_s": startup, "vs_cold": startup / cold, "run_s": run,
              "repeats": len(rows)})
    print(json.dumps({"config": {k: v for k, v in vars(a).items() if k not in
                                 ("case", "path", "cache_dir")}}))


if __name__ == "__main__":
    main()
