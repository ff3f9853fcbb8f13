"""Writes tests/fixtures/vsa/: a tiny random video sparse attention (VSA) Wan 2.1 T2V
checkpoint in the diffusers layout, as FastVideo distills them (every block with a
`to_gate_compress` projection, the gate of VSA's coarse output).

NumPy only (the .safetensors file is written here: an 8-byte little-endian header
length, the JSON header, the raw little-endian tensors); no torch, no vidax_eqx.
Deterministic (seed 26):

    python scripts/make_vsa_fixtures.py

Writes `tests/fixtures/vsa/t2v/config.json` (diffusers' `WanTransformer3DModel`
config) and `diffusion_pytorch_model.safetensors`: 2 layers, width 32 (4 heads of 8),
ffn 48, 4 latent channels in and out, text width 16, freq_dim 16, patch (1, 2, 2).
The tensors are diffusers' names plus `blocks.N.to_gate_compress.weight` (32, 32) and
`.bias` (32,) (FastVideo's block-level name). Weights are normal with a standard
deviation of `1 / sqrt(fan_in)` (biases 0.1), norms `1 + 0.1 N(0, 1)`, modulation
tables `0.3 N(0, 1)`: random, so that every term of a block (the gate included)
matters in the tests' comparison.
"""

import json
import os

import numpy as np

OUT = os.path.join(os.path.dirname(__file__), os.pardir, "tests", "fixtures", "vsa", "t2v")
CONFIG = {
    "_class_name": "WanTransformer3DModel",
    "_diffusers_version": "0.35.0",
    "added_kv_proj_dim": None,
    "attention_head_dim": 8,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 48,
    "freq_dim": 16,
    "image_dim": None,
    "in_channels": 4,
    "num_attention_heads": 4,
    "num_layers": 2,
    "out_channels": 4,
    "patch_size": [1, 2, 2],
    "pos_embed_seq_len": None,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
    "text_dim": 16,
}


def shapes(c) -> dict:
    """Every tensor of the diffusers T2V model with VSA gates: name -> shape."""
    dim = c["num_attention_heads"] * c["attention_head_dim"]
    pt, ph, pw = c["patch_size"]
    out = {
        "patch_embedding.weight": (dim, c["in_channels"], pt, ph, pw),
        "patch_embedding.bias": (dim,),
        "condition_embedder.time_embedder.linear_1.weight": (dim, c["freq_dim"]),
        "condition_embedder.time_embedder.linear_1.bias": (dim,),
        "condition_embedder.time_embedder.linear_2.weight": (dim, dim),
        "condition_embedder.time_embedder.linear_2.bias": (dim,),
        "condition_embedder.time_proj.weight": (6 * dim, dim),
        "condition_embedder.time_proj.bias": (6 * dim,),
        "condition_embedder.text_embedder.linear_1.weight": (dim, c["text_dim"]),
        "condition_embedder.text_embedder.linear_1.bias": (dim,),
        "condition_embedder.text_embedder.linear_2.weight": (dim, dim),
        "condition_embedder.text_embedder.linear_2.bias": (dim,),
        "scale_shift_table": (1, 2, dim),
        "proj_out.weight": (c["out_channels"] * pt * ph * pw, dim),
        "proj_out.bias": (c["out_channels"] * pt * ph * pw,),
    }
    for n in range(c["num_layers"]):
        b = f"blocks.{n}."
        out[b + "scale_shift_table"] = (1, 6, dim)
        for attn in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                out[f"{b}{attn}.{proj}.weight"] = (dim, dim)
                out[f"{b}{attn}.{proj}.bias"] = (dim,)
            out[f"{b}{attn}.norm_q.weight"] = (dim,)
            out[f"{b}{attn}.norm_k.weight"] = (dim,)
        out[b + "norm2.weight"] = (dim,)
        out[b + "norm2.bias"] = (dim,)
        out[b + "ffn.net.0.proj.weight"] = (c["ffn_dim"], dim)
        out[b + "ffn.net.0.proj.bias"] = (c["ffn_dim"],)
        out[b + "ffn.net.2.weight"] = (dim, c["ffn_dim"])
        out[b + "ffn.net.2.bias"] = (dim,)
        out[b + "to_gate_compress.weight"] = (dim, dim)
        out[b + "to_gate_compress.bias"] = (dim,)
    return out


def tensors(c, seed: int = 26) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes(c).items():
        if name.endswith("scale_shift_table"):
            a = 0.3 * rng.standard_normal(shape)
        elif "norm" in name and name.endswith(".weight"):
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            a = 0.1 * rng.standard_normal(shape)
        else:
            fan_in = int(np.prod(shape[1:]))
            a = rng.standard_normal(shape) / np.sqrt(fan_in)
        out[name] = a.astype(np.float32)
    return out


def write_safetensors(path, arrays: dict) -> None:
    """The safetensors format: `u64` header length, JSON header (dtype, shape, byte
    offsets per tensor), then the tensors' bytes."""
    header, offset, blobs = {}, 0, []
    for name in sorted(arrays):
        data = np.ascontiguousarray(arrays[name], dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arrays[name].shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def main():
    os.makedirs(OUT, exist_ok=True)
    write_safetensors(os.path.join(OUT, "diffusion_pytorch_model.safetensors"), tensors(CONFIG))
    with open(os.path.join(OUT, "config.json"), "w", encoding="utf-8") as f:
        json.dump(CONFIG, f, indent=2)
        f.write("\n")
    print(f"wrote {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
