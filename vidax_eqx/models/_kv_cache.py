"""The key/value cache of streaming generation: the self-attention keys and values of the
latent frames a video transformer has finished, carried from one chunk's call to the
next (an input and an output of the call, as the VAE's time cache is)."""

import operator

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from .. import kernels
from ..nn import sharding
from ..parallel import axis_size
from ._base import AbstractBatchedInput
from ._options import BlockCausal
from ._token_layout import AttentionInputs


class KVCache(AbstractBatchedInput):
    """Every block's self-attention keys and values of the last `max_frames` latent frames
    a transformer finished, for the next chunk's call (streaming, chunk by chunk: the
    model's `stream`).

    A rolling window of fixed size: the newest tokens at the end of the buffer, the
    oldest dropped as new frames come, so memory stays flat however long the video. Built
    empty by the model (`WanTransformer3D.kv_cache`); `stream` returns the cache with the
    chunk's keys and values appended (keep it once the chunk is final, e.g. after a pass at
    the clean timestep, and drop the others).

    **Fields:**

    - `k`, `v`: `(num_layers, max_frames * tokens_per_frame, heads, head_dim)`, the keys
        (normed and rotated at their frames) and values, in time order, right-aligned.
    - `length`: int32 scalar, the valid tokens at the end of the buffer.
    - `frame`: int32 scalar, the latent frame the next chunk starts at (its RoPE offset).
    - `tokens_per_frame` (static): patch tokens per latent frame.
    """

    k: Float[Array, "L C H D"]
    v: Float[Array, "L C H D"]
    length: Int[Array, ""]
    frame: Int[Array, ""]
    tokens_per_frame: int = eqx.field(static=True)

    def partition_specs(self, parallel: sharding.ParallelConfig, batch_axis=None) -> "KVCache":
        """The `shard_map` specs of a batched cache (`k`, `v` `(B, num_layers, C, heads,
        head_dim)`) for a model configured with `parallel`: the batch over `batch_axis`,
        the heads over `parallel.tp_axis` then `parallel.ulysses_axis` (each device keeps
        the heads its attention computes: Megatron's share, then Ulysses' share of it
        after the `all_to_all`), the rest whole. What [`run_sharded`][]`(kv_cache=)`
        places it by."""
        heads = tuple(a for a in (parallel.tp_axis, parallel.ulysses_axis) if a is not None)
        spec = P(batch_axis, None, None, heads or None, None)
        return KVCache(spec, spec, P(batch_axis), P(batch_axis), self.tokens_per_frame)

    @classmethod
    def empty(cls, *, layers: int, max_frames: int, tokens_per_frame: int, heads: int, head_dim: int,
              dtype) -> "KVCache":
        """An empty cache of `max_frames` latent frames (0: the chunks see only themselves)."""
        for name, value, least in (("max_frames", max_frames, 0), ("tokens_per_frame", tokens_per_frame, 1)):
            try:
                value = operator.index(value)
            except TypeError:
                value = None
            if value is None or isinstance(value, bool) or value < least:
                raise ValueError(f"KVCache: `{name}` must be an int >= {least}; received {value!r}.")
        shape = (layers, max_frames * tokens_per_frame, heads, head_dim)
        zeros = jnp.zeros(shape, dtype)
        return cls(zeros, zeros, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), tokens_per_frame)

    @property
    def capacity(self) -> int:
        """Tokens the buffer holds."""
        return self.k.shape[1]

    @property
    def max_frames(self) -> int:
        """Latent frames the buffer holds."""
        return self.capacity // self.tokens_per_frame

    def valid(self) -> Bool[Array, " C"]:
        """The buffer's slots that hold a token (the last `length`)."""
        return jnp.arange(self.capacity) >= self.capacity - self.length

    def append(self, k: Float[Array, "L S H D"], v: Float[Array, "L S H D"], frames: int) -> "KVCache":
        """The cache with a chunk of `frames` latent frames appended (`k`, `v`: its tokens'
        keys and values per layer), the oldest tokens dropped beyond the capacity."""
        C = self.capacity

        def keep(old, new):  # the last C tokens of [old; new]
            return jnp.concatenate([old, new.astype(old.dtype)], axis=1)[:, -C:] if C else old

        length = jnp.minimum(self.length + k.shape[1], C).astype(jnp.int32)
        return KVCache(keep(self.k, k), keep(self.v, v), length, (self.frame + frames).astype(jnp.int32),
                       self.tokens_per_frame)


def error_past_reach(out, cache: KVCache, max_frames: int, owner: str):
    """`out`, raising at run time (`eqx.error_if`) when `cache` (after a chunk: its
    `frame` one or one per example) has passed `max_frames` latent frames, the reach
    of the model's RoPE tables. Outside `shard_map` (its varying values do not go
    through `error_if`'s cond)."""
    return eqx.error_if(out, jnp.any(cache.frame > max_frames),
                        f"{owner}: the stream has passed the config's rope_max_seq_len={max_frames} "
                        "latent frames, the reach of its RoPE tables.")


class StreamLayout:
    """The tokens of a streamed chunk as the attention sees them, with
    [`TokenLayout`][]'s interface (`to_tokens`, `attention_inputs`, `from_tokens`), so that
    one forward pass serves both: the attention's sequence is `[the cache's buffer; the
    chunk]` in time order, the chunk its last tokens, frame-block causal
    ([`BlockCausal`][]; default one block per chunk); under Ulysses each device holds
    contiguous rows of the chunk (the attention trades them for a head split, the cache
    holding this device's heads). Raises where the chunk, the cache and `attention`
    disagree, or the mesh cannot stream (a ring)."""

    def __init__(self, grid, cache: KVCache, attention, parallel: sharding.ParallelConfig,
                 owner: str):
        if parallel.ring_axis is not None:
            raise NotImplementedError(
                f"{owner}: streaming with a key/value cache runs on one device or over a mesh "
                f"with tensor parallelism, FSDP or Ulysses; not over a ring ({parallel})."
            )
        f, h, w = grid
        if h * w != cache.tokens_per_frame:
            raise ValueError(
                f"{owner}: the chunk's frames hold {h * w} patch tokens (patch grid {tuple(grid)}); "
                f"the cache's {cache.tokens_per_frame}: build the cache for these latents."
            )
        if attention is None:
            attention = BlockCausal(f)
        if not isinstance(attention, BlockCausal):
            raise ValueError(f"{owner}: `attention` must be a models.BlockCausal or None; received "
                             f"{attention!r}.")
        k = attention.frames_per_block
        if f % k or cache.max_frames % k:
            raise ValueError(
                f"{owner}: the chunk's latent frames ({f}) and the cache's max_frames "
                f"({cache.max_frames}) must be multiples of the blocks' frames_per_block={k}."
            )
        ulysses = parallel.ulysses_axis
        sp = 1 if ulysses is None else axis_size(ulysses, what="Ulysses")
        if (f * h * w) % sp:
            raise ValueError(
                f"{owner}: Ulysses splits the chunk's {f * h * w} patch tokens over {ulysses!r} "
                f"({sp} devices); they must divide them (choose chunk_frames so that they do).")
        self.parallel = parallel
        self.mask = kernels.BlockCausalMask((cache.max_frames + f, h, w), k, window=attention.window,
                                            query_offset=cache.capacity)

    def to_tokens(self, tokens):
        """This device's rows of per-token arrays of the chunk (raster order)."""
        return jax.tree.map(lambda a: sharding.shard_tokens(a, self.parallel), tokens)

    def attention_inputs(self, rope=None) -> AttentionInputs:
        """The chunk's RoPE tables and the frame-block causal mask over `[cache; chunk]`."""
        return AttentionInputs(rope, None, self.mask)

    def from_tokens(self, tokens):
        """The whole chunk's rows from every device's."""
        return sharding.gather_tokens(tokens, self.parallel)
