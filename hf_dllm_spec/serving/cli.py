"""`hf-dllm-spec serve MODEL`: the OpenAI-compatible server (the `serve` extra: `pip install -e '<checkout>[serve]'`).

    hf-dllm-spec serve models/sdar-tiny-arith                                  # the model's stored strategy
    hf-dllm-spec serve models/sdar-tiny-arith --strategy s2d2 --param block_size=4 --port 8000
    hf-dllm-spec serve models/qwen2-tiny-ar --draft-model models/deer-drafter-tiny --strategy deer

Clients pick another strategy or parameters per request in the body (the `openai` client's `extra_body`):
`{"decoding_strategy": "s2d2", "confidence_threshold": 0.8}`; `--strategy` and `--param` are the defaults.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..jobs import CACHE_IMPLEMENTATIONS, DTYPES


def parse_param(text: str) -> tuple[str, Any]:
    """`k=v` -> `(k, v)`, `v` read as JSON (`4`, `0.9`, `true`, `null`, `"x"`), else kept as a string."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--param takes NAME=VALUE, e.g. block_size=4 (got {text!r})")
    try:
        return name.strip(), json.loads(value)
    except json.JSONDecodeError:
        return name.strip(), value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` options."""
    parser.add_argument("model", metavar="MODEL", help="checkpoint directory (any family of the library)")
    parser.add_argument("--draft-model", default=None, metavar="PATH",
                        help="drafter checkpoint, for the strategies that use one (DEER, SimSD)")
    parser.add_argument("--strategy", default=None,
                        help="default decoding_strategy (default: the model's stored one, else its native decoding)")
    parser.add_argument("--param", action="append", type=parse_param, default=[], metavar="NAME=VALUE",
                        help="a parameter of the default strategy (repeatable), e.g. --param block_size=4")
    parser.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="default 8000")
    parser.add_argument("--served-model-name", default=None, help="the `model` id clients pass (default: the "
                                                                  "checkpoint folder's name)")
    parser.add_argument("--max-batch-size", type=int, default=16, help="most requests per batch (default 16)")
    parser.add_argument("--max-tokens", type=int, default=256, help="budget of requests without max_tokens "
                                                                    "(default 256)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--device", default="cpu", help="e.g. cpu, cuda (default cpu)")
    parser.add_argument("--cache-implementation", default=None, choices=CACHE_IMPLEMENTATIONS,
                        help="set on the model's generation config: `static` decodes every batch with the static "
                             "runtime (preallocated cache; CUDA graphs on a GPU, kept across batches); default: the "
                             "eager runtime")


def run(args: argparse.Namespace, argv: list[str] | None = None) -> None:
    """Load the model and serve it until interrupted. A bad option stops with a usage error before serving."""
    parser: argparse.ArgumentParser | None = getattr(args, "parser", None)
    try:
        import uvicorn

        from .app import create_app, load_served_model
    except ImportError as err:
        message = (f"serving needs the `serve` extra: pip install -e '<checkout>[serve]' (the hf-dllm-spec "
                   f"repository checkout) ({err})")
        if parser is not None:
            parser.error(message)
        raise SystemExit(message) from err
    for name, value, low in (("--max-batch-size", args.max_batch_size, 1), ("--max-tokens", args.max_tokens, 1)):
        if value < low and parser is not None:
            parser.error(f"{name} must be >= {low} (got {value})")
    try:
        served = load_served_model(args.model, draft_model=args.draft_model, strategy=args.strategy,
                                   params=dict(args.param), dtype=args.dtype, device=args.device,
                                   name=args.served_model_name, cache_implementation=args.cache_implementation,
                                   default_max_tokens=args.max_tokens,
                                   max_batch_size=args.max_batch_size)
    except ValueError as err:
        if parser is None:
            raise
        parser.error(str(err))
    print(f"serving {served.name} (default decoding_strategy={served.default_strategy!r}) on "
          f"http://{args.host}:{args.port}/v1")
    uvicorn.run(create_app(served), host=args.host, port=args.port, log_level="info")


def main(argv: list[str] | None = None) -> None:
    """`python -m hf_dllm_spec.serving.cli MODEL ...`."""
    parser = argparse.ArgumentParser(prog="hf-dllm-spec serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.parser = parser
    run(args, argv)


if __name__ == "__main__":
    main()
