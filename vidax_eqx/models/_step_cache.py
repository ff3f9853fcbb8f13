"""Step caching: a denoising step that reuses the residual of a model's block stack from
the last step that ran it (MagCache's static schedules, TeaCache's and first-block
cache's data-dependent rule), with one skip decision shared by every device."""

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float

from ..nn import sharding
from .._vma import as_varying, manual_axes
from ._base import AbstractBatchedInput


class StepCache(AbstractBatchedInput):
    """What a denoising loop carries from step to step to skip a model's block stack:
    the residual of the blocks the rule skips, taken at the last step that ran them
    (`output - input` of the whole stack for a static schedule, of every block but the
    first for the first-block rule), and the first block's residual at that step.

    One example's fields, this device's tokens (the rows the model's `ParallelConfig`
    gives it, padding included); `jax.vmap` adds a leading batch axis, and a global
    cache, as [`run_sharded`][] takes it, splits its token axis over the sequence axes
    ([`partition_specs`][StepCache.partition_specs]):

    - `residual`: `(S, dim)` float32;
    - `probe`: `(S, dim)` float32, the first block's residual (zeros with a static
        schedule);
    - `reused`: a bool scalar, whether the call that returned this cache reused the
        residual (the same on every device and every example of a batch).

    `StepCache()` (every field `None`) is the empty cache: a call given it runs every
    block and returns a filled one, which is how a loop learns the shapes of its cache
    (`eqx.filter_eval_shape`) before its first step.
    """

    residual: Float[Array, "*batch S dim"] | None = None
    probe: Float[Array, "*batch S dim"] | None = None
    reused: Bool[Array, "*batch"] | None = None

    @property
    def empty(self) -> bool:
        """Whether this is the empty cache `StepCache()`."""
        return self.residual is None

    def partition_specs(self, parallel: sharding.ParallelConfig, batch_axis=None) -> "StepCache":
        """The `shard_map` specs of a batched cache `(B, S, dim)` for a model configured
        with `parallel`: the batch over `batch_axis`, the tokens over the sequence axes
        (each device keeps the rows of its own tokens), the features whole."""
        return StepCache() if self.empty else step_cache_specs(parallel, batch_axis)


class StepDecision(NamedTuple):
    """What a step-cached forward pass decides with: the previous step's `cache` (a
    [`StepCache`][]), whether it `may_reuse` it, the first-block rule's `threshold`
    (`None`: a static schedule), and the axes the rule's change is summed over
    (`axis_name`)."""

    cache: StepCache
    may_reuse: Any
    threshold: Any
    axis_name: Any


def step_cache_specs(parallel: sharding.ParallelConfig, batch_axis=None) -> StepCache:
    """The specs of a filled batched cache (see `StepCache.partition_specs`)."""
    axes = parallel.sequence_axes
    tokens = (axes[0] if len(axes) == 1 else axes) or None
    rows = P(batch_axis, tokens, None)
    return StepCache(rows, rows, P(batch_axis))


def check_step_cache(owner: str, cache, tokens, may_reuse, threshold) -> None:
    """Raises unless `cache` is a `StepCache` for these tokens `(S, dim)` and the
    decision inputs are scalars."""
    if not isinstance(cache, StepCache):
        raise ValueError(f"{owner}: `step_cache` must be a models.StepCache (StepCache() to "
                         f"start); received {type(cache).__name__}.")
    if not cache.empty and (getattr(cache.residual, "shape", None) != tokens.shape
                            or getattr(cache.probe, "shape", None) != tokens.shape):
        raise ValueError(
            f"{owner}: `step_cache` must hold this device's tokens {tokens.shape} (the cache "
            "returned by the previous step of the same inputs and model configuration); "
            f"received residual {getattr(cache.residual, 'shape', None)}, probe "
            f"{getattr(cache.probe, 'shape', None)}.")
    for name, value in (("may_reuse", may_reuse), ("threshold", threshold)):
        if value is not None and jnp.ndim(value) != 0:
            raise ValueError(f"{owner}: `{name}` must be a scalar (one decision for the "
                             f"whole call); received shape {jnp.shape(value)}.")


def relative_change(new, old, valid, axis_name):
    """`sum |new - old| / sum |old|` over the real tokens (`valid`: `(S,)` bool or
    `None`), summed over `axis_name` too (the vmapped batch and every mesh axis), so
    that every device and example gets the same value; `inf` when `old` is zero."""
    weight = 1.0 if valid is None else valid[:, None].astype(new.dtype)
    num = jnp.sum(jnp.abs(new - old) * weight)
    den = jnp.sum(jnp.abs(old) * weight)
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name or ())
    mesh_axes = manual_axes()
    vmapped = tuple(a for a in names if a not in mesh_axes)
    if vmapped:
        num, den = lax.psum((num, den), vmapped)
    if any(a in mesh_axes for a in names):
        # Summed over every mesh axis, those it is invariant over too (replicas count
        # alike in both sums): cast to vary over them, then reduced.
        num, den = lax.psum(as_varying((num, den), mesh_axes), tuple(mesh_axes))
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1), jnp.inf)


def cached_blocks(run, x, num_layers: int, cache: StepCache, *, may_reuse, threshold,
                  valid, axis_name):
    """The block stack's output for the tokens `x` `(S, dim)`, reusing the cached
    residual when the rule says so, and the cache for the next step.

    `run(x, start, stop)` runs blocks `[start, stop)`. With `threshold=None` (a static
    schedule) the whole stack is skipped when `may_reuse`; otherwise the first block
    runs, and the others are skipped when `may_reuse` and the relative change of the
    first block's residual since the last step that ran them all is below `threshold`.
    The decision is reduced over `axis_name`, so it is one value everywhere, and a
    `lax.cond` runs only the branch taken (under `jax.vmap` too: the predicate is not
    batched)."""
    fresh = cache.empty
    if fresh:
        zeros = jnp.zeros(x.shape, jnp.float32)
        cache = StepCache(zeros, zeros, jnp.asarray(False))
    may_reuse = jnp.asarray(False if fresh else may_reuse, bool)
    if threshold is None:
        h, probe = x, cache.probe
        reuse = may_reuse
        start = 0
    else:
        h = run(x, 0, 1)
        probe = (h - x).astype(jnp.float32)
        change = relative_change(probe, cache.probe, valid, axis_name)
        reuse = may_reuse & (change < threshold)
        start = 1

    def skip(h):
        return (h + cache.residual).astype(h.dtype), cache.residual, cache.probe

    def compute(h):
        out = run(h, start, num_layers)
        return out, (out - h).astype(jnp.float32), probe

    out, residual, probe = lax.cond(reuse, skip, compute, h)
    return out, StepCache(residual, probe, reuse)
