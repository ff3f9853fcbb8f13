"""`.safetensors` files through Hugging Face's `safetensors` library, without pickle.

`safetensors.safe_open` memory-maps a file and validates its whole header in place
before any tensor byte is touched (a forged header length allocates nothing): a length
within `MAX_HEADER_BYTES` and the file, UTF-8 JSON, known dtypes, overflow-checked
shapes that match each entry's bytes, entries that tile the data exactly (no overlap,
gap, trailing bytes or truncation). `get_slice(name)[index]` copies out one block:
what one process's devices hold. `safetensors.numpy.save_file` writes.

A thin layer covers what the library leaves to its caller:

- a key given twice: the library's JSON map keeps the last, so two entries over the same
  bytes pass its overlap check; `json` parses the accepted header again to refuse it;
- float8: the library's NumPy framework builds bfloat16 (`ml_dtypes`) but asks NumPy
  itself for `float8_*`, so float8 tensors are read as the bytes at the offsets it
  validated; dtypes outside `_DTYPES` (complex, 4- and 6-bit floats) are refused;
- a file cut short after opening, which a read through the map would fault on (SIGBUS):
  every read first checks the size;
- memory: a map's touched pages count as resident until it is closed, so the file is
  reopened (and revalidated) every `_REMAP_BYTES`;
- one-line errors: the library's reason, the file, what it holds, what was expected.
"""

import json
import math
import os
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import ml_dtypes
import numpy as np
from safetensors import safe_open, SafetensorError
from safetensors.numpy import save_file

from ._slices import normalize_index


MAX_HEADER_BYTES = 100_000_000
"""The largest JSON header accepted: the `safetensors` library's limit, checked by it
before anything beyond the header length is read."""

_REMAP_BYTES = 128 << 20
"""Bytes of tensor rows read through one memory map of a file before the map is dropped
(the pages it touched count as resident memory until then) and the file opened again."""

# safetensors dtype code -> NumPy dtype (little-endian where it matters).
_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}
_CODES: dict[np.dtype, str] = {dtype.newbyteorder("="): code for code, dtype in _DTYPES.items()}
_RAW = ("F8_E5M2", "F8_E4M3")  # read as bytes: the library's NumPy framework cannot build them


class _Entry(NamedTuple):
    code: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int  # in the data section, from the header the library validated


def _bad(path, what: str) -> ValueError:
    return ValueError(
        f"{os.fspath(path)!r} is not a valid .safetensors file: {what}. Nothing was loaded; "
        "re-download or re-export the file (e.g. with `safetensors.numpy.save_file` or "
        "`vidax_eqx.interop.save_safetensors`)."
    )


def _clip(value, limit=80) -> str:
    """`repr(value)`, cut short: a forged header can hold megabytes in one field."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _rejected(path, size: int, error: Exception) -> ValueError:
    """The library's refusal of `path` (`size` bytes) as one line: its reason, then what
    the file holds against what the format expects."""
    reason = str(error).removeprefix("Error while deserializing header: ")
    reason = reason if len(reason) <= 300 else reason[:297] + "..."
    if size < 8:
        got = f"received {size} bytes; expected at least the 8-byte header length"
    else:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
        data = size - 8 - n
        got = (f"received {size} bytes whose header length is {n}; expected at most "
               f"{min(size - 8, MAX_HEADER_BYTES)} (the bytes after it, never over "
               f"{MAX_HEADER_BYTES})" if data < 0 or n > MAX_HEADER_BYTES else
               f"received a {n}-byte header and {data} data bytes; expected JSON entries "
               f"(dtype, shape, data_offsets) whose tensors tile those {data} bytes in order")
    return _bad(path, f"the safetensors library refuses its header ({reason}); {got}")


def _unique(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"its header has the duplicate key {_clip(key)} (two entries, which "
                             "the safetensors library reads as one); expected each key once")
        out[key] = value
    return out


class SafetensorsFile(Mapping):
    """A validated `.safetensors` file as a read-only mapping of names to NumPy arrays.

    Opening validates the whole header and reads no tensor data; `file[name]` reads
    that one tensor, and `read_slice(name, index)` / `read_slices(name, indices)` only
    the blocks asked for (a sharded load reads what its devices hold). `shape(name)`
    and `dtype(name)` answer from the header; `bytes_read` counts the bytes of the
    blocks read so far. Create with [`vidax_eqx.interop.open_safetensors`][], which lists
    the checks.
    """

    def __init__(self, path):
        """**Arguments:**

        - `path`: the `.safetensors` file; its header is read and validated now.
        """
        self.path = os.fspath(path)
        self._size = os.path.getsize(self.path)
        self._handle, self._mapped = self._open(), 0
        with open(self.path, "rb") as f:  # the header the library accepted, parsed again
            n = int.from_bytes(f.read(8), "little")
            raw = f.read(n) if 8 + n <= self._size else b""  # (unless the file just changed)
        try:
            header = json.loads(raw, object_pairs_hook=_unique)
        except ValueError as e:  # a key given twice
            raise _bad(self.path, str(e)[:300]) from None
        entries = {}
        for name, entry in header.items():
            code = entry["dtype"] if name != "__metadata__" else None
            if code is not None and code not in _DTYPES:
                raise _bad(self.path, f"tensor {_clip(name)} has dtype {_clip(code)}, which is not "
                                      f"read here; expected one of {', '.join(_DTYPES)}")
            if code is not None:
                entries[name] = _Entry(code, _DTYPES[code], tuple(entry["shape"]),
                                       entry["data_offsets"][0])
        self.metadata: dict[str, str] = self._handle.metadata() or {}
        self._entries = entries
        self._data_start = 8 + n
        self.bytes_read = 0

    def _open(self):
        try:
            return safe_open(self.path, framework="numpy")
        except SafetensorError as e:
            raise _rejected(self.path, self._size, e) from None

    def __getitem__(self, name: str) -> np.ndarray:
        return self.read_slice(name, ())

    def read_slice(self, name: str, index=(), dtype=None) -> np.ndarray:
        """One block of tensor `name`, reading only the bytes it needs.

        **Arguments:**

        - `name`: the tensor.
        - `index`: a tuple of `slice`s (step 1), one per leading dimension, the rest
            whole: what `jax.make_array_from_callback` asks for one device. `()` is the
            whole tensor.
        - `dtype`: the result's dtype (floating tensors are cast to it); default the
            tensor's own.

        **Returns:**

        A new NumPy array of the block's shape. See [`read_slices`][] for what is read.
        """
        return self.read_slices(name, [index], dtype)[0]

    def read_slices(self, name: str, indices, dtype=None) -> list[np.ndarray]:
        """Several blocks of tensor `name` (e.g. those of one process's devices).

        Each block is copied out of the file's memory map by the `safetensors` library
        (`safe_open(...).get_slice(name)[index]`): only its own bytes, one contiguous
        run per row of the dimensions it splits, so the disk delivers the pages around
        them and nothing else. A float8 tensor, which the library's NumPy framework does
        not build, is read as the rows each block spans. Host memory holds the blocks.

        **Arguments:**

        - `name`: the tensor.
        - `indices`: the blocks, each as for [`read_slice`][].
        - `dtype`: as for [`read_slice`][].

        **Returns:**

        A list of new NumPy arrays, one per index.
        """
        e = self._entries[name]
        blocks = [normalize_index(index, e.shape, f"tensor {_clip(name)}") for index in indices]
        if os.path.getsize(self.path) != self._size:
            raise _bad(self.path, "its size changed after it was opened")
        if e.code in _RAW:
            arrays = self._read_raw(name, e, blocks)
        else:
            if self._handle is None or self._mapped >= _REMAP_BYTES:
                self._handle = None  # unmap before mapping again
                self._handle, self._mapped = self._open(), 0
            view = self._handle.get_slice(name)
            if view.get_dtype() != e.code or tuple(view.get_shape()) != e.shape:
                raise _bad(self.path, f"tensor {_clip(name)} changed after it was opened")
            # The library refuses to slice a dimension of size 0: such a block is empty.
            arrays = [view[tuple(slice(a, b) for a, b in block)] if all(b > a for a, b in block)
                      else np.empty(tuple(b - a for a, b in block), e.dtype) for block in blocks]
            row = math.prod(e.shape[1:]) * e.dtype.itemsize  # the pages a copy touches: its rows
            self._mapped += sum((b[0][1] - b[0][0]) * row if b else row for b in blocks)
        self.bytes_read += sum(a.nbytes for a in arrays)
        target = e.dtype.newbyteorder("=") if dtype is None else np.dtype(dtype)
        for i, array in enumerate(arrays):  # one converted copy at a time
            if array.dtype != target:
                arrays[i] = array.astype(target)
        return arrays

    def _read_raw(self, name: str, e: _Entry, blocks) -> list[np.ndarray]:
        """Blocks of a float8 tensor: the rows each spans, read at the offset the library
        validated, viewed as `e.dtype` and cut."""
        row = math.prod(e.shape[1:]) * e.dtype.itemsize
        arrays = []
        with open(self.path, "rb") as f:
            for block in blocks:
                lo, hi = block[0] if block else (0, 1)
                buffer = np.empty((hi - lo) * row, np.uint8)
                f.seek(self._data_start + e.begin + lo * row)
                if f.readinto(memoryview(buffer)) != buffer.size:
                    raise _bad(self.path, f"tensor {_clip(name)} could not be read in full")
                rows = buffer.view(e.dtype).reshape((hi - lo,) + e.shape[1:] if block else ())
                rest = tuple(slice(a, b) for a, b in block[1:])
                arrays.append(np.ascontiguousarray(rows[(slice(None),) + rest]) if rest else rows)
        return arrays

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name`, from the header (no data is read)."""
        return self._entries[name].shape

    def dtype(self, name: str) -> np.dtype:
        """The NumPy dtype of tensor `name`, from the header (no data is read)."""
        return self._entries[name].dtype.newbyteorder("=")

    def __repr__(self) -> str:
        return f"SafetensorsFile({self.path!r}, {len(self)} tensors)"


def write_safetensors(path, tensors: Mapping[str, np.ndarray], metadata=None) -> None:
    """Writes `tensors` (name -> NumPy array) to `path` with `safetensors.numpy.save_file`.

    Only the dtypes [`SafetensorsFile`][vidax_eqx.interop.SafetensorsFile] reads are
    written. The file is written beside `path` and renamed into place, so a failure
    leaves no half-written file.
    """
    arrays = {}
    for name in sorted(tensors):
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(
                f"tensor names must be strings other than '__metadata__'; received {name!r}."
            )
        array = np.asarray(tensors[name])
        array = array if array.flags.c_contiguous else np.ascontiguousarray(array)  # keeps 0-d
        code = _CODES.get(array.dtype.newbyteorder("="))
        if code is None:
            raise ValueError(
                f"tensor {name!r} has dtype {array.dtype}, which interop's .safetensors files "
                f"do not hold; supported: {', '.join(str(d) for d in _CODES)}."
            )
        arrays[name] = array.astype(_DTYPES[code], copy=False)
    metadata = {str(k): str(v) for k, v in metadata.items()} if metadata else None
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        save_file(arrays, tmp, metadata=metadata)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
