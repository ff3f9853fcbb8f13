"""The API reference (`docs/api/*.md`) covers every public name, and every public name
has a docstring.

A name is public if and only if its package re-exports it (STYLE.md): in
`vidax_eqx.kernels`, `.parallel`, `.nn`, `.nn.functional`, `.nn.sharding`, `.core`,
`.flax`, `.ring_splash`, `.interop`, `.models`, `.models.wan`, `.models.cogvideox` and `.sampling`,
the names listed in `__all__` where the module has one, else the names imported as
themselves (`from ._x import Y as Y`) and the functions, classes and constants defined
there without a leading underscore. Each must appear in an API page as a mkdocstrings
entry `::: vidax_eqx.<package>.<name>`, and every entry must name a package or one of
its public names (no stale entries). An object that two of these packages re-export
(`models.wan.WanTransformer3D` is `models.WanTransformer3D`) is documented once, under
either of them; `core` and `flax`, which re-export the lower layers' objects under the
original `vidax.core` names, still carry an entry for each of their names.

Every public function and class has a docstring, and so does every `__call__` of a
public class and every explicit `__init__` (unless the class docstring has the
`**Arguments:**`); public constants carry an attribute docstring
(a string right after the assignment, which mkdocstrings renders), and a re-exported
module a module docstring.

Everything is read from the source with `ast`: nothing is imported, so this runs in
well under a second and needs neither JAX nor Flax nor the docs tools. Whether the
pages render (references resolve, Markdown is valid) is `mkdocs build --strict`'s job,
in `.ci/run`.
"""

import ast
import dataclasses
import pathlib
import re

import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent
API_DIR = ROOT / "docs" / "api"
PACKAGES = (
    "vidax_eqx",
    "vidax_eqx.kernels",
    "vidax_eqx.parallel",
    "vidax_eqx.nn",
    "vidax_eqx.nn.functional",
    "vidax_eqx.nn.sharding",
    "vidax_eqx.core",
    "vidax_eqx.flax",
    "vidax_eqx.ring_splash",
    "vidax_eqx.interop",
    "vidax_eqx.models",
    "vidax_eqx.models.wan",
    "vidax_eqx.models.cogvideox",
    "vidax_eqx.sampling",
    "vidax_eqx.pipelines",
    "vidax_eqx.generate",
)
# Packages that only re-export, under their own name, objects that another package of
# PACKAGES documents: an entry for the same object under either package covers them.
# (`core` and `flax` are not here: their names are the original API, each documented.)
FOLDERS = {"vidax_eqx.models.wan": "vidax_eqx.models", "vidax_eqx.models.cogvideox": "vidax_eqx.models"}
_ENTRY = re.compile(r"^:::\s+(?P<path>[\w.]+)\s*$", re.MULTILINE)


def _source_file(module: str) -> pathlib.Path:
    path = ROOT.joinpath(*module.split("."))
    if path.is_dir():
        return path / "__init__.py"
    return path.with_suffix(".py")


def _is_package(module: str) -> bool:
    return ROOT.joinpath(*module.split(".")).is_dir()


def _parse(module: str) -> ast.Module:
    return ast.parse(_source_file(module).read_text(encoding="utf-8"), filename=str(_source_file(module)))


def _absolute(module: str, node: ast.ImportFrom) -> str | None:
    """The absolute module an ImportFrom reads from, or None outside vidax_eqx."""
    if node.level == 0:
        name = node.module or ""
        return name if name == "vidax_eqx" or name.startswith("vidax_eqx.") else None
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _all(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return [ast.literal_eval(e) for e in node.value.elts]
    return None


def _assigned_names(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def public_names(module: str) -> list[str]:
    tree = _parse(module)
    explicit = _all(tree)
    if explicit is not None:
        return explicit
    names = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names += [a.name for a in node.names if a.asname == a.name]
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        else:
            names += _assigned_names(node)
    return [n for n in names if not n.startswith("_")]


@dataclasses.dataclass
class Definition:
    module: str  # where it is defined
    kind: str  # "function", "class", "constant" or "module"
    node: ast.AST | None
    docstring: str | None


def _attribute_docstring(body: list[ast.stmt], index: int) -> str | None:
    following = body[index + 1] if index + 1 < len(body) else None
    if (
        isinstance(following, ast.Expr)
        and isinstance(following.value, ast.Constant)
        and isinstance(following.value.value, str)
    ):
        return following.value.value
    return None


def _blocks(body: list[ast.stmt]):
    """The statement lists a module runs at import: its body and, recursively, the
    branches of its top-level `try` and `if` (guarded imports of optional backends)."""
    yield body
    for node in body:
        if isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _blocks(block)
        elif isinstance(node, ast.If):
            yield from _blocks(node.body)
            yield from _blocks(node.orelse)


def resolve(module: str, name: str, seen=()) -> Definition:
    """Follows re-exports (`from .x import name`) to where `name` is defined.

    Definitions win over imports, and imports over assignments (so `X = None` in the
    fallback of a guarded `from ._x import X` is not taken for the definition)."""
    if (module, name) in seen:
        raise AssertionError(f"import cycle resolving {module}.{name}")
    seen = (*seen, (module, name))
    tree = _parse(module)
    blocks = list(_blocks(tree.body))
    for body in blocks:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return Definition(module, "function", node, ast.get_docstring(node))
            if isinstance(node, ast.ClassDef) and node.name == name:
                return Definition(module, "class", node, ast.get_docstring(node))
    for node in (node for body in blocks for node in body):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) != name:
                    continue
                source = _absolute(module, node)
                if source is None:
                    raise AssertionError(
                        f"{module}.{name} is imported from outside vidax_eqx ({node.module})"
                    )
                submodule = f"{source}.{alias.name}"
                if _source_file(submodule).exists():  # `from . import functional`
                    return Definition(submodule, "module", None, ast.get_docstring(_parse(submodule)))
                return resolve(source, alias.name, seen)
    for body in blocks:
        for index, node in enumerate(body):
            if name in _assigned_names(node):
                return Definition(module, "constant", node, _attribute_docstring(body, index))
    raise AssertionError(f"{module}.{name} is public but neither defined nor imported there")


def _api_entries() -> dict[str, list[str]]:
    entries: dict[str, list[str]] = {}
    for page in sorted(API_DIR.glob("*.md")):
        for match in _ENTRY.finditer(page.read_text(encoding="utf-8")):
            entries.setdefault(match["path"], []).append(page.name)
    return entries


PUBLIC = [(package, name) for package in PACKAGES for name in public_names(package)]


def test_every_package_has_public_names():
    for package in PACKAGES:
        assert public_names(package), f"{package}: no public names found (parser broken?)"


def _same_object(package: str, name: str, other: str) -> bool:
    """Whether `other.name` is public and the same object as `package.name` (both
    re-exports of one definition)."""
    if name not in public_names(other):
        return False
    a, b = resolve(package, name), resolve(other, name)
    return (a.module, a.kind, getattr(a.node, "lineno", None)) == (
        b.module, b.kind, getattr(b.node, "lineno", None))


def _documented(package: str, name: str, entries) -> bool:
    if f"{package}.{name}" in entries:
        return True
    # A folder's name documented under the package that re-exports it, or the reverse.
    others = [FOLDERS[package]] if package in FOLDERS else [
        folder for folder, parent in FOLDERS.items() if parent == package]
    return any(f"{other}.{name}" in entries and _same_object(package, name, other)
               for other in others)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_has_an_api_entry(package):
    entries = _api_entries()
    missing = [name for name in public_names(package) if not _documented(package, name, entries)]
    assert not missing, (
        f"{package} re-exports {missing}, but no page of docs/api/ documents them. Add "
        f"`::: {package}.<name>` to the package's page (docs/api/), or make the name "
        "private if it is not meant to be public."
    )
    assert package in entries, f"no page of docs/api/ renders the docstring of {package} (`::: {package}`)"


def test_api_entries_name_public_objects():
    public = {f"{package}.{name}" for package, name in PUBLIC} | set(PACKAGES)
    stale = {path: pages for path, pages in _api_entries().items() if path not in public}
    assert not stale, (
        f"docs/api/ documents names that are not public (not re-exported by a package): "
        f"{stale}. Remove the entries, or re-export the names."
    )


def test_api_entries_are_unique():
    twice = {path: pages for path, pages in _api_entries().items() if len(pages) > 1}
    assert not twice, f"documented more than once (duplicate anchors): {twice}"


@pytest.mark.parametrize("package", PACKAGES)
def test_package_has_a_docstring(package):
    assert ast.get_docstring(_parse(package)), f"{package} has no module docstring"


@pytest.mark.parametrize("package, name", PUBLIC, ids=[f"{p}.{n}" for p, n in PUBLIC])
def test_public_name_has_a_docstring(package, name):
    definition = resolve(package, name)
    where = f"{package}.{name} ({definition.kind} defined in {definition.module})"
    assert definition.docstring and definition.docstring.strip(), (
        f"{where} has no docstring. Public names are documented in the house style "
        "(Markdown, **Arguments:** / **Returns:**); a constant takes a string literal "
        "right after its assignment."
    )
    if definition.kind == "class":
        # An `__init__` may leave its arguments to the class docstring (the masks'
        # style); a `__call__` documents its own.
        arguments_in_class = "**Arguments:**" in definition.docstring
        for node in definition.node.body:
            if not isinstance(node, ast.FunctionDef) or ast.get_docstring(node):
                continue
            if node.name == "__call__" or (node.name == "__init__" and not arguments_in_class):
                raise AssertionError(f"{where}: `{node.name}` has no docstring")
