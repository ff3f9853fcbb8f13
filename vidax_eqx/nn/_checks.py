"""The validators of `vidax_eqx.nn`'s constructor arguments: plain Python values (sizes,
head counts, epsilons), checked once at construction with one message per rule.

Each raises with the owner's name, the argument's name, the rule, and what was
received. The check of a `ParallelConfig` argument, `check_parallel`, lives beside the class
in `sharding/_config.py`.
"""

from .._checks import check_positive
from .sharding._config import check_parallel


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


def check_attention(owner: str, dim: int, num_heads: int, *, eps, parallel, qk_norm,
                    qk_norms: tuple) -> tuple[int, float]:
    """`(head_dim, eps)` of an attention layer's constructor arguments, after the checks
    every attention layer makes: positive `dim` and `num_heads` with `num_heads` dividing
    `dim`, a valid `eps`, a `ParallelConfig`, and `qk_norm` one of `qk_norms`."""
    head_dim = check_heads(owner, dim, num_heads)
    eps = check_eps(owner, eps)
    check_parallel(owner, parallel)
    if qk_norm not in qk_norms:
        choices = " or ".join(repr(n) for n in qk_norms)
        raise ValueError(f"{owner}: `qk_norm` must be {choices}; received {qk_norm!r}.")
    return head_dim, eps
