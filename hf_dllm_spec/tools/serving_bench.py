"""Benchmark: the server with concurrent clients against the same prompts decoded one at a time, per runtime.

    python -m hf_dllm_spec.tools.serving_bench                    # bundled model, 32 prompts, 1/8/32 clients, eager
    python -m hf_dllm_spec.tools.serving_bench --runtimes eager static --concurrency 1 32 --max-concurrent-batches 2

In one process, for each runtime (`eager`, or `static`: `cache_implementation="static"` on the model's generation
config, as `serve --cache-implementation static` sets it): every prompt through `model.generate` one at a time (the
baseline, in a worker thread like the server's batches), and the server (in-process, on 127.0.0.1) answering the
same prompts from `--concurrency` clients (threads with the `openai` client, streaming; each sends its share one
request after another, so up to that many requests wait to be batched). After a warm-up the settings alternate
`--repeats` times; prints requests/s and generated tokens/s of the median run, the ratio to the baseline of the
same runtime, p50 / p95 latency and p50 time to first token (streamed text) over every request of every repeat
(the baseline's latency is its `generate` call; it streams nothing), and whether every run returned the
baseline's texts (greedy). A measurement, not a test: numbers depend on the machine; record it with them.
"""

from __future__ import annotations

import math
import argparse
import concurrent.futures
import platform
import statistics
import time

import torch

from ..cli_args import positive_int, suggest
from .jobs import check_model
from .jobs.evaluation import DEFAULT_MODEL, arithmetic_prompts

RUNTIMES = {"eager": None, "static": "static"}


def _percentile(values: list[float], q: float) -> float:
    """The `q`-quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _baseline(served, prompts: list[str], max_tokens: int):
    """Each prompt alone through `model.generate` (the server's decoding options): texts, tokens, seconds, the
    latency of each call."""
    from ..integration.generate import dllm_generate
    from ..integration.mixin import DllmGenerationMixin
    from ..runtime.weights import execution_device
    from ..strategies.registry import get_strategy

    entry = {} if isinstance(served.model, DllmGenerationMixin) else {"custom_generate": dllm_generate}
    if get_strategy(served.default_strategy).uses_drafter:
        entry["draft_model"] = served.drafter
    texts, tokens, latencies = [], 0, []
    t0 = time.perf_counter()
    for prompt in prompts:
        start = time.perf_counter()
        ids = served.tokenizer(prompt, return_tensors="pt").input_ids.to(execution_device(served.model))
        out = served.model.generate(ids, decoding_strategy=served.default_strategy, max_new_tokens=max_tokens,
                                    return_dict_in_generate=True, **served.default_params, **entry)
        n = out.spec_stats_per_row[0].num_generated_tokens
        texts.append(served.tokenizer.decode(out.sequences[0, ids.shape[1]:][:n], skip_special_tokens=True))
        tokens += n
        latencies.append(time.perf_counter() - start)
    return texts, tokens, time.perf_counter() - t0, latencies, []


def _clients(base: str, name: str, prompts: list[str], max_tokens: int, concurrency: int):
    """The prompts sent by `concurrency` streaming clients: texts (in prompt order), tokens, seconds, each
    request's latency and time to its first text."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=600, max_retries=0)

    def ask(prompt: str):
        start, first, text, tokens = time.perf_counter(), None, "", 0
        for chunk in client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, stream=True):
            if chunk.choices and chunk.choices[0].text:
                first = first if first is not None else time.perf_counter() - start
                text += chunk.choices[0].text
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        latency = time.perf_counter() - start
        return text, tokens, latency, first if first is not None else latency

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(ask, prompts))
    return ([a[0] for a in answers], sum(a[1] for a in answers), time.perf_counter() - t0,
            [a[2] for a in answers], [a[3] for a in answers])


def _set_runtime(served, runtime: str) -> None:
    for model in filter(None, (served.model, served.drafter)):
        model.generation_config.cache_implementation = RUNTIMES[runtime]


def prepare(args: argparse.Namespace) -> tuple:
    """The served model and the prompts of the benchmark: `(served, prompts)`.

    Raises:
        ValueError: the library's refusal of the checkpoint, drafter or strategy; a missing held-out set.
    """
    from ..serving.app import load_served_model

    served = load_served_model(args.model, draft_model=args.draft_model, strategy=args.strategy,
                               max_concurrent_batches=args.max_concurrent_batches)
    return served, [p.text for p in arithmetic_prompts(args.model, args.num_prompts)]


def run(args: argparse.Namespace, prepared: tuple | None = None) -> list[dict]:
    """Run the benchmark (on `prepared`, :func:`prepare`'s result, else its own); print and return one row per
    runtime and setting."""
    from ..serving.app import create_app, serve_in_background

    served, prompts = prepared if prepared is not None else prepare(args)
    settings = ["generate, one at a time"] + [f"server, {c} concurrent client{'s' * (c > 1)}" for c in args.concurrency]
    rows = []
    # The baseline runs in a worker thread as the server's batches do (torch's intra-op threading differs between
    # the main thread and others); every setting is warmed up, then the settings alternate `--repeats` times.
    with concurrent.futures.ThreadPoolExecutor(1) as worker, serve_in_background(create_app(served)) as base:
        for runtime in args.runtimes:
            _set_runtime(served, runtime)
            walls: dict[str, list[float]] = {name: [] for name in settings}
            latencies: dict[str, list[float]] = {name: [] for name in settings}
            firsts: dict[str, list[float]] = {name: [] for name in settings}
            tokens: dict[str, int] = {}
            same: dict[str, bool] = {name: True for name in settings}
            worker.submit(_baseline, served, prompts[:2], args.max_tokens).result()
            _clients(base, served.name, prompts[:2], args.max_tokens, 2)
            texts = None
            for _ in range(args.repeats):
                runs = [(settings[0], lambda: worker.submit(_baseline, served, prompts, args.max_tokens).result())]
                runs += [(name, lambda c=c: _clients(base, served.name, prompts, args.max_tokens, c))
                         for name, c in zip(settings[1:], args.concurrency)]
                for name, call in runs:
                    got, n, wall, latency, first = call()
                    texts = texts if texts is not None else got
                    walls[name].append(wall)
                    latencies[name] += latency
                    firsts[name] += first
                    tokens[name], same[name] = n, same[name] and got == texts
            for name in settings:
                wall = statistics.median(walls[name])
                rows.append({"runtime": runtime, "setting": name, "requests_s": len(prompts) / wall,
                             "tokens_s": tokens[name] / wall, "p50_s": _percentile(latencies[name], 0.5),
                             "p95_s": _percentile(latencies[name], 0.95),
                             "ttft_p50_s": _percentile(firsts[name], 0.5) if firsts[name] else None,
                             "same_texts": same[name]})
        _set_runtime(served, "eager")
    print(f"{served.name}, decoding_strategy={served.default_strategy!r}, {len(prompts)} prompts, "
          f"max_tokens={args.max_tokens}, max_concurrent_batches={args.max_concurrent_batches}; "
          f"{platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}")
    print("| runtime | setting | requests/s | tokens/s | vs one at a time | p50 / p95 latency (s) | p50 TTFT (s) | "
          "same texts |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        base_tps = next(b["tokens_s"] for b in rows if b["runtime"] == r["runtime"])
        ttft = "-" if r["ttft_p50_s"] is None else f"{r['ttft_p50_s']:.3f}"
        print(f"| {r['runtime']} | {r['setting']} | {r['requests_s']:.2f} | {r['tokens_s']:.1f} | "
              f"{r['tokens_s'] / base_tps:.2f}x | {r['p50_s']:.3f} / {r['p95_s']:.3f} | {ttft} | "
              f"{'yes' if r['same_texts'] else 'NO'} |")
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    """Parse `argv` (default: `sys.argv[1:]`) and run the benchmark (:func:`run`); a bad argument exits with
    status 2 (argparse).

    Returns:
        `list[dict]`: :func:`run`'s rows, one per runtime and setting.
    """
    parser = argparse.ArgumentParser(prog="python -m hf_dllm_spec.tools.serving_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint (default: the bundled model)")
    parser.add_argument("--draft-model", default=None, metavar="PATH")
    parser.add_argument("--strategy", default=None, help="default: the model's stored strategy")
    parser.add_argument("--num-prompts", type=positive_int, default=32, help="held-out arithmetic prompts (default 32)")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="default 32")
    parser.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 8, 32], help="default 1 8 32")
    parser.add_argument("--runtimes", nargs="+", default=["eager"], choices=list(RUNTIMES),
                        help="runtimes measured in turn, each against its own one-at-a-time baseline (default "
                             "eager)")
    parser.add_argument("--max-concurrent-batches", type=positive_int, default=1, help="the server's worker "
                                                                                       "threads (eager runtime; "
                                                                                       "default 1)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="alternating runs of every setting; the "
                                                                        "median wall time is reported (default 3)")
    args = parser.parse_args(argv)
    if args.max_concurrent_batches > 1 and "static" in args.runtimes:
        parser.error("--max-concurrent-batches must be 1 with the static runtime")
    try:                        # a checkpoint, strategy or held-out set the library refuses: a usage error
        check_model(parser, args.model)
        prepared = prepare(args)
    except (ValueError, NotImplementedError, OSError) as err:
        parser.error(suggest(str(err)))
    return run(args, prepared)


if __name__ == "__main__":
    main()
