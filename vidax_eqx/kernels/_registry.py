"""The registry of implementations and the `"auto"` choice."""

from ._base import AbstractImplementation, Request
from ._blockwise import Blockwise
from ._xla import Xla


# Default-configured instances, by name. Optional backends (which need a
# platform or an import that may be missing) register themselves with
# `register` from a guarded import.
_REGISTRY: dict[str, AbstractImplementation] = {}


def register(impl: AbstractImplementation) -> None:
    """Makes `impl` available as `implementation=impl.name`."""
    _REGISTRY[impl.name] = impl


register(Xla())
register(Blockwise())


# On CPU "xla" is faster while the float32 score matrix is small; above this
# many bytes "blockwise" wins (measured by benchmarks/attention.py, see
# benchmarks/NOTES.md) and the materializing path's memory grows as S^2.
AUTO_XLA_MAX_SCORE_BYTES = 8 * 2**20


def implementations() -> dict[str, AbstractImplementation]:
    """The registered implementations, by name (default configuration)."""
    return dict(_REGISTRY)


def _preference(request: Request) -> list[str]:
    """Names in the order `"auto"` tries them for `request`."""
    if request.score_bytes <= AUTO_XLA_MAX_SCORE_BYTES:
        return ["xla", "blockwise"]
    return ["blockwise", "xla"]


def resolve(implementation, request: Request) -> AbstractImplementation:
    """The implementation that serves `request`, or a clear error."""
    if isinstance(implementation, AbstractImplementation):
        impl = implementation
    elif implementation == "auto":
        reasons = {}
        for name in _preference(request):
            impl = _REGISTRY[name]
            missing = impl.unsupported(request)
            if not missing:
                return impl
            reasons[name] = missing
        raise NotImplementedError(
            "no registered attention implementation serves this request: "
            + "; ".join(f"{n}: {', '.join(r)}" for n, r in reasons.items())
        )
    elif isinstance(implementation, str) and implementation in _REGISTRY:
        impl = _REGISTRY[implementation]
    else:
        raise ValueError(
            f"`implementation` must be 'auto', one of {sorted(_REGISTRY)}, or an "
            f"AbstractImplementation instance; received {implementation!r}."
        )
    missing = impl.unsupported(request)
    if missing:
        raise NotImplementedError(
            f"implementation {impl.name!r} does not support: {', '.join(missing)}. "
            "Use implementation='auto' to fall back to one that does."
        )
    return impl
