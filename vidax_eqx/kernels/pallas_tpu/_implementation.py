"""`"pallas_tpu"`: JAX's Pallas TPU attention kernels behind the common contract.

Two kernels, chosen per request:

- **splash attention** (`jax.experimental.pallas.ops.tpu.splash_attention`) for
  every request without a bias or a boolean mask: GQA without repeating K/V,
  causal and sliding-window masks and the padding keys (`SplashPositionsMask`),
  the sliding tile mask (`SplashTileMask`), each a static mask whose block-sparse
  structure, computed at trace time, skips the hidden blocks and evaluates the mask
  in the kernel only on partially visible ones; segment ids and the logit soft cap.
  Its tiles, the fused backward and the VMEM limit come from the chip's tuning table
  (`_tuning.py`) unless given;
- **flash attention** (`jax.experimental.pallas.ops.tpu.flash_attention`) when a
  bias or a boolean mask is given (the mask is folded into the bias); it takes
  causal masks and segment ids too, but neither a window nor a soft cap.

Both are adapted by `_adapt`: sequences are padded to multiples of the tiles (the
flash kernel excludes the padding through segment ids), rows that see nothing give 0 and
`lse = -inf`, sinks are added exactly from the lse, and the backward runs the
kernels' own backward passes from the contract's (possibly ring-merged) `lse`
and `delta - dlse`. The softmax scale is folded into `q` (splash takes none, and
flash's would also scale the bias).

The kernels' entry points that return the log-sum-exp and take one in the
backward are private to JAX, and `jax.experimental.pallas.ops` is undocumented:
every name from it comes through `vidax_eqx._jax_private` (where each call we
rely on is recorded and tested), and a JAX without one of them leaves
`"pallas_tpu"` unregistered rather than broken.
"""

import contextlib
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from ..._jax_private import (
    FLASH_DEFAULT_MASK_VALUE,
    FlashSegmentIds,
    flash_attention_bwd_dkv,
    flash_attention_bwd_dq,
    flash_attention_impl,
    splash_attention_bwd_dkv,
    splash_attention_bwd_dq,
    splash_vmem_limit,
    SplashSegmentIds,
)
from ..._vma import opaque_to_vma
from .. import _adapt as a
from .. import _math as m
from .._args import Operands, Options
from .._base import AbstractImplementation, Capabilities, Request
from .._tile import SlidingTileMask
from . import _gather, _gather_plan, _sliding
from ._int8 import int8_attention
from .. import _int8
from ._mask import in_program, splash_kernel_for
from ._tuning import choose_blocks, LANES as _LANES, SplashBlocks


F32 = jnp.float32
# The request's features the int8 kernel does not compute (it serves full attention).
_MASKING = ("bias", "mask", "segment_ids", "causal", "window", "positions", "sinks",
            "logits_soft_cap", "tile_mask", "block_causal", "kv_lengths")


def _heads_major(x: jax.Array, length: int) -> jax.Array:
    """`(B, S, H, D)` -> the kernels' `(B, H, length, D)`, padded at the end."""
    return a.pad_axis(jnp.swapaxes(x, 1, 2), 2, length)


def _heads_minor(x: jax.Array, length: int) -> jax.Array:
    """The inverse of `_heads_major`: `(B, H, S_pad, D)` -> `(B, length, H, D)`."""
    return jnp.swapaxes(x[:, :, :length], 1, 2)


class _Group(NamedTuple):
    """One splash kernel and the heads it serves: `heads`, the query heads (`None`:
    all, in order); `kv_heads`, the key/value heads in the kernel's order (`None`:
    all), for query heads in groups of `len(heads) // len(kv_heads)`."""

    kernel: object
    heads: tuple[int, ...] | None
    kv_heads: tuple[int, ...] | None


def _head_groups(tm: SlidingTileMask | None, heads: int, kv_heads: int):
    """`[(head_mask, heads, kv_heads)]`: the query heads of each distinct head mask
    (one head's sliding tile mask, or `None`), as `_Group` takes them.

    Splash computes a mask in the kernel only when all its heads share one mask;
    per-head masks that differ would have their partially visible blocks
    materialized instead (`(n, block_q, block_kv)` booleans: about 350 MB per window
    at Wan 480p). So each distinct head window gets a kernel of its own, over its
    query heads and their key/value heads: whole GQA groups when the window's heads
    are whole groups, else one key/value head per query head.
    """
    if tm is None or tm.heads is None:
        return [(tm, None, None)]
    by_mask: dict[SlidingTileMask, list[int]] = {}
    for h in range(heads):
        by_mask.setdefault(tm.select_heads(h, 1), []).append(h)
    if len(by_mask) == 1:
        ((head_mask, _),) = by_mask.items()
        return [(head_mask, None, None)]
    G = heads // kv_heads
    groups = []
    for head_mask, members in by_mask.items():
        kv = sorted({h // G for h in members})
        whole = members == [j * G + g for j in kv for g in range(G)]
        groups.append((head_mask, tuple(members), tuple(kv) if whole else tuple(h // G for h in members)))
    return groups


def _take(x: jax.Array, heads) -> jax.Array:
    """Heads `heads` of `x (B, H, ...)` (all when `None`)."""
    return x if heads is None else jnp.take(x, np.asarray(heads), axis=1)


def _merge(parts: list[jax.Array], groups: list[_Group]) -> jax.Array:
    """The per-group results `(B, len(heads), ...)` back in head order."""
    if len(parts) == 1 and groups[0].heads is None:
        return parts[0]
    order = np.argsort(np.concatenate([g.heads for g in groups]))
    return jnp.take(jnp.concatenate(parts, axis=1), order, axis=1)


def _without_lse(kernel):
    """The splash kernel `kernel` returning its output alone (no lse residual)."""
    return type(kernel)(kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info,
                        **{**kernel.kwargs, "save_residuals": False})


def _collapse(mask_info):
    """The reshape `_jax_private.splash_attention` applies before its kernels."""
    if mask_info.partial_mask_blocks is None:
        return mask_info
    blocks = mask_info.partial_mask_blocks
    return mask_info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))


def _kernel_precision(dtype):
    """The matmul precision the kernels of `dtype` inputs are traced with: for 16-bit
    inputs the default, whatever the caller's `jax.default_matmul_precision` (Mosaic
    refuses a float32 contract precision on 16-bit operands: "highest" around a bf16
    call would not compile, and their products are exact in one pass anyway); float32
    inputs keep the caller's."""
    if jnp.dtype(dtype).itemsize == 2:
        return jax.default_matmul_precision("default")
    return contextlib.nullcontext()


def _copied_padding(ops: Operands, opts: Options) -> bool:
    """Whether the forward pads the keys with copies of the last key (and zero values)
    instead of hiding them with the mask: for full attention (no causal mask, window,
    tile mask, segment ids or key lengths) in 16-bit inputs, where hiding them costs a
    masked column of blocks (about 7% of the forward at 32,760 tokens, measured on
    v5e) and copying costs one pass over the output. The copies only add `copies *
    exp(s_last)` to each row's softmax denominator (their values are zero), which
    `_remove_copies` takes out exactly. Float32 keeps the mask: the correction's
    recomputed logit is as exact as the kernel's to float32 rounding, which a row
    dominated by the last key would amplify `copies` times."""
    return (
        not opts.causal and opts.window is None and opts.tile_mask is None
        and opts.block_causal is None and ops.seg_q is None and ops.kv_lengths is None
        and jnp.dtype(ops.q.dtype).itemsize == 2
    )


def _remove_copies(ops: Operands, opts: Options, out, lse, copies: int):
    """The forward of `copies` extra keys equal to the last key, with zero values, made
    the forward without them: with `w = copies * exp(s_last - lse)` (the copies' share of
    each row's denominator, at most `copies / (copies + 1)`), `lse - log1p(-w)` and
    `out / (1 - w)`; `out (B, S_q, H, D)`, `lse (B, H, S_q)` float32."""
    H, H_kv = ops.q.shape[2], ops.k.shape[2]
    q = ops.q * jnp.asarray(opts.scale, ops.q.dtype)  # as the kernel saw it
    k_last = jnp.repeat(ops.k[:, -1], H // H_kv, axis=1)  # (B, H, D)
    s = jnp.einsum("bqhd,bhd->bhq", q, k_last, preferred_element_type=F32)
    if opts.logits_soft_cap is not None:
        s = opts.logits_soft_cap * jnp.tanh(s / opts.logits_soft_cap)
    w = copies * jnp.exp(s - lse)
    lse = lse + jnp.log1p(-w)
    out = (out.astype(F32) / jnp.swapaxes(1 - w, 1, 2)[..., None]).astype(out.dtype)
    return out, lse


@dataclasses.dataclass(frozen=True)
class PallasTpu(AbstractImplementation):
    """JAX's Pallas TPU splash / flash attention kernels.

    **Arguments:**

    - `block_q`, `block_kv`: one tile size for every kernel, forward and backward
        (multiples of 128; shrunk for short sequences). `None` (the default): the
        tiles of the chip's tuning table (see `blocks`).
    - `blocks`: the splash kernels' whole configuration, a
        [`SplashBlocks`][vidax_eqx.kernels.SplashBlocks] (each kernel's tiles, the key
        sub-block computed at a time, the fused backward, the scoped VMEM limit), used as
        given. `None` and no `block_q` / `block_kv`: chosen per chip generation and
        problem from the table measured on that chip
        ([`splash_blocks`][vidax_eqx.kernels.splash_blocks] tells which).
    - `fused_bwd_max_bytes`: the most memory the fused backward's partial dQ (one per
        key tile) may take when the table asks for it; above it the dK/dV and dQ
        kernels run instead. `None`: three eighths of the chip's memory (6 GB on v5e).
    - `sliding_tile`: the kernel of a sliding tile mask: `"gather"`, the tile-gathering
        kernels (each query tile's window of key tiles from K/V held in VMEM, whole
        window runs per matmul, the work following the window); `"splash"`, the splash
        kernel with the mask's block-sparse structure; `"auto"` (default): `"gather"`
        where it serves the request (a mask without text; no causal mask, window,
        segment ids, key lengths or soft cap; the layout's tokens exactly; K/V of a
        key/value head within its VMEM budget), else `"splash"`.
    - `int8_blocks`: `(block_q, block_kv)` of the int8 kernel (`quantize=`); `block_kv`
        is also the scheme's probability block (`kernels/_int8.py`).
    - `interpret`: run the kernels in Pallas interpret mode (on any platform,
        e.g. to test on CPU; slow). Then the default tiles are 512, unfused.

    With a sliding tile mask whose tiles are multiples of 128 tokens, the tiles are
    rounded to whole tiles. A length that is not a multiple of the tiles is padded; the
    padding keys are hidden by the kernel's mask (one column of partially visible
    blocks), not by segment ids compared on every block.

    A [`SlidingTileMask`][vidax_eqx.kernels.SlidingTileMask] runs the splash kernel
    with the mask's block-sparse structure (built in NumPy when the kernel is first
    traced, about a second at Wan 480p): hidden blocks are skipped, fully visible
    ones computed without a mask, partially visible ones with the mask evaluated in
    the kernel. Per-head windows run one kernel per distinct window.
    """

    block_q: int | None = None
    block_kv: int | None = None
    blocks: SplashBlocks | None = None
    fused_bwd_max_bytes: int | None = None
    sliding_tile: str = "auto"
    int8_blocks: tuple[int, int] = (1024, _int8.BLOCK_KV)
    interpret: bool = False

    name = "pallas_tpu"
    capabilities = Capabilities(
        platforms=("tpu",),
        positions=False,
        # A bias or mask takes the flash kernel, which has neither; see `unsupported`.
        window=True,
        logits_soft_cap=True,
        tile_mask=True,
        block_causal=True,
        kv_lengths=True,
        video_sparse=True,
        quantize=("int8-qk", "int8"),
        notes=(
            "int8: full attention alone (no masks, ids, lengths, positions, sinks, bias, soft cap)",
            "a bias or boolean mask runs the flash kernel, which takes neither a sliding "
            "window nor a soft cap (and holds the bias as a dense (B, H, S_q, S_k) array)",
            "lengths are padded to the tiles (per chip and problem, from a table measured "
            "on the chip: kernels.splash_blocks); padding keys are hidden by the kernel's "
            "mask, or in full attention of 16-bit inputs are copies of the last key taken "
            "out of the result exactly; keys beyond kv_lengths by segment ids",
            "no custom positions, yet ring attention runs on it when causal or unmasked "
            "(its steps then need none)",
            "a sliding tile mask without text runs the tile-gathering kernels (its windows "
            "from K/V held in VMEM), else the splash kernel over the whole sequence; not "
            "with custom positions (a chunk), nor with a bias",
            "VSA's fine stage gathers the selected tiles from K/V held in VMEM (tiles padded "
            "to multiples of 8, 16 for 16-bit dtypes), up to 2,304 keys per product forward "
            "and 1,024 backward, in chunks of query tiles whose tables fit SMEM (Wan 480p's "
            "backward: one; 720p's: two); the per-tile kernels when K/V do not fit",
        ),
    )

    def __post_init__(self):
        blocks = self.int8_blocks
        if not (isinstance(blocks, tuple) and len(blocks) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in blocks)
                and blocks[0] % 8 == 0 and blocks[1] % _LANES == 0):
            raise ValueError(
                "PallasTpu `int8_blocks` must be (block_q, block_kv), positive multiples of 8 "
                f"and {_LANES}; received {blocks!r}."
            )
        for field in ("block_q", "block_kv"):
            value = getattr(self, field)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % _LANES
            ):
                raise ValueError(
                    f"PallasTpu `{field}` must be None or a positive multiple of {_LANES}; "
                    f"received {value!r}."
                )
        if self.blocks is not None:
            if not isinstance(self.blocks, SplashBlocks):
                raise ValueError(
                    f"PallasTpu `blocks` must be a SplashBlocks or None; received {self.blocks!r}."
                )
            if self.block_q is not None or self.block_kv is not None:
                raise ValueError(
                    "PallasTpu: give either `blocks` (every kernel's tiles) or `block_q` / "
                    f"`block_kv` (one tile for all), not both; received blocks={self.blocks!r}, "
                    f"block_q={self.block_q!r}, block_kv={self.block_kv!r}."
                )
        if self.sliding_tile not in ("auto", "gather", "splash"):
            raise ValueError(
                "PallasTpu `sliding_tile` must be 'auto', 'gather' or 'splash'; received "
                f"{self.sliding_tile!r}."
            )
        budget = self.fused_bwd_max_bytes
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise ValueError(
                f"PallasTpu `fused_bwd_max_bytes` must be None or a non-negative int; received {budget!r}."
            )

    def unsupported(self, request: Request) -> list[str]:
        missing = self.capabilities.unsupported(request, any_platform=self.interpret)
        if request.quantize is not None:
            missing += [f"quantize={request.quantize!r} with {what} (the int8 kernel computes "
                        "full attention)" for what in _MASKING if getattr(request, what)]
        if request.bias or request.mask:
            what = "a bias" if request.bias else "a boolean mask"
            if request.window:
                missing.append(f"sliding window together with {what} (the flash kernel has no window)")
            if request.logits_soft_cap:
                missing.append(f"logit soft cap together with {what} (the flash kernel has none)")
            if request.tile_mask:
                missing.append(f"sliding tile mask together with {what} (the flash kernel has none)")
            if request.block_causal:
                missing.append(f"frame-block causal mask together with {what} (the flash kernel has none)")
        if request.tile_mask and request.positions:
            missing.append(
                "sliding tile mask with custom positions (its splash mask is static over the "
                "whole sequence: pass the whole tile layout with default positions, or use "
                "'blockwise' for a chunk)"
            )
        if request.tile_mask and self.sliding_tile == "gather" and (
            request.causal or request.window or request.segment_ids or request.kv_lengths
            or request.logits_soft_cap
        ):
            missing.append(
                "sliding_tile='gather' with a causal mask, window, segment ids, key lengths or "
                "soft cap (the gathering kernels take the tile mask alone; 'splash' takes them)"
            )
        return missing

    def _gathers_tiles(self, ops: Operands, opts: Options) -> bool:
        """Whether a sliding tile mask runs the tile-gathering kernels (`sliding_tile`)."""
        tm = opts.tile_mask
        if tm is None or self.sliding_tile == "splash" or ops.bias is not None or ops.mask is not None:
            return False
        served = (
            not tm.text_len and not opts.causal and opts.window is None and ops.seg_q is None
            and ops.kv_lengths is None and opts.logits_soft_cap is None
            and ops.q.shape[1] == ops.k.shape[1] == tm.video_len
        )
        if self.sliding_tile == "gather":
            if not served:
                raise NotImplementedError(
                    "pallas_tpu: sliding_tile='gather' serves a sliding tile mask without text, "
                    "over the layout's tokens exactly (q and k of "
                    f"{tm.video_len} tokens; received {ops.q.shape[1]} and {ops.k.shape[1]}), with "
                    "no causal mask, window, segment ids, key lengths or soft cap; use 'splash'."
                )
            return True
        return served and all(
            _gather_plan.fits(ops.q, ops.k, jnp.zeros((1, 1, 1, g.table.shape[1]), jnp.int32),
                              tm.tile_size, g.run)
            for g in _sliding.window_groups(tm, ops.q.shape[2], ops.k.shape[2])
        )

    def _scope(self):
        return pltpu.force_tpu_interpret_mode() if self.interpret else contextlib.nullcontext()

    # -------------------------------------------------------------- splash (no bias)

    def splash_blocks(self, ops: Operands, opts: Options) -> SplashBlocks:
        """The configuration the splash kernels run `ops` / `opts` with: the explicit
        one, else the chip's table; fitted to the lengths, and with a sliding tile
        mask whose tiles are multiples of 128 tokens (and whose video starts on a
        tile), rounded to whole tiles, so that every block of video is fully visible
        or hidden (no mask evaluated in the kernel)."""
        B, S_q, H, D = ops.q.shape
        S_k = ops.k.shape[1]
        if self.blocks is not None:
            blocks = self.blocks
        elif self.block_q is not None or self.block_kv is not None or self.interpret:
            blocks = SplashBlocks(self.block_q or 512, self.block_kv or 512)
        else:
            tm = opts.tile_mask
            bc = opts.block_causal
            mask = ("tile" if tm is not None
                    else "block_causal" if bc and bc.left is None
                    else "causal" if opts.causal and opts.window is None
                    else "local" if opts.causal or opts.window is not None or bc else "full")
            blocks = choose_blocks(
                mask=mask, batch=B, heads=H, S_q=S_q, S_k=S_k, head_dim=D,
                itemsize=jnp.dtype(ops.q.dtype).itemsize, fused_bwd_max_bytes=self.fused_bwd_max_bytes,
            )
        tm = opts.tile_mask
        if tm is not None and not (tm.tile_size % _LANES or tm.video_start % tm.tile_size):
            whole = lambda b: tm.tile_size * max(1, round(b / tm.tile_size))  # noqa: E731
            changes = {f: whole(getattr(blocks, f)) for f in (
                "block_q", "block_kv", "block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq")}
            changes["block_kv_compute"] = changes["block_kv"]
            changes["block_kv_dkv_compute"] = changes["block_kv_dkv"]
            blocks = dataclasses.replace(blocks, **changes)
        return blocks.fit(S_q, S_k)

    def _splash_setup(self, ops: Operands, opts: Options, *, forward: bool = False):
        """`(groups, q, k, v, seg, blocks, copies)`: the kernels' operands, one `_Group`
        per splash kernel (one unless a sliding tile mask has several distinct head
        windows), the configuration, and the number of padding keys that are copies of
        the last key (`_copied_padding`; 0: the padding keys are hidden by the mask)."""
        B, S_q, H, D = ops.q.shape
        S_k, H_kv = ops.k.shape[1:3]
        blocks = self.splash_blocks(ops, opts)
        S_qp, S_kp = blocks.padded(S_q, S_k)
        copies = S_kp - S_k if forward and _copied_padding(ops, opts) else 0
        groups = [
            _Group(
                in_program(splash_kernel_for(
                    (S_qp, S_kp), S_k + copies, opts.causal, opts.window, opts.logits_soft_cap,
                    blocks, self.interpret, head_mask, opts.block_causal,
                ), opts.block_causal),
                heads,
                kv_heads,
            )
            for head_mask, heads, kv_heads in _head_groups(opts.tile_mask, H, H_kv)
        ]
        # Padding keys are hidden by the kernel's mask; segment ids only for the request's
        # own (and the keys beyond kv_lengths).
        seg = None
        if ops.seg_q is not None or ops.kv_lengths is not None:
            seg = a.kernel_segment_ids(ops, S_qp, S_kp)
        # Scaled after the padding, so that XLA fuses the scale, the padding and the layout
        # into one pass over q (scaled first, a length that is not a multiple of the tiles
        # took two: around the kernel, the forward at 32,760 tokens moved 2.54 GB, now 1.94,
        # compiled for v5e). The same products either way.
        q = _heads_major(ops.q, S_qp) * jnp.asarray(opts.scale, ops.q.dtype)
        k = ops.k
        if copies:
            k = jnp.concatenate([k, jnp.broadcast_to(k[:, -1:], (B, copies, H_kv, D))], axis=1)
        return groups, q, _heads_major(k, S_kp), _heads_major(ops.v, S_kp), seg, blocks, copies

    def _splash_fwd(self, ops, opts, *, need_lse: bool = True):
        """`(out, lse)`; with `need_lse` False and no copied padding keys to take out,
        `(out, None)` from kernels that write no lse (see `fwd_out`)."""
        groups, q, k, v, seg, blocks, copies = self._splash_setup(ops, opts, forward=True)
        with_lse = need_lse or copies > 0
        outs, lses = [], []
        for group in groups:
            kernel = group.kernel if with_lse else _without_lse(group.kernel)

            def one(q, k, v, seg, kernel=kernel):
                res = kernel(q, k, v, None if seg is None else SplashSegmentIds(*seg))
                return (res[0], res[1][0]) if with_lse else (res, None)

            with splash_vmem_limit(blocks.vmem_limit_bytes):
                out, lse = opaque_to_vma(
                    jax.vmap(one, in_axes=(0, 0, 0, None if seg is None else 0)),
                    _take(q, group.heads), _take(k, group.kv_heads), _take(v, group.kv_heads), seg,
                )
            outs.append(out)
            lses.append(lse)
        S_q = ops.q.shape[1]
        out = jnp.swapaxes(_merge(outs, groups)[:, :, :S_q], 1, 2)
        if not with_lse:
            return out, None
        lse = _merge(lses, groups)[:, :, :S_q]
        if copies:
            out, lse = _remove_copies(ops, opts, out, lse, copies)
        return out, lse

    def _splash_bwd(self, ops, opts, kernel_lse, delta, dout):
        groups, q, k, v, seg, blocks, _ = self._splash_setup(ops, opts)
        S_q, S_k = ops.q.shape[1], ops.k.shape[1]
        S_qp = q.shape[2]
        do = _heads_major(dout.astype(ops.q.dtype), S_qp)
        lse = a.pad_axis(kernel_lse, 2, S_qp, jnp.inf)
        delta = a.pad_axis(delta, 2, S_qp)
        dqs, dk, dv = [], None, None
        for group in groups:
            kernel = group.kernel
            bs = kernel.kwargs["block_sizes"]
            common = dict(
                is_mqa=False,
                mask_value=kernel.kwargs["mask_value"],
                attn_logits_soft_cap=opts.logits_soft_cap,
                q_layout=bs.q_layout,
                k_layout=bs.k_layout,
                v_layout=bs.v_layout,
                mask_function=kernel.kwargs["mask_function"],
                interpret=self.interpret,
            )

            def one(q, k, v, seg, lse, do, delta, kernel=kernel, bs=bs, common=common):
                seg = None if seg is None else SplashSegmentIds(*seg)
                dq, dk, dv = splash_attention_bwd_dkv(
                    q, k, v, seg, None, lse, do, delta,
                    bq=bs.block_q_dkv,
                    bkv=bs.block_kv_dkv,
                    bkv_compute=bs.block_kv_dkv_compute,
                    mask_info=_collapse(kernel.dkv_mask_info),
                    use_fused_bwd_kernel=bs.use_fused_bwd_kernel,
                    **common,
                )
                if not bs.use_fused_bwd_kernel:
                    dq = splash_attention_bwd_dq(
                        q, k, v, seg, None, lse, do, delta,
                        bq=bs.block_q_dq,
                        bkv=bs.block_kv_dq,
                        mask_info=_collapse(kernel.dq_mask_info),
                        **common,
                    )
                return dq, dk, dv

            heads, kv_heads = group.heads, group.kv_heads
            with splash_vmem_limit(blocks.vmem_limit_bytes):
                dq_g, dk_g, dv_g = opaque_to_vma(
                    jax.vmap(one, in_axes=(0, 0, 0, None if seg is None else 0, 0, 0, 0)),
                    _take(q, heads), _take(k, kv_heads), _take(v, kv_heads), seg,
                    _take(lse, heads), _take(do, heads), _take(delta, heads),
                )
            dqs.append(dq_g)
            if kv_heads is None:
                dk, dv = dk_g, dv_g
            else:  # several groups may share a kv head (a query head each): add up
                if dk is None:
                    dk = jnp.zeros(k.shape, F32)
                    dv = jnp.zeros(v.shape, F32)
                dk = dk.at[:, np.asarray(kv_heads)].add(dk_g.astype(F32))
                dv = dv.at[:, np.asarray(kv_heads)].add(dv_g.astype(F32))
        dq = _heads_minor(_merge(dqs, groups), S_q).astype(F32) * opts.scale
        return dq, _heads_minor(dk, S_k), _heads_minor(dv, S_k), None

    # -------------------------------------------------------- flash (bias or mask)

    def _flash_setup(self, ops: Operands, opts: Options):
        B, S_q, H, D = ops.q.shape
        S_k = ops.k.shape[1]
        bq, S_qp = a.tile(S_q, self.block_q or 512, _LANES)
        bkv, S_kp = a.tile(S_k, self.block_kv or 512, _LANES)
        ab = jnp.zeros((), F32) if ops.bias is None else ops.bias.astype(F32)
        if ops.mask is not None:
            ab = jnp.where(ops.mask, ab, a.MASKED_LOGIT)
        ab = jnp.broadcast_to(ab, (B, H, S_q, S_k))
        ab = a.pad_axis(a.pad_axis(ab, 2, S_qp), 3, S_kp)
        seg = a.kernel_segment_ids(ops, S_qp, S_kp)
        seg = None if seg is None else FlashSegmentIds(*seg)
        q = _heads_major(ops.q * jnp.asarray(opts.scale, ops.q.dtype), S_qp)
        k = _heads_major(a.repeat_kv(ops.k, H), S_kp)
        v = _heads_major(a.repeat_kv(ops.v, H), S_kp)
        return q, k, v, ab, seg, bq, bkv

    def _flash_fwd(self, ops, opts):
        q, k, v, ab, seg, bq, bkv = self._flash_setup(ops, opts)
        def kernel(q, k, v, ab, seg):
            with self._scope():
                return flash_attention_impl(
                    q, k, v, ab, seg, True, opts.causal, 1.0, 1, bq, bkv, bkv, False
                )

        out, l, mx = opaque_to_vma(kernel, q, k, v, ab, seg)
        S_q = ops.q.shape[1]
        lse = mx + jnp.log(l)
        return jnp.swapaxes(out[:, :, :S_q], 1, 2), lse[:, :, :S_q]

    def _flash_bwd(self, ops, opts, kernel_lse, delta, dout):
        q, k, v, ab, seg, bq, bkv = self._flash_setup(ops, opts)
        S_q, H = ops.q.shape[1], ops.q.shape[2]
        S_k, K = ops.k.shape[1], ops.k.shape[2]
        S_qp = q.shape[2]
        do = _heads_major(dout.astype(ops.q.dtype), S_qp)
        lse = a.pad_axis(kernel_lse, 2, S_qp, jnp.inf)
        delta = a.pad_axis(delta, 2, S_qp)
        ones = jnp.ones_like(lse)
        common = dict(sm_scale=1.0, causal=opts.causal, mask_value=FLASH_DEFAULT_MASK_VALUE, debug=False)

        def kernels(q, k, v, ab, seg, ones, lse, do, delta):
            with self._scope():
                dk, dv = flash_attention_bwd_dkv(
                    q, k, v, ab, seg, ones, lse, do, delta,
                    block_q_major=bq, block_q=bq, block_k_major=bkv, block_k=bkv, **common,
                )
                dq, ds = flash_attention_bwd_dq(
                    q, k, v, ab, seg, ones, lse, do, delta,
                    block_q_major=bq, block_k_major=bkv, block_k=bkv, **common,
                )
            return dq, dk, dv, ds

        dq, dk, dv, ds = opaque_to_vma(kernels, q, k, v, ab, seg, ones, lse, do, delta)
        dq = _heads_minor(dq, S_q).astype(F32) * opts.scale
        dk = a.reduce_kv(_heads_minor(dk, S_k), K)
        dv = a.reduce_kv(_heads_minor(dv, S_k), K)
        dbias = None
        if ops.bias is not None:
            dbias = m.reduce_to(ds[:, :, :S_q, :S_k].astype(F32), ops.bias.shape).astype(ops.bias.dtype)
        return dq, dk, dv, dbias

    # ------------------------------------------------------------ VSA's fine stage

    def sparse_fwd(self, q, k, v, tiles, kv_valid, *, tile_size: int, scale: float):
        """VSA's fine stage: block-sparse kernels over resident K/V, driven by the
        scalar-prefetched tile table (`_gather.sparse_fwd`; the per-tile
        kernels of `_per_tile` when the resident arrays do not fit VMEM)."""
        with _kernel_precision(q.dtype):
            return _gather.sparse_fwd(
                q, k, v, tiles, kv_valid, tile_size=tile_size, scale=scale, interpret=self.interpret
            )

    def sparse_bwd(self, q, k, v, tiles, kv_valid, out, lse, dout, dlse, *, tile_size: int, scale: float):
        """The gradients of `sparse_fwd`: a dQ pass over the table and a dK/dV pass over
        its inversion (`_gather.sparse_bwd`)."""
        with _kernel_precision(q.dtype):
            return _gather.sparse_bwd(
                q, k, v, tiles, kv_valid, out, lse, dout, dlse, tile_size=tile_size, scale=scale,
                interpret=self.interpret,
            )

    # ------------------------------------------------------------------- contract

    def fwd(self, ops: Operands, opts: Options) -> tuple[jax.Array, jax.Array]:
        if opts.quantize is not None:
            return self._int8(ops, opts, with_lse=True)
        with _kernel_precision(ops.q.dtype):
            return self._fwd(ops, opts)

    def _int8(self, ops: Operands, opts: Options, *, with_lse: bool):
        """The int8 kernel (`_int8.py`); its backward is the float one (`bwd`)."""
        block_q, block_kv = self.int8_blocks
        return int8_attention(ops, opts, block_q=block_q, block_kv=block_kv, with_lse=with_lse,
                              interpret=self.interpret)

    def bwd(self, ops, opts, out, lse, dout, dlse):
        with _kernel_precision(ops.q.dtype):
            return self._bwd(ops, opts, out, lse, dout, dlse)

    def fwd_out(self, ops: Operands, opts: Options) -> jax.Array:
        """`fwd`'s output alone (a forward that is not differentiated and whose lse
        nobody asked for): full and causal attention over the default positions, without
        sinks, run splash without its lse residual, which it writes as float32 `(H, S,
        128)` lanes (at 32,768 tokens and 12 heads, 201 MB written and read back by a
        slice). The rest, and full attention at a padded length (whose copied keys the
        lse takes out), as `fwd`."""
        if opts.quantize is not None:
            return self._int8(ops, opts, with_lse=False)[0]
        with _kernel_precision(ops.q.dtype):
            # Without a bias, mask or tile mask (`rows_may_be_empty` is True with any) and
            # sinks, `fwd`'s `finish` leaves splash's output as it is.
            if ops.sinks is not None or a.rows_may_be_empty(ops, opts):
                return self._fwd(ops, opts)[0]
            return self._splash_fwd(ops, opts, need_lse=False)[0]

    def _fwd(self, ops: Operands, opts: Options) -> tuple[jax.Array, jax.Array]:
        if self._gathers_tiles(ops, opts):
            out, lse = _sliding.sliding_tile_fwd(
                ops.q, ops.k, ops.v, opts.tile_mask, scale=opts.scale, interpret=self.interpret)
            return a.finish(ops, out, lse)
        flash = ops.bias is not None or ops.mask is not None
        out, lse = (self._flash_fwd if flash else self._splash_fwd)(ops, opts)
        # Full and causal attention: no selection of empty rows, a pass over the output and
        # the kernel's float32 lse (0.8 of the 1.0 GB moved around the kernel at 32,768
        # tokens, compiled for v5e).
        return a.finish(ops, out, lse, rows_may_be_empty=a.rows_may_be_empty(ops, opts))

    def _bwd(self, ops, opts, out, lse, dout, dlse):
        kernel_lse, delta, dsinks = a.backward_stats(ops, out, lse, dout, dlse)
        if self._gathers_tiles(ops, opts):
            # The contract's (sink-including) out and lse: their probabilities and delta.
            dq, dk, dv = _sliding.sliding_tile_bwd(
                ops.q, ops.k, ops.v, opts.tile_mask, out, lse, dout, dlse, scale=opts.scale,
                interpret=self.interpret)
            return dq.astype(ops.q.dtype), dk.astype(ops.k.dtype), dv.astype(ops.v.dtype), None, dsinks
        flash = ops.bias is not None or ops.mask is not None
        dq, dk, dv, dbias = (self._flash_bwd if flash else self._splash_bwd)(
            ops, opts, kernel_lse, delta, dout
        )
        return dq.astype(ops.q.dtype), dk.astype(ops.k.dtype), dv.astype(ops.v.dtype), dbias, dsinks

