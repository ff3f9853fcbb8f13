"""One process of the two-process sharded-loading test (`tests/test_fsdp_loading.py`);
not a test itself.

Usage: `python tests/_fsdp_loading_worker.py PROCESS_ID NUM_PROCESSES PORT CHECKPOINT`,
with `XLA_FLAGS=--xla_force_host_platform_device_count=4` in the environment. Every
process joins one `jax.distributed` job over localhost (gloo CPU collectives), loads
the Wan checkpoint with `from_pretrained(..., mesh=mesh)` fully sharded over all 8
devices (FSDP over `dp` x `sp`), and checks, for its own devices only:

- every array has the sharding `nn.sharding.partition_specs` gives, and each of its addressable
  shards equals the same block of the whole tensors that a plain (unsharded,
  process-local) load reads;
- the bytes it read from the files: at least its share (the distinct blocks of its
  devices) and at most its share plus the whole of the tensors split on a later
  dimension (whose nearby runs are read as the rows they span).

Prints `RESULT equal ok` / `RESULT equal error <message>` and
`RESULT bytes <read> <share> <bound> <checkpoint bytes>`.
"""

import math
import os
import sys
import traceback


_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # vidax_eqx, and harness/ beside this file

import jax  # noqa: E402
import numpy as np  # noqa: E402

import harness  # noqa: E402


def _blocks(array, stacked: bool):
    """`(share bytes, bound bytes)` of one loaded array: the bytes of the distinct blocks
    of this process's devices, and that or (split past a tensor's first dimension) the
    whole array."""
    distinct = {tuple(s.indices(n)[:2] for s, n in zip(shard.index, array.shape))
                for shard in array.addressable_shards}
    share = sum(math.prod(b - a for a, b in block) for block in distinct) * array.dtype.itemsize
    later = any((a, b) != (0, n) for block in distinct
                for (a, b), n in list(zip(block, array.shape))[1 + stacked:])
    return share, array.nbytes if later else share


def main() -> int:
    process_id, num_processes, port = (int(x) for x in sys.argv[1:4])
    checkpoint = sys.argv[4]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=num_processes, process_id=process_id)
    from jax.sharding import NamedSharding

    from vidax_eqx import interop, models, nn

    opened = []
    open_checkpoint = interop.open_checkpoint

    def recording(path):
        opened.append(open_checkpoint(path))
        return opened[-1]

    interop.open_checkpoint = recording  # count the bytes the sharded load reads
    mesh = harness.mesh(dp=2, sp=jax.device_count() // 2)
    parallel = nn.sharding.ParallelConfig(sequence="ulysses", fsdp_axes=("dp", "sp"))
    model = models.WanTransformer3D.from_pretrained(checkpoint, parallel=parallel, mesh=mesh)
    read = opened[0].bytes_read
    total = sum(math.prod(opened[0].shape(n)) * opened[0].dtype(n).itemsize for n in opened[0])
    interop.open_checkpoint = open_checkpoint
    plain = models.WanTransformer3D.from_pretrained(checkpoint)  # this process's reference

    try:
        specs = nn.sharding.partition_specs(model, mesh)
        is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)  # noqa: E731
        flat = jax.tree_util.tree_flatten_with_path(harness.arrays(model))[0]
        refs, spec_list = harness.arrays(plain), [s for s in jax.tree.leaves(specs, is_leaf=is_spec)
                                                  if is_spec(s)]
        assert len(flat) == len(refs) == len(spec_list), (len(flat), len(refs), len(spec_list))
        share = bound = 0
        stacked_fields = type(model).stacked_layers
        for (path, array), ref, spec in zip(flat, refs, spec_list):
            name = jax.tree_util.keystr(path)
            assert array.sharding == NamedSharding(mesh, spec), (name, array.sharding, spec)
            assert not array.is_fully_addressable, f"{name} is not split across the processes"
            whole = np.asarray(ref)
            for shard in array.addressable_shards:
                got = np.asarray(shard.data)
                assert got.dtype == whole.dtype and np.array_equal(got, whole[shard.index]), name
            stacked = getattr(path[0], "name", None) in stacked_fields
            s, b = _blocks(array, stacked)
            share, bound = share + s, bound + b
        print("RESULT equal ok", flush=True)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        traceback.print_exc()
        print(f"RESULT equal error {type(e).__name__}: {str(e)[:300]}".replace("\n", " "), flush=True)
        share = bound = -1
    print(f"RESULT bytes {read} {share} {bound} {total}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
