"""What the parts of `accelerator_check.py` share: the run's mode and budget, timing,
errors against a reference, and the lowering of a program for another platform.

A part is a function of a `Run` returning rows (dicts, one per measured thing, written
to the report) and adding its checks (`Run.check`). Three modes:

- `"run"`: on this machine's devices (a GPU or TPU; CPU works too, slowly);
- `"smoke"`: tiny shapes, everything run, anywhere (CPU: the Pallas kernels in
  interpret mode): what CI runs so that the script cannot rot;
- `"lower"`: the real shapes lowered for `Run.platform` (e.g. `"cuda"`) from this host,
  nothing executed: a shape or kernel that cannot be lowered fails here first.
"""

import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from _harness import best_time  # also puts this checkout first on sys.path


F32, BF16 = jnp.float32, jnp.bfloat16
OUT_TOL, GRAD_TOL = 2e-2, 5e-2  # bf16 against the float32 reference, relative to max |reference|


@dataclasses.dataclass
class Run:
    """The run's settings and what it has found so far."""

    mode: str  # "run" | "smoke" | "lower"
    budget_s: float
    reps: int = 3
    platform: str = ""  # what the programs are for: the backend, or the lowering target
    start: float = dataclasses.field(default_factory=time.perf_counter)
    checks: list = dataclasses.field(default_factory=list)
    matmul_tflops: float | None = None

    @property
    def smoke(self) -> bool:
        return self.mode == "smoke"

    @property
    def lower_only(self) -> bool:
        return self.mode == "lower"

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def spent(self) -> bool:
        return self.elapsed() > self.budget_s

    def check(self, name: str, status: str, detail: str = "") -> None:
        self.checks.append(dict(check=name, status=status, detail=detail))

    def not_run(self) -> str:
        return f"not run within the budget of {self.budget_s:.0f} s"


def log(row: dict) -> None:
    print(json.dumps(row, default=str), file=sys.stderr, flush=True)


def error(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:240]}"


def rel_error(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def seconds(fn, *args, reps: int) -> float:
    """Best wall seconds of `reps` runs of `fn(*args)`, after one that compiles."""
    return best_time(lambda: jax.block_until_ready(fn(*args)), reps).best


def abstract(tree):
    """`tree` with every array a `jax.ShapeDtypeStruct`."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a,
                        tree)


def lowered(fn, args, platform: str) -> str:
    """The StableHLO text of `jax.jit(fn)` lowered for `platform` at the shapes of `args`
    (arrays or `ShapeDtypeStruct`s), nothing executed."""
    return jax.jit(fn).trace(*abstract(args)).lower(lowering_platforms=(platform,)).as_text()


KERNEL_CALLS = {"cudnn": "__cudnn$fmha", "pallas_gpu": "__gpu$xla.gpu.triton",
                "pallas_tpu": "tpu_custom_call"}


def custom_calls(text: str) -> dict[str, int]:
    """How many calls of each vendor kernel a lowered program holds."""
    return {name: text.count(target) for name, target in KERNEL_CALLS.items() if target in text}


def matmul_tflops(run: Run) -> float:
    """The bf16 matmul rate of this device (`n x n` operands), the yardstick of every rate."""
    n = 1024 if run.smoke else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), BF16)
    b = jax.random.normal(jax.random.key(1), (n, n), BF16)
    f = jax.jit(lambda a, b: a @ b)
    return 2.0 * n**3 / seconds(f, a, b, reps=5) / 1e12


def accuracy_status(rows: list[dict]) -> tuple[str, str]:
    """`(status, detail)` of rows with `out_err` / `grad_err` (and maybe `error`)."""
    errors = [r for r in rows if "error" in r]
    bad = [r for r in rows if r.get("out_err", 0) > OUT_TOL or r.get("grad_err", 0) > GRAD_TOL]
    if errors:
        return "FAIL", "; ".join(f"{label(r)}: {r['error']}" for r in errors)
    if bad:
        return "FAIL", "; ".join(f"{label(r)} (out {fmt(r.get('out_err'), '.1e')}, grads "
                                 f"{fmt(r.get('grad_err'), '.1e')})" for r in bad)
    worst_out = max((r["out_err"] for r in rows if "out_err" in r), default=None)
    worst_grad = max((r["grad_err"] for r in rows if "grad_err" in r), default=None)
    return "PASS", f"worst out {fmt(worst_out, '.1e')}, grads {fmt(worst_grad, '.1e')}"


def label(row: dict) -> str:
    return " ".join(str(row[k]) for k in ("part", "impl", "feature", "shape", "what") if k in row)


def fmt(x, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)
