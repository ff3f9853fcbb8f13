#!/usr/bin/env bash
# The wheels the lent accelerator machine's image lacks, for an install without network:
#   bash scripts/accelerator_wheels.sh          # here, with network: fills .wheels/
#   pip install --no-index --no-deps .wheels/*.whl && pip install --no-deps -e .   # there
# That image has Python 3.12, JAX with its CUDA plugin, equinox, jaxtyping, numpy,
# flatbuffers and torch, not beartype; the library's other dependencies come with JAX.
# `.wheels/` is ignored by git and travels with the checkout (the device tool's `carry`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .wheels
python -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --dest .wheels "beartype>=0.19"
ls -1 .wheels
