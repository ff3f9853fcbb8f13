"""The two helpers the `vidax.core` page refers to: the mesh its `'sp'` and `'tp'` axes
come from (`build_tpu_mesh`), and the placement of a Wan model's parameters with the
norm scales `'tp'`-sharded (`shard_wan_params`)."""

import jax

from ..nn.sharding import shard_module
from ..parallel import make_mesh


def build_tpu_mesh(sp: int = 1, tp: int = 1, dp: int = 1, *, devices=None) -> jax.sharding.Mesh:
    """The device mesh of the page's examples: axes `("dp", "sp", "tp")`, tensor
    parallelism innermost (the axis names every function of `vidax_eqx.core` defaults
    to). Any platform, despite the name: it is [`vidax_eqx.parallel.make_mesh`][].

    **Arguments:**

    - `sp`, `tp`, `dp`: the sequence-, tensor- and data-parallel sizes; their product
        devices are used.
    - `devices`: the devices (default: the first `dp * sp * tp` of `jax.devices()`).

    **Returns:**

    A `jax.sharding.Mesh`.
    """
    return make_mesh(dp, sp, tp, devices=devices)


def shard_wan_params(model, mesh: jax.sharding.Mesh):
    """A Wan model (or any vidax_eqx module) with its parameters placed over `mesh`:
    Megatron column / row splits of the attention and feed-forward weights over
    `"tp"`, the TP-sharded RMSNorm scales over `"tp"` (each device its `dim_local`
    slice, as `TPShardedRMSNorm` expects), FSDP shards where the model's
    `ParallelConfig` asks for them, the rest replicated. It is
    [`vidax_eqx.nn.sharding.shard_module`][], which reads each layer's configuration.

    **Arguments:**

    - `model`: e.g. a `vidax_eqx.models.WanTransformer3D` configured with
        `nn.sharding.with_parallel(model, ParallelConfig(..., tp_axis="tp"))`.
    - `mesh`: a mesh with the configured axes (e.g. [`build_tpu_mesh`][]'s).

    **Returns:**

    The model with its arrays placed.
    """
    return shard_module(model, mesh)
