"""Trains a tiny Wan 2.1 DiT by flow matching, on 1 device and sharded, and resumes it from orbax.

The model is `vidax_eqx.models.WanTransformer3D` at a tiny size (dim 64, 8 heads,
2 blocks, randomly initialized). The data is a fixed synthetic set: 4 video
latents `(4, 3, 6, 10)` (4 channels, 3 frames, 6 x 10 pixels: 45 tokens of 1 x 2 x 2
patches) and 4 text contexts `(7, 32)`. Each step takes the whole set, Wan's
rectified-flow (flow matching) loss, and one AdamW update:

    sigma = sigmoid(n),  n ~ N(0, 1)           # one per example
    eps ~ N(0, 1)                              # like x0
    x_t = (1 - sigma) * x0 + sigma * eps       # the noisy latents
    v = eps - x0                               # the target velocity
    loss = mean((model(x_t, 1000 * sigma, context) - v) ** 2)

The draws of step `i` come from NumPy seeded with `(seed, i)`, so every run below
sees the same ones.

1. **One device vs sharded.** `--steps` steps on one device, then the same steps
   from the same weights and AdamW state on 8 simulated CPU devices through
   `models.run_sharded`: the tokens split over "sp" (`--sequence ulysses`, `ring`,
   or `usp`: Ulysses over sp/2 x a ring of 2), the heads and MLP features over "tp"
   (Megatron), the batch over "dp" (`--dp`), every weight fully sharded (FSDP,
   `--fsdp`: on by default when `--dp` > 1) over "dp" and "sp" (and "ring" with
   `usp`; the sequence axes alone with `--dp 1`), the weights placed by `nn.sharding.shard_module`, the AdamW state by
   `nn.sharding.shard_like`, and each block rematerialized in the backward pass (`--remat`,
   default `"full"`). The model's `ParallelConfig` is a non-array leaf, not tree
   structure, so the one AdamW state serves both. Checks: the loss went down, the
   sharded losses equal the 1-device ones to `--tol` (relative), and the sharded
   step compiled once.
2. **Resume.** The sharded run's model arrays, AdamW state and step are saved with
   `models.save_training_state` and restored with `models.restore_training_state`
   into abstract templates (`eqx.filter_eval_shape`: no initialization): the arrays
   from the checkpoint, the non-array parts (config, `ParallelConfig`) from the
   templates. The live and the restored state then train `--resume-steps` more
   steps. Checks: the restore is bit for bit, so are the losses, parameters and
   AdamW state after, and the restored state reuses the compiled step.
3. **Resume in another configuration.** The same checkpoint restored onto the same
   mesh with FSDP switched (off when the run had it, on as `--fsdp` puts it when it
   had not), trained `--resume-steps` steps. Checks: the restore is bit for bit, and the
   losses equal the live run's to `--tol`.

    python examples/train_wan.py
    python examples/train_wan.py --dp 2 --sp 2 --tp 2
    python examples/train_wan.py --sequence ring --dp 2 --sp 2 --tp 2 --remat dots_saveable
    python examples/train_wan.py --sequence usp --steps 8 --no-fsdp
    python examples/train_wan.py --lora 8 --dp 2 --sp 2 --tp 2

**LoRA** (`--lora RANK`): instead of 2 and 3, only low-rank adapters are trained. They
go on every attention projection and FFN layer of the blocks (`models.add_lora` by
name pattern; `lora_B` starts at zero, so the model starts as it was), the model is
split by `eqx.partition(model, nn.lora_filter(model))`, and AdamW holds state for the
adapters only. Steps 1 (one device vs sharded, the adapters following their layers'
tensor-parallel split; the AdamW state placed by `nn.sharding.shard_like(..., filter_spec=)`)
run as above; then the adapters are saved as a diffusers/PEFT LoRA file
(`models.save_lora`, into `--checkpoint-dir/lora` when given), loaded back into the base model (`models.load_lora`)
and merged into its weights (`nn.merge_lora`). Checks: the loss went down, sharded ==
1 device, the base weights did not move, the optimizer state is adapter-sized, the
file gives back the adapters bit for bit, and the merged model computes the adapted
one.

Prints the per-step losses and every check; exits non-zero if one fails.
"""

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time


# 8 simulated CPU devices; XLA reads this when JAX initializes its backend. Unless
# XLA_FLAGS says otherwise, XLA's CPU backend also skips its expensive optimizations:
# the programs here are tiny, and they compile in about two thirds of the time (the
# results agree to the same tolerances; what is compared bit for bit runs one program).
_FLAG = "--xla_force_host_platform_device_count=8"
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count")]
_flags += [f for f in _FAST_COMPILE if f.split("=")[0] not in {g.split("=")[0] for g in _flags}]
os.environ["XLA_FLAGS"] = " ".join([*_flags, _FLAG])

# Run against this checkout's vidax_eqx when it is not installed.
try:
    import vidax_eqx  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from vidax_eqx import models, nn, parallel


CONFIG = models.WanConfig(dim=64, ffn_dim=96, num_heads=8, num_layers=2, in_channels=4,
                          out_channels=4, text_dim=32, freq_dim=32)
LATENTS = (4, 4, 3, 6, 10)  # (examples, channels, frames, height, width)
TEXT = (7, 32)  # (tokens, text_dim)


# -- model, data and loss ----------------------------------------------------------------


def dataset(seed):
    """The fixed training set: clean latents `x0 (B, C, F, H, W)` and text `context (B, L, D)`."""
    rng = np.random.default_rng([seed, 0])
    x0 = rng.standard_normal(LATENTS, np.float32)
    context = rng.standard_normal((LATENTS[0], *TEXT), np.float32)
    return x0, context


def flow_matching_batch(seed, step, x0):
    """Wan's rectified flow at step `step`: `(x_t, timestep, v)`.

    `sigma = sigmoid(N(0, 1))` per example (logit-normal), `eps ~ N(0, 1)`,
    `x_t = (1 - sigma) x0 + sigma eps`, `timestep = 1000 sigma`, target velocity
    `v = eps - x0`. Drawn with NumPy from `(seed, step)`: every run sees the same
    draws, whatever its devices.
    """
    rng = np.random.default_rng([seed, 1, step])
    sigma = 1 / (1 + np.exp(-rng.standard_normal(x0.shape[0]).astype(np.float32)))
    eps = rng.standard_normal(x0.shape, np.float32)
    s = sigma[:, None, None, None, None]
    return (1 - s) * x0 + s * eps, 1000 * sigma, eps - x0


def make_step(optimizer, forward):
    """One jitted AdamW step of the flow-matching loss; `forward(model, x_t, timestep,
    context)` is the batched model (one device or sharded)."""

    @eqx.filter_jit
    def step(model, opt_state, x_t, timestep, context, v):
        def loss_fn(model):
            pred = forward(model, x_t, timestep, context)
            return jnp.mean((pred.astype(jnp.float32) - v) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


def train(step, model, opt_state, data, seed, steps, *, first=0, place=lambda a: a):
    """Runs steps `first, ..., first + steps - 1`; returns the model, state and losses.

    `place` puts each batch where the step wants it (the mesh, for a sharded run).
    """
    x0, context = data
    losses = []
    for i in range(first, first + steps):
        x_t, timestep, v = flow_matching_batch(seed, i, x0)
        model, opt_state, loss = step(model, opt_state, *place((x_t, timestep, context, v)))
        losses.append(float(loss))
    return model, opt_state, losses


# -- the mesh ----------------------------------------------------------------------------


def sharded_setup(sequence, dp, sp, tp, fsdp):
    """`(mesh, ParallelConfig)` for `sequence` over `sp` devices x `tp` x `dp`, the
    weights fully sharded over `fsdp_axes(sequence, dp, fsdp)`.

    `usp` splits the `sp` devices into Ulysses over "sp" (`sp // 2`) and a ring of 2
    over "ring".
    """
    if sequence == "usp":
        mesh = parallel.make_mesh(dp=dp, sp=sp // 2, tp=tp, extra_axes={"ring": 2})
        config = nn.sharding.ParallelConfig(sequence="usp", ring_axis="ring", tp_axis="tp",
                                   fsdp_axes=fsdp_axes(sequence, dp, fsdp))
    else:
        mesh = parallel.make_mesh(dp=dp, sp=sp, tp=tp)
        config = nn.sharding.ParallelConfig(sequence=sequence, tp_axis="tp",
                                   fsdp_axes=fsdp_axes(sequence, dp, fsdp))
    return mesh, config


def sharded_training(args, fsdp, make, optimizer):
    """The mesh and `ParallelConfig` of the command line, the placement of a batch on
    it, and the sharded step `make(optimizer, forward)` (`make_step` or
    `make_lora_step`) running the model through `models.run_sharded`."""
    mesh, pconfig = sharded_setup(args.sequence, args.dp, args.sp, args.tp, fsdp)
    batch_axis = "dp" if args.dp > 1 else None
    place = lambda tree: jax.device_put(tree, NamedSharding(mesh, P(batch_axis)))  # noqa: E731
    step = make(optimizer, lambda m, x, t, c: models.run_sharded(
        m, x, t, c, mesh=mesh, batch_axis=batch_axis, remat=args.remat))
    return mesh, pconfig, place, step


def fsdp_axes(sequence, dp, fsdp):
    """The mesh axes FSDP splits the weights over: "dp" (with `--dp` > 1) and the
    sequence axes ("sp"; "sp" and "ring" for `usp`); `()` without FSDP."""
    if not fsdp:
        return ()
    return ("dp",) * (dp > 1) + ("sp",) + ("ring",) * (sequence == "usp")


# -- checks ------------------------------------------------------------------------------------


class Compilations:
    """Counts the XLA compilations of programs named `name` (jax.monitoring)."""

    def __init__(self, name: str):
        self.name, self.count = name, 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration" and self.name in kwargs.get(
                "fun_name", ""):
            self.count += 1


def bitwise_equal(a, b) -> bool:
    """Whether two PyTrees have the same structure and bit-identical arrays."""
    a_leaves, a_def = jax.tree.flatten(eqx.filter(a, eqx.is_array))
    b_leaves, b_def = jax.tree.flatten(eqx.filter(b, eqx.is_array))
    return a_def == b_def and all(
        x.dtype == y.dtype and x.shape == y.shape
        and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(a_leaves, b_leaves)
    )


# -- main ------------------------------------------------------------------------------------


def invalid_arguments(args) -> str | None:
    """What is wrong with the command line, with the fix, or `None`."""
    n_devices = args.dp * args.sp * args.tp
    ulysses = {"ulysses": args.sp, "usp": args.sp // 2, "ring": 1}[args.sequence]
    if args.steps < 2 or args.resume_steps < 1:
        return (f"needs --steps >= 2 (to see the loss go down) and --resume-steps >= 1; "
                f"received --steps {args.steps}, --resume-steps {args.resume_steps}.")
    if min(args.dp, args.sp, args.tp) < 1:
        return (f"--dp, --sp and --tp must be positive; received --dp {args.dp}, --sp {args.sp}, "
                f"--tp {args.tp}.")
    if n_devices > len(jax.devices()):
        return (f"dp={args.dp} x sp={args.sp} x tp={args.tp} needs {n_devices} devices, found "
                f"{len(jax.devices())}; use smaller sizes (or set XLA_FLAGS before JAX is "
                "imported).")
    if LATENTS[0] % args.dp:
        return f"--dp must divide the batch ({LATENTS[0]}); received --dp {args.dp}."
    if args.sequence == "usp" and args.sp % 2:
        return (f"--sequence usp splits --sp into Ulysses over sp/2 x a ring of 2, so --sp must "
                f"be even; received --sp {args.sp}.")
    if CONFIG.num_heads % (args.tp * ulysses):
        return (f"the {CONFIG.num_heads} heads split over tp ({args.tp}) and then over the "
                f"Ulysses devices ({ulysses}) must divide evenly; received --tp {args.tp}, "
                f"--sp {args.sp}, --sequence {args.sequence}. Use powers of 2.")
    return None


def check(name: str, ok: bool, detail: str) -> bool:
    """Prints one check's line; returns `ok`."""
    print(f"  check {name:<32} {'ok' if ok else 'FAILED'}  ({detail})")
    return ok


def templates(optimizer, config):
    """Abstract `(model, AdamW state)` for the `ParallelConfig` `config`: shapes, dtypes
    and the non-array parts, no arrays (`eqx.filter_eval_shape`), for a restore."""
    def init():
        model = models.WanTransformer3D(CONFIG, key=jax.random.PRNGKey(0))
        model = nn.sharding.with_parallel(model, config)
        return model, optimizer.init(eqx.filter(model, eqx.is_array))

    return eqx.filter_eval_shape(init)


def describe(args, config) -> str:
    """The sharded layout in words."""
    layout = (f"sp={args.sp // 2}(ulysses) x ring=2" if args.sequence == "usp"
              else f"sp={args.sp}({args.sequence})")
    fsdp = f"fsdp over {' x '.join(config.fsdp_axes)}" if config.fsdp_axes else "no fsdp"
    return f"dp={args.dp} x {layout} x tp={args.tp}, {fsdp}, remat={args.remat}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Runs on 8 simulated CPU devices (XLA_FLAGS is set by this script).",
    )
    p.add_argument("--steps", type=int, default=4, help="training steps compared (default 4)")
    p.add_argument("--resume-steps", type=int, default=2,
                   help="steps run after the checkpoint, live and restored (default 2)")
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW learning rate (default 3e-3; 3e-2 with --lora)")
    p.add_argument("--sequence", default="ulysses", choices=["ulysses", "ring", "usp"],
                   help="sequence parallelism over 'sp' (default ulysses; usp: Ulysses over "
                        "sp/2 x a ring of 2)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    p.add_argument("--sp", type=int, default=4, help="sequence-parallel size (default 4)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None,
                   help="fully shard the weights and AdamW state over 'dp' and 'sp' (and "
                        "'ring' with usp; the sequence axes alone with --dp 1); default: on "
                        "when --dp > 1")
    p.add_argument("--remat", default="full", choices=models.REMAT_POLICIES,
                   help="rematerialization of the sharded run (default full)")
    p.add_argument("--checkpoint-dir",
                   help="where the orbax checkpoint goes (default: a temporary directory, "
                        "removed at exit)")
    p.add_argument("--tol", type=float, default=1e-5,
                   help="largest allowed |sharded - single| / |single| per loss, and between "
                        "configurations after a restore (default 1e-5)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed (default 0)")
    p.add_argument("--lora", type=int, metavar="RANK",
                   help="train only LoRA adapters of this rank, save them as a LoRA file, "
                        "load and merge them (instead of the full training and the resume)")
    args = p.parse_args(argv)

    error = invalid_arguments(args)
    if error:
        print(error, file=sys.stderr)
        return 2
    fsdp = args.dp > 1 if args.fsdp is None else args.fsdp
    if args.lr is None:
        args.lr = 3e-3 if args.lora is None else 3e-2
    if args.lora is not None:
        return lora_main(args, fsdp)

    model = models.WanTransformer3D(CONFIG, key=jax.random.PRNGKey(args.seed))
    data = dataset(args.seed)
    optimizer = optax.adamw(args.lr)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    n_params = sum(a.size for a in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    print(f"Wan: dim={CONFIG.dim}, heads={CONFIG.num_heads}, layers={CONFIG.num_layers}, "
          f"{n_params:,} parameters; data: {LATENTS[0]} latents {LATENTS[1:]}, text {TEXT}; "
          f"AdamW lr={args.lr:g}")
    compiled = Compilations("step")

    # 1. One device.
    t0 = time.perf_counter()
    single_step = make_step(optimizer, lambda m, x, t, c: jax.vmap(m)(x, t, c))
    single_model, _, single = train(single_step, model, opt_state, data, args.seed, args.steps)
    single_time = time.perf_counter() - t0

    # 2. The same weights, optimizer state and draws, sharded.
    t0 = time.perf_counter()
    mesh, pconfig, place, sharded_step = sharded_training(args, fsdp, make_step, optimizer)
    sharded = nn.sharding.shard_module(nn.sharding.with_parallel(model, pconfig), mesh)
    sharded_state = nn.sharding.shard_like(opt_state, sharded, mesh)
    before = compiled.count
    sharded, sharded_state, losses = train(sharded_step, sharded, sharded_state, data, args.seed,
                                           args.steps, place=place)
    sharded_compiles = compiled.count - before
    sharded_time = time.perf_counter() - t0

    print(f"\n step  {'1 device':>12}  {'sharded':>12}  |diff|")
    for i, (a, b) in enumerate(zip(single, losses)):
        print(f" {i:4d}  {a:12.8f}  {b:12.8f}  {abs(a - b):.2e}")
    print(f" 1 device: {single_time:.1f} s; sharded ({describe(args, pconfig)}): "
          f"{sharded_time:.1f} s (both including compilation)")
    max_diff = max(abs(a - b) for a, b in zip(single, losses))
    max_rel = max(abs(a - b) / abs(a) for a, b in zip(single, losses))
    param_diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(
        jax.tree.leaves(eqx.filter(single_model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(sharded, eqx.is_array))))
    ok = check("loss decreased (1 device)", single[-1] < single[0],
               f"{single[0]:.6f} -> {single[-1]:.6f}")
    ok &= check("loss decreased (sharded)", losses[-1] < losses[0],
                f"{losses[0]:.6f} -> {losses[-1]:.6f}")
    ok &= check("sharded == 1 device", max_rel <= args.tol,
                f"max|diff| = {max_diff:.2e}, relative {max_rel:.2e} <= {args.tol:g}; "
                f"parameters max|diff| = {param_diff:.2e}")
    ok &= check("sharded step compiled once", sharded_compiles == 1,
                f"{sharded_compiles} compilation(s) in {args.steps} steps")

    # 3. Checkpoint the sharded run; restore it into abstract templates, in the same
    # configuration and in another one (FSDP switched), and continue all three.
    other = dataclasses.replace(
        pconfig, fsdp_axes=() if fsdp else fsdp_axes(args.sequence, args.dp, True))
    tmp = None if args.checkpoint_dir else tempfile.mkdtemp(prefix="train_wan_")
    path = os.path.abspath(os.path.join(args.checkpoint_dir or tmp, f"step_{args.steps}"))
    try:
        t0 = time.perf_counter()
        models.save_training_state(path, sharded, sharded_state, args.steps,
                                   overwrite=args.checkpoint_dir is not None)
        save_time = time.perf_counter() - t0
        t0 = time.perf_counter()
        model_t, state_t = templates(optimizer, pconfig)
        restored, restored_state, step = models.restore_training_state(
            path, model_t, state_t, mesh=mesh)
        restore_time = time.perf_counter() - t0
        model_t, state_t = templates(optimizer, other)
        moved, moved_state, moved_step = models.restore_training_state(
            path, model_t, state_t, mesh=mesh)
        moved_exact = bitwise_equal(moved, sharded) and bitwise_equal(moved_state, sharded_state)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n checkpoint: {path} ({'temporary, removed' if tmp else 'kept'}); save "
          f"{save_time:.1f} s, restore {restore_time:.1f} s")
    ok &= check("restored == saved", step == args.steps and bitwise_equal(restored, sharded)
                and bitwise_equal(restored_state, sharded_state),
                f"step {step}, model and AdamW state bit for bit")

    t0 = time.perf_counter()
    live, live_state, live_losses = train(sharded_step, sharded, sharded_state, data, args.seed,
                                          args.resume_steps, first=args.steps, place=place)
    before = compiled.count
    restored, restored_state, restored_losses = train(
        sharded_step, restored, restored_state, data, args.seed, args.resume_steps, first=step,
        place=place)
    restored_compiles = compiled.count - before
    resume_time = time.perf_counter() - t0
    t0 = time.perf_counter()
    moved, moved_state, moved_losses = train(
        sharded_step, moved, moved_state, data, args.seed, args.resume_steps, first=moved_step,
        place=place)
    moved_time = time.perf_counter() - t0
    print(f"\n step  {'live':>12}  {'restored':>12}  {'other config':>12}")
    for i, (a, b, c) in enumerate(zip(live_losses, restored_losses, moved_losses),
                                  start=args.steps):
        print(f" {i:4d}  {a:12.8f}  {b:12.8f}  {c:12.8f}  "
              f"{'same bits' if a == b else 'DIFFERENT'}, |diff| {abs(a - c):.2e}")
    print(f" live + restored {2 * args.resume_steps} steps: {resume_time:.1f} s; other config "
          f"({describe(args, other)}): {moved_time:.1f} s (with its compilation)")
    ok &= check("resume bit-exact", live_losses == restored_losses
                and bitwise_equal(live, restored) and bitwise_equal(live_state, restored_state),
                "losses, parameters and AdamW state")
    ok &= check("restored step not recompiled", restored_compiles == 0,
                f"{restored_compiles} compilation(s) after the restore")
    moved_rel = max(abs(a - c) / abs(a) for a, c in zip(live_losses, moved_losses))
    ok &= check("restored into other config", moved_step == args.steps and moved_exact
                and moved_rel <= args.tol,
                f"{'no fsdp' if not other.fsdp_axes else 'fsdp'}: restore bit for bit, losses "
                f"relative diff {moved_rel:.2e} <= {args.tol:g}")
    print("all checks passed" if ok else "FAILED")
    return 0 if ok else 1


# -- LoRA ------------------------------------------------------------------------------------

LORA_TARGETS = ["blocks.*.self_attn.*", "blocks.*.cross_attn.*", "blocks.*.ffn.*"]


def make_lora_step(optimizer, forward):
    """One jitted AdamW step of the flow-matching loss that trains only the adapters:
    the model split by `nn.lora_filter`, the gradient taken in the adapters alone."""

    @eqx.filter_jit
    def step(model, opt_state, x_t, timestep, context, v):
        trainable, frozen = eqx.partition(model, nn.lora_filter(model))

        def loss_fn(trainable):
            pred = forward(eqx.combine(trainable, frozen), x_t, timestep, context)
            return jnp.mean((pred.astype(jnp.float32) - v) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(trainable)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return eqx.combine(eqx.apply_updates(trainable, updates), frozen), opt_state, loss

    return step


def lora_main(args, fsdp: bool) -> int:
    base = models.WanTransformer3D(CONFIG, key=jax.random.PRNGKey(args.seed))
    model = models.add_lora(base, LORA_TARGETS, args.lora, key=jax.random.PRNGKey(args.seed))
    data = dataset(args.seed)
    optimizer = optax.adamw(args.lr)
    trainable = eqx.filter(model, nn.lora_filter(model))
    opt_state = optimizer.init(trainable)
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree) if eqx.is_array(x))  # noqa: E731
    model_bytes = nbytes(eqx.filter(base, eqx.is_array))
    print(f"Wan: dim={CONFIG.dim}, layers={CONFIG.num_layers}, {model_bytes:,} bytes of weights; "
          f"LoRA rank {args.lora} on {LORA_TARGETS}: {nbytes(trainable):,} bytes of adapters, "
          f"AdamW state {nbytes(opt_state):,} bytes")
    compiled = Compilations("step")

    single_step = make_lora_step(optimizer, lambda m, x, t, c: jax.vmap(m)(x, t, c))
    single_model, _, single = train(single_step, model, opt_state, data, args.seed, args.steps)

    mesh, pconfig, place, sharded_step = sharded_training(args, fsdp, make_lora_step, optimizer)
    sharded = nn.sharding.shard_module(nn.sharding.with_parallel(model, pconfig), mesh)
    sharded_state = nn.sharding.shard_like(opt_state, sharded, mesh, filter_spec=nn.lora_filter(sharded))
    before = compiled.count
    sharded, _, losses = train(sharded_step, sharded, sharded_state, data, args.seed, args.steps,
                               place=place)
    sharded_compiles = compiled.count - before

    print(f"\n step  {'1 device':>12}  {'sharded':>12}  |diff|")
    for i, (a, b) in enumerate(zip(single, losses)):
        print(f" {i:4d}  {a:12.8f}  {b:12.8f}  {abs(a - b):.2e}")
    max_rel = max(abs(a - b) / abs(a) for a, b in zip(single, losses))
    x_t, timestep, v = flow_matching_batch(args.seed, 0, data[0])  # step 0's draws
    forward = eqx.filter_jit(lambda m: jax.vmap(m)(x_t, timestep, data[1]))
    first = [float(jnp.mean((forward(m) - v) ** 2)) for m in (model, single_model)]
    ok = check("loss decreased (1 device)", first[1] < first[0],
               f"step 0's batch: {first[0]:.6f} before, {first[1]:.6f} after")
    ok &= check("sharded == 1 device", max_rel <= args.tol,
                f"losses relative {max_rel:.2e} <= {args.tol:g} ({describe(args, pconfig)})")
    ok &= check("sharded step compiled once", sharded_compiles == 1,
                f"{sharded_compiles} compilation(s) in {args.steps} steps")
    ok &= check("base weights unchanged", bitwise_equal(nn.remove_lora(single_model), base),
                "every weight outside the adapters bit for bit")
    ok &= check("optimizer state adapter-sized", nbytes(opt_state) < model_bytes / 2,
                f"{nbytes(opt_state):,} bytes against {model_bytes:,} of weights")

    tmp = tempfile.mkdtemp(prefix="train_wan_lora_")
    path = os.path.join(args.checkpoint_dir or tmp, "lora")
    try:
        models.save_lora(single_model, path)
        loaded = models.load_lora(base, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ok &= check("LoRA file reads back", bitwise_equal(loaded, single_model),
                f"{path} (diffusers/PEFT layout), adapters bit for bit")
    merged = nn.merge_lora(loaded)
    a, b = forward(loaded), forward(merged)
    merge_rel = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
    ok &= check("merged == adapters", merge_rel <= args.tol,
                f"relative {merge_rel:.2e} <= {args.tol:g}")
    print("all checks passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
