"""Wan's text cache computed over a mesh, as `run_sharded` runs the model."""

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from ..._vma import varying_axes
from ...nn import sharding
from .._base import AbstractExperts
from .._run_sharded import batch_axes, check_batch_axis, check_fsdp_axes
from ._model import WanTransformer3D
from ._text_cache import WanTextCache


def sharded_text_cache(model: WanTransformer3D, context, *, mesh, batch_axis=None,
                       context_image=None) -> WanTextCache:
    """[`WanTransformer3D.text_cache`][] of a batch over `mesh`, computed on each device
    as [`run_sharded`][] runs the model (tensor-parallel heads, FSDP-gathered weights),
    global inputs in, a global cache out: pass it to `run_sharded(..., text_cache=...)`
    for bit for bit the output of a call without it.

    **Arguments:**

    - `model`: a [`WanTransformer3D`][] configured for the mesh, as for `run_sharded`;
        or a [`WanExperts`][]: each expert's cache, a [`WanExpertsTextCache`][].
    - `context`: the text embeddings `(B, L, text_dim)`.
    - `mesh`, `batch_axis`: as for `run_sharded`.
    - `context_image`: I2V: the image features `(B, L_img, image_dim)`; else `None`.

    **Returns:**

    The batched [`WanTextCache`][] `(B, num_layers, L, num_heads, head_dim)`, placed by
    [`WanTextCache.partition_specs`][]: the batch over `batch_axis`, the heads over the
    model's `tp_axis`. Devices that hold the same heads of the same examples computed
    equal copies (the same text and weights); under FSDP, where these are typed as
    varying over the FSDP axes, one `lax.pmax` over those axes (exact on equal values)
    makes them one array.
    """
    if isinstance(model, AbstractExperts):  # one cache per expert
        caches = [sharded_text_cache(e, context, mesh=mesh, batch_axis=batch_axis,
                                     context_image=context_image) for e in model.experts]
        return model.combine_text_caches(caches)
    if not isinstance(model, WanTransformer3D):
        raise NotImplementedError(
            "sharded_text_cache: the text cache is implemented for a WanTransformer3D and "
            f"WanExperts; received a {type(model).__name__}."
        )
    batch_axis = check_batch_axis("sharded_text_cache", mesh, batch_axis, context.shape[0])
    check_fsdp_axes("sharded_text_cache", model, mesh, batch_axis)
    parallel = model.parallel
    batch = P(batch_axis)
    keep = {parallel.tp_axis, *batch_axes(batch_axis)}
    image = None if context_image is None else batch
    shape = WanTextCache(0, 0, None if context_image is None else 0, None)

    def per_device(model, context, context_image):
        cache = jax.vmap(lambda c, i: model.text_cache(c, context_image=i))(
            context, context_image)

        def invariant(a):  # FSDP: equal copies typed as varying over the FSDP axes
            extra = tuple(sorted(varying_axes(a) - keep, key=str))
            return lax.pmax(a, extra) if extra else a

        return jax.tree.map(invariant, cache)

    run = sharding.filter_shard_map(
        per_device, mesh=mesh,
        in_specs=(sharding.partition_specs(model, mesh), batch, image),
        out_specs=shape.partition_specs(parallel, batch_axis),
    )
    return run(model, context, context_image)
