"""`hf-dllm-spec serve MODEL`: the OpenAI-compatible server (the `serve` extra: `pip install -e '<checkout>[serve]'`).

    hf-dllm-spec serve models/sdar-tiny-arith                                  # the model's stored strategy
    hf-dllm-spec serve models/sdar-tiny-arith --strategy s2d2 --param block_size=4 --port 8000
    hf-dllm-spec serve models/qwen2-tiny-ar --draft-model models/deer-drafter-tiny --strategy deer

Clients pick another strategy or parameters per request in the body (the `openai` client's `extra_body`):
`{"decoding_strategy": "s2d2", "confidence_threshold": 0.8}`; `--strategy` and `--param` are the defaults.

Scheduling (continuous batching): requests with the same strategy and parameters decode in one running batch (up to
--max-batch-size rows and --max-step-tokens tokens per forward); a request that arrives while it runs joins it at
its next step (the block strategies and S2D2: between two denoising steps; SimSD and DEER: between two
draft-and-verify cycles), each row with its own budget, seed, temperature / top-p / top-k and ignore_eos, and leaves
as soon as it ends or its client goes away. The oldest waiting request is never passed over: while it is of other
options, the running batch takes no more rows and drains, then its group runs. Every response is the request's own
batch-1 `generate` tokens. With --max-concurrent-batches 2 or more (eager runtime), groups of different options
decode side by side. /metrics reports running and waiting requests, tokens/s, time to first token and per-strategy
acceptance rate and tokens per forward (Prometheus text).

Loading (as `generate`): --dtype auto, --device or --device-map (accelerate), --quantization 4bit|8bit
(bitsandbytes), --draft-device.

Security and limits: with `--api-key KEY` (or the environment variable HF_DLLM_SPEC_API_KEY) every route but
/health needs `Authorization: Bearer KEY` (401 otherwise; the `openai` client's api_key). Bodies over
--max-body-bytes get 413 before they are read, bodies that are not application/json 415, bodies slower than
--body-timeout 408; JSON deeper than --max-json-depth, prompts over --max-prompt-tokens and bad values 400;
past --max-waiting queued requests 429 with Retry-After. On a loopback --host only Host headers naming the
loopback are served (--allowed-hosts). Idle connections close after --timeout-keep-alive (uvicorn).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
from typing import Any

from ..cli_args import CACHE_IMPLEMENTATIONS, UsageError, positive_int, suggest
from .limits import API_KEY_ENV
from .loading import LoadOptions, add_loading_arguments


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
    parser.add_argument("--max-batch-size", type=int, default=32, help="most requests decoding together, the rows "
                        "of the running batch (default 32)")
    parser.add_argument("--max-concurrent-batches", type=int, default=1, metavar="N",
                        help="batches decoded at the same time, sharing the model: with 2 or more, a request that "
                             "arrives while a long batch decodes starts at once in a free worker instead of waiting "
                             "for it (eager runtime only; default 1)")
    parser.add_argument("--max-step-tokens", type=int, default=None, metavar="N",
                        help="most tokens one forward of a batch may hold, on its largest forward (the prefill: rows "
                             "x longest prompt); requests join a batch only within it, a longer prompt gets 400 "
                             "(default: no limit)")
    parser.add_argument("--max-tokens", type=int, default=256, help="budget of requests without max_tokens "
                                                                    "(default 256)")
    add_loading_arguments(parser)          # --dtype, --device, --device-map, --quantization, --draft-device
    parser.add_argument("--cache-implementation", default=None, choices=CACHE_IMPLEMENTATIONS,
                        help="set on the model's generation config: `static` decodes every batch with the static "
                             "runtime (preallocated cache; CUDA graphs on a GPU, kept across batches); default: the "
                             "eager runtime")
    limits = parser.add_argument_group("security and limits")
    limits.add_argument("--api-key", default=None, metavar="KEY",
                        help=f"require `Authorization: Bearer KEY` on every route but /health (401 otherwise); "
                             f"default: the environment variable {API_KEY_ENV}, else no key")
    limits.add_argument("--max-body-bytes", type=positive_int, default=4 * 2 ** 20, metavar="N",
                        help="largest request body; larger ones get 413 before they are read (default 4194304)")
    limits.add_argument("--max-json-depth", type=positive_int, default=32, metavar="N",
                        help="deepest nesting of JSON arrays and objects in a body (default 32)")
    limits.add_argument("--max-prompt-tokens", type=positive_int, default=32768, metavar="N",
                        help="longest prompt in tokens, after the chat template (default 32768; the model's context "
                             "is checked too)")
    limits.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="time a client has to send its whole body; slower ones get 408 (default 30)")
    limits.add_argument("--max-waiting", type=int, default=None, metavar="N",
                        help="most requests waiting for a batch; past it 429 with Retry-After (default: no limit)")
    limits.add_argument("--allowed-hosts", default=None, metavar="HOST[,HOST...]",
                        help="Host header values served (400 otherwise; '*' any); default: the loopback names "
                             "(localhost, 127.0.0.1, ::1) when --host is a loopback address, else any")
    limits.add_argument("--timeout-keep-alive", type=int, default=5, metavar="SECONDS",
                        help="uvicorn closes a connection idle for that long (default 5)")
    limits.add_argument("--limit-concurrency", type=int, default=None, metavar="N",
                        help="uvicorn answers 503 past N open connections and tasks (default: no limit)")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def server_limits(args: argparse.Namespace):
    """The :class:`~hf_dllm_spec.serving.limits.ServerLimits` of the `serve` options (the key from --api-key, else
    the environment variable).

    Raises:
        UsageError: an empty `--allowed-hosts` (it turned the Host check off), an empty `--api-key` or an empty
            HF_DLLM_SPEC_API_KEY (each served every caller: `--api-key "$UNSET_VARIABLE"` expands to nothing).
    """
    from .limits import ServerLimits

    if args.allowed_hosts is not None:
        hosts = tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
        if not hosts:
            raise UsageError("--allowed-hosts", f"must name at least one host (got {args.allowed_hosts!r}); pass e.g. "
                             "--allowed-hosts localhost,127.0.0.1, or '*' to serve any Host header")
    else:
        hosts = ("localhost", "127.0.0.1", "::1", "[::1]") if _is_loopback(args.host) else ("*",)
    key, source = (args.api_key, "--api-key") if args.api_key is not None else (os.environ.get(API_KEY_ENV),
                                                                                API_KEY_ENV)
    if key is not None and not key.strip():
        raise UsageError(source, "must not be empty (an empty key would serve every caller); pass the key, or "
                         f"leave out --api-key and unset {API_KEY_ENV} to serve without one")
    return ServerLimits(api_key=key,
                        max_body_bytes=args.max_body_bytes, max_json_depth=args.max_json_depth,
                        max_prompt_tokens=args.max_prompt_tokens, body_timeout_s=args.body_timeout,
                        allowed_hosts=hosts, max_waiting=args.max_waiting)


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
    for name, value, low in (("--max-batch-size", args.max_batch_size, 1), ("--max-tokens", args.max_tokens, 1),
                             ("--max-concurrent-batches", args.max_concurrent_batches, 1),
                             ("--max-step-tokens", args.max_step_tokens, 1),
                             ("--max-waiting", args.max_waiting, 0), ("--timeout-keep-alive", args.timeout_keep_alive, 1),
                             ("--limit-concurrency", args.limit_concurrency, 1)):
        if value is not None and value < low and parser is not None:
            parser.error(f"{name} must be >= {low} (got {value})")
    if not 0 <= args.port <= 65535 and parser is not None:
        parser.error(f"--port must be in [0, 65535] (got {args.port})")
    if args.max_concurrent_batches > 1 and args.cache_implementation == "static" and parser is not None:
        parser.error("--max-concurrent-batches must be 1 with --cache-implementation static (the static runtime "
                     "keeps its buffers on the model)")
    if not args.body_timeout > 0 and parser is not None:
        parser.error(f"--body-timeout must be a number of seconds > 0 (got {args.body_timeout})")
    try:
        limits = server_limits(args)
        served = load_served_model(args.model, draft_model=args.draft_model, strategy=args.strategy,
                                   params=dict(args.param), loading=LoadOptions.from_args(args),
                                   name=args.served_model_name, cache_implementation=args.cache_implementation,
                                   default_max_tokens=args.max_tokens, max_batch_size=args.max_batch_size,
                                   max_concurrent_batches=args.max_concurrent_batches,
                                   max_step_tokens=args.max_step_tokens)
    except ValueError as err:          # a UsageError reads "argument FLAG: ..."
        if parser is None:
            raise
        parser.error(suggest(str(err)))     # a mistyped --param or --strategy: the closest name
    print(f"serving {served.name} (default decoding_strategy={served.default_strategy!r}) on "
          f"http://{args.host}:{args.port}/v1" + (" (API key required)" if limits.api_key else ""))
    uvicorn.run(create_app(served, limits), host=args.host, port=args.port, log_level="info",
                timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.limit_concurrency)


def main(argv: list[str] | None = None) -> None:
    """`python -m hf_dllm_spec.serving.cli MODEL ...` (installed third-party strategies registered first, as
    `hf-dllm-spec serve` does)."""
    from ..strategies.registry import load_strategy_plugins

    load_strategy_plugins()
    parser = argparse.ArgumentParser(prog="hf-dllm-spec serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.parser = parser
    run(args, argv)


if __name__ == "__main__":
    main()
