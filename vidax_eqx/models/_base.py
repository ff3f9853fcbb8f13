"""What the code around a model needs of it, declared: the abstract bases that
[`run_sharded`][], LoRA, the caches, export and the samplers are written against, and
that every whole model of `vidax_eqx.models` subclasses."""

import abc
from typing import Any

import equinox as eqx

from .. import interop
from ..nn import sharding
from ._capabilities import Capabilities


class AbstractModel(eqx.Module):
    """A whole model: one example per call (`jax.vmap` for a batch), a
    [`ParallelConfig`][vidax_eqx.nn.sharding.ParallelConfig] that says how it runs over
    a mesh, and checkpoint names for its linear layers.

    [`run_sharded`][] runs any `AbstractModel` over a mesh; [`add_lora`][] and the
    LoRA files find its layers by [`linear_layers`][AbstractModel.linear_layers]; FSDP
    and the placement read `stacked_layers`.

    **Declares:**

    - `config`: the model's static configuration (a frozen dataclass).
    - `stacked_layers`: a class variable, the names of the fields that hold layers
        stacked along a leading axis (run by `lax.scan`): never sharded on that axis.
    - `capabilities`: a class variable, the [`Capabilities`][] record of what the
        model's calls take (latent layout, timestep granularity, caches, streaming,
        experts, image conditioning): what the samplers and pipelines read, instead of
        testing the model's class. A combination the record refuses raises in one line
        naming the model and the capability.
    """

    config: eqx.AbstractVar[Any]
    stacked_layers: eqx.AbstractClassVar[tuple[str, ...]]
    capabilities: eqx.AbstractClassVar[Capabilities]

    @property
    @abc.abstractmethod
    def in_channels(self) -> int:
        """Latent channels in (with any condition channels concatenated to them)."""

    @property
    @abc.abstractmethod
    def out_channels(self) -> int:
        """Latent channels out (those of the noise a sampler starts from)."""

    @property
    @abc.abstractmethod
    def patch_size(self) -> tuple[int, int, int]:
        """`(pt, ph, pw)`: latent frames, rows and columns per patch token."""

    @property
    @abc.abstractmethod
    def text_dim(self) -> int:
        """The width of the text encoder's embeddings the call takes as `context`."""

    @property
    @abc.abstractmethod
    def parallel(self) -> sharding.ParallelConfig:
        """The [`ParallelConfig`][vidax_eqx.nn.sharding.ParallelConfig] the model runs
        with (set it on every layer with
        [`with_parallel`][vidax_eqx.nn.sharding.with_parallel])."""

    @abc.abstractmethod
    def __call__(self, x, timestep, context, **kwargs):
        """The model's prediction for one example: the latents `x`, the diffusion
        `timestep`, the text `context`, and the model's keyword options (see the
        subclass); inside `shard_map` the model splits its own tokens as its
        `parallel` says, with `x`, `timestep` and `context` whole on every device."""

    @abc.abstractmethod
    def linear_layers(self) -> list[interop.LinearName]:
        """Every linear layer with its checkpoint names (one per layer of stacked
        blocks): what LoRA patterns and LoRA files name."""


class AbstractCachedModel(AbstractModel):
    """A model whose denoising steps can reuse work: the text's keys and values computed
    once per generation (`text_cache`), and step caching (`cached_call`), which a sampler
    and [`run_sharded`][] use when asked."""

    @abc.abstractmethod
    def text_cache(self, context, *, context_image=None):
        """What every block would compute from the text `context` (and the image
        context), computed once: pass it as `__call__(..., text_cache=...)` at every
        step of the same context, for the same output. Returns an
        [`AbstractBatchedInput`][] (it places itself over a mesh)."""

    @abc.abstractmethod
    def cached_call(self, x, timestep, context, step_cache, **kwargs):
        """`__call__` with step caching: may reuse the block stack's residual of the
        last step that ran it ([`StepCache`][]). Returns `(out, step_cache)`."""


class AbstractExperts(AbstractCachedModel):
    """A model made of experts, one chosen per call by the timestep (Wan 2.2 A14B's
    [`WanExperts`][]). [`run_sharded`][] runs a batch through `route_batch` (one expert
    when the batch agrees) instead of `jax.vmap`, which would run every expert; LoRA
    and the text cache handle each expert."""

    @property
    @abc.abstractmethod
    def experts(self) -> tuple:
        """The experts, in index order."""

    @property
    @abc.abstractmethod
    def boundary_timestep(self) -> float:
        """The smallest timestep of expert 0 (the high-noise expert); lower timesteps go
        to expert 1."""

    @abc.abstractmethod
    def with_expert(self, index: int, expert) -> "AbstractExperts":
        """A copy with expert `index` replaced."""

    @abc.abstractmethod
    def route_batch(self, fn, timestep, *, axis_name=None):
        """`fn(expert, index)` (a batched call of one expert) for the experts the
        batch's `timestep` selects; inside `shard_map` the devices along `axis_name`
        (the batch axis) choose together."""

    @abc.abstractmethod
    def combine_text_caches(self, caches):
        """One cache for the experts from each expert's `text_cache` (in index order)."""


class AbstractBatchedInput(eqx.Module):
    """An input of [`run_sharded`][] that is not a plain batched array and says how it is
    placed over a mesh (a text cache, a step cache)."""

    @abc.abstractmethod
    def partition_specs(self, parallel: sharding.ParallelConfig, batch_axis=None):
        """The `shard_map` in_specs of a batched value `(B, ...)` for a model configured
        with `parallel`, the batch over `batch_axis`: a PyTree of `PartitionSpec`s of
        the value's structure."""


class AbstractPerExpert(AbstractBatchedInput):
    """An input that holds one value per expert of an [`AbstractExperts`][] model."""

    @abc.abstractmethod
    def for_expert(self, index: int):
        """Expert `index`'s value."""


def expert_kwargs(kwargs: dict, index: int) -> dict:
    """Keyword arguments for expert `index`: each [`AbstractPerExpert`][] value replaced
    by that expert's."""
    return {k: v.for_expert(index) if isinstance(v, AbstractPerExpert) else v
            for k, v in kwargs.items()}


class AbstractVideoVAE(eqx.Module):
    """A video VAE: one example per call, channels first, causal in time (the first
    frame alone, then `temporal_factor` frames per latent frame), each frame splittable
    over two mesh axes. What a pipeline and the dataset script need of a VAE.

    **Declares:**

    - `config`: the static configuration (a frozen dataclass with `spatial_factor` and
        `temporal_factor`: video pixels per latent pixel, each side, and video frames per
        latent frame after the first).
    - `z_dim`: latent channels.
    """

    config: eqx.AbstractVar[Any]

    @property
    @abc.abstractmethod
    def z_dim(self) -> int:
        """Latent channels."""

    @property
    def spatial_factor(self) -> int:
        """Video pixels per latent pixel, each side (the config's `spatial_factor`)."""
        return self.config.spatial_factor

    @property
    def temporal_factor(self) -> int:
        """Video frames per latent frame after the first (the config's `temporal_factor`)."""
        return self.config.temporal_factor

    @abc.abstractmethod
    def encode(self, video, *, mesh=None, spatial_axes=None, tiling=None):
        """`video` `(C, 1 + temporal_factor k, H, W)` in [-1, 1] -> the posterior over its
        latents `(z_dim, 1 + k, H / s, W / s)`."""

    @abc.abstractmethod
    def decode(self, latents, *, mesh=None, spatial_axes=None, tiling=None):
        """Latents `(z_dim, T, h, w)` -> the video in [-1, 1]."""

    @abc.abstractmethod
    def normalize_latents(self, latents):
        """The encoder's latents as the transformer takes them."""

    @abc.abstractmethod
    def denormalize_latents(self, latents):
        """The transformer's latents as the decoder takes them."""
