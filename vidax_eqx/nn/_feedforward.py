"""The feed-forward layers of a DiT: the MLP (with Megatron tensor parallelism) and the
timestep embedding."""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray, Real

from .._shapes import checked
from ..parallel import axis_size
from .._checks import check_positive
from .sharding._fsdp import fsdp_gather
from . import _init as init
from ._layers import linear, row_parallel
from .sharding._config import check_parallel, ParallelConfig
from .sharding._parallel_layer import AbstractParallelLayer, MegatronSplit


ACTIVATIONS = {
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # torch GELU(approximate="tanh")
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # torch GELU() (erf)
    "silu": jax.nn.silu,
}


class FeedForward(AbstractParallelLayer):
    """A two-layer MLP, `fc2(act(fc1(x)))`, with Megatron tensor parallelism.

    Wan's block FFN (`ffn.0`, tanh-GELU, `ffn.2`; diffusers' `ffn.net.0.proj`,
    `ffn.net.2`), its text embedding, and the MLP of most DiTs.

    **Tensor parallelism** (`parallel.tp_axis` set): `fc1` is column-parallel
    (each device holds `hidden_dim / tp` rows of its weight and bias), `fc2`
    row-parallel (the matching columns; the partial products are summed with one
    `psum` over `tp_axis` and `fc2`'s bias is added once after it). The placement is
    [`partition_specs`][vidax_eqx.nn.sharding.partition_specs]`(module)`; the module checks that its weights are placed
    so. The input must be the same on every device of `tp_axis`. Sequence
    parallelism needs nothing: the MLP is per token.

    **Fields:** `fc1` (`eqx.nn.Linear(in_dim, hidden_dim)`), `fc2`
    (`eqx.nn.Linear(hidden_dim, out_dim)`), both with bias; `parallel` (a
    [`ParallelConfig`][], a non-array leaf, as in [`Attention`][]); static `in_dim`,
    `hidden_dim`, `out_dim`, `activation`.
    """

    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    in_dim: int = eqx.field(static=True)
    hidden_dim: int = eqx.field(static=True)
    out_dim: int = eqx.field(static=True)
    activation: str = eqx.field(static=True)
    parallel: ParallelConfig
    megatron: ClassVar[MegatronSplit] = MegatronSplit(column=("fc1",), row=("fc2",))

    def __init__(
        self,
        in_dim: int,
        hidden_dim: int,
        out_dim: int | None = None,
        *,
        activation: str = "gelu_tanh",
        parallel: ParallelConfig = ParallelConfig(),
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `in_dim`: the input width.
        - `hidden_dim`: the hidden width (Wan: `ffn_dim`).
        - `out_dim`: the output width, default `in_dim`.
        - `activation`: `"gelu_tanh"` (Wan, diffusers' `"gelu-approximate"`), `"gelu"`
            (erf) or `"silu"`.
        - `parallel`: a [`ParallelConfig`][]; only its `tp_axis` matters here.
        - `dtype`: the parameters' dtype.
        - `key`: a PRNG key for the initialization.
        """
        out_dim = in_dim if out_dim is None else out_dim
        check_positive("FeedForward", in_dim=in_dim, hidden_dim=hidden_dim, out_dim=out_dim)
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"FeedForward: `activation` must be one of {sorted(ACTIVATIONS)}; received "
                f"{activation!r}."
            )
        check_parallel("FeedForward", parallel)
        k1, k2 = init.split(key)
        self.fc1 = init.linear(in_dim, hidden_dim, dtype=dtype, key=k1)
        self.fc2 = init.linear(hidden_dim, out_dim, dtype=dtype, key=k2)
        self.in_dim, self.hidden_dim, self.out_dim = in_dim, hidden_dim, out_dim
        self.activation, self.parallel = activation, parallel

    @checked
    def __call__(
        self, x: Float[Array, "*batch {self.in_dim}"]
    ) -> Float[Array, "*batch {self.out_dim}"]:
        """**Arguments:**

        - `x`: tokens `(..., in_dim)`, e.g. `(S, dim)`.

        **Returns:**

        `(..., out_dim)`, in the promotion of `x`'s and the weights' dtypes.
        """
        with jax.named_scope("vidax_eqx.nn.FeedForward"):
            self, x = fsdp_gather(self, x)
            tp_axis = self.parallel.tp_axis
            tp = 1 if tp_axis is None else axis_size(tp_axis, what="Tensor-parallel")
            rows = self.fc1.weight.shape[0]
            if self.hidden_dim % tp or rows * tp != self.hidden_dim:
                placed = "" if tp_axis is None else f" over the {tp} devices of {tp_axis!r}"
                raise ValueError(
                    f"FeedForward: with tp_axis={tp_axis!r} each device holds hidden_dim / tp = "
                    f"{self.hidden_dim} / {tp} rows of fc1 (column-parallel{placed}); received "
                    f"{rows}. Place the module with `nn.sharding.partition_specs(module)`, or make its "
                    "ParallelConfig match how it is placed (`nn.sharding.with_parallel(module, "
                    "nn.sharding.ParallelConfig(tp_axis=...))`); hidden_dim must be a multiple of tp."
                )
            h = ACTIVATIONS[self.activation](linear(self.fc1, x))
            return row_parallel(self.fc2, h, tp_axis)


@checked
def timestep_embedding(
    t: Real[Array, "*batch"],
    dim: int,
    *,
    flip_sin_to_cos: bool = True,
    downscale_freq_shift: float = 0.0,
    max_period: float = 10000.0,
) -> Float[Array, "*batch dim"]:
    """The sinusoidal embedding of (diffusion) timesteps, float32.

    With `half = dim // 2` and `freqs = exp(-log(max_period) * arange(half) / (half -
    downscale_freq_shift))`: `[cos(t * freqs), sin(t * freqs)]` (`flip_sin_to_cos=True`,
    Wan's `sinusoidal_embedding_1d` and diffusers' `Timesteps(flip_sin_to_cos=True,
    downscale_freq_shift=0)`), or `[sin, cos]`; an odd `dim` gets a zero last feature.
    Computed in float32 as diffusers does (Wan computes it in float64).

    **Arguments:**

    - `t`: the timesteps, any shape (a scalar for one example).
    - `dim`: the embedding width.
    - `flip_sin_to_cos`, `downscale_freq_shift`, `max_period`: as diffusers'
        `get_timestep_embedding`.

    **Returns:**

    float32 `(*t.shape, dim)`.
    """
    check_positive("timestep_embedding", dim=dim)
    half = dim // 2
    exponent = -jnp.log(jnp.float32(max_period)) * jnp.arange(half, dtype=jnp.float32)
    freqs = jnp.exp(exponent / (half - downscale_freq_shift))
    args = t.astype(jnp.float32)[..., None] * freqs
    parts = [jnp.cos(args), jnp.sin(args)] if flip_sin_to_cos else [jnp.sin(args), jnp.cos(args)]
    if dim % 2:
        parts.append(jnp.zeros((*args.shape[:-1], 1), jnp.float32))
    return jnp.concatenate(parts, axis=-1)


class TimestepEmbedding(eqx.Module):
    """Timestep -> sinusoid -> `linear_1` -> SiLU -> `linear_2` (diffusers' `Timesteps` +
    `TimestepEmbedding`; Wan's `time_embedding`).

    The sinusoid ([`vidax_eqx.nn.functional.timestep_embedding`][], float32) is cast to
    the weights' dtype before `linear_1`, as diffusers does.

    **Fields:** `linear_1` (`eqx.nn.Linear(freq_dim, dim)`), `linear_2`
    (`eqx.nn.Linear(dim, dim)`); static `freq_dim`, `dim`, `flip_sin_to_cos`,
    `downscale_freq_shift`.
    """

    linear_1: eqx.nn.Linear
    linear_2: eqx.nn.Linear
    freq_dim: int = eqx.field(static=True)
    dim: int = eqx.field(static=True)
    flip_sin_to_cos: bool = eqx.field(static=True)
    downscale_freq_shift: float = eqx.field(static=True)

    def __init__(self, freq_dim: int, dim: int, *, flip_sin_to_cos: bool = True,
                 downscale_freq_shift: float = 0.0, dtype=jnp.float32, key: PRNGKeyArray):
        """**Arguments:**

        - `freq_dim`: the sinusoid's width (Wan: 256; CogVideoX: the model width).
        - `dim`: the embedding width (Wan: the model width; CogVideoX: `time_embed_dim`).
        - `flip_sin_to_cos`, `downscale_freq_shift`: the sinusoid's options (diffusers'
            `Timesteps`; Wan and CogVideoX: `True`, `0`).
        - `dtype`: the parameters' dtype.
        - `key`: a PRNG key for the initialization.
        """
        check_positive("TimestepEmbedding", freq_dim=freq_dim, dim=dim)
        k1, k2 = init.split(key)
        self.linear_1 = init.linear(freq_dim, dim, dtype=dtype, key=k1)
        self.linear_2 = init.linear(dim, dim, dtype=dtype, key=k2)
        self.freq_dim, self.dim = freq_dim, dim
        self.flip_sin_to_cos = bool(flip_sin_to_cos)
        self.downscale_freq_shift = float(downscale_freq_shift)

    @checked
    def __call__(self, t: Real[Array, "*batch"]) -> Float[Array, "*batch {self.dim}"]:
        """**Arguments:**

        - `t`: the timestep (a scalar per example; any shape works).

        **Returns:**

        `(*t.shape, dim)` in the weights' dtype.
        """
        with jax.named_scope("vidax_eqx.nn.TimestepEmbedding"):
            self, t = fsdp_gather(self, t)
            emb = timestep_embedding(
                t, self.freq_dim, flip_sin_to_cos=self.flip_sin_to_cos,
                downscale_freq_shift=self.downscale_freq_shift,
            ).astype(self.linear_1.weight.dtype)
            return linear(self.linear_2, jax.nn.silu(linear(self.linear_1, emb)))
