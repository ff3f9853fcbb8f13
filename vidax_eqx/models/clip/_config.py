"""The CLIP vision encoder's configuration: transformers' `CLIPVisionConfig`, checked."""

import dataclasses
import json
import os

from ..._checks import is_int, is_real


# The activations of the MLP (transformers' `ACT2FN` names) that the encoder implements:
# `gelu` (the exact, erf form: open-clip's ViT-H/14 of Wan 2.1) and `quick_gelu`
# (OpenAI's CLIP: `x * sigmoid(1.702 x)`).
ACTIVATIONS = ("gelu", "quick_gelu")
# transformers' `CLIPVisionConfig` defaults (ViT-B/32), for the keys a config.json omits.
_TRANSFORMERS_DEFAULTS = dict(
    hidden_size=768, intermediate_size=3072, projection_dim=512, num_hidden_layers=12,
    num_attention_heads=12, num_channels=3, image_size=224, patch_size=32,
    hidden_act="quick_gelu", layer_norm_eps=1e-5,
)
_SIZES = ("hidden_size", "intermediate_size", "projection_dim", "num_hidden_layers",
          "num_attention_heads", "num_channels", "image_size", "patch_size")


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
    """A CLIP vision tower's architecture, in transformers' `CLIPVisionConfig` names.

    The defaults are Wan 2.1 I2V / FLF2V's image encoder (open-clip's ViT-H/14,
    converted to transformers' `CLIPVisionModelWithProjection`): 257 tokens of width
    1280 for a 224 x 224 image.

    **Fields:**

    - `hidden_size`: the token width.
    - `intermediate_size`: the MLP's hidden width.
    - `projection_dim`: the width of `visual_projection` (the image embedding).
    - `num_hidden_layers`, `num_attention_heads`: encoder layers, attention heads
        (`hidden_size` a multiple of the heads).
    - `num_channels`: the image's channels.
    - `image_size`: the square image's side; the encoder takes exactly this size
        (transformers' `interpolate_pos_encoding` is not implemented).
    - `patch_size`: the side of a patch: `(image_size // patch_size) ** 2` patches plus
        the class token (the last `image_size % patch_size` rows and columns are
        dropped, as by the reference's strided convolution).
    - `hidden_act`: the MLP's activation, `"gelu"` (exact) or `"quick_gelu"`.
    - `layer_norm_eps`: the layer norms' epsilon.
    """

    hidden_size: int = 1280
    intermediate_size: int = 5120
    projection_dim: int = 1024
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 14
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        for name in _SIZES:
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"CLIPVisionConfig: `{name}` must be a positive int; "
                                 f"received {value!r}.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                "CLIPVisionConfig: `hidden_size` must be a multiple of `num_attention_heads`; "
                f"received hidden_size={self.hidden_size}, num_attention_heads="
                f"{self.num_attention_heads}.")
        if self.patch_size > self.image_size:
            raise ValueError(
                "CLIPVisionConfig: `patch_size` must be at most `image_size` (one patch at "
                f"least); received patch_size={self.patch_size}, image_size={self.image_size}.")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"CLIPVisionConfig: `hidden_act` must be one of {list(ACTIVATIONS)}; received "
                f"{self.hidden_act!r}, which this encoder does not implement.")
        eps = self.layer_norm_eps
        if not is_real(eps) or not eps > 0:
            raise ValueError("CLIPVisionConfig: `layer_norm_eps` must be a positive float; "
                             f"received {eps!r}.")

    @property
    def num_patches(self) -> int:
        """The patch tokens, `(image_size // patch_size) ** 2`."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        """The tokens, the class token's and the patches': `num_patches + 1`."""
        return self.num_patches + 1

    @classmethod
    def from_dict(cls, config: dict) -> "CLIPVisionConfig":
        """The configuration of transformers' config.json of a `CLIPVisionModel` or
        `CLIPVisionModelWithProjection` (`model_type` `"clip_vision_model"`).

        A key the file omits takes transformers' `CLIPVisionConfig` default (ViT-B/32's,
        `hidden_act="quick_gelu"`), as transformers reads it. Keys that do not change
        the forward pass (dropouts, initializers, `architectures`, `dtype`) are ignored;
        another `model_type` (a whole `CLIPModel`'s `"clip"`) is refused by name.
        """
        if not isinstance(config, dict):
            raise ValueError(f"CLIPVisionConfig.from_dict takes a dict; received "
                             f"{type(config).__name__}.")
        model_type = config.get("model_type", "clip_vision_model")
        if model_type != "clip_vision_model":
            raise ValueError(
                "CLIPVisionConfig: `model_type` must be 'clip_vision_model' (transformers' "
                f"CLIPVisionModel / CLIPVisionModelWithProjection); received {model_type!r}.")
        return cls(**{name: config.get(name, default)
                      for name, default in _TRANSFORMERS_DEFAULTS.items()})

    @classmethod
    def from_file(cls, path) -> "CLIPVisionConfig":
        """The configuration of a config.json file (or of a directory holding one)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f))
