"""Benchmark: one batched `generate` call against the same prompts decoded one at a time, in one process.

    hf-dllm-spec bench-batch                             # bundled model, 8 prompts per set, 3 repeats
    hf-dllm-spec bench-batch --batch-size 8 --repeats 5 --out benchmarks/results

(`./run.sh bench-batch ...` sets up the virtual environment and runs the same.)

For every strategy at its best setting on the bundled model (benchmarks/results/sweep.md) and for two prompt
sets of different lengths (held-out arithmetic, HumanEval), it decodes the `--batch-size` prompts as one
left-padded batch and as sequential batch-1 calls, checks that the tokens are identical, and reports generated
tokens per second of both and their ratio (the median over `--repeats` alternating runs). This is a
measurement, not a test: numbers depend on the machine; record the machine and command next to them.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time

import torch
from tqdm import tqdm

import model_patches

from ...cli_args import UsageError, add_dtype_argument, positive_int
from .evaluation import StrategySpec, arithmetic_prompts, humaneval_prompts
from . import add_model_argument, job_main, load_checkpoint, make_out_dir

DESCRIPTION = __doc__.split("\n\n")[0]

#: Each strategy at its best setting in the batch-1 sweep (benchmarks/results/sweep.md).
SPECS = [
    StrategySpec("AR", "ar"),
    StrategySpec("dynamic 0.9, B=4", "block_diffusion", {"block_size": 4, "confidence_threshold": 0.9}),
    StrategySpec("S2D2 always-verify + AR cache, B=16", "s2d2",
                 {"block_size": 16, "confidence_threshold": 0.9, "min_ssd_span_length": 1, "cache_ver": True,
                  "draft_ver": True}),
]


def decode(model, ids, mask, spec: StrategySpec, max_new_tokens: int):
    """One `generate` call; returns (new tokens per row as lists, generated tokens, wall seconds)."""
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, decoding_strategy=spec.decoding_strategy,
                         max_new_tokens=max_new_tokens, return_dict_in_generate=True, **spec.params)
    wall = time.perf_counter() - t0
    width = ids.shape[1]
    rows = [out.sequences[i, width:width + s.num_generated_tokens].tolist()
            for i, s in enumerate(out.spec_stats_per_row)]
    return rows, out.spec_stats.num_generated_tokens, wall


def compare(model, tokenizer, texts: list[str], spec: StrategySpec, max_new_tokens: int, repeats: int) -> dict:
    """Decode `texts` as one left-padded batch and as sequential batch-1 calls, `repeats` times in alternation.

    Args:
        model, tokenizer: the loaded checkpoint; the tokenizer pads on the left.
        texts (`list[str]`): the prompts.
        spec (`StrategySpec`): the strategy and its parameters.
        max_new_tokens (`int`): the budget per prompt.
        repeats (`int`): runs of each of the two settings.

    Returns:
        `dict`: "label" (`spec.label`), "batch_tps" and "sequential_tps" (generated tokens per second, median over
        the runs), "ratio" (batch / sequential), "tokens" (generated tokens of the last batched run).

    Raises:
        SystemExit: when the batch decodes other tokens than the single calls (with the spec's label).
    """
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    singles = [tokenizer(t, return_tensors="pt") for t in texts]
    batch_tps, seq_tps = [], []
    for _ in range(repeats):
        rows, tokens, wall = decode(model, batch.input_ids, batch.attention_mask, spec, max_new_tokens)
        batch_tps.append(tokens / wall)
        seq_rows, seq_tokens, seq_wall = [], 0, 0.0
        for enc in singles:
            r, n, w = decode(model, enc.input_ids, enc.attention_mask, spec, max_new_tokens)
            seq_rows += r
            seq_tokens += n
            seq_wall += w
        seq_tps.append(seq_tokens / seq_wall)
        if rows != seq_rows:
            raise SystemExit(f"{spec.label}: the batch decoded other tokens than the single calls")
    b, s = statistics.median(batch_tps), statistics.median(seq_tps)
    return {"label": spec.label, "batch_tps": b, "sequential_tps": s, "ratio": b / s, "tokens": tokens}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """Add the options of `hf-dllm-spec bench-batch` to `ap`: --model, --batch-size, --repeats, --dtype, --out,
    --no-progress."""
    add_model_argument(ap)
    ap.add_argument("--batch-size", type=positive_int, default=8)
    ap.add_argument("--repeats", type=positive_int, default=3)
    add_dtype_argument(ap)
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="results folder; default: a new folder runs/bench-batch-<date>-<time> (the committed results "
                         "are written only by --out benchmarks/results)")
    ap.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no progress bars (they only show on a terminal, on stderr)")


def run(args: argparse.Namespace, argv: list[str] | None = None) -> None:
    """The batch benchmark; `argv` (the command that ran, its words) is recorded in batch.md."""
    out = make_out_dir(args.out, "bench-batch")
    tokenizer, model = load_checkpoint(args.model, getattr(torch, args.dtype))
    if not model_patches.get_patch(model).is_diffusion_lm:
        raise UsageError("--model", f"{args.model} is an autoregressive checkpoint: bench-batch compares the "
                                    "block-diffusion rows (dynamic, S2D2) batched and one by one; pass a diffusion "
                                    "checkpoint, e.g. models/sdar-tiny-arith")
    tokenizer.padding_side = "left"
    sets = {
        "held-out arithmetic": ([p.text for p in arithmetic_prompts(args.model, args.batch_size)], 48),
        "HumanEval prompts": ([p.text for p in humaneval_prompts(args.batch_size)], 64),
    }
    compare(model, tokenizer, sets["held-out arithmetic"][0][:2], SPECS[0], 8, 1)          # warm-up
    machine = f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, {args.dtype}, greedy"
    md = [f"# Batch benchmark\n\nCommand: `{shlex.join(argv or ['hf-dllm-spec', 'bench-batch'])}`  ",
          f"Machine: {machine}  ", f"Date: {time.strftime('%Y-%m-%d')}\n",
          f"Batch of {args.batch_size} left-padded prompts vs {args.batch_size} sequential batch-1 calls, same "
          f"tokens (checked); generated tokens per second, median of {args.repeats} runs.\n"]
    bar = tqdm(total=len(sets) * len(SPECS), desc="bench-batch", unit="row", leave=False,
               disable=None if args.progress else True)
    for name, (texts, max_new) in sets.items():
        md += [f"## {name} (max_new_tokens={max_new})\n",
               "| strategy | sequential tokens/s | batch tokens/s | batch / sequential |", "|---|---|---|---|"]
        for spec in SPECS:
            bar.set_postfix_str(f"{name}: {spec.label}")
            r = compare(model, tokenizer, texts, spec, max_new, args.repeats)
            bar.update()
            bar.write(f"{name:20s} {spec.label:40s} sequential {r['sequential_tps']:7.1f} tok/s   "
                      f"batch {r['batch_tps']:7.1f} tok/s   ratio {r['ratio']:.2f}x", file=sys.stdout)
            sys.stdout.flush()
            md.append(f"| {spec.label} | {r['sequential_tps']:.1f} | {r['batch_tps']:.1f} | {r['ratio']:.2f}x |")
        md.append("")
    bar.close()
    (out / "batch.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / 'batch.md'}")


def main(argv: list[str] | None = None) -> None:
    """Run `hf-dllm-spec bench-batch` with `argv` (default: `sys.argv[1:]`); returns None, and a bad argument exits
    with status 2 (:func:`~hf_dllm_spec.tools.jobs.job_main`)."""
    job_main("hf-dllm-spec bench-batch", DESCRIPTION, add_arguments, run, argv)


if __name__ == "__main__":
    main()
