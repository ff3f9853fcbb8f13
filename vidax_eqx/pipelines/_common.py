"""What the pipelines share: argument checks, the dtype of a module, and how a mesh's
axes map to the transformer's parallelism and the VAE's split."""

import numbers
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import interop, models, nn


def dtype_of(module) -> jnp.dtype:
    """The dtype of `module`'s first floating-point array (its parameters'; abstract
    `jax.ShapeDtypeStruct`s too)."""
    return next(x.dtype for x in jax.tree.leaves(module)
                if (eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct))
                and jnp.issubdtype(x.dtype, jnp.inexact))


def parallel_for(mesh) -> nn.sharding.ParallelConfig:
    """The transformer's parallelism on a mesh of the library's axis names
    ([`vidax_eqx.parallel.make_mesh`][]): Ulysses over `"sp"`, Megatron over `"tp"`
    (each when the mesh has it with more than one device)."""
    if mesh is None:
        return nn.sharding.ParallelConfig()
    sizes = dict(mesh.shape)
    return nn.sharding.ParallelConfig(
        sequence="ulysses" if sizes.get("sp", 1) > 1 else "none",
        tp_axis="tp" if sizes.get("tp", 1) > 1 else None)


def spatial_axes(mesh, h: int, w: int):
    """The mesh axes the VAE splits a frame's latent `(h, w)` over: the pair (or single
    axis) of the mesh's axes of more than one device that uses the most devices and
    divides the sizes; `None` when none does."""
    if mesh is None:
        return None
    axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    best, most = None, 1
    candidates = [(a, b) for a in axes for b in axes if a != b]
    candidates += [(a, None) for a in axes] + [(None, a) for a in axes]
    for a, b in candidates:
        n_h = 1 if a is None else mesh.shape[a]
        n_w = 1 if b is None else mesh.shape[b]
        if h % n_h == 0 and w % n_w == 0 and n_h * n_w > most:
            best, most = (a, b), n_h * n_w
    return best


def as_prompts(owner: str, name: str, value, required: bool) -> list[str] | None:
    if value is None:
        if required:
            raise ValueError(f"{owner}: `{name}` is required (a str or a list of str) "
                             "when no prompt embeddings are given; received None.")
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(p, str) for p in value):
        return list(value)
    raise ValueError(f"{owner}: `{name}` must be a str or a non-empty list of str; "
                     f"received {value!r:.200}.")


def check_int(owner: str, name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{owner}: `{name}` must be an int >= {minimum}; received "
                         f"{value!r}.")
    return int(value)


def image_array(owner: str, name: str, image) -> np.ndarray:
    """A PIL image or an `(H, W, 3)` array (uint8, or float in [0, 1]) as a NumPy array."""
    if hasattr(image, "convert") and hasattr(image, "size"):  # a PIL image
        image = np.asarray(image.convert("RGB"))
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(f"{owner}: `{name}` must be an RGB image: a PIL image or an (H, W, 3) "
                         f"array, uint8 or float in [0, 1]; received shape {array.shape}.")
    return array


# -- the text encoder over a mesh ------------------------------------------------------


def text_parallel(mesh, config: models.T5EncoderConfig) -> nn.sharding.ParallelConfig:
    """The T5 encoder's parallelism on a pipeline's mesh: Megatron over `"tp"` (when its
    size divides the heads, `d_ff` and the vocabulary), FSDP over every other axis of more
    than one device (and over `"tp"` when it cannot split the layers), so that the
    weights are split over every device. The encoder has no sequence parallelism: a
    prompt is 226 or 512 tokens."""
    if mesh is None:
        return nn.sharding.ParallelConfig()
    sizes = dict(mesh.shape)
    n = sizes.get("tp", 1)
    divides = all(v % n == 0 for v in (config.num_heads, config.d_ff, config.vocab_size))
    tp = "tp" if n > 1 and divides else None
    fsdp = tuple(a for a in mesh.axis_names if a != tp and sizes[a] > 1)
    return nn.sharding.ParallelConfig(tp_axis=tp, fsdp_axes=fsdp)


def load_text_encoder(path: str, *, dtype, mesh) -> models.T5Encoder:
    """A pipeline's `text_encoder/`, straight into its sharded layout on `mesh`."""
    if mesh is None:
        return models.T5Encoder.from_pretrained(path, dtype=dtype)
    config = models.T5EncoderConfig.from_file(os.path.join(path, "config.json"))
    return models.T5Encoder.from_pretrained(path, dtype=dtype, parallel=text_parallel(mesh, config),
                                            mesh=mesh)


@eqx.filter_jit
def encode_text(encoder: models.T5Encoder, ids, mask, mesh, zero_padding: bool):
    """The encoder's output of a batch of token rows, over `mesh` when given (its batch
    split over `"dp"` when that divides it); with `zero_padding`, each row zero past its
    tokens (diffusers' Wan pipelines' `u[:v]` padded with zeros)."""
    batch_axis = None
    if mesh is not None and dict(mesh.shape).get("dp", 1) > 1 and ids.shape[0] % mesh.shape["dp"] == 0:
        batch_axis = "dp"
    out = encoder.encode(ids, mask, mesh=mesh, batch_axis=batch_axis)
    if zero_padding:
        out = out * (mask[..., None] > 0).astype(out.dtype)
    return out


# -- the stages both pipelines run ------------------------------------------------------


def encode_prompts(owner: str, pipe, prompt, negative_prompt, *, guided: bool,
                   num_videos_per_prompt, max_sequence_length, clean: bool, masked: bool):
    """A pipeline's `encode_prompt`: the prompts (and, with guidance, the negative ones:
    `""` by default, one str for all or one per prompt) tokenized to
    `max_sequence_length` and encoded in one compiled call, each repeated
    `num_videos_per_prompt` times. `clean`: diffusers' Wan prompt cleaning first;
    `masked`: the encoder takes the attention mask and each row is zero past its
    tokens (Wan), else the encoder sees the padding (CogVideoX)."""
    prompts = as_prompts(owner, "prompt", prompt, True)
    n = check_int(owner, "num_videos_per_prompt", num_videos_per_prompt, 1)
    length = check_int(owner, "max_sequence_length", max_sequence_length, 1)
    negatives = []
    if guided:
        negative = "" if negative_prompt is None else negative_prompt
        negatives = as_prompts(owner, "negative_prompt", negative, True)
        if isinstance(negative, str):
            negatives = negatives * len(prompts)
        elif len(negatives) != len(prompts):
            raise ValueError(
                f"{owner}: `negative_prompt` must be one str or a list of one per prompt "
                f"({len(prompts)}); received a list of {len(negatives)}.")
    if pipe.tokenizer is None or pipe.text_encoder is None:
        raise ValueError(f"{owner}: a prompt needs the pipeline's tokenizer and text_encoder, "
                         "which it was built without; pass `prompt_embeds` (and "
                         "`negative_prompt_embeds`) instead.")
    texts = prompts + negatives
    if clean:
        texts = [interop.prompt_clean(t) for t in texts]
    ids, mask = pipe.tokenizer(texts, max_length=length)
    embeds = encode_text(pipe.text_encoder, jnp.asarray(ids),
                         jnp.asarray(mask) if masked else None, pipe.mesh, masked)
    embeds = jnp.repeat(embeds, n, axis=0) if n > 1 else embeds
    if not negatives:
        return embeds, None
    b = len(prompts) * n
    return embeds[:b], embeds[b:]


def given_embeddings(owner: str, prompt, negative_prompt, prompt_embeds,
                     negative_prompt_embeds, *, guided: bool, num_videos_per_prompt: int):
    """`prompt_embeds` / `negative_prompt_embeds` passed to a call instead of prompts,
    checked and repeated `num_videos_per_prompt` times."""
    if prompt is not None or negative_prompt is not None:
        raise ValueError(f"{owner}: pass either `prompt` (and `negative_prompt`) or "
                         "`prompt_embeds` (and `negative_prompt_embeds`), not both.")
    context = jnp.asarray(prompt_embeds)
    negative = None if negative_prompt_embeds is None else jnp.asarray(negative_prompt_embeds)
    if guided and negative is None:
        raise ValueError(f"{owner}: `guidance_scale` > 1 needs `negative_prompt_embeds` with "
                         "`prompt_embeds`.")
    if context.ndim != 3 or (negative is not None and negative.shape != context.shape):
        raise ValueError(
            f"{owner}: `prompt_embeds` must be (B, L, text_dim) and `negative_prompt_embeds` "
            f"the same shape; received {context.shape} and "
            f"{None if negative is None else negative.shape}.")
    n = check_int(owner, "num_videos_per_prompt", num_videos_per_prompt, 1)
    context = jnp.repeat(context, n, axis=0)
    return context, None if negative is None else jnp.repeat(negative, n, axis=0)


def vae_call(vae, mesh, method: str, x):
    """`vae.encode(x)` or `vae.decode(x)`, each frame split over the mesh's axes that
    divide its latent size ([`spatial_axes`][]) when there is a mesh."""
    h, w = x.shape[-2:]
    if method == "encode":
        h, w = h // vae.spatial_factor, w // vae.spatial_factor
    axes = spatial_axes(mesh, h, w)
    kwargs = {} if axes is None else dict(mesh=mesh, spatial_axes=axes)
    return getattr(vae, method)(x, **kwargs)
