"""An audit of every public entry point against wrong or hostile input, as one table.

Each row of `ROWS` is: the entry point, the bad input, a callable that makes the
call, the exception it must raise, and a regex that the message must match. The
regex names the argument, what was received and what was expected, so a row
fails if the library raises the right type with an unhelpful message. Rows marked
`xfail(strict=True)` are known gaps in files this audit may not change; each says
where and why. The troubleshooting page (`docs/troubleshooting.md`) is written from this table.

The error policy (STYLE.md rule 5): `ValueError` for an invalid request,
`TypeError` for a wrong type (including q/k/v of different dtypes: the library
never promotes them, cast explicitly; jaxtyping's `TypeCheckError` for a module
call is a `TypeError`), `NotImplementedError` for a valid request an
implementation cannot serve.

Beside the table:

- non-finite inputs must propagate honestly: a NaN / Inf reaches exactly the
  outputs that depend on it and is never turned into 0 (`test_nan_*`), and a
  token marked as padding (negative segment id) is inert whatever it holds;
- hostile `.safetensors` files are rejected without unpickling, with bounded
  memory, and leave the module untouched (`test_hostile_file_*`).

What this file does not repeat: `tests/test_errors.py` runs every kernel check
through all four kernel entry points (`attention`, `attention_fwd`,
`attention_bwd`, `select_implementation`) and `tests/test_interop.py` holds the
full catalogue of hostile `.safetensors` headers; here each kind of mistake has
one representative row per public entry point.
"""

import os
import pickle
import re
import tracemalloc
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jaxtyping import TypeCheckError

import harness
from vidax_eqx import core, interop, kernels, nn, parallel
from vidax_eqx.nn import functional


flax = pytest.importorskip("vidax_eqx.flax")

B, S_q, S_k, H, H_kv, D = 2, 7, 5, 4, 2, 8
_rng = np.random.default_rng(0)
_a = harness.attention_inputs(B, S_q, H, D, H_kv=H_kv, S_k=S_k, rng=_rng)
Q, K, V = (jnp.asarray(_a[n]) for n in ("q", "k", "v"))
# Global arrays for the parallel rows: 16 tokens, 4 per device over sp = 4.
X = jnp.asarray(harness.normal(_rng, (1, 16, 4, 8)))
KEY = jax.random.PRNGKey(0)
DIM, HEADS = 32, 4


_s = harness.shape_re


# The sharded rows only trace (`jax.eval_shape`): every check runs at trace time, and a
# row that should raise but does not (an xfail) costs no compilation.


def _on_sp(fn, *args, sp=4):
    """`fn` inside `shard_map` over the "sp" axis, every argument sharded on axis 1."""
    spec = P(None, parallel.SP_AXIS)
    mesh = harness.mesh(sp=sp)
    return jax.eval_shape(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec), *args)


def _on_usp(fn, *args):
    """`fn` inside `shard_map` over Ulysses "sp" (2) x "ring" (2), ring-major."""
    spec = P(None, ("ring", parallel.SP_AXIS))
    mesh = harness.mesh(sp=2, ring=2)
    return jax.eval_shape(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec), *args)


def _ulysses(**kw):
    return lambda: _on_sp(lambda x: parallel.sequence_parallel_self_attention(x, x, x, "sp", **kw), X)


def _ring(**kw):
    return lambda: _on_sp(lambda x: parallel.ring_attention(x, x, x, ring_axis="sp", **kw), X)


def _usp(**kw):
    kw = {"ulysses_axis": "sp", "ring_axis": "ring", **kw}
    return lambda: _on_usp(lambda x: parallel.usp_attention(x, x, x, **kw), X)


def _joint(text_len):
    return lambda: _on_sp(
        lambda x: parallel.sequence_parallel_joint_self_attention(x, x, x, text_len, "sp"), X)


def _traced_text_len():
    def f(x, n):
        return parallel.sequence_parallel_joint_self_attention(x, x, x, n[0, 0], "sp")

    return _on_sp(f, X, jnp.ones((1, 16), jnp.int32))


def _ring_segment_ids(seg):
    def f(x, s):
        return parallel.ring_attention(x, x, x, ring_axis="sp",
                                       segment_ids=kernels.SegmentIds(q=s, kv=s))

    return lambda: _on_sp(f, X, seg)


def _tp(q=X, k=X, v=X, **kw):
    return lambda: jax.eval_shape(lambda q, k, v: parallel.tensor_parallel_attention(
        q, k, v, mesh=harness.mesh(tp=4), **kw), q, k, v)


def _inside_tp(fn, x):
    mesh = harness.mesh(tp=2)
    return jax.eval_shape(
        jax.shard_map(fn, mesh=mesh, in_specs=P(None, "tp"), out_specs=P(None, "tp")), x)


def _bwd(**kw):
    out, lse = jnp.ones((B, S_q, H, D)), jnp.zeros((B, H, S_q))
    args = dict(out=out, lse=lse, dout=jnp.ones_like(out))
    args.update(kw)
    return kernels.attention_bwd(Q, K, V, args["out"], args["lse"], args["dout"])


# -- weight files ---------------------------------------------------------------------


def _attention_module(seed=0):
    return harness.resampled(nn.Attention(DIM, HEADS, key=jax.random.PRNGKey(seed)), seed)


def _file_from(edit):
    """A source maker: a valid Attention state dict, edited, saved as a file."""

    def make(tmp):
        sd = dict(interop.state_dict(_attention_module(0)))
        edit(sd)
        path = tmp / "weights.safetensors"
        interop.save_safetensors(sd, path)  # a dict is saved under its own names
        return path

    return make


def _valid_file_bytes(cut=None, flip=None):
    def make(tmp):
        path = tmp / "weights.safetensors"
        interop.save_safetensors(_attention_module(0), path)
        raw = bytearray(path.read_bytes())
        if flip is not None:
            raw[flip] = ord("}")
        if cut is not None:
            raw = raw[:cut]
        path.write_bytes(bytes(raw))
        return path

    return make


def _rejected_load(make_source):
    """Loads `make_source(tmp)` into an Attention module; whatever it raises, the
    module passed in must be unchanged (nothing partially loaded)."""

    def call(tmp):
        target = _attention_module(1)
        before = [np.array(x) for x in harness.arrays(target)]
        try:
            interop.load_state_dict(target, make_source(tmp))
        finally:
            after = harness.arrays(target)
            assert all(np.array_equal(np.asarray(a), b) for a, b in zip(after, before)), \
                "the module passed to load_state_dict was modified"

    return call


def _changed_after_open(tmp):
    path = tmp / "weights.safetensors"
    interop.save_safetensors(_attention_module(0), path)
    opened = interop.open_safetensors(path)
    path.write_bytes(path.read_bytes()[:-4])
    return opened


# -- the table ------------------------------------------------------------------------


class Row(NamedTuple):
    entry: str
    bad: str
    call: Callable[..., Any]  # called with a temporary directory (pathlib.Path)
    error: type
    match: str


def row(entry, bad, call, error, match, *, xfail=None, takes_tmp=False, marks=()):
    fn = call if takes_tmp else (lambda tmp, call=call: call())
    marks = [*marks, pytest.mark.xfail(strict=True, reason=xfail)] if xfail else list(marks)
    return pytest.param(Row(entry, bad, fn, error, match), marks=marks, id=f"{entry}: {bad}")


_att = kernels.attention
_seg = kernels.SegmentIds

ROWS = [
    # ---- kernels.attention (and everything built on it) -------------------------------
    row("kernels.attention", "q of rank 3",
        lambda: _att(Q.reshape(B, S_q, H * D), K, V), ValueError,
        r"`q` must have rank 4 with layout \(B, S_q, H, D\); received shape \(2, 7, 32\)"),
    row("kernels.attention", "k head_dim differs from q",
        lambda: _att(Q, K[..., :5], V[..., :5]), ValueError,
        r"same head_dim D; received q: \(2, 7, 4, 8\) \(D=8\), k: \(2, 5, 2, 5\) \(D=5\)"),
    row("kernels.attention", "k and v of different shapes",
        lambda: _att(Q, K, V[:, :3]), ValueError,
        r"`k` and `v` must have the same shape.*received k: \(2, 5, 2, 8\), v: \(2, 3, 2, 8\)"),
    row("kernels.attention", "q float32, k/v bfloat16 (dtype policy: no promotion)",
        lambda: _att(Q, K.astype(jnp.bfloat16), V.astype(jnp.bfloat16)), TypeError,
        r"`q`, `k` and `v` must share one dtype \(cast them explicitly\); received q: float32, "
        r"k: bfloat16, v: bfloat16"),
    row("kernels.attention", "integer q",
        lambda: _att(Q.astype(jnp.int32), K, V), TypeError,
        r"`q` must have a floating dtype \(float32, bfloat16 or float16\); received dtype int32"),
    row("kernels.attention", "complex q/k/v",
        lambda: _att(Q.astype(jnp.complex64), K.astype(jnp.complex64), V.astype(jnp.complex64)),
        TypeError, r"`q` must have a floating dtype.*received dtype complex64"),
    row("kernels.attention", "a Python list for q",
        lambda: _att(np.asarray(Q).tolist(), K, V), TypeError,
        r"`q` must be an array; received list"),
    row("kernels.attention", "H not a multiple of H_kv (GQA)",
        lambda: _att(Q, K[:, :, :1].repeat(3, 2), V[:, :, :1].repeat(3, 2)), ValueError,
        r"query heads must be a multiple of the number of key/value heads \(GQA\); received "
        r"q: \(2, 7, 4, 8\) \(H=4\), k: \(2, 5, 3, 8\) \(H_kv=3\)"),
    row("kernels.attention", "zero query heads",
        lambda: _att(Q[:, :, :0], K[:, :, :1], V[:, :, :1]), ValueError,
        r"non-empty arrays \(B, S_q, S_k, H, H_kv and D all >= 1\); received q: \(2, 7, 0, 8\)"),
    row("kernels.attention", "empty key sequence",
        lambda: _att(Q, K[:, :0], V[:, :0]), ValueError,
        r"non-empty arrays.*k: \(2, 0, 2, 8\)"),
    row("kernels.attention", "bias that does not broadcast",
        lambda: _att(Q, K, V, bias=jnp.zeros((H_kv, S_q, S_k))), ValueError,
        r"`bias` must broadcast to \(B, H, S_q, S_k\) = \(2, 4, 7, 5\); received shape "
        r"\(1, 2, 7, 5\) \(axis 1 has size 2, expected 1 or 4\)"),
    row("kernels.attention", "mask of rank 5",
        lambda: _att(Q, K, V, mask=jnp.ones((1, B, H, S_q, S_k), bool)), ValueError,
        r"`mask` must broadcast to \(B, H, S_q, S_k\) = \(2, 4, 7, 5\); received shape "
        r"\(1, 2, 4, 7, 5\) of rank 5 > 4"),
    row("kernels.attention", "integer mask",
        lambda: _att(Q, K, V, mask=jnp.ones((S_q, S_k), jnp.int32)), TypeError,
        r"`mask` must be boolean \(True = may attend\); received dtype int32"),
    row("kernels.attention", "complex bias",
        lambda: _att(Q, K, V, bias=jnp.ones((S_q, S_k), jnp.complex64)), TypeError,
        r"`bias` must have a floating dtype.*received dtype complex64"),
    row("kernels.attention", "float segment ids",
        lambda: _att(Q, Q, Q, segment_ids=jnp.zeros((B, S_q))), TypeError,
        r"`segment_ids` must have an integer dtype; received dtype float32"),
    row("kernels.attention", "uint32 segment ids (would wrap to padding)",
        lambda: _att(Q, Q, Q, segment_ids=jnp.full((B, S_q), 2**31, jnp.uint32)), TypeError,
        r"`segment_ids` must have an integer dtype whose values fit int32.*received dtype uint32"
        r".*astype\(jnp.int32\)"),
    row("kernels.attention", "SegmentIds.kv of the wrong shape",
        lambda: _att(Q, K, V, segment_ids=_seg(jnp.zeros((B, S_q), jnp.int32),
                                               jnp.zeros((B, S_q), jnp.int32))), ValueError,
        r"`segment_ids.kv` must have shape \(B, S\) = \(2, 5\); received \(2, 7\)"),
    row("kernels.attention", "one segment_ids array with S_q != S_k",
        lambda: _att(Q, K, V, segment_ids=jnp.zeros((B, S_q), jnp.int32)), ValueError,
        r"single `segment_ids` array needs S_q == S_k; received S_q=7, S_k=5.*SegmentIds"),
    row("kernels.attention", "negative window",
        lambda: _att(Q, K, V, window=(-1, 2)), ValueError,
        r"`window` left size must be >= 0 \(use None for unbounded\); received -1"),
    row("kernels.attention", "window of three sizes",
        lambda: _att(Q, K, V, window=(1, 2, 3)), ValueError,
        r"`window` must be a pair \(left, right\) of non-negative ints or None; received \(1, 2, 3\)"),
    row("kernels.attention", "window given as one int",
        lambda: _att(Q, K, V, window=4), ValueError,
        r"`window` must be a pair \(left, right\).*received 4"),
    row("kernels.attention", "float window size",
        lambda: _att(Q, K, V, window=(1.5, None)), ValueError,
        r"`window` left size must be a non-negative int or None; received 1\.5"),
    row("kernels.attention", "logits_soft_cap = 0",
        lambda: _att(Q, K, V, logits_soft_cap=0.0), ValueError,
        r"`logits_soft_cap` must be > 0; received 0\.0"),
    row("kernels.attention", "logits_soft_cap < 0",
        lambda: _att(Q, K, V, logits_soft_cap=-30.0), ValueError,
        r"`logits_soft_cap` must be > 0; received -30\.0"),
    row("kernels.attention", "logits_soft_cap = inf",
        lambda: _att(Q, K, V, logits_soft_cap=float("inf")), ValueError,
        r"`logits_soft_cap` must be finite; received inf"),
    row("kernels.attention", "logits_soft_cap a string",
        lambda: _att(Q, K, V, logits_soft_cap="30"), TypeError,
        r"`logits_soft_cap` must be a number; received str '30'"),
    row("kernels.attention", "scale = nan",
        lambda: _att(Q, K, V, scale=float("nan")), ValueError,
        r"`scale` must be finite; received nan"),
    row("kernels.attention", "scale = -inf",
        lambda: _att(Q, K, V, scale=-float("inf")), ValueError,
        r"`scale` must be finite; received -inf"),
    row("kernels.attention", "scale a string",
        lambda: _att(Q, K, V, scale="0.125"), TypeError,
        r"`scale` must be a number; received str '0.125'"),
    row("kernels.attention", "scale traced under jit",
        lambda: jax.jit(lambda s: _att(Q, K, V, scale=s))(0.5), TypeError,
        r"`scale` must be a concrete Python number.*received a traced value.*static argument"),
    row("kernels.attention", "causal=1",
        lambda: _att(Q, K, V, causal=1), TypeError, r"`causal` must be a bool; received 1"),
    row("kernels.attention", "unknown implementation",
        lambda: _att(Q, K, V, implementation="flash"), ValueError,
        r"`implementation` must be 'auto', .*one of \[.*'xla'.*\], or an AbstractImplementation "
        r"instance; received 'flash'"),
    row("kernels.attention", "sinks of shape (H_kv,)",
        lambda: _att(Q, K, V, sinks=jnp.zeros((H_kv,))), ValueError,
        r"`sinks` must have shape \(H,\) = \(4,\), one logit per query head; received \(2,\)"),
    row("kernels.attention", "q_positions of the wrong length",
        lambda: _att(Q, K, V, q_positions=jnp.arange(S_k)), ValueError,
        r"`q_positions` must have shape \(7,\); received \(5,\)"),
    row("kernels.attention", "uint32 kv_positions",
        lambda: _att(Q, K, V, kv_positions=jnp.arange(S_k, dtype=jnp.uint32)), TypeError,
        r"`kv_positions` must have an integer dtype whose values fit int32.*uint32"),
    row("kernels.attention_bwd", "lse of the wrong shape",
        lambda: _bwd(lse=jnp.zeros((B, H, S_q + 1))), ValueError,
        r"`lse` must have shape \(2, 4, 7\); received \(2, 4, 8\)"),
    row("kernels.attention_bwd", "complex dout (imaginary part dropped)",
        lambda: _bwd(dout=jnp.ones((B, S_q, H, D), jnp.complex64)), TypeError, r"`dout`.*complex64",
        marks=[pytest.mark.filterwarnings("ignore:Casting from complex:DeprecationWarning")]),
    row("kernels.Blockwise", "block_q = 0",
        lambda: kernels.Blockwise(block_q=0), ValueError,
        r"`block_q` must be a positive int.*0"),

    # ---- parallel: meshes and helpers -------------------------------------------------
    row("parallel.make_mesh", "sp = 0",
        lambda: parallel.make_mesh(sp=0), ValueError,
        r"mesh axis 'sp' must have a positive int size; received 0"),
    row("parallel.make_mesh", "more devices than exist",
        lambda: parallel.make_mesh(sp=len(jax.devices()) + 1), ValueError,
        r"needs 9 devices; 8 are available.*xla_force_host_platform_device_count"),
    row("parallel.make_mesh", "extra_axes redefining 'sp'",
        lambda: parallel.make_mesh(sp=2, extra_axes={"sp": 4}), ValueError,
        r"`extra_axes` .* cannot redefine them; received extra_axes=\{'sp': 4\} "
        r"\(clashes: \['sp'\]\)"),
    row("parallel.axis_size", "outside shard_map",
        lambda: parallel.axis_size("sp"), ValueError,
        r"^Mesh axis 'sp' does not exist in the current context\. Call this inside "
        r"`jax.shard_map`"),
    row("parallel.gather_chunks", "outside shard_map",
        lambda: parallel.gather_chunks(X, 1, "sp"), ValueError,
        r"^Mesh axis 'sp' does not exist"),
    row("parallel.chunk_by_rank", "length not divisible by sp_size",
        lambda: parallel.chunk_by_rank(X, 1, 3, 0), ValueError,
        r"`x` axis 1 has size 16, which does not split evenly over sp_size=3; pad it first "
        r"\(pad_to_multiple\(x, 3, axis=1\)\)"),
    row("parallel.chunk_by_rank", "axis out of range (was wrapped silently)",
        lambda: parallel.chunk_by_rank(X, 5, 4, 0), ValueError,
        r"chunk_by_rank: `axis` must be an int in \[-4, 4\) for `x` of shape \(1, 16, 4, 8\); "
        r"received 5"),
    row("parallel.chunk_by_rank", "rank >= sp_size (was clamped silently)",
        lambda: parallel.chunk_by_rank(X, 1, 4, 4), ValueError,
        r"chunk_by_rank: `rank` must be in \[0, sp_size\) = \[0, 4\); received 4"),
    row("parallel.pad_to_multiple", "multiple = 0",
        lambda: parallel.pad_to_multiple(X, 0), ValueError,
        r"pad_to_multiple: `multiple` must be a positive int; received 0"),
    row("parallel.pad_to_multiple", "axis out of range",
        lambda: parallel.pad_to_multiple(X, 3, axis=-5), ValueError,
        r"pad_to_multiple: `axis` must be an int in \[-4, 4\).*received -5"),
    row("parallel.unpad", "length longer than the axis",
        lambda: parallel.unpad(X, 17), ValueError,
        r"unpad: `length` .* must be an int in \[0, 16\] for axis 1 of `x` of shape "
        r"\(1, 16, 4, 8\); received 17"),
    row("parallel.unpad", "negative length (was sliced from the end)",
        lambda: parallel.unpad(X, -1), ValueError,
        r"unpad: `length` .* in \[0, 16\].*received -1"),
    row("parallel.padding_segment_ids", "ids not (batch, length)",
        lambda: parallel.padding_segment_ids(10, 4, 2, jnp.zeros((3, 9), jnp.int32)), ValueError,
        r"padding_segment_ids: `segment_ids` must be the unpadded ids, int \(batch, length\) = "
        r"\(2, 10\); received int32 \(3, 9\)"),
    row("parallel.padding_segment_ids", "multiple = 0",
        lambda: parallel.padding_segment_ids(10, 0, 2), ValueError,
        r"padding_segment_ids: `multiple` must be a positive int; received 0"),
    row("parallel.kv_head_repeats", "num_kv_heads = 0",
        lambda: parallel.kv_head_repeats(4, 0, 2), ValueError,
        r"kv_head_repeats: `num_kv_heads` must be a positive int; received 0"),
    row("parallel.kv_head_repeats", "no repetition fits",
        lambda: parallel.kv_head_repeats(4, 3, 2), ValueError,
        r"no repetition of 3 key/value heads splits over sp=2 and divides H=4"),
    row("parallel.zigzag_permute", "length not a multiple of 2 * sp_size",
        lambda: parallel.zigzag_permute(X, 1, 3), ValueError,
        r"`zigzag_permute` needs axis 1 to split into 2 \* sp_size = 6 equal chunks; received "
        r"size 16\. Pad it first"),

    # ---- parallel: Ulysses ------------------------------------------------------------
    row("parallel.sequence_parallel_self_attention", "outside shard_map",
        lambda: parallel.sequence_parallel_self_attention(X, X, X, "sp"), ValueError,
        r"^Sequence-parallel axis 'sp' does not exist in the current context"),
    row("parallel.sequence_parallel_self_attention", "mesh without the named axis",
        lambda: _on_sp(lambda x: parallel.sequence_parallel_self_attention(x, x, x, "seq"), X),
        ValueError, r"^Sequence-parallel axis 'seq' does not exist in the current context"),
    row("parallel.sequence_parallel_self_attention", "an int axis name",
        lambda: _on_sp(lambda x: parallel.sequence_parallel_self_attention(x, x, x, 0), X),
        ValueError, r"^Sequence-parallel axis 0 does not exist"),
    row("parallel.sequence_parallel_self_attention", "heads not divisible by sp",
        lambda: _on_sp(lambda x: parallel.sequence_parallel_self_attention(
            x[:, :, :3], x[:, :, :3], x[:, :, :3], "sp"), X), ValueError,
        r"Ulysses splits the 3 query heads over the 4 devices of axis 'sp', so H must be a "
        r"multiple of the SP size; received H=3, sp=4"),
    row("parallel.sequence_parallel_self_attention", "H not a multiple of H_kv (GQA)",
        lambda: _on_sp(lambda x: parallel.sequence_parallel_self_attention(
            x, x[:, :, :3], x[:, :, :3], "sp"), X), ValueError,
        r"multiple of the number of key/value heads \(GQA\); received q: \(1, 4, 4, 8\) \(H=4\), "
        r"k: \(1, 4, 3, 8\) \(H_kv=3\)"),
    row("parallel.sequence_parallel_self_attention", "q of rank 3",
        lambda: _on_sp(lambda x: parallel.sequence_parallel_self_attention(
            x[..., 0], x[..., 0], x[..., 0], "sp"), X), ValueError,
        r"`q` must have rank 4 \(B, L_local, H, D\); received shape \(1, 4, 4\)"),
    row("parallel.sequence_parallel_self_attention", "k bfloat16, q float32",
        lambda: _on_sp(lambda x: parallel.sequence_parallel_self_attention(
            x, x.astype(jnp.bfloat16), x.astype(jnp.bfloat16), "sp"), X), TypeError,
        r"must share one dtype \(cast them explicitly\); received q: float32, k: bfloat16"),
    row("parallel.sequence_parallel_self_attention", "bias over the local chunk",
        _ulysses(bias=jnp.zeros((1, 4, 4, 4))), ValueError,
        r"`bias` is over the whole sequence after the all_to_all: it must broadcast to "
        r"\(B, H, S, S\) = \(1, 4, 16, 16\).*received shape \(1, 4, 4, 4\)"),
    row("parallel.sequence_parallel_self_attention", "global segment ids on every device",
        _ulysses(segment_ids=jnp.zeros((1, 16), jnp.int32)), ValueError,
        r"`segment_ids` holds this device's tokens, shape \(B, S_local\) = \(1, 4\).*received "
        r"\(1, 16\)"),
    row("parallel.sequence_parallel_self_attention", "negative window",
        _ulysses(window=(2, -1)), ValueError,
        r"`window` right size must be >= 0 \(use None for unbounded\); received -1"),
    row("parallel.sequence_parallel_joint_self_attention", "negative text_len",
        _joint(-1), ValueError,
        r"`text_len` must be between 0 and the per-device sequence length 4 .*received "
        r"text_len=-1"),
    row("parallel.sequence_parallel_joint_self_attention", "text_len longer than the sequence",
        _joint(5), ValueError,
        r"`text_len` must be between 0 and the per-device sequence length 4 .*received "
        r"text_len=5"),
    row("parallel.sequence_parallel_joint_self_attention", "float text_len",
        _joint(2.0), ValueError,
        r"`text_len` must be a Python int \(static: it sets shapes\); received float 2\.0"),
    row("parallel.sequence_parallel_joint_self_attention", "traced text_len",
        _traced_text_len, ValueError,
        r"`text_len` must be a Python int \(static: it sets shapes\); received a \w*Tracer of "
        r"shape \(\)\.$"),

    # ---- parallel: ring ---------------------------------------------------------------
    row("parallel.ring_attention", "outside shard_map",
        lambda: parallel.ring_attention(X, X, X, ring_axis="sp"), ValueError,
        r"^Ring axis 'sp' does not exist in the current context"),
    row("parallel.ring_attention", "mesh without the named axis",
        lambda: _on_sp(lambda x: parallel.ring_attention(x, x, x, ring_axis="ring"), X),
        ValueError, r"^Ring axis 'ring' does not exist in the current context"),
    row("parallel.ring_attention", "unknown layout",
        _ring(layout="striped"), ValueError,
        r"`layout` must be one of \('contiguous', 'zigzag'\); received 'striped'"),
    row("parallel.ring_attention", "zigzag with an odd local length",
        lambda: _on_sp(lambda x: parallel.ring_attention(
            x[:, :3], x[:, :3], x[:, :3], ring_axis="sp", layout="zigzag"), X), ValueError,
        r"zigzag layout needs an even local length of q .*received 3\. Pad the global sequence "
        r"to a multiple of 2 \* sp_size = 8"),
    row("parallel.ring_attention", "integer sinks",
        _ring(sinks=jnp.zeros((4,), jnp.int32)), ValueError,
        r"ring_attention: `sinks` must be a float array of shape \(H,\) = \(4,\), one logit per "
        r"query head; received shape \(4,\), dtype int32"),
    row("parallel.ring_attention", "H not a multiple of H_kv (GQA)",
        lambda: _on_sp(lambda x: parallel.ring_attention(
            x, x[:, :, :3], x[:, :, :3], ring_axis="sp"), X), ValueError,
        r"\(GQA\); received q: \(1, 4, 4, 8\) \(H=4\), k: \(1, 4, 3, 8\) \(H_kv=3\)"),
    row("parallel.ring_attention", "logits_soft_cap = 0",
        _ring(logits_soft_cap=0.0), ValueError, r"`logits_soft_cap` must be > 0; received 0\.0"),
    row("parallel.ring_attention", "float SegmentIds (truncated silently)",
        _ring_segment_ids(jnp.zeros((1, 16))), TypeError,
        r"`segment_ids.q` must have an integer dtype; received dtype float32"),
    row("parallel.ring_attention", "uint32 SegmentIds (wrap to padding silently)",
        _ring_segment_ids(jnp.full((1, 16), 2**31, jnp.uint32)), TypeError,
        r"`segment_ids.q` must have an integer dtype whose values fit int32"),
    row("parallel.make_ring_attention", "integer dense mask",
        lambda: parallel.make_ring_attention(np.ones((16, 16), np.int32)), TypeError,
        r"a dense mask must be boolean \(True = may attend\); received dtype int32.*astype\(bool\)"),
    row("parallel.make_ring_attention", "non-square dense mask",
        lambda: parallel.make_ring_attention(np.ones((16, 8), bool)), ValueError,
        r"a dense mask must be 2D \(S, S\).*received shape \(16, 8\)"),
    row("parallel.LocalMask", "negative window",
        lambda: parallel.LocalMask((-1, 2)), ValueError,
        r"`LocalMask\(window=...\)` left size must be a non-negative int or None.*received -1"),
    row("parallel.RingAttentionKernel", "mask built for another sequence length",
        lambda: _on_sp(lambda x: parallel.make_ring_attention(parallel.CausalMask((8, 8)))(
            x, x, x), X), ValueError,
        r"the mask covers a global sequence of 8 tokens, but the ring holds 16"),

    # ---- parallel: USP ----------------------------------------------------------------
    row("parallel.usp_attention", "mesh without the ring axis",
        _usp(ring_axis="rng"), ValueError, r"^Ring axis 'rng' does not exist in the current context"),
    row("parallel.usp_attention", "one axis for both",
        _usp(ring_axis="sp"), ValueError,
        r"`ulysses_axis` and `ring_axis` must be two different mesh axes; received 'sp' for both"),
    row("parallel.usp_attention", "heads not divisible by the Ulysses size",
        lambda: _on_usp(lambda x: parallel.usp_attention(
            x[:, :, :3], x[:, :, :3], x[:, :, :3], ulysses_axis="sp", ring_axis="ring"), X),
        ValueError, r"Ulysses splits the 3 query heads over the 2 devices of axis 'sp'.*H=3, sp=2"),
    row("parallel.usp_attention", "text_len longer than the sequence",
        _usp(text_len=9), ValueError,
        r"usp_attention: `text_len` must be between 0 and the per-device sequence length 4 .*"
        r"received text_len=9"),
    row("parallel.usp_attention", "negative text_len",
        _usp(text_len=-2), ValueError, r"`text_len` must be between 0 .*received text_len=-2"),
    row("parallel.usp_attention", "uint32 segment ids",
        lambda: _on_usp(lambda x, s: parallel.usp_attention(
            x, x, x, ulysses_axis="sp", ring_axis="ring", segment_ids=s),
            X, jnp.zeros((1, 16), jnp.uint32)), ValueError,
        r"`segment_ids` holds this device's tokens: ints that fit int32, \(B, S_local\) = "
        r"\(1, 4\).*received uint32 \(1, 4\)"),

    # ---- parallel / core: Megatron ----------------------------------------------------
    row("parallel.tensor_parallel_attention", "mesh=None",
        lambda: parallel.tensor_parallel_attention(X, X, X, mesh=None), TypeError,
        r"`mesh` must be a jax.sharding.Mesh .*; received NoneType"),
    row("parallel.tensor_parallel_attention", "tp_axis not in the mesh (was unsharded silently)",
        _tp(tp_axis="model"), ValueError,
        r"`tp_axis`='model' is not an axis of the mesh, whose axes are \('dp', 'sp', 'tp'\)"),
    row("parallel.tensor_parallel_attention", "q of rank 3",
        _tp(q=X[..., 0], k=X[..., 0], v=X[..., 0]), ValueError,
        r"`q` must have rank 4 with layout \(B, S_q, H, D\); received shape \(1, 16, 4\)"),
    row("parallel.tensor_parallel_attention", "H not a multiple of H_kv (GQA)",
        _tp(k=X[:, :, :3], v=X[:, :, :3]), ValueError,
        r"\(GQA\); received q: \(1, 16, 4, 8\) \(H=4\), k: \(1, 16, 3, 8\) \(H_kv=3\)"),
    row("parallel.tensor_parallel_attention", "bias that does not broadcast (global shapes)",
        _tp(bias=jnp.zeros((3, 16, 16))), ValueError,
        r"`bias` must broadcast to \(B, H, S_q, S_k\) = \(1, 4, 16, 16\); received shape "
        r"\(1, 3, 16, 16\)"),
    row("parallel.tensor_parallel_attention", "heads not divisible by tp",
        _tp(q=X[:, :, :3], k=X[:, :, :3], v=X[:, :, :3]), ValueError,
        r"splits the 3 query heads over the 4 devices of axis 'tp'.*H=3, tp=4"),
    row("core.dot_product_attention", "mesh given as a string",
        lambda: core.dot_product_attention(X, X, X, mesh="tp"), TypeError,
        r"`mesh` must be a jax.sharding.Mesh .*; received str"),
    row("core.dot_product_attention", "k bfloat16, q float32",
        lambda: core.dot_product_attention(Q, K.astype(jnp.bfloat16), V), TypeError,
        r"must share one dtype \(cast them explicitly\); received q: float32, k: bfloat16, "
        r"v: float32"),
    row("core.local_attention", "integer q",
        lambda: core.local_attention(Q.astype(jnp.int32), K, V), TypeError,
        r"`q` must have a floating dtype.*int32"),

    # ---- nn: construction -------------------------------------------------------------
    row("nn.Attention", "dim = 0", lambda: nn.Attention(0, 4, key=KEY), ValueError,
        r"Attention: `dim` must be a positive int; received 0"),
    row("nn.Attention", "negative dim", lambda: nn.Attention(-8, 4, key=KEY), ValueError,
        r"Attention: `dim` must be a positive int; received -8"),
    row("nn.Attention", "float dim", lambda: nn.Attention(32.0, 4, key=KEY), ValueError,
        r"Attention: `dim` must be a positive int; received 32\.0"),
    row("nn.Attention", "dim not a multiple of num_heads",
        lambda: nn.Attention(30, 4, key=KEY), ValueError,
        r"Attention: `dim` must be a multiple of `num_heads`.*received dim=30, num_heads=4"),
    row("nn.Attention", "num_heads = 0", lambda: nn.Attention(32, 0, key=KEY), ValueError,
        r"Attention: `num_heads` must be a positive int; received 0"),
    row("nn.Attention", "negative eps", lambda: nn.Attention(32, 4, eps=-1e-6, key=KEY),
        ValueError, r"Attention: `eps` must be a finite number >= 0 .*received -1e-06"),
    row("nn.Attention", "parallel given as a string",
        lambda: nn.Attention(32, 4, parallel="ulysses", key=KEY), ValueError,
        r"Attention: `parallel` must be a ParallelConfig; received str"),
    row("nn.CrossAttention", "negative context_dim",
        lambda: nn.CrossAttention(32, 4, context_dim=-1, key=KEY), ValueError,
        r"CrossAttention: `context_dim` must be a positive int; received -1"),
    row("nn.sharding.ParallelConfig", "unknown sequence mode",
        lambda: nn.sharding.ParallelConfig(sequence="context"), ValueError,
        r"`sequence` must be one of \('none', 'ulysses', 'ring', 'usp'\); received 'context'"),
    row("nn.sharding.ParallelConfig", "usp without ring_axis",
        lambda: nn.sharding.ParallelConfig(sequence="usp"), ValueError,
        r"two different mesh axes; received ulysses_axis='sp', ring_axis=None"),
    row("nn.RMSNorm", "dim = 0", lambda: nn.RMSNorm(0), ValueError,
        r"RMSNorm: `dim` must be a positive int; received 0"),
    row("nn.RMSNorm", "eps = nan", lambda: nn.RMSNorm(8, eps=float("nan")), ValueError,
        r"RMSNorm: `eps` must be a finite number >= 0.*received nan"),
    row("nn.RMSNorm", "eps a string", lambda: nn.RMSNorm(8, eps="1e-6"), TypeError,
        r"RMSNorm: `eps` must be a number; received str '1e-6'"),
    row("nn.TPShardedRMSNorm", "global_dim not a multiple of dim_local",
        lambda: nn.TPShardedRMSNorm(3, 8), ValueError,
        r"global_dim to be a multiple of dim_local.*received dim_local=3, global_dim=8"),
    row("nn.LayerNorm", "negative dim", lambda: nn.LayerNorm(-1), ValueError,
        r"LayerNorm: `dim` must be a positive int; received -1"),

    # ---- nn: calls (jaxtyping + beartype, in words: vidax_eqx/_shapes.py) -----------------------------------------
    row("nn.Attention.__call__", "x with the wrong feature size",
        lambda: nn.Attention(DIM, HEADS, key=KEY)(jnp.ones((5, DIM - 8))), TypeCheckError,
        r"^Attention\(dim=32, num_heads=4\): `x` must be a float array \(S, 32\); received "
        r"float32 \(5, 24\)\.$"),
    row("nn.Attention.__call__", "a batch (modules take one example; use jax.vmap)",
        lambda: nn.Attention(DIM, HEADS, key=KEY)(jnp.ones((2, 5, DIM))), TypeCheckError,
        r"`x` must be a float array \(S, 32\); received float32 \(2, 5, 32\)\.\nIt takes one "
        r"example.*jax\.vmap\(module\)"),
    row("nn.Attention.__call__", "integer x",
        lambda: nn.Attention(DIM, HEADS, key=KEY)(jnp.ones((5, DIM), jnp.int32)), TypeCheckError,
        r"`x` must be a float array \(S, 32\); received int32 \(5, 32\)\.$"),
    row("nn.Attention.__call__", "float segment ids",
        lambda: nn.Attention(DIM, HEADS, key=KEY)(jnp.ones((5, DIM)), segment_ids=jnp.zeros(5)),
        TypeCheckError, r"`segment_ids` must be an int array \(5,\) or None; received float32 "
        r"\(5,\) \(S = 5 as in `x`\)\.$"),
    row("nn.Attention.__call__", "rope tables of the wrong width",
        lambda: nn.Attention(DIM, HEADS, key=KEY)(
            jnp.ones((5, DIM)), rope=(jnp.ones((5, 3)), jnp.ones((5, 3)))), TypeCheckError,
        r"`rope` must be a tuple \(a float array \(5, 4\), a float array \(5, 4\)\) or None; "
        r"received a tuple \(float32 \(5, 3\), float32 \(5, 3\)\)"),
    row("nn.Attention.__call__", "tensor parallel outside shard_map",
        lambda: nn.Attention(DIM, HEADS, parallel=nn.sharding.ParallelConfig(tp_axis="tp"), key=KEY)(
            jnp.ones((5, DIM))), ValueError, r"^Tensor-parallel axis 'tp' does not exist"),
    row("nn.CrossAttention.__call__", "context with the wrong feature size",
        lambda: nn.CrossAttention(DIM, HEADS, context_dim=16, key=KEY)(
            jnp.ones((5, DIM)), jnp.ones((3, DIM))), TypeCheckError,
        r"^CrossAttention\(dim=32, num_heads=4, context_dim=16\): `context` must be a float array "
        r"\(S_ctx, 16\) or None; received float32 \(3, 32\)\.$"),
    row("nn.CrossAttention.__call__", "integer context_mask",
        lambda: nn.CrossAttention(DIM, HEADS, key=KEY)(
            jnp.ones((5, DIM)), jnp.ones((3, DIM)), context_mask=jnp.ones(3, jnp.int32)),
        TypeCheckError, r"`context_mask` must be a bool array \(3,\) or None; received int32 \(3,\)"),
    row("nn.JointAttention.__call__", "context with the wrong feature size",
        lambda: nn.JointAttention(DIM, HEADS, key=KEY)(jnp.ones((5, DIM)), jnp.ones((3, 16))),
        TypeCheckError, r"^JointAttention\(dim=32, num_heads=4\): `context` must be a float array "
        r"\(T, 32\); received float32 \(3, 16\)\.$"),
    row("nn.RMSNorm.__call__", "x with the wrong last axis",
        lambda: nn.RMSNorm(16)(jnp.ones((3, 8))), TypeCheckError,
        r"^RMSNorm\(dim=16\): `x` must be a float array \(\.\.\., 16\); received float32 \(3, 8\)\.$"),
    row("nn.functional.rms_norm", "negative eps (NaN for a zero input)",
        lambda: functional.rms_norm(jnp.zeros((3, 8)), jnp.ones(8), -1.0), ValueError,
        r"rms_norm: `eps` must be a finite number >= 0.*a negative one gives NaN.*received -1\.0"),
    row("nn.functional.apply_rope", "odd head_dim",
        lambda: functional.apply_rope(jnp.ones((4, 2, 7)), jnp.ones((4, 3)), jnp.ones((4, 3))),
        ValueError, r"apply_rope: the last axis of `x` must be even; received shape \(4, 2, 7\)"),
    row("nn.functional.rope_3d", "a 2D grid",
        lambda: functional.rope_3d((2, 2), 8), ValueError,
        r"rope_3d: `grid` must be three positive ints \(frames, height, width\); received \(2, 2\)"),
    row("nn.functional.tp_sharded_rms_norm", "global_dim that does not match the mesh",
        lambda: _inside_tp(lambda x: functional.tp_sharded_rms_norm(x, jnp.ones(4), 16),
                           jnp.ones((3, 8))), ValueError,
        r"dim_local \* axis_size\('tp'\) == global_dim; received dim_local=4, axis_size=2, "
        r"global_dim=16"),

    # ---- flax shim --------------------------------------------------------------------
    row("flax.RMSNorm", "x with the wrong last axis",
        lambda: flax.RMSNorm(8).init(KEY, jnp.ones((3, 4))), ValueError,
        r"RMSNorm: the last axis of `x` is normalized and must have size dim=8; received shape "
        r"\(3, 4\)"),
    row("flax.RMSNorm", "dim = 0",
        lambda: flax.RMSNorm(0).init(KEY, jnp.ones((3, 0))), ValueError,
        r"RMSNorm: `dim` must be a positive int; received 0"),
    row("flax.attention_fn", "attention dropout (valid, not served)",
        lambda: flax.attention_fn(Q, Q, Q, dropout_rate=0.1), NotImplementedError,
        r"attention dropout \(dropout_rate=0\.1, deterministic=False\) is not implemented.*"
        r"dropout_rate=0\.0 or deterministic=True"),
    row("flax.attention_fn", "bias that does not broadcast",
        lambda: flax.attention_fn(Q, Q, Q, bias=jnp.ones((B, 3, S_q, S_q))), ValueError,
        r"`bias` must broadcast to \(B, H, S_q, S_k\) = \(2, 4, 7, 7\); received shape "
        r"\(2, 3, 7, 7\)"),
    row("flax.rms_norm_from_linen", "scale of the wrong size",
        lambda: flax.rms_norm_from_linen(flax.RMSNorm(8), {"params": {"scale": jnp.ones(7)}}),
        ValueError, r"`scale` must have shape \(8,\) for a linen RMSNorm of that size; received "
                    r"\(7,\)"),
    row("flax.dot_product_attention", "mesh given as a string",
        lambda: flax.dot_product_attention(X, X, X, mesh="tp"), TypeError,
        r"`mesh` must be a jax.sharding.Mesh"),

    # ---- interop: weight files (the module passed in must stay unchanged) -------------
    row("interop.load_state_dict", "file missing a tensor",
        _rejected_load(_file_from(lambda sd: sd.pop("q.bias"))), ValueError,
        r"nothing was loaded.*missing \(1\): 'q.bias' or 'to_q.bias'.*strict=False",
        takes_tmp=True),
    row("interop.load_state_dict", "file with an extra tensor",
        _rejected_load(_file_from(lambda sd: sd.update(extra=np.zeros(3, np.float32)))),
        ValueError, r"nothing was loaded.*unexpected \(1\): 'extra'", takes_tmp=True),
    row("interop.load_state_dict", "file with a mis-shaped tensor",
        _rejected_load(_file_from(lambda sd: sd.update({"o.weight": np.zeros((32, 33), np.float32)}))),
        ValueError, r"wrong shape \(1\): 'o.weight': got \(32, 33\), expected \(32, 32\)",
        takes_tmp=True),
    row("interop.load_state_dict", "file with an int64 tensor",
        _rejected_load(_file_from(lambda sd: sd.update({"v.bias": np.arange(32)}))),
        ValueError, r"wrong dtype \(1\): 'v.bias': got int64, expected a floating dtype",
        takes_tmp=True),
    row("interop.load_state_dict", "state dict with a complex tensor",
        _rejected_load(lambda tmp: {**interop.state_dict(_attention_module(0)),
                                    "k.bias": np.zeros(32, np.complex64)}),
        ValueError, r"wrong dtype \(1\): 'k.bias': got complex64, expected a floating dtype",
        takes_tmp=True),
    row("interop.load_state_dict", "truncated file",
        _rejected_load(_valid_file_bytes(cut=-100)), ValueError,
        r"is not a valid .safetensors file: the safetensors library refuses its header \(.+\); "
        r"received a \d+-byte header and \d+ data bytes.*Nothing was loaded",
        takes_tmp=True),
    row("interop.load_state_dict", "file cut inside its header",
        _rejected_load(_valid_file_bytes(cut=40)), ValueError,
        r"is not a valid .safetensors file: the safetensors library refuses its header \(.+\); "
        r"received 40 bytes whose header length is \d+; expected at most 32 ", takes_tmp=True),
    row("interop.load_state_dict", "corrupt byte in the header",
        _rejected_load(_valid_file_bytes(flip=20)), ValueError,
        r"is not a valid .safetensors file: the safetensors library refuses its header.*"
        r"Nothing was loaded",
        takes_tmp=True),
    row("interop.load_state_dict", "header declaring a 4 TiB tensor",
        _rejected_load(lambda tmp: harness.safetensors_file(
            tmp / "w.safetensors", {"q.weight": harness.safetensors_entry(shape=(2**40,), offsets=(0, 2**42))},
            bytes(8))), ValueError,
        r"refuses its header \(.+\); received a \d+-byte header and 8 data bytes; expected JSON "
        r"entries \(dtype, shape, data_offsets\) whose tensors tile those 8 bytes", takes_tmp=True),
    row("interop.load_state_dict", "header with offsets past the end",
        _rejected_load(lambda tmp: harness.safetensors_file(
            tmp / "w.safetensors", {"q.bias": harness.safetensors_entry(offsets=(8, 16))}, bytes(8))), ValueError,
        r"refuses its header \(.+\); received a \d+-byte header and 8 data bytes",
        takes_tmp=True),
    row("interop.load_state_dict", "header with overlapping tensors",
        _rejected_load(lambda tmp: harness.safetensors_file(
            tmp / "w.safetensors", {"q.bias": harness.safetensors_entry(), "k.bias": harness.safetensors_entry(offsets=(4, 12))},
            bytes(12))), ValueError,
        r"refuses its header \(.*k\.bias.*\); received a \d+-byte header and 12 data bytes",
        takes_tmp=True),
    row("interop.load_state_dict", "header length 2**64 - 1",
        _rejected_load(lambda tmp: harness.safetensors_file(tmp / "w.safetensors", b"{}", length=2**64 - 1)),
        ValueError, r"header length is 18446744073709551615; expected at most 2 \(the bytes "
                    r"after it, never over 100000000\)", takes_tmp=True),
    row("interop.load_state_dict", "a pickle where the JSON header should be",
        _rejected_load(lambda tmp: harness.safetensors_file(
            tmp / "w.safetensors", pickle.dumps({"q.weight": "os.system"}))), ValueError,
        r"the safetensors library refuses its header \(.+\); received a \d+-byte header",
        takes_tmp=True),
    row("interop.load_state_dict", "a pickle-based .pt checkpoint",
        _rejected_load(lambda tmp: (tmp / "model.pt").write_bytes(b"\x80\x04.") and tmp / "model.pt"),
        ValueError, r"'.*model\.pt' looks like a pickle-based PyTorch checkpoint.*never unpickled",
        takes_tmp=True),
    row("interop.load_state_dict", "file truncated after it was opened",
        _rejected_load(_changed_after_open), ValueError,
        r"is not a valid .safetensors file: its size changed after it was opened", takes_tmp=True),
    row("interop.load_state_dict", "a list of pairs as source",
        _rejected_load(lambda tmp: list(interop.state_dict(_attention_module(0)).items())),
        ValueError, r"`source` must be a mapping of names to arrays or a path to a .safetensors "
                    r"file; received list", takes_tmp=True),
    row("interop.save_safetensors", "a complex tensor",
        lambda tmp: interop.save_safetensors({"w": np.zeros(2, np.complex64)}, tmp / "w.safetensors"),
        ValueError, r"tensor 'w' has dtype complex64, which interop's .safetensors files do not "
                    r"hold; supported: ",
        takes_tmp=True),
]


def test_rows_are_unique():
    ids = [p.id for p in ROWS]
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]


@pytest.mark.parametrize("case", ROWS)
def test_bad_input(case: Row, tmp_path):
    with pytest.raises(case.error) as info:
        case.call(tmp_path)
    message = str(info.value)
    assert re.search(case.match, message, re.DOTALL), (
        f"{case.entry}: {case.bad}: raised {type(info.value).__name__} with a message that does "
        f"not match {case.match!r}:\n{message}"
    )
    assert len(message) < 1000, f"an overlong message ({len(message)} chars):\n{message}"


# -- non-finite values propagate honestly ------------------------------------------------


IMPLS = [
    pytest.param("xla", id="xla"),
    pytest.param("blockwise", id="blockwise"),
    pytest.param(kernels.Blockwise(block_q=8, block_kv=8), id="blockwise-8x8"),
]
# With gradients: the materializing path and the tiled one (tiles partly masked).
GRAD_IMPLS = [IMPLS[0], IMPLS[2]]
_NB, _NS, _NH, _NK, _ND = 2, 24, 4, 2, 8
_GROUP = _NH // _NK  # query heads per kv head


def _nqkv(seed=1):
    a = harness.attention_inputs(_NB, _NS, _NH, _ND, H_kv=_NK, seed=seed)
    return a["q"], a["k"], a["v"]


def _run(q, k, v, impl, **kw):
    """`kernels.attention` under one `jit` (array options traced, the rest static)."""
    arrays = {n: x for n, x in kw.items() if isinstance(x, jax.Array)}
    static = {n: x for n, x in kw.items() if n not in arrays}
    fn = jax.jit(lambda q, k, v, a: kernels.attention(q, k, v, implementation=impl, **static, **a))
    return fn(*map(jnp.asarray, (q, k, v)), arrays)


def _only(nonfinite: np.ndarray, where: np.ndarray, what: str):
    """`nonfinite` (a boolean array) is True exactly on `where`."""
    missing = where & ~nonfinite
    extra = nonfinite & ~where
    assert not missing.any(), f"{what}: {missing.sum()} outputs that depend on the bad value are finite"
    assert not extra.any(), f"{what}: {extra.sum()} outputs that do not depend on it are not finite"


@pytest.mark.parametrize("impl", GRAD_IMPLS)
def test_nan_in_q_reaches_its_row_only(impl):
    q, k, v = _nqkv()
    q[1, 5, 3, 2] = np.nan
    def loss(q):
        return jnp.sum(kernels.attention(q, jnp.asarray(k), jnp.asarray(v), implementation=impl))

    out, lse = jax.jit(lambda q: kernels.attention_fwd(q, jnp.asarray(k), jnp.asarray(v),
                                                       implementation=impl))(jnp.asarray(q))
    where = np.zeros(out.shape, bool)
    where[1, 5, 3, :] = True
    _only(np.isnan(np.asarray(out)), where, "out")
    lse = np.asarray(lse)
    assert np.isnan(lse[1, 3, 5]), "the row's lse must be NaN, not -inf (which means 'sees nothing')"
    assert np.isfinite(np.delete(lse.reshape(-1), np.ravel_multi_index((1, 3, 5), lse.shape))).all()
    # The gradient too: dq of that row is NaN, never zeroed; other rows of dq are finite.
    dq = jax.jit(jax.grad(loss))(jnp.asarray(q))
    where = np.zeros(dq.shape, bool)
    where[1, 5, 3, :] = True
    _only(~np.isfinite(np.asarray(dq)), where, "dq")


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_in_k_reaches_the_rows_that_see_it(impl):
    """Causal: key 10 is seen by rows >= 10 of the query heads of its kv head; rows
    before it are not affected (the mask replaces the NaN score)."""
    q, k, v = _nqkv()
    k[0, 10, 1, 0] = np.nan
    out = _run(q, k, v, impl, causal=True)
    where = np.zeros(out.shape, bool)
    where[0, 10:, _GROUP:2 * _GROUP, :] = True
    _only(np.isnan(np.asarray(out)), where, "out")


@pytest.mark.parametrize("impl", IMPLS)
def test_inf_in_v_is_not_zeroed(impl):
    q, k, v = _nqkv()
    v[1, 3, 0, 4] = np.inf
    out = np.asarray(_run(q, k, v, impl))
    where = np.zeros(out.shape, bool)
    where[1, :, :_GROUP, 4] = True  # every row sees key 3 (no mask): feature 4 is +inf
    _only(~np.isfinite(out), where, "out")
    assert (out[1, :, :_GROUP, 4] == np.inf).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_in_bias_and_sinks(impl):
    q, k, v = map(jnp.asarray, _nqkv())
    bias = np.zeros((_NS, _NS), np.float32)
    bias[7, 2] = np.nan
    out = _run(q, k, v, impl, bias=jnp.asarray(bias))
    where = np.zeros(out.shape, bool)
    where[:, 7] = True
    _only(np.isnan(np.asarray(out)), where, "out (bias)")
    sinks = np.zeros(_NH, np.float32)
    sinks[2] = np.nan
    out = _run(q, k, v, impl, sinks=jnp.asarray(sinks))
    where = np.zeros(out.shape, bool)
    where[:, :, 2] = True
    _only(np.isnan(np.asarray(out)), where, "out (sinks)")


@pytest.mark.parametrize("impl", GRAD_IMPLS)
def test_padding_is_inert_whatever_it_holds(impl):
    """Tokens with a negative segment id attend to nothing and are seen by nothing:
    NaN / Inf left in them changes no real token's output or gradient."""
    q, k, v = _nqkv()
    seg = np.zeros((_NB, _NS), np.int32)
    seg[:, 19:] = -1
    seg[1, :8] = 1
    clean = [jnp.asarray(np.where(seg[:, :, None, None] < 0, 0, x)) for x in (q, k, v)]
    dirty = [x.copy() for x in (q, k, v)]
    for x, bad in zip(dirty, (np.nan, np.inf, -np.inf)):
        x[:, 19:] = bad
        x[0, 21, 0, 0] = np.nan
    dirty = [jnp.asarray(x) for x in dirty]
    ct = jnp.asarray(np.random.default_rng(2).standard_normal((_NB, _NS, _NH, _ND)), jnp.float32)

    def run(q, k, v):
        def loss(q, k, v):
            return jnp.sum(kernels.attention(q, k, v, segment_ids=jnp.asarray(seg), causal=True,
                                             implementation=impl) * ct)

        out = kernels.attention(q, k, v, segment_ids=jnp.asarray(seg), causal=True,
                                implementation=impl)
        return (out, *jax.grad(loss, argnums=(0, 1, 2))(q, k, v))

    run = jax.jit(run)
    for got, want, name in zip(run(*dirty), run(*clean), ("out", "dq", "dk", "dv")):
        got, want = np.asarray(got), np.asarray(want)
        assert np.isfinite(got).all(), f"{name}: padding garbage leaked into real tokens"
        np.testing.assert_array_equal(got, want, err_msg=name)
        assert (got[:, 19:] == 0).all(), f"{name}: padding rows must be 0"


def _nan_pattern_parallel(fn, mesh_kw, spec, causal):
    """Runs `fn` sharded and single-device kernels.attention on the same NaN-laced inputs."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 16, 4, 8)).astype(np.float32) for _ in range(3))
    q[0, 3, 1, 0] = np.nan      # row 3, head 1
    k[0, 9, 2, 0] = np.nan      # key 9, head 2 (a causal mask hides it from rows < 9)
    # Key 0, which every row sees: an Inf in the *value* of a key that the mask hides
    # from some rows may still reach them through `0 * inf` in one implementation and
    # not in another (see docs/limits.md); that is not what this test is about.
    v[0, 0, 0, 5] = np.inf      # head 0, feature 5
    q, k, v = map(jnp.asarray, (q, k, v))
    mesh = harness.mesh(**mesh_kw)
    out = jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)(q, k, v)
    ref = kernels.attention(q, k, v, causal=causal, implementation="xla")
    return np.asarray(out), np.asarray(ref)


@pytest.mark.parametrize("path", ["ulysses", "ring", "usp"])
def test_nan_propagates_through_parallel_paths(path):
    """Sharded attention puts NaN / Inf exactly where one device does (the ring's
    log-sum-exp merge must not mistake a NaN block for an empty one, nor drop it)."""
    sp = P(None, "sp")
    causal = True
    if path == "ulysses":
        fn = lambda q, k, v: parallel.sequence_parallel_self_attention(  # noqa: E731
            q, k, v, "sp", causal=causal)
        mesh_kw, spec = dict(sp=4), sp
    elif path == "ring":  # NaN blocks travel the ring and are merged by log-sum-exp
        fn = lambda q, k, v: parallel.ring_attention(  # noqa: E731
            q, k, v, ring_axis="sp", causal=causal)
        mesh_kw, spec = dict(sp=4), sp
    else:
        fn = lambda q, k, v: parallel.usp_attention(  # noqa: E731
            q, k, v, ulysses_axis="sp", ring_axis="ring", causal=causal)
        mesh_kw, spec = dict(sp=2, ring=2), P(None, ("ring", "sp"))
    out, ref = _nan_pattern_parallel(fn, mesh_kw, spec, causal)
    assert np.isnan(ref).any() and np.isinf(ref).any()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=1e-5, atol=1e-5)


def test_nan_through_modules():
    x = np.random.default_rng(4).standard_normal((6, DIM)).astype(np.float32)
    x[2, 5] = np.nan
    x[4, 0] = np.inf
    y = np.asarray(nn.RMSNorm(DIM)(jnp.asarray(x)))
    where = np.zeros(y.shape, bool)
    where[2] = True  # the NaN token's mean square is NaN: its whole row
    where[4, 0] = True  # inf * rsqrt(inf) is NaN; the row's other features tend to 0, honestly
    _only(np.isnan(y), where, "RMSNorm")
    assert (y[4, 1:] == 0).all()
    attn = _attention_module(0)
    y = np.asarray(attn(jnp.asarray(x)))
    assert np.isnan(y).all(), "every token attends to the NaN token's key: all rows must be NaN"
    # Marked as padding, the bad tokens are inert; real tokens equal the clean run.
    seg = jnp.asarray([0, 0, -1, 0, -1, 0])
    clean = np.where(np.isfinite(x), x, 0).astype(np.float32)
    got = np.asarray(attn(jnp.asarray(x), segment_ids=seg))
    want = np.asarray(attn(jnp.asarray(clean), segment_ids=seg))
    real = np.asarray(seg) >= 0
    assert np.isfinite(got[real]).all()
    np.testing.assert_allclose(got[real], want[real], rtol=1e-6, atol=1e-6)


# -- accepted edge inputs: they work and mean what they say ------------------------------


def test_edge_inputs_that_are_valid():
    q, k, v = map(jnp.asarray, _nqkv())
    ref = np.asarray(kernels.attention(q, k, v))
    # A window wider than the sequence, or past int32, excludes nothing.
    for window in [(_NS, _NS), (2**40, None), (None, 10**30)]:
        np.testing.assert_array_equal(np.asarray(kernels.attention(q, k, v, window=window)), ref)
    # Small unsigned ids fit int32 and are accepted as they are.
    seg = np.zeros((_NB, _NS), np.int32)
    seg[:, 12:] = 1
    a = kernels.attention(q, k, v, segment_ids=jnp.asarray(seg))
    b = kernels.attention(q, k, v, segment_ids=jnp.asarray(seg, jnp.uint16))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- hostile weight files: no unpickling, bounded memory, nothing loaded ----------------


HOSTILE_FILES = {
    "4 TiB tensor": lambda p: harness.safetensors_file(p, {"q.weight": harness.safetensors_entry(shape=(2**20, 2**20),
                                                               offsets=(0, 2**42))}, bytes(8)),
    "2**62 x 1000 shape": lambda p: harness.safetensors_file(p, {"q.weight": harness.safetensors_entry(shape=[2**62] * 1000)},
                                              bytes(8)),
    "header length at the cap": lambda p: harness.safetensors_file(p, b"{}", length=interop.MAX_HEADER_BYTES),
    "offsets beyond the file": lambda p: harness.safetensors_file(
        p, {"q.weight": harness.safetensors_entry(offsets=(2**63, 2**63 + 8))}, bytes(8)),
    "overlapping tensors": lambda p: harness.safetensors_file(
        p, {"a": harness.safetensors_entry(offsets=(0, 8)), "b": harness.safetensors_entry(offsets=(0, 8))}, bytes(8)),
    "pickle payload as header": lambda p: harness.safetensors_file(
        p, pickle.dumps(os.system) + b" " * 8),
    "20k entries": lambda p: harness.safetensors_file(
        p, {f"t{i}": harness.safetensors_entry(shape=(0,), offsets=(0, 0)) for i in range(20_000)}),
}


@pytest.mark.parametrize("case", list(HOSTILE_FILES))
def test_hostile_file_is_rejected_safely(case, tmp_path, monkeypatch):
    path = HOSTILE_FILES[case](tmp_path / "bad.safetensors")

    def forbidden(*args, **kwargs):
        raise AssertionError("the loader tried to unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(np, "load", forbidden)
    target = _attention_module(1)
    before = [np.array(x) for x in harness.arrays(target)]
    size = os.path.getsize(path)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as info:
            interop.load_state_dict(target, path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "nothing was loaded" in str(info.value).lower()
    # The reader allocates for the header it parses, never for what the header claims.
    assert peak < 64 * size + 8_000_000, f"peak {peak} bytes for a {size}-byte file"
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(harness.arrays(target), before))
