"""The Wan VAE's memory at real size: one device against the frames split over 8 devices,
by resolution, frame count and time chunk; and what each device sends per chunk.

The VAE (Wan 2.1's, `WanVAEConfig.wan21()`, or `--wan22`) is built abstractly
(`eqx.filter_eval_shape`: no weight allocated), the video or latents are
`jax.ShapeDtypeStruct`s, and the decode / encode program is lowered and compiled ahead
of time on this machine's CPU backend with 8 simulated devices
(`--xla_force_host_platform_device_count=8`):

- **one device**: `vae.decode(latents, chunk=c)`;
- **8 devices**: `vae.decode(latents, chunk=c, mesh=mesh, spatial_axes=("h", "w"))` on a
  `(2, 4)` mesh: the frames' height over 2 devices, the width over 4.

Reported per program, from `compiled.memory_analysis()` (one device's figures: every
device runs the same SPMD program): `temp` (everything XLA allocates beyond arguments and
outputs: activations, caches, the scan's buffers), `args` and `out`. The goal of the
issue: per-device temp at most 1/6 of the one-device temp.

Communication per chunk (the `lax.scan` body, per device): the bytes of every
`ppermute` (the convolutions' halo rows and columns) and `all_gather` (the mid-block
attention's keys and values) operand, from the program's jaxpr, against the bytes of
every convolution's input in the same body (the activations the chunk reads).

    python benchmarks/vae_memory.py                    # 480p / 720p x 81 / 121 frames, chunks 1 / 2 / 4
    python benchmarks/vae_memory.py --sizes 720p --frames 81 --chunks 1   # one row
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import set_host_devices  # noqa: E402

set_host_devices(8)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from vidax_eqx.models import WanVAE, WanVAEConfig  # noqa: E402
from vidax_eqx.models.internal import vae_program  # noqa: E402

SIZES = {"480p": (480, 832), "720p": (720, 1280)}
GiB = 2 ** 30


def _walk(jaxpr, in_scan: bool, tally: dict) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        inner = name == "scan" or in_scan
        if in_scan:
            nbytes = lambda v: int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize  # noqa: E731
            if name in ("ppermute", "all_gather"):
                tally[name] += sum(nbytes(v) for v in eqn.invars)
            elif name == "conv_general_dilated":
                tally["conv_in"] += nbytes(eqn.invars[0])
        for value in eqn.params.values():
            for sub in (value if isinstance(value, (list, tuple)) else [value]):
                if hasattr(sub, "eqns"):
                    _walk(sub, inner, tally)
                elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                    _walk(sub.jaxpr, inner, tally)


def measure(vae, which: str, x, chunk: int, mesh):
    fn, args = vae_program(vae, which, x, chunk, mesh=mesh, spatial_axes=("h", "w") if mesh else None)
    t = time.perf_counter()
    compiled = fn.lower(*args).compile()
    seconds = time.perf_counter() - t
    m = compiled.memory_analysis()
    row = dict(temp=m.temp_size_in_bytes, args=m.argument_size_in_bytes, out=m.output_size_in_bytes,
               compile_s=seconds)
    if mesh is not None:
        tally = {"ppermute": 0, "all_gather": 0, "conv_in": 0}
        _walk(fn.trace(*args).jaxpr.jaxpr, False, tally)
        row.update(tally)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--frames", nargs="+", type=int, default=[81, 121])
    parser.add_argument("--chunks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--ops", nargs="+", default=["decode", "encode"], choices=["decode", "encode"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--wan22", action="store_true", help="Wan 2.2's VAE (TI2V-5B) instead of 2.1's")
    args = parser.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    config = WanVAEConfig.wan22() if args.wan22 else WanVAEConfig.wan21()
    vae = eqx.filter_eval_shape(WanVAE, config, dtype=dtype, key=jax.random.key(0))
    mesh = jax.make_mesh((2, 4), ("h", "w"))
    s, tf = config.spatial_factor, config.temporal_factor
    print(f"# Wan VAE ({'2.2' if args.wan22 else '2.1'}) memory, {args.dtype}, jax {jax.__version__}, "
          f"CPU backend, 8 simulated devices, mesh (h=2, w=4)")
    print("| op | size | frames | chunk | one device temp | 8 devices temp / device | ratio "
          "| halo sent / chunk | K,V gathered / chunk | conv inputs / chunk |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for op in args.ops:
        for size in args.sizes:
            height, width = SIZES[size]
            for frames in args.frames:
                latent_frames = 1 + (frames - 1) // tf
                if op == "decode":
                    shape = (config.z_dim, latent_frames, height // s, width // s)
                else:
                    shape = (config.video_channels, frames, height, width)
                for chunk in args.chunks:
                    x = jax.ShapeDtypeStruct(shape, dtype)
                    one = measure(vae, op, x, chunk, None)
                    xs = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(None, None, "h", "w")))
                    split = measure(vae, op, xs, chunk, mesh)
                    print(f"| {op} | {size} | {frames} | {chunk} | {one['temp'] / GiB:.2f} GiB "
                          f"| {split['temp'] / GiB:.2f} GiB | {one['temp'] / split['temp']:.1f}x "
                          f"| {split['ppermute'] / 2**20:.1f} MiB | {split['all_gather'] / 2**20:.1f} MiB "
                          f"| {split['conv_in'] / 2**20:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
