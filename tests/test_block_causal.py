"""Frame-block causal attention (`kernels.BlockCausalMask`) against the float64 oracle.

The mask's dense form is `oracle.block_causal_dense`, from the documented semantics
and nothing of `vidax_eqx`: the video's tokens in raster order, frames grouped into
blocks of `k`, a video query of frame `f` seeing the video keys of frames `g` with
`g // k <= f // k` (and `> f // k - window`), text seeing and seen by every token,
positions outside the sequence padding. `oracle.attention` takes it as a boolean mask.

Checked, for `"xla"`, `Blockwise` with small blocks (many tiles, most hidden) and the
splash kernel in interpret mode: forward `out` / `lse` and the gradients of q, k, v
and sinks (by `jax.vjp` of `attention_fwd` with a random cotangent on `(out, lse)`),
with a ragged last block, text prefix / suffix, a rolling window, GQA, segment ids,
key lengths and sinks; a chunk of the sequence by explicit positions (as ring
attention passes them); that the kernels skip hidden blocks (NaN values there do not
reach the rows that cannot see them); the mask's own keys and density; the errors.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
from vidax_eqx import kernels


F32 = np.float32
TPU = kernels.PallasTpu(interpret=True, block_q=128, block_kv=128)
IMPLS = [
    pytest.param("xla", id="xla"),
    pytest.param(kernels.Blockwise(block_q=16, block_kv=16), id="blockwise16"),
    pytest.param(TPU, id="pallas_tpu"),
]


def test_dense_oracle_by_hand():
    """`block_causal_dense` on a case small enough to write out: 3 frames of one token,
    blocks of 2 frames (the last block a single frame), one text token before."""
    vis = oracle.block_causal_dense((3, 1, 1), 2, text_len=1)
    want = np.array([[1, 1, 1, 1],   # text sees everything
                     [1, 1, 1, 0],   # frame 0 (block 0): text, frames 0 and 1
                     [1, 1, 1, 0],   # frame 1 (block 0)
                     [1, 1, 1, 1]],  # frame 2 (block 1)
                    bool)
    np.testing.assert_array_equal(vis, want)
    # A window of one block: block 1 no longer sees block 0.
    vis = oracle.block_causal_dense((3, 1, 1), 2, window=1)
    np.testing.assert_array_equal(vis, [[1, 1, 0], [1, 1, 0], [0, 0, 1]])


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    grid: tuple
    frames_per_block: int
    window: int | None = None
    text_len: int = 0
    text_position: str = "prefix"
    B: int = 1
    H: int = 2
    H_kv: int = 2
    D: int = 8
    segments: bool = False
    kv_lengths: bool = False
    sinks: bool = False

    def mask(self) -> kernels.BlockCausalMask:
        return kernels.BlockCausalMask(self.grid, self.frames_per_block, window=self.window,
                                       text_len=self.text_len, text_position=self.text_position)

    def dense(self, q_pos=None, kv_pos=None):
        return oracle.block_causal_dense(self.grid, self.frames_per_block, self.window, self.text_len,
                                         self.text_position, q_pos, kv_pos)


CONFIGS = [
    # 5 frames in blocks of 2 (the last block one frame), text prefix, GQA, segment ids, sinks.
    Config("ragged-prefix-gqa-segments-sinks", (5, 4, 8), 2, text_len=7, B=2, H=4, H_kv=2,
           segments=True, sinks=True),
    # Frame-causal with a rolling window of 2 blocks, no text, key lengths.
    Config("window-kvlengths", (6, 4, 8), 1, window=2, B=2, kv_lengths=True),
    # Blocks of 3 frames, text after the video.
    Config("suffix", (6, 4, 6), 3, text_len=20, text_position="suffix"),
]


def _inputs(cfg: Config, S: int) -> dict:
    rng = np.random.default_rng(len(cfg.name))
    a = harness.attention_inputs(cfg.B, S, cfg.H, cfg.D, H_kv=cfg.H_kv, rng=rng, dlse=True, sinks=cfg.sinks)
    if cfg.segments:
        a["seg"] = harness.segment_ids(rng, cfg.B, S, scattered=False, pad=(0, 0), holes=0.1)
    if cfg.kv_lengths:
        a["kv_lengths"] = np.array([S, S - 37], np.int32)[: cfg.B]
    return a


def run_kernel(impl, mask, a, q_pos=None, kv_pos=None):
    """`out, lse` of `attention_fwd` and the VJP of `(out, lse)` w.r.t. q, k, v, sinks,
    in one jitted program; NumPy results."""
    kw = {"mask": mask, "implementation": impl}
    if "seg" in a:
        kw["segment_ids"] = jnp.asarray(a["seg"])
    if "kv_lengths" in a:
        kw["kv_lengths"] = jnp.asarray(a["kv_lengths"])
    if q_pos is not None:
        kw["q_positions"], kw["kv_positions"] = jnp.asarray(q_pos), jnp.asarray(kv_pos)

    def f(q, k, v, sinks, dout, dlse):
        fwd = lambda q, k, v, sinks: kernels.attention_fwd(q, k, v, sinks=sinks, **kw)
        (out, lse), vjp = jax.vjp(fwd, q, k, v, sinks)
        return out, lse, vjp((dout, dlse))

    args = [jnp.asarray(a[n]) if n in a else None for n in ("q", "k", "v", "sinks", "dout", "dlse")]
    return jax.tree.map(np.asarray, jax.jit(f)(*args))


def check(got, a, dense):
    ref = oracle.attention(a["q"], a["k"], a["v"], mask=dense, sinks=a.get("sinks"),
                           segment_ids=a.get("seg"), kv_lengths=a.get("kv_lengths"),
                           dout=a["dout"], dlse=a["dlse"])
    out, lse, (dq, dk, dv, dsinks) = got
    oracle.assert_close(out, ref.out, F32, "out")
    oracle.assert_close(lse, ref.lse, F32, "lse")
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv), ("dsinks", dsinks)):
        want = getattr(ref, name)
        if want is None:
            assert g is None, name
            continue
        assert np.all(np.isfinite(g)), f"{name} has non-finite values"
        oracle.assert_close(g, want, F32, name)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_matches_oracle(impl, cfg):
    mask = cfg.mask()
    dense = cfg.dense()
    assert dense.shape == (mask.seq_len,) * 2 and dense.any() and not dense.all()
    a = _inputs(cfg, mask.seq_len)
    check(run_kernel(impl, mask, a), a, dense)


def test_uneven_fused_tiles():
    """The chip's tiles for the mask (`"block_causal"`: query tiles smaller than key
    tiles, the fused backward) over blocks that do not line up with them: 256-token
    frames under 512 x 1024 tiles, the keys padded to the tile (interpret mode)."""
    cfg = Config("uneven-tiles", (5, 8, 32), 1, text_len=9, D=16)
    blocks = kernels.SplashBlocks(512, 1024, 512, block_q_dkv=512, block_kv_dkv=1024,
                                  block_kv_dkv_compute=512, block_q_dq=512, block_kv_dq=1024,
                                  fused_bwd=True)
    mask = cfg.mask()
    a = _inputs(cfg, mask.seq_len)
    check(run_kernel(kernels.PallasTpu(interpret=True, blocks=blocks), mask, a), a, cfg.dense())


# A chunk of the sequence by explicit positions (as ring attention passes them):
# queries running past the end (padding), keys in two pieces, the first starting
# before 0 and the second past the end.
CHUNK = Config("chunk", (5, 4, 8), 2, text_len=7, H=2)


@pytest.mark.parametrize("impl", IMPLS[:2])
def test_chunk_by_positions(impl):
    mask = CHUNK.mask()
    S = mask.seq_len
    q_pos = np.arange(S - 40, S + 8)
    kv_pos = np.concatenate([np.arange(-5, 60), np.arange(S - 30, S + 6)])
    rng = np.random.default_rng(3)
    a = harness.attention_inputs(1, len(q_pos), 2, 8, S_k=len(kv_pos), rng=rng, dlse=True)
    check(run_kernel(impl, mask, a, q_pos, kv_pos), a, CHUNK.dense(q_pos, kv_pos))


@pytest.mark.parametrize("impl", IMPLS)
def test_query_offset(impl):
    """`query_offset`: the last frames' tokens as queries over every key (a chunk attending
    to a cache before it), the cache's empty slots hidden by segment ids; a window of 2
    blocks. The splash kernel serves it (static positions)."""
    mask = kernels.BlockCausalMask((6, 4, 8), 2, window=2, query_offset=128)
    S, S_q = mask.seq_len, mask.seq_len - 128
    rng = np.random.default_rng(11)
    a = harness.attention_inputs(1, S_q, 2, 8, S_k=S, rng=rng, dlse=True)
    seg_kv = np.zeros((1, S), np.int32)
    seg_kv[:, :40] = -1  # empty slots of the cache
    a["seg"] = None
    kw = dict(mask=mask, implementation=impl,
              segment_ids=kernels.SegmentIds(q=jnp.zeros((1, S_q), jnp.int32), kv=jnp.asarray(seg_kv)))

    def f(q, k, v, dout, dlse):
        fwd = lambda q, k, v: kernels.attention_fwd(q, k, v, **kw)
        (out, lse), vjp = jax.vjp(fwd, q, k, v)
        return out, lse, (*vjp((dout, dlse)), None)

    got = jax.tree.map(np.asarray, jax.jit(f)(*(jnp.asarray(a[n]) for n in ("q", "k", "v", "dout", "dlse"))))
    dense = oracle.block_causal_dense((6, 4, 8), 2, 2, q_pos=128 + np.arange(S_q), kv_pos=np.arange(S))
    dense = dense & (seg_kv[0] >= 0)[None, :]
    a.pop("seg")
    check(got, a, dense)


def test_splash_refuses_custom_positions():
    mask = CHUNK.mask()
    q = jnp.zeros((1, 16, 2, 8))
    with pytest.raises(NotImplementedError, match="custom positions"):
        kernels.attention(q, q, q, mask=mask, q_positions=jnp.arange(16), kv_positions=jnp.arange(16),
                          implementation=TPU)


@pytest.mark.parametrize(
    "impl, grid",
    [pytest.param(kernels.Blockwise(block_q=16, block_kv=16), (4, 2, 8), id="blockwise16"),
     pytest.param(TPU, (3, 8, 16), id="pallas_tpu")],
)
def test_hidden_blocks_are_skipped(impl, grid):
    """Values that are NaN in the last frame (whole kernel blocks of keys: 16 tokens for
    `Blockwise(16)`, 128 for the splash kernel at 128) leave every earlier frame's rows
    finite and equal to the oracle's: their tiles are never computed (a computed tile
    would carry `0 * NaN` into the rows). The materializing `"xla"` has NaN there."""
    mask = kernels.BlockCausalMask(grid, 1)
    S, last = mask.seq_len, grid[1] * grid[2]
    a = harness.attention_inputs(1, S, 2, 8, seed=5)
    v = a["v"].copy()
    v[:, S - last:] = np.nan
    out = np.asarray(kernels.attention(jnp.asarray(a["q"]), jnp.asarray(a["k"]), jnp.asarray(v),
                                       mask=mask, implementation=impl))
    ref = oracle.attention(a["q"], a["k"], a["v"], mask=oracle.block_causal_dense(grid, 1))
    oracle.assert_close(out[:, : S - last], ref.out[:, : S - last], F32, "out")
    assert np.isnan(out[:, S - last:]).all()
    dense = np.asarray(kernels.attention(jnp.asarray(a["q"]), jnp.asarray(a["k"]), jnp.asarray(v),
                                         mask=mask, implementation="xla"))
    assert np.isnan(dense[:, : S - last]).any()


# ------------------------------------------------------------------------ the mask itself


def test_keys_define_the_mask():
    """`keys` (causal attention on keys with a left window) and `visible` are the
    oracle's mask, padding positions included."""
    for cfg in (*CONFIGS, CHUNK):
        mask = cfg.mask()
        S = mask.seq_len
        pos = np.arange(-3, S + 3)
        np.testing.assert_array_equal(np.asarray(mask.visible(pos, pos)), cfg.dense(pos, pos))
        np.testing.assert_array_equal(mask.visible(pos, pos, np), cfg.dense(pos, pos))
    m = kernels.BlockCausalMask((21, 30, 52), 3, text_len=512)
    assert (m.block_len, m.blocks, m.video_len, m.seq_len) == (4680, 7, 32760, 33272)
    assert m.video_start == 512 and m.text_start == 0 and m.left is None
    assert kernels.BlockCausalMask((6, 1, 1), 2, window=3).left is None  # every block: no window
    assert kernels.BlockCausalMask((6, 1, 1), 2, window=2).left == 1


def test_density():
    m = kernels.BlockCausalMask((4, 2, 2), 1)
    assert m.density() == pytest.approx(10 / 16)  # 1 + 2 + 3 + 4 of 4 x 4 frame pairs
    m = kernels.BlockCausalMask((21, 2, 2), 1)
    assert m.density() == pytest.approx(22 / 42)


def test_hashable_static():
    a = kernels.BlockCausalMask((4, 2, 2), 2)
    b = kernels.BlockCausalMask([4, 2, 2], 2)
    assert a == b and hash(a) == hash(b)
    assert "frames_per_block=2" in repr(a)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(grid=(4, 2), frames_per_block=1), r"BlockCausalMask: `grid` must be three positive ints"),
        (dict(grid=(4, 2, 2), frames_per_block=0), r"`frames_per_block` must be an int >= 1; received 0"),
        (dict(grid=(4, 2, 2), window=0), r"`window` must be None .* received 0"),
        (dict(grid=(4, 2, 2), text_len=-1), r"`text_len` must be an int >= 0; received -1"),
        (dict(grid=(4, 2, 2), text_position="middle"), r"`text_position` must be one of"),
        (dict(grid=(4, 2, 2), window=2, text_len=3), r"text \(text_len > 0\) with a rolling `window`"),
        (dict(grid=(4, 2, 2), query_offset=16), r"`query_offset` must be below the sequence's 16 tokens"),
    ],
)
def test_bad_mask(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kernels.BlockCausalMask(**kwargs)


def test_bad_requests():
    mask = kernels.BlockCausalMask((2, 2, 2), 1)
    q = jnp.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match=r"BlockCausalMask is the request's causal structure.*causal=True"):
        kernels.attention(q, q, q, mask=mask, causal=True)
    with pytest.raises(ValueError, match=r"takes no `causal` or `window`.*window=\(4, 0\)"):
        kernels.attention(q, q, q, mask=mask, window=(4, 0))
    with pytest.raises(ValueError, match=r"BlockCausalMask over 8 tokens .* needs S_k == 8 and S_q == 8 .*received S_q=9"):
        kernels.attention(jnp.zeros((1, 9, 2, 8)), q, q, mask=mask)
    # Implementations that cannot evaluate it say so (cuDNN has no such mask).
    with pytest.raises(NotImplementedError, match="frame-block causal mask"):
        kernels.attention(q, q, q, mask=mask, implementation="cudnn")
    with pytest.raises(NotImplementedError, match="frame-block causal mask together with a bias"):
        kernels.attention(q, q, q, mask=mask, bias=jnp.zeros((8, 8)), implementation=TPU)
