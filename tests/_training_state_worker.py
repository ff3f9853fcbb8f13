"""One process of the two-process checkpoint test (`tests/test_training_state.py`); not
a test itself.

Usage: `python tests/_training_state_worker.py PROCESS_ID NUM_PROCESSES PORT DIRECTORY`,
with `XLA_FLAGS=--xla_force_host_platform_device_count=4` in the environment. Every
process joins one `jax.distributed` job over localhost (gloo CPU collectives) and:

1. places a tiny Wan and its AdamW state (the same seeded values in every process)
   fully sharded over all 8 devices (FSDP over dp=8), each process providing only its
   own devices' shards, and saves them with `models.save_training_state`;
2. restores them, from abstract templates, as FSDP 4 x tensor parallel 2 (dp=4 x tp=2,
   the tp pairs inside a process) and checks, for its own devices only, that every
   array has the sharding `nn.sharding.partition_specs` gives and every addressable shard equals
   the same block of the saved values, bit for bit;
3. checks that `mesh=None` is refused in a job of several processes.

Prints `RESULT save ok`, `RESULT restore ok`, `RESULT no_mesh ok` (or `error
<message>`).
"""

import os
import sys
import traceback


_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # vidax_eqx, and harness/ beside this file

import jax  # noqa: E402
import numpy as np  # noqa: E402

import harness  # noqa: E402


STEP = 3


def _report(name, fn):
    try:
        fn()
        print(f"RESULT {name} ok", flush=True)
    except Exception as e:  # report and go on: the processes must stay in step
        traceback.print_exc()
        print(f"RESULT {name} error {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)


def main() -> int:
    process_id, num_processes, port = (int(x) for x in sys.argv[1:4])
    path = os.path.join(sys.argv[4], f"step_{STEP}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=num_processes, process_id=process_id)
    import equinox as eqx
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    from vidax_eqx import models, nn

    config = models.WanConfig(dim=64, ffn_dim=96, num_heads=8, num_layers=2, in_channels=4,
                              out_channels=4, text_dim=32, freq_dim=32)
    optimizer = optax.adamw(1e-3)

    def init():
        model = models.WanTransformer3D(config, key=jax.random.PRNGKey(0))
        return model, optimizer.init(eqx.filter(model, eqx.is_array))

    model_t, state_t = eqx.filter_eval_shape(init)
    rng = np.random.default_rng(0)
    values = jax.tree.map(  # host values, the same in every process
        lambda x: (rng.integers(1, 100, x.shape) if np.issubdtype(x.dtype, np.integer)
                   else rng.standard_normal(x.shape)).astype(x.dtype),
        (eqx.filter(model_t, lambda x: isinstance(x, jax.ShapeDtypeStruct)), state_t))
    is_spec = lambda s: isinstance(s, P)  # noqa: E731

    def specs(model, mesh):
        return eqx.filter(nn.sharding.partition_specs(model, mesh), is_spec, is_leaf=is_spec)

    def save():
        mesh = harness.mesh(dp=jax.device_count())
        model = nn.sharding.with_parallel(model_t, nn.sharding.ParallelConfig(fsdp_axes=("dp",)))
        model_specs = specs(model, mesh)
        arrays = jax.tree.map(lambda s, x: harness.global_array(mesh, s, x), model_specs,
                              values[0], is_leaf=is_spec)
        adam, *rest = values[1]
        place = lambda tree: jax.tree.map(  # noqa: E731
            lambda s, x: harness.global_array(mesh, s, x), model_specs, tree, is_leaf=is_spec)
        opt_state = (adam._replace(count=harness.global_array(mesh, P(), adam.count),
                                   mu=place(adam.mu), nu=place(adam.nu)), *rest)
        assert not jax.tree.leaves(arrays)[0].is_fully_addressable
        models.save_training_state(path, eqx.combine(arrays, model), opt_state, STEP)

    def restore():
        mesh = harness.mesh(dp=jax.device_count() // 2, tp=2)
        parallel = nn.sharding.ParallelConfig(tp_axis="tp", fsdp_axes=("dp",))
        template = nn.sharding.with_parallel(model_t, parallel)
        model, opt_state, step = models.restore_training_state(path, template, state_t,
                                                               mesh=mesh)
        assert step == STEP, step
        model_specs = jax.tree.leaves(specs(template, mesh), is_leaf=is_spec)
        adam = opt_state[0]
        got = [*jax.tree.leaves(eqx.filter(model, eqx.is_array)), adam.count,
               *jax.tree.leaves(adam.mu), *jax.tree.leaves(adam.nu)]
        want = [*model_specs, P(), *model_specs, *model_specs]
        ref = [*jax.tree.leaves(values[0]), values[1][0].count,
               *jax.tree.leaves(values[1][0].mu), *jax.tree.leaves(values[1][0].nu)]
        assert len(got) == len(want) == len(ref), (len(got), len(want), len(ref))
        for array, spec, x in zip(got, want, ref):
            assert array.sharding == NamedSharding(mesh, spec), (array.sharding, spec)
            for shard in array.addressable_shards:
                assert np.asarray(shard.data).tobytes() == x[shard.index].tobytes(), shard.index

    def no_mesh():
        try:
            models.restore_training_state(path, model_t)
        except ValueError as e:
            assert "cannot share" in str(e), e
        else:
            raise AssertionError("mesh=None was accepted in a job of several processes")

    _report("save", save)
    _report("restore", restore)
    _report("no_mesh", no_mesh)
    # Every process reaches this point before either shuts the job down.
    multihost_utils.sync_global_devices("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
