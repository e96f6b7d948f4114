"""Every bundled model works with stock tools alone, as a new user meets it (issue 27).

One fresh interpreter per bundled model (stdin closed, offline, its own remote-code cache, never importing
`hf_dllm_spec` or `model_patches` itself) loads the model with `AutoModelForCausalLM.from_pretrained(path,
trust_remote_code=True)` and the tokenizer with `AutoTokenizer` (also with `trust_remote_code=False`: no remote code
runs and no `[y/N]` prompt; the same ids), tokenizes a code snippet and decodes a few tokens
with the family's strategies. The tokens must equal those of the library's own classes in this process, and the
tokenizer's ids those of the saved `tokenizer.json` read by the `tokenizers` library (the tokenizer as trained).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from hf_dllm_spec.tools.jobs.evaluation import load

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
CODE = "def add(a, b):\n    return a + b\n"
PROMPT = "Question: Tom has 3 apples and gets 4 more. How many apples does Tom have now?\nAnswer:"
NEW = 6

#: model -> [(decoding_strategy or None, parameters, drafter model or None)]; None: the model's own default.
CALLS = {
    "sdar-tiny-arith": [("s2d2", {"block_size": 4}, None), (None, {}, None)],
    "sdar-large": [("simsd", {"block_size": 4, "draft_block_size": 4}, "sdar-tiny-arith")],
    "deer-drafter-tiny": [("block_diffusion", {"block_size": 4}, None)],
    "fast-dllm-v2-tiny": [("fast_dllm_v2", {}, None), ("s2d2", {"preset": "fast-dllm-v2-config-a"}, None)],
    "llada2-tiny": [("llada2", {}, None), ("s2d2", {"preset": "llada2.1-mini-quality"}, None)],
    "qwen2-tiny-ar": [("deer", {"block_size": 4}, "deer-drafter-tiny"), (None, {}, None)],
}

FRESH = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

jobs, code, prompt, new = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
assert not {"hf_dllm_spec", "model_patches"} & set(sys.modules), "imported before loading"
for path, drafter_path, calls in jobs:
    remote = {name for name in sys.modules if name.startswith("transformers_modules")}
    plain = AutoTokenizer.from_pretrained(path, trust_remote_code=False)   # no remote code, no prompt
    assert remote == {name for name in sys.modules if name.startswith("transformers_modules")}, "ran remote code"
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    assert plain(code).input_ids == tokenizer(code).input_ids, "the tokenizer depends on trust_remote_code"
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
    drafter = None
    if drafter_path:
        drafter = AutoModelForCausalLM.from_pretrained(drafter_path, trust_remote_code=True,
                                                       dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    tokens = []
    for strategy, params, uses_drafter in calls:
        kwargs = dict(params, max_new_tokens=new)
        if strategy is not None:
            kwargs["decoding_strategy"] = strategy
        if uses_drafter:
            kwargs["draft_model"] = drafter
        tokens.append(model.generate(ids, **kwargs)[0, ids.shape[1]:].tolist())
    print(json.dumps({"tokenizer": type(tokenizer).__name__, "code_ids": tokenizer(code).input_ids,
                      "model_class": [type(model).__module__, type(model).__name__], "tokens": tokens,
                      "max_length": tokenizer.model_max_length}))
"""


def run_fresh(models: list[str], tmp: pathlib.Path) -> dict[str, dict]:
    """Run FRESH for `models` in one fresh interpreter, stdin closed; model -> its JSON line."""
    jobs = []
    for model in models:
        drafter = next((d for _, _, d in CALLS[model] if d), "")
        jobs.append([str(MODELS / model), str(MODELS / drafter) if drafter else "",
                     [[s, p, bool(d)] for s, p, d in CALLS[model]]])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": "",
           "HF_MODULES_CACHE": str(tmp / "modules"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(FRESH), json.dumps(jobs), CODE, PROMPT, str(NEW)],
                          cwd=tmp, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[y/N]" not in proc.stdout + proc.stderr, "an interactive trust_remote_code prompt"
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == len(models), proc.stdout       # nothing printed besides the results
    return dict(zip(models, map(json.loads, lines)))


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> dict[str, dict]:
    """One fresh interpreter loads and decodes all six bundled models (one import of torch and transformers)."""
    return run_fresh(list(CALLS), tmp_path_factory.mktemp("fresh"))


def in_process_tokens(model: str) -> list[list[int]]:
    """The same calls on the library's own classes (`hf_dllm_spec.tools.jobs.evaluation.load`) in this process."""
    tokenizer, target = load(MODELS / model)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    out = []
    for strategy, params, drafter in CALLS[model]:
        kwargs = dict(params, max_new_tokens=NEW)
        if drafter:
            kwargs["draft_model"] = load(MODELS / drafter)[1]
        if strategy is not None:
            kwargs["decoding_strategy"] = strategy
            if not hasattr(target, "default_decoding_strategy"):   # a stock transformers class (the AR target)
                import hf_dllm_spec

                kwargs["custom_generate"] = hf_dllm_spec.custom_generate
        out.append(target.generate(ids, **kwargs)[0, ids.shape[1]:].tolist())
    return out


@pytest.mark.parametrize("model", list(CALLS))
def test_bundled_model_loads_and_decodes_with_stock_tools(model, fresh):
    from tokenizers import Tokenizer

    result = fresh[model]
    assert result["code_ids"] == Tokenizer.from_file(str(MODELS / model / "tokenizer.json")).encode(CODE).ids
    assert len(result["code_ids"]) == 13
    config = json.loads((MODELS / model / "config.json").read_text())
    assert result["max_length"] == config["max_position_embeddings"]
    if model != "qwen2-tiny-ar":                       # remote code: the shim of the family class
        assert result["model_class"][1] == config["architectures"][0]
        assert result["model_class"][0].endswith(".modeling_hf_dllm_spec")
    else:                                              # a stock transformers Qwen2
        assert result["model_class"] == ["transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM"]
    with torch.no_grad():
        assert result["tokens"] == in_process_tokens(model)
    assert all(len(t) > 0 for t in result["tokens"])


@pytest.mark.slow
@pytest.mark.parametrize("model", list(CALLS))
def test_each_bundled_model_alone_in_a_fresh_process(model, fresh, tmp_path):
    """The same result when the model is the only one the process loads (nothing imported by an earlier one)."""
    assert run_fresh([model], tmp_path)[model] == fresh[model]


def test_ar_target_keeps_its_stock_generate_without_a_strategy():
    """The AR target's own `custom_generate/` leaves a call without `decoding_strategy` to transformers: greedy."""
    tokenizer, target = load(MODELS / "qwen2-tiny-ar")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    greedy = target.generate(ids, max_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:].tolist()
    assert in_process_tokens("qwen2-tiny-ar")[1] == greedy


@pytest.mark.parametrize("model", list(CALLS))
def test_tokenizer_config_carries_no_local_flags(model):
    config = json.loads((MODELS / model / "tokenizer_config.json").read_text())
    assert not {"is_local", "local_files_only", "name_or_path", "_commit_hash"} & set(config)
    assert config["model_max_length"] <= 2048


def test_bundled_models_are_shipped_as_exported(tmp_path):
    """Re-running `models/export_bundled.py` on a copy of the models changes no file (shims, auto_map, folder,
    cards are current), and it leaves weights and tokenizers alone."""
    import runpy
    import shutil

    copy = tmp_path / "models"
    shutil.copytree(MODELS, copy, ignore=shutil.ignore_patterns("*.safetensors", "__pycache__"))
    for name in CALLS:     # weights are not read by the export: empty stand-ins keep the copy cheap
        (copy / name / "model.safetensors").write_bytes(b"")
    runpy.run_path(str(copy / "export_bundled.py"), run_name="__main__")     # the script, on the copy
    for path in sorted(MODELS.rglob("*")):
        if path.is_file() and path.suffix != ".safetensors" and "__pycache__" not in path.parts:
            again = copy / path.relative_to(MODELS)
            assert again.read_bytes() == path.read_bytes(), f"{path.relative_to(ROOT)} is not current"
    new = {p.relative_to(copy) for p in copy.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert new == {p.relative_to(MODELS) for p in MODELS.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_assistant_model_on_a_stock_target_is_deer_drafting():
    """A stock Qwen2 target's `generate(assistant_model=<bundled dLLM drafter>)` (transformers' own assisted
    decoding, no custom_generate) gives the target's greedy tokens, in fewer target forwards than greedy decoding:
    the drafter answers transformers' assistant call with DEER's one-forward drafts."""
    tokenizer, target = load(MODELS / "qwen2-tiny-ar")
    _, drafter = load(MODELS / "deer-drafter-tiny")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    calls = []
    hook = target.register_forward_hook(lambda *_: calls.append(1))
    try:
        greedy = target.generate(ids, max_new_tokens=12, do_sample=False)
        greedy_forwards, calls[:] = len(calls), []
        assisted = target.generate(ids, assistant_model=drafter, max_new_tokens=12, do_sample=False)
    finally:
        hook.remove()
    assert torch.equal(assisted, greedy)
    assert len(calls) < greedy_forwards / 2, (len(calls), greedy_forwards)


# ------------------------------------------------------------------------------------------------------------------
# The README's examples run as written


def readme_blocks(language: str) -> list[str]:
    import re

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [body for lang, body in re.findall(r"```(\w+)\n(.*?)```", text, re.S) if lang == language]


README_PRELUDE = """
import torch, hf_dllm_spec
from transformers import AutoModelForCausalLM, AutoTokenizer
hf_dllm_spec.register_auto_classes()
tok = AutoTokenizer.from_pretrained("models/sdar-tiny-arith")
ids = tok("Question: Tom has 3 apples and gets 4 more. How many apples does Tom have now?\\nAnswer:",
          return_tensors="pt").input_ids
"""


def test_readme_python_examples_run_as_written_without_warnings(tmp_path):
    """The self-contained example (it starts with its imports) and the DEER and SimSD examples (which continue
    from `ids` and the imports) run in one fresh process from the checkout, and no warning is raised."""
    blocks = readme_blocks("python")
    complete = [b for b in blocks if b.startswith("import ")]
    continued = [b for b in blocks if b.startswith("target = AutoModelForCausalLM.from_pretrained(\"models/")]
    assert complete and len(continued) == 2
    script = "\n".join(["import warnings", "warnings.simplefilter('error')", README_PRELUDE, *complete, *continued,
                        "print('README OK')"])
    path = tmp_path / "readme_examples.py"
    path.write_text(script)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-W", "error", str(path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert proc.returncode == 0 and "README OK" in proc.stdout, proc.stderr[-4000:]
    assert "Warning" not in proc.stderr, proc.stderr[-4000:]


def test_readme_command_lines_parse():
    """Every `hf-dllm-spec ...` line of the README's command blocks names a subcommand and options that exist."""
    import shlex

    from hf_dllm_spec import cli

    parser = cli.build_parser()
    lines = [line.split("  #")[0].strip() for block in readme_blocks("bash") for line in
             block.replace("\\\n", " ").splitlines() if line.startswith("hf-dllm-spec ")]
    assert len(lines) >= 8
    for line in lines:
        argv = [a for a in shlex.split(line)[1:] if a != "--help"]
        if argv:
            parser.parse_args(argv)     # argparse exits on an unknown option or a bad value
