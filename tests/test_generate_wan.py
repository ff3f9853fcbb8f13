"""`examples/generate_wan.py`: a checkpoint directory and text embeddings in, the latents of
`sampling.sample` out (and, with torch, a prompt encoded by the pipeline's UMT5 and the
latents decoded by its VAE to an .mp4).

The command line runs once in a subprocess (as a user runs it); the other cases call the
example's `main(argv)` in this process, whose JAX already has its 8 CPU devices. Every
case checks the written latents against `sampling.sample` called here on the same model,
noise and embeddings. The torch cases build a tiny UMT5, tokenizer and `AutoencoderKLWan`
from small configs, and are skipped where torch, transformers or diffusers is missing.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from vidax_eqx import models, sampling


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "generate_wan.py")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "wan")
TEXT_DIM = 32  # the fixtures' text_dim
# --num-frames 5 --height 32 --width 48 under Wan 2.1's VAE (4, 8): F = 2, H = 4, W = 6
VIDEO = ["--num-frames", "5", "--height", "32", "--width", "48"]
# Compiled as XLA does by default (conftest's `_fast_compile` turns LLVM's optimizations
# off elsewhere), as the command line's process compiles: its latents are compared bit for
# bit with `sampling.sample` here, and code generated without them gives other bits.
XLA_OPTIMIZED = True


def _example():
    spec = importlib.util.spec_from_file_location("generate_wan", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _example()


def _pipeline(tmp_path, transformer="t2v"):
    """A diffusers pipeline directory: the fixture's transformer and a model_index.json."""
    root = tmp_path / "pipeline"
    shutil.copytree(os.path.join(FIXTURES, transformer, "diffusers"), root / "transformer")
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"]}))
    return root


def _embeddings(tmp_path, batch=None, length=7, seed=0):
    rng = np.random.default_rng(seed)
    shape = (length, TEXT_DIM) if batch is None else (batch, length, TEXT_DIM)
    tensors = {"prompt_embeds": rng.standard_normal(shape).astype(np.float32),
               "negative_prompt_embeds": rng.standard_normal(shape).astype(np.float32)}
    path = tmp_path / "embeddings.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def _batched(a):
    return jnp.asarray(a if a.ndim == 3 else a[None])


def _expected(model, tensors, shape, *, seed=0, steps=2, scheduler=None,
              guidance=sampling.Guidance(scale=5.0), **kwargs):
    context = _batched(tensors["prompt_embeds"])
    noise = jax.random.normal(jax.random.key(seed), (context.shape[0], *shape), jnp.float32)
    return np.asarray(sampling.sample(
        model, noise, context, negative_context=_batched(tensors["negative_prompt_embeds"]),
        guidance=guidance, steps=steps,
        scheduler=scheduler or sampling.UniPC(shift=3.0), **kwargs))


def test_help():
    proc = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr
    for flag in ("--embeddings", "--prompt", "--guidance-scale-2", "--sp", "--tp", "--cfg",
                 "--num-frames", "--latent-shape", "--output", "--latents", "--no-compile-cache"):
        assert flag in proc.stdout
    assert proc.stderr == ""


@pytest.mark.slow  # a fresh JAX in a subprocess: ~12 s of its ~25 s on 2 cores
def test_command_line_pipeline_equals_sample(tmp_path):
    """The CLI on a pipeline directory: its transformer/, 2 UniPC steps, guidance 5; with
    the example's old flags (`--checkpoint`, `--frames`, `--output FILE.safetensors`),
    each with a deprecation message, and the path written on stdout."""
    root = _pipeline(tmp_path)
    embeddings, tensors = _embeddings(tmp_path)
    out = tmp_path / "latents.safetensors"
    # one CPU device (this process's 8 simulated ones make XLA's CPU programs slower)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags), "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--checkpoint", str(root), "--embeddings", str(embeddings),
         "--steps", "2", "--seed", "3", "--frames", "5", "--height", "32", "--width", "48",
         "--output", str(out)],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.splitlines() == [str(out)], proc.stdout
    for old, new in (("--checkpoint DIR", "the positional MODEL"), ("--frames", "--num-frames"),
                     ("--output FILE.safetensors / .npy (the latents)", "--latents FILE")):
        assert f"{old} is deprecated and will be removed in vidax_eqx 0.3.0: use {new}" in \
            proc.stderr, proc.stderr
    latents = load_file(str(out))["latents"]
    model = models.WanTransformer3D.from_pretrained(root / "transformer")
    np.testing.assert_array_equal(latents, _expected(model, tensors, (4, 2, 4, 6), seed=3))


def test_a14b_euler_batch_npy(tmp_path, example):
    """Wan 2.2 A14B (two experts, guidance_scale_2), Euler, a batch of 2, .npy out."""
    root = os.path.join(FIXTURES, "a14b", "diffusers")
    embeddings, tensors = _embeddings(tmp_path, batch=2, length=5)
    out = tmp_path / "latents.npy"
    assert example.main([root, "--embeddings", str(embeddings), "--steps", "3",
                         "--scheduler", "euler", "--shift", "5", "--guidance-scale", "4",
                         "--guidance-scale-2", "2", "--latent-shape", "4", "2", "4", "4",
                         "--latents", str(out)]) == 0
    model = models.WanExperts.from_pretrained(root)
    expected = _expected(model, tensors, (4, 2, 4, 4), steps=3,
                         guidance=sampling.Guidance(scale=4.0, scale_2=2.0),
                         scheduler=sampling.FlowMatchEuler(shift=5.0))
    np.testing.assert_array_equal(np.load(out), expected)


def test_transformer_directory_sharded(tmp_path, example, capsys):
    """A bare transformer directory on a mesh sp=2 x tp=2 x cfg=2 equals one device."""
    root = os.path.join(FIXTURES, "t2v", "diffusers")
    embeddings, tensors = _embeddings(tmp_path)
    out = tmp_path / "latents.safetensors"
    example.main([root, "--embeddings", str(embeddings), "--steps", "2", *VIDEO,
                  "--sp", "2", "--tp", "2", "--cfg", "2", "--latents", str(out)])
    captured = capsys.readouterr()
    assert "mesh {'dp': 1, 'sp': 2, 'cfg': 2, 'tp': 2}" in captured.err
    assert captured.out.splitlines() == [str(out)]
    model = models.WanTransformer3D.from_pretrained(root)
    expected = _expected(model, tensors, (4, 2, 4, 6))
    np.testing.assert_allclose(load_file(str(out))["latents"], expected, rtol=0, atol=1e-5)


def test_step_cache(tmp_path, example, capsys):
    """`--static-step-cache 2` (warmup 1) on 4 steps: step 2 reuses, as in `sample`."""
    root = os.path.join(FIXTURES, "t2v", "diffusers")
    embeddings, tensors = _embeddings(tmp_path)
    out = tmp_path / "latents.npy"
    example.main([root, "--embeddings", str(embeddings), "--steps", "4",
                  "--scheduler", "euler", *VIDEO, "--static-step-cache", "2",
                  "--latents", str(out)])
    assert "1 of 4 steps reused the block stack's residual: [2]" in capsys.readouterr().err
    model = models.WanTransformer3D.from_pretrained(root)
    rule = sampling.StaticStepCache(interval=2, warmup=1)
    expected = _expected(model, tensors, (4, 2, 4, 6), steps=4,
                         caching=sampling.Caching(step=rule),
                         scheduler=sampling.FlowMatchEuler(shift=3.0))
    np.testing.assert_array_equal(np.load(out), expected)


def test_latent_shape_from_vae_config(example):
    wan21 = type("C", (), {"in_channels": 16})()
    assert example.latent_shape(wan21, None, 81, 480, 832) == (16, 21, 60, 104)
    ti2v = type("C", (), {"in_channels": 48})()
    assert example.latent_shape(ti2v, None, 121, 704, 1280) == (48, 31, 44, 80)
    vae = {"scale_factor_temporal": 4, "scale_factor_spatial": 16}
    assert example.latent_shape(ti2v, vae, 5, 32, 32) == (48, 2, 2, 2)


def test_bad_inputs(tmp_path, example):
    path = tmp_path / "bad.safetensors"
    save_file({"embeds": np.zeros((3, TEXT_DIM), np.float32)}, str(path))
    with pytest.raises(ValueError, match="must hold 'prompt_embeds'"):
        example.read_embeddings(str(path))
    save_file({"prompt_embeds": np.zeros((TEXT_DIM,), np.float32)}, str(path))
    with pytest.raises(ValueError, match=r"\(L, text_dim\) or \(B, L, text_dim\)"):
        example.read_embeddings(str(path))
    with pytest.raises(SystemExit):  # neither --embeddings nor --prompt
        example.parse_args(["x"])
    with pytest.raises(SystemExit):
        example.parse_args(["x", "--embeddings", "e", "--mesh", "sp=4,cfg=3"])
    with pytest.raises(SystemExit):
        example.parse_args(["x", "--embeddings", "e", "--cfg", "3"])
    with pytest.raises(SystemExit):
        example.parse_args(["x", "--checkpoint", "y", "--embeddings", "e"])


# -- with torch: the prompt through the pipeline's UMT5, the latents through its VAE -----


def _tiny_text_encoder(root):
    """A tiny UMT5 encoder and a word-level fast tokenizer, saved as a pipeline's."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    torch.manual_seed(0)
    config = transformers.UMT5Config(vocab_size=64, d_model=TEXT_DIM, d_kv=8, d_ff=64,
                                     num_layers=2, num_heads=4, relative_attention_num_buckets=8)
    transformers.UMT5EncoderModel(config).eval().save_pretrained(root / "text_encoder")
    words = ["<pad>", "</s>", "<unk>", *"a cat walks on the grass slowly dog runs".split()]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(root / "tokenizer")


def _tiny_vae(root):
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0])
    vae.eval().save_pretrained(root / "vae")
    return vae


def test_prompt_encoded_as_diffusers_does(tmp_path, example):
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from diffusers import WanPipeline
    from transformers import AutoTokenizer, UMT5EncoderModel
    root = _pipeline(tmp_path)
    _tiny_text_encoder(root)
    out = tmp_path / "latents.safetensors"
    prompt = "A  cat walks on the &amp; grass "
    example.main([str(root), "--prompt", prompt, "--negative-prompt", "dog",
                  "--steps", "2", *VIDEO, "--latents", str(out)])

    # diffusers' own encoding, its method called on the pieces it reads
    class Pipe:
        tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
        text_encoder = UMT5EncoderModel.from_pretrained(root / "text_encoder")
        _execution_device = torch.device("cpu")

    def encode(text):
        embeds = WanPipeline._get_t5_prompt_embeds(Pipe(), text, max_sequence_length=512,
                                                   dtype=torch.float32)
        return embeds.detach().numpy()

    tensors = {"prompt_embeds": encode(prompt), "negative_prompt_embeds": encode("dog")}
    assert tensors["prompt_embeds"].shape == (1, 512, TEXT_DIM)
    model = models.WanTransformer3D.from_pretrained(root / "transformer")
    expected = _expected(model, tensors, (4, 2, 4, 6))
    np.testing.assert_allclose(load_file(str(out))["latents"], expected, rtol=0, atol=1e-5)


def test_video_decoded_as_diffusers_does(tmp_path, example):
    torch = pytest.importorskip("torch")
    pytest.importorskip("imageio")
    pytest.importorskip("imageio_ffmpeg")
    import imageio
    from diffusers.video_processor import VideoProcessor
    root = _pipeline(tmp_path)
    vae = _tiny_vae(root)
    embeddings, _ = _embeddings(tmp_path)
    out, video = tmp_path / "latents.safetensors", tmp_path / "out.mp4"
    example.main([str(root), "--embeddings", str(embeddings), "--steps", "2",
                  *VIDEO, "--latents", str(out), "--output", str(video), "--fps", "8"])
    latents = load_file(str(out))["latents"]
    frames = example.decode_video(str(root / "vae"), latents)
    assert frames.shape == (1, 5, 32, 48, 3) and frames.dtype == np.uint8

    # WanPipeline.__call__'s decode, as written there
    z = torch.from_numpy(latents).to(vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
    std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    with torch.no_grad():
        decoded = vae.decode(z / std + mean, return_dict=False)[0]
    reference = VideoProcessor(vae_scale_factor=8).postprocess_video(decoded, output_type="np")
    assert np.abs(frames / 255.0 - reference).max() <= 0.5 / 255 + 1e-6

    read = np.stack(imageio.mimread(str(video)))
    assert read.shape == (5, 32, 48, 3)


def test_prompt_without_torch(tmp_path, example, monkeypatch):
    """`--prompt` through the library's tokenizer and UMT5 (no torch): the latents of
    `pipelines.WanPipeline` on the same prompt, noise and scheduler."""
    from vidax_eqx import pipelines

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` would raise
    root = os.path.join(ROOT, "tests", "fixtures", "wan_pipeline", "t2v")
    out = tmp_path / "latents.npy"
    example.main([root, "--prompt", "A  cat &amp; a dog", "--negative-prompt",
                  "blurry", "--steps", "2", "--max-sequence-length", "16", *VIDEO,
                  "--latents", str(out)])
    pipe = pipelines.WanPipeline.from_pretrained(root)
    expected = pipe("A  cat &amp; a dog", "blurry", height=32, width=48, num_frames=5,
                    num_inference_steps=2, max_sequence_length=16, seed=0,
                    output_type="latent", progress=False).latents
    np.testing.assert_allclose(np.load(out), expected, rtol=0, atol=1e-5)
