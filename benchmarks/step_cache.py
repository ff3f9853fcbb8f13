"""Step caching in `sampling.sample` (`StaticStepCache | MagCache | FirstBlockCache`):
the speed-up against the uncached sampler, and how far the cached latents land from the
uncached ones, on a tiny Wan trained by `examples/train_wan.py`, in one process on one
device.

Random weights say nothing about what reusing the block stack costs in quality (their
residuals barely change from step to step, or change at random), so the model is
trained first, with the example's own functions (`init_model`, `dataset`,
`flow_matching_batch`, `make_step`, `train`): the example's fixed synthetic set (4
latents `(4, 3, 6, 10)`: 45 video tokens, 4 text contexts `(7, 32)`), its flow-matching
loss and AdamW (lr `--lr`), `--train-steps` steps, at a larger size than the example's
(default dim 128, ffn 256, 8 heads, 6 layers) so that the block stack is most of a
sampling step's time (the rest: patch and time embeddings, the head, the scheduler).
The first and last training losses are printed; the run stops if the loss did not go
down. The example's import sets `XLA_FLAGS` (8 simulated devices, XLA's fast compile);
this script puts back the flags it was started with before JAX starts, so everything
runs on one device with XLA's default optimizations.

Sampling: `sampling.sample` from the trained model, the first `--prompts` training
contexts (the guided batch: those and a zero `negative_context`), guidance 5.0,
`UniPC(shift=3.0)`, `--steps` steps, one fixed noise draw. The rows:

- `uncached`: the reference;
- `StaticStepCache(interval=2, warmup=1)` and `StaticStepCache(interval=2,
  warmup=steps // 5, cooldown=steps // 10)`: fixed schedules;
- `MagCache` at each of `--mag-errors` (`max_error`; `max_skip` 2, retention 0.2),
  its ratios calibrated by `calibrate_magcache` on another noise draw than the one
  timed (the ratios are printed);
- `FirstBlockCache(threshold)` at each of `--thresholds` (warmup 1, cooldown 0;
  default 0.1, 0.2, 0.3, the usual range; a model trained less changes more per step,
  and reuses less at each: after 300 training steps 0.1 reuses nothing, so pass e.g.
  `--thresholds 0.2 0.3 0.5` there).

Before the table, the reuse count of the first-block rule at a grid of thresholds is
printed (the threshold is traced: one compiled program), to show where the chosen ones
sit. Every variant is called once (compiled, and its latents and `reused` kept), then
all are timed in `--rounds` interleaved rounds (`_harness.interleaved`: each once per
round, in a shuffled order); the speed-up is the median over the rounds of
`uncached time / cached time` of the same round (`_harness.paired_ratio`), with its
min-max, in wall time (and its median in process CPU time). Only ratios are reported:
the machines are shared and noisy.

The latents' difference to the uncached ones: relative L2 `||a - b|| / ||b||` and
`max |a - b| / max |b|`. For scale, the quality column: the relative L2 distance of
each prompt's sampled latents to that prompt's training latent `x0` (the mean over the
prompts), and whether the nearest training latent is the prompt's own: the model was
trained to map each context to its `x0`, so a cached sampler that still lands about as
close to it as the uncached one lost little of what the model learned. (Two distinct
training latents are about `sqrt(2) = 1.41` apart in this measure: they are independent
standard normals.) The model never saw the zero `negative_context` in training (the
example has no unconditional dropout), so guidance 5.0 extrapolates away from what it
learned; the same measure of the uncached sampler without guidance (scale 1.0) is
printed under the table, to tell the guidance's share of the distance from the model's.
At the default 1000 steps the model memorizes the four latents (loss ~0.05, unguided
samples ~0.13 from their own `x0`) and the column separates the rules; after 300 steps
(`--train-steps 300`: loss ~1.3, unguided samples ~1.25 from their `x0`, barely closer
than another one) it says little.

    python benchmarks/step_cache.py --quick   # 30 train steps, a smaller model, 6 steps, 2 rounds
    python benchmarks/step_cache.py           # 1000 train steps, 30 sampling steps, 20 rounds
    python benchmarks/step_cache.py --train-steps 300 --thresholds 0.2 0.3 0.5

Prints a Markdown table and one JSON line per row.
"""

import argparse
import dataclasses
import os
import sys
import time

from _harness import REPO, emit, interleaved, log, paired_ratio

# The example sets XLA_FLAGS when imported (8 simulated devices, fast compile): put the
# flags this process started with back before JAX initializes its backend.
_saved_flags = os.environ.get("XLA_FLAGS")
sys.path.insert(0, os.path.join(REPO, "examples"))
import train_wan  # noqa: E402

if _saved_flags is None:
    os.environ.pop("XLA_FLAGS", None)
else:
    os.environ["XLA_FLAGS"] = _saved_flags

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from vidax_eqx import models, sampling  # noqa: E402


SWEEP = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)


def train_model(a):
    """The trained model, its training data, and the first and last loss."""
    config = models.WanConfig(dim=a.dim, ffn_dim=a.ffn, num_heads=a.heads, num_layers=a.layers,
                              in_channels=train_wan.LATENTS[1],
                              out_channels=train_wan.LATENTS[1],
                              text_dim=train_wan.TEXT[1], freq_dim=32)
    model = models.WanTransformer3D(config, key=jax.random.PRNGKey(a.seed))  # as the example builds it
    data = train_wan.dataset(a.seed)
    optimizer = optax.adamw(a.lr)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    n_params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    step = train_wan.make_step(optimizer, lambda m, x, t, c: jax.vmap(m)(x, t, c))
    t0 = time.perf_counter()
    model, _, losses = train_wan.train(step, model, opt_state, data, a.seed, a.train_steps)
    wall = time.perf_counter() - t0
    return model, data, losses, n_params, wall


def rel_l2(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--steps", type=int, default=30, help="denoising steps")
    p.add_argument("--prompts", type=int, default=2, help="training contexts sampled (1-4)")
    p.add_argument("--thresholds", type=float, nargs="+", default=(0.1, 0.2, 0.3))
    p.add_argument("--mag-errors", type=float, nargs="+", default=(0.06, 0.12, 0.24))
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.train_steps, a.dim, a.ffn, a.layers, a.steps, a.rounds = 30, 64, 128, 2, 6, 2
    if not 1 <= a.prompts <= train_wan.LATENTS[0]:
        p.error(f"--prompts must be in [1, {train_wan.LATENTS[0]}]")
    log(f"backend {jax.default_backend()}, {len(jax.devices())} device(s); XLA_FLAGS="
        f"{os.environ.get('XLA_FLAGS', '')!r}")

    # 1. Train.
    model, (x0, contexts), losses, n_params, train_s = train_model(a)
    print(f"trained Wan dim={a.dim}, ffn={a.ffn}, heads={a.heads}, layers={a.layers} "
          f"({n_params:,} parameters) for {a.train_steps} AdamW steps (lr {a.lr:g}) in "
          f"{train_s:.1f} s: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
          f"(min of the last 10: {min(losses[-10:]):.4f})")
    if not losses[-1] < losses[0]:
        print("FAILED: the training loss did not go down", file=sys.stderr)
        sys.exit(1)

    # 2. The variants.
    context = jnp.asarray(contexts[:a.prompts])
    negative = jnp.zeros_like(context)
    noise = jnp.asarray(np.random.default_rng([a.seed, 3]).standard_normal(
        (a.prompts, *train_wan.LATENTS[1:]), np.float32))
    scheduler = sampling.UniPC(shift=3.0)
    warm, cool = max(1, a.steps // 5), a.steps // 10
    variants = {"uncached": None,
                "static interval=2 warmup=1": sampling.StaticStepCache(interval=2, warmup=1)}
    if (warm, cool) != (1, 0):  # the second schedule, unless it is the first one
        variants[f"static interval=2 warmup={warm} cooldown={cool}"] = sampling.StaticStepCache(
            interval=2, warmup=warm, cooldown=cool)
    calibration = jnp.asarray(np.random.default_rng([a.seed, 4]).standard_normal(
        noise.shape, np.float32))  # another draw than the timed one
    magcache = sampling.calibrate_magcache(model, calibration, context, negative_context=negative,
                                           steps=a.steps, scheduler=scheduler,
                                           guidance=sampling.Guidance(5.0))
    print("MagCache ratios (calibrated): " + ", ".join(f"{r:.3f}" for r in magcache.ratios))
    for error in a.mag_errors:
        variants[f"magcache max_error={error:g}"] = dataclasses.replace(magcache, max_error=error)
    for th in a.thresholds:
        variants[f"first-block threshold={th:g}"] = sampling.FirstBlockCache(th)

    def run(step_cache):
        extra = {} if step_cache is None else {"step_cache": step_cache, "return_reused": True}
        return lambda: jax.block_until_ready(sampling.sample(
            model, noise, context, negative_context=negative, guidance_scale=5.0,
            steps=a.steps, scheduler=scheduler, **extra))

    runs = {name: run(sc) for name, sc in variants.items()}
    outputs, compile_s = {}, {}
    for name, fn in runs.items():  # compile each (once per rule type) and keep its result
        t0 = time.perf_counter()
        out = fn()
        compile_s[name] = time.perf_counter() - t0
        latents, reused = (out, np.zeros(a.steps, bool)) if variants[name] is None else out
        outputs[name] = (np.asarray(latents, np.float64), np.asarray(reused))
        log(f"  {name}: first call {compile_s[name]:.1f} s, reused steps "
            f"{np.flatnonzero(outputs[name][1]).tolist()}")

    sweep = {}
    for th in SWEEP:
        _, reused = run(sampling.FirstBlockCache(th))()
        sweep[th] = int(np.sum(reused))
    print(f"first-block rule, steps reused of {a.steps} by threshold: "
          + ", ".join(f"{th:g}: {n}" for th, n in sweep.items()))

    unguided = np.asarray(sampling.sample(model, noise, context, guidance_scale=1.0,
                                          steps=a.steps, scheduler=scheduler), np.float64)

    # 3. Time.
    timing = interleaved(runs, a.rounds, seed=a.seed)

    # 4. The table.
    ref = outputs["uncached"][0]
    x0_64 = np.asarray(x0, np.float64)
    header = ("| variant | steps reused | speed-up (wall, min-max) | speed-up (CPU) | "
              "rel. L2 to uncached | max abs diff / max abs | rel. L2 to own x0 | "
              "nearest x0 is own |")
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    records = []
    for name, (latents, reused) in outputs.items():
        wall = paired_ratio(timing["uncached"], timing[name])
        cpu = paired_ratio(timing["uncached"], timing[name], cpu=True)
        to_x0 = [rel_l2(latents[i], x0_64[i]) for i in range(a.prompts)]
        nearest = [int(np.argmin([np.linalg.norm(latents[i] - x) for x in x0_64]))
                   for i in range(a.prompts)]
        own = sum(n == i for i, n in enumerate(nearest))
        rel = rel_l2(latents, ref)
        max_rel = float(np.max(np.abs(latents - ref)) / np.max(np.abs(ref)))
        n_reused = int(np.sum(reused))
        lines.append(
            f"| {name} | {n_reused}/{a.steps} | {wall[0]:.2f}x ({wall[1]:.2f}-{wall[2]:.2f}) | "
            f"{cpu[0]:.2f}x | {rel:.2e} | {max_rel:.2e} | {np.mean(to_x0):.3f} | "
            f"{own}/{a.prompts} |")
        records.append({
            "variant": name, "steps": a.steps, "steps_reused": n_reused,
            "reused": np.flatnonzero(reused).tolist(),
            "speedup_wall": list(wall), "speedup_cpu": list(cpu),
            "median_s": timing[name].median, "first_call_s": compile_s[name],
            "rel_l2_to_uncached": rel, "max_abs_diff_over_max_abs": max_rel,
            "rel_l2_to_own_x0": to_x0, "nearest_x0": nearest,
            "config": {"dim": a.dim, "ffn": a.ffn, "heads": a.heads, "layers": a.layers,
                       "latents": list(train_wan.LATENTS[1:]), "prompts": a.prompts,
                       "train_steps": a.train_steps, "loss_first": losses[0],
                       "loss_last": losses[-1], "guidance": 5.0, "scheduler": "UniPC(shift=3.0)",
                       "rounds": a.rounds, "backend": jax.default_backend()},
        })
    print(f"\nuncached: median {timing['uncached'].median * 1e3:.1f} ms per sample "
          f"({a.prompts} prompt(s), guided batch {2 * a.prompts}, {a.steps} steps); "
          f"speed-up = uncached / cached time, median over {a.rounds} interleaved rounds\n")
    print("\n".join(lines))
    to_x0 = [rel_l2(unguided[i], x0_64[i]) for i in range(a.prompts)]
    nearest = [int(np.argmin([np.linalg.norm(unguided[i] - x) for x in x0_64]))
               for i in range(a.prompts)]
    print(f"\nfor scale: the uncached sampler without guidance (scale 1.0): rel. L2 to own x0 "
          f"{np.mean(to_x0):.3f} (per prompt {', '.join(f'{d:.3f}' for d in to_x0)}), nearest "
          f"x0 is own {sum(n == i for i, n in enumerate(nearest))}/{a.prompts}; two training "
          f"latents are ~1.41 apart\n")
    for r in records:
        emit(r)


if __name__ == "__main__":
    main()
