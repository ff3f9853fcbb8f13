"""What the video VAEs share: the posterior, time in chunks through a `lax.scan` carrying
the causal caches, the frame split over a mesh, and diffusers' tiled mode.

A video VAE here is causal in time: a latent frame depends on the video frames up to its
own, never later ones. So a video runs in chunks, each step carrying the caches its
causal convolutions read (an explicit pytree); zero frames padded at the end to fill the
last chunk change no earlier output, and their outputs are cut off.

These VAEs treat the first frame (or first latent frame) apart. CogVideoX's runs it as a
first chunk of its own before the scan (`run_chunked`). Wan's runs every chunk,
the first included, through ONE scan body (`run_scanned`): the first chunk is the
video after a few zero frames that line its first frame up with the others, and the
layers that treat it apart do so by data (a `FirstChunk` flag and selects), so the
program holds the model once whatever the chunk size.

Space is split over two mesh axes inside `shard_map` (a
[`vidax_eqx.parallel.SpatialSplit`][]): each device holds one block of every frame, its
convolutions borrow their neighbours' edge rows, and the result is the whole frame's.

On a TPU the VAEs' programs compile at a lower XLA optimization effort (`vae_jit`):
their many large convolutions are where a cold start's compile time goes.
"""

import functools
import json
import os
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float

from .. import _jax_private, interop
from .._checks import is_int
from .._vma import as_varying, varying_axes
from ..nn.sharding import filter_shard_map
from ..parallel import SpatialSplit


class GaussianPosterior(eqx.Module):
    """The encoder's diagonal Gaussian over the latents (diffusers'
    `DiagonalGaussianDistribution`): `mean` and `logvar` (clipped to [-30, 20]), each
    `(z_dim, F_latent, h, w)`."""

    mean: Float[Array, "z T h w"]
    logvar: Float[Array, "z T h w"]

    @property
    def std(self) -> Float[Array, "z T h w"]:
        """`exp(logvar / 2)`."""
        return jnp.exp(0.5 * self.logvar)

    def mode(self) -> Float[Array, "z T h w"]:
        """The most likely latents: `mean`."""
        return self.mean

    def sample(self, key) -> Float[Array, "z T h w"]:
        """`mean + std * N(0, 1)` drawn with `key`."""
        noise = jax.random.normal(key, self.mean.shape, jnp.float32).astype(self.mean.dtype)
        return self.mean + self.std * noise


def posterior(moments: Float[Array, "z2 T h w"]) -> GaussianPosterior:
    """The posterior of the encoder's `2 * z_dim` output channels (mean, then log-variance)."""
    mean, logvar = jnp.split(moments, 2, axis=0)
    return GaussianPosterior(mean, jnp.clip(logvar, -30.0, 20.0))


Step = Callable[[jax.Array, object, bool], tuple[jax.Array, object]]


def cache_at(cache, i):
    """Entry `i` of a block's cache tuple; `None` before the first chunk (no cache yet)."""
    return None if cache is None else cache[i]


def run_layers(layers, x, cache, **kwargs):
    """`x` through `layers` in order, each `layer(x, cache_i, **kwargs) -> (x, cache_i)`:
    the output and the tuple of the layers' new caches."""
    caches = []
    for i, layer in enumerate(layers):
        x, c = layer(x, cache_at(cache, i), **kwargs)
        caches.append(c)
    return x, tuple(caches)


def run_chunked(step: Step, x: Float[Array, "C T H W"], *, first: int, size: int) -> jax.Array:
    """`step` over the frames of `x`: the first `first` frames as the first chunk
    (`step(chunk, None, True)`), then chunks of `size` frames in a `lax.scan` carrying the
    caches `step` returns (`step(chunk, cache, False)`). The rest of the frames is padded
    with zero frames to a whole number of chunks and the padding's outputs cut off, which
    for a causal `step` changes nothing else. Returns the outputs joined along time."""
    head, cache = step(x[:, :first], None, True)
    # Inside shard_map a cache that starts as constant zeros must vary like the frames.
    cache = as_varying(cache, varying_axes(x))
    rest = x.shape[1] - first
    if rest == 0:
        return head
    n = -(-rest // size)
    tail = jnp.pad(x[:, first:], ((0, 0), (0, n * size - rest), (0, 0), (0, 0)))
    chunks = jnp.moveaxis(tail.reshape(x.shape[0], n, size, *x.shape[2:]), 1, 0)

    def body(cache, chunk):
        y, cache = step(chunk, cache, False)
        return cache, y

    _, ys = jax.lax.scan(body, cache, chunks)
    out = jnp.moveaxis(ys, 0, 1)
    out = out.reshape(out.shape[0], -1, *out.shape[3:])
    keep = out.shape[1] * rest // (n * size)
    return jnp.concatenate([head, out[:, :keep]], axis=1)


class FirstChunk(NamedTuple):
    """What a layer of `run_scanned`'s step needs to treat the video's first frame
    apart, by data: `is_first` (a traced bool: this chunk holds the first frame) and
    `latent_frames` (static: latent frames per chunk).

    A chunk of `T` frames at some level of the model holds `T / latent_frames` frames per
    latent frame; in the first chunk the video's first frame is the last of its group
    (its group's frames before it are zeros the runner put in front), so it sits at
    `lead = T / latent_frames - 1`.
    """

    is_first: jax.Array
    latent_frames: int

    def lead(self, x) -> int:
        """The frames of `x` `(C, T, ...)` before the video's first in the first chunk."""
        return x.shape[1] // self.latent_frames - 1

    def zero_lead(self, x, extra: int = 0):
        """`x` with its first `lead(x) + extra` frames zeroed in the first chunk (what
        a causal convolution must read there: the zeros before the video); `x` itself
        elsewhere, exactly."""
        n = self.lead(x) + extra
        if n == 0:
            return x
        frames = jnp.arange(x.shape[1]).reshape(1, -1, *(1,) * (x.ndim - 2))
        return jnp.where(self.is_first & (frames < n), jnp.zeros((), x.dtype), x)

    def replace(self, x, index: int, frame):
        """`x` with frame `index` replaced by `frame` `(C, 1, ...)` in the first chunk."""
        return x.at[:, index:index + 1].set(
            jnp.where(self.is_first, frame.astype(x.dtype), x[:, index:index + 1]))


ScannedStep = Callable[[jax.Array, object, FirstChunk], tuple[jax.Array, object]]


def run_scanned(step: ScannedStep, x: Float[Array, "C T H W"], *, size: int, latent_frames: int,
                lead: int, out_lead: int, out_frames: int) -> jax.Array:
    """`step` over the frames of `x` in one `lax.scan`, the first chunk included.

    `lead` zero frames go before `x` (they line the first frame up as the last of its
    group, see `FirstChunk`), zero frames after it to a whole number of chunks of
    `size` frames, and each step runs `step(chunk, cache, first)` with `first` a
    `FirstChunk` (`latent_frames` per chunk), carrying the caches; the first step's
    cache is zeros (the zeros before the video), shaped by tracing `step` with `cache`
    `None`. Returns the outputs joined along time, `out_frames` of them after the first
    `out_lead` (the lead's outputs)."""
    x = jnp.pad(x, ((0, 0), (lead, 0), (0, 0), (0, 0)))
    n = -(-x.shape[1] // size)
    x = jnp.pad(x, ((0, 0), (0, n * size - x.shape[1]), (0, 0), (0, 0)))
    chunks = jnp.moveaxis(x.reshape(x.shape[0], n, size, *x.shape[2:]), 1, 0)
    probe = FirstChunk(jnp.bool_(True), latent_frames)
    shapes = jax.eval_shape(lambda c: step(c, None, probe)[1], chunks[0])
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    # Inside shard_map a cache that starts as constant zeros must vary like the frames.
    cache = as_varying(cache, varying_axes(x))

    def body(cache, xs):
        chunk, is_first = xs
        y, cache = step(chunk, cache, FirstChunk(is_first, latent_frames))
        return cache, y

    _, ys = jax.lax.scan(body, cache, (chunks, jnp.arange(n) == 0))
    out = jnp.moveaxis(ys, 0, 1)
    out = out.reshape(out.shape[0], -1, *out.shape[3:])
    return out[:, out_lead:out_lead + out_frames]


def _example(owner: str, name: str, x) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 4:
        got = f"shape {tuple(shape)}" if shape is not None else type(x).__name__
        raise ValueError(f"{owner}: `{name}` must be one example (C, F, H, W) (vmap for a "
                         f"batch); received {got}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{owner}: `{name}` must be a floating array; received dtype {x.dtype}.")
    return tuple(shape)


def check_video(owner: str, video, *, channels: int, temporal_factor: int,
                spatial_factor: int) -> None:
    """Raises naming `video` unless it is one example `(channels, 1 + temporal_factor k,
    H, W)` with `H` and `W` multiples of `spatial_factor`."""
    c, f, h, w = _example(owner, "video", video)
    if c != channels:
        raise ValueError(f"{owner}: `video` must have {channels} channels (its first axis, "
                         f"(C, F, H, W)); received shape {tuple(video.shape)}.")
    if (f - 1) % temporal_factor:
        raise ValueError(f"{owner}: `video` must have 1 + {temporal_factor}k frames (axis 1); "
                         f"received {f} frames (shape {tuple(video.shape)}).")
    if h % spatial_factor or w % spatial_factor:
        raise ValueError(f"{owner}: the `video`'s height and width must be multiples of the VAE's "
                         f"spatial factor {spatial_factor}; received {h} x {w} (shape "
                         f"{tuple(video.shape)}).")


def check_latents(owner: str, latents, *, channels: int, name: str = "z_dim") -> None:
    """Raises naming `latents` unless it is one example with `channels` channels."""
    shape = _example(owner, "latents", latents)
    if shape[0] != channels:
        raise ValueError(f"{owner}: `latents` must have {name} = {channels} channels (axis 0 of "
                         f"(z_dim, F, h, w)); received shape {shape}.")


def pad_frames(owner: str, x, max_frames, step: int, what: str):
    """`x` `(C, F, H, W)` with zero frames after its own up to `max_frames` (`1 + step k`,
    at least `F`); `x` itself for `None`. A causal VAE's outputs for the real frames do not
    change: one compiled program serves every frame count up to `max_frames`."""
    if max_frames is None:
        return x
    frames = x.shape[1]
    if (not is_int(max_frames) or isinstance(max_frames, bool) or max_frames < frames
            or (max_frames - 1) % step):
        raise ValueError(f"{owner}: `max_frames` must be None or an int of the form 1 + {step}k "
                         f"({what}) at least the input's {frames}; received {max_frames!r}.")
    return jnp.pad(x, ((0, 0), (0, max_frames - frames), (0, 0), (0, 0)))


def check_chunk(owner: str, chunk) -> int:
    if not is_int(chunk) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"{owner}: `chunk` (latent frames per scan step) must be an int >= 1; "
                         f"received {chunk!r}.")
    return int(chunk)


def check_split(owner: str, mesh, spatial_axes, height: int, width: int,
                unit: int, what: str) -> SpatialSplit:
    """The split of a frame `(height, width)` over `spatial_axes` of `mesh`, each block a
    whole number of `unit`s (the VAE's spatial factor for a video, 1 for latents);
    raises naming the argument otherwise."""
    if mesh is None:
        if spatial_axes is not None:
            raise ValueError(f"{owner}: `spatial_axes` {spatial_axes!r} was given without a "
                             "`mesh`; pass the mesh its axes belong to.")
        return SpatialSplit()
    if (not isinstance(spatial_axes, (tuple, list)) or len(spatial_axes) != 2
            or spatial_axes[0] is not None and spatial_axes[0] == spatial_axes[1]):
        raise ValueError(f"{owner}: `spatial_axes` must be (height_axis, width_axis), two "
                         f"different mesh axes or None; received {spatial_axes!r}.")
    for role, axis, extent in (("height", spatial_axes[0], height), ("width", spatial_axes[1], width)):
        if axis is None:
            continue
        if axis not in mesh.shape:
            raise ValueError(f"{owner}: the {role} axis {axis!r} of `spatial_axes` is not an "
                             f"axis of `mesh` (axes {tuple(mesh.shape)}).")
        n = mesh.shape[axis]
        if extent % (n * unit):
            raise ValueError(
                f"{owner}: the {what}'s {role} {extent} cannot be split over mesh axis {axis!r} "
                f"of size {n}: each device's block must be a whole number of {unit}"
                f"{' pixels' if unit > 1 else ''} ({extent} is not a multiple of {n * unit}). "
                f"Pad the {what}, or split over an axis whose size divides it.")
    return SpatialSplit(*spatial_axes)


def check_one_device(owner: str, tiling, mesh):
    """`tiling` checked, and refused together with a `mesh`."""
    if tiling is not None and mesh is not None:
        raise ValueError(f"{owner}: `tiling` runs on one device; pass `mesh` or `tiling`, not both.")
    return None if tiling is None else check_tiling(owner, tiling)


def frame_spec(split: SpatialSplit) -> P:
    """The `PartitionSpec` of a `(C, T, H, W)` array split like `split`."""
    return P(None, None, split.height_axis, split.width_axis)


def map_frames(fn: Callable, module, x: jax.Array, mesh, split: SpatialSplit,
               out_frames=True):
    """`fn(module, x, split)` with `x` `(C, T, H, W)` split over `mesh` like `split` and
    the module replicated; the result's arrays split the same way (placed over the mesh).
    On one device (`mesh` None) just the call."""
    if mesh is None:
        return fn(module, x, split)
    spec = frame_spec(split)
    x = jax.device_put(x, NamedSharding(mesh, spec))
    mapped = filter_shard_map(lambda m, x: fn(m, x, split), mesh=mesh,
                              in_specs=(P(), spec), out_specs=spec)
    return mapped(module, x)


class Tiling(NamedTuple):
    """diffusers' spatial tiling of a VAE (`enable_tiling`), in video pixels: tiles of
    `min_height x min_width` every `stride_height` / `stride_width`, their overlaps blended
    linearly; a frame no larger than a tile is not tiled. diffusers' defaults."""

    min_height: int = 256
    min_width: int = 256
    stride_height: int = 192
    stride_width: int = 192


def check_tiling(owner: str, tiling) -> Tiling:
    if not isinstance(tiling, Tiling):
        raise ValueError(f"{owner}: `tiling` must be a Tiling(min_height, min_width, "
                         f"stride_height, stride_width) or None; received {tiling!r}.")
    for name, value in tiling._asdict().items():
        if not is_int(value) or value < 1:
            raise ValueError(f"{owner}: `tiling.{name}` must be an int >= 1; received {value!r}.")
    if tiling.stride_height > tiling.min_height or tiling.stride_width > tiling.min_width:
        raise ValueError(f"{owner}: a tile's stride must not exceed its size (tiles must "
                         f"overlap or touch); received {tiling}.")
    return tiling


def _ramps(n: int, dtype) -> tuple[jax.Array, jax.Array]:
    """The weights of the tile before and of this tile over a blend of `n`: `1 - y / n` and
    `y / n`, each computed in float64 and rounded once (as PyTorch's Python scalars)."""
    y = np.arange(n) / n
    return jnp.asarray((1 - y).astype(np.float32)).astype(dtype), jnp.asarray(y.astype(np.float32)).astype(dtype)


def blend_tiles(rows: list[list[jax.Array]], blend: tuple[int, int],
                stride: tuple[int, int], size: tuple[int, int]) -> jax.Array:
    """diffusers' `blend_v` / `blend_h` and crop: each tile `(C, T, h, w)` blended with the
    one above and the one to its left over `blend` rows / columns (linear ramps), cropped to
    `stride`, the rows and columns joined and cut to `size`."""
    out_rows = []
    for i, row in enumerate(rows):
        out_row = []
        for j, tile in enumerate(row):
            if i > 0:
                above = rows[i - 1][j]
                n = min(above.shape[-2], tile.shape[-2], blend[0])
                if n:
                    a, b = _ramps(n, tile.dtype)
                    mixed = above[..., above.shape[-2] - n:, :] * a[:, None] + tile[..., :n, :] * b[:, None]
                    tile = tile.at[..., :n, :].set(mixed)
            if j > 0:
                left = row[j - 1]
                n = min(left.shape[-1], tile.shape[-1], blend[1])
                if n:
                    a, b = _ramps(n, tile.dtype)
                    mixed = left[..., left.shape[-1] - n:] * a + tile[..., :n] * b
                    tile = tile.at[..., :n].set(mixed)
            # diffusers blends in place: the next tile to the right reads this blended one.
            row[j] = tile
            out_row.append(tile[..., :stride[0], :stride[1]])
        out_rows.append(jnp.concatenate(out_row, axis=-1))
    return jnp.concatenate(out_rows, axis=-2)[..., :size[0], :size[1]]


# XLA's `exec_time_optimization_effort` (-1 to 1; XLA's default 0) for the VAEs' programs
# on a TPU. At -0.5 and below the TPU compiler skips its slow search for each
# convolution's code. Measured on a v5e chip (Wan 2.1, 480p x 81 frames, bfloat16,
# `benchmarks/vae_compile.py --efforts`): the decode compiles in 5.9 / 7.8 s instead of
# 38.2 / 39.8 s (chunk 1 / 3) and runs 12% / 10% slower (6.23 / 5.75 s against
# 5.57 / 5.24 s), the encode in 6.9 / 7.5 s instead of 28.1 / 30.8 s, 14% / 11% slower;
# at -1 the programs ran 50-60% slower. A VAE program runs once per video, after minutes of
# denoising: the half minute of compile is the larger cost. Other platforms keep XLA's
# default (on a CPU the option changes neither the compiled program nor a bit of the
# result). A user who set `jax_exec_time_optimization_effort` (any value but 0) keeps it.
TPU_COMPILE_EFFORT = -0.5


def vae_compile_options(platform: str) -> dict:
    """The XLA compile options of a VAE program lowered for `platform` (`"tpu"`: a lower
    optimization effort, which compiles the Wan VAE's decode at 480p x 81 in 6-8 s
    instead of 28-40 s for a decode 10-12% slower; `{}` elsewhere, or when JAX's
    `jax_exec_time_optimization_effort` is already set).

    A VAE call compiles with them by itself; inside a caller's own `jax.jit` the outer
    program is the one compiled, and JAX applies no nested program's options. Compile
    such a function with them to get the same compile time:

        step = jax.jit(fn, compiler_options=models.vae_compile_options("tpu") or None)
    """
    if platform != "tpu" or jax.config.jax_exec_time_optimization_effort != 0.0:
        return {}
    return {"exec_time_optimization_effort": TPU_COMPILE_EFFORT}


def _platform(args) -> str:
    """The platform a call of `args` runs on: the first mesh's or committed array's among
    them, else JAX's default backend (also under a trace: the program is then the outer
    one's)."""
    for leaf in jax.tree.leaves(args, is_leaf=lambda a: isinstance(a, Mesh)):
        if isinstance(leaf, Mesh):
            return leaf.devices.flat[0].platform
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            return next(iter(leaf.sharding.device_set)).platform
    return jax.default_backend()


def vae_jit(fn: Callable) -> Callable:
    """`eqx.filter_jit(fn)` compiled with [`vae_compile_options`][] for the platform of the
    call's arguments after the first (the VAE; its weights' placement says nothing about
    where a call runs that names a mesh). Inside a trace (a `jit`, `grad`, ... around the
    call) without options: the outer program is the one compiled, and JAX refuses
    `compiler_options` on a `jit` staged into another."""
    jitted = {}

    @functools.wraps(fn)
    def call(vae, *args):
        top_level = "trace_state_clean" not in _jax_private.MISSING and _jax_private.trace_state_clean()
        options = vae_compile_options(_platform(args)) if top_level else {}
        key = tuple(sorted(options.items()))
        if key not in jitted:
            jitted[key] = eqx.filter_jit(fn, compiler_options=options or None)
        return jitted[key](vae, *args)

    return call


def _block(vae, which: str, options: tuple):
    def body(vae, x, split):
        return getattr(vae, f"_{which}_block")(x, split, *options)

    return body


@vae_jit
def run_blocks(vae, x, mesh, split: SpatialSplit, which: str, *options):
    """The compiled `vae._encode_block(x, split, *options)` (or `_decode_block`), on one
    device or mapped over `mesh` by [`map_frames`][]: the body of a VAE's public calls.
    `options` are static (a chunk size)."""
    return map_frames(_block(vae, which, options), vae, x, mesh, split)


def vae_program(vae, which: str, x, *options, mesh=None, spatial_axes=None, platform=None):
    """`(fn, args)`: [`run_blocks`][]'s body (without the public call's checks) as a
    `jax.jit` function of the VAE's arrays and `x`; `fn.lower(*args)` compiles it,
    `fn.trace(*args).jaxpr` traces it (not `jax.make_jaxpr(fn)` on a TPU: JAX refuses
    compile options on a `jit` inside another trace). `vae` and `x` may be abstract
    (`jax.ShapeDtypeStruct`s): what the memory benchmark measures. Compiled with
    [`vae_compile_options`][] for `platform` (the mesh's, else JAX's default backend)."""
    split = check_split(f"vae_program({which})", mesh, spatial_axes, x.shape[2], x.shape[3], 1,
                        "input")
    is_leaf = lambda a: isinstance(a, (jax.Array, jax.ShapeDtypeStruct))  # noqa: E731
    params, static = eqx.partition(vae, is_leaf, is_leaf=is_leaf)
    body = _block(vae, which, options)

    def fn(params, x):
        return map_frames(body, eqx.combine(params, static, is_leaf=is_leaf), x, mesh, split)

    platform = platform or _platform(mesh)
    return jax.jit(fn, compiler_options=vae_compile_options(platform) or None), (params, x)


CONFIG_FILE = "config.json"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"


def checkpoint_path(path) -> str:
    """A local file or folder as it is; anything else a Hugging Face Hub id, downloaded by
    `interop.resolve_checkpoint`."""
    path = os.fspath(path)
    return path if os.path.exists(path) else os.fspath(interop.resolve_checkpoint(path))


def load_vae(cls, config, source, *, dtype, mesh, rename=None):
    """`cls(config)` built abstractly (no initial weights), replicated over `mesh` if one is
    given, filled from `source` by `interop.load_state_dict` (every tensor's name and shape
    checked against the config)."""
    vae = eqx.filter_eval_shape(cls, config, dtype=dtype, key=jax.random.key(0))
    if mesh is not None:
        replicated = NamedSharding(mesh, P())
        vae = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), vae)
    return interop.load_state_dict(vae, source, rename=rename)


def save_vae(vae, path, *, rename=None) -> None:
    """diffusers' `vae/` layout: `config.json` (`vae.config.to_dict()`) and
    `diffusion_pytorch_model.safetensors` under diffusers' names."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(vae.config.to_dict(), f, indent=2)
    interop.save_safetensors(vae, os.path.join(path, WEIGHTS_FILE), naming="diffusers", rename=rename)
