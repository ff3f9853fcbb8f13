"""Attention over a long sequence on the CPU, in O(S) memory, checked against the exact reference.

With S = 32768 tokens, B = 1, H = 8 heads of D = 64, the float32 score matrix
alone would take B*H*S^2*4 bytes = 32 GiB. `implementation="auto"` picks the
blockwise flash attention, which never builds it. The check computes the
exact, materializing reference (`implementation="xla"`) for a slice of query
rows against all S keys and compares.

    python examples/long_attention.py              # S = 32768
    python examples/long_attention.py --seq 4096 --causal

Exits non-zero if the largest error exceeds `--tol` (default 1e-4).
"""

import argparse
import os
import resource
import sys
import time


# Run against this checkout's vidax_eqx when it is not installed.
try:
    import vidax_eqx  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from vidax_eqx import kernels


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident memory of this process in MiB (Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    if sys.platform == "darwin":
        peak /= 1024  # bytes on macOS
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        current = float("nan")
    return current, peak


def reset_peak() -> None:
    """Resets the peak that `ru_maxrss` reports, where Linux allows it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=32768, help="sequence length S (default 32768)")
    p.add_argument("--heads", type=int, default=8, help="heads H (default 8)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim D (default 64)")
    p.add_argument("--rows", type=int, default=256,
                   help="query rows checked against the exact reference (default 256)")
    p.add_argument("--causal", action="store_true", help="causal attention")
    p.add_argument("--tol", type=float, default=1e-4, help="largest allowed abs error (default 1e-4)")
    args = p.parse_args(argv)

    B, S, H, D = 1, args.seq, args.heads, args.head_dim
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (B, S, H, D), jnp.float32)
    k = jax.random.normal(kk, (B, S, H, D), jnp.float32)
    v = jax.random.normal(kv, (B, S, H, D), jnp.float32)
    jax.block_until_ready((q, k, v))
    rss_inputs, _ = rss_mb()  # JAX imported, inputs created

    chosen = kernels.select_implementation(q, k, v, causal=args.causal)
    score_gib = 4 * B * H * S * S / 2**30
    print(f"attention over S={S} (B={B}, H={H}, D={D}, float32, causal={args.causal}) "
          f"on {jax.default_backend()}")
    print(f"  a materialized score matrix would be {score_gib:.2f} GiB; "
          f"implementation='auto' chose {chosen!r}")

    attend = jax.jit(lambda q, k, v: kernels.attention(q, k, v, causal=args.causal))
    t0 = time.perf_counter()
    compiled = attend.lower(q, k, v).compile()
    t_compile = time.perf_counter() - t0
    reset_peak()  # so that the peak below is the run's, not the compiler's
    rss_before, _ = rss_mb()
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(q, k, v))
    t_run = time.perf_counter() - t0
    _, rss_peak = rss_mb()
    print(f"  forward: {t_run:.2f} s (+ {t_compile:.2f} s to compile)")
    print(f"  peak RSS during the forward: {rss_peak:.0f} MiB, {rss_peak - rss_inputs:.0f} MiB above "
          f"JAX and the inputs ({rss_peak - rss_before:.0f} MiB above those and the compiled program)")

    # The exact reference for a slice of query rows against every key. Causal
    # masks are defined on positions, so the slice passes its own positions.
    rows = np.linspace(0, S - 1, min(args.rows, S)).round().astype(np.int32)
    rows = np.unique(rows)
    ref = kernels.attention(
        q[:, rows], k, v,
        causal=args.causal,
        q_positions=jnp.asarray(rows) if args.causal else None,
        kv_positions=jnp.arange(S, dtype=jnp.int32) if args.causal else None,
        implementation="xla",
    )  # fmt: skip
    err = float(jnp.max(jnp.abs(out[:, rows] - ref)))
    ok = err <= args.tol
    print(f"  max abs error against implementation='xla' on {len(rows)} query rows: "
          f"{err:.2e} ({'ok' if ok else 'FAILED'}, tolerance {args.tol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
