"""Writes the SkyReels-V2 parity fixtures of tests/fixtures/skyreels/: tiny random
diffusers `SkyReelsV2Transformer3DModel`s (saved by diffusers' `save_pretrained`) with
inputs and diffusers' outputs.

Run by hand, with torch and diffusers installed (CI never needs them); written with
torch 2.13.0 (CPU), diffusers 0.42.1, transformers 5.25.0 and ftfy 6.3.1 (the pipeline's
text encoder and prompt cleaning):

    pip install torch==2.13.0 diffusers==0.42.1 transformers ftfy safetensors
    python scripts/make_skyreels_fixtures.py              # every model
    python scripts/make_skyreels_fixtures.py --only df    # only these (the others untouched)

and, with `df`, `df/pipeline.npz` (the latents of diffusers' diffusion forcing pipeline,
synchronous and asynchronous, on the `df` model) and `schedule.npz` (its
`generate_timestep_matrix` on several cases).

Each model directory holds `diffusers/` (its `save_pretrained`) and `io.npz`: the
inputs and `out` (diffusers' float32 output), one example per call and stacked (batch
axis first). diffusers' diffusion forcing path (`enable_diffusion_forcing=True`, a
timestep per latent frame) adds the fps embedding once per frame of a batch of one (its
`repeat(timestep.shape[1], ...)` broadcasts only for one example), so the examples run
one at a time. A model's seed is ten times its place in `MODELS`.

- `df`: diffusion forcing, text to video, `inject_sample_info=True` (the fps embedding),
    `num_frame_per_block=1` (no causal mask: diffusers applies its frame-block mask only
    for blocks of more than one frame). `timestep (2, F)`: one per latent frame, the
    values of an asynchronous schedule (non-integer ones included); `fps (2,)`: the
    embedding's index (the pipeline's 0 for 16 fps, 1 otherwise); `out`. Also
    `timestep_scalar (2,)` / `out_scalar`: one timestep per example
    (`enable_diffusion_forcing=False`), with the same fps.
- `df_block3`: `num_frame_per_block=3` over 6 latent frames: the frame-block causal
    mask (frames 0-2 see themselves; 3-5 see all six), per-frame timesteps, no fps.
- `i2v`: the image branch (image_dim 24, `added_kv_proj_dim` 64, 12 -> 4 channels), one
    timestep per example, a batch of two in one call; 512 text tokens (diffusers'
    attention takes the context's last 512 tokens as the text, the rest as the image).
"""

import argparse
import os

import numpy as np
import torch
from diffusers import SkyReelsV2Transformer3DModel


BASE = dict(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=8, in_channels=4,
            out_channels=4, text_dim=32, freq_dim=32, ffn_dim=96, num_layers=2, cross_attn_norm=True,
            eps=1e-6)

MODELS = {
    "df": dict(config=dict(BASE, inject_sample_info=True), video=(4, 4, 4, 6), text_len=7,
               timestep=[[999.0, 812.5, 500.25, 0.0], [0.0, 0.0, 333.0, 937.75]], fps=[1, 0]),
    "df_block3": dict(config=dict(BASE, num_frame_per_block=3), video=(4, 6, 4, 4), text_len=5,
                      timestep=[[0.0, 0.0, 0.0, 700.0, 700.0, 700.0], [250.5, 250.5, 250.5, 999.0, 999.0,
                                                                          999.0]]),
    "i2v": dict(config=dict(BASE, in_channels=12, text_dim=16, image_dim=24, added_kv_proj_dim=64),
                video=(12, 2, 4, 6), text_len=512, image_len=5, timestep=[999.0, 137.0]),
}


def build(spec: dict, seed: int) -> SkyReelsV2Transformer3DModel:
    """A random diffusers model of `spec`, every parameter moved off its init."""
    torch.manual_seed(seed)
    model = SkyReelsV2Transformer3DModel(**spec["config"]).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def make(name: str, spec: dict, root: str, seed: int) -> None:
    model = build(spec, seed)
    folder = os.path.join(root, name)
    model.save_pretrained(os.path.join(folder, "diffusers"))
    g = torch.Generator().manual_seed(seed + 1)
    batch = 2
    x = torch.randn(batch, *spec["video"], generator=g)
    context = torch.randn(batch, spec["text_len"], spec["config"]["text_dim"], generator=g)
    timestep = torch.tensor(spec["timestep"], dtype=torch.float32)
    io = {"x": x, "context": context, "timestep": timestep}
    with torch.no_grad():
        if timestep.ndim == 1:  # one timestep per example, one call
            kwargs = {}
            if spec.get("image_len"):
                io["context_image"] = torch.randn(batch, spec["image_len"], spec["config"]["image_dim"],
                                                  generator=g)
                kwargs["encoder_hidden_states_image"] = io["context_image"]
            io["out"] = model(x, timestep, context, return_dict=False, **kwargs)[0]
        else:  # diffusion forcing: a timestep per latent frame, one example per call
            fps = spec.get("fps")
            outs, scalar = [], []
            for b in range(batch):
                kwargs = {} if fps is None else {"fps": [fps[b]]}
                outs.append(model(x[b:b + 1], timestep[b:b + 1], context[b:b + 1], return_dict=False,
                                  enable_diffusion_forcing=True, **kwargs)[0])
                if fps is not None:
                    scalar.append(model(x[b:b + 1], timestep[b, 1:2], context[b:b + 1], return_dict=False,
                                        **kwargs)[0])
            io["out"] = torch.cat(outs)
            if fps is not None:
                io["fps"] = torch.tensor(fps)
                io["timestep_scalar"] = timestep[:, 1]
                io["out_scalar"] = torch.cat(scalar)
    np.savez_compressed(os.path.join(folder, "io.npz"),
                        **{k: v.numpy().astype(np.int32 if k == "fps" else np.float32) for k, v in io.items()})
    print(f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters -> {folder}")


# The denoising loop of `SkyReelsV2DiffusionForcingPipeline` (`output_type="latent"`) on the
# `df` model: (name, ar_step, causal_block_size). UniPC as SkyReels-V2's DF releases ship it
# (flow prediction, flow sigmas, shift 8), 4 steps, guidance 5, 24 fps (the fps index 1).
# With `causal_block_size` 2 the pipeline sets the model's frame-block causal mask
# (`_set_ar_attention`), which stays set: those cases run last.
PIPELINE_CASES = (("sync", 0, None), ("async", 1, 1), ("sync_block2", 0, 2), ("async_block2", 1, 2))
PIPELINE_STEPS, PIPELINE_GUIDANCE, PIPELINE_SHIFT = 4, 5.0, 8.0


# `generate_timestep_matrix`'s cases, (latent frames, steps, ar_step, causal_block_size),
# stored as `schedule.npz`: its step indices and update masks.
SCHEDULE_CASES = ((4, 5, 0, 1), (4, 4, 1, 1), (6, 5, 2, 2), (10, 6, 3, 5), (9, 3, 5, 3), (1, 2, 0, 1))
# (frames, steps, ar_step, block, num_pre_ready): a given prefix (whole blocks of it ready).
SCHEDULE_PREFIX_CASES = ((6, 4, 1, 2, 2), (5, 3, 2, 1, 3), (6, 5, 0, 3, 2), (8, 4, 2, 2, 5))


def make_schedules(root: str) -> None:
    from diffusers import SkyReelsV2DiffusionForcingPipeline

    out = {}
    for n, (frames, steps, ar_step, block) in enumerate(SCHEDULE_CASES):
        template = torch.arange(steps, 0, -1) * (1000 // (steps + 1))
        _, index, update, interval = SkyReelsV2DiffusionForcingPipeline.generate_timestep_matrix(
            None, frames, template, frames, ar_step=ar_step, num_pre_ready=0, causal_block_size=block)
        assert all(i == (0, frames) for i in interval)  # the pipeline's: always the whole video
        out[f"case{n}"] = np.asarray([frames, steps, ar_step, block])
        out[f"index{n}"], out[f"update{n}"] = index.numpy().astype(np.int32), update.numpy()
    for n, (frames, steps, ar_step, block, ready) in enumerate(SCHEDULE_PREFIX_CASES):
        template = torch.arange(steps, 0, -1) * (1000 // (steps + 1))
        _, index, update, _ = SkyReelsV2DiffusionForcingPipeline.generate_timestep_matrix(
            None, frames, template, frames, ar_step=ar_step, num_pre_ready=ready, causal_block_size=block)
        out[f"prefix_case{n}"] = np.asarray([frames, steps, ar_step, block, ready])
        out[f"prefix_index{n}"], out[f"prefix_update{n}"] = index.numpy().astype(np.int32), update.numpy()
    np.savez_compressed(os.path.join(root, "schedule.npz"), **out)
    print(f"schedules: {len(SCHEDULE_CASES)} cases -> {root}")


def make_pipeline(root: str) -> None:
    """`df/pipeline.npz`: diffusers' latents after the loop, from prompt embeddings and the
    initial noise its generator draws (stored as `noise`), per case."""
    from diffusers import SkyReelsV2DiffusionForcingPipeline, UniPCMultistepScheduler
    from diffusers.utils.torch_utils import randn_tensor

    spec = MODELS["df"]
    model = build(spec, seed=10 * list(MODELS).index("df"))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=PIPELINE_SHIFT, num_train_timesteps=1000)
    pipe = SkyReelsV2DiffusionForcingPipeline(tokenizer=None, text_encoder=None, transformer=model, vae=None,
                                              scheduler=scheduler)
    c, f, h, w = spec["video"]
    g = torch.Generator().manual_seed(123)
    context = torch.randn(1, spec["text_len"], spec["config"]["text_dim"], generator=g)
    negative = torch.randn(1, spec["text_len"], spec["config"]["text_dim"], generator=g)
    io = {"context": context, "negative_context": negative,
          "noise": randn_tensor((1, c, f, h, w), generator=torch.Generator().manual_seed(7), dtype=torch.float32)}
    for name, ar_step, block in PIPELINE_CASES:
        out = pipe(prompt=None, prompt_embeds=context, negative_prompt_embeds=negative, height=8 * h, width=8 * w,
                   num_frames=4 * (f - 1) + 1, num_inference_steps=PIPELINE_STEPS, guidance_scale=PIPELINE_GUIDANCE,
                   generator=torch.Generator().manual_seed(7), output_type="latent", ar_step=ar_step,
                   causal_block_size=block, fps=24, return_dict=False)[0]
        io[f"latents_{name}"] = out
    np.savez_compressed(os.path.join(root, "df", "pipeline.npz"),
                        **{k: v.numpy().astype(np.float32) for k, v in io.items()})
    print(f"df pipeline: {', '.join(n for n, *_ in PIPELINE_CASES)} -> {os.path.join(root, 'df')}")


# The whole `SkyReelsV2DiffusionForcingPipeline` on tiny components: the tokenizer, UMT5
# text encoder and VAE of tests/fixtures/wan_pipeline/t2v (not copied: the test assembles
# the folder), a SkyReels-V2 transformer with the fps embedding for them (16 channels,
# text_dim 32) and UniPC with shift 8. `df_pipeline/`: `transformer/`, `scheduler/`,
# `model_index.json` and `io.npz` (`noise`, then per case the `latents` and `frames` of
# `output_type="latent"` / `"np"`).
DF_PIPELINE_CALL = dict(prompt=["A cat walks on the grass"], negative_prompt="bad quality", height=32, width=48,
                        num_frames=9, num_inference_steps=4, guidance_scale=5.0, max_sequence_length=32, fps=24)
DF_PIPELINE_CASES = (("sync", 0), ("async", 1))
# Then 13 frames (4 latent frames) in causal blocks of 2, asynchronous (the model's mask
# set by the pipeline, last): `noise_block2`, `latents_async_block2`, `frames_async_block2`.
DF_PIPELINE_BLOCK = dict(num_frames=13, ar_step=1, causal_block_size=2)


def make_df_pipeline(root: str, windows_only: bool = False) -> None:
    from diffusers import (AutoencoderKLWan, SkyReelsV2DiffusionForcingPipeline, UniPCMultistepScheduler)
    from diffusers.utils.torch_utils import randn_tensor
    from transformers import AutoTokenizer, UMT5EncoderModel

    wan = os.path.join(root, "..", "wan_pipeline", "t2v")
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(wan, "tokenizer"))
    text_encoder = UMT5EncoderModel.from_pretrained(os.path.join(wan, "text_encoder")).eval()
    vae = AutoencoderKLWan.from_pretrained(os.path.join(wan, "vae")).eval()
    spec = dict(config=dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                            out_channels=16, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2,
                            cross_attn_norm=True, eps=1e-6, rope_max_seq_len=32, inject_sample_info=True))
    transformer = build(spec, seed=77)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=PIPELINE_SHIFT, num_train_timesteps=1000)
    pipe = SkyReelsV2DiffusionForcingPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer,
                                              vae=vae, scheduler=scheduler)
    folder = os.path.join(root, "df_pipeline")
    if windows_only:  # the saved transformer, rebuilt: check that it is the same
        saved = SkyReelsV2Transformer3DModel.from_pretrained(os.path.join(folder, "transformer")).state_dict()
        assert all(torch.equal(saved[k], v) for k, v in transformer.state_dict().items())
        return make_df_windows(folder, dict(tokenizer=tokenizer, text_encoder=text_encoder,
                                            transformer=transformer, vae=vae, scheduler=scheduler))
    pipe.save_pretrained(folder)
    for part in ("tokenizer", "text_encoder", "vae"):  # the Wan fixture's, assembled by the test
        import shutil
        shutil.rmtree(os.path.join(folder, part))
    call = DF_PIPELINE_CALL
    frames = 4 * ((call["num_frames"] - 1) // 4) + 1
    shape = (1, 16, (frames - 1) // 4 + 1, call["height"] // 8, call["width"] // 8)
    io = {"noise": randn_tensor(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float32)}
    for name, ar_step in DF_PIPELINE_CASES:
        for output in ("latent", "np"):
            out = pipe(**call, generator=torch.Generator().manual_seed(5), output_type=output, ar_step=ar_step,
                       return_dict=False)[0]
            out = torch.as_tensor(np.asarray(out))
            io[f"{'latents' if output == 'latent' else 'frames'}_{name}"] = out
    block = dict(call, **DF_PIPELINE_BLOCK)
    shape = (1, 16, (block["num_frames"] - 1) // 4 + 1, call["height"] // 8, call["width"] // 8)
    io["noise_block2"] = randn_tensor(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float32)
    for output in ("latent", "np"):
        out = pipe(**block, generator=torch.Generator().manual_seed(5), output_type=output, return_dict=False)[0]
        io[f"{'latents' if output == 'latent' else 'frames'}_async_block2"] = torch.as_tensor(np.asarray(out))
    np.savez_compressed(os.path.join(folder, "io.npz"), **{k: v.numpy().astype(np.float32) for k, v in io.items()})
    print(f"df pipeline: {', '.join(n for n, _ in DF_PIPELINE_CASES)} -> {folder}")
    make_df_windows(folder, dict(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                                 scheduler=scheduler))


# Long videos, image and video to video on the same components: `df_pipeline/windows.npz`.
# Per case, `noise_<case>`: every window's draw of diffusers' generator, one after the
# other on the frame axis; `addnoise_<case>` (with addnoise_condition): the noise of
# `addnoise_condition` at each iteration of a window (diffusers draws it with
# `torch.randn_like` from the global generator; here iteration `i` of every window gets
# `torch.randn(shape, generator=manual_seed(1000 + i))`, stacked); `latents_<case>`,
# `frames_<case>`. The I2V / V2V inputs: `image`, `last_image` (uint8 (32, 48, 3)),
# `video` (uint8 (9, 32, 48, 3)).
DF_WINDOW_CASES = {
    # 17 frames in windows of 9 overlapping by 5: three windows of 3 latent frames.
    "long": dict(mode="t2v", num_frames=17, base_num_frames=9, overlap_history=5, ar_step=1, addnoise_condition=20),
    # 21 frames in windows of 13 overlapping by 9 (3 latent frames, cut to 2 for blocks of 2).
    "long_block2": dict(mode="t2v", num_frames=21, base_num_frames=13, overlap_history=9, ar_step=1,
                        causal_block_size=2),
    "i2v": dict(mode="i2v", num_frames=9, ar_step=1, addnoise_condition=20),
    "i2v_last": dict(mode="i2v", num_frames=9, last=True),
    "v2v": dict(mode="v2v", num_frames=13, base_num_frames=9, overlap_history=5),
}


def make_df_windows(folder: str, components: dict) -> None:
    from diffusers import (SkyReelsV2DiffusionForcingImageToVideoPipeline, SkyReelsV2DiffusionForcingPipeline,
                           SkyReelsV2DiffusionForcingVideoToVideoPipeline)
    import diffusers.pipelines.skyreels_v2.pipeline_skyreels_v2_diffusion_forcing as t2v_module
    import diffusers.pipelines.skyreels_v2.pipeline_skyreels_v2_diffusion_forcing_i2v as i2v_module
    import diffusers.pipelines.skyreels_v2.pipeline_skyreels_v2_diffusion_forcing_v2v as v2v_module
    from PIL import Image

    classes = {"t2v": (SkyReelsV2DiffusionForcingPipeline, t2v_module),
               "i2v": (SkyReelsV2DiffusionForcingImageToVideoPipeline, i2v_module),
               "v2v": (SkyReelsV2DiffusionForcingVideoToVideoPipeline, v2v_module)}
    rng = np.random.default_rng(3)
    io = {"image": rng.integers(0, 256, (32, 48, 3), dtype=np.uint8),
          "last_image": rng.integers(0, 256, (32, 48, 3), dtype=np.uint8),
          "video": rng.integers(0, 256, (9, 32, 48, 3), dtype=np.uint8)}
    call = {k: v for k, v in DF_PIPELINE_CALL.items()}
    for name, case in DF_WINDOW_CASES.items():
        case = dict(dict(causal_block_size=1), **case)  # explicit: set on the shared model
        cls, module = classes[case.pop("mode")]
        pipe = cls(**components)
        draws, addnoise, counter = [], {}, [0]
        original_randn, original_matrix = module.randn_tensor, cls.generate_timestep_matrix

        def recording_randn(*args, **kwargs):
            noise = original_randn(*args, **kwargs)
            draws.append(noise.clone())  # the pipeline writes into its latents
            return noise

        def window_matrix(self, *args, **kwargs):  # a new window: its iterations from 0
            counter[0] = 0
            return original_matrix(self, *args, **kwargs)

        def table_randn_like(x, *args, **kwargs):
            i = counter[0]
            counter[0] += 1
            addnoise.setdefault(i, torch.randn(x.shape, generator=torch.Generator().manual_seed(1000 + i)))
            return addnoise[i].to(x.dtype)

        extra = {}
        if "last" in case:
            case.pop("last")
            extra["last_image"] = Image.fromarray(io["last_image"])
        if cls is SkyReelsV2DiffusionForcingImageToVideoPipeline:
            extra["image"] = Image.fromarray(io["image"])
        if cls is SkyReelsV2DiffusionForcingVideoToVideoPipeline:
            extra["video"] = [Image.fromarray(f) for f in io["video"]]
        out = {}
        for output in ("latent", "np"):
            draws.clear()
            addnoise.clear()
            module.randn_tensor, cls.generate_timestep_matrix = recording_randn, window_matrix
            randn_like, torch.randn_like = torch.randn_like, table_randn_like
            try:
                result = pipe(**dict(call, **case), **extra, generator=torch.Generator().manual_seed(5),
                              output_type=output, return_dict=False)[0]
            finally:
                module.randn_tensor, cls.generate_timestep_matrix = original_randn, original_matrix
                torch.randn_like = randn_like
            out[output] = torch.as_tensor(np.asarray(result))
        io[f"noise_{name}"] = torch.cat(draws, dim=2)
        if addnoise:
            io[f"addnoise_{name}"] = torch.stack([addnoise[i] for i in sorted(addnoise)])
        io[f"latents_{name}"], io[f"frames_{name}"] = out["latent"], out["np"]
    np.savez_compressed(os.path.join(folder, "windows.npz"),
                        **{k: (v if isinstance(v, np.ndarray) else v.numpy().astype(np.float32)) for k, v in io.items()})
    print(f"df windows: {', '.join(DF_WINDOW_CASES)} -> {folder}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures",
                                                      "skyreels"))
    parser.add_argument("--only", nargs="*", choices=sorted(MODELS) + ["windows"], default=None)
    args = parser.parse_args()
    for i, (name, spec) in enumerate(MODELS.items()):
        if args.only is None or name in args.only:
            make(name, spec, args.out, seed=10 * i)
    if args.only == ["windows"]:  # only the long video, I2V, V2V cases and the schedules
        make_schedules(args.out)
        return make_df_pipeline(args.out, windows_only=True)
    if args.only is None or "df" in args.only:
        make_pipeline(args.out)
        make_schedules(args.out)
        make_df_pipeline(args.out)


if __name__ == "__main__":
    main()
