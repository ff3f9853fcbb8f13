"""What a model class can do, as data on the class: the record that the samplers, the
pipelines and [`run_sharded`][] read instead of testing a model's type or probing its
attributes (Diffrax's solvers declare `term_structure` the same way)."""

import dataclasses
from typing import Literal

_LATENTS = ("CFHW", "FCHW")
_TIMESTEPS = ("video", "frame", "token")
_IMAGE = frozenset({"channels", "frames", "embedding"})


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """A model class's capability record (the class variable `capabilities` of every
    [`AbstractModel`][]).

    **Fields:**

    - `latents`: the axes of one example's latents, `"CFHW"` (Wan: channels first) or
        `"FCHW"` (CogVideoX: frames first, diffusers' layout); a batch adds `B` in front.
    - `timestep`: the finest timestep the call takes besides a scalar: `"video"` (a
        scalar only), `"frame"` (one per latent frame of the patch grid, `(F',)`: diffusion
        forcing) or `"token"` (one per patch token, `(S,)`: Wan 2.2 TI2V).
    - `text_cache`: `text_cache(context)` computes the text's keys and values once, and
        the call takes them (`text_cache=`).
    - `step_cache`: `cached_call` reuses the block stack's residual of an earlier step.
    - `streaming`: `kv_cache` / `stream` generate chunk by chunk with a key/value cache.
    - `experts`: several experts routed by the timestep ([`AbstractExperts`][]).
    - `image`: the ways an image conditions the model (a subset of): `"channels"`
        (condition latents concatenated to the noisy ones, when the config's
        `in_channels` exceed its `out_channels`), `"frames"` (the first latent frames
        replaced by the clean condition at timestep 0: needs `timestep="token"`),
        `"embedding"` (image-encoder features, `context_image=`).
    """

    latents: Literal["CFHW", "FCHW"]
    timestep: Literal["video", "frame", "token"]
    text_cache: bool
    step_cache: bool
    streaming: bool
    experts: bool
    image: frozenset

    def __post_init__(self):
        if self.latents not in _LATENTS:
            raise ValueError(f"Capabilities: `latents` must be one of {_LATENTS}; received "
                             f"{self.latents!r}.")
        if self.timestep not in _TIMESTEPS:
            raise ValueError(f"Capabilities: `timestep` must be one of {_TIMESTEPS}; received "
                             f"{self.timestep!r}.")
        for name in ("text_cache", "step_cache", "streaming", "experts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Capabilities: `{name}` must be a bool; received "
                                 f"{getattr(self, name)!r}.")
        image = frozenset(self.image)
        if not image <= _IMAGE:
            raise ValueError(f"Capabilities: `image` must be a subset of {sorted(_IMAGE)}; "
                             f"received {sorted(image)}.")
        if "frames" in image and self.timestep != "token":
            raise ValueError("Capabilities: image conditioning by `frames` needs a timestep per "
                             f"token (timestep='token'); received timestep={self.timestep!r}.")
        object.__setattr__(self, "image", image)

    @property
    def channel_axis(self) -> int:
        """The channel axis of one example's latents (0 in `"CFHW"`, 1 in `"FCHW"`)."""
        return self.latents.index("C")

    def rows(self) -> list[tuple[str, str]]:
        """`(capability, value)` rows as the docs' models table prints them."""
        yes = {True: "yes", False: "no"}
        return [("latents", "(" + ", ".join(self.latents) + ")"),
                ("timestep", self.timestep), ("text cache", yes[self.text_cache]),
                ("step cache", yes[self.step_cache]), ("streaming", yes[self.streaming]),
                ("experts", yes[self.experts]),
                ("image", ", ".join(sorted(self.image)) or "none")]


_WHAT = {
    "text_cache": "a text cache (the text's keys and values computed once)",
    "step_cache": "step caching (cached_call)",
    "streaming": "streaming with a key/value cache (stream)",
    "experts": "experts routed by the timestep",
}


def require(owner: str, model, capability: str) -> None:
    """Raises `NotImplementedError` in one line naming the model and the capability when
    `model`'s class does not declare `capability` (a boolean field of [`Capabilities`][])."""
    if not getattr(model.capabilities, capability):
        raise NotImplementedError(
            f"{owner}: a {type(model).__name__} has no {_WHAT[capability]} "
            f"({type(model).__name__}.capabilities.{capability} is False).")
