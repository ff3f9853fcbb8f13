"""Position embeddings of video tokens: 3D rotary tables (Wan, CogVideoX), the
adjacent-pair rotation, and CogVideoX-2B's 3D sin-cos embedding."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._shapes import checked
from .._checks import is_int


Rope = tuple[Float[Array, "S {self.head_dim//2}"], Float[Array, "S {self.head_dim//2}"]]
"""The annotation of an attention layer's `rope` argument: `(cos, sin)`, each
`(S, head_dim // 2)`, for this device's tokens, as `rope_3d` returns them."""


def wan_rope_split(head_dim: int) -> tuple[int, int, int]:
    """Wan's split of `head_dim // 2` rotary pairs into (time, height, width) parts.

    With `c = head_dim // 2`: time gets `c - 2 * (c // 3)` pairs, height and width
    `c // 3` each (Wan's `rope_apply`; equivalently its `rope_params` dims
    `head_dim - 4 * (head_dim // 6)`, `2 * (head_dim // 6)`, `2 * (head_dim // 6)`).
    """
    c = head_dim // 2
    return (c - 2 * (c // 3), c // 3, c // 3)


@functools.partial(jax.jit, static_argnames="axes")
def _grid_tables(tables, axes):
    """Per-axis tables expanded over a `(frames, height, width)` token grid, in-program.

    `tables[i]` is `(k, n, c_i)`: `k` tables over the `n` positions of grid axis
    `axes[i]`; each is broadcast over the other two grid axes and the parts are
    concatenated on the feature axis in the given order. Returns `k` arrays of shape
    `(frames * height * width, sum(c_i))`, frame-major. A feature that depends on one
    coordinate is the same number whether it is expanded before or after its
    elementwise function, so the result is bitwise the table computed over the whole
    grid; but the program holds O((f + h + w) * c) constants instead of O(f h w c)
    (what `jax.export` serializes; `jax.jit` traces the expansion, not a dense table).
    """
    sizes = [1, 1, 1]
    for t, a in zip(tables, axes):
        sizes[a] = t.shape[1]
    parts = []
    for t, a in zip(tables, axes):
        index = [None, None, None]
        index[a] = slice(None)
        expanded = t[(slice(None), *index, slice(None))]
        parts.append(jnp.broadcast_to(expanded, (t.shape[0], *sizes, t.shape[-1])))
    out = jnp.concatenate(parts, axis=-1).reshape(tables[0].shape[0], math.prod(sizes), -1)
    return tuple(out[i] for i in range(out.shape[0]))


def _angles(positions: np.ndarray, pairs: int, theta: float) -> np.ndarray:
    """Wan's `rope_params` angles at `positions`, float64 `(len(positions), pairs)`."""
    dim = 2 * pairs
    freqs = 1.0 / np.power(float(theta), np.arange(0, dim, 2, dtype=np.float64) / dim)
    return np.outer(np.asarray(positions, np.float64), freqs)


def rope_3d(
    grid: tuple[int, int, int],
    head_dim: int,
    theta: float = 10000.0,
    split: tuple[int, int, int] | None = None,
    positions=None,
    *,
    frame_offset=None,
    max_frames: int | None = None,
) -> tuple[Float[Array, "S half"], Float[Array, "S half"]]:
    """3D rotary tables for a `(frames, height, width)` grid of video tokens (Wan, CogVideoX).

    Rotary pair `i` of a token at grid position `(f, h, w)` turns by an angle that
    depends on one coordinate: the first `split[0]` pairs on `f`, the next
    `split[1]` on `h`, the last `split[2]` on `w`. A part of `n` pairs uses
    frequencies `1 / theta ** (arange(0, 2n, 2) / (2n))`, as Wan's `rope_params`
    and diffusers' `get_1d_rotary_pos_embed`. Tokens are ordered frame-major, then
    height, then width, as Wan and CogVideoX flatten them. The cosines and sines
    of each axis are computed in float64 with NumPy and rounded to float32 (tiny
    `(n, pairs)` tables); the `(S, head_dim // 2)` tables are these expanded over
    the grid by the program, so a traced or exported program (`jax.export`) holds
    no constant that grows with the token count. `grid` must be concrete Python ints.

    **Arguments:**

    - `grid`: `(frames, height, width)` of the token grid (after patchifying).
    - `head_dim`: the attention head size, even.
    - `theta`: the RoPE base.
    - `split`: `(t, h, w)` rotary pairs per axis, summing to `head_dim // 2`.
        Default: Wan's split, `c - 2 * (c // 3), c // 3, c // 3` with `c = head_dim // 2`.
        CogVideoX's is `(head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16)`.
    - `positions`: the coordinate of each grid index along each axis, three 1-D
        arrays of lengths `grid` (floats allowed: CogVideoX places its tokens on a
        crop of a base-resolution grid); default `arange` on every axis (Wan).
    - `frame_offset`: a chunk of a longer video (streaming generation): the frames
        are `frame_offset + arange(frames)`, an int scalar that may be traced (one
        program for every chunk); needs `max_frames` and no `positions`. The frame
        axis's table is computed for `arange(max_frames)` and the chunk's rows sliced
        from it, so the tables are bitwise those of the whole video's grid. A chunk
        past `max_frames` is clamped to its last frames (as `lax.dynamic_slice`):
        callers check the bound (the models' `stream` does).
    - `max_frames`: the frames the table covers with `frame_offset` (a model's
        `rope_max_seq_len`).

    **Returns:**

    `(cos, sin)`, each float32 `(frames * height * width, head_dim // 2)`, for
    [`apply_rope`][].
    """
    if isinstance(grid, (tuple, list)) and any(isinstance(g, jax.Array) for g in grid):
        raise ValueError(
            "rope_3d: `grid` must be concrete Python ints: the tables are computed in NumPy "
            f"when the function is traced; received {grid!r}. Under `jax.jit` pass the grid "
            "as a static argument (`static_argnums`) or close over it; compute the tables "
            "outside `jax.vmap`."
        )
    if (
        not isinstance(grid, (tuple, list))
        or len(grid) != 3
        or not all(is_int(g) and g >= 1 for g in grid)
    ):
        raise ValueError(
            f"rope_3d: `grid` must be three positive ints (frames, height, width); received {grid!r}."
        )
    if not is_int(head_dim) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"rope_3d: `head_dim` must be a positive even int; received {head_dim!r}.")
    c = head_dim // 2
    if split is None:
        split = wan_rope_split(head_dim)
    if (
        not isinstance(split, (tuple, list))
        or len(split) != 3
        or not all(is_int(s) and s >= 0 for s in split)
        or sum(split) != c
    ):
        raise ValueError(
            "rope_3d: `split` must be three non-negative ints (time, height, width pairs) "
            f"summing to head_dim // 2 = {c}; received {split!r}."
        )
    f, h, w = (int(g) for g in grid)
    if frame_offset is not None:
        if positions is not None or not is_int(max_frames) or max_frames < f:
            raise ValueError(
                "rope_3d: `frame_offset` takes `max_frames` (an int >= frames, the frames its "
                f"table covers) and no `positions`; received max_frames={max_frames!r}, "
                f"positions={'given' if positions is not None else None}, grid={grid!r}."
            )
        frames = jax.lax.dynamic_slice_in_dim(
            jnp.asarray(_cos_sin(np.arange(max_frames), split[0], theta)),
            jnp.asarray(frame_offset, jnp.int32), f, axis=1)
        tables = (frames, *(_cos_sin(np.arange(n), m, theta) for n, m in zip((h, w), split[1:])))
        return _grid_tables(tables, (0, 1, 2))
    if positions is None:
        positions = tuple(np.arange(n) for n in (f, h, w))
    positions = tuple(np.asarray(p, np.float64) for p in positions)
    if len(positions) != 3 or any(p.shape != (n,) for p, n in zip(positions, (f, h, w))):
        raise ValueError(
            f"rope_3d: `positions` must be three 1-D arrays of lengths grid = {(f, h, w)}; "
            f"received shapes {[np.shape(p) for p in positions]}."
        )
    # cos / sin of each axis's angles (float64 NumPy, tiny), expanded over the grid in
    # the program: the (S, c) tables are never constants of a traced or exported program.
    tables = tuple(_cos_sin(p, n, theta) for p, n in zip(positions, split))
    return _grid_tables(tables, (0, 1, 2))


def _cos_sin(positions, pairs: int, theta: float) -> np.ndarray:
    """float32 `(2, len(positions), pairs)`: the cosines and sines of `_angles`."""
    a = _angles(positions, pairs, theta)
    return np.stack([np.cos(a), np.sin(a)]).astype(np.float32)


@checked
def apply_rope(
    x: Float[Array, "*batch S H D"],
    cos: Float[Array, "S D//2"],
    sin: Float[Array, "S D//2"],
) -> Float[Array, "*batch S H D"]:
    """Rotates adjacent feature pairs of `x` by the angles whose cosines and sines are given.

    Pair `i` is `(x[..., 2i], x[..., 2i + 1])`, as in Wan (`view_as_complex` of
    `(..., D/2, 2)`) and CogVideoX: `out[2i] = x[2i] cos - x[2i+1] sin`,
    `out[2i+1] = x[2i] sin + x[2i+1] cos`, the same for every head. The rotation
    is computed in float32 (Wan uses float64; float32 is this library's choice)
    and cast back to `x`'s dtype.

    **Arguments:**

    - `x`: `(..., S, H, D)` with the heads axis before `D` (`D` even).
    - `cos`, `sin`: `(S, D // 2)` tables, e.g. from [`rope_3d`][].

    **Returns:**

    The rotated array, `x`'s shape and dtype.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"apply_rope: the last axis of `x` must be even; received shape {x.shape}.")
    with jax.named_scope("vidax_eqx.apply_rope"):
        return jax.lax.platform_dependent(x, cos, sin, default=_rope_pairs, tpu=_rope_lanes)


def _rope_pairs(x, cos, sin):
    """`apply_rope` over the `(..., D/2, 2)` view of the pairs."""
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    x_e, x_o = xf[..., 0], xf[..., 1]
    c = cos.astype(jnp.float32)[:, None, :]
    s = sin.astype(jnp.float32)[:, None, :]
    out = jnp.stack([x_e * c - x_o * s, x_e * s + x_o * c], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def _rope_lanes(x, cos, sin):
    """`apply_rope` along the feature axis as it is, for the TPU, where the `(..., D/2, 2)`
    view's two-wide minor axis costs relayout copies. Each feature's pair partner
    (`-x[2i+1]` at `2i`, `x[2i]` at `2i+1`) comes from a product with a fixed signed
    permutation (exact at the highest precision: one nonzero of magnitude 1 per column),
    and the tables are repeated per pair: the products and sums of `_rope_pairs`, to
    float32 rounding."""
    D = x.shape[-1]
    xf = x.astype(jnp.float32)
    swap = np.zeros((D, D), np.float32)
    swap[np.arange(1, D, 2), np.arange(0, D, 2)] = -1.0  # partner[2i] = -x[2i+1]
    swap[np.arange(0, D, 2), np.arange(1, D, 2)] = 1.0  # partner[2i+1] = x[2i]
    partner = jnp.matmul(xf, jnp.asarray(swap), precision=jax.lax.Precision.HIGHEST)
    c = jnp.repeat(cos.astype(jnp.float32), 2, axis=-1)[:, None, :]
    s = jnp.repeat(sin.astype(jnp.float32), 2, axis=-1)[:, None, :]
    return (xf * c + partner * s).astype(x.dtype)


def _sincos(positions: np.ndarray, dim: int) -> np.ndarray:
    """`[sin(p * w), cos(p * w)]` with `w = 10000 ** -(arange(dim / 2) / (dim / 2))`, float64."""
    omega = 1.0 / 10000.0 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
    angles = np.outer(np.asarray(positions, np.float64), omega)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)


def sincos_embedding_3d(
    grid: tuple[int, int, int],
    dim: int,
    *,
    spatial_interpolation_scale: float = 1.0,
    temporal_interpolation_scale: float = 1.0,
) -> Float[Array, "S dim"]:
    """The fixed 3D sin-cos position embedding of CogVideoX-2B (diffusers'
    `get_3d_sincos_pos_embed`), added to the video tokens after the patch embedding.

    With `t, y, x` a token's frame, row and column divided by their interpolation
    scale: features `[sincos_{dim/4}(t), sincos_{3dim/8}(x), sincos_{3dim/8}(y)]`,
    where `sincos_n(p)` is `[sin(p * w), cos(p * w)]` over `n / 2` frequencies
    `w_i = 10000 ** (-i / (n / 2))` (the column coordinate comes first in the
    spatial part, as diffusers' `meshgrid(..., indexing="xy")` puts it). Tokens
    frame-major, then row, then column. Each axis's part is computed in float64 with
    NumPy and rounded to float32; the program expands them over the grid (no
    `(S, dim)` constant in a traced or exported program). `grid` must be concrete ints.

    **Arguments:**

    - `grid`: `(frames, height, width)` of the token grid (after patchifying).
    - `dim`: the embedding width, a multiple of 16.
    - `spatial_interpolation_scale`, `temporal_interpolation_scale`: the coordinates'
        divisors (CogVideoX: 1.875 and 1.0).

    **Returns:**

    float32 `(frames * height * width, dim)`.
    """
    if (
        not isinstance(grid, (tuple, list))
        or len(grid) != 3
        or not all(is_int(g) and g >= 1 for g in grid)
    ):
        raise ValueError(
            "sincos_embedding_3d: `grid` must be three positive Python ints (frames, height, "
            f"width), concrete when traced; received {grid!r}."
        )
    if not is_int(dim) or dim < 16 or dim % 16:
        raise ValueError(f"sincos_embedding_3d: `dim` must be a positive multiple of 16; received {dim!r}.")
    f, h, w = (int(g) for g in grid)
    spatial = 3 * dim // 4
    temporal = _sincos(np.arange(f) / temporal_interpolation_scale, dim // 4)  # (f, dim/4)
    cols = _sincos(np.arange(w) / spatial_interpolation_scale, spatial // 2)  # (w, 3dim/8)
    rows = _sincos(np.arange(h) / spatial_interpolation_scale, spatial // 2)  # (h, 3dim/8)
    # Per-axis tables expanded over the grid in the program (no (S, dim) constant).
    tables = tuple(t[None].astype(np.float32) for t in (temporal, cols, rows))
    return _grid_tables(tables, (0, 2, 1))[0]
