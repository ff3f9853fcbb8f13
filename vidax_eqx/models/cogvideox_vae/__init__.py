"""CogVideoX's video VAE: [`CogVideoXVAE`][vidax_eqx.models.CogVideoXVAE] and its
[`CogVideoXVAEConfig`][vidax_eqx.models.CogVideoXVAEConfig]."""

from ._config import CogVideoXVAEConfig as CogVideoXVAEConfig
from ._model import CogVideoXVAE as CogVideoXVAE
