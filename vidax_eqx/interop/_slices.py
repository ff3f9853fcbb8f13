"""The blocks that devices hold of a tensor, as ranges per dimension.

A sharded array's device holds one block of each parameter: a range of indices on every
dimension, given as a tuple of slices (`jax.make_array_from_callback`,
`Sharding.addressable_devices_indices_map`). `normalize_index` checks such an index
against a shape and gives its `(start, stop)` per dimension, the key that tells two
devices holding the same block apart from two holding different ones.
"""

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
