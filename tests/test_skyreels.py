"""SkyReels-V2's transformer (`models.SkyReelsV2Transformer3D`) against diffusers'
`SkyReelsV2Transformer3DModel`, on the tiny random models of
`tests/fixtures/skyreels/` (written by `scripts/make_skyreels_fixtures.py` with
diffusers 0.42.1; CI never needs torch):

1. parity, float32: diffusion forcing (a timestep per latent frame, the fps embedding),
   one timestep per example with fps, and I2V;
2. sharded (Ulysses x TP, the zigzag ring over dp x sp) equals one device, per-frame
   timesteps and fps included;
3. checkpoints: diffusers' names, `save_pretrained` -> `from_pretrained` bit for bit;
4. what is refused: fps where the model has no embedding, none where it has one, an
   index outside {0, 1}, a per-frame timestep of the wrong length; and the frame-block
   causal mask (`num_frame_per_block=3`): diffusers' output, a rolling window, sharded
   (Ulysses x TP, the zigzag ring) equal to one device;
5. diffusion forcing (`sampling.sample(forcing=...)`): the schedule is diffusers'
   `generate_timestep_matrix` exactly, and the loop's latents are those of diffusers'
   `SkyReelsV2DiffusionForcingPipeline` (`output_type="latent"`) from the same noise,
   synchronous and asynchronous, in blocks of 1 and of 2 frames (the model's attention
   then frame-block causal); without the reference's aliasing, the synchronous loop is
   the ordinary one;
6. the pipeline (`pipelines.SkyReelsV2DiffusionForcingPipeline`, torch-free): diffusers'
   frames from the same initial latents (synchronous, asynchronous, asynchronous in causal
   blocks of 2), and `vidax-generate --ar-step --causal-block-size` on its folder.
"""

import dataclasses
import functools
import json
import pathlib
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import harness
from vidax_eqx import generate, models, nn, pipelines, sampling


FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "skyreels"
RTOL = 1e-5  # max abs error over max abs output, float32
JIT = functools.partial(eqx.filter_jit, compiler_options=harness.FAST_COMPILE)


def _load(name: str):
    model = models.SkyReelsV2Transformer3D.from_pretrained(FIXTURES / name / "diffusers")
    return model, {k: jnp.asarray(v) for k, v in np.load(FIXTURES / name / "io.npz").items()}


@pytest.fixture(scope="module")
def df():
    return _load("df")


@JIT
def _batched(model, x, t, c, fps):
    return jax.vmap(lambda x, t, c, f: model(x, t, c, fps=f))(x, t, c, fps)


# -- 1. parity ----------------------------------------------------------------------------


@pytest.mark.parametrize("timestep, out", [("timestep", "out"), ("timestep_scalar", "out_scalar")],
                         ids=["per-frame", "scalar"])
def test_diffusion_forcing_matches_diffusers(df, timestep, out):
    model, io = df
    with jax.default_matmul_precision("highest"):
        got = _batched(model, io["x"], io[timestep], io["context"], io["fps"])
    assert harness.max_rel_error(got, io[out]) < RTOL


def test_i2v_matches_diffusers():
    model, io = _load("i2v")
    with jax.default_matmul_precision("highest"):
        got = JIT(lambda m, x, t, c, ci: jax.vmap(lambda *a: m(*a[:3], context_image=a[3]))(x, t, c, ci))(
            model, io["x"], io["timestep"], io["context"], io["context_image"])
    assert harness.max_rel_error(got, io["out"]) < RTOL


def test_fps_changes_the_output(df):
    """The embedding's two entries differ, so a dropped `fps` could not pass parity; and
    a per-frame timestep that is constant is the scalar one."""
    model, io = df
    x, c = io["x"][0], io["context"][0]
    t = jnp.full((x.shape[1],), 500.0)
    a, b, s = (JIT(lambda m, t, f: m(x, t, c, fps=f))(model, tt, f) for tt, f in ((t, 0), (t, 1), (t[0], 1)))
    assert harness.max_rel_error(a, b) > 1e-3
    assert harness.max_rel_error(b, s) < 1e-6


# -- 2. sharded == one device --------------------------------------------------------------

SHARDED = {
    "ulysses-sp4-tp2": (dict(sp=4, tp=2), dict(sequence="ulysses", tp_axis="tp"), None),
    "ring-zigzag-dp2-sp4": (dict(dp=2, sp=4), dict(sequence="ring", layout="zigzag"), "dp"),
}


@pytest.mark.parametrize("name", SHARDED)
def test_sharded_equals_one_device(df, name):
    model, io = df
    mesh_axes, config, batch_axis = SHARDED[name]
    mesh = harness.mesh(**mesh_axes)
    sharded = nn.sharding.shard_module(nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(**config)), mesh)
    run = JIT(functools.partial(models.run_sharded, mesh=mesh, batch_axis=batch_axis))
    out = run(sharded, io["x"], io["timestep"], io["context"], fps=io["fps"])
    one = _batched(model, io["x"], io["timestep"], io["context"], io["fps"])
    assert harness.max_rel_error(out, one) < 2e-6


# -- 3. checkpoints ---------------------------------------------------------------------------


def test_names_are_diffusers_and_round_trip(df, tmp_path):
    model, _ = df
    names = set(load_file(FIXTURES / "df" / "diffusers" / "diffusion_pytorch_model.safetensors"))
    state = model.state_dict()
    assert set(state) == names and {"fps_embedding.weight", "fps_projection.net.0.proj.weight",
                                     "fps_projection.net.2.weight"} <= names
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    reference = json.loads((FIXTURES / "df" / "diffusers" / "config.json").read_text())
    assert {k: v for k, v in config.items() if not k.startswith("_")} == {
        k: v for k, v in reference.items() if not k.startswith("_") and k in config}
    assert config["_class_name"] == "SkyReelsV2Transformer3DModel"
    again = models.SkyReelsV2Transformer3D.from_pretrained(tmp_path)
    assert again.config == model.config
    for a, b in zip(jax.tree.leaves(eqx.filter(again, eqx.is_array)), jax.tree.leaves(eqx.filter(model, eqx.is_array))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="only diffusers' layout"):
        model.save_pretrained(tmp_path / "wan", layout="wan")


def test_a_wan_checkpoint_is_refused(tmp_path):
    wan = FIXTURES.parent / "wan" / "t2v" / "diffusers"
    with pytest.raises(ValueError, match="WanTransformer3DModel config, not a diffusers SkyReelsV2"):
        models.SkyReelsV2Transformer3D.from_pretrained(wan)


# -- 4. refused ----------------------------------------------------------------------------


def test_fps_is_required_by_the_embedding_and_refused_without_it(df):
    model, io = df
    x, t, c = io["x"][0], io["timestep"][0], io["context"][0]
    with pytest.raises(ValueError, match=r"needs `fps`"):
        model(x, t, c)
    with pytest.raises(ValueError, match=r"`fps` is an index, 0 or 1; received 2"):
        model(x, t, c, fps=2)
    i2v, io2 = _load("i2v")
    with pytest.raises(ValueError, match=r"has none, received fps=1"):
        i2v(io2["x"][0], io2["timestep"][0], io2["context"][0], context_image=io2["context_image"][0], fps=1)


def test_per_frame_timestep_length(df):
    model, io = df
    with pytest.raises(ValueError, match=r"one value per latent frame of the patch grid: 4 .*received 3"):
        model(io["x"][0], io["timestep"][0][:3], io["context"][0], fps=0)


@pytest.fixture(scope="module")
def block3():
    return _load("df_block3")


def _no_mask(tmp_path):
    """The `df_block3` weights with `num_frame_per_block = 1`: attending to every frame."""
    folder = tmp_path / "no_mask"
    shutil.copytree(FIXTURES / "df_block3" / "diffusers", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, num_frame_per_block=1)))
    return models.SkyReelsV2Transformer3D.from_pretrained(folder)


def test_block_causal_matches_diffusers(block3, tmp_path):
    """`num_frame_per_block=3` over 6 latent frames: diffusers' frame-block causal mask
    (frames 0-2 see themselves, 3-5 all six), per-frame timesteps; and the mask matters
    (the same weights without it are far from diffusers' output)."""
    model, io = block3
    assert model.config.num_frame_per_block == 3
    call = JIT(lambda m, x, t, c: jax.vmap(lambda x, t, c: m(x, t, c))(x, t, c))
    with jax.default_matmul_precision("highest"):
        got = call(model, io["x"], io["timestep"], io["context"])
        full = call(_no_mask(tmp_path), io["x"], io["timestep"], io["context"])
    assert harness.max_rel_error(got, io["out"]) < RTOL
    assert harness.max_rel_error(full, io["out"]) > 1e-2
    # The first block sees only itself: its output is blind to the later frames.
    x = io["x"][0]
    later = x.at[:, 3:].set(0.0)
    a, b = (JIT(lambda m, x: m(x, io["timestep"][0], io["context"][0]))(model, xx) for xx in (x, later))
    np.testing.assert_array_equal(np.asarray(a[:, :3]), np.asarray(b[:, :3]))
    assert harness.max_rel_error(a[:, 3:], b[:, 3:]) > 1e-3


def test_block_causal_call_sets_the_blocks(block3, tmp_path):
    """A call's `BlockCausal` sets the blocks (diffusers' `_set_ar_attention`): a rolling
    window of one block (the second block no longer sees the first), or other blocks (the
    block-3 model at blocks of 2 is its unmasked copy at blocks of 2); nothing else
    replaces the model's mask."""
    model, io = block3
    x, t, c = io["x"][0], io["timestep"][0], io["context"][0]
    one = JIT(lambda m, x: m(x, t, c, attention=models.BlockCausal(3, window=1)))
    a, b = one(model, x), one(model, x.at[:, :3].set(0.0))
    np.testing.assert_array_equal(np.asarray(a[:, 3:]), np.asarray(b[:, 3:]))
    two = JIT(lambda m, x: m(x, t, c, attention=models.BlockCausal(2)))
    np.testing.assert_array_equal(np.asarray(two(model, x)), np.asarray(two(_no_mask(tmp_path), x)))
    with pytest.raises(ValueError, match=r"num_frame_per_block=3.*None or a BlockCausal\(frames, window\), "
                                         r"received SlidingTile"):
        model(x, t, c, attention=models.SlidingTile((1, 2, 2), (1, 1, 1)))


@pytest.mark.parametrize("name", SHARDED)
def test_block_causal_sharded_equals_one_device(block3, name):
    model, io = block3
    mesh_axes, config, batch_axis = SHARDED[name]
    mesh = harness.mesh(**mesh_axes)
    sharded = nn.sharding.shard_module(nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(**config)), mesh)
    run = JIT(functools.partial(models.run_sharded, mesh=mesh, batch_axis=batch_axis))
    out = run(sharded, io["x"], io["timestep"], io["context"])
    batched = JIT(lambda m, x, t, c: jax.vmap(lambda x, t, c: m(x, t, c))(x, t, c))
    one = batched(model, io["x"], io["timestep"], io["context"])
    assert harness.max_rel_error(out, one) < 2e-6


# -- 5. diffusion forcing ----------------------------------------------------------------------


def test_schedule_is_diffusers():
    cases = np.load(FIXTURES / "schedule.npz")
    for n in range(len([k for k in cases if k.startswith("case")])):
        frames, steps, ar_step, block = (int(v) for v in cases[f"case{n}"])
        progress, update = sampling.DiffusionForcing(ar_step, block).rows(frames, steps)
        np.testing.assert_array_equal(progress, cases[f"index{n}"])
        np.testing.assert_array_equal(update, cases[f"update{n}"])
        # every frame takes each of its steps once, in order
        assert np.all(update.sum(axis=0) == steps)
    for n in range(len([k for k in cases if k.startswith("prefix_case")])):
        frames, steps, ar_step, block, ready = (int(v) for v in cases[f"prefix_case{n}"])
        forcing = sampling.DiffusionForcing(ar_step, block, prefix_frames=ready)
        progress, update = forcing.rows(frames, steps)
        np.testing.assert_array_equal(progress, cases[f"prefix_index{n}"])
        np.testing.assert_array_equal(update, cases[f"prefix_update{n}"])
        given = ready // block * block  # diffusers' whole blocks of the prefix
        assert np.all(update[:, :given].sum(axis=0) == 0) and np.all(update[:, given:].sum(axis=0) == steps)


def test_given_frames_are_kept(df, loop_io):
    """The prefix's whole blocks and the suffix come back as they went in (never
    stepped), the prefix seen noised with `addnoise_condition` changes the others, and
    the noise needs a key."""
    model, io = df[0], loop_io
    noise = io["noise"]
    given = sampling.DiffusionForcing(ar_step=1, prefix_frames=1, suffix_frames=1)
    out = _loop(model, io, forcing=given)
    np.testing.assert_array_equal(out[:, :, :1], noise[:, :, :1])
    np.testing.assert_array_equal(out[:, :, -1:], noise[:, :, -1:])
    noised = dataclasses.replace(given, addnoise_condition=20.0)
    with pytest.raises(ValueError, match=r"addnoise_condition` \(20.0\).*pass `key`"):
        _loop(model, io, forcing=noised)
    key = jax.random.key(0)
    other = _loop(model, io, forcing=noised, key=key)
    np.testing.assert_array_equal(other[:, :, :1], noise[:, :, :1])
    assert harness.max_rel_error(other, out) > 1e-3
    assert harness.max_rel_error(_loop(model, io, forcing=noised, key=jax.random.key(1)), other) > 1e-4
    with pytest.raises(ValueError, match=r"must leave some of the 4 latent frames"):
        sampling.DiffusionForcing(prefix_frames=3, suffix_frames=1).rows(4, 2)
    with pytest.raises(ValueError, match=r"`addnoise_condition` must be a number in \[0, 1000\)"):
        sampling.DiffusionForcing(addnoise_condition=-1)


FORCING = dict(steps=4, scheduler=sampling.UniPC(shift=8.0), guidance=sampling.Guidance(scale=5.0))


@pytest.fixture(scope="module")
def loop_io():
    return {k: jnp.asarray(v) for k, v in np.load(FIXTURES / "df" / "pipeline.npz").items()}


def _loop(model, io, **kwargs):
    with jax.default_matmul_precision("highest"):
        return sampling.sample(model, io["noise"], io["context"], negative_context=io["negative_context"],
                               fps=jnp.ones(1, jnp.int32), **FORCING, **kwargs)


@pytest.mark.parametrize("case, ar_step, block", [("sync", 0, 1), ("async", 1, 1), ("sync_block2", 0, 2),
                                                   ("async_block2", 1, 2)])
def test_diffusion_forcing_loop_matches_diffusers(df, loop_io, case, ar_step, block):
    """Synchronous and asynchronous; with `causal_block_size=2` the model attends in
    frame-block causal blocks of 2 (diffusers sets them on its model)."""
    kwargs = {} if block == 1 else {"attention": models.BlockCausal(block)}
    latents = _loop(df[0], loop_io, forcing=sampling.DiffusionForcing(ar_step=ar_step, causal_block_size=block),
                    **kwargs)
    assert harness.max_rel_error(latents, loop_io[f"latents_{case}"]) < RTOL


def test_textbook_synchronous_forcing_is_the_ordinary_loop(df, loop_io):
    textbook = _loop(df[0], loop_io, forcing=sampling.DiffusionForcing(reference_aliasing=False))
    assert harness.max_rel_error(textbook, _loop(df[0], loop_io)) < 1e-6
    assert harness.max_rel_error(textbook, loop_io["latents_sync"]) > 1e-2  # the aliasing matters


def test_forcing_refusals(df, loop_io):
    model, io = df
    forcing = sampling.DiffusionForcing()
    with pytest.raises(ValueError, match=r"`forcing.causal_block_size` \(2\) must be the model's "
                                         r"num_frame_per_block \(1\).*attention=models.BlockCausal\(causal_block_size\)"):
        _loop(model, loop_io, forcing=sampling.DiffusionForcing(causal_block_size=2))
    with pytest.raises(ValueError, match=r"without `compilation.max_steps`"):
        _loop(model, loop_io, forcing=forcing, compilation=sampling.Compilation(max_steps=6))
    with pytest.raises(ValueError, match=r"must divide the latent frames; received 5 frames"):
        sampling.DiffusionForcing(causal_block_size=2).rows(5, 3)
    wan = models.WanTransformer3D.from_pretrained(FIXTURES.parent / "wan" / "t2v" / "diffusers")
    with pytest.raises(ValueError, match=r"timestep per latent frame .*received a WanTransformer3D"):
        sampling.sample(wan, jnp.zeros((1, 4, 3, 6, 10)), jnp.zeros((1, 7, 32)), steps=2,
                        guidance=sampling.Guidance(scale=1.0), forcing=forcing)


# -- 6. the pipeline ----------------------------------------------------------------------------

DF_CALL = dict(prompt=["A cat walks on the grass"], negative_prompt="bad quality", height=32, width=48,
               num_frames=9, num_inference_steps=4, guidance_scale=5.0, max_sequence_length=32, fps=24)


@pytest.fixture(scope="module")
def df_folder(tmp_path_factory):
    """The diffusion forcing pipeline folder: the Wan pipeline fixture's tokenizer, text
    encoder and VAE with the SkyReels-V2 transformer, scheduler and model index."""
    return harness.skyreels_df_folder(tmp_path_factory.mktemp("skyreels_df"))


@pytest.fixture(scope="module")
def df_pipe(df_folder):
    return pipelines.SkyReelsV2DiffusionForcingPipeline.from_pretrained(df_folder, compile_cache=False)


@pytest.mark.parametrize("case, ar_step", [("sync", 0), ("async", 1)])
def test_pipeline_matches_diffusers(df_pipe, case, ar_step):
    io = np.load(FIXTURES / "df_pipeline" / "io.npz")
    with jax.default_matmul_precision("highest"):
        out = df_pipe(**DF_CALL, latents=io["noise"], ar_step=ar_step, progress=None)
    assert harness.max_rel_error(out.latents, io[f"latents_{case}"]) < RTOL
    assert np.abs(out.frames - io[f"frames_{case}"]).max() < 2e-4  # frames in [0, 1]


def test_pipeline_causal_blocks_match_diffusers(df_pipe):
    """13 frames (4 latent frames) asynchronously in causal blocks of 2: the transformer's
    attention frame-block causal, as diffusers sets it."""
    io = np.load(FIXTURES / "df_pipeline" / "io.npz")
    with jax.default_matmul_precision("highest"):
        out = df_pipe(**dict(DF_CALL, num_frames=13), latents=io["noise_block2"], ar_step=1, causal_block_size=2,
                      progress=None)
    assert harness.max_rel_error(out.latents, io["latents_async_block2"]) < RTOL
    assert np.abs(out.frames - io["frames_async_block2"]).max() < 2e-4


@pytest.fixture
def recorded_addnoise(monkeypatch):
    """`addnoise_condition`'s noise at iteration `i` replaced by the fixture's table (the
    draw diffusers' pipeline was given there), the compiled programs cleared around it."""
    tables = {}

    def noise(key, i, shape):
        table = tables["current"]
        assert table.shape[1:] == shape
        return jnp.asarray(table)[i]

    jax.clear_caches()
    monkeypatch.setattr(sampling._forcing, "condition_noise", noise)
    yield tables
    jax.clear_caches()


WINDOW_CASES = {  # scripts/make_skyreels_fixtures.py's DF_WINDOW_CASES
    "long": dict(num_frames=17, base_num_frames=9, overlap_history=5, ar_step=1, addnoise_condition=20),
    "long_block2": dict(num_frames=21, base_num_frames=13, overlap_history=9, ar_step=1, causal_block_size=2),
    "i2v": dict(num_frames=9, ar_step=1, addnoise_condition=20, image="image"),
    "i2v_last": dict(num_frames=9, image="image", last_image="last_image"),
    "v2v": dict(num_frames=13, base_num_frames=9, overlap_history=5, video="video"),
}


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_windows_image_and_video_match_diffusers(df_pipe, recorded_addnoise, case):
    """Long videos in overlapping windows (the overlap given, noised with
    `addnoise_condition`; cut to whole causal blocks), image to video (first, and last
    frame) and video to video, against diffusers' three pipelines from the same draws."""
    io = np.load(FIXTURES / "df_pipeline" / "windows.npz")
    call = dict(WINDOW_CASES[case])
    for name in ("image", "last_image", "video"):
        if name in call:
            call[name] = io[call[name]]
    recorded_addnoise["current"] = io.get(f"addnoise_{case}")
    with jax.default_matmul_precision("highest"):
        out = df_pipe(**dict(DF_CALL, **call), latents=io[f"noise_{case}"], progress=None)
    expected = io[f"latents_{case}"]
    if case == "i2v_last":  # diffusers' latents keep the given last frame; its frames do not
        expected = expected[:, :, :-1]
    assert out.latents.shape == expected.shape
    assert harness.max_rel_error(out.latents, expected) < RTOL
    assert out.frames.shape == io[f"frames_{case}"].shape
    assert np.abs(out.frames - io[f"frames_{case}"]).max() < 2e-4


def test_windows_plan():
    plan = pipelines._skyreels.plan_windows
    W = pipelines._skyreels.Window
    assert plan(5, base=3, overlap=2, block=1) == [W(3, 0), W(3, 2), W(3, 2)]
    assert plan(6, base=4, overlap=3, block=2) == [W(4, 0), W(4, 2), W(4, 2)]
    assert plan(5, base=8, overlap=2, block=1) == [W(5, 0)]  # fits: one window
    assert plan(5, base=3, overlap=None, block=1, first_prefix=1) == [W(5, 1)]
    assert plan(4, base=3, overlap=2, block=1, video=True) == [W(3, 2), W(3, 2)]
    # every latent frame of the video is generated once: the first window, then the new ones
    for frames, base, overlap in ((21, 9, 3), (30, 10, 5), (11, 10, 9)):
        windows = plan(frames, base=base, overlap=overlap, block=1)
        assert windows[0].frames + sum(w.frames - overlap for w in windows[1:]) == frames


def test_pipeline_refusals(df_pipe):
    with pytest.raises(ValueError, match=r"`causal_block_size` \(2\) must divide the latent frames; received 3"):
        df_pipe(**DF_CALL, causal_block_size=2)
    with pytest.raises(ValueError, match=r"9 frames, longer than base_num_frames \(5\).*pass overlap_history"):
        df_pipe(**DF_CALL, base_num_frames=5)
    with pytest.raises(ValueError, match=r"`overlap_history` must leave new frames.*\[1, 1\]"):
        df_pipe(**DF_CALL, overlap_history=5, base_num_frames=5)
    image = np.zeros((32, 48, 3), np.uint8)
    with pytest.raises(ValueError, match=r"`video` \(V2V\) and `image` \(I2V\) are two modes"):
        df_pipe(**DF_CALL, image=image, video=np.zeros((5, 32, 48, 3), np.uint8), overlap_history=5)
    with pytest.raises(ValueError, match=r"`video` is continued from its last `overlap_history`"):
        df_pipe(**DF_CALL, video=np.zeros((5, 32, 48, 3), np.uint8))
    with pytest.raises(ValueError, match=r"`video` must have at least overlap_history \(5\) frames; received 3"):
        df_pipe(**DF_CALL, video=np.zeros((3, 32, 48, 3), np.uint8), overlap_history=5)
    with pytest.raises(ValueError, match=r"`last_image` needs `image`"):
        df_pipe(**DF_CALL, last_image=image)
    with pytest.raises(ValueError, match=r"`image_embeds` is not taken by diffusion forcing"):
        df_pipe(**DF_CALL, image=image, image_embeds=np.zeros((1, 4, 8)))
    with pytest.raises(NotImplementedError, match=r"`last_image` with a long video"):
        df_pipe(**dict(DF_CALL, num_frames=17), image=image, last_image=image, base_num_frames=9,
                overlap_history=5)
    with pytest.raises(ValueError, match=r"`latents` must be the initial latents .*\(1, 16, 9, 4, 6\)"):
        df_pipe(**dict(DF_CALL, num_frames=17), base_num_frames=9, overlap_history=5,
                latents=np.zeros((1, 16, 5, 4, 6), np.float32))


def test_generate_command(df_folder, tmp_path, capsys):
    path = tmp_path / "df.mp4"
    assert generate.main([str(df_folder), "--prompt", "a cat", "--height", "32", "--width", "48",
                          "--num-frames", "9", "--steps", "2", "--max-sequence-length", "32",
                          "--ar-step", "1", "--output", str(path)]) == 0
    assert path.stat().st_size > 0 and capsys.readouterr().out.strip() == str(path)
    blocks = tmp_path / "df_blocks.mp4"
    assert generate.main([str(df_folder), "--prompt", "a cat", "--height", "32", "--width", "48",
                          "--num-frames", "13", "--steps", "2", "--max-sequence-length", "32",
                          "--ar-step", "1", "--causal-block-size", "2", "--output", str(blocks)]) == 0
    assert blocks.stat().st_size > 0 and capsys.readouterr().out.strip() == str(blocks)
    long = tmp_path / "df_long.mp4"  # three windows; then that video continued (V2V)
    assert generate.main([str(df_folder), "--prompt", "a cat", "--height", "32", "--width", "48",
                          "--num-frames", "17", "--steps", "2", "--max-sequence-length", "32",
                          "--base-num-frames", "9", "--overlap-history", "5", "--addnoise-condition", "20",
                          "--output", str(long)]) == 0
    assert capsys.readouterr().out.strip() == str(long)
    from vidax_eqx import interop
    assert interop.read_video(long).shape == (17, 32, 48, 3)
    more = tmp_path / "df_v2v.mp4"
    assert generate.main([str(df_folder), "--prompt", "a cat", "--height", "32", "--width", "48",
                          "--num-frames", "13", "--steps", "2", "--max-sequence-length", "32",
                          "--base-num-frames", "9", "--overlap-history", "5", "--video", str(long),
                          "--output", str(more)]) == 0
    assert interop.read_video(more).shape == (17 + 13, 32, 48, 3)  # diffusers': [video; generated]
    capsys.readouterr()
    for flag, value in (("--overlap-history", "5"), ("--video", str(long))):
        with pytest.raises(SystemExit):
            generate.main([str(FIXTURES.parent / "wan_pipeline" / "t2v"), "--prompt", "a", flag, value,
                           "--output", str(tmp_path / "x.mp4")])
        assert f"{flag} is for SkyReels-V2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate.main([str(FIXTURES.parent / "wan_pipeline" / "t2v"), "--prompt", "a", "--ar-step", "1",
                       "--output", str(tmp_path / "x.mp4")])
    assert "--ar-step is for SkyReels-V2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate.main([str(FIXTURES.parent / "wan_pipeline" / "t2v"), "--prompt", "a", "--causal-block-size", "2",
                       "--output", str(tmp_path / "x.mp4")])
    assert "--causal-block-size is for SkyReels-V2" in capsys.readouterr().err
