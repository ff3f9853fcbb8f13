"""diffusers' `scheduler_config.json`, read: for each diffusers scheduler that a
vidax_eqx scheduler reproduces, every key of its `__init__` (diffusers 0.42.1) and what
it is here, a field or an option held at the values that change nothing; and
`build_from_config`, which reads a config through that table into a scheduler."""

import difflib
import json
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from .._checks import is_real


CONFIG_FILE = "scheduler_config.json"
ANY = "any value"
"""`Option.supported` for an option that has no effect in the configuration the
scheduler implements."""


class Field(NamedTuple):
    """A key that sets the scheduler field `name`; `default` is diffusers' (used when
    the key is absent), `convert` maps diffusers' spelling to the field's."""

    name: str
    default: Any
    convert: Any = None


class Option(NamedTuple):
    """A key with no field: accepted at the `supported` values (a tuple, or `ANY`),
    at which the scheduler reproduces diffusers exactly; `why` says why (and, for a
    refused value, what is missing)."""

    default: Any
    supported: Any
    why: str


def _solver_type(value):
    # diffusers' __init__ registers these three as "bh2".
    return "bh2" if value in ("midpoint", "heun", "logrho") else value


_BETAS = "no effect on flow sigmas: the betas are not used"
_SIGMAS = "Karras, exponential and beta sigmas are not implemented"
_DYNAMIC = "dynamic, resolution-dependent shifting is not implemented: the shift is fixed"
_TERMINAL = "the terminal stretch of the sigmas is not implemented"
_TIME_SHIFT = "used by dynamic shifting only"
_TIME_SHIFTS = ("exponential", "linear")
_SPACINGS = ("linspace", "leading", "trailing")

UNIPC = {
    "num_train_timesteps": Field("num_train_timesteps", 1000),
    "beta_start": Option(0.0001, ANY, _BETAS),
    "beta_end": Option(0.02, ANY, _BETAS),
    "beta_schedule": Option("linear", ("linear", "scaled_linear", "squaredcos_cap_v2"),
                            "diffusers' schedules; " + _BETAS),
    "trained_betas": Option(None, ANY, _BETAS),
    "solver_order": Field("solver_order", 2),
    "prediction_type": Option("epsilon", ("flow_prediction",),
                              "UniPC is implemented in its flow-prediction form only: the "
                              "model predicts the velocity"),
    "thresholding": Option(False, (False,), "dynamic thresholding is not implemented"),
    "dynamic_thresholding_ratio": Option(0.995, ANY, "used by thresholding only"),
    "sample_max_value": Option(1.0, ANY, "used by thresholding only"),
    "predict_x0": Option(True, (True,), "only the data-prediction form is implemented"),
    "solver_type": Field("solver_type", "bh2", _solver_type),
    "lower_order_final": Field("lower_order_final", True),
    "disable_corrector": Field("disable_corrector", []),
    "solver_p": Option(None, (None,), "an external predictor scheduler is not implemented"),
    "use_karras_sigmas": Option(False, (False,), _SIGMAS),
    "use_exponential_sigmas": Option(False, (False,), _SIGMAS),
    "use_beta_sigmas": Option(False, (False,), _SIGMAS),
    "use_flow_sigmas": Option(False, (True,), "UniPC is implemented with flow-matching "
                                             "sigmas only"),
    "flow_shift": Field("shift", 1.0),
    "timestep_spacing": Option("linspace", _SPACINGS, "no effect with flow sigmas"),
    "steps_offset": Option(0, ANY, "no effect with flow sigmas"),
    "final_sigmas_type": Field("final_sigmas_type", "zero"),
    "rescale_betas_zero_snr": Option(False, (False, True), _BETAS),
    "use_dynamic_shifting": Option(False, (False,), _DYNAMIC),
    "time_shift_type": Option("exponential", _TIME_SHIFTS, _TIME_SHIFT),
    "sigma_min": Option(None, ANY, "used by Karras, exponential and beta sigmas only"),
    "sigma_max": Option(None, ANY, "used by Karras, exponential and beta sigmas only"),
    "shift_terminal": Option(None, (None, 0.0), _TERMINAL),
}

FLOW_MATCH_EULER = {
    "num_train_timesteps": Field("num_train_timesteps", 1000),
    "shift": Field("shift", 1.0),
    "use_dynamic_shifting": Option(False, (False,), _DYNAMIC),
    "base_shift": Option(0.5, ANY, _TIME_SHIFT),
    "max_shift": Option(1.15, ANY, _TIME_SHIFT),
    "base_image_seq_len": Option(256, ANY, _TIME_SHIFT),
    "max_image_seq_len": Option(4096, ANY, _TIME_SHIFT),
    "invert_sigmas": Option(False, (False,), "inverted sigmas, Mochi's, are not implemented"),
    "shift_terminal": Option(None, (None, 0.0), _TERMINAL),
    "use_karras_sigmas": Option(False, (False,), _SIGMAS),
    "use_exponential_sigmas": Option(False, (False,), _SIGMAS),
    "use_beta_sigmas": Option(False, (False,), _SIGMAS),
    "time_shift_type": Option("exponential", _TIME_SHIFTS, _TIME_SHIFT),
    "stochastic_sampling": Option(False, (False,), "stochastic sampling is not implemented"),
}

_NO_CLIP = "no effect: diffusers' CogVideoX step does not clip"
COGVIDEOX = {
    "num_train_timesteps": Field("num_train_timesteps", 1000),
    "beta_start": Field("beta_start", 0.00085),
    "beta_end": Field("beta_end", 0.012),
    "beta_schedule": Option("scaled_linear", ("scaled_linear",),
                            "only the scaled-linear betas are implemented"),
    "trained_betas": Option(None, (None,), "trained betas are not implemented"),
    "clip_sample": Option(True, (True, False), _NO_CLIP),
    "set_alpha_to_one": Field("set_alpha_to_one", True),
    "steps_offset": Field("steps_offset", 0),
    "prediction_type": Field("prediction_type", "epsilon"),
    "clip_sample_range": Option(1.0, ANY, _NO_CLIP),
    "sample_max_value": Option(1.0, ANY, _NO_CLIP),
    "timestep_spacing": Field("timestep_spacing", "leading"),
    "rescale_betas_zero_snr": Field("rescale_betas_zero_snr", False),
    "snr_shift_scale": Field("snr_shift_scale", 3.0),
}

DIFFUSERS_CLASSES = {
    "FlowMatchEuler": "FlowMatchEulerDiscreteScheduler",
    "UniPC": "UniPCMultistepScheduler",
    "CogVideoXDDIM": "CogVideoXDDIMScheduler",
    "CogVideoXDPM": "CogVideoXDPMScheduler",
}
"""The diffusers class each vidax_eqx scheduler reproduces (its `_class_name`)."""
KEYS = {
    "FlowMatchEulerDiscreteScheduler": FLOW_MATCH_EULER,
    "UniPCMultistepScheduler": UNIPC,
    "CogVideoXDDIMScheduler": COGVIDEOX,
    "CogVideoXDPMScheduler": COGVIDEOX,
}


def read_config(owner: str, config) -> dict:
    """`config` as a dict: a mapping (diffusers' `scheduler.config`), or the path of a
    `scheduler_config.json`, of a folder holding one, or of a pipeline's folder (its
    `scheduler/scheduler_config.json`)."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(
            f"{owner}: `config` must be a dict (diffusers' `scheduler.config`) or the path of "
            f"a {CONFIG_FILE}, or of a folder holding one; received {type(config).__name__}.")
    path = os.fspath(config)
    if os.path.isdir(path):
        tried = [os.path.join(path, CONFIG_FILE), os.path.join(path, "scheduler", CONFIG_FILE)]
        found = [p for p in tried if os.path.isfile(p)]
        if not found:
            raise ValueError(f"{owner}: the folder {path!r} holds no {CONFIG_FILE} (looked for "
                             f"{tried[0]!r} and {tried[1]!r}). Pass the file's path, or the "
                             "scheduler's folder of a diffusers pipeline.")
        path = found[0]
    elif not os.path.isfile(path):
        raise ValueError(f"{owner}: `config` {path!r} is neither a file nor a folder. Pass a "
                         f"{CONFIG_FILE}, a folder holding one, or a dict.")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{owner}: {path!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{owner}: {path!r} must hold a JSON object; it holds a "
                         f"{type(raw).__name__}.")
    return raw


def _same(value, supported) -> bool:
    """JSON equality with bools apart from numbers (`0` is not `False`)."""
    if isinstance(value, bool) or isinstance(supported, bool) or supported is None:
        return value is supported
    if is_real(supported):
        return is_real(value) and value == supported
    return type(value) is type(supported) and value == supported


def config_fields(owner: str, config: dict) -> dict:
    """The scheduler fields of a diffusers config (read by `read_config`), refusing what
    the scheduler `owner` does not reproduce."""
    class_name = DIFFUSERS_CLASSES[owner]
    keys = KEYS[class_name]
    prefix = f"{owner}.from_config"
    # diffusers drops the keys a loaded config took defaults for (extract_init_dict).
    defaulted = config.get("_use_default_values") or []
    config = {k: v for k, v in config.items() if k not in defaulted}
    found = config.get("_class_name", class_name)
    if found != class_name:
        raise ValueError(
            f"{prefix}: the config's `_class_name` must be {class_name!r} (the diffusers "
            f"scheduler {owner} reproduces); received {found!r}. Use "
            "`scheduler_from_config`, which picks the scheduler the config names.")
    others = set().union(*KEYS.values()) - set(keys)
    for key in config:
        if key.startswith("_") or key in keys:
            continue
        if key in others:
            # Another scheduler's option, left by diffusers' `from_config` when a
            # pipeline swaps schedulers; diffusers ignores it, and so does this.
            continue
        close = difflib.get_close_matches(key, keys, n=1)
        hint = f" Did you mean `{close[0]}`?" if close else ""
        raise ValueError(
            f"{prefix}: `{key}` (= {config[key]!r}) is not an option of diffusers' "
            f"{class_name} (0.42.1), nor of the other schedulers read here.{hint} Its "
            f"options: {', '.join(sorted(keys))}.")
    fields = {}
    for key, rule in keys.items():
        value = config.get(key, rule.default)
        if isinstance(rule, Field):
            fields[rule.name] = value if rule.convert is None else rule.convert(value)
        elif rule.supported is not ANY and not any(_same(value, s) for s in rule.supported):
            absent = "" if key in config else " (diffusers' default: the key is absent)"
            supported = " or ".join(map(repr, rule.supported))
            raise ValueError(
                f"{prefix}: `{key}` must be {supported} for {owner} to reproduce "
                f"diffusers' {class_name} ({rule.why}); received {value!r}{absent}.")
    return fields


def build_from_config(cls, config):
    """`cls` (a vidax_eqx scheduler named in `DIFFUSERS_CLASSES`) from a diffusers
    config, as `read_config` takes it; a field's invalid value raises a ValueError that
    names the config's key."""
    owner = cls.__name__
    fields = config_fields(owner, read_config(f"{owner}.from_config", config))
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        names = {rule.name: key for key, rule in KEYS[DIFFUSERS_CLASSES[owner]].items()
                 if isinstance(rule, Field)}
        spelled = ", ".join(f"`{f}` is the config's `{k}`" for f, k in names.items() if f != k)
        note = f" ({spelled})" if spelled else ""
        raise ValueError(f"{owner}.from_config: the config holds an invalid value: {e}{note}") from e
