"""The test suite's shared harness: inputs, meshes, runs and comparisons.

What the test files would otherwise each write for themselves (DESIGN.md rule 14):

- **Inputs.** Seeded random NumPy arrays, never zeros: `normal`, `rounded` (a JAX array
  and the same rounded values in float64), `segment_ids` (different per batch element,
  with padding), `joint_segment_ids` (over a text prefix and the visual tokens),
  `attention_inputs` (q, k, v with GQA, the cotangent, optionally dlse, sinks and
  segment ids, in any dtype), `keys` (PRNG keys).
- **Meshes.** `mesh(dp=, sp=, tp=, **extra_axes)`, `parallel.make_mesh` built once per
  shape; `zigzag` / `unzigzag` between the global order and a ring's zigzag layout.
- **Runs.** `vjp`: the VJP of a function with a given cotangent under one `jax.jit`;
  `sharded_vjp`: the same of a function under `jax.shard_map`; `sequence_vjp` /
  `run_sequence`: attention with the sequence (axis 1) sharded, from global arrays to
  global results; `joint_vjp` / `run_joint`: the same for the joint layout (a text
  prefix replicated and put before every device's visual chunk).
- **Comparisons.** `assert_matches` (each result against the float64 oracle's, within
  the dtype's tolerance: `oracle.TOLERANCES` is the suite's one tolerance table),
  `assert_trees_close` (two trees, e.g. sharded against one device), `assert_copies_equal`
  (the copies of the text rows, bitwise), `check_sharded` (the sharded check in one
  call: shard_map, VJP with a random cotangent, against the oracle and/or one device),
  `check_grads_fd` (gradients against central differences of a float64 reference),
  `named` (a VJP's `(out, grads)` as a dict of names), `shape_re` (a shape in an error
  message).
- **Modules.** `arrays`, `with_arrays`, `map_arrays`, `to64`, `leaf_names`, `perturbed`,
  `resampled`: an Equinox module's arrays read, replaced and randomized.
- **Whole models.** `load_io`, `max_rel_error`, `loss_and_grad`, `same_arrays`,
  `leaf_errors` / `assert_leaves_close` (every parameter's gradient, say, against its own
  scale).
- **Weight files.** `safetensors_file`, `safetensors_entry`: files built byte by byte.
- **Processes.** `NUM_PROCESSES`, `LOCAL_DEVICES`, `free_port`, `child_env`,
  `global_array` for the multi-process tests and their workers.

`FAST_COMPILE` is the compiler options of the small programs that compile often.

Nothing of `vidax_eqx` is imported at import time (the multi-process workers import this
module before `jax.distributed.initialize`): the functions that need it import it.
"""

import functools
import json
import os
import socket
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import oracle


# XLA's CPU backend without its backend optimizations and LLVM's expensive passes
# compiles the suite's small programs about twice as fast; it changes code generation,
# not semantics (the numbers are compared with the same tolerances).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


# -- inputs ------------------------------------------------------------------------------


def keys(seed: int, n: int):
    """`n` PRNG keys split from `jax.random.key(seed)`."""
    return jax.random.split(jax.random.key(seed), n)


def normal(rng, shape, dtype=np.float32, offset: float = 0.0) -> np.ndarray:
    """Standard normal values (plus `offset`) as a NumPy array of `dtype` (bfloat16
    included: JAX's dtypes are NumPy dtypes)."""
    return (rng.standard_normal(shape) + offset).astype(dtype)


def rounded(rng, shape, dtype=jnp.float32, offset: float = 0.0):
    """`(x, x64)`: standard normal values (plus `offset`) as a JAX array of `dtype`, and
    the same rounded values in float64 for the reference."""
    x = jnp.asarray(rng.standard_normal(shape) + offset, dtype)
    return x, np.asarray(x.astype(jnp.float32), np.float64)


def segment_ids(rng, B: int, S: int, *, ids: int = 3, pad=None, scattered: bool = True,
                holes: float = 0.0) -> np.ndarray:
    """`(B, S)` int32 segment ids that differ across the batch.

    Ids are drawn from `0..ids-1`: sorted into runs in even rows, and (`scattered`) in
    random order, not contiguous, in odd rows (with `scattered=False` every row is sorted).
    The last `pad[b % 2]` tokens of row `b` are padding (-1), default `(S // 6, S // 10)`;
    `holes` is the fraction of the other tokens also made padding, at random places.
    """
    pad = (S // 6, S // 10) if pad is None else pad
    rows = []
    for b in range(B):
        row = rng.integers(0, ids, S)
        if b % 2 == 0 or not scattered:
            row = np.sort(row)
        if pad[b % 2]:
            row[S - pad[b % 2]:] = -1
        rows.append(row)
    seg = np.stack(rows) if rows else np.zeros((0, S), np.int64)
    if holes:
        seg[rng.random(seg.shape) < holes] = -1
    return seg.astype(np.int32)


def joint_segment_ids(rng, B: int, T: int, S: int, *, pad=None) -> np.ndarray:
    """`(B, T + S)` int32 segment ids over `[text (T); visual (S)]`: the visual ids from
    `segment_ids` (`pad` passed on), then text ids drawn from {0, 1}."""
    visual = segment_ids(rng, B, S, pad=pad)
    return np.concatenate([rng.integers(0, 2, (B, T)), visual], 1).astype(np.int32)


def attention_inputs(B: int, S: int, H: int, D: int, *, H_kv: int | None = None,
                     S_k: int | None = None, dtype=np.float32, seed: int = 0, rng=None,
                     dlse: bool = False, sinks: bool = False, segments: bool = False,
                     pad=None) -> dict:
    """Random global attention inputs as NumPy arrays.

    `q (B, S, H, D)`, `k` / `v (B, S_k, H_kv, D)` and the cotangent `dout (B, S, H, D)`
    in `dtype`; with `dlse`, a cotangent `dlse (B, H, S)` of the log-sum-exp, with
    `sinks`, `sinks (H,)` (both float32); with `segments`, `seg (B, S)` from
    `segment_ids` (`pad` passed on; self-attention only). Drawn in that order from
    `rng` (default `np.random.default_rng(seed)`): a caller passing its own generator
    goes on drawing from it.
    """
    rng = np.random.default_rng(seed) if rng is None else rng
    H_kv = H if H_kv is None else H_kv
    S_k = S if S_k is None else S_k
    a = {
        "q": normal(rng, (B, S, H, D), dtype),
        "k": normal(rng, (B, S_k, H_kv, D), dtype),
        "v": normal(rng, (B, S_k, H_kv, D), dtype),
        "dout": normal(rng, (B, S, H, D), dtype),
    }
    if dlse:
        a["dlse"] = normal(rng, (B, H, S))
    if sinks:
        a["sinks"] = normal(rng, (H,))
    if segments:
        if S_k != S:
            raise ValueError(f"attention_inputs: segment ids here are for self-attention; "
                             f"received S={S}, S_k={S_k}.")
        a["seg"] = segment_ids(rng, B, S, pad=pad)
    return a


# -- meshes and layouts ------------------------------------------------------------------


@functools.cache
def _mesh(dp: int, sp: int, tp: int, extra: tuple):
    from vidax_eqx import parallel

    return parallel.make_mesh(dp=dp, sp=sp, tp=tp, extra_axes=dict(extra) or None)


def mesh(dp: int = 1, sp: int = 1, tp: int = 1, **extra_axes: int):
    """`parallel.make_mesh(dp=dp, sp=sp, tp=tp, extra_axes=extra_axes)` over the first
    devices, built once per shape: `mesh(sp=2, ring=2)` is 2D sequence parallelism."""
    return _mesh(dp, sp, tp, tuple(extra_axes.items()))


def zigzag(x, n: int, axis: int = 1):
    """`x` (global order) as a JAX array in the zigzag layout of a ring of `n`; `n = 0`:
    the contiguous layout (`x` as it is)."""
    from vidax_eqx import parallel

    x = jnp.asarray(x)
    return parallel.zigzag_permute(x, axis, n) if n else x


def unzigzag(x, n: int, axis: int = 1) -> np.ndarray:
    """The inverse of `zigzag`, as NumPy."""
    from vidax_eqx import parallel

    return np.asarray(parallel.zigzag_unpermute(x, axis, n) if n else x)


# -- runs --------------------------------------------------------------------------------


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


def _seg_specs(segments, spec):
    return {None: None, "one": spec, "pair": (spec, spec)}[segments]


def sequence_vjp(attend, mesh, axes, *, batch_axis=None, segments=None, sinks: bool = False,
                 check_vma: bool = True, jit: bool = True, compiler_options=None):
    """A jitted `(q, k, v, seg, sinks, dout) -> (out, (dq, dk, dv, dsinks))` of
    `attend(q, k, v, seg, sinks)` under `jax.shard_map`: `(B, S, ...)` arrays with the
    sequence over `axes` (and the batch over `batch_axis`), `sinks` replicated.

    `segments`: `None` (no segment ids), `"one"` (one array) or `"pair"` (a `(q, kv)`
    pair, for `kernels.SegmentIds`). `dsinks` is `None` without sinks.
    """
    seq = P(batch_axis, axes)
    in_specs = (seq, seq, seq, _seg_specs(segments, seq), P() if sinks else None)
    return sharded_vjp(attend, mesh, in_specs, seq, (0, 1, 2, 4), check_vma=check_vma,
                       jit=jit, compiler_options=compiler_options)


def _segment_arrays(a, segments):
    if segments is None:
        return None
    return a["seg"] if segments == "one" else (a["seg"], a.get("seg_kv", a["seg"]))


def run_sequence(fn, a: dict, *, zigzag_size: int = 0, segments=None, sinks: bool = False,
                 repeat: int = 1):
    """Runs `fn` (from `sequence_vjp`) on the global arrays `a` (`q, k, v, dout`, and
    `seg` / `seg_kv` / `sinks` as configured), in the zigzag layout of a ring of
    `zigzag_size` if not 0; returns `dict(out, dq, dk, dv, dsinks)` in global order as
    NumPy (a list of `repeat` of them when `repeat > 1`)."""
    to = lambda x: zigzag(x, zigzag_size)  # noqa: E731
    back = lambda x: unzigzag(x, zigzag_size)  # noqa: E731
    args = [to(a[name]) for name in ("q", "k", "v")]
    seg = jax.tree.map(to, _segment_arrays(a, segments))
    s = jnp.asarray(a["sinks"]) if sinks else None
    dout = to(a["dout"])

    def unpack(r):
        out, (dq, dk, dv, ds) = r
        return dict(out=back(out), dq=back(dq), dk=back(dk), dv=back(dv),
                    dsinks=None if ds is None else np.asarray(ds))

    results = [unpack(fn(*args, seg, s, dout)) for _ in range(repeat)]
    return results if repeat > 1 else results[0]


def joint_vjp(attend, mesh, axes, *, batch_axis=None, segments=None, sinks: bool = False,
              check_vma: bool = True, compiler_options=None):
    """The joint layout under `jax.shard_map`: a jitted
    `(text, visual, seg, sinks, dout) -> (out, (d_text, d_visual, dsinks))`.

    `text = (qt, kt, vt)` enter replicated and `visual = (qv, kv, vv)` sharded over
    `axes`; inside, every device puts the text before its visual chunk (as varying
    values under `check_vma`) and calls `attend(q, k, v, seg, sinks)`. `seg` is
    `(text, visual)` ids joined the same way (each an array, or a `(q, kv)` pair for
    `segments="pair"`). `out` is every device's `[text; visual chunk]` rows side by
    side; the text gradients are summed over the devices by `shard_map`.
    """
    text, seq = P(batch_axis), P(batch_axis, axes)

    def join(t, x):
        t = jax.lax.pcast(t, axes, to="varying") if check_vma else t
        return jnp.concatenate([t, x], axis=1)

    def per_device(qt, kt, vt, qv, kv, vv, seg, s):
        seg = None if seg is None else jax.tree.map(join, *seg)
        return attend(join(qt, qv), join(kt, kv), join(vt, vv), seg, s)

    seg_specs = None
    if segments is not None:
        seg_specs = (_seg_specs(segments, text), _seg_specs(segments, seq))
    sharded = jax.shard_map(
        per_device, mesh=mesh,
        in_specs=(text, text, text, seq, seq, seq, seg_specs, P() if sinks else None),
        out_specs=seq, check_vma=check_vma,
    )

    @functools.partial(jax.jit, compiler_options=compiler_options)
    def run(text, visual, seg, s, dout):
        out, pull = jax.vjp(lambda t, x, s: sharded(*t, *x, seg, s), text, visual, s)
        return out, pull(dout)

    return run


def text_shares(dout_text, n: int, seed: int = 99) -> np.ndarray:
    """The text cotangent `(B, T, ...)` split over `n` copies of the text rows in random
    shares that sum to it exactly, in any dtype: `(B, n, T, ...)`. Each token's shares
    are `1/2, 1/4, ..., 1/2^(n-1), 1/2^(n-1)` over the copies in random order (powers of
    two: every part is exact)."""
    dout_text = np.asarray(dout_text)
    T = dout_text.shape[1]
    base = np.array([2.0 ** -min(i + 1, n - 1) for i in range(n)]) if n > 1 else np.ones(1)
    rng = np.random.default_rng(seed)
    shares = np.stack([rng.permutation(base) for _ in range(T)], axis=1) if T else np.ones((n, 0))
    extra = (None,) * (dout_text.ndim - 2)
    parts = dout_text[:, None].astype(np.float64) * shares[(None, slice(None), slice(None), *extra)]
    return parts.astype(dout_text.dtype)


def run_joint(fn, a: dict, n: int, text_len: int, *, zigzag_size: int = 0, segments=None,
              sinks: bool = False):
    """Runs `fn` (from `joint_vjp`, `n` devices on the sequence) on the global arrays `a`
    over `[text (text_len); visual]`: the visual part in the zigzag layout of a ring of
    `zigzag_size` if not 0, the text cotangent split over the devices' copies of the text
    rows (`text_shares`). Returns global-order NumPy `dict(out, dq, dk, dv, dsinks)` (the
    text rows of `out` from device 0) and `out_text`, every device's text rows
    `(B, n, T, H, D)`."""
    T = text_len
    to = lambda x: zigzag(x, zigzag_size)  # noqa: E731
    back = lambda x: unzigzag(x, zigzag_size)  # noqa: E731
    text = tuple(jnp.asarray(a[name][:, :T]) for name in ("q", "k", "v"))
    visual = tuple(to(a[name][:, T:]) for name in ("q", "k", "v"))
    seg = _segment_arrays(a, segments)
    if seg is not None:
        seg = (jax.tree.map(lambda x: jnp.asarray(x[:, :T]), seg),
               jax.tree.map(lambda x: to(x[:, T:]), seg))
    s = jnp.asarray(a["sinks"]) if sinks else None

    dout = np.asarray(a["dout"])
    B, rest = dout.shape[0], dout.shape[2:]
    L = (dout.shape[1] - T) // n
    visual_dout = np.asarray(to(dout[:, T:])).reshape(B, n, L, *rest)
    blocks = np.concatenate([text_shares(dout[:, :T], n), visual_dout], axis=2)
    dev_dout = jnp.asarray(blocks.reshape(B, n * (T + L), *rest))

    out, (d_text, d_visual, ds) = fn(text, visual, seg, s, dev_dout)
    out = np.asarray(out).reshape(B, n, T + L, *rest)
    res = dict(out_text=out[:, :, :T])
    res["out"] = np.concatenate([out[:, 0, :T], back(out[:, :, T:].reshape(B, n * L, *rest))], 1)
    for name, g_t, g_v in zip(("dq", "dk", "dv"), d_text, d_visual):
        res[name] = np.concatenate([np.asarray(g_t), back(g_v)], 1)
    res["dsinks"] = None if ds is None else np.asarray(ds)
    return res


# -- comparisons -------------------------------------------------------------------------


ATTENTION_NAMES = ("out", "dq", "dk", "dv")


def named(out, grads, names=("out", "dq", "dk", "dv", "dsinks")) -> dict:
    """`(out, grads)` of a VJP as a dict: `names` label the output, then the gradients."""
    return dict(zip(names, (out, *grads)))


def _get(ref, name):
    return ref[name] if isinstance(ref, Mapping) else getattr(ref, name)


def assert_matches(got, ref, dtype, names=ATTENTION_NAMES, *, factor: float = 1.0) -> None:
    """`got[name]` against `ref`'s `name` (an `oracle.Result` or a mapping) for every
    name: finite, of the reference's shape, within `factor` times the dtype's tolerance."""
    for name in names:
        g = np.asarray(_get(got, name)).astype(np.float64)
        want = _get(ref, name)
        assert np.isfinite(g).all(), f"{name} has non-finite values"
        assert g.shape == np.shape(want), (name, g.shape, np.shape(want))
        oracle.assert_close(g, want, dtype, name, factor=factor)


def shape_re(shape) -> str:
    """A regex matching `shape` as Python prints a tuple (for error messages)."""
    if not shape:
        return r"\(\)"
    return r"\(" + r",\s*".join(str(s) for s in shape) + (r",\)" if len(shape) == 1 else r"\)")


def assert_trees_close(got, ref, dtype=np.float32, what: str = "", factor: float = 1.0) -> None:
    """Every array leaf of `got` against the same leaf of `ref` (the same number of
    leaves, the same shapes), within `factor` times the dtype's tolerance."""
    got_leaves, ref_leaves = jax.tree.leaves(got), jax.tree.leaves(ref)
    assert len(got_leaves) == len(ref_leaves), (what, len(got_leaves), len(ref_leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(got)]
    for path, g, r in zip(paths, got_leaves, ref_leaves):
        assert np.shape(g) == np.shape(r), f"{what}{path}: shape {np.shape(g)} != {np.shape(r)}"
        oracle.assert_close(g, r, dtype, f"{what}{path}", factor=factor)


def assert_copies_equal(copies, what: str = "text rows") -> None:
    """`copies (B, n, ...)`: every device's copy bitwise equal to device 0's."""
    copies = np.asarray(copies)
    for i in range(1, copies.shape[1]):
        np.testing.assert_array_equal(copies[:, i], copies[:, 0], err_msg=f"{what}, device {i}")


def check_sharded(local, mesh, in_specs, out_specs, args, cotangent, *, argnums=None,
                  ref=None, names=("out", "dq", "dk", "dv", "dsinks"), single=None,
                  dtype=np.float32, check_vma: bool = True, compiler_options=None):
    """The sharded check: `local` under `jax.shard_map` over `mesh` on the global `args`,
    its VJP with respect to `args[argnums]` (default all) pulled back with `cotangent`,
    against `ref` (an `oracle.Result` or a mapping; `names` label the output and then
    the gradients, in order) and / or against `single`, the same computation on one
    device (`single(*args)`, its own VJP). Returns the sharded `(out, grads)`."""
    args = tuple(None if x is None else jnp.asarray(x) for x in args)
    cotangent = jax.tree.map(jnp.asarray, cotangent)
    out, grads = sharded_vjp(local, mesh, in_specs, out_specs, argnums, check_vma=check_vma,
                             compiler_options=compiler_options)(*args, cotangent)
    if ref is not None:
        got = named(out, grads, names)
        assert_matches(got, ref, dtype, names[:len(got)])
    if single is not None:
        want = vjp(single, argnums, compiler_options=compiler_options)(*args, cotangent)
        assert_trees_close((out, grads), want, dtype, "sharded vs one device: ")
    return out, grads


def check_grads_fd(ref_loss, params, grads, names, seed: int, tol: float = 2e-5) -> None:
    """Gradients against directional central differences of the float64 `ref_loss(list
    of arrays)`: for each array, two random directions `d`, `<grad, d>` against
    `(L(p + eps d) - L(p - eps d)) / 2 eps`, relative to `sum |grad * d|`."""
    rng = np.random.default_rng(seed)
    params = [oracle.f64(p) for p in params]
    eps = 1e-6
    for i, (g, name) in enumerate(zip(grads, names)):
        g = oracle.f64(g)
        for _ in range(2):
            d = rng.standard_normal(g.shape)
            plus = [p + eps * d if j == i else p for j, p in enumerate(params)]
            minus = [p - eps * d if j == i else p for j, p in enumerate(params)]
            fd = (ref_loss(plus) - ref_loss(minus)) / (2 * eps)
            got = float(np.sum(g * d))
            scale = float(np.sum(np.abs(g * d))) + 1e-12
            assert abs(got - fd) <= tol * max(scale, abs(fd)), (
                f"{name}: <grad, d> = {got:.8g}, finite difference {fd:.8g}"
            )


# -- Equinox modules ---------------------------------------------------------------------


def arrays(module) -> list:
    """The module's arrays (its `ParallelConfig` and other non-array leaves left out)."""
    return jax.tree.leaves(eqx.filter(module, eqx.is_array))


def with_arrays(module, leaves):
    """The module with other arrays in place of its own (float64 NumPy arrays for a
    reference), its non-array leaves kept."""
    params, static = eqx.partition(module, eqx.is_array)
    return eqx.combine(jax.tree.unflatten(jax.tree.structure(params), leaves), static)


def map_arrays(f, tree):
    """`f` applied to every array leaf of `tree`; other leaves (a module's
    `ParallelConfig`) kept as they are."""
    return jax.tree.map(lambda a: f(a) if eqx.is_array(a) else a, tree)


def to64(tree):
    """Every array leaf as NumPy: floating ones in float64, others unchanged."""

    def conv(a):
        a = np.asarray(a)
        return a.astype(np.float64) if np.issubdtype(a.dtype, np.floating) else a

    return map_arrays(conv, tree)


def leaf_names(tree) -> list[str]:
    """The key paths of the array leaves of `tree`, in `arrays` order."""
    return [jax.tree_util.keystr(path)
            for path, _ in jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))]


def perturbed(module, seed: int, scale: float = 0.2):
    """Every array perturbed by `scale` standard normal noise (norm weights away from 1,
    biases away from 0), drawn in NumPy."""
    rng = np.random.default_rng(seed)
    return with_arrays(module, [
        jnp.asarray(np.asarray(x) + scale * rng.standard_normal(x.shape), x.dtype)
        for x in arrays(module)])


def resampled(module, seed: int):
    """Every array replaced by standard normal values (norm weights included)."""
    rng = np.random.default_rng(seed)
    return with_arrays(module, [jnp.asarray(rng.normal(size=x.shape), x.dtype)
                                for x in arrays(module)])


# -- whole models ------------------------------------------------------------------------


def load_io(path) -> dict:
    """The arrays of an `io.npz` fixture as JAX arrays."""
    return {k: jnp.asarray(v) for k, v in np.load(path).items()}


def max_rel_error(out, ref) -> float:
    """`max|out - ref| / max|ref|` in float64: a whole model's output against its
    reference (relative to the output's largest magnitude)."""
    ref = np.asarray(ref)
    return float(np.max(np.abs(np.asarray(out, np.float64) - ref)) / np.max(np.abs(ref)))


def loss_and_grad(run):
    """A filtered-jitted `(arrays, static, x, t, c, target) -> (loss, grad)` of the mean
    squared error of `run(model, x, t, c)` against `target`, with respect to `arrays`."""

    def loss(params, static, x, t, c, target):
        model = eqx.combine(params, static)
        return jnp.mean(jnp.square(run(model, x, t, c) - target))

    return eqx.filter_jit(jax.value_and_grad(loss))


def same_arrays(a, b) -> bool:
    """The same arrays (dtypes and values) in the same order."""
    la, lb = arrays(a), arrays(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
    )


def leaf_errors(got, ref, floor: float = 0.0) -> dict:
    """`{path: max|got - ref| / scale}` over the array leaves of two trees of the same
    structure (a model's gradients, sharded or not), `scale` the leaf's largest magnitude
    in `ref`, and at least `floor` x the largest of the whole tree (a leaf whose values
    are float32 noise around zero is judged against the model's scale)."""
    names = leaf_names(ref)
    ref = [np.asarray(r, np.float64) for r in arrays(ref)]
    got = [np.asarray(g, np.float64) for g in arrays(got)]
    assert len(got) == len(ref), (len(got), len(ref))
    top = max(float(np.max(np.abs(r))) for r in ref)
    return {n: float(np.max(np.abs(g - r))) / max(float(np.max(np.abs(r))), floor * top, 1e-30)
            for n, g, r in zip(names, got, ref, strict=True)}


def assert_leaves_close(got, ref, what: str, floor: float = 0.0, dtype=np.float32) -> None:
    """Every entry of `leaf_errors(got, ref, floor)` within the dtype's tolerance."""
    tol = oracle.tolerance(dtype)
    errors = leaf_errors(got, ref, floor)
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"{what}: {len(bad)} of {len(errors)} arrays off (relative): {bad}"


# -- weight files ------------------------------------------------------------------------


def safetensors_file(path, header, data: bytes = b"", length: int | None = None):
    """A `.safetensors`-shaped file written byte by byte (hostile ones included): the
    8-byte little-endian header length (`length`, default the true one), the header
    (a dict as JSON, or raw bytes) and the data. Returns `path`."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    path.write_bytes(np.array([n], "<u8").tobytes() + raw + data)
    return path


def safetensors_entry(dtype: str = "F32", shape=(2,), offsets=(0, 8)) -> dict:
    """One tensor's entry of a `.safetensors` header."""
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


# -- processes ---------------------------------------------------------------------------


NUM_PROCESSES = 2  # the multi-process jobs: two processes ...
LOCAL_DEVICES = 4  # ... of four CPU devices each


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(local_devices: int = LOCAL_DEVICES) -> dict:
    """This process's environment for a worker process: `local_devices` simulated CPU
    devices, CPU only, JAX's default float32."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={local_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_ENABLE_X64", None)
    return env


def global_array(mesh, spec, x):
    """The global array `x` placed by `spec`, each process providing only its own
    devices' shards."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])


# -- the joint layouts with the text on either side, and key-only padding ----------------


def split_text(x, text_len: int, text_position: str = "prefix", axis: int = 1):
    """`(text, visual)` of a global array over the single-device sequence: `[text; visual]`
    (`"prefix"`) or `[visual; text]` (`"suffix"`)."""
    x = np.asarray(x)
    S = x.shape[axis]
    cut = text_len if text_position == "prefix" else S - text_len
    first, second = np.split(x, [cut], axis=axis)
    return (first, second) if text_position == "prefix" else (second, first)


def key_only_ids(B: int, S: int, *, seg=None, text_len: int = 0, text_position: str = "prefix",
                 text_lengths=None, kv_lengths=None):
    """`(seg_q, seg_kv)` int32 `(B, S)` for the oracle: key-only padding as separate ids.
    The queries keep `seg` (zeros without), the keys get -1 where hidden: text keys at an
    index `>= text_lengths[b]` within the text block (at the start or the end of the
    sequence), and keys at a global index `>= kv_lengths[b]`."""
    seg_q = np.zeros((B, S), np.int32) if seg is None else np.asarray(seg, np.int32)
    seg_kv = seg_q.copy()
    index = np.arange(S)
    start = 0 if text_position == "prefix" else S - text_len
    for b in range(B):
        if text_lengths is not None:
            seg_kv[b, (index >= start + text_lengths[b]) & (index < start + text_len)] = -1
        if kv_lengths is not None:
            seg_kv[b, index >= kv_lengths[b]] = -1
    return seg_q, seg_kv


def text_joint_vjp(attend, mesh, axes, *, text_position: str = "prefix", segments: bool = False,
                   sinks: bool = False, lengths: bool = False, compiler_options=None):
    """`joint_vjp` for either text side, with one more replicated input: a jitted
    `(text, visual, seg, sinks, lengths, dout) -> (out, (d_text, d_visual, dsinks))`.

    Every device joins the replicated text `(qt, kt, vt)` and its visual chunk as
    `[text; chunk]` or `[chunk; text]` and calls `attend(q, k, v, seg, sinks, lengths)`
    (`seg`: `(text, visual)` ids joined the same way, one array each, or `None`;
    `lengths`: an int `(B,)` array, replicated, or `None`). `out` is every device's rows
    side by side.
    """
    text, seq = P(), P(None, axes)

    def join(t, x):
        t = jax.lax.pcast(t, axes, to="varying")
        return jnp.concatenate([t, x] if text_position == "prefix" else [x, t], axis=1)

    def per_device(qt, kt, vt, qv, kv, vv, seg, s, n):
        seg = None if seg is None else join(*seg)
        return attend(join(qt, qv), join(kt, kv), join(vt, vv), seg, s, n)

    sharded = jax.shard_map(
        per_device, mesh=mesh,
        in_specs=(text, text, text, seq, seq, seq, (text, seq) if segments else None,
                  P() if sinks else None, P() if lengths else None),
        out_specs=seq,
    )

    @functools.partial(jax.jit, compiler_options=compiler_options)
    def run(text, visual, seg, s, n, dout):
        out, pull = jax.vjp(lambda t, x, s: sharded(*t, *x, seg, s, n), text, visual, s)
        return out, pull(dout)

    return run


def run_text_joint(fn, a: dict, n: int, text_len: int, *, text_position: str = "prefix",
                   zigzag_size: int = 0, lengths=None) -> dict:
    """`run_joint` for `text_joint_vjp`: the global arrays `a` (`q, k, v, dout`, and
    `seg` / `sinks` when present) over the single-device sequence (text first or last),
    `lengths` the replicated int `(B,)` input. The text cotangent is split over the
    devices' copies (`text_shares`). Returns global-order NumPy `dict(out, dq, dk, dv,
    dsinks)` (the text rows of `out` from device 0) and `out_text` `(B, n, T, H, D)`."""
    T = text_len
    to = lambda x: zigzag(x, zigzag_size)  # noqa: E731
    back = lambda x: unzigzag(x, zigzag_size)  # noqa: E731
    split = lambda x: split_text(x, T, text_position)  # noqa: E731
    join = lambda t, x: np.concatenate([t, x] if text_position == "prefix" else [x, t], 1)  # noqa: E731
    parts = [split(a[name]) for name in ("q", "k", "v")]
    text = tuple(jnp.asarray(t) for t, _ in parts)
    visual = tuple(to(x) for _, x in parts)
    seg = None
    if a.get("seg") is not None:
        t, x = split(a["seg"])
        seg = (jnp.asarray(t), to(x))
    s = jnp.asarray(a["sinks"]) if a.get("sinks") is not None else None
    lengths = None if lengths is None else jnp.asarray(lengths, jnp.int32)

    dout_t, dout_v = split(a["dout"])
    B, rest = dout_v.shape[0], dout_v.shape[2:]
    L = dout_v.shape[1] // n
    visual_dout = np.asarray(to(dout_v)).reshape(B, n, L, *rest)
    shares = text_shares(dout_t, n)
    blocks = np.concatenate(
        [shares, visual_dout] if text_position == "prefix" else [visual_dout, shares], axis=2)
    dev_dout = jnp.asarray(blocks.reshape(B, n * (T + L), *rest))

    out, (d_text, d_visual, ds) = fn(text, visual, seg, s, lengths, dev_dout)
    out = np.asarray(out).reshape(B, n, T + L, *rest)
    out_t, out_v = split_text(out, T, text_position, axis=2)
    res = dict(out_text=out_t)
    res["out"] = join(out_t[:, 0], back(out_v.reshape(B, n * L, *rest)))
    for name, g_t, g_v in zip(("dq", "dk", "dv"), d_text, d_visual):
        res[name] = join(np.asarray(g_t), back(g_v))
    res["dsinks"] = None if ds is None else np.asarray(ds)
    return res
