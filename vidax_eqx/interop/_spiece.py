"""A strict reader of SentencePiece's `spiece.model`, without `sentencepiece` or `protobuf`.

The file is one protobuf message, `ModelProto` of SentencePiece's
`sentencepiece_model.proto` (proto2), in the protobuf wire format: a sequence of
fields, each a varint key `field_number << 3 | wire_type` and a value (wire type 0 a
varint, 1 eight bytes, 2 a varint length and that many bytes, 5 four bytes).
transformers' conversion of a T5 model to a `tokenizers` Unigram model reads the pieces
and the normalizer table, and so does this reader:

- `pieces` (field 1, repeated `SentencePiece`): `piece` (1, UTF-8 string), `score`
    (2, float32), `type` (3, enum: 1 normal, 2 unknown, 3 control, 4 user-defined,
    5 unused, 6 byte; 1 when absent);
- `normalizer_spec` (field 3, `NormalizerSpec`): `precompiled_charsmap` (2, bytes),
    the normalization table that `tokenizers.normalizers.Precompiled` applies.

Every other field (the trainer's settings, the denormalizer, extensions) is skipped by
its wire type, as protobuf does with fields it does not use; as protobuf, the last
value of a field that is not repeated wins. Every length is checked against the bytes
left before anything is sliced, so a damaged file raises instead of allocating; wire
types 3 and 4 (groups, unused by this schema) and 6, 7 (undefined) are errors, as are
a truncated field, a known field of the wrong wire type, a piece that is empty or not
UTF-8, and a file without pieces.

The normalizer table is checked too, since `tokenizers` trusts it and panics on a damaged
one at the first prompt that reaches the damage: it is a little-endian u32 byte count
`T`, a darts-clone double-array trie of `T / 4` u32 units, then the replacement strings
(UTF-8, each ended by a NUL). Every trie position that a lookup can read, for any input
byte, must lie in the array, and every leaf must point at the start of a character of
the strings (`check_charsmap`).
"""

import math
import os
import struct
from typing import NamedTuple

import numpy as np


SPIECE_FILE = "spiece.model"
"""The file name under which transformers' T5 tokenizers keep their SentencePiece model."""

CONTROL = 3
"""`SentencePiece.Type.CONTROL`: a piece never produced from text (`<pad>`, `</s>`)."""

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5


class SpieceModel(NamedTuple):
    """The fields of a `spiece.model` that the conversion uses."""

    pieces: list[tuple[str, float, int]]
    """`(piece, score, type)` in id order."""
    precompiled_charsmap: bytes
    """The normalizer's table; empty for SentencePiece's identity normalization."""


class SpieceError(ValueError):
    """A file that is not a SentencePiece model; the message says why."""


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end:
            raise SpieceError("a varint runs past the end of its message")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise SpieceError("a varint is longer than 10 bytes")


def _fields(data: bytes, start: int, end: int):
    """`(number, wire_type, value)` of the fields of the message `data[start:end]`: an
    int for a varint, `(begin, end)` offsets into `data` for the others."""
    pos = start
    while pos < end:
        key, pos = _varint(data, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise SpieceError("a field has number 0")
        if wire == _VARINT:
            value, pos = _varint(data, pos, end)
        else:
            if wire == _BYTES:
                size, pos = _varint(data, pos, end)
            elif wire in (_FIXED64, _FIXED32):
                size = 8 if wire == _FIXED64 else 4
            else:
                raise SpieceError(f"field {number} has wire type {wire}, which this schema "
                                  f"does not use")
            if size > end - pos:
                raise SpieceError(f"field {number} claims {size} bytes; {end - pos} are left")
            value, pos = (pos, pos + size), pos + size
        yield number, wire, value


def _expect(name: str, wire: int, expected: int) -> None:
    if wire != expected:
        raise SpieceError(f"`{name}` has wire type {wire}, not {expected}")


def _piece(data: bytes, begin: int, end: int, index: int) -> tuple[str, float, int]:
    text, score, kind = None, 0.0, 1
    for number, wire, value in _fields(data, begin, end):
        if number == 1:
            _expect("piece", wire, _BYTES)
            try:
                text = data[value[0]:value[1]].decode("utf-8")
            except UnicodeDecodeError:
                raise SpieceError(f"piece {index} is not UTF-8") from None
        elif number == 2:
            _expect("score", wire, _FIXED32)
            (score,) = struct.unpack_from("<f", data, value[0])
        elif number == 3:
            _expect("type", wire, _VARINT)
            kind = value
    if not text:
        raise SpieceError(f"piece {index} is empty")
    if not math.isfinite(score):
        raise SpieceError(f"piece {index} ({text!r}) has the score {score}")
    return text, score, kind


def parse_spiece(data: bytes) -> SpieceModel:
    """The pieces and normalizer table of a serialized `ModelProto`.

    **Arguments:**

    - `data`: the bytes of a `spiece.model`.

    **Returns:**

    A `SpieceModel`.

    **Raises:**

    `SpieceError` (a `ValueError`) if `data` is not a SentencePiece model.
    """
    if not data:
        raise SpieceError("the file is empty")
    if data.startswith(b"version https://git-lfs"):
        raise SpieceError("it is a Git LFS pointer to the file, not the file (`git lfs pull` "
                          "fetches it)")
    pieces, charsmap = [], b""
    for number, wire, value in _fields(data, 0, len(data)):
        if number == 1:
            _expect("pieces", wire, _BYTES)
            pieces.append(_piece(data, *value, len(pieces)))
        elif number == 3:
            _expect("normalizer_spec", wire, _BYTES)
            for field, field_wire, field_value in _fields(data, *value):
                if field == 2:
                    _expect("precompiled_charsmap", field_wire, _BYTES)
                    charsmap = data[field_value[0]:field_value[1]]
    if not pieces:
        raise SpieceError("it holds no pieces")
    check_charsmap(charsmap)
    return SpieceModel(pieces, charsmap)


def _offset(units: np.ndarray) -> np.ndarray:
    return (units >> 10) << ((units & (1 << 9)) >> 6)


def check_charsmap(charsmap: bytes) -> None:
    """Raises `SpieceError` unless `charsmap` (a `precompiled_charsmap`, empty for none) is
    a table that `tokenizers.normalizers.Precompiled` reads without going out of bounds:
    the lookup of a string's bytes `c` moves from position `p` to `p ^ c`, reads the unit
    there (`label`, `has_leaf`, `offset`), and on a match moves to `p ^ c ^ offset`; a
    leaf's value is the byte offset of its replacement. The trie is walked breadth-first
    from the root over all 255 non-zero bytes at once."""
    if not charsmap:
        return
    damaged = "its normalizer table (`precompiled_charsmap`) is damaged"
    size = int.from_bytes(charsmap[:4], "little") if len(charsmap) >= 4 else -1
    if size <= 0 or size % 4 or size > len(charsmap) - 4:
        raise SpieceError(f"{damaged}: its trie size {size} does not fit its "
                          f"{len(charsmap)} bytes")
    units = np.frombuffer(charsmap, "<u4", count=size // 4, offset=4).astype(np.int64)
    strings = charsmap[4 + size:]
    try:
        strings.decode("utf-8")
    except UnicodeDecodeError:
        raise SpieceError(f"{damaged}: its replacement strings are not UTF-8") from None
    starts = np.frombuffer(strings, np.uint8)
    starts = np.append((starts & 0xC0) != 0x80, True)  # a char starts there (or the end)
    n = len(units)
    labels = np.arange(1, 256, dtype=np.int64)
    visited = np.zeros(n, bool)
    frontier = _offset(units[:1])
    while frontier.size:
        if int((frontier | 0xFF).max()) >= n:
            raise SpieceError(f"{damaged}: a lookup reads past its {n} trie units")
        visited[frontier] = True
        children = []
        for block in np.array_split(frontier, -(-frontier.size // 1024)):
            at = block[:, None] ^ labels
            unit = units[at]
            hit = (unit & ((1 << 31) | 0xFF)) == labels
            child = (at ^ _offset(unit))[hit]
            leaf = child[((unit >> 8) & 1 == 1)[hit]]
            if leaf.size:
                if int(leaf.max()) >= n:
                    raise SpieceError(f"{damaged}: a leaf lies past its {n} trie units")
                value = units[leaf] & ((1 << 31) - 1)
                if int(value.max()) > len(strings) or not starts[value].all():
                    raise SpieceError(f"{damaged}: a replacement starts outside its strings")
            children.append(child)
        child = np.unique(np.concatenate(children))
        if child.size and int(child.max()) >= n:
            raise SpieceError(f"{damaged}: a lookup reads past its {n} trie units")
        frontier = child[~visited[child]]


def read_spiece(path: str | os.PathLike) -> SpieceModel:
    """`parse_spiece` of the file at `path`."""
    with open(path, "rb") as f:
        return parse_spiece(f.read())
