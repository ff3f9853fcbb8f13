"""`"pallas_tpu"`: JAX's Pallas TPU attention kernels behind the common contract.

Two kernels, chosen per request:

- **splash attention** (`jax.experimental.pallas.ops.tpu.splash_attention`) for
  every request without a bias or a boolean mask: GQA without repeating K/V,
  causal and sliding-window masks (static `CausalMask` / `LocalMask`, whose fully
  hidden tiles are skipped), segment ids and the logit soft cap;
- **flash attention** (`jax.experimental.pallas.ops.tpu.flash_attention`) when a
  bias or a boolean mask is given (the mask is folded into the bias); it takes
  causal masks and segment ids too, but neither a window nor a soft cap.

Both are adapted by `_adapt`: sequences are padded to multiples of 128 and the
padding excluded through segment ids, rows that see nothing give 0 and
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
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from .._jax_private import (
    CausalMask,
    FLASH_DEFAULT_MASK_VALUE,
    FlashSegmentIds,
    flash_attention_bwd_dkv,
    flash_attention_bwd_dq,
    flash_attention_impl,
    FullMask,
    LocalMask,
    make_splash_mha,
    MultiHeadMask,
    splash_attention_bwd_dkv,
    splash_attention_bwd_dq,
    SplashBlockSizes,
    SplashSegmentIds,
)
from .._vma import opaque_to_vma
from . import _adapt as a
from . import _math as m
from ._args import Operands, Options
from ._base import AbstractImplementation, Capabilities, Request


F32 = jnp.float32
_LANES = 128  # TPU tiles are multiples of the 128-lane vector width.


@functools.lru_cache(maxsize=64)
def _splash_kernel_for(
    heads: int,
    shape: tuple[int, int],
    causal: bool,
    window,
    soft_cap: float | None,
    block_q: int,
    block_kv: int,
    interpret: bool,
):
    """A splash kernel (forward with lse; dK/dV and dQ backward blocks) for one static mask.

    The backward is unfused: JAX's fused splash backward writes one partial dQ per
    key block, `(S_k / block_kv, H, S_q, D)`, which is O(S^2) memory (6.4 GB for
    Wan 1.3B at 32,760 tokens); separate dK/dV and dQ kernels keep it O(S).
    """
    left, right = (None, None) if window is None else window
    if causal:  # causal and a window: the window with its right side cut at 0
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        mask = FullMask(shape)
    elif left is None and right == 0:
        mask = CausalMask(shape, offset=0)
    else:
        mask = LocalMask(shape, (left, right), offset=0)
    block_sizes = SplashBlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=block_kv,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        block_kv_dkv_compute=block_kv,
        block_q_dq=block_q,
        block_kv_dq=block_kv,
        use_fused_bwd_kernel=False,
    )
    # The mask metadata are constants: built eagerly even when first asked for
    # under a trace, so the cached kernel holds no tracer.
    with jax.ensure_compile_time_eval():
        return make_splash_mha(
            MultiHeadMask([mask] * heads),
            block_sizes=block_sizes,
            head_shards=1,
            q_seq_shards=1,
            save_residuals=True,
            attn_logits_soft_cap=soft_cap,
            interpret=interpret,
        )


def _heads_major(x: jax.Array, length: int) -> jax.Array:
    """`(B, S, H, D)` -> the kernels' `(B, H, length, D)`, padded at the end."""
    return a.pad_axis(jnp.swapaxes(x, 1, 2), 2, length)


def _heads_minor(x: jax.Array, length: int) -> jax.Array:
    """The inverse of `_heads_major`: `(B, H, S_pad, D)` -> `(B, length, H, D)`."""
    return jnp.swapaxes(x[:, :, :length], 1, 2)


def _collapse(mask_info):
    """The reshape `_jax_private.splash_attention` applies before its kernels."""
    if mask_info.partial_mask_blocks is None:
        return mask_info
    blocks = mask_info.partial_mask_blocks
    return mask_info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))


@dataclasses.dataclass(frozen=True)
class PallasTpu(AbstractImplementation):
    """JAX's Pallas TPU splash / flash attention kernels.

    **Arguments:**

    - `block_q`, `block_kv`: tile sizes (multiples of 128; shrunk for short sequences).
    - `interpret`: run the kernels in Pallas interpret mode (on any platform,
        e.g. to test on CPU; slow).
    """

    block_q: int = 512
    block_kv: int = 512
    interpret: bool = False

    name = "pallas_tpu"
    capabilities = Capabilities(
        platforms=("tpu",),
        positions=False,
        # A bias or mask takes the flash kernel, which has neither; see `unsupported`.
        window=True,
        logits_soft_cap=True,
        notes=(
            "a bias or boolean mask runs the flash kernel, which takes neither a sliding "
            "window nor a soft cap (and holds the bias as a dense (B, H, S_q, S_k) array)",
            "lengths are padded to multiples of 128, the padding excluded by segment ids",
            "no custom positions, yet ring attention runs on it when causal or unmasked "
            "(its steps then need none)",
        ),
    )

    def __post_init__(self):
        for field in ("block_q", "block_kv"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0 or value % _LANES:
                raise ValueError(
                    f"PallasTpu `{field}` must be a positive multiple of {_LANES}; received {value!r}."
                )

    def unsupported(self, request: Request) -> list[str]:
        missing = self.capabilities.unsupported(request, any_platform=self.interpret)
        if request.bias or request.mask:
            what = "a bias" if request.bias else "a boolean mask"
            if request.window:
                missing.append(f"sliding window together with {what} (the flash kernel has no window)")
            if request.logits_soft_cap:
                missing.append(f"logit soft cap together with {what} (the flash kernel has none)")
        return missing

    def _scope(self):
        return pltpu.force_tpu_interpret_mode() if self.interpret else contextlib.nullcontext()

    # -------------------------------------------------------------- splash (no bias)

    def _splash_setup(self, ops: Operands, opts: Options):
        B, S_q, H, D = ops.q.shape
        S_k = ops.k.shape[1]
        bq, S_qp = a.tile(S_q, self.block_q, _LANES)
        bkv, S_kp = a.tile(S_k, self.block_kv, _LANES)
        kernel = _splash_kernel_for(
            H, (S_qp, S_kp), opts.causal, opts.window, opts.logits_soft_cap, bq, bkv, self.interpret
        )
        seg = a.kernel_segment_ids(ops, S_qp, S_kp)
        if seg is None:  # the kernel's batch of one example takes ids of shape (S,)
            seg = (jnp.zeros((B, S_qp), jnp.int32), jnp.zeros((B, S_kp), jnp.int32))
        q = _heads_major(ops.q * jnp.asarray(opts.scale, ops.q.dtype), S_qp)
        return kernel, q, _heads_major(ops.k, S_kp), _heads_major(ops.v, S_kp), seg

    def _splash_fwd(self, ops, opts):
        kernel, q, k, v, seg = self._splash_setup(ops, opts)

        def one(q, k, v, seg_q, seg_kv):
            out, (lse,) = kernel(q, k, v, SplashSegmentIds(seg_q, seg_kv))
            return out, lse

        out, lse = opaque_to_vma(jax.vmap(one), q, k, v, *seg)
        S_q = ops.q.shape[1]
        return jnp.swapaxes(out[:, :, :S_q], 1, 2), lse[:, :, :S_q]

    def _splash_bwd(self, ops, opts, kernel_lse, delta, dout):
        kernel, q, k, v, seg = self._splash_setup(ops, opts)
        S_q, S_k = ops.q.shape[1], ops.k.shape[1]
        S_qp = q.shape[2]
        do = _heads_major(dout.astype(ops.q.dtype), S_qp)
        lse = a.pad_axis(kernel_lse, 2, S_qp, jnp.inf)
        delta = a.pad_axis(delta, 2, S_qp)
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

        def one(q, k, v, seg_q, seg_kv, lse, do, delta):
            seg = SplashSegmentIds(seg_q, seg_kv)
            _, dk, dv = splash_attention_bwd_dkv(
                q, k, v, seg, None, lse, do, delta,
                bq=bs.block_q_dkv,
                bkv=bs.block_kv_dkv,
                bkv_compute=bs.block_kv_dkv_compute,
                mask_info=_collapse(kernel.dkv_mask_info),
                use_fused_bwd_kernel=False,
                **common,
            )
            dq = splash_attention_bwd_dq(
                q, k, v, seg, None, lse, do, delta,
                bq=bs.block_q_dq,
                bkv=bs.block_kv_dq,
                mask_info=_collapse(kernel.dq_mask_info),
                **common,
            )
            return dq, dk, dv

        dq, dk, dv = opaque_to_vma(jax.vmap(one), q, k, v, *seg, lse, do, delta)
        dq = _heads_minor(dq, S_q).astype(F32) * opts.scale
        return dq, _heads_minor(dk, S_k), _heads_minor(dv, S_k), None

    # -------------------------------------------------------- flash (bias or mask)

    def _flash_setup(self, ops: Operands, opts: Options):
        B, S_q, H, D = ops.q.shape
        S_k = ops.k.shape[1]
        bq, S_qp = a.tile(S_q, self.block_q, _LANES)
        bkv, S_kp = a.tile(S_k, self.block_kv, _LANES)
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

    # ------------------------------------------------------------------- contract

    def fwd(self, ops: Operands, opts: Options) -> tuple[jax.Array, jax.Array]:
        flash = ops.bias is not None or ops.mask is not None
        out, lse = (self._flash_fwd if flash else self._splash_fwd)(ops, opts)
        return a.finish(ops, out, lse)

    def bwd(self, ops, opts, out, lse, dout, dlse):
        kernel_lse, delta, dsinks = a.backward_stats(ops, out, lse, dout, dlse)
        flash = ops.bias is not None or ops.mask is not None
        dq, dk, dv, dbias = (self._flash_bwd if flash else self._splash_bwd)(
            ops, opts, kernel_lse, delta, dout
        )
        return dq.astype(ops.q.dtype), dk.astype(ops.k.dtype), dv.astype(ops.v.dtype), dbias, dsinks

