#!/usr/bin/env bash
# One entry point for a fresh machine (CPU):
#   ./run.sh main [args]   set up .venv if needed, then run the main job on the bundled model
#   ./run.sh test [args]   set up .venv if needed, then run the test suite
#   ./run.sh bench [args]  set up .venv if needed, then run the benchmark sweep
#   ./run.sh bench-batch [args]  batch of 8 vs 8 sequential calls, tokens/s
#   ./run.sh cli [args]    any subcommand of the installed console script (generate, export, ...)
# After setup, main / bench / bench-batch are `hf-dllm-spec main|bench|bench-batch` (see `hf-dllm-spec --help`).
set -euo pipefail
cd "$(dirname "$0")"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=.venv/bin/python
CLI=.venv/bin/hf-dllm-spec

setup() {
  if [ ! -f .venv/.hf-dllm-spec-ready ]; then
    python3 -m venv .venv
    "$PY" -m pip install -q --upgrade pip
    # The CPU torch wheel first, so that nothing later pulls a multi-GB CUDA build.
    "$PY" -m pip install -q torch==2.13.0
    echo "torch==2.13.0" > .venv/constraints.txt
    "$PY" -m pip install -q -c .venv/constraints.txt -e ".[dev]"
    touch .venv/.hf-dllm-spec-ready
  fi
  # A venv set up before the console script existed: reinstall the package once to get it.
  if [ ! -x "$CLI" ]; then
    "$PY" -m pip install -q -c .venv/constraints.txt -e ".[dev]"
  fi
}

cmd=${1:-main}
shift || true
setup
case "$cmd" in
  setup) ;;
  main|bench|bench-batch) exec "$CLI" "$cmd" "$@" ;;
  cli) exec "$CLI" "$@" ;;
  test) exec "$PY" -m pytest -q "$@" ;;
  *) echo "usage: ./run.sh {main|test|bench|bench-batch|cli|setup} [args]" >&2; exit 2 ;;
esac
