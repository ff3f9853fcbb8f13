"""Key-only padding in the attention modules of `vidax_eqx.nn`: the check of a length
argument (`kv_length`, `context_length`), and the segment ids that express it.

Key-only padding hides the keys at index `>= length` from every query and still
computes every query (HunyuanVideo's text mask). It differs from segment-id padding
(`segment_ids=-1`), where a padded token also sees nothing, so its attention output
is 0. With separate query and key ids (`kernels.SegmentIds(q=..., kv=...)`) it is
the query ids unchanged and the key ids -1 at the padded keys.
"""

import jax
import jax.numpy as jnp
import numpy as np

from .. import kernels


def check_length(owner: str, name: str, length, upper: int | None):
    """`length` as an int32 scalar array (or `None`), after the checks that can be made
    at trace time: a Python int or a 0-d integer array; in `[0, upper]` when concrete
    (and `upper` known). A traced value outside the range acts as clipped to it."""
    if length is None:
        return None
    if isinstance(length, bool):
        raise ValueError(
            f"{owner}: `{name}` must be an int scalar (a number of keys); received the bool "
            f"{length!r}."
        )
    shape = tuple(getattr(length, "shape", ()))
    dtype = getattr(length, "dtype", None) or np.dtype(type(length))
    if shape != () or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(
            f"{owner}: `{name}` must be one int scalar per example (a Python int or a 0-d "
            f"integer array; jax.vmap it for a batch); received shape {shape}, dtype {dtype}."
        )
    if upper is not None and not isinstance(length, jax.core.Tracer):
        value = int(length)
        if not 0 <= value <= upper:
            raise ValueError(
                f"{owner}: `{name}` must lie in [0, {upper}] (the number of keys it may "
                f"keep); received {value}."
            )
    length = jnp.asarray(length, jnp.int32)
    return jnp.maximum(length, 0) if upper is None else jnp.clip(length, 0, upper)


def key_padding_ids(indices, length, segment_ids=None) -> kernels.SegmentIds:
    """The `(S,)` segment ids of one example's tokens with the keys at index `>= length`
    hidden: `SegmentIds(q=ids, kv=where(indices < length, ids, -1))`, `ids` the given
    `segment_ids` (default all 0). `indices`: the tokens' indices that `length`
    counts (global ones under sequence parallelism)."""
    ids = jnp.zeros(indices.shape, jnp.int32) if segment_ids is None else segment_ids
    ids = ids.astype(jnp.int32)
    return kernels.SegmentIds(q=ids, kv=jnp.where(indices < length, ids, -1))
