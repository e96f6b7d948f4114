"""Pure helpers: mask builders, commit rules and routing, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hf_dllm_spec.masks import (
    block_causal_mask,
    concat_segments,
    partially_causal_draft_mask,
    to_additive,
    verifier_2l_mask,
)
from hf_dllm_spec.routing import (
    HysteresisPolicy,
    MinimumSpanPolicy,
    RoutingContext,
    ScoreThresholdPolicy,
    UCBPolicy,
    acceptance_estimates,
    expected_accepted_length,
    verify_score,
)
from hf_dllm_spec.strategies import first_masked_span
from hf_dllm_spec.unmasking import num_transfer_tokens, select_transfer

T, F = True, False


def test_verifier_2l_mask_eq3():
    expected = torch.tensor([
        [T, F, F, F, F, F],
        [T, T, F, F, F, F],
        [T, T, T, F, F, F],
        [F, F, F, T, F, F],
        [T, F, F, F, T, F],
        [T, T, F, F, F, T],
    ])
    assert torch.equal(verifier_2l_mask(3), expected)


def test_partially_causal_draft_mask_eq4():
    expected = torch.tensor([
        [T, F, F, F],
        [T, T, F, F],
        [T, T, T, T],
        [T, T, T, T],
    ])
    assert torch.equal(partially_causal_draft_mask(4, 2), expected)
    assert partially_causal_draft_mask(4, 0).all()


def test_block_causal_mask_counts_blocks_from_position_zero():
    m = block_causal_mask(4, 4, start=2)  # positions 2..5: blocks 0,0,1,1
    assert torch.equal(m, torch.tensor([[T, T, F, F], [T, T, F, F], [T, T, T, T], [T, T, T, T]]))
    assert torch.equal(block_causal_mask(3, 1), torch.ones(3, 3, dtype=torch.bool).tril())


def test_concat_segments_and_additive():
    m = concat_segments(torch.ones(1, 1, dtype=torch.bool), torch.eye(2, dtype=torch.bool))
    assert torch.equal(m, torch.tensor([[T, F, F], [T, T, F], [T, F, T]]))
    add = to_additive(m, torch.float32)
    assert add.shape == (1, 1, 3, 3) and add[0, 0, 0, 1] == torch.finfo(torch.float32).min and add[0, 0, 1, 0] == 0


def test_num_transfer_tokens():
    assert num_transfer_tokens(4, 4) == [1, 1, 1, 1]
    assert num_transfer_tokens(8, 3) == [3, 3, 2]


CONF = torch.tensor([0.9, 0.2, 0.95, 0.5, 0.3])
MASKED = torch.tensor([T, T, F, T, T])


@pytest.mark.parametrize("rule,k,threshold,expected", [
    ("sequential", 2, 0.85, [T, T, F, F, F]),
    ("low_confidence_static", 2, 0.85, [T, F, F, T, F]),
    ("low_confidence_dynamic", 1, 0.85, [T, F, F, F, F]),
    ("low_confidence_dynamic", 1, 0.25, [T, F, F, T, T]),
    ("low_confidence_dynamic", 1, 0.99, [T, F, F, F, F]),   # nothing crosses: still one token (Fast-dLLM #42)
    ("low_confidence_dynamic", 3, 0.85, [T, F, F, T, T]),   # fewer than k confident: top-k
])
def test_select_transfer_rules(rule, k, threshold, expected):
    out = select_transfer(rule, masked=MASKED, confidence=CONF, num_tokens=k, confidence_threshold=threshold)
    assert out.tolist() == expected


def test_entropy_bounded_uses_per_position_entropy():
    ent = torch.tensor([0.10, 0.30, 0.0, 0.05, 1.0])
    # ascending over masked: idx3 (0.05), idx0 (0.15 cum), idx1 (0.45 cum >= 0.35) -> 3 positions
    out = select_transfer("entropy_bounded", masked=MASKED, confidence=CONF, num_tokens=1,
                          entropies=ent, eb_threshold=0.35)
    assert out.tolist() == [T, T, F, T, F]


def test_first_masked_span():
    assert first_masked_span(torch.tensor([F, T, T, F, T])) == (1, 3)
    assert first_masked_span(torch.tensor([F, F])) == (2, 2)
    assert first_masked_span(torch.tensor([T, T])) == (0, 2)


PROBS = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.25, 0.25, 0.25, 0.25], [0.5, 0.45, 0.05, 0.0]])
CHOSEN = torch.tensor([0.7, 0.25, 0.5])


def _entropy(row):
    return -sum(p * math.log(p) for p in row if p > 0)


@pytest.mark.parametrize("name,kwargs,expected", [
    ("hard_margin_threshold", {"margin_threshold": 0.05}, [1.0, 0.0, 1.0]),
    ("hard_margin_threshold", {"margin_threshold": 0.5}, [1.0, 0.0, 0.0]),
    ("soft_entropy_negexp", {"entropy_temperature": 1.0},
     [math.exp(-_entropy(r) / math.log(4)) for r in PROBS.tolist()]),
    ("soft_renyi_2_entropy", {}, [0.54, 0.25, 0.455]),
    ("hard_entropy_threshold", {"entropy_threshold": 0.7},
     [float(_entropy(r) / math.log(4) < 0.7) for r in PROBS.tolist()]),
    ("soft_confidence_power", {"confidence_power": 2.0}, [0.49, 0.0625, 0.25]),
    ("soft_clipped_linear_margin", {"margin_coef": 2.0}, [1.0, 0.0, 0.1]),
])
def test_acceptance_estimators(name, kwargs, expected):
    out = acceptance_estimates(name, PROBS, CHOSEN, **kwargs)
    torch.testing.assert_close(out, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_expected_accepted_length_and_scores():
    assert expected_accepted_length(torch.tensor([1.0, 0.5, 0.5])) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_accepted_length(torch.tensor([])) == float("-inf")
    assert verify_score(1.75, score_type="difference_static", penalty_coef=1.0, num_confident=3) == 0.75
    assert verify_score(1.75, score_type="difference_dynamic", penalty_coef=0.5, num_confident=3) == 0.25


def _ctx(score=0.0, span=2, masked=3, entropy=0.5):
    return RoutingContext(span_length=span, block_size=4, num_masked=masked, num_decodable=4, score=score,
                          mean_normalized_entropy=entropy)


def test_minimum_span_and_score_threshold():
    assert MinimumSpanPolicy(2).decide(_ctx(span=2)) and not MinimumSpanPolicy(3).decide(_ctx(span=2))
    assert ScoreThresholdPolicy(0.0).decide(_ctx(score=0.0)) and not ScoreThresholdPolicy(0.0).decide(_ctx(score=-0.1))


def test_hysteresis_sequence():
    pol = HysteresisPolicy(threshold_on=1.0, threshold_off=-1.0)
    decisions = [pol.decide(_ctx(score=s)) for s in [0.5, 1.0, 0.0, -0.5, -1.0, -1.5, 0.5, 1.2]]
    assert decisions == [F, T, T, T, T, F, F, T]


def test_ucb_explores_then_exploits_by_hand():
    pol = UCBPolicy(beta=0.0, span_bins=2, progress_bins=2, entropy_bins=2)
    ctx = _ctx(span=4, masked=4, entropy=0.9)          # bucket (1, 0, 1)
    assert pol.bucket(ctx) == (1, 0, 1)
    assert pol.decide(ctx) is True                     # both unvisited: tie -> verify
    pol.observe(4, True)                               # reward 4 / 2 = 2
    assert pol.decide(ctx) is False                    # action 0 unvisited -> +inf
    pol.observe(1, False)                              # reward 1
    assert pol.decide(ctx) is True                     # 2 > 1 with beta = 0
    pol.observe(0, True)                               # verify mean -> (2 + 0) / 2 = 1: tie -> verify
    assert pol.decide(ctx) is True
    # With exploration the less-tried action wins: n = (1 for a=0, 3 for a=1) after this observe.
    pol.observe(0, True)                               # verify mean 2/3
    pol.beta = 1.0
    assert pol.decide(ctx) is False
