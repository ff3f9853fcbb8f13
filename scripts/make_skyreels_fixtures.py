"""Writes the SkyReels-V2 parity fixtures of tests/fixtures/skyreels/: tiny random
diffusers `SkyReelsV2Transformer3DModel`s (saved by diffusers' `save_pretrained`) with
inputs and diffusers' outputs.

Run by hand, with torch and diffusers installed (CI never needs them); written with
torch 2.13.0 (CPU) and diffusers 0.42.1:

    pip install torch==2.13.0 diffusers==0.42.1 safetensors
    python scripts/make_skyreels_fixtures.py              # every model
    python scripts/make_skyreels_fixtures.py --only df    # only these (the others untouched)

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures",
                                                      "skyreels"))
    parser.add_argument("--only", nargs="*", choices=sorted(MODELS), default=None)
    args = parser.parse_args()
    for i, (name, spec) in enumerate(MODELS.items()):
        if args.only is None or name in args.only:
            make(name, spec, args.out, seed=10 * i)


if __name__ == "__main__":
    main()
