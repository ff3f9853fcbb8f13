"""Peak host memory of `WanTransformer3D.from_pretrained` against the checkpoint's size.

Writes a Wan 2.1 checkpoint of the chosen size with random weights (diffusers layout,
bfloat16 by default, one file or `--shards` files with an index) into a temporary
directory, then, in a fresh process for each measurement, loads it and reports the
process's peak resident memory (`VmHWM`) against:

- `baseline`: the same fresh process after importing JAX and vidax_eqx and running
  one tiny computation (the runtime's own footprint), and
- the checkpoint's bytes on disk.

`from_pretrained` builds the model abstractly, checks every header, then reads one
tensor at a time (a stacked block array is filled layer by layer into one buffer)
and hands each to JAX; so the peak should be near baseline + checkpoint size, not
twice it.

`--processes N` measures the sharded load instead: N processes of `--local-devices`
CPU devices each join one `jax.distributed` job (gloo) and call
`from_pretrained(path, parallel=ParallelConfig(fsdp_axes=("dp",)), mesh=mesh)` with
FSDP over all their devices (`make_mesh(dp=N * local devices)`); each reads only the
blocks its devices hold. Each process reports its peak RSS before the load (its
baseline) and after, and the bytes it read, against the checkpoint's size and its
largest tensor: each should stay under baseline + 0.6 x checkpoint + largest tensor
(its devices hold 1/N of the model, in its own memory on CPU). The same processes then
load the whole model without a mesh, for comparison.

    python benchmarks/load_memory.py                 # Wan 2.1 1.3B, bfloat16 (2.8 GB)
    python benchmarks/load_memory.py --layers 4      # a quick check
    python benchmarks/load_memory.py --layers 8 --shards 4 --processes 2   # sharded load
"""

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import numpy as np

from _harness import emit, peak_rss, run_child


def _child(path: str, dtype: str | None, baseline_only: bool) -> None:
    import jax
    import jax.numpy as jnp

    from vidax_eqx import models

    jax.block_until_ready(jnp.ones(8) + 1)
    result = {}
    if not baseline_only:
        t0 = time.perf_counter()
        model = models.WanTransformer3D.from_pretrained(path, dtype=dtype)
        jax.block_until_ready(jax.tree.leaves(model))
        result["seconds"] = time.perf_counter() - t0
        result["parameter_bytes"] = sum(
            a.nbytes for a in jax.tree.leaves(model) if hasattr(a, "nbytes"))
    result["peak_rss_bytes"] = peak_rss()  # VmHWM: this process's own peak
    emit(result)


def _sharded_child(path: str, process: int, processes: int, port: int, plain: bool) -> None:
    """One process of the sharded load: baseline peak, then the load's peak and bytes."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=processes, process_id=process)
    from vidax_eqx import interop, models, nn, parallel

    jax.block_until_ready(jnp.ones(8) + 1)
    result = {"process": process, "local_devices": jax.local_device_count(),
              "baseline_peak_rss_bytes": peak_rss()}
    opened = []
    open_checkpoint = interop.open_checkpoint

    def recording(p):  # to read the opened checkpoint's bytes_read
        opened.append(open_checkpoint(p))
        return opened[-1]

    interop.open_checkpoint = recording
    mesh = parallel.make_mesh(dp=jax.device_count())
    t0 = time.perf_counter()
    if plain:
        model = models.WanTransformer3D.from_pretrained(path)
    else:
        model = models.WanTransformer3D.from_pretrained(
            path, parallel=nn.sharding.ParallelConfig(fsdp_axes=("dp",)), mesh=mesh)
    jax.block_until_ready(jax.tree.leaves(model))
    result["seconds"] = time.perf_counter() - t0
    result["peak_rss_bytes"] = peak_rss()
    result["bytes_read"] = opened[0].bytes_read
    result["local_parameter_bytes"] = sum(
        s.data.nbytes for a in jax.tree.leaves(model) if isinstance(a, jax.Array)
        for s in a.addressable_shards)
    emit(result)


def _measure_sharded(path, processes, local_devices, plain):
    """Runs the processes of one sharded (or plain, `plain`) load; their records."""
    import concurrent.futures

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a free local port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with concurrent.futures.ThreadPoolExecutor(processes) as pool:
        runs = [pool.submit(run_child, __file__,
                            ["--child", path, "--process", str(i), "--processes", str(processes),
                             "--port", str(port)] + (["--plain"] if plain else []),
                            devices=local_devices, timeout=1800)
                for i in range(processes)]
        results = [r.result() for r in runs]
    for i, r in enumerate(results):
        if not r.ok or r.last is None:
            raise SystemExit(f"load_memory process {i} failed (exit {r.returncode}): "
                             f"{r.reason or 'no result'}")
    return [r.last for r in results]


def _checkpoint_sizes(path):
    """`(data bytes, largest tensor's bytes)` from the headers."""
    import math

    from vidax_eqx import interop

    tensors = interop.open_checkpoint(path)
    sizes = [math.prod(tensors.shape(n)) * tensors.dtype(n).itemsize for n in tensors]
    return sum(sizes), max(sizes)


def _report_sharded(size, largest, args, sharded, plain) -> None:
    gib = 2**30
    print(f"{args.processes} processes x {args.local_devices} CPU devices, FSDP over all "
          f"{args.processes * args.local_devices} (mesh dp={args.processes * args.local_devices}); "
          f"largest tensor {largest / 2**20:.1f} MiB")
    print("| process | load | baseline peak RSS | peak RSS | increase | increase / checkpoint | "
          "target (0.6 x ckpt + largest) | bytes read / checkpoint | parameters held | time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind, records in (("mesh=", sharded), ("plain", plain)):
        for r in records:
            extra = r["peak_rss_bytes"] - r["baseline_peak_rss_bytes"]
            target = 0.6 * size + largest
            verdict = (f"{target / gib:.2f} GiB ({'met' if extra <= target else 'MISSED'})"
                       if kind == "mesh=" else "–")
            print(f"| {r['process']} | {kind} | {r['baseline_peak_rss_bytes'] / gib:.2f} GiB | "
                  f"{r['peak_rss_bytes'] / gib:.2f} GiB | {extra / gib:.2f} GiB | "
                  f"{extra / size:.2f} | {verdict} | "
                  f"{r['bytes_read'] / size:.2f} | {r['local_parameter_bytes'] / gib:.2f} GiB | "
                  f"{r['seconds']:.1f} s |")


def _measure(path, dtype, baseline_only):
    args = ["--child", path, "--dtype", dtype or "none"]
    if baseline_only:
        args.append("--baseline")
    r = run_child(__file__, args)
    if not r.ok or r.last is None:
        raise SystemExit(f"load_memory child failed (exit {r.returncode}): {r.reason or 'no result'}")
    return r.last


def write_checkpoint(path, config, dtype, shards):
    """A diffusers-layout checkpoint with random weights, written tensor by tensor."""
    import equinox as eqx
    import jax
    import ml_dtypes

    from vidax_eqx import interop, models

    abstract = eqx.filter_eval_shape(models.WanTransformer3D, config, key=jax.random.PRNGKey(0))
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(0)
    names = {}
    for name, leaf in _abstract_state_dict(abstract).items():
        names[name] = (rng.standard_normal(leaf, np.float32) * 0.02).astype(np_dtype)
    total = sum(a.nbytes for a in names.values())
    interop.write_checkpoint(path, names, max_shard_bytes=None if shards <= 1 else -(-total // shards))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_diffusers(), f)
    return total


def _abstract_state_dict(abstract):
    """name -> shape of every tensor of the diffusers layout, from the abstract model
    (zero-strided NumPy stand-ins: `state_dict` needs arrays, none is allocated)."""
    import jax

    concrete = jax.tree.map(
        lambda s: np.broadcast_to(np.zeros((), np.float32), s.shape)
        if isinstance(s, jax.ShapeDtypeStruct) else s,
        abstract, is_leaf=lambda s: isinstance(s, jax.ShapeDtypeStruct),
    )
    return {k: v.shape for k, v in concrete.state_dict(layout="diffusers").items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30, help="blocks (default 30: Wan 2.1 1.3B)")
    p.add_argument("--dtype", default="bfloat16", help="checkpoint dtype (default bfloat16)")
    p.add_argument("--shards", type=int, default=1, help="files with an index (default 1)")
    p.add_argument("--processes", type=int, default=0,
                   help="measure the sharded load (mesh=) in this many jax.distributed "
                        "processes (default 0: the plain load in one process)")
    p.add_argument("--local-devices", type=int, default=4,
                   help="CPU devices per process with --processes (default 4)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--process", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child and args.process is not None:
        _sharded_child(args.child, args.process, args.processes, args.port, args.plain)
        return 0
    if args.child:
        _child(args.child, None if args.dtype == "none" else args.dtype, args.baseline)
        return 0

    from vidax_eqx import models

    config = models.WanConfig(num_layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        size = write_checkpoint(tmp, config, args.dtype, args.shards)
        print(f"checkpoint: Wan 2.1 1.3B shape, {args.layers} layers, {args.dtype}, "
              f"{size / 2**30:.2f} GiB in {args.shards} file(s) (written in "
              f"{time.perf_counter() - t0:.0f} s)")
        if args.processes:
            size, largest = _checkpoint_sizes(tmp)
            sharded = _measure_sharded(tmp, args.processes, args.local_devices, plain=False)
            plain = _measure_sharded(tmp, args.processes, args.local_devices, plain=True)
            _report_sharded(size, largest, args, sharded, plain)
            return 0
        base = _measure(tmp, None, True)
        load = _measure(tmp, None, False)
    extra = load["peak_rss_bytes"] - base["peak_rss_bytes"]
    print("| checkpoint | baseline peak RSS | from_pretrained peak RSS | increase | "
          "increase / checkpoint | load time |")
    print("|---|---|---|---|---|---|")
    print(f"| {size / 2**30:.2f} GiB ({args.dtype}, {args.shards} file(s)) | "
          f"{base['peak_rss_bytes'] / 2**30:.2f} GiB | {load['peak_rss_bytes'] / 2**30:.2f} GiB | "
          f"{extra / 2**30:.2f} GiB | {extra / size:.2f} | {load['seconds']:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
