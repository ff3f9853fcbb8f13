"""The command's arguments, the run (the checks before loading, the load, the call or the
stream, the files written) and its log on stderr."""

import argparse
import importlib
import json
import os
import sys
import time

from ._checks import (
    check_call, check_output, check_text, check_values, CommandError, configured, read_image,
    read_video,
)

_PROG = "vidax-generate"
_DTYPES = ("float32", "bfloat16", "float16")
_AXES = (("sp", "sequence parallelism (Ulysses)"), ("tp", "tensor parallelism (Megatron)"),
         ("dp", "the batch"), ("cfg", "guidance's two passes: 1 or 2"))
# The libraries the command needs, each `(module, pip name, what for)`; the `pipeline`
# extra brings them all.
_TEXT = ("tokenizers", "tokenizers", "the prompt's tokens")
_VIDEO = ("av", "av", "writing the .mp4")
_IMAGE = ("PIL", "pillow", "reading --image")
_HUB = ("huggingface_hub", "huggingface_hub", "a Hub id")
INSTALL = "pip install '.[pipeline]' in a clone of vidax_eqx"
# The quick local run of --help, on the tests' tiny random pipeline (from a clone's root).
QUICK = ('vidax-generate tests/fixtures/wan_pipeline/t2v --prompt "A cat walks on the grass" \\\n'
         "      --height 32 --width 48 --num-frames 9 --steps 4 --max-sequence-length 32 \\\n"
         "      --output cat.mp4")
QUICK_TIME = ("about 12 s of CPU the first time, most of it compiling;\nabout 5 s once JAX's "
              "compilation cache holds its programs")


def _families() -> dict:
    from ..pipelines import CogVideoXPipeline, SkyReelsV2DiffusionForcingPipeline, WanPipeline

    return {name: cls for cls in (WanPipeline, CogVideoXPipeline, SkyReelsV2DiffusionForcingPipeline)
            for name in cls.pipeline_classes}


def _default(field: str, unit: str = "") -> str:
    from ..pipelines import CogVideoXPipeline, WanPipeline

    wan, cog = getattr(WanPipeline.defaults, field), getattr(CogVideoXPipeline.defaults, field)
    if wan == cog:
        return f"default {wan}{unit}"
    return f"default Wan {wan}{unit}, CogVideoX {cog}{unit}"


def parser() -> argparse.ArgumentParser:
    """The command's arguments (`examples/generate_wan.py` shares their names)."""
    p = argparse.ArgumentParser(
        prog=_PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate a video from a prompt (and an image) with a Wan or CogVideoX "
                    "diffusers pipeline, in JAX, without PyTorch.",
        epilog=f"A quick local run, from the root of a clone (the tests' tiny random "
               f"pipeline):\n\n  {QUICK}\n\n({QUICK_TIME}.)\n\nThe paths written go to "
               "stdout, the progress and timings to stderr; an error\nis one line on "
               "stderr and exit status 2.")
    p.add_argument("model", help="a diffusers pipeline folder (model_index.json) or a Hugging "
                   "Face Hub id, e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    p.add_argument("--prompt", action="append", required=True,
                   help="the prompt; repeat for several videos")
    p.add_argument("--negative-prompt", default=None,
                   help="the negative prompt, used when --guidance-scale > 1 (default '')")
    p.add_argument("--image", help="image-to-video: the first frame (an image file)")
    p.add_argument("--last-image", help="Wan FLF2V, SkyReels-V2 DF I2V: the last frame (an image file)")
    p.add_argument("--video", help="SkyReels-V2 diffusion forcing: video to video, the video file "
                                   "continued from its last --overlap-history frames")
    v = p.add_argument_group("video")
    v.add_argument("--height", type=int, help=f"pixels ({_default('height')})")
    v.add_argument("--width", type=int, help=f"pixels ({_default('width')})")
    v.add_argument("--num-frames", type=int,
                   help=f"frames ({_default('num_frames')}; Wan 1 + 4k, CogVideoX 1 + 8k)")
    v.add_argument("--fps", type=float, help=f"frames per second ({_default('fps')})")
    v.add_argument("--output", default="video.mp4",
                   help="the .mp4 to write (several videos: _1, _2, ... suffixes; default "
                        "video.mp4)")
    v.add_argument("--latents", help="also write the final latents (the transformer's "
                   "layout) to this .npy or .safetensors (key 'latents')")
    s = p.add_argument_group("sampling")
    s.add_argument("--steps", type=int,
                   help=f"denoising steps ({_default('num_inference_steps')})")
    s.add_argument("--guidance-scale", type=float,
                   help=f"CFG scale ({_default('guidance_scale')})")
    s.add_argument("--guidance-scale-2", type=float,
                   help="Wan 2.2 A14B: the low-noise expert's scale (default --guidance-scale)")
    s.add_argument("--use-dynamic-cfg", action="store_true",
                   help="CogVideoX: the cosine guidance schedule")
    s.add_argument("--ar-step", type=int, default=None,
                   help="SkyReels-V2 diffusion forcing: the iterations a frame lags the one "
                        "before it (default 0: every frame at once)")
    s.add_argument("--causal-block-size", type=int, default=None,
                   help="SkyReels-V2 diffusion forcing: latent frames per causal block, the "
                        "transformer's attention frame-block causal above 1 (default: the "
                        "transformer's num_frame_per_block)")
    s.add_argument("--overlap-history", type=int, default=None,
                   help="SkyReels-V2 diffusion forcing: a video longer than --base-num-frames "
                        "in windows overlapping by this many frames (17 or 37 recommended); "
                        "with --video, the input's frames continued")
    s.add_argument("--base-num-frames", type=int, default=None,
                   help="SkyReels-V2 diffusion forcing: the frames of a window (default 97)")
    s.add_argument("--addnoise-condition", type=float, default=None,
                   help="SkyReels-V2 diffusion forcing: the noise level the overlapping frames "
                        "are shown at (20 recommended; default 0)")
    s.add_argument("--stream", action="store_true",
                   help="Wan / SkyReels-V2: generate chunk by chunk against a key/value cache, "
                        "each chunk decoded and appended to the file as it is finished, a "
                        "fragmented .mp4 that plays up to the frames written so far (FewStep's "
                        "4 steps per chunk and no guidance by default; --steps: the folder's "
                        "scheduler)")
    s.add_argument("--chunk-frames", type=int, default=3,
                   help="--stream: latent frames per chunk (default 3)")
    s.add_argument("--max-cached-frames", type=int, default=None,
                   help="--stream: latent frames the key/value cache keeps (default: all)")
    s.add_argument("--seed", type=int, default=0, help="the initial latents' seed (default 0)")
    s.add_argument("--num-videos-per-prompt", type=int, default=1, help="default 1")
    s.add_argument("--max-sequence-length", type=int,
                   help=f"the prompt's tokens ({_default('max_sequence_length')})")
    add_device_arguments(p)
    return p


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """`--dtype`, `--vae-dtype`, `--sp/--tp/--dp/--cfg` and `--no-compile-cache`."""
    m = p.add_argument_group("model and devices")
    m.add_argument("--dtype", choices=_DTYPES,
                   help="the transformer's and encoders' dtype (default: the checkpoint's)")
    m.add_argument("--vae-dtype", choices=_DTYPES, default="float32",
                   help="the VAE's dtype (default float32)")
    m.add_argument("--quantize", choices=("none", "int8-weights", "int8"), default="none",
                   help="the transformer's block layers in int8: int8-weights (half the bytes) "
                        "or int8 (weights and activations: int8 products); default none")
    for axis, what in _AXES:
        m.add_argument(f"--{axis}", type=int, default=1, metavar="N",
                       help=f"devices for {what} (default 1; simulated on a CPU)")
    m.add_argument("--offload", choices=("auto", "none", "model", "cpu", "blocks"), default="auto",
                   help="where the components live on one accelerator: auto (default: the fastest "
                        "plan that fits), none (all resident), model (host memory, moved in for "
                        "their stage), cpu (the encoders on the host CPU), blocks (the "
                        "transformer's blocks streamed from host memory)")
    m.add_argument("--device-memory", metavar="SIZE",
                   help="the memory the plan may use on the accelerator: bytes or a size with a "
                        "unit (8GB, 7.5GiB, 512MB; default: the capacity JAX reports)")
    m.add_argument("--host-memory", metavar="SIZE",
                   help="the machine's memory the plan may keep components in (host memory, "
                        "the host CPU, streamed blocks), as --device-memory (default: the "
                        "machine's physical memory)")
    m.add_argument("--no-compile-cache", action="store_true",
                   help="leave JAX's persistent compilation cache off (by default it is on, in "
                        "$XDG_CACHE_HOME/vidax_eqx/jax or ~/.cache/vidax_eqx/jax; also "
                        "VIDAX_COMPILE_CACHE=0)")


def check_devices(args) -> None:
    """`--sp/--tp/--dp/--cfg`, `--offload`, `--device-memory` and `--host-memory` (parsed
    to bytes in `args`); a `CommandError` otherwise."""
    for axis, _ in _AXES:
        if getattr(args, axis) < 1:
            raise CommandError(f"--{axis} must be an int >= 1; received {getattr(args, axis)}.")
    if args.cfg not in (1, 2):
        raise CommandError(f"--cfg must be 1 or 2 (the conditional and unconditional passes); "
                           f"received {args.cfg}.")
    for name in ("device_memory", "host_memory"):
        value = getattr(args, name)
        if value is not None:
            from ..pipelines import parse_bytes

            try:
                setattr(args, name, parse_bytes(value, name))
            except ValueError:
                raise CommandError(
                    f"--{name.replace('_', '-')} must be bytes or a size with a unit (KB, MB, GB, "
                    f"KiB, MiB, GiB; e.g. 8GB); received {value!r}.") from None
    mesh = args.sp * args.tp * args.dp * args.cfg > 1
    planned = args.device_memory is not None or args.host_memory is not None
    if mesh and (args.offload not in ("auto", "none") or planned):
        raise CommandError("--offload, --device-memory and --host-memory plan one accelerator's "
                           "memory; over a mesh (--sp, --tp, --dp, --cfg) the weights are "
                           "sharded instead.")


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, parsed by argparse (which answers `--help` and an unknown flag itself)
    and checked: a `CommandError` for a value no run can take."""
    args = parser().parse_args(argv)
    check_devices(args)
    if args.last_image and not args.image:
        raise CommandError("--last-image needs --image (the first frame).")
    if not args.output.endswith(".mp4"):
        raise CommandError(f"--output must end in .mp4; received {args.output!r}.")
    if args.latents and not args.latents.endswith((".npy", ".safetensors")):
        raise CommandError(f"--latents must end in .npy or .safetensors; received "
                           f"{args.latents!r}.")
    if args.stream:
        for option, given in (("--image", args.image), ("--last-image", args.last_image),
                              *_forcing_flags(args), ("--latents", args.latents)):
            if given is not None:
                raise CommandError(f"{option} does not go with --stream.")
    check_values(args)
    for option, texts in (("--prompt", args.prompt), ("--negative-prompt", [args.negative_prompt])):
        for text in texts:
            if text is not None:
                check_text(option, text)
    return args


# -- before anything loads ---------------------------------------------------------------


def check_libraries(needs) -> None:
    """Imports each `(module, pip name, what for)` of `needs`; a `CommandError` naming
    every missing one and the extra that brings them all."""
    missing = []
    for module, package, why in needs:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append((package, why))
    if missing:
        names = ", ".join(f"{package} ({why})" for package, why in missing)
        raise CommandError(
            f"missing {names}: {INSTALL} (the `pipeline` extra: tokenizers, av, pillow, "
            f"huggingface_hub), or pip install {' '.join(package for package, _ in missing)}.")


def simulate_devices(count: int) -> None:
    """`count` devices on a CPU: JAX's `jax_num_cpu_devices`, when the backend has not
    started and `XLA_FLAGS` does not set the count already (the CPU backend reads it
    when it starts; other platforms ignore it)."""
    if count <= 1 or "--xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # the backend already started (a caller ran JAX in this process)
        pass


def make_mesh(args):
    """The mesh of `--sp/--tp/--dp/--cfg` (`None` for one device)."""
    import jax

    from .. import parallel

    devices = args.sp * args.tp * args.dp * args.cfg
    if devices == 1:
        return None
    if jax.device_count() < devices:
        raise CommandError(
            f"--sp {args.sp} --tp {args.tp} --dp {args.dp} --cfg {args.cfg} needs {devices} "
            f"devices; JAX sees {jax.device_count()} ({jax.default_backend()}).")
    extra = {"cfg": args.cfg} if args.cfg > 1 else None
    return parallel.make_mesh(args.dp, args.sp, args.tp, extra_axes=extra)


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def progress_callback():
    """A bar on a terminal, else lines every few steps (for a log)."""
    from ..sampling import ProgressBar, ProgressLines

    if sys.stderr.isatty():
        try:
            importlib.import_module("tqdm")
            return ProgressBar()
        except ImportError:
            pass
    return ProgressLines()


def write_latents(path: str, latents) -> None:
    import numpy as np

    from .. import interop

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".npy"):
        np.save(path, latents)
    else:
        interop.save_safetensors({"latents": np.asarray(latents, np.float32)}, path)


def _log_start(stage: str, what: str = "") -> None:
    """A stage's start, `stage  ...` (its end: `stage  seconds s`): a log shows what runs
    while it compiles, not only what has finished."""
    log(f"{stage:<10} {'...':>8}  {what}".rstrip())


def _stage_report(starts: dict[str, str]):
    """The pipeline's `report(stage, seconds)`: the stage's time as it ends, then the
    start of the stage after it. `starts`: each stage's start line, in their order."""
    order = list(starts)

    def report(stage: str, seconds: float) -> None:
        log(f"{stage:<10} {seconds:8.1f} s")
        if stage in order[:-1]:
            following = order[order.index(stage) + 1]
            _log_start(following, starts[following])

    return report


# -- the run -----------------------------------------------------------------------------


def _forcing_flags(args) -> tuple:
    """The SkyReels-V2 diffusion forcing flags, `(flag, value or None)`."""
    return (("--ar-step", args.ar_step), ("--causal-block-size", args.causal_block_size),
            ("--overlap-history", args.overlap_history), ("--base-num-frames", args.base_num_frames),
            ("--addnoise-condition", args.addnoise_condition), ("--video", args.video))


def _paths(args) -> list[str]:
    """The videos' files: `--output`, then `_1`, `_2`, ... for the videos after the first."""
    stem, ext = os.path.splitext(args.output)
    videos = len(args.prompt) * args.num_videos_per_prompt
    return [args.output if i == 0 else f"{stem}_{i}{ext}" for i in range(videos)]


def _call_keywords(args, inputs: dict, fps: float, skyreels: bool) -> tuple[dict, dict | None]:
    """The pipeline call's keywords from the flags and the `inputs` read (`--image`,
    `--last-image`, `--video`): `(kwargs, forcing)`, `forcing` the SkyReels-V2 diffusion
    forcing keywords (`None` for the other families); `fps` the family's frame rate."""
    kwargs = dict(height=args.height, width=args.width, num_frames=args.num_frames,
                  num_inference_steps=args.steps, guidance_scale=args.guidance_scale,
                  guidance_scale_2=args.guidance_scale_2, use_dynamic_cfg=args.use_dynamic_cfg,
                  max_sequence_length=args.max_sequence_length, seed=args.seed,
                  num_videos_per_prompt=args.num_videos_per_prompt, **inputs)
    if not skyreels:
        return kwargs, None
    kwargs["fps"] = fps if args.fps is None else args.fps  # the model is conditioned on it
    forcing = dict(ar_step=args.ar_step or 0, causal_block_size=args.causal_block_size,
                   overlap_history=args.overlap_history,
                   addnoise_condition=args.addnoise_condition or 0)
    if args.base_num_frames is not None:
        forcing["base_num_frames"] = args.base_num_frames
    return kwargs, forcing


def _run(args, start: float) -> list[str]:
    """The run: every check that needs no weight (`parse_args`' before it), then the load,
    the call (or the stream) and the files; the paths written."""
    needs = [_TEXT, _VIDEO]
    if args.image or args.last_image:
        needs.append(_IMAGE)
    if args.video:
        needs.append(("PIL", "pillow", "resizing --video"))
    if not os.path.isdir(args.model):
        needs.append(_HUB)
    check_libraries(needs)
    for option, path in (("--output", args.output), ("--latents", args.latents)):
        if path is not None:
            check_output(option, path)
    inputs = {dest: read_image(option, path) for option, dest, path in (
        ("--image", "image", args.image), ("--last-image", "last_image", args.last_image))
        if path is not None}
    if args.video is not None:
        inputs["video"] = read_video("--video", args.video)
    simulate_devices(args.sp * args.tp * args.dp * args.cfg)
    if not args.no_compile_cache:
        from ..pipelines import enable_compile_cache

        enable_compile_cache()
    import jax.numpy as jnp

    from .. import interop
    from ..pipelines import save_video

    mesh = make_mesh(args)
    root = interop.resolve_pipeline(args.model)
    with open(os.path.join(root, "model_index.json")) as f:
        name = json.load(f).get("_class_name")
    families = _families()
    if name not in families:
        raise CommandError(f"{args.model!r} is a {name!r} pipeline; {_PROG} runs "
                           f"{', '.join(families)}.")
    cls = families[name]
    wan = not cls.__name__.startswith("CogVideoX")  # Wan and SkyReels-V2 (Wan's components)
    skyreels = cls.__name__ == "SkyReelsV2DiffusionForcingPipeline"
    for flag, given in _forcing_flags(args):
        if given is not None and not skyreels:
            raise CommandError(f"{flag} is for SkyReels-V2 diffusion forcing pipelines; {args.model!r} is {name}.")
    for flag, given, family in (("--guidance-scale-2", args.guidance_scale_2 is not None, "Wan"),
                                ("--last-image", args.last_image is not None and not skyreels, "Wan"),
                                ("--use-dynamic-cfg", args.use_dynamic_cfg, "CogVideoX"),
                                ("--stream", args.stream, "Wan and SkyReels-V2")):
        if given and wan != (family != "CogVideoX"):
            raise CommandError(f"{flag} is for {family} pipelines; {args.model!r} is {name}.")
    kwargs, forcing = _call_keywords(args, inputs, cls.defaults.fps, skyreels)
    standin = configured(cls, root)
    if standin is not None:  # the loaded pipeline's own checks of this call, on the configs
        check_call(standin, kwargs, forcing=forcing, stream=_stream_options(
            args, kwargs, standin.scheduler) if args.stream else None)
    d = cls.defaults  # the plan is made for the video asked for
    video = (args.height or d.height, args.width or d.width, args.num_frames or d.num_frames)
    _log_start("load", f"{name} from {args.model}")
    pipe = cls.from_pretrained(
        root, dtype=None if args.dtype is None else jnp.dtype(args.dtype),
        vae_dtype=jnp.dtype(args.vae_dtype), mesh=mesh, compile_cache=False,
        offload=args.offload, device_memory=args.device_memory, host_memory=args.host_memory,
        plan_video=video, quantize=None if args.quantize == "none" else args.quantize)
    if mesh is None:
        log(f"{'plan':<10} {pipe.memory_plan.describe()}")
    where = "1 device" if mesh is None else f"mesh {dict(mesh.shape)}"
    log(f"{'load':<10} {time.perf_counter() - start:8.1f} s  ({name}: "
        f"{type(pipe.transformer).__name__}, {pipe.transformer_dtype}, "
        f"{type(pipe.scheduler).__name__}, {where})")
    defaults = pipe.call_defaults
    kwargs.update(forcing or {})
    shown = {k: getattr(defaults, k) if v is None else v for k, v in kwargs.items()
             if k in ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")}
    videos = len(args.prompt) * args.num_videos_per_prompt
    size = (f"{videos} video{'s' * (videos > 1)} of {shown['num_frames']} x {shown['height']} x "
            f"{shown['width']}")
    prompt = args.prompt[0] if len(args.prompt) == 1 else args.prompt
    if args.stream:
        return _stream(args, pipe, prompt, kwargs, size, start)
    log(f"generating {size}: {shown['num_inference_steps']} steps, guidance "
        f"{shown['guidance_scale']}")
    paths = _paths(args)
    files = paths + ([args.latents] if args.latents else [])
    starts = {"text": "", "image": args.image, "denoise": f"{shown['num_inference_steps']} steps",
              "decode": "", "write": ", ".join(files)}
    if args.image is None:  # the image stage runs with an image
        del starts["image"]
    _log_start("text")
    out = pipe(prompt, args.negative_prompt, progress=progress_callback(),
               report=_stage_report(starts), **kwargs)
    written = time.perf_counter()
    fps = defaults.fps if args.fps is None else args.fps
    for path, frames in zip(paths, out.frames):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        save_video(frames, path, fps=fps)
    if args.latents:
        write_latents(args.latents, out.latents)
    log(f"{'write':<10} {time.perf_counter() - written:8.1f} s")
    log(f"{'total':<10} {time.perf_counter() - start:8.1f} s  (wall time: load, "
        f"{', '.join(out.timings)}, write)")
    return paths


# With --stream and no --guidance-scale: none, as distilled causal models run
# (`WanPipeline.stream`'s default).
_STREAM_GUIDANCE = 1.0


def _stream_options(args, kwargs: dict, scheduler) -> dict:
    """The keywords of `pipe.stream(...)` besides the prompts: the video's size, the
    sampler (`scheduler`, the folder's, for `--steps`; else few-step sampling, what
    distilled causal models expect) and its steps per chunk, the guidance, the chunks."""
    from ..sampling import FewStep

    options = {k: kwargs[k] for k in ("height", "width", "num_frames", "max_sequence_length",
                                      "seed", "num_videos_per_prompt", "fps") if k in kwargs}
    if args.steps is None:
        scheduler = FewStep()
        steps = len(scheduler.timesteps)
    else:
        steps = args.steps
    guidance = _STREAM_GUIDANCE if args.guidance_scale is None else args.guidance_scale
    return dict(options, scheduler=scheduler, num_inference_steps=steps, guidance_scale=guidance,
                chunk_frames=args.chunk_frames, max_cached_frames=args.max_cached_frames)


def _stream(args, pipe, prompt, kwargs: dict, size: str, start: float) -> list[str]:
    """`--stream`: `pipe.stream(...)`, every chunk's frames appended to its video's
    fragmented `.mp4` as soon as they are decoded."""
    from ..interop import VideoWriter

    options = _stream_options(args, kwargs, pipe.scheduler)
    log(f"streaming {size}: {options['num_inference_steps']} steps per chunk "
        f"({type(options['scheduler']).__name__}), guidance {options['guidance_scale']}, chunks "
        f"of {args.chunk_frames} latent frames")
    fps = pipe.call_defaults.fps if args.fps is None else args.fps
    paths = _paths(args)
    writers = []
    _log_start("chunk 0", "the text, then the first chunk (compiled the first time)")
    try:
        for chunk in pipe.stream(prompt, args.negative_prompt, **options):
            if not writers:
                for path in paths:
                    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                writers = [VideoWriter(path, fps=fps, fragmented=True) for path in paths]
            for writer, frames in zip(writers, chunk.frames):
                writer.write(frames)
            log(f"{'chunk ' + str(chunk.index):<10} {chunk.seconds:8.1f} s  ({writers[0].frames} "
                "frames written)")
    finally:
        for writer in writers:
            writer.close()
    log(f"{'total':<10} {time.perf_counter() - start:8.1f} s  (wall time)")
    return paths


def process_start() -> float:
    """The `time.perf_counter()` of this process's start (Linux's `/proc`: the
    interpreter and the imports before `main` count), else of now."""
    now = time.perf_counter()
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return now - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return now


def main(argv=None) -> int:
    """Runs the command: prints the paths of the videos written on stdout and returns
    0; an error is one line on stderr and `SystemExit(2)` (argparse's own, for an unknown
    flag, with its usage first). The total it reports is the process's wall time, from its
    start."""
    start = process_start()
    try:
        paths = _run(parse_args(argv), start)
    except (CommandError, ValueError, ImportError, FileNotFoundError,
            NotImplementedError) as e:
        message = " ".join(str(e).split())
        print(f"{_PROG}: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    for path in paths:
        print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
