"""Every strategy on every bundled model gives the same tokens and forward counts on every supported transformers.

The expected tokens live in `tests/data/tokens_across_versions.json`, written once (greedy, fp32, CPU) and read by
both CI environments (the newest transformers and the oldest supported one), so a difference between versions
fails one of them. A change that alters tokens on purpose rewrites the file:

    HF_DLLM_SPEC_WRITE_TOKENS=1 .venv/bin/python -m pytest tests/test_tokens_across_versions.py

(then say so under "Behaviour changes" in CHANGELOG.md).
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
import transformers

import hf_dllm_spec
import model_patches
from hf_dllm_spec.tools.jobs.evaluation import ROOT, arithmetic_prompts, humaneval_prompts, load
from hf_dllm_spec.tools.jobs.main import SUB_BLOCKS, specs

DATA = pathlib.Path(__file__).parent / "data" / "tokens_across_versions.json"
WRITE = os.environ.get("HF_DLLM_SPEC_WRITE_TOKENS") == "1"
MODELS = ROOT / "models"
MAX_NEW_TOKENS = 24

#: model -> (the main job's strategy rows on it, drafter). The rows are the main job's, at the trained block size.
CASES = {
    "sdar-tiny-arith": (["ar", "static", "dynamic", "s2d2"], None),
    "fast-dllm-v2-tiny": (["ar", "fast_dllm_v2", "s2d2"], None),
    "llada2-tiny": (["ar", "llada2.0", "llada2", "llada2-quality", "s2d2-llada2"], None),
    "sdar-large": (["ar", "simsd", "simsd-dynamic"], "sdar-tiny-arith"),
    "qwen2-tiny-ar": (["ar", "deer"], "deer-drafter-tiny"),
}


@pytest.fixture(scope="module")
def expected() -> dict:
    if WRITE:
        return {"made_with": {"transformers": transformers.__version__, "torch": torch.__version__}, "cases": {}}
    return json.loads(DATA.read_text())


@pytest.fixture(scope="module", autouse=True)
def write_back(expected):
    yield
    if WRITE:
        DATA.parent.mkdir(exist_ok=True)
        DATA.write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


def _decode(model, tokenizer, spec, texts: list[str]) -> dict:
    """One left-padded batch of `texts` with one strategy row: the new tokens and NFE of each row."""
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    entry = {} if isinstance(model, hf_dllm_spec.DllmGenerationMixin) else {"custom_generate": hf_dllm_spec.custom_generate}
    drafter = {"draft_model": spec.draft_model} if spec.draft_model is not None else {}
    out = model.generate(enc.input_ids, attention_mask=enc.attention_mask, decoding_strategy=spec.decoding_strategy,
                         max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True, **entry, **spec.params,
                         **drafter)
    rows = out.spec_stats_per_row
    return {"tokens": [out.sequences[n, enc.input_ids.shape[1]:][: rows[n].num_generated_tokens].tolist()
                       for n in range(len(texts))],
            "nfe": [rows[n].nfe for n in range(len(texts))]}


@pytest.mark.parametrize("name", list(CASES))
def test_bundled_tokens_match_the_recorded_ones(name, expected):
    strategies, drafter_name = CASES[name]
    tokenizer, model = load(MODELS / name)
    drafter = load(MODELS / drafter_name)[1] if drafter_name else None
    patch = model_patches.get_patch(model)
    block_size = patch.trained_block_size(model) or 4
    family = SUB_BLOCKS if patch.native_strategy == "fast_dllm_v2" else None
    texts = [p.text for p in arithmetic_prompts(MODELS / name, 2)] + [humaneval_prompts(1)[0].text]
    got = {spec.label: _decode(model, tokenizer, spec, texts)
           for spec in specs(block_size, 0.9, strategies, {}, family, drafter, draft_block_size=8)}
    if drafter_name == "deer-drafter-tiny":      # DEER inside transformers' own assisted decoding (batch 1)
        ids = tokenizer(texts[0], return_tensors="pt").input_ids
        out = hf_dllm_spec.deer_assisted_generate(model, ids, drafter, num_draft_tokens=8,
                                                  max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        got["DEER, transformers assisted decoding"] = {"tokens": [out[0, ids.shape[1]:].tolist()]}
    if WRITE:
        expected["cases"][name] = got
        return
    want = expected["cases"][name]
    assert sorted(got) == sorted(want)
    for label in want:
        assert got[label] == want[label], (
            f"{name} / {label}: tokens differ from those recorded with transformers "
            f"{expected['made_with']['transformers']} (running {transformers.__version__})")
