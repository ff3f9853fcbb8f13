"""`WanPipeline`'s stage times on this machine: text encoding, the denoising loop and the
decode, cold (the first call: compilation included) and warm, and against diffusers'
`WanPipeline` running the same tiny pipeline in the same run.

The pipeline is the tiny random one the tests compare against diffusers
(`tests/fixtures/wan_pipeline/t2v`: UMT5 of 2 layers, a 2-block transformer, a VAE of
base width 4), at a larger video than the tests' (`--height`, `--width`, `--frames`,
`--steps`; 512 prompt tokens as Wan). Warm times are medians over `--rounds` calls;
diffusers runs in a process of its own (`--diffusers-python`, an interpreter with torch
and diffusers; left out when not given), its stages timed the same way: `encode_prompt`,
the call with `output_type="latent"` from the embeddings, the VAE's decode and
`postprocess_video`. A tiny model measures the pipeline's overheads (dispatch, host
work, the per-stage programs), not an accelerator's arithmetic.

    python benchmarks/pipeline_stages.py
    python benchmarks/pipeline_stages.py --diffusers-python /tmp/torchvenv/bin/python --rounds 5
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(ROOT, "tests", "fixtures", "wan_pipeline", "t2v")
PROMPT, NEGATIVE = "A cat walks on the grass, then runs to a tree", "blurry"

_DIFFUSERS = r"""
import json, statistics, sys, time
import numpy as np, torch
from diffusers import WanPipeline
torch.set_num_threads(int(sys.argv[7]))
folder, height, width, frames, steps, rounds = sys.argv[1], *map(int, sys.argv[2:7])
pipe = WanPipeline.from_pretrained(folder, torch_dtype=torch.float32)
pipe.set_progress_bar_config(disable=True)
shape = (1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)
latents = torch.from_numpy(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
times = {"text": [], "denoise": [], "decode": []}
for _ in range(rounds + 1):
    with torch.no_grad():
        t = time.perf_counter()
        pe, ne = pipe.encode_prompt(%(prompt)r, %(negative)r, max_sequence_length=512)
        times["text"].append(time.perf_counter() - t)
        t = time.perf_counter()
        z = pipe(prompt_embeds=pe, negative_prompt_embeds=ne, height=height, width=width,
                 num_frames=frames, num_inference_steps=steps, latents=latents.clone(),
                 output_type="latent").frames
        times["denoise"].append(time.perf_counter() - t)
        t = time.perf_counter()
        mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
        video = pipe.vae.decode(z / std + mean, return_dict=False)[0]
        pipe.video_processor.postprocess_video(video, output_type="np")
        times["decode"].append(time.perf_counter() - t)
print(json.dumps({k: {"first": v[0], "warm": statistics.median(v[1:])} for k, v in times.items()}))
""" % {"prompt": PROMPT, "negative": NEGATIVE}


def _jax_times(args):
    import jax

    from vidax_eqx.pipelines import WanPipeline

    pipe = WanPipeline.from_pretrained(FOLDER)
    runs = []
    for _ in range(args.rounds + 1):
        out = pipe(PROMPT, NEGATIVE, height=args.height, width=args.width,
                   num_frames=args.frames, num_inference_steps=args.steps, seed=0,
                   progress=False)
        runs.append(out.timings)
    jax.block_until_ready(out.latents)
    return {k: {"first": runs[0][k], "warm": statistics.median(r[k] for r in runs[1:])}
            for k in runs[0]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--height", type=int, default=64)
    p.add_argument("--width", type=int, default=96)
    p.add_argument("--frames", type=int, default=17)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--diffusers-python", help="an interpreter with torch and diffusers")
    args = p.parse_args(argv)
    import jax

    start = time.perf_counter()
    ours = _jax_times(args)
    print(f"# WanPipeline stages, tiny random pipeline, {args.frames} x {args.height} x "
          f"{args.width}, {args.steps} steps, guidance 5, 512 tokens; jax {jax.__version__} "
          f"({jax.devices()[0].platform}, {os.cpu_count()} cores); {args.rounds} warm rounds "
          f"(median); {time.perf_counter() - start:.0f} s", flush=True)
    theirs = None
    if args.diffusers_python:
        run = subprocess.run(
            [args.diffusers_python, "-c", _DIFFUSERS, FOLDER, str(args.height), str(args.width),
             str(args.frames), str(args.steps), str(args.rounds), str(os.cpu_count())],
            capture_output=True, text=True, check=True)
        theirs = json.loads(run.stdout.strip().splitlines()[-1])
    total = sum(v["warm"] for v in ours.values())
    print("| stage | first call (s) | warm (s) | share of warm total |"
          + (" diffusers warm (s) | warm / diffusers |" if theirs else ""))
    print("|---|---|---|---|" + ("---|---|" if theirs else ""))
    for stage, t in ours.items():
        row = f"| {stage} | {t['first']:.2f} | {t['warm']:.3f} | {t['warm'] / total:.2f} |"
        if theirs:
            d = theirs[stage]["warm"]
            row += f" {d:.3f} | {t['warm'] / d:.2f} |"
        print(row, flush=True)
    if theirs:
        d = sum(v["warm"] for v in theirs.values())
        print(f"| total | {sum(v['first'] for v in ours.values()):.2f} | {total:.3f} | 1.00 | "
              f"{d:.3f} | {total / d:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
