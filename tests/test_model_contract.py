"""The declared model contract: every model class of `vidax_eqx.models` carries a
`Capabilities` record, the samplers and pipelines read that record (never the model's
class or its attributes), and a combination the record refuses raises in one line naming
the model and the capability.

The models here are abstract (`eqx.filter_eval_shape`: no arrays, nothing compiled); every
refusal is raised while the call's arguments are checked, before any array is read."""

import ast
import dataclasses
import inspect
import pathlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

from vidax_eqx import models, sampling
from vidax_eqx.models.internal import require_capability

_WAN = dict(dim=16, ffn_dim=32, num_heads=2, num_layers=1, in_channels=4, out_channels=4,
            text_dim=8, freq_dim=16, patch_size=(1, 2, 2))


def _abstract(cls, config):
    return eqx.filter_eval_shape(lambda: cls(config, key=jax.random.key(0)))


@pytest.fixture(scope="module")
def wan():
    return _abstract(models.WanTransformer3D, models.WanConfig(**_WAN))


@pytest.fixture(scope="module")
def skyreels():
    return _abstract(models.SkyReelsV2Transformer3D, models.SkyReelsV2Config(**_WAN))


@pytest.fixture(scope="module")
def cogvideox():
    config = models.CogVideoXConfig(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                    out_channels=4, time_embed_dim=16, text_embed_dim=8,
                                    num_layers=1, sample_width=8, sample_height=8, sample_frames=5)
    return _abstract(models.CogVideoXTransformer3D, config)


def _model_classes():
    return sorted({obj for obj in vars(models).values()
                   if inspect.isclass(obj) and issubclass(obj, models.AbstractModel)
                   and not inspect.isabstract(obj)}, key=lambda c: c.__name__)


def test_every_model_declares_its_record():
    classes = _model_classes()
    assert {c.__name__ for c in classes} >= {"WanTransformer3D", "SkyReelsV2Transformer3D",
                                              "WanExperts", "CogVideoXTransformer3D"}
    for cls in classes:
        caps = cls.capabilities
        assert isinstance(caps, models.Capabilities), cls
        # What the record says is what the class has: the calls it declares exist.
        assert caps.step_cache == hasattr(cls, "cached_call"), cls
        assert caps.text_cache == hasattr(cls, "text_cache"), cls
        assert caps.streaming == (hasattr(cls, "stream") and hasattr(cls, "kv_cache")), cls
        assert caps.experts == issubclass(cls, models.AbstractExperts), cls
    table = {c.__name__: c.capabilities for c in classes}
    assert table["WanTransformer3D"].timestep == "token"
    assert table["SkyReelsV2Transformer3D"].timestep == "frame"
    assert table["CogVideoXTransformer3D"].latents == "FCHW"
    assert table["CogVideoXTransformer3D"].channel_axis == 1
    assert not table["WanExperts"].streaming


def test_model_io_properties(wan, cogvideox):
    assert (wan.in_channels, wan.out_channels, wan.patch_size, wan.text_dim) == (4, 4, (1, 2, 2), 8)
    assert (cogvideox.in_channels, cogvideox.patch_size, cogvideox.text_dim) == (4, (1, 2, 2), 8)


def test_record_is_checked():
    good = dict(latents="CFHW", timestep="token", text_cache=True, step_cache=True,
                streaming=False, experts=False, image=frozenset({"frames"}))
    models.Capabilities(**good)
    for field, value, message in (
            ("latents", "BCFHW", r"`latents` must be one of \('CFHW', 'FCHW'\); received 'BCFHW'"),
            ("timestep", "step", r"`timestep` must be one of"),
            ("streaming", 1, r"`streaming` must be a bool; received 1"),
            ("image", {"mask"}, r"`image` must be a subset of .*; received \['mask'\]")):
        with pytest.raises(ValueError, match=message):
            models.Capabilities(**{**good, field: value})
    with pytest.raises(ValueError, match="`frames` needs a timestep per token"):
        models.Capabilities(**{**good, "timestep": "frame"})


def _io(B=1, C=4, F=2, H=4, W=4, layout="CFHW"):
    shape = (B, C, F, H, W) if layout == "CFHW" else (B, F, C, H, W)
    noise = jax.random.normal(jax.random.key(1), shape)
    context = jax.random.normal(jax.random.key(2), (B, 3, 8))
    return noise, context


def test_refusals_name_model_and_capability(wan, skyreels, cogvideox):
    noise, context = _io(layout="FCHW")
    one_line = r"^[^\n]*CogVideoXTransformer3D[^\n]*capabilities\.step_cache is False\)\.$"
    with pytest.raises(NotImplementedError, match=one_line):
        sampling.sample(cogvideox, noise, context, steps=2, guidance=sampling.Guidance(scale=1.0),
                        caching=sampling.Caching(step=sampling.StaticStepCache()))
    with pytest.raises(NotImplementedError, match=r"a WanExperts has no streaming .*"
                       r"WanExperts\.capabilities\.streaming is False"):
        experts = models.WanExperts(wan, wan, boundary=0.9)
        require_capability("WanPipeline.stream", experts, "streaming")
    # Diffusion forcing: a timestep per frame (SkyReels-V2), which Wan's record does not say.
    noise, context = _io()
    forcing = sampling.DiffusionForcing(causal_block_size=1)
    with pytest.raises(ValueError, match=r"timestep per latent frame .* WanTransformer3D, whose capabilities.timestep is 'token'"):
        sampling.sample(wan, noise, context, steps=2, guidance=sampling.Guidance(scale=1.0),
                        forcing=forcing)
    # TI2V's condition frames need a timestep per token: SkyReels-V2 takes one per frame.
    condition = noise[:, :, :1]
    with pytest.raises(ValueError, match=r"SkyReelsV2Transformer3D does not take .*'frames'"):
        sampling.sample(skyreels, noise, context, steps=2, guidance=sampling.Guidance(scale=1.0),
                        condition=condition, fps=0)
    # The latents' layout comes from the record: CogVideoX's frames-first noise for Wan fails.
    bad, _ = _io(C=3)
    with pytest.raises(ValueError, match=r"`noise` must have the model's 4 latent channels .*\(B, C, F, H, W\)"):
        sampling.sample(wan, bad, context, steps=2, guidance=sampling.Guidance(scale=1.0))


def test_calls_written_once():
    # The public calls live on AbstractVideoDiT alone; Wan writes one forward, SkyReels-V2
    # the one hook (its fps and timestep per frame) and no call of its own.
    calls = {"__call__", "cached_call", "stream"}
    assert calls <= set(vars(models.AbstractVideoDiT))
    assert not calls & set(vars(models.WanTransformer3D))
    assert "_forward" in vars(models.WanTransformer3D)
    sky = set(vars(models.SkyReelsV2Transformer3D))
    assert not sky & (calls | {"_forward"}) and "_conditioning" in sky
    assert issubclass(models.SkyReelsV2Transformer3D, models.AbstractVideoDiT)


def test_base_calls_read_the_record(wan):
    # A family without streaming or step caching (a subclass and its record) is refused
    # by the base's calls in one line naming the model and the capability, before any
    # array is read.
    class NoCaches(models.WanTransformer3D):
        capabilities = dataclasses.replace(models.WanTransformer3D.capabilities,
                                           step_cache=False, streaming=False, text_cache=False)

    model = _abstract(NoCaches, models.WanConfig(**_WAN))
    x, context = jnp.zeros((4, 2, 4, 4)), jnp.zeros((3, 8))
    t = jnp.float32(500.0)
    with pytest.raises(NotImplementedError, match=r"^NoCaches: a NoCaches has no streaming .*"
                       r"NoCaches\.capabilities\.streaming is False\)\.$"):
        model.stream(x, t, context, wan.kv_cache(4, 4, max_frames=2))
    with pytest.raises(NotImplementedError, match=r"NoCaches\.capabilities\.step_cache is False"):
        model.cached_call(x, t, context, models.StepCache())
    with pytest.raises(NotImplementedError, match=r"NoCaches\.capabilities\.text_cache is False"):
        model(x, t, context, text_cache=eqx.filter_eval_shape(lambda m: m.text_cache(context), wan))
    # A keyword the model's hook does not take names the model; SkyReels-V2's hook takes
    # `fps`, Wan's none.
    with pytest.raises(TypeError, match=r"WanTransformer3D: unexpected keyword arguments \['fps'\]"):
        eqx.filter_eval_shape(lambda m: m(x, t, context, fps=0), wan)
    with pytest.raises(ValueError, match=r"CallState: a call is step-cached or streamed"):
        models.CallState(step=object(), kv_cache=object())


_ROOT = pathlib.Path(__file__).resolve().parent.parent / "vidax_eqx"
_MODEL_CLASS = re.compile(r"^(Wan|SkyReels|CogVideoX|T5|CLIP)[A-Za-z0-9]*$")


def test_floors_above_read_the_record():
    """`sampling/` and `pipelines/` never test a model's class with `isinstance` nor probe
    a model with `hasattr` (the abstract base `AbstractModel` tells a model from a plain
    function; everything else is the record's)."""
    found = []
    for folder in ("sampling", "pipelines"):
        for path in sorted((_ROOT / folder).glob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                    continue
                if node.func.id == "isinstance" and len(node.args) == 2:
                    classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                    for c in classes:
                        name = c.attr if isinstance(c, ast.Attribute) else getattr(c, "id", "")
                        if _MODEL_CLASS.match(name) and not name.endswith(("Config", "Processor")):
                            found.append(f"{path.name}:{node.lineno} isinstance(..., {name})")
                if node.func.id == "hasattr" and ast.unparse(node.args[0]).split(".")[-1] in (
                        "model", "transformer", "t"):
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


def test_docs_table_is_the_records():
    """docs/api/models.md's capability table is `models.capability_table()`, over every
    model class."""
    assert {c.__name__ for c in _model_classes()} == {c.__name__ for c in models._table.MODELS}
    page = (_ROOT.parent / "docs" / "api" / "models.md").read_text()
    start = page.index("<!-- capabilities table")
    block = page[page.index("\n", start) + 1:page.index("<!-- end of capabilities table -->")]
    assert block.strip() == models.capability_table().strip(), (
        "docs/api/models.md's capability table is stale: paste models.capability_table()")
