"""The names of a module's parameters in a PyTorch state dict: this library's field paths
to Wan's and diffusers' tensor names (attention projections, MLPs, stacked layers), and
its linear layers by name (what LoRA files target)."""

from typing import NamedTuple

import equinox as eqx
import jax
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

from .. import nn


NAMINGS = ("wan", "diffusers")
"""The parameter namings `naming=` accepts: `"wan"` (Wan's reference model, attention
projections `q, k, v, o`) and `"diffusers"` (`to_q, to_k, to_v, to_out.0`)."""

# The attention projections under each naming: Wan's reference model calls them
# `q, k, v, o`; diffusers (WanAttention, CogVideoX's Attention) `to_q, to_k,
# to_v, to_out.0` (`to_out` is a ModuleList of the Linear and a Dropout).
# Field name (either naming) -> (wan name, diffusers name).
_PROJECTIONS = {
    "q": ("q", "to_q"),
    "k": ("k", "to_k"),
    "v": ("v", "to_v"),
    "o": ("o", "to_out.0"),
    "to_q": ("q", "to_q"),
    "to_k": ("k", "to_k"),
    "to_v": ("v", "to_v"),
    "to_out": ("o", "to_out.0"),
}
_ATTENTION_TYPES = (nn.Attention, nn.CrossAttention, nn.JointAttention)
# Wan's I2V image branch of the cross-attention: diffusers' added key/value projections.
_IMAGE_BRANCH = {
    "k_img": ("k_img", "add_k_proj"),
    "v_img": ("v_img", "add_v_proj"),
    "norm_k_img": ("norm_k_img", "norm_added_k"),
}
# Wan's MLPs are `nn.Sequential(Linear, GELU, Linear)` (`ffn.0`, `ffn.2`); diffusers'
# `FeedForward` is `net.0.proj` (the GELU module's projection) and `net.2`.
_FEED_FORWARD = {"fc1": ("0", "net.0.proj"), "fc2": ("2", "net.2")}
# Wan's `time_embedding` is `nn.Sequential(Linear, SiLU, Linear)`; diffusers'
# `TimestepEmbedding` names them `linear_1`, `linear_2`.
_TIMESTEP = {"linear_1": ("0", "linear_1"), "linear_2": ("2", "linear_2")}


def _renames(node) -> dict[str, tuple[str, str]]:
    """Field name -> (wan name, diffusers name) for the children of `node`."""
    if isinstance(node, eqx.nn.Sequential):
        return {"layers": ("", "")}  # torch.nn.Sequential names its children 0, 1, ...
    if isinstance(node, nn.LoRALinear):
        return {"base": ("", "")}  # the wrapped layer's weights keep its names
    if isinstance(node, nn.CrossAttention):
        return {**_PROJECTIONS, **_IMAGE_BRANCH}
    if isinstance(node, _ATTENTION_TYPES):
        return _PROJECTIONS
    if isinstance(node, nn.FeedForward):
        return _FEED_FORWARD
    if isinstance(node, nn.TimestepEmbedding):
        return _TIMESTEP
    return {}


def is_parameter(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def check_naming(naming) -> int:
    if naming not in NAMINGS:
        raise ValueError(f"`naming` must be one of {NAMINGS}; received {naming!r}.")
    return NAMINGS.index(naming)


class _Entry(NamedTuple):
    """One tensor of the state dict: leaf `leaf` (its layer `layer` when stacked)."""

    leaf: int
    layer: int | None
    names: tuple[str, str]  # (wan, diffusers)


def check_stacked(stacked) -> tuple[str, ...]:
    if isinstance(stacked, str) or not all(isinstance(p, str) and p for p in stacked):
        raise ValueError(
            "`stacked` must be a sequence of field paths (e.g. ('blocks',)); received "
            f"{stacked!r}."
        )
    return tuple(stacked)


def named_parameters(module, stacked=(), rename=None) -> tuple[list, list[_Entry], jax.tree_util.PyTreeDef]:
    """The module's leaves, and the state dict's tensors: one entry per array leaf, or
    one per layer for the leaves under a `stacked` field path.

    Names are PyTorch's: attribute names and sequence indices joined by dots,
    with the renames of `_renames` applied at each level, the layer index inserted
    after a stacked path, then `rename(name, naming)`. Leaves that are not arrays
    (functions, Python scalars, configurations) are not parameters.
    """
    stacked = check_stacked(stacked)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        module, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)
    )
    leaves, entries = [], []
    for index, (path, leaf) in enumerate(flat):
        leaves.append(leaf)
        if not is_parameter(leaf):
            continue
        named = torch_names(module, path, stacked)
        if named is None:  # a LoRA adapter's array: not a checkpoint parameter
            continue
        pair, layered = named
        layers = [None] if not layered else range(leaf.shape[0] if leaf.ndim else 0)
        for layer in layers:
            names = tuple(p.replace("{layer}", str(layer)) for p in pair)
            if rename is not None:
                names = (rename(names[0], "wan"), rename(names[1], "diffusers"))
            entries.append(_Entry(index, layer, names))
    for i, naming in enumerate(NAMINGS):
        seen = set()
        for entry in entries:
            if entry.names[i] in seen:
                raise ValueError(
                    f"two parameters of {type(module).__name__} share the {naming} name "
                    f"{entry.names[i]!r}; a state dict cannot address them separately."
                )
            seen.add(entry.names[i])
    return leaves, entries, treedef


def torch_names(module, path, stacked) -> tuple[tuple[str, str], bool] | None:
    """The PyTorch names (wan, diffusers) of the node at `path` in `module`, with
    `{layer}` after a stacked field path, and whether it is under one; `None` under a
    [`vidax_eqx.nn.LoRALinear`][]'s adapters."""
    parts: list[list[str]] = [[], []]
    fields: list[str] = []
    node = module
    layered = False
    for key in path:
        if isinstance(key, GetAttrKey):
            field, child = key.name, getattr(node, key.name, None)
        elif isinstance(key, SequenceKey):
            field, child = str(key.idx), node[key.idx]
        elif isinstance(key, DictKey):
            field, child = str(key.key), node[key.key]
        else:  # a pytree without named children: its flat index
            field, child = str(getattr(key, "key", key)), None
        if isinstance(node, nn.LoRALinear) and field == "adapters":
            return None
        renamed = _renames(node).get(field, (field, field))
        for i in (0, 1):
            if renamed[i]:
                parts[i].append(renamed[i])
        fields.append(field)
        if ".".join(fields) in stacked:
            layered = True
            for i in (0, 1):
                parts[i].append("{layer}")
        node = child
    return (".".join(parts[0]), ".".join(parts[1])), layered


class LinearName(NamedTuple):
    """A linear layer of a module and its PyTorch names (one per layer of a stack)."""

    path: tuple  # the key path of the `eqx.nn.Linear` / `LoRALinear` in the module
    layer: int | None  # its index in a stacked field, or None
    names: tuple[str, str]  # (wan, diffusers), without `.weight`


def is_linear(x) -> bool:
    return isinstance(x, (eqx.nn.Linear, nn.LoRALinear, nn.QuantizedLinear))


def linear_layers(module, *, stacked=(), rename=None) -> list[LinearName]:
    """Every linear layer (`eqx.nn.Linear` or [`vidax_eqx.nn.LoRALinear`][]) of
    `module` with its names under both namings, as [`state_dict`][] names its
    weight without the `.weight` (`blocks.3.self_attn.q`, `blocks.3.attn1.to_q`): the
    targets of LoRA files and name patterns. `stacked`, `rename` as for
    [`load_state_dict`][]."""
    stacked = check_stacked(stacked)
    out = []
    for path, node in jax.tree_util.tree_flatten_with_path(module, is_leaf=is_linear)[0]:
        if not is_linear(node):
            continue
        pair, layered = torch_names(module, path, stacked)
        shape = node.weight.shape
        for layer in ([None] if not layered else range(shape[0])):
            names = tuple(p.replace("{layer}", str(layer)) for p in pair)
            if rename is not None:  # names the weight: the layer is the weight's parent
                names = tuple(rename(n + ".weight", naming).removesuffix(".weight")
                              for n, naming in zip(names, NAMINGS))
            out.append(LinearName(tuple(path), layer, names))
    return out
