"""`CogVideoXVAE`: CogVideoX's video VAE (diffusers' `AutoencoderKLCogVideoX`), one example
per call, time in diffusers' chunks through a `lax.scan`, space split over a mesh or
tiled."""

import os
from collections.abc import Hashable

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from ...nn import CausalConv3d
from ...nn import internal as nn_internal
from ...parallel import SpatialSplit
from .._base import AbstractVideoVAE
from .._vae import (
    blend_tiles, check_latents, check_one_device, check_split, check_tiling, check_video,
    checkpoint_path, CONFIG_FILE, GaussianPosterior, load_vae, posterior, run_blocks,
    run_chunked, save_vae, Tiling,
)
from ._blocks import CogVideoXDecoder3D, CogVideoXEncoder3D
from ._config import CogVideoXVAEConfig


# diffusers' `num_sample_frames_batch_size` and `num_latent_frames_batch_size`: the frames
# of one chunk, whose GroupNorm statistics they share (so part of the numbers).
SAMPLE_FRAMES, LATENT_FRAMES = 8, 2


def first_chunk(frames: int, batch: int) -> int:
    """The frames of diffusers' first chunk: `batch` plus the remainder of `frames` over
    `batch`, or all of them when there are fewer than `batch`; the rest come `batch` at a
    time."""
    return batch + frames % batch if frames >= batch else frames


class CogVideoXVAE(AbstractVideoVAE):
    """CogVideoX's video VAE (diffusers' `AutoencoderKLCogVideoX`; CogVideoX 1.0's 2B and 5B,
    CogVideoX 1.5 with its config).

    One example per call, channels first: a video `(3, F, H, W)` in [-1, 1] with
    `F = 1 + 4k` encodes to latents `(latent_channels, 1 + k, H / 8, W / 8)`, and back.
    Time runs in diffusers' chunks (8 video frames, 2 latent frames, the first chunk
    taking the remainder too), the causal convolutions' caches carried through a
    `lax.scan`. Every GroupNorm's statistics span a chunk's frames, so the chunks are part
    of the result and there is no `chunk` option. With `mesh` and `spatial_axes`, every
    frame is split over two mesh axes (height and width): each convolution exchanges its
    edge rows with its neighbours and each GroupNorm sums its statistics over the
    devices; the result equals one device's to float32 round-off. `tiling=` reproduces
    diffusers' tiled mode.

    Parameter names are diffusers' (`interop.load_state_dict` loads its state dict as
    it is). The pipelines scale the latents by
    [`scaling_factor`][vidax_eqx.models.CogVideoXVAE.scaling_factor]
    ([`normalize_latents`][vidax_eqx.models.CogVideoXVAE.normalize_latents]); encode and
    decode do not.
    """

    encoder: CogVideoXEncoder3D
    decoder: CogVideoXDecoder3D
    quant_conv: CausalConv3d | None
    post_quant_conv: CausalConv3d | None
    config: CogVideoXVAEConfig = eqx.field(static=True)

    def __init__(self, config: CogVideoXVAEConfig | None = None, *, dtype=jnp.float32, key):
        """**Arguments:**

        - `config`: the architecture (default: CogVideoX-2b's,
            [`CogVideoXVAEConfig.cogvideox_2b`][]).
        - `dtype`: the parameters' dtype.
        - `key`: a PRNG key for the random initial weights.
        """
        config = CogVideoXVAEConfig() if config is None else config
        if not isinstance(config, CogVideoXVAEConfig):
            raise ValueError(f"CogVideoXVAE: `config` must be a CogVideoXVAEConfig; received "
                             f"{type(config).__name__}.")
        k1, k2, k3, k4 = nn_internal.init.split(key, 4)
        self.config = config
        self.encoder = CogVideoXEncoder3D(config, dtype=dtype, key=k1)
        self.decoder = CogVideoXDecoder3D(config, dtype=dtype, key=k2)
        out = config.out_channels  # diffusers sizes both by out_channels
        self.quant_conv = (CausalConv3d(2 * out, 2 * out, 1, dtype=dtype, key=k3)
                           if config.use_quant_conv else None)
        self.post_quant_conv = (CausalConv3d(out, out, 1, dtype=dtype, key=k4)
                                if config.use_post_quant_conv else None)

    @property
    def z_dim(self) -> int:
        """Latent channels (`latent_channels`)."""
        return self.config.latent_channels

    def normalize_latents(self, latents: Float[Array, "z F h w"]) -> Float[Array, "z F h w"]:
        """`(latents - shift_factor) * scaling_factor` (no shift in CogVideoX's configs):
        the encoder's latents as the transformer takes them (diffusers' CogVideoX
        pipelines; CogVideoX 1.5's `invert_scale_latents` concerns the image-to-video
        pipeline's image latents and is not applied here)."""
        shift = self.config.shift_factor or 0.0
        return ((latents - shift) * self.config.scaling_factor).astype(latents.dtype)

    def denormalize_latents(self, latents: Float[Array, "z F h w"]) -> Float[Array, "z F h w"]:
        """`latents / scaling_factor + shift_factor`: the transformer's latents as the
        decoder takes them."""
        shift = self.config.shift_factor or 0.0
        return (latents / self.config.scaling_factor + shift).astype(latents.dtype)

    @property
    def scaling_factor(self) -> float:
        """The config's `scaling_factor`: the transformer takes `latents * scaling_factor`
        and the decoder `latents / scaling_factor` (diffusers' CogVideoX pipelines)."""
        return self.config.scaling_factor

    # -- encode / decode ------------------------------------------------------------------

    def encode(self, video: Float[Array, "C F H W"], *, mesh=None,
               spatial_axes: tuple[Hashable | None, Hashable | None] | None = None,
               tiling: Tiling | None = None) -> GaussianPosterior:
        """The posterior over the latents of `video`.

        **Arguments:**

        - `video`: one video `(3, F, H, W)` in [-1, 1], `F = 1 + 4k`, `H` and `W`
            multiples of 8.
        - `mesh`, `spatial_axes`: split every frame's height and width over the mesh axes
            `(height_axis, width_axis)` (either may be `None`); each device's block must
            be a whole number of latent pixels. The posterior comes back placed over the
            mesh the same way.
        - `tiling`: diffusers' tiled encode ([`Tiling`][vidax_eqx.models.Tiling]; see
            [`tiling`][vidax_eqx.models.CogVideoXVAE.tiling] for diffusers' defaults and
            overlap factors), one device.

        **Returns:**

        A [`GaussianPosterior`][vidax_eqx.models.GaussianPosterior]: `mean`, `logvar`,
        `sample(key)`, each `(latent_channels, 1 + k, H / 8, W / 8)`.
        """
        owner = "CogVideoXVAE.encode"
        check_video(owner, video, channels=self.config.in_channels,
                    temporal_factor=self.temporal_factor, spatial_factor=self.spatial_factor)
        tiling = check_one_device(owner, tiling, mesh)
        if tiling is not None:
            return self._tiled_encode(video, tiling)
        split = check_split(owner, mesh, spatial_axes, video.shape[2], video.shape[3],
                            self.config.spatial_factor, "video")
        return posterior(run_blocks(self, video, mesh, split, "encode"))

    def decode(self, latents: Float[Array, "z T h w"], *, mesh=None,
               spatial_axes: tuple[Hashable | None, Hashable | None] | None = None,
               tiling: Tiling | None = None) -> Float[Array, "C F H W"]:
        """The video of `latents` (not clamped, as diffusers').

        **Arguments:**

        - `latents`: `(latent_channels, T, h, w)`, unscaled (divide the transformer's by
            [`scaling_factor`][vidax_eqx.models.CogVideoXVAE.scaling_factor]).
        - `mesh`, `spatial_axes`: as for [`encode`][vidax_eqx.models.CogVideoXVAE.encode];
            the latents' height and width must divide among the axes' devices. The video
            comes back placed over the mesh.
        - `tiling`: diffusers' tiled decode ([`Tiling`][vidax_eqx.models.Tiling]), one device.

        **Returns:**

        The video `(3, F, 8 h, 8 w)`: `F = 1 + 4 (T - 1)` for an odd `T` (the usual case),
        `4 T` for an even `T` (diffusers' first chunk is then two whole latent frames).
        """
        owner = "CogVideoXVAE.decode"
        check_latents(owner, latents, channels=self.z_dim, name="latent_channels")
        tiling = check_one_device(owner, tiling, mesh)
        if tiling is not None:
            return self._tiled_decode(latents, tiling)
        split = check_split(owner, mesh, spatial_axes, latents.shape[2], latents.shape[3], 1, "latents")
        return run_blocks(self, latents, mesh, split, "decode")

    # The per-device bodies: `x` is this device's block of every frame.

    def _encode_block(self, video, split: SpatialSplit):
        def step(x, cache, first):
            return self.encoder(x, cache, split=split)

        frames = video.shape[1]
        moments = run_chunked(step, video, first=first_chunk(frames, SAMPLE_FRAMES), size=SAMPLE_FRAMES)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments, split=split)[0]
        return moments

    def _decode_block(self, latents, split: SpatialSplit):
        if self.post_quant_conv is not None:
            latents = self.post_quant_conv(latents, split=split)[0]

        def step(x, cache, first):
            return self.decoder(x, cache, split=split)

        frames = latents.shape[1]
        return run_chunked(step, latents, first=first_chunk(frames, LATENT_FRAMES), size=LATENT_FRAMES)

    # -- diffusers' tiled mode ------------------------------------------------------------

    def tiling(self, min_height: int | None = None, min_width: int | None = None,
               overlap_factor_height: float | None = None,
               overlap_factor_width: float | None = None) -> Tiling:
        """diffusers' `enable_tiling` of this VAE as a [`Tiling`][vidax_eqx.models.Tiling]:
        tiles of `min_height x min_width` video pixels (default: half the config's
        `sample_height` and `sample_width`, 240 x 360 for CogVideoX 1.0) overlapping by
        the factors (default 1/6 and 1/5), every stride `int(min * (1 - factor))`.

        **Raises:**

        `ValueError` unless the tiles, strides and blends diffusers derives from the
        factors for encode and decode are whole latent pixels that agree with one
        `Tiling` (they do for the defaults).
        """
        s = self.config.spatial_factor
        sizes = (min_height or self.config.sample_height // 2, min_width or self.config.sample_width // 2)
        factors = (overlap_factor_height or 1 / 6, overlap_factor_width or 1 / 5)
        strides = []
        for role, size, factor in zip(("height", "width"), sizes, factors):
            stride = int(size * (1 - factor))  # diffusers' expressions, in Python floats
            latent = int(size / s)
            ok = (size % s == 0 and stride % s == 0 and 0 < stride <= size
                  and latent - int(latent * factor) == stride // s          # encode's blend
                  and int(latent * (1 - factor)) == stride // s             # decode's stride
                  and size - int(size * factor) == stride)                  # decode's blend
            if not ok:
                raise ValueError(
                    f"CogVideoXVAE.tiling: a tile {size} pixels {role} overlapping by "
                    f"{factor!r} does not fall on whole latent pixels (diffusers' stride "
                    f"{stride}, spatial factor {s}); choose a {role} and factor whose stride "
                    f"and overlap are multiples of {s}.")
            strides.append(stride)
        return check_tiling("CogVideoXVAE.tiling", Tiling(*sizes, *strides))

    def _tiled_encode(self, video, tiling: Tiling) -> GaussianPosterior:
        h, w = video.shape[2:]
        s = self.config.spatial_factor
        if w <= tiling.min_width and h <= tiling.min_height:
            return self.encode(video)
        th, tw = tiling.min_height, tiling.min_width
        lat, stride = (th // s, tw // s), (tiling.stride_height // s, tiling.stride_width // s)
        rows = [[run_blocks(self, video[:, :, i:i + th, j:j + tw], None, SpatialSplit(), "encode")
                 for j in range(0, w, tiling.stride_width)]
                for i in range(0, h, tiling.stride_height)]
        moments = blend_tiles(rows, (lat[0] - stride[0], lat[1] - stride[1]), stride, (h // s, w // s))
        return posterior(moments)

    def _tiled_decode(self, latents, tiling: Tiling):
        s = self.config.spatial_factor
        h, w = latents.shape[2:]
        lat = (tiling.min_height // s, tiling.min_width // s)
        if w <= lat[1] and h <= lat[0]:
            return self.decode(latents)
        lat_stride = (tiling.stride_height // s, tiling.stride_width // s)
        stride = (tiling.stride_height, tiling.stride_width)
        blend = (tiling.min_height - stride[0], tiling.min_width - stride[1])
        rows = [[run_blocks(self, latents[:, :, i:i + lat[0], j:j + lat[1]], None, SpatialSplit(), "decode")
                 for j in range(0, w, lat_stride[1])]
                for i in range(0, h, lat_stride[0])]
        return blend_tiles(rows, blend, stride, (h * s, w * s))

    # -- checkpoints ----------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path, *, dtype=jnp.float32, mesh=None) -> "CogVideoXVAE":
        """A VAE from diffusers' `vae/` folder (`config.json` and
        `diffusion_pytorch_model.safetensors`, or its shards with the index). A Hub
        repository id works through [`vidax_eqx.interop.resolve_checkpoint`][].

        **Arguments:**

        - `path`: the folder.
        - `dtype`: the parameters' dtype (tensors of any float dtype are cast).
        - `mesh`: place the parameters on this mesh (replicated).

        **Raises:**

        `ValueError` naming every tensor that is missing, unexpected or of the wrong shape
        for the config.
        """
        path = checkpoint_path(path)
        config = CogVideoXVAEConfig.from_file(os.path.join(path, CONFIG_FILE))
        return load_vae(cls, config, path, dtype=dtype, mesh=mesh)

    def save_pretrained(self, path) -> None:
        """Writes diffusers' `vae/` layout: `config.json` and
        `diffusion_pytorch_model.safetensors` (diffusers' names)."""
        save_vae(self, path)
