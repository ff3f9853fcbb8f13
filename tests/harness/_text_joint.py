"""The joint layouts with the text on either side of the visual tokens, and key-only
padding (text lengths, key lengths) for the oracle."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ._joint import text_shares
from ._meshes import unzigzag, zigzag


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
