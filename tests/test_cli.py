"""The `hf-dllm-spec` command line: subcommands, strategy options built from the config dataclasses, errors,
generate on the bundled model, and the packaging rule that scripts and tests import installed modules only."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import pytest
import torch

from hf_dllm_spec import cli
from hf_dllm_spec.evaluation import DEFAULT_MODEL, ROOT, arithmetic_prompts, load
from hf_dllm_spec.registry import STRATEGIES, resolve_config

SUBCOMMANDS = ("generate", "main", "bench", "bench-batch", "export", "strategies")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`cli.main(argv)` in-process: (exit code, stdout, stderr)."""
    try:
        cli.main(list(argv))
        code = 0
    except SystemExit as exit_:
        code = exit_.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def generate_args(*argv: str):
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", *argv])
    return cli.given_strategy_parameters(args)


def test_help_lists_the_subcommands(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    for name in SUBCOMMANDS:
        assert f"\n    {name}" in out


def test_console_script_is_installed():
    script = pathlib.Path(sys.executable).with_name("hf-dllm-spec")
    if not script.exists():
        pytest.skip("the package is not installed with its console script")
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True).stdout
    assert all(name in out for name in SUBCOMMANDS)


def test_every_strategy_parameter_is_an_option():
    """Options come from the dataclass fields of every registered strategy config, nothing hand-written."""
    dests = {a.dest for a in cli.build_parser()._subparsers._group_actions[0].choices["generate"]._actions}
    for strategy in STRATEGIES.values():
        for field in dataclasses.fields(strategy.config_class):
            assert cli.PARAM_PREFIX + field.name in dests, field.name


def test_parameters_are_typed_from_the_annotations():
    assert generate_args() == {}                     # unset options are not passed: the strategy defaults apply
    params = generate_args("--block-size", "8", "--confidence_threshold", "0.7", "--cache-ver",
                           "--allow-resample", "false", "--s2d2-acceptance", "none", "--do-verify-policy",
                           "score_hysteresis", "--steps-per-block", "none")
    assert params == {"block_size": 8, "confidence_threshold": 0.7, "cache_ver": True, "allow_resample": False,
                      "s2d2_acceptance": None, "do_verify_policy": "score_hysteresis", "steps_per_block": None}
    assert type(params["block_size"]) is int and type(params["confidence_threshold"]) is float


def test_a_malformed_value_is_a_usage_error(capsys):
    code, _, err = run_cli(capsys, "generate", "--prompt", "x", "--block-size", "four")
    assert code == 2 and "invalid int" in err and "--block-size" in err


@pytest.mark.parametrize("argv,strategy,overrides,preset", [
    (["--confidence-threshold", "1.5"], "s2d2", {"confidence_threshold": 1.5}, None),
    (["--strategy", "ar", "--min-ssd-span-length", "2"], "ar", {"min_ssd_span_length": 2}, None),
    (["--remasking-strategy", "bogus"], "s2d2", {"remasking_strategy": "bogus"}, None),
    (["--preset", "no-such-preset"], "s2d2", {}, "no-such-preset"),
])
def test_a_bad_parameter_gives_the_library_error(capsys, argv, strategy, overrides, preset):
    with pytest.raises(ValueError) as library:
        resolve_config(strategy, preset=preset, overrides=overrides)
    code, out, err = run_cli(capsys, "generate", "--prompt", "x", *argv)
    assert code == 2 and out == ""
    assert str(library.value) in err


@pytest.fixture(scope="module")
def bundled():
    tokenizer, model = load(DEFAULT_MODEL)
    return tokenizer, model, arithmetic_prompts(DEFAULT_MODEL, 1)[0].text


@pytest.mark.parametrize("strategy,argv,params", [
    ("s2d2", ["--block-size", "4", "--min-ssd-span-length", "1", "--cache-ver", "--draft-ver"],
     {"block_size": 4, "min_ssd_span_length": 1, "cache_ver": True, "draft_ver": True}),
    ("block_diffusion", ["--block_size", "4", "--confidence-threshold", "0.9"],
     {"block_size": 4, "confidence_threshold": 0.9}),
    ("ar", [], {}),
])
def test_generate_prints_what_generate_returns(capsys, bundled, strategy, argv, params):
    tokenizer, model, prompt = bundled
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = model.generate(ids, decoding_strategy=strategy, max_new_tokens=8,
                              generator=torch.Generator().manual_seed(0), **params)
    expected_text = tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)
    code, out, err = run_cli(capsys, "generate", "--prompt", prompt, "--strategy", strategy, "--max-new-tokens", "8",
                             "--stats", *argv)
    assert code == 0
    assert out == expected_text + "\n"
    assert f"spec stats ({strategy}):" in err and "  nfe: " in err and "  num_generated_tokens: " in err


def test_generate_with_a_preset_and_sampling(capsys, bundled):
    tokenizer, model, prompt = bundled
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = model.generate(ids, decoding_strategy="s2d2", preset="sdar-1.7b-config-a", max_new_tokens=8,
                              do_sample=True, top_k=5, generator=torch.Generator().manual_seed(3))
    code, out, _ = run_cli(capsys, "generate", "--prompt", prompt, "--preset", "sdar-1.7b-config-a",
                           "--max-new-tokens", "8", "--do-sample", "--top-k", "5", "--seed", "3")
    assert code == 0
    assert out == tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True) + "\n"


def test_main_job_runs_through_the_cli(capsys):
    code, out, _ = run_cli(capsys, "main", "--num-arith", "2", "--num-humaneval", "1", "--max-new-tokens", "8",
                           "--block-size", "4", "--strategies", "dynamic,s2d2", "--no-progress")
    assert code == 0
    assert "=== held-out arithmetic: 2 prompts, max_new_tokens=8 ===" in out
    assert "| AR (block size 1) |" in out and "| S2D2, B=4 |" in out and "| dynamic tau=0.9, B=4 |" in out


def test_export_calls_export_checkpoint(capsys, monkeypatch, tmp_path):
    export = pytest.importorskip("hf_dllm_spec.export")
    calls = []
    monkeypatch.setattr(export, "export_checkpoint", lambda *a, **k: calls.append((a, k)) or pathlib.Path(a[1]))
    code, out, _ = run_cli(capsys, "export", "src_dir", str(tmp_path / "out"), "--overwrite")
    assert code == 0 and calls == [(("src_dir", str(tmp_path / "out")), {"overwrite": True})]
    assert "exported src_dir" in out


def test_scripts_run_from_anywhere(tmp_path):
    """The thin scripts import installed modules: they run with another working directory."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sweep.py"), "--help"], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert "--block-sizes" in out


def test_no_sys_path_edits():
    needle = "sys" + ".path"
    offenders = [str(p.relative_to(ROOT)) for folder in ("examples", "benchmarks", "tests", "recipes")
                 for p in (ROOT / folder).rglob("*.py") if needle in p.read_text(encoding="utf-8")]
    assert offenders == []
