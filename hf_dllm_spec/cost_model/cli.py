"""Command line of the cost model (`python benchmarks/cost_model.py`): run the phases the arguments ask for and
write `<out>/<name>.json`, `.md` and `.png` (docs/performance.md lists the commands)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

from hf_dllm_spec.jobs.evaluation import ROOT

from .count import GROUPS, count_phase, default_rows
from .measure import STATS, time_phase
from .predict import predict_phase
from .report import json_ready, load_average, machine_description, markdown, plot, run_name
from .shapes import DTYPES, QUANTS, SCALES

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cost_model"
DESCRIPTION = ("Cost model: predict tokens/s of every decoding strategy at real model scale from forward widths "
               "and timings.")


def build_parser() -> argparse.ArgumentParser:
    """The command line of `benchmarks/cost_model.py` (flags documented in their help)."""
    ap = argparse.ArgumentParser(prog="cost_model.py", description=DESCRIPTION)
    ap.add_argument("--shape", default="tiny", choices=sorted(SCALES),
                    help="shapes to time: tiny (the bundled configs, random weights), 1.7b (SDAR-1.7B; SimSD "
                         "SDAR-8B + 1.7B; DEER Qwen3-8B + 0.5B drafter; Fast-dLLM v2 1.5B; LLaDA2.1-mini), 8b")
    ap.add_argument("--groups", default=",".join(GROUPS), help=f"comma list of {', '.join(GROUPS)}")
    ap.add_argument("--rows", default=None,
                    help="comma list of row labels to keep (the AR row of each group is always kept)")
    ap.add_argument("--device", default="cpu", help="device of the TIME phase: cpu, cuda, cuda:1, ...")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of the TIME phase")
    ap.add_argument("--quant", default="none", choices=QUANTS, help="bitsandbytes quantization of the TIME phase")
    ap.add_argument("--num-prompts", type=int, default=10, help="held-out arithmetic prompts per COUNT row")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--counts", default=None, metavar="JSON",
                    help="reuse the COUNT phase of a previous result file instead of running it")
    ap.add_argument("--count-only", action="store_true", help="run the COUNT phase only")
    ap.add_argument("--count-repeats", type=int, default=1,
                    help="COUNT: run all rows this many times (interleaved); each row keeps its fastest run")
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
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="results folder")
    ap.add_argument("--no-plot", dest="plot", action="store_false")
    return ap


def main(argv: list[str] | None = None) -> dict:
    """Run the phases the arguments ask for, write `<out>/<name>.json`, `.md` and `.png`; returns the result."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    groups = [g for g in args.groups.split(",") if g]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        ap.error(f"--groups: unknown {unknown}; choose from {', '.join(GROUPS)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: CUDA is not available here; use --device cpu")
    if args.quant != "none" and args.dtype == "float32":
        ap.error(f"--quant {args.quant} with --dtype float32: quantized weights compute in bf16/fp16; pass "
                 "--dtype bfloat16")
    started = time.perf_counter()
    start_load = load_average()
    if args.counts:
        count = json.loads(pathlib.Path(args.counts).read_text())["count"]
        missing = sorted(set(groups) - {r["group"] for r in count["rows"]})
        if missing:
            ap.error(f"--counts {args.counts} has no rows of groups {missing}; rerun without --counts or pass "
                     "--groups with the groups it has")
    else:
        rows = [r for r in default_rows() if r.group in groups]
        if args.rows:
            keep = set(args.rows.split(","))
            rows = [r for r in rows if r.strategy == "ar" or r.label in keep]
        count = count_phase(rows, args.num_prompts, args.max_new_tokens, args.seed, repeats=args.count_repeats)
    count_s = time.perf_counter() - started
    count_load = load_average()
    if args.rows and args.counts:
        keep = set(args.rows.split(","))
        count = dict(count, rows=[r for r in count["rows"] if r["strategy"] == "ar" or r["label"] in keep])
    if args.counts:
        count = dict(count, source=str(args.counts))
    dtype_name = args.dtype
    meta = {"command": "python benchmarks/cost_model.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": time.strftime("%Y-%m-%d"), "machine": machine_description(device), "shape": args.shape,
            "device": str(device), "dtype": dtype_name, "quant": args.quant, "reps": args.reps,
            "warmup": args.warmup, "stat": args.stat, "groups": groups,
            "load_average": {"start": start_load, "after_count": count_load}}
    result: dict = {"meta": meta, "count": count}
    if not args.count_only:
        t0 = time.perf_counter()
        result["time"] = time_phase(count, args.shape, groups, device, DTYPES[args.dtype], args.quant,
                                    reps=args.reps, warmup=args.warmup, max_widths=args.max_widths,
                                    context=args.context, outside_tokens=args.outside_tokens,
                                    outside_reps=args.outside_reps, seed=args.seed, stat=args.stat)
        meta["time_phase_s"] = time.perf_counter() - t0
        meta["load_average"]["after_time"] = load_average()
        result["predict"] = predict_phase(count, result["time"], args.shape, groups)
    meta["count_phase_s"] = count_s
    meta["total_s"] = time.perf_counter() - started
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "count-cpu-float32" if args.count_only else run_name(args.shape, device, dtype_name, args.quant)
    (out / f"{name}.json").write_text(json.dumps(json_ready(result), indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(result))
    written = [out / f"{name}.json", out / f"{name}.md"]
    if args.plot and not args.count_only:
        plot(result, out / f"{name}.png")
        written.append(out / f"{name}.png")
    print(markdown(result))
    print("wrote " + ", ".join(map(str, written)) + f" in {meta['total_s']:.0f} s")
    return result
