"""Which compiled `lax.scan` over stacked weights in host memory XLA accepts on the chip,
and how much of the copy it hides: L layers of `x @ W_l` with `W` (L, N, N) bf16 in pinned
host memory, against the same scan with `W` resident.

    python benchmarks/tpu/tpu_host_scan.py --out DIR
"""
import argparse, json, os, sys, time

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import SingleDeviceSharding


def closed_prefetch(w, x):  # the host array a scan constant; layer i+1 fetched in the carry
    n = w.shape[0]
    fetch = lambda i: jax.device_put(lax.dynamic_index_in_dim(w, i, keepdims=False), jax.memory.Space.Device)
    def body(c, i):
        x, cur = c
        nxt = fetch(jnp.minimum(i + 1, n - 1))
        return (jnp.tanh(x @ cur), nxt), None
    return lax.scan(body, (x, fetch(0)), jnp.arange(n))[0][0]


def scanned(w, x, unroll=1):  # the host array scanned (xs); each layer copied in its step
    def body(x, wl):
        return jnp.tanh(x @ jax.device_put(wl, jax.memory.Space.Device)), None
    return lax.scan(body, x, w, unroll=unroll)[0]


def scanned_prefetch(w, x):  # xs = the host array; the carry holds the layer fetched a step ahead
    n = w.shape[0]
    first = jax.device_put(w[0], jax.memory.Space.Device)
    def body(c, wl):  # wl: layer i + 1 (the last step's is a dummy: layer 0 again)
        x, cur = c
        nxt = jax.device_put(wl, jax.memory.Space.Device)
        return (jnp.tanh(x @ cur), nxt), None
    ahead = jnp.roll(jnp.arange(n), -1)
    return lax.scan(body, (x, first), lax.map(lambda i: i, ahead) if False else w)[0][0]


def resident(w, x):
    return lax.scan(lambda x, wl: (jnp.tanh(x @ wl), None), x, w)[0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--out", default=".")
    a = p.parse_args()
    dev = jax.devices()[0]
    host = SingleDeviceSharding(dev, memory_kind="pinned_host")
    on = SingleDeviceSharding(dev)
    shape = (a.layers, a.n, a.n)
    w_host = jax.jit(lambda k: (0.01 * jax.random.normal(k, shape)).astype(jnp.bfloat16), out_shardings=host)(jax.random.key(0))
    w_dev = jax.device_put(w_host, on)
    x = jnp.ones((a.rows, a.n), jnp.bfloat16)
    rows = []
    for name, fn, w in (("resident", resident, w_dev), ("closed_prefetch", closed_prefetch, w_host),
                        ("scanned", scanned, w_host), ("scanned_unroll2", lambda w, x: scanned(w, x, 2), w_host),
                        ("scanned_prefetch", scanned_prefetch, w_host)):
        try:
            f = jax.jit(fn).lower(w, x).compile()
            jax.block_until_ready(f(w, x))
            best = min((lambda s: (jax.block_until_ready(f(w, x)), time.perf_counter() - s)[1])(time.perf_counter()) for _ in range(3))
            rows.append(dict(name=name, seconds=best, copy_gb_s=w.nbytes / best / 1e9))
        except Exception as e:  # noqa: BLE001
            rows.append(dict(name=name, error=repr(e)[:300]))
        print(json.dumps(rows[-1]), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tpu_host_scan.json"), "w") as f:
        json.dump(dict(jax=jax.__version__, device=dev.device_kind, args=vars(a), rows=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
