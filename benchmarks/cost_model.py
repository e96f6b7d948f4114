"""The cost model (COUNT forwards, TIME them at real shapes, PREDICT tokens/s), as a script.

    python benchmarks/cost_model.py --threads 1 --count-repeats 3 --reps 7      # CPU, tiny shapes (bundled configs)

The code is `hf_dllm_spec.cost_model` (its docstring lists the phases and commands; docs/performance.md states
the equations and the results). Results: benchmarks/results/cost_model/.
"""

from hf_dllm_spec.cost_model.cli import main

if __name__ == "__main__":
    main()
