"""Runtime shape checks in one voice: jaxtyping + beartype check every public module's
and function's arrays, and a failure reads as the library's other errors do.

`@checked` replaces `@jaxtyped(typechecker=beartype)`. jaxtyping still does the
checking (the annotations are the specification); its failure, a 10-20 line dump whose
expected type reads `'*batch {self.dim}'`, becomes a `ShapeError` (a subclass of
jaxtyping's `TypeCheckError`, so of `TypeError`) of one to three lines::

    RMSNorm(dim=64): `x` must be a float array (..., 64); received float32 (32, 48).

naming the module (with its sizes) or the function, the argument, the expected shape
with every size it can resolve (from the module's fields, and from the other arguments
of the call: `S = 12 as in x`), and what was received. A per-example module given one
leading axis too many says to map it with `jax.vmap`. jaxtyping's own text stays on the
error as `details`.

The checks run where the call is traced (once per compilation under `jax.jit`), and
eagerly on every call outside it. `set_shape_checks(False)` (or the environment
variable `VIDAX_SHAPE_CHECKS=0`, read at import) turns them off, for a production
server that calls modules eagerly; they are on by default.
"""

import functools
import inspect
import os
import re
import types
import typing

import numpy as np
from beartype import beartype
from jaxtyping import jaxtyped, TypeCheckError


_ENABLED = os.environ.get("VIDAX_SHAPE_CHECKS", "1").strip().lower() not in ("0", "false", "no", "off")


def set_shape_checks(enabled: bool) -> None:
    """Turns the runtime shape checks of every vidax_eqx module and function on or off
    (default on; `VIDAX_SHAPE_CHECKS=0` starts with them off). Off, a wrong shape fails
    wherever the computation first trips on it, or not at all."""
    global _ENABLED
    if not isinstance(enabled, bool):
        raise TypeError(f"set_shape_checks takes a bool; received {enabled!r}.")
    _ENABLED = enabled


def shape_checks_enabled() -> bool:
    """Whether the runtime shape checks are on ([`set_shape_checks`][])."""
    return _ENABLED


class ShapeError(TypeCheckError):
    """A call whose arguments do not have the annotated shapes or dtypes. `details`
    holds jaxtyping's full report."""

    def __init__(self, message: str, details: str = ""):
        """**Arguments:** the message, and jaxtyping's report (`details`)."""
        super().__init__(message)
        self.details = details


def checked(fn):
    """`jaxtyped(typechecker=beartype)` with the failure as a `ShapeError` (see the
    module docstring); skipped when the checks are off."""
    checked_fn = jaxtyped(typechecker=beartype)(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not _ENABLED:
            return fn(*args, **kwargs)
        try:
            return checked_fn(*args, **kwargs)
        except ShapeError:
            raise  # (a nested checked call's, already in words)
        except TypeCheckError as error:
            message = _message(fn, args, kwargs, str(error))
            if message is None:
                raise
            raise ShapeError(message, str(error)) from None

    return call


# -- the message ------------------------------------------------------------------------

_KINDS = {"Float": "a float array", "Int": "an int array", "Bool": "a bool array",
          "Shaped": "an array", "Inexact": "a float or complex array", "Real": "a real array",
          "Integer": "an integer array", "Num": "a numeric array", "UInt": "an unsigned int array",
          "Complex": "a complex array", "Key": "a PRNG key array"}


def _owner(fn, bound: dict) -> tuple[str, str]:
    """`(who, what to vmap)`: `"RMSNorm(dim=64)", "module"` or `"rms_norm", "rms_norm"`."""
    self = bound.get("self")
    if self is None:
        return fn.__name__, fn.__name__
    try:  # the sizes its constructor takes, in their order (`dim`, `num_heads`, ...)
        names = list(inspect.signature(type(self).__init__).parameters)[1:]
    except (TypeError, ValueError):
        names = []
    sizes = []
    for name in names:
        value = getattr(self, name, None)
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            sizes.append(f"{name}={int(value)}")
    who = type(self).__name__ + (f"({', '.join(sizes[:4])})" if sizes else "")
    return who, "module"


def _members(annotation) -> tuple:
    """A union's members, or the annotation itself."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _array_types(annotation) -> list:
    """The jaxtyping array types among an annotation's members."""
    return [m for m in _members(annotation) if hasattr(m, "dim_str") and hasattr(m, "dtypes")]


def _tokens(array_type) -> list[str]:
    return array_type.dim_str.split()


def _evaluate(expression: str, scope: dict):
    try:
        value = eval(expression, {}, scope)  # noqa: S307  (an annotation of this package)
    except Exception:  # noqa: BLE001  (unresolvable: shown by name)
        return None
    return int(value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else None


def _size_of(token: str, scope: dict, sizes: dict) -> tuple[str | None, int | None]:
    """`(name, size)` of one dimension token: the name it binds (None for a fixed size)
    and its size when known."""
    token = token.lstrip("#")
    if token.startswith("{") and token.endswith("}"):
        return None, _evaluate(token[1:-1], scope)
    if token.isdigit():
        return None, int(token)
    if token in ("_", "..."):
        return None, None
    if re.fullmatch(r"[A-Za-z_]\w*", token):
        return token, sizes.get(token)
    return None, _evaluate(token, {**scope, **sizes})  # e.g. "2*dim"


def _split(tokens: list[str]) -> tuple[list[str], bool, list[str]]:
    """`(before, variadic, after)` around a `*name` / `...` token."""
    for i, token in enumerate(tokens):
        if token.startswith("*") or token == "...":
            return tokens[:i], True, tokens[i + 1:]
    return tokens, False, []


def _bind(tokens: list[str], shape: tuple, scope: dict, sizes: dict, source: dict, arg: str) -> None:
    """Adds the named sizes of an argument that passed its check."""
    before, variadic, after = _split(tokens)
    if (len(shape) < len(before) + len(after)) if variadic else len(shape) != len(before):
        return
    pairs = list(zip(before, shape)) + (list(zip(after, shape[len(shape) - len(after):])) if after else [])
    star = next((t for t in tokens if t.startswith("*") and len(t) > 1), None)
    if star is not None:  # a named variadic part (`*shape`): the dims between
        name = star.lstrip("*#")
        if name not in sizes:
            sizes[name], source[name] = tuple(shape[len(before):len(shape) - len(after)]), arg
    for token, size in pairs:
        name, _ = _size_of(token, scope, sizes)
        if name is not None and name not in sizes and not (token.startswith("#") and size == 1):
            sizes[name], source[name] = int(size), arg


def _expected(tokens: list[str], scope: dict, sizes: dict, source: dict) -> tuple[str, list[str]]:
    """The expected shape with the sizes resolved, and the names resolved from other
    arguments (for the message's `S = 12 as in x`)."""
    parts, used = [], []
    for token in tokens:
        if token.startswith("*") or token == "...":
            name = token.lstrip("*#")
            if "#" not in token and isinstance(sizes.get(name), tuple) and name in source:
                parts += [str(d) for d in sizes[name]]
                used.append(f"{name} = {sizes[name]} as in `{source[name]}`")
            else:
                parts.append("...")
            continue
        name, size = _size_of(token, scope, sizes)
        parts.append(str(size) if size is not None else (name or token.strip("{}")))
        if size is not None:  # the sizes it took from other arguments (`T+S`: both)
            for word in re.findall(r"[A-Za-z_]\w*", token):
                if word in source and word in sizes:
                    used.append(f"{word} = {sizes[word]} as in `{source[word]}`")
    comma = "," if len(parts) == 1 and parts[0] != "..." else ""
    shape = "(" + ", ".join(parts) + comma + ")"
    return shape, used


def _received(value) -> str:
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{getattr(dtype, 'name', None) or np.dtype(dtype).name} {tuple(shape)}"
    if isinstance(value, tuple):
        return "a tuple (" + ", ".join(_received(v) for v in value) + ")"
    return "None" if value is None else f"a {type(value).__name__}"


def _message(fn, args, kwargs, report: str) -> str | None:
    """The one-voice message for jaxtyping's `report`, or None to keep jaxtyping's."""
    found = re.search(r"typechecking parameter '(\w+)'", report)
    if found is None:
        return None  # (the return value, or something else: an internal error)
    name = found.group(1)
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    who, mapped = _owner(fn, arguments)
    annotation = fn.__annotations__.get(name)
    value = arguments.get(name)
    array_types = _array_types(annotation)

    scope = dict(arguments)
    sizes, source = {}, {}
    for other, other_value in arguments.items():  # sizes named by the arguments that passed
        if other == name or not hasattr(other_value, "shape"):
            continue
        for other_type in _array_types(fn.__annotations__.get(other)):
            _bind(_tokens(other_type), tuple(other_value.shape), scope, sizes, source, other)

    notes = []

    def describe(array_type) -> str:
        shape, used = _expected(_tokens(array_type), scope, sizes, source)
        notes.extend(u for u in used if u not in notes)
        return f"{_kind(array_type)} {shape}"

    options = []
    for member in _members(annotation):
        if member is type(None):
            options.append("None")
        elif member in array_types:
            options.append(describe(member))
        elif typing.get_origin(member) is tuple and all(_array_types(a) for a in typing.get_args(member)):
            options.append("a tuple (" + ", ".join(describe(a) for a in typing.get_args(member)) + ")")
        else:
            options.append(getattr(member, "__name__", repr(member)))
    message = f"{who}: `{name}` must be {' or '.join(options)}; received {_received(value)}"
    if notes:
        message += f" ({', '.join(notes)})"
    message += "."
    shape = getattr(value, "shape", None)
    if shape is not None and any(_one_example_more(t, tuple(shape), scope, sizes) for t in array_types):
        call = f"jax.vmap({mapped})" if mapped != "module" else "jax.vmap(module)"
        message += (f"\nIt takes one example, and `{name}` has one leading axis more: map it over "
                    f"the batch with {call}(...).")
    return message


def _kind(array_type) -> str:
    name = getattr(array_type, "__name__", "")
    for prefix, kind in _KINDS.items():
        if name.startswith(prefix + "["):
            return kind
    return "an array"


def _one_example_more(array_type, shape: tuple, scope: dict, sizes: dict) -> bool:
    """Whether `shape` is the annotation's fixed-rank shape with one axis in front."""
    before, variadic, _ = _split(_tokens(array_type))
    if variadic or len(shape) != len(before) + 1:
        return False
    for token, size in zip(before, shape[1:]):
        _, want = _size_of(token, scope, sizes)
        if want is not None and want != size and not (token.startswith("#") and size == 1):
            return False
    return True
