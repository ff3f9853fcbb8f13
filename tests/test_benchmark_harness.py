"""The benchmarks' HLO reader (`benchmarks/_hlo.py`) and child-process runner
(`benchmarks/_harness.py`).

Two HLO parsers used to live in `benchmarks/models.py` and `benchmarks/parallel.py`
with different computation-header regexes: models.py's required `(...) -> RESULT {`,
parallel.py's took any `NAME (... {`. `_hlo.HEADER` takes both, and a bare
`NAME {`. Checked on hand-written HLO text and on programs XLA compiles here (a dot,
a `lax.scan`, and a `shard_map` with a `psum` and a `ppermute` over the 8 simulated
CPU devices the test configuration sets up).
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import _harness, _hlo


# The two header regexes the benchmarks had, to show what each took.
MODELS_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->.*\{\s*$")
PARALLEL_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")

HEADERS = {  # header line -> computation name
    # What `as_text()` prints: both old regexes took it.
    "ENTRY %main.5 (x.1: f32[8,16], ws.1: f32[3,16,16]) -> f32[8,16] {": "main.5",
    "%region_0.3 (arg_tuple.1: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {": "region_0.3",
    '%async_wrapped (p: f32[4]) -> f32[4], execution_thread="host" {': "async_wrapped",
    "fused_computation.1 (param_0: f32[8]) -> f32[8] {": "fused_computation.1",
    # No result type: parallel.py's regex only.
    "%body.7 (p.1: (s32[], f32[4])) {": "body.7",
    "ENTRY %main (a: f32[2]) {": "main",
    # No program shape at all: neither old regex.
    "%region_1 {": "region_1",
    "ENTRY %main.2 {": "main.2",
}
NOT_HEADERS = [
    "HloModule jit_f, is_scheduled=true, entry_computation_layout={(f32[8]{0})->f32[8]{0}}",
    "  %p.1 = f32[8]{0} parameter(0)",
    "  ROOT %t = (f32[8]{0}) tuple(%p.1)",
    "}",
    '1 {file_name_id=1 function_name_id=1 line=3}',
]


@pytest.mark.parametrize("line", HEADERS)
def test_header_regex_takes_every_form(line):
    m = _hlo.HEADER.match(line)
    assert m is not None and m.group(1) == HEADERS[line]
    if MODELS_HEADER.match(line) or PARALLEL_HEADER.match(line):  # what the old ones named
        assert (MODELS_HEADER.match(line) or PARALLEL_HEADER.match(line)).group(1) == HEADERS[line]


def test_old_regexes_disagreed_and_the_new_one_takes_the_union():
    models = {ln for ln in HEADERS if MODELS_HEADER.match(ln)}
    parallel = {ln for ln in HEADERS if PARALLEL_HEADER.match(ln)}
    assert models < parallel  # parallel.py's took headers without `-> RESULT`
    assert all(_hlo.HEADER.match(ln) for ln in parallel | models)


@pytest.mark.parametrize("line", NOT_HEADERS)
def test_header_regex_rejects_other_lines(line):
    assert _hlo.HEADER.match(line) is None


# A loop of 4 trips around a dot and a collective-permute (its body's header has no
# result type: only parallel.py's regex read it), a conditional whose costlier branch
# has an all-gather, a fusion with a dot, and an f32 copy of a bf16 weight.
HAND_WRITTEN = """\
HloModule hand_written, entry_computation_layout={(f32[8,16]{1,0}, bf16[16,16]{1,0})->f32[8,16]{1,0}}

%fused_dot (param_0: f32[8,16], param_1: f32[16,16]) -> f32[8,16] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  %param_1 = f32[16,16]{1,0} parameter(1)
  ROOT %d = f32[8,16]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (arg: (s32[], f32[8,16], f32[16,16])) {
  %arg = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%arg), index=1
  %w = f32[16,16]{1,0} get-tuple-element(%arg), index=2
  %y = f32[8,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot
  %z = f32[8,16]{1,0} collective-permute(%y), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %i = s32[] get-tuple-element(%arg), index=0
  ROOT %t = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) tuple(%i, %z, %w)
}

%cond (arg.1: (s32[], f32[8,16], f32[16,16])) -> pred[] {
  %arg.1 = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%cheap {
  %a = f32[8,16]{1,0} parameter(0)
  ROOT %n = f32[8,16]{1,0} negate(%a)
}

%costly (b: f32[8,16]) -> f32[8,16] {
  %b = f32[8,16]{1,0} parameter(0)
  %g = f32[64,16]{1,0} all-gather(%b), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %s = f32[8,16]{1,0} slice(%g), slice={[0:8], [0:16]}
}

ENTRY %main (x.1: f32[8,16], w.1: bf16[16,16]) -> f32[8,16] {
  %x.1 = f32[8,16]{1,0} parameter(0)
  %w.1 = bf16[16,16]{1,0} parameter(1)
  %w32 = f32[16,16]{1,0} convert(%w.1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) tuple(%zero, %x.1, %w32)
  %loop = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %out = f32[8,16]{1,0} get-tuple-element(%loop), index=1
  %p = pred[] constant(true)
  ROOT %r = f32[8,16]{1,0} conditional(%p, %out, %out), branch_computations={%cheap, %costly}
}
"""


def test_parse_hand_written():
    module = _hlo.parse(HAND_WRITTEN)
    assert module.entry == "main"
    assert set(module.computations) == {"fused_dot", "body", "cond", "cheap", "costly", "main"}
    body = {i.name: i for i in module.computations["body"]}
    assert body["y"].opcode == "fusion" and body["y"].type == "f32[8,16]{1,0}"
    assert body["t"].type == "(s32[], f32[8,16]{1,0}, f32[16,16]{1,0})"
    assert _hlo.operands(body["t"]) == ["i", "z", "w"]


def test_counts_of_hand_written():
    assert _hlo.dot_flops(HAND_WRITTEN) == {"flops": 4 * 2 * 8 * 16 * 16, "unknown_trip_counts": 0}
    comm = _hlo.collective_bytes(HAND_WRITTEN, n_devices=8)
    permute, gather = 4 * 8 * 16 * 4, 64 * 16 * 4 * 7 / 8
    assert comm["by_kind"] == {"collective-permute": permute, "all-gather": gather}
    assert comm["ops"] == {"collective-permute": 4, "all-gather": 1}
    assert comm["total"] == permute + gather
    assert _hlo.f32_weight_copies(HAND_WRITTEN) == 16 * 16 * 4
    assert _hlo.collective_dtypes(HAND_WRITTEN) == {"f32": 2}


def test_unknown_trip_count_is_reported():
    text = HAND_WRITTEN.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
    assert _hlo.dot_flops(text) == {"flops": 2 * 8 * 16 * 16, "unknown_trip_counts": 1}
    assert _hlo.collective_bytes(text, 8)["unknown_trip_counts"] == 1


def test_compiled_dot_and_scan():
    a, b = jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((16, 32), jnp.float32)
    text = jax.jit(jnp.matmul).lower(a, b).compile().as_text()
    assert _hlo.parse(text).entry is not None
    assert _hlo.dot_flops(text)["flops"] == 2 * 8 * 16 * 32

    def scan(x, ws):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]

    ws = jax.ShapeDtypeStruct((3, 16, 16), jnp.float32)
    text = jax.jit(scan).lower(jax.ShapeDtypeStruct((8, 16), jnp.float32), ws).compile().as_text()
    assert _hlo.dot_flops(text) == {"flops": 3 * 2 * 8 * 16 * 16, "unknown_trip_counts": 0}


def test_compiled_collectives_over_a_mesh():
    n = 8
    assert jax.device_count() >= n
    mesh = jax.make_mesh((n,), ("sp",), devices=jax.devices()[:n])

    def f(x):
        ring = jax.lax.ppermute(x, "sp", [(i, (i + 1) % n) for i in range(n)])
        return jax.lax.psum(x, "sp") + ring

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("sp"), out_specs=P("sp")))
    x = jax.ShapeDtypeStruct((2 * n, 32), jnp.float32, sharding=NamedSharding(mesh, P("sp")))
    comm = _hlo.collective_bytes(g.lower(x).compile().as_text(), n)
    local = 2 * 32 * 4  # bytes of one device's block
    assert comm["by_kind"] == {"collective-permute": local, "all-reduce": 2 * local * (n - 1) / n}
    assert comm["ops"] == {"collective-permute": 1, "all-reduce": 1}
    assert comm["unknown_trip_counts"] == 0


def test_run_child_collects_json_and_failures(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(
        "import json, os, sys\n"
        "print('not json')\n"
        "print(json.dumps({'flags': os.environ.get('XLA_FLAGS', ''), 'args': sys.argv[1:]}))\n"
        "if sys.argv[1:] == ['fail']:\n"
        "    raise ValueError('the rule; received fail')\n"
    )
    ok = _harness.run_child(str(script), ["a", 2], devices=4)
    assert ok.ok and ok.reason == "" and len(ok.records) == 1
    assert ok.last["args"] == ["a", "2"]
    assert "--xla_force_host_platform_device_count=4" in ok.last["flags"].split()
    failed = _harness.run_child(str(script), ["fail"], devices=1)
    assert not failed.ok and failed.returncode == 1
    assert failed.reason == "ValueError: the rule; received fail"
    assert "device_count" not in failed.last["flags"]  # one device: the flag removed


def test_best_time_makes_the_runs_it_promises():
    calls = []
    slow = _harness.Sample(wall=5.0, cpu=5.0)
    t = _harness.best_time(lambda: calls.append(1), 3, first=slow, target_seconds=11.0)
    assert (t.runs, len(calls), t.first_only) == (2, 2, False)  # 3 runs of 5 s > 11 s
    t = _harness.best_time(lambda: calls.append(1), 3, first=slow, single_run_seconds=4.0)
    assert (t.runs, len(calls), t.first_only, t.best) == (1, 2, True, 5.0)
    assert t.fields() == {"time_s": 5.0, "cpu_s": 5.0, "runs": 1, "note": "timed on its first run"}
    t = _harness.best_time(lambda: calls.append(1), 3)  # makes its own warm-up
    assert (t.runs, len(calls)) == (3, 6)


def test_interleaved_shuffles_every_round_and_pairs_the_rounds():
    order = []
    runs = {n: (lambda n=n: order.append(n)) for n in "abcd"}
    timings = _harness.interleaved(runs, 6)
    assert order[:4] == list("abcd")  # the warm-ups
    rounds = [tuple(order[i:i + 4]) for i in range(4, len(order), 4)]
    assert len(rounds) == 6 and all(sorted(r) == list("abcd") for r in rounds)
    assert len(set(rounds)) > 1 and len({r.index("a") for r in rounds}) > 1  # not a fixed order
    assert all(t.runs == 6 and not t.first_only for t in timings.values())
    again = []
    _harness.interleaved({n: (lambda n=n: again.append(n)) for n in "abcd"}, 6)
    assert again == order  # seeded
    s = _harness.Sample
    a = _harness.Timing(s(1, 1), (s(2.0, 4.0), s(3.0, 3.0), s(8.0, 1.0)))
    b = _harness.Timing(s(1, 1), (s(1.0, 2.0), s(2.0, 3.0), s(2.0, 1.0)))
    assert _harness.paired_ratio(a, b) == (2.0, 1.5, 4.0)
    assert _harness.paired_ratio(a, b, cpu=True) == (1.0, 1.0, 2.0)


def test_collectives_split_by_the_source_file_on_their_stack():
    # An FSDP gather (made in vidax_eqx/nn/sharding/_fsdp.py) and a psum made here: the stack
    # frames XLA records in the HLO tell them apart.
    from vidax_eqx import nn

    n = 8
    mesh = jax.make_mesh((n,), ("dp",), devices=jax.devices()[:n])

    def f(w, x):
        w, x = nn.sharding.fsdp_gather(nn.sharding.FSDPShard(w, -1, ("dp",)), x)
        return jax.lax.psum(x @ w, "dp")

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(None, "dp"), P("dp")),
                              out_specs=P()))
    w = jax.ShapeDtypeStruct((16, 8 * n), jnp.float32, sharding=NamedSharding(mesh, P(None, "dp")))
    x = jax.ShapeDtypeStruct((n, 16), jnp.float32, sharding=NamedSharding(mesh, P("dp")))
    split = _hlo.split_collectives(g.lower(w, x).compile().as_text(), n, "vidax_eqx/nn/sharding/_fsdp.py")
    assert split["marked"]["ops"] == {"all-gather": 1}
    assert split["other"]["ops"].get("all-reduce", 0) >= 1
    assert "all-gather" not in split["other"]["ops"]
