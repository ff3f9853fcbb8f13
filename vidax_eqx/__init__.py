"""vidax_eqx: attention and normalization layers for video diffusion transformers."""

from . import (
    core as core, interop as interop, kernels as kernels, nn as nn, parallel as parallel,
    ring_splash as ring_splash,
)
from ._shapes import (
    set_shape_checks as set_shape_checks,
    shape_checks_enabled as shape_checks_enabled,
    ShapeError as ShapeError,
)
from .kernels import SegmentIds as SegmentIds

# The one place the version is written: pyproject.toml reads it (`dynamic = ["version"]`);
# CHANGELOG.md says what each version changed.
__version__ = "0.2.0"
