"""The CLIP vision encoder: transformers' `CLIPVisionModelWithProjection` (Wan 2.1 I2V /
FLF2V's image encoder, open-clip's ViT-H/14) as one Equinox module."""

import os
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ..._checks import is_int
from ..._shapes import checked
from ... import interop, kernels, nn
from ...nn import functional
from ...nn.internal import init, linear
from .._checkpoint import read_config
from .._layers import check_remat, scan_layers
from ._config import CLIPVisionConfig


class CLIPAttention(eqx.Module):
    """transformers' `CLIPAttention`: biased `q_proj, k_proj, v_proj`, softmax attention
    scaled by `1/sqrt(head_dim)` over every token, biased `out_proj`."""

    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    out_proj: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)
    implementation: str = eqx.field(static=True)

    def __init__(self, config: CLIPVisionConfig, *, implementation: str, dtype,
                 key: PRNGKeyArray):
        d = config.hidden_size
        keys = init.split(key, 4)
        self.q_proj = init.linear(d, d, dtype=dtype, key=keys[0])
        self.k_proj = init.linear(d, d, dtype=dtype, key=keys[1])
        self.v_proj = init.linear(d, d, dtype=dtype, key=keys[2])
        self.out_proj = init.linear(d, d, dtype=dtype, key=keys[3])
        self.num_heads, self.implementation = config.num_attention_heads, implementation

    def __call__(self, x: Float[Array, "S D"]) -> Float[Array, "S D"]:
        s, d = x.shape
        q, k, v = (linear(p, x).reshape(1, s, self.num_heads, d // self.num_heads)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = kernels.attention(q, k, v, implementation=self.implementation)
        return linear(self.out_proj, out.reshape(s, d))


class CLIPMLP(eqx.Module):
    """transformers' `CLIPMLP`: `fc2(act(fc1(x)))`, the activation in float32."""

    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    hidden_act: str = eqx.field(static=True)

    def __init__(self, config: CLIPVisionConfig, *, dtype, key: PRNGKeyArray):
        keys = init.split(key, 2)
        self.fc1 = init.linear(config.hidden_size, config.intermediate_size, dtype=dtype,
                               key=keys[0])
        self.fc2 = init.linear(config.intermediate_size, config.hidden_size, dtype=dtype,
                               key=keys[1])
        self.hidden_act = config.hidden_act

    def __call__(self, x: Float[Array, "S D"]) -> Float[Array, "S D"]:
        h = linear(self.fc1, x)
        hf = h.astype(jnp.float32)
        if self.hidden_act == "gelu":  # transformers' GELUActivation: the exact (erf) form
            hf = jax.nn.gelu(hf, approximate=False)
        else:  # "quick_gelu" (the config admits no other)
            hf = hf * jax.nn.sigmoid(1.702 * hf)
        return linear(self.fc2, hf.astype(h.dtype))


class CLIPEncoderLayer(eqx.Module):
    """transformers' `CLIPEncoderLayer`: pre-norm self-attention and MLP, each with its
    residual."""

    layer_norm1: nn.LayerNorm
    self_attn: CLIPAttention
    layer_norm2: nn.LayerNorm
    mlp: CLIPMLP

    def __init__(self, config: CLIPVisionConfig, *, implementation: str, dtype,
                 key: PRNGKeyArray):
        keys = init.split(key, 2)
        d, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(d, eps, dtype=dtype)
        self.self_attn = CLIPAttention(config, implementation=implementation, dtype=dtype,
                                       key=keys[0])
        self.layer_norm2 = nn.LayerNorm(d, eps, dtype=dtype)
        self.mlp = CLIPMLP(config, dtype=dtype, key=keys[1])

    def __call__(self, x: Float[Array, "S D"]) -> Float[Array, "S D"]:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


# This module's parameter names -> transformers' (beside `vision_model.`).
_EMBEDDINGS = {
    "class_embedding": "embeddings.class_embedding",
    "patch_embedding": "embeddings.patch_embedding.weight",
    "position_embedding": "embeddings.position_embedding.weight",
}
_PROJECTION = "visual_projection.weight"
# The non-persistent buffer that checkpoints of older transformers versions still hold.
_POSITION_IDS = "vision_model.embeddings.position_ids"


def rename(name: str, naming: str) -> str:
    """This module's parameter name -> transformers' (`load_state_dict`'s `rename=`):
    `layers.{i}.self_attn.q_proj.weight` -> `vision_model.encoder.layers.{i}...`."""
    del naming  # transformers' names only
    if name == _PROJECTION:
        return name
    if name.startswith("layers."):
        return "vision_model.encoder." + name
    return "vision_model." + _EMBEDDINGS.get(name, name)


class _Without(Mapping):
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
        return len(self._tensors) - (self._hidden in self._tensors)


class CLIPVisionEncoder(eqx.Module):
    """transformers' `CLIPVisionModelWithProjection` (and `CLIPVisionModel`, without the
    projection): the image encoder of Wan 2.1 I2V / FLF2V. One image per call; `jax.vmap`
    for a batch.

    The image `(C, image_size, image_size)` is cut into `patch_size` patches, each
    embedded by one matrix product (the reference's strided `Conv2d`, no bias); a class
    token goes in front, learned position embeddings are added, then `pre_layrnorm` and
    `num_hidden_layers` pre-norm transformer layers (stacked along a leading axis and run
    by `lax.scan`). The class token's output, through `post_layernorm` and
    `visual_projection`, is the image embedding.

    Wan's pipelines take the penultimate layer's output, diffusers' `hidden_states[-2]`:
    [`penultimate_hidden_states`][vidax_eqx.models.CLIPVisionEncoder.penultimate_hidden_states]`(x)`,
    which is [`hidden_states`][vidax_eqx.models.CLIPVisionEncoder.hidden_states]`(x, -2)`.
    """

    class_embedding: Float[Array, " D"]
    patch_embedding: Float[Array, "D C P P"]
    position_embedding: Float[Array, "S D"]
    pre_layrnorm: nn.LayerNorm
    layers: CLIPEncoderLayer
    post_layernorm: nn.LayerNorm
    visual_projection: eqx.nn.Linear | None
    config: CLIPVisionConfig = eqx.field(static=True)

    def __init__(self, config: CLIPVisionConfig, *, projection: bool = True,
                 dtype=jnp.float32, implementation: str = "auto", key: PRNGKeyArray):
        """**Arguments:**

        - `config`: the architecture ([`CLIPVisionConfig`][vidax_eqx.models.CLIPVisionConfig]).
        - `projection`: whether the encoder has `visual_projection` (transformers'
            `CLIPVisionModelWithProjection`); without it (`CLIPVisionModel`),
            `image_embeds` is refused.
        - `dtype`: the parameters' dtype (the computation's).
        - `implementation`: the attention implementation
            ([`vidax_eqx.kernels.attention`][]'s `implementation`).
        - `key`: a PRNG key for the random initial weights.
        """
        if not isinstance(config, CLIPVisionConfig):
            raise ValueError("CLIPVisionEncoder: `config` must be a CLIPVisionConfig; "
                             f"received {type(config).__name__}.")
        if not isinstance(projection, bool):
            raise ValueError("CLIPVisionEncoder: `projection` must be a bool; received "
                             f"{projection!r}.")
        c = config
        d, p = c.hidden_size, c.patch_size
        keys = init.split(key, 5)
        self.class_embedding = init.normal(keys[0], (d,), dtype, d ** -0.5)
        self.patch_embedding = init.normal(keys[1], (d, c.num_channels, p, p), dtype, 0.02)
        self.position_embedding = init.normal(keys[2], (c.num_positions, d), dtype, 0.02)
        self.pre_layrnorm = nn.LayerNorm(d, c.layer_norm_eps, dtype=dtype)
        self.layers = init.stacked(
            lambda k: CLIPEncoderLayer(c, implementation=implementation, dtype=dtype, key=k),
            init.split(keys[3], c.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(d, c.layer_norm_eps, dtype=dtype)
        self.visual_projection = (init.linear(d, c.projection_dim, use_bias=False, dtype=dtype,
                                              key=keys[4]) if projection else None)
        self.config = c

    @checked
    def __call__(
        self,
        pixel_values: Float[Array, "{self.config.num_channels} {self.config.image_size} {self.config.image_size}"],
    ) -> Float[Array, "{self.config.num_positions} {self.config.hidden_size}"]:
        """**Arguments:**

        - `pixel_values`: one image `(num_channels, image_size, image_size)`, as
            [`CLIPImageProcessor`][vidax_eqx.models.CLIPImageProcessor] gives it (cast to
            the parameters' dtype).

        **Returns:**

        transformers' `last_hidden_state`: `(num_positions, hidden_size)`, the class
        token first, in the parameters' dtype.
        """
        with jax.named_scope("vidax_eqx.models.CLIPVisionEncoder"):
            return self._run(pixel_values, self.config.num_hidden_layers)

    @checked
    def hidden_states(
        self,
        pixel_values: Float[Array, "{self.config.num_channels} {self.config.image_size} {self.config.image_size}"],
        layer: int = -2,
    ) -> Float[Array, "{self.config.num_positions} {self.config.hidden_size}"]:
        """One of transformers' `hidden_states` (`output_hidden_states=True`), computing
        only the layers it needs.

        **Arguments:**

        - `pixel_values`: as for `__call__`.
        - `layer`: the index into transformers' `hidden_states`, a tuple of
            `num_hidden_layers + 1`: `0` is the embeddings after `pre_layrnorm`, `i` the
            output of layer `i`, and negative indices count from the end. The default
            `-2` is the penultimate layer's output, the image features that diffusers'
            `WanImageToVideoPipeline` gives the transformer
            (`image_encoder(..., output_hidden_states=True).hidden_states[-2]`); the
            last layer is not run.

        **Returns:**

        `(num_positions, hidden_size)` in the parameters' dtype (ViT-H/14 at 224:
        `(257, 1280)`).
        """
        n = self.config.num_hidden_layers
        if not is_int(layer) or not -(n + 1) <= layer <= n:
            raise ValueError(
                f"CLIPVisionEncoder.hidden_states: `layer` must be an int index into the "
                f"{n + 1} hidden states (from {-(n + 1)} to {n}); received {layer!r}.")
        with jax.named_scope("vidax_eqx.models.CLIPVisionEncoder.hidden_states"):
            return self._run(pixel_values, int(layer) % (n + 1))

    @checked
    def penultimate_hidden_states(
        self,
        pixel_values: Float[Array, "{self.config.num_channels} {self.config.image_size} {self.config.image_size}"],
    ) -> Float[Array, "{self.config.num_positions} {self.config.hidden_size}"]:
        """`hidden_states(pixel_values, -2)`: the image features of Wan's I2V / FLF2V
        pipelines, every layer run but the last.

        **Arguments:**

        - `pixel_values`: as for `__call__`.

        **Returns:**

        `(num_positions, hidden_size)` in the parameters' dtype.
        """
        return self.hidden_states(pixel_values, -2)

    @checked
    def image_embeds(
        self,
        pixel_values: Float[Array, "{self.config.num_channels} {self.config.image_size} {self.config.image_size}"],
    ) -> Float[Array, " {self.config.projection_dim}"]:
        """transformers' `image_embeds`: the class token's last hidden state through
        `post_layernorm` and `visual_projection`.

        **Arguments:**

        - `pixel_values`: as for `__call__`.

        **Returns:**

        `(projection_dim,)` in the parameters' dtype.
        """
        if self.visual_projection is None:
            raise ValueError(
                "CLIPVisionEncoder.image_embeds: this encoder has no `visual_projection` "
                "(built with projection=False, or loaded from a CLIPVisionModel checkpoint "
                "without `visual_projection.weight`); use a CLIPVisionModelWithProjection's.")
        with jax.named_scope("vidax_eqx.models.CLIPVisionEncoder.image_embeds"):
            pooled = self.post_layernorm(self._run(pixel_values, self.config.num_hidden_layers)[0])
            return linear(self.visual_projection, pooled)

    def _run(self, pixel_values, num_layers: int):
        """The hidden state after the embeddings, `pre_layrnorm` and the first
        `num_layers` layers."""
        c = self.config
        p = c.patch_size
        g = c.image_size // p
        x = pixel_values[:, : g * p, : g * p].astype(self.patch_embedding.dtype)
        patches = functional.patchify(x[:, None], (1, p, p))  # (g * g, C * p * p)
        tokens = patches @ self.patch_embedding.reshape(c.hidden_size, -1).T
        x = jnp.concatenate([self.class_embedding[None].astype(tokens.dtype), tokens])
        x = self.pre_layrnorm(x + self.position_embedding)
        if num_layers == 0:
            return x
        arrays, static = eqx.partition(self.layers, eqx.is_array)
        layers = eqx.combine(jax.tree.map(lambda a: a[:num_layers], arrays), static)
        return scan_layers(lambda x, layer: layer(x), x, layers, check_remat(None))

    @classmethod
    def from_pretrained(cls, path, *, dtype=jnp.float32, subfolder: str | None = None,
                        revision: str | None = None, cache_dir=None,
                        implementation: str = "auto") -> "CLIPVisionEncoder":
        """The encoder of a transformers checkpoint directory (a diffusers pipeline's
        `image_encoder/`: config.json and model.safetensors, or shards with their index),
        or of a Hugging Face Hub repository's.

        **Arguments:**

        - `path`: the directory (or Hub repository id): the encoder's own, or a
            pipeline's with `subfolder="image_encoder"`.
        - `dtype`: the parameters' dtype; the checkpoint's tensors are cast to it.
        - `subfolder`, `revision`, `cache_dir`: where the checkpoint lies in `path`, and
            the Hub's revision and cache ([`vidax_eqx.interop.resolve_checkpoint`][]).
        - `implementation`: as for `__init__`.

        **Returns:**

        The encoder with transformers' weights (names
        `vision_model.embeddings.patch_embedding.weight`,
        `vision_model.encoder.layers.{i}.self_attn.q_proj.weight`, ...,
        `visual_projection.weight`); without `visual_projection.weight` (a
        `CLIPVisionModel`'s checkpoint) it is built with `projection=False`. A stored
        `vision_model.embeddings.position_ids` (a buffer of older transformers) is not
        read. A missing tensor, an unexpected one, or one whose shape disagrees with
        config.json raises a `ValueError` naming it.
        """
        local = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
        if (subfolder is None and local is not None and os.path.isdir(local)
                and not os.path.isfile(os.path.join(local, "config.json"))
                and os.path.isfile(os.path.join(local, "image_encoder", "config.json"))):
            raise ValueError(
                f"CLIPVisionEncoder.from_pretrained: {local!r} is a pipeline directory, not "
                "a checkpoint's; pass subfolder='image_encoder'.")
        raw, tensors = read_config(path, "CLIPVisionEncoder", subfolder=subfolder,
                                   revision=revision, cache_dir=cache_dir)
        config = CLIPVisionConfig.from_dict(raw)
        model = eqx.filter_eval_shape(cls, config, projection=_PROJECTION in tensors,
                                      dtype=dtype, implementation=implementation,
                                      key=jax.random.PRNGKey(0))
        if _POSITION_IDS in tensors:
            tensors = _Without(tensors, _POSITION_IDS)
        return interop.load_state_dict(model, tensors, stacked=("layers",), rename=rename)
