"""The memory plan: where a pipeline's components live on one accelerator (resident, in
host memory and moved in for their stage, on the host CPU, the transformer's blocks
streamed from host memory), chosen before any weight is read, and the same frames
whatever the plan.

On a CPU backend the "accelerator" is the CPU device: host memory is its `pinned_host`
memory kind (the moves and the streamed blocks' copies are real transfers between
memory kinds), and `device_memory` gives the budget a chip would."""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vidax_eqx import generate, interop, models, pipelines, sampling
from vidax_eqx.pipelines import parse_bytes, plan_memory, Size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T2V = os.path.join(ROOT, "tests", "fixtures", "wan_pipeline", "t2v")
WAN = os.path.join(ROOT, "tests", "fixtures", "wan", "t2v", "diffusers")
VIDEO = (32, 48, 5)  # height, width, frames: the calls' and the plans' video
CALL = dict(height=32, width=48, num_frames=5, num_inference_steps=2, guidance_scale=5.0,
            max_sequence_length=16, progress=False)
MiB = 2**20
# The streamed step is another program than the resident one: XLA's default CPU emitters
# give both the same bits here (the elemental ones round them up to 1e-5 apart).
XLA_DEFAULT_EMITTERS = True


# -- the plan, from byte counts ----------------------------------------------------------

SIZES = {"text_encoder": Size(10 * MiB), "transformer": Size(6 * MiB, 4 * MiB, MiB // 2),
         "vae": Size(MiB)}
WORKING = {"text": 2 * MiB, "denoise": 3 * MiB, "decode": 4 * MiB}


def _plan(budget, offload="auto"):
    return plan_memory(SIZES, WORKING, budget=budget, offload=offload, owner="P")


def test_plan_is_the_cheapest_that_fits():
    # Everything fits: resident.
    assert set(_plan(40 * MiB).placement.values()) == {"device"}
    # All resident needs 17 + 4 MiB at the decode; the cheapest move is the transformer's
    # (6 MiB moved in for the denoising, against the text encoder's 10).
    plan = _plan(20 * MiB)
    assert plan.placement == {"text_encoder": "device", "transformer": "host", "vae": "device"}
    assert plan.peak == ("denoise", 10 * MiB + MiB + 6 * MiB + 3 * MiB)
    assert plan.cost == pytest.approx(6 * MiB / 8e9)
    # Every component moved in for its stage (18 MiB moved a call) is cheaper than the
    # text encoder on the host CPU, down to the text stage's 10 + 2 MiB.
    plan = _plan(12 * MiB)
    assert set(plan.placement.values()) == {"host"} and plan.peak == ("text", 12 * MiB)
    # Below that: the text encoder on the host CPU (no device bytes), the rest resident.
    plan = _plan(11 * MiB)
    assert plan.placement == {"text_encoder": "cpu", "transformer": "device", "vae": "device"}
    assert plan.stage_bytes("text") == 7 * MiB  # the resident transformer and VAE only
    # Below the transformer with the VAE's decode: the transformer's blocks streamed, two
    # of them on the device while it denoises; nothing fits below that.
    plan = _plan(7 * MiB)
    assert plan.placement == {"text_encoder": "cpu", "transformer": "streamed", "vae": "device"}
    assert plan.stage_bytes("denoise") == (6 - 4) * MiB + 2 * (MiB // 2) + 3 * MiB + MiB
    with pytest.raises(ValueError, match="the smallest plan needs 7.00 MiB"):
        _plan(5 * MiB)


def test_plan_modes_and_refusal():
    assert set(_plan(None, "model").placement.values()) == {"host"}
    assert _plan(None, "cpu").placement == {"text_encoder": "cpu", "transformer": "device",
                                            "vae": "device"}
    assert _plan(None, "blocks").placement["transformer"] == "streamed"
    with pytest.raises(ValueError, match=r"^P: no memory plan with offload='none' fits 20.00 MiB per "
                       r"device: components text_encoder 10.00 MiB, transformer 6.00 MiB, vae "
                       r"1.00 MiB; stages' working memory text 2.00 MiB, denoise 3.00 MiB, decode "
                       r"4.00 MiB; the smallest plan needs 21.00 MiB \(decode: [^\n]*\)\.$"):
        _plan(20 * MiB, "none")
    with pytest.raises(ValueError, match=r"`offload` must be one of .*received 'disk'"):
        _plan(None, "disk")
    with pytest.raises(ValueError, match=r"streams the transformer's stacked blocks; this "
                       "transformer has none"):
        plan_memory({"transformer": Size(5)}, {}, budget=None, offload="blocks")


def test_plan_fits_the_host_memory():
    # At 12 MiB a device the cheapest plan keeps every component in host memory (17
    # MiB); with 12 MiB of host memory the text encoder alone stays off the device, on
    # the host CPU (10 MiB), the dearer plan that fits both.
    host = lambda budget, h: plan_memory(SIZES, WORKING, budget=budget, host_budget=h, owner="P")  # noqa: E731
    assert set(host(12 * MiB, None).placement.values()) == {"host"}
    plan = host(12 * MiB, 12 * MiB)
    assert plan.placement == {"text_encoder": "cpu", "transformer": "device", "vae": "device"}
    assert plan.host_bytes == 10 * MiB
    # Streamed blocks live in the machine's memory too.
    assert host(7 * MiB, None).host_bytes == 10 * MiB + 4 * MiB
    with pytest.raises(ValueError, match=r"^P: no memory plan with offload='auto' fits "
                       r"7.00 MiB per device and 13.00 MiB of host memory: components "
                       r"text_encoder 10.00 MiB, transformer 6.00 MiB, vae 1.00 MiB; the plans "
                       r"that fit the device keep at least 14.00 MiB off it \(memory plan"):
        host(7 * MiB, 13 * MiB)
    with pytest.raises(ValueError, match="fits any per device and 1.00 MiB of host memory"):
        plan_memory(SIZES, WORKING, budget=None, offload="model", host_budget=MiB)
    # A pipeline checks the machine's memory before reading a weight (the folder's
    # files are never opened: the plan fails on the abstract components).
    with pytest.raises(ValueError, match=r"WanPipeline: no memory plan with offload='model' "
                       r"fits any per device and 1000 B of host memory"):
        pipelines.WanPipeline.from_pretrained(T2V, offload="model", host_memory=1000)
    with pytest.raises(ValueError, match="`host_memory` must be a positive number"):
        pipelines.WanPipeline.from_pretrained(T2V, offload="model", host_memory="lots")


def test_parse_bytes():
    assert parse_bytes(1000) == 1000
    assert parse_bytes("8GB") == 8 * 10**9
    assert parse_bytes("7.5 GiB") == int(7.5 * 2**30)
    assert parse_bytes("512kib") == 512 * 1024
    for bad in ("8XB", "-1GB", "0", "", True, 1.5, -3):
        with pytest.raises(ValueError, match="`device_memory` must be a positive"):
            parse_bytes(bad)


# -- blocks streamed from host memory, in the models' compiled steps ---------------------


def test_streamed_blocks_give_the_resident_outputs():
    wan = models.WanTransformer3D.from_pretrained(WAN)
    streamed = pipelines.stream_blocks(wan)
    with pytest.raises(ValueError, match="stream_blocks: a Linear has no stacked blocks"):
        pipelines.stream_blocks(eqx.nn.Linear(2, 2, key=jax.random.key(0)))
    assert streamed.blocks.self_attn.q.weight.sharding.memory_kind == "pinned_host"
    assert streamed.blocks.self_attn.q.bias.sharding.memory_kind == "device"
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 4, 3, 6, 10)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((2, 7, wan.config.text_dim)), jnp.float32)
    # The traced step sees the matrices in host memory and copies each block's in (a
    # TPU's compiler refuses a matmul on host memory; the CPU's lowering drops the copy).
    jaxpr = eqx.filter_make_jaxpr(lambda m: m(x[0], jnp.float32(500.0), c[0]))(streamed)[0]
    copies = str(jaxpr).count("devices=(MemorySpace.Device,)")
    assert copies == len(pipelines.streamed_leaves(wan)), copies
    # The whole compiled loop: guidance, a text cache, step caching (a slice of the stack).
    run = lambda m: sampling.sample(m, x, c, negative_context=0.3 * c, steps=3, progress=None,  # noqa: E731
                                    caching=sampling.Caching(step=sampling.StaticStepCache()))
    np.testing.assert_array_equal(run(streamed), run(wan))
    # A chunk of a streamed video (the blocks' keys and values kept).
    chunk = eqx.filter_jit(lambda m, cache: m.stream(x[0][:, :1], jnp.float32(500.0), c[0], cache))
    cache = wan.kv_cache(6, 10, max_frames=2)
    (a, ka), (b, kb) = chunk(wan, cache), chunk(streamed, cache)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ka.k, kb.k)


def test_abstract_loading_reads_nothing(tmp_path):
    # The header is all a plan reads: a file whose tensor data is cut off still loads
    # abstractly (every name and shape checked), and fails to load for real.
    import shutil

    folder = tmp_path / "wan"
    shutil.copytree(WAN, folder)
    weights = folder / "diffusion_pytorch_model.safetensors"
    data = weights.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    weights.write_bytes(data[:header + 16])
    with pytest.raises(ValueError):
        models.WanTransformer3D.from_pretrained(folder)
    with interop.loading(lambda module: interop.ABSTRACT):
        abstract = models.WanTransformer3D.from_pretrained(WAN)
    arrays = jax.tree.leaves(abstract, is_leaf=lambda a: isinstance(a, jax.ShapeDtypeStruct))
    arrays = [a for a in arrays if hasattr(a, "shape")]
    assert arrays and all(isinstance(a, jax.ShapeDtypeStruct) for a in arrays)


# -- whole pipelines: every plan, the same frames ----------------------------------------


@pytest.fixture(scope="module")
def resident():
    pipe = pipelines.WanPipeline.from_pretrained(T2V, compile_cache=False)
    assert pipe.placement == {"text_encoder": "device", "transformer": "device", "vae": "device"}
    return pipe(["a cat walks"], **CALL)


@pytest.mark.parametrize("offload", ["model", "cpu", "blocks"])
def test_every_plan_gives_the_resident_frames(resident, offload):
    pipe = pipelines.WanPipeline.from_pretrained(T2V, compile_cache=False, offload=offload)
    expected = {"model": {"host"}, "cpu": {"cpu", "device"}, "blocks": {"streamed", "device"}}
    assert set(pipe.placement.values()) == expected[offload]
    out = pipe(["a cat walks"], **CALL)
    # The same programs on another memory kind or device (model, cpu), or the streamed
    # step (blocks): the same bits.
    np.testing.assert_array_equal(out.frames, resident.frames)
    np.testing.assert_array_equal(out.latents, resident.latents)
    # Between stages the components are where the plan keeps them.
    kinds = {a.sharding.memory_kind for a in jax.tree.leaves(pipe.transformer)
             if isinstance(a, jax.Array)}
    assert kinds == {"model": {"pinned_host"}, "cpu": {"device"},
                     "blocks": {"pinned_host", "device"}}[offload]


def test_budget_plan_is_measured_and_remade_for_a_larger_call(resident):
    # 2 MB: the stages' working memory (the compiler's analysis at 5 x 32 x 48) with the
    # text encoder's 512-token program over it: the encoder goes to the host CPU.
    pipe = pipelines.WanPipeline.from_pretrained(T2V, compile_cache=False, device_memory="2MB",
                                                 plan_video=VIDEO)
    plan = pipe.memory_plan
    assert plan.budget == 2 * 10**6 and plan.video == VIDEO and set(plan.working) == {
        "text", "denoise", "decode"}
    assert plan.placement["text_encoder"] == "cpu" and plan.peak[1] <= plan.budget
    assert plan.describe().startswith("memory plan 'auto', 1.91 MiB per device: text_encoder cpu")
    np.testing.assert_array_equal(pipe(["a cat walks"], **CALL).frames, resident.frames)
    # A call of more frames than the plan was measured for: measured again first.
    pipe(["a cat walks"], **{**CALL, "num_frames": 9, "num_inference_steps": 1})
    assert pipe.memory_plan.video == (32, 48, 9)


def test_command_refuses_an_impossible_plan_before_loading(capsys, monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(interop.SafetensorsFile, "read_slice", no_weights)
    with pytest.raises(SystemExit) as exit_:
        generate.main([T2V, "--prompt", "a cat", "--height", "32", "--width", "48",
                       "--num-frames", "5", "--device-memory", "300KB", "--no-compile-cache"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()  # the load's start line, then the error
    assert len(err) == 2 and err[0].startswith("load ") and err[1].startswith(
        "vidax-generate: error: WanPipeline: no memory plan with offload='auto' fits 292.97 KiB "
        "per device: components text_encoder 114.75 KiB, transformer 89.66 KiB, vae 85.23 KiB;")


def test_image_stage_on_the_host_cpu_matches_diffusers():
    # I2V with the encoders on the host CPU: CLIP's features and the text come over to the
    # device (the VAE's encode runs there), as diffusers' pipeline computes them.
    import json

    folder = os.path.join(ROOT, "tests", "fixtures", "wan_pipeline", "i2v")
    io = dict(np.load(os.path.join(folder, "io.npz")))
    with open(os.path.join(folder, "call.json")) as f:
        call = json.load(f)["calls"]["main"]
    kwargs = {k: io[v] if k in ("latents", "image") else v for k, v in call.items()
              if k not in ("scheduler", "pipeline", "transformer")}
    pipe = pipelines.WanPipeline.from_pretrained(folder, compile_cache=False, offload="cpu")
    assert pipe.placement == {"text_encoder": "cpu", "image_encoder": "cpu", "transformer": "device",
                              "vae": "device"}
    out = pipe(**kwargs, progress=False)
    assert np.abs(out.latents - io["final_latents"]).max() / np.abs(io["final_latents"]).max() < 1e-5
    assert np.abs(out.frames[0] - io["frames"]).max() < 2e-4


def test_stream_with_components_in_host_memory():
    # Streaming alternates the transformer and the VAE chunk by chunk: both are moved in
    # for the whole stream and back to host memory after it.
    kwargs = dict(height=32, width=48, num_frames=5, chunk_frames=1, max_sequence_length=16)
    resident = pipelines.WanPipeline.from_pretrained(T2V, compile_cache=False)
    expected = [c.latents for c in resident.stream(["a cat"], output_type="latent", **kwargs)]
    pipe = pipelines.WanPipeline.from_pretrained(T2V, compile_cache=False, offload="model")
    got = [c.latents for c in pipe.stream(["a cat"], output_type="latent", **kwargs)]
    assert len(got) == len(expected) == 2
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    kinds = {a.sharding.memory_kind for a in jax.tree.leaves(pipe.transformer) if isinstance(a, jax.Array)}
    assert kinds == {"pinned_host"}


def test_two_experts_streamed(tmp_path):
    # Wan 2.2 A14B's layout: both experts' weight matrices in host memory, the step's
    # switch streams the chosen expert's blocks only; the same latents as resident.
    import json
    import shutil

    root = tmp_path / "a14b"
    shutil.copytree(T2V, root)
    shutil.copytree(root / "transformer", root / "transformer_2")
    index = json.loads((root / "model_index.json").read_text())
    index.update(transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=0.875)
    (root / "model_index.json").write_text(json.dumps(index))
    kwargs = dict(height=32, width=48, num_frames=5, num_inference_steps=3, seed=4,
                  guidance_scale=5.0, guidance_scale_2=2.0, max_sequence_length=16,
                  output_type="latent", progress=False)
    expected = pipelines.WanPipeline.from_pretrained(root, compile_cache=False)("a cat", **kwargs)
    pipe = pipelines.WanPipeline.from_pretrained(root, compile_cache=False, offload="blocks")
    size = pipe.memory_plan.sizes["transformer"]
    assert pipe.placement["transformer"] == "streamed" and size.blocks == 2 * size.block * 2
    np.testing.assert_array_equal(pipe("a cat", **kwargs).latents, expected.latents)
