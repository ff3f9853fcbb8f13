"""Layer plumbing of `vidax_eqx.nn`: linear layers applied to tokens, and the Megatron
tensor-parallel pieces around them (the shared column-parallel input, the row-parallel
reduce, this device's heads, the qk-norm over sharded features, a per-token input's
columns of this device's heads).

The modules of `nn/` and the models of `vidax_eqx.models` apply their `eqx.nn.Linear`
layers through `linear` (on `(S, in)` tokens, or any leading axes) instead of
`jax.vmap` of the layer.
"""

import equinox as eqx
import jax
from jax import lax
from jaxtyping import Array

from .._order import after
from .._vma import as_varying, varying_axes
from ..parallel import axis_size
from ._lora import lora_term
from ._norm import RMSNorm, tp_sharded_rms_norm
from ._quantized import product


def linear(layer: eqx.nn.Linear, x: Array) -> Array:
    """`x @ W.T + b` on the last axis of `x` (e.g. `(S, in)` tokens), plus the low-rank
    term of a `LoRALinear`'s adapters; a column-parallel shard gives its own columns; a
    `QuantizedLinear` (or an adapter's quantized base) multiplies in int8."""
    y = product(_base(layer), x)
    y = y + lora_term(layer, x, y.dtype)
    return y if layer.bias is None else y + layer.bias


def _base(layer):
    """The layer whose weight multiplies: a `LoRALinear`'s base, or the layer."""
    return getattr(layer, "base", layer)


def tp_input(x: Array, tp_axis: str | None) -> Array:
    """Under TP, `x` cast once to vary over `tp_axis`, before the column-parallel
    projections that share it: their input gradients are then summed on each device
    before the one `psum` that the cast's transpose is, instead of one `psum` per
    projection (JAX casts an invariant input at each use)."""
    return x if tp_axis is None else as_varying(x, varying_axes(x) | {tp_axis})


def row_parallel(layer: eqx.nn.Linear, x: Array, tp_axis: str | None) -> Array:
    """The output projection: partial products (with a `LoRALinear`'s adapter term,
    whose `A` holds this device's input features) summed over `tp_axis`, bias added
    once."""
    y = product(_base(layer), x, tp_axis=tp_axis)
    y = y + lora_term(layer, x, y.dtype)
    if tp_axis is not None:
        y = jax.lax.psum(y, tp_axis)
    return y if layer.bias is None else y + layer.bias


def local_heads(owner: str, m, column: eqx.nn.Linear) -> int:
    """This device's number of heads of the attention module `m`: all of them, or
    `num_heads / tp` under TP.

    Checks that the column-parallel weights `column` really are this device's shard
    (they are when placed by `partition_specs`).
    """
    tp_axis = m.parallel.tp_axis
    tp = 1 if tp_axis is None else axis_size(tp_axis, what="Tensor-parallel")
    if m.num_heads % tp:
        raise ValueError(
            f"{owner}: tensor parallelism splits the {m.num_heads} heads over the {tp} devices "
            f"of axis {tp_axis!r}, so num_heads must be a multiple of the TP size; received "
            f"num_heads={m.num_heads}, tp={tp}."
        )
    rows = column.weight.shape[0]
    if tp_axis is None and rows != m.dim:
        raise ValueError(
            f"{owner}: the module's ParallelConfig has no tp_axis, so every device needs all "
            f"{m.dim} rows of the q/k/v weights; received {rows} (weights placed for tensor "
            "parallelism?). Use `nn.sharding.with_parallel(module, nn.sharding.ParallelConfig(tp_axis=...))` "
            "to match how they are placed, or place them with `partition_specs(module)`."
        )
    if rows * tp != m.dim:
        raise ValueError(
            f"{owner}: with tp_axis={tp_axis!r} of size {tp}, each device holds "
            f"{m.dim} / {tp} = {m.dim // tp} rows of the q/k/v weights (column-parallel); "
            f"received {rows}. Place the module with `partition_specs(module)` as its "
            "`shard_map` in_spec."
        )
    return m.num_heads // tp


def qk_rms_norm(norm: RMSNorm | None, x: Array, m) -> Array:
    """Wan's q/k RMSNorm over the whole inner dim of the attention module `m`; over this
    device's feature shard under TP (the statistic `psum`-ed over `tp_axis`)."""
    if norm is None:
        return x
    if m.parallel.tp_axis is None:
        return norm(x)
    return tp_sharded_rms_norm(x, norm.weight, m.dim, m.eps, axis_name=m.parallel.tp_axis)


def after_tp(x: Array, first: Array, m) -> Array:
    """Under TP, `x` made to wait for `first`, so that `norm_k`'s psum follows `norm_q`'s
    (one collective order on every device, see `vidax_eqx._order`)."""
    return x if m.parallel.tp_axis is None else after(x, first)


def local_columns(x: Array, m, heads: int) -> Array:
    """The columns of this device's `heads` heads of a per-token `(S, dim)` input of the
    attention module `m` (all of them without TP)."""
    tp_axis = m.parallel.tp_axis
    if tp_axis is None:
        return x
    width = heads * m.head_dim
    return lax.dynamic_slice_in_dim(x, lax.axis_index(tp_axis) * width, width, axis=1)
