"""Every Python code block of the documentation runs: `README.md` and `docs/**/*.md`.

Each page's fenced blocks whose info string starts with `python` run in order, in
one fresh Python process, like the cells of a notebook (a block may use what an
earlier block of the same page defined). The process runs as from the repository's root,
with nothing else set for it: the repository on `PYTHONPATH`, its working directory a
fresh temporary directory (pages may write files) holding links to the repository's
`tests/`, `scripts/`, `examples/` and `benchmarks/` (so that `"tests/fixtures/..."` reads
as it does from the root),
`JAX_PLATFORMS=cpu`, one CPU device unless the page asks for more, and a timeout.
Blocks of any other language (`bash`, `text`, ...) are shown, never run.

**Markers.** A page steers its test with HTML comments, invisible in the rendered
page, of the form `<!-- docs-test: NAME key=value ... -->` (values are bare words
or double-quoted strings), on a line of their own outside code blocks:

- `<!-- docs-test: devices=8 -->` anywhere in the page: the page's process sees
    8 simulated CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`,
    set before JAX starts). At most once per page.
- `<!-- docs-test: skip reason="needs a GPU" -->` on the line before a `python`
    block (blank lines between are allowed): that block is not run, and is
    reported as a pytest skip with its reason. The reason is required. Use it only
    for blocks that cannot run on a CPU-only CI machine (an accelerator, a
    downloaded multi-GB checkpoint), never to hide a failing example.

Anything else spelled like a marker (an unknown name or key, a misspelt
`doc-test`, a skip without a reason or not followed by a `python` block) fails
`test_markers_are_valid`, as does a block tagged `py`, `python3`, `pycon`, ...,
which would silently not run: write `python`.

`test_feature_tables_are_current` also checks every page's copy of the feature
table (between `<!-- feature-table:start -->` and `<!-- feature-table:end -->`,
as `scripts/feature_table.py` writes it) against the capability flags.

**Speed.** Keep the pages' examples tiny (small shapes, few compilations): the
whole file runs in about 80 s on 2 cores, README included. Most of a page's time
is XLA compiling, so the pages run with two helps that change no result: JAX's
persistent compilation cache in a directory shared by the pages of one run (what
several pages compile is compiled once), and `--xla_backend_optimization_level=0`
(XLA's CPU backend compiles about twice as fast; the programs it makes run
slower, which tiny examples do not notice; `VIDAX_DOCS_FAST_COMPILE=0` turns it off). The pages
run two at a time (`VIDAX_DOCS_JOBS`), longest first; `VIDAX_DOCS_TIMEOUT` is the
limit per page in seconds (default 300: it catches a hang; a page on a loaded 2-core machine took 120).

Running one page by hand: `python -m pytest -q tests/test_docs.py -k first-attention`;
the failure message names the page, the line of the block that failed and the tail
of the page process's stderr, whose tracebacks point at lines of the page.
"""

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import time

import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT_S = int(os.environ.get("VIDAX_DOCS_TIMEOUT", "300"))  # per page: a hang, not a speed limit
JOBS = max(1, int(os.environ.get("VIDAX_DOCS_JOBS", str(min(2, os.cpu_count() or 1)))))
STDERR_TAIL = 4000  # characters of the page process's stderr in a failure message

_MARKER = re.compile(r"^\s*<!--\s*docs-test:(?P<body>.*?)-->\s*$")
# Anything that looks like an attempt at a marker, to catch misspellings.
_MARKER_LIKE = re.compile(r"<!--\s*docs?[-_ ]?tests?\b", re.IGNORECASE)
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
# Info strings that mean Python but would not run: write `python`.
_PYTHON_ALIASES = {"py", "python3", "py3", "pycon", "ipython", "ipython3", "pyi", "python-repl"}
_BLOCK_LANGUAGE = "python"
# The repository's folders a page reads by a path relative to the root.
_LINKED = ("tests", "scripts", "examples", "benchmarks")


@dataclasses.dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    language: str
    source: str
    skip: str | None = None  # the skip reason, or None


@dataclasses.dataclass
class Page:
    path: pathlib.Path
    blocks: list[Block]
    devices: int | None
    errors: list[str]  # marker / fence problems, "line N: message"

    @property
    def name(self) -> str:
        return self.path.relative_to(ROOT).as_posix()

    @property
    def python(self) -> list[Block]:
        return [b for b in self.blocks if b.language == _BLOCK_LANGUAGE]


def _pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _parse_marker(body: str) -> tuple[str | None, dict[str, str], str | None]:
    """`(name, {key: value}, error)` of a marker's text after `docs-test:`.

    The first word is the name, unless it is a `key=value` pair itself (`devices=8`).
    """
    try:
        words = shlex.split(body)
    except ValueError as e:
        return None, {}, f"cannot parse the marker ({e}); quote values with double quotes"
    name, fields = None, {}
    for i, word in enumerate(words):
        if "=" in word:
            key, _, value = word.partition("=")
            if not key or key in fields:
                return None, {}, f"bad or repeated key in {word!r}"
            fields[key] = value
        elif i == 0:
            name = word
        else:
            return None, {}, f"{word!r} is not a key=value pair"
    return name, fields, None


def parse(path: pathlib.Path) -> Page:
    """The code blocks and markers of one Markdown page."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    errors: list[str] = []
    devices = None
    pending_skip: tuple[int, str] | None = None  # (line, reason) of a skip marker
    i = 0
    while i < len(lines):
        text, lineno = lines[i], i + 1
        fence = _FENCE.match(text)
        if fence:
            mark, indent = fence["fence"], len(fence["indent"])
            info = fence["info"].strip()
            if mark[0] == "`" and "`" in info:  # inline code such as ```x```, not a fence
                i += 1
                continue
            language = info.strip("{}").split()[0].lstrip(".").lower() if info else ""
            body = []
            i += 1
            while i < len(lines):
                close = _FENCE.match(lines[i])
                if close and close["fence"][0] == mark[0] and len(close["fence"]) >= len(mark) \
                        and not close["info"].strip():
                    break
                line = lines[i]
                body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
                i += 1
            else:
                errors.append(f"line {lineno}: the code block opened here is never closed")
            if language in _PYTHON_ALIASES:
                errors.append(
                    f"line {lineno}: a code block tagged {language!r} would not be run by "
                    f"tests/test_docs.py; tag it 'python'"
                )
            skip = None
            if pending_skip is not None:
                if language == _BLOCK_LANGUAGE:
                    skip = pending_skip[1]
                else:
                    errors.append(
                        f"line {pending_skip[0]}: a skip marker must come right before a "
                        f"'python' block; the next block (line {lineno}) is "
                        f"{language or 'untagged'!r}"
                    )
                pending_skip = None
            blocks.append(Block(lineno, language, "\n".join(body) + "\n", skip))
            i += 1
            continue
        marker = _MARKER.match(text)
        if marker:
            name, fields, error = _parse_marker(marker["body"])
            if error:
                errors.append(f"line {lineno}: {error}")
            elif name is None and set(fields) == {"devices"}:
                value = fields["devices"]
                if not value.isdigit() or not 1 <= int(value) <= 64:
                    errors.append(
                        f"line {lineno}: devices must be an int from 1 to 64; received {value!r}")
                elif devices is not None:
                    errors.append(f"line {lineno}: devices is set twice in this page")
                else:
                    devices = int(value)
            elif name == "skip" and set(fields) <= {"reason"}:
                reason = fields.get("reason", "").strip()
                if not reason:
                    errors.append(f"line {lineno}: a skip needs a reason: "
                                  '<!-- docs-test: skip reason="..." -->')
                elif pending_skip is not None:
                    errors.append(f"line {lineno}: two skip markers in a row")
                else:
                    pending_skip = (lineno, reason)
            else:
                errors.append(
                    f"line {lineno}: unknown marker {marker['body'].strip()!r}; the markers are "
                    '<!-- docs-test: devices=N --> and <!-- docs-test: skip reason="..." -->'
                )
        elif _MARKER_LIKE.search(re.sub(r"`+[^`]*`+", "", text)):  # not in inline code
            errors.append(
                f"line {lineno}: {text.strip()!r} looks like a docs-test marker but is not one; "
                "write <!-- docs-test: ... --> alone on its line"
            )
        elif pending_skip is not None and text.strip():
            errors.append(
                f"line {pending_skip[0]}: a skip marker must come right before a 'python' block; "
                f"line {lineno} comes first"
            )
            pending_skip = None
        i += 1
    if pending_skip is not None:
        errors.append(f"line {pending_skip[0]}: a skip marker at the end of the page skips nothing")
    return Page(path, blocks, devices, errors)


# -- running a page ----------------------------------------------------------------------

# Runs the blocks in one namespace. Each block is compiled under the page's path with
# its lines at their places in the page, so a traceback points at the Markdown line.
_RUNNER = r"""
import json, sys, time, traceback
page, blocks = json.load(open(sys.argv[1], encoding="utf-8"))
namespace = {"__name__": "__main__", "__file__": page}
for block in blocks:
    print(f"docs-test: running the block at line {block['line']}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        code = compile("\n" * block["line"] + block["source"], page, "exec")
        exec(code, namespace)
    except BaseException:
        traceback.print_exc()
        print(f"docs-test: FAILED the block at line {block['line']}", file=sys.stderr, flush=True)
        sys.exit(1)
    sys.stdout.flush()
    print(f"docs-test: the block at line {block['line']} took {time.perf_counter() - start:.2f} s",
          file=sys.stderr, flush=True)
"""


@dataclasses.dataclass(frozen=True)
class Result:
    returncode: int | None  # None: timed out
    stdout: str
    stderr: str
    seconds: float


def _environment(devices: int | None, cache_dir: str | None) -> dict[str, str]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    if os.environ.get("VIDAX_DOCS_FAST_COMPILE", "1") == "1":
        flags.append("--xla_backend_optimization_level=0")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_ENABLE_X64", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("VIDAX_REPO", None)  # the pages run as written, with no variable of their own
    env["PYTHONUNBUFFERED"] = "1"
    if cache_dir is not None:
        # Pages compile many of the same small programs (random initializers, eager
        # ops): JAX's persistent compilation cache, shared by the pages of one run,
        # compiles each once. It changes no result, only the time.
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    return env


def run_page(page: Page, cache_dir: str | None = None) -> Result:
    """Runs the page's `python` blocks (except skipped ones) in a fresh process, with
    JAX's compilation cache in `cache_dir` if given."""
    blocks = [{"line": b.line, "source": b.source} for b in page.python if b.skip is None]
    with tempfile.TemporaryDirectory(prefix="vidax-docs-") as cwd:
        for name in _LINKED:  # as from the repository's root
            (pathlib.Path(cwd) / name).symlink_to(ROOT / name)
        spec = pathlib.Path(cwd) / ".docs_test_blocks.json"
        spec.write_text(json.dumps([str(page.path), blocks]), encoding="utf-8")
        start = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, "-c", _RUNNER, str(spec)], cwd=cwd,
                env=_environment(page.devices, cache_dir), capture_output=True, text=True,
                timeout=TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as e:
            decode = lambda s: s.decode(errors="replace") if isinstance(s, bytes) else (s or "")
            return Result(None, decode(e.stdout), decode(e.stderr), time.perf_counter() - start)
        return Result(done.returncode, done.stdout, done.stderr, time.perf_counter() - start)


_PAGES = {p.relative_to(ROOT).as_posix(): p for p in _pages()}
_POOL: dict[str, concurrent.futures.Future] = {}


@pytest.fixture(scope="session")
def page_runs(request):
    """Starts every selected page's process, `JOBS` at a time, on first use; each test
    then waits for its own page."""
    if not _POOL and not os.environ.get("PYTEST_XDIST_WORKER"):  # xdist: one page per test
        selected = [item.callspec.params["name"] for item in request.session.items
                    if getattr(item, "originalname", None) == "test_page"
                    and hasattr(item, "callspec")]
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=JOBS)
        cache = tempfile.TemporaryDirectory(prefix="vidax-docs-jax-cache-")
        request.addfinalizer(cache.cleanup)
        request.addfinalizer(lambda: pool.shutdown(wait=True, cancel_futures=True))
        pages = [parse(_PAGES[name]) for name in selected]
        # Longest first (a rough guess: the amount of code, more with several devices),
        # so that no long page starts last.
        cost = lambda p: sum(len(b.source) for b in p.python) * (1 + (p.devices or 1) / 8)
        for page in sorted(pages, key=cost, reverse=True):
            if page.python and not page.errors:
                _POOL[page.name] = pool.submit(run_page, page, cache.name)
    return _POOL


def _failed_line(stderr: str) -> str:
    running = re.findall(r"docs-test: running the block at line (\d+)", stderr)
    return running[-1] if running else "?"


@pytest.mark.slow  # every page's code in a process of its own: ~2 min in all
@pytest.mark.parametrize("name", sorted(_PAGES))
def test_page(name, page_runs):
    page = parse(_PAGES[name])
    assert not page.errors, f"{name}: invalid markers or fences:\n" + "\n".join(page.errors)
    if not [b for b in page.python if b.skip is None]:
        return
    future = page_runs.get(name)
    result = future.result() if future is not None else run_page(page)
    if result.returncode == 0:
        return
    line = _failed_line(result.stderr)
    tail = result.stderr[-STDERR_TAIL:]
    what = (f"timed out after {TIMEOUT_S} s" if result.returncode is None
            else f"exited with {result.returncode}")
    pytest.fail(
        f"{name}, the python block at line {line}: the page's process {what} "
        f"(after {result.seconds:.1f} s).\n--- stderr (tail) ---\n{tail}"
        + (f"\n--- stdout (tail) ---\n{result.stdout[-1500:]}" if result.stdout.strip() else ""),
        pytrace=False,
    )


def _skipped_blocks() -> list:
    params = []
    for name, path in sorted(_PAGES.items()):
        for block in parse(path).python:
            if block.skip is not None:
                params.append(pytest.param(name, block.line, block.skip, id=f"{name}:{block.line}"))
    return params


@pytest.mark.parametrize("name, line, reason", _skipped_blocks() or [
    pytest.param(None, None, None, id="none", marks=pytest.mark.skip(reason="no skipped blocks"))])
def test_skipped_block(name, line, reason):
    """One skip per block a page marks `skip`, with its reason: visible in `-ra`."""
    pytest.skip(f"{name}:{line}: {reason}")


def test_markers_are_valid():
    problems = [f"{page.name}: {error}"
                for page in map(parse, _PAGES.values()) for error in page.errors]
    assert not problems, "invalid docs-test markers or code fences:\n" + "\n".join(problems)


def test_parser_understands_the_marker_syntax(tmp_path):
    """The parser on a page with every marker form, valid and invalid."""
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- docs-test: devices=4 -->\n"
        "```python\nx = 1\n```\n"
        '<!-- docs-test: skip reason="needs a TPU" -->\n\n'
        "```python\ny = 2\n```\n"
        "```bash\nls\n```\n"
        "<!-- docs-test: skip -->\n"
        "```python\nz = 3\n```\n"
        '<!-- docs-test: skip reason="x" -->\n'
        "```bash\nls\n```\n"
        "<!-- docs-test: timeout=3 -->\n"
        "<!-- doc-test: devices=2 -->\n"
        "```py\nw = 4\n```\n"
        "  ```python\n  indented = True\n  ```\n",
        encoding="utf-8",
    )
    parsed = parse(page)
    assert parsed.devices == 4
    assert [(b.line, b.language, b.skip) for b in parsed.blocks] == [
        (2, "python", None), (7, "python", "needs a TPU"), (10, "bash", None),
        (14, "python", None), (18, "bash", None), (23, "py", None), (26, "python", None)]
    assert parsed.blocks[-1].source == "indented = True\n"
    errors = "\n".join(parsed.errors)
    for expected in ("line 13: a skip needs a reason",
                     "line 17: a skip marker must come right before",
                     "line 21: unknown marker",
                     "line 22: '<!-- doc-test: devices=2 -->' looks like",
                     "line 23: a code block tagged 'py'"):
        assert expected in errors, errors
    assert len(parsed.errors) == 5, errors


_TABLE_START, _TABLE_END = "<!-- feature-table:start -->", "<!-- feature-table:end -->"
_TABLE_BRIEF = "<!-- feature-table:start brief -->"  # the README's: without the notes


def test_feature_tables_are_current():
    """A page's copy of the feature table (between the markers of
    `scripts/feature_table.py`) is the one the capability flags generate."""
    from vidax_eqx import kernels

    stale = []
    for name, path in sorted(_PAGES.items()):
        text = path.read_text(encoding="utf-8")
        marker = next((m for m in (_TABLE_START, _TABLE_BRIEF) if m in text), None)
        if marker is None:
            continue
        table = kernels.feature_table(notes=marker == _TABLE_START).strip()
        start, end = text.index(marker) + len(marker), text.find(_TABLE_END)
        if end < start or text[start:end].strip() != table:
            stale.append(name)
    assert not stale, (
        f"stale feature tables in {stale}: run `python scripts/feature_table.py --write PAGE` "
        "for each"
    )
