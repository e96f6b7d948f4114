"""PREDICT phase of the cost model, pure functions: forward time by interpolation over measured widths, the
predicted decoding time and tokens/s of each COUNT row, and the efficiency figure (docs/performance.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from .shapes import SCALES


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


# -- the targets of issue 25 (the static-runtime mode: `--runtime static`, `hf-dllm-spec bench-gpu`) ----------------
#: A forward of any width up to `MAX_TARGET_WIDTH` costs at most this many stock compiled AR steps.
WIDTH_TARGET = 1.3
MAX_TARGET_WIDTH = 64
#: Time outside forwards: at most this share of a decoding step.
OUTSIDE_TARGET = 0.10
#: Predicted tokens/s over stock compiled AR, for the strategies of `SPEEDUP_STRATEGIES`.
SPEEDUP_TARGET = 2.0
SPEEDUP_STRATEGIES = ("s2d2", "block_diffusion", "fast_dllm_v2", "llada2", "deer")
#: End to end (bundled models): wall speedup over the library's AR >= this x the forward-count ratio.
EFFICIENCY_TARGET = 0.85


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or denominator != denominator or denominator <= 0:
        return None
    return numerator / denominator


def _met(value: float | None, target: float | None, at_most: bool) -> bool | None:
    """Whether `value` meets `target` (<= when `at_most`, else >=); None when either is missing."""
    if value is None or target is None or value != value:
        return None
    return value <= target if at_most else value >= target


def _step_of(baseline: dict | None) -> float | None:
    """Seconds of the baseline's AR decode step, None when it was skipped or not measured."""
    return None if not baseline or "skipped" in baseline else baseline.get("step_s")


def width_targets(timing: dict) -> list[dict]:
    """Per timed shape and width: seconds of one forward, the shape's stock step, their ratio and the 1.3 target
    (widths up to 64; wider ones carry no target).

    Returns:
        `list[dict]` with "shape", "curve" ("cached" / "prefill"), "q", "seconds", "stock_step_s", "ratio",
        "target" (None above 64 tokens), "met" (None when not applicable).
    """
    out = []
    baselines = timing.get("baselines", {})
    for name, info in timing["shapes"].items():
        if info.get("skipped"):
            continue
        step = _step_of(baselines.get(name))
        for curve, key in (("cached", "cached"), ("prefill", "uncached")):
            for q, seconds in sorted((int(k), float(v)) for k, v in info[key].items()):
                target = WIDTH_TARGET if q <= MAX_TARGET_WIDTH else None
                ratio = _ratio(seconds, step)
                out.append({"shape": name, "curve": curve, "q": q, "seconds": seconds, "stock_step_s": step,
                            "ratio": ratio, "target": target, "met": _met(ratio, target, at_most=True)})
    return out


def outside_targets(count: dict, timing: dict, predict: list[dict], scale: str) -> list[dict]:
    """Per predicted row: seconds outside forwards per decoding step, the predicted forward seconds per decoding
    step (its non-prefill forwards over its decoding steps), and the outside share of a step,
    o / (o + forward seconds per step), against the 10% target.

    Returns:
        `list[dict]` with "key", "outside_s_per_step", "forward_s_per_step", "share", "target", "met".
    """
    curves = curves_of(timing)
    rows = {r["key"]: r for r in count["rows"]}
    out = []
    for entry in predict:
        if "predicted_forward_s" not in entry:
            continue
        row = rows[entry["key"]]
        target_name, drafter_name = SCALES[scale][row["group"]]
        shape_of = {"target": target_name, "drafter": drafter_name}
        decode = [(f[0], f[2], f[3], f[5]) for f in row["forwards"] if f[1] != "prefill"]
        fwd, _ = predict_seconds(decode, lambda role, q, ctx: curves[shape_of[role]].seconds(q, ctx), 0, 0.0)
        per_step = _ratio(fwd, row["decode_forwards"])
        o = entry["outside_s_per_step"]
        share = _ratio(o, o + per_step) if per_step is not None else None
        out.append({"key": entry["key"], "outside_s_per_step": o, "forward_s_per_step": per_step, "share": share,
                    "target": OUTSIDE_TARGET, "met": _met(share, OUTSIDE_TARGET, at_most=True)})
    return out


def strategy_targets(count: dict, timing: dict, predict: list[dict]) -> list[dict]:
    """Per predicted row: predicted tokens/s against the stock compiled AR tokens/s of its target shape
    (1 / the stock decode step), and the 2x target for the strategies of `SPEEDUP_STRATEGIES`.

    Returns:
        `list[dict]` with "key", "strategy", "target_shape", "predicted_tokens_per_s", "stock_tokens_per_s",
        "ratio", "target" (None for AR and the strategies without one), "met".
    """
    strategies = {r["key"]: r["strategy"] for r in count["rows"]}
    baselines = timing.get("baselines", {})
    out = []
    for entry in predict:
        strategy = strategies[entry["key"]]
        step = _step_of(baselines.get(entry["target_shape"]))
        stock_tps = _ratio(1.0, step)
        ratio = _ratio(entry.get("predicted_tokens_per_s"), stock_tps)
        target = SPEEDUP_TARGET if strategy in SPEEDUP_STRATEGIES else None
        out.append({"key": entry["key"], "strategy": strategy, "target_shape": entry["target_shape"],
                    "predicted_tokens_per_s": entry.get("predicted_tokens_per_s"), "stock_tokens_per_s": stock_tps,
                    "ratio": ratio, "target": target, "met": _met(ratio, target, at_most=False)})
    return out


def end_to_end_targets(count: dict, predict: list[dict]) -> list[dict]:
    """Per non-AR row: the COUNT phase's measured wall speedup over the library's AR, the forward-count ratio,
    their quotient (the measured efficiency) and the 0.85 target, with the COUNT device and runtime.

    Returns:
        `list[dict]` with "key", "speedup", "forward_ratio", "efficiency", "target", "met", "count_device",
        "count_runtime".
    """
    strategies = {r["key"]: r["strategy"] for r in count["rows"]}
    out = []
    for entry in predict:
        if strategies[entry["key"]] == "ar":
            continue
        m = entry["measured"]
        eff = m["efficiency"] if m["efficiency"] == m["efficiency"] else None
        out.append({"key": entry["key"], "speedup": m["speedup"], "forward_ratio": m["forward_ratio"],
                    "efficiency": eff, "target": EFFICIENCY_TARGET, "met": _met(eff, EFFICIENCY_TARGET, False),
                    "count_device": count.get("device", "cpu"), "count_runtime": count.get("runtime", "eager")})
    return out


def targets_phase(count: dict, timing: dict, predict: list[dict], scale: str) -> dict:
    """Every target of issue 25 against the numbers of a static-runtime run (pure; the report prints it).

    Returns:
        `dict` with "widths" (:func:`width_targets`), "outside" (:func:`outside_targets`), "strategies"
        (:func:`strategy_targets`), "end_to_end" (:func:`end_to_end_targets`) and "limits" (the target values).
    """
    return {"widths": width_targets(timing), "outside": outside_targets(count, timing, predict, scale),
            "strategies": strategy_targets(count, timing, predict), "end_to_end": end_to_end_targets(count, predict),
            "limits": {"width_ratio_at_most": WIDTH_TARGET, "max_width": MAX_TARGET_WIDTH,
                       "outside_share_at_most": OUTSIDE_TARGET, "speedup_over_stock_at_least": SPEEDUP_TARGET,
                       "speedup_strategies": list(SPEEDUP_STRATEGIES), "efficiency_at_least": EFFICIENCY_TARGET}}
