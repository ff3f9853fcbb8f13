"""The Wan VAE's blocks (diffusers' `AutoencoderKLWan` module tree and parameter names).

Every block maps a chunk of frames `(C, T, H, W)` and its caches to the output chunk and
the caches of the next: `block(x, cache, first=..., split=...) -> (y, cache)`. `cache` is
a tuple over the block's causal convolutions (`None`: zeros, the start of the video);
`first` (a `FirstChunk`) marks the first chunk by
data, which Wan treats apart: the video's first frame is not doubled by a time
upsampling, nor paired by a time downsampling, and the zero frames the runner put before
it are zeroed again before every causal convolution reads them.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ...kernels import attention
from ...nn import CausalConv3d, ChannelRMSNorm, FrameConv2d
from ...nn import internal as nn_internal
from ...parallel import SpatialSplit
from .._vae import cache_at, FirstChunk, run_layers


def _silu(x):
    """SiLU computed in float32 and rounded once (PyTorch's for a bfloat16 input)."""
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


class WanResidualBlock(eqx.Module):
    """norm, SiLU, causal 3x3x3 conv, twice, plus the (1x1x1-convolved) input."""

    norm1: ChannelRMSNorm
    conv1: CausalConv3d
    norm2: ChannelRMSNorm
    conv2: CausalConv3d
    conv_shortcut: CausalConv3d | None

    def __init__(self, in_dim: int, out_dim: int, *, dtype, key):
        k1, k2, k3 = nn_internal.init.split(key, 3)
        self.norm1 = ChannelRMSNorm(in_dim, dtype=dtype)
        self.conv1 = CausalConv3d(in_dim, out_dim, 3, padding=1, dtype=dtype, key=k1)
        self.norm2 = ChannelRMSNorm(out_dim, dtype=dtype)
        self.conv2 = CausalConv3d(out_dim, out_dim, 3, padding=1, dtype=dtype, key=k2)
        self.conv_shortcut = (CausalConv3d(in_dim, out_dim, 1, dtype=dtype, key=k3)
                              if in_dim != out_dim else None)

    def __call__(self, x, cache, *, first: FirstChunk, split: SpatialSplit):
        h = x if self.conv_shortcut is None else self.conv_shortcut(x, split=split)[0]
        x, c1 = self.conv1(first.zero_lead(_silu(self.norm1(x))), cache_at(cache, 0), split=split)
        x, c2 = self.conv2(first.zero_lead(_silu(self.norm2(x))), cache_at(cache, 1), split=split)
        return x + h, (c1, c2)


class WanAttentionBlock(eqx.Module):
    """One-head self-attention over each frame's pixels (`to_qkv`, `proj`: 1x1 convs).

    Split over a mesh, every device attends its pixels to the whole frame's keys and
    values, gathered over the split axes (a frame's latent-resolution pixels: 14,400 at
    720p)."""

    norm: ChannelRMSNorm
    to_qkv: FrameConv2d
    proj: FrameConv2d

    def __init__(self, dim: int, *, dtype, key):
        k1, k2 = nn_internal.init.split(key)
        self.norm = ChannelRMSNorm(dim, images=True, dtype=dtype)
        self.to_qkv = FrameConv2d(dim, 3 * dim, 1, dtype=dtype, key=k1)
        self.proj = FrameConv2d(dim, dim, 1, dtype=dtype, key=k2)

    def __call__(self, x, cache=None, *, first: FirstChunk | None = None, split: SpatialSplit):
        c, t, h, w = x.shape
        qkv = self.to_qkv(self.norm(x))  # (3C, T, h, w)
        tokens = jnp.moveaxis(qkv.reshape(3 * c, t, h * w), 0, -1)[:, :, None, :]  # (T, hw, 1, 3C)
        q, k, v = jnp.split(tokens, 3, axis=-1)
        if split.axes:
            k, v = (jax.lax.all_gather(a, split.axes, axis=1, tiled=True) for a in (k, v))
        # The portable kernels ("xla" or "blockwise"), never a vendor kernel: beside the
        # splash kernel's call the TPU compiler rewrites the next convolutions into a
        # form it takes minutes to compile (the decoder's mid block: 129 s against 10 s).
        # On a CPU "auto" is the same choice.
        out = attention(q, k, v, implementation="portable")  # (T, hw, 1, C), scale 1 / sqrt(C)
        out = jnp.moveaxis(out[:, :, 0, :], -1, 0).reshape(c, t, h, w)
        return self.proj(out) + x, None


class WanResample(eqx.Module):
    """Spatial (and time) up- or downsampling: `upsample2d` / `upsample3d` (nearest 2x,
    3x3 conv; `3d` first doubles time by a causal conv to two frames per frame),
    `downsample2d` / `downsample3d` (3x3 stride-2 conv after one zero row and column
    below and right; `3d` then halves time by a stride-2 time conv)."""

    mode: str = eqx.field(static=True)
    resample: FrameConv2d  # diffusers' `resample.1` (index 0 is the parameter-free up / pad)
    time_conv: CausalConv3d | None

    def __init__(self, dim: int, mode: str, upsample_out_dim: int | None = None, *, dtype, key):
        k1, k2 = nn_internal.init.split(key)
        self.mode = mode
        if mode.startswith("upsample"):
            out = dim // 2 if upsample_out_dim is None else upsample_out_dim
            self.resample = FrameConv2d(dim, out, 3, padding=1, dtype=dtype, key=k1)
        else:
            self.resample = FrameConv2d(dim, dim, 3, stride=2, padding=(0, 1, 0, 1),
                                        dtype=dtype, key=k1)
        self.time_conv = {
            "upsample3d": lambda: CausalConv3d(dim, 2 * dim, (3, 1, 1), padding=(1, 0, 0),
                                               dtype=dtype, key=k2),
            "downsample3d": lambda: CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1),
                                                 dtype=dtype, key=k2),
        }.get(mode, lambda: None)()

    def __call__(self, x, cache, *, first: FirstChunk, split: SpatialSplit):
        if self.mode == "upsample3d":
            # Each frame becomes two by the time conv, but the video's first frame stays
            # itself, once, and the time conv starts after it (reading zeros before the
            # next frame): in the first chunk it reads the first frame (and the zeros
            # before it) as zeros, and the first frame replaces its second output.
            lead = first.lead(x)
            y, cache = self.time_conv(first.zero_lead(x, 1), cache, split=split)  # (2C, T, h, w)
            c, t = x.shape[:2]
            y = jnp.moveaxis(y.reshape(2, c, t, *x.shape[2:]), 0, 2).reshape(c, 2 * t, *x.shape[2:])
            x = first.replace(y, 2 * lead + 1, x[:, lead:lead + 1])
        if self.mode.startswith("upsample"):
            x = jnp.repeat(jnp.repeat(x, 2, axis=-2), 2, axis=-1)  # nearest-exact, 2x
        x = self.resample(x, split=split)
        if self.mode == "downsample3d":
            # frames (2j - 2, 2j - 1, 2j) of the whole video -> frame j, but the video's
            # first frame stays itself (in the first chunk, output (lead - 1) / 2).
            if cache is None:
                cache = jnp.zeros_like(x[:, :1])
            lead = first.lead(x)
            y = self.time_conv(jnp.concatenate([cache, x], axis=1), split=split)[0]
            cache = x[:, -1:]
            x = first.replace(y, (lead - 1) // 2, x[:, lead:lead + 1])
        return x, (cache if self.time_conv is not None else None)


def avg_down(x, out_channels: int, factor_t: int, factor_s: int):
    """diffusers' `AvgDown3D`: pixel (and frame) groups folded into channels, averaged in
    groups down to `out_channels`; an odd chunk gets a zero frame in front (in
    `run_scanned`'s chunks the first chunk's zero
    frames stand for it)."""
    pad_t = (factor_t - x.shape[1] % factor_t) % factor_t
    x = jnp.pad(x, ((0, 0), (pad_t, 0), (0, 0), (0, 0)))
    c, t, h, w = x.shape
    x = x.reshape(c, t // factor_t, factor_t, h // factor_s, factor_s, w // factor_s, factor_s)
    x = x.transpose(0, 2, 4, 6, 1, 3, 5)
    factor = factor_t * factor_s * factor_s
    x = x.reshape(out_channels, c * factor // out_channels, t // factor_t, h // factor_s, w // factor_s)
    return x.mean(axis=1)


def dup_up(x, out_channels: int, factor_t: int, factor_s: int):
    """diffusers' `DupUp3D`: channels repeated and unfolded into pixels (and frames).
    diffusers' first chunk drops the frames before its first; here they stay, in front
    of the video's first frame (see `FirstChunk`)."""
    c, t, h, w = x.shape
    repeats = out_channels * factor_t * factor_s * factor_s // c
    x = jnp.repeat(x, repeats, axis=0)
    x = x.reshape(out_channels, factor_t, factor_s, factor_s, t, h, w)
    x = x.transpose(0, 4, 1, 5, 2, 6, 3).reshape(out_channels, t * factor_t, h * factor_s, w * factor_s)
    return x


class WanResidualDownBlock(eqx.Module):
    """Wan 2.2's down block: residual blocks and a downsampling, plus the input averaged
    down to the same shape (`avg_shortcut`, no parameters)."""

    resnets: list[WanResidualBlock]
    downsampler: WanResample | None
    out_dim: int = eqx.field(static=True)
    factor_t: int = eqx.field(static=True)
    factor_s: int = eqx.field(static=True)

    def __init__(self, in_dim, out_dim, num_res_blocks, *, temporal: bool, down: bool, dtype, key):
        keys = nn_internal.init.split(key, num_res_blocks + 1)
        self.resnets = [WanResidualBlock(in_dim if i == 0 else out_dim, out_dim, dtype=dtype, key=keys[i])
                        for i in range(num_res_blocks)]
        self.downsampler = (WanResample(out_dim, "downsample3d" if temporal else "downsample2d",
                                        dtype=dtype, key=keys[-1]) if down else None)
        self.out_dim, self.factor_t, self.factor_s = out_dim, 2 if temporal else 1, 2 if down else 1

    def __call__(self, x, cache, *, first: FirstChunk, split: SpatialSplit):
        shortcut = avg_down(first.zero_lead(x), self.out_dim, self.factor_t, self.factor_s)
        x, caches = run_layers(self.resnets, x, cache_at(cache, 0), first=first, split=split)
        c = None
        if self.downsampler is not None:
            x, c = self.downsampler(x, cache_at(cache, 1), first=first, split=split)
        return x + shortcut, (caches, c)


class WanUpBlock(eqx.Module):
    """Wan 2.1's up block: residual blocks, then an upsampling (`upsamplers.0`)."""

    resnets: list[WanResidualBlock]
    upsamplers: list[WanResample] | None

    def __init__(self, in_dim, out_dim, num_res_blocks, upsample_mode, *, dtype, key):
        keys = nn_internal.init.split(key, num_res_blocks + 2)
        self.resnets = [WanResidualBlock(in_dim if i == 0 else out_dim, out_dim, dtype=dtype, key=keys[i])
                        for i in range(num_res_blocks + 1)]
        self.upsamplers = (None if upsample_mode is None
                           else [WanResample(out_dim, upsample_mode, dtype=dtype, key=keys[-1])])

    def __call__(self, x, cache, *, first: FirstChunk, split: SpatialSplit):
        x, caches = run_layers(self.resnets, x, cache_at(cache, 0), first=first, split=split)
        c = None
        if self.upsamplers is not None:
            x, c = self.upsamplers[0](x, cache_at(cache, 1), first=first, split=split)
        return x, (caches, c)


class WanResidualUpBlock(eqx.Module):
    """Wan 2.2's up block: residual blocks and an upsampling, plus the input duplicated up
    to the same shape (`avg_shortcut`, no parameters)."""

    resnets: list[WanResidualBlock]
    upsampler: WanResample | None
    out_dim: int = eqx.field(static=True)
    factor_t: int = eqx.field(static=True)

    def __init__(self, in_dim, out_dim, num_res_blocks, *, temporal: bool, up: bool, dtype, key):
        keys = nn_internal.init.split(key, num_res_blocks + 2)
        self.resnets = [WanResidualBlock(in_dim if i == 0 else out_dim, out_dim, dtype=dtype, key=keys[i])
                        for i in range(num_res_blocks + 1)]
        self.upsampler = (WanResample(out_dim, "upsample3d" if temporal else "upsample2d",
                                      upsample_out_dim=out_dim, dtype=dtype, key=keys[-1])
                          if up else None)
        self.out_dim, self.factor_t = out_dim, 2 if temporal else 1

    def __call__(self, x, cache, *, first: FirstChunk, split: SpatialSplit):
        shortcut = (dup_up(x, self.out_dim, self.factor_t, 2)
                    if self.upsampler is not None else None)
        x, caches = run_layers(self.resnets, x, cache_at(cache, 0), first=first, split=split)
        c = None
        if self.upsampler is not None:
            x, c = self.upsampler(x, cache_at(cache, 1), first=first, split=split)
            x = x + shortcut
        return x, (caches, c)


class WanMidBlock(eqx.Module):
    """Residual block, attention over each frame, residual block."""

    resnets: list[WanResidualBlock]
    attentions: list[WanAttentionBlock]

    def __init__(self, dim: int, *, dtype, key):
        k1, k2, k3 = nn_internal.init.split(key, 3)
        self.resnets = [WanResidualBlock(dim, dim, dtype=dtype, key=k) for k in (k1, k3)]
        self.attentions = [WanAttentionBlock(dim, dtype=dtype, key=k2)]

    def __call__(self, x, cache, *, first: FirstChunk, split: SpatialSplit):
        x, c0 = self.resnets[0](x, cache_at(cache, 0), first=first, split=split)
        x, _ = self.attentions[0](x, split=split)
        x, c1 = self.resnets[1](x, cache_at(cache, 1), first=first, split=split)
        return x, (c0, c1)


def _head(norm, conv, x, cache, first, split):
    return conv(first.zero_lead(_silu(norm(x))), cache, split=split)


class WanEncoder3d(eqx.Module):
    """Video (patched) -> the posterior's moments `(2 z_dim, ...)` (before `quant_conv`)."""

    conv_in: CausalConv3d
    down_blocks: list
    mid_block: WanMidBlock
    norm_out: ChannelRMSNorm
    conv_out: CausalConv3d

    def __init__(self, config, *, dtype, key):
        dims = [config.base_dim * m for m in (1, *config.dim_mult)]
        levels = len(config.dim_mult)
        keys = iter(nn_internal.init.split(key, 4 + levels * (config.num_res_blocks + 2)))
        self.conv_in = CausalConv3d(config.in_channels, dims[0], 3, padding=1, dtype=dtype, key=next(keys))
        blocks, scale = [], 1.0
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            last = i == levels - 1
            temporal = config.temperal_downsample[i] if not last else False
            if config.is_residual:
                blocks.append(WanResidualDownBlock(in_dim, out_dim, config.num_res_blocks,
                                                   temporal=temporal, down=not last,
                                                   dtype=dtype, key=next(keys)))
                continue
            for _ in range(config.num_res_blocks):
                blocks.append(WanResidualBlock(in_dim, out_dim, dtype=dtype, key=next(keys)))
                if scale in config.attn_scales:
                    blocks.append(WanAttentionBlock(out_dim, dtype=dtype, key=next(keys)))
                in_dim = out_dim
            if not last:
                blocks.append(WanResample(out_dim, "downsample3d" if temporal else "downsample2d",
                                          dtype=dtype, key=next(keys)))
                scale /= 2.0
        self.down_blocks = blocks
        self.mid_block = WanMidBlock(dims[-1], dtype=dtype, key=next(keys))
        self.norm_out = ChannelRMSNorm(dims[-1], dtype=dtype)
        self.conv_out = CausalConv3d(dims[-1], 2 * config.z_dim, 3, padding=1, dtype=dtype, key=next(keys))

    def __call__(self, x, cache, *, first: FirstChunk, split: SpatialSplit):
        x, c_in = self.conv_in(x, cache_at(cache, 0), split=split)
        x, c_down = run_layers(self.down_blocks, x, cache_at(cache, 1), first=first, split=split)
        x, c_mid = self.mid_block(x, cache_at(cache, 2), first=first, split=split)
        x, c_out = _head(self.norm_out, self.conv_out, x, cache_at(cache, 3), first, split)
        return x, (c_in, c_down, c_mid, c_out)


class WanDecoder3d(eqx.Module):
    """Latents (after `post_quant_conv`) -> video (patched)."""

    conv_in: CausalConv3d
    mid_block: WanMidBlock
    up_blocks: list
    norm_out: ChannelRMSNorm
    conv_out: CausalConv3d

    def __init__(self, config, *, dtype, key):
        base = config.decoder_base_dim or config.base_dim
        mults = config.dim_mult
        dims = [base * m for m in (mults[-1], *mults[::-1])]
        levels = len(mults)
        upsample = config.temperal_downsample[::-1]
        keys = nn_internal.init.split(key, 3 + levels)
        self.conv_in = CausalConv3d(config.z_dim, dims[0], 3, padding=1, dtype=dtype, key=keys[0])
        self.mid_block = WanMidBlock(dims[0], dtype=dtype, key=keys[1])
        blocks = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            up = i != levels - 1
            temporal = bool(up and upsample[i])
            if config.is_residual:
                blocks.append(WanResidualUpBlock(in_dim, out_dim, config.num_res_blocks,
                                                 temporal=temporal, up=up, dtype=dtype, key=keys[2 + i]))
            else:
                mode = None if not up else ("upsample3d" if temporal else "upsample2d")
                blocks.append(WanUpBlock(in_dim // 2 if i > 0 else in_dim, out_dim,
                                         config.num_res_blocks, mode, dtype=dtype, key=keys[2 + i]))
        self.up_blocks = blocks
        self.norm_out = ChannelRMSNorm(dims[-1], dtype=dtype)
        self.conv_out = CausalConv3d(dims[-1], config.out_channels, 3, padding=1, dtype=dtype,
                                     key=keys[-1])

    def __call__(self, x, cache, *, first: FirstChunk, split: SpatialSplit):
        x, c_in = self.conv_in(x, cache_at(cache, 0), split=split)
        x, c_mid = self.mid_block(x, cache_at(cache, 1), first=first, split=split)
        x, c_up = run_layers(self.up_blocks, x, cache_at(cache, 2), first=first, split=split)
        x, c_out = _head(self.norm_out, self.conv_out, x, cache_at(cache, 3), first, split)
        return x, (c_in, c_mid, c_up, c_out)


def patchify(x: Float[Array, "C T H W"], p: int | None) -> Float[Array, "Cpp T h w"]:
    """diffusers' Wan `patchify`: `p x p` pixel patches into channels, channel-major with
    the patch's column before its row."""
    if not p or p == 1:
        return x
    c, t, h, w = x.shape
    x = x.reshape(c, t, h // p, p, w // p, p).transpose(0, 5, 3, 1, 2, 4)
    return x.reshape(c * p * p, t, h // p, w // p)


def unpatchify(x: Float[Array, "Cpp T h w"], p: int | None) -> Float[Array, "C T H W"]:
    """The inverse of [`patchify`][]."""
    if not p or p == 1:
        return x
    cpp, t, h, w = x.shape
    x = x.reshape(cpp // (p * p), p, p, t, h, w).transpose(0, 3, 4, 2, 5, 1)
    return x.reshape(cpp // (p * p), t, h * p, w * p)
