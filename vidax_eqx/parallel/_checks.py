"""Argument validators shared by the sequence-parallel entry points.

Ulysses, the ring, its joint layout and USP check their common arguments here, so
that each rule has one implementation and one message: the rank and
head counts of `q, k, v`, sink logits, ring sizes, and sliding tile masks laid
over a sharded global sequence. Everything raises `ValueError` (a wrong mask type
`TypeError`), stating the rule, what was received and the fix.
"""

import jax
import jax.numpy as jnp
import numpy as np

from .. import kernels
from ..kernels.internal import STRUCTURED_MASKS
from ._rank_masks import RankMasks


def check_qkv(q, k, v, fn: str) -> None:
    """Self-attention operands of rank 4 with `k.shape == v.shape`, the same B, local
    length and D as `q`, and `H % H_kv == 0`."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.ndim(x) != 4:
            raise ValueError(
                f"{fn}: `{name}` must have rank 4 (B, L_local, H, D); received shape "
                f"{jnp.shape(x)}."
            )
    if jnp.shape(k) != jnp.shape(v):
        raise ValueError(
            f"{fn}: `k` and `v` must have the same shape; received k: {jnp.shape(k)}, "
            f"v: {jnp.shape(v)}."
        )
    B, L, H, D = jnp.shape(q)
    Bk, Lk, H_kv, Dk = jnp.shape(k)
    if (Bk, Lk, Dk) != (B, L, D):
        raise ValueError(
            f"{fn}: self-attention needs `q` and `k`/`v` to share B, the local sequence "
            f"length and D; received q: {jnp.shape(q)}, k: {jnp.shape(k)}."
        )
    if H_kv == 0 or H % H_kv:
        raise ValueError(
            f"{fn}: the number of query heads must be a multiple of the number of key/value "
            f"heads (GQA); received q: {jnp.shape(q)} (H={H}), k: {jnp.shape(k)} (H_kv={H_kv})."
        )


def check_head_split(H: int, sp: int, sp_axis_name: str, fn: str) -> None:
    """Ulysses' head split: `H` must be a multiple of the SP size `sp`."""
    if H % sp:
        raise ValueError(
            f"{fn}: Ulysses splits the {H} query heads over the {sp} devices of axis "
            f"{sp_axis_name!r}, so H must be a multiple of the SP size; received H={H}, "
            f"sp={sp} ({H} % {sp} = {H % sp}). Use an SP size that divides H, or ring "
            "attention (which splits the sequence, not the heads) for the rest."
        )


def check_sp_size(sp_size) -> int:
    """`sp_size` as an int, or a `ValueError` unless it is a positive int."""
    if isinstance(sp_size, bool) or not isinstance(sp_size, (int, np.integer)) or sp_size < 1:
        raise ValueError(f"`sp_size` must be a positive int; received {sp_size!r}.")
    return int(sp_size)


def check_sinks(fn: str, sinks, H: int):
    """`sinks` as an array, or a `ValueError` unless it is float `(H,)` (or `None`)."""
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)
    if sinks.shape != (H,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(
            f"{fn}: `sinks` must be a float array of shape (H,) = ({H},), one logit per "
            f"query head; received shape {sinks.shape}, dtype {sinks.dtype}."
        )
    return sinks


def check_tile_mask(fn: str, tile_mask, global_len: int, heads: int, unit: int, what: str = "sequence"):
    """Raises a `ValueError` unless `tile_mask` (a structured kernel mask, a
    `kernels.SlidingTileMask` or `kernels.BlockCausalMask`, or None) fits a global
    sequence of `global_len` tokens and `heads` query heads: the sequence is the mask's,
    padded by fewer than `unit` tiles' tokens (`unit` tokens for a frame-block causal
    mask; positions past the mask's `seq_len` are padding)."""
    if tile_mask is None:
        return
    if isinstance(tile_mask, RankMasks):
        for mask in tile_mask.masks:
            check_tile_mask(fn, mask, global_len, heads, unit, what)
        return
    if not isinstance(tile_mask, STRUCTURED_MASKS):
        raise TypeError(
            f"{fn}: `mask` must be a kernels.SlidingTileMask, a kernels.BlockCausalMask or "
            f"None; received {type(tile_mask).__name__}."
        )
    tile_mask.check_heads(heads, fn)
    need = tile_mask.seq_len if what == "sequence" else tile_mask.video_len
    tiles = isinstance(tile_mask, kernels.SlidingTileMask)
    slack = unit * (tile_mask.tile_size if tiles else 1)
    if not need <= global_len < need + slack:
        raise ValueError(
            f"{fn}: the {type(tile_mask).__name__} lays out {need} tokens ({what}; {tile_mask!r}), "
            f"but the devices hold "
            f"{global_len} in all (sp_size x local length). The global {what} must be the "
            f"mask's, padded at the end by fewer than {slack} tokens "
            f"({'pad to whole tiles per device; ' if tiles else ''}padding is invisible)."
        )


TEXT_POSITIONS = ("prefix", "suffix")


def check_text_position(fn: str, text_position) -> str:
    """`text_position`, or a `ValueError` unless it is `"prefix"` or `"suffix"`."""
    if not isinstance(text_position, str) or text_position not in TEXT_POSITIONS:
        raise ValueError(
            f"{fn}: `text_position` must be one of {TEXT_POSITIONS} (where the replicated text "
            f"sits in each device's arrays: before or after its video chunk); received "
            f"{text_position!r}."
        )
    return text_position


def check_lengths(fn: str, name: str, lengths, B: int, upper: int, what: str):
    """`lengths` as an int32 `(B,)` array (or `None`): integers, and, when concrete, within
    `[0, upper]`; otherwise a `ValueError` naming `name`. `what` says what `upper` counts."""
    if lengths is None:
        return None
    shape = jnp.shape(lengths)
    dtype = getattr(lengths, "dtype", None)
    if dtype is None:
        dtype = np.asarray(lengths).dtype
    if shape != (B,) or not jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_):
        raise ValueError(
            f"{fn}: `{name}` must be an integer array of shape (B,) = ({B},), one count per batch "
            f"element; received dtype {dtype}, shape {shape}."
        )
    if not isinstance(lengths, jax.core.Tracer):
        values = np.asarray(lengths).astype(np.int64)
        if values.size and (values.min() < 0 or values.max() > upper):
            raise ValueError(
                f"{fn}: `{name}` must lie in [0, {upper}] ({what}); received "
                f"{values.tolist()}."
            )
    return jnp.asarray(lengths).astype(jnp.int32)


def check_no_text_lengths(fn: str, text_lengths) -> None:
    """A `ValueError` when `text_lengths` is given without a joint layout (`text_len=0`)."""
    if text_lengths is not None:
        raise ValueError(
            f"{fn}: `text_lengths` pads the text of the joint layout, which needs text_len > 0; "
            f"received text_lengths with text_len=0. Use `kv_lengths` (keys at a global index "
            "at or past it hidden) for key-only padding of a plain sequence."
        )
