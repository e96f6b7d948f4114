"""Every strategy runs in bfloat16: greedy cache == no-cache, seeds reproduce, acceptance reads float32.

bf16 vs fp32 agreement of the bundled models is measured in tests/test_quantization.py (the same table as the
quantised variants).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import MASK_ID, gen, left_padded_batch

from hf_dllm_spec.maths.sampling import Sampler
from model_patches.fast_dllm_v2 import Fast_dLLM_QwenConfig, Fast_dLLM_QwenForCausalLM
from transformers import LogitsProcessorList, TemperatureLogitsWarper

GREEDY = dict(eos_token_id=None, pad_token_id=0, max_new_tokens=12)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bf16_models(sdar_model, llada2_model):
    """bf16 copies of the tiny SDAR, LLaDA2 and a tiny Fast-dLLM v2 model."""
    torch.manual_seed(0)
    fast = Fast_dLLM_QwenForCausalLM(Fast_dLLM_QwenConfig(
        vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.2, bd_size=4, mask_token_id=MASK_ID, eos_token_id=None,
        attn_implementation="sdpa")).eval()
    return {name: copy.deepcopy(m).to(torch.bfloat16)
            for name, m in (("sdar", sdar_model), ("llada2", llada2_model), ("fast", fast))}


CASES = [
    ("sdar", "ar", {}),
    ("sdar", "block_diffusion", {"confidence_threshold": 0.7}),
    ("sdar", "s2d2", {}),
    ("sdar", "s2d2", {"do_verify_policy": "contextual_bandit_ucb", "cache_ver": True, "draft_ver": True}),
    ("fast", "fast_dllm_v2", {"sub_block_size": 2}),
    ("fast", "s2d2", {"preset": "fast-dllm-v2-config-a", "block_size": 4, "sub_block_size": 2}),
    ("llada2", "llada2", {"block_size": 4}),
    ("llada2", "s2d2", {"preset": "llada2.1-mini-quality", "block_size": 4}),
]


@pytest.mark.parametrize("name,strategy,params", CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_bf16_greedy_cache_equals_no_cache_in_a_batch(bf16_models, name, strategy, params):
    model = bf16_models[name]
    ids, mask, _ = left_padded_batch([3, 7, 5])
    cached = model.generate(ids, attention_mask=mask, decoding_strategy=strategy, **GREEDY, **params)
    recomputed = model.generate(ids, attention_mask=mask, decoding_strategy=strategy, use_cache=False, **GREEDY,
                                **params)
    assert cached.tolist() == recomputed.tolist()
    assert cached.shape[1] == ids.shape[1] + GREEDY["max_new_tokens"]


@pytest.mark.parametrize("name,strategy,params", CASES[2:4] + CASES[7:], ids=["sdar-s2d2", "sdar-ucb", "llada2"])
def test_bf16_sampling_reproduces_with_the_same_seed(bf16_models, name, strategy, params):
    model = bf16_models[name]
    ids, mask, _ = left_padded_batch([4, 6])
    kwargs = dict(attention_mask=mask, decoding_strategy=strategy, do_sample=True, temperature=1.3, **GREEDY,
                  **params)
    a = model.generate(ids, generator=gen(5), **kwargs)
    b = model.generate(ids, generator=gen(5), **kwargs)
    c = model.generate(ids, generator=gen(6), **kwargs)
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()


def test_acceptance_reads_float32_probabilities_of_bf16_logits():
    logits = torch.randn(2, 3, 50, generator=gen(0)).to(torch.bfloat16)
    sampler = Sampler(LogitsProcessorList([TemperatureLogitsWarper(0.7)]), do_sample=True, suppress_token_ids=[7])
    probs = sampler.probs(logits)
    assert probs.dtype == torch.float32
    expected = torch.softmax(logits.float() / 0.7, dim=-1)
    expected[..., 7] = 0
    expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(probs, expected)
    assert torch.all(probs[..., 7] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_without_the_distribution_equals_choose_on_probs(dtype):
    """`Sampler.greedy` (max + log-sum-exp) picks the token `choose(probs(...))` picks, with its probability; the
    mask id stays suppressed; a sampling sampler refuses it."""
    logits = (torch.randn(3, 8, 500, generator=gen(1)) * 4).to(dtype)
    logits[0, 0, 7] = 100.0                                  # the suppressed id would win
    sampler = Sampler(LogitsProcessorList(), do_sample=False, suppress_token_ids=[7])
    tokens, confidence = sampler.greedy(logits)
    expected_tokens, expected_confidence = sampler.choose(sampler.probs(logits))
    assert tokens.tolist() == expected_tokens.tolist() and tokens[0, 0] != 7
    torch.testing.assert_close(confidence, expected_confidence, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="do_sample"):
        Sampler(LogitsProcessorList(), do_sample=True, suppress_token_ids=[]).greedy(logits)
