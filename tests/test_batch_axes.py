"""`models.run_sharded` with the batch split over several mesh axes: `batch_axis` a tuple
of mesh axis names, the batch over their product, the first outermost (as in
`PartitionSpec(("cfg", "dp"))`), so that classifier-free guidance's halves (over `cfg`)
combine with data parallelism (over `dp`).

On 8 simulated CPU devices (`cfg` 2 x `dp` 2 x `sp` 2), a tiny random Wan (the `t2v`
fixture's weights, perturbed) on a batch of 8 (2 examples per device):

1. the batch over ("cfg", "dp") with Ulysses over sp equals one device (float32 tolerance,
   relative to the output's largest magnitude), and the output is laid out as
   `P(("cfg", "dp"))` says: the `cfg` index 0 devices hold the first half of the batch;
2. with FSDP over ("dp", "sp") too; an FSDP axis that is any of the batch axes carries
   data (`cfg` is accepted with the batch over ("cfg", "dp"), refused with it over "dp");
3. `WanExperts` (two perturbed copies) routes a batch that agrees, one that mixes on
   every device, and one whose `cfg` halves each agree but differ;
4. bad inputs raise `ValueError`s: an axis not in the mesh (named, with the mesh's axes),
   an axis named twice, an empty tuple, a batch not a multiple of the devices.

A single string keeps its meaning: tests/test_wan.py, test_wan22.py and test_fsdp.py.
"""

import functools
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import harness
import oracle
from vidax_eqx import models, nn


FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "wan"
RTOL = oracle.tolerance(np.float32)  # relative to the output's largest magnitude
MESH = dict(dp=2, sp=2, cfg=2)
BATCH_AXES = ("cfg", "dp")
B = 8  # 2 examples per device of cfg x dp
VIDEO = (4, 2, 4, 4)  # patch grid 2 x 2 x 2 = 8 tokens
ULYSSES = dict(sequence="ulysses")
BOUNDARY = 0.875
JIT = functools.partial(eqx.filter_jit, compiler_options=harness.FAST_COMPILE)


def _wan(seed: int):
    model = models.WanTransformer3D.from_pretrained(FIXTURES / "t2v" / "diffusers")
    return harness.perturbed(model, seed)


@JIT
def _single(model, x, t, c):
    return jax.vmap(lambda x, t, c: model(x, t, c))(x, t, c)


@JIT
def _sharded(model, x, t, c, *, mesh, batch_axis):
    return models.run_sharded(model, x, t, c, mesh=mesh, batch_axis=batch_axis)


@pytest.fixture(scope="module")
def inputs():
    """`(model, (x, t, c))`: a random Wan and a batch of 8 with different timesteps."""
    model = _wan(1)
    rng = np.random.default_rng(2)
    x = jnp.asarray(harness.normal(rng, (B, *VIDEO)))
    c = jnp.asarray(harness.normal(rng, (B, 5, model.config.text_dim)))
    t = jnp.asarray(rng.uniform(0, 1000, B), jnp.float32)
    return model, (x, t, c)


def _run(model, args, config, batch_axis=BATCH_AXES):
    mesh = harness.mesh(**MESH)
    placed = nn.sharding.shard_module(nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(**config)), mesh)
    return _sharded(placed, *args, mesh=mesh, batch_axis=batch_axis)


# -- 1, 2. equal to one device -----------------------------------------------------------


@pytest.mark.parametrize("config", [ULYSSES, dict(ULYSSES, fsdp_axes=("dp", "sp"))],
                         ids=["ulysses", "fsdp-dp-sp"])
def test_batch_over_two_axes_equals_one_device(inputs, config):
    model, args = inputs
    out = _run(model, args, config)
    want = _single(model, *args)
    assert out.shape == (B, *VIDEO)
    assert harness.max_rel_error(out, want) < RTOL


def test_first_batch_axis_is_outermost(inputs):
    model, args = inputs
    mesh = harness.mesh(**MESH)
    out = _run(model, args, ULYSSES)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(BATCH_AXES)), out.ndim)
    cfg, dp = (mesh.axis_names.index(a) for a in BATCH_AXES)
    coords = {d: i for i, d in np.ndenumerate(mesh.devices)}
    per_device = B // (mesh.shape["cfg"] * mesh.shape["dp"])
    for shard in out.addressable_shards:
        at = coords[shard.device]
        first = (at[cfg] * mesh.shape["dp"] + at[dp]) * per_device
        assert shard.index[0] == slice(first, first + per_device), (at, shard.index)


def test_fsdp_axis_among_the_batch_axes_carries_data(inputs):
    model, args = inputs
    mesh = harness.mesh(**MESH)
    fsdp = nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(**ULYSSES, fsdp_axes=("cfg",)))
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    run = lambda batch_axis: eqx.filter_eval_shape(  # noqa: E731
        lambda m, *a: models.run_sharded(m, *a, mesh=mesh, batch_axis=batch_axis), fsdp, *shapes)
    assert run(BATCH_AXES).shape == (B, *VIDEO)  # traced, not compiled
    with pytest.raises(ValueError, match=r"FSDP axis 'cfg' .* carries neither the batch"):
        run("dp")


# -- 3. the experts of Wan 2.2 -----------------------------------------------------------


# 8 examples, 2 per device in the order cfg x dp: all high noise (the boundary itself
# included), all low, mixed on every device, and the cfg halves each agreeing but not
# with each other.
BATCHES = {
    "high": (950.0, 900.0, 875.0, 999.0, 880.0, 960.0, 1000.0, 910.0),
    "low": (300.0, 874.0, 0.0, 500.0, 10.0, 600.0, 874.5, 100.0),
    "mixed": (950.0, 300.0, 100.0, 900.0, 875.0, 874.0, 20.0, 990.0),
    "cfg-halves": (950.0, 900.0, 875.0, 999.0, 300.0, 100.0, 0.0, 500.0),
}


@pytest.fixture(scope="module")
def experts(inputs):
    """`(experts placed on the mesh, each expert's output on one device for every batch
    of timesteps)`."""
    _, (x, _, c) = inputs
    e = models.WanExperts(_wan(11), _wan(13), BOUNDARY)
    mesh = harness.mesh(**MESH)
    placed = nn.sharding.shard_module(nn.sharding.with_parallel(e, nn.sharding.ParallelConfig(**ULYSSES)), mesh)
    outputs = {name: tuple(np.asarray(_single(m, x, jnp.asarray(t), c)) for m in e.experts)
               for name, t in BATCHES.items()}
    return placed, outputs


@pytest.mark.parametrize("batch", BATCHES)
def test_experts_route_a_batch_over_two_axes(inputs, experts, batch):
    _, (x, _, c) = inputs
    placed, outputs = experts
    t = np.asarray(BATCHES[batch], np.float32)
    high, low = outputs[batch]
    want = np.where((t >= BOUNDARY * 1000).reshape(-1, 1, 1, 1, 1), high, low)
    out = _sharded(placed, x, jnp.asarray(t), c, mesh=harness.mesh(**MESH),
                   batch_axis=BATCH_AXES)
    assert harness.max_rel_error(out, want) < RTOL
    assert harness.max_rel_error(high, low) > 1e-2  # the experts differ


# -- 4. bad inputs -----------------------------------------------------------------------


@pytest.mark.parametrize("batch_axis, batch, message", [
    (("cfg", "data"), B, r"every axis of `batch_axis` must be an axis of the mesh "
                         r"\('dp', 'sp', 'cfg', 'tp'\); 'data' \(of batch_axis=\('cfg', 'data'\)\)"),
    ("data", B, r"must be an axis of the mesh .*; 'data' \(of batch_axis='data'\) is not"),
    (("dp", "cfg", "dp"), B, r"must be distinct; received batch_axis=\('dp', 'cfg', 'dp'\), "
                             r"which repeats 'dp'"),
    ((), B, r"a non-empty tuple of them, or None; received \(\)"),
    (BATCH_AXES, 6, r"size of `batch_axis` \('cfg', 'dp'\): 'cfg' \(2\) x 'dp' \(2\) = 4; "
                    r"received a batch of 6"),
    (("cfg", "dp", "sp"), 4, r"= 8; received a batch of 4"),
], ids=["missing", "missing-string", "duplicate", "empty", "indivisible", "indivisible-3"])
def test_bad_batch_axes_raise(inputs, batch_axis, batch, message):
    model, (x, t, c) = inputs
    mesh = harness.mesh(**MESH)
    with pytest.raises(ValueError, match=message):
        models.run_sharded(model, x[:batch], t[:batch], c[:batch], mesh=mesh,
                           batch_axis=batch_axis)
