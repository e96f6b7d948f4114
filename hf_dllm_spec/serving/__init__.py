"""An OpenAI-compatible server over the library's strategies (`hf-dllm-spec serve`; extra `hf-dllm-spec[serve]`).

Modules: `protocol` (request parsing and validation), `limits` (the API key, body and JSON limits),
`batcher` (the request queue and the padded batches), `metrics` (`/metrics`, Prometheus text), `app` (the FastAPI
routes and server-sent events), `loading` (the loading options `generate` and `serve` share), `cli` (the `serve`
subcommand). Its benchmark is a tool above it: `python -m hf_dllm_spec.tools.serving_bench`. Importing this package
imports neither FastAPI nor uvicorn.
"""
