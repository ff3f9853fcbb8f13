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

    python benchmarks/load_memory.py                 # Wan 2.1 1.3B, bfloat16 (2.8 GB)
    python benchmarks/load_memory.py --layers 4      # a quick check
"""

import argparse
import json
import os
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
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
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
