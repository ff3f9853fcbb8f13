"""`vidax-generate` as a new user meets it (issue 49's first run), on the tests' tiny
random Wan pipeline (`tests/fixtures/wan_pipeline/t2v`), with the command's own `--help`
example:

1. On a terminal: the installed console script in a process of its own, stderr a
   pseudo-terminal (Python's `pty`) where the real tqdm draws its bar; `--sp 2` with no
   `XLA_FLAGS` (two simulated CPU devices); exit status 0, the written path alone on
   stdout; JAX's persistent compilation cache written in the user's cache folder.
2. In a log (nothing a terminal): the same command again, a second process: each stage
   announced as it starts and timed as it ends, progress lines every few steps, the total
   wall time, every compiled program read from the
   cache (JAX's "cache hit" log lines with `JAX_LOG_COMPILES=1`, no miss, no new entry).
3. Before anything loads: a missing library (PyAV made unimportable) is one line naming
   the `pipeline` extra, exit status 2; so is the library's own error on a bad size (the
   rest of the checks before loading: `test_generate_checks.py`).
4. `--help` holds the quick local example and its time; the example
   `examples/generate_wan.py` speaks the command's vocabulary; the compilation cache is
   never switched on by importing the library, and its off switches work.
"""

import importlib.util
import os
import pathlib
import pty
import re
import shlex
import shutil
import subprocess
import sys
import time

import jax
import pytest

from vidax_eqx import generate, pipelines


ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "generate_wan.py"
TIMEOUT_S = 300


def _command() -> list[str]:
    """The installed console script (`pip install -e .` puts it beside the interpreter),
    or what it runs, `sys.exit(vidax_eqx.generate.main())`."""
    script = shutil.which("vidax-generate", path=os.path.dirname(sys.executable))
    if script is not None:
        return [script]
    return [sys.executable, "-c", "import sys; from vidax_eqx.generate import main; "
                                  "sys.exit(main())"]


def _quick_args(tmp: pathlib.Path) -> list[str]:
    """`--help`'s quick example as written, from a copy of the repository root (its
    `tests/` linked), plus `--sp 2`."""
    words = shlex.split(generate.QUICK.replace("\\\n", " "))
    assert words[0] == "vidax-generate"
    (tmp / "tests").symlink_to(ROOT / "tests")
    return words[1:] + ["--sp", "2"]


def _environment(cache: pathlib.Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "VIDAX_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    # Every program written, however fast it compiled (the tiny pipeline's take well
    # under the command's threshold), so that the second process finds them all.
    # XLA without LLVM's optimizations, as the suite compiles (conftest's `_fast_compile`).
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    return env


def _on_a_terminal(args, cwd, env):
    """Runs `args` with stderr (and stdin) a pseudo-terminal, stdout a pipe; `(exit
    status, stdout, what the terminal showed)`."""
    main, child = pty.openpty()
    import fcntl
    import struct
    import termios

    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdin=child, stderr=child,
                            stdout=subprocess.PIPE, text=True)
    os.close(child)
    shown = b""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            data = os.read(main, 4096)
        except OSError:  # the child side closed
            break
        if not data:
            break
        shown += data
    os.close(main)
    stdout, _ = proc.communicate(timeout=60)
    return proc.returncode, stdout, shown.decode(errors="replace")


def _entries(cache: pathlib.Path) -> set[str]:
    folder = cache / "vidax_eqx" / "jax"
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The quick example twice, each in a fresh process: on a terminal, then in a log."""
    tmp = tmp_path_factory.mktemp("first-run")
    cache = tmp / "cache"
    args = _command() + _quick_args(tmp)
    env = _environment(cache)
    first = _on_a_terminal(args, tmp, env)
    written = _entries(cache)
    os.rename(tmp / "cat.mp4", tmp / "first.mp4")
    start = time.perf_counter()
    second = subprocess.run(args, cwd=tmp, capture_output=True, text=True, timeout=TIMEOUT_S,
                            env={**env, "JAX_LOG_COMPILES": "1"})  # logs each cache hit
    wall = time.perf_counter() - start
    return dict(tmp=tmp, first=first, written=written, second=second, wall=wall,
                after=_entries(cache))


def test_console_script_on_a_terminal(runs):
    status, stdout, shown = runs["first"]
    assert status == 0, shown[-4000:]
    assert stdout.splitlines() == ["cat.mp4"], (stdout, shown[-2000:])
    assert (runs["tmp"] / "first.mp4").stat().st_size > 0
    assert "mesh {'dp': 1, 'sp': 2, 'tp': 1}" in shown, shown[-2000:]  # no XLA_FLAGS
    assert "denoise: 100%" in shown and "4/4" in shown, shown[-2000:]  # tqdm's own bar
    assert "Traceback" not in shown, shown[-4000:]
    assert runs["written"], "the first run wrote no compilation cache entry"


def test_second_process_in_a_log(runs):
    second = runs["second"]
    assert second.returncode == 0, second.stderr[-4000:]
    assert second.stdout.splitlines() == ["cat.mp4"]
    lines = second.stderr.splitlines()
    progress = [line for line in lines if line.startswith("denoise  step")]
    assert [line.split()[2] for line in progress] == ["1/4", "2/4", "3/4", "4/4"], lines
    assert "remaining ~" in progress[1]
    assert "\r" not in second.stderr  # no bar in a log
    timed = [re.match(r"(load|text|denoise|decode|write|total) +(\d+\.\d) s", line)
             for line in lines]
    stages = {m[1]: float(m[2]) for m in timed if m}
    assert set(stages) == {"load", "text", "denoise", "decode", "write", "total"}, lines
    # Each stage is announced as it starts (`text ...`), before its time as it ends, and
    # after the stage before it ends: a log shows what runs while it compiles.
    ends = []
    for stage in ("load", "text", "denoise", "decode", "write"):
        start = [i for i, line in enumerate(lines) if re.match(rf"{stage} +\.\.\.", line)]
        end = [i for i, line in enumerate(lines) if re.match(rf"{stage} +\d+\.\d s", line)]
        assert len(start) == len(end) == 1 and start[0] < end[0], (stage, lines)
        assert not ends or ends[-1] < start[0], (stage, lines)
        ends.append(end[0])
    assert lines.index(progress[0]) > [i for i, line in enumerate(lines)
                                       if line.startswith("denoise  ")][0]
    # The total is the wall time: at least the stages, at most the process's life.
    assert sum(v for k, v in stages.items() if k != "total") <= stages["total"] + 0.2
    assert stages["total"] <= runs["wall"]
    # Every program compiled by the first process came from the cache.
    assert "Persistent compilation cache hit" in second.stderr, second.stderr[-4000:]
    assert "Persistent compilation cache miss" not in second.stderr, second.stderr[-4000:]
    assert runs["after"] == runs["written"]


def test_missing_library_before_loading(tmp_path, monkeypatch, capsys):
    """PyAV made unimportable: one line naming the extra, status 2, nothing loaded."""
    monkeypatch.setitem(sys.modules, "av", None)
    loaded = []
    monkeypatch.setattr(pipelines.WanPipeline, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loaded.append(a)))
    with pytest.raises(SystemExit) as exit:
        generate.main([str(ROOT / "tests" / "fixtures" / "wan_pipeline" / "t2v"), "--prompt",
                       "a cat", "--output", str(tmp_path / "x.mp4")])
    assert exit.value.code == 2 and not loaded
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err == ("vidax-generate: error: missing av (writing the .mp4): pip install "
                   "'.[pipeline]' in a clone of vidax_eqx (the `pipeline` extra: tokenizers, av, "
                   "pillow, huggingface_hub), or pip install av.\n"), err


def test_library_error_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        generate.main([str(ROOT / "tests" / "fixtures" / "wan_pipeline" / "t2v"), "--prompt",
                       "a cat", "--height", "30", "--output", str(tmp_path / "x.mp4")])
    assert exit.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (  # before loading: the only line
        "vidax-generate: error: WanPipeline: `height` must be a multiple of 16 (the VAE's "
        "spatial factor 8 x the patch's 2); received 30. Use 16 or 32.\n"), err
    with pytest.raises(SystemExit) as exit:
        generate.main([str(tmp_path / "missing"), "--prompt", "a", "--output",
                       str(tmp_path / "x.mp4")])
    assert exit.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_help_and_the_shared_vocabulary():
    help_text = generate.parser().format_help()
    assert generate.QUICK in help_text and generate.QUICK_TIME in help_text
    helps = {a.dest: a.help for a in generate.parser()._actions}
    assert helps["width"] == "pixels (default Wan 832, CogVideoX 720)"  # CallDefaults
    spec = importlib.util.spec_from_file_location("generate_wan", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    def flags(parser):
        return {s for a in parser._actions for s in a.option_strings if a.help != "==SUPPRESS=="}

    ours, theirs = flags(example.parser()), flags(generate.parser())
    extras = {"--embeddings", "--latent-shape", "--vae", "--scheduler", "--shift", "--noise",
              "--first-block-cache", "--static-step-cache", "--cache-warmup"}
    assert ours - theirs == extras  # the example's own; every other flag is the command's
    assert theirs - ours == {"--image", "--last-image", "--use-dynamic-cfg",
                             "--num-videos-per-prompt", "--ar-step", "--causal-block-size", "--stream",
                             "--chunk-frames", "--max-cached-frames", "--overlap-history", "--base-num-frames",
                             "--addnoise-condition", "--video"}


def test_compile_cache_switches(tmp_path, monkeypatch):
    """Importing the library leaves JAX's cache as it was; `VIDAX_COMPILE_CACHE=0` keeps
    it off; otherwise it goes to the user's cache folder with the command's thresholds,
    and a folder set by the user is kept."""
    # Imported, never switched on: the suite's own folder (conftest), or none.
    assert jax.config.jax_compilation_cache_dir == os.environ.get("JAX_COMPILATION_CACHE_DIR")
    saved = {name: getattr(jax.config, name) for name in (
        "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes")}
    try:
        # A process with no cache set, JAX's thresholds at their defaults.
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        monkeypatch.setenv("VIDAX_COMPILE_CACHE", "0")
        assert pipelines.enable_compile_cache() is None
        assert jax.config.jax_compilation_cache_dir is None
        monkeypatch.delenv("VIDAX_COMPILE_CACHE")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        folder = str(tmp_path / "vidax_eqx" / "jax")
        assert pipelines.default_compile_cache_dir() == folder
        assert pipelines.enable_compile_cache() == folder and os.path.isdir(folder)
        assert jax.config.jax_compilation_cache_dir == folder
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.5
        assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
        assert pipelines.enable_compile_cache(tmp_path / "other") == folder  # kept
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
