#!/usr/bin/env bash
# One entry point for a fresh machine (CPU):
#   ./run.sh main [args]   set up .venv if needed, then run the main job on the bundled model
#   ./run.sh test [args]   set up .venv if needed, then run the test suite (newest transformers pip resolves), one
#                          pytest-xdist worker per core (-n auto, work stealing)
#   ./run.sh test-oldest [args]  set up .venv-oldest (.venv with the oldest transformers pyproject.toml allows),
#                          then run the fast part of the suite there (-m "not slow", OLDEST_SKIPS aside); CI runs both
#   ./run.sh bench [args]  set up .venv if needed, then run the benchmark sweep
#   ./run.sh bench-batch [args]  batch of 8 vs 8 sequential calls, tokens/s
#   ./run.sh cli [args]    any subcommand of the installed console script (generate, export, ...)
# After setup, main / bench / bench-batch are `hf-dllm-spec main|bench|bench-batch` (see `hf-dllm-spec --help`).
set -euo pipefail
cd "$(dirname "$0")"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
TORCH_PIN="torch==2.13.0"
# The lower bound of the transformers requirement in pyproject.toml: the oldest version the project supports.
OLDEST_TRANSFORMERS=$(sed -n 's/^ *"transformers>=\([0-9.]*\).*/\1/p' pyproject.toml)

# Test files that run on the newest transformers only: they test the library's own layers above `generate` (the
# CLI, the HTTP server and its limits, the cost model, the import rules) or repeat, on random batches, the
# transformers-facing calls the deterministic batch tests make on both versions (the batch property).
OLDEST_SKIPS=(test_cli.py test_serve.py test_serve_limits.py test_serve_wire.py test_cost_model.py test_architecture.py
              test_batch_properties.py)

# setup VENV [PIN ...]: create VENV with the CPU torch wheel and the package (editable, with the dev extra),
# under the given extra pins; once (a marker file records it). .venv-oldest starts as a copy of .venv (set up
# first), so that the pins (transformers, and what its own requirements move) are the only difference between the
# two, and torch and the extras are not installed twice.
setup() {
  local venv=$1; shift
  if [ ! -f "$venv/.hf-dllm-spec-ready" ]; then
    if [ "$venv" = .venv-oldest ]; then
      setup .venv
      rm -rf "$venv" && cp -a .venv "$venv" && rm -f "$venv/.hf-dllm-spec-ready"
      # The copy's scripts (pip, pytest, hf-dllm-spec, activate) and pyvenv.cfg name .venv: point them at the copy.
      grep -lIF "$PWD/.venv" "$venv"/bin/* "$venv/pyvenv.cfg" | xargs -r sed -i "s|$PWD/\.venv|$PWD/$venv|g"
    else
      python3 -m venv "$venv"
      "$venv/bin/python" -m pip install -q --upgrade pip
      # The CPU torch wheel first, so that nothing later pulls a multi-GB CUDA build.
      "$venv/bin/python" -m pip install -q "$TORCH_PIN"
    fi
    printf '%s\n' "$TORCH_PIN" "$@" > "$venv/constraints.txt"
    "$venv/bin/python" -m pip install -q -c "$venv/constraints.txt" -e ".[dev]"
    touch "$venv/.hf-dllm-spec-ready"
  fi
  # A venv set up before the console script existed: reinstall the package once to get it.
  if [ ! -x "$venv/bin/hf-dllm-spec" ]; then
    "$venv/bin/python" -m pip install -q -c "$venv/constraints.txt" -e ".[dev]"
  fi
  "$venv/bin/python" -c 'import transformers, sys; print(f"{sys.argv[1]}: transformers {transformers.__version__}")' \
    "$venv" >&2
}

cmd=${1:-main}
shift || true
case "$cmd" in
  test-oldest)
    setup .venv-oldest "transformers==$OLDEST_TRANSFORMERS"
    exec .venv-oldest/bin/python -m pytest -q -n auto --dist worksteal -m "not slow" \
      "${OLDEST_SKIPS[@]/#/--ignore=tests/}" "$@" ;;
esac
setup .venv
case "$cmd" in
  setup) ;;
  main|bench|bench-batch) exec .venv/bin/hf-dllm-spec "$cmd" "$@" ;;
  cli) exec .venv/bin/hf-dllm-spec "$@" ;;
  test) exec .venv/bin/python -m pytest -q -n auto --dist worksteal "$@" ;;
  *) echo "usage: ./run.sh {main|test|test-oldest|bench|bench-batch|cli|setup} [args]" >&2; exit 2 ;;
esac
