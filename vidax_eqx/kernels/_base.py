"""The contract every attention implementation fulfils.

An implementation is a frozen dataclass subclassing [`AbstractImplementation`][]:
its fields are its tuning knobs (block sizes), its class attribute
`capabilities` says which features it serves, and it provides `fwd` and `bwd`
over normalized operands. Capability flags drive three things at once: the
error an explicitly named implementation raises, what `"auto"` may choose,
and the README's feature table.
"""

import abc
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from ._args import Operands, Options


# One row of the README feature table per entry: (Request attribute, label).
FEATURES: tuple[tuple[str, str], ...] = (
    ("gqa", "GQA / MQA"),
    ("cross", "S_q != S_k"),
    ("bias", "additive bias (+ gradient)"),
    ("mask", "boolean mask"),
    ("tile_mask", "sliding tile mask (3D, skips hidden tiles)"),
    ("block_causal", "frame-block causal mask (skips hidden blocks)"),
    ("segment_ids", "segment ids"),
    ("kv_lengths", "key-only padding (kv_lengths)"),
    ("video_sparse", "video sparse attention (VSA fine stage)"),
    ("causal", "causal (on positions)"),
    ("window", "sliding window (on positions)"),
    ("positions", "custom positions"),
    ("sinks", "attention sinks (+ gradient)"),
    ("logits_soft_cap", "logit soft cap"),
)


@dataclasses.dataclass(frozen=True)
class Request:
    """What one attention call asks for, as static facts (used for dispatch).

    `platform` is the platform the call runs on (`"cpu"`, `"gpu"`, `"tpu"`), or
    `None` when that is decided when the program is lowered (traced arrays):
    dispatch then chooses for every platform (see `kernels/_dispatch.py`).
    """

    platform: str | None
    dtype: str
    batch: int
    seq_q: int
    seq_k: int
    heads: int
    kv_heads: int
    head_dim: int
    gqa: bool
    cross: bool
    bias: bool
    mask: bool
    segment_ids: bool
    causal: bool
    window: bool
    positions: bool
    sinks: bool
    logits_soft_cap: bool
    needs_lse: bool = False
    shared_segment_ids: bool = False
    tile_mask: bool = False
    kv_lengths: bool = False
    video_sparse: bool = False
    block_causal: bool = False
    quantize: str | None = None

    @classmethod
    def of(
        cls, ops: Operands, opts: Options, *, needs_lse: bool = False, platform: str | None = None
    ) -> "Request":
        """The request of `ops`/`opts`; `needs_lse`: the caller uses the float32
        log-sum-exp (`attention_fwd`, `attention_bwd`, ring attention); `platform`:
        the platform to choose for, default that of concrete arrays (`None` for
        tracers: decided at lowering)."""
        B, S_q, H, D = ops.q.shape
        _, S_k, H_kv, _ = ops.k.shape
        return cls(
            platform=_platform(ops.q) if platform is None else platform,
            dtype=jnp.dtype(ops.q.dtype).name,
            batch=B,
            seq_q=S_q,
            seq_k=S_k,
            heads=H,
            kv_heads=H_kv,
            head_dim=D,
            gqa=H != H_kv,
            cross=S_q != S_k,
            bias=ops.bias is not None,
            mask=ops.mask is not None,
            segment_ids=ops.seg_q is not None,
            causal=opts.causal,
            window=opts.window is not None,
            positions=not opts.default_positions,
            sinks=ops.sinks is not None,
            logits_soft_cap=opts.logits_soft_cap is not None,
            needs_lse=needs_lse,
            # One `(B, S)` array for queries and keys (some kernels take only that).
            shared_segment_ids=ops.seg_q is not None and ops.seg_q is ops.seg_kv,
            tile_mask=opts.tile_mask is not None,
            kv_lengths=ops.kv_lengths is not None,
            block_causal=opts.block_causal is not None,
            quantize=opts.quantize,
        )

    @classmethod
    def sparse(cls, q, k, *, platform: str | None = None) -> "Request":
        """The request of VSA's fine stage (`kernels/_vsa.py`) on q `(B, S_q, H, D)`
        and k `(B, S_k, H_kv, D)`: block-sparse attention with a float32 lse."""
        B, S_q, H, D = q.shape
        _, S_k, H_kv, _ = k.shape
        return cls(
            platform=_platform(q) if platform is None else platform,
            dtype=jnp.dtype(q.dtype).name,
            batch=B, seq_q=S_q, seq_k=S_k, heads=H, kv_heads=H_kv, head_dim=D,
            gqa=H != H_kv, cross=S_q != S_k, bias=False, mask=False, segment_ids=False,
            causal=False, window=False, positions=False, sinks=False, logits_soft_cap=False,
            needs_lse=True, video_sparse=True,
        )

    @property
    def score_bytes(self) -> int:
        """Bytes of one float32 score matrix `(B, H, S_q, S_k)`."""
        return 4 * self.batch * self.heads * self.seq_q * self.seq_k


# JAX's platform names for what the capability flags call "gpu".
GPU_PLATFORMS = ("cuda", "rocm")


def capability_platform(platform: str) -> str:
    """A JAX platform name as the capability flags name it (`"cuda"`, `"rocm"`: `"gpu"`)."""
    return "gpu" if platform in GPU_PLATFORMS else platform


def _platform(x: jax.Array) -> str | None:
    """The platform concrete `x` lives on; `None` for tracers, whose platform is
    the one the program is lowered for."""
    try:
        devices = x.devices()
    except Exception:  # tracers have no devices
        return None
    return capability_platform(next(iter(devices)).platform)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """Which requests an implementation serves.

    Every boolean corresponds to a [`Request`][] field of the same name;
    `platforms`, `dtypes` and `max_head_dim` bound the rest. `tile_mask`,
    `block_causal`, `kv_lengths` and `video_sparse` are off unless declared (an implementation must
    apply them itself; `video_sparse` means it has the `sparse_fwd` / `sparse_bwd`
    methods of VSA's fine stage, see `kernels/_sparse.py`). `float32_lse` says the log-sum-exp comes back in float32 with a gradient and that the
    backward takes an external `(out, lse, dlse)` (what `attention_fwd`,
    `attention_bwd` and ring attention need); `portable` marks pure-JAX
    implementations that run on every platform and that XLA can partition over
    a mesh (what `implementation="portable"` chooses from); `memory` is `"O(S)"`
    or `"O(S^2)"`; `notes` state the limits on combinations of features that an
    implementation's `unsupported` adds to these flags.
    """

    platforms: tuple[str, ...]
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    max_head_dim: int | None = None
    gqa: bool = True
    cross: bool = True
    bias: bool = True
    mask: bool = True
    segment_ids: bool = True
    causal: bool = True
    window: bool = True
    positions: bool = True
    sinks: bool = True
    logits_soft_cap: bool = True
    # Off unless declared: an implementation must evaluate the structure itself.
    tile_mask: bool = False
    kv_lengths: bool = False
    block_causal: bool = False
    # VSA's fine stage: the implementation has `sparse_fwd` / `sparse_bwd` (`_vsa.py`).
    video_sparse: bool = False
    # The `quantize=` modes it computes (`_int8.py`'s scheme); none unless declared.
    quantize: tuple[str, ...] = ()
    float32_lse: bool = True
    portable: bool = False
    memory: str = "O(S)"
    notes: tuple[str, ...] = ()  # limits of combinations, for the feature table

    def unsupported(self, request: Request, *, any_platform: bool = False) -> list[str]:
        """Names the parts of `request` this implementation cannot serve.

        `any_platform` skips the platform check (Pallas kernels in interpret mode).
        """
        missing = [label for attr, label in FEATURES if getattr(request, attr) and not getattr(self, attr)]
        if request.quantize is not None and request.quantize not in self.quantize:
            missing.append(f"quantize={request.quantize!r}")
        if request.needs_lse and not self.float32_lse:
            missing.append("a float32 log-sum-exp with gradient (attention_fwd / attention_bwd / ring)")
        if not any_platform and request.platform is not None and request.platform not in self.platforms:
            missing.append(f"platform {request.platform!r} (serves {', '.join(self.platforms)})")
        if request.dtype not in self.dtypes:
            missing.append(f"dtype {request.dtype} (serves {', '.join(self.dtypes)})")
        if self.max_head_dim is not None and request.head_dim > self.max_head_dim:
            missing.append(f"head_dim {request.head_dim} > {self.max_head_dim}")
        return missing


class AbstractImplementation(abc.ABC):
    """One attention algorithm behind the `vidax_eqx.kernels` interface.

    Subclasses are frozen dataclasses (hashable: they are static configuration)
    with a class-level `name` and `capabilities`.
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    @abc.abstractmethod
    def fwd(self, ops: Operands, opts: Options) -> tuple[jax.Array, jax.Array]:
        """Returns `out (B, S_q, H, D)` in q's dtype and `lse (B, H, S_q)` float32.

        `lse` includes the sink term when `ops.sinks` is given; a row that sees
        no key (and has no sink) has `out = 0` and `lse = -inf`.
        """

    def fwd_out(self, ops: Operands, opts: Options) -> jax.Array:
        """`fwd`'s `out` alone, for a forward that is not differentiated and whose lse
        nobody asked for (`attention` outside a gradient): a kernel that can skip
        writing its statistics then may."""
        return self.fwd(ops, opts)[0]

    @abc.abstractmethod
    def bwd(
        self,
        ops: Operands,
        opts: Options,
        out: jax.Array,
        lse: jax.Array,
        dout: jax.Array,
        dlse: jax.Array | None,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
        """Returns `(dq, dk, dv, dbias, dsinks)`.

        Gradients are taken through `out` (cotangent `dout`) and `lse`
        (cotangent `dlse`, or none). `out` and `lse` may be those of a larger
        computation this call is one block of (ring attention): the tile
        probabilities are always `exp(s - lse)`. `dbias` has the shape of the
        rank-4 `ops.bias` (reduced over its broadcast axes); it and `dsinks`
        are `None` when the feature is absent.
        """

    def unsupported(self, request: Request) -> list[str]:
        """The features of `request` this implementation cannot serve (empty if none)."""
        return self.capabilities.unsupported(request)
