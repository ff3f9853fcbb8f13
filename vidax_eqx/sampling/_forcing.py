"""Diffusion forcing: every latent frame at its own noise level, the frames denoised
synchronously or in a staggered wave (SkyReels-V2's `ar_step` schedules)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._schedulers import check_int


# The timestep a frame that has not started is shown at (with its pure noise), and the one
# a finished frame is shown at: SkyReels-V2's `999` and `0`, whatever the scheduler's.
NOT_STARTED_TIMESTEP = 999.0
FINISHED_TIMESTEP = 0.0


class DiffusionForcing(eqx.Module):
    """The schedule of diffusion forcing (SkyReels-V2's `SkyReelsV2DiffusionForcingPipeline`):
    the latent frames come in blocks of `causal_block_size`, and each block runs the
    scheduler's `steps` steps on its own frames, starting `ar_step` iterations after the
    block before it (`ar_step = 0`: every frame at once, the synchronous schedule).

    One iteration calls the model once on every frame, each frame at its own timestep
    (the model takes one per latent frame, as [`vidax_eqx.models.SkyReelsV2Transformer3D`][]
    does), and steps the frames of the blocks that are running, each with its own
    scheduler state, at its own step index; a block that has not started is shown at
    timestep 999 with its noise, a finished one at 0. `rows(frames, steps)` gives the
    iterations.

    **Fields (static):**

    - `ar_step`: the iterations a block lags the one before it, an int >= 0.
    - `causal_block_size`: the frames of a block, an int >= 1 that divides the latent
        frames; a model with frame-block causal attention must have it as its
        `num_frame_per_block` (1: no mask).
    - `prefix_frames`: the first latent frames are given, not noise (an image's or a
        video's latents, or the end of the window before: diffusers' prefix); the whole
        blocks among them start finished (its `num_pre_ready`), are shown at timestep 0
        and never stepped. The latents passed to the loop hold them in place of noise.
    - `suffix_frames`: the last latent frames are given (the I2V pipeline's last image):
        shown at timestep 0 and never stepped, though they count in the schedule's blocks
        as diffusers' do.
    - `addnoise_condition`: above 0, every iteration shows the model the prefix frames
        noised, `x (1 - a / 1000) + n a / 1000` with fresh standard normal `n`, at
        timestep `a` (diffusers' `addnoise_condition`, 20 recommended for long videos);
        the loop then needs a `key` (iteration `i` draws with `jax.random.fold_in(key,
        i)`).
    - `reference_aliasing`: step [`UniPC`][] as SkyReels-V2's reference code and
        diffusers' pipeline do (default), or as the textbook solver (False). Theirs keep,
        as a frame's last sample, a view of the frame that the pipeline then overwrites
        with the step's output; so after a step without the corrector (each frame's
        first), the next step corrects from the output instead of the input. The two
        differ at the level of the result (0.57 of a largest latent of 7.3 on the tiny
        test model after 4 steps); the released models were sampled the reference's way.
    """

    ar_step: int = eqx.field(static=True, default=0)
    causal_block_size: int = eqx.field(static=True, default=1)
    reference_aliasing: bool = eqx.field(static=True, default=True)
    prefix_frames: int = eqx.field(static=True, default=0)
    suffix_frames: int = eqx.field(static=True, default=0)
    addnoise_condition: float = eqx.field(static=True, default=0.0)

    def __check_init__(self):
        check_int("DiffusionForcing", "ar_step", self.ar_step, 0)
        check_int("DiffusionForcing", "causal_block_size", self.causal_block_size, 1)
        check_int("DiffusionForcing", "prefix_frames", self.prefix_frames, 0)
        check_int("DiffusionForcing", "suffix_frames", self.suffix_frames, 0)
        a = self.addnoise_condition
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a < 1000:
            raise ValueError("DiffusionForcing: `addnoise_condition` must be a number in [0, "
                             f"1000) (a timestep); received {a!r}.")
        if not isinstance(self.reference_aliasing, bool):
            raise ValueError("DiffusionForcing: `reference_aliasing` must be a bool; received "
                             f"{self.reference_aliasing!r}.")

    def rows(self, frames: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """The iterations over `frames` latent frames of a `steps`-step schedule:
        `(progress, update)`, int32 and bool `(N, frames)`. `progress` is each frame's
        place in its schedule at that iteration: 0 not started, `k` in `[1, steps]` at
        step `k - 1` (the model sees the scheduler's timestep `k - 1`), `steps + 1`
        finished; `update` marks the frames stepped at that iteration (their progress
        moved and they are not finished). Every frame is stepped exactly `steps` times,
        in order, but the given ones (`prefix_frames`' whole blocks, `suffix_frames`),
        which are never stepped and stay finished.

        **Raises:** `ValueError` unless `causal_block_size` divides `frames`, or when the
        given frames leave none to generate.
        """
        check_int("DiffusionForcing.rows", "frames", frames, 1)
        check_int("DiffusionForcing.rows", "steps", steps, 1)
        k = self.causal_block_size
        if frames % k:
            raise ValueError(
                f"DiffusionForcing: `causal_block_size` ({k}) must divide the latent frames; "
                f"received {frames} frames.")
        if self.prefix_frames + self.suffix_frames >= frames:
            raise ValueError(
                f"DiffusionForcing: `prefix_frames` ({self.prefix_frames}) and `suffix_frames` "
                f"({self.suffix_frames}) are given frames; they must leave some of the "
                f"{frames} latent frames to generate.")
        blocks, done = frames // k, steps + 1
        previous = np.zeros(blocks, np.int64)
        previous[:self.prefix_frames // k] = done  # diffusers' pre-ready blocks
        progress, update = [], []
        while not np.all(previous >= steps):
            row = np.zeros(blocks, np.int64)
            for b in range(blocks):
                # The first block, and a block whose predecessor has taken its last step,
                # advance by one; the others follow their predecessor `ar_step` behind.
                lead = b == 0 or previous[b - 1] >= steps
                row[b] = previous[b] + 1 if lead else row[b - 1] - self.ar_step
            row = np.clip(row, 0, done)
            update.append((row != previous) & (row != done))
            progress.append(row)
            previous = row
        expand = lambda a: np.repeat(np.stack(a), k, axis=1)
        progress, update = expand(progress).astype(np.int32), expand(update)
        if self.suffix_frames:  # shown finished, never stepped (diffusers' last image)
            progress[:, frames - self.suffix_frames:] = done
            update[:, frames - self.suffix_frames:] = False
        return progress, update


def condition_noise(key, iteration, shape) -> jax.Array:
    """The standard normal noise of `addnoise_condition` at a loop iteration, float32."""
    return jax.random.normal(jax.random.fold_in(key, iteration), shape, jnp.float32)
