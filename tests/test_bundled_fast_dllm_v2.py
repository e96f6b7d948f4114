"""End-to-end checks on the bundled AR Qwen2 model and its Fast-dLLM v2 conversion, real prompts, CPU fp32."""

from __future__ import annotations

import json

import pytest
import torch

from hf_dllm_spec.tools.jobs.evaluation import ROOT

AR_DIR = ROOT / "models" / "qwen2-tiny-ar"
FAST_DIR = ROOT / "models" / "fast-dllm-v2-tiny"

pytestmark = pytest.mark.slow


def _prompts(tokenizer, model_dir, n: int = 3) -> list[torch.Tensor]:
    from hf_dllm_spec.tools.jobs.evaluation import arithmetic_prompts, humaneval_prompts

    texts = [p.text for p in arithmetic_prompts(model_dir, n)] + [humaneval_prompts(1)[0].text]
    return [tokenizer(t, return_tensors="pt").input_ids for t in texts]


@pytest.fixture(scope="module")
def ar():
    from hf_dllm_spec.tools.jobs.evaluation import load

    tokenizer, model = load(AR_DIR)
    return tokenizer, model, _prompts(tokenizer, AR_DIR)


@pytest.fixture(scope="module")
def fast():
    from hf_dllm_spec.tools.jobs.evaluation import load

    tokenizer, model = load(FAST_DIR)
    return tokenizer, model, _prompts(tokenizer, FAST_DIR)


def test_ar_model_tokenizer_is_the_bundled_one(ar):
    """The AR model's tokenizer tokenizes exactly as the SDAR model's (not as transformers' Qwen2Tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    from hf_dllm_spec.tools.jobs.evaluation import DEFAULT_MODEL

    tokenizer, _, _ = ar
    sdar = PreTrainedTokenizerFast.from_pretrained(DEFAULT_MODEL)
    text = "def f(x):\n\n    return x + 12\n\nQuestion: Tom has 3 apples.\nAnswer:"
    assert tokenizer(text).input_ids == sdar(text).input_ids


def test_ar_strategy_equals_stock_greedy_generate(ar):
    import hf_dllm_spec

    _, model, prompts = ar
    assert type(model).__name__ == "Qwen2ForCausalLM"
    for ids in prompts:
        stock = model.generate(ids, max_new_tokens=24, do_sample=False)
        ours = model.generate(ids, custom_generate=hf_dllm_spec.custom_generate, decoding_strategy="ar",
                              max_new_tokens=24)
        assert ours.tolist() == stock.tolist()


def test_fast_dllm_v2_loads_in_hub_layout(fast):
    from model_patches import Fast_dLLM_QwenForCausalLM, get_patch

    tokenizer, model, _ = fast
    config = json.loads((FAST_DIR / "config.json").read_text())
    assert config["model_type"] == "Fast_dLLM_Qwen" and config["bd_size"] == 32 and config["conplemenrary_mask"]
    assert "mask_token_id" not in config                       # as on the Hub: the mask comes from the tokenizer
    assert type(model) is Fast_dLLM_QwenForCausalLM
    assert model.config.mask_token_id == tokenizer.convert_tokens_to_ids("|<MASK>|") == 8192
    assert tokenizer.mask_token is None                        # as on the Hub
    assert get_patch(model).alignment_of(model) == "right_shift"
    assert model.get_output_embeddings().weight.shape[0] == 8256   # rows above the tokenizer, as on the Hub


def test_fast_dllm_v2_s2d2_always_verify_equals_ar(fast):
    """Greedy S2D2 with always-on verification and AR-like caching equals `ar`, token for token."""
    _, model, prompts = fast
    for ids in prompts:
        ar = model.generate(ids, decoding_strategy="ar", max_new_tokens=40, fuse_cache_write=False)
        s2d2 = model.generate(ids, decoding_strategy="s2d2", block_size=32, sub_block_size=8, max_new_tokens=40,
                              min_ssd_span_length=1, cache_ver=True, fuse_cache_write=False)
        assert s2d2.tolist() == ar.tolist()


def test_fast_dllm_v2_family_decoder_answers(fast):
    """Plain `generate` runs the family decoder and solves held-out problems with fewer forwards than tokens."""
    from recipes.arithmetic import extract_answer

    tokenizer, model, prompts = fast
    answers = [json.loads(line)["answer"] for line in (FAST_DIR / "heldout_arithmetic.jsonl").read_text().splitlines()[:3]]
    correct = 0
    for ids, answer in zip(prompts, answers):
        out = model.generate(ids, max_new_tokens=48, return_dict_in_generate=True)
        stats = out.spec_stats
        assert stats.nfe < stats.num_generated_tokens
        correct += extract_answer(tokenizer.decode(out.sequences[0, ids.shape[1]:])) == answer
    assert correct >= 2
