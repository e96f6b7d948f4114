"""Cost model: predict tokens/s of every decoding strategy at real model scale from forward widths and timings.

    python benchmarks/cost_model.py --threads 1 --count-repeats 3 --reps 7      # CPU, tiny shapes (bundled configs)
    python benchmarks/cost_model.py --shape 1.7b --dtype bfloat16 --threads 1 --groups sdar,fast_dllm_v2 \\
        --counts benchmarks/results/cost_model/tiny-cpu-float32.json           # CPU, SDAR-1.7B: reuse the counts
    python benchmarks/cost_model.py --shape 1.7b --device cuda --dtype bfloat16 --quant nf4 \\
        --counts benchmarks/results/cost_model/tiny-cpu-float32.json           # GPU (bitsandbytes installed)
    hf-dllm-spec bench-gpu                     # GPU: static runtime vs stock AR, the targets -> runs/bench-gpu-*/

On a shared CPU machine use one torch thread: with two OpenMP threads and another process on one of the two
cores, forwards ran up to 10x slower (threads wait at barriers); with one thread the wall/CPU time ratio the
tables print shows how much other processes slowed a run.

Three phases, one module each (docs/performance.md states the equations):

1. COUNT (`count`): every strategy at its best setting of the existing benchmarks runs on the bundled trained
   models with greedy decoding over N held-out arithmetic prompts; the runtime's forward trace
   (`hf_dllm_spec.runtime.trace.trace_forwards`) gives each forward's model role, kind, query width, context length
   and `logits_to_keep`. Tokens, NFE, acceptance and the measured outside-forward seconds per step are kept.
2. TIME (`measure`): models of real shapes (`shapes`: configs written from `shared/reference/families.md`, random
   weights, optionally bitsandbytes-quantized) time the query widths the COUNT phase saw, as the library's
   `ModelRunner.forward` runs them, and the time outside forwards per decoding step of each strategy.
3. PREDICT (`predict`, pure functions): tokens/s = tokens / (sum over recorded forwards of t_shape(q) + decode
   steps * outside-per-step), t_shape(q) piecewise-linear over the measured widths; the efficiency figure
   (speedup over AR / forward-count ratio over AR) per strategy.

The static-runtime mode (`--runtime static`; `hf-dllm-spec bench-gpu` runs it with GPU defaults) times each width
as the static runtime runs it (`measure.StaticForward`: CUDA-graph replays on a GPU), measures the outside time
with `cache_implementation="static"`, times stock transformers `generate(cache_implementation="static")` greedy AR
on a stock class of each shape's dimensions in the same process (`baseline`), and checks the targets of issue 25
(`predict.targets_phase`); `--count-device` / `--count-runtime` run the COUNT phase on a GPU and under the static
runtime, for the end-to-end figures.

`report` writes the tables, plots and the machine description; `cli` is the command line
(`benchmarks/cost_model.py`, `hf-dllm-spec bench-gpu`). Outputs in `--out` (default `benchmarks/results/cost_model/`):
`<shape>-<device>-<dtype>[-<quant>][-<runtime>].json` (`report.run_name`: a subset of groups or rows, or a COUNT
phase elsewhere than the CPU's eager runtime, adds to the name), the same name `.md` (tables) and `.png` (forward
time vs query width per shape; predicted tokens/s per strategy). This is a measurement, not a test: record the machine and the
command next to the numbers.
"""
