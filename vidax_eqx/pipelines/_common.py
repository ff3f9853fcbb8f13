"""What the pipelines share: argument checks, the dtype of a module, and how a mesh's
axes map to the transformer's parallelism and the VAE's split."""

import numbers

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import nn


def dtype_of(module) -> jnp.dtype:
    """The dtype of `module`'s first floating-point array (its parameters')."""
    return next(x.dtype for x in jax.tree.leaves(module) if eqx.is_inexact_array(x))


def parallel_for(mesh) -> nn.sharding.ParallelConfig:
    """The transformer's parallelism on a mesh of the library's axis names
    ([`vidax_eqx.parallel.make_mesh`][]): Ulysses over `"sp"`, Megatron over `"tp"`
    (each when the mesh has it with more than one device)."""
    if mesh is None:
        return nn.sharding.ParallelConfig()
    sizes = dict(mesh.shape)
    return nn.sharding.ParallelConfig(
        sequence="ulysses" if sizes.get("sp", 1) > 1 else "none",
        tp_axis="tp" if sizes.get("tp", 1) > 1 else None)


def spatial_axes(mesh, h: int, w: int):
    """The mesh axes the VAE splits a frame's latent `(h, w)` over: the pair (or single
    axis) of the mesh's axes of more than one device that uses the most devices and
    divides the sizes; `None` when none does."""
    if mesh is None:
        return None
    axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    best, most = None, 1
    candidates = [(a, b) for a in axes for b in axes if a != b]
    candidates += [(a, None) for a in axes] + [(None, a) for a in axes]
    for a, b in candidates:
        n_h = 1 if a is None else mesh.shape[a]
        n_w = 1 if b is None else mesh.shape[b]
        if h % n_h == 0 and w % n_w == 0 and n_h * n_w > most:
            best, most = (a, b), n_h * n_w
    return best


def as_prompts(owner: str, name: str, value, required: bool) -> list[str] | None:
    if value is None:
        if required:
            raise ValueError(f"{owner}: `{name}` is required (a str or a list of str) "
                             "when no prompt embeddings are given; received None.")
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(p, str) for p in value):
        return list(value)
    raise ValueError(f"{owner}: `{name}` must be a str or a non-empty list of str; "
                     f"received {value!r:.200}.")


def check_int(owner: str, name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{owner}: `{name}` must be an int >= {minimum}; received "
                         f"{value!r}.")
    return int(value)
