#!/usr/bin/env bash
# What one device-tool call runs on the H200: environment, compiled-kernel checks, the test
# suite with compiled kernels, and the benchmarks. Logs go to $OUT. Wheels carried in .whl/
# (Liger-Kernel; pytest-xdist and execnet for WORKERS=n parallel test processes) are installed
# first when present. The device copy's .git may be older than
# its files: pass CODETTA_CODE_COMMIT=<the sending machine's HEAD> so results name the code.
# ab, kparts-ab: bench/version_ab.py, bench/kparts_ab.py against OLD_TREE (default old/, gitignored: `mkdir old && git archive <commit> codetta bench | tar -x -C old`, carried to the device).
#   M=16384,4096 OPS=a,b,c,d,e TESTS=tests WORKERS=8 VARIANTS=hf_liger,hf_codetta LORA=q_proj,v_proj bash bench/device_run.sh [smoke] [test] [host] [op-profile] [gemm] [gemm-quick] [gemm-1b] [breakdown] [sweep] [ops] [ops-compile] [ops-paper] [block] [train] [profile] [host-profile] [demo] [rope] [ab] [kparts-ab] [check]
set -uo pipefail
export PYTHONUNBUFFERED=1 CODETTA_CACHE_DIR=/tmp/codetta-cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export CODETTA_TUNE_LOG="$OUT/tune_log.jsonl"  # each tuning: its finalists' times
touch /tmp/device_run.start
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
for step in "$@"; do
  case "$step" in
    smoke) python3 bench/device_smoke.py 2>&1 | tee "$OUT/smoke.log" ;;
    test) CODETTA_AUTOTUNE=0 timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q ${WORKERS:+-n "$WORKERS"} ${TESTS:-tests} \
        2>&1 | tee "$OUT/test.log" | tail -40 ;;
    host) python3 bench/host_overhead.py 2>&1 | tee "$OUT/host.log" ;;
    op-profile) python3 bench/op_profile.py --m "${M:-4096}" --ops "${OPS:-a,b}" 2>&1 | tee "$OUT/op_profile.log" | head -60 ;;
    gemm) python3 bench/gemm_bench.py 2>&1 | tee "$OUT/gemm.log" ;;
    gemm-quick) python3 bench/gemm_bench.py --shapes quick 2>&1 | tee "$OUT/gemm.log" ;;
    gemm-1b) python3 bench/gemm_bench.py --shapes llama1b 2>&1 | tee "$OUT/gemm.log" ;;
    breakdown) python3 bench/ops_breakdown.py 2>&1 | tee "$OUT/breakdown.log" ;;
    sweep) python3 bench/config_sweep.py --pieces "${PIECES:-epilogue GEMM}" 2>&1 | tee "$OUT/sweep.log" | tail -80 ;;
    ops) python3 bench/ops_bench.py --no-compile --m "${M:-16384}" --ops "${OPS:-a,b,c,d,e}" 2>&1 | tee "$OUT/ops.log" ;;
    ops-compile) python3 bench/ops_bench.py --m "${M:-16384}" --ops "${OPS:-a,b,c,d,e}" 2>&1 | tee "$OUT/ops.log" ;;
    ops-paper) python3 bench/ops_bench.py --no-compile --m "${M:-16384}" --ops "${OPS:-a,b,c,d,e}" \
        --shapes paper-d2048,paper-d4096,paper-d8192 2>&1 | tee "$OUT/ops_paper.log" ;;
    block) python3 bench/block_bench.py 2>&1 | tee "$OUT/block.log" ;;
    train) python3 bench/train_bench.py --variants "${VARIANTS:-hf_eager,hf_compile,hf_liger,hf_codetta}" ${LORA:+--lora "$LORA"} \
        2>&1 | tee "$OUT/train${LORA:+_lora}.log" ;;
    profile) for v in ${VARIANTS//,/ }; do
        timeout "${PROFILE_TIMEOUT:-240}" python3 bench/train_profile.py --variant "$v" ${LORA:+--lora "$LORA"} 2>&1 \
          | tee "$OUT/profile_$v${LORA:+_lora}.log"
      done ;;
    host-profile) for v in ${VARIANTS//,/ }; do
        timeout "${PROFILE_TIMEOUT:-240}" python3 bench/host_profile.py --variant "$v" ${LORA:+--lora "$LORA"} 2>&1 \
          | tee "$OUT/host_profile_$v${LORA:+_lora}.log" | head -60
      done ;;
    demo) python3 -m codetta demo 2>&1 | tee "$OUT/demo.log" | tail -30 ;;
    rope) python3 bench/rope_bench.py 2>&1 | tee "$OUT/rope.log" | tail -30 ;;
    ab) python3 bench/version_ab.py "${OLD_TREE:-old}" 2>&1 | tee "$OUT/version_ab.log" | tail -25 ;;
    kparts-ab) python3 bench/kparts_ab.py "${OLD_TREE:-old}" 2>&1 | tee "$OUT/kparts_ab.md" ;;
    check) python3 bench/training_shapes_check.py --part "${PART:-all}" 2>&1 | tee "$OUT/training_shapes_check.log" | tail -40 ;;
  esac
done
# Only the result files this call wrote come back (the tool returns at most 8 files), and
# the tuner's choices (which configs win where: for pruning the candidate list).
find bench/results -newer /tmp/device_run.start -type f -exec cp {} "$OUT/" \;
if [ -f "$CODETTA_CACHE_DIR/tuning.json" ]; then cp "$CODETTA_CACHE_DIR/tuning.json" "$OUT/"; fi
