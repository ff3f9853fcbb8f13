"""Dispatch decided for the platform a program is lowered for.

A traced attention call does not know where it will run: `jax.jit(f).trace(...)
.lower(lowering_platforms=("tpu",))` lowers on a CPU host for a TPU, and one
`jax.export` may serve CPU, TPU and GPU at once. So a call whose arrays are
tracers resolves its implementation for every platform in [`PLATFORMS`][] (a
*plan*), and [`run`][] stages the kernel call as one primitive whose lowering
picks the branch of the platform being lowered (`mlir.lower_per_platform`: a
single-platform lowering keeps one branch; a multi-platform export keeps each
and selects one just before compiling). Concrete arrays name their platform,
and then only its choice is traced.

Only the *primary* branch (the host's choice where it is served) is traced when
the call is; the other platforms' kernels are traced when the program is
lowered for them, so a CPU program never pays for tracing TPU or GPU kernels.
Those are per-device kernels: they are traced on the operands' shapes and dtypes
alone (no varying mesh axes), which is all their lowering needs. Each branch is
lowered for its own platforms only, so a Pallas TPU kernel inside a CPU + TPU
export does not try to lower "for CPU".

A platform that no implementation serves (a vendor kernel named explicitly)
gets a branch that raises the reason as `NotImplementedError` when the program
is lowered for it; it still lowers for the platforms that are served.

The primitive runs inside the custom VJP's forward and backward (`_api.py`); a
higher-order gradient differentiates the backward, and that derivative goes
through a pure-JAX choice of the plan (a `custom_jvp` around the primitive),
so the primitive itself needs abstract evaluation, lowering and batching rules only.
"""

import contextlib
import contextvars
import functools
from collections.abc import Callable

import jax
from jax.extend import core as jex_core
from jax.interpreters import mlir

from .. import _jax_private as jp
from ._base import AbstractImplementation, capability_platform, GPU_PLATFORMS


PLATFORMS: tuple[str, ...] = ("cpu", "gpu", "tpu")
"""The platforms dispatch chooses for (capability names; `"gpu"` is CUDA and ROCm)."""

# The names `lowering_platforms` / `lax.platform_dependent` use for each of ours.
_LOWERING_NAMES = {"cpu": ("cpu",), "gpu": GPU_PLATFORMS, "tpu": ("tpu",)}

# A plan: `((platform, implementation or the reason none serves it), ...)` over
# `PLATFORMS`, or one entry for a platform known when traced. Hashable: it is a
# static argument of the custom VJP.
Plan = tuple[tuple[str, "AbstractImplementation | str"], ...]


def canonical_platform(platform: str, *, what: str = "platform") -> str:
    """`platform` as a capability name: `"cuda"` / `"rocm"` are `"gpu"`."""
    name = capability_platform(str(platform).lower())
    if name not in PLATFORMS:
        raise ValueError(
            f"`{what}` must be one of {', '.join(repr(p) for p in PLATFORMS + GPU_PLATFORMS)}; "
            f"received {platform!r}."
        )
    return name


# The GPU a program is lowered for when the host has none (JAX 0.11+ needs one for a
# Triton kernel), per lowering platform; `gpu_target` overrides it.
DEFAULT_GPU_TARGETS = {"cuda": "NVIDIA H100", "rocm": "gfx942"}
_GPU_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("gpu_target", default=None)


@contextlib.contextmanager
def gpu_target(device_kind: str):
    """Lowers the GPU kernels of programs lowered inside this context for the GPU
    `device_kind` (as `jax.Device.device_kind` names it: `"NVIDIA H200"`, `"NVIDIA
    A100-SXM4-80GB"`, `"gfx942"`), whatever GPU the host has, if any.

    A GPU program lowered or exported from a host without a GPU
    (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`,
    [`vidax_eqx.models.export`][]`(..., platforms=("cuda",))`) needs a target for its
    Triton kernels (`"pallas_gpu"`); without this context it is
    `DEFAULT_GPU_TARGETS[platform]` (an H100 for CUDA, an MI300 for ROCm), and on a
    host with a GPU, that GPU.

    **Arguments:**

    - `device_kind`: a non-empty string.
    """
    if not isinstance(device_kind, str) or not device_kind:
        raise ValueError(
            "gpu_target: `device_kind` must be a GPU's device kind, e.g. 'NVIDIA H100'; "
            f"received {device_kind!r}."
        )
    token = _GPU_TARGET.set(device_kind)
    try:
        yield
    finally:
        _GPU_TARGET.reset(token)


def _gpu_kind(platform: str) -> str | None:
    """The device kind a GPU kernel is lowered for on `platform` (`"cuda"` / `"rocm"`):
    `gpu_target`'s, else `None` (the host's GPU) on a host with one, else the default."""
    chosen = _GPU_TARGET.get()
    if chosen is not None:
        return chosen
    if any(d.platform in ("gpu",) + GPU_PLATFORMS for d in jax.devices()):
        return None
    return DEFAULT_GPU_TARGETS.get(platform)


def lowering_names(platform: str) -> tuple[str, ...]:
    """The names `lowering_platforms` / `lax.platform_dependent` use for `platform`."""
    return _LOWERING_NAMES[platform]


def host_platform() -> str:
    """The platform of JAX's default backend, as a capability name."""
    return capability_platform(jax.default_backend())


def served(plan: Plan) -> list[AbstractImplementation]:
    """The implementations of `plan`, each once, in platform order."""
    found = []
    for _, choice in plan:
        if isinstance(choice, AbstractImplementation) and choice not in found:
            found.append(choice)
    return found


def run(plan: Plan, fn: Callable, *operands):
    """`fn(impl, *operands)`, with `impl` the choice of `plan` for the platform the
    program is lowered for. `operands` is a PyTree of arrays.

    `fn` runs inside the custom VJP's forward and backward; the backward is
    differentiated again only for higher-order gradients, whose extra terms are
    then taken through a pure-JAX choice of the plan (see `_run`'s JVP).
    """
    impls = served(plan)
    if len(impls) == 1 and all(choice == impls[0] for _, choice in plan):
        return fn(impls[0], *operands)
    return _run(plan, fn, operands)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _run(plan: Plan, fn: Callable, operands):
    return _staged(plan, fn, operands)


@_run.defjvp
def _run_jvp(plan, fn, primals, tangents):
    (operands,), (dots,) = primals, tangents
    # The derivative of the kernel call (a second-order gradient of attention) is
    # the same whichever exact implementation computes it: take a pure-JAX one,
    # since the vendor kernels have no derivative of their own.
    impls = served(plan)
    exact = next((impl for impl in impls if impl.capabilities.portable), impls[0])
    out = _staged(plan, fn, operands)
    _, dout = jax.jvp(lambda ops: fn(exact, *ops), (operands,), (dots,))
    return out, dout


def _staged(plan: Plan, fn: Callable, operands):
    """`run` for a plan with several choices: the dispatch primitive."""
    impls = served(plan)
    flat, in_tree = jax.tree.flatten(operands)
    host_choice = dict(plan).get(host_platform())
    primary = host_choice if isinstance(host_choice, AbstractImplementation) else impls[0]
    out_tree = []

    def branch(impl):
        def flat_fn(*leaves):
            out = fn(impl, *jax.tree.unflatten(in_tree, leaves))
            leaves, tree = jax.tree.flatten(out)
            out_tree.append(tree)
            return leaves

        return flat_fn

    traced = jax.make_jaxpr(branch(primary))(*flat)
    branches = []
    for platform, choice in plan:
        if choice == primary and not (platform == "gpu" and host_platform() != "gpu"):
            body = traced  # (a GPU kernel on a host without a GPU is traced for its target)
        elif isinstance(choice, AbstractImplementation):
            body = branch(choice)
        else:
            body = choice  # the reason, raised when lowering for `platform`
        branches.append((_LOWERING_NAMES[platform], body))
    out = _per_platform_p.bind(*flat, branches=tuple(branches), out_avals=tuple(traced.out_avals))
    return jax.tree.unflatten(out_tree[0], out)


# -- the primitive ---------------------------------------------------------------------

_per_platform_p = jex_core.Primitive("vidax_attention_per_platform")
_per_platform_p.multiple_results = True
_per_platform_p.def_abstract_eval(lambda *avals, branches, out_avals: out_avals)


def _impl(*args, branches, out_avals):
    """Eager evaluation (outside `jit`): the traced branch, the host's choice
    wherever the host is served."""
    traced = next(body for _, body in branches if isinstance(body, jex_core.ClosedJaxpr))
    return jex_core.jaxpr_as_fun(traced)(*args)


_per_platform_p.def_impl(_impl)


def _lower_jaxpr(ctx, closed: jex_core.ClosedJaxpr, *args):
    """Inlines `closed` at this point of the module, for `ctx.platforms` if set."""
    module = ctx.module_context
    if ctx.platforms is not None:
        module = module.replace(platforms=ctx.platforms)
    consts = jp.ir_consts(closed.consts, [v.aval for v in closed.jaxpr.constvars])
    out, tokens = jp.jaxpr_subcomp(
        module, closed.jaxpr, ctx.name_stack, ctx.tokens_in, consts, *args,
        dim_var_values=ctx.dim_var_values, const_lowering=ctx.const_lowering, outer_traceback=None,
    )
    ctx.set_tokens_out(tokens)
    return out


def _rule(body):
    """The lowering rule of one branch."""
    if isinstance(body, str):

        def unserved(ctx, *args):
            raise NotImplementedError(f"{body} (when lowering for {', '.join(ctx.platforms or ctx.module_context.platforms)})")

        return unserved
    if isinstance(body, jex_core.ClosedJaxpr):
        return lambda ctx, *args: _lower_jaxpr(ctx, body, *args)

    def lazy(ctx, *args):
        # A per-device kernel, traced now on shapes and dtypes alone (no varying
        # mesh axes, and shard_map's check of them off, as for any Pallas kernel),
        # inside the rule's context (a GPU kernel: for its target GPU, which its
        # equations record).
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ctx.avals_in]
        with jp.check_vma(False):
            traced = jax.make_jaxpr(body)(*avals)
        return _lower_jaxpr(ctx, traced, *args)

    return lazy


def _on_gpu(rule):
    """A GPU branch's rule, lowered for the target GPU (`gpu_target`)."""

    def lower(ctx, *args):
        platform = (ctx.platforms or ctx.module_context.platforms)[0]
        with jp.gpu_lowering(_gpu_kind(platform)):
            return rule(ctx, *args)

    return lower


def _lowering(ctx, *args, branches, out_avals):
    rules = {}
    for names, body in branches:
        rule = _rule(body)  # one per branch: CUDA and ROCm share theirs
        if set(names) <= set(GPU_PLATFORMS):
            rule = _on_gpu(rule)
        rules.update(dict.fromkeys(names, rule))
    default = rules.get("cpu")  # no vendor kernels: also right for any other platform
    return jp.lower_per_platform(
        ctx, "vidax_attention_per_platform", rules, default, jex_core.no_effects, *args
    )


def _batching(args, dims, *, branches, out_avals):
    batched = []
    traced = None
    for names, body in branches:
        if isinstance(body, jex_core.ClosedJaxpr):
            body = jax.make_jaxpr(jax.vmap(jex_core.jaxpr_as_fun(body), in_axes=dims))(*args)
            traced = body
        elif not isinstance(body, str):
            body = jax.vmap(body, in_axes=dims)
        batched.append((names, body))
    out = _per_platform_p.bind(*args, branches=tuple(batched), out_avals=tuple(traced.out_avals))
    return out, [0] * len(out)


mlir.register_lowering(_per_platform_p, _lowering)
jp.primitive_batchers[_per_platform_p] = _batching
