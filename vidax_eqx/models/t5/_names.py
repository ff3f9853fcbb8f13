"""T5 / UMT5 checkpoint names: the declarative table from this library's field names to
transformers' tensor names, and the set of names a checkpoint of a configuration holds."""

import re

from ._config import T5EncoderConfig


# The layer's field names -> transformers' names under `encoder.block.{i}.`.
_LAYER_NAMES = {
    "attn_norm": "layer.0.layer_norm",
    "q": "layer.0.SelfAttention.q",
    "k": "layer.0.SelfAttention.k",
    "v": "layer.0.SelfAttention.v",
    "o": "layer.0.SelfAttention.o",
    "relative_attention_bias": "layer.0.SelfAttention.relative_attention_bias",
    "ff_norm": "layer.1.layer_norm",
    "wi_0": "layer.1.DenseReluDense.wi_0",
    "wi_1": "layer.1.DenseReluDense.wi_1",
    "wo": "layer.1.DenseReluDense.wo",
}
# The encoder's other parameters -> transformers' names.
_TOP_NAMES = {
    "embeddings.shared.weight": "shared.weight",
    "final_layer_norm.weight": "encoder.final_layer_norm.weight",
    "embeddings.relative_attention_bias.weight":
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
}
TIED = "encoder.embed_tokens.weight"
"""transformers' copy of `shared.weight` (the encoder's `embed_tokens` is the same
module) that some checkpoints also store, e.g. Wan's diffusers `text_encoder/`."""


def rename(name: str, naming: str) -> str:
    """This module's parameter name -> transformers' (`load_state_dict`'s `rename=`)."""
    del naming  # both namings are transformers'
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = re.fullmatch(r"blocks\.(\d+)\.(\w+)\.weight", name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"T5Encoder: no transformers name for the parameter {name!r}.")
    return f"encoder.block.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


def checkpoint_names(config: T5EncoderConfig) -> set[str]:
    """The transformers names of every tensor an encoder of `config` reads."""
    names = {_TOP_NAMES["embeddings.shared.weight"], _TOP_NAMES["final_layer_norm.weight"]}
    if not config.per_layer_bias:
        names.add(_TOP_NAMES["embeddings.relative_attention_bias.weight"])
    for field in _LAYER_NAMES:
        if field == "relative_attention_bias" and not config.per_layer_bias:
            continue
        names.update(rename(f"blocks.{i}.{field}.weight", "") for i in range(config.num_layers))
    return names
