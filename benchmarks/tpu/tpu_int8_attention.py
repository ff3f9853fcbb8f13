"""int8 attention against bf16 attention on an accelerator, in one process.

    python benchmarks/tpu/tpu_int8_attention.py --out DIR          # Wan 2.1 1.3B, 480p x 81
    python benchmarks/tpu/tpu_int8_attention.py --smoke --out DIR  # tiny, anywhere (interpret)

The forward of `kernels.attention` at Wan 2.1 1.3B's self-attention at 480p x 81 (one
sequence of 32,760 tokens, 12 heads of 128, bf16), compiled once per configuration and
timed (best of 5): `"pallas_tpu"` in bf16 (JAX's splash kernel at the chip's tuned
tiles) against `quantize="int8-qk"` and `quantize="int8"` at several `int8_blocks`;
each int8 output's cosine and relative L2 against float32 attention (the same kernel on
the same bf16 inputs in float32), on random inputs and on keys with a large per-channel offset.
"""

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from _harness import best_time, write_json  # noqa: E402
from vidax_eqx import kernels  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32


def seconds(fn, *args) -> float:
    """The best of 5 calls after a warm-up."""
    return best_time(lambda: jax.block_until_ready(fn(*args)), 5).best


def errors(a, b) -> dict:
    a, b = a.astype(F32).ravel(), b.astype(F32).ravel()
    return dict(rel_l2=float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)),
                cosine=float(jnp.vdot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32760)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--blocks", default="1024x512,512x512,1024x1024,2048x512",
                        help="int8_blocks to try, block_q x block_kv")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=".", metavar="DIR")
    args = parser.parse_args()
    S, H = (512, 2) if args.smoke else (args.tokens, args.heads)
    interpret = args.smoke
    report = dict(date=datetime.date.today().isoformat(), jax=jax.__version__,
                  device=jax.devices()[0].device_kind, tokens=S, heads=H, head_dim=128, rows=[])
    print(report, flush=True)
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (1, S, H, 128)
    q, k, v = (jax.random.normal(key, shape, F32) for key in keys[:3])
    offset = 8.0 * jax.random.normal(keys[3], (1, 1, H, 128), F32)
    bf16 = kernels.PallasTpu(interpret=interpret)

    def run(impl, quantize=None):
        return jax.jit(lambda q, k, v: kernels.attention(q, k, v, quantize=quantize, implementation=impl))

    inputs = {"random": (q, k, v), "k_offset": (q, k + offset, v)}
    # float32 attention of the bf16 inputs the int8 kernels take
    reference = {name: run(bf16)(*(a.astype(BF16).astype(F32) for a in x)) for name, x in inputs.items()}
    bf16_s = seconds(run(bf16), *(a.astype(BF16) for a in inputs["random"]))
    report["bf16_s"] = bf16_s
    print(f"bf16 {bf16_s * 1e3:.1f} ms", flush=True)
    for blocks in args.blocks.split(","):
        bq, bk = (int(n) for n in blocks.split("x"))
        if args.smoke:
            bq, bk = min(bq, 256), min(bk, 256)
        impl = kernels.PallasTpu(interpret=interpret, int8_blocks=(bq, bk))
        for mode in ("int8-qk", "int8"):
            row = dict(mode=mode, block_q=bq, block_kv=bk)
            try:
                fn = run(impl, mode)
                row["s"] = seconds(fn, *(a.astype(BF16) for a in inputs["random"]))
                row["of_bf16"] = row["s"] / bf16_s
                for name, x in inputs.items():
                    row[name] = errors(fn(*(a.astype(BF16) for a in x)), reference[name])
            except Exception as error:  # noqa: BLE001  (a configuration that fails is reported)
                row["error"] = repr(error)[:400]
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
            os.makedirs(args.out, exist_ok=True)
            write_json(os.path.join(args.out, "tpu_int8_attention.json"), report)


if __name__ == "__main__":
    sys.exit(main())
