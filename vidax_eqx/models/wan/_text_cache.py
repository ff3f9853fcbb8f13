"""Wan's text cache: every block's cross-attention keys and values of one context,
computed once per generation, and the check that a cache fits a model and context."""

import equinox as eqx
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from ...nn import sharding
from ...parallel import axis_size
from .._base import AbstractBatchedInput
from ._config import WanConfig


class WanTextCache(AbstractBatchedInput):
    """The keys and values of every block's cross-attention for one text (and image)
    context: what [`WanTransformer3D.text_cache`][] computes once and
    `WanTransformer3D.__call__(..., text_cache=...)` takes instead of projecting the
    context in every block at every denoising step (the text does not change across
    steps). Exact: the model gives bit for bit the output it gives without it.

    Arrays stacked over the layers like the blocks (one slice per step of the blocks'
    `lax.scan`), heads last but one; `jax.vmap` adds a leading batch axis:

    - `k`, `v`: `(num_layers, L, H, head_dim)`, the text's (`k` after `norm_k`), `L`
        the text length the blocks see (the config's `text_len` when it pads);
    - `k_img`, `v_img`: I2V: `(num_layers, L_img, H, head_dim)`, the image context's;
        else `None`.

    `H` is `num_heads`; inside `shard_map` under tensor parallelism, this device's
    `num_heads / tp` (a global cache splits its heads over `tp_axis`:
    [`partition_specs`][WanTextCache.partition_specs], [`sharded_text_cache`][]).

    Inference only: the keys and values are inputs, so a gradient through a call that
    takes them reaches neither the text nor the cross-attention's `k`, `v` (`k_img`,
    `v_img`, `norm_k`, `norm_k_img`) weights unless the cache was computed inside the
    differentiated function.

    CogVideoX has no equivalent: its text goes through joint self-attention with the
    video and changes in every block, so its keys and values cannot be cached exactly.
    """

    k: Array
    v: Array
    k_img: Array | None
    v_img: Array | None

    def partition_specs(self, parallel: sharding.ParallelConfig, batch_axis=None) -> "WanTextCache":
        """The `shard_map` specs of a batched cache `(B, num_layers, L, H, head_dim)` for
        a model configured with `parallel`: the batch over `batch_axis`, the heads over
        `parallel.tp_axis` (each device gets its heads), the rest whole. What
        [`run_sharded`][] gives its `text_cache` argument."""
        spec = P(batch_axis, None, None, parallel.tp_axis, None)
        image = None if self.k_img is None else spec
        return WanTextCache(spec, spec, image, image)


def check_text_cache(cache, config: WanConfig, parallel: sharding.ParallelConfig, text_length: int,
                 context_image, dtype) -> None:
    """Raises unless `cache` is a `WanTextCache` of a model of `config` and `parallel` for
    a context of `text_length` tokens the blocks see (and `context_image`), with this
    device's heads, in `dtype`."""
    c = config
    if not isinstance(cache, WanTextCache):
        raise ValueError(
            "WanTransformer3D: `text_cache` must be a WanTextCache (from "
            f"model.text_cache(context)) or None; received {type(cache).__name__}."
        )
    tp_axis = parallel.tp_axis
    tp = 1 if tp_axis is None else axis_size(tp_axis, what="Tensor-parallel")
    heads = c.num_heads // tp if c.num_heads % tp == 0 else c.num_heads
    L = text_length
    expected = {"k": (c.num_layers, L, heads, c.head_dim)}
    expected["v"] = expected["k"]
    if context_image is not None:
        expected["k_img"] = (c.num_layers, context_image.shape[0], heads, c.head_dim)
        expected["v_img"] = expected["k_img"]
    received = {name: getattr(cache, name) for name in ("k", "v", "k_img", "v_img")}
    bad = [name for name, a in received.items()
           if (a is None) != (name not in expected)
           or (a is not None and (not eqx.is_array(a) or a.shape != expected[name]
                                  or a.dtype != dtype))]
    if bad:
        shapes = {n: None if a is None else (tuple(getattr(a, "shape", ())),
                                             str(getattr(a, "dtype", type(a).__name__)))
                  for n, a in received.items()}
        raise ValueError(
            "WanTransformer3D: `text_cache` must hold the keys and values of this model "
            "for this context, (num_layers, L, heads, head_dim) in the weights' dtype "
            f"{jnp.dtype(dtype).name}: {expected}"
            + ("" if context_image is not None else " (no image keys/values: T2V)")
            + (f", heads this device's share under tp_axis={tp_axis!r}" if tp_axis else "")
            + f"; received {shapes} (field {bad[0]!r}). Compute it with "
            "model.text_cache(context, context_image=...) for this model and context "
            "(sharded: models.sharded_text_cache)."
        )
