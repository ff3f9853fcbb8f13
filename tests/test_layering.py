"""The package's import graph stays as drawn in DESIGN.md.

Four rules, read from the source with `ast` (imports inside functions count: that
is where cycles hide):

1. Arrows only point down the floors `kernels` <- `parallel` <- `nn` <-
   `core` / `flax` / `ring_splash` / `interop` <- `models` <- `sampling` <- `pipelines` <-
   `generate` (the command); the private top-level
   modules (`vidax_eqx/_order.py`, ...) are the floor under all of them.
2. No import cycle between modules. A package's `__init__.py` re-exporting its own
   children is not an edge of the cycle check (that is how a facade is built).
3. Inside a package, an implementation module never imports the package's facade:
   its `__init__.py` or a public module that only re-exports (`nn.functional`).
4. Across packages, a module imports only another package's public modules: its
   `__init__`, a public facade (`nn.sharding`), or its documented internal facade
   (`kernels.internal`, `nn.internal`, `models.internal`); never a private module
   (`nn._init`). The private top-level modules (`_checks`, `_order`, ...) are the floor
   under every package and open to all.

Each rule is checked on the real package and, so that the checks can fail, on small
hand-made graphs that break it.
"""

import ast
import pathlib

import pytest

PACKAGE = "vidax_eqx"
ROOT = pathlib.Path(__file__).resolve().parent.parent / PACKAGE

# Floor of each top-level part of the package. The private top-level modules
# (`_order`, `_vma`, `_jax_private`) are floor 0; the package's own `__init__` is above all.
FLOORS = {"kernels": 1, "parallel": 2, "nn": 3, "core": 4, "flax": 4, "interop": 4, "ring_splash": 4,
          "models": 5, "sampling": 6, "pipelines": 7, "generate": 8}
# Imports between different parts of one floor that the design names: the linen
# shim is a thin layer over `core`'s functions.
SIDEWAYS = {("flax", "core")}


# -- reading the graph ---------------------------------------------------------------


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_package() -> tuple[dict[str, set[str]], set[str], set[str]]:
    """`(imports, packages, facades)`: each module's imported package modules, the
    names that are packages (have an `__init__.py`), and the facade modules."""
    files = {_module_name(f): f for f in ROOT.rglob("*.py")}
    packages = {name for name, f in files.items() if f.name == "__init__.py"}
    facades = set(packages)
    imports: dict[str, set[str]] = {}
    for name, f in files.items():
        tree = ast.parse(f.read_text(), filename=str(f))
        base = name if name in packages else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = base.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    origin = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                if origin.split(".")[0] != PACKAGE:
                    continue
                # `from pkg import child` imports the module `pkg.child` when it is one.
                children = [f"{origin}.{a.name}" for a in node.names if f"{origin}.{a.name}" in files]
                found.update(children)
                if len(children) < len(node.names):
                    found.add(origin)
        imports[name] = {_deepest(m, files) for m in found} - {name}
        leaf = name.rpartition(".")[2]
        body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        if name not in packages and not leaf.startswith("_") and body and all(
            isinstance(n, (ast.Import, ast.ImportFrom)) for n in body
        ):
            facades.add(name)
    return imports, packages, facades


def _deepest(module: str, files) -> str:
    while module not in files:
        module = module.rpartition(".")[0]
    return module


# -- the rules ------------------------------------------------------------------------


def _part(module: str) -> str | None:
    """The top-level part of the package that `module` belongs to: a subpackage or
    top-level module, `"_"` for the private top-level modules, None for the root."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    return "_" if parts[1].startswith("_") else parts[1]


def _floor(module: str) -> float:
    part = _part(module)
    if part is None:
        return float("inf")
    return 0 if part == "_" else FLOORS[part]


def upward_arrows(imports: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(imports.items()):
        for dst in sorted(targets):
            s, d = _part(src), _part(dst)
            if s == d:
                continue
            if _floor(dst) > _floor(src) or (_floor(dst) == _floor(src) and (s, d) not in SIDEWAYS):
                bad.append(f"{src} -> {dst}")
    return bad


def cycles(imports: dict[str, set[str]], packages: set[str]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), after
    dropping each package `__init__`'s edges to its own descendants."""
    graph = {
        m: sorted(d for d in ds if not (m in packages and d.startswith(m + ".")))
        for m, ds in imports.items()
    }
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def facade_imports(imports: dict[str, set[str]], packages: set[str], facades: set[str]) -> list[str]:
    """Implementation modules importing a facade of their own package (or of a package
    that contains them)."""
    bad = []
    for src, targets in sorted(imports.items()):
        if src in packages or src in facades:
            continue
        for dst in sorted(targets):
            owner = dst if dst in packages else dst.rpartition(".")[0]
            if dst == PACKAGE or (dst in facades and src.startswith(owner + ".")):
                bad.append(f"{src} -> {dst}")
    return bad


def private_imports(imports: dict[str, set[str]]) -> list[str]:
    """Imports of another top-level part's private module (a path segment below the
    part that starts with `_`)."""
    bad = []
    for src, targets in sorted(imports.items()):
        for dst in sorted(targets):
            s, d = _part(src), _part(dst)
            if d in (None, "_") or s == d:
                continue
            if any(seg.startswith("_") for seg in dst.split(".")[2:]):
                bad.append(f"{src} -> {dst}")
    return bad


# -- on the package -------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph():
    return read_package()


def test_the_graph_is_read(graph):
    imports, packages, facades = graph
    assert {"vidax_eqx.kernels", "vidax_eqx.parallel", "vidax_eqx.nn", "vidax_eqx.models"} <= packages
    assert "vidax_eqx.nn.functional" in facades
    # A folder inside a part is a package of that part: `nn.sharding`'s files are `nn`'s.
    assert "vidax_eqx.nn.sharding" in packages and _part("vidax_eqx.nn.sharding._fsdp") == "nn"
    # A relative import resolves to the module it names.
    assert "vidax_eqx.kernels" in imports["vidax_eqx.parallel._fronts"]
    assert all(m in imports for ds in imports.values() for m in ds)


def test_arrows_point_down(graph):
    imports, _, _ = graph
    assert upward_arrows(imports) == []


def test_no_import_cycle(graph):
    imports, packages, _ = graph
    assert cycles(imports, packages) == []


def test_no_module_imports_its_own_facade(graph):
    assert facade_imports(*graph) == []


def test_no_private_import_across_packages(graph):
    imports, _, _ = graph
    assert private_imports(imports) == []
    # The internal facades are where such imports go instead.
    assert "vidax_eqx.nn.internal" in imports["vidax_eqx.models.wan._model"]


# -- the checks can fail ---------------------------------------------------------------


def test_the_checks_find_what_they_guard():
    imports = {
        "vidax_eqx": {"vidax_eqx.kernels"},
        "vidax_eqx.kernels": {"vidax_eqx.kernels._a"},
        "vidax_eqx.kernels._a": {"vidax_eqx.kernels._b", "vidax_eqx.parallel"},  # up
        "vidax_eqx.kernels._b": {"vidax_eqx.kernels._a", "vidax_eqx._order"},  # cycle a <-> b
        "vidax_eqx.parallel": {"vidax_eqx.parallel._r"},
        "vidax_eqx.parallel._r": {"vidax_eqx.kernels", "vidax_eqx.parallel"},  # own facade
        "vidax_eqx.flax": {"vidax_eqx.core", "vidax_eqx.interop"},  # allowed, sideways
        "vidax_eqx.core": set(),
        "vidax_eqx.interop": set(),
        "vidax_eqx._order": set(),
    }
    packages = {"vidax_eqx", "vidax_eqx.kernels", "vidax_eqx.parallel"}
    assert upward_arrows(imports) == ["vidax_eqx.flax -> vidax_eqx.interop", "vidax_eqx.kernels._a -> vidax_eqx.parallel"]
    assert cycles(imports, packages) == [["vidax_eqx.kernels._a", "vidax_eqx.kernels._b"]]
    assert facade_imports(imports, packages, packages) == ["vidax_eqx.parallel._r -> vidax_eqx.parallel"]
    crossing = {
        "vidax_eqx.models._m": {"vidax_eqx.nn._init", "vidax_eqx.nn.internal", "vidax_eqx.nn",
                                "vidax_eqx._order", "vidax_eqx.models._n"},
        "vidax_eqx.models.wan._w": {"vidax_eqx.models._base", "vidax_eqx.parallel._ring"},
    }
    assert private_imports(crossing) == ["vidax_eqx.models._m -> vidax_eqx.nn._init",
                                         "vidax_eqx.models.wan._w -> vidax_eqx.parallel._ring"]
