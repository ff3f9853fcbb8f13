"""One-command accuracy and speed check of every attention implementation on a GPU or TPU.

    python benchmarks/accelerator_check.py            # the realistic shapes, < 5 minutes
    python benchmarks/accelerator_check.py --smoke    # tiny shapes (any platform, also CPU)

For each shape (B=1, H in {16, 40}, D in {64, 128}, S from 8k to 64k, non-causal
and causal) and each implementation available on this platform (`"auto"`, the
vendor kernels, `"blockwise"`, and `"xla"` while its score matrix fits), in
bfloat16:

- **accuracy**: the output on a slice of query rows (and, at the smallest S, the
  gradients of q, k, v) against the float32 `"xla"` reference on the same rows,
  as max |error| / max |reference|;
- **speed**: forward and forward+backward wall time (best of a few runs),
  achieved TFLOP/s (4·S_q·S_k·H·D per forward, halved when causal; the backward
  counted as 2.5 forwards), the time as a ratio to the fastest vendor kernel of
  the row, and the rate as a fraction of a large bfloat16 matmul measured in
  the same run.

The last lines check the targets: `"auto"` within 5% of the fastest
implementation on every row, and at S >= 16k at least half the matmul rate. The
run stops adding rows when `--budget-s` (default 270 s) is spent, so it fits a
five-minute slot; rows are ordered so the most informative come first.
"""

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from vidax_eqx import kernels


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


VENDOR = ("cudnn", "pallas_gpu", "pallas_tpu")


def _time(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def _matmul_tflops(smoke: bool) -> float:
    n = 1024 if smoke else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    return 2.0 * n**3 / _time(f, a, b, reps=5) / 1e12


def _inputs(shape: Shape):
    ks = jax.random.split(jax.random.key(shape.S + shape.H), 4)
    mk = lambda key: jax.random.normal(key, (1, shape.S, shape.H, shape.D), jnp.bfloat16)
    return mk(ks[0]), mk(ks[1]), mk(ks[2]), mk(ks[3])


def _fits_xla(shape: Shape, smoke: bool) -> bool:
    # The float32 score matrix and its softmax, and their gradients, must fit.
    return smoke or 4 * shape.H * shape.S * shape.S <= 12 * 2**30


def _rel_error(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _reference_rows(shape: Shape, q, k, v, rows: int):
    """float32 "xla" output for the last `rows` queries (those that see the most keys)."""
    start = shape.S - rows
    pos = jnp.arange(shape.S, dtype=jnp.int32)
    f = jax.jit(lambda q, k, v: kernels.attention(
        q[:, start:].astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
        q_positions=pos[start:], kv_positions=pos, causal=shape.causal, implementation="xla"))
    return f(q, k, v), start


def _check_shape(shape: Shape, impls: dict, smoke: bool, matmul: float, reps: int) -> list[dict]:
    q, k, v, dout = _inputs(shape)
    rows = min(256, shape.S)
    ref_rows, start = _reference_rows(shape, q, k, v, rows)
    grad_ref = None
    if shape.S == min(s.S for s in _shapes(smoke)) and _fits_xla(shape, smoke):
        f32 = lambda x: x.astype(jnp.float32)
        grad_ref = jax.jit(jax.grad(
            lambda q, k, v: jnp.sum(kernels.attention(q, k, v, causal=shape.causal, implementation="xla")
                                    * f32(dout)), (0, 1, 2)))(f32(q), f32(k), f32(v))
    results = []
    for name, impl in impls.items():
        if name == "xla" and not _fits_xla(shape, smoke):
            continue
        row = dict(shape=str(shape), impl=name)
        try:
            chosen = kernels.select_implementation(q, k, v, causal=shape.causal, implementation=impl)
            row["runs"] = chosen
            fwd = jax.jit(lambda q, k, v: kernels.attention(q, k, v, causal=shape.causal, implementation=impl))
            loss = lambda q, k, v: jnp.sum(
                kernels.attention(q, k, v, causal=shape.causal, implementation=impl).astype(jnp.float32)
                * dout.astype(jnp.float32))
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
        except Exception as e:  # an implementation that cannot serve the shape here
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    for key in ("fwd_s", "fwd_bwd_s"):
        vendor = [r[key] for r in results if r["impl"] in VENDOR and key in r]
        fastest_any = min((r[key] for r in results if key in r), default=None)
        for r in results:
            if key in r:
                r[f"{key}_vs_vendor"] = r[key] / min(vendor) if vendor else None
                r[f"{key}_vs_fastest"] = r[key] / fastest_any
    return results


def _table(results: list[dict]) -> str:
    head = ("| shape | impl | runs | out err | grad err | fwd TFLOP/s | fwd / best vendor | fwd of matmul "
            "| fwd+bwd TFLOP/s | fwd+bwd / best vendor | fwd+bwd of matmul |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    fmt = lambda x, f: "–" if x is None else format(x, f)
    for r in results:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['impl']} | {r['error']} |" + " |" * 8)
            continue
        lines.append(
            f"| {r['shape']} | {r['impl']} | {r['runs']} | {fmt(r.get('out_err'), '.1e')} "
            f"| {fmt(r.get('grad_err'), '.1e')} | {r["fwd_tflops"]:.3g} | {fmt(r.get('fwd_s_vs_vendor'), '.2f')} "
            f"| {r['fwd_of_matmul']:.0%} | {r["fwd_bwd_tflops"]:.3g} | {fmt(r.get('fwd_bwd_s_vs_vendor'), '.2f')} "
            f"| {r['fwd_bwd_of_matmul']:.0%} |"
        )
    return "\n".join(lines)


def _verdict(results: list[dict], smoke: bool) -> list[str]:
    lines = []
    for key in ("fwd_s", "fwd_bwd_s"):
        autos = [r for r in results if r["impl"] == "auto" and key in r]
        worst = max((r[f"{key}_vs_fastest"] for r in autos), default=None)
        ok = worst is not None and worst <= 1.05
        lines.append(f"auto within 5% of the fastest ({key[:-2]}): {'PASS' if ok else 'FAIL'} "
                     f"(worst ratio {fmt_ratio(worst)})")
    long_rows = [r for r in results if r["impl"] == "auto" and "fwd_tflops" in r
                 and int(r["shape"].split()[0][2:]) >= (0 if smoke else 16384)]
    for key in ("fwd", "fwd_bwd"):
        worst = min((r[f"{key}_of_matmul"] for r in long_rows), default=None)
        ok = worst is not None and worst >= 0.5
        lines.append(f"auto at S >= 16k >= half the bf16 matmul rate ({key}): {'PASS' if ok else 'FAIL'} "
                     f"(worst {fmt_ratio(worst, '.0%')})")
    bad = [r for r in results if r.get("out_err", 0) > 2e-2 or r.get("grad_err", 0) > 5e-2]
    lines.append(f"accuracy (bf16 vs float32 reference: out <= 2e-2, grads <= 5e-2): "
                 f"{'PASS' if not bad else 'FAIL: ' + ', '.join(r['impl'] + ' ' + r['shape'] for r in bad)}")
    return lines


def fmt_ratio(x, f=".2f"):
    return "–" if x is None else format(x, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs anywhere (CPU: interpret mode)")
    parser.add_argument("--budget-s", type=float, default=270.0, help="stop adding rows after this long")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    t0 = time.perf_counter()
    platform = jax.default_backend()
    print(f"jax {jax.__version__} on {platform}: {jax.devices()[0].device_kind}", flush=True)
    matmul = _matmul_tflops(args.smoke)
    print(f"bf16 matmul: {matmul:.1f} TFLOP/s", flush=True)
    impls = _implementations(platform, args.smoke)
    results = []
    for shape in _shapes(args.smoke):
        if time.perf_counter() - t0 > args.budget_s:
            print(f"(budget of {args.budget_s:.0f} s spent: stopping before {shape})", flush=True)
            break
        results += _check_shape(shape, impls, args.smoke, matmul, args.reps)
    print(_table(results))
    for line in _verdict(results, args.smoke):
        print(line)
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(platform=platform, matmul_tflops=matmul, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
