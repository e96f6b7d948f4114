"""Benchmark: the server with 1, 4 and 16 concurrent clients against the same prompts decoded one at a time.

    python -m hf_dllm_spec.serving.bench                                  # bundled model, 16 prompts, 32 tokens
    python -m hf_dllm_spec.serving.bench --strategy s2d2 --concurrency 1 4 16 --num-prompts 32

In one process: every prompt through `model.generate` one at a time (the baseline, in a worker thread like the
server's batches), and the server (in-process, on 127.0.0.1) answering the same prompts from `--concurrency`
clients (threads with the `openai` client; each sends its share one request after another, so up to that many
requests wait to be batched). After a warm-up the settings alternate `--repeats` times; prints requests/s and
generated tokens/s of the median run, the ratio to the baseline, and whether every run returned the baseline's
texts (greedy). A measurement, not a test: numbers depend on the machine; record it with them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import platform
import statistics
import time

import torch

from ..jobs.evaluation import DEFAULT_MODEL, arithmetic_prompts


def _baseline(served, prompts: list[str], max_tokens: int) -> tuple[list[str], int, float]:
    """Each prompt alone through `model.generate` (the server's decoding options): texts, tokens, seconds."""
    from ..integration.generate import dllm_generate
    from ..integration.mixin import DllmGenerationMixin
    from ..strategies.registry import get_strategy

    entry = {} if isinstance(served.model, DllmGenerationMixin) else {"custom_generate": dllm_generate}
    if get_strategy(served.default_strategy).uses_drafter:
        entry["draft_model"] = served.drafter
    texts, tokens = [], 0
    t0 = time.perf_counter()
    for prompt in prompts:
        ids = served.tokenizer(prompt, return_tensors="pt").input_ids.to(served.model.device)
        out = served.model.generate(ids, decoding_strategy=served.default_strategy, max_new_tokens=max_tokens,
                                    return_dict_in_generate=True, **served.default_params, **entry)
        n = out.spec_stats_per_row[0].num_generated_tokens
        texts.append(served.tokenizer.decode(out.sequences[0, ids.shape[1]:][:n], skip_special_tokens=True))
        tokens += n
    return texts, tokens, time.perf_counter() - t0


def _clients(base: str, name: str, prompts: list[str], max_tokens: int, concurrency: int):
    """The prompts sent by `concurrency` clients: texts (in prompt order), tokens, seconds."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=600, max_retries=0)

    def ask(prompt: str):
        r = client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens)
        return r.choices[0].text, r.usage.completion_tokens

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(ask, prompts))
    return [a[0] for a in answers], sum(a[1] for a in answers), time.perf_counter() - t0


def run(args: argparse.Namespace) -> list[dict]:
    """Run the benchmark; print and return one row per setting."""
    from .app import create_app, load_served_model, serve_in_background

    served = load_served_model(args.model, draft_model=args.draft_model, strategy=args.strategy)
    prompts = [p.text for p in arithmetic_prompts(args.model, args.num_prompts)]
    settings = ["generate, one at a time"] + [f"server, {c} concurrent client{'s' * (c > 1)}" for c in args.concurrency]
    walls: dict[str, list[float]] = {name: [] for name in settings}
    tokens: dict[str, int] = {}
    same: dict[str, bool] = {name: True for name in settings}
    # The baseline runs in a worker thread as the server's batches do (torch's intra-op threading differs between
    # the main thread and others); every setting is warmed up, then the settings alternate `--repeats` times.
    with concurrent.futures.ThreadPoolExecutor(1) as worker, serve_in_background(create_app(served)) as base:
        worker.submit(_baseline, served, prompts[:2], args.max_tokens).result()
        _clients(base, served.name, prompts[:2], args.max_tokens, 2)
        texts = None
        for _ in range(args.repeats):
            got, n, wall = worker.submit(_baseline, served, prompts, args.max_tokens).result()
            texts = texts if texts is not None else got
            walls[settings[0]].append(wall)
            tokens[settings[0]], same[settings[0]] = n, same[settings[0]] and got == texts
            for name, c in zip(settings[1:], args.concurrency):
                got, n, wall = _clients(base, served.name, prompts, args.max_tokens, c)
                walls[name].append(wall)
                tokens[name], same[name] = n, same[name] and got == texts
    rows = [{"setting": name, "requests_s": len(prompts) / statistics.median(walls[name]),
             "tokens_s": tokens[name] / statistics.median(walls[name]), "same_texts": same[name]}
            for name in settings]
    base_tps = rows[0]["tokens_s"]
    print(f"{served.name}, decoding_strategy={served.default_strategy!r}, {len(prompts)} prompts, "
          f"max_tokens={args.max_tokens}; {platform.processor() or platform.machine()}, "
          f"torch threads {torch.get_num_threads()}")
    print("| setting | requests/s | tokens/s | vs one at a time | same texts |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['requests_s']:.2f} | {r['tokens_s']:.1f} | {r['tokens_s'] / base_tps:.2f}x | "
              f"{'yes' if r['same_texts'] else 'NO'} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hf_dllm_spec.serving.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint (default: the bundled model)")
    parser.add_argument("--draft-model", default=None, metavar="PATH")
    parser.add_argument("--strategy", default=None, help="default: the model's stored strategy")
    parser.add_argument("--num-prompts", type=int, default=16, help="held-out arithmetic prompts (default 16)")
    parser.add_argument("--max-tokens", type=int, default=32, help="default 32")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="default 1 4 16")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of every setting; the median "
                                                               "wall time is reported (default 3)")
    args = parser.parse_args(argv)
    if min(args.num_prompts, args.max_tokens, args.repeats, *args.concurrency) < 1:
        parser.error("--num-prompts, --max-tokens, --repeats and --concurrency must be >= 1")
    run(args)


if __name__ == "__main__":
    main()
