"""`vidax-generate` fails before it loads anything: nothing the command can know before
loading the model fails after the run (a user leaves it running for an hour).

Every test here runs `vidax_eqx.generate.main` in-process with the pipelines'
`from_pretrained` patched to fail the test if it is called (`no_load`): a bad flag value,
a prompt that is not text, an input file that is missing or does not decode, an output
folder that cannot be written, a flag the folder's family does not take, and what the
folder's configs refuse: a size, an image given to a text-to-video folder or missing
for an image-to-video one, CogVideoX's text length, `--chunk-frames` that does not
divide the latent frames, `--causal-block-size` that does not divide a window's. Each
is one line on stderr (`vidax-generate: error: ...`, the flag, what was received and
what was expected; no usage, no traceback) and exit status 2. Those of the configs are
the loaded pipeline's own checks and messages, run on the pipeline built on its
configs with abstract components (no array: nothing read; one folder here holds its
JSON files alone), and calls a loaded pipeline takes pass them. Also: `--stream` runs
the steps its header prints; the tiny SkyReels-V2 folder of
`scripts/tiny_skyreels_folder.py` is one the command reads.

No model is loaded and nothing is compiled here: the file runs in a few seconds.
"""

import importlib.util
import json
import os
import pathlib
import shutil

import equinox as eqx
import jax
import pytest

import harness
from vidax_eqx import generate, pipelines, sampling

ROOT = pathlib.Path(__file__).resolve().parent.parent
T2V = str(ROOT / "tests" / "fixtures" / "wan_pipeline" / "t2v")
I2V = str(ROOT / "tests" / "fixtures" / "wan_pipeline" / "i2v")
COG = str(ROOT / "tests" / "fixtures" / "cogvideox_pipeline" / "t2v")
COG_I2V = str(ROOT / "tests" / "fixtures" / "cogvideox_pipeline" / "i2v")
# A video every tiny folder takes (9 frames: 3 latent frames).
SIZE = ("--height", "32", "--width", "48", "--num-frames", "9")
SCRIPT = ROOT / "scripts" / "tiny_skyreels_folder.py"
ERROR = "vidax-generate: error: "


@pytest.fixture(autouse=True)
def no_load(monkeypatch, tmp_path):
    """Every pipeline's `from_pretrained` fails the test; the working directory is a
    fresh folder (the default `--output` is `video.mp4` there)."""
    def loaded(cls, *args, **kwargs):
        raise AssertionError(f"{cls.__name__}.from_pretrained was called: the error came after "
                             "loading")

    monkeypatch.setattr(pipelines.AbstractVideoPipeline, "from_pretrained", classmethod(loaded))
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def df_folder(tmp_path_factory):
    """A SkyReels-V2 diffusion forcing folder (`harness.skyreels_df_folder`'s)."""
    return harness.skyreels_df_folder(tmp_path_factory.mktemp("df"))


def _configs_only(source: str, folder: pathlib.Path) -> pathlib.Path:
    """A copy of the pipeline folder `source` with its JSON files alone (no weight)."""
    for path in pathlib.Path(source).rglob("*.json"):
        target = folder / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    return folder


def _error(capsys, *argv, model=T2V) -> str:
    """The one line `main` prints for `model --prompt 'a cat' *argv`, after checking the
    exit status (2) and that nothing else was printed."""
    with pytest.raises(SystemExit) as exit:
        generate.main([model, "--prompt", "a cat", *argv])
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and out == "", (exit.value.code, out, err)
    assert err.count("\n") == 1 and err.startswith(ERROR), err
    return err[len(ERROR):].rstrip("\n")


# -- the flags' values -------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--num-frames", "0"], "--num-frames must be an int >= 1; received 0."),
    (["--steps", "0"], "--steps must be an int >= 1; received 0."),
    (["--height", "-16"], "--height must be an int >= 1; received -16."),
    (["--num-videos-per-prompt", "0"], "--num-videos-per-prompt must be an int >= 1; received 0."),
    (["--max-sequence-length", "0"], "--max-sequence-length must be an int >= 1; received 0."),
    (["--chunk-frames", "0"], "--chunk-frames must be an int >= 1; received 0."),
    (["--ar-step", "-1"], "--ar-step must be an int >= 0; received -1."),
    (["--guidance-scale", "-1"], "--guidance-scale must be a finite number >= 0 (1 or less: no "
                                 "guidance; Wan uses 5); received -1.0."),
    (["--guidance-scale-2", "nan"], "--guidance-scale-2 must be a finite number >= 0 (1 or "
                                    "less: no guidance; Wan uses 5); received nan."),
    (["--fps", "0"], "--fps must be a positive number of frames per second; received 0.0."),
    (["--addnoise-condition", "1000"], "--addnoise-condition must be a timestep in [0, 1000) (20 "
                                       "recommended); received 1000.0."),
    (["--sp", "0"], "--sp must be an int >= 1; received 0."),
    (["--cfg", "3"], "--cfg must be 1 or 2 (the conditional and unconditional passes); "
                     "received 3."),
    (["--device-memory", "8XB"], "--device-memory must be bytes or a size with a unit (KB, MB, "
                                 "GB, KiB, MiB, GiB; e.g. 8GB); received '8XB'."),
    (["--host-memory", "lots"], "--host-memory must be bytes or a size with a unit (KB, MB, "
                                "GB, KiB, MiB, GiB; e.g. 8GB); received 'lots'."),
    (["--offload", "blocks", "--sp", "2"], "--offload, --device-memory and --host-memory plan "
                                           "one accelerator's memory; over a mesh (--sp, --tp, "
                                           "--dp, --cfg) the weights are sharded instead."),
    (["--output", "cat.avi"], "--output must end in .mp4; received 'cat.avi'."),
    (["--latents", "z.pt"], "--latents must end in .npy or .safetensors; received 'z.pt'."),
    (["--last-image", "last.png"], "--last-image needs --image (the first frame)."),
    (["--stream", "--image", "first.png"], "--image does not go with --stream."),
    (["--stream", "--ar-step", "1"], "--ar-step does not go with --stream."),
])
def test_flag_values(capsys, argv, message):
    """Each is one line, no usage first (argparse's `error` would print it)."""
    assert _error(capsys, *argv) == message


def test_argparse_keeps_its_own_errors(capsys):
    """An unknown flag is argparse's: its usage, then its error, status 2."""
    with pytest.raises(SystemExit) as exit:
        generate.main([T2V, "--prompt", "a cat", "--no-such-flag"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith("usage: vidax-generate")
    assert "error: unrecognized arguments: --no-such-flag" in err


def test_prompts_are_text(capsys):
    """Bytes that are not UTF-8 reach Python as lone surrogates (`$'\\xff\\xfe'` from a
    shell); the tokenizer would raise a TypeError after loading."""
    assert _error(capsys, "--prompt", "b \udcff\udcfe c") == (
        "--prompt must be UTF-8 text; received 'b \\udcff\\udcfe c' with bytes that are not "
        "UTF-8 (\\xff\\xfe) at character 2. Check the shell's quoting and the terminal's "
        "encoding (LANG, LC_ALL).")
    assert _error(capsys, "--negative-prompt", "\udce9t\udce9").startswith(
        "--negative-prompt must be UTF-8 text; received '\\udce9t\\udce9' with bytes that are "
        "not UTF-8 (\\xe9) at character 0.")


# -- files read and written --------------------------------------------------------------


def test_input_files(capsys, tmp_path):
    """Missing, a folder, or not an image / a video: each named by its flag."""
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"not an image at all")
    from PIL import Image

    good = tmp_path / "good.png"
    Image.new("RGB", (48, 32)).save(good)
    assert _error(capsys, "--image", str(tmp_path / "missing.png")) == (
        f"--image: no file {str(tmp_path / 'missing.png')!r}.")
    assert _error(capsys, "--image", str(tmp_path)) == (
        f"--image must be a file; {str(tmp_path)!r} is a folder.")
    assert _error(capsys, "--image", str(garbage)) == (
        f"--image must be an image file that Pillow reads (PNG, JPEG, WebP, ...); "
        f"{str(garbage)!r} is not one (UnidentifiedImageError: cannot identify image file "
        f"{str(garbage)!r}).")
    assert _error(capsys, "--image", str(good), "--last-image", str(garbage)).startswith(
        f"--last-image must be an image file that Pillow reads (PNG, JPEG, WebP, ...); "
        f"{str(garbage)!r} is not one")
    assert _error(capsys, "--video", str(garbage)).startswith(
        f"--video must be a video file that PyAV reads (.mp4, .mkv, .webm, ...); "
        f"{str(garbage)!r} is not one (InvalidDataError:")


def test_output_folders(capsys, tmp_path):
    """A folder under a file, a folder that cannot be written, the output a folder: each
    refused before loading; a missing folder is created."""
    (tmp_path / "file").write_text("x")
    under = tmp_path / "file" / "sub" / "x.mp4"
    assert _error(capsys, "--output", str(under)) == (
        f"--output must be a path in a folder that exists or can be created; {str(under)!r} "
        f"is under {str(tmp_path / 'file')!r}, a file.")
    assert _error(capsys, "--latents", str(tmp_path / "file" / "z.npy")).startswith(
        "--latents must be a path in a folder that exists or can be created;")
    (tmp_path / "d.mp4").mkdir()
    assert _error(capsys, "--output", str(tmp_path / "d.mp4")) == (
        f"--output must be a file to write; {str(tmp_path / 'd.mp4')!r} is a folder.")
    if os.path.isdir("/sys"):  # sysfs takes no new file, not even root's
        assert _error(capsys, "--output", "/sys/x.mp4") == (
            "--output must be a path in a folder this user can write; '/sys/x.mp4' is in "
            "'/sys' (Permission denied).")
    new = tmp_path / "new" / "folder" / "x.mp4"  # created; then the next check fails
    assert _error(capsys, "--output", str(new), "--height", "30").startswith("WanPipeline:")
    assert new.parent.is_dir() and list(new.parent.iterdir()) == []  # its test file removed


# -- the folder's configs ----------------------------------------------------------------


def test_size_from_the_configs(capsys):
    """The loaded pipeline's own messages (its `check_size`, on the JSON configs)."""
    assert _error(capsys, "--height", "30") == (
        "WanPipeline: `height` must be a multiple of 16 (the VAE's spatial factor 8 x the "
        "patch's 2); received 30. Use 16 or 32.")
    assert _error(capsys, "--height", "32", "--width", "48", "--num-frames", "10") == (
        "WanPipeline: `num_frames` must be 1 + a multiple of 4 (the VAE's temporal factor); "
        "received 10. Use 9 or 13.")
    assert _error(capsys, "--height", "32", "--width", "40", "--num-frames", "13",
                  model=COG).startswith(
        "CogVideoXPipeline: `width` must be a multiple of 16 (the VAE's spatial factor 8 x the "
        "patch size 2); received 40.")
    assert _error(capsys, "--height", "32", "--width", "48", "--num-frames", "11",
                  model=COG) == (
        "CogVideoXPipeline: `num_frames` must be 1 + a multiple of 8: 1 + a multiple of the "
        "VAE's temporal factor 4, with an odd number of latent frames ((num_frames - 1) / 4 "
        "+ 1; the VAE decodes an even number F of them to 4 F frames, not num_frames); "
        "received 11. Use 9 or 17.")


def test_configured_reads_no_weight():
    """The checks before loading are the pipeline class's own, run on the class built on
    the folder's configs: its components abstract (`jax.ShapeDtypeStruct` leaves, no
    array: nothing read), its `check_size` the loaded pipeline's."""
    pipe = generate._checks.configured(pipelines.WanPipeline, T2V)
    assert type(pipe) is pipelines.WanPipeline and pipe.text_encoder is None
    leaves = jax.tree.leaves((pipe.transformer, pipe.vae))
    assert any(type(leaf) is jax.ShapeDtypeStruct for leaf in leaves)
    assert not any(eqx.is_array(leaf) for leaf in leaves)
    assert pipe.check_size(32, 48, 9) == (3, 4, 6)
    with pytest.raises(ValueError, match=r"^WanPipeline: `width` must be a multiple of 16"):
        pipe.check_size(32, 50, 9)


def test_images_from_the_configs(capsys, tmp_path):
    """An image given to a text-to-video folder, and an image-to-video folder without
    one (the transformer's channels): the call's `check_image`, before loading."""
    from PIL import Image

    image = str(tmp_path / "first.png")
    Image.new("RGB", (48, 32)).save(image)
    assert _error(capsys, *SIZE, "--image", image) == (
        "WanPipeline: `image` is for an image-to-video transformer; this pipeline's is "
        "text-to-video (in_channels 16 = out_channels, no expand_timesteps). Load an I2V "
        "pipeline (WanImageToVideoPipeline's folder).")
    assert _error(capsys, *SIZE, model=I2V) == (
        "WanPipeline: this pipeline's transformer is image-to-video (in_channels 36 = 16 "
        "latents + 20 condition channels): pass `image`.")
    assert _error(capsys, *SIZE, "--image", image, model=COG).startswith(
        "CogVideoXPipeline: `image` is for an image-to-video transformer; this pipeline's "
        "is text-to-video (in_channels 4 = out_channels).")
    assert _error(capsys, *SIZE, model=COG_I2V) == (
        "CogVideoXPipeline: this pipeline's transformer is image-to-video (in_channels 8 = "
        "4 latents + 4 image latents): pass `image`.")


def test_text_length_from_the_configs(capsys):
    """CogVideoX 2B's positional embedding over the text fixes its length (the
    transformer's max_text_seq_length, 16 in the tiny folder)."""
    assert _error(capsys, *SIZE, "--max-sequence-length", "32", model=COG) == (
        "CogVideoXPipeline: `max_sequence_length` must be the transformer's "
        "max_text_seq_length (16): its positional embedding covers that many text tokens "
        "(diffusers fails on any other length); received 32.")


def test_stream_from_the_configs(capsys, tmp_path):
    """`--stream`'s chunks against the video's latent frames (9 frames: 3), the cache,
    the RoPE tables' reach, and a transformer that does not stream: `WanPipeline.stream`'s
    own checks. The two-expert folder holds configs only: no weight to read."""
    assert _error(capsys, *SIZE, "--stream", "--chunk-frames", "2") == (
        "WanPipeline.stream: `chunk_frames` (2 latent frames) must divide the video's 3 "
        "latent frames; e.g. 1, 3.")
    assert _error(capsys, *SIZE, "--stream", "--max-cached-frames", "2") == (
        "WanPipeline.stream: `max_cached_frames` (2) must be a multiple of `chunk_frames` "
        "(3): the cache holds whole chunks.")
    assert _error(capsys, *SIZE[:4], "--num-frames", "129", "--stream") == (
        "WanPipeline.stream: the video's 33 latent frames pass the transformer's "
        "rope_max_seq_len (32 latent frames), the reach of its RoPE tables; generate at "
        "most 125 frames.")
    assert _error(capsys, *SIZE, "--stream", model=I2V) == (
        "WanPipeline.stream: streaming generation is text-to-video; this transformer takes "
        "an image.")
    a14b = _configs_only(T2V, tmp_path / "a14b")
    shutil.copytree(a14b / "transformer", a14b / "transformer_2")
    index = json.loads((a14b / "model_index.json").read_text())
    index.update(transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=0.875)
    (a14b / "model_index.json").write_text(json.dumps(index))
    assert _error(capsys, *SIZE, "--stream", model=str(a14b)) == (
        "WanPipeline.stream: a WanExperts has no streaming with a key/value cache (stream) "
        "(WanExperts.capabilities.streaming is False).")


def test_forcing_blocks_from_the_configs(capsys, tmp_path, df_folder):
    """`--causal-block-size` must divide each window's latent frames (the last image's
    frame counted in the last window): the denoising loop's rule
    (`DiffusionForcing.rows`), checked by `forcing_options` before loading."""
    from PIL import Image

    image = str(tmp_path / "first.png")
    Image.new("RGB", (48, 32)).save(image)
    folder = str(df_folder)
    assert _error(capsys, *SIZE, "--causal-block-size", "2", model=folder) == (
        "DiffusionForcing: `causal_block_size` (2) must divide the latent frames; received "
        "3 frames.")
    assert _error(capsys, *SIZE, "--causal-block-size", "3", "--image", image,
                  "--last-image", image, model=folder) == (
        "DiffusionForcing: `causal_block_size` (3) must divide the latent frames; received "
        "4 frames.")
    # 33 frames in windows of 17 overlapping by 5: latent windows of 5, then 3 new + 2.
    assert _error(capsys, *SIZE[:4], "--num-frames", "33", "--base-num-frames", "17",
                  "--overlap-history", "5", "--causal-block-size", "5", model=folder) == (
        "DiffusionForcing: `causal_block_size` (5) must divide the latent frames; received "
        "3 frames.")


def test_valid_calls_pass_the_configs(tmp_path, df_folder):
    """Calls the loaded pipelines take pass the checks on the configs (the load, patched
    here, is then what fails)."""
    from PIL import Image

    image = str(tmp_path / "first.png")
    Image.new("RGB", (48, 32)).save(image)
    for model, argv in ((T2V, ["--stream", "--chunk-frames", "3"]),
                        (I2V, ["--image", image]),
                        (COG, ["--max-sequence-length", "16"]),
                        (str(df_folder), ["--causal-block-size", "2", "--ar-step", "1",
                                          "--image", image, "--last-image", image])):
        with pytest.raises(AssertionError, match="from_pretrained was called"):
            generate.main([model, "--prompt", "a cat", *SIZE, *argv])


def test_family_flags(capsys):
    """`--stream` on a CogVideoX folder (it was refused after loading)."""
    assert _error(capsys, "--stream", model=COG) == (
        f"--stream is for Wan and SkyReels-V2 pipelines; {COG!r} is CogVideoXPipeline.")


# -- --stream's sampler -----------------------------------------------------------------


def test_stream_options():
    """What `--stream` passes to `pipe.stream` and prints in its header: FewStep's steps
    by default (four, not the family's 50), or the folder's scheduler with `--steps`."""
    folder = sampling.FlowMatchEuler(shift=5.0)
    args = generate.parse_args([T2V, "--prompt", "a", "--stream", "--chunk-frames", "2"])
    options = generate._command._stream_options(args, {"height": 32, "seed": 1}, folder)
    assert type(options["scheduler"]) is sampling.FewStep
    assert options["num_inference_steps"] == len(sampling.FewStep().timesteps) == 4
    assert options["guidance_scale"] == 1.0 and options["chunk_frames"] == 2
    assert options["height"] == 32 and options["seed"] == 1
    args = generate.parse_args([T2V, "--prompt", "a", "--stream", "--steps", "3",
                                "--guidance-scale", "2"])
    options = generate._command._stream_options(args, {}, folder)
    assert options["scheduler"] is folder and options["num_inference_steps"] == 3
    assert options["guidance_scale"] == 2.0


# -- a tiny SkyReels-V2 folder -----------------------------------------------------------


def test_tiny_skyreels_folder(capsys, tmp_path):
    """`scripts/tiny_skyreels_folder.py PATH` writes a SkyReels-V2 diffusion forcing
    folder that the command reads as one (its flags taken, its configs checked); a PATH
    that holds files is refused."""
    spec = importlib.util.spec_from_file_location("tiny_skyreels_folder", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    folder = tmp_path / "df"
    assert script.main([str(folder)]) == 0
    assert capsys.readouterr().out == f"{folder}\n"
    assert {p.name for p in folder.iterdir()} == {
        "model_index.json", "tokenizer", "text_encoder", "transformer", "vae", "scheduler"}
    assert _error(capsys, "--ar-step", "1", "--causal-block-size", "2", "--overlap-history",
                  "5", "--width", "40", model=str(folder)).startswith(
        "WanPipeline: `width` must be a multiple of 16")
    assert script.main([str(folder)]) == 2
    assert "PATH must be a new or empty folder" in capsys.readouterr().err
