#!/usr/bin/env bash
# The one prepared command of a session that is lent a GPU (the device machine: CUDA torch and transformers
# preinstalled, no network). Run from the repository root there, with a limit of about 10 minutes:
#   bash benchmarks/gpu_session.sh
# It installs this package over the machine's own torch / transformers (no dependency is fetched), then runs
# (550 s in all at most, within one 600-s device command)
#   1. `hf-dllm-spec check-gpu` (every strategy x bundled family through CUDA graphs, bf16 and fp32, memory over
#      50 calls, a captured forward vs stock compiled AR at SDAR-1.7B shapes), JSON and report;
#   2. the CUDA-graph tests of the default static runtime (`test_cuda_graphs_replay_the_eager_tokens`: every
#      strategy x family through captured forwards, memory over 100 calls) and the no-sync test;
#   3. the decoding steps of issue 34 as CUDA graphs (`test_steps_on_cuda_graphs_...`, 12 rows each): captured
#      whole by the static runtime (the default on a GPU), then compiled in "reduce-overhead" mode (inductor
#      compiles each: the slowest part, run last and verbose, so that a timeout still shows which rows passed),
# writing everything under $OUT (default runs/gpu-session/). Record the figures in docs/performance.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-session}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.txt" 2>&1 \
  || { cat "$OUT/install.txt"; exit 3; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)'
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
timeout 210 python3 -m hf_dllm_spec.cli check-gpu --json "$OUT/check-gpu.json" 2>&1 | tee "$OUT/check-gpu.txt"
check=${PIPESTATUS[0]}
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_static_runtime.py tests/test_core_v2.py \
  -k "cuda_graphs_replay or no_device_sync_per_forward_on_cuda" 2>&1 | tee "$OUT/gpu-tests.txt"
tests=${PIPESTATUS[0]}
timeout 90 python3 -m pytest -v -p no:cacheprovider tests/test_static_runtime.py \
  -k "steps_on_cuda_graphs and captured" 2>&1 | tee "$OUT/gpu-captured-steps.txt"
captured=${PIPESTATUS[0]}
timeout 150 python3 -m pytest -v -p no:cacheprovider tests/test_static_runtime.py \
  -k "steps_on_cuda_graphs and compiled" 2>&1 | tee "$OUT/gpu-compiled-steps.txt"
steps=${PIPESTATUS[0]}
echo "check-gpu exit status $check; GPU tests exit status $tests; captured steps exit status $captured;" \
  "compiled steps exit status $steps"
exit $(( check || tests || captured || steps ))
