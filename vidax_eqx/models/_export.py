"""A function of a model exported with `jax.export`, the model an argument: its arrays
go in flat, its configuration is closed over and recorded as a signature that every call
checks, and any module type (LoRA wrappers, experts, stacked blocks) serializes, because
`jax.export` only ever sees flat arrays. The signature and the byte layout are shared
with `sampling.export_sample`."""

import dataclasses
import hashlib
import json
import re

import equinox as eqx
import jax


_FORMAT = "vidax_eqx.models.ExportedModel/1"
# Custom-call targets that this library's kernels emit and that JAX gives no
# compatibility guarantee: the Pallas GPU (Triton) kernel, and cuDNN's fused attention
# (traced on a GPU host only). `export` disables the check for those of them that the
# lowered module calls, by name; any other target still fails JAX's check.
_KERNEL_TARGETS = re.compile(r"__gpu\$xla\.gpu\.triton|__cudnn\$fmha\w*")
_CUSTOM_CALL = re.compile(r"custom_call @([\w$.\-]+)\(")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_SHOWN = 3  # differences named in a mismatch error


def _is_dynamic(x) -> bool:
    """An input of the exported program: an array, or the shape of one."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _partition(tree):
    return eqx.partition(tree, _is_dynamic)


def _plain(tree) -> bool:
    """Arrays in tuples, lists and dicts (what `jax.export` serializes as it is)."""
    if tree is None or _is_dynamic(tree):
        return True
    if type(tree) in (tuple, list):
        return all(map(_plain, tree))
    return type(tree) is dict and all(map(_plain, tree.values()))


def _describe(value) -> str:
    """A process-independent description of a non-array value (no memory addresses)."""
    if callable(value) and hasattr(value, "__qualname__") and not isinstance(value, type):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return _ADDRESS.sub("", repr(value))


def _entries(tree, path: str):
    """`(path, description)` of everything that fixes the program traced for `tree`:
    each array's dtype and shape, each node's type, each static field and non-array
    leaf (configuration, `ParallelConfig`, activations)."""
    if _is_dynamic(tree):
        yield path, f"{tree.dtype}{list(tree.shape)}"
        return
    if isinstance(tree, eqx.Module):
        yield path, type(tree).__qualname__
        for field in dataclasses.fields(tree):
            value = getattr(tree, field.name, None)
            if field.metadata.get("static", False):
                yield from _static(value, f"{path}.{field.name}")
            else:
                yield from _entries(value, f"{path}.{field.name}")
        return
    children = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]
    if len(children) == 1 and children[0][0] == () and children[0][1] is tree:
        yield path, _describe(tree)  # a leaf
        return
    yield path, type(tree).__qualname__
    for key, child in children:
        yield from _entries(child, path + jax.tree_util.keystr(key))


def _static(value, path: str):
    """A static field: a configuration dataclass field by field, anything else whole."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        yield path, type(value).__qualname__
        for field in dataclasses.fields(value):
            yield from _static(getattr(value, field.name, None), f"{path}.{field.name}")
    else:
        yield path, _describe(value)


def _structure(tree) -> str:
    """A digest of the pytree structure (what unflattening relies on), addresses removed."""
    text = _ADDRESS.sub("", str(jax.tree.structure(_partition(tree)[0])))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def signature(name: str, tree) -> list:
    """What a program traced for `tree` depends on beyond what `jax.export` checks, as
    JSON: `[path, description]` pairs (paths start at `name`), and a digest of the
    pytree structure. Equal signatures: the same flat arrays, in the same order, for
    the same configuration."""
    return [[p, d] for p, d in _entries(tree, name)] + [[name + " <structure>", _structure(tree)]]


def differences(exported: list, received: list) -> list[str]:
    """What differs between two signatures, by path, outermost first (a model's config
    before the fields of its layers that follow from it)."""
    got = dict(map(tuple, received))
    want = dict(map(tuple, exported))
    out = []
    for path, desc in exported:
        if path not in got:
            out.append(f"{path}: exported {desc}, absent from the call")
        elif got[path] != desc:
            out.append(f"{path}: exported {desc}, received {got[path]}")
    out += [f"{path}: received {desc}, absent from the export" for path, desc in received
            if path not in want]
    # The structure digest last: it only says something when nothing else does.
    return sorted(out, key=lambda d: (" <structure>:" in d,
                                      len(re.findall(r"[.\[]", d.split(":")[0]))))


def mismatch(exported: list, received: list) -> str:
    """The first differences between two signatures, for an error message."""
    diffs = differences(exported, received)
    more = f" (and {len(diffs) - _SHOWN} more)" if len(diffs) > _SHOWN else ""
    return "; ".join(diffs[:_SHOWN]) + more


def pack(fmt: str, settings: dict, exported: jax.export.Exported) -> bytes:
    """An 8-byte header length, the JSON header (`fmt` and `settings`), then
    `jax.export`'s serialization."""
    header = json.dumps({"format": fmt, **settings}).encode()
    return len(header).to_bytes(8, "little") + header + bytes(exported.serialize())


def unpack(owner: str, what: str, fmt: str, data: bytes) -> tuple[dict, jax.export.Exported]:
    """`(settings, exported)` from [`pack`][]'s bytes; a `ValueError` naming `what` they
    should have been if they are not."""
    data = bytes(data)
    n = int.from_bytes(data[:8], "little")
    try:
        settings = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        settings = None
    if not isinstance(settings, dict) or settings.pop("format", None) != fmt:
        raise ValueError(
            f"{owner}: `data` is not {what} (format {fmt!r}); received {len(data)} bytes "
            f"starting {data[:16]!r}.")
    return settings, jax.export.deserialize(bytearray(data[8 + n:]))


class ExportedModel:
    """A function of a model exported with `jax.export` by [`export`][]: serializable
    to bytes, reloaded in another process, and called with a model of the same
    structure and configuration (the weights are an argument, not part of it).

    **Attributes:**

    - `exported`: the `jax.export.Exported` program over the flat arrays of the
        arguments (its `platforms`, `in_avals`, `mlir_module()`).
    - `settings`: the JSON-able rest: a signature of every argument (each array's
        dtype and shape, each module's static configuration) and how to rebuild the
        output.
    """

    def __init__(self, exported: jax.export.Exported, settings: dict):
        """Made by [`export`][] and [`deserialize`][ExportedModel.deserialize]."""
        self.exported = exported
        self.settings = settings

    @property
    def platforms(self) -> tuple[str, ...]:
        """The platforms the program was lowered for (`("cpu", "tpu", "cuda")`)."""
        return tuple(self.exported.platforms)

    def serialize(self) -> bytes:
        """The program and its settings as bytes: an 8-byte length, a JSON header, then
        `jax.export`'s serialization. Holds no weights."""
        return pack(_FORMAT, self.settings, self.exported)

    @classmethod
    def deserialize(cls, data: bytes) -> "ExportedModel":
        """The exported function that [`serialize`][ExportedModel.serialize] wrote.

        **Arguments:**

        - `data`: the bytes.

        **Returns:**

        An [`ExportedModel`][].
        """
        settings, exported = unpack(
            "ExportedModel.deserialize",
            "an exported model function (ExportedModel.serialize's bytes)", _FORMAT, data)
        return cls(exported, settings)

    def __call__(self, model, *args, **kwargs):
        """Runs the exported program: `fn(model, *args, **kwargs)` as it was exported.

        **Arguments:**

        The model and the arguments, of the exported structure: arrays of the exported
        shapes and dtypes (and shardings), the same static configuration and non-array
        arguments. On a host whose platform is one of `platforms`.

        **Returns:**

        What `fn` returned: arrays, and models or optimizer states of the structure of
        the argument they were exported like.
        """
        inputs = (model, args, kwargs)
        received = _arguments(model, args, kwargs)
        if received != self.settings["signature"]:
            raise ValueError(
                "ExportedModel: the arguments must have the exported structure, shapes, "
                "dtypes and configuration; " + mismatch(self.settings["signature"], received)
                + ". Export the function again for these arguments.")
        dynamic, _ = _partition(inputs)
        results = self.exported.call(*jax.tree.leaves(dynamic))
        return _rebuild(self.settings["output"], results, inputs)


def _arguments(model, args, kwargs) -> list:
    """The signature of `fn`'s arguments."""
    return signature("model", model) + [
        e for i, a in enumerate(args) for e in signature(f"args[{i}]", a)
    ] + signature("kwargs", kwargs)


def _like(inputs):
    """The arguments an output may have the structure of: the model, then each of
    `args`, then each keyword argument, with a JSON-able address."""
    model, args, kwargs = inputs
    yield ["model"], model
    for i, a in enumerate(args):
        yield ["args", i], a
    for k, a in kwargs.items():
        yield ["kwargs", k], a


def _find(inputs, address):
    model, args, kwargs = inputs
    if address[0] == "model":
        return model
    return args[address[1]] if address[0] == "args" else kwargs[address[1]]


def _encode_output(out, inputs):
    """The output as the program returns it (flat arrays for anything of an input's
    structure, plain containers of arrays as they are) and how to rebuild it."""
    sequence = type(out) in (tuple, list)
    elements = list(out) if sequence else [out]
    plan, returned = [], []
    for k, element in enumerate(elements):
        dynamic, static = _partition(element)
        empty = not jax.tree.leaves(static)
        tree = jax.tree.structure(dynamic)
        if empty and _plain(dynamic):
            plan.append({"like": None})
            returned.append(dynamic)
            continue
        for address, arg in _like(inputs):
            arg_dynamic, arg_static = _partition(arg)
            if jax.tree.structure(arg_dynamic) != tree:
                continue
            if empty or eqx.tree_equal(static, arg_static) is True:
                plan.append({"like": address, "static": not empty})
                returned.append(tuple(jax.tree.leaves(dynamic)))
                break
        else:
            if not empty:
                raise ValueError(
                    f"export: output {k} of `fn` holds non-array values "
                    f"({_describe(jax.tree.leaves(static)[0])}, ...) and does not have the "
                    "structure of an argument; return arrays (in tuples, lists, dicts), "
                    "or models and optimizer states of the structure of an argument.")
            plan.append({"like": None})
            returned.append(dynamic)
    return {"sequence": type(out).__name__ if sequence else None, "elements": plan}, \
        tuple(returned)


def _rebuild(output: dict, results, inputs):
    elements = []
    for plan, result in zip(output["elements"], results):
        if plan["like"] is None:
            elements.append(result)
            continue
        arg_dynamic, arg_static = _partition(_find(inputs, plan["like"]))
        dynamic = jax.tree.unflatten(jax.tree.structure(arg_dynamic), list(result))
        elements.append(eqx.combine(dynamic, arg_static) if plan["static"] else dynamic)
    if output["sequence"] is None:
        return elements[0]
    return tuple(elements) if output["sequence"] == "tuple" else elements


def export(fn, model, *args, platforms=None, **kwargs) -> ExportedModel:
    """`fn(model, *args, **kwargs)` exported with `jax.export`, the model an argument:
    a forward pass, a training step, anything of a model.

        exported = models.export(lambda m, x, t, c: m(x, t, c), model, x, t, context)
        blob = exported.serialize()                         # bytes: no weights
        again = models.ExportedModel.deserialize(blob)      # in another process
        out = again(model, x, t, context)                   # == model(x, t, context)

    The arrays of the arguments (the model's parameters, the inputs, an optimizer
    state) become the program's flat inputs; everything else (the model's structure,
    its config, `ParallelConfig`, activations, Python numbers) is closed over, so
    `jax.export` serializes no module types, and is recorded as a signature that
    every call checks: a model of another structure or configuration is refused
    with an error naming what differs. An output of the structure of an argument (the
    updated model and optimizer state of a training step, gradients) comes back as
    that structure; other outputs must be arrays in tuples, lists or dicts.

    The rotary tables are computed in the program (nothing in the serialized module
    grows with the token count but shape text). Exporting for several platforms
    (`platforms=("cpu", "tpu", "cuda")`) from any host lowers the attention for each
    (Pallas TPU, Pallas GPU): the Triton kernel's custom call, which JAX does not
    guarantee stable, has its check disabled by name, exactly for the targets the
    lowered module calls (`exported.exported.disabled_safety_checks`).

    **Arguments:**

    - `fn`: a function of the model and the other arguments; traced once.
    - `model`: an Equinox module (any model or layer of this library); its arrays may
        be `jax.ShapeDtypeStruct`s (`eqx.filter_eval_shape`): exporting needs shapes,
        not weights.
    - `*args`, `**kwargs`: the other arguments: arrays (or `jax.ShapeDtypeStruct`s) fix
        the program's input shapes; non-array values (numbers, strings, options) are
        baked in: pass a number as an array to vary it between calls.
    - `platforms`: the platforms to lower for (`"cpu"`, `"tpu"`, `"cuda"`, `"rocm"`);
        default the default backend's.

    **Returns:**

    An [`ExportedModel`][].
    """
    if not isinstance(model, eqx.Module):
        raise ValueError(
            "export: `model` must be an Equinox module (a vidax_eqx model or layer); "
            f"received {type(model).__name__}.")
    if isinstance(platforms, str):
        platforms = (platforms,)
    inputs = (model, args, kwargs)
    dynamic, static = _partition(inputs)
    leaves, treedef = jax.tree.flatten(dynamic)
    output = {}

    def run(*leaves):  # flat arrays in and out: jax.export serializes no module types
        inputs = eqx.combine(jax.tree.unflatten(treedef, leaves), static)
        m, a, kw = inputs
        plan, returned = _encode_output(fn(m, *a, **kw), inputs)
        output.update(plan)
        return returned

    # Arrays and ShapeDtypeStructs as they are: their shardings (committed or not) are
    # what `jax.jit` would see; nothing is computed.
    jitted = jax.jit(run)
    text = jitted.trace(*leaves).lower(lowering_platforms=platforms).as_text()
    targets = sorted({t for t in _CUSTOM_CALL.findall(text) if _KERNEL_TARGETS.fullmatch(t)})
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]
    exported = jax.export.export(jitted, platforms=platforms, disabled_checks=checks)(*leaves)
    result = ExportedModel(exported, {"signature": _arguments(model, args, kwargs),
                                      "output": output})
    try:
        exported.serialize()
    except ValueError as e:
        raise ValueError(
            "export: an output of `fn` has a pytree type that jax.export cannot serialize "
            f"({e}); return arrays in tuples, lists or dicts, or models and optimizer "
            "states of the structure of an argument.") from None
    return result
