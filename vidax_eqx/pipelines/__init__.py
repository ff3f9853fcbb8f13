"""Pipelines, the top floor: a diffusers pipeline folder in, videos out, without
PyTorch, above [`vidax_eqx.sampling`][].

- [`WanPipeline`][]: Wan 2.1 / 2.2 text-to-video and image-to-video (diffusers'
    `WanPipeline` and `WanImageToVideoPipeline`): tokenizer, UMT5, CLIP, transformer or
    experts, scheduler and VAE from one folder or Hub id, compiled and sharded over a
    mesh; [`PipelineOutput`][] is what a call returns.
- [`CogVideoXPipeline`][]: CogVideoX 1.0 (2B, 5B) text-to-video and image-to-video
    (diffusers' `CogVideoXPipeline` and `CogVideoXImageToVideoPipeline`): tokenizer, T5,
    transformer, scheduler and VAE from one folder or Hub id, compiled and sharded over
    a mesh.
- [`save_video`][]: a video's frames to an `.mp4`.

The command `vidax-generate` (`python -m vidax_eqx.generate`) runs a pipeline from the
shell.
"""

from ._cogvideox import CogVideoXPipeline as CogVideoXPipeline
from ._output import PipelineOutput as PipelineOutput, save_video as save_video
from ._wan import WanPipeline as WanPipeline
