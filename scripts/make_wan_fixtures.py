"""Writes the Wan parity fixtures of tests/fixtures/wan/: tiny random diffusers models,
saved in the diffusers and the original Wan 2.1 layout, with inputs and diffusers' outputs.

Run by hand, with torch and diffusers installed (CI never needs them):

    pip install torch diffusers safetensors
    python scripts/make_wan_fixtures.py            # writes tests/fixtures/wan/

Each model directory `<name>/diffusers/` is diffusers' own `save_pretrained`;
`<name>/wan/` holds the same tensors under the original Wan 2.1 names (written here
with the name map of Wan's `convert_wan_to_diffusers.py`, reversed, independently of
vidax_eqx) and a Wan-style `config.json` that, like the real ones, leaves out
`text_dim`, `patch_size`, `qk_norm`, `cross_attn_norm` and `window_size`.
`<name>/io.npz` holds the inputs and `out` (diffusers' float32 output), and
`out_padded`, diffusers on the text zero-padded to 512 tokens, which is what Wan's own
forward computes (it pads before its text embedding).

The models (2 layers, width 64, 8 heads):

- `t2v`: patch (1, 2, 2), cross-attention norm (Wan 2.1 T2V).
- `t2v_patch2`: patch (2, 2, 2), no cross-attention norm.
- `t2v_no_qk_norm`: Wan's `qk_norm=False`: diffusers' attention norms replaced by
    the identity after construction (diffusers >= 0.35 always builds them; its
    `qk_norm` config key is not used), the config saying `qk_norm: null`.
- `i2v`: the image branch (image_dim 24, `added_kv_proj_dim` 64), 36 -> 16 channels
    as Wan I2V; diffusers hard-codes 512 text tokens for it.

"""

import argparse
import json
import os
import re

import numpy as np
import torch
from diffusers import WanTransformer3DModel
from safetensors.torch import load_file, save_file


MODELS = {
    "t2v": dict(
        config=dict(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=8,
                    in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=96,
                    num_layers=2, cross_attn_norm=True, eps=1e-6),
        video=(4, 3, 6, 10), text_len=7, image_len=None,
    ),
    "t2v_patch2": dict(
        config=dict(patch_size=(2, 2, 2), num_attention_heads=8, attention_head_dim=8,
                    in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=96,
                    num_layers=2, cross_attn_norm=False, eps=1e-6),
        video=(4, 4, 6, 6), text_len=5, image_len=None,
    ),
    "t2v_no_qk_norm": dict(
        config=dict(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=8,
                    in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=96,
                    num_layers=2, cross_attn_norm=True, eps=1e-6, qk_norm=None),
        video=(4, 2, 4, 6), text_len=6, image_len=None, no_qk_norm=True,
    ),
    "i2v": dict(
        config=dict(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=8,
                    in_channels=12, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=96,
                    num_layers=2, cross_attn_norm=True, eps=1e-6, image_dim=24,
                    added_kv_proj_dim=64),
        video=(12, 2, 4, 6), text_len=512, image_len=5,
    ),
}

# diffusers name -> Wan 2.1 name (the reverse of diffusers' conversion script).
_TO_WAN = [
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.image_embedder\.norm1\.", "img_emb.proj.0."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "img_emb.proj.1."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.2\.", "img_emb.proj.3."),
    (r"^condition_embedder\.image_embedder\.norm2\.", "img_emb.proj.4."),
    (r"^proj_out\.", "head.head."),
    (r"^scale_shift_table$", "head.modulation"),
    (r"\.attn1\.", ".self_attn."),
    (r"\.attn2\.", ".cross_attn."),
    (r"\.to_q\.", ".q."),
    (r"\.to_k\.", ".k."),
    (r"\.to_v\.", ".v."),
    (r"\.to_out\.0\.", ".o."),
    (r"\.add_k_proj\.", ".k_img."),
    (r"\.add_v_proj\.", ".v_img."),
    (r"\.norm_added_k\.", ".norm_k_img."),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."),
    (r"\.ffn\.net\.2\.", ".ffn.2."),
    (r"^(blocks\.\d+)\.norm2\.", r"\1.norm3."),
    (r"^(blocks\.\d+)\.scale_shift_table$", r"\1.modulation"),
]


def to_wan_name(name: str) -> str:
    for pattern, replacement in _TO_WAN:
        name = re.sub(pattern, replacement, name)
    return name


def wan_config(config: dict) -> dict:
    """A Wan 2.1-style config.json: only the keys the real releases carry."""
    return {
        "_class_name": "WanModel",
        "_diffusers_version": "0.30.0",
        "model_type": "i2v" if config.get("image_dim") else "t2v",
        "text_len": 512,
        "in_dim": config["in_channels"],
        "dim": config["num_attention_heads"] * config["attention_head_dim"],
        "ffn_dim": config["ffn_dim"],
        "freq_dim": config["freq_dim"],
        "out_dim": config["out_channels"],
        "num_heads": config["num_attention_heads"],
        "num_layers": config["num_layers"],
        "eps": config["eps"],
        **({"qk_norm": False} if config.get("qk_norm", "rms_norm_across_heads") is None else {}),
    }


def make(name: str, spec: dict, root: str, seed: int) -> None:
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**spec["config"]).eval()
    if spec.get("no_qk_norm"):
        # Wan's qk_norm=False: diffusers' WanAttention always builds the norms (its
        # config's qk_norm is not used), so they are replaced by the identity here.
        for block in model.blocks:
            for attn in (block.attn1, block.attn2):
                attn.norm_q = attn.norm_k = torch.nn.Identity()
    with torch.no_grad():  # move every parameter off its init (norm weights of 1, ...)
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    folder = os.path.join(root, name)
    model.save_pretrained(os.path.join(folder, "diffusers"))

    tensors = load_file(os.path.join(folder, "diffusers", "diffusion_pytorch_model.safetensors"))
    wan = {to_wan_name(k): v.contiguous() for k, v in tensors.items()}
    assert len(wan) == len(tensors), "two diffusers names map to one Wan name"
    os.makedirs(os.path.join(folder, "wan"), exist_ok=True)
    save_file(wan, os.path.join(folder, "wan", "diffusion_pytorch_model.safetensors"))
    with open(os.path.join(folder, "wan", "config.json"), "w") as f:
        json.dump(wan_config(spec["config"]), f, indent=2)

    g = torch.Generator().manual_seed(seed + 1)
    batch = 2
    x = torch.randn(batch, *spec["video"], generator=g)
    timestep = torch.tensor([999.0, 137.0])
    context = torch.randn(batch, spec["text_len"], spec["config"]["text_dim"], generator=g)
    io = {"x": x, "timestep": timestep, "context": context}
    kwargs = {}
    if spec["image_len"]:
        io["context_image"] = torch.randn(batch, spec["image_len"], spec["config"]["image_dim"],
                                          generator=g)
        kwargs["encoder_hidden_states_image"] = io["context_image"]
    with torch.no_grad():
        io["out"] = model(x, timestep, context, return_dict=False, **kwargs)[0]
        if not spec["image_len"]:  # Wan's forward: the text zero-padded to text_len = 512
            padded = torch.nn.functional.pad(context, (0, 0, 0, 512 - context.shape[1]))
            io["out_padded"] = model(x, timestep, padded, return_dict=False)[0]
    np.savez_compressed(os.path.join(folder, "io.npz"),
                        **{k: v.numpy().astype(np.float32) for k, v in io.items()})
    print(f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters -> {folder}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--out", default=os.path.join(here, "..", "tests", "fixtures", "wan"))
    args = p.parse_args()
    torch.set_default_dtype(torch.float32)
    for i, (name, spec) in enumerate(MODELS.items()):
        make(name, spec, os.path.abspath(args.out), seed=10 * i)


if __name__ == "__main__":
    main()
