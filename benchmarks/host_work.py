"""What the decoding loop does between forwards, per forward: host synchronisations and tensor operations.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/host_work.py [--max-new-tokens 24]
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/host_work.py --compiled [--max-new-tokens 64]
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/host_work.py --captured [--max-new-tokens 64]

Every strategy of the main job on every bundled model, batch 1, one held-out prompt, greedy, under the static
runtime (`cache_implementation="static"`), on the CPU. For each it prints the forwards, the host synchronisations
(`hf_dllm_spec.runtime.syncs.count_host_syncs`) of the whole call and between the first and the last decoding
forward, and the tensor operations dispatched outside the model calls (each one kernel launch on a GPU), per
forward. Counts, not times: they are the same on any machine; what they cost on a GPU is what
`hf-dllm-spec bench-gpu` measures. Results: docs/performance.md ("Host synchronisations and launches").

`--compiled`: the same under `compile_config` (transformers' `CompileConfig()` with `_compile_all_devices`, the way
transformers compiles on a CPU), counted with `torch.profiler`: the top-level ATen operations that run outside
compiled code (no "Torch-Compiled Region" range and no ATen operation above them), per forward, over a whole call
(input checks, prefill and output included) after two calls that compiled (the first call's first forward runs
eagerly: it allocates the static cache); beside stock transformers' own `generate(cache_implementation="static",
compile_config=...)` on qwen2-tiny-ar, per token, measured in the same run, and the ratio; and the same call with the
step left eager (only the model call compiled, as before issue 34). Some rows are measured sampled as well
(temperature 0.7, top-k 20, top-p 0.95; torch's global RNG seeded before each call). Results:
docs/performance.md ("One decoding step, one compiled function").

`--captured`: the same around the static runtime's CUDA-graph mode (each step one graph; the default on a GPU),
the graphs stood in for on the CPU by the test suite's tape (tests/graph_tape.py; the replays are left out of the
count), beside the same stock baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import CompileConfig

import hf_dllm_spec
import model_patches
from hf_dllm_spec.tools.jobs.evaluation import ROOT, arithmetic_prompts, load
from hf_dllm_spec.tools.jobs.main import SUB_BLOCKS, specs
from hf_dllm_spec.runtime.static import StaticModelRunner
from hf_dllm_spec.runtime.syncs import count_host_syncs

MODELS = ROOT / "models"
#: bundled model -> (main-job strategy rows, drafter)
CASES = {
    "sdar-tiny-arith": (["ar", "static", "dynamic", "s2d2"], None),
    "fast-dllm-v2-tiny": (["fast_dllm_v2", "s2d2"], None),
    "llada2-tiny": (["llada2", "s2d2-llada2"], None),
    "sdar-large": (["simsd"], "sdar-tiny-arith"),
    "qwen2-tiny-ar": (["deer"], "deer-drafter-tiny"),
}


class OperationCounter(TorchDispatchMode):
    """Counts the ATen operations dispatched while active and not paused (`paused` is set around model calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not self.paused
        return func(*args, **(kwargs or {}))


def measure(model, ids: torch.Tensor, spec, max_new_tokens: int) -> dict:
    """One batch-1 static-runtime call of `spec`: forwards, syncs (all / between decoding forwards), operations."""
    ops, before, run = OperationCounter(), [], StaticModelRunner._run

    def counted(runner, *args):
        before.append(syncs.total)
        ops.paused = True
        try:
            return run(runner, *args)
        finally:
            ops.paused = False

    entry = {} if isinstance(model, hf_dllm_spec.DllmGenerationMixin) else {"custom_generate": hf_dllm_spec.custom_generate}
    drafter = {"draft_model": spec.draft_model} if spec.draft_model is not None else {}
    StaticModelRunner._run = counted
    try:
        with count_host_syncs() as syncs, ops:
            model.generate(ids, decoding_strategy=spec.decoding_strategy, max_new_tokens=max_new_tokens,
                           cache_implementation="static", **entry, **spec.params, **drafter)
    finally:
        StaticModelRunner._run = run
    forwards = len(before)
    return {"forwards": forwards, "syncs_per_forward": syncs.total / forwards,
            "loop_syncs_per_forward": (before[-1] - before[1]) / (forwards - 2) if forwards > 2 else float("nan"),
            "operations_per_forward": ops.count / forwards}


#: bundled model -> main-job strategy rows measured under `compile_config` (every strategy x family of the main
#: job; the drafter of a pair is the one of :data:`CASES`).
COMPILED_CASES = {"sdar-tiny-arith": ["ar", "static", "dynamic", "s2d2"], "llada2-tiny": ["llada2", "s2d2-llada2"],
                  "fast-dllm-v2-tiny": ["fast_dllm_v2", "s2d2"], "sdar-large": ["simsd"], "qwen2-tiny-ar": ["deer"]}
#: rows measured sampled as well (transformers' warpers; torch's global RNG, seeded before each call).
SAMPLED_ROWS = {"sdar-tiny-arith": ["dynamic", "s2d2"], "llada2-tiny": ["llada2"], "sdar-large": ["simsd"],
                "qwen2-tiny-ar": ["deer"]}
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.95}
#: The stock transformers baseline under `compile_config`: an AR model's own `generate`.
STOCK_MODEL = "qwen2-tiny-ar"
COMPILED_REGION = "Torch-Compiled Region"


def eager_operations(run, region: str = COMPILED_REGION) -> Counter:
    """The top-level ATen operations `run()` dispatches outside compiled code, by name: profiler events named
    `aten::*` with no ATen operation and no `region` range above them (most are one kernel launch on a GPU; views
    and allocations such as `aten::empty_like` launch none)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    names = Counter()
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not (parent.name.startswith("aten::") or region in parent.name):
            parent = parent.cpu_parent
        if parent is None:
            names[event.name] += 1
    return names


@contextlib.contextmanager
def stood_in_graphs():
    """The static runtime's CUDA-graph mode on the CPU, capture and replay stood in for by the test suite's tape
    (tests/graph_tape.py: a replay re-runs the recorded operations inside a profiler range of its own)."""
    import importlib.util

    import pytest

    spec = importlib.util.spec_from_file_location("graph_tape", ROOT / "tests" / "graph_tape.py")
    graph_tape = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graph_tape)

    with pytest.MonkeyPatch.context() as patch:
        graph_tape.install(patch)
        yield graph_tape.REPLAY_REGION


@contextlib.contextmanager
def eager_steps():
    """Strategies run their steps eagerly around the compiled model call (what every step did before issue 34)."""
    names = ("runs_compiled_steps", "runs_compiled_carry_steps")                  # every strategy asks the runner
    served = {name: getattr(StaticModelRunner, name) for name in names}
    for name in names:
        setattr(StaticModelRunner, name, property(lambda runner: False))
    try:
        yield
    finally:
        for name, value in served.items():
            setattr(StaticModelRunner, name, value)


def compiled_config() -> CompileConfig:
    config = CompileConfig()
    config._compile_all_devices = True            # transformers compiles on the CPU only when told
    return config


def measure_compiled(model, ids: torch.Tensor, max_new_tokens: int, region: str | None = None,
                     **kwargs) -> tuple[Counter, int]:
    """`(eager operations by name, forwards)` of the third of three identical `generate` calls under static +
    `compile_config` (the first two compile); with `region` (:func:`stood_in_graphs`), static alone, counted
    outside the replays."""
    config = {} if region else {"compile_config": compiled_config()}
    calls = []

    def run():
        torch.manual_seed(0)
        calls.append(model.generate(ids, max_new_tokens=max_new_tokens, cache_implementation="static",
                                    return_dict_in_generate=True, **config, **kwargs))

    run()
    run()
    operations = eager_operations(run, region or COMPILED_REGION)
    out = calls[-1]
    stats = getattr(out, "spec_stats", None)
    forwards = stats.num_forward_calls if stats is not None else out.sequences.shape[1] - ids.shape[1]
    return operations, forwards


def main_compiled(max_new_tokens: int, only: list[str] | None = None, captured: bool = False, top: int = 0,
                  batch: int = 1) -> None:
    torch._dynamo.reset()
    tokenizer, stock = load(MODELS / STOCK_MODEL)
    ids = tokenizer(arithmetic_prompts(MODELS / STOCK_MODEL, 1)[0].text, return_tensors="pt").input_ids
    names, tokens = measure_compiled(stock, ids, max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens)
    ops = names.total()
    baseline = ops / tokens
    print(f"stock transformers generate(cache_implementation='static', compile_config), {STOCK_MODEL}: "
          f"{ops} eager operations / {tokens} tokens = {baseline:.1f} per token\n")
    where = "captured graphs (stood in for)" if captured else "compiled code"
    print(f"| model | strategy | forwards | eager operations / forward outside {where} | ratio to stock per "
          f"token | with the step eager (model call {'captured' if captured else 'compiled'} only) |"
          + (f" {top} most frequent / forward |" if top else ""))
    with stood_in_graphs() if captured else contextlib.nullcontext() as region:
        _rows(max_new_tokens, only, baseline, region, top, batch)


def _rows(max_new_tokens: int, only: list[str] | None, baseline: float, region: str | None, top: int,
          batch: int) -> None:
    print("|---|---|---|---|---|---|" + ("---|" if top else ""))
    for name, rows in COMPILED_CASES.items():
        if only and name not in only:
            continue
        tokenizer, model = load(MODELS / name)
        drafter_name = CASES[name][1]
        drafter = load(MODELS / drafter_name)[1] if drafter_name else None
        patch = model_patches.get_patch(model)
        family = SUB_BLOCKS if patch.native_strategy == "fast_dllm_v2" else None
        tokenizer.padding_side = "left"
        enc = tokenizer([p.text for p in arithmetic_prompts(MODELS / name, batch)], return_tensors="pt", padding=True)
        ids = enc.input_ids
        entry = ({} if isinstance(model, hf_dllm_spec.DllmGenerationMixin)
                 else {"custom_generate": hf_dllm_spec.custom_generate})
        entry["attention_mask"] = enc.attention_mask
        names = rows if rows[0] == "ar" else ["ar", *rows]                    # specs() puts AR first
        for row, spec in zip(names, specs(patch.trained_block_size(model) or 4, 0.9, rows, {}, family, drafter,
                                          draft_block_size=8)):
            for sampled in (False, True) if row in SAMPLED_ROWS.get(name, ()) else (False,):
                kwargs = dict(decoding_strategy=spec.decoding_strategy, **spec.params, **entry,
                              **({"draft_model": spec.draft_model} if spec.draft_model is not None else {}),
                              **(SAMPLING if sampled else {}))
                counted, forwards = measure_compiled(model, ids, max_new_tokens, region, **kwargs)
                with eager_steps():
                    before, before_forwards = measure_compiled(model, ids, max_new_tokens, region, **kwargs)
                label = f"{spec.label}, sampled" if sampled else spec.label
                ops = counted.total()
                frequent = ", ".join(f"{n.removeprefix('aten::')} {c / forwards:.1f}"
                                     for n, c in counted.most_common(top))
                print(f"| {name} | {label} | {forwards} | {ops / forwards:.1f} | {ops / forwards / baseline:.2f} | "
                      f"{before.total() / before_forwards:.1f} |" + (f" {frequent} |" if top else ""), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="24 (64 with --compiled)")
    ap.add_argument("--compiled", action="store_true", help="count around compiled code under compile_config")
    ap.add_argument("--captured", action="store_true",
                    help="count around the static runtime's CUDA-graph mode (stood in for: tests/graph_tape.py)")
    ap.add_argument("--batch", type=int, default=1, metavar="N",
                    help="with --compiled / --captured: a left-padded batch of the first N held-out prompts (stock "
                         "stays at batch 1)")
    ap.add_argument("--top", type=int, default=0, metavar="N",
                    help="with --compiled / --captured: a column of each row's N most frequent operations per forward")
    ap.add_argument("--only", nargs="+", metavar="MODEL", choices=list(COMPILED_CASES),
                    help="with --compiled: these bundled models' rows only (the stock baseline always runs)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if args.compiled or args.captured:
        main_compiled(args.max_new_tokens or 64, args.only, captured=args.captured, top=args.top, batch=args.batch)
        return
    args.max_new_tokens = args.max_new_tokens or 24
    print("| model | strategy | forwards | host syncs / forward (call) | (between decoding forwards) | "
          "tensor operations / forward outside the model |")
    print("|---|---|---|---|---|---|")
    for name, (rows, drafter_name) in CASES.items():
        tokenizer, model = load(MODELS / name)
        drafter = load(MODELS / drafter_name)[1] if drafter_name else None
        patch = model_patches.get_patch(model)
        family = SUB_BLOCKS if patch.native_strategy == "fast_dllm_v2" else None
        ids = tokenizer(arithmetic_prompts(MODELS / name, 1)[0].text, return_tensors="pt").input_ids
        for spec in specs(patch.trained_block_size(model) or 4, 0.9, rows, {}, family, drafter, draft_block_size=8):
            m = measure(model, ids, spec, args.max_new_tokens)
            print(f"| {name} | {spec.label} | {m['forwards']} | {m['syncs_per_forward']:.1f} | "
                  f"{m['loop_syncs_per_forward']:.2f} | {m['operations_per_forward']:.0f} |")


if __name__ == "__main__":
    main()
