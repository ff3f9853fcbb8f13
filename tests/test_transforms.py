"""Composability: every public entry point under JAX's transformations.

A matrix of entry point x transformation. Each entry point is an `Entry`: a
function of global arrays (and Equinox modules / Flax variables), its inputs
(small: S = 37..61, D = 8, H = 4; sequence lengths that are not multiples of
any tile size; GQA and MQA), and an independent float64 reference written
here in NumPy on top of `oracle.attention`. Every transformation is checked
against that reference, forward and gradients (analytic from the oracle for
the attention functions, directional central differences of the float64
reference for the modules and norms), and against the untransformed call
where that is cheap:

| test                 | what is checked                                                  |
|----------------------|------------------------------------------------------------------|
| `test_jit`           | `jax.jit` / `eqx.filter_jit` == reference (== the eager call for the `EAGER` entries) |
| `test_vmap[axis0]`   | an extra leading batch axis on every array input                 |
| `test_vmap[axis1-partial]` | the batch on axis 1 for some inputs, `None` for the others, `out_axes=1` |
| `test_grad`          | `jax.grad` / `eqx.filter_grad` (and `jax.vjp` / `eqx.filter_vjp`), every differentiable input and parameter |
| `test_checkpoint`    | `jax.vjp` of `jax.checkpoint(fn, policy)` / `eqx.filter_checkpoint` around the call (`shard_map` included) |
| `test_eval_shape`    | `jax.eval_shape` / `eqx.filter_eval_shape` on `ShapeDtypeStruct` inputs |
| `test_donate`        | `jax.jit(..., donate_argnums=...)` / `eqx.filter_jit(..., donate=...)` bit-identical to the undonated call |

Entries whose arguments are arrays (and Flax variables, dicts of arrays) go through
JAX's transformations as they are. Equinox modules go through Equinox's filtered ones
(`eqx.filter_jit`, `filter_vmap`, `filter_grad`, `filter_vjp`, `filter_checkpoint`,
`filter_eval_shape`, and `nn.sharding.filter_shard_map`): an attention module's
`ParallelConfig` is a non-array leaf, so that its tree structure does not depend on
the parallel configuration, and `jax.jit` does not take it as an argument
(`test_jit_rejects_module_arguments`).

and beyond the matrix: checkpointing inside `shard_map`, scans over stacked
layers (`eqx.filter_vmap` construction, `lax.scan` == a Python loop; one
device, Ulysses, ring, Ulysses x TP), module construction under
`eqx.filter_eval_shape` / `filter_jit` / `filter_vmap`, second-order
gradients, `linen.scan` / `linen.remat` over the shim, and the combinations that
cannot work, which must raise clear errors (forward-mode autodiff through the
attention custom VJPs, traced static arguments).

Sharded entries are not run eagerly: an eager `shard_map` executes op by op
(seconds per call); the float64 reference is their untransformed baseline.
Programs are compiled at XLA CPU optimization level 0 (`FAST_COMPILE`) to keep
the file within its time budget.
"""

import dataclasses
import functools
from typing import Callable

import equinox as eqx
import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import oracle
from vidax_eqx import core, kernels, nn, parallel
from vidax_eqx import flax as vflax


F32 = np.float32
SP, TP, DP, RING = parallel.SP_AXIS, parallel.TP_AXIS, parallel.DP_AXIS, "ring"
SEQ = P(None, SP)
H, D = 4, 8
DIM = H * D  # 32
NOTHING = jax.checkpoint_policies.nothing_saveable


# -- float64 references (`oracle.py`) --------------------------------------------------------


f64, map_arrays, to64 = oracle.f64, harness.map_arrays, harness.to64


def ref_block(b, x, cos, sin):
    return x + oracle.wan_self_attention(b.attn, oracle.rms_norm(x, b.norm.weight, b.norm.eps),
                                         (cos, sin))


# -- entries -------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Entry:
    """One public entry point with fixed inputs.

    - `fn(*args)`: the untransformed call on global arrays (sharded entries wrap
        `jax.shard_map`, or `nn.sharding.filter_shard_map` where they take modules, themselves).
    - `diff`: the positions of the differentiable arguments.
    - `ref(*args64)`: the float64 reference forward.
    - `ref_grads(args64, ct64)`: the reference gradients of `<fn(args), ct>` for the
        `diff` arguments; `None`: checked by finite differences of `ref`.
    - `partial`: `in_axes` of the `vmap-axis1-partial` case.
    - `placement`: sharded entries: `(mesh, specs)`, a `PartitionSpec` (prefix) per
        argument: where a training step would keep the inputs (`test_donate` places them
        there, so the donated buffers are the ones the program consumes).
    - `reuses_donation`: `False` where no output has the layout of a donated input (the
        output is rearranged after the `shard_map`), so XLA cannot reuse any buffer.
    """

    fn: Callable
    args: tuple
    diff: tuple[int, ...]
    ref: Callable
    ref_grads: Callable | None = None
    partial: tuple | None = None
    placement: tuple | None = None
    reuses_donation: bool = True

    @property
    def sharded(self) -> bool:
        return self.placement is not None

    @functools.cached_property
    def ref_out(self):
        return self.ref(*to64(self.args))

    @functools.cached_property
    def ct(self):
        rng = np.random.default_rng(123)
        return jax.tree.map(lambda r: rng.standard_normal(r.shape).astype(F32), self.ref_out)

    @functools.cached_property
    def has_modules(self) -> bool:
        """Equinox modules or Flax variables among the arguments: gradients by
        `eqx.filter_grad` / `eqx.filter_vjp`."""
        return any(not _is_array(a) for a in self.args)

    @functools.cached_property
    def has_eqx_modules(self) -> bool:
        """Equinox modules among the arguments: Equinox's filtered transformations."""
        return any(isinstance(a, eqx.Module) for a in self.args)

    def jit(self, fn, **kw):
        """`filter_jit` for the entries that take Equinox modules, else `jit`."""
        return (filter_jit if self.has_eqx_modules else jit)(fn, **kw)

    @functools.cached_property
    def jit_out(self):
        return self.jit(self.fn)(*self.args)

    def with_diff(self, diff_args) -> list:
        args = list(self.args)
        for i, a in zip(self.diff, diff_args):
            args[i] = a
        return args


def _is_array(a) -> bool:
    return isinstance(a, (jax.Array, np.ndarray))


# `harness.FAST_COMPILE`: XLA's CPU backend without its backend optimizations compiles
# these small programs about twice as fast and gives the same numbers.
FAST_COMPILE = harness.FAST_COMPILE


def jit(fn, **kw):
    """`jax.jit`, for functions of arrays (and Flax variables: dicts of arrays)."""
    return jax.jit(fn, compiler_options=FAST_COMPILE, **kw)


def filter_jit(fn, **kw):
    """`eqx.filter_jit`, for functions of Equinox modules: their arrays are traced, their
    other leaves (an attention module's `ParallelConfig`) static. `jax.jit` does not take
    a module as an argument (`test_jit_rejects_module_arguments`)."""
    return eqx.filter_jit(fn, compiler_options=FAST_COMPILE, **kw)


_BUILDERS: dict[str, tuple[Callable[[], Entry], bool]] = {}


def entry(name: str, *, differentiable: bool = True):
    """Registers an `Entry` builder (run lazily, once) under `name`."""

    def register(build):
        _BUILDERS[name] = (build, differentiable)
        return build

    return register


@functools.cache
def get(name: str) -> Entry:
    e = _BUILDERS[name][0]()
    e.args = tuple(replicated(e, a) for a in e.args)
    return e


def replicated(e: Entry, tree):
    """A sharded entry's input replicated over its mesh (host to devices, nothing compiled;
    left on one device, every jitted call would first compile a program to spread it)."""
    if not e.sharded:
        return tree
    sharding = jax.NamedSharding(e.placement[0], P())
    return map_arrays(lambda a: jax.device_put(np.asarray(a), sharding), tree)


def _normal(rng, *shape):
    return jnp.asarray(harness.normal(rng, shape))


def _segments(rng, Bn, S):
    """Sorted runs of 0..2 with a padded (-1) tail, differing per batch element."""
    return jnp.asarray(harness.segment_ids(rng, Bn, S, scattered=False, pad=(S // 7, S // 7)))


def _oracle_grads(call, names):
    """`ref_grads` from an oracle call `call(args64, dout=..., dlse=...) -> Result`."""

    def grads(args, ct):
        if isinstance(ct, tuple):
            r = call(args, dout=ct[0], dlse=ct[1])
        else:
            r = call(args, dout=ct)
        return tuple(getattr(r, n) for n in names)

    return grads


# kernels ---------------------------------------------------------------------------------


@entry("kernels.attention[xla,gqa,cross,bias,sinks]")
def _():
    r = np.random.default_rng(0)
    args = (_normal(r, 2, 45, H, D), _normal(r, 2, 61, 2, D), _normal(r, 2, 61, 2, D),
            _normal(r, 1, H, 45, 61), _normal(r, H))
    call = lambda a, **kw: oracle.attention(a[0], a[1], a[2], bias=a[3], sinks=a[4], **kw)
    return Entry(
        fn=lambda q, k, v, bias, sinks: kernels.attention(
            q, k, v, bias=bias, sinks=sinks, implementation="xla"),
        args=args, diff=(0, 1, 2, 3, 4),
        ref=lambda *a: call(a).out,
        ref_grads=_oracle_grads(call, ("dq", "dk", "dv", "dbias", "dsinks")),
        partial=(0, None, None, None, None),
    )


BLOCKWISE = kernels.Blockwise(block_q=16, block_kv=16)


@entry("kernels.attention[blockwise,mqa,causal,window,segments]")
def _():
    r = np.random.default_rng(1)
    S = 53  # 16-token tiles: 3 full and one of 5
    args = (_normal(r, 2, S, H, D), _normal(r, 2, S, 1, D), _normal(r, 2, S, 1, D),
            _segments(r, 2, S))
    opts = dict(causal=True, window=(20, None))
    call = lambda a, **kw: oracle.attention(a[0], a[1], a[2], segment_ids=a[3], **opts, **kw)
    return Entry(
        fn=lambda q, k, v, seg: kernels.attention(
            q, k, v, segment_ids=seg, implementation=BLOCKWISE, **opts),
        args=args, diff=(0, 1, 2),
        ref=lambda *a: call(a).out,
        ref_grads=_oracle_grads(call, ("dq", "dk", "dv")),
        partial=(0, None, None, None),
    )


@entry("kernels.attention_fwd[auto,gqa,causal,softcap,sinks]")
def _():
    r = np.random.default_rng(2)
    args = (_normal(r, 2, 44, H, D), _normal(r, 2, 44, 2, D), _normal(r, 2, 44, 2, D),
            _normal(r, H))
    opts = dict(causal=True, logits_soft_cap=2.0, scale=0.6)
    call = lambda a, **kw: oracle.attention(a[0], a[1], a[2], sinks=a[3], **opts, **kw)
    return Entry(
        fn=lambda q, k, v, sinks: kernels.attention_fwd(q, k, v, sinks=sinks, **opts),
        args=args, diff=(0, 1, 2, 3),
        ref=lambda *a: (call(a).out, call(a).lse),
        ref_grads=_oracle_grads(call, ("dq", "dk", "dv", "dsinks")),
        partial=(None, 0, 0, None),
    )


@entry("kernels.attention_bwd[blockwise,gqa,bias]", differentiable=False)
def _():
    """The backward from the `(out, lse)` of `attention_fwd` (`"xla"`) on the same inputs, so
    that every batch element of a `vmap` gets a consistent `(out, lse)`."""
    r = np.random.default_rng(3)
    S_q, S_k = 37, 50
    args = (_normal(r, 2, S_q, H, D), _normal(r, 2, S_k, 2, D), _normal(r, 2, S_k, 2, D),
            _normal(r, 2, S_q, H, D), _normal(r, 2, 1, S_q, S_k))

    def fn(q, k, v, dout, bias):
        out, lse = kernels.attention_fwd(q, k, v, bias=bias, implementation="xla")
        return kernels.attention_bwd(q, k, v, out, lse, dout, bias=bias, implementation=BLOCKWISE)

    def ref(q, k, v, dout, bias):
        g = oracle.attention(q, k, v, bias=bias, dout=dout)
        return (g.dq, g.dk, g.dv, g.dbias, None)

    return Entry(fn=fn, args=args, diff=(), ref=ref, partial=(None, None, None, 0, None))


# parallel --------------------------------------------------------------------------------


def _shard(fn, mesh, in_specs, out_specs):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


@entry("parallel.ring_attention[contiguous,gqa,causal,sinks]")
def _():
    r = np.random.default_rng(4)
    S = 44  # 11 tokens per device
    args = (_normal(r, 2, S, H, D), _normal(r, 2, S, 2, D), _normal(r, 2, S, 2, D), _normal(r, H))
    mesh, specs = harness.mesh(sp=4), (SEQ, SEQ, SEQ, P())
    f = _shard(lambda q, k, v, s: parallel.ring_attention(q, k, v, ring_axis=SP, causal=True,
                                                          sinks=s), mesh, specs, SEQ)
    call = lambda a, **kw: oracle.attention(a[0], a[1], a[2], sinks=a[3], causal=True, **kw)
    return Entry(fn=f, args=args, diff=(0, 1, 2, 3), ref=lambda *a: call(a).out,
                 ref_grads=_oracle_grads(call, ("dq", "dk", "dv", "dsinks")),
                 partial=(0, None, None, None), placement=(mesh, specs))


@entry("parallel.ring_attention[zigzag,window,segments]")
def _():
    r = np.random.default_rng(5)
    S, n = 44, 2  # 22 tokens per device: zigzag chunks of 11
    args = (_normal(r, 2, S, H, D), _normal(r, 2, S, H, D), _normal(r, 2, S, H, D),
            _segments(r, 2, S))
    mesh, specs = harness.mesh(sp=n), (SEQ,) * 4
    sharded = _shard(
        lambda q, k, v, seg: parallel.ring_attention(
            q, k, v, ring_axis=SP, window=(9, 4), segment_ids=seg, layout="zigzag"),
        mesh, specs, SEQ)

    def fn(q, k, v, seg):
        zz = lambda x: parallel.zigzag_permute(x, 1, n)
        return parallel.zigzag_unpermute(sharded(zz(q), zz(k), zz(v), zz(seg)), 1, n)

    call = lambda a, **kw: oracle.attention(a[0], a[1], a[2], segment_ids=a[3], window=(9, 4), **kw)
    return Entry(fn=fn, args=args, diff=(0, 1, 2), ref=lambda *a: call(a).out,
                 ref_grads=_oracle_grads(call, ("dq", "dk", "dv")),
                 partial=(0, None, None, 0), placement=(mesh, specs), reuses_donation=False)


@entry("parallel.sequence_parallel_self_attention[gqa,bias]")
def _():
    r = np.random.default_rng(6)
    S = 44
    args = (_normal(r, 2, S, H, D), _normal(r, 2, S, 2, D), _normal(r, 2, S, 2, D),
            _normal(r, 1, H, S, S))
    mesh, specs = harness.mesh(sp=4), (SEQ, SEQ, SEQ, P())
    f = _shard(lambda q, k, v, b: parallel.sequence_parallel_self_attention(q, k, v, SP, bias=b),
               mesh, specs, SEQ)
    call = lambda a, **kw: oracle.attention(a[0], a[1], a[2], bias=a[3], **kw)
    return Entry(fn=f, args=args, diff=(0, 1, 2, 3), ref=lambda *a: call(a).out,
                 ref_grads=_oracle_grads(call, ("dq", "dk", "dv", "dbias")),
                 partial=(None, 0, 0, None), placement=(mesh, specs))


T_TEXT = 5


@entry("parallel.sequence_parallel_joint_self_attention[text=5,gqa]")
def _():
    """Global text `(B, T, ...)` (replicated) and visual `(B, 44, ...)` (sharded); the
    output is `[text copy of device 0; visual]` (the whole text cotangent goes to that
    copy, as the function documents)."""
    r = np.random.default_rng(7)
    L = 44
    args = (_normal(r, 2, T_TEXT, H, D), _normal(r, 2, T_TEXT, 2, D), _normal(r, 2, T_TEXT, 2, D),
            _normal(r, 2, L, H, D), _normal(r, 2, L, 2, D), _normal(r, 2, L, 2, D))

    def local(qt, kt, vt, qv, kv, vv):
        cat = lambda t, x: jnp.concatenate([t, x], axis=1)
        out = parallel.sequence_parallel_joint_self_attention(
            cat(qt, qv), cat(kt, kv), cat(vt, vv), T_TEXT, SP)
        return out[:, :T_TEXT][None], out[:, T_TEXT:]

    mesh, specs = harness.mesh(sp=4), (P(),) * 3 + (SEQ,) * 3
    sharded = _shard(local, mesh, specs, (P(SP), SEQ))

    def fn(*a):
        copies, visual = sharded(*a)
        return jnp.concatenate([copies[0], visual], axis=1)

    def call(a, **kw):
        q, k, v = (np.concatenate([a[i], a[i + 3]], axis=1) for i in range(3))
        return oracle.attention(q, k, v, **kw)

    def grads(a, ct):
        g = call(a, dout=ct)
        text = tuple(getattr(g, n)[:, :T_TEXT] for n in ("dq", "dk", "dv"))
        return text + tuple(getattr(g, n)[:, T_TEXT:] for n in ("dq", "dk", "dv"))

    return Entry(fn=fn, args=args, diff=(0, 1, 2, 3, 4, 5), ref=lambda *a: call(a).out,
                 ref_grads=grads, partial=(None,) * 3 + (0, 0, 0), placement=(mesh, specs),
                 reuses_donation=False)


USP_SEQ = P(None, (RING, SP))


@entry("parallel.usp_attention[ulysses2xring2,gqa,causal]")
def _():
    r = np.random.default_rng(8)
    S = 44  # 11 tokens per device, 22 per ring rank
    args = (_normal(r, 2, S, H, D), _normal(r, 2, S, 2, D), _normal(r, 2, S, 2, D))
    mesh, specs = harness.mesh(sp=2, **{RING: 2}), (USP_SEQ,) * 3
    f = _shard(lambda q, k, v: parallel.usp_attention(q, k, v, ulysses_axis=SP, ring_axis=RING,
                                                      causal=True), mesh, specs, USP_SEQ)
    call = lambda a, **kw: oracle.attention(*a, causal=True, **kw)
    return Entry(fn=f, args=args, diff=(0, 1, 2), ref=lambda *a: call(a).out,
                 ref_grads=_oracle_grads(call, ("dq", "dk", "dv")),
                 partial=(0, None, None), placement=(mesh, specs))


def _dense_mask(S, seed):
    m = np.random.default_rng(seed).random((S, S)) < 0.5
    m[3] = False  # a row that sees nothing
    m[10:20, 20:30] = False  # a whole ring step of device 1
    return m


@entry("parallel.make_ring_attention[dense mask,gqa,sinks]")
def _():
    r = np.random.default_rng(9)
    S = 40
    mask = _dense_mask(S, 9)
    kernel = parallel.make_ring_attention(mask, ring_axis=SP)
    args = (_normal(r, 2, S, H, D), _normal(r, 2, S, 2, D), _normal(r, 2, S, 2, D), _normal(r, H))
    mesh, specs = harness.mesh(sp=4), (SEQ, SEQ, SEQ, P())
    f = _shard(lambda q, k, v, s: kernel(q, k, v, sinks=s), mesh, specs, SEQ)
    call = lambda a, **kw: oracle.attention(a[0], a[1], a[2], sinks=a[3], mask=mask, **kw)
    return Entry(fn=f, args=args, diff=(0, 1, 2, 3), ref=lambda *a: call(a).out,
                 ref_grads=_oracle_grads(call, ("dq", "dk", "dv", "dsinks")),
                 partial=(0, None, None, None), placement=(mesh, specs))


@entry("parallel.tensor_parallel_attention[dp2xtp4,gqa,bias,sinks,segments]")
def _():
    r = np.random.default_rng(10)
    S = 37
    args = (_normal(r, 2, S, H, D), _normal(r, 2, S, 2, D), _normal(r, 2, S, 2, D),
            _normal(r, 2, H, S, S), _normal(r, H), _segments(r, 2, S))
    mesh = harness.mesh(dp=2, tp=4)
    call = lambda a, **kw: oracle.attention(a[0], a[1], a[2], bias=a[3], sinks=a[4],
                                            segment_ids=a[5], **kw)
    return Entry(
        fn=lambda q, k, v, b, s, seg: parallel.tensor_parallel_attention(
            q, k, v, mesh=mesh, bias=b, sinks=s, segment_ids=seg),
        args=args, diff=(0, 1, 2, 3, 4), ref=lambda *a: call(a).out,
        ref_grads=_oracle_grads(call, ("dq", "dk", "dv", "dbias", "dsinks")),
        partial=(0, None, None, None, None, None),
        placement=(mesh, (HEADS, P(DP), P(DP), P(DP, TP), P(TP), P(DP))))


@entry("parallel.chunk_by_rank+gather_chunks+pad_to_multiple+unpad")
def _():
    """Inside shard_map over sp=4: pad 42 -> 44 tokens, take this rank's chunk, scale
    it by `rank + 1`, gather the chunks back, unpad: `x * (token // 11 + 1)`."""
    S, n = 42, 4
    x = _normal(np.random.default_rng(11), 2, S, 3)

    def local(x):
        rank = jax.lax.axis_index(SP)
        chunk = parallel.chunk_by_rank(parallel.pad_to_multiple(x, n, axis=1), 1, n, rank)
        full = parallel.gather_chunks(chunk * (rank + 1).astype(x.dtype), 1, SP)
        return parallel.unpad(full, S, axis=1)[None]

    mesh = harness.mesh(sp=n)
    sharded = _shard(local, mesh, P(), P(SP))
    factor = (np.arange(S) // 11 + 1)[:, None]
    return Entry(fn=lambda x: sharded(x)[0], args=(x,), diff=(0,), ref=lambda x: x * factor,
                 ref_grads=lambda a, ct: (ct * factor,), partial=(0,), placement=(mesh, (P(),)))


HEADS = P(DP, None, TP)  # (B, S, H, D) with heads over tp, batch over dp


# core ------------------------------------------------------------------------------------


def _core_args(seed, S_q, S_k):
    r = np.random.default_rng(seed)
    return (_normal(r, 2, S_q, H, D), _normal(r, 2, S_k, H, D), _normal(r, 2, S_k, H, D),
            _normal(r, 1, H, S_q, S_k), jnp.asarray(r.random((2, 1, S_q, S_k)) < 0.8))


def _core_call(a, **kw):
    return oracle.attention(a[0], a[1], a[2], bias=a[3], mask=a[4], **kw)


@entry("core.dot_product_attention[bias,mask,cross]")
def _():
    return Entry(fn=lambda q, k, v, b, m: core.dot_product_attention(q, k, v, b, m),
                 args=_core_args(12, 40, 52), diff=(0, 1, 2, 3),
                 ref=lambda *a: _core_call(a).out,
                 ref_grads=_oracle_grads(_core_call, ("dq", "dk", "dv", "dbias")),
                 partial=(0, None, None, None, None))


@entry("core.dot_product_attention[mesh=dp2xtp4,bias,mask]")
def _():
    mesh = harness.mesh(dp=2, tp=4)
    return Entry(fn=lambda q, k, v, b, m: core.dot_product_attention(q, k, v, b, m, mesh=mesh),
                 args=_core_args(13, 41, 41), diff=(0, 1, 2, 3),
                 ref=lambda *a: _core_call(a).out,
                 ref_grads=_oracle_grads(_core_call, ("dq", "dk", "dv", "dbias")),
                 partial=(None, 0, 0, None, None),
                 placement=(mesh, (HEADS, HEADS, HEADS, P(None, TP), P(DP))))


@entry("core.local_attention[scale]")
def _():
    a = _core_args(14, 43, 43)[:3]
    call = lambda a, **kw: oracle.attention(*a, scale=0.5, **kw)
    return Entry(fn=lambda q, k, v: core.local_attention(q, k, v, scale=0.5), args=a,
                 diff=(0, 1, 2), ref=lambda *a: call(a).out,
                 ref_grads=_oracle_grads(call, ("dq", "dk", "dv")), partial=(0, None, None))


# nn: norms and functional ----------------------------------------------------------------


def randomized(module, seed):
    """Every parameter perturbed (norm weights away from 1, biases away from 0), in NumPy."""
    return harness.perturbed(module, seed, scale=0.3)


def random_module(make, seed):
    """`make()`'s structure, traced by `eqx.filter_eval_shape` (nothing is computed), with
    parameters drawn in NumPy: matrices `N(0, 1 / DIM)`, biases `0.3 N(0, 1)`, other
    vectors (norm scales) `1 + 0.3 N(0, 1)`. Building modules eagerly would compile a
    dozen small initialization programs per module."""
    rng = np.random.default_rng(seed)

    def draw(path, a):
        if not isinstance(a, jax.ShapeDtypeStruct):
            return a  # a non-array leaf: an attention module's `ParallelConfig`
        n = rng.standard_normal(a.shape)
        if "bias" in jax.tree_util.keystr(path):
            n = 0.3 * n
        elif len(a.shape) >= 2:
            n = n / np.sqrt(DIM)
        else:
            n = 1 + 0.3 * n
        return jnp.asarray(n.astype(a.dtype))

    return jax.tree_util.tree_map_with_path(draw, eqx.filter_eval_shape(make))


@entry("nn.RMSNorm")
def _():
    m = random_module(lambda: nn.RMSNorm(DIM), 20)
    return Entry(fn=lambda m, x: m(x), args=(m, _normal(np.random.default_rng(21), 44, DIM)), diff=(0, 1),
                 ref=lambda m, x: oracle.rms_norm(x, m.weight, m.eps), partial=(None, 0))


@entry("nn.TPShardedRMSNorm[tp=4]")
def _():
    m = eqx.filter_eval_shape(nn.TPShardedRMSNorm, DIM // 4, DIM)
    m = eqx.tree_at(lambda m: m.weight, m, _normal(np.random.default_rng(22), DIM))  # the global weight
    spec = jax.tree.map(lambda _: P(TP), m)
    mesh, specs = harness.mesh(tp=4), (spec, P(None, TP))
    f = _shard(lambda m, x: m(x), mesh, specs, P(None, TP))
    return Entry(fn=f, args=(m, _normal(np.random.default_rng(23), 44, DIM)), diff=(0, 1),
                 ref=lambda m, x: oracle.rms_norm(x, m.weight, m.eps), partial=(None, 0),
                 placement=(mesh, specs))


@entry("nn.LayerNorm[per head]")
def _():
    m = random_module(lambda: nn.LayerNorm(D), 24)
    return Entry(fn=lambda m, x: m(x), args=(m, _normal(np.random.default_rng(25), 44, H, D)), diff=(0, 1),
                 ref=lambda m, x: oracle.layer_norm(x, m.weight, m.bias, m.eps), partial=(None, 0))


@entry("nn.functional.rms_norm")
def _():
    r = np.random.default_rng(26)
    return Entry(fn=lambda x, w: nn.functional.rms_norm(x, w, 1e-5),
                 args=(_normal(r, 2, 44, DIM), _normal(r, DIM)), diff=(0, 1),
                 ref=lambda x, w: oracle.rms_norm(x, w, 1e-5), partial=(0, None))


GRID = (4, 1, 11)  # 44 tokens


def _rope(grid=GRID):
    return nn.functional.rope_3d(grid, D)


@entry("nn.functional.apply_rope+rope_3d")
def _():
    cos, sin = _rope()
    return Entry(fn=lambda x, c, s: nn.functional.apply_rope(x, c, s),
                 args=(_normal(np.random.default_rng(27), 2, 44, H, D), cos, sin), diff=(0, 1, 2),
                 ref=oracle.rope, partial=(0, None, None))


# nn: attention modules ---------------------------------------------------------------------


@entry("nn.Attention[rope,segments]")
def _():
    m = random_module(lambda: nn.Attention(DIM, H, key=jax.random.key(0)), 30)
    r = np.random.default_rng(31)
    seg = np.zeros(44, np.int32)
    seg[30:], seg[40:] = 1, -1
    return Entry(fn=lambda m, x, c, s, seg: m(x, rope=(c, s), segment_ids=seg),
                 args=(m, _normal(r, 44, DIM), *_rope(), jnp.asarray(seg)), diff=(0, 1),
                 ref=lambda m, x, c, s, seg: oracle.wan_self_attention(m, x, (c, s), seg),
                 partial=(None, 0, None, None, None))


@entry("nn.CrossAttention[context_mask]")
def _():
    m = random_module(lambda: nn.CrossAttention(DIM, H, context_dim=24, key=jax.random.key(1)), 32)
    r = np.random.default_rng(33)
    cmask = jnp.asarray(np.arange(13) < 10)

    return Entry(fn=lambda m, x, ctx, cm: m(x, ctx, context_mask=cm),
                 args=(m, _normal(r, 44, DIM), _normal(r, 13, 24), cmask), diff=(0, 1, 2),
                 ref=oracle.wan_cross_attention, partial=(None, 0, None, None))


@entry("nn.JointAttention[rope]")
def _():
    m = random_module(lambda: nn.JointAttention(DIM, H, key=jax.random.key(2)), 34)
    r = np.random.default_rng(35)

    return Entry(fn=lambda m, x, ctx, c, s: m(x, ctx, rope=(c, s)),
                 args=(m, _normal(r, 44, DIM), _normal(r, 7, DIM), *_rope()), diff=(0, 1, 2),
                 ref=lambda m, x, ctx, c, s: oracle.cogvideox_attention(m, x, ctx, (c, s)),
                 partial=(None, 0, None, None, None))


class Block(eqx.Module):
    """A pre-norm residual attention block: `x + attn(norm(x))`."""

    norm: nn.RMSNorm
    attn: nn.Attention

    def __init__(self, *, parallel_config=nn.sharding.ParallelConfig(), key):
        self.norm = nn.RMSNorm(DIM)
        self.attn = nn.Attention(DIM, H, parallel=parallel_config, key=key)

    def __call__(self, x, cos, sin):
        return x + self.attn(self.norm(x), rope=(cos, sin))


CONFIGS = {
    "single": nn.sharding.ParallelConfig(),
    "ulysses": nn.sharding.ParallelConfig(sequence="ulysses"),
    "ring": nn.sharding.ParallelConfig(sequence="ring"),
    "ulysses+tp": nn.sharding.ParallelConfig(sequence="ulysses", tp_axis=TP),
}
MESHES = {"ulysses": dict(sp=4), "ring": dict(sp=4), "ulysses+tp": dict(sp=2, tp=2)}


def block_specs(module):
    return (nn.sharding.partition_specs(module), P(SP), P(SP), P(SP))


def block_fn(mode: str, module, wrap=lambda f: f):
    """`(module, x, cos, sin) -> out` for one example, sharded over the sequence by
    `nn.sharding.filter_shard_map` unless `mode == "single"`; `wrap` transforms the per-device
    function (e.g. a checkpoint)."""
    call = wrap(lambda b, x, c, s: b(x, c, s))
    if mode == "single":
        return call
    return nn.sharding.filter_shard_map(call, mesh=harness.mesh(**MESHES[mode]),
                               in_specs=block_specs(module), out_specs=P(SP))


def _block_entry(mode):
    b = nn.sharding.with_parallel(random_module(lambda: Block(key=jax.random.key(3)), 36), CONFIGS[mode])
    return Entry(fn=block_fn(mode, b), args=(b, _normal(np.random.default_rng(37), 44, DIM), *_rope()),
                 diff=(0, 1), ref=ref_block, partial=(None, 0, None, None),
                 placement=None if mode == "single" else (harness.mesh(**MESHES[mode]),
                                                          block_specs(b)))


for _mode in ("single", "ulysses", "ring"):
    entry(f"block(RMSNorm+Attention)[{_mode}]")(
        functools.partial(_block_entry, _mode))


# flax ------------------------------------------------------------------------------------


@entry("flax.RMSNorm")
def _():
    r = np.random.default_rng(40)
    model = vflax.RMSNorm(DIM)
    return Entry(fn=model.apply, args=({"params": {"scale": _normal(r, DIM)}}, _normal(r, 44, DIM)),
                 diff=(0, 1), ref=lambda v, x: oracle.rms_norm(x, v["params"]["scale"]),
                 partial=(None, 0))


@entry("flax.TPShardedRMSNorm[tp=4]")
def _():
    r = np.random.default_rng(41)
    model = vflax.TPShardedRMSNorm(DIM // 4, DIM)
    mesh, specs = harness.mesh(tp=4), ({"params": {"scale": P(TP)}}, P(None, TP))
    f = _shard(model.apply, mesh, specs, P(None, TP))
    return Entry(fn=f, args=({"params": {"scale": _normal(r, DIM)}}, _normal(r, 44, DIM)),
                 diff=(0, 1), ref=lambda v, x: oracle.rms_norm(x, v["params"]["scale"]),
                 partial=(None, 0), placement=(mesh, specs))


@entry("flax.attention_fn[MultiHeadDotProductAttention]")
def _():
    mha = linen.MultiHeadDotProductAttention(num_heads=H, qkv_features=DIM,
                                             attention_fn=vflax.attention_fn)
    x = _normal(np.random.default_rng(42), 44, DIM)
    variables = random_module(lambda: mha.init(jax.random.key(4), x), 43)

    def ref(variables, x):
        p = variables["params"]
        proj = lambda n: np.einsum("sf,fhd->shd", x, p[n]["kernel"]) + p[n]["bias"]
        out = oracle.example_attention(proj("query"), proj("key"), proj("value"))
        return np.einsum("shd,hdf->sf", out, p["out"]["kernel"]) + p["out"]["bias"]

    return Entry(fn=lambda v, x: mha.apply(v, x), args=(variables, x), diff=(0, 1), ref=ref,
                 partial=(None, 0))


NAMES = list(_BUILDERS)
DIFF_NAMES = [n for n in NAMES if _BUILDERS[n][1]]


# -- comparison helpers --------------------------------------------------------------------


def assert_trees_close(got, ref, what: str, factor: float = 1.0):
    harness.assert_trees_close(got, ref, F32, what, factor)


def vdot_tree(out, ct):
    return sum(jnp.vdot(o, c) for o, c in zip(jax.tree.leaves(out), jax.tree.leaves(ct)))


def check_grads(e: Entry, grads, what: str):
    """`grads` (of the `diff` arguments, as a tuple) against the reference: analytic
    oracle gradients, or directional central differences of the float64 reference (one
    random direction per parameter array)."""
    args64, ct64 = to64(e.args), to64(e.ct)
    if e.ref_grads is not None:
        assert_trees_close(tuple(grads), e.ref_grads(args64, ct64), what)
        return
    # The arrays are differentiated; the other leaves (`ParallelConfig`) have `None`
    # gradients, which `jax.tree.leaves` drops.
    diff64, static64 = eqx.partition([args64[i] for i in e.diff], eqx.is_array)
    leaves64, treedef = jax.tree.flatten(diff64)
    got = jax.tree.leaves(tuple(grads))
    assert len(got) == len(leaves64), f"{what}: {len(got)} gradient leaves for {len(leaves64)}"
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(diff64)]

    def loss(leaves):
        args = list(args64)
        for i, a in zip(e.diff, eqx.combine(jax.tree.unflatten(treedef, leaves), static64)):
            args[i] = a
        return sum(np.sum(o * c) for o, c in
                   zip(jax.tree.leaves(e.ref(*args)), jax.tree.leaves(ct64)))

    rng, eps = np.random.default_rng(99), 1e-6
    for j, (g, path) in enumerate(zip(got, paths)):
        g = f64(g)
        d = rng.standard_normal(g.shape)
        shifted = lambda s: loss([x + s * eps * d if i == j else x for i, x in enumerate(leaves64)])
        fd = (shifted(1) - shifted(-1)) / (2 * eps)
        dot = float(np.sum(g * d))
        # The size of `<grad, d>` for a random `d` (|grad| |d| / sqrt(n)), floored at 1 as
        # in `oracle.rel_error`: a 0.1% error in any gradient array is caught.
        scale = max(np.linalg.norm(g) * np.linalg.norm(d) / np.sqrt(g.size), abs(fd), 1.0)
        assert abs(dot - fd) <= 2e-5 * scale, f"{what}{path}: <grad, d> = {dot:.8g}, FD {fd:.8g}"


def diff_args(e: Entry) -> tuple:
    return tuple(e.args[i] for i in e.diff)


def vjp_fn(e: Entry, fn=None):
    """`diff_args -> (out, grads)` by `jax.vjp` (`eqx.filter_vjp` with modules), jitted
    (`eqx.filter_jit` with Equinox modules)."""
    fn = e.fn if fn is None else fn
    call = lambda d: fn(*e.with_diff(d))
    if e.has_modules:
        def run(d):
            out, pull = eqx.filter_vjp(call, d)
            return out, pull(e.ct)[0]
    else:
        def run(d):
            out, pull = jax.vjp(lambda *d: call(d), *d)
            return out, pull(e.ct)
    return e.jit(run)


# -- the matrix ----------------------------------------------------------------------------

# The untransformed (eager) call of these is compared with `jit` too; the others' eager
# calls dispatch dozens of ops one by one (the module entries) or a `shard_map` op by op.
EAGER = {"kernels.attention[xla,gqa,cross,bias,sinks]", "nn.RMSNorm",
         "nn.functional.apply_rope+rope_3d", "flax.RMSNorm"}


@pytest.mark.parametrize("name", NAMES)
def test_jit(name):
    """`jax.jit`, or `eqx.filter_jit` for the entries that take Equinox modules."""
    e = get(name)
    assert_trees_close(e.jit_out, e.ref_out, "jit vs oracle: out")
    if name in EAGER:
        assert_trees_close(e.jit_out, e.fn(*e.args), "jit vs eager: out")


def test_jit_rejects_module_arguments():
    """An attention module's `ParallelConfig` is a non-array leaf: `jax.jit` does not
    take the module as an argument (a `TypeError` naming the leaf); closing over the
    module, or `eqx.filter_jit`, does. Both equal the float64 reference."""
    m, x = get("nn.Attention[rope,segments]").args[:2]
    with pytest.raises(TypeError, match=r"ParallelConfig.*m\.parallel"):
        jax.jit(lambda m, x: m(x))(m, x)
    closed = jax.jit(lambda x: m(x))(x)
    filtered = filter_jit(lambda m, x: m(x))(m, x)
    no_rope = np.ones((x.shape[0], D // 2)), np.zeros((x.shape[0], D // 2))  # the identity
    ref = oracle.wan_self_attention(m, x, no_rope)
    oracle.assert_close(closed, ref, F32, "jit closing over the module vs oracle")
    oracle.assert_close(filtered, ref, F32, "filter_jit vs oracle")


def _second(a, rng):
    """A second, different batch element like `a`."""
    a = np.asarray(a)
    if np.issubdtype(a.dtype, np.floating):
        return (a + 0.5 * rng.standard_normal(a.shape)).astype(a.dtype)
    return np.roll(a, 3, axis=-1)  # segment ids, masks


@pytest.mark.parametrize("mode", ["axis0", "axis1-partial"])
@pytest.mark.parametrize("name", NAMES)
def test_vmap(name, mode):
    """`axis0`: every array input gets a leading batch axis (modules and variables are
    shared). `axis1-partial`: only some inputs are batched (`e.partial`), on axis 1,
    the others shared (`None`), and the output is batched on axis 1. `jax.vmap`, or
    `eqx.filter_vmap` (under `eqx.filter_jit`) for the entries that take Equinox
    modules."""
    e = get(name)
    if mode == "axis0":
        in_axes, out_axes = tuple(0 if _is_array(a) else None for a in e.args), 0
    else:
        in_axes, out_axes = tuple(None if ax is None else 1 for ax in e.partial), 1
    rng = np.random.default_rng(7)
    slices = [list(e.args), [a if ax is None else _second(a, rng) for a, ax in zip(e.args, in_axes)]]
    batched = [a if ax is None else replicated(e, jnp.asarray(np.stack([s[i] for s in slices], axis=ax)))
               for i, (a, ax) in enumerate(zip(e.args, in_axes))]
    vmap = eqx.filter_vmap if e.has_eqx_modules else jax.vmap
    got = e.jit(vmap(e.fn, in_axes=in_axes, out_axes=out_axes))(*batched)
    ref = jax.tree.map(lambda *r: np.stack(r, axis=out_axes), *[e.ref(*to64(s)) for s in slices])
    assert_trees_close(got, ref, f"vmap({mode}) vs oracle: out")


BLOCKS = [n for n in NAMES if n.startswith("block")]
# Left out: plain functions with no custom VJP and no collective (nothing to recompute
# but themselves), and entries whose gradient path is another entry's.
NO_CHECKPOINT = {"core.dot_product_attention[bias,mask,cross]", "core.local_attention[scale]",
                 # the same code paths as the contiguous ring and tensor_parallel_attention
                 "parallel.ring_attention[zigzag,window,segments]",
                 "core.dot_product_attention[mesh=dp2xtp4,bias,mask]",
                 "nn.RMSNorm", "nn.LayerNorm[per head]", "nn.functional.rms_norm",
                 "nn.functional.apply_rope+rope_3d", "flax.RMSNorm", "flax.TPShardedRMSNorm[tp=4]"}
CHECKPOINT_CASES = ([(n, "nothing_saveable") for n in DIFF_NAMES if n not in NO_CHECKPOINT]
                    + [(n, "default") for n in BLOCKS])
POLICIES = {"default": None, "nothing_saveable": jax.checkpoint_policies.nothing_saveable}


GRAD_CASES = [(n, "grad") for n in DIFF_NAMES] + [(n, "vjp") for n in DIFF_NAMES
                                                  if n in NO_CHECKPOINT]


@pytest.mark.parametrize("name, mode", GRAD_CASES)
def test_grad(name, mode):
    """`jax.grad` (`eqx.filter_grad` with modules) of `<fn(...), ct>` with respect to every
    differentiable input and parameter; `jax.vjp` (`eqx.filter_vjp`) for the entries that
    `test_checkpoint` (which takes the VJP of the checkpointed call) leaves out."""
    e = get(name)
    d = diff_args(e)
    if mode == "vjp":
        out, grads = vjp_fn(e)(d)
        assert_trees_close(out, e.ref_out, "vjp: out")
    elif e.has_modules:
        loss = lambda d: vdot_tree(e.fn(*e.with_diff(d)), e.ct)
        grads = e.jit(lambda d: eqx.filter_grad(loss)(d))(d)
    else:
        loss = lambda *d: vdot_tree(e.fn(*e.with_diff(d)), e.ct)
        grads = jit(jax.grad(loss, argnums=tuple(range(len(d)))))(*d)
    check_grads(e, grads, f"{mode} vs oracle: d")


@pytest.mark.parametrize("name, policy", CHECKPOINT_CASES)
def test_checkpoint(name, policy):
    """`jax.vjp` (`eqx.filter_vjp`) of `jax.checkpoint(fn, policy=...)`
    (`eqx.filter_checkpoint` with Equinox modules): around the whole call, `shard_map`
    included for the sharded entries."""
    e = get(name)
    checkpoint = eqx.filter_checkpoint if e.has_eqx_modules else jax.checkpoint
    out, grads = vjp_fn(e, checkpoint(e.fn, policy=POLICIES[policy]))(diff_args(e))
    assert_trees_close(out, e.ref_out, "checkpoint: out")
    check_grads(e, grads, "checkpoint vs oracle: d")


@pytest.mark.parametrize("name", NAMES)
def test_eval_shape(name):
    """`jax.eval_shape`, or `eqx.filter_eval_shape` for the entries that take Equinox
    modules, on `ShapeDtypeStruct`s in place of every array."""
    e = get(name)
    abstract = map_arrays(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), e.args)
    eval_shape = eqx.filter_eval_shape if e.has_eqx_modules else jax.eval_shape
    got = eval_shape(e.fn, *abstract)
    want = jax.tree.map(lambda r: jax.ShapeDtypeStruct(r.shape, jnp.float32), e.ref_out)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert jax.tree.leaves(got) == jax.tree.leaves(want)


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@pytest.mark.parametrize("name", NAMES)
def test_donate(name):
    """Donating the differentiable inputs (q/k/v, modules' arrays; the float inputs of
    `attention_bwd`) gives bit-identical results to the undonated call; sharded entries'
    inputs placed as their `shard_map` wants them. `jax.jit(..., donate_argnums=...)`,
    or for the entries that take Equinox modules `eqx.filter_jit(...,
    donate="all-except-first")` with the kept arguments passed first."""
    e = get(name)
    positions = e.diff or tuple(i for i, a in enumerate(e.args)
                                if _is_array(a) and jnp.issubdtype(a.dtype, jnp.floating))
    fresh = [map_arrays(lambda a: jnp.asarray(np.array(a)), a) if i in positions else a
             for i, a in enumerate(e.args)]
    if e.sharded:
        mesh, specs = e.placement
        shardings = jax.tree.map(lambda s: jax.NamedSharding(mesh, s), specs,
                                 is_leaf=lambda s: isinstance(s, P))

        def place(a, sharding):  # the arrays; a module's `ParallelConfig` stays as it is
            arrays, static = eqx.partition(a, eqx.is_array)
            return eqx.combine(jax.device_put(arrays, sharding), static)

        fresh = [place(a, s) for a, s in zip(fresh, shardings)]
    if e.has_eqx_modules:
        kept = tuple(i for i in range(len(fresh)) if i not in positions)

        def call(kept_args, donated_args):
            args = dict(zip(kept, kept_args)) | dict(zip(positions, donated_args))
            return e.fn(*(args[i] for i in range(len(fresh))))

        got = filter_jit(call, donate="all-except-first")(
            tuple(fresh[i] for i in kept), tuple(fresh[i] for i in positions))
    else:
        got = jit(e.fn, donate_argnums=positions)(*fresh)
    assert_trees_close(got, e.jit_out, "donated vs undonated: out", factor=0.0)
    donated = jax.tree.leaves(eqx.filter([fresh[i] for i in positions], eqx.is_array))
    assert any(a.is_deleted() for a in donated) == e.reuses_donation, "donation not applied"


# -- checkpoint inside shard_map, scans over stacked layers ----------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_checkpoint_inside_shard_map(mode, policy):
    """`eqx.filter_checkpoint` around the per-device block, inside `nn.sharding.filter_shard_map`."""
    e = get(f"block(RMSNorm+Attention)[{mode}]")
    fn = block_fn(mode, e.args[0],
                  wrap=lambda f: eqx.filter_checkpoint(f, policy=POLICIES[policy]))
    out, grads = vjp_fn(e, fn)(diff_args(e))
    assert_trees_close(out, e.ref_out, "out")
    check_grads(e, grads, "d")


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_vmap_inside_shard_map_with_per_device_segment_ids(mode):
    """`vmap` inside `shard_map` over a kernel whose tile-skipping `lax.cond` tests
    segment ids made on each device (varying over "sp", unbatched), gradients included.

    This is how a whole model runs (`models.run_sharded`: `shard_map(vmap(model))`, the
    padding's ids built per device). JAX batches such a cond by broadcasting its
    operands with a select, which made invariant operands (tile indices) varying behind
    the branches' backs: `lt requires varying manual axes to match` at the backward of
    Ulysses before the kernel cast them (caught at CogVideoX-5B scale).
    """
    n, S, H, D = 8, 64, 8, 8  # Ulysses: the kernel sees 64 tokens in 8 x 8 tiles
    impl = kernels.Blockwise(block_q=8, block_kv=8)
    real = 61  # the last 3 tokens are padding

    def per_device(q, k, v):
        start = (S // n) * jax.lax.axis_index("sp")
        seg = jnp.where(jnp.arange(S // n) + start < real, 0, -1)[None]

        def one(q, k, v):
            q, k, v = q[None], k[None], v[None]
            if mode == "ulysses":
                out = parallel.sequence_parallel_self_attention(
                    q, k, v, "sp", segment_ids=seg, implementation=impl)
            else:
                out = parallel.ring_attention(q, k, v, ring_axis="sp", segment_ids=seg,
                                              implementation=impl)
            return out[0]

        return jax.vmap(one)(q, k, v)

    f = jax.shard_map(per_device, mesh=harness.mesh(sp=n), in_specs=P(None, "sp"),
                      out_specs=P(None, "sp"))
    rng = np.random.default_rng(70)
    q, k, v, ct = (jnp.asarray(rng.standard_normal((2, S, H, D)), F32) for _ in range(4))
    out, vjp = jax.vjp(jax.jit(f), q, k, v)
    grads = vjp(ct)
    seg = np.where(np.arange(S) < real, 0, -1)[None].repeat(2, 0)
    ref = oracle.attention(q, k, v, segment_ids=seg, dout=ct)
    oracle.assert_close(out, ref.out, F32, "out")
    for name, g, r in zip("qkv", grads, (ref.dq, ref.dk, ref.dv)):
        oracle.assert_close(g, r, F32, f"d{name}")


SCAN_CASES = {  # mode, checkpointed scan body
    "single": ("single", False),
    "ulysses": ("ulysses", False),
    "ring-remat": ("ring", True),
    "ulysses+tp": ("ulysses+tp", False),
}


N_LAYERS = 2


def _stacked_blocks(mode):
    """`N_LAYERS` blocks built the Equinox way, `eqx.filter_vmap` over keys."""
    make = lambda key: Block(parallel_config=CONFIGS[mode], key=key)
    keys = jax.random.split(jax.random.key(5), N_LAYERS)
    return randomized(eqx.filter_jit(eqx.filter_vmap(make))(keys), 50)


def _scan_inputs():
    return _normal(np.random.default_rng(51), 44, DIM), _rope(), _normal(np.random.default_rng(52), 44, DIM)


def _value_and_grad(model, tree):
    """`model(tree, x, cos, sin)` and the gradient of `<., ct>` w.r.t. `(tree, x)`, under
    `eqx.filter_jit` (`tree`: modules, or their arrays)."""
    x, (cos, sin), ct = _scan_inputs()
    loss = lambda tx: vdot_tree(model(tx[0], tx[1], cos, sin), ct)
    return filter_jit(lambda tx: (model(tx[0], tx[1], cos, sin), eqx.filter_grad(loss)(tx)))(
        (tree, x))


@functools.cache
def _loop_reference():
    """The Python loop over the unstacked single-device layers: `(layers, out, d layers
    (stacked), dx)`, the output checked against the float64 reference."""
    stack = _stacked_blocks("single")
    layers = [map_arrays(lambda a: jnp.asarray(np.asarray(a)[i]), stack) for i in range(N_LAYERS)]

    def loop_model(layers, x, cos, sin):
        for layer in layers:
            x = layer(x, cos, sin)
        return x

    out, (g_layers, g_x) = _value_and_grad(loop_model, layers)
    x, (cos, sin), _ = _scan_inputs()
    ref = f64(x)
    for layer in to64(layers):
        ref = ref_block(layer, ref, f64(cos), f64(sin))
    oracle.assert_close(out, ref, F32, "loop vs float64 reference")
    return stack, out, jax.tree.map(lambda *g: np.stack(g), *g_layers), g_x


@pytest.mark.parametrize("case", list(SCAN_CASES))
def test_scan_over_stacked_layers(case):
    """The Equinox idiom: layers built by `eqx.filter_vmap` over keys, `eqx.partition`ed,
    and `lax.scan` over the stacked arrays; equal to a Python loop over the unstacked
    layers on one device, forward and gradients (stacked parameters and input). Sharded
    cases run the whole scan inside `shard_map`, the stack placed by `partition_specs`
    (which leaves the layer axis unsharded; `jax.shard_map` takes the arrays alone)."""
    mode, remat = SCAN_CASES[case]
    stack = _stacked_blocks(mode)
    params, static = eqx.partition(stack, eqx.is_array)
    assert params.attn.q.weight.shape == (N_LAYERS, DIM, DIM)

    def scan_model(params, x, cos, sin):
        def body(h, p):
            return eqx.combine(p, static)(h, cos, sin), None
        if remat:
            body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
        return jax.lax.scan(body, x, params)[0]

    if mode != "single":
        # Of the module (it reads `parallel.tp_axis`): `None` at the config leaf, as in
        # `params`.
        specs = nn.sharding.partition_specs(stack)
        if CONFIGS[mode].tp_axis is not None:
            assert specs.attn.q.weight == P(None, TP, None)
        scan_model = _shard(scan_model, harness.mesh(**MESHES[mode]),
                            (specs, P(SP), P(SP), P(SP)), P(SP))
    single, out_l, g_layers, g_x_l = _loop_reference()
    assert jax.tree.structure(stack) == jax.tree.structure(single)
    assert all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(params), jax.tree.leaves(eqx.filter(single, eqx.is_array))))
    out_s, (g_params, g_x) = _value_and_grad(scan_model, params)
    oracle.assert_close(out_s, out_l, F32, "scan vs loop: out")
    oracle.assert_close(g_x, g_x_l, F32, "scan vs loop: dx")
    assert_trees_close(g_params, eqx.filter(g_layers, eqx.is_array), "scan vs loop: d")


# -- module construction --------------------------------------------------------------------


CONSTRUCTORS = {
    "RMSNorm": lambda key: nn.RMSNorm(DIM),
    "TPShardedRMSNorm": lambda key: nn.TPShardedRMSNorm(DIM // 4, DIM),
    "LayerNorm": lambda key: nn.LayerNorm(D),
    "Attention": lambda key: nn.Attention(DIM, H, key=key),
    "CrossAttention": lambda key: nn.CrossAttention(DIM, H, context_dim=24, key=key),
    "JointAttention[usp,tp]": lambda key: nn.JointAttention(
        DIM, H, parallel=nn.sharding.ParallelConfig(sequence="usp", ring_axis=RING, tp_axis=TP), key=key),
}


@pytest.mark.parametrize("name", list(CONSTRUCTORS))
def test_module_construction_eval_shape(name):
    """`eqx.filter_eval_shape` builds the module abstractly: the eager module's structure,
    shapes and dtypes, nothing computed; its non-array leaves (an attention module's
    `ParallelConfig`) are the eager module's."""
    make = CONSTRUCTORS[name]
    abstract = eqx.filter_eval_shape(make, jax.random.key(0))
    eager = make(jax.random.key(0))
    assert jax.tree.structure(abstract) == jax.tree.structure(eager)
    arrays, others = eqx.partition(eager, eqx.is_array)
    abstract_arrays, abstract_others = eqx.partition(
        abstract, lambda a: isinstance(a, jax.ShapeDtypeStruct))
    assert jax.tree.structure(abstract_arrays) == jax.tree.structure(arrays)
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(abstract_arrays)] == [
        (a.shape, a.dtype) for a in jax.tree.leaves(arrays)]
    assert jax.tree.leaves(abstract_others) == jax.tree.leaves(others)


def test_module_construction_jit_and_vmap():
    """`eqx.filter_jit` construction (a traced key: `jax.random`) gives the eager
    module's structure, shapes and dtypes (a concrete key draws on the host: other
    values of the same distributions); `eqx.filter_vmap` over keys stacks the modules
    the jitted construction builds from each key. Both keep the `ParallelConfig` leaf."""
    make = CONSTRUCTORS["Attention"]
    keys = jax.random.split(jax.random.key(0), 2)
    eager = make(keys[0])
    jitted = [eqx.filter_jit(make)(key) for key in keys]
    stacked = eqx.filter_vmap(make)(keys)
    assert jax.tree.structure(jitted[0]) == jax.tree.structure(eager)
    assert jax.tree.structure(stacked) == jax.tree.structure(eager)
    assert jitted[0].parallel == stacked.parallel == eager.parallel
    arrays = lambda t: jax.tree.leaves(eqx.filter(t, eqx.is_array))
    for e, s, a, b in zip(*(arrays(t) for t in (eager, stacked, *jitted))):
        assert (a.shape, a.dtype) == (e.shape, e.dtype)
        np.testing.assert_allclose(s, np.stack([a, b]), rtol=1e-6, atol=1e-7)


# -- kernel dispatch on abstract inputs -----------------------------------------------------


SMALL = jax.ShapeDtypeStruct((2, 44, H, D), jnp.float32)
LARGE = jax.ShapeDtypeStruct((1, 8192, 8, 64), jnp.bfloat16)  # a 2 GiB score matrix


def test_select_implementation_inside_eval_shape():
    """Which kernel would `"auto"` run for a large problem, without allocating it: inside
    `jax.eval_shape`, `select_implementation` takes the abstract inputs."""
    chosen = []

    def probe(q, k, v):
        chosen.append(kernels.select_implementation(q, k, v))
        return q

    jax.eval_shape(probe, SMALL, SMALL, SMALL)
    jax.eval_shape(probe, LARGE, LARGE, LARGE)
    assert chosen == ["xla", "blockwise"]


def test_select_implementation_takes_shape_dtype_structs():
    """The same question asked directly with `jax.ShapeDtypeStruct`s, outside `eval_shape`."""
    assert kernels.select_implementation(SMALL, SMALL, SMALL) == "xla"
    assert kernels.select_implementation(LARGE, LARGE, LARGE) == "blockwise"


# -- differentiation beyond first-order reverse mode ----------------------------------------


# Every entry whose call reaches an attention `custom_vjp` (zigzag: as the contiguous ring).
FORWARD_MODE = [n for n in DIFF_NAMES
                if ("attention" in n.lower() and "zigzag" not in n) or n.startswith("block")]
JVP_ERROR = r"can't apply forward-mode autodiff \(jvp\) to a custom_vjp function"


@pytest.mark.parametrize("name", FORWARD_MODE)
def test_forward_mode_raises(name):
    """Attention is a `jax.custom_vjp` (the backward recomputes tiles): forward mode
    (`jax.jvp`, `jax.jacfwd`, `jax.hessian`, and `jax.linearize`'s linear function) is not
    available and says so, at trace time. (Not jitted, a `shard_map` run eagerly fails
    inside JAX with `unhashable type: 'Unhashable'` instead.) Modules are
    `eqx.partition`ed: their arrays are the primals, the rest is closed over."""
    e = get(name)
    d, static = eqx.partition(diff_args(e), eqx.is_array)
    tangents = jax.tree.map(np.zeros_like, d)
    call = lambda *d: e.fn(*e.with_diff(eqx.combine(d, static)))
    with pytest.raises(TypeError, match=JVP_ERROR):
        jax.jit(lambda d, t: jax.jvp(call, d, t))(d, tangents)
    with pytest.raises(TypeError, match=JVP_ERROR):
        jax.jit(lambda d, t: jax.linearize(call, *d)[1](*t))(d, tangents)
    if not e.has_modules:
        with pytest.raises(TypeError, match=JVP_ERROR):
            jax.jit(jax.jacfwd(lambda q: call(q, *d[1:])))(d[0])


# Not `ring_attention` over 4 simulated devices: its second-order program aborts XLA's
# CPU runtime (`Check failed: id < num_threads ... collective permute RendezvousKey`),
# the collective-permute failure of docs/limits.md; usp runs a 2-device ring.
SECOND_ORDER = ["kernels.attention[xla,gqa,cross,bias,sinks]",
                "kernels.attention[blockwise,mqa,causal,window,segments]",
                "parallel.sequence_parallel_self_attention[gqa,bias]",
                "parallel.usp_attention[ulysses2xring2,gqa,causal]"]


@pytest.mark.parametrize("name", SECOND_ORDER)
def test_grad_of_grad(name):
    """Reverse over reverse (the backward is differentiable JAX): `d/dq <dL/dq, w>` along
    a direction `d`, against central differences of the oracle's analytic `dq` in
    float64."""
    e = get(name)
    rng = np.random.default_rng(3)
    q, rest = e.args[0], e.args[1:]
    args64, ct64 = to64(e.args), to64(e.ct)
    w, d = rng.standard_normal(q.shape).astype(F32), rng.standard_normal(q.shape)
    loss = lambda q: vdot_tree(e.fn(q, *rest), e.ct)
    hvp = jit(jax.grad(lambda q: jnp.vdot(jax.grad(loss)(q), w)))(q)
    phi = lambda s: float(np.sum(e.ref_grads([args64[0] + s * d, *args64[1:]], ct64)[0] * w))
    eps = 1e-5
    fd = (phi(eps) - phi(-eps)) / (2 * eps)
    got = float(np.sum(f64(hvp) * d))
    assert abs(got - fd) <= 1e-4 * max(float(np.sum(np.abs(f64(hvp) * d))), 1.0), (got, fd)


# -- functions with static arguments --------------------------------------------------------


def test_rope_3d_is_static():
    """`rope_3d` builds its tables in NumPy from a concrete grid: under `jit` it is a
    constant equal to the eager tables; a traced grid raises a ValueError naming the fix."""
    eager = _rope()
    jitted = jax.jit(lambda: nn.functional.rope_3d(GRID, D))()
    for a, b in zip(jitted, eager):
        np.testing.assert_array_equal(a, b)
    assert jax.eval_shape(lambda: nn.functional.rope_3d(GRID, D)) == (
        jax.ShapeDtypeStruct((44, D // 2), jnp.float32),) * 2
    with pytest.raises(ValueError, match=r"`grid` must be concrete Python ints.*static"):
        jax.jit(lambda f: nn.functional.rope_3d((f, 1, 11), D))(4)
    with pytest.raises(ValueError, match=r"`grid` must be concrete Python ints.*static"):
        jax.vmap(lambda f: nn.functional.rope_3d((f, 1, 11), D))(jnp.arange(1, 3))


def test_chunk_by_rank_traced_rank():
    """`chunk_by_rank` takes a traced rank (under `jit`, and batched under `vmap`); its
    `sp_size` is static and a traced one raises."""
    x = np.arange(2 * 44 * 3, dtype=F32).reshape(2, 44, 3)
    chunks = np.stack(np.split(x, 4, axis=1))
    f = jax.jit(lambda x, r: parallel.chunk_by_rank(x, 1, 4, r))
    np.testing.assert_array_equal(f(x, 2), chunks[2])
    np.testing.assert_array_equal(jax.vmap(f, in_axes=(None, 0))(x, jnp.arange(4)), chunks)
    with pytest.raises(ValueError, match="`sp_size` must be a positive int"):
        jax.jit(lambda x, n: parallel.chunk_by_rank(x, 1, n, 0))(x, 4)


# -- the linen shim ---------------------------------------------------------------------------


def test_shim_names_are_the_tested_functions():
    """`vidax_eqx.flax` and `vidax_eqx.core` re-export the functions of the rows above."""
    for name in ("dot_product_attention", "local_attention", "sequence_parallel_self_attention",
                 "sequence_parallel_joint_self_attention", "chunk_by_rank"):
        assert getattr(vflax, name) is getattr(core, name)
    assert core.sequence_parallel_self_attention is parallel.sequence_parallel_self_attention
    assert core.sequence_parallel_joint_self_attention is (
        parallel.sequence_parallel_joint_self_attention)
    assert core.chunk_by_rank is parallel.chunk_by_rank
    assert (core.RMSNorm, core.TPShardedRMSNorm) == (nn.RMSNorm, nn.TPShardedRMSNorm)


class _ResidualNorm(linen.Module):
    @linen.compact
    def __call__(self, x, _):
        return x + 0.5 * vflax.RMSNorm(DIM)(x), None


class _NormStack(linen.Module):
    remat: bool

    @linen.compact
    def __call__(self, x):
        layer = linen.remat(_ResidualNorm) if self.remat else _ResidualNorm
        layers = linen.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=N_LAYERS)
        return layers(name="layers")(x, None)[0]


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan+remat"])
def test_linen_scan_and_remat(remat):
    """`linen.scan` (and `linen.remat`) over the shim's `RMSNorm` == a Python loop of
    `RMSNorm.apply` over the unstacked scales, forward and gradients."""
    model = _NormStack(remat)
    x, ct = _normal(np.random.default_rng(60), 44, DIM), _normal(np.random.default_rng(61), 44, DIM)
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
    assert abstract["params"]["layers"]["RMSNorm_0"]["scale"].shape == (N_LAYERS, DIM)
    scales = _normal(np.random.default_rng(62), N_LAYERS, DIM)
    variables = {"params": {"layers": {"RMSNorm_0": {"scale": scales}}}}

    def loop(scales, x):
        for s in scales:
            x = x + 0.5 * vflax.RMSNorm(DIM).apply({"params": {"scale": s}}, x)
        return x

    def value_and_grad(f, params):
        return jit(jax.value_and_grad(lambda p, x: vdot_tree(f(p, x), ct), argnums=(0, 1)))(
            params, x)

    v_scan, (g_vars, gx_scan) = value_and_grad(model.apply, variables)
    v_loop, (g_scales, gx_loop) = value_and_grad(loop, scales)
    ref = f64(x)
    for s in f64(scales):
        ref = ref + 0.5 * oracle.rms_norm(ref, s)
    oracle.assert_close(v_scan, np.sum(ref * f64(ct)), F32, "scan: loss vs float64")
    oracle.assert_close(v_scan, v_loop, F32, "scan vs loop: loss")
    oracle.assert_close(g_vars["params"]["layers"]["RMSNorm_0"]["scale"], g_scales, F32,
                        "scan vs loop: d scale")
    oracle.assert_close(gx_scan, gx_loop, F32, "scan vs loop: dx")
