"""Encodes a folder of video clips to Wan VAE latents: one `.safetensors` per clip.

    python scripts/encode_dataset.py clips/ --vae /path/to/Wan2.1-T2V-1.3B-Diffusers/vae \\
        --num-frames 81 --height 480 --width 832 --out latents/
    python scripts/encode_dataset.py clips/ --vae .../vae --spatial 2 4   # a clip over 8 devices

**Clips.** Every `.mp4`, `.mov`, `.mkv`, `.webm` and `.avi` file directly in the folder,
read with `interop.read_video` and converted with `interop.frames_to_video` (diffusers'
`VideoProcessor`: Lanczos resize with `--height` and `--width`, both or neither, then
`2 * x / 255 - 1`). `--num-frames` takes the first frames of each clip and must be
`1 + 4k` (the VAE's time factor); by default each clip gives the largest `1 + 4k` frames
it has. Height and width must be multiples of the VAE's spatial factor (8, or 16 for
Wan 2.2's VAE): resize with `--height` / `--width` otherwise.

**Output.** `<out>/<clip name>.safetensors` (`--out`, default: beside each clip) holds
the posterior of `WanVAE.encode`, not normalised and not sampled: `mean` and `logvar`,
each `(z_dim, 1 + k, H / s, W / s)` float32. A training step samples
`mean + exp(logvar / 2) * noise` and normalises with `WanVAE.normalize_latents`.
Its metadata: `source` (the clip's path), `frames` (video frames encoded), `fps` (the
clip's), `height`, `width` (encoded), `vae` (the `--vae` folder) and `vae_config` (its
config, JSON).

**Devices.** By default the clips are spread over every device (data parallel): the
clips of one shape are encoded in batches of one per device, a `jax.vmap` of
`WanVAE.encode` compiled once per shape, the batch split over a 1-D mesh of all devices
(the last batch padded with empty clips, whose latents are dropped). `--spatial H W`
instead encodes one clip at a time with every frame split over an `H x W` mesh
(`WanVAE.encode(..., mesh=, spatial_axes=)`), for clips too large for one device; each
device's block must be a whole number of latent pixels. `--chunk` is the latent frames
per step of the encoder's time loop (memory against steps; same latents). On CPU, set
`XLA_FLAGS=--xla_force_host_platform_device_count=8` to simulate 8 devices (`--spatial`
sets it when it needs more devices than that and JAX has not started).

Needs PyAV and Pillow: `pip install 'vidax_eqx[video]'`.
"""

import argparse
import json
import os
import sys
import time


EXTENSIONS = (".mp4", ".mov", ".mkv", ".webm", ".avi")
HEIGHT_AXIS, WIDTH_AXIS, DATA_AXIS = "height", "width", "data"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="See the module docstring (scripts/encode_dataset.py).")
    p.add_argument("clips", help="the folder of video clips")
    p.add_argument("--vae", required=True, help="the VAE: diffusers' vae/ folder")
    p.add_argument("--out", help="the output folder (default: beside each clip)")
    p.add_argument("--num-frames", type=int,
                   help="frames per clip, 1 + 4k (default: the most each clip has)")
    p.add_argument("--height", type=int, help="resize to this height (with --width)")
    p.add_argument("--width", type=int, help="resize to this width (with --height)")
    p.add_argument("--chunk", type=int, default=1,
                   help="latent frames per step of the encoder's time loop (default 1)")
    p.add_argument("--spatial", type=int, nargs=2, metavar=("H", "W"),
                   help="split each clip's frames over an H x W mesh instead of spreading "
                        "the clips over the devices")
    args = p.parse_args(argv)
    if (args.height is None) != (args.width is None):
        p.error("give both --height and --width, or neither")
    for name in ("num_frames", "height", "width", "chunk"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1; received {value}")
    if args.spatial is not None and min(args.spatial) < 1:
        p.error(f"--spatial H W takes two ints >= 1; received {args.spatial}")
    if not os.path.isdir(args.clips):
        p.error(f"{args.clips!r} is not a folder")
    return args


def find_clips(folder: str) -> list[str]:
    """The video files directly in `folder`, sorted by name."""
    return sorted(os.path.join(folder, f) for f in os.listdir(folder)
                  if f.lower().endswith(EXTENSIONS) and os.path.isfile(os.path.join(folder, f)))


def frames_to_encode(available: int, asked: int | None, factor: int, clip: str) -> int:
    """The frames of a clip to encode: `asked` (checked to be `1 + factor k` and at most
    `available`) or the largest `1 + factor k` not above `available`."""
    if asked is not None:
        if (asked - 1) % factor:
            below = 1 + (asked - 1) // factor * factor
            raise SystemExit(f"--num-frames must be 1 + {factor}k (the VAE's time factor is "
                             f"{factor}); received {asked}: use {below} or {below + factor}.")
        if asked > available:
            raise SystemExit(f"--num-frames {asked}: {clip} has only {available} frames.")
        return asked
    return 1 + (available - 1) // factor * factor


def _fps(path: str) -> float:
    import av

    with av.open(path) as container:
        rate = container.streams.video[0].average_rate
    return float(rate) if rate else 0.0


def _load(path: str, args, config):
    """`(video (3, F, H, W) float32 NumPy, fps)` of one clip, checked against the VAE."""
    from vidax_eqx import interop

    if args.num_frames is None:
        frames = interop.read_video(path)
        frames = frames[:frames_to_encode(len(frames), None, config.temporal_factor, path)]
    else:
        frames_to_encode(args.num_frames, args.num_frames, config.temporal_factor, path)
        try:
            frames = interop.read_video(path, num_frames=args.num_frames)
        except ValueError as e:
            raise SystemExit(f"--num-frames {args.num_frames}: {e}") from e
    size = None if args.height is None else (args.height, args.width)
    video = interop.frames_to_video(frames, size=size)
    s = config.spatial_factor
    if video.shape[2] % s or video.shape[3] % s:
        raise SystemExit(f"{path}: frames of {video.shape[2]} x {video.shape[3]} pixels; the "
                         f"VAE takes multiples of {s}. Resize with --height and --width.")
    return video, _fps(path)


def _save(out_dir: str, path: str, mean, logvar, fps: float, video_shape, args, config) -> str:
    from vidax_eqx import interop

    name = os.path.splitext(os.path.basename(path))[0]
    metadata = {"source": os.path.abspath(path), "frames": str(video_shape[1]),
                "fps": f"{fps:g}", "height": str(video_shape[2]), "width": str(video_shape[3]),
                "vae": os.path.abspath(args.vae), "vae_config": json.dumps(config.to_dict())}
    written = interop.write_checkpoint(out_dir, {"mean": mean, "logvar": logvar}, name=name,
                                       metadata=metadata)
    return written[0]


def main(argv=None):
    args = parse_args(argv)
    if args.spatial is not None:
        devices = args.spatial[0] * args.spatial[1]
        flags = os.environ.get("XLA_FLAGS", "")
        if devices > 1 and "jax" not in sys.modules and \
                "--xla_force_host_platform_device_count" not in flags:
            # simulated CPU devices (only the CPU backend reads this flag)
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    try:  # run against this checkout's vidax_eqx when it is not installed
        import vidax_eqx  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import equinox as eqx
    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from vidax_eqx import models

    clips = find_clips(args.clips)
    if not clips:
        raise SystemExit(f"{args.clips!r} has no video clips ({', '.join(EXTENSIONS)}).")
    start = time.perf_counter()
    if args.spatial is not None:
        h, w = args.spatial
        if h * w > jax.device_count():
            raise SystemExit(f"--spatial {h} {w} needs {h * w} devices; JAX has "
                             f"{jax.device_count()}.")
        mesh = jax.make_mesh((h, w), (HEIGHT_AXIS, WIDTH_AXIS),
                             axis_types=(AxisType.Auto, AxisType.Auto),
                             devices=jax.devices()[:h * w])
        layout = f"frames split over a {h} x {w} mesh"
    else:
        n = jax.device_count()
        mesh = jax.make_mesh((n,), (DATA_AXIS,), axis_types=(AxisType.Auto,))
        layout = f"clips spread over {n} device{'s' * (n > 1)}"
    vae = models.WanVAE.from_pretrained(args.vae, mesh=mesh)
    config = vae.config
    print(f"vae         {args.vae} (z_dim {config.z_dim}, x{config.spatial_factor} "
          f"space, x{config.temporal_factor} time): {time.perf_counter() - start:.1f} s; "
          f"{len(clips)} clips, {layout}", flush=True)

    done = 0
    total = len(clips)

    def report(path, out, video_shape, latent_shape, t0, share=1):
        nonlocal done
        done += 1
        print(f"[{done}/{total}] {os.path.basename(path)}: {video_shape[1]} frames "
              f"{video_shape[2]}x{video_shape[3]} -> {tuple(latent_shape)} in {out} "
              f"({(time.perf_counter() - t0) / share:.1f} s)", flush=True)

    def out_dir(path):
        return args.out or os.path.dirname(os.path.abspath(path))

    if args.spatial is not None:
        for path in clips:
            t0 = time.perf_counter()
            video, fps = _load(path, args, config)
            post = vae.encode(video, chunk=args.chunk, mesh=mesh,
                              spatial_axes=(HEIGHT_AXIS, WIDTH_AXIS))
            mean, logvar = np.asarray(post.mean), np.asarray(post.logvar)
            out = _save(out_dir(path), path, mean, logvar, fps, video.shape, args, config)
            report(path, out, video.shape, mean.shape, t0)
    else:
        n = mesh.shape[DATA_AXIS]
        batch_sharding = NamedSharding(mesh, P(DATA_AXIS))

        @eqx.filter_jit
        def encode_batch(vae, videos):
            post = jax.vmap(lambda v: vae.encode(v, chunk=args.chunk))(videos)
            return post.mean, post.logvar

        groups: dict[tuple, list] = {}  # clips of one shape, encoded together
        for path in clips:
            t0 = time.perf_counter()
            video, fps = _load(path, args, config)
            group = groups.setdefault(video.shape, [])
            group.append((path, video, fps, t0))
            if len(group) == n:
                _encode_group(encode_batch, vae, groups.pop(video.shape), n, batch_sharding,
                              out_dir, args, config, report)
        for group in groups.values():
            _encode_group(encode_batch, vae, group, n, batch_sharding, out_dir, args, config,
                          report)
    print(f"done        {total} clips in {time.perf_counter() - start:.1f} s", flush=True)


def _encode_group(encode_batch, vae, group, n, sharding, out_dir, args, config, report):
    """Encodes up to `n` clips of one shape as one batch over the devices."""
    import jax
    import numpy as np

    t0 = time.perf_counter()
    videos = np.zeros((n, *group[0][1].shape), np.float32)  # padded with empty clips
    for i, (_, video, _, _) in enumerate(group):
        videos[i] = video
    means, logvars = encode_batch(vae, jax.device_put(videos, sharding))
    means, logvars = np.asarray(means), np.asarray(logvars)
    for i, (path, video, fps, _) in enumerate(group):
        out = _save(out_dir(path), path, means[i], logvars[i], fps, video.shape, args, config)
        report(path, out, video.shape, means[i].shape, t0, share=len(group))


if __name__ == "__main__":
    main()
