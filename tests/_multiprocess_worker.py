"""One process of the two-process test (`tests/test_multiprocess.py`); not a test itself.

Usage: `python tests/_multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT`, with
`XLA_FLAGS=--xla_force_host_platform_device_count=4` in the environment. Every
process joins the same `jax.distributed` job over localhost with gloo CPU
collectives, builds one global mesh over all processes' devices, builds the
same seeded global arrays with `jax.make_array_from_callback`, runs sequence-
parallel attention (and its VJP) under `jax.shard_map`, gathers the results with
`multihost_utils.process_allgather` and compares them with the float64 oracle.

Prints one line per case:
`RESULT <case> ok <max relative error> <tolerance>` or `RESULT <case> error <message>`
(`RESULT ring unavailable` when `vidax_eqx.parallel.ring_attention` does not exist).
"""

import os
import sys
import traceback


_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # vidax_eqx; oracle.py, harness/ beside it

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import harness  # noqa: E402
import oracle  # noqa: E402


def _compare(name, got, ref):
    tol = oracle.tolerance(np.float32)
    err = max(oracle.rel_error(g, r) for g, r in zip(got, ref))
    print(f"RESULT {name} ok {err:.3e} {tol:.1e}", flush=True)


def _run_case(name, mesh, local, a, ref):
    """VJP of `local(q, k, v, sinks, seg)` under shard_map, gathered and compared."""
    spec = P(None, "sp")
    f = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, P(), spec), out_specs=spec)

    @jax.jit
    def run(q, k, v, sinks, seg, dout):
        out, vjp = jax.vjp(lambda q, k, v, s: f(q, k, v, s, seg), q, k, v, sinks)
        return out, vjp(dout)

    args = [harness.global_array(mesh, spec, a[n]) for n in ("q", "k", "v")]
    args += [harness.global_array(mesh, P(), a["sinks"]),
             *(harness.global_array(mesh, spec, a[n]) for n in ("seg", "dout"))]
    out, grads = run(*args)
    got = multihost_utils.process_allgather((out, *grads), tiled=True)
    _compare(name, got, (ref.out, ref.dq, ref.dk, ref.dv, ref.dsinks))


def main() -> int:
    process_id, num_processes, port = (int(x) for x in sys.argv[1:4])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
    )
    from vidax_eqx import parallel

    print(f"INFO process {jax.process_index()}/{jax.process_count()} "
          f"local={jax.local_device_count()} global={jax.device_count()}", flush=True)
    mesh = harness.mesh(sp=jax.device_count())
    # Segment ids: sorted runs, different per batch element, no padding.
    rng = np.random.default_rng(0)
    a = harness.attention_inputs(2, 32, 8, 16, H_kv=2, rng=rng, sinks=True)
    a["seg"] = harness.segment_ids(rng, 2, 32, scattered=False, pad=(0, 0))
    ref = oracle.attention(a["q"], a["k"], a["v"], sinks=a["sinks"], segment_ids=a["seg"],
                           causal=True, dout=a["dout"])

    def ulysses(q, k, v, sinks, seg):
        return parallel.sequence_parallel_self_attention(
            q, k, v, "sp", sinks=sinks, segment_ids=seg, causal=True)

    def ring(q, k, v, sinks, seg):
        return parallel.ring_attention(
            q, k, v, ring_axis="sp", sinks=sinks, segment_ids=seg, causal=True)

    cases = [("ulysses", ulysses)]
    if hasattr(parallel, "ring_attention"):
        cases.append(("ring", ring))
    else:
        print("RESULT ring unavailable", flush=True)
    for name, local in cases:
        try:
            _run_case(name, mesh, local, a, ref)
        except Exception as e:  # report and go on: the other case is independent
            traceback.print_exc()
            msg = f"{type(e).__name__}: {e}".splitlines()[0]
            print(f"RESULT {name} error {msg}", flush=True)
    # Every process reaches this point before either shuts the job down.
    multihost_utils.sync_global_devices("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
