#!/usr/bin/env bash
# What one device-tool call runs on the H200: environment, compiled-kernel checks, the test
# suite with compiled kernels, and the benchmark. Logs go to $OUT.
#   bash bench/device_run.sh [smoke] [test] [bench] [bench-quick]
set -uo pipefail
export PYTHONUNBUFFERED=1 CODETTA_CACHE_DIR=/tmp/codetta-cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
for step in "$@"; do
  case "$step" in
    smoke) python3 bench/device_smoke.py 2>&1 | tee "$OUT/smoke.log" ;;
    test) python3 -m pytest -q -x tests 2>&1 | tee "$OUT/test.log" | tail -30 ;;
    bench) python3 bench/gemm_bench.py 2>&1 | tee "$OUT/bench.log" ;;
    bench-quick) python3 bench/gemm_bench.py --quick 2>&1 | tee "$OUT/bench.log" ;;
  esac
done
cp -r bench/results "$OUT/" 2>/dev/null || true
