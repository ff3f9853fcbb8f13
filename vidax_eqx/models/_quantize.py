"""int8 transformers: a model's block linear layers as [`vidax_eqx.nn.QuantizedLinear`][].

Our own small layer rather than qwix: qwix chooses the layers to quantize by the module
paths of Flax (linen / NNX) and intercepts their calls; an Equinox model has neither, and
every linear of `vidax_eqx.nn` already goes through one function
(`nn._layers.linear`), so a layer type and that function are the whole integration.
"""

import equinox as eqx
import jax

from .. import nn
from ._base import AbstractExperts, AbstractModel


WEIGHTS = ("int8",)
"""The weight formats of [`quantize`][]."""


def quantize(model, weights: str = "int8", activations: str | None = None):
    """`model` with the linear layers of its stacked blocks in int8
    ([`vidax_eqx.nn.QuantizedLinear`][]: per-output-channel int8 weights and their
    float32 scales, half the bytes of bfloat16), the same class, callable wherever the
    float model is (jit, sampling, streaming, step caching, stacked-block streaming
    from host memory, LoRA adapters added after). The embeddings, norms, modulation,
    condition projections and the output head stay in float: a small share of the
    weights, and the most sensitive.

    **Arguments:**

    - `model`: a transformer of [`vidax_eqx.models`][] (its `stacked_layers`), or
        [`WanExperts`][vidax_eqx.models.WanExperts] (both experts).
    - `weights`: `"int8"`.
    - `activations`: `None` (the weights dequantized in each product: memory, not
        arithmetic) or `"int8"` (each token quantized with its own scale and the
        product in int8 with an int32 sum: the chip's int8 rate).

    A layer already quantized, or holding an adapter merged into its weight, is
    refused (merge adapters before quantizing).
    """
    if weights not in WEIGHTS:
        raise ValueError(f"quantize: `weights` must be one of {WEIGHTS}; received {weights!r}.")
    if activations not in nn.QUANTIZED_ACTIVATIONS:
        raise ValueError(f"quantize: `activations` must be one of {nn.QUANTIZED_ACTIVATIONS}; "
                         f"received {activations!r}.")
    if isinstance(model, AbstractExperts):
        for i, expert in enumerate(model.experts):
            model = model.with_expert(i, quantize(expert, weights, activations))
        return model
    stacked = getattr(model, "stacked_layers", ())
    if not isinstance(model, AbstractModel) or not stacked:
        raise ValueError(f"quantize: `model` must be a transformer of vidax_eqx.models with "
                         f"stacked blocks; received {type(model).__name__}.")
    owner = type(model).__name__

    def one(layer):
        if isinstance(layer, nn.QuantizedLinear) or (
                isinstance(layer, nn.LoRALinear) and isinstance(layer.base, nn.QuantizedLinear)):
            raise ValueError(f"quantize: this {owner} is quantized already.")
        if isinstance(layer, nn.LoRALinear):
            if layer.merged:
                raise ValueError(
                    f"quantize: a layer of this {owner} holds adapters merged into its weight "
                    f"({list(layer.merged)}); quantizing would fold them in for good. Unmerge "
                    "them first, or remove the LoRA.")
            return eqx.tree_at(lambda l: l.base, layer,
                               nn.QuantizedLinear.from_linear(layer.base, activations))
        if isinstance(layer, eqx.nn.Linear):
            return nn.QuantizedLinear.from_linear(layer, activations)
        return layer

    linear = lambda x: isinstance(x, (eqx.nn.Linear, nn.LoRALinear, nn.QuantizedLinear))  # noqa: E731
    for name in stacked:
        blocks = jax.tree.map(one, getattr(model, name), is_leaf=linear)
        model = eqx.tree_at(lambda m, n=name: getattr(m, n), model, blocks)
    return model


# -- checkpoints: `from_pretrained(quantize=)`, int8 weights written and read -------------

QUANTIZE = (None, "int8-weights", "int8")
"""The `quantize=` options of the transformers' and pipelines' `from_pretrained`:
int8 weights, or int8 weights and activations (W8A8)."""

_MODES = {"int8-weights": ("int8", None), "int8": ("int8", "int8")}
_METHOD = "vidax_eqx"


def quantize_mode(owner: str, quantize) -> tuple[str, str | None] | None:
    """`(weights, activations)` of a `quantize=` option (`None`: float)."""
    if quantize not in QUANTIZE:
        raise ValueError(f"{owner}: `quantize` must be one of {QUANTIZE}; received {quantize!r}.")
    return _MODES.get(quantize)


def _quantized_layers(model) -> list:
    is_q = lambda x: isinstance(x, nn.QuantizedLinear)  # noqa: E731
    return [x for x in jax.tree.leaves(model, is_leaf=is_q) if is_q(x)]


def quantization_config(model) -> dict | None:
    """The `quantization_config` entry a quantized model's `config.json` carries (its
    weights' and activations' format), `None` for a float model."""
    layers = _quantized_layers(model)
    if not layers:
        return None
    modes = {layer.activations for layer in layers}
    if len(modes) != 1:
        raise ValueError(f"{type(model).__name__}.save_pretrained: its int8 layers mix "
                         f"activation modes {sorted(map(str, modes))}; quantize it in one call.")
    return {"quant_method": _METHOD, "weights": "int8", "activations": modes.pop()}


def read_quantization(owner: str, entry) -> tuple[str, str | None] | None:
    """`(weights, activations)` of a `config.json`'s `quantization_config` entry (`None`
    when there is none); a format this library did not write is refused."""
    if entry is None:
        return None
    if not isinstance(entry, dict) or entry.get("quant_method") != _METHOD:
        method = entry.get("quant_method") if isinstance(entry, dict) else entry
        raise ValueError(f"{owner}.from_pretrained: the checkpoint is quantized by {method!r} "
                         f"(config.json's quantization_config); only {_METHOD!r} int8 "
                         "checkpoints (a quantized model's save_pretrained) are read.")
    mode = (entry.get("weights"), entry.get("activations"))
    if mode not in _MODES.values():
        raise ValueError(f"{owner}.from_pretrained: config.json's quantization_config {entry} "
                         f"names no known format ({sorted(map(str, _MODES.values()))}).")
    return mode


def quantize_to(model, option, owner: str):
    """`model` in the format of the `quantize=` option `option` (`None`: as it is); a
    model already in that format (loaded from an int8 checkpoint) as it is, one in
    another refused."""
    mode = quantize_mode(f"{owner}.from_pretrained", option)
    if mode is None:
        return model
    stored = quantization_config(model)
    if stored is None:
        return quantize(model, *mode)
    if (stored["weights"], stored["activations"]) != mode:
        raise ValueError(f"{owner}.from_pretrained: the checkpoint holds int8 weights of format "
                         f"({stored['weights']!r}, {stored['activations']!r}) (weights, "
                         f"activations); received quantize={option!r}, another. Load it as it "
                         "is (quantize=None).")
    return model
