"""The T5 / UMT5 text encoder: transformers' `T5EncoderModel` (T5 v1.1, CogVideoX's) and
`UMT5EncoderModel` (Wan 2.1's and 2.2's) as one Equinox module."""

import math
import re
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ... import interop, kernels, nn
from .._checkpoint import read_config
from ._config import T5EncoderConfig


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


def _linear(layer: eqx.nn.Linear, x):
    return x @ layer.weight.T


class T5Layer(eqx.Module):
    """One encoder layer (transformers' `T5Block` / `UMT5Block`): RMS norm, unscaled
    self-attention with the relative position bias, residual; RMS norm, gated-GELU
    feed-forward, residual."""

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

    def __init__(self, config: T5EncoderConfig, *, dtype, key: PRNGKeyArray):
        c = config
        inner = c.num_heads * c.d_kv
        keys = jax.random.split(key, 8)
        self.num_heads, self.d_kv = c.num_heads, c.d_kv
        self.attn_norm = nn.RMSNorm(c.d_model, c.layer_norm_epsilon, dtype=dtype)
        self.q = eqx.nn.Linear(c.d_model, inner, use_bias=False, dtype=dtype, key=keys[0])
        self.k = eqx.nn.Linear(c.d_model, inner, use_bias=False, dtype=dtype, key=keys[1])
        self.v = eqx.nn.Linear(c.d_model, inner, use_bias=False, dtype=dtype, key=keys[2])
        self.o = eqx.nn.Linear(inner, c.d_model, use_bias=False, dtype=dtype, key=keys[3])
        self.relative_attention_bias = (
            eqx.nn.Embedding(c.relative_attention_num_buckets, c.num_heads, dtype=dtype,
                             key=keys[4]) if c.per_layer_bias else None)
        self.ff_norm = nn.RMSNorm(c.d_model, c.layer_norm_epsilon, dtype=dtype)
        self.wi_0 = eqx.nn.Linear(c.d_model, c.d_ff, use_bias=False, dtype=dtype, key=keys[5])
        self.wi_1 = eqx.nn.Linear(c.d_model, c.d_ff, use_bias=False, dtype=dtype, key=keys[6])
        self.wo = eqx.nn.Linear(c.d_ff, c.d_model, use_bias=False, dtype=dtype, key=keys[7])

    def __call__(self, x: Float[Array, "S D"], bias: Float[Array, "H S S"] | None,
                 buckets: Int[Array, "S S"], valid: Bool[Array, "S"],
                 implementation) -> Float[Array, "S D"]:
        """`x` after this layer; `bias` the shared position bias (T5), or `None` to take
        this layer's own from `buckets` (UMT5); `valid` the keys that may be attended."""
        if bias is None:
            bias = position_bias(self.relative_attention_bias, buckets)
        s = x.shape[0]
        h = self.attn_norm(x)
        q, k, v = (_linear(p, h).reshape(s, self.num_heads, self.d_kv)[None]
                   for p in (self.q, self.k, self.v))
        a = kernels.attention(q, k, v, bias=bias[None].astype(q.dtype),
                              mask=valid[None, None, None, :], scale=1.0,
                              implementation=implementation)
        x = x + _linear(self.o, a[0].reshape(s, -1))
        h = self.ff_norm(x)
        h = jax.nn.gelu(_linear(self.wi_0, h), approximate=True) * _linear(self.wi_1, h)
        return x + _linear(self.wo, h)


def position_bias(embedding: eqx.nn.Embedding, buckets) -> Float[Array, "H S S"]:
    return jnp.transpose(embedding.weight[buckets], (2, 0, 1))


# This module's field names -> transformers' names under `encoder.block.{i}.`.
_LAYER_NAMES = {
    "attn_norm": "layer.0.layer_norm",
    "q": "layer.0.SelfAttention.q",
    "k": "layer.0.SelfAttention.k",
    "v": "layer.0.SelfAttention.v",
    "o": "layer.0.SelfAttention.o",
    "relative_attention_bias": "layer.0.SelfAttention.relative_attention_bias",
    "ff_norm": "layer.1.layer_norm",
    "wi_0": "layer.1.DenseReluDense.wi_0",
    "wi_1": "layer.1.DenseReluDense.wi_1",
    "wo": "layer.1.DenseReluDense.wo",
}
_TOP_NAMES = {
    "shared.weight": "shared.weight",
    "final_layer_norm.weight": "encoder.final_layer_norm.weight",
    "relative_attention_bias.weight":
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
}
# transformers' tied copy of `shared.weight` that some checkpoints also store.
_TIED = "encoder.embed_tokens.weight"


def rename(name: str, naming: str) -> str:
    """This module's parameter name -> transformers' (`load_state_dict`'s `rename=`)."""
    del naming  # both namings are transformers'
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = re.fullmatch(r"blocks\.(\d+)\.(\w+)\.weight", name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"T5Encoder: no transformers name for the parameter {name!r}.")
    return f"encoder.block.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


class _Hidden(Mapping):
    """A tensor mapping without one key (read lazily, one tensor at a time)."""

    def __init__(self, tensors, hidden: str):
        self._tensors, self._hidden = tensors, hidden

    def __getitem__(self, name):
        if name == self._hidden:
            raise KeyError(name)
        return self._tensors[name]

    def __iter__(self):
        return (k for k in self._tensors.keys() if k != self._hidden)

    def __len__(self):
        return len(self._tensors) - 1


def _check_inputs(input_ids, attention_mask, vocab_size):
    """`(input_ids, valid)` checked: int ids `(S,)`, a bool mask `(S,)`."""
    if not hasattr(input_ids, "ndim") or input_ids.ndim != 1:
        shape = getattr(input_ids, "shape", type(input_ids).__name__)
        raise ValueError(
            "T5Encoder: `input_ids` must be one example's token ids, an int array (S,); "
            f"received {shape}. Map a batch with jax.vmap.")
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError("T5Encoder: `input_ids` must be an int array; received "
                         f"{input_ids.dtype}.")
    s = input_ids.shape[0]
    if attention_mask is None:
        return input_ids, jnp.ones((s,), bool)
    shape = getattr(attention_mask, "shape", None)
    if shape != (s,):
        raise ValueError(
            f"T5Encoder: `attention_mask` must have `input_ids`'s shape ({s},); received "
            f"{shape if shape is not None else type(attention_mask).__name__}.")
    dtype = attention_mask.dtype
    if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer)):
        raise ValueError("T5Encoder: `attention_mask` must be an int or bool array; "
                         f"received {dtype}.")
    if not isinstance(input_ids, jax.core.Tracer) and s:
        low, high = int(np.min(input_ids)), int(np.max(input_ids))
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"T5Encoder: `input_ids` must lie in [0, {vocab_size}) (the config's "
                f"vocab_size); received ids from {low} to {high}.")
    return input_ids, attention_mask != 0


class T5Encoder(eqx.Module):
    """transformers' `UMT5EncoderModel` (Wan 2.1 / 2.2) and `T5EncoderModel` (T5 v1.1,
    CogVideoX): token embedding, `num_layers` layers of unscaled self-attention with a
    relative position bias and a gated-GELU feed-forward, final RMS norm. One example
    per call; `jax.vmap` for a batch.

    The layers are stacked along a leading axis (`blocks`, built with
    `eqx.filter_vmap`) and run by `lax.scan`. With `config.per_layer_bias` (UMT5) each
    layer has its own `relative_attention_bias`; otherwise (T5) the encoder's
    `relative_attention_bias` (transformers' first layer's) is computed once and
    shared by every layer.
    """

    shared: eqx.nn.Embedding
    relative_attention_bias: eqx.nn.Embedding | None
    blocks: T5Layer
    final_layer_norm: nn.RMSNorm
    config: T5EncoderConfig = eqx.field(static=True)
    implementation: str = eqx.field(static=True)

    def __init__(self, config: T5EncoderConfig, *, dtype=jnp.float32,
                 implementation: str = "auto", key: PRNGKeyArray):
        """**Arguments:**

        - `config`: the architecture ([`T5EncoderConfig`][vidax_eqx.models.T5EncoderConfig]).
        - `dtype`: the parameters' dtype (the computation's).
        - `implementation`: the attention implementation
            ([`vidax_eqx.kernels.attention`][]'s `implementation`).
        - `key`: a PRNG key for the random initial weights.
        """
        if not isinstance(config, T5EncoderConfig):
            raise ValueError("T5Encoder: `config` must be a T5EncoderConfig; received "
                             f"{type(config).__name__}.")
        c = config
        self.config, self.implementation = c, implementation
        keys = jax.random.split(key, 3)
        self.shared = eqx.nn.Embedding(c.vocab_size, c.d_model, dtype=dtype, key=keys[0])
        self.relative_attention_bias = (
            None if c.per_layer_bias else
            eqx.nn.Embedding(c.relative_attention_num_buckets, c.num_heads, dtype=dtype,
                             key=keys[1]))
        self.blocks = eqx.filter_vmap(lambda k: T5Layer(c, dtype=dtype, key=k))(
            jax.random.split(keys[2], c.num_layers))
        self.final_layer_norm = nn.RMSNorm(c.d_model, c.layer_norm_epsilon, dtype=dtype)

    def __call__(self, input_ids: Int[Array, "S"],
                 attention_mask: Int[Array, "S"] | Bool[Array, "S"] | None = None,
                 ) -> Float[Array, "S {self.config.d_model}"]:
        """**Arguments:**

        - `input_ids`: token ids `(S,)`, integers in `[0, vocab_size)` (checked when
            concrete; a traced id out of range is clamped, as JAX's indexing does).
        - `attention_mask`: `(S,)` int or bool, nonzero for the tokens that may be
            attended to (transformers' `attention_mask`); `None`: all of them.

        **Returns:**

        transformers' `last_hidden_state` of this example, `(S, d_model)` in the
        parameters' dtype, every position computed (a padded position attends to the
        valid ones, as in transformers). An example with no valid token gives
        `final_layer_norm(embedding + ...)` of zero attention outputs where
        transformers attends uniformly.
        """
        c = self.config
        input_ids, valid = _check_inputs(input_ids, attention_mask, c.vocab_size)
        s = input_ids.shape[0]
        buckets = jnp.asarray(relative_position_buckets(
            s, c.relative_attention_num_buckets, c.relative_attention_max_distance))
        bias = (None if self.relative_attention_bias is None
                else position_bias(self.relative_attention_bias, buckets))
        x = self.shared.weight[input_ids]
        arrays, static = eqx.partition(self.blocks, eqx.is_array)

        def step(x, layer):
            layer = eqx.combine(layer, static)
            return layer(x, bias, buckets, valid, self.implementation), None

        x = jax.lax.scan(step, x, arrays)[0]
        return self.final_layer_norm(x)

    @classmethod
    def from_pretrained(cls, path, *, dtype=jnp.float32,
                        implementation: str = "auto") -> "T5Encoder":
        """The encoder of a transformers checkpoint directory (a pipeline's
        `text_encoder/`: config.json and model.safetensors, or shards with their index),
        or of a Hugging Face Hub repository's.

        **Arguments:**

        - `path`: the directory (or Hub repository id).
        - `dtype`: the parameters' dtype; the checkpoint's tensors are cast to it.
        - `implementation`: as for `__init__`.

        **Returns:**

        The encoder with transformers' weights (names `shared.weight`,
        `encoder.block.{i}.layer.0.SelfAttention.q.weight`, ...; a stored
        `encoder.embed_tokens.weight`, the tied copy of `shared.weight`, is not read).
        A missing tensor, an unexpected one, or one whose shape disagrees with
        config.json raises a `ValueError` naming it.
        """
        raw, tensors = read_config(path, "T5Encoder")
        config = T5EncoderConfig.from_dict(raw)
        model = eqx.filter_eval_shape(cls, config, dtype=dtype, implementation=implementation,
                                      key=jax.random.PRNGKey(0))
        if _TIED in tensors:
            tensors = _Hidden(tensors, _TIED)
        return interop.load_state_dict(model, tensors, stacked=("blocks",), rename=rename)
