#!/usr/bin/env bash
# The measurements of a TPU session, in two parts that each fit one 10-minute command on
# the lent TPU v5e machine (see ../shared/tpu/README.md for the install line before it):
#
#   bash benchmarks/tpu/tpu_session.sh speed OUT    # attention vs splash, a Wan step, VSA
#   bash benchmarks/tpu/tpu_session.sh sparse OUT   # sliding tile attention's rows
#   bash benchmarks/tpu/tpu_session.sh checks OUT   # device tests, cold start, 14B block, UMT5-XXL, VAE
#
# (benchmarks/accelerator_check.py, the all-platform command, runs on its own; the scripts of
# benchmarks/ that also run on a CPU are called from there.)
#
# Each step has its own time limit, so one that hangs leaves the others their time; every
# step's log and report lands in OUT.
set -uo pipefail
part="${1:?speed, sparse or checks}"
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
  speed)  # ~10 minutes: the dense table (tuned splash rows only), a Wan step, VSA's rows
    step tpu_attention 250 python3 "$here/tpu_attention.py" --quick --budget 215 --out "$out"
    step wan_step 110 python3 "$here/tpu_wan_step.py" --compile-cache /tmp/vidax-cc --out "$out"
    step tpu_sparse 230 python3 "$here/tpu_sparse.py" --quick --section VSA --budget 190 --out "$out"
    ;;
  sparse)  # ~10 minutes: sliding tile attention's rows
    step tpu_sparse_sta 560 python3 "$here/tpu_sparse.py" --section STA --budget 500 --out "$out/sta"
    ;;
  checks)  # ~10 minutes: the device tests, cold start, the 14B block, the VAE, UMT5-XXL
    # Each failure is written to device_failures.txt as it happens, every comparison's error
    # to device_errors.tsv (tests/conftest.py); about 2.5 minutes on a v5e.
    step device_tests 240 env VIDAX_TEST_DEVICE=1 VIDAX_TEST_DEVICE_LOG="$out/device_failures.txt" \
      VIDAX_TEST_DEVICE_ERRORS="$out/device_errors.tsv" python3 -m pytest -o addopts="" -q -ra -m device \
      tests/test_device_kernels.py tests/test_device_sparse.py tests/test_device_wan.py --durations=10
    step wan_step_again 100 python3 "$here/tpu_wan_step.py" --compile-cache /tmp/vidax-cc --no-ablate --out "$out/again"
    step wan14b_block 60 python3 "$here/tpu_wan_step.py" --model 14b --layers 1 --no-ablate --out "$out"
    step text_encoder 50 python3 "$here/../text_encoder_device.py"
    step vae_compile 60 python3 "$here/../vae_compile.py" --chunks 1 --rounds 1
    ;;
  *)
    echo "unknown part: $part (speed, sparse or checks)" >&2
    exit 2
    ;;
esac
