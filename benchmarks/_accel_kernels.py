"""The kernel part of `accelerator_check.py`: every attention path this platform serves,
at Wan's shapes, against a float32 reference (forward and gradients, bf16, with each
feature), and timed against the baselines a user would pick, as ratios and as a fraction
of a bf16 matmul measured in the same run: on a GPU `jax.nn.dot_product_attention` (its
cuDNN path) and PyTorch's `scaled_dot_product_attention` with the flash and cuDNN
backends; on a TPU JAX's splash kernel called directly, at its default tiles and at the
best configuration measured on the chip (the tuning table's row for the problem). A path
whose float32 scores do not fit the device (`"xla"` at Wan's lengths) is recorded as
such, not run."""

import dataclasses
import math

import jax
import jax.numpy as jnp

from _accel_common import (
    accuracy_status, BF16, custom_calls, error, F32, fmt, log, lowered, rel_error, Run, seconds,
)
from _splash import attend as splash_attend, block_sizes_of, compile_with
from vidax_eqx import kernels


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention problem: `B=1`, `S` tokens (a video grid `(F, H, W)` of patches),
    `H` heads of `D`."""

    name: str
    grid: tuple[int, int, int]
    H: int
    D: int = 128

    @property
    def S(self) -> int:
        return math.prod(self.grid)

    def __str__(self):
        return f"{self.name} S={self.S} H={self.H} D={self.D}"

    def flops(self, backward: bool, density: float = 1.0) -> float:
        f = 4.0 * self.S * self.S * self.H * self.D * density
        return f * (3.5 if backward else 1.0)


def shapes(run: Run) -> tuple[list[Shape], Shape]:
    """`(timed shapes, the gradient-check shape)`: Wan 2.1 1.3B and 14B heads at 480p
    (81 frames at 480 x 832: a 21 x 30 x 52 patch grid, 32,760 tokens), gradients at 9
    frames (4,680 tokens) where the float32 reference and its gradient fit."""
    if run.smoke:
        return [Shape("smoke", (2, 4, 8), 4, 64)], Shape("smoke", (2, 4, 8), 4, 64)
    return ([Shape("wan1.3b-480p", (21, 30, 52), 12), Shape("wan14b-480p", (21, 30, 52), 40)],
            Shape("wan1.3b-9f", (3, 30, 52), 12))


def _tile(shape: Shape) -> tuple[int, int, int]:
    """Sliding tile attention's tile: whole tiles over the grid."""
    return (1, 2, 4) if shape.name == "smoke" else (3, 6, 4)


FEATURES = ("full", "causal", "window", "kv_lengths", "sinks", "sliding_tile")


def feature_options(feature: str, shape: Shape) -> dict:
    """The keyword options of `kernels.attention` for `feature` at `shape`."""
    S = shape.S
    if feature == "full":
        return {}
    if feature == "causal":
        return dict(causal=True)
    if feature == "window":
        return dict(window=(S // 8, S // 8))
    if feature == "kv_lengths":
        return dict(kv_lengths=jnp.asarray([S - S // 10], jnp.int32))
    if feature == "sinks":
        return dict(sinks=jax.random.normal(jax.random.key(7), (shape.H,), F32))
    if feature == "sliding_tile":
        return dict(mask=kernels.SlidingTileMask(shape.grid, _tile(shape), (3, 3, 3)))
    raise ValueError(feature)


def implementations(run: Run) -> dict[str, object]:
    """The paths to check on `run.platform`: `"auto"`, the vendor kernels, the portable
    ones (CPU: the Pallas kernels in interpret mode)."""
    impls = {"auto": "auto"}
    if run.platform in ("gpu", "cuda", "rocm"):
        impls.update(cudnn="cudnn", pallas_gpu="pallas_gpu")
    elif run.platform == "tpu":
        impls.update(pallas_tpu="pallas_tpu")
    elif run.smoke:
        impls.update(pallas_tpu=kernels.PallasTpu(interpret=True, block_q=128, block_kv=128),
                     pallas_gpu=kernels.PallasGpu(interpret=True))
    impls.update(blockwise="blockwise", xla="xla")
    return impls


XLA_MAX_SCORE_BYTES = 12 * 2**30  # of a 16 GB accelerator, beside the inputs


def _xla_fits(shape: Shape, run: Run, backward: bool) -> bool:
    """Whether the float32 score matrix (and for the backward its gradient) fits."""
    return run.smoke or shape.H * shape.S * shape.S * 4 * (3 if backward else 1) <= XLA_MAX_SCORE_BYTES


def _too_big(name: str, shape: Shape, run: Run, backward: bool) -> str | None:
    """Why `name` is not run at `shape` (its scores do not fit), or `None`."""
    if name != "xla" or _xla_fits(shape, run, backward):
        return None
    gb = shape.H * shape.S * shape.S * 4 * (3 if backward else 1) / 2**30
    return f"not run: its float32 scores ({gb:.0f} GiB) do not fit the device"


def inputs(shape: Shape, run: Run, dtype=BF16):
    """`(q, k, v, dout)`, random; abstract (`ShapeDtypeStruct`s) when only lowering."""
    if run.lower_only:
        return (jax.ShapeDtypeStruct((1, shape.S, shape.H, shape.D), dtype),) * 4
    ks = jax.random.split(jax.random.key(shape.S + shape.H), 4)
    mk = lambda key: jax.random.normal(key, (1, shape.S, shape.H, shape.D), F32).astype(dtype)  # noqa: E731
    return tuple(mk(k) for k in ks)


def _attend(impl, options):
    return lambda q, k, v: kernels.attention(q, k, v, implementation=impl, **options)


def _loss(impl, options):
    attend = _attend(impl, options)
    return lambda q, k, v, dout: jnp.sum(attend(q, k, v).astype(F32) * dout.astype(F32))


# -- accuracy ------------------------------------------------------------------------------


def accuracy_rows(run: Run, shape: Shape, grad_shape: Shape, feature: str) -> list[dict]:
    """Every implementation on `feature`: the output of the last query rows at `shape`
    against the float32 `"xla"` reference of those rows, and the gradients of q, k, v at
    `grad_shape` against the float32 reference's."""
    impls = implementations(run)
    options = feature_options(feature, shape)
    q, k, v, dout = inputs(shape, run)
    rows_n = min(256, shape.S)
    start = shape.S - rows_n
    pos = jnp.arange(shape.S, dtype=jnp.int32)
    ref_rows = None
    gq, gk, gv, gdout = inputs(grad_shape, run)
    g_options = feature_options(feature, grad_shape)
    ref_grads = None
    results = []
    for name, impl in impls.items():
        if run.spent():
            break
        row = dict(part="kernels", what="accuracy", impl=name, feature=feature, shape=str(shape))
        too_big = None if run.lower_only else _too_big(name, shape, run, False)
        if too_big:
            row["skipped"] = too_big
            results.append(row)
            log(row)
            continue
        try:
            row["runs"] = kernels.select_implementation(q, k, v, implementation=impl,
                                                      platform=run.platform, **options)
            if run.lower_only:
                text = lowered(_attend(impl, options), (q, k, v), run.platform)
                row.update(lowered=True, kernels=custom_calls(text))
                text = lowered(jax.grad(_loss(impl, options), (0, 1, 2)), (q, k, v, dout),
                               run.platform)
                row.update(lowered_bwd=True, kernels_bwd=custom_calls(text))
            else:
                if ref_rows is None:
                    ref_rows = jax.jit(lambda q, k, v: kernels.attention(
                        q[:, start:].astype(F32), k.astype(F32), v.astype(F32),
                        q_positions=pos[start:], kv_positions=pos, implementation="xla",
                        **options))(q, k, v)
                out = jax.jit(_attend(impl, options))(q, k, v)
                row["out_err"] = rel_error(out[:, start:], ref_rows)
                if _xla_fits(grad_shape, run, True):
                    if ref_grads is None:
                        ref_grads = jax.jit(jax.grad(_loss("xla", g_options), (0, 1, 2)))(
                            *(a.astype(F32) for a in (gq, gk, gv, gdout)))
                    grads = jax.jit(jax.grad(_loss(impl, g_options), (0, 1, 2)))(gq, gk, gv, gdout)
                    row["grad_err"] = max(rel_error(g, r) for g, r in zip(grads, ref_grads))
        except NotImplementedError as e:  # a documented refusal: recorded, not a failure
            row["refused"] = error(e)
        except Exception as e:
            row["error"] = error(e)
        results.append(row)
        log(row)
    return results


def vsa_rows(run: Run, shape: Shape, grad_shape: Shape) -> list[dict]:
    """Video sparse attention (`kernels.video_sparse_attention`, sparsity 0.9, FastVideo's
    4 x 4 x 4 tiles) on the paths that serve it: accuracy (output and gradients) at
    `grad_shape`'s grid against the float32 `"xla"` reference, and timed at `shape`'s
    against full attention of the same tokens."""
    tile, sparsity = ((1, 2, 2), 0.5) if run.smoke else ((4, 4, 4), 0.9)
    results = []
    impls = {n: i for n, i in implementations(run).items() if n != "xla"}

    def vsa(grid, impl):
        return lambda q, k, v: kernels.video_sparse_attention(
            q, k, v, grid, tile=tile, sparsity=sparsity, implementation=impl)

    def laid_out(s: Shape) -> Shape:
        padded = tuple(-(-g // t) * t for g, t in zip(s.grid, tile))
        return dataclasses.replace(s, grid=padded, name=s.name + "-tiles")

    small, big = laid_out(grad_shape), laid_out(shape)
    gq, gk, gv, gdout = inputs(small, run)
    ref = None
    for name, impl in impls.items():
        if run.spent():
            break
        row = dict(part="kernels", what="vsa", impl=name, feature="video_sparse", shape=str(big))
        try:
            if run.lower_only:
                text = lowered(vsa(shape.grid, impl), inputs(big, run)[:3], run.platform)
                row.update(lowered=True, kernels=custom_calls(text))
            else:
                loss = lambda impl: lambda q, k, v, d: jnp.sum(  # noqa: E731
                    vsa(grad_shape.grid, impl)(q, k, v).astype(F32) * d.astype(F32))
                if ref is None:
                    f32 = [a.astype(F32) for a in (gq, gk, gv, gdout)]
                    ref = (vsa(grad_shape.grid, "xla")(*f32[:3]),
                           jax.jit(jax.grad(loss("xla"), (0, 1, 2)))(*f32))
                row["out_err"] = rel_error(jax.jit(vsa(grad_shape.grid, impl))(gq, gk, gv), ref[0])
                grads = jax.jit(jax.grad(loss(impl), (0, 1, 2)))(gq, gk, gv, gdout)
                row["grad_err"] = max(rel_error(g, r) for g, r in zip(grads, ref[1]))
                q, k, v, dout = inputs(big, run)
                fwd = jax.jit(vsa(shape.grid, impl))
                full = jax.jit(lambda q, k, v: kernels.attention(q, k, v))
                row["fwd_s"] = seconds(fwd, q, k, v, reps=run.reps)
                row["full_fwd_s"] = seconds(full, q, k, v, reps=run.reps)
                row["vs_full"] = row["fwd_s"] / row["full_fwd_s"]
        except NotImplementedError as e:
            row["refused"] = error(e)
        except Exception as e:
            row["error"] = error(e)
        results.append(row)
        log(row)
    return results


# -- speed -----------------------------------------------------------------------------------


def _torch_sdpa(shape: Shape, causal: bool, backend: str, reps: int) -> dict:
    """PyTorch's `scaled_dot_product_attention` with one backend (`"flash"`, `"cudnn"`),
    same shape, bf16, `(B, H, S, D)`: `{"fwd_s", "fwd_bwd_s"}` or `{"skipped": why}`."""
    try:
        import torch  # noqa: PLC0415
        from torch.nn.attention import sdpa_kernel, SDPBackend  # noqa: PLC0415
    except ImportError as e:
        return dict(skipped=f"no torch: {e}")
    if not torch.cuda.is_available():
        return dict(skipped="torch sees no CUDA device")
    choice = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    gen = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda: torch.randn(1, shape.H, shape.S, shape.D, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                             generator=gen, requires_grad=True)
    q, k, v = mk(), mk(), mk()
    dout = torch.randn_like(q)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def timed(fn):
        with sdpa_kernel([choice]):
            fn()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(max(1, reps)):
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                stop.record()
                torch.cuda.synchronize()
                best = min(best, start.elapsed_time(stop) / 1e3)
        return best

    try:
        with torch.no_grad():
            fwd_s = timed(lambda: sdpa(q, k, v, is_causal=causal))
        fwd_bwd_s = timed(lambda: torch.autograd.grad(sdpa(q, k, v, is_causal=causal), (q, k, v), dout))
        return dict(fwd_s=fwd_s, fwd_bwd_s=fwd_bwd_s, torch=torch.__version__)
    except RuntimeError as e:  # the backend refuses the shape or the device
        return dict(skipped=error(e))


def _splash_direct(shape: Shape, causal: bool, which: str, reps: int) -> dict:
    """JAX's splash kernel called directly on `(B, H, S, D)` at the next multiple of 128
    (splash takes no other length): `"default"` tiles (128), or the `"best"`
    configuration measured on this chip (the tuning table's row that `"pallas_tpu"`
    runs): `{"fwd_s", "fwd_bwd_s", "config"}`."""
    S = -(-shape.S // 128) * 128
    q, k, v, dout = (x.swapaxes(1, 2) for x in inputs(dataclasses.replace(shape, grid=(1, 1, S)),
                                                        Run(mode="run", budget_s=0)))
    if which == "default":
        bs, vmem = None, None
    else:
        blocks = kernels.splash_blocks(q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), causal=causal)
        bs, vmem = block_sizes_of(blocks), blocks.vmem_limit_bytes
    attend = splash_attend(S, shape.H, causal, bs)
    loss = lambda q, k, v, d: jnp.sum(attend(q, k, v).astype(F32) * d.astype(F32))  # noqa: E731
    fwd = compile_with(attend, (q, k, v), vmem)
    grad = compile_with(jax.grad(loss, (0, 1, 2)), (q, k, v, dout), vmem)
    return dict(fwd_s=seconds(fwd, q, k, v, reps=reps), fwd_bwd_s=seconds(grad, q, k, v, dout, reps=reps),
                config="JAX default (128)" if bs is None else str(blocks), S_splash=S)


def speed_rows(run: Run, shape: Shape, causal: bool) -> list[dict]:
    """Forward and forward+backward time of every implementation and baseline at
    `shape`, full or causal, as TFLOP/s, a fraction of the bf16 matmul, and a ratio to
    the fastest baseline (jax.nn's cuDNN path, torch SDPA flash / cuDNN)."""
    feature = "causal" if causal else "full"
    density = 0.5 if causal else 1.0
    q, k, v, dout = inputs(shape, run)
    results = []
    candidates = dict(implementations(run))
    if run.platform in ("gpu", "cuda") and not run.lower_only:
        candidates["jax.nn cudnn"] = "jax.nn"
        candidates["torch flash"] = "torch:flash"
        candidates["torch cudnn"] = "torch:cudnn"
    if run.platform == "tpu" and not run.lower_only:
        candidates["splash default"] = "splash:default"
        candidates["splash best measured"] = "splash:best"
    for name, impl in candidates.items():
        if run.spent():
            break
        if name == "xla" and not _xla_fits(shape, run, True):
            continue
        row = dict(part="kernels", what="speed", impl=name, feature=feature, shape=str(shape))
        try:
            if isinstance(impl, str) and impl.startswith("torch:"):
                row.update(_torch_sdpa(shape, causal, impl.split(":")[1], run.reps))
            elif isinstance(impl, str) and impl.startswith("splash:"):
                row.update(_splash_direct(shape, causal, impl.split(":")[1], run.reps))
            else:
                if impl == "jax.nn":
                    attend = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
                        q, k, v, is_causal=causal, implementation="cudnn")
                else:
                    row["runs"] = kernels.select_implementation(q, k, v, causal=causal,
                                                                implementation=impl,
                                                                platform=run.platform)
                    attend = _attend(impl, dict(causal=causal))
                loss = lambda q, k, v, d: jnp.sum(attend(q, k, v).astype(F32) * d.astype(F32))  # noqa: E731
                if run.lower_only:
                    row["kernels"] = custom_calls(lowered(attend, (q, k, v), run.platform))
                else:
                    row["fwd_s"] = seconds(jax.jit(attend), q, k, v, reps=run.reps)
                    row["fwd_bwd_s"] = seconds(jax.jit(jax.grad(loss, (0, 1, 2))), q, k, v, dout,
                                               reps=run.reps)
            for key, backward in (("fwd", False), ("fwd_bwd", True)):
                if f"{key}_s" in row:
                    tflops = shape.flops(backward, density) / row[f"{key}_s"] / 1e12
                    row[f"{key}_tflops"] = tflops
                    if run.matmul_tflops:
                        row[f"{key}_of_matmul"] = tflops / run.matmul_tflops
        except NotImplementedError as e:
            row["refused"] = error(e)
        except Exception as e:
            row["error"] = error(e)
        results.append(row)
        log(row)
    baselines = [r for r in results if r["impl"] in ("jax.nn cudnn", "torch flash", "torch cudnn",
                                                     "splash default", "splash best measured")]
    for key in ("fwd_s", "fwd_bwd_s"):
        best = min((r[key] for r in baselines if key in r), default=None)
        fastest = min((r[key] for r in results if key in r), default=None)
        for r in results:
            if key in r:
                r[f"{key}_vs_baseline"] = None if best is None else r[key] / best
                r[f"{key}_vs_fastest"] = r[key] / fastest
    return results


def table(rows: list[dict]) -> str:
    """The speed rows as Markdown."""
    head = ("| shape | mask | impl | runs | fwd ms | fwd TFLOP/s | fwd of matmul | fwd / best baseline "
            "| fwd+bwd ms | fwd+bwd TFLOP/s | fwd+bwd / best baseline |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r.get("what") != "speed":
            continue
        why = r.get("error") or r.get("refused") or r.get("skipped")
        if why or "fwd_s" not in r:
            lines.append(f"| {r['shape']} | {r['feature']} | {r['impl']} | {why or 'lowered'} |" + " |" * 7)
            continue
        lines.append(
            f"| {r['shape']} | {r['feature']} | {r['impl']} | {r.get('runs', '')} "
            f"| {r['fwd_s'] * 1e3:.2f} | {r['fwd_tflops']:.3g} | {fmt(r.get('fwd_of_matmul'), '.0%')} "
            f"| {fmt(r.get('fwd_s_vs_baseline'))} | {r['fwd_bwd_s'] * 1e3:.2f} | {r['fwd_bwd_tflops']:.3g} "
            f"| {fmt(r.get('fwd_bwd_s_vs_baseline'))} |")
    return "\n".join(lines)


def checks(run: Run, rows: list[dict]) -> None:
    """The kernel part's PASS / FAIL / SKIP lines."""
    accuracy = [r for r in rows if r.get("what") in ("accuracy", "vsa")]
    if run.lower_only:
        bad = [r for r in accuracy if "error" in r]
        run.check("kernels lower for " + run.platform, "FAIL" if bad else ("PASS" if accuracy else "SKIP"),
                  "; ".join(f"{r['impl']} {r['feature']}: {r['error']}" for r in bad)
                  or f"{len(accuracy)} rows, {sum('refused' in r for r in accuracy)} refused")
    elif accuracy:
        status, detail = accuracy_status(accuracy)
        refused = sum("refused" in r for r in accuracy)
        run.check("kernel accuracy (every path x feature)", status,
                  f"{len(accuracy)} rows, {refused} refused (NotImplementedError); {detail}")
    else:
        run.check("kernel accuracy (every path x feature)", "SKIP", run.not_run())
    speed = [r for r in rows if r.get("what") == "speed"]
    failed = [r for r in speed if "error" in r]
    if failed:
        run.check("kernel speed rows ran", "FAIL",
                  "; ".join(f"{r['impl']} {r['shape']}: {r['error']}" for r in failed))
    if run.smoke or run.lower_only or not speed:
        run.check("auto within 10% of the fastest path", "SKIP",
                  "speed targets apply to real runs" if speed else run.not_run())
        return
    for key in ("fwd_s", "fwd_bwd_s"):
        autos = [r for r in speed if r["impl"] == "auto" and key in r]
        worst = max((r[f"{key}_vs_fastest"] for r in autos), default=None)
        name = f"auto within 10% of the fastest path ({key[:-2]})"
        if worst is None:
            run.check(name, "SKIP", run.not_run())
        else:
            run.check(name, "PASS" if worst <= 1.10 else "FAIL", f"worst ratio {worst:.2f}")
