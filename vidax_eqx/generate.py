"""`vidax-generate` (or `python -m vidax_eqx.generate`): a prompt (and an image) to an
`.mp4` with a Wan or CogVideoX diffusers pipeline, without PyTorch.

    vidax-generate Wan-AI/Wan2.1-T2V-1.3B-Diffusers --prompt "A cat walks on the grass" \\
        --height 480 --width 832 --num-frames 81 --output cat.mp4
    vidax-generate /models/Wan2.1-I2V-14B-480P-Diffusers --image first.png \\
        --prompt "The cat turns its head" --dtype bfloat16 --sp 4 --tp 2 --output i2v.mp4

The pipeline ([`vidax_eqx.pipelines.WanPipeline`][] or
[`vidax_eqx.pipelines.CogVideoXPipeline`][], by `model_index.json`'s class) is read from a
folder saved by diffusers or a Hub id; the size, guidance, prompt length and frame rate
default to the model family's (Wan: 480 x 832, 81 frames, guidance 5, 512 tokens, 16 fps;
CogVideoX: 480 x 720, 49 frames, guidance 6, 226 tokens, 8 fps). `--sp`, `--tp`, `--dp` and `--cfg` build the device mesh
(Ulysses over `sp`, Megatron over `tp`, the batch over `dp`, guidance's two passes over
`cfg`); on a CPU the devices are simulated. Each stage's time is printed as it ends.
"""

import argparse
import json
import os
import sys
import time

__all__ = ["main"]

_FAMILIES = {"WanPipeline": "wan", "WanImageToVideoPipeline": "wan",
             "CogVideoXPipeline": "cogvideox", "CogVideoXImageToVideoPipeline": "cogvideox"}
_DEFAULTS = {  # diffusers' call defaults, and the models' frame rates
    "wan": dict(height=480, width=832, num_frames=81, guidance_scale=5.0,
                max_sequence_length=512, fps=16),
    "cogvideox": dict(height=480, width=720, num_frames=49, guidance_scale=6.0,
                      max_sequence_length=226, fps=8),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="vidax-generate",
        description="Generate a video from a prompt (and an image) with a Wan or CogVideoX "
                    "diffusers pipeline, in JAX, without PyTorch.")
    p.add_argument("model", help="a diffusers pipeline folder (model_index.json) or a Hugging "
                   "Face Hub id, e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    p.add_argument("--prompt", action="append", required=True,
                   help="the prompt; repeat for several videos")
    p.add_argument("--negative-prompt", default=None,
                   help="the negative prompt, used when --guidance-scale > 1 (default '')")
    p.add_argument("--image", help="image-to-video: the first frame (an image file)")
    p.add_argument("--last-image", help="Wan FLF2V: the last frame (an image file)")
    v = p.add_argument_group("video")
    v.add_argument("--height", type=int, help="pixels (default 480)")
    v.add_argument("--width", type=int, help="pixels (default Wan 832, CogVideoX 720)")
    v.add_argument("--num-frames", type=int,
                   help="frames (default Wan 81 = 1 + 4k, CogVideoX 49 = 1 + 8k)")
    v.add_argument("--fps", type=float, help="frames per second (default Wan 16, CogVideoX 8)")
    v.add_argument("--output", default="video.mp4",
                   help="the .mp4 to write (several videos: _1, _2, ... suffixes; default "
                        "video.mp4)")
    v.add_argument("--latents",
                   help="also write the final latents (the transformer's layout) to this .npy")
    s = p.add_argument_group("sampling")
    s.add_argument("--steps", type=int, default=50, help="denoising steps (default 50)")
    s.add_argument("--guidance-scale", type=float,
                   help="CFG scale (default Wan 5.0, CogVideoX 6.0)")
    s.add_argument("--guidance-scale-2", type=float,
                   help="Wan 2.2 A14B: the low-noise expert's scale (default --guidance-scale)")
    s.add_argument("--use-dynamic-cfg", action="store_true",
                   help="CogVideoX: the cosine guidance schedule")
    s.add_argument("--seed", type=int, default=0, help="the initial latents' seed (default 0)")
    s.add_argument("--num-videos-per-prompt", type=int, default=1, help="default 1")
    s.add_argument("--max-sequence-length", type=int,
                   help="the prompt's tokens (default Wan 512, CogVideoX 226)")
    m = p.add_argument_group("model and devices")
    m.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="the transformer's and encoders' dtype (default: the checkpoint's)")
    m.add_argument("--vae-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the VAE's dtype (default float32)")
    for axis, what in (("sp", "sequence parallelism (Ulysses)"),
                       ("tp", "tensor parallelism (Megatron)"),
                       ("dp", "the batch"), ("cfg", "guidance's two passes: 1 or 2")):
        m.add_argument(f"--{axis}", type=int, default=1, metavar="N",
                       help=f"devices for {what} (default 1)")
    args = p.parse_args(argv)
    for axis in ("sp", "tp", "dp", "cfg"):
        if getattr(args, axis) < 1:
            p.error(f"--{axis} must be >= 1; received {getattr(args, axis)}")
    if args.cfg not in (1, 2):
        p.error(f"--cfg must be 1 or 2 (the conditional and unconditional passes); received "
                f"{args.cfg}")
    if args.last_image and not args.image:
        p.error("--last-image needs --image (the first frame)")
    if not args.output.endswith(".mp4"):
        p.error(f"--output must end in .mp4; received {args.output!r}")
    return args


def _simulate_devices(count: int) -> None:
    """On a CPU, `count` simulated devices (the flag is read by the CPU backend only, when
    JAX starts)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])


def _read_image(path: str):
    try:
        from PIL import Image
    except ImportError as e:
        raise SystemExit("--image needs Pillow: pip install 'vidax_eqx[video]'") from e
    with Image.open(path) as image:
        return image.convert("RGB")


def _report(stage: str, seconds: float) -> None:
    print(f"{stage:<10} {seconds:8.1f} s", flush=True)


def main(argv=None) -> list[str]:
    """Runs the command; returns the paths of the videos written."""
    args = parse_args(argv)
    devices = args.sp * args.tp * args.dp * args.cfg
    if devices > 1 and "jax" not in sys.modules:
        _simulate_devices(devices)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from . import interop, parallel
    from .pipelines import CogVideoXPipeline, save_video, WanPipeline

    mesh = None
    if devices > 1:
        if jax.device_count() < devices:
            raise SystemExit(f"--sp {args.sp} --tp {args.tp} --dp {args.dp} --cfg {args.cfg} "
                             f"needs {devices} devices; JAX sees {jax.device_count()}.")
        extra = {"cfg": args.cfg} if args.cfg > 1 else None
        mesh = parallel.make_mesh(args.dp, args.sp, args.tp, extra_axes=extra)
    start = time.perf_counter()
    root = interop.resolve_pipeline(args.model)
    with open(os.path.join(root, "model_index.json")) as f:
        name = json.load(f).get("_class_name")
    if name not in _FAMILIES:
        raise SystemExit(f"{args.model!r} is a {name!r} pipeline; vidax-generate runs "
                         f"{', '.join(_FAMILIES)}.")
    family = _FAMILIES[name]
    cls = WanPipeline if family == "wan" else CogVideoXPipeline
    pipe = cls.from_pretrained(
        root, dtype=None if args.dtype is None else jnp.dtype(args.dtype),
        vae_dtype=jnp.dtype(args.vae_dtype), mesh=mesh)
    where = "1 device" if mesh is None else f"mesh {dict(mesh.shape)}"
    print(f"{'load':<10} {time.perf_counter() - start:8.1f} s  ({name}: "
          f"{type(pipe.transformer).__name__}, {pipe.transformer_dtype}, "
          f"{type(pipe.scheduler).__name__}, {where})", flush=True)
    defaults = dict(_DEFAULTS[family])
    if family == "cogvideox" and pipe.positional_text_length is not None:
        defaults["max_sequence_length"] = pipe.positional_text_length
    settings = {k: defaults[k] if getattr(args, k) is None else getattr(args, k)
                for k in defaults}
    fps = settings.pop("fps")
    kwargs = dict(settings, num_inference_steps=args.steps, seed=args.seed,
                  num_videos_per_prompt=args.num_videos_per_prompt, report=_report)
    if args.image is not None:
        kwargs["image"] = _read_image(args.image)
    if family == "wan":
        kwargs["guidance_scale_2"] = args.guidance_scale_2
        if args.last_image is not None:
            kwargs["last_image"] = _read_image(args.last_image)
    else:
        for flag, given in (("--guidance-scale-2", args.guidance_scale_2 is not None),
                            ("--last-image", args.last_image is not None)):
            if given:
                raise SystemExit(f"{flag} is for Wan pipelines; {args.model!r} is {name}.")
        kwargs["use_dynamic_cfg"] = args.use_dynamic_cfg
    if family == "wan" and args.use_dynamic_cfg:
        raise SystemExit(f"--use-dynamic-cfg is for CogVideoX pipelines; {args.model!r} is {name}.")
    prompt = args.prompt[0] if len(args.prompt) == 1 else args.prompt
    out = pipe(prompt, args.negative_prompt, **kwargs)
    start = time.perf_counter()
    stem, ext = os.path.splitext(args.output)
    paths = [args.output if i == 0 else f"{stem}_{i}{ext}" for i in range(len(out.frames))]
    for path, frames in zip(paths, out.frames):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        save_video(frames, path, fps=fps)
    if args.latents:
        np.save(args.latents, out.latents)
    _report("write", time.perf_counter() - start)
    total = sum(out.timings.values())
    print(f"{'total':<10} {total:8.1f} s  ({', '.join(out.timings)}); videos: "
          f"{', '.join(paths)}", flush=True)
    return paths


if __name__ == "__main__":
    main()
