"""The step-caching rules `sample` takes: which denoising steps may reuse the block
stack's residual of the last step that ran it, and (data-dependent) when they do."""

import equinox as eqx
import numpy as np

from ._schedulers import check_int, check_positive


def _check_ends(owner: str, warmup, cooldown) -> None:
    check_int(owner, "warmup", warmup, 1)
    check_int(owner, "cooldown", cooldown, 0)


def _ends(mask, steps: int, warmup: int, cooldown: int):
    mask[:min(warmup, steps)] = False
    if cooldown:
        mask[max(0, steps - cooldown):] = False
    return mask


class StaticStepCache(eqx.Module):
    """A static schedule of step caching (MagCache-style): a fixed set of denoising
    steps reuse the residual of the whole block stack from the last step that ran it,
    the others run every block. No data-dependent control flow: the schedule is known
    before the loop starts, so every device takes the same branch by construction.

        StaticStepCache(interval=2, warmup=4, cooldown=2)  # after 4 steps, every other
                                                           # step reuses; the last 2 run
        StaticStepCache(reuse=(5, 7, 9, 11))               # exactly these steps reuse

    **Fields:**

    - `interval`: run the blocks at one step of every `interval` (counted from the end
        of the warmup) and reuse at the others; `1`: never reuse.
    - `warmup`: the first steps always run (at least 1: the first step has nothing to
        reuse). Flow matching's first steps set the layout of the video.
    - `cooldown`: the last steps always run (the details).
    - `reuse`: instead of the three above, the indices of the steps that reuse; steps
        outside `[1, steps)` are refused when the schedule is applied.
    """

    interval: int = eqx.field(static=True, default=2)
    warmup: int = eqx.field(static=True, default=1)
    cooldown: int = eqx.field(static=True, default=0)
    reuse: tuple[int, ...] | None = eqx.field(static=True, default=None)

    threshold = None  # the static schedule has no data-dependent rule

    def __check_init__(self):
        check_int("StaticStepCache", "interval", self.interval, 1)
        _check_ends("StaticStepCache", self.warmup, self.cooldown)
        if self.reuse is not None:
            if not isinstance(self.reuse, tuple) or not all(
                    isinstance(i, int) and not isinstance(i, bool) for i in self.reuse):
                raise TypeError(f"StaticStepCache: `reuse` must be a tuple of step indices "
                                f"(ints); received {self.reuse!r}.")

    def mask(self, steps: int) -> np.ndarray:
        """`(steps,)` bool: the steps that reuse."""
        if self.reuse is not None:
            bad = [i for i in self.reuse if not 1 <= i < steps]
            if bad:
                raise ValueError(
                    f"StaticStepCache: `reuse` must name steps in [1, {steps}) (step 0 has "
                    f"nothing to reuse) of this {steps}-step schedule; received {bad}.")
            mask = np.zeros(steps, bool)
            mask[list(self.reuse)] = True
            return mask
        mask = (np.arange(steps) - self.warmup) % self.interval != 0
        return _ends(mask, steps, self.warmup, self.cooldown)


class FirstBlockCache(eqx.Module):
    """The data-dependent rule of step caching (first-block cache, as in TeaCache and
    ParaAttention's FBCache): at every step the first block runs; the relative L1
    change of its residual since the last step that ran every block,
    `sum |r - r_last| / sum |r_last|` (over the whole batch, guidance's two halves
    included, and every device's tokens), decides: below `threshold` the other blocks
    are skipped and their residual from that step is reused. The sum is reduced over
    every device before the decision, so a sharded run takes one branch everywhere.

    **Fields:**

    - `threshold`: the relative change below which a step reuses (> 0); larger:
        faster and further from the uncached result. `0.05` to `0.2` are typical.
    - `warmup`: the first steps always run (at least 1).
    - `cooldown`: the last steps always run.
    """

    threshold: float = eqx.field(static=True)
    warmup: int = eqx.field(static=True, default=1)
    cooldown: int = eqx.field(static=True, default=0)

    def __check_init__(self):
        check_positive("FirstBlockCache", "threshold", self.threshold,
                       " (the relative change below which a step reuses)")
        _check_ends("FirstBlockCache", self.warmup, self.cooldown)

    def mask(self, steps: int) -> np.ndarray:
        """`(steps,)` bool: the steps that may reuse (the rule decides at run time)."""
        return _ends(np.ones(steps, bool), steps, self.warmup, self.cooldown)
