"""`sample` exported with `jax.export`: the denoising loop traced and lowered once,
serialized, and reloaded by a server that runs it without tracing the model again."""

import dataclasses

import equinox as eqx
import jax

from .._deprecation import warn_deprecated
from ..models.internal import mismatch, pack, signature, unpack
from . import _cogvideox, _flow_match, _step_cache
from ._loop import denoising_loop
from ._options import Caching, Compilation, Guidance, Placement
from ._sample import old_return_reused, options_from_old_keywords, prepare

_FORMAT = "vidax_eqx.sampling.ExportedSampler/2"
# The loop's `LoopInputs`, slot by slot, as a signature names them (the names of format
# 2: its sixth, `dynamic_cfg`, is called "model_kwargs" there).
_ARGS = ("model", "noise", "context", "negative_context", "guidance_scales",
         "model_kwargs", "plan", "key", "batched", "reuse", "count", "condition", "forcing")
_CLASSES = {cls.__name__: cls for cls in (
    _flow_match.FlowMatchEuler, _flow_match.UniPC, _cogvideox.CogVideoXDDIM,
    _cogvideox.CogVideoXDPM, _step_cache.StaticStepCache, _step_cache.FirstBlockCache,
    _step_cache.MagCache)}


def _encode(obj):
    """A scheduler or step-cache rule as JSON: its class and its fields."""
    if obj is None:
        return None
    if type(obj).__name__ not in _CLASSES:
        raise ValueError(f"export_sample: cannot export a {type(obj).__name__} (only the "
                         f"schedulers and step-cache rules of vidax_eqx.sampling).")
    fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return {"class": type(obj).__name__,
            "fields": {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}}


def _decode(spec):
    if spec is None:
        return None
    cls = _CLASSES[spec["class"]]
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["fields"].items()}
    return cls(**fields)


def _signature(inputs, options) -> list:
    """What the loop was traced for beyond the shapes `jax.export` checks: the model's
    structure, its static configuration and non-array leaves (`ParallelConfig`,
    activations), the inputs' structure and the non-array model arguments, by path
    (`models.export`'s signature)."""
    return [e for name, a in zip(_ARGS, inputs, strict=True) for e in signature(name, a)] + \
        signature("model_kwargs", options.model_static)


class ExportedSampler:
    """A [`sample`][] call exported with `jax.export` ([`export_sample`][]): the
    denoising loop for one model configuration, input shapes, scheduler, guidance mode
    and mesh, serializable to bytes. Reloaded ([`deserialize`][ExportedSampler.deserialize])
    and called, it runs the loop without tracing the model again (XLA still compiles
    the program once per process, unless JAX's persistent compilation cache holds it:
    `jax.config.update("jax_compilation_cache_dir", path)`).

    The weights are not in it: the call takes the model (e.g. loaded from its
    checkpoint), whose arrays must have the exported shapes, dtypes and shardings, and
    whose configuration (config, `ParallelConfig`, activations) must be the exported
    one, which is checked. With a `max_steps` export it runs any number of steps up to
    it; without one, exactly the exported number.
    """

    def __init__(self, exported: jax.export.Exported, settings: dict):
        """Made by [`export_sample`][] and [`deserialize`][ExportedSampler.deserialize]:
        `exported`, the `jax.export.Exported` loop over the flat arrays of its inputs;
        `settings`, everything else the call needs (JSON: the scheduler, guidance
        mode, mesh shape, step-cache rule, steps, and a signature of the model's
        configuration)."""
        self.exported = exported
        self.settings = settings

    @property
    def max_steps(self) -> int:
        """The most steps a call may run (the exported `steps` without `max_steps`)."""
        return self.settings["max_steps"] or self.settings["steps"]

    def serialize(self) -> bytes:
        """The exported program and its settings as bytes (a JSON header, then
        `jax.export`'s serialization)."""
        return pack(_FORMAT, self.settings, self.exported)

    @classmethod
    def deserialize(cls, data: bytes) -> "ExportedSampler":
        """The sampler that [`serialize`][ExportedSampler.serialize] wrote."""
        settings, exported = unpack(
            "ExportedSampler.deserialize",
            "an exported sampler (ExportedSampler.serialize's bytes)", _FORMAT, data)
        return cls(exported, settings)

    def __call__(self, model, noise, context, *, negative_context=None,
                 guidance: Guidance | None = None, steps=None, key=None, condition=None,
                 **model_kwargs):
        """Runs the exported loop: the arguments of [`sample`][] that vary between
        requests (the model's weights, the noise, the text embeddings, the guidance
        scales, the number of steps up to `max_steps`, the key, per-example model
        arrays); the others are the exported ones.

        **Arguments:**

        - `guidance`: a [`Guidance`][] on the exported side of 1 (with or without
            guidance) and with the exported `dynamic`; `None`: the exported one.
            (`guidance_scale=` / `guidance_scale_2=`: deprecated spellings of its
            `scale` / `scale_2`.)
        - the others as for [`sample`][]; `steps` defaults to the exported number.

        **Returns:**

        The final latents (and `reused`, with the deprecated `return_reused=True` of
        the export).
        """
        s = self.settings
        steps = s["steps"] if steps is None else steps
        if s["max_steps"] is None and steps != s["steps"]:
            raise ValueError(
                f"ExportedSampler: `steps` must be the exported {s['steps']} (it was exported "
                f"without max_steps); received {steps!r}. Export with "
                "compilation=Compilation(max_steps=N) to serve any number of steps up to N.")
        exported = Guidance(scale=s["guidance_scale"], dynamic=s["use_dynamic_cfg"])
        old = {k: model_kwargs.pop(k) for k in ("guidance_scale", "guidance_scale_2")
               if k in model_kwargs}
        if old:
            if guidance is not None:
                raise TypeError("ExportedSampler() got `guidance=` and the deprecated "
                                f"keywords {sorted(old)}: pass `guidance` only.")
            for name, field in (("guidance_scale", "scale"), ("guidance_scale_2", "scale_2")):
                if name in old:
                    warn_deprecated(f"ExportedSampler({name}=...)",
                                    f"`guidance=sampling.Guidance({field}=...)`", stacklevel=2)
            guidance = Guidance(scale=exported.scale if old.get("guidance_scale") is None
                                else old["guidance_scale"],
                                scale_2=old.get("guidance_scale_2"), dynamic=exported.dynamic)
        guidance = exported if guidance is None else guidance
        if not isinstance(guidance, Guidance):
            raise ValueError(f"ExportedSampler: `guidance` must be a sampling.Guidance or None; "
                             f"received a {type(guidance).__name__}.")
        if guidance.guided != s["guided"] or guidance.dynamic != s["use_dynamic_cfg"]:
            raise ValueError(
                f"ExportedSampler: the sampler was exported {'with' if s['guided'] else 'without'}"
                f" classifier-free guidance (scale > 1: {s['guided']}) and dynamic="
                f"{s['use_dynamic_cfg']}; received {guidance}.")
        inputs, options = self._prepare(
            model, noise, context, negative_context=negative_context, guidance=guidance,
            steps=steps, key=key, condition=condition, model_kwargs=model_kwargs)
        received = _signature(inputs, options)
        if received != s["signature"]:
            raise ValueError(
                "ExportedSampler: the model (its structure, config or ParallelConfig), the "
                "inputs' structure or the non-array model arguments (remat, attention) "
                "differ from those the sampler was exported for: "
                f"{mismatch(s['signature'], received)}; export it again for them.")
        dynamic = eqx.filter(inputs, eqx.is_array)
        if s["mesh"] is not None:
            _check_mesh(s["mesh"], inputs.model)
        return self.exported.call(*jax.tree.leaves(dynamic))

    def _prepare(self, model, noise, context, **kwargs):
        s = self.settings
        placement = Placement(mesh=_mesh_of(model) if s["mesh"] else None,
                              batch_axis=_axes(s["batch_axis"]), cfg_axis=s["cfg_axis"])
        return prepare(
            "ExportedSampler", model, noise, context, scheduler=_decode(s["scheduler"]),
            placement=placement,
            caching=Caching(text=s["text_cache"], step=_decode(s["step_cache"])),
            compilation=Compilation(max_steps=s["max_steps"]), **kwargs)


def _axes(batch_axis):
    return tuple(batch_axis) if isinstance(batch_axis, list) else batch_axis


def _mesh_of(model):
    """The mesh the model's arrays are placed on (`nn.sharding.shard_module`), or `None`."""
    for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    return None


def _check_mesh(expected: dict, model) -> None:
    mesh = _mesh_of(model)
    got = None if mesh is None else dict(mesh.shape)
    if got != expected:
        raise ValueError(
            f"ExportedSampler: the model must be placed on a mesh of the exported shape "
            f"{expected} (nn.sharding.shard_module(model, mesh)); received a model on {got}.")


def export_sample(model, noise, context, *, negative_context=None, steps: int = 50,
                  scheduler=None, guidance: Guidance = Guidance(),
                  placement: Placement = Placement(), caching: Caching = Caching(),
                  compilation: Compilation = Compilation(), condition=None, key=None,
                  **model_kwargs) -> ExportedSampler:
    """[`sample`][]'s denoising loop exported with `jax.export`, for a server that
    reloads it instead of tracing and lowering the model at start-up:

        exported = sampling.export_sample(model, noise, context, negative_context=neg,
                                          steps=50, compilation=Compilation(max_steps=100))
        blob = exported.serialize()                            # bytes, to a file
        sampler = sampling.ExportedSampler.deserialize(blob)   # in the server
        latents = sampler(model, noise, context, negative_context=neg, steps=30,
                          guidance=Guidance(scale=6.0))

    **Arguments:**

    As for [`sample`][] (without `progress`: a host callback cannot be exported). The
    inputs fix the exported shapes and dtypes (their values are not kept); `steps`,
    `guidance` and `key` are defaults of the calls, which may change them (the number of
    steps up to `compilation.max_steps`; the guidance scale on the same side of 1). With
    `placement.mesh`, the model must be placed on it
    ([`vidax_eqx.nn.sharding.shard_module`][]) and the call's model on a mesh of the
    same shape. The deprecated keywords of [`sample`][] are accepted as there; with
    `return_reused=True` the exported program returns `(latents, reused)`.

    **Returns:**

    An [`ExportedSampler`][].
    """
    groups = options_from_old_keywords("export_sample", dict(
        guidance=guidance, placement=placement, caching=caching, compilation=compilation),
        model_kwargs)
    return_reused = old_return_reused("export_sample", model_kwargs)
    inputs, options = prepare(
        "export_sample", model, noise, context, negative_context=negative_context,
        steps=steps, scheduler=scheduler, condition=condition, key=key,
        model_kwargs=model_kwargs, **groups)
    if return_reused and inputs.reuse is None:
        raise ValueError("export_sample: `return_reused` reports which steps reused the step "
                         "cache; it needs `caching=Caching(step=...)`, which is None.")
    dynamic, static = eqx.partition(inputs, eqx.is_array)

    leaves, treedef = jax.tree.flatten(dynamic)

    def run(*leaves):  # flat arrays in: jax.export serializes no module types
        result = denoising_loop(eqx.combine(jax.tree.unflatten(treedef, leaves), static), options)
        return (result.latents, result.reused) if return_reused else result.latents

    exported = jax.export.export(jax.jit(run))(*leaves)
    guidance, placement, caching = groups["guidance"], groups["placement"], groups["caching"]
    mesh, batch_axis = placement.mesh, placement.batch_axis
    settings = dict(
        steps=steps, max_steps=groups["compilation"].max_steps,
        guidance_scale=float(guidance.scale), guided=guidance.guided,
        scheduler=_encode(options.scheduler),
        mesh=None if mesh is None else {k: int(v) for k, v in mesh.shape.items()},
        batch_axis=list(batch_axis) if isinstance(batch_axis, tuple) else batch_axis,
        cfg_axis=placement.cfg_axis, use_dynamic_cfg=guidance.dynamic, text_cache=caching.text,
        step_cache=_encode(caching.step), return_reused=return_reused,
        signature=_signature(inputs, options),
    )
    return ExportedSampler(exported, settings)
