"""Video sparse attention (VSA) in the modules and in Wan: `nn.Attention(video_sparse=)`,
`WanTransformer3D(attention=models.VideoSparseTiles(tile, topk or sparsity))`, and
FastVideo-style VSA
checkpoints (`to_gate_compress`).

The fixture `tests/fixtures/vsa/t2v/` (written by `scripts/make_vsa_fixtures.py`,
NumPy only) is a tiny random diffusers-layout Wan 2.1 T2V with a `to_gate_compress`
projection per block. Here:

1. loaded with `gate_compress=True` and run with `attention=VideoSparseTiles(...)`, on a
   patch grid whose
   tiles are partial on every axis, the model equals a float64 NumPy model written
   below from the checkpoint's tensors (Wan's block forward with `tests/oracle.py`'s
   pieces and its VSA oracle), and so do the gradients of a loss with respect to
   `to_gate_compress` and `to_q` (central differences of the float64 model);
2. sharded runs equal the single-device run: Ulysses with tensor parallelism (the
   gate's columns split with the heads), and USP with a zigzag ring and padding tiles,
   gradients included;
3. loading: the tensors' names both ways (FastVideo's block-level name and an
   `attn1.` one), the errors without the option and with it on a dense checkpoint,
   save -> load; the bad options, and the keyword `video_sparse=` that the option
   replaced (it warns, and gives the same numbers bit for bit);
4. `nn.Attention(video_sparse=)` against the float64 oracle, with the module's gate
   and a gate passed in, and its bad inputs.
"""

import json
import os
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import oracle
from vidax_eqx import interop, kernels, models, nn, parallel, ShapeError


HERE = os.path.dirname(__file__)
FIXTURE = os.path.join(HERE, "fixtures", "vsa", "t2v")
DENSE = os.path.join(HERE, "fixtures", "wan", "t2v", "diffusers")
GRID, TILE, TOPK = (3, 5, 6), (2, 2, 2), 5  # 2 x 3 x 3 = 18 tiles, partial on every axis
VSA = models.VideoSparseTiles(TILE, TOPK)
LATENT = (4, 3, 10, 12)  # patch (1, 2, 2): the grid above
TIMESTEP = 700.0
RTOL = oracle.tolerance(np.float32)


def _read_safetensors(path) -> dict:
    """The tensors of a float32 .safetensors file (independently of vidax_eqx)."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        assert entry["dtype"] == "F32", entry
        a, b = entry["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + a:8 + n + b], "<f4").reshape(entry["shape"])
    return out


# -- the float64 oracle model ------------------------------------------------------------


class _Lin:
    def __init__(self, sd, name):
        self.weight, self.bias = sd[name + ".weight"], sd[name + ".bias"]


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _rope_tables(grid, head_dim, theta=10000.0):
    """Wan's 3D RoPE angles per token (frame-major): `(cos, sin)` `(S, head_dim / 2)`."""
    c = head_dim // 2
    parts = (c - 2 * (c // 3), c // 3, c // 3)
    coords = np.stack(np.meshgrid(*(np.arange(g) for g in grid), indexing="ij"), -1).reshape(-1, 3)
    angles = []
    for axis, n in enumerate(parts):
        inv = 1.0 / theta ** (np.arange(0, 2 * n, 2) / (2 * n))
        angles.append(coords[:, axis:axis + 1] * inv[None, :])
    angles = np.concatenate(angles, axis=1)
    return np.cos(angles), np.sin(angles)


def oracle_wan(sd, config, x, t, context, topk, *, margins=None):
    """diffusers' `WanTransformer3DModel.forward` for one example in float64, every
    self-attention replaced by VSA (`oracle.video_sparse_attention`) on the tile
    layout of the patch grid, gated by the block's `to_gate_compress`. `margins`: a
    list that receives each block's selection margin."""
    f64 = oracle.f64
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    H, D, eps = config["num_attention_heads"], config["attention_head_dim"], config["eps"]
    pt, ph, pw = config["patch_size"]
    C, F, Hh, W = x.shape
    grid = (F // pt, Hh // ph, W // pw)
    # patch embedding (Conv3d with kernel = stride = patch), tokens frame-major
    p = f64(x).reshape(C, grid[0], pt, grid[1], ph, grid[2], pw).transpose(1, 3, 5, 0, 2, 4, 6)
    p = p.reshape(-1, C * pt * ph * pw)
    tokens = p @ f64(sd["patch_embedding.weight"]).reshape(dim, -1).T + f64(sd["patch_embedding.bias"])
    # time: sinusoid [cos, sin], MLP, projection to the six modulation rows
    half = config["freq_dim"] // 2
    arg = float(t) * np.exp(-np.log(10000.0) * np.arange(half) / half)
    emb = np.concatenate([np.cos(arg), np.sin(arg)])
    lin = lambda name, h: oracle.linear(h, _Lin(sd, name))  # noqa: E731
    temb = lin("condition_embedder.time_embedder.linear_2",
               _silu(lin("condition_embedder.time_embedder.linear_1", emb)))
    e0 = lin("condition_embedder.time_proj", _silu(temb)).reshape(6, dim)
    ctx = lin("condition_embedder.text_embedder.linear_2",
              _gelu_tanh(lin("condition_embedder.text_embedder.linear_1", context)))
    cos, sin = _rope_tables(grid, D)
    # the tile layout (zero rows for the padding slots)
    coords, real = oracle.video_layout(grid, TILE)
    flat = (coords[:, 0] * grid[1] + coords[:, 1]) * grid[2] + coords[:, 2]
    lay = lambda a: np.where(real[:, None], a[np.where(real, flat, 0)], 0.0)  # noqa: E731
    h_tok, cos, sin = lay(tokens), lay(cos), lay(sin)
    S = h_tok.shape[0]
    for n in range(config["num_layers"]):
        b = f"blocks.{n}."
        e = f64(sd[b + "scale_shift_table"])[0] + e0
        shift, scale, gate, c_shift, c_scale, c_gate = e
        h = oracle.layer_norm(h_tok, eps=eps) * (1 + scale) + shift
        q = oracle.rms_norm(lin(b + "attn1.to_q", h), sd[b + "attn1.norm_q.weight"], eps)
        k = oracle.rms_norm(lin(b + "attn1.to_k", h), sd[b + "attn1.norm_k.weight"], eps)
        v = lin(b + "attn1.to_v", h)
        g = lin(b + "to_gate_compress", h)
        q, k = oracle.rope(q.reshape(S, H, D), cos, sin), oracle.rope(k.reshape(S, H, D), cos, sin)
        r = oracle.video_sparse_attention(q[None], k[None], v.reshape(1, S, H, D), grid, TILE,
                                          topk, gate=g.reshape(1, S, H, D))
        if margins is not None:
            margins.append(r.margin)
        h_tok = h_tok + lin(b + "attn1.to_out.0", r.out[0].reshape(S, dim)) * gate
        h = oracle.layer_norm(h_tok, sd[b + "norm2.weight"], sd[b + "norm2.bias"], eps)
        q = oracle.rms_norm(lin(b + "attn2.to_q", h), sd[b + "attn2.norm_q.weight"], eps)
        k = oracle.rms_norm(lin(b + "attn2.to_k", ctx), sd[b + "attn2.norm_k.weight"], eps)
        v = lin(b + "attn2.to_v", ctx)
        L = ctx.shape[0]
        a = oracle.example_attention(q.reshape(S, H, D), k.reshape(L, H, D), v.reshape(L, H, D))
        h_tok = h_tok + lin(b + "attn2.to_out.0", a.reshape(S, dim))
        h = oracle.layer_norm(h_tok, eps=eps) * (1 + c_scale) + c_shift
        h_tok = h_tok + lin(b + "ffn.net.2", _gelu_tanh(lin(b + "ffn.net.0.proj", h))) * c_gate
    shift, scale = f64(sd["scale_shift_table"])[0] + temb
    out = lin("proj_out", oracle.layer_norm(h_tok, eps=eps) * (1 + scale) + shift)
    # back from the tile layout, then unpatchify ((pt, ph, pw, C) per token, as diffusers)
    tokens = np.zeros((int(np.prod(grid)), out.shape[1]))
    tokens[flat[real]] = out[real]
    o = tokens.reshape(*grid, pt, ph, pw, -1).transpose(6, 0, 3, 1, 4, 2, 5)
    return o.reshape(-1, grid[0] * pt, grid[1] * ph, grid[2] * pw)


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint():
    with open(os.path.join(FIXTURE, "config.json")) as f:
        config = json.load(f)
    return config, _read_safetensors(os.path.join(FIXTURE, "diffusion_pytorch_model.safetensors"))


@pytest.fixture(scope="module")
def model():
    return models.WanTransformer3D.from_pretrained(FIXTURE, gate_compress=True)


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(1)  # selection margin 2.7e-3 (see the first test)
    x = rng.standard_normal((1, *LATENT)).astype(np.float32)
    context = rng.standard_normal((1, 5, 16)).astype(np.float32)
    ct = rng.standard_normal((1, *LATENT))
    return jax.device_put(x), jnp.full((1,), TIMESTEP), jax.device_put(context), ct


def _batched(model, x, t, context, **kw):
    return jax.vmap(lambda x, t, c: model(x, t, c, **kw))(x, t, context)


@eqx.filter_jit
def _loss_and_grad(model, x, t, context, ct):
    def loss(model):
        out = _batched(model, x, t, context, attention=VSA)
        return jnp.sum(out * ct), out

    (_, out), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
    return out, grads


@pytest.fixture(scope="module")
def single(model, inputs):
    x, t, context, ct = inputs
    return _loss_and_grad(model, x, t, context, jnp.asarray(ct, jnp.float32))


# -- 1. the model against the float64 oracle model -----------------------------------------


def test_vsa_checkpoint_matches_the_oracle_model(checkpoint, single, inputs):
    config, sd = checkpoint
    x, t, context, _ = inputs
    margins = []
    ref = oracle_wan(sd, config, np.asarray(x[0]), TIMESTEP, np.asarray(context[0]), TOPK,
                     margins=margins)
    # float32 and float64 pick the same tiles only away from ties.
    assert min(margins) > 1e-3, f"near-tie in the coarse scores ({margins}): change the seed"
    out, _ = single
    assert out.shape == (1, *LATENT) and out.dtype == jnp.float32
    assert harness.max_rel_error(out[0], ref) < RTOL
    # The gate and the sparsity matter: all tiles, or no gate, give other numbers.
    dense = oracle_wan(sd, config, np.asarray(x[0]), TIMESTEP, np.asarray(context[0]), 18)
    assert harness.max_rel_error(out[0], dense) > 1e-2


def test_vsa_gradients_match_the_oracle_model(checkpoint, single, inputs):
    config, sd = checkpoint
    x, _, context, ct = inputs
    _, grads = single
    attn = grads.blocks.self_attn
    names = ["blocks.0.to_gate_compress.weight", "blocks.1.to_gate_compress.bias",
             "blocks.0.attn1.to_q.weight", "blocks.1.attn1.to_k.weight"]
    got = [attn.to_gate_compress.weight[0], attn.to_gate_compress.bias[1], attn.q.weight[0],
           attn.k.weight[1]]
    assert all(float(jnp.abs(g).max()) > 0 for g in got)

    def loss(params):
        tensors = {**sd, **dict(zip(names, params))}
        out = oracle_wan(tensors, config, np.asarray(x[0]), TIMESTEP, np.asarray(context[0]), TOPK)
        return float(np.sum(out * ct[0]))

    harness.check_grads_fd(loss, [sd[n] for n in names], got, names, seed=5, tol=2e-3)


# -- 2. sharded == one device ------------------------------------------------------------------


SHARDED = {
    "ulysses-sp2-tp2": (dict(sp=2, tp=2), dict(sequence="ulysses", tp_axis="tp")),
    "usp-zigzag-2x2": (dict(sp=2, ring=2), dict(sequence="usp", ring_axis="ring", layout="zigzag")),
}


# The gradients under every mode are checked against the oracle at the function's
# level (test_vsa_parallel.py); here those of one mode through the whole model.
@pytest.mark.parametrize("name", sorted(SHARDED))
def test_sharded_equals_one_device(model, single, inputs, name):
    x, t, context, ct = inputs
    mesh_axes, config = SHARDED[name]
    mesh = harness.mesh(**mesh_axes)
    sharded = nn.sharding.shard_module(nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(**config)), mesh)

    def run(model, x, t, c):
        return models.run_sharded(model, x, t, c, mesh=mesh, attention=VSA)

    if name != "usp-zigzag-2x2":
        out = eqx.filter_jit(run)(sharded, x, t, context)
        assert harness.max_rel_error(out, single[0]) < RTOL
        return

    @eqx.filter_jit
    def loss_and_grad(model, ct):
        def loss(model):
            out = run(model, x, t, context)
            return jnp.sum(out * ct), out

        return eqx.filter_value_and_grad(loss, has_aux=True)(model)

    (_, out), grads = loss_and_grad(sharded, jnp.asarray(ct, jnp.float32))
    assert harness.max_rel_error(out, single[0]) < RTOL
    got, want = grads.blocks.self_attn, single[1].blocks.self_attn
    for a, b in ((got.to_gate_compress.weight, want.to_gate_compress.weight),
                 (got.q.weight, want.q.weight), (got.v.bias, want.v.bias)):
        assert harness.max_rel_error(a, np.asarray(b, np.float64)) < 10 * RTOL


def test_ring_keeps_its_run_time_skip(model):
    # The ring skips unselected steps with a lax.cond; run_sharded runs the examples of
    # a device one by one so that jax.vmap does not turn it into a select.
    mesh = harness.mesh(sp=2)
    sharded = nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(sequence="ring"))
    arrays, static = eqx.partition(sharded, eqx.is_array)
    x, t, context = jnp.zeros((2, *LATENT)), jnp.zeros((2,)), jnp.zeros((2, 5, 16))
    jaxpr = jax.make_jaxpr(lambda a: models.run_sharded(
        eqx.combine(a, static), x, t, context, mesh=mesh, attention=VSA))(arrays)
    assert " cond[" in str(jaxpr)


def test_usp_under_vmap_equals_the_kernel():
    # What a user's jax.vmap over examples inside shard_map does (a regression: the ring's
    # key validity met a stale varying-axes type under vmap).
    mesh = harness.mesh(sp=2, ring=2)
    S = parallel.vsa_padded_length(GRID, TILE, ulysses_size=2, ring_size=2)
    rng = np.random.default_rng(3)
    q, k, v = (jax.device_put(rng.standard_normal((2, VS.layout.video_len, 4, 8)).astype(np.float32))
               for _ in range(3))
    ref = kernels.video_sparse_attention(q, k, v, GRID, topk=TOPK, tile=TILE)

    def one(q, k, v):
        return parallel.video_sparse_attention(q[None], k[None], v[None], GRID, ulysses_axis="sp",
                                               ring_axis="ring", topk=TOPK, tile=TILE)[0]

    spec = P(None, ("ring", "sp"))
    run = jax.jit(jax.shard_map(jax.vmap(one), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    padded = [jax.device_put(jnp.pad(a, ((0, 0), (0, S - a.shape[1]), (0, 0), (0, 0))),
                             jax.NamedSharding(mesh, spec)) for a in (q, k, v)]
    out = run(*padded)[:, :VS.layout.video_len]
    assert harness.max_rel_error(out, np.asarray(ref, np.float64)) < RTOL


# -- 3. loading ------------------------------------------------------------------------------


def test_loading_without_the_option_names_the_tensors_and_the_option():
    with pytest.raises(ValueError, match=r"4 `to_gate_compress` tensors \('blocks\.0\.to_gate_"
                                         r"compress\.bias', 'blocks\.0\.to_gate_compress\.weight'"
                                         r".*gate_compress=True"):
        models.WanTransformer3D.from_pretrained(FIXTURE)
    with pytest.raises(ValueError, match="gate_compress=True expects .* has none"):
        models.WanTransformer3D.from_pretrained(DENSE, gate_compress=True)
    with pytest.raises(ValueError, match="`gate_compress` must be a bool"):
        models.WanTransformer3D.from_pretrained(FIXTURE, gate_compress="yes")


def test_names_save_and_attn1_alias(model, checkpoint, tmp_path):
    _, sd = checkpoint
    attn = model.blocks.self_attn
    np.testing.assert_array_equal(attn.to_gate_compress.weight[1], sd["blocks.1.to_gate_compress.weight"])
    np.testing.assert_array_equal(attn.to_gate_compress.bias[0], sd["blocks.0.to_gate_compress.bias"])
    assert model.config.gate_compress
    names = {n for entry in model.linear_layers() for n in entry.names}
    assert "blocks.1.to_gate_compress" in names and "blocks.1.self_attn.to_gate_compress" in names
    # save -> load: FastVideo's names, bit for bit
    model.save_pretrained(tmp_path / "saved")
    saved = _read_safetensors(tmp_path / "saved" / "diffusion_pytorch_model.safetensors")
    assert set(saved) == set(sd)
    again = models.WanTransformer3D.from_pretrained(tmp_path / "saved", gate_compress=True)
    assert harness.same_arrays(again, model)
    # the gates named under attn1 (as some converters write them) load the same
    alias = tmp_path / "attn1"
    alias.mkdir()
    shutil.copy(os.path.join(FIXTURE, "config.json"), alias / "config.json")
    renamed = {k.replace(".to_gate_compress.", ".attn1.to_gate_compress."): v for k, v in sd.items()}
    interop.write_checkpoint(alias, renamed)
    assert harness.same_arrays(models.WanTransformer3D.from_pretrained(alias, gate_compress=True), model)


def test_gate_follows_the_block_linears(model):
    # Megatron: column-parallel like q (stacked layers: the leading axis whole).
    mesh = harness.mesh(tp=2)
    specs = nn.sharding.partition_specs(nn.sharding.with_parallel(model, nn.sharding.ParallelConfig(tp_axis="tp")), mesh)
    gate, q = specs.blocks.self_attn.to_gate_compress, specs.blocks.self_attn.q
    assert gate.weight == q.weight == P(None, "tp", None) and gate.bias == q.bias == P(None, "tp")
    # LoRA by name pattern, in FastVideo's naming.
    lora = models.add_lora(model, "blocks.*.to_gate_compress", 2, key=jax.random.key(0))
    assert isinstance(lora.blocks.self_attn.to_gate_compress, nn.LoRALinear)
    assert not isinstance(lora.blocks.self_attn.q, nn.LoRALinear)


def test_with_gate_compress_starts_from_a_dense_model():
    dense = models.WanTransformer3D.from_pretrained(DENSE)
    assert dense.blocks.self_attn.to_gate_compress is None and not dense.config.gate_compress
    gated = dense.with_gate_compress()
    assert gated.config.gate_compress and gated.with_gate_compress() is gated
    g = gated.blocks.self_attn.to_gate_compress
    assert g.weight.shape == (2, 64, 64) and float(jnp.abs(g.weight).max()) == 0.0
    assert "blocks.0.to_gate_compress.weight" in gated.state_dict()


def test_bad_video_sparse_options(model, inputs):
    x, t, context, _ = inputs

    def trace(**kw):
        return eqx.filter_eval_shape(lambda m: m(x[0], t[0], context[0], **kw), model)

    with pytest.raises(ShapeError, match="`attention` must be SlidingTile or VideoSparseTiles"):
        trace(attention=(TILE, 3))
    with pytest.raises(ValueError, match="takes an int .* or a float"):
        trace(attention=models.VideoSparseTiles(TILE, True))
    with pytest.raises(ValueError, match=r"`topk` must be an int in \[1, 18\]"):
        trace(attention=models.VideoSparseTiles(TILE, 19))
    with pytest.raises(ValueError, match=r"`sparsity` must be a float in \[0, 1\)"):
        trace(attention=models.VideoSparseTiles(TILE, 1.0))
    with pytest.raises(ValueError, match="`tile`"):
        trace(attention=models.VideoSparseTiles((0, 2, 2), 3))
    # The keyword the option replaced, with its checks as they were.
    with pytest.warns(DeprecationWarning), \
            pytest.raises(ValueError, match="`video_sparse` must be a pair"):
        trace(video_sparse=(TILE,))
    with pytest.warns(DeprecationWarning), \
            pytest.raises(ValueError, match="`video_sparse` must be a pair"):
        trace(video_sparse=(TILE, True))
    with pytest.warns(DeprecationWarning), \
            pytest.raises(ValueError, match="`video_sparse` and `sliding_tile`"):
        trace(video_sparse=(TILE, 3), sliding_tile=(TILE, (3, 3, 3)))


def test_deprecated_video_sparse_keyword(model, inputs):
    """`video_sparse=(tile, topk)` (a plain pair, as it took) warns, naming
    `attention=models.VideoSparseTiles`, and gives the new spelling's numbers."""
    x, t, context, _ = inputs

    @eqx.filter_jit
    def run(m, x, t, c):  # both spellings in one program: one compile
        return (_batched(m, x, t, c, attention=VSA),
                _batched(m, x, t, c, video_sparse=(TILE, TOPK)))

    with pytest.warns(DeprecationWarning, match=r"WanTransformer3D\(video_sparse=\.\.\.\) is "
                      r"deprecated.*attention=models\.VideoSparseTiles"):
        new, old = run(model, x, t, context)
    np.testing.assert_array_equal(old, new)


# -- 4. nn.Attention ---------------------------------------------------------------------------


ATTN_DIM, ATTN_HEADS = 16, 2
VS = nn.VideoSparse(GRID, TILE, sparsity=0.75)  # ceil(0.25 * 18) = 5 tiles


def _attention_case():
    m = nn.Attention(ATTN_DIM, ATTN_HEADS, gate_compress=True, key=jax.random.key(3))
    m = harness.resampled(m, seed=4)  # random gate weights (they start at zero)
    rng = np.random.default_rng(8)
    S = VS.layout.video_len
    x = rng.standard_normal((S, ATTN_DIM)).astype(np.float32)
    cos, sin = _rope_tables(GRID, ATTN_DIM // ATTN_HEADS)
    coords, real = oracle.video_layout(GRID, TILE)
    flat = (coords[:, 0] * GRID[1] + coords[:, 1]) * GRID[2] + coords[:, 2]
    rope = tuple(np.where(real[:, None], a[np.where(real, flat, 0)], 0.0).astype(np.float32)
                 for a in (cos, sin))
    return m, x, rope


def test_attention_module_matches_the_oracle():
    m, x, rope = _attention_case()
    H, D = ATTN_HEADS, ATTN_DIM // ATTN_HEADS
    S = x.shape[0]
    q = oracle.rope(oracle.rms_norm(oracle.linear(x, m.q), m.norm_q.weight).reshape(S, H, D), *rope)
    k = oracle.rope(oracle.rms_norm(oracle.linear(x, m.k), m.norm_k.weight).reshape(S, H, D), *rope)
    v = oracle.linear(x, m.v).reshape(S, H, D)
    g = oracle.linear(x, m.to_gate_compress).reshape(S, H, D)
    r = oracle.video_sparse_attention(q[None], k[None], v[None], GRID, TILE, sparsity=0.75,
                                      gate=g[None])
    assert r.margin > 1e-3
    ref = oracle.linear(r.out[0].reshape(S, ATTN_DIM), m.o)
    rope = tuple(jax.device_put(a) for a in rope)
    x = jax.device_put(x)
    run = eqx.filter_jit(lambda m, x, rope, gate: m(x, rope=rope, video_sparse=VS, gate=gate))
    out = run(m, x, rope, None)
    assert harness.max_rel_error(out, ref) < RTOL
    # The same gate passed in to a module without the projection: the same numbers.
    bare = eqx.tree_at(lambda a: a.to_gate_compress, m, None)
    gate = jax.device_put(np.asarray(oracle.linear(x, m.to_gate_compress), np.float32))
    # (To float32 round-off: XLA fuses the projection differently when it is the module's.)
    assert harness.max_rel_error(run(bare, x, rope, gate), out) < 1e-6


def test_attention_bad_inputs():
    m, x, rope = _attention_case()
    x = jnp.asarray(x)

    def trace(module=m, x=x, **kw):
        return eqx.filter_eval_shape(lambda mod: mod(x, **kw), module)

    with pytest.raises(ValueError, match="cannot be combined with `mask`"):
        trace(video_sparse=VS, mask=kernels.SlidingTileMask(GRID, TILE, (3, 3, 3)))
    with pytest.raises(ValueError, match="cannot be combined with `segment_ids`"):
        trace(video_sparse=VS, segment_ids=jnp.zeros(x.shape[0], jnp.int32))
    with pytest.raises(ValueError, match="lays the video out as 144 tokens"):
        trace(x=x[:100], video_sparse=VS)
    with pytest.raises(ValueError, match="`gate` is the coarse output's gate"):
        trace(gate=x)
    with pytest.raises(ValueError, match="received a `gate` too"):
        trace(video_sparse=VS, gate=x)
    with pytest.raises(ValueError, match="`topk`"):
        nn.VideoSparse(GRID, TILE, topk=0)
    with pytest.raises(ValueError, match="exactly one of `topk`"):
        nn.VideoSparse(GRID, TILE)


def test_attention_gate_passed_in_under_tensor_parallelism():
    # A gate given as (S, dim) is split by heads like q's columns on each TP rank.
    m, x, rope = _attention_case()
    bare = eqx.tree_at(lambda a: a.to_gate_compress, m, None)
    gate = jax.device_put(np.random.default_rng(9).standard_normal(x.shape).astype(np.float32))
    x, rope = jax.device_put(x), tuple(jax.device_put(a) for a in rope)
    ref = eqx.filter_jit(lambda m, x, r, g: m(x, rope=r, video_sparse=VS, gate=g))(bare, x, rope, gate)
    mesh = harness.mesh(tp=2)
    tp = nn.sharding.shard_module(nn.sharding.with_parallel(bare, nn.sharding.ParallelConfig(tp_axis="tp")), mesh)
    run = nn.sharding.filter_shard_map(lambda m, x, r, g: m(x, rope=r, video_sparse=VS, gate=g), mesh=mesh,
                              in_specs=(nn.sharding.partition_specs(tp, mesh), P(), P(), P()),
                              out_specs=P())
    out = eqx.filter_jit(run)(tp, x, rope, gate)
    assert harness.max_rel_error(out, np.asarray(ref, np.float64)) < RTOL
