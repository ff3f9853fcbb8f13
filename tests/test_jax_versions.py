"""What the library needs of the JAX it runs on, on every JAX in the tested range (0.10.2
on Python 3.11, 0.11.2 and 0.12.0.1 on Python 3.12, see `.ci/run`):

- GPU programs lower from a host without a GPU, for the default target or the one
  `kernels.gpu_target` names (JAX 0.11+ asks for an abstract GPU device there);
- the library's own calls raise no `DeprecationWarning`, JAX 0.12's deprecations of
  the Pallas GPU attention module and of the Pallas Triton backend included (they
  are recorded in `_jax_private` and silenced only for the library's own import and
  lowering);
- the requirement in `pyproject.toml` admits the JAX installed;
- jaxlib 0.11.x's crash on a `shard_map` with an empty input is a clear error instead.
"""

import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from vidax_eqx import _jax_private, kernels, nn


ROOT = pathlib.Path(__file__).resolve().parent.parent
Q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)


def _lower_for_cuda(fn) -> str:
    return jax.jit(fn).trace(Q).lower(lowering_platforms=("cuda",)).as_text()


def _triton_calls(text: str) -> int:
    return text.count("__gpu$xla.gpu.triton")


def test_pallas_gpu_lowers_for_cuda_from_this_host_without_warnings():
    forward = lambda q: kernels.attention(q, q, q, implementation="pallas_gpu")  # noqa: E731
    backward = jax.grad(lambda q: forward(q).astype(jnp.float32).sum())
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert _triton_calls(_lower_for_cuda(forward)) == 1
        assert _triton_calls(_lower_for_cuda(backward)) == 2  # dq, and dk / dv
        with kernels.gpu_target("NVIDIA A100-SXM4-80GB"):
            assert _triton_calls(_lower_for_cuda(forward)) == 1


def test_auto_lowers_for_cuda_and_cpu_in_one_export():
    """A multi-platform export: the CPU branch and the GPU branch (traced for its target
    while the host is a CPU) in one program."""
    fn = lambda q: kernels.attention(q, q, q, causal=True)  # noqa: E731
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = jax.export.export(jax.jit(fn), platforms=("cpu", "cuda"),
                                 disabled_checks=[triton])(Q)
    assert exported.platforms == ("cpu", "cuda")
    out = exported.call(jnp.ones(Q.shape, Q.dtype))
    assert out.shape == Q.shape and bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))


def test_gpu_target_checks_its_argument():
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match=r"gpu_target: `device_kind` must be a GPU's device kind"):
            with kernels.gpu_target(bad):
                pass


def test_deprecated_entry_points_are_recorded():
    """The names JAX 0.12 deprecates say so in their record, and importing them warns
    nothing here."""
    deprecated = {name for name, e in _jax_private.ENTRY_POINTS.items() if e.deprecated}
    assert {"gpu_mha", "gpu_mha_backward_kernel", "GpuBlockSizes"} <= deprecated
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in deprecated - set(_jax_private.MISSING):
            _jax_private.ENTRY_POINTS[name].load()


def test_requirement_admits_this_jax():
    text = (ROOT / "pyproject.toml").read_text()
    low, high = re.search(r'"jax>=([\d.]+),<([\d.]+)"', text).groups()
    version = tuple(int(p) for p in re.findall(r"\d+", jax.__version__)[:3])
    as_tuple = lambda s: tuple(int(p) for p in s.split("."))  # noqa: E731
    assert as_tuple(low) <= version < as_tuple(high), (jax.__version__, low, high)


def test_an_empty_shard_map_input_is_refused_where_jaxlib_crashes_on_it():
    """jaxlib 0.11.x's CPU compiler segfaults on a shard_map with an empty input: the
    library's entry points raise a clear error there, and run it elsewhere."""
    mesh = jax.sharding.Mesh(jax.devices()[:2], ("sp",))
    join = nn.sharding.filter_shard_map(
        lambda t, x: jnp.concatenate([jax.lax.pcast(t, "sp", to="varying"), x], 1),
        mesh=mesh, in_specs=(P(), P(None, "sp")), out_specs=P(None, "sp"))
    text, empty = jnp.ones((1, 3, 4)), jnp.ones((1, 0, 4))
    if _jax_private.EMPTY_SHARD_MAP_INPUT_CRASHES:
        with pytest.raises(ValueError, match=r"crashes on a shard_map with an empty input.*\(1, 0, 4\)"):
            join(text, empty)
    else:
        assert join(text, empty).shape == (1, 6, 4)
