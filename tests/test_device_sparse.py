"""Sliding tile and video sparse attention on a TPU, with the real Pallas kernels.

Marked `device`: skipped unless `VIDAX_TEST_DEVICE=1` on a TPU (`harness/_device.py`);
`VIDAX_TEST_DEVICE=interpret` runs the same bodies on the CPU, the kernels in Pallas
interpret mode, at the sizes of `tests/test_sparse_pallas.py` and `tests/test_vsa_pallas.py`
(which check the kernels' logic so on every CI run); `interpret-full` at the chip's. Here
Mosaic compiles them and the chip runs them, at Wan's head size (`D = 128`) and over many
kernel blocks, under `jax.default_matmul_precision("highest")`, against the float64 oracle:

- **sliding tile attention** (`kernels.SlidingTileMask` on `"pallas_tpu"`: the splash
    kernel with the mask's block-sparse structure): tiles of 128 tokens (whole kernel
    blocks: every block fully visible or hidden) with a text prefix, and tiles of 32 and 24
    tokens ragged along every grid dimension (the mask evaluated in the kernel on the
    partial blocks) with a text suffix, per-head windows, a window on positions and a soft
    cap, or segment ids; and without text on the tile-gathering kernels
    (`sliding_tile="gather"`: 128-token tiles, and ragged 80-token tiles with per-head
    windows); GQA and sinks throughout. Forward out / lse and the gradients of
    q, k, v and sinks (`attention_fwd`'s VJP, random cotangents on both outputs), against
    `oracle.attention` with the dense mask `oracle.sliding_tile_of` enumerates;
- **frame-block causal attention** (`kernels.BlockCausalMask` on `"pallas_tpu"`): whole
    128-token blocks with a text prefix, 120-token blocks (partial kernel blocks) with a
    text suffix and segment ids, and a rolling window; against `oracle.block_causal_dense`;
- **video sparse attention** (`kernels.video_sparse_attention(...,
    implementation="pallas_tpu")`: the block-sparse fine-stage kernel): the public
    function with GQA, partial tiles and a gate, out and lse and the gradients of q, k, v
    and gate against `oracle.video_sparse_attention`; and the fine stage itself
    (`sparse_fwd` / `sparse_bwd`) on a tile table with unused slots, an empty row and a
    padding-only key tile, in float32 and bfloat16.
"""

import dataclasses
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
from vidax_eqx import kernels


pytestmark = pytest.mark.device

XLA_OPTIMIZED = harness.on_chip()  # on the chip, compiled as XLA does by default
CHIP_SIZES = harness.chip_sizes()
F32 = np.float32


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


# -- sliding tile attention ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    mask: kernels.SlidingTileMask
    H: int = 4
    H_kv: int = 2
    D: int = 128
    segments: bool = False
    options: tuple = ()  # (name, value) pairs: window, logits_soft_cap
    kernel: str = "auto"  # PallasTpu(sliding_tile=...)


PER_HEAD = ((1, 3, 3), (1, 3, 3), (3, 1, 3), (3, 3, 1))  # heads 0-1: a whole GQA group
if CHIP_SIZES:
    STA_CONFIGS = [
        # 128-token tiles (1 x 8 x 16), 4 x 2 x 1 of them, a 128-token text prefix:
        # 1,152 tokens, the kernel's blocks whole tiles.
        Config("aligned-prefix", kernels.SlidingTileMask((4, 16, 16), (1, 8, 16), (3, 1, 1), text_len=128)),
        # 32-token tiles ragged along every dimension (5, 9, 14 over 2, 4, 4), a text
        # suffix, per-head windows, a window on positions and a soft cap: 1,192 tokens.
        Config("ragged-suffix-perhead-window-softcap",
               kernels.SlidingTileMask((5, 9, 14), (2, 4, 4), PER_HEAD, text_len=40,
                                       text_position="suffix"),
               options=(("window", (400, 200)), ("logits_soft_cap", 5.0))),
        # 24-token tiles, ragged along W, a text prefix, segment ids with padding: 452 tokens.
        Config("ragged-prefix-segments",
               kernels.SlidingTileMask((3, 10, 10), (1, 4, 6), (3, 3, 3), text_len=20), segments=True),
        # Without text: the tile-gathering kernels (window runs sliced from K/V in VMEM).
        # 128-token tiles, 4 x 2 x 2 of them: 2,048 tokens; a shared window.
        Config("gather-aligned", kernels.SlidingTileMask((4, 16, 32), (1, 8, 16), (3, 1, 1)), kernel="gather"),
        # 80-token tiles ragged along H and W, per-head windows over a split GQA group:
        # 2 x 3 x 4 tiles, 1,920 tokens in the layout.
        Config("gather-ragged-perhead",
               kernels.SlidingTileMask((4, 9, 35), (2, 4, 10), PER_HEAD), kernel="gather"),
    ]
else:  # interpret mode: test_sparse_pallas's sizes
    STA_CONFIGS = [
        Config("aligned-prefix", kernels.SlidingTileMask((3, 8, 16), (1, 8, 16), (1, 1, 1), text_len=128),
               D=8),
        Config("ragged-suffix-perhead-window-softcap",
               kernels.SlidingTileMask((3, 5, 5), (1, 2, 2), PER_HEAD, text_len=30, text_position="suffix"),
               D=8, options=(("window", (60, 20)), ("logits_soft_cap", 5.0))),
        Config("ragged-prefix-segments",
               kernels.SlidingTileMask((5, 3, 7), (2, 2, 3), (1, 1, 3), text_len=12), D=8, segments=True),
        Config("gather-aligned", kernels.SlidingTileMask((2, 4, 8), (1, 2, 4), (1, 1, 1)), D=8, kernel="gather"),
        Config("gather-ragged-perhead", kernels.SlidingTileMask((3, 5, 5), (1, 2, 2), PER_HEAD), D=8,
               kernel="gather"),
    ]


@pytest.mark.parametrize("cfg", STA_CONFIGS, ids=lambda c: c.name)
def test_sliding_tile_attention(cfg):
    tm, options = cfg.mask, dict(cfg.options)
    S = tm.seq_len
    rng = np.random.default_rng(zlib.crc32(cfg.name.encode()))
    a = harness.attention_inputs(1, S, cfg.H, cfg.D, H_kv=cfg.H_kv, rng=rng, dlse=True, sinks=True)
    seg = None
    impl = harness.pallas_tpu()
    if cfg.kernel != "auto":
        impl = (kernels.PallasTpu(sliding_tile=cfg.kernel, interpret=not harness.on_chip())
                if isinstance(impl, str) else dataclasses.replace(impl, sliding_tile=cfg.kernel))
    kw = dict(mask=tm, implementation=impl, **options)
    if cfg.segments:
        seg = harness.segment_ids(rng, 1, S, ids=2, scattered=False, pad=(0, 0), holes=0.1)
        kw["segment_ids"] = jnp.asarray(seg)

    @jax.jit
    def run(q, k, v, sinks, dout, dlse):
        fwd = lambda q, k, v, sinks: kernels.attention_fwd(q, k, v, sinks=sinks, **kw)
        (out, lse), vjp = jax.vjp(fwd, q, k, v, sinks)
        return out, lse, vjp((dout, dlse))

    out, lse, grads = jax.tree.map(
        np.asarray, run(*(jnp.asarray(a[n]) for n in ("q", "k", "v", "sinks", "dout", "dlse")))
    )
    pos = np.arange(S)
    dense = oracle.sliding_tile_of(tm, pos, pos)  # (windows, S, S)
    ref = oracle.attention(
        a["q"], a["k"], a["v"], mask=dense[0] if len(dense) == 1 else dense, sinks=a["sinks"],
        segment_ids=seg, dout=a["dout"], dlse=a["dlse"], **options,
    )
    oracle.assert_close(out, ref.out, F32, "out")
    oracle.assert_close(lse, ref.lse, F32, "lse")
    for name, got in zip(("dq", "dk", "dv", "dsinks"), grads):
        oracle.assert_close(got, getattr(ref, name), F32, name)


# -- frame-block causal attention -----------------------------------------------------------

if CHIP_SIZES:
    BC_CONFIGS = [
        # 1-frame blocks of 128 tokens (whole kernel blocks), a 128-token text prefix: 896 tokens.
        ("aligned-prefix", kernels.BlockCausalMask((6, 8, 16), 1, text_len=128), False),
        # 2-frame blocks of 120 tokens over 5 frames (the mask evaluated on partial blocks),
        # a text suffix, segment ids with padding: 640 tokens.
        ("ragged-suffix-segments", kernels.BlockCausalMask((5, 6, 10), 2, text_len=40, text_position="suffix"),
         True),
        # A rolling window of 3 one-frame blocks of 64 tokens: 768 tokens.
        ("window", kernels.BlockCausalMask((12, 4, 16), 1, window=3), False),
    ]
else:  # interpret mode: test_block_causal's sizes
    BC_CONFIGS = [
        ("aligned-prefix", kernels.BlockCausalMask((3, 8, 16), 1, text_len=128), False),
        ("ragged-suffix-segments", kernels.BlockCausalMask((5, 4, 8), 2, text_len=12, text_position="suffix"),
         True),
        ("window", kernels.BlockCausalMask((6, 4, 8), 1, window=2), False),
    ]


@pytest.mark.parametrize("name, mask, segments", BC_CONFIGS, ids=[c[0] for c in BC_CONFIGS])
def test_block_causal_attention(name, mask, segments):
    """`kernels.BlockCausalMask` on `"pallas_tpu"` (the splash kernel with the mask's block
    structure), GQA and sinks: out / lse and the gradients of q, k, v and sinks against
    `oracle.attention` with `oracle.block_causal_dense`."""
    S, D = mask.seq_len, 128 if CHIP_SIZES else 8
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    a = harness.attention_inputs(1, S, 4, D, H_kv=2, rng=rng, dlse=True, sinks=True)
    kw = dict(mask=mask, implementation=harness.pallas_tpu())
    seg = None
    if segments:
        seg = harness.segment_ids(rng, 1, S, ids=2, scattered=False, pad=(0, 0), holes=0.1)
        kw["segment_ids"] = jnp.asarray(seg)

    @jax.jit
    def run(q, k, v, sinks, dout, dlse):
        fwd = lambda q, k, v, sinks: kernels.attention_fwd(q, k, v, sinks=sinks, **kw)
        (out, lse), vjp = jax.vjp(fwd, q, k, v, sinks)
        return out, lse, vjp((dout, dlse))

    out, lse, grads = jax.tree.map(
        np.asarray, run(*(jnp.asarray(a[n]) for n in ("q", "k", "v", "sinks", "dout", "dlse"))))
    dense = oracle.block_causal_dense(mask.grid, mask.frames_per_block, mask.window, mask.text_len,
                                      mask.text_position)
    ref = oracle.attention(a["q"], a["k"], a["v"], mask=dense, sinks=a["sinks"], segment_ids=seg,
                           dout=a["dout"], dlse=a["dlse"])
    oracle.assert_close(out, ref.out, F32, "out")
    oracle.assert_close(lse, ref.lse, F32, "lse")
    for n, got in zip(("dq", "dk", "dv", "dsinks"), grads):
        oracle.assert_close(got, getattr(ref, n), F32, n)


# -- video sparse attention: the public function -----------------------------------------------

# Chip: 2 x 3 x 3 tiles of 4 x 4 x 4 tokens (FastVideo's) over a grid partial along H and W,
# 1,152 tokens, 5 of 18 key tiles per query tile. Interpret mode: test_vsa_pallas's.
if CHIP_SIZES:
    GRID, TILE, TOPK, VSA_D, VSA_SEED = (6, 10, 12), (4, 4, 4), 5, 128, 4
else:
    GRID, TILE, TOPK, VSA_D, VSA_SEED = (3, 5, 6), (2, 2, 3), 4, 8, 1


def test_video_sparse_attention():
    """out, the fine stage's lse and the gradients of q, k, v and gate (random cotangents
    on out and lse), GQA (4 query heads over 2), partial tiles, against the float64 VSA
    oracle; the seed's top-k margin is far above float32's error in the coarse scores, so
    the kernel cannot select other tiles than the oracle."""
    S = len(oracle.vsa_layout(GRID, TILE)[0])  # tokens of the tile layout, padding included
    rng = np.random.default_rng(VSA_SEED)
    q, q64 = harness.rounded(rng, (1, S, 4, VSA_D))
    k, k64 = harness.rounded(rng, (1, S, 2, VSA_D))
    v, v64 = harness.rounded(rng, (1, S, 2, VSA_D))
    gate, gate64 = harness.rounded(rng, (1, S, 4, VSA_D))
    dout, dout64 = harness.rounded(rng, (1, S, 4, VSA_D))
    dlse = harness.normal(rng, (1, 4, S))
    ref = oracle.video_sparse_attention(q64, k64, v64, GRID, TILE, TOPK, gate64, dout=dout64, dlse=dlse)
    # The coarse scores are O(1e-2) here (tile means of unit normals, scaled): float32
    # gets them to about 1e-9, so a margin of 1e-5 cannot be crossed.
    assert ref.margin > 1e-5, ref.margin

    def f(q, k, v, gate):
        return kernels.video_sparse_attention(q, k, v, GRID, topk=TOPK, tile=TILE, gate=gate,
                                              return_lse=True, implementation=harness.pallas_tpu())

    @jax.jit
    def forward_and_vjp(q, k, v, gate, dout, dlse):
        (out, lse), vjp = jax.vjp(f, q, k, v, gate)
        return out, lse, vjp((dout, jnp.where(jnp.isfinite(lse), dlse, 0.0)))

    out, lse, grads = forward_and_vjp(q, k, v, gate, dout, jnp.asarray(dlse))
    oracle.assert_close(out, ref.out, F32, "out")
    oracle.assert_close(lse, ref.lse, F32, "lse")
    for name, got in zip(("dq", "dk", "dv", "dgate"), grads):
        oracle.assert_close(got, getattr(ref, name), F32, name)


# -- video sparse attention: the fine stage -----------------------------------------------------

# B=2, 4 query heads over 2 kv heads, 5 query and 6 key tiles of T tokens, 3 slots.
# Chip: tiles of 64 tokens (4 x 4 x 4) and D = 128; interpret mode: test_vsa_pallas's 8 and 16.
B, H, K, NQ, NK, NSEL = 2, 4, 2, 5, 6, 3
T, FINE_D = (64, 128) if CHIP_SIZES else (8, 16)


def _empty_to_inf(lse) -> np.ndarray:
    """The contract's empty lse (the finite `masked` sentinel or -inf) as -inf."""
    lse = np.asarray(lse, np.float64)
    return np.where(lse <= np.finfo(np.float32).min, -np.inf, lse)


def _table_mask(tiles: np.ndarray, kv_valid: np.ndarray) -> np.ndarray:
    """The token mask of a tile table: bool `(B, H, NQ*T, NK*T)`; query token `i` sees key
    `j` iff `j`'s tile is listed for `i`'s tile (per head) and `j` is real."""
    hit = np.zeros((B, H, NQ, NK), bool)
    for b, h, i, s in np.ndindex(tiles.shape):
        if tiles[b, h, i, s] >= 0:
            hit[b, h, i, tiles[b, h, i, s]] = True
    tokens = np.repeat(np.repeat(hit, T, axis=2), T, axis=3)
    return tokens & kv_valid[None, None, None, :]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_fine_stage(dtype):
    """`sparse_fwd` / `sparse_bwd` of the registered `"pallas_tpu"`: out, lse and the
    gradients of q, k, v (random cotangents on out and lse) against the oracle on the
    inputs as rounded to `dtype`; unused (-1) slots, a row that sees nothing and a query
    tile whose only key tile is padding give 0 (and lse empty), padding keys no gradient."""
    impl = harness.registered_pallas_tpu()
    rng = np.random.default_rng(T)
    S_q, S_k = NQ * T, NK * T
    q, q64 = harness.rounded(rng, (B, S_q, H, FINE_D), dtype)
    k, k64 = harness.rounded(rng, (B, S_k, K, FINE_D), dtype)
    v, v64 = harness.rounded(rng, (B, S_k, K, FINE_D), dtype)
    dout, dout64 = harness.rounded(rng, (B, S_q, H, FINE_D), dtype)
    dlse = harness.normal(rng, (B, H, S_q))
    tiles = np.stack([rng.permutation(NK)[:NSEL] for _ in range(B * H * NQ)]).reshape(B, H, NQ, NSEL)
    tiles[0, 0, 1, 1:] = -1  # unused slots
    tiles[1, 3, 0, 0] = -1  # an unused slot before used ones
    tiles[0, 1, 2, :] = -1  # a row that sees nothing
    tiles[1, 2, 4] = [NK - 1, -1, -1]  # only the last key tile, which is all padding
    tiles = tiles.astype(np.int32)
    kv_valid = np.ones(S_k, bool)
    kv_valid[(NK - 1) * T:] = False  # the last key tile: padding only
    kv_valid[T + 1: T + 3] = False  # and two padding keys inside tile 1
    scale = 0.7 / math.sqrt(FINE_D)
    ref = oracle.attention(q64, k64, v64, mask=_table_mask(tiles, kv_valid), scale=scale,
                           dout=dout64, dlse=dlse)

    @jax.jit
    def fine(q, k, v, tiles, kv_valid, dout, dlse):
        out, lse = impl.sparse_fwd(q, k, v, tiles, kv_valid, tile_size=T, scale=scale)
        grads = impl.sparse_bwd(q, k, v, tiles, kv_valid, out, lse, dout, dlse, tile_size=T, scale=scale)
        return out, lse, grads

    out, lse, (dq, dk, dv) = fine(q, k, v, jnp.asarray(tiles), jnp.asarray(kv_valid), dout, jnp.asarray(dlse))
    assert out.dtype == dtype and lse.dtype == jnp.float32
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype,) * 3
    oracle.assert_close(out, ref.out, dtype, "out")
    oracle.assert_close(_empty_to_inf(lse), ref.lse, F32 if dtype == jnp.float32 else dtype, "lse")
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        oracle.assert_close(got, getattr(ref, name), dtype, name)
    rows = np.s_[2 * T: 3 * T]
    assert np.all(np.asarray(out[0, rows, 1]) == 0) and np.all(np.asarray(dq[0, rows, 1]) == 0)
    assert np.all(np.isneginf(_empty_to_inf(lse[1, 2, 4 * T:])))
    assert not np.any(np.asarray(dk[:, (NK - 1) * T:], np.float32))
    assert not np.any(np.asarray(dv[:, (NK - 1) * T:], np.float32))
