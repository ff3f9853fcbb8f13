"""The commands a user runs as they are written: the examples `.ci/run` and the README
name, and the accelerator command's two CPU modes (`--smoke`: every part at tiny shapes,
so that it cannot rot; `--lower cuda`: the real shapes lowered for CUDA from this host,
so that a shape that cannot compile fails here first).

Each runs in a process of its own, as a user starts it, and must exit with status 0 (the
examples compare the sharded run with one device and exit non-zero when they differ;
the accelerator command exits 1 on any FAIL). Run inside the suite, they share its two
workers instead of running one after the other beside it.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 600


def _run(args: list[str], devices: int | None = None, **env) -> subprocess.CompletedProcess:
    """`python *args` from the checkout's root, CPU only, with `devices` simulated CPU
    devices (None: the command's own choice; the examples ask for 8 themselves) and the
    environment variables `env` added."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags), **env}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n" \
                                 f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.slow  # a fresh JAX in a process of its own: 4-7 s each
@pytest.mark.parametrize("args", [
    pytest.param(["examples/wan_block.py"], id="wan_block"),
    pytest.param(["examples/wan_denoise.py", "--modes", "ulysses", "usp"], id="wan_denoise"),
    pytest.param(["examples/long_attention.py", "--seq", "4096"], id="long_attention"),
])
def test_example(args):
    _run(args)


def _report(tmp_path, mode_args: list[str], **env) -> dict:
    """Runs the accelerator command on one CPU device; its JSON report."""
    _run(["benchmarks/accelerator_check.py", *mode_args, "--out", str(tmp_path)], devices=1,
         **env)
    with open(tmp_path / "accelerator_check.json") as f:
        return json.load(f)


def _statuses(report: dict) -> dict:
    return {c["check"]: c["status"] for c in report["checks"]}


@pytest.mark.slow  # every kernel path and feature, a Wan block, the parallel paths: ~60 s
def test_accelerator_check_smoke(tmp_path):
    # Its timings mean nothing at tiny shapes on a CPU: XLA without LLVM's optimizations
    # (as the suite compiles, conftest's `_fast_compile`) runs it in 60 s instead of 76.
    report = _report(tmp_path, ["--smoke", "--reps", "1"], JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    status = _statuses(report)
    assert report["mode"] == "smoke" and report["platform"] == "cpu"
    for check in ("kernel accuracy (every path x feature)", "Wan blocks forward+backward",
                  "Ulysses / ring / USP on one device"):
        assert status.get(check) == "PASS", (check, status)
    kernels = [r for r in report["rows"] if r.get("part") == "kernels"]
    assert {r.get("impl") for r in kernels} >= {"auto", "blockwise", "xla", "pallas_tpu",
                                                "pallas_gpu"}, kernels


@pytest.mark.slow  # the real shapes (32,760 tokens, 14B blocks) lowered, not run: ~30 s
def test_accelerator_check_lowers_for_cuda(tmp_path):
    report = _report(tmp_path, ["--lower", "cuda"])
    status = _statuses(report)
    assert report["mode"] == "lower" and report["platform"] == "cuda"
    for check in ("kernels lower for cuda", "Wan blocks forward+backward",
                  "Ulysses / ring / USP on one device"):
        assert status.get(check) == "PASS", (check, status)
