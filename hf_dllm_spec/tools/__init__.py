"""The tools: a floor of their own above the library, out of the decoding path.

`jobs` (the main job, the benchmark sweep and the batch benchmark behind `hf-dllm-spec main | bench | bench-batch`,
with the prompt sets and scoring in `jobs.evaluation`), `cost_model` (count / measure / predict / report, and the
`hf-dllm-spec check-gpu` checks) and `serving_bench` (the server against one request at a time:
`python -m hf_dllm_spec.tools.serving_bench`). They import the library and the server; nothing but the command
line (`hf_dllm_spec.cli`) imports them (tests/test_architecture.py).
"""
