"""Building the encoder's random weights in bounded memory, with the values it always had.

`T5Encoder(config, dtype=..., key=...)` draws its weights by `jax.random` (through
`eqx.nn.Linear` and `eqx.nn.Embedding`). Drawn whole, a large leaf costs far more than
its own bytes while it is made: XLA's CPU backend keeps the random bits' uint32 / uint64
intermediates of the whole leaf (16 bytes per element for a bfloat16 normal: 15.6 GiB for
UMT5's 256384 x 4096 token table, which is 2 GiB itself), and `eqx.filter_vmap` over the
layers draws each stacked leaf `(24, ...)` in one go. Built here instead:

- [`stack_layers`][]: the layers one at a time, each written into its slot of the stacked
    arrays (donated, updated in place), so one layer's draws are alive at a time; the
    same values as `eqx.filter_vmap` (a layer's draws depend on its key alone).
- [`normal_table`][], [`uniform_table`][] (and [`linear`][], `eqx.nn.Linear` with its
    weight so drawn): `jax.random.normal` / `uniform` of a whole leaf drawn in row blocks
    of about [`BLOCK`][] elements, each block the same bits `jax.random` gives those rows
    of the whole leaf (its threefry counters are the elements' flat indices,
    `jax_threefry_partitionable`, the default), written into the leaf in place.

Both serve a concrete key outside any trace (a traced key, under `jax.jit` or
`eqx.filter_eval_shape`, allocates nothing to bound) with JAX's default threefry
keys (typed or raw); otherwise the plain draws run. Every value, float32 or bfloat16, is the plain
draws' bit for bit (tests/test_t5.py checks it).
"""

import math
from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

from ...nn import internal as nn_internal


BLOCK = 1 << 22  # elements per drawn block of a table (64 MiB of intermediates on CPU)
_UINT = {8: np.uint8, 16: np.uint16, 32: np.uint32}


def bounded(key) -> bool:
    """Whether `key` is drawn here in bounded memory: a concrete threefry key, no trace
    being built, and partitionable threefry (a row block's bits are the whole draw's)."""
    if isinstance(key, jax.core.Tracer) or nn_internal.init.tracing():
        return False
    if not jax.config.jax_threefry_partitionable:
        return False
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(key)) == "threefry2x32"
    # A raw key (`jax.random.PRNGKey`): the default implementation's data.
    return (dtype == np.uint32 and tuple(key.shape) == (2,)
            and jax.config.jax_default_prng_impl == "threefry2x32")


def _key_data(key):
    return key if key.dtype == np.uint32 else jax.random.key_data(key)


def _uniform_bits(k1, k2, start: jax.Array, shape: tuple[int, ...], dtype):
    """`jax.random.uniform(key, (whole leaf), dtype)`'s floats in [1, 2) - 1 at the flat
    indices `start + arange(prod(shape))`, shaped `shape` (jax's `_uniform` before its
    scaling, with `_threefry_random_bits_partitionable`'s bits)."""
    size = math.prod(shape)
    lo0, hi0 = start[0], start[1]
    lo = lo0 + lax.iota(np.uint32, size)
    hi = hi0 + (lo < lo0).astype(np.uint32)  # the 64-bit index's carry
    bits1, bits2 = threefry2x32_p.bind(k1, k2, hi, lo)
    bits = bits1 ^ bits2
    finfo = jnp.finfo(dtype)
    nbits, nmant = finfo.bits, finfo.nmant
    rng_bits = nbits if nmant >= 8 else 8
    if rng_bits != 32:
        bits = lax.convert_element_type(bits, _UINT[rng_bits])
    uint = _UINT[nbits]
    if rng_bits != nbits:
        bits = lax.convert_element_type(bits, uint)
    float_bits = lax.shift_right_logical(bits, jnp.array(rng_bits - nmant, uint))
    float_bits = lax.bitwise_or(float_bits, jnp.asarray(np.array(1.0, dtype).view(uint), dtype=uint))
    floats = lax.bitcast_convert_type(float_bits, dtype) - jnp.array(1.0, dtype)
    return floats.reshape(shape)


@partial(jax.jit, static_argnames=("rows", "dtype", "normal"), donate_argnums=0)
def _draw_rows(table, key_data, row, start, minval, maxval, *, rows: int, dtype, normal: bool):
    """`table` with rows `row : row + rows` set to those of `jax.random.uniform(key,
    table.shape, dtype, minval, maxval)` (or of `jax.random.normal(key, table.shape,
    dtype)` when `normal`); `start`: the flat index of the first, as (low, high) uint32."""
    shape = (rows, *table.shape[1:])
    floats = _uniform_bits(key_data[0], key_data[1], start, shape, dtype)
    if normal:  # jax's `_normal_real`: uniform on (nextafter(-1, 0), 1), then sqrt(2) erfinv
        minval = np.nextafter(np.array(-1.0, dtype), np.array(0.0, dtype))
        maxval = np.array(1.0, dtype)
    minval = lax.convert_element_type(minval, dtype)
    maxval = lax.convert_element_type(maxval, dtype)
    x = lax.max(minval, floats * (maxval - minval) + minval)
    if normal:
        x = lax.mul(np.array(np.sqrt(2), dtype), lax.erf_inv(x))
    return lax.dynamic_update_slice_in_dim(table, x, row, axis=0)


def _table(key, shape: tuple[int, ...], dtype, normal: bool, minval=0.0, maxval=1.0):
    dtype = jnp.dtype(dtype)
    if not bounded(key) or math.prod(shape) <= BLOCK or jnp.finfo(dtype).bits not in _UINT:
        if normal:
            return jax.random.normal(key, shape, dtype)
        return jax.random.uniform(key, shape, dtype, minval=minval, maxval=maxval)
    cols = math.prod(shape[1:])
    rows = max(1, BLOCK // cols)
    key_data = _key_data(key)
    bounds = jnp.asarray(minval, jnp.float32), jnp.asarray(maxval, jnp.float32)
    table = jnp.zeros(shape, dtype)
    for row in range(0, shape[0], rows):
        n = min(rows, shape[0] - row)
        flat = row * cols
        start = jnp.array([flat & 0xFFFFFFFF, flat >> 32], np.uint32)
        table = _draw_rows(table, key_data, row, start, *bounds, rows=n, dtype=dtype,
                           normal=normal)
    return table


def normal_table(key, shape: tuple[int, ...], dtype) -> jax.Array:
    """`jax.random.normal(key, shape, dtype)` (what `eqx.nn.Embedding` draws), bit for
    bit; for a [`bounded`][] key drawn in row blocks of about [`BLOCK`][] elements into
    the table, in place."""
    return _table(key, shape, dtype, True)


def uniform_table(key, shape: tuple[int, ...], dtype, minval: float, maxval: float) -> jax.Array:
    """`jax.random.uniform(key, shape, dtype, minval, maxval)`, bit for bit, drawn as
    [`normal_table`][] draws."""
    return _table(key, shape, dtype, False, minval, maxval)


def linear(in_features: int, out_features: int, *, dtype, key) -> eqx.nn.Linear:
    """`eqx.nn.Linear(in_features, out_features, use_bias=False, dtype=dtype, key=key)`
    (its weight `U(-1/sqrt(in), 1/sqrt(in))` drawn with the first of `split(key)`), its
    weight drawn by [`uniform_table`][]."""
    if not bounded(key):
        return eqx.nn.Linear(in_features, out_features, use_bias=False, dtype=dtype, key=key)
    wkey, _ = jax.random.split(key, 2)
    lim = 1 / math.sqrt(in_features)
    weight = uniform_table(wkey, (out_features, in_features), dtype, -lim, lim)
    template = eqx.filter_eval_shape(eqx.nn.Linear, in_features, out_features, use_bias=False,
                                     dtype=dtype, key=key)
    return eqx.tree_at(lambda m: m.weight, template, weight)


@partial(jax.jit, donate_argnums=0)
def _set_layer(stacks, layer, i):
    return jax.tree.map(lambda s, x: lax.dynamic_update_index_in_dim(s, x, i, 0), stacks, layer)


def stack_layers(make, keys):
    """`eqx.filter_vmap(make)(keys)`: the layers `make(key)` stacked on a new leading axis
    of every array. For [`bounded`][] keys built one at a time, each written into its
    slot of the stacks (donated: updated in place); the layers' non-array parts (equal
    across layers) are the first's."""
    if not bounded(keys[0]):
        return eqx.filter_vmap(make)(keys)
    first, static = eqx.partition(make(keys[0]), eqx.is_array)
    stacks = jax.tree.map(lambda x: jnp.zeros((len(keys), *x.shape), x.dtype), first)
    stacks = _set_layer(stacks, first, 0)
    del first
    for i in range(1, len(keys)):
        stacks = _set_layer(stacks, eqx.filter(make(keys[i]), eqx.is_array), i)
    return eqx.combine(stacks, static)
