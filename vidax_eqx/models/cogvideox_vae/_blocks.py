"""The CogVideoX VAE's blocks (diffusers' `AutoencoderKLCogVideoX` module tree and
parameter names).

Every block with causal convolutions maps a chunk of frames `(C, T, H, W)` and its caches
to the output chunk and the caches of the next: `block(x, cache, split=...) -> (y,
cache)`. `cache` is a tuple over the block's causal convolutions, `None` before the first
chunk, where CogVideoX pads time with copies of the chunk's first frame (not zeros). The
time up- and downsamplings and the decoder's conditioning on the latents depend only on
the chunk's length (an odd chunk keeps its first frame apart), so no `first` flag is
needed. Every GroupNorm's statistics span the chunk's frames and the whole frame.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ...nn import CausalConv3d, FrameConv2d, GroupNorm
from ...nn import internal as nn_internal
from ...parallel import SpatialSplit
from .._vae import cache_at, run_layers


class CogVideoXCausalConv3d(eqx.Module):
    """diffusers' `CogVideoXCausalConv3d` (`pad_mode="first"`): a convolution causal in
    time whose first chunk is padded with `kt - 1` copies of its first frame; later
    chunks read the cache (the `kt - 1` frames before them). Zeros around in space."""

    conv: CausalConv3d

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, *, dtype, key):
        self.conv = CausalConv3d(in_channels, out_channels, kernel_size,
                                 padding=(kernel_size - 1) // 2, dtype=dtype, key=key)

    def __call__(self, x, cache=None, *, split: SpatialSplit):
        frames = self.conv.cache_frames
        if frames and cache is None:
            cache = jnp.repeat(x[:, :1], frames, axis=1)
        return self.conv(x, cache, split=split)


def _nearest(n_in: int, n_out: int) -> np.ndarray:
    """PyTorch's `nearest` source index of each of `n_out` outputs from `n_in` inputs."""
    out = np.arange(n_out)
    if n_out == n_in:
        return out
    if n_out == 2 * n_in:
        return out >> 1
    scale = np.float32(np.float32(n_in) / np.float32(n_out))
    return np.minimum(np.floor(out.astype(np.float32) * scale).astype(np.int64), n_in - 1)


def interpolate_latents(zq: Float[Array, "z t h w"], frames: int, height: int, width: int):
    """diffusers' `CogVideoXSpatialNorm3D` resizing of the latents `zq` to `(frames,
    height, width)` (nearest): an odd number of frames (more than one) keeps the first
    frame apart and stretches the rest over the rest. Space is a whole-number repeat, so
    on a split frame each device resizes its own block."""
    t = zq.shape[1]
    if frames > 1 and frames % 2 == 1:
        index = np.concatenate([[0], 1 + _nearest(t - 1, frames - 1)])
    else:
        index = _nearest(t, frames)
    if not np.array_equal(index, np.arange(t)):
        zq = zq[:, index]
    for axis, size in ((2, height), (3, width)):
        if size % zq.shape[axis]:
            raise NotImplementedError(
                f"CogVideoXSpatialNorm3D: resizing {zq.shape[axis]} latent rows to {size} "
                "is not a whole-number repeat.")
        zq = jnp.repeat(zq, size // zq.shape[axis], axis=axis)
    return zq


class CogVideoXSpatialNorm3D(eqx.Module):
    """The decoder's norm conditioned on the latents: `GroupNorm(f) * conv_y(zq) +
    conv_b(zq)`, `zq` the chunk's latents resized to `f` (1x1x1 convolutions)."""

    norm_layer: GroupNorm
    conv_y: CogVideoXCausalConv3d
    conv_b: CogVideoXCausalConv3d

    def __init__(self, f_channels: int, zq_channels: int, groups: int, *, dtype, key):
        k1, k2 = nn_internal.init.split(key)
        self.norm_layer = GroupNorm(groups, f_channels, eps=1e-6, dtype=dtype)
        self.conv_y = CogVideoXCausalConv3d(zq_channels, f_channels, 1, dtype=dtype, key=k1)
        self.conv_b = CogVideoXCausalConv3d(zq_channels, f_channels, 1, dtype=dtype, key=k2)

    def __call__(self, f, zq, *, split: SpatialSplit):
        zq = interpolate_latents(zq, *f.shape[1:])
        y = self.conv_y(zq, split=split)[0]
        b = self.conv_b(zq, split=split)[0]
        return self.norm_layer(f, split=split) * y + b


def _norm(norm, x, zq, split):
    if isinstance(norm, CogVideoXSpatialNorm3D):
        return norm(x, zq, split=split)
    return norm(x, split=split)


class CogVideoXResnetBlock3D(eqx.Module):
    """norm, SiLU, causal 3x3x3 conv, twice, plus the input (through a 1x1x1 conv when
    the width changes). The norms are GroupNorms, or in the decoder
    [`CogVideoXSpatialNorm3D`][]s conditioned on the latents."""

    norm1: GroupNorm | CogVideoXSpatialNorm3D
    conv1: CogVideoXCausalConv3d
    norm2: GroupNorm | CogVideoXSpatialNorm3D
    conv2: CogVideoXCausalConv3d
    conv_shortcut: CausalConv3d | None

    def __init__(self, in_dim: int, out_dim: int, *, groups: int, eps: float,
                 spatial_norm_dim: int | None, dtype, key):
        k1, k2, k3, k4, k5 = nn_internal.init.split(key, 5)
        if spatial_norm_dim is None:
            self.norm1 = GroupNorm(groups, in_dim, eps=eps, dtype=dtype)
            self.norm2 = GroupNorm(groups, out_dim, eps=eps, dtype=dtype)
        else:
            self.norm1 = CogVideoXSpatialNorm3D(in_dim, spatial_norm_dim, groups, dtype=dtype, key=k4)
            self.norm2 = CogVideoXSpatialNorm3D(out_dim, spatial_norm_dim, groups, dtype=dtype, key=k5)
        self.conv1 = CogVideoXCausalConv3d(in_dim, out_dim, 3, dtype=dtype, key=k1)
        self.conv2 = CogVideoXCausalConv3d(out_dim, out_dim, 3, dtype=dtype, key=k2)
        self.conv_shortcut = (CausalConv3d(in_dim, out_dim, 1, dtype=dtype, key=k3)
                              if in_dim != out_dim else None)

    def __call__(self, x, cache, *, zq=None, split: SpatialSplit):
        h = jax.nn.silu(_norm(self.norm1, x, zq, split))
        h, c1 = self.conv1(h, cache_at(cache, 0), split=split)
        h = jax.nn.silu(_norm(self.norm2, h, zq, split))
        h, c2 = self.conv2(h, cache_at(cache, 1), split=split)
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x, split=split)[0]
        return h + x, (c1, c2)


def _pairs(x):
    """Time halved by averaging consecutive frames (`avg_pool1d(2, 2)`)."""
    c, t, h, w = x.shape
    return x.reshape(c, t // 2, 2, h, w).mean(axis=2)


class CogVideoXDownsample3D(eqx.Module):
    """Time halved by averaging pairs of frames (`compress_time`; an odd chunk keeps its
    first frame), then a 3x3 stride-2 conv of each frame after one zero row and column
    below and right."""

    conv: FrameConv2d
    compress_time: bool = eqx.field(static=True)

    def __init__(self, dim: int, *, compress_time: bool, dtype, key):
        self.conv = FrameConv2d(dim, dim, 3, stride=2, padding=(0, 1, 0, 1), dtype=dtype, key=key)
        self.compress_time = compress_time

    def __call__(self, x, *, split: SpatialSplit):
        if self.compress_time:
            if x.shape[1] % 2 == 1:
                x = jnp.concatenate([x[:, :1], _pairs(x[:, 1:])], axis=1) if x.shape[1] > 1 else x
            else:
                x = _pairs(x)
        return self.conv(x, split=split)


def _up2(x, axes):
    for axis in axes:
        x = jnp.repeat(x, 2, axis=axis)
    return x


class CogVideoXUpsample3D(eqx.Module):
    """Nearest 2x in space (and time: `compress_time`, every frame doubled except an odd
    chunk's first), then a 3x3 conv of each frame."""

    conv: FrameConv2d
    compress_time: bool = eqx.field(static=True)

    def __init__(self, dim: int, *, compress_time: bool, dtype, key):
        self.conv = FrameConv2d(dim, dim, 3, padding=1, dtype=dtype, key=key)
        self.compress_time = compress_time

    def __call__(self, x, *, split: SpatialSplit):
        t = x.shape[1]
        if self.compress_time and t > 1 and t % 2 == 1:
            x = jnp.concatenate([_up2(x[:, :1], (2, 3)), _up2(x[:, 1:], (1, 2, 3))], axis=1)
        elif self.compress_time and t > 1:
            x = _up2(x, (1, 2, 3))
        else:
            x = _up2(x, (2, 3))
        return self.conv(x, split=split)


class CogVideoXDownBlock3D(eqx.Module):
    """Residual blocks, then (but at the last level) a downsampling."""

    resnets: list[CogVideoXResnetBlock3D]
    downsamplers: list[CogVideoXDownsample3D] | None

    def __init__(self, in_dim, out_dim, num_layers, *, groups, eps, down: bool,
                 compress_time: bool, dtype, key):
        keys = nn_internal.init.split(key, num_layers + 1)
        self.resnets = [CogVideoXResnetBlock3D(in_dim if i == 0 else out_dim, out_dim, groups=groups,
                                               eps=eps, spatial_norm_dim=None, dtype=dtype, key=keys[i])
                        for i in range(num_layers)]
        self.downsamplers = ([CogVideoXDownsample3D(out_dim, compress_time=compress_time,
                                                    dtype=dtype, key=keys[-1])] if down else None)

    def __call__(self, x, cache, *, split: SpatialSplit):
        x, caches = run_layers(self.resnets, x, cache, zq=None, split=split)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x, split=split)
        return x, caches


class CogVideoXMidBlock3D(eqx.Module):
    """Two residual blocks (spatially conditioned norms in the decoder)."""

    resnets: list[CogVideoXResnetBlock3D]

    def __init__(self, dim: int, *, groups, eps, spatial_norm_dim, dtype, key):
        keys = nn_internal.init.split(key, 2)
        self.resnets = [CogVideoXResnetBlock3D(dim, dim, groups=groups, eps=eps,
                                               spatial_norm_dim=spatial_norm_dim, dtype=dtype, key=k)
                        for k in keys]

    def __call__(self, x, cache, *, zq=None, split: SpatialSplit):
        return run_layers(self.resnets, x, cache, zq=zq, split=split)


class CogVideoXUpBlock3D(eqx.Module):
    """Residual blocks with spatially conditioned norms, then (but at the last level) an
    upsampling."""

    resnets: list[CogVideoXResnetBlock3D]
    upsamplers: list[CogVideoXUpsample3D] | None

    def __init__(self, in_dim, out_dim, num_layers, *, groups, spatial_norm_dim, up: bool,
                 compress_time: bool, dtype, key):
        keys = nn_internal.init.split(key, num_layers + 1)
        self.resnets = [CogVideoXResnetBlock3D(in_dim if i == 0 else out_dim, out_dim, groups=groups,
                                               eps=1e-6, spatial_norm_dim=spatial_norm_dim,
                                               dtype=dtype, key=keys[i])
                        for i in range(num_layers)]
        self.upsamplers = ([CogVideoXUpsample3D(out_dim, compress_time=compress_time,
                                                dtype=dtype, key=keys[-1])] if up else None)

    def __call__(self, x, cache, *, zq, split: SpatialSplit):
        x, caches = run_layers(self.resnets, x, cache, zq=zq, split=split)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, split=split)
        return x, caches


def _time_levels(config) -> int:
    return int(np.log2(config.temporal_compression_ratio))


class CogVideoXEncoder3D(eqx.Module):
    """Video -> the posterior's moments `(2 latent_channels, ...)` of one chunk."""

    conv_in: CogVideoXCausalConv3d
    down_blocks: list[CogVideoXDownBlock3D]
    mid_block: CogVideoXMidBlock3D
    norm_out: GroupNorm
    conv_out: CogVideoXCausalConv3d

    def __init__(self, config, *, dtype, key):
        widths = config.block_out_channels
        levels = len(widths)
        keys = nn_internal.init.split(key, 3 + levels)
        groups, eps = config.norm_num_groups, config.norm_eps
        self.conv_in = CogVideoXCausalConv3d(config.in_channels, widths[0], 3, dtype=dtype, key=keys[0])
        self.down_blocks = [
            CogVideoXDownBlock3D(widths[max(i - 1, 0)], widths[i], config.layers_per_block,
                                 groups=groups, eps=eps, down=i != levels - 1,
                                 compress_time=i < _time_levels(config), dtype=dtype, key=keys[1 + i])
            for i in range(levels)]
        self.mid_block = CogVideoXMidBlock3D(widths[-1], groups=groups, eps=eps,
                                             spatial_norm_dim=None, dtype=dtype, key=keys[-2])
        self.norm_out = GroupNorm(groups, widths[-1], eps=1e-6, dtype=dtype)
        self.conv_out = CogVideoXCausalConv3d(widths[-1], 2 * config.latent_channels, 3,
                                              dtype=dtype, key=keys[-1])

    def __call__(self, x, cache, *, split: SpatialSplit):
        x, c_in = self.conv_in(x, cache_at(cache, 0), split=split)
        x, c_down = run_layers(self.down_blocks, x, cache_at(cache, 1), split=split)
        x, c_mid = self.mid_block(x, cache_at(cache, 2), split=split)
        x = jax.nn.silu(self.norm_out(x, split=split))
        x, c_out = self.conv_out(x, cache_at(cache, 3), split=split)
        return x, (c_in, c_down, c_mid, c_out)


class CogVideoXDecoder3D(eqx.Module):
    """A chunk of latents -> its video frames; every norm conditioned on the chunk's
    latents."""

    conv_in: CogVideoXCausalConv3d
    mid_block: CogVideoXMidBlock3D
    up_blocks: list[CogVideoXUpBlock3D]
    norm_out: CogVideoXSpatialNorm3D
    conv_out: CogVideoXCausalConv3d

    def __init__(self, config, *, dtype, key):
        widths = config.block_out_channels[::-1]
        levels = len(widths)
        z, groups = config.latent_channels, config.norm_num_groups
        keys = nn_internal.init.split(key, 4 + levels)
        self.conv_in = CogVideoXCausalConv3d(z, widths[0], 3, dtype=dtype, key=keys[0])
        self.mid_block = CogVideoXMidBlock3D(widths[0], groups=groups, eps=1e-6,
                                             spatial_norm_dim=z, dtype=dtype, key=keys[1])
        self.up_blocks = [
            CogVideoXUpBlock3D(widths[max(i - 1, 0)], widths[i], config.layers_per_block + 1,
                               groups=groups, spatial_norm_dim=z, up=i != levels - 1,
                               compress_time=i < _time_levels(config), dtype=dtype, key=keys[2 + i])
            for i in range(levels)]
        self.norm_out = CogVideoXSpatialNorm3D(widths[-1], z, groups, dtype=dtype, key=keys[-2])
        self.conv_out = CogVideoXCausalConv3d(widths[-1], config.out_channels, 3, dtype=dtype,
                                              key=keys[-1])

    def __call__(self, zq, cache, *, split: SpatialSplit):
        x, c_in = self.conv_in(zq, cache_at(cache, 0), split=split)
        x, c_mid = self.mid_block(x, cache_at(cache, 1), zq=zq, split=split)
        x, c_up = run_layers(self.up_blocks, x, cache_at(cache, 2), zq=zq, split=split)
        x = jax.nn.silu(self.norm_out(x, zq, split=split))
        x, c_out = self.conv_out(x, cache_at(cache, 3), split=split)
        return x, (c_in, c_mid, c_up, c_out)
