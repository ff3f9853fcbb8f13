"""One compile for any number of steps (`sample(compilation=Compilation(max_steps=...))`)
and the exported sampler (`sampling.export_sample`, `ExportedSampler.serialize` /
`deserialize`), on a tiny random Wan.

1. `Compilation(max_steps=...)`: the latents of the static loop bit for bit, for several
   step counts, from one compiled program (XLA compilations of the loop counted).
2. Export: serialized, deserialized and called, the latents of `sample` bit for bit:
   any steps up to `max_steps`, another guidance scale, a step cache (its reused
   steps), and CFG over a mesh axis on 8 simulated devices; the blob holds no weights.
3. Bad input: too many steps, guidance on the other side of 1, a model of another
   configuration, bytes that are not an exported sampler.

Cold compile against a reloaded export is timed by `benchmarks/sampler_compile.py`.
"""

import os

import jax
import numpy as np
import pytest

import harness
from vidax_eqx import models, nn, sampling


# Bit-identity between two programs (see conftest's _elemental_emitters_when_fast): XLA's
# default CPU fusion emitters.
XLA_DEFAULT_EMITTERS = True


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture(scope="module")
def model():
    path = os.path.join(FIXTURES, "wan", "t2v", "diffusers")
    return harness.perturbed(models.WanTransformer3D.from_pretrained(path), 1)


@pytest.fixture(scope="module")
def io(model):
    rng = np.random.default_rng(7)
    return dict(noise=harness.normal(rng, (1, 4, 3, 4, 6)),
                context=harness.normal(rng, (1, 6, model.config.text_dim)),
                negative_context=harness.normal(rng, (1, 6, model.config.text_dim)))


class _Compiles:
    """Counts XLA compilations of the sampler's loop (jax.monitoring)."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration" and "_loop" in kwargs.get(
                "fun_name", ""):
            self.count += 1


def _identical(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and np.array_equal(a, b), f"max |diff| {np.max(np.abs(a - b))}"


# -- 1. one compile for any number of steps ----------------------------------------------


def test_max_steps_compiles_once(model, io):
    compiles = _Compiles()
    padded = {steps: sampling.sample(model, **io, steps=steps, scheduler="euler",
                                     compilation=sampling.Compilation(max_steps=6))
              for steps in (2, 3, 6)}
    assert compiles.count == 1
    for steps, latents in padded.items():
        _identical(latents, sampling.sample(model, **io, steps=steps, scheduler="euler"))
    assert compiles.count == 4  # the static loops: one per number of steps


# -- 2. export ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(model, io):
    """UniPC (the history-carrying scheduler), up to 5 steps, reloaded from bytes."""
    blob = sampling.export_sample(model, **io, steps=3,
                                  compilation=sampling.Compilation(max_steps=5)).serialize()
    return blob, sampling.ExportedSampler.deserialize(blob)


def test_export_round_trip(model, io, exported):
    blob, sampler = exported
    n_weights = sum(a.nbytes for a in jax.tree.leaves(model) if hasattr(a, "nbytes"))
    assert len(blob) < n_weights  # the program only: the weights come with each call
    assert sampler.max_steps == 5
    for steps in (3, 5):
        _identical(sampler(model, **io, steps=steps), sampling.sample(model, **io, steps=steps))
    guidance = sampling.Guidance(scale=7.5)
    _identical(sampler(model, **io, steps=4, guidance=guidance),
               sampling.sample(model, **io, steps=4, guidance=guidance))


def test_export_step_cache(model, io):
    """A step cache exported; with the deprecated `return_reused=True` the program
    returns each step's decision, those a progress callback sees."""
    caching = sampling.Caching(step=sampling.FirstBlockCache(1.5))
    sampler = sampling.ExportedSampler.deserialize(sampling.export_sample(
        model, **io, steps=5, caching=caching).serialize())
    ref, ref_reused = harness.sample_reused(model, **io, steps=5, caching=caching)
    _identical(sampler(model, **io), ref)
    with pytest.warns(DeprecationWarning, match=r"return_reused"):
        old = sampling.export_sample(model, **io, steps=5, caching=caching, return_reused=True)
    out, reused = sampling.ExportedSampler.deserialize(old.serialize())(model, **io)
    _identical(out, ref)
    _identical(reused, ref_reused)


def test_export_cfg_over_a_mesh(model, io):
    mesh = harness.mesh(dp=2, sp=2, tp=2)
    sharded = nn.sharding.shard_module(nn.sharding.with_parallel(
        model, nn.sharding.ParallelConfig(sequence="ulysses", tp_axis="tp")), mesh)
    kwargs = dict(steps=2, scheduler="euler",
                  placement=sampling.Placement(mesh=mesh, cfg_axis="dp"))
    sampler = sampling.ExportedSampler.deserialize(
        sampling.export_sample(sharded, **io, **kwargs).serialize())
    _identical(sampler(sharded, **io), sampling.sample(sharded, **io, **kwargs))
    with pytest.raises(ValueError, match="mesh"):
        sampler(model, **io)  # not placed on the mesh


# -- 3. bad input ------------------------------------------------------------------------


def test_bad_input(model, io, exported):
    _, sampler = exported
    with pytest.raises(ValueError, match="max_steps"):
        sampler(model, **io, steps=6)
    with pytest.raises(ValueError, match="guidance"):
        sampler(model, **io, guidance=sampling.Guidance(scale=1.0))
    other = nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(sequence="ulysses"))
    with pytest.raises(ValueError, match="exported for"):
        sampler(other, **io)
    with pytest.raises(ValueError, match="not an exported sampler"):
        sampling.ExportedSampler.deserialize(b"\x04" + b"\x00" * 7 + b"nope")
    with pytest.raises(ValueError, match="max_steps"):
        sampling.sample(model, **io, steps=4, compilation=sampling.Compilation(max_steps=3))
    fixed = sampling.export_sample(model, **io, steps=2, scheduler="euler")
    with pytest.raises(ValueError, match="exported 2"):
        fixed(model, **io, steps=3)
