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
