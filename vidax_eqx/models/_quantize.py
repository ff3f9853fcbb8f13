"""int8 transformers: a model's block linear layers as [`vidax_eqx.nn.QuantizedLinear`][].

Our own small layer rather than qwix: qwix chooses the layers to quantize by the module
paths of Flax (linen / NNX) and intercepts their calls; an Equinox model has neither, and
every linear of `vidax_eqx.nn` already goes through one function
(`nn._layers.linear`), so a layer type and that function are the whole integration.
"""

import equinox as eqx
import jax

from .. import kernels, nn
from ..nn.internal import with_quantized_attention
from ._base import AbstractExperts, AbstractModel


WEIGHTS = ("int8",)
"""The weight formats of [`quantize`][]."""


def quantize(model, weights: str = "int8", activations: str | None = None, attention: str | None = None):
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
    - `attention`: `None` (float attention), `"int8-qk"` or `"int8"`: the blocks'
        self-attention computed by [`vidax_eqx.kernels.attention`][]`(quantize=...)`
        (Q.Kᵀ, and with `"int8"` P.V, on the int8 units; the gradient the float
        attention's). The cross-attention to the text (a few hundred keys) stays in
        float, as does a streamed chunk's attention over its cache.

    A layer already quantized, or holding an adapter merged into its weight, is
    refused (merge adapters before quantizing).
    """
    if weights not in WEIGHTS:
        raise ValueError(f"quantize: `weights` must be one of {WEIGHTS}; received {weights!r}.")
    if activations not in nn.QUANTIZED_ACTIVATIONS:
        raise ValueError(f"quantize: `activations` must be one of {nn.QUANTIZED_ACTIVATIONS}; "
                         f"received {activations!r}.")
    if attention not in kernels.QUANTIZE:
        raise ValueError(f"quantize: `attention` must be one of {kernels.QUANTIZE}; received "
                         f"{attention!r}.")
    if isinstance(model, AbstractExperts):
        for i, expert in enumerate(model.experts):
            model = model.with_expert(i, quantize(expert, weights, activations, attention))
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
    if attention is not None and not _attention_layers([getattr(model, n) for n in stacked]):
        raise ValueError(f"quantize: the blocks of a {owner} have no self-attention layer that "
                         f"int8 attention serves (attention={attention!r}); its attention stays "
                         "in float (attention=None).")
    for name in stacked:
        blocks = jax.tree.map(one, getattr(model, name), is_leaf=linear)
        if attention is not None:
            blocks = with_quantized_attention(blocks, attention)
        model = eqx.tree_at(lambda m, n=name: getattr(m, n), model, blocks)
    return model


# -- checkpoints: `from_pretrained(quantize=)`, int8 weights written and read -------------

QUANTIZE = (None, "int8-weights", "int8")
"""The `quantize=` options of the transformers' and pipelines' `from_pretrained`:
int8 weights, or int8 weights and activations (W8A8). The attention stays in float
(int8 attention is slower than bf16 splash on a TPU v5e: `docs/benchmarks.md`); ask for
it with [`quantize`][vidax_eqx.models.quantize]`(..., attention="int8")`."""

# (weights, activations) of each option.
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
    attention = {m.quantize for m in _attention_layers(model)}
    if len(modes) != 1 or len(attention) > 1:
        raise ValueError(f"{type(model).__name__}.save_pretrained: its int8 layers mix "
                         f"activation modes {sorted(map(str, modes))} or attention modes "
                         f"{sorted(map(str, attention))}; quantize it in one call.")
    return {"quant_method": _METHOD, "weights": "int8", "activations": modes.pop(),
            "attention": attention.pop() if attention else None}


def _attention_layers(model) -> list:
    is_a = lambda x: isinstance(x, nn.Attention)  # noqa: E731
    return [x for x in jax.tree.leaves(model, is_leaf=is_a) if is_a(x)]


def read_quantization(owner: str, entry) -> tuple[str, str | None, str | None] | None:
    """`(weights, activations, attention)` of a `config.json`'s `quantization_config`
    entry (`None` when there is none); a format this library did not write is refused."""
    if entry is None:
        return None
    if not isinstance(entry, dict) or entry.get("quant_method") != _METHOD:
        method = entry.get("quant_method") if isinstance(entry, dict) else entry
        raise ValueError(f"{owner}.from_pretrained: the checkpoint is quantized by {method!r} "
                         f"(config.json's quantization_config); only {_METHOD!r} int8 "
                         "checkpoints (a quantized model's save_pretrained) are read.")
    mode = (entry.get("weights"), entry.get("activations"), entry.get("attention"))
    if mode[0] not in WEIGHTS or mode[1] not in nn.QUANTIZED_ACTIVATIONS or mode[2] not in kernels.QUANTIZE:
        raise ValueError(f"{owner}.from_pretrained: config.json's quantization_config {entry} "
                         f"names no known format (weights {WEIGHTS}, activations "
                         f"{nn.QUANTIZED_ACTIVATIONS}, attention {kernels.QUANTIZE}).")
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
