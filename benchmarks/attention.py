"""Speed and memory of `vidax_eqx.kernels.attention` against `jax.nn.dot_product_attention`.

For each sequence length S (B=1, H=8, D=64, float32 by default) and each pass
(`fwd`; `fwd+bwd`, the gradient of `sum(out * cotangent)` with respect to q, k
and v), it measures four configurations in the same run:

- `jax.nn`: `jax.nn.dot_product_attention(implementation=None)` (XLA), the baseline;
- `xla`, `blockwise`, `auto`: `vidax_eqx.kernels.attention(implementation=...)`.

Every configuration runs in a fresh process (this script with the hidden
`--child` flag), one after another, so that each gets a clean heap and its
peak memory is its own. The child creates the inputs, compiles the jitted
function ahead of time, resets the RSS high-water mark (Linux), runs the
function once and reads it (`VmHWM`): peak memory above the inputs is that
minus the RSS just before the run (imported JAX, inputs and compiled program
included in the baseline, the compiler's own peak excluded). That first run is
also the warm-up; the time is the best of up to `--repeats` further runs
(fewer when one run is long, see `--target-seconds`), each synchronized with
`block_until_ready`. A first run longer than `--single-run-seconds` (S = 32768
on a small CPU) is the only timed run: the program is compiled ahead of
time, so it holds no compilation, and a second run would double a long wait.
Reported per row:

- `time / jax.nn`: the time as a ratio to `jax.nn` at the same S and pass;
- achieved GFLOP/s, with forward = 4*B*H*S^2*D flops and forward+backward =
  2.5x that (half of each with `--causal`), and that rate as a percentage of
  a large float32 matmul's GFLOP/s measured at the start of the same run;
- peak memory above the inputs (outputs included) and XLA's compiled
  `memory_analysis()` temp size.

A configuration whose compiled temp + output buffers would exceed
`--mem-budget-gb` is not run and is reported as "skipped (memory)".

    python benchmarks/attention.py --quick         # smoke run, about a minute
    python benchmarks/attention.py --plot          # full table, CSV and PNG
"""

import argparse
import dataclasses
import os
import platform
import sys
import time

from _harness import (
    PASSES, RESULTS, attention_pass, best_time, compile_ahead, emit, fmt, log,
    meminfo, now, run_child, run_with_peak, write_csv,
)


CONFIGS = ("jax.nn", "xla", "blockwise", "auto")
BASELINE = "jax.nn"
CSV_EXTRA = ("matmul_gflops", "matmul_cpu_gflops", "causal", "dtype", "jax", "cpus", "date")
DEFAULT_SEQS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_SEQS = (512, 1024)
DEFAULT_CSV = os.path.join(RESULTS, "attention.csv")
QUICK_CSV = os.path.join(RESULTS, "attention_quick.csv")
DEFAULT_PNG = os.path.join(RESULTS, "attention.png")


# --------------------------------------------------------------------------- #
# What is measured
# --------------------------------------------------------------------------- #


def attention_fn(config: str, causal: bool):
    import jax

    from vidax_eqx import kernels

    if config == BASELINE:

        def attn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=None)

    else:

        def attn(q, k, v):
            return kernels.attention(q, k, v, causal=causal, implementation=config)

    return attn


def benchmark_fn(config: str, pass_: str, causal: bool):
    """The jitted function of one configuration, and how many inputs it takes."""
    return attention_pass(attention_fn(config, causal), pass_)


def make_inputs(shape, dtype: str, n: int, seed: int = 0):
    """`n` random normal arrays: q, k, v in `dtype`, then a float32 cotangent."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), n)
    dtypes = [dtype] * 3 + ["float32"] * (n - 3)
    return jax.block_until_ready(
        [jax.random.normal(key, shape, jnp.dtype(dt)) for key, dt in zip(keys, dtypes)]
    )


def flops(pass_: str, B: int, H: int, S: int, D: int, causal: bool) -> float:
    f = 4.0 * B * H * S * S * D
    if pass_ == "fwd+bwd":
        f *= 2.5
    if causal:
        f /= 2
    return f


def matmul_gflops(n: int, repeats: int) -> tuple[float, float]:
    """GFLOP/s of an (n, n) @ (n, n) float32 matmul, best of `repeats` after a
    warm-up: per wall second, and per CPU second (summed over threads)."""
    import jax
    import jax.numpy as jnp

    a, b = make_inputs((n, n), "float32", 2, seed=1)
    compiled, _, _ = compile_ahead(jax.jit(jnp.matmul), (a, b))
    t = best_time(lambda: jax.block_until_ready(compiled(a, b)), repeats)
    return 2.0 * n**3 / t.best / 1e9, 2.0 * n**3 / t.best_cpu / 1e9


# --------------------------------------------------------------------------- #
# One configuration, in a fresh process
# --------------------------------------------------------------------------- #


def child_main(args) -> dict:
    """Measures one configuration: peak memory of its first run, then its best time."""
    import jax

    from vidax_eqx import kernels

    result = {"status": "ok"}
    shape = (args.batch, args.child_seq, args.heads, args.head_dim)
    fn, n_in = benchmark_fn(args.child_config, args.child_pass, args.causal)
    xs = make_inputs(shape, args.dtype, n_in)
    if args.child_config == BASELINE:
        result["implementation"] = "xla (jax.nn)"
    else:
        result["implementation"] = kernels.select_implementation(
            *xs[:3], causal=args.causal, implementation=args.child_config
        )
    compiled, temp, out = compile_ahead(fn, xs)
    result.update(xla_temp_bytes=temp, xla_output_bytes=out)
    need = (temp or 0) + (out or 0)
    if need > args.mem_budget_gb * 2**30:
        result["status"] = "skipped (memory)"
        result["note"] = f"needs {need / 2**30:.1f} GB > budget {args.mem_budget_gb:g} GB"
        return result

    def run():
        return jax.block_until_ready(compiled(*xs))

    first, _, peak = run_with_peak(run)
    result.update(peak_reset=peak.reset, peak_above_inputs_bytes=peak.above_baseline,
                  baseline_rss_bytes=peak.baseline, first_run_s=first.wall)
    # A first run longer than --single-run-seconds is the only timed one: the program
    # was compiled ahead of time, so it holds no compilation.
    timing = best_time(run, args.repeats, target_seconds=args.target_seconds,
                       single_run_seconds=args.single_run_seconds, first=first)
    result.update(timing.fields())
    return result


def spawn_child(args, config: str, pass_: str, seq: int) -> dict:
    cmd = [
        "--child",
        "--child-config", config, "--child-pass", pass_, "--child-seq", str(seq),
        "--batch", str(args.batch), "--heads", str(args.heads),
        "--head-dim", str(args.head_dim), "--dtype", args.dtype,
        "--repeats", str(args.repeats), "--target-seconds", str(args.target_seconds),
        "--single-run-seconds", str(args.single_run_seconds),
        "--mem-budget-gb", str(args.mem_budget_gb),
    ]  # fmt: skip
    if args.causal:
        cmd.append("--causal")
    return run_child(__file__, cmd).record()


# --------------------------------------------------------------------------- #
# The run
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Row:
    seq: int
    pass_: str
    config: str
    implementation: str = ""
    status: str = "ok"
    time_s: float | None = None
    runs: int | None = None
    ratio_vs_jax_nn: float | None = None
    gflops: float | None = None
    frac_of_matmul: float | None = None
    cpu_s: float | None = None
    cpu_ratio_vs_jax_nn: float | None = None
    cpu_frac_of_matmul: float | None = None
    peak_above_inputs_mb: float | None = None
    xla_temp_mb: float | None = None
    note: str = ""


def _mb(x) -> float | None:
    return None if x is None else x / 2**20


def run(args) -> tuple[list[Row], dict]:
    import jax

    info = {
        "date": now(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "B": args.batch,
        "H": args.heads,
        "D": args.head_dim,
        "dtype": args.dtype,
        "causal": args.causal,
        "mem_budget_gb": args.mem_budget_gb,
    }
    log(f"# {info}")
    t_start = time.perf_counter()
    n = args.matmul_n
    info["matmul_n"] = n
    info["matmul_gflops"], info["matmul_cpu_gflops"] = matmul_gflops(n, repeats=args.repeats)
    log(
        f"# matmul {n}x{n} @ {n}x{n} float32: {info['matmul_gflops']:.1f} GFLOP/s, "
        f"{info['matmul_cpu_gflops']:.1f} GFLOP per CPU second"
    )

    rows: list[Row] = []
    for seq in args.seqs:
        for pass_ in PASSES:
            base_time = base_cpu = None
            for config in args.configs:
                r = spawn_child(args, config, pass_, seq)
                row = Row(
                    seq,
                    pass_,
                    config,
                    implementation=r.get("implementation", ""),
                    status=r["status"],
                    time_s=r.get("time_s"),
                    runs=r.get("runs"),
                    cpu_s=r.get("cpu_s"),
                    peak_above_inputs_mb=_mb(r.get("peak_above_inputs_bytes")),
                    xla_temp_mb=_mb(r.get("xla_temp_bytes")),
                    note=r.get("note", ""),
                )
                if r.get("peak_reset") is False:
                    row.note = "; ".join(filter(None, (row.note, "peak includes compilation")))
                rows.append(row)
                if row.time_s is not None:
                    work = flops(pass_, args.batch, args.heads, seq, args.head_dim, args.causal)
                    row.gflops = work / row.time_s / 1e9
                    row.frac_of_matmul = row.gflops / info["matmul_gflops"]
                    row.cpu_frac_of_matmul = work / row.cpu_s / 1e9 / info["matmul_cpu_gflops"]
                    if config == BASELINE:
                        base_time, base_cpu = row.time_s, row.cpu_s
                    if base_time is not None:
                        row.ratio_vs_jax_nn = row.time_s / base_time
                        row.cpu_ratio_vs_jax_nn = row.cpu_s / base_cpu
                    summary = (
                        f"{row.time_s * 1e3:.1f} ms ({_runs(row)}), {row.gflops:.1f} GFLOP/s, "
                        f"peak {fmt(row.peak_above_inputs_mb, '.0f')} MB"
                    )
                else:
                    summary = f"{row.status} {row.note}"
                elapsed = time.perf_counter() - t_start
                log(f"S={seq} {pass_} {config} [{row.implementation}]: {summary}  [{elapsed:.0f} s]")
    info["seconds"] = round(time.perf_counter() - t_start, 1)
    return rows, info


# --------------------------------------------------------------------------- #
# Output
# --------------------------------------------------------------------------- #


def _runs(row: Row) -> str:
    if "first run" in row.note:
        return "first run only"
    return f"best of {row.runs}"


def markdown(rows: list[Row], info: dict) -> str:
    causal = ", causal" if info["causal"] else ""
    lines = [
        f"B={info['B']}, H={info['H']}, D={info['D']}, {info['dtype']}{causal}; jax {info['jax']}, "
        f"{info['backend']} ({info['cpus']} CPUs); {info['matmul_n']}^3 float32 matmul: "
        f"{info['matmul_gflops']:.0f} GFLOP/s ({info['matmul_cpu_gflops']:.0f} per CPU second). "
        "Peak memory includes the outputs and some tens of MB that any first run costs "
        "(thread stacks, allocator arenas). The CPU columns use process CPU time (all "
        "threads), which other load on a shared machine disturbs far less than wall time.",
        "",
        "| S | pass | config | runs as | time (ms) | timed runs | time / jax.nn | GFLOP/s | "
        "% of matmul | CPU time / jax.nn | % of matmul (CPU) | peak above inputs (MB) | "
        "XLA temp (MB) |",
        "|---:|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        time_cell = fmt(r.time_s and r.time_s * 1e3, ".1f") if r.status == "ok" else r.status
        pct = None if r.frac_of_matmul is None else 100 * r.frac_of_matmul
        cpu_pct = None if r.cpu_frac_of_matmul is None else 100 * r.cpu_frac_of_matmul
        lines.append(
            f"| {r.seq} | {r.pass_} | `{r.config}` | {r.implementation} | {time_cell} | "
            f"{_runs(r) if r.time_s is not None else '–'} | "
            f"{fmt(r.ratio_vs_jax_nn, '.2f')} | {fmt(r.gflops, '.1f')} | {fmt(pct, '.0f')} | "
            f"{fmt(r.cpu_ratio_vs_jax_nn, '.2f')} | {fmt(cpu_pct, '.0f')} | "
            f"{fmt(r.peak_above_inputs_mb, '.0f')} | {fmt(r.xla_temp_mb, '.0f')} |"
        )
    return "\n".join(lines)


def plot(rows: list[Row], info: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"fwd": "-", "fwd+bwd": "--"}
    colors = dict(zip(CONFIGS, ("black", "tab:blue", "tab:orange", "tab:green")))
    for config in CONFIGS:
        for pass_ in PASSES:
            ok = [r for r in rows if r.config == config and r.pass_ == pass_ and r.time_s is not None]
            if not ok:
                continue
            kw = dict(color=colors[config], linestyle=styles[pass_], marker="o", label=f"{config} {pass_}")
            ax_t.plot([r.seq for r in ok], [r.time_s for r in ok], **kw)
            mem = [r for r in ok if r.peak_above_inputs_mb is not None]
            ax_m.plot([r.seq for r in mem], [max(r.peak_above_inputs_mb, 0.1) for r in mem], **kw)
    for ax, label in ((ax_t, "time (s)"), (ax_m, "peak memory above inputs (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length S")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8)
    causal = ", causal" if info["causal"] else ""
    fig.suptitle(
        f"attention, B={info['B']} H={info['H']} D={info['D']} {info['dtype']}{causal} "
        f"({info['backend']}, {info['cpus']} CPUs, jax {info['jax']}); "
        "skipped configurations are not drawn"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


def parse_args(argv=None):
    rel = os.path.relpath
    p = argparse.ArgumentParser(
        description="Time and peak memory of vidax_eqx attention against "
        "jax.nn.dot_product_attention, forward and forward+backward, each "
        "configuration in a fresh process. Prints a Markdown table and writes a CSV."
    )
    p.add_argument("--seqs", type=int, nargs="+", default=None,
                   help=f"sequence lengths (default {' '.join(map(str, DEFAULT_SEQS))})")
    p.add_argument("--causal", action="store_true", help="causal attention (flops counted as half)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                   help="configurations to measure (default: all; jax.nn gives the ratios)")
    p.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    p.add_argument("--heads", type=int, default=8, help="heads H (default 8)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim D (default 64)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of q, k, v (default float32)")
    p.add_argument("--repeats", type=int, default=5,
                   help="most timed runs per configuration after the warm-up (default 5)")
    p.add_argument("--target-seconds", type=float, default=10.0,
                   help="fewer timed runs (at least one) when they would take longer "
                   "than this many seconds (default 10)")
    p.add_argument("--single-run-seconds", type=float, default=30.0,
                   help="a configuration whose first run takes longer than this many seconds "
                   "is timed on that run alone, without a warm-up (default 30)")
    p.add_argument("--mem-budget-gb", type=float, default=None,
                   help="skip configurations whose compiled temp + output buffers exceed "
                   "this (default 12, or 75%% of the available memory if less)")
    p.add_argument("--matmul-n", type=int, default=4096,
                   help="size of the reference float32 matmul (default 4096)")
    p.add_argument("--csv", default=None, help=f"CSV output (default {rel(DEFAULT_CSV)}; "
                   f"{rel(QUICK_CSV)} with --quick)")
    p.add_argument("--plot", nargs="?", const=DEFAULT_PNG, default=None, metavar="PNG",
                   help=f"also plot time and peak memory against S (default {rel(DEFAULT_PNG)})")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: S={' '.join(map(str, QUICK_SEQS))}, 2 repeats, 2048 matmul")
    # Hidden: measure one configuration in this (fresh) process; used by the parent.
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-config", choices=CONFIGS, help=argparse.SUPPRESS)
    p.add_argument("--child-pass", choices=PASSES, help=argparse.SUPPRESS)
    p.add_argument("--child-seq", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.quick:
        args.seqs = args.seqs or list(QUICK_SEQS)
        args.repeats = min(args.repeats, 2)
        args.matmul_n = min(args.matmul_n, 2048)
        args.csv = args.csv or QUICK_CSV
    args.seqs = args.seqs or list(DEFAULT_SEQS)
    args.csv = args.csv or DEFAULT_CSV
    if args.mem_budget_gb is None:
        args.mem_budget_gb = 12.0
        available = meminfo("MemAvailable")
        if available is not None:
            args.mem_budget_gb = round(min(12.0, 0.75 * available / 2**30), 1)
    if BASELINE in args.configs:  # first, so that every ratio has its baseline
        args.configs = [BASELINE] + [c for c in args.configs if c != BASELINE]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        emit(child_main(args))
        return 0
    rows, info = run(args)
    print(markdown(rows, info))
    write_csv(args.csv, Row, rows, info, CSV_EXTRA)
    log(f"# wrote {os.path.relpath(args.csv)} after {info['seconds']:.0f} s")
    if args.plot:
        plot(rows, info, args.plot)
        log(f"# wrote {os.path.relpath(args.plot)}")
    failed = [r for r in rows if r.status.startswith("error")]
    for r in failed:
        log(f"# S={r.seq} {r.pass_} {r.config}: {r.status}: {r.note}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
