"""Weight import: PyTorch-style state dicts and `.safetensors` files <-> Equinox modules.

Names follow the PyTorch reference models, in Wan's naming (`q, k, v, o`) or
diffusers' (`to_q, to_k, to_v, to_out.0`). `.safetensors` files are read and written by
Hugging Face's `safetensors` library: no pickle, nothing executed, nothing allocated for
what a header claims, every header field checked before any tensor data is read. A model
placed on a mesh (FSDP, Megatron) loads from the blocks each process's devices hold,
reading only those bytes. Checkpoints may also be named by a Hugging Face Hub
repository id (`resolve_checkpoint`, and a whole diffusers pipeline by
`resolve_pipeline`; `huggingface_hub` is optional). Video files go in
and out as frames (`read_video`, `write_video`, `VideoWriter` as they come; PyAV is
optional), converted to and from the VAEs' layout by `frames_to_video` and `video_to_frames`. Prompts become token ids
and masks as transformers' tokenizers give them (`TextTokenizer`, over the `tokenizers`
library; `prompt_clean`, diffusers' cleaning), without torch or transformers.
"""

from ._checkpoint import (
    open_checkpoint as open_checkpoint,
    open_safetensors as open_safetensors,
    SafetensorsShards as SafetensorsShards,
    write_checkpoint as write_checkpoint,
)
from ._hub import resolve_checkpoint as resolve_checkpoint, resolve_pipeline as resolve_pipeline
from ._safetensors import MAX_HEADER_BYTES as MAX_HEADER_BYTES, SafetensorsFile as SafetensorsFile
from ._lora import (
    LORA_FILE as LORA_FILE,
    LORA_LAYOUTS as LORA_LAYOUTS,
    LoRAFile as LoRAFile,
    LoRATensors as LoRATensors,
    read_lora as read_lora,
    write_lora as write_lora,
)
from ._naming import linear_layers as linear_layers, LinearName as LinearName, NAMINGS as NAMINGS
from ._state_dict import (
    ABSTRACT as ABSTRACT,
    loading as loading,
    load_state_dict as load_state_dict,
    save_safetensors as save_safetensors,
    state_dict as state_dict,
)
from ._video import (
    frames_to_video as frames_to_video,
    read_video as read_video,
    video_to_frames as video_to_frames,
    VideoWriter as VideoWriter,
    write_video as write_video,
)
from ._tokenizer import prompt_clean as prompt_clean, TextTokenizer as TextTokenizer
