"""The test suite's shared harness: inputs, meshes, runs and comparisons.

What the test files would otherwise each write for themselves (STYLE.md rule 14), one
concern per module; this file only re-exports, so every test reads `harness.X`:

- **Inputs** (`_inputs.py`). Seeded random NumPy arrays, never zeros: `normal`,
  `rounded` (a JAX array and the same rounded values in float64), `segment_ids`
  (different per batch element, with padding), `joint_segment_ids` (over a text prefix
  and the visual tokens), `attention_inputs` (q, k, v with GQA, the cotangent,
  optionally dlse, sinks and segment ids, in any dtype), `keys` (PRNG keys).
- **Meshes** (`_meshes.py`). `mesh(dp=, sp=, tp=, **extra_axes)`, `parallel.make_mesh`
  built once per shape; `zigzag` / `unzigzag` between the global order and a ring's
  zigzag layout.
- **Runs** (`_runs.py`). `vjp`: the VJP of a function with a given cotangent under one
  `jax.jit`; `sharded_vjp`: the same of a function under `jax.shard_map`;
  `FAST_COMPILE`, the compiler options of the small programs that compile often.
- **The sequence layout** (`_sequence.py`). `sequence_vjp` / `run_sequence`: attention
  with the sequence (axis 1) sharded, from global arrays to global results.
- **The joint layout** (`_joint.py`). `joint_vjp` / `run_joint`: a text prefix
  replicated and put before every device's visual chunk; `text_shares` splits the text
  cotangent over the devices' copies.
- **The text on either side** (`_text_joint.py`). `text_joint_vjp` / `run_text_joint`
  (the text before or after the visual tokens, with key lengths), `split_text`,
  `key_only_ids` (key-only padding as the oracle's separate key ids).
- **Comparisons** (`_compare.py`). `assert_matches` (each result against the float64
  oracle's, within the dtype's tolerance: `oracle.TOLERANCES` is the suite's one
  tolerance table), `assert_trees_close` (two trees, e.g. sharded against one device),
  `assert_copies_equal` (the copies of the text rows, bitwise), `check_sharded` (the
  sharded check in one call: shard_map, VJP with a random cotangent, against the oracle
  and/or one device), `check_grads_fd` (gradients against central differences of a
  float64 reference), `named` (a VJP's `(out, grads)` as a dict of names), `shape_re`
  (a shape in an error message).
- **Modules** (`_modules.py`). `arrays`, `with_arrays`, `map_arrays`, `to64`,
  `leaf_names`, `perturbed`, `resampled`: an Equinox module's arrays read, replaced and
  randomized.
- **Whole models** (`_models.py`). `load_io`, `max_rel_error`, `loss_and_grad`,
  `same_arrays`, `leaf_errors` / `assert_leaves_close` (every parameter's gradient, say,
  against its own scale).
- **Weight files** (`_weights.py`). `safetensors_file`, `safetensors_entry`: files built
  byte by byte.
- **The device mode** (`_device.py`). `device_mode`, `device_skip_reason`, `on_chip`,
  `chip_sizes`: whether the `device` tests run, on the TPU or in Pallas interpret mode, and
  at which sizes (`VIDAX_TEST_DEVICE`); `pallas_tpu`, `registered_pallas_tpu`, `accelerator`, `cpu`:
  the kernels and devices they run on.
- **Sampling** (`_sampling.py`). `sample_reused`: `sampling.sample` and the steps that
  reused the step cache, as its progress callback saw them; `skyreels_df_folder`: the tiny
  SkyReels-V2 diffusion forcing pipeline folder assembled from the fixtures.
- **Processes** (`_processes.py`). `NUM_PROCESSES`, `LOCAL_DEVICES`, `free_port`,
  `child_env`, `global_array` for the multi-process tests and their workers.

Nothing of `vidax_eqx` is imported at import time (the multi-process workers import this
package before `jax.distributed.initialize`): the functions that need it import it. The
float64 references are `tests/oracle.py`, which imports nothing of this package.
"""

from ._compare import (
    ATTENTION_NAMES as ATTENTION_NAMES,
    assert_copies_equal as assert_copies_equal,
    assert_matches as assert_matches,
    assert_trees_close as assert_trees_close,
    check_grads_fd as check_grads_fd,
    check_sharded as check_sharded,
    named as named,
    shape_re as shape_re,
)
from ._device import (
    accelerator as accelerator,
    chip_sizes as chip_sizes,
    cpu as cpu,
    device_mode as device_mode,
    device_skip_reason as device_skip_reason,
    on_chip as on_chip,
    pallas_tpu as pallas_tpu,
    registered_pallas_tpu as registered_pallas_tpu,
)
from ._inputs import (
    attention_inputs as attention_inputs,
    joint_segment_ids as joint_segment_ids,
    keys as keys,
    normal as normal,
    rounded as rounded,
    segment_ids as segment_ids,
)
from ._joint import joint_vjp as joint_vjp, run_joint as run_joint, text_shares as text_shares
from ._meshes import mesh as mesh, unzigzag as unzigzag, zigzag as zigzag
from ._models import (
    assert_leaves_close as assert_leaves_close,
    leaf_errors as leaf_errors,
    load_io as load_io,
    loss_and_grad as loss_and_grad,
    max_rel_error as max_rel_error,
    same_arrays as same_arrays,
)
from ._modules import (
    arrays as arrays,
    leaf_names as leaf_names,
    map_arrays as map_arrays,
    perturbed as perturbed,
    resampled as resampled,
    to64 as to64,
    with_arrays as with_arrays,
)
from ._processes import (
    LOCAL_DEVICES as LOCAL_DEVICES,
    NUM_PROCESSES as NUM_PROCESSES,
    child_env as child_env,
    free_port as free_port,
    global_array as global_array,
)
from ._runs import FAST_COMPILE as FAST_COMPILE, sharded_vjp as sharded_vjp, vjp as vjp
from ._sequence import run_sequence as run_sequence, sequence_vjp as sequence_vjp
from ._text_joint import (
    key_only_ids as key_only_ids,
    run_text_joint as run_text_joint,
    split_text as split_text,
    text_joint_vjp as text_joint_vjp,
)
from ._weights import safetensors_entry as safetensors_entry, safetensors_file as safetensors_file
from ._sampling import sample_reused as sample_reused, skyreels_df_folder as skyreels_df_folder
