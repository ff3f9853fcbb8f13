"""Writes the LoRA parity fixtures of tests/fixtures/lora/: two tiny random LoRA adapters
of the Wan 2.1 T2V test model (tests/fixtures/wan/t2v/diffusers, float32), adapter "a"
in three file layouts, and diffusers' outputs with them loaded.

Run by hand, with torch, diffusers and peft installed (CI never needs them); written with
torch 2.13.0 (CPU), diffusers 0.42.1 and peft 0.21.2, after scripts/make_wan_fixtures.py
(it reads tests/fixtures/wan/t2v/):

    pip install torch diffusers peft safetensors
    python scripts/make_lora_fixtures.py

The adapters (lora_A and lora_B both seeded random normal, `STD_A` and `STD_B`, in
place of PEFT's zero init of B, so that adapter "a" changes the output by about 20%):

- "a" (seed 1): rank 4, lora_alpha 8 (scale alpha / rank = 2), on every block's
    `attn1.to_q`, `attn1.to_k`, `attn1.to_v`, `attn1.to_out.0`, `attn2.to_q`, `attn2.to_k`,
    `attn2.to_v`, `attn2.to_out.0`, `ffn.net.0.proj`, `ffn.net.2`, and on the non-block
    `condition_embedder.time_proj` (Wan's `time_projection.1`).
- "b" (seed 2): rank 2, lora_alpha 2, only on `blocks.1.attn1.to_q` and `blocks.1.attn1.to_v`
    (block 0 has none).

The files:

- `peft/pytorch_lora_weights.safetensors`: "a" as diffusers users save it,
    `WanPipeline.save_lora_weights(dir, transformer_lora_layers=get_peft_model_state_dict(...),
    transformer_lora_adapter_metadata=<the LoraConfig as a dict>)`: keys
    `transformer.blocks.0.attn1.to_q.lora_A.weight` (rank, in), `...lora_B.weight` (out, rank),
    `transformer.condition_embedder.time_proj.lora_A.weight`, ...; the safetensors metadata
    has `format: pt` and `lora_adapter_metadata`, a JSON of the LoraConfig with every key
    prefixed `transformer.` (`transformer.r: 4`, `transformer.lora_alpha: 8`, its
    `target_modules` sorted, ...), which
    `load_lora_weights` reads back (without it the alpha would default to the rank).
- `peft_b/pytorch_lora_weights.safetensors`: "b", saved the same way.
- `kohya/lora.safetensors`: "a" in the kohya / musubi-tuner layout: the original Wan names
    (`to_wan_name` of make_wan_fixtures.py) with dots as underscores, prefixed `lora_unet_`:
    `lora_unet_blocks_0_self_attn_q.lora_down.weight` (= lora_A), `.lora_up.weight`
    (= lora_B), `.alpha` (a 0-d float32 tensor, 8.0); `lora_unet_time_projection_1.*` for
    the time projection.
- `comfy/lora.safetensors`: "a" in the ComfyUI layout, Wan names prefixed `diffusion_model.`
    with PEFT's suffixes: `diffusion_model.blocks.0.self_attn.q.lora_A.weight`,
    `...lora_B.weight`, `diffusion_model.blocks.0.self_attn.q.alpha` (8.0);
    `diffusion_model.time_projection.1.*` for the time projection.

The time projection in the kohya and ComfyUI files: diffusers 0.42.1 converts those
layouts (`WanPipeline.lora_state_dict`) only as far as the blocks; on the whole file its
kohya converter fails (it only knows `lora_unet_blocks_*` keys) and its ComfyUI converter
raises on the left-over `time_projection.1.alpha` (it has no alpha for that layer). So
`out_kohya` and `out_comfy` are computed from each file by diffusers' converter on the
file's block entries, the file's `time_projection.1` entries converted here (lora_A times
alpha / rank, as diffusers does for the blocks), the two loaded together with
`load_lora_adapter` (no metadata, so alpha = rank); the script asserts that diffusers
still fails on the whole files, so a newer diffusers that reads them is noticed.

`io.npz` (float32; every output by diffusers with the LoRA loaded from the files above
into a fresh copy of the base model, through a `WanPipeline` holding only the transformer):

- `x`, `timestep`, `context`: the inputs, copied from tests/fixtures/wan/t2v/io.npz;
    the model is called as `model(x, timestep, context, return_dict=False)[0]`.
- `out_base`: the base model (that io.npz's `out`, to float rounding: 3e-7 relative).
- `out_a`: `pipe.load_lora_weights(peft/, adapter_name="a")`.
- `out_a_half`: then `pipe.set_adapters(["a"], [0.5])`.
- `out_ab`: then `pipe.load_lora_weights(peft_b/, adapter_name="b")`,
    `pipe.set_adapters(["a", "b"], [1.0, 0.7])`.
- `out_a_fused`: a fresh pipeline, "a" loaded, `pipe.fuse_lora(lora_scale=1.0)`.
- `out_kohya`, `out_comfy`: kohya/ and comfy/ loaded as said above.

Asserted here: `out_a` differs from `out_base` and `out_ab` from `out_a`; `out_a_fused`
equals `out_a` to 1e-5, `out_kohya` and `out_comfy` equal `out_a` to 1e-6 (relative norms).
Measured (|u - v| / |v|): out_a vs out_base 0.19, out_a_half vs out_a 0.096, out_ab vs
out_a 0.013, out_a_fused vs out_a 3e-7, out_kohya and out_comfy vs out_a 0 (bit-equal:
alpha / rank = 2 is folded into lora_A exactly). The output is deterministic (the PEFT
files up to the order in which safetensors writes their two metadata keys, which varies).
"""

import json
import os
import sys

import numpy as np
import peft
import torch
from diffusers import WanPipeline, WanTransformer3DModel
from peft import LoraConfig, get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_wan_fixtures import to_wan_name  # noqa: E402


HERE = os.path.dirname(os.path.abspath(__file__))
BASE = os.path.join(HERE, "..", "tests", "fixtures", "wan", "t2v")
OUT = os.path.join(HERE, "..", "tests", "fixtures", "lora")

BLOCK_TARGETS = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                 "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
                 "ffn.net.0.proj", "ffn.net.2"]
ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, seed=1,
              target_modules=BLOCK_TARGETS + ["condition_embedder.time_proj"]),
    "b": dict(r=2, lora_alpha=2, seed=2,
              target_modules=["blocks.1.attn1.to_q", "blocks.1.attn1.to_v"]),
}
STD_A = 0.3   # lora_A ~ N(0, STD_A^2)
STD_B = 0.02  # lora_B ~ N(0, STD_B^2)
INPUTS = ("x", "timestep", "context")


def base_model() -> WanTransformer3DModel:
    return WanTransformer3DModel.from_pretrained(os.path.join(BASE, "diffusers"),
                                                 torch_dtype=torch.float32).eval()


def pipeline() -> WanPipeline:
    """A WanPipeline around a fresh base model, without VAE, text encoder or scheduler."""
    return WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None,
                       transformer=base_model())


def run(model: WanTransformer3DModel, io: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(io["x"], io["timestep"], io["context"], return_dict=False)[0]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def save_peft(name: str, folder: str) -> dict:
    """Adapter `name` with seeded random lora_A and lora_B, saved as diffusers users do;
    returns its tensors under diffusers' names (no `transformer.` prefix)."""
    spec = ADAPTERS[name]
    model = base_model()
    model.add_adapter(LoraConfig(r=spec["r"], lora_alpha=spec["lora_alpha"],
                                 target_modules=spec["target_modules"]), adapter_name=name)
    g = torch.Generator().manual_seed(spec["seed"])
    with torch.no_grad():  # in module order, so the draw is deterministic
        for module_name, module in model.named_modules():
            if hasattr(module, "lora_A") and name in module.lora_A:
                module.lora_A[name].weight.copy_(
                    STD_A * torch.randn(module.lora_A[name].weight.shape, generator=g))
                module.lora_B[name].weight.copy_(
                    STD_B * torch.randn(module.lora_B[name].weight.shape, generator=g))
    layers = get_peft_model_state_dict(model, adapter_name=name)
    metadata = model.peft_config[name].to_dict()
    metadata["target_modules"] = sorted(metadata["target_modules"])  # a set: fix the order
    WanPipeline.save_lora_weights(folder, transformer_lora_layers=layers,
                                  transformer_lora_adapter_metadata=metadata)
    return {k: v.detach().clone().contiguous() for k, v in layers.items()}


def save_kohya_comfy(layers: dict, alpha: float) -> None:
    """Adapter tensors (diffusers' names) in the kohya and the ComfyUI layouts."""
    kohya, comfy = {}, {}
    for key, value in layers.items():
        module, kind = key.rsplit(".lora_", 1)  # "blocks.0.attn1.to_q", "A.weight"
        wan = to_wan_name(module + ".")[:-1]    # "blocks.0.self_attn.q"
        down_up = {"A.weight": "lora_down.weight", "B.weight": "lora_up.weight"}[kind]
        kohya[f"lora_unet_{wan.replace('.', '_')}.{down_up}"] = value
        comfy[f"diffusion_model.{wan}.lora_{kind}"] = value
        kohya[f"lora_unet_{wan.replace('.', '_')}.alpha"] = torch.tensor(float(alpha))
        comfy[f"diffusion_model.{wan}.alpha"] = torch.tensor(float(alpha))
    for layout, tensors in (("kohya", kohya), ("comfy", comfy)):
        os.makedirs(os.path.join(OUT, layout), exist_ok=True)
        save_file(tensors, os.path.join(OUT, layout, "lora.safetensors"))


def load_non_diffusers(path: str, time_prefix: str, down: str, up: str) -> dict:
    """`path` (kohya or ComfyUI) as diffusers keys: diffusers' own conversion of the block
    entries, the time projection's converted here (lora_A times alpha / rank)."""
    tensors = load_file(path)
    try:  # diffusers 0.42.1 cannot convert these files whole (see the docstring)
        # copies: diffusers' ComfyUI converter scales some tensors of its input in place
        WanPipeline.lora_state_dict({k: v.clone() for k, v in tensors.items()})
    except Exception as e:  # noqa: BLE001
        print(f"  diffusers on the whole {os.path.relpath(path, OUT)}: {type(e).__name__}")
    else:
        raise AssertionError(f"diffusers now reads {path} whole: use that")
    time = {k: tensors.pop(k) for k in list(tensors) if k.startswith(time_prefix)}
    state = WanPipeline.lora_state_dict(tensors)
    assert all(k.startswith("transformer.blocks.") for k in state)
    a = time[f"{time_prefix}.{down}.weight"]
    state["transformer.condition_embedder.time_proj.lora_A.weight"] = (
        a * time[f"{time_prefix}.alpha"].item() / a.shape[0])
    state["transformer.condition_embedder.time_proj.lora_B.weight"] = time[f"{time_prefix}.{up}.weight"]
    return state


def main() -> None:
    torch.set_default_dtype(torch.float32)
    os.makedirs(OUT, exist_ok=True)
    base_io = np.load(os.path.join(BASE, "io.npz"))
    io = {k: torch.from_numpy(base_io[k]) for k in INPUTS}

    layers_a = save_peft("a", os.path.join(OUT, "peft"))
    save_peft("b", os.path.join(OUT, "peft_b"))
    save_kohya_comfy(layers_a, ADAPTERS["a"]["lora_alpha"])
    peft_file = os.path.join(OUT, "peft", "pytorch_lora_weights.safetensors")
    with safe_open(peft_file, "pt") as f:
        metadata = f.metadata()
    print("peft file metadata:", json.dumps(metadata, indent=1))
    config = json.loads(metadata["lora_adapter_metadata"])
    assert config["transformer.lora_alpha"] == 8 and config["transformer.r"] == 4

    out = {}
    out["out_base"] = run(base_model(), io)
    assert rel(out["out_base"], torch.from_numpy(base_io["out"])) < 1e-6  # its `out`, to rounding

    pipe = pipeline()
    pipe.load_lora_weights(os.path.join(OUT, "peft"), adapter_name="a")
    out["out_a"] = run(pipe.transformer, io)
    pipe.set_adapters(["a"], [0.5])
    out["out_a_half"] = run(pipe.transformer, io)
    pipe.load_lora_weights(os.path.join(OUT, "peft_b"), adapter_name="b")
    pipe.set_adapters(["a", "b"], [1.0, 0.7])
    out["out_ab"] = run(pipe.transformer, io)
    # peft warns, loading "b", that the keys of "a" are missing from b's file; "a" is intact:
    pipe.set_adapters(["a"], [1.0])
    assert rel(run(pipe.transformer, io), out["out_a"]) < 1e-6

    pipe = pipeline()
    pipe.load_lora_weights(os.path.join(OUT, "peft"), adapter_name="a")
    pipe.fuse_lora(lora_scale=1.0)
    out["out_a_fused"] = run(pipe.transformer, io)

    for layout, time_prefix, down, up in (
            ("kohya", "lora_unet_time_projection_1", "lora_down", "lora_up"),
            ("comfy", "diffusion_model.time_projection.1", "lora_A", "lora_B")):
        state = load_non_diffusers(os.path.join(OUT, layout, "lora.safetensors"), time_prefix, down, up)
        model = base_model()
        model.load_lora_adapter(state, prefix="transformer", adapter_name="a")
        out[f"out_{layout}"] = run(model, io)

    d = {k: rel(out[k], out["out_a"]) for k in ("out_base", "out_a_half", "out_ab", "out_a_fused",
                                                   "out_kohya", "out_comfy")}
    d["out_a vs out_base"] = rel(out["out_a"], out["out_base"])
    for k, v in d.items():
        print(f"  |{k} - out_a| / |out_a| = {v:.3e}" if " vs " not in k
              else f"  |out_a - out_base| / |out_base| = {v:.3e}")
    assert 0.05 < d["out_a vs out_base"] < 0.3, d
    assert d["out_ab"] > 1e-2, d
    assert d["out_a_fused"] < 1e-5, d
    assert d["out_kohya"] < 1e-6 and d["out_comfy"] < 1e-6, d

    np.savez_compressed(os.path.join(OUT, "io.npz"),
                        **{k: v.numpy().astype(np.float32) for k, v in {**io, **out}.items()})
    print(f"torch {torch.__version__}, peft {peft.__version__} -> {os.path.abspath(OUT)}")


if __name__ == "__main__":
    main()
