"""The CLIP image encoder of Wan 2.1 I2V / FLF2V:
[`CLIPVisionEncoder`][vidax_eqx.models.CLIPVisionEncoder] (transformers'
`CLIPVisionModelWithProjection`), its [`CLIPVisionConfig`][vidax_eqx.models.CLIPVisionConfig],
and the [`CLIPImageProcessor`][vidax_eqx.models.CLIPImageProcessor] that makes its
`pixel_values`."""

from ._config import CLIPVisionConfig as CLIPVisionConfig
from ._model import CLIPVisionEncoder as CLIPVisionEncoder
from ._processor import CLIPImageProcessor as CLIPImageProcessor
