"""Wan 2.1's forward wall time: `vidax_eqx.models.WanTransformer3D` against diffusers'
`WanTransformer3DModel`, the same weights and inputs, on this machine's CPU.

A small real configuration (dim 1536, 12 heads, ffn 8960, 2 layers, text 512 x 4096;
latents (16, 4, 64, 64): 4,096 tokens), float32, batch 1, forward only: `vidax_eqx`
(`eqx.filter_jit`, compiled before timing, one device) against diffusers'
`WanTransformer3DModel` under `torch.no_grad()`, with the same weights (random init
of `WanTransformer3D`, written with `save_pretrained(dir, layout="diffusers")`, read
with `WanTransformer3DModel.from_pretrained(dir)`) and inputs. Each side runs in its
own process (this script with a hidden `--child-*` flag; diffusers in
`--torch-python`, default `/work/torchvenv/bin/python`: an environment without JAX),
one after the other, never at once; each runs once as a warm-up and reports the best
and the median of `--repeats` further runs, each synchronized
(`block_until_ready`). `max rel diff` = max |vidax - diffusers| / max |diffusers|
over the output. GFLOP/s: the analytic forward dot FLOPs (`benchmarks/models.py`'s
docstring) over the best time, next to a float32 2048^3 matmul in the same process.
Skipped, with the reason, when torch or diffusers cannot be imported there.

    python benchmarks/models_vs_diffusers.py --quick    # one timed run per side
    python benchmarks/models_vs_diffusers.py            # best and median of 3

The Markdown table goes to stdout and `benchmarks/results/models_vs_diffusers.md`
(`models_vs_diffusers_quick.md` with `--quick`), raw numbers to the `.json` next to
it (under `"diffusers"`, as `models.py` once wrote them).
"""

import argparse
import math
import os
import platform
import shutil
import sys
import tempfile
import time

from _harness import RESULTS, best_time, command_line, emit, log, now, run_child, write_json, write_text
from _model_flops import WAN_TEXT, wan_flops


TORCH_PYTHON = "/work/torchvenv/bin/python"
# Wan 1.3B's width, 2 layers; x (C, F, H, W), patch (1, 2, 2): 4 x 32 x 32 = 4,096 tokens.
WALL_CONFIG = dict(dim=1536, ffn_dim=8960, num_heads=12, num_layers=2)
WALL_LATENTS = (16, 4, 64, 64)
WALL_TEXT = WAN_TEXT
WALL_TIMESTEP = 500.0
MATMUL_N = 2048  # the reference matmul: (N x N) @ (N x N), float32


def _tokens() -> int:
    return math.prod(WALL_LATENTS[1:]) // 4


def _times(run, repeats: int) -> dict:
    """Wall and process CPU time (all threads) of `repeats` runs after a warm-up."""
    t = best_time(run, repeats)
    return {"best_s": t.best, "median_s": t.median, "runs_s": [s.wall for s in t.samples],
            "best_cpu_s": t.best_cpu, "cpu_s": [s.cpu for s in t.samples]}


# --------------------------------------------------------------------------- #
# The two sides, each in a fresh process
# --------------------------------------------------------------------------- #


def vidax_child(args) -> None:
    """Builds the small float32 model (random init), writes it in diffusers' layout
    and the inputs to `--child-dir`, times the jitted forward, saves its output."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    from vidax_eqx import models

    d = args.child_dir
    model = models.WanTransformer3D(models.WanConfig(**WALL_CONFIG), dtype=jnp.float32,
                                    key=jax.random.PRNGKey(0))
    model.save_pretrained(os.path.join(d, "model"), layout="diffusers")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(WALL_LATENTS, dtype=np.float32)
    context = rng.standard_normal(WALL_TEXT, dtype=np.float32)
    timestep = np.float32(WALL_TIMESTEP)
    np.savez(os.path.join(d, "inputs.npz"), x=x, context=context, timestep=timestep)

    fn = eqx.filter_jit(lambda m, x, t, c: m(x, t, c))
    xs = (jnp.asarray(x), jnp.asarray(timestep), jnp.asarray(context))
    t0 = time.perf_counter()
    compiled = fn.lower(model, *xs).compile()
    compile_s = time.perf_counter() - t0
    out = None

    def run():
        nonlocal out
        out = jax.block_until_ready(compiled(model, *xs))

    r = _times(run, args.repeats)
    np.save(os.path.join(d, "out_vidax.npy"), np.asarray(out))
    a = jnp.asarray(rng.standard_normal((MATMUL_N, MATMUL_N), dtype=np.float32))
    matmul = jax.jit(jnp.matmul).lower(a, a).compile()
    r["matmul_s"] = best_time(lambda: jax.block_until_ready(matmul(a, a)), 5).best
    emit({"side": "vidax_eqx", "compile_s": compile_s, **r, "jax": jax.__version__,
          "devices": len(jax.devices()), "tokens": _tokens()})


def diffusers_child(args) -> None:
    """Runs in the torch environment (no JAX): loads the same weights and inputs with
    diffusers and times its forward."""
    import numpy as np
    import torch
    import diffusers
    from diffusers import WanTransformer3DModel

    d = args.child_dir
    t0 = time.perf_counter()
    model = WanTransformer3DModel.from_pretrained(os.path.join(d, "model"),
                                                  torch_dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    io = np.load(os.path.join(d, "inputs.npz"))
    x = torch.from_numpy(io["x"])[None]
    context = torch.from_numpy(io["context"])[None]
    timestep = torch.tensor([float(io["timestep"])], dtype=torch.float32)
    out = None

    def run():
        nonlocal out
        with torch.no_grad():
            out = model(x, timestep, context, return_dict=False)[0]

    r = _times(run, args.repeats)
    np.save(os.path.join(d, "out_diffusers.npy"), out[0].numpy())
    a = torch.randn(MATMUL_N, MATMUL_N)
    with torch.no_grad():
        r["matmul_s"] = best_time(lambda: a @ a, 5).best
    emit({"side": "diffusers", "load_s": load_s, **r, "torch": torch.__version__,
          "diffusers": diffusers.__version__, "threads": torch.get_num_threads()})


def torch_check_child() -> None:
    """Fails unless torch and diffusers import (run with `--torch-python`)."""
    import diffusers  # noqa: F401
    import torch  # noqa: F401

    emit({"importable": True})


def run_wall(args) -> dict:
    """Both sides, one after the other, in fresh processes; the ratio and the output
    difference."""
    import numpy as np

    check = None
    if os.path.exists(args.torch_python):
        check = run_child(__file__, ["--child-check-torch"], python=args.torch_python)
    if check is None or not check.ok:
        why = "not found" if check is None else (check.reason or "import failed")[:200]
        return {"status": f"skipped: torch/diffusers not importable with "
                          f"{args.torch_python} ({why})"}
    d = tempfile.mkdtemp(prefix="vidax_wan_wall_")
    try:
        out = {"status": "ok"}
        for side, python, flag in (("vidax_eqx", sys.executable, "--child-wall"),
                                   ("diffusers", args.torch_python, "--child-diffusers")):
            log(f"# wall time: {side} ...")
            # vidax_eqx on one device: the simulated-device flag, if set, removed.
            child = run_child(__file__, [flag, "--child-dir", d, "--repeats", args.repeats],
                              python=python, devices=1 if side == "vidax_eqx" else None)
            if not child.ok or child.last is None:
                return {"status": f"error in the {side} process (exit {child.returncode}): "
                                  + (child.reason or "no result")[:400]}
            out[side] = child.last
        a = np.load(os.path.join(d, "out_vidax.npy")).astype(np.float64)
        b = np.load(os.path.join(d, "out_diffusers.npy")).astype(np.float64)
        out["max_rel_diff"] = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
        out["max_abs_diff"] = float(np.max(np.abs(a - b)))
        out["max_abs_ref"] = float(np.max(np.abs(b)))
        out["shape"] = list(a.shape)
        for k in ("best_s", "median_s", "best_cpu_s"):
            out[f"ratio_{k}"] = out["vidax_eqx"][k] / out["diffusers"][k]
        out["analytic_fwd_flops"] = wan_flops(WALL_CONFIG, _tokens())["fwd_total"]
        for side in ("vidax_eqx", "diffusers"):
            r = out[side]
            r["gflops"] = out["analytic_fwd_flops"] / r["best_s"] / 1e9
            r["matmul_gflops"] = 2 * MATMUL_N**3 / r["matmul_s"] / 1e9
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- #
# Output
# --------------------------------------------------------------------------- #


def wall_markdown(w: dict) -> str:
    tokens = _tokens()
    head = (f"Wall time against diffusers: dim {WALL_CONFIG['dim']}, {WALL_CONFIG['num_heads']} "
            f"heads, ffn {WALL_CONFIG['ffn_dim']}, {WALL_CONFIG['num_layers']} layers, latents "
            f"{WALL_LATENTS} ({tokens:,} tokens), text {WALL_TEXT[0]} x {WALL_TEXT[1]}, "
            "float32, batch 1, "
            f"forward, the same weights and inputs; this machine's CPU ({os.cpu_count()} cores, "
            "shared with other jobs).")
    if w["status"] != "ok":
        return head + "\n\n" + w["status"]
    v, t = w["vidax_eqx"], w["diffusers"]

    def row(name, r, setup, versions):
        return (f"| {name} | {r['best_s']:.2f} | {r['median_s']:.2f} | {r['best_cpu_s']:.2f} | "
                f"{len(r['runs_s'])} | "
                f"{r['gflops']:.0f} | {r['matmul_gflops']:.0f} | "
                f"{r['gflops'] / r['matmul_gflops']:.2f} | {setup} | {versions} |")

    return "\n".join([
        head,
        "",
        "| implementation | best (s) | median (s) | best CPU time (s) | runs | GFLOP/s | "
        "matmul GFLOP/s | of matmul | setup (s) | versions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        row("vidax_eqx (`eqx.filter_jit`, 1 device)", v, f"{v['compile_s']:.1f} compile",
            f"jax {v['jax']}"),
        row("diffusers `WanTransformer3DModel` (`torch.no_grad`)", t, f"{t['load_s']:.1f} load",
            f"torch {t['torch']} ({t['threads']} threads), diffusers {t['diffusers']}"),
        "",
        f"**vidax_eqx / diffusers: {w['ratio_best_s']:.2f} (best), {w['ratio_median_s']:.2f} "
        f"(median); process CPU time {w['ratio_best_cpu_s']:.2f} (best).** Max relative "
        "difference of the outputs (max |vidax - diffusers| / max "
        f"|diffusers|): {w['max_rel_diff']:.1e} (max |diff| {w['max_abs_diff']:.1e}, max "
        f"|diffusers| {w['max_abs_ref']:.2f}).",
        "",
        f"GFLOP/s: the analytic forward dot FLOPs ({w['analytic_fwd_flops'] / 1e12:.3f} TFLOP, "
        "module docstring) over the best time; matmul: a float32 "
        f"{MATMUL_N}x{MATMUL_N}x{MATMUL_N} product in the same process (best of 5), the "
        "framework's own ceiling on this machine. Each side ran in its own process, one after "
        "the other; one warm-up run each, then the timed runs; vidax_eqx's kernel choice is "
        "`implementation=\"auto\"`. The machine is shared: other jobs slow wall time (and "
        "the matmul rate) by different amounts in the two processes; process CPU time (all "
        "threads of the process) moves less, but counts threads that spin.",
    ])


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Wan 2.1's forward wall time (vidax_eqx.models.WanTransformer3D) against "
        "diffusers' WanTransformer3DModel on a small config, the same weights and inputs, "
        "each side in its own process."
    )
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per side after a warm-up (default 3)")
    p.add_argument("--torch-python", default=TORCH_PYTHON,
                   help=f"a Python with torch and diffusers (default {TORCH_PYTHON})")
    p.add_argument("--out", default=None,
                   help="output stem (default benchmarks/results/models_vs_diffusers; "
                   "models_vs_diffusers_quick with --quick)")
    p.add_argument("--quick", action="store_true", help="one timed run per side")
    # Hidden: one side in this (fresh) process.
    for flag in ("--child-wall", "--child-diffusers", "--child-check-torch"):
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = 1
    stem = "models_vs_diffusers_quick" if args.quick else "models_vs_diffusers"
    args.out = args.out or os.path.join(RESULTS, stem)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child_wall:
        vidax_child(args)
        return 0
    if args.child_diffusers:
        diffusers_child(args)
        return 0
    if args.child_check_torch:
        torch_check_child()
        return 0

    t_start = time.perf_counter()
    report = {
        "date": now(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "command": command_line(__file__, prefix="") if argv is None else None,
    }
    w = run_wall(args)
    w["seconds"] = time.perf_counter() - t_start
    report["diffusers"] = w
    log(f"# wall time: {w['status']}  [{w['seconds']:.0f} s]")
    report["seconds"] = time.perf_counter() - t_start
    text = wall_markdown(w)
    print(text)
    command = report["command"] or "benchmarks/models_vs_diffusers.py"
    write_text(args.out + ".md", f"# Wan 2.1 against diffusers: forward wall time\n\n"
               f"`python {command}`, {report['date']}, {report['seconds']:.0f} s.\n\n{text}\n")
    write_json(args.out + ".json", report)
    log(f"# wrote {os.path.relpath(args.out)}.md and .json after {report['seconds']:.0f} s")
    return 1 if w["status"].startswith("error") else 0


if __name__ == "__main__":
    sys.exit(main())
