"""A batch of texts through the T5 encoder over a mesh: global inputs in, the global
output out, the weights placed by `nn.sharding.partition_specs`."""

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from ..._vma import varying_axes
from ...nn import sharding
from .._run_sharded import batch_axes, check_batch_axis
from ._config import check_tensor_parallel


def check_mesh(owner: str, config, parallel: sharding.ParallelConfig, mesh) -> None:
    """Raises unless `mesh` has the axes of `parallel` and its tensor-parallel size splits
    an encoder of `config` evenly."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(
            f"{owner}: `mesh` must be a jax.sharding.Mesh (e.g. vidax_eqx.parallel.make_mesh"
            f"(...)) or None; received {type(mesh).__name__}.")
    missing = [a for a in (parallel.tp_axis, *parallel.fsdp_axes)
               if a is not None and a not in mesh.shape]
    if missing:
        raise ValueError(
            f"{owner}: the model's ParallelConfig (tp_axis={parallel.tp_axis!r}, fsdp_axes="
            f"{parallel.fsdp_axes}) names the axis {missing[0]!r}, which the mesh "
            f"{dict(mesh.shape)} lacks. Pass a mesh with it, or configure the model for this "
            "mesh (nn.sharding.with_parallel).")
    if parallel.tp_axis is not None:
        check_tensor_parallel(owner, config, parallel.tp_axis, mesh.shape[parallel.tp_axis])


def encode_over_mesh(model, forward, input_ids, valid, *, mesh, batch_axis):
    """`forward(model, input_ids, valid)` (the encoder's batched forward pass, one
    example per row) inside `shard_map` over `mesh` (see `T5Encoder.encode`): the
    weights by `partition_specs`, the batch over `batch_axis`.

    Devices of an FSDP axis that the batch is not split over compute the same examples
    (the split is for the weights' memory); their outputs, equal but typed as varying
    over that axis (computed from gathered weights), become one array through a
    `lax.pmax` over it (exact on equal values)."""
    owner = "T5Encoder.encode"
    check_mesh(owner, model.config, model.parallel, mesh)
    batch_axis = check_batch_axis(owner, mesh, batch_axis, input_ids.shape[0])
    keep = set(batch_axes(batch_axis))
    tp_axis = model.parallel.tp_axis
    if tp_axis in keep:
        raise ValueError(
            f"{owner}: `batch_axis` {batch_axis!r} contains the tensor-parallel axis "
            f"{tp_axis!r}, whose devices split the heads of the same examples. Split the batch "
            "over the data or FSDP axes only.")
    batch = P(batch_axis)

    def per_device(model, input_ids, valid):
        out = forward(model, input_ids, valid)
        extra = tuple(sorted(varying_axes(out) - keep, key=str))
        return lax.pmax(out, extra) if extra else out

    run = sharding.filter_shard_map(
        per_device, mesh=mesh,
        in_specs=(sharding.partition_specs(model, mesh), batch, batch), out_specs=batch)
    return run(model, input_ids, valid)
