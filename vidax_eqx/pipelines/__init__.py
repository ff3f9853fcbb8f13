"""Pipelines, the top floor: a diffusers pipeline folder in, videos out, without
PyTorch, above [`vidax_eqx.sampling`][].

- [`AbstractVideoPipeline`][]: the template every family fills in: loading a folder
    (`from_pretrained`) and the one call (its checks, the stages `text`, `image`,
    `denoise` and `decode`, their timer); a family's call defaults are a
    [`CallDefaults`][] of class data, which `vidax-generate` reads too.
- [`WanPipeline`][]: Wan 2.1 / 2.2 text-to-video and image-to-video (diffusers'
    `WanPipeline` and `WanImageToVideoPipeline`): tokenizer, UMT5, CLIP, transformer or
    experts, scheduler and VAE from one folder or Hub id, compiled and sharded over a
    mesh; [`PipelineOutput`][] is what a call returns.
- [`CogVideoXPipeline`][]: CogVideoX 1.0 (2B, 5B) text-to-video and image-to-video
    (diffusers' `CogVideoXPipeline` and `CogVideoXImageToVideoPipeline`): tokenizer, T5,
    transformer, scheduler and VAE from one folder or Hub id, compiled and sharded over
    a mesh.
- [`SkyReelsV2DiffusionForcingPipeline`][]: SkyReels-V2 text-to-video by diffusion
    forcing (diffusers' pipeline of that name): a `WanPipeline` whose loop steps every
    latent frame at its own timestep (`ar_step`), with the fps conditioning; its own
    options of a call reach its hooks as a [`SkyReelsOptions`][] (the template's
    `family=`).
- [`WanPipeline.stream`][vidax_eqx.pipelines.WanPipeline.stream]: streaming generation,
    chunk by chunk against a key/value cache, each chunk decoded as it is finished
    ([`StreamChunk`][]).
- [`MemoryPlan`][]: where each component lives on one accelerator (resident, in host
    memory and moved in for its stage, on the host CPU, or the transformer's blocks
    streamed from host memory), made by `from_pretrained(offload=, device_memory=)`
    before any weight is read; [`plan_memory`][] makes one from byte counts ([`Size`][]),
    [`parse_bytes`][] reads a size such as `"8GB"`, [`streamed_leaves`][] names the
    arrays a streamed transformer keeps in host memory, [`OFFLOAD`][] the plans.
- [`save_video`][]: a video's frames to an `.mp4`.
- [`enable_compile_cache`][]: JAX's persistent compilation cache in a folder under the
    user's cache directory ([`default_compile_cache_dir`][]), as `from_pretrained` and
    the command switch it on (`VIDAX_COMPILE_CACHE=0` turns that off).

The command `vidax-generate` (`python -m vidax_eqx.generate`) runs a pipeline from the
shell.
"""

from ._cogvideox import CogVideoXPipeline as CogVideoXPipeline
from ._compile_cache import (
    default_compile_cache_dir as default_compile_cache_dir,
    enable_compile_cache as enable_compile_cache,
)
from ._memory import (
    MemoryPlan as MemoryPlan,
    OFFLOAD as OFFLOAD,
    parse_bytes as parse_bytes,
    plan_memory as plan_memory,
    Size as Size,
    stream_blocks as stream_blocks,
    streamed_leaves as streamed_leaves,
)
from ._output import PipelineOutput as PipelineOutput, save_video as save_video
from ._pipeline import AbstractVideoPipeline as AbstractVideoPipeline, CallDefaults as CallDefaults
from ._skyreels import (
    SkyReelsOptions as SkyReelsOptions,
    SkyReelsV2DiffusionForcingPipeline as SkyReelsV2DiffusionForcingPipeline,
)
from ._stream import StreamChunk as StreamChunk
from ._wan import WanPipeline as WanPipeline
