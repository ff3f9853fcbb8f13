"""`sampling.sample` with each step's step-cache decision, read by a progress callback."""


def sample_reused(*args, **kwargs):
    """`(latents, reused)`: `sampling.sample(*args, **kwargs)` and the `(steps,)` bool
    NumPy array of the steps whose `SampleStep.reused` was true (none without step
    caching)."""
    import numpy as np

    from vidax_eqx import sampling

    steps = []
    latents = sampling.sample(*args, progress=steps.append, **kwargs)
    reused = np.array([bool(s.reused) for s in steps])
    assert [s.step for s in steps] == list(range(len(steps))), steps
    return latents, reused
