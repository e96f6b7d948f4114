"""Compile time of the static runtime's compiled steps: the first compiled call, static shapes against torch's default.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/compile_time.py [--model sdar-tiny-arith] [--strategy s2d2]
        [--rows 3] [--max-new-tokens 64] [--backend eager] [--repeats 2]

A bundled model, a left-padded batch of `--rows` held-out arithmetic prompts, greedy, `cache_implementation="static"`
with a `compile_config` (dynamo's "eager" backend by default: the trace and its guards; `--backend inductor` adds code
generation, with its on-disk caches off so that every run generates code), on the CPU. Each run times the first
compiled call (where every key is compiled) from a fresh dynamo state and a fresh static state (after one warm-up
call, not counted), and checks its tokens against the eager runtime's, for two settings in the same process,
alternating:

- static shapes: what the runtime passes when `compile_config.dynamic` is unset (`torch.compile(dynamic=False)`);
- torch's default (`dynamic=None`, automatic dynamic), which the runtime passed before: it marks sizes dynamic from a
  step function's second key on, since its record is per source line and the keys' copies of a function share it.

Prints each run, then the medians and their ratio. Results: docs/performance.md ("Compile time").
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

import torch
from transformers import CompileConfig

from hf_dllm_spec.runtime import static
from hf_dllm_spec.runtime.static import clear_static_state, static_states
from hf_dllm_spec.tools.jobs.evaluation import ROOT, arithmetic_prompts, load

MODELS = ROOT / "models"


@contextlib.contextmanager
def torch_default_shapes():
    """The runtime's compile options without its `dynamic=False` when the config leaves `dynamic` unset."""
    own = static.compile_options

    def torch_default(config, **kwargs):
        options = own(config, **kwargs)
        if getattr(config, "dynamic", None) is None:
            options.pop("dynamic")
        return options

    static.compile_options = torch_default
    try:
        yield
    finally:
        static.compile_options = own


def first_call(model, enc, config: CompileConfig, **kwargs) -> tuple[float, int, torch.Tensor]:
    """`(seconds, compiled functions, sequences)` of one compiled call from a fresh dynamo and static state."""
    clear_static_state(model)
    torch._dynamo.reset()
    start = time.perf_counter()
    out = model.generate(enc.input_ids, attention_mask=enc.attention_mask, cache_implementation="static",
                         compile_config=config, **kwargs)
    seconds = time.perf_counter() - start
    return seconds, sum(len(state.steps.keys) for state in static_states(model)), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="sdar-tiny-arith", help="a bundled model under models/")
    ap.add_argument("--strategy", default="s2d2", help="decoding_strategy (default: s2d2)")
    ap.add_argument("--rows", type=int, default=3, help="prompts in the left-padded batch (default: 3)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--backend", default="eager", help="torch.compile backend: eager (default) or inductor")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each setting, alternating (default: 2)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    tokenizer, model = load(MODELS / args.model)
    tokenizer.padding_side = "left"
    prompts = [prompt.text for prompt in arithmetic_prompts(MODELS / args.model, args.rows)]
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    kwargs = dict(decoding_strategy=args.strategy, max_new_tokens=args.max_new_tokens)
    eager = model.generate(enc.input_ids, attention_mask=enc.attention_mask, **kwargs)
    config = CompileConfig(backend=args.backend, mode=None if args.backend == "eager" else "default")
    config._compile_all_devices = True                  # transformers compiles on the CPU only when told
    torch._inductor.config.fx_graph_cache = False       # inductor: every run generates its code (no on-disk reuse)
    torch._functorch.config.enable_autograd_cache = False
    first_call(model, enc, config, **kwargs)            # warm-up, not counted: dynamo's first use in the process
    times = {"static shapes": [], "torch's default": []}
    for run in range(args.repeats):
        for setting in times:
            with torch_default_shapes() if setting == "torch's default" else contextlib.nullcontext():
                seconds, functions, out = first_call(model, enc, config, **kwargs)
            times[setting].append(seconds)
            print(f"run {run + 1}, {setting}: first compiled call {seconds:.1f} s, {functions} compiled functions, "
                  f"eager tokens: {torch.equal(out, eager)}", flush=True)
    fixed, default = (statistics.median(values) for values in times.values())
    print(f"{args.model}, {args.strategy}, {args.rows} rows, {args.max_new_tokens} tokens, backend {args.backend}: "
          f"median first compiled call {fixed:.1f} s with static shapes, {default:.1f} s with torch's default "
          f"(ratio {fixed / default:.2f})")

if __name__ == "__main__":
    main()
