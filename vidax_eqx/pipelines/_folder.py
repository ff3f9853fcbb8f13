"""A diffusers pipeline folder: `model_index.json` and a folder per component, read as
diffusers' `DiffusionPipeline.from_pretrained` reads it."""

import json
import os

from .. import interop


class PipelineFolder:
    """The components of a diffusers pipeline directory (or Hub repository), by the
    names of its `model_index.json`.

    A component is present when the index names it with a class (`["diffusers",
    "AutoencoderKLWan"]`); diffusers writes `[null, null]` for one left out (a T2V
    pipeline's `image_encoder`).
    """

    def __init__(self, path, *, owner: str, classes: tuple[str, ...], revision=None,
                 cache_dir=None):
        self.owner = owner
        self.root = interop.resolve_pipeline(path, revision=revision, cache_dir=cache_dir)
        with open(os.path.join(self.root, "model_index.json")) as f:
            self.index = json.load(f)
        name = self.index.get("_class_name")
        if name not in classes:
            raise ValueError(
                f"{owner}.from_pretrained: `path` must be a pipeline of the classes "
                f"{', '.join(classes)} (model_index.json's `_class_name`); {path!r} is a "
                f"{name!r}.")
        self.class_name = name

    def config(self, key: str, default=None):
        """A pipeline-level setting of `model_index.json` (`boundary_ratio`, ...)."""
        return self.index.get(key, default)

    def has(self, component: str) -> bool:
        entry = self.index.get(component)
        return (isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[1] is not None
                and os.path.isdir(os.path.join(self.root, component)))

    def path(self, component: str, *, needed_for: str) -> str:
        """The folder of `component`; a `ValueError` naming what needed it when the
        pipeline has none."""
        if not self.has(component):
            held = sorted(k for k in self.index if not k.startswith("_") and self.has(k))
            raise ValueError(
                f"{self.owner}.from_pretrained: {needed_for} needs the pipeline's "
                f"`{component}/` component, which {self.root!r} does not hold (its "
                f"model_index.json names {self.index.get(component)!r}; the components "
                f"present: {', '.join(held)}).")
        return os.path.join(self.root, component)
