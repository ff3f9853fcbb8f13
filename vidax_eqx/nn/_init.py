"""Parameter initialization, fast for a concrete key and traceable for a traced one.

Every constructor of `vidax_eqx.nn` and `vidax_eqx.models` draws its arrays through
these functions. There are two paths, chosen per call from the key:

- **host** (a concrete key, outside any trace): NumPy draws the values, seeded from
  the key's data, and `jax.device_put` moves them to the default device. Nothing
  is compiled: a tiny Wan builds in milliseconds instead of the seconds that
  `jax.random` takes when it dispatches (and compiles) one small program per weight.
- **traced** (a traced key: inside `jax.jit` / `eqx.filter_jit`, `jax.vmap`,
  `eqx.filter_eval_shape`; or any key while a trace is being built, such as a
  concrete key closed over by a function given to `eqx.filter_eval_shape`):
  `jax.random`, exactly as `eqx.nn.Linear` and friends draw, so that an abstract
  build allocates nothing and a build under `jit` runs on the device.

Both paths draw from the same distributions (`eqx.nn.Linear`'s
`U(-1/sqrt(in), 1/sqrt(in))` for weight and bias, standard normals, ...), and one
key gives one model on each path; the two paths give different values. The host
path's keys are NumPy `uint32` arrays (the key's data; `jax.random` accepts them as
raw keys), derived from their parent by NumPy's `SeedSequence` hashing.

`jax_init()` switches the host path off (every draw by `jax.random`, as before this
module existed): the construction benchmark builds the old way with it.
"""

import contextlib
import contextvars
import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


_JAX_ONLY = contextvars.ContextVar("vidax_eqx.nn.jax_init", default=False)
_ON_HOST = contextvars.ContextVar("vidax_eqx.nn.host_arrays", default=False)
_PROBE = np.zeros((), np.uint8)
# Tags that keep the seeds of a key's draw, split and fold_in apart.
_DRAW, _SPLIT, _FOLD = 0x5EED0001, 0x5EED0002, 0x5EED0003


@contextlib.contextmanager
def jax_init():
    """Inside: every draw by `jax.random` (the traced path), even for a concrete key:
    the per-weight eager initialization of `eqx.nn.Linear`. For comparisons and
    benchmarks."""
    token = _JAX_ONLY.set(True)
    try:
        yield
    finally:
        _JAX_ONLY.reset(token)


def tracing() -> bool:
    """Whether a JAX trace is being built here (`jit`, `eval_shape`, `grad`, ...): a
    value created now is a tracer."""
    return isinstance(jax.device_put(_PROBE), jax.core.Tracer)


def host_key(key) -> np.ndarray | None:
    """The key's data as a NumPy `uint32` array when the host path serves it (a
    concrete key, no trace being built, `jax_init` off); `None` for the traced path."""
    if isinstance(key, jax.core.Tracer) or _JAX_ONLY.get() or not hasattr(key, "dtype"):
        return None  # (not an array: `jax.random` says what a key must be)
    if isinstance(key, np.ndarray):  # a key of the host path
        return key if not tracing() else None
    if tracing():
        return None
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.asarray(key, np.uint32)


def _rng(tag: int, data: np.ndarray) -> np.random.Generator:
    return np.random.default_rng([tag, data.size, *data.ravel().tolist()])


def _dtype(dtype) -> np.dtype:
    default = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    return np.dtype(jax.dtypes.canonicalize_dtype(default if dtype is None else dtype))


def _put(x: np.ndarray):
    """A host value as the caller gets it: on the device, or left on the host inside
    `stacked`'s build (which stacks the layers there and moves them once)."""
    return x if _ON_HOST.get() else jax.device_put(x)


def split(key, num: int = 2):
    """`num` keys from `key` (`jax.random.split` on the traced path). Index the result
    (`keys[i]`) or unpack it."""
    data = host_key(key)
    if data is None:
        return jax.random.split(key, num)
    return _rng(_SPLIT, data).integers(0, 2**32, (num, *data.shape), dtype=np.uint32)


def fold_in(key, data: int):
    """A key from `key` and the integer `data` (`jax.random.fold_in` on the traced path)."""
    host = host_key(key)
    if host is None:
        return jax.random.fold_in(key, data)
    return _rng(_FOLD, np.append(host, np.uint32(data))).integers(
        0, 2**32, host.shape, dtype=np.uint32)


def uniform(key, shape, dtype, bound: float):
    """`U(-bound, bound)` of `shape` in `dtype` (`jax.random.uniform` on the traced path)."""
    data = host_key(key)
    if data is None:
        return jax.random.uniform(key, shape, dtype, -bound, bound)
    x = _rng(_DRAW, data).random(shape, np.float32)
    x *= np.float32(2 * bound)
    x -= np.float32(bound)
    return _put(x.astype(_dtype(dtype), copy=False))


def normal(key, shape, dtype, std: float = 1.0):
    """`N(0, std^2)` of `shape`, drawn in float32 and cast to `dtype`."""
    data = host_key(key)
    if data is None:
        return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)
    x = _rng(_DRAW, data).standard_normal(shape, np.float32)
    x *= np.float32(std)
    return _put(x.astype(_dtype(dtype), copy=False))


def full(shape, value, dtype):
    """A constant array (`jnp.full`; on the host path made by NumPy, no compile)."""
    if tracing():
        return jnp.full(shape, value, dtype)
    return _put(np.full(shape, value, _dtype(dtype)))


def ones(shape, dtype):
    """`full(shape, 1, dtype)`."""
    return full(shape, 1, dtype)


def zeros(shape, dtype):
    """`full(shape, 0, dtype)`."""
    return full(shape, 0, dtype)


@functools.lru_cache(maxsize=256)
def _linear_template(in_features, out_features, use_bias: bool, dtype) -> eqx.nn.Linear:
    return eqx.filter_eval_shape(eqx.nn.Linear, in_features, out_features, use_bias, dtype,
                                 key=jax.random.key(0))


def linear(in_features: int, out_features: int, *, use_bias: bool = True, dtype=None,
           key) -> eqx.nn.Linear:
    """`eqx.nn.Linear(in_features, out_features, use_bias, dtype, key=key)`: weight and
    bias `U(-1/sqrt(in_features), 1/sqrt(in_features))`, as Equinox (and PyTorch)
    initialize them; on the traced path, Equinox's own constructor."""
    if host_key(key) is None:
        return eqx.nn.Linear(in_features, out_features, use_bias, dtype, key=key)
    dtype = _dtype(dtype)
    bound = 1 / math.sqrt(in_features) if in_features else 1.0
    wkey, bkey = split(key)
    template = _linear_template(in_features, out_features, use_bias, dtype)
    weight = uniform(wkey, (out_features, in_features), dtype, bound)
    if not use_bias:
        return eqx.tree_at(lambda m: m.weight, template, weight)
    bias = uniform(bkey, (out_features,), dtype, bound)
    return eqx.tree_at(lambda m: (m.weight, m.bias), template, (weight, bias))


def stacked(make, keys):
    """`make(key)` for each of `keys` (from [`split`][]), stacked on a new leading axis
    of every array: `eqx.filter_vmap(make)(keys)` on the traced path. On the host path
    each layer is built on the host, copied into its slot, and the stacks moved to
    the device once; the layers' non-array parts (equal across layers) are the
    first's."""
    if isinstance(keys, np.ndarray) and not tracing() and not _JAX_ONLY.get():
        token = _ON_HOST.set(True)
        try:
            arrays, static = eqx.partition(make(keys[0]), eqx.is_array)
            leaves, treedef = jax.tree.flatten(arrays)
            stacks = [np.empty((len(keys), *np.shape(x)), np.asarray(x).dtype) for x in leaves]
            del leaves
            for i in range(len(keys)):
                layer = arrays if i == 0 else eqx.filter(make(keys[i]), eqx.is_array)
                for stack, x in zip(stacks, jax.tree.leaves(layer)):
                    stack[i] = x
                arrays = layer = None  # one layer on the host at a time
        finally:
            _ON_HOST.reset(token)
        leaves = [_put(stacks.pop(0)) for _ in range(len(stacks))]
        return eqx.combine(jax.tree.unflatten(treedef, leaves), static)
    return eqx.filter_vmap(make)(keys)
