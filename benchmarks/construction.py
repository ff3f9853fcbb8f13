"""Construction time of the models: `WanTransformer3D(config, key=key)` and
`CogVideoXTransformer3D(config, key=key)`, before and after the host initialization
of `vidax_eqx/nn/_init.py`, in the same run.

- **before**: every parameter drawn by `jax.random` eagerly, one small compiled
  program per weight shape (`eqx.nn.Linear`'s own initialization): the library's
  construction until the host path existed, run here through the private switch
  `vidax_eqx.nn._init.jax_init()`, which turns the host path off.
- **after**: the default: a concrete key draws every parameter on the host with
  NumPy (seeded from the key) and moves it to the device; nothing is compiled.
- **one program** (the tiny models only): the other way to avoid a compile per
  weight, the whole construction under one `eqx.filter_jit` (one XLA compile of
  every draw); measured to choose between the two.

Cases: the tiny Wan and CogVideoX of the tests (`tests/fixtures/*/`: Wan dim 64,
2 layers, 133k parameters; CogVideoX 4 heads of 16, 2 layers), Wan 2.1 T2V-1.3B
built abstractly (`eqx.filter_eval_shape`: shapes only, on the traced path both
before and after), and Wan 1.3B built concretely (5.7 GB of float32 parameters;
`--no-concrete` leaves it out). Every measurement runs in a fresh process
(`_harness.run_child`): "first" is the first construction after `import vidax_eqx`
(what a user waits for), "second" another in the same process (compile caches
warm). Medians over `--repeats` processes, cases interleaved; peak RSS per process.

    python benchmarks/construction.py --repeats 3
    python benchmarks/construction.py --quick        # tiny models only, 1 repeat
"""

import argparse
import os
import statistics
import sys
import time

from _harness import (command_line, cpu_model, emit, fmt, git_state, log, now, peak_rss,
                      RESULTS, run_child, write_json, write_text)


# The tiny configurations of tests/fixtures (wan/t2v, cogvideox/2b).
_TINY_WAN = dict(dim=64, ffn_dim=96, num_heads=8, num_layers=2, in_channels=4, out_channels=4,
                 text_dim=32, freq_dim=32)
_TINY_COG = dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
                 time_embed_dim=32, text_embed_dim=24, num_layers=2, sample_width=8,
                 sample_height=6, sample_frames=9, patch_size=2, max_text_seq_length=5,
                 norm_eps=1e-5)
CASES = {  # name: (description, model, config, build)
    "wan-tiny": ("tiny Wan (tests' t2v)", "wan", _TINY_WAN, "concrete"),
    "cogvideox-tiny": ("tiny CogVideoX (tests' 2b)", "cogvideox", _TINY_COG, "concrete"),
    "wan-1.3b-abstract": ("Wan 1.3B, `eqx.filter_eval_shape`", "wan", "t2v-1.3b", "abstract"),
    "wan-1.3b": ("Wan 1.3B, concrete", "wan", "t2v-1.3b", "concrete"),
}
MODES = ("before", "after", "one program")


def child(a) -> None:
    """One measurement in this fresh process: `emit`s the first and second
    construction times."""
    t0 = time.perf_counter()
    import equinox as eqx
    import jax

    from vidax_eqx import models
    from vidax_eqx.nn import _init

    import_s = time.perf_counter() - t0
    _, model, config, build = CASES[a.case]
    if model == "wan":
        cls = models.WanTransformer3D
        config = (models.WanConfig.preset(config) if isinstance(config, str)
                  else models.WanConfig(**config))
    else:
        cls, config = models.CogVideoXTransformer3D, models.CogVideoXConfig(**config)
    key = jax.random.key(0)

    def construct():
        if build == "abstract":
            return eqx.filter_eval_shape(cls, config, key=key)
        if a.mode == "one program":
            return eqx.filter_jit(lambda k: cls(config, key=k))(key)
        if a.mode == "before":
            with _init.jax_init():
                return cls(config, key=key)
        return cls(config, key=key)

    times = []
    for _ in range(1 if a.case == "wan-1.3b" else 2):
        t0 = time.perf_counter()
        m = construct()
        jax.block_until_ready(eqx.filter(m, eqx.is_array))
        times.append(time.perf_counter() - t0)
        leaves = jax.tree.leaves(eqx.filter(m, lambda x: hasattr(x, "shape")))
        params = sum(x.size for x in leaves)
        del m, leaves
    emit({"case": a.case, "mode": a.mode, "import_s": import_s, "first_s": times[0],
          "second_s": times[1] if len(times) > 1 else None, "params": params,
          "peak_rss_gib": peak_rss() / 2**30})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-concrete", action="store_true", help="leave out the concrete Wan 1.3B")
    p.add_argument("--quick", action="store_true", help="the tiny models only, one repeat")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=os.path.join(RESULTS, "construction"))
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.case:
        return child(a)
    if a.quick:
        a.repeats, a.no_concrete = 1, True
    cases = [c for c in CASES if not (a.quick and "1.3b" in c)
             and not (a.no_concrete and c == "wan-1.3b")]
    plan = [(c, m) for c in cases for m in MODES if m != "one program" or "tiny" in c]
    results: dict[tuple[str, str], list[dict]] = {k: [] for k in plan}
    for r in range(a.repeats):
        for case, mode in plan:
            if case == "wan-1.3b" and r > 0:
                continue  # one process each: tens of seconds and GBs
            log(f"[{r + 1}/{a.repeats}] {case} {mode}")
            out = run_child(__file__, ["--case", case, "--mode", mode], devices=1,
                            timeout=a.timeout)
            if not out.ok:
                log(f"  failed: {out.reason}")
            results[(case, mode)].append(out.record())

    def median(case, mode, field):
        values = [r[field] for r in results.get((case, mode), ()) if r.get(field) is not None]
        return statistics.median(values) if values else None

    lines = [
        f"# Construction time ({now()})", "",
        f"`{command_line(__file__)}` at {git_state()}; {cpu_model()}, {os.cpu_count()} cores; "
        f"medians of {a.repeats} fresh processes (Wan 1.3B concrete: 1).", "",
        "| model | parameters | before: first s | after: first s | before / after "
        "| one program: first s | before: second s | after: second s | peak RSS before / after GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for case in cases:
        first = {m: median(case, m, "first_s") for m in MODES}
        second = {m: median(case, m, "second_s") for m in MODES}
        rss = {m: median(case, m, "peak_rss_gib") for m in MODES}
        params = median(case, "after", "params") or median(case, "before", "params")
        ratio = (first["before"] / first["after"]
                 if first["before"] and first["after"] else None)
        lines.append(
            f"| {CASES[case][0]} | {fmt(params, ',.0f')} | {fmt(first['before'], '.3f')} | "
            f"{fmt(first['after'], '.3f')} | {fmt(ratio, '.1f')}x | "
            f"{fmt(first['one program'], '.3f')} | {fmt(second['before'], '.3f')} | "
            f"{fmt(second['after'], '.3f')} | {fmt(rss['before'], '.2f')} / "
            f"{fmt(rss['after'], '.2f')} |")
        rows.append({"case": case, "params": params, "first": first, "second": second,
                     "ratio": ratio, "peak_rss_gib": rss})
    imports = [r["import_s"] for rs in results.values() for r in rs if "import_s" in r]
    if imports:
        lines += ["", f"`import vidax_eqx` (not counted above): median {statistics.median(imports):.2f} s."]
    text = "\n".join(lines) + "\n"
    print(text)
    write_text(a.out + ".md", text)
    write_json(a.out + ".json", {"rows": rows, "raw": {f"{c}|{m}": v for (c, m), v in results.items()}})
    if any(not r.get("first_s") for rs in results.values() for r in rs):
        sys.exit("some measurements failed (see above)")


if __name__ == "__main__":
    main()
