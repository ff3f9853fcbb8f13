"""Deprecated spellings: an old public name, keyword or attribute keeps working for one
release, with a warning that names its replacement and the release that removes it.

The rule (docs: conventions): no public name leaves without a deprecation release. Each
package routes its old spellings through the three helpers here:

- [`moved`][]: a module `__getattr__` for names that moved or were renamed;
- [`renamed_keywords`][]: a decorator accepting a function's old keyword names;
- [`warn_deprecated`][]: the warning itself, for anything else (an old attribute as a
    property, an old positional form).

The warning's category is `VidaxDeprecationWarning`, a `DeprecationWarning`, shown once
per call site (Python's `"default"` action; a filter for this category alone is added
on import, so that users see it outside `__main__` too, as they would not a plain
`DeprecationWarning`).
"""

import functools
import importlib
import warnings


SINCE = "0.2.0"
REMOVED_IN = "0.3.0"


class VidaxDeprecationWarning(DeprecationWarning):
    """A vidax_eqx spelling that will be removed: the message names the new one."""


warnings.filterwarnings("default", category=VidaxDeprecationWarning)


def warn_deprecated(old: str, new: str, *, stacklevel: int = 2) -> None:
    """Warns that `old` is deprecated in favour of `new`.

    `stacklevel` counts from the caller of this function (2: the caller's caller, the
    user's line when called from a wrapper or a module `__getattr__`).
    """
    warnings.warn(
        f"{old} is deprecated since vidax_eqx {SINCE} and will be removed in {REMOVED_IN}: "
        f"use {new} instead.",
        VidaxDeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def moved(module: str, names: dict[str, str]):
    """A module-level `__getattr__` serving old names.

    **Arguments:**

    - `module`: the module's dotted name (`__name__`).
    - `names`: old attribute -> the new object's dotted path
        (`"vidax_eqx.nn.sharding.ParallelConfig"`), imported on first use.

    Assign the result to the module's `__getattr__`.
    """

    def __getattr__(name: str):
        target = names.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn_deprecated(f"{module}.{name}", target, stacklevel=2)
        path, _, attr = target.rpartition(".")
        return getattr(importlib.import_module(path), attr)

    return __getattr__


def renamed_keywords(**old_to_new: str):
    """Decorates a function so that each old keyword `old=...` is passed as `new=...`,
    with a warning; both at once is a `TypeError`."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(
                            f"{fn.__qualname__}() got both `{old}` (deprecated) and `{new}`: "
                            f"pass `{new}` only."
                        )
                    warn_deprecated(f"{fn.__qualname__}({old}=...)", f"`{new}=`", stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper

    return decorate
