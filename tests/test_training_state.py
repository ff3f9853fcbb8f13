"""`models.save_training_state` / `models.restore_training_state`: a sharded training
state (model arrays, AdamW state, step) saved with orbax and restored onto another mesh
and parallel configuration bit for bit, placed so that the first training step compiles
once, and the bad inputs that raise before anything is read.

One checkpoint (module fixture) is saved from FSDP over 8 devices (dp=8); the tests
restore it elsewhere: FSDP 4 x tensor parallel 2, tensor parallel without FSDP, one
device. `tests/_training_state_worker.py` does the same across two processes.
"""

import contextlib
import dataclasses
import functools
import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import harness
from vidax_eqx import models, nn


optax = pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

CONFIG = models.WanConfig(dim=64, ffn_dim=96, num_heads=8, num_layers=2, in_channels=4,
                          out_channels=4, text_dim=32, freq_dim=32)
STEP = 7
FSDP8 = nn.sharding.ParallelConfig(fsdp_axes=("dp",))
FSDP4_TP2 = nn.sharding.ParallelConfig(tp_axis="tp", fsdp_axes=("dp",))
TP2 = nn.sharding.ParallelConfig(tp_axis="tp")


def _templates(config=CONFIG):
    """Abstract `(model, AdamW state)` of a Wan of `config` (`eqx.filter_eval_shape`)."""
    optimizer = optax.adamw(1e-3)

    def init():
        model = models.WanTransformer3D(config, key=jax.random.PRNGKey(0))
        return model, optimizer.init(eqx.filter(model, eqx.is_array))

    return eqx.filter_eval_shape(init)


def _fill(tree, seed: int):
    """`tree`'s abstract arrays drawn at random, as NumPy arrays (no JAX initialization
    to compile; placing host arrays on a mesh compiles nothing): standard normal
    floats, integers in [1, 100)."""
    rng = np.random.default_rng(seed)

    def draw(x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        if jnp.issubdtype(x.dtype, jnp.integer):
            return rng.integers(1, 100, x.shape).astype(x.dtype)
        return harness.normal(rng, x.shape, x.dtype)

    return jax.tree.map(draw, tree, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def _bits(tree) -> list[bytes]:
    return [np.asarray(a).tobytes() for a in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def _shardings(tree) -> list:
    return [a.sharding for a in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def _placed(model, config, mesh):
    """`nn.sharding.shard_module(nn.sharding.with_parallel(model, config), mesh)`, by one `jax.device_put`
    (`shard_module` compiles a small program per array shape outside `jit`)."""
    model = nn.sharding.with_parallel(model, config)
    arrays, static = eqx.partition(model, eqx.is_array)
    return eqx.combine(jax.device_put(arrays, _model_shardings(model, mesh)), static)


def _model_shardings(model, mesh):
    """`NamedSharding(mesh, spec)` per array of `model`, the specs `nn.sharding.partition_specs`'."""
    specs = eqx.filter(nn.sharding.partition_specs(model, mesh), lambda s: isinstance(s, P),
                       is_leaf=lambda s: isinstance(s, P))
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda s: isinstance(s, P))


def _adamw_shardings(opt_state, model, mesh):
    """AdamW's state placed as `nn.sharding.shard_like` places it: the moments like the
    parameters, the step count replicated."""
    adam, *rest = opt_state
    params = _model_shardings(model, mesh)
    return (adam._replace(count=NamedSharding(mesh, P()), mu=params, nu=params), *rest)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The templates, the trained state (host values) and its checkpoint, saved from
    FSDP over dp=8."""
    model_t, state_t = _templates()
    model, opt_state = _fill(model_t, 1), _fill(state_t, 2)
    mesh = harness.mesh(dp=8)
    sharded = _placed(model, FSDP8, mesh)
    sharded_state = jax.device_put(opt_state, _adamw_shardings(opt_state, sharded, mesh))
    path = tmp_path_factory.mktemp("training_state") / f"step_{STEP}"
    models.save_training_state(path, sharded, sharded_state, STEP)
    return {"model_t": model_t, "state_t": state_t, "model": model, "opt_state": opt_state,
            "path": path}


def _check_restored(saved, model, opt_state, config, mesh):
    """Bit for bit the saved values, each array placed by `nn.sharding.partition_specs` (the
    optimizer's moments like their parameters, its count replicated)."""
    template = nn.sharding.with_parallel(saved["model"], config)
    assert jax.tree.structure(model) == jax.tree.structure(template)
    assert jax.tree.structure(opt_state) == jax.tree.structure(saved["opt_state"])
    assert _bits(model) == _bits(saved["model"])
    assert _bits(opt_state) == _bits(saved["opt_state"])
    assert _shardings(model) == jax.tree.leaves(_model_shardings(template, mesh))
    assert _shardings(opt_state) == jax.tree.leaves(
        _adamw_shardings(saved["opt_state"], template, mesh))


def test_fsdp8_restored_as_fsdp4_tp2_bit_for_bit(saved):
    mesh = harness.mesh(dp=4, tp=2)
    template = nn.sharding.with_parallel(saved["model_t"], FSDP4_TP2)
    model, opt_state, step = models.restore_training_state(
        saved["path"], template, saved["state_t"], mesh=mesh)
    assert step == STEP and isinstance(step, int)
    assert model.blocks.self_attn.parallel == FSDP4_TP2
    assert model.blocks.self_attn.q.weight.sharding.spec == P(None, "tp", "dp")
    _check_restored(saved, model, opt_state, FSDP4_TP2, mesh)
    # Where nn.sharding.shard_like puts a fresh state for the same model and mesh.
    fresh = nn.sharding.shard_like(saved["opt_state"], model, mesh)
    assert _shardings(opt_state) == _shardings(fresh)


def test_fsdp_restored_without_fsdp_from_real_templates(saved):
    # Real templates: their values are ignored, their structure and placement used.
    mesh = harness.mesh(dp=2, sp=2, tp=2)
    template = nn.sharding.with_parallel(_fill(saved["model_t"], 3), TP2)
    model, opt_state, step = models.restore_training_state(
        saved["path"], template, _fill(saved["state_t"], 4), mesh=mesh)
    assert step == STEP
    assert model.blocks.self_attn.q.weight.sharding.spec == P(None, "tp", None)
    assert opt_state[0].count.sharding == NamedSharding(mesh, P())
    _check_restored(saved, model, opt_state, TP2, mesh)


def test_model_alone_on_one_device(saved):
    model, opt_state, step = models.restore_training_state(saved["path"], saved["model_t"])
    assert opt_state is None and step == STEP
    assert _bits(model) == _bits(saved["model"])
    assert all(s.device_set == {jax.devices()[0]} for s in _shardings(model))


def test_weights_only_checkpoint(saved, tmp_path):
    model = _placed(saved["model"], FSDP8, harness.mesh(dp=8))
    models.save_training_state(tmp_path / "weights", model, None, 0)
    restored, opt_state, step = models.restore_training_state(tmp_path / "weights",
                                                              saved["model_t"])
    assert (opt_state, step) == (None, 0)
    assert _bits(restored) == _bits(saved["model"])
    with pytest.raises(ValueError, match=r"holds no optimizer state.*opt_state=None"):
        models.restore_training_state(tmp_path / "weights", saved["model_t"], saved["state_t"])


# -- the first step compiles once ------------------------------------------------------------


@contextlib.contextmanager
def _compiles(name: str):
    """The XLA compilations of programs whose name contains `name`, while inside."""
    seen = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration" and name in kwargs.get(
                "fun_name", ""):
            seen.append(kwargs["fun_name"])

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.slow  # compiles a sharded training step of the whole model: ~10-15 s
def test_first_step_compiles_once_after_shard_like_and_restore(saved):
    """A sharded AdamW step (dp=2 x sp=2 x tp=2, FSDP over dp and sp) compiles on its
    first call from `shard_module` + `shard_like` placements, never on the next; the
    state restored for that configuration runs the same compiled program."""
    mesh = harness.mesh(dp=2, sp=2, tp=2)
    config = nn.sharding.ParallelConfig(sequence="ulysses", tp_axis="tp", fsdp_axes=("dp", "sp"))
    optimizer = optax.adamw(1e-3)
    static = eqx.partition(nn.sharding.with_parallel(saved["model_t"], config), eqx.is_array)[1]

    # jax.jit of the arrays (eqx.filter_jit compiles the same way) for its compiler
    # options: the fast-compiling ones halve the compile time.
    @functools.partial(jax.jit, compiler_options=harness.FAST_COMPILE)
    def train_step(params, opt_state, x, t, context):
        def loss(params):
            out = models.run_sharded(eqx.combine(params, static), x, t, context, mesh=mesh,
                                     batch_axis="dp", remat="full")
            return jnp.mean(out ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, value

    rng = np.random.default_rng(5)
    batch = jax.device_put(
        (harness.normal(rng, (2, 4, 2, 4, 4)), np.array([100.0, 700.0], np.float32),
         harness.normal(rng, (2, 7, 32))),
        NamedSharding(mesh, P("dp")))

    model = _placed(saved["model"], config, mesh)
    opt_state = nn.sharding.shard_like(saved["opt_state"], model, mesh)
    with _compiles("train_step") as fresh:
        state = train_step(eqx.filter(model, eqx.is_array), opt_state, *batch)[:2]
        state = train_step(*state, *batch)[:2]
    assert len(fresh) == 1, fresh

    model, opt_state, _ = models.restore_training_state(
        saved["path"], nn.sharding.with_parallel(saved["model_t"], config), saved["state_t"], mesh=mesh)
    with _compiles("train_step") as after_restore:
        train_step(eqx.filter(model, eqx.is_array), opt_state, *batch)
    assert after_restore == [], after_restore


# -- two processes ---------------------------------------------------------------------------


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_training_state_worker.py")


@pytest.mark.slow  # two processes starting JAX: ~10-13 s
def test_save_and_restore_across_two_processes(tmp_path):
    """Two processes of four devices: saved with FSDP over all 8 (each process writing
    its shards), restored as FSDP 4 x tensor parallel 2, every shard bit for bit."""
    port = harness.free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(i), str(harness.NUM_PROCESSES), str(port),
             str(tmp_path)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=harness.child_env(),
        )
        for i in range(harness.NUM_PROCESSES)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{out[-4000:]}"
        for case in ("save", "restore", "no_mesh"):
            assert f"RESULT {case} ok" in out, f"process {i}, {case}:\n{out[-4000:]}"


# -- bad inputs ----------------------------------------------------------------------------------


def test_mesh_that_does_not_divide_raises_naming_the_array(saved):
    mesh = harness.mesh(tp=3)
    template = nn.sharding.with_parallel(saved["model_t"], TP2)
    with pytest.raises(ValueError, match=r"array model\.\S+ of shape .* cannot be split over "
                                         r"\['tp'\] \(size 3\)"):
        models.restore_training_state(saved["path"], template, saved["state_t"], mesh=mesh)


def test_mesh_without_the_configured_axis_raises(saved):
    template = nn.sharding.with_parallel(saved["model_t"], TP2)
    with pytest.raises(ValueError, match=r"axis 'tp'.*does not have"):
        models.restore_training_state(saved["path"], template, mesh=jax.make_mesh(
            (8,), ("dp",), devices=jax.devices()))


def test_template_of_another_model_raises_naming_the_array(saved):
    model_t, state_t = _templates(dataclasses.replace(CONFIG, ffn_dim=128))
    with pytest.raises(ValueError, match=r"array model\.blocks\.ffn\.fc1\.weight is stored as "
                                         r"float32\[2, 96, 64\], the template has "
                                         r"float32\[2, 128, 64\]"):
        models.restore_training_state(saved["path"], model_t, state_t)
    other_t, _ = _templates(dataclasses.replace(CONFIG, image_dim=16))
    with pytest.raises(ValueError, match=r"has no array model\.img_emb"):
        models.restore_training_state(saved["path"], other_t)


def test_missing_or_foreign_directory_raises(saved, tmp_path):
    with pytest.raises(ValueError, match=r"no checkpoint at .*not a directory"):
        models.restore_training_state(tmp_path / "absent", saved["model_t"])
    with pytest.raises(ValueError, match=r"is not a checkpoint of save_training_state \(it holds "
                                         r"no orbax PyTree checkpoint.*not its parent"):
        models.restore_training_state(saved["path"].parent, saved["model_t"])


def test_save_refuses_to_overwrite_and_abstract_or_bad_inputs(saved, tmp_path):
    model = saved["model"]
    with pytest.raises(ValueError, match=r"exists already.*overwrite=True"):
        models.save_training_state(saved["path"], model, None, STEP)
    with pytest.raises(ValueError, match=r"`model` has abstract arrays"):
        models.save_training_state(tmp_path / "a", saved["model_t"], None, 0)
    with pytest.raises(ValueError, match=r"`step` must be an int.*received 1.5"):
        models.save_training_state(tmp_path / "b", model, None, 1.5)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_missing_orbax_says_how_to_install(saved, monkeypatch):
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # import raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'vidax_eqx\[train\]'"):
        models.restore_training_state(saved["path"], saved["model_t"])
