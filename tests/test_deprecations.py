"""Old spellings keep working for one release (`vidax_eqx/_deprecation.py`).

Every public name, keyword and attribute renamed or moved since 0.1.0 is listed here
with its replacement: using it raises a `DeprecationWarning` that names the new
spelling and the release that removes it (0.3.0), and it gives what the new spelling
gives. The list is CHANGELOG.md's "Deprecated" section.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import vidax_eqx
from vidax_eqx import nn, parallel
from vidax_eqx._deprecation import REMOVED_IN, VidaxDeprecationWarning
from vidax_eqx.nn import sharding

import harness


def _warns(new: str):
    """`pytest.warns` for a deprecation whose message names `new` (literally)."""
    return pytest.warns(DeprecationWarning, match=re.escape(new))


# -- names moved: `vidax_eqx.nn.X` -> `vidax_eqx.nn.sharding.X` ---------------------------

MOVED = {
    (nn, name): (sharding, name)
    for name in (
        "FSDPShard", "ParallelConfig", "filter_shard_map", "fsdp_axes_of", "fsdp_gather",
        "gather_tokens", "partition_specs", "replicated_parameters", "shard_like",
        "shard_module", "shard_tokens", "with_parallel",
    )
}


@pytest.mark.parametrize("old, new", MOVED.items(), ids=lambda x: ".".join(
    (x[0].__name__, x[1])) if isinstance(x, tuple) else None)
def test_moved_name_warns_and_is_the_new_object(old, new):
    (old_module, name), (new_module, new_name) = old, new
    with _warns(f"{new_module.__name__}.{new_name}") as record:
        got = getattr(old_module, name)
    assert got is getattr(new_module, new_name)
    message = str(record[0].message)
    assert f"{old_module.__name__}.{name}" in message and REMOVED_IN in message
    # `from vidax_eqx.nn import ParallelConfig` goes through the same door.
    with _warns(f"{new_module.__name__}.{new_name}"):
        exec(f"from {old_module.__name__} import {name}", {})


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        nn.no_such_name  # noqa: B018


# -- keywords and attributes ----------------------------------------------------------------


@pytest.mark.parametrize("old, new", [
    (dict(sequence="ulysses", sp_axis="u"), dict(sequence="ulysses", ulysses_axis="u")),
    (dict(sequence="ring", sp_axis="r"), dict(sequence="ring", ring_axis="r")),
    (dict(sequence="usp", sp_axis="u", ring_axis="r"),
     dict(sequence="usp", ulysses_axis="u", ring_axis="r")),
    (dict(sequence="none", sp_axis="sp"), dict(sequence="none")),
    (dict(sp_axis="sp", tp_axis="tp"), dict(tp_axis="tp")),  # 0.1.0's default: one device
])
def test_parallel_config_sp_axis_keyword(old, new):
    with _warns("`ulysses_axis=` (Ulysses, USP) or `ring_axis=` (a ring)"):
        got = sharding.ParallelConfig(**old)
    assert got == sharding.ParallelConfig(**new)


def test_parallel_config_sp_axis_keyword_positional_mode_and_conflict():
    with _warns("`ring_axis=`"):
        assert sharding.ParallelConfig("ring", sp_axis="r") == sharding.ParallelConfig(
            "ring", ring_axis="r")
    with pytest.raises(TypeError, match="both `sp_axis`"), pytest.warns(DeprecationWarning):
        sharding.ParallelConfig(sequence="ulysses", sp_axis="a", ulysses_axis="b")


@pytest.mark.parametrize("config, axis", [
    (dict(sequence="ulysses", ulysses_axis="u"), "u"),
    (dict(sequence="ring", ring_axis="r"), "r"),
    (dict(sequence="usp", ulysses_axis="u", ring_axis="r"), "u"),  # 0.1.0: Ulysses' axis
    (dict(), "sp"),
])
def test_parallel_config_sp_axis_attribute(config, axis):
    config = sharding.ParallelConfig(**config)
    with _warns("ParallelConfig.ulysses_axis / .ring_axis"):
        got = config.sp_axis
    assert got == axis == (config.ulysses_axis or config.ring_axis or parallel.SP_AXIS)


def test_ring_attention_axis_name_keyword():
    mesh = harness.mesh(sp=2)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(harness.normal(rng, (1, 8, 2, 8))) for _ in range(3))

    def run(**axis):
        f = lambda q, k, v: parallel.ring_attention(q, k, v, causal=True, **axis)  # noqa: E731
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(None, "sp"),
                                     out_specs=P(None, "sp")))(q, k, v)

    with _warns("`ring_axis=`"):
        old = run(axis_name="sp")
    np.testing.assert_array_equal(old, run(ring_axis="sp"))
    with pytest.raises(TypeError, match="both `axis_name`"):
        run(axis_name="sp", ring_axis="sp")


# -- the warning itself ---------------------------------------------------------------------


def test_warned_once_per_call_site_and_named_for_the_user():
    """Python's "default" action for the library's category: one warning per line of the
    caller (not of the library), however often that line runs."""
    with warnings.catch_warnings(record=True) as record:
        warnings.resetwarnings()
        warnings.filterwarnings("default", category=VidaxDeprecationWarning)
        for _ in range(3):
            nn.with_parallel  # noqa: B018
        nn.with_parallel  # noqa: B018  (another line: warned again)
    assert len(record) == 2
    assert {r.filename for r in record} == {__file__}
    assert all(issubclass(r.category, DeprecationWarning) for r in record)


def test_the_library_uses_no_deprecated_spelling():
    """Importing every public module and building the configurations the library builds
    raises no deprecation of the library's own (CI's newest-JAX leg runs other files
    with every `DeprecationWarning` an error)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", VidaxDeprecationWarning)
        import vidax_eqx.core, vidax_eqx.interop, vidax_eqx.models, vidax_eqx.sampling  # noqa: E401, F401
        sharding.ParallelConfig(sequence="usp", ring_axis="ring", tp_axis="tp")
    assert vidax_eqx.__version__


def test_the_changelog_lists_every_old_spelling_and_the_version():
    """CHANGELOG.md's entry for this version lists each spelling tested here under
    "Deprecated", with its replacement (the docs' conventions: no public name leaves
    without a deprecation release)."""
    import pathlib

    text = (pathlib.Path(__file__).resolve().parent.parent / "CHANGELOG.md").read_text()
    entry = text.split(f"- {vidax_eqx.__version__}\n", 1)[1].split("\n## [", 1)[0]
    deprecated = entry.split("### Deprecated", 1)[1].split("\n### ", 1)[0]
    for (old_module, name), (new_module, new_name) in MOVED.items():
        assert f"`{old_module.__name__}.{name}` -> `{new_module.__name__}.{new_name}`" in deprecated
    for old, new in (("ParallelConfig(sp_axis=...)", "ring_axis="),
                     ("ParallelConfig.sp_axis", "ParallelConfig.ulysses_axis"),
                     ("parallel.ring_attention(axis_name=...)", "ring_axis=...")):
        assert old in deprecated and new in deprecated
    assert REMOVED_IN in deprecated


def test_t5_encoder_embedding_attributes():
    """`T5Encoder.shared` / `.relative_attention_bias` (0.1.0) are `embeddings.shared` /
    `embeddings.relative_attention_bias`."""
    from vidax_eqx.models import T5Encoder, T5EncoderConfig

    model = T5Encoder(T5EncoderConfig(vocab_size=16, d_model=8, d_kv=4, d_ff=12, num_heads=2, num_layers=1),
                      key=jax.random.key(0))
    with pytest.warns(DeprecationWarning, match="embeddings.shared"):
        assert model.shared is model.embeddings.shared
    with pytest.warns(DeprecationWarning, match="embeddings.relative_attention_bias"):
        assert model.relative_attention_bias is model.embeddings.relative_attention_bias
