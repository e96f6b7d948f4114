"""TIME phase of the cost model: which widths to time, one library-style forward timed per width, and the time
outside forwards per decoding step, on models of real shapes with random weights (`shapes`)."""

from __future__ import annotations

import gc
import statistics
import time
from collections import Counter
from typing import Callable

import torch

from .predict import outside_per_step
from .shapes import BYTES_PER_PARAM, SCALES, SHAPES, available_bytes, build_model, count_parameters

#: How repeats of a timing are summarised (--stat).
STATS: dict[str, Callable] = {"median": statistics.median, "min": min}


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_forward(model, q: int, ctx: int, keep: int, *, reps: int, warmup: int, seed: int = 0,
                 stat: str = "median", cpu_log: list | None = None) -> float:
    """Seconds of one library-style forward of width `q` over `ctx` cached tokens: the median (or the minimum,
    `stat="min"`, for a shared machine where other processes inflate some repeats) of `reps` repeats.

    As `hf_dllm_spec.runtime.runner.ModelRunner.forward`: explicit `position_ids`, a 4D additive float mask
    `(1, 1, q, ctx + q)` from `hf_dllm_spec.maths.masks.to_additive`, the family patch's forward (logits upcast to
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
    from hf_dllm_spec.maths.masks import to_additive

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
    from hf_dllm_spec.integration.generate import dllm_generate
    from hf_dllm_spec.integration.mixin import DllmGenerationMixin

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
