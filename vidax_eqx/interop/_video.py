"""Pixels in and out around a video VAE: `.mp4` files read and written through PyAV, and
frames `(F, H, W, 3)` to and from the VAE's layout `(3, F, H, W)` in [-1, 1].

Everything here is NumPy on the host; PyAV (`av`) and, to resize, Pillow are imported
only by the functions that need them (`pip install av pillow`, or `pip install '.[video]'`
in a clone of vidax_eqx).
"""

import fractions
import os

import ml_dtypes
import numpy as np

from .._checks import is_int, is_real


_INSTALL = "pip install av pillow (or pip install '.[video]' in a clone of vidax_eqx)"


def _import_av(owner: str):
    try:
        import av
    except ImportError as e:
        raise ImportError(f"{owner} reads and writes video files through PyAV (the `av` "
                          f"package), which is not installed: {_INSTALL}.") from e
    return av


def _import_pil(owner: str):
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError(f"{owner}: resizing (`size=`) goes through Pillow, which is not "
                          f"installed: {_INSTALL}.") from e
    return Image


def _received(x) -> str:
    shape = getattr(x, "shape", None)
    if shape is None:
        return type(x).__name__
    return f"shape {tuple(shape)}, dtype {getattr(x, 'dtype', '?')}"


def _extended_float(dtype) -> bool:
    """Whether `dtype` is one of JAX's floating types NumPy does not count as floating
    (bfloat16, the float8 types: `ml_dtypes`')."""
    try:
        ml_dtypes.finfo(dtype)
    except (TypeError, ValueError):
        return False
    return True


def _as_array(owner: str, name: str, x, layout: str) -> np.ndarray:
    """`x` as a NumPy array of rank 4, non-empty, uint8 or floating and finite."""
    if getattr(x, "shape", None) is None and not isinstance(x, (list, tuple)):
        raise ValueError(f"{owner}: `{name}` must be an array {layout}; received {_received(x)}.")
    try:
        a = np.asarray(x)
    except Exception as e:  # a ragged list, ...
        raise ValueError(f"{owner}: `{name}` must be an array {layout}; received "
                         f"{type(x).__name__} that NumPy cannot read as one ({e}).") from e
    if a.ndim != 4:
        raise ValueError(f"{owner}: `{name}` must have rank 4, {layout}; received "
                         f"{_received(a)}.")
    if a.size == 0:
        raise ValueError(f"{owner}: `{name}` must not be empty ({layout}); received "
                         f"{_received(a)}.")
    if a.dtype != np.uint8 and not np.issubdtype(a.dtype, np.floating):
        if not _extended_float(a.dtype):
            raise ValueError(f"{owner}: `{name}` must be uint8 or floating; received {_received(a)}.")
        a = a.astype(np.float32)  # bfloat16 and the float8 types: as float32
    if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
        bad = int(np.size(a) - np.count_nonzero(np.isfinite(a)))
        raise ValueError(f"{owner}: `{name}` must be finite; received {bad} NaN or infinite "
                         f"values ({_received(a)}).")
    return a


def _check_frames(owner: str, frames) -> np.ndarray:
    a = _as_array(owner, "frames", frames, "(F, H, W, 3)")
    if a.shape[-1] != 3:
        raise ValueError(f"{owner}: `frames` must have 3 channels (RGB) on its last axis, "
                         f"(F, H, W, 3); received {_received(a)}.")
    return a


def _check_size(owner: str, size) -> tuple[int, int] | None:
    if size is None:
        return None
    if (not isinstance(size, (tuple, list)) or len(size) != 2
            or not all(is_int(s) and s >= 1 for s in size)):
        raise ValueError(f"{owner}: `size` must be None or (height, width), two ints >= 1; "
                         f"received {size!r}.")
    return int(size[0]), int(size[1])


def _to_uint8(frames: np.ndarray) -> np.ndarray:
    """Float frames in [0, 1] (clipped) as uint8: `round(x * 255)`."""
    if frames.dtype == np.uint8:
        return frames
    return np.round(np.clip(frames, 0.0, 1.0) * 255).astype(np.uint8)


def _resize(owner: str, frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Each frame resized to `size` (height, width) with Pillow's Lanczos filter: uint8
    frames as RGB images (Pillow rounds and clips to uint8), float frames channel by
    channel in 32-bit float, clipped to [0, 1] after (the filter overshoots)."""
    if frames.shape[1:3] == size:
        return frames
    Image = _import_pil(owner)
    lanczos = Image.Resampling.LANCZOS
    h, w = size
    if frames.dtype == np.uint8:
        return np.stack([np.asarray(Image.fromarray(f).resize((w, h), resample=lanczos))
                         for f in frames])
    out = np.empty((frames.shape[0], h, w, 3), np.float32)
    for i, f in enumerate(frames.astype(np.float32)):
        for c in range(3):
            out[i, :, :, c] = np.asarray(Image.fromarray(np.ascontiguousarray(f[:, :, c]))
                                         .resize((w, h), resample=lanczos))
    return np.clip(out, 0.0, 1.0)


def write_video(frames, path, *, fps: float = 16, codec: str = "libx264",
                crf: int | None = 18) -> None:
    """Writes frames to a video file (`.mp4`) through PyAV, in 4:2:0 YUV.

    **Arguments:**

    - `frames`: `(F, H, W, 3)` RGB, uint8, or float in [0, 1]: clipped to [0, 1] and
        rounded, `round(x * 255)` (as diffusers' `VaeImageProcessor.numpy_to_pil`;
        diffusers' `export_to_video` truncates instead, `(x * 255).astype(uint8)`).
        A NumPy or JAX array. `H` and `W` must be even (4:2:0 chroma).
    - `path`: the file; its extension picks the container (`.mp4`, `.mkv`, ...).
    - `fps`: frames per second (Wan's videos: 16).
    - `codec`: an FFmpeg encoder (`"libx264"`, `"libx265"`, `"mpeg4"`, ...).
    - `crf`: the constant rate factor of x264 / x265 (0 lossless in luma, 18 close to
        visually lossless, 23 their default); `None` leaves the codec's default.

    **Raises:**

    `ValueError` for frames that are not `(F, H, W, 3)`, empty, not finite, or of odd
    height or width; `ImportError` without PyAV (`pip install av`).
    """
    owner = "write_video"
    frames = _even_frames(owner, frames)
    _check_encoding(owner, fps, codec, crf)
    with VideoWriter(path, fps=fps, codec=codec, crf=crf) as writer:
        writer.write(frames)


def _even_frames(owner: str, frames) -> np.ndarray:
    """`frames` checked (`_check_frames`) and of even height and width."""
    frames = _check_frames(owner, frames)
    if frames.shape[1] % 2 or frames.shape[2] % 2:
        raise ValueError(f"{owner}: `frames` must have an even height and width (the 4:2:0 "
                         f"chroma of .mp4 players halves both); received {_received(frames)}. "
                         "Crop or pad a row or column.")
    return frames


def _check_encoding(owner: str, fps, codec, crf) -> None:
    if not is_real(fps) or not fps > 0 or not np.isfinite(fps):
        raise ValueError(f"{owner}: `fps` must be a positive number; received {fps!r}.")
    if not isinstance(codec, str) or not codec:
        raise ValueError(f"{owner}: `codec` must be an FFmpeg encoder's name, e.g. 'libx264'; "
                         f"received {codec!r}.")
    if crf is not None and (not is_int(crf) or not 0 <= crf <= 63):
        raise ValueError(f"{owner}: `crf` must be None or an int in [0, 63] (x264: 0 to 51); "
                         f"received {crf!r}.")


# The containers `VideoWriter(fragmented=True)` writes (FFmpeg's mov muxer).
_FRAGMENTED = (".mp4", ".mov")


class VideoWriter:
    """A video file written as its frames come (streaming generation: the first frames
    are on disk before the last exist), through PyAV in 4:2:0 YUV; what
    [`write_video`][vidax_eqx.interop.write_video] writes in one call.

        with VideoWriter("out.mp4", fps=16) as writer:
            for frames in chunks:          # (F, H, W, 3) each
                writer.write(frames)

    **Arguments:** `path`, `fps`, `codec`, `crf` as [`write_video`][vidax_eqx.interop.write_video]'s,
    and `fragmented`: write a fragmented MP4 (`.mp4` or `.mov`; FFmpeg's `movflags`
    `frag_every_frame+empty_moov+default_base_moof`, each packet flushed to the file, and
    x264's and x265's `tune=zerolatency`: no frame held back by the encoder), which plays
    up to the frames written so far, all but the last `write`'s last frame, also while it
    is written or after the process writing it was killed. Without it the file plays
    once it is closed.

    Every chunk must have the first one's height and width (even). Each `write` encodes
    and writes its frames; `close` (the `with` block's end) flushes the encoder.
    """

    def __init__(self, path, *, fps: float = 16, codec: str = "libx264", crf: int | None = 18,
                 fragmented: bool = False):
        owner = "VideoWriter"
        _check_encoding(owner, fps, codec, crf)
        path = os.fspath(path)
        if not isinstance(fragmented, bool):
            raise ValueError(f"{owner}: `fragmented` must be a bool; received {fragmented!r}.")
        if fragmented and not path.lower().endswith(_FRAGMENTED):
            raise ValueError(f"{owner}: `fragmented` writes MP4's fragments: `path` must end in "
                             f"{' or '.join(_FRAGMENTED)}; received {path!r}.")
        self._av = _import_av(owner)
        self._container = self._av.open(path, mode="w", container_options=dict(
            movflags="frag_every_frame+empty_moov+default_base_moof", flush_packets="1")
            if fragmented else None)
        options = {} if crf is None else {"crf": str(int(crf))}
        if fragmented and codec in ("libx264", "libx265"):
            options["tune"] = "zerolatency"  # no lookahead: each frame out as it goes in
        rate = fractions.Fraction(fps).limit_denominator(1001)
        self._stream = self._container.add_stream(codec, rate=rate, options=options)
        self._stream.pix_fmt = "yuv420p"
        self._size = None
        self.frames = 0  # written so far

    def write(self, frames) -> None:
        """Encodes and writes `frames` `(F, H, W, 3)` (uint8, or float in [0, 1])."""
        owner = "VideoWriter.write"
        if self._container is None:
            raise ValueError(f"{owner}: the writer is closed.")
        frames = _even_frames(owner, frames)
        if self._size is None:
            self._size = frames.shape[1:3]
            self._stream.height, self._stream.width = self._size
        elif frames.shape[1:3] != self._size:
            raise ValueError(f"{owner}: every chunk must be {self._size[0]} x {self._size[1]} (the "
                             f"first chunk's); received {_received(frames)}.")
        for frame in _to_uint8(frames):
            self._container.mux(self._stream.encode(self._av.VideoFrame.from_ndarray(frame, format="rgb24")))
        self.frames += frames.shape[0]

    def close(self) -> None:
        """Flushes the encoder and closes the file (once; later calls do nothing)."""
        if self._container is None:
            return
        try:
            if self._size is not None:
                self._container.mux(self._stream.encode())  # flush the encoder
        finally:
            self._container.close()
            self._container = None

    def __enter__(self) -> "VideoWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_video(path, *, num_frames: int | None = None, start: int = 0, stride: int = 1,
               size: tuple[int, int] | None = None) -> np.ndarray:
    """Reads frames of a video file through PyAV, as RGB uint8.

    **Arguments:**

    - `path`: the file (`.mp4`, `.mkv`, `.webm`, ...; its first video stream).
    - `num_frames`: how many frames to return (`None`: every frame from `start`); a file
        with fewer is refused.
    - `start`: the first frame's index.
    - `stride`: keep one frame in `stride` (2: every other frame).
    - `size`: `(height, width)` to resize each frame to, as
        [`frames_to_video`][vidax_eqx.interop.frames_to_video] does (Pillow's Lanczos);
        `None` keeps the file's size.

    **Returns:**

    The frames `(F, H, W, 3)`, uint8 NumPy.
    """
    owner = "read_video"
    if num_frames is not None and (not is_int(num_frames) or num_frames < 1):
        raise ValueError(f"{owner}: `num_frames` must be None or an int >= 1; received "
                         f"{num_frames!r}.")
    if not is_int(start) or start < 0:
        raise ValueError(f"{owner}: `start` must be an int >= 0; received {start!r}.")
    if not is_int(stride) or stride < 1:
        raise ValueError(f"{owner}: `stride` must be an int >= 1; received {stride!r}.")
    size = _check_size(owner, size)
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{owner}: no file {path!r}.")
    av = _import_av(owner)
    frames, seen = [], 0
    with av.open(path) as container:
        if not container.streams.video:
            raise ValueError(f"{owner}: {path!r} has no video stream.")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for frame in container.decode(stream):
            i, seen = seen, seen + 1
            if i < start or (i - start) % stride:
                continue
            frames.append(frame.to_ndarray(format="rgb24"))
            if num_frames is not None and len(frames) == num_frames:
                break
    wanted = "every frame" if num_frames is None else f"{num_frames} frames"
    if not frames or num_frames is not None and len(frames) < num_frames:
        raise ValueError(f"{owner}: {path!r} has {seen} frames; {wanted} from frame {start} "
                         f"every {stride} asks for more. Ask for fewer frames or an earlier "
                         "`start`.")
    out = np.stack(frames)
    return out if size is None else _resize(owner, out, size)


def video_to_frames(video) -> np.ndarray:
    """The VAE's video as frames for [`write_video`][vidax_eqx.interop.write_video]:
    `(3, F, H, W)` in [-1, 1] to `(F, H, W, 3)` float32 in [0, 1], as diffusers'
    pipelines: `(video / 2 + 0.5).clamp(0, 1)` in float32.

    **Arguments:**

    - `video`: one video `(3, F, H, W)`, floating (a NumPy or JAX array; a JAX array
        placed over a mesh is gathered).

    **Returns:**

    The frames `(F, H, W, 3)`, float32 NumPy in [0, 1].
    """
    owner = "video_to_frames"
    video = _as_array(owner, "video", video, "(3, F, H, W)")
    if video.shape[0] != 3:
        raise ValueError(f"{owner}: `video` must have 3 channels on its first axis, "
                         f"(3, F, H, W); received {_received(video)}.")
    if video.dtype == np.uint8:
        raise ValueError(f"{owner}: `video` must be floating, in [-1, 1] (the VAE's output); "
                         f"received {_received(video)}.")
    video = video.astype(np.float32)
    return np.ascontiguousarray(np.clip(video / 2 + 0.5, 0.0, 1.0).transpose(1, 2, 3, 0))


def frames_to_video(frames, *, size: tuple[int, int] | None = None) -> np.ndarray:
    """Frames as the VAE's video: `(F, H, W, 3)` to `(3, F, H, W)` float32 in [-1, 1], as
    diffusers' `VideoProcessor.preprocess_video` prepares a video for Wan's encoder.

    uint8 frames become `2 * (x / 255) - 1` in float32 (diffusers' `pil_to_numpy` then
    `normalize`); float frames in [0, 1] become `2 * x - 1`.

    With `size = (height, width)`, each frame is first resized with Pillow's Lanczos
    filter, stretched to the size without keeping the aspect ratio or cropping: what
    diffusers' `VideoProcessor(vae_scale_factor=s)` does to the PIL frames that its
    `load_video` returns (`resize_mode="default"`, `resample="lanczos"`). uint8 frames
    are resized as RGB images, rounded to uint8 (bit-identical to diffusers for the same
    Pillow); float frames channel by channel in float32, clipped to [0, 1]. diffusers
    also rounds `height` and `width` down to multiples of the VAE's spatial factor `s`
    (8 for Wan 2.1's VAE, 16 for Wan 2.2's); here `size` is used as given, and the VAE
    refuses a size that is not such a multiple.

    **Arguments:**

    - `frames`: `(F, H, W, 3)` RGB, uint8 or float in [0, 1] (NumPy or JAX).
    - `size`: `(height, width)` to resize to, or `None`.

    **Returns:**

    The video `(3, F, H, W)`, float32 NumPy in [-1, 1]: the input of
    `WanVAE.encode`.
    """
    owner = "frames_to_video"
    frames = _check_frames(owner, frames)
    size = _check_size(owner, size)
    if frames.dtype != np.uint8:
        lo, hi = float(frames.min()), float(frames.max())
        if lo < 0 or hi > 1:
            raise ValueError(f"{owner}: float `frames` must be in [0, 1]; received values in "
                             f"[{lo}, {hi}] ({_received(frames)}). A video already in [-1, 1] "
                             "needs no conversion; uint8 frames are scaled by 1 / 255.")
    if size is not None:
        frames = _resize(owner, frames, size)
    x = frames.astype(np.float32)
    if frames.dtype == np.uint8:
        x = x / np.float32(255)
    return np.ascontiguousarray((np.float32(2) * x - np.float32(1)).transpose(3, 0, 1, 2))
