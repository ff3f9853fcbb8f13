"""Streaming generation with a key/value cache (`models.KVCache`, `WanTransformer3D.stream`,
`SkyReelsV2Transformer3D.stream`): chunk by chunk, each chunk's latent frames attending
to themselves and to the cached keys and values of the frames before them.

The cached path is checked against the model's ordinary call over the whole video with
the same frame-block causal attention (`attention=models.BlockCausal(...)`), whose own
numbers are checked against diffusers in `tests/test_skyreels.py` (the frame-block causal
mask of `num_frame_per_block=3`) and against the float64 oracle in
`tests/test_block_causal.py`:

- SkyReels-V2's `df_block3` model (diffusers' weights, blocks of 3 frames) streamed in
  two chunks with per-frame timesteps: equal to its call on all six frames;
- a small Wan in one-frame chunks over blocks of 1 and 2 frames, with a rolling window
  (a cache of one block and `window=2`; then a cache larger than the window): equal to
  the whole video with the same window as a mask; the text cache's path equal to the
  text's; the cache's memory flat however many chunks (its shapes fixed, its length
  capped);
- the RoPE tables of a chunk (`rope_3d(frame_offset=...)`) are bitwise the whole
  video's rows;
- the refusals: a chunk the blocks do not divide, a cache built for other latents, an
  attention that is not frame-block causal, a ring;
- over a mesh (`run_sharded(kv_cache=...)`, dp x sp x tp = 2 x 2 x 2: Ulysses x TP, with
  FSDP, TP with FSDP): every chunk's output and the cache equal one device's; the
  streaming pipeline over Ulysses equal to one device;
- `sampling.FewStep`, the few-step sampler of CausVid / Self-Forcing: its warped
  timesteps and its step against a NumPy re-derivation;
- the streaming pipeline (`SkyReelsV2DiffusionForcingPipeline.stream` on the tiny
  diffusers folder of `test_skyreels.py`): each chunk equal to denoising it with the
  model's ordinary call over the finished chunks (at timestep 0) and itself, the
  prefix recomputed at every step instead of cached; its frames the VAE's decode of all
  the latents; `vidax-generate --stream` writing the video chunk by chunk; the refusals.
"""

import dataclasses
import functools
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
from vidax_eqx import generate, interop, models, nn, pipelines, sampling
from vidax_eqx.nn import functional


FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "skyreels"
JIT = functools.partial(eqx.filter_jit, compiler_options=harness.FAST_COMPILE)
TOL = 1e-5  # max abs error over max abs output, float32


@pytest.fixture(autouse=True)
def _highest():
    with jax.default_matmul_precision("highest"):
        yield


def _stream(model, x, timesteps, context, cache, chunk: int, **kwargs):
    """`x (C, F, H, W)` in chunks of `chunk` latent frames (`timesteps` one per frame,
    sliced likewise), each chunk's output and the cache it leaves; returns the outputs
    concatenated over frames and the caches after each chunk."""
    step = JIT(lambda m, x, t, c, cache: m.stream(x, t, c, cache, **kwargs))
    outs, caches = [], []
    for start in range(0, x.shape[1], chunk):
        out, cache = step(model, x[:, start:start + chunk], timesteps[start:start + chunk], context, cache)
        outs.append(out)
        caches.append(cache)
    return jnp.concatenate(outs, axis=1), caches


def test_skyreels_stream_equals_the_whole_video():
    """Two chunks of one block (3 frames) of the `df_block3` model, a timestep per frame:
    the model's call on all six frames (diffusers' numbers, `test_skyreels.py`)."""
    model = models.SkyReelsV2Transformer3D.from_pretrained(FIXTURES / "df_block3" / "diffusers")
    io = {k: jnp.asarray(v) for k, v in np.load(FIXTURES / "df_block3" / "io.npz").items()}
    x, t, c = io["x"][0], io["timestep"][0], io["context"][0]
    whole = JIT(lambda m: m(x, t, c))(model)
    cache = model.kv_cache(x.shape[2], x.shape[3], max_frames=3)
    streamed, caches = _stream(model, x, t, c, cache, chunk=3)
    assert harness.max_rel_error(streamed, whole) < TOL
    assert harness.max_rel_error(streamed, io["out"][0]) < TOL
    assert int(caches[-1].frame) == 6 and int(caches[-1].length) == 12


# -- a small Wan -------------------------------------------------------------------------

CONFIG = models.WanConfig(dim=32, ffn_dim=64, num_heads=2, num_layers=2, in_channels=4, out_channels=4,
                          text_dim=16, freq_dim=16)
FRAMES, HEIGHT, WIDTH = 6, 4, 6


@pytest.fixture(scope="module")
def wan():
    model = models.WanTransformer3D(CONFIG, key=jax.random.key(0))
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (4, FRAMES, HEIGHT, WIDTH))
    t = jax.random.uniform(keys[1], (FRAMES,), maxval=1000.0)
    c = jax.random.normal(keys[2], (5, 16))
    return model, x, t, c


def _per_token(t, frames):
    """Per-frame timesteps as Wan's per-token ones (2 x 3 patch tokens per frame)."""
    return jnp.repeat(t[:frames], (HEIGHT // 2) * (WIDTH // 2))


def _whole(model, x, t, c, attention):
    return JIT(lambda m: m(x, _per_token(t, FRAMES), c, attention=attention))(model)


@pytest.mark.parametrize(
    "frames_per_block, window, max_frames, chunk",
    [(1, None, FRAMES, 1), (2, None, FRAMES, 2), (1, 2, 1, 1), (2, 2, 2, 2), (1, 2, 4, 1), (2, 1, 4, 2)],
    ids=["frame-causal", "blocks2", "rolling-window", "rolling-window-blocks2", "cache-beyond-window",
         "window1-blocks2"],
)
def test_wan_stream_equals_the_whole_video(wan, frames_per_block, window, max_frames, chunk):
    """Chunk by chunk with a cache of `max_frames` frames equals the whole video with the
    same frame-block causal attention; a rolling window (a cache of exactly the window's
    earlier blocks, or more, which the mask then narrows) equals the window as a mask."""
    model, x, t, c = wan
    attention = models.BlockCausal(frames_per_block, window)
    cache = model.kv_cache(HEIGHT, WIDTH, max_frames=max_frames)
    streamed, caches = _stream_per_token(model, x, t, c, cache, chunk, attention)
    assert harness.max_rel_error(streamed, _whole(model, x, t, c, attention)) < TOL
    # Memory is flat: every cache has the first one's shapes; its length is capped.
    tokens = (HEIGHT // 2) * (WIDTH // 2)
    assert all(k.k.shape == cache.k.shape and k.v.shape == cache.v.shape for k in caches)
    assert [int(k.length) for k in caches] == [min((i + 1) * chunk, max_frames) * tokens for i in range(len(caches))]


def _stream_per_token(model, x, t, c, cache, chunk, attention, **kwargs):
    step = JIT(lambda m, x, t, cache: m.stream(x, t, c, cache, attention=attention, **kwargs))
    outs, caches = [], []
    for start in range(0, FRAMES, chunk):
        out, cache = step(model, x[:, start:start + chunk], _per_token(t[start:], chunk), cache)
        outs.append(out)
        caches.append(cache)
    return jnp.concatenate(outs, axis=1), caches


def test_window_changes_the_output(wan):
    """The rolling window matters: without it the last frames see the first."""
    model, x, t, c = wan
    a = _whole(model, x, t, c, models.BlockCausal(1, 2))
    b = _whole(model, x, t, c, models.BlockCausal(1))
    assert harness.max_rel_error(a[:, :2], b[:, :2]) < 1e-6 and harness.max_rel_error(a[:, 2:], b[:, 2:]) > 1e-3


def test_text_cache(wan):
    """The text's keys and values computed once (`text_cache`) give the text's numbers."""
    model, x, t, c = wan
    attention = models.BlockCausal(1)
    cache = model.kv_cache(HEIGHT, WIDTH, max_frames=2)
    plain, _ = _stream_per_token(model, x, t, c, cache, 1, attention)
    cached, _ = _stream_per_token(model, x, t, c, cache, 1, attention, text_cache=model.text_cache(c))
    assert harness.max_rel_error(cached, plain) < 1e-6


def test_rope_of_a_chunk_is_the_whole_videos():
    whole = functional.rope_3d((9, 3, 4), 12)
    part = jax.jit(lambda o: functional.rope_3d((3, 3, 4), 12, frame_offset=o, max_frames=32))(4)
    for a, b in zip(whole, part):
        np.testing.assert_array_equal(np.asarray(a)[4 * 12:7 * 12], np.asarray(b))
    with pytest.raises(ValueError, match=r"`frame_offset` takes `max_frames`"):
        functional.rope_3d((3, 3, 4), 12, frame_offset=0)


def test_refusals(wan):
    model, x, t, c = wan
    cache = model.kv_cache(HEIGHT, WIDTH, max_frames=2)
    chunk = x[:, :3]
    with pytest.raises(ValueError, match=r"chunk's latent frames \(3\) and the cache's max_frames \(2\) must be "
                                         r"multiples of the blocks' frames_per_block=2"):
        model.stream(chunk, t[0], c, cache, attention=models.BlockCausal(2))
    with pytest.raises(ValueError, match=r"hold 6 patch tokens .* the cache's 4"):
        model.stream(chunk, t[0], c, model.kv_cache(4, 4, max_frames=2))
    with pytest.raises(TypeError, match=r"`attention` must be BlockCausal or None; received a tuple"):
        model.stream(chunk, t[0], c, cache, attention=models.SlidingTile((1, 2, 2), (1, 1, 1)))
    with pytest.raises(ValueError, match=r"`max_frames` must be an int >= 0; received -1"):
        model.kv_cache(HEIGHT, WIDTH, max_frames=-1)
    with pytest.raises(ValueError, match=r"positive multiples of the patch \(2, 2\); received 5 x 6"):
        model.kv_cache(5, WIDTH, max_frames=1)
    ring = nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(sequence="ring"))
    with pytest.raises(NotImplementedError, match=r"not over a ring"):
        ring.stream(chunk, t[0], c, cache)


def test_the_ropes_reach(wan):
    """A stream past the config's `rope_max_seq_len` raises at run time; `check_reach=False`
    leaves that check (a host callback, which JAX's persistent cache refuses) out of the
    program, for a caller that checks the length itself."""
    model, x, t, c = wan
    short = models.WanTransformer3D(dataclasses.replace(CONFIG, rope_max_seq_len=2), key=jax.random.key(0))
    cache = short.kv_cache(HEIGHT, WIDTH, max_frames=2)
    out, cache = short.stream(x[:, :2], t[0], c, cache)
    with pytest.raises(Exception, match=r"passed the config's rope_max_seq_len=2"):
        jax.block_until_ready(short.stream(x[:, 2:3], t[0], c, cache)[0])
    jaxpr = lambda **kw: str(jax.make_jaxpr(lambda x: model.stream(x, t[0], c, cache, **kw))(x[:, :1]))
    assert "callback" in jaxpr() and "callback" not in jaxpr(check_reach=False)


# -- over a mesh -------------------------------------------------------------------------------

MESH_CONFIG = models.WanConfig(
    dim=32, ffn_dim=64, num_heads=4, num_layers=2, in_channels=4, out_channels=4, text_dim=16, freq_dim=16)
SHARDED = {
    "ulysses-sp2-tp2-dp2": dict(sequence="ulysses", tp_axis="tp"),
    "ulysses-tp-fsdp": dict(sequence="ulysses", tp_axis="tp", fsdp_axes=("dp", "sp")),
    "tp-dp-fsdp": dict(tp_axis="tp", fsdp_axes=("dp",)),
}


@pytest.mark.parametrize("name", SHARDED)
def test_stream_over_a_mesh_equals_one_device(name):
    """Two videos over dp x sp x tp (2 x 2 x 2), chunk by chunk through
    `run_sharded(kv_cache=...)` with a rolling window and the text cache: every chunk's
    output and the cache (gathered: split by heads over tp then sp) equal one device's."""
    model = models.WanTransformer3D(MESH_CONFIG, key=jax.random.key(0))
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (2, 4, 4, HEIGHT, WIDTH))
    t = jax.random.uniform(keys[1], (2, 4), maxval=1000.0)
    c = jax.random.normal(keys[2], (2, 5, 16))
    attention = models.BlockCausal(1, 2)
    empty = model.kv_cache(HEIGHT, WIDTH, max_frames=2)
    cache = jax.tree.map(lambda a: jnp.broadcast_to(a, (2, *a.shape)), empty)
    text = jax.vmap(model.text_cache)(c)
    mesh = harness.mesh(dp=2, sp=2, tp=2)
    parallel = nn.sharding.ParallelConfig(**SHARDED[name])
    sharded = nn.sharding.shard_module(nn.sharding.with_parallel(model, parallel), mesh)
    text_sharded = models.sharded_text_cache(sharded, c, mesh=mesh, batch_axis="dp")
    run = JIT(lambda m, x, t, cache, text: models.run_sharded(
        m, x, t, c, mesh=mesh, batch_axis="dp", attention=attention, kv_cache=cache, text_cache=text))
    one = JIT(jax.vmap(lambda m, x, t, c, cache, text: m.stream(x, t, c, cache, attention=attention,
                                                               text_cache=text), in_axes=(None, 0, 0, 0, 0, 0)))
    mine, theirs = cache, cache
    for f in range(4):
        out, mine = run(sharded, x[:, :, f:f + 1], t[:, f], mine, text_sharded)
        expected, theirs = one(model, x[:, :, f:f + 1], t[:, f], c, theirs, text)
        assert harness.max_rel_error(out, expected) < 2e-6
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
            assert harness.max_rel_error(np.asarray(a, np.float32), np.asarray(b, np.float32)) < 2e-6
    ring = nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(sequence="ring"))
    with pytest.raises(NotImplementedError, match=r"not over a ring"):
        models.run_sharded(nn.sharding.shard_module(ring, mesh), x[:, :, :1], t[:, 0], c, mesh=mesh,
                           batch_axis="dp", kv_cache=cache)
    with pytest.raises(ValueError, match=r"`kv_cache` \(streaming\) does not take `remat`"):
        models.run_sharded(sharded, x[:, :, :1], t[:, 0], c, mesh=mesh, batch_axis="dp", kv_cache=cache,
                           remat="blocks")


# -- the few-step sampler ----------------------------------------------------------------------


def test_few_step_schedule_and_step():
    """Self-Forcing's warped list (`timesteps[1000 - t]` of its shift-5 flow schedule):
    1000, 937.5, 833.3, 625; a step is `(1 - s') (x - s v) + s' eps`, the last `x - s v`."""
    scheduler = sampling.FewStep()
    plan = scheduler.plan(4)
    np.testing.assert_allclose(np.asarray(plan.timesteps), [1000.0, 937.5, 2500 / 3, 625.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(plan.sigmas), [1.0, 0.9375, 5 / 6, 0.625, 0.0], rtol=1e-6)
    x = jax.random.normal(jax.random.key(0), (2, 3))
    v = jax.random.normal(jax.random.key(1), (2, 3))
    key = jax.random.key(2)
    state = scheduler.init(x)
    got, _ = scheduler.step(plan, state, 1, v, x, key=key)
    eps = np.asarray(jax.random.normal(key, x.shape))
    x0 = np.asarray(x, np.float64) - 0.9375 * np.asarray(v, np.float64)
    np.testing.assert_allclose(np.asarray(got), (1 - 5 / 6) * x0 + 5 / 6 * eps, rtol=1e-5, atol=1e-6)
    last, _ = scheduler.step(plan, state, 3, v, x, key=key)
    np.testing.assert_allclose(np.asarray(last), np.asarray(x) - 0.625 * np.asarray(v), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"`steps` must be the number of its timesteps, 4"):
        scheduler.plan(3)
    with pytest.raises(ValueError, match=r"strictly decreasing"):
        sampling.FewStep(timesteps=(500.0, 750.0))
    with pytest.raises(ValueError, match=r"needs a `key`"):
        scheduler.step(plan, state, 0, v, x)


# -- the streaming pipeline -----------------------------------------------------------------------

STREAM = dict(prompt="A cat walks on the grass", height=32, width=48, num_frames=13, max_sequence_length=32)


@pytest.fixture(scope="module")
def df_pipe(tmp_path_factory):
    """The tiny SkyReels-V2 diffusion forcing folder of `test_skyreels.py` (the Wan pipeline
    fixture's tokenizer, text encoder and VAE, a transformer with the fps embedding)."""
    folder = harness.skyreels_df_folder(tmp_path_factory.mktemp("stream_df"))
    return folder, pipelines.SkyReelsV2DiffusionForcingPipeline.from_pretrained(folder, compile_cache=False)


def test_stream_equals_recomputing_the_prefix(df_pipe):
    """Four latent frames in chunks of two, two Euler steps each, from given latents: each
    chunk's latents equal denoising it with the transformer's ordinary call over [the
    finished chunks at timestep 0; the chunk] in blocks of two frames (the prefix
    recomputed at every step); the frames equal the VAE's decode of all the latents."""
    _, pipe = df_pipe
    scheduler = sampling.FlowMatchEuler(shift=5.0)
    noise = jax.random.normal(jax.random.key(3), (1, 16, 4, 4, 6))
    chunks = list(pipe.stream(**STREAM, chunk_frames=2, scheduler=scheduler, num_inference_steps=2,
                              latents=noise))
    assert [c.frames.shape[1] for c in chunks] == [5, 8]
    model = pipe.transformer
    context, _ = pipe.text_context(STREAM["prompt"], None, None, None, guided=False, num_videos_per_prompt=1,
                                   max_sequence_length=32)
    plan = scheduler.plan(2)
    call = JIT(lambda m, x, t, c: m(x, t, c, fps=1, attention=models.BlockCausal(2)))
    done = []
    for i, chunk in enumerate(chunks):
        x = noise[0, :, 2 * i:2 * i + 2]
        state = scheduler.init(x)
        for step in range(2):
            t = scheduler.timestep(plan, step)
            video = jnp.concatenate(done + [x], axis=1)
            timesteps = jnp.concatenate([jnp.zeros(2 * i), jnp.full((2,), t)])
            v = call(model, video, timesteps, context[0])[:, 2 * i:]
            x, state = scheduler.step(plan, state, step, v, x)
        assert harness.max_rel_error(chunk.latents[0], x) < TOL
        done.append(jnp.asarray(chunk.latents[0]))
    whole = pipe.decode(np.concatenate([c.latents for c in chunks], axis=2))
    frames = np.concatenate([c.frames for c in chunks], axis=1)
    assert np.abs(frames - whole).max() < 1e-5


def test_stream_command(df_pipe, tmp_path, capsys):
    """`vidax-generate --stream`: the video written chunk by chunk (13 frames: 5, then 8)."""
    folder, _ = df_pipe
    path = tmp_path / "stream.mp4"
    assert generate.main([str(folder), "--prompt", "a cat", "--height", "32", "--width", "48",
                          "--num-frames", "13", "--max-sequence-length", "32", "--stream",
                          "--chunk-frames", "2", "--steps", "1", "--output", str(path)]) == 0
    assert capsys.readouterr().out.strip() == str(path)
    assert interop.read_video(path).shape == (13, 32, 48, 3)
    with pytest.raises(SystemExit):
        generate.main([str(folder), "--prompt", "a", "--stream", "--ar-step", "1", "--output",
                       str(tmp_path / "x.mp4")])
    assert "--ar-step does not go with --stream" in capsys.readouterr().err


def test_stream_over_a_mesh(df_pipe):
    """The pipeline on a mesh (Ulysses over sp = 2, two guidance branches, each with its
    cache): every chunk's latents and frames equal one device's."""
    folder, pipe = df_pipe
    meshed = pipelines.SkyReelsV2DiffusionForcingPipeline.from_pretrained(folder, compile_cache=False,
                                                                          mesh=harness.mesh(sp=2))
    call = dict(STREAM, chunk_frames=2, scheduler=sampling.FlowMatchEuler(shift=5.0), num_inference_steps=2,
                guidance_scale=3.0, negative_prompt="bad", seed=4)
    for a, b in zip(meshed.stream(**call), pipe.stream(**call)):
        assert harness.max_rel_error(a.latents, b.latents) < 1e-5
        assert np.abs(a.frames - b.frames).max() < 1e-3  # the latents' round-off through the VAE


def test_stream_refusals(df_pipe):
    _, pipe = df_pipe
    with pytest.raises(ValueError, match=r"`chunk_frames` \(3 latent frames\) must divide the video's 4"):
        next(pipe.stream(**STREAM, chunk_frames=3))
    with pytest.raises(ValueError, match=r"`max_cached_frames` \(3\) must be a multiple of `chunk_frames` \(2\)"):
        next(pipe.stream(**STREAM, chunk_frames=2, max_cached_frames=3))
    with pytest.raises(ValueError, match=r"`num_inference_steps` is needed with a FlowMatchEuler"):
        next(pipe.stream(**STREAM, chunk_frames=2, scheduler=sampling.FlowMatchEuler()))
    with pytest.raises(ValueError, match=r"`latents` must be the video's initial latents"):
        next(pipe.stream(**STREAM, chunk_frames=2, latents=np.zeros((1, 16, 3, 4, 6))))
    reach = pipe.transformer_config.rope_max_seq_len
    with pytest.raises(ValueError, match=rf"{reach + 1} latent frames pass the transformer's rope_max_seq_len "
                                         rf"\({reach} latent frames\).*at most {4 * (reach - 1) + 1} frames"):
        next(pipe.stream(**dict(STREAM, num_frames=4 * reach + 1), chunk_frames=1))
