"""One denoising step of a Wan 2.1 transformer from a checkpoint, on 8 devices and on 1.

    python examples/wan_denoise.py                                # a tiny random Wan
    python examples/wan_denoise.py --checkpoint tests/fixtures/wan/t2v/diffusers
    python examples/wan_denoise.py --checkpoint /path/to/Wan2.1-T2V-1.3B-Diffusers/transformer \
        --latents 16 3 30 52 --modes ring

The model is `vidax_eqx.models.WanTransformer3D.from_pretrained(path)`: a diffusers
`WanTransformer3DModel` directory or an original Wan 2.1 release (config.json and
safetensors, one file or shards). Without `--checkpoint`, a tiny Wan with random
weights is saved to a temporary directory in diffusers' layout and loaded from there.

The step is Wan's flow matching sampler, one Euler step: the model predicts the
velocity `v` of the noisy latents at noise level `sigma` (timestep `1000 * sigma`) and
`x <- x + (sigma_next - sigma) * v`. It runs once on one device and then with
`models.run_sharded` on 8 simulated CPU devices in each `--modes` configuration
(sequence parallelism x tensor parallelism, weights placed by `nn.sharding.partition_specs`,
the batch over a data-parallel axis where the mode says so); every result is compared
with the single-device one. Exits non-zero if a difference exceeds `--tol`.
"""

import argparse
import os
import sys
import tempfile
import time


# 8 simulated CPU devices; XLA reads this when JAX initializes its backend.
_FLAG = "--xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if not f.startswith("--xla_force_host_platform_device_count")] + [_FLAG]
)

# Run against this checkout's vidax_eqx when it is not installed.
try:
    import vidax_eqx  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from vidax_eqx import models, nn, parallel


# mode -> (mesh axes, ParallelConfig fields, data-parallel axis)
MODES = {
    "ulysses": (dict(sp=4, tp=2), dict(sequence="ulysses", tp_axis="tp"), None),
    "ring": (dict(sp=4, tp=2), dict(sequence="ring", layout="zigzag", tp_axis="tp"), None),
    "usp": (dict(sp=2, tp=2, extra_axes={"ring": 2}),
            dict(sequence="usp", ring_axis="ring", tp_axis="tp"), None),
    "dp": (dict(dp=2, sp=2, tp=2), dict(sequence="ulysses", tp_axis="tp"), "dp"),
}
TINY = models.WanConfig(dim=128, ffn_dim=256, num_heads=8, num_layers=2, in_channels=16,
                        out_channels=16, text_dim=64, freq_dim=256)


def euler_step(velocity, x, sigma, sigma_next):
    """`x + (sigma_next - sigma) * v`, per example (`sigma` of shape `(B,)`)."""
    return x + (sigma_next - sigma)[:, None, None, None, None] * velocity


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="a diffusers or Wan 2.1 transformer directory "
                                        "(default: a tiny random Wan)")
    p.add_argument("--latents", type=int, nargs=4, default=(16, 3, 12, 20),
                   metavar=("C", "F", "H", "W"), help="latent shape (default 16 3 12 20)")
    p.add_argument("--text-len", type=int, default=12, help="text tokens (default 12)")
    p.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    p.add_argument("--sigma", type=float, default=0.8, help="noise level (default 0.8)")
    p.add_argument("--sigma-next", type=float, default=0.7, help="next level (default 0.7)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                   help="sharded configurations (default: all)")
    p.add_argument("--tol", type=float, default=1e-4,
                   help="largest max|sharded - single| / max(max|single|, 1) (default 1e-4)")
    args = p.parse_args(argv)
    if len(jax.devices()) < 8:
        print(f"needs 8 devices, found {len(jax.devices())} (was JAX imported before "
              "XLA_FLAGS was set?)", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint
        if path is None:
            path = tmp
            random = models.WanTransformer3D(TINY, key=jax.random.PRNGKey(0))
            random.save_pretrained(path)  # diffusers layout: config.json + safetensors
        try:
            model = models.WanTransformer3D.from_pretrained(path)
        except ValueError as error:  # missing / mis-shaped tensors, a bad config: all named
            print(error, file=sys.stderr)
            return 2
    c = model.config
    n_params = sum(a.size for a in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    latents = tuple(args.latents)
    grid = (latents[1] // c.patch_size[0], latents[2] // c.patch_size[1],
            latents[3] // c.patch_size[2])
    print(f"Wan 2.1: dim={c.dim}, heads={c.num_heads}, layers={c.num_layers}, "
          f"{n_params:,} parameters from {args.checkpoint or 'a tiny random checkpoint'}")
    print(f"latents: batch {args.batch} x {latents} -> {int(np.prod(grid)):,} tokens, "
          f"text {args.text_len} x {c.text_dim}")

    kx, kc = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (args.batch, *latents), model.patch_embedding.weight.dtype)
    context = jax.random.normal(kc, (args.batch, args.text_len, c.text_dim))
    sigma = jnp.full((args.batch,), args.sigma)
    sigma_next = jnp.full((args.batch,), args.sigma_next)

    @eqx.filter_jit
    def single(model, x, context):
        v = jax.vmap(model)(x, 1000 * sigma, context)
        return euler_step(v, x, sigma, sigma_next)

    t0 = time.perf_counter()
    ref = jax.block_until_ready(single(model, x, context))
    scale = float(jnp.max(jnp.abs(ref)))
    print(f"  {'1 device':<40} {time.perf_counter() - t0:6.1f} s (incl. compile)  "
          f"max|x_next| = {scale:.3g}")

    failed = False
    for mode in args.modes:
        mesh_axes, config, batch_axis = MODES[mode]
        mesh = parallel.make_mesh(**mesh_axes)
        sharded = nn.sharding.shard_module(nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(**config)), mesh)

        @eqx.filter_jit
        def step(model, x, context):
            v = models.run_sharded(model, x, 1000 * sigma, context, mesh=mesh,
                                   batch_axis=batch_axis)
            return euler_step(v, x, sigma, sigma_next)

        t0 = time.perf_counter()
        out = jax.block_until_ready(step(sharded, x, context))
        diff = float(jnp.max(jnp.abs(out - ref)))
        ok = diff <= args.tol * max(scale, 1.0)
        failed |= not ok
        label = f"{mode}: {dict(mesh.shape)}"
        print(f"  {label:<40} {time.perf_counter() - t0:6.1f} s (incl. compile)  "
              f"max|diff| = {diff:.2e}  {'ok' if ok else 'FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
