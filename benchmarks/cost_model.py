"""Cost model: predict tokens/s of every decoding strategy at real model scale from forward widths and timings.

    python benchmarks/cost_model.py --threads 1 --count-repeats 3 --reps 7      # CPU, tiny shapes (bundled configs)
    python benchmarks/cost_model.py --shape 1.7b --dtype bfloat16 --threads 1 --groups sdar,fast_dllm_v2 \\
        --counts benchmarks/results/cost_model/tiny-cpu-float32.json           # CPU, SDAR-1.7B: reuse the counts
    python benchmarks/cost_model.py --shape 1.7b --device cuda --dtype bfloat16 --quant nf4 \\
        --counts benchmarks/results/cost_model/tiny-cpu-float32.json           # GPU (bitsandbytes installed)

On a shared CPU machine use one torch thread: with two OpenMP threads and another process on one of the two
cores, forwards ran up to 10x slower (threads wait at barriers); with one thread the wall/CPU time ratio the
tables print shows how much other processes slowed a run.

Three phases (docs/performance.md states the equations):

1. COUNT: every strategy at its best setting of the existing benchmarks (`hf_dllm_spec.jobs.sweep` and
   `benchmarks/results/*/sweep.md`) runs on the bundled trained models with greedy decoding over N held-out
   arithmetic prompts. A standard PyTorch forward pre-hook (`register_forward_pre_hook(..., with_kwargs=True)`)
   on each model records every forward's query width q (`input_ids.shape[1]`), context length
   (the cache's `get_seq_length()` before the forward), `logits_to_keep` and kind (prefill / draft / verify /
   cache_write, read from the library's `ModelRunner.forward` frame), per model role (target / drafter). The
   library is not changed. Tokens, NFE, acceptance and the measured outside-forward seconds per step are kept.
2. TIME: models of real shapes (configs written from `shared/reference/families.md`) are built with random
   weights (no download) in `--dtype`, optionally quantized with bitsandbytes (`--quant 8bit|nf4`), and the
   query widths the COUNT phase saw (all, or the `--max-widths` most frequent plus both ends) are timed with a
   `DynamicCache` of a representative length and an explicit 4D additive float mask
   (`hf_dllm_spec.masks.to_additive`), as the library's `ModelRunner.forward` does (the mask build and the cache
   crop are inside the timed region, as in the library's forward timer). CUDA events on the
   GPU, `time.perf_counter` on the CPU; warm-up, median of repeats. The time outside forwards per decoding step
   is measured at that shape by running the library's `generate` for a few blocks with the same random weights.
3. PREDICT: tokens/s = tokens / (sum over recorded forwards of t_shape(q) + decode steps * outside-per-step),
   with t_shape(q) a piecewise-linear interpolation over the measured widths; the efficiency figure
   (speedup over AR / forward-count ratio over AR) per strategy.

Outputs in `--out` (default `benchmarks/results/cost_model/`): `<shape>-<device>-<dtype>[-<quant>].json`, the same
name `.md` (tables) and `.png` (forward time vs query width per shape; predicted tokens/s per strategy). This is a
measurement, not a test: record the machine and the command next to the numbers.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import logging
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

MODELS_DIR = ROOT / "models"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cost_model"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTS = ("none", "8bit", "nf4")
#: How repeats of a timing are summarised (--stat).
STATS: dict[str, Callable] = {"median": statistics.median, "min": min}
#: bytes per parameter by storage, for the memory check before building a shape (nf4: 4-bit codes + absmax,
#: metrics.md §6; 8-bit: int8 + scales).
BYTES_PER_PARAM = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "8bit": 1.05, "nf4": 0.56}


# ------------------------------------------------------------------------------------------------------------------
# What runs: the rows of the COUNT phase (best settings of the existing benchmark jobs) and the real-scale shapes.
# ------------------------------------------------------------------------------------------------------------------
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
      and the four S2D2 routing presets of `hf_dllm_spec.jobs.sweep.s2d2_presets` at B=4.
    - simsd (`models/sdar-large` target, `models/sdar-tiny-arith` drafter): AR, SimSD `simsd-dynamic` at B=4 (best
      SimSD row: 96% exact match, 1.86x).
    - fast_dllm_v2 (`models/fast-dllm-v2-tiny`): AR (separate block writes, as the sweep), the family decoder at
      threshold 0.9, B=32, SB=8 (the main job's default).
    - llada2 (`models/llada2-tiny`): AR, LLaDA2.1 0.9 / edit 0.9 at B=32 (the main job's default) and S2D2
      `llada2.1-mini-quality` (the sweep's best accuracy at > 1.5x).
    - deer (`models/qwen2-tiny-ar` target, `models/deer-drafter-tiny` drafter): AR, DEER k=16 (best sweep speed).
    """
    from hf_dllm_spec.jobs.sweep import s2d2_presets

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


@dataclass(frozen=True)
class Shape:
    """A model shape to time: the config class (by family) and its keyword arguments.

    Attributes:
        name (`str`): e.g. "SDAR-1.7B".
        family (`str`): "sdar" (Qwen3 layout, SDAR classes), "qwen3" (transformers' Qwen3 AR model),
            "fast_dllm_v2" (Qwen2 layout), "llada2" (LLaDA2 MoE), or "bundled" (the config.json of `models/<dir>`).
        config (`dict`): config keywords (for "bundled": {"dir": name}).
        source (`str`): where the numbers come from.
    """

    name: str
    family: str
    config: dict
    source: str


_QWEN3_COMMON = dict(vocab_size=151936, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, attention_bias=False,
                     max_position_embeddings=32768)
SHAPES: dict[str, Shape] = {
    "SDAR-1.7B": Shape("SDAR-1.7B", "sdar", dict(_QWEN3_COMMON, hidden_size=2048, intermediate_size=6144,
                                                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                                 tie_word_embeddings=True, block_size=4, mask_token_id=151669),
                       "families.md §2.1 (Qwen3-1.7B layout; marked open there)"),
    "SDAR-8B": Shape("SDAR-8B", "sdar", dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288,
                                             num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                             tie_word_embeddings=False, block_size=4, mask_token_id=151669),
                     "families.md §2.1 (SDAR-8B-Chat config)"),
    "Qwen3-8B": Shape("Qwen3-8B", "qwen3", dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288,
                                                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                                tie_word_embeddings=False, max_position_embeddings=40960),
                      "families.md §5 (Qwen3-8B)"),
    # DEER's drafter: Open-dCoder 0.5B has Qwen2.5-0.5B dimensions (families.md §6); built as an SDAR (Qwen3
    # layout: q/k norm, no qkv bias) diffusion model, the class the library's DEER drafter runs as here.
    "Open-dCoder-0.5B": Shape("Open-dCoder-0.5B", "sdar", dict(_QWEN3_COMMON, hidden_size=896, intermediate_size=4864,
                                                               num_hidden_layers=24, num_attention_heads=14,
                                                               num_key_value_heads=2, head_dim=64,
                                                               tie_word_embeddings=True, block_size=4,
                                                               mask_token_id=151669),
                              "families.md §5-6 (Qwen2.5-0.5B dimensions, Qwen3 layout)"),
    "Fast-dLLM-v2-1.5B": Shape("Fast-dLLM-v2-1.5B", "fast_dllm_v2",
                               dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                    num_attention_heads=12, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                                    max_position_embeddings=32768, tie_word_embeddings=True, bd_size=32,
                                    mask_token_id=151665),
                               "families.md §3.1 (Qwen2.5-1.5B base values)"),
    "Fast-dLLM-v2-7B": Shape("Fast-dLLM-v2-7B", "fast_dllm_v2",
                             dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                  num_attention_heads=28, num_key_value_heads=4, rope_theta=1e6, rms_norm_eps=1e-6,
                                  max_position_embeddings=32768, tie_word_embeddings=False, bd_size=32,
                                  mask_token_id=151665),
                             "families.md §3.1 (7B)"),
    "LLaDA2.1-mini": Shape("LLaDA2.1-mini", "llada2", dict(mask_token_id=156895, block_size=32),
                           "families.md §4.1 (mini; the LLaDA2MoeConfig defaults)"),
}
for _dir in ("sdar-tiny-arith", "sdar-large", "fast-dllm-v2-tiny", "llada2-tiny", "qwen2-tiny-ar", "deer-drafter-tiny"):
    SHAPES[f"tiny:{_dir}"] = Shape(f"tiny:{_dir}", "bundled", {"dir": _dir}, f"models/{_dir}/config.json")

#: --shape -> group -> (target shape, drafter shape or None).
SCALES: dict[str, dict[str, tuple[str, str | None]]] = {
    "tiny": {"sdar": ("tiny:sdar-tiny-arith", None), "simsd": ("tiny:sdar-large", "tiny:sdar-tiny-arith"),
             "fast_dllm_v2": ("tiny:fast-dllm-v2-tiny", None), "llada2": ("tiny:llada2-tiny", None),
             "deer": ("tiny:qwen2-tiny-ar", "tiny:deer-drafter-tiny")},
    "1.7b": {"sdar": ("SDAR-1.7B", None), "simsd": ("SDAR-8B", "SDAR-1.7B"),
             "fast_dllm_v2": ("Fast-dLLM-v2-1.5B", None), "llada2": ("LLaDA2.1-mini", None),
             "deer": ("Qwen3-8B", "Open-dCoder-0.5B")},
    "8b": {"sdar": ("SDAR-8B", None), "simsd": ("SDAR-8B", "SDAR-1.7B"),
           "fast_dllm_v2": ("Fast-dLLM-v2-7B", None), "llada2": ("LLaDA2.1-mini", None),
           "deer": ("Qwen3-8B", "Open-dCoder-0.5B")},
}


# ------------------------------------------------------------------------------------------------------------------
# Pure functions: width selection, interpolation, prediction, efficiency.
# ------------------------------------------------------------------------------------------------------------------
def select_widths(counts: dict[int, int], max_widths: int) -> list[int]:
    """Query widths to time: all of them if at most `max_widths`, else the smallest, the largest and the most
    frequent ones (ties: the smaller width) up to `max_widths`; ascending.

    Args:
        counts (`dict[int, int]`): query width q (tokens) -> number of recorded forwards of that width.
        max_widths (`int`): at most this many widths, >= 2.

    Raises:
        ValueError: if `max_widths` < 2 (the interpolation needs both ends).
    """
    if max_widths < 2:
        raise ValueError(f"select_widths: `max_widths` (={max_widths}) must be >= 2 (the smallest and the largest "
                         "width are always timed); pass a larger value.")
    widths = sorted(w for w, n in counts.items() if n > 0)
    if len(widths) <= max_widths:
        return widths
    chosen = {widths[0], widths[-1]}
    for w in sorted(widths, key=lambda w: (-counts[w], w)):
        if len(chosen) >= max_widths:
            break
        chosen.add(w)
    return sorted(chosen)


def interpolate(widths: list[int], seconds: list[float], q: float) -> float:
    """Piecewise-linear time of a forward of width `q` from measured points.

    Inside the measured range: linear between the two neighbouring widths. Below the smallest width: the smallest
    width's time (a forward never gets cheaper than its narrowest measurement). Above the largest: the last
    segment extended with a non-negative slope. One point: its time for every width.

    Args:
        widths (`list[int]`): measured query widths, strictly ascending.
        seconds (`list[float]`): time of one forward at each width, in seconds.
        q (`float`): query width to predict, in tokens.

    Returns:
        `float`, seconds.

    Raises:
        ValueError: if the lists are empty, of different lengths, or `widths` is not strictly ascending.
    """
    if not widths or len(widths) != len(seconds):
        raise ValueError(f"interpolate: `widths` ({len(widths)}) and `seconds` ({len(seconds)}) must be non-empty "
                         "and of equal length; time at least one width first.")
    if any(b <= a for a, b in zip(widths, widths[1:])):
        raise ValueError(f"interpolate: `widths` (={widths}) must be strictly ascending; sort and deduplicate them.")
    if len(widths) == 1 or q <= widths[0]:
        return float(seconds[0])
    for (x0, y0), (x1, y1) in zip(zip(widths, seconds), zip(widths[1:], seconds[1:])):
        if q <= x1:
            return float(y0 + (y1 - y0) * (q - x0) / (x1 - x0))
    x0, y0, x1, y1 = widths[-2], seconds[-2], widths[-1], seconds[-1]
    return float(y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (q - x1))


@dataclass
class TimeCurve:
    """Forward time of one shape against query width, at one context length.

    Attributes:
        cached (`dict[int, float]`): q -> seconds for forwards over a non-empty cache (decode steps).
        uncached (`dict[int, float]`): q -> seconds for forwards over an empty cache (prefill).
        context (`int`): the cache length (tokens) `cached` was measured at.
    """

    cached: dict[int, float] = field(default_factory=dict)
    uncached: dict[int, float] = field(default_factory=dict)
    context: int = 0

    def seconds(self, q: int, ctx: int) -> float:
        """Time of a forward of width `q` over `ctx` cached tokens: the cached curve when `ctx` > 0 (measured at
        `self.context`; the context dependence is not modelled), else the uncached curve; the other curve when
        the needed one has no point.

        Raises:
            ValueError: if neither curve has a point.
        """
        points = self.cached if (ctx > 0 and self.cached) or not self.uncached else self.uncached
        if not points:
            raise ValueError("TimeCurve.seconds: no measured point; run the TIME phase for this shape first.")
        widths = sorted(points)
        return interpolate(widths, [points[w] for w in widths], q)


def predict_seconds(forwards: Iterable[tuple[str, int, int, int]], time_of: Callable[[str, int, int], float],
                    decode_steps: int, outside_per_step_s: float) -> tuple[float, float]:
    """Predicted decoding time of a run: (forward seconds, outside seconds).

    forward seconds = sum over recorded forwards f of n_f * time_of(role_f, q_f, ctx_f);
    outside seconds = decode_steps * outside_per_step_s.

    Args:
        forwards: `(role, q, ctx, n)` tuples: model role ("target" / "drafter"), query width (tokens), context
            length before the forward (tokens), number of such forwards.
        time_of: `(role, q, ctx) -> seconds` of one forward.
        decode_steps (`int`): forwards after prefill (the loop's steps).
        outside_per_step_s (`float`): seconds outside forwards per step.
    """
    fwd = sum(n * time_of(role, q, ctx) for role, q, ctx, n in forwards)
    return fwd, decode_steps * outside_per_step_s


def efficiency(tokens_per_s: float, ar_tokens_per_s: float, forwards_per_token: float,
               ar_forwards_per_token: float) -> dict[str, float]:
    """The issue's efficiency figure: speedup over AR divided by the forward-count ratio over AR.

    speedup = tokens_per_s / ar_tokens_per_s; forward_ratio = ar_forwards_per_token / forwards_per_token;
    efficiency = speedup / forward_ratio (1.0: every forward saved turns into time saved one for one).

    Returns:
        `dict` with "speedup", "forward_ratio", "efficiency" (nan where a denominator is 0).
    """
    speedup = tokens_per_s / ar_tokens_per_s if ar_tokens_per_s else float("nan")
    ratio = ar_forwards_per_token / forwards_per_token if forwards_per_token else float("nan")
    return {"speedup": speedup, "forward_ratio": ratio,
            "efficiency": speedup / ratio if ratio and ratio == ratio else float("nan")}


def outside_per_step(wall_s: float, forward_s: float, decode_forwards: int) -> float:
    """Seconds outside model forwards per decoding step: (wall - forward) / decode forwards (0 with no step)."""
    return (wall_s - forward_s) / decode_forwards if decode_forwards else 0.0


def representative_context(contexts: Counter) -> int:
    """Median context length (tokens) over forwards with a non-empty cache, weighted by count; 0 if none."""
    values = sorted((c, n) for c, n in contexts.items() if c > 0)
    total = sum(n for _, n in values)
    if not total:
        return 0
    seen = 0
    for c, n in values:
        seen += n
        if 2 * seen >= total:
            return int(c)
    return int(values[-1][0])


# ------------------------------------------------------------------------------------------------------------------
# COUNT phase.
# ------------------------------------------------------------------------------------------------------------------
def _runner_kind() -> str:
    """The `kind` argument of the library's `ModelRunner.forward` that is running now (frame lookup), else
    "unknown"."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "forward" and "kind" in frame.f_locals and "store_len" in frame.f_locals:
            return str(frame.f_locals["kind"])
        frame = frame.f_back
    return "unknown"


class ForwardRecorder:
    """Records every forward of the models it is attached to, with standard forward pre-hooks.

    Each record is `(role, kind, q, ctx, keep)`: model role, forward kind, query width `input_ids.shape[1]`,
    context: the cache's `get_seq_length()` before the forward (0 without a cache) and `logits_to_keep`
    (0 = all). Batch size 1 is assumed (the COUNT phase runs one prompt per call).
    """

    def __init__(self) -> None:
        self.records: Counter = Counter()
        self._handles: list = []

    def attach(self, model: torch.nn.Module, role: str) -> None:
        from model_patches.compat import find_cache

        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                raise ValueError("ForwardRecorder: a forward without `input_ids`; the COUNT phase reads the query "
                                 "width from them. Run the library's decoding loop (it passes input_ids).")
            cache = find_cache(kwargs)
            ctx = int(cache.get_seq_length()) if cache is not None else 0
            keep = int(kwargs.get("logits_to_keep") or 0)
            self.records[(role, _runner_kind(), int(ids.shape[1]), ctx, keep)] += 1

        self._handles.append(model.register_forward_pre_hook(hook, with_kwargs=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def take(self) -> list[list]:
        """The records as sorted `[role, kind, q, ctx, keep, n]` lists; clears them."""
        out = [[*key, n] for key, n in sorted(self.records.items())]
        self.records.clear()
        return out


def count_phase(rows: list[Row], num_prompts: int, max_new_tokens: int, seed: int, repeats: int = 1,
                progress: bool = False) -> dict:
    """Run every row on the bundled models (CPU, fp32, greedy, batch 1) and record its forwards.

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
        ValueError: if `repeats` < 1.
    """
    from hf_dllm_spec.evaluation import StrategySpec, arithmetic_prompts, load, run as run_spec

    if repeats < 1:
        raise ValueError(f"count_phase: `repeats` (={repeats}) must be >= 1; pass --count-repeats 1 or more.")
    models: dict[str, tuple] = {}
    for name in dict.fromkeys([r.target for r in rows] + [r.drafter for r in rows if r.drafter]):
        models[name] = load(MODELS_DIR / name)
    recorder = ForwardRecorder()
    best: dict[str, dict] = {}
    for rep in range(repeats):
        for row in rows:
            tokenizer, target = models[row.target]
            drafter = models[row.drafter][1] if row.drafter else None
            prompts = arithmetic_prompts(MODELS_DIR / row.target, num_prompts)
            spec = StrategySpec(row.label, row.strategy, dict(row.params), draft_model=drafter)
            if rep == 0:      # allocator and lazy inits, so the measured run is warm
                run_spec(target, tokenizer, prompts[:1], spec, max_new_tokens=8, seed=seed, progress=False)
            recorder.attach(target, "target")
            if drafter is not None:
                recorder.attach(drafter, "drafter")
            wall0, cpu0 = time.perf_counter(), time.process_time()
            try:
                result = run_spec(target, tokenizer, prompts, spec, max_new_tokens=max_new_tokens, seed=seed,
                                  progress=progress)
            finally:
                recorder.detach()
            call_wall, call_cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            forwards = recorder.take()
            st = result.stats
            print(f"count {row.key:40s} tokens={st.num_generated_tokens:5d} nfe={st.nfe:5d} "
                  f"wall={st.wall_time_s:6.2f}s exact={result.accuracy:5.1f}%", flush=True)
            if row.key in best and best[row.key]["wall_time_s"] <= st.wall_time_s:
                continue
            recorded = sum(f[-1] for f in forwards)
            if recorded != st.num_forward_calls:
                print(f"warning: {row.key}: the hooks saw {recorded} forwards, the stats count "
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
    return {"rows": [best[row.key] for row in rows], "num_prompts": num_prompts, "max_new_tokens": max_new_tokens,
            "seed": seed, "repeats": repeats, "device": "cpu", "dtype": "float32",
            "threads": torch.get_num_threads()}


# ------------------------------------------------------------------------------------------------------------------
# TIME phase.
# ------------------------------------------------------------------------------------------------------------------
def shape_config(shape: Shape):
    """The transformers config of `shape` (attention: SDPA)."""
    import hf_dllm_spec

    hf_dllm_spec.register_auto_classes()
    kwargs = dict(shape.config)
    if shape.family == "bundled":
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(MODELS_DIR / kwargs["dir"])
        hub_mask = {"Fast_dLLM_Qwen": "fast_dllm_v2", "llada2_moe": "llada2"}.get(cfg.model_type)
        if hub_mask and getattr(cfg, "mask_token_id", None) is None:
            # Families whose configs carry no mask id: the tokenizer files name it (as their from_pretrained does).
            import importlib

            from model_patches.hub_generate import mask_token_from_files

            token = importlib.import_module(f"model_patches.{hub_mask}").MASK_TOKEN
            cfg.mask_token_id = mask_token_from_files(str(MODELS_DIR / kwargs["dir"]), token)
    elif shape.family == "sdar":
        from model_patches.sdar import SDARConfig

        cfg = SDARConfig(**kwargs)
    elif shape.family == "qwen3":
        from transformers import Qwen3Config

        cfg = Qwen3Config(**kwargs)
    elif shape.family == "fast_dllm_v2":
        from model_patches.fast_dllm_v2 import Fast_dLLM_QwenConfig

        cfg = Fast_dLLM_QwenConfig(**kwargs)
    elif shape.family == "llada2":
        from model_patches.llada2 import LLaDA2MoeConfig

        cfg = LLaDA2MoeConfig(**kwargs)
    else:
        raise ValueError(f"shape_config: `family` (={shape.family!r}) of shape {shape.name} must be one of bundled, "
                         "sdar, qwen3, fast_dllm_v2, llada2; fix the SHAPES entry.")
    cfg._attn_implementation = "sdpa"
    return cfg


def count_parameters(shape: Shape) -> int:
    """Number of parameters of `shape` (built on the meta device: no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(shape))
    return sum(p.numel() for p in model.parameters())


def available_bytes(device: torch.device) -> int:
    """Free memory of `device` in bytes (CUDA: `mem_get_info`; CPU: MemAvailable of /proc/meminfo, else large)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _no_init_weights():
    """transformers' `no_init_weights` context (skip the library's weight init: `build_model` fills the weights
    itself), or a no-op context where this transformers has none (init then runs twice, only slower)."""
    import contextlib

    for module in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return importlib.import_module(module).no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


def build_model(shape: Shape, device: torch.device, dtype: torch.dtype, quant: str, seed: int):
    """A model of `shape` with random weights, in eval mode, on `device`.

    Weights: uniform in +-0.02*sqrt(3) (std 0.02, the usual `initializer_range`) from a `torch.Generator` seeded
    with `seed`; 1-D weights of norms are 1, biases 0. With `quant` "8bit" / "nf4" the random model is saved to a
    temporary directory and reloaded through `from_pretrained(..., quantization_config=BitsAndBytesConfig(...))`,
    the path real checkpoints take (the bf16 model is built on `device` first, so it must fit there too).

    Args:
        shape (`Shape`): what to build (`SHAPES`).
        device (`torch.device`): where the model lives.
        dtype (`torch.dtype`): parameter dtype; the compute dtype of quantized layers.
        quant (`str`): "none", "8bit" (LLM.int8) or "nf4" (4-bit NormalFloat), see `QUANTS`.
        seed (`int`): seed of the weights' generator.

    Raises:
        ValueError: `quant` unknown, or bitsandbytes missing for a quantized build.
    """
    from transformers import AutoModelForCausalLM

    if quant not in QUANTS:
        raise ValueError(f"build_model: `quant` (={quant!r}) must be one of {QUANTS}; pass one of them (--quant).")
    if quant != "none" and importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(f"--quant {quant} needs bitsandbytes, which is not installed: `pip install bitsandbytes` "
                         "(on a GPU machine without network, carry its wheel), or drop --quant.")
    build_dtype = dtype if quant == "none" else torch.bfloat16
    with torch.device(device), _no_init_weights():
        model = AutoModelForCausalLM.from_config(shape_config(shape), dtype=build_dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    bound = 0.02 * 3 ** 0.5
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(0.0 if name.endswith("bias") else 1.0)
            else:
                param.uniform_(-bound, bound, generator=gen)
    model.eval()
    if quant == "none":
        return model
    from transformers import BitsAndBytesConfig

    bnb = (BitsAndBytesConfig(load_in_8bit=True) if quant == "8bit" else
           BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype))
    with tempfile.TemporaryDirectory(prefix="cost_model_") as tmp:
        model.save_pretrained(tmp)
        cls = type(model)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        loaded = cls.from_pretrained(tmp, quantization_config=bnb, dtype=dtype,
                                     device_map=str(device) if device.type != "cuda" else {"": device.index or 0})
    if quant == "8bit":
        # LLM.int8 casts bf16 inputs to fp16 and logs it on every matmul.
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    return loaded.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_forward(model, q: int, ctx: int, keep: int, *, reps: int, warmup: int, seed: int = 0,
                 stat: str = "median", cpu_log: list | None = None) -> float:
    """Seconds of one library-style forward of width `q` over `ctx` cached tokens: the median (or the minimum,
    `stat="min"`, for a shared machine where other processes inflate some repeats) of `reps` repeats.

    As `hf_dllm_spec.runner.ModelRunner.forward`: explicit `position_ids`, a 4D additive float mask
    `(1, 1, q, ctx + q)` from `hf_dllm_spec.masks.to_additive`, the family patch's forward (logits upcast to
    fp32) with `logits_to_keep=keep`, then `DynamicCache.crop(-q)` (a read-only forward) when `ctx` > 0; a prefill
    (`ctx` = 0) stores into an empty cache. Mask build, forward and crop are timed (the library's forward span).
    CUDA: events around each repeat; CPU: `time.perf_counter`.

    Args:
        model: the model (eval mode).
        q (`int`): query width (tokens). ctx (`int`): cache length (tokens). keep (`int`): logits_to_keep (0: all).
        reps (`int`): timed repeats (>= 1). warmup (`int`): untimed repeats first.
        seed (`int`): seed of the random token ids.
        stat (`str`): "median" or "min" of the repeats.
        cpu_log (`list`, *optional*): CPU only: receives `(wall seconds, process CPU seconds)` of the timed
            repeats together (their ratio shows contention from other processes).

    Raises:
        ValueError: if `q` < 1, `reps` < 1 or `stat` is unknown.
    """
    import model_patches
    from hf_dllm_spec.masks import to_additive

    if q < 1 or reps < 1:
        raise ValueError(f"time_forward: `q` (={q}) and `reps` (={reps}) must be >= 1; pass a width of at least one "
                         "token and at least one timed repeat (--reps).")
    if stat not in STATS:
        raise ValueError(f"time_forward: `stat` (={stat!r}) must be one of {sorted(STATS)}; pass one of them "
                         "(--stat).")
    patch = model_patches.get_patch(model)
    device = model.device
    dtype = model.dtype if model.dtype.is_floating_point else torch.float32
    vocab = int(model.config.vocab_size)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (1, ctx + q), generator=gen).to(device)
    cache = patch.new_cache(model) if ctx else None
    if ctx:
        patch.forward(model, ids[:, :ctx], position_ids=torch.arange(ctx, device=device)[None],
                      attention_mask=to_additive(torch.ones(1, ctx, ctx, dtype=torch.bool, device=device), dtype),
                      cache=cache, logits_to_keep=1)
    query, pos = ids[:, ctx:], torch.arange(ctx, ctx + q, device=device)[None]
    visible = torch.ones(1, q, ctx + q, dtype=torch.bool, device=device)
    cuda = device.type == "cuda"
    times, cpu_times = [], []
    for i in range(warmup + reps):
        step_cache = cache if ctx else patch.new_cache(model)
        _sync(device)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0, c0 = time.perf_counter(), time.process_time()
        patch.forward(model, query, position_ids=pos, attention_mask=to_additive(visible, dtype),
                      cache=step_cache, logits_to_keep=keep)
        if ctx:
            step_cache.crop(-q)
        if cuda:
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            elapsed = time.perf_counter() - t0
            cpu_elapsed = time.process_time() - c0
        if i >= warmup:
            times.append(elapsed)
            if not cuda:
                cpu_times.append(cpu_elapsed)
    if cpu_log is not None and cpu_times:
        cpu_log.append((sum(times), sum(cpu_times)))
    return float(STATS[stat](times))


def needed_points(count: dict, scale: str, groups: list[str]) -> dict[str, dict]:
    """Per shape: forwards by (cached, q) with their modal `logits_to_keep`, and the contexts seen.

    Returns:
        shape name -> {"cached": Counter q -> n, "uncached": Counter q -> n, "keep": {(cached, q): keep},
        "contexts": Counter ctx -> n}.
    """
    out: dict[str, dict] = {}
    keeps: dict[str, dict] = {}
    for row in count["rows"]:
        if row["group"] not in groups:
            continue
        target_shape, drafter_shape = SCALES[scale][row["group"]]
        for role, _kind, q, ctx, keep, n in row["forwards"]:
            shape = target_shape if role == "target" else drafter_shape
            if shape is None:
                raise ValueError(f"needed_points: row {row['key']} has drafter forwards but scale {scale!r} maps "
                                 f"group {row['group']!r} to no drafter shape; fix SCALES.")
            entry = out.setdefault(shape, {"cached": Counter(), "uncached": Counter(), "keep": {},
                                           "contexts": Counter()})
            cached = ctx > 0
            entry["cached" if cached else "uncached"][q] += n
            entry["contexts"][ctx] += n
            keeps.setdefault(shape, {}).setdefault((cached, q), Counter())[min(keep or q, q)] += n
    for shape, entry in out.items():
        entry["keep"] = {k: c.most_common(1)[0][0] for k, c in keeps[shape].items()}
    return out


def measure_outside(target, drafter, row: dict, *, prompt_tokens: int, new_tokens: int, reps: int,
                    seed: int, stat: str = "median") -> float:
    """Seconds outside model forwards per decoding step of `row`'s strategy at this shape (random weights).

    Runs the library's `generate` on a random prompt of `prompt_tokens` tokens for `new_tokens` tokens (EOS
    stopping off), once untimed, then `reps` times; median (`stat`: or minimum) of
    (wall_time_s - forward_time_s) / decode forwards.
    """
    from hf_dllm_spec.generation import dllm_generate
    from hf_dllm_spec.mixin import DllmGenerationMixin

    device = target.device
    vocab = min(int(target.config.vocab_size), int(drafter.config.vocab_size) if drafter is not None else 1 << 30)
    mask_ids = {getattr(m.config, "mask_token_id", None) for m in (target, drafter) if m is not None}
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(3, min(vocab, 1000), (1, prompt_tokens), generator=gen)
    for mask_id in mask_ids - {None}:
        ids[ids == mask_id] = 3
    ids = ids.to(device)
    entry = {} if isinstance(target, DllmGenerationMixin) else {"custom_generate": dllm_generate}
    extra = {"draft_model": drafter} if drafter is not None else {}
    values = []
    for i in range(1 + reps):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), decoding_strategy=row["strategy"],
                              max_new_tokens=new_tokens, eos_token_id=None, return_dict_in_generate=True,
                              generator=torch.Generator(device=device).manual_seed(seed + i), **entry, **extra,
                              **row["params"])
        st = out.spec_stats
        if i:
            values.append(outside_per_step(st.wall_time_s, st.forward_time_s, st.decode_forwards))
    return float(STATS[stat](values))


def _block_size(row: dict) -> int:
    params = row["params"]
    if "block_size" in params:
        return int(params["block_size"])
    return 32 if row["group"] in ("llada2", "fast_dllm_v2") else 4


def time_phase(count: dict, scale: str, groups: list[str], device: torch.device, dtype: torch.dtype, quant: str, *,
               reps: int, warmup: int, max_widths: int, context: int | None, outside_tokens: int, outside_reps: int,
               seed: int, stat: str = "median") -> dict:
    """Build each group's models at `scale`, time the widths the COUNT phase saw, measure the outside time.

    Returns:
        `dict` with "shapes": name -> {"params", "source", "context", "cached": {q: s}, "uncached": {q: s},
        "keep": {...}, "skipped": reason or None, "build_s"} and "outside": row key -> seconds per step.
    """
    points = needed_points(count, scale, groups)
    storage = quant if quant != "none" else {torch.float32: "float32", torch.bfloat16: "bfloat16",
                                             torch.float16: "float16"}[dtype]
    shapes: dict[str, dict] = {}
    for name, entry in points.items():
        shape = SHAPES[name]
        n_params = count_parameters(shape)
        ctx = context if context is not None else max(1, representative_context(entry["contexts"]))
        cached_w = select_widths(entry["cached"], max_widths)
        uncached_w = select_widths(entry["uncached"], max(2, max_widths // 2)) if entry["uncached"] else []
        shapes[name] = {"params": n_params, "source": shape.source, "context": ctx, "cached": {}, "uncached": {},
                        "widths": {"cached": cached_w, "uncached": uncached_w},
                        "keep": {f"{'cached' if c else 'uncached'}:{q}": k for (c, q), k in entry["keep"].items()},
                        "skipped": None, "build_s": None, "wall_over_cpu": None,
                        "estimated_bytes": int(n_params * BYTES_PER_PARAM[storage] * 1.1),
                        "build_bytes": int(n_params * BYTES_PER_PARAM["bfloat16"] * 1.1)}
    outside: dict[str, float] = {}
    by_group = {g: [r for r in count["rows"] if r["group"] == g] for g in groups}
    for group, rows in by_group.items():
        if not rows:
            continue
        target_name, drafter_name = SCALES[scale][group]
        names = [n for n in (target_name, drafter_name) if n is not None]
        need = sum(shapes[n]["estimated_bytes"] for n in names if n in shapes)
        if quant != "none":        # a quantized model is first built in bf16 on the device, then reloaded
            need += max((shapes[n]["build_bytes"] for n in names if n in shapes), default=0)
        if need > available_bytes(device):
            reason = (f"needs about {need / 2**30:.1f} GiB, {available_bytes(device) / 2**30:.1f} GiB free on "
                      f"{device}")
            for n in names:
                if n in shapes and not shapes[n]["cached"] and not shapes[n]["uncached"]:
                    shapes[n]["skipped"] = reason
            print(f"time: skip group {group} ({reason})", flush=True)
            continue
        built = {}
        for n in names:
            t0 = time.perf_counter()
            built[n] = build_model(SHAPES[n], device, dtype, quant, seed)
            if shapes[n]["build_s"] is None:
                shapes[n]["build_s"] = time.perf_counter() - t0
        for n in names:
            info = shapes[n]
            cpu_log: list = []
            for cached, widths in ((True, info["widths"]["cached"]), (False, info["widths"]["uncached"])):
                table = info["cached" if cached else "uncached"]
                for q in widths:
                    if q in table:
                        continue
                    keep = points[n]["keep"].get((cached, q), q)
                    table[q] = time_forward(built[n], q, info["context"] if cached else 0, keep, reps=reps,
                                            warmup=warmup, seed=seed, stat=stat, cpu_log=cpu_log)
                    print(f"time {n:20s} {'cached' if cached else 'prefill'} q={q:4d} "
                          f"ctx={info['context'] if cached else 0:5d} keep={keep:4d} {table[q] * 1e3:9.2f} ms",
                          flush=True)
            if cpu_log:
                wall_s, cpu_s = sum(w for w, _ in cpu_log), sum(c for _, c in cpu_log)
                info["wall_over_cpu"] = wall_s / cpu_s if cpu_s else None
        for row in rows:
            tokens = max(outside_tokens, _block_size(row))
            drafter = built.get(drafter_name) if row["drafter"] else None
            outside[row["key"]] = measure_outside(built[target_name], drafter, row,
                                                  prompt_tokens=row["median_prompt_tokens"], new_tokens=tokens,
                                                  reps=outside_reps, seed=seed, stat=stat)
            print(f"outside {row['key']:40s} {outside[row['key']] * 1e3:8.2f} ms/step", flush=True)
        del built
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"shapes": shapes, "outside": outside}


# ------------------------------------------------------------------------------------------------------------------
# PREDICT phase.
# ------------------------------------------------------------------------------------------------------------------
def curves_of(timing: dict) -> dict[str, TimeCurve]:
    """`TimeCurve` per timed shape (shapes skipped or without points are left out)."""
    out = {}
    for name, info in timing["shapes"].items():
        cached = {int(q): float(s) for q, s in info["cached"].items()}
        uncached = {int(q): float(s) for q, s in info["uncached"].items()}
        if cached or uncached:
            out[name] = TimeCurve(cached, uncached, int(info["context"]))
    return out


def predict_phase(count: dict, timing: dict, scale: str, groups: list[str]) -> list[dict]:
    """Predicted tokens/s, speedup over AR, forward ratio and efficiency per row at `scale`; with the measured
    (COUNT, bundled models) figures next to them. Rows whose shapes were not timed get `None` predictions."""
    curves = curves_of(timing)
    rows = [r for r in count["rows"] if r["group"] in groups]
    out = []
    predicted: dict[str, dict] = {}
    for row in rows:
        target_name, drafter_name = SCALES[scale][row["group"]]
        shape_of = {"target": target_name, "drafter": drafter_name}
        entry = {"key": row["key"], "group": row["group"], "label": row["label"], "tokens": row["tokens"],
                 "nfe": row["nfe"], "target_forwards": row["target_forwards"],
                 "drafter_forwards": row["drafter_forwards"], "target_shape": target_name,
                 "drafter_shape": drafter_name if row["drafter"] else None,
                 "measured_tokens_per_s": row["tokens"] / row["wall_time_s"] if row["wall_time_s"] else float("nan")}
        ok = all(shape_of[f[0]] in curves for f in row["forwards"]) and row["key"] in timing["outside"]
        if ok:
            fwd_s, out_s = predict_seconds(((f[0], f[2], f[3], f[5]) for f in row["forwards"]),
                                           lambda role, q, ctx: curves[shape_of[role]].seconds(q, ctx),
                                           row["decode_forwards"], timing["outside"][row["key"]])
            entry.update(predicted_forward_s=fwd_s, predicted_outside_s=out_s,
                         outside_s_per_step=timing["outside"][row["key"]],
                         predicted_tokens_per_s=row["tokens"] / (fwd_s + out_s))
        predicted[row["key"]] = entry
        out.append(entry)
    for entry in out:
        row = next(r for r in rows if r["key"] == entry["key"])
        ar_key = next(r["key"] for r in rows if r["group"] == row["group"] and r["strategy"] == "ar")
        ar_row, ar = next(r for r in rows if r["key"] == ar_key), predicted[ar_key]
        fpt, ar_fpt = row["nfe"] / row["tokens"], ar_row["nfe"] / ar_row["tokens"]
        tfpt, ar_tfpt = row["target_forwards"] / row["tokens"], ar_row["target_forwards"] / ar_row["tokens"]
        entry["measured"] = efficiency(entry["measured_tokens_per_s"], ar["measured_tokens_per_s"], fpt, ar_fpt)
        entry["measured_target_only"] = efficiency(entry["measured_tokens_per_s"], ar["measured_tokens_per_s"],
                                                   tfpt, ar_tfpt)
        if row.get("call_cpu_s") and ar_row.get("call_cpu_s"):      # process CPU time: robust to other processes
            entry["measured_cpu_time"] = efficiency(row["tokens"] / row["call_cpu_s"],
                                                    ar_row["tokens"] / ar_row["call_cpu_s"], fpt, ar_fpt)
        if "predicted_tokens_per_s" in entry and "predicted_tokens_per_s" in ar:
            entry["predicted"] = efficiency(entry["predicted_tokens_per_s"], ar["predicted_tokens_per_s"], fpt,
                                            ar_fpt)
            entry["predicted_target_only"] = efficiency(entry["predicted_tokens_per_s"],
                                                        ar["predicted_tokens_per_s"], tfpt, ar_tfpt)
    return out


# ------------------------------------------------------------------------------------------------------------------
# Output.
# ------------------------------------------------------------------------------------------------------------------
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
    meta, count, timing, predict = result["meta"], result["count"], result.get("time"), result.get("predict")
    lines = [f"# Cost model: {meta['shape']} shapes, {meta['device']}, {meta['dtype']}"
             f"{', ' + meta['quant'] if meta['quant'] != 'none' else ''}\n",
             f"Command: `{meta['command']}`  ", f"Machine: {meta['machine']}  ", f"Date: {meta['date']}  ",
             f"COUNT: {count['num_prompts']} held-out arithmetic prompts per row, max_new_tokens="
             f"{count['max_new_tokens']}, greedy, EOS on, bundled models, {count['device']} {count['dtype']}, "
             f"{count['threads']} threads, fastest of {count.get('repeats', 1)} interleaved run(s)"
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
                  f"{meta['load_average'].get('after_count')}, {meta['load_average'].get('after_time')}\n",
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
    return "\n".join(lines) + "\n"


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


def _load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (other processes on a shared machine), or None where unavailable."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_description(device: torch.device) -> str:
    if device.type == "cuda":
        what = torch.cuda.get_device_name(device)
    else:
        what = f"{platform.machine()} CPU, {os.cpu_count()} cores (nproc), {torch.get_num_threads()} torch threads"
    import transformers

    return (f"{what}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"Python {platform.python_version()}")


def run_name(shape: str, device: torch.device, dtype: str, quant: str) -> str:
    """Output file stem: `<shape>-<device type>-<dtype>[-<quant>]`."""
    return f"{shape}-{device.type}-{dtype}" + (f"-{quant}" if quant != "none" else "")


def _json_ready(obj):
    if isinstance(obj, dict):
        return {str(k): _json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_ready(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return None
    return obj


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="cost_model.py", description=__doc__.split("\n\n")[0])
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
    start_load = _load_average()
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
    count_load = _load_average()
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
        meta["load_average"]["after_time"] = _load_average()
        result["predict"] = predict_phase(count, result["time"], args.shape, groups)
    meta["count_phase_s"] = count_s
    meta["total_s"] = time.perf_counter() - started
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "count-cpu-float32" if args.count_only else run_name(args.shape, device, dtype_name, args.quant)
    (out / f"{name}.json").write_text(json.dumps(_json_ready(result), indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(result))
    written = [out / f"{name}.json", out / f"{name}.md"]
    if args.plot and not args.count_only:
        plot(result, out / f"{name}.png")
        written.append(out / f"{name}.png")
    print(markdown(result))
    print("wrote " + ", ".join(map(str, written)) + f" in {meta['total_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
