"""The validators of `vidax_eqx.nn`'s constructor arguments: plain Python values (sizes,
head counts, epsilons), checked once at construction with one message per rule.

Each raises with the owner's name, the argument's name, the rule, and what was
received. The check of a `ParallelConfig` argument, `check_parallel`, lives beside the class
in `_parallel.py`, which uses it too.
"""

from .._checks import check_positive


def check_heads(owner: str, dim: int, num_heads: int) -> int:
    """`head_dim = dim / num_heads`, after checking that both are positive ints and that
    `num_heads` divides `dim`."""
    check_positive(owner, dim=dim, num_heads=num_heads)
    if dim % num_heads:
        raise ValueError(
            f"{owner}: `dim` must be a multiple of `num_heads` (head_dim = dim / num_heads); "
            f"received dim={dim}, num_heads={num_heads}."
        )
    return dim // num_heads


def check_eps(owner: str, eps) -> float:
    """`eps` as a float: finite and >= 0 (a negative one makes `rsqrt` NaN silently)."""
    if isinstance(eps, (bool, str, bytes)):
        raise TypeError(f"{owner}: `eps` must be a number; received {type(eps).__name__} {eps!r}.")
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"{owner}: `eps` must be a number; received {type(eps).__name__}.") from None
    if not (value >= 0 and value != float("inf")):
        raise ValueError(
            f"{owner}: `eps` must be a finite number >= 0 (it is added to the variance "
            f"before rsqrt; a negative one gives NaN); received {eps!r}."
        )
    return value
