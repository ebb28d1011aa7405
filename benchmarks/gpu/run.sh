#!/usr/bin/env bash
# The GPU check on a GPU machine with no network: install the carried wheels (the transformers release flashdraft
# pins, the reference implementation, platformdirs) into a private folder ahead of the machine's own packages, then
# run every stage. Usage: bash benchmarks/gpu/run.sh OUT_DIR   (see benchmarks/gpu/README.md)
set -euo pipefail
out="${1:?usage: bash benchmarks/gpu/run.sh OUT_DIR}"
cd "$(dirname "$0")/../.."
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/flashdraft-site .whl/*.whl
export PYTHONPATH=/tmp/flashdraft-site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 benchmarks/gpu/check.py --out "$out" "${@:2}" 2>&1 | tee "$out/gpu-check.log"
