"""Sequence parallelism across a process boundary: two processes, four CPU devices each.

The test launches `tests/_multiprocess_worker.py` twice; the workers join one
`jax.distributed` job on localhost (gloo CPU collectives), build one 8-device
mesh spanning both processes, and compare Ulysses (and ring attention, when
`vidax_eqx.parallel.ring_attention` exists) forward and gradients with the
float64 oracle. This is the code path of a multi-host TPU or GPU job.
"""

import os
import subprocess
import sys

import pytest

import harness
from vidax_eqx import parallel


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_multiprocess_worker.py")
NUM_PROCESSES, LOCAL_DEVICES = harness.NUM_PROCESSES, harness.LOCAL_DEVICES
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def workers():
    """Runs both workers once; returns `[(returncode, output), ...]` per process."""
    port = harness.free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(i), str(NUM_PROCESSES), str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=harness.child_env(),
        )
        for i in range(NUM_PROCESSES)
    ]
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            results.append((p.returncode, out))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate()[0] for p in procs]
        pytest.fail(f"multi-process workers timed out after {TIMEOUT_S} s:\n"
                    + "\n".join(f"--- process {i}\n{o[-3000:]}" for i, o in enumerate(outs)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def _result(output: str, case: str) -> list[str] | None:
    for line in output.splitlines():
        parts = line.split()
        if parts[:2] == ["RESULT", case]:
            return parts[2:]
    return None


def _check_case(workers, case):
    for i, (rc, out) in enumerate(workers):
        assert rc == 0, f"process {i} exited with {rc}:\n{out[-4000:]}"
        res = _result(out, case)
        assert res is not None, f"process {i} reported no result for {case}:\n{out[-4000:]}"
        assert res[0] == "ok", f"process {i}, {case}: {' '.join(res)}\n{out[-4000:]}"
        err, tol = float(res[1]), float(res[2])
        assert err <= tol, f"process {i}, {case}: relative error {err:.3g} > {tol:.3g}"


def test_processes_joined(workers):
    for i, (rc, out) in enumerate(workers):
        assert rc == 0, f"process {i} exited with {rc}:\n{out[-4000:]}"
        assert f"INFO process {i}/{NUM_PROCESSES} local={LOCAL_DEVICES} global=8" in out, out[-4000:]


def test_ulysses_across_processes(workers):
    _check_case(workers, "ulysses")


def test_ring_across_processes(workers):
    if not hasattr(parallel, "ring_attention"):
        pytest.skip("vidax_eqx.parallel.ring_attention does not exist yet")
    _check_case(workers, "ring")
