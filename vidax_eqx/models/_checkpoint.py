"""A model's checkpoint directory: its `config.json` and lazy tensors in, the model built
abstractly and filled (sharded when asked)."""

import functools
import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import interop
from ._quantize import quantize as quantize_model, quantize_mode, quantize_to, read_quantization


def read_config(path, owner: str, *, subfolder=None, revision=None, cache_dir=None):
    """`(config.json as a dict, the lazy tensor mapping)` of a checkpoint directory, or
    of a Hugging Face Hub repository's (resolved by
    [`vidax_eqx.interop.resolve_checkpoint`][] with `subfolder`, `revision`, `cache_dir`)."""
    try:
        text = interop.resolve_checkpoint(path, subfolder=subfolder, revision=revision,
                                          cache_dir=cache_dir)
    except ValueError as e:
        raise ValueError(f"{owner}.from_pretrained: {e}") from e.__cause__
    config_path = os.path.join(text, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(
            f"{owner}.from_pretrained: {text!r} must be a checkpoint directory holding "
            "config.json and the safetensors weights (diffusers' save_pretrained layout, or "
            "a Wan 2.1 release)"
            + ("" if subfolder else "; for a diffusers pipeline pass subfolder='transformer'")
            + "."
        )
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{owner}.from_pretrained: {config_path!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{owner}.from_pretrained: {config_path!r} must hold a JSON object.")
    return raw, interop.open_checkpoint(text)


def load_pretrained(cls, config, tensors, *, dtype, dtype_from: str, parallel,
                    implementation, mesh=None, quantization=None, quantize=None, **load_kwargs):
    """`cls(config, ...)` built abstractly (no random weights) in `dtype` (default: the
    checkpoint's dtype of the tensor `dtype_from`, else float32) and filled from
    `tensors` by [`vidax_eqx.interop.load_state_dict`][] (`load_kwargs`: `stacked=`,
    `rename=`); with `mesh`, every parameter placed by
    [`vidax_eqx.nn.sharding.partition_specs`][]`(model, mesh)` under `parallel`, each process
    reading only the blocks its devices hold.

    `quantization`: the checkpoint's `config.json` `quantization_config` (int8 weights
    written by a quantized model: built quantized, read as int8); `quantize`: the
    `from_pretrained(quantize=)` option (a float checkpoint quantized once loaded; on an
    int8 checkpoint it must name the checkpoint's own format)."""
    owner = cls.__name__
    quantize_mode(f"{owner}.from_pretrained", quantize)  # a bad option before any read
    stored = read_quantization(owner, quantization)
    if dtype is None:  # a missing tensor is reported by the load
        dtype = tensors.dtype(dtype_from) if dtype_from in tensors else jnp.float32
    build = functools.partial(cls, config, parallel=parallel, implementation=implementation,
                              dtype=dtype, key=jax.random.PRNGKey(0))
    model = eqx.filter_eval_shape(
        build if stored is None else lambda: quantize_model(build(), *stored))
    try:
        return quantize_to(interop.load_state_dict(model, tensors, mesh=mesh, **load_kwargs),
                           quantize, owner)
    except ValueError as e:
        if mesh is None or str(e).startswith("load_state_dict"):
            raise
        # The placement's errors (nn.sharding.partition_specs: an FSDP size that divides nothing,
        # axes the mesh lacks) name the model's call, not the loader's.
        raise ValueError(f"{cls.__name__}.from_pretrained(mesh=...): {e}") from None
