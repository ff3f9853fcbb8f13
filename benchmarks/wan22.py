"""Wan 2.2's additions to `vidax_eqx.models` (commit 0ab3c77), timed against what they
replace, in one process on one device.

A small Wan (`WanTransformer3D`, float32, default dim 384, ffn 1024, 4 heads, 2 layers,
text 64 x 256, latents (16, 4, 32, 48): 1,536 tokens; every size is an option), its
programs compiled ahead of time (`eqx.filter_jit(...).lower(...).compile()`), then timed
in interleaved rounds (`_harness.interleaved`: each program once per round, in an order
shuffled every round), each run synchronized. Times are medians over the rounds; a ratio
is the median of the per-round ratios (the two runs of a round ran a few seconds apart),
with their range; process CPU time is reported too (less disturbed by other load on a
shared machine). `fwd` is the forward pass; `fwd+bwd` the gradient with respect to the model's
parameters (`eqx.filter_grad`) of `sum(out * cotangent)`, float32 cotangent.

1. **Per-token timestep**: the model called with one timestep per patch token (`(S,)`,
   `wan_image_timestep(700, grid)`: Wan 2.2 TI2V's, the first latent frame at 0) against
   a scalar (700), same model and inputs. Per token, the time embedding and projection
   run on every token and every block's modulation is `(S, 6, dim)`.
2. **A scalar timestep now and at `--previous`** (default `99aebd6`, the commit before
   the per-token timestep): that commit's `vidax_eqx/` is extracted with `git archive`
   into a temporary directory as `vidax_eqx_prev` (the package imports itself
   relatively) and imported next to this checkout's; its model is built from the same
   configuration and gets this model's arrays (the same PyTree of parameters). Its
   output and gradients are compared with this checkout's (bit for bit, and the
   largest difference), and the two compiled programs' HLO by opcode (how many of each
   instruction, loops and fusions included). Skipped, with the reason, where the
   commit cannot be read (no git checkout: `--previous DIR` then takes a directory
   holding that commit's `vidax_eqx/`).
3. **Expert routing**: `WanExperts(a, b, 0.875)` (two models of this size) under
   `eqx.filter_jit` with a traced timestep (950: the high-noise expert `a`; 500: the
   low-noise `b`) against `a` called directly (the scalar program of part 1). The
   compiled HLO's `conditional` ops are counted, and for each branch: the `while`
   loops it holds (the blocks' `lax.scan` has `known_trip_count` = layers) and its dot
   FLOPs (`_hlo.dot_flops`, loops times their trip counts); the whole program's dot
   FLOPs count a conditional's costliest branch only, so routing that ran one expert
   shows the same FLOPs as `a` alone.
4. **Memory**: `memory_analysis()` temp bytes of every program (per-token against
   scalar), where the backend reports them.

    python benchmarks/wan22.py --quick   # tiny model, 2 rounds: a smoke run (< 1 min)
    python benchmarks/wan22.py           # the sizes above, 25 rounds (3-4 minutes on 2 CPUs)
    python benchmarks/wan22.py --dim 512 --layers 4 --latents 4 32 64 --rounds 9

Markdown tables go to stdout and `benchmarks/results/wan22.md` (`wan22_quick.md` with
`--quick`), raw numbers to the `.json` next to it.
"""

import argparse
import collections
import importlib
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _harness import (
    REPO, RESULTS, command_line, compile_ahead, cpu_model, fmt, git_state, interleaved, log,
    now, paired_ratio, write_json, write_text,
)
import _hlo


PREVIOUS = "99aebd6"  # the commit before the per-token timestep (0ab3c77)
TIMESTEP, HIGH, LOW, BOUNDARY = 700.0, 950.0, 500.0, 0.875
DEFAULT = dict(dim=384, ffn_dim=1024, heads=4, layers=2, latents=(4, 32, 48), text=(64, 256),
               rounds=25)
QUICK = dict(dim=128, ffn_dim=256, heads=2, layers=2, latents=(2, 8, 8), text=(8, 64), rounds=2)


# --------------------------------------------------------------------------- #
# The previous commit's package, importable next to this one
# --------------------------------------------------------------------------- #


def import_previous(rev: str, into: str):
    """`vidax_eqx` at git revision `rev` (or the copy in the directory `rev`, where
    there is no git checkout), put into the directory `into` as `vidax_eqx_prev` and
    imported; raises `RuntimeError` with git's reason."""
    target = os.path.join(into, "vidax_eqx_prev")
    if os.path.isdir(os.path.join(rev, "vidax_eqx")):
        shutil.copytree(os.path.join(rev, "vidax_eqx"), target)
    else:
        archive = subprocess.run(["git", "archive", rev, "vidax_eqx"], cwd=REPO,
                                 capture_output=True)
        if archive.returncode:
            raise RuntimeError(f"git archive {rev}: {archive.stderr.decode().strip()[:200]}")
        subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
        os.rename(os.path.join(into, "vidax_eqx"), target)
    sys.path.insert(0, into)
    try:
        return importlib.import_module("vidax_eqx_prev.models")
    finally:
        sys.path.remove(into)


def same_weights(prev_model, model):
    """`prev_model` (another commit's class, same structure) holding `model`'s arrays."""
    import equinox as eqx
    import jax

    arrays, static = eqx.partition(prev_model, eqx.is_array)
    mine, theirs = jax.tree.leaves(eqx.filter(model, eqx.is_array)), jax.tree.leaves(arrays)
    if [a.shape for a in mine] != [a.shape for a in theirs]:
        raise RuntimeError("the previous commit's WanTransformer3D has other parameters "
                           f"({len(theirs)} arrays against {len(mine)}).")
    return eqx.combine(jax.tree.unflatten(jax.tree.structure(arrays), mine), static)


# --------------------------------------------------------------------------- #
# Programs
# --------------------------------------------------------------------------- #


def forward(model, x, t, context):
    return model(x, t, context)


def loss(model, x, t, context, cotangent):
    import jax.numpy as jnp

    return jnp.sum(model(x, t, context).astype(jnp.float32) * cotangent)


def compile_program(fn, *args) -> dict:
    """`fn` (an `eqx.filter_jit` function) compiled for `args`: the callable, its HLO
    text, temp bytes and compile seconds."""
    t0 = time.perf_counter()
    compiled, temp, _ = compile_ahead(fn, args)
    seconds = time.perf_counter() - t0
    hlo = compiled.compiled.as_text()
    return {"compiled": compiled, "args": args, "hlo": hlo, "temp_bytes": temp,
            "compile_s": seconds, "dot_flops": _hlo.dot_flops(hlo)["flops"]}


def hlo_diff(a: str, b: str) -> dict:
    """Two compiled programs' HLO texts compared: `{"opcodes": {opcode: count in a -
    count in b}, "transposes": {"+" or "-": result types}}` (the counts that differ; the
    `transpose` instructions, by result type without layout, only in `a` or only in `b`)."""

    def instructions(hlo):
        return [i for instrs in _hlo.parse(hlo).computations.values() for i in instrs]

    ops_a, ops_b = (collections.Counter(i.opcode for i in instructions(h)) for h in (a, b))
    tr_a, tr_b = (collections.Counter(re.sub(r"\{[\d,]*\}", "", i.type) for i in instructions(h)
                                      if i.opcode == "transpose") for h in (a, b))
    return {"opcodes": {k: ops_a[k] - ops_b[k] for k in sorted(ops_a | ops_b)
                        if ops_a[k] != ops_b[k]},
            "transposes": {"+": sorted((tr_a - tr_b).elements()),
                           "-": sorted((tr_b - tr_a).elements())}}


def branches(hlo: str, layers: int) -> dict:
    """The `conditional` ops of a compiled program; for each of their branches, the
    distinct `while` loops it holds (by `known_trip_count`, nested ones included) and its
    dot FLOPs per run; and the `while` loops of ENTRY outside them."""
    module = _hlo.parse(hlo)
    out = {"conditionals": 0, "branches": [], "scan_trips": layers}
    for where, instrs in module.computations.items():
        for instr in instrs:
            if instr.opcode != "conditional":
                continue
            out["conditionals"] += 1
            for k, name in enumerate(_branch_names(instr)):
                out["branches"].append({
                    "in": where, "index": k, "name": name, "loops": loops_in(module, name),
                    "dot_flops": _hlo.dot_flops(_hlo.Module(module.computations, name))["flops"]})
    out["entry_loops_outside"] = sum(i.opcode == "while" for i in module.computations[module.entry])
    return out


def _branch_names(instr) -> list[str]:
    m = re.search(r"branch_computations=\{([^}]*)\}", instr.rest)
    if m:
        return [b.strip().lstrip("%") for b in m.group(1).split(",")]
    return re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", instr.rest)


def loops_in(module, start: str) -> dict[str, int]:
    """`{"n=TRIPS": count}` of the distinct `while` instructions reachable from the
    computation `start` (through loop bodies, branches and called computations)."""
    seen, found, stack = set(), collections.Counter(), [start]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        for instr in module.computations.get(name, []):
            if instr.opcode == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.rest)
                found[f"n={trips.group(1) if trips else '?'}"] += 1
            if instr.opcode == "conditional":
                stack += _branch_names(instr)
            stack += re.findall(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)", instr.rest)
    return dict(found)


# --------------------------------------------------------------------------- #
# The run
# --------------------------------------------------------------------------- #


def run(args) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    from vidax_eqx import models

    text_len, text_dim = args.text
    config = models.WanConfig(dim=args.dim, ffn_dim=args.ffn_dim, num_heads=args.heads,
                              num_layers=args.layers, text_dim=text_dim)
    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    model = models.WanTransformer3D(config, key=key_a)
    grid = tuple(args.latents)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((config.in_channels, *grid), dtype=np.float32))
    context = jnp.asarray(rng.standard_normal((text_len, text_dim), dtype=np.float32))
    cotangent = jnp.asarray(rng.standard_normal(x.shape, dtype=np.float32))
    scalar = jnp.float32(TIMESTEP)
    per_token = models.wan_image_timestep(scalar, grid, patch_size=config.patch_size)
    tokens = per_token.shape[0]
    fwd, grad = eqx.filter_jit(forward), eqx.filter_jit(eqx.filter_grad(loss))

    info = {"jax": jax.__version__, "equinox": eqx.__version__,
            "platform": jax.devices()[0].platform, "device": jax.devices()[0].device_kind,
            "cpu": cpu_model(), "cpus": os.cpu_count(), "tokens": tokens,
            "params": sum(a.size for a in jax.tree.leaves(eqx.filter(model, eqx.is_array)))}
    programs = {}
    log(f"# compiling: {tokens} tokens, dim {args.dim}, {args.layers} layers")
    programs["fwd scalar"] = compile_program(fwd, model, x, scalar, context)
    programs["fwd per-token"] = compile_program(fwd, model, x, per_token, context)
    programs["fwd+bwd scalar"] = compile_program(grad, model, x, scalar, context, cotangent)
    programs["fwd+bwd per-token"] = compile_program(grad, model, x, per_token, context, cotangent)

    previous = {"rev": args.previous}
    tmp = tempfile.mkdtemp(prefix="wan22_prev_")
    try:
        prev_models = import_previous(args.previous, tmp)
        prev = same_weights(prev_models.WanTransformer3D(
            prev_models.WanConfig(dim=args.dim, ffn_dim=args.ffn_dim, num_heads=args.heads,
                                  num_layers=args.layers, text_dim=text_dim), key=key_a), model)
        previous["module"] = prev_models.__name__
        programs["fwd scalar (prev)"] = compile_program(fwd, prev, x, scalar, context)
        programs["fwd+bwd scalar (prev)"] = compile_program(grad, prev, x, scalar, context,
                                                            cotangent)
    except Exception as e:  # no git checkout, or another package layout
        previous["skipped"] = f"{type(e).__name__}: {e}"[:300]
        log(f"# part 2 skipped: {previous['skipped']}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # imported modules stay loaded

    experts = models.WanExperts(model, models.WanTransformer3D(config, key=key_b), BOUNDARY)
    programs["fwd experts, t=950 (high)"] = compile_program(fwd, experts, x, jnp.float32(HIGH),
                                                            context)
    programs["fwd experts, t=500 (low)"] = {**programs["fwd experts, t=950 (high)"],  # the same
                                            "args": (experts, x, jnp.float32(LOW), context),
                                            "compile_s": None}

    def call(p):
        return lambda: jax.block_until_ready(p["compiled"](*p["args"]))

    # Outputs, before timing: part 2's comparison and the routing's.
    outs = {name: jax.device_get(call(p)()) for name, p in programs.items()}
    checks = {}
    if "fwd scalar (prev)" in programs:
        for pass_ in ("fwd", "fwd+bwd"):
            a = jax.tree.leaves(outs[f"{pass_} scalar"])
            b = jax.tree.leaves(outs[f"{pass_} scalar (prev)"])
            checks[f"now vs prev, {pass_}"] = compare(a, b)
        previous["hlo_diff"] = {
            pass_: hlo_diff(programs[f"{pass_} scalar"]["hlo"],
                            programs[f"{pass_} scalar (prev)"]["hlo"])
            for pass_ in ("fwd", "fwd+bwd")}
    for label, expert, t in (("experts t=950 vs a", model, HIGH),
                             ("experts t=500 vs b", experts.low_noise, LOW)):
        name = f"fwd experts, t={t:g} ({'high' if t == HIGH else 'low'})"
        direct = call({**programs["fwd scalar"], "args": (expert, x, jnp.float32(t), context)})
        checks[label] = compare([outs[name]], [jax.device_get(direct())])
    routing = branches(programs["fwd experts, t=950 (high)"]["hlo"], args.layers)

    log(f"# timing: {len(programs)} programs x {args.rounds} rounds")
    timings = interleaved({name: call(p) for name, p in programs.items()}, args.rounds)
    rows = {name: {"median_s": t.median,
                   "median_cpu_s": statistics.median(s.cpu for s in t.samples),
                   "runs_s": [s.wall for s in t.samples], "cpu_s": [s.cpu for s in t.samples],
                   "compile_s": programs[name]["compile_s"],
                   "temp_bytes": programs[name]["temp_bytes"],
                   "dot_flops": programs[name]["dot_flops"]}
            for name, t in timings.items()}
    ratios = []
    for label, a, b in RATIOS:
        if a in timings and b in timings:
            wall, cpu = paired_ratio(timings[a], timings[b]), paired_ratio(timings[a], timings[b],
                                                                           cpu=True)
            ratios.append({"label": label, "a": a, "b": b, "wall": wall, "cpu": cpu,
                           "flops": _div(rows[a]["dot_flops"], rows[b]["dot_flops"]),
                           "temp": _div(rows[a]["temp_bytes"], rows[b]["temp_bytes"])})
    return {"info": info, "rows": rows, "ratios": ratios, "checks": checks,
            "previous": previous, "routing": routing}


RATIOS = (  # (what, numerator, denominator)
    ("per-token / scalar timestep, fwd", "fwd per-token", "fwd scalar"),
    ("per-token / scalar timestep, fwd+bwd", "fwd+bwd per-token", "fwd+bwd scalar"),
    ("scalar: now / previous commit, fwd", "fwd scalar", "fwd scalar (prev)"),
    ("scalar: now / previous commit, fwd+bwd", "fwd+bwd scalar", "fwd+bwd scalar (prev)"),
    ("WanExperts (t=950, high) / expert a alone, fwd", "fwd experts, t=950 (high)", "fwd scalar"),
    ("WanExperts (t=500, low) / expert a alone, fwd", "fwd experts, t=500 (low)", "fwd scalar"),
)


def compare(a: list, b: list) -> dict:
    """Bit-identical or not, and the largest |a - b| relative to max |b|, over arrays."""
    import numpy as np

    identical = len(a) == len(b) and all(np.array_equal(u, v) for u, v in zip(a, b))
    rel = max(float(np.max(np.abs(u - v))) / max(float(np.max(np.abs(v))), 1e-30)
              for u, v in zip(a, b))
    return {"identical": identical, "max_rel_diff": rel, "arrays": len(a)}


def _div(a, b):
    return None if a is None or b is None or not b else a / b


# --------------------------------------------------------------------------- #
# Output
# --------------------------------------------------------------------------- #


def markdown(report: dict, args) -> str:
    info, rows = report["info"], report["rows"]
    mib = lambda b: fmt(None if b is None else b / 2**20, ".1f")  # noqa: E731
    out = [
        f"JAX {info['jax']} (Equinox {info['equinox']}) on {info['platform']}: "
        f"{info['device']}" + (f" ({info['cpu']}, {info['cpus']} CPUs)"
                               if info["platform"] == "cpu" else "") + ". "
        f"Wan float32: dim {args.dim}, ffn {args.ffn_dim}, {args.heads} heads, {args.layers} "
        f"layers ({info['params']:,} parameters); latents "
        f"(16, {', '.join(map(str, args.latents))}): "
        f"{info['tokens']:,} tokens; text {args.text[0]} x {args.text[1]}. One device, one "
        f"process; every program compiled ahead of time, then {args.rounds} interleaved rounds "
        "(one run of each per round, in a shuffled order); medians.",
        "",
        "| program | median (s) | median CPU (s) | dot GFLOP (HLO) | temp (MiB) | compile (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        out.append(f"| {name} | {r['median_s']:.4f} | {r['median_cpu_s']:.3f} | "
                   f"{r['dot_flops'] / 1e9:.2f} | {mib(r['temp_bytes'])} | "
                   f"{fmt(r['compile_s'], '.1f', 'same')} |")
    out += [
        "",
        "Ratios: the median of the per-round ratios (min-max over the rounds), wall and "
        "process CPU time; dot FLOPs and temp bytes of the compiled programs.",
        "",
        "| comparison | wall | wall range | CPU | dot FLOPs | temp |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["ratios"]:
        w, c = r["wall"], r["cpu"]
        out.append(f"| {r['label']} | **{w[0]:.3f}** | {w[1]:.3f}-{w[2]:.3f} | {c[0]:.3f} | "
                   f"{fmt(r['flops'], '.3f')} | {fmt(r['temp'], '.3f')} |")
    out += ["", "Checks:", ""]
    prev = report["previous"]
    if "skipped" in prev:
        out.append(f"- Previous commit `{prev['rev']}`: skipped ({prev['skipped']}).")
    else:
        for pass_ in ("fwd", "fwd+bwd"):
            c = report["checks"][f"now vs prev, {pass_}"]
            what = "output" if pass_ == "fwd" else f"gradients ({c['arrays']} arrays)"
            out.append(f"- Scalar timestep, now vs `{prev['rev']}` (imported as "
                       f"`{prev['module']}`, same weights), {pass_} {what}: "
                       + ("bit-identical." if c["identical"] else
                          f"not bit-identical, max |diff| / max |prev| = {c['max_rel_diff']:.2e}."))
        for pass_, diff in prev["hlo_diff"].items():
            ops, tr = diff["opcodes"], diff["transposes"]
            out.append(f"- Compiled HLO, now - `{prev['rev']}`, {pass_}, instructions by opcode: "
                       + (", ".join(f"{k or '(other)'} {v:+d}" for k, v in ops.items())
                          if ops else "the same counts")
                       + "; transposes only now: "
                       + (", ".join(f"`{t}`" for t in tr["+"]) or "none")
                       + ", only before: " + (", ".join(f"`{t}`" for t in tr["-"]) or "none") + ".")
    for name in ("experts t=950 vs a", "experts t=500 vs b"):
        c = report["checks"][name]
        out.append(f"- WanExperts {name.split(' ', 1)[1]} called directly: "
                   + ("bit-identical." if c["identical"] else
                      f"max |diff| / max = {c['max_rel_diff']:.2e}."))
    r = report["routing"]
    out.append(f"- WanExperts' compiled HLO: {r['conditionals']} "
               f"`conditional` op(s); `while` loops in ENTRY outside them: "
               f"{r['entry_loops_outside']}. Branches (the blocks' scan: n={r['scan_trips']}):")
    for b in r["branches"]:
        loops = ", ".join(f"{k} x{v}" for k, v in sorted(b["loops"].items())) or "none"
        out.append(f"  - `{b['in']}` branch {b['index']} `{b['name']}`: while loops {loops}; "
                   f"dot {b['dot_flops'] / 1e9:.2f} GFLOP")
    return "\n".join(out)


# --------------------------------------------------------------------------- #
# Entry point
# --------------------------------------------------------------------------- #


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds (a smoke run)")
    p.add_argument("--dim", type=int, default=None, help=f"model width ({DEFAULT['dim']})")
    p.add_argument("--ffn-dim", type=int, default=None, help=f"MLP width ({DEFAULT['ffn_dim']})")
    p.add_argument("--heads", type=int, default=None, help=f"attention heads ({DEFAULT['heads']})")
    p.add_argument("--layers", type=int, default=None, help=f"blocks ({DEFAULT['layers']})")
    p.add_argument("--latents", type=int, nargs=3, metavar=("F", "H", "W"), default=None,
                   help=f"latent grid, patch (1, 2, 2) ({' '.join(map(str, DEFAULT['latents']))})")
    p.add_argument("--text", type=int, nargs=2, metavar=("LEN", "DIM"), default=None,
                   help=f"text context ({' '.join(map(str, DEFAULT['text']))})")
    p.add_argument("--rounds", type=int, default=None, help=f"timed rounds ({DEFAULT['rounds']})")
    p.add_argument("--previous", default=PREVIOUS,
                   help=f"the git revision to compare the scalar timestep with ({PREVIOUS}), "
                   "or a directory holding that revision's vidax_eqx/")
    p.add_argument("--out", default=None, help="output stem (default benchmarks/results/wan22)")
    args = p.parse_args(argv)
    sizes = QUICK if args.quick else DEFAULT
    for k, v in sizes.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.out = args.out or os.path.join(RESULTS, "wan22_quick" if args.quick else "wan22")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    report = run(args)
    report.update(date=now(), git=git_state(), machine=platform.machine(),
                  command=command_line(__file__) if argv is None else None,
                  seconds=time.perf_counter() - t_start, args=vars(args))
    text = markdown(report, args)
    print(text)
    command = report["command"] or "python benchmarks/wan22.py"
    write_text(args.out + ".md", f"# Wan 2.2 benchmark\n\n`{command}`, {report['date']}, "
               f"{report['seconds']:.0f} s, git {report['git']}.\n\n{text}\n")
    write_json(args.out + ".json", report)
    log(f"# wrote {os.path.relpath(args.out)}.md and .json after {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
