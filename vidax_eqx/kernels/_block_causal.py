"""Frame-block causal attention: autoregressive video as a structured kernel mask.

An autoregressive video model (SkyReels-V2's diffusion forcing, CausVid,
Self-Forcing) generates its latent frames in blocks of `k` frames, each block
attending to itself and to the blocks before it. Over a video's tokens in raster
order (frames slowest) a block is a contiguous run of `k * H * W` tokens, so the
mask is causal attention at the granularity of blocks: query block `b` sees key
blocks `<= b` (and, with a rolling `window`, only the last `window` of them).

[`BlockCausalMask`][] is that structure as static configuration, passed as
`mask=` like [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask]. It is
evaluated on token positions through one integer map, [`keys`][vidax_eqx.kernels.BlockCausalMask.keys]:
each query and key position gets the index of its block, and the mask is ordinary
causal attention (with a window on the left, in blocks) on those keys. That is
how the implementations run it: the portable ones (`"xla"`, `"blockwise"`) by
passing the keys as positions to their causal mask (`lower`), so `"blockwise"`
skips every tile whose block ranges hide it; the splash kernel on the TPU by a
static splash mask over the same keys, whose hidden blocks it never visits. A
chunk of the sequence (ring attention) evaluates the keys from its global
positions.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from ._tile import TEXT_POSITIONS, Triple, triple


@dataclasses.dataclass(frozen=True)
class BlockCausalMask:
    """Frame-block causal attention over a video's token grid (autoregressive video).

    The video's `F x H x W` tokens are in raster order (frames slowest, width
    fastest: how a patch embedding flattens them), `text_len` text tokens before
    (`"prefix"`) or after (`"suffix"`) them: the attention's sequence length is
    [`seq_len`][vidax_eqx.kernels.BlockCausalMask.seq_len] `= text_len + F * H * W`.

    **Semantics.** The video's frames are grouped into blocks of `frames_per_block`
    consecutive frames (the last block may be shorter). A video query in block
    `b` sees the video keys of blocks `b - window + 1 ... b` (every block `<= b`
    when `window` is `None`): itself and what came before, never the future.
    Text is handled as in [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask]:
    text queries see every token and every query sees the text (text with a
    `window` is refused: it cannot be both). A position outside `[0, seq_len)`
    is padding: it sees nothing and nothing sees it. It combines (logical and)
    with segment ids and key lengths; `causal` and `window` (on positions) are
    refused beside it (it is the causal structure).

    This is the mask of diffusers' `SkyReelsV2Transformer3DModel` with
    `num_frame_per_block = frames_per_block`, and with `window` the attention of
    a rolling key/value cache that keeps the last `window` blocks.

    **Arguments:**

    - `grid`: `(F, H, W)`, the video's token grid (after patchifying).
    - `frames_per_block`: frames per block (1: frame-causal).
    - `window`: the key blocks a query block sees, its own included (`None`: all
        earlier blocks).
    - `text_len`: the number of text tokens (0: video only).
    - `text_position`: `"prefix"` (text before the video) or `"suffix"` (after).
    - `query_offset`: with the default positions, the queries are the positions
        `query_offset + arange(S_q)` (and the keys `arange(S_k)`, `S_k = seq_len`): the
        last `S_q` tokens attending to themselves and to every token before them, as a
        chunk of a video attends to the key/value cache of the frames before it (the
        models' `stream`). Default 0: `S_q = S_k = seq_len`. A static offset keeps the
        mask static, so the splash kernel serves it.

    Frozen and hashable: static configuration, like `causal` or `window`.
    """

    grid: Triple
    frames_per_block: int = 1
    window: int | None = None
    text_len: int = 0
    text_position: str = "prefix"
    query_offset: int = 0

    def __post_init__(self):
        object.__setattr__(self, "grid", triple("grid", self.grid, owner="BlockCausalMask"))
        for name, value, least in (("frames_per_block", self.frames_per_block, 1),
                                   ("text_len", self.text_len, 0), ("query_offset", self.query_offset, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
                raise ValueError(
                    f"BlockCausalMask: `{name}` must be an int >= {least}; received {value!r}."
                )
            object.__setattr__(self, name, int(value))
        if self.window is not None:
            w = self.window
            if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1:
                raise ValueError(
                    "BlockCausalMask: `window` must be None (every earlier block) or the number "
                    f"of key blocks a query block sees, its own included (>= 1); received {w!r}."
                )
            object.__setattr__(self, "window", int(w))
        if self.text_position not in TEXT_POSITIONS:
            raise ValueError(
                f"BlockCausalMask: `text_position` must be one of {TEXT_POSITIONS}; received "
                f"{self.text_position!r}."
            )
        if self.query_offset >= self.seq_len:
            raise ValueError(
                f"BlockCausalMask: `query_offset` must be below the sequence's {self.seq_len} tokens; "
                f"received {self.query_offset}."
            )
        if self.text_len and self.left is not None:
            raise ValueError(
                "BlockCausalMask: text (text_len > 0) with a rolling `window` is not served: "
                "text sees every block and every block sees the text, which a window over "
                f"blocks cannot express; received text_len={self.text_len}, window={self.window}."
            )

    # -- the layout ---------------------------------------------------------------

    @property
    def block_len(self) -> int:
        """Tokens per block, `frames_per_block * H * W`."""
        _, H, W = self.grid
        return self.frames_per_block * H * W

    @property
    def blocks(self) -> int:
        """The number of blocks, `ceil(F / frames_per_block)`."""
        return -(-self.grid[0] // self.frames_per_block)

    @property
    def video_len(self) -> int:
        """Video tokens, `F * H * W`."""
        return math.prod(self.grid)

    @property
    def seq_len(self) -> int:
        """The attention's sequence length: `text_len + video_len`."""
        return self.text_len + self.video_len

    @property
    def video_start(self) -> int:
        """Position of the first video token."""
        return self.text_len if self.text_position == "prefix" else 0

    @property
    def text_start(self) -> int:
        """Position of the first text token."""
        return 0 if self.text_position == "prefix" else self.video_len


    # The head interface of a structured mask (SlidingTileMask's has per-head windows):
    # this mask is the same for every head.

    heads = None

    def check_heads(self, heads: int, where: str = "attention") -> None:
        """Every head count is served (the mask is shared by the heads)."""

    def select_heads(self, start: int, count: int) -> "BlockCausalMask":
        """The mask of a range of query heads: this one (shared by the heads)."""
        return self

    # -- evaluation on positions ----------------------------------------------------

    def keys(self, q_positions, kv_positions, xp=jnp):
        """The block keys of query and key positions (int arrays, any shapes): int32
        `(q_keys, kv_keys)` such that query `i` sees key `j` exactly when
        `q_keys[i] - left <= kv_keys[j] <= q_keys[i]`, with `left = window - 1`
        (unbounded when `window` is `None`): the mask as causal attention on keys.

        A video token's key is its block; a text query's is `blocks` (after every
        video key) and a text key's `-1` (before every query's); padding queries
        get `-2` (no key is that low) and padding keys `blocks + 1` (above every
        query's).
        """
        n = self.blocks

        def decode(p):
            p = xp.asarray(p).astype(xp.int32)
            v = p - self.video_start
            video = (v >= 0) & (v < self.video_len)
            text = (p >= self.text_start) & (p < self.text_start + self.text_len)
            return text, video, xp.where(video, v, 0) // self.block_len

        q_text, q_video, q_block = decode(q_positions)
        k_text, k_video, k_block = decode(kv_positions)
        q_keys = xp.where(q_video, q_block, xp.where(q_text, n, -2)).astype(xp.int32)
        kv_keys = xp.where(k_video, k_block, xp.where(k_text, -1, n + 1)).astype(xp.int32)
        return q_keys, kv_keys

    @property
    def left(self) -> int | None:
        """The window's reach to the left, in blocks (`window - 1`; `None`: unbounded, as
        is a window of every block)."""
        return None if self.window is None or self.window >= self.blocks else self.window - 1

    def visible(self, q_positions, kv_positions, xp=jnp):
        """The dense mask over these positions, bool `(S_q, S_k)` (materializes it:
        references and small problems only)."""
        q_keys, kv_keys = self.keys(q_positions, kv_positions, xp)
        vis = kv_keys[None, :] <= q_keys[:, None]
        if self.left is not None:
            vis = vis & (kv_keys[None, :] >= q_keys[:, None] - self.left)
        return vis

    def chunk_table(self, q_starts, q_size: int, kv_starts, kv_size: int) -> np.ndarray:
        """Which chunks of positions may see which, in NumPy: bool `(len(q_starts),
        len(kv_starts))`, entry `(a, b)` whether some query at positions `[q_starts[a],
        q_starts[a] + q_size)` sees some key at `[kv_starts[b], kv_starts[b] + kv_size)`
        (what ring attention's schedule skips). Exact: a chunk's real keys are a run of
        consecutive blocks (and, without a window, text), so their ranges decide."""

        def ranges(starts, size, real_of):
            pos = np.asarray(starts, np.int64)[:, None] + np.arange(size)[None, :]
            q_keys, kv_keys = self.keys(pos, pos, np)
            keys = q_keys if real_of == "q" else kv_keys
            real = keys >= -1 if real_of == "q" else keys <= self.blocks
            big = np.iinfo(np.int32).max
            return (np.where(real, keys, big).min(1), np.where(real, keys, -big).max(1))

        q_lo, q_hi = ranges(q_starts, q_size, "q")
        k_lo, k_hi = ranges(kv_starts, kv_size, "kv")
        seen = k_lo[None, :] <= q_hi[:, None]
        if self.left is not None:
            seen &= k_hi[None, :] >= q_lo[:, None] - self.left
        return seen

    def density(self) -> float:
        """The fraction of (query, key) pairs of real tokens that are visible (computed
        per block, in NumPy)."""
        F, H, W = self.grid
        frames = np.minimum(self.frames_per_block, F - self.frames_per_block * np.arange(self.blocks))
        tokens = frames.astype(np.int64) * H * W  # per block
        seen = np.cumsum(tokens)  # keys of the blocks up to each one
        if self.left is not None:
            seen = seen - np.concatenate([np.zeros(self.left + 1, np.int64), seen])[: self.blocks]
        T, V = self.text_len, self.video_len
        return float((tokens @ seen + T * (2 * V + T)) / (T + V) ** 2)

    def __repr__(self) -> str:
        extra = "" if self.window is None else f", window={self.window}"
        if self.query_offset:
            extra += f", query_offset={self.query_offset}"
        if self.text_len:
            extra += f", text_len={self.text_len}, text_position={self.text_position!r}"
        return f"BlockCausalMask(grid={self.grid}, frames_per_block={self.frames_per_block}{extra})"


def lower(ops, opts):
    """`(ops, opts)` with a [`BlockCausalMask`][] (`opts.block_causal`) as causal
    attention (and a left window, in blocks) on its keys: the request the portable
    implementations serve with their position masks. Unchanged without one."""
    mask = opts.block_causal
    if mask is None:
        return ops, opts
    S_q, S_k = ops.q.shape[1], ops.k.shape[1]
    q_pos = mask.query_offset + jnp.arange(S_q, dtype=jnp.int32) if ops.q_pos is None else ops.q_pos
    kv_pos = jnp.arange(S_k, dtype=jnp.int32) if ops.kv_pos is None else ops.kv_pos
    q_keys, kv_keys = mask.keys(q_pos, kv_pos)
    window = None if mask.left is None else (mask.left, None)
    return (
        ops._replace(q_pos=q_keys, kv_pos=kv_keys),
        dataclasses.replace(opts, causal=True, window=window, default_positions=False, block_causal=None),
    )
