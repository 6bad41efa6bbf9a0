#!/bin/bash
# One GPU session: kernel checks + config sweep, the bench grid, then CUDA-vs-CPU logits.
# Usage on the device machine (repo root): bash bench/device_run.sh  (writes under $OUT)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
export PYTHONUNBUFFERED=1
OUT=${OUT:-.out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout ${CHECK_S:-220} python3 bench/cuda_check.py --out "$OUT" --skip logits 2>&1 | tee "$OUT/cuda_check.md"
export LOCALLLM_GEMV_CONFIGS="$OUT/gemv_configs.json"
[ -f "$LOCALLLM_GEMV_CONFIGS" ] || unset LOCALLLM_GEMV_CONFIGS
timeout ${BENCH_S:-260} python3 cli.py bench --synthetic ${SHAPES:-llama-3.1-8b,llama-3.2-1b} --type ${TYPES:-bf16,Q8_0,Q4_0,Q4_K_M} \
  -p 512 -n 128 -r 3 2>&1 | tee "$OUT/bench.md"
timeout ${LOGITS_S:-100} python3 bench/cuda_check.py --out "$OUT" --skip kernels,attention,sweep 2>&1 | tee "$OUT/logits.md"
