"""Writes the CogVideoX VAE parity fixtures of tests/fixtures/cogvideox_vae/: a tiny random
diffusers `AutoencoderKLCogVideoX`, with inputs and diffusers' outputs.

Run by hand, with torch and diffusers installed (CI never needs them); written with
torch 2.13.0 (CPU) and diffusers 0.42.1:

    pip install torch diffusers safetensors
    python scripts/make_cogvideox_vae_fixtures.py

The model directory `<name>/diffusers/` is diffusers' own `save_pretrained` (four levels,
spatial factor 8, time factor 4, as CogVideoX's; widths 8 and 16, four groups per
GroupNorm, one residual block per level).

`<name>/io.npz` holds, for videos of 5 and 17 frames (one chunk of 5 frames; diffusers'
first chunk of 9 frames then one of 8): the video in [-1, 1] (`video_5`), the posterior's
`mean_5` and `logvar_5` (diffusers' `encode`); for random latents of 4 and 5 frames (chunks
of 2 + 2 and 3 + 2 latent frames) `latents_4` and diffusers' `decode` `decoded_4`; then the
tiled mode (`enable_tiling(tile_sample_min_height, tile_sample_min_width,
tile_overlap_factor_height, tile_overlap_factor_width)` with the values stored as
`tiling` (the sizes) and `overlap` (the factors)): `video_tiled`, `mean_tiled`,
`logvar_tiled`, `latents_tiled`, `decoded_tiled`.

Every parameter is moved off its initialisation (norm scales about 1, biases about 0.1,
convolutions scaled by their fan-in).
"""

import argparse
import os

import numpy as np
import torch
from diffusers import AutoencoderKLCogVideoX


MODELS = {
    "tiny": dict(
        config=dict(block_out_channels=[8, 8, 16, 16], latent_channels=4, layers_per_block=1,
                    norm_num_groups=4, sample_height=64, sample_width=64),
        size=(16, 32), tiled_size=(48, 48), tiling=(32, 32), overlap=(0.25, 0.5),
    ),
}


def build(spec: dict, seed: int) -> AutoencoderKLCogVideoX:
    torch.manual_seed(seed)
    model = AutoencoderKLCogVideoX(**spec["config"]).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and name.endswith("weight"):  # GroupNorm scales
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn_like(p) / fan_in**0.5)
    return model


def posterior(model, video):
    dist = model.encode(video).latent_dist
    return dist.mean.numpy(), dist.logvar.numpy()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                      "fixtures", "cogvideox_vae"))
    args = parser.parse_args()
    for place, (name, spec) in enumerate(MODELS.items()):
        root = os.path.join(args.out, name)
        model = build(spec, seed=10 * place)
        model.save_pretrained(os.path.join(root, "diffusers"))
        g = torch.Generator().manual_seed(10 * place + 1)
        z_dim = spec["config"]["latent_channels"]
        factor = 2 ** (len(spec["config"]["block_out_channels"]) - 1)
        io = {}
        h, w = spec["size"]
        with torch.no_grad():
            for frames in (5, 17):
                video = torch.rand(1, 3, frames, h, w, generator=g) * 2 - 1
                io[f"video_{frames}"] = video[0].numpy()
                mean, logvar = posterior(model, video)
                io[f"mean_{frames}"], io[f"logvar_{frames}"] = mean[0], logvar[0]
            for frames in (4, 5):
                latents = torch.randn(1, z_dim, frames, h // factor, w // factor, generator=g)
                io[f"latents_{frames}"] = latents[0].numpy()
                io[f"decoded_{frames}"] = model.decode(latents).sample[0].numpy()
            th, tw = spec["tiling"]
            fh, fw = spec["overlap"]
            model.enable_tiling(tile_sample_min_height=th, tile_sample_min_width=tw,
                                tile_overlap_factor_height=fh, tile_overlap_factor_width=fw)
            h, w = spec["tiled_size"]
            video = torch.rand(1, 3, 5, h, w, generator=g) * 2 - 1
            io["video_tiled"] = video[0].numpy()
            mean, logvar = posterior(model, video)
            io["mean_tiled"], io["logvar_tiled"] = mean[0], logvar[0]
            latents = torch.randn(1, z_dim, 2, h // factor, w // factor, generator=g)
            io["latents_tiled"] = latents[0].numpy()
            io["decoded_tiled"] = model.decode(latents).sample[0].numpy()
            io["tiling"] = np.array(spec["tiling"])
            io["overlap"] = np.array(spec["overlap"])
        np.savez_compressed(os.path.join(root, "io.npz"), **io)
        for k, v in io.items():
            print(f"  {k}: {v.shape}")
        print(f"wrote {root}")


if __name__ == "__main__":
    main()
