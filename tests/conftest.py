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
import os
import sys


_FLAG = "--xla_force_host_platform_device_count=8"
if "jax" in sys.modules and _FLAG not in os.environ.get("XLA_FLAGS", ""):
    # Too late to take effect if a backend already exists; say so loudly.
    print("conftest: jax was imported before XLA_FLAGS could be set", file=sys.stderr)
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
os.environ["XLA_FLAGS"] = " ".join([*_flags, _FLAG])
# The pipelines' `from_pretrained` and `vidax-generate` switch on JAX's persistent
# compilation cache under ~/.cache; the suite (and the processes it starts) leaves it off,
# except where a test turns it on in a folder of its own (tests/test_compile_cache.py).
os.environ["VIDAX_COMPILE_CACHE"] = "0"

# The repository root, so `vidax_eqx` imports without being installed.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)


import pytest  # noqa: E402


# -- the device tests ------------------------------------------------------------------------


def pytest_collection_modifyitems(config, items):
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


def pytest_addoption(parser):
    parser.addoption(
        "--file-durations", type=int, default=0, metavar="N",
        help="list the N test files with the most time (setup, call and teardown of their "
             "tests summed, module-scoped fixtures included), as .ci/run does (N=15)")


_FILE_SECONDS: dict[str, float] = {}


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
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
    yield


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
