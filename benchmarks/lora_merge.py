"""The cost of merging LoRA adapters into a Wan model (`nn.merge_lora`): its peak memory
against the model's size, and its time, in one process on one device.

1. **Wan 14B, abstractly.** The model (`WanConfig.preset("t2v-14b")`, bfloat16) and a
   rank `--rank` adapter on every linear layer of its 40 stacked blocks (attention
   q/k/v/o of both attentions, the two FFN layers) are built with
   `eqx.filter_eval_shape`: nothing is allocated. The merge is compiled for those
   shapes (`jax.jit(...).lower(...).compile()`) and XLA's `memory_analysis()` gives
   its argument, output, aliased and temporary bytes: the peak of the program is
   `argument + output - alias + temp`. Three variants: `merge_lora` with the model
   donated (`eqx.filter_jit(nn.merge_lora, donate="all")`: the new weights take the
   old ones' buffers), without donation, and a one-shot merge that computes each
   stack's float32 delta for all 40 layers at once (what `merge_lora`'s loop over the
   layers, updating the stack in place, avoids).
2. **A smaller model, concretely** (default Wan 1.3B, bfloat16, adapters on the same
   layers): the weights filled with random values, the donated merge timed (compile
   excluded; `--rounds` runs, the median) and its peak RSS above the RSS before it
   (`_harness.run_with_peak`; the model itself is already resident).

Only sizes and this machine's wall time are reported; the merge is a one-off.

    python benchmarks/lora_merge.py [--rank 64] [--small t2v-1.3b] [--rounds 3]
"""

import argparse
import statistics
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import _harness
from vidax_eqx import models, nn


TARGETS = ["blocks.*.self_attn.*", "blocks.*.cross_attn.[qkvo]", "blocks.*.ffn.*"]
GIB = 1 << 30


def _abstract(preset: str, rank: int):
    config = models.WanConfig.preset(preset)
    key = jax.random.key(0)
    return eqx.filter_eval_shape(
        lambda: models.add_lora(
            models.WanTransformer3D(config, dtype=jnp.bfloat16, key=key), TARGETS, rank,
            key=key))


def _bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _one_shot(tree):
    """Every stack's delta for all its layers at once (no loop over the layers)."""
    def one(layer):
        if not isinstance(layer, nn.LoRALinear):
            return layer
        a = layer.adapters["default"]
        w = (layer.weight.astype(jnp.float32) + a.delta()).astype(layer.weight.dtype)
        return nn.LoRALinear(eqx.tree_at(lambda b: b.weight, layer.base, w), layer.adapters,
                             ("default",))
    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nn.LoRALinear))


def _analysis(fn, abstract, donate: bool):
    arrays, static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))

    def run(arrays):
        return eqx.filter(fn(eqx.combine(arrays, static)), eqx.is_array)

    compiled = jax.jit(run, donate_argnums=(0,) if donate else ()).lower(arrays).compile()
    ma = compiled.memory_analysis()
    arg, out = int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes)
    alias, temp = int(ma.alias_size_in_bytes), int(ma.temp_size_in_bytes)
    return dict(argument=arg, output=out, alias=alias, temp=temp, peak=arg + out - alias + temp)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--large", default="t2v-14b")
    p.add_argument("--small", default="t2v-1.3b")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    print(f"# LoRA merge: rank {a.rank} on every block linear, bfloat16\n")
    print(f"{_harness.git_state()}; {_harness.cpu_model()}; {_harness.command_line(sys.argv[0])}"
          f"{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}\n")

    abstract = _abstract(a.large, a.rank)
    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    model_bytes = _bytes(eqx.filter(nn.remove_lora(abstract), is_abstract))
    adapter_bytes = _bytes(eqx.filter(abstract, nn.lora_filter(abstract)))
    print(f"## {a.large}, abstract: model {model_bytes / GIB:.2f} GiB, adapters "
          f"{adapter_bytes / GIB:.3f} GiB\n")
    print("| variant | argument GiB | output GiB | aliased GiB | temp GiB | peak GiB | peak / model |")
    print("|---|---|---|---|---|---|---|")
    for name, fn, donate in [("merge_lora, donated", nn.merge_lora, True),
                             ("merge_lora, not donated", nn.merge_lora, False),
                             ("one-shot stacked delta, donated", _one_shot, True)]:
        _harness.log(f"compiling {name}")
        m = _analysis(fn, abstract, donate)
        print(f"| {name} | {m['argument'] / GIB:.2f} | {m['output'] / GIB:.2f} | "
              f"{m['alias'] / GIB:.2f} | {m['temp'] / GIB:.3f} | {m['peak'] / GIB:.2f} | "
              f"{m['peak'] / model_bytes:.3f} |")

    _harness.log(f"building {a.small}")
    small = _abstract(a.small, a.rank)
    rng = np.random.default_rng(0)

    def fill(s):
        if not isinstance(s, jax.ShapeDtypeStruct):
            return s
        return jax.device_put(rng.standard_normal(s.shape, np.float32).astype(s.dtype) * 0.02)

    model = jax.tree.map(fill, small)
    small_bytes = _bytes(eqx.filter(nn.remove_lora(model), eqx.is_array))
    merge = eqx.filter_jit(nn.merge_lora, donate="all")
    times, peaks = [], []
    for i in range(a.rounds + 1):
        fresh = jax.tree.map(lambda x: x + 0 if eqx.is_array(x) else x, model)
        jax.block_until_ready(fresh)
        sample, merged, peak = _harness.run_with_peak(
            lambda: jax.block_until_ready(merge(fresh)))
        del fresh, merged
        if i:  # the first run compiles
            times.append(sample.wall)
            peaks.append(peak.above_baseline)
    print(f"\n## {a.small}, concrete: model {small_bytes / GIB:.2f} GiB\n")
    print("| merge (donated) | wall s, median | peak RSS above the model, GiB | / model |")
    print("|---|---|---|---|")
    print(f"| rank {a.rank} | {statistics.median(times):.2f} | "
          f"{statistics.median(peaks) / GIB:.3f} | {statistics.median(peaks) / small_bytes:.3f} |")


if __name__ == "__main__":
    main()
