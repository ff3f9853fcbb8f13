"""CogVideoX 1.0: the transformer ([`CogVideoXTransformer3D`][]), its configuration and
blocks."""

from ._blocks import (
    CogVideoXBlock as CogVideoXBlock,
    CogVideoXBlockInputs as CogVideoXBlockInputs,
)
from ._config import CogVideoXConfig as CogVideoXConfig, rope_crop_positions as rope_crop_positions
from ._model import CogVideoXTransformer3D as CogVideoXTransformer3D
