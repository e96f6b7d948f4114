"""COUNT phase of the cost model: run every strategy at its best benchmark setting on the bundled trained models
and record each forward (model role, kind, query width, context length, `logits_to_keep`) from the runtime's
forward trace (`hf_dllm_spec.runtime.trace.trace_forwards`), with the run's tokens, NFE, acceptance and times."""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import torch

from hf_dllm_spec.runtime.trace import ForwardRecord, trace_forwards

from .predict import outside_per_step
from .shapes import MODELS_DIR


@dataclass(frozen=True)
class Row:
    """One `generate` configuration of the COUNT phase.

    Attributes:
        group (`str`): the target model's group; its first row is the AR baseline every speedup divides by.
        label (`str`): human name (unique inside the group).
        strategy (`str`): `decoding_strategy`.
        params (`dict`): further `generate` keywords (JSON-serialisable).
        target (`str`): bundled model directory name under `models/`.
        drafter (`str`, *optional*): bundled drafter directory name (SimSD, DEER).
    """

    group: str
    label: str
    strategy: str
    params: dict
    target: str
    drafter: str | None = None

    @property
    def key(self) -> str:
        """`group/label`, unique over all rows."""
        return f"{self.group}/{self.label}"


def default_rows() -> list[Row]:
    """The best settings of the existing benchmarks (benchmarks/results/*/sweep.md, greedy, held-out arithmetic).

    - sdar (`models/sdar-tiny-arith`): AR (block size 1), dynamic 0.9 at B=4 (best accuracy of the dynamic rows),
      and the four S2D2 routing presets of `hf_dllm_spec.tools.jobs.sweep.s2d2_presets` at B=4.
    - simsd (`models/sdar-large` target, `models/sdar-tiny-arith` drafter): AR, SimSD `simsd-dynamic` at B=4 (best
      SimSD row: 96% exact match, 1.86x).
    - fast_dllm_v2 (`models/fast-dllm-v2-tiny`): AR (separate block writes, as the sweep), the family decoder at
      threshold 0.9, B=32, SB=8 (the main job's default).
    - llada2 (`models/llada2-tiny`): AR, LLaDA2.1 0.9 / edit 0.9 at B=32 (the main job's default) and S2D2
      `llada2.1-mini-quality` (the sweep's best accuracy at > 1.5x).
    - deer (`models/qwen2-tiny-ar` target, `models/deer-drafter-tiny` drafter): AR, DEER k=16 (best sweep speed).
    """
    from hf_dllm_spec.tools.jobs.sweep import s2d2_presets

    rows = [Row("sdar", "AR", "ar", {}, "sdar-tiny-arith"),
            Row("sdar", "dynamic 0.9 B=4", "block_diffusion", {"block_size": 4, "confidence_threshold": 0.9},
                "sdar-tiny-arith")]
    rows += [Row("sdar", f"S2D2 {name} B=4", "s2d2", {"block_size": 4, "confidence_threshold": 0.9, **params},
                 "sdar-tiny-arith") for name, params in s2d2_presets(4).items()]
    rows += [Row("simsd", "AR", "ar", {}, "sdar-large"),
             Row("simsd", "SimSD dynamic B=4", "simsd", {"preset": "simsd-dynamic", "block_size": 4,
                                                        "draft_block_size": 4}, "sdar-large", "sdar-tiny-arith"),
             Row("fast_dllm_v2", "AR", "ar", {"fuse_cache_write": False}, "fast-dllm-v2-tiny"),
             Row("fast_dllm_v2", "Fast-dLLM v2 0.9 SB=8", "fast_dllm_v2",
                 {"block_size": 32, "sub_block_size": 8, "confidence_threshold": 0.9}, "fast-dllm-v2-tiny"),
             Row("llada2", "AR", "ar", {}, "llada2-tiny"),
             Row("llada2", "LLaDA2.1 0.9 / edit 0.9", "llada2", {"block_size": 32, "confidence_threshold": 0.9},
                 "llada2-tiny"),
             Row("llada2", "S2D2 llada2.1-mini-quality", "s2d2", {"preset": "llada2.1-mini-quality"}, "llada2-tiny"),
             Row("deer", "AR", "ar", {}, "qwen2-tiny-ar"),
             Row("deer", "DEER k=16", "deer", {"block_size": 16}, "qwen2-tiny-ar", "deer-drafter-tiny")]
    return rows


GROUPS = ("sdar", "simsd", "fast_dllm_v2", "llada2", "deer")


def tally(records: Iterable[ForwardRecord]) -> list[list]:
    """The forwards of a trace as sorted `[role, kind, q, ctx, keep, n]` lists: `n` forwards of model role `role`
    ("target" / "drafter") and kind `kind` with query width `q` (tokens), `ctx` cached tokens before the forward
    and `logits_to_keep` `keep` (the rows of logits the model computed).

    Args:
        records: `hf_dllm_spec.runtime.trace.ForwardRecord`s of batch-size-1 forwards (`trace.records`).

    Raises:
        ValueError: if a record has more than one batch row (the widths and contexts are per forward only at
            batch size 1; the COUNT phase runs one prompt per `generate` call).
    """
    records = list(records)
    batched = sorted({r.rows for r in records} - {1})
    if batched:
        raise ValueError(f"tally: forwards with {batched} batch rows; the COUNT phase records batch-size-1 forwards "
                         "only. Run one prompt per `generate` call (`hf_dllm_spec.tools.jobs.evaluation.run`, "
                         "batch_size=1).")
    counts = Counter((r.role, r.kind, r.width, r.context, r.keep) for r in records)
    return [[*key, n] for key, n in sorted(counts.items())]


#: How a phase runs the library's `generate` (`--runtime`, `--count-runtime`): "eager" (the default runtime),
#: "static" (`cache_implementation="static"`: the static runtime, CUDA graphs on a GPU) or "compiled" (the static
#: runtime with `compile_config=CompileConfig()`: each forward and decoding step compiled by `torch.compile`, inductor
#: in "reduce-overhead" mode, as transformers' `generate` compiles its static-cache forward).
RUNTIMES = ("eager", "static", "compiled")


def runtime_kwargs(runtime: str) -> dict:
    """The `generate` keywords of a runtime of :data:`RUNTIMES` (e.g. `{"cache_implementation": "static"}`).

    Raises:
        ValueError: if `runtime` is not one of :data:`RUNTIMES`.
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"`runtime` (={runtime!r}) must be one of {RUNTIMES}; pass --runtime / --count-runtime "
                         "eager, static or compiled.")
    if runtime == "eager":
        return {}
    from transformers import CompileConfig

    return {"cache_implementation": "static", **({"compile_config": CompileConfig()} if runtime == "compiled" else {})}


def count_phase(rows: list[Row], num_prompts: int, max_new_tokens: int, seed: int, repeats: int = 1,
                progress: bool = False, device: torch.device | str = "cpu", runtime: str = "eager") -> dict:
    """Run every row on the bundled models (fp32, greedy, batch 1; by default on the CPU with the eager runtime)
    and record its forwards (`tally` of the runtime's forward trace).

    `device` moves the bundled models there (e.g. "cuda"); `runtime="static"` runs every row with
    `cache_implementation="static"` (the static runtime: CUDA graphs on a GPU), `runtime="compiled"` adds
    `compile_config=CompileConfig()` (:func:`runtime_kwargs`), so the measured speedups and efficiencies are those
    of that runtime; each row then first runs once over all its prompts, untimed, so that every forward width is
    captured (or compiled) before the timed runs. Under the static runtime the trace records each
    forward at its width bucket (the width it runs at).

    With `repeats` > 1 all rows run again in turn (interleaved, so a slow spell of a shared machine hits every row
    alike) and each row keeps its fastest run; the recorded forwards are the same in every repeat (greedy).
    Besides the library's own times, the whole prompt loop is timed in wall seconds (`call_wall_s`) and in
    process CPU seconds (`call_cpu_s`, `time.process_time`): with one torch thread their ratio shows how much
    other processes of a shared machine slowed the run (1.0: not at all).

    Returns:
        `dict` with "rows": one entry per row (strategy, models, tokens, NFE split, acceptance, measured times,
        outside seconds per step, accuracy and "forwards": `[role, kind, q, ctx, keep, n]` lists), and the run's
        settings.

    Raises:
        ValueError: if `repeats` < 1 or `runtime` is not one of :data:`RUNTIMES`.
    """
    from hf_dllm_spec.tools.jobs.evaluation import StrategySpec, arithmetic_prompts, load, run as run_spec

    if repeats < 1:
        raise ValueError(f"count_phase: `repeats` (={repeats}) must be >= 1; pass --count-repeats 1 or more.")
    runtime_params = runtime_kwargs(runtime)
    device = torch.device(device)
    models: dict[str, tuple] = {}
    for name in dict.fromkeys([r.target for r in rows] + [r.drafter for r in rows if r.drafter]):
        tokenizer, model = load(MODELS_DIR / name)
        models[name] = (tokenizer, model.to(device) if device.type != "cpu" else model)
    best: dict[str, dict] = {}
    for rep in range(repeats):
        for row in rows:
            tokenizer, target = models[row.target]
            drafter = models[row.drafter][1] if row.drafter else None
            prompts = arithmetic_prompts(MODELS_DIR / row.target, num_prompts)
            spec = StrategySpec(row.label, row.strategy, dict(row.params, **runtime_params), draft_model=drafter)
            if rep == 0:      # allocator and lazy inits (static runtime: every width's capture), so the run is warm
                run_spec(target, tokenizer, prompts if runtime_params else prompts[:1], spec,
                         max_new_tokens=max_new_tokens if runtime_params else 8, seed=seed, progress=False)
            wall0, cpu0 = time.perf_counter(), time.process_time()
            with trace_forwards() as trace:
                result = run_spec(target, tokenizer, prompts, spec, max_new_tokens=max_new_tokens, seed=seed,
                                  progress=progress)
            call_wall, call_cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            forwards = tally(trace.records)
            st = result.stats
            print(f"count {row.key:40s} tokens={st.num_generated_tokens:5d} nfe={st.nfe:5d} "
                  f"wall={st.wall_time_s:6.2f}s exact={result.accuracy:5.1f}%", flush=True)
            if row.key in best and best[row.key]["wall_time_s"] <= st.wall_time_s:
                continue
            recorded = sum(f[-1] for f in forwards)
            if recorded != st.num_forward_calls:
                print(f"warning: {row.key}: the trace saw {recorded} forwards, the stats count "
                      f"{st.num_forward_calls}", file=sys.stderr)
            prompt_lengths = [len(tokenizer(p.text).input_ids) for p in prompts]
            best[row.key] = {
                "key": row.key, "group": row.group, "label": row.label, "strategy": row.strategy,
                "params": row.params, "target": row.target, "drafter": row.drafter, "prompts": len(prompts),
                "median_prompt_tokens": int(statistics.median(prompt_lengths)),
                "tokens": st.num_generated_tokens, "committed_tokens": st.num_committed_tokens, "nfe": st.nfe,
                "prefill_forwards": st.num_prefill_forwards, "decode_forwards": st.decode_forwards,
                "target_forwards": st.num_forward_calls - st.num_draft_model_forwards,
                "drafter_forwards": st.num_draft_model_forwards,
                "forward_kinds": {k: getattr(st, f"num_{k}_forwards") for k in ("prefill", "draft", "verify",
                                                                                "cache_write")},
                "acceptance_rate": st.acceptance_rate, "mean_acceptance_length": st.mean_acceptance_length,
                "wall_time_s": st.wall_time_s, "forward_time_s": st.forward_time_s,
                "overhead_fraction": st.overhead_fraction,
                "outside_s_per_step": outside_per_step(st.wall_time_s, st.forward_time_s, st.decode_forwards),
                "accuracy": result.accuracy, "forwards": forwards, "recorded_forwards": recorded,
                "call_wall_s": call_wall, "call_cpu_s": call_cpu,
            }
    out = {"rows": [best[row.key] for row in rows], "num_prompts": num_prompts, "max_new_tokens": max_new_tokens,
           "seed": seed, "repeats": repeats, "device": str(device), "dtype": "float32",
           "threads": torch.get_num_threads()}
    if runtime != "eager":
        out["runtime"] = runtime
    return out
