"""`hf-dllm-spec check-gpu`: is this GPU setup on the static runtime's fast path, and does it give the eager tokens?

Three checks, in one process, on one CUDA device (a few minutes on an H100):

1. **Tokens and capture.** Every strategy row of the main job on every bundled model (SDAR, Fast-dLLM v2 with
   sub-blocks, LLaDA2.1 with editing, S2D2 on each, SimSD and DEER with their drafters), a left-padded batch of 2,
   greedy, in bfloat16 and float32: `cache_implementation="static"` with CUDA graphs (each decoding step captured
   whole, forward and maths, where the strategy's step is a function of tensors), twice (capture, then replay),
   against the same static runtime without graphs (`disable_compile=True`: the tokens must be equal in every dtype,
   graphs change nothing)
   and against the eager runtime (tokens and forward counters must be equal in float32; in bfloat16 the two
   layouts may round differently, so that comparison is reported, not required); per model and role whether its
   forwards were captured (graphs, no fallback) or why not (`spec_stats.runtime`).
2. **Memory over calls.** `calls` static calls of S2D2 on the bundled SDAR model: allocated memory and graph count
   after the second call and after the last must be equal (nothing captured twice, nothing leaked).
3. **Speed, in the same process.** A captured forward of the static runtime at widths 1-64 over a 160-token context
   of SDAR-1.7B shapes (random weights), against stock transformers' compiled AR step (`generate(
   cache_implementation="static")` on a Qwen3 model of the same dimensions): the ratio and issue 25's 1.3 target.
   These are figures, not a verdict: the exit status does not depend on them.

The exit status is 0 only when every row of 1 and 2 holds. Without CUDA the command refuses to run (exit 2).

Source: issue 32 ("`hf-dllm-spec check-gpu`").
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import time
from dataclasses import fields

import torch

from ...cli_args import torch_device
from ...validation import invalid

#: Bundled model -> (its strategy rows of the main job, its drafter): every strategy on every family.
CASES: dict[str, tuple[list[str], str | None]] = {
    "sdar-tiny-arith": (["ar", "static", "dynamic", "s2d2"], None),
    "fast-dllm-v2-tiny": (["ar", "fast_dllm_v2", "s2d2"], None),
    "llada2-tiny": (["llada2", "s2d2-llada2"], None),
    "sdar-large": (["simsd"], "sdar-tiny-arith"),
    "qwen2-tiny-ar": (["ar", "deer"], "deer-drafter-tiny"),
}
#: Statistics that are times or notes, not counters.
_NOT_COUNTERS = {"wall_time_s", "prefill_time_s", "forward_time_s", "draft_model_time_s", "warmup_time_s", "runtime"}
WIDTHS = (1, 2, 4, 8, 16, 32, 64)


def _counters(stats) -> dict:
    return {f.name: getattr(stats, f.name) for f in fields(stats) if f.name not in _NOT_COUNTERS}


def _load(name: str, dtype: torch.dtype, device: torch.device):
    from hf_dllm_spec.tools.jobs.evaluation import ROOT, load

    tokenizer, model = load(ROOT / "models" / name, dtype=dtype)
    return tokenizer, model.to(device)


def _spec(model, strategy: str, drafter):
    import model_patches
    from hf_dllm_spec.tools.jobs.main import SUB_BLOCKS, specs

    patch = model_patches.get_patch(model)
    family = SUB_BLOCKS if patch.native_strategy == "fast_dllm_v2" else None
    (spec,) = specs(patch.trained_block_size(model) or 4, 0.9, [strategy], {}, family, drafter,
                    draft_block_size=8)[-1:]
    return spec


def _generate(model, tokenizer, texts: list[str], spec, max_new_tokens: int, **kwargs):
    import hf_dllm_spec

    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True).to(model.device)
    entry = {} if isinstance(model, hf_dllm_spec.DllmGenerationMixin) else {
        "custom_generate": hf_dllm_spec.custom_generate}
    drafter = {"draft_model": spec.draft_model} if spec.draft_model is not None else {}
    return model.generate(enc.input_ids, attention_mask=enc.attention_mask, decoding_strategy=spec.decoding_strategy,
                          return_dict_in_generate=True, max_new_tokens=max_new_tokens, **entry, **spec.params,
                          **drafter, **kwargs)


def check_tokens(device: torch.device, dtype: torch.dtype, *, max_new_tokens: int = 16, on_row=None) -> list[dict]:
    """Check 1 for one dtype: one row per strategy and bundled model; `on_row(row)`, if given, is called as each
    row is done (the command prints it at once, so that a run stopped by a time limit still shows its rows).

    Returns:
        `list[dict]`: "dtype", "model", "strategy", "tokens_equal" (static == eager), "graph_equal" (the
        captured calls, the first and a second, == the static runtime with `disable_compile=True`, nothing
        captured), "counters_equal", "captured" (every model and
        role of the call captured at least one graph and none failed), "graphs" (graphs held per model and role),
        "steps" (of them, whole decoding steps: `StaticModelRunner.run_step`), "runtime" (`spec_stats.runtime`),
        "ok".
    """
    from hf_dllm_spec.tools.jobs.evaluation import ROOT, arithmetic_prompts
    from hf_dllm_spec.runtime.static import clear_static_state, static_states

    rows = []
    for name, (strategies, drafter_name) in CASES.items():
        tokenizer, model = _load(name, dtype, device)
        drafter = _load(drafter_name, dtype, device)[1] if drafter_name else None
        texts = [p.text for p in arithmetic_prompts(ROOT / "models" / name, 2)]
        for strategy in strategies:
            spec = _spec(model, strategy, drafter)
            for m in (model, drafter):
                if m is not None:
                    clear_static_state(m)
            eager = _generate(model, tokenizer, texts, spec, max_new_tokens)
            uncaptured = _generate(model, tokenizer, texts, spec, max_new_tokens, cache_implementation="static",
                                   disable_compile=True)
            static = _generate(model, tokenizer, texts, spec, max_new_tokens, cache_implementation="static")
            again = _generate(model, tokenizer, texts, spec, max_new_tokens, cache_implementation="static")
            states = [*static_states(model), *(static_states(drafter) if drafter is not None else [])]
            tokens = static.sequences.tolist() == eager.sequences.tolist()
            replayed = (static.sequences.tolist() == uncaptured.sequences.tolist()
                        and again.sequences.tolist() == uncaptured.sequences.tolist())
            counters = all(_counters(a) == _counters(b)
                           for a, b in zip(eager.spec_stats_per_row, static.spec_stats_per_row))
            captured = bool(states) and all(s.graphs.captures > 0 and s.graphs.failure is None for s in states)
            exact = dtype == torch.float32            # bfloat16 layouts may round differently: reported only
            rows.append({"dtype": str(dtype).removeprefix("torch."), "model": name, "strategy": spec.label,
                         "tokens_equal": tokens, "graph_equal": replayed, "counters_equal": counters,
                         "captured": captured, "graphs": [len(s.graphs.graphs) for s in states],
                         "steps": [sum(key[0] == "step" for key in s.graphs.graphs) for s in states],
                         "runtime": static.spec_stats.runtime,
                         "ok": replayed and captured and (not exact or (tokens and counters))})
            if on_row is not None:
                on_row(rows[-1])
        del model, drafter
        torch.cuda.empty_cache()
    return rows


def check_memory(device: torch.device, dtype: torch.dtype, *, calls: int = 50, max_new_tokens: int = 16) -> dict:
    """Check 2: `calls` static calls of S2D2 on the bundled SDAR model; allocated bytes and graph count after each.

    Returns:
        `dict`: "calls", "memory_bytes" (after the second call, after the last), "graphs" (the same two), "ok".
    """
    from hf_dllm_spec.tools.jobs.evaluation import ROOT, arithmetic_prompts
    from hf_dllm_spec.runtime.static import clear_static_state, static_states

    tokenizer, model = _load("sdar-tiny-arith", dtype, device)
    spec = _spec(model, "s2d2", None)
    texts = [p.text for p in arithmetic_prompts(ROOT / "models" / "sdar-tiny-arith", 2)]
    clear_static_state(model)
    memory, graphs = [], []
    for _ in range(calls):
        _generate(model, tokenizer, texts, spec, max_new_tokens, cache_implementation="static")
        gc.collect()                        # what is still reachable, not when Python's collector last ran
        torch.cuda.synchronize(device)
        memory.append(torch.cuda.memory_allocated(device))
        graphs.append(sum(s.graphs.captures for s in static_states(model)))
    return {"calls": calls, "memory_bytes": [memory[1], memory[-1]], "graphs": [graphs[1], graphs[-1]],
            "ok": memory[-1] == memory[1] and graphs[-1] == graphs[1]}


def check_speed(device: torch.device, *, widths=WIDTHS, compiled_widths=(), context: int = 160, reps: int = 20,
                seed: int = 0) -> dict:
    """Check 3 (figures only): seconds of a captured static-runtime forward per width over `context` stored tokens,
    SDAR-1.7B shapes in bfloat16 with random weights, and stock transformers' compiled AR step on the same
    dimensions (Qwen3ForCausalLM), in this process; for `compiled_widths`, the same forward compiled as
    `compile_config=CompileConfig()` compiles it (inductor, "reduce-overhead": the kernels stock `generate` runs;
    each width compiles first, a minute or so at these shapes).

    Returns:
        `dict`: "shape", "stock_step_s", "compiled" (transformers' own decision), "widths" (a list of {"q",
        "seconds", "ratio", "met"} with issue 25's target :data:`~hf_dllm_spec.tools.cost_model.predict.WIDTH_TARGET`),
        "compiled_widths" (the same for the compiled forwards; empty without `compiled_widths`).
    """
    from .baseline import measure_baseline
    from .measure import StaticForward, time_static_forward
    from .predict import WIDTH_TARGET
    from .shapes import SHAPES, build_model

    shape = SHAPES["SDAR-1.7B"]
    model = build_model(shape, device, torch.bfloat16, "none", seed)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    vocab = model.config.vocab_size
    context_ids = torch.randint(0, vocab, (1, context), generator=generator)
    queries = {q: torch.randint(0, vocab, (1, q), generator=generator) for q in sorted({*widths, *compiled_widths})}
    static = StaticForward(model, context_ids, context + 256)
    timed = [(q, time_static_forward(static, queries[q], q, reps=reps, warmup=3)) for q in widths]
    del static
    compiled = []
    if compiled_widths:
        from transformers import CompileConfig

        static = StaticForward(model, context_ids, context + 256, compile_config=CompileConfig())
        compiled = [(q, time_static_forward(static, queries[q], q, reps=reps, warmup=3)) for q in compiled_widths]
        del static
    baseline = measure_baseline(shape, model, device=device, dtype=torch.bfloat16, quant="none", seed=seed,
                                prompt_tokens=context, new_tokens=32, reps=5)
    step = baseline.get("step_s")

    def against_stock(times):
        return [{"q": q, "seconds": seconds, "ratio": seconds / step if step else None,
                 "met": seconds / step <= WIDTH_TARGET if step else None} for q, seconds in times]

    return {"shape": shape.name, "stock_step_s": step, "compiled": baseline.get("compiled"),
            "baseline": {k: v for k, v in baseline.items() if isinstance(v, (str, int, float, bool, type(None)))},
            "target": WIDTH_TARGET, "widths": against_stock(timed), "compiled_widths": against_stock(compiled)}


def run_check(device: torch.device, *, dtypes=(torch.bfloat16, torch.float32), calls: int = 50,
              speed: bool = True, correctness: bool = True, compiled_widths=(), on_row=None) -> dict:
    """The three checks (checks 1 and 2 unless `correctness` is False, check 3 when `speed`); "ok" is True when
    every row of checks 1 and 2 that ran holds; `on_row` as in :func:`check_tokens`, `compiled_widths` as in
    :func:`check_speed`."""
    from .report import machine_description

    t0 = time.perf_counter()
    rows = [row for dtype in dtypes for row in check_tokens(device, dtype, on_row=on_row)] if correctness else []
    memory = check_memory(device, torch.bfloat16, calls=calls) if correctness else None
    result = {"machine": machine_description(device), "tokens": rows, "memory": memory}
    if speed:
        result["speed"] = check_speed(device, compiled_widths=compiled_widths)
    result["ok"] = all(row["ok"] for row in rows) and (memory is None or memory["ok"])
    result["seconds"] = time.perf_counter() - t0
    return result


def row_line(row: dict) -> str:
    """One row of check 1 as a line of the report."""
    return (f"  {'ok  ' if row['ok'] else 'FAIL'} {row['dtype']:<9} {row['model']:<18} {row['strategy']:<42} "
            f"graph {'=' if row['graph_equal'] else '!='} eager {'=' if row['tokens_equal'] else '!='} "
            f"counters {'=' if row['counters_equal'] else '!='}"
            f" graphs {row['graphs']} (steps {row['steps']})  [{row['runtime']}]")


def report(result: dict) -> str:
    """The result as a plain-text report (one line per row)."""
    lines = [f"hf-dllm-spec check-gpu on {result['machine']}"]
    memory = result["memory"]
    if memory is not None:                                              # checks 1 and 2 ran (not --speed-only)
        lines += ["", "1. static runtime (CUDA graphs) vs eager: tokens, counters, capture"]
        lines += [row_line(row) for row in result["tokens"]]
        lines += ["", f"2. memory over {memory['calls']} calls: {'ok' if memory['ok'] else 'FAIL'} (allocated "
                      f"{memory['memory_bytes'][0]} -> {memory['memory_bytes'][1]} bytes, graphs captured "
                      f"{memory['graphs'][0]} -> {memory['graphs'][1]})"]
    speed = result.get("speed")
    if speed:
        step = speed["stock_step_s"]
        lines += ["", f"3. captured forward vs stock compiled AR step ({speed['shape']}, bf16; stock step "
                      f"{step * 1e3:.2f} ms, compiled={speed['compiled']}; target ratio <= {speed['target']}, "
                      "figures only)" if step else f"3. stock baseline not measured: {speed['baseline']}"]
        compiled = [dict(w, how="compiled (compile_config)") for w in speed.get("compiled_widths", [])]
        for w in speed["widths"] + compiled:
            ratio = "-" if w["ratio"] is None else f"{w['ratio']:.2f}"
            met = "met" if w["met"] else "not met" if w["met"] is False else ""
            lines.append(f"  width {w['q']:>3}: {w['seconds'] * 1e3:7.2f} ms  ratio {ratio}  {met}  "
                         f"{w.get('how', '')}".rstrip())
    lines += ["", f"{'PASS' if result['ok'] else 'FAIL'} in {result['seconds']:.0f} s"]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of `hf-dllm-spec check-gpu` to `parser`: --device, --dtypes, --calls, --no-speed,
    --speed-only, --compiled-widths, --json (read by :func:`main`)."""
    parser.add_argument("--device", default="cuda", help="the CUDA device to check (default: cuda)")
    parser.add_argument("--dtypes", default="bfloat16,float32",
                        help="comma-separated dtypes of check 1 (default: bfloat16,float32)")
    parser.add_argument("--calls", type=int, default=50, help="calls of check 2 (default: 50)")
    parser.add_argument("--no-speed", action="store_true", help="skip check 3 (the 1.7B-shape timing)")
    parser.add_argument("--speed-only", action="store_true",
                        help="run check 3 alone (skip the token and memory checks 1 and 2)")
    parser.add_argument("--compiled-widths", default="",
                        help="comma-separated widths whose forward check 3 also times compiled by compile_config="
                             "CompileConfig() (inductor; about a minute of compilation each); default: none")
    parser.add_argument("--json", default=None, help="also write the result as JSON to this file")


def main(args: argparse.Namespace) -> int:
    """Run the checks named by `args` (:func:`add_arguments`); print the report; the exit status (0: all hold).

    Raises:
        ValueError: if `--compiled-widths` is not a list of positive integers, `--no-speed` and `--speed-only` are
            both given, `--calls` < 2 (check 2 compares the last call with the second), `--device` is no torch
            device or no available CUDA device (:func:`~hf_dllm_spec.cli_args.torch_device`) or a dtype is unknown
            (the CLI turns it into a usage error, exit 2).
    """
    try:
        compiled_widths = tuple(int(q) for q in args.compiled_widths.split(",") if q.strip())
    except ValueError:
        compiled_widths = (0,)
    if any(q < 1 for q in compiled_widths):
        raise invalid("--compiled-widths", args.compiled_widths, "be comma-separated positive integers",
                      "pass e.g. 1,8,32")
    if args.no_speed and args.speed_only:
        raise invalid("--speed-only", True, "not be given with --no-speed (it runs check 3 alone)",
                      "drop one of the two")
    if args.calls < 2 and not args.speed_only:
        raise invalid("--calls", args.calls, "be at least 2 (check 2 compares the memory and graphs after the "
                      "last call with those after the second)", "pass --calls 2 or more (default: 50)")
    on_gpu = "run it on a GPU machine (the CPU checks are the test suite: `./run.sh test`)"
    device = torch_device("--device", args.device, on_gpu)
    if device.type != "cuda":
        raise invalid("--device", args.device, "be a CUDA device: check-gpu needs one", on_gpu)
    dtypes = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name.strip(), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise invalid("--dtypes", args.dtypes, f"name torch floating-point dtypes ({name!r} is not one)",
                          "pass e.g. bfloat16,float32")
        dtypes.append(dtype)
    result = run_check(device, dtypes=tuple(dtypes), calls=args.calls, speed=not args.no_speed,
                       correctness=not args.speed_only, compiled_widths=compiled_widths,
                       on_row=lambda row: print(row_line(row), flush=True))
    print(report(result))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0 if result["ok"] else 1


__all__ = ["CASES", "add_arguments", "check_memory", "check_speed", "check_tokens", "main", "report", "row_line",
           "run_check"]
