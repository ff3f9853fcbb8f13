"""Writes a tiny random SkyReels-V2 diffusion forcing pipeline folder, to try
`vidax-generate`'s diffusion forcing flags in seconds on a CPU (from a clone's root):

    python scripts/tiny_skyreels_folder.py /tmp/tiny-df
    vidax-generate /tmp/tiny-df --prompt "A cat walks on the grass" --height 32 --width 48 \\
        --num-frames 13 --steps 2 --max-sequence-length 32 --ar-step 1 \\
        --causal-block-size 2 --output df.mp4

The folder is the test suite's (`tests/harness`' `skyreels_df_folder`): the tiny Wan
pipeline's tokenizer, text encoder and VAE (`tests/fixtures/wan_pipeline/t2v`) with the
SkyReels-V2 transformer, scheduler and `model_index.json` of
`tests/fixtures/skyreels/df_pipeline`, all saved by diffusers. Its weights are random:
the video is noise, but every flag runs as on a real folder (`--base-num-frames`,
`--overlap-history`, `--addnoise-condition`, `--image`, `--last-image`, `--video`,
`--stream`). PATH must not exist, or be an empty folder; the path is printed on stdout.
"""

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print(f"usage: python {os.path.relpath(__file__)} PATH (a new folder)", file=sys.stderr)
        return 2
    path = pathlib.Path(args[0])
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        print(f"tiny_skyreels_folder.py: error: PATH must be a new or empty folder; "
              f"{str(path)!r} {'holds files' if path.is_dir() else 'is a file'}.", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT / "tests"))
    import harness

    print(harness.skyreels_df_folder(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
