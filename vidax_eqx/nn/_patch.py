"""Video patches <-> tokens: the patch embedding of video DiTs and its inverse."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._shapes import checked
from .._checks import check_positive
from .sharding._fsdp import fsdp_gather
from . import _init as init


def _check_patch(owner: str, patch_size) -> tuple[int, int, int]:
    if (
        not isinstance(patch_size, (tuple, list))
        or len(patch_size) != 3
        or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 1 for p in patch_size)
    ):
        raise ValueError(
            f"{owner}: `patch_size` must be three positive ints (frames, height, width); "
            f"received {patch_size!r}."
        )
    return tuple(patch_size)


def patch_grid(shape, patch_size, owner: str = "patch_grid") -> tuple[int, int, int]:
    """The token grid `(F / pt, H / ph, W / pw)` of a `(C, F, H, W)` video.

    Raises where a dimension is not a multiple of its patch size (a `Conv3d` would
    silently drop the remainder).
    """
    pt, ph, pw = _check_patch(owner, patch_size)
    _, f, h, w = shape
    if f % pt or h % ph or w % pw:
        raise ValueError(
            f"{owner}: the video's (frames, height, width) = {(f, h, w)} must be multiples of "
            f"patch_size {(pt, ph, pw)}; crop or pad the latents first."
        )
    return f // pt, h // ph, w // pw


class PatchEmbedding(eqx.Module):
    """The patch embedding of video DiTs: a `Conv3d` whose kernel equals its stride
    (Wan), or a `Conv2d` applied to every frame (CogVideoX).

    Computed as what it is, one linear map per non-overlapping `(pt, ph, pw)` patch:
    the video `(C, F, H, W)` is cut into patches, each flattened in `(C, pt, ph, pw)`
    order, and multiplied by `weight` reshaped to `(dim, C * pt * ph * pw)`. The
    weight keeps the convolution's shape, `(dim, C, pt, ph, pw)` for a 3-tuple
    `patch_size` and `(dim, C, ph, pw)` for a 2-tuple (`pt = 1`), so the reference's
    weight loads as is. Tokens come out frame-major, then height, then width
    (`flatten(2).transpose(1, 2)` of the reference).

    **Fields:** `weight` `(dim, in_channels, *patch_size)`, `bias` `(dim,)`; static
    `in_channels`, `dim`, `patch_size` (as given: 2 or 3 ints).
    """

    weight: Float[Array, "dim C *patch"]
    bias: Float[Array, " dim"]
    in_channels: int = eqx.field(static=True)
    dim: int = eqx.field(static=True)
    patch_size: tuple[int, ...] = eqx.field(static=True)

    def __init__(self, in_channels: int, dim: int, patch_size=(1, 2, 2), *, dtype=jnp.float32,
                 key: PRNGKeyArray):
        """**Arguments:**

        - `in_channels`: the latent channels `C`.
        - `dim`: the token width.
        - `patch_size`: `(pt, ph, pw)` (a `Conv3d`), or `(ph, pw)` (a per-frame `Conv2d`).
        - `dtype`: the parameters' dtype.
        - `key`: a PRNG key for the initialization (PyTorch's convolution default).
        """
        check_positive("PatchEmbedding", in_channels=in_channels, dim=dim)
        if isinstance(patch_size, (tuple, list)) and len(patch_size) == 2:
            patch_size = _check_patch("PatchEmbedding", (1, *patch_size))[1:]
        else:
            patch_size = _check_patch("PatchEmbedding", patch_size)
        fan_in = in_channels * math.prod(patch_size)
        bound = 1 / fan_in**0.5
        kw, kb = init.split(key)
        shape = (dim, in_channels, *patch_size)
        self.weight = init.uniform(kw, shape, dtype, bound)
        self.bias = init.uniform(kb, (dim,), dtype, bound)
        self.in_channels, self.dim, self.patch_size = in_channels, dim, patch_size

    @checked
    def __call__(self, x: Float[Array, "{self.in_channels} F H W"]) -> Float[Array, "S {self.dim}"]:
        """**Arguments:**

        - `x`: one video `(C, F, H, W)`, each of `F, H, W` a multiple of its patch size.

        **Returns:**

        The tokens `(F/pt * H/ph * W/pw, dim)` in the weight's dtype (`x` is cast to it,
        as a `Conv3d` needs).
        """
        with jax.named_scope("vidax_eqx.nn.PatchEmbedding"):
            self, x = fsdp_gather(self, x)
            return self.project(patchify(x.astype(self.weight.dtype), self.patch_3d))

    @property
    def patch_3d(self) -> tuple[int, int, int]:
        """`(pt, ph, pw)`: `patch_size`, with `pt = 1` for a per-frame `Conv2d`."""
        return self.patch_size if len(self.patch_size) == 3 else (1, *self.patch_size)

    @checked
    def project(self, patches: Float[Array, "S P"]) -> Float[Array, "S {self.dim}"]:
        """The embedding of patches already cut by [`vidax_eqx.nn.functional.patchify`][].

        `__call__` is `project(patchify(x))`. A sequence-parallel model cuts the whole
        video into patches (cheap: `C * pt * ph * pw` values per token), takes its own
        share of them, and projects only those: no device holds the `(S, dim)` tokens
        of the whole video.

        **Arguments:**

        - `patches`: `(S, in_channels * pt * ph * pw)`.

        **Returns:**

        `(S, dim)` in the weight's dtype.
        """
        self, patches = fsdp_gather(self, patches)
        if patches.shape[1] != self.weight[0].size:
            raise ValueError(
                f"PatchEmbedding.project: `patches` must have in_channels * pt * ph * pw = "
                f"{self.weight[0].size} columns; received shape {patches.shape}."
            )
        with jax.named_scope("vidax_eqx.nn.PatchEmbedding"):
            patches = patches.astype(self.weight.dtype)
            return patches @ self.weight.reshape(self.dim, -1).T + self.bias


@checked
def patchify(x: Float[Array, "C F H W"], patch_size: tuple[int, int, int]) -> Float[Array, "S P"]:
    """A video `(C, F, H, W)` cut into non-overlapping `(pt, ph, pw)` patches.

    Patches in frame-major token order, each flattened in `(C, pt, ph, pw)` order (the
    order of a `Conv3d` weight's input axes); the inverse layout of [`unpatchify`][] is
    `(pt, ph, pw, C)`, as the models' output projections produce it.

    **Arguments:**

    - `x`: one video, each of `F, H, W` a multiple of its patch size.
    - `patch_size`: `(pt, ph, pw)`.

    **Returns:**

    `(F/pt * H/ph * W/pw, C * pt * ph * pw)`.
    """
    f, h, w = patch_grid(x.shape, patch_size, "patchify")
    pt, ph, pw = patch_size
    c = x.shape[0]
    x = x.reshape(c, f, pt, h, ph, w, pw).transpose(1, 3, 5, 0, 2, 4, 6)
    return x.reshape(f * h * w, c * pt * ph * pw)


@checked
def unpatchify(
    tokens: Float[Array, "S D"],
    grid: tuple[int, int, int],
    patch_size: tuple[int, int, int],
    *,
    channels_first: bool = False,
) -> Float[Array, "C F H W"]:
    """The inverse of the patch layout: tokens `(S, C * pt * ph * pw)` -> video `(C, F, H, W)`.

    Token `(f, h, w)` (frame-major order) holds its patch's values in `(pt, ph, pw, C)`
    order, as Wan's `head` and diffusers' Wan `proj_out` produce them, or in
    `(C, pt, ph, pw)` order with `channels_first=True` (CogVideoX's `proj_out`).

    **Arguments:**

    - `tokens`: `(F' * H' * W', C * pt * ph * pw)`.
    - `grid`: `(F', H', W')`, the token grid.
    - `patch_size`: `(pt, ph, pw)`.
    - `channels_first`: the order of each token's values, as above.

    **Returns:**

    `(C, F' * pt, H' * ph, W' * pw)`.
    """
    f, h, w = grid
    pt, ph, pw = _check_patch("unpatchify", patch_size)
    patch = pt * ph * pw
    if tokens.shape[0] != f * h * w or tokens.shape[1] % patch:
        raise ValueError(
            f"unpatchify: `tokens` must be (F*H*W, C*pt*ph*pw) = ({f * h * w}, C*{patch}) for "
            f"grid {grid} and patch_size {patch_size}; received {tokens.shape}."
        )
    c = tokens.shape[1] // patch
    if channels_first:
        x = tokens.reshape(f, h, w, c, pt, ph, pw).transpose(3, 0, 4, 1, 5, 2, 6)
    else:
        x = tokens.reshape(f, h, w, pt, ph, pw, c).transpose(6, 0, 3, 1, 4, 2, 5)
    return x.reshape(c, f * pt, h * ph, w * pw)
