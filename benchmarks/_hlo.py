"""Reading XLA's HLO text (`jax.jit(f).lower(...).compile().as_text()`): what the
benchmarks count in a compiled program.

- [`parse`][]: the computations of a module, each a list of [`Instruction`][]s, and
  the name of its ENTRY computation. One header regex, [`HEADER`][], for every
  form a computation header takes (below).
- [`dot_flops`][]: 2 x (result elements) x (contracted size) of every `dot`.
- [`collective_bytes`][]: the bytes each device communicates, by kind of collective.
- [`f32_weight_copies`][]: bytes of ENTRY-level f32 copies of bf16 parameters.
- [`collective_dtypes`][]: the element types of the collectives (StableHLO or HLO).

The counts walk the call graph from ENTRY: an instruction in a `while` body counts
`known_trip_count` times (XLA's annotation in the while's `backend_config`; a loop
without one counts once and is reported in `unknown_trip_counts`), nested loops
multiply, a `conditional` counts its costliest branch, and fusions and other called
computations (`calls=`, `to_apply=`) are followed.

Computation headers: `[ENTRY] [%]NAME (PARAMS) -> RESULT [, attributes] {` (what
`as_text()` prints), the same without `-> RESULT`, and a bare `[ENTRY] [%]NAME {`
(HLO printed without program shapes).
"""

import math
import re
from collections.abc import Callable
from typing import NamedTuple


BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
    "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(BYTES) + r")\[([\d,]*)\]")
# A computation's first line: an optional ENTRY, its name, optionally its parameters
# in parentheses and anything after them (`-> RESULT`, attributes), then `{`.
HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"([\w\-]+)\(")


class Instruction(NamedTuple):
    """One HLO instruction: `[ROOT] %name = TYPE opcode(operands), attributes`."""

    name: str
    type: str  # its result type: `f32[8,16]{1,0}`, or a parenthesized tuple
    opcode: str  # "" when the text after the type does not start with `opcode(`
    rest: str  # the text from the opcode on: operands, attributes, metadata


class Module(NamedTuple):
    computations: dict[str, list[Instruction]]
    entry: str | None


def _split_type(rest: str) -> tuple[str, str]:
    """`TYPE opcode(...)...` -> (TYPE, the text from the opcode on); TYPE may be a
    parenthesized tuple."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        return rest[: i + 1], rest[i + 1 :].lstrip()
    type_, _, tail = rest.partition(" ")
    return type_, tail.lstrip()


def instruction(line: str) -> Instruction | None:
    """The instruction on one line of HLO text, or None if the line holds none."""
    m = _INSTR.match(line)
    if not m:
        return None
    type_, rest = _split_type(line[m.end() :])
    op = _OPCODE.match(rest)
    return Instruction(m.group(1), type_, op.group(1) if op else "", rest)


def parse(hlo: str) -> Module:
    """The computations of the HLO text `hlo` and its ENTRY computation's name."""
    comps: dict[str, list[Instruction]] = {}
    entry = current = None
    for line in hlo.splitlines():
        if current is None:
            m = HEADER.match(line)
            if m:
                current = m.group(1)
                comps[current] = []
                if line.startswith("ENTRY"):
                    entry = current
        elif line.strip() == "}":
            current = None
        else:
            instr = instruction(line)
            if instr is not None:
                comps[current].append(instr)
    return Module(comps, entry)


def _module(hlo: "str | Module") -> Module:
    return hlo if isinstance(hlo, Module) else parse(hlo)


def shape(type_: str) -> tuple[str, list[int]] | None:
    """(element type, dims) of the first array in `type_`, or None."""
    m = _ARRAY.search(re.sub(r"/\*.*?\*/", "", type_))
    if not m:
        return None
    return m.group(1), [int(x) for x in m.group(2).split(",") if x]


def array_bytes(type_: str) -> int:
    """Bytes of every array in `type_` (a tuple's elements summed)."""
    total = 0
    for dtype, dims in _ARRAY.findall(re.sub(r"/\*.*?\*/", "", type_)):
        total += BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def operands(instr: Instruction) -> list[str]:
    """The names of an instruction's operands."""
    m = re.match(r"[\w\-]+\((.*?)\)(?:,|$)", instr.rest)
    if not m:
        return []
    return [o.strip().split()[-1].lstrip("%") for o in m.group(1).split(",") if o.strip()]


# --------------------------------------------------------------------------- #
# Walking the call graph
# --------------------------------------------------------------------------- #

Counts = dict[str, float]


class Totals(NamedTuple):
    counts: Counts  # per run of the ENTRY computation
    unknown_trip_counts: int  # loops with something counted but no known_trip_count


def _add(into: Counts, sub: Counts, times: float) -> None:
    for k, v in sub.items():
        into[k] = into.get(k, 0) + times * v


def walk(
    hlo: "str | Module",
    count: Callable[[Instruction, dict[str, Instruction]], Counts],
    weigh: Callable[[Counts], float] = lambda c: sum(c.values()),
) -> Totals:
    """Sums `count(instruction, the instructions of its computation by name)` over one
    run of the ENTRY computation (module docstring: loops times their trip counts, a
    conditional's costliest branch by `weigh`, called computations followed)."""
    module = _module(hlo)
    memo: dict[str, Counts] = {}
    unknown = 0

    def visit(name: str) -> Counts:
        nonlocal unknown
        if name in memo:
            return memo[name]
        memo[name] = {}  # recursion guard
        instrs = module.computations.get(name, [])
        by_name = {i.name: i for i in instrs}
        total: Counts = {}
        for instr in instrs:
            _add(total, count(instr, by_name), 1)
            if instr.opcode == "while":
                body = re.search(r"\bbody=%?([\w.\-]+)", instr.rest).group(1)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.rest)
                sub = visit(body)
                if trips is None and any(sub.values()):
                    unknown += 1
                _add(total, sub, int(trips.group(1)) if trips else 1)
            elif instr.opcode == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", instr.rest)
                names = (
                    [b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches
                    else re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", instr.rest)
                )
                subs = [visit(b) for b in names]
                if subs:
                    _add(total, max(subs, key=weigh), 1)
            else:
                for callee in re.findall(r"\b(?:calls|to_apply)=%?([\w.\-]+)", instr.rest):
                    _add(total, visit(callee), 1)
        memo[name] = total
        return total

    counts = visit(module.entry) if module.entry is not None else {}
    return Totals(counts, unknown)


# --------------------------------------------------------------------------- #
# What the benchmarks count
# --------------------------------------------------------------------------- #


def dot_flops(hlo: "str | Module") -> dict:
    """Dot FLOPs of one run of the optimized HLO `hlo`: 2 x (result elements) x
    (contracted size) of every `dot` (elementwise work not included).

    Returns `{"flops": float, "unknown_trip_counts": int}`.
    """

    def count(instr: Instruction, by_name: dict[str, Instruction]) -> Counts:
        if instr.opcode != "dot":
            return {}
        out = shape(instr.type)
        ops = operands(instr)
        lhs = shape(by_name[ops[0]].type) if ops and ops[0] in by_name else None
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.rest)
        if not (out and lhs and contracting):
            return {}
        k = math.prod(lhs[1][int(i)] for i in contracting.group(1).split(",") if i)
        return {"flops": 2.0 * math.prod(out[1]) * k}

    totals = walk(hlo, count)
    return {"flops": totals.counts.get("flops", 0.0), "unknown_trip_counts": totals.unknown_trip_counts}


COLLECTIVE_KINDS = ("collective-permute", "all-to-all", "all-gather", "all-reduce", "reduce-scatter")
_COUNTED = {  # opcode -> kind; the -done of an async pair carries the result
    "collective-permute": "collective-permute",
    "collective-permute-done": "collective-permute",
    "all-to-all": "all-to-all",
    "all-gather": "all-gather",
    "all-gather-done": "all-gather",
    "all-reduce": "all-reduce",
    "all-reduce-done": "all-reduce",
    "reduce-scatter": "reduce-scatter",
}


def _group_size(rest: str, default: int) -> int:
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", rest)  # iota form [groups, size]
    if m:
        return int(m.group(1).split(",")[-1])
    return default


def _per_device_bytes(kind: str, size: int, g: int) -> float:
    if kind == "collective-permute":
        return size
    if kind == "all-to-all":
        return size * (g - 1) / g
    if kind == "all-gather":  # the result is g operands; (g - 1) of them arrive
        return size * (g - 1) / g
    if kind == "all-reduce":  # a ring all-reduce
        return 2 * size * (g - 1) / g
    if kind == "reduce-scatter":  # the operand is g results; (g - 1) of them leave
        return size * (g - 1)
    raise ValueError(kind)


def collective_bytes(hlo: "str | Module", n_devices: int) -> dict:
    """Bytes each device communicates (received = sent) in one run of the compiled
    program `hlo`: a `collective-permute` moves its result (one hop), an `all-to-all`
    over a group of g devices (g-1)/g of it, an `all-gather` receives (g-1)/g of its
    result, an `all-reduce` 2 (g-1)/g of it, a `reduce-scatter` (g-1) results. Groups
    from `replica_groups`, else `n_devices`.

    Returns `{"total": float, "by_kind": {kind: bytes}, "ops": {kind: count per run},
    "unknown_trip_counts": int}`.
    """

    def count(instr: Instruction, by_name: dict[str, Instruction]) -> Counts:
        kind = _COUNTED.get(instr.opcode)
        if kind is None:
            return {}
        size = array_bytes(instr.type)
        b = _per_device_bytes(kind, size, _group_size(instr.rest, n_devices))
        return {"bytes:" + kind: b, "ops:" + kind: 1}

    def weigh(c: Counts) -> float:
        return sum(v for k, v in c.items() if k.startswith("bytes:"))

    totals = walk(hlo, count, weigh)
    by_kind = {k.removeprefix("bytes:"): v for k, v in totals.counts.items() if k.startswith("bytes:")}
    ops = {k.removeprefix("ops:"): int(v) for k, v in totals.counts.items() if k.startswith("ops:")}
    return {
        "total": sum(by_kind.values()),
        "by_kind": by_kind,
        "ops": ops,
        "unknown_trip_counts": totals.unknown_trip_counts,
    }


def f32_weight_copies(hlo: "str | Module") -> int:
    """Bytes of ENTRY-level instructions that make an f32 array of a bf16 parameter's
    shape from that parameter alone (XLA CPU's hoisted bf16 -> f32 converts)."""
    module = _module(hlo)
    entry = module.computations[module.entry]
    params = {}
    for instr in entry:
        if instr.opcode == "parameter":
            d = shape(instr.type)
            if d and d[0] == "bf16":
                params[instr.name] = d[1]
    total = 0
    for instr in entry:
        ops = operands(instr)
        d = shape(instr.type)
        if (len(ops) == 1 and ops[0] in params and d and d[0] == "f32"
                and math.prod(d[1]) == math.prod(params[ops[0]]) and not instr.type.startswith("(")):
            total += 4 * math.prod(d[1])
    return total


_STABLEHLO_COLLECTIVE = re.compile(
    r'"stablehlo\.(?:' + "|".join(c.replace("-", "_") for c in COLLECTIVE_KINDS)
    + r')".*?:\s*\(.*?\)\s*->\s*(\(.*?\)|tensor<[^>]*>)', re.S)


def collective_dtypes(text: str) -> dict[str, int]:
    """{element type: collectives whose result has it} of a program: the lowered
    StableHLO (what JAX asked for) or the compiled HLO (what the backend runs); each op
    once, loops or not."""
    if "stablehlo." in text:
        types = [re.findall(r"x?([a-z]+\d+)>", m.group(1))
                 for m in _STABLEHLO_COLLECTIVE.finditer(text)]
    else:
        types = []
        for line in text.splitlines():
            instr = instruction(line)
            if instr is not None and re.match(r"(%s)(-start)?\(" % "|".join(COLLECTIVE_KINDS), instr.rest):
                types.append([t for t, _ in _ARRAY.findall(instr.type)])
    counts: dict[str, int] = {}
    for t in types:
        for dtype in dict.fromkeys(t):
            counts[dtype] = counts.get(dtype, 0) + 1
    return counts


# -- where an instruction comes from ------------------------------------------------------


_TABLE = r"^{}\n(.*?)\n\n"


def frame_files(hlo: str) -> dict[int, frozenset[str]]:
    """{stack_frame_id: the source files of that frame and of its callers}, from the
    `FileNames`, `FileLocations` and `StackFrames` tables that head XLA's HLO text."""

    def table(name):
        m = re.search(_TABLE.format(name), hlo, re.S | re.M)
        return {int(i): v for i, v in re.findall(r"^(\d+) (.*)$", m.group(1), re.M)} if m else {}

    files, locations, frames = table("FileNames"), table("FileLocations"), table("StackFrames")
    loc_file = {i: files[int(re.search(r"file_name_id=(\d+)", v).group(1))].strip('"')
                for i, v in locations.items()}
    out: dict[int, frozenset[str]] = {}
    for start in frames:
        seen, i = [], start
        while i in frames and i not in seen:
            seen.append(i)
            # `parent_frame_id` as printed is one more than the parent's id (the
            # outermost frames print 1).
            i = int(re.search(r"parent_frame_id=(\d+)", frames[i]).group(1)) - 1
        out[start] = frozenset(
            loc_file[int(re.search(r"file_location_id=(\d+)", frames[j]).group(1))] for j in seen)
    return out


def _collective(opcode: str) -> bool:
    return opcode.removesuffix("-start").removesuffix("-done") in COLLECTIVE_KINDS


def split_collectives(hlo: str, n_devices: int, marker: str) -> dict:
    """[`collective_bytes`][] of the program's collectives made under `marker` (a source
    file on their call stack, e.g. `"vidax_eqx/nn/sharding/_fsdp.py"`) and of the others:
    `{"marked": ..., "other": ...}`."""
    module = parse(hlo)
    files = frame_files(hlo)

    def origin(instr, by_name) -> bool:
        m = re.search(r"stack_frame_id=(\d+)", instr.rest)
        if m is None and instr.opcode.endswith("-done"):  # an async pair: the start's
            start = by_name.get((operands(instr) or [""])[0])
            m = start and re.search(r"stack_frame_id=(\d+)", start.rest)
        return bool(m) and any(f.endswith(marker) for f in files.get(int(m.group(1)), ()))

    def only(keep: bool) -> Module:
        comps = {}
        for name, instrs in module.computations.items():
            by_name = {i.name: i for i in instrs}
            comps[name] = [i if not _collective(i.opcode) or origin(i, by_name) == keep
                           else i._replace(opcode="") for i in instrs]
        return Module(comps, module.entry)

    return {"marked": collective_bytes(only(True), n_devices),
            "other": collective_bytes(only(False), n_devices)}
