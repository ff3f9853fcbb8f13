"""A strict reader and a writer of the `.safetensors` format, without pickle.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian
unsigned header length `N`, then `N` bytes of UTF-8 JSON mapping each tensor
name to `{"dtype", "shape", "data_offsets": [begin, end]}` (plus an optional
`"__metadata__"` of strings), then the raw little-endian tensor data, offsets
relative to its start.

The reader treats the file as hostile until proven otherwise. Before reading
anything beyond the first 8 bytes it checks that the header length is at most
`MAX_HEADER_BYTES` and fits in the file, so a forged length cannot make it
allocate; it then parses the header with `json` only (nothing is executed) and
checks every entry: known dtype, a shape of non-negative ints whose size times
the dtype's item size equals the entry's byte length, offsets inside the data
section, and entries that tile the data section without overlap or gap (the
same rule as the reference implementation). Tensor data is read lazily, one
tensor at a time, into a buffer of exactly the validated size; or only the blocks of a
tensor that a caller asks for (`_slices.py`): what one process's devices hold.
"""

import json
import os
from collections.abc import Iterator, Mapping

import ml_dtypes
import numpy as np

from .._checks import is_int
from ._slices import normalize_index, read_blocks


MAX_HEADER_BYTES = 100_000_000
"""The largest JSON header accepted (the reference implementation's limit)."""

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


class _Entry:
    __slots__ = ("name", "code", "dtype", "shape", "begin", "end")

    def __init__(self, name, code, dtype, shape, begin, end):
        self.name, self.code, self.dtype = name, code, dtype
        self.shape, self.begin, self.end = shape, begin, end


def _bad(path, what: str) -> ValueError:
    return ValueError(
        f"{os.fspath(path)!r} is not a valid .safetensors file: {what}. Nothing was loaded; "
        "re-download or re-export the file (e.g. with `safetensors.numpy.save_file` or "
        "`vidax_eqx.interop.save_safetensors`)."
    )


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {_clip(key)} in the JSON header")
        out[key] = value
    return out


def _clip(value, limit=80) -> str:
    """`repr(value)`, cut short: a forged header can hold megabytes in one field."""
    text = repr(tuple(value) if isinstance(value, list) else value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _parse_entry(path, name, raw, data_bytes) -> _Entry:
    where = f"tensor {_clip(name)}"
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise _bad(path, f"{where} must be an object with exactly the keys dtype, shape, "
                         f"data_offsets; got {got}")
    code, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(code, str) or code not in _DTYPES:
        raise _bad(path, f"{where} has unknown dtype {_clip(code)}; known: {', '.join(_DTYPES)}")
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise _bad(path, f"{where} has shape {_clip(shape)}; expected a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)):
        raise _bad(path, f"{where} has data_offsets {_clip(offsets)}; expected [begin, end] ints")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        raise _bad(path, f"{where} has data_offsets [{begin}, {end}] outside the data "
                         f"section of {data_bytes} bytes (the file is truncated or forged)")
    dtype = _DTYPES[code]
    # Size in bytes, stopping past 2**64: bounded work for forged shapes.
    nbytes, overflow = (0 if 0 in shape else dtype.itemsize), False
    for d in shape:
        nbytes *= d
        if nbytes > 2**64:
            overflow = True
            break
    if nbytes != end - begin:
        needs = f"more than {end - begin}" if overflow else str(nbytes)
        raise _bad(path, f"{where} of dtype {code} and shape {_clip(shape)} needs {needs} "
                         f"bytes, but its data_offsets [{begin}, {end}] hold {end - begin}")
    return _Entry(name, code, dtype, tuple(shape), begin, end)


class SafetensorsFile(Mapping):
    """A validated `.safetensors` file as a read-only mapping of names to NumPy arrays.

    Opening validates the whole header and reads no tensor data; `file[name]` reads
    that one tensor, and `read_slice(name, index)` / `read_slices(name, indices)` only
    the blocks asked for (a sharded load reads what its devices hold). `shape(name)`
    and `dtype(name)` answer from the header; `bytes_read` counts the tensor bytes read
    so far. Create with [`vidax_eqx.interop.open_safetensors`][], which lists the checks.
    """

    def __init__(self, path):
        """**Arguments:**

        - `path`: the `.safetensors` file; its header is read and validated now.
        """
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise _bad(path, f"it is {size} bytes long, shorter than the 8-byte header length")
            head = f.read(8)
            if len(head) != 8:
                raise _bad(path, "the file shrank while its header length was being read")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES:
                raise _bad(path, f"its header claims {n} bytes, more than the "
                                 f"{MAX_HEADER_BYTES}-byte limit")
            if 8 + n > size:
                raise _bad(path, f"its header claims {n} bytes, but only {size - 8} bytes "
                                 "follow the header length (the file is truncated or forged)")
            raw = f.read(n)
        if len(raw) != n:
            raise _bad(path, "the file shrank while its header was being read")
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            reason = f"{type(e).__name__}: {e}"
            raise _bad(path, f"its header is not valid UTF-8 JSON ({reason[:200]})") from None
        if not isinstance(header, dict):
            raise _bad(path, f"its header is a JSON {type(header).__name__}, not an object")
        metadata = header.pop("__metadata__", None)
        if metadata is not None and not (
            isinstance(metadata, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        ):
            raise _bad(path, "its __metadata__ is not an object of strings")
        data_bytes = size - 8 - n
        entries = {name: _parse_entry(path, name, e, data_bytes) for name, e in header.items()}
        # The entries must tile the data section: no overlap, no gap, nothing after.
        position = 0
        for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
            if e.begin != position:
                problem = "overlaps the previous tensor" if e.begin < position else "leaves a gap"
                raise _bad(path, f"tensor {_clip(e.name)} at data_offsets [{e.begin}, {e.end}] "
                                 f"{problem} (expected it to start at byte {position})")
            position = e.end
        if position != data_bytes:
            raise _bad(path, f"its tensors cover {position} bytes of a {data_bytes}-byte data "
                             "section (trailing bytes)")
        self.metadata: dict[str, str] = metadata or {}
        self._entries = entries
        self._data_start = 8 + n
        self._size = size
        self.bytes_read = 0

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
        """Several blocks of tensor `name` (e.g. those of one process's devices), read
        in one pass over the file.

        A block split only on the leading dimension is one contiguous read; a block
        split on a later dimension is read run by run when its runs are at least a page
        apart, and otherwise together with the other such blocks as the rows they span,
        once, in chunks of at most 16 MiB (every page of that span would be read from
        disk anyway). Host memory stays at the blocks plus one chunk.

        **Arguments:**

        - `name`: the tensor.
        - `indices`: the blocks, each as for [`read_slice`][].
        - `dtype`: as for [`read_slice`][].

        **Returns:**

        A list of new NumPy arrays, one per index.
        """
        e = self._entries[name]
        blocks = [normalize_index(index, e.shape, f"tensor {_clip(name)}") for index in indices]
        with open(self.path, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size != self._size:
                raise _bad(self.path, "its size changed after it was opened")

            def read_at(offset: int, view: memoryview) -> None:
                f.seek(self._data_start + e.begin + offset)
                done = 0
                while done < len(view):  # readinto may return less than asked for huge reads
                    got = f.readinto(view[done:])
                    if not got:
                        raise _bad(self.path, f"tensor {_clip(name)} could not be read in full")
                    done += got
                self.bytes_read += done

            arrays = read_blocks(read_at, e.shape, e.dtype, blocks)
        target = e.dtype.newbyteorder("=") if dtype is None else np.dtype(dtype)
        for i, array in enumerate(arrays):  # one converted copy at a time
            if array.dtype != target:
                arrays[i] = array.astype(target)
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
    """Writes `tensors` (name -> NumPy array) to `path` in the `.safetensors` format.

    Tensors are stored in name order, little-endian; the header is padded with
    spaces to a multiple of 8 bytes, as the reference implementation does. The
    file is written beside `path` and renamed into place, so a failure leaves
    no half-written file.
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
                f"tensor {name!r} has dtype {array.dtype}, which .safetensors cannot store; "
                f"supported: {', '.join(str(d) for d in _CODES)}."
            )
        arrays[name] = (code, array.astype(_DTYPES[code], copy=False))
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    position = 0
    for name, (code, array) in arrays.items():
        header[name] = {"dtype": code, "shape": list(array.shape),
                        "data_offsets": [position, position + array.nbytes]}
        position += array.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(np.array([len(raw)], dtype="<u8").tobytes())
            f.write(raw)
            for _, array in arrays.values():
                f.write(array.tobytes())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
