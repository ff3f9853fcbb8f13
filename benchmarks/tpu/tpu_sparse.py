"""Sparse attention on a TPU against dense attention over the same tokens: video sparse
attention (VSA) with the tile-gathering fine stage and with the per-tile one, sliding
tile attention (STA) through splash and through the tile-gathering kernels, and
frame-block causal attention (BC) through splash.

On the TPU machine, from the checkout (after the install line of
`../shared/tpu/README.md`):

    python3 benchmarks/tpu/tpu_sparse.py --budget 200 --out DIR  # every row, in order, for ~4 min
    python3 benchmarks/tpu/tpu_sparse.py --quick --out DIR       # VSA and STA's first grid (~5 min)
    python3 benchmarks/tpu/tpu_sparse.py --section STA --out DIR # one section's rows (VSA, STA, BC or TUNE)
    python3 benchmarks/tpu/tpu_sparse.py --section STA --rows 'gather$' --profile --out DIR
        # the rows whose "problem path" matches a regular expression (with their dense
        # rows), and each pass's slowest device ops (a jax.profiler trace)
    python3 benchmarks/tpu/tpu_sparse.py --out DIR               # every row (about 10 min)
    python3 benchmarks/tpu/tpu_sparse.py --smoke --out DIR       # tiny shapes, interpret mode, CPU

and, on a host without a TPU but with libtpu (`pip install --target DIR "libtpu==0.0.42.*"`,
the release JAX 0.10.2 pins; `PYTHONPATH=DIR ALLOW_MULTIPLE_LIBTPU_LOAD=1
TPU_SKIP_MDS_QUERY=1`), `--compile-only v5e:1x1 [--quick]` compiles every row for that
TPU ahead of time and runs none: Mosaic's verdict (scoped VMEM, unsupported operations).

Problems (B = 1, 12 heads of 128 as Wan 2.1 1.3B, bfloat16; inputs random), in the
order they run:

- **VSA**: Wan 480p's token grid (24, 32, 52) (39,936 tokens) in tiles of 4 x 4 x 4,
  `kernels.video_sparse_attention(..., implementation="pallas_tpu")` (coarse stage
  included) at sparsity 0.9, then 0.75: `gather` (the tile-gathering kernels,
  `_gather.py`, what `PallasTpu` runs now) and `per-tile` (the per-tile kernels
  of `_per_tile`, forced by a VMEM budget of 0 while tracing; last of all, they
  are slow); with them VSA's stages apart (the fine stage at both sparsities, the coarse
  ones at 0.9): the coarse stage to its scores, then with the top-k selection (forward
  only); the fine stage alone on the selection of these inputs (a constant of the program);
- **STA**: `SlidingTileMask(grid, tile, (3, 3, 3))`: `splash` (`kernels.attention(q,
  k, v, mask=tm)`, today's dispatch) and `gather`
  (`_sliding.sliding_tile_attention`), on the grid (24, 32, 64) in tiles of
  256 then 128 tokens ((4, 8, 8), (2, 8, 8));
- the gathering kernels' knobs on the fine stage alone at sparsity 0.9 (chunks gathered
  through a VMEM copy, as before `GATHER = "load"`; full rows unrolled, `UNROLL`, with 2
  and 4 chains; `CHAINS = 4`; chunks of 512 keys, as before `KV_KEYS_FWD` /
  `KV_KEYS_BWD`; the selection sorted by tile index);
- STA: the issue's (3, 6, 4) on (21, 30, 52), tiles of 512 tokens (4, 8, 16) on (24, 32,
  64), and 720p's grid (24, 48, 80) in all three tile sizes;
- **BC**: `BlockCausalMask(grid, frames_per_block)` on Wan 480p's grid (21, 30, 52)
  (32,760 tokens): blocks of 1 frame (21 blocks, density 0.52), of 3 frames (7 blocks,
  SkyReels-V2's `causal_block_size`, density 0.57), blocks of 1 frame in a rolling window
  of 6 blocks (density 0.24); with `kernels.attention(causal=True)` over the same tokens
  (token-causal, density 0.50) for comparison;
- **TUNE** (`--section TUNE`, last in a full run): the gathering kernels' chunk widths:
  VSA whole at both sparsities and its fine stage alone with the defaults and with other
  `KV_KEYS_BWD` / `CHAINS`; sliding tile attention at the issue's 72-token tiles (the
  defaults, and 1, 2 or 8 query tiles a step of the forward and dQ passes, `ROWS`), in
  128-token tiles on (24, 32, 64) (defaults: the whole window in one forward chunk; and
  in two, `KV_KEYS_WHOLE = 0`) and
  on 720p's grid;
- **dense**: `kernels.attention(q, k, v)` (the default implementation) over the same
  number of tokens, first for each problem size: the ratios' denominator.

`--quick` runs VSA's rows (not the per-tile ones, which run last), STA on the first grid and
the knobs. Each row: forward (`fwd`) and forward+backward
(`fwd+bwd`: the gradients of `sum(out * cotangent)` in q, k and v), compiled ahead of
time, then timed as the best of `--reps` (3) measurements of `n` calls issued back to
back (asynchronous dispatch; `n` from the first call's time), divided by `n`. A
gathering row also reports the largest difference of its outputs (out; dq, dk, dv) from
its reference's (per-tile VSA at the same selection; splash for STA), relative to the
reference's largest value: a check that the kernels compute the same thing on the chip.

No row starts once `--budget` seconds are spent (default: 150 with `--quick`, else
1,500); the rows not run are listed. The table goes to stdout and `DIR/tpu_sparse.md`,
every row (with compile times) to `DIR/tpu_sparse.json`; the exit status is 1 if a row
failed.
"""

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import re
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the shared harness
import _harness as h  # noqa: E402  (puts this checkout first on sys.path)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from vidax_eqx import kernels  # noqa: E402
from vidax_eqx.kernels.pallas_tpu import _gather_plan, _sliding  # noqa: E402
from vidax_eqx.kernels import _vsa as _vsa_internal  # noqa: E402


BF16 = jnp.bfloat16
HEADS, HEAD_DIM = 12, 128
VSA_GRID, VSA_TILE = (24, 32, 52), (4, 4, 4)
STA_GRIDS = ((24, 32, 64), (24, 48, 80))
STA_TILES = ((2, 8, 8), (4, 8, 8), (4, 8, 16))
STA_ISSUE = ((21, 30, 52), (3, 6, 4))
BC_GRID = (21, 30, 52)
BC_MASKS = ((1, None), (3, None), (1, 6))  # (frames_per_block, window)
WINDOW = (3, 3, 3)
QUICK = 5  # the rows of `--quick`: VSA, its knobs, STA on the first grid in tiles of 128 and 256


@dataclasses.dataclass
class Case:
    """One row: a named function of `(q, k, v)` over `S` tokens."""

    section: str  # "VSA" | "STA" | "BC"
    problem: str  # the grid, tile (and sparsity)
    path: str  # "dense", "gather", "per-tile", "splash", ...
    S: int
    attend: object  # (q, k, v) -> out
    density: float | None = None
    reference: str | None = None  # the path (same problem) whose outputs this row is compared with
    patch: dict = dataclasses.field(default_factory=dict)  # module attributes set while tracing
    priority: int = 0  # rows run in increasing priority; `--quick`: those up to `QUICK`
    knob: bool = False  # a tuning variant (not part of `--smoke`)
    fwd_only: bool = False  # `attend` returns a tuple of outputs (a stage of VSA): no backward


@contextlib.contextmanager
def _patched(attrs: dict):
    """`_gather_plan`'s attributes (the tile-gathering kernels' knobs) set to `attrs` for
    the block (the kernels choose their plan while they are traced)."""
    old = {k: getattr(_gather_plan, k) for k in attrs}
    for k, v in attrs.items():
        setattr(_gather_plan, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(_gather_plan, k, v)


# -- the cases -----------------------------------------------------------------------------


def _vsa(grid, tile, sparsity, impl):
    return lambda q, k, v: kernels.video_sparse_attention(q, k, v, grid, sparsity=sparsity, tile=tile,
                                                          implementation=impl)


def _sta_splash(tm, impl):
    return lambda q, k, v: kernels.attention(q, k, v, mask=tm, implementation=impl)


def _sta_gather(tm, interpret):
    return lambda q, k, v: _sliding.sliding_tile_attention(q, k, v, tm, interpret=interpret)[0]


def _dense(**options):
    return lambda q, k, v: kernels.attention(q, k, v, **options)


def _vsa_stage(grid, tile, sparsity, upto: str):
    """VSA's coarse stage alone, `upto` `"scores"` (tile means, coarse attention) or
    `"top-k"` (and the selection): a tuple of what it hands on, so nothing is dropped."""
    vsa = kernels.internal.VsaLayout(grid, tile)

    def stage(q, k, v):
        valid, T = vsa.token_valid(), vsa.tile_size
        q_c, k_c, v_c = (_vsa_internal.tile_means(x, valid, T) for x in (q, k, v))
        out_c, scores = _vsa_internal.coarse_attention(q_c, k_c, v_c, vsa.tile_counts(), q.shape[-1] ** -0.5)
        if upto == "scores":
            return out_c, scores
        return out_c, _vsa_internal.select_tiles(scores, vsa.topk(None, sparsity))

    return stage


@functools.lru_cache(maxsize=None)
def _selection(grid, tile, sparsity, smoke: bool) -> np.ndarray:
    """VSA's selection `(B, H, n_q_tiles, topk)` for the inputs `_inputs` makes, computed
    once per problem (outside the timed programs)."""
    with jax.ensure_compile_time_eval():
        q, k, v, _ = _inputs(kernels.internal.VsaLayout(grid, tile).video_len, smoke)
        return np.asarray(jax.jit(_vsa_stage(grid, tile, sparsity, "top-k"))(q, k, v)[1])


def _vsa_fine(grid, tile, sparsity, impl, smoke: bool, order: str = "top-k"):
    """VSA's fine stage alone on `_selection` (a constant of the program): `order`
    `"top-k"` as selected, `"sorted"` by tile index."""
    vsa = kernels.internal.VsaLayout(grid, tile)

    def fine(q, k, v):
        tiles = _selection(grid, tile, sparsity, smoke)
        tiles = np.sort(tiles, axis=-1) if order == "sorted" else tiles
        valid = jnp.asarray(vsa.token_valid())
        return _vsa_internal.sparse_attention(q, k, v, jnp.asarray(tiles), valid, tile_size=vsa.tile_size,
                                              scale=q.shape[-1] ** -0.5, implementation=impl)[0]

    return fine


_MiB = 2**20
# Tile variants for the frame-causal mask (`--section BC`, after its main rows).
BC_TILES = tuple(
    (label, kernels.SplashBlocks(q, kv, c, block_q_dkv=qd, block_kv_dkv=kd, block_kv_dkv_compute=512,
                                 block_q_dq=qd, block_kv_dq=kd, fused_bwd=True, vmem_limit_bytes=64 * _MiB))
    for label, (q, kv, c, qd, kd) in (
        ("q1024 kv1024/512 bwd1024/1024", (1024, 1024, 512, 1024, 1024)),
        ("q512 kv1024/512 bwd512/1024", (512, 1024, 512, 512, 1024)),
        ("q1024 kv2048/1024 bwd1024/1024", (1024, 2048, 1024, 1024, 1024)),
        ("q2048 kv2048/1024 bwd1024/2048", (2048, 2048, 1024, 1024, 2048)),
        ("q512 kv2048/512 bwd512/2048", (512, 2048, 512, 512, 2048)),
    ))


def cases(args) -> list[Case]:
    """The rows of this run, most important first."""
    if args.smoke:
        tpu, interpret = kernels.PallasTpu(interpret=True), True
        vsa_grid, vsa_tile, sparsities = (4, 6, 8), (2, 2, 2), (0.75,)
        sta = [((3, 4, 8), (1, 2, 2), 3)]
        bc_grid, bc_masks = (3, 8, 16), ((1, None),)
    else:
        bc_grid, bc_masks = BC_GRID, BC_MASKS
        tpu, interpret = "pallas_tpu", False
        vsa_grid, vsa_tile, sparsities = VSA_GRID, VSA_TILE, (0.9, 0.75)
        # (grid, tile, priority): the first grid in tiles of 256 and 128 tokens first.
        sta = [(STA_GRIDS[0], (4, 8, 8), 3), (STA_GRIDS[0], (2, 8, 8), 4), (*STA_ISSUE, 6),
               (STA_GRIDS[0], (4, 8, 16), 6)] + [(STA_GRIDS[1], t, 7) for t in STA_TILES]
    layout = kernels.internal.VsaLayout(vsa_grid, vsa_tile)
    S = layout.video_len
    rows = [Case("VSA", f"{vsa_grid}", "dense", S, _dense(), priority=0)]
    for i, sp in enumerate(sparsities):
        name, density = f"{vsa_grid} tile {vsa_tile} sparsity {sp}", layout.topk(None, sp) / layout.n_tiles
        # A function object per row: `jax.jit` caches traces by function, and the rows differ
        # only in the module attributes patched while tracing.
        attend = lambda sp=sp: _vsa(vsa_grid, vsa_tile, sp, tpu)
        rows.append(Case("VSA", name, "gather", S, attend(), density, "per-tile", priority=1 + 2 * i))
        rows.append(Case("VSA", name, "per-tile", S, attend(), density, patch={"VMEM_BUDGET": 0},
                         priority=8 + 2 * i))
        # Where the time goes: the coarse stage (scores; with the top-k), the fine stage alone.
        fine = lambda order="top-k", sp=sp: _vsa_fine(vsa_grid, vsa_tile, sp, tpu, args.smoke, order)
        rows.append(Case("VSA", name, "fine stage alone", S, fine(), density, priority=1 + 2 * i))
        if i == 0:
            for upto in ("scores", "top-k"):
                rows.append(Case("VSA", name, f"coarse stage to {upto}", S, _vsa_stage(vsa_grid, vsa_tile, sp, upto),
                                 density, priority=1, fwd_only=True))
            # The gathering kernels' knobs (after STA's first rows).
            for path, patch in (("fine alone, gathered by copy", {"GATHER": "copy"}),
                                ("fine alone unrolled", {"UNROLL": True}),
                                ("fine alone unrolled chains=4", {"UNROLL": True, "CHAINS": 4}),
                                ("fine alone chains=4", {"CHAINS": 4}),
                                ("fine alone, 512 keys per chunk (before)", {"KV_KEYS_FWD": 512, "KV_KEYS_BWD": 512})):
                rows.append(Case("VSA", name, path, S, fine(), density, "fine stage alone", patch, priority=5,
                                 knob=True))
            rows.append(Case("VSA", name, "fine alone, tiles sorted", S, fine("sorted"), density, priority=5,
                             knob=True))
    dense_done = set()
    for grid, tile, priority in sta:
        tm = kernels.SlidingTileMask(grid, tile, WINDOW)
        if grid not in dense_done:
            dense_done.add(grid)
            rows.append(Case("STA", f"{grid}", "dense", tm.video_len, _dense(), priority=priority))
        name = f"{grid} tile {tile} window {WINDOW}"
        rows.append(Case("STA", name, "splash", tm.video_len, _sta_splash(tm, tpu), tm.density(),
                         priority=priority))
        rows.append(Case("STA", name, "gather", tm.video_len, _sta_gather(tm, interpret), tm.density(), "splash",
                         priority=priority))
    S = math.prod(bc_grid)
    rows.append(Case("BC", f"{bc_grid}", "dense", S, _dense(), priority=2))
    rows.append(Case("BC", f"{bc_grid} token-causal", "causal", S, _dense(causal=True), 0.5, priority=2))
    for frames, window in bc_masks:
        bc = kernels.BlockCausalMask(bc_grid, frames, window=window)
        name = f"{bc_grid} blocks of {frames} frame{'s' * (frames > 1)}" + (f" window {window}" if window else "")
        rows.append(Case("BC", name, "splash", S, _dense(mask=bc, implementation=tpu), bc.density(), priority=2))
    if not args.smoke:  # the tiles of the frame-causal mask (the table's are the causal row's)
        bc = kernels.BlockCausalMask(bc_grid, 1)
        for label, blocks in BC_TILES:
            rows.append(Case("BC", f"{bc_grid} blocks of 1 frame", f"splash {label}", S,
                             _dense(mask=bc, implementation=kernels.PallasTpu(blocks=blocks)), bc.density(),
                             priority=7, knob=True))
    if not args.smoke:
        rows += _chunk_rows(tpu)
    if args.quick or args.smoke:
        rows = [r for r in rows if r.priority <= QUICK and not (args.smoke and r.knob)]
    if args.section:
        rows = [r for r in rows if r.section == args.section]
    cases_dense = [r for r in rows if r.path == "dense"]
    if args.rows:  # with the dense rows of their sizes: the ratios' denominators
        rows = [r for r in rows if r.path != "dense" and re.search(args.rows, f"{r.problem} {r.path}")]
        rows = [d for d in cases_dense if any((r.section, r.S) == (d.section, d.S) for r in rows)] + rows
    return sorted(rows, key=lambda r: r.priority)  # stable: the order above within a priority


def _chunk_rows(tpu) -> list[Case]:
    """`--section TUNE`: the gathering kernels' chunks (keys per chunk: their matrix
    products' width; `KV_KEYS_FWD`, `KV_KEYS_BWD`, `CHAINS`) on VSA (whole, and its fine
    stage alone) and on sliding tile attention at the issue's 72-token tiles and at
    128-token tiles, the defaults first."""
    layout = kernels.internal.VsaLayout(VSA_GRID, VSA_TILE)
    S = layout.video_len
    rows = [Case("TUNE", f"{VSA_GRID}", "dense", S, _dense(), priority=9)]
    for sp in (0.9, 0.75):
        rows.append(Case("TUNE", f"VSA sparsity {sp}", "gather", S, _vsa(VSA_GRID, VSA_TILE, sp, tpu),
                         layout.topk(None, sp) / layout.n_tiles, priority=9))
    for sp, patch, priority in ((0.9, {}, 10), (0.75, {}, 10), (0.75, {"KV_KEYS_BWD": 768}, 10),
                                (0.75, {"CHAINS": 1}, 10), (0.9, {"KV_KEYS_BWD": 768}, 12)):
        name, density = f"VSA sparsity {sp} fine alone", layout.topk(None, sp) / layout.n_tiles
        path = ", ".join(f"{k}={v}" for k, v in patch.items()) or "default"
        rows.append(Case("TUNE", name, path, S, _vsa_fine(VSA_GRID, VSA_TILE, sp, tpu, False), density,
                         "default" if patch else None, patch, priority=priority, knob=True))
    for (grid, tile), priority, patches in ((STA_ISSUE, 9, ({}, {"ROWS": 1}, {"ROWS": 2}, {"ROWS": 8})),
                                            ((STA_GRIDS[0], (2, 8, 8)), 11, ({}, {"KV_KEYS_WHOLE": 0})),
                                            ((STA_GRIDS[1], (2, 8, 8)), 12, ({},))):
        tm = kernels.SlidingTileMask(grid, tile, WINDOW)
        rows.append(Case("TUNE", f"{grid}", "dense", tm.video_len, _dense(), priority=priority))
        for patch in patches:
            path = "gather " + (", ".join(f"{k}={v}" for k, v in patch.items()) or "default")
            rows.append(Case("TUNE", f"STA {grid} tile {tile}", path, tm.video_len, _sta_gather(tm, False),
                             tm.density(), "gather default" if patch else None, patch, priority=priority,
                             knob=True))
    return rows


# -- measuring -------------------------------------------------------------------------------


def _inputs(S: int, smoke: bool):
    heads, dim = (2, 8) if smoke else (HEADS, HEAD_DIM)
    keys = jax.random.split(jax.random.key(S), 4)
    q, k, v = (jax.random.normal(kk, (1, S, heads, dim), BF16) for kk in keys[:3])
    ct = jax.random.normal(keys[3], (1, S, heads, dim), jnp.float32)
    return q, k, v, ct


def _time(compiled, args, reps: int):
    """`(seconds per call, the first call's output)`: the best of `reps` measurements of
    `n` calls issued back to back (the first call, uncounted, sizes `n`; with `reps` 0
    it is the time)."""
    t0 = time.perf_counter()
    first = jax.block_until_ready(compiled(*args))
    best = time.perf_counter() - t0  # the first call's, when `reps` is 0 (`--smoke`)
    n = max(1, min(20, int(0.25 / max(best, 1e-6))))
    best = best if reps == 0 else math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = compiled(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / n)
    return best, first


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def _diff(got: dict, want: dict) -> float | None:
    """The largest difference of two rows' outputs (every pass both have), relative to
    the reference's largest value."""
    errs = [_rel(a, b) for p in got if p in want
            for a, b in zip(jax.tree.leaves(got[p]), jax.tree.leaves(want[p]))]
    return max(errs) if errs else None


def measure(case: Case, inputs: dict, outputs: dict, reps: int, profile: bool = False) -> dict:
    """The row of `case`: ms per pass (and the outputs, in `outputs`, for the rows
    compared with each other); with `profile`, each pass's slowest device ops."""
    q, k, v, ct = inputs[case.S]
    row = dict(section=case.section, problem=case.problem, path=case.path, S=case.S, density=case.density)
    results = {}
    for pass_ in h.PASSES[:1] if case.fwd_only else h.PASSES:
        fn, nargs = h.attention_pass(case.attend, pass_)
        args = (q, k, v, ct)[:nargs]
        try:
            t0 = time.perf_counter()
            with _patched(case.patch):
                compiled = fn.lower(*args).compile()
            row[f"compile_{pass_}_s"] = time.perf_counter() - t0
            seconds, results[pass_] = _time(compiled, args, reps)
            row[f"{pass_}_ms"] = 1e3 * seconds
            if profile:
                row[f"{pass_}_ops"] = h.device_op_times(lambda: compiled(*args))
        except Exception as e:  # a row that fails is recorded, the run goes on
            row[f"{pass_}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
            h.log(traceback.format_exc(limit=4))
    outputs[(case.problem, case.path)] = (results, row, case.reference)
    # Compare with the reference, or be the reference of rows measured before.
    for (problem, path), (res, r, reference) in outputs.items():
        if problem != case.problem:
            continue
        if path == case.reference:
            row["max_rel_diff"] = _diff(results, res)
        elif reference == case.path:
            r["max_rel_diff"] = _diff(res, results)
    return row


def _ratios(rows: list[dict]) -> None:
    dense = {(r["section"], r["S"]): r for r in rows if r["path"] == "dense"}
    for r in rows:
        d = dense.get((r["section"], r["S"]))
        for pass_ in h.PASSES:
            key = f"{pass_}_ms"
            if d and r.get(key) and d.get(key):
                r[f"{pass_}_ratio"] = r[key] / d[key]


def table(rows: list[dict]) -> str:
    head = ("| section | problem | path | density | fwd ms | fwd / dense | fwd+bwd ms | fwd+bwd / dense "
            "| max rel diff | note |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        note = "; ".join(r[f"{p}_error"] for p in h.PASSES if r.get(f"{p}_error"))
        lines.append(
            f"| {r['section']} | {r['problem']} | {r['path']} | {h.fmt(r.get('density'), '.3f')} "
            f"| {h.fmt(r.get('fwd_ms'), '.2f')} | {h.fmt(r.get('fwd_ratio'), '.3f')} "
            f"| {h.fmt(r.get('fwd+bwd_ms'), '.2f')} | {h.fmt(r.get('fwd+bwd_ratio'), '.3f')} "
            f"| {h.fmt(r.get('max_rel_diff'), '.2e')} | {note[:160]} |"
        )
    return "\n".join(lines)


def op_tables(rows: list[dict]) -> str:
    """`--profile`: each row's slowest device ops per pass (ms per call, share of the
    pass's device time)."""
    parts = []
    for r in rows:
        for pass_ in h.PASSES:
            ops = r.get(f"{pass_}_ops")
            if ops:
                head = f"{r['section']} {r['problem']} {r['path']}, {pass_}:\n\n| op | ms | share |\n|---|---|---|\n"
                parts.append(head + "\n".join(f"| `{o['op']}` | {o['ms']:.3f} | {o['share']:.3f} |" for o in ops))
    return "\n\n".join(parts)


def compile_only(todo: list[Case], topology: str) -> list[dict]:
    """Every row compiled, not run, for a TPU of `topology` (e.g. `"v5e:1x1"`) from this
    host (libtpu installed; no TPU needed): the Mosaic compiler's verdict (scoped VMEM,
    unsupported operations) and the compile time."""
    from jax.experimental import topologies

    from vidax_eqx._jax_private import single_device_sharding

    device = topologies.get_topology_desc(topology, "tpu", chips_per_host_bounds=[1, 1, 1]).devices[0]
    sharding = single_device_sharding(device)
    rows = []
    for case in todo:
        shape = (1, case.S, HEADS, HEAD_DIM)
        args = (*(jax.ShapeDtypeStruct(shape, BF16, sharding=sharding),) * 3,
                jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding))
        row = dict(section=case.section, problem=case.problem, path=case.path, S=case.S, density=case.density)
        for pass_ in h.PASSES:
            fn, nargs = h.attention_pass(case.attend, pass_)
            t0 = time.perf_counter()
            try:
                with _patched(case.patch):
                    fn.lower(*args[:nargs]).compile()
                row[f"compile_{pass_}_s"] = time.perf_counter() - t0
            except Exception as e:
                row[f"{pass_}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        h.log(f"{case.section} {case.problem} {case.path}: "
              + ", ".join(f"{p} {row.get(f'compile_{p}_s', 0):.1f} s" if f"{p}_error" not in row
                          else f"{p} FAILED" for p in h.PASSES))
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(h.RESULTS, "tpu_sparse"))
    parser.add_argument("--quick", action="store_true", help="the most important rows only (~2-3 min)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, Pallas interpret mode (CPU)")
    parser.add_argument("--budget", type=float, default=None, help="start no row after this many seconds")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--section", choices=("VSA", "STA", "BC", "TUNE"), default=None, help="that section's rows only")
    parser.add_argument("--compile-only", metavar="TOPOLOGY", default=None,
                        help="compile every row for this TPU topology (e.g. v5e:1x1) from this host, run none")
    parser.add_argument("--profile", action="store_true",
                        help="also trace each pass and list its slowest device ops (jax.profiler)")
    parser.add_argument("--rows", default=None,
                        help="only the rows whose 'problem path' matches this regular expression "
                             "(and their dense rows)")
    args = parser.parse_args(argv)
    if args.compile_only:
        rows = compile_only(cases(args), args.compile_only)
        h.write_json(os.path.join(args.out, "tpu_sparse_compile.json"), dict(topology=args.compile_only, rows=rows))
        return 1 if any(r.get(f"{p}_error") for r in rows for p in h.PASSES) else 0
    start = time.perf_counter()
    budget = args.budget if args.budget is not None else (150.0 if args.quick else 1500.0)
    todo = cases(args)
    info = dict(date=h.now(), jax=jax.__version__, device=str(jax.devices()[0].device_kind),
                backend=jax.default_backend(), git=h.git_state(), command=h.command_line(__file__),
                heads=HEADS, head_dim=HEAD_DIM, dtype="bfloat16")
    h.log(f"{len(todo)} rows on {info['device']} ({info['backend']}), budget {budget:.0f} s")
    inputs, outputs, rows, skipped = {}, {}, [], []
    for case in todo:
        if time.perf_counter() - start > budget:
            skipped.append(f"{case.section} {case.problem} {case.path}")
            continue
        if case.S not in inputs:
            inputs[case.S] = _inputs(case.S, args.smoke)
        h.log(f"[{time.perf_counter() - start:6.1f} s] {case.section} {case.problem} {case.path}")
        rows.append(measure(case, inputs, outputs, 0 if args.smoke else args.reps, args.profile))
    _ratios(rows)
    text = table(rows)
    if skipped:
        text += f"\n\nNot run within the budget of {budget:.0f} s: " + ", ".join(skipped) + "."
    text += f"\n\n{info['device']}, JAX {info['jax']}, {info['date']}, {time.perf_counter() - start:.0f} s."
    if args.profile:
        text += "\n\n" + op_tables(rows)
    print(text)
    h.write_text(os.path.join(args.out, "tpu_sparse.md"), text + "\n")
    h.write_json(os.path.join(args.out, "tpu_sparse.json"), dict(info=info, rows=rows, skipped=skipped))
    failed = [r for r in rows if any(r.get(f"{p}_error") for p in h.PASSES)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
