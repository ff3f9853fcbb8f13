"""Wan's checkpoint names: the declarative table from this library's field names to
Wan's and diffusers' tensor names, and the detection of FastVideo's VSA gates."""

import os
import re


# Checkpoint names: the fields carry Wan's names, except where a module of `nn` serves a
# role that Wan spells as a `Sequential` index; diffusers renames most of the model.
# (pattern, wan replacement, diffusers replacement), applied to the generated names.
_NAMES = (
    (r"^time_projection\.", "time_projection.1.", "condition_embedder.time_proj."),
    (r"^time_embedding\.", "time_embedding.", "condition_embedder.time_embedder."),
    (r"^text_embedding\.net\.0\.proj\.", None, "condition_embedder.text_embedder.linear_1."),
    (r"^text_embedding\.net\.2\.", None, "condition_embedder.text_embedder.linear_2."),
    (r"^img_emb\.pos_embed$", "img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"),
    (r"^img_emb\.norm1\.", "img_emb.proj.0.", "condition_embedder.image_embedder.norm1."),
    (r"^img_emb\.ff\.0\.", "img_emb.proj.1.", None),
    (r"^img_emb\.ff\.2\.", "img_emb.proj.3.", None),
    (r"^img_emb\.ff\.", None, "condition_embedder.image_embedder.ff."),
    (r"^img_emb\.norm2\.", "img_emb.proj.4.", "condition_embedder.image_embedder.norm2."),
    # FastVideo's VSA Wan: the gate of the coarse output, a block-level name.
    (r"^(blocks\.\d+\.)self_attn\.to_gate_compress\.", None, r"\1to_gate_compress."),
    (r"^(blocks\.\d+\.)self_attn\.", None, r"\1attn1."),
    (r"^(blocks\.\d+\.)cross_attn\.", None, r"\1attn2."),
    (r"^(blocks\.\d+\.)norm3\.", None, r"\1norm2."),
    (r"^(blocks\.\d+\.)modulation$", None, r"\1scale_shift_table"),
    (r"^head\.head\.", None, "proj_out."),
    (r"^head\.modulation$", None, "scale_shift_table"),
)
def rename(name: str, naming: str, rules=_NAMES) -> str:
    """A generated parameter name in `naming` (`\"wan\"` or `\"diffusers\"`)."""
    column = 1 if naming == "wan" else 2
    for rule in rules:
        if rule[column] is not None and re.match(rule[0], name):
            return re.sub(rule[0], rule[column], name)
    return name


_GATE_COMPRESS = re.compile(r"^blocks\.\d+\.(attn1\.|self_attn\.)?to_gate_compress\.")


def check_gate_compress(tensors, gate_compress, path):
    """The `rename` of a checkpoint: whether its `to_gate_compress` tensors (FastVideo's
    VSA Wan) and `gate_compress` agree (else `ValueError`), and where they are named."""
    if not isinstance(gate_compress, bool):
        raise ValueError(
            "WanTransformer3D.from_pretrained: `gate_compress` must be a bool; received "
            f"{gate_compress!r}."
        )
    gates = sorted((k for k in tensors if _GATE_COMPRESS.match(k)),
                   key=lambda k: [int(t) if t.isdigit() else t for t in k.split(".")])
    where = f"{os.fspath(path)!r}" if isinstance(path, (str, os.PathLike)) else repr(path)
    if gates and not gate_compress:
        raise ValueError(
            f"WanTransformer3D.from_pretrained: the checkpoint {where} is a video sparse "
            f"attention (VSA) Wan: it has {len(gates)} `to_gate_compress` tensors "
            f"({', '.join(repr(g) for g in gates[:2])}, ...), the gate of VSA's coarse "
            "output. Load it with from_pretrained(..., gate_compress=True) and run it with "
            "video_sparse=(tile, topk or sparsity), e.g. ((4, 4, 4), 0.9)."
        )
    if gate_compress and not gates:
        raise ValueError(
            f"WanTransformer3D.from_pretrained: gate_compress=True expects a video sparse "
            f"attention Wan checkpoint with `blocks.N.to_gate_compress.weight` / `.bias` "
            f"tensors; {where} has none. Load it without gate_compress (a dense Wan), "
            "and run it with video_sparse=... ungated, or add zero gates with "
            "WanTransformer3D.with_gate_compress() to distill one."
        )
    if any(".attn1.to_gate_compress." in g for g in gates):
        rules = tuple((p, w, r"\1attn1.to_gate_compress.") if "to_gate_compress" in p
                      else (p, w, d) for p, w, d in _NAMES)
        return lambda name, naming: rename(name, naming, rules)
    return rename


def check_layout(layout: str) -> str:
    """`layout` (a checkpoint layout), or a `ValueError` unless it is `\"diffusers\"` or `\"wan\"`."""
    if layout not in ("diffusers", "wan"):
        raise ValueError(f"`layout` must be 'diffusers' or 'wan'; received {layout!r}.")
    return layout
