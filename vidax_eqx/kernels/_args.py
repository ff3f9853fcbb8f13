"""Validation and normalization of attention arguments.

Every public entry point of `vidax_eqx.kernels` funnels its arguments through
[`normalize`][], which checks them once, with messages that name the argument,
what was received and what was expected, and returns

- `Operands`: the arrays (a PyTree; absent features are `None`), with bias and
  mask lifted to rank 4, segment ids split into `(q, kv)` and key lengths
  (`kv_lengths`) as int32 `(B,)`;
- `Options`: the static configuration (hashable, so it can be a `nondiff`
  argument of a `custom_vjp` and a `jit` static argument).

Implementations therefore never re-validate, and every implementation sees
exactly the same normalized request.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._block_causal import BlockCausalMask
from ._tile import SlidingTileMask


QUANTIZE = (None, "int8-qk", "int8")
"""The modes of `attention(..., quantize=)`: float; Q.Kᵀ in int8; Q.Kᵀ and P.V in int8
(the scheme: `_int8.py`)."""


class SegmentIds(NamedTuple):
    """Segment ids of the query and key/value tokens.

    **Arguments:**

    - `q`: int32 `(B, S_q)`.
    - `kv`: int32 `(B, S_k)`.

    A query attends only to keys with the same id. A negative id marks padding:
    that token attends to nothing and nothing attends to it.
    """

    q: jax.Array
    kv: jax.Array


@dataclasses.dataclass(frozen=True)
class Options:
    """Static attention options, after validation.

    `window` is `(left, right)` with `None` meaning unbounded on that side, or
    `None` for no window. `default_positions` is True when neither position
    array was given (the positions are `arange`), which lets implementations
    with a fixed causal layout serve the request. `tile_mask` is a structured
    [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask] passed as `mask=`
    (evaluated on the positions; never materialized outside `"xla"`), and
    `block_causal` a [`BlockCausalMask`][vidax_eqx.kernels.BlockCausalMask] passed
    as `mask=` (`causal` and `window` are then False and None: it is the causal
    structure; implementations that declare it run it natively or through
    `_block_causal.lower`).
    """

    causal: bool
    window: tuple[int | None, int | None] | None
    scale: float
    logits_soft_cap: float | None
    default_positions: bool
    tile_mask: SlidingTileMask | None = None
    block_causal: BlockCausalMask | None = None
    quantize: str | None = None


class Operands(NamedTuple):
    """The arrays of one attention request, normalized.

    Shapes: `q (B, S_q, H, D)`, `k`/`v (B, S_k, H_kv, D)`; `bias`/`mask` rank 4,
    each axis 1 or full; `seg_q (B, S_q)`, `seg_kv (B, S_k)` int32; `sinks (H,)`;
    `q_pos (S_q,)`, `kv_pos (S_k,)` int32; `kv_lengths (B,)` int32, the number of
    valid keys of each batch row (keys at index `>= kv_lengths[b]` are invisible).
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    bias: jax.Array | None = None
    mask: jax.Array | None = None
    seg_q: jax.Array | None = None
    seg_kv: jax.Array | None = None
    sinks: jax.Array | None = None
    q_pos: jax.Array | None = None
    kv_pos: jax.Array | None = None
    kv_lengths: jax.Array | None = None


def _shape(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _as_array(name: str, x) -> jax.Array:
    if isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "shape"):
        return jnp.asarray(x)
    raise TypeError(f"`{name}` must be an array; received {type(x).__name__}.")


def _check_float(name: str, x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"`{name}` must have a floating dtype (float32, bfloat16 or float16); "
            f"received dtype {x.dtype}."
        )


def _check_int(name: str, x: jax.Array) -> None:
    """Ids and positions are int32: any integer dtype whose values all fit int32.

    uint32 / uint64 / int64 ids above 2**31 - 1 would wrap to negative values (which
    mean padding), so those dtypes are refused rather than cast silently.
    """
    dtype = np.dtype(x.dtype)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"`{name}` must have an integer dtype; received dtype {dtype}.")
    if np.iinfo(dtype).max > _INT32_MAX or np.iinfo(dtype).min < -_INT32_MAX - 1:
        raise TypeError(
            f"`{name}` must have an integer dtype whose values fit int32 (int8, int16, int32, "
            f"uint8, uint16); received dtype {dtype}, whose values above 2**31 - 1 would wrap "
            "to negative ids (padding). Cast it explicitly with `.astype(jnp.int32)`."
        )


def _lift_to_4d(name: str, x: jax.Array, full: tuple[int, int, int, int]) -> jax.Array:
    """Lifts `x` to rank 4 by prepending ones and checks it broadcasts to `full`."""
    if x.ndim > 4:
        raise ValueError(
            f"`{name}` must broadcast to (B, H, S_q, S_k) = {full}; received shape "
            f"{x.shape} of rank {x.ndim} > 4."
        )
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    for axis, (got, want) in enumerate(zip(x.shape, full)):
        if got not in (1, want):
            raise ValueError(
                f"`{name}` must broadcast to (B, H, S_q, S_k) = {full}; received shape "
                f"{x.shape} (axis {axis} has size {got}, expected 1 or {want})."
            )
    return x


_INT32_MAX = 2**31 - 1


def check_window(window) -> tuple[int | None, int | None] | None:
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(
            f"`window` must be a pair (left, right) of non-negative ints or None; "
            f"received {window!r}."
        )
    out = []
    for side, w in zip(("left", "right"), window):
        if w is None:
            out.append(None)
            continue
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)):
            raise ValueError(
                f"`window` {side} size must be a non-negative int or None; received {w!r}."
            )
        if w < 0:
            raise ValueError(
                f"`window` {side} size must be >= 0 (use None for unbounded); received {w}."
            )
        # Positions are non-negative int32, so no pair is farther apart than
        # 2**31 - 1: a side that large excludes nothing (and must not overflow).
        out.append(None if w >= _INT32_MAX else int(w))
    return (out[0], out[1])


def _static_float(name: str, x) -> float:
    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            f"`{name}` must be a concrete Python number (it is static configuration); "
            "received a traced value. Pass it as a static argument of `jax.jit`."
        )
    if isinstance(x, (str, bytes, bool)):
        raise TypeError(f"`{name}` must be a number; received {type(x).__name__} {x!r}.")
    try:
        value = float(x)
    except (TypeError, ValueError):
        raise TypeError(f"`{name}` must be a number; received {type(x).__name__} {x!r}.") from None
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be finite; received {value}.")
    return value


def _check_kv_lengths(kv_lengths, batch: int, seq_k: int) -> jax.Array:
    """`kv_lengths` as int32 `(B,)`, checked: integer dtype, shape `(B,)`, values in
    `[0, S_k]` (a `ValueError` for concrete arrays). Traced values cannot be checked
    when the program is traced; they are clipped to `[0, S_k]`, as documented. (A
    runtime check, `eqx.error_if`, would put a host callback into the program, which
    `jax.export` cannot serialize and which does not type-check inside `shard_map`
    when the lengths vary over a mesh axis.)"""
    x = _as_array("kv_lengths", kv_lengths)
    dtype = np.dtype(x.dtype)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(
            f"`kv_lengths` must have an integer dtype (int32: the number of valid keys of "
            f"each batch row); received dtype {dtype}."
        )
    _check_int("kv_lengths", x)
    if x.shape != (batch,):
        raise ValueError(
            f"`kv_lengths` must have shape (B,) = ({batch},), the number of valid keys of "
            f"each batch row; received shape {x.shape}."
        )
    message = (
        f"`kv_lengths` must lie in [0, S_k] = [0, {seq_k}] (the number of valid keys of "
        "each batch row)"
    )
    if isinstance(x, jax.core.Tracer):
        return jnp.clip(x.astype(jnp.int32), 0, seq_k)
    values = np.asarray(x)
    if np.any((values < 0) | (values > seq_k)):
        raise ValueError(f"{message}; received {values.tolist()}.")
    return x.astype(jnp.int32)


def valid_keys(kv_lengths: jax.Array, index) -> jax.Array:
    """Key-only padding: bool `(B, U)`, key `u` (at sequence index `index[u]`, `index`
    int `(U,)`, or `U` for `arange(U)`) visible to row `b`'s queries."""
    if isinstance(index, int):
        index = jnp.arange(index, dtype=jnp.int32)
    return index[None, :] < kv_lengths[:, None]


def normalize(
    q,
    k,
    v,
    *,
    bias=None,
    mask=None,
    segment_ids=None,
    sinks=None,
    q_positions=None,
    kv_positions=None,
    causal: bool = False,
    window=None,
    scale=None,
    logits_soft_cap=None,
    kv_lengths=None,
    quantize=None,
) -> tuple[Operands, Options]:
    """Validates an attention request; see the module docstring."""
    q, k, v = _as_array("q", q), _as_array("k", k), _as_array("v", v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            layout = "(B, S_q, H, D)" if name == "q" else "(B, S_k, H_kv, D)"
            raise ValueError(
                f"`{name}` must have rank 4 with layout {layout}; received shape {x.shape}."
            )
        _check_float(name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            "`q`, `k` and `v` must share one dtype (cast them explicitly); received "
            f"q: {q.dtype}, k: {k.dtype}, v: {v.dtype}."
        )
    B, S_q, H, D = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"`k` and `v` must have the same shape (B, S_k, H_kv, D); received k: {k.shape}, "
            f"v: {v.shape}."
        )
    _, S_k, H_kv, _ = k.shape
    if k.shape[0] != B:
        raise ValueError(
            f"`q` and `k` must have the same batch size; received q: {q.shape} (B={B}), "
            f"k: {k.shape} (B={k.shape[0]})."
        )
    if k.shape[3] != D:
        raise ValueError(
            f"`q` and `k` must have the same head_dim D; received q: {q.shape} (D={D}), "
            f"k: {k.shape} (D={k.shape[3]})."
        )
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(
            f"the number of query heads must be a multiple of the number of key/value heads "
            f"(GQA); received q: {q.shape} (H={H}), k: {k.shape} (H_kv={H_kv})."
        )
    if min(B, S_q, S_k, H, D) == 0:
        raise ValueError(
            f"attention needs non-empty arrays (B, S_q, S_k, H, H_kv and D all >= 1); received "
            f"q: {q.shape}, k: {k.shape}."
        )
    full = (B, H, S_q, S_k)

    if bias is not None:
        bias = _as_array("bias", bias)
        _check_float("bias", bias)
        bias = _lift_to_4d("bias", bias, full)
    tile_mask = None
    if isinstance(mask, SlidingTileMask):
        tile_mask, mask = mask, None
        tile_mask.check_heads(H)
        if q_positions is None and kv_positions is None and not S_q == S_k == tile_mask.seq_len:
            raise ValueError(
                f"a SlidingTileMask over {tile_mask.seq_len} tokens (text_len={tile_mask.text_len} "
                f"+ video_len={tile_mask.video_len}, the tile layout of grid {tile_mask.grid} with "
                f"tile {tile_mask.tile}) needs S_q == S_k == {tile_mask.seq_len}; received "
                f"S_q={S_q}, S_k={S_k}. Lay the video out with tile_permute (which pads the grid "
                "to whole tiles) and add the text, or pass q_positions / kv_positions for a chunk."
            )
    block_causal = None
    if isinstance(mask, BlockCausalMask):
        block_causal, mask = mask, None
        if causal or window is not None:
            raise ValueError(
                "a BlockCausalMask is the request's causal structure: it takes no `causal` or "
                f"`window` beside it (a rolling window is its own `window`, in blocks); received "
                f"causal={causal!r}, window={window!r}."
            )
        n, offset = block_causal.seq_len, block_causal.query_offset
        if q_positions is None and kv_positions is None and not (S_k == n and S_q == n - offset):
            raise ValueError(
                f"a BlockCausalMask over {n} tokens (text_len={block_causal.text_len} + the "
                f"{block_causal.video_len} tokens of grid {block_causal.grid}) needs S_k == {n} and "
                f"S_q == {n - offset} (the tokens from query_offset={offset}); received S_q={S_q}, "
                f"S_k={S_k}. Pass q_positions / kv_positions for a chunk."
            )
    if mask is not None:
        mask = _as_array("mask", mask)
        if mask.dtype != jnp.bool_:
            raise TypeError(
                f"`mask` must be boolean (True = may attend); received dtype {mask.dtype}."
            )
        mask = _lift_to_4d("mask", mask, full)

    seg_q = seg_kv = None
    if segment_ids is not None:
        if isinstance(segment_ids, SegmentIds):
            seg_q = _as_array("segment_ids.q", segment_ids.q)
            seg_kv = _as_array("segment_ids.kv", segment_ids.kv)
        else:
            seg_q = seg_kv = _as_array("segment_ids", segment_ids)
            if S_q != S_k:
                raise ValueError(
                    "a single `segment_ids` array needs S_q == S_k; received S_q="
                    f"{S_q}, S_k={S_k}. Pass SegmentIds(q=..., kv=...) instead."
                )
        name_q = "segment_ids.q" if isinstance(segment_ids, SegmentIds) else "segment_ids"
        name_kv = "segment_ids.kv" if isinstance(segment_ids, SegmentIds) else "segment_ids"
        for name, s, want in ((name_q, seg_q, (B, S_q)), (name_kv, seg_kv, (B, S_k))):
            _check_int(name, s)
            if s.shape != want:
                raise ValueError(f"`{name}` must have shape (B, S) = {want}; received {s.shape}.")
        if seg_q is seg_kv:  # one array for both sides: keep it one array
            seg_q = seg_kv = seg_q.astype(jnp.int32)
        else:
            seg_q, seg_kv = seg_q.astype(jnp.int32), seg_kv.astype(jnp.int32)
        # Padding attends to nothing and nothing attends to it, so its values must not
        # matter. They would through `0 * x` products (the `p @ v` of the forward and the
        # `ds @ k`, `ds^T @ q` of the backward): a NaN or Inf left in a padded token
        # would reach every real token. Zeroing padded q / k / v rows makes padding
        # inert; its gradient is 0 either way.
        q = jnp.where((seg_q >= 0)[:, :, None, None], q, jnp.zeros((), q.dtype))
        k = jnp.where((seg_kv >= 0)[:, :, None, None], k, jnp.zeros((), k.dtype))
        v = jnp.where((seg_kv >= 0)[:, :, None, None], v, jnp.zeros((), v.dtype))

    if kv_lengths is not None:
        kv_lengths = _check_kv_lengths(kv_lengths, B, S_k)
        # Padded keys are invisible, so (as for segment-id padding) their values must
        # not matter: zero them, so a NaN / Inf left there cannot reach a real row
        # through a `0 * x` product. Their gradient is 0 either way.
        valid = valid_keys(kv_lengths, S_k)[:, :, None, None]
        k = jnp.where(valid, k, jnp.zeros((), k.dtype))
        v = jnp.where(valid, v, jnp.zeros((), v.dtype))

    if sinks is not None:
        sinks = _as_array("sinks", sinks)
        _check_float("sinks", sinks)
        if sinks.shape != (H,):
            raise ValueError(
                f"`sinks` must have shape (H,) = ({H},), one logit per query head; received "
                f"{sinks.shape}."
            )

    default_positions = q_positions is None and kv_positions is None
    q_pos = kv_pos = None
    if not default_positions:
        q_pos = jnp.arange(S_q, dtype=jnp.int32) if q_positions is None else q_positions
        kv_pos = jnp.arange(S_k, dtype=jnp.int32) if kv_positions is None else kv_positions
        for name, p, n in (("q_positions", q_pos, S_q), ("kv_positions", kv_pos, S_k)):
            p = _as_array(name, p)
            _check_int(name, p)
            if p.shape != (n,):
                raise ValueError(f"`{name}` must have shape ({n},); received {p.shape}.")
        q_pos = jnp.asarray(q_pos, jnp.int32)
        kv_pos = jnp.asarray(kv_pos, jnp.int32)

    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"`causal` must be a bool; received {causal!r}.")
    window = check_window(window)
    scale = 1.0 / math.sqrt(D) if scale is None else _static_float("scale", scale)
    if logits_soft_cap is not None:
        logits_soft_cap = _static_float("logits_soft_cap", logits_soft_cap)
        if logits_soft_cap <= 0:
            raise ValueError(f"`logits_soft_cap` must be > 0; received {logits_soft_cap}.")

    if quantize not in QUANTIZE:
        raise ValueError(f"`quantize` must be one of {QUANTIZE}; received {quantize!r}.")
    operands = Operands(q, k, v, bias, mask, seg_q, seg_kv, sinks, q_pos, kv_pos, kv_lengths)
    options = Options(bool(causal), window, scale, logits_soft_cap, default_positions, tile_mask,
                      block_causal, quantize)
    return operands, options
