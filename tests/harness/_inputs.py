"""Inputs: seeded random NumPy arrays (never zeros), segment ids, PRNG keys."""

import jax
import jax.numpy as jnp
import numpy as np


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
