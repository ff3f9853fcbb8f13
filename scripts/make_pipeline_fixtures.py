"""Writes the Wan pipeline parity fixtures of tests/fixtures/wan_pipeline/: tiny random
diffusers `WanPipeline` / `WanImageToVideoPipeline` directories (`save_pretrained`,
float32 safetensors) and what diffusers computes with them end to end, from the prompt
strings (and the image) to the decoded frames.

Run by hand, with torch, transformers, diffusers, accelerate, pillow and ftfy installed
(the test suite never needs them); written with torch 2.13.0 (CPU), diffusers 0.42.1,
transformers 5.25.0, tokenizers 0.23.3, accelerate 1.16.0, pillow 13.0.0 and ftfy 6.3.1
(`call.json` records the versions), without torchvision (so transformers'
`CLIPImageProcessor` is its PIL backend, `CLIPImageProcessorPil`):

    pip install torch diffusers transformers accelerate pillow ftfy
    python scripts/make_pipeline_fixtures.py

ftfy is needed: `pipeline_wan_i2v.basic_clean` calls `ftfy.fix_text` unconditionally
(`pipeline_wan.basic_clean` only when it is installed); the prompts here are ones that
`fix_text` leaves unchanged. accelerate is needed to read the pipelines back: without
it diffusers loads with `low_cpu_mem_usage=False`, which `WanTransformer3DModel`'s
`_keep_in_fp32_modules` refuses. The output is byte-identical from run to run.

- `t2v/`: a `WanPipeline` directory (tokenizer: the committed
    tests/fixtures/tokenizer/t5/ tokenizer; a 2-layer `UMT5EncoderModel` of width 32; a
    2-layer `WanTransformer3DModel` of 2 heads of 12; an `AutoencoderKLWan` of
    base_dim 4, z_dim 16; `UniPCMultistepScheduler` in Wan's shipped configuration), and
    `scheduler_euler/`, a `FlowMatchEulerDiscreteScheduler(shift=5.0)` config for the
    `euler_*` arrays.
- `i2v/`: a `WanImageToVideoPipeline` directory, the same tokenizer, text encoder, VAE
    and scheduler, a 2-layer `CLIPVisionModelWithProjection` of width 32 (17 tokens)
    with its `CLIPImageProcessor`, and an image-conditioned transformer (36 -> 16
    channels, `image_dim` 32, `added_kv_proj_dim` 24).
- `flf2v/`: only `transformer/`, the i2v transformer with `pos_embed_seq_len` 34
    (2 x 17 image tokens, Wan 2.1 FLF2V); the pipeline is i2v's other components with
    this transformer (`WanImageToVideoPipeline.from_pretrained("i2v",
    transformer=WanTransformer3DModel.from_pretrained("flf2v/transformer"))`).

`<name>/call.json` lists each call's keyword arguments (arrays named by their key in
`<name>/io.npz`); `io.npz` holds each call's inputs, intermediates recorded inside the
pipeline's own call (`encode_prompt`'s, `encode_image`'s and `prepare_latents`'s
outputs), the latents after every step, the final latents (`output_type="latent"`) and
the frames (`output_type="np"`). The outputs are those of the pipelines read back
from the written directories. See tests/fixtures/wan_pipeline/README.md for the keys.

Every parameter is moved off its initialisation (seeded, magnitudes kept as a trained
model keeps them; the VAE decoder's last convolution small enough that few pixels reach
the [-1, 1] clamp: the script prints the fraction of frame values at 0 or 1).
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
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import (
    AutoTokenizer,
    CLIPImageProcessor,
    CLIPVisionConfig,
    CLIPVisionModelWithProjection,
    UMT5Config,
    UMT5EncoderModel,
)


ROOT = pathlib.Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizer" / "t5"
OUT = ROOT / "tests" / "fixtures" / "wan_pipeline"

# google/umt5-xxl's text encoder in miniature (Wan's: 24 layers of 4096, 64 heads of 64,
# d_ff 10240, 32 buckets, max distance 128, gated gelu_new).
TEXT_ENCODER = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                    relative_attention_num_buckets=32, relative_attention_max_distance=128,
                    feed_forward_proj="gated-gelu", dropout_rate=0.0, layer_norm_epsilon=1e-6,
                    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                   in_channels=16, out_channels=16, text_dim=32, freq_dim=32, ffn_dim=32,
                   num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                   eps=1e-6, rope_max_seq_len=32)
IMAGE_ENCODER = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                     num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32,
                     hidden_act="gelu", layer_norm_eps=1e-5)
IMAGE_TOKENS = (32 // 8) ** 2 + 1
I2V_TRANSFORMER = dict(TRANSFORMER, in_channels=36, image_dim=32, added_kv_proj_dim=24)
FLF2V_TRANSFORMER = dict(I2V_TRANSFORMER, pos_embed_seq_len=2 * IMAGE_TOKENS)
VAE = dict(base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
           temperal_downsample=[False, True, True])
# Wan2.1-T2V's scheduler/scheduler_config.json (UniPC, flow prediction, shift 3).
SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                 num_train_timesteps=1000)
EULER = dict(shift=5.0)

SUMMARY = []  # printed at the end

HEIGHT, WIDTH = 32, 48
COMMON = dict(height=HEIGHT, width=WIDTH, num_inference_steps=4, guidance_scale=5.0)


# ---------------------------------------------------------------- components


def randomize_t5(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # RMS norm scales
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:  # (out, in) and the relative bias (buckets, heads)
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)


def randomize_clip(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name or "layrnorm" in name or "layernorm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "class_embedding" in name or "position_embedding" in name:
                p.copy_(0.5 * torch.randn_like(p))
            else:  # linear (out, in), patch convolution (out, 3, p, p)
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)


def randomize_transformer(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():  # as scripts/make_wan_fixtures.py (the FLF2V pos_embed starts at 0)
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))


def build_vae(seed):
    torch.manual_seed(seed)
    z = VAE["z_dim"]
    model = AutoencoderKLWan(**VAE, latents_mean=(0.3 * torch.randn(z)).tolist(),
                             latents_std=(0.5 + 0.5 * torch.rand(z)).tolist()).eval()
    with torch.no_grad():  # as scripts/make_vae_fixtures.py
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
        model.decoder.conv_out.weight.mul_(0.3)
    return model


def build_components():
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **TEXT_ENCODER)).eval()
    randomize_t5(text_encoder, seed=1)
    vae = build_vae(seed=2)
    image_encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(**IMAGE_ENCODER)).eval()
    randomize_clip(image_encoder, seed=3)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32},
                                         crop_size={"height": 32, "width": 32})
    transformers_ = {}
    for seed, (name, config) in enumerate((("t2v", TRANSFORMER), ("i2v", I2V_TRANSFORMER),
                                           ("flf2v", FLF2V_TRANSFORMER)), start=4):
        torch.manual_seed(seed)
        model = WanTransformer3DModel(**config).eval()
        randomize_transformer(model, seed)
        transformers_[name] = model
    return dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                image_encoder=image_encoder, image_processor=image_processor,
                transformers=transformers_)


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
    return (batch, VAE["z_dim"], (num_frames - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8)


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


def run(pipe, methods, kwargs, arrays):
    """Calls `pipe` twice (latent, np); returns (final latents, frames, records, steps)."""
    results = {}
    for output_type in ("latent", "np"):
        call = {k: (torch.from_numpy(arrays[v]) if k in ("latents",) else v)
                for k, v in kwargs.items()}
        for k in ("image", "last_image"):
            if k in call:
                call[k] = PIL.Image.fromarray(arrays[call[k]])
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
    frames, records_np, steps_np = results["np"]
    assert torch.equal(steps, steps_np), "two identical calls differ"
    return latents.numpy(), np.asarray(frames), records, steps.numpy()


def float64_gap(pipe, kwargs, arrays, latents, frames):
    """How far float32 rounding moves the outputs: the same call on a float64 copy."""
    pipe64 = copy.deepcopy(pipe).to(torch.float64)
    call = {k: (torch.from_numpy(arrays[v]).double() if k == "latents" else v)
            for k, v in kwargs.items()}
    for k in ("image", "last_image"):
        if k in call:
            call[k] = PIL.Image.fromarray(arrays[call[k]])
    with torch.no_grad():
        lat64 = pipe64(**call, output_type="latent").frames.double().numpy()
        frames64 = pipe64(**call, output_type="np").frames
    return float(np.abs(lat64 - latents).max()), float(np.abs(frames64 - frames).max())


def clipped(frames):
    return float(np.mean((frames <= 0.0) | (frames >= 1.0)))


def scheduler_arrays(pipe, prefix=""):
    # UniPC's timesteps are int64 (the transformer sees int(1000 * sigma)), Euler's float32
    return {prefix + "timesteps": pipe.scheduler.timesteps.numpy(),
            prefix + "sigmas": pipe.scheduler.sigmas.numpy().astype(np.float32)}


def write(folder, arrays, calls, report):
    np.savez_compressed(folder / "io.npz", **arrays)
    versions = {m: importlib.metadata.version(m) for m in
                ("torch", "diffusers", "transformers", "tokenizers", "accelerate", "pillow",
                 "ftfy", "safetensors", "numpy")}
    (folder / "call.json").write_text(
        json.dumps({"versions": versions, "calls": calls}, ensure_ascii=False, indent=1) + "\n")
    for name, frames in report.items():
        SUMMARY.append(f"{folder.name}/{name}: frames {frames.shape}, {clipped(frames):.4%} of "
                       f"values at 0 or 1, range [{frames.min():.3f}, {frames.max():.3f}], "
                       f"mean {frames.mean():.3f}")


def make_t2v(c):
    folder = OUT / "t2v"
    pipe = WanPipeline(tokenizer=c["tokenizer"], text_encoder=c["text_encoder"], vae=c["vae"],
                       transformer=c["transformers"]["t2v"],
                       scheduler=UniPCMultistepScheduler(**SCHEDULER))
    pipe.save_pretrained(folder, safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**EULER).save_pretrained(folder / "scheduler_euler")
    pipe = WanPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    methods = ["encode_prompt"]

    arrays, calls, report = {}, {}, {}
    # 1. one prompt, UniPC
    arrays["latents"] = noise(latent_shape(1, 9), seed=100)
    kwargs = dict(prompt=["A cat walks on the grass, 猫が歩く"], negative_prompt="bad quality",
                  num_frames=9, max_sequence_length=32, latents="latents", **COMMON)
    calls["main"] = kwargs
    latents, frames, rec, steps = run(pipe, methods, kwargs, arrays)
    arrays["prompt_embeds"], arrays["negative_prompt_embeds"] = (
        t.numpy() for t in rec["encode_prompt"][0])
    arrays.update(final_latents=latents, step_latents=steps, frames=frames[0],
                  **scheduler_arrays(pipe))
    report["main"] = frames[0]
    SUMMARY.append("t2v/main: max |float64 - float32| of the final latents %.2e, of the "
                   "frames %.2e" % float64_gap(pipe, kwargs, arrays, latents, frames))
    with torch.no_grad():  # the same, outside the call
        direct = pipe.encode_prompt(kwargs["prompt"], kwargs["negative_prompt"],
                                    max_sequence_length=32)
    assert all(torch.equal(a, b) for a, b in zip(direct, rec["encode_prompt"][0]))

    # 2. the same with FlowMatchEulerDiscreteScheduler(shift=5.0)
    unipc = pipe.scheduler
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder / "scheduler_euler")
    calls["euler"] = dict(kwargs, scheduler="scheduler_euler")
    latents, frames, rec, steps = run(pipe, methods, kwargs, arrays)
    arrays.update(euler_final_latents=latents, euler_step_latents=steps,
                  **scheduler_arrays(pipe, "euler_"))  # (frames: the VAE's, as above)
    report["euler"] = frames[0]
    pipe.scheduler = unipc

    # 3. two prompts (one truncated at 16 tokens), a negative prompt each (one empty)
    # one frame (a single latent frame) keeps the batch's frames small
    arrays["batch2_latents"] = noise(latent_shape(2, 1), seed=101)
    kwargs = dict(prompt=["A dog runs across the green field.",
                          "An astronaut rides a horse on the moon, then a robot walks through "
                          "a futuristic city while fireworks explode over the river."],
                  negative_prompt=["Worst quality, blurry, static.", ""], num_frames=1,
                  num_videos_per_prompt=1, max_sequence_length=16, latents="batch2_latents",
                  **COMMON)
    calls["batch2"] = kwargs
    latents, frames, rec, steps = run(pipe, methods, kwargs, arrays)
    arrays["batch2_prompt_embeds"], arrays["batch2_negative_prompt_embeds"] = (
        t.numpy() for t in rec["encode_prompt"][0])
    arrays.update(batch2_final_latents=latents, batch2_step_latents=steps,
                  batch2_frames=frames)
    report["batch2[0]"], report["batch2[1]"] = frames[0], frames[1]
    write(folder, arrays, calls, report)
    return pipe


def i2v_call(pipe, arrays, kwargs, prefix):
    methods = ["encode_prompt", "encode_image", "prepare_latents"]
    latents, frames, rec, steps = run(pipe, methods, kwargs, arrays)
    prompt_embeds, negative_prompt_embeds = rec["encode_prompt"][0]
    _, condition = rec["prepare_latents"][0]
    image_embeds = rec["encode_image"][0]
    # the inputs of encode_image and prepare_latents, recomputed as the pipeline does
    images = [PIL.Image.fromarray(arrays[kwargs[k]]) for k in ("image", "last_image")
              if k in kwargs]
    pixel_values = pipe.image_processor(images=images if len(images) > 1 else images[0],
                                        return_tensors="pt").pixel_values
    with torch.no_grad():
        direct = pipe.encode_image(images if len(images) > 1 else images[0], "cpu")
    assert torch.equal(direct, image_embeds)
    preprocessed = [pipe.video_processor.preprocess(i, height=HEIGHT, width=WIDTH).numpy()
                    for i in images]
    out = {
        "prompt_embeds": prompt_embeds.numpy(),
        "negative_prompt_embeds": negative_prompt_embeds.numpy(),
        "clip_pixel_values": pixel_values.numpy(),
        "image_embeds": image_embeds.numpy(),
        "image_preprocessed": preprocessed[0],
        "condition": condition.numpy(),
        "final_latents": latents,
        "step_latents": steps,
        "frames": frames[0],
        **scheduler_arrays(pipe),
    }
    if len(preprocessed) > 1:
        out["last_image_preprocessed"] = preprocessed[1]
    return {prefix + k: v for k, v in out.items()}, frames[0]


def make_i2v(c):
    folder = OUT / "i2v"
    pipe = WanImageToVideoPipeline(
        tokenizer=c["tokenizer"], text_encoder=c["text_encoder"], vae=c["vae"],
        scheduler=UniPCMultistepScheduler(**SCHEDULER), image_processor=c["image_processor"],
        image_encoder=c["image_encoder"], transformer=c["transformers"]["i2v"])
    pipe.save_pretrained(folder, safe_serialization=True)
    pipe = WanImageToVideoPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)

    arrays = {"image": make_image(40, 56, seed=200), "latents": noise(latent_shape(1, 5), seed=201)}
    # diffusers' transformer cuts the cross-attention context 512 text tokens from its
    # end (the rest is the image's): the I2V call must keep max_sequence_length=512
    kwargs = dict(image="image", prompt="A cat walks on the grass, 猫が歩く",
                  negative_prompt="bad quality", num_frames=5, max_sequence_length=512,
                  latents="latents", **COMMON)
    out, frames = i2v_call(pipe, arrays, kwargs, "")
    arrays.update(out)
    SUMMARY.append("i2v/main: max |float64 - float32| of the final latents %.2e, of the "
                   "frames %.2e" % float64_gap(pipe, kwargs, arrays, out["final_latents"],
                                               frames[None]))
    write(folder, arrays, {"main": kwargs}, {"main": frames})

    folder = OUT / "flf2v"
    c["transformers"]["flf2v"].save_pretrained(folder / "transformer", safe_serialization=True)
    pipe = WanImageToVideoPipeline.from_pretrained(
        OUT / "i2v", transformer=WanTransformer3DModel.from_pretrained(folder / "transformer"))
    pipe.set_progress_bar_config(disable=True)
    arrays = {"image": make_image(40, 56, seed=300), "last_image": make_image(40, 56, seed=301),
              "latents": noise(latent_shape(1, 5), seed=302)}
    kwargs = dict(image="image", last_image="last_image", prompt="A cat walks on the grass.",
                  negative_prompt="bad quality", num_frames=5, max_sequence_length=512,
                  latents="latents", **COMMON)
    out, frames = i2v_call(pipe, arrays, kwargs, "")
    arrays.update(out)
    write(folder, arrays, {"main": dict(kwargs, pipeline="../i2v", transformer="transformer")},
          {"main": frames})


def main():
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    if OUT.exists():
        shutil.rmtree(OUT / "t2v", ignore_errors=True)
        shutil.rmtree(OUT / "i2v", ignore_errors=True)
        shutil.rmtree(OUT / "flf2v", ignore_errors=True)
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
