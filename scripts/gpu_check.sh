#!/usr/bin/env bash
# Run on the GPU machine from the repo root (see ../shared/gpu/README.md): installs what is missing from .whl,
# runs the GPU tests and, with "bench", the decode benchmarks on synthetic models. Logs go to $OUT when set.
#   scripts/gpu_check.sh tests [PYTEST-ARGS...]   |   scripts/gpu_check.sh bench   |   scripts/gpu_check.sh all
set -uo pipefail
what=${1:-all}; shift || true
out=${OUT:-/tmp/infero-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 INFERO_CACHE_DIR=/tmp/infero-kernels
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --find-links .whl gguf fastapi uvicorn openai llguidance jsonschema 2>&1 | tail -2
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
[ -f /tmp/smollm2.gguf ] && export INFERO_SMOLLM2=/tmp/smollm2.gguf
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -rA -p no:cacheprovider tests/cuda "$@" 2>&1 | tee "$out/gpu-tests.log" | grep -vE "^(PASSED|SKIPPED)" | tail -120
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for spec in "qwen2.5-0.5b Q8_0" "llama-3.1-8b Q4_K_M"; do
    set -- $spec
    f=/tmp/synth-$1-$2.gguf
    [ -f "$f" ] || python3 -m infero synth "$1" --quant "$2" -o "$f"
    python3 -m infero bench decode --model "$f" --device cuda --profile 2>&1 | tee "$out/bench-$1-$2.txt"
  done
  [ -n "${INFERO_SMOLLM2:-}" ] && python3 -m infero bench decode --model "$INFERO_SMOLLM2" --device cuda 2>&1 | tee "$out/bench-smollm2.txt"
fi
