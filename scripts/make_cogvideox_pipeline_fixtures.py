"""Writes the CogVideoX pipeline parity fixtures of tests/fixtures/cogvideox_pipeline/:
tiny random diffusers `CogVideoXPipeline` / `CogVideoXImageToVideoPipeline` directories
(`save_pretrained`, float32 safetensors) and what diffusers computes with them end to
end, from the prompt strings (and the image) to the decoded frames.

Run by hand, with torch, transformers, diffusers, accelerate and pillow installed (the
test suite never needs them); written with torch 2.13.0 (CPU), diffusers 0.42.1,
transformers 5.25.0, tokenizers 0.23.3, accelerate 1.16.0 and pillow 13.0.0
(`call.json` records the versions):

    pip install torch diffusers transformers accelerate pillow
    python scripts/make_cogvideox_pipeline_fixtures.py

The output is byte-identical from run to run.

- `t2v/`: a `CogVideoXPipeline` directory (tokenizer: the committed
    tests/fixtures/tokenizer/t5/ tokenizer; a 2-layer T5 v1.1 `T5EncoderModel` of width
    16; a CogVideoX-2B-style `CogVideoXTransformer3DModel`: the 3D sin-cos positional
    embedding, 2 layers of 2 heads of 16, 4 -> 4 channels, training size 6 x 8 latents
    and 9 frames (so that the calls' 4 x 6 grid makes diffusers recompute the
    embedding), max_text_seq_length 16; an `AutoencoderKLCogVideoX` of width 4 with
    CogVideoX-2B's `scaling_factor` 1.15258426; `CogVideoXDDIMScheduler` in
    CogVideoX-2B's shipped configuration), and `scheduler_dpm/`, the
    `CogVideoXDPMScheduler` CogVideoX's demos swap in
    (`CogVideoXDPMScheduler.from_config(pipe.scheduler.config)`).
- `i2v/`: a `CogVideoXImageToVideoPipeline` directory: the same tokenizer, text encoder
    and scheduler, the same VAE with CogVideoX-5B's `scaling_factor` 0.7, and a
    CogVideoX-5B-I2V-style transformer (3D RoPE and the learned positional embedding,
    8 -> 4 channels) whose training size is the call's (4 x 6 latents, 9 frames), as
    diffusers requires of a learned embedding.

`<name>/call.json` lists each call's keyword arguments (arrays named by their key in
`<name>/io.npz`); `io.npz` holds each call's inputs, what the pipeline's own call
computed inside (`encode_prompt`'s outputs, `prepare_latents`' image latents), the
latents after every step, the final latents (`output_type="latent"`) and the frames
(`output_type="np"`). See tests/fixtures/cogvideox_pipeline/README.md for the keys.

diffusers' CogVideoX image-to-video pipeline samples the image's latents from the VAE's
posterior with the call's `generator` (`retrieve_latents`, `sample_mode="sample"`): the
i2v call passes `generator=torch.Generator().manual_seed(7)`, and `io.npz` holds the
posterior's mean and log-variance beside the sampled, scaled, zero-padded
`image_latents`.

Every parameter is moved off its initialisation (seeded; the VAE decoder's last
convolution small enough that few pixels reach the [-1, 1] clamp: the script prints the
fraction of frame values at 0 or 1).
"""

import copy
import importlib.metadata
import json
import pathlib
import shutil

import diffusers
import numpy as np
import PIL.Image
import torch
import transformers
from diffusers import (
    AutoencoderKLCogVideoX,
    CogVideoXDDIMScheduler,
    CogVideoXDPMScheduler,
    CogVideoXImageToVideoPipeline,
    CogVideoXPipeline,
    CogVideoXTransformer3DModel,
)
from transformers import AutoTokenizer, T5Config, T5EncoderModel


ROOT = pathlib.Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizer" / "t5"
OUT = ROOT / "tests" / "fixtures" / "cogvideox_pipeline"

# google/t5-v1_1-xxl's encoder in miniature (CogVideoX's: 24 layers of 4096, 64 heads of
# 64, d_ff 10240, 32 buckets, max distance 128, gated gelu_new).
TEXT_ENCODER = dict(d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                    relative_attention_num_buckets=32, relative_attention_max_distance=128,
                    feed_forward_proj="gated-gelu", dropout_rate=0.0, layer_norm_epsilon=1e-6,
                    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                    tie_word_embeddings=False)
TEXT_LEN = 16  # max_text_seq_length (CogVideoX: 226)
TRANSFORMER = dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                   time_embed_dim=16, text_embed_dim=16, num_layers=2, patch_size=2,
                   sample_height=6, sample_width=8, sample_frames=9,
                   max_text_seq_length=TEXT_LEN)
I2V_TRANSFORMER = dict(TRANSFORMER, in_channels=8, sample_height=4, sample_width=6,
                       use_rotary_positional_embeddings=True,
                       use_learned_positional_embeddings=True)
VAE = dict(block_out_channels=[4, 4, 4, 4], latent_channels=4, layers_per_block=1,
           norm_num_groups=2, sample_height=32, sample_width=48)
SCALING_2B, SCALING_5B = 1.15258426, 0.7
# CogVideoX-2B's scheduler/scheduler_config.json.
SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                 beta_schedule="scaled_linear", clip_sample=False,
                 prediction_type="v_prediction", rescale_betas_zero_snr=True,
                 set_alpha_to_one=True, snr_shift_scale=3.0, steps_offset=0,
                 timestep_spacing="trailing")

SUMMARY = []  # printed at the end

HEIGHT, WIDTH = 32, 48
COMMON = dict(height=HEIGHT, width=WIDTH, num_inference_steps=4, guidance_scale=6.0,
              max_sequence_length=TEXT_LEN)


# ---------------------------------------------------------------- components


def randomize_t5(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # RMS norm scales
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:  # (out, in) and the relative bias (buckets, heads)
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)


def build_transformer(config, seed):
    torch.manual_seed(seed)
    model = CogVideoXTransformer3DModel(**config).eval()
    with torch.no_grad():  # as scripts/make_cogvideox_fixtures.py
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        if config.get("use_learned_positional_embeddings"):
            pos = model.patch_embed.pos_embedding  # a saved buffer, not a parameter
            pos.add_(0.1 * torch.randn_like(pos))
    return model


def build_vae(seed, scaling_factor):
    torch.manual_seed(seed)
    model = AutoencoderKLCogVideoX(**VAE, scaling_factor=scaling_factor).eval()
    with torch.no_grad():  # as scripts/make_cogvideox_vae_fixtures.py
        for name, p in model.named_parameters():
            if p.ndim == 1 and name.endswith("weight"):  # GroupNorm scales
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "conv_y" in name and name.endswith("bias"):  # the decoder's SpatialNorm3D
                p.copy_(1 + 0.1 * torch.randn_like(p))  # scales: about 1
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
            if "conv_y" in name or "conv_b" in name:  # the scales and shifts vary little
                p.mul_(0.3) if name.endswith("weight") else None
        model.decoder.conv_out.conv.weight.mul_(0.15)
        # a trained VAE's posterior is narrow: log-variances about -6 (std 0.05)
        model.encoder.conv_out.conv.bias[VAE["latent_channels"]:].add_(-6.0)
    return model


def build_components():
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    text_encoder = T5EncoderModel(T5Config(vocab_size=len(tokenizer), **TEXT_ENCODER)).eval()
    randomize_t5(text_encoder, seed=1)
    return dict(tokenizer=tokenizer, text_encoder=text_encoder,
                vae_2b=build_vae(2, SCALING_2B), vae_5b=build_vae(2, SCALING_5B),
                t2v=build_transformer(TRANSFORMER, seed=3),
                i2v=build_transformer(I2V_TRANSFORMER, seed=4))


# ---------------------------------------------------------------- inputs


def make_image(height, width, seed):
    """A smooth gradient plus a seeded pattern, uint8 (H, W, 3)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    r = 255 * x / (width - 1)
    g = 255 * y / (height - 1)
    b = 128 + 80 * np.sin(2 * np.pi * (x / 17 + y / 11 + rng.random()))
    img = np.stack([r, g, b], -1) + rng.normal(0, 12, (height, width, 3))
    blocks = rng.integers(0, 2, (height // 8 + 1, width // 8 + 1, 1)) * 40 - 20
    img = img + np.kron(blocks, np.ones((8, 8, 1)))[:height, :width]
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def noise(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def latent_shape(batch, num_frames):
    """diffusers' CogVideoX layout (B, F, C, h, w)."""
    return (batch, (num_frames - 1) // 4 + 1, VAE["latent_channels"], HEIGHT // 8, WIDTH // 8)


# ---------------------------------------------------------------- running


class Recorder:
    """Wraps a pipeline's methods on the instance to record what its call computed."""

    def __init__(self, pipe, methods):
        self.records = {}
        for name in methods:
            original = getattr(pipe, name)

            def wrapped(*args, _original=original, _name=name, **kwargs):
                out = _original(*args, **kwargs)
                self.records.setdefault(_name, []).append(out)
                return out

            setattr(pipe, name, wrapped)


def _call_kwargs(kwargs, arrays, dtype=torch.float32):
    call = {k: (torch.from_numpy(arrays[v]).to(dtype) if k == "latents" else v)
            for k, v in kwargs.items() if k != "generator_seed"}
    if "image" in call:
        call["image"] = PIL.Image.fromarray(arrays[call["image"]])
    if "generator_seed" in kwargs:  # the I2V posterior sample's generator
        call["generator"] = torch.Generator().manual_seed(kwargs["generator_seed"])
    return call


def run(pipe, methods, kwargs, arrays, output_types=("latent", "np")):
    """Calls `pipe` once per output type; returns (final latents, frames or None,
    records, steps)."""
    results = {}
    for output_type in output_types:
        call = _call_kwargs(kwargs, arrays)
        steps = []

        def on_step(pipe_, i, t, cb):
            steps.append(cb["latents"].detach().clone())
            return {}

        recorder = Recorder(pipe, methods)
        with torch.no_grad():
            out = pipe(**call, output_type=output_type, callback_on_step_end=on_step,
                       callback_on_step_end_tensor_inputs=["latents"]).frames
        for name in methods:  # back to the class methods
            delattr(pipe, name)
        results[output_type] = (out, recorder.records, torch.stack(steps))
    latents, records, steps = results["latent"]
    frames = None
    if "np" in results:
        frames, _, steps_np = results["np"]
        assert torch.equal(steps, steps_np), "two identical calls differ"
        frames = np.asarray(frames)
    return latents.numpy(), frames, records, steps.numpy()


def float64_gap(pipe, kwargs, arrays, latents, frames):
    """How far float32 rounding moves the outputs: the same call on a float64 copy (the
    I2V posterior sampled with the float32 call's standard normal draw: a float64
    generator draw differs)."""
    pipe64 = copy.deepcopy(pipe).to(torch.float64)
    module = diffusers.pipelines.cogvideo.pipeline_cogvideox_image2video
    original = module.retrieve_latents

    def float32_draw(encoder_output, generator=None, sample_mode="sample"):
        dist = encoder_output.latent_dist
        draw = torch.randn(dist.mean.shape, generator=generator, dtype=torch.float32)
        return dist.mean + dist.std * draw.to(dist.mean.dtype)

    module.retrieve_latents = float32_draw
    try:
        with torch.no_grad():
            lat64 = pipe64(**_call_kwargs(kwargs, arrays, torch.float64),
                           output_type="latent").frames.double().numpy()
            frames64 = pipe64(**_call_kwargs(kwargs, arrays, torch.float64),
                              output_type="np").frames
    finally:
        module.retrieve_latents = original
    return float(np.abs(lat64 - latents).max()), float(np.abs(frames64 - frames).max())


def clipped(frames):
    return float(np.mean((frames <= 0.0) | (frames >= 1.0)))


def write(folder, arrays, calls, report):
    np.savez_compressed(folder / "io.npz", **arrays)
    versions = {m: importlib.metadata.version(m) for m in
                ("torch", "diffusers", "transformers", "tokenizers", "accelerate", "pillow",
                 "safetensors", "numpy")}
    (folder / "call.json").write_text(
        json.dumps({"versions": versions, "calls": calls}, ensure_ascii=False, indent=1) + "\n")
    for name, frames in report.items():
        SUMMARY.append(f"{folder.name}/{name}: frames {frames.shape}, {clipped(frames):.4%} of "
                       f"values at 0 or 1, range [{frames.min():.3f}, {frames.max():.3f}], "
                       f"mean {frames.mean():.3f}, std {frames.std():.3f}")


def make_t2v(c):
    folder = OUT / "t2v"
    pipe = CogVideoXPipeline(tokenizer=c["tokenizer"], text_encoder=c["text_encoder"],
                             vae=c["vae_2b"], transformer=c["t2v"],
                             scheduler=CogVideoXDDIMScheduler(**SCHEDULER))
    pipe.save_pretrained(folder, safe_serialization=True)
    CogVideoXDPMScheduler.from_config(pipe.scheduler.config).save_pretrained(
        folder / "scheduler_dpm")
    pipe = CogVideoXPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    methods = ["encode_prompt"]

    arrays, calls, report = {}, {}, {}
    # 1. one prompt with a negative prompt, DDIM, 9 frames (3 latent frames)
    arrays["latents"] = noise(latent_shape(1, 9), seed=100)
    kwargs = dict(prompt="A panda plays a guitar in a bamboo forest.",
                  negative_prompt="blurry, low quality", num_frames=9, latents="latents",
                  **COMMON)
    calls["main"] = kwargs
    latents, frames, rec, steps = run(pipe, methods, kwargs, arrays)
    arrays["prompt_embeds"], arrays["negative_prompt_embeds"] = (
        t.numpy() for t in rec["encode_prompt"][0])
    arrays.update(final_latents=latents, step_latents=steps, frames=frames[0],
                  timesteps=pipe.scheduler.timesteps.numpy())
    report["main"] = frames[0]
    SUMMARY.append("t2v/main: max |float64 - float32| of the final latents %.2e, of the "
                   "frames %.2e" % float64_gap(pipe, kwargs, arrays, latents, frames))
    with torch.no_grad():  # the same, outside the call
        direct = pipe.encode_prompt(kwargs["prompt"], kwargs["negative_prompt"],
                                    max_sequence_length=TEXT_LEN)
    assert all(torch.equal(a, b) for a, b in zip(direct, rec["encode_prompt"][0]))

    # 2. the same with use_dynamic_cfg (latents only)
    calls["dynamic"] = dict(kwargs, use_dynamic_cfg=True)
    latents, _, _, steps = run(pipe, methods, calls["dynamic"], arrays, ("latent",))
    arrays.update(dynamic_final_latents=latents, dynamic_step_latents=steps)

    # 3. two prompts (one truncated at 16 tokens), a negative prompt each (one empty),
    # one frame (a single latent frame) keeps the batch's frames small
    arrays["batch2_latents"] = noise(latent_shape(2, 1), seed=101)
    kwargs = dict(prompt=["A dog runs across the green field.",
                          "An astronaut rides a horse on the moon, then a robot walks through "
                          "a futuristic city while fireworks explode over the river."],
                  negative_prompt=["", "Worst quality, blurry, static."], num_frames=1,
                  latents="batch2_latents", **COMMON)
    calls["batch2"] = kwargs
    latents, frames, rec, steps = run(pipe, methods, kwargs, arrays)
    arrays["batch2_prompt_embeds"], arrays["batch2_negative_prompt_embeds"] = (
        t.numpy() for t in rec["encode_prompt"][0])
    arrays.update(batch2_final_latents=latents, batch2_step_latents=steps,
                  batch2_frames=frames)
    report["batch2[0]"], report["batch2[1]"] = frames[0], frames[1]

    # 4. the VAE of an even number of latent frames: 4 T frames, not 4 (T - 1) + 1
    with torch.no_grad():
        z = torch.from_numpy(noise((1, 4, 2, 4, 6), seed=102))
        SUMMARY.append(f"t2v: diffusers decodes 2 latent frames to "
                       f"{pipe.vae.decode(z).sample.shape[2]} frames")
    write(folder, arrays, calls, report)


def make_i2v(c):
    folder = OUT / "i2v"
    pipe = CogVideoXImageToVideoPipeline(
        tokenizer=c["tokenizer"], text_encoder=c["text_encoder"], vae=c["vae_5b"],
        transformer=c["i2v"], scheduler=CogVideoXDDIMScheduler(**SCHEDULER))
    pipe.save_pretrained(folder, safe_serialization=True)
    pipe = CogVideoXImageToVideoPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    methods = ["encode_prompt", "prepare_latents"]

    arrays = {"image": make_image(40, 56, seed=200), "latents": noise(latent_shape(1, 9), seed=201)}
    kwargs = dict(image="image", prompt="A cat walks on the grass.",
                  negative_prompt="bad quality", num_frames=9, latents="latents",
                  generator_seed=7, **COMMON)
    latents, frames, rec, steps = run(pipe, methods, kwargs, arrays)
    prompt_embeds, negative_prompt_embeds = rec["encode_prompt"][0]
    _, image_latents = rec["prepare_latents"][0]
    # the pipeline's image and the VAE posterior it samples from, recomputed
    image = pipe.video_processor.preprocess(PIL.Image.fromarray(arrays["image"]),
                                            height=HEIGHT, width=WIDTH)
    with torch.no_grad():
        dist = pipe.vae.encode(image.unsqueeze(2)).latent_dist
    arrays.update(
        prompt_embeds=prompt_embeds.numpy(), negative_prompt_embeds=negative_prompt_embeds.numpy(),
        image_preprocessed=image.numpy(), image_mean=dist.mean.numpy(),
        image_logvar=dist.logvar.numpy(), image_latents=image_latents.numpy(),
        final_latents=latents, step_latents=steps, frames=frames[0],
        timesteps=pipe.scheduler.timesteps.numpy())
    sample = (image_latents[:, :1].permute(0, 2, 1, 3, 4) / SCALING_5B - dist.mean) / dist.std
    SUMMARY.append(f"i2v: the posterior sample's noise has std {float(sample.std()):.3f}; "
                   f"the posterior std is {float(dist.std.mean()):.3f} on average")
    SUMMARY.append("i2v/main: max |float64 - float32| of the final latents %.2e, of the "
                   "frames %.2e" % float64_gap(pipe, kwargs, arrays, latents, frames))
    write(folder, arrays, {"main": kwargs}, {"main": frames[0]})


def main():
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    for name in ("t2v", "i2v"):
        shutil.rmtree(OUT / name, ignore_errors=True)
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    components = build_components()
    make_t2v(components)
    make_i2v(components)
    total = 0
    for f in sorted(OUT.rglob("*")):
        if f.is_file():
            total += f.stat().st_size
            print(f"{f.relative_to(OUT)}: {f.stat().st_size} bytes")
    print(f"total {total} bytes")
    print("\n".join(SUMMARY))


if __name__ == "__main__":
    main()
