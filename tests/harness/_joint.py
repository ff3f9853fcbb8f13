"""The joint layout: a text prefix replicated and put before every device's visual
chunk, its cotangent split over the devices' copies."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ._meshes import unzigzag, zigzag
from ._runs import segment_arrays, segment_specs


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

    def varying(t):
        return jax.lax.pcast(t, axes, to="varying") if check_vma else t

    def per_device(text_part, visual_part, s):
        """Each part `(q, k, v), seg` of this device, or None where it is empty: an empty
        part (no text, or no visual tokens) is not an input of the shard_map, as jaxlib
        0.11.x's CPU compiler crashes on an empty one
        (`_jax_private.EMPTY_SHARD_MAP_INPUT_CRASHES`); it is the other part's rows [:0]."""
        if text_part is not None:
            text_part = jax.tree.map(varying, text_part)
        text_part = text_part or jax.tree.map(lambda a: a[:, :0], visual_part)
        visual_part = visual_part or jax.tree.map(lambda a: a[:, :0], text_part)
        (t, seg_t), (x, seg_x) = text_part, visual_part
        join = lambda a, b: jnp.concatenate([a, b], axis=1)  # noqa: E731
        seg = None if seg_t is None else jax.tree.map(join, seg_t, seg_x)
        return attend(*map(join, t, x), seg, s)

    seg_specs = (None, None)
    if segments is not None:
        seg_specs = (segment_specs(segments, text), segment_specs(segments, seq))

    def sharded(t, x, seg, s):
        seg = (None, None) if seg is None else seg
        parts, specs = [], []
        for arrays, seg_part, spec, seg_spec in zip((t, x), seg, (text, seq), seg_specs):
            empty = arrays[0].shape[1] == 0
            parts.append(None if empty else (arrays, seg_part))
            specs.append(None if empty else ((spec,) * 3, seg_spec))
        return jax.shard_map(
            per_device, mesh=mesh, in_specs=(*specs, P() if sinks else None),
            out_specs=seq, check_vma=check_vma,
        )(*parts, s)

    @functools.partial(jax.jit, compiler_options=compiler_options)
    def run(text, visual, seg, s, dout):
        out, pull = jax.vjp(lambda t, x, s: sharded(t, x, seg, s), text, visual, s)
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
    seg = segment_arrays(a, segments)
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
