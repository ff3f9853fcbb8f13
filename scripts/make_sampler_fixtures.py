"""Writes the sampler parity fixtures of tests/fixtures/sampler/: diffusers'
`WanPipeline(output_type="latent")` run on tiny random transformers, for
`tests/test_sample.py` to match with `vidax_eqx.sampling.sample`.

Run by hand, with torch and diffusers installed (CI never needs them); written with
diffusers 0.42.1 on the CPU:

    pip install torch diffusers
    python scripts/make_sampler_fixtures.py

The transformers are the tiny random ones of tests/fixtures/wan/ (written by
scripts/make_wan_fixtures.py): `t2v/diffusers` (Wan 2.1) and the two experts of
`a14b/diffusers` (Wan 2.2 A14B, `boundary_ratio` 0.875). The pipeline has no text
encoder, tokenizer or VAE: it takes `prompt_embeds` / `negative_prompt_embeds` and the
initial `latents`, and returns the final latents.

- `wan_t2v.npz`: `noise` `(2, 4, 3, 6, 10)`, `context` and `negative_context`
    `(2, 7, 32)` (standard normal, float32), and `{scheduler}_s{steps}`, the final
    latents of guidance 5.0 with `FlowMatchEulerDiscreteScheduler(shift=3.0)`
    (`euler`) and `UniPCMultistepScheduler(prediction_type="flow_prediction",
    use_flow_sigmas=True, flow_shift=3.0)` (`unipc`, Wan's shipped configuration), at
    4 and 20 steps.
- `wan_a14b.npz`: the same inputs, the two-expert pipeline with UniPC, guidance 5.0
    for the high-noise expert and `guidance_scale_2` 3.0 for the low-noise one.
- `cogvideox_2b.npz`: `CogVideoXPipeline(output_type="latent")` around the tiny
    `cogvideox/2b/diffusers` transformer with `CogVideoXDDIMScheduler` in
    CogVideoX-2B's shipped configuration, guidance 6.0: `noise` `(2, 2, 4, 6, 10)`
    (diffusers' `(B, F, C, H, W)`), `context` / `negative_context` `(2, 5, 24)`,
    `ddim_s{steps}` at 4 and 20 steps and `ddim_dynamic_s4` with `use_dynamic_cfg`.
"""

import pathlib

import numpy as np
import torch
from diffusers import (
    CogVideoXDDIMScheduler,
    CogVideoXPipeline,
    CogVideoXTransformer3DModel,
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
    WanPipeline,
    WanTransformer3DModel,
)


ROOT = pathlib.Path(__file__).resolve().parent.parent
WAN = ROOT / "tests" / "fixtures" / "wan"
OUT = ROOT / "tests" / "fixtures" / "sampler"
SHAPE = (2, 4, 3, 6, 10)  # (B, C, F, H, W): 3 x 3 x 5 = 45 patch tokens
TEXT = (2, 7, 32)
STEPS = (4, 20)
SCHEDULERS = {
    "euler": lambda: FlowMatchEulerDiscreteScheduler(shift=3.0),
    "unipc": lambda: UniPCMultistepScheduler(prediction_type="flow_prediction",
                                             use_flow_sigmas=True, flow_shift=3.0),
}


# THUDM/CogVideoX-2b's scheduler_config.json (as scripts/make_scheduler_fixtures.py).
COGVIDEOX_DDIM = dict(
    num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
    beta_schedule="scaled_linear", clip_sample=False, prediction_type="v_prediction",
    rescale_betas_zero_snr=True, set_alpha_to_one=True, snr_shift_scale=3.0,
    steps_offset=0, timestep_spacing="trailing",
)


def _cogvideox():
    rng = np.random.default_rng(1)
    io = {"noise": rng.standard_normal((2, 2, 4, 6, 10)).astype(np.float32),
          "context": rng.standard_normal((2, 5, 24)).astype(np.float32),
          "negative_context": rng.standard_normal((2, 5, 24)).astype(np.float32)}
    model = CogVideoXTransformer3DModel.from_pretrained(
        ROOT / "tests" / "fixtures" / "cogvideox" / "2b" / "diffusers").float().eval()
    pipe = CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=model,
                             scheduler=CogVideoXDDIMScheduler(**COGVIDEOX_DDIM))
    pipe.set_progress_bar_config(disable=True)
    F, H, W = io["noise"].shape[1], io["noise"].shape[3], io["noise"].shape[4]
    for name, steps, dynamic in (("ddim_s4", 4, False), ("ddim_s20", 20, False),
                                 ("ddim_dynamic_s4", 4, True)):
        with torch.no_grad():
            out = pipe(prompt_embeds=torch.from_numpy(io["context"]),
                       negative_prompt_embeds=torch.from_numpy(io["negative_context"]),
                       latents=torch.from_numpy(io["noise"]), num_inference_steps=steps,
                       guidance_scale=6.0, use_dynamic_cfg=dynamic, height=8 * H,
                       width=8 * W, num_frames=4 * (F - 1) + 1, output_type="latent",
                       return_dict=False)[0]
        io[name] = out.detach().numpy().astype(np.float32)
    np.savez(OUT / "cogvideox_2b.npz", **io)


def _inputs():
    rng = np.random.default_rng(0)
    return {
        "noise": rng.standard_normal(SHAPE).astype(np.float32),
        "context": rng.standard_normal(TEXT).astype(np.float32),
        "negative_context": rng.standard_normal(TEXT).astype(np.float32),
    }


def _run(pipe, io, steps, **kwargs):
    out = pipe(
        prompt_embeds=torch.from_numpy(io["context"]),
        negative_prompt_embeds=torch.from_numpy(io["negative_context"]),
        latents=torch.from_numpy(io["noise"]),
        num_inference_steps=steps,
        output_type="latent",
        return_dict=False,
        **kwargs,
    )[0]
    return out.detach().numpy().astype(np.float32)


def main():
    torch.manual_seed(0)
    OUT.mkdir(parents=True, exist_ok=True)
    io = _inputs()

    t2v = WanTransformer3DModel.from_pretrained(WAN / "t2v" / "diffusers").float().eval()
    arrays = dict(io)
    for name, make in SCHEDULERS.items():
        pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=make(),
                           transformer=t2v)
        pipe.set_progress_bar_config(disable=True)
        for steps in STEPS:
            with torch.no_grad():
                arrays[f"{name}_s{steps}"] = _run(pipe, io, steps, guidance_scale=5.0)
    np.savez(OUT / "wan_t2v.npz", **arrays)

    a14b = WAN / "a14b" / "diffusers"
    high = WanTransformer3DModel.from_pretrained(a14b / "transformer").float().eval()
    low = WanTransformer3DModel.from_pretrained(a14b / "transformer_2").float().eval()
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None,
                       scheduler=SCHEDULERS["unipc"](), transformer=high, transformer_2=low,
                       boundary_ratio=0.875)
    pipe.set_progress_bar_config(disable=True)
    arrays = dict(io)
    for steps in STEPS:
        with torch.no_grad():
            arrays[f"unipc_s{steps}"] = _run(pipe, io, steps, guidance_scale=5.0,
                                             guidance_scale_2=3.0)
    np.savez(OUT / "wan_a14b.npz", **arrays)
    _cogvideox()
    for f in sorted(OUT.glob("*.npz")):
        print(f.relative_to(ROOT), f.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
