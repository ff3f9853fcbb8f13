"""`WanVAE`: Wan 2.1's and 2.2's video VAE (diffusers' `AutoencoderKLWan`), one example
per call, time in chunks through a `lax.scan`, space split over a mesh or tiled."""

import os
from collections.abc import Hashable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ...nn import CausalConv3d
from ...nn import internal as nn_internal
from ...parallel import SpatialSplit
from .._base import AbstractVideoVAE
from .._vae import (
    blend_tiles, check_chunk, check_latents, check_one_device, check_split, check_video,
    checkpoint_path,
    CONFIG_FILE, FirstChunk, GaussianPosterior, load_vae, pad_frames, posterior, run_blocks,
    run_scanned, save_vae, Tiling, vae_jit,
)
from ._blocks import patchify, unpatchify, WanDecoder3d, WanEncoder3d
from ._config import WanVAEConfig
from ._names import checkpoint_name


class DecodeStream(eqx.Module):
    """The state of [`WanVAE.decode_stream`][vidax_eqx.models.WanVAE.decode_stream] between
    two chunks of a streamed decode: the decoder's causal time caches (the last frames
    each causal convolution and time upsampler needs), a PyTree of arrays of fixed size."""

    cache: object


class WanVAE(AbstractVideoVAE):
    """Wan 2.1's and Wan 2.2's video VAE (diffusers' `AutoencoderKLWan`; Wan's `WanVAE_`).

    One example per call, channels first: a video `(3, F, H, W)` in [-1, 1] with
    `F = 1 + 4k` encodes to latents `(z_dim, 1 + k, H / s, W / s)` (`s` = 8, or 16 for
    Wan 2.2), and back. Time runs in chunks (`chunk` latent frames per `lax.scan` step,
    the causal convolutions' caches carried explicitly; the first chunk, which Wan treats
    apart, runs in the same scan body, so the compiled program holds the model once
    whatever the chunk size); with `mesh` and
    `spatial_axes`, every frame is split over two mesh axes (height and width), each
    convolution exchanging its edge rows with its neighbours. Both equal the whole video
    on one device to float32 round-off; `tiling=` reproduces diffusers' tiled mode.

    Parameter names are diffusers' (`load_state_dict` / `state_dict` with
    `naming="diffusers"`), or for Wan 2.1 the original Wan names (`naming="wan"`).
    """

    encoder: WanEncoder3d
    quant_conv: CausalConv3d
    post_quant_conv: CausalConv3d
    decoder: WanDecoder3d
    config: WanVAEConfig = eqx.field(static=True)

    def __init__(self, config: WanVAEConfig | None = None, *, dtype=jnp.float32, key):
        """**Arguments:**

        - `config`: the architecture (default: Wan 2.1's, [`WanVAEConfig.wan21`][]).
        - `dtype`: the parameters' dtype.
        - `key`: a PRNG key for the random initial weights.
        """
        config = WanVAEConfig.wan21() if config is None else config
        if not isinstance(config, WanVAEConfig):
            raise ValueError(f"WanVAE: `config` must be a WanVAEConfig; received {type(config).__name__}.")
        k1, k2, k3, k4 = nn_internal.init.split(key, 4)
        self.config = config
        self.encoder = WanEncoder3d(config, dtype=dtype, key=k1)
        self.quant_conv = CausalConv3d(2 * config.z_dim, 2 * config.z_dim, 1, dtype=dtype, key=k2)
        self.post_quant_conv = CausalConv3d(config.z_dim, config.z_dim, 1, dtype=dtype, key=k3)
        self.decoder = WanDecoder3d(config, dtype=dtype, key=k4)

    @property
    def z_dim(self) -> int:
        """Latent channels."""
        return self.config.z_dim

    # -- latent statistics ----------------------------------------------------------------

    @property
    def latents_mean(self) -> jax.Array:
        """The config's per-channel latent mean `(z_dim,)` (the pipelines' normalisation)."""
        return self._stat("latents_mean")

    @property
    def latents_std(self) -> jax.Array:
        """The config's per-channel latent standard deviation `(z_dim,)`."""
        return self._stat("latents_std")

    def _stat(self, name):
        value = getattr(self.config, name)
        if value is None:
            raise ValueError(f"WanVAE: this config has no `{name}` (load the VAE's config.json "
                             "with from_pretrained, or give it to WanVAEConfig).")
        return jnp.asarray(value, jnp.float32)

    def normalize_latents(self, latents: Float[Array, "z F h w"]) -> Float[Array, "z F h w"]:
        """`(latents - mean) / std` per channel: the encoder's latents as the transformer
        takes them (diffusers' Wan pipelines)."""
        shape = (-1, 1, 1, 1)
        return ((latents - self.latents_mean.reshape(shape)) / self.latents_std.reshape(shape)
                ).astype(latents.dtype)

    def denormalize_latents(self, latents: Float[Array, "z F h w"]) -> Float[Array, "z F h w"]:
        """`latents * std + mean`: the transformer's latents as the decoder takes them."""
        shape = (-1, 1, 1, 1)
        return (latents * self.latents_std.reshape(shape) + self.latents_mean.reshape(shape)
                ).astype(latents.dtype)

    # -- encode / decode ------------------------------------------------------------------

    def encode(self, video: Float[Array, "C F H W"], *, chunk: int = 1, mesh=None,
               spatial_axes: tuple[Hashable | None, Hashable | None] | None = None,
               tiling: Tiling | None = None, max_frames: int | None = None) -> GaussianPosterior:
        """The posterior over the latents of `video`.

        **Arguments:**

        - `video`: one video `(3, F, H, W)` in [-1, 1], `F = 1 + 4k`, `H` and `W`
            multiples of the spatial factor.
        - `chunk`: latent frames per `lax.scan` step (memory against steps); any value
            gives the same result.
        - `mesh`, `spatial_axes`: split every frame's height and width over the mesh axes
            `(height_axis, width_axis)` (either may be `None`); each device's block must
            be a whole number of latent pixels. The posterior comes back placed over the
            mesh the same way.
        - `tiling`: diffusers' tiled encode ([`Tiling`][vidax_eqx.models.Tiling]), one device.
        - `max_frames`: run the program of a `max_frames`-frame video (`1 + 4k`, at least
            `F`; zero frames after the video, whose latents are cut off): one compiled
            program for every frame count up to it. The result is the same.

        **Returns:**

        A [`GaussianPosterior`][vidax_eqx.models.GaussianPosterior]: `mean`, `logvar`,
        `sample(key)`, each `(z_dim, 1 + k, H / s, W / s)`.
        """
        owner = "WanVAE.encode"
        check_video(owner, video, channels=self.config.video_channels,
                    temporal_factor=self.temporal_factor, spatial_factor=self.spatial_factor)
        chunk = check_chunk(owner, chunk)
        tiling = check_one_device(owner, tiling, mesh)
        if tiling is not None:
            return self._tiled_encode(video, tiling, chunk)
        split = check_split(owner, mesh, spatial_axes, video.shape[2], video.shape[3],
                            self.spatial_factor, "video")
        frames = video.shape[1]
        video = pad_frames(owner, video, max_frames, self.temporal_factor, "video frames")
        moments = run_blocks(self, video, mesh, split, "encode", chunk)
        if max_frames is not None:  # the padding's latents cut off
            moments = moments[:, :1 + (frames - 1) // self.temporal_factor]
        return posterior(moments)

    def decode(self, latents: Float[Array, "z T h w"], *, chunk: int = 1, mesh=None,
               spatial_axes: tuple[Hashable | None, Hashable | None] | None = None,
               tiling: Tiling | None = None, max_frames: int | None = None) -> Float[Array, "C F H W"]:
        """The video of `latents`, clamped to [-1, 1].

        **Arguments:**

        - `latents`: `(z_dim, T, h, w)` (not normalised: see
            [`denormalize_latents`][vidax_eqx.models.WanVAE.denormalize_latents]).
        - `chunk`: latent frames per `lax.scan` step.
        - `mesh`, `spatial_axes`: as for [`encode`][vidax_eqx.models.WanVAE.encode]; the
            latents' height and width must divide among the axes' devices. The video comes
            back placed over the mesh.
        - `tiling`: diffusers' tiled decode ([`Tiling`][vidax_eqx.models.Tiling]), one device.
        - `max_frames`: run the program of `max_frames` latent frames (at least `T`; zero
            latents after these, whose frames are cut off): one compiled program for every
            latent frame count up to it. The result is the same.

        **Returns:**

        The video `(3, 1 + 4 (T - 1), h s, w s)`.
        """
        owner = "WanVAE.decode"
        check_latents(owner, latents, channels=self.z_dim)
        chunk = check_chunk(owner, chunk)
        tiling = check_one_device(owner, tiling, mesh)
        if tiling is not None:
            return self._tiled_decode(latents, tiling, chunk)
        split = check_split(owner, mesh, spatial_axes, latents.shape[2], latents.shape[3], 1, "latents")
        frames = latents.shape[1]
        latents = pad_frames(owner, latents, max_frames, 1, "latent frames")
        video = run_blocks(self, latents, mesh, split, "decode", chunk)
        if max_frames is not None:  # the padding's frames cut off
            video = video[:, :1 + self.temporal_factor * (frames - 1)]
        return video

    def decode_stream(self, latents: Float[Array, "z T h w"], state: "DecodeStream | None" = None
                      ) -> tuple[Float[Array, "C F H W"], "DecodeStream"]:
        """The video of a chunk of latent frames, decoded as the chunks come (streaming
        generation): the decoder's causal time caches carried from one call to the next
        in `state`, so that the chunks' frames joined are the video of all the latents
        decoded at once ([`decode`][vidax_eqx.models.WanVAE.decode]), and the first
        frames can be written before the last latents exist.

        **Arguments:**

        - `latents`: the chunk's `(z_dim, T, h, w)` (not normalised).
        - `state`: `None` for the video's first chunk, then the state the previous
            call returned.

        **Returns:**

        `(video, state)`: the chunk's frames, clamped to [-1, 1] (`1 + 4 (T - 1)` for
        the first chunk, `4 T` after it; 4 is the temporal factor), and the state for
        the next chunk. One device; each call runs one latent frame per scan step (two
        programs in all: the first chunk's and the others').
        """
        owner = "WanVAE.decode_stream"
        check_latents(owner, latents, channels=self.z_dim)
        first = state is None
        if not (first or isinstance(state, DecodeStream)):
            raise ValueError(f"{owner}: `state` must be None (the first chunk) or the DecodeStream "
                             f"the previous call returned; received {type(state).__name__}.")
        split = SpatialSplit()
        x = self.post_quant_conv(latents, split=split)[0]

        def step(x, cache, is_first):
            return self.decoder(x, cache, first=FirstChunk(is_first, 1), split=split)

        if first:
            shapes = jax.eval_shape(lambda c: step(c, None, jnp.bool_(True))[1], x[:, :1])
            cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        else:
            cache = state.cache

        def body(cache, xs):
            frame, is_first = xs
            y, cache = step(frame[:, None], cache, is_first)
            return cache, y

        frames = jnp.moveaxis(x, 1, 0)
        is_first = (jnp.arange(x.shape[1]) == 0) & first
        cache, ys = jax.lax.scan(body, cache, (frames, is_first))
        out = jnp.moveaxis(ys, 0, 1)
        out = out.reshape(out.shape[0], -1, *out.shape[3:])
        if first:  # the first latent frame's group ends with the video's first frame
            out = out[:, self.temporal_factor - 1:]
        return jnp.clip(unpatchify(out, self.config.patch_size), -1.0, 1.0), DecodeStream(cache)

    # The per-device bodies: `x` is this device's block of every frame.

    def _encode_block(self, video, split: SpatialSplit, chunk: int):
        x = patchify(video, self.config.patch_size)
        tf = self.config.temporal_factor

        def step(x, cache, first):
            return self.encoder(x, cache, first=first, split=split)

        # tf - 1 zero frames in front: the first frame ends the first latent frame's group.
        moments = run_scanned(step, x, size=tf * chunk, latent_frames=chunk, lead=tf - 1,
                              out_lead=0, out_frames=1 + (x.shape[1] - 1) // tf)
        return self.quant_conv(moments, split=split)[0]

    def _decode_block(self, latents, split: SpatialSplit, chunk: int):
        x = self.post_quant_conv(latents, split=split)[0]
        out = _run_decoder(self, x, split, chunk)
        return jnp.clip(unpatchify(out, self.config.patch_size), -1.0, 1.0)

    # -- diffusers' tiled mode ------------------------------------------------------------

    def _tiled_encode(self, video, tiling: Tiling, chunk: int) -> GaussianPosterior:
        p = self.config.patch_size or 1
        x_h, x_w = video.shape[2] // p, video.shape[3] // p  # diffusers tiles the patched video
        factor = self.config.spatial_factor // p
        if x_w <= tiling.min_width and x_h <= tiling.min_height:
            return self.encode(video, chunk=chunk)
        th, tw = tiling.min_height, tiling.min_width
        lat = (th // factor, tw // factor)
        stride = (tiling.stride_height // factor, tiling.stride_width // factor)
        rows = []
        for i in range(0, x_h, tiling.stride_height):
            rows.append([run_blocks(self, video[:, :, i * p:(i + th) * p, j * p:(j + tw) * p],
                                    None, SpatialSplit(), "encode", chunk)
                         for j in range(0, x_w, tiling.stride_width)])
        moments = blend_tiles(rows, (lat[0] - stride[0], lat[1] - stride[1]), stride,
                              (x_h // factor, x_w // factor))
        return posterior(moments)

    def _tiled_decode(self, latents, tiling: Tiling, chunk: int):
        p = self.config.patch_size or 1
        s = self.config.spatial_factor
        h, w = latents.shape[2:]
        lat = (tiling.min_height // s, tiling.min_width // s)
        if w <= lat[1] and h <= lat[0]:
            return self.decode(latents, chunk=chunk)
        lat_stride = (tiling.stride_height // s, tiling.stride_width // s)
        stride = (tiling.stride_height // p, tiling.stride_width // p)
        blend = (tiling.min_height // p - stride[0], tiling.min_width // p - stride[1])
        rows = []
        for i in range(0, h, lat_stride[0]):
            rows.append([_decode_patched(self, latents[:, :, i:i + lat[0], j:j + lat[1]], chunk)
                         for j in range(0, w, lat_stride[1])])
        out = blend_tiles(rows, blend, stride, (h * s // p, w * s // p))
        return jnp.clip(unpatchify(out, self.config.patch_size), -1.0, 1.0)

    # -- checkpoints ----------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path, *, config: WanVAEConfig | None = None, dtype=jnp.float32,
                        mesh=None) -> "WanVAE":
        """A VAE from a checkpoint: diffusers' `vae/` folder (`config.json` and
        `diffusion_pytorch_model.safetensors`, or its shards with the index), or a
        `.safetensors` file of the original Wan 2.1 VAE (Wan's names; the architecture
        Wan 2.1's). A Hub repository id works through
        [`vidax_eqx.interop.resolve_checkpoint`][].

        **Arguments:**

        - `path`: the folder or file.
        - `config`: the architecture of a single file (default Wan 2.1's); a folder's is
            its `config.json` (a different `config` given with it is refused).
        - `dtype`: the parameters' dtype (tensors of any float dtype are cast).
        - `mesh`: place the parameters on this mesh (replicated).

        **Raises:**

        `ValueError` naming every tensor that is missing, unexpected or of the wrong shape
        for the config.
        """
        path = checkpoint_path(path)
        if os.path.isdir(path):
            found = WanVAEConfig.from_file(os.path.join(path, CONFIG_FILE))
            if config is not None and config != found:
                raise ValueError(f"WanVAE.from_pretrained: `config` {config} differs from the "
                                 f"folder's config.json {found}; leave `config` out.")
            config = found
        elif config is None:
            config = WanVAEConfig.wan21()
        source = path
        return load_vae(cls, config, source, dtype=dtype, mesh=mesh, rename=checkpoint_name(config))

    def save_pretrained(self, path) -> None:
        """Writes diffusers' `vae/` layout: `config.json` and
        `diffusion_pytorch_model.safetensors` (diffusers' names)."""
        save_vae(self, path, rename=checkpoint_name(self.config))


def _run_decoder(vae, x, split: SpatialSplit, chunk: int):
    """The decoder over latents `x` (after `post_quant_conv`), in one scan: the first
    latent frame's group of `temporal_factor` frames ends with the video's first frame,
    the frames before it cut off."""
    tf = vae.config.temporal_factor

    def step(x, cache, first):
        return vae.decoder(x, cache, first=first, split=split)

    return run_scanned(step, x, size=chunk, latent_frames=chunk, lead=0, out_lead=tf - 1,
                       out_frames=1 + tf * (x.shape[1] - 1))


@vae_jit
def _decode_patched(vae, latents, chunk):
    """A tile's decode before unpatching and clamping (diffusers blends those)."""
    return _run_decoder(vae, vae.post_quant_conv(latents)[0], SpatialSplit(), chunk)
