"""The CogVideoX VAE's configuration: diffusers' `AutoencoderKLCogVideoX` config, checked."""

import dataclasses
import json
import math
import os

from ..._checks import is_int


_DOWN, _UP = "CogVideoXDownBlock3D", "CogVideoXUpBlock3D"
# diffusers' config keys that do not change the computation here.
_IGNORED = {"_class_name", "_diffusers_version", "_name_or_path"}


@dataclasses.dataclass(frozen=True)
class CogVideoXVAEConfig:
    """The CogVideoX VAE's architecture, in diffusers' `AutoencoderKLCogVideoX` names
    (diffusers' defaults: CogVideoX-2b's VAE; [`CogVideoXVAEConfig.cogvideox_5b`][] is
    CogVideoX-5b's, the same network with another `scaling_factor`).

    **Fields:**

    - `in_channels`, `out_channels`: the video's channels in and out.
    - `down_block_types`, `up_block_types`: one `"CogVideoXDownBlock3D"` /
        `"CogVideoXUpBlock3D"` per level (the only kinds there are).
    - `block_out_channels`: the widths per level; `len - 1` spatial halvings.
    - `latent_channels`: latent channels (`z_dim`).
    - `layers_per_block`: residual blocks per encoder level (the decoder has one more).
    - `act_fn`: `"silu"` (or its other name `"swish"`).
    - `norm_eps`: the encoder's residual blocks' GroupNorm epsilon (every other norm
        has 1e-6, as in diffusers).
    - `norm_num_groups`: the groups of every GroupNorm.
    - `temporal_compression_ratio`: video frames per latent frame after the first (a
        power of two: that many of the first levels also halve time).
    - `sample_height`, `sample_width`: the training resolution; diffusers' default
        tiles are half of it ([`CogVideoXVAE.tiling`][vidax_eqx.models.CogVideoXVAE.tiling]).
    - `scaling_factor`, `shift_factor`, `latents_mean`, `latents_std`,
        `invert_scale_latents`: the pipelines' latent scaling (the transformer takes
        `latents * scaling_factor`); not used by encode and decode.
    - `force_upcast`: diffusers' hint to run the VAE in float32; not used here.
    - `use_quant_conv`, `use_post_quant_conv`: 1x1x1 convolutions after the encoder and
        before the decoder (off in every release; diffusers sizes them by
        `out_channels`, so they need `latent_channels == out_channels`).
    """

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = (_DOWN,) * 4
    up_block_types: tuple[str, ...] = (_UP,) * 4
    block_out_channels: tuple[int, ...] = (128, 256, 256, 512)
    latent_channels: int = 16
    layers_per_block: int = 3
    act_fn: str = "silu"
    norm_eps: float = 1e-6
    norm_num_groups: int = 32
    temporal_compression_ratio: float = 4
    sample_height: int = 480
    sample_width: int = 720
    scaling_factor: float = 1.15258426
    shift_factor: float | None = None
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    force_upcast: bool = True
    use_quant_conv: bool = False
    use_post_quant_conv: bool = False
    invert_scale_latents: bool = False

    def __post_init__(self):
        def fail(name, expected):
            raise ValueError(f"CogVideoXVAEConfig: `{name}` must be {expected}; received "
                             f"{getattr(self, name)!r}.")

        for name in ("in_channels", "out_channels", "latent_channels", "layers_per_block",
                     "norm_num_groups", "sample_height", "sample_width"):
            value = getattr(self, name)
            if not is_int(value) or isinstance(value, bool) or value < 1:
                fail(name, "an int >= 1")
        for name in ("down_block_types", "up_block_types", "block_out_channels",
                     "latents_mean", "latents_std"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        levels = len(self.block_out_channels)
        if levels < 1 or not all(is_int(c) and c >= 1 for c in self.block_out_channels):
            fail("block_out_channels", "a non-empty sequence of ints >= 1")
        if any(c % self.norm_num_groups for c in self.block_out_channels):
            fail("norm_num_groups", f"a divisor of every width in block_out_channels "
                 f"{self.block_out_channels}")
        for name, kind in (("down_block_types", _DOWN), ("up_block_types", _UP)):
            if getattr(self, name) != (kind,) * levels:
                fail(name, f"{levels} x {kind!r} (one per width in block_out_channels)")
        if self.act_fn not in ("silu", "swish"):
            fail("act_fn", "'silu' (or 'swish')")
        ratio = self.temporal_compression_ratio
        if (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio < 1
                or 2 ** int(math.log2(ratio)) != ratio or int(math.log2(ratio)) > levels - 1):
            fail("temporal_compression_ratio", f"a power of two, at most 2 ** {levels - 1} "
                 f"(one halving of time per spatial halving)")
        if not isinstance(self.norm_eps, (int, float)) or self.norm_eps < 0:
            fail("norm_eps", "a float >= 0")
        if (self.use_quant_conv or self.use_post_quant_conv) and self.latent_channels != self.out_channels:
            fail("use_quant_conv" if self.use_quant_conv else "use_post_quant_conv",
                 f"False unless latent_channels == out_channels (diffusers sizes the "
                 f"convolution by out_channels = {self.out_channels})")

    @property
    def spatial_factor(self) -> int:
        """Video pixels per latent pixel (each side): `2 ** (len(block_out_channels) - 1)`."""
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def temporal_factor(self) -> int:
        """Video frames per latent frame after the first."""
        return int(self.temporal_compression_ratio)

    @property
    def z_dim(self) -> int:
        """The latent channels (`latent_channels`)."""
        return self.latent_channels

    @classmethod
    def cogvideox_2b(cls, **overrides) -> "CogVideoXVAEConfig":
        """CogVideoX-2b's VAE (diffusers' defaults)."""
        return cls(**overrides)

    @classmethod
    def cogvideox_5b(cls, **overrides) -> "CogVideoXVAEConfig":
        """CogVideoX-5b's VAE: 2b's network, `scaling_factor` 0.7."""
        return cls(**{"scaling_factor": 0.7, **overrides})

    @classmethod
    def from_dict(cls, config: dict) -> "CogVideoXVAEConfig":
        """From diffusers' `config.json` of an `AutoencoderKLCogVideoX`; an unknown key is
        refused by name."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - fields - _IGNORED)
        if unknown:
            raise ValueError(f"CogVideoXVAEConfig: unknown config keys {unknown} (known: "
                             f"{sorted(fields)}).")
        if config.get("_class_name", "AutoencoderKLCogVideoX") != "AutoencoderKLCogVideoX":
            raise ValueError(f"CogVideoXVAEConfig: the config is a {config['_class_name']!r}, "
                             "not an 'AutoencoderKLCogVideoX'.")
        return cls(**{k: v for k, v in config.items() if k in fields})

    @classmethod
    def from_file(cls, path) -> "CogVideoXVAEConfig":
        """From a `config.json` file."""
        with open(os.fspath(path), encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict:
        """diffusers' config (the `config.json` of `save_pretrained`)."""
        out = {"_class_name": "AutoencoderKLCogVideoX", **dataclasses.asdict(self)}
        for key in ("down_block_types", "up_block_types", "block_out_channels",
                    "latents_mean", "latents_std"):
            if out[key] is not None:
                out[key] = list(out[key])
        return out
