"""The T5 / UMT5 text encoder: transformers' `T5EncoderModel` (T5 v1.1, CogVideoX's) and
`UMT5EncoderModel` (Wan 2.1's and 2.2's) as one Equinox module, on one device or split
over a mesh."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ..._deprecation import warn_deprecated
from ..._vma import as_varying
from ... import nn
from ...nn import sharding
from ...nn.internal import has_shards
from ...parallel import axis_size
from .._checkpoint import load_pretrained, read_config
from .._layers import check_remat, scan_layers
from ._blocks import relative_position_buckets, T5Embeddings, T5Layer
from ._config import check_tensor_parallel, T5EncoderConfig
from ._init import stack_layers
from ._names import checkpoint_names, rename, TIED
from ._sharded import check_mesh, encode_over_mesh


def _check_inputs(owner, input_ids, attention_mask, vocab_size, *, batched=False):
    """`(input_ids, valid)` checked: int ids `(S,)` (`(B, S)` when `batched`), a bool
    mask of the same shape."""
    ndim = 2 if batched else 1
    if not hasattr(input_ids, "ndim") or input_ids.ndim != ndim:
        shape = getattr(input_ids, "shape", type(input_ids).__name__)
        raise ValueError(
            f"{owner}: `input_ids` must be a batch of token ids, an int array (B, S); "
            f"received {shape}." if batched else
            f"{owner}: `input_ids` must be one example's token ids, an int array (S,); "
            f"received {shape}. Map a batch with jax.vmap.")
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"{owner}: `input_ids` must be an int array; received "
                         f"{input_ids.dtype}.")
    if not isinstance(input_ids, jax.core.Tracer) and input_ids.size:
        low, high = int(np.min(input_ids)), int(np.max(input_ids))
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"{owner}: `input_ids` must lie in [0, {vocab_size}) (the config's "
                f"vocab_size); received ids from {low} to {high}.")
    shape = tuple(input_ids.shape)
    if attention_mask is None:
        return input_ids, jnp.ones(shape, bool)
    got = getattr(attention_mask, "shape", None)
    if got is None or tuple(got) != shape:
        raise ValueError(
            f"{owner}: `attention_mask` must have `input_ids`'s shape {shape}; received "
            f"{got if got is not None else type(attention_mask).__name__}.")
    dtype = attention_mask.dtype
    if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer)):
        raise ValueError(f"{owner}: `attention_mask` must be an int or bool array; "
                         f"received {dtype}.")
    return input_ids, attention_mask != 0


class T5Encoder(eqx.Module):
    """transformers' `UMT5EncoderModel` (Wan 2.1 / 2.2) and `T5EncoderModel` (T5 v1.1,
    CogVideoX): token embedding, `num_layers` layers of unscaled self-attention with a
    relative position bias and a gated-GELU feed-forward, final RMS norm. One example
    per call; `jax.vmap` for a batch, or [`encode`][vidax_eqx.models.T5Encoder.encode]
    (a batch, on one device or over a mesh).

    The layers are stacked along a leading axis (`blocks`, built with
    `eqx.filter_vmap`) and run by `lax.scan`. With `config.per_layer_bias` (UMT5) each
    layer has its own `relative_attention_bias`; otherwise (T5) the encoder's
    (transformers' first layer's, in `embeddings`) is computed once and shared by every
    layer.

    **Parallelism** (the [`vidax_eqx.nn.sharding.ParallelConfig`][] `parallel` of the
    constructor or [`from_pretrained`][vidax_eqx.models.T5Encoder.from_pretrained]; set
    another with [`vidax_eqx.nn.sharding.with_parallel`][]): the encoder is split over a
    mesh for its memory (UMT5-XXL: 5.7B parameters, 22.7 GB in float32), the way the
    transformer is. [`encode`][vidax_eqx.models.T5Encoder.encode]`(..., mesh=mesh)` runs
    it, its weights placed by [`vidax_eqx.nn.sharding.partition_specs`][]`(model, mesh)`
    (place them once with [`vidax_eqx.nn.sharding.shard_module`][], or load them placed
    with `from_pretrained(..., mesh=mesh)`), and gives the one-device numbers to float32
    round-off.

    - `tp_axis` (Megatron): each device of the axis computes `num_heads / tp` heads and
        `d_ff / tp` hidden units: `q`, `k`, `v`, `wi_0`, `wi_1` column-parallel, `o` and
        `wo` row-parallel (one `psum` each per layer), the relative position bias tables
        `(buckets, heads)` split by heads. The token table `shared` `(vocab, d_model)` is
        split over its rows (Megatron's vocabulary-parallel embedding): each device looks
        up the ids in its share of the vocabulary and one `psum` of `(S, d_model)` adds
        them, exactly (one nonzero term), so no device holds or gathers the table (4.2 GB
        in float32 for UMT5's 256384 x 4096). `num_heads`, `d_ff` and `vocab_size` must be
        multiples of the axis size (`ValueError` naming them otherwise).
    - `fsdp_axes` (FSDP): every parameter is stored split over these axes (and over
        `tp_axis` too where tensor parallelism does not split it) on one dimension; each
        layer of the scan gathers its own weights just before it runs (one layer's
        weights whole at a time). The token table is not gathered: its columns split
        over the FSDP axes (rows over `tp_axis`), or its rows without tensor
        parallelism, are looked up in place and the `(S, d_model)` result is summed or
        gathered. An FSDP axis need not carry the batch: its devices then encode the same
        texts (the split is for the weights).
    - Sequence parallelism (`ulysses_axis`, `ring_axis`) is not implemented: texts are
        short (512 tokens); `NotImplementedError`.

    Given the transformer's mesh `("dp", "sp", "tp")` (Ulysses over `sp`, Megatron over
    `tp`), build the encoder with `ParallelConfig(tp_axis="tp", fsdp_axes=("dp", "sp"))`
    (every axis but `tp` is FSDP) and call `encode(ids, mask, mesh=mesh,
    batch_axis="dp")` (or `batch_axis=None` when the batch does not divide `dp`).

    **Fields:** `embeddings` (`shared`, the token embedding, and T5's shared
    `relative_attention_bias` or `None`), `blocks` (the stacked layers), `final_layer_norm`,
    and the static `config` ([`T5EncoderConfig`][vidax_eqx.models.T5EncoderConfig]) and
    `implementation`.
    """

    embeddings: T5Embeddings
    blocks: T5Layer
    final_layer_norm: nn.RMSNorm
    config: T5EncoderConfig = eqx.field(static=True)
    implementation: str = eqx.field(static=True)

    @property
    def shared(self):
        """Deprecated: `embeddings.shared` (the token embedding)."""
        warn_deprecated("T5Encoder.shared", "T5Encoder.embeddings.shared")
        return self.embeddings.shared

    @property
    def relative_attention_bias(self):
        """Deprecated: `embeddings.relative_attention_bias`."""
        warn_deprecated("T5Encoder.relative_attention_bias", "T5Encoder.embeddings.relative_attention_bias")
        return self.embeddings.relative_attention_bias

    def __init__(self, config: T5EncoderConfig, *, dtype=jnp.float32,
                 implementation: str = "auto",
                 parallel: sharding.ParallelConfig = sharding.ParallelConfig(),
                 key: PRNGKeyArray):
        """**Arguments:**

        - `config`: the architecture ([`T5EncoderConfig`][vidax_eqx.models.T5EncoderConfig]).
        - `dtype`: the parameters' dtype (the computation's).
        - `implementation`: the attention implementation
            ([`vidax_eqx.kernels.attention`][]'s `implementation`).
        - `parallel`: how the encoder is split over a mesh (see the class): its
            `tp_axis` and `fsdp_axes`; default one device.
        - `key`: a PRNG key for the random initial weights.
        """
        if not isinstance(config, T5EncoderConfig):
            raise ValueError("T5Encoder: `config` must be a T5EncoderConfig; received "
                             f"{type(config).__name__}.")
        if not isinstance(parallel, sharding.ParallelConfig):
            raise ValueError("T5Encoder: `parallel` must be a ParallelConfig; received "
                             f"{type(parallel).__name__}.")
        if parallel.sequence_axes:
            fsdp = (*parallel.fsdp_axes, *parallel.sequence_axes)
            raise NotImplementedError(
                "T5Encoder: sequence parallelism (ParallelConfig(sequence="
                f"{parallel.sequence!r}) over {parallel.sequence_axes}) is not implemented for "
                "the text encoder, whose texts are short; split it with tp_axis and put the "
                f"sequence axes in fsdp_axes instead, e.g. ParallelConfig(tp_axis="
                f"{parallel.tp_axis!r}, fsdp_axes={fsdp}).")
        c = config
        self.config, self.implementation = c, implementation
        keys = jax.random.split(key, 3)
        self.embeddings = T5Embeddings(c, parallel=parallel, dtype=dtype, key=keys[0])
        # `eqx.filter_vmap` over the layers, one layer's draws alive at a time (`_init.py`)
        self.blocks = stack_layers(lambda k: T5Layer(c, parallel=parallel, dtype=dtype, key=k),
                                   jax.random.split(keys[2], c.num_layers))
        self.final_layer_norm = nn.RMSNorm(c.d_model, c.layer_norm_epsilon, dtype=dtype)

    @property
    def parallel(self) -> sharding.ParallelConfig:
        """The [`vidax_eqx.nn.sharding.ParallelConfig`][] the encoder runs with."""
        return self.blocks.parallel

    def __call__(self, input_ids: Int[Array, "S"],
                 attention_mask: Int[Array, "S"] | Bool[Array, "S"] | None = None,
                 ) -> Float[Array, "S {self.config.d_model}"]:
        """**Arguments:**

        - `input_ids`: token ids `(S,)`, integers in `[0, vocab_size)` (checked when
            concrete; a traced id out of range is clamped, as JAX's indexing does).
        - `attention_mask`: `(S,)` int or bool, nonzero for the tokens that may be
            attended to (transformers' `attention_mask`); `None`: all of them.

        Over a mesh this runs inside `shard_map` with the weights placed by
        `partition_specs` and the example whole on every device of the model's axes;
        [`encode`][vidax_eqx.models.T5Encoder.encode] does all of it.

        **Returns:**

        transformers' `last_hidden_state` of this example, `(S, d_model)` in the
        parameters' dtype, every position computed (a padded position attends to the
        valid ones, as in transformers). An example with no valid token gives
        `final_layer_norm(embedding + ...)` of zero attention outputs where
        transformers attends uniformly.
        """
        with jax.named_scope("vidax_eqx.models.T5Encoder"):
            input_ids, valid = _check_inputs("T5Encoder", input_ids, attention_mask,
                                             self.config.vocab_size)
            return self._forward(input_ids, valid)

    def _forward(self, input_ids, valid):
        """The forward pass of one example `(S,)` or of a batch `(B, S)`: a batch shares
        each layer's FSDP gather (the weights gathered once for all its examples, not once
        per example as under `jax.vmap` of the model)."""
        c = self.config
        tp_axis = self.parallel.tp_axis
        if tp_axis is not None:
            check_tensor_parallel("T5Encoder", c, tp_axis,
                                  axis_size(tp_axis, what="Tensor-parallel"))
        s = input_ids.shape[-1]
        buckets = jnp.asarray(relative_position_buckets(
            s, c.relative_attention_num_buckets, c.relative_attention_max_distance))
        x, bias = self.embeddings(input_ids, buckets)
        if has_shards(self.blocks):
            # FSDP: the layers' outputs vary (in type) over the FSDP axes, as their
            # gathered weights do; the scan's carry starts so.
            x = as_varying(x, frozenset(self.parallel.fsdp_axes))

        def step(x, layer):
            layer, x = sharding.fsdp_gather(layer, x)  # once for the batch
            if x.ndim == 2:
                return layer(x, bias, buckets, valid, self.implementation)
            return jax.vmap(
                lambda x, v: layer(x, bias, buckets, v, self.implementation))(x, valid)

        x = scan_layers(step, x, self.blocks, check_remat(None))
        norm, x = sharding.fsdp_gather(self.final_layer_norm, x)
        return norm(x)

    def encode(self, input_ids: Int[Array, "B S"],
               attention_mask: Int[Array, "B S"] | Bool[Array, "B S"] | None = None, *,
               mesh: jax.sharding.Mesh | None = None,
               batch_axis: str | tuple[str, ...] | None = None,
               ) -> Float[Array, "B S {self.config.d_model}"]:
        """A batch of texts, on one device or over a mesh: global inputs in, the global
        output out. Call it under `eqx.filter_jit` (or `jax.jit` closing over the model).

        **Arguments:**

        - `input_ids`: token ids `(B, S)`, integers in `[0, vocab_size)`.
        - `attention_mask`: `(B, S)` int or bool (transformers' `attention_mask`), or
            `None` (every token valid).
        - `mesh`: a `jax.sharding.Mesh` with the axes of the model's `parallel`: the
            encoder runs inside `shard_map` over it, its weights placed by
            [`vidax_eqx.nn.sharding.partition_specs`][]`(model, mesh)` (place them once
            beforehand, or load them placed, to avoid moving them per call). `None`:
            `jax.vmap(model)` on one device (the model then has no `tp_axis` nor
            `fsdp_axes`).
        - `batch_axis`: with `mesh`, the mesh axis (or tuple of axes) the batch is split
            over, as for [`vidax_eqx.models.run_sharded`][]: a data or FSDP axis, never
            `tp_axis`; `B` must be a multiple of its size. `None`: every device encodes
            the whole batch.

        **Returns:**

        `(B, S, d_model)` in the parameters' dtype (with `mesh`: sharded over
        `batch_axis`, replicated over the other axes).
        """
        owner = "T5Encoder.encode"
        input_ids, valid = _check_inputs(owner, input_ids, attention_mask,
                                         self.config.vocab_size, batched=True)
        if mesh is not None:
            return encode_over_mesh(self, T5Encoder._forward, input_ids, valid, mesh=mesh,
                                    batch_axis=batch_axis)
        parallel = self.parallel
        if parallel.tp_axis is not None or parallel.fsdp_axes:
            raise ValueError(
                f"{owner}: the model is configured for a mesh (tp_axis={parallel.tp_axis!r}, "
                f"fsdp_axes={parallel.fsdp_axes}); pass mesh=..., or run it on one device "
                "with nn.sharding.with_parallel(model, nn.sharding.ParallelConfig()).")
        if batch_axis is not None:
            raise ValueError(f"{owner}: `batch_axis` splits the batch over a mesh; received "
                             f"batch_axis={batch_axis!r} without `mesh`.")
        return jax.vmap(self)(input_ids, valid)

    @classmethod
    def from_pretrained(cls, path, *, dtype=jnp.float32, implementation: str = "auto",
                        parallel: sharding.ParallelConfig = sharding.ParallelConfig(),
                        mesh: jax.sharding.Mesh | None = None,
                        subfolder: str | None = None, revision: str | None = None,
                        cache_dir=None) -> "T5Encoder":
        """The encoder of a transformers checkpoint directory (a pipeline's
        `text_encoder/`: config.json and model.safetensors, or shards with their index),
        or of a Hugging Face Hub repository's.

        The model is built abstractly (no random weights), every tensor's shape is
        checked before any is read, and tensors are read one at a time. With `mesh`, it
        loads straight into its sharded layout: every parameter placed by
        [`vidax_eqx.nn.sharding.partition_specs`][]`(model, mesh)` under `parallel`
        (Megatron over its `tp_axis`, FSDP over its `fsdp_axes`), each process reading
        only the blocks of each tensor its own devices hold (see
        [`vidax_eqx.models.WanTransformer3D.from_pretrained`][]).

        **Arguments:**

        - `path`: the directory (or Hub repository id).
        - `dtype`: the parameters' dtype; the checkpoint's tensors are cast to it.
        - `implementation`, `parallel`: as for `__init__`.
        - `mesh`: a `jax.sharding.Mesh` with the axes `parallel` names: load sharded.
            Default: unsharded, on the default device.
        - `subfolder`: the folder of `path` holding the checkpoint, e.g.
            `"text_encoder"` for a diffusers pipeline.
        - `revision`, `cache_dir`: the Hub revision and cache directory (Hub ids only).

        **Returns:**

        The encoder with transformers' weights (names `shared.weight`,
        `encoder.block.{i}.layer.0.SelfAttention.q.weight`, ...; a stored
        `encoder.embed_tokens.weight`, the tied copy of `shared.weight`, is not read).
        A missing tensor, an unexpected one, or one whose shape disagrees with
        config.json raises a `ValueError` naming it; so does a `mesh` whose
        tensor-parallel size does not divide `num_heads`, `d_ff` or `vocab_size`.
        """
        raw, tensors = read_config(path, "T5Encoder", subfolder=subfolder, revision=revision,
                                   cache_dir=cache_dir)
        config = T5EncoderConfig.from_dict(raw)
        owner = "T5Encoder.from_pretrained"
        strict = TIED not in tensors
        if not strict:
            # transformers' tied copy of `shared.weight` stays unread: the names are
            # checked here, the rest (shapes, dtypes) by a load that skips unused keys.
            expected, found = checkpoint_names(config), set(tensors.keys()) - {TIED}
            if found != expected:
                missing, unexpected = sorted(expected - found), sorted(found - expected)
                raise ValueError(
                    f"{owner}: the tensors do not fit the config's T5Encoder; nothing was "
                    f"loaded. Missing ({len(missing)}): {missing[:20]}; unexpected "
                    f"({len(unexpected)}): {unexpected[:20]}.")
        if mesh is not None:
            check_mesh(owner, config, parallel, mesh)
        return load_pretrained(cls, config, tensors, dtype=dtype, dtype_from="shared.weight",
                               parallel=parallel, implementation=implementation, mesh=mesh,
                               stacked=("blocks",), rename=rename, strict=strict)
