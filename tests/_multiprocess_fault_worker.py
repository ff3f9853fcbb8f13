"""One process of the multi-process fault test (`tests/test_multiprocess_faults.py`); not a test itself.

Usage:
`python tests/_multiprocess_fault_worker.py PROCESS_ID NUM_PROCESSES PORT HEARTBEAT_TIMEOUT_S`,
with `XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_cpu_collective_timeout_seconds=5"`
(or another collective timeout) in the environment.

Every process joins the same `jax.distributed` job over localhost (gloo CPU
collectives) with the given heartbeat timeout, builds one global mesh over all
processes' devices, compiles one step of Ulysses sequence-parallel attention
under `jax.shard_map` (its all-to-alls cross the process boundary), waits at a
coordination-service barrier so that no process starts its first collective
long before the other has compiled, and then runs steps in a loop until it is
killed or a step fails. (Ring attention's ppermutes fail the same way; it is
left out because compiling it costs each process about 2 s of CPU.) It prints:

- `INFO process <i>/<n> ...` once the job is up;
- `STEP <i>` (flushed) after every completed step;
- `FAULT <exception type>: <first line of the message>` and exits with status 1
  when a step raises, for example because the other process died.

When the JAX distributed runtime ends the process itself (it does when the
coordination service reports a dead task, or when the coordinator is gone),
there is no `FAULT` line: the process aborts (SIGABRT) with the runtime's
message on stderr.
"""

import os
import sys
import time


_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # vidax_eqx, and harness/ beside this file

import jax  # noqa: E402
import numpy as np  # noqa: E402
# The coordination-service client, for a barrier that is not a gloo collective
# (`jax.experimental.array_serialization` uses it the same way).
from jax._src import distributed  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import harness  # noqa: E402


INIT_TIMEOUT_S = 60  # `initialization_timeout`: both processes must connect within this
BARRIER_TIMEOUT_S = 120  # both processes must finish compiling within this of each other
MAX_SECONDS = 120.0  # without a kill, stop after this long (the test kills a process long before)


def main() -> int:
    process_id, num_processes, port, heartbeat_s = (int(x) for x in sys.argv[1:5])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=INIT_TIMEOUT_S,
        heartbeat_timeout_seconds=heartbeat_s,
        shutdown_timeout_seconds=heartbeat_s,
    )
    from vidax_eqx import parallel

    print(f"INFO process {jax.process_index()}/{jax.process_count()} "
          f"local={jax.local_device_count()} global={jax.device_count()} pid={os.getpid()}",
          flush=True)
    mesh = harness.mesh(sp=jax.device_count())
    spec = P(None, "sp")

    def local(q, k, v):
        return parallel.sequence_parallel_self_attention(q, k, v, "sp", causal=True)

    f = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)

    def step(q, k, v):
        return q + 1e-3 * f(q, k, v)

    rng = np.random.default_rng(0)
    B, L, H, D = 1, 16 * jax.device_count(), jax.device_count(), 8
    q, k, v = (harness.global_array(mesh, spec, harness.normal(rng, (B, L, H, D)))
               for _ in range(3))
    compiled = jax.jit(step).lower(q, k, v).compile()
    # Compile times differ between processes; without this barrier the first
    # collective would wait for the slower one under the short gloo timeout.
    distributed.global_state.client.wait_at_barrier("fault_worker_compiled",
                                                    BARRIER_TIMEOUT_S * 1000)
    t0 = last = time.monotonic()
    i = 0
    try:
        for i in range(sys.maxsize):
            q = compiled(q, k, v)
            jax.block_until_ready(q)
            last = time.monotonic()
            print(f"STEP {i}", flush=True)
            if last - t0 > MAX_SECONDS:
                print(f"NOFAULT after {i + 1} steps", flush=True)
                return 2
    except Exception as e:  # the point of this worker: report the failure, then exit non-zero
        lines = str(e).strip().splitlines()
        print(f"FAULT {type(e).__name__}: {lines[0] if lines else ''}", flush=True)
        print(f"INFO step {i} failed {time.monotonic() - last:.2f} s after step {i - 1} completed",
              flush=True)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # `os._exit`, not `sys.exit`: a normal interpreter exit runs JAX's atexit
    # `jax.distributed.shutdown()`, which waits at a shutdown barrier for the
    # dead process until the heartbeat timeout declares it dead, and then the
    # runtime aborts this process after all.
    os._exit(code)
