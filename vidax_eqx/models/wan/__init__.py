"""Wan 2.1 and 2.2: the transformer ([`WanTransformer3D`][]), Wan 2.2 A14B's two experts
([`WanExperts`][]), their configuration, blocks, text cache and checkpoint names."""

from ._blocks import (
    WanBlock as WanBlock,
    WanBlockInputs as WanBlockInputs,
    WanHead as WanHead,
    WanImageEmbedding as WanImageEmbedding,
    wan_image_timestep as wan_image_timestep,
)
from ._config import WanConfig as WanConfig
from ._experts import WanExperts as WanExperts, WanExpertsTextCache as WanExpertsTextCache
from ._model import WanTransformer3D as WanTransformer3D
from ._sharded import sharded_text_cache as sharded_text_cache
from ._text_cache import WanTextCache as WanTextCache
