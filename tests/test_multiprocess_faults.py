"""A process of a two-process job dies or freezes mid-run: the survivor must fail, not hang.

Each scenario launches `tests/_multiprocess_fault_worker.py` twice (the same
2 x 4 CPU-device `jax.distributed` job with gloo collectives as
`tests/test_multiprocess.py`), waits until both processes have completed
`KILL_AFTER_STEP + 1` steps of sharded Ulysses attention together, sends a
signal to one of them, and checks that the other one ends, with a non-zero
status and a recognizable message, within `SURVIVOR_BOUND_S`. SIGKILL is a
crash: the kernel closes the dead process's sockets. SIGSTOP is a frozen
process, much like a host cut off the network: its sockets stay open and
nothing answers. Every wait has a timeout and every process is killed on the
way out, so a hang fails the test instead of hanging the run. The scenarios
(independent jobs) run at the same time: most of the wall time is start-up and
compilation.

The survivor's wait is bounded by (JAX 0.10.2 names, defaults, what the test sets):

- `--xla_cpu_collective_timeout_seconds` (XLA flag, default 1800 s; here
  `COLLECTIVE_TIMEOUT_S`): how long a gloo collective waits for a peer. After a
  crash, a device thread that was reading from the dead process's socket fails
  at once ("Connection reset by peer" or "Connection closed by peer"), but
  another device thread of the same process can be left waiting in a
  collective that will never complete; after a freeze every thread waits. This
  flag ends the wait ("Timed out waiting ...ms for recv [or send] operation
  to complete"), and the step raises `JaxRuntimeError` in Python.
- `jax.distributed.initialize(heartbeat_timeout_seconds=...)` (default 100 s;
  here `HEARTBEAT_TIMEOUT_S`): the coordination service (hosted by process 0)
  declares a process dead after this long without heartbeats and then aborts
  every other process (SIGABRT, "Terminating process because the JAX
  distributed service detected fatal errors"). It is the backstop when no
  Python exception comes first; it is kept well above the collective timeout
  so that the exception wins.

Limitation: when the coordinator (process 0) crashes, the runtime aborts the
survivor as soon as its connection to the coordination service breaks, which on
localhost is at once; depending on timing the survivor's step raises first
(exit status 1, `FAULT` line) or the abort wins (SIGABRT, no Python exception
to handle). Both pass. A process that dies before `jax.distributed.initialize`
returns is bounded by `initialization_timeout` instead, not tested here.
"""

import concurrent.futures
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

import harness


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_multiprocess_fault_worker.py")
NUM_PROCESSES = harness.NUM_PROCESSES
# Three two-process jobs started, signalled and waited for: ~15 s for the file.
pytestmark = pytest.mark.slow
HEARTBEAT_TIMEOUT_S = 20  # jax.distributed.initialize(heartbeat_timeout_seconds=...)
COLLECTIVE_TIMEOUT_S = 5  # --xla_cpu_collective_timeout_seconds
KILL_AFTER_STEP = 2  # signal the victim once both processes have printed `STEP 2`
STARTUP_TIMEOUT_S = 240  # imports, `jax.distributed.initialize`, compilation, three steps
SURVIVOR_BOUND_S = 45  # the survivor must be gone this long after the signal

# The step's exception, caught and printed by the worker (see its docstring).
FAULT = re.compile(r"^FAULT JaxRuntimeError: .*Gloo [\w -]+ failed", re.MULTILINE)
# ... when the peer froze: the gloo wait ran out.
TIMED_OUT = re.compile(r"^FAULT JaxRuntimeError: .*Gloo [\w -]+ failed: .*Timed out waiting",
                       re.MULTILINE)
# The runtime ending the process itself when the coordination service reports an error.
ABORT = re.compile(r"Terminating process because the JAX distributed service detected fatal errors")

# name: (victim process, signal)
SCENARIOS = {
    "non_coordinator_killed": (1, signal.SIGKILL),
    "coordinator_killed": (0, signal.SIGKILL),
    "coordinator_frozen": (0, signal.SIGSTOP),
}


def _launch():
    env = harness.child_env()
    env["XLA_FLAGS"] += f" --xla_cpu_collective_timeout_seconds={COLLECTIVE_TIMEOUT_S}"
    port = harness.free_port()
    return [
        subprocess.Popen(
            [sys.executable, WORKER, str(i), str(NUM_PROCESSES), str(port),
             str(HEARTBEAT_TIMEOUT_S)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        for i in range(NUM_PROCESSES)
    ]


def _reader(i, proc, lines, events):
    for line in proc.stdout:
        lines[i].append(line)
        events.put((i, line))
    events.put((i, None))


def _dump(lines):
    return "\n".join(f"--- process {i}\n{''.join(out)[-4000:]}" for i, out in enumerate(lines))


def _run_scenario(victim, sig):
    """Runs both workers and sends `sig` to `victim` mid-run.

    Returns `(returncode, output, None)` of the survivor, or `(None, output, problem)`
    when the run went wrong before the signal or the survivor outlived the bound.
    """
    procs = _launch()
    lines = [[] for _ in procs]
    events = queue.Queue()
    threads = [threading.Thread(target=_reader, args=(i, p, lines, events), daemon=True)
               for i, p in enumerate(procs)]
    for t in threads:
        t.start()
    survivor = 1 - victim
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        ready = set()
        while len(ready) < NUM_PROCESSES:
            try:
                i, line = events.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                return None, _dump(lines), (f"the workers did not reach step {KILL_AFTER_STEP} "
                                            f"within {STARTUP_TIMEOUT_S} s")
            if line is None or line.startswith("FAULT"):
                return None, _dump(lines), (f"process {i} ended or failed before process {victim} "
                                            f"got {sig.name}")
            if line.strip() == f"STEP {KILL_AFTER_STEP}":
                ready.add(i)
        procs[victim].send_signal(sig)
        try:
            procs[survivor].wait(timeout=SURVIVOR_BOUND_S)
        except subprocess.TimeoutExpired:
            return None, _dump(lines), (
                f"process {survivor} still running {SURVIVOR_BOUND_S} s after process {victim} "
                f"got {sig.name} (heartbeat timeout {HEARTBEAT_TIMEOUT_S} s, collective timeout "
                f"{COLLECTIVE_TIMEOUT_S} s)")
        threads[survivor].join(timeout=10)  # the rest of its output
        return procs[survivor].returncode, "".join(lines[survivor]), None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL also ends a stopped process
            p.wait()
        for p, t in zip(procs, threads):
            t.join(timeout=10)
            if not t.is_alive():
                p.stdout.close()


@pytest.fixture(scope="module")
def survivors():
    """All scenarios at once (independent jobs): `{name: (returncode, output, problem)}`."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(SCENARIOS)) as pool:
        futures = {name: pool.submit(_run_scenario, *args) for name, args in SCENARIOS.items()}
        return {name: f.result() for name, f in futures.items()}


def _survivor(survivors, name):
    rc, out, problem = survivors[name]
    if problem is not None:
        pytest.fail(f"{name}: {problem}:\n{out}")
    return rc, out


def test_survivor_raises_when_non_coordinator_killed(survivors):
    """Process 1 crashes; process 0 (which hosts the coordination service) raises from its step."""
    rc, out = _survivor(survivors, "non_coordinator_killed")
    assert rc == 1, (
        f"process 0 exited with {rc}, expected 1 after a caught exception:\n{out[-4000:]}")
    assert FAULT.search(out), f"process 0 reported no gloo collective failure:\n{out[-4000:]}"


def test_survivor_ends_when_coordinator_killed(survivors):
    """Process 0 (the coordinator) crashes; process 1's step raises or the runtime aborts it."""
    rc, out = _survivor(survivors, "coordinator_killed")
    assert rc != 0, f"process 1 exited with 0 after the coordinator died:\n{out[-4000:]}"
    assert ABORT.search(out) or FAULT.search(out), (
        f"process 1 ended (status {rc}) without a recognizable error:\n{out[-4000:]}")


def test_survivor_times_out_when_coordinator_frozen(survivors):
    """Process 0 freezes; process 1's step raises once the gloo collective timeout runs out.

    A frozen process 1 fails process 0 the same way; one frozen scenario keeps the file short.
    """
    rc, out = _survivor(survivors, "coordinator_frozen")
    assert rc == 1, (
        f"process 1 exited with {rc}, expected 1 after a caught exception:\n{out[-4000:]}")
    assert TIMED_OUT.search(out), f"process 1 reported no gloo timeout:\n{out[-4000:]}"
