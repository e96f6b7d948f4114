"""An OpenAI-compatible server over the library's strategies (`hf-dllm-spec serve`; extra `hf-dllm-spec[serve]`).

Modules: `protocol` (request parsing and validation), `batcher` (the request queue and the padded batches),
`app` (the FastAPI routes and server-sent events), `cli` (the `serve` subcommand), `bench` (throughput against
one request at a time). Importing this package imports neither FastAPI nor uvicorn.
"""
