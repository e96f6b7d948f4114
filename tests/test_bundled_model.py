"""End-to-end checks on the bundled trained checkpoint (models/sdar-tiny-arith), real prompts, CPU fp32."""

from __future__ import annotations

import pytest
import torch

from hf_dllm_spec.tools.jobs.evaluation import DEFAULT_MODEL as MODEL_DIR

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bundled():
    from hf_dllm_spec.tools.jobs.evaluation import arithmetic_prompts, humaneval_prompts, load

    tokenizer, model = load(MODEL_DIR)
    prompts = [p.text for p in arithmetic_prompts(MODEL_DIR, 3)] + [humaneval_prompts(1)[0].text]
    return tokenizer, model, [tokenizer(p, return_tensors="pt").input_ids for p in prompts]


def test_loads_in_sdar_hub_layout(bundled):
    from model_patches.sdar import SDARForCausalLM

    tokenizer, model, _ = bundled
    assert type(model) is SDARForCausalLM and model.config.model_type == "sdar"
    assert model.config.mask_token_id == tokenizer.mask_token_id and model.config.block_size == 4
    assert tokenizer.eos_token_id in model.generation_config.eos_token_id


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_s2d2_always_verify_equals_ar(bundled, block_size):
    """Always-on verification + greedy match + AR-like caching gives the AR greedy output token for token."""
    _, model, prompts = bundled
    for ids in prompts:
        ar = model.generate(ids, decoding_strategy="ar", max_new_tokens=40)
        s2d2 = model.generate(ids, decoding_strategy="s2d2", block_size=block_size, max_new_tokens=40,
                              min_ssd_span_length=1, s2d2_acceptance="greedy_match", cache_ver=True, draft_ver=True)
        assert s2d2.tolist() == ar.tolist()


@pytest.mark.parametrize("strategy,params", [
    ("ar", {}),
    ("block_diffusion", {"block_size": 16, "confidence_threshold": 0.9}),
    ("s2d2", {"block_size": 16}),
    ("s2d2", {"block_size": 8, "do_verify_policy": "score_hysteresis", "score_penalty_coef": 1.0}),
    ("s2d2", {"block_size": 8, "do_verify_policy": "contextual_bandit_ucb", "do_sample": True, "top_k": 0}),
])
def test_statistics_add_up(bundled, strategy, params):
    tokenizer, model, prompts = bundled
    out = model.generate(prompts[0], decoding_strategy=strategy, max_new_tokens=48, return_dict_in_generate=True,
                         generator=torch.Generator().manual_seed(0), **params)
    s = out.spec_stats
    generated = out.sequences[0, prompts[0].shape[1]:]
    assert s.num_generated_tokens == generated.shape[0] <= 48
    # every committed token is accounted for exactly once
    assert s.num_committed_tokens == (s.num_fallback_tokens + s.num_accepted_tokens + s.num_recovered_tokens
                                      + s.num_bonus_tokens)
    assert s.num_generated_tokens + s.num_discarded_tokens == s.num_committed_tokens
    if generated[-1].item() not in model.generation_config.eos_token_id and s.num_generated_tokens < 48:
        pytest.fail("generation ended without a stop id before the budget")
    assert s.nfe == s.num_prefill_forwards + s.num_draft_forwards + s.num_verify_forwards + s.num_cache_write_forwards
    assert s.num_verify_forwards == s.num_drafts and s.num_draft_tokens >= s.num_accepted_tokens
    assert 0 < s.forward_time_s < s.wall_time_s


@pytest.fixture(scope="module")
def real_batch(bundled):
    """8 real prompts of different lengths (arithmetic and HumanEval), left-padded by the tokenizer."""
    from hf_dllm_spec.tools.jobs.evaluation import arithmetic_prompts, humaneval_prompts

    tokenizer, _, _ = bundled
    texts = [p.text for p in arithmetic_prompts(MODEL_DIR, 5)] + [p.text for p in humaneval_prompts(3)]
    tokenizer.padding_side = "left"
    return texts, tokenizer(texts, return_tensors="pt", padding=True)


@pytest.mark.parametrize("strategy,params", [
    ("ar", {}),
    ("block_diffusion", {"block_size": 4, "confidence_threshold": 0.9}),
    ("block_diffusion", {"block_size": 16, "remasking_strategy": "low_confidence_static"}),
    ("s2d2", {"block_size": 16, "min_ssd_span_length": 1, "cache_ver": True, "draft_ver": True}),
    ("s2d2", {"block_size": 8, "do_verify_policy": "score_hysteresis", "score_penalty_coef": 1.0}),
])
@pytest.mark.filterwarnings("ignore:`block_size`")
def test_batch_of_8_real_prompts_equals_single_calls(bundled, real_batch, strategy, params):
    """EOS on: rows stop at different points, leave the batch, and are padded; tokens equal the single calls."""
    tokenizer, model, _ = bundled
    texts, enc = real_batch
    out = model.generate(enc.input_ids, attention_mask=enc.attention_mask, decoding_strategy=strategy,
                         max_new_tokens=40, return_dict_in_generate=True, **params)
    width, nfe = enc.input_ids.shape[1], 0
    for i, text in enumerate(texts):
        ids = tokenizer(text, return_tensors="pt").input_ids
        single = model.generate(ids, decoding_strategy=strategy, max_new_tokens=40, return_dict_in_generate=True,
                                **params)
        new = single.sequences[0, ids.shape[1]:].tolist()
        assert out.sequences[i, width:width + len(new)].tolist() == new, f"row {i}"
        assert out.spec_stats_per_row[i].nfe == single.spec_stats.nfe
        nfe += single.spec_stats.nfe
    assert out.spec_stats.nfe == nfe and out.spec_stats.num_forward_calls < nfe
