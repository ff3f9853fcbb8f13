"""The shape of a CogVideoX 1.0 transformer: `CogVideoXConfig` (diffusers' config
fields), and the RoPE positions its pipeline crops for a grid."""

import dataclasses

import numpy as np


_ACTIVATIONS = {"gelu-approximate": "gelu_tanh", "gelu": "gelu"}


@dataclasses.dataclass(frozen=True)
class CogVideoXConfig:
    """The shape of a CogVideoX 1.0 transformer (immutable, hashable: a static field).

    The field names and defaults are those of diffusers' `CogVideoXTransformer3DModel`
    `config.json` (CogVideoX-2B); build one from a checkpoint's with
    [`CogVideoXConfig.from_diffusers`][]. CogVideoX-5B: `num_attention_heads=48,
    num_layers=42, use_rotary_positional_embeddings=True`; 5B-I2V adds
    `in_channels=32, use_learned_positional_embeddings=True`.

    **Fields:**

    - `num_attention_heads`, `attention_head_dim`: heads and head size (width
        `dim = num_attention_heads * attention_head_dim`).
    - `in_channels`, `out_channels`: latent channels in and out.
    - `flip_sin_to_cos`, `freq_shift`: the timestep sinusoid's options.
    - `time_embed_dim`: the timestep embedding's width (the blocks' conditioning).
    - `text_embed_dim`: the text encoder's width (T5-XXL: 4096).
    - `num_layers`: the number of blocks.
    - `sample_width`, `sample_height`, `sample_frames`: the training resolution
        (latent width and height; frames before temporal compression). They fix the
        positional embedding's base grid and the RoPE crop region.
    - `patch_size`: the spatial patch size (a per-frame `Conv2d`).
    - `temporal_compression_ratio`: the VAE's (4): latent frames = `(sample_frames -
        1) // ratio + 1`.
    - `max_text_seq_length`: the text length of the positional embedding (226).
    - `activation_fn`: the FFN's, `"gelu-approximate"` or `"gelu"`.
    - `norm_elementwise_affine`, `norm_eps`: the blocks' and final LayerNorms'.
    - `spatial_interpolation_scale`, `temporal_interpolation_scale`: the 2B's sin-cos
        embedding's coordinate divisors.
    - `use_rotary_positional_embeddings`: 3D RoPE on the video tokens (5B) instead of
        the sin-cos embedding (2B).
    - `use_learned_positional_embeddings`: a learned embedding over `[text; video]`
        at the training resolution (5B-I2V).
    """

    num_attention_heads: int = 30
    attention_head_dim: int = 64
    in_channels: int = 16
    out_channels: int = 16
    flip_sin_to_cos: bool = True
    freq_shift: float = 0.0
    time_embed_dim: int = 512
    text_embed_dim: int = 4096
    num_layers: int = 30
    sample_width: int = 90
    sample_height: int = 60
    sample_frames: int = 49
    patch_size: int = 2
    temporal_compression_ratio: int = 4
    max_text_seq_length: int = 226
    activation_fn: str = "gelu-approximate"
    norm_elementwise_affine: bool = True
    norm_eps: float = 1e-5
    spatial_interpolation_scale: float = 1.875
    temporal_interpolation_scale: float = 1.0
    use_rotary_positional_embeddings: bool = False
    use_learned_positional_embeddings: bool = False

    def __post_init__(self):
        for name in ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels",
                     "time_embed_dim", "text_embed_dim", "num_layers", "sample_width",
                     "sample_height", "sample_frames", "patch_size", "temporal_compression_ratio",
                     "max_text_seq_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"CogVideoXConfig: `{name}` must be a positive int; received {value!r}."
                )
        if self.activation_fn not in _ACTIVATIONS:
            raise NotImplementedError(
                f"CogVideoXConfig: activation_fn={self.activation_fn!r} is not implemented "
                f"(one of {sorted(_ACTIVATIONS)})."
            )
        if self.use_learned_positional_embeddings and not self.use_rotary_positional_embeddings:
            raise ValueError(
                "CogVideoXConfig: use_learned_positional_embeddings needs "
                "use_rotary_positional_embeddings (as in diffusers: no CogVideoX has the "
                "learned embedding without RoPE)."
            )
        if self.use_rotary_positional_embeddings and self.attention_head_dim % 16:
            raise ValueError(
                "CogVideoXConfig: 3D RoPE splits the head into dim // 4 (time) and "
                "3 * dim // 8 (height, width) features of even size, so attention_head_dim "
                f"must be a multiple of 16; received {self.attention_head_dim}."
            )
        if not self.use_rotary_positional_embeddings and self.dim % 16:
            raise ValueError(
                "CogVideoXConfig: the 3D sin-cos embedding needs a width (num_attention_heads "
                f"* attention_head_dim) that is a multiple of 16; received {self.dim}."
            )

    @property
    def dim(self) -> int:
        """The model width, `num_attention_heads * attention_head_dim`."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def sample_grid(self) -> tuple[int, int, int]:
        """The token grid `(frames, height, width)` of the training resolution."""
        frames = (self.sample_frames - 1) // self.temporal_compression_ratio + 1
        p = self.patch_size
        return frames, self.sample_height // p, self.sample_width // p

    @classmethod
    def from_diffusers(cls, config: dict, **overrides) -> "CogVideoXConfig":
        """From a diffusers `CogVideoXTransformer3DModel` `config.json` (as a dict).

        Raises `NotImplementedError` for what the model does not implement: CogVideoX
        1.5 (`patch_size_t`, `ofs_embed_dim`), projections without bias
        (`attention_bias`, `patch_bias` false), a timestep activation other than SiLU.
        """
        unsupported = {
            "patch_size_t": (config.get("patch_size_t"), None),
            "ofs_embed_dim": (config.get("ofs_embed_dim"), None),
            "attention_bias": (config.get("attention_bias", True), True),
            "patch_bias": (config.get("patch_bias", True), True),
            "timestep_activation_fn": (config.get("timestep_activation_fn", "silu"), "silu"),
        }
        for name, (value, expected) in unsupported.items():
            if value != expected and not (value in (0, None) and expected is None):
                raise NotImplementedError(
                    f"CogVideoXConfig: {name}={value!r} is not implemented (CogVideoX 1.0 has "
                    f"{expected!r}); CogVideoX 1.5's temporal patches and ofs embedding are not "
                    "supported."
                )
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in config.items() if k in names}
        if fields.get("out_channels") is None:
            fields["out_channels"] = config.get("in_channels", 16)
        return cls(**{**fields, **overrides})

    def to_diffusers(self) -> dict:
        """The diffusers `config.json` of this model."""
        return {
            "_class_name": "CogVideoXTransformer3DModel",
            **dataclasses.asdict(self),
            "ofs_embed_dim": None,
            "dropout": 0.0,
            "attention_bias": True,
            "patch_size_t": None,
            "timestep_activation_fn": "silu",
            "patch_bias": True,
        }


def rope_crop_positions(grid: tuple[int, int, int], config: CogVideoXConfig):
    """The coordinates of CogVideoX-5B's 3D RoPE, as the diffusers CogVideoX pipeline
    computes them (`_prepare_rotary_positional_embeddings`).

    The `(height, width)` token grid is fitted inside the base grid of the training
    resolution (`sample_height // p`, `sample_width // p`) keeping its aspect ratio
    (`get_resize_crop_region_for_grid`, rounding as the pipeline does: Python's
    `round`) and centred; row `i` then sits at `linspace(top, bottom * (h - 1) / h,
    h)[i]`, and likewise for columns; frames at `0, 1, ...`.

    **Returns:** three float64 arrays `(frames,)`, `(height,)`, `(width,)` for
    [`vidax_eqx.nn.functional.rope_3d`][]`(positions=...)`.
    """
    f, h, w = grid
    th, tw = config.sample_height // config.patch_size, config.sample_width // config.patch_size
    if h / w > th / tw:
        rh, rw = th, int(round(th / h * w))
    else:
        rw, rh = tw, int(round(tw / w * h))
    top, left = int(round((th - rh) / 2.0)), int(round((tw - rw) / 2.0))
    rows = np.linspace(top, (top + rh) * (h - 1) / h, h)
    cols = np.linspace(left, (left + rw) * (w - 1) / w, w)
    return np.arange(f, dtype=np.float64), rows, cols
