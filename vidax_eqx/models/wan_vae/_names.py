"""The Wan VAE's parameter names: this library's field paths to diffusers' names and to
the original Wan VAEs' (`WanVAE_` of Wan 2.1's `vae.py` and Wan 2.2's `vae2_2.py`, the
`Wan2.1_VAE.pth` / `Wan2.2_VAE.pth` releases converted to `.safetensors`)."""

import re
from collections.abc import Callable

from ._config import WanVAEConfig


def _diffusers(name: str) -> str:
    # diffusers' resampling is `nn.Sequential(upsample-or-pad, Conv2d)`: the conv is `.1`.
    return re.sub(r"\.resample\.(weight|bias)$", r".resample.1.\1", name)


_RESNET = (("norm1", "residual.0"), ("conv1", "residual.2"), ("norm2", "residual.3"),
           ("conv2", "residual.6"), ("conv_shortcut", "shortcut"))


def _wan(name: str, num_res_blocks: int, residual: bool) -> str:
    """diffusers' name -> the original Wan name: `residual.N` inside a residual block,
    `middle`, `head`, `conv1` / `conv2`; Wan 2.1's levels flat `downsamples` / `upsamples`
    sequences, Wan 2.2's one block per level holding its own `downsamples` / `upsamples`
    sequence (the residual blocks, then the resampling)."""

    def resnet(rest: str) -> str:
        for ours, theirs in _RESNET:
            if rest.startswith(ours + "."):
                return theirs + rest[len(ours):]
        return rest  # attention: norm, to_qkv, proj

    top = {"quant_conv.": "conv1.", "post_quant_conv.": "conv2."}
    for ours, theirs in top.items():
        if name.startswith(ours):
            return theirs + name[len(ours):]
    side, rest = name.split(".", 1)
    for ours, theirs in (("conv_in.", "conv1."), ("norm_out.", "head.0."), ("conv_out.", "head.2.")):
        if rest.startswith(ours):
            return f"{side}.{theirs}{rest[len(ours):]}"
    m = re.match(r"mid_block\.(resnets|attentions)\.(\d+)\.(.*)", rest)
    if m:
        kind, i, tail = m.groups()
        return f"{side}.middle.1.{tail}" if kind == "attentions" else f"{side}.middle.{2 * int(i)}.{resnet(tail)}"
    if residual:
        m = re.match(r"(down|up)_blocks\.(\d+)\.(resnets\.(\d+)|downsampler|upsampler)\.(.*)", rest)
        if m:
            kind, i, part, j, tail = m.groups()
            seq = f"{kind}samples"
            if part.startswith("resnets"):
                return f"{side}.{seq}.{i}.{seq}.{j}.{resnet(tail)}"
            last = num_res_blocks if kind == "down" else num_res_blocks + 1
            return f"{side}.{seq}.{i}.{seq}.{last}.{tail}"
        return name
    m = re.match(r"down_blocks\.(\d+)\.(.*)", rest)
    if m:
        return f"{side}.downsamples.{m.group(1)}.{resnet(m.group(2))}"
    m = re.match(r"up_blocks\.(\d+)\.(resnets|upsamplers)\.(\d+)\.(.*)", rest)
    if m:
        block, kind, j, tail = int(m.group(1)), m.group(2), int(m.group(3)), m.group(4)
        # Each up block is num_res_blocks + 1 residual blocks then one resampling.
        flat = block * (num_res_blocks + 2) + (j if kind == "resnets" else num_res_blocks + 1)
        return f"{side}.upsamples.{flat}.{resnet(tail) if kind == 'resnets' else tail}"
    return name


def checkpoint_name(config: WanVAEConfig) -> Callable[[str, str], str]:
    """The `rename` of `load_state_dict` / `state_dict` for a Wan VAE of `config`: under
    `"diffusers"` diffusers' names, under `"wan"` the original Wan names (Wan 2.1's or
    2.2's layout; a config with `attn_scales`, which no release has, keeps diffusers'
    names)."""

    def rename(name: str, naming: str) -> str:
        name = _diffusers(name)
        if naming == "wan" and not config.attn_scales:
            return _wan(name, config.num_res_blocks, config.is_residual)
        return name

    return rename
