"""The benchmark sweep (block size x unmasking rule x S2D2 routing preset against AR), as a script.

Same as `hf-dllm-spec bench [args]` and `./run.sh bench [args]`; the code is `hf_dllm_spec.tools.jobs.sweep`.
Results: benchmarks/results/sweep.md, sweep.json, frontier.png.
"""

from hf_dllm_spec.tools.jobs.sweep import main

if __name__ == "__main__":
    main()
