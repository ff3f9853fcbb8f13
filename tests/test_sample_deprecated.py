"""The spellings `sampling.sample` (and `export_sample`, `ExportedSampler`) took before
0.2.0 keep working until 0.3.0: each old keyword warns (a `DeprecationWarning` naming
its new spelling and the release that removes it) and gives the latents of the new
spelling bit for bit, on the tiny random Wan of `tests/fixtures/wan/` (2 steps: one
compiled loop per case, shared by the two spellings).

| old keyword | new spelling |
|---|---|
| `guidance_scale`, `guidance_scale_2`, `use_dynamic_cfg` | `guidance=Guidance(scale, scale_2, dynamic)` |
| `mesh`, `batch_axis`, `cfg_axis` | `placement=Placement(mesh, batch_axis, cfg_axis)` |
| `text_cache`, `step_cache` | `caching=Caching(text, step)` |
| `max_steps` | `compilation=Compilation(max_steps)` |
| `return_reused=True` (a `(latents, reused)` tuple) | a `progress=` callback's `SampleStep.reused` |
"""

import os
import warnings

import numpy as np
import pytest

import harness
from vidax_eqx import models, nn, sampling
from vidax_eqx._deprecation import VidaxDeprecationWarning


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
NEW = {
    "guidance_scale": "`guidance=sampling.Guidance(scale=...)`",
    "guidance_scale_2": "`guidance=sampling.Guidance(scale_2=...)`",
    "use_dynamic_cfg": "`guidance=sampling.Guidance(dynamic=...)`",
    "mesh": "`placement=sampling.Placement(mesh=...)`",
    "batch_axis": "`placement=sampling.Placement(batch_axis=...)`",
    "cfg_axis": "`placement=sampling.Placement(cfg_axis=...)`",
    "text_cache": "`caching=sampling.Caching(text=...)`",
    "step_cache": "`caching=sampling.Caching(step=...)`",
    "max_steps": "`compilation=sampling.Compilation(max_steps=...)`",
    "return_reused": "a `progress=` callback (each step's `SampleStep.reused`)",
}


@pytest.fixture(scope="module")
def t2v():
    return models.WanTransformer3D.from_pretrained(os.path.join(FIXTURES, "wan", "t2v", "diffusers"))


@pytest.fixture(scope="module")
def io(t2v):
    rng = np.random.default_rng(3)
    return dict(noise=harness.normal(rng, (2, 4, 3, 4, 6)),
                context=harness.normal(rng, (2, 6, t2v.config.text_dim)),
                negative_context=harness.normal(rng, (2, 6, t2v.config.text_dim)),
                steps=2, scheduler="euler")


def _old(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` and the old keywords it warned about, each once, in order."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args, **kwargs)
    warned = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    for w in warned:
        assert issubclass(w.category, VidaxDeprecationWarning)
        assert w.filename == __file__, w.filename  # the caller's line
    names = []
    for w in warned:
        text = str(w.message)
        name = text.split("(", 1)[1].split("=", 1)[0]
        assert text == (f"{fn.__name__}({name}=...) is deprecated since vidax_eqx 0.2.0 and "
                        f"will be removed in 0.3.0: use {NEW[name]} instead."), text
        names.append(name)
    return out, names


def _identical(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and np.array_equal(a, b), f"max |diff| {np.max(np.abs(a - b))}"


def test_guidance_caching_compilation(t2v, io):
    old, warned = _old(sampling.sample, t2v, **io, guidance_scale=3.0, use_dynamic_cfg=True,
                       text_cache=False, max_steps=3)
    assert warned == ["guidance_scale", "use_dynamic_cfg", "text_cache", "max_steps"]
    new = sampling.sample(t2v, **io, guidance=sampling.Guidance(scale=3.0, dynamic=True),
                          caching=sampling.Caching(text=False),
                          compilation=sampling.Compilation(max_steps=3))
    _identical(old, new)


def test_placement(t2v, io):
    mesh = harness.mesh(dp=2, sp=2, cfg=2)
    model = nn.sharding.shard_module(nn.sharding.with_parallel(
        t2v, nn.sharding.ParallelConfig(sequence="ulysses")), mesh)
    old, warned = _old(sampling.sample, model, **io, mesh=mesh, batch_axis="dp", cfg_axis="cfg")
    assert warned == ["mesh", "batch_axis", "cfg_axis"]
    new = sampling.sample(model, **io, placement=sampling.Placement(
        mesh=mesh, batch_axis="dp", cfg_axis="cfg"))
    _identical(old, new)


def test_step_cache_and_return_reused(t2v, io):
    """`return_reused=True` returned `(latents, reused)`: still so, with a warning; the
    new spelling's callback sees the same decisions."""
    rule = sampling.StaticStepCache(reuse=(1,))
    (old, old_reused), warned = _old(sampling.sample, t2v, **io, step_cache=rule,
                                     return_reused=True)
    assert warned == ["step_cache", "return_reused"]
    new, reused = harness.sample_reused(t2v, **io, caching=sampling.Caching(step=rule))
    _identical(old, new)
    _identical(old_reused, reused)
    np.testing.assert_array_equal(reused, [False, True])


def test_guidance_scale_2():
    experts = models.WanExperts.from_pretrained(os.path.join(FIXTURES, "wan", "a14b", "diffusers"))
    rng = np.random.default_rng(4)
    c = experts.config
    io = dict(noise=harness.normal(rng, (1, c.out_channels, 3, 4, 6)),
              context=harness.normal(rng, (1, 6, c.text_dim)),
              negative_context=harness.normal(rng, (1, 6, c.text_dim)), steps=2,
              scheduler="euler")
    old, warned = _old(sampling.sample, experts, **io, guidance_scale=4.0, guidance_scale_2=2.0)
    assert warned == ["guidance_scale", "guidance_scale_2"]
    _identical(old, sampling.sample(experts, **io,
                                    guidance=sampling.Guidance(scale=4.0, scale_2=2.0)))


def test_exported_sampler_guidance_scale(t2v, io):
    """`ExportedSampler(guidance_scale=...)` and `export_sample`'s old keywords."""
    exported, warned = _old(sampling.export_sample, t2v, **io, max_steps=3)
    assert warned == ["max_steps"]
    sampler = sampling.ExportedSampler.deserialize(exported.serialize())
    with pytest.warns(VidaxDeprecationWarning, match=r"ExportedSampler\(guidance_scale=\.\.\.\) "
                      r"is deprecated .* use `guidance=sampling.Guidance\(scale=\.\.\.\)`"):
        old = sampler(t2v, **{k: v for k, v in io.items() if k != "scheduler"},
                      guidance_scale=7.0)
    new = sampler(t2v, **{k: v for k, v in io.items() if k != "scheduler"},
                  guidance=sampling.Guidance(scale=7.0))
    _identical(old, new)


def test_old_and_new_spelling_together(t2v, io):
    with pytest.raises(TypeError, match=r"got `guidance=` and the deprecated keywords "
                                        r"\['guidance_scale'\]"):
        with pytest.warns(VidaxDeprecationWarning):
            sampling.sample(t2v, **io, guidance=sampling.Guidance(scale=2.0), guidance_scale=3.0)
    with pytest.raises(ValueError, match="`return_reused` reports which steps reused"):
        with pytest.warns(VidaxDeprecationWarning):
            sampling.sample(t2v, **io, return_reused=True)
