"""LoRA on whole models: adapters added by name pattern, shared LoRA files loaded
(diffusers/PEFT, ComfyUI/kohya) and saved.

The adapters themselves are [`vidax_eqx.nn.LoRALinear`][] layers; merging, unmerging,
switching and training them are the functions of [`vidax_eqx.nn`][]
(`merge_lora`, `unmerge_lora`, `set_lora_scale`, `lora_filter`), which work on any
model, stacked layers and [`WanExperts`][] included.
"""

import fnmatch

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.tree_util import DictKey, GetAttrKey, SequenceKey
from jaxtyping import PRNGKeyArray

from .. import interop, nn
from ..nn.internal import init
from ..nn.internal import attach
from ._base import AbstractExperts, AbstractModel


_SHOWN = 20  # keys listed in an error before "... (N more)"


def _targets(model) -> list[interop.LinearName]:
    if isinstance(model, AbstractModel):
        return model.linear_layers()
    return interop.linear_layers(model)


def _node(tree, path):
    for key in path:
        if isinstance(key, GetAttrKey):
            tree = getattr(tree, key.name)
        elif isinstance(key, SequenceKey):
            tree = tree[key.idx]
        elif isinstance(key, DictKey):
            tree = tree[key.key]
        else:
            raise ValueError(f"cannot follow the key {key!r} of a LoRA target's path.")
    return tree


def _replace(model, layers: dict):
    """`model` with the linear layers at the given paths replaced (path -> new layer)."""
    paths = list(layers)
    return eqx.tree_at(lambda m: [_node(m, p) for p in paths], model, [layers[p] for p in paths])


def _fmt(items, limit=_SHOWN) -> str:
    items = list(items)
    shown = "\n  ".join(items[:limit])
    more = f"\n  ... ({len(items) - limit} more)" if len(items) > limit else ""
    return "\n  " + shown + more


def _check_name(owner: str, model, name: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{owner}: `name` must be a non-empty string; received {name!r}.")
    if name in nn.lora_names(model):
        raise ValueError(f"{owner}: the model already has an adapter named {name!r}; pass "
                         "another `name` (several adapters live side by side), or "
                         "nn.remove_lora it first.")


def _placed(model, new):
    """`new` placed like `model`'s weights when those are on a mesh (the adapters then
    follow their layers' tensor-parallel and FSDP placement), else as it is."""
    weights = [x for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
    shardings = [getattr(x, "sharding", None) for x in weights]
    mesh = next((s.mesh for s in shardings if isinstance(s, NamedSharding)), None)
    return new if mesh is None else nn.sharding.shard_module(new, mesh)


def add_lora(model, patterns, rank: int, *, alpha: float | None = None, name: str = "default",
             dtype=None, key: PRNGKeyArray):
    """`model` with new adapters on the linear layers whose names match `patterns`.

    Names are the checkpoint names of the layers, without `.weight`, in either naming
    of the model (Wan's `blocks.0.self_attn.q`, diffusers' `blocks.0.attn1.to_q`), one
    per layer of the stacked blocks; a pattern is a shell-style pattern (`fnmatch`:
    `"blocks.*.attn1.to_[qkv]"`, `"*.ffn.*"`, `"blocks.1[0-9].*"`). On stacked layers
    the adapter is stacked too; a layer of the stack that no pattern selects holds
    zeros, which keep a zero gradient, so it stays without an adapter through
    training (and [`save_lora`][] leaves it out).

    Initialised as PEFT does ([`vidax_eqx.nn.with_lora`][]: `lora_B` zero), so the
    model computes what it did. A model placed on a mesh gets its adapters placed
    like their layers ([`vidax_eqx.nn.sharding.partition_specs`][]).

    **Arguments:**

    - `model`: a [`WanTransformer3D`][], [`CogVideoXTransformer3D`][], [`WanExperts`][]
        (both experts get adapters) or any module tree of [`vidax_eqx.nn`][] layers.
    - `patterns`: a pattern or a sequence of them; each must match at least one layer.
    - `rank`: the adapters' rank.
    - `alpha`: the scaling numerator (`alpha / rank`); default `rank`.
    - `name`: the adapter's name (new on the model).
    - `dtype`: the adapters' dtype; default each layer's weight dtype (pass
        `jnp.float32` to train float32 adapters on a bfloat16 model).
    - `key`: a PRNG key.

    **Returns:**

    The model with [`vidax_eqx.nn.LoRALinear`][] layers where selected.

        model = models.add_lora(model, ["blocks.*.attn1.to_[qkvo]*", "blocks.*.ffn.*"], 16,
                                key=jax.random.key(0))
        trainable, frozen = eqx.partition(model, nn.lora_filter(model))
    """
    if isinstance(model, AbstractExperts):
        keys = init.split(key, 2)
        experts = [add_lora(e, patterns, rank, alpha=alpha, name=name, dtype=dtype, key=k)
                   for e, k in zip(model.experts, keys)]
        return model.with_expert(0, experts[0]).with_expert(1, experts[1])
    _check_name("add_lora", model, name)
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"add_lora: `patterns` must be a pattern or a non-empty sequence of "
                         f"them; received {patterns!r}.")
    targets = _targets(model)
    chosen: dict[tuple, set] = {}
    for pattern in patterns:
        hits = [t for t in targets if any(fnmatch.fnmatchcase(n, pattern) for n in t.names)]
        if not hits:
            examples = sorted({t.names[1] for t in targets if t.layer in (None, 0)})
            raise ValueError(
                f"add_lora: the pattern {pattern!r} selects no linear layer of "
                f"{type(model).__name__}. Its layers (layer 0 of stacked blocks, diffusers' "
                f"names; Wan's names match too):{_fmt(examples, 60)}")
        for t in hits:
            chosen.setdefault(t.path, set()).add(t.layer)
    new = {}
    for i, (path, layers) in enumerate(chosen.items()):
        layer = _node(model, path)
        wrapped = nn.with_lora(layer, rank, alpha=alpha, name=name, dtype=dtype,
                               key=init.fold_in(key, i))
        if None not in layers:  # stacked: only the selected layers
            mask = np.zeros(layer.weight.shape[0], bool)
            mask[sorted(layers)] = True
            adapter = wrapped.adapters[name]
            a = jnp.where(jnp.asarray(mask)[:, None, None], adapter.lora_A, 0)
            wrapped = eqx.tree_at(lambda w: w.adapters[name].lora_A, wrapped, a)
        new[path] = wrapped
    return _placed(model, _replace(model, new))


def load_lora(model, source, *, scale: float = 1.0, name: str = "default", merge: bool = False,
              ignore=()):
    """`model` with the adapter of a shared LoRA file.

    Reads the diffusers/PEFT layout (`transformer.blocks.0.attn1.to_q.lora_A.weight`,
    alpha from PEFT's config in the file's metadata) and the ComfyUI/kohya layouts
    Wan LoRAs are shared in (`lora_unet_blocks_0_self_attn_q.lora_down.weight`, `.alpha`;
    `diffusion_model.blocks.0.self_attn.q.lora_A.weight`), in either naming of the
    model (see [`vidax_eqx.interop.read_lora`][]). Every key must be used: the keys
    that match no layer of the model, or that are no adapter (a full-weight `.diff`),
    are listed in one error, and nothing is loaded; `ignore` skips keys knowingly.
    Each adapter's shapes are checked against its layer.

    Layers of stacked blocks get one stacked adapter (a layer the file leaves out holds
    zeros; ranks that differ between layers are padded with zeros, the alpha adjusted
    so that each layer computes `alpha / rank` of its own rank). The adapters take the
    dtype of their layers' weights, and, on a model placed on a mesh, their placement.

    **Arguments:**

    - `model`: a [`WanTransformer3D`][], [`CogVideoXTransformer3D`][] or [`WanExperts`][]
        (Wan 2.2 A14B LoRAs come as one file per expert: pass `(high_noise,
        low_noise)`, either may be `None`; one source goes to both experts).
    - `source`: a `.safetensors` file, a directory holding
        `pytorch_lora_weights.safetensors`, or a mapping of names to arrays.
    - `scale`: the adapter's weight (diffusers' `adapter_weights`, ComfyUI's strength);
        change it later with [`vidax_eqx.nn.set_lora_scale`][] without recompiling.
    - `name`: the adapter's name, new on the model (several adapters live side by
        side, each with its scale).
    - `merge`: fold the adapter into the weights ([`vidax_eqx.nn.merge_lora`][]).
    - `ignore`: shell-style patterns of file keys to skip (e.g. `"*.diff"`).

    **Returns:**

    The model with the adapter.
    """
    if isinstance(model, AbstractExperts):
        sources = tuple(source) if isinstance(source, (tuple, list)) else (source, source)
        if len(sources) != 2:
            raise ValueError(f"load_lora: WanExperts takes one source or two (high-noise, "
                             f"low-noise); received {len(sources)}.")
        for i, src in enumerate(sources):
            if src is not None:
                expert = load_lora(model.experts[i], src, scale=scale, name=name, merge=merge,
                                   ignore=ignore)
                model = model.with_expert(i, expert)
        return model
    _check_name("load_lora", model, name)
    found = interop.read_lora(source, ignore=ignore)
    targets = _targets(model)
    by_name = {}
    for t in targets:
        for n in t.names:
            by_name[n] = t
            by_name[n.replace(".", "_")] = t  # kohya's form
    problems = [f"{k}: {why}" for k, why in sorted(found.unused.items())]
    groups: dict[tuple, dict] = {}
    for layer_name, tensors in sorted(found.layers.items()):
        t = by_name.get(layer_name)
        if t is None:
            problems.append(f"{layer_name}: matches no linear layer of {type(model).__name__}")
            continue
        base = _node(model, t.path)
        out_features, in_features = base.weight.shape[-2:]
        a, b = tensors.lora_A, tensors.lora_B
        if a.shape[1] != in_features or b.shape[0] != out_features:
            problems.append(
                f"{layer_name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the "
                f"layer's weight (out={out_features}, in={in_features}): expected lora_A "
                f"(rank, {in_features}) and lora_B ({out_features}, rank)")
            continue
        groups.setdefault(t.path, {})[t.layer] = tensors
    if problems:
        raise ValueError(
            f"load_lora: {len(problems)} key(s) of the LoRA file cannot be loaded into "
            f"{type(model).__name__} (nothing was loaded):{_fmt(problems)}\nLayer names are "
            "the model's checkpoint names (model.linear_layers()); pass ignore=[patterns] to "
            "skip keys knowingly.")
    if not groups:
        raise ValueError("load_lora: the LoRA file holds no adapter.")
    new = {}
    for path, per_layer in groups.items():
        layer = _node(model, path)
        new[path] = attach(layer, name, _adapter(layer, per_layer, scale))
    out = _placed(model, _replace(model, new))
    return nn.merge_lora(out, name) if merge else out


def _adapter(layer, per_layer: dict, scale: float) -> nn.LoRA:
    """One (possibly stacked) adapter from the file's tensors of each layer."""
    dtype = layer.weight.dtype
    out_features, in_features = layer.weight.shape[-2:]
    if None in per_layer:  # not stacked
        t = per_layer[None]
        rank = t.lora_A.shape[0]
        return nn.LoRA(
            lora_A=jax.device_put(np.asarray(t.lora_A, np.float32).astype(dtype)),
            lora_B=jax.device_put(np.asarray(t.lora_B, np.float32).astype(dtype)),
            alpha=jax.device_put(np.float32(rank if t.alpha is None else t.alpha)),
            scale=jax.device_put(np.float32(scale)),
        )
    count = layer.weight.shape[0]
    rank = max(t.lora_A.shape[0] for t in per_layer.values())
    a = np.zeros((count, rank, in_features), np.float32)
    b = np.zeros((count, out_features, rank), np.float32)
    first = next(iter(per_layer.values()))  # a layer without the adapter: any alpha
    alpha = np.full((count,), (first.lora_A.shape[0] if first.alpha is None else first.alpha)
                    * rank / first.lora_A.shape[0], np.float32)
    for i, t in per_layer.items():
        r = t.lora_A.shape[0]
        a[i, :r] = t.lora_A
        b[i, :, :r] = t.lora_B
        # alpha / rank of the layer's own rank, over the padded rank
        alpha[i] = (r if t.alpha is None else t.alpha) * rank / r
    return nn.LoRA(
        lora_A=jax.device_put(a.astype(dtype)), lora_B=jax.device_put(b.astype(dtype)),
        alpha=jax.device_put(alpha), scale=jax.device_put(np.full((count,), scale, np.float32)),
    )


def save_lora(model, path, *, name: str = "default", layout: str = "diffusers") -> None:
    """Writes one adapter of `model` as a LoRA file others load.

    `layout="diffusers"`: `pytorch_lora_weights.safetensors` with
    `transformer.<diffusers name>.lora_A.weight` / `lora_B.weight` and PEFT's config
    (rank, alpha) in the metadata, which diffusers' `load_lora_weights` reads;
    `"kohya"`: `lora_unet_<Wan name>.lora_down.weight`, `.lora_up.weight`, `.alpha`,
    as ComfyUI loads Wan LoRAs. Layers of a stack without the adapter (all zeros) are
    left out; the adapter's scale is a runtime weight and is not saved.
    [`load_lora`][] reads either back to the same adapter.

    **Arguments:**

    - `model`: a model with the adapter `name` (for [`WanExperts`][], save each expert:
        `save_lora(experts.experts[i], ...)`).
    - `path`: a directory (created), or a `.safetensors` file.
    - `name`: the adapter.
    - `layout`: `"diffusers"` or `"kohya"`.
    """
    if isinstance(model, AbstractExperts):
        raise ValueError("save_lora: save each expert's adapter to its own file: "
                         "save_lora(experts.experts[0], ...), save_lora(experts.experts[1], ...).")
    if layout not in interop.LORA_LAYOUTS:
        raise ValueError(f"save_lora: `layout` must be one of {interop.LORA_LAYOUTS}; received "
                         f"{layout!r}.")
    if name not in nn.lora_names(model):
        raise ValueError(f"save_lora: the model has no adapter {name!r}; it has "
                         f"{nn.lora_names(model)}.")
    naming = 1 if layout == "diffusers" else 0
    layers = {}
    for t in _targets(model):
        layer = _node(model, t.path)
        if not isinstance(layer, nn.LoRALinear) or name not in layer.adapters:
            continue
        adapter = layer.adapters[name]
        pick = (lambda x: np.asarray(x)) if t.layer is None else (lambda x: np.asarray(x[t.layer]))
        a, b = pick(adapter.lora_A), pick(adapter.lora_B)
        if t.layer is not None and not a.any() and not b.any():
            continue
        layers[t.names[naming]] = interop.LoRATensors(a, b, float(pick(adapter.alpha)))
    interop.write_lora(path, layers, layout=layout)
