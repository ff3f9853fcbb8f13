"""Progress of a `sample` call: a callback of the call, told each finished step with
Python values ([`SampleStep`][]), and two ready-made ones: a tqdm bar for a terminal
([`ProgressBar`][]) and lines for a log ([`ProgressLines`][]).

With a callback the loop's steps run one compiled call at a time from the host, which
tells the callback as each ends (`_loop.stepwise_loop`): no host callback inside the
compiled program (JAX's persistent compilation cache does not keep programs that hold
one), no state outside the call.
"""

import abc
import sys
import time
from typing import NamedTuple


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
        """Opens a bar of `steps` steps (closing the previous one)."""
        import tqdm

        self.end()
        self.bar = tqdm.tqdm(total=int(steps), desc=self.desc, leave=True, file=self.file)

    def __call__(self, step: SampleStep) -> None:
        """Moves the bar to the step; closes it after the last."""
        if self.bar is None:
            self.begin(step.steps)
        self.bar.update(step.step + 1 - self.bar.n)
        if step.step + 1 == step.steps:  # done (also when called as a plain callable)
            self.end()

    def end(self) -> None:
        """Closes the bar, if one is open."""
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
        """Starts the call's clock."""
        self.start, self.first = time.perf_counter(), None

    def __call__(self, step: SampleStep) -> None:
        """Writes the step's line when it is the first, the last or every `every`-th."""
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
