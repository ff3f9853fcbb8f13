"""Writes the scheduler parity fixtures of tests/fixtures/schedulers/: diffusers' own
schedules and denoising loops, for `tests/test_schedulers.py` to match.

Run by hand, with torch and diffusers installed (CI never needs them); written with
torch 2.14.1 (run on the CPU) and diffusers 0.42.1:

    pip install torch diffusers
    python scripts/make_scheduler_fixtures.py

One `<name>.npz` per scheduler configuration (`CONFIGS`): the diffusers class and the
keyword arguments it is built with (`config`, JSON), and for each number of steps `S`
in `STEPS[name]`:

- `s{S}_timesteps`: diffusers' `scheduler.timesteps` after `set_timesteps(S)`, as the
    model gets them (float64 here; integers for UniPC and CogVideoX);
- `s{S}_sigmas` (flow matching): `scheduler.sigmas`, `S + 1` values ending at the
    final one; `s{S}_alphas_cumprod` (CogVideoX): `alphas_cumprod` at the timesteps;
- `s{S}_{dtype}_outputs`, `(S, *shape)`: the sample after each `step` of a whole
    loop in `dtype` (float32, and float64 where `FLOAT64_STEPS` says), from `sample`.

The loop's model is a fixed function of the sample, so that a multistep scheduler's
history matters and a loop elsewhere can replay it exactly:

    model_output_i = model_scale * sample_i + sin(model_freqs[0] * j + model_freqs[1] * i + model_freqs[2])

(`j` the flat index of an element, `i` the step; computed in float64, cast to the
loop's dtype, then added in it). `CogVideoXDPMScheduler` draws Gaussian noise in every
step (its `eta` is not used); here its `randn_tensor` is replaced by
`cos(noise_freqs[0] * j + noise_freqs[1] * i + noise_freqs[2])`, stored the same way,
so that a replay can hand the same noise to its step.

The sample is tiny, `(1, 2, 2, 2, 4)`: schedulers act elementwise, and the files stay
small (about 140 kB in all).
"""

import json
import pathlib

import numpy as np
import torch
from diffusers import (
    CogVideoXDDIMScheduler,
    CogVideoXDPMScheduler,
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
)
from diffusers.schedulers import scheduling_dpm_cogvideox


OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "schedulers"
SHAPE = (1, 2, 2, 2, 4)
MODEL_SCALE = 0.5
MODEL_FREQS = (0.61, 1.37, 0.5)
NOISE_FREQS = (0.83, 0.71, 0.2)

# The scheduler_config.json of the Wan 2.1 / 2.2 diffusers pipelines (UniPC, flow
# prediction), with `flow_shift` set per configuration.
WAN_UNIPC = dict(
    num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
    solver_order=2, predict_x0=True, solver_type="bh2", lower_order_final=True,
    disable_corrector=[], final_sigmas_type="zero", timestep_spacing="linspace",
    beta_schedule="linear", beta_start=0.0001, beta_end=0.02, thresholding=False,
    use_karras_sigmas=False, rescale_betas_zero_snr=False,
)
# THUDM/CogVideoX-2b's scheduler_config.json (CogVideoXDDIMScheduler); the 5B models
# ship the same with snr_shift_scale 1.0 and are run with CogVideoXDPMScheduler.
COGVIDEOX = dict(
    num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
    beta_schedule="scaled_linear", clip_sample=False, prediction_type="v_prediction",
    rescale_betas_zero_snr=True, set_alpha_to_one=True, snr_shift_scale=3.0,
    steps_offset=0, timestep_spacing="trailing",
)

CONFIGS = {
    "euler_shift3": (FlowMatchEulerDiscreteScheduler, dict(shift=3.0)),
    "euler_shift5": (FlowMatchEulerDiscreteScheduler, dict(shift=5.0)),
    "unipc_shift3": (UniPCMultistepScheduler, dict(WAN_UNIPC, flow_shift=3.0)),
    "unipc_shift5": (UniPCMultistepScheduler, dict(WAN_UNIPC, flow_shift=5.0)),
    # Options the Wan pipelines leave at their defaults: third order, B(h) = h,
    # a disabled corrector step, and a last step to sigma_min instead of 0.
    "unipc_order3_bh1": (UniPCMultistepScheduler, dict(
        WAN_UNIPC, flow_shift=3.0, solver_order=3, solver_type="bh1",
        disable_corrector=[2], final_sigmas_type="sigma_min")),
    "cogvideox_ddim_2b": (CogVideoXDDIMScheduler, dict(COGVIDEOX)),
    "cogvideox_ddim_5b": (CogVideoXDDIMScheduler, dict(COGVIDEOX, snr_shift_scale=1.0)),
    "cogvideox_dpm_5b": (CogVideoXDPMScheduler, dict(COGVIDEOX, snr_shift_scale=1.0)),
}
STEPS = {name: (4, 20, 50) for name in CONFIGS}
STEPS["unipc_order3_bh1"] = (4, 20)
STEPS["cogvideox_ddim_5b"] = (4, 30)  # 30: 1000 % 30 != 0, diffusers' prev-timestep rule
FLOAT64_STEPS = (4, 20)


def _wave(freqs, i, dtype):
    j = np.arange(int(np.prod(SHAPE)), dtype=np.float64)
    return torch.from_numpy(np.sin(freqs[0] * j + freqs[1] * i + freqs[2]).reshape(SHAPE)).to(dtype)


def _noise(i, dtype):
    j = np.arange(int(np.prod(SHAPE)), dtype=np.float64)
    return torch.from_numpy(np.cos(NOISE_FREQS[0] * j + NOISE_FREQS[1] * i + NOISE_FREQS[2]).reshape(SHAPE)).to(dtype)


def _loop(cls, kwargs, steps, sample, dtype):
    scheduler = cls(**kwargs)
    scheduler.set_timesteps(steps)
    x = sample.to(dtype)
    outputs = []
    old_x0 = None
    timesteps = scheduler.timesteps
    for i, t in enumerate(timesteps):
        model_output = MODEL_SCALE * x + _wave(MODEL_FREQS, i, dtype)
        if cls is CogVideoXDPMScheduler:
            noise = _noise(i, dtype)
            scheduling_dpm_cogvideox.randn_tensor = lambda shape, **kw: noise.to(kw.get("dtype") or noise.dtype)
            x, old_x0 = scheduler.step(model_output, old_x0, t, timesteps[i - 1] if i > 0 else None,
                                       x, return_dict=False)
        else:
            x = scheduler.step(model_output, t, x, return_dict=False)[0]
        assert x.dtype == dtype, (cls.__name__, x.dtype, dtype)
        outputs.append(x.numpy().copy())
    return scheduler, np.stack(outputs)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    sample = torch.from_numpy(rng.standard_normal(SHAPE))
    for name, (cls, kwargs) in CONFIGS.items():
        arrays = {
            "config": np.array(json.dumps({"class": cls.__name__, "kwargs": kwargs})),
            "sample": sample.numpy(),
            "model_scale": np.array(MODEL_SCALE),
            "model_freqs": np.array(MODEL_FREQS),
            "noise_freqs": np.array(NOISE_FREQS),
            "steps": np.array(STEPS[name]),
        }
        for steps in STEPS[name]:
            for dtype in (torch.float32, torch.float64):
                if dtype == torch.float64 and steps not in FLOAT64_STEPS:
                    continue
                scheduler, outputs = _loop(cls, kwargs, steps, sample, dtype)
                arrays[f"s{steps}_{str(dtype).removeprefix('torch.')}_outputs"] = outputs
            arrays[f"s{steps}_timesteps"] = scheduler.timesteps.numpy().astype(np.float64)
            if hasattr(scheduler, "sigmas") and cls in (FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler):
                arrays[f"s{steps}_sigmas"] = scheduler.sigmas.numpy().astype(np.float64)
            else:
                arrays[f"s{steps}_alphas_cumprod"] = scheduler.alphas_cumprod[scheduler.timesteps].numpy()
        np.savez_compressed(OUT / f"{name}.npz", **arrays)
        print(f"{name}: {(OUT / f'{name}.npz').stat().st_size} bytes")


if __name__ == "__main__":
    main()
