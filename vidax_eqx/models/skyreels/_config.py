"""The shape of a SkyReels-V2 transformer: Wan 2.1's, with the fps embedding and the
frame-block causal attention of diffusion forcing."""

import dataclasses

from ..wan._config import WanConfig


@dataclasses.dataclass(frozen=True)
class SkyReelsV2Config(WanConfig):
    """The shape of a SkyReels-V2 transformer (diffusers' `SkyReelsV2Transformer3DModel`):
    every field of [`WanConfig`][] (SkyReels-V2 is Wan 2.1's architecture), and:

    - `inject_sample_info`: the model has the fps embedding (`fps_embedding`, an
        embedding of 2 entries, and `fps_projection`, `Linear -> SiLU -> Linear` to the
        six modulation vectors), added to every block's modulation; the call then takes
        `fps`.
    - `num_frame_per_block`: the frames of one block of the frame-block causal mask of
        autoregressive diffusion forcing (each latent frame sees the frames of its own
        block and of the blocks before it). 1 (the released configs): no mask, as in
        diffusers, which applies it only to blocks of more than one frame.

    Built from a diffusers `config.json` by [`SkyReelsV2Config.from_diffusers`][] (what
    [`SkyReelsV2Transformer3D.from_pretrained`][] does).
    """

    inject_sample_info: bool = False
    num_frame_per_block: int = 1

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.inject_sample_info, bool):
            raise ValueError(
                f"SkyReelsV2Config: `inject_sample_info` must be a bool; received {self.inject_sample_info!r}."
            )
        value = self.num_frame_per_block
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"SkyReelsV2Config: `num_frame_per_block` must be a positive int; received {value!r}."
            )

    @classmethod
    def from_diffusers(cls, config: dict, **overrides) -> "SkyReelsV2Config":
        """From a diffusers `SkyReelsV2Transformer3DModel` `config.json` (as a dict)."""
        fields = dict(inject_sample_info=bool(config.get("inject_sample_info", False)),
                      num_frame_per_block=config.get("num_frame_per_block", 1))
        return super().from_diffusers(config, **{**fields, **overrides})

    def to_diffusers(self) -> dict:
        """The diffusers `config.json` of this model."""
        return {**super().to_diffusers(), "_class_name": "SkyReelsV2Transformer3DModel",
                "inject_sample_info": self.inject_sample_info,
                "num_frame_per_block": self.num_frame_per_block}

    def to_wan(self) -> dict:
        raise ValueError("SkyReelsV2Config: only diffusers' layout is read and written (to_diffusers); "
                         "SkyReels-V2 has no original Wan layout here.")
