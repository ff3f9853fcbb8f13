"""`parallel.sequence_attention`, the one sequence-parallel entry: each role of the mesh
axes (none, Ulysses, ring, both) with a joint text before or after the video and its
key-only padding, against the float64 oracle, forward and gradients with a random
cotangent; on one device (no axis) the text padding is hidden there too. And the errors
it adds to the functions it calls.

Tiny shapes, one compile per configuration.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import oracle
from vidax_eqx import kernels, parallel


SP, TP, RING = parallel.SP_AXIS, parallel.TP_AXIS, "ring"
B, T, V, H, H_KV, D = 2, 3, 16, 4, 2, 8  # V: global video tokens
TEXT_LENGTHS = np.array([1, 3], np.int32)


@dataclasses.dataclass(frozen=True)
class Case:
    roles: str  # "ulysses" | "ring" | "usp"
    text_position: str = "prefix"
    layout: str = "contiguous"

    @property
    def axes(self) -> dict:
        return {"ulysses": dict(ulysses_axis=SP), "ring": dict(ring_axis=SP),
                "usp": dict(ulysses_axis=SP, ring_axis=RING)}[self.roles]

    @property
    def mesh_axes(self):
        return (RING, SP) if self.roles == "usp" else SP

    @property
    def n(self) -> int:
        return 8 if self.roles == "usp" else 4


def _mesh(case: Case):
    return harness.mesh(sp=2, ring=4) if case.roles == "usp" else harness.mesh(sp=4)


@functools.lru_cache(maxsize=None)
def _fn(case: Case):
    def attend(q, k, v, seg, sinks, lengths):
        return parallel.sequence_attention(
            q, k, v, **case.axes, layout=case.layout, text_len=T,
            text_position=case.text_position, text_lengths=lengths, segment_ids=seg,
            implementation="xla")

    return harness.text_joint_vjp(attend, _mesh(case), case.mesh_axes,
                                  text_position=case.text_position, lengths=True,
                                  compiler_options=harness.FAST_COMPILE)


def _reference(a: dict, text_position: str):
    seg = harness.key_only_ids(B, T + V, text_len=T, text_position=text_position,
                               text_lengths=TEXT_LENGTHS)
    return oracle.attention(a["q"], a["k"], a["v"], segment_ids=seg, dout=a["dout"])


@pytest.mark.parametrize("case", [
    Case("ulysses"),
    Case("ring", text_position="suffix", layout="zigzag"),
    Case("usp", text_position="suffix"),
], ids=lambda c: f"{c.roles}-{c.text_position}-{c.layout}")
def test_roles_match_oracle(case):
    a = harness.attention_inputs(B, T + V, H, D, H_kv=H_KV, seed=3)
    got = harness.run_text_joint(_fn(case), a, case.n, T, text_position=case.text_position,
                                 zigzag_size=4 if case.layout == "zigzag" else 0,
                                 lengths=TEXT_LENGTHS)
    harness.assert_matches(got, _reference(a, case.text_position), np.float32)
    harness.assert_copies_equal(got["out_text"])


@pytest.mark.parametrize("text_position", ["prefix", "suffix"])
def test_one_device_hides_the_text_padding(text_position):
    """No axis: one kernel call; the padded text keys are hidden (key segment ids for a
    prefix, `kv_lengths` for a suffix), every query computed."""
    a = harness.attention_inputs(B, T + V, H, D, H_kv=H_KV, seed=4)
    lengths = jnp.asarray(TEXT_LENGTHS)

    def f(q, k, v):
        return parallel.sequence_attention(q, k, v, text_len=T, text_position=text_position,
                                           text_lengths=lengths, implementation="xla")

    out, pull = jax.vjp(f, *(jnp.asarray(a[n]) for n in ("q", "k", "v")))
    got = harness.named(out, pull(jnp.asarray(a["dout"])))
    harness.assert_matches(got, _reference(a, text_position), np.float32)


def test_no_axis_is_the_kernel():
    a = harness.attention_inputs(B, V, H, D, H_kv=H_KV, seed=5)
    q, k, v = (jnp.asarray(a[n]) for n in ("q", "k", "v"))
    np.testing.assert_array_equal(parallel.sequence_attention(q, k, v, causal=True),
                                  kernels.attention(q, k, v, causal=True))


def test_errors():
    a = harness.attention_inputs(1, 8, 2, 4, seed=6)
    q = jnp.asarray(a["q"])
    with pytest.raises(ValueError, match="two different mesh axes"):
        parallel.sequence_attention(q, q, q, ulysses_axis=SP, ring_axis=SP)
    with pytest.raises(ValueError, match="text_position"):
        parallel.sequence_attention(q, q, q, text_len=2, text_position="middle")
    # Per-head windows that differ between tensor-parallel ranks, under Ulysses.
    mask = kernels.SlidingTileMask((2, 2, 4), (1, 2, 2), ((1, 1, 1), (1, 1, 1), (3, 3, 3),
                                                          (3, 3, 3)))
    mesh = harness.mesh(sp=2, tp=2)
    x = jnp.ones((1, 16, 4, 4))
    run = jax.shard_map(
        lambda x: parallel.sequence_attention(x, x, x, ulysses_axis=SP, tp_axis=TP, mask=mask),
        mesh=mesh, in_specs=P(None, SP, TP), out_specs=P(None, SP, TP))
    with pytest.raises(NotImplementedError, match="differ between tensor-parallel ranks"):
        run(x)
