"""Wan 2.1 (`vidax_eqx.models.WanTransformer3D`) and CogVideoX-5B
(`vidax_eqx.models.CogVideoXTransformer3D`) at scale, and Wan against diffusers.

Two parts, each configuration in a fresh process (this script with a hidden
`--child-*` flag):

**Scale** (`--part scale`): bfloat16 weights, one video (batch 1), on 8 simulated CPU
devices, built abstractly (`eqx.filter_eval_shape`: no weight is ever allocated) and
compiled ahead of time (`jax.jit(...).lower(ShapeDtypeStructs).compile()`) through
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

- parameter bytes: from the shapes and `nn.partition_specs` (bf16; TP shards the
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

Analytic dot FLOPs of one forward (2 flops per multiply-add). S tokens, d = dim,
f = ffn_dim, L layers, T = 512 text tokens, C = 4096 text width, p = 64 values per
patch (16 channels x 1 x 2 x 2), per block:

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
role): measured from the compiled HLO by `collective_bytes` of `benchmarks/parallel.py`
(a collective-permute moves its operand, an all-to-all (g-1)/g of it, an all-gather
receives (g-1)/g of its result, an all-reduce 2 (g-1)/g of its operand, a
reduce-scatter (g-1) results; an op in a `while` body counts its `known_trip_count`
times), against the least the joint layout must move. n = sp, t = tp, h = 48 / t heads
of D = 64, L = ceil(S/n) video tokens, T = 226, d = 3072, N = 42 layers, b = 2 bytes
(bf16 activations and gradients; lse and the ring's dK, dV float32). Per layer,
forward:

- ring: the video K and V, n - 1 hops: 2 (n-1) L h D b (`_ring_bytes("fwd", ...)`);
  the text K/V never travel; the text rows' partial (out, lse) against each device's
  video, all-gathered: (n-1) T h (D b + 4);
- Ulysses: the all_to_alls of the video q, k, v in and out back: 4 (n-1)/n L h D b
  (`_ulysses_bytes("fwd", ...)`); the text rows' out, computed for h / n heads per
  device, all-gathered over heads: (n-1)/n T h D b;
- Megatron (t > 1): the psums of to_out's and the FFN's outputs, on [text; video]:
  2 x 2 (t-1)/t (T + L) d b;

and once proj_out's rows gathered over sp: (n-1) L p b. A training step (remat="full")
runs every layer's forward twice (the forward, the recompute) and its backward:

- ring: K and V again and dK, dV, n - 1 hops each: 2 (n-1) L h D (b + 4)
  (`_ring_bytes("fwd+bwd", ...) - _ring_bytes("fwd", ...)`); the text rows' output
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

**Wall time against diffusers** (`--part diffusers`): a small real configuration
(dim 1536, 12 heads, ffn 8960, 2 layers, text 512 x 4096; latents (16, 4, 64, 64):
4,096 tokens), float32, batch 1, forward only, on this machine's CPU:
`vidax_eqx` (`eqx.filter_jit`, compiled before timing, one device) against diffusers'
`WanTransformer3DModel` under `torch.no_grad()`, with the same weights (random init
of `WanTransformer3D`, written with `save_pretrained(dir, layout="diffusers")`, read
with `WanTransformer3DModel.from_pretrained(dir)`) and inputs. Each side runs in its
own process (diffusers in `--torch-python`, default `/work/torchvenv/bin/python`:
an environment without JAX), one after the other, never at once; each runs once as a
warm-up and reports the best and the median of `--repeats` further runs, each
synchronized (`block_until_ready`). `max rel diff` = max |vidax - diffusers| / max
|diffusers| over the output. Skipped, with the reason, when torch or diffusers
cannot be imported there.

    python benchmarks/models.py --quick    # 1.3B at 4,096 tokens on sp8, and diffusers
    python benchmarks/models.py            # 1.3B, 14B x 32,760, 75,600 tokens, CogVideoX-5B
                                           # x sp8, sp4xtp2; and diffusers
    python benchmarks/models.py --part scale --models cogvideox-5B   # its 4 rows only

Markdown tables go to stdout and `benchmarks/results/models.md`
(`models_quick.md` with `--quick`), raw numbers to the `.json` next to it.
"""

import os
import sys


# The scale children run on 8 simulated CPU devices, the wall-time child on one; set
# before JAX is imported. The parent never imports JAX.
N_DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"
_devices = 1 if "--child-wall" in sys.argv else N_DEVICES
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_FLAG)]
    + ([f"{_FLAG}={_devices}"] if _devices > 1 else [])
)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402


# Benchmark this checkout's vidax_eqx, not whichever copy happens to be installed.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from benchmarks.parallel import _ring_bytes, _ulysses_bytes, collective_bytes  # noqa: E402

RESULTS = os.path.join(_REPO, "benchmarks", "results")
TORCH_PYTHON = "/work/torchvenv/bin/python"
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
    "wan": Family("WanTransformer3D", "WanConfig", "num_heads", (512, 4096), {
        4096: (16, 4, 64, 64),  # small: --quick, and the diffusers comparison
        32760: (16, 21, 60, 104),  # 480p (480 x 832), 81 frames
        75600: (16, 21, 90, 160),  # 720p (720 x 1280), 81 frames
    }),
    # x (F, C, H, W), 16 channels, patch 2 x 2 per frame; one resolution, the
    # pipeline's: 49 frames x 480 x 720, 13 x 30 x 45 tokens.
    "cogvideox": Family("CogVideoXTransformer3D", "CogVideoXConfig", "num_attention_heads",
                        (226, 4096), {17550: (13, 16, 60, 90)}),
}
# name: (family, config fields; the rest are the config class's defaults).
MODELS = {
    "1.3B": ("wan", dict(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30)),
    "14B": ("wan", dict(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)),
    "cogvideox-5B": ("cogvideox", dict(num_attention_heads=48, attention_head_dim=64,
                                       num_layers=42, use_rotary_positional_embeddings=True)),
}
MESHES = {"sp8": (8, 1), "sp4xtp2": (4, 2)}  # name: (sp, tp)
PATCH_VALUES = 64  # values per patch in and out, both families: 16 channels x 2 x 2
WAN_FREQ_DIM = 256  # WanConfig's timestep sinusoid width
COGVIDEOX_TIME_DIM = 512  # CogVideoXConfig's time_embed_dim (default)
PASSES = ("fwd", "train")
BF16 = 2  # bytes

DEFAULT_MODELS = ("1.3B", "14B", "cogvideox-5B")
DEFAULT_TOKENS, DEFAULT_MESHES = (32760, 75600), ("sp8", "sp4xtp2")
QUICK = dict(models=("1.3B",), tokens=(4096,), meshes=("sp8",))

# The wall-time comparison: Wan 1.3B's width, 2 layers.
WALL_CONFIG = dict(dim=1536, ffn_dim=8960, num_heads=12, num_layers=2)
WALL_LATENTS = FAMILIES["wan"].latents[4096]
WALL_TEXT = FAMILIES["wan"].text
WALL_TIMESTEP = 500.0


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


def _pad(n: int, block: int) -> int:
    """`n` rounded up to a multiple of `min(block, n)` (the blockwise kernel's tiles)."""
    b = min(block, n)
    return -(-n // b) * b


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


def wan_flops(m: dict, tokens: int, sp: int = 1, tp: int = 1, mode: str | None = None) -> dict:
    """Wan's `analytic_flops`."""
    d, f, L, H = m["dim"], m["ffn_dim"], m["num_layers"], m["num_heads"]
    (T, C), p = FAMILIES["wan"].text, PATCH_VALUES
    S = tokens
    hd = d // H

    def flops(n_tok: int, n_text: int, n_head: int, attn: float) -> dict:
        """Forward FLOPs by kind: per-token work over n_tok devices, the text k/v
        projections over n_text, the head over n_head; `attn` the attention's."""
        return dict(
            dense=L * (12 * S * d * d + 4 * S * d * f) / n_tok,
            attn=attn,
            text_kv=L * 4 * T * d * d / n_text,
            text_emb=(2 * T * C * d + 2 * T * d * d) / n_text,
            patch=2 * S * p * d / n_head,
            head=2 * S * d * p / n_head,
            time=2 * (WAN_FREQ_DIM * d + d * d + 6 * d * d),
        )

    def text_emb_backward(n_text: int) -> float:
        """The text embedding's backward: fc1 dW only, fc2 dX and dW (TP-split)."""
        return (2 * T * C * d + 2 * 2 * T * d * d) / n_text

    def fwd(k: dict) -> float:
        return sum(k.values())

    def train(k: dict, n_text: int) -> float:
        blocks = k["dense"] + k["attn"] + k["text_kv"]
        outside = k["text_emb"] + k["patch"] + k["head"] + k["time"]
        backward = (2 * k["dense"] + 2.5 * k["attn"] + 2 * k["text_kv"]
                    + k["patch"]  # dW only
                    + text_emb_backward(n_text)
                    + 2 * k["head"] + 2 * k["time"])
        return outside + 2 * blocks + backward  # + the blocks' recomputed forward

    plain_attn = L * (4 * S * S * d + 4 * S * T * d)
    total = flops(1, 1, 1, plain_attn)
    per_device = flops(sp * tp, tp, sp, plain_attn / (sp * tp))
    out = {"fwd_total": fwd(total), "train_total": train(total, 1),
           "fwd_per_device": fwd(per_device), "train_per_device": train(per_device, tp)}
    if mode is not None:
        heads = H // tp  # this device's heads (Megatron)
        local = -(-S // sp)  # this device's tokens
        if mode == "ulysses":  # the whole sequence, heads / sp of them
            self_attn = 4 * _pad(S, 256) * _pad(S, 512) * hd * heads / sp
        else:  # ring: sp steps of the local queries against one chunk of keys
            self_attn = sp * 4 * _pad(local, 256) * _pad(local, 512) * hd * heads
        cross = 4 * _pad(local, 256) * _pad(T, 512) * hd * heads
        tiles = flops(sp * tp, tp, sp, L * (self_attn + cross))
        out.update(fwd_tiles=fwd(tiles), train_tiles=train(tiles, tp))
    return out


def cogvideox_flops(m: dict, tokens: int, sp: int = 1, tp: int = 1,
                    mode: str | None = None) -> dict:
    """CogVideoX's `analytic_flops`."""
    H, hd, N = m["num_attention_heads"], m["attention_head_dim"], m["num_layers"]
    d, te, p = H * hd, COGVIDEOX_TIME_DIM, PATCH_VALUES
    (T, C), S = FAMILIES["cogvideox"].text, tokens

    def flops(v: float, n_tp: int, attn: float) -> dict:
        """Forward FLOPs by kind on a device holding `v` video tokens and the whole
        text, its attention and FFN split over `n_tp`; `attn` the attention's."""
        return dict(
            dense=N * 24 * (v + T) * d * d / n_tp,
            attn=attn,
            modulation=N * 2 * 2 * te * 6 * d,
            text_emb=2 * T * C * d,
            patch=2 * v * p * d,
            head=2 * v * d * p + 2 * te * 2 * d,
            time=2 * (d * te + te * te),
        )

    def fwd(k: dict) -> float:
        return sum(k.values())

    def train(k: dict) -> float:
        blocks = k["dense"] + k["attn"] + k["modulation"]
        outside = k["text_emb"] + k["patch"] + k["head"] + k["time"]
        backward = (2 * k["dense"] + 2.5 * k["attn"] + 2 * k["modulation"]
                    + k["text_emb"] + k["patch"]  # dW only
                    + 2 * k["head"] + 2 * d * te + 4 * te * te)  # time: linear_1 dW only
        return outside + 2 * blocks + backward  # + the blocks' recomputed forward

    joint = N * 4 * (S + T) ** 2 * d  # QK^T and PV over [text; video]
    total = flops(S, 1, joint)
    if mode == "ring":  # the text x text block on every device
        attn = N * 4 * ((S + T) ** 2 - T**2) * d / (sp * tp) + N * 4 * T**2 * d / tp
    else:
        attn = joint / (sp * tp)
    per_device = flops(S / sp, tp, attn)
    out = {"fwd_total": fwd(total), "train_total": train(total),
           "fwd_per_device": fwd(per_device), "train_per_device": train(per_device)}
    if mode is not None:
        v = -(-S // sp)  # this device's video tokens, padded to a multiple of sp
        heads = H // tp
        if mode == "ulysses":  # [text; the whole video], heads / sp of them
            n = T + sp * v
            attn = 4 * _pad(n, 256) * _pad(n, 512) * hd * heads / sp
        else:  # the video ring, and the three text blocks locally
            attn = 4 * hd * heads * (
                sp * _pad(v, 256) * _pad(v, 512) + _pad(v, 256) * _pad(T, 512)
                + _pad(T, 256) * _pad(v, 512) + _pad(T, 256) * _pad(T, 512))
        tiles = flops(v, tp, N * attn)
        out.update(fwd_tiles=fwd(tiles), train_tiles=train(tiles))
    return out


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
        seq_fwd = (_ring_bytes("fwd", n, n * L, h, D, b)  # video K/V, n - 1 hops
                   + (n - 1) * T * h * (D * b + f32))  # text partials (out, lse) gathered
        seq_bwd = (_ring_bytes("fwd+bwd", n, n * L, h, D, b)  # K/V again, dK/dV (f32)
                   - _ring_bytes("fwd", n, n * L, h, D, b)
                   + all_reduce(n) * T * h * D * b)  # the text rows' cotangent summed
    else:
        seq_fwd = (_ulysses_bytes("fwd", n, L, h, h, D, b)  # video q, k, v in, out back
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
# HLO reading (children)
# --------------------------------------------------------------------------- #

_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
    "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def _split_type(rest: str) -> tuple[str, str]:
    """`TYPE opcode(...)...` -> (TYPE, the rest from the opcode on)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        return rest[: i + 1], rest[i + 1:].lstrip()
    type_, _, tail = rest.partition(" ")
    return type_, tail


def _dims(type_: str) -> tuple[str, list[int]] | None:
    m = _ARRAY.search(re.sub(r"/\*.*?\*/", "", type_))
    if not m:
        return None
    return m.group(1), [int(x) for x in m.group(2).split(",") if x]


def _computations(hlo: str) -> tuple[dict, str]:
    """{name: [(instr name, type, tail)]} with parameters from the header, and ENTRY's name."""
    comps: dict[str, list] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(1)
                comps[current] = []
                if line.startswith("ENTRY"):
                    entry = current
        elif line.strip() == "}":
            current = None
        else:
            m = _INSTR.match(line)
            if m:
                type_, tail = _split_type(line[m.end():])
                comps[current].append((m.group(1), type_, tail))
    return comps, entry


def _operands(tail: str) -> list[str]:
    m = re.match(r"[\w\-]+\((.*?)\)(?:,|$)", tail)
    if not m:
        return []
    return [o.strip().split()[-1].lstrip("%") for o in m.group(1).split(",") if o.strip()]


def dot_flops(hlo: str) -> dict:
    """Dot FLOPs of one run of the optimized HLO `hlo` (module docstring), and how
    many loops had no known trip count (counted once)."""
    comps, entry = _computations(hlo)
    unknown = 0
    memo: dict[str, float] = {}

    def walk(name: str) -> float:
        nonlocal unknown
        if name in memo:
            return memo[name]
        memo[name] = 0.0  # recursion guard
        types = {n: t for n, t, _ in comps.get(name, ())}
        total = 0.0
        for _, type_, tail in comps.get(name, ()):
            opcode = re.match(r"[\w\-]+", tail)
            opcode = opcode.group(0) if opcode else ""
            if opcode == "dot":
                out = _dims(type_)
                lhs = _dims(types.get(_operands(tail)[0], ""))
                contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", tail)
                if out and lhs and contracting:
                    k = math.prod(lhs[1][int(i)] for i in contracting.group(1).split(",") if i)
                    total += 2.0 * math.prod(out[1]) * k
            elif opcode == "while":
                body = re.search(r"\bbody=%?([\w.\-]+)", tail).group(1)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', tail)
                sub = walk(body)
                if trips is None and sub:
                    unknown += 1
                total += sub * (int(trips.group(1)) if trips else 1)
            elif opcode == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", tail)
                names = ([b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches
                         else re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", tail))
                total += max((walk(b) for b in names), default=0.0)
            else:
                for callee in re.findall(r"\b(?:calls|to_apply)=%?([\w.\-]+)", tail):
                    total += walk(callee)
        memo[name] = total
        return total

    return {"flops": walk(entry), "unknown_trip_counts": unknown}


_COLLECTIVES = ("all-to-all", "collective-permute", "all-gather", "all-reduce", "reduce-scatter")
_STABLEHLO_COLLECTIVE = re.compile(
    r'"stablehlo\.(?:' + "|".join(c.replace("-", "_") for c in _COLLECTIVES)
    + r')".*?:\s*\(.*?\)\s*->\s*(\(.*?\)|tensor<[^>]*>)', re.S)


def collective_dtypes(text: str) -> dict[str, int]:
    """{element type: collectives whose result has it} of a program: the lowered
    StableHLO (what JAX asked for) or the compiled HLO (what the backend runs); each op
    once, loops or not."""
    if "stablehlo." in text:
        types = [re.findall(r"x?([a-z]+\d+)>", m.group(1))
                 for m in _STABLEHLO_COLLECTIVE.finditer(text)]
    else:
        types = []
        for line in text.splitlines():
            m = _INSTR.match(line)
            if m:
                type_, tail = _split_type(line[m.end():])
                if re.match(r"(%s)(-start)?\(" % "|".join(_COLLECTIVES), tail):
                    types.append([t for t, _ in _ARRAY.findall(type_)])
    counts: dict[str, int] = {}
    for t in types:
        for dtype in dict.fromkeys(t):
            counts[dtype] = counts.get(dtype, 0) + 1
    return counts


def f32_weight_copies(hlo: str) -> int:
    """Bytes of ENTRY-level instructions that make an f32 array of a bf16 parameter's
    shape from that parameter alone (XLA CPU's hoisted bf16 -> f32 converts)."""
    comps, entry = _computations(hlo)
    params = {}
    for name, type_, tail in comps[entry]:
        if tail.startswith("parameter("):
            d = _dims(type_)
            if d and d[0] == "bf16":
                params[name] = d[1]
    total = 0
    for name, type_, tail in comps[entry]:
        ops = _operands(tail)
        d = _dims(type_)
        if (len(ops) == 1 and ops[0] in params and d and d[0] == "f32"
                and math.prod(d[1]) == math.prod(params[ops[0]]) and not type_.startswith("(")):
            total += 4 * math.prod(d[1])
    return total


# --------------------------------------------------------------------------- #
# One scale case, in a fresh process
# --------------------------------------------------------------------------- #


def _emit(result: dict) -> None:
    print(json.dumps(result), flush=True)


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
    pc = nn.ParallelConfig(sequence=case.sequence, tp_axis="tp" if case.tp > 1 else None)
    model = eqx.filter_eval_shape(getattr(models, fam.cls), cfg, parallel=pc,
                                  dtype=jnp.bfloat16, key=jax.random.PRNGKey(0))
    is_struct = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    arrays, static = eqx.partition(model, is_struct)
    # `nn.partition_specs` recognizes arrays with `eqx.is_array`, which a
    # ShapeDtypeStruct is not: take the specs of the traced model instead.
    box = []

    def take_specs(a):
        specs = nn.partition_specs(eqx.combine(a, static))
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
    _emit({"kind": "model", "params": count, "param_bytes_per_device": per_device,
           "build_s": time.perf_counter() - t0, "jax": jax.__version__})
    if args.child_probe:  # before the passes: a pass that fails ends the process
        _emit({"kind": "probe", **scan_probe()})

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
        dots = dot_flops(hlo)
        comm = collective_bytes(hlo, N_DEVICES)
        _emit({
            "kind": "pass", "pass": pass_, "lower_s": lower_s, "compile_s": compile_s,
            "temp_bytes": mem.temp_size_in_bytes, "argument_bytes": mem.argument_size_in_bytes,
            "output_bytes": mem.output_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes,
            "cost_flops": cost.get("flops"), "hlo_dot_flops": dots["flops"],
            "unknown_trip_counts": dots["unknown_trip_counts"],
            "f32_weight_copy_bytes": f32_weight_copies(hlo),
            "comm_bytes": comm["total"], "comm_by_kind": comm["by_kind"], "comm_ops": comm["ops"],
            "comm_unknown_trip_counts": comm["unknown_trip_counts"],
            "collective_dtypes": {"lowered": collective_dtypes(lowered.as_text()),
                                  "compiled": collective_dtypes(hlo)},
        })
        del lowered, compiled, hlo


def spawn_scale(args, case: Case, probe: bool) -> dict:
    """The results of one case, measured in a fresh process with a time limit."""
    cmd = [
        sys.executable, os.path.abspath(__file__), "--child-scale",
        "--child-model", case.model, "--child-tokens", str(case.tokens),
        "--child-mesh", case.mesh, "--child-sequence", case.sequence,
        "--child-passes", ",".join(args.passes),
    ] + (["--child-probe"] if probe else [])  # fmt: skip
    t0 = time.perf_counter()
    result: dict = {"passes": {}, "status": "ok"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr, rc = "", None
        result["status"] = f"not measured: compile exceeded the {args.case_timeout:g} s limit"
    result["wall_s"] = time.perf_counter() - t0
    for line in stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            if r["kind"] == "pass":
                result["passes"][r["pass"]] = r
            else:
                result[r["kind"]] = r
    if rc not in (0, None):
        lines = (stderr or stdout).strip().splitlines() or [""]
        errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception)\b", ln)]
        reason = (errors[-1:] or lines[-1:])[0][:300]
        if rc in (-9, 137):
            reason = "killed (out of memory?)"
        missing = [p for p in args.passes if p not in result["passes"]]
        where = " and ".join(missing) or "after the passes"
        result["status"] = f"error (exit {rc}, {where}): {reason}"
    return result


# --------------------------------------------------------------------------- #
# Wall time against diffusers
# --------------------------------------------------------------------------- #


def _times(fn, repeats: int) -> dict:
    """Wall and process CPU time (all threads) of `repeats` runs after a warm-up."""
    fn()  # warm-up
    runs, cpu = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"best_s": min(runs), "median_s": statistics.median(runs), "runs_s": runs,
            "best_cpu_s": min(cpu), "cpu_s": cpu}


MATMUL_N = 2048  # the reference matmul of the wall-time part: (N x N) @ (N x N), float32


def wall_vidax_child(args) -> None:
    """Builds the small float32 model (random init), writes it in diffusers' layout
    and the inputs to `--child-dir`, times the jitted forward, saves its output."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    from vidax_eqx import models

    d = args.child_dir
    model = models.WanTransformer3D(models.WanConfig(**WALL_CONFIG), dtype=jnp.float32,
                                    key=jax.random.PRNGKey(0))
    model.save_pretrained(os.path.join(d, "model"), layout="diffusers")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(WALL_LATENTS, dtype=np.float32)
    context = rng.standard_normal(WALL_TEXT, dtype=np.float32)
    timestep = np.float32(WALL_TIMESTEP)
    np.savez(os.path.join(d, "inputs.npz"), x=x, context=context, timestep=timestep)

    fn = eqx.filter_jit(lambda m, x, t, c: m(x, t, c))
    xs = (jnp.asarray(x), jnp.asarray(timestep), jnp.asarray(context))
    t0 = time.perf_counter()
    compiled = fn.lower(model, *xs).compile()
    compile_s = time.perf_counter() - t0
    out = None

    def run():
        nonlocal out
        out = jax.block_until_ready(compiled(model, *xs))

    r = _times(run, args.repeats)
    np.save(os.path.join(d, "out_vidax.npy"), np.asarray(out))
    a = jnp.asarray(rng.standard_normal((MATMUL_N, MATMUL_N), dtype=np.float32))
    matmul = jax.jit(jnp.matmul).lower(a, a).compile()
    r["matmul_s"] = _times(lambda: jax.block_until_ready(matmul(a, a)), 5)["best_s"]
    _emit({"side": "vidax_eqx", "compile_s": compile_s, **r, "jax": jax.__version__,
           "devices": len(jax.devices()), "tokens": math.prod(WALL_LATENTS[1:]) // 4})


def wall_diffusers_child(args) -> None:
    """Runs in the torch environment (no JAX): loads the same weights and inputs with
    diffusers and times its forward."""
    import numpy as np
    import torch
    import diffusers
    from diffusers import WanTransformer3DModel

    d = args.child_dir
    t0 = time.perf_counter()
    model = WanTransformer3DModel.from_pretrained(os.path.join(d, "model"),
                                                  torch_dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    io = np.load(os.path.join(d, "inputs.npz"))
    x = torch.from_numpy(io["x"])[None]
    context = torch.from_numpy(io["context"])[None]
    timestep = torch.tensor([float(io["timestep"])], dtype=torch.float32)
    out = None

    def run():
        nonlocal out
        with torch.no_grad():
            out = model(x, timestep, context, return_dict=False)[0]

    r = _times(run, args.repeats)
    np.save(os.path.join(d, "out_diffusers.npy"), out[0].numpy())
    a = torch.randn(MATMUL_N, MATMUL_N)
    with torch.no_grad():
        r["matmul_s"] = _times(lambda: a @ a, 5)["best_s"]
    _emit({"side": "diffusers", "load_s": load_s, **r, "torch": torch.__version__,
           "diffusers": diffusers.__version__, "threads": torch.get_num_threads()})


def run_wall(args) -> dict:
    """Both sides, one after the other, in fresh processes; the ratio and the output
    difference."""
    import numpy as np

    check = None
    if os.path.exists(args.torch_python):
        check = subprocess.run([args.torch_python, "-c", "import torch, diffusers"],
                               capture_output=True, text=True)
    if check is None or check.returncode != 0:
        why = ("not found" if check is None else
               (check.stderr.strip().splitlines() or ["import failed"])[-1][:200])
        return {"status": f"skipped: torch/diffusers not importable with "
                          f"{args.torch_python} ({why})"}
    d = tempfile.mkdtemp(prefix="vidax_wan_wall_")
    try:
        out = {"status": "ok"}
        for side, python, flag in (("vidax_eqx", sys.executable, "--child-wall"),
                                   ("diffusers", args.torch_python, "--child-diffusers")):
            cmd = [python, os.path.abspath(__file__), flag, "--child-dir", d,
                   "--repeats", str(args.repeats)]
            log(f"# wall time: {side} ...")
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                return {"status": f"error in the {side} process (exit {proc.returncode}): "
                                  + " | ".join(tail)[:400]}
            out[side] = json.loads(lines[-1])
        a = np.load(os.path.join(d, "out_vidax.npy")).astype(np.float64)
        b = np.load(os.path.join(d, "out_diffusers.npy")).astype(np.float64)
        out["max_rel_diff"] = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
        out["max_abs_diff"] = float(np.max(np.abs(a - b)))
        out["max_abs_ref"] = float(np.max(np.abs(b)))
        out["shape"] = list(a.shape)
        for k in ("best_s", "median_s", "best_cpu_s"):
            out[f"ratio_{k}"] = out["vidax_eqx"][k] / out["diffusers"][k]
        tokens = math.prod(WALL_LATENTS[1:]) // 4
        out["analytic_fwd_flops"] = wan_flops(WALL_CONFIG, tokens)["fwd_total"]
        for side in ("vidax_eqx", "diffusers"):
            r = out[side]
            r["gflops"] = out["analytic_fwd_flops"] / r["best_s"] / 1e9
            r["matmul_gflops"] = 2 * MATMUL_N**3 / r["matmul_s"] / 1e9
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- #
# Output
# --------------------------------------------------------------------------- #


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fmt(x, spec: str, missing: str = "–") -> str:
    return missing if x is None else format(x, spec)


def _gib(x) -> str:
    return _fmt(None if x is None else x / GIB, ".2f")


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


_KINDS = ("collective-permute", "all-to-all", "all-gather", "all-reduce", "reduce-scatter")


def comm_markdown(rows: list[dict]) -> list[str]:
    """The communication table of the rows with a minimum (CogVideoX)."""
    rows = [r for r in rows if r.get("comm_minimum")]
    if not rows:
        return []
    out = [
        "",
        "Communication (GiB per device, one run of the compiled program): measured from the "
        "compiled HLO (`collective_bytes` of `benchmarks/parallel.py`: loops times their trip "
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
            cells = ([_gib(p["comm_bytes"])] + [_gib(by[k]) if by.get(k) else "–" for k in _KINDS]
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


def wall_markdown(w: dict, args) -> str:
    tokens = math.prod(WALL_LATENTS[1:]) // 4
    head = (f"Wall time against diffusers: dim {WALL_CONFIG['dim']}, {WALL_CONFIG['num_heads']} "
            f"heads, ffn {WALL_CONFIG['ffn_dim']}, {WALL_CONFIG['num_layers']} layers, latents "
            f"{WALL_LATENTS} ({tokens:,} tokens), text {WALL_TEXT[0]} x {WALL_TEXT[1]}, "
            "float32, batch 1, "
            f"forward, the same weights and inputs; this machine's CPU ({os.cpu_count()} cores, "
            "shared with other jobs).")
    if w["status"] != "ok":
        return head + "\n\n" + w["status"]
    v, t = w["vidax_eqx"], w["diffusers"]

    def row(name, r, setup, versions):
        return (f"| {name} | {r['best_s']:.2f} | {r['median_s']:.2f} | {r['best_cpu_s']:.2f} | "
                f"{len(r['runs_s'])} | "
                f"{r['gflops']:.0f} | {r['matmul_gflops']:.0f} | "
                f"{r['gflops'] / r['matmul_gflops']:.2f} | {setup} | {versions} |")

    return "\n".join([
        head,
        "",
        "| implementation | best (s) | median (s) | best CPU time (s) | runs | GFLOP/s | "
        "matmul GFLOP/s | of matmul | setup (s) | versions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        row("vidax_eqx (`eqx.filter_jit`, 1 device)", v, f"{v['compile_s']:.1f} compile",
            f"jax {v['jax']}"),
        row("diffusers `WanTransformer3DModel` (`torch.no_grad`)", t, f"{t['load_s']:.1f} load",
            f"torch {t['torch']} ({t['threads']} threads), diffusers {t['diffusers']}"),
        "",
        f"**vidax_eqx / diffusers: {w['ratio_best_s']:.2f} (best), {w['ratio_median_s']:.2f} "
        f"(median); process CPU time {w['ratio_best_cpu_s']:.2f} (best).** Max relative "
        "difference of the outputs (max |vidax - diffusers| / max "
        f"|diffusers|): {w['max_rel_diff']:.1e} (max |diff| {w['max_abs_diff']:.1e}, max "
        f"|diffusers| {w['max_abs_ref']:.2f}).",
        "",
        f"GFLOP/s: the analytic forward dot FLOPs ({w['analytic_fwd_flops'] / 1e12:.3f} TFLOP, "
        "module docstring) over the best time; matmul: a float32 "
        f"{MATMUL_N}x{MATMUL_N}x{MATMUL_N} product in the same process (best of 5), the "
        "framework's own ceiling on this machine. Each side ran in its own process, one after "
        "the other; one warm-up run each, then the timed runs; vidax_eqx's kernel choice is "
        "`implementation=\"auto\"`. The machine is shared: other jobs slow wall time (and "
        "the matmul rate) by different amounts in the two processes; process CPU time (all "
        "threads of the process) moves less, but counts threads that spin.",
    ])


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
        "on 8 simulated CPU devices, no weights allocated), and Wan's forward wall time "
        "against diffusers on a small config."
    )
    p.add_argument("--part", choices=("all", "scale", "diffusers"), default="all")
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
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per side of the diffusers comparison (default 3)")
    p.add_argument("--torch-python", default=TORCH_PYTHON,
                   help=f"a Python with torch and diffusers (default {TORCH_PYTHON})")
    p.add_argument("--out", default=None,
                   help="output stem (default benchmarks/results/models; models_quick with "
                   "--quick)")
    p.add_argument("--quick", action="store_true",
                   help="1.3B at 4,096 tokens on sp8, and the diffusers comparison with 1 run")
    # Hidden: one measurement in this (fresh) process.
    for flag in ("--child-scale", "--child-wall", "--child-diffusers", "--child-probe"):
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag in ("--child-model", "--child-mesh", "--child-sequence", "--child-passes",
                 "--child-dir"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    p.add_argument("--child-tokens", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.models = args.models or list(QUICK["models"])
        args.tokens = args.tokens or list(QUICK["tokens"])
        args.meshes = args.meshes or list(QUICK["meshes"])
        args.repeats = 1
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
    if args.child_wall:
        wall_vidax_child(args)
        return 0
    if args.child_diffusers:
        wall_diffusers_child(args)
        return 0

    t_start = time.perf_counter()
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]) if argv is None
        else None,
    }
    sections = []
    if args.part in ("all", "scale"):
        rows, info = run_scale(args)
        report.update(scale=rows, scale_info=info)
        sections.append(scale_markdown(rows, info) + "\n" + scale_notes(rows, info))
    if args.part in ("all", "diffusers"):
        t0 = time.perf_counter()
        w = run_wall(args)
        w["seconds"] = time.perf_counter() - t0
        report["diffusers"] = w
        sections.append(wall_markdown(w, args))
        log(f"# wall time: {w['status']}  [{w['seconds']:.0f} s]")
    report["seconds"] = time.perf_counter() - t_start
    text = "\n\n".join(sections)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".md", "w", encoding="utf-8") as f:
        command = report["command"] or "benchmarks/models.py"
        f.write(f"# Video DiT models benchmark (Wan 2.1, CogVideoX)\n\n"
                f"`python {command}`, {report['date']}, "
                f"{report['seconds']:.0f} s.\n\n{text}\n")
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    log(f"# wrote {os.path.relpath(args.out)}.md and .json after {report['seconds']:.0f} s")
    failed = [r for r in report.get("scale", []) if r["status"].startswith("error")]
    return 1 if failed or report.get("diffusers", {}).get("status", "ok").startswith("error") else 0


if __name__ == "__main__":
    sys.exit(main())
