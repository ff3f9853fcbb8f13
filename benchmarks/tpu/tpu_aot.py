"""Eight chips, compiled ahead of time: Wan 14B's guided denoising step for a TPU slice
that no chip runs.

    pip install libtpu          # the version matching JAX (JAX 0.10.2: libtpu 0.0.42)
    python benchmarks/tpu/tpu_aot.py --out DIR                 # every row (about 40 min on 2 CPU cores)
    python benchmarks/tpu/tpu_aot.py --layers 2 --topologies v5e:2x4 --models t2v-14b \
        --layouts cfg2-sp4-fsdp --out DIR                       # one quick row
    python benchmarks/tpu/tpu_aot.py --render DIR/tpu_aot.json  # the tables again

Runs wherever libtpu is importable: a TPU host, or any CPU machine with `pip install
libtpu` (JAX stays on its CPU backend; libtpu only compiles). For each TPU topology
(`v5e:2x4`, `v6e:2x4`: one host of 8 chips), model (Wan 2.1 T2V 14B; Wan 2.2 T2V A14B,
two 14B experts routed by the timestep) and mesh layout (`LAYOUTS`), one child process
builds the model abstractly in bfloat16 (`eqx.filter_eval_shape`: no weight exists),
places it as `nn.sharding.partition_specs` does over a mesh of the topology's 8 devices
(`parallel.make_mesh(..., devices=topology.devices)`), and lowers and compiles one
guided denoising step at 720p x 81 frames (latents `(16, 21, 90, 160)`, 75,600 tokens
after the (1, 2, 2) patch; text 512 x 4096) as the sampling loop runs it on a mesh
(`sampling/_loop.py`: `_predict`'s sharded branch):

    x = concatenate([latents, latents])            # [conditional; unconditional]
    out = models.run_sharded(model, x, t, context, mesh=mesh, batch_axis=cfg_axis,
                             text_cache=text_cache)  # the text K/V, computed once per video
    latents + dt * (uncond + scale * (cond - uncond))   # an Euler flow-matching update

(the default UniPC update is elementwise too: no FLOP or byte that matters). Per row:

- **Memory per chip**, `compiled.memory_analysis()` (every chip runs the same SPMD
  program): arguments (this chip's share of the weights, the text cache, the context,
  the latents), outputs, temporaries, generated code; their total (less the aliased
  bytes) against the HBM the compiler gives a program (`TOPOLOGIES`: 15.75 GiB on a
  v5e, 31.25 GiB on a v6e, as its `RESOURCE_EXHAUSTED` message says: a program over it
  by the compiler's own count does not compile, and the row records the error).
- **FLOPs per chip**: the matmuls of the optimized HLO (`matmul_flops`: dots and the
  convolutions the TPU compiler writes them as), every loop counted times its trip
  count (the TPU compiler does not print `known_trip_count`: each loop's count is read
  from its condition, below); plus the attention kernels' (Pallas custom calls, opaque
  to the HLO: analytic, QK^T and PV, `4 S^2 dim + 4 S T dim` per layer and example,
  over the chips); and XLA's own `compiled.cost_analysis()["flops"]` as it reports it
  (on TPU it counts a `while` body once, not times its trip count, and nothing inside
  a custom call).
- **Collectives per chip**, from the optimized HLO (`compiled.as_text()`), loops times
  their trip counts: per kind (all-gather, all-to-all, reduce-scatter, all-reduce,
  collective-permute) the ops, the bytes of their results, and the bytes a chip sends
  (`_hlo.collective_bytes`: an all-gather receives (g-1)/g of its result, an all-to-all
  (g-1)/g, an all-reduce 2 (g-1)/g, a collective-permute its result).
- **Compile seconds** (`lower` and `compile`), or the error the compiler raised.

Two experts: the program holds both (both are arguments), and a `lax.switch` runs the
high-noise expert, the low-noise one, or both for a batch that mixes them. A sampler's
batch always agrees (one timestep per step), so FLOPs and collectives count one expert:
each `conditional` counts its cheapest branch by dot FLOPs.

Trip counts: a loop's condition compares its counter (tuple element k) with a
constant N (`direction=LT`); the loop's initial tuple gives the counter's start K; the
trip count is N - K (LE: N - K + 1). A loop whose count cannot be read counts once and
is reported in `unknown_trip_counts`.

Markdown tables go to stdout and `DIR/tpu_aot.md`, the rows to `DIR/tpu_aot.json`.
"""

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the shared harness
import _hlo  # noqa: E402
from _harness import command_line, emit, fmt, git_state, log, run_child, write_json, write_text  # noqa: E402


GIB = 2**30
LATENTS = (16, 21, 90, 160)  # 720p x 81 frames: (C, F, H/8, W/8)
TEXT = (512, 4096)  # umT5 tokens x width
BOUNDARY = 0.875  # Wan 2.2 T2V A14B's boundary_ratio
MODELS = {"t2v-14b": "Wan 2.1 T2V 14B", "a14b": "Wan 2.2 T2V A14B"}


@dataclasses.dataclass(frozen=True)
class Chip:
    """A topology's chip: the HBM the TPU compiler gives one program (`hbm_bytes`, as
    `hbm` writes it), and Google's figures (cloud.google.com/tpu/docs/v5e, /v6e): the
    bf16 peak and the bidirectional inter-chip (ICI) bandwidth per chip, of which a chip
    sends half."""

    hbm_bytes: float
    hbm: str
    peak_flops: float
    ici_bytes_s: float


TOPOLOGIES = {  # HBM: libtpu 0.0.42's "exceeds available HBM (15.75G)" / "(31.25G)"
    "v5e:2x4": Chip(hbm_bytes=15.75 * GIB, hbm="15.75 GiB", peak_flops=197e12, ici_bytes_s=400e9),
    "v6e:2x4": Chip(hbm_bytes=31.25 * GIB, hbm="31.25 GiB", peak_flops=918e12, ici_bytes_s=800e9),
}
HOST_BOUNDS = (2, 4, 1)  # a 2x4 slice is one host of 8 chips


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh over the 8 chips and the transformer's parallelism on it: Ulysses over
    `sp`, Megatron over `tp`, guidance's two halves over `cfg` (when 2; else both on
    every chip), FSDP over every sequence and batch axis (when `fsdp`)."""

    sp: int
    tp: int = 1
    cfg: int = 1
    fsdp: bool = True

    @property
    def batch_axis(self):
        return "cfg" if self.cfg > 1 else None

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        return tuple(a for a, n in (("sp", self.sp), ("cfg", self.cfg)) if self.fsdp and n > 1)

    def label(self) -> str:
        axes = " x ".join(f"{a}{n}" for a, n in (("cfg", self.cfg), ("sp", self.sp), ("tp", self.tp))
                          if n > 1)
        split = math.prod(self.sp if a == "sp" else self.cfg for a in self.fsdp_axes)
        return f"{axes}, " + (f"FSDP over {split}" if self.fsdp else "weights whole")

    def mesh(self, devices):
        from vidax_eqx import parallel

        return parallel.make_mesh(sp=self.sp, tp=self.tp, devices=devices,
                                  extra_axes={"cfg": self.cfg} if self.cfg > 1 else None)

    def parallel(self):
        from vidax_eqx import nn

        return nn.sharding.ParallelConfig(sequence="ulysses", tp_axis="tp" if self.tp > 1 else None,
                                          fsdp_axes=self.fsdp_axes)


LAYOUTS = {
    "cfg2-sp4-fsdp": Layout(sp=4, cfg=2),
    "sp8-fsdp": Layout(sp=8),
    "cfg2-sp2-tp2-fsdp": Layout(sp=2, tp=2, cfg=2),
    # What `WanPipeline.from_pretrained(mesh=...)` picks by default (pipelines'
    # `parallel_for`): Ulysses over sp, no FSDP.
    "cfg2-sp4": Layout(sp=4, cfg=2, fsdp=False),
}


# --------------------------------------------------------------------------- #
# Reading the TPU compiler's HLO
# --------------------------------------------------------------------------- #


def _constant(instr, by_name) -> int | None:
    """The integer `instr` holds: a `constant`, through copies and bitcasts; or None."""
    while instr is not None and instr.opcode in ("copy", "bitcast", "convert"):
        instr = by_name.get((_hlo.operands(instr) or [""])[0])
    m = instr is not None and instr.opcode == "constant" and re.match(r"constant\((-?\d+)\)", instr.rest)
    return int(m.group(1)) if m else None


def trip_count(module: _hlo.Module, computation: str, loop) -> int | None:
    """The trip count of the `while` instruction `loop` of `computation`, read from
    its condition and initial tuple (module docstring), or None."""
    cond = re.search(r"\bcondition=%?([\w.\-]+)", loop.rest)
    body = module.computations.get(cond.group(1), []) if cond else []
    by_name = {i.name: i for i in body}
    root = next((i for i in body if i.opcode == "compare"), None)
    if root is None or not re.search(r"direction=(LT|LE)", root.rest):
        return None
    ops = [by_name.get(o) for o in _hlo.operands(root)]
    if len(ops) != 2 or ops[0] is None or ops[0].opcode != "get-tuple-element":
        return None
    limit, index = _constant(ops[1], by_name), re.search(r"index=(\d+)", ops[0].rest)
    outer = {i.name: i for i in module.computations[computation]}
    init = outer.get((_hlo.operands(loop) or [""])[0])
    if limit is None or index is None or init is None or init.opcode != "tuple":
        return None
    start = _constant(outer.get(_hlo.operands(init)[int(index.group(1))]), outer)
    if start is None:
        return None
    return limit - start + ("direction=LE" in root.rest)


def with_trip_counts(module: _hlo.Module) -> _hlo.Module:
    """`module` with `known_trip_count` written on every `while` whose count its
    condition gives (what `_hlo.walk` reads; the CPU and GPU compilers print it)."""
    comps = {}
    for name, instrs in module.computations.items():
        out = []
        for i in instrs:
            if i.opcode == "while" and "known_trip_count" not in i.rest:
                n = trip_count(module, name, i)
                if n is not None:
                    i = i._replace(rest=i.rest + f' "known_trip_count":{{"n":"{n}"}}')
            out.append(i)
        comps[name] = out
    return _hlo.Module(comps, module.entry)


def cheapest_branches(module: _hlo.Module) -> _hlo.Module:
    """`module` with every `conditional` reduced to its branch of fewest dot FLOPs
    (among those with any): the expert a sampler's batch runs, not the mixed batch."""
    comps = {}
    for name, instrs in module.computations.items():
        out = []
        for i in instrs:
            m = re.search(r"branch_computations=\{([^}]*)\}", i.rest) if i.opcode == "conditional" else None
            if m:
                branches = [b.strip().lstrip("%") for b in m.group(1).split(",")]
                cost = {b: matmul_flops(_hlo.Module(module.computations, b))["flops"] for b in branches}
                keep = min(branches, key=lambda b: (cost[b] == 0, cost[b]))
                i = i._replace(rest=i.rest[:m.start()] + f"branch_computations={{%{keep}}}" + i.rest[m.end():])
            out.append(i)
        comps[name] = out
    return _hlo.Module(comps, module.entry)


def matmul_flops(module: _hlo.Module) -> dict:
    """`_hlo.dot_flops` and the matmuls the TPU compiler writes as `convolution`s:
    2 x (result elements) x (the lhs feature size / feature groups) x (window elements /
    lhs dilation: a batch of B matmuls is written as a window of `size=B lhs_dilate=B`,
    one tap of which meets an input)."""

    def count(instr, by_name):
        if instr.opcode != "convolution":
            return {}
        out, ops = _hlo.shape(instr.type), _hlo.operands(instr)
        lhs = _hlo.shape(by_name[ops[0]].type) if ops and ops[0] in by_name else None
        labels = re.search(r"dim_labels=([\w?]+)_", instr.rest)
        if not (out and lhs and labels and "f" in labels.group(1)):
            return {}
        window = re.search(r"window=\{size=([\dx]+)", instr.rest)
        taps = math.prod(int(w) for w in window.group(1).split("x")) if window else 1
        dilate = re.search(r"lhs_dilate=([\dx]+)", instr.rest)
        if dilate:  # the taps that land between dilated inputs multiply zeros: not counted
            taps /= math.prod(int(d) for d in dilate.group(1).split("x"))
        groups = re.search(r"feature_group_count=(\d+)", instr.rest)
        k = lhs[1][labels.group(1).index("f")] // (int(groups.group(1)) if groups else 1)
        return {"flops": 2.0 * math.prod(out[1]) * k * taps}

    dots, convolutions = _hlo.dot_flops(module), _hlo.walk(module, count)
    return {"flops": dots["flops"] + convolutions.counts.get("flops", 0.0),
            "unknown_trip_counts": max(dots["unknown_trip_counts"], convolutions.unknown_trip_counts)}


def collective_results(module: _hlo.Module) -> dict:
    """Per kind, the bytes of the collectives' results in one run (loops times their
    trip counts; an async pair counted at its `-done`)."""

    def count(instr, by_name):
        kind = instr.opcode.removesuffix("-done")
        if kind not in _hlo.COLLECTIVE_KINDS or instr.opcode.endswith("-start"):
            return {}
        return {kind: _hlo.array_bytes(instr.type)}

    return dict(_hlo.walk(module, count).counts)


# --------------------------------------------------------------------------- #
# One row (child)
# --------------------------------------------------------------------------- #


def topology(name: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(
        topology_name=name, platform="tpu", chip_config_name="default",
        chips_per_host_bounds=HOST_BOUNDS, num_slices=1, wrap=(False, False, False))


def abstract_model(model: str, layers: int | None, parallel):
    """The transformer (or both experts) in bfloat16, every array a ShapeDtypeStruct."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from vidax_eqx import models

    preset = "t2v-14b" if model == "t2v-14b" else "t2v-a14b"
    config = models.WanConfig.preset(preset, **({} if layers is None else {"num_layers": layers}))

    def one(i):
        return models.WanTransformer3D(config, dtype=jnp.bfloat16, parallel=parallel,
                                       key=jax.random.key(i))

    if model == "t2v-14b":
        return config, eqx.filter_eval_shape(lambda: one(0))
    return config, eqx.filter_eval_shape(
        lambda: models.WanExperts(high_noise=one(0), low_noise=one(1), boundary=BOUNDARY))


def placed(tree, specs, mesh):
    """The ShapeDtypeStructs of `tree` with the `NamedSharding`s of `specs`."""
    import jax
    from jax.sharding import NamedSharding

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
                        tree, specs)


def compile_row(topo: str, model: str, layout_name: str, layers: int | None) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from vidax_eqx import models, nn

    layout = LAYOUTS[layout_name]
    devices = topology(topo).devices
    mesh = layout.mesh(devices)
    parallel = layout.parallel()
    config, model_ = abstract_model(model, layers, parallel)
    is_struct = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    params, static = eqx.partition(model_, is_struct)
    params = placed(params, eqx.filter(nn.sharding.partition_specs(model_, mesh),
                                       lambda s: isinstance(s, P)), mesh)
    batch_axis = layout.batch_axis
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))
    latents = jax.ShapeDtypeStruct((1, *LATENTS), jnp.float32, sharding=NamedSharding(mesh, P()))
    context = jax.ShapeDtypeStruct((2, *TEXT), jnp.bfloat16, sharding=NamedSharding(mesh, P(batch_axis)))
    cache = eqx.filter_eval_shape(lambda m, c: models.sharded_text_cache(
        m, c, mesh=mesh, batch_axis=batch_axis), model_, context)
    cache = placed(cache, cache.partition_specs(parallel, batch_axis), mesh)

    def step(params, latents, t, dt, scale, context, text_cache):
        model = eqx.combine(params, static)
        x = jnp.concatenate([latents, latents])  # [conditional; unconditional]
        out = models.run_sharded(model, x, jnp.broadcast_to(t, (2,)), context, mesh=mesh,
                                 batch_axis=batch_axis, text_cache=text_cache)
        cond, uncond = jnp.split(out, 2)
        return latents + dt * (uncond + scale * (cond - uncond)).astype(latents.dtype)

    t0 = time.perf_counter()
    lowered = jax.jit(step).lower(params, latents, scalar, scalar, scalar, context, cache)
    lower_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0

    mem = compiled.memory_analysis()
    memory = dict(argument=mem.argument_size_in_bytes, output=mem.output_size_in_bytes,
                  temp=mem.temp_size_in_bytes, code=mem.generated_code_size_in_bytes,
                  alias=mem.alias_size_in_bytes)
    memory["total"] = memory["argument"] + memory["output"] + memory["temp"] + memory["code"] - memory["alias"]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    module = cheapest_branches(with_trip_counts(_hlo.parse(compiled.as_text())))
    dots = matmul_flops(module)
    comm = _hlo.collective_bytes(module, len(devices))
    return dict(
        topology=topo, device_kind=devices[0].device_kind, devices=len(devices), model=model,
        config=dict(dim=config.dim, ffn_dim=config.ffn_dim, num_heads=config.num_heads,
                    num_layers=config.num_layers),
        layers=config.num_layers, layout=layout_name, mesh=dict(mesh.shape), label=layout.label(),
        parallel=dict(sequence="ulysses", tp_axis=parallel.tp_axis, fsdp_axes=list(parallel.fsdp_axes)),
        batch_axis=batch_axis, tokens=math.prod(LATENTS[1:]) // 4, lower_s=lower_s, compile_s=compile_s,
        memory=memory,
        xla_flops=cost.get("flops"), hlo_dot_flops_per_chip=dots["flops"],
        collectives=dict(results=collective_results(module), sent=comm["by_kind"], ops=comm["ops"],
                         sent_total=comm["total"]),
        unknown_trip_counts=dots["unknown_trip_counts"] + comm["unknown_trip_counts"],
        jax=jax.__version__, libtpu=_libtpu_version(), error=None,
    )


def _libtpu_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return "unknown"


def child(args) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")  # libtpu compiles; nothing runs on a chip
    emit(compile_row(args.topology, args.model, args.layout, args.layers))


# --------------------------------------------------------------------------- #
# Every row (parent) and the tables
# --------------------------------------------------------------------------- #


def _gib(x) -> str:
    return fmt(None if x is None else x / GIB, ".2f")


def derived(r: dict) -> dict:
    """What a row implies on its topology's chip: FLOPs per chip (the HLO's matmuls and
    the attention kernels', analytic), and the seconds they take at the bf16 peak against
    the seconds the bytes a chip sends take at half the bidirectional ICI bandwidth."""
    c, chip = r["config"], TOPOLOGIES[r["topology"]]
    S, T = r["tokens"], TEXT[0]
    attention = 2 * c["num_layers"] * (4 * S * S + 4 * S * T) * c["dim"] / r["devices"]  # two halves
    total = r["hlo_dot_flops_per_chip"] + attention
    return dict(attention=attention, total=total, compute_s=total / chip.peak_flops,
                ici_s=r["collectives"]["sent_total"] / (chip.ici_bytes_s / 2))


KINDS = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute")


def render(rows: list[dict]) -> str:
    mem = ["| topology | model | mesh | arguments | outputs | temporaries | code | total GiB | "
           "HBM | fits | compile s |", "|" + "---|" * 11]
    work = ["| topology | model | mesh | matmuls | attention | total | XLA's | "
            + " | ".join(KINDS) + " | GB sent | compute ms | ICI ms |", "|" + "---|" * (10 + len(KINDS))]
    for r in rows:
        head = f"| {r['topology']} | {MODELS[r['model']]} | {r['label']} |"
        if r.get("error"):
            mem.append(head + f" error: {r['error'][:160]} |" + " |" * 6 + f" {fmt(r.get('wall_s'), '.0f')} |")
            work.append(head + " error |" + " |" * (6 + len(KINDS)))
            continue
        m, chip, d = r["memory"], TOPOLOGIES[r["topology"]], derived(r)
        mem.append(head + "".join(f" {_gib(m[k])} |" for k in ("argument", "output", "temp", "code"))
                   + f" **{_gib(m['total'])}** | {chip.hbm} | "
                   f"{'yes' if m['total'] <= chip.hbm_bytes else '**no**'} | {r['compile_s']:.0f} |")
        c = r["collectives"]
        work.append(head + f" {r['hlo_dot_flops_per_chip'] / 1e12:.0f} | {d['attention'] / 1e12:.0f} | "
                    f"**{d['total'] / 1e12:.0f}** | {fmt(r['xla_flops'] and r['xla_flops'] / 1e12, '.0f')} | "
                    + " | ".join(f"{c['results'].get(k, 0) / 1e9:.2f} ({c['ops'].get(k, 0)})" for k in KINDS)
                    + f" | {c['sent_total'] / 1e9:.1f} | {d['compute_s'] * 1e3:.0f} | {d['ici_s'] * 1e3:.0f} |")
    return ("Memory per chip (GiB; `compiled.memory_analysis()`):\n\n" + "\n".join(mem)
            + "\n\nTFLOP per chip and step, and collectives per chip and step (GB of results, "
            "(ops)):\n\n" + "\n".join(work) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), choices=list(TOPOLOGIES))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: the model's 40)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per row")
    parser.add_argument("--out", default=".", metavar="DIR")
    parser.add_argument("--render", metavar="JSON", default=None, help="the tables of a run's JSON again")
    parser.add_argument("--child", nargs=3, metavar=("TOPOLOGY", "MODEL", "LAYOUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.render:
        with open(args.render) as f:
            return print(render(json.load(f)["rows"]))
    if importlib.util.find_spec("libtpu") is None:
        sys.exit("tpu_aot.py: libtpu is not importable; `pip install libtpu` (the version of "
                 "your JAX: 0.0.42 for JAX 0.10.2) or put it on PYTHONPATH; no TPU is needed.")
    if args.child:
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # off a TPU VM: no metadata server to ask
        args.topology, args.model, args.layout = args.child
        return child(args)
    stamp = dict(date=datetime.date.today().isoformat(), command=command_line(__file__),
                 git=git_state(), note="compiled ahead of time for each topology; no chip ran it")
    rows = []
    for topo in args.topologies:
        for model in args.models:
            for layout in args.layouts:
                log(f"{topo} {model} {layout} ...")
                extra = [] if args.layers is None else ["--layers", str(args.layers)]
                result = run_child(__file__, ["--child", topo, model, layout, *extra], timeout=args.timeout)
                row = result.last if result.ok and result.last else dict(
                    topology=topo, model=model, layout=layout, label=LAYOUTS[layout].label(),
                    error=result.reason or "no result")
                row["wall_s"] = result.wall_s
                rows.append(row)
                log(f"  {result.wall_s:.0f} s" + (f"  error: {row['error']}" if row.get("error") else
                                                  f"  total {row['memory']['total'] / GIB:.2f} GiB"))
                write_json(os.path.join(args.out, "tpu_aot.json"), dict(stamp, rows=rows))
    table = render(rows)
    print(table)
    write_text(os.path.join(args.out, "tpu_aot.md"), table)


if __name__ == "__main__":
    main()
