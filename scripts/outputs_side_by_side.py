"""Saves the outputs of the models, the sampler and the pipelines of one checkout, so that
a refactor can be checked bit for bit against the commit before it:

    git worktree add /tmp/before HEAD~5
    python scripts/outputs_side_by_side.py /tmp/before /tmp/before.npz
    python scripts/outputs_side_by_side.py . /tmp/after.npz
    python -c "import numpy as np; a, b = np.load('/tmp/before.npz'), np.load('/tmp/after.npz'); \
               print({k: bool(np.array_equal(a[k], b[k])) for k in a})"

The outputs: a Wan forward, Wan's stream (three chunks), `sample` with guidance and with step caching, CogVideoX's
`sample`, the SkyReels-V2 diffusion forcing pipeline (frames and latents) and its
streamed generation, on the committed fixtures (CPU, float32)."""
import os, sys, tempfile, shutil, pathlib
root = os.path.abspath(sys.argv[1]); out = sys.argv[2]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["VIDAX_COMPILE_CACHE"] = "0"
sys.path.insert(0, root); sys.path.insert(0, os.path.join(root, "tests"))
import jax, jax.numpy as jnp, numpy as np
import vidax_eqx
assert vidax_eqx.__file__.startswith(root), vidax_eqx.__file__
from vidax_eqx import models, sampling, pipelines
import harness
F = pathlib.Path(root) / "tests" / "fixtures"
res = {}
rng = np.random.default_rng(0)
wan = models.WanTransformer3D.from_pretrained(F / "wan" / "t2v" / "diffusers")
x = jnp.asarray(rng.standard_normal((2, 4, 3, 6, 10)), jnp.float32)
c = jnp.asarray(rng.standard_normal((2, 7, wan.config.text_dim)), jnp.float32)
n = jnp.asarray(rng.standard_normal((2, 7, wan.config.text_dim)), jnp.float32)
res["wan_forward"] = jax.vmap(wan)(x, jnp.array([700.0, 250.0]), c)
res["wan_sample_cfg"] = sampling.sample(wan, x, c, negative_context=n, steps=3, progress=None)
res["wan_sample_stepcache"] = sampling.sample(wan, x, c, negative_context=n, steps=4, progress=None,
    caching=sampling.Caching(step=sampling.StaticStepCache()))
kv = wan.kv_cache(6, 10, max_frames=2)
for i in range(3):  # Wan's own stream: three one-frame chunks, the cache carried
    v, kv = wan.stream(x[0][:, i:i + 1], jnp.float32(500.0 - 100 * i), c[0], kv,
                       text_cache=wan.text_cache(c[0]) if i == 2 else None)
    res[f"wan_stream_{i}"] = v
res["wan_stream_cache"] = kv.k
cog = models.CogVideoXTransformer3D.from_pretrained(F / "cogvideox" / "2b" / "diffusers") if (F/"cogvideox"/"2b"/"diffusers").exists() else None
if cog is not None:
    cc = cog.config
    xc = jnp.asarray(rng.standard_normal((1, 2, cc.in_channels, 4, 4)), jnp.float32)
    tc = jnp.asarray(rng.standard_normal((1, cc.max_text_seq_length if hasattr(cc, "max_text_seq_length") else 8, cc.text_embed_dim)), jnp.float32)
    try:
        res["cog_sample"] = sampling.sample(cog, xc, tc, steps=2, scheduler="cogvideox_ddim", guidance=sampling.Guidance(scale=1.0), progress=None)
    except Exception as e:
        print("cog skipped:", e)
tmp = tempfile.mkdtemp()
folder = harness.skyreels_df_folder(pathlib.Path(tmp) / "df")
pipe = pipelines.SkyReelsV2DiffusionForcingPipeline.from_pretrained(folder)
o = pipe(["A cat walks on the grass"], negative_prompt="bad", height=32, width=48, num_frames=9,
         num_inference_steps=3, guidance_scale=5.0, max_sequence_length=32, fps=24, ar_step=1, progress=False)
res["skyreels_df_frames"] = o.frames; res["skyreels_df_latents"] = o.latents
chunks = list(pipe.stream(["A cat"], height=32, width=48, num_frames=9, chunk_frames=1, max_sequence_length=32, guidance_scale=3.0))
res["stream_latents"] = np.concatenate([ch.latents for ch in chunks], axis=2)
res["stream_frames"] = np.concatenate([ch.frames for ch in chunks], axis=1)
np.savez(out, **{k: np.asarray(v) for k, v in res.items()})
print("saved", sorted(res))
