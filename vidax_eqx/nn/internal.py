"""The internals of [`vidax_eqx.nn`][] that the floors above it (`models`, `sampling`)
build with: the one documented door into `nn`'s private modules, as `equinox.internal`
is Equinox's. Not part of the public API: names here may change without notice.

- `init`: the parameter initializers every module and model draws through (host-side
    NumPy for a concrete key, `jax.random` when traced): `split`, `fold_in`, `normal`,
    `uniform`, `zeros`, `ones`, `full`, `linear`, `stacked`, `jax_init`.
- `linear`: an `eqx.nn.Linear` (or `LoRALinear`) applied to tokens on their last axis.
- `check_text`: the check that a text input is whole and the same on every device of a
    layer's sequence and tensor-parallel axes.
- `has_shards`, `regather_policy`: FSDP under a scan of stacked blocks (whether weights
    are still split; the rematerialization policy that gathers them again).
- `attach`: a `LoRALinear` with one more named adapter.
- `padded_tokens`, `sequence_multiple`: a model's token split (padded to the devices,
    the padding's segment ids) under a `ParallelConfig`.
- `with_quantized_attention`: every `Attention` of a PyTree in an int8 `quantize=` mode
    (`models.quantize(..., attention=)`).
"""

from . import _init as init
from .sharding._call_checks import check_text as check_text
from .sharding._fsdp import has_shards as has_shards, regather_policy as regather_policy
from ._layers import linear as linear
from ._lora import attach as attach
from ._self_attention import with_quantized_attention as with_quantized_attention
from .sharding._tokens import padded_tokens as padded_tokens, sequence_multiple as sequence_multiple
