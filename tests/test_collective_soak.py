"""The collective soak's CI profile: sharded programs that once aborted XLA's CPU runtime.

`scripts/soak_collectives.py --profile ci` runs a fixed list of sharded
configurations (the USP gradient and ring attention's second order at the smallest
sizes that aborted before the collectives were ordered, one of every other path, and
two with fully sharded weights: an FSDP attention layer among a zigzag ring and tensor
parallelism, a whole Wan over dp x Ulysses x tp), each in its own subprocess, twice,
against a single-device reference. An abort there ends only its child; this test
asserts that every configuration is `ok`.
"""

import json
import os
import subprocess
import sys

import pytest


SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "scripts", "soak_collectives.py")


@pytest.mark.slow  # a soak run of the collectives in subprocesses: ~60 s
def test_collective_soak_ci(tmp_path):
    report = tmp_path / "soak.json"
    # Its children compile as the suite does (conftest's `_fast_compile`: XLA without its
    # LLVM optimizations; the same HLO, every result against the same tolerances).
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--profile", "ci", "--jobs", "2", "--json", str(report)],
        capture_output=True, text=True, timeout=600,
        env=dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1"),
    )
    output = f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert report.exists(), f"the soak wrote no report (exit status {proc.returncode}):\n{output}"
    outcomes = json.loads(report.read_text())["summary"]["outcomes"]
    assert outcomes == {"ok": outcomes.get("ok", 0)} and proc.returncode == 0, output
