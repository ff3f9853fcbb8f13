"""A model's checkpoint directory: its `config.json` and lazy tensors in, the model built
abstractly and filled (sharded when asked)."""

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import interop


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
                    implementation, mesh=None, **load_kwargs):
    """`cls(config, ...)` built abstractly (no random weights) in `dtype` (default: the
    checkpoint's dtype of the tensor `dtype_from`, else float32) and filled from
    `tensors` by [`vidax_eqx.interop.load_state_dict`][] (`load_kwargs`: `stacked=`,
    `rename=`); with `mesh`, every parameter placed by
    [`vidax_eqx.nn.sharding.partition_specs`][]`(model, mesh)` under `parallel`, each process
    reading only the blocks its devices hold."""
    if dtype is None:  # a missing tensor is reported by the load
        dtype = tensors.dtype(dtype_from) if dtype_from in tensors else jnp.float32
    model = eqx.filter_eval_shape(
        cls, config, parallel=parallel, implementation=implementation, dtype=dtype,
        key=jax.random.PRNGKey(0),
    )
    try:
        return interop.load_state_dict(model, tensors, mesh=mesh, **load_kwargs)
    except ValueError as e:
        if mesh is None or str(e).startswith("load_state_dict"):
            raise
        # The placement's errors (nn.sharding.partition_specs: an FSDP size that divides nothing,
        # axes the mesh lacks) name the model's call, not the loader's.
        raise ValueError(f"{cls.__name__}.from_pretrained(mesh=...): {e}") from None
