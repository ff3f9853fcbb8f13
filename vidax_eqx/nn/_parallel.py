"""`ParallelConfig`: how an attention module is split over a device mesh (static); the
checks of a module's argument and call against it, and the token split it implies."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

from ._fsdp import unwrap_shards, wrap_shards
from .._vma import explicit_axes, manual_axes, replicated_axes, tracks_vma, varying_axes
from ..parallel import axis_size, chunk_by_rank, SP_AXIS, zigzag_permute, zigzag_unpermute


SEQUENCE_MODES = ("none", "ulysses", "ring", "usp")
LAYOUTS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How an attention module runs over a device mesh: immutable and hashable.

    The configuration only chooses which collective functions of
    [`vidax_eqx.parallel`][] the module calls; the module's parameters are the
    same (global shapes) whatever it says. `ParallelConfig()` is a single device.
    Anything else runs inside `jax.shard_map` over a mesh that has the named axes,
    with the parameters placed by [`vidax_eqx.nn.partition_specs`][].

    Modules hold it as an ordinary field: a non-array *leaf*, not part of the tree
    structure, so the single-device module and all its [`with_parallel`][] variants
    share one structure (one optax state, one set of specs, one checkpoint layout).
    Like any non-array field it is static under `eqx.filter_jit` (hashed into the
    cache key); plain `jax.jit` does not take a module argument (close over it, or
    use Equinox's filtered transformations and [`filter_shard_map`][]). Inside
    `shard_map` the modules check their call against it and raise on a mismatch.

    **Fields:**

    - `sequence`: how the sequence axis is split.
        - `"none"`: every device holds the whole sequence.
        - `"ulysses"`: DeepSpeed-Ulysses over `sp_axis` (`all_to_all` from a
            sequence split to a head split); the local head count must be a multiple
            of the size of `sp_axis`.
        - `"ring"`: ring attention over `sp_axis`.
        - `"usp"`: 2D: Ulysses over `sp_axis`, ring over `ring_axis`; the sequence is
            sharded ring-major, `PartitionSpec((ring_axis, sp_axis))`.
    - `sp_axis`: the sequence-parallel mesh axis (default `"sp"`).
    - `ring_axis`: the ring axis of `"usp"` (required there, and only there).
    - `layout`: `"contiguous"` (device `r` holds the `r`-th chunk) or `"zigzag"`
        (ring and usp only: the sequence, and every per-token input such as the RoPE
        tables and segment ids, permuted by `vidax_eqx.parallel.zigzag_permute`
        before sharding).
    - `tp_axis`: the tensor-parallel (Megatron) mesh axis, or `None`. With an axis,
        heads are split over it: q/k/v column-parallel, the output projection
        row-parallel with one `psum`.
    - `fsdp_axes`: the mesh axes (data and sequence axes; never `tp_axis`) over which
        every parameter is split (FSDP / ZeRO-3), or `()`. [`partition_specs`][] puts
        them on one dimension of each parameter (the largest one that `tp` does not
        split and that their size divides); inside `shard_map` each module gathers its
        own weights just before it uses them ([`fsdp_gather`][]), so gradients come
        back reduce-scattered. Every FSDP axis must carry different data (the batch or
        the sequence), or its devices would compute the same thing.
    - `fsdp_regather`: `True` (default, ZeRO-3): under a model's scanned blocks the
        gathered weights of a block are not kept for the backward pass but gathered
        again there, so at most about one block is gathered at a time. `False` keeps
        them from the forward (one gather per block and step instead of two, but the
        whole model gathered on every device by the end of the forward).
    """

    sequence: str = "none"
    sp_axis: str = SP_AXIS
    ring_axis: str | None = None
    layout: str = "contiguous"
    tp_axis: str | None = None
    fsdp_axes: tuple[str, ...] = ()
    fsdp_regather: bool = True

    def __post_init__(self):
        if self.sequence not in SEQUENCE_MODES:
            raise ValueError(
                f"`sequence` must be one of {SEQUENCE_MODES}; received {self.sequence!r}."
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"`layout` must be one of {LAYOUTS}; received {self.layout!r}.")
        if self.layout == "zigzag" and self.sequence not in ("ring", "usp"):
            raise ValueError(
                "`layout='zigzag'` is a ring layout: it needs sequence='ring' or 'usp'; "
                f"received sequence={self.sequence!r}. Use layout='contiguous'."
            )
        if self.sequence == "usp":
            if self.ring_axis is None or self.ring_axis == self.sp_axis:
                raise ValueError(
                    "sequence='usp' runs Ulysses over `sp_axis` and a ring over `ring_axis`, "
                    "two different mesh axes; received sp_axis="
                    f"{self.sp_axis!r}, ring_axis={self.ring_axis!r}. Pass e.g. "
                    "ring_axis='ring' (make_mesh(sp=U, extra_axes={'ring': R}))."
                )
        elif self.ring_axis is not None:
            raise ValueError(
                f"`ring_axis` is only used by sequence='usp'; received ring_axis="
                f"{self.ring_axis!r} with sequence={self.sequence!r}. Drop it, or use 'usp'."
            )
        if self.tp_axis is not None and self.sequence != "none" and self.tp_axis in (
            self.sp_axis, self.ring_axis
        ):
            raise ValueError(
                f"`tp_axis` must differ from the sequence axes; received tp_axis="
                f"{self.tp_axis!r}, sp_axis={self.sp_axis!r}, ring_axis={self.ring_axis!r}."
            )
        axes = self.fsdp_axes
        if isinstance(axes, str):
            axes = (axes,)
        if not isinstance(axes, (tuple, list)) or not all(isinstance(a, str) and a for a in axes):
            raise ValueError(
                "`fsdp_axes` must be a tuple of mesh axis names, e.g. ('dp', 'sp'); received "
                f"fsdp_axes={self.fsdp_axes!r}."
            )
        axes = tuple(axes)
        if len(set(axes)) != len(axes):
            raise ValueError(f"`fsdp_axes` names an axis twice; received fsdp_axes={axes!r}.")
        if self.tp_axis is not None and self.tp_axis in axes:
            raise ValueError(
                f"`fsdp_axes` must not contain the tensor-parallel axis {self.tp_axis!r}: "
                "Megatron already splits the weights over it (and its devices see the same "
                f"tokens); received fsdp_axes={axes!r}, tp_axis={self.tp_axis!r}. FSDP goes over "
                "the data and sequence axes, e.g. fsdp_axes=('dp', 'sp')."
            )
        if not isinstance(self.fsdp_regather, bool):
            raise ValueError(
                f"`fsdp_regather` must be a bool; received {self.fsdp_regather!r}."
            )
        object.__setattr__(self, "fsdp_axes", axes)


def fsdp_axes_of(tree) -> tuple[str, ...]:
    """The `fsdp_axes` of the [`ParallelConfig`][]s in `tree`: FSDP places a whole model,
    so the configurations that name FSDP axes must agree (those with none, e.g. a
    model's embeddings built without a configuration, follow them); `()` without any."""
    return agreed(tree, "fsdp_axes") or ()


def agreed(tree, field: str):
    """The one value of `field` that the [`ParallelConfig`][]s in `tree` set (ignoring
    those that leave it empty), or `None`; a `ValueError` when they differ."""
    found = {getattr(x, field) for x in jax.tree.leaves(tree) if isinstance(x, ParallelConfig)}
    found -= {None, ()}
    if len(found) > 1:
        raise ValueError(
            f"the modules of one model must agree on their ParallelConfig's {field} (one "
            f"placement of the whole model); received {sorted(found, key=str)}. Set one "
            "configuration with nn.with_parallel(model, config)."
        )
    return found.pop() if found else None


def check_parallel(owner: str, parallel) -> None:
    """Raises unless `parallel` (an argument of `owner`) is a [`ParallelConfig`][]."""
    if not isinstance(parallel, ParallelConfig):
        raise ValueError(
            f"{owner}: `parallel` must be a ParallelConfig; received {type(parallel).__name__}."
        )


def check_context(cls: str, parallel: ParallelConfig, x, *, context=None,
                  sharded_x: bool = True) -> None:
    """Raises where `parallel` cannot be how this call is sharded.

    Inside `shard_map(check_vma=True)` every value knows the mesh axes it varies
    over, so a module can tell a sequence that is sharded from one that is
    replicated, and refuse a configuration that would silently give a wrong answer:

    - `sequence="none"` with `x` varying over the configured `sp_axis` (default
        `"sp"`): each device would attend only to its own chunk (`with_parallel`
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
    [`vidax_eqx.nn.shard_tokens`][].
    """
    if not manual_axes():
        explicit = explicit_axes(x, context)
        if explicit:
            raise ValueError(
                f"{cls}: `x` is sharded over the Explicit mesh axes {explicit} "
                "(`jax.make_mesh`'s default axis type) outside `shard_map`; the module needs "
                "to know how its sequence is split. Call it inside "
                "`nn.filter_shard_map(...)` with a matching ParallelConfig "
                "(`nn.with_parallel`), or replicate `x` first (`jax.sharding.reshard(x, P())`)."
            )
    if not tracks_vma():
        return
    vma = varying_axes(x)
    seq_axes = _sequence_axes(parallel)
    if sharded_x and parallel.sequence == "none":
        # Values computed with FSDP-gathered weights vary over the FSDP axes by type
        # (the gather's transpose is a reduce-scatter): nothing can be told there.
        wrong = vma & {parallel.sp_axis, SP_AXIS} - set(parallel.fsdp_axes)
        if wrong:
            axis = sorted(wrong)[0]
            raise ValueError(
                f"{cls}: `x` varies over the mesh axis {axis!r} (its sequence is sharded over "
                f"it), but the module's ParallelConfig says one device (sequence='none'): each "
                f"device would attend only to its own {x.shape[0]} tokens, a wrong answer. Run "
                "the sharded twin, `nn.with_parallel(module, nn.ParallelConfig(sequence="
                f"'ulysses' | 'ring' | 'usp', sp_axis={axis!r}))`, or replicate `x` over "
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
                "run a replicated sequence with `nn.with_parallel(module, nn.ParallelConfig("
                f"tp_axis={parallel.tp_axis!r}))`."
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
    axes = {*_sequence_axes(parallel), parallel.sp_axis, SP_AXIS, parallel.tp_axis}
    wrong = varying_axes(context) & axes
    if wrong:
        raise ValueError(
            f"{cls}: `context` (the text) must be whole and the same on every device "
            f"(in_spec P()); it varies over the mesh axes {sorted(wrong, key=str)}."
        )


def _sequence_axes(parallel: ParallelConfig) -> tuple:
    if parallel.sequence == "none":
        return ()
    if parallel.sequence == "usp":
        return (parallel.ring_axis, parallel.sp_axis)
    return (parallel.sp_axis,)


def _split(fn: str, parallel):
    """How `parallel` splits a sequence on this device: `(axes, rank, n, zigzag_n)` (the
    mesh axes, this device's chunk among `n`, the ring size of the zigzag), or `None`
    for one device."""
    check_parallel(fn, parallel)
    if parallel.sequence == "none":
        return None
    sp = parallel.sp_axis
    n_sp = axis_size(sp, what="Sequence-parallel")
    if parallel.sequence != "usp":
        return sp, lax.axis_index(sp), n_sp, n_sp
    ring = parallel.ring_axis
    n_ring = axis_size(ring, what="Ring")  # ring-major: chunk ring_rank * n_sp + sp_rank
    return (ring, sp), lax.axis_index(ring) * n_sp + lax.axis_index(sp), n_ring * n_sp, n_ring


def shard_tokens(x, parallel: ParallelConfig, *, axis: int = 0):
    """This device's share of a per-token array, in the layout `parallel` shards `x` in.

    Call it inside `jax.shard_map` with `x` whole (the same on every device, e.g. a
    closed-over constant or in_spec `P()`): RoPE tables, segment ids, positions, or the
    tokens themselves. It returns exactly the rows a module configured with `parallel`
    expects next to its `x`, so the tables always follow the tokens: contiguous chunks
    of `sp_axis` for Ulysses and ring; for `layout="zigzag"` the
    [`vidax_eqx.parallel.zigzag_permute`][]d sequence, chunked; for `"usp"` ring-major
    chunks over `(ring_axis, sp_axis)` (zigzag over the ring). A mismatch here is not
    detectable afterwards (a RoPE table is just numbers), which is why this one call
    exists: `rope = nn.shard_tokens(nn.functional.rope_3d(grid, head_dim), parallel)`.

    **Arguments:**

    - `x`: an array, or a PyTree of arrays (e.g. the `(cos, sin)` pair), each with the
        whole sequence along `axis`.
    - `parallel`: the [`ParallelConfig`][] of the module the result is for.
    - `axis`: the sequence axis of every array.

    **Returns:**

    The same structure with `S / n` rows along `axis` (`n` the number of devices the
    sequence is split over); `x` itself for `sequence="none"`. `S` must be a multiple of
    `n` (`2n` for zigzag): pad first with [`vidax_eqx.parallel.pad_to_multiple`][].
    """
    split = _split("shard_tokens", parallel)
    if split is None:
        return x
    _, rank, n, zigzag_n = split

    def shard(a):
        if parallel.layout == "zigzag":
            a = zigzag_permute(a, axis, zigzag_n)
        return chunk_by_rank(a, axis, n, rank)

    return jax.tree.map(shard, x)


def gather_tokens(x, parallel: ParallelConfig, *, axis: int = 0):
    """The inverse of [`shard_tokens`][]: the whole sequence from every device's share.

    Call it inside `jax.shard_map` on per-token arrays sharded as `parallel` shards
    `x` (a module's output, e.g. a DiT's last hidden states before unpatchify): every
    device's rows, in the layout's order, with the zigzag undone. The result is the
    same on every device of the sequence axes, and known to be (it is a `psum`, so it
    may leave `shard_map` with an out_spec that does not name those axes); its
    gradient gives each device the cotangent of its own rows. It moves `n` times the
    rows of an `all_gather`: gather small arrays (a model's output projection, not
    its hidden states).

    **Arguments:**

    - `x`: an array, or a PyTree of arrays, each this device's rows along `axis`.
    - `parallel`: the [`ParallelConfig`][] the rows were sharded by.
    - `axis`: the sequence axis of every array.

    **Returns:**

    The same structure with `n` times the rows along `axis`, in global order; `x`
    itself for `sequence="none"`.
    """
    split = _split("gather_tokens", parallel)
    if split is None:
        return x
    axes, rank, n, zigzag_n = split

    def gather(a):
        # A psum of each device's rows placed in a zero buffer: unlike all_gather, its
        # result is known to be the same on every device (replicated under check_vma,
        # so it can leave shard_map with an unsharded out_spec); its transpose hands
        # each device the cotangent of its own rows.
        rows = a.shape[axis]
        shape = (*a.shape[:axis], n * rows, *a.shape[axis + 1:])
        start = [0] * a.ndim
        start[axis] = rank * rows
        a = lax.psum(lax.dynamic_update_slice(jnp.zeros(shape, a.dtype), a, start), axes)
        if parallel.layout == "zigzag":
            a = zigzag_unpermute(a, axis, zigzag_n)
        return a

    return jax.tree.map(gather, x)


def filter_shard_map(fn, *, mesh, in_specs, out_specs, **kwargs):
    """`jax.shard_map` for arguments that hold Equinox modules: the Equinox idiom
    (`eqx.filter_jit`, `eqx.filter_grad`) for `shard_map`.

    A module's non-array leaves (its [`ParallelConfig`][], activation functions) are
    not JAX types, so `jax.shard_map` cannot take them; here every argument is
    split with `eqx.partition(args, eqx.is_array)`, only the arrays cross the
    `shard_map` boundary, and `fn` gets the modules back whole on every device.
    [`partition_specs`][]`(module, mesh)` is the in_spec of a module (its non-array
    leaves get `None`, which matches). Under FSDP (`fsdp_axes`), a parameter whose
    in_spec names an FSDP axis reaches `fn` as an [`FSDPShard`][] (which the modules
    gather just before use, [`fsdp_gather`][]), and any `FSDPShard` `fn` returns (e.g.
    in gradients) leaves as its local slice. `fn` must return arrays (or `None` leaves,
    as `eqx.filter_grad`'s gradients have).

    **Arguments:**

    - `fn`: the per-device function.
    - `mesh`, `in_specs`, `out_specs`, `**kwargs`: as for `jax.shard_map`; `in_specs`
        is a tuple with one entry per positional argument.

    **Returns:**

    A function of the same arguments as `fn`, callable under `eqx.filter_jit`, or
    under `jax.jit` when it closes over the modules.
    """

    in_specs = tuple(in_specs)

    def call(*args):
        dynamic, static = eqx.partition(args, eqx.is_array)
        fsdp = [fsdp_axes_of(arg) for arg in args]

        def per_device(*dynamic):
            # Parameters split over FSDP axes enter as `FSDPShard`s (their in_spec says
            # which dimension), for the modules to gather just before use.
            args = eqx.combine(dynamic, static)
            if len(in_specs) == len(args):
                args = tuple(wrap_shards(a, spec, axes) if axes else a
                             for a, spec, axes in zip(args, in_specs, fsdp))
            return unwrap_shards(fn(*args))

        return jax.shard_map(
            per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kwargs
        )(*dynamic)

    return call
