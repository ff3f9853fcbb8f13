"""Wan 2.1's and 2.2's video VAE: [`WanVAE`][vidax_eqx.models.WanVAE] and its
[`WanVAEConfig`][vidax_eqx.models.WanVAEConfig]."""

from ._config import WanVAEConfig as WanVAEConfig
from ._model import DecodeStream as DecodeStream, WanVAE as WanVAE
