"""JAX's persistent compilation cache for the pipelines and `vidax-generate`: the
compiled programs (the denoising loop, the VAE, the encoders) written to a folder under
the user's cache directory, so that a second process loads them instead of compiling.
Switched on by `from_pretrained` and the command, never by importing the library."""

import os

import jax


ENVIRONMENT = "VIDAX_COMPILE_CACHE"
"""The environment variable that turns the cache off (`0`, `false`, `off`, `no`) or
names its folder (any other value)."""

MIN_COMPILE_TIME_SECS = 0.5
"""Programs that compile faster are not written (JAX's default is 1 s): every program a
pipeline call compiles for long enough to matter, not the small eager operations."""

_OFF = {"0", "false", "off", "no"}
_JAX_DEFAULT_MIN_COMPILE_TIME_SECS = 1.0
_JAX_DEFAULT_MIN_ENTRY_SIZE_BYTES = 0


def default_compile_cache_dir() -> str:
    """`$XDG_CACHE_HOME/vidax_eqx/jax`, or `~/.cache/vidax_eqx/jax`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vidax_eqx", "jax")


def enable_compile_cache(directory: str | os.PathLike | None = None) -> str | None:
    """Switches on JAX's persistent compilation cache, unless it is off by the
    environment or already set.

    - `VIDAX_COMPILE_CACHE=0` (or `false`, `off`, `no`) in the environment: nothing is
        changed, and `None` is returned.
    - A cache folder already set (`jax.config.update("jax_compilation_cache_dir", ...)`
        or `JAX_COMPILATION_CACHE_DIR`): it is kept, and returned.
    - Otherwise the cache goes to `directory`, else the folder `VIDAX_COMPILE_CACHE`
        names, else [`default_compile_cache_dir`][vidax_eqx.pipelines.default_compile_cache_dir]
        (`$XDG_CACHE_HOME/vidax_eqx/jax` or `~/.cache/vidax_eqx/jax`), created if
        needed. The thresholds are set so that the big programs are written, when they
        are still at JAX's defaults: programs that compile in at least
        `MIN_COMPILE_TIME_SECS` (0.5 s; JAX's default is 1 s), of any size
        (`jax_persistent_cache_min_entry_size_bytes = -1`).

    Called by the pipelines' `from_pretrained` (unless `compile_cache=False`) and by
    `vidax-generate` (unless `--no-compile-cache`). The cache is trusted code: keep the
    folder private to its user (JAX's warning).

    **Returns:**

    The cache folder in use, or `None` when it is off.
    """
    setting = os.environ.get(ENVIRONMENT, "").strip()
    if setting.lower() in _OFF:
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    folder = os.fspath(directory) if directory is not None else (
        setting or default_compile_cache_dir())
    os.makedirs(folder, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    if jax.config.jax_persistent_cache_min_compile_time_secs == _JAX_DEFAULT_MIN_COMPILE_TIME_SECS:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_SECS)
    if jax.config.jax_persistent_cache_min_entry_size_bytes == _JAX_DEFAULT_MIN_ENTRY_SIZE_BYTES:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return folder
