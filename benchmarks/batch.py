"""The batch benchmark (one batched generate call against sequential calls, tokens/s), as a script.

Same as `hf-dllm-spec bench-batch [args]` and `./run.sh bench-batch [args]`; the code is
`hf_dllm_spec.tools.jobs.batch`. Result: benchmarks/results/batch.md.
"""

from hf_dllm_spec.tools.jobs.batch import main

if __name__ == "__main__":
    main()
