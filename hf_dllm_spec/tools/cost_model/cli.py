"""Command line of the cost model (`python benchmarks/cost_model.py`, and `hf-dllm-spec bench-gpu` with GPU
defaults): run the phases the arguments ask for and write `<out>/<name>.json`, `.md` and `.png`
(docs/performance.md lists the commands)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

from hf_dllm_spec.cli_args import UsageError, did_you_mean, positive_int, torch_device
from hf_dllm_spec.tools.jobs.evaluation import ROOT

from .count import GROUPS, RUNTIMES, count_phase, default_rows
from .measure import STATS, time_phase
from .predict import predict_phase, targets_phase
from .report import json_ready, load_average, machine_description, markdown, plot, run_name
from .shapes import DTYPES, QUANTS, SCALES

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cost_model"
DESCRIPTION = ("Cost model: predict tokens/s of every decoding strategy at real model scale from forward widths "
               "and timings.")
#: What to tell a user without CUDA who asked for it (`run`'s device check).
CPU_HINT = "use --device cpu (and --count-device cpu)"


def add_arguments(ap: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """Every flag of the cost model, on `ap` (flags documented in their help); `defaults` overrides the defaults
    by destination name (`hf-dllm-spec bench-gpu`: cuda, bfloat16, the static runtime, ...)."""
    ap.add_argument("--shape", default="tiny", choices=sorted(SCALES),
                    help="shapes to time: tiny (the bundled configs, random weights), 1.7b (SDAR-1.7B; SimSD "
                         "SDAR-8B + 1.7B; DEER Qwen3-8B + 0.5B drafter; Fast-dLLM v2 1.5B; LLaDA2.1-mini), 8b")
    ap.add_argument("--groups", default=",".join(GROUPS), help=f"comma list of {', '.join(GROUPS)}")
    ap.add_argument("--rows", default=None,
                    help="comma list of row labels to keep (the AR row of each group is always kept)")
    ap.add_argument("--device", default="cpu", help="device of the TIME phase: cpu, cuda, cuda:1, ...")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of the TIME phase")
    ap.add_argument("--quant", default="none", choices=QUANTS, help="bitsandbytes quantization of the TIME phase")
    ap.add_argument("--runtime", default="eager", choices=RUNTIMES,
                    help="how the TIME phase runs each width: eager (ModelRunner-style forward over a DynamicCache; "
                         "the default of cost_model.py), static (the static runtime's StaticModelRunner: CUDA-graph "
                         "replays on a GPU) or compiled (the static runtime with compile_config=CompileConfig(): "
                         "forwards and steps compiled by torch.compile on a GPU, a compilation per width and step "
                         "shape first); static and compiled also measure the stock transformers AR baseline and "
                         "print the targets")
    ap.add_argument("--num-prompts", type=positive_int, default=10, help="held-out arithmetic prompts per COUNT row")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--counts", default=None, metavar="JSON",
                    help="reuse the COUNT phase of a previous result file instead of running it")
    ap.add_argument("--count-only", action="store_true", help="run the COUNT phase only")
    ap.add_argument("--count-repeats", type=int, default=1,
                    help="COUNT: run all rows this many times (interleaved); each row keeps its fastest run")
    ap.add_argument("--count-device", default="cpu",
                    help="device of the COUNT phase (the bundled models, fp32): cpu, cuda, ... (default: cpu for "
                         "cost_model.py, --device for bench-gpu)")
    ap.add_argument("--count-runtime", default="eager", choices=RUNTIMES,
                    help="runtime of the COUNT phase: eager (the default of cost_model.py), static "
                         "(cache_implementation='static': the measured speedups and efficiencies are then those of "
                         "the static runtime) or compiled (the same with compile_config=CompileConfig())")
    ap.add_argument("--reps", type=int, default=5, help="timed repeats per width (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed repeats per width")
    ap.add_argument("--stat", default="median", choices=sorted(STATS),
                    help="summary of the timed repeats (min: for a shared machine, where other processes inflate "
                         "some repeats)")
    ap.add_argument("--max-widths", type=int, default=12,
                    help="at most this many cached widths per shape (half as many prefill widths); the rest is "
                         "interpolated")
    ap.add_argument("--context", type=int, default=None,
                    help="cache length of the cached timings; default: the median context the COUNT phase saw")
    ap.add_argument("--outside-tokens", type=int, default=16,
                    help="tokens generated (at least one block) to measure the time outside forwards per step")
    ap.add_argument("--outside-reps", type=int, default=2)
    ap.add_argument("--stock-tokens", type=int, default=64,
                    help="--runtime static or compiled: new tokens of the timed AR baseline calls (>= 2)")
    ap.add_argument("--stock-reps", type=int, default=3,
                    help="--runtime static or compiled: timed pairs of AR baseline calls (N tokens, 1 token)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="results folder")
    ap.add_argument("--no-plot", dest="plot", action="store_false")
    if defaults:
        ap.set_defaults(**defaults)


def build_parser() -> argparse.ArgumentParser:
    """The command line of `benchmarks/cost_model.py`."""
    ap = argparse.ArgumentParser(prog="cost_model.py", description=DESCRIPTION)
    add_arguments(ap)
    return ap


def _check_devices(args: argparse.Namespace, cpu_hint: str) -> torch.device:
    """The TIME device; a device torch cannot parse, or a CUDA device asked for (--device, --count-device) where none
    exists, is a usage error (:func:`~hf_dllm_spec.cli_args.torch_device`)."""
    fix = f"run on a GPU machine, or {cpu_hint}"
    device = torch_device("--device", args.device, fix)
    torch_device("--count-device", args.count_device, fix)
    return device


def _check_arguments(args: argparse.Namespace, groups: list[str]) -> None:
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        raise UsageError("--groups", f"unknown {unknown}; choose from {', '.join(GROUPS)}")
    if args.quant != "none" and args.dtype == "float32":
        raise UsageError("--quant", f"{args.quant} with --dtype float32: quantized weights compute in bf16/fp16; pass "
                                    "--dtype bfloat16")
    for flag in ("--max-new-tokens", "--count-repeats", "--reps", "--max-widths", "--outside-tokens", "--outside-reps",
                 "--stock-reps"):
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value < 1:
            raise UsageError(flag, f"must be >= 1 (got {value})")
    if args.warmup < 0:
        raise UsageError("--warmup", f"must be >= 0 (got {args.warmup})")
    if args.runtime != "eager" and args.stock_tokens < 2:
        raise UsageError("--stock-tokens", f"{args.stock_tokens}: the AR baseline's step is (t(N) - t(1)) / (N - 1); "
                                           "pass 2 or more")


def _kept_labels(text: str, labels: set[str]) -> set[str]:
    """The labels of `--rows` (a comma list), each one of `labels` (the rows of the chosen groups).

    Raises:
        UsageError: a label that names no row, with the closest one.
    """
    keep = {label.strip() for label in text.split(",") if label.strip()}
    if not keep:
        raise UsageError("--rows", f"{text!r} names no row; pass labels of: {', '.join(sorted(labels))}")
    unknown = sorted(keep - labels)
    if unknown:
        raise UsageError("--rows", f"no row is labelled {unknown[0]!r}{did_you_mean(unknown[0], labels)}; the rows "
                                   f"of these groups: {', '.join(sorted(labels))}")
    return keep


def _count(args: argparse.Namespace, groups: list[str]) -> dict:
    """The COUNT phase: run it, or read it from `--counts` (with `--rows` applied)."""
    if args.counts:
        count = json.loads(pathlib.Path(args.counts).read_text())["count"]
        missing = sorted(set(groups) - {r["group"] for r in count["rows"]})
        if missing:
            raise UsageError("--counts", f"{args.counts} has no rows of groups {missing}; rerun without --counts or "
                                         "pass --groups with the groups it has")
        if args.rows:
            keep = _kept_labels(args.rows, {r["label"] for r in count["rows"] if r["group"] in groups})
            count = dict(count, rows=[r for r in count["rows"] if r["strategy"] == "ar" or r["label"] in keep],
                         rows_kept=sorted(keep))
        return dict(count, source=str(args.counts))
    rows = [r for r in default_rows() if r.group in groups]
    if args.rows:
        keep = _kept_labels(args.rows, {r.label for r in rows})
        rows = [r for r in rows if r.strategy == "ar" or r.label in keep]
    count = count_phase(rows, args.num_prompts, args.max_new_tokens, args.seed, repeats=args.count_repeats,
                        device=args.count_device, runtime=args.count_runtime)
    return dict(count, rows_kept=sorted(keep)) if args.rows else count


def run(args: argparse.Namespace, command: str, cpu_hint: str = CPU_HINT) -> dict:
    """Run the phases `args` ask for (parsed by a parser of :func:`add_arguments`), write `<out>/<name>.json`,
    `.md` and `.png`, print the tables; returns the result.

    Args:
        command (`str`): the command line, recorded in the report.
        cpu_hint (`str`): what the error for a missing CUDA device suggests instead.

    Raises:
        UsageError: a bad argument (the flag, the value, the rule and the fix).
    """
    if args.threads:
        torch.set_num_threads(args.threads)
    groups = [g for g in args.groups.split(",") if g]
    _check_arguments(args, groups)
    device = _check_devices(args, cpu_hint)
    started = time.perf_counter()
    start_load = load_average()
    count = _count(args, groups)
    count_s = time.perf_counter() - started
    count_load = load_average()
    dtype_name = args.dtype
    meta = {"command": command, "date": time.strftime("%Y-%m-%d"), "machine": machine_description(device),
            "shape": args.shape, "device": str(device), "dtype": dtype_name, "quant": args.quant, "reps": args.reps,
            "warmup": args.warmup, "stat": args.stat, "groups": groups,
            "load_average": {"start": start_load, "after_count": count_load}}
    if args.runtime != "eager":
        meta["runtime"] = args.runtime
    result: dict = {"meta": meta, "count": count}
    if not args.count_only:
        t0 = time.perf_counter()
        static = {"runtime": args.runtime, "stock_tokens": args.stock_tokens, "stock_reps": args.stock_reps} \
            if args.runtime != "eager" else {}
        result["time"] = time_phase(count, args.shape, groups, device, DTYPES[args.dtype], args.quant,
                                    reps=args.reps, warmup=args.warmup, max_widths=args.max_widths,
                                    context=args.context, outside_tokens=args.outside_tokens,
                                    outside_reps=args.outside_reps, seed=args.seed, stat=args.stat, **static)
        meta["time_phase_s"] = time.perf_counter() - t0
        meta["load_average"]["after_time"] = load_average()
        result["predict"] = predict_phase(count, result["time"], args.shape, groups)
        if static:
            result["targets"] = targets_phase(count, result["time"], result["predict"], args.shape)
    meta["count_phase_s"] = count_s
    meta["total_s"] = time.perf_counter() - started
    _write(result, args, device)
    return result


def _write(result: dict, args: argparse.Namespace, device: torch.device) -> None:
    """`<out>/<name>.json`, `.md` and (unless --no-plot or --count-only) `.png`; print the tables and the paths."""
    meta = result["meta"]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = run_name(args.shape, device, args.dtype, args.quant, args.runtime, result["count"],
                    tuple(meta["groups"]), GROUPS, count_only=args.count_only)
    (out / f"{name}.json").write_text(json.dumps(json_ready(result), indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(result))
    written = [out / f"{name}.json", out / f"{name}.md"]
    if args.plot and not args.count_only:
        plot(result, out / f"{name}.png")
        written.append(out / f"{name}.png")
    print(markdown(result))
    print("wrote " + ", ".join(map(str, written)) + f" in {meta['total_s']:.0f} s")


def main(argv: list[str] | None = None) -> dict:
    """`benchmarks/cost_model.py`: parse, :func:`run`; a bad argument exits with status 2 and one line."""
    ap = build_parser()
    args = ap.parse_args(argv)
    command = "python benchmarks/cost_model.py " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        return run(args, command)
    except UsageError as err:
        ap.error(str(err))
