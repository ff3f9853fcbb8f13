"""`sampling.sample`, the whole denoising loop, against diffusers' `WanPipeline`.

The fixtures under `tests/fixtures/sampler/` come from `scripts/make_sampler_fixtures.py`
(run by hand with torch + diffusers): `WanPipeline(output_type="latent")` around the
tiny random transformers of `tests/fixtures/wan/` (`t2v`, and the two experts of
`a14b`), with fixed noise and prompt embeddings, guidance 5.0, and
`CogVideoXPipeline` around `tests/fixtures/cogvideox/2b`. Here, without torch:

1. the final latents equal diffusers' within 1e-4 relative, for `FlowMatchEuler` and
   `UniPC` at 4 and 20 steps, for Wan 2.2 A14B's experts with `guidance_scale_2`, and
   for `CogVideoXPipeline` (DDIM at 4 and 20 steps, dynamic guidance);
2. the loop is one compiled program: a while loop in the HLO whose size does not grow
   with the number of steps, traced once for new inputs of the same shapes;
3. sharded on 8 simulated devices (Ulysses x TP with the guided batch whole, and the
   conditional and unconditional halves over a `cfg` axis) equal to one device;
4. bad inputs raise a ValueError naming the argument.
"""

import os
import re
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
from vidax_eqx import models, nn, sampling


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
PARITY = 1e-4  # the bound: final latents relative to their largest magnitude
SHARDED = 1e-5
SCHEDULERS = {"euler": sampling.FlowMatchEuler(shift=3.0), "unipc": sampling.UniPC(shift=3.0)}


def _io(name):
    return dict(np.load(os.path.join(FIXTURES, "sampler", f"{name}.npz")))


@pytest.fixture(scope="module")
def t2v():
    return models.WanTransformer3D.from_pretrained(os.path.join(FIXTURES, "wan", "t2v", "diffusers"))


@pytest.fixture(scope="module")
def io():
    return _io("wan_t2v")


def _sample(model, io, **kwargs):
    return sampling.sample(model, io["noise"], io["context"],
                           negative_context=io["negative_context"], **kwargs)


@pytest.fixture(scope="module")
def unipc4(t2v, io):
    """One device, UniPC, 4 steps: the reference of the sharded runs."""
    return _sample(t2v, io, steps=4, scheduler=SCHEDULERS["unipc"])


# -- 1. diffusers ------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [4, 20])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_matches_diffusers(t2v, io, unipc4, name, steps):
    ref = io[f"{name}_s{steps}"]
    out = unipc4 if (name, steps) == ("unipc", 4) else _sample(
        t2v, io, steps=steps, scheduler=SCHEDULERS[name])
    assert out.shape == ref.shape and out.dtype == jnp.float32
    assert harness.max_rel_error(out, ref) < PARITY


def test_default_scheduler_is_unipc(t2v, io, unipc4):
    out = sampling.sample(t2v, io["noise"], io["context"], negative_context=io["negative_context"],
                          steps=4, scheduler="unipc")
    assert harness.same_arrays(out, unipc4)


def test_experts_match_diffusers():
    """Wan 2.2 A14B: the high-noise expert with guidance 5.0 while t >= 875, then the
    low-noise one with guidance_scale_2 3.0 (4 steps: timesteps 999, 900, 750, 500)."""
    io = _io("wan_a14b")
    experts = models.WanExperts.from_pretrained(os.path.join(FIXTURES, "wan", "a14b", "diffusers"))
    out = _sample(experts, io, steps=4, guidance=sampling.Guidance(scale=5.0, scale_2=3.0))
    assert harness.max_rel_error(out, io["unipc_s4"]) < PARITY


@pytest.mark.parametrize("name, steps, dynamic", [
    ("ddim_s4", 4, False), ("ddim_s20", 20, False), ("ddim_dynamic_s4", 4, True)])
def test_cogvideox_matches_diffusers(name, steps, dynamic):
    """CogVideoXPipeline: latents (B, F, C, H, W), CogVideoXDDIM (v-prediction), guidance
    6.0, and its dynamic guidance."""
    io = _io("cogvideox_2b")
    model = models.CogVideoXTransformer3D.from_pretrained(
        os.path.join(FIXTURES, "cogvideox", "2b", "diffusers"))
    out = _sample(model, io, steps=steps, guidance=sampling.Guidance(scale=6.0, dynamic=dynamic),
                  scheduler="cogvideox_ddim")
    assert harness.max_rel_error(out, io[name]) < PARITY


# -- 2. one compiled loop ----------------------------------------------------------------


def test_one_compiled_loop(t2v, io):
    traces = []

    @eqx.filter_jit
    def run(model, noise, context, negative_context, steps):
        traces.append(steps)
        return sampling.sample(model, noise, context, negative_context=negative_context,
                               steps=steps, scheduler=SCHEDULERS["euler"])

    args = (t2v, io["noise"], io["context"], io["negative_context"])
    hlo = {s: run.lower(*args, s).as_text() for s in (4, 20)}
    assert "while" in hlo[4]
    # Not unrolled: the same program but for the plan's length.
    assert len(re.findall(r"\bwhile\b", hlo[4])) == len(re.findall(r"\bwhile\b", hlo[20]))
    assert abs(len(hlo[20]) - len(hlo[4])) < 0.01 * len(hlo[4])
    assert traces == [4, 20]
    out = run(*args, 4)
    assert harness.max_rel_error(out, io["euler_s4"]) < PARITY
    rng = np.random.default_rng(1)
    other = [rng.standard_normal(a.shape).astype(np.float32) for a in args[1:]]
    out2 = run(t2v, *other, 4)
    assert traces == [4, 20]  # both calls ran the program lowered above: no new trace
    assert not np.allclose(out, out2)


# -- 3. sharded --------------------------------------------------------------------------


def test_sharded_sp_tp_equals_one_device(t2v, io, unipc4):
    mesh = harness.mesh(sp=4, tp=2)
    model = nn.sharding.shard_module(
        nn.sharding.with_parallel(t2v, nn.sharding.ParallelConfig(sequence="ulysses", tp_axis="tp")), mesh)
    out = _sample(model, io, steps=4, scheduler=SCHEDULERS["unipc"],
                  placement=sampling.Placement(mesh=mesh))
    assert harness.max_rel_error(out, unipc4) < SHARDED


def test_cfg_axis_with_batch_axis_equals_one_device(t2v, io, unipc4):
    # The guided batch [cond; uncond] over (cfg, dp): each half's 2 examples over dp.
    mesh = harness.mesh(dp=2, sp=2, cfg=2)
    model = nn.sharding.shard_module(nn.sharding.with_parallel(t2v, nn.sharding.ParallelConfig(sequence="ulysses")), mesh)
    out = _sample(model, io, steps=4, scheduler=SCHEDULERS["unipc"],
                  placement=sampling.Placement(mesh=mesh, cfg_axis="cfg", batch_axis="dp"))
    assert harness.max_rel_error(out, unipc4) < SHARDED


# -- 4. bad inputs -----------------------------------------------------------------------


def _bad(io, **changes):
    kwargs = dict(noise=io["noise"], context=io["context"],
                  negative_context=io["negative_context"], steps=4)
    kwargs.update(changes)
    return kwargs


@pytest.mark.parametrize("changes, match", [
    (dict(noise=np.zeros((2, 3, 3, 6, 10), np.float32)), "`noise` must have the model's 4"),
    (dict(noise=np.zeros((2, 4, 3, 5, 10), np.float32)), "multiples of the model's patch size"),
    (dict(noise=np.zeros((4, 3, 6, 10), np.float32)), r"`noise` must be the initial latents"),
    (dict(context=np.zeros((2, 7, 16), np.float32)), r"`context` must be .* = \(2, L, 32\)"),
    (dict(context=np.zeros((1, 7, 32), np.float32)), r"`context` must be"),
    (dict(negative_context=np.zeros((2, 5, 32), np.float32)), "`negative_context` must have"),
    (dict(negative_context=None), "`negative_context` is required"),
    (dict(guidance=sampling.Guidance(scale_2=3.0)), "`guidance.scale_2`"),
    (dict(guidance="5"), "`guidance` must be a sampling.Guidance"),
    (dict(steps=0), "`steps`"),
    (dict(steps=2.0), "`steps`"),
    (dict(scheduler="ddpm"), "`scheduler` must be"),
    (dict(scheduler=sampling.CogVideoXDPM()), "`key`"),
    (dict(placement=sampling.Placement(cfg_axis="cfg")),
     "`placement.batch_axis` and `placement.cfg_axis` name axes of `placement.mesh`"),
    (dict(compilation=sampling.Compilation(max_steps=3)), "`compilation.max_steps`"),
    (dict(progress="yes"), "`progress` must be"),
])
def test_bad_inputs(t2v, io, changes, match):
    with pytest.raises(ValueError, match=match):
        sampling.sample(t2v, **_bad(io, **changes))


@pytest.mark.parametrize("make, match", [
    (lambda: sampling.Guidance(scale=-1.0), "`scale`"),
    (lambda: sampling.Guidance(scale=float("nan")), "`scale`"),
    (lambda: sampling.Guidance(scale_2=-2.0), "`scale_2`"),
    (lambda: sampling.Guidance(dynamic=1), "`dynamic`"),
    (lambda: sampling.Placement(mesh="sp"), "`mesh` must be a jax.sharding.Mesh"),
    (lambda: sampling.Caching(text=1), "`text`"),
    (lambda: sampling.Caching(step=0.1), "`step` must be None, a sampling.StaticStepCache"),
    (lambda: sampling.Compilation(max_steps=0), "`max_steps`"),
])
def test_bad_options(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("mesh_axes, placement, changes, match", [
    (dict(sp=8), dict(cfg_axis="cfg"), {}, "`placement.cfg_axis` must be an axis of size 2"),
    (dict(sp=2, cfg=4), dict(cfg_axis="cfg"), {},
     "`placement.cfg_axis` must be an axis of size 2"),
    (dict(sp=4, cfg=2), dict(cfg_axis="cfg"),
     dict(guidance=sampling.Guidance(scale=1.0), negative_context=None), "no guidance"),
    (dict(dp=8), dict(batch_axis="dp"), {}, "multiple of the size of `placement.batch_axis`"),
    (dict(sp=8), dict(batch_axis="data"), {}, "`placement.batch_axis` must be an axis"),
])
def test_bad_mesh(t2v, io, mesh_axes, placement, changes, match):
    placement = sampling.Placement(mesh=harness.mesh(**mesh_axes), **placement)
    with pytest.raises(ValueError, match=match):
        sampling.sample(t2v, **_bad(io, placement=placement, **changes))


# -- 5. progress -------------------------------------------------------------------------


def test_progress_callback_per_call(t2v, io):
    """Each call's own callback, told every step once, in order, as Python values; the
    latents bit for bit those of a call without one (the steps then run one compiled call
    at a time)."""
    steps = []
    out = sampling.sample(t2v, io["noise"], io["context"], steps=3, scheduler="euler",
                          guidance=sampling.Guidance(scale=1.0), progress=steps.append)
    assert [(s.step, s.steps, s.reused) for s in steps] == [(0, 3, None), (1, 3, None),
                                                             (2, 3, None)]
    assert all(type(s.step) is int and type(s.steps) is int for s in steps)
    again = sampling.sample(t2v, io["noise"], io["context"], steps=3, scheduler="euler",
                            guidance=sampling.Guidance(scale=1.0))
    assert harness.same_arrays(out, again)


def test_progress_lines(capsys):
    """`ProgressLines`: the first step, every `every` and the last, with the elapsed time
    and an estimate of the rest."""
    lines = sampling.ProgressLines(every=2, file=sys.stdout)
    lines.begin(5)
    for i in range(5):
        lines(sampling.SampleStep(i, 5, None))
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in out] == ["1/5", "2/5", "4/5", "5/5"], out
    assert all(re.fullmatch(r"denoise  step \d/5  elapsed \d+\.\d s(  remaining ~\d+\.\d s)?",
                            line) for line in out), out
    assert "remaining" in out[1] and "remaining" not in out[-1]
