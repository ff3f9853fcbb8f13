"""Every private or undocumented JAX entry point that vidax_eqx uses, in one place.

The Pallas adapters (`kernels/pallas_tpu/`, `kernels/_pallas_gpu.py`) run
JAX's attention kernels from `jax.experimental.pallas.ops`, which has no API
documentation and whose backward passes we call from a given log-sum-exp through
functions with a leading underscore; `_vma.py` switches `shard_map`'s
varying-axes check through `jax._src.config`. Each of those names is imported
here and nowhere else, from the record in `ENTRY_POINTS`: where it lives in JAX,
what we use it for, and the call we rely on (the parameters we pass by
position, in order, and by keyword; the attributes we read).
`tests/test_jax_private.py` checks every record against the installed JAX with
`inspect.signature`, so an upgrade that moves or renames one fails by name.
The documented Pallas API (`pallas_call`, `BlockSpec`, `tpu.force_tpu_interpret_mode`,
`triton.CompilerParams`) stays where it is used.

A JAX version without one of them does not break the import of this module: the
name is left unbound and listed in `MISSING`, and importing it raises
`ImportError` (`from vidax_eqx._jax_private import name`) or `AttributeError`
(`_jax_private.name`), which the guarded imports of `kernels/_registry.py` turn
into an absent `"pallas_tpu"` / `"pallas_gpu"`. Sits below `kernels/` and
`parallel/`, like `_vma.py`.
"""

import contextlib
import dataclasses
import importlib
import warnings

import jax


_SPLASH = "jax.experimental.pallas.ops.tpu.splash_attention"
_SPLASH_KERNEL = "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel"
_SPLASH_MASK = "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask"
_SPLASH_MASK_INFO = "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info"
_FLASH = "jax.experimental.pallas.ops.tpu.flash_attention"
_GPU = "jax.experimental.pallas.ops.gpu.attention"
_GPU_DEPRECATED = ("JAX 0.12 deprecates jax.experimental.pallas.ops.gpu.attention and points to "
                   "tokamax.dot_product_attention")


@dataclasses.dataclass(frozen=True)
class EntryPoint:
    """One private or undocumented JAX name and how we call it.

    **Arguments:**

    - `module`, `attr`: where it lives (`importlib.import_module(module).attr`).
    - `use`: what vidax_eqx uses it for.
    - `positional`: the parameters we pass by position, in order.
    - `keyword`: the parameters we pass by keyword.
    - `attributes`: the attributes we read on it (fields of a class, `.value`).
    - `returns`: what we read on the object a call returns: attribute paths,
        `a.b` for attributes and `a[key]` for a mapping's keys.
    - `deprecated`: where JAX deprecated the module (and what it points to instead),
        or `""`. Its import's `DeprecationWarning` is expected and silenced here, the
        only place the module is imported; a JAX that removes it leaves the name
        `MISSING` (and the implementation that uses it unregistered).
    """

    module: str
    attr: str
    use: str
    positional: tuple[str, ...] = ()
    keyword: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()
    returns: tuple[str, ...] = ()
    deprecated: str = ""

    @property
    def where(self) -> str:
        return f"{self.module}.{self.attr}"

    def load(self):
        with warnings.catch_warnings():
            if self.deprecated:
                warnings.filterwarnings("ignore", category=DeprecationWarning,
                                        message=rf"{self.module.replace('.', '[.]')} is deprecated")
            return getattr(importlib.import_module(self.module), self.attr)


ENTRY_POINTS: dict[str, EntryPoint] = {
    # ---------------------------------------------- TPU splash attention (no bias)
    "make_splash_mha": EntryPoint(
        _SPLASH, "make_splash_mha",
        "splash's own kernel builder: the tests compare the mask infos "
        "`kernels/pallas_tpu/_mask.py` builds from block kinds with the ones it builds "
        "(the library builds its kernels itself, `SplashAttentionKernel`)",
        positional=("mask",),
        keyword=("block_sizes", "head_shards", "q_seq_shards", "save_residuals",
                 "attn_logits_soft_cap", "interpret"),
    ),
    "SplashComputableMask": EntryPoint(
        _SPLASH_MASK, "_ComputableMask",
        "the base of `kernels/pallas_tpu/_mask.py: SplashTileMask`, the sliding tile mask as a "
        "splash mask: a mask with `q_sequence` and `mask_function` (the one unique mask of a "
        "kernel) is evaluated inside the kernel as `mask_function(q_sequence[rows], kv "
        "positions)` on partial blocks; `mask[q_slice, kv_slice]` is the dense block that "
        "splash's own `process_mask` reads (tests compare its mask infos with ours)",
        positional=("shape", "mask_function"),
        returns=("q_sequence", "mask_function", "shape"),
    ),
    "SplashAttentionKernel": EntryPoint(
        _SPLASH_KERNEL, "SplashAttentionKernel",
        "every splash kernel of `\"pallas_tpu\"`, built from the mask infos of its mask "
        "(`kernels/pallas_tpu/_mask.py: _kernel`) with the settings `make_splash_mha` "
        "gives it (the keywords of `splash_attention`); its backward is rebuilt from the "
        "kernel's settings and mask infos",
        positional=("fwd_mask_info", "dq_mask_info", "dkv_mask_info"),
        returns=("dkv_mask_info", "dkv_mask_info.partial_mask_blocks", "dkv_mask_info._replace",
                 "dq_mask_info", "dq_mask_info.partial_mask_blocks", "dq_mask_info._replace",
                 "fwd_mask_info.block_mask", "fwd_mask_info.data_next",
                 "kwargs[block_sizes]", "kwargs[mask_value]", "kwargs[mask_function]"),
    ),
    "SplashMaskInfo": EntryPoint(
        _SPLASH_MASK_INFO, "MaskInfo",
        "a sliding tile mask's block-sparse structure as the splash kernels read it "
        "(`kernels/pallas_tpu/_mask.py: _mask_info`, checked against splash's `process_mask`)",
        keyword=("data_next", "mask_next", "block_mask", "partial_mask_blocks", "q_sequence"),
    ),
    "SPLASH_DEFAULT_MASK_VALUE": EntryPoint(
        _SPLASH_KERNEL, "DEFAULT_MASK_VALUE",
        "the masked logit `make_splash_mha` gives its kernels (a tile mask's kernel gets it too)",
    ),
    "MultiHeadMask": EntryPoint(
        _SPLASH, "MultiHeadMask", "one mask per head for `make_splash_mha`",
        positional=("masks",),
    ),
    "SplashBlockSizes": EntryPoint(
        _SPLASH, "BlockSizes",
        "the splash tiles (forward, dK/dV and dQ backward); the backward reads them back",
        keyword=("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
                 "block_kv_dkv_compute", "block_q_dq", "block_kv_dq", "use_fused_bwd_kernel"),
        attributes=("block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute", "block_q_dq",
                    "block_kv_dq", "q_layout", "k_layout", "v_layout"),
    ),
    "SplashSegmentIds": EntryPoint(
        _SPLASH, "SegmentIds", "segment ids (padding and packed sequences) for the splash kernels",
        positional=("q", "kv"),
    ),
    "splash_attention": EntryPoint(
        _SPLASH_KERNEL, "_splash_attention",
        "what calling a splash kernel `kernel(q, k, v, segment_ids)` runs, with the kernel's "
        "mask infos first and its settings as keywords; `pallas_tpu/_implementation.py: "
        "_collapse` repeats its reshape of `partial_mask_blocks` before the backward",
        positional=("fwd_mask_info", "dq_mask_info", "dkv_mask_info", "q", "k", "v", "segment_ids"),
        keyword=("is_mqa", "block_sizes", "save_residuals", "mask_value", "attn_logits_soft_cap",
                 "residual_checkpoint_name", "mask_function", "interpret"),
    ),
    "splash_attention_bwd_dkv": EntryPoint(
        _SPLASH_KERNEL, "_splash_attention_bwd_dkv",
        "the splash dK/dV backward (unfused: the fused kernel keeps one partial dQ per key "
        "block, O(S^2) memory) from a given lse and delta: `attention_bwd` and ring "
        "attention's backward on `\"pallas_tpu\"`",
        positional=("q", "k", "v", "segment_ids", "sinks", "logsumexp", "do", "di"),
        keyword=("bq", "bkv", "bkv_compute", "is_mqa", "mask_info", "mask_value",
                 "attn_logits_soft_cap", "use_fused_bwd_kernel", "q_layout", "k_layout",
                 "v_layout", "mask_function", "interpret"),
    ),
    "splash_attention_bwd_dq": EntryPoint(
        _SPLASH_KERNEL, "_splash_attention_bwd_dq",
        "the splash dQ backward from a given lse and delta (beside `splash_attention_bwd_dkv`)",
        positional=("q", "k", "v", "segment_ids", "sinks", "logsumexp", "do", "di"),
        keyword=("bq", "bkv", "is_mqa", "mask_info", "mask_value", "attn_logits_soft_cap",
                 "q_layout", "k_layout", "v_layout", "mask_function", "interpret"),
    ),
    "splash_kernel_module_pltpu": EntryPoint(
        _SPLASH_KERNEL, "pltpu",
        "the `pltpu` module the splash kernels build their `CompilerParams` from: "
        "`splash_vmem_limit` swaps it, while a kernel is traced, for one whose "
        "`CompilerParams` also sets `vmem_limit_bytes` (splash takes no VMEM limit of its "
        "own, and its larger tiles need more than the default scoped limit)",
        attributes=("CompilerParams",),
    ),
    # ------------------------------------------- TPU flash attention (bias or mask)
    "flash_attention_impl": EntryPoint(
        _FLASH, "_flash_attention_impl",
        "the flash forward with its residuals (row sum `l` and max `m`, the lse being "
        "`m + log l`) for a request with a bias or boolean mask",
        positional=("q", "k", "v", "ab", "segment_ids", "save_residuals", "causal", "sm_scale",
                    "block_b", "block_q", "block_k_major", "block_k", "debug"),
    ),
    "flash_attention_bwd_dkv": EntryPoint(
        _FLASH, "_flash_attention_bwd_dkv",
        "the flash dK/dV backward from a given lse (passed as `m`, with `l = 1`) and delta",
        positional=("q", "k", "v", "ab", "segment_ids", "l", "m", "do", "di"),
        keyword=("block_q_major", "block_q", "block_k_major", "block_k", "sm_scale", "causal",
                 "mask_value", "debug"),
    ),
    "flash_attention_bwd_dq": EntryPoint(
        _FLASH, "_flash_attention_bwd_dq",
        "the flash dQ backward (and the bias gradient) from a given lse and delta",
        positional=("q", "k", "v", "ab", "segment_ids", "l", "m", "do", "di"),
        keyword=("block_q_major", "block_k_major", "block_k", "sm_scale", "causal", "mask_value",
                 "debug"),
    ),
    "FlashSegmentIds": EntryPoint(
        _FLASH, "SegmentIds", "segment ids (padding and packed sequences) for the flash kernels",
        positional=("q", "kv"),
    ),
    "FLASH_DEFAULT_MASK_VALUE": EntryPoint(
        _FLASH, "DEFAULT_MASK_VALUE", "the masked logit the flash backward kernels expect",
    ),
    # ------------------------------------------------- GPU (Triton) flash attention
    "gpu_mha": EntryPoint(
        _GPU, "mha", "the Triton flash forward with its residuals (the lse in base 2)",
        positional=("q", "k", "v", "segment_ids"),
        keyword=("sm_scale", "causal", "block_sizes", "num_warps", "num_stages", "interpret",
                 "return_residuals"),
        deprecated=_GPU_DEPRECATED,
    ),
    "gpu_mha_backward_kernel": EntryPoint(
        _GPU, "mha_backward_kernel",
        "the fused Triton backward kernel, launched by `kernels/_pallas_gpu.py` with a given "
        "lse and delta (`pallas_call` passes the 8 input refs, then the 3 output refs)",
        positional=("q_ref", "k_ref", "v_ref", "segment_ids_ref", "out_ref", "do_scaled_ref",
                    "lse_ref", "delta_ref", "dq_ref", "dk_ref", "dv_ref"),
        keyword=("sm_scale", "causal", "block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq",
                 "head_dim"),
        deprecated=_GPU_DEPRECATED,
    ),
    "GpuBlockSizes": EntryPoint(
        _GPU, "BlockSizes", "the Triton forward tiles",
        keyword=("block_q", "block_k"),
        deprecated=_GPU_DEPRECATED,
    ),
    "next_power_of_2": EntryPoint(
        "jax.experimental.pallas", "next_power_of_2",
        "the head-dim padding `mha_backward_kernel` assumes of its blocks (exported, "
        "but absent from the API reference)",
        positional=("x",),
    ),
    # ----------------------------------------- lowering per platform (kernels/_dispatch.py)
    "lower_per_platform": EntryPoint(
        "jax._src.interpreters.mlir", "lower_per_platform",
        "the dispatch primitive's lowering: one rule per lowering platform, each lowered with "
        "`ctx.platforms` narrowed to its own (a case on the platform index in a "
        "multi-platform export)",
        positional=("ctx", "description", "platform_rules", "default_rule", "effects"),
    ),
    "jaxpr_subcomp": EntryPoint(
        "jax.interpreters.mlir", "jaxpr_subcomp",
        "inlining a branch's jaxpr into the module being lowered (exported, undocumented)",
        positional=("ctx", "jaxpr", "name_stack", "tokens", "consts_for_constvars"),
        keyword=("dim_var_values", "const_lowering", "outer_traceback"),
    ),
    "ir_consts": EntryPoint(
        "jax._src.interpreters.mlir", "ir_consts",
        "the constants of a branch's jaxpr, as MLIR values",
        positional=("consts", "avals"),
    ),
    "primitive_batchers": EntryPoint(
        "jax.interpreters.batching", "primitive_batchers",
        "registering the dispatch primitive's `vmap` rule (a dict, exported, undocumented)",
    ),
    # ------------------------------------------------ multi-process (the tests only)
    "distributed_state": EntryPoint(
        "jax._src.distributed", "global_state",
        "the distributed client of `jax.distributed.initialize`, whose `wait_at_barrier` the "
        "multi-process fault test uses to hold its processes together "
        "(`tests/_multiprocess_fault_worker.py`); the library itself does not use it",
        attributes=("client", "process_id", "num_processes"),
    ),
    # ------------------------------------------------------------------ JAX config
    "trace_state_clean": EntryPoint(
        "jax._src.core", "trace_state_clean",
        "whether a call runs outside every trace (no `jit`, `grad`, ... around it): "
        "`models/_vae.py: vae_jit` passes its compile options only then, since JAX refuses "
        "`compiler_options` on a `jit` staged into an outer trace (no public handle exists)",
    ),
    "check_vma": EntryPoint(
        "jax._src.config", "_check_vma",
        "the switch `shard_map(check_vma=...)` sets: `_vma.tracks_vma` reads it, "
        "`_vma.opaque_to_vma` turns it off around a Pallas kernel (no public handle exists)",
        positional=("new_val",),
        attributes=("value",),
    ),
}
"""The records, by the name each is bound to in this module."""

MISSING: dict[str, str] = {}
"""The entry points the installed JAX lacks, by name: why each could not be imported."""

for _name, _entry in ENTRY_POINTS.items():
    try:
        globals()[_name] = _entry.load()
    except (ImportError, AttributeError) as _error:  # pragma: no cover - depends on the JAX version
        MISSING[_name] = f"{type(_error).__name__}: {_error}"
del _name, _entry



def _jaxlib_version() -> tuple[int, ...]:
    import jaxlib  # noqa: PLC0415  (only its version)

    return tuple(int(p) for p in jaxlib.__version__.split(".")[:3] if p.isdigit())


EMPTY_SHARD_MAP_INPUT_CRASHES = _jaxlib_version()[:2] == (0, 11)
"""jaxlib 0.11.x: XLA:CPU crashes (a segmentation fault while compiling) on a
`jax.shard_map` one of whose inputs is an empty array sharded over a mesh axis (e.g. a
joint layout's video part of length 0) and used inside; 0.10.2 and 0.12 compile it.
The library's `shard_map` entry points refuse such an input there with a
`ValueError` instead (`nn/sharding/_shard_map.py`, `parallel/_megatron.py`)."""


def refuse_empty_shard_map_inputs(owner: str, mesh, arrays) -> None:
    """Raises a `ValueError` instead of XLA:CPU's crash (`EMPTY_SHARD_MAP_INPUT_CRASHES`)
    when `arrays` (the array leaves a `shard_map` over `mesh` takes) hold an empty one;
    nothing on other jaxlibs and platforms."""
    if not EMPTY_SHARD_MAP_INPUT_CRASHES:
        return
    devices = getattr(mesh, "devices", None)
    platform = (devices.flat[0].platform if devices is not None and devices.size
                else jax.default_backend())
    if platform != "cpu":
        return
    empty = [tuple(a.shape) for a in jax.tree.leaves(arrays) if getattr(a, "size", 1) == 0]
    if empty:
        import jaxlib  # noqa: PLC0415

        raise ValueError(
            f"{owner}: jaxlib {jaxlib.__version__}'s CPU compiler crashes on a shard_map with "
            f"an empty input (received arrays of shapes {empty}); jaxlib 0.10.2 and 0.12 "
            "compile it. Leave the empty part out of the inputs (e.g. no video tokens: "
            "attend the text alone), or use another jaxlib."
        )


@contextlib.contextmanager
def gpu_lowering(device_kind: str | None):
    """The context a GPU kernel is lowered in.

    - `device_kind`: the GPU to lower for, as `jax.Device.device_kind` names it (e.g.
        `"NVIDIA H100"`), or `None` for the host's own GPU. JAX 0.11+ reads the target
        of a Pallas Triton kernel from the device, or, on a host without one, from the
        abstract device of the current abstract mesh
        (`jax._src.pallas.triton.gpu_info.get_device_kind`): a kind given here is set
        as that abstract device (`jax.sharding.use_abstract_mesh`), which JAX 0.10
        does not read and ignores.
    - JAX 0.12's deprecation of the Pallas Triton backend (`"jax-pallas-triton"`,
        warned at each lowering of a Triton kernel) is silenced for the library's own
        lowering: `"pallas_gpu"` is recorded as running on it (`_GPU_DEPRECATED`).
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", category=DeprecationWarning,
                                message="The Pallas Triton backend is deprecated")
        if device_kind is not None:
            device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None,
                                                 platform="gpu")
            mesh = jax.sharding.get_abstract_mesh().update(abstract_device=device)
            stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
        yield


class _PltpuWithVmemLimit:
    """`jax.experimental.pallas.tpu` whose `CompilerParams` sets `vmem_limit_bytes`."""

    def __init__(self, module, limit: int):
        self._module, self._limit = module, limit

    def __getattr__(self, name):
        return getattr(self._module, name)

    def CompilerParams(self, *args, **kwargs):  # noqa: N802 (the name it stands in for)
        kwargs.setdefault("vmem_limit_bytes", self._limit)
        return self._module.CompilerParams(*args, **kwargs)


@contextlib.contextmanager
def splash_vmem_limit(limit_bytes: int | None):
    """The splash kernels traced inside this context get a scoped VMEM limit of
    `limit_bytes` (`None`: the compiler's default), through their module's `pltpu`
    (`ENTRY_POINTS["splash_kernel_module_pltpu"]`). Not thread-safe: trace one such
    kernel at a time (tracing is, in JAX)."""
    if limit_bytes is None or "splash_kernel_module_pltpu" in MISSING:
        yield
        return
    module = importlib.import_module(_SPLASH_KERNEL)
    original = module.pltpu
    module.pltpu = _PltpuWithVmemLimit(original, int(limit_bytes))
    try:
        yield
    finally:
        module.pltpu = original


def single_device_sharding(device) -> jax.sharding.Sharding:
    """The sharding of an array whole on `device`: `jax.sharding.make_single_device_sharding`
    where JAX has it (0.12.1 deprecates the `SingleDeviceSharding` class), else the class."""
    make = getattr(jax.sharding, "make_single_device_sharding", None)
    if make is not None:
        return make(device)
    return jax.sharding.SingleDeviceSharding(device)


def __getattr__(name: str):
    if name in MISSING:
        entry = ENTRY_POINTS[name]
        raise AttributeError(
            f"JAX {jax.__version__} has no {entry.where} ({MISSING[name]}), which vidax_eqx "
            f"uses for {entry.use}. Install a JAX in the range pyproject.toml states."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
