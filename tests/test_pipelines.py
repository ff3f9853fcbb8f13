"""`pipelines.WanPipeline` and the `vidax-generate` command against diffusers' own
`WanPipeline` / `WanImageToVideoPipeline`, end to end.

The fixtures (`tests/fixtures/wan_pipeline/`, written by
`scripts/make_pipeline_fixtures.py` with diffusers 0.42.1 and transformers 5.25) are
tiny random pipelines saved by diffusers' `save_pretrained` (T2V; I2V with a tiny CLIP;
FLF2V's transformer beside it) and the outputs of diffusers' calls from fixed initial
latents: the prompt embeddings, the final latents and the frames (`output_type="np"`).
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from vidax_eqx import models, parallel, pipelines, sampling
from vidax_eqx.pipelines import WanPipeline


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "wan_pipeline")
T2V, I2V = os.path.join(FIXTURES, "t2v"), os.path.join(FIXTURES, "i2v")
FLF2V = os.path.join(FIXTURES, "flf2v")  # the transformer; the rest is I2V's
FRAMES_TOL = 2e-4  # the bound on frames in [0, 1], float32


def _io(folder):
    with open(os.path.join(folder, "call.json")) as f:
        calls = json.load(f)["calls"]
    return dict(np.load(os.path.join(folder, "io.npz"))), calls


def _relative(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def _call(pipe, io, call, **extra):
    """The pipeline called as diffusers was: the call's keywords, arrays by name."""
    kwargs = {k: v for k, v in call.items() if k not in ("scheduler", "pipeline", "transformer")}
    for name in ("latents", "image", "last_image"):
        if name in kwargs:
            kwargs[name] = io[kwargs[name]]
    return pipe(**kwargs, progress=False, **extra)


@pytest.fixture(scope="module")
def t2v():
    return WanPipeline.from_pretrained(T2V)


@pytest.fixture(scope="module")
def t2v_main(t2v):
    io, calls = _io(T2V)
    return io, _call(t2v, io, calls["main"])


# -- parity with diffusers ---------------------------------------------------------------


def test_t2v_equals_diffusers(t2v, t2v_main):
    io, out = t2v_main
    assert isinstance(t2v.scheduler, sampling.UniPC) and t2v.scheduler.shift == 3.0
    context, negative = t2v.encode_prompt(["A cat walks on the grass, 猫が歩く"], "bad quality",
                                          max_sequence_length=32)
    assert _relative(context, io["prompt_embeds"]) < 1e-5
    assert _relative(negative, io["negative_prompt_embeds"]) < 1e-5
    assert _relative(out.latents, io["final_latents"]) < 1e-5
    assert out.frames.shape == (1, 9, 32, 48, 3) and out.frames.dtype == np.float32
    assert np.abs(out.frames[0] - io["frames"]).max() < FRAMES_TOL
    assert list(out.timings) == ["text", "denoise", "decode"]


def test_t2v_euler_scheduler_and_batch(t2v):
    """The scheduler from a FlowMatchEuler `scheduler_config.json` (shift 5), and a batch of
    two prompts with a negative prompt each (diffusers' per-prompt zeroing past each
    prompt's length; the second prompt truncated)."""
    io, calls = _io(T2V)
    scheduler = sampling.scheduler_from_config(os.path.join(T2V, calls["euler"]["scheduler"]))
    assert isinstance(scheduler, sampling.FlowMatchEuler)
    euler = WanPipeline(tokenizer=t2v.tokenizer, text_encoder=t2v.text_encoder,
                        transformer=t2v.transformer, vae=t2v.vae, scheduler=scheduler)
    out = _call(euler, io, calls["euler"], output_type="latent")
    assert _relative(out.latents, io["euler_final_latents"]) < 1e-5
    out = _call(t2v, io, calls["batch2"])
    assert _relative(out.latents, io["batch2_final_latents"]) < 1e-5
    assert np.abs(out.frames - io["batch2_frames"]).max() < FRAMES_TOL


def test_prompt_embeds_and_latent_output(t2v, t2v_main):
    io, out = t2v_main
    again = t2v(prompt_embeds=io["prompt_embeds"], negative_prompt_embeds=io["negative_prompt_embeds"],
                height=32, width=48, num_frames=9, num_inference_steps=4, latents=io["latents"],
                output_type="latent", progress=False)
    assert again.frames is None and _relative(again.latents, io["final_latents"]) < 1e-5
    assert list(again.timings) == ["text", "denoise"]


@pytest.fixture(scope="module")
def i2v():
    return WanPipeline.from_pretrained(I2V)


def test_i2v_equals_diffusers(i2v):
    io, calls = _io(I2V)
    assert _relative(i2v.encode_image(io["image"]), io["image_embeds"]) < 1e-5
    condition = i2v.prepare_condition(io["image"], None, 32, 48, 5, 1)
    assert _relative(condition, io["condition"]) < 1e-5
    out = _call(i2v, io, calls["main"])
    assert _relative(out.latents, io["final_latents"]) < 1e-5
    assert np.abs(out.frames[0] - io["frames"]).max() < FRAMES_TOL
    assert list(out.timings) == ["text", "image", "denoise", "decode"]
    small = dict(height=32, width=48, num_frames=5, num_inference_steps=1, progress=False)
    with pytest.raises(ValueError, match=r"this pipeline's transformer is image-to-video .* "
                                         r"pass `image`"):
        i2v("a", **small)
    with pytest.raises(ValueError, match=r"`last_image` needs an FLF2V transformer"):
        i2v("a", image=io["image"], last_image=io["image"], **small)


def test_flf2v_equals_diffusers(i2v):
    """FLF2V: the first and last frames' CLIP tokens one after the other, the mask's last
    latent frame [0, 0, 0, 1]."""
    io, calls = _io(FLF2V)
    transformer = models.WanTransformer3D.from_pretrained(os.path.join(FLF2V, "transformer"))
    pipe = WanPipeline(tokenizer=i2v.tokenizer, text_encoder=i2v.text_encoder,
                       transformer=transformer, vae=i2v.vae, scheduler=i2v.scheduler,
                       image_encoder=i2v.image_encoder, image_processor=i2v.image_processor)
    features = pipe.encode_image(io["image"], io["last_image"])
    assert _relative(features, io["image_embeds"].reshape(1, -1, features.shape[-1])) < 1e-5
    condition = pipe.prepare_condition(io["image"], io["last_image"], 32, 48, 5, 1)
    assert _relative(condition, io["condition"]) < 1e-5
    out = _call(pipe, io, calls["main"])
    assert _relative(out.latents, io["final_latents"]) < 1e-5
    assert np.abs(out.frames[0] - io["frames"]).max() < FRAMES_TOL


# -- the template ------------------------------------------------------------------------


def test_a_new_family_is_a_subclass(t2v, t2v_main):
    """A family written here, `AbstractVideoPipeline`'s hooks only (Wan's components, its
    own call defaults as class data): the template's call gives WanPipeline's latents bit
    for bit, and the latents reach the decode on the device."""
    seen = []

    class Family(pipelines.AbstractVideoPipeline):
        defaults = pipelines.CallDefaults(height=32, width=48, num_frames=9,
                                          num_inference_steps=4, guidance_scale=5.0,
                                          max_sequence_length=32, fps=8)
        pipeline_classes = ("WanPipeline",)
        clean_prompts = masked_text = True
        latent_layout = "(B, z, F, h, w)"
        transformer_config = property(lambda self: self.transformer.config)
        image_conditioned = property(lambda self: False)

        @classmethod
        def load_components(cls, folder, *, dtype, vae_dtype, encoder_dtype, parallel, mesh):
            return dict(transformer=models.WanTransformer3D.from_pretrained(
                            folder.path("transformer", needed_for="every call")),
                        vae=models.WanVAE.from_pretrained(folder.path("vae", needed_for="x")))

        def check_size(self, height, width, num_frames):
            return (num_frames - 1) // 4 + 1, height // 8, width // 8

        def latent_shape(self, batch, grid):
            return (batch, self.transformer.config.out_channels, *grid)

        def check_image(self, **images):
            assert all(v is None for k, v in images.items() if k != "num_frames")
            return False

        def image_condition(self, **kwargs):
            raise AssertionError("no image stage")

        def decode(self, latents):
            seen.append(latents)
            return t2v.decode(latents)

    io, out = t2v_main
    pipe = Family.from_pretrained(T2V)
    call = _io(T2V)[1]["main"]
    again = pipe(call["prompt"], call["negative_prompt"], latents=io["latents"])  # defaults
    np.testing.assert_array_equal(again.latents, out.latents)
    np.testing.assert_array_equal(again.frames, out.frames)
    assert isinstance(seen[0], jax.Array)  # not fetched to the host before the decode
    assert list(again.timings) == ["text", "denoise", "decode"]


def test_call_defaults_are_class_data(t2v):
    """The defaults a call and `vidax-generate` use are the classes' data."""
    from vidax_eqx import generate

    assert t2v.call_defaults == WanPipeline.defaults == pipelines.CallDefaults(
        height=480, width=832, num_frames=81, num_inference_steps=50, guidance_scale=5.0,
        max_sequence_length=512, fps=16)
    helps = {a.dest: a.help for a in generate.parser()._actions}
    assert helps["num_frames"].startswith("frames (default Wan 81, CogVideoX 49;")


# -- errors ------------------------------------------------------------------------------


def test_bad_calls(t2v):
    io, _ = _io(T2V)
    small = dict(num_inference_steps=1, progress=False)
    with pytest.raises(ValueError, match=r"`height` must be a multiple of 16 .* received 40\. "
                                         r"Use 32 or 48"):
        t2v("a", height=40, width=48, num_frames=9, **small)
    with pytest.raises(ValueError, match=r"`num_frames` must be 1 \+ a multiple of 4 .* "
                                         r"received 8\. Use 5 or 9"):
        t2v("a", height=32, width=48, num_frames=8, **small)
    with pytest.raises(ValueError, match=r"`negative_prompt` must be one str or a list of one "
                                         r"per prompt \(2\); received a list of 3"):
        t2v(["a", "b"], ["x", "y", "z"], height=32, width=48, num_frames=5, **small)
    with pytest.raises(ValueError, match=r"`image` is for an image-to-video transformer; this "
                                         r"pipeline's is text-to-video"):
        t2v("a", image=io["frames"][0], height=32, width=48, num_frames=5, **small)
    with pytest.raises(ValueError, match=r"`latents` must be the initial latents .* "
                                         r"\(1, 16, 2, 4, 6\) .* received shape \(1, 16, 3, 4, 6\)"):
        t2v("a", latents=io["latents"], height=32, width=48, num_frames=5, **small)
    with pytest.raises(ValueError, match=r"pass either `prompt` .* or `prompt_embeds`"):
        t2v("a", prompt_embeds=io["prompt_embeds"], height=32, width=48, num_frames=5, **small)
    with pytest.raises(ValueError, match=r"`output_type` must be 'np' or 'latent'"):
        t2v("a", output_type="pil", **small)


def _copy(tmp_path, edit):
    root = tmp_path / "pipe"
    shutil.copytree(T2V, root)
    index = json.loads((root / "model_index.json").read_text())
    edit(root, index)
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def test_bad_folders(tmp_path, t2v):
    def no_tokenizer(root, index):
        index["tokenizer"] = [None, None]
        shutil.rmtree(root / "tokenizer")

    pipe = WanPipeline.from_pretrained(_copy(tmp_path / "a", no_tokenizer))
    with pytest.raises(ValueError, match=r"a prompt needs the pipeline's tokenizer and "
                                         r"text_encoder.*pass `prompt_embeds`"):
        pipe("a", height=32, width=48, num_frames=5, num_inference_steps=1, progress=False)

    def other_class(root, index):
        index["_class_name"] = "CogVideoXPipeline"

    with pytest.raises(ValueError, match=r"must be a pipeline of the classes WanPipeline, "
                                         r"WanImageToVideoPipeline .* is a 'CogVideoXPipeline'"):
        WanPipeline.from_pretrained(_copy(tmp_path / "b", other_class))

    def no_vae(root, index):
        index["vae"] = [None, None]

    with pytest.raises(ValueError, match=r"decoding needs the pipeline's `vae/` component"):
        WanPipeline.from_pretrained(_copy(tmp_path / "c", no_vae))

    def unknown_scheduler(root, index):
        path = root / "scheduler" / "scheduler_config.json"
        config = json.loads(path.read_text())
        config["_class_name"] = "DDPMScheduler"
        path.write_text(json.dumps(config))

    with pytest.raises(ValueError, match=r"DDPMScheduler"):
        WanPipeline.from_pretrained(_copy(tmp_path / "d", unknown_scheduler))
    with pytest.raises(ValueError, match=r"must be a diffusers pipeline holding model_index"):
        WanPipeline.from_pretrained(os.path.join(T2V, "vae"))


# -- a mesh, the Hub, the command --------------------------------------------------------


def test_sharded_equals_one_device(t2v_main):
    """Ulysses over `sp`, guidance's two passes over `cfg`, the VAE's frames split over
    both: the same frames."""
    io, out = t2v_main
    _, calls = _io(T2V)
    mesh = parallel.make_mesh(1, 2, 1, extra_axes={"cfg": 2}, devices=jax.devices()[:4])
    pipe = WanPipeline.from_pretrained(T2V, mesh=mesh)
    assert pipe.cfg_axis == "cfg" and pipe.transformer.parallel.sequence == "ulysses"
    sharded = _call(pipe, io, calls["main"])
    assert _relative(sharded.latents, out.latents) < 1e-5
    assert np.abs(sharded.frames - out.frames).max() < 1e-4  # measured 3.5e-5
    assert np.abs(sharded.frames[0] - io["frames"]).max() < FRAMES_TOL


REVISION = "0123456789abcdef0123456789abcdef01234567"


def test_hub_repository(tmp_path, monkeypatch, t2v):
    """A Hub id resolved offline from a cache holding the pipeline: the same components."""
    constants = pytest.importorskip("huggingface_hub.constants")
    snapshot = tmp_path / "models--vidax--tiny-wan-pipe" / "snapshots" / REVISION
    shutil.copytree(T2V, snapshot)
    (tmp_path / "models--vidax--tiny-wan-pipe" / "refs").mkdir()
    (tmp_path / "models--vidax--tiny-wan-pipe" / "refs" / "main").write_text(REVISION)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    pipe = WanPipeline.from_pretrained("vidax/tiny-wan-pipe", cache_dir=tmp_path)
    for name in ("text_encoder", "transformer", "vae"):
        for a, b in zip(jax.tree.leaves(getattr(pipe, name)), jax.tree.leaves(getattr(t2v, name))):
            np.testing.assert_array_equal(a, b)
    assert pipe.scheduler == t2v.scheduler
    with pytest.raises(ValueError, match=r"could not be resolved"):
        WanPipeline.from_pretrained("vidax/missing", cache_dir=tmp_path)


def test_without_torch(tmp_path, t2v):
    """In a process where `import torch` (and transformers, diffusers) fails: the T2V and
    I2V parity runs (diffusers' frames from its latents, within 2e-4), then `python -m
    vidax_eqx.generate`'s .mp4 and latents, equal to the same call made here."""
    video, latents = tmp_path / "out.mp4", tmp_path / "latents.npy"
    args = [T2V, "--prompt", "A cat walks on the grass", "--height", "32", "--width", "48",
            "--num-frames", "5", "--steps", "2", "--max-sequence-length", "16", "--seed", "3",
            "--output", str(video), "--latents", str(latents), "--fps", "8"]
    code = f"""
import json, sys
for name in ("torch", "transformers", "diffusers"):
    sys.modules[name] = None  # `import torch` raises
import numpy as np
from vidax_eqx.pipelines import WanPipeline
errors = {{}}
for folder, call in (({T2V!r}, {_io(T2V)[1]["main"]!r}), ({I2V!r}, {_io(I2V)[1]["main"]!r})):
    io = dict(np.load(folder + "/io.npz"))
    arrays = {{k: io[v] for k, v in call.items() if k in ("latents", "image")}}
    out = WanPipeline.from_pretrained(folder)(**dict(call, **arrays), progress=False)
    errors[folder] = float(np.abs(out.frames[0] - io["frames"]).max())
print(json.dumps(errors))
from vidax_eqx.generate import main
main({args!r})
"""
    # Compiled as this module's programs are (conftest's `_fast_compile`): a third faster.
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert all(e < FRAMES_TOL for e in json.loads(run.stdout.splitlines()[0]).values())
    assert run.stdout.splitlines()[1:] == [str(video)], run.stdout  # the path written
    for stage in ("load", "text", "denoise", "decode", "write", "total"):
        assert f"\n{stage}" in "\n" + run.stderr, run.stderr
    expected = t2v("A cat walks on the grass", height=32, width=48, num_frames=5,
                   num_inference_steps=2, max_sequence_length=16, seed=3, progress=False)
    assert _relative(np.load(latents), expected.latents) < 1e-5
    from vidax_eqx import interop

    frames = interop.read_video(video)
    assert frames.shape == (5, 32, 48, 3)
    assert np.abs(frames / 255 - expected.frames[0]).mean() < 0.05  # H.264 is lossy


def test_command_help():
    run = subprocess.run([sys.executable, "-m", "vidax_eqx.generate", "--help"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0
    for flag in ("--prompt", "--image", "--sp", "--tp", "--num-frames", "--guidance-scale"):
        assert flag in run.stdout


def test_save_video(tmp_path):
    with pytest.raises(ValueError, match=r"`frames` must be one video \(F, H, W, 3\)"):
        pipelines.save_video(np.zeros((1, 5, 8, 8, 3)), tmp_path / "x.mp4")
    with pytest.raises(ValueError, match=r"float `frames` must be in \[0, 1\]"):
        pipelines.save_video(np.full((5, 8, 8, 3), 2.0), tmp_path / "x.mp4")


# -- Wan 2.2: two experts, TI2V ----------------------------------------------------------


def test_wan22_experts_folder(tmp_path, t2v):
    """A14B's layout (`transformer_2/`, `boundary_ratio`): `WanExperts`, and the latents
    of `sampling.sample` on them with both guidance scales; two videos per prompt."""
    def experts(root, index):
        shutil.copytree(root / "transformer", root / "transformer_2")
        index["transformer_2"] = ["diffusers", "WanTransformer3DModel"]
        index["boundary_ratio"] = 0.875

    pipe = WanPipeline.from_pretrained(_copy(tmp_path, experts))
    assert isinstance(pipe.transformer, models.WanExperts) and pipe.transformer.boundary == 0.875
    kwargs = dict(height=32, width=48, num_frames=5, num_inference_steps=3, seed=4,
                  guidance_scale=5.0, guidance_scale_2=2.0, max_sequence_length=16,
                  num_videos_per_prompt=2, output_type="latent", progress=False)
    out = pipe("a cat", "blurry", **kwargs)
    context, negative = t2v.encode_prompt("a cat", "blurry", num_videos_per_prompt=2,
                                          max_sequence_length=16)
    noise = jax.random.normal(jax.random.key(4), (2, 16, 2, 4, 6))
    expected = sampling.sample(pipe.transformer, noise, context, negative_context=negative,
                               guidance=sampling.Guidance(scale=5.0, scale_2=2.0), steps=3,
                               scheduler=pipe.scheduler)
    assert out.latents.shape == (2, 16, 2, 4, 6)
    assert _relative(out.latents, np.asarray(expected)) < 1e-6


def test_ti2v_image_is_the_first_latent_frame(tmp_path, t2v):
    """Wan 2.2 TI2V (`expand_timesteps`): the image's normalized latents replace the first
    latent frame and come back unchanged; without an image it is text-to-video."""
    def ti2v(root, index):
        index["expand_timesteps"] = True

    pipe = WanPipeline.from_pretrained(_copy(tmp_path, ti2v))
    io, _ = _io(I2V)
    kwargs = dict(height=32, width=48, num_frames=5, num_inference_steps=2,
                  max_sequence_length=16, output_type="latent", progress=False)
    out = pipe("a cat", image=io["image"], **kwargs)
    condition = pipe.prepare_condition(io["image"], None, 32, 48, 5, 1)
    assert condition.shape == (1, 16, 1, 4, 6)
    np.testing.assert_allclose(out.latents[:, :, :1], condition, rtol=0, atol=1e-6)
    assert pipe("a cat", **kwargs).latents.shape == (1, 16, 2, 4, 6)
