"""hf_dllm_spec.tools.cost_model (benchmarks/cost_model.py): the pure maths (interpolation, prediction, efficiency)
against hand-computed values, the COUNT phase's trace against the statistics, and a smoke run of the COUNT and
TIME phases on the bundled SDAR model (1 prompt, 8 tokens, tiny shape)."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from conftest import cpu_compile_config
from hf_dllm_spec.tools.cost_model.cli import main
from hf_dllm_spec.tools.cost_model.count import count_phase, default_rows, tally
from hf_dllm_spec.tools.cost_model.measure import representative_context, select_widths
from hf_dllm_spec.tools.cost_model.predict import (TimeCurve, efficiency, interpolate, outside_per_step, predict_phase,
                                             predict_seconds)
from hf_dllm_spec.tools.cost_model.shapes import SCALES, SHAPES, build_model
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


def test_bad_arguments_are_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--quant", "nf4", "--dtype", "float32", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["--groups", "sdar,nope", "--out", str(tmp_path)])
    # before: counted and timed everything, then failed on an empty median (or read -1 as 499 prompts); a mistyped
    # row label silently kept only the AR rows
    for argv, flag in [(["--outside-reps", "0"], "--outside-reps"), (["--num-prompts", "0"], "--num-prompts"),
                       (["--num-prompts", "-1"], "--num-prompts"), (["--rows", "dynamic 0.9 B=5"], "--rows")]:
        with pytest.raises(SystemExit) as exit_:
            main(["--groups", "sdar", "--count-only", "--out", str(tmp_path), *argv])
        assert exit_.value.code == 2 and flag in capsys.readouterr().err
    assert not list(tmp_path.iterdir())                                           # nothing ran, nothing written


def test_serving_bench_percentiles_are_nearest_rank():
    """Before: `round` (half to even) put the p50 of 10, 30 or 2 values and the p95 of 20 one rank too high."""
    from hf_dllm_spec.tools.serving_bench import _percentile

    for n, q in [(2, 0.5), (6, 0.5), (10, 0.5), (20, 0.95), (30, 0.5), (96, 0.5), (96, 0.95), (1, 0.95)]:
        assert _percentile(list(range(1, n + 1)), q) == math.ceil(q * n)


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
    saved = json.loads((tmp_path / "tiny-cpu-float32-sdar-rows.json").read_text())     # the name says what ran
    assert saved["meta"]["shape"] == "tiny" and saved["predict"]
    assert "## PREDICT" in (tmp_path / "tiny-cpu-float32-sdar-rows.md").read_text()
    assert (tmp_path / "tiny-cpu-float32-sdar-rows.png").stat().st_size > 0


# -- the static-runtime mode (`--runtime static`, `hf-dllm-spec bench-gpu`, issue 25) --------------------------------
def _hand_targets_inputs():
    """One shape, a stock step of 10 ms, an AR row and a dynamic row (as `predict_phase` leaves them)."""
    shape = SCALES["tiny"]["sdar"][0]
    timing = {"shapes": {shape: {"cached": {"1": 0.012, "64": 0.014, "128": 0.030}, "uncached": {"20": 0.011},
                                 "context": 30, "skipped": None}},
              "outside": {"sdar/AR": 0.001, "sdar/fast": 0.004},
              "baselines": {shape: {"step_s": 0.010, "baseline": "stock"}}}
    count = {"device": "cuda", "runtime": "static", "rows": [
        {"key": "sdar/AR", "group": "sdar", "strategy": "ar", "decode_forwards": 10,
         "forwards": [["target", "prefill", 20, 0, 1, 1], ["target", "draft", 1, 25, 1, 10]]},
        {"key": "sdar/fast", "group": "sdar", "strategy": "block_diffusion", "decode_forwards": 2,
         "forwards": [["target", "prefill", 20, 0, 1, 1], ["target", "draft", 64, 25, 64, 2]]}]}
    predict = [{"key": "sdar/AR", "target_shape": shape, "predicted_forward_s": 0.131, "outside_s_per_step": 0.001,
                "predicted_tokens_per_s": 70.0, "measured": {"speedup": 1.0, "forward_ratio": 1.0, "efficiency": 1.0}},
               {"key": "sdar/fast", "target_shape": shape, "predicted_forward_s": 0.039, "outside_s_per_step": 0.004,
                "predicted_tokens_per_s": 250.0,
                "measured": {"speedup": 3.0, "forward_ratio": 4.0, "efficiency": 0.75}}]
    return count, timing, predict


def test_targets_by_hand_meet_and_miss():
    """Ratios are the plain divisions and every met / not met follows its number (both outcomes occur)."""
    from hf_dllm_spec.tools.cost_model.predict import targets_phase

    count, timing, predict = _hand_targets_inputs()
    targets = targets_phase(count, timing, predict, "tiny")
    widths = {(w["curve"], w["q"]): w for w in targets["widths"]}
    assert widths["cached", 1]["ratio"] == pytest.approx(1.2) and widths["cached", 1]["met"] is True
    assert widths["cached", 64]["ratio"] == pytest.approx(1.4) and widths["cached", 64]["met"] is False
    assert widths["cached", 128]["target"] is None and widths["cached", 128]["met"] is None     # wider than 64
    assert widths["prefill", 20]["ratio"] == pytest.approx(1.1) and widths["prefill", 20]["met"] is True
    outside = {o["key"]: o for o in targets["outside"]}
    assert outside["sdar/AR"]["forward_s_per_step"] == pytest.approx(0.012)        # 10 x q=1 at 12 ms over 10 steps
    assert outside["sdar/AR"]["share"] == pytest.approx(0.001 / 0.013) and outside["sdar/AR"]["met"] is True
    assert outside["sdar/fast"]["share"] == pytest.approx(0.004 / 0.018) and outside["sdar/fast"]["met"] is False
    speed = {s["key"]: s for s in targets["strategies"]}
    assert speed["sdar/AR"]["stock_tokens_per_s"] == pytest.approx(100.0)
    assert speed["sdar/AR"]["target"] is None and speed["sdar/AR"]["met"] is None
    assert speed["sdar/fast"]["ratio"] == pytest.approx(2.5) and speed["sdar/fast"]["met"] is True
    (e2e,) = targets["end_to_end"]
    assert (e2e["key"], e2e["efficiency"], e2e["met"], e2e["count_runtime"]) == ("sdar/fast", 0.75, False, "static")
    timing["baselines"] = {}                                              # no baseline: no ratio, no verdict
    assert all(w["ratio"] is None and w["met"] is None for w in targets_phase(count, timing, predict, "tiny")["widths"])


def test_time_ar_steps_takes_the_prefill_out(monkeypatch):
    """t(n) = 50 ms + 10 ms x n on a fake clock: the step is 10 ms, the whole call 90 ms for 4 tokens."""
    import torch

    from hf_dllm_spec.tools.cost_model import baseline

    clock = [0.0]
    monkeypatch.setattr(baseline, "now", lambda device: clock[0])

    def call(n):
        clock[0] += 0.050 + 0.010 * n

    timing = baseline.time_ar_steps(call, torch.device("cpu"), new_tokens=4, reps=2)
    assert timing["step_s"] == pytest.approx(0.010) and timing["call_s"] == pytest.approx(0.090)
    assert timing["prefill_call_s"] == pytest.approx(0.060) and timing["per_token_s"] == pytest.approx(0.0225)
    with pytest.raises(ValueError, match="--stock-tokens"):
        baseline.time_ar_steps(call, torch.device("cpu"), new_tokens=1, reps=1)


def test_stock_twins_have_the_dimensions_of_the_shape():
    from hf_dllm_spec.tools.cost_model.baseline import stock_twin
    from hf_dllm_spec.tools.cost_model.shapes import count_parameters

    sdar, fast = stock_twin(SHAPES["tiny:sdar-tiny-arith"]), stock_twin(SHAPES["tiny:fast-dllm-v2-tiny"])
    assert (sdar.family, fast.family) == ("qwen3", "qwen2")
    assert count_parameters(sdar) == count_parameters(SHAPES["tiny:sdar-tiny-arith"])
    assert count_parameters(fast) == count_parameters(SHAPES["tiny:fast-dllm-v2-tiny"])
    assert stock_twin(SHAPES["tiny:qwen2-tiny-ar"]) is SHAPES["tiny:qwen2-tiny-ar"]     # already stock Qwen2
    assert stock_twin(SHAPES["tiny:llada2-tiny"]) is None                               # no stock MoE class


@pytest.mark.parametrize("name", ["tiny:sdar-tiny-arith", "tiny:qwen2-tiny-ar"])
def test_static_time_forward_gives_the_eager_logits(name):
    """The static TIME forward (StaticModelRunner, read-only over the stored context) and the eager path's model
    call (`time_forward`'s EagerForward) give the same logits for one width; the write position stays put."""
    import torch

    from hf_dllm_spec.tools.cost_model.measure import EagerForward, StaticForward, time_static_forward
    from hf_dllm_spec.runtime.static import static_cache_length, static_states

    model = build_model(SHAPES[name], torch.device("cpu"), torch.float32, "none", 0)
    q, ctx = 3, 10
    eager = EagerForward(model, q, ctx, q, seed=1)
    with torch.inference_mode():
        expected = eager()                                                    # (1, 3, V) raw model rows
    static = StaticForward(model, eager.ids[:, :ctx], static_cache_length(ctx, 8, q))
    got = static(eager.ids[:, ctx:], q)
    if static.right_shift:      # the runner aligns: row i predicts query token i, i.e. the model's row i - 1
        expected = expected[:, :-1]
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
    assert time_static_forward(static, eager.ids[:, ctx:], q, reps=2, warmup=0) > 0
    assert static.runner.lengths.tolist() == [ctx]                                   # read-only: nothing stored
    compiled = StaticForward(model, eager.ids[:, :ctx], static_cache_length(ctx, 8, q),
                             compile_config=cpu_compile_config())        # check-gpu --compiled-widths
    assert compiled.runner.compile_mode == "compile"
    torch.testing.assert_close(compiled(eager.ids[:, ctx:], q), got, atol=1e-5, rtol=1e-5)
    assert any(key[0] == "forward" for state in static_states(model) for key in state.steps.keys)   # compiled


@pytest.mark.parametrize("runtime", ["static", "compiled"])
def test_static_mode_smoke_prints_the_stock_baseline_and_the_targets(tmp_path, runtime):
    """`--runtime static` (and `compiled`: the same with `compile_config=CompileConfig()`, which transformers' rule
    does not compile on a CPU) on the CPU at the tiny shape, 1 prompt: the report has the stock baseline, every
    ratio is the division of the numbers in the JSON, and met / not met follows the numbers."""
    result = main(["--groups", "sdar", "--rows", "dynamic 0.9 B=4", "--num-prompts", "1", "--max-new-tokens", "8",
                   "--reps", "1", "--warmup", "0", "--max-widths", "2", "--outside-tokens", "4", "--outside-reps",
                   "1", "--runtime", runtime, "--stock-tokens", "8", "--stock-reps", "3", "--out", str(tmp_path),
                   "--no-plot"])     # 8 tokens, median of 3: a step of 3 tokens, once, measured < 0 on a busy machine
    saved = json.loads((tmp_path / f"tiny-cpu-float32-{runtime}-sdar-rows.json").read_text())
    assert saved["meta"]["runtime"] == runtime and saved["time"]["runtime"] == runtime
    shape = "tiny:sdar-tiny-arith"
    base = saved["time"]["baselines"][shape]
    assert (base["baseline"], base["class"], base["compiled"]) == ("stock", "Qwen3ForCausalLM", False)
    assert base["step_s"] == pytest.approx((base["call_s"] - base["prefill_call_s"]) / 7)
    assert base["step_s"] > 0, f"the stock step was not measurable on this machine: {base}"
    info = saved["time"]["shapes"][shape]
    assert info["runtime"].startswith("static cache, eager")
    targets = saved["targets"]
    assert targets == json.loads(json.dumps(result["targets"]))
    for w in targets["widths"]:
        table = info["cached" if w["curve"] == "cached" else "uncached"]
        assert w["ratio"] == pytest.approx(table[str(w["q"])] / base["step_s"])
        assert w["met"] == (w["ratio"] <= 1.3)
    predicted = {e["key"]: e for e in saved["predict"]}
    for r in targets["strategies"]:
        assert r["ratio"] == pytest.approx(predicted[r["key"]]["predicted_tokens_per_s"] * base["step_s"])
        assert r["met"] == (None if r["strategy"] == "ar" else r["ratio"] >= 2.0)
    for o in targets["outside"]:
        assert o["outside_s_per_step"] == saved["time"]["outside"][o["key"]]
        assert o["met"] == (o["share"] <= 0.10)
    (e2e,) = targets["end_to_end"]
    measured = predicted["sdar/dynamic 0.9 B=4"]["measured"]
    assert e2e["efficiency"] == pytest.approx(measured["speedup"] / measured["forward_ratio"])
    assert e2e["met"] == (e2e["efficiency"] >= 0.85)
    md = (tmp_path / f"tiny-cpu-float32-{runtime}-sdar-rows.md").read_text()
    assert "stock step ms" in md and "Qwen3ForCausalLM" in md and "not compiled" in md
    assert ("compile_config=CompileConfig()" in md) == (runtime == "compiled")
    verdict = "met" if targets["strategies"][1]["met"] else "not met"
    assert f"| >= 2.0 | {verdict} |" in md


def test_count_phase_under_the_static_runtime_gives_the_eager_tokens():
    (row,) = [r for r in default_rows() if r.key == "sdar/dynamic 0.9 B=4"]
    eager = count_phase([row], num_prompts=1, max_new_tokens=8, seed=0)
    static = count_phase([row], num_prompts=1, max_new_tokens=8, seed=0, runtime="static")
    assert "runtime" not in eager and static["runtime"] == "static" and static["device"] == "cpu"
    (e,), (s,) = eager["rows"], static["rows"]
    assert (s["tokens"], s["nfe"], s["accuracy"]) == (e["tokens"], e["nfe"], e["accuracy"])
    assert s["recorded_forwards"] == s["nfe"] and s["params"] == row.params        # no runtime flag in the row
    compiled = count_phase([row], num_prompts=1, max_new_tokens=8, seed=0, runtime="compiled")
    (c,) = compiled["rows"]
    assert compiled["runtime"] == "compiled" and (c["tokens"], c["nfe"]) == (e["tokens"], e["nfe"])
    with pytest.raises(ValueError, match="--count-runtime"):
        count_phase([row], num_prompts=1, max_new_tokens=8, seed=0, runtime="graphs")


def test_runtimes_are_generate_keywords():
    """`--runtime` / `--count-runtime` names map to the keywords the library's `generate` gets."""
    from transformers import CompileConfig

    from hf_dllm_spec.tools.cost_model.count import RUNTIMES, runtime_kwargs

    assert RUNTIMES == ("eager", "static", "compiled")
    assert runtime_kwargs("eager") == {} and runtime_kwargs("static") == {"cache_implementation": "static"}
    compiled = runtime_kwargs("compiled")
    assert compiled["cache_implementation"] == "static" and isinstance(compiled["compile_config"], CompileConfig)
    with pytest.raises(ValueError, match="'graphs'.*eager, static or compiled"):
        runtime_kwargs("graphs")


def test_bench_gpu_without_cuda_exits_2_naming_device_and_the_cpu_smoke(capsys, monkeypatch, tmp_path):
    import torch

    from hf_dllm_spec import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench-gpu"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("hf-dllm-spec bench-gpu: error: argument --device: names a CUDA device ('cuda') but "
                          "torch here sees none")
    assert "--device cpu" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()                                   # nothing ran, nothing written
    for argv, flag in ((["--device", "foo"], "--device"), (["--device", "cpu", "--count-device", "cuda:x"],
                                                           "--count-device")):
        with pytest.raises(SystemExit) as exit_:                              # a traceback from torch.device
            cli.main(["bench-gpu", *argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"argument {flag}: must be a torch device" in err and "Traceback" not in err
    args = cli.build_parser().parse_args(["bench-gpu"])
    assert (args.device, args.dtype, args.runtime, args.count_runtime, args.shape, args.out) == \
        ("cuda", "bfloat16", "static", "static", "1.7b", None)
    assert (args.outside_tokens, args.outside_reps) == (64, 5)
    assert cli.build_parser().parse_args(["bench-gpu", "--runtime", "compiled"]).runtime == "compiled"


def test_the_output_name_says_what_ran():
    """A run of other settings never writes over another's files: a subset of groups or rows, or a COUNT phase on
    another device or runtime, is in the name (before, `--groups sdar` or `--count-runtime static` at the tiny shape
    wrote over the committed `tiny-cpu-float32.*`)."""
    from hf_dllm_spec.tools.cost_model.count import GROUPS
    from hf_dllm_spec.tools.cost_model.report import run_name

    cpu, cuda = torch.device("cpu"), torch.device("cuda:1")
    eager = {"device": "cpu"}
    assert run_name("tiny", cpu, "float32", "none", "eager", eager, GROUPS, GROUPS) == "tiny-cpu-float32"
    assert run_name("1.7b", cpu, "bfloat16", "none", "eager", eager, ("sdar", "fast_dllm_v2"), GROUPS) \
        == "1.7b-cpu-bfloat16-sdar+fast_dllm_v2"
    assert run_name("1.7b", cuda, "bfloat16", "nf4", "static", {"device": "cuda:0", "runtime": "static"}, GROUPS,
                    GROUPS) == "1.7b-cuda-bfloat16-nf4-static-count-cuda-static"
    assert run_name("tiny", cpu, "float32", "none", "eager", {"device": "cpu", "runtime": "compiled"}, GROUPS,
                    GROUPS) == "tiny-cpu-float32-count-cpu-compiled"
    assert run_name("tiny", cpu, "float32", "none", "eager", {"device": "cpu", "rows_kept": ["x"]}, ("sdar",),
                    GROUPS, count_only=True) == "count-cpu-float32-sdar-rows"
    assert run_name("tiny", cpu, "float32", "none", "eager", {"device": "cuda", "runtime": "static"}, GROUPS,
                    GROUPS, count_only=True) == "count-cuda-float32-static"
