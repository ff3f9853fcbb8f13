"""Fully sharded data parallelism (FSDP / ZeRO-3, `nn.sharding.ParallelConfig(fsdp_axes=...)`):
what a training step holds per device, what it communicates, and what it costs.

Every case runs in a fresh process (this script with a hidden `--child-*` flag) with
its own number of simulated CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=N`,
set before JAX is imported; one process per device count). Three parts:

**1. `memory`: Wan 2.1 14B, one training step, compiled ahead of time.** The model
(`WanConfig(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)`, text 512 x 4096,
14,288,491,584 parameters) is built abstractly (`eqx.filter_eval_shape`: no weight is
ever allocated) in float32, its parameters, and the AdamW moments of
`optax.adamw`, placed as `nn.sharding.partition_specs(model, mesh)` places them
(`jax.ShapeDtypeStruct`s with `NamedSharding`s), and the step

    params, opt_state, loss = step(params, opt_state, x, t, context, target)

is lowered and compiled (`jax.jit(step, donate_argnums=(0, 1)).lower(...).compile()`).
The step casts the float32 master weights to bfloat16 inside `jit`
(`a.astype(jnp.bfloat16)` for every inexact array: elementwise, on each device's
slice), runs `models.run_sharded(..., remat="full")` (each block saves only its input
and is recomputed in the backward pass), takes the gradient of an MSE loss (float32)
against a target with the output's shape, through the cast back to float32, and
applies the AdamW update; parameters and moments come back in place (donated). The
gathers therefore move bfloat16 weights, and each device's gradients, moments and
master weights are its slice only. One video per data-parallel group (batch = dp),
at 480p (81 frames: latents 21 x 60 x 104, 32,760 tokens) and 720p (21 x 90 x 160,
75,600 tokens), on 8, 64 and 256 simulated devices, in the recommended configuration
of each (`CONFIGS`: Ulysses over sp = 8, whose 4,095 / 9,450 tokens per device set the
activations; FSDP over every data and sequence axis), plus reference rows (the same
step without FSDP; tensor parallelism).

- **Memory per device**: of `compiled.memory_analysis()` (one device's: every device
  runs the same SPMD program), `argument + output + temp - alias` bytes: arguments are
  the master weights, the two moments, AdamW's step count and the inputs (this
  device's slices); outputs the updated weights, moments and the loss; `alias` the
  outputs that reuse their donated arguments' buffers (weights and moments: counted
  once); temp everything XLA allocates in between (gradients, the bfloat16 slices, the
  gathered weights, activations, the optimizer's temporaries). `peak_memory_in_bytes`
  is not used: on this backend it reports about the arguments alone. Against an
  80 GB (74.5 GiB) device.
- **Communication per device**, read from the optimized HLO (`_hlo.collective_bytes`:
  loops times their trip counts; an all-gather receives (g-1)/g of its result, a
  reduce-scatter sends (g-1) results, an all-to-all (g-1)/g of it, an all-reduce
  2 (g-1)/g, a collective-permute its result), split by where each collective was
  made: *FSDP* (the call stack XLA records for it, the HLO's `StackFrames`, passes
  through `vidax_eqx/nn/sharding/_fsdp.py`: the weights' all-gathers and their transposes, the
  gradients' reduce-scatters) and *other* (Ulysses' all-to-alls, the ring's
  collective-permutes, Megatron's psums, the output tokens gathered over sp, the
  gradients of parameters FSDP leaves whole), by kind.
- **The ZeRO-3 minimum** of the FSDP collectives, per device and step: with n the FSDP
  size (the product of the FSDP axes' sizes), b the bytes of a bfloat16 value, P_blocks
  the parameters of the stacked blocks and P_rest the others (embeddings, time and
  text MLPs, head) that FSDP splits, each counted per Megatron shard (a parameter that
  tensor parallelism splits over t devices counts 1/t of its elements):

      all-gather      (n-1)/n b (2 P_blocks + P_rest)   the blocks in the forward and
                                                        again in the backward (each
                                                        recomputed block gathers its
                                                        weights again); the rest once,
                                                        kept for the backward
      reduce-scatter  (n-1)/n b (P_blocks + P_rest)     every gradient, once

  i.e. about 3 (n-1)/n x the bfloat16 parameter bytes / t (P_rest is 1.6% of the 14B).
  With `fsdp_regather=False` the blocks are gathered once: (n-1)/n b (P_blocks +
  P_rest). XLA's CPU backend runs bfloat16 collectives in float32 (the lowered program
  asks for bf16; the compiled one moves f32: both are listed), so the measured bytes are
  compared with the minimum at b = 2 and at b = 4 (the latter checks the program
  against the formula; the target is 1.10).
- **One block gathered at a time**: the temp bytes of the same step with
  `fsdp_regather=True` (the default) and `False` (the gathered weights kept for the
  backward pass), at L and 2L layers (the 14B's 20 and 40 blocks, 480p, 8 devices):
  with regathering, a block adds its share of the gradients, moments and one residual;
  without, its whole gathered weights too.

**2. `time`: step time** of a small Wan (`SMALL`) with real arrays on 8 simulated
devices, dp2 x sp2 x tp2 (Ulysses over sp, Megatron over tp), the same training step
(float32 master weights, bfloat16 compute, AdamW) with FSDP over (dp, sp) against the
same configuration without it, in one process: both compiled ahead of time, then
timed in alternating rounds (`_harness.best_time`), best wall and process CPU time
of each, and their ratio. Simulated devices share two cores and their collectives
are memory copies, so the ratio is what FSDP's extra collectives cost on this machine
(both programs recompute every block: remat "full"), not a network's cost.

**3. `bytes`: bytes per device** of the same small model, FSDP over (dp, sp) with tp:
the master weights, a gradient (`jax.grad` of the same loss, its placement left to XLA:
it leaves `shard_map` as the weights' in_specs say) and AdamW's two moments after one
step, summed per device from each array's `addressable_shards`, against the
placement's expectation: the bytes of the parameters split over both FSDP and tensor
parallelism / (fsdp x tp), + over FSDP only / fsdp, + the replicated remainder, the
parameters FSDP leaves whole (`nn.sharding.replicated_parameters`: under tp, the vectors whose
one dimension tp already splits) / tp or in full; and against the one-line estimate
`(total - replicated) / (fsdp x tp) + replicated remainder`, which assumes that every
parameter FSDP splits is also split by tp (the embeddings, norms and modulations are
not).

    python benchmarks/fsdp.py --quick   # small Wan on 8 devices, every part (< 2 min)
    python benchmarks/fsdp.py           # 14B x 480p, 720p x 8, 64, 256 devices; regather;
                                        # step time; bytes per device
    python benchmarks/fsdp.py --parts memory --devices 8
    python benchmarks/fsdp.py --render benchmarks/results/fsdp.json   # the tables again

Markdown tables go to stdout and `benchmarks/results/fsdp.md` (`fsdp_quick.md` with
`--quick`), raw numbers to the `.json` next to it.
"""

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time

from _harness import (
    RESULTS, best_time, command_line, emit, fmt, git_state, log, now, run_child,
    write_json, write_text,
)
from _hlo import collective_dtypes, split_collectives


GIB = 2**30
DEVICE_BYTES = 80e9  # the device the memory is held against: 80 GB
BF16, F32 = 2, 4

WAN_14B = dict(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)
TEXT = (512, 4096)  # umT5 tokens x width
LATENTS = {  # video tokens -> latents (C, F, H, W), patch (1, 2, 2)
    256: (16, 4, 16, 16),  # --quick's small model
    1024: (16, 4, 32, 32),  # the small model
    32760: (16, 21, 60, 104),  # 480p (480 x 832), 81 frames
    75600: (16, 21, 90, 160),  # 720p (720 x 1280), 81 frames
}
RESOLUTION = {256: "small", 1024: "small", 32760: "480p", 75600: "720p"}
# The small model of parts 2 and 3 (and of --quick's part 1): 8 heads, so Ulysses
# splits them over sp x tp = 4.
SMALL = dict(dim=256, ffn_dim=768, num_heads=8, num_layers=4, text_dim=256)
SMALL_TEXT = (64, 256)
# --quick compiles with XLA's cheap passes only (as the test suite's small programs do):
# its numbers check that every part runs, they are not the measurement.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@dataclasses.dataclass(frozen=True)
class Case:
    """One compiled training step (part 1)."""

    dp: int
    sp: int
    tp: int = 1
    fsdp: bool = True
    regather: bool = True
    layers: int = 40
    tokens: int = 32760
    model: str = "14B"  # "14B" | "small"
    role: str = "recommended"  # "recommended" | "reference" | "regather"

    @property
    def devices(self) -> int:
        return self.dp * self.sp * self.tp

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        return tuple(a for a, n in (("dp", self.dp), ("sp", self.sp)) if n > 1) if self.fsdp else ()

    @property
    def mesh(self) -> str:
        parts = [f"{a}{n}" for a, n in (("dp", self.dp), ("sp", self.sp), ("tp", self.tp)) if n > 1]
        return " x ".join(parts) or "1"

    def config(self) -> dict:
        return dict(WAN_14B, num_layers=self.layers) if self.model == "14B" else dict(
            SMALL, num_layers=self.layers)

    def text(self) -> tuple[int, int]:
        return TEXT if self.model == "14B" else SMALL_TEXT

    def args(self) -> list[str]:
        return [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)]

    @classmethod
    def parse(cls, text: str) -> "Case":
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        values = dict(kv.split("=", 1) for kv in text.split(","))
        conv = {int: int, bool: lambda s: s == "True", str: str}
        return cls(**{k: conv[kinds[k]](v) for k, v in values.items()})


def full_cases(devices: list[int]) -> list[Case]:
    """Part 1's cases: per device count, the recommended configuration at both
    resolutions, and the references; the regather comparison on 8 devices."""
    out = []
    for tokens in (32760, 75600):
        if 8 in devices:
            out.append(Case(dp=1, sp=8, tokens=tokens))
            out.append(Case(dp=1, sp=8, fsdp=False, tokens=tokens, role="reference"))
        if 64 in devices:
            out.append(Case(dp=8, sp=8, tokens=tokens))
        if 256 in devices:
            out.append(Case(dp=32, sp=8, tokens=tokens))
            out.append(Case(dp=32, sp=4, tp=2, tokens=tokens, role="reference"))
    if 8 in devices:
        out += [Case(dp=1, sp=8, layers=20, role="regather"),
                Case(dp=1, sp=8, regather=False, layers=20, role="regather"),
                Case(dp=1, sp=8, regather=False, layers=40, role="regather")]
    return out


def quick_cases() -> list[Case]:
    """--quick's part 1: the small model, its gathered weights regathered and kept."""
    small = dict(model="small", tokens=256, dp=2, sp=2, tp=2, layers=2)
    return [Case(**small), Case(**small, regather=False, role="regather")]


# --------------------------------------------------------------------------- #
# The training step (every part)
# --------------------------------------------------------------------------- #


def bf16_compute(model):
    """`model` with every inexact array cast to bfloat16 (inside `jit`: each device
    casts its own slice, and the gradient flows back to the float32 master weights)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, model)


def train_step(static, optimizer, mesh, batch_axis):
    """`step(params, opt_state, x, t, context, target) -> (params, opt_state, loss)`."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    from vidax_eqx import models

    def loss_fn(params, x, t, context, target):
        model = bf16_compute(eqx.combine(params, static))
        out = models.run_sharded(model, x, t, context, mesh=mesh, batch_axis=batch_axis,
                                 remat="full")
        return jnp.mean(jnp.square(out.astype(jnp.float32) - target.astype(jnp.float32)))

    def step(params, opt_state, x, t, context, target):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, t, context, target)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, loss_fn


def parallel_config(case: Case):
    from vidax_eqx import nn

    return nn.sharding.ParallelConfig(sequence="ulysses", tp_axis="tp" if case.tp > 1 else None,
                             fsdp_axes=case.fsdp_axes, fsdp_regather=case.regather)


def batch_axis(case: Case) -> str | None:
    return "dp" if case.dp > 1 else None


# --------------------------------------------------------------------------- #
# Part 1: one compiled step (child)
# --------------------------------------------------------------------------- #


def _is_spec(s) -> bool:
    from jax.sharding import PartitionSpec as P

    return isinstance(s, P)


def abstract_state(case: Case):
    """(params, opt_state, static, mesh, optimizer, parameter counts) of the float32
    model, as sharded `ShapeDtypeStruct`s: nothing allocated."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from vidax_eqx import models, nn, parallel

    mesh = parallel.make_mesh(dp=case.dp, sp=case.sp, tp=case.tp)
    cfg = models.WanConfig(**case.config())
    model = eqx.filter_eval_shape(models.WanTransformer3D, cfg, parallel=parallel_config(case),
                                  dtype=jnp.float32, key=jax.random.PRNGKey(0))
    is_struct = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    specs = eqx.filter(nn.sharding.partition_specs(model, mesh), _is_spec)
    params, static = eqx.partition(model, is_struct)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
        params, specs)
    optimizer = optax.adamw(1e-4)
    structure = jax.tree.structure(params)
    replicated = NamedSharding(mesh, P())

    def place(node):  # the moments like the parameters, the step count replicated
        if is_struct(node):
            return jax.ShapeDtypeStruct(node.shape, node.dtype, sharding=replicated)
        return jax.tree.map(
            lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=p.sharding), node, params)

    opt_state = jax.tree.map(
        place, jax.eval_shape(optimizer.init, params),
        is_leaf=lambda n: is_struct(n) or (n is not None and jax.tree.structure(n) == structure))
    return params, opt_state, static, mesh, optimizer, parameter_counts(params, specs, case)


def parameter_counts(params, specs, case: Case) -> dict:
    """Elements per Megatron shard: the blocks' and the rest's that FSDP splits, and
    those it leaves whole; and the model's total."""
    import jax

    sizes = {"dp": case.dp, "sp": case.sp, "tp": case.tp}
    fsdp = set(case.fsdp_axes)
    counts = {"blocks": 0, "rest": 0, "replicated": 0, "total": 0}
    flat_specs = jax.tree.leaves(specs, is_leaf=_is_spec)
    for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0], flat_specs):
        names = [n for e in spec for n in (e if isinstance(e, tuple) else (e,)) if n is not None]
        tp = math.prod(sizes[n] for n in names if n not in fsdp)
        elements = math.prod(x.shape)
        counts["total"] += elements
        if not fsdp & set(names):
            counts["replicated"] += elements // tp
        elif jax.tree_util.keystr(path).startswith(".blocks"):
            counts["blocks"] += elements // tp
        else:
            counts["rest"] += elements // tp
    return counts


def memory_child(cases: list[Case], options: dict | None) -> None:
    """Compiles each case's training step (with the compiler `options`); one JSON line
    each."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    for case in cases:
        t0 = time.perf_counter()
        params, opt_state, static, mesh, optimizer, counts = abstract_state(case)
        build_s = time.perf_counter() - t0
        axis = batch_axis(case)
        step, _ = train_step(static, optimizer, mesh, axis)
        batch = NamedSharding(mesh, P(axis))
        x = jax.ShapeDtypeStruct((case.dp, *LATENTS[case.tokens]), jnp.bfloat16, sharding=batch)
        t = jax.ShapeDtypeStruct((case.dp,), jnp.float32, sharding=batch)
        context = jax.ShapeDtypeStruct((case.dp, *case.text()), jnp.bfloat16, sharding=batch)
        shardings = lambda tree: jax.tree.map(lambda a: a.sharding, tree)  # noqa: E731
        fn = jax.jit(step, donate_argnums=(0, 1), out_shardings=(
            shardings(params), shardings(opt_state), NamedSharding(mesh, P())))
        t0 = time.perf_counter()
        lowered = fn.lower(params, opt_state, x, t, context, x)
        lower_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = lowered.compile(options)
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        hlo = compiled.as_text()
        comm = split_collectives(hlo, case.devices, "vidax_eqx/nn/sharding/_fsdp.py")
        comm = {"fsdp": comm["marked"], "other": comm["other"]}
        state = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                    for a in jax.tree.leaves((params, opt_state)))
        emit({
            "kind": "memory", "case": dataclasses.asdict(case), "counts": counts,
            "build_s": build_s, "lower_s": lower_s, "compile_s": compile_s,
            "argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
            "temp_bytes": mem.temp_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes,
            "state_bytes": state,
            "comm": {k: {"total": v["total"], "by_kind": v["by_kind"], "ops": v["ops"],
                         "unknown_trip_counts": v["unknown_trip_counts"]} for k, v in comm.items()},
            "collective_dtypes": {"lowered": collective_dtypes(lowered.as_text()),
                                  "compiled": collective_dtypes(hlo)},
            "jax": jax.__version__,
        })
        del lowered, compiled, hlo


def zero3_minimum(counts: dict, case: Case, b: int) -> dict:
    """The least bytes the FSDP collectives of one step move per device (module
    docstring), by kind."""
    if not case.fsdp:
        return {"all-gather": 0.0, "reduce-scatter": 0.0}
    n = case.dp * case.sp
    share = (n - 1) / n * b
    gathers = (2 if case.regather else 1) * counts["blocks"] + counts["rest"]
    return {"all-gather": share * gathers,
            "reduce-scatter": share * (counts["blocks"] + counts["rest"])}


# --------------------------------------------------------------------------- #
# Parts 2 and 3: the small model with real arrays (child)
# --------------------------------------------------------------------------- #


def small_child(args, options: dict | None) -> None:
    """Step time with and without FSDP, and bytes per device with it (compiled with the
    compiler `options`): JSON lines."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from vidax_eqx import models, nn, parallel

    layers = args.small_layers
    cfg = models.WanConfig(**dict(SMALL, num_layers=layers))
    base = models.WanTransformer3D(cfg, dtype=jnp.float32, key=jax.random.PRNGKey(0))
    mesh = parallel.make_mesh(dp=2, sp=2, tp=2)
    rng = np.random.default_rng(0)
    batch = NamedSharding(mesh, P("dp"))
    latents = (2, *LATENTS[args.small_tokens])
    x = jax.device_put(rng.standard_normal(latents, np.float32).astype(jnp.bfloat16), batch)
    target = jax.device_put(rng.standard_normal(latents, np.float32).astype(jnp.bfloat16), batch)
    t = jax.device_put(np.array([100.0, 700.0], np.float32), batch)
    context = jax.device_put(
        rng.standard_normal((2, *SMALL_TEXT), np.float32).astype(jnp.bfloat16), batch)
    optimizer = optax.adamw(1e-4)

    variants = {}
    for name, fsdp in (("fsdp", True), ("no fsdp", False)):
        case = Case(dp=2, sp=2, tp=2, fsdp=fsdp, layers=layers, model="small",
                    tokens=args.small_tokens)
        model = nn.sharding.shard_module(nn.sharding.with_parallel(base, parallel_config(case)), mesh)
        params, static = eqx.partition(model, eqx.is_array)
        opt_state = nn.sharding.shard_like(optimizer.init(params), model, mesh)
        step, loss_fn = train_step(static, optimizer, mesh, "dp")
        shardings = lambda tree: jax.tree.map(lambda a: a.sharding, tree)  # noqa: E731
        fn = jax.jit(step, donate_argnums=(0, 1), out_shardings=(
            shardings(params), shardings(opt_state), NamedSharding(mesh, P())))
        t0 = time.perf_counter()
        compiled = fn.lower(params, opt_state, x, t, context, target).compile(options)
        compile_s = time.perf_counter() - t0
        # The gradient's placement is left to XLA: it leaves shard_map as the
        # in_specs place the parameters (reduce-scattered under FSDP).
        grad = jax.jit(jax.grad(loss_fn)).lower(params, x, t, context, target).compile(
            options) if fsdp else None
        variants[name] = dict(case=case, model=model, compiled=compiled, grad=grad,
                              state=[params, opt_state], compile_s=compile_s)

    def run(v):
        def once():
            params, opt_state, loss = v["compiled"](*v["state"], x, t, context, target)
            v["state"] = [params, opt_state]
            return jax.block_until_ready(loss)
        return once

    # Part 3 first, on the state after one step (a warm-up for part 2 too).
    for name, v in variants.items():
        run(v)()
        params, opt_state = v["state"]
        trees = {"params": params, "mu": opt_state[0].mu, "nu": opt_state[0].nu}
        if v["grad"] is not None:
            trees["grads"] = v["grad"](params, x, t, context, target)
        emit({"kind": "bytes", "variant": name, "case": dataclasses.asdict(v["case"]),
              "measured": {k: device_bytes(tree) for k, tree in trees.items()},
              "expected": expected_bytes(v["model"], mesh, v["case"]),
              "replicated": [list(r[:2]) for r in nn.sharding.replicated_parameters(v["model"], mesh)]
              if v["case"].fsdp else []})

    timings = {name: [] for name in variants}
    for _ in range(args.rounds):  # alternating, so that load on the machine hits both
        for name, v in variants.items():
            timings[name].append(best_time(run(v), args.repeats))
    for name, v in variants.items():
        samples = [s for tm in timings[name] for s in tm.samples]
        emit({"kind": "time", "variant": name, "case": dataclasses.asdict(v["case"]),
              "compile_s": v["compile_s"], "time_s": min(s.wall for s in samples),
              "cpu_s": min(s.cpu for s in samples), "runs": len(samples),
              "params": sum(a.size for a in jax.tree.leaves(v["state"][0])),
              "jax": jax.__version__})


def device_bytes(tree) -> dict:
    """Bytes of `tree`'s arrays on each device (from `addressable_shards`): max, min."""
    import jax

    per: dict = {}
    for a in jax.tree.leaves(tree):
        for s in a.addressable_shards:
            per[s.device.id] = per.get(s.device.id, 0) + s.data.nbytes
    return {"max": max(per.values()), "min": min(per.values()), "devices": len(per)}


def expected_bytes(model, mesh, case: Case) -> dict:
    """Bytes per device, float32: by the placement (split by TP and FSDP, by FSDP only,
    by TP only, neither), and the one-line estimate (module docstring)."""
    import equinox as eqx
    import jax

    from vidax_eqx import nn

    params = eqx.filter(model, eqx.is_array)
    specs = jax.tree.leaves(eqx.filter(nn.sharding.partition_specs(model, mesh), _is_spec), is_leaf=_is_spec)
    fsdp, tp = set(case.fsdp_axes), case.tp
    n_fsdp = math.prod(mesh.shape[a] for a in fsdp)
    parts = {"tp_and_fsdp": 0, "fsdp_only": 0, "tp_only": 0, "whole": 0}
    for a, spec in zip(jax.tree.leaves(params), specs):
        names = {n for e in spec for n in (e if isinstance(e, tuple) else (e,)) if n is not None}
        key = {(True, True): "tp_and_fsdp", (False, True): "fsdp_only",
               (True, False): "tp_only", (False, False): "whole"}["tp" in names, bool(fsdp & names)]
        parts[key] += a.nbytes
    total = sum(parts.values())
    placement = (parts["tp_and_fsdp"] / (n_fsdp * tp) + parts["fsdp_only"] / n_fsdp
                 + parts["tp_only"] / tp + parts["whole"])
    return {"parts": parts, "total": total, "fsdp": n_fsdp, "tp": tp, "placement": placement,
            "estimate": estimate(parts, n_fsdp, tp)}


def estimate(parts: dict, fsdp: int, tp: int) -> float:
    """`(total - replicated) / (fsdp x tp) + the replicated remainder` (per device)."""
    replicated = parts["tp_only"] + parts["whole"]
    return ((sum(parts.values()) - replicated) / (fsdp * tp)
            + parts["tp_only"] / tp + parts["whole"])


# --------------------------------------------------------------------------- #
# The run (parent)
# --------------------------------------------------------------------------- #


def run_memory(args, cases: list[Case]) -> list[dict]:
    rows = []
    for devices in sorted({c.devices for c in cases}):
        group = [c for c in cases if c.devices == devices]
        log(f"# part 1: {len(group)} case(s) on {devices} devices ...")
        cmd = ["--child-memory"] + [",".join(c.args()) for c in group] + (
            ["--fast-compile"] if args.quick else [])
        child = run_child(__file__, cmd, devices=devices,
                          timeout=args.case_timeout * len(group))
        done = {Case(**r["case"]): r for r in child.records if r.get("kind") == "memory"}
        for c in group:
            r = done.get(c) or {"case": dataclasses.asdict(c), **child.record(),
                                "status": f"error: {child.reason or 'no result'}"}
            r.setdefault("status", "ok")
            if r["status"] == "ok":
                r["minimum"] = zero3_minimum(r["counts"], c, BF16)
                r["minimum_f32"] = zero3_minimum(r["counts"], c, F32)
                log(f"#   {c.mesh} {RESOLUTION[c.tokens]} L={c.layers} fsdp={c.fsdp_axes} "
                    f"regather={c.regather}: total {_gib(total_bytes(r))} GiB, temp "
                    f"{_gib(r['temp_bytes'])} GiB, compile {r['compile_s']:.0f} s")
            else:
                log(f"#   {c}: {r['status']}")
            rows.append(r)
        log(f"#   [{child.wall_s:.0f} s]")
    return rows


def run_small(args) -> list[dict]:
    log("# parts 2 and 3: the small model on 8 devices ...")
    cmd = ["--child-small", "--small-layers", str(args.small_layers),
           "--small-tokens", str(args.small_tokens), "--repeats", str(args.repeats),
           "--rounds", str(args.rounds)] + (["--fast-compile"] if args.quick else [])
    child = run_child(__file__, cmd, devices=8, timeout=args.case_timeout * 2)
    if not child.ok:
        log(f"#   {child.reason}")
        return child.records + [{"kind": "error", **child.record()}]
    log(f"#   [{child.wall_s:.0f} s]")
    return child.records


# --------------------------------------------------------------------------- #
# Output
# --------------------------------------------------------------------------- #


def _gib(x) -> str:
    return fmt(None if x is None else x / GIB, ".2f")


def total_bytes(r: dict) -> int:
    return r["argument_bytes"] + r["output_bytes"] + r["temp_bytes"] - r["alias_bytes"]


def memory_markdown(rows: list[dict]) -> list[str]:
    main = [r for r in rows if r["case"]["role"] != "regather"]
    out = [
        "Memory per device (GiB) of one training step (float32 master weights and AdamW "
        "moments, bfloat16 compute, remat \"full\", Ulysses over sp): `memory_analysis()` "
        "arguments + outputs + temp - aliased (the donated weights and moments); `state`: the "
        "weights and moments alone; against an 80 GB (74.5 GiB) device.",
        "",
        "| devices | mesh | FSDP over | video | tokens / device | state | temp | total | "
        "fits 80 GB | compile (s) |",
        "|---:|---|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in main:
        c = Case(**r["case"])
        head = (f"| {c.devices} | {c.mesh} | {' x '.join(c.fsdp_axes) or 'none'} | "
                f"{RESOLUTION[c.tokens]} ({c.tokens:,}) | {c.tokens // c.sp:,} | ")
        if r["status"] != "ok":
            out.append(head + f"{r['status']} |" + " |" * 4)
            continue
        total = total_bytes(r)
        fits = "yes" if total <= DEVICE_BYTES else "no"
        out.append(head + f"{_gib(r['state_bytes'])} | {_gib(r['temp_bytes'])} | {_gib(total)} | "
                   f"{fits} | {r['lower_s'] + r['compile_s']:.0f} |")
    out += [
        "",
        "Communication per device and step (GiB), from the compiled HLO: the FSDP collectives "
        "(made in `nn/sharding/_fsdp.py`) against the ZeRO-3 minimum (module docstring) at bf16 and at "
        "f32 (XLA's CPU backend runs bf16 collectives in f32); the other collectives by kind.",
        "",
        "| devices | mesh | video | FSDP all-gather | FSDP reduce-scatter | FSDP other | "
        "minimum (bf16) | minimum (f32) | FSDP / minimum (bf16) | FSDP / minimum (f32) | "
        "all-to-all | collective-permute | all-reduce | other all-gather |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in main:
        if r["status"] != "ok":
            continue
        c = Case(**r["case"])
        f, o = r["comm"]["fsdp"]["by_kind"], r["comm"]["other"]["by_kind"]
        fsdp = r["comm"]["fsdp"]["total"]
        least, least32 = sum(r["minimum"].values()), sum(r["minimum_f32"].values())
        rest = fsdp - f.get("all-gather", 0) - f.get("reduce-scatter", 0)
        ratio = (lambda m: f"{fsdp / m:.3f}" if m else "–")  # noqa: E731
        out.append(
            f"| {c.devices} | {c.mesh} | {RESOLUTION[c.tokens]} | {_gib(f.get('all-gather'))} | "
            f"{_gib(f.get('reduce-scatter'))} | {_gib(rest) if rest else '–'} | {_gib(least)} | "
            f"{_gib(least32)} | {ratio(least)} | {ratio(least32)} | {_gib(o.get('all-to-all'))} | "
            f"{_gib(o.get('collective-permute'))} | {_gib(o.get('all-reduce'))} | "
            f"{_gib(o.get('all-gather'))} |")
    regather = [r for r in rows if _regather_row(r, rows)]
    if regather:
        out += [
            "",
            "One block gathered at a time: the same step's temp (GiB per device) with the "
            "gathered weights gathered again in the backward pass (`fsdp_regather=True`, the "
            "default) and kept from the forward (`False`), at L and 2L layers; FSDP all-gather "
            "bytes per device (GiB).",
            "",
            "| mesh | video | layers | fsdp_regather | temp | total | temp per added layer | "
            "FSDP all-gather |",
            "|---|---|---:|---|---:|---:|---:|---:|",
        ]
        for r in sorted(regather, key=lambda r: (not r["case"]["regather"], r["case"]["layers"])):
            c = Case(**r["case"])
            twin = [q for q in regather if q["case"]["regather"] == c.regather
                    and q["case"]["layers"] < c.layers and q["status"] == "ok"]
            per_layer = "–"
            if twin and r["status"] == "ok":
                q = twin[0]
                added = c.layers - q["case"]["layers"]
                per_layer = _gib((r["temp_bytes"] - q["temp_bytes"]) / added)
            if r["status"] != "ok":
                out.append(f"| {c.mesh} | {RESOLUTION[c.tokens]} | {c.layers} | {c.regather} | "
                           f"{r['status']} | | | |")
                continue
            out.append(f"| {c.mesh} | {RESOLUTION[c.tokens]} | {c.layers} | {c.regather} | "
                       f"{_gib(r['temp_bytes'])} | {_gib(total_bytes(r))} | {per_layer} | "
                       f"{_gib(r['comm']['fsdp']['by_kind'].get('all-gather'))} |")
    return out


def _regather_row(r: dict, rows: list[dict]) -> bool:
    """The regather comparison's rows: its own, and the recommended row it shares a
    configuration with."""
    if r["case"]["role"] == "regather":
        return True
    same = [q for q in rows if q["case"]["role"] == "regather"
            and {k: v for k, v in q["case"].items() if k not in ("layers", "regather", "role")}
            == {k: v for k, v in r["case"].items() if k not in ("layers", "regather", "role")}]
    return bool(same) and r["case"]["fsdp"]


def small_markdown(records: list[dict]) -> list[str]:
    out = []
    times = {r["variant"]: r for r in records if r.get("kind") == "time"}
    if len(times) == 2:
        f, b = times["fsdp"], times["no fsdp"]
        c = Case(**f["case"])
        out += [
            "",
            f"Step time: small Wan ({c.layers} layers, dim {SMALL['dim']}, "
            f"{f['params']:,} parameters), {c.tokens:,} tokens x batch 2, {c.mesh} on 8 "
            f"simulated CPU devices, one process, best of {f['runs']} runs each (alternating "
            "rounds).",
            "",
            "| configuration | time (s) | CPU time (s) | compile (s) |",
            "|---|---:|---:|---:|",
            f"| FSDP over dp x sp | {f['time_s']:.3f} | {f['cpu_s']:.3f} | {f['compile_s']:.1f} |",
            f"| no FSDP | {b['time_s']:.3f} | {b['cpu_s']:.3f} | {b['compile_s']:.1f} |",
            f"| **FSDP / no FSDP** | **{f['time_s'] / b['time_s']:.2f}** | "
            f"**{f['cpu_s'] / b['cpu_s']:.2f}** | |",
        ]
    sizes = [r for r in records if r.get("kind") == "bytes"]
    if sizes:
        out += [
            "",
            "Bytes per device (KiB, max over the 8 devices; min in parentheses where it "
            "differs), measured from `addressable_shards` after one step, against the "
            "placement (TP- and FSDP-split / (fsdp x tp) + FSDP-only / fsdp + the replicated "
            "remainder: TP-only / tp + whole) and the one-line estimate (total - replicated) / "
            "(fsdp x tp) + the replicated remainder.",
            "",
            "| configuration | params | grads | AdamW mu | AdamW nu | expected (placement) | "
            "measured / placement | replicated remainder | estimate | measured / estimate | "
            "whole model |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in sizes:
            m, e = r["measured"], r["expected"]
            cells = []
            for k in ("params", "grads", "mu", "nu"):
                if k not in m:
                    cells.append("–")
                    continue
                cell = f"{m[k]['max'] / 1024:,.1f}"
                if m[k]["min"] != m[k]["max"]:
                    cell += f" ({m[k]['min'] / 1024:,.1f})"
                cells.append(cell)
            worst = max(m[k]["max"] for k in m)
            guess = estimate(e["parts"], e["fsdp"], e["tp"])
            remainder = e["parts"]["tp_only"] / e["tp"] + e["parts"]["whole"]
            out.append(f"| {r['variant']} (fsdp {e['fsdp']}, tp {e['tp']}) | " + " | ".join(cells)
                       + f" | {e['placement'] / 1024:,.1f} | {worst / e['placement']:.4f} | "
                       f"{remainder / 1024:,.1f} | {guess / 1024:,.1f} | {worst / guess:.3f} | "
                       f"{e['total'] / 1024:,.1f} |")
    return out


def notes(rows: list[dict], records: list[dict]) -> list[str]:
    out = ["", "Notes:", ""]
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        r = ok[0]
        c = r["counts"]
        out.append(f"- Parameters: {c['total']:,} ({c['total'] * 4 / GIB:.2f} GiB float32, "
                   f"{c['total'] * 2 / GIB:.2f} GiB bfloat16).")
        seen: dict = {"lowered": {}, "compiled": {}}
        for q in ok:
            for stage, counts in seen.items():
                for dtype, n in q["collective_dtypes"][stage].items():
                    counts[dtype] = counts.get(dtype, 0) + n
        out.append("- Collective ops by result type, as lowered (what JAX asks for): "
                   + ", ".join(f"{n} {d}" for d, n in sorted(seen["lowered"].items()))
                   + "; as compiled for CPU: "
                   + ", ".join(f"{n} {d}" for d, n in sorted(seen["compiled"].items())) + ".")
    for r in rows:
        for k in ("fsdp", "other"):
            if r["status"] == "ok" and r["comm"][k]["unknown_trip_counts"]:
                out.append(f"- {Case(**r['case']).mesh}: {r['comm'][k]['unknown_trip_counts']} "
                           "loop(s) without known_trip_count, counted once.")
    for r in records:
        if r.get("kind") == "bytes" and r["replicated"]:
            e = r["expected"]
            out.append(f"- Parameters FSDP leaves whole in the small model ({r['variant']}, fsdp "
                       f"{e['fsdp']} x tp {e['tp']}; their only dimension besides the layer axis "
                       "is the one tensor parallelism splits, and FSDP takes a dimension of its "
                       "own): " + ", ".join(f"`{p}` {tuple(s)}" for p, s in r["replicated"]) + ".")
        if r.get("kind") == "error":
            out.append(f"- Parts 2 and 3: {r.get('status')}: {r.get('note')}")
    return out


# --------------------------------------------------------------------------- #
# Entry point
# --------------------------------------------------------------------------- #


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a small Wan on 8 devices, every part (under 2 minutes)")
    p.add_argument("--parts", nargs="+", choices=("memory", "time"), default=["memory", "time"],
                   help="memory: part 1; time: parts 2 and 3 (step time, bytes per device)")
    p.add_argument("--devices", nargs="+", type=int, choices=(8, 64, 256), default=[8, 64, 256],
                   help="part 1's device counts")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per round (part 2)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (part 2)")
    p.add_argument("--small-layers", type=int, default=None,
                   help=f"the small model's layers (default {SMALL['num_layers']}; 2 with --quick)")
    p.add_argument("--small-tokens", type=int, default=None, choices=(256, 1024),
                   help="the small model's video tokens (default 1024; 256 with --quick)")
    p.add_argument("--case-timeout", type=float, default=600.0,
                   help="seconds per compiled case (default 600)")
    p.add_argument("--out", default=None, help="output stem (default benchmarks/results/fsdp)")
    p.add_argument("--render", metavar="JSON", default=None,
                   help="write the Markdown of an earlier run's JSON (next to it), run nothing")
    p.add_argument("--child-memory", nargs="+", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-small", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fast-compile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.repeats = 1, 1
    args.small_layers = args.small_layers or (2 if args.quick else SMALL["num_layers"])
    args.small_tokens = args.small_tokens or (256 if args.quick else 1024)
    args.out = args.out or os.path.join(RESULTS, "fsdp_quick" if args.quick else "fsdp")
    return args


def write_markdown(report: dict, stem: str) -> None:
    """The tables of `report` on stdout and in `stem.md`."""
    rows, records = report["memory"], report["small"]
    text = "\n".join((memory_markdown(rows) if rows else []) + small_markdown(records)
                     + notes(rows, records))
    print(text)
    command = report["command"] or "benchmarks/fsdp.py"
    write_text(stem + ".md", f"# FSDP / ZeRO-3 benchmark\n\n`python {command}`, "
               f"{report['date']}, {report['seconds']:.0f} s, git {report['git']}.\n\n{text}\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    options = FAST_COMPILE if args.fast_compile else None
    if args.child_memory:
        memory_child([Case.parse(a) for a in args.child_memory], options)
        return 0
    if args.child_small:
        small_child(args, options)
        return 0

    if args.render:
        with open(args.render, encoding="utf-8") as f:
            report = json.load(f)
        write_markdown(report, args.render.removesuffix(".json"))
        return 0

    t_start = time.perf_counter()
    report = {"date": now(), "git": git_state(), "machine": platform.machine(),
              "cpus": os.cpu_count(),
              "command": command_line(__file__, prefix="") if argv is None else None}
    cases = []
    if "memory" in args.parts:
        cases = quick_cases() if args.quick else full_cases(args.devices)
    rows = run_memory(args, cases) if cases else []
    records = run_small(args) if "time" in args.parts else []
    report.update(memory=rows, small=records, seconds=time.perf_counter() - t_start)
    write_markdown(report, args.out)
    write_json(args.out + ".json", report)
    log(f"# wrote {os.path.relpath(args.out)}.md and .json after {report['seconds']:.0f} s")
    failed = ([r for r in rows if r["status"] != "ok"]
              + [r for r in records if r.get("kind") == "error"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
