"""The cost model (COUNT forwards, TIME them at real shapes, PREDICT tokens/s), as a script.

    python benchmarks/cost_model.py --threads 1 --count-repeats 3 --reps 7      # CPU, tiny shapes (bundled configs)
    python benchmarks/cost_model.py --runtime static --shape 1.7b --device cuda --dtype bfloat16 \
        --count-device cuda --count-runtime static       # GPU: static runtime vs stock AR, the issue-25 targets
    hf-dllm-spec bench-gpu                                # the same (GPU defaults), into runs/bench-gpu-<date>-<time>/

The code is `hf_dllm_spec.tools.cost_model` (its docstring lists the phases and commands; docs/performance.md states
the equations and the results). Results: benchmarks/results/cost_model/.
"""

from hf_dllm_spec.tools.cost_model.cli import main

if __name__ == "__main__":
    main()
