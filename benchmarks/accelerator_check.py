"""One command that measures vidax_eqx on an accelerator (a GPU or TPU), within a short
lease, and says PASS or FAIL.

On the lent GPU machine (Python 3.12, JAX with its CUDA plugin, torch; no network), from
the checkout:

    pip install --no-index --no-deps .wheels/*.whl   # what the image lacks (beartype):
                                                      # scripts/accelerator_wheels.sh fetches them
    pip install --no-deps -e .
    python benchmarks/accelerator_check.py --out "$OUT"

Other modes:

    python benchmarks/accelerator_check.py --smoke --out /tmp/check   # tiny shapes, anywhere (CI, on CPU)
    python benchmarks/accelerator_check.py --lower cuda --out /tmp/check  # real shapes lowered
                                                                          # for CUDA from this host

Four parts, in order of information, none started once `--budget` seconds (default
420, from the start) are spent:

1. **Kernels at Wan's shapes** (`_accel_kernels.py`): Wan 2.1 1.3B (12 heads of 128) and
   14B (40) at 480p x 81 frames (21 x 30 x 52 = 32,760 tokens), bf16. Every path the
   platform serves (`"auto"`, `"cudnn"`, `"pallas_gpu"` or `"pallas_tpu"`, `"blockwise"`,
   `"xla"` where its score matrix fits) on each feature (full, causal, a sliding window,
   `kv_lengths`, sinks, sliding tile attention; video sparse attention through its own
   function): the output of the last 256 query rows against the float32 `"xla"`
   reference of those rows, and the gradients of q, k, v at 9 frames (4,680 tokens)
   against the float32 reference's. A documented refusal (`NotImplementedError`) is
   recorded, not failed; a path whose float32 scores do not fit the device (`"xla"` at
   these lengths) is recorded as not run. Speed, full and causal: forward and
   forward+backward against the peers a user would call (same shapes, same run): on a
   GPU `jax.nn.dot_product_attention(implementation="cudnn")` and PyTorch's SDPA with the
   flash and cuDNN backends; on a TPU JAX's splash kernel called directly, at its default
   tiles and at the best configuration measured on the chip; as ratios, TFLOP/s and a
   fraction of a bf16 matmul measured in the same run. Video sparse attention's rows
   (accuracy, and its time against dense attention) come right after.
2. **Wan blocks** (`_accel_models.py`): one Wan 2.1 1.3B block and one 14B block,
   forward+backward at 32,760 tokens, bf16, with `remat="full"` and without: step time,
   and the device's peak memory (`jax.devices()[0].memory_stats()`) against the
   compiled program's `memory_analysis` (arguments + outputs + temporaries).
3. **Sequence parallelism on one device**: `parallel.sequence_attention` as Ulysses, a
   ring and USP over one-device axes, forward and gradients against the kernel.
4. The remaining kernel rows (the other features' accuracy, the 14B heads' speed).

The report goes to `--out DIR/accelerator_check.json` (every row, every check, the
platform, device, versions, the elapsed time) and `DIR/accelerator_check.md` (the speed
table); the last lines say `PASS <check> (detail)`, `FAIL <check>: reason` or
`SKIP <check>: reason`, and the exit status is 1 if any check failed.
"""

import argparse
import os
import sys

import jax
import jaxlib

import _accel_kernels as kern
import _accel_models as mods
from _accel_common import log, matmul_tflops, Run
from _harness import write_json, write_text


def _steps(run: Run, found: dict) -> list:
    """The parts in order of information, as closures that add rows to `found`."""
    timed, grad_shape = kern.shapes(run)
    first = timed[0]

    def add(key, fn):
        return lambda: found[key].extend(fn())

    steps = [
        add("kernels", lambda: kern.speed_rows(run, first, causal=False)),
        add("kernels", lambda: kern.speed_rows(run, first, causal=True)),
        add("kernels", lambda: kern.accuracy_rows(run, first, grad_shape, "full")),
        add("kernels", lambda: kern.accuracy_rows(run, first, grad_shape, "causal")),
        add("kernels", lambda: kern.vsa_rows(run, first, grad_shape)),
        add("blocks", lambda: mods.wan_block_rows(run)),
        add("parallel", lambda: mods.one_device_parallel_rows(run)),
    ]
    steps += [add("kernels", lambda f=f: kern.accuracy_rows(run, first, grad_shape, f))
              for f in kern.FEATURES if f not in ("full", "causal")]
    for shape in timed[1:]:
        steps += [add("kernels", lambda s=shape: kern.speed_rows(run, s, causal=False)),
                  add("kernels", lambda s=shape: kern.speed_rows(run, s, causal=True))]
    return steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true",
                      help="tiny shapes, everything run, anywhere (CPU: Pallas in interpret mode)")
    mode.add_argument("--lower", metavar="PLATFORM",
                      help="lower the real shapes for PLATFORM (cuda, rocm, tpu) from this host; run nothing")
    parser.add_argument("--out", default=".", metavar="DIR",
                        help="the folder for accelerator_check.json and .md (created; default: here)")
    parser.add_argument("--budget", type=float, default=420.0, metavar="SECONDS",
                        help="start no part after this many seconds (default 420)")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per measurement (the best is kept)")
    args = parser.parse_args()
    run = Run(mode="smoke" if args.smoke else "lower" if args.lower else "run",
              budget_s=args.budget, reps=args.reps,
              platform=args.lower or jax.default_backend())
    device = jax.devices()[0]
    print(f"jax {jax.__version__} (jaxlib {jaxlib.__version__}) on {jax.default_backend()}: "
          f"{jax.device_count()} x {device.device_kind}; mode {run.mode}, programs for "
          f"{run.platform}", flush=True)
    if not run.lower_only:
        run.matmul_tflops = matmul_tflops(run)
        print(f"bf16 matmul: {run.matmul_tflops:.2f} TFLOP/s", flush=True)

    found = {"kernels": [], "blocks": [], "parallel": []}
    for step in _steps(run, found):
        if run.spent():
            print(f"(budget of {run.budget_s:.0f} s spent: stopping)", flush=True)
            break
        try:
            step()
        except Exception as e:  # a part that fails as a whole is one failed row
            row = dict(part="driver", error=f"{type(e).__name__}: {e}"[:400])
            found["kernels"].append(row)
            log(row)

    kern.checks(run, found["kernels"])
    mods.checks(run, found["blocks"], found["parallel"])
    table = kern.table(found["kernels"])
    print(table)
    report = dict(
        mode=run.mode, platform=run.platform, backend=jax.default_backend(),
        device_kind=device.device_kind, device_count=jax.device_count(),
        jax_version=jax.__version__, jaxlib_version=jaxlib.__version__,
        budget_s=run.budget_s, elapsed_s=run.elapsed(), matmul_tflops=run.matmul_tflops,
        rows=found["kernels"] + found["blocks"] + found["parallel"], checks=run.checks,
    )
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "accelerator_check.json"), report)
    write_text(os.path.join(args.out, "accelerator_check.md"), table + "\n")
    print(f"total {run.elapsed():.0f} s; report in {args.out}/accelerator_check.json")
    for c in run.checks:  # PASS <check> (detail) / FAIL <check>: reason / SKIP <check>: reason
        detail = c["detail"] and (f" ({c['detail']})" if c["status"] == "PASS" else f": {c['detail']}")
        print(f"{c['status']} {c['check']}{detail}")
    sys.exit(1 if any(c["status"] == "FAIL" for c in run.checks) else 0)


if __name__ == "__main__":
    main()
