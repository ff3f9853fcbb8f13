"""`vidax-generate` (or `python -m vidax_eqx.generate`): a prompt (and an image) to an
`.mp4` with a Wan or CogVideoX diffusers pipeline, without PyTorch.

    vidax-generate Wan-AI/Wan2.1-T2V-1.3B-Diffusers --prompt "A cat walks on the grass" \\
        --height 480 --width 832 --num-frames 81 --output cat.mp4
    vidax-generate /models/Wan2.1-I2V-14B-480P-Diffusers --image first.png \\
        --prompt "The cat turns its head" --dtype bfloat16 --sp 4 --tp 2 --output i2v.mp4

The pipeline ([`vidax_eqx.pipelines.WanPipeline`][],
[`vidax_eqx.pipelines.CogVideoXPipeline`][] or
[`vidax_eqx.pipelines.SkyReelsV2DiffusionForcingPipeline`][] (`--ar-step`,
`--causal-block-size`; long videos with `--overlap-history`, `--base-num-frames`,
`--addnoise-condition`; `--image` / `--last-image` and `--video` for its image and
video to video), by
`model_index.json`'s class) is read from a
folder saved by diffusers or a Hub id; the size, steps, guidance, prompt length and frame
rate default to the family's [`CallDefaults`][vidax_eqx.pipelines.CallDefaults] (Wan:
480 x 832, 81 frames, 50 steps, guidance 5, 512 tokens, 16 fps; CogVideoX: 480 x 720,
49 frames, 50 steps, guidance 6, 226 tokens, 8 fps). `--sp`, `--tp`, `--dp` and `--cfg`
build the device mesh (Ulysses over `sp`, Megatron over `tp`, the batch over `dp`,
guidance's two passes over `cfg`); on a CPU the devices are simulated.

What it prints: the written paths on stdout, one a line; on stderr each stage as it
starts (`text ...`) and its time as it ends, the denoising steps (a bar on a terminal,
else a line every few steps with the elapsed time and an estimate of the rest) and the
total wall time. `--stream` appends each chunk to a fragmented `.mp4` as it comes, so
that the file plays up to the frames written so far (also after the process is killed).

Nothing it can know before it loads the model fails after: before it reads a weight or
compiles a program it checks the flags' values, the prompts' text, the libraries it will
need (tokenizers, PyAV, and Pillow for an image, huggingface_hub for a Hub id), the
files it reads (`--image`, `--last-image` decoded, `--video` read), the folders it
writes (`--output`, `--latents`: created, and written to) and the call against the
folder's JSON configs, by the pipeline's own checks run on the pipeline built on them
(its components abstract): the video's size (the VAE's factors, the patch size), the
image an image-to-video folder needs and a text-to-video one refuses, CogVideoX's fixed
text length, `--stream`'s chunks (`--chunk-frames` divides the latent frames) and
diffusion forcing's blocks (`--causal-block-size` divides each window's latent frames).
An error is one line on stderr and exit status 2. JAX's persistent compilation cache is on (a folder under
`~/.cache/vidax_eqx`; [`vidax_eqx.pipelines.enable_compile_cache`][]), so that a second
run does not compile again; `--no-compile-cache` or `VIDAX_COMPILE_CACHE=0` turns it off.
"""

from ._checks import CommandError as CommandError
from ._command import (
    add_device_arguments as add_device_arguments,
    check_devices as check_devices,
    check_libraries as check_libraries,
    INSTALL as INSTALL,
    log as log,
    main as main,
    make_mesh as make_mesh,
    parse_args as parse_args,
    parser as parser,
    progress_callback as progress_callback,
    QUICK as QUICK,
    QUICK_TIME as QUICK_TIME,
    simulate_devices as simulate_devices,
    write_latents as write_latents,
)

__all__ = ["main"]
