"""The models' capability table, as the API docs print it: one row per model class, read
from the classes' own records (so the docs cannot drift from what the samplers read)."""

from .cogvideox import CogVideoXTransformer3D
from .skyreels import SkyReelsV2Transformer3D
from .wan import WanExperts, WanTransformer3D

MODELS = (WanTransformer3D, WanExperts, SkyReelsV2Transformer3D, CogVideoXTransformer3D)
"""The transformers of `vidax_eqx.models`, in the table's order."""


def capability_table() -> str:
    """The Markdown table of every transformer's [`Capabilities`][] record (model x
    capability)."""
    names = [name for name, _ in MODELS[0].capabilities.rows()]
    lines = ["| model | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for cls in MODELS:
        values = [value for _, value in cls.capabilities.rows()]
        lines.append(f"| `{cls.__name__}` | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"
