"""Sequence parallelism on 8 simulated CPU devices against single-device attention.

For each total sequence length S (B=1, H=8, D=64, float32 by default) it
measures, forward (`fwd`) and forward+backward (`fwd+bwd`: the gradient of
`sum(out * cotangent)` with respect to q, k and v), these configurations:

- `single`, `single-causal`: `vidax_eqx.kernels.attention(implementation="blockwise")`
  on the whole (B, S, H, D) problem, jitted on one device: the baseline;
- `ulysses`: `parallel.sequence_parallel_self_attention` over sp=8;
- `ring-contiguous`, `ring-zigzag` and their `-causal` variants:
  `parallel.ring_attention(layout=...)` over sp=8;
- `usp-2x4`: `parallel.usp_attention`, Ulysses over 2 devices x ring over 4
  (`--usp U R`; non-causal, contiguous ring), on `make_mesh(sp=U,
  extra_axes={"ring": R})` with the sequence sharded ring-major
  (`PartitionSpec(None, ("ring", "sp"))`, as `usp_attention` documents), when the
  library has it (reported "not available" otherwise);
- `ring-mask-full`, `ring-mask-25%`: the kernel object of
  `parallel.make_ring_attention` (contiguous ring, closed over, so its block
  plan is static) built from a dense `(S, S)` NumPy mask: all True (the plan
  sees that it hides nothing, so every step runs without a mask, like
  `ring-contiguous`), and block-sparse at 25% density (each device's queries see
  whole key blocks: their own and one other, 2 of 8; the other 6 steps are
  skipped, though their K/V still travel the ring). The 25% row is timed against
  the full-mask row (`time / single` holds that ratio; target <= 0.35: skipped
  blocks cost nothing). Both hold an `S^2`-byte mask on every device, so they run
  for S <= `--mask-max-seq` only; with `--quick`'s single run at S <= 4096 the
  fixed per-hop cost and the noise of a shared machine weigh more than at 8192.

Every parallel configuration runs the same kernel (`implementation="blockwise"`)
inside `jax.shard_map` over `make_mesh`, on inputs already sharded along the
sequence (the zigzag rows take the random inputs as already permuted: a model
keeps its activations in that layout, so the permutation is not timed). Causal
configurations are compared with `single-causal`, the others with `single`.

Every configuration runs in a fresh process (this script with the hidden
`--child` flag) that compiles both passes ahead of time, runs each once as a
warm-up and reports the best of up to `--repeats` further runs, each
synchronized with `block_until_ready`. A first run longer than
`--single-run-seconds` is the only timed run (it holds no compilation). Reported
per row:

- time, and `time / single`: the ratio to the single-device baseline (same S,
  pass and causality) in the same run. The 8 simulated devices share this
  machine's cores, so the ideal is 1.0 (the same total flops); wall time cannot
  show load imbalance, hence the work balance below.
- `CPU time / single`: the same ratio of process CPU time (all threads), the
  least over the timed runs; steadier than wall time when other jobs load the machine, but it
  also counts threads that spin while they wait (collective rendezvous, XLA's
  thread pool), which favours the single-device baseline.
- `work balance`: for the ring layouts, the max over devices / mean of the
  (query, key) pairs each device hands to the kernel, from `parallel.ring_work`
  (the same schedule the ring runs); Ulysses splits the heads evenly (1.0 by
  construction). `pairs / S^2`: the share of all pairs the schedule computes.
- `causal / non-causal`: a causal row's time over its non-causal twin's.
- bytes communicated per device, measured from the compiled program (below),
  against the theoretical minimum, and their ratio.
- `max rel err`: the largest |difference| from the single-device baseline
  output (and, for fwd+bwd, gradients) over the largest |baseline| value, for
  S <= `--check-max-seq` (a sanity check, not the test suite).

Bytes communicated per device (received = sent: every device plays the same
role), read by `_hlo.collective_bytes` from
`jax.jit(f).lower(...).compile().as_text()`: every `collective-permute` moves
its whole operand (one hop), an `all-to-all` over a group of g devices moves
(g-1)/g of its operand, an `all-gather` receives (g-1) times its operand, an
`all-reduce` (none expected) is counted as 2 (g-1)/g of its operand (a ring
all-reduce); operand sizes are the op's (per-device) result
shapes. An op inside a `while` body counts `known_trip_count` times (XLA's
annotation in the while's `backend_config`), nested loops multiply, a
`conditional` counts its most expensive branch.

The theoretical minimum per device, n = 8 devices, b = 4 bytes (float32), L = S/n:

- ring, fwd:      2 (n-1)/n S H_kv D b          (K and V, n-1 hops)
- ring, fwd+bwd:  3 x that: the forward ring, then K and V again plus their
                  float32 dK and dV (n-1 hops each) in the backward ring;
- Ulysses, fwd:   4 (n-1)/n L H D b             (all_to_all of q, k, v in, out back;
                  k, v count H_kv x the repeats of `kv_head_repeats` heads)
- Ulysses, fwd+bwd: 7 (n-1)/n L H D b           (q, k, v and the cotangent in,
                  dq, dk, dv back; the gradient program never returns `out`, so
                  its trip back is dead code and XLA removes it);
- USP (Ulysses over u, ring over r, n = u r): the Ulysses terms with (u-1)/u in
  place of (n-1)/n, plus the ring terms over r devices with H_kv / u heads.

    python benchmarks/parallel.py --quick    # smoke run (S = 2048, 4096), a few minutes
    python benchmarks/parallel.py            # S = 8192, 32768: the lead's table
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
    PASSES, RESULTS, attention_pass, best_time, emit, fmt, log, now, run_child,
    set_host_devices, timed, write_csv,
)
from _hlo import collective_bytes


# 8 simulated CPU devices: set before JAX is imported, here and in every child.
N_DEVICES = 8
set_host_devices(N_DEVICES)

DEFAULT_SEQS = (8192, 32768)
QUICK_SEQS = (2048, 4096)
DEFAULT_CSV = os.path.join(RESULTS, "parallel.csv")
QUICK_CSV = os.path.join(RESULTS, "parallel_quick.csv")
KERNEL = "blockwise"  # every configuration's kernel, and the baseline
USP_RING_AXIS = "ring"  # the hybrid's extra mesh axis (make_mesh(extra_axes=...))
CSV_EXTRA = ("B", "H", "H_kv", "D", "devices", "jax", "cpus", "date")


# --------------------------------------------------------------------------- #
# The configurations
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Config:
    """One row group of the table (both passes).

    `kind` selects the branch of `build` (and of `theory_bytes` and `work`); a
    new kind of parallel attention is a branch in each plus its entries in
    `configs`.
    """

    name: str
    kind: str  # "single" | "ulysses" | "ring" | "usp" | "ring-mask"
    causal: bool = False
    layout: str = "contiguous"  # ring layout ("usp": the layout of its ring)
    mask: str | None = None  # "ring-mask" (and its "single" reference): see `dense_mask`
    against: str | None = None  # the row `time / single` compares with, if not `single`

    @property
    def baseline(self) -> str:
        if self.against is not None:
            return self.against
        return "single-causal" if self.causal else "single"

    @property
    def non_causal_twin(self) -> str | None:
        return self.name.removesuffix("-causal") if self.causal else None


def configs(usp: tuple[int, int]) -> list[Config]:
    """Every configuration, baselines first (ratios need them)."""
    u, r = usp
    return [
        Config("single", "single"),
        Config("single-causal", "single", causal=True),
        Config("ulysses", "ulysses"),
        Config("ring-contiguous", "ring", layout="contiguous"),
        Config("ring-contiguous-causal", "ring", causal=True, layout="contiguous"),
        Config("ring-zigzag", "ring", layout="zigzag"),
        Config("ring-zigzag-causal", "ring", causal=True, layout="zigzag"),
        Config(f"usp-{u}x{r}", "usp"),
        # `make_ring_attention` with a dense 2D mask: block-sparse against full.
        Config("ring-mask-full", "ring-mask", mask="full"),
        Config("ring-mask-25%", "ring-mask", mask="sparse25", against="ring-mask-full"),
    ]


CONFIG_NAMES_HELP = (
    "single, single-causal, ulysses, ring-{contiguous,zigzag}[-causal], usp-UxR, "
    "ring-mask-{full,25%%}"  # %% for argparse
)


def dense_mask(name: str, S: int):
    """The global `(S, S)` bool NumPy mask of a "ring-mask" row (deterministic, so
    parent and child build the same one).

    `"full"`: all True. `"sparse25"`: in blocks of the ring's local length
    `L = S / 8`, query block `r` sees key blocks `r` and one other (a random
    derangement of the blocks), so every device computes 2 of its 8 ring steps:
    25% of the pairs, evenly spread.
    """
    import numpy as np

    if name == "full":
        return np.ones((S, S), bool)
    n, L = N_DEVICES, S // N_DEVICES
    rng = np.random.default_rng(0)
    while True:
        other = rng.permutation(n)
        if (other != np.arange(n)).all():
            break
    blocks = np.eye(n, dtype=bool)
    blocks[np.arange(n), other] = True
    return np.kron(blocks, np.ones((L, L), bool)).astype(bool)


# --------------------------------------------------------------------------- #
# What is measured (runs in the child)
# --------------------------------------------------------------------------- #


class NotAvailable(Exception):
    """The library lacks this configuration (reported as such, not as an error)."""


def build(cfg: Config, args):
    """`(attend, in_sharding)`: a function of global (q, k, v) and where its inputs live."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from vidax_eqx import kernels, parallel
    from vidax_eqx._jax_private import single_device_sharding

    if cfg.kind == "single":
        mask = None if cfg.mask is None else dense_mask(cfg.mask, args.child_seq)

        def attend(q, k, v):
            return kernels.attention(q, k, v, causal=cfg.causal, mask=mask, implementation=KERNEL)

        return attend, single_device_sharding(jax.devices()[0])

    if cfg.kind == "usp":
        if not hasattr(parallel, "usp_attention"):
            raise NotAvailable("not available (vidax_eqx.parallel has no usp_attention)")
        u, r = args.usp
        mesh = parallel.make_mesh(sp=u, extra_axes={USP_RING_AXIS: r})

        def local(q, k, v):
            return parallel.usp_attention(
                q, k, v, ulysses_axis=parallel.SP_AXIS, ring_axis=USP_RING_AXIS,
                causal=cfg.causal, layout=cfg.layout, implementation=KERNEL,
            )

        # Ring-major, as `usp_attention` asks: a Ulysses group holds neighbouring
        # chunks, so after its all_to_all each ring rank holds one contiguous block.
        spec = P(None, (USP_RING_AXIS, parallel.SP_AXIS))
    else:
        mesh = parallel.make_mesh(sp=N_DEVICES)
        spec = P(None, parallel.SP_AXIS)
        if cfg.kind == "ulysses":
            def local(q, k, v):
                return parallel.sequence_parallel_self_attention(
                    q, k, v, parallel.SP_AXIS, causal=cfg.causal, implementation=KERNEL
                )
        elif cfg.kind == "ring":
            def local(q, k, v):
                return parallel.ring_attention(
                    q, k, v, ring_axis=parallel.SP_AXIS, causal=cfg.causal,
                    layout=cfg.layout, implementation=KERNEL,
                )
        elif cfg.kind == "ring-mask":
            if not hasattr(parallel, "make_ring_attention"):
                raise NotAvailable("not available (vidax_eqx.parallel has no make_ring_attention)")
            if args.child_seq > args.mask_max_seq:
                raise NotAvailable(f"skipped (dense mask, S > --mask-max-seq {args.mask_max_seq})")
            kernel = parallel.make_ring_attention(
                dense_mask(cfg.mask, args.child_seq), ring_axis=parallel.SP_AXIS,
                layout=cfg.layout, implementation=KERNEL,
            )
            local = kernel  # closed over: the mask is concrete, the block plan static
        else:
            raise ValueError(f"unknown configuration kind {cfg.kind!r}")
    attend = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    return attend, NamedSharding(mesh, spec)


def make_inputs(args, seq: int):
    """q, k, v and a float32 cotangent, random normal, as NumPy arrays."""
    import numpy as np

    rng = np.random.default_rng(0)
    q_shape = (args.batch, seq, args.heads, args.head_dim)
    kv_shape = (args.batch, seq, args.kv_heads, args.head_dim)
    return [rng.standard_normal(s, dtype=np.float32) for s in (q_shape, kv_shape, kv_shape, q_shape)]


# --------------------------------------------------------------------------- #
# Theory and work balance (run in the parent)
# --------------------------------------------------------------------------- #


def theory_bytes(cfg: Config, pass_: str, S: int, args) -> float | None:
    """The minimum bytes per device (module docstring)."""
    from vidax_eqx import parallel

    H, H_kv, D, b = args.heads, args.kv_heads, args.head_dim, 4
    S_b = S * args.batch
    if cfg.kind == "single":
        return 0.0
    if cfg.kind in ("ring", "ring-mask"):
        return ring_bytes(pass_, N_DEVICES, S_b, H_kv, D, b)
    if cfg.kind == "ulysses":
        reps = parallel.kv_head_repeats(H, H_kv, N_DEVICES)
        return ulysses_bytes(pass_, N_DEVICES, S_b // N_DEVICES, H, H_kv * reps, D, b)
    if cfg.kind == "usp":
        u, r = args.usp
        reps = parallel.kv_head_repeats(H, H_kv, u)
        return ulysses_bytes(pass_, u, S_b // N_DEVICES, H, H_kv * reps, D, b) + ring_bytes(
            pass_, r, S_b, H_kv * reps // u, D, b
        )
    return None


def work(cfg: Config, S: int, args) -> tuple[float | None, float | None]:
    """(max / mean per-device work, pairs handed to the kernel / S^2) of the ring
    schedule; `None` where there is no ring schedule."""
    import numpy as np

    from vidax_eqx import parallel

    if cfg.kind == "ring":
        w = parallel.ring_work(S, N_DEVICES, layout=cfg.layout, causal=cfg.causal)
    elif cfg.kind == "usp":
        u, r = args.usp
        w = parallel.ring_work(S, r, layout=cfg.layout, causal=cfg.causal)
    elif cfg.kind == "ring-mask":
        if S > args.mask_max_seq:
            return None, None
        kernel = parallel.make_ring_attention(dense_mask(cfg.mask, S), layout=cfg.layout)
        w = kernel.work(N_DEVICES)
    elif cfg.kind == "ulysses":  # every device: the whole sequence for H / n heads
        return 1.0, None
    else:
        return None, None
    w = np.asarray(w, dtype=np.float64)
    return float(w.max() / w.mean()), float(w.sum() / S**2)


# --------------------------------------------------------------------------- #
# One configuration, in a fresh process
# --------------------------------------------------------------------------- #


def _zigzag_views(cfg: Config):
    """(to global order, from global order) for this configuration's inputs."""
    from vidax_eqx import parallel

    if cfg.kind == "ring" and cfg.layout == "zigzag":
        return (lambda x: parallel.zigzag_unpermute(x, 1, N_DEVICES),
                lambda x: parallel.zigzag_permute(x, 1, N_DEVICES))
    return (lambda x: x), (lambda x: x)


def _rel_err(got, ref) -> float:
    import numpy as np

    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))


def child_main(args) -> None:
    """Measures one configuration, both passes; prints one JSON line per pass as
    it completes (so a crash in the second keeps the first)."""
    import jax

    cfg = next(c for c in configs(args.usp) if c.name == args.child_config)
    seq = args.child_seq
    try:
        attend, sharding = build(cfg, args)
    except NotAvailable as e:
        emit({"status": str(e)})
        return
    host = make_inputs(args, seq)
    xs = [jax.device_put(x, sharding) for x in host]
    jax.block_until_ready(xs)
    for pass_ in PASSES:
        fn, n_in = attention_pass(attend, pass_)
        t0 = time.perf_counter()
        compiled = fn.lower(*xs[:n_in]).compile()
        r = {"compile_s": time.perf_counter() - t0}
        comm = collective_bytes(compiled.as_text(), N_DEVICES)
        r.update(bytes=comm["total"], bytes_by_kind=comm["by_kind"], ops=comm["ops"],
                 unknown_trip_counts=comm["unknown_trip_counts"])

        def run():
            return jax.block_until_ready(compiled(*xs[:n_in]))

        first, out = timed(run)
        r.update(best_time(run, args.repeats, target_seconds=args.target_seconds,
                           single_run_seconds=args.single_run_seconds, first=first).fields())
        if cfg.kind != "single" and seq <= args.check_max_seq:
            r["max_rel_err"] = _check(cfg, pass_, out, host, args)
        del out
        emit({"pass": pass_, "status": "ok", **r})


def _check(cfg: Config, pass_: str, out, host, args) -> float:
    """Largest relative difference from the single-device baseline."""
    import jax

    to_global, from_global = _zigzag_views(cfg)
    single, sharding = build(Config("ref", "single", causal=cfg.causal, mask=cfg.mask), args)
    fn, n_in = attention_pass(single, pass_)
    xs = [jax.device_put(x, sharding) for x in host]
    ins = [to_global(x) for x in xs[:3]] + [to_global(x) for x in xs[3:n_in]]
    ref = fn(*ins)
    ref = [ref] if pass_ == "fwd" else list(ref)
    got = [out] if pass_ == "fwd" else list(out)
    return max(_rel_err(jax.device_get(g), jax.device_get(from_global(x))) for g, x in zip(got, ref))


def spawn_child(args, cfg: Config, seq: int) -> dict[str, dict]:
    """`{pass: result}` of one configuration, measured in a fresh process."""
    cmd = [
        "--child", "--child-config", cfg.name, "--child-seq", str(seq),
        "--batch", str(args.batch), "--heads", str(args.heads),
        "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim),
        "--repeats", str(args.repeats), "--target-seconds", str(args.target_seconds),
        "--single-run-seconds", str(args.single_run_seconds),
        "--check-max-seq", str(args.check_max_seq), "--usp", *map(str, args.usp),
        "--mask-max-seq", str(args.mask_max_seq),
    ]  # fmt: skip
    child = run_child(__file__, cmd)
    results: dict[str, dict] = {}
    for r in child.records:
        results.update({r["pass"]: r} if "pass" in r else dict.fromkeys(PASSES, r))
    for pass_ in PASSES:
        if not child.ok:
            results.setdefault(pass_, {"status": f"error (exit {child.returncode}): {child.reason[:200]}"})
        else:
            results.setdefault(pass_, {"status": "error (no result)"})
    return results


# --------------------------------------------------------------------------- #
# The run
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Row:
    seq: int
    pass_: str
    config: str
    status: str = "ok"
    time_s: float | None = None
    runs: int | None = None
    ratio_vs_single: float | None = None
    cpu_s: float | None = None
    cpu_ratio_vs_single: float | None = None
    causal_over_non_causal: float | None = None
    work_balance: float | None = None
    pairs_over_s2: float | None = None
    bytes_per_device: float | None = None
    theory_bytes: float | None = None
    bytes_over_theory: float | None = None
    bytes_by_kind: str = ""
    max_rel_err: float | None = None
    compile_s: float | None = None
    note: str = ""


def run(args) -> tuple[list[Row], dict]:
    import jax

    info = {
        "date": now(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "B": args.batch,
        "H": args.heads,
        "H_kv": args.kv_heads,
        "D": args.head_dim,
        "usp": f"{args.usp[0]}x{args.usp[1]}",
    }
    log(f"# {info}")
    t_start = time.perf_counter()
    chosen = [c for c in configs(args.usp) if args.configs is None or c.name in args.configs]
    rows: list[Row] = []
    for seq in args.seqs:
        by_name: dict[tuple[str, str], Row] = {}
        for cfg in chosen:
            r = spawn_child(args, cfg, seq)
            balance, pairs = work(cfg, seq, args)
            for pass_ in PASSES:
                p = r[pass_]
                row = Row(seq, pass_, cfg.name, status=p["status"], note=p.get("note", ""))
                if p["status"] == "ok":
                    row.time_s, row.cpu_s, row.runs = p["time_s"], p["cpu_s"], p["runs"]
                    row.compile_s = p["compile_s"]
                    row.bytes_per_device = p["bytes"]
                    row.bytes_by_kind = " ".join(
                        f"{k}:{p['ops'][k]}x={v / 2**20:.2f}MiB" for k, v in sorted(p["bytes_by_kind"].items())
                    )
                    if p["unknown_trip_counts"]:
                        row.note = "; ".join(filter(None, (row.note, "a loop without known_trip_count counted once")))
                    row.max_rel_err = p.get("max_rel_err")
                    row.theory_bytes = theory_bytes(cfg, pass_, seq, args)
                    if row.theory_bytes:
                        row.bytes_over_theory = row.bytes_per_device / row.theory_bytes
                    row.work_balance, row.pairs_over_s2 = balance, pairs
                    base = by_name.get((cfg.baseline, pass_))
                    if base is not None and base.time_s:
                        row.ratio_vs_single = row.time_s / base.time_s
                        row.cpu_ratio_vs_single = row.cpu_s / base.cpu_s
                    twin = by_name.get((cfg.non_causal_twin, pass_))
                    if twin is not None and twin.time_s:
                        row.causal_over_non_causal = row.time_s / twin.time_s
                by_name[(cfg.name, pass_)] = row
                rows.append(row)
                elapsed = time.perf_counter() - t_start
                if row.time_s is not None:
                    summary = (
                        f"{row.time_s * 1e3:.1f} ms (best of {row.runs}), x{fmt(row.ratio_vs_single, '.2f')} "
                        f"single, {_mib(row.bytes_per_device)} MiB/device (theory "
                        f"{_mib(row.theory_bytes)}), err {fmt(row.max_rel_err, '.1e')}"
                    )
                else:
                    summary = row.status
                log(f"S={seq} {pass_} {cfg.name}: {summary}  [{elapsed:.0f} s]")
    info["seconds"] = round(time.perf_counter() - t_start, 1)
    return rows, info


# --------------------------------------------------------------------------- #
# Output
# --------------------------------------------------------------------------- #


def _mib(x) -> str:
    return fmt(None if x is None else x / 2**20, ".2f")


def markdown(rows: list[Row], info: dict) -> str:
    lines = [
        f"B={info['B']}, H={info['H']}, H_kv={info['H_kv']}, D={info['D']}, float32, kernel "
        f"`{KERNEL}`; {info['devices']} simulated devices on {info['backend']} "
        f"({info['cpus']} CPUs, shared); jax {info['jax']}; {info['seconds']:.0f} s in all.",
        "",
        "| S | pass | config | time (ms) | runs | time / single | CPU time / single | causal / non-causal | "
        "work balance | pairs / S² | MiB / device (HLO) | MiB / device (theory) | HLO / theory | "
        "max rel err |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        time_cell = fmt(r.time_s and r.time_s * 1e3, ".1f") if r.status == "ok" else r.status
        if r.status.startswith("error"):
            time_cell = r.status.split(":")[0] + " (see notes)"
        lines.append(
            f"| {r.seq} | {r.pass_} | `{r.config}` | {time_cell} | {fmt(r.runs, 'd')} | "
            f"{fmt(r.ratio_vs_single, '.2f')} | {fmt(r.cpu_ratio_vs_single, '.2f')} | "
            f"{fmt(r.causal_over_non_causal, '.2f')} | "
            f"{fmt(r.work_balance, '.2f')} | {fmt(r.pairs_over_s2, '.3f')} | "
            f"{_mib(r.bytes_per_device)} | {_mib(r.theory_bytes)} | "
            f"{fmt(r.bytes_over_theory, '.3f')} | {fmt(r.max_rel_err, '.1e')} |"
        )
    return "\n".join(lines)


def notes(rows: list[Row], info: dict, args) -> str:
    u, r = args.usp
    out = [
        "",
        "Notes:",
        "",
        f"- `single` / `single-causal`: `kernels.attention(implementation=\"{KERNEL}\")` on the "
        "whole problem, jitted on one device. Every other row runs the same kernel on "
        f"{N_DEVICES} simulated CPU devices that share the machine's {info['cpus']} cores, so "
        "the ideal time / single is 1.0 (same total work) and wall time cannot show load "
        "imbalance: `work balance` (max / mean over devices of the (query, key) pairs "
        "`parallel.ring_work` schedules; Ulysses splits heads evenly) shows it instead. "
        "`pairs / S²` is the share of all pairs computed (causal ideal 0.5; the ring's "
        "block-level skip keeps whole diagonal blocks, and the kernel skips hidden tiles "
        "inside them).",
        "- Causal rows: time / single is against `single-causal`; `causal / non-causal` is "
        "against the same layout's non-causal row.",
        "- A ratio below 1.0 is not less work: every row computes the same flops (the ring's "
        "causal rows slightly more, see `pairs / S²`). Eight device programs keep both cores "
        "busier than one device's program does, which is the likely reason Ulysses (one "
        "head per device, one kernel call) runs under the baseline on this machine.",
        "- `CPU time / single`: process CPU time (all threads) of the same timed run. Other "
        "jobs on this shared machine move wall time more than CPU time, but CPU time also "
        "counts threads spinning while they wait (collective rendezvous, XLA's pool), which "
        "favours the single-device baseline.",
        f"- Timing: best of up to {args.repeats} run(s) after a warm-up; a pass whose first "
        f"run exceeds {args.single_run_seconds:g} s is timed on that run alone. With one run "
        "(`--quick`) on a shared 2-core machine, expect +-20% noise between rows.",
        f"- Bytes per device are read from the compiled HLO: collective-permute = its "
        "operand, all-to-all = (g-1)/g of it, all-gather = (g-1)/g of its result, ops in a "
        "while body x its `known_trip_count`. Theory (n = 8, b = 4, L = S/n): ring fwd "
        "2(n-1)/n·S·H_kv·D·b (K, V); ring fwd+bwd 3x that (K, V again and float32 dK, dV in "
        "the backward ring, whose n-1 dK/dV hops include the last one home: a block's own "
        "dK/dV never travel); Ulysses fwd 4(n-1)/n·L·H·D·b (q, k, v in, out back); Ulysses "
        "fwd+bwd 7(n-1)/n·L·H·D·b (q, k, v, cotangent in; dq, dk, dv back: a gradient-only "
        f"program never sends `out` back, XLA removes that all_to_all); USP {u}x{r}: the "
        f"Ulysses terms over {u} devices plus the ring terms over {r} devices with H_kv/{u} "
        "heads.",
        "- Zigzag rows take the random inputs as already in the zigzag layout (the "
        "permutation is not timed); their `max rel err` compares with the baseline on the "
        "unpermuted sequence.",
        f"- `max rel err` (max |diff| / max |baseline|, outputs or all three gradients) is "
        f"measured for S <= {args.check_max_seq}; float32 agreement is ~1e-6.",
    ]
    usp_rows = [x for x in rows if x.config.startswith("usp")]
    if usp_rows and usp_rows[0].status.startswith("not available"):
        out.append(f"- `usp-{u}x{r}`: {usp_rows[0].status}.")
    elif usp_rows:
        out.append(
            f"- `usp-{u}x{r}`: `usp_attention` on `make_mesh(sp={u}, extra_axes={{'ring': {r}}})`, "
            "sequence sharded ring-major over ('ring', 'sp'), contiguous ring, non-causal only."
        )
    off = [x for x in rows if x.bytes_over_theory is not None and abs(x.bytes_over_theory - 1) > 0.10]
    if off:
        out.append(
            "- HLO bytes more than 10% away from theory: "
            + "; ".join(f"S={x.seq} {x.pass_} {x.config} x{x.bytes_over_theory:.3f} ({x.bytes_by_kind})" for x in off)
        )
    elif any(x.bytes_over_theory is not None for x in rows):
        worst = max((x for x in rows if x.bytes_over_theory is not None), key=lambda x: abs(x.bytes_over_theory - 1))
        out.append(
            "- HLO bytes match the theoretical minimum on every parallel row "
            f"(largest deviation x{worst.bytes_over_theory:.3f}, {worst.config} {worst.pass_})."
        )
    for pass_ in PASSES:
        for seq in sorted({x.seq for x in rows}):
            by = {x.config: x for x in rows if x.pass_ == pass_ and x.seq == seq}
            sparse, full, plain = by.get("ring-mask-25%"), by.get("ring-mask-full"), by.get("ring-contiguous")
            if sparse is None or sparse.time_s is None or full is None or not full.time_s:
                continue
            vs_plain = (
                f", x{sparse.time_s / plain.time_s:.2f} the mask-free `ring-contiguous`"
                if plain is not None and plain.time_s else ""
            )
            verdict = "meets" if sparse.time_s / full.time_s <= 0.35 else "MISSES"
            out.append(
                f"- S={seq} {pass_}: `ring-mask-25%` takes x{sparse.time_s / full.time_s:.2f} the "
                f"time of `ring-mask-full` ({verdict} the 0.35 target){vs_plain}; its schedule "
                f"hands the kernel {fmt(sparse.pairs_over_s2, '.3f')} of the pairs."
            )
    bad = [x for x in rows if x.max_rel_err is not None and x.max_rel_err > 1e-4]
    if bad:
        out.append("- LARGE ERRORS: " + "; ".join(f"S={x.seq} {x.pass_} {x.config} {x.max_rel_err:.1e}" for x in bad))
    for x in rows:
        if x.status.startswith("error"):
            out.append(f"- S={x.seq} {x.pass_} {x.config}: {x.status}")
    single = [x for x in rows if x.note]
    for x in single:
        out.append(f"- S={x.seq} {x.pass_} {x.config}: {x.note}.")
    return "\n".join(out)


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


def parse_args(argv=None):
    rel = os.path.relpath
    p = argparse.ArgumentParser(
        description="Ulysses, ring (contiguous, zigzag; causal and not) and hybrid sequence "
        f"parallelism on {N_DEVICES} simulated CPU devices against single-device "
        f"`{KERNEL}` attention: time, work balance and bytes communicated per device "
        "(from the compiled HLO) against the theoretical minimum. Each configuration in a "
        "fresh process. Prints a Markdown table and writes a CSV."
    )
    p.add_argument("--seqs", type=int, nargs="+", default=None,
                   help=f"total sequence lengths, multiples of {2 * N_DEVICES} "
                   f"(default {' '.join(map(str, DEFAULT_SEQS))})")
    p.add_argument("--configs", nargs="+", default=None,
                   help=f"configurations to run (default all: {CONFIG_NAMES_HELP}); "
                   "include the baselines for the ratios")
    p.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    p.add_argument("--heads", type=int, default=8, help="heads H (default 8)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads H_kv (default H)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim D (default 64)")
    p.add_argument("--usp", type=int, nargs=2, default=(2, 4), metavar=("U", "R"),
                   help="hybrid split: Ulysses over U devices x ring over R, U*R = "
                   f"{N_DEVICES} (default 2 4)")
    p.add_argument("--repeats", type=int, default=3,
                   help="most timed runs per pass after the warm-up (default 3)")
    p.add_argument("--target-seconds", type=float, default=10.0,
                   help="fewer timed runs (at least one) when they would take longer "
                   "than this many seconds (default 10)")
    p.add_argument("--single-run-seconds", type=float, default=15.0,
                   help="a pass whose first run takes longer than this many seconds is "
                   "timed on that run alone (default 15)")
    p.add_argument("--check-max-seq", type=int, default=8192,
                   help="compare outputs and gradients with the baseline up to this S "
                   "(default 8192; costs one baseline run per configuration)")
    p.add_argument("--mask-max-seq", type=int, default=8192,
                   help="run the ring-mask rows (a dense (S, S) mask on every device) up "
                   "to this S (default 8192)")
    p.add_argument("--csv", default=None, help=f"CSV output (default {rel(DEFAULT_CSV)}; "
                   f"{rel(QUICK_CSV)} with --quick)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: S={' '.join(map(str, QUICK_SEQS))}, 1 timed run")
    # Hidden: measure one configuration in this (fresh) process; used by the parent.
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-config", help=argparse.SUPPRESS)
    p.add_argument("--child-seq", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.quick:
        args.seqs = args.seqs or list(QUICK_SEQS)
        args.repeats = 1
        args.csv = args.csv or QUICK_CSV
    args.seqs = args.seqs or list(DEFAULT_SEQS)
    args.csv = args.csv or DEFAULT_CSV
    args.kv_heads = args.kv_heads or args.heads
    args.usp = tuple(args.usp)
    if math.prod(args.usp) != N_DEVICES:
        p.error(f"--usp U R needs U * R = {N_DEVICES}; received {args.usp}")
    for s in args.seqs:
        if s % (2 * N_DEVICES):
            p.error(f"every S must be a multiple of 2 * {N_DEVICES} (zigzag); received {s}")
    names = [c.name for c in configs(args.usp)]
    for c in args.configs or ():
        if c not in names:
            p.error(f"unknown configuration {c!r}; choose from {', '.join(names)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return 0
    rows, info = run(args)
    print(markdown(rows, info))
    print(notes(rows, info, args))
    write_csv(args.csv, Row, rows, info, CSV_EXTRA)
    log(f"# wrote {os.path.relpath(args.csv)} after {info['seconds']:.0f} s")
    failed = [r for r in rows if r.status.startswith("error")]
    for r in failed:
        log(f"# S={r.seq} {r.pass_} {r.config}: {r.status}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
