"""The device test mode: where the `device` tests run, and the kernels they run.

The tests marked `device` (`tests/test_device_*.py`; the marker is registered in
`pyproject.toml`) run the Pallas TPU kernels for real, compiled by Mosaic on a TPU, against
the float64 oracle. The environment variable `VIDAX_TEST_DEVICE` selects the mode:

- unset (or `0`): they are skipped (CI, and every CPU run of the suite);
- `1`: they run on the TPU, the default backend; skipped, with the reason, where that
    is not a TPU;
- `interpret`: they run on the CPU with the kernels in Pallas interpret mode, at smaller
    sizes: the same test bodies, to check them without a chip (5 to 7 minutes on 2 cores);
- `interpret-full`: the same at the chip's sizes (slower still): the chip's inputs,
    configurations and tolerances checked on the CPU.

`tests/conftest.py` skips the `device` tests outside the mode (`device_skip_reason`); the test
modules read the mode to pick their kernels (`pallas_tpu`), devices and sizes (`chip_sizes`).
"""

import dataclasses
import os


ENV = "VIDAX_TEST_DEVICE"
MODES = {"1": "tpu", "interpret": "interpret", "interpret-full": "interpret-full"}


def device_mode() -> str | None:
    """`"tpu"`, `"interpret"`, `"interpret-full"`, or `None` (the device tests are off), from
    `VIDAX_TEST_DEVICE`.

    Reads the environment only (no JAX backend is started): cheap at collection time.
    """
    value = os.environ.get(ENV, "").strip()
    if value in ("", "0"):
        return None
    if value not in MODES:
        raise ValueError(
            f"{ENV} must be unset, '0', '1' (run the device tests on the TPU), 'interpret' "
            f"(on the CPU in Pallas interpret mode, small sizes) or 'interpret-full' (the "
            f"same at the chip's sizes); received {value!r}."
        )
    return MODES[value]


def device_skip_reason() -> str | None:
    """Why the `device` tests cannot run in this process, or `None` when they can."""
    mode = device_mode()
    if mode is None:
        return (f"a device test: runs on a TPU with {ENV}=1 (on the CPU in Pallas interpret "
                f"mode with {ENV}=interpret); see docs/index.md, 'Tests on a TPU'")
    if mode == "tpu":
        import jax

        platform = jax.devices()[0].platform
        if platform != "tpu":
            return f"{ENV}=1 asks for a TPU, but JAX's default backend is {platform!r}"
    return None


def on_chip() -> bool:
    """The device tests run on a TPU (`VIDAX_TEST_DEVICE=1`), the kernels compiled by Mosaic."""
    return device_mode() == "tpu"


def chip_sizes() -> bool:
    """The device tests run at the chip's sizes (`1` and `interpret-full`), not the small
    ones of `interpret`."""
    return device_mode() in ("tpu", "interpret-full")


def pallas_tpu(blocks: tuple[int, int] | None = None):
    """The Pallas TPU implementation the device tests run: `"pallas_tpu"` (the registered
    one, its own blocks), or `PallasTpu(block_q=, block_kv=)` of `blocks`. Off the chip the
    same in interpret mode; at the small sizes of `interpret`, `blocks` defaults to
    `(128, 128)` (the small test sequences then span several)."""
    from vidax_eqx import kernels

    if blocks is None and on_chip():
        return "pallas_tpu"
    if blocks is None and chip_sizes():
        return registered_pallas_tpu()
    block_q, block_kv = blocks or (128, 128)
    return kernels.PallasTpu(block_q=block_q, block_kv=block_kv, interpret=not on_chip())


def registered_pallas_tpu():
    """The `"pallas_tpu"` implementation object itself (for its VSA fine-stage methods);
    off the chip, the same in interpret mode."""
    from vidax_eqx import kernels

    impl = kernels.implementations()["pallas_tpu"]
    return impl if on_chip() else dataclasses.replace(impl, interpret=True)


def accelerator():
    """The device under test: the TPU on the chip, the (first) CPU device in interpret mode."""
    import jax

    return jax.devices()[0]


def cpu():
    """The first CPU device (present beside the TPU too: JAX always has a CPU backend)."""
    import jax

    return jax.devices("cpu")[0]
