"""The validators floor: plain-Python checks of arguments that every package shares
(sizes, static ints, reals), each raising with the owner's name, the argument's name,
the rule and what was received.

Private to the package and below every floor (like `_order`, `_vma`): `kernels`,
`parallel`, `nn`, `interop`, `models` and `sampling` all import it.
"""

import numpy as np


def is_int(x) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def is_real(x) -> bool:
    """A Python or NumPy real number (integer or floating), not a bool."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def positive_int(owner: str, name: str, value) -> int:
    """`value` as an int, after checking that it is an integer >= 1 (not a bool)."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{owner}: `{name}` must be a positive int; received {value!r}.")
    return int(value)


def check_positive(owner: str, **sizes) -> None:
    """Raises unless every value of `sizes` (argument name -> value) is an int >= 1 (not
    a bool), checked in the order given."""
    for name, value in sizes.items():
        positive_int(owner, name, value)


def static_int(name: str, x) -> int:
    """`x` as an int, or a `ValueError` unless it is a Python (or NumPy) int: it sets shapes."""
    if not is_int(x):
        shape = getattr(x, "shape", None)
        got = (f"a {type(x).__name__} of shape {tuple(shape)}" if shape is not None
               else f"{type(x).__name__} {x!r}")
        raise ValueError(
            f"`{name}` must be a Python int (static: it sets shapes); received {got}."
        )
    return int(x)
