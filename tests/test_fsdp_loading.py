"""Checkpoints loaded straight into the sharded layout: `from_pretrained(..., mesh=mesh)`.

Each process reads only the blocks of each tensor that its own devices hold, each
distinct block once (never once per device), and the result is the plain load,
placed as `nn.sharding.partition_specs` says:

1. Wan and CogVideoX, one file and a sharded index, under FSDP over `dp` x `sp` with
   Megatron, FSDP over 8 devices alone, and Megatron alone: every array bit for bit
   the plain load's, with the expected `NamedSharding`; the bytes read are the
   checkpoint's, once; a bfloat16 checkpoint loads in float32.
2. The slice reader (the safetensors library's `get_slice`): every block, split on any
   dimension, reads exactly its own bytes, once; float8 (read as raw rows) and casts too.
3. Two processes of four devices (`jax.distributed`, gloo): each process's shards
   equal the tensors' blocks, and it reads about its half of the checkpoint.
4. A Hugging Face Hub repository id (`subfolder="transformer"`), from a cache directory
   laid out as the Hub's, offline; a missing repository or folder is a clear error,
   and so is a missing `huggingface_hub`.
5. Bad input: placement errors (`nn.sharding.partition_specs`'s, an uneven Megatron split, a
   mesh without the axes) and a mis-shaped tensor raise before anything is read, the
   latter with the same message as the plain load.
"""

import json
import math
import os
import shutil
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import harness
from vidax_eqx import interop, models, nn


HERE = os.path.dirname(os.path.abspath(__file__))
# Tiny random models of 2 layers saved by diffusers (Wan: dim 64, ffn 96, 8 heads).
WAN = os.path.join(HERE, "fixtures", "wan", "t2v")
COGVIDEOX = os.path.join(HERE, "fixtures", "cogvideox", "5b", "diffusers")
WORKER = os.path.join(HERE, "_fsdp_loading_worker.py")

# (mesh axes, ParallelConfig): FSDP over dp x sp with Megatron; FSDP over 8 devices
# alone; Megatron alone (replicated over dp: one read per process, not per device).
PLACEMENTS = {
    "fsdp4-tp2": ({"dp": 2, "sp": 2, "tp": 2},
                  nn.sharding.ParallelConfig(sequence="ulysses", tp_axis="tp", fsdp_axes=("dp", "sp"))),
    "fsdp8": ({"dp": 8}, nn.sharding.ParallelConfig(fsdp_axes=("dp",))),
    "tp4": ({"dp": 2, "tp": 4}, nn.sharding.ParallelConfig(tp_axis="tp")),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny Wan (diffusers' layout in one file, Wan's own layout, our shards, a
    bfloat16 copy in shards) and CogVideoX (one file, shards) checkpoints, and the plain
    loads."""
    root = tmp_path_factory.mktemp("checkpoints")
    wan = models.WanTransformer3D.from_pretrained(os.path.join(WAN, "diffusers"))
    wan.save_pretrained(root / "wan-shards", max_shard_bytes=20_000)
    tensors = interop.open_checkpoint(os.path.join(WAN, "diffusers"))
    interop.write_checkpoint(root / "wan-bf16", {n: tensors[n].astype(ml_dtypes.bfloat16)
                                                 for n in tensors}, max_shard_bytes=20_000)
    shutil.copy(os.path.join(WAN, "diffusers", "config.json"), root / "wan-bf16")
    cog = models.CogVideoXTransformer3D.from_pretrained(COGVIDEOX)
    cog.save_pretrained(root / "cog-shards", max_shard_bytes=50_000)
    return {
        "root": root,
        "wan": wan,
        "wan-f32-from-bf16": models.WanTransformer3D.from_pretrained(root / "wan-bf16",
                                                                     dtype=jnp.float32),
        "cog": cog,
    }


def _wan_path(checkpoints, layout):
    return {"wan": os.path.join(WAN, "diffusers"), "wan-original": os.path.join(WAN, "wan")}.get(
        layout, checkpoints["root"] / layout)


def _mesh(placement):
    axes, parallel = PLACEMENTS[placement]
    return harness.mesh(**axes), parallel


def _recording(monkeypatch):
    """The checkpoints `from_pretrained` opens from now on (to read their `bytes_read`)."""
    opened = []
    open_checkpoint = interop.open_checkpoint

    def record(path):
        opened.append(open_checkpoint(path))
        return opened[-1]

    monkeypatch.setattr(interop, "open_checkpoint", record)
    return opened


def _total_bytes(tensors) -> int:
    return sum(math.prod(tensors.shape(n)) * tensors.dtype(n).itemsize for n in tensors)


def _check_placed(model, plain, mesh):
    """`model` is `plain` bit for bit, each array placed by `nn.sharding.partition_specs`."""
    assert harness.same_arrays(model, plain)
    specs = [s for s in jax.tree.leaves(nn.sharding.partition_specs(model, mesh),
                                        is_leaf=lambda s: isinstance(s, P)) if isinstance(s, P)]
    got = harness.arrays(model)
    assert len(specs) == len(got)
    for array, spec in zip(got, specs):
        assert array.sharding == NamedSharding(mesh, spec), (array.sharding, spec)
        assert array.committed


# -- 1. sharded loads equal the plain load -------------------------------------------------


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("layout", ["wan", "wan-shards", "wan-original"])
def test_wan_loads_sharded(checkpoints, layout, placement, monkeypatch):
    mesh, parallel = _mesh(placement)
    opened = _recording(monkeypatch)
    model = models.WanTransformer3D.from_pretrained(_wan_path(checkpoints, layout),
                                                    parallel=parallel, mesh=mesh)
    _check_placed(model, checkpoints["wan"], mesh)
    assert model.blocks.self_attn.parallel == parallel
    # All 8 devices are this process's: every byte read once, none once per device.
    assert opened[0].bytes_read == _total_bytes(opened[0])
    if placement == "fsdp8":  # every parameter split (Megatron leaves some whole to FSDP)
        assert not nn.sharding.replicated_parameters(model, mesh)


def test_bfloat16_checkpoint_loads_in_float32(checkpoints, monkeypatch):
    mesh, parallel = _mesh("fsdp4-tp2")
    opened = _recording(monkeypatch)
    model = models.WanTransformer3D.from_pretrained(
        checkpoints["root"] / "wan-bf16", parallel=parallel, mesh=mesh, dtype=jnp.float32)
    assert model.blocks.ffn.fc2.weight.dtype == jnp.float32
    _check_placed(model, checkpoints["wan-f32-from-bf16"], mesh)
    assert opened[0].bytes_read == _total_bytes(opened[0])  # the bfloat16 bytes, once
    assert opened[0].dtype("proj_out.weight") == np.dtype(ml_dtypes.bfloat16)
    half = models.WanTransformer3D.from_pretrained(checkpoints["root"] / "wan-bf16",
                                                   parallel=parallel, mesh=mesh)
    assert half.blocks.ffn.fc2.weight.dtype == jnp.bfloat16  # default: the checkpoint's


@pytest.mark.parametrize("placement", ["fsdp4-tp2", "fsdp8"])
@pytest.mark.parametrize("layout", ["one", "shards"])
def test_cogvideox_loads_sharded(checkpoints, layout, placement, monkeypatch):
    mesh, parallel = _mesh(placement)
    path = COGVIDEOX if layout == "one" else checkpoints["root"] / "cog-shards"
    opened = _recording(monkeypatch)
    model = models.CogVideoXTransformer3D.from_pretrained(path, parallel=parallel, mesh=mesh)
    _check_placed(model, checkpoints["cog"], mesh)
    assert opened[0].bytes_read == _total_bytes(opened[0])


def test_load_state_dict_places_one_module(checkpoints):
    """`interop.load_state_dict(..., mesh=)` on any module; a ShapeDtypeStruct's own
    sharding drives the same path."""
    mesh, parallel = _mesh("fsdp4-tp2")
    attn = eqx.filter_eval_shape(nn.Attention, 64, 8, parallel=parallel, key=jax.random.key(0))
    path = _wan_path(checkpoints, "wan")
    got = interop.load_state_dict(attn, path, prefix="blocks.1.attn1.", mesh=mesh)
    want = checkpoints["wan"].blocks.self_attn
    assert np.array_equal(got.q.weight, want.q.weight[1])
    assert got.q.weight.sharding == NamedSharding(mesh, P("tp", ("dp", "sp")))
    given = NamedSharding(mesh, P(None, "tp"))
    attn = eqx.tree_at(lambda m: m.o.weight, attn,
                       jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=given))
    got = interop.load_state_dict(attn, path, prefix="blocks.1.attn1.")
    assert got.o.weight.sharding == given and np.array_equal(got.o.weight, want.o.weight[1])
    assert got.q.weight.sharding != given  # the others: uncommitted, as without a sharding


def test_stacked_leaves_under_any_sharding(tmp_path):
    """A stacked leaf whose layer axis is split (not what partition_specs gives) is read
    block by block too; one whose layer axis is whole, layer by layer."""
    rng = np.random.default_rng(1)
    tensors = {f"blocks.{i}.{n}": harness.normal(rng, s) for i in range(4)
               for n, s in (("weight", (8, 6)), ("bias", (8,)))}
    interop.write_checkpoint(tmp_path, tensors)
    mesh = harness.mesh(dp=2, sp=4)
    placed = {"weight": NamedSharding(mesh, P("dp", "sp", None)),  # layers split over dp
              "bias": NamedSharding(mesh, P(None, ("dp", "sp")))}
    module = {"blocks": {n: jax.ShapeDtypeStruct((4,) + tensors[f"blocks.0.{n}"].shape,
                                                 jnp.float32, sharding=s)
                         for n, s in placed.items()}}
    source = interop.open_checkpoint(tmp_path)
    got = interop.load_state_dict(module, source, stacked=("blocks",))
    for n, sharding in placed.items():
        assert got["blocks"][n].sharding == sharding
        assert np.array_equal(got["blocks"][n], np.stack([tensors[f"blocks.{i}.{n}"]
                                                          for i in range(4)]))
    assert source.bytes_read == _total_bytes(source)


# -- 2. the slice reader ---------------------------------------------------------------------


def test_read_slices_reads_only_the_blocks(tmp_path):
    rng = np.random.default_rng(0)
    x = harness.normal(rng, (16, 2048))  # rows of 8 KiB
    y = harness.normal(rng, (16, 24, 6), ml_dtypes.bfloat16)
    interop.write_checkpoint(tmp_path, {"x": x, "y": y})
    f = interop.open_checkpoint(tmp_path)

    def read(name, indices, dtype=None):
        before = f.bytes_read
        got = f.read_slices(name, indices, dtype)
        return got, f.bytes_read - before

    got, n = read("x", [(slice(4, 8),)])  # leading dimension: one contiguous run
    assert np.array_equal(got[0], x[4:8]) and n == x[4:8].nbytes
    halves = [(slice(None), slice(0, 1024)), (slice(None), slice(1024, 2048))]
    got, n = read("x", halves)  # runs of 4 KiB, one per row
    assert all(np.array_equal(g, x[i]) for g, i in zip(got, halves)) and n == x.nbytes
    got, n = read("x", halves[:1])
    assert n == x.nbytes // 2
    quarters = [(slice(0, 8), slice(6 * i, 6 * i + 6)) for i in range(4)]
    got, n = read("y", quarters, np.float32)  # runs of 72 bytes: each block's own, once
    assert all(g.dtype == np.float32 and np.array_equal(g, y[i].astype(np.float32))
               for g, i in zip(got, quarters))
    assert n == y[:8].nbytes
    z = harness.normal(rng, (6, 10)).astype(ml_dtypes.float8_e4m3fn)  # raw rows, then cut
    interop.write_checkpoint(tmp_path / "f8", {"z": z})
    f8 = interop.open_checkpoint(tmp_path / "f8")
    got = f8.read_slices("z", [(slice(1, 4), slice(2, 9)), (slice(5, 6),)], np.float32)
    assert np.array_equal(got[0], z[1:4, 2:9].astype(np.float32))
    assert np.array_equal(got[1], z[5:6].astype(np.float32))
    assert f8.bytes_read == z[1:4, 2:9].nbytes + z[5:6].nbytes
    assert np.array_equal(f.read_slice("y", (slice(3, 5), slice(2, 20), slice(1, 4))),
                          y[3:5, 2:20, 1:4])
    with pytest.raises(ValueError, match=r"slices with a step are not read; received slice\(0, 8, 2\)"):
        f.read_slice("x", (slice(0, 8, 2),))
    with pytest.raises(ValueError, match=r"at most 2 slices .* received"):
        f.read_slice("x", (slice(0, 1),) * 3)


# -- 3. two processes ------------------------------------------------------------------------


@pytest.mark.slow
def test_two_processes_read_their_share(checkpoints):
    path = str(checkpoints["root"] / "wan-shards")
    port = harness.free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, str(i), str(harness.NUM_PROCESSES),
                               str(port), path],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=harness.child_env())
             for i in range(harness.NUM_PROCESSES)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{out[-4000:]}"
        results = {line.split()[1]: line.split()[2:] for line in out.splitlines()
                   if line.startswith("RESULT ")}
        assert results.get("equal") == ["ok"], f"process {i}:\n{out[-4000:]}"
        read, share, bound, total = (int(v) for v in results["bytes"])
        assert share <= read <= bound, (i, read, share, bound)
        assert read < 0.6 * total, (i, read, total)  # about half (55% here), never the whole


# -- 4. a Hugging Face Hub repository -------------------------------------------------------


REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(checkpoints, tmp_path, monkeypatch):
    """A Hub cache directory holding the pipeline repository `vidax/tiny-wan` (its
    `transformer/` folder the Wan checkpoint, and another component beside it), offline."""
    constants = pytest.importorskip("huggingface_hub.constants")
    snapshot = tmp_path / "models--vidax--tiny-wan" / "snapshots" / REVISION
    shutil.copytree(checkpoints["root"] / "wan-shards", snapshot / "transformer")
    (snapshot / "vae").mkdir()
    (snapshot / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"not read")
    (snapshot / "model_index.json").write_text(json.dumps({"transformer": ["diffusers", "x"]}))
    (tmp_path / "models--vidax--tiny-wan" / "refs").mkdir()
    (tmp_path / "models--vidax--tiny-wan" / "refs" / "main").write_text(REVISION)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path


def test_hub_repository(hub_cache, checkpoints):
    mesh, parallel = _mesh("fsdp8")
    model = models.WanTransformer3D.from_pretrained(
        "vidax/tiny-wan", subfolder="transformer", cache_dir=hub_cache, parallel=parallel,
        mesh=mesh)
    _check_placed(model, checkpoints["wan"], mesh)
    plain = models.WanTransformer3D.from_pretrained("vidax/tiny-wan", subfolder="transformer",
                                                    cache_dir=hub_cache, revision="main")
    assert harness.same_arrays(plain, checkpoints["wan"])
    assert interop.resolve_checkpoint("vidax/tiny-wan", subfolder="transformer",
                                      cache_dir=hub_cache) == str(
        hub_cache / "models--vidax--tiny-wan" / "snapshots" / REVISION / "transformer")


def test_hub_errors(hub_cache, monkeypatch):
    with pytest.raises(ValueError, match=r"WanTransformer3D.from_pretrained: 'vidax/missing' is "
                                         r"not a directory on disk, and the Hugging Face Hub "
                                         r"repository 'vidax/missing' .* could not be resolved"):
        models.WanTransformer3D.from_pretrained("vidax/missing", cache_dir=hub_cache)
    with pytest.raises(ValueError, match=r"has no folder 'unet'.*Pass the right `subfolder`"):
        models.WanTransformer3D.from_pretrained("vidax/tiny-wan", subfolder="unet",
                                                cache_dir=hub_cache)
    with pytest.raises(ValueError, match=r"pass subfolder='transformer'"):
        models.CogVideoXTransformer3D.from_pretrained("vidax/tiny-wan", cache_dir=hub_cache)
    with pytest.raises(ValueError, match=r"`subfolder` must be a relative folder name"):
        models.WanTransformer3D.from_pretrained("vidax/tiny-wan", subfolder="../x",
                                                cache_dir=hub_cache)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install huggingface_hub"):
        models.WanTransformer3D.from_pretrained("vidax/tiny-wan", subfolder="transformer")


def test_local_path_errors(tmp_path):
    with pytest.raises(ValueError, match=r"`path` must be a checkpoint directory holding "
                                         r"config.json .* '.*/nothing/here' is not a directory "
                                         r"on disk, nor a repository id."):
        models.WanTransformer3D.from_pretrained(tmp_path / "nothing" / "here")
    with pytest.raises(ValueError, match=r"`revision` and `cache_dir` are for Hub repositories"):
        models.WanTransformer3D.from_pretrained(tmp_path, revision="main")


# -- 5. bad input ------------------------------------------------------------------------------


def test_placement_errors(checkpoints, monkeypatch):
    path = _wan_path(checkpoints, "wan")
    opened = _recording(monkeypatch)
    mesh, _ = _mesh("fsdp8")
    with pytest.raises(ValueError, match=r"from_pretrained\(mesh=...\): partition_specs: the FSDP "
                                         r"axis 'data' .* is not an axis of the mesh"):
        models.WanTransformer3D.from_pretrained(
            path, parallel=nn.sharding.ParallelConfig(fsdp_axes=("data",)), mesh=mesh)
    with pytest.raises(ValueError, match=r"`mesh` has the axes \('dp', 'sp', 'tp'\), but .* "
                                         r"over \['model'\]"):
        models.WanTransformer3D.from_pretrained(
            path, parallel=nn.sharding.ParallelConfig(tp_axis="model"), mesh=mesh)
    with pytest.raises(ValueError, match=r"`mesh` must be a jax.sharding.Mesh"):
        models.WanTransformer3D.from_pretrained(path, mesh="dp")
    three = harness.mesh(tp=3)
    with pytest.raises(ValueError, match=r"nothing was loaded.\n  not split evenly by their "
                                         r"placement .*'blocks.0.attn1.to_q.weight' \(2, 64, 64\) "
                                         r"by P\(None, 'tp', None\) over"):
        models.WanTransformer3D.from_pretrained(
            path, parallel=nn.sharding.ParallelConfig(tp_axis="tp"), mesh=three)
    assert opened and all(f.bytes_read == 0 for f in opened)  # refused before any read
    # partition_specs' own error: a parameter too large to stay whole that FSDP cannot split.
    ffn = eqx.filter_eval_shape(nn.FeedForward, 1025, 1025, parallel=nn.sharding.ParallelConfig(
        fsdp_axes=("dp",)), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"partition_specs: FSDP over \('dp',\) \(size 8\) "
                                         r"cannot split the parameter"):
        interop.load_state_dict(ffn, {}, mesh=mesh)


def test_mis_shaped_tensor_same_error(checkpoints, tmp_path, monkeypatch):
    source = interop.open_checkpoint(_wan_path(checkpoints, "wan"))
    broken = {name: source[name] for name in source}
    broken["blocks.1.ffn.net.2.weight"] = np.zeros((64, 95), np.float32)
    interop.write_checkpoint(tmp_path, broken)
    shutil.copy(os.path.join(_wan_path(checkpoints, "wan"), "config.json"), tmp_path)
    with pytest.raises(ValueError) as plain:
        models.WanTransformer3D.from_pretrained(tmp_path)
    assert "wrong shape (1): 'blocks.1.ffn.net.2.weight': got (64, 95), expected (64, 96)" in str(
        plain.value)
    mesh, parallel = _mesh("fsdp4-tp2")
    opened = _recording(monkeypatch)
    with pytest.raises(ValueError) as sharded:
        models.WanTransformer3D.from_pretrained(tmp_path, parallel=parallel, mesh=mesh)
    assert str(sharded.value) == str(plain.value)
    assert opened[0].bytes_read == 0
