#!/usr/bin/env bash
# Set up (first run) and run codetta's main job or its tests.
#   ./run.sh demo [args]   the demo: a fused-program check, then a small Llama trained plain and patched
#   ./run.sh test [args]   the test suite (on a CPU through Triton's interpreter); args go to pytest
#                          (options alone, e.g. -x or -k name, run codetta's tests from any folder)
# The environment is .venv beside this script (it sees the machine's own packages, e.g. a GPU
# machine's torch and Triton); paths in args are relative to the folder you run it from.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
usage() { echo "usage: ./run.sh demo [--help | demo options] | ./run.sh test [pytest options and paths]"; }
cmd="${1:-}"
case "$cmd" in
  demo|test) shift ;;
  -h|--help|help) usage; exit 0 ;;
  *) usage >&2; exit 2 ;;
esac
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || { echo "codetta needs Python 3.10 or newer; python3 is $(python3 --version 2>&1)" >&2; exit 1; }
venv="$here/.venv"
py="$venv/bin/python"
if ! "$py" -c "" >/dev/null 2>&1; then  # missing, or broken (e.g. the Python it was made from is gone)
  python3 -m venv --clear --system-site-packages "$venv"
fi
requirements="$here/requirements-cpu.txt"
if ! "$py" -c "import torch, triton" >/dev/null 2>&1; then
  # A machine without torch: the pinned CPU build (a bare "torch" would pull a CUDA build of GBs).
  # Where PyTorch's CPU index can be reached, pip takes the CPU build from it; this workplace
  # keeps that build on local disk.
  cpu_index=()
  if ! command -v nvidia-smi >/dev/null 2>&1 && command -v curl >/dev/null 2>&1 \
      && curl -fsS --max-time 5 -o /dev/null https://download.pytorch.org/whl/cpu/torch/ 2>/dev/null; then
    cpu_index=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
  "$py" -m pip install -q ${cpu_index[@]+"${cpu_index[@]}"} -r "$requirements"
elif ! "$py" -c "import numpy, pytest, xdist, hypothesis, transformers, peft, tqdm, matplotlib" >/dev/null 2>&1; then
  # A machine with its own torch and Triton (a GPU's): they stay; the other pinned packages.
  "$py" -m pip install -q -r <(grep -v -E '^(torch|triton)==' "$requirements")
fi
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
case "$cmd" in
  demo) exec "$py" -m codetta demo "$@" ;;
  test)
    # the whole suite, by default in one test process per core (pytest-xdist; an idle process takes
    # tests queued for a busy one: the slow ones do not end the run alone), naming its slowest tests
    if [ $# -eq 0 ]; then set -- -n "$(nproc 2>/dev/null || echo 1)" --dist worksteal --durations=20; fi
    # no test path among the args (options only, e.g. -x or -k name): codetta's tests, from any folder;
    # the value of an option that takes one (-k name, -m mark, -p plugin, -n 2, ...) is no test path
    names_a_path=0 value_of=""
    for arg in "$@"; do
      if [ -n "$value_of" ]; then value_of=""; continue; fi
      case "$arg" in
        -k|-m|-p|-n|-o|-c|-W|-r|--dist|--durations|--maxfail|--tb|--rootdir|--basetemp|--deselect|--ignore) value_of=1 ;;
        -*) ;;
        *) if [ -e "${arg%%::*}" ]; then names_a_path=1; fi ;;
      esac
    done
    if [ "$names_a_path" -eq 0 ]; then set -- "$@" "$here/tests"; fi
    exec "$py" -m pytest -q --rootdir "$here" -c "$here/pyproject.toml" "$@" ;;
esac
