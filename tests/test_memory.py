"""`"blockwise"` is O(S) in memory, forward and backward; `"xla"` is O(S^2).

Nothing here runs at the large size: the functions are only lowered and compiled
on abstract shapes, and XLA's buffer assignment (`memory_analysis()`) and the
optimized HLO are inspected. At S = 65536 one float32 score matrix would take
`4 * B * H * S^2` = 32 GiB; the blockwise program must need a small fraction of it.
The same measurements on `"xla"` at a moderate size do find the score matrix,
which shows the checks can fail.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vidax_eqx import kernels


GiB = 2**30
_SHAPE = re.compile(r"\b(?:pred|s8|s16|s32|s64|u8|u16|u32|u64|f16|bf16|f32|f64)\[([0-9,]*)\]")


def _largest_hlo_array(compiled) -> int:
    """The element count of the largest array shape in the optimized HLO text."""
    largest = 0
    for dims in _SHAPE.findall(compiled.as_text()):
        largest = max(largest, int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)))
    return largest


def _compile(implementation, B, S, H, D, *, grad, features=False):
    """Compiles attention (or the gradient of a scalar of it) on abstract inputs."""
    f32 = jnp.float32
    qkv = jax.ShapeDtypeStruct((B, S, H, D), f32)
    args = [qkv, qkv, qkv]
    kw = dict(implementation=implementation)
    if features:
        # Every O(S)-sized feature at once: a key bias and sinks (both differentiated),
        # segment ids with padding, custom positions, causal, a window and a soft cap.
        args += [jax.ShapeDtypeStruct((B, 1, 1, S), f32), jax.ShapeDtypeStruct((H,), f32)]
        seg = (jnp.arange(S, dtype=jnp.int32) // 4096)[None].repeat(B, 0)
        seg = seg.at[:, -100:].set(-1)
        pos = jnp.arange(S, dtype=jnp.int32) * 2
        kw.update(segment_ids=seg, q_positions=pos, kv_positions=pos, causal=True,
                  window=(8192, None), logits_soft_cap=30.0)

    def loss(q, k, v, bias=None, sinks=None):
        out, lse = kernels.attention_fwd(q, k, v, bias=bias, sinks=sinks, **kw)
        # Both outputs feed the loss, so the backward sees a dlse cotangent too.
        return jnp.sum(out.astype(f32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    if grad:
        fn = jax.grad(loss, argnums=tuple(range(len(args))))
    else:
        fn = lambda *a: kernels.attention(*a[:3], **kw)  # noqa: E731
    return jax.jit(fn).lower(*args).compile()


@pytest.mark.parametrize(
    "grad, features",
    [(False, False), (True, False), (True, True)],
    ids=["forward", "forward+backward", "forward+backward-all-features"],
)
def test_blockwise_memory_is_linear(grad, features):
    B, S, H, D = 1, 65536, 2, 64
    score_bytes = 4 * B * H * S * S  # 32 GiB
    compiled = _compile("blockwise", B, S, H, D, grad=grad, features=features)
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 1 * GiB, f"blockwise temp memory {temp / GiB:.2f} GiB (score matrix {score_bytes / GiB:.0f} GiB)"
    assert temp < score_bytes / 64
    # No array in the optimized program comes anywhere near S^2 elements (the
    # largest legitimately O(S) ones, like q itself, have S * H * D).
    largest = _largest_hlo_array(compiled)
    assert 0 < largest < S * S // 128, f"largest HLO array has {largest} elements; S^2 = {S * S}"


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "forward+backward"])
def test_xla_memory_is_quadratic(grad):
    """The materializing reference does hold a score matrix: the checks above can fail."""
    B, S, H, D = 1, 2048, 2, 64
    score_bytes = 4 * B * H * S * S  # 32 MiB
    compiled = _compile("xla", B, S, H, D, grad=grad)
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp >= score_bytes, f"xla temp memory {temp} < one score matrix {score_bytes}"
    assert _largest_hlo_array(compiled) >= B * H * S * S


def test_blockwise_memory_grows_linearly():
    """Doubling S roughly doubles blockwise's temp memory (it does not quadruple)."""
    temps = [
        _compile("blockwise", 1, S, 2, 64, grad=True).memory_analysis().temp_size_in_bytes
        for S in (16384, 32768)
    ]
    assert temps[1] <= 2.5 * temps[0], temps
