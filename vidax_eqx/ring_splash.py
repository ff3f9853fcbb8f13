"""The splash-kernel ring attention API, as a drop-in: its names, per-example layout and
unscaled logits, on the library's ring.

Code written for the splash ring module (`make_ring_attention(mask, block_sizes=,
is_mqa=, mask_value=, logits_soft_cap=, ring_axis=, q_seq_shards=)`, then
`kernel(q, k, v, segment_ids, sinks)` inside `jax.shard_map`, usually under
`jax.vmap` over the batch; or `ring_splash_attention(..., causal=True)`) runs with
its imports changed to this module:

```python
from vidax_eqx.ring_splash import make_ring_attention, SegmentIds

kernel = make_ring_attention(np.ones((L, L), bool), ring_axis="sp")
per_device = lambda q, k, v, q_ids, kv_ids: jax.vmap(kernel)(q, k, v, SegmentIds(q_ids, kv_ids))
out = jax.shard_map(per_device, mesh=mesh, in_specs=P(None, None, "sp"),
                    out_specs=P(None, None, "sp"))(q, k, v, q_ids, kv_ids)
```

The semantics are the original's, where the original is well defined:

- **Per example**: `q` is `(H, L, D)` (this device's `L` tokens of the sequence, which
  the ring splits over `ring_axis` in order: device `r` holds tokens `[r L, (r + 1) L)`),
  `k` and `v` `(H, L, D)`, or `(L, D)` with `is_mqa=True`; `SegmentIds(q=(L,),
  kv=(L,))`; `sinks` `(H,)`. A batch goes through `jax.vmap`, as it did.
- **Logits are not scaled** (`q @ k.T`, as splash attention computes them): scale
  `q` beforehand, as code written for splash already does. The library's own API
  ([`vidax_eqx.parallel.make_ring_attention`][]) scales by `1 / sqrt(D)` by default.
- **The mask is the local block `(L, L)` every ring step applies**, as the original
  hands the same mask information to each step: the query at global position `i`
  may see the key at `j` when `mask[i % L, j % L]`. A full mask is the usual case;
  `causal=True` is global causal attention (the mask is then not used, as in the
  original, and one that hides more than causal is refused). A mask over the global
  sequence is [`vidax_eqx.parallel.make_ring_attention`][]'s.
- Segment ids: a query sees a key of the same id, negative ids are padding. The key
  ids travel the ring with their keys (the original kept each device's own ids while
  the keys moved, which agrees with this when every device holds the same ids).
- `sinks` enter the softmax once per row, `logits_soft_cap` `c` applies `c tanh(s /
  c)` to the logits, gradients flow to `q`, `k`, `v` and `sinks`.

Where the library differs on purpose: masking is exact, so `mask_value` is accepted
and not used (a hidden logit is `-inf`; a row that sees nothing gives 0, where splash
gives the mean of the values); `block_sizes` set the tiles of the blockwise kernel
each step runs (`None`: the fastest kernel for the platform); `q_seq_shards` only
shaped the original's mask metadata and is accepted. docs/how-to/port-splash-ring.md
puts each original call beside its library call.
"""

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .kernels import SegmentIds as SegmentIds
from .parallel import (
    AbstractMask, axis_size, CausalMask, DenseMask, FullMask, make_ring_attention as _ring,
)


RING_AXIS = "sp"
"""The default mesh axis of the ring."""

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
"""Splash attention's stand-in logit for hidden entries; accepted, not used (masking
here is exact)."""

MaskFunctionType = Callable[[jax.Array, jax.Array], jax.Array]
"""`(q_ids, kv_ids) -> bool`, elementwise over local positions."""


@dataclass(frozen=True)
class BlockSizes:
    """Splash attention's tile sizes. `block_q` and `block_kv` set the tiles of the
    blockwise kernel each ring step runs (its backward uses the same tiles); the other
    fields are accepted for compatibility. JAX's own splash `BlockSizes` objects are
    accepted too."""

    block_q: int
    block_kv: int
    block_kv_compute: int | None = None
    block_q_dkv: int | None = None
    block_kv_dkv: int | None = None
    block_kv_dkv_compute: int | None = None
    block_q_dq: int | None = None
    block_kv_dq: int | None = None
    use_fused_bwd_kernel: bool = False
    q_layout: object = None
    k_layout: object = None
    v_layout: object = None

    @property
    def has_backward_blocks(self) -> bool:
        return self.block_q_dkv is not None and self.block_kv_dkv is not None

    @classmethod
    def get_default(cls) -> "BlockSizes":
        """Splash's defaults: 128 for every tile."""
        return cls(128, 128, 128, 128, 128, 128, 128, 128)


# -- the local mask, repeated at every ring step -------------------------------------


def _local_mask(mask) -> np.ndarray | jax.Array:
    """The `(L, L)` boolean block of `mask`: an array, or a splash mask object (anything
    with a 2-D `shape` that slices to a boolean array, as JAX's splash masks do)."""
    if isinstance(mask, AbstractMask):
        raise TypeError(
            "vidax_eqx.ring_splash takes the original's local (L, L) mask (an array or a "
            f"splash mask object); received the library's {type(mask).__name__}, a mask over "
            "global positions: use vidax_eqx.parallel.make_ring_attention for it."
        )
    if not isinstance(mask, (np.ndarray, jax.Array)):
        shape = getattr(mask, "shape", None)
        if shape is None or not hasattr(mask, "__getitem__"):
            raise TypeError(
                "`mask` must be a boolean (L, L) array or a splash mask object (with `shape` "
                f"and slicing); received {type(mask).__name__}."
            )
        if len(shape) != 2:
            raise ValueError(f"Expected 2D mask, got shape: {tuple(shape)}")
        mask = np.asarray(mask[0:shape[0], 0:shape[1]])
    if mask.ndim != 2 or mask.shape[0] != mask.shape[1]:
        raise ValueError(
            "`mask` must be 2D (L, L), the block of this device's queries and each step's "
            f"keys; received shape {tuple(mask.shape)}."
        )
    if isinstance(mask, jax.core.Tracer):
        return mask.astype(bool)
    mask = np.asarray(mask)
    if mask.dtype != np.bool_:
        raise TypeError(f"`mask` must be boolean (True = may attend); received dtype {mask.dtype}.")
    return mask


class _RepeatedBlock(AbstractMask):
    """The original's semantics as a mask over global positions: the `(L, L)` block
    applied to every `(query block, key block)` pair of the ring, `mask[i % L, j % L]`."""

    local: DenseMask

    def block(self, q_positions, kv_positions):
        L = self.local.seq_len()
        return self.local.block(q_positions % L, kv_positions % L)

    def window(self):
        return None

    def seq_len(self):
        return None

    def _split(self):
        return (None, None), self

    def _materialize(self, seq_len, xp):
        n = seq_len // self.local.seq_len()
        return xp.tile(self.local._materialize(self.local.seq_len(), xp), (n, n))

    def _block_tables(self, seq_len, block_size):
        L = self.local.seq_len()
        if block_size != L or seq_len % L:  # (the ring's blocks are the devices' L tokens)
            return super()._block_tables(seq_len, block_size)
        some, every = (table[0, 0] for table in self.local._block_tables(L, L))
        xp = np if isinstance(some, np.generic) else jnp
        n = seq_len // L
        return xp.full((n, n), some), xp.full((n, n), every)


def _with_function(mask, mask_function: MaskFunctionType | None, L: int):
    """`mask & mask_function(q_ids, kv_ids)` over local positions `[0, L)`."""
    if mask_function is None:
        return mask
    ids = np.arange(L, dtype=np.int32)
    visible = mask_function(ids[:, None], ids[None, :])
    visible = np.asarray(visible) if not isinstance(visible, jax.core.Tracer) else visible
    both = visible & mask
    return both if isinstance(both, jax.core.Tracer) else np.asarray(both, bool)


def _hides_more_than_causal(mask) -> bool:
    if isinstance(mask, jax.core.Tracer):
        return False  # (not decidable at trace time; the original ignores it too)
    return bool((~mask & np.tril(np.ones(mask.shape, bool))).any())


# -- the call --------------------------------------------------------------------------


def _check_per_example(q, k, v, is_mqa: bool) -> None:
    if q.ndim != 3:
        raise ValueError(
            "`q` must be one example's (H, L, D) (the original's per-example layout; a batch "
            f"goes through jax.vmap); received shape {q.shape}."
        )
    H, L, D = q.shape
    if is_mqa:
        if k.shape != (L, D) or v.shape != (L, D):
            raise ValueError(
                f"is_mqa=True: `k` and `v` must be (L, D) = {(L, D)} (one key/value head); "
                f"received k: {k.shape}, v: {v.shape}."
            )
    elif k.ndim != 3 or k.shape[1:] != (L, D) or v.shape != k.shape or H % k.shape[0]:
        raise ValueError(
            f"`k` and `v` must be (H_kv, L, D) with H % H_kv == 0, for q {q.shape}; received "
            f"k: {k.shape}, v: {v.shape} (or pass is_mqa=True with (L, D) keys)."
        )


def ring_splash_attention(
    fwd_mask_info,
    dkv_mask_info,
    q: Float[Array, "H L D"],
    k: Float[Array, "H_kv L D"] | Float[Array, "L D"],
    v: Float[Array, "H_kv L D"] | Float[Array, "L D"],
    segment_ids: SegmentIds | None = None,
    sinks: Float[Array, " H"] | None = None,
    *,
    is_mqa: bool,
    block_sizes=None,
    mask_value: float = DEFAULT_MASK_VALUE,
    mask_function: MaskFunctionType | None = None,
    logits_soft_cap: float | None = None,
    ring_axis: Hashable = RING_AXIS,
    causal: bool = False,
) -> Float[Array, "H L D"]:
    """Ring attention of one example's block of the sequence, inside `jax.shard_map`.

    **Arguments:**

    - `fwd_mask_info`: the local `(L, L)` mask every ring step applies (an array or a
        splash mask object; `None`: every key), where the original took the mask
        information splash derived from it. Not used with `causal=True`.
    - `dkv_mask_info`: accepted and not used (the backward applies the forward's mask).
    - `q`: `(H, L, D)`; `k`, `v`: `(H_kv, L, D)` (`H % H_kv == 0`), or `(L, D)` with
        `is_mqa=True`.
    - `segment_ids`: `SegmentIds(q=(L,), kv=(L,))`, this device's ids.
    - `sinks`: per-head sink logits `(H,)`.
    - `is_mqa`, `block_sizes`, `mask_value`, `logits_soft_cap`, `ring_axis`: as for
        [`make_ring_attention`][]; `mask_function`: `(q_ids, kv_ids) -> bool` over local
        positions, ANDed with the mask.
    - `causal`: global causal attention over the ring's order of the sequence.

    **Returns:**

    This device's output `(H, L, D)` in `q`'s dtype. Outside a context that binds
    `ring_axis`: `ValueError("Ring axis 'sp' does not exist in the current context. ...")`.
    """
    del dkv_mask_info, mask_value  # (see the module docstring)
    axis_size(ring_axis, what="Ring")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    _check_per_example(q, k, v, is_mqa)
    L = q.shape[1]
    mask = None if fwd_mask_info is None else _local_mask(fwd_mask_info)
    if mask is not None and mask.shape != (L, L):
        raise ValueError(
            f"the mask is the (L, L) block every ring step applies, for this device's L = {L} "
            f"tokens; received a mask of shape {tuple(mask.shape)}. For a mask over the global "
            "sequence use vidax_eqx.parallel.make_ring_attention."
        )
    if causal:
        if mask is not None and _hides_more_than_causal(_with_function(mask, mask_function, L)):
            raise ValueError(
                "causal=True is global causal attention and does not apply the mask (as in the "
                "original); this mask hides keys that causal attention sees. Use causal=False "
                "with the mask, or a mask with every causal entry True."
            )
        global_mask = CausalMask()
    else:
        if mask is None and mask_function is not None:
            mask = np.ones((L, L), bool)
        mask = _with_function(mask, mask_function, L)
        global_mask = FullMask() if mask is None else _RepeatedBlock(DenseMask(mask))
    kernel = _ring(global_mask, block_sizes=block_sizes, is_mqa=is_mqa,
                   logits_soft_cap=logits_soft_cap, ring_axis=ring_axis, scale=1.0)
    to_rows = lambda x: jnp.moveaxis(x, 0, 1)[None]  # noqa: E731  (H, L, D) -> (1, L, H, D)
    k4, v4 = (x[None, :, None] if is_mqa else to_rows(x) for x in (k, v))
    if segment_ids is not None:
        if not isinstance(segment_ids, SegmentIds):
            raise TypeError(
                f"`segment_ids` must be SegmentIds(q=(L,), kv=(L,)); received {type(segment_ids).__name__}."
            )
        seg_q, seg_kv = jnp.asarray(segment_ids.q), jnp.asarray(segment_ids.kv)
        if seg_q.shape != (L,) or seg_kv.shape != (L,):
            raise ValueError(
                f"`segment_ids` must be SegmentIds(q=(L,), kv=(L,)) with L = {L}; received q: "
                f"{seg_q.shape}, kv: {seg_kv.shape}."
            )
        segment_ids = SegmentIds(q=seg_q[None], kv=seg_kv[None])
    out = kernel(to_rows(q), k4, v4, segment_ids=segment_ids, sinks=sinks)
    return jnp.moveaxis(out[0], 1, 0)


class RingSplashAttentionKernel(eqx.Module):
    """The kernel object of [`make_ring_attention`][]: call it as `kernel(q, k, v,
    segment_ids=None, sinks=None)` on one example inside `jax.shard_map` (a batch
    through `jax.vmap(kernel)`). A PyTree (an `eqx.Module`) whose mask is a leaf and
    whose options are static, so it passes through `jax.jit`.

    Built as the original: `RingSplashAttentionKernel(fwd_mask_info, dkv_mask_info,
    ring_axis=..., **options)` with the options of [`ring_splash_attention`][]
    (`is_mqa`, `block_sizes`, `mask_value`, `mask_function`, `logits_soft_cap`, `causal`).
    """

    fwd_mask_info: Array | np.ndarray | None
    dkv_mask_info: Array | np.ndarray | None
    ring_axis: Hashable = eqx.field(static=True)
    options: tuple[tuple[str, object], ...] = eqx.field(static=True)  # (hashable, for jit)

    def __init__(self, fwd_mask_info, dkv_mask_info, ring_axis: Hashable = RING_AXIS, **kwargs):
        """**Arguments:** the local `(L, L)` mask (`fwd_mask_info`; an array or a splash
        mask object, or `None`: every key), `dkv_mask_info` (accepted, not used), the ring
        axis, and the options of [`ring_splash_attention`][] by keyword."""
        known = {"is_mqa", "block_sizes", "mask_value", "mask_function", "logits_soft_cap", "causal"}
        if unknown := sorted(set(kwargs) - known):
            raise TypeError(
                f"RingSplashAttentionKernel: unknown option(s) {unknown}; the options are "
                f"{sorted(known)}."
            )
        self.fwd_mask_info = None if fwd_mask_info is None else _local_mask(fwd_mask_info)
        self.dkv_mask_info = None if dkv_mask_info is None else _local_mask(dkv_mask_info)
        self.ring_axis = ring_axis
        self.options = tuple(sorted({"is_mqa": False, **kwargs}.items()))

    @property
    def kwargs(self) -> dict:
        """The options, as the original kept them."""
        return dict(self.options)

    def __call__(
        self,
        q: Float[Array, "H L D"],
        k: Float[Array, "H_kv L D"] | Float[Array, "L D"],
        v: Float[Array, "H_kv L D"] | Float[Array, "L D"],
        segment_ids: SegmentIds | None = None,
        sinks: Float[Array, " H"] | None = None,
    ) -> Float[Array, "H L D"]:
        """[`ring_splash_attention`][] of one example with this kernel's mask and options:
        `q (H, L, D)`, `k`, `v` `(H_kv, L, D)` (or `(L, D)` with `is_mqa`),
        `SegmentIds(q=(L,), kv=(L,))`, `sinks (H,)`; returns `(H, L, D)`."""
        return ring_splash_attention(
            self.fwd_mask_info, self.dkv_mask_info, q, k, v, segment_ids=segment_ids,
            sinks=sinks, ring_axis=self.ring_axis, **self.kwargs,
        )


def make_ring_attention(
    mask,
    *,
    block_sizes=None,
    is_mqa: bool = False,
    mask_value: float = DEFAULT_MASK_VALUE,
    logits_soft_cap: float | None = None,
    ring_axis: Hashable = RING_AXIS,
    q_seq_shards: int = 1,
    causal: bool = False,
) -> RingSplashAttentionKernel:
    """Builds the ring kernel for a local mask, as the splash ring module did.

    **Arguments:**

    - `mask`: the `(L, L)` block every ring step applies (`L` tokens per device): a
        boolean array or a splash mask object (e.g. JAX's splash `FullMask((L, L))`).
    - `block_sizes`: [`BlockSizes`][] (or JAX's splash one): `block_q` and `block_kv`
        set the blockwise kernel's tiles. `None`: the fastest kernel for the platform.
    - `is_mqa`: one key/value head, `k` and `v` `(L, D)`.
    - `mask_value`: accepted, not used (masking is exact).
    - `logits_soft_cap`: `c` applies `c tanh(s / c)` to the (unscaled) logits.
    - `ring_axis`: the mesh axis of the ring.
    - `q_seq_shards`: accepted (a positive int); it only shaped the original's mask metadata.
    - `causal`: global causal attention (not in the original's `make_ring_attention`,
        whose `RingSplashAttentionKernel(..., causal=True)` this is).

    **Returns:**

    A [`RingSplashAttentionKernel`][].
    """
    if isinstance(q_seq_shards, bool) or not isinstance(q_seq_shards, (int, np.integer)) or q_seq_shards < 1:
        raise ValueError(f"`q_seq_shards` must be a positive int; received {q_seq_shards!r}.")
    mask = _local_mask(mask)
    options = dict(is_mqa=is_mqa, block_sizes=block_sizes, mask_value=mask_value,
                   logits_soft_cap=logits_soft_cap)
    if causal:
        options["causal"] = True
    return RingSplashAttentionKernel(mask, None, ring_axis=ring_axis, **options)


__all__ = [
    "BlockSizes", "DEFAULT_MASK_VALUE", "make_ring_attention", "MaskFunctionType", "RING_AXIS",
    "ring_splash_attention", "RingSplashAttentionKernel", "SegmentIds",
]
