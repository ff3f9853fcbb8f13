"""Wan's text K/V cache: one denoising step's model call with the cross-attention keys
and values precomputed (`WanTransformer3D.text_cache`, passed as `text_cache=`)
against the same call projecting the text, in one process on one device.

A small random Wan (`WanTransformer3D`, float32; default dim 256, ffn 512, 4 heads,
4 layers, the text padded to Wan's 512 tokens of width 256, latents (16, 4, 16, 24):
384 video tokens), a guided step's batch of 2 (conditional and unconditional). Both
programs are compiled ahead of time and timed in interleaved rounds
(`_harness.interleaved`: each once per round, in a shuffled order); the ratio is the
median of the per-round ratios `cached / uncached` (with its range), in wall and in
process CPU time. The cache itself is computed once per generation, not per step, and
is not in the timed call (its own time is reported). The outputs are checked equal bit
for bit.

What the cache saves per step is every block's text (and image) K and V projections
and `norm_k`: about `4 * L_text * dim^2` multiply-adds per layer and example, so the
saving grows with the text length relative to the video tokens (Wan pads to 512 text
tokens; at 480p a video has ~32k tokens, so there it is a few percent).

    python benchmarks/text_cache.py --quick   # tiny model, 3 rounds
    python benchmarks/text_cache.py           # the sizes above, 15 rounds
"""

import argparse
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from _harness import interleaved, paired_ratio

from vidax_eqx import models


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--text-len", type=int, default=512)
    p.add_argument("--latents", type=int, nargs=4, default=(16, 4, 16, 24))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.dim, a.ffn, a.layers, a.text_len, a.latents, a.rounds = 64, 128, 2, 64, (16, 2, 8, 8), 3
    config = models.WanConfig(dim=a.dim, ffn_dim=a.ffn, num_heads=a.heads, num_layers=a.layers,
                              in_channels=a.latents[0], out_channels=a.latents[0],
                              text_dim=a.dim, freq_dim=64, text_len=a.text_len)
    model = models.WanTransformer3D(config, key=jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, *a.latents), np.float32))
    t = jnp.full((2,), 700.0)
    c = jnp.asarray(rng.standard_normal((2, a.text_len, a.dim), np.float32))

    def step(model, x, t, c, cache):
        if cache is None:
            return jax.vmap(lambda x, t, c: model(x, t, c))(x, t, c)
        return jax.vmap(lambda x, t, c, k: model(x, t, c, text_cache=k))(x, t, c, cache)

    make_cache = eqx.filter_jit(lambda m, c: jax.vmap(m.text_cache)(c))
    cache = jax.block_until_ready(make_cache(model, c))
    jitted = eqx.filter_jit(step)
    uncached = jitted.lower(model, x, t, c, None).compile()
    cached = jitted.lower(model, x, t, c, cache).compile()
    cache_program = make_cache.lower(model, c).compile()
    same = np.array_equal(uncached(model, x, t, c, None), cached(model, x, t, c, cache))
    runs = {
        "uncached": lambda: jax.block_until_ready(uncached(model, x, t, c, None)),
        "cached": lambda: jax.block_until_ready(cached(model, x, t, c, cache)),
        "cache": lambda: jax.block_until_ready(cache_program(model, c)),
    }
    timing = interleaved(runs, a.rounds)
    wall = paired_ratio(timing["cached"], timing["uncached"])
    cpu = paired_ratio(timing["cached"], timing["uncached"], cpu=True)
    tokens = a.latents[1] * (a.latents[2] // 2) * (a.latents[3] // 2)
    record = {
        "config": {"dim": a.dim, "ffn": a.ffn, "heads": a.heads, "layers": a.layers,
                   "text_len": a.text_len, "latents": list(a.latents), "video_tokens": tokens,
                   "batch": 2, "backend": jax.default_backend(), "rounds": a.rounds},
        "bit_identical": bool(same),
        "uncached_s": timing["uncached"].median, "cached_s": timing["cached"].median,
        "cache_once_s": timing["cache"].median,
        "ratio_wall": wall, "ratio_cpu": cpu,
    }
    print(f"per-step model call, cached / uncached: {wall[0]:.3f} wall (range {wall[1]:.3f}-"
          f"{wall[2]:.3f}), {cpu[0]:.3f} CPU; uncached {record['uncached_s'] * 1e3:.1f} ms, "
          f"cached {record['cached_s'] * 1e3:.1f} ms, the cache once "
          f"{record['cache_once_s'] * 1e3:.1f} ms; bit-identical: {same}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
