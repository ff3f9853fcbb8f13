"""Low-rank adapters (LoRA) on the linear layers of `vidax_eqx.nn`.

A [`LoRALinear`][] wraps an `eqx.nn.Linear` and holds named adapters, each adding
`scale * alpha / rank * (x @ A.T) @ B.T` to the layer's output. The modules of `nn/`
apply every linear through `_layers.linear` / `_layers.row_parallel`, which add the
adapters' term, so a wrapped layer works wherever a plain one does: under Megatron
tensor parallelism (the adapter follows the layer's split, see
[`partition_specs`][vidax_eqx.nn.sharding.partition_specs]), FSDP, and in stacked (scanned)
layers, whose adapters carry the same leading layer axis.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._shapes import checked
from . import _init as init
from ._quantized import product, QuantizedLinear


DEFAULT = "default"
"""The name of an adapter when none is given (PEFT's)."""


class LoRA(eqx.Module):
    """One low-rank adapter: `delta_W = scale * alpha / rank * lora_B @ lora_A`.

    **Fields** (arrays; a stacked layer's carry a leading layer axis):

    - `lora_A`: `(rank, in_features)`, PEFT's `lora_A.weight` (kohya's `lora_down`).
    - `lora_B`: `(out_features, rank)`, PEFT's `lora_B.weight` (kohya's `lora_up`).
    - `alpha`: float32 `()`, PEFT's `lora_alpha` (kohya's `.alpha`).
    - `scale`: float32 `()`, the adapter's weight in the sum (diffusers'
        `set_adapters(..., adapter_weights)`), 1 by default; an array, so changing it
        ([`set_lora_scale`][]) does not recompile.

    Only `lora_A` and `lora_B` are trained ([`lora_filter`][]).
    """

    lora_A: Array
    lora_B: Array
    alpha: Array
    scale: Array

    @property
    def rank(self) -> int:
        return self.lora_A.shape[-2]

    def multiplier(self) -> Array:
        """`scale * alpha / rank`, float32, with the leading layer axes of a stacked
        adapter."""
        return self.scale.astype(jnp.float32) * self.alpha.astype(jnp.float32) / self.rank

    def delta(self) -> Array:
        """The float32 update of the base weight, `(..., out, in)`."""
        b = self.lora_B.astype(jnp.float32)
        a = self.lora_A.astype(jnp.float32)
        return jnp.einsum("...or,...ri->...oi", b, a) * self.multiplier()[..., None, None]


class LoRALinear(eqx.Module):
    """An `eqx.nn.Linear` with low-rank adapters: `base(x) + sum over the active
    adapters of scale * alpha / rank * (x @ A.T) @ B.T`.

    Stands in for the linear layer it wraps: `weight`, `bias`, `in_features`,
    `out_features` are the base layer's (so the placement, the checks of the modules
    and the checkpoint loaders see the layer they know), and the modules of
    [`vidax_eqx.nn`][] add the adapters' term where they apply the layer, inside the
    tensor-parallel partial sum of a row-parallel layer (one `psum`, as before).

    Made by [`with_lora`][] (a new adapter) or `vidax_eqx.models.add_lora` /
    `load_lora` (by name pattern, or from a shared file).

    **Fields:** `base` (the `eqx.nn.Linear`), `adapters` (`dict[str, LoRA]`, by
    name), static `merged` (the names of the adapters folded into `base.weight` by
    [`merge_lora`][]: kept so that [`unmerge_lora`][] can take them out, and skipped
    by the forward pass).
    """

    base: eqx.nn.Linear
    adapters: dict[str, LoRA]
    merged: tuple[str, ...] = eqx.field(static=True, default=())

    @property
    def weight(self):
        return self.base.weight

    @property
    def bias(self):
        return self.base.bias

    @property
    def in_features(self):
        return self.base.in_features

    @property
    def out_features(self):
        return self.base.out_features

    @property
    def use_bias(self) -> bool:
        return self.base.use_bias

    def active(self) -> list[LoRA]:
        """The adapters the forward pass adds (every one not merged), by name."""
        return [a for n, a in sorted(self.adapters.items()) if n not in self.merged]

    @checked
    def __call__(
        self, x: Float[Array, "*batch {self.in_features}"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*batch {self.out_features}"]:
        """`x @ W.T + b` plus the adapters' term, on the last axis of `x` (one vector,
        as `eqx.nn.Linear` takes it, or any leading axes). `key` is ignored."""
        del key
        with jax.named_scope("vidax_eqx.nn.LoRALinear"):
            y = product(self.base, x)
            y = y + lora_term(self, x, y.dtype)
            return y if self.bias is None else y + self.bias


def _refuse_quantized(owner: str, layer) -> None:
    if isinstance(layer.base, QuantizedLinear):
        raise ValueError(
            f"{owner}: this adapter's base layer has int8 weights (a QuantizedLinear): folding "
            "the adapter into it would quantize the sum again. Merge before quantizing "
            "(`models.quantize(merge_lora(model))`), or keep the adapters unmerged.")


def is_lora_linear(x) -> bool:
    return isinstance(x, LoRALinear)


def lora_term(layer, x: Array, dtype) -> Array | int:
    """The adapters' contribution `sum scale * alpha / rank * (x @ A.T) @ B.T` for the
    linear `layer` (0 for a plain `eqx.nn.Linear`), in `dtype`. Row-parallel: `x` and
    `A` hold this device's input features, so it is a partial sum like `x @ W.T`."""
    if not isinstance(layer, LoRALinear):
        return 0
    total = 0
    for adapter in layer.active():
        h = x @ adapter.lora_A.T
        h = h * adapter.multiplier().astype(h.dtype)
        total = total + h @ adapter.lora_B.T
    return total if isinstance(total, int) else total.astype(dtype)


def with_lora(layer, rank: int, *, alpha: float | None = None, name: str = DEFAULT,
              dtype=None, key: PRNGKeyArray) -> LoRALinear:
    """`layer` with a new adapter, initialised as PEFT does: `lora_A` uniform in
    `±1 / sqrt(in_features)` (PyTorch's Kaiming-uniform with `a = sqrt(5)`), `lora_B`
    zeros, so the layer computes what it did.

    **Arguments:**

    - `layer`: an `eqx.nn.Linear` or a [`LoRALinear`][] (the adapter is added to the
        ones it has), or a stacked one (weights `(L, out, in)`: one adapter per layer).
    - `rank`: the adapter's rank, positive.
    - `alpha`: the scaling numerator (`alpha / rank`); default `rank` (a factor 1).
    - `name`: the adapter's name, new on the layer.
    - `dtype`: the adapter's dtype; default the layer's weight dtype.
    - `key`: a PRNG key for `lora_A`.

    **Returns:**

    A [`LoRALinear`][].
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"with_lora: `rank` must be a positive integer; received {rank!r}.")
    if alpha is not None and not (isinstance(alpha, (int, float)) and math.isfinite(alpha)):
        raise ValueError(f"with_lora: `alpha` must be a finite number or None; received {alpha!r}.")
    if not isinstance(layer, (eqx.nn.Linear, LoRALinear, QuantizedLinear)):
        raise ValueError(f"with_lora: `layer` must be an eqx.nn.Linear, LoRALinear or "
                         f"QuantizedLinear; received {type(layer).__name__}.")
    existing = layer.adapters if isinstance(layer, LoRALinear) else {}
    if name in existing:
        raise ValueError(f"with_lora: the layer already has an adapter named {name!r}; pass "
                         "another `name`.")
    base = layer.base if isinstance(layer, LoRALinear) else layer
    stored = base.qweight if isinstance(base, QuantizedLinear) else base.weight  # (no dequantizing)
    *lead, out_features, in_features = stored.shape
    if dtype is None:
        dtype = base.dtype if isinstance(base, QuantizedLinear) else base.weight.dtype
    bound = 1 / math.sqrt(in_features)
    adapter = LoRA(
        lora_A=init.uniform(key, (*lead, rank, in_features), dtype, bound),
        lora_B=init.zeros((*lead, out_features, rank), dtype),
        alpha=init.full(lead, float(rank if alpha is None else alpha), jnp.float32),
        scale=init.ones(lead, jnp.float32),
    )
    return attach(layer, name, adapter)


def attach(layer, name: str, adapter: LoRA) -> LoRALinear:
    """`layer` (plain or wrapped) with `adapter` added under `name`."""
    if isinstance(layer, LoRALinear):
        return LoRALinear(layer.base, {**layer.adapters, name: adapter}, layer.merged)
    return LoRALinear(layer, {name: adapter})


def _map_layers(fn, tree):
    return jax.tree.map(lambda x: fn(x) if is_lora_linear(x) else x, tree, is_leaf=is_lora_linear)


def lora_names(tree) -> list[str]:
    """The names of the adapters of the [`LoRALinear`][] layers anywhere in `tree`,
    sorted."""
    names = set()
    _map_layers(lambda layer: names.update(layer.adapters) or layer, tree)
    return sorted(names)


def _check_names(owner: str, tree, names) -> tuple[str, ...]:
    present = lora_names(tree)
    if names is None:
        return tuple(present)
    names = (names,) if isinstance(names, str) else tuple(names)
    missing = [n for n in names if n not in present]
    if missing:
        raise ValueError(f"{owner}: no adapter named {missing}; the tree has {present}.")
    return names


def lora_filter(tree):
    """The filter spec that selects the adapters' trainable arrays (`lora_A`,
    `lora_B`) of `tree`: `True` there, `False` at every other leaf.

        trainable, frozen = eqx.partition(model, nn.lora_filter(model))

    `optax` then holds state for the adapters only, and the gradient of
    `eqx.combine(trainable, frozen)` is taken with respect to `trainable`.
    """
    def spec(node):
        if isinstance(node, LoRA):
            return LoRA(lora_A=True, lora_B=True, alpha=False, scale=False)
        return False

    return jax.tree.map(spec, tree, is_leaf=lambda x: isinstance(x, LoRA))


def set_lora_scale(tree, scales: dict[str, float]):
    """`tree` with the weight of each named adapter set (diffusers'
    `set_adapters(names, adapter_weights)`): 0 switches one off, without recompiling
    (the weights are arrays).

    **Arguments:**

    - `tree`: a model or any PyTree with [`LoRALinear`][] layers.
    - `scales`: adapter name -> weight.
    """
    if not isinstance(scales, dict):
        raise ValueError(f"set_lora_scale: `scales` must be a dict of adapter name -> weight; "
                         f"received {type(scales).__name__}.")
    _check_names("set_lora_scale", tree, list(scales))

    def one(layer):
        adapters = {n: (a if n not in scales else eqx.tree_at(
            lambda a: a.scale, a, jnp.full_like(a.scale, float(scales[n]))))
            for n, a in layer.adapters.items()}
        return LoRALinear(layer.base, adapters, layer.merged)

    return _map_layers(one, tree)


def merge_lora(tree, names=None, *, keep_originals: bool = False):
    """The named adapters folded into their layers' weights:
    `W <- W + scale * alpha / rank * B @ A`, computed in float32 and cast back to the
    weight's dtype. The layers stay [`LoRALinear`][] with those names in `merged` (the
    forward pass skips them; [`unmerge_lora`][] takes them out again).

    Stacked layers merge one layer at a time, in place (a loop over the layers), so
    the float32 temporaries are one layer's weight. Under `eqx.filter_jit(merge_lora, donate="all")` the new
    weights take the old ones' buffers.

    **Arguments:**

    - `tree`: a model or any PyTree with [`LoRALinear`][] layers.
    - `names`: an adapter name or a sequence of them; default every adapter not yet
        merged.
    - `keep_originals`: also return the weights the merge replaces, copied to the host
        (NumPy), for a bit-for-bit [`unmerge_lora`][] (outside `jit` only).

    **Returns:**

    The merged tree; with `keep_originals`, `(merged, originals)`.
    """
    names = _check_names("merge_lora", tree, names)
    originals = {}
    if keep_originals:
        flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_lora_linear)[0]
        for path, layer in flat:
            if is_lora_linear(layer) and any(n in layer.adapters and n not in layer.merged
                                             for n in names):
                originals[jax.tree_util.keystr(path)] = np.asarray(jax.device_get(layer.weight))

    def one(layer):
        todo = [n for n in names if n in layer.adapters and n not in layer.merged]
        if not todo:
            return layer
        _refuse_quantized("merge_lora", layer)
        weight = _shift(layer.weight, [layer.adapters[n] for n in todo], +1)
        base = eqx.tree_at(lambda b: b.weight, layer.base, weight)
        return LoRALinear(base, layer.adapters, layer.merged + tuple(todo))

    merged = _map_layers(one, tree)
    return (merged, originals) if keep_originals else merged


def unmerge_lora(tree, names=None, *, originals: dict | None = None):
    """The named merged adapters taken out of their layers' weights again (they become
    active adapters).

    Without `originals`: `W <- W - scale * alpha / rank * B @ A` in float32, which
    gives back the weights before [`merge_lora`][] up to the merge's rounding: an
    element may be off by up to an ulp of the merged weight `W + delta` (on the test
    model, whose adapter changes the output by 19%, 10% of the elements were; a small
    weight next to a large delta is off by many of its own ulps). With `originals` (from
    `merge_lora(..., keep_originals=True)`) the weights are those originals, bit for
    bit, placed like the merged ones.

    **Arguments:**

    - `tree`: a model or any PyTree with merged [`LoRALinear`][] layers.
    - `names`: an adapter name or a sequence of them; default every merged adapter.
    - `originals`: the dict `merge_lora(..., keep_originals=True)` returned with this
        tree; every layer with a merged adapter named here must be in it.
    """
    names = _check_names("unmerge_lora", tree, names)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_lora_linear)
    out = []
    for path, layer in flat:
        todo = [n for n in names if is_lora_linear(layer) and n in layer.merged]
        if not todo:
            out.append(layer)
            continue
        _refuse_quantized("unmerge_lora", layer)
        if originals is not None:
            where = jax.tree_util.keystr(path)
            if where not in originals:
                raise ValueError(
                    f"unmerge_lora: `originals` has no weight for the merged layer {where}; "
                    "pass the dict merge_lora(..., keep_originals=True) returned for this tree.")
            if set(todo) != set(layer.merged):
                raise ValueError(
                    f"unmerge_lora: the originals of {where} are its weight before all of its "
                    f"merged adapters {list(layer.merged)}; received names {todo}. Unmerge "
                    "them together, or without `originals`.")
            weight = _restore(layer.weight, originals[where], where)
        else:
            weight = _shift(layer.weight, [layer.adapters[n] for n in todo], -1)
        base = eqx.tree_at(lambda b: b.weight, layer.base, weight)
        out.append(LoRALinear(base, layer.adapters, tuple(n for n in layer.merged if n not in todo)))
    return jax.tree_util.tree_unflatten(treedef, out)


def remove_lora(tree, names=None):
    """`tree` without the named adapters (default all). A merged adapter cannot be
    removed (unmerge it first); a layer left with none becomes its plain
    `eqx.nn.Linear` again."""
    names = _check_names("remove_lora", tree, names)

    def one(layer):
        stuck = [n for n in names if n in layer.merged]
        if stuck:
            raise ValueError(f"remove_lora: the adapters {stuck} are merged into the weights; "
                             "unmerge_lora them first (or keep the merged layer).")
        adapters = {n: a for n, a in layer.adapters.items() if n not in names}
        return LoRALinear(layer.base, adapters, layer.merged) if adapters else layer.base

    return _map_layers(one, tree)


def _shift(weight, adapters, sign):
    """`weight +/- sum of the adapters' deltas`, float32 math, the weight's dtype; a
    stacked weight one layer at a time, updated in place (a loop whose carry is the
    stack), so the temporaries are one layer's."""
    def one(w, parts):
        total = w.astype(jnp.float32)
        for a in parts:
            total = total + sign * a.delta()
        return total.astype(w.dtype)

    if weight.ndim == 2:
        return one(weight, adapters)
    flat = lambda x: x.reshape((-1, *x.shape[weight.ndim - 2:]))  # noqa: E731
    parts = [jax.tree.map(flat, a) for a in adapters]

    def body(i, w):
        return w.at[i].set(one(w[i], [jax.tree.map(lambda x: x[i], a) for a in parts]))

    w = weight.reshape((-1, *weight.shape[-2:]))
    return jax.lax.fori_loop(0, w.shape[0], body, w).reshape(weight.shape)


def _restore(weight, original, where: str):
    if tuple(original.shape) != tuple(weight.shape) or original.dtype != weight.dtype:
        raise ValueError(
            f"unmerge_lora: the original of {where} is {original.dtype}{list(original.shape)}, "
            f"the merged weight {weight.dtype}{list(weight.shape)}; pass the originals of this tree.")
    if isinstance(weight, jax.core.Tracer):
        raise ValueError("unmerge_lora: `originals` are host arrays, restored outside `jit`.")
    sharding = getattr(weight, "sharding", None)
    return jax.device_put(original, sharding)
