"""Runs: the VJP of a function under one `jax.jit`, plain or under `jax.shard_map`; the
compiler options of the small programs; the segment ids' specs and arrays that the
sequence and joint layouts share."""

import jax


# XLA's CPU backend without its backend optimizations and LLVM's expensive passes
# compiles the suite's small programs about twice as fast; it changes code generation,
# not semantics (the numbers are compared with the same tolerances). conftest's
# `_fast_compile` compiles every program of a test module so (JAX's
# `jax_disable_most_optimizations`) unless the module sets `XLA_OPTIMIZED`; these options
# ask it of one program whatever the module.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def vjp(fn, argnums=None, *, jit: bool = True, compiler_options=None):
    """`run(*args, cotangent) -> (out, grads)`: `jax.vjp` of `fn(*args)` with respect to
    the arguments at `argnums` (default: all), pulled back with `cotangent`, under one
    `jax.jit` (`jit=False`: not jitted, to be jitted by the caller)."""

    def run(*args):
        *args, cotangent = args
        diff = range(len(args)) if argnums is None else argnums

        def f(*d):
            full = list(args)
            for i, x in zip(diff, d):
                full[i] = x
            return fn(*full)

        out, pull = jax.vjp(f, *(args[i] for i in diff))
        return out, pull(cotangent)

    return jax.jit(run, compiler_options=compiler_options) if jit else run


def sharded_vjp(local, mesh, in_specs, out_specs, argnums=None, *, check_vma: bool = True,
                jit: bool = True, compiler_options=None):
    """`vjp` of `jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)`."""
    f = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                      check_vma=check_vma)
    return vjp(f, argnums, jit=jit, compiler_options=compiler_options)


def segment_specs(segments, spec):
    """The specs of the segment ids: `None`, one `spec` (`"one"`) or a `(q, kv)` pair
    (`"pair"`)."""
    return {None: None, "one": spec, "pair": (spec, spec)}[segments]


def segment_arrays(a, segments):
    """The segment ids of the global arrays `a` as `segments` asks: `None`, `a["seg"]`
    (`"one"`) or the pair `(seg, seg_kv)` (`"pair"`, `seg_kv` defaulting to `seg`)."""
    if segments is None:
        return None
    return a["seg"] if segments == "one" else (a["seg"], a.get("seg_kv", a["seg"]))
