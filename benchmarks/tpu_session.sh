#!/usr/bin/env bash
# The measurements of a TPU session, in two parts that each fit one 10-minute command on
# the lent TPU v5e machine (see ../shared/tpu/README.md for the install line before it):
#
#   bash benchmarks/tpu_session.sh speed OUT    # attention vs splash, a Wan step, sparse, device tests
#   bash benchmarks/tpu_session.sh checks OUT   # cold start, 14B block, VAE, UMT5-XXL, accelerator_check
#
# Each step has its own time limit, so one that hangs leaves the others their time; every
# step's log and report lands in OUT.
set -uo pipefail
part="${1:?speed or checks}"
out="${2:?output folder}"
mkdir -p "$out"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
step() {  # step NAME SECONDS COMMAND...
  local name="$1" limit="$2"
  shift 2
  echo "== $name (limit ${limit} s)"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | grep -v -E "UserWarning: Transparent hugepages|warnings.warn" | tail -60
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}
case "$part" in
  speed)  # ~10 minutes: the dense table, a Wan step, the sparse rows, the device tests
    step tpu_attention 200 python3 "$here/tpu_attention.py" --out "$out"
    step wan_step 95 python3 "$here/tpu_wan_step.py" --compile-cache /tmp/vidax-cc --out "$out"
    step tpu_sparse 140 python3 "$here/tpu_sparse.py" --quick --budget 105 --out "$out"
    step device_tests 150 env VIDAX_TEST_DEVICE=1 python3 -m pytest -o addopts="" -q -ra -m device \
      tests/test_device_kernels.py tests/test_device_sparse.py tests/test_device_wan.py --durations=10
    ;;
  checks)  # ~6 minutes: cold start, the 14B block, the VAE, UMT5-XXL, accelerator_check
    step wan_step_again 40 python3 "$here/tpu_wan_step.py" --compile-cache /tmp/vidax-cc --no-ablate --out "$out/again"
    step wan14b_block 45 python3 "$here/tpu_wan_step.py" --model 14b --layers 1 --no-ablate --out "$out"
    step vae_compile 100 python3 "$here/vae_compile.py" --rounds 1
    step text_encoder 100 python3 "$here/text_encoder_device.py"
    step accelerator_check 110 python3 "$here/accelerator_check.py" --budget 45 --out "$out"
    ;;
  *)
    echo "unknown part: $part (speed or checks)" >&2
    exit 2
    ;;
esac
