"""The T5 text encoders of the video pipelines: UMT5 (Wan 2.1 / 2.2) and T5 v1.1
(CogVideoX), [`T5Encoder`][vidax_eqx.models.T5Encoder] and its
[`T5EncoderConfig`][vidax_eqx.models.T5EncoderConfig], on one device or split over a
mesh (tensor parallelism and FSDP)."""

from ._config import T5EncoderConfig as T5EncoderConfig
from ._model import T5Encoder as T5Encoder
