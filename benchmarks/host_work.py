"""What the decoding loop does between forwards, per forward: host synchronisations and tensor operations.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/host_work.py [--max-new-tokens 24]

Every strategy of the main job on every bundled model, batch 1, one held-out prompt, greedy, under the static
runtime (`cache_implementation="static"`), on the CPU. For each it prints the forwards, the host synchronisations
(`hf_dllm_spec.runtime.syncs.count_host_syncs`) of the whole call and between the first and the last decoding
forward, and the tensor operations dispatched outside the model calls (each one kernel launch on a GPU), per
forward. Counts, not times: they are the same on any machine; what they cost on a GPU is what
`hf-dllm-spec bench-gpu` measures. Results: docs/performance.md ("Host synchronisations and launches").
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
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
