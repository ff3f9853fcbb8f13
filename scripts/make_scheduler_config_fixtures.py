"""Writes the scheduler config fixtures of tests/fixtures/schedulers/configs/: the
`scheduler_config.json` diffusers' `save_config` writes for the Wan and CogVideoX
settings, and diffusers' schedule for each, for `tests/test_scheduler_config.py`.

Run by hand, with torch and diffusers installed (CI never needs them); written with
torch 2.14.1 (run on the CPU) and diffusers 0.42.1:

    pip install torch diffusers
    python scripts/make_scheduler_config_fixtures.py

- `<name>.json`: diffusers' `scheduler.save_config(folder)` output, as written (every
    option of the class's `__init__`, and the `_class_name` / `_diffusers_version`
    metadata), for each configuration of `CONFIGS`. The settings are those of
    `scripts/make_scheduler_fixtures.py` (the Wan 2.1 / 2.2 pipelines' UniPC; CogVideoX-2B
    and -5B's DDIM; the DPM scheduler CogVideoX's demos swap in with
    `CogVideoXDPMScheduler.from_config(pipe.scheduler.config)`; the Euler scheduler a
    Wan pipeline swaps in the same way, which keeps UniPC's options in its config);
    UniPC and Euler with options at values that change nothing; and diffusers'
    defaults for UniPC (the epsilon-prediction form, refused) and Euler.
- `schedules.json`: for each configuration diffusers builds a schedule for, and each
    number of steps in `STEPS`, diffusers' `timesteps` after `set_timesteps(steps)` and
    `sigmas` (flow matching) or `alphas_cumprod` at the timesteps (CogVideoX), as
    float64 numbers.
"""

import json
import pathlib
import tempfile

from diffusers import (
    CogVideoXDDIMScheduler,
    CogVideoXDPMScheduler,
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
)

from make_scheduler_fixtures import COGVIDEOX, WAN_UNIPC


OUT = (pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "schedulers"
       / "configs")
STEPS = (4, 30)


def _configs():
    wan = UniPCMultistepScheduler(**WAN_UNIPC, flow_shift=3.0)
    cogvideox_5b = CogVideoXDDIMScheduler(**dict(COGVIDEOX, snr_shift_scale=1.0))
    return {
        "wan_unipc_shift3": wan,
        "wan_unipc_shift5": UniPCMultistepScheduler(**WAN_UNIPC, flow_shift=5.0),
        "unipc_order3_bh1": UniPCMultistepScheduler(**dict(
            WAN_UNIPC, flow_shift=3.0, solver_order=3, solver_type="bh1",
            disable_corrector=[2], final_sigmas_type="sigma_min")),
        "wan_euler_shift5": FlowMatchEulerDiscreteScheduler.from_config(wan.config, shift=5.0),
        "cogvideox_2b_ddim": CogVideoXDDIMScheduler(**COGVIDEOX),
        "cogvideox_5b_ddim": cogvideox_5b,
        "cogvideox_5b_dpm": CogVideoXDPMScheduler.from_config(cogvideox_5b.config),
        # Options at values other than Wan's where they change nothing: the betas,
        # timestep spacing and Karras bounds (no effect on flow sigmas), the dynamic
        # shifting parameters (no effect without dynamic shifting).
        "unipc_no_effect_options": UniPCMultistepScheduler(**dict(
            WAN_UNIPC, flow_shift=3.0, beta_schedule="scaled_linear", beta_start=0.00085,
            beta_end=0.012, rescale_betas_zero_snr=True, timestep_spacing="trailing",
            steps_offset=1, sigma_min=0.002, sigma_max=80.0, time_shift_type="linear",
            dynamic_thresholding_ratio=0.9, sample_max_value=2.0)),
        "euler_no_effect_options": FlowMatchEulerDiscreteScheduler(
            shift=3.0, base_shift=0.3, max_shift=2.0, base_image_seq_len=128,
            max_image_seq_len=8192, time_shift_type="linear"),
        "euler_defaults": FlowMatchEulerDiscreteScheduler(),
        "unipc_defaults": UniPCMultistepScheduler(),
    }


def _schedule(scheduler, steps):
    scheduler.set_timesteps(steps)
    out = {"timesteps": scheduler.timesteps.double().tolist()}
    if isinstance(scheduler, (CogVideoXDDIMScheduler, CogVideoXDPMScheduler)):
        out["alphas_cumprod"] = scheduler.alphas_cumprod[scheduler.timesteps].double().tolist()
    else:
        out["sigmas"] = scheduler.sigmas.double().tolist()
    return out


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    schedules = {}
    for name, scheduler in _configs().items():
        with tempfile.TemporaryDirectory() as folder:
            scheduler.save_config(folder)
            text = (pathlib.Path(folder) / "scheduler_config.json").read_text()
        (OUT / f"{name}.json").write_text(text)
        if name != "unipc_defaults":  # epsilon prediction: no flow schedule to compare
            schedules[name] = {str(s): _schedule(scheduler, s) for s in STEPS}
        print(f"{name}.json: {len(text)} bytes")
    (OUT / "schedules.json").write_text(json.dumps(schedules, indent=1) + "\n")


if __name__ == "__main__":
    main()
