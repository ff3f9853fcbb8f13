"""Wan 2.2 (a timestep per token, TI2V-5B, the two experts of A14B) and Wan 2.1 FLF2V
against diffusers: outputs and gradients.

The fixtures under `tests/fixtures/wan/` come from `scripts/make_wan_fixtures.py` (run by
hand with torch + diffusers 0.42.1): tiny random diffusers models (2 layers, width 32,
4 heads of 8) in diffusers' and Wan's layouts, with inputs, diffusers' float32 outputs, a
random cotangent, and diffusers' gradients of `sum(out * cotangent)` with respect to the
input and to every parameter (`grads*.safetensors`, diffusers' names). Here, without
torch:

1. `t2v_token_timestep` (a per-token timestep `(S,)`: TI2V's pattern, and random),
   `ti2v` (48 channels, per-token timesteps) and `flf2v` (the image position embedding
   over the first and the last frame's features) in both layouts match diffusers: the
   output (rtol 1e-5 of its scale), and the gradient with respect to `x` and to every
   parameter (each within 1e-5 of its tensor's largest magnitude); both layouts load
   the same arrays; a per-token timestep of one value is the scalar timestep, and one of
   the wrong length raises;
2. A14B in both layouts (diffusers' pipeline directory, Wan 2.2's `high_noise_model/`
   with two shards and `low_noise_model/`): the boundary 0.875 of 1000 steps, each
   example routed as diffusers' `WanPipeline` routes it (875 exactly is high noise),
   each expert alone, and each expert's gradients;
3. the sharded run (`models.run_sharded`, 8 simulated devices) with per-token
   timesteps split like the tokens, FLF2V, and the experts on a batch that mixes them
   or agrees.
"""

import functools
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import harness
import oracle
from vidax_eqx import models, nn


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "wan")
RTOL = oracle.tolerance(np.float32)  # relative to the output's (or tensor's) largest magnitude
SINGLE = ("t2v_token_timestep", "ti2v", "flf2v")
LAYOUTS = ("diffusers", "wan")
# Whole models forward and backward: XLA's quick compile (harness.FAST_COMPILE) halves the time.
_jit = functools.partial(eqx.filter_jit, compiler_options=harness.FAST_COMPILE)


def _io(name):
    return harness.load_io(os.path.join(FIXTURES, name, "io.npz"))


def _kwargs(io):
    return {"context_image": io["context_image"]} if "context_image" in io else {}


def _batched(model, x, timestep, context, **kwargs):
    return jax.vmap(lambda x, t, c, **k: model(x, t, c, **k))(x, timestep, context, **kwargs)


_single = _jit(_batched)


@_jit
def _with_grads(model, x, timestep, context, cotangent, **kwargs):
    """`(out, grad_x, grads)`: the batched output, and the gradients of
    `sum(out * cotangent)` with respect to `x` and to the model (a model-shaped tree)."""

    def loss(diff):
        model, x = diff
        out = _batched(model, x, timestep, context, **kwargs)
        return jnp.sum(out * cotangent), out

    (grads, grad_x), out = eqx.filter_grad(loss, has_aux=True)((model, x))
    return out, grad_x, grads


@_jit
def _with_input_grad(model, x, timestep, context, cotangent):
    """`(out, grad_x)` alone (the model's arrays held constant: no parameter gradients)."""
    out, vjp = jax.vjp(lambda x: _batched(model, x, timestep, context), x)
    return out, vjp(cotangent)[0]


def _check_grads(grads, path):
    """Every parameter's gradient against diffusers' (`path`, diffusers' names), each
    relative to its tensor's largest magnitude; returns the largest of those errors."""
    ref = load_file(path)
    got = grads.state_dict(layout="diffusers")
    assert set(got) == set(ref)
    errors = {name: harness.max_rel_error(got[name], ref[name]) for name in ref}
    worst = max(errors, key=errors.get)
    assert errors[worst] < RTOL, (worst, errors[worst])
    return errors[worst]


# -- 1. the single models ----------------------------------------------------------------


@pytest.fixture(scope="module", params=[(n, l) for n in SINGLE for l in LAYOUTS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def single(request):
    """`(name, io, (out, grad_x, grads))`: one forward and backward per model and layout."""
    name, layout = request.param
    io = _io(name)
    model = models.WanTransformer3D.from_pretrained(os.path.join(FIXTURES, name, layout))
    return name, io, _with_grads(model, io["x"], io["timestep"], io["context"], io["cotangent"],
                                 **_kwargs(io))


def test_fixture_timesteps():
    # The inputs the tests rely on: TI2V's pattern (first latent frame clean) and random.
    for name, grid in (("t2v_token_timestep", (3, 3, 5)), ("ti2v", (3, 2, 3))):
        t = np.asarray(_io(name)["timestep"])
        per_frame = grid[1] * grid[2]
        assert t.shape == (2, np.prod(grid))
        assert (t[0, :per_frame] == 0).all() and (t[0, per_frame:] == 700).all()
        assert len(np.unique(t[1])) == t.shape[1] and (0 <= t[1]).all() and (t[1] < 1000).all()
    flf2v = _io("flf2v")
    assert flf2v["context_image"].shape == (2, 10, 24) and flf2v["timestep"].shape == (2,)


def test_matches_diffusers(single):
    name, io, (out, _, _) = single
    assert out.shape == io["out"].shape and out.dtype == jnp.float32
    assert harness.max_rel_error(out, io["out"]) < RTOL


def test_input_gradient_matches_diffusers(single):
    _, io, (_, grad_x, _) = single
    assert grad_x.shape == io["x"].shape
    assert harness.max_rel_error(grad_x, io["grad_x"]) < RTOL


def test_parameter_gradients_match_diffusers(single):
    name, _, (_, _, grads) = single
    _check_grads(grads, os.path.join(FIXTURES, name, "grads.safetensors"))


def test_layouts_load_the_same_model():
    for name in SINGLE:
        diffusers, wan = (models.WanTransformer3D.from_pretrained(os.path.join(FIXTURES, name, l))
                          for l in LAYOUTS)
        assert harness.same_arrays(diffusers, wan), name
    flf2v = models.WanTransformer3D.from_pretrained(os.path.join(FIXTURES, "flf2v", "wan"))
    assert flf2v.config.pos_embed_seq_len == 10 and flf2v.config.image_dim == 24
    ti2v = models.WanTransformer3D.from_pretrained(os.path.join(FIXTURES, "ti2v", "wan"))
    assert ti2v.config.image_dim is None
    assert (ti2v.config.in_channels, ti2v.config.out_channels) == (48, 48)


def test_per_token_timestep_of_one_value_is_the_scalar():
    # A per-token timestep whose tokens agree is the scalar timestep (diffusers' two paths).
    io = _io("ti2v")
    model = models.WanTransformer3D.from_pretrained(os.path.join(FIXTURES, "ti2v", "diffusers"))
    t = jnp.array([700.0, 37.5])
    tokens = jnp.broadcast_to(t[:, None], io["timestep"].shape)
    scalar, per_token = _single(model, io["x"], t, io["context"]), _single(model, io["x"], tokens, io["context"])
    assert harness.max_rel_error(per_token, scalar) < RTOL


def test_per_token_timestep_of_the_wrong_length_raises():
    io = _io("ti2v")
    model = models.WanTransformer3D.from_pretrained(os.path.join(FIXTURES, "ti2v", "diffusers"))
    with pytest.raises(ValueError, match="timestep"):
        model(io["x"][0], io["timestep"][0][:-1], io["context"][0])


# -- 2. A14B: two experts -----------------------------------------------------------------


@pytest.fixture(scope="module", params=LAYOUTS)
def a14b(request):
    return models.WanExperts.from_pretrained(os.path.join(FIXTURES, "a14b", request.param))


def test_experts_loaded(a14b):
    assert a14b.boundary == 0.875 and a14b.num_train_timesteps == 1000
    root = os.path.join(FIXTURES, "a14b", "diffusers")
    for expert, folder in ((a14b.high_noise, "transformer"), (a14b.low_noise, "transformer_2")):
        assert harness.same_arrays(
            expert, models.WanTransformer3D.from_pretrained(os.path.join(root, folder)))


def test_experts_route_as_diffusers(a14b):
    # 950 and 875 (exactly the boundary: t >= 0.875 * 1000) are high noise, 300 low noise.
    io = _io("a14b")
    out = _single(a14b, io["x"], io["timestep"], io["context"])
    assert harness.max_rel_error(out, io["out"]) < RTOL
    for i in range(3):  # one example per call, the way a sampler calls it
        one = _jit(a14b)(io["x"][i], io["timestep"][i], io["context"][i])
        assert harness.max_rel_error(one, io["out"][i]) < RTOL


@pytest.mark.parametrize("expert", ["high", "low"])
def test_each_expert_matches_diffusers(a14b, expert):
    io = _io("a14b")
    model = a14b.high_noise if expert == "high" else a14b.low_noise
    out, grad_x, grads = _with_grads(model, io["x"], io["timestep"], io["context"], io["cotangent"])
    assert harness.max_rel_error(out, io[f"out_{expert}"]) < RTOL
    assert harness.max_rel_error(grad_x, io[f"grad_x_{expert}"]) < RTOL
    _check_grads(grads, os.path.join(FIXTURES, "a14b", f"grads_{expert}.safetensors"))


def test_routed_input_gradient(a14b):
    io = _io("a14b")
    out, grad_x = _with_input_grad(a14b, io["x"], io["timestep"], io["context"], io["cotangent"])
    assert harness.max_rel_error(out, io["out"]) < RTOL
    assert harness.max_rel_error(grad_x, io["grad_x"]) < RTOL


# -- 3. sharded ---------------------------------------------------------------------------


# mesh axes, ParallelConfig, batch axis; 4 heads: Ulysses x TP splits at most 4 ways.
_CONFIGS = {
    "ulysses-sp4": (dict(sp=4), dict(sequence="ulysses"), None),
    "ring-zigzag-sp4-tp2": (dict(sp=4, tp=2), dict(sequence="ring", layout="zigzag", tp_axis="tp"), None),
    "usp-zigzag-2x2-tp2": (dict(sp=2, tp=2, ring=2),
                           dict(sequence="usp", ring_axis="ring", layout="zigzag", tp_axis="tp"), None),
    "dp2-ulysses-sp2-tp2": (dict(dp=2, sp=2, tp=2), dict(sequence="ulysses", tp_axis="tp"), "dp"),
}


def _sharded(model, config):
    mesh_axes, parallel, batch_axis = _CONFIGS[config]
    mesh = harness.mesh(**mesh_axes)
    model = nn.sharding.shard_module(nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(**parallel)), mesh)
    run = _jit(lambda m, *a, **k: models.run_sharded(m, *a, mesh=mesh, batch_axis=batch_axis, **k))
    return model, run


@pytest.mark.parametrize("name, config", [
    ("t2v_token_timestep", "ring-zigzag-sp4-tp2"),  # 45 tokens: padded to 48, zigzag order
    ("t2v_token_timestep", "dp2-ulysses-sp2-tp2"),  # (B, S) timestep split over dp too
    ("ti2v", "usp-zigzag-2x2-tp2"),
    ("flf2v", "ulysses-sp4"),
])
def test_sharded_matches_diffusers(name, config):
    io = _io(name)
    model, run = _sharded(models.WanTransformer3D.from_pretrained(os.path.join(FIXTURES, name, "diffusers")),
                          config)
    out = run(model, io["x"], io["timestep"], io["context"], **_kwargs(io))
    assert harness.max_rel_error(out, io["out"]) < RTOL


def test_sharded_experts():
    io = _io("a14b")
    experts = models.WanExperts.from_pretrained(os.path.join(FIXTURES, "a14b", "wan"))
    model, run = _sharded(experts, "ulysses-sp4")
    x, c = io["x"], io["context"]
    assert harness.max_rel_error(run(model, x, io["timestep"], c), io["out"]) < RTOL  # mixed
    # A batch that agrees runs one expert: the same program, other timesteps.
    for t, expert in (([950.0, 875.0, 900.0], experts.high_noise),
                      ([300.0, 0.0, 874.0], experts.low_noise)):
        t = jnp.array(t)
        assert harness.max_rel_error(run(model, x, t, c), _single(expert, x, t, c)) < RTOL
