"""SentencePiece's `spiece.model`, read by the `sentencepiece` package.

`sentencepiece.SentencePieceProcessor` parses the file (one protobuf `ModelProto`) and
checks the model as SentencePiece loads it: the wire format, non-empty unique pieces,
finite scores, an unknown piece, the normalizer table's sizes. Its API gives the
pieces, their scores and which are control pieces. The one field it does not expose,
the normalizer table (`normalizer_spec.precompiled_charsmap`, which
`tokenizers.normalizers.Precompiled` applies), is read with the schema `sentencepiece`
ships (`sentencepiece_model_pb2`, through `protobuf`), as transformers' converter reads
it.

The thin layer kept here is `check_charsmap`. `tokenizers` trusts the table and panics
on a damaged one at the first prompt that reaches the damage, and `sentencepiece` does
not check everything a lookup reads (0.2.1 checks the table's sizes, 0.2.3 its node
references too): of 60 randomly damaged copies of a real table that sentencepiece 0.2.3
loads and this check refuses, 57 made `tokenizers` fail or panic. The table is a
little-endian u32 byte count `T`, a darts-clone double-array trie of `T / 4` u32 units,
then the replacement strings (UTF-8, each ended by a NUL). Every trie position that a
lookup can read, for any input byte, must lie in the array, and every leaf must point
at the start of a character of the strings.
"""

import os
from typing import NamedTuple

import numpy as np


SPIECE_FILE = "spiece.model"
"""The file name under which transformers' T5 tokenizers keep their SentencePiece model."""

_INSTALL = "pip install -U sentencepiece protobuf (or pip install '.[text]' in a clone of vidax_eqx)"


class SpieceModel(NamedTuple):
    """The fields of a `spiece.model` that the conversion uses."""

    pieces: list[tuple[str, float, bool]]
    """`(piece, score, is a control piece)` in id order (control pieces, `<pad>` and
    `</s>`, are never produced from text)."""
    precompiled_charsmap: bytes
    """The normalizer's table; empty for SentencePiece's identity normalization."""


class SpieceError(ValueError):
    """A file that is not a SentencePiece model; the message says why."""


def read_spiece(path: str | os.PathLike) -> SpieceModel:
    """The pieces and normalizer table of the SentencePiece model at `path`.

    **Raises:**

    `SpieceError` (a `ValueError`) if the file is not a SentencePiece model;
    `ImportError` if `sentencepiece` or `protobuf` cannot be imported.
    """
    try:
        import sentencepiece
        from sentencepiece import sentencepiece_model_pb2
    except Exception as e:  # not installed, or a protobuf older than the schema's
        raise ImportError(f"reading SentencePiece's `{SPIECE_FILE}` needs the `sentencepiece` "
                          f"package and `protobuf` (its normalizer table), which cannot be "
                          f"imported here ({type(e).__name__}: {e}): {_INSTALL}.") from e
    with open(path, "rb") as f:
        data = f.read()
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(data)
    except (RuntimeError, OSError) as e:
        if not data:
            raise SpieceError("the file is empty") from None
        if data.startswith(b"version https://git-lfs"):
            raise SpieceError("it is a Git LFS pointer to the file, not the file (`git lfs "
                              "pull` fetches it)") from None
        raise SpieceError(f"sentencepiece cannot load it ({str(e)[:200]})") from None
    pieces = []
    for i in range(processor.GetPieceSize()):
        try:
            pieces.append((processor.IdToPiece(i), processor.GetScore(i), processor.IsControl(i)))
        except UnicodeDecodeError:
            raise SpieceError(f"piece {i} is not UTF-8") from None
    model = sentencepiece_model_pb2.ModelProto.FromString(data)
    charsmap = model.normalizer_spec.precompiled_charsmap
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
