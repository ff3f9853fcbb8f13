"""A Wan 2.1 DiT block on 8 devices (sequence parallel x tensor parallel), checked against 1 device.

The block is Wan's `WanAttentionBlock`, built from vidax_eqx modules:

    e = modulation + time_projection(time_embedding(t))        # adaLN, float32, (6, dim)
    x = x + self_attn(norm1(x) * (1 + e[1]) + e[0], rope) * e[2]
    x = x + cross_attn(norm3(x), text)
    x = x + ffn(norm2(x) * (1 + e[4]) + e[3]) * e[5]

with `self_attn` an `nn.Attention` (q/k RMSNorm, Wan's 3D RoPE from
`nn.functional.rope_3d` over a (frames, height, width) token grid),
`cross_attn` an `nn.CrossAttention` over the text tokens, and `ffn` an
`nn.FeedForward` (tanh-GELU). Its fields carry Wan's parameter names,
so the weights load from a Wan checkpoint with
`interop.load_state_dict(block, path, prefix="blocks.0.")`. Here, unless
`--weights` names a real file, they come from a synthetic checkpoint in Wan's
naming written to a temporary `.safetensors` file and loaded into a block
built abstractly (`eqx.filter_eval_shape`: no random initialization).

The same block then runs on 8 simulated CPU devices as sp=4 x tp=2: the video
tokens split over "sp" (Ulysses all_to_all, or ring attention), the heads and
the MLP's hidden features split over "tp" (Megatron: column-parallel then
row-parallel, one psum each), the weights placed by `nn.sharding.partition_specs`.
Each mode is compared with the single-device result.

    python examples/wan_block.py
    python examples/wan_block.py --grid 8 16 16 --modes ulysses ring usp
    python examples/wan_block.py --weights wan2.1_t2v_1.3B.safetensors \
        --dim 1536 --heads 12 --ffn-dim 8960

Prints the largest difference and the time of each mode; exits non-zero if a
difference exceeds `--tol`.
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
from jax.sharding import PartitionSpec as P

from vidax_eqx import interop, nn, parallel


# -- the model pieces ----------------------------------------------------------------------


class TimeEmbedding(eqx.Module):
    """Wan's timestep path: sinusoid -> `time_embedding` -> `time_projection`, in float32.

    Field names are Wan's (`time_embedding.0`, `time_embedding.2`,
    `time_projection.1`), so they load from the same checkpoint as the blocks.
    """

    time_embedding: eqx.nn.Sequential
    time_projection: eqx.nn.Sequential
    freq_dim: int = eqx.field(static=True)
    dim: int = eqx.field(static=True)

    def __init__(self, dim: int, freq_dim: int = 256, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.time_embedding = eqx.nn.Sequential([
            eqx.nn.Linear(freq_dim, dim, key=k1),
            eqx.nn.Lambda(jax.nn.silu),
            eqx.nn.Linear(dim, dim, key=k2),
        ])
        self.time_projection = eqx.nn.Sequential([
            eqx.nn.Lambda(jax.nn.silu),
            eqx.nn.Linear(dim, 6 * dim, key=k3),
        ])
        self.freq_dim, self.dim = freq_dim, dim

    def __call__(self, t):
        """`t`: a scalar timestep. Returns the block's modulation input `(6, dim)`, float32."""
        half = self.freq_dim // 2
        freqs = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
        sinusoid = jnp.asarray(t, jnp.float32) * freqs
        emb = jnp.concatenate([jnp.cos(sinusoid), jnp.sin(sinusoid)])
        return self.time_projection(self.time_embedding(emb)).reshape(6, self.dim)


class WanBlock(eqx.Module):
    """Wan 2.1's `WanAttentionBlock` (text-to-video), one example per call.

    Fields are named as in Wan's reference (`norm1`, `self_attn`, `norm3`,
    `cross_attn`, `norm2`, `ffn.0`, `ffn.2`, `modulation`). The attention
    modules' `parallel` configuration decides how the block runs: with a
    tensor-parallel axis the MLP is split over it too (`ffn.0` column-parallel,
    `ffn.2` row-parallel, placed by `nn.sharding.partition_specs`).
    """

    norm1: nn.LayerNorm
    self_attn: nn.Attention
    norm3: nn.LayerNorm
    cross_attn: nn.CrossAttention
    norm2: nn.LayerNorm
    ffn: nn.FeedForward
    modulation: jax.Array

    def __init__(self, dim, ffn_dim, num_heads, *, eps=1e-6, parallel=nn.sharding.ParallelConfig(), key):
        k1, k2, k3, k5 = jax.random.split(key, 4)
        self.norm1 = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.self_attn = nn.Attention(dim, num_heads, eps=eps, parallel=parallel, key=k1)
        self.norm3 = nn.LayerNorm(dim, eps)  # Wan 2.1: cross_attn_norm=True
        self.cross_attn = nn.CrossAttention(dim, num_heads, eps=eps, parallel=parallel, key=k2)
        self.norm2 = nn.LayerNorm(dim, eps, elementwise_affine=False)
        # ffn.0 -> tanh-GELU -> ffn.2; with a tp_axis, column- then row-parallel.
        self.ffn = nn.FeedForward(dim, ffn_dim, activation="gelu_tanh", parallel=parallel, key=k3)
        self.modulation = jax.random.normal(k5, (1, 6, dim), jnp.float32) / dim**0.5

    def __call__(self, x, e, context, rope):
        """`x (S, dim)` video tokens (this device's under SP), `e (6, dim)` float32 from
        `TimeEmbedding`, `context (T, dim)` text tokens, `rope` the `(cos, sin)` of `x`'s tokens."""
        with jax.named_scope("WanBlock"):
            e = (self.modulation[0] + e).astype(jnp.float32)  # Wan: autocast(float32)
            shift1, scale1, gate1, shift2, scale2, gate2 = e
            h = self.norm1(x).astype(jnp.float32) * (1 + scale1) + shift1
            x = x + self.self_attn(h.astype(x.dtype), rope=rope) * gate1
            x = x + self.cross_attn(self.norm3(x), context)
            h = self.norm2(x).astype(jnp.float32) * (1 + scale2) + shift2
            return x + self.ffn(h.astype(x.dtype)) * gate2


# -- weights ---------------------------------------------------------------------------


def synthetic_checkpoint(path, dim, ffn_dim, num_heads, freq_dim):
    """A Wan-named checkpoint with random weights (norm scales away from 1, too).

    The names come from the modules themselves, built abstractly and filled with
    NumPy zeros; the values are drawn with NumPy (no JAX compilation).
    """

    def zeros(module):
        return jax.tree.map(
            lambda s: np.zeros(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s,
            module, is_leaf=lambda s: isinstance(s, jax.ShapeDtypeStruct),
        )

    block = eqx.filter_eval_shape(WanBlock, dim, ffn_dim, num_heads, key=jax.random.PRNGKey(0))
    temb = eqx.filter_eval_shape(TimeEmbedding, dim, freq_dim, key=jax.random.PRNGKey(0))
    names = {**interop.state_dict(zeros(temb)), **interop.state_dict(zeros(block), prefix="blocks.0.")}
    rng = np.random.default_rng(1)
    tensors = {}
    for name, value in names.items():
        noise = rng.standard_normal(value.shape).astype(np.float32)
        if "norm" in name and name.endswith(".weight"):
            tensors[name] = 1 + 0.1 * noise  # RMSNorm / LayerNorm scales
        elif name.endswith("modulation"):
            tensors[name] = noise / dim**0.5  # Wan's initialization
        elif value.ndim == 2:
            tensors[name] = noise / value.shape[1] ** 0.5  # Linear (out, in)
        else:
            tensors[name] = 0.1 * noise  # biases, norm shifts
    interop.save_safetensors(tensors, path, metadata={"note": "synthetic, examples/wan_block.py"})


def load_weights(path, prefix, dim, ffn_dim, num_heads, freq_dim):
    """The block and time embedding, built abstractly and filled from `path`."""
    f = interop.open_safetensors(path)
    block = eqx.filter_eval_shape(WanBlock, dim, ffn_dim, num_heads, key=jax.random.PRNGKey(0))
    block = interop.load_state_dict(block, f, prefix=prefix)
    temb = eqx.filter_eval_shape(TimeEmbedding, dim, freq_dim, key=jax.random.PRNGKey(0))
    time_keys = {k: f[k] for k in f if k.startswith(("time_embedding.", "time_projection."))}
    temb = interop.load_state_dict(temb, time_keys)
    return block, temb


# -- running -----------------------------------------------------------------------------


def timed(fn, *args, repeats):
    """(result, seconds to compile and run once, median seconds of `repeats` further runs)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return out, first, float(np.median(times))


def sharded_forward(block, mode, sp, tp):
    """`jit(shard_map(block))` over an sp x tp mesh, with the sequence split over "sp"."""
    if mode == "usp":  # Ulysses over "sp", a ring over "ring"
        sp_u, ring = 2, sp // 2
        mesh = parallel.make_mesh(sp=sp_u, tp=tp, extra_axes={"ring": ring})
        config = nn.sharding.ParallelConfig(sequence="usp", ring_axis="ring", tp_axis="tp")
        seq = ("ring", "sp")
    else:
        mesh = parallel.make_mesh(sp=sp, tp=tp)
        config = nn.sharding.ParallelConfig(sequence=mode, tp_axis="tp")
        seq = "sp"
    block = nn.sharding.with_parallel(block, config)  # the same arrays, another ParallelConfig leaf
    specs = nn.sharding.partition_specs(block)  # Megatron attention and FFN

    def body(block, x, e, context, cos, sin):
        return jax.vmap(lambda x, e, c: block(x, e, c, (cos, sin)))(x, e, context)

    # Modules hold their ParallelConfig as a (non-array) leaf: Equinox's filtered
    # transformations, and `nn.sharding.filter_shard_map` for the shard_map, take them whole.
    run = eqx.filter_jit(nn.sharding.filter_shard_map(
        body,
        mesh=mesh,
        in_specs=(specs, P(None, seq), P(), P(), P(seq), P(seq)),
        out_specs=P(None, seq),
    ))
    return lambda x, e, context, cos, sin: run(block, x, e, context, cos, sin)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Runs on 8 simulated CPU devices (XLA_FLAGS is set by this script).",
    )
    p.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--ffn-dim", type=int, default=256, help="MLP hidden width (default 256)")
    p.add_argument("--freq-dim", type=int, default=256, help="timestep sinusoid width (default 256)")
    p.add_argument("--grid", type=int, nargs=3, default=(4, 8, 8), metavar=("F", "H", "W"),
                   help="video token grid, frames height width (default 4 8 8)")
    p.add_argument("--text-len", type=int, default=16, help="text tokens (default 16)")
    p.add_argument("--batch", type=int, default=2, help="batch size, by jax.vmap (default 2)")
    p.add_argument("--modes", nargs="+", default=["ulysses", "ring"],
                   choices=["ulysses", "ring", "usp"],
                   help="sequence-parallel modes to run at sp=4 x tp=2 (default ulysses ring)")
    p.add_argument("--weights", help="a Wan .safetensors checkpoint (default: synthetic weights)")
    p.add_argument("--prefix", default="blocks.0.", help="the block's key prefix (default blocks.0.)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per mode (default 3)")
    p.add_argument("--tol", type=float, default=1e-4,
                   help="largest allowed max|sharded - single|, relative to max(max|single|, 1) "
                        "(default 1e-4)")
    args = p.parse_args(argv)

    sp, tp = 4, 2
    if len(jax.devices()) < sp * tp:
        print(f"needs {sp * tp} devices, found {len(jax.devices())} (was JAX imported before "
              "XLA_FLAGS was set?)", file=sys.stderr)
        return 2
    dim, heads, ffn_dim = args.dim, args.heads, args.ffn_dim
    grid = tuple(args.grid)
    S, T, B = int(np.prod(grid)), args.text_len, args.batch
    if heads % (sp * tp) or S % sp or ffn_dim % tp:
        print(f"sp={sp} x tp={tp} needs heads % 8 == 0, frames*height*width % 4 == 0 and "
              f"ffn_dim % 2 == 0; received heads={heads}, tokens={S}, ffn_dim={ffn_dim}",
              file=sys.stderr)
        return 2

    if args.weights:
        try:
            block, temb = load_weights(args.weights, args.prefix, dim, ffn_dim, heads, args.freq_dim)
        except ValueError as error:  # missing / mis-shaped tensors, a malformed file: all named
            print(error, file=sys.stderr)
            return 2
        source = args.weights
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "wan_block.safetensors")
            synthetic_checkpoint(path, dim, ffn_dim, heads, args.freq_dim)
            block, temb = load_weights(path, "blocks.0.", dim, ffn_dim, heads, args.freq_dim)
        source = "synthetic weights (Wan names, via a .safetensors file)"
    n_params = sum(x.size for x in jax.tree.leaves(eqx.filter(block, eqx.is_array)))
    print(f"Wan block: dim={dim}, heads={heads}, ffn_dim={ffn_dim}, {n_params:,} parameters "
          f"from {source}")
    print(f"input: batch {B} x {S} video tokens (grid {grid[0]}x{grid[1]}x{grid[2]}) "
          f"+ {T} text tokens, float32, on {jax.default_backend()}")

    kx, kc = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (B, S, dim), jnp.float32)
    context = jax.random.normal(kc, (B, T, dim), jnp.float32)
    t = jnp.linspace(100.0, 900.0, B)
    e = jax.jit(jax.vmap(temb))(t)  # (B, 6, dim), float32
    cos, sin = nn.functional.rope_3d(grid, dim // heads)

    single = jax.jit(lambda x, e, c, cos, sin: jax.vmap(
        lambda x, e, c: block(x, e, c, (cos, sin)))(x, e, c))
    ref, first, steady = timed(single, x, e, context, cos, sin, repeats=args.repeats)
    scale = float(jnp.max(jnp.abs(ref)))
    print(f"  {'1 device':<22} {steady * 1e3:8.1f} ms/call  (first call incl. compile "
          f"{first:.1f} s)  max|out| = {scale:.3g}")

    failed = False
    for mode in args.modes:
        forward = sharded_forward(block, mode, sp, tp)
        out, first, steady = timed(forward, x, e, context, cos, sin, repeats=args.repeats)
        diff = float(jnp.max(jnp.abs(out - ref)))
        ok = diff <= args.tol * max(scale, 1.0)
        failed |= not ok
        label = f"sp=4 x tp=2, {mode}" if mode != "usp" else "sp=2x2(usp) x tp=2"
        print(f"  {label:<22} {steady * 1e3:8.1f} ms/call  (first call incl. compile "
              f"{first:.1f} s)  max|diff| = {diff:.2e}  {'ok' if ok else 'FAILED'}")
    print(f"tolerance: max|diff| <= {args.tol:g} * max(max|out|, 1)"
          + ("" if not failed else "; FAILED"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
