"""Benchmark: block size x unmasking rule x S2D2 routing preset, against AR, in one process.

    hf-dllm-spec bench                              # bundled model, 50 arithmetic + 10 HumanEval prompts -> runs/
    hf-dllm-spec bench --num-arith 100 --block-sizes 4,16 --out benchmarks/results
    hf-dllm-spec bench --model models/qwen2-tiny-ar --draft-model aligned=models/deer-drafter-tiny \\
        --draft-model unaligned=models/sdar-tiny-arith   # DEER: k = 4, 8, 16, 32 per drafter, against AR
    hf-dllm-spec bench --model models/sdar-large --draft-model models/sdar-tiny-arith --block-sizes 4,8
                                                    # SimSD per block size, against the target alone
    hf-dllm-spec bench --model models/llada2-tiny   # LLaDA2.x: editing on / off, S2D2 presets, against AR

(`./run.sh bench ...` sets up the virtual environment and runs the same.)

For every prompt set (held-out arithmetic: exact match; HumanEval: syntax-valid completions) it runs AR
(block size 1), then for each block size static decoding, dynamic thresholds and the S2D2 routing presets,
all with greedy decoding (temperature 0) and EOS on. It writes `<out>/sweep.md` (one table per prompt set,
with NFE and wall-time ratios against AR measured in the same process, and the command that ran),
`<out>/sweep.json` (merged statistics), both rewritten as each row finishes (an interrupted sweep keeps its
rows), and `<out>/frontier.png` (accuracy vs wall time, the layout of S2D2's Figure 3). `<out>` is a new folder
`runs/bench-<date>-<time>` unless `--out` names one; the committed results of the project in
`benchmarks/results/` are written only by `--out benchmarks/results`. This is a measurement, not a test:
numbers depend on the machine; record the machine and command next to them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import shlex
import time

import torch

from ...cli_args import UsageError, add_dtype_argument, float_list, int_list, non_negative_int
from .evaluation import LEGEND, StrategySpec, arithmetic_prompts, humaneval_prompts, run as run_spec, table
from . import add_model_argument, job_main, load_checkpoint, make_out_dir

DESCRIPTION = __doc__.split("\n\n")[0]


def s2d2_presets(block_size: int) -> dict[str, dict]:
    """Routing presets swept for S2D2 (S2D2 §5.1 and App. A.7 policies), fallback = dynamic 0.9."""
    ar_caching = {"cache_ver": True, "draft_ver": True}
    return {
        "always-verify+ARcache": {"min_ssd_span_length": 1, **ar_caching},
        f"min-span {max(1, block_size // 2)}": {"min_ssd_span_length": max(1, block_size // 2)},
        "score c=1 static+ARcache": {"do_verify_policy": "score_threshold", "do_verify_score_threshold": 0.0,
                                     "do_verify_score_type": "difference_static", "score_penalty_coef": 1.0,
                                     "token_acceptance_estimator": "soft_entropy_negexp", **ar_caching},
        "hysteresis 1/-5": {"do_verify_policy": "score_hysteresis", "hysteresis_threshold_on": 1.0,
                            "hysteresis_threshold_off": -5.0, "score_penalty_coef": 1.0,
                            "token_acceptance_estimator": "soft_entropy_negexp"},
    }


def sweep_specs(block_sizes: list[int], thresholds: list[float]) -> list[StrategySpec]:
    """The sweep's rows for a block-diffusion model without a family decoder of its own (e.g. SDAR): AR, then per
    block size static decoding (one token per step), dynamic decoding at each threshold, and S2D2 with each routing
    preset of :func:`s2d2_presets` (fallback dynamic 0.9).

    Args:
        block_sizes (`list[int]`): the block sizes, in tokens.
        thresholds (`list[float]`): the confidence thresholds of the dynamic rows.

    Returns:
        `list[StrategySpec]`: AR first, then the rows of each block size in the order of `block_sizes`.
    """
    out = [StrategySpec("AR", "ar")]
    for b in block_sizes:
        out.append(StrategySpec(f"static B={b}", "block_diffusion",
                                {"block_size": b, "remasking_strategy": "low_confidence_static"}))
        for tau in thresholds:
            out.append(StrategySpec(f"dynamic {tau} B={b}", "block_diffusion",
                                    {"block_size": b, "confidence_threshold": tau}))
        for name, params in s2d2_presets(b).items():
            out.append(StrategySpec(f"S2D2 {name} B={b}", "s2d2",
                                    {"block_size": b, "confidence_threshold": 0.9, **params}))
    return out


def fast_dllm_v2_specs(thresholds: list[float]) -> list[StrategySpec]:
    """Fast-dLLM v2 rows (S2D2 §5.1 Table 2): AR, the family decoder (sub-blocks 4 / 8 / 32 at each threshold,
    and the AR-style B=4, SB=1 baseline), and the S2D2 presets of the family, always-verify with AR caching."""
    out = [StrategySpec("AR", "ar", {"fuse_cache_write": False})]
    for tau in thresholds:
        for sb in (4, 8, 32):
            out.append(StrategySpec(f"Fast-dLLM v2 {tau} SB={sb}", "fast_dllm_v2",
                                    {"block_size": 32, "sub_block_size": sb, "confidence_threshold": tau}))
    out.append(StrategySpec("Fast-dLLM v2 AR-style B=4 SB=1", "fast_dllm_v2", {"preset": "fast-dllm-v2-ar-style"}))
    for preset in ("config-a", "config-b", "config-b-sb8", "config-c"):
        out.append(StrategySpec(f"S2D2 {preset}", "s2d2", {"preset": f"fast-dllm-v2-{preset}"}))
    out.append(StrategySpec("S2D2 always-verify+ARcache SB=8", "s2d2",
                            {"block_size": 32, "sub_block_size": 8, "min_ssd_span_length": 1, "cache_ver": True,
                             "fuse_cache_write": False, "confidence_threshold": 0.9}))
    return out


def llada2_specs(thresholds: list[float]) -> list[StrategySpec]:
    """LLaDA2.x rows (S2D2 §5.1 Table 3, blocks of 32): AR; the family decoder per threshold without editing
    (LLaDA2.0) and with editing (LLaDA2.1, tau_edit 0.9 and the "Quality" 0.7 / 0.5); the static 1-token rule;
    S2D2 with the paper's LLaDA2.1 presets and with always-on verification, editing on."""
    out = [StrategySpec("AR", "ar")]
    for tau in thresholds:
        out += [StrategySpec(f"LLaDA2.0 {tau} (no editing)", "llada2", {"preset": "llada2.0", "block_size": 32,
                                                                       "confidence_threshold": tau}),
                StrategySpec(f"LLaDA2.1 {tau} / edit 0.9", "llada2", {"block_size": 32, "confidence_threshold": tau})]
    out += [StrategySpec("LLaDA2.1 quality 0.7 / 0.5", "llada2", {"preset": "llada2.1-quality", "block_size": 32}),
            StrategySpec("LLaDA2.1 static (1 token/step) / edit 0.9", "llada2",
                         {"preset": "llada2.1-static", "block_size": 32})]
    for preset in ("quality", "conservative"):
        out.append(StrategySpec(f"S2D2 llada2.1-mini-{preset}", "s2d2", {"preset": f"llada2.1-mini-{preset}"}))
    out.append(StrategySpec("S2D2 always-verify, quality editing", "s2d2",
                            {"preset": "llada2.1-mini-quality", "do_verify_policy": "mask_span_length",
                             "min_ssd_span_length": 1}))
    return out


def deer_specs(drafters: dict, ks: list[int]) -> list[StrategySpec]:
    """DEER rows (DEER App. B.2): AR, then k x drafter (e.g. D2A-aligned vs the unaligned starting point)."""
    out = [StrategySpec("AR", "ar")]
    for name, drafter in drafters.items():
        out += [StrategySpec(f"DEER {name} k={k}", "deer", {"block_size": k}, draft_model=drafter) for k in ks]
    return out


def simsd_specs(drafters: dict, block_sizes: list[int]) -> list[StrategySpec]:
    """SimSD rows (SimSD §4): AR, then per block size the target alone (static: one token per forward, the
    paper's baseline; dynamic 0.9) and SimSD per drafter (the paper's protocol; a dynamic drafter; the exact
    sequential + stacked variant)."""
    out = [StrategySpec("AR", "ar")]
    for b in block_sizes:
        out += [StrategySpec(f"target static B={b}", "block_diffusion",
                             {"block_size": b, "remasking_strategy": "low_confidence_static"}),
                StrategySpec(f"target dynamic 0.9 B={b}", "block_diffusion",
                             {"block_size": b, "confidence_threshold": 0.9})]
        for name, drafter in drafters.items():
            for preset in ("simsd-paper", "simsd-dynamic", "simsd-exact"):
                out.append(StrategySpec(f"SimSD {name} {preset.removeprefix('simsd-')} B={b}", "simsd",
                                        {"preset": preset, "block_size": b, "draft_block_size": b},
                                        draft_model=drafter))
    return out


def simsd_summary(results: list, metric: str) -> str:
    """Markdown table of the SimSD rows against the target alone at the same block size (same process): alpha,
    accepted drafts per block, rho, wall-time speedups over target static and dynamic decoding, accuracy."""
    by_label = {r.spec.label: r for r in results}
    lines = [f"| SimSD row | alpha | accepted per block | drafter / target forwards | rho | speedup vs target "
             f"static | speedup vs target dynamic 0.9 | {metric} (SimSD / target static) |", "|" + "---|" * 8]
    for r in results:
        if r.spec.decoding_strategy != "simsd":
            continue
        b, st = r.spec.params["block_size"], r.stats
        static, dynamic = by_label[f"target static B={b}"], by_label[f"target dynamic 0.9 B={b}"]
        blocks = st.num_committed_tokens / b
        target_forwards = st.num_forward_calls - st.num_draft_model_forwards
        lines.append(f"| {r.spec.label} | {st.acceptance_rate:.3f} | {st.num_accepted_tokens / blocks:.2f} / "
                     f"{st.num_draft_tokens / blocks:.2f} | {st.num_draft_model_forwards} / {target_forwards} | "
                     f"{st.draft_target_time_ratio:.2f} | {static.stats.wall_time_s / st.wall_time_s:.2f}x | "
                     f"{dynamic.stats.wall_time_s / st.wall_time_s:.2f}x | {r.accuracy:.1f}% / "
                     f"{static.accuracy:.1f}% |")
    return "\n".join(lines)


def frontier_plot(all_results: dict, path: pathlib.Path, model_name: str = "bundled model") -> None:
    """Accuracy vs wall time per prompt set (S2D2 Figure 3's layout), one marker per row; the rows on the
    speed / accuracy frontier and AR are labelled. Writes `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_results), figsize=(6.5 * len(all_results), 4.8), squeeze=False)
    families = {"AR": ("black", "*"), "static": ("tab:gray", "s"), "dynamic": ("tab:blue", "o"),
                "S2D2": ("tab:red", "^"), "Fast-dLLM": ("tab:blue", "o"), "DEER": ("tab:red", "^"),
                "target": ("tab:gray", "s"), "SimSD": ("tab:red", "^")}
    for ax, (name, results) in zip(axes[0], all_results.items()):
        for r in results:
            fam = r["label"].split()[0]
            color, marker = families.get(fam, ("tab:green", "x"))
            ax.scatter(r["wall_time_s"], r["accuracy"], color=color, marker=marker, s=40,
                       label=fam if fam not in ax.get_legend_handles_labels()[1] else None)
        # Labels only on the frontier (no other row is both faster and at least as accurate) and AR, stacked
        # in order of wall time with alternating offsets, so they do not overlap.
        frontier = sorted((r for r in results if r["label"] == "AR" or not any(
            o["wall_time_s"] < r["wall_time_s"] and o["accuracy"] >= r["accuracy"] for o in results)),
            key=lambda r: r["wall_time_s"])
        for i, r in enumerate(frontier):
            ax.annotate(r["label"], (r["wall_time_s"], r["accuracy"]), fontsize=6, xytext=(4, 6 + 9 * (i % 3)),
                        textcoords="offset points", arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.5"})
        ax.set_xlabel("wall time of the prompt set (s, lower is faster)")
        ax.set_ylabel(results[0]["metric"] + " (%)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Accuracy vs time ({model_name}, greedy, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


#: The lists swept when `--block-sizes` / `--thresholds` are not given.
DEFAULT_BLOCK_SIZES, DEFAULT_THRESHOLDS = "4,8,16,32", "0.9,0.7"


def _refuse_unused(args: argparse.Namespace, flag: str, rows: str) -> None:
    """A sweep option given for rows that have no such parameter is a usage error, not a silent no-op.

    Raises:
        UsageError: `flag` was given.
    """
    value = getattr(args, flag.removeprefix("--").replace("-", "_"))
    if value is not None:
        raise UsageError(flag, f"{flag} {value} does not apply to the {rows} this --model gives: drop {flag}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """Add the options of `hf-dllm-spec bench` to `ap`: the model and drafters, the prompt counts, the block sizes
    and thresholds swept, the results folder, seed, dtype and progress bars."""
    add_model_argument(ap)
    ap.add_argument("--num-arith", type=non_negative_int, default=50, help="held-out arithmetic prompts (0: none)")
    ap.add_argument("--num-humaneval", type=non_negative_int, default=10, help="HumanEval prompts (0: none)")
    ap.add_argument("--block-sizes", default=None,
                    help="comma list of block sizes >= 1 of the block-diffusion, SimSD and DEER (k) rows; default "
                         f"{DEFAULT_BLOCK_SIZES} (Fast-dLLM v2 and LLaDA2.1 keep their checkpoints' blocks)")
    ap.add_argument("--thresholds", default=None,
                    help="comma list of confidence thresholds in (0, 1] of the block-diffusion, Fast-dLLM v2 and "
                         f"LLaDA2.1 rows; default {DEFAULT_THRESHOLDS} (SimSD and DEER rows have none)")
    ap.add_argument("--draft-model", action="append", default=[], metavar="[NAME=]PATH",
                    help="drafters (repeatable): DEER drafters for an AR --model, e.g. "
                         "aligned=models/deer-drafter-tiny (the DEER rows sweep --block-sizes as k); SimSD drafters "
                         "for a diffusion --model, e.g. models/sdar-tiny-arith for models/sdar-large (SimSD rows per "
                         "block size)")
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="results folder; default: a new folder runs/bench-<date>-<time> (the committed results are "
                         "written only by --out benchmarks/results)")
    ap.add_argument("--seed", type=int, default=0)
    add_dtype_argument(ap)
    ap.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no progress bars (they only show on a terminal, on stderr)")


def run(args: argparse.Namespace, argv: list[str] | None = None) -> None:
    """The sweep; `argv` (the command that ran, its words) is recorded in sweep.md."""
    import model_patches

    dtype = getattr(torch, args.dtype)
    # bad lists fail before anything loads
    thresholds = float_list("--thresholds", DEFAULT_THRESHOLDS if args.thresholds is None else args.thresholds)
    block_sizes = int_list("--block-sizes", DEFAULT_BLOCK_SIZES if args.block_sizes is None else args.block_sizes)
    if args.num_arith == 0 and args.num_humaneval == 0:
        raise UsageError("--num-arith", "--num-arith 0 and --num-humaneval 0 leave no prompts; pass a count > 0")
    named = {}
    for item in args.draft_model:
        name, _, path = item.rpartition("=")
        name = name or pathlib.Path(path).name
        if name in named:            # the rows of both were measured with the last one, under one name
            raise UsageError("--draft-model", f"names {name!r} twice ({named[name]} and {path}); name each drafter "
                                              "once, e.g. --draft-model aligned=PATH --draft-model base=PATH")
        named[name] = path
    out_dir = make_out_dir(args.out, "bench")
    tokenizer, model = load_checkpoint(args.model, dtype)
    patch = model_patches.get_patch(model)
    drafters = {name: load_checkpoint(path, dtype, "--draft-model")[1] for name, path in named.items()}
    if not patch.is_diffusion_lm:
        if not drafters:
            raise UsageError("--draft-model", "an AR --model is benchmarked with DEER: pass --draft-model "
                                              "[NAME=]PATH (repeatable), e.g. models/deer-drafter-tiny")
        _refuse_unused(args, "--thresholds", "DEER rows (an AR --model with drafters)")
        specs = deer_specs(drafters, block_sizes)
    elif drafters:
        _refuse_unused(args, "--thresholds", "SimSD rows (a diffusion --model with drafters)")
        specs = simsd_specs(drafters, block_sizes)
    elif patch.native_strategy == "fast_dllm_v2":
        _refuse_unused(args, "--block-sizes", "Fast-dLLM v2 rows (blocks of the checkpoint's bd_size)")
        specs = fast_dllm_v2_specs(thresholds)
    elif patch.native_strategy == "llada2":
        _refuse_unused(args, "--block-sizes", "LLaDA2.1 rows (blocks of 32, as the checkpoint was trained)")
        specs = llada2_specs(thresholds)
    else:
        specs = sweep_specs(block_sizes, thresholds)
    sets = {
        "held-out arithmetic": (arithmetic_prompts(args.model, args.num_arith), 48, "exact match"),
        "HumanEval prompts": (humaneval_prompts(args.num_humaneval), 64, "syntax OK"),
    }
    sets = {name: value for name, value in sets.items() if value[0]}     # --num-... 0: the set is skipped
    # Warm-up (allocator, lazy inits) so the first timed row is not penalised.
    run_spec(model, tokenizer, next(iter(sets.values()))[0][:2], specs[0], max_new_tokens=8, seed=0, progress=False)
    print(f"writing {out_dir}/ (sweep.md and sweep.json after every row)", flush=True)
    machine = (f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
               f"{args.dtype}, batch 1, greedy")
    command = shlex.join(argv or ["hf-dllm-spec", "bench"])
    md = [f"# Benchmark sweep\n\nCommand: `{command}`  ",
          f"Machine: {machine}  ", f"Date: {time.strftime('%Y-%m-%d')}\n"]
    raw: dict = {}
    for name, (prompts, max_new, metric) in sets.items():
        results = []
        for spec in specs:
            r = run_spec(model, tokenizer, prompts, spec, max_new_tokens=max_new, seed=args.seed,
                         progress=args.progress)
            results.append(r)
            accuracy = "-" if not r.scored else f"{r.accuracy:5.1f}%"
            print(f"{name:20s} {spec.label:40s} nfe={r.stats.nfe:6d} wall={r.stats.wall_time_s:7.2f}s "
                  f"{metric}={accuracy}", flush=True)
            raw[name] = [{"label": r.spec.label, "decoding_strategy": r.spec.decoding_strategy,
                          "params": r.spec.params, "accuracy": r.accuracy, "metric": metric, **r.stats.to_dict()}
                         for r in results]
            section = [f"## {name} ({len(prompts)} prompts, max_new_tokens={max_new}, metric: {metric})\n",
                       table(results, results[0], metric), ""]
            if any(r.spec.decoding_strategy == "simsd" for r in results):
                section += ["SimSD against the target alone (accepted per block: accepted / drafted tokens per "
                            "block):\n", simsd_summary(results, metric), ""]
            # Every row is on disk as soon as it finishes: an interrupted sweep keeps what it measured.
            (out_dir / "sweep.md").write_text("\n".join(md + section + [LEGEND]) + "\n")
            (out_dir / "sweep.json").write_text(json.dumps(raw, indent=1))
        md += section
    frontier_plot(raw, out_dir / "frontier.png", pathlib.Path(args.model).name)
    print(f"wrote {out_dir / 'sweep.md'}, {out_dir / 'sweep.json'}, {out_dir / 'frontier.png'}")


def main(argv: list[str] | None = None) -> None:
    """Run `hf-dllm-spec bench` with `argv` (default: `sys.argv[1:]`); returns None, and a bad argument exits with
    status 2 (:func:`~hf_dllm_spec.tools.jobs.job_main`)."""
    job_main("hf-dllm-spec bench", DESCRIPTION, add_arguments, run, argv)


if __name__ == "__main__":
    main()
