#!/usr/bin/env bash
# Set up (first run) and run codetta's main job or its tests.
#   ./run.sh demo [args]   the demo: a fused-program check, then a small Llama trained plain and patched
#   ./run.sh test [args]   the test suite (on a CPU through Triton's interpreter)
set -euo pipefail
cd "$(dirname "$0")"
venv=.venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv --system-site-packages "$venv"
fi
py="$venv/bin/python"
if ! "$py" -c "import torch, triton" >/dev/null 2>&1; then
  # A machine without torch: the pinned CPU build (a bare "torch" would pull a CUDA build of GBs).
  "$py" -m pip install -q -r requirements-cpu.txt
elif ! "$py" -c "import numpy, pytest, hypothesis, transformers, tqdm, matplotlib" >/dev/null 2>&1; then
  # A machine with its own torch and Triton (a GPU's): they stay; the other pinned packages.
  "$py" -m pip install -q $(grep -E '^[a-z]' requirements-cpu.txt | grep -v -E '^(torch|triton)==')
fi
cmd="${1:-}"
shift || true
case "$cmd" in
  demo) exec "$py" -m codetta demo "$@" ;;
  test) exec "$py" -m pytest -q "$@" ;;
  *) echo "usage: ./run.sh demo|test [args]" >&2; exit 2 ;;
esac
