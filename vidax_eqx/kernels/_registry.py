"""The registry of implementations and the `"auto"` / `"portable"` choices."""

import dataclasses

from ._base import AbstractImplementation, Request
from ._dispatch import PLATFORMS, Plan, host_platform
from ._blockwise import Blockwise
from ._cudnn import Cudnn
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
# The Pallas kernels reach into JAX modules (and private entry points of them)
# that a JAX version may lack; without them the implementation is simply absent.
try:
    from .pallas_tpu._implementation import PallasTpu
except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX version
    PallasTpu = None
else:
    register(PallasTpu())
try:
    from ._pallas_gpu import PallasGpu
except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX version
    PallasGpu = None
else:
    register(PallasGpu())
register(Cudnn())


# On CPU "xla" is faster while the float32 score matrix is small; above this
# many bytes "blockwise" wins (measured by benchmarks/attention.py, see
# benchmarks/NOTES.md) and the materializing path's memory grows as S^2.
AUTO_XLA_MAX_SCORE_BYTES = 8 * 2**20
"""The size of one float32 score matrix `(B, H, S_q, S_k)`, in bytes (8 MiB), up to
which `implementation="auto"` and `"portable"` try `"xla"` before `"blockwise"`.

Above it `"blockwise"` comes first: the materializing path's memory grows as `S**2`.
Under `"auto"`, the vendor kernels of the platform (GPU, TPU) are tried before either.
[`vidax_eqx.kernels.select_implementation`][] tells which implementation a call runs.
"""

AUTO_INT8_XLA_MAX_SCORE_BYTES = 2**30
"""Up to this many bytes of float32 scores (1 GiB), `"auto"` runs an int8 request
(`quantize=`) that no kernel serves on `"xla"`, the scheme's materialized reference;
above it such a request is refused (name `"xla"` to run it anyway)."""

# What "auto" tries first on each platform, before the portable implementations:
# the vendor kernels, fastest first (cuDNN's fused kernel before the Triton one).
_VENDOR_PREFERENCE = {
    "gpu": ("cudnn", "pallas_gpu"),
    "tpu": ("pallas_tpu",),
}


def implementations() -> dict[str, AbstractImplementation]:
    """The registered implementations, by name (default configuration)."""
    return dict(_REGISTRY)


def preference(request: Request, *, portable_only: bool = False) -> list[str]:
    """Names in the order `"auto"` (or `"portable"`) tries them for `request`."""
    if request.score_bytes <= AUTO_XLA_MAX_SCORE_BYTES:
        portable = ["xla", "blockwise"]
    else:
        portable = ["blockwise", "xla"]
    if request.quantize is not None and request.score_bytes > AUTO_INT8_XLA_MAX_SCORE_BYTES:
        portable.remove("xla")  # (no portable O(S) int8 implementation)
    if portable_only:
        return portable
    vendor = [n for n in _VENDOR_PREFERENCE.get(request.platform, ()) if n in _REGISTRY]
    return vendor + portable


def report(request: Request) -> dict[str, list[str]]:
    """Every registered implementation with what it cannot serve of `request`
    (empty: it serves it), in the order `"auto"` tries them, then the rest."""
    order = preference(request)
    order += [n for n in _REGISTRY if n not in order]
    return {name: _REGISTRY[name].unsupported(request) for name in order}


def resolve(implementation, request: Request) -> AbstractImplementation:
    """The implementation that serves `request`, or a clear error."""
    if isinstance(implementation, AbstractImplementation):
        impl = implementation
    elif implementation in ("auto", "portable"):
        reasons = {}
        for name in preference(request, portable_only=implementation == "portable"):
            impl = _REGISTRY[name]
            missing = impl.unsupported(request)
            if not missing:
                return impl
            reasons[name] = missing
        raise NotImplementedError(
            f"no registered attention implementation ({implementation!r}) serves this request: "
            + "; ".join(f"{n}: {', '.join(r)}" for n, r in reasons.items())
        )
    elif isinstance(implementation, str) and implementation in _REGISTRY:
        impl = _REGISTRY[implementation]
    else:
        raise ValueError(
            f"`implementation` must be 'auto', 'portable', one of {sorted(_REGISTRY)}, or an "
            f"AbstractImplementation instance; received {implementation!r}."
        )
    missing = impl.unsupported(request)
    if missing:
        raise NotImplementedError(
            f"implementation {impl.name!r} does not support: {', '.join(missing)}. "
            "Use implementation='auto' to fall back to one that does."
        )
    return impl


def choices(implementation, request: Request) -> Plan:
    """What serves `request` on each platform it may be lowered for (a plan).

    A request whose platform is known gets that platform's implementation, or
    raises its error. One decided at lowering (`request.platform is None`) gets,
    for each of `PLATFORMS`, the implementation or the reason none serves it
    there; when no platform is served, the error of the host's platform is raised
    (for a named implementation that does not run here, of its own platform).
    """
    if request.platform is not None:
        return ((request.platform, resolve(implementation, request)),)
    found, errors = [], {}
    for platform in PLATFORMS:
        try:
            found.append((platform, resolve(implementation, dataclasses.replace(request, platform=platform))))
        except NotImplementedError as error:
            errors[platform] = error
            found.append((platform, str(error)))
    if len(errors) == len(PLATFORMS):
        # The reasons of the host's platform; of the implementation's own platform
        # for a named one that does not run here (they name what it lacks there).
        named = implementation if isinstance(implementation, AbstractImplementation) else _REGISTRY.get(implementation)
        own = [p for p in PLATFORMS if named is not None and p in named.capabilities.platforms]
        host = host_platform() if host_platform() in errors else "cpu"
        raise errors[host if not own or host in own else own[0]]
    return tuple(found)
