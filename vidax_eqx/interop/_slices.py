"""Reading parts of a row-major tensor stored in a file: the blocks that devices hold.

A sharded array's device holds one block of each parameter: a range of indices on every
dimension. In the row-major layout of a `.safetensors` tensor such a block is a set of
contiguous *runs*: everything after the last dimension that is not whole is whole, so
each run is that dimension's range times the size of the rest, and the runs repeat over
the dimensions before it.

- A block split only on its leading dimension (or not split) is one run: one read.
- When consecutive runs lie at least a page (`PAGE_BYTES`) apart, each run is read on its
  own: exactly the block's bytes.
- When they lie closer, every page between the first and the last run holds part of a
  run, so the disk delivers the whole span whatever is asked. Those blocks are read
  together, once for all of them: rows of the leading dimension in chunks of at most
  `CHUNK_BYTES` (a row larger than that is split the same way along the next
  dimension), each block keeping its part of every chunk. Host memory stays at the
  blocks plus one chunk.

The caller supplies `read_at(offset, buffer)`, which fills `buffer` (a writable byte
view) with the bytes at `offset` of the tensor's data.
"""

import math
from collections.abc import Callable, Sequence

import numpy as np


PAGE_BYTES = 4096
"""Runs at least this far apart are read one by one; closer ones as their whole span."""
CHUNK_BYTES = 16 << 20
"""The largest piece of a span held at once while the blocks take their parts of it."""

Ranges = tuple[tuple[int, int], ...]  # (start, stop) per dimension


def normalize_index(index, shape: tuple[int, ...], what: str) -> Ranges:
    """`index` (a tuple of `slice`s with step 1 or `None`, as
    `jax.make_array_from_callback` and `Sharding.addressable_devices_indices_map` give;
    missing trailing dimensions are whole) as a `(start, stop)` per dimension of
    `shape`. `what` names the tensor in the error."""
    if not isinstance(index, tuple):
        index = (index,)
    if len(index) > len(shape) or not all(isinstance(s, slice) for s in index):
        raise ValueError(
            f"{what}: a slice index must be a tuple of at most {len(shape)} slices (one per "
            f"dimension of the shape {shape}); received {index!r}. Pass e.g. "
            "(slice(0, 8), slice(None))."
        )
    ranges = []
    for s, n in zip(index + (slice(None),) * (len(shape) - len(index)), shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(
                f"{what}: slices with a step are not read; received {s!r} on a dimension of "
                f"size {n}. Read the contiguous range and step through it afterwards."
            )
        ranges.append((start, max(start, stop)))
    return tuple(ranges)


def read_blocks(read_at: Callable[[int, memoryview], None], shape: tuple[int, ...],
                dtype: np.dtype, blocks: Sequence[Ranges]) -> list[np.ndarray]:
    """Each block (`normalize_index`'s ranges) of the row-major tensor of `shape` and
    `dtype` whose bytes `read_at` reads, as a new C-contiguous array in `dtype`."""
    outs = [np.empty(tuple(b - a for a, b in block), dtype) for block in blocks]
    todo = [(block, out) for block, out in zip(blocks, outs) if out.size]
    _fill(read_at, 0, tuple(shape), np.dtype(dtype), todo)
    return outs


def _fill(read_at, offset: int, shape, dtype: np.dtype, todo) -> None:
    """Fills each `(ranges, out)` of `todo` from the tensor of `shape` at `offset`."""
    if not todo:
        return
    if not shape:  # a scalar: its one element
        for _, out in todo:
            read_at(offset, memoryview(out.reshape(-1).view(np.uint8)))
        return
    together = []
    for ranges, out in todo:
        partial = [d for d, (a, b) in enumerate(ranges) if (a, b) != (0, shape[d])]
        k = partial[-1] if partial else 0
        inner = math.prod(shape[k + 1:]) * dtype.itemsize
        gap = (shape[k] - (ranges[k][1] - ranges[k][0])) * inner
        if k == 0 or gap >= PAGE_BYTES:
            _read_runs(read_at, offset, shape, dtype.itemsize, ranges, k, out)
        else:
            together.append((ranges, out))
    if together:
        _read_span(read_at, offset, shape, dtype, together)


def _read_runs(read_at, offset, shape, itemsize, ranges, k, out) -> None:
    """One read per contiguous run of the block `ranges` (dimensions after `k` whole)."""
    strides = [math.prod(shape[d + 1:]) * itemsize for d in range(len(shape))]
    run = (ranges[k][1] - ranges[k][0]) * strides[k]
    views = memoryview(out.reshape(-1).view(np.uint8))
    lead = [b - a for a, b in ranges[:k]]
    for i, where in enumerate(np.ndindex(*lead)):
        start = offset + sum((ranges[d][0] + j) * strides[d] for d, j in enumerate(where))
        start += ranges[k][0] * strides[k]
        read_at(start, views[i * run:(i + 1) * run])


def _read_span(read_at, offset, shape, dtype, together) -> None:
    """The rows of the leading dimension that the blocks of `together` cover, once, in
    chunks of at most `CHUNK_BYTES`; each block copies its part of every chunk."""
    row = math.prod(shape[1:]) * dtype.itemsize
    rows = _union([ranges[0] for ranges, _ in together])
    if row > CHUNK_BYTES:  # one row is too large: split each along the next dimension
        for lo, hi in rows:
            for r in range(lo, hi):
                _fill(read_at, offset + r * row, shape[1:], dtype,
                      [(ranges[1:], out[r - ranges[0][0]]) for ranges, out in together
                       if ranges[0][0] <= r < ranges[0][1]])
        return
    step = max(1, CHUNK_BYTES // row)
    for lo, hi in rows:
        for r in range(lo, hi, step):
            m = min(step, hi - r)
            buffer = np.empty(m * row, np.uint8)
            read_at(offset + r * row, memoryview(buffer))
            chunk = buffer.view(dtype).reshape((m,) + tuple(shape[1:]))
            for ranges, out in together:
                a, b = max(r, ranges[0][0]), min(r + m, ranges[0][1])
                if a < b:
                    part = (slice(a - r, b - r),) + tuple(slice(x, y) for x, y in ranges[1:])
                    out[a - ranges[0][0]:b - ranges[0][0]] = chunk[part]


def _union(intervals) -> list[tuple[int, int]]:
    """Sorted, merged `(start, stop)` intervals."""
    merged: list[list[int]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]
