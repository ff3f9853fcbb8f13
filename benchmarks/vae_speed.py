"""The Wan VAE's speed on this machine, as ratios measured in one run: time chunk sizes
against each other, and the frames split over 8 simulated devices against one device.

Wan 2.1's VAE at its real width (`WanVAEConfig.wan21()`, random weights) decodes latents
`(16, T, h, w)` and encodes the matching video, each variant compiled once and then timed
in interleaved rounds (`_harness.interleaved`: the order shuffled every round), reported
as the median over rounds of its time divided by one device's with `chunk=1` in the same
round. On a CPU the 8 simulated devices share the machine's cores, so the split's ratio
measures its overhead (halo exchanges, smaller convolutions), not a speed-up; on an
accelerator per device each device does 1/8 of the work.

    python benchmarks/vae_speed.py                        # latents 16 x 5 x 16 x 16 (video 17 x 128 x 128)
    python benchmarks/vae_speed.py --latent-size 8 8 --rounds 3
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import interleaved, paired_ratio, set_host_devices  # noqa: E402

set_host_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from vidax_eqx.models import WanVAE, WanVAEConfig  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latent-frames", type=int, default=5)
    parser.add_argument("--latent-size", type=int, nargs=2, default=(16, 16))
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    config = WanVAEConfig.wan21()
    vae = WanVAE(config, key=jax.random.key(0))
    h, w = args.latent_size
    z = jax.random.normal(jax.random.key(1), (config.z_dim, args.latent_frames, h, w))
    video = jax.random.uniform(jax.random.key(2), (3, 1 + 4 * (args.latent_frames - 1), 8 * h, 8 * w),
                               minval=-1, maxval=1)
    mesh = jax.make_mesh((2, 4), ("h", "w"))
    split = dict(mesh=mesh, spatial_axes=("h", "w"))
    print(f"# Wan 2.1 VAE speed, jax {jax.__version__}, {jax.devices()[0].platform}, latents "
          f"{tuple(z.shape)}, video {tuple(video.shape)}, {args.rounds} rounds; time / (one device, chunk 1)")
    print("| op | variant | ratio (median) | min | max |")
    print("|---|---|---|---|---|")
    for op, x, call in (("decode", z, WanVAE.decode), ("encode", video, lambda v, x, **k: v.encode(x, **k).mean)):
        runs = {f"one device, chunk {c}": (lambda c=c: jax.block_until_ready(call(vae, x, chunk=c)))
                for c in args.chunks}
        runs.update({f"8 devices (2 x 4), chunk {c}": (lambda c=c: jax.block_until_ready(call(vae, x, chunk=c, **split)))
                     for c in args.chunks})
        timings = interleaved(runs, args.rounds)
        base = timings[f"one device, chunk {args.chunks[0]}"]
        for name, timing in timings.items():
            median, low, high = paired_ratio(timing, base)
            print(f"| {op} | {name} | {median:.2f} | {low:.2f} | {high:.2f} |", flush=True)


if __name__ == "__main__":
    main()
