"""Pixels in and out around the VAE, without torch: `interop.write_video` /
`read_video` (PyAV), the conversions `frames_to_video` / `video_to_frames`,
`scripts/encode_dataset.py` (data parallel and frames split over a 2 x 4 mesh) and
`examples/generate_wan.py --video`.

The round trip through H.264 is lossy: a smooth pattern at a high quality (crf 10) comes
back within a small mean absolute error. The conversions are checked value by value
against the formulas diffusers writes. The script's latents are compared with
`WanVAE.encode` called here on the same frames (read back with `read_video` and
`frames_to_video`), using the tiny Wan 2.1 VAE fixture.
"""

import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("av")
pytest.importorskip("PIL")

from vidax_eqx import interop, models  # noqa: E402


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VAE = os.path.join(ROOT, "tests", "fixtures", "wan_vae", "wan21", "diffusers")
TRANSFORMER = os.path.join(ROOT, "tests", "fixtures", "wan", "t2v", "diffusers")
MAE_CRF10 = 0.015  # measured ~0.007: the 8-bit RGB <-> YUV 4:2:0 conversion's floor


def _load(name, *parts):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, *parts))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smooth(frames, height, width, phase=0.0):
    """A smooth RGB pattern in [0.1, 0.9], float64 `(F, H, W, 3)`: ramps and one slow
    wave that moves with time."""
    t = np.arange(frames)[:, None, None] / frames
    y = np.arange(height)[None, :, None] / height
    x = np.arange(width)[None, None, :] / width
    r = 0.2 + 0.6 * x + 0 * (t + y)
    g = 0.2 + 0.6 * y + 0 * (t + x)
    b = 0.5 + 0.3 * np.sin(2 * np.pi * (x + y + t + phase) / 2)
    return np.stack(np.broadcast_arrays(r, g, b), axis=-1)


@pytest.fixture(scope="module")
def vae():
    return models.WanVAE.from_pretrained(VAE)


# -- files -------------------------------------------------------------------------------


def test_write_read_round_trip(tmp_path):
    frames = smooth(9, 32, 48)
    path = tmp_path / "clip.mp4"
    interop.write_video(frames, path, fps=8, crf=10)
    back = interop.read_video(path)
    assert back.shape == (9, 32, 48, 3) and back.dtype == np.uint8
    assert np.abs(back / 255 - frames).mean() < MAE_CRF10
    # frame selection reads the same decoded frames
    np.testing.assert_array_equal(interop.read_video(path, num_frames=3, start=1, stride=3),
                                  back[1:8:3])
    np.testing.assert_array_equal(interop.read_video(path, start=4), back[4:])
    import av
    with av.open(str(path)) as container:
        assert container.streams.video[0].average_rate == 8
    # uint8 frames are written as they are
    interop.write_video(back, tmp_path / "again.mp4", crf=10)
    assert np.abs(interop.read_video(tmp_path / "again.mp4") / 255 - frames).mean() < MAE_CRF10


def test_resize_on_read_equals_resize_in_conversion(tmp_path):
    path = tmp_path / "clip.mp4"
    interop.write_video(smooth(5, 32, 48), path)
    small = interop.read_video(path, size=(16, 24))
    assert small.shape == (5, 16, 24, 3) and small.dtype == np.uint8
    np.testing.assert_array_equal(interop.frames_to_video(small),
                                  interop.frames_to_video(interop.read_video(path), size=(16, 24)))


# -- conversions -------------------------------------------------------------------------


def test_frames_to_video_values():
    levels = np.arange(256, dtype=np.uint8)
    frames = np.broadcast_to(levels[None, :, None, None], (2, 256, 2, 3))
    video = interop.frames_to_video(frames)
    assert video.shape == (3, 2, 256, 2) and video.dtype == np.float32
    # diffusers: np.array(image).astype(float32) / 255, then 2 * x - 1 (float32 each step)
    expected = np.float32(2) * (levels.astype(np.float32) / np.float32(255)) - np.float32(1)
    np.testing.assert_array_equal(video[1, 0, :, 0], expected)
    np.testing.assert_allclose(video[1, 0, :, 0], 2 * np.arange(256) / 255 - 1, rtol=0, atol=1e-7)
    assert video[0, 0, 0, 0] == -1 and video[0, 0, 255, 0] == 1
    # float frames in [0, 1]: 2 x - 1; channels move first
    floats = smooth(3, 4, 6)
    np.testing.assert_allclose(interop.frames_to_video(floats),
                               (2 * floats - 1).transpose(3, 0, 1, 2), rtol=0, atol=1e-7)


def test_video_to_frames_values():
    values = np.array([-3.0, -1.0, -0.5, 0.0, 0.25, 1.0, 2.0], np.float32)
    video = np.broadcast_to(values[None, None, None, :], (3, 2, 1, 7))
    frames = interop.video_to_frames(jnp.asarray(video))
    assert frames.shape == (2, 1, 7, 3) and frames.dtype == np.float32
    np.testing.assert_array_equal(frames[0, 0, :, 0], [0.0, 0.0, 0.25, 0.5, 0.625, 1.0, 1.0])
    # the two conversions invert each other on frames in [0, 1]
    floats = smooth(3, 4, 6).astype(np.float32)
    np.testing.assert_allclose(interop.video_to_frames(interop.frames_to_video(floats)), floats,
                               rtol=0, atol=1e-7)
    # a bfloat16 VAE's output (NumPy does not count bfloat16 as floating): as float32
    half = interop.video_to_frames(jnp.asarray(video, jnp.bfloat16))
    assert half.dtype == np.float32
    np.testing.assert_array_equal(half, frames)


def test_resize_keeps_a_constant_frame():
    frames = np.full((2, 10, 14, 3), 0.25)
    video = interop.frames_to_video(frames, size=(8, 16))
    assert video.shape == (3, 2, 8, 16)
    np.testing.assert_allclose(video, -0.5, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(interop.frames_to_video(np.full((1, 10, 14, 3), 77, np.uint8),
                                                          size=(8, 16)),
                                  interop.frames_to_video(np.full((1, 8, 16, 3), 77, np.uint8)))


# -- bad inputs --------------------------------------------------------------------------


def _bad_frames():
    nan = np.full((2, 4, 4, 3), 0.5)
    nan[1, 2, 2, 0] = np.nan
    return [
        (np.zeros((4, 4, 3)), r"rank 4.*shape \(4, 4, 3\)"),
        (np.zeros((2, 4, 4, 4)), r"3 channels.*shape \(2, 4, 4, 4\)"),
        (np.zeros((0, 4, 4, 3)), r"not be empty"),
        (nan, r"finite; received 1 NaN"),
        (np.zeros((2, 4, 4, 3), np.int32), r"uint8 or floating"),
        ("frames", r"an array \(F, H, W, 3\); received str"),
    ]


@pytest.mark.parametrize("frames, match", _bad_frames())
def test_bad_frames(tmp_path, frames, match):
    with pytest.raises(ValueError, match="write_video: `frames`.*" + match):
        interop.write_video(frames, tmp_path / "x.mp4")
    with pytest.raises(ValueError, match="frames_to_video: `frames`.*" + match):
        interop.frames_to_video(frames)


def test_bad_arguments(tmp_path):
    frames = np.zeros((2, 4, 4, 3), np.uint8)
    with pytest.raises(ValueError, match=r"even height and width.*shape \(2, 5, 4, 3\)"):
        interop.write_video(np.zeros((2, 5, 4, 3), np.uint8), tmp_path / "x.mp4")
    with pytest.raises(ValueError, match="`fps` must be a positive number; received 0"):
        interop.write_video(frames, tmp_path / "x.mp4", fps=0)
    with pytest.raises(ValueError, match="`crf` must be None or an int"):
        interop.write_video(frames, tmp_path / "x.mp4", crf=-1)
    with pytest.raises(ValueError, match=r"float `frames` must be in \[0, 1\]; received values "
                                         r"in \[-1.0, 1.0\]"):
        interop.frames_to_video(np.linspace(-1, 1, 48).reshape(1, 4, 4, 3))
    with pytest.raises(ValueError, match=r"`size` must be None or \(height, width\)"):
        interop.frames_to_video(frames, size=(4,))
    with pytest.raises(ValueError, match=r"video_to_frames: `video` must have 3 channels on "
                                         r"its first axis, \(3, F, H, W\); received shape "
                                         r"\(2, 4, 4, 3\)"):
        interop.video_to_frames(np.zeros((2, 4, 4, 3), np.float32))
    with pytest.raises(ValueError, match="video_to_frames: `video` must be finite"):
        interop.video_to_frames(np.full((3, 1, 2, 2), np.inf, np.float32))
    path = tmp_path / "clip.mp4"
    interop.write_video(frames, path)
    for kwargs, match in [(dict(num_frames=0), "`num_frames` must be None or an int >= 1"),
                          (dict(start=-1), "`start` must be an int >= 0"),
                          (dict(stride=0), "`stride` must be an int >= 1"),
                          (dict(size=(0, 4)), "`size` must be None"),
                          (dict(num_frames=3), "has 2 frames; 3 frames from frame 0"),
                          (dict(start=2), "has 2 frames; every frame from frame 2")]:
        with pytest.raises(ValueError, match=r"read_video: .*" + match):
            interop.read_video(path, **kwargs)
    with pytest.raises(FileNotFoundError, match="read_video: no file"):
        interop.read_video(tmp_path / "missing.mp4")


def test_fragmented_writer_plays_while_written(tmp_path):
    """`VideoWriter(fragmented=True)` (`vidax-generate --stream`): after each `write`, a
    copy of the file (what a player, or the file left by a killed process, holds) reads
    back every frame written but the last one; closed, all of them. Without it nothing
    reads before the file is closed. A container other than MP4 / MOV is refused."""
    chunks = [np.round(smooth(5, 32, 48, phase=i) * 255).astype(np.uint8) for i in range(3)]
    for fragmented in (True, False):
        path, seen = tmp_path / f"stream_{fragmented}.mp4", []
        with interop.VideoWriter(path, fps=16, fragmented=fragmented) as writer:
            for frames in chunks:
                writer.write(frames)
                copy = tmp_path / "copy.mp4"
                copy.write_bytes(path.read_bytes() if path.exists() else b"")
                try:
                    seen.append(len(interop.read_video(copy)))
                except Exception:  # av's InvalidDataError, or no frame at all
                    seen.append(0)
        assert seen == ([4, 9, 14] if fragmented else [0, 0, 0]), (fragmented, seen)
        back = interop.read_video(path)
        assert back.shape == (15, 32, 48, 3)
        assert np.abs(back / 255 - np.concatenate(chunks) / 255).mean() < 0.05
    assert b"moof" in (tmp_path / "stream_True.mp4").read_bytes()  # the fragments' boxes
    with pytest.raises(ValueError, match=r"VideoWriter: `fragmented` writes MP4's fragments: "
                                         r"`path` must end in \.mp4 or \.mov; received"):
        interop.VideoWriter(tmp_path / "x.mkv", fragmented=True)


def test_without_pyav_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    with pytest.raises(ImportError, match=r"pip install av pillow \(or pip install "
                                          r"'\.\[video\]' in a clone of vidax_eqx\)"):
        interop.write_video(np.zeros((1, 2, 2, 3), np.uint8), tmp_path / "x.mp4")
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ImportError, match=r"Pillow.*pip install av pillow \(or pip install "
                                          r"'\.\[video\]' in a clone"):
        interop.frames_to_video(np.zeros((1, 2, 2, 3), np.uint8), size=(4, 4))


# -- scripts/encode_dataset.py -----------------------------------------------------------


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """Two clips of 32 x 64 pixels: 7 frames (5 are encoded) and 5 frames."""
    folder = tmp_path_factory.mktemp("clips")
    interop.write_video(smooth(7, 32, 64), folder / "a.mp4", fps=12)
    interop.write_video(smooth(5, 32, 64, phase=0.5), folder / "b.mp4", fps=16)
    (folder / "notes.txt").write_text("not a clip")
    return folder


@pytest.fixture(scope="module")
def expected(clips, vae):
    """`WanVAE.encode` of the first 5 frames of each clip, read as the script reads them."""
    out = {}
    for name in ("a", "b"):
        video = interop.frames_to_video(interop.read_video(clips / f"{name}.mp4")[:5])
        post = vae.encode(jnp.asarray(video))
        out[name] = np.asarray(post.mean), np.asarray(post.logvar)
    return out


@pytest.fixture(scope="module")
def encode_dataset():
    return _load("encode_dataset", "scripts", "encode_dataset.py")


@pytest.mark.parametrize("mode", [[], ["--spatial", "2", "4", "--chunk", "2"]],
                         ids=["data_parallel", "spatial_2x4"])
def test_encode_dataset(tmp_path, clips, expected, encode_dataset, capsys, mode):
    out = tmp_path / "latents"
    encode_dataset.main([str(clips), "--vae", VAE, "--out", str(out), *mode])
    printed = capsys.readouterr().out
    assert "[1/2] a.mp4: 5 frames 32x64 -> (4, 2, 4, 8)" in printed, printed
    assert "[2/2] b.mp4" in printed and "done        2 clips" in printed
    assert sorted(os.listdir(out)) == ["a.safetensors", "b.safetensors"]
    for name, fps in (("a", "12"), ("b", "16")):
        tensors = interop.open_safetensors(out / f"{name}.safetensors")
        mean, logvar = expected[name]
        np.testing.assert_allclose(tensors["mean"], mean, rtol=0, atol=1e-5)
        np.testing.assert_allclose(tensors["logvar"], logvar, rtol=0, atol=1e-5)
        meta = tensors.metadata
        assert meta["source"] == str(clips / f"{name}.mp4")
        assert (meta["frames"], meta["fps"], meta["height"], meta["width"]) == ("5", fps, "32", "64")
        assert json.loads(meta["vae_config"])["z_dim"] == 4


def test_encode_dataset_errors(tmp_path, clips, encode_dataset):
    with pytest.raises(SystemExit, match=r"--num-frames must be 1 \+ 4k .* received 6: use 5 or 9"):
        encode_dataset.main([str(clips), "--vae", VAE, "--num-frames", "6"])
    with pytest.raises(SystemExit, match=r"--num-frames 9: read_video: .*a.mp4. has 7 frames"):
        encode_dataset.main([str(clips), "--vae", VAE, "--num-frames", "9", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="multiples of 8. Resize with --height and --width"):
        encode_dataset.main([str(clips), "--vae", VAE, "--height", "20", "--width", "64",
                             "--out", str(tmp_path)])


# -- examples/generate_wan.py --video, without torch -------------------------------------


def test_generate_wan_video_without_torch(tmp_path, vae, monkeypatch):
    """The tiny transformer (4 latent channels) and the tiny Wan 2.1 VAE (z_dim 4):
    `--video` writes 5 frames of 32 x 48, the decode of the written latents."""
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` would raise
    example = _load("generate_wan", "examples", "generate_wan.py")
    rng = np.random.default_rng(0)
    embeddings = tmp_path / "embeddings.safetensors"
    interop.write_checkpoint(tmp_path, {
        "prompt_embeds": rng.standard_normal((7, 32)).astype(np.float32),
        "negative_prompt_embeds": rng.standard_normal((7, 32)).astype(np.float32)},
        name="embeddings")
    out, video = tmp_path / "latents.npy", tmp_path / "out.mp4"
    example.main(["--checkpoint", TRANSFORMER, "--embeddings", str(embeddings), "--steps", "2",
                  "--frames", "5", "--height", "32", "--width", "48", "--output", str(out),
                  "--video", str(video), "--vae", VAE, "--fps", "8"])
    latents = np.load(out)
    assert latents.shape == (1, 4, 2, 4, 6)
    frames = interop.read_video(video)
    assert frames.shape == (5, 32, 48, 3)
    decoded = vae.decode(vae.denormalize_latents(jnp.asarray(latents[0])))
    reference = interop.video_to_frames(decoded)
    # random weights give a busy picture: a looser bound than the smooth pattern's
    assert np.abs(frames / 255 - reference).mean() < 0.05
    np.testing.assert_array_equal(example.decode_video(VAE, latents)[0],
                                  np.round(reference * 255).astype(np.uint8))
