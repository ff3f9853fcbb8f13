"""Dense attention on a TPU: vidax_eqx's `"pallas_tpu"` against JAX's splash kernel called
directly, in one process, and XLA where its score matrix fits.

    python benchmarks/tpu/tpu_attention.py --out DIR            # the table (docs/benchmarks.md)
    python benchmarks/tpu/tpu_attention.py --sweep --out DIR    # the tuning sweep behind
                                                                # kernels/pallas_tpu/_tuning.py
    python benchmarks/tpu/tpu_attention.py --smoke --out DIR    # tiny, anywhere (CPU: interpret)
    python benchmarks/tpu/tpu_attention.py --quick --problems '^32760 12 causal$' --out DIR
                                                            # some rows, tuned splash only

**The table.** Wan's heads (12 of 128: Wan 2.1 1.3B; 40: 14B), bf16, one video, at
32,768 and 8,192 tokens and at Wan 480p's 32,760 (not a multiple of 128), full and
causal: forward and forward+backward (the gradient of q, k, v through a random
cotangent) of

- `"pallas_tpu"` (what `"auto"` runs on a TPU) with its tuning table, on `(B, S, H, D)`
  arrays, as the library takes them;
- splash called directly (`make_splash_mha` on `(H, S, D)` arrays per example, its own
  custom VJP) at JAX's default blocks (128) and at the candidate configurations below
  (the larger tiles with a 64 MiB scoped VMEM limit; the fused backward where named),
  on the next multiple of 128 for a length splash does not take (32,760 -> 32,768);
- `jax.nn.dot_product_attention` (XLA) where its float32 scores and their gradient fit.

Each row gives ms, TFLOP/s and the fraction of a bf16 8192^3 matmul measured in the same
process; the library's rows give `ours / fastest splash` (the fastest configuration of
each pass separately). Timing: each program compiled first, then the best of 3 rounds of
back-to-back calls (asynchronous dispatch hides the launch), divided by the calls.

**The sweep** (`--sweep`): per problem, the forward over tile configurations, then the
backward: the dK/dV tiles with the dQ tiles fixed, the dQ tiles with the best dK/dV, and
the fused backward over dK/dV tiles; it prints the best of each, and the library at the
sweep's best configuration (`PallasTpu(blocks=...)`, so that `ours / splash` at one
configuration is the adapter's own cost). The table in `kernels/pallas_tpu/_tuning.py` is
written from it.
"""

import argparse
import dataclasses
import datetime
import os
import re
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the shared harness
from _harness import write_json, write_text  # noqa: E402  (also puts this checkout first on sys.path)
from _splash import attend as splash_attend, compile_with, sk, VMEM  # noqa: E402
from vidax_eqx import kernels  # noqa: E402


BF16, F32 = jnp.bfloat16, jnp.float32


@dataclasses.dataclass(frozen=True)
class Problem:
    S: int
    H: int
    causal: bool
    D: int = 128

    @property
    def splash_S(self) -> int:
        return -(-self.S // 128) * 128

    def flops(self, backward: bool) -> float:
        f = 4.0 * self.S * self.S * self.H * self.D * (0.5 if self.causal else 1.0)
        return f * (3.5 if backward else 1.0)

    def __str__(self):
        return f"S={self.S} H={self.H} {'causal' if self.causal else 'full'}"


# (block_q, block_kv, block_kv_compute)
FWD = [(512, 512, 512), (512, 1024, 512), (1024, 1024, 512), (1024, 1024, 1024),
       (1024, 2048, 512), (1024, 2048, 1024), (2048, 1024, 1024), (2048, 2048, 1024)]
# (block_q_dkv, block_kv_dkv, block_kv_dkv_compute)
DKV = [(512, 512, 512), (512, 1024, 512), (1024, 1024, 512), (1024, 2048, 512),
       (2048, 1024, 512), (512, 2048, 512)]
# (block_q_dq, block_kv_dq)
DQ = [(512, 512), (1024, 1024), (512, 1024), (1024, 512), (2048, 1024)]


def block_sizes(fwd, dkv, dq=None) -> sk.BlockSizes:
    """Splash's `BlockSizes`: unfused when `dq` is given, else fused."""
    extra = dict(block_q_dq=dq[0], block_kv_dq=dq[1]) if dq else dict(use_fused_bwd_kernel=True)
    return sk.BlockSizes(block_q=fwd[0], block_kv=fwd[1], block_kv_compute=fwd[2],
                         block_q_dkv=dkv[0], block_kv_dkv=dkv[1], block_kv_dkv_compute=dkv[2], **extra)


def ours_blocks(bs: sk.BlockSizes) -> kernels.SplashBlocks:
    fused = bs.use_fused_bwd_kernel
    return kernels.SplashBlocks(
        bs.block_q, bs.block_kv, bs.block_kv_compute, block_q_dkv=bs.block_q_dkv,
        block_kv_dkv=bs.block_kv_dkv, block_kv_dkv_compute=bs.block_kv_dkv_compute,
        block_q_dq=None if fused else bs.block_q_dq, block_kv_dq=None if fused else bs.block_kv_dq,
        fused_bwd=fused, vmem_limit_bytes=VMEM)


def shorten(bs) -> str:
    if bs is None:
        return "default 128"
    s = f"fwd {bs.block_q}/{bs.block_kv}/{bs.block_kv_compute} dkv {bs.block_q_dkv}/{bs.block_kv_dkv}/{bs.block_kv_dkv_compute}"
    return s + (" fused" if bs.use_fused_bwd_kernel else f" dq {bs.block_q_dq}/{bs.block_kv_dq}")


def seconds(compiled, args, *, iters: int, reps: int = 3) -> float:
    """Best over `reps` rounds of `iters` back-to-back calls, per call."""
    jax.block_until_ready(compiled(*args))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        out = None
        for _ in range(iters):
            out = compiled(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def iters_for(p: Problem, smoke: bool) -> int:
    if smoke:
        return 1
    return max(2, min(20, int(2e12 / p.flops(False))))


def inputs(p: Problem, S: int, heads_major: bool, smoke: bool):
    keys = jax.random.split(jax.random.key(p.S + p.H), 4)
    shape = (1, p.H, S, p.D) if heads_major else (1, S, p.H, p.D)
    return tuple(jax.random.normal(k, shape, F32).astype(BF16) for k in keys)


def loss_grad(attend):
    def loss(q, k, v, d):
        return jnp.sum(attend(q, k, v).astype(F32) * d.astype(F32))
    return jax.grad(loss, (0, 1, 2))


def splash_row(p: Problem, bs, args, interpret: bool, smoke: bool, passes=("fwd", "fwd_bwd")) -> dict:
    """Splash called directly on `(1, H, S, D)`: `{fwd_s, fwd_bwd_s}` or `{error}`."""
    S = p.splash_S
    row = dict(impl="splash", config=shorten(bs), S=S)
    if time.perf_counter() > DEADLINE[0]:
        row["error"] = "not run: budget spent"
        return row
    try:
        attend = splash_attend(S, p.H, p.causal, bs, interpret=interpret)
        q, k, v, d = args
        if "fwd" in passes:
            row["fwd_s"] = seconds(compile_with(attend, (q, k, v), VMEM), (q, k, v), iters=iters_for(p, smoke))
        if "fwd_bwd" in passes:
            row["fwd_bwd_s"] = seconds(compile_with(loss_grad(attend), args, VMEM), args,
                                       iters=max(1, iters_for(p, smoke) // 3))
    except Exception as e:  # a configuration that does not compile (VMEM) is a row too
        row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [repr(e)])[0][:200]}"
    log(p, row)
    return row


def ours_row(p: Problem, impl, name: str, args, smoke: bool) -> dict:
    row = dict(impl=name, S=p.S)
    try:
        attend = lambda q, k, v: kernels.attention(q, k, v, causal=p.causal, implementation=impl)  # noqa: E731
        if isinstance(impl, kernels.AbstractImplementation) or impl == "pallas_tpu":
            blocks = kernels.splash_blocks(*args[:3], causal=p.causal,
                                           implementation=impl if not isinstance(impl, str) else "pallas_tpu")
            row["config"] = None if blocks is None else str(blocks)
        q, k, v, d = args
        row["fwd_s"] = seconds(jax.jit(attend).lower(q, k, v).compile(), (q, k, v), iters=iters_for(p, smoke))
        row["fwd_bwd_s"] = seconds(jax.jit(loss_grad(attend)).lower(*args).compile(), args,
                                   iters=max(1, iters_for(p, smoke) // 3))
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [repr(e)])[0][:200]}"
    log(p, row)
    return row


def xla_row(p: Problem, args, smoke: bool) -> dict:
    row = dict(impl="xla (jax.nn)", S=p.S)
    if not smoke and p.H * p.S * p.S * 4 * 3 > 12 * 2**30:
        row["skipped"] = "scores do not fit"
        return row
    try:
        attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=p.causal,  # noqa: E731
                                                               implementation="xla")
        q, k, v, d = args
        row["fwd_s"] = seconds(jax.jit(attend).lower(q, k, v).compile(), (q, k, v), iters=iters_for(p, smoke))
        row["fwd_bwd_s"] = seconds(jax.jit(loss_grad(attend)).lower(*args).compile(), args, iters=1)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [repr(e)])[0][:200]}"
    log(p, row)
    return row


def log(p: Problem, row: dict) -> None:
    parts = [str(p), row["impl"], row.get("config", "")]
    for key in ("fwd_s", "fwd_bwd_s"):
        if key in row:
            parts.append(f"{key[:-2]} {row[key] * 1e3:.2f} ms")
    if "error" in row:
        parts.append(row["error"])
    print(" | ".join(str(x) for x in parts), flush=True)


def matmul_tflops(smoke: bool) -> float:
    n = 1024 if smoke else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), BF16)
    f = jax.jit(lambda a, b: a @ b).lower(a, a).compile()
    return 2.0 * n**3 / seconds(f, (a, a), iters=10) / 1e12


# -- the table -------------------------------------------------------------------------------

def candidates(p: Problem, tuned_only: bool = False) -> list:
    """The splash configurations the table times for `p`: JAX's default tiles (not at 40
    heads, where they take seconds) and the sweep's finalists for the problem; with
    `tuned_only`, the finalists alone (not the default tiles, not the issue's row)."""
    big_fused = block_sizes((2048, 2048, 1024), (1024, 2048, 512))
    big_unfused = block_sizes((2048, 2048, 1024), (1024, 2048, 512), (2048, 1024))
    mid_fused = block_sizes((1024, 2048, 1024), (1024, 1024, 512))
    issue = block_sizes((512, 1024, 512), (512, 1024, 512))  # the issue's best backward
    if p.causal:
        found = [block_sizes((1024, 2048, 512), (1024, 1024, 512), (1024, 1024)),
                 block_sizes((1024, 2048, 512), (1024, 1024, 512))]
    elif p.H > 12:
        return [big_fused, big_unfused]
    elif p.S >= 16384:
        found = [big_fused, big_unfused, issue]
    else:
        found = [mid_fused, big_fused, issue]
    return [bs for bs in found if bs is not issue] if tuned_only else [None] + found


def _metrics(p: Problem, row: dict, best: dict, matmul: float) -> dict:
    """`row` with TFLOP/s, the fraction of the matmul rate and the ratio to `best`."""
    row = dict(row, problem=str(p))
    for key in ("fwd_s", "fwd_bwd_s"):
        if key in row:
            tf = p.flops(key == "fwd_bwd_s") / row[key] / 1e12
            row[key[:-2] + "_tflops"], row[key[:-2] + "_of_matmul"] = tf, tf / matmul
            if best.get(key):
                row[key[:-2] + "_vs_splash"] = row[key] / best[key]
    return row


def table_rows(problems, interpret, smoke, matmul, tuned_only: bool = False) -> list[dict]:
    """Per problem, the library's rows (and XLA's), then splash's at each candidate (once
    per length splash runs, with the first problem of that length)."""
    rows, splash_of = [], {}
    for p in problems:
        key = (p.splash_S, p.H, p.causal)
        fresh = key not in splash_of
        if fresh:
            sp = dataclasses.replace(p, S=p.splash_S)
            args = inputs(sp, sp.S, True, smoke)
            tried = [None] if smoke else candidates(p, tuned_only)
            splash_of[key] = [splash_row(sp, bs, args, interpret, smoke) for bs in tried]
            del args
        splash = splash_of[key]
        best = {k: min((r[k] for r in splash if k in r), default=None) for k in ("fwd_s", "fwd_bwd_s")}
        args = inputs(p, p.S, False, smoke)
        impl = kernels.PallasTpu(interpret=True, block_q=128, block_kv=128) if interpret else "pallas_tpu"
        mine = [ours_row(p, impl, "vidax pallas_tpu", args, smoke)]
        if p.S <= 8192 or smoke:
            mine.append(xla_row(p, args, smoke))
        del args
        rows += [_metrics(p, r, best, matmul) for r in mine]
        if fresh:
            sp = dataclasses.replace(p, S=p.splash_S)
            rows += [_metrics(sp, r, best, matmul) for r in splash]
    return rows


def markdown(rows: list[dict], head: str) -> str:
    lines = [head, "", "| problem | path | configuration | fwd ms | fwd of matmul | fwd / best splash "
             "| fwd+bwd ms | fwd+bwd of matmul | fwd+bwd / best splash |", "|" + "---|" * 9]
    seen = set()
    for r in rows:
        ident = (r["problem"], r["impl"], r.get("config"))
        if ident in seen:
            continue
        seen.add(ident)
        cfg = r.get("config") or ""
        if len(cfg) > 60:
            cfg = cfg[:60] + "..."
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['problem']} | {r['impl']} | {cfg} | {r.get('error') or r.get('skipped')} |||||||")
            continue

        def f(key, spec):
            return format(r[key], spec) if key in r else "–"

        lines.append(
            f"| {r['problem']} | {r['impl']} | {cfg} | {r['fwd_s'] * 1e3:.2f} | {f('fwd_of_matmul', '.2f')} "
            f"| {f('fwd_vs_splash', '.3f')} | {(r['fwd_bwd_s'] * 1e3) if 'fwd_bwd_s' in r else float('nan'):.2f} "
            f"| {f('fwd_bwd_of_matmul', '.2f')} | {f('fwd_bwd_vs_splash', '.3f')} |")
    return "\n".join(lines)


# -- the sweep -------------------------------------------------------------------------------


DEADLINE = [float("inf")]  # perf_counter time after which the sweep starts no configuration


def sweep(p: Problem, interpret, smoke, lists) -> dict:
    fwd_list, dkv_list, dq_list, fused_list = lists
    if time.perf_counter() > DEADLINE[0]:
        print(f"SWEEP {p}: skipped (budget spent)", flush=True)
        return dict(problem=str(p), skipped="budget")
    S = p.splash_S
    sp = dataclasses.replace(p, S=S)
    args = inputs(sp, S, True, smoke)
    found = dict(problem=str(sp), fwd=[], dkv=[], dq=[], fused=[])
    for f in fwd_list:
        r = splash_row(sp, block_sizes(f, (512, 512, 512), (512, 512)), args, interpret, smoke, passes=("fwd",))
        found["fwd"].append(dict(r, tiles=f))
    ok = [r for r in found["fwd"] if "fwd_s" in r]
    if not ok:
        return dict(found, skipped="no forward configuration ran")
    best_f = min(ok, key=lambda r: r["fwd_s"])["tiles"]
    for t in dkv_list:
        r = splash_row(sp, block_sizes(best_f, t, (1024, 1024) if S >= 1024 else (S, S)), args, interpret, smoke,
                       passes=("fwd_bwd",))
        found["dkv"].append(dict(r, tiles=t))
    ok = [r for r in found["dkv"] if "fwd_bwd_s" in r]
    if not ok:
        return dict(found, skipped="no backward configuration ran")
    best_dkv = min(ok, key=lambda r: r["fwd_bwd_s"])["tiles"]
    for t in dq_list:
        r = splash_row(sp, block_sizes(best_f, best_dkv, t), args, interpret, smoke, passes=("fwd_bwd",))
        found["dq"].append(dict(r, tiles=t))
    ok = [r for r in found["dq"] if "fwd_bwd_s" in r] or [dict(found["dkv"][0], tiles=(1024, 1024))]
    best_dq = min(ok, key=lambda r: r.get("fwd_bwd_s", float("inf")))["tiles"]
    for t in fused_list:
        r = splash_row(sp, block_sizes(best_f, t), args, interpret, smoke, passes=("fwd_bwd",))
        found["fused"].append(dict(r, tiles=t))
    ok = [r for r in found["fused"] if "fwd_bwd_s" in r]
    best_fused = min(ok, key=lambda r: r["fwd_bwd_s"])["tiles"] if ok else None
    unfused_s = min([r["fwd_bwd_s"] for r in found["dq"] + found["dkv"] if "fwd_bwd_s" in r])
    fused_s = min((r["fwd_bwd_s"] for r in ok), default=float("inf"))
    best = (block_sizes(best_f, best_fused) if fused_s < unfused_s
            else block_sizes(best_f, best_dkv, best_dq))
    found["best"] = shorten(best)
    found["best_unfused"] = shorten(block_sizes(best_f, best_dkv, best_dq))
    found["unfused_fwd_bwd_s"], found["fused_fwd_bwd_s"] = unfused_s, fused_s
    # The library at the same configurations (the adapter's own cost), at S and at S - 8.
    del args
    for cfg_name, bs in (("best", best), ("best_unfused", block_sizes(best_f, best_dkv, best_dq))):
        for S_ours in sorted({p.S, S}):
            po = dataclasses.replace(p, S=S_ours)
            oargs = inputs(po, S_ours, False, smoke)
            impl = kernels.PallasTpu(blocks=ours_blocks(bs), interpret=interpret)
            found.setdefault("ours", []).append(dict(ours_row(po, impl, f"vidax at {cfg_name}", oargs, smoke),
                                                     config=shorten(bs)))
    print(f"SWEEP {sp}: best {found['best']} (unfused {unfused_s * 1e3:.2f} ms, fused "
          f"{fused_s * 1e3:.2f} ms); fwd best {best_f}", flush=True)
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".", metavar="DIR")
    parser.add_argument("--sweep", action="store_true", help="the tuning sweep instead of the table")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode off a TPU")
    parser.add_argument("--quick", action="store_true",
                        help="every problem against the tuned splash configurations only (not JAX's default "
                             "tiles, not the issue's row)")
    parser.add_argument("--problems", default=None, metavar="REGEX",
                        help="only the table's problems whose 'S H full|causal' matches, e.g. '^32760 12 causal$'")
    parser.add_argument("--budget", type=float, default=float("inf"), metavar="SECONDS",
                        help="start no configuration after this many seconds")
    args = parser.parse_args()
    DEADLINE[0] = time.perf_counter() + args.budget
    on_tpu = jax.default_backend() == "tpu"
    interpret = not on_tpu
    device = jax.devices()[0]
    stamp = dict(date=datetime.date.today().isoformat(), jax=jax.__version__,
                 device=device.device_kind, backend=jax.default_backend())
    print(stamp, flush=True)
    matmul = matmul_tflops(args.smoke or not on_tpu)
    print(f"bf16 matmul {matmul:.1f} TFLOP/s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    if args.sweep:
        if args.smoke or not on_tpu:
            problems = [Problem(512, 2, False, 64)]
            lists = ([(128, 256, 128), (256, 256, 256)], [(128, 256, 128), (256, 256, 128)],
                     [(128, 128), (256, 256)], [(128, 256, 128)])
            plan = [(p, lists) for p in problems]
        else:
            full = (FWD, DKV, DQ, DKV[:4])
            small = (FWD[:6], DKV[:4], DQ[:3], DKV[:3])
            plan = [(Problem(32760, 12, False), full), (Problem(8192, 12, False), small),
                    (Problem(32760, 12, True), small), (Problem(8192, 12, True), small)]
        results = [sweep(p, interpret, args.smoke or not on_tpu, lists) for p, lists in plan]
        write_json(os.path.join(args.out, "tpu_attention_sweep.json"), dict(stamp, matmul_tflops=matmul,
                                                                           results=results))
        return
    if args.smoke or not on_tpu:
        problems = [Problem(500, 2, False, 64), Problem(512, 2, True, 64)]
    else:
        problems = [Problem(S, 12, False) for S in (32768, 32760, 8192)]
        problems += [Problem(32768, 12, True), Problem(32760, 12, True), Problem(32760, 40, False)]
    if args.problems:
        problems = [p for p in problems if re.search(args.problems, f"{p.S} {p.H} {'causal' if p.causal else 'full'}")]
    rows = table_rows(problems, interpret, args.smoke or not on_tpu, matmul, tuned_only=args.quick)
    head = (f"{stamp['date']}, JAX {stamp['jax']}, {stamp['device']}; bf16 matmul "
            f"{matmul:.1f} TFLOP/s; B=1, D=128, bf16")
    md = markdown(rows, head)
    print(md)
    write_json(os.path.join(args.out, "tpu_attention.json"), dict(stamp, matmul_tflops=matmul, rows=rows))
    write_text(os.path.join(args.out, "tpu_attention.md"), md + "\n")


if __name__ == "__main__":
    sys.exit(main())
