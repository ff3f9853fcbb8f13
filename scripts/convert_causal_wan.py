"""Converts a Self-Forcing or CausVid checkpoint (a causal Wan 2.1 in a PyTorch pickle) into
a folder that `models.WanTransformer3D.from_pretrained` loads, without PyTorch from then on:
`config.json` (Wan's layout) and `diffusion_pytorch_model.safetensors`.

Run by hand, with torch installed (reading a pickle needs it; the library never does):

    pip install torch==2.13.0 safetensors numpy
    python scripts/convert_causal_wan.py self_forcing_dmd.pt --out /models/self-forcing-1.3b
    python scripts/convert_causal_wan.py causvid/model.pt --key generator --out /models/causvid

What the checkpoints hold (Self-Forcing's `inference.py` and CausVid's load them this way):
a dict whose `generator_ema` (Self-Forcing's default) or `generator` entry is the
state dict of `WanDiffusionWrapper`, whose `model` is a `CausalWanModel`: Wan 2.1's
parameter names (`blocks.0.self_attn.q.weight`, `head.head.weight`, ...) under the prefix
`model.`. A causal Wan has exactly Wan's parameters (its causality is in the attention
mask, which `models.BlockCausal` gives at run time), so after the prefix is taken off the
tensors load as an original Wan 2.1 checkpoint. Prefixes that wrappers add
(`_fsdp_wrapped_module.`, `_orig_mod.`, `module.`) are taken off too. The config is Wan
2.1 T2V's, its sizes read off the tensors (`num_heads = dim / 128`, Wan's head size).

Then stream it: `pipe = WanPipeline(..., transformer=WanTransformer3D.from_pretrained(out))`
with the Wan 2.1 1.3B pipeline's other components, and `pipe.stream(prompt,
chunk_frames=3)` (Self-Forcing's and CausVid's blocks of 3 latent frames, four steps of
`sampling.FewStep`).

Verified offline (no network here): a state dict written by torch with these names, from
a random `WanTransformer3D`'s Wan-layout `state_dict`, converts and loads back equal. Not
verified: the released files themselves (not downloaded).
"""

import argparse
import json
import os
import re

import numpy as np


PREFIXES = re.compile(r"^(?:(?:module|_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module|model)\.)+")
HEAD_DIM = 128  # every Wan 2.1 model's


def wan_names(state: dict) -> dict:
    """The tensors under Wan's names: the wrappers' prefixes taken off each name."""
    out = {}
    for name, tensor in state.items():
        wan = PREFIXES.sub("", name)
        if wan in out:
            raise ValueError(f"two tensors are named {wan!r} once their prefixes are taken off")
        out[wan] = tensor
    if "patch_embedding.weight" not in out or "head.head.weight" not in out:
        raise ValueError(f"not a Wan state dict: no patch_embedding / head.head among {sorted(out)[:8]}")
    return out


def config_of(tensors: dict) -> dict:
    """Wan 2.1 T2V's `config.json`, the sizes read off the tensors."""
    dim = tensors["patch_embedding.weight"].shape[0]
    blocks = {int(m.group(1)) for k in tensors if (m := re.match(r"blocks\.(\d+)\.", k))}
    return {"_class_name": "WanModel", "model_type": "t2v", "dim": dim,
            "ffn_dim": tensors["blocks.0.ffn.0.weight"].shape[0], "freq_dim": tensors["time_embedding.0.weight"].shape[1],
            "num_heads": dim // HEAD_DIM, "num_layers": len(blocks),
            "in_dim": tensors["patch_embedding.weight"].shape[1], "out_dim": tensors["head.head.weight"].shape[0] // 4,
            "text_len": 512, "eps": 1e-6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="the .pt file (Self-Forcing's self_forcing_dmd.pt, CausVid's model.pt)")
    parser.add_argument("--key", default="generator_ema",
                        help="the entry holding the model (default generator_ema; CausVid: generator)")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--num-heads", type=int, default=None, help="default: dim / 128")
    args = parser.parse_args()

    import torch
    from safetensors.numpy import save_file

    checkpoint = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    state = checkpoint.get(args.key, checkpoint) if isinstance(checkpoint, dict) else checkpoint
    if not isinstance(state, dict):
        raise ValueError(f"{args.checkpoint}: no state dict under {args.key!r}; its keys: {list(checkpoint)[:8]}")
    tensors = {k: v.detach().to(torch.float32 if v.dtype == torch.bfloat16 else v.dtype).numpy()
               for k, v in wan_names(state).items()}
    config = config_of(tensors)
    if args.num_heads is not None:
        config["num_heads"] = args.num_heads
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              os.path.join(args.out, "diffusion_pytorch_model.safetensors"))
    print(f"{len(tensors)} tensors, {config['num_layers']} blocks, dim {config['dim']} -> {args.out}")


if __name__ == "__main__":
    main()
