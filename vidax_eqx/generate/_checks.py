"""What `vidax-generate` checks before it loads anything, so that no error it could have
seen first comes after the model has loaded and the video has been generated: the flags'
values, the prompts' text, the files it reads, the folders it writes, and the call
against the pipeline folder's JSON configs (no weight read, nothing compiled): the
pipeline class's own checks, run on the class built on its configs (`configured`,
`check_call`).

Each failure is one line on stderr and exit status 2: a `CommandError`, or the
pipeline's own `ValueError` / `NotImplementedError`."""

import json
import math
import os
import tempfile


class CommandError(Exception):
    """An error the command reports as one line (exit status 2)."""


def _flag(dest: str) -> str:
    """The command-line spelling of an argument's `dest` (`num_frames` -> `--num-frames`)."""
    return "--" + dest.replace("_", "-")


# The integer flags and their least value, as the pipelines check their keywords.
_AT_LEAST = (("height", 1), ("width", 1), ("num_frames", 1), ("steps", 1),
             ("num_videos_per_prompt", 1), ("max_sequence_length", 1), ("chunk_frames", 1),
             ("max_cached_frames", 0), ("ar_step", 0), ("causal_block_size", 1),
             ("overlap_history", 1), ("base_num_frames", 1))


def check_values(args) -> None:
    """The numeric flags' ranges: those the pipeline would refuse after loading."""
    for dest, least in _AT_LEAST:
        value = getattr(args, dest)
        if value is not None and value < least:
            raise CommandError(f"{_flag(dest)} must be an int >= {least}; received {value}.")
    for dest in ("guidance_scale", "guidance_scale_2"):
        value = getattr(args, dest)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise CommandError(f"{_flag(dest)} must be a finite number >= 0 (1 or less: no "
                               f"guidance; Wan uses 5); received {value}.")
    if args.fps is not None and not (math.isfinite(args.fps) and args.fps > 0):
        raise CommandError(f"--fps must be a positive number of frames per second; received "
                           f"{args.fps}.")
    noise = args.addnoise_condition
    if noise is not None and not 0 <= noise < 1000:
        raise CommandError(f"--addnoise-condition must be a timestep in [0, 1000) (20 "
                           f"recommended); received {noise}.")


def check_text(option: str, text: str) -> None:
    """`text` is text a tokenizer takes: a shell passes bytes that are not UTF-8 (`$'\\xff'`)
    to Python as lone surrogates, which no encoder accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = "".join(f"\\x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF
                      else f"\\u{ord(c):04x}" for c in text[e.start:e.end])
        raise CommandError(
            f"{option} must be UTF-8 text; received {text!r:.80} with bytes that are not "
            f"UTF-8 ({bad}) at character {e.start}. Check the shell's quoting and the "
            "terminal's encoding (LANG, LC_ALL).") from None


def _check_file(option: str, path: str) -> None:
    if not os.path.exists(path):
        raise CommandError(f"{option}: no file {path!r}.")
    if not os.path.isfile(path):
        raise CommandError(f"{option} must be a file; {path!r} is a folder.")
    try:
        open(path, "rb").close()
    except OSError as e:
        raise CommandError(f"{option}: cannot read {path!r} ({e.strerror or e}).") from None


def read_image(option: str, path: str):
    """The image of `--image` / `--last-image`, read and decoded now (a PIL RGB image)."""
    from PIL import Image, UnidentifiedImageError

    _check_file(option, path)
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as e:
        raise CommandError(f"{option} must be an image file that Pillow reads (PNG, JPEG, WebP, "
                           f"...); {path!r} is not one ({type(e).__name__}: {e}).") from None


def read_video(option: str, path: str):
    """The frames of `--video`, read now (uint8 `(F, H, W, 3)`)."""
    import av

    from .. import interop

    _check_file(option, path)
    try:
        return interop.read_video(path)
    except (av.FFmpegError, OSError, ValueError) as e:
        raise CommandError(f"{option} must be a video file that PyAV reads (.mp4, .mkv, .webm, "
                           f"...); {path!r} is not one ({type(e).__name__}: {e}).") from None


def check_output(option: str, path: str) -> None:
    """`path` can be written: not a folder, and its folder exists (created now when it is
    missing) and takes a new file (one is created and removed)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CommandError(f"{option} must be a file to write; {path!r} is a folder.")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".vidax-generate-"):
            pass
    except (FileExistsError, NotADirectoryError):
        above = folder
        while not os.path.exists(above):
            above = os.path.dirname(above)
        raise CommandError(f"{option} must be a path in a folder that exists or can be created; "
                           f"{path!r} is under {above!r}, a file.") from None
    except OSError as e:
        raise CommandError(f"{option} must be a path in a folder this user can write; {path!r} "
                           f"is in {folder!r} ({e.strerror or e}).") from None
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise CommandError(f"{option} must be a path this user can write; {path!r} exists, "
                           "read-only.")


# The models (of `vidax_eqx.models`) of a pipeline folder's components, by their config's
# `_class_name` (diffusers' names): `(model, config class, the config class's reader)`.
_TRANSFORMERS = {
    "WanTransformer3DModel": ("WanTransformer3D", "WanConfig", "from_diffusers"),
    "SkyReelsV2Transformer3DModel": ("SkyReelsV2Transformer3D", "SkyReelsV2Config", "from_diffusers"),
    "CogVideoXTransformer3DModel": ("CogVideoXTransformer3D", "CogVideoXConfig", "from_diffusers")}
_VAES = {"AutoencoderKLWan": ("WanVAE", "WanVAEConfig", "from_dict"),
         "AutoencoderKLCogVideoX": ("CogVideoXVAE", "CogVideoXVAEConfig", "from_dict")}


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None  # the loader says what is wrong with it
    return config if isinstance(config, dict) else None


def _abstract(table: dict, root: str, component: str):
    """The model of the folder's `component/config.json` (one of `table`'s) built
    abstractly, as the models' `from_pretrained` build it before reading a weight
    (`jax.ShapeDtypeStruct` leaves); `None` for a config this does not know."""
    config = _read_json(os.path.join(root, component, "config.json"))
    names = table.get((config or {}).get("_class_name"))
    if names is None:
        return None
    import equinox as eqx
    import jax

    from .. import models

    model, config_class, reader = names
    config = getattr(getattr(models, config_class), reader)(config)
    return eqx.filter_eval_shape(getattr(models, model), config, key=jax.random.key(0))


def configured(cls, root: str):
    """The pipeline class `cls` built on its folder's JSON configs alone, so that the
    loaded pipeline's own checks run before anything loads (no weight read, nothing
    compiled): its transformer and VAE built abstractly from their `config.json` (Wan
    2.2 A14B's two experts for a `transformer_2/`), no text encoder, the folder's
    scheduler, and what `WanPipeline` reads of `model_index.json`. `None` for a folder
    whose configs this does not know (another layout, a missing file): the loaded
    pipeline checks its call itself."""
    transformer = _abstract(_TRANSFORMERS, root, "transformer")
    vae = _abstract(_VAES, root, "vae")
    if transformer is None or vae is None:
        return None
    from .. import models, pipelines, sampling

    index = _read_json(os.path.join(root, "model_index.json")) or {}
    family = {}
    if cls is pipelines.WanPipeline:  # what its `load_components` reads of the index
        family["expand_timesteps"] = index.get("expand_timesteps", False)
        second = index.get("transformer_2")
        if isinstance(second, list) and second[-1] is not None:  # Wan 2.2 A14B
            low_noise = _abstract(_TRANSFORMERS, root, "transformer_2")
            if low_noise is None or index.get("boundary_ratio") is None:
                return None
            transformer = models.WanExperts(transformer, low_noise, index["boundary_ratio"])
    scheduler = os.path.join(root, "scheduler")
    if os.path.isdir(scheduler):
        scheduler = sampling.scheduler_from_config(scheduler)
    else:
        scheduler = None  # the loader says it is missing
    return cls(tokenizer=None, text_encoder=None, transformer=transformer, vae=vae,
               scheduler=scheduler, **family)


def check_call(pipe, call: dict, *, forcing: dict | None = None,
               stream: dict | None = None) -> None:
    """The loaded pipeline's own checks of the command's call, run on `configured`'s
    pipeline: `call` the call's keywords (sizes, images, prompt length), `forcing`
    SkyReels-V2's diffusion forcing keywords, `stream` those of `pipe.stream` (with
    `--stream`). The video's size (the VAE's factors, the patch size), the stream's
    chunks, diffusion forcing's windows and blocks, the image an image-to-video
    transformer needs or a text-to-video one refuses, and CogVideoX's fixed text
    length."""
    d = pipe.call_defaults
    height, width, num_frames = (getattr(d, k) if call.get(k) is None else call[k]
                                 for k in ("height", "width", "num_frames"))
    grid = pipe.check_size(height, width, num_frames)
    images = {k: call.get(k) for k in ("image", "last_image")}
    if stream is not None:
        pipe.check_stream(grid, **{k: stream[k] for k in (
            "chunk_frames", "max_cached_frames", "scheduler", "num_inference_steps")})
    else:
        if forcing is not None:
            pipe.forcing_options(height=height, width=width, num_frames=num_frames,
                                 video=call.get("video"), fps=call["fps"], **images, **forcing)
        pipe.check_image(**images, image_embeds=None, image_latents=None, num_frames=num_frames)
    if call.get("max_sequence_length") is not None:
        pipe.check_text_length("max_sequence_length", call["max_sequence_length"])
