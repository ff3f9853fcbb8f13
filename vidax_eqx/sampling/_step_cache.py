"""The step-caching rules `sample` takes: which denoising steps may reuse the block
stack's residual of the last step that ran it, and (data-dependent) when they do."""

import dataclasses
import json

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


class MagCache(eqx.Module):
    """MagCache's rule of step caching (Ma et al., 2025): the magnitude ratio of the
    block stack's residual from one step to the next, `||r_i|| / ||r_{i-1}||`, is
    nearly the same for every prompt of a model and step count, so it is measured once
    ([`calibrate_magcache`][vidax_eqx.sampling.calibrate_magcache]) and the steps that
    reuse follow from it before the loop starts (a static schedule, as
    [`StaticStepCache`][]'s: no data-dependent control flow). From the end of the
    retention on, each step multiplies a running ratio by its own; the step reuses the
    last residual while the summed error `sum |1 - running ratio|` stays within
    `max_error` and at most `max_skip` steps in a row have reused, else it runs every
    block and the running values start again.

        rule = sampling.calibrate_magcache(model, noise, context, steps=50, ...)
        rule = dataclasses.replace(rule, max_error=0.12)     # the trade-off
        rule.save("magcache.json")                            # with the model
        sample(..., caching=sampling.Caching(step=sampling.MagCache.load("magcache.json")))

    **Fields:**

    - `ratios`: the calibrated ratios, one per step (the first is 1: nothing before
        it); a schedule of another step count takes them at the nearest position.
    - `max_error`: the summed error within which steps reuse (> 0; MagCache's
        threshold: 0.06 to 0.24 for Wan in its paper; larger is faster and further).
    - `max_skip`: the most steps in a row that reuse (MagCache's K), >= 1.
    - `retention`: the fraction of the first steps that always run (0.2 in MagCache).
    - `cooldown`: the last steps that always run.
    """

    ratios: tuple[float, ...] = eqx.field(static=True)
    max_error: float = eqx.field(static=True, default=0.12)
    max_skip: int = eqx.field(static=True, default=2)
    retention: float = eqx.field(static=True, default=0.2)
    cooldown: int = eqx.field(static=True, default=0)

    threshold = None  # a schedule known before the loop, no data-dependent rule

    def __check_init__(self):
        if (not isinstance(self.ratios, tuple) or not self.ratios or not all(
                isinstance(r, float) and np.isfinite(r) and r > 0 for r in self.ratios)):
            raise ValueError(f"MagCache: `ratios` must be a non-empty tuple of positive finite "
                             f"floats (calibrate_magcache's); received {self.ratios!r:.200}.")
        check_positive("MagCache", "max_error", self.max_error,
                       " (the summed error within which steps reuse)")
        check_int("MagCache", "max_skip", self.max_skip, 1)
        if isinstance(self.retention, bool) or not isinstance(self.retention, (int, float)) \
                or not 0 <= self.retention <= 1:
            raise ValueError(f"MagCache: `retention` (the fraction of the first steps that "
                             f"always run) must be in [0, 1]; received {self.retention!r}.")
        check_int("MagCache", "cooldown", self.cooldown, 0)

    def step_ratios(self, steps: int) -> np.ndarray:
        """The ratios of a `steps`-step schedule: the calibrated ones, or for another step
        count each step's nearest calibrated position (MagCache's `nearest_interp`)."""
        calibrated = np.asarray(self.ratios, np.float64)
        if steps == calibrated.size:
            return calibrated
        at = np.rint(np.linspace(0, calibrated.size - 1, steps)).astype(int)
        return calibrated[at]

    def mask(self, steps: int) -> np.ndarray:
        """`(steps,)` bool: the steps that reuse."""
        ratios = self.step_ratios(steps)
        mask = np.zeros(steps, bool)
        ratio, error, skipped = 1.0, 0.0, 0
        for i in range(max(1, int(self.retention * steps)), steps):
            ratio *= ratios[i]
            error += abs(1.0 - ratio)
            skipped += 1
            if error <= self.max_error and skipped <= self.max_skip:
                mask[i] = True
            else:
                ratio, error, skipped = 1.0, 0.0, 0
        return _ends(mask, steps, 1, self.cooldown)

    def save(self, path) -> None:
        """Writes the rule as JSON (its fields), e.g. beside the model's checkpoint."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"class": "MagCache", **{k: list(v) if isinstance(v, tuple) else v
                                               for k, v in fields.items()}}, f, indent=1)

    @classmethod
    def load(cls, path) -> "MagCache":
        """The rule [`save`][vidax_eqx.sampling.MagCache.save] wrote."""
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        if not isinstance(spec, dict) or spec.pop("class", None) != "MagCache":
            raise ValueError(f"MagCache.load: {path!r} is not a MagCache file (its JSON has no "
                             "\"class\": \"MagCache\").")
        spec["ratios"] = tuple(float(r) for r in spec.get("ratios", ()))
        return cls(**spec)
