"""Weight import: state dict round trips, both namings, error messages, hostile files.

The expected parameter names are written out here from the PyTorch reference
models (Wan2.1's `WanSelfAttention` / `WanT2VCrossAttention`, diffusers'
`Attention` as CogVideoX and WanAttention use it), not derived from the library.
Hostile `.safetensors` files are built byte by byte.
"""

import json
import os
import tracemalloc

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import harness
from vidax_eqx import interop, nn


DIM, HEADS, CTX = 32, 4, 24

WAN_LINEARS = ["q", "k", "v", "o"]
DIFFUSERS_LINEARS = ["to_q", "to_k", "to_v", "to_out.0"]


def _linear_names(linears):
    return [f"{lin}.{p}" for lin in linears for p in ("weight", "bias")]


# kind -> (constructor(key), {naming: expected names})
KINDS = {
    "RMSNorm": (lambda key: nn.RMSNorm(DIM), {"wan": ["weight"], "diffusers": ["weight"]}),
    "TPShardedRMSNorm": (
        lambda key: nn.TPShardedRMSNorm(DIM // 2, DIM),
        {"wan": ["weight"], "diffusers": ["weight"]},
    ),
    "LayerNorm": (
        lambda key: nn.LayerNorm(DIM),
        {"wan": ["weight", "bias"], "diffusers": ["weight", "bias"]},
    ),
    "Attention": (
        lambda key: nn.Attention(DIM, HEADS, key=key),
        {
            "wan": _linear_names(WAN_LINEARS) + ["norm_q.weight", "norm_k.weight"],
            "diffusers": _linear_names(DIFFUSERS_LINEARS) + ["norm_q.weight", "norm_k.weight"],
        },
    ),
    "CrossAttention": (
        lambda key: nn.CrossAttention(DIM, HEADS, context_dim=CTX, key=key),
        {
            "wan": _linear_names(WAN_LINEARS) + ["norm_q.weight", "norm_k.weight"],
            "diffusers": _linear_names(DIFFUSERS_LINEARS) + ["norm_q.weight", "norm_k.weight"],
        },
    ),
    "JointAttention": (
        lambda key: nn.JointAttention(DIM, HEADS, key=key),
        {
            "wan": _linear_names(WAN_LINEARS)
            + ["norm_q.weight", "norm_q.bias", "norm_k.weight", "norm_k.bias"],
            "diffusers": _linear_names(DIFFUSERS_LINEARS)
            + ["norm_q.weight", "norm_q.bias", "norm_k.weight", "norm_k.bias"],
        },
    ),
}


def _make(kind, seed):
    """A module of `kind`, every array leaf random (norm weights included)."""
    return harness.resampled(KINDS[kind][0](jax.random.PRNGKey(seed)), seed)


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(harness.arrays(a), harness.arrays(b)):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _assert_differ(a, b):
    assert any(not np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(harness.arrays(a), harness.arrays(b)))


def _snapshot(module):
    return [np.array(x) for x in harness.arrays(module)]


def _unchanged(module, snapshot):
    return all(np.array_equal(np.asarray(x), s) for x, s in zip(harness.arrays(module), snapshot))


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("naming", interop.NAMINGS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_round_trip(kind, naming):
    source, target = _make(kind, 0), _make(kind, 1)
    _assert_differ(source, target)
    sd = interop.state_dict(source, naming=naming)
    assert sorted(sd) == sorted(KINDS[kind][1][naming])
    assert all(isinstance(v, np.ndarray) for v in sd.values())
    loaded = interop.load_state_dict(target, sd)
    _assert_same(loaded, source)
    assert loaded is not target


@pytest.mark.parametrize("kind", ["Attention", "JointAttention"])
def test_namings_load_the_same(kind):
    source, target = _make(kind, 0), _make(kind, 1)
    wan = interop.load_state_dict(target, interop.state_dict(source, naming="wan"))
    diffusers = interop.load_state_dict(target, interop.state_dict(source, naming="diffusers"))
    _assert_same(wan, diffusers)


def test_linear_layout_is_pytorch():
    """PyTorch Linear.weight is (out, in), as eqx.nn.Linear.weight."""
    m = nn.CrossAttention(DIM, HEADS, context_dim=CTX, key=jax.random.PRNGKey(0))
    sd = interop.state_dict(m)
    assert sd["k.weight"].shape == (DIM, CTX) and sd["k.bias"].shape == (DIM,)


class Block(eqx.Module):
    """A module tree with PyTorch names: Wan's block layout in miniature."""

    self_attn: nn.Attention
    norm3: nn.LayerNorm
    ffn: eqx.nn.Sequential
    modulation: jax.Array

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.self_attn = nn.Attention(DIM, HEADS, key=k1)
        self.norm3 = nn.LayerNorm(DIM)
        self.ffn = eqx.nn.Sequential([
            eqx.nn.Linear(DIM, 2 * DIM, key=k2),
            eqx.nn.Lambda(jax.nn.gelu),
            eqx.nn.Linear(2 * DIM, DIM, key=k3),
        ])
        self.modulation = jnp.zeros((1, 6, DIM))


def test_nested_module_names_and_prefix():
    source, target = harness.resampled(Block(jax.random.PRNGKey(0)), 0), Block(jax.random.PRNGKey(1))
    sd = interop.state_dict(source, naming="diffusers", prefix="blocks.3.")
    assert {"blocks.3.self_attn.to_out.0.weight", "blocks.3.ffn.0.weight", "blocks.3.ffn.2.bias",
            "blocks.3.norm3.bias", "blocks.3.modulation"} <= set(sd)
    assert not any(".layers." in k for k in sd)
    other = {"blocks.4.ffn.0.weight": np.zeros(3), "head.weight": np.zeros(2)}  # outside prefix
    loaded = interop.load_state_dict(target, {**sd, **other}, prefix="blocks.3.")
    _assert_same(loaded, source)


def test_safetensors_round_trip(tmp_path):
    source, target = _make("JointAttention", 0), _make("JointAttention", 1)
    path = tmp_path / "model.safetensors"
    interop.save_safetensors(source, path, naming="diffusers", prefix="transformer_blocks.0.attn1.",
                             metadata={"format": "pt"})
    f = interop.open_safetensors(path)
    assert f.metadata == {"format": "pt"}
    assert "transformer_blocks.0.attn1.to_out.0.weight" in f
    assert f.shape("transformer_blocks.0.attn1.to_q.weight") == (DIM, DIM)
    loaded = interop.load_state_dict(target, path, prefix="transformer_blocks.0.attn1.")
    _assert_same(loaded, source)
    loaded = interop.load_state_dict(target, str(path), prefix="transformer_blocks.0.attn1.")
    _assert_same(loaded, source)
    assert not [p for p in os.listdir(tmp_path) if p != "model.safetensors"]  # no temp files left


def test_safetensors_interoperates_with_reference_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    source = _make("Attention", 0)
    ours = tmp_path / "ours.safetensors"
    interop.save_safetensors(source, ours)
    theirs_read = st.load_file(str(ours))
    for key, value in interop.state_dict(source).items():
        np.testing.assert_array_equal(theirs_read[key], value)
    theirs = tmp_path / "theirs.safetensors"
    tensors = {k: v.astype(np.float16) for k, v in interop.state_dict(source).items()}
    tensors["q.weight"] = tensors["q.weight"].astype(np.float64)
    st.save_file(tensors, str(theirs))
    loaded = interop.load_state_dict(_make("Attention", 1), theirs)
    for key, value in interop.state_dict(loaded).items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, tensors[key].astype(np.float32))


def test_float_dtypes_cast_to_module_dtype(tmp_path):
    source = _make("Attention", 0)
    target = nn.Attention(DIM, HEADS, dtype=jnp.bfloat16, key=jax.random.PRNGKey(1))
    sd = interop.state_dict(source)
    mixed = {k: v.astype([np.float16, np.float64, ml_dtypes.bfloat16][i % 3])
             for i, (k, v) in enumerate(sd.items())}
    loaded = interop.load_state_dict(target, mixed)
    for key, value in interop.state_dict(loaded).items():
        assert value.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(value, mixed[key].astype(ml_dtypes.bfloat16))
    path = tmp_path / "bf16.safetensors"
    interop.save_safetensors(loaded, path)  # bfloat16 on disk
    assert interop.open_safetensors(path).dtype("q.weight") == ml_dtypes.bfloat16
    _assert_same(interop.load_state_dict(target, path), loaded)


def test_jax_arrays_and_torch_like_tensors():
    source, target = _make("RMSNorm", 0), _make("RMSNorm", 1)
    weight = source.weight

    class FakeTensor:  # duck-typed like torch.Tensor, without torch
        __module__ = "torch"

        def __init__(self, array, dtype):
            self.array, self.dtype, self.shape = array, dtype, array.shape

        def detach(self):
            return self

        def cpu(self):
            return self

        def float(self):
            return FakeTensor(self.array.astype(np.float32), "torch.float32")

        def numpy(self):
            if self.dtype == "torch.bfloat16":
                raise TypeError("Got unsupported ScalarType BFloat16")
            return self.array

    _assert_same(interop.load_state_dict(target, {"weight": weight}), source)
    bf16 = np.asarray(weight).astype(ml_dtypes.bfloat16)
    loaded = interop.load_state_dict(target, {"weight": FakeTensor(bf16, "torch.bfloat16")})
    np.testing.assert_array_equal(np.asarray(loaded.weight), bf16.astype(np.float32))


def test_loaded_arrays_do_not_alias_the_source():
    target = _make("RMSNorm", 1)
    weight = np.ones(DIM, np.float32)
    loaded = interop.load_state_dict(target, {"weight": weight})
    weight[:] = 5.0
    np.testing.assert_array_equal(np.asarray(loaded.weight), np.ones(DIM, np.float32))


def test_sharding_is_kept():
    mesh = harness.mesh(tp=2)
    module = nn.Attention(DIM, HEADS, parallel=nn.sharding.ParallelConfig(tp_axis="tp"),
                          key=jax.random.PRNGKey(0))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), nn.sharding.partition_specs(module),
                             is_leaf=lambda x: isinstance(x, P))
    module = eqx.filter_shard(module, shardings)
    loaded = interop.load_state_dict(module, interop.state_dict(_make("Attention", 3)))
    for old, new in zip(harness.arrays(module), harness.arrays(loaded)):
        assert new.sharding == old.sharding and new.committed
    assert loaded.q.weight.sharding.spec == P("tp", None)
    # An uncommitted module (plain initialization) gets uncommitted arrays, which
    # jit may still place anywhere.
    loaded = interop.load_state_dict(_make("Attention", 1), interop.state_dict(_make("Attention", 3)))
    assert not any(x.committed for x in harness.arrays(loaded))


def test_abstract_module_from_eval_shape():
    abstract = eqx.filter_eval_shape(nn.Attention, DIM, HEADS, key=jax.random.PRNGKey(0))
    assert isinstance(abstract.q.weight, jax.ShapeDtypeStruct)
    source = _make("Attention", 0)
    _assert_same(interop.load_state_dict(abstract, interop.state_dict(source)), source)
    with pytest.raises(ValueError, match="abstract"):
        interop.state_dict(abstract)


# -- errors --------------------------------------------------------------------------------


def test_all_problems_in_one_error_and_nothing_loaded():
    target = _make("Attention", 1)
    before = _snapshot(target)
    sd = interop.state_dict(_make("Attention", 0))
    del sd["q.bias"], sd["norm_k.weight"]
    sd["extra.weight"] = np.zeros(3, np.float32)
    sd["o.weight"] = np.zeros((DIM, DIM + 1), np.float32)
    sd["v.bias"] = np.arange(DIM, dtype=np.int32)
    with pytest.raises(ValueError) as info:
        interop.load_state_dict(target, sd)
    message = str(info.value)
    assert "nothing was loaded" in message
    assert "missing (2): 'q.bias' or 'to_q.bias', 'norm_k.weight'" in message
    assert "unexpected (1): 'extra.weight'" in message
    assert f"'o.weight': got ({DIM}, {DIM + 1}), expected ({DIM}, {DIM})" in message
    assert "'v.bias': got int32, expected a floating dtype" in message
    assert "strict=False" in message
    assert _unchanged(target, before)


def test_error_names_keys_with_prefix():
    sd = interop.state_dict(_make("Attention", 0), naming="diffusers", prefix="blocks.0.attn1.")
    del sd["blocks.0.attn1.to_out.0.weight"]
    with pytest.raises(ValueError, match=r"missing \(1\): 'blocks.0.attn1.o.weight' or "
                                         r"'blocks.0.attn1.to_out.0.weight'"):
        interop.load_state_dict(_make("Attention", 1), sd, prefix="blocks.0.attn1.")


def test_wrong_prefix_hint():
    sd = interop.state_dict(_make("RMSNorm", 0), prefix="model.norm.")
    with pytest.raises(ValueError, match=r"is `prefix` right\? The source's keys start with: "
                                         r"'model.norm.weight'"):
        interop.load_state_dict(_make("RMSNorm", 1), sd)


@pytest.mark.parametrize("bad", [np.zeros(DIM, np.int64), np.zeros(DIM, bool),
                                 np.zeros(DIM, np.complex64), np.array(["a"] * DIM)])
def test_non_float_dtypes_rejected(bad):
    with pytest.raises(ValueError, match=r"wrong dtype \(1\): 'weight': got"):
        interop.load_state_dict(_make("RMSNorm", 1), {"weight": bad})


def test_both_namings_at_once_rejected():
    sd = interop.state_dict(_make("Attention", 0))
    sd["to_q.weight"] = sd["q.weight"]
    with pytest.raises(ValueError, match=r"both namings \(1\): 'q.weight' and 'to_q.weight'"):
        interop.load_state_dict(_make("Attention", 1), sd)


def test_non_strict():
    source, target = _make("Attention", 0), _make("Attention", 1)
    sd = interop.state_dict(source)
    partial = {"q.weight": sd["q.weight"], "unused": np.zeros(2)}
    loaded = interop.load_state_dict(target, partial, strict=False)
    np.testing.assert_array_equal(np.asarray(loaded.q.weight), sd["q.weight"])
    np.testing.assert_array_equal(np.asarray(loaded.k.weight), np.asarray(target.k.weight))
    with pytest.raises(ValueError, match="no parameter matched"):
        interop.load_state_dict(target, {"unused": np.zeros(2)}, strict=False)
    no_params = nn.LayerNorm(DIM, elementwise_affine=False)
    assert interop.load_state_dict(no_params, {}, strict=False) is not None
    assert interop.load_state_dict(no_params, {}) is not None
    with pytest.raises(ValueError, match="wrong shape"):  # shapes are checked all the same
        interop.load_state_dict(target, {"q.weight": np.zeros((1, 1))}, strict=False)


def test_bad_arguments(tmp_path):
    target = _make("RMSNorm", 1)
    with pytest.raises(ValueError, match="mapping of names to arrays or a path"):
        interop.load_state_dict(target, [("weight", np.ones(DIM))])
    with pytest.raises(ValueError, match="`prefix` must be a string"):
        interop.load_state_dict(target, {}, prefix=None)
    with pytest.raises(ValueError, match="`naming` must be one of"):
        interop.state_dict(target, naming="torch")
    for name in ("model.pt", "pytorch_model.bin", "model.ckpt"):
        (tmp_path / name).write_bytes(b"\x80\x04not really a pickle")
        with pytest.raises(ValueError, match="pickle-based"):
            interop.load_state_dict(target, tmp_path / name)
    with pytest.raises(ValueError, match="no candidate checkpoints"):
        interop.load_state_dict(target, tmp_path)
    with pytest.raises(FileNotFoundError):
        interop.load_state_dict(target, tmp_path / "absent.safetensors")


# -- hostile .safetensors files -------------------------------------------------------------


_raw_file = harness.safetensors_file  # the hostile-file builders, shared with test_bad_inputs
_entry = harness.safetensors_entry


def _valid(tmp_path):
    path = tmp_path / "valid.safetensors"
    interop.save_safetensors(_make("Attention", 0), path)
    return path


def _refused(data: int) -> str:
    """The match of a header the safetensors library refuses, in a file with `data`
    bytes after the header: the library's reason, then what the file holds."""
    return (r"the safetensors library refuses its header \(.+\); received a \d+-byte header "
            rf"and {data} data bytes; expected JSON entries .* tile those {data} bytes")


# The library's reasons are worded differently across its versions: the matches are the
# parts this package writes.
HOSTILE = {
    "empty file": lambda p: (p.write_bytes(b"") or p,
                             "received 0 bytes; expected at least the 8-byte header length"),
    "header length beyond the file": lambda p: (_raw_file(p, b"{}", length=1000),
                                                "header length is 1000; expected at most 2 "),
    "header length over the cap": lambda p: (
        _raw_file(p, b"{}", length=interop.MAX_HEADER_BYTES + 1),
        r"header length is 100000001; expected at most 2 \(.*never over 100000000\)"),
    "header length 2**64 - 1": lambda p: (_raw_file(p, b"{}", length=2**64 - 1),
                                          "header length is 18446744073709551615; expected"),
    "header not JSON": lambda p: (_raw_file(p, b"{'q.weight': pickle}"), _refused(0)),
    "header not UTF-8": lambda p: (_raw_file(p, b'{"\xff\xfe": 1}'), _refused(0)),
    "header a list": lambda p: (_raw_file(p, [1, 2]), _refused(0)),
    "deeply nested header": lambda p: (_raw_file(p, b"[" * 200_000 + b"]" * 200_000),
                                       _refused(0)),
    "duplicate key": lambda p: (_raw_file(p, b'{"w": %s, "w": %s}' % (
        json.dumps(_entry()).encode(), json.dumps(_entry()).encode()), bytes(8)),
        "the duplicate key 'w' .*expected each key once"),
    "bad metadata": lambda p: (_raw_file(p, {"__metadata__": {"a": 1}}), _refused(0)),
    "entry not an object": lambda p: (_raw_file(p, {"w": [1]}), _refused(0)),
    "unknown dtype": lambda p: (_raw_file(p, {"w": _entry(dtype="F128")}, bytes(8)), _refused(8)),
    "dtype not read here": lambda p: (_raw_file(p, {"w": _entry(dtype="C64", shape=(1,))},
                                                bytes(8)),
                                      # (safetensors < 0.7 does not know C64 itself)
                                      "tensor 'w' has dtype 'C64', which is not read here|"
                                      + _refused(8)),
    "negative dim": lambda p: (_raw_file(p, {"w": _entry(shape=(-2,))}, bytes(8)), _refused(8)),
    "bool dim": lambda p: (_raw_file(p, {"w": _entry(shape=(True, 2))}, bytes(8)), _refused(8)),
    "float dim": lambda p: (_raw_file(p, {"w": _entry(shape=(2.0,))}, bytes(8)), _refused(8)),
    "offsets out of range": lambda p: (_raw_file(p, {"w": _entry(offsets=(0, 8))}, bytes(4)),
                                       _refused(4)),
    "offsets reversed": lambda p: (_raw_file(p, {"w": _entry(offsets=(8, 0))}, bytes(8)),
                                   _refused(8)),
    "offsets not ints": lambda p: (_raw_file(p, {"w": _entry(offsets=(0, "8"))}, bytes(8)),
                                   _refused(8)),
    "shape / bytes mismatch": lambda p: (_raw_file(p, {"w": _entry(shape=(3,))}, bytes(8)),
                                         _refused(8)),
    "forged huge shape": lambda p: (_raw_file(p, {"w": _entry(shape=[2**62] * 1000)}, bytes(8)),
                                    _refused(8)),
    "overlapping tensors": lambda p: (_raw_file(p, {"a": _entry(), "b": _entry(offsets=(4, 12))},
                                                bytes(12)), _refused(12)),
    "gap between tensors": lambda p: (_raw_file(p, {"a": _entry(), "b": _entry(offsets=(12, 20))},
                                                bytes(20)), _refused(20)),
    "trailing bytes": lambda p: (_raw_file(p, {"a": _entry()}, bytes(16)), _refused(16)),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_file_rejected(tmp_path, case):
    path, match = HOSTILE[case](tmp_path / "bad.safetensors")
    target = _make("RMSNorm", 1)
    before = _snapshot(target)
    with pytest.raises(ValueError, match=match) as info:
        interop.load_state_dict(target, path)
    assert "is not a valid .safetensors file" in str(info.value)
    assert len(str(info.value)) < 1000
    assert _unchanged(target, before)


def _peak_rise(call) -> int | None:
    """How far this process's peak resident memory (`VmHWM`) rose during `call()`, in
    bytes: it sees the safetensors library's own (Rust) allocations, which tracemalloc
    does not. `None` where Linux's reset of the peak (`/proc/self/clear_refs`) is missing."""
    def peak() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = peak()
    except (OSError, StopIteration):
        return None
    call()
    return peak() - before


def test_huge_header_length_allocates_nothing(tmp_path):
    path = _raw_file(tmp_path / "bad.safetensors", b"{}", length=interop.MAX_HEADER_BYTES)

    def refused():
        with pytest.raises(ValueError, match="header length is 100000000; expected at most 2 "):
            interop.open_safetensors(path)

    tracemalloc.start()
    try:
        refused()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000
    rise = _peak_rise(refused)
    assert rise is None or rise < 32_000_000, rise  # nothing near the claimed 100 MB


def test_extra_entry_fields_are_ignored(tmp_path):
    """The safetensors library, the format's reference reader, ignores keys of an entry
    beyond dtype, shape and data_offsets (a later version of the format may add some)."""
    path = _raw_file(tmp_path / "extra.safetensors", {"w": {**_entry(), "x": 1}},
                     np.array([1.5, -2], "<f4").tobytes())
    np.testing.assert_array_equal(interop.open_safetensors(path)["w"], [1.5, -2])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, ml_dtypes.bfloat16,
                                   ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, np.int32,
                                   np.bool_], ids=lambda d: np.dtype(d).name)
def test_every_dtype_round_trips_whole_and_in_blocks(tmp_path, dtype):
    """Bit for bit, whole, in blocks and cast: bfloat16 through the library's NumPy
    framework, float8 (which it does not build) from the bytes at the offsets it
    validated; a 0-d and an empty tensor too."""
    rng = np.random.default_rng(0)
    tensors = {"m": (rng.normal(size=(6, 10)) * 3).astype(dtype),
               "s": np.asarray(1.5).astype(dtype), "e": np.zeros((0, 3), dtype)}
    interop.write_checkpoint(tmp_path, tensors)
    f = interop.open_checkpoint(tmp_path)
    for name, value in tensors.items():
        got = f[name]
        assert (got.dtype, got.shape, got.tobytes()) == (value.dtype, value.shape, value.tobytes())
    for block in [(slice(1, 4), slice(2, 7)), (slice(2, 5),), (slice(3, 3),)]:
        want = np.ascontiguousarray(tensors["m"][block])
        assert f.read_slice("m", block).tobytes() == want.tobytes()
        np.testing.assert_array_equal(f.read_slice("m", block, np.float32), want.astype(np.float32))
    assert f.read_slice("e", (slice(0, 0), slice(1, 2))).shape == (0, 1)


@pytest.mark.parametrize("keep", [8 + 4, -1, -200])
def test_truncated_file_rejected(tmp_path, keep):
    path = _valid(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:keep])
    target = _make("Attention", 1)
    before = _snapshot(target)
    with pytest.raises(ValueError, match="is not a valid .safetensors file"):
        interop.load_state_dict(target, path)
    assert _unchanged(target, before)


def test_corrupt_byte_in_header_rejected(tmp_path):
    path = _valid(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[20] = ord("}")
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="is not a valid .safetensors file"):
        interop.open_safetensors(path)


def test_wrong_tensors_in_file_checked_before_reading(tmp_path, monkeypatch):
    """Mis-shaped and integer tensors are reported from the header alone."""
    sd = interop.state_dict(_make("Attention", 0))
    sd["q.weight"] = np.zeros((DIM, 2), np.float32)
    sd["k.bias"] = np.zeros(DIM, np.int32)
    path = tmp_path / "wrong.safetensors"
    interop.save_safetensors(sd, path)  # a dict is saved under its own names
    assert sorted(interop.open_safetensors(path)) == sorted(sd)

    def no_reading(self, name):
        raise AssertionError(f"tensor {name!r} was read")

    monkeypatch.setattr(interop.SafetensorsFile, "__getitem__", no_reading)
    with pytest.raises(ValueError) as info:
        interop.load_state_dict(_make("Attention", 1), path)
    assert f"'q.weight': got ({DIM}, 2), expected ({DIM}, {DIM})" in str(info.value)
    assert "'k.bias': got int32, expected a floating dtype" in str(info.value)


def test_file_changed_after_opening(tmp_path):
    path = _valid(tmp_path)
    f = interop.open_safetensors(path)
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(ValueError, match="size changed"):
        f["q.weight"]


def test_file_reopened_for_each_map(tmp_path, monkeypatch):
    """With the map dropped after every read (the file reopened and its header validated
    again), reads are the same; a file replaced after opening by one of the same size
    whose tensor has another dtype is refused, not misread."""
    monkeypatch.setattr(interop._safetensors, "_REMAP_BYTES", 0)
    w = np.arange(4, dtype=np.float32).reshape(2, 2)
    interop.write_checkpoint(tmp_path, {"w": w})
    f = interop.open_checkpoint(tmp_path)
    for _ in range(3):
        np.testing.assert_array_equal(f["w"], w)
    interop.write_checkpoint(tmp_path / "other", {"w": w.view(np.int32)})
    os.replace(tmp_path / "other" / "diffusion_pytorch_model.safetensors", f.path)
    with pytest.raises(ValueError, match="tensor 'w' changed after it was opened"):
        f["w"]


# -- stacked layers and sharded checkpoints ---------------------------------------------------


class _Stack(eqx.Module):
    """Two layers stacked on a leading axis (as `eqx.filter_vmap` builds them), and a head."""

    blocks: nn.FeedForward
    head: eqx.nn.Linear


def _stack():
    blocks = eqx.filter_vmap(lambda k: nn.FeedForward(4, 6, key=k))(jax.random.split(jax.random.key(0), 3))
    return _Stack(blocks, eqx.nn.Linear(4, 2, key=jax.random.key(1)))


def test_stacked_layers_round_trip_per_layer_names(tmp_path):
    model = _stack()
    sd = interop.state_dict(model, stacked=("blocks",))
    assert sorted(sd) == sorted(
        [f"blocks.{i}.{n}.{p}" for i in range(3) for n in ("0", "2") for p in ("weight", "bias")]
        + ["head.weight", "head.bias"])
    np.testing.assert_array_equal(sd["blocks.2.0.weight"], model.blocks.fc1.weight[2])
    renamed = interop.state_dict(model, naming="diffusers", stacked=("blocks",),
                                 rename=lambda name, naming: name.replace("head.", "proj_out."))
    assert "proj_out.weight" in renamed and "blocks.1.net.0.proj.bias" in renamed
    path = tmp_path / "stack.safetensors"
    interop.save_safetensors(model, path, stacked=("blocks",))
    abstract = eqx.filter_eval_shape(_stack)
    loaded = interop.load_state_dict(abstract, path, stacked=("blocks",))
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(model)):
        np.testing.assert_array_equal(a, b)
    del sd["blocks.1.2.bias"]
    with pytest.raises(ValueError, match=r"missing \(1\): 'blocks.1.2.bias'"):
        interop.load_state_dict(model, sd, stacked=("blocks",))


def test_sharded_checkpoint_index(tmp_path):
    tensors = {f"t{i}": np.full((10,), i, np.float32) for i in range(5)}
    files = interop.write_checkpoint(tmp_path, tensors, max_shard_bytes=80)
    assert len(files) == 4  # the index and 3 shards of at most 2 tensors
    ckpt = interop.open_checkpoint(tmp_path)
    assert isinstance(ckpt, interop.SafetensorsShards) and sorted(ckpt) == sorted(tensors)
    assert ckpt.shape("t3") == (10,) and float(ckpt["t3"][0]) == 3.0
    index_path = tmp_path / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for bad, message in (
        ({"t0": "../elsewhere.safetensors"}, "no directories"),
        ({**index["weight_map"], "t9": index["weight_map"]["t0"]}, "'t9' is not in"),
        ({k: v for k, v in index["weight_map"].items() if k != "t1"}, "'t1' of .* is not indexed"),
    ):
        index_path.write_text(json.dumps({"weight_map": bad}))
        with pytest.raises(ValueError, match=message):
            interop.open_checkpoint(tmp_path)
