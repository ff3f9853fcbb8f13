"""vidax_eqx: attention and normalization layers for video diffusion transformers."""

from . import core as core, interop as interop, kernels as kernels, nn as nn, parallel as parallel
from .kernels import SegmentIds as SegmentIds

__version__ = "0.1.0"
