"""SkyReels-V2: the diffusion forcing transformer ([`SkyReelsV2Transformer3D`][]) and its
configuration ([`SkyReelsV2Config`][])."""

from ._config import SkyReelsV2Config as SkyReelsV2Config
from ._model import SkyReelsV2Transformer3D as SkyReelsV2Transformer3D
