"""The token layout every video transformer shares: its patch tokens (and their per-token
arrays) into the order its attention takes, padded and split over the sequence axes,
and back; and what each self-attention of its blocks takes in that layout."""

import math
import operator

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .. import kernels, nn, parallel as par
from ..nn import sharding
from ..nn.internal import sequence_multiple
from ._options import BlockCausal, check_attention, SlidingTile, VideoSparseTiles


class AttentionInputs(eqx.Module):
    """What each self-attention of a transformer's blocks takes in one call, in the
    tokens' [`TokenLayout`][]: built by
    [`TokenLayout.attention_inputs`][vidax_eqx.models.TokenLayout.attention_inputs]
    and carried to every block in its per-call inputs
    ([`WanBlockInputs`][], [`CogVideoXBlockInputs`][]).

    **Fields:**

    - `rope`: `(cos, sin)`, each `(S, head_dim // 2)`, the RoPE tables of this
        device's video tokens in the layout's order; `None`: no RoPE.
    - `segment_ids`: int `(text_len + S,)`: the devices' padding at -1, the rest 0
        (a text prefix first when the layout has one); `None` when nothing is padded.
    - `mask`: the attention's [`vidax_eqx.kernels.SlidingTileMask`][] or
        [`vidax_eqx.kernels.BlockCausalMask`][], or `None` (static).
    - `video_sparse`: the attention's [`vidax_eqx.nn.VideoSparse`][], or `None`
        (static).
    """

    rope: tuple[Float[Array, "S half"], Float[Array, "S half"]] | None
    segment_ids: Int[Array, " S"] | None
    mask: kernels.SlidingTileMask | kernels.BlockCausalMask | None = eqx.field(static=True, default=None)
    video_sparse: nn.VideoSparse | None = eqx.field(static=True, default=None)

    def kwargs(self) -> dict:
        """The keywords of [`vidax_eqx.nn.Attention`][] (and, without `video_sparse`,
        of [`vidax_eqx.nn.JointAttention`][]) that run the attention as the layout
        says: video sparse attention takes its padding from its tile layout, so it gets
        neither `segment_ids` nor `mask`."""
        if self.video_sparse is not None:
            return dict(rope=self.rope, video_sparse=self.video_sparse)
        return dict(rope=self.rope, segment_ids=self.segment_ids, mask=self.mask)


class TokenLayout(eqx.Module):
    """How a video transformer lays out its patch tokens for its blocks, and back: one
    object for every model of [`vidax_eqx.models`][], built per call from the patch
    grid, the call's `attention=` and the model's
    [`ParallelConfig`][vidax_eqx.nn.sharding.ParallelConfig].

        patches = patchify(x)                        # (F * H * W, ...), raster order
        tokens, rope = layout.to_tokens((patches, rope))     # the attention's order,
        inputs = layout.attention_inputs(rope)               # padded, this device's rows
        tokens = blocks(tokens, ...inputs)
        out = unpatchify(layout.from_tokens(head(tokens)))   # raster order, whole

    [`to_tokens`][vidax_eqx.models.TokenLayout.to_tokens] takes the video's tokens and
    every per-token array (RoPE tables, positions, a timestep per token) in raster order
    (frames slowest, width fastest) and returns this device's rows of each:

    1. in the attention's order: tile by tile ([`vidax_eqx.kernels.tile_permute`][],
        each grid dimension padded with zero rows to whole tiles) for
        [`SlidingTile`][] and [`VideoSparseTiles`][]; as they are for full attention
        and [`BlockCausal`][];
    2. padded with zero rows to what the sequence axes take: a multiple of the
        devices (whole tiles per device on a ring with sliding tiles; whole empty tiles
        to [`vidax_eqx.parallel.vsa_padded_length`][] with video sparse attention),
        the padding hidden from attention by segment id -1;
    3. split over the sequence axes by [`vidax_eqx.nn.sharding.shard_tokens`][].

    [`from_tokens`][vidax_eqx.models.TokenLayout.from_tokens] undoes all three:
    [`vidax_eqx.nn.sharding.gather_tokens`][], the padding dropped, raster order.
    Call both inside `jax.shard_map` under sequence parallelism, with the inputs
    whole on every device (as [`run_sharded`][] calls a model); on one device they
    are the tile permutation alone.

    The transformers know nothing of the options: a kind of attention (as the
    frame-block causal mask of [`BlockCausal`][], for autoregressive video) is one case
    here (its token order, its padding over the devices, its kernel mask) and in
    [`AttentionInputs`][] (what its attention layers take), with the models' code
    unchanged.

    **Arguments:**

    - `grid`: the patch grid `(F, H, W)` of the video tokens.
    - `attention`: a [`SlidingTile`][], a [`VideoSparseTiles`][], a [`BlockCausal`][],
        or `None` (full attention).
    - `parallel`: the model's [`ParallelConfig`][vidax_eqx.nn.sharding.ParallelConfig];
        default one device.
    - `text_len`: text tokens before the video tokens in the self-attention's sequence
        (a joint attention's text prefix, CogVideoX's), whole on every device and never
        padding: the sliding tile mask covers them, the segment ids start with them.
        `0` (default) when the text enters by cross-attention (Wan).
    - `owner`: the name the errors start with (the model's).

    **Fields:** `grid`, `attention`, `parallel`, `text_len`, and the attention's
    `mask` (a [`vidax_eqx.kernels.SlidingTileMask`][] or
    [`vidax_eqx.kernels.BlockCausalMask`][]) or `video_sparse` (a
    [`vidax_eqx.nn.VideoSparse`][]), all static.
    """

    grid: tuple[int, int, int] = eqx.field(static=True)
    attention: SlidingTile | VideoSparseTiles | BlockCausal | None = eqx.field(static=True)
    parallel: sharding.ParallelConfig = eqx.field(static=True)
    text_len: int = eqx.field(static=True)
    mask: kernels.SlidingTileMask | kernels.BlockCausalMask | None = eqx.field(static=True)
    video_sparse: nn.VideoSparse | None = eqx.field(static=True)

    def __init__(self, grid, attention=None,
                 parallel: sharding.ParallelConfig = sharding.ParallelConfig(), *,
                 text_len: int = 0, owner: str = "TokenLayout"):
        try:
            sizes = tuple(operator.index(g) for g in grid)
        except TypeError:
            sizes = ()
        if len(sizes) != 3 or min(sizes) < 1:
            raise ValueError(f"{owner}: `grid` must be the patch grid (F, H, W) of positive "
                             f"ints; received {grid!r}.")
        grid = sizes
        if not isinstance(parallel, sharding.ParallelConfig):
            raise ValueError(f"{owner}: `parallel` must be an nn.sharding.ParallelConfig; "
                             f"received {type(parallel).__name__}.")
        if isinstance(text_len, bool) or not isinstance(text_len, int) or text_len < 0:
            raise ValueError(f"{owner}: `text_len` must be a non-negative int; received "
                             f"{text_len!r}.")
        attention = check_attention(owner, attention)
        mask = video_sparse = None
        if isinstance(attention, SlidingTile):
            mask = kernels.SlidingTileMask(grid, attention.tile, attention.window,
                                           text_len=text_len)
        elif isinstance(attention, BlockCausal):
            mask = kernels.BlockCausalMask(grid, attention.frames_per_block,
                                           window=attention.window, text_len=text_len)
        elif isinstance(attention, VideoSparseTiles):
            if text_len:
                raise NotImplementedError(
                    f"{owner}: video sparse attention is implemented for video tokens alone "
                    f"(a text by cross-attention, as Wan's), not for a joint attention's "
                    f"text prefix (text_len={text_len}); use attention=SlidingTile(...) or "
                    "None."
                )
            tile, amount = attention
            kind = "topk" if isinstance(amount, int) else "sparsity"
            video_sparse = nn.VideoSparse(grid, tile, **{kind: amount})
        self.grid = grid
        self.attention = attention
        self.parallel = parallel
        self.text_len = text_len
        self.mask = mask
        self.video_sparse = video_sparse

    @property
    def tile(self) -> tuple[int, int, int] | None:
        """The tile of the tile layout, `None` for raster order."""
        if isinstance(self.mask, kernels.SlidingTileMask):
            return self.mask.tile
        return None if self.video_sparse is None else self.video_sparse.tile

    @property
    def length(self) -> int:
        """The video tokens in the attention's order before the devices' padding: `F H W`,
        or the tile layout's (padded to whole tiles)."""
        tile = self.tile
        if tile is None:
            return math.prod(self.grid)
        return math.prod(-(-g // t) * t for g, t in zip(self.grid, tile))

    def _padded_length(self) -> int:
        """The video tokens with the devices' padding (inside `shard_map`: it reads the
        sequence axes' sizes)."""
        p, n = self.parallel, self.length
        if not p.sequence_axes:
            return n
        if self.video_sparse is not None:
            def size(axis):
                return 1 if axis is None else par.axis_size(axis)

            return par.vsa_padded_length(self.grid, self.video_sparse.tile,
                                         ulysses_size=size(p.ulysses_axis),
                                         ring_size=size(p.ring_axis), layout=p.layout)
        multiple = sequence_multiple(p)
        if p.ring_axis is not None and self.tile is not None:  # whole tiles per chunk
            multiple *= math.prod(self.tile)
        return -(-n // multiple) * multiple

    def to_tokens(self, tokens):
        """This device's rows of per-token arrays, in the attention's order.

        **Arguments:**

        - `tokens`: an array or a PyTree of arrays (`None` leaves pass), each with the
            `F * H * W` video tokens in raster order on its first axis: the patches,
            RoPE tables, positions, a timestep per token.

        **Returns:**

        The same structure, each array in the layout's order, padded with zero rows
        and split over the sequence axes (the rows that
        [`attention_inputs`][vidax_eqx.models.TokenLayout.attention_inputs] describes).
        """
        tile = self.tile
        if tile is not None:  # tile layout: tiles in raster order, zero padding rows
            tokens = jax.tree.map(lambda a: kernels.tile_permute(a, self.grid, tile, axis=0),
                                  tokens)
        p = self.parallel
        if not p.sequence_axes:
            return tokens
        n, total = self.length, self._padded_length()
        if total != n:
            tokens = jax.tree.map(
                lambda a: jnp.pad(a, ((0, total - n),) + ((0, 0),) * (a.ndim - 1)), tokens)
        return sharding.shard_tokens(tokens, p)

    def segment_ids(self) -> Int[Array, " S"] | None:
        """This device's segment ids of the attention's sequence: int32, 0 for the
        text prefix and the video tokens, -1 for the devices' padding; `None` when
        nothing is padded."""
        p = self.parallel
        if not p.sequence_axes:
            return None
        n, total = self.length, self._padded_length()
        if total == n:
            return None
        ids = jnp.where(jnp.arange(total) < n, 0, -1).astype(jnp.int32)
        ids = sharding.shard_tokens(ids, p)
        if self.text_len:  # the text is never padding
            ids = jnp.concatenate([jnp.zeros((self.text_len,), jnp.int32), ids])
        return ids

    def attention_inputs(self, rope=None) -> AttentionInputs:
        """What each self-attention takes in this layout ([`AttentionInputs`][]):
        `rope`, this device's RoPE tables as [`to_tokens`][vidax_eqx.models.TokenLayout.to_tokens]
        returned them (or `None`), with the segment ids, the mask and the video
        sparse option of the layout."""
        return AttentionInputs(rope, self.segment_ids(), self.mask, self.video_sparse)

    def from_tokens(self, tokens):
        """The inverse of [`to_tokens`][vidax_eqx.models.TokenLayout.to_tokens]: the
        whole video in raster order from every device's rows.

        **Arguments:**

        - `tokens`: an array or a PyTree of arrays, each this device's rows (a model's
            output projection: gather small arrays, see
            [`vidax_eqx.nn.sharding.gather_tokens`][]).

        **Returns:**

        The same structure with `F * H * W` rows in raster order, the same on every
        device.
        """
        n, tile = self.length, self.tile
        tokens = jax.tree.map(lambda a: a[:n], sharding.gather_tokens(tokens, self.parallel))
        if tile is not None:
            tokens = jax.tree.map(lambda a: kernels.tile_unpermute(a, self.grid, tile, axis=0),
                                  tokens)
        return tokens
