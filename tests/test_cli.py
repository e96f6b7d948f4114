"""The `hf-dllm-spec` command line: subcommands, strategy options built from the config dataclasses, errors,
generate on the bundled model, and the packaging rule that scripts and tests import installed modules only."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from hf_dllm_spec import cli
from hf_dllm_spec.tools.jobs.evaluation import DEFAULT_MODEL, ROOT, arithmetic_prompts, load
from hf_dllm_spec.strategies.registry import STRATEGIES, resolve_config

SUBCOMMANDS = ("generate", "main", "bench", "bench-batch", "export", "strategies", "serve", "bench-gpu")


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


def test_every_strategy_parameter_has_a_description():
    """Each strategy option's help says what it does (its config docstring's own "name (`type`, ...):" entry), not
    only its default: an entry that names two fields at once gave neither a description."""
    undescribed = sorted(name for name, entry in cli.strategy_parameters().items()
                         if not cli._doc_text(entry["config"], name))
    assert undescribed == []


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


def test_a_parameter_typed_differently_by_two_strategies_follows_the_chosen_one():
    """Before: a third-party `acceptance: float` was parsed as the built-in `acceptance: str | None` of DEER and
    SimSD (the first strategy declaring it typed the option), then refused as "must be a float"."""
    from hf_dllm_spec.strategies.block_diffusion import BlockDiffusionConfig, BlockDiffusionStrategy
    from hf_dllm_spec.strategies.registry import register_strategy

    @dataclasses.dataclass
    class SoftConfig(BlockDiffusionConfig):
        """Soft.

        Args:
            acceptance (`float`, defaults to 0.5): a soft acceptance level.
        """

        acceptance: float = 0.5

    class SoftStrategy(BlockDiffusionStrategy):
        name = "soft"
        config_class = SoftConfig

    before = dict(STRATEGIES)
    try:
        register_strategy(SoftStrategy)
        soft = generate_args("--strategy", "soft", "--acceptance", "0.7")
        assert soft == {"acceptance": 0.7} and type(soft["acceptance"]) is float
        assert generate_args("--strategy", "deer", "--acceptance", "greedy_match") == {"acceptance": "greedy_match"}
        with pytest.raises(cli.UsageError, match="--acceptance"):
            generate_args("--strategy", "soft", "--acceptance", "high")
    finally:
        STRATEGIES.clear()
        STRATEGIES.update(before)
        register_strategy(before["ar"])


def test_a_malformed_value_is_a_usage_error(capsys):
    code, _, err = run_cli(capsys, "generate", "--prompt", "x", "--block-size", "four")
    assert code == 2 and "invalid int" in err and "--block-size" in err


@pytest.mark.parametrize("argv,expected", [
    (["--seed", str(2 ** 70)], "argument --seed: must be in [0, 2**64)"),             # was an OverflowError
    (["--max-new-tokens", "5000"], "lower --max-new-tokens."),                 # the library says max_new_tokens
    (["--strategy", "deer"], "the diffusion model as --draft-model."),         # ... as draft_model=
    (["--strategy", "deer", "--model", str(DEFAULT_MODEL.parent / "qwen2-tiny-ar")],
     "argument --draft-model: `draft_model` (=None) must be given for decoding_strategy='deer'; pass --draft-model <"),
])
def test_errors_name_the_subcommands_options(capsys, argv, expected):
    code, out, err = run_cli(capsys, "generate", "--prompt", "x", *argv)
    assert code == 2 and expected in err and out == "", err


def test_main_refuses_a_bad_threshold_before_loading(capsys):
    """It named `--confidence-threshold`, an option of `generate`, after the model had loaded."""
    code, out, err = run_cli(capsys, "main", "--num-arith", "1", "--num-humaneval", "0", "--threshold", "2")
    assert code == 2 and out == "" and "argument --threshold: `confidence_threshold` (=2.0)" in err


@pytest.mark.parametrize("argv,expected", [
    (["--device", "foo"], "argument --device: must be a torch device"),
    (["--device-map", '{"": "foo"}'], "argument --device-map: must be a torch device"),
    (["--strategy", "deer", "--draft-model", str(DEFAULT_MODEL.parent / "deer-drafter-tiny"), "--draft-device", "foo"],
     "argument --draft-device: must be a torch device"),
    (["--device", "cuda:0"], "argument --device: names a CUDA device"),
    (["--draft-device", "cpu"], "argument --draft-device: places the drafter (='cpu'), and no --draft-model"),
])
def test_a_device_torch_cannot_use_is_a_usage_error_before_loading(capsys, argv, expected):
    """Devices are checked before anything loads (they failed inside `.to()` / `from_pretrained`: exit 1 and a
    traceback)."""
    if "cuda" in argv[-1] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, out, err = run_cli(capsys, "generate", "--prompt", "x", *argv)
    assert code == 2 and expected in err and out == "", err


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
    assert f"spec stats ({strategy}):" in err and "forwards (NFE)" in err and "new tokens" in err


def test_generate_with_the_static_runtime_prints_the_eager_text(capsys, bundled):
    """`--cache-implementation static` runs the static runtime (stats say so) and prints the eager tokens' text."""
    tokenizer, model, prompt = bundled
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = model.generate(ids, decoding_strategy="s2d2", block_size=4, max_new_tokens=8,
                              generator=torch.Generator().manual_seed(0))
    code, out, err = run_cli(capsys, "generate", "--prompt", prompt, "--strategy", "s2d2", "--block-size", "4",
                             "--max-new-tokens", "8", "--cache-implementation", "static", "--stats")
    assert code == 0
    assert out == tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True) + "\n"
    assert "static cache" in err


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
    export = pytest.importorskip("hf_dllm_spec.hub.export")
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


# ------------------------------------------------------------------------------------------------------------------
# One error path (issue 27): the library's message, the flag named, exit status 2, no traceback unless --debug


@pytest.mark.parametrize("argv,flag,words", [
    (["generate", "--prompt", "x", "--strategy", "s2d3"], "--strategy", "did you mean 's2d2'"),
    (["generate", "--prompt", "x", "--preset", "sdar-4b-confg-a"], "--preset", "did you mean 'sdar-4b-config-a'"),
    (["generate", "--prompt", "x", "--block-size", "0"], "--block-size", "must be an integer >= 1"),
    (["generate", "--prompt", "x", "--model", "models/sdar-tiny"], "--model", "did you mean 'sdar-tiny-arith'"),
    (["generate", "--prompt", "x", "--model", "no_such_dir"], "--model", "no checkpoint directory"),
    (["main", "--set", "blok_size=4"], "--set", "did you mean 'block_size'"),
    (["main", "--set", "typo"], "--set", "KEY=VALUE"),
    (["main", "--block-size", "0"], "--block-size", "must be >= 1"),
    (["main", "--num-arith", "0", "--num-humaneval", "0"], "--num-arith", "leave no prompts"),
    (["main", "--strategies", "ar,dynamc"], "--strategies", "did you mean 'dynamic'"),
    (["main", "--num-arith", "-1"], "--num-arith", "must be >= 0"),
    (["bench", "--block-sizes", "0"], "--block-sizes", "integers >= 1"),
    (["bench", "--block-sizes", "4,x"], "--block-sizes", "comma-separated integers"),
    (["bench", "--thresholds", "1.5"], "--thresholds", "(0, 1]"),
    (["export", "no_such_dir", "out"], "SOURCE", "config.json"),
    # a byte the terminal could not decode (a traceback inside the tokenizer), an empty prompt (refused after loading,
    # naming `input_ids`), a misspelt option (the top-level program's error, no suggestion)
    (["generate", "--prompt", "caf\udce9"], "--prompt", "must be valid UTF-8 text (byte 0xe9 at position 3"),
    (["generate", "--prompt", ""], "--prompt", "must be non-empty text"),
    (["main", "--prompt", ""], "--prompt", "must be non-empty text"),
    (["generate", "--prompt", "x", "--block-sise", "4"], "hf-dllm-spec generate: error: unrecognized arguments",
     "did you mean '--block-size'?"),
    (["bench", "--draft-model", "a=models/deer-drafter-tiny", "--draft-model", "a=models/sdar-tiny-arith"],
     "--draft-model", "names 'a' twice"),
    (["main", "--strategies", ""], "--strategies", "unknown strategy ''"),
    # an empty OUTPUT_DIR was the working directory; an unwritable one was reported as SOURCE
    (["export", "models/sdar-tiny-arith", ""], "OUTPUT_DIR", "must be a directory path"),
    (["export", "models/sdar-tiny-arith", "README.md/out"], "argument OUTPUT_DIR", "Not a directory"),
    (["generate", "--prompt", "x", "--do-sample", "--top-p", "1.5"], "--top-p", "must be a number in (0, 1]"),
    (["generate", "--prompt", "x", "--do-sample", "--top-k", "-3"], "--top-k", "must be >= 0, got -3"),
    (["generate", "--prompt", "x", "--do-sample", "--temperature", "0"], "--temperature", "must be a number > 0"),
    (["generate", "--prompt", "x", "--do-sample", "--temperature", "hot"], "--temperature", "must be a number > 0, "
     "got 'hot'"),
])
def test_bad_arguments_name_the_flag_and_exit_2(capsys, argv, flag, words):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert flag in err and words in err, err
    assert "Traceback" not in err and len(err.splitlines()) <= 4, err   # one message, not a usage dump


@pytest.mark.parametrize("argv,flag,words", [
    (["--model", "models/fast-dllm-v2-tiny", "--block-sizes", "4"], "--block-sizes", "Fast-dLLM v2 rows"),
    (["--model", "models/llada2-tiny", "--block-sizes", "8"], "--block-sizes", "drop --block-sizes"),
    (["--model", "models/qwen2-tiny-ar", "--draft-model", "models/deer-drafter-tiny", "--thresholds", "0.9"],
     "--thresholds", "DEER rows"),
    (["--model", "models/sdar-large", "--draft-model", "models/sdar-tiny-arith", "--thresholds", "0.9"],
     "--thresholds", "SimSD rows"),
])
def test_bench_refuses_a_sweep_list_its_rows_do_not_use(capsys, argv, flag, words):
    """`bench` on a family whose rows have no block size (Fast-dLLM v2, LLaDA2.1: the checkpoint's blocks) or no
    threshold (SimSD, DEER) refuses the list given for them instead of ignoring it (once the model says its family)."""
    code, _, err = run_cli(capsys, "bench", "--num-arith", "1", "--num-humaneval", "0", *argv)
    assert code == 2 and flag in err and words in err and "Traceback" not in err, err


def test_export_speaks_of_flags(capsys, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    code, _, err = run_cli(capsys, "export", str(DEFAULT_MODEL), str(tmp_path / "full"))
    assert code == 2 and "OUTPUT_DIR" in err and "--overwrite" in err and "overwrite=True" not in err, err
    assert f"argument OUTPUT_DIR: '{tmp_path / 'full'}' must be empty or new" in err, err    # it read "(='...')"


def test_export_names_source_for_a_file_it_cannot_copy(capsys, tmp_path):
    """A file of SOURCE that cannot be read (a dangling link) was reported as OUTPUT_DIR's, as a Python list."""
    import shutil

    source = tmp_path / "src"
    source.mkdir()
    shutil.copy(ROOT / "models" / "sdar-tiny-arith" / "config.json", source)
    (source / "dangling.bin").symlink_to(tmp_path / "nowhere")
    code, _, err = run_cli(capsys, "export", str(source), str(tmp_path / "out"))
    assert code == 2 and "argument SOURCE:" in err and "dangling.bin could not be copied" in err, err


def test_the_mask_token_of_a_qwen_layout_model_is_an_option(capsys):
    """The refusal of a model without a mask token said "pass mask_token_id=<id> to generate", which the command
    line had no option for: `--mask-token-id` now, named by the refusal."""
    argv = ["generate", "--model", "models/qwen2-tiny-ar", "--prompt", "x", "--max-new-tokens", "4"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "argument --mask-token-id:" in err and "pass --mask-token-id ID" in err, err
    code, out, err = run_cli(capsys, *argv, "--strategy", "block_diffusion", "--block-size", "4", "--mask-token-id",
                             "2")
    assert code == 0 and out.strip(), err


def test_a_reader_that_goes_away_ends_the_command_quietly(capsys, monkeypatch):
    """`hf-dllm-spec strategies | head -1`: the closed pipe was reported as a usage error (exit 2)."""
    from hf_dllm_spec import cli

    def closed(args, argv):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_strategies", closed)
    code, _, err = run_cli(capsys, "strategies")
    assert code == 1 and err == ""


def test_a_missing_or_bad_held_out_set_names_the_file_and_the_fix(tmp_path):
    """A checkpoint of one's own has no `heldout_arithmetic.jsonl`: `main` said only "[Errno 2]"; an empty file
    was a StopIteration traceback, a line without `answer` a KeyError."""
    from hf_dllm_spec.tools.jobs.evaluation import arithmetic_prompts

    with pytest.raises(ValueError, match="heldout_arithmetic.jsonl is missing .*--num-arith 0 with your own"):
        arithmetic_prompts(tmp_path, 2)
    for text, words in (("", "is empty"), ('{"question": "q"}\n', "line 1 must be an object with a `question` and "
                        "an `answer`"), ("\x8d\n", "must hold one JSON object per line")):
        (tmp_path / "heldout_arithmetic.jsonl").write_bytes(text.encode("latin-1"))
        with pytest.raises(ValueError, match=re.escape(words)):
            arithmetic_prompts(tmp_path, 2)


def test_the_console_script_exits_2_without_a_traceback_and_debug_shows_it():
    script = pathlib.Path(sys.executable).with_name("hf-dllm-spec")
    if not script.exists():
        pytest.skip("the package is not installed with its console script")
    argv = [str(script), "main", "--set", "blok_size=4", "--model", str(DEFAULT_MODEL)]
    plain = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert plain.returncode == 2 and "argument --set" in plain.stderr and "Traceback" not in plain.stderr
    debug = subprocess.run([*argv, "--debug"], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "UsageError" in debug.stderr


def test_generate_decodes_an_ar_target_with_deer(capsys):
    import hf_dllm_spec

    target_dir, drafter_dir = ROOT / "models" / "qwen2-tiny-ar", ROOT / "models" / "deer-drafter-tiny"
    tokenizer, target = load(target_dir)
    prompt = arithmetic_prompts(target_dir, 1)[0].text
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = target.generate(ids, max_new_tokens=8, do_sample=False)        # greedy DEER == the target's greedy
    code, out, err = run_cli(capsys, "generate", "--prompt", prompt, "--model", str(target_dir), "--strategy",
                             "deer", "--draft-model", str(drafter_dir), "--block-size", "4", "--max-new-tokens", "8",
                             "--stats")
    assert code == 0, err
    assert out == tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True) + "\n"
    assert "acceptance rate" in err and "tokens/s" in err and "nan" not in err
    assert hf_dllm_spec  # imported for the Auto registration the loader does


def test_stats_is_a_table_with_units(capsys, bundled):
    _, _, prompt = bundled
    code, _, err = run_cli(capsys, "generate", "--prompt", prompt, "--strategy", "ar", "--max-new-tokens", "4",
                           "--stats")
    assert code == 0
    lines = err.splitlines()
    lines = lines[lines.index("spec stats (ar):"):]
    assert any(line.split()[:2] == ["forwards", "(NFE)"] and line.endswith("forwards") for line in lines)
    assert any(line.strip().startswith("wall time") and line.endswith(" s") for line in lines)
    assert "nan" not in err and "acceptance rate" not in err        # AR drafts nothing: no such row


def test_main_with_a_custom_prompt_and_no_second_set(capsys):
    code, out, err = run_cli(capsys, "main", "--prompt", "def add(a, b):", "--max-new-tokens", "4",
                             "--strategies", "dynamic", "--no-progress")
    assert code == 0, err
    assert "nan" not in out and "| AR (block size 1) |" in out and ", B=4 |" in out   # the trained block size
    assert "NFE: model forwards" in out                                               # the legend
    code, out, err = run_cli(capsys, "main", "--num-arith", "1", "--num-humaneval", "0", "--max-new-tokens", "4",
                             "--strategies", "dynamic", "--no-progress")
    assert code == 0 and "HumanEval" not in out and "held-out arithmetic: 1 prompts" in out, err


def test_bench_writes_rows_as_they_finish_into_a_fresh_folder(capsys, monkeypatch, tmp_path):
    from hf_dllm_spec.tools.jobs.evaluation import StrategySpec
    from hf_dllm_spec.tools.jobs import fresh_out_dir, sweep

    written = []
    real_table = sweep.table
    monkeypatch.setattr(sweep, "table", lambda results, *a, **k: written.append(len(results)) or
                        real_table(results, *a, **k))
    lean = lambda block_sizes, thresholds: [  # noqa: E731 -- two rows keep the test short
        StrategySpec("AR", "ar"), StrategySpec(f"dynamic 0.9 B={block_sizes[0]}", "block_diffusion",
                                               {"block_size": block_sizes[0], "confidence_threshold": 0.9})]
    monkeypatch.setattr(sweep, "sweep_specs", lean)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "bench", "--num-arith", "1", "--num-humaneval", "0", "--block-sizes", "4",
                             "--thresholds", "0.9", "--no-progress")
    assert code == 0, err
    (folder,) = (tmp_path / "runs").iterdir()
    assert folder.name.startswith("bench-") and (folder / "sweep.md").is_file() and (folder / "frontier.png").is_file()
    assert written == [1, 2]                                   # the table is written after every row
    text = (folder / "sweep.md").read_text()
    assert "Command: `hf-dllm-spec bench --num-arith 1 --num-humaneval 0 --block-sizes 4" in text
    assert "HumanEval" not in text
    # The default folder is ignored by git: a trial leaves `git status` of the checkout clean.
    ignored = subprocess.run(["git", "check-ignore", "-q", str(ROOT / fresh_out_dir("bench") / "sweep.md")],
                             cwd=ROOT, capture_output=True)
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert ignored.returncode == 0
