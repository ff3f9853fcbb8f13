"""Flax linen shim: a drop-in for the original `vidax.core`.

Code written against `vidax.core` changes one import line
(`from vidax_eqx import flax as core`): the seven documented names are here with
the same argument names, defaults and layouts —

- `dot_product_attention`, `local_attention`, `sequence_parallel_self_attention`,
    `sequence_parallel_joint_self_attention`, `chunk_by_rank`: the functions of
    [`vidax_eqx.core`][] themselves;
- `RMSNorm(dim, eps=1e-6)` and `TPShardedRMSNorm(dim_local, global_dim, eps=1e-6)`:
    linen modules with a parameter `scale`, computed by the same functions as the
    Equinox modules of [`vidax_eqx.nn`][], so the same weights give bit-identical
    output through either.

Beyond those: [`attention_fn`][] plugs the kernels into
`flax.linen.MultiHeadDotProductAttention(attention_fn=...)`, and
[`rms_norm_to_linen`][] / [`rms_norm_from_linen`][] convert norm weights between
the two module systems.

This is the only module of the package that imports Flax (an optional
dependency: `pip install flax`, or `pip install '.[flax]'` in a clone); `import vidax_eqx`
does not.

One deliberate change from the original `vidax.core`: the norms' result dtype is
the promotion of the input and `scale` dtypes (as in PyTorch, and as Wan's
`WanRMSNorm` computes it), so a bfloat16 input with the default float32 `scale`
gives float32 where the original gave bfloat16. Pass `param_dtype=jnp.bfloat16`,
or cast the result, to keep bfloat16.
"""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

try:
    import flax.linen as linen
except ImportError as e:  # pragma: no cover - exercised only without flax
    raise ImportError(
        "vidax_eqx.flax needs Flax, an optional dependency: pip install flax (or pip install "
        "'.[flax]' in a clone of vidax_eqx). "
        "The Equinox modules and vidax_eqx.core work without it."
    ) from e

from . import nn as _nn
from .core import (
    chunk_by_rank as chunk_by_rank,
    dot_product_attention as dot_product_attention,
    local_attention as local_attention,
    sequence_parallel_joint_self_attention as sequence_parallel_joint_self_attention,
    sequence_parallel_self_attention as sequence_parallel_self_attention,
)
from .kernels import attention as _attention, SlidingTileMask
from .nn.functional import rms_norm as _rms_norm, tp_sharded_rms_norm as _tp_sharded_rms_norm
from .parallel import axis_size, TP_AXIS


__all__ = [
    "attention_fn",
    "chunk_by_rank",
    "dot_product_attention",
    "local_attention",
    "RMSNorm",
    "rms_norm_from_linen",
    "rms_norm_to_linen",
    "sequence_parallel_joint_self_attention",
    "sequence_parallel_self_attention",
    "TPShardedRMSNorm",
]


# ---------------------------------------------------------------------------- norms


def _check_last_axis(cls: str, name: str, size, x) -> None:
    """The linen norms' shape check (the Equinox modules get theirs from jaxtyping)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{cls}: `{name}` must be a positive int; received {size!r}.")
    if x.ndim < 1 or x.shape[-1] != size:
        raise ValueError(
            f"{cls}: the last axis of `x` is normalized and must have size {name}={size}; "
            f"received shape {x.shape}."
        )


class RMSNorm(linen.Module):
    """Wan's RMSNorm as a linen module, with a parameter `scale` of shape `(dim,)`.

    Computes [`vidax_eqx.nn.functional.rms_norm`][] (the function behind the
    Equinox [`vidax_eqx.nn.RMSNorm`][]): float32 statistics over the last axis, cast
    back to the input dtype, times `scale`, in the promotion of the two dtypes.

    **Attributes:**

    - `dim`: the size of the normalized (last) axis.
    - `eps`: added to the mean square before the reciprocal square root.
    - `param_dtype`: the dtype of `scale` (initialized to ones).
    """

    dim: int
    eps: float = 1e-6
    param_dtype: Any = jnp.float32

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """**Arguments:**

        - `x`: any shape `(..., dim)`; the last axis is normalized.

        **Returns:**

        The same shape, in the promotion of `x`'s and `scale`'s dtypes.
        """
        x = jnp.asarray(x)
        _check_last_axis("RMSNorm", "dim", self.dim, x)
        scale = self.param("scale", linen.initializers.ones, (self.dim,), self.param_dtype)
        with jax.named_scope("vidax_eqx.flax.RMSNorm"):
            return _rms_norm(x, scale, self.eps)


class TPShardedRMSNorm(linen.Module):
    """RMSNorm over a feature axis column-sharded over the `"tp"` mesh axis, as a linen module.

    Call it inside `jax.shard_map`: `x`'s last axis is this device's `dim_local`
    slice of `global_dim` features, and `scale` `(dim_local,)` is this device's
    slice of the weight (give the global `(global_dim,)` parameter the in-spec
    `P("tp")`). Local sums of squares are `psum`-ed over `axis_name`
    ([`vidax_eqx.nn.functional.tp_sharded_rms_norm`][]), so the result equals
    [`RMSNorm`][] over the full width. Raises `ValueError` outside `shard_map` (`.init`
    too: the message says how to make the parameters without one) or when
    `dim_local * axis_size != global_dim`.

    **Attributes:**

    - `dim_local`: the features this device holds.
    - `global_dim`: the full feature width.
    - `eps`: added to the mean square before the reciprocal square root.
    - `axis_name`: the mesh axis the features are sharded over (default `"tp"`).
    - `param_dtype`: the dtype of `scale` (initialized to ones).
    """

    dim_local: int
    global_dim: int
    eps: float = 1e-6
    axis_name: str = TP_AXIS
    param_dtype: Any = jnp.float32

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """**Arguments:**

        - `x`: this device's features `(..., dim_local)`, inside `jax.shard_map`.

        **Returns:**

        The same shape, in the promotion of `x`'s and `scale`'s dtypes.
        """
        x = jnp.asarray(x)
        _check_last_axis("TPShardedRMSNorm", "dim_local", self.dim_local, x)
        scale = self.param("scale", linen.initializers.ones, (self.dim_local,), self.param_dtype)
        try:
            axis_size(self.axis_name)
        except ValueError:
            what = ".init" if self.is_initializing() else ".apply"
            raise ValueError(
                f"TPShardedRMSNorm(dim_local={self.dim_local}, global_dim={self.global_dim}){what}: "
                f"the mesh axis {self.axis_name!r} does not exist in the current context. Call .init and .apply "
                f"inside jax.shard_map over a mesh with that axis: the `scale` parameter is this "
                f"device's ({self.dim_local},) slice (give the global ({self.global_dim},) one "
                f"the in-spec P({self.axis_name!r})). The parameters need no forward pass: "
                f"{{'params': {{'scale': jnp.ones(({self.dim_local},))}}}} is what .init makes."
            ) from None
        with jax.named_scope("vidax_eqx.flax.TPShardedRMSNorm"):
            return _tp_sharded_rms_norm(x, scale, self.global_dim, self.eps, self.axis_name)


def rms_norm_to_linen(module: _nn.RMSNorm | _nn.TPShardedRMSNorm) -> dict:
    """The linen variables holding an Equinox norm's weight.

    **Arguments:**

    - `module`: a [`vidax_eqx.nn.RMSNorm`][] or [`vidax_eqx.nn.TPShardedRMSNorm`][].

    **Returns:**

    `{"params": {"scale": module.weight}}`, to pass to `.apply` of the linen
    [`RMSNorm`][]`(module.dim, module.eps)` (or
    [`TPShardedRMSNorm`][]`(module.dim_local, module.global_dim, module.eps,
    axis_name=module.axis_name)`). The array is shared, not copied.
    """
    if not isinstance(module, (_nn.RMSNorm, _nn.TPShardedRMSNorm)):
        raise TypeError(
            "rms_norm_to_linen takes a vidax_eqx.nn.RMSNorm or TPShardedRMSNorm; "
            f"received {type(module).__name__}."
        )
    return {"params": {"scale": module.weight}}


def rms_norm_from_linen(
    module: RMSNorm | TPShardedRMSNorm, variables: dict
) -> _nn.RMSNorm | _nn.TPShardedRMSNorm:
    """The Equinox norm equivalent to a linen norm with the given variables.

    **Arguments:**

    - `module`: the linen [`RMSNorm`][] or [`TPShardedRMSNorm`][] (its configuration:
        `dim` or `dim_local` / `global_dim`, `eps`, `axis_name`).
    - `variables`: its variables, `{"params": {"scale": ...}}` as `init` returns them
        (or the inner `{"scale": ...}`).

    **Returns:**

    A [`vidax_eqx.nn.RMSNorm`][] (or [`vidax_eqx.nn.TPShardedRMSNorm`][]) whose
    `weight` is `scale`, in `scale`'s dtype. For `TPShardedRMSNorm`, `scale` may be
    this device's `(dim_local,)` slice or the global `(global_dim,)` weight that
    `shard_map` will slice with the in-spec `P("tp")`.
    """
    params = variables.get("params", variables) if isinstance(variables, dict) else None
    if not isinstance(params, dict) or "scale" not in params:
        raise ValueError(
            "rms_norm_from_linen needs the linen variables {'params': {'scale': array}}; "
            f"received {variables!r:.200}."
        )
    scale = jnp.asarray(params["scale"])
    if isinstance(module, RMSNorm):
        out = _nn.RMSNorm(module.dim, module.eps, dtype=scale.dtype)
        allowed = [(module.dim,)]
    elif isinstance(module, TPShardedRMSNorm):
        out = _nn.TPShardedRMSNorm(
            module.dim_local, module.global_dim, module.eps,
            axis_name=module.axis_name, dtype=scale.dtype,
        )
        allowed = [(module.dim_local,), (module.global_dim,)]
    else:
        raise TypeError(
            "rms_norm_from_linen takes a vidax_eqx.flax.RMSNorm or TPShardedRMSNorm; "
            f"received {type(module).__name__}."
        )
    if scale.shape not in allowed:
        raise ValueError(
            f"rms_norm_from_linen: `scale` must have shape {' or '.join(map(str, allowed))} "
            f"for a linen {type(module).__name__} of that size; received {scale.shape}."
        )
    return eqx.tree_at(lambda m: m.weight, out, scale)


# ---------------------------------------------------------------------------- attention_fn


def _fold_batch(x, batch_shape: tuple[int, ...], name: str):
    """Broadcasts a mask/bias `(batch..., #H, #S_q, #S_k)` over `batch_shape`, folded to one axis."""
    nb = len(batch_shape)
    if x.ndim > nb + 3:
        raise ValueError(
            f"attention_fn: `{name}` must be broadcastable to (batch..., heads, q_length, "
            f"kv_length) with {nb} batch axes; received shape {x.shape}."
        )
    x = x.reshape((1,) * (nb + 3 - x.ndim) + x.shape)
    x = jnp.broadcast_to(x, batch_shape + x.shape[nb:])
    return x.reshape((math.prod(batch_shape),) + x.shape[nb:])


def attention_fn(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: linen.Module | None = None,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum: Any = None,
    attn_weights_value_einsum: Any = None,
    *,
    implementation: str = "auto",
) -> jax.Array:
    """`flax.linen.dot_product_attention`'s calling convention over [`vidax_eqx.kernels.attention`][].

    Use it as `flax.linen.MultiHeadDotProductAttention(..., attention_fn=attention_fn)`,
    or `functools.partial(attention_fn, implementation="blockwise")` to pin a kernel.
    The arguments keep Flax's names (`key` here is the keys array, as in Flax).
    The score matrix is never materialized where the chosen kernel does not need it.

    **Arguments:**

    - `query`: `(batch..., q_length, heads, depth)`.
    - `key`, `value`: `(batch..., kv_length, kv_heads, depth)`; `kv_heads` may divide
        `heads` (GQA), which Flax's own function does not allow.
    - `bias`: additive logit bias broadcastable to `(batch..., heads, q_length, kv_length)`.
    - `mask`: boolean, same broadcasting; `True` may attend.
    - `dropout_rate`, `deterministic`, `dropout_rng`, `broadcast_dropout`: attention
        dropout is not implemented: `dropout_rate > 0` with `deterministic=False`
        raises `NotImplementedError`; otherwise they are ignored.
    - `dtype`: the computation dtype; `query`, `key`, `value` are cast to it (default:
        their promoted dtype).
    - `precision`: only `None` / default; the kernels accumulate in float32 and take
        no matmul precision, so another value raises `NotImplementedError`.
    - `module`: passed by Flax when `sow_weights=True`; the kernels do not produce
        attention weights, so it raises `NotImplementedError`.
    - `force_fp32_for_softmax`: accepted; softmax statistics are always float32.
    - `qk_attn_weights_einsum`, `attn_weights_value_einsum`: custom (e.g. quantized)
        einsums are not supported; anything but `None` raises `NotImplementedError`.
    - `implementation`: the kernel, as in [`vidax_eqx.kernels.attention`][].

    **Returns:**

    `(batch..., q_length, heads, depth)` in the computation dtype.

    One difference from Flax: a query row whose mask hides every key gives 0 here
    (never NaN), where Flax's softmax over equal masked logits averages all values.
    """
    if dropout_rate > 0.0 and not deterministic:
        raise NotImplementedError(
            f"vidax_eqx.flax.attention_fn: attention dropout (dropout_rate={dropout_rate}, "
            "deterministic=False) is not implemented by the vidax_eqx kernels. Set "
            "dropout_rate=0.0 or deterministic=True, or use flax.linen.dot_product_attention."
        )
    if module is not None:
        raise NotImplementedError(
            "vidax_eqx.flax.attention_fn: sow_weights=True needs the attention weights, which "
            "the vidax_eqx kernels never materialize. Use flax.linen.dot_product_attention to "
            "inspect them."
        )
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
        raise NotImplementedError(
            "vidax_eqx.flax.attention_fn: custom qk_attn_weights_einsum / "
            "attn_weights_value_einsum (e.g. AQT quantization) are not supported by the "
            "vidax_eqx kernels."
        )
    if precision is not None and precision not in (jax.lax.Precision.DEFAULT, "default"):
        raise NotImplementedError(
            f"vidax_eqx.flax.attention_fn: precision={precision!r} is not supported; the "
            "vidax_eqx kernels choose their own matmul precision (float32 accumulation). "
            "Leave precision=None."
        )
    del broadcast_dropout, dropout_rng, force_fp32_for_softmax
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    if dtype is None:
        dtype = jnp.result_type(query.dtype, key.dtype, value.dtype)
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    if query.ndim < 3 or key.ndim != query.ndim or value.shape != key.shape:
        raise ValueError(
            "attention_fn: query must be (batch..., q_length, heads, depth) and key/value "
            "(batch..., kv_length, kv_heads, depth) with the same batch axes; received "
            f"query {query.shape}, key {key.shape}, value {value.shape}."
        )
    batch_shape = query.shape[:-3]
    if key.shape[:-3] != batch_shape:
        raise ValueError(
            f"attention_fn: query and key must share batch axes; received {batch_shape} and "
            f"{key.shape[:-3]}."
        )
    B = math.prod(batch_shape)
    q = query.reshape((B,) + query.shape[-3:])
    k = key.reshape((B,) + key.shape[-3:])
    v = value.reshape((B,) + value.shape[-3:])
    if bias is not None:
        bias = _fold_batch(jnp.asarray(bias), batch_shape, "bias")
    if mask is not None and not isinstance(mask, SlidingTileMask):  # a tile mask: as it is
        mask = _fold_batch(jnp.asarray(mask).astype(bool), batch_shape, "mask")
    with jax.named_scope("vidax_eqx.flax.attention_fn"):
        out = _attention(q, k, v, bias=bias, mask=mask, implementation=implementation)
    return out.reshape(query.shape)

