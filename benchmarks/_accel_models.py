"""The model part of `accelerator_check.py`: a Wan 2.1 1.3B block and a 14B block, forward
and backward at 480p token counts in bf16, with and without rematerialization (step time,
the device's measured peak memory against the compiled program's `memory_analysis`); and
the sequence-parallel paths on this device alone (a ring of one, Ulysses over one)
against the single-device kernel."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from _accel_common import (
    abstract, accuracy_status, BF16, custom_calls, error, F32, log, lowered, rel_error, Run, seconds,
)
from vidax_eqx import kernels, models, nn, parallel


TEXT = 512  # Wan's text length


def _configs(run: Run) -> dict[str, models.WanConfig]:
    if run.smoke:
        return {"smoke": models.WanConfig(dim=64, ffn_dim=128, num_heads=4, num_layers=1,
                                          text_dim=32)}
    return {"wan2.1-1.3b": models.WanConfig.preset("t2v-1.3b", num_layers=1),
            "wan2.1-14b": models.WanConfig.preset("t2v-14b", num_layers=1)}


def _grid(run: Run) -> tuple[int, int, int]:
    """The patch grid: 480p x 81 frames (latents 21 x 60 x 104, patch 1 x 2 x 2)."""
    return (2, 4, 6) if run.smoke else (21, 30, 52)


def _is_param(x) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


def _block_step(block, remat: str | None):
    """`(params, x, e0, context, rope, dout) -> grads of (params, x)` of one block."""
    params, static = eqx.partition(block, _is_param)

    def apply(params, x, e0, context, rope):
        b = eqx.combine(params, static)
        return b(x, models.WanBlockInputs(models.AttentionInputs(rope, None), e0, context))

    if remat == "full":
        apply = jax.checkpoint(apply)

    def loss(params, x, e0, context, rope, dout):
        return jnp.sum(apply(params, x, e0, context, rope) * dout)

    return params, jax.grad(loss, (0, 1))


def _inputs(config: models.WanConfig, grid, key):
    S = math.prod(grid)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    x = jax.random.normal(k1, (S, config.dim), F32)
    e0 = 0.1 * jax.random.normal(k2, (6, config.dim), F32)
    context = jax.random.normal(k3, (TEXT, config.dim), F32).astype(BF16)
    rope = nn.functional.rope_3d(grid, config.head_dim, config.rope_theta)
    dout = jax.random.normal(k4, (S, config.dim), F32)
    return x, e0, context, rope, dout


def _compiled_bytes(compiled) -> int | None:
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
               - m.alias_size_in_bytes)


def _peak() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def wan_block_rows(run: Run) -> list[dict]:
    """One row per (model, remat): the fwd+bwd step of one block at 480p."""
    grid = _grid(run)
    rows = []
    # Ascending expected peaks, so that each row's measured peak is its own.
    for name, config in _configs(run).items():
        for remat in ("full", None):
            if run.spent():
                return rows
            row = dict(part="wan_block", what=name, remat=remat or "none", S=math.prod(grid),
                       dim=config.dim)
            try:
                if run.lower_only:
                    block = eqx.filter_eval_shape(models.WanBlock, config,
                                                  parallel=nn.sharding.ParallelConfig(),
                                                  implementation="auto", dtype=BF16,
                                                  key=jax.random.key(0))
                    params, step = _block_step(block, remat)
                    args = (params,) + abstract(_inputs(config, grid, jax.random.key(1)))
                    row["kernels"] = custom_calls(lowered(step, args, run.platform))
                else:
                    block = models.WanBlock(config, parallel=nn.sharding.ParallelConfig(),
                                            implementation="auto", dtype=BF16,
                                            key=jax.random.key(0))
                    params, step = _block_step(block, remat)
                    args = (params,) + _inputs(config, grid, jax.random.key(1))
                    compiled = jax.jit(step).lower(*args).compile()
                    row["compiled_bytes"] = _compiled_bytes(compiled)
                    before = _peak()
                    grads = jax.block_until_ready(compiled(*args))
                    after = _peak()
                    row["finite"] = all(bool(jnp.isfinite(g.astype(F32)).all())
                                        for g in jax.tree.leaves(grads))
                    if after is not None:
                        row["peak_bytes"] = after
                        row["new_peak"] = before is None or after > before
                        if row["compiled_bytes"]:
                            row["peak_vs_compiled"] = after / row["compiled_bytes"]
                    row["step_s"] = seconds(compiled, *args, reps=run.reps)
                    del grads
            except Exception as e:
                row["error"] = error(e)
            rows.append(row)
            log(row)
    return rows


def one_device_parallel_rows(run: Run) -> list[dict]:
    """Ulysses, the ring and both (USP over two one-device axes) on this device alone,
    forward and gradients, against the single-device float32 `"xla"` kernel."""
    S, H, D = (128, 4, 64) if run.smoke else (8192, 8, 128)
    keys = jax.random.split(jax.random.key(3), 4)
    if run.lower_only:
        q = k = v = dout = jax.ShapeDtypeStruct((1, S, H, D), BF16)
    else:
        q, k, v, dout = (jax.random.normal(key, (1, S, H, D), F32).astype(BF16) for key in keys)
    device = jax.devices()[:1]
    rows = []
    roles = {"ulysses": dict(ulysses_axis="sp"), "ring": dict(ring_axis="ring"),
             "usp": dict(ulysses_axis="sp", ring_axis="ring")}
    for name, axes in roles.items():
        if run.spent():
            break
        for causal in (False, True):
            row = dict(part="parallel", what=name, shape=f"S={S} H={H} D={D}",
                       feature="causal" if causal else "full")
            try:
                mesh = jax.sharding.Mesh(np.array(device).reshape(1, 1), ("ring", "sp"))
                spec = P(None, ("ring", "sp"))

                def attend(q, k, v, axes=axes, causal=causal):
                    return parallel.sequence_attention(q, k, v, causal=causal, **axes)

                sharded = jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
                loss = lambda q, k, v, d: jnp.sum(sharded(q, k, v).astype(F32) * d.astype(F32))  # noqa: E731
                if run.lower_only:
                    row["kernels"] = custom_calls(lowered(jax.grad(loss, (0, 1, 2)), (q, k, v, dout),
                                                          run.platform))
                else:
                    def ref_loss(q, k, v, d, causal=causal):
                        out = kernels.attention(q, k, v, causal=causal, implementation="xla")
                        return jnp.sum(out * d)

                    f32 = [a.astype(F32) for a in (q, k, v, dout)]
                    ref_out = jax.jit(lambda q, k, v, causal=causal: kernels.attention(
                        q, k, v, causal=causal, implementation="xla"))(*f32[:3])
                    ref_grads = jax.jit(jax.grad(ref_loss, (0, 1, 2)))(*f32)
                    row["out_err"] = rel_error(jax.jit(sharded)(q, k, v), ref_out)
                    grads = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v, dout)
                    row["grad_err"] = max(rel_error(g, r) for g, r in zip(grads, ref_grads))
            except Exception as e:
                row["error"] = error(e)
            rows.append(row)
            log(row)
    return rows


def checks(run: Run, block_rows: list[dict], parallel_rows: list[dict]) -> None:
    """The model part's PASS / FAIL / SKIP lines."""
    if not block_rows:
        run.check("Wan blocks forward+backward", "SKIP", run.not_run())
    else:
        bad = [r for r in block_rows if "error" in r or r.get("finite") is False]
        detail = "; ".join(
            f"{r['what']} remat={r['remat']}: " + (r.get("error") or "non-finite gradients")
            for r in bad) or "; ".join(
            f"{r['what']} remat={r['remat']}" + (
                f" {r['step_s'] * 1e3:.0f} ms" + (
                    f", peak {r['peak_bytes'] / 2**30:.1f} GiB" if "peak_bytes" in r else "")
                + (f" (compiled {r['compiled_bytes'] / 2**30:.1f} GiB)" if r.get("compiled_bytes")
                   else "")
                if "step_s" in r else " lowered") for r in block_rows)
        run.check("Wan blocks forward+backward", "FAIL" if bad else "PASS", detail)
        measured = [r for r in block_rows if r.get("new_peak") and r.get("peak_vs_compiled")]
        if measured:
            worst = max(r["peak_vs_compiled"] for r in measured)
            run.check("Wan block peak memory within 1.25x of the compiled figure",
                      "PASS" if worst <= 1.25 else "FAIL", f"worst measured / compiled {worst:.2f}")
        else:
            run.check("Wan block peak memory within 1.25x of the compiled figure", "SKIP",
                      "no device memory statistics here" if not run.lower_only
                      else "lowered only")
    run.check("FSDP memory table (8-device rows)", "SKIP",
              "one device cannot run an 8-device FSDP step's collectives; the compiled "
              "figures of benchmarks/fsdp.py use the same memory_analysis this check "
              "compares with the measured peak")
    if not parallel_rows:
        run.check("Ulysses / ring / USP on one device", "SKIP", run.not_run())
    elif run.lower_only:
        bad = [r for r in parallel_rows if "error" in r]
        run.check("Ulysses / ring / USP on one device", "FAIL" if bad else "PASS",
                  "; ".join(f"{r['what']}: {r['error']}" for r in bad) or "lowered")
    else:
        status, detail = accuracy_status(parallel_rows)
        run.check("Ulysses / ring / USP on one device", status, detail)
