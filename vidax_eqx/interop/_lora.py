"""LoRA files in the layouts people share them in: diffusers/PEFT and ComfyUI/kohya.

- diffusers/PEFT: `transformer.blocks.0.attn1.to_q.lora_A.weight` `(rank, in)` and
  `.lora_B.weight` `(out, rank)`; the alpha in the file's metadata
  (`lora_adapter_metadata`: PEFT's `LoraConfig`, `lora_alpha` and `alpha_pattern`,
  `use_rslora`'s `alpha / sqrt(rank)`), else the rank (PEFT's default, a factor 1);
  DoRA is refused. Prefixes `transformer.`,
  `base_model.model.` and `diffusion_model.` are accepted.
- ComfyUI/kohya: `lora_unet_blocks_0_self_attn_q.lora_down.weight`, `.lora_up.weight`
  and `.alpha` (the layer's name with `_` for `.`), or `diffusion_model.` and the
  layer's name with `lora_down` / `lora_up` or `lora_A` / `lora_B` and `.alpha`.

Names after the prefix are the model's own (Wan's or diffusers'); matching them to
layers is the model's business (`vidax_eqx.models.load_lora`).
"""

import fnmatch
import json
import math
import os
import re
from collections import Counter
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from ._checkpoint import open_safetensors
from ._safetensors import write_safetensors


LORA_LAYOUTS = ("diffusers", "kohya")
"""The layouts [`write_lora`][] writes; [`read_lora`][] reads both (and their variants)."""

LORA_FILE = "pytorch_lora_weights.safetensors"
"""The file name diffusers' `save_lora_weights` writes and `load_lora_weights` looks for
in a directory."""

METADATA_KEY = "lora_adapter_metadata"
"""The safetensors metadata entry where diffusers stores the adapter's `LoraConfig`."""

_PREFIXES = ("base_model.model.", "transformer.", "model.diffusion_model.", "diffusion_model.")
_KOHYA = "lora_unet_"
_SUFFIXES = {  # suffix -> which tensor
    ".lora_A.weight": "A", ".lora_B.weight": "B",
    ".lora_down.weight": "A", ".lora_up.weight": "B",
    ".alpha": "alpha",
}


class LoRATensors(NamedTuple):
    """One layer's adapter as a file holds it."""

    lora_A: np.ndarray  # (rank, in)
    lora_B: np.ndarray  # (out, rank)
    alpha: float | None  # None: not given (PEFT's default: the rank)


class LoRAFile(NamedTuple):
    """What [`read_lora`][] found: `layers` by name (the key without its prefix and
    suffix: `blocks.0.attn1.to_q`, or kohya's `blocks_0_self_attn_q`), and `unused`,
    the keys it could not read as an adapter (unknown suffixes, a `lora_A` without its
    `lora_B`, full-weight deltas `.diff` / `.diff_b`), each with the reason."""

    layers: dict[str, LoRATensors]
    unused: dict[str, str]


def _open(source) -> tuple[Mapping, dict]:
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, LORA_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"read_lora: no LoRA file at {path!r} (a .safetensors file, or a "
                             f"directory holding {LORA_FILE}).")
        f = open_safetensors(path)
        return f, dict(f.metadata)
    if isinstance(source, Mapping):
        return source, {}
    raise ValueError(f"read_lora: `source` must be a path or a mapping of names to arrays; "
                     f"received {type(source).__name__}.")


def _config(metadata: dict) -> dict:
    """PEFT's `LoraConfig` of the file (diffusers writes it flat, or with a
    `transformer.` prefix on every key)."""
    raw = metadata.get(METADATA_KEY)
    if not raw:
        return {}
    try:
        config = json.loads(raw)
    except ValueError:
        raise ValueError(f"read_lora: the file's {METADATA_KEY!r} metadata is not JSON.") from None
    if not isinstance(config, dict):
        return {}
    unpacked = {k.split(".", 1)[1]: v for k, v in config.items()
                if k.startswith("transformer.") and "." in k}
    return unpacked or config


def _pattern_alpha(config: dict, name: str) -> float | None:
    """PEFT's rule: an `alpha_pattern` key that matches the end of the module name,
    else `lora_alpha`."""
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            return float(value)
    value = config.get("lora_alpha")
    return None if value is None else float(value)


def read_lora(source, *, ignore=()) -> LoRAFile:
    """The adapters of a LoRA file, by layer name.

    **Arguments:**

    - `source`: a `.safetensors` path, a directory holding
        `pytorch_lora_weights.safetensors`, or a mapping of names to arrays.
    - `ignore`: shell-style patterns (`fnmatch`) of keys to skip, e.g. `"*.diff"`.

    **Returns:**

    A [`LoRAFile`][]: the layers' `lora_A`, `lora_B` (NumPy) and alpha, and the keys
    it did not use.
    """
    if isinstance(ignore, str):
        ignore = (ignore,)
    tensors, metadata = _open(source)
    config = _config(metadata)
    if config.get("use_dora"):
        raise ValueError("read_lora: the file is a DoRA adapter (its PEFT config says use_dora), "
                         "which adds a learned magnitude per output feature; only plain LoRA "
                         "is supported.")
    parts: dict[str, dict[str, str]] = {}
    unused: dict[str, str] = {}
    for key in tensors:
        if any(fnmatch.fnmatchcase(key, p) for p in ignore):
            continue
        name = key
        kohya = name.startswith(_KOHYA)
        if kohya:
            name = name[len(_KOHYA):]
        else:
            for prefix in _PREFIXES:
                if name.startswith(prefix):
                    name = name[len(prefix):]
                    break
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            if name.endswith((".diff", ".diff_b")):
                unused[key] = "a full-weight or bias delta (.diff / .diff_b), not a low-rank adapter"
            else:
                unused[key] = "not a LoRA tensor (expected .lora_A/.lora_B/.lora_down/.lora_up.weight or .alpha)"
            continue
        parts.setdefault(name[:-len(suffix)], {})[_SUFFIXES[suffix]] = key
    layers = {}
    for name, found in parts.items():
        if "A" not in found or "B" not in found:
            for key in found.values():
                unused[key] = f"the layer {name!r} has no {'lora_B' if 'A' in found else 'lora_A'}"
            continue
        a, b = np.asarray(tensors[found["A"]]), np.asarray(tensors[found["B"]])
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"read_lora: {found['A']!r} {list(a.shape)} and {found['B']!r} {list(b.shape)} "
                "are not a low-rank pair: expected lora_A (rank, in) and lora_B (out, rank) "
                "with the same rank.")
        alpha = None
        if "alpha" in found:
            value = np.asarray(tensors[found["alpha"]])
            if value.size != 1:
                raise ValueError(f"read_lora: {found['alpha']!r} must be one number; received "
                                 f"shape {list(value.shape)}.")
            alpha = float(value.reshape(()))
        elif config:
            alpha = _pattern_alpha(config, name)
            if alpha is not None and config.get("use_rslora"):
                alpha *= math.sqrt(a.shape[0])  # rsLoRA scales by alpha / sqrt(rank)
        layers[name] = LoRATensors(a, b, alpha)
    return LoRAFile(layers, unused)


def write_lora(path, layers: Mapping[str, LoRATensors], *, layout: str = "diffusers") -> None:
    """Writes adapters as a LoRA file.

    **Arguments:**

    - `path`: a `.safetensors` file, or a directory (created) to hold
        `pytorch_lora_weights.safetensors`.
    - `layers`: layer name (in the naming the layout's readers expect: diffusers'
        for `"diffusers"`, Wan's for `"kohya"`) -> [`LoRATensors`][].
    - `layout`: `"diffusers"` (`transformer.<name>.lora_A.weight`, alpha and rank in
        PEFT's `LoraConfig` in the metadata, as diffusers' `save_lora_weights` writes
        them) or `"kohya"` (`lora_unet_<name with _>.lora_down.weight`, `.lora_up.weight`,
        `.alpha`).
    """
    if layout not in LORA_LAYOUTS:
        raise ValueError(f"write_lora: `layout` must be one of {LORA_LAYOUTS}; received {layout!r}.")
    path = os.fspath(path)
    if not path.endswith(".safetensors"):
        path = os.path.join(path, LORA_FILE)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tensors, metadata = {}, None
    if layout == "diffusers":
        for name, t in layers.items():
            tensors[f"transformer.{name}.lora_A.weight"] = np.asarray(t.lora_A)
            tensors[f"transformer.{name}.lora_B.weight"] = np.asarray(t.lora_B)
        ranks = {name: int(t.lora_A.shape[0]) for name, t in layers.items()}
        alphas = {name: float(t.lora_A.shape[0] if t.alpha is None else t.alpha)
                  for name, t in layers.items()}
        # the most common rank and alpha; the others go in PEFT's patterns
        r = Counter(ranks.values()).most_common(1)[0][0] if ranks else 1
        alpha = Counter(alphas.values()).most_common(1)[0][0] if alphas else 1.0
        config = {
            "r": r, "lora_alpha": alpha, "target_modules": sorted(layers),
            "rank_pattern": {re.escape(n): v for n, v in ranks.items() if v != r},
            "alpha_pattern": {re.escape(n): v for n, v in alphas.items() if v != alpha},
            "use_dora": False, "lora_bias": False,
        }
        # diffusers' `load_lora_weights` reads the keys of its `transformer.` prefix.
        config = {f"transformer.{k}": v for k, v in config.items()}
        metadata = {"format": "pt", METADATA_KEY: json.dumps(config, indent=2, sort_keys=True)}
    else:
        for name, t in layers.items():
            key = _KOHYA + name.replace(".", "_")
            tensors[f"{key}.lora_down.weight"] = np.asarray(t.lora_A)
            tensors[f"{key}.lora_up.weight"] = np.asarray(t.lora_B)
            tensors[f"{key}.alpha"] = np.asarray(
                t.lora_A.shape[0] if t.alpha is None else t.alpha, np.float32)
    write_safetensors(path, tensors, metadata)
