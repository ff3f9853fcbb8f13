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

__version__ = "0.1.0"
