"""Normalization: the pure functions and the Equinox modules built on them.

The functions (`rms_norm`, `tp_sharded_rms_norm`, `layer_norm`) are the math;
the modules hold a weight and call them, and so does the linen shim
(`vidax_eqx.flax`), which is why linen and Equinox give bit-identical output.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._shapes import checked
from ..parallel import axis_size, TP_AXIS
from .._checks import check_positive
from ._checks import check_eps
from .sharding._fsdp import fsdp_gather
from . import _init as init


def _out_dtype(x, *params):
    """The result dtype: the promotion of the input and parameter dtypes (as PyTorch)."""
    return jnp.result_type(x.dtype, *(p.dtype for p in params if p is not None))


@checked
def rms_norm(
    x: Float[Array, "*batch dim"],
    weight: Float[Array, "dim"],
    eps: float = 1e-6,
) -> Float[Array, "*batch dim"]:
    """Root-mean-square normalization over the last axis, in Wan's order of operations.

    Computes WanRMSNorm exactly: `ms = mean(float32(x) ** 2)` over the last axis,
    `y = float32(x) * rsqrt(ms + eps)` cast back to `x`'s dtype, then
    `y * weight`, both cast to the promotion of `x`'s and `weight`'s dtypes (a
    bfloat16 input with a float32 weight gives float32, as in PyTorch).

    **Arguments:**

    - `x`: the input, normalized over its last axis.
    - `weight`: the per-feature scale `(dim,)`.
    - `eps`: added to the mean square before the reciprocal square root.

    **Returns:**

    An array of `x`'s shape in `promote_types(x.dtype, weight.dtype)`.
    """
    eps = check_eps("rms_norm", eps)
    xf = x.astype(jnp.float32)
    ms = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    return _scale(xf, ms, x, weight, eps)


def _scale(xf, ms, x, weight, eps):
    y = (xf * jax.lax.rsqrt(ms + eps)).astype(x.dtype)
    out_dtype = _out_dtype(x, weight)
    return y.astype(out_dtype) * weight.astype(out_dtype)


@checked
def channel_rms_norm(
    x: Float[Array, "C *rest"],
    gamma: Float[Array, "C"],
    bias: Float[Array, "C"] | None = None,
) -> Float[Array, "C *rest"]:
    """Wan's `RMS_norm` (channel-first, the Wan VAE's norm): every position's channel
    vector `x[:, ...]` divided by its Euclidean norm (at least `1e-12`), times `sqrt(C)`,
    `gamma` and plus `bias`.

    As PyTorch's `F.normalize(x, dim=0) * sqrt(C) * gamma + bias`: the division in float32
    for a lower-precision input, cast back, then the scale in the promotion of `x`'s and
    `gamma`'s dtypes. Per position: a frame split over a mesh needs no communication.

    **Arguments:**

    - `x`: `(C, ...)`, channels first.
    - `gamma`, `bias`: per-channel scale and shift `(C,)`.

    **Returns:**

    An array of `x`'s shape.
    """
    xf = x.astype(jnp.float32) if jnp.finfo(x.dtype).bits < 32 else x
    norm = jnp.sqrt(jnp.sum(jnp.square(xf), axis=0, keepdims=True))
    y = (xf / jnp.maximum(norm, 1e-12)).astype(x.dtype)
    out_dtype = _out_dtype(x, gamma, bias)
    shape = (-1,) + (1,) * (x.ndim - 1)
    y = y.astype(out_dtype) * (x.shape[0] ** 0.5) * gamma.astype(out_dtype).reshape(shape)
    return y if bias is None else y + bias.astype(out_dtype).reshape(shape)


@checked
def tp_sharded_rms_norm(
    x: Float[Array, "*batch dim_local"],
    weight: Float[Array, "dim_local"],
    global_dim: int,
    eps: float = 1e-6,
    axis_name: str = TP_AXIS,
) -> Float[Array, "*batch dim_local"]:
    """[`rms_norm`][] of a feature axis that is column-sharded over a mesh axis.

    Call it inside `jax.shard_map`: `x`'s last axis is this device's `dim_local`
    slice of a feature axis of size `global_dim` split over `axis_name`. The local
    float32 sums of squares are `psum`-ed over `axis_name` and divided by
    `global_dim`; the rest is [`rms_norm`][]'s. The result equals `rms_norm` of the
    full-width input, sliced the same way.

    **Arguments:**

    - `x`: this device's slice of the input, normalized over the global feature axis.
    - `weight`: this device's slice `(dim_local,)` of the scale.
    - `global_dim`: the size of the full feature axis; must equal
        `dim_local * axis_size(axis_name)`.
    - `eps`: added to the mean square before the reciprocal square root.
    - `axis_name`: the mesh axis the features are sharded over.

    **Returns:**

    This device's slice of the normalized array, in
    `promote_types(x.dtype, weight.dtype)`.

    **Raises:**

    `ValueError` when `axis_name` is not bound (outside `shard_map`) or when
    `dim_local * axis_size != global_dim`.
    """
    eps = check_eps("tp_sharded_rms_norm", eps)
    dim_local = x.shape[-1]
    n = axis_size(axis_name, what="Tensor-parallel")
    if dim_local * n != global_dim:
        raise ValueError(
            f"tp_sharded_rms_norm needs dim_local * axis_size({axis_name!r}) == global_dim; "
            f"received dim_local={dim_local}, axis_size={n}, global_dim={global_dim} "
            f"({dim_local} * {n} = {dim_local * n}). Shard the {global_dim} features evenly: "
            f"each device should hold global_dim // {n} of them."
        )
    xf = x.astype(jnp.float32)
    ss = jax.lax.psum(jnp.sum(jnp.square(xf), axis=-1, keepdims=True), axis_name)
    return _scale(xf, ss / global_dim, x, weight, eps)


@checked
def layer_norm(
    x: Float[Array, "*batch dim"],
    weight: Float[Array, "dim"] | None,
    bias: Float[Array, "dim"] | None,
    eps: float = 1e-6,
) -> Float[Array, "*batch dim"]:
    """Layer normalization over the last axis, as `torch.nn.LayerNorm`.

    Mean and (biased) variance are computed in float32; the normalized value is
    scaled and shifted in float32, as PyTorch's fused kernel does, and rounded
    once to the promotion of the input and parameter dtypes (the same result-dtype
    rule as [`rms_norm`][]).

    **Arguments:**

    - `x`: the input, normalized over its last axis.
    - `weight`: the per-feature scale `(dim,)`, or `None` for none.
    - `bias`: the per-feature shift `(dim,)`, or `None` for none.
    - `eps`: added to the variance before the reciprocal square root.

    **Returns:**

    An array of `x`'s shape in the promotion of the dtypes of `x`, `weight` and `bias`.
    """
    eps = check_eps("layer_norm", eps)
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    centred = xf - mean
    var = jnp.mean(jnp.square(centred), axis=-1, keepdims=True)
    y = centred * jax.lax.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(_out_dtype(x, weight, bias))



@checked
def modulated_layer_norm(
    x: Float[Array, "*batch dim"],
    shift: Float[Array, "*#batch dim"],
    scale: Float[Array, "*#batch dim"],
    eps: float = 1e-6,
    weight: Float[Array, "dim"] | None = None,
    bias: Float[Array, "dim"] | None = None,
) -> Float[Array, "*batch dim"]:
    """Adaptive layer normalization (adaLN): `layer_norm(x) * (1 + scale) + shift`, in float32.

    The modulation of Wan's blocks and head (`norm1`, the FFN norm, `head.norm`:
    LayerNorm without affine, then the timestep's `shift` and `scale`) and of
    CogVideoX's `LayerNormZero`. Everything is computed in float32, as Wan does
    under `autocast(float32)` and diffusers with its `FP32LayerNorm`, and the result
    is float32: cast it to the compute dtype where the reference does
    (`.type_as(hidden_states)`).

    **Arguments:**

    - `x`: the input, normalized over its last axis.
    - `shift`, `scale`: broadcastable to `x` (e.g. `(dim,)` per example).
    - `eps`: the LayerNorm epsilon.
    - `weight`, `bias`: the LayerNorm's own affine parameters, or `None` (Wan).

    **Returns:**

    A float32 array of `x`'s shape.
    """
    y = layer_norm(x.astype(jnp.float32), weight, bias, eps).astype(jnp.float32)
    return y * (1 + scale.astype(jnp.float32)) + shift.astype(jnp.float32)


_LINEN_METHODS = frozenset({"init", "apply", "init_with_output", "bind", "param", "variables"})


def _linen_hint(module, name: str):
    """The `AttributeError` of a missing attribute, naming the linen class for linen's
    methods: code written for the `vidax.core` page calls `RMSNorm(dim).init(rng, x)`,
    and the linen classes of that page are `vidax_eqx.flax`'s."""
    cls = type(module).__name__
    if name in _LINEN_METHODS:
        raise AttributeError(
            f"'{cls}' object has no attribute '{name}': vidax_eqx.nn.{cls} (also "
            f"vidax_eqx.core.{cls}) is an Equinox module, created with its weights and called "
            f"directly. The flax.linen module of the vidax.core page, with .init / .apply, is "
            f"vidax_eqx.flax.{cls}."
        )
    raise AttributeError(f"'{cls}' object has no attribute '{name}'")


class RMSNorm(eqx.Module):
    """Wan's RMSNorm (`WanRMSNorm`) over the last axis, with a learned `weight`.

    Statistics in float32, `x * rsqrt(mean(x ** 2) + eps)` cast back to the input
    dtype, then times `weight`; the result dtype is the promotion of the input and
    weight dtypes. See [`vidax_eqx.nn.functional.rms_norm`][].
    """

    weight: Float[Array, "dim"]
    dim: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-6, *, dtype=jnp.float32):
        """**Arguments:**

        - `dim`: the size of the normalized (last) axis.
        - `eps`: added to the mean square before the reciprocal square root.
        - `dtype`: the dtype of `weight` (initialized to ones).
        """
        check_positive("RMSNorm", dim=dim)
        self.dim = dim
        self.eps = check_eps("RMSNorm", eps)
        self.weight = init.ones((dim,), dtype)

    @checked
    def __call__(self, x: Float[Array, "*batch {self.dim}"]) -> Float[Array, "*batch {self.dim}"]:
        """**Arguments:**

        - `x`: an array whose last axis has size `dim`.

        **Returns:**

        The normalized array, `x`'s shape, dtype `promote_types(x.dtype, weight.dtype)`.
        """
        with jax.named_scope("vidax_eqx.nn.RMSNorm"):
            self, x = fsdp_gather(self, x)
            return rms_norm(x, self.weight, self.eps)

    def __getattr__(self, name: str):
        return _linen_hint(self, name)


class ChannelRMSNorm(eqx.Module):
    """Wan's channel-first `RMS_norm` of a video or image `(C, ...)`, with a learned
    `gamma` (and `bias`): see [`vidax_eqx.nn.functional.channel_rms_norm`][].

    `gamma` keeps PyTorch's shape `(C, 1, 1, 1)` (`images=False`, a video) or `(C, 1, 1)`
    (`images=True`), so that Wan and diffusers checkpoints load as they are.
    """

    gamma: Float[Array, "C ..."]
    bias: Float[Array, "C ..."] | None

    def __init__(self, dim: int, *, images: bool = False, use_bias: bool = False,
                 dtype=jnp.float32):
        """**Arguments:**

        - `dim`: the channel count.
        - `images`: the parameters' shape: `(C, 1, 1)` if `True`, else `(C, 1, 1, 1)`.
        - `use_bias`: a learned shift (zeros at first).
        - `dtype`: the parameters' dtype.
        """
        check_positive("ChannelRMSNorm", dim=dim)
        shape = (dim, 1, 1) if images else (dim, 1, 1, 1)
        self.gamma = init.ones(shape, dtype)
        self.bias = init.zeros(shape, dtype) if use_bias else None

    def __call__(self, x: Float[Array, "C *rest"]) -> Float[Array, "C *rest"]:
        """**Arguments:**

        - `x`: `(C, ...)`, channels first.

        **Returns:**

        The normalized array, `x`'s shape.
        """
        if x.shape[0] != self.gamma.shape[0]:
            raise ValueError(f"ChannelRMSNorm: `x` must have {self.gamma.shape[0]} channels "
                             f"(its first axis); received shape {x.shape}.")
        bias = None if self.bias is None else self.bias.reshape(-1)
        return channel_rms_norm(x, self.gamma.reshape(-1), bias)


class TPShardedRMSNorm(eqx.Module):
    """[`RMSNorm`][] over a feature axis column-sharded over a tensor-parallel mesh axis.

    Inside `jax.shard_map`, each device holds `dim_local` of the `global_dim`
    features and the matching slice of `weight`; local sums of squares are
    `psum`-ed over `axis_name`, so the result equals `RMSNorm(global_dim)` on the
    full width. See [`vidax_eqx.nn.functional.tp_sharded_rms_norm`][].

    Inside `shard_map` the module's `weight` is the local slice `(dim_local,)`.
    Outside it the module may hold the full `(global_dim,)` weight (set with
    `eqx.tree_at`, or loaded from a checkpoint): pass the module to `shard_map`
    with the in-spec `P("tp")` and each device receives its slice.
    """

    weight: Float[Array, "dim_local"]
    dim_local: int = eqx.field(static=True)
    global_dim: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)

    def __init__(
        self,
        dim_local: int,
        global_dim: int,
        eps: float = 1e-6,
        *,
        axis_name: str = TP_AXIS,
        dtype=jnp.float32,
    ):
        """**Arguments:**

        - `dim_local`: the features this device holds.
        - `global_dim`: the full feature width, a multiple of `dim_local`.
        - `eps`: added to the mean square before the reciprocal square root.
        - `axis_name`: the mesh axis the features are sharded over (default `"tp"`).
        - `dtype`: the dtype of `weight` (initialized to ones).
        """
        self.dim_local = dim_local
        self.global_dim = global_dim
        self.eps = check_eps("TPShardedRMSNorm", eps)
        self.axis_name = axis_name
        check_positive("TPShardedRMSNorm", dim_local=dim_local, global_dim=global_dim)
        self.weight = init.ones((dim_local,), dtype)

    def __check_init__(self):
        if self.global_dim % self.dim_local:
            raise ValueError(
                "TPShardedRMSNorm needs global_dim to be a multiple of dim_local (global_dim = "
                f"dim_local * tensor-parallel size); received dim_local={self.dim_local}, "
                f"global_dim={self.global_dim}."
            )

    @checked
    def __call__(
        self, x: Float[Array, "*batch {self.dim_local}"]
    ) -> Float[Array, "*batch {self.dim_local}"]:
        """**Arguments:**

        - `x`: this device's slice of the input, last axis `dim_local`.

        **Returns:**

        This device's slice of the normalized array. Raises `ValueError` outside a
        `shard_map` over `axis_name`, or when `dim_local * axis_size != global_dim`.
        """
        with jax.named_scope("vidax_eqx.nn.TPShardedRMSNorm"):
            self, x = fsdp_gather(self, x)
            return tp_sharded_rms_norm(x, self.weight, self.global_dim, self.eps, self.axis_name)

    def __getattr__(self, name: str):
        return _linen_hint(self, name)


class LayerNorm(eqx.Module):
    """Layer normalization over the last axis, as `torch.nn.LayerNorm`.

    CogVideoX applies it per head to queries and keys (`dim = head_dim`, weight and
    bias over `head_dim`). Float32 statistics; the result dtype is the promotion of
    the input and parameter dtypes. See [`vidax_eqx.nn.functional.layer_norm`][].
    """

    weight: Float[Array, "dim"] | None
    bias: Float[Array, "dim"] | None
    dim: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        *,
        elementwise_affine: bool = True,
        dtype=jnp.float32,
    ):
        """**Arguments:**

        - `dim`: the size of the normalized (last) axis.
        - `eps`: added to the variance before the reciprocal square root.
        - `elementwise_affine`: whether to learn `weight` (ones) and `bias` (zeros);
            `False` leaves both `None`.
        - `dtype`: the dtype of `weight` and `bias`.
        """
        check_positive("LayerNorm", dim=dim)
        self.dim = dim
        self.eps = check_eps("LayerNorm", eps)
        self.weight = init.ones((dim,), dtype) if elementwise_affine else None
        self.bias = init.zeros((dim,), dtype) if elementwise_affine else None

    @checked
    def __call__(self, x: Float[Array, "*batch {self.dim}"]) -> Float[Array, "*batch {self.dim}"]:
        """**Arguments:**

        - `x`: an array whose last axis has size `dim` (e.g. `(S, heads, head_dim)`).

        **Returns:**

        The normalized array, `x`'s shape.
        """
        with jax.named_scope("vidax_eqx.nn.LayerNorm"):
            self, x = fsdp_gather(self, x)
            return layer_norm(x, self.weight, self.bias, self.eps)


class ModulatedLayerNorm(eqx.Module):
    """Adaptive LayerNorm: `LayerNorm(x) * (1 + scale) + shift`, float32 (adaLN).

    Wan's `norm1` / FFN norm / `head.norm` with their modulation (no affine
    parameters, the default), or with `elementwise_affine=True` CogVideoX's
    `LayerNormZero` norm. See [`vidax_eqx.nn.functional.modulated_layer_norm`][].
    """

    weight: Float[Array, "dim"] | None
    bias: Float[Array, "dim"] | None
    dim: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(
        self, dim: int, eps: float = 1e-6, *, elementwise_affine: bool = False, dtype=jnp.float32
    ):
        """**Arguments:**

        - `dim`: the size of the normalized (last) axis.
        - `eps`: the LayerNorm epsilon.
        - `elementwise_affine`: whether the LayerNorm learns its own `weight` and `bias`.
        - `dtype`: their dtype.
        """
        check_positive("ModulatedLayerNorm", dim=dim)
        self.dim = dim
        self.eps = check_eps("ModulatedLayerNorm", eps)
        self.weight = init.ones((dim,), dtype) if elementwise_affine else None
        self.bias = init.zeros((dim,), dtype) if elementwise_affine else None

    @checked
    def __call__(
        self,
        x: Float[Array, "*batch {self.dim}"],
        shift: Float[Array, "*#batch {self.dim}"],
        scale: Float[Array, "*#batch {self.dim}"],
    ) -> Float[Array, "*batch {self.dim}"]:
        """**Arguments:**

        - `x`: the input; `shift`, `scale`: the modulation, broadcastable to `x`.

        **Returns:**

        `layer_norm(x) * (1 + scale) + shift`, float32, `x`'s shape.
        """
        with jax.named_scope("vidax_eqx.nn.ModulatedLayerNorm"):
            self, x = fsdp_gather(self, x)
            return modulated_layer_norm(x, shift, scale, self.eps, self.weight, self.bias)
