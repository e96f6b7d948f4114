"""hf_dllm_spec.cost_model (benchmarks/cost_model.py): the pure maths (interpolation, prediction, efficiency)
against hand-computed values, the COUNT phase's trace against the statistics, and a smoke run of the COUNT and
TIME phases on the bundled SDAR model (1 prompt, 8 tokens, tiny shape)."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from hf_dllm_spec.cost_model.cli import main
from hf_dllm_spec.cost_model.count import count_phase, default_rows, tally
from hf_dllm_spec.cost_model.measure import representative_context, select_widths
from hf_dllm_spec.cost_model.predict import (TimeCurve, efficiency, interpolate, outside_per_step, predict_phase,
                                             predict_seconds)
from hf_dllm_spec.cost_model.shapes import SCALES, SHAPES, build_model
from hf_dllm_spec.outputs import FORWARD_KINDS


def test_interpolate_is_piecewise_linear_flat_below_and_extended_above():
    widths, secs = [1, 4, 8], [0.010, 0.016, 0.020]
    assert interpolate(widths, secs, 1) == pytest.approx(0.010)
    assert interpolate(widths, secs, 2) == pytest.approx(0.012)        # 0.010 + 0.006 * 1/3
    assert interpolate(widths, secs, 6) == pytest.approx(0.018)        # halfway between 4 and 8
    assert interpolate(widths, secs, 8) == pytest.approx(0.020)
    assert interpolate(widths, secs, 0.5) == pytest.approx(0.010)      # never cheaper than the narrowest point
    assert interpolate(widths, secs, 12) == pytest.approx(0.024)       # last slope 0.001 per token
    assert interpolate([4, 8], [0.02, 0.01], 16) == pytest.approx(0.01)  # a falling last segment stays flat
    assert interpolate([5], [0.3], 100) == pytest.approx(0.3)


@pytest.mark.parametrize("widths, secs", [([], []), ([1, 2], [0.1]), ([2, 2], [0.1, 0.2]), ([4, 1], [0.1, 0.2])])
def test_interpolate_rejects_bad_points(widths, secs):
    with pytest.raises(ValueError, match="interpolate"):
        interpolate(widths, secs, 3)


def test_select_widths_keeps_both_ends_and_the_most_frequent():
    counts = {1: 5, 2: 50, 4: 10, 8: 30, 16: 1, 32: 2}
    assert select_widths(counts, 10) == [1, 2, 4, 8, 16, 32]
    assert select_widths(counts, 4) == [1, 2, 8, 32]
    assert select_widths({3: 1, 5: 0}, 4) == [3]
    with pytest.raises(ValueError, match="max_widths"):
        select_widths(counts, 1)


def test_time_curve_uses_the_cached_curve_only_with_a_cache():
    curve = TimeCurve(cached={1: 0.01, 4: 0.016}, uncached={20: 0.05, 40: 0.09}, context=30)
    assert curve.seconds(2, 30) == pytest.approx(0.012)
    assert curve.seconds(30, 0) == pytest.approx(0.07)
    assert TimeCurve(cached={1: 0.01}).seconds(7, 0) == pytest.approx(0.01)     # falls back to the other curve
    with pytest.raises(ValueError, match="TIME phase"):
        TimeCurve().seconds(1, 1)


def test_representative_context_is_the_weighted_median_of_cached_forwards():
    from collections import Counter

    assert representative_context(Counter({0: 100, 10: 1, 20: 1, 30: 5})) == 30
    assert representative_context(Counter({0: 3})) == 0


def test_prediction_and_efficiency_by_hand():
    """AR: prefill (q=20, 0.05 s) + 10 steps of q=2 (0.012 s) + 1 ms outside each; 10 tokens.
    Strategy: the same prefill + 3 steps of q=8 (0.020 s) + 2 ms outside each; 10 tokens."""
    curve = TimeCurve(cached={1: 0.010, 4: 0.016, 8: 0.020}, uncached={20: 0.05}, context=30)
    time_of = lambda role, q, ctx: curve.seconds(q, ctx)  # noqa: E731
    ar_fwd, ar_out = predict_seconds([("target", 20, 0, 1), ("target", 2, 25, 10)], time_of, 10, 0.001)
    assert (ar_fwd, ar_out) == (pytest.approx(0.17), pytest.approx(0.01))
    fwd, out = predict_seconds([("target", 20, 0, 1), ("target", 8, 25, 3)], time_of, 3, 0.002)
    assert (fwd, out) == (pytest.approx(0.11), pytest.approx(0.006))
    eff = efficiency(10 / (fwd + out), 10 / (ar_fwd + ar_out), 4 / 10, 11 / 10)
    assert eff["speedup"] == pytest.approx(0.18 / 0.116)                   # 1.5517
    assert eff["forward_ratio"] == pytest.approx(2.75)                     # 11 vs 4 forwards for 10 tokens
    assert eff["efficiency"] == pytest.approx(0.18 / 0.116 / 2.75)         # 0.5643
    assert math.isnan(efficiency(1.0, 0.0, 1.0, 1.0)["efficiency"])
    assert outside_per_step(1.0, 0.8, 4) == pytest.approx(0.05) and outside_per_step(1.0, 0.8, 0) == 0.0


def test_predict_phase_on_synthetic_counts():
    """The same two runs as above through predict_phase: AR row efficiency 1, the other as by hand."""
    def row(label, strategy, forwards, decode, nfe, wall):
        return {"key": f"sdar/{label}", "group": "sdar", "label": label, "strategy": strategy, "tokens": 10,
                "nfe": nfe, "target_forwards": nfe, "drafter_forwards": 0, "drafter": None, "wall_time_s": wall,
                "decode_forwards": decode, "forwards": forwards}

    count = {"rows": [row("AR", "ar", [["target", "prefill", 20, 0, 1, 1], ["target", "draft", 2, 25, 1, 10]], 10,
                          11, 0.2),
                      row("fast", "block_diffusion", [["target", "prefill", 20, 0, 1, 1],
                                                      ["target", "draft", 8, 25, 4, 3]], 3, 4, 0.1)]}
    shape = SCALES["tiny"]["sdar"][0]
    timing = {"shapes": {shape: {"cached": {"1": 0.010, "4": 0.016, "8": 0.020}, "uncached": {"20": 0.05},
                                 "context": 30}},
              "outside": {"sdar/AR": 0.001, "sdar/fast": 0.002}}
    ar, fast = predict_phase(count, timing, "tiny", ["sdar"])
    assert ar["predicted_tokens_per_s"] == pytest.approx(10 / 0.18)
    assert ar["predicted"]["efficiency"] == pytest.approx(1.0)
    assert fast["predicted_tokens_per_s"] == pytest.approx(10 / 0.116)
    assert fast["predicted"]["efficiency"] == pytest.approx(0.18 / 0.116 / 2.75)
    assert fast["measured"]["speedup"] == pytest.approx(2.0)
    assert fast["measured"]["efficiency"] == pytest.approx(2.0 / 2.75)


def test_quantization_without_bitsandbytes_is_a_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else
                        real(name, *a))
    import torch

    with pytest.raises(ValueError, match="--quant nf4 needs bitsandbytes"):
        build_model(SHAPES["tiny:sdar-tiny-arith"], torch.device("cpu"), torch.bfloat16, "nf4", 0)


def test_bad_arguments_are_usage_errors(tmp_path):
    with pytest.raises(SystemExit):
        main(["--quant", "nf4", "--dtype", "float32", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["--groups", "sdar,nope", "--out", str(tmp_path)])


def test_count_phase_traces_every_forward_the_statistics_count():
    """COUNT on one tiny prompt with a target and a separate drafter (DEER): the trace's forwards per kind are the
    `spec_stats` kind counters, per role the target / drafter counters; the target prefills once, over no cache."""
    from collections import Counter

    (row,) = [r for r in default_rows() if r.key == "deer/DEER k=16"]
    (counted,) = count_phase([row], num_prompts=1, max_new_tokens=8, seed=0)["rows"]
    kinds, roles = Counter(), Counter()
    for role, kind, _q, _ctx, _keep, n in counted["forwards"]:
        kinds[kind] += n
        roles[role] += n
    assert kinds == Counter(counted["forward_kinds"])
    assert roles == Counter(target=counted["target_forwards"], drafter=counted["drafter_forwards"])
    assert roles["drafter"] > 0 and counted["recorded_forwards"] == counted["nfe"]
    prefill = [f for f in counted["forwards"] if f[:2] == ["target", "prefill"]]
    assert [(ctx, n) for *_, ctx, _keep, n in prefill] == [(0, 1)]
    assert 0 < prefill[0][2] <= counted["median_prompt_tokens"]


def test_tally_counts_records_and_rejects_batched_forwards():
    from hf_dllm_spec.runtime.trace import ForwardRecord

    records = [ForwardRecord("target", "prefill", 1, 12, 12, 0, 1), ForwardRecord("target", "draft", 1, 4, 0, 12, 4),
               ForwardRecord("drafter", "draft", 1, 4, 0, 12, 4), ForwardRecord("target", "draft", 1, 4, 0, 12, 4)]
    assert tally(records) == [["drafter", "draft", 4, 12, 4, 1], ["target", "draft", 4, 12, 4, 2],
                              ["target", "prefill", 12, 0, 1, 1]]
    with pytest.raises(ValueError, match="batch rows"):
        tally([ForwardRecord("target", "draft", 2, 4, 0, 12, 4)])


def test_smoke_count_and_time_phases_on_the_bundled_model(tmp_path):
    result = main(["--groups", "sdar", "--rows", "dynamic 0.9 B=4", "--num-prompts", "1", "--max-new-tokens", "8",
                      "--reps", "1", "--warmup", "0", "--max-widths", "3", "--outside-tokens", "4",
                      "--outside-reps", "1", "--out", str(tmp_path)])
    rows = result["count"]["rows"]
    assert [r["label"] for r in rows] == ["AR", "dynamic 0.9 B=4"]
    for r in rows:
        assert r["recorded_forwards"] == r["nfe"] > 0               # the hooks saw every forward the stats count
        assert {f[1] for f in r["forwards"]} <= set(FORWARD_KINDS)
        assert all(f[2] >= 1 and f[3] >= 0 for f in r["forwards"])
    ar_widths = {f[2] for f in rows[0]["forwards"] if f[1] != "prefill"}
    assert ar_widths <= {1, 2}                                         # AR: one token, or one + the fused write
    shape = result["time"]["shapes"]["tiny:sdar-tiny-arith"]
    assert shape["cached"] and all(s > 0 for s in shape["cached"].values())
    assert len(shape["cached"]) <= 3
    assert set(result["time"]["outside"]) == {"sdar/AR", "sdar/dynamic 0.9 B=4"}
    pred = {e["key"]: e for e in result["predict"]}
    assert pred["sdar/AR"]["predicted"]["efficiency"] == pytest.approx(1.0)
    assert pred["sdar/dynamic 0.9 B=4"]["predicted_tokens_per_s"] > 0
    saved = json.loads((tmp_path / "tiny-cpu-float32.json").read_text())
    assert saved["meta"]["shape"] == "tiny" and saved["predict"]
    assert "## PREDICT" in (tmp_path / "tiny-cpu-float32.md").read_text()
    assert (tmp_path / "tiny-cpu-float32.png").stat().st_size > 0
