"""TIME phase of the cost model: which widths to time, one library-style forward timed per width, and the time
outside forwards per decoding step, on models of real shapes with random weights (`shapes`)."""

from __future__ import annotations

import gc
import statistics
import time
from collections import Counter
from functools import partial
from typing import Callable

import torch

from .count import runtime_kwargs
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


def _random_ids(vocab: int, n: int, seed: int, device: torch.device) -> torch.Tensor:
    """`(1, n)` int64 token ids, uniform in `[0, vocab)`, from a CPU `torch.Generator` seeded with `seed`."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (1, n), generator=gen).to(device)


def _time_repeats(run: Callable[[], object], device: torch.device, *, reps: int, warmup: int, stat: str,
                  cpu_log: list | None = None, before: Callable[[], None] | None = None) -> float:
    """Seconds of `run()`: `warmup` untimed calls, then the `stat` ("median" / "min") of `reps` timed ones.

    CUDA: events recorded around each call, read after it; CPU: `time.perf_counter` (and `time.process_time`,
    appended to `cpu_log` as `(wall seconds, process CPU seconds)` of the timed calls together). `before()`, when
    given, runs before each call, untimed (e.g. a fresh cache).
    """
    cuda = device.type == "cuda"
    times, cpu_times = [], []
    for i in range(warmup + reps):
        if before is not None:
            before()
        _sync(device)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0, c0 = time.perf_counter(), time.process_time()
        run()
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


def _check_timing_args(name: str, q: int, reps: int, stat: str) -> None:
    if q < 1 or reps < 1:
        raise ValueError(f"{name}: `q` (={q}) and `reps` (={reps}) must be >= 1; pass a width of at least one "
                         "token and at least one timed repeat (--reps).")
    if stat not in STATS:
        raise ValueError(f"{name}: `stat` (={stat!r}) must be one of {sorted(STATS)}; pass one of them (--stat).")


class EagerForward:
    """The forward `time_forward` times: width `q` over `ctx` cached tokens, as the eager `ModelRunner` runs it.

    Explicit `position_ids`, a 4D additive float mask `(1, 1, q, ctx + q)` (every query token sees the context and
    the whole query) from `hf_dllm_spec.maths.masks.to_additive`, the family patch's forward (fp32 logits) with
    `logits_to_keep=keep`, then `DynamicCache.crop(-q)` (read-only) when `ctx` > 0; with `ctx` = 0 each call stores
    into a fresh empty cache (`reset`, untimed). The context is prefilled once, in the constructor, seeing itself
    bidirectionally.

    Attributes:
        ids (`torch.Tensor` of shape `(1, ctx + q)`, int64): the context then the query (random, seeded).
    """

    def __init__(self, model, q: int, ctx: int, keep: int, seed: int = 0) -> None:
        import model_patches
        from hf_dllm_spec.maths.masks import to_additive

        self.model, self.q, self.ctx, self.keep = model, q, ctx, keep
        self.patch = model_patches.get_patch(model)
        self._to_additive = to_additive
        device = model.device
        self.dtype = model.dtype if model.dtype.is_floating_point else torch.float32
        self.ids = _random_ids(int(model.config.vocab_size), ctx + q, seed, device)
        self.cache = self.patch.new_cache(model) if ctx else None
        if ctx:
            self.patch.forward(model, self.ids[:, :ctx], position_ids=torch.arange(ctx, device=device)[None],
                               attention_mask=to_additive(torch.ones(1, ctx, ctx, dtype=torch.bool, device=device),
                                                          self.dtype),
                               cache=self.cache, logits_to_keep=1)
        self.pos = torch.arange(ctx, ctx + q, device=device)[None]
        self.visible = torch.ones(1, q, ctx + q, dtype=torch.bool, device=device)
        self.step_cache = self.cache

    def reset(self) -> None:
        """Before each call: the context cache (read-only forwards), or a fresh empty cache (prefill, ctx = 0)."""
        self.step_cache = self.cache if self.ctx else self.patch.new_cache(self.model)

    def __call__(self) -> torch.Tensor:
        """One forward; returns the model call's logits `(1, keep or q, V)`, fp32."""
        logits = self.patch.forward(self.model, self.ids[:, self.ctx:], position_ids=self.pos,
                                    attention_mask=self._to_additive(self.visible, self.dtype),
                                    cache=self.step_cache, logits_to_keep=self.keep)
        if self.ctx:
            self.step_cache.crop(-self.q)
        return logits


@torch.inference_mode()
def time_forward(model, q: int, ctx: int, keep: int, *, reps: int, warmup: int, seed: int = 0,
                 stat: str = "median", cpu_log: list | None = None) -> float:
    """Seconds of one library-style forward of width `q` over `ctx` cached tokens: the median (or the minimum,
    `stat="min"`, for a shared machine where other processes inflate some repeats) of `reps` repeats.

    As `hf_dllm_spec.runtime.runner.ModelRunner.forward` (:class:`EagerForward`): explicit `position_ids`, a 4D
    additive float mask `(1, 1, q, ctx + q)` from `hf_dllm_spec.maths.masks.to_additive`, the family patch's forward
    (logits upcast to fp32) with `logits_to_keep=keep`, then `DynamicCache.crop(-q)` (a read-only forward) when
    `ctx` > 0; a prefill (`ctx` = 0) stores into an empty cache. Mask build, forward and crop are timed (the
    library's forward span). CUDA: events around each repeat; CPU: `time.perf_counter`.

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
    _check_timing_args("time_forward", q, reps, stat)
    call = EagerForward(model, q, ctx, keep, seed)
    return _time_repeats(call, model.device, reps=reps, warmup=warmup, stat=stat, cpu_log=cpu_log,
                         before=call.reset)


class StaticForward:
    """Read-only forwards of any width over a stored context, through the library's static runtime.

    A `hf_dllm_spec.runtime.static.StaticModelRunner` (`make_runner` with
    `GenerationConfig(cache_implementation="static")`, batch 1, as `generate` builds it) over a cache of
    `max_cache_len` columns; the constructor stores `context_ids` (one prefill forward, the context seeing itself
    bidirectionally, as :class:`EagerForward`). Each :meth:`__call__` is one `runner.forward` with `store_len=0`,
    so the write position does not advance and every call sees the same context: the query is padded to its width
    bucket, its mask built, and the forward run as the runtime runs it (CUDA: the captured graph of its
    `(1, bucket, kept logits)`, captured on the first call of that key; CPU: eager over the static cache).

    Args:
        model: the model (eval mode).
        context_ids (`torch.Tensor` of shape `(1, ctx)`, int64): tokens to store (ctx may be 0: empty cache).
        max_cache_len (`int`): columns of the static cache (`static_cache_length`); a wider need reallocates.
        compile_config (`transformers.CompileConfig`, *optional*): the `compile_config` of `generate`: each width's
            forward then runs compiled by `torch.compile` with its options (inductor and, in "reduce-overhead" mode,
            CUDA graph trees) instead of replaying a graph captured from the eager kernels.

    Attributes:
        runner (`StaticModelRunner`): the runner; `runner.compile_mode` says how its forwards run.
    """

    @torch.no_grad()
    def __init__(self, model, context_ids: torch.Tensor, max_cache_len: int, compile_config=None) -> None:
        import model_patches
        from transformers import GenerationConfig

        from hf_dllm_spec.outputs import BatchStats
        from hf_dllm_spec.runtime.static import make_runner

        patch = model_patches.get_patch(model)
        self.runner = make_runner(model, patch, BatchStats(1), batch_size=1,
                                  generation_config=GenerationConfig(cache_implementation="static",
                                                                     compile_config=compile_config),
                                  max_cache_len=max_cache_len)
        self.device = self.runner.device
        self.right_shift = self.runner.alignment != "position"
        self.ctx = int(context_ids.shape[1])
        if self.ctx:
            self.runner.forward(context_ids.to(self.device), torch.arange(self.ctx, device=self.device)[None],
                                torch.ones(self.ctx, self.ctx, dtype=torch.bool, device=self.device),
                                kind="prefill", store_len=self.ctx, logits_to_keep=1)

    @torch.no_grad()
    def __call__(self, query_ids: torch.Tensor, keep: int) -> torch.Tensor:
        """One read-only forward of `query_ids` `(1, q)` after the context; `keep`: the model call's
        `logits_to_keep` as the trace records it (right-shifted families: the runner adds its extra row itself).

        Returns:
            `torch.Tensor` of shape `(1, n, V)`, fp32: the runner's logits (aligned to the positions they predict).
        """
        q = int(query_ids.shape[1])
        keep = max(1, keep - 1) if self.right_shift and keep else keep
        return self.runner.forward(query_ids.to(self.device),
                                   torch.arange(self.ctx, self.ctx + q, device=self.device)[None],
                                   torch.ones(q, q, dtype=torch.bool, device=self.device), kind="draft",
                                   store_len=0, logits_to_keep=keep)


@torch.no_grad()          # not inference mode: `generate` later writes into the same static buffers
def time_static_forward(static: StaticForward, query_ids: torch.Tensor, keep: int, *, reps: int, warmup: int,
                        stat: str = "median", cpu_log: list | None = None) -> float:
    """Seconds of one read-only static-runtime forward of `query_ids` `(1, q)` (:class:`StaticForward`): the
    `stat` of `reps` timed calls after `warmup` untimed ones (on CUDA at least one: the first call of a width
    captures its graph). CUDA events on the GPU, `time.perf_counter` on the CPU, around `runner.forward` (input
    padding, mask, graph replay or eager forward).

    Raises:
        ValueError: if the query is empty, `reps` < 1 or `stat` is unknown.
    """
    _check_timing_args("time_static_forward", int(query_ids.shape[1]), reps, stat)
    warmup = max(warmup, 1) if static.device.type == "cuda" else warmup
    return _time_repeats(lambda: static(query_ids, keep), static.device, reps=reps, warmup=warmup, stat=stat,
                         cpu_log=cpu_log)


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
                    seed: int, stat: str = "median", runtime: str = "eager") -> float:
    """Seconds outside model forwards per decoding step of `row`'s strategy at this shape (random weights).

    Runs the library's `generate` on a random prompt of `prompt_tokens` tokens for `new_tokens` tokens (EOS
    stopping off), once untimed, then `reps` times; median (`stat`: or minimum) of
    (wall_time_s - forward_time_s) / decode forwards. `runtime="static"` passes `cache_implementation="static"`
    (the static runtime; on CUDA the untimed call captures the graphs), `runtime="compiled"` also
    `compile_config=CompileConfig()` (the untimed call compiles); :func:`~.count.runtime_kwargs`.
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
    extra.update(runtime_kwargs(runtime))
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


def _time_widths_eager(name: str, model, info: dict, keeps: dict, *, reps: int, warmup: int, seed: int, stat: str,
                       cpu_log: list, **_) -> None:
    """Fill `info["cached"]` / `info["uncached"]` (q -> seconds) with `time_forward` (the eager runtime)."""
    for cached, widths in ((True, info["widths"]["cached"]), (False, info["widths"]["uncached"])):
        table = info["cached" if cached else "uncached"]
        for q in widths:
            if q in table:
                continue
            keep = keeps.get((cached, q), q)
            table[q] = time_forward(model, q, info["context"] if cached else 0, keep, reps=reps, warmup=warmup,
                                    seed=seed, stat=stat, cpu_log=cpu_log)
            _print_width(name, info, cached, q, keep, table[q])


def _time_widths_static(name: str, model, info: dict, keeps: dict, *, reps: int, warmup: int, seed: int, stat: str,
                        cpu_log: list, max_new_tokens: int, compile_config=None) -> None:
    """Fill `info["cached"]` / `info["uncached"]` with `time_static_forward`: one `StaticForward` over the stored
    context (cached curve) and one over an empty cache (prefill curve), sharing one static cache of
    `static_cache_length(context, max_new_tokens, widest width)` columns (what `generate` allocates for a prompt
    of that length), with `compile_config` (`generate`'s; None: captured graphs); records `info["runtime"]` (how
    the runner ran its forwards) and `info["cache_columns"]`."""
    from hf_dllm_spec.runtime.static import clear_static_state, static_cache_length

    widest = max(info["widths"]["cached"] + info["widths"]["uncached"], default=1)
    ctx = info["context"]
    columns = static_cache_length(ctx, max_new_tokens, widest)
    ids = _random_ids(int(model.config.vocab_size), ctx + widest, seed, model.device)
    clear_static_state(model)
    for cached, widths in ((True, info["widths"]["cached"]), (False, info["widths"]["uncached"])):
        table = info["cached" if cached else "uncached"]
        todo = [q for q in widths if q not in table]
        if not todo:
            continue
        static = StaticForward(model, ids[:, :ctx] if cached else ids[:, :0], columns, compile_config=compile_config)
        info["runtime"], info["cache_columns"] = static.runner.runtime_note, static.runner.cache.max_cache_len
        start = ctx if cached else 0
        for q in todo:
            keep = keeps.get((cached, q), q)
            table[q] = time_static_forward(static, ids[:, start:start + q], keep, reps=reps, warmup=warmup,
                                           stat=stat, cpu_log=cpu_log)
            _print_width(name, info, cached, q, keep, table[q])


def _print_width(name: str, info: dict, cached: bool, q: int, keep: int, seconds: float) -> None:
    print(f"time {name:20s} {'cached' if cached else 'prefill'} q={q:4d} "
          f"ctx={info['context'] if cached else 0:5d} keep={keep:4d} {seconds * 1e3:9.2f} ms", flush=True)


def _shape_entries(points: dict, quant: str, dtype: torch.dtype, max_widths: int, context: int | None) -> dict:
    """The `time_phase` entry of every shape the COUNT phase needs (widths to time, context, memory estimate)."""
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
    return shapes


def time_phase(count: dict, scale: str, groups: list[str], device: torch.device, dtype: torch.dtype, quant: str, *,
               reps: int, warmup: int, max_widths: int, context: int | None, outside_tokens: int, outside_reps: int,
               seed: int, stat: str = "median", runtime: str = "eager", stock_tokens: int = 64,
               stock_reps: int = 3) -> dict:
    """Build each group's models at `scale`, time the widths the COUNT phase saw, measure the outside time.

    With `runtime="static"` the widths are timed through the static runtime (`time_static_forward`: CUDA-graph
    replays on a GPU, eager over the static cache on the CPU), the outside time is measured with
    `cache_implementation="static"`; `runtime="compiled"` does the same with `compile_config=CompileConfig()`
    (forwards and steps compiled by `torch.compile`, where transformers' rule compiles: on a GPU); with either,
    every timed shape also gets its AR baseline
    (`baseline.measure_baseline`: stock transformers `generate(cache_implementation="static")` on its stock twin,
    `stock_tokens` new tokens, `stock_reps` timed pairs, prompt = the shape's cache length).

    Returns:
        `dict` with "shapes": name -> {"params", "source", "context", "cached": {q: s}, "uncached": {q: s},
        "keep": {...}, "skipped": reason or None, "build_s"} and "outside": row key -> seconds per step; with
        `runtime="static"` or "compiled" also "runtime" (that name) and "baselines": shape name -> the baseline's
        dict.

    Raises:
        ValueError: if `runtime` is not one of :data:`RUNTIMES`.
    """
    compile_config = runtime_kwargs(runtime).get("compile_config")         # (checks `runtime` first)
    points = needed_points(count, scale, groups)
    shapes = _shape_entries(points, quant, dtype, max_widths, context)
    static = runtime != "eager"
    time_widths = partial(_time_widths_static, compile_config=compile_config) if static else _time_widths_eager
    outside: dict[str, float] = {}
    baselines: dict[str, dict] = {}
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
            cpu_log: list = []
            time_widths(n, built[n], shapes[n], points[n]["keep"], reps=reps, warmup=warmup, seed=seed, stat=stat,
                        cpu_log=cpu_log, max_new_tokens=int(count.get("max_new_tokens", 48)))
            if cpu_log:
                wall_s, cpu_s = sum(w for w, _ in cpu_log), sum(c for _, c in cpu_log)
                shapes[n]["wall_over_cpu"] = wall_s / cpu_s if cpu_s else None
        for row in rows:
            tokens = max(outside_tokens, _block_size(row))
            drafter = built.get(drafter_name) if row["drafter"] else None
            outside[row["key"]] = measure_outside(built[target_name], drafter, row,
                                                  prompt_tokens=row["median_prompt_tokens"], new_tokens=tokens,
                                                  reps=outside_reps, seed=seed, stat=stat, runtime=runtime)
            print(f"outside {row['key']:40s} {outside[row['key']] * 1e3:8.2f} ms/step", flush=True)
        if static:
            _measure_baselines(names, built, shapes, baselines, device=device, dtype=dtype, quant=quant, seed=seed,
                               new_tokens=stock_tokens, reps=stock_reps, stat=stat)
        del built
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = {"shapes": shapes, "outside": outside}
    if static:
        out.update(runtime=runtime, baselines=baselines)
    return out


def _measure_baselines(names: list[str], built: dict, shapes: dict, baselines: dict, *, device: torch.device,
                       dtype: torch.dtype, quant: str, seed: int, new_tokens: int, reps: int, stat: str) -> None:
    """`baseline.measure_baseline` for each shape of `names` that has none yet (into `baselines`); the static
    states of the built models are dropped first (their caches and graphs free memory for a stock twin)."""
    from hf_dllm_spec.runtime.static import clear_static_state

    from .baseline import measure_baseline

    for model in built.values():
        clear_static_state(model)
    for n in names:
        if n in baselines:
            continue
        need = shapes[n]["estimated_bytes"] + (shapes[n]["build_bytes"] if quant != "none" else 0)
        baselines[n] = measure_baseline(SHAPES[n], built[n], device=device, dtype=dtype, quant=quant, seed=seed,
                                        prompt_tokens=shapes[n]["context"], new_tokens=new_tokens, reps=reps,
                                        stat=STATS[stat], needed_bytes=need)
        b = baselines[n]
        if "skipped" in b:
            print(f"baseline {n:20s} skipped: {b['skipped']}", flush=True)
        else:
            print(f"baseline {n:20s} {b['baseline']} {b['class']} ({'compiled' if b['compiled'] else 'not compiled'})"
                  f" {b['step_s'] * 1e3:8.2f} ms/step", flush=True)
