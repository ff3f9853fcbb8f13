"""The sequence layout: attention with the sequence (axis 1) sharded, from global arrays
to global results."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ._meshes import unzigzag, zigzag
from ._runs import segment_arrays, segment_specs, sharded_vjp


def sequence_vjp(attend, mesh, axes, *, batch_axis=None, segments=None, sinks: bool = False,
                 check_vma: bool = True, jit: bool = True, compiler_options=None):
    """A jitted `(q, k, v, seg, sinks, dout) -> (out, (dq, dk, dv, dsinks))` of
    `attend(q, k, v, seg, sinks)` under `jax.shard_map`: `(B, S, ...)` arrays with the
    sequence over `axes` (and the batch over `batch_axis`), `sinks` replicated.

    `segments`: `None` (no segment ids), `"one"` (one array) or `"pair"` (a `(q, kv)`
    pair, for `kernels.SegmentIds`). `dsinks` is `None` without sinks.
    """
    seq = P(batch_axis, axes)
    in_specs = (seq, seq, seq, segment_specs(segments, seq), P() if sinks else None)
    return sharded_vjp(attend, mesh, in_specs, seq, (0, 1, 2, 4), check_vma=check_vma,
                       jit=jit, compiler_options=compiler_options)


def run_sequence(fn, a: dict, *, zigzag_size: int = 0, segments=None, sinks: bool = False,
                 repeat: int = 1):
    """Runs `fn` (from `sequence_vjp`) on the global arrays `a` (`q, k, v, dout`, and
    `seg` / `seg_kv` / `sinks` as configured), in the zigzag layout of a ring of
    `zigzag_size` if not 0; returns `dict(out, dq, dk, dv, dsinks)` in global order as
    NumPy (a list of `repeat` of them when `repeat > 1`)."""
    to = lambda x: zigzag(x, zigzag_size)  # noqa: E731
    back = lambda x: unzigzag(x, zigzag_size)  # noqa: E731
    args = [to(a[name]) for name in ("q", "k", "v")]
    seg = jax.tree.map(to, segment_arrays(a, segments))
    s = jnp.asarray(a["sinks"]) if sinks else None
    dout = to(a["dout"])

    def unpack(r):
        out, (dq, dk, dv, ds) = r
        return dict(out=back(out), dq=back(dq), dk=back(dk), dv=back(dv),
                    dsinks=None if ds is None else np.asarray(ds))

    results = [unpack(fn(*args, seg, s, dout)) for _ in range(repeat)]
    return results if repeat > 1 else results[0]
