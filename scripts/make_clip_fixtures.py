"""Writes the CLIP image encoder's parity fixtures, `tests/fixtures/clip/`.

- `encoder/`: a tiny random transformers `CLIPVisionModelWithProjection` with Wan 2.1's
    activation (`hidden_act="gelu"`, open-clip's ViT-H/14 converted), 32 x 32 images in
    patches of 6 (a 5 x 5 grid, the last 2 rows and columns dropped by the strided
    convolution: 26 tokens), `save_pretrained` (config.json, model.safetensors).
- `processor/`: transformers' `CLIPImageProcessor` with a small size (shortest edge 35,
    a 32 x 32 crop), `save_pretrained` (preprocessor_config.json), written and run by
    its Pillow backend (`CLIPImageProcessorPil`, what `CLIPImageProcessor` is without
    torchvision).
- `io.npz`: `image_0 (45, 70, 3)` and `image_1 (83, 41, 3)` uint8 (random noise on a
    smooth picture), `image_rgba (45, 70, 4)` uint8 (image_0 with a random alpha,
    given as a Pillow RGBA image); the processor's float32 `pixel_values (2, 3, 32, 32)`
    and `pixel_values_rgba (3, 32, 32)`; the encoder's float32 `hidden_states (4, 2, 26,
    32)` (transformers' `output_hidden_states=True`, stacked: embeddings after
    `pre_layrnorm`, then each layer's output), `last_hidden_state (2, 26, 32)` and
    `image_embeds (2, 16)`. With torchvision installed, also
    `pixel_values_torchvision`: what transformers 5's default (torchvision) backend
    gives for the two images, for the test that bounds how far it is from Pillow's.

Run with torch and transformers (made with torch 2.13 CPU, transformers 5.25.0,
Pillow 13.0):

    python scripts/make_clip_fixtures.py
"""

import importlib.util
import os

import numpy as np
import torch
from PIL import Image
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil


OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "clip")
CONFIG = dict(hidden_size=32, intermediate_size=40, projection_dim=16, num_hidden_layers=3,
              num_attention_heads=4, num_channels=3, image_size=32, patch_size=6,
              hidden_act="gelu", layer_norm_eps=1e-5)
PROCESSOR = dict(size={"shortest_edge": 35}, crop_size={"height": 32, "width": 32})


def _randomize(model, seed):
    """Every parameter off its initial value: norms' weights around 1, biases and
    embeddings of order 0.2-1, matrices with unit-variance outputs."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.ndim == 1:  # biases, the class embedding
                p.copy_(0.2 * torch.randn_like(p))
            elif "position_embedding" in name:
                p.copy_(0.5 * torch.randn_like(p))
            else:  # (out, in) or (out, C, p, p)
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)


def _images(rng):
    """Two non-square uint8 images of different sizes: noise on smooth gradients."""
    out = []
    for h, w in ((45, 70), (83, 41)):
        y, x = np.mgrid[:h, :w]
        smooth = np.stack([128 + 100 * np.sin(x / 9 + c) * np.cos(y / 7 - c) for c in range(3)], -1)
        noisy = smooth + rng.normal(0, 25, (h, w, 3))
        out.append(np.clip(np.round(noisy), 0, 255).astype(np.uint8))
    return out


def _torchvision_pixels(images):
    if importlib.util.find_spec("torchvision") is None:
        return None
    from transformers.models.clip.image_processing_clip import CLIPImageProcessor
    return CLIPImageProcessor(**PROCESSOR)(images=images, return_tensors="np")["pixel_values"]


def main():
    rng = np.random.default_rng(0)
    model = CLIPVisionModelWithProjection(CLIPVisionConfig(**CONFIG)).eval()
    _randomize(model, seed=0)
    model.save_pretrained(os.path.join(OUT, "encoder"))
    processor = CLIPImageProcessorPil(**PROCESSOR)
    processor.save_pretrained(os.path.join(OUT, "processor"))

    images = _images(rng)
    rgba = np.concatenate([images[0], rng.integers(0, 256, images[0].shape[:2] + (1,),
                                                   dtype=np.uint8)], -1)
    pixel_values = processor(images=images, return_tensors="np")["pixel_values"]
    pixel_values_rgba = processor(images=Image.fromarray(rgba, "RGBA"),
                                  return_tensors="np")["pixel_values"][0]
    with torch.no_grad():
        out = model(pixel_values=torch.from_numpy(pixel_values), output_hidden_states=True)
        # transformers' own bfloat16 forward against its float32 (the bfloat16 test's scale)
        bf16 = model.to(torch.bfloat16)(pixel_values=torch.from_numpy(pixel_values).bfloat16(),
                                         output_hidden_states=True)
    hidden = np.stack([h.float().numpy() for h in out.hidden_states])
    arrays = dict(image_0=images[0], image_1=images[1], image_rgba=rgba,
                  pixel_values=pixel_values.astype(np.float32),
                  pixel_values_rgba=pixel_values_rgba.astype(np.float32),
                  hidden_states=hidden, last_hidden_state=out.last_hidden_state.numpy(),
                  image_embeds=out.image_embeds.numpy())
    tv = _torchvision_pixels(images)
    if tv is not None:
        arrays["pixel_values_torchvision"] = tv.astype(np.float32)
        print("torchvision vs Pillow backend: max abs", float(np.abs(tv - pixel_values).max()),
              "fraction differing", float((np.abs(tv - pixel_values) > 1e-4).mean()))
    np.savez_compressed(os.path.join(OUT, "io.npz"), **arrays)

    def rel(a, b):
        return float(np.abs(a - b).max() / np.abs(b).max())

    print("transformers bf16 vs f32: hidden_states[-2]",
          rel(bf16.hidden_states[-2].float().numpy(), hidden[-2]),
          "last_hidden_state", rel(bf16.last_hidden_state.float().numpy(), hidden[-1]),
          "image_embeds", rel(bf16.image_embeds.float().numpy(), out.image_embeds.numpy()))
    print({k: v.shape for k, v in arrays.items()})


if __name__ == "__main__":
    main()
