#!/usr/bin/env bash
# The one prepared command of a session that is lent a GPU (the device machine: CUDA torch and transformers
# preinstalled, no network). Run from the repository root there, with a limit of about 9 minutes:
#   bash benchmarks/gpu_session.sh            # steps 1-3 below, bench-gpu on the SDAR group
#   bash benchmarks/gpu_session.sh speed      # steps 3 then 2: bench-gpu on each of $BENCH_GROUPS (default: the
#                                             # groups issue 34 asks for: sdar,fast_dllm_v2,llada2,deer), each
#                                             # within its $BENCH_LIMIT s (default 80,80,120,140), then the speed
#                                             # check with what is left until $DEADLINE s (default 585)
#   BENCH_RUNTIME=compiled BENCH_ROWS='dynamic 0.9 B=4,S2D2 hysteresis 1/-5 B=4' BENCH_GROUPS=sdar BENCH_LIMIT=400 \
#     bash benchmarks/gpu_session.sh speed   # bench-gpu --runtime compiled (compile_config=CompileConfig(): every
#                                             # width and step shape compiles first) on some rows ($BENCH_ROWS);
#                                             # 39-50 s per compile at 1.7B shapes on an H200: even one row with
#                                             # its group's AR row needs about 10 minutes (docs/performance.md)
# It installs this package over the machine's own torch / transformers (no dependency is fetched), then runs
# (about 580 s in all at most; 321 s on an H200 without step 3 and the compiled widths, 2026-11-27; the speed mode
# 436 s on an H200, 2026-11-28: bench-gpu 61 / 42 / 11 / 86 s per group plus about 25 s of start-up each, then the
# speed check 134 s; the GPU tests of step 1 needed more than their 250 s there, 27 of 30 done)
#   1. at the same time (correctness only, nothing timed):
#      - `hf-dllm-spec check-gpu --no-speed` (every strategy x bundled family through CUDA graphs, bf16 and fp32,
#        memory over 50 calls), one line per row as it is done, JSON at the end;
#      - the GPU tests on 8 pytest-xdist workers: the CUDA-graph tests of the default static runtime
#        (`test_cuda_graphs_replay_the_eager_tokens`: every strategy x family, memory over 50 calls), the no-sync
#        test and the decoding steps of issue 34 as CUDA graphs (`test_steps_on_cuda_graphs_...`, 12 rows each:
#        captured whole by the static runtime, the default on a GPU, and compiled in "reduce-overhead" mode);
#   2. alone, so that nothing else runs on the GPU: check-gpu's speed check (a captured forward at widths 1-64 of
#      SDAR-1.7B shapes against stock transformers' compiled AR step, in one process; widths 1 and 8 compiled by
#      `compile_config=CompileConfig()` too: `check-gpu --speed-only --compiled-widths 1,8`);
#   3. alone: the GPU benchmark of the SDAR rows at 1.7B shapes (`hf-dllm-spec bench-gpu --groups sdar
#      --num-prompts 2`: outside-forward time per step, predicted tokens/s against stock; 52 s on an H200),
# writing everything under $OUT (default runs/gpu-session/; 8 files at most). Record the figures in
# docs/performance.md ("First GPU run").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-session}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.txt" 2>&1 \
  || { cat "$OUT/install.txt"; exit 3; }
rm "$OUT/install.txt"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)'
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
MODE=${1:-full}
check=0 tests=0
if [ "$MODE" = full ]; then
  timeout 240 python3 -m hf_dllm_spec.cli check-gpu --no-speed --json "$OUT/check-gpu.json" \
    > "$OUT/check-gpu.txt" 2>&1 &
  check_pid=$!
  timeout 250 python3 -m pytest -v -n 8 -p no:cacheprovider --durations=15 tests/test_static_runtime.py \
    tests/test_core_v2.py -k "cuda_graphs_replay or no_device_sync_per_forward_on_cuda or steps_on_cuda_graphs" \
    > "$OUT/gpu-tests.txt" 2>&1
  tests=$?
  wait $check_pid
  check=$?
  tail -5 "$OUT/gpu-tests.txt"
  cat "$OUT/check-gpu.txt"
  groups=${BENCH_GROUPS:-sdar} limits=${BENCH_LIMIT:-120}
else
  groups=${BENCH_GROUPS:-sdar,fast_dllm_v2,llada2,deer} limits=${BENCH_LIMIT:-80,80,120,140}
fi
speed_check() {   # check-gpu's speed check within $1 s; its report is printed at the end only
  timeout "$1" python3 -m hf_dllm_spec.cli check-gpu --speed-only --compiled-widths 1,8 2>&1 | tee "$OUT/speed.txt"
  speed=${PIPESTATUS[0]}
}
speed=0
[ "$MODE" = full ] && speed_check 200
mkdir -p "$OUT/bench"   # each group's log and report (<group>.log, <group>/*.md), packed into one file at the end
bench=0 limit=120
IFS=, read -ra group_list <<< "$groups"
IFS=, read -ra limit_list <<< "$limits"
for i in "${!group_list[@]}"; do
  group=${group_list[$i]} limit=${limit_list[$i]:-$limit}    # one limit serves every group; a list, one each
  log="$OUT/bench/$group.log"
  timeout "$limit" python3 -m hf_dllm_spec.cli bench-gpu --groups "$group" --num-prompts 2 --no-plot \
    --runtime "${BENCH_RUNTIME:-static}" ${BENCH_ROWS:+--rows "$BENCH_ROWS"} --out "$OUT/bench/$group" > "$log" 2>&1
  status=$?
  bench=$(( bench || status ))
  echo "== bench-gpu --groups $group (${SECONDS} s in): exit status $status"
  sed -n '/^## Targets/,$p' "$log"; tail -3 "$log"
done
tar -czf "$OUT/bench.tar.gz" -C "$OUT" bench && rm -rf "$OUT/bench"
[ "$MODE" = full ] || speed_check $(( ${DEADLINE:-585} - SECONDS ))
echo "check-gpu exit status $check; GPU tests exit status $tests; speed exit status $speed; bench exit status $bench"
exit $(( check || tests || speed || bench ))
