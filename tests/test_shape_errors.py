"""Shape errors in one voice: a table of wrong calls per public module (and a few
functions), and the message each must give.

Every message names the module with its sizes (or the function), the argument, the
expected shape with its sizes resolved (from the module's fields and the call's other
arguments) and what was received, in at most three lines; a per-example module given a
batch says to use `jax.vmap`. The checker is still jaxtyping + beartype (its report is
kept on the error as `details`), and `set_shape_checks(False)` turns it off.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import pytest

import vidax_eqx
from vidax_eqx import models, nn, ShapeError

KEY = jax.random.key(0)
f32 = lambda *shape: jnp.ones(shape, jnp.float32)  # noqa: E731
VMAP = r"\nIt takes one example, and `x` has one leading axis more: map it over the batch with jax\.vmap\(module\)\(\.\.\.\)\.$"


def _wan():
    config = models.WanConfig(dim=32, ffn_dim=64, num_heads=2, num_layers=1, in_channels=4,
                              out_channels=4, text_dim=16, freq_dim=16)
    return models.WanTransformer3D(config, key=KEY)


def _cogvideox():
    config = models.CogVideoXConfig(num_attention_heads=2, attention_head_dim=16, num_layers=1,
                                    in_channels=4, out_channels=4, text_embed_dim=16,
                                    time_embed_dim=16, sample_frames=5, sample_height=8,
                                    sample_width=8, max_text_seq_length=3)
    return models.CogVideoXTransformer3D(config, key=KEY)


# (id, the module or function, the wrong call, the message it must match)
TABLE = [
    ("RMSNorm-width", lambda: nn.RMSNorm(64), lambda m: m(f32(32, 48)),
     r"^RMSNorm\(dim=64\): `x` must be a float array \(\.\.\., 64\); received float32 \(32, 48\)\.$"),
    ("RMSNorm-dtype", lambda: nn.RMSNorm(64), lambda m: m(jnp.ones((4, 64), jnp.int32)),
     r"^RMSNorm\(dim=64\): `x` must be a float array \(\.\.\., 64\); received int32 \(4, 64\)\.$"),
    ("TPShardedRMSNorm", lambda: nn.TPShardedRMSNorm(16, 64), lambda m: m(f32(4, 32)),
     r"^TPShardedRMSNorm\(dim_local=16, global_dim=64\): `x` must be a float array \(\.\.\., 16\); "
     r"received float32 \(4, 32\)\.$"),
    ("LayerNorm", lambda: nn.LayerNorm(32), lambda m: m(f32(4, 16)),
     r"^LayerNorm\(dim=32\): `x` must be a float array \(\.\.\., 32\); received float32 \(4, 16\)\.$"),
    ("ModulatedLayerNorm-shift", lambda: nn.ModulatedLayerNorm(32),
     lambda m: m(f32(4, 32), f32(4, 16), f32(4, 32)),
     r"^ModulatedLayerNorm\(dim=32\): `shift` must be a float array \(\.\.\., 32\); received "
     r"float32 \(4, 16\)\.$"),
    ("FeedForward", lambda: nn.FeedForward(32, 64, key=KEY), lambda m: m(f32(4, 16)),
     r"^FeedForward\(in_dim=32, hidden_dim=64, out_dim=32\): `x` must be a float array "
     r"\(\.\.\., 32\); received float32 \(4, 16\)\.$"),
    ("Attention-batch", lambda: nn.Attention(64, 4, key=KEY), lambda m: m(f32(2, 10, 64)),
     r"^Attention\(dim=64, num_heads=4\): `x` must be a float array \(S, 64\); received float32 "
     r"\(2, 10, 64\)\." + VMAP),
    ("Attention-gate", lambda: nn.Attention(64, 4, key=KEY), lambda m: m(f32(10, 64), gate=f32(12, 64)),
     r"^Attention\(dim=64, num_heads=4\): `gate` must be a float array \(10, 64\) or None; "
     r"received float32 \(12, 64\) \(S = 10 as in `x`\)\.$"),
    ("CrossAttention-context", lambda: nn.CrossAttention(64, 4, context_dim=32, key=KEY),
     lambda m: m(f32(10, 64), f32(7, 48)),
     r"^CrossAttention\(dim=64, num_heads=4, context_dim=32.*\): `context` must be a float array "
     r"\(S_ctx, 32\) or None; received float32 \(7, 48\)\.$"),
    ("JointAttention-segments", lambda: nn.JointAttention(64, 4, key=KEY),
     lambda m: m(f32(10, 64), f32(3, 64), segment_ids=jnp.zeros(12, jnp.int32)),
     r"^JointAttention\(dim=64, num_heads=4\): `segment_ids` must be an int array \(13,\) or "
     r"None; received int32 \(12,\) \(T = 3 as in `context`, S = 10 as in `x`\)\.$"),
    ("PatchEmbedding", lambda: nn.PatchEmbedding(4, 32, (1, 2, 2), key=KEY),
     lambda m: m(f32(3, 2, 4, 4)),
     r"^PatchEmbedding\(in_channels=4, dim=32.*\): `x` must be a float array \(4, F, H, W\); "
     r"received float32 \(3, 2, 4, 4\)\.$"),
    ("WanTransformer3D-batch", _wan, lambda m: m(f32(2, 4, 1, 4, 4), 500.0, f32(3, 16)),
     r"^WanTransformer3D: `x` must be a float array \(4, F, H, W\); received float32 "
     r"\(2, 4, 1, 4, 4\)\." + VMAP),
    ("DualStreamAttention-context", lambda: nn.DualStreamAttention(64, 4, context_dim=32, key=KEY),
     lambda m: m(f32(10, 64), f32(5, 64)),
     r"^DualStreamAttention\(dim=64, num_heads=4, context_dim=32\): `context` must be a float array "
     r"\(T, 32\); received float32 \(5, 64\)\.$"),
    ("LoRALinear", lambda: nn.with_lora(eqx.nn.Linear(16, 8, key=KEY), rank=2, key=KEY),
     lambda m: m(f32(3, 12)),
     r"^LoRALinear: `x` must be a float array \(\.\.\., 16\); received float32 \(3, 12\)\.$"),
    ("CogVideoXTransformer3D-batch", _cogvideox, lambda m: m(f32(2, 1, 4, 4, 4), 500.0, f32(3, 16)),
     r"^CogVideoXTransformer3D: `x` must be a float array \(F, 4, H, W\); received float32 "
     r"\(2, 1, 4, 4, 4\)\." + VMAP),
    ("rms_norm", lambda: nn.functional.rms_norm, lambda f: f(f32(4, 48), f32(64)),
     r"^rms_norm: `weight` must be a float array \(48,\); received float32 \(64,\) "
     r"\(dim = 48 as in `x`\)\.$"),
]


@pytest.mark.parametrize("build, call, message", [row[1:] for row in TABLE],
                         ids=[row[0] for row in TABLE])
def test_wrong_call_message(build, call, message):
    with pytest.raises(ShapeError, match=message) as caught:
        call(build())
    assert str(caught.value).count("\n") <= 2
    assert "Type-check error" in caught.value.details  # jaxtyping's report, kept


def test_shape_error_is_jaxtypings_error():
    """Code that caught jaxtyping's (or a TypeError) still does."""
    assert issubclass(ShapeError, jaxtyping.TypeCheckError) and issubclass(ShapeError, TypeError)


def test_the_switch():
    norm = nn.RMSNorm(64)
    assert vidax_eqx.shape_checks_enabled()
    vidax_eqx.set_shape_checks(False)
    try:
        with pytest.raises(Exception) as caught:  # noqa: PT011  (whatever trips first)
            norm(f32(32, 48))
        assert not isinstance(caught.value, ShapeError)
    finally:
        vidax_eqx.set_shape_checks(True)
    with pytest.raises(ShapeError):
        norm(f32(32, 48))
    with pytest.raises(TypeError, match=r"set_shape_checks takes a bool; received 0"):
        vidax_eqx.set_shape_checks(0)
