"""UMT5-XXL's memory per device at real size: one device against 8 devices split by
tensor parallelism, FSDP, or both; bfloat16 and float32, a batch of 1 and 2 texts of 512
tokens.

The encoder (Wan 2.1's and 2.2's text encoder, `T5EncoderConfig()`: d_model 4096, d_ff
10240, 64 heads, 24 layers, vocabulary 256384, 5.7B parameters) is built abstractly
(`eqx.filter_eval_shape`: no weight allocated), the token ids and mask are
`jax.ShapeDtypeStruct`s, and `T5Encoder.encode` is lowered and compiled ahead of time on
this machine's CPU backend with 8 simulated devices
(`--xla_force_host_platform_device_count=8`):

- **one device**: `model.encode(ids, mask)`;
- **8 devices**: `model.encode(ids, mask, mesh=mesh, batch_axis=...)`, the weights placed
  by `nn.sharding.partition_specs(model, mesh)` (arguments whose sharding says so):
  - `tp=8`: `ParallelConfig(tp_axis="tp")` on a mesh `(tp=8)`: Megatron heads and
    hidden units, the token table split over its rows (the vocabulary);
  - `fsdp=8`: `ParallelConfig(fsdp_axes=("sp",))` on `(sp=8)`: every parameter split,
    each layer's gathered inside the scan; the batch on every device;
  - `tp=2 x fsdp=4`: `ParallelConfig(tp_axis="tp", fsdp_axes=("sp",))` on `(sp=4,
    tp=2)`; and, for a batch of 2, `fsdp_axes=("dp", "sp")` on `(dp=2, sp=2, tp=2)`
    with the batch split over `dp` (`batch=dp`).

Reported per program, from `compiled.memory_analysis()` (one device's figures: every
device runs the same SPMD program): `args` (the weights, and the ids and mask), `temp`
(everything XLA allocates beyond arguments and outputs: activations, gathered weights,
the scan's buffers), `out`, their total, and the one-device total over it. The CPU
backend's attention is `implementation="auto"`'s choice for CPU; an accelerator's
kernels change `temp`, not `args`.

    python benchmarks/text_encoder_memory.py                       # the whole table
    python benchmarks/text_encoder_memory.py --dtypes bfloat16 --batches 1
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
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from vidax_eqx import parallel  # noqa: E402
from vidax_eqx.models import T5Encoder, T5EncoderConfig  # noqa: E402
from vidax_eqx.nn import sharding  # noqa: E402

GiB = 2 ** 30
# name -> (mesh sizes, ParallelConfig, batch_axis, batch sizes it applies to); None: one device.
LAYOUTS = {
    "one device": (None, sharding.ParallelConfig(), None, None),
    "tp=8": (dict(tp=8), sharding.ParallelConfig(tp_axis="tp"), None, None),
    "fsdp=8": (dict(sp=8), sharding.ParallelConfig(fsdp_axes=("sp",)), None, None),
    "tp=2 x fsdp=4": (dict(sp=4, tp=2), sharding.ParallelConfig(tp_axis="tp", fsdp_axes=("sp",)),
                      None, None),
    "tp=2 x fsdp=4, batch=dp": (dict(dp=2, sp=2, tp=2),
                                sharding.ParallelConfig(tp_axis="tp", fsdp_axes=("dp", "sp")),
                                "dp", (2,)),
}


def measure(config, dtype, layout: str, batch: int, seq: int) -> dict:
    sizes, par, batch_axis, _ = LAYOUTS[layout]
    model = eqx.filter_eval_shape(T5Encoder, config, dtype=dtype, parallel=par,
                                  key=jax.random.key(0))
    arrays, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    if sizes is None:
        mesh, kwargs = None, {}
        ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    else:
        mesh = parallel.make_mesh(**sizes)
        kwargs = dict(mesh=mesh, batch_axis=batch_axis)
        specs = sharding.partition_specs(model, mesh)
        arrays = jax.tree.map(
            lambda s, x: x if s is None else jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
            specs, arrays, is_leaf=lambda s: s is None or isinstance(s, P))
        ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32,
                                   sharding=NamedSharding(mesh, P(batch_axis)))
    mask = jax.ShapeDtypeStruct(ids.shape, jnp.bool_, sharding=ids.sharding)

    def encode(arrays, ids, mask):
        return eqx.combine(arrays, static).encode(ids, mask, **kwargs)

    t = time.perf_counter()
    compiled = jax.jit(encode).lower(arrays, ids, mask).compile()
    m = compiled.memory_analysis()
    return dict(args=m.argument_size_in_bytes, temp=m.temp_size_in_bytes,
                out=m.output_size_in_bytes, compile_s=time.perf_counter() - t)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                        choices=["bfloat16", "float32"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args(argv)
    config = T5EncoderConfig()
    print(f"# UMT5-XXL text encoder memory per device, sequence {args.seq}, jax {jax.__version__}, "
          f"CPU backend, 8 simulated devices")
    print("| dtype | layout | batch | weights (args) / device | temp / device | total / device "
          "| one device / this: weights | total | compile |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.dtypes:
        dtype = jnp.dtype(name)
        for batch in args.batches:
            one = one_args = None
            for layout in args.layouts:
                only = LAYOUTS[layout][3]
                if only is not None and batch not in only:
                    continue
                row = measure(config, dtype, layout, batch, args.seq)
                total = row["args"] + row["temp"] + row["out"]
                if layout == "one device":
                    one, one_args = total, row["args"]
                ratios = (f"{one_args / row['args']:.2f}x | {one / total:.2f}x" if one
                          else "– | –")
                print(f"| {name} | {layout} | {batch} | {row['args'] / GiB:.2f} GiB "
                      f"| {row['temp'] / GiB:.2f} GiB | {total / GiB:.2f} GiB | {ratios} "
                      f"| {row['compile_s']:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
