"""UMT5-XXL on this machine's default device: building (or loading) it in bfloat16, and
encoding a batch of texts; the times and the device's peak memory, in one process.

The encoder (Wan 2.1's and 2.2's text encoder, `T5EncoderConfig()`: 5.7B parameters,
10.6 GiB in bfloat16) is built with random weights
(`T5Encoder(T5EncoderConfig(), dtype=bfloat16, key=...)`, drawn leaf by leaf in bounded
memory: `models/t5/_init.py`) or loaded with `--checkpoint` (`T5Encoder.from_pretrained`,
a transformers checkpoint folder, e.g. a Wan pipeline's `text_encoder/`). Then
`encode(ids, mask)` of `--batch` x `--seq` random tokens under `eqx.filter_jit`: its
compile time (`lower().compile()`, JAX's persistent compilation cache off), the first run
and the median of `--rounds` more. Printed after each stage: the device's memory in use
and its peak (TPU, GPU: `memory_stats()`; on a CPU the process's peak RSS, `VmHWM`).
`--scale N` divides every width and the vocabulary by N (a quick run on a CPU).

    python benchmarks/text_encoder_device.py                       # UMT5-XXL, 2 x 512 tokens
    python benchmarks/text_encoder_device.py --scale 8 --layers 4  # a small copy, on a CPU
    python benchmarks/text_encoder_device.py --checkpoint /path/to/text_encoder
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import peak_rss  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from vidax_eqx.models import T5Encoder, T5EncoderConfig  # noqa: E402

GiB = 2 ** 30


def memory() -> str:
    stats = jax.local_devices()[0].memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        limit = stats.get("bytes_limit")
        return (f"device in use {stats.get('bytes_in_use', 0) / GiB:.2f} GiB, peak "
                f"{stats['peak_bytes_in_use'] / GiB:.2f} GiB"
                + (f" of {limit / GiB:.2f} GiB" if limit else ""))
    return f"process peak RSS {peak_rss() / GiB:.2f} GiB"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="a transformers checkpoint folder (default: random weights)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--scale", type=int, default=1, help="divide the widths and vocabulary by this")
    parser.add_argument("--layers", type=int, default=None, help="layers (default UMT5-XXL's 24)")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    dtype = jnp.dtype(args.dtype)
    device = jax.devices()[0]
    print(f"# UMT5-XXL text encoder on {device.platform} ({device.device_kind}), jax "
          f"{jax.__version__}, {args.dtype}, batch {args.batch} x {args.seq} tokens")
    print(f"start: {memory()}", flush=True)
    t = time.perf_counter()
    if args.checkpoint:
        model = T5Encoder.from_pretrained(args.checkpoint, dtype=dtype)
        what = f"loaded {args.checkpoint}"
    else:
        s, d = args.scale, T5EncoderConfig()
        config = T5EncoderConfig(d_model=d.d_model // s, d_kv=d.d_kv // s, d_ff=d.d_ff // s,
                                 vocab_size=d.vocab_size // s,
                                 num_layers=args.layers or d.num_layers)
        model = T5Encoder(config, dtype=dtype, key=jax.random.key(0))
        what = "built (random weights)"
    jax.block_until_ready(model)
    build_s = time.perf_counter() - t
    weights = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    print(f"{what} in {build_s:.1f} s: {weights / GiB:.2f} GiB of weights; {memory()}", flush=True)

    c = model.config
    ids = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, c.vocab_size)
    lengths = jnp.array([args.seq, args.seq // 3] * args.batch)[:args.batch]
    mask = jnp.arange(args.seq)[None, :] < lengths[:, None]
    encode = eqx.filter_jit(lambda m, ids, mask: m.encode(ids, mask))
    t = time.perf_counter()
    compiled = encode.lower(model, ids, mask).compile()
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    out = jax.block_until_ready(compiled(model, ids, mask))
    first_s = time.perf_counter() - t
    times = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        jax.block_until_ready(compiled(model, ids, mask))
        times.append(time.perf_counter() - t)
    print(f"encode {tuple(out.shape)} {out.dtype}: compile {compile_s:.1f} s, first run "
          f"{first_s:.3f} s, steady {statistics.median(times):.3f} s (median of {args.rounds}); "
          f"{memory()}", flush=True)


if __name__ == "__main__":
    main()
