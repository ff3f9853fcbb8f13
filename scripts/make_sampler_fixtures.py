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
"""

import pathlib

import numpy as np
import torch
from diffusers import (
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
    for f in sorted(OUT.glob("*.npz")):
        print(f.relative_to(ROOT), f.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
