"""Processes: the multi-process jobs' shape, ports, the workers' environment, and global
arrays that each process provides its own shards of."""

import os
import socket

import jax
import numpy as np
from jax.sharding import NamedSharding


NUM_PROCESSES = 2  # the multi-process jobs: two processes ...
LOCAL_DEVICES = 4  # ... of four CPU devices each


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(local_devices: int = LOCAL_DEVICES) -> dict:
    """This process's environment for a worker process: `local_devices` simulated CPU
    devices, CPU only, JAX's default float32."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={local_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_ENABLE_X64", None)
    return env


def global_array(mesh, spec, x):
    """The global array `x` placed by `spec`, each process providing only its own
    devices' shards."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])
