#!/bin/bash
# One GPU session: integer-dot kernel checks + sweep + per-kernel breakdown + the bench grid, then
# float-kernel checks and CUDA-vs-CPU logits. Usage on the device machine (repo root; the gguf wheel
# carried in .whl/): bash bench/device_run.sh  (writes under $OUT)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
export PYTHONUNBUFFERED=1
OUT=${OUT:-.out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout 300 python3 bench/q8_tune.py --out "$OUT" --breakdown --bench-types bf16,Q8_0,Q4_0,Q4_K_M 2>&1 | tee "$OUT/q8_tune.md"
timeout 200 python3 bench/cuda_check.py --out "$OUT" --skip sweep 2>&1 | tee "$OUT/cuda_check.md"
