"""The main job: AR, dynamic confidence decoding and S2D2 on real prompts with the bundled model.

    hf-dllm-spec main                                    # bundled model, held-out arithmetic + HumanEval prompts
    hf-dllm-spec main --prompt "def fibonacci(n):"       # your own prompt
    hf-dllm-spec main --model path/to/sdar --block-size 8 --set do_verify_policy=score_threshold
    hf-dllm-spec main --batch-size 8                     # 8 left-padded prompts per generate call
    hf-dllm-spec main --model models/qwen2-tiny-ar       # an AR target: AR vs DEER with the bundled drafter
    hf-dllm-spec main --model models/sdar-large --draft-model models/sdar-tiny-arith   # SimSD vs the target alone
    hf-dllm-spec main --model models/llada2-tiny         # LLaDA2.x decoder with / without editing, S2D2 on it

(`./run.sh main ...` sets up the virtual environment and runs the same.) Loads the model with
`AutoModelForCausalLM.from_pretrained` (no remote code) and decodes every prompt with
`model.generate(..., decoding_strategy=...)`. Prints sample generations and, per prompt set, a table of
forwards (NFE), tokens per forward, wall time, speedup and NFE against AR (run in the same process, after one
untimed warm-up call per strategy), exact-match accuracy (arithmetic) or syntax-valid rate (HumanEval), the S2D2
acceptance rate and the share of time spent outside model forwards; a legend follows each table. Every family
decodes at the block size it was trained with unless --block-size says otherwise (SDAR: `config.block_size`,
4 for the bundled model; Fast-dLLM v2: `bd_size`; LLaDA2: 32).
"""

from __future__ import annotations

import argparse
import ast

import torch

from ...cli_args import (UsageError, add_dtype_argument, did_you_mean, non_negative_int, positive_int, prompt_text,
                         suggest)
from ...strategies.registry import resolve_config
from .evaluation import Prompt, StrategySpec, arithmetic_prompts, humaneval_prompts, run as run_spec, table
from . import DEFAULT_MODEL, add_model_argument, job_main, load_checkpoint

DESCRIPTION = __doc__.split("\n\n")[0]

# S2D2 defaults of the main job: always-on verification of the first masked span with AR-like caching
# (the paper's config-B recipe for SDAR), greedy-match acceptance (deterministic at temperature 0).
S2D2_DEFAULTS = {"min_ssd_span_length": 1, "cache_ver": True, "draft_ver": True}


def parse_set(items: list[str]) -> dict:
    """`["key=value", ...]` -> `{key: value}` (values read as Python literals, else kept as text), checked as S2D2
    parameters.

    Raises:
        UsageError: an item without "=", or a key or value S2D2 refuses (the library's message, naming --set).
    """
    out = {}
    for item in items:
        if "=" not in item:
            raise UsageError("--set", f"expects KEY=VALUE (an S2D2 parameter), got {item!r}")
        key, value = item.split("=", 1)
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    try:
        resolve_config("s2d2", overrides=out)
    except ValueError as err:
        raise UsageError("--set", suggest(str(err))) from None
    return out


#: Sub-blocks of the Fast-dLLM v2 family (its decoder and S2D2 on it), with separate block writes.
SUB_BLOCKS = {"sub_block_size": 8, "fuse_cache_write": False}


#: DEER's drafter for an AR target when --draft-model is not given: the bundled D2A-aligned drafter.
DEFAULT_DRAFTER = DEFAULT_MODEL.parent / "deer-drafter-tiny"


#: The rows `--strategies` may name (the keys of :func:`specs`).
STRATEGY_NAMES = ("ar", "static", "dynamic", "s2d2", "fast_dllm_v2", "deer", "simsd", "llada2.0", "llada2",
                  "llada2-quality", "s2d2-llada2", "simsd-dynamic")


def check_strategy_names(names: list[str], known=STRATEGY_NAMES) -> None:
    """Raise `UsageError` (naming --strategies, with the closest name) for a name not in `known`."""
    for name in names:
        if name not in known:
            raise UsageError("--strategies", f"unknown strategy {name!r}{did_you_mean(name, known)}; choose from "
                                             + ", ".join(known))


def specs(block_size: int, threshold: float, strategies: list[str], extra: dict,
          family: dict | None = None, draft_model=None, draft_block_size: int = 16) -> list[StrategySpec]:
    """The rows of the job; `family` holds parameters every block-diffusion row of this model family takes;
    `draft_model` is DEER's drafter (k = `draft_block_size`) or SimSD's (block size `block_size`)."""
    family = family or {}
    known = {
        "ar": StrategySpec("AR (block size 1)", "ar"),
        "static": StrategySpec(f"static, B={block_size}", "block_diffusion",
                               {"block_size": block_size, "remasking_strategy": "low_confidence_static"}),
        "dynamic": StrategySpec(f"dynamic tau={threshold}, B={block_size}", "block_diffusion",
                                {"block_size": block_size, "confidence_threshold": threshold}),
        "s2d2": StrategySpec(f"S2D2, B={block_size}", "s2d2",
                             {"block_size": block_size, "confidence_threshold": threshold, **S2D2_DEFAULTS, **family,
                              **extra}),
        "fast_dllm_v2": StrategySpec(f"Fast-dLLM v2 tau={threshold}, B={block_size}, SB=8", "fast_dllm_v2",
                                     {"block_size": block_size, "confidence_threshold": threshold}),
        "deer": StrategySpec(f"DEER, k={draft_block_size}", "deer", {"block_size": draft_block_size},
                             draft_model=draft_model),
        "simsd": StrategySpec(f"SimSD, B={block_size}", "simsd", {"block_size": block_size,
                                                                  "draft_block_size": block_size},
                              draft_model=draft_model),
        "llada2.0": StrategySpec(f"LLaDA2.0 tau={threshold}, B={block_size} (no editing)", "llada2",
                                 {"preset": "llada2.0", "block_size": block_size, "confidence_threshold": threshold}),
        "llada2": StrategySpec(f"LLaDA2.1 tau={threshold} / edit 0.9, B={block_size}", "llada2",
                               {"block_size": block_size, "confidence_threshold": threshold}),
        "llada2-quality": StrategySpec(f"LLaDA2.1 quality 0.7 / edit 0.5, B={block_size}", "llada2",
                                       {"preset": "llada2.1-quality", "block_size": block_size}),
        "s2d2-llada2": StrategySpec(f"S2D2 llada2.1-mini-quality, B={block_size}", "s2d2",
                                    {"preset": "llada2.1-mini-quality", "block_size": block_size, **extra}),
        "simsd-dynamic": StrategySpec(f"SimSD dynamic drafter 0.9, B={block_size}", "simsd",
                                      {"preset": "simsd-dynamic", "block_size": block_size,
                                       "draft_block_size": block_size}, draft_model=draft_model),
    }
    check_strategy_names(strategies, known)
    for needs_drafter in ("deer", "simsd", "simsd-dynamic"):
        if needs_drafter in strategies and draft_model is None:
            raise UsageError("--draft-model", f"--strategies {needs_drafter} needs --draft-model PATH (a diffusion "
                                              "drafter of the same tokenizer)")
    if "ar" not in strategies:
        strategies = ["ar", *strategies]   # the baseline every speedup is measured against
    return [known[s] for s in strategies]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """Add the options of `hf-dllm-spec main` to `ap`: the model and drafter, the strategy rows and their
    parameters, the prompt sets, the budget, seed, batch size, dtype and progress bars."""
    add_model_argument(ap)
    ap.add_argument("--prompt", action="append", default=[], type=prompt_text,
                    help="your own prompt (repeatable); skips the sets")
    ap.add_argument("--strategies", default=None,
                    help="comma list of ar, static, dynamic, s2d2, fast_dllm_v2, deer, simsd, simsd-dynamic, llada2.0, "
                         "llada2, llada2-quality, s2d2-llada2; default: ar,dynamic,s2d2 (ar,fast_dllm_v2,s2d2 on a "
                         "Fast-dLLM v2 model, ar,llada2.0,llada2,llada2-quality,s2d2-llada2 on a LLaDA2 model, "
                         "ar,deer on an AR model, ar,static,dynamic,simsd,simsd-dynamic with a diffusion --draft-model)")
    ap.add_argument("--block-size", type=positive_int, default=None,
                    help="default: the block size the model was trained with (4 for the bundled SDAR model, bd_size "
                         "for Fast-dLLM v2, 32 for LLaDA2; 32 when the config does not say)")
    ap.add_argument("--draft-model", default=None, metavar="PATH",
                    help="the drafter: DEER's for an AR --model (default: models/deer-drafter-tiny), SimSD's for a "
                         "diffusion --model (e.g. models/sdar-tiny-arith for models/sdar-large)")
    ap.add_argument("--draft-block-size", type=positive_int, default=16, help="DEER: tokens drafted per cycle (k)")
    ap.add_argument("--threshold", type=float, default=0.9, help="confidence threshold of dynamic decoding")
    ap.add_argument("--num-arith", type=non_negative_int, default=30, help="held-out arithmetic prompts (0: none)")
    ap.add_argument("--num-humaneval", type=non_negative_int, default=4, help="HumanEval prompts (0: none)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=None, help="default 48 (arithmetic), 64 (code)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra S2D2 parameter")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=positive_int, default=1, help="prompts per generate call (left-padded batch)")
    add_dtype_argument(ap)
    ap.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no progress bars (they only show on a terminal, on stderr)")


def run(args: argparse.Namespace, argv: list[str] | None = None) -> None:
    """The main job: load `--model` and the drafter (`--draft-model`, else the bundled DEER drafter for a DEER row
    on an AR model), run one untimed warm-up call per strategy row, then decode every prompt set with each row;
    print up to two sample generations and a table per set (the legend after the last). `argv` is part of the
    jobs' common signature and is not used here.

    Raises:
        UsageError: a bad `--set` or `--strategies`, no prompts at all, a checkpoint that cannot be loaded, or a
            row that needs `--draft-model` without one.
    """
    import model_patches

    dtype = getattr(torch, args.dtype)
    extra = parse_set(args.set)                   # bad --set values fail before anything loads
    if args.strategies is not None:              # an empty list too (it ran the default rows without a word)
        check_strategy_names(args.strategies.split(","))
    try:                     # every row's confidence threshold, by the library's own rule, before anything loads
        resolve_config("block_diffusion", overrides={"confidence_threshold": args.threshold})
    except ValueError as err:
        raise UsageError("--threshold", str(err)) from None
    if not args.prompt and args.num_arith == 0 and args.num_humaneval == 0:
        raise UsageError("--num-arith", "--num-arith 0 and --num-humaneval 0 leave no prompts; pass a count > 0 "
                                        "or --prompt TEXT")
    tokenizer, model = load_checkpoint(args.model, dtype)
    patch = model_patches.get_patch(model)
    fast_dllm = patch.native_strategy == "fast_dllm_v2"
    autoregressive = not patch.is_diffusion_lm
    simsd = args.draft_model is not None and not autoregressive
    default = "ar,fast_dllm_v2,s2d2" if fast_dllm else ("ar,deer" if autoregressive else "ar,dynamic,s2d2")
    if patch.native_strategy == "llada2":
        default = "ar,llada2.0,llada2,llada2-quality,s2d2-llada2"
    if simsd:
        default = "ar,static,dynamic,simsd,simsd-dynamic"
    strategies = args.strategies or default
    if args.block_size is not None and set(strategies.split(",")) <= {"ar", "deer"}:
        raise UsageError("--block-size", f"{args.block_size} applies to no row of --strategies {strategies} (DEER's "
                                         "drafts are --draft-block-size): drop --block-size")
    draft_path = args.draft_model or (str(DEFAULT_DRAFTER) if autoregressive and "deer" in strategies else None)
    draft_model = load_checkpoint(draft_path, dtype, "--draft-model")[1] if draft_path else None
    block_size = args.block_size if args.block_size is not None else (patch.trained_block_size(model) or 32)
    strategy_specs = specs(block_size, args.threshold, strategies.split(","), extra,
                           SUB_BLOCKS if fast_dllm else None, draft_model, args.draft_block_size)
    if args.prompt:
        sets = {"your prompts": ([Prompt(p) for p in args.prompt], args.max_new_tokens or 64, "-")}
    else:
        sets = {
            "held-out arithmetic": (arithmetic_prompts(args.model, args.num_arith), args.max_new_tokens or 48,
                                    "exact match"),
            "HumanEval prompts": (humaneval_prompts(args.num_humaneval), args.max_new_tokens or 64, "syntax OK"),
        }
        sets = {name: value for name, value in sets.items() if value[0]}     # --num-... 0: the set is skipped
    print(f"model: {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{patch.family}, trained block size {patch.trained_block_size(model)}, "
          f"mask id {patch.mask_token_id(model)}, {args.dtype})")
    warm = next(iter(sets.values()))[0][:1]
    for spec in strategy_specs:        # untimed warm-up (allocator, lazy initialisation, first-call costs)
        run_spec(model, tokenizer, warm, spec, max_new_tokens=8, seed=args.seed, progress=False)
    for index, (name, (prompts, max_new, metric)) in enumerate(sets.items()):
        results = [run_spec(model, tokenizer, prompts, spec, max_new_tokens=max_new, seed=args.seed,
                            batch_size=args.batch_size, progress=args.progress) for spec in strategy_specs]
        print(f"\n=== {name}: {len(prompts)} prompts, max_new_tokens={max_new} ===")
        for idx in range(min(2, len(prompts))):
            print(f"\n--- prompt {idx}:\n{prompts[idx].text}")
            for r in results:
                print(f"[{r.spec.label}] {r.texts[idx]!r}")
        print()
        print(table(results, results[0], metric, legend=index == len(sets) - 1))


def main(argv: list[str] | None = None) -> None:
    """Run `hf-dllm-spec main` with `argv` (default: `sys.argv[1:]`); returns None, and a bad argument exits with
    status 2 (:func:`~hf_dllm_spec.tools.jobs.job_main`)."""
    job_main("hf-dllm-spec main", DESCRIPTION, add_arguments, run, argv)


if __name__ == "__main__":
    main()
