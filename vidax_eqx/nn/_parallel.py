"""`ParallelConfig`: how an attention module is split over a device mesh (static)."""

import dataclasses

from ..parallel import SP_AXIS


SEQUENCE_MODES = ("none", "ulysses", "ring", "usp")
LAYOUTS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How an attention module runs over a device mesh: static and hashable.

    The configuration only chooses which collective functions of
    [`vidax_eqx.parallel`][] the module calls; the module's parameters are the
    same (global shapes) whatever it says. `ParallelConfig()` is a single device.
    Anything else runs inside `jax.shard_map` over a mesh that has the named axes,
    with the parameters placed by [`vidax_eqx.nn.partition_specs`][].

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
    """

    sequence: str = "none"
    sp_axis: str = SP_AXIS
    ring_axis: str | None = None
    layout: str = "contiguous"
    tp_axis: str | None = None

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
