"""Wan 2.1 (`vidax_eqx.models.WanTransformer3D`) and CogVideoX-5B
(`vidax_eqx.models.CogVideoXTransformer3D`) at scale. (Wan's wall time against
diffusers is `benchmarks/models_vs_diffusers.py`.)

Each configuration runs in a fresh process (this script with a hidden `--child-*`
flag): bfloat16 weights, one video (batch 1), on 8 simulated CPU devices, built
abstractly (`eqx.filter_eval_shape`: no weight is ever allocated) and compiled ahead
of time (`jax.jit(...).lower(ShapeDtypeStructs).compile()`) through
`models.run_sharded`:

- Wan 2.1 1.3B and 14B, text context (512, 4096), at the `--tokens` video token counts;
- CogVideoX-5B (`CogVideoXConfig(num_attention_heads=48, attention_head_dim=64,
  num_layers=42, use_rotary_positional_embeddings=True)`, the other fields default:
  width 3072, time_embed_dim 512, patch 2), text context (226, 4096), at its one
  resolution, the pipeline's 49 frames x 480 x 720: latents (F, C, H, W) =
  (13, 16, 60, 90), 13 x 30 x 45 = 17,550 video tokens. Its blocks attend over the
  joint sequence [226 text tokens, whole on every device; the video tokens, split
  over sp (padded to a multiple of sp, the padding hidden by segment ids)].

Two meshes:

- `sp8`: sequence parallelism over 8 devices.
- `sp4xtp2`: sequence parallelism over 4 devices x Megatron tensor parallelism over
  2 (heads and MLP features split).

Sequence modes: Ulysses needs the local head count (heads / tp) to be a multiple of
sp: 1.3B has 12 heads (12 % 8 != 0 on sp8, 6 % 4 != 0 on sp4xtp2: ring only), 14B has
40 (40 % 8 == 0, 20 % 4 == 0: both), CogVideoX-5B 48 (both). CogVideoX's joint
attention: Ulysses is `parallel.sequence_parallel_joint_self_attention` (the video
through the all_to_alls, the text's heads taken locally), ring the joint ring
(`parallel.ring_attention(..., text_len=T)`: the video K/V travel, the text K/V never
do). By default every case runs ring attention (contiguous layout) and, where it fits,
Ulysses too; `--sequence` chooses (`auto`:
Ulysses where it fits, ring otherwise; a single mode that cannot serve a case gives a
"not measured" row). The mode is in every row.

Reported per (model, tokens, mesh), per device (each device runs its own SPMD
program: every number below is one device's):

- parameter bytes: from the shapes and `nn.sharding.partition_specs` (bf16; TP shards the
  attention and FFN weights, everything else is replicated).
- XLA temp bytes (`compiled.memory_analysis().temp_size_in_bytes`) of a forward and
  of a training step: `jax.value_and_grad` of an MSE loss (float32) against a target
  of the output's shape, with respect to every array of the model, `remat="full"`
  (each block recomputed in the backward pass), gradients returned with the
  parameters' shardings. `XLA total` = arguments + outputs + temp - aliased.
- `f32 weight copies`: bytes of ENTRY-level instructions of the optimized HLO that
  turn a bf16 parameter into an f32 array of the same shape. XLA's CPU backend runs
  bf16 dots in f32 and hoists these converts out of the layer loop, so on CPU the temp
  bytes hold an f32 copy of (nearly) every weight; a GPU/TPU backend with bf16 dots
  does not. `temp - copies` is the temp with them taken out (an estimate: it assumes
  nothing else shares their buffers).
- FLOPs, three ways, per device:
  - `cost_analysis`: `compiled.cost_analysis()["flops"]`. XLA's HloCostAnalysis
    counts the body of a `while` loop once, whatever its trip count (checked by the
    probe in every run: a `lax.scan` of 4 matmuls reports 1), so with the layers in
    a `lax.scan` and the attention's loops it is far below the work done;
  - `HLO dots`: 2 x (result elements) x (contracted size) of every `dot` of the
    optimized HLO, each `while` body multiplied by its `known_trip_count`, fusions
    and called computations followed, a `conditional` counted by its costliest
    branch (elementwise work not included);
  - `analytic`: the formula below, per device; `analytic (tiles)`: the same with
    the attention's sequences padded as the blockwise kernel pads them (to multiples
    of block_q = 256 queries and block_kv = 512 keys, each at most the length; ring:
    per step, local queries against one local chunk; Ulysses: the whole sequence for
    heads / sp heads), and `HLO / analytic (tiles)`.
- compile time (lower + compile) of each program.
- CogVideoX: bytes communicated, measured and the least possible (below).

Analytic dot FLOPs of one forward (2 flops per multiply-add; `benchmarks/_model_flops.py`
computes them). S tokens, d = dim, f = ffn_dim, L layers, T = 512 text tokens, C = 4096
text width, p = 64 values per patch (16 channels x 1 x 2 x 2), per block:

    self-attention projections q, k, v, o     4 x 2 S d^2  = 8 S d^2
    self-attention QK^T and PV                2 x 2 S^2 d  = 4 S^2 d
    cross-attention projections q, o          2 x 2 S d^2  = 4 S d^2
    cross-attention projections k, v (text)   2 x 2 T d^2  = 4 T d^2
    cross-attention QK^T and PV               2 x 2 S T d  = 4 S T d
    FFN                                       2 x 2 S d f  = 4 S d f

plus, once: the text embedding 2 T C d + 2 T d^2, the patch embedding 2 S p d, the
head 2 S d p, the timestep MLPs 2 (256 d + d^2 + 6 d^2). Per device, with n = sp x tp
devices: every per-token term over n; the text k, v projections over tp only (each
device projects the whole text for its heads), and the text embedding (a TP
`FeedForward`) over tp only; the patch embedding (each device embeds its own share
of the patches) and the head over sp (neither is tensor-parallel); the timestep
embedding on every device.

A training step with `remat="full"` = the forward, the blocks' forward again
(recomputed in the backward), and the backward: 2x a dense layer's forward (dX and
dW; dW only where the input is not differentiated: the patch embedding and the text
embedding's first layer), 2.5x an attention's forward (the blockwise kernel's
backward recomputes QK^T: 5 matmuls against 2). About 4x the forward ("3x forward,
+1x recompute").

CogVideoX-5B, Wan 2.1's formula's counterpart: S video tokens, T = 226 text tokens,
d = 3072 (48 heads x 64), e = 512 (time_embed_dim), C = 4096 text width, p = 64 values
per patch in and out, N = 42 blocks, each over the joint sequence [text; video]:

    joint attention projections to_q, to_k, to_v, to_out  4 x 2 (S+T) d^2   = 8 (S+T) d^2
    joint attention QK^T and PV over (S+T)^2               2 x 2 (S+T)^2 d  = 4 (S+T)^2 d
    FFN (4d features) on S + T tokens                      2 x 2 (S+T) d 4d = 16 (S+T) d^2
    norm1, norm2 (LayerNormZero) linears e -> 6d           2 x 2 e 6d       = 24 e d

plus, once: the patch embedding 2 S p d, text_proj 2 T C d, the time embedding
2 (d e + e^2), norm_out's linear 2 e 2d, proj_out 2 S d p. Per device, the video over
sp and the heads and FFN features over tp: the projections and the FFN on S/sp + T
tokens over tp (every device carries the whole text stream: its projections and FFN
are not divided by sp); the attention over sp x tp for Ulysses ((S+T)^2 / (sp tp):
one kernel call over [text; all video] for heads / (sp tp) heads), and for the ring
((S+T)^2 - T^2) / (sp tp) + T^2 / tp (the video ring, this device's video x text and
text x video blocks, and the text x text block on every device); the patch embedding
and proj_out on S/sp tokens; text_proj, the time embedding and the modulation linears
(per example, replicated) whole on every device. `analytic (tiles)`: S/sp replaced by
L = ceil(S/sp) (the video padded to a multiple of sp) everywhere, and the attention in
the kernel's tiles: Ulysses pad256(T + sp L) x pad512(T + sp L) for heads / (sp tp)
heads; ring sp steps of pad256(L) x pad512(L), and pad256(L) x T, T x pad512(L), T x T.
Training step, as for Wan: the forward, the blocks' forward again, and the backward:
2x the projections, FFN, modulation linears, norm_out and proj_out, 2.5x the attention,
1x (dW only: their inputs are not differentiated) the patch embedding, text_proj and
the time embedding's first linear, 2x its second.

**Communication** (CogVideoX; per device; received = sent, every device plays the same
role): measured from the compiled HLO by `collective_bytes` of `benchmarks/_hlo.py`
(a collective-permute moves its operand, an all-to-all (g-1)/g of it, an all-gather
receives (g-1)/g of its result, an all-reduce 2 (g-1)/g of its operand, a
reduce-scatter (g-1) results; an op in a `while` body counts its `known_trip_count`
times), against the least the joint layout must move. n = sp, t = tp, h = 48 / t heads
of D = 64, L = ceil(S/n) video tokens, T = 226, d = 3072, N = 42 layers, b = 2 bytes
(bf16 activations and gradients; lse and the ring's dK, dV float32). Per layer,
forward:

- ring: the video K and V, n - 1 hops: 2 (n-1) L h D b (`ring_bytes("fwd", ...)`);
  the text K/V never travel; the text rows' partial (out, lse) against each device's
  video, all-gathered: (n-1) T h (D b + 4);
- Ulysses: the all_to_alls of the video q, k, v in and out back: 4 (n-1)/n L h D b
  (`ulysses_bytes("fwd", ...)`); the text rows' out, computed for h / n heads per
  device, all-gathered over heads: (n-1)/n T h D b;
- Megatron (t > 1): the psums of to_out's and the FFN's outputs, on [text; video]:
  2 x 2 (t-1)/t (T + L) d b;

and once proj_out's rows gathered over sp: (n-1) L p b. A training step (remat="full")
runs every layer's forward twice (the forward, the recompute) and its backward:

- ring: K and V again and dK, dV, n - 1 hops each: 2 (n-1) L h D (b + 4)
  (`ring_bytes("fwd+bwd", ...) - ring_bytes("fwd", ...)`); the text rows' output
  cotangent summed over sp: 2 (n-1)/n T h D b;
- Ulysses: dout in, dq, dk, dv back: 4 (n-1)/n L h D b; the text rows' dout scattered
  back over heads: (n-1)/n T h D b;
- Megatron: the psums of the column-parallel layers' input gradients (to_q, to_k, to_v
  share one input: one psum; the FFN's fc1 another): 2 x 2 (t-1)/t (T + L) d b;

plus the gradients summed over sp (an all-reduce: 2 (n-1)/n of the bytes) of every
weight applied to this device's tokens: per layer (12 d^2 + 7 d) / t (to_q/k/v/out and
the FFN, TP-split) + 18 d (to_out's and fc2's biases, the affine LayerNorms of norm1
and norm2, and, for the LayerNormZero linears, whose input is the same on every device,
the cotangents of their 2 x 6d outputs instead of their weights) + 4 D (norm_q, norm_k:
replicated over tp but each device's heads see them, so over sp x tp); once 2 p d + d +
p (patch embedding, proj_out), 6 d (norm_final, norm_out's LayerNorm and the cotangent
of its 2d modulation) and T d (the text stream's cotangent, summed where it starts:
text_proj's gradient then needs no sum). The minimum is reported at b = 2 (the model's
width), and, to check the program against the formula on this backend, with every
collective 4 bytes wide (XLA's CPU backend runs bf16 collectives in f32).

    python benchmarks/models.py --quick    # 1.3B at 4,096 tokens on sp8
    python benchmarks/models.py            # 1.3B, 14B x 32,760, 75,600 tokens, CogVideoX-5B
                                           # x sp8, sp4xtp2
    python benchmarks/models.py --models cogvideox-5B   # its 4 rows only

`--part scale`, how this part alone was once chosen, is still accepted.

Markdown tables go to stdout and `benchmarks/results/models.md`
(`models_quick.md` with `--quick`), raw numbers to the `.json` next to it.
"""

import argparse
import dataclasses
import math
import os
import platform
import sys
import time

from _comm import ring_bytes, ulysses_bytes
from _harness import (
    RESULTS, command_line, emit, fmt, log, now, run_child, set_host_devices, write_json,
    write_text,
)
from _hlo import (
    COLLECTIVE_KINDS, collective_bytes, collective_dtypes, dot_flops, f32_weight_copies, parse,
)
from _model_flops import (
    COGVIDEOX_TEXT, COGVIDEOX_TIME_DIM, PATCH_VALUES, WAN_FREQ_DIM, WAN_TEXT, cogvideox_flops,
    wan_flops,
)


# Every case runs on 8 simulated CPU devices: set before JAX is imported (the parent
# never imports JAX; its children get the flag from run_child too).
N_DEVICES = 8
set_host_devices(N_DEVICES)

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Family:
    """What the script needs to know of one model family."""

    cls: str  # the `vidax_eqx.models` class
    config: str  # its config class
    heads: str  # the config field holding the head count
    text: tuple[int, int]  # the text context (T, C)
    # Video tokens -> the latents of one example, in the layout the model takes.
    latents: dict[int, tuple[int, ...]]


FAMILIES = {
    # x (C, F, H, W), 16 channels, patch (1, 2, 2): tokens = F * H/2 * W/2.
    "wan": Family("WanTransformer3D", "WanConfig", "num_heads", WAN_TEXT, {
        4096: (16, 4, 64, 64),  # small: --quick (and models_vs_diffusers.py's size)
        32760: (16, 21, 60, 104),  # 480p (480 x 832), 81 frames
        75600: (16, 21, 90, 160),  # 720p (720 x 1280), 81 frames
    }),
    # x (F, C, H, W), 16 channels, patch 2 x 2 per frame; one resolution, the
    # pipeline's: 49 frames x 480 x 720, 13 x 30 x 45 tokens.
    "cogvideox": Family("CogVideoXTransformer3D", "CogVideoXConfig", "num_attention_heads",
                        COGVIDEOX_TEXT, {17550: (13, 16, 60, 90)}),
}
# name: (family, config fields; the rest are the config class's defaults).
MODELS = {
    "1.3B": ("wan", dict(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30)),
    "14B": ("wan", dict(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)),
    "cogvideox-5B": ("cogvideox", dict(num_attention_heads=48, attention_head_dim=64,
                                       num_layers=42, use_rotary_positional_embeddings=True)),
}
MESHES = {"sp8": (8, 1), "sp4xtp2": (4, 2)}  # name: (sp, tp)
PASSES = ("fwd", "train")
BF16 = 2  # bytes

DEFAULT_MODELS = ("1.3B", "14B", "cogvideox-5B")
DEFAULT_TOKENS, DEFAULT_MESHES = (32760, 75600), ("sp8", "sp4xtp2")
QUICK = dict(models=("1.3B",), tokens=(4096,), meshes=("sp8",))

# --------------------------------------------------------------------------- #
# Cases and the analytic counts (parent)
# --------------------------------------------------------------------------- #


def family(model: str) -> Family:
    return FAMILIES[MODELS[model][0]]


def config(model: str) -> dict:
    return MODELS[model][1]


def model_tokens(model: str, requested) -> list[int]:
    """The video token counts `model` runs at: those of `requested` it has latents for;
    a family with one resolution (CogVideoX) always runs at that one."""
    latents = family(model).latents
    if len(latents) == 1:
        return list(latents)
    return [t for t in requested if t in latents]


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    tokens: int
    mesh: str
    sequence: str  # "ring" | "ulysses"

    @property
    def sp(self) -> int:
        return MESHES[self.mesh][0]

    @property
    def tp(self) -> int:
        return MESHES[self.mesh][1]


def ulysses_fits(model: str, mesh: str) -> bool:
    """Ulysses splits this device's heads over sp: (heads / tp) % sp == 0."""
    sp, tp = MESHES[mesh]
    return (config(model)[family(model).heads] // tp) % sp == 0


def sequence_modes(model: str, mesh: str, requested: list[str]) -> list[tuple[str, str | None]]:
    """[(mode, why not measured or None)] of one (model, mesh).

    `auto`: Ulysses where it fits, ring otherwise. Several modes: each that fits (a
    Ulysses that does not fit is left out). One mode: that one, or a row saying why not.
    """
    sp, tp = MESHES[mesh]
    heads = config(model)[family(model).heads] // tp
    why = f"not measured: Ulysses needs the local heads ({heads}) to be a multiple of sp={sp}"
    out = []
    for mode in dict.fromkeys(requested):
        if mode == "auto":
            mode = "ulysses" if ulysses_fits(model, mesh) else "ring"
        if mode == "ulysses" and not ulysses_fits(model, mesh):
            if len(requested) == 1:
                out.append((mode, why))
            continue
        if (mode, None) not in out:
            out.append((mode, None))
    return out


def analytic_flops(model: str, tokens: int, sp: int = 1, tp: int = 1,
                   mode: str | None = None) -> dict:
    """Dot FLOPs of one forward and one training step (remat="full") by the formulas of
    the module docstring: `{fwd,train}_total` (the whole model, one example),
    `{fwd,train}_per_device` (under sp x tp), and, with `mode` ("ring" | "ulysses"),
    `{fwd,train}_tiles`: per device as the compiled program pads (the attention's
    sequences to the blockwise kernel's tiles, block_q 256, block_kv 512, each at most
    the length; CogVideoX: the video tokens to a multiple of sp)."""
    fn = {"wan": wan_flops, "cogvideox": cogvideox_flops}[MODELS[model][0]]
    return fn(config(model), tokens, sp, tp, mode)


def param_count(model: str) -> int:
    """Parameters of the model (checked against the built model's shapes)."""
    m, p = config(model), PATCH_VALUES
    if MODELS[model][0] == "wan":
        d, f, L, C = m["dim"], m["ffn_dim"], m["num_layers"], FAMILIES["wan"].text[1]
        block = 2 * 4 * (d * d + d) + 4 * d + (d * f + f + f * d + d) + 2 * d + 6 * d
        outside = ((p * d + d) + (C * d + d + d * d + d)
                   + (WAN_FREQ_DIM * d + d + d * d + d) + (d * 6 * d + 6 * d)
                   + (d * p + p) + 2 * d)
        return L * block + outside
    hd, L, C = m["attention_head_dim"], m["num_layers"], FAMILIES["cogvideox"].text[1]
    d, te = m["num_attention_heads"] * hd, COGVIDEOX_TIME_DIM
    f = 4 * d
    norm_zero = te * 6 * d + 6 * d + 2 * d  # linear, affine LayerNorm
    block = 2 * norm_zero + 4 * (d * d + d) + 2 * 2 * hd + (d * f + f + f * d + d)
    outside = ((p * d + d) + (C * d + d)  # patch, text_proj
               + (d * te + te + te * te + te)  # time embedding
               + 2 * d + (te * 2 * d + 2 * d + 2 * d)  # norm_final, norm_out
               + (d * p + p))  # proj_out
    return L * block + outside


def comm_minimum(model: str, tokens: int, sp: int, tp: int, mode: str,
                 b: int = BF16) -> dict | None:
    """The fewest bytes one device must communicate (module docstring), by term, for
    the forward (`"fwd"`) and the training step (`"train"`): activations and gradients
    `b` bytes wide, `lse` and the ring's dK/dV float32. `None` where no formula is
    written (Wan)."""
    if MODELS[model][0] != "cogvideox":
        return None
    m = config(model)
    H, D, N = m["num_attention_heads"], m["attention_head_dim"], m["num_layers"]
    d, p, T = H * D, PATCH_VALUES, FAMILIES["cogvideox"].text[0]
    n, t = sp, tp
    L, h = -(-tokens // n), H // t  # this device's video tokens (padded) and heads
    f32 = 4

    def all_reduce(g: int) -> float:
        return 2 * (g - 1) / g

    # Per layer: the joint attention.
    if mode == "ring":
        seq_fwd = (ring_bytes("fwd", n, n * L, h, D, b)  # video K/V, n - 1 hops
                   + (n - 1) * T * h * (D * b + f32))  # text partials (out, lse) gathered
        seq_bwd = (ring_bytes("fwd+bwd", n, n * L, h, D, b)  # K/V again, dK/dV (f32)
                   - ring_bytes("fwd", n, n * L, h, D, b)
                   + all_reduce(n) * T * h * D * b)  # the text rows' cotangent summed
    else:
        seq_fwd = (ulysses_bytes("fwd", n, L, h, h, D, b)  # video q, k, v in, out back
                   + (n - 1) / n * T * h * D * b)  # text out gathered over heads
        seq_bwd = seq_fwd  # video dout in, dq, dk, dv back; text dout scattered back
    megatron = 2 * all_reduce(t) * (T + L) * d * b  # to_out's and the FFN's psums
    output = (n - 1) * L * p * b  # proj_out's rows gathered
    # Training: summing the gradients over sp of every weight applied to this device's
    # tokens; for the modulation linears and text_proj, whose inputs are the same on
    # every device, the cotangent of their output (6d per norm, T x d) instead.
    layer = (12 * d * d + 7 * d) / t + 18 * d  # q/k/v/out, FFN, norms, modulation
    outside = 2 * p * d + d + p + 6 * d + T * d  # patch, proj_out, norms, text stream
    qk_norms = 4 * D  # replicated over tp, seen by this device's heads: over sp x tp
    grads = (all_reduce(n) * (N * layer + outside) + all_reduce(n * t) * N * qk_norms) * b
    return {
        "fwd": {"sequence": N * seq_fwd, "megatron": N * megatron, "output": output},
        "train": {"sequence": N * (2 * seq_fwd + seq_bwd), "megatron": 3 * N * megatron,
                  "output": output, "gradients": grads},
    }


# --------------------------------------------------------------------------- #
# One scale case, in a fresh process
# --------------------------------------------------------------------------- #


def scan_probe() -> dict:
    """What cost_analysis reports for a `lax.scan` of 4 (512 x 1024) @ (1024 x 1024)."""
    import jax
    import jax.numpy as jnp

    def f(x, ws):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]

    compiled = jax.jit(f).lower(jax.ShapeDtypeStruct((512, 1024), jnp.float32),
                                jax.ShapeDtypeStruct((4, 1024, 1024), jnp.float32)).compile()
    return {
        "expected": 4 * 2 * 512 * 1024 * 1024,
        "cost_analysis": compiled.cost_analysis()["flops"],
        "hlo_dots": dot_flops(compiled.as_text())["flops"],
    }


def abstract_model(case: Case):
    """(sharded ShapeDtypeStruct arrays, static part, mesh, parameter count, bytes per
    device) of the bf16 model: nothing allocated."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from vidax_eqx import models, nn, parallel

    mesh = parallel.make_mesh(sp=case.sp, tp=case.tp)
    fam = family(case.model)
    cfg = getattr(models, fam.config)(**config(case.model))
    pc = nn.sharding.ParallelConfig(sequence=case.sequence, tp_axis="tp" if case.tp > 1 else None)
    model = eqx.filter_eval_shape(getattr(models, fam.cls), cfg, parallel=pc,
                                  dtype=jnp.bfloat16, key=jax.random.PRNGKey(0))
    is_struct = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    arrays, static = eqx.partition(model, is_struct)
    # `nn.sharding.partition_specs` recognizes arrays with `eqx.is_array`, which a
    # ShapeDtypeStruct is not: take the specs of the traced model instead.
    box = []

    def take_specs(a):
        specs = nn.sharding.partition_specs(eqx.combine(a, static))
        box.append(eqx.partition(specs, lambda s: isinstance(s, P))[0])
        return 0

    jax.eval_shape(take_specs, arrays)
    arrays = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
        arrays, box[0],
    )
    leaves = jax.tree.leaves(arrays)
    count = sum(math.prod(x.shape) for x in leaves)
    per_device = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)
    return arrays, static, mesh, count, per_device


def scale_child(args) -> None:
    """Compiles the forward and the training step of one case; one JSON line each."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from vidax_eqx import models

    case = Case(args.child_model, args.child_tokens, args.child_mesh, args.child_sequence)
    t0 = time.perf_counter()
    arrays, static, mesh, count, per_device = abstract_model(case)
    emit({"kind": "model", "params": count, "param_bytes_per_device": per_device,
           "build_s": time.perf_counter() - t0, "jax": jax.__version__})
    if args.child_probe:  # before the passes: a pass that fails ends the process
        emit({"kind": "probe", **scan_probe()})

    rep = NamedSharding(mesh, P())
    fam = family(case.model)
    x = jax.ShapeDtypeStruct((1, *fam.latents[case.tokens]), jnp.bfloat16, sharding=rep)
    t = jax.ShapeDtypeStruct((1,), jnp.float32, sharding=rep)
    context = jax.ShapeDtypeStruct((1, *fam.text), jnp.bfloat16, sharding=rep)

    def forward(a, x, t, context):
        return models.run_sharded(eqx.combine(a, static), x, t, context, mesh=mesh)

    def train_step(a, x, t, context, target):
        def loss(a):
            out = models.run_sharded(eqx.combine(a, static), x, t, context, mesh=mesh,
                                     remat="full")
            return jnp.mean(jnp.square(out.astype(jnp.float32) - target.astype(jnp.float32)))

        return jax.value_and_grad(loss)(a)

    param_shardings = jax.tree.map(lambda s: s.sharding, arrays)
    programs = {
        "fwd": (jax.jit(forward), (arrays, x, t, context)),
        "train": (jax.jit(train_step, out_shardings=(rep, param_shardings)),
                  (arrays, x, t, context, x)),
    }
    for pass_ in args.child_passes.split(","):
        fn, ins = programs[pass_]
        t0 = time.perf_counter()
        lowered = fn.lower(*ins)
        lower_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        hlo = compiled.as_text()
        module = parse(hlo)
        dots = dot_flops(module)
        comm = collective_bytes(module, N_DEVICES)
        emit({
            "kind": "pass", "pass": pass_, "lower_s": lower_s, "compile_s": compile_s,
            "temp_bytes": mem.temp_size_in_bytes, "argument_bytes": mem.argument_size_in_bytes,
            "output_bytes": mem.output_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes,
            "cost_flops": cost.get("flops"), "hlo_dot_flops": dots["flops"],
            "unknown_trip_counts": dots["unknown_trip_counts"],
            "f32_weight_copy_bytes": f32_weight_copies(module),
            "comm_bytes": comm["total"], "comm_by_kind": comm["by_kind"], "comm_ops": comm["ops"],
            "comm_unknown_trip_counts": comm["unknown_trip_counts"],
            "collective_dtypes": {"lowered": collective_dtypes(lowered.as_text()),
                                  "compiled": collective_dtypes(hlo)},
        })
        del lowered, compiled, hlo, module


def spawn_scale(args, case: Case, probe: bool) -> dict:
    """The results of one case, measured in a fresh process with a time limit."""
    cmd = [
        "--child-scale",
        "--child-model", case.model, "--child-tokens", str(case.tokens),
        "--child-mesh", case.mesh, "--child-sequence", case.sequence,
        "--child-passes", ",".join(args.passes),
    ] + (["--child-probe"] if probe else [])  # fmt: skip
    child = run_child(__file__, cmd, devices=N_DEVICES, timeout=args.case_timeout)
    result: dict = {"passes": {}, "status": "ok", "wall_s": child.wall_s}
    for r in child.records:
        if r["kind"] == "pass":
            result["passes"][r["pass"]] = r
        else:
            result[r["kind"]] = r
    if child.returncode is None:
        result["status"] = f"not measured: compile exceeded the {args.case_timeout:g} s limit"
    elif not child.ok:
        missing = [p for p in args.passes if p not in result["passes"]]
        where = " and ".join(missing) or "after the passes"
        result["status"] = f"error (exit {child.returncode}, {where}): {child.reason[:300]}"
    return result


# --------------------------------------------------------------------------- #
# Output
# --------------------------------------------------------------------------- #


def _gib(x) -> str:
    return fmt(None if x is None else x / GIB, ".2f")


def _tf(x) -> str:
    """TFLOP, three significant digits or so."""
    if x is None:
        return "–"
    x /= 1e12
    return format(x, ".0f" if abs(x) >= 100 else ".1f" if abs(x) >= 10 else ".2f")


def scale_markdown(rows: list[dict], info: dict) -> str:
    families = dict.fromkeys(MODELS[r["model"]][0] for r in rows)
    text = ", ".join(f"{FAMILIES[f].text[0]} x {FAMILIES[f].text[1]} ({f})" for f in families)
    out = [
        f"Scale: bfloat16 weights, batch 1, text {text}; `tokens`: video tokens; "
        f"{N_DEVICES} simulated CPU devices; jax {info.get('jax', '?')}; every number per "
        f"device; {info['scale_seconds']:.0f} s in all.",
        "",
        "Memory (GiB per device). Temp: `memory_analysis().temp_size_in_bytes`; copies: the "
        "f32 copies of bf16 weights that XLA's CPU backend makes (see notes); "
        "XLA total = arguments + outputs + temp.",
        "",
        "| model | tokens | mesh | seq. mode | params | fwd temp | fwd copies | fwd temp - copies | "
        "fwd XLA total | train temp | train copies | train temp - copies | train XLA total |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        head = f"| {r['model']} | {r['tokens']:,} | {r['mesh']} | {r['sequence']} | "
        if r["status"] != "ok" and not r["passes"]:
            out.append(head + f"{_gib(r.get('param_bytes'))} | {r['status']} |" + " |" * 7)
            continue
        cells = [_gib(r.get("param_bytes"))]
        for pass_ in PASSES:
            p = r["passes"].get(pass_)
            if p is None:
                cells += ["not measured"] + ["–"] * 3
                continue
            total = p["argument_bytes"] + p["output_bytes"] + p["temp_bytes"] - p["alias_bytes"]
            cells += [_gib(p["temp_bytes"]), _gib(p["f32_weight_copy_bytes"]),
                      _gib(p["temp_bytes"] - p["f32_weight_copy_bytes"]), _gib(total)]
        out.append(head + " | ".join(cells) + " |")
    out += [
        "",
        "FLOPs (TFLOP per device): `cost_analysis()['flops']`; the dot FLOPs of the optimized "
        "HLO, loops times their trip counts; the analytic count (module docstring), plain and "
        "with the attention padded to the kernel's tiles, and HLO over the latter. Compile: "
        "lower + compile, seconds.",
        "",
        "| model | tokens | mesh | seq. mode | pass | cost_analysis | HLO dots | analytic | "
        "analytic (tiles) | HLO / analytic (tiles) | analytic, all devices | compile (s) |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for pass_ in PASSES:
            a = r["analytic"]
            p = r["passes"].get(pass_)
            head = f"| {r['model']} | {r['tokens']:,} | {r['mesh']} | {r['sequence']} | {pass_} | "
            tail = f"{_tf(a[f'{pass_}_total'])} |"
            if p is None:
                status = r["status"] if r["status"] != "ok" else "not measured"
                out.append(head + f"{status} | – | {_tf(a[f'{pass_}_per_device'])} | "
                           f"{_tf(a.get(f'{pass_}_tiles'))} | – | " + tail + " – |")
                continue
            ratio = p["hlo_dot_flops"] / a[f"{pass_}_tiles"]
            out.append(
                head + f"{_tf(p['cost_flops'])} | {_tf(p['hlo_dot_flops'])} | "
                f"{_tf(a[f'{pass_}_per_device'])} | {_tf(a[f'{pass_}_tiles'])} | "
                f"{ratio:.4f} | " + tail + f" {p['lower_s'] + p['compile_s']:.0f} |"
            )
    return "\n".join(out + comm_markdown(rows))




def comm_markdown(rows: list[dict]) -> list[str]:
    """The communication table of the rows with a minimum (CogVideoX)."""
    rows = [r for r in rows if r.get("comm_minimum")]
    if not rows:
        return []
    out = [
        "",
        "Communication (GiB per device, one run of the compiled program): measured from the "
        "compiled HLO (`collective_bytes` of `benchmarks/_hlo.py`: loops times their trip "
        "counts), in all and by kind; the minimum of the module docstring at the model's width "
        "(bf16 activations and gradients), its sequence-parallel, Megatron and gradient terms; "
        "measured / minimum, and measured / the minimum with every collective 4 bytes wide "
        "(XLA's CPU backend runs bf16 collectives in f32: see notes).",
        "",
        "| model | tokens | mesh | seq. mode | pass | measured | permute | all-to-all | "
        "all-gather | all-reduce | reduce-scatter | minimum | sequence | Megatron | gradients | "
        "measured / minimum | measured / minimum (f32) |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for pass_ in PASSES:
            least, least32 = r["comm_minimum"][pass_], r["comm_minimum_f32"][pass_]
            total, total32 = sum(least.values()), sum(least32.values())
            terms = [_gib(least[k]) if least.get(k) else "–"
                     for k in ("sequence", "megatron", "gradients")]
            p = r["passes"].get(pass_)
            head = f"| {r['model']} | {r['tokens']:,} | {r['mesh']} | {r['sequence']} | {pass_} | "
            if p is None:
                why = "not measured" + ("" if r["status"] == "ok" else ": see notes")
                out.append(head + f"{why} |" + " – |" * 5 + f" {_gib(total)} | "
                           + " | ".join(terms) + " | – | – |")
                continue
            by = p["comm_by_kind"]
            cells = ([_gib(p["comm_bytes"])] + [_gib(by[k]) if by.get(k) else "–" for k in COLLECTIVE_KINDS]
                     + [_gib(total)] + terms
                     + [f"{p['comm_bytes'] / total:.2f}", f"{p['comm_bytes'] / total32:.3f}"])
            out.append(head + " | ".join(cells) + " |")
    return out


def _dtype_note(rows: list[dict]) -> list[str]:
    """What element types the collectives of the communication table's programs have, as
    JAX lowered them and as XLA compiled them."""
    seen = {"lowered": {}, "compiled": {}}
    for r in rows:
        for p in r["passes"].values() if r.get("comm_minimum") else ():
            for stage, counts in seen.items():
                for dtype, n in p["collective_dtypes"][stage].items():
                    counts[dtype] = counts.get(dtype, 0) + n
    if not seen["lowered"]:
        return []

    def fmt(counts: dict) -> str:
        return ", ".join(f"{n} {dtype}" for dtype, n in sorted(counts.items()))

    note = (f"- Collective ops by result type in the communication table's programs: as lowered "
            f"(StableHLO, what JAX asks for) {fmt(seen['lowered'])}; as compiled for CPU "
            f"{fmt(seen['compiled'])} (XLA combines and splits ops, so the counts differ).")
    if "bf16" in seen["lowered"] and "bf16" not in seen["compiled"]:
        note += (" XLA's CPU backend runs every bf16 collective in f32: on CPU they move twice "
                 "the bytes of the model's width, where a GPU/TPU backend moves bf16. "
                 "`measured / minimum (f32)` checks the program against the formula; "
                 "`measured / minimum` is what this CPU program moves over the least possible.")
    return [note]


def scale_notes(rows: list[dict], info: dict) -> str:
    out = ["", "Notes (scale):", ""]
    probe = info.get("probe")
    if probe:
        out.append(
            f"- cost_analysis counts a `while` body once: a `lax.scan` of 4 matmuls "
            f"({probe['expected'] / 1e9:.2f} GFLOP) reports {probe['cost_analysis'] / 1e9:.2f} "
            f"GFLOP; the HLO dot count gives {probe['hlo_dots'] / 1e9:.2f}. The model's layers "
            "are a `lax.scan` and its attention runs in loops, so its cost_analysis column is "
            "roughly one layer's work, not the model's."
        )
    out += [
        "- Every number is one device's: each device compiles the same SPMD program "
        "(`jax.shard_map`), so `memory_analysis()` and `cost_analysis()` describe one device. "
        "The analytic per-device count divides the per-token work by sp x tp and keeps what "
        "every device repeats (Wan: text embedding, patch embedding, the text k/v projections "
        "over sp; CogVideoX: text_proj, and the text stream's projections and FFN in every "
        "block, with ring attention also the text x text block); `analytic total` is the "
        "whole model's work for one example.",
        "- `copies`: on CPU, XLA runs bf16 dots in f32 and hoists the bf16 -> f32 converts of "
        "the stacked layer weights out of the layer loop, so the temp holds an f32 copy of "
        "every weight (2x the bf16 parameter bytes) for the whole run. A GPU/TPU backend "
        "with native bf16 dots makes no such copies; `temp - copies` estimates the rest.",
        "- Training step: value_and_grad of an f32 MSE loss with respect to every model "
        "array, `remat=\"full\"` (each block saves only its input and is recomputed in the "
        "backward pass); gradients come out sharded like the parameters (bf16), so `train "
        "XLA total` counts parameters, gradients and temp; no optimizer state.",
        "- `HLO / analytic (tiles)` near 1 says the compiled program does the work the "
        "formula expects, no more (dots only; elementwise work is not counted); `analytic` "
        "without tiles is the model's own work, which the kernel's padding exceeds slightly "
        "where a length is not a multiple of its blocks.",
        "- Compiled ahead of time only: nothing was run, no weight allocated.",
    ]
    for r in rows:
        if r["status"] != "ok":
            out.append(f"- {r['model']} {r['tokens']:,} tokens {r['mesh']} ({r['sequence']}): "
                       f"{r['status']}.")
        for pass_, p in r["passes"].items():
            if p.get("unknown_trip_counts"):
                out.append(f"- {r['model']} {r['tokens']:,} {r['mesh']} {pass_}: "
                           f"{p['unknown_trip_counts']} loop(s) without known_trip_count, "
                           "counted once.")
            if p.get("comm_unknown_trip_counts"):
                out.append(f"- {r['model']} {r['tokens']:,} {r['mesh']} {pass_}: "
                           f"{p['comm_unknown_trip_counts']} loop(s) with collectives and no "
                           "known_trip_count, counted once.")
        if r.get("params") is not None and r["params"] != param_count(r["model"]):
            out.append(f"- {r['model']}: the built model has {r['params']:,} parameters, the "
                       f"formula {param_count(r['model']):,}.")
    out += _dtype_note(rows)
    counts = {r["model"]: r["params"] for r in rows if r.get("params")}
    if counts:
        out.append("- Parameters: " + ", ".join(f"{m} {c:,} ({c * 2 / GIB:.2f} GiB bf16)"
                                                for m, c in counts.items()) + ".")
    return "\n".join(out)


# --------------------------------------------------------------------------- #
# The run
# --------------------------------------------------------------------------- #


def run_scale(args) -> tuple[list[dict], dict]:
    info: dict = {}
    t_start = time.perf_counter()
    rows = []
    first = True
    for model in args.models:
        for tokens in model_tokens(model, args.tokens):
            for mesh in args.meshes:
                for mode, why in sequence_modes(model, mesh, args.sequence):
                    sp, tp = MESHES[mesh]
                    row = {"model": model, "tokens": tokens, "mesh": mesh, "sequence": mode,
                           "analytic": analytic_flops(model, tokens, sp, tp, mode),
                           "comm_minimum": comm_minimum(model, tokens, sp, tp, mode),
                           "comm_minimum_f32": comm_minimum(model, tokens, sp, tp, mode, b=4),
                           "passes": {}}
                    rows.append(row)
                    if why:
                        row["status"] = why
                        continue
                    log(f"# {model} {tokens} tokens {mesh} ({mode}) ...")
                    r = spawn_scale(args, Case(model, tokens, mesh, mode), probe=first)
                    first = False
                    row.update(status=r["status"], passes=r["passes"], wall_s=r["wall_s"])
                    if "model" in r:
                        row["params"] = r["model"]["params"]
                        row["param_bytes"] = r["model"]["param_bytes_per_device"]
                        info["jax"] = r["model"]["jax"]
                    if "probe" in r:
                        info["probe"] = r["probe"]
                    summary = ", ".join(
                        f"{k}: temp {_gib(p['temp_bytes'])} GiB, HLO {_tf(p['hlo_dot_flops'])} "
                        f"TF, comm {_gib(p['comm_bytes'])} GiB, compile {p['compile_s']:.0f} s"
                        for k, p in r["passes"].items())
                    log(f"#   {r['status']}; {summary}  [{r['wall_s']:.0f} s]")
    info["scale_seconds"] = time.perf_counter() - t_start
    return rows, info


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Wan 2.1 and CogVideoX-5B (vidax_eqx.models): parameter, temp memory, "
        "FLOPs and (CogVideoX) communicated bytes per device at scale (compiled ahead of time "
        "on 8 simulated CPU devices, no weights allocated). Wan's forward wall time against "
        "diffusers: benchmarks/models_vs_diffusers.py."
    )
    p.add_argument("--part", choices=("all", "scale", "diffusers"), default="scale",
                   help="scale (the default, and all this script measures; all and diffusers "
                   "moved to benchmarks/models_vs_diffusers.py)")
    p.add_argument("--models", nargs="+", choices=tuple(MODELS), default=None,
                   help=f"default {' '.join(DEFAULT_MODELS)}")
    wan = FAMILIES["wan"].latents
    p.add_argument("--tokens", nargs="+", type=int, choices=tuple(wan), default=None,
                   help=f"Wan's video tokens (latents (C, F, H, W) {wan}); default "
                   f"{' '.join(map(str, DEFAULT_TOKENS))}. CogVideoX runs at its one "
                   f"resolution, {FAMILIES['cogvideox'].latents}")
    p.add_argument("--meshes", nargs="+", choices=tuple(MESHES), default=None,
                   help=f"default {' '.join(DEFAULT_MESHES)}")
    p.add_argument("--sequence", nargs="+", choices=("ring", "ulysses", "auto"),
                   default=["ring", "ulysses"],
                   help="sequence-parallel modes (default: ring, and Ulysses where the local "
                   "heads divide by sp); auto = Ulysses where it fits, ring otherwise")
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    p.add_argument("--case-timeout", type=float, default=300.0,
                   help="seconds one case (both compiles) may take (default 300)")
    p.add_argument("--out", default=None,
                   help="output stem (default benchmarks/results/models; models_quick with "
                   "--quick)")
    p.add_argument("--quick", action="store_true",
                   help="1.3B at 4,096 tokens on sp8")
    # Hidden: one measurement in this (fresh) process.
    for flag in ("--child-scale", "--child-probe"):
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag in ("--child-model", "--child-mesh", "--child-sequence", "--child-passes"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    p.add_argument("--child-tokens", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part != "scale":
        p.error(f"--part {args.part}: Wan's wall time against diffusers moved to its own "
                "script; run python benchmarks/models_vs_diffusers.py (this one measures the "
                "scale part: --part scale, or no --part)")
    if args.quick:
        args.models = args.models or list(QUICK["models"])
        args.tokens = args.tokens or list(QUICK["tokens"])
        args.meshes = args.meshes or list(QUICK["meshes"])
    args.models = args.models or list(DEFAULT_MODELS)
    args.tokens = args.tokens or list(DEFAULT_TOKENS)
    args.meshes = args.meshes or list(DEFAULT_MESHES)
    args.out = args.out or os.path.join(RESULTS, "models_quick" if args.quick else "models")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child_scale:
        scale_child(args)
        return 0

    t_start = time.perf_counter()
    report = {
        "date": now(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "command": command_line(__file__, prefix="") if argv is None else None,
    }
    rows, info = run_scale(args)
    report.update(scale=rows, scale_info=info)
    text = scale_markdown(rows, info) + "\n" + scale_notes(rows, info)
    report["seconds"] = time.perf_counter() - t_start
    print(text)
    command = report["command"] or "benchmarks/models.py"
    write_text(args.out + ".md", f"# Video DiT models benchmark (Wan 2.1, CogVideoX)\n\n"
               f"`python {command}`, {report['date']}, {report['seconds']:.0f} s.\n\n{text}\n")
    write_json(args.out + ".json", report)
    log(f"# wrote {os.path.relpath(args.out)}.md and .json after {report['seconds']:.0f} s")
    failed = [r for r in rows if r["status"].startswith("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
