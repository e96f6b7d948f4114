#!/usr/bin/env bash
# One entry point for a fresh machine (CPU):
#   ./run.sh main [args]   set up .venv if needed, then run the main job on the bundled model
#   ./run.sh test [args]   set up .venv if needed, then run the test suite
#   ./run.sh bench [args]  set up .venv if needed, then run the benchmark sweep
#   ./run.sh bench-batch [args]  batch of 8 vs 8 sequential calls, tokens/s
set -euo pipefail
cd "$(dirname "$0")"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=.venv/bin/python

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
}

cmd=${1:-main}
shift || true
setup
case "$cmd" in
  setup) ;;
  main) exec "$PY" examples/run_strategies.py "$@" ;;
  test) exec "$PY" -m pytest -q "$@" ;;
  bench) exec "$PY" benchmarks/sweep.py "$@" ;;
  bench-batch) exec "$PY" benchmarks/batch.py "$@" ;;
  *) echo "usage: ./run.sh {main|test|bench|bench-batch|setup} [args]" >&2; exit 2 ;;
esac
