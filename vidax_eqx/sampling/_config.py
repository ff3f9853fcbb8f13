"""A scheduler from a diffusers pipeline's `scheduler/scheduler_config.json`."""

import os

from ._cogvideox import CogVideoXDDIM, CogVideoXDPM
from ._diffusers_keys import DIFFUSERS_CLASSES, read_config
from ._flow_match import FlowMatchEuler, UniPC
from ._schedulers import AbstractScheduler


_SCHEDULERS = {DIFFUSERS_CLASSES[cls.__name__]: cls
               for cls in (FlowMatchEuler, UniPC, CogVideoXDDIM, CogVideoXDPM)}


def scheduler_from_config(config: dict | str | os.PathLike) -> AbstractScheduler:
    """The scheduler a diffusers scheduler config describes, with its settings: so that a
    checkpoint shipped with, say, `flow_shift` 5.0 is sampled with 5.0.

    The config's `_class_name` picks the scheduler: `UniPCMultistepScheduler` (flow
    prediction) [`UniPC`][], `FlowMatchEulerDiscreteScheduler` [`FlowMatchEuler`][],
    `CogVideoXDDIMScheduler` [`CogVideoXDDIM`][], `CogVideoXDPMScheduler`
    [`CogVideoXDPM`][]; that class's `from_config` reads the rest. A key that sets a
    field gives it its value, and a key that is absent diffusers' default (not the
    vidax_eqx class's: `flow_shift` absent is 1.0). Every other key diffusers (0.42.1)
    writes is accepted at the values this scheduler reproduces exactly (its default, or
    any value where the option has no effect), and refused otherwise. Keys starting
    with `_` are metadata (`_use_default_values` drops the keys it lists, as in
    diffusers); an option of one of the other three diffusers classes is ignored, as
    diffusers ignores it (diffusers' `from_config` leaves them behind when a pipeline
    swaps schedulers).

    **Arguments:**

    - `config`: a dict (the JSON's content, or diffusers' `scheduler.config`), or the
        path of a `scheduler_config.json`, of a folder holding one, or of a diffusers
        pipeline's folder (its `scheduler/scheduler_config.json`).

    **Returns:**

    A [`FlowMatchEuler`][], [`UniPC`][], [`CogVideoXDDIM`][] or [`CogVideoXDPM`][].

    **Raises:**

    `ValueError` for a config without `_class_name` or with another class; for an
    option set to a value the scheduler does not reproduce (naming the key, the value
    received and the values supported: e.g. UniPC's `use_karras_sigmas`, a
    `prediction_type` other than `"flow_prediction"`, FlowMatchEuler's
    `use_dynamic_shifting`); for a key that is no option of the class; for a path
    that is not a config or not valid JSON. `TypeError` for a `config` of another type.
    """
    owner = "scheduler_from_config"
    config = read_config(owner, config)
    if "_class_name" not in config:
        raise ValueError(
            f"{owner}: the config must name its scheduler in `_class_name` (diffusers' "
            f"scheduler_config.json does); received a config without one, keys "
            f"{sorted(config)}. Add it, or call the scheduler's own `from_config` "
            f"({', '.join(cls.__name__ for cls in _SCHEDULERS.values())}).")
    name = config["_class_name"]
    if not isinstance(name, str) or name not in _SCHEDULERS:
        raise ValueError(
            f"{owner}: `_class_name` must be one of the diffusers schedulers that "
            f"vidax_eqx reproduces, {', '.join(_SCHEDULERS)}; received {name!r}.")
    return _SCHEDULERS[name].from_config(config)
