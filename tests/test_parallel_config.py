"""A module's parallel configuration against how it is really called.

1. Mismatches the kit can know raise, naming the fix: inside
   `shard_map(check_vma=True)` every value carries the mesh axes it varies over, so
   a sequence sharded under a one-device `ParallelConfig`, a replicated sequence
   under a sequence-parallel one, tokens split over the tensor-parallel axis, or a
   sharded text context are refused; so are the parallel functions' and `core`'s
   equivalents. A data-parallel axis alone stays legal.
2. What no value records (RoPE tables in another layout than the tokens) has a
   helper instead: `nn.sharding.shard_tokens` gives exactly the rows a configuration expects.
3. One optimizer state for every configuration: `ParallelConfig` is a leaf, not part
   of the tree structure, so an optax AdamW state built from the single-device model
   steps the Ulysses, ring and USP x TP variants and back, equal to single-device
   training; `partition_specs` of one variant places another.
4. `jax.make_mesh`'s Explicit axes: the Megatron path works, and a sharded input
   `core` cannot plan for gets an error saying what to do.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import harness
import oracle
from vidax_eqx import core, nn, parallel


F32 = jnp.float32
SP, TP, DP, RING = parallel.SP_AXIS, parallel.TP_AXIS, parallel.DP_AXIS, "ring"
DIM, H, S, B = 32, 4, 16, 2


@pytest.fixture(scope="module")
def attn():
    return nn.Attention(DIM, H, key=jax.random.key(0))


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(1), (B, S, DIM), F32)


def _run(module, x, mesh, x_spec, *, context=None, c_spec=P()):
    """`vmap(module)` over the batch inside `shard_map`, the module placed by its specs."""
    def call(m, x, c):
        return jax.vmap(m)(x) if c is None else jax.vmap(m)(x, c)

    out_spec = x_spec if not isinstance(module, nn.JointAttention) else (x_spec, P())
    f = nn.sharding.filter_shard_map(call, mesh=mesh, in_specs=(nn.sharding.partition_specs(module), x_spec, c_spec),
                            out_specs=out_spec)
    return eqx.filter_jit(f)(module, x, context)


# -- 1. mismatches that raise ----------------------------------------------------------


def test_one_device_config_on_a_sharded_sequence_raises(attn, x):
    with pytest.raises(ValueError, match=r"varies over the mesh axis 'sp'.*with_parallel"):
        _run(attn, x, harness.mesh(sp=4), P(None, SP))
    joint = nn.JointAttention(DIM, H, key=jax.random.key(2))
    with pytest.raises(ValueError, match=r"JointAttention: `x` varies over the mesh axis 'sp'"):
        _run(joint, x, harness.mesh(sp=4), P(None, SP), context=x[:, :3])


def test_sequence_parallel_config_on_a_replicated_sequence_raises(attn, x):
    for cfg, mesh in ((nn.sharding.ParallelConfig(sequence="ulysses"), harness.mesh(sp=4)),
                      (nn.sharding.ParallelConfig(sequence="ring", layout="zigzag"), harness.mesh(sp=4)),
                      (nn.sharding.ParallelConfig(sequence="usp", ring_axis=RING), harness.mesh(sp=2, ring=2))):
        with pytest.raises(ValueError, match=r"same on every device of '(sp|ring)' \(replicated\)"):
            _run(nn.sharding.with_parallel(attn, cfg), x, mesh, P())


def test_tokens_over_the_tensor_parallel_axis_raise(attn, x):
    tp = nn.sharding.with_parallel(attn, nn.sharding.ParallelConfig(tp_axis=TP))
    with pytest.raises(ValueError, match=r"tensor-parallel axis 'tp'.*splits heads, not tokens"):
        _run(tp, x, harness.mesh(tp=2), P(None, TP))


def test_sharded_text_context_raises(x):
    cross = nn.CrossAttention(DIM, H, key=jax.random.key(3))
    with pytest.raises(ValueError, match=r"CrossAttention: `context` \(the text\).*\['sp'\]"):
        _run(cross, x, harness.mesh(sp=4), P(None, SP), context=x[:, :8], c_spec=P(None, SP))


def test_weights_placed_for_tp_under_a_config_without_tp_raise(attn, x):
    placed_for_tp = nn.sharding.partition_specs(nn.sharding.with_parallel(attn, nn.sharding.ParallelConfig(tp_axis=TP)))
    f = nn.sharding.filter_shard_map(lambda m, x: jax.vmap(m)(x), mesh=harness.mesh(tp=2),
                            in_specs=(placed_for_tp, P()), out_specs=P())
    with pytest.raises(ValueError, match=r"no tp_axis.*received 16.*with_parallel"):
        eqx.filter_jit(f)(attn, x)


def test_parallel_functions_and_core_refuse_replicated_or_sharded_misuse():
    q = jax.random.normal(jax.random.key(4), (1, S, H, 8), F32)
    mesh = harness.mesh(sp=4)

    def run(fn, spec):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))(q)

    with pytest.raises(ValueError, match=r"ring_attention: `q` must be this device's chunk"):
        run(lambda q: parallel.ring_attention(q, q, q, ring_axis=SP), P())
    with pytest.raises(ValueError, match=r"sequence_parallel_self_attention: `q` must be"):
        run(lambda q: parallel.sequence_parallel_self_attention(q, q, q, SP), P())
    with pytest.raises(ValueError, match=r"dot_product_attention: `q` varies over the mesh axis"):
        run(lambda q: core.dot_product_attention(q, q, q), P(None, SP))
    usp_mesh = harness.mesh(sp=2, ring=2)
    with pytest.raises(ValueError, match=r"usp_attention: `q` must be"):
        jax.jit(jax.shard_map(
            lambda q: parallel.usp_attention(q, q, q, ulysses_axis=SP, ring_axis=RING),
            mesh=usp_mesh, in_specs=P(), out_specs=P()))(q)


def test_data_parallel_axis_and_sharded_cross_attention_queries_stay_legal(attn, x):
    ref = jax.vmap(attn)(x)
    oracle.assert_close(_run(attn, x, harness.mesh(dp=2), P(DP)), ref, F32, "dp")
    cross = nn.CrossAttention(DIM, H, key=jax.random.key(3))
    ctx = x[:, :8]
    oracle.assert_close(_run(cross, x, harness.mesh(sp=4), P(None, SP), context=ctx),
                        jax.vmap(cross)(x, ctx), F32, "cross, queries sharded")


# -- 2. shard_tokens --------------------------------------------------------------------


@pytest.mark.parametrize("cfg, sizes", [
    (nn.sharding.ParallelConfig(sequence="ulysses"), dict(sp=4)),
    (nn.sharding.ParallelConfig(sequence="ring", layout="zigzag"), dict(sp=4)),
    (nn.sharding.ParallelConfig(sequence="usp", ring_axis=RING, layout="zigzag"), dict(sp=2, ring=4)),
    (nn.sharding.ParallelConfig(sequence="usp", ring_axis=RING), dict(sp=2, ring=2)),
])
def test_shard_tokens_gives_the_rows_of_the_layout(cfg, sizes):
    rope = nn.functional.rope_3d((2, 4, 4), 8)  # 32 tokens
    mesh = harness.mesh(**sizes)
    seq = (RING, SP) if cfg.sequence == "usp" else SP
    got = jax.jit(jax.shard_map(lambda: nn.sharding.shard_tokens(rope, cfg), mesh=mesh, in_specs=(),
                                out_specs=P(seq)))()
    # The reference layout, written out: zigzag over the ring, then contiguous chunks
    # in the order the sequence in_spec gives the devices.
    n_ring = sizes.get("ring", 1) if cfg.sequence == "usp" else sizes["sp"]
    for got_t, ref_t in zip(got, rope):
        ref = np.asarray(ref_t)
        if cfg.layout == "zigzag":
            chunks = np.split(ref, 2 * n_ring)
            ref = np.concatenate([c for r in range(n_ring) for c in (chunks[r], chunks[-1 - r])])
        np.testing.assert_array_equal(np.asarray(got_t), ref)
    assert nn.sharding.shard_tokens(rope, nn.sharding.ParallelConfig()) is rope


def test_zigzag_module_with_shard_tokens_rope_equals_single_device(attn, x):
    cfg = nn.sharding.ParallelConfig(sequence="ring", layout="zigzag")
    rope = nn.functional.rope_3d((1, 4, 4), DIM // H)

    def per_device(m, x):
        r = nn.sharding.shard_tokens(rope, cfg)
        return jax.vmap(lambda x: m(x, rope=r))(x)

    f = nn.sharding.filter_shard_map(per_device, mesh=harness.mesh(sp=4),
                            in_specs=(nn.sharding.partition_specs(attn), P(None, SP)), out_specs=P(None, SP))
    zz = parallel.zigzag_permute(x, 1, 4)
    out = parallel.zigzag_unpermute(eqx.filter_jit(f)(nn.sharding.with_parallel(attn, cfg), zz), 1, 4)
    oracle.assert_close(out, jax.vmap(lambda x: attn(x, rope=rope))(x), F32, "zigzag + rope")


# -- 3. one optimizer state for every configuration -------------------------------------


VARIANTS = {
    "none": (nn.sharding.ParallelConfig(), None, P()),
    # Every mesh spans the 8 devices (a data-parallel axis where the rest is smaller),
    # so that one program's outputs are where the next one expects them.
    "ulysses": (nn.sharding.ParallelConfig(sequence="ulysses"), dict(dp=2, sp=4), P(DP, SP)),
    "ring-zigzag": (nn.sharding.ParallelConfig(sequence="ring", layout="zigzag"), dict(dp=2, sp=4),
                    P(DP, SP)),
    "usp-tp": (nn.sharding.ParallelConfig(sequence="usp", ring_axis=RING, tp_axis=TP),
               dict(sp=2, ring=2, tp=2), P(None, (RING, SP))),
}


def _loss_and_grad(model, name, x, ct):
    cfg, sizes, spec = VARIANTS[name]
    model = nn.sharding.with_parallel(model, cfg)
    zigzag = cfg.layout == "zigzag"

    def loss(m):
        if sizes is None:
            out = jax.vmap(m)(x)
        else:
            f = nn.sharding.filter_shard_map(lambda m, x: jax.vmap(m)(x), mesh=harness.mesh(**sizes),
                                    in_specs=(nn.sharding.partition_specs(m), spec), out_specs=spec)
            xs = parallel.zigzag_permute(x, 1, sizes["sp"]) if zigzag else x
            out = f(m, xs)
            out = parallel.zigzag_unpermute(out, 1, sizes["sp"]) if zigzag else out
        return jnp.sum(out * ct)

    return eqx.filter_value_and_grad(loss)(model), model


def test_one_adamw_state_steps_every_configuration(attn, x):
    ct = jax.random.normal(jax.random.key(5), x.shape, F32)
    opt = optax.adamw(1e-2, eps=1e-3)  # eps: no sign flips of ~0 gradients between paths

    @eqx.filter_jit
    def step(model, state, name):
        (loss, grads), model = _loss_and_grad(model, name, x, ct)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, loss

    schedule = ["none", "ulysses", "ring-zigzag", "usp-tp", "none"]
    model, state = attn, opt.init(eqx.filter(attn, eqx.is_array))  # from the 1-device model
    ref_model, ref_state = attn, state
    for name in schedule:
        model, state, loss = step(model, state, name)
        ref_model, ref_state, ref_loss = step(ref_model, ref_state, "none")
        oracle.assert_close(loss, ref_loss, F32, f"loss, {name}")
        # The variant keeps its own configuration; the state is the one state.
        assert model.parallel == VARIANTS[name][0]
        assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    arrays = jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_array))
    for (path, got), want in zip(arrays, jax.tree.leaves(eqx.filter(ref_model, eqx.is_array))):
        oracle.assert_close(got, want, F32, jax.tree_util.keystr(path))


def test_variants_share_one_structure_and_specs_place_each_other(attn, x):
    variants = {n: nn.sharding.with_parallel(attn, cfg) for n, (cfg, _, _) in VARIANTS.items()}
    structures = {jax.tree.structure(v) for v in variants.values()}
    assert len(structures) == 1, "the parallel configuration must not be tree structure"
    # Specs of the Ulysses variant (no TP) place the ring variant, and the usp x tp
    # variant's specs place a Ulysses x tp variant.
    ring = nn.sharding.with_parallel(attn, VARIANTS["ring-zigzag"][0])
    out = _run(ring, parallel.zigzag_permute(x, 1, 4), harness.mesh(sp=4), P(None, SP))
    assert nn.sharding.partition_specs(variants["ulysses"]) == nn.sharding.partition_specs(ring)
    uly_tp = nn.sharding.with_parallel(attn, nn.sharding.ParallelConfig(sequence="ulysses", tp_axis=TP))
    specs = nn.sharding.partition_specs(variants["usp-tp"])
    f = nn.sharding.filter_shard_map(lambda m, x: jax.vmap(m)(x), mesh=harness.mesh(sp=2, tp=2),
                            in_specs=(specs, P(None, SP)), out_specs=P(None, SP))
    ref = jax.vmap(attn)(x)
    oracle.assert_close(eqx.filter_jit(f)(uly_tp, x), ref, F32, "ulysses x tp, usp specs")
    oracle.assert_close(parallel.zigzag_unpermute(out, 1, 4), ref, F32, "ring, ulysses specs")


def test_plain_jax_jit_on_a_module_names_the_equinox_idiom(attn, x):
    # The configuration is a non-array leaf: Equinox's filtered transformations (or a
    # closure) take modules, plain `jax.jit` with a module argument does not.
    with pytest.raises(TypeError):
        jax.jit(lambda m, x: m(x))(attn, x[0])
    oracle.assert_close(jax.jit(lambda x: attn(x))(x[0]), eqx.filter_jit(lambda m, x: m(x))(attn, x[0]),
                        F32, "closure == filter_jit")


# -- 4. Explicit meshes -----------------------------------------------------------------


def test_explicit_mesh_megatron_works_and_sharded_inputs_name_the_fix():
    q = jax.random.normal(jax.random.key(6), (2, S, H, 8), F32)
    mesh = jax.make_mesh((2, 4), (DP, TP), axis_types=(AxisType.Explicit,) * 2)
    out = core.dot_product_attention(q, q, q, mesh=mesh)
    oracle.assert_close(out, core.dot_product_attention(q, q, q), F32, "explicit mesh")
    seq_mesh = jax.make_mesh((8,), (SP,), axis_types=(AxisType.Explicit,))
    qs = jax.device_put(q, NamedSharding(seq_mesh, P(None, SP)))
    with pytest.raises(ValueError, match=r"Explicit mesh axes \['sp'\].*pass `mesh=`"):
        core.dot_product_attention(qs, qs, qs)


def test_partition_specs_of_the_whole_module_place_its_arrays_part(attn):
    tp = nn.sharding.with_parallel(attn, nn.sharding.ParallelConfig(tp_axis=TP))
    arrays, _ = eqx.partition(tp, eqx.is_array)
    specs = nn.sharding.partition_specs(tp)
    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(harness.mesh(tp=2), s)),
                          arrays, specs)
    assert placed.q.weight.sharding.spec == P(TP, None)
    with pytest.raises(ValueError, match=r"partition_specs on the whole module"):
        nn.sharding.partition_specs(arrays)


def test_module_on_an_explicitly_sharded_sequence_outside_shard_map_names_the_fix(attn, x):
    mesh = jax.make_mesh((8,), (SP,), axis_types=(AxisType.Explicit,))
    xs = jax.device_put(x[0], NamedSharding(mesh, P(SP)))
    with pytest.raises(ValueError, match=r"Attention: `x` is sharded over the Explicit mesh axes"):
        attn(xs)


def test_a_sequence_axis_of_size_one_is_never_a_mismatch(attn, x):
    # Ulysses over sp = 1 (x trivially "replicated" over it) is the single-device answer.
    uly = nn.sharding.with_parallel(attn, nn.sharding.ParallelConfig(sequence="ulysses", tp_axis=TP))
    f = nn.sharding.filter_shard_map(lambda m, x: jax.vmap(m)(x), mesh=harness.mesh(sp=1, tp=2),
                            in_specs=(nn.sharding.partition_specs(uly), P()), out_specs=P(None, SP))
    oracle.assert_close(eqx.filter_jit(f)(uly, x), jax.vmap(attn)(x), F32, "sp = 1")
