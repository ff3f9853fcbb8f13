"""Writes the CogVideoX parity fixtures of tests/fixtures/cogvideox/: tiny random diffusers
`CogVideoXTransformer3DModel`s in diffusers' layout, with inputs and diffusers' outputs.

Run by hand, with torch and diffusers installed (CI never needs them):

    pip install torch diffusers safetensors
    python scripts/make_cogvideox_fixtures.py      # writes tests/fixtures/cogvideox/

Each `<name>/diffusers/` is diffusers' own `save_pretrained`; `<name>/io.npz` holds the
inputs (`x` `(B, F, C, H, W)`, `timestep`, `context`) and `out`, diffusers' float32
output. The 5B-style models get their RoPE tables from the diffusers CogVideoX
pipeline's own `_prepare_rotary_positional_embeddings` (called on a stand-in for the
pipeline), so the fixtures pin the pipeline's crop region and rounding.

The models (2 layers, 4 heads of 16, width 64):

- `2b`: CogVideoX-2B style: the 3D sin-cos positional embedding, at a grid other than
    the config's sample size (diffusers recomputes it for the input).
- `5b`: CogVideoX-5B style: 3D RoPE on the video tokens, a grid whose aspect ratio
    differs from the base grid's (a crop region with a rounded offset).
- `5b_i2v`: CogVideoX-5B-I2V style: RoPE and the learned positional embedding (at the
    training resolution, as diffusers requires), 8 input channels.
"""

import argparse
import os
import types

import numpy as np
import torch
from diffusers import CogVideoXTransformer3DModel
from diffusers.pipelines.cogvideo.pipeline_cogvideox import CogVideoXPipeline


BASE = dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
            time_embed_dim=32, text_embed_dim=24, num_layers=2, patch_size=2,
            sample_height=6, sample_width=8, sample_frames=9, max_text_seq_length=5)

MODELS = {
    # video: (F, C, H, W) latents per example.
    "2b": dict(config=dict(BASE), video=(2, 4, 6, 10), text_len=5),
    "5b": dict(config=dict(BASE, use_rotary_positional_embeddings=True), video=(3, 4, 4, 8),
               text_len=7),
    "5b_i2v": dict(config=dict(BASE, in_channels=8, use_rotary_positional_embeddings=True,
                               use_learned_positional_embeddings=True),
                   video=(3, 8, 6, 8), text_len=5),
}


def rope_tables(model, frames: int, height: int, width: int):
    """The pipeline's RoPE tables for latents `(frames, height, width)`."""
    pipe = types.SimpleNamespace(transformer=model, vae_scale_factor_spatial=8)
    return CogVideoXPipeline._prepare_rotary_positional_embeddings(
        pipe, height * 8, width * 8, frames, torch.device("cpu")
    )


def make(name: str, spec: dict, root: str, seed: int) -> None:
    torch.manual_seed(seed)
    model = CogVideoXTransformer3DModel(**spec["config"]).eval()
    with torch.no_grad():  # move every parameter off its init (norm weights of 1, ...)
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        if spec["config"].get("use_learned_positional_embeddings"):
            pos = model.patch_embed.pos_embedding  # a saved buffer, not a parameter
            pos.add_(0.1 * torch.randn_like(pos))
    folder = os.path.join(root, name)
    model.save_pretrained(os.path.join(folder, "diffusers"))

    g = torch.Generator().manual_seed(seed + 1)
    batch = 2
    x = torch.randn(batch, *spec["video"], generator=g)
    timestep = torch.tensor([999.0, 137.0])
    context = torch.randn(batch, spec["text_len"], spec["config"]["text_embed_dim"], generator=g)
    rope = None
    if spec["config"].get("use_rotary_positional_embeddings"):
        frames, _, height, width = spec["video"]
        rope = rope_tables(model, frames, height, width)
    with torch.no_grad():
        out = model(x, context, timestep, image_rotary_emb=rope, return_dict=False)[0]
    io = {"x": x, "timestep": timestep, "context": context, "out": out}
    np.savez_compressed(os.path.join(folder, "io.npz"),
                        **{k: v.numpy().astype(np.float32) for k, v in io.items()})
    print(f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters -> {folder}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--out", default=os.path.join(here, "..", "tests", "fixtures", "cogvideox"))
    args = p.parse_args()
    torch.set_default_dtype(torch.float32)
    for i, (name, spec) in enumerate(MODELS.items()):
        make(name, spec, os.path.abspath(args.out), seed=100 + 10 * i)


if __name__ == "__main__":
    main()
