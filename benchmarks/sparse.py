"""Sliding tile attention (STA) and video sparse attention (VSA): time against
density, single device and ring.

The issue's question: with a [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask]
whose windows cover about 1/8, 1/4 and 1/2 of the tiles, does the time scale
with the density? Target, on every row: `time / full <= 1.25 x density + 0.05`.

Default problem: Wan 2.1's 480p x 81-frame latent grid, 21 x 30 x 52 = 32,760
tokens, B=1, H=8, D=64, float32, CPU; tile (3, 6, 13) (234 tokens; 7 x 5 x 4
tiles, no padding). Configurations, each forward (`fwd`) and forward+backward
(`fwd+bwd`: the gradient of `sum(out * cotangent)` with respect to q, k and v):

- `single`: `vidax_eqx.kernels.attention(implementation="blockwise")` on one
  device. Baseline (`full`): no mask, the 32,760 real tokens (default blocks).
  Masked rows: `mask=tm` on the tile layout (`tm.seq_len` tokens: the 32,760
  plus any padding of partial tiles), served from the static table of each query
  tile's window tiles (`Blockwise(sta_table=True)`, the default; `--sta-path loop`
  times the tile-pair loop instead).
- `ring-contiguous`, `ring-zigzag`: `vidax_eqx.parallel.ring_attention(mask=tm,
  layout=..., implementation="blockwise")` inside `jax.shard_map` over
  `parallel.make_mesh(sp=8)` on 8 simulated CPU devices
  (`--xla_force_host_platform_device_count=8`, set in the child before JAX is
  imported). The global sequence is the tile layout padded to a multiple of
  `sp x tile_size` (zigzag: `2 x sp x tile_size`) so that every device's chunk
  is whole tiles; tokens at positions `>= tm.seq_len` are invisible. Baseline
  (`ring`, `full`): the ring without a mask, contiguous layout, on the same 8
  devices and the 32,760 real tokens (without a mask the two layouts do the same
  work; zigzag would need 32,760 / 16 tokens per half-chunk, which is not whole).

Inputs are random and taken as already laid out (tile order, zigzag order): a
model keeps its activations in that layout, so `tile_permute` / `zigzag_permute`
are not timed. `jax.nn.dot_product_attention` is not the baseline here: at
32,760 tokens its XLA path materializes the `(B, H, S, S)` float32 logits, 34 GB
(the script prints the figure for the chosen size).

Every (configuration, window, pass) runs in a fresh process (this script with
the hidden `--child` flag), one after another, as in `attention.py`: the child
creates the inputs, compiles ahead of time (`jit(...).lower(...).compile()`),
resets the RSS high-water mark (`/proc/self/clear_refs`, Linux), runs once and
reads `VmHWM` (peak above inputs = that minus the RSS just before the run;
`ru_maxrss` would carry the parent's peak across fork + exec). That first run is
the warm-up; the time is the best of up to `--repeats` further runs, fewer when
they would take over `--target-seconds`; a first run longer than
`--single-run-seconds` is the only timed run (no compilation in it).

Reported per row: density (`tm.density()`, over real tokens), the fraction of
(query block, key block) pairs the kernel computes (`_tile.block_map` over the
sequence it sees, padding included), time (wall, best of the runs),
`time / full` against the baseline of the same kind measured in the same run,
the same ratio of process CPU time (all threads), the target
`1.25 x density + 0.05` and a PASS / FAIL on each ratio, `cores busy` (CPU time
/ wall time: how much of the machine the row got, and used), peak RSS above the
inputs (ring: all 8 devices, one process) and XLA's compiled `memory_analysis()`
temp size (ring: per device). On a shared machine the CPU-time ratio is the
steadier one: another job's load stretches wall time, and by different amounts
for rows measured minutes apart. With `--check-max-seq` (default: the
`--quick` size) each masked row also reports its largest relative difference
from a reference: the materializing `"xla"` kernel (single) or the
single-device `"blockwise"` kernel on the global sequence (ring).
`--render JSON` re-renders the table of an earlier run without measuring.

`--kind vsa` measures video sparse attention instead (`--kind vsa sta`: both, VSA
first, the baselines of equal size measured once), written to
`results/sparse_vsa.{md,json}`: per grid (default 12 x 32 x 32 = 12,288 and
21 x 30 x 52 = 32,760 tokens, tile 4 x 4 x 4: 192 and 624 tiles, the second
with partial tiles, 39,936 tokens in the tile layout) and density d = topk /
tiles (default 0.1 and 0.25), forward and forward+backward:

- `single`: `kernels.video_sparse_attention(topk=..., implementation="blockwise")`
  on the tile layout; and a `coarse:` row, the coarse stage and the selection
  alone (tile means, coarse attention, top-k, out_c's broadcast), whose time over
  full attention's is added to the target: `time / full <= 1.25 x d + 0.05 +
  coarse / full`.
- `ring-contiguous`: `parallel.video_sparse_attention(ring_axis=...)` inside
  `jax.shard_map` over 8 simulated devices, on the tile layout padded with empty
  tiles to `parallel.vsa_padded_length` (`--vsa-ring-max-tokens` limits it to the
  smaller grids); target without the coarse term.

Baselines as for STA: the unmasked `"blockwise"` kernel (single) and the unmasked
contiguous ring, on the grid's real tokens. `jax.nn.dot_product_attention` does
not fit: its (B, H, S, S) float32 logits are 4.8 GB at 12,288 tokens and H=8
(forward+backward holds several such arrays), on a 24 GiB machine.

    python benchmarks/sparse.py --quick                    # smoke run, stdout only
    python benchmarks/sparse.py --configs single           # the issue's table, one device
    python benchmarks/sparse.py                            # ... and the ring rows
    python benchmarks/sparse.py --kind vsa --quick         # VSA smoke run
    python benchmarks/sparse.py --kind vsa sta --configs single   # VSA, then STA on one device
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time

from _harness import (
    PASSES, RESULTS, attention_pass, best_time, command_line, compile_ahead,
    cpu_model, emit, fmt, git_state, log, meminfo, now, run_child, run_with_peak, write_json,
    write_text,
)


CONFIGS = ("single", "ring-contiguous", "ring-zigzag")
FULL = "full"  # the window name of the unmasked baselines
KERNEL = "blockwise"
N_DEVICES = 8

DEFAULT_GRID = (21, 30, 52)  # Wan 2.1, 480p x 81 frames, after the VAE and 1x2x2 patches
DEFAULT_TILE = (3, 6, 13)
DEFAULT_WINDOWS = ((3, 5, 1), (7, 5, 1), (5, 5, 3))  # densities 0.107, 0.250, 0.536
QUICK_GRID = (14, 10, 26)
QUICK_TILE = (2, 5, 13)  # 130 tokens, 7 x 2 x 2 tiles
QUICK_WINDOWS = ((3, 1, 1), (7, 1, 1), (7, 3, 1))  # densities 0.107, 0.250, 0.500

DEFAULT_MD = os.path.join(RESULTS, "sparse.md")
DEFAULT_JSON = os.path.join(RESULTS, "sparse.json")

# Video sparse attention (`--kind vsa`).
KINDS = ("sta", "vsa")
VSA_CONFIGS = ("single", "ring-contiguous")
VSA_GRIDS = ((12, 32, 32), (21, 30, 52))  # 12,288 and 32,760 tokens
VSA_TILE = (4, 4, 4)
VSA_DENSITIES = (0.1, 0.25)
QUICK_VSA_GRIDS = ((8, 16, 16),)  # 2,048 tokens, 32 tiles
VSA_MD = os.path.join(RESULTS, "sparse_vsa.md")
VSA_JSON = os.path.join(RESULTS, "sparse_vsa.json")
COARSE = "coarse"  # a VSA row's prefix: the coarse stage and the selection alone


def target(density: float) -> float:
    return 1.25 * density + 0.05


# --------------------------------------------------------------------------- #
# The problem of one row
# --------------------------------------------------------------------------- #


def tile_mask(args, window):
    from vidax_eqx.kernels import SlidingTileMask

    return SlidingTileMask(tuple(args.grid), tuple(args.tile), tuple(window))


def vsa_topk(args, density: float) -> int:
    """The key tiles per query tile that make density `density` (at least one)."""
    return max(1, round(density * vsa_layout(args).n_tiles))


def vsa_layout(args):
    from vidax_eqx.kernels._vsa import VsaLayout

    return VsaLayout(tuple(args.grid), tuple(args.tile))


def vsa_window(window) -> tuple[str, int] | None:
    """`("topk" | "coarse", topk)` for a VSA row's window name, None otherwise."""
    if isinstance(window, str) and ":" in window:
        what, n = window.split(":")
        return what, int(n)
    return None


def global_len(args, config: str, window) -> int:
    """The global sequence length a row runs on."""
    real = math.prod(args.grid)
    if window == FULL:
        return real
    if vsa_window(window) is not None:
        if config == "single":
            return vsa_layout(args).video_len
        from vidax_eqx.parallel import vsa_padded_length

        return vsa_padded_length(tuple(args.grid), tuple(args.tile), ring_size=args.devices)
    tm = tile_mask(args, window)
    if config == "single":
        return tm.seq_len
    multiple = (2 if config == "ring-zigzag" else 1) * args.devices * tm.tile_size
    return -(-tm.seq_len // multiple) * multiple


def block_fraction(args, config: str, window) -> tuple[float, int, int]:
    """(fraction, computed, total) of (query block, key block) pairs that the
    blockwise kernel computes on the sequence this row runs on (padding included)."""
    import numpy as np

    from vidax_eqx.kernels._tile_tables import block_map, tile_block

    tm = tile_mask(args, window)
    block = tile_block(tm, 128)  # what `Blockwise._block_sizes` picks (block_q default 256)
    pos = np.arange(global_len(args, config, window))
    bm = block_map(tm, block, block, pos, pos)
    return float(bm.mean()), int(bm.sum()), int(bm.size)


# --------------------------------------------------------------------------- #
# One row, in a fresh process
# --------------------------------------------------------------------------- #


class NotAvailable(Exception):
    """The library cannot run this configuration (yet)."""


def attention_fn(args, config: str, window):
    """`(attend, sharding, layout)`: the global-array function of one row, the
    sharding of its inputs, and the ring layout (None on one device)."""
    import inspect

    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from vidax_eqx import kernels, parallel
    from vidax_eqx._jax_private import single_device_sharding

    if vsa_window(window) is not None:
        return vsa_fn(args, config, window)
    tm = None if window == FULL else tile_mask(args, window)
    if config == "single":
        impl = kernels.Blockwise(sta_table=args.sta_path == "table") if tm is not None else KERNEL

        def attend(q, k, v):
            return kernels.attention(q, k, v, mask=tm, implementation=impl)

        return attend, single_device_sharding(jax.devices()[0]), None

    layout = config.removeprefix("ring-")
    if tm is not None and "mask" not in inspect.signature(parallel.ring_attention).parameters:
        raise NotAvailable("not available (parallel.ring_attention has no mask= yet)")
    if len(jax.devices()) < args.devices:
        raise NotAvailable(f"needs {args.devices} devices, found {len(jax.devices())}")
    mesh = parallel.make_mesh(sp=args.devices)
    spec = P(None, parallel.SP_AXIS)
    extra = {} if tm is None else {"mask": tm}

    def local(q, k, v):
        return parallel.ring_attention(
            q, k, v, ring_axis=parallel.SP_AXIS, layout=layout, implementation=KERNEL, **extra
        )

    attend = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    return attend, NamedSharding(mesh, spec), layout


def vsa_fn(args, config: str, window):
    """`attention_fn` for VSA rows: `kernels.video_sparse_attention` (single), the
    coarse stage and the selection alone (`coarse:`), or
    `parallel.video_sparse_attention` over a ring of `--devices`."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from vidax_eqx import kernels, parallel
    from vidax_eqx._jax_private import single_device_sharding
    from vidax_eqx.kernels import _vsa

    what, topk = vsa_window(window)
    grid, tile = tuple(args.grid), tuple(args.tile)
    one = single_device_sharding(jax.devices()[0])
    if what == COARSE:
        layout = vsa_layout(args)
        valid, T = layout.token_valid(), layout.tile_size

        def coarse(q, k, v):
            # What `kernels.video_sparse_attention` runs before the fine stage, and its
            # broadcast of out_c; the selection is kept alive through a 0.0 * sum.
            q_c, k_c, v_c = (_vsa.tile_means(x, valid, T) for x in (q, k, v))
            out_c, scores = _vsa.coarse_attention(q_c, k_c, v_c, layout.tile_counts(), q.shape[-1] ** -0.5)
            tiles = _vsa.select_tiles(scores, topk)
            out = _vsa.combine(out_c, jnp.zeros_like(q), None, valid, T)
            return out + lax.stop_gradient(jnp.sum(tiles).astype(out.dtype)) * 0.0

        return coarse, one, None
    if config == "single":

        def attend(q, k, v):
            return kernels.video_sparse_attention(q, k, v, grid, topk=topk, tile=tile, implementation=KERNEL)

        return attend, one, None
    if len(jax.devices()) < args.devices:
        raise NotAvailable(f"needs {args.devices} devices, found {len(jax.devices())}")
    mesh = parallel.make_mesh(sp=args.devices)
    spec = P(None, parallel.SP_AXIS)

    def local(q, k, v):
        return parallel.video_sparse_attention(
            q, k, v, grid, ring_axis=parallel.SP_AXIS, topk=topk, tile=tile, implementation=KERNEL
        )

    attend = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    return attend, NamedSharding(mesh, spec), "contiguous"


def vsa_check_error(args, config: str, window, host_xs, outputs) -> float:
    """VSA rows: largest |difference| over the largest |reference|, against the
    materializing `"xla"` fine stage (single) or the single-device `"blockwise"` call
    on the video's tokens (ring; the ring's padding outputs must be 0)."""
    import numpy as np

    from vidax_eqx import kernels

    what, topk = vsa_window(window)
    layout = vsa_layout(args)
    S = layout.video_len
    outputs = [np.asarray(o, np.float32) for o in (outputs if isinstance(outputs, tuple) else (outputs,))]
    pad = max(float(np.max(np.abs(o[:, S:]), initial=0.0)) for o in outputs) if config != "single" else 0.0
    impl = KERNEL if config != "single" else "xla"

    def attend(q, k, v):
        return kernels.video_sparse_attention(q, k, v, tuple(args.grid), topk=topk, tile=tuple(args.tile),
                                              implementation=impl)

    fn, _ = attention_pass(attend, args.child_pass)
    ref = fn(*[x[:, :S] for x in host_xs])
    ref = [np.asarray(r, np.float32) for r in (ref if isinstance(ref, tuple) else (ref,))]
    err = max(
        float(np.max(np.abs(o[:, :S] - r)) / max(float(np.max(np.abs(r))), 1e-30))
        for o, r in zip(outputs, ref, strict=True)
    )
    return max(err, pad)


def make_inputs(args, seq: int, n: int):
    """`n` random normal NumPy arrays `(B, seq, H, D)`: q, k, v in `--dtype`, then a
    float32 cotangent."""
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (args.batch, seq, args.heads, args.head_dim)
    xs = [rng.standard_normal(shape, dtype=np.float32) for _ in range(n)]
    if args.dtype != "float32":
        import jax.numpy as jnp

        xs[:3] = [np.asarray(jnp.asarray(x, args.dtype)) for x in xs[:3]]
    return xs


def check_error(args, window, layout, host_xs, outputs) -> float:
    """Largest |difference| from a reference over the largest |reference| value, on
    the real tokens (and, for the ring, every padding output must be 0)."""
    import numpy as np

    from vidax_eqx import kernels, parallel

    tm = tile_mask(args, window)
    S = tm.seq_len
    outputs = [np.asarray(o, np.float32) for o in (outputs if isinstance(outputs, tuple) else (outputs,))]
    xs = list(host_xs)
    if layout == "zigzag":  # back to global order
        outputs = [np.asarray(parallel.zigzag_unpermute(o, 1, args.devices)) for o in outputs]
        xs = [np.asarray(parallel.zigzag_unpermute(x, 1, args.devices)) for x in xs]
    pad = max(float(np.max(np.abs(o[:, S:]), initial=0.0)) for o in outputs)
    impl = KERNEL if layout is not None else "xla"  # the ring against one device

    def attend(q, k, v):
        return kernels.attention(q, k, v, mask=tm, implementation=impl)

    fn, _ = attention_pass(attend, args.child_pass)
    ref = fn(*[x[:, :S] for x in xs])
    ref = [np.asarray(r, np.float32) for r in (ref if isinstance(ref, tuple) else (ref,))]
    err = max(
        float(np.max(np.abs(o[:, :S] - r)) / max(float(np.max(np.abs(r))), 1e-30))
        for o, r in zip(outputs, ref, strict=True)
    )
    return max(err, pad)


def child_main(args) -> dict:
    """Measures one row: peak memory of its first run, then its best time."""
    import jax

    config, pass_ = args.child_config, args.child_pass
    if args.child_window == FULL or vsa_window(args.child_window) is not None:
        window = args.child_window
    else:
        window = tuple(map(int, args.child_window.split(",")))
    result = {"status": "ok", "devices": len(jax.devices())}
    try:
        attend, sharding, layout = attention_fn(args, config, window)
    except NotAvailable as e:
        return {"status": str(e)}
    seq = global_len(args, config, window)
    fn, n_in = attention_pass(attend, pass_)
    host_xs = make_inputs(args, seq, n_in)
    xs = jax.block_until_ready([jax.device_put(x, sharding) for x in host_xs])
    t0 = time.perf_counter()
    compiled, temp, out = compile_ahead(fn, xs)
    result.update(seq=seq, compile_s=time.perf_counter() - t0, xla_temp_bytes=temp, xla_output_bytes=out)

    def run():
        return jax.block_until_ready(compiled(*xs))

    first, outputs, peak = run_with_peak(run)
    result["peak_reset"] = peak.reset
    if peak.reset:
        result["peak_above_inputs_bytes"] = peak.above_baseline
    result["first_run_s"] = first.wall
    # A first run longer than --single-run-seconds is the only timed one: the program
    # was compiled ahead of time, so it holds no compilation.
    result.update(best_time(run, args.repeats, target_seconds=args.target_seconds,
                            single_run_seconds=args.single_run_seconds, first=first).fields())
    if window != FULL and seq <= args.check_max_seq:
        if vsa_window(window) is None:
            result["max_rel_err"] = check_error(args, window, layout, host_xs, outputs)
        elif vsa_window(window)[0] != COARSE:
            result["max_rel_err"] = vsa_check_error(args, config, window, host_xs, outputs)
    return result


def child_cmd(args, config: str, window, pass_: str) -> list[str]:
    window_arg = window if isinstance(window, str) else ",".join(map(str, window))
    return [
        "--child",
        "--child-config", config, "--child-window", window_arg, "--child-pass", pass_,
        "--grid", *map(str, args.grid), "--tile", *map(str, args.tile),
        "--batch", str(args.batch), "--heads", str(args.heads),
        "--head-dim", str(args.head_dim), "--dtype", args.dtype, "--devices", str(args.devices),
        "--repeats", str(args.repeats), "--target-seconds", str(args.target_seconds),
        "--single-run-seconds", str(args.single_run_seconds),
        "--check-max-seq", str(args.check_max_seq), "--sta-path", args.sta_path,
    ]  # fmt: skip


def spawn_child(args, config: str, window, pass_: str) -> dict:
    devices = None if config == "single" else args.devices  # set before the child imports JAX
    return run_child(__file__, child_cmd(args, config, window, pass_), devices=devices).record()


# --------------------------------------------------------------------------- #
# The run
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Row:
    config: str
    window: str
    pass_: str
    seq: int | None = None
    density: float | None = None
    blocks: float | None = None
    blocks_computed: int | None = None
    blocks_total: int | None = None
    status: str = "ok"
    time_s: float | None = None
    runs: int | None = None
    cpu_s: float | None = None
    ratio: float | None = None
    cpu_ratio: float | None = None
    target: float | None = None
    passed: bool | None = None
    cpu_passed: bool | None = None
    peak_above_inputs_mb: float | None = None
    xla_temp_mb: float | None = None
    compile_s: float | None = None
    max_rel_err: float | None = None
    note: str = ""
    # VSA rows
    grid: list | None = None
    topk: int | None = None
    n_tiles: int | None = None
    coarse_s: float | None = None  # the coarse stage + selection alone, same pass
    coarse_share: float | None = None  # coarse_s / this row's time
    coarse_of_full: float | None = None  # coarse_s / full attention's time


def _mb(x) -> float | None:
    return None if x is None else x / 2**20


def _gb(x) -> float | None:
    return None if x is None else x / 2**30


def _window_name(window) -> str:
    return FULL if window == FULL else "x".join(map(str, window))


def run(args) -> tuple[list[Row], dict]:
    import jax

    real = math.prod(args.grid)
    tm0 = tile_mask(args, args.windows[0])
    info = {
        "date": now(),
        "command": command_line(__file__),
        "git": git_state(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "mem_gb": _gb(meminfo("MemTotal")),
        "grid": list(args.grid),
        "tile": list(args.tile),
        "tiles": list(tm0.tiles),
        "tile_size": tm0.tile_size,
        "real_tokens": real,
        "B": args.batch,
        "H": args.heads,
        "D": args.head_dim,
        "dtype": args.dtype,
        "devices": args.devices,
        "jax_nn_logits_gb": args.batch * args.heads * real**2 * 4 / 1e9,
    }
    log(f"# {info}")
    t_start = time.perf_counter()
    rows: list[Row] = []
    for config in args.configs:
        for pass_ in args.passes:
            base = None
            # One unmasked ring baseline (contiguous) serves both ring layouts.
            base_config = "single" if config == "single" else "ring-contiguous"
            for window in [FULL, *args.windows]:
                row = Row(config if window != FULL else ("single" if config == "single" else "ring"),
                          _window_name(window), pass_)
                if window == FULL:
                    key = (base_config, pass_, tuple(args.grid))
                    if key in args._baselines:  # measured for the other ring layout (or VSA)
                        base = args._baselines[key]
                        if base is not None and base.grid is not None:  # VSA's: shown here too
                            rows.append(dataclasses.replace(base, grid=None, n_tiles=None, note="; ".join(
                                filter(None, (base.note, "measured for the VSA rows of this run")))))
                        continue
                    r = spawn_child(args, base_config, FULL, pass_)
                    row.density = 1.0
                else:
                    tm = tile_mask(args, window)
                    row.density = tm.density()
                    row.blocks, row.blocks_computed, row.blocks_total = block_fraction(args, config, window)
                    row.target = target(row.density)
                    r = spawn_child(args, config, window, pass_)
                row.status = r["status"]
                row.seq = r.get("seq")
                row.time_s, row.runs, row.cpu_s = r.get("time_s"), r.get("runs"), r.get("cpu_s")
                row.peak_above_inputs_mb = _mb(r.get("peak_above_inputs_bytes"))
                row.xla_temp_mb = _mb(r.get("xla_temp_bytes"))
                row.compile_s = r.get("compile_s")
                row.max_rel_err = r.get("max_rel_err")
                row.note = r.get("note", "")
                if r.get("peak_reset") is False:
                    row.note = "; ".join(filter(None, (row.note, "peak not measured")))
                if window == FULL:
                    base = row if row.time_s is not None else None
                    args._baselines[(base_config, pass_, tuple(args.grid))] = base
                    if base is not None:
                        row.ratio = row.cpu_ratio = 1.0
                        single = args._baselines.get(("single", pass_, tuple(args.grid)))
                        if config != "single" and single is not None:
                            row.note = "; ".join(filter(None, (
                                row.note, f"{row.time_s / single.time_s:.2f}x single full")))
                elif row.time_s is not None and base is not None:
                    row.ratio = row.time_s / base.time_s
                    row.cpu_ratio = row.cpu_s / base.cpu_s
                    row.passed = row.ratio <= row.target
                    row.cpu_passed = row.cpu_ratio <= row.target
                rows.append(row)
                elapsed = time.perf_counter() - t_start
                if row.time_s is not None:
                    summary = (
                        f"{row.time_s:.3f} s ({_runs(row)}), ratio {fmt(row.ratio, '.3f')} "
                        f"(target {fmt(row.target, '.3f')}), cpu ratio {fmt(row.cpu_ratio, '.3f')}, "
                        f"peak {fmt(row.peak_above_inputs_mb, '.0f')} MB, "
                        f"temp {fmt(row.xla_temp_mb, '.0f')} MB, compile {fmt(row.compile_s, '.1f')} s"
                        + ("" if row.max_rel_err is None else f", err {row.max_rel_err:.1e}")
                    )
                else:
                    summary = f"{row.status} {row.note}"
                log(f"{row.config} {row.window} {pass_} S={row.seq}: {summary}  [{elapsed:.0f} s]")
    info["seconds"] = round(time.perf_counter() - t_start, 1)
    git_end = git_state()
    if git_end != info["git"]:
        info["git"] += f" at the start, {git_end} at the end"
    return rows, info


def _fill(row: Row, r: dict) -> None:
    row.status = r["status"]
    row.seq = r.get("seq")
    row.time_s, row.runs, row.cpu_s = r.get("time_s"), r.get("runs"), r.get("cpu_s")
    row.peak_above_inputs_mb = _mb(r.get("peak_above_inputs_bytes"))
    row.xla_temp_mb = _mb(r.get("xla_temp_bytes"))
    row.compile_s = r.get("compile_s")
    row.max_rel_err = r.get("max_rel_err")
    row.note = r.get("note", "")
    if r.get("peak_reset") is False:
        row.note = "; ".join(filter(None, (row.note, "peak not measured")))


def _log_row(row: Row, t_start: float) -> None:
    elapsed = time.perf_counter() - t_start
    if row.time_s is not None:
        summary = (
            f"{row.time_s:.3f} s ({_runs(row)}), ratio {fmt(row.ratio, '.3f')} "
            f"(target {fmt(row.target, '.3f')}), cpu ratio {fmt(row.cpu_ratio, '.3f')}, "
            f"peak {fmt(row.peak_above_inputs_mb, '.0f')} MB, temp {fmt(row.xla_temp_mb, '.0f')} MB"
            + ("" if row.max_rel_err is None else f", err {row.max_rel_err:.1e}")
        )
    else:
        summary = f"{row.status} {row.note}"
    log(f"{row.config} {row.grid} {row.window} {row.pass_} S={row.seq}: {summary}  [{elapsed:.0f} s]")


def run_vsa(args) -> tuple[list[Row], dict]:
    """VSA rows: per grid, configuration and pass, full attention (the baseline),
    then per density the coarse stage alone (single device) and VSA."""
    import jax

    info = {
        "date": now(), "command": command_line(__file__), "git": git_state(), "jax": jax.__version__,
        "backend": jax.default_backend(), "cpu": cpu_model(), "cpus": os.cpu_count(),
        "mem_gb": _gb(meminfo("MemTotal")), "grids": [list(g) for g in args.vsa_grids],
        "tile": list(args.tile), "B": args.batch, "H": args.heads, "D": args.head_dim,
        "dtype": args.dtype, "devices": args.devices, "densities": list(args.densities),
    }
    log(f"# {info}")
    t_start = time.perf_counter()
    rows: list[Row] = []
    for grid in args.vsa_grids:
        args.grid = list(grid)
        n_tiles = vsa_layout(args).n_tiles
        for config in args.vsa_configs:
            if config != "single" and args.vsa_ring_max_tokens and math.prod(grid) > args.vsa_ring_max_tokens:
                continue
            for pass_ in args.passes:
                key = (config, pass_, tuple(grid))
                base = args._baselines.get(key)
                if key not in args._baselines:
                    row = Row("single" if config == "single" else "ring", FULL, pass_, grid=list(grid),
                              density=1.0, n_tiles=n_tiles)
                    _fill(row, spawn_child(args, config, FULL, pass_))
                    base = row if row.time_s is not None else None
                    args._baselines[key] = base
                    if base is not None:
                        row.ratio = row.cpu_ratio = 1.0
                    rows.append(row)
                    _log_row(row, t_start)
                for d in args.densities:
                    topk = vsa_topk(args, d)
                    coarse = None
                    if config == "single":
                        coarse = Row("single", f"{COARSE}:{topk}", pass_, grid=list(grid), topk=topk,
                                     n_tiles=n_tiles, density=topk / n_tiles)
                        _fill(coarse, spawn_child(args, config, coarse.window, pass_))
                        if coarse.time_s is not None and base is not None:
                            coarse.ratio = coarse.time_s / base.time_s
                            coarse.cpu_ratio = coarse.cpu_s / base.cpu_s
                        rows.append(coarse)
                        _log_row(coarse, t_start)
                    row = Row(config, f"topk:{topk}", pass_, grid=list(grid), topk=topk, n_tiles=n_tiles,
                              density=topk / n_tiles)
                    _fill(row, spawn_child(args, config, row.window, pass_))
                    if row.time_s is not None and base is not None:
                        row.ratio = row.time_s / base.time_s
                        row.cpu_ratio = row.cpu_s / base.cpu_s
                        row.target = target(row.density)
                        if coarse is not None and coarse.time_s is not None:
                            row.coarse_s = coarse.time_s
                            row.coarse_share = coarse.time_s / row.time_s
                            row.coarse_of_full = coarse.time_s / base.time_s
                            row.target += row.coarse_of_full
                        row.passed = row.ratio <= row.target
                        row.cpu_passed = row.cpu_ratio <= row.target
                    rows.append(row)
                    _log_row(row, t_start)
    info["seconds"] = round(time.perf_counter() - t_start, 1)
    git_end = git_state()
    if git_end != info["git"]:
        info["git"] += f" at the start, {git_end} at the end"
    return rows, info


def markdown_vsa(rows: list[Row], info: dict) -> str:
    mem = "" if info["mem_gb"] is None else f", {info['mem_gb']:.0f} GiB"
    judged = [r for r in rows if r.passed is not None]
    t = info["tile"]
    lines = [
        f"Video sparse attention, tile {t[0]} x {t[1]} x {t[2]}; B={info['B']}, H={info['H']}, "
        f"D={info['D']}, {info['dtype']}; fine stage `\"{KERNEL}\"` (gathers the selected key tiles).",
        "",
        f"Machine: {info['cpu']}, {info['cpus']} CPUs{mem} (shared: wall times are noisy); jax "
        f"{info['jax']} ({info['backend']}); {info['date']}; total run time {info['seconds']:.0f} s; "
        f"vidax_eqx at {info['git']}.",
        "",
        f"Command: `{info['command']}`",
        "",
        "Baselines (`full`): `kernels.attention(implementation=\"blockwise\")` without a mask on the "
        "grid's real tokens (ring: the unmasked contiguous ring on the same devices). VSA runs on the "
        "tile layout (partial tiles padded; ring: padded with empty tiles to whole tiles per device), "
        "its ratio is to the baseline over the real tokens. `density` = topk / tiles. `coarse` rows: "
        "the tile means, the coarse attention, the top-k selection and out_c's broadcast alone (same "
        "pass); `coarse / full` is added to the target: `time / full <= 1.25 x density + 0.05 + "
        "coarse / full` (ring rows: without the coarse term, not measured on the ring).",
        "",
        f"Verdict: {sum(r.passed for r in judged)} of {len(judged)} VSA rows meet the target on wall "
        f"time, {sum(bool(r.cpu_passed) for r in judged)} of {len(judged)} on CPU time.",
        "",
        "| config | grid | S | tiles | row | density | pass | time (s) | timed runs | time / full | "
        "CPU time / full | coarse / VSA | coarse / full | target | verdict (wall) | verdict (CPU) | "
        "cores busy | peak RSS above inputs (MB) | XLA temp (MB) | max rel err | note |",
        "|---|---|---:|---:|---|---:|---|---:|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        time_cell = fmt(r.time_s, ".3f") if r.status == "ok" else r.status
        busy = None if r.time_s is None or r.cpu_s is None else r.cpu_s / r.time_s
        g = "x".join(map(str, r.grid)) if r.grid else "–"
        lines.append(
            f"| {r.config} | {g} | {fmt(r.seq, ',')} | {fmt(r.n_tiles, ',')} | {r.window} | "
            f"{fmt(r.density, '.3f')} | {r.pass_} | {time_cell} | "
            f"{_runs(r) if r.time_s is not None else '–'} | {fmt(r.ratio, '.3f')} | "
            f"{fmt(r.cpu_ratio, '.3f')} | {fmt(r.coarse_share, '.3f')} | {fmt(r.coarse_of_full, '.3f')} | "
            f"{fmt(r.target, '.3f')} | {_verdict(r.passed)} | {_verdict(r.cpu_passed)} | {fmt(busy, '.2f')} | "
            f"{fmt(r.peak_above_inputs_mb, '.0f')} | {fmt(r.xla_temp_mb, '.0f')} | "
            f"{fmt(r.max_rel_err, '.1e')} | {r.note} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- #
# Output
# --------------------------------------------------------------------------- #


def _runs(row: Row) -> str:
    if "first run" in row.note:
        return "first run only"
    return f"best of {row.runs}"


def _verdict(passed: bool | None) -> str:
    return "–" if passed is None else ("PASS" if passed else "FAIL")


def markdown(rows: list[Row], info: dict) -> str:
    g, t, n = info["grid"], info["tile"], info["tiles"]
    mem = "" if info["mem_gb"] is None else f", {info['mem_gb']:.0f} GiB"
    judged = [r for r in rows if r.passed is not None]
    lines = [
        f"Grid {g[0]} x {g[1]} x {g[2]} = {info['real_tokens']:,} tokens, tile {t[0]} x {t[1]} x {t[2]} "
        f"({info['tile_size']} tokens; {n[0]} x {n[1]} x {n[2]} tiles); B={info['B']}, H={info['H']}, "
        f"D={info['D']}, {info['dtype']}; kernel `\"{KERNEL}\"` throughout.",
        "",
        f"Machine: {info['cpu']}, {info['cpus']} CPUs{mem} (shared with other jobs: wall times "
        f"are noisy); jax {info['jax']} ({info['backend']}); {info['date']}; total run time "
        f"{info['seconds']:.0f} s; vidax_eqx at {info['git']}.",
        "",
        f"Command: `{info['command']}`",
        "",
        "Baselines (`full`): `kernels.attention(implementation=\"blockwise\")` without a mask on "
        f"the {info['real_tokens']:,} real tokens (default blocks), and for the ring rows the "
        f"ring without a mask (contiguous) on the same {info['devices']} simulated devices. "
        "`jax.nn.dot_product_attention` is not the baseline: its XLA path would materialize "
        f"the (B, H, S, S) float32 logits, {info['jax_nn_logits_gb']:.1f} GB at this size. "
        "Masked rows run on the tile layout (ring: padded to whole tiles per device; padding "
        "is invisible), and their ratio is to the baseline over the real tokens. `density` = "
        "`tm.density()` over real tokens; `blocks` = the fraction of (query block, key block) "
        "pairs the kernel computes (`block_map` over the sequence it sees, padding included). "
        "Target: `time / full <= 1.25 x density + 0.05`, judged on wall time and, separately, "
        "on process CPU time (all threads), which other load on a shared machine disturbs far "
        "less. `cores busy` = CPU time / wall time of the timed run. Peak RSS above the "
        "inputs includes the outputs (ring: all devices, one process); XLA temp is per device.",
        "",
        f"Verdict: {sum(r.passed for r in judged)} of {len(judged)} masked rows meet the target "
        f"on wall time, {sum(bool(r.cpu_passed) for r in judged)} of {len(judged)} on CPU time.",
        "",
        "| config | window | S | density | blocks | pass | time (s) | timed runs | time / full | "
        "CPU time / full | target | verdict (wall) | verdict (CPU) | cores busy | "
        "peak RSS above inputs (MB) | XLA temp (MB) | max rel err | note |",
        "|---|---|---:|---:|---:|---|---:|---|---:|---:|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        time_cell = fmt(r.time_s, ".3f") if r.status == "ok" else r.status
        busy = None if r.time_s is None or r.cpu_s is None else r.cpu_s / r.time_s
        lines.append(
            f"| {r.config} | {r.window} | {fmt(r.seq, ',')} | {fmt(r.density, '.3f')} | "
            f"{fmt(r.blocks, '.3f')} | {r.pass_} | {time_cell} | "
            f"{_runs(r) if r.time_s is not None else '–'} | {fmt(r.ratio, '.3f')} | "
            f"{fmt(r.cpu_ratio, '.3f')} | {fmt(r.target, '.3f')} | {_verdict(r.passed)} | "
            f"{_verdict(r.cpu_passed)} | {fmt(busy, '.2f')} | "
            f"{fmt(r.peak_above_inputs_mb, '.0f')} | {fmt(r.xla_temp_mb, '.0f')} | "
            f"{fmt(r.max_rel_err, '.1e')} | {r.note} |"
        )
    return "\n".join(lines)


def load_json(path: str) -> tuple[list[Row], dict]:
    """The rows and run info of a JSON this script wrote (for `--render`)."""
    with open(path) as f:
        data = json.load(f)
    names = {fl.name for fl in dataclasses.fields(Row)}
    rows = [Row(**{k: v for k, v in r.items() if k in names}) for r in data["rows"]]
    for r in rows:
        if r.cpu_passed is None and r.cpu_ratio is not None and r.target is not None:
            r.cpu_passed = r.cpu_ratio <= r.target
    return rows, data["info"]


def write_outputs(args, rows: list[Row], info: dict, table: str) -> None:
    title = "Video sparse attention" if "grids" in info else "Sliding tile attention"
    if args.md:
        write_text(args.md, f"# {title}: time against density\n\n" + table + "\n")
        log(f"# wrote {os.path.relpath(args.md)}")
    if args.json:
        write_json(args.json, {"info": info, "rows": [dataclasses.asdict(r) for r in rows]})
        log(f"# wrote {os.path.relpath(args.json)}")


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


def _window(text: str) -> tuple[int, int, int]:
    parts = text.replace("x", ",").split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"a window is three odd ints, e.g. 3,5,1; received {text!r}")
    return tuple(int(p) for p in parts)


def parse_args(argv=None):
    rel = os.path.relpath
    p = argparse.ArgumentParser(
        description="Time and peak memory of sliding tile attention against full attention, "
        "per window density, single device and ring; each row in a fresh process. Prints a "
        "Markdown table and writes it (and JSON) under benchmarks/results."
    )
    p.add_argument("--kind", choices=KINDS, nargs="+", default=["sta"],
                   help="sta: sliding tile attention rows (default); vsa: video sparse attention rows; "
                   "both: VSA first, then STA, sharing the baselines of equal size "
                   f"(grids {' '.join(','.join(map(str, g)) for g in VSA_GRIDS)}, tile {VSA_TILE}, "
                   f"densities {VSA_DENSITIES}; output {rel(VSA_MD)})")
    p.add_argument("--vsa-grids", type=_window, nargs="+", default=None, metavar="F,H,W",
                   help="VSA: token grids")
    p.add_argument("--densities", type=float, nargs="+", default=list(VSA_DENSITIES),
                   help="VSA: densities topk / tiles (default %(default)s)")
    p.add_argument("--vsa-configs", nargs="+", default=list(VSA_CONFIGS), choices=VSA_CONFIGS,
                   help="VSA: configurations (default: all)")
    p.add_argument("--vsa-ring-max-tokens", type=int, default=None,
                   help="VSA: ring rows only for grids of at most this many tokens (default: all)")
    p.add_argument("--sta-path", choices=("table", "loop"), default="table",
                   help="STA single-device rows: the static-table path (default) or the "
                   "tile-pair loop (`Blockwise(sta_table=False)`, for comparison)")
    p.add_argument("--grid", type=int, nargs=3, default=None, metavar=("F", "H", "W"),
                   help=f"token grid (default {DEFAULT_GRID})")
    p.add_argument("--tile", type=int, nargs=3, default=None, metavar=("TF", "TH", "TW"),
                   help=f"tile in tokens (default {DEFAULT_TILE})")
    p.add_argument("--windows", type=_window, nargs="+", default=None, metavar="WF,WH,WW",
                   help="windows in tiles (default " + " ".join(",".join(map(str, w)) for w in DEFAULT_WINDOWS) + ")")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                   help="configurations (default: all)")
    p.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES,
                   help="passes (default: both)")
    p.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    p.add_argument("--heads", type=int, default=8, help="heads H (default 8)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim D (default 64)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of q, k, v (default float32)")
    p.add_argument("--devices", type=int, default=N_DEVICES,
                   help=f"simulated CPU devices of the ring (default {N_DEVICES})")
    p.add_argument("--repeats", type=int, default=3,
                   help="most timed runs per row after the warm-up (default 3)")
    p.add_argument("--target-seconds", type=float, default=30.0,
                   help="fewer timed runs (at least one) when they would take longer than "
                   "this many seconds (default 30)")
    p.add_argument("--single-run-seconds", type=float, default=30.0,
                   help="a row whose first run takes longer than this is timed on that run "
                   "alone (default 30)")
    p.add_argument("--check-max-seq", type=int, default=None,
                   help="check masked rows against a reference up to this global length "
                   "(default: 4160 with --quick, else 0 = never)")
    p.add_argument("--md", default=None, help=f"Markdown output (default {rel(DEFAULT_MD)}; "
                   "none with --quick)")
    p.add_argument("--json", default=None, help=f"JSON output (default {rel(DEFAULT_JSON)}; "
                   "none with --quick)")
    p.add_argument("--render", metavar="JSON", default=None,
                   help="measure nothing: print (and write to --md) the table of a JSON this "
                   "script wrote")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: grid {QUICK_GRID}, tile {QUICK_TILE}, windows "
                   + " ".join(",".join(map(str, w)) for w in QUICK_WINDOWS) + ", 2 repeats")
    # Hidden: measure one row in this (fresh) process; used by the parent.
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-config", choices=CONFIGS, help=argparse.SUPPRESS)
    p.add_argument("--child-window", help=argparse.SUPPRESS)
    p.add_argument("--child-pass", choices=PASSES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    vsa = "vsa" in args.kind and not args.child
    if vsa:
        args.vsa_grids = args.vsa_grids or list(QUICK_VSA_GRIDS if args.quick else VSA_GRIDS)
        args.tile = args.tile or list(VSA_TILE)
        args.vsa_md = (VSA_MD if not args.quick else "") if args.md is None else args.md
        args.vsa_json = (VSA_JSON if not args.quick else "") if args.json is None else args.json
        if "sta" in args.kind:  # --md / --json name the VSA files; STA's keep their defaults
            args.md = args.json = None
        else:
            args.md, args.json = args.vsa_md, args.vsa_json
    sta_tile = args.tile if not vsa else None
    if args.quick:
        args.grid = args.grid or list(QUICK_GRID)
        args.tile = args.tile or list(QUICK_TILE)
        args.windows = args.windows or list(QUICK_WINDOWS)
        args.repeats = min(args.repeats, 2)
        args.md = args.md or ""  # stdout only, unless asked
        args.json = args.json or ""
        if args.check_max_seq is None:
            args.check_max_seq = 4160
    args.grid = args.grid or list(DEFAULT_GRID)
    args.sta_grid = list(args.grid)
    args.sta_tile = sta_tile or (list(QUICK_TILE) if args.quick else list(DEFAULT_TILE))
    args.tile = args.tile or list(DEFAULT_TILE)
    args.windows = args.windows or list(DEFAULT_WINDOWS)
    args.md = DEFAULT_MD if args.md is None else args.md
    args.json = DEFAULT_JSON if args.json is None else args.json
    if args.check_max_seq is None:
        args.check_max_seq = 0
    args._baselines = {}
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        emit(child_main(args))
        return 0
    if args.render:
        rows, info = load_json(args.render)
        table = markdown_vsa(rows, info) if "grids" in info else markdown(rows, info)
        print(table)
        args.json = ""  # the JSON is the source, left as it is
        write_outputs(args, rows, info, table)
        return 0
    failed_vsa = False
    if "vsa" in args.kind:
        rows, info = run_vsa(args)
        table = markdown_vsa(rows, info)
        print(table)
        md, js = args.md, args.json
        args.md, args.json = args.vsa_md, args.vsa_json
        write_outputs(args, rows, info, table)
        args.md, args.json = md, js
        log(f"# done after {info['seconds']:.0f} s")
        failed_vsa = any(r.status.startswith("error") for r in rows)
        if "sta" not in args.kind:
            return int(failed_vsa)
        args.grid, args.tile = list(args.sta_grid), list(args.sta_tile)
        args.md = DEFAULT_MD if args.md is None else args.md
        args.json = DEFAULT_JSON if args.json is None else args.json
    for w in args.windows:  # fail early on a bad window
        tile_mask(args, w)
    rows, info = run(args)
    table = markdown(rows, info)
    print(table)
    write_outputs(args, rows, info, table)
    log(f"# done after {info['seconds']:.0f} s")
    failed = [r for r in rows if r.status.startswith("error")]
    for r in failed:
        log(f"# {r.config} {r.window} {r.pass_}: {r.status}: {r.note}")
    return 1 if failed or failed_vsa else 0


if __name__ == "__main__":
    sys.exit(main())
