"""Convolutions over video `(C, T, H, W)`: causal in time with the time cache an explicit
input and output, and per frame; split over a mesh through a
[`vidax_eqx.parallel.SpatialSplit`][].

A VAE runs its video in chunks of frames (a `lax.scan`): a causal convolution of time
width `k` needs the `k - 1` frames before the chunk, which is what its cache holds. The
first chunk has no cache (`None`): zeros before the first frame, the causal padding of
the whole video. So a video run chunk by chunk equals the video run whole.

Weights are PyTorch's `(out, in, kt, kh, kw)` (`Conv3d`) or `(out, in, kh, kw)`
(`Conv2d`), loaded as they are.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._checks import check_positive
from ..parallel import SpatialSplit
from . import _init as init


_ONE_DEVICE = SpatialSplit()


def _triple(value, name: str, what: str) -> tuple[int, int, int]:
    values = (value,) * 3 if isinstance(value, int) else tuple(value)
    if len(values) != 3 or not all(isinstance(v, int) and v >= 0 for v in values):
        raise ValueError(f"{what}: `{name}` must be an int or three ints >= 0; received {value!r}.")
    return values


def _conv(x, weight, bias, stride):
    """`x` `(C, T, H, W)` (already padded) convolved with `weight` `(O, I, kt, kh, kw)`."""
    # Products summed in float32 whatever the input dtype (as cuDNN and the TPU do), the
    # bias added there, one rounding to the input's dtype. Channels last for the
    # convolution itself: XLA's CPU backend runs an NCDHW convolution inside a loop body
    # (the VAEs' lax.scan over chunks) by its naive emitter, about 30x slower than its
    # library path, which it takes for NDHWC; on GPU / TPU layout assignment makes the
    # transposes free.
    y = jax.lax.conv_general_dilated(
        jnp.moveaxis(x, 0, -1)[None], jnp.transpose(weight, (2, 3, 4, 1, 0)).astype(x.dtype),
        window_strides=stride, padding="VALID", dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
        preferred_element_type=jnp.float32,
    )[0]
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return jnp.moveaxis(y, -1, 0).astype(x.dtype)


def _conv_init(key, out_channels, in_channels, kernel, use_bias, dtype):
    # PyTorch's default (kaiming uniform with a = sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    bound = 1 / math.sqrt(in_channels * math.prod(kernel))
    wkey, bkey = init.split(key)
    weight = init.uniform(wkey, (out_channels, in_channels, *kernel), dtype, bound)
    bias = init.uniform(bkey, (out_channels,), dtype, bound) if use_bias else None
    return weight, bias


class CausalConv3d(eqx.Module):
    """A 3D convolution, causal in time, its time cache an explicit input and output
    (Wan's `CausalConv3d`).

    Time: `2 * padding[0]` frames before the input (the cache, zeros at the start), none
    after. Space: `padding[1:]` zeros (or a split frame's neighbours' rows) on each side.
    """

    weight: Float[Array, "out in kt kh kw"]
    bias: Float[Array, " out"] | None
    stride: tuple[int, int, int] = eqx.field(static=True)
    padding: tuple[int, int, int] = eqx.field(static=True)

    def __init__(self, in_channels: int, out_channels: int, kernel_size=3, *, stride=1,
                 padding=0, use_bias: bool = True, dtype=jnp.float32, key):
        """**Arguments:**

        - `in_channels`, `out_channels`: the channel counts.
        - `kernel_size`: `(kt, kh, kw)` or one int for all three.
        - `stride`: `(st, sh, sw)` or one int.
        - `padding`: `(pt, ph, pw)` or one int, PyTorch's `padding` of a Wan causal
            convolution: `ph` / `pw` zeros on each side in space, `2 * pt` frames before in
            time (the cache) and none after.
        - `use_bias`, `dtype`: the bias and the parameters' dtype.
        - `key`: a PRNG key (PyTorch's default initialisation).
        """
        check_positive("CausalConv3d", in_channels=in_channels, out_channels=out_channels)
        kernel = _triple(kernel_size, "kernel_size", "CausalConv3d")
        self.stride = _triple(stride, "stride", "CausalConv3d")
        self.padding = _triple(padding, "padding", "CausalConv3d")
        self.weight, self.bias = _conv_init(key, out_channels, in_channels, kernel, use_bias, dtype)

    @property
    def cache_frames(self) -> int:
        """How many frames before a chunk the convolution reads: `2 * padding[0]` (Wan's
        causal padding; `kt - 1` for the usual `padding = kt // 2`)."""
        return 2 * self.padding[0]

    def __call__(self, x: Float[Array, "C T H W"], cache: Float[Array, "C c H W"] | None = None,
                 *, split: SpatialSplit = _ONE_DEVICE):
        """**Arguments:**

        - `x`: a chunk of frames `(C, T, H, W)` (this device's block of them when `split`
            splits the frame).
        - `cache`: the [`cache_frames`][vidax_eqx.nn.CausalConv3d.cache_frames] frames
            before the chunk (the last call's returned cache), or `None` at the start of
            the video (zeros).
        - `split`: how the frame is split over the mesh (the default: not split).

        **Returns:**

        `(y, cache)`: the output frames (one per input frame at time stride 1), and the
        cache for the next chunk (`None` for `kt == 1`).
        """
        c = self.cache_frames
        if c:
            if cache is None:
                cache = jnp.zeros((x.shape[0], c, *x.shape[2:]), x.dtype)
            x = jnp.concatenate([cache.astype(x.dtype), x], axis=1)
            cache = x[:, -c:]
        else:
            cache = None
        _, ph, pw = self.padding
        x = split.pad(x, height=(ph, ph), width=(pw, pw))
        return _conv(x, self.weight, self.bias, self.stride), cache


class FrameConv2d(eqx.Module):
    """A 2D convolution of every frame of a video `(C, T, H, W)` (a PyTorch `Conv2d`
    applied to the frames as a batch), with zero padding `padding = (top, bottom, left,
    right)`: symmetric for `3` / `1`, or one-sided (Wan's downsampling pads the bottom and
    right by one before a stride-2 convolution)."""

    weight: Float[Array, "out in kh kw"]
    bias: Float[Array, " out"] | None
    stride: int = eqx.field(static=True)
    padding: tuple[int, int, int, int] = eqx.field(static=True)

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, *,
                 stride: int = 1, padding=0, use_bias: bool = True, dtype=jnp.float32, key):
        """**Arguments:**

        - `in_channels`, `out_channels`, `kernel_size`: as PyTorch's `Conv2d` (square).
        - `stride`: the spatial stride.
        - `padding`: one int (every side) or `(top, bottom, left, right)`.
        - `use_bias`, `dtype`, `key`: as [`CausalConv3d`][vidax_eqx.nn.CausalConv3d].
        """
        check_positive("FrameConv2d", in_channels=in_channels, out_channels=out_channels,
                       kernel_size=kernel_size, stride=stride)
        self.stride = stride
        self.padding = (padding,) * 4 if isinstance(padding, int) else tuple(padding)
        if len(self.padding) != 4:
            raise ValueError(f"FrameConv2d: `padding` must be an int or (top, bottom, left, "
                             f"right); received {padding!r}.")
        self.weight, self.bias = _conv_init(key, out_channels, in_channels,
                                            (kernel_size, kernel_size), use_bias, dtype)

    def __call__(self, x: Float[Array, "C T H W"], *, split: SpatialSplit = _ONE_DEVICE
                 ) -> Float[Array, "out T h w"]:
        """**Arguments:**

        - `x`: frames `(C, T, H, W)`, this device's block of each when `split` splits them.
        - `split`: how the frame is split over the mesh (the default: not split).

        **Returns:**

        The convolved frames.
        """
        top, bottom, left, right = self.padding
        x = split.pad(x, height=(top, bottom), width=(left, right))
        return _conv(x, self.weight[:, :, None], self.bias, (1, self.stride, self.stride))
