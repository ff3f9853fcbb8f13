"""The public attention interface: `attention`, `attention_fwd`, `attention_bwd`."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._args import Operands, Options, SegmentIds, normalize
from ._base import AbstractImplementation, Request
from .._vma import as_varying, varying_axes
from ._math import is_empty_lse, stat_dtype
from ._dispatch import Plan, canonical_platform, host_platform, lowering_names, run, served
from ._registry import choices, report
from ._tile import SlidingTileMask


def _request(q, k, v, kwargs, *, needs_lse: bool, platform: str | None = None):
    """`(ops, opts, plan)`: the normalized arguments and what serves them on each
    platform the call may be lowered for (see `_dispatch.py`)."""
    implementation = kwargs.pop("implementation", "auto")
    ops, opts = normalize(q, k, v, **kwargs)
    plan = choices(implementation, Request.of(ops, opts, needs_lse=needs_lse, platform=platform))
    # Inside `shard_map(check_vma=True)`, an operand replicated over a mesh axis
    # (e.g. sinks or a bias) meets device-varying q/k/v: mark every operand as
    # varying over all those axes, so the custom VJP's cotangents have the
    # operands' types and the transpose of the cast sums a replicated operand's
    # per-device gradients (its correct gradient).
    ops = as_varying(ops, varying_axes(*jax.tree.leaves(ops)))
    return ops, opts, plan


def _options_from(scope: dict) -> dict:
    """The keyword arguments of a public entry point, from its `locals()`."""
    return {name: value for name, value in scope.items() if name not in ("q", "k", "v")}


def _fwd(opts: Options):
    def fwd(impl, ops):
        with jax.named_scope(f"vidax_attention_{impl.name}"):
            return impl.fwd(ops, opts)

    return fwd


def _bwd(opts: Options):
    def bwd(impl, ops, out, lse, dout, dlse):
        with jax.named_scope(f"vidax_attention_{impl.name}_bwd"):
            return impl.bwd(ops, opts, out, lse, dout, dlse)

    return bwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(plan: Plan, opts: Options, ops: Operands):
    return run(plan, _fwd(opts), ops)


def _attention_fwd_rule(plan, opts, ops):
    out, lse = _attention(plan, opts, ops)
    return (out, lse), (ops, out, lse)


def _attention_bwd_rule(plan, opts, residuals, cotangents):
    ops, out, lse = residuals
    dout, dlse = cotangents
    dq, dk, dv, dbias, dsinks = run(plan, _bwd(opts), ops, out, lse, dout, dlse)
    # Integer and boolean operands (mask, segment ids, positions) get no cotangent.
    return (Operands(dq, dk, dv, dbias, None, None, None, dsinks, None, None, None),)


_attention.defvjp(_attention_fwd_rule, _attention_bwd_rule)


def _fwd_out(opts: Options):
    def fwd_out(impl, ops):
        with jax.named_scope(f"vidax_attention_{impl.name}"):
            return impl.fwd_out(ops, opts)

    return fwd_out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention_out(plan: Plan, opts: Options, ops: Operands):
    """`_attention`'s output alone. Not differentiated, it runs the implementations'
    `fwd_out` (a kernel may skip its lse); differentiated, `_attention`'s rules."""
    return run(plan, _fwd_out(opts), ops)


def _attention_out_fwd_rule(plan, opts, ops):
    (out, _), residuals = _attention_fwd_rule(plan, opts, ops)
    return out, residuals


def _attention_out_bwd_rule(plan, opts, residuals, dout):
    _, _, lse = residuals
    return _attention_bwd_rule(plan, opts, residuals, (dout, jnp.zeros_like(lse)))


_attention_out.defvjp(_attention_out_fwd_rule, _attention_out_bwd_rule)


def _fused(plan: Plan, opts: Options, ops: Operands):
    """`attention` where a platform's choice is a fused kernel differentiated by its
    own VJP (cuDNN; `float32_lse` False), which must stay outside our custom VJP:
    the choice is staged with `lax.platform_dependent`, the others through it."""
    fused = [impl for impl in served(plan) if not impl.capabilities.float32_lse]
    rest = [impl for impl in served(plan) if impl.capabilities.float32_lse]
    if not rest:
        return _fwd(opts)(fused[0], ops)[0]
    stand_in = rest[0]  # in the platforms the fused kernel serves, never lowered
    others = tuple((p, stand_in if c in fused else c) for p, c in plan)
    branches = {}
    for platform, choice in plan:
        if choice in fused:
            for name in lowering_names(platform):
                branches[name] = lambda ops, _impl=choice: _fwd(opts)(_impl, ops)[0]
    return jax.lax.platform_dependent(ops, default=lambda ops: _attention_out(others, opts, ops), **branches)


def attention(
    q: Float[Array, "B S_q H D"],
    k: Float[Array, "B S_k H_kv D"],
    v: Float[Array, "B S_k H_kv D"],
    *,
    bias: Float[Array, "#B #H #S_q #S_k"] | None = None,
    mask: Bool[Array, "#B #H #S_q #S_k"] | SlidingTileMask | None = None,
    segment_ids: SegmentIds | Int[Array, "B S"] | None = None,
    sinks: Float[Array, "H"] | None = None,
    q_positions: Int[Array, "S_q"] | None = None,
    kv_positions: Int[Array, "S_k"] | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    kv_lengths: Int[Array, "B"] | None = None,
    quantize: str | None = None,
    implementation: str | AbstractImplementation = "auto",
) -> Float[Array, "B S_q H D"]:
    """Scaled dot-product attention with every feature, through one interface.

    Differentiable in `q`, `k`, `v`, `bias` and `sinks` by a `jax.custom_vjp` whose
    backward is [`attention_bwd`][] (it recomputes tiles rather than storing
    probabilities).

    **Arguments:**

    - `q`: queries `(B, S_q, H, D)`.
    - `k`, `v`: keys and values `(B, S_k, H_kv, D)`, `H % H_kv == 0` (GQA; `H_kv == 1`
        is MQA). Same dtype as `q`.
    - `bias`: additive float bias broadcastable to `(B, H, S_q, S_k)`, added after
        scaling and soft-capping; differentiable.
    - `mask`: boolean, broadcastable to `(B, H, S_q, S_k)`; `True` may attend. Or a
        [`SlidingTileMask`][] (3D sliding tile attention over a video laid out with
        [`tile_permute`][]): evaluated on the positions, never materialized outside
        `"xla"`; `"blockwise"` (and `"pallas_tpu"`) skip the tiles it hides.
    - `segment_ids`: [`SegmentIds`][] `(q=(B, S_q), kv=(B, S_k))`, or one `(B, S)` int array
        when `S_q == S_k`. Tokens attend within equal ids; negative ids are padding
        (a padding token attends to nothing and nothing attends to it: its output row
        is 0).
    - `sinks`: per-head sink logits `(H,)` that join every row's softmax
        denominator (and carry no value); differentiable.
    - `q_positions`, `kv_positions`: int32 `(S_q,)` / `(S_k,)` token positions on which
        `causal` and `window` are defined; default `arange`.
    - `causal`: key position <= query position.
    - `window`: `(left, right)`: `q_pos - left <= kv_pos <= q_pos + right`; `None` on a
        side is unbounded.
    - `scale`: logit scale, default `1 / sqrt(D)`.
    - `logits_soft_cap`: `c` applies `c * tanh(s / c)` to the scaled logits.
    - `kv_lengths`: int `(B,)`, key-only padding: the number of valid keys of each batch
        row, `0 <= kv_lengths[b] <= S_k`. Keys at index `>= kv_lengths[b]` along `k`'s
        sequence axis (the index, not `kv_positions`) are invisible to every query;
        every query row is still computed (a row left with no visible key gives 0).
        Their values never matter (a NaN there does not reach real rows) and their
        `dk`, `dv` are 0. Combines with every other feature. Out-of-range values raise
        a `ValueError`; traced values (unknown when the program is traced) act as clipped
        to `[0, S_k]`.
    - `quantize`: `None` (float), `"int8"` (Q.Kᵀ and P.V on the matrix units' int8:
        K centred on its mean, Q and K per token, probabilities per block of keys, V per
        channel; see `kernels/_int8.py`) or `"int8-qk"` (Q.Kᵀ alone in int8). The
        forward pass only: the gradient is the float attention's at the int8 output and
        log-sum-exp (whose value is the float attention's, up to the rounding). Served by
        `"pallas_tpu"` (full attention; no mask, segment ids, positions, sinks, bias or
        soft cap) and `"xla"` (the reference: masks, segment ids, windows and key
        lengths too; no bias, sinks or soft cap).
    - `implementation`: `"auto"` (the fastest implementation that serves the request on
        this platform: see [`select_implementation`][]), `"portable"` (the same among
        the pure-JAX `"xla"` / `"blockwise"`, which XLA can partition over a mesh), a
        registered name (`"xla"`, `"blockwise"`, `"pallas_tpu"`, `"pallas_gpu"`,
        `"cudnn"`), or a configured instance such as
        `Blockwise(block_q=128, block_kv=1024)` or `PallasTpu(interpret=True)`. A named
        implementation that cannot serve the request raises `NotImplementedError`
        naming the feature; `"auto"` falls back to one that can.

    **Returns:**

    `(B, S_q, H, D)` in `q`'s dtype. A query row that can see no key gives 0.

    Inputs may be float32, bfloat16, float16, or float64 (served by `"xla"` and
    `"blockwise"`, with float64 statistics). The portable implementations create no
    inf or NaN (they run clean under `jax.debug_infs` / `jax.debug_nans`), the
    gradient included.
    """
    ops, opts, plan = _request(q, k, v, _options_from(locals()), needs_lse=False)
    if any(not impl.capabilities.float32_lse for impl in served(plan)):
        return _fused(plan, opts, ops)
    return _attention_out(plan, opts, ops)


def attention_fwd(
    q: Float[Array, "B S_q H D"],
    k: Float[Array, "B S_k H_kv D"],
    v: Float[Array, "B S_k H_kv D"],
    *,
    bias: Float[Array, "#B #H #S_q #S_k"] | None = None,
    mask: Bool[Array, "#B #H #S_q #S_k"] | SlidingTileMask | None = None,
    segment_ids: SegmentIds | Int[Array, "B S"] | None = None,
    sinks: Float[Array, "H"] | None = None,
    q_positions: Int[Array, "S_q"] | None = None,
    kv_positions: Int[Array, "S_k"] | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    kv_lengths: Int[Array, "B"] | None = None,
    quantize: str | None = None,
    implementation: str | AbstractImplementation = "auto",
) -> tuple[Float[Array, "B S_q H D"], Float[Array, "B H S_q"]]:
    """Attention that also returns the float32 log-sum-exp of each row.

    Takes the arguments of [`attention`][]; differentiable in both outputs.

    **Returns:**

    `(out, lse)`: `out (B, S_q, H, D)` in `q`'s dtype and `lse (B, H, S_q)` float32
    (float64 for float64 inputs), including the sink term when `sinks` is given. A row
    that sees no key (and has no sink) has `out = 0` and `lse = -inf`: that `-inf` is
    made here, at the boundary (the implementations carry a finite sentinel), so
    under `jax.debug_infs(True)` a call with such a row raises `FloatingPointError`
    (as the contract's `-inf` is an inf); every other call runs clean.
    """
    ops, opts, plan = _request(q, k, v, _options_from(locals()), needs_lse=True)
    out, lse = _attention(plan, opts, ops)
    return out, _public_lse(lse)


def _public_lse(lse: jax.Array) -> jax.Array:
    """The contract's lse: rows that saw nothing (the implementations' finite sentinel
    `_math.masked`, or `-inf`) as `-inf`; only such rows ever hold an inf."""
    empty = is_empty_lse(lse)
    return jnp.where(empty, -jnp.inf, lse) if _may_hold(empty) else lse


def _may_hold(flags: jax.Array) -> bool:
    """Whether `flags` may be True somewhere: always for tracers, by value otherwise
    (so a concrete call with no empty row creates no inf even eagerly)."""
    if isinstance(flags, jax.core.Tracer):
        return True
    return bool(jnp.any(flags))


def attention_bwd(
    q: Float[Array, "B S_q H D"],
    k: Float[Array, "B S_k H_kv D"],
    v: Float[Array, "B S_k H_kv D"],
    out: Float[Array, "B S_q H D"],
    lse: Float[Array, "B H S_q"],
    dout: Float[Array, "B S_q H D"],
    *,
    bias: Float[Array, "#B #H #S_q #S_k"] | None = None,
    mask: Bool[Array, "#B #H #S_q #S_k"] | SlidingTileMask | None = None,
    segment_ids: SegmentIds | Int[Array, "B S"] | None = None,
    sinks: Float[Array, "H"] | None = None,
    q_positions: Int[Array, "S_q"] | None = None,
    kv_positions: Int[Array, "S_k"] | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    kv_lengths: Int[Array, "B"] | None = None,
    quantize: str | None = None,
    implementation: str | AbstractImplementation = "auto",
    dlse: Float[Array, "B H S_q"] | None = None,
):
    """The backward pass of [`attention_fwd`][], from its saved `(out, lse)`.

    `out` and `lse` may come from a larger computation this call is one block of
    (ring attention merges blocks): each tile's probabilities are `exp(s - lse)`
    and `delta = rowsum(dout * out) - dlse`.

    **Returns:**

    `(dq, dk, dv, dbias, dsinks)`: `dbias` has `bias`'s shape and `dsinks` `(H,)`;
    each is `None` when that input was not given.
    """
    scope = _options_from(locals())
    for name in ("out", "lse", "dout", "dlse"):
        scope.pop(name)
    ops, opts, plan = _request(q, k, v, scope, needs_lse=True)
    B, S_q, H, D = ops.q.shape
    for name, x, want in (
        ("out", out, (B, S_q, H, D)),
        ("dout", dout, (B, S_q, H, D)),
        ("lse", lse, (B, H, S_q)),
        ("dlse", dlse, (B, H, S_q)),
    ):
        if x is None:
            continue
        if jnp.shape(x) != want:
            raise ValueError(f"`{name}` must have shape {want}; received {jnp.shape(x)}.")
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise TypeError(
                f"`{name}` must have a floating dtype (`out`/`dout` like q, `lse`/`dlse` "
                f"float32); received dtype {jnp.result_type(x)}."
            )

    lse = jnp.asarray(lse, stat_dtype(ops.q.dtype))
    dq, dk, dv, dbias, dsinks = run(plan, _bwd(opts), ops, jnp.asarray(out), lse, jnp.asarray(dout), dlse)
    if dbias is not None:
        dbias = dbias.reshape(jnp.shape(bias))
    return dq, dk, dv, dbias, dsinks


def select_implementation(
    q: Float[Array, "B S_q H D"],
    k: Float[Array, "B S_k H_kv D"],
    v: Float[Array, "B S_k H_kv D"],
    *,
    needs_lse: bool = False,
    platform: str | None = None,
    **kwargs,
) -> str:
    """The name of the implementation [`attention`][] would run for these arguments.

    Takes the arguments of [`attention`][] (`implementation` included). With
    `needs_lse=True`, the one [`attention_fwd`][] / [`attention_bwd`][] (and ring
    attention) would run: those need a float32 log-sum-exp with a gradient.
    `platform` (`"cpu"`, `"gpu"` / `"cuda"` / `"rocm"`, `"tpu"`) asks about a program
    lowered for that platform, from any host; by default, the platform the arrays
    live on, or for abstract and traced arrays the host's default backend (a traced
    call itself decides for the platform it is lowered for).
    Raises the errors `attention` would raise on that platform.
    [`implementation_report`][] says why the others were passed over.
    """
    kwargs.setdefault("implementation", "auto")
    platform = None if platform is None else canonical_platform(platform)

    def choose(q, k, v, **kw):
        ops, opts = normalize(q, k, v, **{n: x for n, x in kw.items() if n != "implementation"})
        request = _on_platform(Request.of(ops, opts, needs_lse=needs_lse, platform=platform))
        return dict(choices(kw["implementation"], request))[request.platform].name

    return _on_abstract(choose, q, k, v, kwargs)


def _on_platform(request: Request) -> Request:
    """`request`, for the host's default platform when it was left to lowering."""
    if request.platform is not None:
        return request
    return dataclasses.replace(request, platform=host_platform())


def check_request(q, k, v, *, needs_lse: bool = False, **kwargs) -> None:
    """Raises what [`attention`][] would raise now for these arguments (on traced
    arrays: when no platform serves them); used by `parallel/` to validate once."""

    def check(q, k, v, **kw):
        _request(q, k, v, kw, needs_lse=needs_lse)

    _on_abstract(check, q, k, v, kwargs)


def _on_abstract(fn, q, k, v, kwargs):
    """`fn(q, k, v, **kwargs)` (a static answer), traced under `jax.eval_shape` when
    any argument is a `jax.ShapeDtypeStruct`: shapes alone can be asked about."""
    is_struct = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    if not any(is_struct(x) for x in jax.tree.leaves((q, k, v, kwargs), is_leaf=is_struct)):
        return fn(q, k, v, **kwargs)
    arrays = {n: x for n, x in kwargs.items() if is_struct(x) or isinstance(x, (jax.Array, SegmentIds))}
    static = {n: x for n, x in kwargs.items() if n not in arrays}
    answer = []
    jax.eval_shape(lambda q, k, v, arrays: answer.append(fn(q, k, v, **arrays, **static)), q, k, v, arrays)
    return answer[0]


def implementation_report(
    q: Float[Array, "B S_q H D"],
    k: Float[Array, "B S_k H_kv D"],
    v: Float[Array, "B S_k H_kv D"],
    *,
    needs_lse: bool = False,
    platform: str | None = None,
    **kwargs,
) -> dict[str, list[str]]:
    """Why each registered implementation does or does not serve these arguments.

    Takes the arguments of [`select_implementation`][] (without `implementation`),
    `platform` included.

    **Returns:**

    `{name: reasons}` for every registered implementation, in the order `"auto"`
    tries them on that platform (then the rest): `reasons` lists the features,
    platform, dtype or head size it cannot serve, and is empty for those that
    serve the request. `"auto"` runs the first with no reasons.
    """
    platform = None if platform is None else canonical_platform(platform)

    def explain(q, k, v, **kwargs):
        ops, opts = normalize(q, k, v, **kwargs)
        return report(_on_platform(Request.of(ops, opts, needs_lse=needs_lse, platform=platform)))

    return _on_abstract(explain, q, k, v, kwargs)


def splash_blocks(
    q: Float[Array, "B S_q H D"],
    k: Float[Array, "B S_k H_kv D"],
    v: Float[Array, "B S_k H_kv D"],
    *,
    implementation: str | AbstractImplementation = "pallas_tpu",
    **kwargs,
):
    """The [`SplashBlocks`][vidax_eqx.kernels.SplashBlocks] that `"pallas_tpu"` runs the
    splash kernels with for these arguments (those of [`attention`][]; arrays or
    `jax.ShapeDtypeStruct`s): the chip's table row fitted to the problem, or the
    configuration `implementation` (a [`PallasTpu`][vidax_eqx.kernels.PallasTpu]) was
    given. On a host without a TPU, the default table's (TPU v5e). `None` when the
    request runs the flash kernel (a bias or a boolean mask).
    """

    def blocks(q, k, v, **kw):
        ops, opts = normalize(q, k, v, **kw)
        impl = implementation
        if isinstance(impl, str):
            impl = dict(choices(impl, dataclasses.replace(
                Request.of(ops, opts, platform="tpu"), platform="tpu")))["tpu"]
        if not hasattr(impl, "splash_blocks"):
            raise ValueError(
                f"splash_blocks: `implementation` must be 'pallas_tpu' or a PallasTpu; received "
                f"{implementation!r}."
            )
        if ops.bias is not None or ops.mask is not None:
            return None
        return impl.splash_blocks(ops, opts)

    return _on_abstract(blocks, q, k, v, kwargs)
