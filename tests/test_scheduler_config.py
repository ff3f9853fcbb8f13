"""`sampling.scheduler_from_config` and the schedulers' `from_config`: diffusers'
`scheduler_config.json` read into a scheduler with its settings.

1. Real configs: the Wan and CogVideoX pipelines' (literal dicts below), and the ones
   diffusers 0.42.1's `save_config` writes for their settings
   (`tests/fixtures/schedulers/configs/*.json`, from
   `scripts/make_scheduler_config_fixtures.py`) give the scheduler built directly with
   those settings, and its plan; the saved ones give diffusers' own timesteps and
   sigmas (`schedules.json`), exactly (`alphas_cumprod` to 1e-7 for CogVideoX).
2. Keys: a field's key sets it (`flow_shift` 5.0 is honoured), an absent one is
   diffusers' default; options with no effect are accepted at any of diffusers' values;
   `_use_default_values` drops what it lists; another scheduler's options are ignored,
   as diffusers ignores them.
3. Every refusal (an option the scheduler does not reproduce, an unknown key, an
   unknown or missing `_class_name`, an invalid value, a bad path) raises a ValueError
   naming the key, the value and what is supported.
"""

import json
import pathlib
import shutil

import numpy as np
import pytest

import oracle
from vidax_eqx import sampling


CONFIGS = pathlib.Path(__file__).resolve().parent / "fixtures" / "schedulers" / "configs"
FIXTURES = CONFIGS.parent

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers, scheduler/scheduler_config.json.
WAN21_T2V = {
    "_class_name": "UniPCMultistepScheduler",
    "_diffusers_version": "0.33.0.dev0",
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995,
    "final_sigmas_type": "zero",
    "flow_shift": 3.0,
    "lower_order_final": True,
    "num_train_timesteps": 1000,
    "predict_x0": True,
    "prediction_type": "flow_prediction",
    "rescale_betas_zero_snr": False,
    "sample_max_value": 1.0,
    "solver_order": 2,
    "solver_p": None,
    "solver_type": "bh2",
    "steps_offset": 0,
    "thresholding": False,
    "timestep_spacing": "linspace",
    "trained_betas": None,
    "use_beta_sigmas": False,
    "use_exponential_sigmas": False,
    "use_flow_sigmas": True,
    "use_karras_sigmas": False,
}
# The same as diffusers 0.35 writes it (two options more, at their defaults).
WAN_DIFFUSERS_035 = {**WAN21_T2V, "_diffusers_version": "0.35.0.dev0",
                     "time_shift_type": "exponential", "use_dynamic_shifting": False}
# THUDM/CogVideoX-2b, scheduler/scheduler_config.json; the 5B models ship it with
# snr_shift_scale 1.0.
COGVIDEOX_2B = {
    "_class_name": "CogVideoXDDIMScheduler",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "clip_sample_range": 1.0,
    "num_train_timesteps": 1000,
    "prediction_type": "v_prediction",
    "rescale_betas_zero_snr": True,
    "sample_max_value": 1.0,
    "set_alpha_to_one": True,
    "snr_shift_scale": 3.0,
    "steps_offset": 0,
    "timestep_spacing": "trailing",
    "trained_betas": None,
}
COGVIDEOX_5B = {**COGVIDEOX_2B, "snr_shift_scale": 1.0}
EULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
         "shift": 5.0}


def _assert_same_plan(got, expected, steps=(4, 30)):
    for s in steps:
        a, b = got.plan(s), expected.plan(s)
        for name in ("timesteps", "sigmas", "coefficients"):
            np.testing.assert_array_equal(np.asarray(getattr(a, name)),
                                          np.asarray(getattr(b, name)), err_msg=name)


# -- 1. real configs ------------------------------------------------------------------


@pytest.mark.parametrize("config,expected", [
    (WAN21_T2V, sampling.UniPC(shift=3.0)),
    (WAN_DIFFUSERS_035, sampling.UniPC(shift=3.0)),
    ({**WAN21_T2V, "flow_shift": 5.0}, sampling.UniPC(shift=5.0)),
    (COGVIDEOX_2B, sampling.CogVideoXDDIM(snr_shift_scale=3.0)),
    (COGVIDEOX_5B, sampling.CogVideoXDDIM(snr_shift_scale=1.0)),
    ({**COGVIDEOX_5B, "_class_name": "CogVideoXDPMScheduler"}, sampling.CogVideoXDPM()),
    (EULER, sampling.FlowMatchEuler(shift=5.0)),
], ids=["wan21", "wan-diffusers035", "wan-shift5", "cogvideox2b", "cogvideox5b",
        "cogvideox5b-dpm", "euler"])
def test_real_config(config, expected):
    got = sampling.scheduler_from_config(config)
    assert type(got) is type(expected) and got == expected, got
    assert type(expected).from_config(config) == expected
    _assert_same_plan(got, expected)


def test_flow_shift_is_honoured():
    five = sampling.scheduler_from_config({**WAN21_T2V, "flow_shift": 5.0})
    assert five.shift == 5.0
    three = sampling.scheduler_from_config(WAN21_T2V).plan(30).sigmas
    assert not np.array_equal(np.asarray(five.plan(30).sigmas), np.asarray(three))


SAVED = {
    "wan_unipc_shift3": sampling.UniPC(shift=3.0),
    "wan_unipc_shift5": sampling.UniPC(shift=5.0),
    "unipc_order3_bh1": sampling.UniPC(shift=3.0, solver_order=3, solver_type="bh1",
                                       disable_corrector=(2,), final_sigmas_type="sigma_min"),
    "unipc_no_effect_options": sampling.UniPC(shift=3.0),
    # Euler swapped into a Wan pipeline: UniPC's options stay in its config, ignored.
    "wan_euler_shift5": sampling.FlowMatchEuler(shift=5.0),
    "euler_no_effect_options": sampling.FlowMatchEuler(shift=3.0),
    "euler_defaults": sampling.FlowMatchEuler(shift=1.0),
    "cogvideox_2b_ddim": sampling.CogVideoXDDIM(),
    "cogvideox_5b_ddim": sampling.CogVideoXDDIM(snr_shift_scale=1.0),
    "cogvideox_5b_dpm": sampling.CogVideoXDPM(),
}


def test_saved_configs_present():
    names = {p.stem for p in CONFIGS.glob("*.json")} - {"schedules"}
    assert names == set(SAVED) | {"unipc_defaults"}, names


@pytest.mark.parametrize("name", sorted(SAVED))
def test_saved_config_matches_diffusers(name):
    """diffusers' save_config output gives the scheduler, and diffusers' schedule."""
    got = sampling.scheduler_from_config(CONFIGS / f"{name}.json")
    assert got == SAVED[name], got
    schedules = json.loads((CONFIGS / "schedules.json").read_text())[name]
    for steps, ref in schedules.items():
        plan = got.plan(int(steps))
        np.testing.assert_array_equal(np.asarray(plan.timesteps, np.float64), ref["timesteps"])
        if "sigmas" in ref:
            np.testing.assert_array_equal(np.asarray(plan.sigmas, np.float64), ref["sigmas"])
        else:
            expected = np.sqrt(1 - np.asarray(ref["alphas_cumprod"]))
            assert oracle.rel_error(np.asarray(plan.sigmas[:-1]), expected) <= 1e-7


def test_parity_fixture_configs():
    """The diffusers arguments of the parity fixtures (`test_schedulers.py`) read as a
    config give the scheduler those fixtures check."""
    expected = {
        "euler_shift3": sampling.FlowMatchEuler(shift=3.0),
        "euler_shift5": sampling.FlowMatchEuler(shift=5.0),
        "unipc_shift3": sampling.UniPC(shift=3.0),
        "unipc_shift5": sampling.UniPC(shift=5.0),
        "unipc_order3_bh1": SAVED["unipc_order3_bh1"],
        "cogvideox_ddim_2b": sampling.CogVideoXDDIM(),
        "cogvideox_ddim_5b": sampling.CogVideoXDDIM(snr_shift_scale=1.0),
        "cogvideox_dpm_5b": sampling.CogVideoXDPM(),
    }
    for path in sorted(FIXTURES.glob("*.npz")):
        with np.load(path) as z:
            config = json.loads(str(z["config"]))
        got = sampling.scheduler_from_config({"_class_name": config["class"], **config["kwargs"]})
        assert got == expected[path.stem], (path.stem, got)


def test_paths(tmp_path):
    expected = SAVED["wan_unipc_shift5"]
    source = CONFIGS / "wan_unipc_shift5.json"
    folder = tmp_path / "scheduler"
    folder.mkdir()
    shutil.copy(source, folder / "scheduler_config.json")
    for config in (source, str(source), folder, str(folder), tmp_path):  # tmp_path: a pipeline
        assert sampling.scheduler_from_config(config) == expected, config
    assert sampling.UniPC.from_config(folder) == expected


# -- 2. keys --------------------------------------------------------------------------


def test_absent_keys_take_diffusers_defaults():
    minimal = {"_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction",
               "use_flow_sigmas": True}
    assert sampling.scheduler_from_config(minimal) == sampling.UniPC(shift=1.0)
    euler = sampling.scheduler_from_config({"_class_name": "FlowMatchEulerDiscreteScheduler"})
    assert euler == sampling.FlowMatchEuler(shift=1.0)
    ddim = sampling.scheduler_from_config({"_class_name": "CogVideoXDDIMScheduler"})
    assert ddim == sampling.CogVideoXDDIM(
        prediction_type="epsilon", timestep_spacing="leading", rescale_betas_zero_snr=False,
        snr_shift_scale=3.0)


@pytest.mark.parametrize("config,changes", [
    (WAN21_T2V, dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                     trained_betas=[0.001] * 1000, rescale_betas_zero_snr=True,
                     timestep_spacing="trailing", steps_offset=1, sigma_min=0.002,
                     sigma_max=80.0, dynamic_thresholding_ratio=0.9, sample_max_value=2.0,
                     time_shift_type="linear", shift_terminal=None, solver_type="midpoint")),
    (EULER, dict(base_shift=0.3, max_shift=2.0, base_image_seq_len=128,
                 max_image_seq_len=8192, time_shift_type="linear", shift_terminal=0.0)),
    (COGVIDEOX_2B, dict(clip_sample=True, clip_sample_range=2.0, sample_max_value=2.0)),
], ids=["unipc", "euler", "cogvideox"])
def test_options_without_effect_accepted(config, changes):
    assert sampling.scheduler_from_config({**config, **changes}) == \
        sampling.scheduler_from_config(config)


def test_use_default_values_drops_keys():
    # diffusers' `scheduler.config` lists the keys a loaded config took defaults for.
    config = {**WAN21_T2V, "solver_order": 3, "_use_default_values": ["solver_order"]}
    assert sampling.scheduler_from_config(config).solver_order == 2


def test_other_schedulers_options_ignored():
    config = {**EULER, "flow_shift": 3.0, "solver_order": 2, "snr_shift_scale": 1.0}
    assert sampling.scheduler_from_config(config) == sampling.FlowMatchEuler(shift=5.0)


# -- 3. refusals ----------------------------------------------------------------------


REFUSED = [
    (WAN21_T2V, "prediction_type", "epsilon", "'flow_prediction'"),
    (WAN21_T2V, "prediction_type", "v_prediction", "'flow_prediction'"),
    (WAN21_T2V, "use_flow_sigmas", False, "True"),
    (WAN21_T2V, "predict_x0", False, "True"),
    (WAN21_T2V, "use_karras_sigmas", True, "False"),
    (WAN21_T2V, "use_exponential_sigmas", True, "False"),
    (WAN21_T2V, "use_beta_sigmas", True, "False"),
    (WAN21_T2V, "use_dynamic_shifting", True, "False"),
    (WAN21_T2V, "thresholding", True, "False"),
    (WAN21_T2V, "shift_terminal", 0.1, "None or 0.0"),
    (WAN21_T2V, "solver_p", "DPMSolverMultistepScheduler", "None"),
    (WAN21_T2V, "beta_schedule", "cosine", "'linear' or 'scaled_linear' or 'squaredcos_cap_v2'"),
    (WAN21_T2V, "timestep_spacing", "uniform", "'linspace' or 'leading' or 'trailing'"),
    (WAN21_T2V, "time_shift_type", "quadratic", "'exponential' or 'linear'"),
    (EULER, "use_dynamic_shifting", True, "False"),
    (EULER, "invert_sigmas", True, "False"),
    (EULER, "stochastic_sampling", True, "False"),
    (EULER, "shift_terminal", 0.1, "None or 0.0"),
    (EULER, "use_karras_sigmas", True, "False"),
    (EULER, "use_exponential_sigmas", True, "False"),
    (EULER, "use_beta_sigmas", True, "False"),
    (EULER, "time_shift_type", "quadratic", "'exponential' or 'linear'"),
    (COGVIDEOX_2B, "beta_schedule", "linear", "'scaled_linear'"),
    (COGVIDEOX_2B, "trained_betas", [0.001] * 1000, "None"),
    ({**COGVIDEOX_5B, "_class_name": "CogVideoXDPMScheduler"}, "beta_schedule",
     "squaredcos_cap_v2", "'scaled_linear'"),
]


@pytest.mark.parametrize("config,key,value,supported", REFUSED,
                         ids=[f"{c['_class_name']}-{k}-{v!r:.12}" for c, k, v, _ in REFUSED])
def test_unsupported_option_refused(config, key, value, supported):
    with pytest.raises(ValueError) as info:
        sampling.scheduler_from_config({**config, key: value})
    message = str(info.value)
    assert f"`{key}` must be {supported}" in message and repr(value) in message, message


def test_absent_key_refused_at_diffusers_default():
    config = {k: v for k, v in WAN21_T2V.items() if k != "prediction_type"}
    with pytest.raises(ValueError, match=r"`prediction_type`.*'epsilon' \(diffusers' default"):
        sampling.scheduler_from_config(config)
    with pytest.raises(ValueError, match="`prediction_type` must be 'flow_prediction'"):
        sampling.scheduler_from_config(CONFIGS / "unipc_defaults.json")


@pytest.mark.parametrize("config,key,value", [
    (WAN21_T2V, "flow_shift", 0.0),
    (WAN21_T2V, "flow_shift", "3.0"),
    (WAN21_T2V, "solver_type", "bh3"),
    (WAN21_T2V, "final_sigmas_type", "one"),
    (WAN21_T2V, "disable_corrector", "2"),
    (EULER, "shift", -1.0),
    (COGVIDEOX_2B, "prediction_type", "flow_prediction"),
    (COGVIDEOX_2B, "snr_shift_scale", 0.0),
], ids=lambda x: x if isinstance(x, str) else None)
def test_invalid_value_refused(config, key, value):
    with pytest.raises(ValueError) as info:
        sampling.scheduler_from_config({**config, key: value})
    message = str(info.value)
    assert f"`{key}`" in message and repr(value) in message, message


def test_unknown_key_refused():
    with pytest.raises(ValueError, match=r"`flow_shfit` \(= 5.0\) is not an option of "
                                         r"diffusers' UniPCMultistepScheduler.*`flow_shift`"):
        sampling.scheduler_from_config({**WAN21_T2V, "flow_shfit": 5.0})
    with pytest.raises(ValueError, match="`variance_type`"):
        sampling.scheduler_from_config({**WAN21_T2V, "variance_type": None})


def test_unknown_class_refused():
    with pytest.raises(ValueError, match="'DPMSolverMultistepScheduler'") as info:
        sampling.scheduler_from_config({**WAN21_T2V, "_class_name": "DPMSolverMultistepScheduler"})
    for name in ("FlowMatchEulerDiscreteScheduler", "UniPCMultistepScheduler",
                 "CogVideoXDDIMScheduler", "CogVideoXDPMScheduler"):
        assert name in str(info.value)


def test_class_name_required_or_matching():
    config = {k: v for k, v in WAN21_T2V.items() if k != "_class_name"}
    with pytest.raises(ValueError, match="`_class_name`"):
        sampling.scheduler_from_config(config)
    assert sampling.UniPC.from_config(config) == sampling.UniPC(shift=3.0)  # the class is named
    with pytest.raises(ValueError, match="'FlowMatchEulerDiscreteScheduler'.*'UniPCMultistepScheduler'"):
        sampling.FlowMatchEuler.from_config(WAN21_T2V)
    with pytest.raises(ValueError, match="'CogVideoXDPMScheduler'.*'CogVideoXDDIMScheduler'"):
        sampling.CogVideoXDPM.from_config(COGVIDEOX_2B)


def test_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="neither a file nor a folder"):
        sampling.scheduler_from_config(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="holds no scheduler_config.json"):
        sampling.scheduler_from_config(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        sampling.scheduler_from_config(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        sampling.scheduler_from_config(tmp_path / "list.json")
    with pytest.raises(TypeError, match="`config` must be a dict"):
        sampling.scheduler_from_config(3.0)
