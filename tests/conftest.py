"""Test configuration: 8 simulated CPU devices, set before JAX is imported.

Multi-device tests (sharded == unsharded) need several devices; on CPU they are
simulated with `--xla_force_host_platform_device_count`. This must be in
`XLA_FLAGS` before the XLA backend initializes, so it is set here, at the top of
the first module pytest imports. Float64 is *not* enabled in JAX: the library
runs in its default float32 and the oracle (`tests/oracle.py`) uses NumPy float64.

The shared harness is the package `tests/harness/` (inputs, meshes, the sharded check, the
comparisons), the float64 references `tests/oracle.py`, the kernel cases
`tests/cases.py`; no test file imports another. XLA compiles the test modules'
programs without LLVM's optimizations, unless a module sets `XLA_OPTIMIZED = True`
(`_fast_compile` below).

The `slow` marker (registered in `pyproject.toml`) marks the tests that take more than
about 10 s each on a 2-core CPU: the documentation pages run in processes of their own
(`test_docs.py::test_page`), the training run (`test_train_wan.py`), the collective soak
(`test_collective_soak.py`), the multi-process fault jobs (`test_multiprocess_faults.py`),
the determinism check across fresh processes, the whole-model sharded gradients
(`test_wan.py`, `test_cogvideox.py`), the FSDP training steps and the regather's memory
(`test_fsdp.py`), the two-process sharded load and checkpoint (`test_fsdp_loading.py`,
`test_training_state.py`) and the hypothesis searches (`test_properties.py`).
The default run, and CI, run everything; the quick developer loop leaves them out:

    python -m pytest -q -m "not slow" tests

The `device` marker (also registered in `pyproject.toml`) marks the tests that run the
Pallas TPU kernels for real on a TPU (`tests/test_device_*.py`). They are skipped unless
`VIDAX_TEST_DEVICE=1` on a TPU machine (or `=interpret`: the same tests on the CPU, the
kernels in Pallas interpret mode); `pytest_collection_modifyitems` below adds the skip,
`tests/harness/_device.py` decides it. On the chip, in one process:

    VIDAX_TEST_DEVICE=1 python -m pytest -o addopts="" -ra -m device tests/test_device_*.py
"""

import gc
import json
import os
import sys


_FLAG = "--xla_force_host_platform_device_count=8"
if "jax" in sys.modules and _FLAG not in os.environ.get("XLA_FLAGS", ""):
    # Too late to take effect if a backend already exists; say so loudly.
    print("conftest: jax was imported before XLA_FLAGS could be set", file=sys.stderr)
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]


os.environ["XLA_FLAGS"] = " ".join([*_flags, _FLAG])
# The pipelines' `from_pretrained` and `vidax-generate` switch on JAX's persistent
# compilation cache under ~/.cache; the suite (and the processes it starts) never writes
# there.
os.environ["VIDAX_COMPILE_CACHE"] = "0"


def _suite_compile_cache() -> None:
    """JAX's persistent compilation cache in one temporary folder for the whole run: the
    pytest process makes it before its workers start, and they, and every process the
    tests start, inherit it (`JAX_COMPILATION_CACHE_DIR`). Most of the suite's time is
    XLA compiling small programs, and many recur: `_release_compiled_programs` drops a
    module's programs after it, the next module and the other worker compile the same
    random draws, comparisons and fixture models again, and the example and worker
    processes compile what the tests did. From the cache each is a file read. Every
    program is cached (no minimum compile time). It changes no result: the cache holds
    XLA's output for the same program and options.

    `VIDAX_TEST_COMPILE_CACHE=0` turns it off; a folder already set by the caller's
    `JAX_COMPILATION_CACHE_DIR` is used as it is (and kept)."""
    if os.environ.get("VIDAX_TEST_COMPILE_CACHE", "1") == "0" or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="vidax-test-jax-cache-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


_suite_compile_cache()

# The repository root, so `vidax_eqx` imports without being installed.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)


import pytest  # noqa: E402


# -- the device tests ------------------------------------------------------------------------


def _skip_device_tests(items):
    """Skips the `device` tests outside the device mode (`harness.device_skip_reason`:
    `VIDAX_TEST_DEVICE` unset, or set to 1 where the default backend is not a TPU)."""
    device = [item for item in items if item.get_closest_marker("device") is not None]
    if not device:
        return
    import harness

    reason = harness.device_skip_reason()
    if reason is not None:
        for item in device:
            item.add_marker(pytest.mark.skip(reason=reason))


# -- where the time goes: the slowest files -----------------------------------------------


_FILE_COSTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_seconds.json")


def pytest_addoption(parser):
    parser.addoption(
        "--file-durations", type=int, default=0, metavar="N",
        help="list the N test files with the most time (setup, call and teardown of their "
             "tests summed, module-scoped fixtures included), as .ci/run does (N=15)")
    parser.addoption(
        "--write-file-durations", action="store_true",
        help=f"after a whole run, write every file's seconds to {os.path.basename(_FILE_COSTS)} "
             "(the order in which the workers take the files)")


def _file_costs() -> dict[str, float]:
    try:
        with open(_FILE_COSTS, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def pytest_collection_modifyitems(config, items):
    """The files longest first, each file's tests kept together and in their order: the
    two workers take whole files (`--dist loadfile`, `--no-loadscope-reorder`), so that
    the longest start first and the two finish together (the longest processing time
    first rule) instead of one worker running a long file alone at the end. A file's
    cost is its seconds in `file_seconds.json` (a whole run's `--write-file-durations`;
    a new file counts as one of the median). Then the device tests' skip."""
    costs = _file_costs()
    median = sorted(costs.values())[len(costs) // 2] if costs else 0.0
    rank = {}
    for item in items:
        name = item.nodeid.split("::")[0]
        rank.setdefault(name, (-costs.get(name, median), len(rank)))
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])
    _skip_device_tests(items)


_FILE_SECONDS: dict[str, float] = {}


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    if config.getoption("--write-file-durations") and _FILE_SECONDS:
        with open(_FILE_COSTS, "w", encoding="utf-8") as f:
            json.dump({k: round(v, 1) for k, v in sorted(_FILE_SECONDS.items())}, f, indent=1)
            f.write("\n")
    n = config.getoption("--file-durations")
    if not n or not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("=", f"slowest {n} test files (of {len(_FILE_SECONDS)}; "
                                    f"{total / 60:.1f} min summed over the workers)")
    for name, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:n]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {100 * seconds / total:5.1f}%  {name}")


def pytest_runtest_logreport(report):
    """Adds the report's time to its file's (`--file-durations`). With
    `VIDAX_TEST_DEVICE_LOG=FILE`, each failing test's id and the last lines of its
    error are appended to FILE as it fails (a chip session's time limit may end the run
    before pytest's summary is printed)."""
    name = report.nodeid.split("::")[0]
    _FILE_SECONDS[name] = _FILE_SECONDS.get(name, 0.0) + report.duration
    path = os.environ.get("VIDAX_TEST_DEVICE_LOG")
    if not path or not report.failed:
        return
    text = str(report.longrepr).strip().splitlines()
    with open(path, "a") as f:
        f.write(f"{report.nodeid} ({report.when}): " + " | ".join(line.strip() for line in text[-6:]) + "\n")


@pytest.fixture(autouse=True)
def _chip_tolerance(request, monkeypatch):
    """A `device` test on the chip compares float32 with `oracle.CHIP_FLOAT32` (the TPU's
    own exp and log); with `VIDAX_TEST_DEVICE_ERRORS=FILE` every comparison's relative
    error is appended to FILE (test id, quantity, dtype, error, tolerance)."""
    if request.node.get_closest_marker("device") is None:
        yield
        return
    import harness
    import oracle

    if harness.on_chip():
        monkeypatch.setitem(oracle.TOLERANCES, "float32", oracle.CHIP_FLOAT32)
    monkeypatch.setattr(oracle, "ERRORS_LOG", [os.environ.get("VIDAX_TEST_DEVICE_ERRORS"), request.node.nodeid])
    yield


# -- how XLA compiles in the test processes --------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def _fast_compile(request):
    """XLA's CPU backend without its backend (LLVM) optimizations, as the documentation
    pages run and as `harness.FAST_COMPILE` asks of single programs: JAX's
    `jax_disable_most_optimizations`, for every program of a test module.

    Most of the suite's time is XLA compiling small programs that then run once; without
    LLVM's optimizations the whole suite took 17:48 instead of about 20 minutes
    (2 workers on a 2-core CPU, 2026-12-05). It changes code generation,
    not semantics: XLA's HLO passes (fusion, layout, sharding, the buffer assignment
    that `memory_analysis` reports) give the same optimized HLO, and every result is
    compared with the same tolerances. The bits may differ (LLVM orders some arithmetic
    differently), so a module compiles as XLA does by default where it sets
    `XLA_OPTIMIZED = True`: `test_kernels.py` (the optimized code of every kernel path
    against the oracle) and the modules that compare bits with a process they start
    (`test_determinism.py`, `test_generate_wan.py`), whose processes compile as XLA does
    by default. `VIDAX_TEST_FAST_COMPILE=0` compiles every module so.
    """
    fast = (os.environ.get("VIDAX_TEST_FAST_COMPILE", "1") != "0"
            and not getattr(request.module, "XLA_OPTIMIZED", False))
    jax.config.update("jax_disable_most_optimizations", fast)
    _ELEMENTAL_EMITTERS[0] = fast and not getattr(request.module, "XLA_DEFAULT_EMITTERS", False)
    yield


_ELEMENTAL_EMITTERS = [False]


def _elemental_emitters_when_fast() -> None:
    """In the modules `_fast_compile` compiles fast, XLA's CPU backend also uses its
    elemental fusion emitters instead of the MLIR ones (`xla_cpu_use_fusion_emitters`
    off, in each compile's options): on the suite's small programs it compiles about 3x
    faster (a tiny Wan's gradient 1.91 -> 0.65 s, its forward over 8 devices 0.77 ->
    0.33 s; 2-core CI machine, jaxlib 0.10.2, 2026-12-07) and the programs run as fast.
    Both emitters implement the same HLO, and results are compared with the same
    tolerances; but the elemental ones can round two different programs of the same
    math differently where the MLIR ones agree to the bit, so a module whose tests
    promise bit-identity between two programs (a text or step cache against the plain
    call, an exported program against the traced one) sets `XLA_DEFAULT_EMITTERS = True`.

    Only on jaxlib 0.10, where it was measured, through JAX's compile options
    (`jax._src.compiler.get_compile_options`, wrapped; an unknown option is an error to
    XLA); `VIDAX_TEST_XLA_EMITTERS=default` keeps XLA's default everywhere (CI's
    newest-JAX leg runs so)."""
    if os.environ.get("VIDAX_TEST_XLA_EMITTERS", "elemental") != "elemental":
        return
    import jaxlib

    if not jaxlib.__version__.startswith("0.10."):
        return
    from jax._src import compiler

    original = compiler.get_compile_options

    def get_compile_options(*args, **kwargs):
        options = original(*args, **kwargs)
        if _ELEMENTAL_EMITTERS[0]:
            options.env_option_overrides = [*options.env_option_overrides,
                                            ("xla_cpu_use_fusion_emitters", False)]
        return options

    compiler.get_compile_options = get_compile_options


_elemental_emitters_when_fast()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module.

    Every program XLA's CPU backend loads maps a few regions of executable memory
    (about 3 per program), and JAX keeps the programs of every `jit` cache alive.
    Over a whole suite (thousands of programs) a process crosses Linux's
    `vm.max_map_count` (65530 by default), after which LLVM's next mapping fails and
    the compiler crashes with a segmentation fault. `jax.clear_caches()` releases
    them; a module recompiles what it uses.
    """
    yield
    jax.clear_caches()
    gc.collect()
