"""Progress of a `sample` call: a callback of the call, told each finished step with
Python values ([`SampleStep`][]), and two ready-made ones: a tqdm bar for a terminal
([`ProgressBar`][]) and lines for a log ([`ProgressLines`][]).

The compiled loop cannot hold the caller's callback (a new callback would mean a new
program), so it calls one fixed host function with a number naming the call; the call
registers its callback under that number while it runs and removes it when it ends
(Diffrax's progress meters do the same). Nothing outlives the call.
"""

import abc
import itertools
import sys
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np


class SampleStep(NamedTuple):
    """What a progress callback receives after each denoising step, as Python values."""

    step: int
    """The index of the step that finished, from 0."""
    steps: int
    """The number of steps of the call."""
    reused: bool | None
    """Whether the step reused the step cache's residual; `None` without step caching."""


def stream_is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class AbstractProgress(abc.ABC):
    """A progress report over the steps of `sample` calls, told when a call begins and
    ends besides each step (any callable taking a [`SampleStep`][] also serves, told
    only the steps)."""

    def begin(self, steps: int) -> None:
        """Called when a call begins (before its loop compiles and runs)."""

    @abc.abstractmethod
    def __call__(self, step: SampleStep) -> None:
        """Called after each step, in order, once."""

    def end(self) -> None:
        """Called when the call ends, after its last step or on an error."""


class ProgressBar(AbstractProgress):
    """A tqdm bar over the steps of each `sample` call (what `progress=True` makes when
    stderr is a terminal and tqdm is installed).

    **Arguments:**

    - `desc`: the bar's label.
    - `file`: the stream (default tqdm's, `sys.stderr`).
    """

    def __init__(self, desc: str = "denoise", file=None):
        self.desc, self.file, self.bar = desc, file, None

    def begin(self, steps: int) -> None:
        import tqdm

        self.end()
        self.bar = tqdm.tqdm(total=int(steps), desc=self.desc, leave=True, file=self.file)

    def __call__(self, step: SampleStep) -> None:
        if self.bar is None:
            self.begin(step.steps)
        self.bar.update(step.step + 1 - self.bar.n)

    def end(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class ProgressLines(AbstractProgress):
    """Progress as lines, for a log (output that is not a terminal): the first step (it
    includes the compilation), then every `every` steps and the last, each as

        denoise  step 10/50  elapsed 61.2 s  remaining ~180.4 s

    the elapsed time from the call's start, the estimate from the steps after the first
    (the compilation left out).

    **Arguments:**

    - `every`: a line every this many steps (default: about ten lines a call).
    - `file`: the stream (default `sys.stderr`, read when a line is written).
    - `prefix`: the label of each line.
    """

    def __init__(self, every: int | None = None, file=None, prefix: str = "denoise"):
        if every is not None and (isinstance(every, bool) or not isinstance(every, int)
                                  or every < 1):
            raise ValueError(f"ProgressLines: `every` must be None or an int >= 1; received "
                             f"{every!r}.")
        self.every, self.file, self.prefix = every, file, prefix
        self.start = self.first = None

    def begin(self, steps: int) -> None:
        self.start, self.first = time.perf_counter(), None

    def __call__(self, step: SampleStep) -> None:
        now = time.perf_counter()
        if self.start is None:
            self.start = now
        done, total = step.step + 1, step.steps
        if done == 1:
            self.first = now
        every = self.every or max(1, -(-total // 10))
        if done != 1 and done != total and done % every:
            return
        text = f"{self.prefix}  step {done}/{total}  elapsed {now - self.start:.1f} s"
        if 1 < done < total and self.first is not None:
            rate = (now - self.first) / (done - 1)
            text += f"  remaining ~{rate * (total - done):.1f} s"
        print(text, file=self.file or sys.stderr, flush=True)


def default_progress(progress):
    """`progress` as a callback or `None`: `True` is a [`ProgressBar`][] when stderr is
    a terminal and tqdm is installed, else `None`; `False` / `None` is `None`; a
    callable is itself."""
    if progress is None or progress is False:
        return None
    if progress is True:
        if not stream_is_terminal(sys.stderr):
            return None
        try:
            import tqdm  # noqa: F401
        except ImportError:
            return None
        return ProgressBar()
    if not callable(progress):
        raise ValueError(
            "sample: `progress` must be True (a tqdm bar on a terminal), False / None, or a "
            "callable taking a sampling.SampleStep (e.g. sampling.ProgressLines()); received "
            f"a {type(progress).__name__}.")
    return progress


# -- the host side of the compiled loop's callback ---------------------------------------


class _Call:
    """A running call's callback; reports each step once, in order (the loop's callback
    is unordered, and runs once per device of a mesh)."""

    def __init__(self, callback: Callable[[SampleStep], None]):
        self.callback, self.done, self.lock = callback, -1, threading.Lock()

    def report(self, step: int, steps: int, reused) -> None:
        with self.lock:
            if step <= self.done:
                return
            self.done = step
            self.callback(SampleStep(step, steps, reused))


_CALLS: dict[int, _Call] = {}
_IDS = itertools.count(1)
_LOCK = threading.Lock()


def register(callback) -> int:
    """Registers a call's callback for as long as the call runs; its number."""
    with _LOCK:
        number = next(_IDS) % (2 ** 31 - 1)
        _CALLS[number] = _Call(callback)
    return number


def unregister(number: int) -> None:
    with _LOCK:
        _CALLS.pop(number, None)


def report(number, step, steps, reused=None) -> None:
    """The compiled loop's host callback: the step as Python values, to the call's
    callback (nothing once the call has ended)."""
    call = _CALLS.get(int(np.asarray(number)))
    if call is not None:
        call.report(int(np.asarray(step)), int(np.asarray(steps)),
                    None if reused is None else bool(np.asarray(reused)))
