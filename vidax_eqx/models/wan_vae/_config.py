"""The Wan VAE's configuration: diffusers' `AutoencoderKLWan` config, checked."""

import dataclasses
import json
import os

from ..._checks import is_int


_WAN21_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
               0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
_WAN21_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
              3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)
# diffusers' config keys that do not change the computation here.
_IGNORED = {"_class_name", "_diffusers_version", "_name_or_path", "dropout", "clip_output"}


@dataclasses.dataclass(frozen=True)
class WanVAEConfig:
    """The Wan VAE's architecture, in diffusers' `AutoencoderKLWan` names.

    [`WanVAEConfig.wan21`][] is Wan 2.1's VAE (every Wan 2.1 and the Wan 2.2 A14B
    pipelines), [`WanVAEConfig.wan22`][] Wan 2.2's (TI2V-5B: residual blocks, 2x2
    patches, 48 latent channels, spatial factor 16).

    **Fields:**

    - `base_dim`, `decoder_base_dim`: the encoder's and decoder's first widths
        (`decoder_base_dim=None`: `base_dim`).
    - `z_dim`: latent channels.
    - `dim_mult`: width multipliers per level; `len(dim_mult) - 1` spatial halvings.
    - `num_res_blocks`: residual blocks per level (the decoder has one more).
    - `attn_scales`: the scales (1, 1/2, ...) with attention after the residual blocks
        (Wan 2.1 layout only; empty in every release).
    - `temperal_downsample`: which spatial halvings also halve time (diffusers' spelling).
    - `is_residual`: Wan 2.2's residual down / up blocks.
    - `in_channels`, `out_channels`: the encoder's input and decoder's output channels
        (after `patch_size` patching: 12 for RGB in 2x2 patches).
    - `patch_size`: the pixel patches folded into channels (`None`: none).
    - `scale_factor_temporal`, `scale_factor_spatial`: video frames and pixels per
        latent frame and pixel, checked against the architecture.
    - `latents_mean`, `latents_std`: per-channel latent statistics for the pipelines'
        normalisation (`None`: none; [`wan21`][vidax_eqx.models.WanVAEConfig.wan21] has
        Wan 2.1's).
    """

    base_dim: int = 96
    decoder_base_dim: int | None = None
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    is_residual: bool = False
    in_channels: int = 3
    out_channels: int = 3
    patch_size: int | None = None
    scale_factor_temporal: int = 4
    scale_factor_spatial: int = 8
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None

    def __post_init__(self):
        def fail(name, expected):
            raise ValueError(f"WanVAEConfig: `{name}` must be {expected}; received "
                             f"{getattr(self, name)!r}.")

        for name in ("base_dim", "z_dim", "num_res_blocks", "in_channels", "out_channels",
                     "scale_factor_temporal", "scale_factor_spatial"):
            value = getattr(self, name)
            if not is_int(value) or isinstance(value, bool) or value < 1:
                fail(name, "an int >= 1")
        if self.decoder_base_dim is not None and (not is_int(self.decoder_base_dim)
                                                  or self.decoder_base_dim < 1):
            fail("decoder_base_dim", "an int >= 1 or None")
        if self.patch_size is not None and (not is_int(self.patch_size) or self.patch_size < 1):
            fail("patch_size", "an int >= 1 or None")
        object.__setattr__(self, "dim_mult", tuple(self.dim_mult))
        object.__setattr__(self, "attn_scales", tuple(self.attn_scales))
        object.__setattr__(self, "temperal_downsample", tuple(bool(t) for t in self.temperal_downsample))
        if len(self.dim_mult) < 1 or not all(is_int(m) and m >= 1 for m in self.dim_mult):
            fail("dim_mult", "a non-empty sequence of ints >= 1")
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            fail("temperal_downsample", f"{len(self.dim_mult) - 1} flags (one per halving of "
                 f"dim_mult {self.dim_mult})")
        for name in ("latents_mean", "latents_std"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(v) for v in value))
                if len(getattr(self, name)) != self.z_dim:
                    fail(name, f"None or z_dim = {self.z_dim} values")
        if self.scale_factor_spatial != self.spatial_factor:
            fail("scale_factor_spatial", f"{self.spatial_factor} (2 ** {len(self.dim_mult) - 1} "
                 f"halvings x patch {self.patch_size or 1})")
        if self.scale_factor_temporal != self.temporal_factor:
            fail("scale_factor_temporal", f"{self.temporal_factor} (the halvings of time in "
                 f"temperal_downsample {self.temperal_downsample})")

    @property
    def spatial_factor(self) -> int:
        """Video pixels per latent pixel (each side)."""
        return 2 ** (len(self.dim_mult) - 1) * (self.patch_size or 1)

    @property
    def temporal_factor(self) -> int:
        """Video frames per latent frame after the first: 2 ** (halvings of time)."""
        return 2 ** sum(self.temperal_downsample)

    @property
    def video_channels(self) -> int:
        """The video's channels: `in_channels` before patching."""
        return self.in_channels // (self.patch_size or 1) ** 2

    @classmethod
    def wan21(cls, **overrides) -> "WanVAEConfig":
        """Wan 2.1's VAE (diffusers' defaults, with its latent statistics)."""
        return cls(**{**dict(latents_mean=_WAN21_MEAN, latents_std=_WAN21_STD), **overrides})

    @classmethod
    def wan22(cls, **overrides) -> "WanVAEConfig":
        """Wan 2.2's VAE (TI2V-5B) architecture; its latent statistics come with its
        checkpoint's config ([`WanVAE.from_pretrained`][vidax_eqx.models.WanVAE.from_pretrained])."""
        return cls(**{**dict(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True,
                             in_channels=12, out_channels=12, patch_size=2,
                             scale_factor_spatial=16, latents_mean=None, latents_std=None),
                      **overrides})

    @classmethod
    def from_dict(cls, config: dict) -> "WanVAEConfig":
        """From diffusers' `config.json` of an `AutoencoderKLWan` (a missing key takes
        diffusers' default); an unknown key is refused by name."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - fields - _IGNORED)
        if unknown:
            raise ValueError(f"WanVAEConfig: unknown config keys {unknown} (known: "
                             f"{sorted(fields)}).")
        values = {k: v for k, v in config.items() if k in fields}
        if values.get("z_dim", 16) == 16:  # diffusers' defaults: Wan 2.1's statistics
            values.setdefault("latents_mean", _WAN21_MEAN)
            values.setdefault("latents_std", _WAN21_STD)
        if config.get("_class_name", "AutoencoderKLWan") != "AutoencoderKLWan":
            raise ValueError(f"WanVAEConfig: the config is a {config['_class_name']!r}, not an "
                             "'AutoencoderKLWan'.")
        return cls(**values)

    @classmethod
    def from_file(cls, path) -> "WanVAEConfig":
        """From a `config.json` file."""
        with open(os.fspath(path), encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict:
        """diffusers' config (the `config.json` of `save_pretrained`)."""
        out = {"_class_name": "AutoencoderKLWan", **dataclasses.asdict(self)}
        for key in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            if out[key] is not None:
                out[key] = list(out[key])
        return out
