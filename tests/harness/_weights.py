"""Weight files: `.safetensors` files built byte by byte."""

import json

import numpy as np


def safetensors_file(path, header, data: bytes = b"", length: int | None = None):
    """A `.safetensors`-shaped file written byte by byte (hostile ones included): the
    8-byte little-endian header length (`length`, default the true one), the header
    (a dict as JSON, or raw bytes) and the data. Returns `path`."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    path.write_bytes(np.array([n], "<u8").tobytes() + raw + data)
    return path


def safetensors_entry(dtype: str = "F32", shape=(2,), offsets=(0, 8)) -> dict:
    """One tensor's entry of a `.safetensors` header."""
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}
