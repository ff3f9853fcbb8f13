"""Analytic dot FLOPs of Wan 2.1 and CogVideoX, one forward and one training step
(`remat="full"`), whole and per device: the formulas of `benchmarks/models.py`'s
docstring. `models.py` compares them with the compiled programs' dots;
`models_vs_diffusers.py` turns the forward count into GFLOP/s.
"""

WAN_TEXT = (512, 4096)  # Wan's text context (T, C)
COGVIDEOX_TEXT = (226, 4096)  # CogVideoX's
PATCH_VALUES = 64  # values per patch in and out, both families: 16 channels x 2 x 2
WAN_FREQ_DIM = 256  # WanConfig's timestep sinusoid width
COGVIDEOX_TIME_DIM = 512  # CogVideoXConfig's time_embed_dim (default)


def _pad(n: int, block: int) -> int:
    """`n` rounded up to a multiple of `min(block, n)` (the blockwise kernel's tiles)."""
    b = min(block, n)
    return -(-n // b) * b


def wan_flops(m: dict, tokens: int, sp: int = 1, tp: int = 1, mode: str | None = None) -> dict:
    """Dot FLOPs of Wan 2.1 (config fields `m`: dim, ffn_dim, num_layers, num_heads)
    at `tokens` video tokens: `{fwd,train}_total`, `{fwd,train}_per_device` under
    sp x tp, and with `mode` ("ring" | "ulysses") `{fwd,train}_tiles`."""
    d, f, L, H = m["dim"], m["ffn_dim"], m["num_layers"], m["num_heads"]
    (T, C), p = WAN_TEXT, PATCH_VALUES
    S = tokens
    hd = d // H

    def flops(n_tok: int, n_text: int, n_head: int, attn: float) -> dict:
        """Forward FLOPs by kind: per-token work over n_tok devices, the text k/v
        projections over n_text, the head over n_head; `attn` the attention's."""
        return dict(
            dense=L * (12 * S * d * d + 4 * S * d * f) / n_tok,
            attn=attn,
            text_kv=L * 4 * T * d * d / n_text,
            text_emb=(2 * T * C * d + 2 * T * d * d) / n_text,
            patch=2 * S * p * d / n_head,
            head=2 * S * d * p / n_head,
            time=2 * (WAN_FREQ_DIM * d + d * d + 6 * d * d),
        )

    def text_emb_backward(n_text: int) -> float:
        """The text embedding's backward: fc1 dW only, fc2 dX and dW (TP-split)."""
        return (2 * T * C * d + 2 * 2 * T * d * d) / n_text

    def fwd(k: dict) -> float:
        return sum(k.values())

    def train(k: dict, n_text: int) -> float:
        blocks = k["dense"] + k["attn"] + k["text_kv"]
        outside = k["text_emb"] + k["patch"] + k["head"] + k["time"]
        backward = (2 * k["dense"] + 2.5 * k["attn"] + 2 * k["text_kv"]
                    + k["patch"]  # dW only
                    + text_emb_backward(n_text)
                    + 2 * k["head"] + 2 * k["time"])
        return outside + 2 * blocks + backward  # + the blocks' recomputed forward

    plain_attn = L * (4 * S * S * d + 4 * S * T * d)
    total = flops(1, 1, 1, plain_attn)
    per_device = flops(sp * tp, tp, sp, plain_attn / (sp * tp))
    out = {"fwd_total": fwd(total), "train_total": train(total, 1),
           "fwd_per_device": fwd(per_device), "train_per_device": train(per_device, tp)}
    if mode is not None:
        heads = H // tp  # this device's heads (Megatron)
        local = -(-S // sp)  # this device's tokens
        if mode == "ulysses":  # the whole sequence, heads / sp of them
            self_attn = 4 * _pad(S, 256) * _pad(S, 512) * hd * heads / sp
        else:  # ring: sp steps of the local queries against one chunk of keys
            self_attn = sp * 4 * _pad(local, 256) * _pad(local, 512) * hd * heads
        cross = 4 * _pad(local, 256) * _pad(T, 512) * hd * heads
        tiles = flops(sp * tp, tp, sp, L * (self_attn + cross))
        out.update(fwd_tiles=fwd(tiles), train_tiles=train(tiles, tp))
    return out


def cogvideox_flops(m: dict, tokens: int, sp: int = 1, tp: int = 1,
                    mode: str | None = None) -> dict:
    """Dot FLOPs of CogVideoX (config fields `m`: num_attention_heads,
    attention_head_dim, num_layers) at `tokens` video tokens; the keys of
    [`wan_flops`][]."""
    H, hd, N = m["num_attention_heads"], m["attention_head_dim"], m["num_layers"]
    d, te, p = H * hd, COGVIDEOX_TIME_DIM, PATCH_VALUES
    (T, C), S = COGVIDEOX_TEXT, tokens

    def flops(v: float, n_tp: int, attn: float) -> dict:
        """Forward FLOPs by kind on a device holding `v` video tokens and the whole
        text, its attention and FFN split over `n_tp`; `attn` the attention's."""
        return dict(
            dense=N * 24 * (v + T) * d * d / n_tp,
            attn=attn,
            modulation=N * 2 * 2 * te * 6 * d,
            text_emb=2 * T * C * d,
            patch=2 * v * p * d,
            head=2 * v * d * p + 2 * te * 2 * d,
            time=2 * (d * te + te * te),
        )

    def fwd(k: dict) -> float:
        return sum(k.values())

    def train(k: dict) -> float:
        blocks = k["dense"] + k["attn"] + k["modulation"]
        outside = k["text_emb"] + k["patch"] + k["head"] + k["time"]
        backward = (2 * k["dense"] + 2.5 * k["attn"] + 2 * k["modulation"]
                    + k["text_emb"] + k["patch"]  # dW only
                    + 2 * k["head"] + 2 * d * te + 4 * te * te)  # time: linear_1 dW only
        return outside + 2 * blocks + backward  # + the blocks' recomputed forward

    joint = N * 4 * (S + T) ** 2 * d  # QK^T and PV over [text; video]
    total = flops(S, 1, joint)
    if mode == "ring":  # the text x text block on every device
        attn = N * 4 * ((S + T) ** 2 - T**2) * d / (sp * tp) + N * 4 * T**2 * d / tp
    else:
        attn = joint / (sp * tp)
    per_device = flops(S / sp, tp, attn)
    out = {"fwd_total": fwd(total), "train_total": train(total),
           "fwd_per_device": fwd(per_device), "train_per_device": train(per_device)}
    if mode is not None:
        v = -(-S // sp)  # this device's video tokens, padded to a multiple of sp
        heads = H // tp
        if mode == "ulysses":  # [text; the whole video], heads / sp of them
            n = T + sp * v
            attn = 4 * _pad(n, 256) * _pad(n, 512) * hd * heads / sp
        else:  # the video ring, and the three text blocks locally
            attn = 4 * hd * heads * (
                sp * _pad(v, 256) * _pad(v, 512) + _pad(v, 256) * _pad(T, 512)
                + _pad(T, 256) * _pad(v, 512) + _pad(T, 256) * _pad(T, 512))
        tiles = flops(v, tp, N * attn)
        out.update(fwd_tiles=fwd(tiles), train_tiles=train(tiles))
    return out
