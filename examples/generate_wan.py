"""Generates a Wan video from a checkpoint: text embeddings -> latents -> (optionally) .mp4.

The whole pipeline (a diffusers folder: prompt and image in, `.mp4` out) is the installed
command `vidax-generate` (`vidax_eqx.generate`, over `pipelines.WanPipeline`). This
example is its lower-level sibling, with the command's vocabulary (the same flags, the
same one-line errors and exit status 2, the paths written on stdout): a transformer
directory or pipeline and precomputed embeddings in, the latents out, and the pieces
`vidax-generate` does not have (`--embeddings`, `--noise`, `--latent-shape`,
`--scheduler`, `--shift`, step caching).

    python examples/generate_wan.py /path/to/Wan2.1-T2V-1.3B-Diffusers \\
        --embeddings prompt.safetensors --num-frames 81 --height 480 --width 832 \\
        --latents latents.safetensors --output out.mp4
    python examples/generate_wan.py Wan-AI/Wan2.1-T2V-1.3B-Diffusers \\
        --prompt "A cat walks on the grass" --output out.mp4
    python examples/generate_wan.py /path/to/Wan2.2-T2V-A14B-Diffusers \\
        --embeddings prompt.safetensors --guidance-scale 4 --guidance-scale-2 3 --sp 4 --tp 2

**The model.** `MODEL` is a directory or a Hugging Face Hub id:

- a diffusers pipeline (`model_index.json`, `transformer/`, ...): its `transformer/`
    through `models.WanTransformer3D.from_pretrained`;
- a Wan 2.2 A14B pipeline (`transformer/` + `transformer_2/`) or release
    (`high_noise_model/` + `low_noise_model/`): `models.WanExperts.from_pretrained`;
- a transformer directory (`config.json` + safetensors, diffusers' or Wan's layout).

`--dtype` casts the parameters (default: the checkpoint's). `--sp 4 --tp 2` (and `--dp`,
`--cfg 2`) loads the model straight into its sharded layout and samples over that mesh:
Ulysses over `sp`, Megatron over `tp`, the batch over `dp`, the conditional /
unconditional passes over `cfg`. On CPU the devices are simulated.

**The text.** `--embeddings FILE.safetensors` holds the UMT5 embeddings, as diffusers'
`WanPipeline.encode_prompt` returns them:

- `prompt_embeds`: `(L, text_dim)` or `(B, L, text_dim)`, the prompt's (zero past its
    length, as diffusers pads them to 512 tokens);
- `negative_prompt_embeds`: the same shape, the negative (or empty) prompt's;
    required when `--guidance-scale` > 1.

Without `--embeddings`, `--prompt` (and `--negative-prompt`, default "") are encoded
with the pipeline's `text_encoder/` and `tokenizer/` by `models.T5Encoder` and
`interop.TextTokenizer` (no torch; the `tokenizers` library: `pip install '.[pipeline]'`
in a clone, or `pip install tokenizers`), as diffusers'
`WanPipeline._get_t5_prompt_embeds` does: the prompt cleaned, tokenized to 512 tokens,
the encoder's output zeroed past each prompt's length.
The embeddings are cast to the model's dtype (as diffusers casts them to the
transformer's).

**Sampling.** `vidax_eqx.sampling.sample`: `--steps`, `--scheduler` (`unipc`, the
default of diffusers' Wan pipelines, or `euler`), `--shift` (3.0: Wan at 480p; 5.0 at
720p), `--guidance-scale` (and `--guidance-scale-2`, A14B's low-noise expert); step caching
with `--first-block-cache THRESHOLD` or `--static-step-cache INTERVAL` (after
`--cache-warmup` steps; the steps that reused are printed, as the progress callback
sees them). The initial latents are `jax.random.normal(jax.random.key(seed), (B, C, F, H,
W), float32)` (or `--noise FILE` with a `noise` tensor, e.g. diffusers' own draw), where
`F = (num_frames - 1) // 4 + 1`, `H = height // s`, `W = width // s` with the VAE's scale
factors (read from `vae/config.json`, or `--vae`'s, when there is one; else Wan 2.1's
VAE, `s = 8`, or Wan 2.2 TI2V's for a 48-channel model, `s = 16`), or
`--latent-shape C F H W`.

**Output.** `--latents FILE` writes the final latents `(B, C, F, H, W)` float32
(`.safetensors` under the key `latents`, or `.npy`; default `latents.safetensors` when
no `--output` is given). `--output out.mp4` decodes them without torch, with
`models.WanVAE.from_pretrained` of the pipeline's `vae/` (or `--vae DIR`), as
`WanPipeline` does: `WanVAE.denormalize_latents` (`latents * latents_std +
latents_mean`), `WanVAE.decode`, `interop.video_to_frames` (`(video / 2 + 0.5)` clipped
to [0, 1]), rounded to uint8, and `interop.write_video` (H.264 through PyAV) at `--fps`;
several videos get `_1`, `_2`, ... suffixes.

**Old flags** (until vidax_eqx 0.3.0, each with a deprecation message on stderr):
`--checkpoint DIR` (the positional `MODEL`), `--frames` (`--num-frames`), `--video`
(`--output`), `--output FILE.safetensors|.npy` (`--latents`), `--mesh sp=4,tp=2`
(`--sp 4 --tp 2`).
"""

import argparse
import json
import os
import sys
import time

try:
    import vidax_eqx  # noqa: F401
except ImportError:  # run against this checkout's vidax_eqx when it is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_MESH_AXES = ("dp", "sp", "tp", "cfg")
_REMOVED_IN = "0.3.0"


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


def _deprecated(old: str, new: str) -> None:
    print(f"generate_wan.py: {old} is deprecated and will be removed in vidax_eqx "
          f"{_REMOVED_IN}: use {new}", file=sys.stderr, flush=True)


def parser() -> argparse.ArgumentParser:
    """The example's arguments: `vidax-generate`'s names, and its extras."""
    from vidax_eqx.generate import add_device_arguments
    from vidax_eqx.pipelines import WanPipeline

    defaults = WanPipeline.defaults
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="See the module docstring (examples/generate_wan.py) for the file formats.")
    p.add_argument("model", nargs="?",
                   help="a diffusers pipeline, Wan 2.2 A14B or transformer directory, or a Hub id")
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)  # deprecated: MODEL
    text = p.add_argument_group("text")
    text.add_argument("--embeddings", help="a .safetensors file with prompt_embeds "
                      "[(B,) L, text_dim] and negative_prompt_embeds")
    text.add_argument("--prompt", action="append",
                      help="a prompt, encoded with the pipeline's UMT5 (models.T5Encoder); "
                      "repeat for a batch")
    text.add_argument("--negative-prompt", default="", help="the negative prompt (default '')")
    text.add_argument("--max-sequence-length", type=int, default=defaults.max_sequence_length,
                      help=f"the prompt's token length (default {defaults.max_sequence_length}, "
                           "as diffusers)")
    v = p.add_argument_group("video")
    v.add_argument("--height", type=int, default=defaults.height,
                   help=f"pixels (default {defaults.height})")
    v.add_argument("--width", type=int, default=defaults.width,
                   help=f"pixels (default {defaults.width})")
    v.add_argument("--num-frames", type=int, help=f"video frames (default {defaults.num_frames})")
    v.add_argument("--frames", type=int, help=argparse.SUPPRESS)  # deprecated: --num-frames
    v.add_argument("--latent-shape", type=int, nargs=4, metavar=("C", "F", "H", "W"),
                   help="the latent shape, instead of --num-frames/--height/--width")
    v.add_argument("--fps", type=float, default=defaults.fps,
                   help=f"the video's frame rate (default {defaults.fps})")
    v.add_argument("--output", help="decode with the pipeline's vae/ (models.WanVAE) to this .mp4")
    v.add_argument("--video", help=argparse.SUPPRESS)  # deprecated: --output
    v.add_argument("--latents", help="the final latents, .safetensors (key 'latents') or .npy "
                   "(default latents.safetensors when no --output is given)")
    v.add_argument("--vae", help="the VAE directory (default: the pipeline's vae/)")
    s = p.add_argument_group("sampling")
    s.add_argument("--steps", type=int, default=defaults.num_inference_steps,
                   help=f"denoising steps (default {defaults.num_inference_steps})")
    s.add_argument("--guidance-scale", type=float, default=defaults.guidance_scale,
                   help=f"CFG scale (default {defaults.guidance_scale})")
    s.add_argument("--guidance-scale-2", type=float,
                   help="Wan 2.2 A14B: the low-noise expert's scale (default: --guidance-scale)")
    s.add_argument("--scheduler", choices=("unipc", "euler"), default="unipc",
                   help="UniPC (default, diffusers' Wan default) or flow-matching Euler")
    s.add_argument("--shift", type=float, default=3.0,
                   help="the timestep shift (default 3.0: 480p; 5.0 for 720p)")
    s.add_argument("--seed", type=int, default=0, help="the noise seed (default 0)")
    s.add_argument("--noise", help="initial latents instead of the seed's: a .safetensors "
                   "(key 'noise') or .npy file, (B, C, F, H, W)")
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
    add_device_arguments(p)
    p.add_argument("--mesh", type=_mesh_spec, help=argparse.SUPPRESS)  # deprecated: --sp ...
    return p


def parse_args(argv=None):
    from vidax_eqx.generate import check_devices, CommandError
    from vidax_eqx.pipelines import WanPipeline

    p = parser()
    args = p.parse_args(argv)
    _old_flags(p, args, WanPipeline.defaults)
    try:
        check_devices(args)
    except CommandError as e:
        p.error(str(e))
    if args.model is None:
        p.error("MODEL (a checkpoint directory or Hub id) is required")
    if (args.embeddings is None) == (args.prompt is None):
        p.error("give exactly one of --embeddings FILE and --prompt TEXT")
    if args.output is not None and not args.output.endswith(".mp4"):
        p.error(f"--output must end in .mp4 (the latents: --latents); received {args.output!r}")
    if args.latents is None and args.output is None:
        args.latents = "latents.safetensors"
    if args.latents is not None and not args.latents.endswith((".safetensors", ".npy")):
        p.error(f"--latents must end in .safetensors or .npy; received {args.latents!r}")
    return args


def _old_flags(p, args, defaults) -> None:
    """The flags of vidax_eqx 0.1's example, mapped to the command's vocabulary."""
    if args.checkpoint is not None:
        _deprecated("--checkpoint DIR", "the positional MODEL")
        if args.model is not None:
            p.error("give MODEL or the deprecated --checkpoint, not both")
        args.model = args.checkpoint
    if args.frames is not None:
        _deprecated("--frames", "--num-frames")
        if args.num_frames is not None:
            p.error("give --num-frames or the deprecated --frames, not both")
        args.num_frames = args.frames
    if args.num_frames is None:
        args.num_frames = defaults.num_frames
    video = args.video
    if args.output is not None and args.output.endswith((".safetensors", ".npy")):
        _deprecated("--output FILE.safetensors / .npy (the latents)", "--latents FILE")
        if args.latents is not None:
            p.error("give --latents or the deprecated --output FILE.safetensors, not both")
        args.latents, args.output = args.output, None
    elif video is not None and args.latents is None:
        args.latents = "latents.safetensors"  # 0.1 wrote the latents beside the video
    if video is not None:
        _deprecated("--video FILE.mp4", "--output FILE.mp4")
        if args.output is not None:
            p.error("give --output or the deprecated --video, not both")
        args.output = video
    if args.mesh is not None:
        _deprecated("--mesh", "--sp N --tp N --dp N --cfg 2")
        for axis in _MESH_AXES:
            if getattr(args, axis) != 1 and axis in args.mesh:
                p.error(f"give --{axis} or the deprecated --mesh, not both")
            setattr(args, axis, args.mesh.get(axis, getattr(args, axis)))


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


def decode_video(vae_dir, latents, dtype=None):
    """diffusers' `WanPipeline` decode, without torch: uint8 frames `(B, F, H, W, 3)`;
    the VAE in `dtype` (default its checkpoint's)."""
    import jax.numpy as jnp
    import numpy as np
    from vidax_eqx import interop, models

    vae = models.WanVAE.from_pretrained(vae_dir, **({} if dtype is None else dict(dtype=dtype)))
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


def _reused_steps(progress):
    """A progress callback that also records the steps that reused the step cache."""
    from vidax_eqx import sampling

    class Recorder(sampling.AbstractProgress):
        def __init__(self):
            self.steps = []

        def begin(self, steps):
            progress.begin(steps)

        def __call__(self, step):
            if step.reused:
                self.steps.append(step.step)
            progress(step)

        def end(self):
            progress.end()

    return Recorder()


def _run(args) -> list[str]:
    from vidax_eqx.generate import (
        check_libraries, log, make_mesh, progress_callback, simulate_devices, write_latents,
    )

    needs = [("tokenizers", "tokenizers", "--prompt")] if args.prompt else []
    if args.output:
        needs.append(("av", "av", "writing the .mp4"))
    if not os.path.isdir(args.model):
        needs.append(("huggingface_hub", "huggingface_hub", "a Hub id"))
    check_libraries(needs)
    simulate_devices(args.sp * args.tp * args.dp * args.cfg)
    if not args.no_compile_cache:
        from vidax_eqx.pipelines import enable_compile_cache

        enable_compile_cache()
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    from vidax_eqx import interop, nn, sampling

    mesh = make_mesh(args)
    parallel_config = None
    if mesh is not None:
        parallel_config = nn.sharding.ParallelConfig(
            sequence="ulysses" if args.sp > 1 else "none", tp_axis="tp" if args.tp > 1 else None)

    t0 = time.perf_counter()
    dtype = None if args.dtype is None else jnp.dtype(args.dtype)
    model, find = load_model(args.model, dtype=dtype, parallel=parallel_config, mesh=mesh)
    config = model.config
    model_dtype = next(leaf.dtype for leaf in jax.tree.leaves(model) if eqx.is_inexact_array(leaf))
    kind = type(model).__name__
    log(f"model       {kind} from {args.model} ({model_dtype}, "
        f"{config.num_layers} blocks, dim {config.dim}): {time.perf_counter() - t0:.1f} s")

    t0 = time.perf_counter()
    if args.embeddings is not None:
        context, negative = read_embeddings(args.embeddings)
        source = args.embeddings
    else:
        encoder, tokenizer = find("text_encoder"), find("tokenizer")
        if encoder is None or tokenizer is None:
            raise ValueError(f"--prompt: {args.model!r} has no text_encoder/ and tokenizer/ "
                             "(a diffusers pipeline has them); pass --embeddings instead.")
        context = encode_prompts(encoder, tokenizer, args.prompt, args.max_sequence_length)
        negative = None
        if args.guidance_scale > 1:
            negative = encode_prompts(encoder, tokenizer, [args.negative_prompt] * len(args.prompt),
                                      args.max_sequence_length)
        source = f"UMT5 of {encoder}"
    if args.guidance_scale <= 1:
        negative = None
    log(f"text        {context.shape} from {source}"
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
                                 args.num_frames, args.height, args.width)
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
    progress = _reused_steps(progress_callback())

    t0 = time.perf_counter()
    latents = sampling.sample(
        model, noise, context, negative_context=negative, steps=args.steps, scheduler=scheduler,
        guidance=sampling.Guidance(scale=args.guidance_scale, scale_2=args.guidance_scale_2),
        placement=sampling.Placement(mesh=mesh, batch_axis="dp" if args.dp > 1 else None,
                                     cfg_axis="cfg" if args.cfg > 1 else None),
        caching=sampling.Caching(step=step_cache), progress=progress)
    latents = np.asarray(jax.device_get(latents), np.float32)
    mesh_text = "1 device" if mesh is None else f"mesh {dict(mesh.shape)}"
    log(f"sampled     {latents.shape} in {args.steps} {args.scheduler} steps, guidance "
        f"{args.guidance_scale}, {mesh_text}: {time.perf_counter() - t0:.1f} s")
    if step_cache is not None:
        log(f"step cache  {len(progress.steps)} of {args.steps} steps reused the block "
            f"stack's residual: {progress.steps}")

    paths = []
    if args.latents is not None:
        write_latents(args.latents, latents)
        log(f"latents     written to {args.latents}")
        paths.append(args.latents)
    if args.output is not None:
        vae = args.vae or find("vae")
        if vae is None:
            raise ValueError(f"--output: {args.model!r} has no vae/ to decode with; pass --vae "
                             "DIR.")
        t0 = time.perf_counter()
        frames = decode_video(vae, latents, dtype=jnp.dtype(args.vae_dtype))
        videos = write_videos(args.output, frames, args.fps)
        log(f"video       {frames.shape[1:]} frames x {len(videos)} written to "
            f"{', '.join(videos)}: {time.perf_counter() - t0:.1f} s")
        paths += videos
    return paths


def main(argv=None) -> int:
    """Runs the example: the paths written on stdout (the latents, the videos), 0; an error
    is one line on stderr and `SystemExit(2)`, as `vidax-generate`'s."""
    from vidax_eqx.generate import CommandError

    args = parse_args(argv)
    try:
        paths = _run(args)
    except (CommandError, ValueError, ImportError, FileNotFoundError,
            NotImplementedError) as e:
        print(f"generate_wan.py: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    for path in paths:
        print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
