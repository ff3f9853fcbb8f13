"""Wan 2.2 A14B: two Wan transformers, a high-noise and a low-noise expert, one chosen
per call by the timestep."""

import json
import numbers
import os
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Real

from ... import interop
from ...nn import sharding
from .._base import AbstractExperts, AbstractPerExpert, expert_kwargs
from .._capabilities import Capabilities
from .._options import attention_keywords
from ._model import WanTransformer3D
from ._text_cache import WanTextCache


# The boundaries of Wan 2.2's own configs (`wan/configs/wan_{t2v,i2v}_A14B.py`), for the
# original layout, whose checkpoint does not carry it.
_WAN_BOUNDARIES = {"t2v": 0.875, "i2v": 0.900}
# The experts' folders (high noise, low noise) in each layout.
_FOLDERS = {"diffusers": ("transformer", "transformer_2"),
            "wan": ("high_noise_model", "low_noise_model")}
# Fields both experts must share: they take the same inputs and give the same outputs.
_SHARED = ("patch_size", "in_channels", "out_channels", "text_dim", "image_dim",
           "pos_embed_seq_len", "text_len")


class WanExpertsTextCache(AbstractPerExpert):
    """The text K/V caches of both experts of a [`WanExperts`][] for one context (each
    expert has its own cross-attention weights): [`WanExperts.text_cache`][] makes
    it, `WanExperts.__call__(..., text_cache=...)` gives each expert its own, and
    [`sharded_text_cache`][] makes it over a mesh.

    **Fields:** `high_noise`, `low_noise`: [`WanTextCache`][]s.
    """

    high_noise: WanTextCache
    low_noise: WanTextCache

    def for_expert(self, index: int) -> WanTextCache:
        """Expert `index`'s cache (0: high noise, 1: low noise)."""
        return (self.high_noise, self.low_noise)[index]

    def partition_specs(self, parallel: sharding.ParallelConfig, batch_axis=None):
        """The `shard_map` specs of a batched cache: each expert's
        ([`WanTextCache.partition_specs`][])."""
        return WanExpertsTextCache(self.high_noise.partition_specs(parallel, batch_axis),
                                   self.low_noise.partition_specs(parallel, batch_axis))


class WanExperts(AbstractExperts):
    """Wan 2.2's two-expert models (T2V-A14B, I2V-A14B): a high-noise and a low-noise
    [`WanTransformer3D`][], a call routed by its timestep as Wan 2.2 and diffusers'
    `WanPipeline` route it:

        timestep >= boundary * num_train_timesteps  ->  high_noise,  else  low_noise

    A call takes one example, like [`WanTransformer3D`][] (same arguments), and runs
    one expert: the choice is a `lax.cond`, so under `eqx.filter_jit` with a traced
    timestep the compiled program holds both experts but executes one. A per-token
    timestep routes by its largest value (the noise level of the generated tokens).
    Under `jax.vmap` with timesteps that differ across the batch, `lax.cond` becomes a
    select and both experts run; [`vidax_eqx.models.run_sharded`][] routes a batch
    instead: one expert when every example picks it (the batch of a sampler step
    does), both only for a batch that mixes them.

    Training: [`route`][WanExperts.route] runs a whole step (loss, gradients,
    optimizer update) for the expert a timestep selects, leaving the other expert's
    weights and optimizer state untouched.

    **Fields:** `high_noise`, `low_noise` (the experts), and the static `boundary`
    (in (0, 1), diffusers' `boundary_ratio`) and `num_train_timesteps` (1000).
    """

    high_noise: WanTransformer3D
    low_noise: WanTransformer3D
    boundary: float = eqx.field(static=True, converter=lambda b: _real_to_float(b))
    num_train_timesteps: int = eqx.field(static=True, default=1000)
    stacked_layers: ClassVar[tuple[str, ...]] = ()
    capabilities: ClassVar[Capabilities] = Capabilities(
        latents="CFHW", timestep="token", text_cache=True, step_cache=True, streaming=False,
        experts=True, image=frozenset({"channels", "embedding"}))

    def __check_init__(self):
        for name in ("high_noise", "low_noise"):
            if not isinstance(getattr(self, name), WanTransformer3D):
                raise ValueError(f"WanExperts: `{name}` must be a WanTransformer3D; received "
                                 f"{type(getattr(self, name)).__name__}.")
        if isinstance(self.boundary, bool) or not isinstance(self.boundary, numbers.Real) \
                or not 0 < self.boundary < 1:
            raise ValueError(
                "WanExperts: `boundary` (the fraction of num_train_timesteps where the "
                f"high-noise expert hands over; Wan 2.2: 0.875 T2V, 0.9 I2V) must be in (0, 1); "
                f"received {self.boundary!r}."
            )
        n = self.num_train_timesteps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"WanExperts: `num_train_timesteps` must be a positive int; "
                             f"received {n!r}.")
        high, low = self.high_noise.config, self.low_noise.config
        for field in _SHARED:
            if getattr(high, field) != getattr(low, field):
                raise ValueError(
                    f"WanExperts: both experts take the same inputs and give the same outputs, "
                    f"so their configs must agree on `{field}`; received high_noise "
                    f"{getattr(high, field)!r}, low_noise {getattr(low, field)!r}."
                )
        if self.high_noise.parallel != self.low_noise.parallel:
            raise ValueError(
                "WanExperts: both experts run on one mesh with one placement, so their "
                f"ParallelConfigs must be equal; received high_noise {self.high_noise.parallel}, "
                f"low_noise {self.low_noise.parallel}. Set one with "
                "nn.sharding.with_parallel(experts, config)."
            )

    @property
    def config(self):
        """The high-noise expert's [`WanConfig`][] (the inputs and outputs of both)."""
        return self.high_noise.config

    @property
    def parallel(self) -> sharding.ParallelConfig:
        """The [`vidax_eqx.nn.sharding.ParallelConfig`][] both experts run with."""
        return self.high_noise.parallel

    in_channels = property(lambda self: self.high_noise.in_channels)
    out_channels = property(lambda self: self.high_noise.out_channels)
    patch_size = property(lambda self: self.high_noise.patch_size)
    text_dim = property(lambda self: self.high_noise.text_dim)

    @property
    def boundary_timestep(self) -> float:
        """`boundary * num_train_timesteps`: the smallest timestep of the high-noise expert."""
        return self.boundary * self.num_train_timesteps

    @property
    def experts(self) -> tuple[WanTransformer3D, WanTransformer3D]:
        """`(high_noise, low_noise)`: expert `0` and expert `1` of [`route`][WanExperts.route]."""
        return self.high_noise, self.low_noise

    def is_high_noise(self, timestep: Real[Array, "*batch"] | float) -> Bool[Array, ""]:
        """Whether `timestep` (a scalar, or one per token: their largest) selects the
        high-noise expert: `timestep >= boundary * num_train_timesteps`."""
        timestep = jnp.asarray(timestep)
        return jnp.max(timestep) >= self.boundary_timestep

    def route(self, timestep, fn, *args):
        """`fn(expert, index, *args)` for the expert `timestep` selects (`index` 0: high
        noise, 1: low noise), by `lax.cond`: both branches are compiled, one runs.

        `fn` may return any PyTree (arrays, modules with static fields); the two
        branches must agree on its non-array parts. A training step, for example:

            def train(expert, i, opt_states, batch):
                loss, grads = eqx.filter_value_and_grad(loss_fn)(expert, batch)
                updates, state = optimizer.update(grads, opt_states[i], expert)
                expert = eqx.apply_updates(expert, updates)
                opt_states = opt_states[:i] + (state,) + opt_states[i + 1:]
                return experts.with_expert(i, expert), opt_states, loss

            experts, opt_states, loss = experts.route(t, train, opt_states, batch)

        with `opt_states = tuple(optimizer.init(eqx.filter(e, eqx.is_array)) for e in
        experts.experts)`: the expert `t` does not select, and its optimizer state,
        come back bit for bit (its gradient is never computed).

        **Arguments:**

        - `timestep`: a scalar (or per-token) timestep; under `jit` it may be traced.
        - `fn`: a function of `(expert, index, *args)`.
        - `args`: passed on to `fn` (any PyTree).
        """
        timestep = jnp.asarray(timestep)
        return _cond(self.is_high_noise(timestep),
                     lambda: fn(self.high_noise, 0, *args),
                     lambda: fn(self.low_noise, 1, *args))

    def route_batch(self, fn, timestep, *, axis_name=None):
        """`fn(expert, index)` on a batch: one expert when every example selects it,
        both (each example's output taken from its expert) when the batch mixes them.

        **Arguments:**

        - `fn`: a function of one expert and its index (0: high noise, 1: low noise)
            returning batched arrays `(B, ...)`.
        - `timestep`: the batch's timesteps, `(B,)` or per token `(B, S)`.
        - `axis_name`: inside `shard_map`, the mesh axis the batch is split over: the
            devices agree on the choice (their collectives must run in the same branch).
        """
        timestep = jnp.asarray(timestep)
        high = jax.vmap(self.is_high_noise)(timestep)
        count, total = jnp.sum(high, dtype=jnp.int32), high.shape[0]
        if axis_name is not None:
            count, total = lax.psum(count, axis_name), total * lax.axis_size(axis_name)

        def mixed():
            a, b = fn(self.high_noise, 0), fn(self.low_noise, 1)
            return jax.tree.map(
                lambda u, v: jnp.where(high.reshape((-1,) + (1,) * (u.ndim - 1)), u, v), a, b)

        case = jnp.where(count == total, 0, jnp.where(count == 0, 1, 2))
        return lax.switch(case, (lambda: fn(self.high_noise, 0), lambda: fn(self.low_noise, 1),
                                 mixed))

    def with_expert(self, index: int, expert: WanTransformer3D) -> "WanExperts":
        """A copy with expert `index` (0: high noise, 1: low noise) replaced."""
        if index not in (0, 1):
            raise ValueError(f"WanExperts.with_expert: `index` must be 0 (high noise) or 1 "
                             f"(low noise); received {index!r}.")
        where = (lambda m: m.high_noise) if index == 0 else (lambda m: m.low_noise)
        return eqx.tree_at(where, self, expert)

    @attention_keywords
    def __call__(self, x, timestep, context, **kwargs):
        """One example, as [`WanTransformer3D`][] takes it (`x`, `timestep`, `context`,
        and its keyword arguments: `context_image`, `remat`, `attention`;
        `text_cache` a [`WanExpertsTextCache`][], each expert taking its own), run by
        the expert `timestep` selects.

        **Returns:**

        That expert's prediction `(out_channels, F, H, W)`.
        """
        with jax.named_scope("vidax_eqx.models.WanExperts"):
            return self.route(timestep, lambda m, i: m(x, timestep, context,
                                                       **expert_kwargs(kwargs, i)))

    def text_cache(self, context, *, context_image=None) -> WanExpertsTextCache:
        """Each expert's [`WanTransformer3D.text_cache`][] of `context` (and
        `context_image`): pass it as `text_cache=` at every denoising step, for bit for
        bit the output without it.

        **Returns:**

        A [`WanExpertsTextCache`][].
        """
        return WanExpertsTextCache(
            *(e.text_cache(context, context_image=context_image) for e in self.experts))

    def combine_text_caches(self, caches) -> WanExpertsTextCache:
        """A [`WanExpertsTextCache`][] of each expert's [`WanTextCache`][] (high noise,
        then low noise)."""
        return WanExpertsTextCache(*caches)

    def linear_layers(self) -> list[interop.LinearName]:
        """Every linear layer of both experts, its path from this module and its names
        prefixed by the expert's folder in each layout (`high_noise_model.` /
        `low_noise_model.` in Wan's, `transformer.` / `transformer_2.` in diffusers'):
        the names of a pipeline's two transformers."""
        layers = []
        for index, (field, expert) in enumerate((("high_noise", self.high_noise),
                                                 ("low_noise", self.low_noise))):
            prefixes = (_FOLDERS["wan"][index], _FOLDERS["diffusers"][index])
            for layer in expert.linear_layers():
                layers.append(interop.LinearName(
                    (jax.tree_util.GetAttrKey(field), *layer.path), layer.layer,
                    tuple(f"{p}.{n}" for p, n in zip(prefixes, layer.names))))
        return layers

    @attention_keywords
    def cached_call(self, x, timestep, context, step_cache, **kwargs):
        """[`WanTransformer3D.cached_call`][] of the expert `timestep` selects (both
        experts have the same shapes, so they share one [`StepCache`][]). A residual
        is one expert's: the caller forces the first step after a switch of experts to
        run every block (`may_reuse=False`), as `sampling.sample` does.

        **Returns:**

        `(out, step_cache)`, that expert's.
        """
        with jax.named_scope("vidax_eqx.models.WanExperts.cached_call"):
            return self.route(timestep, lambda m, i: m.cached_call(
                x, timestep, context, step_cache, **expert_kwargs(kwargs, i)))

    # -- checkpoints --------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path, *, boundary: float | None = None, dtype=None,
                        parallel: sharding.ParallelConfig = sharding.ParallelConfig(),
                        implementation="auto", pad_text: bool = False, mesh=None,
                        revision: str | None = None, cache_dir=None,
                        quantize: str | None = None) -> "WanExperts":
        """Loads Wan 2.2 A14B from a directory in one of its two layouts:

        - a diffusers pipeline (`Wan-AI/Wan2.2-T2V-A14B-Diffusers`): `model_index.json`,
            `transformer/` (the high-noise expert) and `transformer_2/` (low noise);
            the boundary is `model_index.json`'s `boundary_ratio`;
        - Wan 2.2's own release (`Wan-AI/Wan2.2-T2V-A14B`): `high_noise_model/` and
            `low_noise_model/`; the boundary is a `boundary_ratio` in their
            `config.json` when there is one (what [`save_pretrained`][] writes), else
            Wan 2.2's own (its code's configs): 0.875 for `model_type` t2v, 0.9 for i2v.

        Each expert is read by [`WanTransformer3D.from_pretrained`][] (diffusers or
        Wan names, shards, dtype, and with `mesh` straight into its sharded layout).

        **Arguments:**

        - `path`: the directory, or a Hugging Face Hub repository id (either layout;
            only the experts' folders and `model_index.json` are fetched), see
            [`vidax_eqx.interop.resolve_checkpoint`][].
        - `boundary`: overrides the boundary the directory gives.
        - `dtype`, `parallel`, `implementation`, `pad_text`, `mesh`, `quantize`: as for
            [`WanTransformer3D.from_pretrained`][], for both experts.
        - `revision`, `cache_dir`: the Hub revision and cache directory (Hub ids only).
        """
        root = os.fspath(path)
        if not os.path.isdir(root) or revision is not None or cache_dir is not None:
            root = _from_hub(root, revision, cache_dir)
        found = sorted(os.listdir(root))
        index = _read_json(os.path.join(root, "model_index.json"))
        if index is not None or set(_FOLDERS["diffusers"]) & set(found):
            folders, saved = _FOLDERS["diffusers"], (index or {}).get("boundary_ratio")
        else:
            folders, saved = _FOLDERS["wan"], None
        missing = [f for f in folders if not os.path.isfile(os.path.join(root, f, "config.json"))]
        if missing:
            raise ValueError(
                f"WanExperts.from_pretrained: a two-expert Wan 2.2 directory holds {folders[0]}/ "
                f"and {folders[1]}/ (each a checkpoint with config.json); {root!r} lacks "
                f"{', '.join(m + '/' for m in missing)} and holds {found}. A single model "
                "loads with WanTransformer3D.from_pretrained."
            )
        if saved is None and index is None:
            config = _read_json(os.path.join(root, folders[0], "config.json")) or {}
            saved = config.get("boundary_ratio", _WAN_BOUNDARIES.get(config.get("model_type")))
        boundary = saved if boundary is None else boundary
        if boundary is None:
            raise ValueError(
                f"WanExperts.from_pretrained: {root!r} does not say where the experts hand "
                "over (no boundary_ratio in model_index.json); pass `boundary=` (Wan 2.2: "
                "0.875 for T2V-A14B, 0.9 for I2V-A14B)."
            )
        high, low = (
            WanTransformer3D.from_pretrained(os.path.join(root, f), dtype=dtype, parallel=parallel,
                                             implementation=implementation, pad_text=pad_text,
                                             mesh=mesh, quantize=quantize)
            for f in folders
        )
        return cls(high, low, boundary)

    def save_pretrained(self, path, *, layout: str = "diffusers",
                        max_shard_bytes: int | None = None) -> None:
        """Writes both experts: `layout="diffusers"` as a pipeline directory
        (`transformer/`, `transformer_2/`, and `model_index.json` with `boundary_ratio`,
        updated in place when the directory already holds a pipeline), `"wan"` as Wan
        2.2's `high_noise_model/` and `low_noise_model/` (their `config.json` also
        carry `boundary_ratio`). `from_pretrained(path)` gives back the same arrays
        and boundary."""
        folders = _FOLDERS
        if layout not in folders:
            raise ValueError(f"`layout` must be 'diffusers' or 'wan'; received {layout!r}.")
        root = os.fspath(path)
        for expert, folder in zip(self.experts, folders[layout]):
            expert.save_pretrained(os.path.join(root, folder), layout=layout,
                                   max_shard_bytes=max_shard_bytes)
        if layout == "diffusers":
            index = _read_json(os.path.join(root, "model_index.json")) or {"_class_name": "WanPipeline"}
            index.update(boundary_ratio=self.boundary,
                         transformer=["diffusers", "WanTransformer3DModel"],
                         transformer_2=["diffusers", "WanTransformer3DModel"])
            _write_json(os.path.join(root, "model_index.json"), index)
        else:
            for folder in folders[layout]:
                config_path = os.path.join(root, folder, "config.json")
                _write_json(config_path, {**_read_json(config_path), "boundary_ratio": self.boundary})


def _real_to_float(value):
    """A real number (NumPy's included) as a Python float; anything else as it is, for
    `__check_init__` to refuse."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value


def _from_hub(path: str, revision, cache_dir) -> str:
    """The local snapshot of a Hub repository holding both experts' folders, in the
    diffusers layout or Wan 2.2's."""
    errors = []
    for folders in _FOLDERS.values():
        try:
            found = [interop.resolve_checkpoint(path, subfolder=f, revision=revision,
                                                cache_dir=cache_dir) for f in folders]
        except ValueError as e:
            errors.append(str(e))
            continue
        return os.path.dirname(found[0])
    raise ValueError(
        "WanExperts.from_pretrained: a two-expert Wan 2.2 checkpoint holds transformer/ and "
        "transformer_2/ (diffusers) or high_noise_model/ and low_noise_model/ (Wan); "
        f"{path!r} gives neither: {errors[0]} / {errors[1]}"
    )


def _cond(pred, true_fn, false_fn):
    """`lax.cond` for functions of nothing (they close over their inputs) returning any
    PyTree: arrays through the conditional, the rest (static fields, configurations)
    checked equal and passed around it."""
    static = []

    def branch(f):
        def run():
            dynamic, rest = eqx.partition(f(), eqx.is_array)
            static.append(rest)
            return dynamic
        return run

    dynamic = lax.cond(pred, branch(true_fn), branch(false_fn))
    first, second = (jax.tree.structure(s) for s in static)
    if first != second:
        raise ValueError(
            "WanExperts.route: both experts' branches must return the same non-array parts; "
            f"their structures differ: {first} and {second}."
        )
    differ = [(a, b) for a, b in zip(jax.tree.leaves(static[0]), jax.tree.leaves(static[1]))
              if a != b]
    if differ:
        raise ValueError(
            "WanExperts.route: both experts' branches must return the same non-array parts; "
            f"the high-noise branch returns {differ[0][0]!r} where the low-noise one returns "
            f"{differ[0][1]!r} ({len(differ)} value(s) differ). Return them as arrays."
        )
    return eqx.combine(dynamic, static[0])


def _read_json(path):
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(path, value) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
