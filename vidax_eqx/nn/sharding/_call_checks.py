"""The checks of a layer's call against its `ParallelConfig` inside `shard_map`: what
the varying-axes types of its inputs say about how they are split."""

from ..._vma import explicit_axes, manual_axes, replicated_axes, tracks_vma, varying_axes
from ...parallel import SP_AXIS
from ._config import ParallelConfig


def check_context(cls: str, parallel: ParallelConfig, x, *, context=None,
                  sharded_x: bool = True) -> None:
    """Raises where `parallel` cannot be how this call is sharded.

    Inside `shard_map(check_vma=True)` every value knows the mesh axes it varies
    over, so a module can tell a sequence that is sharded from one that is
    replicated, and refuse a configuration that would silently give a wrong answer:

    - `sequence="none"` with `x` varying over `"sp"`: each device would attend only to its own chunk (`with_parallel`
        forgotten);
    - a sequence-parallel configuration with `x` the same on every device of one of
        its axes: the replicated sequence would be taken as a chunk;
    - `x` varying over `tp_axis`: Megatron splits heads, never tokens;
    - `context` (the text, whole on every device) varying over any of these axes.

    `sharded_x=False` (cross-attention, whose queries need no communication) skips
    the checks of `x`'s sequence axes. Outside `shard_map`, or with
    `check_vma=False`, nothing is known and nothing is checked; a data-parallel axis
    is never a mismatch. Mismatches no value records (RoPE tables or segment ids
    sharded in another layout than `x`) cannot be detected: build those with
    [`vidax_eqx.nn.sharding.shard_tokens`][].
    """
    if not manual_axes():
        explicit = explicit_axes(x, context)
        if explicit:
            raise ValueError(
                f"{cls}: `x` is sharded over the Explicit mesh axes {explicit} "
                "(`jax.make_mesh`'s default axis type) outside `shard_map`; the module needs "
                "to know how its sequence is split. Call it inside "
                "`nn.sharding.filter_shard_map(...)` with a matching ParallelConfig "
                "(`nn.sharding.with_parallel`), or replicate `x` first (`jax.sharding.reshard(x, P())`)."
            )
    if not tracks_vma():
        return
    vma = varying_axes(x)
    seq_axes = parallel.sequence_axes
    if sharded_x and not parallel.sequence_axes:
        # Values computed with FSDP-gathered weights vary over the FSDP axes by type
        # (the gather's transpose is a reduce-scatter): nothing can be told there.
        wrong = vma & {SP_AXIS} - set(parallel.fsdp_axes)
        if wrong:
            axis = sorted(wrong)[0]
            raise ValueError(
                f"{cls}: `x` varies over the mesh axis {axis!r} (its sequence is sharded over "
                f"it), but the module's ParallelConfig says one device (sequence='none'): each "
                f"device would attend only to its own {x.shape[0]} tokens, a wrong answer. Run "
                "the sharded twin, `nn.sharding.with_parallel(module, nn.sharding.ParallelConfig("
                f"ulysses_axis={axis!r} | ring_axis={axis!r}))`, or replicate `x` over "
                f"{axis!r}."
            )
    if sharded_x and x.shape[0]:
        missing = replicated_axes(x, seq_axes)
        if missing:
            raise ValueError(
                f"{cls}: ParallelConfig(sequence={parallel.sequence!r}) takes `x` as this "
                f"device's chunk of a sequence sharded over {missing[0]!r}, but `x` is the "
                f"same on every device of {missing[0]!r} (replicated): the sequence would be "
                f"counted once per device. Shard `x` over {missing[0]!r} (its in_spec), or "
                "run a replicated sequence with `nn.sharding.with_parallel(module, "
                f"nn.sharding.ParallelConfig(tp_axis={parallel.tp_axis!r}))`."
            )
    if parallel.tp_axis is not None and parallel.tp_axis in vma:
        raise ValueError(
            f"{cls}: `x` varies over the tensor-parallel axis {parallel.tp_axis!r}, but "
            "Megatron tensor parallelism splits heads, not tokens: every device of "
            f"{parallel.tp_axis!r} needs the same `x`. Leave {parallel.tp_axis!r} out of "
            "x's in_spec."
        )
    if context is not None:
        check_text(cls, parallel, context)


def check_text(cls: str, parallel: ParallelConfig, context) -> None:
    """Raises where `context` (text, whole on every device) varies over a sequence or
    tensor-parallel axis of `parallel` inside `shard_map`: it was sharded like `x`."""
    if not tracks_vma():
        return
    axes = {*parallel.sequence_axes, SP_AXIS, parallel.tp_axis}
    wrong = varying_axes(context) & axes
    if wrong:
        raise ValueError(
            f"{cls}: `context` (the text) must be whole and the same on every device "
            f"(in_spec P()); it varies over the mesh axes {sorted(wrong, key=str)}."
        )
