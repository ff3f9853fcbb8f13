"""SkyReels-V2's video DiT (diffusers' `SkyReelsV2Transformer3DModel`): Wan 2.1's
transformer with a timestep per latent frame (diffusion forcing) and the fps embedding."""

import os
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import ArrayLike, Integer, PRNGKeyArray

from ..._shapes import checked
from ... import nn
from ...nn import sharding
from ...nn.internal import init
from .._capabilities import Capabilities
from .._checkpoint import load_pretrained, read_config
from .._dit import Conditioning
from .._options import BlockCausal
from ..wan._model import WanTransformer3D
from ..wan._names import check_layout, rename
from ._config import SkyReelsV2Config


class SkyReelsV2Transformer3D(WanTransformer3D):
    """SkyReels-V2's video DiT, one example per call (`jax.vmap` for a batch): Wan 2.1's
    [`WanTransformer3D`][] (T2V and I2V, the same blocks, RoPE, text and image branches,
    parallelism, text cache and step cache) with

        timestep (F',) per latent frame   # diffusion forcing: each frame its own noise level
        e0 += fps_projection(fps_embedding[fps])   # inject_sample_info: every block's modulation

    where diffusers' `SkyReelsV2Transformer3DModel` takes `enable_diffusion_forcing=True`
    with a `(B, F')` timestep. A timestep per frame runs Wan's per-token path (each frame's
    value for its tokens: the time embedding, every block's modulation and the head's).

    With `num_frame_per_block = k > 1` every self-attention is frame-block causal
    ([`BlockCausal`][]`(k)`: blocks of `k` latent frames, each seeing itself and the blocks
    before it, diffusers' mask); a call's `attention=BlockCausal(k', window)` sets other
    blocks (as diffusers' `_set_ar_attention(k')`, which the pipelines call for their
    `causal_block_size`), or a rolling window.

    **Calls:** Wan's `__call__`, `cached_call` and `stream` (one forward pass), where
    `timestep` is a scalar or one per latent frame of the patch grid `(F / pt,)`, and a
    model with `inject_sample_info` requires the keyword `fps`: the index of its fps
    embedding, 0 or 1 (SkyReels-V2's pipelines pass 0 for 16 frames per second, 1
    otherwise); an index outside `{0, 1}` raises `ValueError`, a traced one is clipped to
    `[0, 1]` (it cannot be checked while the program is traced). A model without the fps
    embedding refuses `fps`.

    **Fields:** Wan's (see [`WanTransformer3D`][]), and `fps_embedding` (`eqx.nn.Embedding`
    of 2 entries) and `fps_projection` ([`vidax_eqx.nn.FeedForward`][], SiLU, to `6 * dim`)
    when `config.inject_sample_info`, else `None`. `config` is a [`SkyReelsV2Config`][].
    """

    fps_embedding: eqx.nn.Embedding | None
    fps_projection: nn.FeedForward | None
    capabilities: ClassVar[Capabilities] = Capabilities(
        latents="CFHW", timestep="frame", text_cache=True, step_cache=True, streaming=True,
        experts=False, image=frozenset({"channels", "embedding"}))

    def __init__(
        self,
        config: SkyReelsV2Config,
        *,
        parallel: sharding.ParallelConfig = sharding.ParallelConfig(),
        implementation="auto",
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        """**Arguments:** as [`WanTransformer3D`][]'s, with a [`SkyReelsV2Config`][]."""
        if not isinstance(config, SkyReelsV2Config):
            raise ValueError(
                f"SkyReelsV2Transformer3D: `config` must be a SkyReelsV2Config; received {config!r}."
            )
        wan_key, embed_key, project_key = init.split(key, 3)
        super().__init__(config, parallel=parallel, implementation=implementation, dtype=dtype, key=wan_key)
        if config.inject_sample_info:
            self.fps_embedding = eqx.nn.Embedding(2, config.dim, dtype=dtype, key=embed_key)
            self.fps_projection = nn.FeedForward(config.dim, config.dim, 6 * config.dim, activation="silu",
                                                 dtype=dtype, key=project_key)
        else:
            self.fps_embedding = self.fps_projection = None

    @checked
    def _conditioning(self, x, timestep, attention, *, streaming: bool,
                      fps: Integer[ArrayLike, ""] | None = None) -> Conditioning:
        """The one hook SkyReels-V2 overrides of [`AbstractVideoDiT`][]'s calls
        (`__call__`, `cached_call`, `stream` take these keywords):

        - `timestep`: a scalar (every frame at one noise level), or one per latent frame
            of the patch grid `(F / pt,)` (diffusion forcing; diffusers'
            `enable_diffusion_forcing=True` with a `(B, F')` timestep, without the batch
            axis), repeated over the frame's patch tokens for Wan's forward.
        - `fps`: a model with `inject_sample_info` only, and required there: the index
            of its fps embedding, 0 or 1 (SkyReels-V2's pipelines pass 0 for 16 frames
            per second, 1 otherwise), added to every block's modulation. An index outside
            `{0, 1}` raises `ValueError`; a traced one cannot be checked while the program
            is traced and is clipped to `[0, 1]` (as `kernels.attention` clips traced
            `kv_lengths`: a runtime check would be a host callback, which `jax.export`
            cannot serialize and which does not type-check inside `shard_map` when the
            value varies over a mesh axis).
        - `attention`: with `num_frame_per_block > 1` the model's own frame-block causal
            blocks by default (also when streaming, where one block per chunk is the
            default otherwise); see `_attention`.
        """
        timestep, shift = self._skyreels_inputs(x, timestep, fps)
        return Conditioning(timestep, self._attention(attention), {"e0_shift": shift})

    def _attention(self, attention):
        """The call's attention: with `num_frame_per_block > 1`, the model's frame-block
        causal mask ([`BlockCausal`][]`(num_frame_per_block)`, diffusers' mask). A call's
        `BlockCausal(k, window)` sets the blocks instead (what diffusers'
        `_set_ar_attention(k)` does to its model; a rolling `window` narrows them)."""
        k = self.config.num_frame_per_block
        if k == 1 or isinstance(attention, BlockCausal):
            return attention
        if attention is None:
            return BlockCausal(k)
        raise ValueError(
            f"SkyReelsV2Transformer3D: this model attends frame-block causally "
            f"(num_frame_per_block={k}); `attention` may be None or a BlockCausal(frames, window), "
            f"received {attention!r}."
        )

    def _skyreels_inputs(self, x, timestep, fps):
        """`(timestep, e0_shift)` for Wan's forward: a timestep per frame repeated over
        its patch tokens (frame-major, diffusers' order), and the fps term."""
        c = self.config
        pt, ph, pw = c.patch_size
        frames, tokens_per_frame = x.shape[1] // pt, (x.shape[2] // ph) * (x.shape[3] // pw)
        if timestep.ndim == 1:
            if timestep.shape[0] != frames:
                raise ValueError(
                    "SkyReelsV2Transformer3D: a `timestep` per frame has one value per latent "
                    f"frame of the patch grid: {frames} for x of shape {tuple(x.shape)} (patch "
                    f"{c.patch_size}); received {timestep.shape[0]}."
                )
            timestep = jnp.repeat(timestep, tokens_per_frame, total_repeat_length=frames * tokens_per_frame)
        if self.fps_embedding is None:
            if fps is not None:
                raise ValueError(
                    "SkyReelsV2Transformer3D: `fps` is taken by a model with the fps embedding "
                    "(inject_sample_info=True); this one has none, received fps="
                    f"{fps!r}."
                )
            return timestep, None
        if fps is None:
            raise ValueError(
                "SkyReelsV2Transformer3D: this model has the fps embedding "
                "(inject_sample_info=True) and needs `fps`, its index (0: 16 frames per "
                "second, 1: otherwise)."
            )
        fps = jnp.asarray(fps)
        if isinstance(fps, jax.core.Tracer):  # cannot be checked while tracing: clipped
            fps = jnp.clip(fps, 0, 1)
        elif int(fps) not in (0, 1):
            raise ValueError(f"SkyReelsV2Transformer3D: `fps` is an index, 0 or 1; received {int(fps)}.")
        embedded = self.fps_embedding(fps)
        shift = self.fps_projection(embedded[None])[0]
        return timestep, shift.reshape(6, c.dim).astype(jnp.float32)

    # -- checkpoints --------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path,
        *,
        dtype=None,
        parallel: sharding.ParallelConfig = sharding.ParallelConfig(),
        implementation="auto",
        mesh=None,
        subfolder: str | None = None,
        revision: str | None = None,
        cache_dir=None,
        quantize: str | None = None,
    ) -> "SkyReelsV2Transformer3D":
        """Loads a diffusers `SkyReelsV2Transformer3DModel` directory (`config.json` and
        the safetensors weights), e.g. the `transformer/` folder of
        `Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers` (`subfolder="transformer"`). Built
        abstractly, every shape checked before any tensor is read, nothing partially
        loaded; the arguments are [`WanTransformer3D.from_pretrained`][]'s (`quantize`
        included)."""
        raw, tensors = read_config(path, "SkyReelsV2Transformer3D", subfolder=subfolder,
                                   revision=revision, cache_dir=cache_dir)
        if raw.get("_class_name", "SkyReelsV2Transformer3DModel") != "SkyReelsV2Transformer3DModel":
            raise ValueError(
                f"SkyReelsV2Transformer3D.from_pretrained: {os.fspath(path)!r}/config.json is a "
                f"{raw['_class_name']} config, not a diffusers SkyReelsV2Transformer3DModel one."
            )
        config = SkyReelsV2Config.from_diffusers(raw)
        return load_pretrained(cls, config, tensors, dtype=dtype, dtype_from="patch_embedding.weight",
                               parallel=parallel, implementation=implementation, mesh=mesh,
                               stacked=cls.stacked_layers, quantize=quantize,
                               quantization=raw.get("quantization_config"), rename=rename)

    def state_dict(self, *, layout: str = "diffusers"):
        """The parameters under diffusers' names (the only layout SkyReels-V2 is read and
        written in here)."""
        if check_layout(layout) != "diffusers":
            raise ValueError("SkyReelsV2Transformer3D: only diffusers' layout is read and written.")
        return super().state_dict(layout=layout)

    def save_pretrained(self, path, *, layout: str = "diffusers", max_shard_bytes: int | None = None) -> None:
        """Writes `config.json` and the weights in diffusers' layout (loadable by diffusers'
        `SkyReelsV2Transformer3DModel.from_pretrained` and by `from_pretrained`, bit for bit);
        `max_shard_bytes` as [`WanTransformer3D.save_pretrained`][]'s."""
        super().save_pretrained(path, layout=layout, max_shard_bytes=max_shard_bytes)
