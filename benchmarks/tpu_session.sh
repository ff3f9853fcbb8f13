#!/usr/bin/env bash
# The measurements of a TPU session, in two parts that each fit one 10-minute command on
# the lent TPU v5e machine (see ../shared/tpu/README.md for the install line before it):
#
#   bash benchmarks/tpu_session.sh speed OUT    # attention vs splash, sparse, Wan step, VAE
#   bash benchmarks/tpu_session.sh checks OUT   # device tests, UMT5-XXL, accelerator_check
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
  speed)
    step tpu_attention 270 python3 "$here/tpu_attention.py" --out "$out"
    step tpu_sparse 150 python3 "$here/tpu_sparse.py" --quick --out "$out"
    step wan_step 100 python3 "$here/tpu_wan_step.py" --compile-cache /tmp/vidax-cc --out "$out"
    step wan_step_again 45 python3 "$here/tpu_wan_step.py" --compile-cache /tmp/vidax-cc --no-ablate --out "$out/again"
    step wan14b_block 50 python3 "$here/tpu_wan_step.py" --model 14b --layers 1 --no-ablate --out "$out"
    ;;
  checks)
    step device_tests 300 env VIDAX_TEST_DEVICE=1 python3 -m pytest -o addopts="" -q -ra -m device \
      tests/test_device_kernels.py tests/test_device_sparse.py tests/test_device_wan.py --durations=10
    step accelerator_check 170 python3 "$here/accelerator_check.py" --budget 90 --out "$out"
    ;;
  *)
    echo "unknown part: $part (speed or checks)" >&2
    exit 2
    ;;
esac
