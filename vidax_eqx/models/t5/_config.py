"""The T5 / UMT5 encoders' configuration: transformers' `T5Config` / `UMT5Config`, checked."""

import dataclasses
import json
import math
import os

from ..._checks import is_int


# model_type -> whether every layer has its own relative position bias.
_MODEL_TYPES = {"umt5": True, "t5": False}
# What each supported `feed_forward_proj` means: (dense_act_fn, is_gated_act).
_FEED_FORWARD = {"gated-gelu": ("gelu_new", True)}


@dataclasses.dataclass(frozen=True)
class T5EncoderConfig:
    """A T5 encoder's architecture, in transformers' `T5Config` / `UMT5Config` names.

    The defaults are UMT5-XXL's (Wan 2.1's and 2.2's text encoder); CogVideoX's is T5
    v1.1 XXL (`vocab_size=32128`, `per_layer_bias=False`).

    **Fields:**

    - `vocab_size`, `d_model`: the token embedding's rows and width.
    - `d_kv`: each head's width (`num_heads * d_kv` need not equal `d_model`).
    - `d_ff`: the gated feed-forward's hidden width.
    - `num_layers`, `num_heads`: encoder layers, attention heads.
    - `relative_attention_num_buckets`, `relative_attention_max_distance`: T5's
        bidirectional relative position buckets.
    - `layer_norm_epsilon`: the RMS norms' epsilon.
    - `feed_forward_proj`: `"gated-gelu"` (`gelu_new`, the tanh approximation, on
        `wi_0`, times `wi_1`), the only one supported.
    - `per_layer_bias`: `True` for UMT5 (each layer's self-attention has its own
        `relative_attention_bias`), `False` for T5 (the first layer's, shared by all).
    """

    vocab_size: int = 256384
    d_model: int = 4096
    d_kv: int = 64
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "gated-gelu"
    per_layer_bias: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
                     "relative_attention_num_buckets", "relative_attention_max_distance"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"T5EncoderConfig: `{name}` must be a positive int; "
                                 f"received {value!r}.")
        if self.relative_attention_num_buckets < 4:
            raise ValueError(
                "T5EncoderConfig: `relative_attention_num_buckets` must be >= 4 (half for "
                "each direction, half of those exact); received "
                f"{self.relative_attention_num_buckets}.")
        eps = self.layer_norm_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError("T5EncoderConfig: `layer_norm_epsilon` must be a positive "
                             f"float; received {eps!r}.")
        if self.feed_forward_proj not in _FEED_FORWARD:
            raise ValueError(
                f"T5EncoderConfig: `feed_forward_proj` must be one of {sorted(_FEED_FORWARD)} "
                f"(T5 v1.1's and UMT5's); received {self.feed_forward_proj!r}.")
        if not isinstance(self.per_layer_bias, bool):
            raise ValueError("T5EncoderConfig: `per_layer_bias` must be a bool; received "
                             f"{self.per_layer_bias!r}.")

    @classmethod
    def from_dict(cls, config: dict) -> "T5EncoderConfig":
        """The configuration of transformers' config.json (a `T5Config` or `UMT5Config`).

        `model_type` (`"umt5"` or `"t5"`) decides `per_layer_bias`. Keys that do not
        change the encoder's forward pass (dropout, decoder sizes, token ids, ...) are
        ignored; a value the encoder does not implement (another `feed_forward_proj`, a
        `dense_act_fn` or `is_gated_act` that disagrees with it, `is_decoder=True`) is
        refused by name.
        """
        if not isinstance(config, dict):
            raise ValueError(f"T5EncoderConfig.from_dict takes a dict; received "
                             f"{type(config).__name__}.")
        model_type = config.get("model_type")
        if model_type not in _MODEL_TYPES:
            raise ValueError(
                f"T5EncoderConfig: `model_type` must be one of {sorted(_MODEL_TYPES)} "
                f"(UMT5EncoderModel, T5EncoderModel); received {model_type!r}.")
        proj = config.get("feed_forward_proj", "relu")
        if proj not in _FEED_FORWARD:
            raise ValueError(
                f"T5EncoderConfig: `feed_forward_proj` must be one of {sorted(_FEED_FORWARD)} "
                f"(T5 v1.1's and UMT5's); received {proj!r}.")
        act, gated = _FEED_FORWARD[proj]
        for name, expected in (("dense_act_fn", act), ("is_gated_act", gated),
                               ("is_decoder", False)):
            if name in config and config[name] != expected:
                raise ValueError(
                    f"T5EncoderConfig: `{name}` must be {expected!r} with feed_forward_proj="
                    f"{proj!r} (an encoder); received {config[name]!r}.")
        missing = [n for n in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers",
                               "num_heads") if n not in config]
        if missing:
            raise ValueError(f"T5EncoderConfig: the config has no {missing}.")
        names = [f.name for f in dataclasses.fields(cls)
                 if f.name not in ("feed_forward_proj", "per_layer_bias")]
        return cls(**{n: config[n] for n in names if n in config}, feed_forward_proj=proj,
                   per_layer_bias=_MODEL_TYPES[model_type])

    @classmethod
    def from_file(cls, path) -> "T5EncoderConfig":
        """The configuration of a config.json file (or of a directory holding one)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f))


def check_tensor_parallel(owner: str, config: T5EncoderConfig, tp_axis: str, tp: int) -> None:
    """Raises unless tensor parallelism over the `tp` devices of `tp_axis` splits the
    encoder evenly: its heads, its feed-forward's hidden units and its vocabulary."""
    sizes = {"num_heads": config.num_heads, "d_ff": config.d_ff, "vocab_size": config.vocab_size}
    bad = [name for name, size in sizes.items() if size % tp]
    if bad:
        received = ", ".join(f"{name}={size}" for name, size in sizes.items())
        common = math.gcd(*sizes.values())
        fits = [n for n in range(2, common + 1) if common % n == 0]
        hint = (f"a tensor-parallel size that divides them ({', '.join(map(str, fits))})"
                if fits else "no tensor parallelism (tp_axis=None; FSDP over fsdp_axes)")
        raise ValueError(
            f"{owner}: tensor parallelism splits the attention heads, the feed-forward's "
            f"hidden units (d_ff) and the vocabulary over the {tp} devices of the axis "
            f"{tp_axis!r}, so each must be a multiple of {tp}; received {received} "
            f"({', '.join(bad)} not). Use {hint}.")
