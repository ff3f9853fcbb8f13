"""Bit-for-bit reproducibility: the same inputs give the same bits, forward and gradients.

For single-device attention (`"xla"` and `"blockwise"`, float32 and bfloat16),
ring attention and Ulysses on 4 simulated devices, USP on 2 x 2, and an
`nn.Attention` module forward + gradient:

- calling the same function twice gives identical bytes, under `jax.jit` and
  (single-device kernels and the module) eagerly, op by op with no outer `jit`;
- two fresh Python processes computing the same jitted things (`PROCESS_RUNS`)
  from the same seeded inputs get identical bytes, equal to this process's (a fresh
  process means a fresh trace and a fresh XLA compilation). The processes run
  this file as a script: `python tests/test_determinism.py` prints one SHA-256
  digest per case.

Bitwise equality *between* implementations is not a property (they sum in a
different order); `docs/transformations.md` ("Determinism and property tests") gives the measured
differences.
"""

import hashlib
import json
import os
import subprocess
import sys


if __name__ == "__main__":  # a worker process: 8 simulated devices, as in conftest.py
    _flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
              if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join([*_flags, "--xla_force_host_platform_device_count=8"])
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import harness  # noqa: E402
from vidax_eqx import kernels, nn, parallel  # noqa: E402


CASES = ["xla-float32", "xla-bfloat16", "blockwise-float32", "blockwise-bfloat16", "ring", "ulysses",
         "usp", "module"]
SHARDED = ("ring", "ulysses", "usp")
# Eager `shard_map` dispatches every primitive of the ring / all_to_all program over
# the mesh one by one (about a minute per call on 2 cores), so the sharded cases run
# under `jit` only; eager runs cover one dtype of each kernel and the module.
EAGER = ("xla-float32", "blockwise-float32", "module")
RUNS = [(name, "jit") for name in CASES] + [(name, "eager") for name in EAGER]
# The fresh processes repeat these jitted runs, each compiling from scratch.
PROCESS_RUNS = [(name, "jit") for name in ("xla-float32", "blockwise-float32", "ring", "ulysses",
                                           "module")]
TIMEOUT_S = 240
# Compiled as XLA does by default (conftest's `_fast_compile` turns LLVM's optimizations
# off elsewhere), as the fresh processes compile: code generated without them gives other
# bits, so this process and the fresh ones must compile alike.
XLA_OPTIMIZED = True


def _jax(*arrays):
    return tuple(jnp.asarray(x) for x in arrays)


def _kernel_case(impl, dtype):
    """GQA, causal, segment ids with padding, sinks, bias: `(out, lse, grads)`."""
    B, S, H, H_kv, D = 2, 45, 4, 2, 16
    rng = np.random.default_rng(0)
    a = harness.attention_inputs(B, S, H, D, H_kv=H_kv, dtype=dtype, rng=rng, dlse=True,
                                 sinks=True, segments=True)
    bias = harness.normal(rng, (1, H, S, S))

    def fn(q, k, v, bias, sinks, seg, dout, dlse):
        def fwd(q, k, v, bias, sinks):
            return kernels.attention_fwd(q, k, v, bias=bias, sinks=sinks, segment_ids=seg,
                                         causal=True, implementation=impl)

        (out, lse), vjp = jax.vjp(fwd, q, k, v, bias, sinks)
        return out, lse, vjp((dout, dlse))

    return fn, _jax(a["q"], a["k"], a["v"], bias, a["sinks"], a["seg"], a["dout"], a["dlse"])


def _sharded_case(kind):
    """Ring (zigzag, sp=4), Ulysses (sp=4) or USP (2 x 2) with the "xla" kernel:
    causal, segment ids, sinks, GQA; `(out, grads)` of the sharded global arrays."""
    B, S, H, H_kv, D = 2, 32, 4, 2, 16
    a = harness.attention_inputs(B, S, H, D, H_kv=H_kv, seed=1, sinks=True, segments=True)
    if kind == "usp":
        mesh = harness.mesh(sp=2, ring=2)
        spec = P(None, ("ring", parallel.SP_AXIS))
    else:
        mesh = harness.mesh(sp=4)
        spec = P(None, parallel.SP_AXIS)

    def local(q, k, v, sinks, seg):
        opts = dict(causal=True, sinks=sinks, segment_ids=seg, implementation="xla")
        if kind == "ring":
            return parallel.ring_attention(q, k, v, ring_axis=parallel.SP_AXIS, layout="zigzag", **opts)
        if kind == "usp":
            return parallel.usp_attention(q, k, v, ulysses_axis=parallel.SP_AXIS, ring_axis="ring",
                                          **opts)
        return parallel.sequence_parallel_self_attention(q, k, v, parallel.SP_AXIS, **opts)

    fn = harness.sharded_vjp(local, mesh, (spec, spec, spec, P(), spec), spec, (0, 1, 2, 3),
                             jit=False)
    return fn, _jax(a["q"], a["k"], a["v"], a["sinks"], a["seg"], a["dout"])


def _module_case():
    """`nn.Attention` (qk RMSNorm, RoPE-free): output, and the gradients of a random
    projection of it with respect to every parameter and the input."""
    S, dim, H = 24, 32, 4
    k_mod, = harness.keys(2, 1)
    params, static = eqx.partition(nn.Attention(dim, H, key=k_mod), eqx.is_array)
    rng = np.random.default_rng(2)
    x, cot = _jax(harness.normal(rng, (S, dim)), harness.normal(rng, (S, dim)))

    def fn(params, x, cot):
        def loss(params, x):
            return jnp.sum(eqx.combine(params, static)(x) * cot)

        return eqx.combine(params, static)(x), jax.grad(loss, argnums=(0, 1))(params, x)

    return fn, (params, x, cot)


def _case(name):
    if name == "module":
        return _module_case()
    if name in ("ring", "ulysses", "usp"):
        return _sharded_case(name)
    impl, dtype = name.split("-")
    impl = "xla" if impl == "xla" else kernels.Blockwise(block_q=16, block_kv=16)
    return _kernel_case(impl, jnp.dtype(dtype))


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _digest(leaves) -> str:
    h = hashlib.sha256()
    for x in leaves:
        h.update(f"{x.dtype.str}{x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


_FIRST: dict[tuple[str, str], list[np.ndarray]] = {}


def _compute(name, mode, fns={}):  # noqa: B006 (the cache of jitted functions)
    if name not in fns:
        fn, args = _case(name)
        fns[name] = (fn, jax.jit(fn), args)
    fn, jitted, args = fns[name]
    leaves = _leaves((jitted if mode == "jit" else fn)(*args))
    _FIRST.setdefault((name, mode), leaves)
    return leaves


@pytest.mark.parametrize("name, mode", RUNS, ids=[f"{n}-{m}" for n, m in RUNS])
def test_repeated_calls_are_bitwise_equal(name, mode):
    first = _compute(name, mode)
    second = _compute(name, mode)
    assert len(first) == len(second) > 1
    for i, (a, b) in enumerate(zip(first, second)):
        assert not np.isnan(np.asarray(a, np.float32)).any(), f"{name} ({mode}): leaf {i} has NaN"
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes(), f"{name} ({mode}): leaf {i} differs between two calls"
    assert any(np.any(np.asarray(a, np.float32) != 0) for a in first)


@pytest.mark.slow  # two fresh processes compile every case: ~25 s
def test_across_processes():
    """Two fresh processes (spawned concurrently) and this one: identical digests of
    every jitted case."""
    procs = [
        subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=harness.child_env(8))
        for _ in range(2)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT_S)
            assert p.returncode == 0, f"worker exited with {p.returncode}:\n{err[-4000:]}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    here = {f"{name}/{mode}": _digest(_FIRST.get((name, mode)) or _compute(name, mode))
            for name, mode in PROCESS_RUNS}
    assert set(results[0]) == set(here)
    for key in sorted(here):
        assert results[0][key] == results[1][key], f"{key}: the two fresh processes differ"
        assert results[0][key] == here[key], f"{key}: a fresh process differs from this one"


def _main() -> int:
    digests = {f"{name}/{mode}": _digest(_compute(name, mode)) for name, mode in PROCESS_RUNS}
    print(json.dumps(digests, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
