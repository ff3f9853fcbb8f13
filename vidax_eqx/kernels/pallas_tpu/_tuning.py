"""The splash kernels' tiles, per TPU generation and problem: a table measured on the chip.

Splash attention's speed is configuration: the tiles of its forward, dK/dV and dQ
kernels, the key sub-block each forward / dK/dV step computes at a time (`*_compute`),
whether the backward is one fused kernel (dQ, dK and dV from one recomputation of the
probabilities: two matmuls fewer per block, but one partial dQ per key block, kept in
memory until they are summed) and the scoped VMEM limit the larger tiles need. JAX's
defaults (128 everywhere) run at a tenth of the chip's matmul rate on video lengths.

[`SplashBlocks`][vidax_eqx.kernels.SplashBlocks] is one configuration; `TABLES` holds,
per chip generation (`jax.Device.device_kind`), the configurations measured fastest
(`benchmarks/tpu/tpu_attention.py --sweep`), with the chip, JAX version and date of the
measurement; [`choose_blocks`][] picks the row for a problem, shrinks tiles that would
pad a sequence by more than 2%, and switches the fused backward off where its partial
dQ would not fit the budget. A user's explicit blocks (`PallasTpu(block_q=...)` or
`PallasTpu(blocks=SplashBlocks(...))`) are used as given.
"""

import dataclasses
import functools
import math

import jax


LANES = 128  # TPU tiles are multiples of the 128-lane vector width.
# The share of the device's memory the fused backward's partial dQ may take by default: 6
# GB on a 16 GB v5e, which holds Wan 14B's 40 heads at 32,768 tokens (5.4 GB).
FUSED_BWD_SHARE = 3 / 8
MAX_PADDING = 0.02  # the share of extra tokens a table's tile may cost a sequence


@dataclasses.dataclass(frozen=True)
class SplashBlocks:
    """The tiles and settings of the splash kernels for one problem.

    **Arguments:**

    - `block_q`, `block_kv`, `block_kv_compute`: the forward's query tile, key tile, and
        the part of the key tile computed at a time.
    - `block_q_dkv`, `block_kv_dkv`, `block_kv_dkv_compute`: the same for the dK/dV (or
        fused) backward kernel.
    - `block_q_dq`, `block_kv_dq`: the dQ kernel's tiles (unused by a fused backward).
    - `fused_bwd`: one backward kernel for dQ, dK and dV. It keeps one partial dQ per
        key tile, `S_k / block_kv_dkv` copies of q's size, until they are summed;
        `PallasTpu(fused_bwd_max_bytes=...)` bounds that memory (above it the two
        kernels run instead).
    - `vmem_limit_bytes`: the kernels' scoped VMEM limit (`None`: the compiler's
        default, 16 MiB on v5e), which larger tiles need raised.

    Every tile is a positive multiple of 128 and every `*_compute` divides its tile.
    """

    block_q: int = 512
    block_kv: int = 512
    block_kv_compute: int | None = None
    block_q_dkv: int | None = None
    block_kv_dkv: int | None = None
    block_kv_dkv_compute: int | None = None
    block_q_dq: int | None = None
    block_kv_dq: int | None = None
    fused_bwd: bool = False
    vmem_limit_bytes: int | None = None

    def __post_init__(self):
        # Unset backward tiles default to the forward's (as splash's own BlockSizes).
        defaults = dict(
            block_kv_compute=self.block_kv, block_q_dkv=self.block_q, block_kv_dkv=self.block_kv,
            block_q_dq=self.block_q, block_kv_dq=self.block_kv,
        )
        for field, value in defaults.items():
            if getattr(self, field) is None:
                object.__setattr__(self, field, value)
        if self.block_kv_dkv_compute is None:
            object.__setattr__(self, "block_kv_dkv_compute", self.block_kv_dkv)
        for field in _TILES:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % LANES:
                raise ValueError(
                    f"SplashBlocks `{field}` must be a positive multiple of {LANES}; received {value!r}."
                )
        for compute, tile in (("block_kv_compute", "block_kv"), ("block_kv_dkv_compute", "block_kv_dkv")):
            if getattr(self, tile) % getattr(self, compute):
                raise ValueError(
                    f"SplashBlocks `{compute}` must divide `{tile}`; received {getattr(self, compute)} "
                    f"and {getattr(self, tile)}."
                )
        if self.vmem_limit_bytes is not None and (
            not isinstance(self.vmem_limit_bytes, int) or self.vmem_limit_bytes <= 0
        ):
            raise ValueError(
                f"SplashBlocks `vmem_limit_bytes` must be a positive int or None; received "
                f"{self.vmem_limit_bytes!r}."
            )

    @property
    def q_tiles(self) -> tuple[int, ...]:
        """The tiles along the query axis (its padded length is a multiple of each)."""
        return (self.block_q, self.block_q_dkv) + (() if self.fused_bwd else (self.block_q_dq,))

    @property
    def kv_tiles(self) -> tuple[int, ...]:
        """The tiles along the key axis."""
        return (self.block_kv, self.block_kv_dkv) + (() if self.fused_bwd else (self.block_kv_dq,))

    def fit(self, S_q: int, S_k: int) -> "SplashBlocks":
        """These blocks for sequences of `S_q` queries and `S_k` keys: no tile longer
        than its sequence rounded up to 128 (compute sub-blocks shrunk with it)."""
        q_cap, kv_cap = _round_up(S_q, LANES), _round_up(S_k, LANES)
        changes = {f: min(getattr(self, f), q_cap) for f in ("block_q", "block_q_dkv", "block_q_dq")}
        changes.update({f: min(getattr(self, f), kv_cap) for f in ("block_kv", "block_kv_dkv", "block_kv_dq")})
        for compute, tile in (("block_kv_compute", "block_kv"), ("block_kv_dkv_compute", "block_kv_dkv")):
            c = min(getattr(self, compute), changes[tile])
            changes[compute] = c if changes[tile] % c == 0 else changes[tile]
        return dataclasses.replace(self, **changes)

    def padded(self, S_q: int, S_k: int) -> tuple[int, int]:
        """`(S_q_pad, S_k_pad)`: the lengths the kernels run on (multiples of every tile)."""
        return _round_up(S_q, math.lcm(*self.q_tiles)), _round_up(S_k, math.lcm(*self.kv_tiles))


_TILES = (
    "block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
    "block_kv_dkv_compute", "block_q_dq", "block_kv_dq",
)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class TuningTable:
    """The measured configurations of one chip generation.

    `rows`: `(mask, min_len, blocks)` with `mask` one of `"full"`, `"causal"`,
    `"block_causal"` (a frame-block causal mask without a window), `"local"` (a sliding
    window, or a frame-block causal mask with one) and `"tile"` (a sliding tile mask):
    the row of a
    problem is that of its mask with the largest `min_len` not above its key length.
    """

    device_kind: str
    measured: str  # "YYYY-MM-DD, JAX x.y.z, benchmarks/tpu/tpu_attention.py --sweep"
    rows: tuple[tuple[str, int, SplashBlocks], ...]

    def lookup(self, mask: str, S_k: int) -> SplashBlocks:
        best = None
        for kind, min_len, blocks in self.rows:
            if kind == mask and min_len <= S_k and (best is None or min_len >= best[0]):
                best = (min_len, blocks)
        if best is None:
            return _FALLBACK
        return best[1]


# The configuration of a chip with no table (and before any measurement): JAX's
# splash at 512-token tiles, unfused, the default VMEM limit (what this library ran
# before its tables).
_FALLBACK = SplashBlocks(512, 512)

_MiB = 2**20

TABLES: dict[str, TuningTable] = {
    "TPU v5 lite": TuningTable(
        device_kind="TPU v5 lite",
        measured=(
            "2026-12-05, JAX 0.10.2, one TPU v5e chip (bf16 matmul 184.5 TFLOP/s), "
            "benchmarks/tpu/tpu_attention.py --sweep and its table: 12 heads of 128, bf16, at "
            "32,768 and 8,192 tokens (full: forward, dK/dV, dQ and fused tiles; causal: "
            "forward, then its finalists' backward)"
        ),
        rows=(
            ("full", 0, SplashBlocks(512, 512)),
            # 8,192 tokens (the table run): splash at these tiles 2.66 ms forward (0.83 of
            # matmul), 9.27 ms with the fused backward, the fastest of the configurations
            # timed (1024-token query tiles: 2.68 / 9.60 ms).
            ("full", 4096, SplashBlocks(
                2048, 2048, 1024, block_q_dkv=1024, block_kv_dkv=2048, block_kv_dkv_compute=512,
                block_q_dq=2048, block_kv_dq=1024, fused_bwd=True, vmem_limit_bytes=64 * _MiB)),
            # 32,768 tokens: forward 39.1 ms (0.92 of matmul); forward + fused backward
            # 130.3 ms (0.83), unfused (dQ 2048 / 1024) 162.2 ms; JAX's defaults: 10x slower.
            ("full", 16384, SplashBlocks(
                2048, 2048, 1024, block_q_dkv=1024, block_kv_dkv=2048, block_kv_dkv_compute=512,
                block_q_dq=2048, block_kv_dq=1024, fused_bwd=True, vmem_limit_bytes=64 * _MiB)),
            ("causal", 0, SplashBlocks(512, 512)),
            # 32,768 tokens: forward 22.0 ms (against 32.3 at 512-token tiles); with the
            # fused backward 77.6 ms in all, unfused 91.8.
            ("causal", 4096, SplashBlocks(
                1024, 2048, 512, block_q_dkv=1024, block_kv_dkv=1024, block_kv_dkv_compute=512,
                block_q_dq=1024, block_kv_dq=1024, fused_bwd=True, vmem_limit_bytes=64 * _MiB)),
            # Frame-block causal (`BlockCausalMask` without a window): the causal row's
            # tiles up to 16,384 tokens; above, a 2048-key backward. At Wan 480p's 32,760
            # tokens in one-frame blocks (2026-12-06, `benchmarks/tpu/tpu_sparse.py --section BC`): forward
            # 24.7 ms, forward + backward 80.7 ms (0.607 / 0.609 of full attention), against
            # 24.8 / 83.7 ms with the causal row's tiles.
            ("block_causal", 0, SplashBlocks(512, 512)),
            ("block_causal", 4096, SplashBlocks(
                1024, 2048, 512, block_q_dkv=1024, block_kv_dkv=1024, block_kv_dkv_compute=512,
                block_q_dq=1024, block_kv_dq=1024, fused_bwd=True, vmem_limit_bytes=64 * _MiB)),
            ("block_causal", 16384, SplashBlocks(
                512, 2048, 512, block_q_dkv=512, block_kv_dkv=2048, block_kv_dkv_compute=512,
                block_q_dq=512, block_kv_dq=2048, fused_bwd=True, vmem_limit_bytes=64 * _MiB)),
            ("local", 0, SplashBlocks(512, 512)),
            ("local", 4096, SplashBlocks(
                1024, 2048, 512, block_q_dkv=1024, block_kv_dkv=1024, block_kv_dkv_compute=512,
                block_q_dq=1024, block_kv_dq=1024, vmem_limit_bytes=64 * _MiB)),
            ("tile", 0, SplashBlocks(512, 512)),
        ),
    ),
}
"""The measured tables, by `jax.Device.device_kind`."""

DEFAULT_DEVICE_KIND = "TPU v5 lite"
"""The table of a program lowered for a TPU from a host without one."""


@functools.lru_cache(maxsize=None)
def device_kind() -> str | None:
    """The device kind of this host's TPU, or `None` without one."""
    try:
        tpus = jax.devices("tpu")
    except RuntimeError:
        return None
    return tpus[0].device_kind if tpus else None


@functools.lru_cache(maxsize=None)
def device_memory_bytes() -> int:
    """The memory of this host's TPU (16 GiB when unknown: v5e's)."""
    try:
        stats = jax.devices("tpu")[0].memory_stats() or {}
    except RuntimeError:
        stats = {}
    return int(stats.get("bytes_limit", 16 * 2**30))


def table_for(kind: str | None) -> TuningTable | None:
    """The table of a chip generation (`None`: the default one)."""
    return TABLES.get(kind or DEFAULT_DEVICE_KIND)


def choose_blocks(
    *, mask: str, batch: int, heads: int, S_q: int, S_k: int, head_dim: int, itemsize: int,
    fused_bwd_max_bytes: int | None = None, kind: str | None = None,
) -> SplashBlocks:
    """The table's blocks for one problem, fitted to it.

    **Arguments:**

    - `mask`: `"full"`, `"causal"`, `"block_causal"`, `"local"` or `"tile"`.
    - `batch`, `heads`, `S_q`, `S_k`, `head_dim`, `itemsize`: the problem (q's dtype size).
    - `fused_bwd_max_bytes`: the most memory the fused backward's partial dQ may take
        (`None`: `FUSED_BWD_SHARE` of the device's memory).
    - `kind`: the chip's device kind (`None`: this host's TPU, else the default table).
    """
    table = table_for(kind or device_kind())
    blocks = (table.lookup(mask, S_k) if table is not None else _FALLBACK).fit(S_q, S_k)
    blocks = _limit_padding(blocks, S_q, S_k)
    if blocks.fused_bwd:
        budget = (int(device_memory_bytes() * FUSED_BWD_SHARE) if fused_bwd_max_bytes is None
                  else fused_bwd_max_bytes)
        S_qp, S_kp = blocks.padded(S_q, S_k)
        partial = batch * heads * S_qp * head_dim * itemsize * (S_kp // blocks.block_kv_dkv)
        if partial > budget:
            blocks = dataclasses.replace(blocks, fused_bwd=False)
    return blocks


# The rate of the forward kernel at a tile of this many tokens (its smaller side), as a
# share of its rate at 2048: what padding a sequence to a larger tile is weighed against.
TILE_RATE = {128: 0.30, 256: 0.55, 512: 0.80, 1024: 0.95, 2048: 1.0}


def _limit_padding(blocks: SplashBlocks, S_q: int, S_k: int) -> SplashBlocks:
    """Of the blocks and their tiles halved along either axis (down to 128), the one
    with the least estimated time: padded work divided by the tile's rate. A tile whose
    padding stays within `MAX_PADDING` of the next multiple of 128 is kept as is."""
    best, best_cost = None, None
    queue = [blocks]
    seen = set()
    while queue:
        b = queue.pop()
        if b in seen:
            continue
        seen.add(b)
        S_qp, S_kp = b.padded(S_q, S_k)
        tile = min(b.block_q, b.block_kv)
        rate = TILE_RATE.get(tile, TILE_RATE[min(TILE_RATE, key=lambda t: abs(t - tile))])
        cost = S_qp * S_kp / rate
        if best_cost is None or cost < best_cost * (1 - 1e-9):
            best, best_cost = b, cost
        q_floor, kv_floor = _round_up(S_q, LANES), _round_up(S_k, LANES)
        if S_qp > q_floor * (1 + MAX_PADDING) and max(b.q_tiles) > LANES:
            queue.append(_halve(b, "q"))
        if S_kp > kv_floor * (1 + MAX_PADDING) and max(b.kv_tiles) > LANES:
            queue.append(_halve(b, "kv"))
    return best


def _halve(blocks: SplashBlocks, axis: str) -> SplashBlocks:
    """The largest tiles along `axis` halved (to multiples of 128)."""
    fields = ("block_q", "block_q_dkv", "block_q_dq") if axis == "q" else ("block_kv", "block_kv_dkv", "block_kv_dq")
    top = max(getattr(blocks, f) for f in fields)
    half = max(LANES, _round_up(top // 2, LANES))
    changes = {f: half for f in fields if getattr(blocks, f) == top}
    if axis == "kv":
        for compute, tile in (("block_kv_compute", "block_kv"), ("block_kv_dkv_compute", "block_kv_dkv")):
            t = changes.get(tile, getattr(blocks, tile))
            c = min(getattr(blocks, compute), t)
            changes[compute] = c if t % c == 0 else t
    return dataclasses.replace(blocks, **changes)
