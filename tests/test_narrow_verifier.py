"""The span-width S2D2 verifier equals the full-width Eq. 3 layout: same tokens, same forwards, narrower inputs.

The narrow layout reads `[x~[:E] | MASK copies of S..E-1]` (position-aligned) or `x~[:E]` (right-shifted) instead of
`[x~ | MASK x B]` / `x~`. Checked for every routing policy, both cache flags, greedy and sampled acceptance, a
left-padded batch, both alignments, and sub-blocks; the query widths the model sees are recorded by a forward hook.
"""

from __future__ import annotations

import pytest
import torch
from conftest import MASK_ID, gen, left_padded_batch

from hf_dllm_spec.maths.masks import verifier_2l_mask
from hf_dllm_spec.strategies.s2d2 import S2D2Strategy
from model_patches.fast_dllm_v2 import Fast_dLLM_QwenConfig, Fast_dLLM_QwenForCausalLM

POLICIES = {
    "always": dict(do_verify_policy="mask_span_length", min_ssd_span_length=1),
    "min-span-3": dict(do_verify_policy="mask_span_length", min_ssd_span_length=3),
    "score": dict(do_verify_policy="score_threshold", do_verify_score_threshold=-1.0,
                  token_acceptance_estimator="soft_entropy_negexp"),
    "hysteresis": dict(do_verify_policy="score_hysteresis", hysteresis_threshold_on=0.0,
                       hysteresis_threshold_off=-2.0),
    "ucb": dict(do_verify_policy="contextual_bandit_ucb"),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def fast_model() -> Fast_dLLM_QwenForCausalLM:
    """Tiny random right-shifted model (Fast-dLLM v2 family, block 8)."""
    torch.manual_seed(0)
    config = Fast_dLLM_QwenConfig(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, bd_size=8,
                                  mask_token_id=MASK_ID, eos_token_id=None, attn_implementation="sdpa")
    return Fast_dLLM_QwenForCausalLM(config).eval()


def _run(model, narrow: bool, monkeypatch, **kwargs):
    """Generate with the narrow or the full verifier; return the output and the verify forwards' query widths."""
    monkeypatch.setattr(S2D2Strategy, "narrow_verifier", narrow)
    widths: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: widths.append(kw["input_ids"].shape[1]),
                                           with_kwargs=True)
    try:
        out = model.generate(**kwargs, decoding_strategy="s2d2", return_dict_in_generate=True, eos_token_id=None,
                             pad_token_id=0)
    finally:
        hook.remove()
    return out, widths


def _assert_same(model, monkeypatch, seed: int | None = None, **kwargs):
    """Both layouts, each with a fresh generator of the same seed when sampling."""
    draws = {} if seed is None else {"generator": gen(seed)}
    narrow, narrow_widths = _run(model, True, monkeypatch, **kwargs, **draws)
    draws = {} if seed is None else {"generator": gen(seed)}
    full, full_widths = _run(model, False, monkeypatch, **kwargs, **draws)
    assert narrow.sequences.tolist() == full.sequences.tolist()
    a, b = narrow.spec_stats, full.spec_stats
    for name in ("num_forward_calls", "num_draft_forwards", "num_verify_forwards", "num_accepted_tokens",
                 "num_draft_tokens", "num_fallback_tokens"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.num_verify_forwards > 0
    assert len(narrow_widths) == len(full_widths)
    assert all(n <= f for n, f in zip(narrow_widths, full_widths))
    return narrow_widths, full_widths


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("use_cache", [True, False])
def test_narrow_equals_full_position_aligned_batch(sdar_model, monkeypatch, policy, use_cache):
    ids, mask, _ = left_padded_batch([3, 7, 5])
    narrow, full = _assert_same(sdar_model, monkeypatch, inputs=ids, attention_mask=mask, max_new_tokens=12,
                                block_size=4, use_cache=use_cache, **POLICIES[policy])
    assert sum(narrow) < sum(full)


@pytest.mark.parametrize("policy", ["always", "hysteresis", "ucb"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_narrow_equals_full_sampled(sdar_model, monkeypatch, policy, use_cache):
    ids, mask, _ = left_padded_batch([6, 4])
    _assert_same(sdar_model, monkeypatch, inputs=ids, attention_mask=mask, max_new_tokens=12, block_size=8,
                 do_sample=True, temperature=1.5, seed=3, use_cache=use_cache, **POLICIES[policy])


@pytest.mark.parametrize("policy", ["always", "score", "ucb"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_narrow_equals_full_right_shifted_with_sub_blocks(fast_model, monkeypatch, policy, use_cache):
    ids, mask, _ = left_padded_batch([5, 9])
    for sub_block_size in (8, 4):
        _assert_same(fast_model, monkeypatch, inputs=ids, attention_mask=mask, max_new_tokens=16, block_size=8,
                     sub_block_size=sub_block_size, use_cache=use_cache, **POLICIES[policy])


def test_narrow_equals_full_with_ar_caching(sdar_model, monkeypatch):
    ids, mask, _ = left_padded_batch([2, 6])
    _assert_same(sdar_model, monkeypatch, inputs=ids, attention_mask=mask, max_new_tokens=16, block_size=8,
                 cache_ver=True, draft_ver=True, **POLICIES["always"])


def test_span_mask_is_the_full_mask_restricted_to_the_kept_rows_and_keys():
    full = verifier_2l_mask(6)
    for end in range(1, 7):
        for start in range(end):
            narrow = verifier_2l_mask(end, span_start=start)
            keys = list(range(end)) + [6 + p for p in range(start, end)]
            assert torch.equal(narrow, full[keys][:, keys])
            # no kept row sees a dropped key of the full layout
            dropped = [k for k in range(12) if k not in keys]
            assert not full[keys][:, dropped].any()
