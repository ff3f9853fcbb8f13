"""The shape of a Wan 2.1 / 2.2 transformer: `WanConfig`, its presets, and its
conversions to and from the diffusers and original Wan `config.json`."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class WanConfig:
    """The shape of a Wan 2.1 or 2.2 transformer (immutable, hashable: a static field).

    The defaults are Wan 2.1 T2V 1.3B. Wan 14B: `dim=5120, ffn_dim=13824,
    num_heads=40, num_layers=40`. Build one from a checkpoint's `config.json` with
    [`WanConfig.from_diffusers`][] or [`WanConfig.from_wan`][] (what
    [`WanTransformer3D.from_pretrained`][] does).

    **Fields:**

    - `dim`, `ffn_dim`, `num_heads`, `num_layers`: width, MLP width, heads, blocks.
    - `in_channels`, `out_channels`: latent channels in and out (16; I2V takes 36 in).
    - `patch_size`: `(pt, ph, pw)`, default `(1, 2, 2)`.
    - `text_dim`: the text encoder's width (umT5: 4096); `freq_dim`: the timestep
        sinusoid's width (256).
    - `eps`: the norms' epsilon.
    - `qk_norm`: RMSNorm on queries and keys (Wan 2.1: always).
    - `cross_attn_norm`: the affine LayerNorm before the cross-attention.
    - `image_dim`: the CLIP image feature width of the I2V models (1280), or `None`
        (text-to-video: no image branch).
    - `text_len`: `None` uses the text context as given (diffusers' transformer);
        an int zero-pads it to that many tokens before the text embedding, as Wan's
        own `WanModel.forward` does (`text_len=512`), so that the model also attends
        to the embedded padding. The two differ in their numbers.
    - `rope_theta`: the RoPE base (10000).
    - `pos_embed_seq_len`: Wan 2.1 FLF2V (first-last-frame to video): the length of
        the learned position embedding added to the image features (514: the CLIP
        tokens of the first frame, then the last frame's), or `None`. Needs `image_dim`.
    - `gate_compress`: each block's self-attention has the `to_gate_compress`
        projection of FastVideo's video sparse attention (VSA) Wan models: the gate of
        VSA's coarse output (`blocks.N.to_gate_compress.*` in a diffusers checkpoint).
        Not a field of the reference configs: `from_pretrained(gate_compress=True)`.
    - `rope_max_seq_len`: diffusers' `rope_max_seq_len` (1024), the positions per grid
        axis its RoPE table holds; read and written back by the diffusers config (this
        library computes RoPE at any position, so it does not limit a grid here).

    The released models, as [`WanConfig.preset`][] names them:

    | preset | dim | ffn_dim | heads | layers | channels in / out | image_dim | pos_embed_seq_len |
    |---|---|---|---|---|---|---|---|
    | `"t2v-1.3b"` (Wan 2.1) | 1536 | 8960 | 12 | 30 | 16 / 16 | - | - |
    | `"t2v-14b"` (Wan 2.1) | 5120 | 13824 | 40 | 40 | 16 / 16 | - | - |
    | `"i2v-14b"` (Wan 2.1) | 5120 | 13824 | 40 | 40 | 36 / 16 | 1280 | - |
    | `"flf2v-14b"` (Wan 2.1) | 5120 | 13824 | 40 | 40 | 36 / 16 | 1280 | 514 |
    | `"ti2v-5b"` (Wan 2.2) | 3072 | 14336 | 24 | 30 | 48 / 48 | - | - |
    | `"t2v-a14b"` (Wan 2.2, each expert) | 5120 | 13824 | 40 | 40 | 16 / 16 | - | - |
    | `"i2v-a14b"` (Wan 2.2, each expert) | 5120 | 13824 | 40 | 40 | 36 / 16 | - | - |

    All use patch `(1, 2, 2)`, `text_dim` 4096 (umT5) and `freq_dim` 256. Wan 2.2's
    TI2V-5B takes a timestep per token ([`wan_image_timestep`][]); its 48 latent
    channels are those of the Wan 2.2 VAE. The A14B models are two experts
    ([`WanExperts`][]).
    """

    dim: int = 1536
    ffn_dim: int = 8960
    num_heads: int = 12
    num_layers: int = 30
    in_channels: int = 16
    out_channels: int = 16
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 4096
    freq_dim: int = 256
    eps: float = 1e-6
    qk_norm: bool = True
    cross_attn_norm: bool = True
    image_dim: int | None = None
    text_len: int | None = None
    rope_theta: float = 10000.0
    pos_embed_seq_len: int | None = None
    gate_compress: bool = False
    rope_max_seq_len: int = 1024

    def __post_init__(self):
        for name in ("dim", "ffn_dim", "num_heads", "num_layers", "in_channels", "out_channels",
                     "text_dim", "freq_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"WanConfig: `{name}` must be a positive int; received {value!r}.")
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 2:
            raise ValueError(
                "WanConfig: `dim` must be a multiple of `num_heads` with an even head_dim; "
                f"received dim={self.dim}, num_heads={self.num_heads}."
            )
        if self.pos_embed_seq_len is not None:
            value = self.pos_embed_seq_len
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"WanConfig: `pos_embed_seq_len` must be None or a positive int; received {value!r}."
                )
            if self.image_dim is None:
                raise ValueError(
                    "WanConfig: `pos_embed_seq_len` (FLF2V's image position embedding) needs "
                    f"`image_dim` (the image branch); received pos_embed_seq_len={value}, "
                    "image_dim=None."
                )
        value = self.rope_max_seq_len
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"WanConfig: `rope_max_seq_len` must be a positive int; received {value!r}.")
        if not isinstance(self.gate_compress, bool):
            raise ValueError(
                f"WanConfig: `gate_compress` must be a bool; received {self.gate_compress!r}."
            )
        object.__setattr__(self, "patch_size", tuple(self.patch_size))

    @classmethod
    def preset(cls, name: str, **overrides) -> "WanConfig":
        """The configuration of a released Wan model (the table above), e.g.
        `WanConfig.preset("ti2v-5b")`; `overrides` replace fields (e.g. `num_layers=2`
        for a test)."""
        if name not in _PRESETS:
            raise ValueError(f"WanConfig.preset: `name` must be one of {sorted(_PRESETS)}; "
                             f"received {name!r}.")
        return cls(**{**_PRESETS[name], **overrides})

    @property
    def head_dim(self) -> int:
        """The attention head size, `dim // num_heads`."""
        return self.dim // self.num_heads

    @classmethod
    def from_diffusers(cls, config: dict, **overrides) -> "WanConfig":
        """From a diffusers `WanTransformer3DModel` `config.json` (as a dict)."""
        heads, head_dim = config.get("num_attention_heads", 40), config.get("attention_head_dim", 128)
        dim = heads * head_dim
        image_dim = config.get("image_dim")
        added = config.get("added_kv_proj_dim")
        if (image_dim is None) != (added is None) or added not in (None, dim):
            raise ValueError(
                "WanConfig: an I2V config has image_dim and added_kv_proj_dim == the model "
                f"width ({dim}); received image_dim={image_dim}, added_kv_proj_dim={added}."
            )
        fields = dict(
            dim=dim,
            ffn_dim=config.get("ffn_dim", 13824),
            num_heads=heads,
            num_layers=config.get("num_layers", 40),
            in_channels=config.get("in_channels", 16),
            out_channels=config.get("out_channels") or config.get("in_channels", 16),
            patch_size=tuple(config.get("patch_size", (1, 2, 2))),
            text_dim=config.get("text_dim", 4096),
            freq_dim=config.get("freq_dim", 256),
            eps=config.get("eps", 1e-6),
            qk_norm=config.get("qk_norm", "rms_norm_across_heads") is not None,
            cross_attn_norm=config.get("cross_attn_norm", True),
            image_dim=image_dim,
            pos_embed_seq_len=config.get("pos_embed_seq_len"),
            rope_max_seq_len=config.get("rope_max_seq_len", 1024),
        )
        return cls(**{**fields, **overrides})

    @classmethod
    def from_wan(cls, config: dict, tensors=None, **overrides) -> "WanConfig":
        """From an original Wan 2.1 or 2.2 `config.json` (`dim`, `ffn_dim`, `num_heads`, ...).

        `model_type` `"t2v"`, `"i2v"`, `"flf2v"` (Wan 2.1) and `"ti2v"` (Wan 2.2) are
        read. Wan 2.2's I2V experts have no image branch (no CLIP features): with
        `tensors`, the branch is there when its weights are; without, `"i2v"` means
        Wan 2.1's (CLIP features of width 1280). Real Wan configs leave out `text_dim`, `patch_size`, `qk_norm`,
        `cross_attn_norm` and `window_size`: they are read off the checkpoint's tensor
        shapes when `tensors` (a mapping with `shape(name)`, e.g.
        [`vidax_eqx.interop.open_checkpoint`][]) is given, and take Wan's defaults
        otherwise.
        """
        model_type = config.get("model_type", "t2v")
        if model_type not in ("t2v", "i2v", "flf2v", "ti2v"):
            raise NotImplementedError(
                f"WanConfig: model_type={model_type!r} is not implemented (t2v, i2v, flf2v "
                "and ti2v are)."
            )
        window = tuple(config.get("window_size", (-1, -1)))
        if window != (-1, -1):
            raise NotImplementedError(
                f"WanConfig: window_size={window} (local attention on flattened tokens) is not "
                "implemented; Wan 2.1's released models use (-1, -1)."
            )
        def shape(name):  # None: no tensors given, or no such tensor
            return tensors.shape(name) if tensors is not None and name in tensors else None

        def has(name):  # None: no tensors given
            return None if tensors is None else name in tensors

        patch = shape("patch_embedding.weight")
        text = shape("text_embedding.0.weight")
        image = shape("img_emb.proj.0.weight")
        position = shape("img_emb.emb_pos")
        if model_type in ("t2v", "ti2v") or (tensors is not None and image is None):
            image_dim = None  # Wan 2.2's I2V experts: no image branch
        else:
            image_dim = 1280 if image is None else image[0]
        fields = dict(
            dim=config.get("dim", 2048),
            ffn_dim=config.get("ffn_dim", 8192),
            num_heads=config.get("num_heads", 16),
            num_layers=config.get("num_layers", 32),
            in_channels=config.get("in_dim", 16 if patch is None else patch[1]),
            out_channels=config.get("out_dim", 16),
            patch_size=tuple(config.get("patch_size", (1, 2, 2) if patch is None else patch[2:])),
            text_dim=config.get("text_dim", 4096 if text is None else text[1]),
            freq_dim=config.get("freq_dim", 256),
            eps=config.get("eps", 1e-6),
            qk_norm=config.get("qk_norm", has("blocks.0.self_attn.norm_q.weight") is not False),
            cross_attn_norm=config.get("cross_attn_norm", has("blocks.0.norm3.weight") is not False),
            image_dim=image_dim,
            pos_embed_seq_len=(None if model_type != "flf2v" or image_dim is None
                               else 514 if position is None else position[1]),
        )
        return cls(**{**fields, **overrides})

    def to_diffusers(self) -> dict:
        """The diffusers `config.json` of this model."""
        return {
            "_class_name": "WanTransformer3DModel",
            "patch_size": list(self.patch_size),
            "num_attention_heads": self.num_heads,
            "attention_head_dim": self.head_dim,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "text_dim": self.text_dim,
            "freq_dim": self.freq_dim,
            "ffn_dim": self.ffn_dim,
            "num_layers": self.num_layers,
            "cross_attn_norm": self.cross_attn_norm,
            "qk_norm": "rms_norm_across_heads" if self.qk_norm else None,
            "eps": self.eps,
            "image_dim": self.image_dim,
            "added_kv_proj_dim": None if self.image_dim is None else self.dim,
            "rope_max_seq_len": self.rope_max_seq_len,
            "pos_embed_seq_len": self.pos_embed_seq_len,
        }

    def to_wan(self) -> dict:
        """The original Wan `config.json` of this model (with every key it may omit)."""
        return {
            "_class_name": "WanModel",
            "model_type": ("flf2v" if self.pos_embed_seq_len is not None
                           else "i2v" if self.image_dim is not None
                           or self.in_channels != self.out_channels else "t2v"),
            "patch_size": list(self.patch_size),
            "text_len": 512 if self.text_len is None else self.text_len,
            "in_dim": self.in_channels,
            "dim": self.dim,
            "ffn_dim": self.ffn_dim,
            "freq_dim": self.freq_dim,
            "text_dim": self.text_dim,
            "out_dim": self.out_channels,
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "window_size": [-1, -1],
            "qk_norm": self.qk_norm,
            "cross_attn_norm": self.cross_attn_norm,
            "eps": self.eps,
        }


_WAN_14B = dict(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)
_PRESETS = {
    "t2v-1.3b": dict(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30),
    "t2v-14b": _WAN_14B,
    "i2v-14b": dict(_WAN_14B, in_channels=36, image_dim=1280),
    "flf2v-14b": dict(_WAN_14B, in_channels=36, image_dim=1280, pos_embed_seq_len=514),
    "ti2v-5b": dict(dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, in_channels=48,
                    out_channels=48),
    "t2v-a14b": _WAN_14B,
    "i2v-a14b": dict(_WAN_14B, in_channels=36),
}
