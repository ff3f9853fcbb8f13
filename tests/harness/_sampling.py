"""`sampling.sample` with each step's step-cache decision, read by a progress callback; the
tiny SkyReels-V2 diffusion forcing pipeline folder."""

import pathlib
import shutil

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "fixtures"


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


def skyreels_df_folder(folder) -> pathlib.Path:
    """The diffusion forcing pipeline folder assembled in `folder`: the Wan pipeline
    fixture's tokenizer, text encoder and VAE with the SkyReels-V2 transformer, scheduler
    and model index of `fixtures/skyreels/df_pipeline`."""
    folder = pathlib.Path(folder)
    for part in ("tokenizer", "text_encoder", "vae"):
        shutil.copytree(FIXTURES / "wan_pipeline" / "t2v" / part, folder / part)
    for part in ("transformer", "scheduler"):
        shutil.copytree(FIXTURES / "skyreels" / "df_pipeline" / part, folder / part)
    shutil.copy(FIXTURES / "skyreels" / "df_pipeline" / "model_index.json", folder)
    return folder
