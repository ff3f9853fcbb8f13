"""GroupNorm over a channels-first array `(C, ...)`, its statistics spanning a frame split
over a mesh ([`vidax_eqx.parallel.SpatialSplit`][]).

The statistics of a group are over its channels and every other axis (PyTorch's
`nn.GroupNorm` of one example). Split over a mesh, each device holds one block of the
frame: the per-block sums are `psum`-ed over the split axes, the mean first and then the
sum of squared deviations from it (two passes, as accurate as one device's).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._checks import check_positive
from ..parallel import SpatialSplit
from . import _init as init


_ONE_DEVICE = SpatialSplit()


class GroupNorm(eqx.Module):
    """PyTorch's `nn.GroupNorm` of one example `(C, ...)`, channels first: the channels in
    `num_groups` groups, each normalised by the mean and (biased) variance of its channels
    over all the other axes, then scaled by `weight` and shifted by `bias` per channel.

    Statistics and the affine map in float32, the result in the input's dtype. With a
    `split`, the frame's height and width (the last two axes) are split over the mesh and
    the statistics are the whole frame's.
    """

    weight: Float[Array, " C"] | None
    bias: Float[Array, " C"] | None
    num_groups: int = eqx.field(static=True)
    num_channels: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, num_groups: int, num_channels: int, *, eps: float = 1e-5,
                 affine: bool = True, dtype=jnp.float32):
        """**Arguments:**

        - `num_groups`: the groups; must divide `num_channels`.
        - `num_channels`: the channel count (the input's first axis).
        - `eps`: added to the variance.
        - `affine`: a learned per-channel `weight` (ones at first) and `bias` (zeros).
        - `dtype`: the parameters' dtype.
        """
        check_positive("GroupNorm", num_groups=num_groups, num_channels=num_channels)
        if num_channels % num_groups:
            raise ValueError(f"GroupNorm: `num_groups` must divide `num_channels` "
                             f"{num_channels}; received num_groups={num_groups}.")
        self.num_groups, self.num_channels, self.eps = num_groups, num_channels, float(eps)
        self.weight = init.ones((num_channels,), dtype) if affine else None
        self.bias = init.zeros((num_channels,), dtype) if affine else None

    def __call__(self, x: Float[Array, "C *rest"], *, split: SpatialSplit = _ONE_DEVICE
                 ) -> Float[Array, "C *rest"]:
        """**Arguments:**

        - `x`: `(C, ...)`, channels first (this device's block of the frame when `split`
            splits it: the last two axes).
        - `split`: how the frame is split over the mesh (the default: not split); call
            inside `jax.shard_map` when it names mesh axes.

        **Returns:**

        The normalised array, `x`'s shape and dtype.
        """
        with jax.named_scope("GroupNorm"):
            if x.ndim < 1 or x.shape[0] != self.num_channels:
                raise ValueError(f"GroupNorm: `x` must have {self.num_channels} channels (its "
                                 f"first axis); received shape {x.shape}.")
            g = x.reshape(self.num_groups, -1).astype(jnp.float32)
            count = split.sum(jnp.float32(g.shape[1]))
            mean = split.sum(jnp.sum(g, axis=1, keepdims=True)) / count
            var = split.sum(jnp.sum(jnp.square(g - mean), axis=1, keepdims=True)) / count
            y = ((g - mean) * jax.lax.rsqrt(var + self.eps)).reshape(x.shape)
            if self.weight is not None:
                shape = (-1,) + (1,) * (x.ndim - 1)
                y = y * self.weight.astype(jnp.float32).reshape(shape) + self.bias.astype(
                    jnp.float32).reshape(shape)
            return y.astype(x.dtype)
