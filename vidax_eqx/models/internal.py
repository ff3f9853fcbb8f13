"""The internals of [`vidax_eqx.models`][] that the floors above it (`sampling`) build
with: the one documented door into `models`' private modules. Not part of the public API.

- `signature`, `mismatch`, `pack`, `unpack`: the export format of
    [`vidax_eqx.models.export`][] (a call's signature of static and array arguments,
    the message naming where two signatures differ, and the serialized bytes with their
    settings), which the exported sampler reuses.
- `vae_program`: a VAE's encode or decode body as a `jax.jit` function of abstract
    arguments, for the memory benchmark (`benchmarks/vae_memory.py`).
- `require_capability`: raises `NotImplementedError` in one line naming a model and a
    capability its class's [`Capabilities`][vidax_eqx.models.Capabilities] record
    lacks.
- `vae_jit`: `eqx.filter_jit` with the VAEs' compile options for the platform of the
    call (a lower XLA optimization effort on a TPU), for programs around a VAE's calls
    (the streaming pipeline's decode).
- `quantize_to`: a transformer in the int8 format a `quantize=` option names (`None`:
    as it is), one already in that format (an int8 checkpoint) as it is; the pipelines'
    `from_pretrained(quantize=)`.
- `HostWords`, `pack_int8`, `packable`: a streamed block's int8 matrix held in host
    memory as 32-bit words (the layout a TPU copies one layer of in), unpacked by the
    blocks' scan; the memory plan's streamed placement.
"""

from ._capabilities import require as require_capability
from ._quantize import quantize_to as quantize_to
from ._layers import HostWords as HostWords, pack_int8 as pack_int8, packable as packable
from ._export import mismatch as mismatch, pack as pack, signature as signature, unpack as unpack
from ._vae import vae_jit as vae_jit, vae_program as vae_program
