"""A whole Wan forward through `jax.export` (`models.export`): the serialized size at
two token counts, the export time for the CPU alone and for cpu + tpu + cuda (lowered
from this CPU host), and the round trip (serialize, deserialize, call on the CPU)
against the direct call.

Two models: the tiny random Wan of the tests (real weights: the round trip is run), and
Wan 2.1 1.3B built abstractly (`eqx.filter_eval_shape`: shapes only, nothing to run) at
one example of 2 and 21 latent frames of 480p (60 x 104 latents: 3,120 and 32,760
tokens). "dense tables" is what the two (S, head_dim / 2) float32 RoPE tables weighed
as constants of the module before they were computed in the program.

    python benchmarks/export.py            # both models, 3 repeats
    python benchmarks/export.py --quick    # the tiny model, 1 repeat
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from vidax_eqx import models


TINY = models.WanConfig(dim=32, ffn_dim=64, num_heads=4, num_layers=2, in_channels=4,
                        out_channels=4, text_dim=16, freq_dim=16)
MULTI = ("cpu", "tpu", "cuda")


def _forward(model, x, t, context):
    return model(x, t, context)


def _shapes(config, latents, text_len):
    return (jax.ShapeDtypeStruct((config.in_channels, *latents), jnp.float32),
            jax.ShapeDtypeStruct((), jnp.float32),
            jax.ShapeDtypeStruct((text_len, config.text_dim), jnp.float32))


def _tokens(config, latents) -> int:
    return int(np.prod([n // p for n, p in zip(latents, config.patch_size)]))


def _export_time(model, shapes, platforms, repeats):
    times, exported = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        exported = models.export(_forward, model, *shapes, platforms=platforms)
        times.append(time.perf_counter() - start)
    return statistics.median(times), exported


def measure(name, config, frame_counts, spatial, text_len, repeats, weights=None):
    model = weights if weights is not None else eqx.filter_eval_shape(
        models.WanTransformer3D, config, key=jax.random.key(0))
    rows = []
    for frames in frame_counts:
        latents = (frames, *spatial)
        shapes = _shapes(config, latents, text_len)
        t_cpu, _ = _export_time(model, shapes, ("cpu",), repeats)
        t_multi, multi = _export_time(model, shapes, MULTI, repeats)
        cpu = models.export(_forward, model, *shapes)
        S, c = _tokens(config, latents), config.dim // config.num_heads // 2
        row = dict(model=name, tokens=S, size_cpu=len(cpu.serialize()),
                   size_multi=len(multi.serialize()), dense=2 * S * c * 4, t_cpu=t_cpu,
                   t_multi=t_multi, checks=[str(c) for c in multi.exported.disabled_safety_checks],
                   diff=None)
        if weights is not None:
            rng = np.random.default_rng(0)
            args = [jax.device_put(rng.standard_normal(s.shape).astype(np.float32))
                    for s in shapes]
            reloaded = models.ExportedModel.deserialize(multi.serialize())
            out = reloaded(weights, *args)
            ref = eqx.filter_jit(_forward)(weights, *args)
            row["diff"] = float(jnp.max(jnp.abs(out - ref)))
        rows.append(row)
        print(row, flush=True)
    return rows


def table(rows) -> str:
    lines = ["| model | tokens | serialized, cpu (bytes) | serialized, cpu+tpu+cuda (bytes) | "
             "dense tables (bytes) | export cpu (s) | export cpu+tpu+cuda (s) | "
             "round trip max abs diff |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        diff = "–" if r["diff"] is None else f"{r['diff']:.1e}"
        lines.append(f"| {r['model']} | {r['tokens']:,} | {r['size_cpu']:,} | "
                     f"{r['size_multi']:,} | {r['dense']:,} | {r['t_cpu']:.2f} | "
                     f"{r['t_multi']:.2f} | {diff} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, 1 repeat")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else 3
    tiny = models.WanTransformer3D(TINY, key=jax.random.key(0))
    rows = measure("tiny Wan", TINY, (2, 8), (16, 16), 7, repeats, weights=tiny)
    if not args.quick:
        rows += measure("Wan 2.1 1.3B (abstract)", models.WanConfig(), (2, 21), (60, 104), 512,
                        repeats)
    print()
    print(table(rows))
    print("disabled safety checks (cpu+tpu+cuda):", rows[0]["checks"])


if __name__ == "__main__":
    main()
