"""Opening and writing checkpoints: one `.safetensors` file, or several in the Hugging Face
index layout. Pickle-based PyTorch files are refused here, by name, before anything is read.

A large checkpoint is split into shards (`diffusion_pytorch_model-00001-of-00006.safetensors`,
...) listed by `diffusion_pytorch_model.safetensors.index.json`, whose `weight_map`
names each tensor's file. Diffusers and the original Wan releases both use it.
"""

import json
import os
from collections.abc import Iterator, Mapping

import numpy as np

from ._safetensors import SafetensorsFile, write_safetensors


INDEX_SUFFIX = ".safetensors.index.json"
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model"


# Pickle-based PyTorch formats: loading one would run arbitrary code.
_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle")


def open_safetensors(path) -> SafetensorsFile:
    """Opens a `.safetensors` file as a read-only mapping of names to NumPy arrays.

    The file is opened with Hugging Face's `safetensors` library (`safe_open`), which
    validates the whole header before any tensor data is read: a header length within
    `MAX_HEADER_BYTES` and the file, JSON only, known dtypes, shapes that match byte
    lengths, tensors that tile the data exactly (no overlap, gap or truncation). A
    key given twice and dtypes not read here (complex, 4- and 6-bit floats) are refused
    too. A bad file raises `ValueError` naming the file, what it holds and what was
    expected. Tensors are then read one at a time, on access, so a large checkpoint is
    never held in memory whole; `.shape(name)` and `.dtype(name)` answer from the
    header. No pickle, nothing executed.

    A sharded checkpoint is one mapping through
    `collections.ChainMap(*(open_safetensors(p) for p in paths))`.

    **Arguments:**

    - `path`: the file.

    **Returns:**

    A `Mapping[str, numpy.ndarray]` (bfloat16 / float8 as `ml_dtypes` dtypes),
    with a `metadata` dict of the file's `__metadata__` strings.
    """
    text = os.fspath(path)
    if os.path.isdir(text):
        raise ValueError(
            f"`source` {text!r} is a directory; pass one .safetensors file, or for a sharded "
            "checkpoint a merged mapping: collections.ChainMap(*(open_safetensors(p) for p in "
            "paths))."
        )
    if text.lower().endswith(_PICKLE_SUFFIXES):
        raise ValueError(
            f"`source` {text!r} looks like a pickle-based PyTorch checkpoint, which can run "
            "arbitrary code when loaded and is never unpickled here. Convert it to "
            ".safetensors where you trust it (safetensors.torch.save_file(torch.load(path, "
            "weights_only=True), out)), or pass a mapping of arrays."
        )
    return SafetensorsFile(text)


class SafetensorsShards(Mapping):
    """The shards of an indexed checkpoint as one read-only mapping of names to arrays.

    Every shard's header is validated on opening (see [`open_safetensors`][]) and
    the index is checked against them: every tensor the index names is in its shard,
    and every tensor of a shard is in the index. Tensors are read one at a time, on
    access, or only the blocks asked for (`read_slice`, `read_slices`); `shape(name)` /
    `dtype(name)` answer from the headers.
    """

    def __init__(self, index_path):
        """**Arguments:**

        - `index_path`: the JSON index (`*.safetensors.index.json`) whose `weight_map`
            names each tensor's shard. The shards, beside it, are opened and checked
            against it now; their tensors are read on access.
        """
        self.path = os.fspath(index_path)
        folder = os.path.dirname(self.path)
        try:
            with open(self.path, encoding="utf-8") as f:
                index = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{self.path!r} is not a readable JSON index: {e}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError(
                f"{self.path!r}: the index must hold a `weight_map` object of tensor name -> "
                "file name strings."
            )
        files = {}
        for name in sorted(set(weight_map.values())):
            if os.path.basename(name) != name or not name.endswith(".safetensors"):
                raise ValueError(
                    f"{self.path!r}: the index names the file {name!r}; shards must be "
                    ".safetensors files beside the index (no directories)."
                )
            files[name] = SafetensorsFile(os.path.join(folder, name))
        problems = []
        for tensor, name in weight_map.items():
            if tensor not in files[name]:
                problems.append(f"{tensor!r} is not in {name!r}")
        for name, shard in files.items():
            for tensor in shard:
                if weight_map.get(tensor) != name:
                    problems.append(f"{tensor!r} of {name!r} is not indexed to it")
        if problems:
            shown = "; ".join(problems[:10]) + (f"; ... ({len(problems) - 10} more)" if len(problems) > 10 else "")
            raise ValueError(f"{self.path!r}: the index does not match its shards: {shown}.")
        self._map = {tensor: files[name] for tensor, name in weight_map.items()}
        self.files = files
        metadata = index.get("metadata")
        self.metadata: dict[str, str] = (
            {str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else {}
        )

    def __getitem__(self, name: str) -> np.ndarray:
        return self._map[name][name]

    def read_slice(self, name: str, index=(), dtype=None) -> np.ndarray:
        """One block of tensor `name` from its shard, reading only the bytes it needs
        (see [`vidax_eqx.interop.SafetensorsFile.read_slice`][])."""
        return self._map[name].read_slice(name, index, dtype)

    def read_slices(self, name: str, indices, dtype=None) -> list[np.ndarray]:
        """Several blocks of tensor `name` in one pass (see
        [`vidax_eqx.interop.SafetensorsFile.read_slices`][])."""
        return self._map[name].read_slices(name, indices, dtype)

    @property
    def bytes_read(self) -> int:
        """The tensor bytes read so far from all the shards."""
        return sum(f.bytes_read for f in self.files.values())

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, name) -> bool:
        return name in self._map

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name`, from its shard's header."""
        return self._map[name].shape(name)

    def dtype(self, name: str) -> np.dtype:
        """The dtype of tensor `name`, from its shard's header."""
        return self._map[name].dtype(name)

    def __repr__(self) -> str:
        return f"SafetensorsShards({self.path!r}, {len(self.files)} files, {len(self)} tensors)"


def open_checkpoint(path) -> SafetensorsFile | SafetensorsShards:
    """Opens a safetensors checkpoint: one file, an index of shards, or a directory.

    **Arguments:**

    - `path`: a `.safetensors` file; a `*.safetensors.index.json` index; or a
        directory holding `diffusion_pytorch_model.safetensors[.index.json]` (the
        diffusers and Wan 2.1 releases), or else exactly one index or one
        `.safetensors` file.

    **Returns:**

    A lazy read-only mapping of names to NumPy arrays with `shape(name)` and
    `dtype(name)` ([`open_safetensors`][] for one file, a `SafetensorsShards` for an
    index), for [`load_state_dict`][].
    """
    text = os.fspath(path)
    if os.path.isdir(text):
        names = sorted(os.listdir(text))
        candidates = [DIFFUSERS_WEIGHTS + INDEX_SUFFIX, DIFFUSERS_WEIGHTS + ".safetensors"]
        found = [n for n in candidates if n in names]
        if not found:
            found = [n for n in names if n.endswith(INDEX_SUFFIX)]
            if not found:
                found = [n for n in names if n.endswith(".safetensors")]
            if len(found) != 1:
                raise ValueError(
                    f"open_checkpoint: the directory {text!r} holds "
                    f"{'no' if not found else len(found)} candidate checkpoints "
                    f"({', '.join(found) or 'none'}); expected {candidates[1]!r}, its index "
                    f"{candidates[0]!r}, or exactly one .safetensors file or index. Pass the "
                    "file's path."
                )
        text = os.path.join(text, found[0])
    if text.endswith(".json"):
        return SafetensorsShards(text)
    return open_safetensors(text)


def write_checkpoint(directory, tensors: Mapping[str, np.ndarray], *, name=DIFFUSERS_WEIGHTS,
                     max_shard_bytes: int | None = None, metadata=None) -> list[str]:
    """Writes `tensors` as `<name>.safetensors`, or as shards with an index.

    With `max_shard_bytes`, tensors (in name order) fill shards of at most that
    many bytes (a larger tensor gets a shard of its own), written as
    `<name>-0000i-of-0000n.safetensors` with `<name>.safetensors.index.json`, the
    layout `open_checkpoint` and diffusers read. Returns the files written.
    """
    os.makedirs(directory, exist_ok=True)
    names = sorted(tensors)
    if max_shard_bytes is None:
        path = os.path.join(directory, f"{name}.safetensors")
        write_safetensors(path, tensors, metadata)
        return [path]
    groups, size = [[]], 0
    for tensor in names:
        nbytes = int(np.asarray(tensors[tensor]).nbytes)
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += nbytes
    weight_map, written, total = {}, [], 0
    for i, group in enumerate(groups):
        file = f"{name}-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(os.path.join(directory, file), {t: tensors[t] for t in group}, metadata)
        written.append(os.path.join(directory, file))
        for tensor in group:
            weight_map[tensor] = file
            total += int(np.asarray(tensors[tensor]).nbytes)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    path = os.path.join(directory, name + INDEX_SUFFIX)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)
    return [path, *written]
