"""Writes the Wan VAE parity fixtures of tests/fixtures/wan_vae/: tiny random diffusers
`AutoencoderKLWan` models (Wan 2.1 and Wan 2.2), with inputs and diffusers' outputs.

Run by hand, with torch and diffusers installed (CI never needs them); written with
torch 2.13.0 (CPU) and diffusers 0.42.1:

    pip install torch diffusers safetensors
    python scripts/make_vae_fixtures.py

Each model directory `<name>/diffusers/` is diffusers' own `save_pretrained`;
`<name>/wan/Wan2.1_VAE.safetensors` (or `Wan2.2_VAE.safetensors`) holds the same tensors
under the original Wan names (`WanVAE_` of Wan 2.1's `vae.py`: `encoder.downsamples.*.
residual.*`, `middle`, `head`, `conv1` / `conv2`; Wan 2.2's `vae2_2.py` nests each level's
blocks as `downsamples.{i}.downsamples.{j}` / `upsamples.{i}.upsamples.{j}`), written
with a name map of this script's own.

`<name>/io.npz` holds, for videos of 5 and 9 frames (1 + 4k for k = 1, 2): the video in
[-1, 1] (`video_5`), the posterior's `mean_5` and `logvar_5` (diffusers' `encode`), and
for random latents of 2 and 3 frames `latents_2`, diffusers' `decode` `decoded_2`; then
the same for the tiled mode (`enable_tiling` with the sizes stored as `tile_*`):
`video_tiled`, `mean_tiled`, `logvar_tiled`, `latents_tiled`, `decoded_tiled`.

Every parameter is moved off its initialisation (norm scales about 1, biases about 0.1,
convolutions scaled by their fan-in; the decoder's last convolution smaller so that its
output stays mostly inside the [-1, 1] that decode clamps to).
"""

import argparse
import os
import re

import numpy as np
import torch
from diffusers import AutoencoderKLWan
from safetensors.torch import save_file


MODELS = {
    "wan21": dict(
        config=dict(base_dim=4, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                    attn_scales=[], temperal_downsample=[False, True, True]),
        size=(16, 24), tiled_size=(48, 64), tiling=(32, 32, 16, 16),
    ),
    "wan22": dict(
        config=dict(base_dim=4, decoder_base_dim=6, z_dim=8, dim_mult=[1, 2, 4, 4],
                    num_res_blocks=1, attn_scales=[], temperal_downsample=[False, True, True],
                    is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                    scale_factor_spatial=16),
        size=(32, 32), tiled_size=(64, 96), tiling=(32, 32, 16, 16),
    ),
}


def build(spec: dict, seed: int) -> AutoencoderKLWan:
    torch.manual_seed(seed)
    z_dim = spec["config"]["z_dim"]
    model = AutoencoderKLWan(
        **spec["config"],
        latents_mean=torch.randn(z_dim).tolist(),
        latents_std=(1 + torch.rand(z_dim)).tolist(),
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn_like(p) / fan_in**0.5)
        model.decoder.conv_out.weight.mul_(0.3)
    return model


# The original Wan names (`WanVAE_` of Wan 2.1's `vae.py` and Wan 2.2's `vae2_2.py`):
# diffusers name -> original name.
def to_wan_name(name: str, num_res_blocks: int, residual: bool) -> str:
    def resnet(rest: str) -> str:
        for d, w in (("norm1", "residual.0"), ("conv1", "residual.2"), ("norm2", "residual.3"),
                     ("conv2", "residual.6"), ("conv_shortcut", "shortcut")):
            if rest.startswith(d + "."):
                return w + rest[len(d):]
        raise KeyError(rest)

    if name.startswith("quant_conv."):
        return "conv1." + name[len("quant_conv."):]
    if name.startswith("post_quant_conv."):
        return "conv2." + name[len("post_quant_conv."):]
    side, rest = name.split(".", 1)
    if rest.startswith("conv_in."):
        return f"{side}.conv1.{rest[len('conv_in.'):]}"
    if rest.startswith("norm_out."):
        return f"{side}.head.0.{rest[len('norm_out.'):]}"
    if rest.startswith("conv_out."):
        return f"{side}.head.2.{rest[len('conv_out.'):]}"
    m = re.match(r"mid_block\.(resnets|attentions)\.(\d)\.(.*)", rest)
    if m:
        kind, i, tail = m.groups()
        if kind == "attentions":
            return f"{side}.middle.1.{tail}"
        return f"{side}.middle.{2 * int(i)}.{resnet(tail)}"
    if residual:  # Wan 2.2: Down_ResidualBlock / Up_ResidualBlock, each a `downsamples` /
        # `upsamples` sequence of residual blocks then the resampling
        m = re.match(r"(down|up)_blocks\.(\d+)\.(resnets\.(\d+)|downsampler|upsampler)\.(.*)", rest)
        if m:
            kind, i, part, j, tail = m.groups()
            seq = f"{kind}samples"
            if part.startswith("resnets"):
                return f"{side}.{seq}.{i}.{seq}.{j}.{resnet(tail)}"
            last = num_res_blocks if kind == "down" else num_res_blocks + 1
            return f"{side}.{seq}.{i}.{seq}.{last}.{tail}"
        raise KeyError(name)
    m = re.match(r"down_blocks\.(\d+)\.(.*)", rest)
    if m:
        i, tail = int(m.group(1)), m.group(2)
        if tail.startswith(("resample.", "time_conv.")):
            return f"{side}.downsamples.{i}.{tail}"
        return f"{side}.downsamples.{i}.{resnet(tail)}"
    m = re.match(r"up_blocks\.(\d+)\.(resnets|upsamplers)\.(\d+)\.(.*)", rest)
    if m:
        b, kind, j, tail = int(m.group(1)), m.group(2), int(m.group(3)), m.group(4)
        per_block = num_res_blocks + 2  # the resnets, then one upsampler (not the last block)
        flat = b * per_block + (j if kind == "resnets" else num_res_blocks + 1)
        return f"{side}.upsamples.{flat}.{tail if kind == 'upsamplers' else resnet(tail)}"
    raise KeyError(name)


def posterior(model, video):
    dist = model.encode(video).latent_dist
    return dist.mean.numpy(), dist.logvar.numpy()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                      "fixtures", "wan_vae"))
    args = parser.parse_args()
    for place, (name, spec) in enumerate(MODELS.items()):
        root = os.path.join(args.out, name)
        model = build(spec, seed=10 * place)
        model.save_pretrained(os.path.join(root, "diffusers"))
        cfg = spec["config"]
        residual = cfg.get("is_residual", False)
        tensors = {to_wan_name(k, cfg["num_res_blocks"], residual): v.contiguous()
                   for k, v in model.state_dict().items()}
        os.makedirs(os.path.join(root, "wan"), exist_ok=True)
        save_file(tensors, os.path.join(root, "wan", "Wan2.2_VAE.safetensors" if residual
                                        else "Wan2.1_VAE.safetensors"))
        g = torch.Generator().manual_seed(10 * place + 1)
        z_dim = spec["config"]["z_dim"]
        factor = spec["config"].get("scale_factor_spatial", 8)
        io = {}
        h, w = spec["size"]
        with torch.no_grad():
            for frames in (5, 9):
                video = torch.rand(1, 3, frames, h, w, generator=g) * 2 - 1
                io[f"video_{frames}"] = video[0].numpy()
                mean, logvar = posterior(model, video)
                io[f"mean_{frames}"], io[f"logvar_{frames}"] = mean[0], logvar[0]
            for frames in (2, 3):
                latents = torch.randn(1, z_dim, frames, h // factor, w // factor, generator=g)
                io[f"latents_{frames}"] = latents[0].numpy()
                io[f"decoded_{frames}"] = model.decode(latents).sample[0].numpy()
                clamped = np.mean(np.abs(io[f"decoded_{frames}"]) >= 1.0)
                print(f"{name}: decode of {frames} frames, {clamped:.1%} of values clamped")
            th, tw, sh, sw = spec["tiling"]
            model.enable_tiling(tile_sample_min_height=th, tile_sample_min_width=tw,
                                tile_sample_stride_height=sh, tile_sample_stride_width=sw)
            h, w = spec["tiled_size"]
            video = torch.rand(1, 3, 5, h, w, generator=g) * 2 - 1
            io["video_tiled"] = video[0].numpy()
            mean, logvar = posterior(model, video)
            io["mean_tiled"], io["logvar_tiled"] = mean[0], logvar[0]
            latents = torch.randn(1, z_dim, 2, h // factor, w // factor, generator=g)
            io["latents_tiled"] = latents[0].numpy()
            io["decoded_tiled"] = model.decode(latents).sample[0].numpy()
            io["tiling"] = np.array(spec["tiling"])
        np.savez_compressed(os.path.join(root, "io.npz"), **io)
        print(f"wrote {root}")


if __name__ == "__main__":
    main()
