"""What a pipeline call returns, the stage timer, and `save_video`."""

import contextlib
import dataclasses
import time

import numpy as np

from .. import interop


@dataclasses.dataclass(frozen=True)
class PipelineOutput:
    """A pipeline call's result (diffusers' `WanPipelineOutput` / `CogVideoXPipelineOutput`,
    with the latents and the stage timings beside the frames).

    **Fields:**

    - `frames`: `(B, F, H, W, 3)` float32 NumPy in [0, 1], diffusers' `output_type="np"`
        (`frames[0]` is the first video); `None` with `output_type="latent"`.
    - `latents`: the final latents float32 NumPy in the transformer's layout, Wan's
        `(B, C, F, h, w)`, CogVideoX's `(B, F, C, h, w)` (diffusers'
        `output_type="latent"`: not denormalized nor unscaled).
    - `timings`: seconds per stage, in order (`"text"`, `"image"`, `"denoise"`,
        `"decode"`), each from its start to its arrays being ready (compilation
        included on a first call).
    """

    frames: np.ndarray | None
    latents: np.ndarray
    timings: dict[str, float]


class StageTimer:
    """Times the stages of a call: `with timer("text"): ...` adds the block's seconds to
    `timings[stage]` and passes them to `report(stage, seconds)` when given. A stage
    waits for the arrays it returns (`jax.block_until_ready`) before it ends."""

    def __init__(self, report=None):
        self.timings: dict[str, float] = {}
        self.report = report

    @contextlib.contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self.timings[stage] = self.timings.get(stage, 0.0) + seconds
        if self.report is not None:
            self.report(stage, seconds)


def save_video(frames, path, *, fps: float = 16) -> None:
    """Writes one video's frames to an `.mp4` (H.264 through PyAV: `pip install
    av`, or `pip install '.[video]'` in a clone).

    **Arguments:**

    - `frames`: `(F, H, W, 3)` float in [0, 1] (a pipeline's `frames[b]`), rounded to
        uint8 (`round(255 x)`; diffusers' `export_to_video` truncates), or uint8.
    - `path`: the file to write.
    - `fps`: frames per second (16: Wan's; CogVideoX's is 8).
    """
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"save_video: `frames` must be one video (F, H, W, 3); received shape "
                         f"{frames.shape}. For a pipeline's output pass `output.frames[b]`.")
    if frames.dtype != np.uint8:
        lo, hi = float(frames.min()), float(frames.max())
        if lo < 0 or hi > 1 or not np.isfinite(frames).all():
            raise ValueError(f"save_video: float `frames` must be in [0, 1]; received values "
                             f"in [{lo}, {hi}].")
        frames = np.round(frames * 255).astype(np.uint8)
    interop.write_video(frames, path, fps=fps)
