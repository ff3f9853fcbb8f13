"""Images to the CLIP vision encoder's `pixel_values`: transformers' `CLIPImageProcessor`
(its Pillow backend) in NumPy, read from a pipeline's `image_processor/` folder.

Pillow is imported only when an image is processed (`pip install 'vidax_eqx[video]'`).
"""

import dataclasses
import json
import os

import numpy as np

from ..._checks import is_int, is_real


_INSTALL = "pip install 'vidax_eqx[video]'"
# Pillow's resampling filters by their number (`PIL.Image.Resampling`), as config files
# store them.
_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
# OpenAI CLIP's normalization (transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD).
_MEAN = (0.48145466, 0.4578275, 0.40821073)
_STD = (0.26862954, 0.26130258, 0.27577711)
# Keys of preprocessor_config.json that name classes and change nothing.
_INFORMATIONAL = ("image_processor_type", "feature_extractor_type", "processor_class")


def _import_pil():
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError("CLIPImageProcessor resizes images through Pillow, which is not "
                          f"installed: {_INSTALL}.") from e
    return Image


def _size(name: str, value, shortest_edge: bool) -> dict:
    """`size` / `crop_size` as transformers reads it: `{"shortest_edge": n}` (`size` only,
    also from an int) or `{"height": h, "width": w}` (also from an int, for
    `crop_size`)."""
    if is_int(value):
        value = {"shortest_edge": value} if shortest_edge else {"height": value, "width": value}
    forms = [{"height", "width"}] + ([{"shortest_edge"}] if shortest_edge else [])
    if isinstance(value, dict) and set(value) in forms:
        for key, n in value.items():
            if not is_int(n) or n < 1:
                raise ValueError(f"CLIPImageProcessor: `{name}[{key!r}]` must be a positive "
                                 f"int; received {n!r}.")
        return {k: int(n) for k, n in value.items()}
    expected = ("{'shortest_edge': n} or {'height': h, 'width': w}" if shortest_edge
                else "{'height': h, 'width': w} or an int")
    raise ValueError(f"CLIPImageProcessor: `{name}` must be {expected} (the forms this "
                     f"processor implements); received {value!r}.")


def _triple(name: str, value) -> tuple[float, float, float]:
    if is_real(value):
        value = [value] * 3
    if (not isinstance(value, (list, tuple)) or len(value) != 3
            or not all(is_real(v) for v in value)):
        raise ValueError(f"CLIPImageProcessor: `{name}` must be 3 floats (one per RGB "
                         f"channel) or one; received {value!r}.")
    return tuple(float(v) for v in value)


@dataclasses.dataclass(frozen=True)
class CLIPImageProcessor:
    """transformers' `CLIPImageProcessor`, the `image_processor` of diffusers' Wan 2.1
    I2V / FLF2V pipelines: an RGB image resized (Pillow), center-cropped, rescaled to
    [0, 1] and normalized, as the encoder's `pixel_values` `(3, crop, crop)` float32.

    It reproduces transformers' Pillow backend (`CLIPImageProcessorPil`) bit for bit:
    that is what diffusers' `WanImageToVideoPipeline.from_pretrained` loads as
    `CLIPImageProcessor` when torchvision is not installed. With torchvision installed it
    loads transformers 5's torchvision backend instead, whose antialiased bicubic resize
    of uint8 images rounds in a fixed-point arithmetic of its own: on the test fixture's
    noisy, downscaled images 15% of the values differ, by up to 3 levels of 255 (0.045
    after normalization). Both backends are transformers' `CLIPImageProcessor`; this is
    the Pillow one.

    A plain Python object (not a module); the defaults are transformers' (and Wan's:
    shortest edge 224, bicubic, a 224 x 224 crop, OpenAI CLIP's mean and std).

    **Fields** (preprocessor_config.json's names):

    - `do_resize`, `size`, `resample`: resize so that the shortest edge is
        `size["shortest_edge"]` (the other `int(n * long / short)`), or to
        `size["height"], size["width"]`; `resample` a Pillow filter number (3: bicubic).
    - `do_center_crop`, `crop_size`: the central `crop_size["height"], ["width"]`
        (zero-padded where the image is smaller, as transformers does).
    - `do_rescale`, `rescale_factor`: times `rescale_factor` (1/255), in float64, then
        float32.
    - `do_normalize`, `image_mean`, `image_std`: `(x - mean) / std` per channel, float32.
    - `do_convert_rgb`: a Pillow image converted to RGB first (transparency composited
        onto white).
    """

    do_resize: bool = True
    size: dict = dataclasses.field(default_factory=lambda: {"shortest_edge": 224})
    resample: int = 3
    do_center_crop: bool = True
    crop_size: dict = dataclasses.field(default_factory=lambda: {"height": 224, "width": 224})
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple = _MEAN
    image_std: tuple = _STD
    do_convert_rgb: bool = True

    def __post_init__(self):
        for name in ("do_resize", "do_center_crop", "do_rescale", "do_normalize",
                     "do_convert_rgb"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CLIPImageProcessor: `{name}` must be a bool; received "
                                 f"{getattr(self, name)!r}.")
        checked = {
            "size": _size("size", self.size, shortest_edge=True),
            "crop_size": _size("crop_size", self.crop_size, shortest_edge=False),
            "image_mean": _triple("image_mean", self.image_mean),
            "image_std": _triple("image_std", self.image_std),
        }
        if not is_int(self.resample) or int(self.resample) not in _RESAMPLE:
            raise ValueError(
                "CLIPImageProcessor: `resample` must be a Pillow filter number, one of "
                f"{_RESAMPLE} (3, bicubic, for CLIP); received {self.resample!r}.")
        if not is_real(self.rescale_factor) or not self.rescale_factor > 0:
            raise ValueError("CLIPImageProcessor: `rescale_factor` must be a positive "
                             f"float; received {self.rescale_factor!r}.")
        if not all(s > 0 for s in checked["image_std"]):
            raise ValueError("CLIPImageProcessor: `image_std` must be positive; received "
                             f"{self.image_std!r}.")
        checked.update(resample=int(self.resample), rescale_factor=float(self.rescale_factor))
        for name, value in checked.items():  # normalized (a frozen dataclass)
            object.__setattr__(self, name, value)

    @classmethod
    def from_dict(cls, config: dict) -> "CLIPImageProcessor":
        """The processor of preprocessor_config.json's contents. A key the file omits
        takes transformers' default; class names (`image_processor_type`, ...) are
        ignored; any other key is refused by name (this processor would not apply it)."""
        if not isinstance(config, dict):
            raise ValueError(f"CLIPImageProcessor.from_dict takes a dict; received "
                             f"{type(config).__name__}.")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in config if k not in names and k not in _INFORMATIONAL)
        if unknown:
            raise ValueError(
                f"CLIPImageProcessor: the config has keys this processor does not implement: "
                f"{unknown}; it reads {sorted(names)}.")
        return cls(**{k: v for k, v in config.items() if k in names})

    @classmethod
    def from_pretrained(cls, path, *, subfolder: str | None = None) -> "CLIPImageProcessor":
        """The processor of a directory's preprocessor_config.json (a diffusers
        pipeline's `image_processor/`, or the pipeline's directory with
        `subfolder="image_processor"`), or of that file's path."""
        path = os.fspath(path)
        if subfolder is not None:
            path = os.path.join(path, subfolder)
        if os.path.isdir(path):
            path = os.path.join(path, "preprocessor_config.json")
        if not os.path.isfile(path):
            raise ValueError(
                f"CLIPImageProcessor.from_pretrained: no {path!r}; pass a pipeline's "
                "image_processor/ folder (or the pipeline with subfolder='image_processor').")
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"CLIPImageProcessor.from_pretrained: {path!r} is not valid "
                             f"JSON: {e}") from None
        return cls.from_dict(config)

    def __call__(self, image) -> np.ndarray:
        """**Arguments:**

        - `image`: a Pillow image, a uint8 array `(H, W, 3)` (RGB), or a list of them.

        **Returns:**

        float32 `pixel_values`: `(3, crop_h, crop_w)` for one image (with the crop;
        the resized size without it), `(N, 3, crop_h, crop_w)` for a list of `N`.
        """
        if isinstance(image, (list, tuple)):
            if not image:
                raise ValueError("CLIPImageProcessor: `image` is an empty list; pass at "
                                 "least one image.")
            out = [self._one(im, f"image[{i}]") for i, im in enumerate(image)]
            shapes = {o.shape for o in out}
            if len(shapes) > 1:
                raise ValueError(
                    "CLIPImageProcessor: the images of a list must come out in one shape to "
                    f"be stacked (do_center_crop=False keeps their sizes); they came out as "
                    f"{sorted(shapes)}.")
            return np.stack(out)
        return self._one(image, "image")

    def _one(self, image, name: str) -> np.ndarray:
        Image = _import_pil()
        if isinstance(image, Image.Image):
            if self.do_convert_rgb:
                image = _to_rgb(Image, image)
            array = np.array(image)
        else:  # a NumPy array, or one that converts (a JAX array)
            array = np.asarray(image) if hasattr(image, "__array__") else image
        shape, dtype = getattr(array, "shape", None), getattr(array, "dtype", None)
        if (not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 3
                or array.shape[2] != 3 or 0 in array.shape):
            received = (f"{dtype} {tuple(shape)}" if shape is not None
                        else type(image).__name__)
            raise ValueError(
                f"CLIPImageProcessor: `{name}` must be a Pillow image or a uint8 NumPy "
                f"array (H, W, 3) of RGB values; received {received}. Convert a float "
                "image in [0, 1] with (x * 255).round().astype(np.uint8).")
        if self.do_resize:
            height, width = self._resized(array.shape[:2])
            resized = Image.fromarray(array).resize((width, height), resample=self.resample)
            array = np.array(resized)
        x = np.moveaxis(array, -1, 0)  # (3, H, W)
        if self.do_center_crop:
            x = _center_crop(x, self.crop_size["height"], self.crop_size["width"])
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        x = x.astype(np.float32)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, np.float32)[:, None, None]
            std = np.asarray(self.image_std, np.float32)[:, None, None]
            x = (x - mean) / std
        return np.ascontiguousarray(x)

    def _resized(self, hw: tuple[int, int]) -> tuple[int, int]:
        """transformers' `get_resize_output_image_size(default_to_square=False)`."""
        if "height" in self.size:
            return self.size["height"], self.size["width"]
        height, width = hw
        n = self.size["shortest_edge"]
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(n * long / short)
        return (new_long, n) if width <= height else (n, new_long)


def _to_rgb(Image, image):
    """transformers' `convert_to_rgb`: transparency composited onto white, else
    Pillow's conversion to RGB."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image).convert("RGB")
    return image.convert("RGB")


def _center_crop(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' `center_crop` of `(C, H, W)`: the central window, zero-padded
    (centred, the odd row or column before) where the image is smaller."""
    h, w = x.shape[1:]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return x[:, top:top + height, left:left + width]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros((x.shape[0], new_h, new_w), x.dtype)
    pad_top, pad_left = -(-(new_h - h) // 2), -(-(new_w - w) // 2)
    padded[:, pad_top:pad_top + h, pad_left:pad_left + w] = x
    top, left = top + pad_top, left + pad_left
    return padded[:, max(0, top):min(new_h, top + height), max(0, left):min(new_w, left + width)]
