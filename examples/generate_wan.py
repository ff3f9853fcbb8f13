"""Generates a Wan video from a checkpoint: text embeddings -> latents -> (optionally) .mp4.

The whole pipeline (a diffusers folder: prompt and image in, `.mp4` out) is the installed
command `vidax-generate` (`vidax_eqx.generate`, over `pipelines.WanPipeline`). This
example is its lower-level sibling: a transformer directory or pipeline and precomputed
embeddings in, the latents out (with step caching and `--mesh` axis options).

    python examples/generate_wan.py --checkpoint /path/to/Wan2.1-T2V-1.3B-Diffusers \\
        --embeddings prompt.safetensors --frames 81 --height 480 --width 832 \\
        --output latents.safetensors --video out.mp4
    python examples/generate_wan.py --checkpoint Wan-AI/Wan2.1-T2V-1.3B-Diffusers \\
        --prompt "A cat walks on the grass" --video out.mp4
    python examples/generate_wan.py --checkpoint /path/to/Wan2.2-T2V-A14B-Diffusers \\
        --embeddings prompt.safetensors --guidance-scale 4 --guidance-scale-2 3 --mesh sp=4,tp=2

**The model.** `--checkpoint` is a directory or a Hugging Face Hub id:

- a diffusers pipeline (`model_index.json`, `transformer/`, ...): its `transformer/`
    through `models.WanTransformer3D.from_pretrained`;
- a Wan 2.2 A14B pipeline (`transformer/` + `transformer_2/`) or release
    (`high_noise_model/` + `low_noise_model/`): `models.WanExperts.from_pretrained`;
- a transformer directory (`config.json` + safetensors, diffusers' or Wan's layout).

`--dtype` casts the parameters (default: the checkpoint's). `--mesh sp=4,tp=2` (axes
`dp`, `sp`, `tp`, `cfg`) loads the model straight into its sharded layout and samples
over that mesh: Ulysses over `sp`, Megatron over `tp`, the batch over `dp`, the
conditional / unconditional passes over `cfg` (size 2). On CPU the devices are simulated.

**The text.** `--embeddings FILE.safetensors` holds the UMT5 embeddings, as diffusers'
`WanPipeline.encode_prompt` returns them:

- `prompt_embeds`: `(L, text_dim)` or `(B, L, text_dim)`, the prompt's (zero past its
    length, as diffusers pads them to 512 tokens);
- `negative_prompt_embeds`: the same shape, the negative (or empty) prompt's;
    required when `--guidance-scale` > 1.

Without `--embeddings`, `--prompt` (and `--negative-prompt`, default "") are encoded
with the pipeline's `text_encoder/` and `tokenizer/` by `models.T5Encoder` and
`interop.TextTokenizer` (no torch; `pip install 'vidax_eqx[text]'`), as diffusers'
`WanPipeline._get_t5_prompt_embeds` does: the prompt cleaned, tokenized to 512 tokens,
the encoder's output zeroed past each prompt's length.
The embeddings are cast to the model's dtype (as diffusers casts them to the
transformer's).

**Sampling.** `vidax_eqx.sampling.sample`: `--steps`, `--scheduler` (`unipc`, the
default of diffusers' Wan pipelines, or `euler`), `--shift` (3.0: Wan at 480p; 5.0 at
720p), `--guidance-scale` (and `--guidance-scale-2`, A14B's low-noise expert); step caching
with `--first-block-cache THRESHOLD` or `--static-step-cache INTERVAL` (after
`--cache-warmup` steps; the steps that reused are printed). The
initial latents are `jax.random.normal(jax.random.key(seed), (B, C, F, H, W), float32)`
(or `--noise FILE` with a `noise` tensor, e.g. diffusers' own draw), where
`F = (frames - 1) // 4 + 1`, `H = height // s`, `W = width // s` with the VAE's scale
factors (read from `vae/config.json`, or `--vae`'s, when there is one; else Wan 2.1's
VAE, `s = 8`, or Wan 2.2 TI2V's for a 48-channel model, `s = 16`), or
`--latent-shape C F H W`.

**Output.** `--output` writes the final latents `(B, C, F, H, W)` float32 (`.safetensors`
under the key `latents`, or `.npy`). `--video out.mp4` decodes them without torch, with
`models.WanVAE.from_pretrained` of the pipeline's `vae/` (or `--vae DIR`), as
`WanPipeline` does: `WanVAE.denormalize_latents` (`latents * latents_std +
latents_mean`), `WanVAE.decode`, `interop.video_to_frames` (`(video / 2 + 0.5)` clipped
to [0, 1]), rounded to uint8, and `interop.write_video` (H.264 through PyAV: `pip install
'vidax_eqx[video]'`) at `--fps`; several videos get `_1`, `_2`, ... suffixes.
"""

import argparse
import json
import os
import sys
import time


_MESH_AXES = ("dp", "sp", "tp", "cfg")


def _mesh_spec(text: str) -> dict[str, int]:
    sizes = {}
    for part in filter(None, text.split(",")):
        name, _, size = part.partition("=")
        if name not in _MESH_AXES or not size.isdigit() or int(size) < 1 or name in sizes:
            raise argparse.ArgumentTypeError(
                f"--mesh takes comma-separated AXIS=SIZE with the axes {', '.join(_MESH_AXES)} "
                f"(e.g. sp=4,tp=2); received {text!r}.")
        sizes[name] = int(size)
    if sizes.get("cfg", 2) != 2:
        raise argparse.ArgumentTypeError(f"--mesh: the cfg axis has size 2; received {text!r}.")
    return sizes


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="See the module docstring (examples/generate_wan.py) for the file formats.")
    p.add_argument("--checkpoint", required=True,
                   help="a diffusers pipeline, Wan 2.2 A14B or transformer directory, or a Hub id")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="the parameters' dtype (default: the checkpoint's)")
    text = p.add_argument_group("text")
    text.add_argument("--embeddings", help="a .safetensors file with prompt_embeds "
                      "[(B,) L, text_dim] and negative_prompt_embeds")
    text.add_argument("--prompt", action="append",
                      help="a prompt, encoded with the pipeline's UMT5 (models.T5Encoder); "
                      "repeat for a batch")
    text.add_argument("--negative-prompt", default="", help="the negative prompt (default '')")
    text.add_argument("--max-sequence-length", type=int, default=512,
                      help="the prompt's token length (default 512, as diffusers)")
    s = p.add_argument_group("sampling")
    s.add_argument("--steps", type=int, default=50, help="denoising steps (default 50)")
    s.add_argument("--guidance-scale", type=float, default=5.0, help="CFG scale (default 5.0)")
    s.add_argument("--guidance-scale-2", type=float,
                   help="Wan 2.2 A14B: the low-noise expert's scale (default: --guidance-scale)")
    s.add_argument("--scheduler", choices=("unipc", "euler"), default="unipc",
                   help="UniPC (default, diffusers' Wan default) or flow-matching Euler")
    s.add_argument("--shift", type=float, default=3.0,
                   help="the timestep shift (default 3.0: 480p; 5.0 for 720p)")
    s.add_argument("--seed", type=int, default=0, help="the noise seed (default 0)")
    s.add_argument("--noise", help="initial latents instead of the seed's: a .safetensors "
                   "(key 'noise') or .npy file, (B, C, F, H, W)")
    s.add_argument("--frames", type=int, default=81, help="video frames (default 81)")
    s.add_argument("--height", type=int, default=480, help="pixels (default 480)")
    s.add_argument("--width", type=int, default=832, help="pixels (default 832)")
    s.add_argument("--latent-shape", type=int, nargs=4, metavar=("C", "F", "H", "W"),
                   help="the latent shape, instead of --frames/--height/--width")
    cache = s.add_mutually_exclusive_group()
    cache.add_argument("--first-block-cache", type=float, metavar="THRESHOLD",
                       help="step caching, the first-block rule: skip the other blocks when "
                            "the first block's residual changed by less than THRESHOLD "
                            "(e.g. 0.1) since the last full step")
    cache.add_argument("--static-step-cache", type=int, metavar="INTERVAL",
                       help="step caching, a static schedule: after --cache-warmup steps, "
                            "run the blocks at one step in INTERVAL, reuse at the others")
    s.add_argument("--cache-warmup", type=int, default=1,
                   help="the first steps that always run every block (default 1)")
    s.add_argument("--mesh", type=_mesh_spec, default={},
                   help="sample sharded, e.g. sp=4,tp=2 or sp=2,tp=2,cfg=2 (axes dp, sp, tp, cfg)")
    o = p.add_argument_group("output")
    o.add_argument("--output", default="latents.safetensors",
                   help="the final latents, .safetensors (key 'latents') or .npy "
                   "(default latents.safetensors)")
    o.add_argument("--video", help="decode with the pipeline's vae/ (models.WanVAE) to this "
                   ".mp4 (PyAV: pip install 'vidax_eqx[video]')")
    o.add_argument("--vae", help="the VAE directory (default: the pipeline's vae/)")
    o.add_argument("--fps", type=int, default=16, help="the video's frame rate (default 16)")
    args = p.parse_args(argv)
    if (args.embeddings is None) == (args.prompt is None):
        p.error("give exactly one of --embeddings FILE and --prompt TEXT")
    if not args.output.endswith((".safetensors", ".npy")):
        p.error(f"--output must end in .safetensors or .npy; received {args.output!r}")
    return args


# -- the checkpoint ----------------------------------------------------------------------


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _hub_part(repo_id: str, part: str):
    """A folder of a Hub pipeline (`vae`, `text_encoder`, ...), downloaded on demand."""
    import huggingface_hub
    try:
        root = huggingface_hub.snapshot_download(repo_id, allow_patterns=[f"{part}/*"])
    except Exception:  # not on the Hub, offline, no access
        return None
    folder = os.path.join(root, part)
    return folder if os.path.isdir(folder) else None


def load_model(checkpoint: str, *, dtype=None, parallel=None, mesh=None):
    """`(model, find)`: the transformer (or the two experts) of `checkpoint`, and
    `find(part)`, the pipeline's folder `part` (`"vae"`, ...) or `None`."""
    from vidax_eqx import interop, models, nn

    kwargs = dict(dtype=dtype, parallel=parallel or nn.sharding.ParallelConfig(), mesh=mesh)
    if not os.path.isdir(checkpoint):  # a Hub id: its model_index.json says what it holds
        index = _read_json(os.path.join(interop.resolve_checkpoint(checkpoint),
                                        "model_index.json")) or {}
        holds = {k for k, v in index.items() if isinstance(v, list) and v[0] is not None}

        def find(part):
            return _hub_part(checkpoint, part) if part in holds else None

        if "transformer_2" in holds:
            return models.WanExperts.from_pretrained(checkpoint, **kwargs), find
        sub = "transformer" if "transformer" in holds else None
        return models.WanTransformer3D.from_pretrained(checkpoint, subfolder=sub, **kwargs), find

    def has(*parts):
        return all(os.path.isfile(os.path.join(checkpoint, p, "config.json")) for p in parts)

    if has("transformer", "transformer_2") or has("high_noise_model", "low_noise_model"):
        model, root = models.WanExperts.from_pretrained(checkpoint, **kwargs), checkpoint
    elif has("transformer"):
        model = models.WanTransformer3D.from_pretrained(checkpoint, subfolder="transformer", **kwargs)
        root = checkpoint
    else:  # a transformer directory, maybe inside a pipeline
        model = models.WanTransformer3D.from_pretrained(checkpoint, **kwargs)
        root = os.path.dirname(os.path.abspath(checkpoint))

    def find(part):
        folder = os.path.join(root, part)
        return folder if os.path.isdir(folder) else None

    return model, find


def latent_shape(model_config, vae_config, frames: int, height: int, width: int):
    """`(C, F, H, W)` of a `frames x height x width` video under the VAE's scale factors."""
    channels = model_config.in_channels
    vae_config = vae_config or {}
    temporal = vae_config.get("scale_factor_temporal", 4)
    spatial = vae_config.get("scale_factor_spatial", 16 if channels == 48 else 8)
    return channels, (frames - 1) // temporal + 1, height // spatial, width // spatial


# -- the text ----------------------------------------------------------------------------


def _as_batch(array, name, path):
    if array.ndim == 2:
        return array[None]
    if array.ndim != 3:
        raise ValueError(f"--embeddings: {name!r} in {path!r} must be (L, text_dim) or "
                         f"(B, L, text_dim); received shape {array.shape}.")
    return array


def read_embeddings(path):
    """`(prompt_embeds, negative_prompt_embeds or None)`, `(B, L, text_dim)` NumPy."""
    from vidax_eqx import interop

    tensors = interop.open_safetensors(path)
    if "prompt_embeds" not in tensors:
        raise ValueError(f"--embeddings: {path!r} must hold 'prompt_embeds' (and "
                         f"'negative_prompt_embeds' for guidance); it holds {sorted(tensors)}.")
    context = _as_batch(tensors["prompt_embeds"], "prompt_embeds", path)
    negative = None
    if "negative_prompt_embeds" in tensors:
        negative = _as_batch(tensors["negative_prompt_embeds"], "negative_prompt_embeds", path)
    return context, negative


def encode_prompts(text_encoder_dir, tokenizer_dir, prompts, max_sequence_length=512):
    """diffusers' `WanPipeline._get_t5_prompt_embeds` in float32, without torch: the
    prompts cleaned (`interop.prompt_clean`), tokenized (`interop.TextTokenizer`) and
    encoded by `models.T5Encoder`, each row zero past its tokens. `(B, L, text_dim)` NumPy."""
    import jax
    import numpy as np
    from vidax_eqx import interop, models

    tokenizer = interop.TextTokenizer.from_pretrained(tokenizer_dir)
    encoder = models.T5Encoder.from_pretrained(text_encoder_dir)
    ids, mask = tokenizer([interop.prompt_clean(p) for p in prompts],
                          max_length=max_sequence_length)
    out = jax.jit(jax.vmap(encoder))(ids, mask)
    return np.asarray(out, np.float32) * (mask[..., None] > 0)


# -- the video ---------------------------------------------------------------------------


def decode_video(vae_dir, latents):
    """diffusers' `WanPipeline` decode, without torch: uint8 frames `(B, F, H, W, 3)`."""
    import jax.numpy as jnp
    import numpy as np
    from vidax_eqx import interop, models

    vae = models.WanVAE.from_pretrained(vae_dir)
    videos = []
    for z in np.asarray(latents, np.float32):  # one video at a time: (C, F, H, W)
        video = vae.decode(vae.denormalize_latents(jnp.asarray(z)))  # (3, F, H, W) in [-1, 1]
        videos.append(np.round(interop.video_to_frames(video) * 255).astype(np.uint8))
    return np.stack(videos)


def write_videos(path, frames, fps):
    from vidax_eqx import interop

    stem, ext = os.path.splitext(path)
    paths = [path if i == 0 else f"{stem}_{i}{ext}" for i in range(len(frames))]
    for p, video in zip(paths, frames):
        interop.write_video(video, p, fps=fps)
    return paths


# -- main --------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    devices = 1
    for size in args.mesh.values():
        devices *= size
    if devices > 1:  # simulated CPU devices (only the CPU backend reads this flag)
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        os.environ["XLA_FLAGS"] = " ".join(
            [*flags, f"--xla_force_host_platform_device_count={max(devices, 8)}"])
    try:  # run against this checkout's vidax_eqx when it is not installed
        import vidax_eqx  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    from vidax_eqx import interop, nn, parallel, sampling

    mesh = parallel_config = None
    if devices > 1:
        sizes = args.mesh
        extra = {"cfg": 2} if "cfg" in sizes else None
        mesh = parallel.make_mesh(sizes.get("dp", 1), sizes.get("sp", 1), sizes.get("tp", 1),
                                  extra_axes=extra)
        parallel_config = nn.sharding.ParallelConfig(
            sequence="ulysses" if sizes.get("sp", 1) > 1 else "none",
            tp_axis="tp" if sizes.get("tp", 1) > 1 else None)

    t0 = time.perf_counter()
    dtype = None if args.dtype is None else jnp.dtype(args.dtype)
    model, find = load_model(args.checkpoint, dtype=dtype, parallel=parallel_config, mesh=mesh)
    config = model.config
    model_dtype = next(leaf.dtype for leaf in jax.tree.leaves(model) if eqx.is_inexact_array(leaf))
    kind = type(model).__name__
    print(f"model       {kind} from {args.checkpoint} ({model_dtype}, "
          f"{config.num_layers} blocks, dim {config.dim}): {time.perf_counter() - t0:.1f} s")

    t0 = time.perf_counter()
    if args.embeddings is not None:
        context, negative = read_embeddings(args.embeddings)
        source = args.embeddings
    else:
        encoder, tokenizer = find("text_encoder"), find("tokenizer")
        if encoder is None or tokenizer is None:
            raise SystemExit(f"--prompt: {args.checkpoint!r} has no text_encoder/ and tokenizer/ "
                             "(a diffusers pipeline has them); pass --embeddings instead.")
        context = encode_prompts(encoder, tokenizer, args.prompt, args.max_sequence_length)
        negative = None
        if args.guidance_scale > 1:
            negative = encode_prompts(encoder, tokenizer, [args.negative_prompt] * len(args.prompt),
                                      args.max_sequence_length)
        source = f"UMT5 of {encoder}"
    if args.guidance_scale <= 1:
        negative = None
    print(f"text        {context.shape} from {source}"
          f"{'' if negative is None else ', with negative'}: {time.perf_counter() - t0:.1f} s")

    batch = context.shape[0]
    if args.noise is not None:
        if args.noise.endswith(".npy"):
            noise = np.load(args.noise)
        else:
            noise = interop.open_safetensors(args.noise)["noise"]
        noise = jnp.asarray(noise, jnp.float32)
    else:
        if args.latent_shape is not None:
            shape = tuple(args.latent_shape)
        else:
            vae_dir = args.vae or find("vae") or ""
            shape = latent_shape(config, _read_json(os.path.join(vae_dir, "config.json")),
                                 args.frames, args.height, args.width)
        noise = jax.random.normal(jax.random.key(args.seed), (batch, *shape), jnp.float32)
    context = jnp.asarray(context, model_dtype)
    if negative is not None:
        negative = jnp.asarray(negative, model_dtype)
    scheduler = (sampling.UniPC if args.scheduler == "unipc" else sampling.FlowMatchEuler)(
        shift=args.shift)

    step_cache = None
    if args.first_block_cache is not None:
        step_cache = sampling.FirstBlockCache(args.first_block_cache, warmup=args.cache_warmup)
    elif args.static_step_cache is not None:
        step_cache = sampling.StaticStepCache(interval=args.static_step_cache,
                                              warmup=args.cache_warmup)

    t0 = time.perf_counter()
    out = sampling.sample(
        model, noise, context, negative_context=negative, guidance_scale=args.guidance_scale,
        guidance_scale_2=args.guidance_scale_2, steps=args.steps, scheduler=scheduler,
        mesh=mesh, batch_axis="dp" if args.mesh.get("dp", 1) > 1 else None,
        cfg_axis="cfg" if "cfg" in args.mesh else None, progress=True,
        step_cache=step_cache, return_reused=step_cache is not None)
    latents, reused = out if step_cache is not None else (out, None)
    latents = np.asarray(jax.device_get(latents), np.float32)
    mesh_text = "1 device" if mesh is None else f"mesh {dict(mesh.shape)}"
    print(f"sampled     {latents.shape} in {args.steps} {args.scheduler} steps, guidance "
          f"{args.guidance_scale}, {mesh_text}: {time.perf_counter() - t0:.1f} s")
    if reused is not None:
        steps_reused = np.flatnonzero(np.asarray(reused)).tolist()
        print(f"step cache  {len(steps_reused)} of {args.steps} steps reused the block "
              f"stack's residual: {steps_reused}")

    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    if args.output.endswith(".npy"):
        np.save(args.output, latents)
    else:
        from safetensors.numpy import save_file
        save_file({"latents": latents}, args.output)
    print(f"latents     written to {args.output}")

    if args.video is not None:
        vae = args.vae or find("vae")
        if vae is None:
            raise SystemExit(f"--video: {args.checkpoint!r} has no vae/; pass --vae DIR.")
        t0 = time.perf_counter()
        frames = decode_video(vae, latents)
        paths = write_videos(args.video, frames, args.fps)
        print(f"video       {frames.shape[1:]} frames x {len(paths)} written to "
              f"{', '.join(paths)}: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
