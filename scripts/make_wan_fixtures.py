"""Writes the Wan parity fixtures of tests/fixtures/wan/: tiny random diffusers models,
saved in the diffusers and the original Wan layout, with inputs and diffusers' outputs.

Run by hand, with torch and diffusers installed (CI never needs them); written with
torch 2.14.1 (CPU) and diffusers 0.42.1 (>= 0.35 is needed: Wan 2.2's per-token
timestep and `pos_embed_seq_len`):

    pip install torch diffusers safetensors
    python scripts/make_wan_fixtures.py            # writes every model of tests/fixtures/wan/
    python scripts/make_wan_fixtures.py --only ti2v a14b   # only these (the others untouched)

Each model directory `<name>/diffusers/` is diffusers' own `save_pretrained`;
`<name>/wan/` holds the same tensors under the original Wan names (written here
with the name map of Wan's `convert_wan_to_diffusers.py`, reversed, independently of
vidax_eqx) and a Wan-style `config.json` that, like the real ones, leaves out
`text_dim`, `patch_size`, `qk_norm`, `cross_attn_norm` and `window_size`.
`<name>/io.npz` holds the inputs and `out` (diffusers' float32 output), and for the
Wan 2.1 T2V models `out_padded`, diffusers on the text zero-padded to 512 tokens, which
is what Wan's own forward computes (it pads before its text embedding). A model's seed is
ten times its place in `MODELS`, so writing some models never changes the others.

The Wan 2.1 models (2 layers, width 64, 8 heads):

- `t2v`: patch (1, 2, 2), cross-attention norm (Wan 2.1 T2V).
- `t2v_patch2`: patch (2, 2, 2), no cross-attention norm.
- `t2v_no_qk_norm`: Wan's `qk_norm=False`: diffusers' attention norms replaced by
    the identity after construction (diffusers >= 0.35 always builds them; its
    `qk_norm` config key is not used), the config saying `qk_norm: null`.
- `i2v`: the image branch (image_dim 24, `added_kv_proj_dim` 64), 12 -> 4 channels
    (Wan I2V: 36 -> 16); diffusers hard-codes 512 text tokens for it.

The Wan 2.2 and FLF2V models are narrower (2 layers, width 32: 4 heads of 8, freq_dim
32, ffn 96), which keeps their files (two layouts and a gradient each) near 170 kB:

- `t2v_token_timestep`: the T2V model with a per-token timestep `(B, S)` (S patch
    tokens, frame-major as diffusers flattens them): sample 0 has Wan 2.2 TI2V's
    pattern (the first latent frame's tokens at 0, the others at 700), sample 1 random
    values in [0, 1000).
- `ti2v`: Wan 2.2 TI2V-5B in miniature: 48 -> 48 channels, patch (1, 2, 2), no image
    branch, per-token timesteps as above; Wan config `model_type: "ti2v"`.
- `flf2v`: Wan 2.1 FLF2V: the I2V model with `pos_embed_seq_len = 2 * image_len`
    (Wan's `img_emb.emb_pos`). diffusers takes the image features as `(2B, image_len,
    image_dim)` (first and last frame of each example) and views them as `(B, 2 *
    image_len, image_dim)`; `io.npz` stores `context_image` already viewed, the
    first frame's tokens then the last frame's. Wan config `model_type: "flf2v"`.
- `a14b`: Wan 2.2 T2V-A14B in miniature: two experts, same T2V config, different
    weights. `a14b/diffusers/` is a diffusers `WanPipeline` directory (`model_index.json`
    with `boundary_ratio` 0.875, `transformer/` the high-noise expert, `transformer_2/`
    the low-noise one); `a14b/wan/` is Wan 2.2's release layout, `high_noise_model/`
    (weights in two shards with `diffusion_pytorch_model.safetensors.index.json`) and
    `low_noise_model/`. `io.npz` has batch 3, timesteps 950, 875 (exactly the boundary)
    and 300; `out` routes each example as diffusers' `WanPipeline` does
    (`t >= boundary_ratio * 1000`: `transformer`, else `transformer_2`), `out_high` and
    `out_low` are each expert on every example.

Gradients (the Wan 2.2 and FLF2V models): `io.npz` holds a random `cotangent` (the
shape of `out`) and `grad_x`, the gradient of `sum(out * cotangent)` with respect to
`x`; `grads.safetensors` holds that loss's gradient with respect to every parameter,
under diffusers' names. For `a14b` the loss of each expert is `sum(out_high * cotangent)`
and `sum(out_low * cotangent)` over all three examples: `grad_x_high`, `grad_x_low` and
`grads_high.safetensors`, `grads_low.safetensors` (top of `a14b/`); its `grad_x` is the
routed output's.

"""

import argparse
import json
import os
import re

import diffusers
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
    # Wan 2.2 and FLF2V (width 32: two layouts and a gradient per model stay small).
    "t2v_token_timestep": dict(
        config=dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8,
                    in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=96,
                    num_layers=2, cross_attn_norm=True, eps=1e-6),
        video=(4, 3, 6, 10), text_len=7, image_len=None, timestep="token", grads=True,
    ),
    "ti2v": dict(
        config=dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8,
                    in_channels=48, out_channels=48, text_dim=32, freq_dim=32, ffn_dim=96,
                    num_layers=2, cross_attn_norm=True, eps=1e-6),
        video=(48, 3, 4, 6), text_len=7, image_len=None, timestep="token", grads=True,
        model_type="ti2v",
    ),
    "flf2v": dict(
        config=dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8,
                    in_channels=12, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=96,
                    num_layers=2, cross_attn_norm=True, eps=1e-6, image_dim=24,
                    added_kv_proj_dim=32, pos_embed_seq_len=10),
        video=(12, 2, 4, 6), text_len=512, image_len=5, grads=True, model_type="flf2v",
    ),
    "a14b": dict(
        config=dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8,
                    in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=96,
                    num_layers=2, cross_attn_norm=True, eps=1e-6),
        video=(4, 3, 6, 10), text_len=7, image_len=None, experts=True,
        timestep=(950.0, 875.0, 300.0), boundary_ratio=0.875,
    ),
}

NUM_TRAIN_TIMESTEPS = 1000  # diffusers' scheduler config and Wan's `num_train_timesteps`

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
    (r"^condition_embedder\.image_embedder\.pos_embed$", "img_emb.emb_pos"),
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


def wan_config(config: dict, model_type: str | None = None) -> dict:
    """A Wan-style config.json: only the keys the real releases carry."""
    return {
        "_class_name": "WanModel",
        "_diffusers_version": "0.30.0",
        "model_type": model_type or ("i2v" if config.get("image_dim") else "t2v"),
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


def build(spec: dict, seed: int) -> WanTransformer3DModel:
    """A random diffusers model of `spec`, every parameter moved off its init."""
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
    return model


def save_layouts(model: WanTransformer3DModel, spec: dict, diffusers_dir: str, wan_dir: str,
                 shards: int = 1) -> None:
    """diffusers' `save_pretrained` in `diffusers_dir`; the same tensors under Wan's names
    with a Wan config in `wan_dir`, in `shards` files (with an index when more than one)."""
    model.save_pretrained(diffusers_dir)
    tensors = load_file(os.path.join(diffusers_dir, "diffusion_pytorch_model.safetensors"))
    wan = {to_wan_name(k): v.contiguous() for k, v in tensors.items()}
    assert len(wan) == len(tensors), "two diffusers names map to one Wan name"
    os.makedirs(wan_dir, exist_ok=True)
    if shards == 1:
        save_file(wan, os.path.join(wan_dir, "diffusion_pytorch_model.safetensors"))
    else:  # as the large releases: consecutive names, shards of about equal bytes
        names = sorted(wan)
        total = sum(wan[k].numel() * wan[k].element_size() for k in names)
        files = [f"diffusion_pytorch_model-{i + 1:05d}-of-{shards:05d}.safetensors"
                 for i in range(shards)]
        weight_map, done = {}, 0
        for k in names:
            weight_map[k] = files[min(done * shards // total, shards - 1)]
            done += wan[k].numel() * wan[k].element_size()
        assert len(set(weight_map.values())) == shards
        for file in files:
            save_file({k: wan[k] for k in names if weight_map[k] == file},
                      os.path.join(wan_dir, file))
        with open(os.path.join(wan_dir, "diffusion_pytorch_model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(wan_dir, "config.json"), "w") as f:
        json.dump(wan_config(spec["config"], spec.get("model_type")), f, indent=2)


def token_timesteps(spec: dict, g: torch.Generator) -> torch.Tensor:
    """`(2, S)` per-token timesteps, S the patch tokens in diffusers' frame-major order:
    Wan 2.2 TI2V's pattern (the first latent frame's tokens at 0, the rest at 700) and
    random values in [0, 1000)."""
    pt, ph, pw = spec["config"]["patch_size"]
    _, f, h, w = spec["video"]
    per_frame = (h // ph) * (w // pw)
    S = (f // pt) * per_frame
    ti2v = torch.full((S,), 700.0)
    ti2v[:per_frame] = 0.0  # patch (1, ph, pw): one latent frame per token frame
    assert pt == 1
    return torch.stack([ti2v, 1000.0 * torch.rand(S, generator=g)])


def gradients(model: WanTransformer3DModel, x: torch.Tensor, cotangent: torch.Tensor,
              *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """`(out, grad_x, grads)`: the model's output and the gradients of
    `sum(out * cotangent)` with respect to `x` and to every parameter (diffusers' names)."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = model(x, *args, return_dict=False, **kwargs)[0]
    (out * cotangent).sum().backward()
    grads = {k: p.grad.detach().contiguous() for k, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    return out.detach(), x.grad.detach(), grads


def save_io(folder: str, io: dict) -> None:
    np.savez_compressed(os.path.join(folder, "io.npz"),
                        **{k: v.numpy().astype(np.float32) for k, v in io.items()})


def make(name: str, spec: dict, root: str, seed: int) -> None:
    if spec.get("experts"):
        return make_experts(name, spec, root, seed)
    model = build(spec, seed)
    folder = os.path.join(root, name)
    save_layouts(model, spec, os.path.join(folder, "diffusers"), os.path.join(folder, "wan"))

    g = torch.Generator().manual_seed(seed + 1)
    batch = 2
    x = torch.randn(batch, *spec["video"], generator=g)
    if not spec.get("grads"):  # the Wan 2.1 models
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
        save_io(folder, io)
        print(f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters -> {folder}")
        return

    context = torch.randn(batch, spec["text_len"], spec["config"]["text_dim"], generator=g)
    io = {"x": x, "context": context}
    kwargs = {}
    if spec["image_len"]:
        # FLF2V: per example the first frame's image tokens, then the last frame's; diffusers
        # takes them as (2B, image_len, image_dim) and views them back to this.
        io["context_image"] = torch.randn(batch, 2 * spec["image_len"], spec["config"]["image_dim"],
                                          generator=g)
        kwargs["encoder_hidden_states_image"] = io["context_image"].reshape(
            2 * batch, spec["image_len"], spec["config"]["image_dim"])
    if spec.get("timestep") == "token":
        io["timestep"] = token_timesteps(spec, g)
    else:
        io["timestep"] = torch.tensor([999.0, 137.0])
    with torch.no_grad():
        reference = model(x, io["timestep"], context, return_dict=False, **kwargs)[0]
    io["cotangent"] = torch.randn(reference.shape, generator=g)
    io["out"], io["grad_x"], grads = gradients(model, x, io["cotangent"], io["timestep"], context,
                                               **kwargs)
    assert torch.equal(io["out"], reference)
    assert set(grads) == set(load_file(os.path.join(folder, "diffusers",
                                                     "diffusion_pytorch_model.safetensors")))
    save_file(grads, os.path.join(folder, "grads.safetensors"))
    save_io(folder, io)
    print(f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters -> {folder}")


def make_experts(name: str, spec: dict, root: str, seed: int) -> None:
    """Wan 2.2 A14B: a high-noise and a low-noise expert, one config, two seeds."""
    high, low = build(spec, seed), build(spec, seed + 5)
    folder = os.path.join(root, name)
    pipeline = os.path.join(folder, "diffusers")
    save_layouts(high, spec, os.path.join(pipeline, "transformer"),
                 os.path.join(folder, "wan", "high_noise_model"), shards=2)
    save_layouts(low, spec, os.path.join(pipeline, "transformer_2"),
                 os.path.join(folder, "wan", "low_noise_model"))
    model_index = {
        "_class_name": "WanPipeline",
        "_diffusers_version": diffusers.__version__,
        "boundary_ratio": spec["boundary_ratio"],
        "expand_timesteps": False,
        "scheduler": [None, None],
        "text_encoder": [None, None],
        "tokenizer": [None, None],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"],
        "vae": [None, None],
    }
    with open(os.path.join(pipeline, "model_index.json"), "w") as f:
        json.dump(model_index, f, indent=2)

    g = torch.Generator().manual_seed(seed + 1)
    timestep = torch.tensor(spec["timestep"])
    batch = len(timestep)
    x = torch.randn(batch, *spec["video"], generator=g)
    context = torch.randn(batch, spec["text_len"], spec["config"]["text_dim"], generator=g)
    cotangent = torch.randn(batch, spec["config"]["out_channels"], *spec["video"][1:], generator=g)
    out_high, grad_x_high, grads_high = gradients(high, x, cotangent, timestep, context)
    out_low, grad_x_low, grads_low = gradients(low, x, cotangent, timestep, context)
    # diffusers' WanPipeline: `transformer` for t >= boundary_ratio * num_train_timesteps.
    high_noise = (timestep >= spec["boundary_ratio"] * NUM_TRAIN_TIMESTEPS)[:, None, None, None, None]
    assert high_noise.flatten().tolist() == [True, True, False]
    io = {"x": x, "timestep": timestep, "context": context, "cotangent": cotangent,
          "out": torch.where(high_noise, out_high, out_low), "out_high": out_high,
          "out_low": out_low, "grad_x": torch.where(high_noise, grad_x_high, grad_x_low),
          "grad_x_high": grad_x_high, "grad_x_low": grad_x_low}
    save_file(grads_high, os.path.join(folder, "grads_high.safetensors"))
    save_file(grads_low, os.path.join(folder, "grads_low.safetensors"))
    save_io(folder, io)
    print(f"{name}: 2 x {sum(p.numel() for p in high.parameters()):,} parameters -> {folder}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--out", default=os.path.join(here, "..", "tests", "fixtures", "wan"))
    p.add_argument("--only", nargs="+", choices=list(MODELS), metavar="NAME",
                   help=f"write only these models (default all: {', '.join(MODELS)})")
    args = p.parse_args()
    torch.set_default_dtype(torch.float32)
    for i, (name, spec) in enumerate(MODELS.items()):  # the seed is the place in MODELS
        if args.only is None or name in args.only:
            make(name, spec, os.path.abspath(args.out), seed=10 * i)


if __name__ == "__main__":
    main()
