"""`ParallelConfig`: how a layer is split over a device mesh, by the role of each mesh
axis (static, hashable); and the one answer to "which axes is the sequence on, which
axes are the heads on" that every layer and model reads."""

import dataclasses
import functools

import jax

from ..._deprecation import warn_deprecated
from ...parallel import LAYOUTS, SP_AXIS


SEQUENCE_MODES = ("none", "ulysses", "ring", "usp")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How a layer runs over a device mesh: the role of each mesh axis. Immutable and
    hashable.

    The configuration only chooses which collective functions of
    [`vidax_eqx.parallel`][] a layer calls; the layer's parameters are the same
    (global shapes) whatever it says. `ParallelConfig()` is a single device. Anything
    else runs inside `jax.shard_map` over a mesh that has the named axes, with the
    parameters placed by [`vidax_eqx.nn.sharding.partition_specs`][].

    Layers hold it as an ordinary field: a non-array *leaf*, not part of the tree
    structure, so the single-device layer and all its
    [`with_parallel`][vidax_eqx.nn.sharding.with_parallel] variants share one structure
    (one optax state, one set of specs, one checkpoint layout). Like any non-array
    field it is static under `eqx.filter_jit` (hashed into the cache key); plain
    `jax.jit` does not take a module argument (close over it, or use Equinox's
    filtered transformations and
    [`filter_shard_map`][vidax_eqx.nn.sharding.filter_shard_map]). Inside `shard_map`
    the layers check their call against it and raise on a mismatch.

    **Sequence parallelism**, by role: the sequence is split over `ulysses_axis`
    (DeepSpeed-Ulysses: `all_to_all` from a sequence split to a head split), over
    `ring_axis` (ring attention), or over both (USP, 2D: sharded ring-major,
    `PartitionSpec((ring_axis, ulysses_axis))`). `sequence` names the mode; give it
    alone for the default axis name (`"sp"`), the axes alone, or both:

    | `sequence` | axes | default axes |
    |---|---|---|
    | `"none"` | none | |
    | `"ulysses"` | `ulysses_axis` | `ulysses_axis="sp"` |
    | `"ring"` | `ring_axis` | `ring_axis="sp"` |
    | `"usp"` | both, different | `ulysses_axis="sp"`; `ring_axis` required |

    **Fields:**

    - `sequence`: the mode, `"none"`, `"ulysses"`, `"ring"` or `"usp"`; default (`None`):
        read off the axes given.
    - `ulysses_axis`: the mesh axis of Ulysses' `all_to_all` (the local head count
        must be a multiple of its size), or `None`.
    - `ring_axis`: the mesh axis of the ring, or `None`.
    - `layout`: `"contiguous"` (device `r` holds the `r`-th chunk) or `"zigzag"` (with
        a ring only: the sequence, and every per-token input such as the RoPE tables
        and segment ids, permuted by `vidax_eqx.parallel.zigzag_permute` over the ring
        before sharding; [`shard_tokens`][vidax_eqx.nn.sharding.shard_tokens] does it).
    - `tp_axis`: the tensor-parallel (Megatron) mesh axis, or `None`. With an axis,
        heads are split over it: q/k/v column-parallel, the output projection
        row-parallel with one `psum`.
    - `fsdp_axes`: the mesh axes (data and sequence axes; never `tp_axis`) over which
        every parameter is split (FSDP / ZeRO-3), or `()`.
        [`partition_specs`][vidax_eqx.nn.sharding.partition_specs] puts them on one
        dimension of each parameter (the largest one that `tp` does not split and that
        their size divides); inside `shard_map` each layer gathers its own weights just
        before it uses them ([`fsdp_gather`][vidax_eqx.nn.sharding.fsdp_gather]), so
        gradients come back reduce-scattered. Every FSDP axis must carry different data
        (the batch or the sequence), or its devices would compute the same thing.
    - `fsdp_regather`: `True` (default, ZeRO-3): under a model's scanned blocks the
        gathered weights of a block are not kept for the backward pass but gathered
        again there, so at most about one block is gathered at a time. `False` keeps
        them from the forward (one gather per block and step instead of two, but the
        whole model gathered on every device by the end of the forward).

    The answers every layer and model reads: [`sequence_axes`][ParallelConfig.sequence_axes]
    (the axes the tokens are split over) and [`head_axes`][ParallelConfig.head_axes]
    (the axes the attention heads are split over).
    """

    sequence: str | None = None
    ulysses_axis: str | None = None
    ring_axis: str | None = None
    layout: str = "contiguous"
    tp_axis: str | None = None
    fsdp_axes: tuple[str, ...] = ()
    fsdp_regather: bool = True

    def __post_init__(self):
        sequence, ulysses, ring = self.sequence, self.ulysses_axis, self.ring_axis
        for name, axis in (("ulysses_axis", ulysses), ("ring_axis", ring), ("tp_axis", self.tp_axis)):
            if axis is not None and (not isinstance(axis, str) or not axis):
                raise ValueError(f"`{name}` must be a mesh axis name (a str) or None; received "
                                 f"{axis!r}.")
        if sequence is None:
            sequence = ("usp" if ulysses and ring else "ulysses" if ulysses else "ring" if ring
                        else "none")
        elif sequence not in SEQUENCE_MODES:
            raise ValueError(
                f"`sequence` must be one of {SEQUENCE_MODES}; received {sequence!r}."
            )
        else:
            if sequence in ("ulysses", "usp") and ulysses is None:
                ulysses = SP_AXIS
            if sequence == "ring" and ring is None:
                ring = SP_AXIS
            roles = {"none": (False, False), "ulysses": (True, False), "ring": (False, True),
                     "usp": (True, True)}[sequence]
            for name, axis, wanted in (("ulysses_axis", ulysses, roles[0]),
                                       ("ring_axis", ring, roles[1])):
                if wanted and axis is None:
                    raise ValueError(
                        "sequence='usp' runs Ulysses over `ulysses_axis` and a ring over "
                        "`ring_axis`, two different mesh axes; received ulysses_axis="
                        f"{ulysses!r}, ring_axis=None. Pass e.g. ring_axis='ring' "
                        "(make_mesh(sp=U, extra_axes={'ring': R}))."
                    )
                if not wanted and axis is not None:
                    mode = "usp" if sequence in ("ulysses", "ring") else (
                        "ulysses" if name == "ulysses_axis" else "ring")
                    raise ValueError(
                        f"`{name}` is not used by sequence={sequence!r}; received {name}="
                        f"{axis!r}. Drop it, or use sequence={mode!r} (or leave `sequence` "
                        "out: the axes given say the mode)."
                    )
        if ulysses is not None and ulysses == ring:
            raise ValueError(
                "sequence='usp' runs Ulysses and a ring over two different mesh axes; "
                f"received ulysses_axis={ulysses!r}, ring_axis={ring!r}."
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"`layout` must be one of {LAYOUTS}; received {self.layout!r}.")
        if self.layout == "zigzag" and ring is None:
            raise ValueError(
                "`layout='zigzag'` is a ring layout: it needs a ring (sequence='ring' or "
                f"'usp'); received sequence={sequence!r}. Use layout='contiguous'."
            )
        if self.tp_axis is not None and self.tp_axis in (ulysses, ring):
            raise ValueError(
                f"`tp_axis` must differ from the sequence axes; received tp_axis="
                f"{self.tp_axis!r}, ulysses_axis={ulysses!r}, ring_axis={ring!r}."
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
        object.__setattr__(self, "sequence", sequence)
        object.__setattr__(self, "ulysses_axis", ulysses)
        object.__setattr__(self, "ring_axis", ring)
        object.__setattr__(self, "fsdp_axes", axes)

    @property
    def sequence_axes(self) -> tuple[str, ...]:
        """The mesh axes the sequence is split over, major to minor: `(ring_axis,
        ulysses_axis)` for USP (ring-major), one axis for Ulysses or a ring, `()` on one
        device. A token array's `PartitionSpec` entry is `sequence_axes` (one axis
        unpacked): `P(parallel.sequence_axes)` for one example's `(S, dim)` tokens."""
        return tuple(a for a in (self.ring_axis, self.ulysses_axis) if a is not None)

    @property
    def head_axes(self) -> tuple[str, ...]:
        """The mesh axes the attention heads are split over inside the kernel, major to
        minor: `tp_axis` (Megatron: each device's q/k/v columns are its heads), then
        `ulysses_axis` (the `all_to_all` splits each device's heads over it); `()` when
        every device computes every head."""
        return tuple(a for a in (self.tp_axis, self.ulysses_axis) if a is not None)

    @property
    def sp_axis(self) -> str:
        """Deprecated (0.1.0's one sequence axis; removed in 0.3.0): `ulysses_axis` under
        Ulysses and USP, `ring_axis` under a ring, `"sp"` on one device."""
        warn_deprecated("ParallelConfig.sp_axis",
                        "ParallelConfig.ulysses_axis / .ring_axis (or .sequence_axes)")
        return self.ulysses_axis or self.ring_axis or SP_AXIS


_UNSET = object()


def _accept_sp_axis(init):
    """`ParallelConfig(sp_axis=...)`, 0.1.0's spelling, as the axis of its role: Ulysses'
    (`"ulysses"`, and `"usp"`, whose ring went to `ring_axis`) or the ring's (`"ring"`);
    with one device (`"none"`, then the default) it named nothing."""

    @functools.wraps(init)
    def __init__(self, *args, sp_axis=_UNSET, **kwargs):
        if sp_axis is not _UNSET:
            warn_deprecated("ParallelConfig(sp_axis=...)",
                            "`ulysses_axis=` (Ulysses, USP) or `ring_axis=` (a ring)")
            sequence = args[0] if args else kwargs.get("sequence")
            role = {"ulysses": "ulysses_axis", "usp": "ulysses_axis", "ring": "ring_axis"}.get(
                sequence)
            if role is not None:
                if kwargs.get(role) is not None or len(args) > (1 if role == "ulysses_axis" else 2):
                    raise TypeError(f"ParallelConfig() got both `sp_axis` (deprecated) and "
                                    f"`{role}`: pass `{role}` only.")
                kwargs[role] = sp_axis
        init(self, *args, **kwargs)

    return __init__


ParallelConfig.__init__ = _accept_sp_axis(ParallelConfig.__init__)


def agreed(tree, field: str):
    """The one value of `field` that the [`ParallelConfig`][]s in `tree` set (ignoring
    those that leave it empty), or `None`; a `ValueError` when they differ."""
    found = {getattr(x, field) for x in jax.tree.leaves(tree) if isinstance(x, ParallelConfig)}
    found -= {None, ()}
    if len(found) > 1:
        raise ValueError(
            f"the modules of one model must agree on their ParallelConfig's {field} (one "
            f"placement of the whole model); received {sorted(found, key=str)}. Set one "
            "configuration with nn.sharding.with_parallel(model, config)."
        )
    return found.pop() if found else None


def fsdp_axes_of(tree) -> tuple[str, ...]:
    """The `fsdp_axes` of the [`ParallelConfig`][]s in `tree`: FSDP places a whole model,
    so the configurations that name FSDP axes must agree (those with none, e.g. a
    model's embeddings built without a configuration, follow them); `()` without any."""
    return agreed(tree, "fsdp_axes") or ()


def check_parallel(owner: str, parallel) -> None:
    """Raises unless `parallel` (an argument of `owner`) is a [`ParallelConfig`][]."""
    if not isinstance(parallel, ParallelConfig):
        raise ValueError(
            f"{owner}: `parallel` must be a ParallelConfig; received {type(parallel).__name__}."
        )
