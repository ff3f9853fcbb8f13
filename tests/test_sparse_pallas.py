"""Sliding tile attention on `"pallas_tpu"`: the splash kernel with the tile mask's
block-sparse structure, in Pallas interpret mode on CPU.

Against the float64 oracle (`oracle.attention` with the dense mask that
`oracle.sliding_tile_of` enumerates from the documented semantics): forward `out` /
`lse` and the gradients of q, k, v and sinks (by
`jax.vjp` of `attention_fwd` with a random cotangent on both outputs), on grids
that do and do not divide the tiles, text prefix and suffix, shared and per-head
windows (several splash kernels, GQA groups whole and split), with causal / window
/ soft cap / segment ids, lengths padded to 256. Then, without running a kernel:
the in-kernel mask function and the NumPy blocks against the dense mask, the block
map (hidden / fully visible / partial) of a small case written out by hand, the
mask infos against those splash's own `process_mask` builds, and the refusals. The
frame-block causal mask's splash mask (`SplashBlockCausalMask`) is checked the same
way here; its kernels against the oracle in `tests/test_block_causal.py`.
"""

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
from vidax_eqx import kernels
from vidax_eqx._jax_private import make_splash_mha, MultiHeadMask
from vidax_eqx.kernels.pallas_tpu import _mask
from vidax_eqx.kernels._args import Operands, Options
from vidax_eqx.kernels.pallas_tpu._implementation import _head_groups
from vidax_eqx.kernels.pallas_tpu._mask import (
    splash_kernel_for, SplashBlockCausalMask, SplashPositionsMask, SplashTileMask,
)


F32 = np.float32
TPU = kernels.PallasTpu(interpret=True, block_q=128, block_kv=128)


def _dense(tm: kernels.SlidingTileMask, S_pad: int | None = None) -> np.ndarray:
    """The mask at positions `arange(S_pad or seq_len)` (beyond `seq_len`: padding):
    bool `(n_windows, S, S)`."""
    pos = np.arange(tm.seq_len if S_pad is None else S_pad)
    return oracle.sliding_tile_of(tm, pos, pos)


def _local(dense: np.ndarray, local) -> np.ndarray:
    """`dense` ANDed with a window `(left, right)` on positions."""
    if local is None:
        return dense
    left, right = local
    pos = np.arange(dense.shape[-1])
    d = pos[None, :] - pos[:, None]
    return dense & (left is None or d >= -left) & (right is None or d <= right)


# --------------------------------------------------------------- against the oracle


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    mask: kernels.SlidingTileMask
    B: int = 1
    H: int = 2
    H_kv: int = 1
    D: int = 8
    segments: bool = False
    options: tuple = ()  # (name, value) pairs: causal, window, logits_soft_cap


CONFIGS = [
    # Ragged along every dimension (5, 3, 7 over tiles of 2, 2, 3), a text prefix, GQA,
    # segment ids with padding, sinks: 228 tokens, padded to 256.
    Config("prefix-ragged-gqa-segments", kernels.SlidingTileMask((5, 3, 7), (2, 2, 3), (1, 1, 3), text_len=12),
           H=4, H_kv=2, segments=True),
    # Per-head windows: heads 0-1 (kv head 0, a whole GQA group) share a kernel, heads 2
    # and 3 get one each and share kv head 1; a text suffix; ragged along H and W; a
    # window on positions and a soft cap: 138 tokens.
    Config("suffix-perhead-window-softcap",
           kernels.SlidingTileMask((3, 5, 5), (1, 2, 2), ((1, 3, 1), (1, 3, 1), (3, 1, 1), (1, 1, 3)),
                                   text_len=30, text_position="suffix"),
           H=4, H_kv=2, options=(("window", (60, 20)), ("logits_soft_cap", 5.0))),
    # Tiles of 128 tokens: the kernel's blocks are whole tiles, so the video's blocks
    # are fully visible or hidden (computed without a mask); causal cuts the diagonal.
    Config("aligned-causal", kernels.SlidingTileMask((3, 8, 16), (1, 8, 16), (1, 1, 1), text_len=128),
           options=(("causal", True),)),
]


def _inputs(cfg: Config):
    """Global arrays (with dlse and sinks); segment ids: sorted runs of 0 and 1 with
    padding (-1) scattered in."""
    S = cfg.mask.seq_len
    rng = np.random.default_rng(zlib.crc32(cfg.name.encode()))
    a = harness.attention_inputs(cfg.B, S, cfg.H, cfg.D, H_kv=cfg.H_kv, rng=rng, dlse=True,
                                 sinks=True)
    a["seg"] = None
    if cfg.segments:
        a["seg"] = harness.segment_ids(rng, cfg.B, S, ids=2, scattered=False, pad=(0, 0), holes=0.1)
    return a


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_matches_oracle(cfg):
    tm, a, options = cfg.mask, _inputs(cfg), dict(cfg.options)
    kw = dict(mask=tm, implementation=TPU, **options)
    if a["seg"] is not None:
        kw["segment_ids"] = jnp.asarray(a["seg"])

    @jax.jit
    def run(q, k, v, sinks, dout, dlse):
        fwd = lambda q, k, v, sinks: kernels.attention_fwd(q, k, v, sinks=sinks, **kw)
        (out, lse), vjp = jax.vjp(fwd, q, k, v, sinks)
        return out, lse, vjp((dout, dlse))

    out, lse, grads = jax.tree.map(
        np.asarray, run(*(jnp.asarray(a[n]) for n in ("q", "k", "v", "sinks", "dout", "dlse")))
    )
    dense = _dense(tm)
    ref = oracle.attention(
        a["q"], a["k"], a["v"], mask=dense[0] if len(dense) == 1 else dense, sinks=a["sinks"],
        segment_ids=a["seg"], dout=a["dout"], dlse=a["dlse"], **options,
    )
    oracle.assert_close(out, ref.out, F32, "out")
    oracle.assert_close(lse, ref.lse, F32, "lse")
    for name, got in zip(("dq", "dk", "dv", "dsinks"), grads):
        oracle.assert_close(got, getattr(ref, name), F32, name)


# ------------------------------------------------------- the splash mask, in NumPy


MASKS = [  # (mask, padded length, window on positions)
    pytest.param(kernels.SlidingTileMask((5, 3, 7), (2, 2, 3), (1, 1, 3), text_len=12), 256, None,
                 id="prefix-ragged"),
    pytest.param(kernels.SlidingTileMask((3, 5, 5), (1, 2, 2), (3, 1, 1), text_len=30, text_position="suffix"),
                 256, (60, 20), id="suffix-window"),
    pytest.param(kernels.SlidingTileMask((4, 6, 4), (2, 2, 2), (3, 1, 1)), 128, (None, 0), id="video-causal"),
    pytest.param(kernels.SlidingTileMask((3, 8, 16), (1, 8, 16), (1, 1, 1), text_len=128), 512, None,
                 id="aligned"),
]


@pytest.mark.parametrize("tm, S_pad, local", MASKS)
def test_mask_matches_dense(tm, S_pad, local):
    """The kernel's `mask_function` (evaluated here with jnp) and the NumPy blocks
    splash reads are the dense mask, padding (beyond `seq_len`) hidden; the block
    kinds classify it exactly."""
    mask = SplashTileMask(tm, (S_pad, S_pad), local)
    want = _local(_dense(tm, S_pad)[0], local)
    assert not want[tm.seq_len:].any() and not want[:, tm.seq_len:].any()
    pos = jnp.arange(S_pad, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(jax.jit(mask.mask_function)(pos[:, None], pos[None, :])), want)
    for bq, bk in ((128, 128), (64, 128)):
        blocks = want.reshape(S_pad // bq, bq, S_pad // bk, bk)
        kinds = np.where(blocks.all(axis=(1, 3)), 2, np.where(blocks.any(axis=(1, 3)), 1, 0))
        np.testing.assert_array_equal(mask.block_kinds(bq, bk), kinds)
        for i in range(0, S_pad, bq):
            for j in range(0, S_pad, bk):
                np.testing.assert_array_equal(mask[i:i + bq, j:j + bk], want[i:i + bq, j:j + bk])


def _block_map(info, shape: tuple[int, int], dkv: bool) -> np.ndarray:
    """A shrunk splash `MaskInfo` (one head) back to `(q blocks, kv blocks)` kinds: each
    listed block is at `data_next` along the shrunk axis."""
    kinds = np.zeros(shape, np.int32)
    block, data = np.asarray(info.block_mask)[0], np.asarray(info.data_next)[0]
    for r, c in zip(*np.nonzero(block)):
        if dkv:
            kinds[data[r, c], c] = block[r, c]
        else:
            kinds[r, data[r, c]] = block[r, c]
    return kinds


def test_block_map():
    """A 128-token text prefix and three 128-token tiles, each seeing only itself:
    the text blocks are fully visible, the video's diagonal too, the rest hidden;
    with causal, the diagonal (text included) becomes partial and the blocks above
    it hidden. The forward / dQ and dK/dV grids list exactly those blocks."""
    tm = kernels.SlidingTileMask((3, 8, 16), (1, 8, 16), (1, 1, 1), text_len=128)
    expected = {
        False: [[2, 2, 2, 2],
                [2, 2, 0, 0],
                [2, 0, 2, 0],
                [2, 0, 0, 2]],
        True: [[1, 0, 0, 0],
               [2, 1, 0, 0],
               [2, 0, 1, 0],
               [2, 0, 0, 1]],
    }
    for causal, kinds in expected.items():
        kernel = splash_kernel_for((512, 512), 512, causal, None, None, kernels.SplashBlocks(128, 128), True, tm)
        for name, dkv in (("fwd_mask_info", False), ("dq_mask_info", False), ("dkv_mask_info", True)):
            info = getattr(kernel, name)
            np.testing.assert_array_equal(_block_map(info, (4, 4), dkv), kinds, err_msg=f"{causal=} {name}")
            # The grid is shrunk to the visible blocks: the longest row (column) of them.
            longest = max(np.count_nonzero(np.asarray(kinds), axis=0 if dkv else 1))
            assert np.asarray(info.block_mask).shape[2 if not dkv else 1] == longest
            assert info.partial_mask_blocks is None and info.mask_next is None
        # Partially visible blocks (only with causal here) need the mask in the kernel.
        assert (kernel.kwargs["mask_function"] is not None) == causal


def _assert_same_kernel_infos(mask, blocks: kernels.SplashBlocks, q_ids=None):
    """The mask infos `_mask` builds from `mask`'s block kinds are those
    splash's `make_splash_mha` builds by evaluating every block of it in NumPy (with
    `q_ids`, the query ids the kernel's mask function takes instead of positions)."""
    with jax.ensure_compile_time_eval():
        ours = _mask._kernel(mask, blocks, None, True)
        theirs = make_splash_mha(
            MultiHeadMask([mask] * 3), block_sizes=_mask._splash_block_sizes(blocks),
            head_shards=1, q_seq_shards=1, save_residuals=True, attn_logits_soft_cap=None,
            interpret=True,
        )
    if ours.kwargs["mask_function"] is None:  # no partially visible block: no mask needed
        theirs.kwargs["mask_function"] = None
        theirs = type(theirs)(*(None if i is None else i._replace(q_sequence=None) for i in (
            theirs.fwd_mask_info, theirs.dq_mask_info, theirs.dkv_mask_info)), **theirs.kwargs)
    elif q_ids is not None:
        theirs = type(theirs)(*(None if i is None else i._replace(q_sequence=np.asarray(q_ids, np.int32)) for i in (
            theirs.fwd_mask_info, theirs.dq_mask_info, theirs.dkv_mask_info)), **theirs.kwargs)
    assert ours.kwargs == theirs.kwargs
    for name in ("fwd_mask_info", "dq_mask_info", "dkv_mask_info"):
        assert (getattr(ours, name) is None) == (getattr(theirs, name) is None), name
        if getattr(ours, name) is None:
            continue
        for field, a, b in zip(ours.fwd_mask_info._fields, getattr(ours, name), getattr(theirs, name)):
            assert (a is None) == (b is None), (name, field)
            if a is not None:
                a, b = np.asarray(a), np.asarray(b)
                assert a.dtype == b.dtype and a.shape == b.shape, (name, field, a.dtype, b.dtype, a.shape, b.shape)
                np.testing.assert_array_equal(a, b, err_msg=f"{name}.{field}")


@pytest.mark.parametrize("tm, S_pad, local", MASKS)
def test_mask_info_is_splash_own(tm, S_pad, local):
    """The sliding tile mask's mask infos are splash's own (at two tilings)."""
    mask = SplashTileMask(tm, (S_pad, S_pad), local)
    for bq, bk in ((128, 128), (max(128, S_pad // 2), 128)):
        _assert_same_kernel_infos(mask, kernels.SplashBlocks(bq, bk))


@pytest.mark.parametrize(
    "shape, kv_len, window",
    [((512, 512), 512, None), ((512, 512), 500, None), ((512, 768), 700, (None, 0)),
     ((768, 512), 390, (None, 0)), ((1024, 1024), 1000, (200, 50)), ((512, 512), 512, (None, 100))],
)
@pytest.mark.parametrize("fused", [False, True])
def test_positions_mask_info_is_splash_own(shape, kv_len, window, fused):
    """The positions mask (causal / window / padding keys) at a configuration with
    separate backward tiles, unfused and fused (whose dK/dV grid is not shrunk), gives
    splash's own mask infos; the NumPy blocks and the in-kernel function agree with the
    dense definition."""
    mask = SplashPositionsMask(shape, kv_len, window)
    blocks = kernels.SplashBlocks(256, 256, 128, block_q_dkv=128, block_kv_dkv=256, block_kv_dkv_compute=128,
                                  block_q_dq=256, block_kv_dq=128, fused_bwd=fused)
    _assert_same_kernel_infos(mask, blocks)
    q, k = np.arange(shape[0])[:, None], np.arange(shape[1])[None, :]
    left, right = (None, None) if window is None else window
    dense = np.broadcast_to((k < kv_len) & (left is None or k >= q - left) & (right is None or k <= q + right), shape)
    np.testing.assert_array_equal(mask[:, :], dense)
    kinds = mask.block_kinds(128, 256)
    for i in range(kinds.shape[0]):
        for j in range(kinds.shape[1]):
            block = dense[i * 128:(i + 1) * 128, j * 256:(j + 1) * 256]
            assert kinds[i, j] == (2 if block.all() else 1 if block.any() else 0), (i, j)


BLOCK_CAUSAL = [  # (mask, padded length)
    pytest.param(kernels.BlockCausalMask((5, 4, 8), 2, text_len=12), 256, id="prefix-ragged"),
    pytest.param(kernels.BlockCausalMask((6, 4, 8), 1, window=3), 256, id="window"),
    pytest.param(kernels.BlockCausalMask((3, 8, 16), 1, text_len=128, text_position="suffix"), 512,
                 id="aligned-suffix"),
    pytest.param(kernels.BlockCausalMask((4, 4, 12), 3, window=1), 256, id="ragged-window"),
    pytest.param(kernels.BlockCausalMask((8, 4, 8), 2, window=2, query_offset=128), 128, id="query-offset"),
]


@pytest.mark.parametrize("bc, S_pad", BLOCK_CAUSAL)
def test_block_causal_mask_matches_dense(bc, S_pad):
    """The frame-block causal splash mask: its in-kernel function (evaluated with jnp, on
    the per-query ids the kernel takes) and its NumPy blocks are the oracle's dense mask,
    padding hidden; its block kinds classify each block exactly, and its mask infos are
    splash's own but for the query ids."""
    S_k = S_pad + bc.query_offset
    mask = SplashBlockCausalMask(bc, (S_pad, S_k))
    want = oracle.block_causal_dense(bc.grid, bc.frames_per_block, bc.window, bc.text_len,
                                     bc.text_position, bc.query_offset + np.arange(S_pad), np.arange(S_k))
    assert not want[bc.seq_len - bc.query_offset:].any() and not want[:, bc.seq_len:].any()
    ids = jnp.asarray(mask.query_ids())
    got = jax.jit(mask.mask_function)(ids[:, None], jnp.arange(S_k, dtype=jnp.int32)[None, :])
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(mask[:, :], want)
    for bq, bk in ((128, 128), (64, 128), (128, 64)):
        blocks = want.reshape(S_pad // bq, bq, S_k // bk, bk)
        kinds = np.where(blocks.all(axis=(1, 3)), 2, np.where(blocks.any(axis=(1, 3)), 1, 0))
        np.testing.assert_array_equal(mask.block_kinds(bq, bk), kinds)
    _assert_same_kernel_infos(mask, kernels.SplashBlocks(128, 128), q_ids=mask.query_ids())


def test_head_groups():
    """One kernel per distinct head window: whole GQA groups keep their kv head,
    split ones get a kv head per query head; equal windows share one kernel."""
    tm = kernels.SlidingTileMask((3, 5, 5), (1, 2, 2), ((1, 3, 1), (1, 3, 1), (3, 1, 1), (1, 1, 3)))
    groups = _head_groups(tm, 4, 2)
    assert [(m.window, h, kv) for m, h, kv in groups] == [
        ((1, 3, 1), (0, 1), (0,)), ((3, 1, 1), (2,), (1,)), ((1, 1, 3), (3,), (1,)),
    ]
    split = _head_groups(dataclasses.replace(tm, window=((1, 3, 1), (3, 1, 1), (1, 3, 1), (3, 1, 1))), 4, 2)
    assert [(h, kv) for _, h, kv in split] == [((0, 2), (0, 1)), ((1, 3), (0, 1))]
    same = dataclasses.replace(tm, window=((1, 3, 1),) * 4)
    assert _head_groups(same, 4, 2) == [(dataclasses.replace(tm, window=(1, 3, 1)), None, None)]
    assert _head_groups(None, 4, 2) == [(None, None, None)]


def test_tile_aligned_blocks():
    """Tiles of a multiple of 128 tokens give blocks of whole tiles; others keep the
    configured blocks."""
    impl = kernels.PallasTpu(block_q=512, block_kv=256)

    def tiles(tm):
        q = jnp.zeros((1, tm.seq_len, 1, 8), jnp.float32)
        blocks = impl.splash_blocks(Operands(q, q, q), Options(False, None, 1.0, None, True, tile_mask=tm))
        assert (blocks.block_kv_compute, blocks.block_kv_dkv_compute) == (blocks.block_kv, blocks.block_kv_dkv)
        return blocks.block_q, blocks.block_kv

    aligned = kernels.SlidingTileMask((6, 8, 16), (2, 8, 24), (1, 1, 1), text_len=384)  # 384-token tiles
    assert tiles(aligned) == (384, 384)
    assert tiles(kernels.SlidingTileMask((6, 8, 16), (1, 8, 16), (1, 1, 1))) == (512, 256)
    assert tiles(dataclasses.replace(aligned, text_len=100)) == (512, 256)
    assert tiles(kernels.SlidingTileMask((21, 30, 52), (3, 6, 13), (3, 3, 3))) == (512, 256)


# --------------------------------------------------------------------------- refusals


def _qkv(S, H=2):
    q = jnp.ones((1, S, H, 8), jnp.float32)
    return q, q, q


def test_refuses_custom_positions():
    """A splash mask is static over the whole sequence: no chunk by positions."""
    tm = kernels.SlidingTileMask((3, 5, 5), (1, 2, 2), (1, 1, 1), text_len=4)
    pos = jnp.arange(tm.seq_len, dtype=jnp.int32)
    with pytest.raises(NotImplementedError, match="sliding tile mask with custom positions") as err:
        kernels.attention(*_qkv(tm.seq_len), mask=tm, q_positions=pos, kv_positions=pos, implementation=TPU)
    assert "pallas_tpu" in str(err.value)


def test_refuses_bias():
    """A bias takes the flash kernel, which has no tile mask."""
    tm = kernels.SlidingTileMask((3, 5, 5), (1, 2, 2), (1, 1, 1))
    bias = jnp.zeros((tm.seq_len, tm.seq_len), jnp.float32)
    with pytest.raises(NotImplementedError, match="sliding tile mask together with a bias"):
        kernels.attention(*_qkv(tm.seq_len), mask=tm, bias=bias, implementation=TPU)
