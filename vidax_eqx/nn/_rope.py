"""Rotary position embedding: Wan's 3D tables and the adjacent-pair rotation."""

import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jaxtyping import Array, Float, jaxtyped


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def wan_rope_split(head_dim: int) -> tuple[int, int, int]:
    """Wan's split of `head_dim // 2` rotary pairs into (time, height, width) parts.

    With `c = head_dim // 2`: time gets `c - 2 * (c // 3)` pairs, height and width
    `c // 3` each (Wan's `rope_apply`; equivalently its `rope_params` dims
    `head_dim - 4 * (head_dim // 6)`, `2 * (head_dim // 6)`, `2 * (head_dim // 6)`).
    """
    c = head_dim // 2
    return (c - 2 * (c // 3), c // 3, c // 3)


def _angles(length: int, pairs: int, theta: float) -> np.ndarray:
    """Wan's `rope_params(length, 2 * pairs, theta)` angles, float64 `(length, pairs)`."""
    dim = 2 * pairs
    freqs = 1.0 / np.power(float(theta), np.arange(0, dim, 2, dtype=np.float64) / dim)
    return np.outer(np.arange(length, dtype=np.float64), freqs)


def rope_3d(
    grid: tuple[int, int, int],
    head_dim: int,
    theta: float = 10000.0,
    split: tuple[int, int, int] | None = None,
) -> tuple[Float[Array, "S half"], Float[Array, "S half"]]:
    """Wan's 3D rotary tables for a `(frames, height, width)` grid of video tokens.

    Rotary pair `i` of a token at grid position `(f, h, w)` turns by an angle that
    depends on one coordinate: the first `split[0]` pairs on `f`, the next
    `split[1]` on `h`, the last `split[2]` on `w`. A part of `n` pairs uses
    frequencies `1 / theta ** (arange(0, 2n, 2) / (2n))`, as Wan's `rope_params`.
    Tokens are ordered frame-major, then height, then width, as Wan flattens them.
    The tables are computed in float64 with NumPy (as the reference does) and
    returned in float32; `grid` must therefore be concrete Python ints.

    **Arguments:**

    - `grid`: `(frames, height, width)` of the token grid (after patchifying).
    - `head_dim`: the attention head size, even.
    - `theta`: the RoPE base.
    - `split`: `(t, h, w)` rotary pairs per axis, summing to `head_dim // 2`.
        Default: Wan's split, `c - 2 * (c // 3), c // 3, c // 3` with `c = head_dim // 2`.
        Models that split differently (CogVideoX) pass their own.

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
        or not all(_is_int(g) and g >= 1 for g in grid)
    ):
        raise ValueError(
            f"rope_3d: `grid` must be three positive ints (frames, height, width); received {grid!r}."
        )
    if not _is_int(head_dim) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"rope_3d: `head_dim` must be a positive even int; received {head_dim!r}.")
    c = head_dim // 2
    if split is None:
        split = wan_rope_split(head_dim)
    if (
        not isinstance(split, (tuple, list))
        or len(split) != 3
        or not all(_is_int(s) and s >= 0 for s in split)
        or sum(split) != c
    ):
        raise ValueError(
            "rope_3d: `split` must be three non-negative ints (time, height, width pairs) "
            f"summing to head_dim // 2 = {c}; received {split!r}."
        )
    f, h, w = (int(g) for g in grid)
    parts = [
        np.broadcast_to(_angles(f, split[0], theta)[:, None, None, :], (f, h, w, split[0])),
        np.broadcast_to(_angles(h, split[1], theta)[None, :, None, :], (f, h, w, split[1])),
        np.broadcast_to(_angles(w, split[2], theta)[None, None, :, :], (f, h, w, split[2])),
    ]
    angles = np.concatenate(parts, axis=-1).reshape(f * h * w, c)
    return (
        jnp.asarray(np.cos(angles).astype(np.float32)),
        jnp.asarray(np.sin(angles).astype(np.float32)),
    )


@jaxtyped(typechecker=beartype)
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
        xf = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
        x_e, x_o = xf[..., 0], xf[..., 1]
        c = cos.astype(jnp.float32)[:, None, :]
        s = sin.astype(jnp.float32)[:, None, :]
        out = jnp.stack([x_e * c - x_o * s, x_e * s + x_o * c], axis=-1)
        return out.reshape(x.shape).astype(x.dtype)
