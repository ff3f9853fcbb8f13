"""Soak test of the sharded attention paths on 8 simulated CPU devices.

XLA's CPU runtime can abort the whole process (`Check failed: id < num_threads`,
`Termination timeout for collective permute RendezvousKey ... Exiting`) when two
independent collectives of one program run at the same time and meet in one
rendezvous. This script draws sharded configurations at random (seeded), runs each
in its own subprocess so that an abort is counted instead of ending the soak, and
classifies each one:

- `ok`: both executions finished and match a single-device float32 reference;
- `wrong`: the numbers are off (or not finite, or the two executions differ);
- `error`: a Python exception (its type and message are printed);
- `abort`: the child died by a signal, or printed XLA's fatal log lines;
- `timeout`: the child ran past `--timeout` (its process group is killed).

Each child puts `--repo` first on its import path, sets
`XLA_FLAGS=--xla_force_host_platform_device_count=8` before importing JAX, builds a
mesh over the first `n` devices, and runs the configuration under
`jax.jit(jax.shard_map(...))` twice back to back (no blocking in between), then
checks both results against plain `jax.numpy` attention on one device: the output
(`forward`), the gradients of `<out, cotangent>` in q, k, v (`grad`), or the
gradient in q of `<(dq, dk, dv), w>` (`second`: docs/transformations.md lists
Ulysses and USP, joint layouts included; ring attention's is the program that aborted).

FSDP draws (`fsdp-attention`, `fsdp-wan`) add a data-parallel and a tensor-parallel axis
and weights fully sharded over some of the axes that carry data (`nn.sharding.ParallelConfig(
fsdp_axes=...)`): a Wan self-attention (`nn.Attention`) or a tiny whole Wan
(`models.run_sharded`), placed by `nn.sharding.partition_specs` and run through
`nn.sharding.filter_shard_map`, where every module all-gathers its own weights (and the
backward reduce-scatters their gradients) among its sequence and tensor-parallel
collectives. They check the output (`forward`), or the gradients of `<out, cotangent>`
in every weight and in the tokens (`grad`), against the same module on one device.

    python scripts/soak_collectives.py                          # 200 drawn configurations
    python scripts/soak_collectives.py --count 60 --seed 0 --jobs 2 --json soak.json
    python scripts/soak_collectives.py --profile ci             # the fixed CI list (tests/test_collective_soak.py)
    python scripts/soak_collectives.py --repo /tmp/old_checkout --profile ci
    python scripts/soak_collectives.py --list --count 20        # print the draws, run nothing
    python scripts/soak_collectives.py --count 20 --fsdp-share 1   # FSDP draws only
    python scripts/soak_collectives.py --child '<a "config" of the JSON report>'   # rerun one, in this process

The exit status is 1 when any configuration is not `ok`.
"""

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 8
ATTENTION_PATHS = ("ring", "ring-zigzag", "ulysses", "joint-ulysses", "usp", "joint-usp")
FSDP_PATHS = ("fsdp-attention", "fsdp-wan")
PATHS = ATTENTION_PATHS + FSDP_PATHS
FSDP_SHARE = 0.25  # of the drawn configurations
# Second order on every attention path: the docs/transformations.md lists Ulysses and
# USP, and ring attention's is the program known to abort over 4 simulated devices.
SECOND_ORDER = frozenset(ATTENTION_PATHS)
MODES = ("forward", "grad", "second")
OUTCOMES = ("ok", "wrong", "error", "abort", "timeout")
RTOL = 1e-4  # max |sharded - reference| / max |reference|, per array, float32
RESULT_MARK = "SOAK_RESULT "
# XLA / absl fatal log lines: `F1130 23:36:41.935781 ... Check failed: ...`.
FATAL = re.compile(
    r"^F\d{4} |Check failed|Termination timeout for collective|Fatal Python error", re.M
)


@dataclasses.dataclass(frozen=True)
class Config:
    """One sharded configuration. `seq` counts the visual (sharded) tokens; the joint
    paths add a replicated text prefix of `text` tokens before every device's chunk."""

    path: str
    ulysses: int  # Ulysses group size (1 for ring attention)
    ring: int  # ring size (1 for Ulysses)
    seq: int
    text: int
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    layout: str  # "contiguous" or "zigzag" (ring-zigzag, usp)
    implementation: str
    mode: str
    seed: int
    # FSDP paths only: data- and tensor-parallel sizes, the FSDP axes, the whole model's
    # rematerialization policy ("none" or a `remat=` name) and `fsdp_regather`.
    dp: int = 1
    tp: int = 1
    fsdp: tuple = ()
    remat: str = "none"
    regather: bool = True

    def __post_init__(self):
        object.__setattr__(self, "fsdp", tuple(self.fsdp))  # a JSON list back to a tuple

    @property
    def devices(self) -> int:
        return self.dp * self.ulysses * self.ring * self.tp

    @property
    def sequence(self) -> str:
        """The FSDP paths' `ParallelConfig.sequence`."""
        if self.ulysses > 1 and self.ring > 1:
            return "usp"
        return "ulysses" if self.ulysses > 1 else "ring" if self.ring > 1 else "none"

    def describe(self) -> str:
        if self.path in FSDP_PATHS:
            sizes = (("dp", self.dp), ("U", self.ulysses), ("R", self.ring), ("tp", self.tp))
            mesh = "x".join(f"{name}{size}" for name, size in sizes if size > 1)
            extras = [self.layout] if self.ring > 1 else []
            if self.path == "fsdp-wan":
                extras += [f"remat={self.remat}"] + ([] if self.regather else ["keep-gathered"])
            return " ".join([self.path, mesh, f"fsdp={'+'.join(self.fsdp)}", f"S={self.seq}",
                             f"B={self.batch}", f"H={self.heads}", f"D={self.head_dim}", *extras,
                             self.implementation, self.mode])
        mesh = f"U{self.ulysses}xR{self.ring}" if self.path.endswith("usp") else f"n{self.devices}"
        seq = f"S={self.seq}" + (f"+T{self.text}" if self.text else "")
        heads = f"H={self.heads}" + (f"/kv{self.kv_heads}" if self.kv_heads != self.heads else "")
        extras = [self.layout] if self.path.endswith("usp") else []
        extras += ["causal"] if self.causal else []
        return " ".join([self.path, mesh, seq, f"B={self.batch}", heads, f"D={self.head_dim}",
                         *extras, self.implementation, self.mode])


# -- drawing configurations ---------------------------------------------------------------


def _seq_multiple(path: str, U: int, R: int, layout: str) -> int:
    """What the visual sequence length must be a multiple of (see each function's docstring)."""
    n = U * R
    if path == "ring-zigzag":
        return 2 * n
    if path.endswith("usp") and layout == "zigzag":
        return math.lcm(2 * R, n)  # each ring rank's share splits in two halves
    return n


def _heads(rng: random.Random, U: int) -> int:
    """A head count that Ulysses over `U` devices can split (ring: any)."""
    fits = [h for h in (4, 8, 12, 16) if h % U == 0]
    return rng.choice(fits) if fits else U * math.ceil(8 / U)


# Attention flops (`4 B H S^2 D`) times these per pass: a drawn configuration above
# WORK_BUDGET is shrunk (batch 1, then D <= 32, then shorter sequences), so that one
# child (compile, two sharded executions, the reference) stays well inside --timeout
# on a loaded two-core machine.
WORK_PER_PASS = {"forward": 1.0, "grad": 3.5, "second": 10.0}
WORK_BUDGET = 1.5e11


def _work(cfg: Config) -> float:
    return 4 * cfg.batch * cfg.heads * (cfg.seq + cfg.text) ** 2 * cfg.head_dim * WORK_PER_PASS[cfg.mode]


def draw_fsdp(rng: random.Random, index: int, seed: int, max_seq: int) -> Config:
    """An FSDP configuration: a mesh of at most 8 devices (dp x Ulysses x ring x tp), FSDP
    over a non-empty subset of the axes that carry data (dp: the batch; the sequence
    axes), heads that the tensor-parallel and Ulysses axes split."""
    path = rng.choices(FSDP_PATHS, [0.6, 0.4])[0]
    U, R = rng.choice([(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2)])
    dp = rng.choice([d for d in (1, 2, 4, 8) if d * U * R <= DEVICES and (d > 1 or U * R > 1)])
    tp = rng.choice([t for t in (1, 2) if dp * U * R * t <= DEVICES])
    layout = rng.choice(["contiguous", "zigzag"]) if R > 1 else "contiguous"
    sizes = (("dp", dp), ("sp", U if U > 1 else R), ("ring", R if U > 1 else 1))
    data = [a for a, n in sizes if n > 1]  # the axes that carry the batch or the sequence
    fsdp = tuple(a for a in data if rng.random() < 0.6) or (rng.choice(data),)
    heads = rng.choice([h for h in (4, 8, 16) if h % (tp * U) == 0])
    multiple = U * R * (2 if layout == "zigzag" else 1)
    if path == "fsdp-wan":  # patch tokens, padded by the model to the split
        seq = rng.randint(max(multiple, 8), max(min(max_seq, 96), multiple, 8))
    else:
        seq = multiple * rng.randint(max(1, 16 // multiple), max(1, min(max_seq, 256) // multiple))
    return Config(
        path=path, ulysses=U, ring=R, seq=seq, text=0, batch=dp * rng.choice([1, 2]),
        heads=heads, kv_heads=heads, head_dim=rng.choice([8, 16, 32]), causal=False,
        layout=layout, implementation=rng.choices(["blockwise", "auto", "xla"], [0.4, 0.3, 0.3])[0],
        mode=rng.choice(MODES[:2]), seed=seed * 100_003 + index, dp=dp, tp=tp, fsdp=fsdp,
        remat=rng.choice(["none", "full", "dots_saveable"]) if path == "fsdp-wan" else "none",
        regather=path != "fsdp-wan" or rng.random() < 0.8,
    )


def draw(rng: random.Random, index: int, seed: int, max_seq: int,
         fsdp_share: float = FSDP_SHARE) -> Config:
    if rng.random() < fsdp_share:
        return draw_fsdp(rng, index, seed, max_seq)
    path = rng.choice(ATTENTION_PATHS)
    layout = "zigzag" if path == "ring-zigzag" else "contiguous"
    if path.endswith("usp"):
        U, R = rng.choice([(2, 2), (2, 3), (3, 2), (2, 4), (4, 2)])
        layout = rng.choice(["contiguous", "zigzag"])
    elif path.startswith("ring"):
        U, R = 1, rng.randint(2, DEVICES)
    else:
        U, R = rng.randint(2, DEVICES), 1
    multiple = _seq_multiple(path, U, R, layout)
    seq = math.exp(rng.uniform(math.log(64), math.log(max(max_seq, 64))))
    seq = max(multiple, min(round(seq / multiple), max_seq // multiple) * multiple)
    text = round(math.exp(rng.uniform(0, math.log(128)))) if path.startswith("joint") else 0
    heads = _heads(rng, U)
    kv_heads = heads
    if rng.random() < 0.35:  # GQA / MQA
        kv_heads = rng.choice([h for h in (1, 2, 4, heads // 4, heads // 2) if 0 < h < heads and heads % h == 0])
    implementation = rng.choices(["blockwise", "auto", "xla"], [0.6, 0.2, 0.2])[0]
    modes = MODES if path in SECOND_ORDER else MODES[:2]
    cfg = Config(
        path=path, ulysses=U, ring=R, seq=seq, text=text, batch=rng.choice([1, 2]),
        heads=heads, kv_heads=kv_heads, head_dim=rng.choice([8, 32, 64]), causal=rng.random() < 0.5,
        layout=layout, implementation=implementation,
        mode=rng.choices(modes, [0.25, 0.45, 0.3][: len(modes)])[0], seed=seed * 100_003 + index,
    )
    while _work(cfg) > WORK_BUDGET:
        if cfg.batch > 1:
            cfg = dataclasses.replace(cfg, batch=1)
        elif cfg.head_dim > 32:
            cfg = dataclasses.replace(cfg, head_dim=32)
        elif cfg.seq > multiple:
            cfg = dataclasses.replace(cfg, seq=max(multiple, cfg.seq // 2 // multiple * multiple))
        else:
            break
    if cfg.implementation == "xla" and cfg.seq + cfg.text > 1024:
        cfg = dataclasses.replace(cfg, implementation="blockwise")  # (B, H, S, S) logits per device
    return cfg


def _ci(path, U, R, seq, mode, *, text=0, heads=8, kv_heads=8, head_dim=64, causal=False,
        layout="contiguous", implementation="blockwise", batch=1, **fsdp) -> Config:
    return Config(path=path, ulysses=U, ring=R, seq=seq, text=text, batch=batch, heads=heads,
                  kv_heads=kv_heads, head_dim=head_dim, causal=causal, layout=layout,
                  implementation=implementation, mode=mode, seed=0, **fsdp)


# The fixed CI list: the patterns that aborted XLA's CPU runtime before the collectives
# were ordered, at the smallest sizes found to trigger them (the USP gradient, ring
# second order over 4 devices: both need B = 2 and GQA), then one configuration of
# every other path, and two FSDP configurations. S <= 512, small heads: about a minute
# and a half on two cores.
CI_PROFILE = (
    _ci("usp", 2, 4, 512, "grad", batch=2, heads=4, kv_heads=2, head_dim=32),
    _ci("ring", 1, 4, 32, "second", batch=2, heads=4, kv_heads=2, head_dim=8, causal=True),
    _ci("ring-zigzag", 1, 8, 128, "grad", batch=2, heads=4, kv_heads=4, head_dim=8, causal=True,
        layout="zigzag"),
    _ci("ulysses", 4, 1, 128, "second", batch=2, heads=8, kv_heads=2, head_dim=32, causal=True),
    _ci("joint-ulysses", 8, 1, 128, "grad", text=7, heads=8, kv_heads=8, head_dim=32),
    _ci("joint-usp", 4, 2, 128, "grad", text=5, batch=2, heads=8, kv_heads=2, head_dim=32,
        causal=True, layout="zigzag"),
    _ci("usp", 2, 3, 192, "forward", heads=8, kv_heads=1, head_dim=64, causal=True,
        layout="zigzag", implementation="auto"),
    # FSDP: weights gathered (and gradients reduce-scattered) among a zigzag ring's
    # ppermutes and the tensor-parallel psums; a whole Wan over dp x Ulysses x tp, its
    # scanned blocks gathered again in the backward pass.
    _ci("fsdp-attention", 1, 4, 64, "grad", batch=2, heads=4, kv_heads=4, head_dim=8,
        layout="zigzag", tp=2, fsdp=("sp",)),
    _ci("fsdp-wan", 2, 1, 24, "grad", batch=2, heads=4, kv_heads=4, head_dim=8, dp=2, tp=2,
        fsdp=("dp", "sp"), remat="full"),
)


# -- the child: one configuration ---------------------------------------------------------


def _zigzag_order(parts: int) -> list[int]:
    """Chunks of `2 * parts` in zigzag order: rank r holds chunks r and 2 * parts - 1 - r."""
    return [c for r in range(parts) for c in (r, 2 * parts - 1 - r)]


def _relative_errors(got, want) -> list[tuple[str, float]]:
    """`(path, max|got - want| / scale)` per array of two PyTrees, `scale` the array's
    largest magnitude, at least 1e-3 of the largest of all (a gradient that is float32
    noise around zero is compared to the others' scale)."""
    import jax
    import numpy as np

    pairs = [(jax.tree_util.keystr(p), np.asarray(g, np.float64), np.asarray(w, np.float64))
             for (p, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want))]
    top = max((float(np.abs(w).max()) for _, _, w in pairs if w.size), default=0.0)
    return [(p, float(np.abs(g - w).max()) / max(float(np.abs(w).max()), 1e-3 * top, 1e-30))
            if np.isfinite(g).all() else (p, float("inf")) for p, g, w in pairs if w.size]


def _run_fsdp_child(cfg: Config) -> dict:
    """An FSDP configuration: the module (or whole model) sharded by
    `nn.sharding.partition_specs`, run through `nn.sharding.filter_shard_map` twice, against one device."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import vidax_eqx
    from vidax_eqx import models, nn, parallel

    extra = {"ring": cfg.ring} if cfg.sequence == "usp" else {}
    sp = cfg.ulysses if cfg.sequence in ("ulysses", "usp") else cfg.ring
    mesh = parallel.make_mesh(dp=cfg.dp, sp=sp, tp=cfg.tp, extra_axes=extra)
    config = nn.sharding.ParallelConfig(
        sequence=cfg.sequence, ring_axis="ring" if extra else None, layout=cfg.layout,
        tp_axis="tp" if cfg.tp > 1 else None, fsdp_axes=cfg.fsdp, fsdp_regather=cfg.regather)
    batch_axis = "dp" if cfg.dp > 1 else None
    rng = np.random.default_rng(cfg.seed)
    dim = cfg.heads * cfg.head_dim

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    def random_weights(make):
        """`make(key)`'s module with seeded normal weights, scaled by 1 / sqrt(the last
        dimension), filled in NumPy (building it eagerly compiles a program per array)."""
        def fill(x):
            if not isinstance(x, jax.ShapeDtypeStruct):
                return x
            return jnp.asarray(rng.standard_normal(x.shape) / np.sqrt(x.shape[-1]), x.dtype)

        return jax.tree.map(fill, eqx.filter_eval_shape(make, jax.random.key(0)))

    if cfg.path == "fsdp-attention":
        module = random_weights(lambda key: nn.Attention(
            dim, cfg.heads, qk_norm="rms", implementation=cfg.implementation, key=key))
        inputs = (normal(cfg.batch, cfg.seq, dim),)

        def single(m, x):
            return jax.vmap(m)(x)

        def per_device(m, x):  # the whole sequence in, each device its share
            def one(x):
                return nn.sharding.gather_tokens(m(nn.sharding.shard_tokens(x, m.parallel)), m.parallel)

            return jax.vmap(one)(x)

        def sharded(m, x):
            return nn.sharding.filter_shard_map(
                per_device, mesh=mesh, in_specs=(nn.sharding.partition_specs(m, mesh), P(batch_axis)),
                out_specs=P(batch_axis))(m, x)
    else:
        wan = models.WanConfig(dim=dim, ffn_dim=3 * dim // 2, num_heads=cfg.heads, num_layers=2,
                               in_channels=4, out_channels=4, text_dim=24, freq_dim=32)
        module = random_weights(lambda key: models.WanTransformer3D(
            wan, implementation=cfg.implementation, key=key))
        w = -(-cfg.seq // 4)  # patch grid (2, 2, w): about cfg.seq tokens
        inputs = (normal(cfg.batch, 4, 2, 4, 2 * w),
                  jnp.asarray(rng.uniform(0, 1000, cfg.batch), jnp.float32),
                  normal(cfg.batch, 5, 24))
        remat = None if cfg.remat == "none" else cfg.remat

        def single(m, *inputs):
            return jax.vmap(lambda *a: m(*a, remat=remat))(*inputs)

        def sharded(m, *inputs):
            return models.run_sharded(m, *inputs, mesh=mesh, batch_axis=batch_axis, remat=remat)

    params, static = eqx.partition(module, eqx.is_array)
    ct = normal(*jax.eval_shape(lambda: single(module, *inputs)).shape)

    def program(run, static):
        def forward(params, *inputs):
            return run(eqx.combine(params, static), *inputs)

        if cfg.mode == "forward":
            return forward

        def loss(params, *inputs):
            return jnp.vdot(forward(params, *inputs), ct)

        # The weights' gradients, and the tokens' for the attention module.
        return jax.grad(loss, argnums=(0, 1) if cfg.path == "fsdp-attention" else 0)

    placed = nn.sharding.shard_module(nn.sharding.with_parallel(module, config), mesh)
    sharded_params, sharded_static = eqx.partition(placed, eqx.is_array)
    clock = time.monotonic()
    compiled = jax.jit(program(sharded, sharded_static)).lower(sharded_params, *inputs).compile()
    seconds = dict(compile=time.monotonic() - clock)
    clock = time.monotonic()
    run1 = compiled(sharded_params, *inputs)
    run2 = compiled(sharded_params, *inputs)  # back to back, no blocking in between
    run1, run2 = jax.block_until_ready((run1, run2))
    seconds["run"] = time.monotonic() - clock
    clock = time.monotonic()
    ref = jax.block_until_ready(jax.jit(program(single, static))(params, *inputs))
    seconds["reference"] = time.monotonic() - clock

    worst, problems = 0.0, []
    for run, got in (("first", run1), ("second", run2)):
        for name, err in _relative_errors(got, ref):
            worst = max(worst, err)
            if not err <= RTOL:
                problems.append(
                    f"{run} execution: {cfg.mode}{name} relative error {err:.2e} > {RTOL:g}")
    if not all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(run1), jax.tree.leaves(run2))):
        problems.append("the two executions differ")
    return dict(outcome="wrong" if problems else "ok", max_rel_err=worst,
                detail="; ".join(dict.fromkeys(problems[:6])), vidax_eqx=vidax_eqx.__file__,
                phases={k: round(t, 1) for k, t in seconds.items()})


def _run_child(cfg: Config) -> dict:
    if cfg.path in FSDP_PATHS:
        return _run_fsdp_child(cfg)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import vidax_eqx
    from vidax_eqx import parallel

    B, S, T, H, H_kv, D = cfg.batch, cfg.seq, cfg.text, cfg.heads, cfg.kv_heads, cfg.head_dim
    n = cfg.devices
    zigzag_parts = {"ring-zigzag": n}.get(cfg.path, cfg.ring if cfg.layout == "zigzag" else 0)
    rng = np.random.default_rng(cfg.seed)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    # Global arrays over [text; visual] (T = 0 but for the joint paths).
    q, ct, wq = normal(B, T + S, H, D), normal(B, T + S, H, D), normal(B, T + S, H, D)
    k, v, wk, wv = (normal(B, T + S, H_kv, D) for _ in range(4))
    shares = rng.dirichlet(np.ones(n), size=T).T.astype(np.float32)  # (n, T): text cotangent copies

    def to_devices(x, text_rows=None):
        """Global `(B, T + S, ...)` -> the per-device layout, concatenated: zigzag
        permutation of the visual part, then the text prefix before every chunk
        (`text_rows(i, text)` gives device i's copy)."""
        text, visual = x[:, :T], x[:, T:]
        if zigzag_parts:
            chunks = np.split(visual, 2 * zigzag_parts, axis=1)
            visual = np.concatenate([chunks[c] for c in _zigzag_order(zigzag_parts)], 1)
        if not T:
            return visual
        parts = np.split(visual, n, axis=1)
        return np.concatenate(
            [np.concatenate([text if text_rows is None else text_rows(i, text), p], 1)
             for i, p in enumerate(parts)], 1)

    def from_devices(x):
        """Inverse of `to_devices`: `(text rows of every device (n, B, T, ...), global)`,
        global text rows summed over the copies (as gradients are)."""
        x = np.asarray(x)
        blocks = np.split(x, n, axis=1)
        text = np.stack([b[:, :T] for b in blocks])
        visual = np.concatenate([b[:, T:] for b in blocks], 1)
        if zigzag_parts:
            chunks = np.split(visual, 2 * zigzag_parts, axis=1)
            order = _zigzag_order(zigzag_parts)
            visual = np.concatenate([chunks[order.index(c)] for c in range(2 * zigzag_parts)], 1)
        return text, np.concatenate([text.sum(0), visual], 1)

    # The sharded function, on the per-device layout.
    opts = dict(causal=cfg.causal, implementation=cfg.implementation)
    if cfg.path.endswith("usp"):
        mesh = parallel.make_mesh(sp=cfg.ulysses, extra_axes={"ring": cfg.ring})
        spec = P(None, ("ring", parallel.SP_AXIS))
        attend = lambda q, k, v: parallel.usp_attention(  # noqa: E731
            q, k, v, ulysses_axis=parallel.SP_AXIS, ring_axis="ring", layout=cfg.layout,
            text_len=T, **opts)
    else:
        mesh = parallel.make_mesh(sp=n)
        spec = P(None, parallel.SP_AXIS)
        if cfg.path.startswith("ring"):
            attend = lambda q, k, v: parallel.ring_attention(  # noqa: E731
                q, k, v, ring_axis=parallel.SP_AXIS, layout=cfg.layout, **opts)
        elif cfg.path == "ulysses":
            attend = lambda q, k, v: parallel.sequence_parallel_self_attention(  # noqa: E731
                q, k, v, parallel.SP_AXIS, **opts)
        else:
            attend = lambda q, k, v: parallel.sequence_parallel_joint_self_attention(  # noqa: E731
                q, k, v, T, parallel.SP_AXIS, **opts)
    sharded = jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

    def programs(f):
        """The program of this mode for an attention function `f(q, k, v)`."""
        loss = lambda q, k, v, ct: jnp.vdot(f(q, k, v), ct)  # noqa: E731
        grads = jax.grad(loss, argnums=(0, 1, 2))
        if cfg.mode == "forward":
            return lambda q, k, v, ct, w: f(q, k, v)
        if cfg.mode == "grad":
            return lambda q, k, v, ct, w: grads(q, k, v, ct)
        inner = lambda q, k, v, ct, w: sum(  # noqa: E731
            jnp.vdot(g, x) for g, x in zip(grads(q, k, v, ct), w))
        return jax.grad(inner, argnums=0)

    # Every device's copy of the text cotangent gets a share; w's text rows are copies.
    dev_ct = to_devices(ct, lambda i, t: t * shares[i][None, :, None, None])
    dev_args = [to_devices(x) for x in (q, k, v)] + [dev_ct, tuple(to_devices(x) for x in (wq, wk, wv))]
    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    dev_args = jax.tree.map(put, dev_args)
    clock = time.monotonic()
    program = jax.jit(programs(sharded)).lower(*dev_args).compile()
    seconds = dict(compile=time.monotonic() - clock)
    clock = time.monotonic()
    run1 = program(*dev_args)
    run2 = program(*dev_args)  # back to back, no blocking in between
    run1, run2 = jax.block_until_ready((run1, run2))
    seconds["run"] = time.monotonic() - clock
    clock = time.monotonic()

    def reference(q, k, v):
        """Plain float32 attention over the global `[text; visual]`, one head at a time."""
        rep = H // H_kv
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        hi = jax.lax.Precision.HIGHEST

        @jax.checkpoint
        def head(x):
            qh, kh, vh = x
            s = jnp.einsum("bqd,bkd->bqk", qh, kh, precision=hi) / math.sqrt(D)
            if cfg.causal:
                s = jnp.where(jnp.tril(jnp.ones((T + S, T + S), bool)), s, -jnp.inf)
            return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), vh, precision=hi)

        out = jax.lax.map(head, tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v)))
        return jnp.moveaxis(out, 0, 2)

    ref = jax.jit(programs(reference))(q, k, v, ct, (wq, wk, wv))
    ref = jax.tree.map(np.asarray, jax.block_until_ready(ref))
    seconds["reference"] = time.monotonic() - clock

    names = {"forward": ["out"], "grad": ["dq", "dk", "dv"], "second": ["d(<grad, w>)/dq"]}[cfg.mode]
    ref_leaves = jax.tree.leaves(ref)
    worst, problems = 0.0, []
    for run, got in (("first", run1), ("second", run2)):
        for name, leaf, r in zip(names, jax.tree.leaves(got), ref_leaves):
            text, g = from_devices(leaf)
            candidates = [g]
            if cfg.mode == "forward" and T:  # every device's text rows are the text output
                candidates = [np.concatenate([text[i], g[:, T:]], 1) for i in range(n)]
            for g in candidates:
                if not np.isfinite(g).all():
                    problems.append(f"{run} execution: {name} is not finite")
                    continue
                err = float(np.abs(g - r).max() / max(float(np.abs(r).max()), 1e-30))
                worst = max(worst, err)
                if err > RTOL:
                    problems.append(f"{run} execution: {name} relative error {err:.2e} > {RTOL:g}")
    for a, b in zip(jax.tree.leaves(run1), jax.tree.leaves(run2)):
        if not np.array_equal(np.asarray(a), np.asarray(b)):
            problems.append("the two executions differ")
            break
    return dict(outcome="wrong" if problems else "ok", max_rel_err=worst,
                detail="; ".join(dict.fromkeys(problems)), vidax_eqx=vidax_eqx.__file__,
                phases={k: round(t, 1) for k, t in seconds.items()})



def child_main(cfg_json: str, repo: str) -> int:
    """Runs one configuration in this process and prints one `SOAK_RESULT {json}` line."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={DEVICES}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.abspath(repo))
    cfg = Config(**json.loads(cfg_json))
    try:
        result = _run_child(cfg)
    except Exception as e:  # noqa: BLE001 - classified and reported, not hidden
        import traceback

        tb = traceback.extract_tb(e.__traceback__)
        tb = [f for f in tb if f"{os.sep}vidax_eqx{os.sep}" in f.filename] or tb  # the library's frame
        where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
        result = dict(outcome="error", detail=f"{type(e).__name__}: {e}{where}")
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


# -- the parent: run, classify, summarize ----------------------------------------------------


_LIVE: set = set()  # the children running now, killed (by process group) on Ctrl-C
_STOP = threading.Event()


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_one(cfg: Config, repo: str, timeout: float) -> dict:
    """Runs `cfg` in a child process and classifies it (see the module docstring)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(repo), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, os.path.abspath(__file__), "--repo", repo,
           "--child", json.dumps(dataclasses.asdict(cfg))]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)  # its own process group
    _LIVE.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, err = proc.communicate()
        timed_out = True
    finally:
        _LIVE.discard(proc)
    seconds = time.monotonic() - start
    results = [json.loads(line[len(RESULT_MARK):]) for line in out.splitlines()
               if line.startswith(RESULT_MARK)]
    fatal = FATAL.search(err)
    if timed_out:
        result = dict(outcome="timeout", detail=f"killed after {timeout:g} s")
    elif proc.returncode < 0 or fatal:
        line = err[fatal.start():].splitlines()[0] if fatal else ""
        sig = (f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exit status {proc.returncode}")
        result = dict(outcome="abort", detail=f"{sig}: {line[:300]}".rstrip(": "))
    elif results:
        result = results[-1]
    else:
        tail = err.strip().splitlines()[-1:] or ["(no output)"]
        result = dict(outcome="error", detail=f"child exit status {proc.returncode}: {tail[0][:300]}")
    result.update(seconds=round(seconds, 1), returncode=proc.returncode)
    return result


def summarize(records: list[dict]) -> dict:
    def table(key):
        rows = collections.defaultdict(collections.Counter)
        for r in records:
            rows[key(r)][r["outcome"]] += 1
        return {k: dict(v) for k, v in sorted(rows.items())}

    return dict(
        outcomes=dict(collections.Counter(r["outcome"] for r in records)),
        per_path=table(lambda r: r["config"]["path"]),
        per_mode=table(lambda r: r["config"]["mode"]),
        seconds=round(sum(r["seconds"] for r in records), 1),
    )


def print_summary(summary: dict, records: list[dict], wall: float) -> None:
    def counts(c):
        return ", ".join(f"{o} {c[o]}" for o in OUTCOMES if c.get(o)) or "-"

    print(f"\n== {len(records)} configurations in {wall:.0f} s (child time {summary['seconds']:.0f} s): "
          f"{counts(summary['outcomes'])}")
    for title, key in (("per path", "per_path"), ("per pass", "per_mode")):
        print(f"-- {title}")
        for name, c in summary[key].items():
            print(f"   {name:14s} {counts(c)}")
    bad = [r for r in records if r["outcome"] != "ok"]
    if bad:
        print("-- not ok")
        for r in bad:
            print(f"   [{r['index']}] {r['description']}: {r['outcome']}: {r.get('detail', '')[:400]}")
    sys.stdout.flush()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=200, help="configurations to draw (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws and the data (default 0)")
    p.add_argument("--profile", choices=("full", "ci"), default="full",
                   help="full: --count random draws; ci: the fixed short list (ignores --count, --seed)")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per configuration (default 150)")
    p.add_argument("--jobs", type=int, default=1, help="children run in parallel (default 1)")
    p.add_argument("--max-seq", type=int, default=4096, help="largest sharded sequence length (default 4096)")
    p.add_argument("--fsdp-share", type=float, default=FSDP_SHARE,
                   help=f"the share of FSDP draws (default {FSDP_SHARE}; 1: only FSDP)")
    p.add_argument("--repo", default=ROOT, help="checkout whose vidax_eqx the children import "
                   "(default: the one containing this script)")
    p.add_argument("--json", help="write a JSON report here")
    p.add_argument("--list", action="store_true", help="print the configurations and exit")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        return child_main(args.child, args.repo)

    if args.profile == "ci":
        configs = list(CI_PROFILE)
    else:
        rng = random.Random(args.seed)
        configs = [draw(rng, i, args.seed, args.max_seq, args.fsdp_share)
                   for i in range(args.count)]
    if args.list:
        for i, cfg in enumerate(configs):
            print(f"[{i}] {cfg.describe()}")
        return 0

    print(f"== {len(configs)} configurations ({args.profile}), vidax_eqx from {os.path.abspath(args.repo)}, "
          f"{args.jobs} job(s), timeout {args.timeout:g} s", flush=True)
    records: list[dict | None] = [None] * len(configs)
    lock = threading.Lock()
    start = time.monotonic()
    done = 0

    def run_index(i):
        nonlocal done
        if _STOP.is_set():
            return
        result = run_one(configs[i], args.repo, args.timeout)
        if _STOP.is_set():  # killed by the interrupt, not by itself
            return
        record = dict(index=i, description=configs[i].describe(), config=dataclasses.asdict(configs[i]),
                      **result)
        with lock:
            records[i] = record
            done += 1
            detail = f"  {record['detail'][:400]}" if record["outcome"] != "ok" and record.get("detail") else ""
            err = f" err={record['max_rel_err']:.1e}" if "max_rel_err" in record else ""
            if "phases" in record:
                err += " (" + ", ".join(f"{k} {t:g}s" for k, t in record["phases"].items()) + ")"
            print(f"[{done}/{len(configs)}] #{i} {record['description']}: {record['outcome']} "
                  f"{record['seconds']:.1f}s{err}{detail}", flush=True)

    pool = concurrent.futures.ThreadPoolExecutor(max(1, args.jobs))
    try:
        for future in [pool.submit(run_index, i) for i in range(len(configs))]:
            future.result()
    except KeyboardInterrupt:
        _STOP.set()
        for proc in list(_LIVE):
            _kill(proc)
        pool.shutdown(cancel_futures=True)
        print("\ninterrupted: the running children were killed; the summary covers those that "
              "finished", flush=True)
    pool.shutdown()
    finished = [r for r in records if r is not None]
    wall = time.monotonic() - start
    summary = summarize(finished)
    print_summary(summary, finished, wall)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(argv=sys.argv[1:] if argv is None else argv, repo=os.path.abspath(args.repo),
                           profile=args.profile, seed=args.seed, count=len(configs),
                           interrupted=_STOP.is_set(), wall_seconds=round(wall, 1), summary=summary,
                           results=finished), f, indent=1)
    if _STOP.is_set():
        return 130
    return 0 if all(r["outcome"] == "ok" for r in finished) else 1


if __name__ == "__main__":
    sys.exit(main())
