"""Cross-lowering: the vendor kernels lowered for their own platform, from this CPU host.

What this suite proves, at the sizes of real models (Wan 2.1 1.3B and 14B,
CogVideoX-5B; 4,096 to 75,600 tokens; bfloat16):

- every Pallas kernel, forward and backward (`jax.grad`), lowers for its platform
  (`.trace(...).lower(lowering_platforms=(p,))`, abstract `jax.ShapeDtypeStruct`
  inputs): Pallas TPU (Mosaic: splash, and flash when a bias is given) for "tpu",
  Pallas GPU (Triton) for "cuda"; alone, inside ring / Ulysses / USP attention
  under `jax.shard_map` on the 8 simulated devices, and inside a whole Wan
  attention layer under sp x tp;
- the lowered module calls the vendor kernel (its custom-call target is there),
  and `implementation="auto"` picks the right kernel for each platform;
- memory is O(S) at the HLO level: no array of the lowered module is larger than
  the q, k and v it attends over (see `_check_arrays`);
- a feature a kernel does not serve is refused (`select_implementation` raises, or
  the traced call does): those cases are skipped with the reason, "not served: ...".

What it cannot prove: lowering stops at StableHLO holding the kernels as custom
calls. Mosaic and Triton compile them on the device, so tiling limits, VMEM /
shared-memory budgets and numerics are checked only there (the interpret-mode
tests check numerics on CPU, at small sizes). Nothing here is compiled or run.
"""

import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import harness
from vidax_eqx import kernels, nn, parallel
from vidax_eqx.kernels.pallas_tpu import _gather_plan, _tuning


BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
B = 1
MODELS = {  # name: (heads, head_dim)
    "wan1.3b": (12, 128),
    "wan14b": (40, 128),
    "cogvideox5b": (48, 64),
}
WAN_480P = 21 * 30 * 52  # 81 frames at 480p: 32,760 video tokens
WAN_720P = 21 * 45 * 80  # 81 frames at 720p: 75,600 video tokens
SEQ_LENS = (4_096, WAN_480P, WAN_720P)
FEATURE_SHAPE = ("wan1.3b", WAN_480P)  # where every feature is lowered
FLASH_SEQ = 4_096  # the flash kernel holds its bias as a dense (B, H, S, S) array
SHARDED_SEQ = WAN_480P  # global, Wan 1.3B

MOSAIC, TRITON = "tpu_custom_call", "__gpu$xla.gpu.triton"
TARGETS = {"tpu": MOSAIC, "cuda": TRITON}
VENDOR = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}  # the kernel named for each platform
KERNELS = {  # name: (implementation, platform, with a bias)
    "splash": ("pallas_tpu", "tpu", False),
    "flash": ("pallas_tpu", "tpu", True),  # a bias (or boolean mask) takes the flash kernel
    "triton": ("pallas_gpu", "cuda", False),
}
FEATURES = {
    "non_causal": {},
    "causal": dict(causal=True),
    "window": dict(window=(2_048, 2_048)),
    "segments": dict(segments=True),  # two packed sequences and a padded (-1) tail
    "gqa": dict(kv_heads=4),
    "sinks": dict(sinks=True),
    "soft_cap": dict(logits_soft_cap=30.0),
}
# The one representative feature set of the shape grid: full bidirectional
# attention, what Wan and CogVideoX run.
GRID_FEATURE = "non_causal"
DIRECTIONS = ("fwd", "bwd")
# What "auto" runs when lowered for each platform from a CPU host (cuDNN, first on
# GPU, cannot be traced off a GPU host).
AUTO = {"tpu": ("pallas_tpu", MOSAIC), "cuda": ("pallas_gpu", TRITON), "cpu": ("blockwise", None)}


class QuadraticArray(AssertionError):
    """An array of the lowered module exceeds the O(S) bound."""


# JAX's *fused* splash backward writes one partial dQ per key block,
# (S_k / block_kv_dkv, H, S_q, D) in q's dtype: O(S^2 / block), 115 GB at Wan 14B,
# S = 75,600 with 512-token blocks, which interpret-mode tests at small S cannot see.
# `"pallas_tpu"` runs it only where the chip's table measured it faster and those
# partials fit `FUSED_BWD_SHARE` of the chip's memory (`_tuning.choose_blocks`;
# else the separate dK/dV and dQ kernels): the bound below lets exactly those arrays
# through, and checks their size against that budget.


# -- lowering and the checks --------------------------------------------------------------


def _lower(fn, args, platform: str) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _grad(fn, argnums=(0, 1, 2)):
    """The gradient of a scalar loss of `fn`'s (array) output."""
    return jax.grad(lambda *a: jnp.sum(fn(*a).astype(F32)), argnums=argnums)


def _check_target(text: str, target: str | None, direction: str) -> None:
    """The vendor kernel is called: once forward, and again in the backward."""
    if target is None:  # CPU: no kernel, no custom call of any kind
        assert "custom_call" not in text
        return
    calls = text.count(f"custom_call @{target}(")
    assert calls >= (2 if direction == "bwd" else 1), f"{calls} calls of {target}"
    assert ({MOSAIC, TRITON} - {target}).pop() not in text  # and not the other platform's


_ARRAY = re.compile(r"tensor<((?:\d+x)*)[a-z]\w*>")


def _arrays(text: str):
    """`(shape, per_device)` of every array type in `text`. Per-device: inside a
    `shard_map` body (an `sdy.manual_computation` region, found by its indentation,
    whose closing line lists the global results) or in a private function."""
    body_indent, in_main = None, False
    for line in text.splitlines():
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if stripped.startswith("func.func"):
            in_main = "@main(" in stripped
        if body_indent == indent and stripped.startswith("}"):
            body_indent = None
        opens = "sdy.manual_computation(" in stripped
        per_device = body_indent is not None or opens or not in_main
        for match in _ARRAY.finditer(line):
            yield tuple(int(d) for d in match.group(1).split("x")[:-1]), per_device
        if opens and body_indent is None:
            body_indent = indent


def _fused_dq_partials(shape: tuple[int, ...]) -> bool:
    """Whether `shape` is the fused splash backward's partial dQs, (n, H, S, D) (or with
    batches of one before it), of a kernel that `"pallas_tpu"` runs fused on H heads over
    S tokens (full or causal, the default table); asserts that they fit the budget."""
    while len(shape) > 4 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) != 4:
        return False
    n, H, S, D = shape
    q = jax.ShapeDtypeStruct((B, S, H, D), BF16)
    for causal in (False, True):
        blocks = kernels.splash_blocks(q, q, q, causal=causal)
        if blocks.fused_bwd and n == blocks.padded(S, S)[1] // blocks.block_kv_dkv:
            budget = _tuning.device_memory_bytes() * _tuning.FUSED_BWD_SHARE
            assert math.prod(shape) * jnp.dtype(BF16).itemsize <= budget, shape
            return True
    return False


def _check_arrays(text: str, limit: int, global_limit: int | None = None, exempt=()) -> None:
    """No array of the module has more elements than the q, k and v it attends over.

    `limit` is |q| + |k| + |v| of the kernel calls, per device for the arrays of a
    `shard_map` body (ring and USP: the local blocks; Ulysses: L_local x H, which is
    S x H / sp after the all_to_all; the Wan layer: H / tp heads); `global_limit`
    is the same over the global arrays, for those outside the body (the program's
    arguments and results, the loss cotangent). `exempt`: shapes O(S^2) by design.
    The fused backward's partial dQs pass when their memory is within the budget
    (`_fused_dq_partials`).

    Why this bound: every O(S) array fits under it (q/k/v/out and their gradients
    in any dtype; K and V stacked for one ring hop; q/k/v stacked for one all_to_all;
    splash's lse padded to 128 lanes, 2 * H * D per token at D = 64; tiles padded to
    512 tokens). One (batch, head) score matrix, S_q * S_k elements, is larger
    whenever S > 3 * H * D (every model at S >= 32,760), so there this bound implies
    "no array of S_q * S_k elements"; below that (Wan 14B at S = 4,096: q alone is
    1.25 * S_q * S_k; the global operands of a sharded program) S_q * S_k cannot bound
    even the inputs. And it catches O(S^2 / block) buffers that stay under S_q * S_k
    (the splash dQ buffer under Ulysses: 0.75 * S_q * S_k).
    """
    if global_limit is not None and "sdy.manual_computation(" not in text:
        raise AssertionError("no shard_map body (sdy.manual_computation) in the module")
    for shape, per_device in _arrays(text):
        bound = limit if per_device or global_limit is None else global_limit
        if shape not in exempt and math.prod(shape) > bound and not _fused_dq_partials(shape):
            raise QuadraticArray(
                f"array {'x'.join(map(str, shape))} has {math.prod(shape):,} elements "
                f"> {bound:,} (|q| + |k| + |v|{', per device' if per_device else ''})"
            )


def _qkv_elements(tokens: int, heads: int, kv_heads: int, head_dim: int) -> int:
    return B * tokens * head_dim * (heads + 2 * kv_heads)


# -- 1. one kernel call -------------------------------------------------------------------


def _segment_ids(S: int) -> jax.Array:
    """Two packed sequences and a padded tail (-1), built in the program from an iota."""
    i = jnp.arange(S, dtype=I32)
    return jnp.where(i >= S - S // 16, -1, (i >= S // 2).astype(I32))[None]


def _kernel_call(kernel: str, model: str, S: int, options: dict):
    """`(f, args, ask, limit)`: `f(q, k, v, extra)` calls the kernel (`extra`: the bias
    and sinks arrays), `args` are its abstract arguments, `ask` the same options for
    `select_implementation`, `limit` the O(S) bound."""
    implementation, _, with_bias = KERNELS[kernel]
    options = dict(options)
    H, D = MODELS[model]
    H_kv = options.pop("kv_heads", H)
    segments = options.pop("segments", False)
    extra = {}
    if with_bias:
        extra["bias"] = jax.ShapeDtypeStruct((B, H, S, S), F32)
    if options.pop("sinks", False):
        extra["sinks"] = jax.ShapeDtypeStruct((H,), F32)

    def f(q, k, v, extra):
        seg = _segment_ids(S) if segments else None
        return kernels.attention(
            q, k, v, segment_ids=seg, implementation=implementation, **extra, **options
        )

    q = jax.ShapeDtypeStruct((B, S, H, D), BF16)
    kv = jax.ShapeDtypeStruct((B, S, H_kv, D), BF16)
    seg = jax.ShapeDtypeStruct((B, S), I32) if segments else None
    ask = dict(extra, **options, segment_ids=seg)
    return f, (q, kv, kv, extra), ask, _qkv_elements(S, H, H_kv, D)


def _flash_exempt(kernel: str, S: int, H: int) -> set:
    """The flash path's arrays that the bound does not cover: its dense bias (and the
    bias gradient), `(B, H, S, S)`, O(S^2) by design; and its dQ backward's delta
    broadcast over one key tile, `(B, H, S, 512)`: O(S), but 512 wide per row."""
    if not KERNELS[kernel][2]:
        return set()
    S_pad = -(-S // 512) * 512
    return {(B, H, S_pad, S_pad), (B, H, S_pad, 512)}


def _lower_kernel(kernel, model, S, options, direction):
    implementation, platform, _ = KERNELS[kernel]
    f, args, ask, limit = _kernel_call(kernel, model, S, options)
    try:
        kernels.select_implementation(
            *args[:3], platform=platform, implementation=implementation, **ask
        )
    except NotImplementedError as error:
        pytest.skip(f"not served: {error}")
    text = _lower(f if direction == "fwd" else _grad(f), args, platform)
    _check_target(text, TARGETS[platform], direction)
    _check_arrays(text, limit, exempt=_flash_exempt(kernel, S, MODELS[model][0]))


GRID = [
    pytest.param(kernel, model, S, id=f"{kernel}-{model}-S{S}")
    for kernel in KERNELS
    for model in MODELS
    for S in SEQ_LENS
    if kernel != "flash" or S == FLASH_SEQ
]


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("kernel, model, S", GRID)
def test_shape_grid(kernel, model, S, direction):
    _lower_kernel(kernel, model, S, FEATURES[GRID_FEATURE], direction)


def test_fused_backward_within_its_budget():
    """Wan 1.3B at 32,760 tokens: the table's fused backward holds its 16 partial dQs
    (1.3 GB); with `fused_bwd_max_bytes` below that, the separate dK/dV and dQ kernels
    run and every array of the backward is O(S)."""
    (H, D), S = MODELS["wan1.3b"], WAN_480P
    q = jax.ShapeDtypeStruct((B, S, H, D), BF16)
    partials = (16, H, 32_768, D)
    assert kernels.splash_blocks(q, q, q).fused_bwd and _fused_dq_partials(partials)
    for budget, fused in ((math.prod(partials) * 2, True), (math.prod(partials) * 2 - 1, False)):
        impl = kernels.PallasTpu(fused_bwd_max_bytes=budget)
        assert kernels.splash_blocks(q, q, q, implementation=impl).fused_bwd == fused
        f = lambda q, k, v: kernels.attention(q, k, v, implementation=impl)  # noqa: B023
        text = _lower(_grad(f), (q, q, q), "tpu")
        assert ("16x12x32768x128xbf16" in text) == fused
        _check_arrays(text, _qkv_elements(S, H, H, D))


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_features(kernel, feature, direction):
    model, S = FEATURE_SHAPE
    if kernel == "flash":
        S = FLASH_SEQ
    _lower_kernel(kernel, model, S, FEATURES[feature], direction)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("platform", list(AUTO))
def test_auto_picks_the_platform_kernel(platform, direction):
    model, S = FEATURE_SHAPE
    H, D = MODELS[model]
    q = jax.ShapeDtypeStruct((B, S, H, D), BF16)
    name, target = AUTO[platform]
    if platform == "cuda" and jax.default_backend() == "gpu":
        pytest.skip("on a GPU host, auto lowers cuDNN for cuda")
    assert kernels.select_implementation(q, q, q, causal=True, platform=platform) == name
    f = lambda q, k, v: kernels.attention(q, k, v, causal=True)
    text = _lower(f if direction == "fwd" else _grad(f), (q, q, q), platform)
    _check_target(text, target, direction)
    _check_arrays(text, _qkv_elements(S, H, H, D))


# Sliding tile attention at Wan 480p: 21 x 30 x 52 tokens in tiles of 3 x 6 x 13
# (7 x 5 x 4 tiles of 234 tokens), each query tile seeing a 3 x 3 x 3 window of tiles;
# per-head windows split the heads over two splash kernels.
TILE_MASKS = {
    "shared": kernels.SlidingTileMask((21, 30, 52), (3, 6, 13), (3, 3, 3)),
    "per_head": kernels.SlidingTileMask((21, 30, 52), (3, 6, 13), ((3, 3, 3),) * 6 + ((1, 3, 5),) * 6),
}


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("window", list(TILE_MASKS))
def test_sliding_tile_mask(window, direction):
    """`mask=SlidingTileMask(...)` on `"pallas_tpu"`, Wan 1.3B at 480p (32,760 tokens):
    splash with the mask's block-sparse structure (built in NumPy while tracing) and
    the mask evaluated in the kernel; "auto" picks it for TPU."""
    tm = TILE_MASKS[window]
    H, D = MODELS["wan1.3b"]
    S = tm.seq_len
    q = jax.ShapeDtypeStruct((B, S, H, D), BF16)
    assert kernels.select_implementation(q, q, q, mask=tm, platform="tpu") == "pallas_tpu"
    f = lambda q, k, v: kernels.attention(q, k, v, mask=tm, implementation="pallas_tpu")
    text = _lower(f if direction == "fwd" else _grad(f), (q, q, q), "tpu")
    _check_target(text, MOSAIC, direction)
    _check_arrays(text, _qkv_elements(S, H, H, D))


def test_the_bound_catches_a_score_matrix():
    """The O(S) check bites: the materializing reference ("xla") lowered for TPU holds
    the (B, H, S, S) scores."""
    (H, D), S = MODELS["wan1.3b"], FLASH_SEQ
    q = jax.ShapeDtypeStruct((B, S, H, D), BF16)
    xla = lambda q, k, v: kernels.attention(q, k, v, implementation="xla")
    text = _lower(xla, (q, q, q), "tpu")
    with pytest.raises(QuadraticArray, match=f"{B}x{H}x{S}x{S} "):
        _check_arrays(text, _qkv_elements(S, H, H, D))


# -- 2. sharded --------------------------------------------------------------------------


def _ring(layout: str, implementation: str):
    n = 8
    # Contiguous: 32,760 tokens split over 8 devices as they are; zigzag needs a
    # multiple of 2 * 8, so the sequence is padded and the padding hidden by segment ids.
    S = SHARDED_SEQ if layout == "contiguous" else -(-SHARDED_SEQ // (2 * n)) * 2 * n
    attend = lambda q, k, v, seg: parallel.ring_attention(
        q, k, v, ring_axis="sp", causal=True, segment_ids=seg, layout=layout,
        implementation=implementation,
    )
    return attend, harness.mesh(sp=n), P(None, "sp"), S, n


def _ulysses(implementation: str):
    n = 4  # Wan 1.3B's 12 heads split over 4 devices, not 8
    attend = lambda q, k, v, seg: parallel.sequence_parallel_self_attention(
        q, k, v, "sp", implementation=implementation
    )
    return attend, harness.mesh(sp=n), P(None, "sp"), SHARDED_SEQ, n


def _usp(implementation: str):
    U, R = 4, 2  # ring-major: 32,760 is a multiple of U * R, no padding
    attend = lambda q, k, v, seg: parallel.usp_attention(
        q, k, v, ulysses_axis="sp", ring_axis="ring", causal=True, implementation=implementation
    )
    mesh = harness.mesh(sp=U, ring=R)
    return attend, mesh, P(None, ("ring", "sp")), SHARDED_SEQ, U * R


SHARDED = {
    "ring-contiguous-causal": lambda impl: _ring("contiguous", impl),
    "ring-zigzag-causal-padded": lambda impl: _ring("zigzag", impl),
    "ulysses-sp4": _ulysses,
    "usp-sp4-ring2-causal": _usp,
}


def _lower_sharded(fn, args, platform, direction, argnums=(0, 1, 2)):
    """The lowered text; a request the kernel does not serve is skipped with the reason."""
    try:
        traced = jax.jit(fn if direction == "fwd" else _grad(fn, argnums)).trace(*args)
    except NotImplementedError as error:
        if "does not support" not in str(error):  # not dispatch refusing: a real failure
            raise
        pytest.skip(f"not served: {error}")
    return traced.lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("platform", list(TARGETS))
@pytest.mark.parametrize("case", list(SHARDED))
def test_sequence_parallel(case, platform, direction):
    """Wan 1.3B, 32,760 tokens on the simulated mesh, the platform's kernel named.

    The global inputs come in the layout the function takes (padded, with the
    padding's segment ids; zigzag-permuted), as a model keeps them from its first
    layer to its last: the program is the `shard_map` alone.
    """
    H, D = MODELS["wan1.3b"]
    attend, mesh, seq, S, n = SHARDED[case](VENDOR[platform])
    padded = S > SHARDED_SEQ
    f = jax.shard_map(
        attend, mesh=mesh, in_specs=(seq, seq, seq, seq if padded else None), out_specs=seq
    )
    x = jax.ShapeDtypeStruct((B, S, H, D), BF16)
    seg = jax.ShapeDtypeStruct((B, S), I32) if padded else None
    text = _lower_sharded(f, (x, x, x, seg), platform, direction)
    _check_target(text, TARGETS[platform], direction)
    _check_arrays(text, _qkv_elements(S // n, H, H, D), _qkv_elements(S, H, H, D))


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("platform", list(TARGETS))
def test_wan_attention_layer(platform, direction):
    """`nn.Attention` (Wan 1.3B: dim 1,536, 12 heads, RoPE) under sp = 4 x tp = 2 with
    `implementation="auto"`: ring attention over sp (6 heads per tp rank do not split
    over 4 for Ulysses), Megatron over tp."""
    H, D = MODELS["wan1.3b"]
    sp, tp, S = 4, 2, SHARDED_SEQ
    config = nn.sharding.ParallelConfig(sequence="ring", tp_axis="tp")
    layer = eqx.filter_eval_shape(
        lambda: nn.Attention(H * D, H, parallel=config, dtype=BF16, key=jax.random.key(0))
    )
    params, static = eqx.partition(layer, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    call = nn.sharding.filter_shard_map(
        lambda m, x, cos, sin: jax.vmap(lambda x: m(x, rope=(cos, sin)))(x),
        mesh=harness.mesh(sp=sp, tp=tp),
        in_specs=(nn.sharding.partition_specs(layer), P(None, "sp"), P("sp"), P("sp")),
        out_specs=P(None, "sp"),
    )
    f = lambda params, x, cos, sin: call(eqx.combine(params, static), x, cos, sin)
    x = jax.ShapeDtypeStruct((B, S, H * D), BF16)
    rope = jax.ShapeDtypeStruct((S, D // 2), F32)
    text = _lower_sharded(f, (params, x, rope, rope), platform, direction, argnums=(0, 1))
    _check_target(text, TARGETS[platform], direction)
    _check_arrays(text, _qkv_elements(S // sp, H // tp, H // tp, D), _qkv_elements(S, H, H, D))


# VSA's token grids: (grid, tokens with padding to 4 x 4 x 4 tiles).
VSA_GRIDS = {"480p": ((21, 30, 52), 39_936), "720p": ((21, 45, 80), 92_160)}


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("resolution", list(VSA_GRIDS))
def test_video_sparse_attention(resolution, direction):
    """VSA (`video_sparse_attention`, issue 26) with its Pallas TPU block-sparse fine
    stage, Wan 1.3B: at 480p the (21, 30, 52) token grid in 4 x 4 x 4 tiles is 624
    tiles, 39,936 tokens with padding, 63 key tiles per query tile (sparsity 0.9); at
    720p 1,440 tiles, 144 per query tile (the backward's query tiles in two chunks whose
    tile tables fit SMEM). The tile-gathering kernels (`_gather`: K/V resident in VMEM)
    serve both (forward; dQ and dK/dV in the backward); no array of the module reaches
    S x S elements, nor |q| + |k| + |v|; "auto" picks the kernel for TPU."""
    grid, S = VSA_GRIDS[resolution]
    tile = (4, 4, 4)
    H, D = MODELS["wan1.3b"]
    n = S // 64
    p = _gather_plan.plan((B, S, H, D), (B, S, H, D), BF16, math.ceil(0.1 * n), 64,
                          keys=_gather_plan.KV_KEYS_BWD)
    assert p.C == {"480p": 1, "720p": 2}[resolution]
    q = jax.ShapeDtypeStruct((B, S, H, D), BF16)
    for implementation in ("pallas_tpu", "auto"):
        f = lambda q, k, v: kernels.video_sparse_attention(
            q, k, v, grid, sparsity=0.9, tile=tile, implementation=implementation
        )
        text = _lower(f if direction == "fwd" else _grad(f), (q, q, q), "tpu")
        _check_target(text, MOSAIC, direction)
        names = ("fwd", "dq", "dkv") if direction == "bwd" else ("fwd",)
        for name in names:  # the kernels: forward; dQ and dK/dV in the backward
            assert f'kernel_name = "vidax_tile_gather_{name}"' in text, name
        assert max(math.prod(shape) for shape, _ in _arrays(text)) < S * S
        _check_arrays(text, _qkv_elements(S, H, H, D))
