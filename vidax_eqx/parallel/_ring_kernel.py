"""`make_ring_attention`: ring attention as a kernel object built once from a 2D mask.

The API of the splash-based ring attention kernels (`make_ring_attention(mask,
...)`, then `kernel(q, k, v, segment_ids=..., sinks=...)` inside `shard_map`), on
top of [`ring_attention`][]: the kernel is an `eqx.Module`, so a PyTree whose mask
arrays are leaves and whose options are static, and it can be passed through
`jax.jit` or closed over. The masks themselves ([`AbstractMask`][] and its
subclasses, over global positions) are `_masks.py`'s.

How a mask runs. Full, causal and local masks, and any `&` / `|` of them, are one
window on `kv_pos - q_pos` (every such window contains the diagonal, so the union
of two is again a window): they run exactly as `ring_attention(causal=...,
window=...)`, from positions alone. A mask with a dense part is split into the
positional factors of its top-level `&` (still given to the kernel as `causal` /
`window`) and the rest, whose `(query part, key part)` sub-block at the global
positions of each step is passed to the kernel as `mask=`; the backward step
calls the same function with the same positions, so it sees the same block. The
ring's step plan comes from which blocks of the whole mask hold some / only
`True` ([`AbstractMask.block_visibility`][]): key blocks (in the zigzag layout,
half-blocks) that the mask hides entirely are skipped, and blocks it does not
touch run without `mask=` (as fast as no mask); the blockwise kernel then skips
hidden tiles inside the blocks that get one.
"""

import functools
from collections.abc import Hashable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .. import kernels
from ._checks import check_sp_size
from ._layout import check_layout, check_zigzag_length, layout_parts
from ._masks import AbstractMask, as_mask, block_tables, sliding_tile, split, Window
from ._mesh import axis_size
from ._request import check_ring
from ._ring_engine import ring
from ._schedule import plan_from_table, plan_work, ring_work, tile_plan


# -- the step mask the ring runs ----------------------------------------------------


class _StepMask(eqx.Module):
    """The step mask of one ring call (see `_ring_engine._step_plan`): the part of the
    mask handed to the kernel as `mask=`, and the ring's plan for the whole mask,
    static (`static_plan`) or traced (`traced_plan`)."""

    rest: AbstractMask
    traced_plan: Int[Array, "n n"] | None
    static_plan: tuple[tuple[int, ...], ...] | None = eqx.field(static=True)

    def plan(self):
        if self.static_plan is not None:
            return np.asarray(self.static_plan, np.int32)
        return self.traced_plan

    def block(self, q_pos, kv_pos):
        return self.rest.block(q_pos, kv_pos)


def _kernel_window(window: Window) -> tuple[bool, Window | None]:
    """A window on `kv_pos - q_pos` as the kernel's `(causal, window)` options."""
    if window == (None, None):
        return False, None
    if window == (None, 0):
        return True, None
    return False, window


def _mask_plan(mask: AbstractMask, layout: str, n: int, L: int):
    """The ring's `(n, n)` plan for `mask` (NumPy when decided statically): hidden
    steps skipped, steps the mask does not touch run without `mask=`."""
    some, every = block_tables(mask, n * L, L // layout_parts(layout))
    xp = np if isinstance(some, np.ndarray) else jnp
    return plan_from_table(layout, n, some, xp, full_table=every)


# -- the kernel object --------------------------------------------------------------


def _check_block_sizes(block_sizes) -> tuple[int, int] | None:
    if block_sizes is None:
        return None
    if isinstance(block_sizes, (tuple, list)):
        sizes = tuple(block_sizes)
    elif hasattr(block_sizes, "block_q") and hasattr(block_sizes, "block_kv"):
        sizes = (block_sizes.block_q, block_sizes.block_kv)
    else:
        sizes = None
    if (
        sizes is None
        or len(sizes) != 2
        or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1 for s in sizes)
    ):
        raise ValueError(
            "`block_sizes` must be None, a pair (block_q, block_kv) of positive ints, or an "
            "object with positive int attributes `block_q` and `block_kv` (such as splash "
            f"attention's BlockSizes); received {block_sizes!r}."
        )
    return int(sizes[0]), int(sizes[1])


class RingAttentionKernel(eqx.Module):
    """Ring attention with a fixed mask, callable inside `jax.shard_map`.

    Build it with [`make_ring_attention`][] (which documents the options). It is an
    `eqx.Module`: its mask arrays are PyTree leaves and its options static, so it
    can be closed over or passed as an argument through `jax.jit`.
    """

    mask: AbstractMask
    ring_axis: Hashable = eqx.field(static=True)
    layout: str = eqx.field(static=True)
    is_mqa: bool = eqx.field(static=True)
    scale: float | None = eqx.field(static=True)
    logits_soft_cap: float | None = eqx.field(static=True)
    block_sizes: tuple[int, int] | None = eqx.field(static=True)
    mask_value: float | None = eqx.field(static=True)
    q_seq_shards: int = eqx.field(static=True)
    implementation: str | kernels.AbstractImplementation = eqx.field(static=True)

    def __init__(
        self,
        mask,
        *,
        block_sizes=None,
        is_mqa: bool = False,
        mask_value: float | None = None,
        logits_soft_cap: float | None = None,
        ring_axis: Hashable = "sp",
        q_seq_shards: int = 1,
        implementation: str | kernels.AbstractImplementation = "auto",
        layout: str = "contiguous",
        scale: float | None = None,
    ):
        """**Arguments:** as for [`make_ring_attention`][], which builds it."""
        self.mask = as_mask(mask)
        if not isinstance(is_mqa, (bool, np.bool_)):
            raise ValueError(f"`is_mqa` must be a bool; received {is_mqa!r}.")
        if mask_value is not None:
            try:
                mask_value = float(mask_value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"`mask_value` must be a number or None; received {mask_value!r}."
                ) from None
        if isinstance(q_seq_shards, bool) or not isinstance(q_seq_shards, (int, np.integer)) or q_seq_shards < 1:
            raise ValueError(f"`q_seq_shards` must be a positive int; received {q_seq_shards!r}.")
        if q_seq_shards != 1:
            raise NotImplementedError(
                f"make_ring_attention: q_seq_shards={q_seq_shards} is not supported; the ring "
                "splits the sequence over `ring_axis` only (q_seq_shards=1). Shard heads or "
                "batch over other mesh axes instead."
            )
        self.block_sizes = _check_block_sizes(block_sizes)
        if self.block_sizes is not None and isinstance(implementation, kernels.AbstractImplementation):
            raise ValueError(
                "give the block sizes once: either `block_sizes=` or a configured "
                f"`implementation=` instance; received both ({block_sizes!r}, {implementation!r})."
            )
        self.layout = check_layout(layout)
        self.ring_axis = ring_axis
        self.is_mqa = bool(is_mqa)
        self.mask_value = mask_value
        self.q_seq_shards = int(q_seq_shards)
        self.scale = None if scale is None else float(scale)
        self.logits_soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
        self.implementation = implementation

    def _implementation(self):
        """The kernel each ring step runs: `block_sizes` configure the blockwise one."""
        if self.block_sizes is not None and self.implementation in ("auto", "blockwise"):
            return kernels.Blockwise(block_q=self.block_sizes[0], block_kv=self.block_sizes[1])
        return self.implementation

    def _seq_len(self, seq_len: int | None) -> int:
        expected = self.mask.seq_len()
        if seq_len is not None and expected is not None and seq_len != expected:
            raise ValueError(
                f"the mask covers a global sequence of {expected} tokens, but the ring holds "
                f"{seq_len} (sp_size x local length). Build the mask for the global (padded) "
                "sequence, or shard the sequence it was built for."
            )
        return expected if seq_len is None else seq_len

    def __call__(
        self,
        q: Float[Array, "B L H D"],
        k: Float[Array, "B L H_kv D"] | Float[Array, "B L D"],
        v: Float[Array, "B L H_kv D"] | Float[Array, "B L D"],
        segment_ids: kernels.SegmentIds | Int[Array, "B L"] | None = None,
        sinks: Float[Array, " H"] | None = None,
    ) -> Float[Array, "B L H D"]:
        """Ring attention of this device's block of the global sequence.

        **Arguments:**

        - `q`: this device's queries `(B, L, H, D)`.
        - `k`, `v`: `(B, L, H_kv, D)` with `H % H_kv == 0`; with `is_mqa=True`,
            `H_kv` must be 1 (a `(B, L, D)` array is taken as that one head).
        - `segment_ids`: this device's ids, `(B, L)` or `SegmentIds(q=..., kv=...)`;
            ANDed with the mask. Negative ids are padding.
        - `sinks`: per-head sink logits `(H,)`, usually replicated.

        **Returns:**

        This device's output `(B, L, H, D)` in `q`'s dtype; a row that sees nothing
        gives 0.

        Raises `ValueError("Ring axis 'sp' does not exist in the current context. ...")`
        outside a `shard_map` that binds `ring_axis`, and when the shapes do not fit
        the mask.
        """
        n = axis_size(self.ring_axis, what="Ring")
        q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
        if self.is_mqa:
            if k.ndim == 3 and v.ndim == 3:
                k, v = k[:, :, None], v[:, :, None]
            if k.ndim != 4 or k.shape[2] != 1 or v.shape != k.shape:
                raise ValueError(
                    "is_mqa=True means one key/value head: k and v must be (B, L, 1, D) or "
                    f"(B, L, D); received k: {k.shape}, v: {v.shape}. Use is_mqa=False for GQA."
                )
        if q.ndim == 4 and k.ndim == 4 and q.shape[1] != k.shape[1]:
            raise ValueError(
                "the kernel attends one global sequence to itself: q and k must hold the same "
                f"local length L; received q: {q.shape}, k: {k.shape}."
            )
        window, tile_mask = self._tile_split()
        step_mask = None
        if tile_mask is not None:  # ring_attention(mask=...), which checks the length
            causal, window = _kernel_window(window)
        elif self.mask.window() is not None:  # positional: causal / window, no mask array
            self._seq_len(n * q.shape[1])
            causal, window = _kernel_window(self.mask.window())
        else:  # the positional factors as causal / window, the rest as `mask=` blocks
            self._seq_len(n * q.shape[1])
            window, rest = split(self.mask)
            causal, window = _kernel_window(window)
            step_mask = functools.partial(self._step_mask, rest)
        with jax.named_scope("vidax_ring_attention_kernel"):
            _, sinks = check_ring(
                "ring_attention", q, k, v, axis_name=self.ring_axis, sp_size=n,
                layout=self.layout, segment_ids=segment_ids, causal=causal, window=window,
                scale=self.scale, logits_soft_cap=self.logits_soft_cap, tile_mask=tile_mask,
                kv_lengths=None, sinks=sinks, step_mask=step_mask is not None,
            )
            return ring(
                q, k, v, axis_name=self.ring_axis, sp_size=n, causal=causal,
                segment_ids=segment_ids, sinks=sinks, window=window, scale=self.scale,
                logits_soft_cap=self.logits_soft_cap, layout=self.layout,
                implementation=self._implementation(), step_mask=step_mask, tile_mask=tile_mask,
            )

    def _tile_split(self) -> tuple[Window, "kernels.SlidingTileMask | None"]:
        """`(window, tile_mask)` when the mask is a sliding tile mask `&`-ed with positional
        masks only (it then runs from positions alone), else `(_, None)`."""
        window, rest = split(self.mask)
        return window, sliding_tile(rest)

    def _step_mask(self, rest: AbstractMask, n: int, L: int) -> _StepMask:
        plan = _mask_plan(self.mask, self.layout, n, L)
        if isinstance(plan, np.ndarray):
            return _StepMask(rest, None, tuple(map(tuple, plan.tolist())))
        return _StepMask(rest, plan, None)

    def work(self, sp_size: int, seq_len: int | None = None) -> np.ndarray:
        """Per-device work of the forward ring, as it schedules this mask.

        Like [`ring_work`][]: for each device, the (query, key) pairs of the blocks
        handed to the attention kernel over all ring steps, after the ring skipped
        the blocks (zigzag: half-blocks) the mask hides entirely. The backward
        schedules the same blocks.

        **Arguments:**

        - `sp_size`: the number of devices on the ring.
        - `seq_len`: the global sequence length; default the mask's.

        **Returns:**

        int64 NumPy array `(sp_size,)`. Needs a concrete mask (not traced).
        """
        n = check_sp_size(sp_size)
        S = self._seq_len(seq_len)
        if S is None:
            raise ValueError("this mask has no length of its own: pass `seq_len`.")
        if S % n:
            raise ValueError(f"`seq_len` must be a multiple of sp_size={n}; received {S}.")
        L = S // n
        window, tile_mask = self._tile_split()
        if tile_mask is not None:
            causal, window = _kernel_window(window)
            plan = tile_plan(tile_mask, self.layout, n, L, L, causal, window)
            return plan_work(plan, self.layout, n, L)
        window = self.mask.window()
        if window is not None:
            causal, window = _kernel_window(window)
            return ring_work(S, n, layout=self.layout, causal=causal, window=window)
        if self.layout == "zigzag":
            check_zigzag_length(L, "local length", f"Use a multiple of 2 * sp_size = {2 * n}.")
        plan = _mask_plan(self.mask, self.layout, n, L)
        if not isinstance(plan, np.ndarray):
            raise ValueError("`work` needs a concrete mask; this one is traced.")
        return plan_work(plan, self.layout, n, L)


def make_ring_attention(
    mask,
    *,
    block_sizes=None,
    is_mqa: bool = False,
    mask_value: float | None = None,
    logits_soft_cap: float | None = None,
    ring_axis: Hashable = "sp",
    q_seq_shards: int = 1,
    implementation: str | kernels.AbstractImplementation = "auto",
    layout: str = "contiguous",
    scale: float | None = None,
) -> RingAttentionKernel:
    """Builds a ring attention kernel for a fixed 2D mask (the splash ring API).

    ```python
    kernel = make_ring_attention(CausalMask() & LocalMask((1024, 0)), ring_axis="sp")

    @jax.jit
    def step(kernel, q, k, v, seg):
        f = lambda q, k, v, seg: kernel(q, k, v, segment_ids=seg)
        return jax.shard_map(f, mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q, k, v, seg)
    ```

    The kernel runs [`ring_attention`][] with the mask: each ring step hands the
    kernel only its `(query block, key block)` sub-mask at the blocks' global
    positions (the backward step the same one), and key blocks the mask hides
    entirely are skipped. Gradients with respect to `q`, `k`, `v` and `sinks` equal
    single-device attention's with the same global mask.

    **Arguments:**

    - `mask`: over the global positions of the sequence (`True` = may attend): a
        boolean `(S, S)` NumPy array, or a mask object ([`FullMask`][],
        [`CausalMask`][], [`LocalMask`][], [`DenseMask`][], and their `&` / `|`), or a
        [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask] (sliding tile
        attention; alone or `&`-ed with positional masks it runs as
        `ring_attention(mask=...)`, never materialized, per-head windows allowed, and
        the global sequence may be its `seq_len` padded by less than a tile per chunk).
        There is no `causal` flag: causal attention is a `CausalMask` (with a dense
        mask: `dense & CausalMask()`). Segment ids given at call time are ANDed
        with the mask. One mask serves every batch element and head.
    - `block_sizes`: the tile sizes `(block_q, block_kv)` of the blockwise kernel
        each step runs, as a pair or an object with `block_q` and `block_kv` (such as
        splash's `BlockSizes`; its other fields are ignored: the blockwise backward
        uses the same tiles). With `implementation="auto"` or `"blockwise"` the steps
        run `kernels.Blockwise(block_q, block_kv)`; another named implementation
        (the `"xla"` reference has no tiles) accepts and ignores them.
    - `is_mqa`: one key/value head: `k`, `v` are `(B, L, 1, D)` (or `(B, L, D)`);
        checked at call time. Without it, any GQA `H % H_kv == 0` works.
    - `mask_value`: accepted for compatibility and ignored: vidax masks exactly
        (hidden logits are `-inf`, a row that sees nothing gives 0, never NaN), so
        no finite stand-in value is needed. Must be a number or `None`.
    - `logits_soft_cap`: `c` applies `c * tanh(s / c)` to the scaled logits.
    - `ring_axis`: the mesh axis of the ring.
    - `q_seq_shards`: must be 1 (the ring shards the sequence over `ring_axis`
        alone); other values raise `NotImplementedError`.
    - `implementation`: the kernel of each ring step, as in
        `vidax_eqx.kernels.attention` (it must serve boolean masks when the mask has
        a dense part).
    - `layout`: `"contiguous"` (rank `r` holds the `r`-th block) or `"zigzag"` (rank
        `r` holds chunks `r` and `2n - 1 - r` of `2n`), as in [`ring_attention`][].
        The mask stays in global order in both: with zigzag, permute q, k, v and
        segment ids with `zigzag_permute` (never the mask) and unpermute the
        output; the kernel takes each block's sub-mask at its global positions, and
        skips hidden half-blocks.
    - `scale`: the logit scale, default `1 / sqrt(D)` as everywhere in vidax. The
        splash kernels do not scale: pass `scale=1.0` for queries scaled beforehand.

    **Returns:**

    A [`RingAttentionKernel`][]: call it as `kernel(q, k, v, segment_ids=None,
    sinks=None)` inside `jax.shard_map` with this device's `(B, L, H, D)` blocks
    (the global length `S = sp_size * L` must be the mask's). Outside a context
    that binds `ring_axis` it raises `ValueError("Ring axis 'sp' does not exist in
    the current context. ...")`.

    **Skipping and cost:** positional masks (full, causal, local and their `&` /
    `|`, which are always one window on `kv_pos - q_pos`) run from positions alone,
    exactly as `ring_attention(causal=..., window=...)`. A mask with a dense part
    plans each step from its block visibility: a block it hides entirely is
    skipped, a block it does not touch runs without a mask (as fast as no mask),
    any other gets its sub-mask (and the blockwise kernel skips the hidden tiles
    in it). The plan is made at trace time when the arrays are concrete (closed
    over, or built from NumPy), so skipped steps are not even traced; on device,
    from the traced mask, when the kernel is a `jax.jit` argument (every step then
    sits behind a `lax.switch`). A dense mask is `S^2` bytes on every device.
    """
    return RingAttentionKernel(
        mask,
        block_sizes=block_sizes,
        is_mqa=is_mqa,
        mask_value=mask_value,
        logits_soft_cap=logits_soft_cap,
        ring_axis=ring_axis,
        q_seq_shards=q_seq_shards,
        implementation=implementation,
        layout=layout,
        scale=scale,
    )
