"""`pipelines.CogVideoXPipeline` against diffusers' own `CogVideoXPipeline` /
`CogVideoXImageToVideoPipeline`, end to end.

The fixtures (`tests/fixtures/cogvideox_pipeline/`, written by
`scripts/make_cogvideox_pipeline_fixtures.py` with diffusers 0.42.1 and transformers 5.25)
are tiny random pipelines saved by diffusers' `save_pretrained` (T2V in CogVideoX-2B's
form, I2V in CogVideoX-5B-I2V's) and the outputs of diffusers' calls from fixed initial
latents (and, for I2V, diffusers' sampled image latents): the prompt embeddings, the final
latents and the frames (`output_type="np"`). The DPM scheduler draws its noise with
diffusers' generator, so it is checked against `sampling.sample` called directly.
"""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from vidax_eqx import interop, nn, parallel, sampling
from vidax_eqx.pipelines import CogVideoXPipeline


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "cogvideox_pipeline")
T2V, I2V = os.path.join(FIXTURES, "t2v"), os.path.join(FIXTURES, "i2v")
FRAMES_TOL = 2e-4  # the bound on frames in [0, 1], float32
SIZE = dict(height=32, width=48)


def _io(folder):
    with open(os.path.join(folder, "call.json")) as f:
        calls = json.load(f)["calls"]
    return dict(np.load(os.path.join(folder, "io.npz"))), calls


def _relative(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def _call(pipe, io, call, **extra):
    """The pipeline called as diffusers was: the call's keywords, arrays by name (the
    I2V posterior's generator seed left out: `image_latents` stands for its draw)."""
    kwargs = {k: v for k, v in call.items() if k != "generator_seed"}
    for name in ("latents", "image"):
        if name in kwargs:
            kwargs[name] = io[kwargs[name]]
    return pipe(**{**kwargs, **extra}, progress=False)


@pytest.fixture(scope="module")
def t2v():
    return CogVideoXPipeline.from_pretrained(T2V)


@pytest.fixture(scope="module")
def t2v_main(t2v):
    io, calls = _io(T2V)
    return io, _call(t2v, io, calls["main"])


# -- parity with diffusers ---------------------------------------------------------------


def test_t2v_equals_diffusers(t2v, t2v_main):
    io, out = t2v_main
    assert isinstance(t2v.scheduler, sampling.CogVideoXDDIM)
    assert t2v.scheduler.snr_shift_scale == 3.0
    context, negative = t2v.encode_prompt("A panda plays a guitar in a bamboo forest.",
                                          "blurry, low quality", max_sequence_length=16)
    assert _relative(context, io["prompt_embeds"]) < 1e-5
    assert _relative(negative, io["negative_prompt_embeds"]) < 1e-5
    assert out.latents.shape == (1, 3, 4, 4, 6)  # (B, F, C, h, w)
    assert _relative(out.latents, io["final_latents"]) < 1e-5
    assert out.frames.shape == (1, 9, 32, 48, 3) and out.frames.dtype == np.float32
    assert np.abs(out.frames[0] - io["frames"]).max() < FRAMES_TOL
    assert list(out.timings) == ["text", "denoise", "decode"]


def test_t2v_dynamic_cfg_and_batch(t2v):
    """`use_dynamic_cfg`, and a batch of two prompts with a negative prompt each (one
    empty; the second prompt truncated at 16 tokens)."""
    io, calls = _io(T2V)
    out = _call(t2v, io, calls["dynamic"], output_type="latent")
    assert _relative(out.latents, io["dynamic_final_latents"]) < 1e-5
    assert _relative(out.latents, io["final_latents"]) > 1e-2  # the schedule matters
    call = calls["batch2"]
    context, negative = t2v.encode_prompt(call["prompt"], call["negative_prompt"],
                                          max_sequence_length=16)
    assert _relative(context, io["batch2_prompt_embeds"]) < 1e-5
    assert _relative(negative, io["batch2_negative_prompt_embeds"]) < 1e-5
    out = _call(t2v, io, call)
    assert _relative(out.latents, io["batch2_final_latents"]) < 1e-5
    assert out.frames.shape == (2, 1, 32, 48, 3)
    assert np.abs(out.frames - io["batch2_frames"]).max() < FRAMES_TOL


def test_prompt_embeds_and_latent_output(t2v, t2v_main):
    io, _ = t2v_main
    again = t2v(prompt_embeds=io["prompt_embeds"], negative_prompt_embeds=io["negative_prompt_embeds"],
                num_frames=9, num_inference_steps=4, latents=io["latents"], output_type="latent",
                progress=False, **SIZE)
    assert again.frames is None and _relative(again.latents, io["final_latents"]) < 1e-5
    assert list(again.timings) == ["text", "denoise"]


def test_dpm_scheduler_and_videos_per_prompt(t2v):
    """CogVideoXDPM (stochastic) from the folder's `scheduler_dpm/`: two videos of one
    prompt from `seed`, the same as `sampling.sample` with the documented keys."""
    dpm = sampling.scheduler_from_config(os.path.join(T2V, "scheduler_dpm"))
    assert isinstance(dpm, sampling.CogVideoXDPM)
    pipe = CogVideoXPipeline(tokenizer=t2v.tokenizer, text_encoder=t2v.text_encoder,
                             transformer=t2v.transformer, vae=t2v.vae, scheduler=dpm)
    out = pipe("A panda plays a guitar in a bamboo forest.", num_frames=9, num_inference_steps=4,
               num_videos_per_prompt=2, seed=5, max_sequence_length=16, output_type="latent",
               progress=False, **SIZE)
    assert out.latents.shape == (2, 3, 4, 4, 6) and np.isfinite(out.latents).all()
    assert np.abs(out.latents[0] - out.latents[1]).max() > 0.1  # two draws
    context, negative = t2v.encode_prompt("A panda plays a guitar in a bamboo forest.",
                                          num_videos_per_prompt=2, max_sequence_length=16)
    key = jax.random.key(5)
    direct = sampling.sample(t2v.transformer, jax.random.normal(key, out.latents.shape),
                             context, negative_context=negative,
                             guidance=sampling.Guidance(scale=6.0), steps=4, scheduler=dpm,
                             key=jax.random.fold_in(key, 2))
    np.testing.assert_array_equal(out.latents, np.asarray(direct))


@pytest.fixture(scope="module")
def i2v():
    return CogVideoXPipeline.from_pretrained(I2V)


def test_i2v_equals_diffusers(i2v):
    """The image's VAE posterior (diffusers samples it with its generator: the call
    takes diffusers' sampled `image_latents`), the padded condition, the whole call."""
    io, calls = _io(I2V)
    assert i2v.image_conditioned and i2v.vae.scaling_factor == 0.7
    pixels = interop.frames_to_video(io["image"][None], size=(32, 48))  # Lanczos, as PIL
    assert np.abs(pixels[:, 0] - io["image_preprocessed"][0]).max() < 1e-6
    mean = i2v.encode_image(io["image"], 32, 48)
    expected = np.transpose(io["image_mean"], (0, 2, 1, 3, 4)) * 0.7
    assert mean.shape == (1, 1, 4, 4, 6) and _relative(mean, expected) < 1e-5
    key = jax.random.key(3)
    sampled = i2v.encode_image(io["image"], 32, 48, key=key)
    draw = np.asarray(jax.random.normal(key, (4, 1, 4, 6)))
    posterior = io["image_mean"][0] + np.exp(0.5 * io["image_logvar"][0]) * draw
    assert _relative(sampled[0], 0.7 * np.transpose(posterior, (1, 0, 2, 3))) < 1e-5
    condition = i2v.prepare_condition(io["image_latents"][:, :1], 3, 1)
    np.testing.assert_array_equal(condition, io["image_latents"])  # zeros past frame 0
    out = _call(i2v, io, calls["main"], image_latents=io["image_latents"])
    assert _relative(out.latents, io["final_latents"]) < 1e-5
    assert np.abs(out.frames[0] - io["frames"]).max() < FRAMES_TOL
    assert list(out.timings) == ["text", "image", "denoise", "decode"]
    # from `seed`: the image's posterior sampled with fold_in(key(seed), 1)
    seeded = _call(i2v, io, calls["main"], seed=4, output_type="latent")
    latents = i2v.encode_image(io["image"], 32, 48, key=jax.random.fold_in(jax.random.key(4), 1))
    again = _call(i2v, io, calls["main"], image_latents=latents, output_type="latent")
    np.testing.assert_array_equal(seeded.latents, again.latents)

    small = dict(num_frames=9, num_inference_steps=1, max_sequence_length=16, progress=False)
    with pytest.raises(ValueError, match=r"this pipeline's transformer is image-to-video .* "
                                         r"pass `image`"):
        i2v("a", **small, **SIZE)
    with pytest.raises(ValueError, match=r"learned positional embedding .* \(height, width\) = "
                                         r"\(32, 48\); received \(32, 32\)"):
        i2v("a", image=io["image"], height=32, width=32, **small)
    with pytest.raises(ValueError, match=r"`image_latents` must be \(1, 1 or 3, 4, 4, 6\)"):
        i2v("a", image_latents=io["image_latents"][:, :2], **small, **SIZE)


# -- errors ------------------------------------------------------------------------------


def test_bad_calls(t2v):
    io, _ = _io(T2V)
    small = dict(num_inference_steps=1, max_sequence_length=16, progress=False)
    with pytest.raises(ValueError, match=r"`height` must be a multiple of 16 .* received 40\. "
                                         r"Use 32 or 48"):
        t2v("a", height=40, width=48, num_frames=9, **small)
    with pytest.raises(ValueError, match=r"`width` must be a multiple of 16 .* received 8\. "
                                         r"Use 16\.$"):
        t2v("a", height=32, width=8, num_frames=9, **small)
    with pytest.raises(ValueError, match=r"`num_frames` must be 1 \+ a multiple of 8: .* "
                                         r"received 8\. Use 1 or 9"):
        t2v("a", num_frames=8, **small, **SIZE)
    with pytest.raises(ValueError, match=r"an odd number of latent frames .* received 13\. "
                                         r"Use 9 or 17"):
        t2v("a", num_frames=13, **small, **SIZE)
    with pytest.raises(ValueError, match=r"`negative_prompt` must be one str or a list of one "
                                         r"per prompt \(2\); received a list of 3"):
        t2v(["a", "b"], ["x", "y", "z"], num_frames=9, **small, **SIZE)
    with pytest.raises(ValueError, match=r"`prompt` must be a str or a non-empty list"):
        t2v([], num_frames=9, **small, **SIZE)
    with pytest.raises(ValueError, match=r"`image` is for an image-to-video transformer; this "
                                         r"pipeline's is text-to-video"):
        t2v("a", image=io["frames"][0], num_frames=9, **small, **SIZE)
    with pytest.raises(ValueError, match=r"`latents` must be the initial latents .* "
                                         r"\(1, 1, 4, 4, 6\) .* received shape \(1, 3, 4, 4, 6\)"):
        t2v("a", latents=io["latents"], num_frames=1, **small, **SIZE)
    with pytest.raises(ValueError, match=r"pass either `prompt` .* or `prompt_embeds`"):
        t2v("a", prompt_embeds=io["prompt_embeds"], num_frames=9, **small, **SIZE)
    with pytest.raises(ValueError, match=r"`guidance_scale` > 1 needs `negative_prompt_embeds`"):
        t2v(prompt_embeds=io["prompt_embeds"], num_frames=9, **small, **SIZE)
    with pytest.raises(ValueError, match=r"`max_sequence_length` must be the transformer's "
                                         r"max_text_seq_length \(16\).* received 226"):
        t2v("a", num_frames=9, num_inference_steps=1, max_sequence_length=226, progress=False,
            **SIZE)
    with pytest.raises(ValueError, match=r"`prompt_embeds.shape\[1\]` must be the transformer's "
                                         r"max_text_seq_length \(16\).* received 8"):
        t2v(prompt_embeds=io["prompt_embeds"][:, :8], guidance_scale=1.0, num_frames=9,
            **small, **SIZE)
    with pytest.raises(ValueError, match=r"`output_type` must be 'np' or 'latent'"):
        t2v("a", output_type="pil", **small)


def _copy(tmp_path, edit):
    root = tmp_path / "pipe"
    shutil.copytree(T2V, root)
    index = json.loads((root / "model_index.json").read_text())
    edit(root, index)
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def test_bad_folders(tmp_path):
    def no_tokenizer(root, index):
        index["tokenizer"] = [None, None]
        shutil.rmtree(root / "tokenizer")

    pipe = CogVideoXPipeline.from_pretrained(_copy(tmp_path / "a", no_tokenizer))
    with pytest.raises(ValueError, match=r"a prompt needs the pipeline's tokenizer and "
                                         r"text_encoder.*pass `prompt_embeds`"):
        pipe("a", num_frames=9, num_inference_steps=1, max_sequence_length=16, progress=False,
             **SIZE)

    def other_class(root, index):
        index["_class_name"] = "WanPipeline"

    with pytest.raises(ValueError, match=r"must be a pipeline of the classes CogVideoXPipeline, "
                                         r"CogVideoXImageToVideoPipeline .* is a 'WanPipeline'"):
        CogVideoXPipeline.from_pretrained(_copy(tmp_path / "b", other_class))

    def no_vae(root, index):
        index["vae"] = [None, None]

    with pytest.raises(ValueError, match=r"decoding needs the pipeline's `vae/` component"):
        CogVideoXPipeline.from_pretrained(_copy(tmp_path / "c", no_vae))

    for name, value in (("patch_size_t", 2), ("ofs_embed_dim", 512)):
        def version_15(root, index, name=name, value=value):
            path = root / "transformer" / "config.json"
            config = json.loads(path.read_text())
            config[name] = value
            path.write_text(json.dumps(config))

        with pytest.raises(NotImplementedError, match=rf"{name}={value} is not implemented .* "
                                                      r"CogVideoX 1\.5"):
            CogVideoXPipeline.from_pretrained(_copy(tmp_path / name, version_15))


# -- a mesh ------------------------------------------------------------------------------


def test_sharded_equals_one_device(t2v_main):
    """8 devices: ring attention over `sp` (the tiny model's 2 heads go to Megatron over
    `tp`, which leaves none for Ulysses), guidance's two passes over `cfg`, the VAE's
    frames split over two axes: the same latents and frames."""
    io, out = t2v_main
    _, calls = _io(T2V)
    mesh = parallel.make_mesh(1, 2, 2, extra_axes={"cfg": 2})
    config = nn.sharding.ParallelConfig(sequence="ring", tp_axis="tp")
    pipe = CogVideoXPipeline.from_pretrained(T2V, mesh=mesh, parallel=config)
    assert pipe.cfg_axis == "cfg" and pipe.transformer.parallel == config
    sharded = _call(pipe, io, calls["main"])
    assert _relative(sharded.latents, out.latents) < 1e-5
    assert np.abs(sharded.frames - out.frames).max() < 1e-4
    assert np.abs(sharded.frames[0] - io["frames"]).max() < FRAMES_TOL


# -- the command ------------------------------------------------------------------------


def test_command(tmp_path, t2v, capsys):
    """`vidax-generate` on a CogVideoX folder: CogVideoXPipeline, its prompt length (the
    transformer's 16 positions, its `call_defaults`) and frame rate by default; Wan's
    flags refused in one line, exit status 2."""
    from vidax_eqx import generate, interop

    assert t2v.call_defaults.max_sequence_length == 16
    assert t2v.call_defaults.fps == CogVideoXPipeline.defaults.fps == 8
    video, latents = tmp_path / "panda.mp4", tmp_path / "latents.npy"
    args = [T2V, "--prompt", "A panda plays a guitar", "--height", "32", "--width", "48",
            "--num-frames", "9", "--steps", "2", "--seed", "1", "--output", str(video),
            "--latents", str(latents)]
    assert generate.main(args) == 0
    assert capsys.readouterr().out.splitlines() == [str(video)]
    expected = t2v("A panda plays a guitar", height=32, width=48, num_frames=9,
                   num_inference_steps=2, seed=1, progress=False)
    np.testing.assert_allclose(np.load(latents), expected.latents, rtol=0, atol=1e-5)
    assert interop.read_video(video).shape == (9, 32, 48, 3)
    with pytest.raises(SystemExit) as exit:
        generate.main(args + ["--guidance-scale-2", "3"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"vidax-generate: error: --guidance-scale-2 is for Wan pipelines; {T2V!r} is "
        "CogVideoXPipeline.")
