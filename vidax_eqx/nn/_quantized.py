"""int8 linear layers: per-output-channel int8 weights, optionally int8 activations.

A [`QuantizedLinear`][] stands in for an `eqx.nn.Linear` (its `in_features`,
`out_features`, `bias`; `weight` is the dequantized matrix, for the checks and code that
read it) and holds the weight as `qweight` (int8, `(out, in)`) times `scale` (float32,
one per output row): half the bytes of bfloat16. The modules of `nn/` apply every
linear through `_layers.linear` / `_layers.row_parallel`, which call
[`product`][vidax_eqx.nn.product], so a quantized layer works wherever a float one does:
in stacked (scanned) blocks (a leading layer axis on both arrays), under a LoRA adapter
(its base), under Megatron tensor parallelism (`qweight` split as the weight, `scale` as
the output features).

Two products:

- weights only (`activations=None`): `x @ (qweight * scale).T` in `x`'s dtype, the
  weight dequantized on the fly (the bytes halve; the arithmetic is the float one's);
- `activations="int8"`: each token of `x` quantized with its own scale (`max |x| / 127`),
  the product accumulated in int32 (`lax.dot_general(..., preferred_element_type=int32)`,
  the int8 units of a TPU), then scaled back. Its gradient with respect to `x` is the
  weights-only product's (a straight-through estimator: rounding has no useful
  derivative), so adapters train on a W8A8 base.

Symmetric int8 in [-127, 127]: a row of zeros gets scale 1 (no division by zero); a
token of zeros stays zero.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int8

from .._shapes import checked


QUANTIZED_ACTIVATIONS = (None, "int8")
"""The activation modes of a [`QuantizedLinear`][]."""

_QMAX = 127.0


def quantize_rows(w: Array) -> tuple[Array, Array]:
    """`(q, scale)` with `q` int8 and `w ~ q * scale[..., None]`: symmetric, one scale per
    row of the last two axes (per output channel of a `(..., out, in)` weight)."""
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=-1)
    scale = jnp.where(amax > 0, amax / _QMAX, 1.0)
    q = jnp.clip(jnp.round(w / scale[..., None]), -_QMAX, _QMAX).astype(jnp.int8)
    return q, scale


class QuantizedLinear(eqx.Module):
    """A linear layer with int8 weights (see the module's text).

    **Fields:** `qweight` (int8 `(out, in)`, a leading layer axis when stacked),
    `scale` (float32 `(out,)`), `bias` (as the float layer's, or `None`), and the
    static `in_features`, `out_features`, `activations` (`None` or `"int8"`) and
    `dtype` (the float layer's weight dtype: the dequantized weight's and the
    product's).
    """

    qweight: Int8[Array, "*layers out in"]
    scale: Float[Array, "*layers out"]
    bias: Array | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    activations: str | None = eqx.field(static=True)
    dtype: jnp.dtype = eqx.field(static=True)

    def __check_init__(self):
        if self.activations not in QUANTIZED_ACTIVATIONS:
            raise ValueError(f"QuantizedLinear: `activations` must be one of {QUANTIZED_ACTIVATIONS}; "
                             f"received {self.activations!r}.")

    @classmethod
    def from_linear(cls, layer: eqx.nn.Linear, activations: str | None = None) -> "QuantizedLinear":
        """`layer` (an `eqx.nn.Linear`, stacked or not) with its weight quantized per
        output channel; the bias stays as it is. An abstract layer (`ShapeDtypeStruct`
        leaves) gives an abstract one."""
        if not isinstance(layer, eqx.nn.Linear):
            raise ValueError(f"QuantizedLinear.from_linear: `layer` must be an eqx.nn.Linear; "
                             f"received {type(layer).__name__}.")
        abstract = isinstance(layer.weight, jax.ShapeDtypeStruct)  # a model loaded abstractly
        q, scale = (jax.eval_shape if abstract else lambda f, w: f(w))(quantize_rows, layer.weight)
        return cls(q, scale, layer.bias, layer.in_features, layer.out_features, activations,
                   jnp.dtype(layer.weight.dtype))

    @property
    def weight(self) -> Array:
        """The dequantized weight `(out, in)` in `dtype`."""
        return (self.qweight.astype(jnp.float32) * self.scale[..., None]).astype(self.dtype)

    @property
    def use_bias(self) -> bool:
        return self.bias is not None

    @checked
    def __call__(self, x: Float[Array, "*batch {self.in_features}"], *, key=None
                 ) -> Float[Array, "*batch {self.out_features}"]:
        """`x @ W.T + b` on the last axis of `x` (one vector, as `eqx.nn.Linear` takes it,
        or any leading axes). `key` is ignored."""
        del key
        y = product(self, x)
        return y if self.bias is None else y + self.bias


def product(layer, x: Array, *, tp_axis: str | None = None) -> Array:
    """`x @ layer.weight.T` for a float linear layer or a [`QuantizedLinear`][] (int8
    activations when the layer says so); no bias. `tp_axis`: a row-parallel layer's
    axis, over which `x`'s features are split: each token's int8 scale is then its
    largest magnitude over all of them (`pmax`), as on one device."""
    if not isinstance(layer, QuantizedLinear):
        return x @ layer.weight.T
    if layer.activations is None:
        return x @ layer.weight.astype(x.dtype).T
    return _w8a8(tp_axis, x, layer.qweight, layer.scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _w8a8(tp_axis, x, q, scale):
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    if tp_axis is not None:
        amax = lax.pmax(amax, tp_axis)
    sx = jnp.where(amax > 0, amax / _QMAX, 1.0)
    xq = jnp.clip(jnp.round(x.astype(jnp.float32) / sx), -_QMAX, _QMAX).astype(jnp.int8)
    acc = lax.dot_general(xq, q, (((x.ndim - 1,), (q.ndim - 1,)), ((), ())),
                          preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * sx * scale).astype(x.dtype)


def _w8a8_fwd(tp_axis, x, q, scale):
    return _w8a8(tp_axis, x, q, scale), (q, scale, jnp.zeros((), x.dtype))  # (a dtype is no residual)


def _w8a8_bwd(tp_axis, res, g):
    q, scale, like = res
    w = q.astype(jnp.float32) * scale[..., None]
    dx = (g.astype(jnp.float32) @ w).astype(like.dtype)
    return dx, None, jnp.zeros_like(scale)


_w8a8.defvjp(_w8a8_fwd, _w8a8_bwd)


def is_quantized_linear(x) -> bool:
    return isinstance(x, QuantizedLinear)
