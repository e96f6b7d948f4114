"""Output of the cost model: the markdown tables, the plot, the machine description and JSON-ready results."""

from __future__ import annotations

import os
import pathlib
import platform
from collections import Counter

import torch


def _f(value, fmt: str = ".2f", none: str = "-") -> str:
    if value is None or (isinstance(value, float) and value != value):
        return none
    return format(value, fmt)


def widths_summary(forwards: list[list], top: int = 4) -> str:
    """'kind: q x n, ...' per role and kind, the `top` most frequent widths each (for the COUNT table)."""
    by: dict[tuple[str, str], Counter] = {}
    for role, kind, q, _ctx, _keep, n in forwards:
        by.setdefault((role, kind), Counter())[q] += n
    parts = []
    for (role, kind), widths in sorted(by.items()):
        common = ", ".join(f"{q}x{n}" for q, n in sorted(widths.most_common(top)))
        more = "" if len(widths) <= top else f", +{len(widths) - top} widths"
        parts.append(f"{'D ' if role == 'drafter' else ''}{kind}: {common}{more}")
    return "; ".join(parts)


def markdown(result: dict) -> str:
    """The `.md` report of a result (`cli.main`): the command and machine, the COUNT table, and the TIME and
    PREDICT tables when those phases ran."""
    meta, count, timing, predict = result["meta"], result["count"], result.get("time"), result.get("predict")
    lines = [f"# Cost model: {meta['shape']} shapes, {meta['device']}, {meta['dtype']}"
             f"{', ' + meta['quant'] if meta['quant'] != 'none' else ''}"
             f"{', ' + meta['runtime'] + ' runtime' if meta.get('runtime', 'eager') != 'eager' else ''}\n",
             f"Command: `{meta['command']}`  ", f"Machine: {meta['machine']}  ", f"Date: {meta['date']}  ",
             f"COUNT: {count['num_prompts']} held-out arithmetic prompts per row, max_new_tokens="
             f"{count['max_new_tokens']}, greedy, EOS on, bundled models, {count['device']} {count['dtype']}, "
             f"{count['threads']} threads, fastest of {count.get('repeats', 1)} interleaved run(s)"
             + (f", {count['runtime']} runtime" if count.get("runtime", "eager") != "eager" else "")
             + (f" (reused from `{count['source']}`)" if count.get("source") else "") + "\n",
             "## COUNT: bundled models, measured\n",
             "wall/CPU: wall seconds over process CPU seconds of the prompt loop (1 torch thread: 1.0 = no other "
             "process slowed the run).\n",
             "| row | tokens | NFE (target / drafter) | tokens/forward | acceptance | wall s | tok/s | wall/CPU | "
             "outside ms/step | outside share | exact match | forwards by kind (width x count) |",
             "|" + "---|" * 12]
    for r in count["rows"]:
        lines.append(f"| {r['key']} | {r['tokens']} | {r['nfe']} ({r['target_forwards']} / {r['drafter_forwards']}) "
                     f"| {r['tokens'] / max(1, r['decode_forwards']):.2f} | {_f(r['acceptance_rate'])} | "
                     f"{r['wall_time_s']:.2f} | {r['tokens'] / r['wall_time_s']:.1f} | "
                     f"{_f(r.get('call_cpu_s') and r['call_wall_s'] / r['call_cpu_s'])} | "
                     f"{r['outside_s_per_step'] * 1e3:.2f} | {r['overhead_fraction']:.0%} | {r['accuracy']:.0f}% | "
                     f"{widths_summary(r['forwards'])} |")
    if timing:
        lines += ["", f"## TIME: one forward, {meta.get('stat', 'median')} of {meta['reps']} after {meta['warmup']} "
                  "warm-up\n",
                  f"Load averages (1/5/15 min) at start, after COUNT, after TIME: {meta['load_average'].get('start')}, "
                  f"{meta['load_average'].get('after_count')}, {meta['load_average'].get('after_time')}\n"]
        if timing.get("runtime") == "static":
            lines += ["Runtime: static (each width run as `StaticModelRunner.forward` runs it: padded to its width "
                      "bucket, read-only over the stored context; CUDA: captured graphs replayed, CPU: eager).\n"]
        elif timing.get("runtime") == "compiled":
            lines += ["Runtime: compiled (the static runtime with `compile_config=CompileConfig()`: each width run as "
                      "`StaticModelRunner.forward` runs it, compiled by `torch.compile` where transformers' rule "
                      "compiles (a GPU); the outside time with the same `compile_config`).\n"]
        lines += [
                  "| shape | params | build s | cache length | wall/CPU | cached forward ms by query width q | "
                  "prefill ms by q (empty cache) |", "|---|---|---|---|---|---|---|"]
        for name, info in timing["shapes"].items():
            if info["skipped"]:
                lines.append(f"| {name} | {info['params'] / 1e6:.1f}M | - | - | - | skipped: {info['skipped']} | |")
                continue
            cached = ", ".join(f"{q}: {s * 1e3:.2f}" for q, s in sorted((int(k), v) for k, v in info["cached"].items()))
            uncached = ", ".join(f"{q}: {s * 1e3:.2f}"
                                 for q, s in sorted((int(k), v) for k, v in info["uncached"].items()))
            lines.append(f"| {name} | {info['params'] / 1e6:.1f}M | {_f(info.get('build_s'), '.1f')} | "
                         f"{info['context']} | {_f(info.get('wall_over_cpu'))} | {cached or '-'} | {uncached or '-'} |")
    if predict:
        tiny = meta["shape"] == "tiny"
        lines += ["", "## PREDICT: tokens/s = tokens / (sum of t(q) over recorded forwards + steps x outside)\n",
                  "efficiency = speedup over AR / forward-count ratio over AR (forwards per token, all models; "
                  "'target' uses target-model forwards only). Measured: COUNT wall times of the bundled models.\n",
                  "| row | shapes (target / drafter) | pred. forward s | pred. outside s | pred. tok/s | "
                  + ("measured tok/s | pred./meas. | " if tiny else "") +
                  "pred. speedup | forward ratio | pred. efficiency | pred. eff. (target) | measured speedup | "
                  "measured efficiency | measured eff. (CPU time) |",
                  "|" + "---|" * (14 if tiny else 12)]
        for e in predict:
            p, m = e.get("predicted", {}), e["measured"]
            pt = e.get("predicted_target_only", {})
            shapes = e["target_shape"] + (f" / {e['drafter_shape']}" if e["drafter_shape"] else "")
            ptps = e.get("predicted_tokens_per_s")
            lines.append(
                f"| {e['key']} | {shapes} | {_f(e.get('predicted_forward_s'), '.3f')} | "
                f"{_f(e.get('predicted_outside_s'), '.3f')} | {_f(ptps, '.1f')} | "
                + (f"{e['measured_tokens_per_s']:.1f} | {_f(ptps and ptps / e['measured_tokens_per_s'])} | "
                   if tiny else "")
                + f"{_f(p.get('speedup'))}x | {_f(m['forward_ratio'])} | {_f(p.get('efficiency'))} | "
                  f"{_f(pt.get('efficiency'))} | {m['speedup']:.2f}x | {_f(m['efficiency'])} | "
                  f"{_f(e.get('measured_cpu_time', {}).get('efficiency'))} |")
    if result.get("targets"):
        lines += targets_markdown(result)
    return "\n".join(lines) + "\n"


def _verdict(met: bool | None) -> str:
    return "-" if met is None else ("met" if met else "not met")


def _ms(seconds: float | None) -> str:
    return _f(seconds * 1e3 if seconds is not None else None)


def baselines_markdown(timing: dict) -> list[str]:
    """The AR baselines of a static-runtime run: per shape, the model timed, whether it was compiled, the decode
    step and the whole call per token."""
    lines = ["### AR baselines (same process)\n",
             "Stock step: (t(N new tokens) - t(1)) / (N - 1) of greedy `generate(cache_implementation=\"static\")`, "
             "EOS off, after a warm-up call (on CUDA the compilation): one decode step, prefill excluded. "
             "Whole call: t(N) / N, prefill included.\n",
             "| shape | baseline | model timed | compiled | why | stock step ms | whole call ms/token | N |",
             "|---|---|---|---|---|---|---|---|"]
    for name, b in timing.get("baselines", {}).items():
        if "skipped" in b:
            lines.append(f"| {name} | skipped: {b['skipped']} | {b.get('shape', '-')} | - | - | - | - | - |")
            continue
        compiled = {True: "yes", False: "no", None: "unknown"}[b["compiled"]]
        timed = b["shape"] if b["shape"] != name else f"{b['class']} (this shape)"
        lines.append(f"| {name} | {b['baseline']} | {timed} | {compiled} | {b['compile_note']}"
                     + (f"; {b['note']}" if b.get("note") else "")
                     + f" | {_ms(b['step_s'])} | {_ms(b['per_token_s'])} | {b['new_tokens']} |")
    return lines


def targets_markdown(result: dict) -> list[str]:
    """The targets section of a static-runtime run (`result["targets"]`, `predict.targets_phase`): baselines,
    forward widths against the stock step, outside share, predicted tokens/s against stock, end to end."""
    targets, timing, count = result["targets"], result["time"], result["count"]
    limits = targets["limits"]
    runtime = "static runtime, compile_config=CompileConfig()" if timing.get("runtime") == "compiled" \
        else "static runtime"
    lines = ["", f"## Targets (issue 25): {runtime} against stock transformers, same process\n"]
    lines += baselines_markdown(timing)
    lines += ["", f"### Forward widths: ms per forward / stock step (target <= {limits['width_ratio_at_most']} up to "
              f"width {limits['max_width']})\n",
              "| shape | curve | q | ms/forward | stock step ms | ratio | target | met? |",
              "|---|---|---|---|---|---|---|---|"]
    for w in targets["widths"]:
        lines.append(f"| {w['shape']} | {w['curve']} | {w['q']} | {_ms(w['seconds'])} | {_ms(w['stock_step_s'])} | "
                     f"{_f(w['ratio'])} | {'<= ' + str(w['target']) if w['target'] else '-'} | {_verdict(w['met'])} |")
    lines += ["", f"### Outside forwards per decoding step (target <= {limits['outside_share_at_most']:.0%} of a "
              "step)\n",
              "share = outside / (outside + predicted forward ms per decoding step); outside: the library's "
              "`generate` with `cache_implementation=\"static\"` on the random-weight models.\n",
              "| row | outside ms/step | forward ms/step | share | target | met? |", "|---|---|---|---|---|---|"]
    for o in targets["outside"]:
        lines.append(f"| {o['key']} | {_ms(o['outside_s_per_step'])} | {_ms(o['forward_s_per_step'])} | "
                     f"{_f(o['share'], '.1%')} | <= {o['target']:.0%} | {_verdict(o['met'])} |")
    lines += ["", f"### Predicted tokens/s against stock AR (target >= {limits['speedup_over_stock_at_least']}"
              f"x for {', '.join(limits['speedup_strategies'])})\n",
              "stock tok/s = 1000 / stock step ms of the row's target shape (prefill excluded; the prediction "
              "includes the row's prefill forwards); the baselines table says whether transformers compiled it.\n",
              "| row | target shape | pred. tok/s | stock tok/s | ratio | target | met? |",
              "|---|---|---|---|---|---|---|"]
    for r in targets["strategies"]:
        lines.append(f"| {r['key']} | {r['target_shape']} | {_f(r['predicted_tokens_per_s'], '.1f')} | "
                     f"{_f(r['stock_tokens_per_s'], '.1f')} | {_f(r['ratio'])} | "
                     f"{'>= ' + str(r['target']) if r['target'] else '-'} | {_verdict(r['met'])} |")
    runtime = f"{count.get('device', 'cpu')}, {count.get('runtime', 'eager')} runtime"
    lines += ["", f"### End to end, bundled models (COUNT on {runtime}; target efficiency >= "
              f"{limits['efficiency_at_least']})\n",
              "efficiency = measured wall speedup over the library's AR / forward-count ratio.\n",
              "| row | measured speedup | forward ratio | measured efficiency | target | met? |",
              "|---|---|---|---|---|---|"]
    for e in targets["end_to_end"]:
        lines.append(f"| {e['key']} | {_f(e['speedup'])}x | {_f(e['forward_ratio'])} | {_f(e['efficiency'])} | "
                     f">= {e['target']} | {_verdict(e['met'])} |")
    return lines



def plot(result: dict, path: pathlib.Path) -> None:
    """Left: forward time vs query width per shape (solid: cached, dashed: prefill). Right: predicted (and, at the
    tiny shape, measured) tokens/s per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5))
    for i, (name, info) in enumerate(result["time"]["shapes"].items()):
        color = f"C{i % 10}"
        for key, style in (("cached", "-o"), ("uncached", "--s")):
            pts = sorted((int(q), s) for q, s in info[key].items())
            if pts:
                left.plot([q for q, _ in pts], [s * 1e3 for _, s in pts], style, color=color, ms=4,
                          label=f"{name} ({'ctx ' + str(info['context']) if key == 'cached' else 'prefill'})")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("query width q (tokens)")
    left.set_ylabel("one forward (ms)")
    left.set_title("forward time vs query width")
    left.grid(alpha=0.3, which="both")
    left.legend(fontsize=7)
    rows = result["predict"]
    y = range(len(rows))
    pred = [e.get("predicted_tokens_per_s") or 0.0 for e in rows]
    right.barh([v + 0.2 for v in y], pred, height=0.4, color="tab:red", label="predicted")
    if result["meta"]["shape"] == "tiny":
        right.barh([v - 0.2 for v in y], [e["measured_tokens_per_s"] for e in rows], height=0.4, color="tab:gray",
                   label="measured (bundled models)")
    right.set_yticks(list(y), [e["key"] for e in rows], fontsize=7)
    right.invert_yaxis()
    right.set_xlabel("tokens/s")
    right.set_title(f"tokens/s per strategy ({result['meta']['shape']} shapes)")
    right.legend(fontsize=8)
    right.grid(alpha=0.3, axis="x")
    meta = result["meta"]
    fig.suptitle(f"Cost model, {meta['device']} {meta['dtype']}"
                 f"{' ' + meta['quant'] if meta['quant'] != 'none' else ''}, {meta['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (other processes on a shared machine), or None where unavailable."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_description(device: torch.device) -> str:
    """One line for the report: the GPU name, or the CPU with its cores and torch threads; torch, transformers
    and Python versions."""
    if device.type == "cuda":
        what = torch.cuda.get_device_name(device)
    else:
        what = f"{platform.machine()} CPU, {os.cpu_count()} cores (nproc), {torch.get_num_threads()} torch threads"
    import transformers

    return (f"{what}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"Python {platform.python_version()}")


def run_name(shape: str, device: torch.device, dtype: str, quant: str, runtime: str, count: dict,
             groups: tuple[str, ...], all_groups: tuple[str, ...], count_only: bool = False) -> str:
    """Output file stem, naming what ran, so that a run of other settings never writes over another's files.

    `<shape>-<device type>-<dtype>[-<quant>][-static|-compiled]`, then `-count-<device type>-<runtime>` when the
    COUNT phase (`count`) ran elsewhere than on the CPU's eager runtime; with `count_only`,
    `count-<device type>-float32[-<runtime>]`. Then `-<group>+<group>...` when `groups` are fewer than
    `all_groups`, and `-rows` when `count` keeps a `--rows` subset.
    """
    count_device, count_runtime = torch.device(count.get("device", "cpu")).type, count.get("runtime") or "eager"
    if count_only:
        name = f"count-{count_device}-float32" + (f"-{count_runtime}" if count_runtime != "eager" else "")
    else:
        name = (f"{shape}-{device.type}-{dtype}" + (f"-{quant}" if quant != "none" else "")
                + (f"-{runtime}" if runtime != "eager" else ""))
        if (count_device, count_runtime) != ("cpu", "eager"):
            name += f"-count-{count_device}-{count_runtime}"
    if set(groups) != set(all_groups):
        name += "-" + "+".join(groups)
    return name + ("-rows" if count.get("rows_kept") else "")


def json_ready(obj):
    """`obj` with string keys everywhere, tuples as lists and NaN as None (strict JSON)."""
    if isinstance(obj, dict):
        return {str(k): json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return None
    return obj
