"""What `vidax-generate` checks before it loads anything, so that no error it could have
seen first comes after the model has loaded and the video has been generated: the flags'
values, the prompts' text, the files it reads, the folders it writes, and the video's
size against the pipeline folder's JSON configs (no weight read, nothing compiled).

Each failure is a `CommandError`: one line on stderr and exit status 2."""

import json
import math
import os
import tempfile
import types


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


# The config classes (of `vidax_eqx.models`) of a pipeline folder's components, by their
# config's `_class_name` (diffusers' names): what the models' `from_pretrained` read them with.
_TRANSFORMERS = {"WanTransformer3DModel": "WanConfig",
                 "SkyReelsV2Transformer3DModel": "SkyReelsV2Config",
                 "CogVideoXTransformer3DModel": "CogVideoXConfig"}
_VAES = {"AutoencoderKLWan": "WanVAEConfig", "AutoencoderKLCogVideoX": "CogVideoXVAEConfig"}


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None  # the loader says what is wrong with it
    return config if isinstance(config, dict) else None


def check_size(cls, root: str, height: int, width: int, num_frames: int) -> None:
    """The pipeline class's own `check_size` on its folder's configs alone: the VAE's
    (`vae/config.json`: its spatial and temporal factors) and the transformer's
    (`transformer/config.json`: its patch size, and CogVideoX's positional embedding),
    read as the models' `from_pretrained` read them, so that the message is the one the
    loaded pipeline would give. A folder whose configs this does not know (another
    layout, a missing file) is left to the pipeline's check after loading."""
    transformer = _read_json(os.path.join(root, "transformer", "config.json"))
    vae = _read_json(os.path.join(root, "vae", "config.json"))
    if transformer is None or vae is None:
        return
    transformer_class = _TRANSFORMERS.get(transformer.get("_class_name"))
    vae_class = _VAES.get(vae.get("_class_name"))
    if transformer_class is None or vae_class is None:
        return
    from .. import models

    config = getattr(models, transformer_class).from_diffusers(transformer)
    # What `check_size` reads of the components: `vae.spatial_factor` and
    # `vae.temporal_factor` (the VAE's are its config's) and the transformer's config.
    components = types.SimpleNamespace(vae=getattr(models, vae_class).from_dict(vae),
                                       transformer_config=config,
                                       transformer=types.SimpleNamespace(config=config))
    cls.check_size(components, height, width, num_frames)
