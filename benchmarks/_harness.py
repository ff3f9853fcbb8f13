"""What every benchmark in `benchmarks/` shares: child processes, timing, memory, the
run's stamp, and output.

Imports only the standard library at module level (JAX is imported inside the
functions that need it), so a benchmark can set `XLA_FLAGS` after importing this
module and before importing JAX, and a child that runs in another environment
(the diffusers comparison's torch venv) can use it too.

- **Child processes**: [`run_child`][] runs `python SCRIPT ARGS` (one case in a fresh
  process, so that each gets a clean heap and its own peak memory), with a device
  count for XLA's host platform and a time limit, and returns every JSON line the
  child printed and, if it failed, one line saying why. [`emit`][] is the child's
  side.
- **Timing**: [`best_time`][] times a callable that synchronizes itself
  (`jax.block_until_ready`) and returns a [`Timing`][]: the warm-up run and the timed
  runs, wall and process CPU time (all threads) of each. [`interleaved`][] times
  several against each other in rounds, shuffled; [`paired_ratio`][] divides them
  round by round.
- **Memory**: [`current_rss`][], [`peak_rss`][] (`VmHWM`, not `ru_maxrss`, which
  Linux carries from the parent across fork + exec), [`reset_peak_rss`][], and
  [`run_with_peak`][]: one run and its peak RSS above the RSS just before it.
- **Stamp**: [`git_state`][] (HEAD and the library files changed from it),
  [`command_line`][], [`cpu_model`][], [`meminfo`][].
- **Output**: [`fmt`][], [`write_text`][] (the Markdown), [`write_json`][],
  [`write_csv`][]; and [`log`][] for progress on stderr.
"""

import csv
import dataclasses
import datetime
import gc
import json
import os
import platform
import random
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
# Benchmark this checkout's vidax_eqx, not whichever copy happens to be installed.
if REPO not in sys.path:
    sys.path.insert(0, REPO)

PASSES = ("fwd", "fwd+bwd")  # the attention benchmarks' two passes
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


# --------------------------------------------------------------------------- #
# Child processes
# --------------------------------------------------------------------------- #


def xla_flags_with_devices(flags: str, devices: int | None) -> str:
    """`flags` (an `XLA_FLAGS` value) with its host device count replaced by `devices`
    (removed for `None` or 1: one device is XLA's default)."""
    kept = [f for f in flags.split() if not f.startswith(_DEVICE_FLAG)]
    if devices is not None and devices > 1:
        kept.append(f"{_DEVICE_FLAG}={devices}")
    return " ".join(kept)


def set_host_devices(devices: int) -> None:
    """Simulates `devices` CPU devices in this process: call before JAX is imported."""
    os.environ["XLA_FLAGS"] = xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""), devices)


class ChildResult(NamedTuple):
    """What a child process left behind."""

    records: list[dict]  # every JSON object it printed on stdout (a line starting with "{")
    returncode: int | None  # None: stopped at the time limit
    reason: str  # why it failed, one line ("" when returncode == 0)
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def last(self) -> dict | None:
        return self.records[-1] if self.records else None

    def record(self) -> dict:
        """The child's last record, or an error record (`status`, `note`) when it failed
        or printed none."""
        if not self.ok or self.last is None:
            return {"status": f"error (exit {self.returncode})", "note": (self.reason or "no result")[:300]}
        return self.last


_ERROR_LINE = re.compile(r"^[\w.]+(Error|Exception|Exit)\b")


def failure_reason(returncode: int | None, stdout: str, stderr: str, timeout: float | None) -> str:
    """One line on why a child failed: the time limit, a kill (out of memory), XLA's
    `Check failed:`, the last exception line, or the last line of its output."""
    if returncode is None:
        return f"exceeded the {timeout:g} s limit"
    if returncode in (-9, 137):
        return "killed (out of memory?)"
    lines = (stderr or stdout).strip().splitlines() or [""]
    fatal = [m.group(0) for ln in lines if (m := re.search(r"Check failed: .*", ln))]
    errors = [ln for ln in lines if _ERROR_LINE.match(ln)]
    return (fatal[:1] or errors[-1:] or lines[-1:])[0]


def run_child(
    script: str,
    args: Sequence[str] = (),
    *,
    devices: int | None = None,
    timeout: float | None = None,
    python: str = sys.executable,
) -> ChildResult:
    """Runs `python script *args` and collects the JSON lines it prints.

    **Arguments:**

    - `script`: the Python file to run (usually the calling benchmark itself).
    - `args`: its command-line arguments.
    - `devices`: simulated CPU devices in the child (`XLA_FLAGS`, set before it
      imports JAX); `None` leaves this process's `XLA_FLAGS` as they are.
    - `timeout`: seconds before the child is stopped (`returncode` then `None`).
    - `python`: the interpreter (another environment: torch, diffusers).

    **Returns:** a [`ChildResult`][]; a failed child keeps the records it printed
    before it failed.
    """
    env = dict(os.environ)
    if devices is not None:
        env["XLA_FLAGS"] = xla_flags_with_devices(env.get("XLA_FLAGS", ""), devices)
    cmd = [python, os.path.abspath(script), *map(str, args)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr, rc = "", None
    wall = time.perf_counter() - t0
    records = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
    reason = "" if rc == 0 else failure_reason(rc, stdout, stderr, timeout)
    return ChildResult(records, rc, reason, wall)


def emit(record: dict) -> None:
    """The child's side of [`run_child`][]: one JSON line on stdout, flushed (so a
    crash later keeps it)."""
    print(json.dumps(record), flush=True)


# --------------------------------------------------------------------------- #
# Timing
# --------------------------------------------------------------------------- #


class Sample(NamedTuple):
    """One run: wall seconds and process CPU seconds (all threads)."""

    wall: float
    cpu: float


def timed(run: Callable[[], Any]) -> tuple[Sample, Any]:
    """Runs `run()` once (it must synchronize: `jax.block_until_ready`); returns its
    [`Sample`][] and its result."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = run()
    return Sample(time.perf_counter() - t0, time.process_time() - c0), out


class Timing(NamedTuple):
    """The result of [`best_time`][]."""

    first: Sample  # the warm-up run
    samples: tuple[Sample, ...]  # the timed runs; `(first,)` when it was the only one
    first_only: bool = False  # the warm-up was so long that it was the only timed run

    @property
    def best(self) -> float:
        """Wall seconds of the fastest timed run."""
        return min(s.wall for s in self.samples)

    @property
    def best_cpu(self) -> float:
        """Process CPU seconds of the cheapest timed run (CPU time is what a run costs
        whatever else shares the machine, so its ratios stay meaningful when the
        wall-clock ones are noisy)."""
        return min(s.cpu for s in self.samples)

    @property
    def median(self) -> float:
        return statistics.median(s.wall for s in self.samples)

    @property
    def runs(self) -> int:
        return len(self.samples)

    def fields(self) -> dict:
        """`time_s`, `cpu_s`, `runs` (and a `note` when the warm-up was the only timed
        run): the keys the benchmarks' child processes report."""
        out = {"time_s": self.best, "cpu_s": self.best_cpu, "runs": self.runs}
        if self.first_only:
            out["note"] = "timed on its first run"
        return out


def best_time(
    run: Callable[[], Any],
    repeats: int,
    *,
    target_seconds: float = float("inf"),
    single_run_seconds: float = float("inf"),
    first: Sample | None = None,
) -> Timing:
    """Times `run()` (a callable that synchronizes itself): a warm-up, then up to
    `repeats` timed runs.

    **Arguments:**

    - `run`: one run, e.g. `lambda: jax.block_until_ready(compiled(*xs))`.
    - `repeats`: the most timed runs (at least one is made).
    - `target_seconds`: fewer timed runs (at least one) when `repeats` of them would
      take longer than this, judged by the warm-up.
    - `single_run_seconds`: a warm-up longer than this is the only timed run (a
      program compiled ahead of time holds no compilation in it, and a second run
      would double a long wait).
    - `first`: the warm-up, when the caller has already made it (to measure its
      memory, say); otherwise `best_time` makes it.

    **Returns:** a [`Timing`][].
    """
    if first is None:
        first, _ = timed(run)
    if first.wall > single_run_seconds:
        return Timing(first, (first,), first_only=True)
    n = repeats
    if first.wall * repeats > target_seconds:
        n = int(target_seconds / first.wall)
    return Timing(first, tuple(timed(run)[0] for _ in range(max(1, n))))


def interleaved(runs: dict[str, Callable[[], Any]], rounds: int, *,
                seed: int = 0) -> dict[str, Timing]:
    """Times callables against each other in one process: each once as a warm-up, then
    `rounds` rounds that run each once, in an order shuffled every round (seeded), so
    that neither a load that comes and goes on a shared machine nor what ran just before
    (a large program's freed memory, cold caches: a fixed order slows whatever follows
    it every round) favours one of them.

    **Arguments:**

    - `runs`: `{name: run}`, each `run()` synchronizing itself.
    - `rounds`: the timed runs of each (at least one).
    - `seed`: the shuffles' seed.

    **Returns:** `{name: Timing}`; `samples[i]` of any two names come from round `i`,
    a pair ([`paired_ratio`][]).
    """
    rng = random.Random(seed)
    names = list(runs)
    first = {n: timed(runs[n])[0] for n in names}
    samples: dict[str, list[Sample]] = {n: [] for n in names}
    for _ in range(max(1, rounds)):
        for n in rng.sample(names, len(names)):
            samples[n].append(timed(runs[n])[0])
    return {n: Timing(first[n], tuple(samples[n])) for n in names}


def paired_ratio(a: Timing, b: Timing, *, cpu: bool = False) -> tuple[float, float, float]:
    """`(median, min, max)` over the rounds of [`interleaved`][] of `a / b`, each
    round's samples divided (wall time, or process CPU time with `cpu`)."""
    key = (lambda s: s.cpu) if cpu else (lambda s: s.wall)
    ratios = [key(x) / key(y) for x, y in zip(a.samples, b.samples)]
    return statistics.median(ratios), min(ratios), max(ratios)


# --------------------------------------------------------------------------- #
# Memory
# --------------------------------------------------------------------------- #


def _max_rss() -> int:
    """`ru_maxrss` in bytes (KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def _kb_field(path: str, field: str) -> int | None:
    """A `Name:  N kB` field of a `/proc` file in bytes (Linux), else None."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _proc_status(field: str) -> int | None:
    """A memory field of `/proc/self/status` in bytes (Linux), else None."""
    return _kb_field("/proc/self/status", field)


def current_rss() -> int:
    """Resident set size now, in bytes (`VmRSS`, Linux); elsewhere the peak so far."""
    rss = _proc_status("VmRSS")
    return _max_rss() if rss is None else rss


def peak_rss() -> int:
    """This process's peak resident set size, in bytes: `VmHWM` on Linux (which
    [`reset_peak_rss`][] resets). Not `ru_maxrss`: Linux carries the parent's peak
    across fork + exec into it. Elsewhere `ru_maxrss`."""
    hwm = _proc_status("VmHWM")
    return _max_rss() if hwm is None else hwm


def reset_peak_rss() -> bool:
    """Resets the high-water mark that [`peak_rss`][] reports (Linux >= 4.0); False
    where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Peak(NamedTuple):
    """Peak memory of one run."""

    above_baseline: int  # peak RSS during the run minus the RSS just before it, bytes
    baseline: int  # the RSS just before it, bytes
    reset: bool  # False: the high-water mark could not be reset, the peak is the process's


def run_with_peak(run: Callable[[], Any]) -> tuple[Sample, Any, Peak]:
    """One timed run of `run()` and its peak RSS above the RSS just before it (the
    garbage collected and the high-water mark reset first)."""
    gc.collect()
    reset = reset_peak_rss()
    baseline = current_rss()
    sample, out = timed(run)
    return sample, out, Peak(peak_rss() - baseline, baseline, reset)


def compile_ahead(fn, args) -> tuple[Any, int | None, int | None]:
    """`fn.lower(*args).compile()`, and its `memory_analysis()` temp and output bytes
    (`None` where the backend does not report them)."""
    compiled = fn.lower(*args).compile()
    try:  # `eqx.filter_jit`'s Compiled wraps JAX's
        ma = getattr(compiled, "compiled", compiled).memory_analysis()
        temp, out = int(ma.temp_size_in_bytes), int(ma.output_size_in_bytes)
    except Exception:  # not every backend reports it
        temp = out = None
    return compiled, temp, out


def attention_pass(attend, pass_: str):
    """The jitted function of one pass of `attend(q, k, v)` and how many inputs it
    takes: `"fwd"` (3) or `"fwd+bwd"`, the gradient of `sum(out * cotangent)` with
    respect to q, k and v (4: a float32 cotangent last)."""
    import jax
    import jax.numpy as jnp

    if pass_ == "fwd":
        return jax.jit(attend), 3

    def loss(q, k, v, cotangent):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * cotangent)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), 4


def device_op_times(run: Callable[[], Any], *, calls: int = 3, top: int = 12) -> list[dict]:
    """Where a program's device time goes: `run()` (one call of a compiled program)
    `calls` times under `jax.profiler.trace`, the device planes' XLA op events summed
    by op name. The `top` ops by time: `{"op", "ms" (per call), "share"}` (of every op's
    time). Empty where the trace has no device plane (the CPU backend's ops run on host
    threads)."""
    import tempfile

    import jax
    from jax.profiler import ProfileData

    jax.block_until_ready(run())
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            for _ in range(calls):
                jax.block_until_ready(run())
        paths = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if f.endswith(".xplane.pb")]
        data = ProfileData.from_file(paths[0]) if paths else None
    totals: dict[str, float] = {}
    for plane in data.planes if data else ():
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if line.name != "XLA Ops":
                continue
            for event in line.events:
                totals[event.name] = totals.get(event.name, 0.0) + event.duration_ns
    whole = sum(totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return [dict(op=name, ms=ns / 1e6 / calls, share=ns / whole) for name, ns in ranked]


# --------------------------------------------------------------------------- #
# The run's stamp
# --------------------------------------------------------------------------- #


def now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def git_state() -> str:
    """HEAD's short hash, and the library files that differ from it (others may be
    editing the checkout while a benchmark runs); "unknown" outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "vidax_eqx"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    dirty = [ln[3:] for ln in dirty if ln.strip()]
    return head + (f" + uncommitted changes to {', '.join(dirty)}" if dirty else "")


def command_line(script: str, prefix: str = "python ") -> str:
    """`python SCRIPT ARGS` of this process (`prefix` in place of `python `), the
    script relative to the working directory, shell-quoted."""
    return prefix + " ".join(shlex.quote(a) for a in [os.path.relpath(script), *sys.argv[1:]])


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def meminfo(field: str) -> int | None:
    """A field of `/proc/meminfo` (`MemTotal`, `MemAvailable`) in bytes (Linux), else
    None."""
    return _kb_field("/proc/meminfo", field)


# --------------------------------------------------------------------------- #
# Output
# --------------------------------------------------------------------------- #


def log(msg: str) -> None:
    """Progress, on stderr (stdout holds the tables, and a child's JSON lines)."""
    print(msg, file=sys.stderr, flush=True)


def fmt(x, spec: str, missing: str = "–") -> str:
    """`format(x, spec)`, or `missing` for None."""
    return missing if x is None else format(x, spec)


def _makedirs_for(path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def write_text(path: str, text: str) -> None:
    _makedirs_for(path)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_json(path: str, data) -> None:
    """`data` as indented JSON (one level per line)."""
    _makedirs_for(path)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)


def write_csv(path: str, row_type: type, rows: Sequence, info: dict, extra: Sequence[str]) -> None:
    """One line per row (instances of the dataclass `row_type`): its fields (a trailing
    `_` dropped from the header), then the `extra` keys of the run's `info`, the same
    on every line."""
    _makedirs_for(path)
    fields = [f.name for f in dataclasses.fields(row_type)]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([n.rstrip("_") for n in fields] + list(extra))
        for r in rows:
            writer.writerow([getattr(r, n) for n in fields] + [info[k] for k in extra])
