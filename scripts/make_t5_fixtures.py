"""Writes the T5 / UMT5 text encoders' parity fixtures, `tests/fixtures/t5/{umt5,t5}/`.

Each folder holds a tiny random transformers encoder (`save_pretrained`: config.json
and model.safetensors) and `io.npz`: `input_ids (2, 12)` int32, `attention_mask
(2, 12)` int32 (the second example padded after 7 tokens) and transformers' float32
`last_hidden_state (2, 12, d_model)`.

- `umt5/`: `UMT5EncoderModel` (Wan 2.1 / 2.2's text encoder: a relative position
    bias in every layer).
- `t5/`: `T5EncoderModel` with T5 v1.1's configuration (CogVideoX's text encoder:
    the first layer's bias shared by every layer).

Run with torch and transformers (made with torch 2.13 CPU, transformers 5.25.0):

    python scripts/make_t5_fixtures.py
"""

import os

import numpy as np
import torch
from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel


OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "t5")
SIZES = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
             relative_attention_num_buckets=8, relative_attention_max_distance=16,
             feed_forward_proj="gated-gelu", dropout_rate=0.0, layer_norm_epsilon=1e-6)


def _randomize(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norm weights: around 1
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:  # (out, in): unit-variance outputs, as a trained model keeps them
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)


def _write(name, model_cls, config, seed):
    model = model_cls(config).eval()
    _randomize(model, seed)
    folder = os.path.join(OUT, name)
    model.save_pretrained(folder)
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, config.vocab_size, (2, 12)).astype(np.int32)
    attention_mask = np.ones((2, 12), np.int32)
    attention_mask[1, 7:] = 0
    input_ids[1, 7:] = 0  # the pad token
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(input_ids).long(),
                    attention_mask=torch.from_numpy(attention_mask).long()).last_hidden_state
    np.savez(os.path.join(folder, "io.npz"), input_ids=input_ids,
             attention_mask=attention_mask, last_hidden_state=out.float().numpy())
    print(name, sorted(model.state_dict()), out.shape)


if __name__ == "__main__":
    _write("umt5", UMT5EncoderModel, UMT5Config(**SIZES), seed=0)
    _write("t5", T5EncoderModel, T5Config(**SIZES), seed=1)
