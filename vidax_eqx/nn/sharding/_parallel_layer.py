"""What a layer that runs over a mesh declares: its `ParallelConfig` and its Megatron
split, read by the placement code (`partition_specs`) and by `with_parallel`."""

from typing import NamedTuple

import equinox as eqx

from ._config import ParallelConfig


class MegatronSplit(NamedTuple):
    """A layer's Megatron tensor-parallel split, by field name (a field that is `None`,
    an absent qk-norm or image branch, is skipped):

    - `column`: the column-parallel `eqx.nn.Linear` layers: weight `P(tp, None)`, bias
        `P(tp)` (each device holds its heads' or hidden features' outputs);
    - `row`: the row-parallel ones: weight `P(None, tp)`, bias `P()` (added once, after
        the `psum`);
    - `sharded_norms`: norms over the column-parallel features, whose `weight` is split
        like them (`P(tp)`: Wan's qk RMSNorm over the whole inner dim); also any table
        whose last axis is the heads (T5's relative position bias `(buckets, heads)`).
    - `vocab`: embedding tables (`eqx.nn.Embedding`, weight `(num_embeddings, dim)`)
        split over their rows, Megatron's vocabulary-parallel embedding: weight
        `P(tp, None)`; the layer looks up the ids that fall in its rows (zeros for the
        others) and sums over `tp`, so no device ever holds the whole table.

    A linear layer without a bias has only its weight placed. Every other parameter of
    the layer (per-head norms, ...) is replicated over `tp`.
    """

    column: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    sharded_norms: tuple[str, ...] = ()
    vocab: tuple[str, ...] = ()


class AbstractParallelLayer(eqx.Module):
    """A layer that runs on one device or over a mesh, as its [`ParallelConfig`][]
    says: the attention layers and [`vidax_eqx.nn.FeedForward`][] of this library, and
    any layer of a user's that subclasses it.

    [`partition_specs`][vidax_eqx.nn.sharding.partition_specs] places its parameters by
    its `megatron` split when `parallel.tp_axis` is set, and
    [`with_parallel`][vidax_eqx.nn.sharding.with_parallel] swaps its `parallel`.

    **Declares:**

    - `parallel`: the layer's [`ParallelConfig`][] (a field: a non-array leaf).
    - `megatron`: a class variable, its [`MegatronSplit`][].
    """

    parallel: eqx.AbstractVar[ParallelConfig]
    megatron: eqx.AbstractClassVar[MegatronSplit]
