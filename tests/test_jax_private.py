"""The private and undocumented JAX entry points of `vidax_eqx._jax_private`, against the installed JAX.

Each record is imported afresh from its JAX module path and attribute name (not
from what `_jax_private` bound), and every parameter we pass must exist with the
kind we use: the positional ones at their positions, the keyword ones accepting a
keyword, and no parameter without a default left out. A JAX upgrade that moves,
renames or reorders one fails here, naming the entry point and the JAX version,
rather than leaving `"pallas_tpu"` / `"pallas_gpu"` silently unregistered.
"""

import importlib
import inspect
import re

import jax
import pytest

from vidax_eqx import _jax_private, kernels
from vidax_eqx._jax_private import ENTRY_POINTS


P = inspect.Parameter
POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
KEYWORD = (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)


def _fail(name: str, problem: str):
    entry = ENTRY_POINTS[name]
    pytest.fail(f"JAX {jax.__version__}: entry point {name!r} ({entry.where}): {problem}", pytrace=False)


def _import(name: str):
    entry = ENTRY_POINTS[name]
    try:
        module = importlib.import_module(entry.module)
    except ImportError as e:
        _fail(name, f"module not importable ({e})")
    if not hasattr(module, entry.attr):
        _fail(name, f"{entry.module} has no attribute {entry.attr!r}")
    return getattr(module, entry.attr)


def _problems(entry, obj) -> list[str]:
    """What of `entry`'s recorded call `obj`'s signature does not accept."""
    problems = []
    if entry.positional or entry.keyword:
        try:
            params = list(inspect.signature(obj).parameters.values())
        except (TypeError, ValueError) as e:
            return [f"no signature to check ({e})"]
        for i, name in enumerate(entry.positional):
            if i >= len(params) or params[i].kind not in POSITIONAL:
                problems.append(f"takes no positional parameter at position {i} (we pass {name!r} there)")
            elif params[i].name != name:
                problems.append(f"position {i} is {params[i].name!r}, we pass {name!r} there")
        by_name = {p.name: p for p in params}
        for name in entry.keyword:
            if name not in by_name:
                problems.append(f"has no parameter {name!r} (we pass it by keyword)")
            elif by_name[name].kind not in KEYWORD:
                problems.append(f"parameter {name!r} is {by_name[name].kind.description}, we pass it by keyword")
        passed = set(entry.positional) | set(entry.keyword)
        for p in params:
            if p.default is P.empty and p.kind in POSITIONAL + KEYWORD and p.name not in passed:
                problems.append(f"requires {p.name!r}, which we do not pass")
    for attr in entry.attributes:
        if not hasattr(obj, attr):
            problems.append(f"has no attribute {attr!r} (we read it)")
    return problems


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_entry_point_signature(name):
    problems = _problems(ENTRY_POINTS[name], _import(name))
    if problems:
        _fail(name, "; ".join(problems))


def test_records_are_consistent():
    """No parameter recorded as both positional and keyword; every path well formed."""
    for name, entry in ENTRY_POINTS.items():
        assert not set(entry.positional) & set(entry.keyword), name
        for path in entry.returns:
            assert re.fullmatch(r"\w+(\[\w+\]|\.\w+)*", path), (name, path)


def _resolve(obj, path: str):
    for attr, key in re.findall(r"\.?(\w+)|\[(\w+)\]", path):
        obj = getattr(obj, attr) if attr else obj[key]
    return obj


def test_splash_kernel_reads():
    """The attributes the TPU backward reads on a splash kernel, on tiny causal ones
    built as `"pallas_tpu"` builds them (`SplashAttentionKernel` from mask infos of a
    positions mask and of a sliding tile mask, unfused and fused)."""
    from vidax_eqx.kernels.pallas_tpu._mask import splash_kernel_for

    tm = kernels.SlidingTileMask((2, 4, 4), (1, 2, 2), (1, 1, 1), text_len=32)
    for tile_mask in (None, tm):
        for fused in (False, True):
            blocks = kernels.SplashBlocks(128, 128, fused_bwd=fused)
            kernel = splash_kernel_for((256, 256), 256, True, None, None, blocks, True, tile_mask)
            for path in ENTRY_POINTS["SplashAttentionKernel"].returns:
                if fused and path.startswith("dq_mask_info"):
                    continue  # a fused backward has no dQ kernel
                try:
                    _resolve(kernel, path)
                except (AttributeError, KeyError, TypeError) as e:
                    _fail("SplashAttentionKernel", f"the kernel has no {path} ({type(e).__name__}: {e})")


def test_splash_computable_mask_reads():
    """What splash reads on a mask computed in the kernel (`q_sequence`, `mask_function`,
    `shape`), on `"pallas_tpu"`'s subclass for the sliding tile mask."""
    from vidax_eqx.kernels.pallas_tpu._mask import SplashTileMask

    mask = SplashTileMask(kernels.SlidingTileMask((2, 4, 4), (1, 2, 2), (1, 1, 1)), (128, 128))
    assert isinstance(mask, _jax_private.SplashComputableMask)
    for path in ENTRY_POINTS["SplashComputableMask"].returns:
        try:
            _resolve(mask, path)
        except (AttributeError, KeyError, TypeError) as e:
            _fail("SplashComputableMask", f"a subclass instance has no {path} ({type(e).__name__}: {e})")
    assert mask.shape == (128, 128) and mask.q_sequence.shape == (128,)


def test_all_bound():
    """The installed JAX has every entry point, each bound in `_jax_private` to the
    object at its recorded path."""
    assert not _jax_private.MISSING, _jax_private.MISSING
    for name, entry in ENTRY_POINTS.items():
        assert getattr(_jax_private, name) is entry.load(), name


def test_pallas_registered():
    """The Pallas implementations did not silently unregister (a missing entry point would)."""
    names = kernels.implementations()
    assert "pallas_tpu" in names and "pallas_gpu" in names, (jax.__version__, sorted(names))


def test_missing_entry_point_raises_by_name():
    """A name the installed JAX lacks: an AttributeError naming it, and `from ... import`
    an ImportError (what the registry's guarded imports catch)."""
    _jax_private.MISSING["_test_absent"] = "AttributeError: absent"
    _jax_private.ENTRY_POINTS["_test_absent"] = _jax_private.EntryPoint("jax", "_absent", "a test")
    try:
        with pytest.raises(AttributeError, match=r"jax\._absent.*a test"):
            _jax_private._test_absent
        with pytest.raises(ImportError):
            from vidax_eqx._jax_private import _test_absent  # noqa: F401
    finally:
        del _jax_private.MISSING["_test_absent"], _jax_private.ENTRY_POINTS["_test_absent"]
