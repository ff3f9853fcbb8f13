"""A pipeline's memory plan: where each component lives, from its bytes and each stage's
working memory (the compiler's memory analysis of the stage's program), so that a whole
run fits the accelerator's memory: resident on the device, kept in host memory and moved
in for its stage, computed on the host CPU, or (the transformer) streamed block by block
from host memory inside the compiled step.

    plan = plan_memory(sizes, working, budget=16 * 2**30, offload="auto")
    plan.placement        # {"text_encoder": "cpu", "transformer": "device", "vae": "host"}
    plan.describe()       # one line

The plan is data (`MemoryPlan`), made before any weight is read (the components loaded
abstractly, `interop.loading(ABSTRACT)`); `Residency` carries it out around each stage.
"""

import contextlib
import dataclasses
import itertools
import os
import re
from collections.abc import Mapping

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from .. import models
from ..models.internal import pack_int8, packable

OFFLOAD = ("auto", "none", "model", "cpu", "blocks")
"""The `offload=` a pipeline takes: `"auto"` (the fastest plan that fits), `"none"`
(everything resident), `"model"` (every component in host memory, moved in for its
stage), `"cpu"` (the encoders computed on the host CPU, the rest resident), `"blocks"`
(the transformer streamed block by block from host memory)."""

PLACES = ("device", "host", "cpu", "streamed")
ENCODERS = ("text_encoder", "image_encoder")
STAGES = {"text": ("text_encoder",), "image": ("image_encoder", "vae"),
          "denoise": ("transformer",), "decode": ("vae",)}
"""The components each stage of the pipeline template computes with."""

# The cost model that orders the plans that fit (seconds a call spends on placement):
# a move into the device at about the host-to-chip bandwidth measured on a TPU v5e
# (6.3-10.3 GB/s), an encoder on the host CPU about 20x slower than its move (UMT5-XXL:
# 18.9 s on the host against about 1.5 s moved in). Streaming is chosen only when
# nothing else fits: its copies are hidden behind a step at video sizes (Wan 14B at 480p
# on a TPU v5e: 0.999x the resident step), not behind a small step's compute.
_BANDWIDTH = 8e9
_CPU_RATE = 0.5e9
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value, name: str = "device_memory") -> int:
    """`value` (the argument `name`) as bytes: an int, or a str of a number and a unit
    (`"8GB"`, `"512 MiB"`; KB, MB, GB, TB in powers of 10, KiB, MiB, GiB, TiB in powers
    of 2)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"`{name}` must be a positive number of bytes; received {value}.")
        return int(value)
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if match and match.group(2).lower() in _UNITS and float(match.group(1)) > 0:
            return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    raise ValueError(
        f"`{name}` must be a positive number of bytes or a size with a unit (KB, MB, GB, "
        f"KiB, MiB, GiB, e.g. '8GB'); received {value!r}.")


def _gib(n: int) -> str:
    """Bytes in the largest binary unit below them (`"2.50 GiB"`, `"90 KiB"`)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class Size:
    """A component's bytes: `total`, of which `blocks` in stacked blocks (what streaming
    keeps in host memory) and `block` one block's (what it holds on the device, twice)."""

    total: int
    blocks: int = 0
    block: int = 0


def _nbytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
               for a in jax.tree.leaves(tree) if hasattr(a, "shape") and hasattr(a, "dtype"))


def _stacked(component) -> list:
    """The stacked blocks of a model (each expert's for experts)."""
    if isinstance(component, models.AbstractExperts):
        return [b for expert in component.experts for b in _stacked(expert)]
    if isinstance(component, models.AbstractModel):
        return [getattr(component, name) for name in component.stacked_layers]
    return []


def streamed_leaves(component) -> list:
    """The arrays a streamed component keeps in host memory: its stacked blocks' weight
    matrices (`(layers, out, in)`). The rest of a block (biases, norms: `(layers, dim)`;
    modulation tables such as `(layers, 1, 6, dim)`: a few KiB a layer) stays on the
    device: one copy a step per matrix, and no small slices of odd layouts from host
    memory (XLA's TPU backend fails on `(1, 6, dim)` slices of a host array)."""
    return [a for b in _stacked(component) for a in jax.tree.leaves(
        b, is_leaf=lambda a: isinstance(a, jax.ShapeDtypeStruct)) if len(getattr(a, "shape", ())) == 3]


def stream_blocks(model, device=None):
    """`model` with its stacked blocks' weight matrices ([`streamed_leaves`][
    vidax_eqx.pipelines.streamed_leaves]) in `device`'s host memory (`pinned_host`;
    default the first device) and its other arrays on `device`: a model larger than the
    accelerator, run as `offload="blocks"` runs it outside a pipeline (under
    `eqx.filter_jit`, `sampling.sample`, ...). Each compiled call copies a block's
    matrices in for its step of the blocks' `lax.scan` (inference: no gradient flows
    into host memory); on a TPU v5e the copies hide behind the step's compute (Wan 14B
    at 480p: 0.999x the resident step).

        with interop.loading(lambda module: jax.devices("cpu")[0]):  # read into host RAM
            model = models.WanTransformer3D.from_pretrained(folder, dtype=jnp.bfloat16)
        model = pipelines.stream_blocks(model)   # 14B: 28 GB, on a 16 GB chip
    """
    if not streamed_leaves(model):
        raise ValueError(f"stream_blocks: a {type(model).__name__} has no stacked blocks to stream.")
    residency = Residency(None, jax.devices()[0] if device is None else device)
    return residency.put_streamed(model)


def size_of(component) -> Size:
    """A component's [`Size`][] from its arrays (or abstract `ShapeDtypeStruct`s)."""
    streamed = streamed_leaves(component)
    stacked = _nbytes(streamed)
    layers = sum(max((a.shape[0] for a in jax.tree.leaves(
        b, is_leaf=lambda a: isinstance(a, jax.ShapeDtypeStruct)) if hasattr(a, "shape")), default=0)
        for b in _stacked(component))
    return Size(_nbytes(component), stacked, stacked // max(layers, 1))


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Where each component of a pipeline lives, and why it fits.

    **Fields:** `offload` (as asked), `budget` (bytes per accelerator, `None`: no
    limit), `sizes` (component -> [`Size`][]), `working` (stage -> the bytes its program
    needs besides the weights), `placement` (component -> `"device"`, `"host"`, `"cpu"`
    or `"streamed"`), `video` (the `(height, width, num_frames)` the working memory was
    measured for; `None` when it was not), `host_budget` (bytes of the machine's memory
    the components kept off the device may take; `None`: not checked).
    """

    offload: str
    budget: int | None
    sizes: Mapping[str, Size]
    working: Mapping[str, int]
    placement: Mapping[str, str]
    video: tuple[int, int, int] | None = None
    host_budget: int | None = None

    def stage_bytes(self, stage: str) -> int:
        """The device bytes while `stage` runs: the resident weights, the stage's moved
        in or streamed ones, and its working memory (none for a stage on the host CPU)."""
        used = [c for c in STAGES[stage] if c in self.placement]
        total = 0
        for name, place in self.placement.items():
            size = self.sizes[name]
            if place == "device":
                total += size.total
            elif place == "streamed":
                total += size.total - size.blocks + (2 * size.block if name in used else 0)
            elif place == "host" and name in used:
                total += size.total
        on_cpu = used and all(self.placement[c] == "cpu" for c in used)
        return total + (0 if on_cpu else self.working.get(stage, 0))

    @property
    def peak(self) -> tuple[str, int]:
        """`(stage, bytes)` of the stage that needs the most device memory."""
        stages = [s for s in STAGES if s in self.working] or list(STAGES)
        return max(((s, self.stage_bytes(s)) for s in stages), key=lambda p: p[1])

    @property
    def host_bytes(self) -> int:
        """The bytes kept in the machine's memory: the components in host memory or on
        the host CPU, and a streamed transformer's blocks."""
        return sum(self.sizes[n].total if p in ("host", "cpu") else self.sizes[n].blocks
                   if p == "streamed" else 0 for n, p in self.placement.items())

    @property
    def fits(self) -> bool:
        device = self.budget is None or self.peak[1] <= self.budget
        return device and (self.host_budget is None or self.host_bytes <= self.host_budget)

    @property
    def cost(self) -> float:
        """Seconds a call spends on placement (the model above), streaming last."""
        seconds = 0.0
        for name, place in self.placement.items():
            uses = sum(name in STAGES[s] for s in self.working) or 1
            if place == "host":
                seconds += uses * self.sizes[name].total / _BANDWIDTH
            elif place == "cpu":
                seconds += self.sizes[name].total / _CPU_RATE
            elif place == "streamed":
                seconds += 1e6 + self.sizes[name].blocks / _BANDWIDTH
        return seconds

    def describe(self) -> str:
        """The plan in one line."""
        budget = "no limit" if self.budget is None else _gib(self.budget)
        parts = ", ".join(f"{name} {place} ({_gib(self.sizes[name].total)})"
                          for name, place in self.placement.items())
        stage, peak = self.peak
        return f"memory plan {self.offload!r}, {budget} per device: {parts}; peak {_gib(peak)} ({stage})"


def _choices(name: str, offload: str, sizes: Mapping[str, Size]) -> tuple[str, ...]:
    encoder, streamable = name in ENCODERS, sizes[name].blocks > 0
    if offload == "none":
        return ("device",)
    if offload == "model":
        return ("host",)
    if offload == "cpu":
        return ("cpu",) if encoder else ("device",)
    if offload == "blocks" and name == "transformer":
        return ("streamed",)
    return ("device", "host") + (("cpu",) if encoder else ()) + (
        ("streamed",) if name == "transformer" and streamable else ())


def plan_memory(sizes: Mapping[str, Size], working: Mapping[str, int], *, budget: int | None,
                offload: str = "auto", owner: str = "pipeline", video=None,
                host_budget: int | None = None) -> MemoryPlan:
    """The placement of every component (`sizes`) that fits `budget` with the stages'
    `working` memory, and whose components kept off the device fit `host_budget`: for
    `offload="auto"` (and the other components of `"blocks"`) the cheapest that fits,
    else the one `offload` names. Raises `ValueError` naming each component's bytes and
    the budgets when none fits."""
    if offload not in OFFLOAD:
        raise ValueError(f"{owner}: `offload` must be one of {OFFLOAD}; received {offload!r}.")
    names = list(sizes)
    if offload == "blocks" and (sizes.get("transformer", Size(0)).blocks == 0):
        raise ValueError(f"{owner}: offload='blocks' streams the transformer's stacked blocks; "
                         "this transformer has none.")
    plans = [MemoryPlan(offload, budget, dict(sizes), dict(working), dict(zip(names, places)), video,
                        host_budget)
             for places in itertools.product(*(_choices(n, offload, sizes) for n in names))]
    fitting = [p for p in plans if p.fits]
    if not fitting:
        parts = ", ".join(f"{n} {_gib(s.total)}" for n, s in sizes.items())
        work = ", ".join(f"{s} {_gib(w)}" for s, w in working.items())
        on_device = [p for p in plans if budget is None or p.peak[1] <= budget]
        if on_device:  # the device could hold a plan; the machine cannot hold the rest
            best = min(on_device, key=lambda p: p.host_bytes)
            raise ValueError(
                f"{owner}: no memory plan with offload={offload!r} fits "
                f"{'any' if budget is None else _gib(budget)} per device and "
                f"{_gib(host_budget)} of host memory: components {parts}; the plans "
                f"that fit the device keep at least {_gib(best.host_bytes)} off it "
                f"({best.describe()}). Free host memory, pass a larger `host_memory`, or "
                "use smaller weights.")
        best = min(plans, key=lambda p: p.peak[1])
        stage, peak = best.peak
        raise ValueError(
            f"{owner}: no memory plan with offload={offload!r} fits {_gib(budget)} per device: "
            f"components {parts}; stages' working memory {work or 'not measured'}; the "
            f"smallest plan needs {_gib(peak)} ({stage}: {best.describe()}).")
    return min(fitting, key=lambda p: (p.cost, sum(v != "device" for v in p.placement.values())))


def device_budget(device_memory, device) -> int | None:
    """The bytes a plan may use on `device`: `device_memory` when given, else the
    capacity JAX reports less 4% for the runtime (`None` on a CPU backend: no limit)."""
    if device_memory is not None:
        return parse_bytes(device_memory)
    if device.platform == "cpu":
        return None
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    return None if limit is None else int(limit * 0.96)


def host_budget(host_memory=None) -> int | None:
    """The bytes of the machine's memory a plan may keep components in (host memory, the
    host CPU, streamed blocks): `host_memory` when given (bytes or a size with a unit),
    else the machine's physical memory (`None` where the system does not say)."""
    if host_memory is not None:
        return parse_bytes(host_memory, "host_memory")
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def program_bytes(fn, *args) -> int:
    """The bytes `fn(*args)`'s compiled program needs besides its arguments' arrays that
    are weights: temporaries, outputs, and the non-weight inputs (`args[1:]`); `args[0]`
    is the component (its arrays abstract or real, nothing is run)."""
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if eqx.is_array(a)
                            or isinstance(a, jax.ShapeDtypeStruct) else a, args,
                            is_leaf=lambda a: isinstance(a, jax.ShapeDtypeStruct))
    is_leaf = lambda a: isinstance(a, jax.ShapeDtypeStruct)  # noqa: E731
    dynamic, static = eqx.partition(abstract, is_leaf, is_leaf=is_leaf)
    compiled = jax.jit(lambda d: fn(*eqx.combine(d, static, is_leaf=is_leaf))).lower(dynamic).compile()
    stats = compiled.memory_analysis()
    inputs = _nbytes(abstract[1:])
    return int(stats.temp_size_in_bytes + stats.output_size_in_bytes + inputs)


class Residency:
    """Carries out a [`MemoryPlan`][] on a pipeline's components around each stage: the
    components kept in host memory are moved to the device for their stage and dropped
    there after it; the results of a stage on the host CPU come to the device."""

    def __init__(self, plan: MemoryPlan | None, device):
        self.plan, self.device = plan, device

    def host_sharding(self):
        """Host memory of the accelerator (`pinned_host`), where it has one: a
        `NamedSharding` over a one-device mesh, the sharding whose memory kind a traced
        program sees (`jax.typeof(x).memory_space`; a `SingleDeviceSharding`'s is not
        seen, and a streamed block would never be copied in)."""
        kinds = {m.kind for m in self.device.addressable_memories()}
        if "pinned_host" in kinds:
            mesh = Mesh(np.array([self.device]), ("device",))
            return NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
        return SingleDeviceSharding(jax.devices("cpu")[0])

    def sharding_of(self, name: str, component):
        """A function from each array of `component` to where the plan keeps it between
        stages: the accelerator, its host memory, or the host CPU (committed there, so
        that the component's programs run there); a streamed component's weight matrices
        in host memory, the rest on the accelerator."""
        place = "device" if self.plan is None else self.plan.placement.get(name, "device")
        device = SingleDeviceSharding(self.device)
        if place == "cpu":
            cpu = SingleDeviceSharding(jax.devices("cpu")[0])
            return lambda _: cpu
        if place == "device":
            return lambda _: device
        if place == "host":
            host = self.host_sharding()
            return lambda _: host
        return self.streamed_sharding_of(component)

    def put_streamed(self, component, *, pack: bool | None = None):
        """`component` placed as streamed ([`streamed_sharding_of`][]). With `pack` (by
        default on a TPU) its int8 matrices are held in host memory as 32-bit words
        (`models.internal.HostWords`: the layout a TPU copies one layer of in without
        re-tiling the whole stack; other backends need no such care)."""
        pack = self.device.platform == "tpu" if pack is None else pack
        return _put(component, self.streamed_sharding_of(component), pack=pack)

    def streamed_sharding_of(self, component):
        """A function from each array of `component` to its place when streamed: its
        blocks' weight matrices in host memory, the rest on the accelerator."""
        host, device = self.host_sharding(), SingleDeviceSharding(self.device)
        blocks = {id(a) for a in streamed_leaves(component)}
        return lambda a: host if id(a) in blocks else device

    def place(self, name: str, component):
        """`component` where the plan keeps it between stages (leaf by leaf: one array
        in flight at a time)."""
        if component is None:
            return None
        if self.plan is not None and self.plan.placement.get(name) == "streamed":
            return self.put_streamed(component)
        return _put(component, self.sharding_of(name, component))

    @contextlib.contextmanager
    def stage(self, pipe, stage: str):
        """Within: `pipe`'s components of `stage` kept in host memory are on the device."""
        moved = {}
        if self.plan is not None:
            for name in STAGES[stage]:
                component = getattr(pipe, name, None)
                if component is not None and self.plan.placement.get(name) == "host":
                    moved[name] = component
                    setattr(pipe, name, _put(component, lambda _: SingleDeviceSharding(self.device)))
        try:
            yield
        finally:
            for name, host in moved.items():
                on_device = getattr(pipe, name)
                setattr(pipe, name, host)
                kept = {id(a) for a in jax.tree.leaves(host)}
                for a in jax.tree.leaves(on_device):
                    if eqx.is_array(a) and id(a) not in kept:
                        a.delete()

    def resident(self, pipe, stages, iterator):
        """`iterator`'s items, with the components of `stages` on the device while it
        runs (from its first item to its end or its closing)."""
        with contextlib.ExitStack() as stack:
            for stage in stages:
                stack.enter_context(self.stage(pipe, stage))
            yield from iterator

    def to_device(self, tree):
        """`tree`'s arrays on the accelerator (a stage on the host CPU hands its results
        over)."""
        if self.plan is None or "cpu" not in self.plan.placement.values():
            return tree
        device = SingleDeviceSharding(self.device)
        return jax.tree.map(lambda a: jax.device_put(a, device) if isinstance(a, jax.Array) else a, tree)


def _put(component, sharding_of, *, pack: bool = False):
    """`component` with each array moved by `sharding_of(array)`, one at a time (the
    source freed as it goes when nothing else holds it); with `pack`, an int8 matrix
    bound for pinned host memory held there as 32-bit words (`models.internal.HostWords`)."""
    def move(a):
        if not isinstance(a, jax.Array):
            return a
        target = sharding_of(a)
        if pack and getattr(target, "memory_kind", None) == "pinned_host" and packable(a):
            return jax.block_until_ready(pack_int8(a, target))
        return jax.block_until_ready(jax.device_put(a, target))

    return jax.tree.map(move, component)
