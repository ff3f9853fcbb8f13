"""The parts of the T5 / UMT5 encoder: the relative position buckets, the embeddings
(token table and T5's shared position bias) and one encoder layer, each as transformers
names its fields, with Megatron tensor parallelism and FSDP."""

import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ... import kernels, nn
from ...nn import sharding
from ...parallel import axis_size
from ._config import T5EncoderConfig
from ._init import linear, normal_table


def relative_position_buckets(length: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """T5's bidirectional relative position buckets `(length, length)` int32 of query `i`
    and key `j` (`j - i`), with transformers' float32 arithmetic: half the buckets for
    each direction, half of those exact distances, the rest logarithmic up to
    `max_distance`."""
    relative = np.arange(length)[None, :] - np.arange(length)[:, None]
    half = num_buckets // 2
    buckets = (relative > 0).astype(np.int64) * half
    distance = np.abs(relative)
    max_exact = half // 2
    small = distance < max_exact
    ratio = np.where(small, max_exact, distance).astype(np.float32) / np.float32(max_exact)
    log_ratio = np.log(ratio) / np.float32(math.log(max_distance / max_exact))
    large = max_exact + (log_ratio * np.float32(half - max_exact)).astype(np.int64)
    large = np.minimum(large, half - 1)
    return (buckets + np.where(small, distance, large)).astype(np.int32)


def position_bias(embedding: eqx.nn.Embedding, buckets) -> Float[Array, "H S S"]:
    """The relative position bias `(heads, S, S)` of `buckets` `(S, S)`: this device's
    heads when the table `(num_buckets, heads)` is split over them."""
    return jnp.transpose(embedding.weight[buckets], (2, 0, 1))


def _linear(layer: eqx.nn.Linear, x):
    return x @ layer.weight.T


def _row_parallel(layer: eqx.nn.Linear, x, tp_axis):
    """A row-parallel projection: this device's partial product summed over `tp_axis`."""
    y = x @ layer.weight.T
    return y if tp_axis is None else lax.psum(y, tp_axis)


def _names(axes: tuple[str, ...]):
    return axes[0] if len(axes) == 1 else axes


def vocab_lookup(weight, ids: Int[Array, "*B S"], tp_axis: str | None) -> Array:
    """The rows of an embedding table at `ids`, exactly, without ever gathering the table.

    On one device `weight[ids]`. Inside `shard_map`, `weight` is this device's block
    as [`vidax_eqx.nn.sharding.partition_specs`][] places a `MegatronSplit.vocab` table:
    its rows (the vocabulary) split over `tp_axis` and/or, under FSDP, its rows or its
    columns split over the FSDP axes (an [`vidax_eqx.nn.sharding.FSDPShard`][]).

    - Rows over `tp_axis` (whose devices have the same `ids`): each device takes the
        ids in its rows (zeros for the others) and one `psum` adds the devices' rows,
        exactly (one term is not zero).
    - Over FSDP axes, whose devices may hold different texts (the batch split over
        them): the ids of every device of those axes are gathered first (`(n, *B, S)`
        ints), each device looks them all up in its block, and the results go back to
        their devices: a `psum_scatter` of `(n, *B, S, dim)` when the rows are split,
        an `all_to_all` of the column blocks when the columns are.

    Ids are wrapped and clamped to the vocabulary as JAX's indexing does on one device.
    """
    if not isinstance(weight, sharding.FSDPShard) and tp_axis is None:
        return weight[ids]
    fsdp, rows_fsdp = (), False
    if isinstance(weight, sharding.FSDPShard):
        fsdp, rows_fsdp = weight.axes, weight.dim == -2
        if weight.inner_axes or (rows_fsdp and tp_axis is not None):
            raise ValueError(
                f"T5Encoder: the token embedding's block is split over "
                f"{weight.axes + weight.inner_axes} on dimension {weight.dim} with "
                f"tp_axis={tp_axis!r}: not a placement of nn.sharding.partition_specs(model, "
                "mesh). Place the model by it.")
        weight = weight.shard
    if fsdp:  # every device of the FSDP axes looks up every device's ids
        ids = lax.all_gather(ids, _names(fsdp))  # (n, *B, S)
    rows = fsdp if rows_fsdp else () if tp_axis is None else (tp_axis,)
    n = weight.shape[0]
    if rows:
        vocab = n * math.prod(axis_size(a, what="Tensor-parallel") for a in rows)
        ids = jnp.clip(jnp.where(ids < 0, ids + vocab, ids), 0, vocab - 1)
        local = ids - lax.axis_index(_names(rows)) * n
        hit = (local >= 0) & (local < n)
        x = jnp.where(hit[..., None], weight[jnp.clip(local, 0, n - 1)],
                      jnp.zeros((), weight.dtype))
    else:
        x = weight[ids]
    if rows_fsdp:  # (n, ..., dim) -> this device's (..., dim), summed over the row blocks
        return lax.psum_scatter(x, _names(fsdp), scatter_dimension=0)
    if tp_axis is not None:
        x = lax.psum(x, tp_axis)
    if fsdp:  # (n, ..., dim / n) -> this device's (..., dim), its ids' column blocks
        x = lax.all_to_all(x, _names(fsdp), 0, x.ndim - 1, tiled=True)[0]
    return x


class T5Embeddings(nn.sharding.AbstractParallelLayer):
    """The encoder's inputs: the token embedding `shared` and, for T5 v1.1, the relative
    position bias its first layer computes for every layer (`None` for UMT5, whose
    layers have their own).

    **Tensor parallelism:** the token table is split over its rows (Megatron's
    vocabulary-parallel embedding, [`vocab_lookup`][]), the bias table over its heads.
    Under FSDP the bias table is gathered before use; the token table never is (each
    device looks up its own block).
    """

    shared: eqx.nn.Embedding
    relative_attention_bias: eqx.nn.Embedding | None
    parallel: sharding.ParallelConfig
    megatron: ClassVar[sharding.MegatronSplit] = sharding.MegatronSplit(
        vocab=("shared",), sharded_norms=("relative_attention_bias",))

    def __init__(self, config: T5EncoderConfig, *, parallel: sharding.ParallelConfig, dtype,
                 key: PRNGKeyArray):
        c = config
        k1, k2 = jax.random.split(key)
        # (`eqx.nn.Embedding`'s normal draw, in bounded memory: see `_init.py`)
        self.shared = eqx.nn.Embedding(weight=normal_table(k1, (c.vocab_size, c.d_model), dtype))
        self.relative_attention_bias = (
            None if c.per_layer_bias else
            eqx.nn.Embedding(c.relative_attention_num_buckets, c.num_heads, dtype=dtype, key=k2))
        self.parallel = parallel

    def __call__(self, input_ids: Int[Array, "*B S"], buckets: Int[Array, "S S"]):
        """`(x, bias)`: the token embeddings `(*B, S, d_model)` of one example or a batch
        (one lookup, one set of collectives, for the batch) and T5's shared position
        bias `(heads, S, S)` (this device's heads under tensor parallelism), or `None`."""
        with jax.named_scope("vidax_eqx.models.T5Embeddings"):
            self, (input_ids, buckets) = sharding.fsdp_gather(
                self, (input_ids, buckets), exclude=lambda m: m.shared)
            x = vocab_lookup(self.shared.weight, input_ids, self.parallel.tp_axis)
            bias = (None if self.relative_attention_bias is None
                    else position_bias(self.relative_attention_bias, buckets))
            return x, bias


class T5Layer(nn.sharding.AbstractParallelLayer):
    """One encoder layer (transformers' `T5Block` / `UMT5Block`): RMS norm, unscaled
    self-attention with the relative position bias, residual; RMS norm, gated-GELU
    feed-forward, residual.

    **Tensor parallelism** (`parallel.tp_axis`): each device computes `num_heads / tp`
    heads and `d_ff / tp` hidden units: `q`, `k`, `v`, `wi_0`, `wi_1` column-parallel,
    `o` and `wo` row-parallel (one `psum` each), the position bias table split by
    heads. Under FSDP the layer gathers its weights first.
    """

    attn_norm: nn.RMSNorm
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    relative_attention_bias: eqx.nn.Embedding | None
    ff_norm: nn.RMSNorm
    wi_0: eqx.nn.Linear
    wi_1: eqx.nn.Linear
    wo: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)
    d_kv: int = eqx.field(static=True)
    d_ff: int = eqx.field(static=True)
    parallel: sharding.ParallelConfig
    megatron: ClassVar[sharding.MegatronSplit] = sharding.MegatronSplit(
        column=("q", "k", "v", "wi_0", "wi_1"), row=("o", "wo"),
        sharded_norms=("relative_attention_bias",))

    def __init__(self, config: T5EncoderConfig, *, parallel: sharding.ParallelConfig, dtype,
                 key: PRNGKeyArray):
        c = config
        inner = c.num_heads * c.d_kv
        keys = jax.random.split(key, 8)
        # (`eqx.nn.Linear`s, their weights drawn in bounded memory: see `_init.py`)
        self.num_heads, self.d_kv, self.d_ff = c.num_heads, c.d_kv, c.d_ff
        self.attn_norm = nn.RMSNorm(c.d_model, c.layer_norm_epsilon, dtype=dtype)
        self.q = linear(c.d_model, inner, dtype=dtype, key=keys[0])
        self.k = linear(c.d_model, inner, dtype=dtype, key=keys[1])
        self.v = linear(c.d_model, inner, dtype=dtype, key=keys[2])
        self.o = linear(inner, c.d_model, dtype=dtype, key=keys[3])
        self.relative_attention_bias = (
            eqx.nn.Embedding(c.relative_attention_num_buckets, c.num_heads, dtype=dtype,
                             key=keys[4]) if c.per_layer_bias else None)
        self.ff_norm = nn.RMSNorm(c.d_model, c.layer_norm_epsilon, dtype=dtype)
        self.wi_0 = linear(c.d_model, c.d_ff, dtype=dtype, key=keys[5])
        self.wi_1 = linear(c.d_model, c.d_ff, dtype=dtype, key=keys[6])
        self.wo = linear(c.d_ff, c.d_model, dtype=dtype, key=keys[7])
        self.parallel = parallel

    def __call__(self, x: Float[Array, "S D"], bias: Float[Array, "H S S"] | None,
                 buckets: Int[Array, "S S"], valid: Bool[Array, "S"],
                 implementation) -> Float[Array, "S D"]:
        """`x` after this layer; `bias` the shared position bias (T5), or `None` to take
        this layer's own from `buckets` (UMT5); `valid` the keys that may be attended."""
        with jax.named_scope("vidax_eqx.models.T5Layer"):
            # (Not `bias`: T5's shared bias holds this device's heads, and the inputs
            # tied to the gathers would vary over `tp_axis` with it.)
            self, (x, buckets, valid) = sharding.fsdp_gather(self, (x, buckets, valid))
            tp_axis = self.parallel.tp_axis
            heads = self._local_heads()
            if bias is None:
                bias = position_bias(self.relative_attention_bias, buckets)
            s = x.shape[0]
            h = self.attn_norm(x)
            q, k, v = (_linear(p, h).reshape(s, heads, self.d_kv)[None]
                       for p in (self.q, self.k, self.v))
            a = kernels.attention(q, k, v, bias=bias[None].astype(q.dtype),
                                  mask=valid[None, None, None, :], scale=1.0,
                                  implementation=implementation)
            x = x + _row_parallel(self.o, a[0].reshape(s, -1), tp_axis)
            h = self.ff_norm(x)
            h = jax.nn.gelu(_linear(self.wi_0, h), approximate=True) * _linear(self.wi_1, h)
            return x + _row_parallel(self.wo, h, tp_axis)

    def _local_heads(self) -> int:
        """This device's heads (all of them without tensor parallelism), after checking
        that the column-parallel weights are this device's share."""
        tp_axis = self.parallel.tp_axis
        tp = 1 if tp_axis is None else axis_size(tp_axis, what="Tensor-parallel")
        rows, hidden = self.q.weight.shape[0], self.wi_0.weight.shape[0]
        if rows * tp != self.num_heads * self.d_kv or hidden * tp != self.d_ff:
            raise ValueError(
                f"T5Encoder: with tp_axis={tp_axis!r} ({tp} devices) each device holds "
                f"num_heads * d_kv / tp = {self.num_heads * self.d_kv} / {tp} rows of q, k, v "
                f"and d_ff / tp = {self.d_ff} / {tp} rows of wi_0, wi_1; received {rows} and "
                f"{hidden}. Place the model with nn.sharding.partition_specs(model, mesh) "
                "(T5Encoder.encode(..., mesh=) does), with a ParallelConfig that matches it.")
        return self.num_heads // tp
