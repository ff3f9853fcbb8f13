"""One-command accuracy and speed check of vidax_eqx on a GPU or TPU.

    python benchmarks/accelerator_check.py                 # realistic shapes, within --budget (240 s)
    python benchmarks/accelerator_check.py --smoke         # tiny shapes (any platform, also CPU)
    python benchmarks/accelerator_check.py --budget 120 --json report.json

Three parts, in bfloat16, each checked against a float32 `"xla"` reference:

- **kernels**: for each shape (B=1, H in {16, 40}, D in {64, 128}, S from 8k to
  64k, non-causal and causal) and each implementation available on this platform
  (`"auto"`, the vendor kernels, `"blockwise"`, and `"xla"` while its score
  matrix fits): the output on a slice of query rows (and, at the smallest S, the
  gradients of q, k, v) as max |error| / max |reference|; forward and
  forward+backward wall time (best of `--reps` runs), achieved TFLOP/s
  (4·S_q·S_k·H·D per forward, halved when causal; the backward counted as 2.5
  forwards), the time as a ratio to the fastest vendor kernel of the row, and the
  rate as a fraction of a large bfloat16 matmul measured in the same run;
- **Wan layer**: a whole `vidax_eqx.nn.Attention` configured as Wan 2.1 1.3B's
  self-attention (dim 1536, 12 heads of 128, q/k RMSNorm, 3D RoPE) with
  `implementation="auto"`: forward and forward+backward timed at S = 32,760
  (21 x 30 x 52 tokens: 81 frames at 480 x 832), the output and the gradients
  of `x` and of every weight checked against the float32 `"xla"` layer at
  S = 4,680 (3 x 30 x 52);
- **ring attention**: `vidax_eqx.parallel.ring_attention` inside `jax.shard_map`
  over all local devices (`make_mesh(sp=jax.device_count())`; one device is a
  ring of one), non-causal and causal, forward and backward, against
  single-device attention on the gathered arrays; timed.

Rows run in order of information (the first kernel shape, the Wan layer, the
ring, then the other kernel shapes) and none starts once `--budget` seconds
(from the start of the script) are spent, so the run fits a short accelerator
lease. The report is written to `--json` (default `accelerator_check.json`):
platform, device kind and count, JAX version, every row, every check. The last
lines say `PASS <check>`, `FAIL <check>: reason` or `SKIP <check>: reason` (not
run within the budget; the speed targets under `--smoke`); the exit status is 1
if any check failed. The speed targets: `"auto"` within 5% of the fastest
implementation on every row, and at S >= 16k at least half the matmul rate.
"""

import argparse
import dataclasses
import json
import math
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from _harness import best_time, write_json  # also puts this checkout first on sys.path
from vidax_eqx import kernels, nn, parallel


F32, BF16 = jnp.float32, jnp.bfloat16
OUT_TOL, GRAD_TOL = 2e-2, 5e-2  # bf16 against the float32 reference, relative to max |reference|
VENDOR = ("cudnn", "pallas_gpu", "pallas_tpu")


class Budget:
    """Seconds left of `--budget`, counted from the start of the script."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def spent(self) -> bool:
        return self.elapsed() > self.seconds


def _log(row: dict):
    print(json.dumps(row), file=sys.stderr, flush=True)


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def _time(fn, *args, reps: int) -> float:
    """Best wall seconds of `reps` runs after one that compiles and warms up."""
    return best_time(lambda: jax.block_until_ready(fn(*args)), reps).best


def _rel_error(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _matmul_tflops(smoke: bool) -> float:
    n = 1024 if smoke else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), BF16)
    b = jax.random.normal(jax.random.key(1), (n, n), BF16)
    f = jax.jit(lambda a, b: a @ b)
    return 2.0 * n**3 / _time(f, a, b, reps=5) / 1e12


# ---------------------------------------------------------------------- kernels


@dataclasses.dataclass(frozen=True)
class Shape:
    S: int
    H: int
    D: int
    causal: bool

    def __str__(self):
        return f"S={self.S} H={self.H} D={self.D} {'causal' if self.causal else 'full'}"

    def flops(self, backward: bool) -> float:
        f = 4.0 * self.S * self.S * self.H * self.D * (0.5 if self.causal else 1.0)
        return f * (3.5 if backward else 1.0)


def _shapes(smoke: bool) -> list[Shape]:
    if smoke:
        return [Shape(256, 4, 64, c) for c in (False, True)]
    rows = []
    for S in (8192, 16384, 32768, 65536):  # Wan 2.1 14B heads first
        for causal in (False, True):
            rows.append(Shape(S, 40, 128, causal))
    for S in (16384, 65536):  # CogVideoX-like heads
        rows.append(Shape(S, 16, 64, False))
    return rows


def _implementations(platform: str, smoke: bool) -> dict[str, object]:
    impls = {"auto": "auto"}
    if platform == "gpu":
        impls.update(cudnn="cudnn", pallas_gpu="pallas_gpu")
    elif platform == "tpu":
        impls.update(pallas_tpu="pallas_tpu")
    elif smoke:  # CPU: the Pallas kernels in interpret mode
        impls.update(pallas_tpu=kernels.PallasTpu(interpret=True, block_q=128, block_kv=128),
                     pallas_gpu=kernels.PallasGpu(interpret=True))
    impls.update(blockwise="blockwise", xla="xla")
    return impls


def _inputs(shape: Shape):
    ks = jax.random.split(jax.random.key(shape.S + shape.H), 4)
    mk = lambda key: jax.random.normal(key, (1, shape.S, shape.H, shape.D), BF16)
    return mk(ks[0]), mk(ks[1]), mk(ks[2]), mk(ks[3])


def _fits_xla(shape: Shape, smoke: bool) -> bool:
    # The float32 score matrix and its softmax, and their gradients, must fit.
    return smoke or 4 * shape.H * shape.S * shape.S <= 12 * 2**30


def _reference_rows(shape: Shape, q, k, v, rows: int):
    """float32 "xla" output for the last `rows` queries (those that see the most keys)."""
    start = shape.S - rows
    pos = jnp.arange(shape.S, dtype=jnp.int32)
    f = jax.jit(lambda q, k, v: kernels.attention(
        q[:, start:].astype(F32), k.astype(F32), v.astype(F32),
        q_positions=pos[start:], kv_positions=pos, causal=shape.causal, implementation="xla"))
    return f(q, k, v), start


def _kernel_rows(shape: Shape, impls: dict, smoke: bool, matmul: float, reps: int,
                 budget: Budget) -> list[dict]:
    q, k, v, dout = _inputs(shape)
    rows = min(256, shape.S)
    ref_rows, start = _reference_rows(shape, q, k, v, rows)
    grad_ref = None
    if shape.S == min(s.S for s in _shapes(smoke)) and _fits_xla(shape, smoke):
        grad_ref = jax.jit(jax.grad(
            lambda q, k, v: jnp.sum(kernels.attention(q, k, v, causal=shape.causal, implementation="xla")
                                    * dout.astype(F32)), (0, 1, 2)))(q.astype(F32), k.astype(F32), v.astype(F32))
    results = []
    for name, impl in impls.items():
        if name == "xla" and not _fits_xla(shape, smoke):
            continue
        if budget.spent():
            print(f"(budget of {budget.seconds:.0f} s spent: stopping before {name} at {shape})", flush=True)
            break
        row = dict(part="kernels", shape=str(shape), impl=name)
        try:
            row["runs"] = kernels.select_implementation(q, k, v, causal=shape.causal, implementation=impl)
            fwd = jax.jit(lambda q, k, v: kernels.attention(q, k, v, causal=shape.causal, implementation=impl))
            loss = lambda q, k, v: jnp.sum(
                kernels.attention(q, k, v, causal=shape.causal, implementation=impl).astype(F32)
                * dout.astype(F32))
            fwd_bwd = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
            out = fwd(q, k, v)
            row["out_err"] = _rel_error(out[:, start:], ref_rows)
            if grad_ref is not None:
                grads = fwd_bwd(q, k, v)[1]
                row["grad_err"] = max(_rel_error(g, r) for g, r in zip(grads, grad_ref))
            row["fwd_s"] = _time(fwd, q, k, v, reps=reps)
            row["fwd_bwd_s"] = _time(fwd_bwd, q, k, v, reps=reps)
            for key, backward in (("fwd", False), ("fwd_bwd", True)):
                tflops = shape.flops(backward) / row[f"{key}_s"] / 1e12
                row[f"{key}_tflops"] = tflops
                row[f"{key}_of_matmul"] = tflops / matmul
        except NotImplementedError as e:  # a documented refusal: recorded, not a failure
            row["refused"] = _error(e)
        except Exception as e:
            row["error"] = _error(e)
        results.append(row)
        _log(row)
    for key in ("fwd_s", "fwd_bwd_s"):
        vendor = [r[key] for r in results if r["impl"] in VENDOR and key in r]
        fastest_any = min((r[key] for r in results if key in r), default=None)
        for r in results:
            if key in r:
                r[f"{key}_vs_vendor"] = r[key] / min(vendor) if vendor else None
                r[f"{key}_vs_fastest"] = r[key] / fastest_any
    return results


def _fmt(x, f=".2f"):
    return "–" if x is None else format(x, f)


def _kernel_table(results: list[dict]) -> str:
    head = ("| shape | impl | runs | out err | grad err | fwd TFLOP/s | fwd / best vendor | fwd of matmul "
            "| fwd+bwd TFLOP/s | fwd+bwd / best vendor | fwd+bwd of matmul |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        if "fwd_s" not in r:
            lines.append(f"| {r['shape']} | {r['impl']} | {r.get('error') or r.get('refused') or 'not timed'} |"
                         + " |" * 8)
            continue
        lines.append(
            f"| {r['shape']} | {r['impl']} | {r['runs']} | {_fmt(r.get('out_err'), '.1e')} "
            f"| {_fmt(r.get('grad_err'), '.1e')} | {r['fwd_tflops']:.3g} | {_fmt(r.get('fwd_s_vs_vendor'))} "
            f"| {r['fwd_of_matmul']:.0%} | {r['fwd_bwd_tflops']:.3g} | {_fmt(r.get('fwd_bwd_s_vs_vendor'))} "
            f"| {r['fwd_bwd_of_matmul']:.0%} |"
        )
    return "\n".join(lines)


# -------------------------------------------------------------------- Wan layer


WAN_DIM, WAN_HEADS = 1536, 12  # Wan 2.1 1.3B: 12 heads of 128


def _wan_grids(smoke: bool) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """`(timed grid, checked grid)` of (frames, height, width) tokens."""
    if smoke:
        return (2, 6, 8), (2, 6, 8)
    return (21, 30, 52), (3, 30, 52)  # 81 frames at 480 x 832, patch (1, 2, 2); 9 frames


def _wan_layer(implementation: str, dtype):
    """Wan 2.1 1.3B's self-attention; the same weights for every implementation and dtype."""
    layer = nn.Attention(WAN_DIM, WAN_HEADS, qk_norm="rms", eps=1e-6, implementation=implementation,
                         key=jax.random.key(42))
    return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, layer)


def _wan_functions(layer):
    """Jitted `fwd(params, x, rope)` and `fwd_bwd(params, x, rope, dout)` (-> grads of params and x)."""
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    apply = lambda params, x, rope: eqx.combine(params, static)(x, rope=rope)
    loss = lambda params, x, rope, dout: jnp.sum(apply(params, x, rope).astype(F32) * dout.astype(F32))
    return params, jax.jit(apply), jax.jit(jax.grad(loss, (0, 1)))


def _wan_inputs(grid, dtype):
    S = math.prod(grid)
    kx, kd = jax.random.split(jax.random.key(S))
    x = jax.random.normal(kx, (S, WAN_DIM), F32).astype(dtype)
    dout = jax.random.normal(kd, (S, WAN_DIM), F32).astype(dtype)
    return x, nn.functional.rope_3d(grid, WAN_DIM // WAN_HEADS), dout


def _wan_flops(S: int, backward: bool) -> float:
    proj = 4 * 2.0 * S * WAN_DIM * WAN_DIM  # q, k, v, o
    attn = 4.0 * S * S * WAN_DIM  # H * D = dim
    return 3 * proj + 3.5 * attn if backward else proj + attn


def _wan_rows(smoke: bool, matmul: float, reps: int, budget: Budget) -> list[dict]:
    timed_grid, check_grid = _wan_grids(smoke)
    results = []
    # Accuracy: bf16 "auto" against the float32 "xla" layer, at the checked length.
    row = dict(part="wan_layer", what="check", grid=list(check_grid), S=math.prod(check_grid))
    try:
        x, rope, dout = _wan_inputs(check_grid, F32)
        ref_params, ref_fwd, ref_grad = _wan_functions(_wan_layer("xla", F32))
        ref_out = ref_fwd(ref_params, x, rope)
        ref_grads = ref_grad(ref_params, x, rope, dout)
        params, fwd, grad = _wan_functions(_wan_layer("auto", BF16))
        xb, doutb = x.astype(BF16), dout.astype(BF16)
        row["out_err"] = _rel_error(fwd(params, xb, rope), ref_out)
        grads = grad(params, xb, rope, doutb)
        errs = [_rel_error(g, r) for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))]
        row["grad_err"] = max(errs)
        row["grad_x_err"] = errs[-1]
    except Exception as e:
        row["error"] = _error(e)
    results.append(row)
    _log(row)
    if budget.spent():
        print("(budget spent: the Wan layer is not timed)", flush=True)
        return results
    # Speed: bf16 "auto" at the timed length; the output must be finite.
    S = math.prod(timed_grid)
    head_dim = WAN_DIM // WAN_HEADS
    row = dict(part="wan_layer", what="timed", grid=list(timed_grid), S=S)
    try:
        like = jax.ShapeDtypeStruct((1, S, WAN_HEADS, head_dim), BF16)
        row["runs"] = kernels.select_implementation(like, like, like)
        x, rope, dout = _wan_inputs(timed_grid, BF16)
        params, fwd, grad = _wan_functions(_wan_layer("auto", BF16))
        out = fwd(params, x, rope)
        grads = grad(params, x, rope, dout)
        row["finite"] = bool(jnp.isfinite(out.astype(F32)).all()) and all(
            bool(jnp.isfinite(g.astype(F32)).all()) for g in jax.tree.leaves(grads))
        row["fwd_s"] = _time(fwd, params, x, rope, reps=reps)
        row["fwd_bwd_s"] = _time(grad, params, x, rope, dout, reps=reps)
        for key, backward in (("fwd", False), ("fwd_bwd", True)):
            tflops = _wan_flops(S, backward) / row[f"{key}_s"] / 1e12
            row[f"{key}_tflops"] = tflops
            row[f"{key}_of_matmul"] = tflops / matmul
    except Exception as e:
        row["error"] = _error(e)
    results.append(row)
    _log(row)
    return results


# ------------------------------------------------------------------------- ring


def _ring_shape(smoke: bool, n: int) -> Shape:
    """Global length a multiple of the ring size; the float32 reference fits anywhere."""
    S, H, D = (32 * max(n, 8), 4, 64) if smoke else (8192, 8, 128)
    return Shape(S - S % n, H, D, False)


def _ring_rows(smoke: bool, reps: int, budget: Budget) -> list[dict]:
    n = jax.device_count()
    mesh = parallel.make_mesh(sp=n)
    seq = NamedSharding(mesh, P(None, "sp"))
    results = []
    for causal in (False, True):
        if budget.spent():
            print(f"(budget spent: stopping before the {'causal' if causal else 'full'} ring)", flush=True)
            break
        shape = dataclasses.replace(_ring_shape(smoke, n), causal=causal)
        row = dict(part="ring", shape=str(shape), devices=n)
        try:
            q, k, v, dout = _inputs(shape)

            def attend(q, k, v):
                return parallel.ring_attention(q, k, v, ring_axis="sp", causal=causal, implementation="auto")

            ring = jax.shard_map(attend, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
            fwd = jax.jit(ring)
            fwd_bwd = jax.jit(lambda q, k, v, dout: jax.vjp(ring, q, k, v)[1](dout))
            sharded = [jax.device_put(a, seq) for a in (q, k, v, dout)]
            out = fwd(*sharded[:3])
            grads = fwd_bwd(*sharded)
            reference = lambda q, k, v: kernels.attention(q, k, v, causal=causal, implementation="xla")
            f32 = [a.astype(F32) for a in (q, k, v, dout)]
            ref_out, vjp = jax.vjp(reference, *f32[:3])
            ref_grads = vjp(f32[3])
            row["out_err"] = _rel_error(out, ref_out)
            row["grad_err"] = max(_rel_error(g, r) for g, r in zip(grads, ref_grads))
            row["fwd_s"] = _time(fwd, *sharded[:3], reps=reps)
            row["fwd_bwd_s"] = _time(fwd_bwd, *sharded, reps=reps)
        except Exception as e:
            row["error"] = _error(e)
        results.append(row)
        _log(row)
    return results


# ----------------------------------------------------------------------- checks


def _check(name: str, status: str, detail: str = "") -> dict:
    return dict(check=name, status=status, detail=detail)


def _accuracy(rows: list[dict]) -> tuple[str, str]:
    bad = [r for r in rows if r.get("out_err", 0) > OUT_TOL or r.get("grad_err", 0) > GRAD_TOL]
    errors = [r for r in rows if "error" in r]
    if errors:
        return "FAIL", "; ".join(f"{r.get('impl', r.get('what', ''))} {r.get('shape', r.get('S', ''))}: "
                                 f"{r['error']}" for r in errors)
    if bad:
        return "FAIL", ", ".join(f"{r.get('impl', r.get('what', ''))} {r.get('shape', r.get('S', ''))} "
                                 f"(out {_fmt(r.get('out_err'), '.1e')}, grads {_fmt(r.get('grad_err'), '.1e')})"
                                 for r in bad)
    worst_out = max((r["out_err"] for r in rows if "out_err" in r), default=None)
    worst_grad = max((r["grad_err"] for r in rows if "grad_err" in r), default=None)
    return "PASS", f"worst out {_fmt(worst_out, '.1e')}, grads {_fmt(worst_grad, '.1e')}"


def _checks(kernel_rows, wan_rows, ring_rows, smoke: bool, budget: Budget) -> list[dict]:
    checks = []
    not_run = f"not run within the budget of {budget.seconds:.0f} s"
    tolerances = f"bf16 vs float32: out <= {OUT_TOL:g}, grads <= {GRAD_TOL:g}"
    if any("out_err" in r or "error" in r for r in kernel_rows):
        status, detail = _accuracy(kernel_rows)
        checks.append(_check("kernel accuracy", status, f"{tolerances}; {detail}"))
    else:
        checks.append(_check("kernel accuracy", "SKIP", not_run))
    speed_skip = "speed targets apply to the realistic shapes (not --smoke)" if smoke else not_run
    for key in ("fwd_s", "fwd_bwd_s"):
        autos = [r for r in kernel_rows if r["impl"] == "auto" and key in r]
        worst = max((r[f"{key}_vs_fastest"] for r in autos), default=None)
        name = f"auto within 5% of the fastest ({key[:-2]})"
        if smoke or worst is None:
            checks.append(_check(name, "SKIP", speed_skip))
        else:
            checks.append(_check(name, "PASS" if worst <= 1.05 else "FAIL", f"worst ratio {worst:.2f}"))
    long_rows = [r for r in kernel_rows if r["impl"] == "auto" and "fwd_tflops" in r
                 and int(r["shape"].split()[0][2:]) >= 16384]
    for key in ("fwd", "fwd_bwd"):
        worst = min((r[f"{key}_of_matmul"] for r in long_rows), default=None)
        name = f"auto at S >= 16k >= half the bf16 matmul rate ({key})"
        if smoke or worst is None:
            checks.append(_check(name, "SKIP", speed_skip))
        else:
            checks.append(_check(name, "PASS" if worst >= 0.5 else "FAIL", f"worst {worst:.0%}"))
    failed = [r for r in kernel_rows if "error" in r]
    checks.append(_check(
        "kernel rows ran",
        "FAIL" if failed else ("PASS" if kernel_rows else "SKIP"),
        "; ".join(f"{r['impl']} {r['shape']}: {r['error']}" for r in failed) if failed
        else f"{len(kernel_rows)} rows, {sum('refused' in r for r in kernel_rows)} refused "
             "(NotImplementedError)" if kernel_rows
        else not_run,
    ))
    check = [r for r in wan_rows if r["what"] == "check"]
    if check:
        status, detail = _accuracy(check)
        checks.append(_check("Wan layer accuracy", status,
                             f"S={check[0]['S']}, auto vs the float32 xla layer, {tolerances}; {detail}"))
    else:
        checks.append(_check("Wan layer accuracy", "SKIP", not_run))
    timed = [r for r in wan_rows if r["what"] == "timed"]
    if timed:
        r = timed[0]
        ok = "error" not in r and r.get("finite")
        detail = r.get("error") or (f"S={r['S']}, runs {r['runs']}, fwd {r['fwd_s'] * 1e3:.1f} ms, "
                                    f"fwd+bwd {r['fwd_bwd_s'] * 1e3:.1f} ms, finite" if ok
                                    else f"S={r['S']}: non-finite output or gradient")
        checks.append(_check("Wan layer forward+backward", "PASS" if ok else "FAIL", detail))
    else:
        checks.append(_check("Wan layer forward+backward", "SKIP", not_run))
    if ring_rows:
        status, detail = _accuracy(ring_rows)
        n = ring_rows[0]["devices"]
        kinds = ", ".join(r["shape"].split()[-1] for r in ring_rows)
        checks.append(_check("ring attention", status,
                             f"{n} device(s), {kinds}, vs one device, {tolerances}; {detail}"))
    else:
        checks.append(_check("ring attention", "SKIP", not_run))
    return checks


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs anywhere (CPU: interpret mode)")
    parser.add_argument("--budget", "--budget-s", dest="budget", type=float, default=240.0,
                        metavar="SECONDS", help="start no row after this many seconds (default 240)")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per measurement (the best is kept)")
    parser.add_argument("--json", default="accelerator_check.json", metavar="PATH",
                        help="where to write the report (default: accelerator_check.json)")
    args = parser.parse_args()
    budget = Budget(args.budget)
    platform = jax.default_backend()
    device_kind = jax.devices()[0].device_kind
    print(f"jax {jax.__version__} on {platform}: {jax.device_count()} x {device_kind}", flush=True)
    matmul = _matmul_tflops(args.smoke)
    print(f"bf16 matmul: {matmul:.2f} TFLOP/s", flush=True)
    impls = _implementations(platform, args.smoke)

    shapes = _shapes(args.smoke)
    kernel_rows, wan_rows, ring_rows = [], [], []
    steps = [
        lambda: kernel_rows.extend(_kernel_rows(shapes[0], impls, args.smoke, matmul, args.reps, budget)),
        lambda: wan_rows.extend(_wan_rows(args.smoke, matmul, args.reps, budget)),
        lambda: ring_rows.extend(_ring_rows(args.smoke, args.reps, budget)),
    ] + [
        (lambda s: lambda: kernel_rows.extend(_kernel_rows(s, impls, args.smoke, matmul, args.reps, budget)))(s)
        for s in shapes[1:]
    ]
    for step in steps:
        if budget.spent():
            print(f"(budget of {budget.seconds:.0f} s spent: stopping)", flush=True)
            break
        step()

    print(_kernel_table(kernel_rows))
    for r in wan_rows + ring_rows:
        print(json.dumps(r))
    checks = _checks(kernel_rows, wan_rows, ring_rows, args.smoke, budget)
    report = dict(
        platform=platform, device_kind=device_kind, device_count=jax.device_count(),
        jax_version=jax.__version__, jaxlib_version=jaxlib.__version__, smoke=args.smoke,
        budget_s=args.budget, elapsed_s=budget.elapsed(),
        matmul_tflops=matmul, rows=kernel_rows + wan_rows + ring_rows, checks=checks,
    )
    write_json(args.json, report)
    print(f"total {budget.elapsed():.0f} s; report in {args.json}")
    for c in checks:  # PASS <check> (detail) / FAIL <check>: reason / SKIP <check>: reason
        detail = c["detail"] and (f" ({c['detail']})" if c["status"] == "PASS" else f": {c['detail']}")
        print(f"{c['status']} {c['check']}{detail}")
    sys.exit(1 if any(c["status"] == "FAIL" for c in checks) else 0)


if __name__ == "__main__":
    main()
