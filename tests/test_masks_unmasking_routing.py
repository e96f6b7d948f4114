"""Pure helpers: mask builders, commit rules and routing, against hand-computed values (batch-leading API)."""

from __future__ import annotations

import math

import pytest
import torch

from hf_dllm_spec.maths.masks import (
    block_causal_mask,
    concat_segments,
    partially_causal_draft_mask,
    to_additive,
    verifier_2l_mask,
)
from hf_dllm_spec.maths.routing import (
    HysteresisPolicy,
    MinimumSpanPolicy,
    RoutingContext,
    RoutingPolicy,
    ScoreThresholdPolicy,
    UCBPolicy,
    acceptance_estimates,
    expected_accepted_length,
    ucb_context_buckets,
    ucb_entropy_bin,
    ucb_progress_bin,
    ucb_span_bin,
    verify_score,
)
from hf_dllm_spec.strategies import first_masked_span
from hf_dllm_spec.maths.unmasking import num_transfer_tokens, scheduled_tokens, select_transfer

T, F = True, False


def _b(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


# -- masks -------------------------------------------------------------------------------------------------------
def test_verifier_2l_mask_eq3():
    expected = _b([
        [T, F, F, F, F, F],
        [T, T, F, F, F, F],
        [T, T, T, F, F, F],
        [F, F, F, T, F, F],
        [T, F, F, F, T, F],
        [T, T, F, F, F, T],
    ])
    assert torch.equal(verifier_2l_mask(3), expected)


def test_partially_causal_draft_mask_eq4():
    out = partially_causal_draft_mask(4, torch.tensor([2, 0, 4, 1]))
    assert out.shape == (4, 4, 4) and out.dtype == torch.bool
    assert torch.equal(out[0], _b([
        [T, F, F, F],
        [T, T, F, F],
        [T, T, T, T],
        [T, T, T, T],
    ]))
    assert out[1].all()                                                    # j = 0: the whole block sees itself
    assert torch.equal(out[2], torch.ones(4, 4, dtype=torch.bool).tril())  # j = B (no mask): token-causal
    assert torch.equal(out[3], _b([
        [T, F, F, F],
        [T, T, T, T],
        [T, T, T, T],
        [T, T, T, T],
    ]))
    # each row is built from its own j: a single-row call gives the same slice
    for n, j in enumerate([2, 0, 4, 1]):
        assert torch.equal(partially_causal_draft_mask(4, torch.tensor([j]))[0], out[n])


def test_block_causal_mask_counts_blocks_from_position_zero():
    m = block_causal_mask(torch.arange(2, 6), 4)          # positions 2..5: blocks 0,0,1,1
    assert torch.equal(m, _b([[T, T, F, F], [T, T, F, F], [T, T, T, T], [T, T, T, T]]))
    assert torch.equal(block_causal_mask(torch.arange(3), 1), torch.ones(3, 3, dtype=torch.bool).tril())
    # batched: each row from its own positions
    pos = torch.tensor([[2, 3, 4, 5], [0, 1, 2, 3], [3, 4, 7, 8]])
    out = block_causal_mask(pos, 4)
    assert out.shape == (3, 4, 4)
    assert torch.equal(out[0], m)
    assert out[1].all()                                    # one block: all visible
    assert torch.equal(out[2], _b([                        # blocks 0,1,1,2
        [T, F, F, F],
        [T, T, T, F],
        [T, T, T, F],
        [T, T, T, T],
    ]))
    # repeated positions (2L layout) see each other; block size 1 is token-causal over positions, not indices
    assert torch.equal(block_causal_mask(torch.tensor([[4, 5, 4, 5]]), 1)[0], _b([
        [T, F, T, F],
        [T, T, T, T],
        [T, F, T, F],
        [T, T, T, T],
    ]))


def test_concat_segments_and_additive():
    m = concat_segments(torch.ones(1, 1, dtype=torch.bool), torch.eye(2, dtype=torch.bool))
    assert torch.equal(m, _b([[T, F, F], [T, T, F], [T, F, T]]))
    add = to_additive(m[None], torch.float32)
    assert add.shape == (1, 1, 3, 3)
    low = torch.finfo(torch.float32).min
    assert add[0, 0, 0, 1] == low and add[0, 0, 1, 0] == 0
    torch.testing.assert_close(add[0, 0], torch.where(m, 0.0, low), atol=0, rtol=0)
    # batched first segment, shared second segment
    first = torch.stack([torch.ones(2, 2, dtype=torch.bool).tril(), torch.ones(2, 2, dtype=torch.bool)])
    out = concat_segments(first, torch.ones(1, 1, dtype=torch.bool))
    assert torch.equal(out, _b([
        [[T, F, F], [T, T, F], [T, T, T]],
        [[T, T, F], [T, T, F], [T, T, T]],
    ]))
    add = to_additive(out, torch.float16)
    assert add.shape == (2, 1, 3, 3) and add.dtype == torch.float16
    assert torch.equal(add[:, 0], torch.where(out, 0.0, torch.finfo(torch.float16).min).half())


def test_num_transfer_tokens():
    assert num_transfer_tokens(4, 4) == [1, 1, 1, 1]
    assert num_transfer_tokens(8, 3) == [3, 3, 2]


@pytest.mark.parametrize("steps_per_block", [1, 2, 3, 4, 8])
def test_scheduled_tokens_matches_num_transfer_tokens(steps_per_block):
    cases = [(m, s) for m in range(1, 10) for s in range(12)]   # steps past the schedule included
    num_masks = torch.tensor([m for m, _ in cases])
    step = torch.tensor([s for _, s in cases])
    out = scheduled_tokens(num_masks, steps_per_block, step)
    expected = []
    for m, s in cases:
        schedule = num_transfer_tokens(m, min(steps_per_block, m))
        expected.append(schedule[min(s, len(schedule) - 1)])
    assert out.tolist() == expected


# -- commit rules ------------------------------------------------------------------------------------------------
CONF = torch.tensor([0.9, 0.2, 0.95, 0.5, 0.3])
MASKED = torch.tensor([T, T, F, T, T])

RULE_CASES = [
    ("sequential", 2, 0.85, [T, T, F, F, F]),
    ("low_confidence_static", 2, 0.85, [T, F, F, T, F]),
    ("low_confidence_dynamic", 1, 0.85, [T, F, F, F, F]),
    ("low_confidence_dynamic", 1, 0.25, [T, F, F, T, T]),
    ("low_confidence_dynamic", 1, 0.99, [T, F, F, F, F]),   # nothing crosses: still one token (Fast-dLLM #42)
    ("low_confidence_dynamic", 3, 0.85, [T, F, F, T, T]),   # fewer than k confident: top-k
]


@pytest.mark.parametrize("rule,k,threshold,expected", RULE_CASES)
def test_select_transfer_rules(rule, k, threshold, expected):
    out = select_transfer(rule, masked=MASKED[None], confidence=CONF[None], num_tokens=k,
                          confidence_threshold=threshold)
    assert out.shape == (1, 5) and out[0].tolist() == expected
    out_t = select_transfer(rule, masked=MASKED[None], confidence=CONF[None], num_tokens=torch.tensor([k]),
                            confidence_threshold=threshold)
    assert out_t[0].tolist() == expected


@pytest.mark.parametrize("rule", ["sequential", "low_confidence_static", "low_confidence_dynamic", "entropy_bounded"])
def test_select_transfer_rows_are_independent(rule):
    """A batch with per-row k gives, row by row, what one-row calls give."""
    g = torch.Generator().manual_seed(5)
    n, width = 12, 6
    masked = torch.rand(n, width, generator=g) < 0.6
    masked[0] = False                                   # a row without masks commits nothing
    masked[1] = True
    conf = torch.rand(n, width, generator=g)
    ent = torch.rand(n, width, generator=g) * 0.4
    k = torch.randint(0, 5, (n,), generator=g)          # 0 is clamped up to 1
    kwargs = dict(confidence_threshold=0.5, entropies=ent, eb_threshold=0.5)
    out = select_transfer(rule, masked=masked, confidence=conf, num_tokens=k, **kwargs)
    assert out.shape == (n, width)
    assert not out[0].any()
    assert not (out & ~masked).any()
    for r in range(n):
        single = select_transfer(rule, masked=masked[r:r + 1], confidence=conf[r:r + 1], num_tokens=int(k[r]),
                                 confidence_threshold=0.5, entropies=ent[r:r + 1], eb_threshold=0.5)
        assert out[r].tolist() == single[0].tolist(), r
        if masked[r].any():
            assert out[r].sum() >= min(max(int(k[r]), 1), int(masked[r].sum()))
    # rows are not all alike (the comparison above is not trivially true)
    assert len({tuple(row) for row in out.tolist()}) > 3


def test_select_transfer_ties_go_leftmost():
    masked = _b([[T, T, T, T, T], [F, T, T, T, T]])
    conf = torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.5], [0.9, 0.3, 0.7, 0.3, 0.7]])
    out = select_transfer("low_confidence_static", masked=masked, confidence=conf, num_tokens=torch.tensor([2, 3]))
    assert out.tolist() == [[T, T, F, F, F], [F, T, T, F, T]]        # 0.7, 0.7, then the left 0.3
    out = select_transfer("low_confidence_static", masked=masked, confidence=conf, num_tokens=torch.tensor([2, 2]))
    assert out.tolist() == [[T, T, F, F, F], [F, F, T, F, T]]
    out = select_transfer("low_confidence_dynamic", masked=masked, confidence=conf, num_tokens=1,
                          confidence_threshold=0.95)
    assert out.tolist() == [[T, F, F, F, F], [F, F, T, F, F]]
    out = select_transfer("entropy_bounded", masked=masked, confidence=conf, num_tokens=1,
                          entropies=torch.full((2, 5), 0.2), eb_threshold=0.3)
    assert out.tolist() == [[T, T, F, F, F], [F, T, T, F, F]]


def test_entropy_bounded_uses_per_position_entropy():
    ent = torch.tensor([0.10, 0.30, 0.0, 0.05, 1.0])
    # ascending over masked: idx3 (0.05), idx0 (0.15 cum), idx1 (0.45 cum >= 0.35) -> 3 positions
    out = select_transfer("entropy_bounded", masked=MASKED[None], confidence=CONF[None], num_tokens=1,
                          entropies=ent[None], eb_threshold=0.35)
    assert out[0].tolist() == [T, T, F, T, F]
    # batched with a second row whose budget is reached at once, and k forcing more in a third
    masked = torch.stack([MASKED, MASKED, MASKED])
    ents = torch.stack([ent, torch.tensor([0.5, 0.3, 0.0, 0.9, 1.0]), ent])
    out = select_transfer("entropy_bounded", masked=masked, confidence=CONF.expand(3, -1),
                          num_tokens=torch.tensor([1, 1, 4]), entropies=ents, eb_threshold=0.35)
    assert out.tolist() == [[T, T, F, T, F], [T, T, F, F, F], [T, T, F, T, T]]
    with pytest.raises(ValueError, match="entropies"):
        select_transfer("entropy_bounded", masked=MASKED[None], confidence=CONF[None], num_tokens=1)
    with pytest.raises(ValueError, match="remasking_strategy"):
        select_transfer("nope", masked=MASKED[None], confidence=CONF[None], num_tokens=1)


def test_first_masked_span():
    start, end = first_masked_span(_b([[F, T, T, F, T], [F, F, F, F, F], [T, T, T, T, T], [T, F, T, T, F]]))
    assert start.tolist() == [1, 5, 0, 0]
    assert end.tolist() == [3, 5, 5, 1]
    start, end = first_masked_span(_b([[F, F]]))
    assert (start.tolist(), end.tolist()) == ([2], [2])


# -- routing -----------------------------------------------------------------------------------------------------
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
    expected = torch.tensor(expected)
    out = acceptance_estimates(name, PROBS, CHOSEN, **kwargs)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # batched (N, B, V) -> (N, B): rows in a different order give the permuted values
    perm = torch.tensor([2, 0, 1])
    probs = torch.stack([PROBS, PROBS[perm]])
    chosen = torch.stack([CHOSEN, CHOSEN[perm]])
    out = acceptance_estimates(name, probs, chosen, **kwargs)
    assert out.shape == (2, 3)
    torch.testing.assert_close(out, torch.stack([expected, expected[perm]]), atol=1e-5, rtol=1e-5)


def test_unknown_estimator_raises():
    with pytest.raises(ValueError, match="token_acceptance_estimator"):
        acceptance_estimates("nope", PROBS, CHOSEN)


def test_expected_accepted_length_and_scores():
    out = expected_accepted_length(torch.tensor([[1.0, 0.5, 0.5]]))
    assert out.shape == (1,) and out.item() == pytest.approx(1 + 0.5 + 0.25)
    alpha = torch.tensor([
        [1.0, 0.5, 0.5, 0.9],
        [0.1, 1.0, 0.5, 0.9],     # span [1, 3): 1 + 0.5; alpha outside the span ignored
        [0.3, 0.3, 0.8, 1.0],     # span [2, 4): 0.8 + 0.8
        [0.9, 0.9, 0.9, 0.9],     # empty span
        [0.5, 1.0, 1.0, 1.0],     # span [0, 1) only: the 1.0 after it must not count
    ])
    span = _b([[T, T, T, F], [F, T, T, F], [F, F, T, T], [F, F, F, F], [T, F, F, F]])
    out = expected_accepted_length(alpha, span)
    assert out.shape == (5,)
    assert out[3].item() == float("-inf")
    torch.testing.assert_close(out[[0, 1, 2, 4]], torch.tensor([1.75, 1.5, 1.6, 0.5]), atol=1e-6, rtol=1e-6)
    # span=None: the whole row
    torch.testing.assert_close(expected_accepted_length(alpha[:1]), torch.tensor([1.0 + 0.5 + 0.25 + 0.225]),
                               atol=1e-6, rtol=1e-6)
    assert verify_score(1.75, score_type="difference_static", penalty_coef=1.0, num_confident=3) == 0.75
    assert verify_score(1.75, score_type="difference_dynamic", penalty_coef=0.5, num_confident=3) == 0.25
    k_hat = torch.tensor([1.75, 0.5, float("-inf")])
    torch.testing.assert_close(
        verify_score(k_hat, score_type="difference_dynamic", penalty_coef=0.5, num_confident=torch.tensor([3, 0, 1])),
        torch.tensor([0.25, 0.5, float("-inf")]))
    torch.testing.assert_close(
        verify_score(k_hat, score_type="difference_static", penalty_coef=1.0, num_confident=torch.tensor([3, 0, 1])),
        torch.tensor([0.75, -0.5, float("-inf")]))
    with pytest.raises(ValueError, match="do_verify_score_type"):
        verify_score(k_hat, score_type="nope", penalty_coef=1.0, num_confident=0)


def _ctx(score=0.0, span=2, masked=3, entropy=0.5, start=0):
    return RoutingContext(span_length=span, block_size=4, num_masked=masked, num_decodable=4, score=score,
                          mean_normalized_entropy=entropy, span_start=start)


def test_routing_context_and_policy_flags():
    assert _ctx(start=2).span_start == 2
    assert RoutingContext(span_length=1, block_size=4, num_masked=1, num_decodable=4).span_start == 0
    assert UCBPolicy(1.0, 2, 2, 2, counts_prompt_tail=False).needs_feedback is True
    for pol in (MinimumSpanPolicy(1), ScoreThresholdPolicy(0.0), HysteresisPolicy(0.0, -1.0)):
        assert pol.needs_feedback is False
    assert RoutingPolicy.needs_feedback is False


def test_minimum_span_and_score_threshold():
    assert MinimumSpanPolicy(2).decide(_ctx(span=2)) and not MinimumSpanPolicy(3).decide(_ctx(span=2))
    assert ScoreThresholdPolicy(0.0).decide(_ctx(score=0.0)) and not ScoreThresholdPolicy(0.0).decide(_ctx(score=-0.1))


def test_hysteresis_sequence():
    pol = HysteresisPolicy(threshold_on=1.0, threshold_off=-1.0)
    decisions = [pol.decide(_ctx(score=s)) for s in [0.5, 1.0, 0.0, -0.5, -1.0, -1.5, 0.5, 1.2]]
    assert decisions == [F, T, T, T, T, F, F, T]


@pytest.mark.parametrize("counts_prompt_tail", [False, True])
def test_ucb_explores_then_exploits_by_hand(counts_prompt_tail):
    pol = UCBPolicy(beta=0.0, span_bins=2, progress_bins=2, entropy_bins=2, counts_prompt_tail=counts_prompt_tail)
    ctx = _ctx(span=4, masked=4, entropy=0.9)          # bucket (1, 0, 1); no prompt tail: same in both conventions
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


# -- UCB context buckets (strategies.md §5.6) --------------------------------------------------------------------
def _bins(fn, values, *args):
    return fn(torch.tensor(values), *args).tolist()


@pytest.mark.parametrize("block_size, num_bins, lengths, expected", [
    # floor((L - 1) / (B - 1) * bins), clamped to bins - 1; L = 1 -> 0, L = B -> last bin.
    (4, 2, [1, 2, 3, 4], [0, 0, 1, 1]),
    (4, 3, [1, 2, 3, 4], [0, 1, 2, 2]),              # the old (L - 1) / B put L = 2 in bin 0
    (32, 2, [1, 16, 17, 32], [0, 0, 1, 1]),
    (32, 3, [1, 11, 12, 21, 22, 32], [0, 0, 1, 1, 2, 2]),   # 21/31*3 = 2.03 (old 21/32*3 = 1.97 -> 1)
    (1, 2, [1], [0]),                                # B = 1: bin 0, no division by zero
    (1, 3, [1, 0], [0, 0]),
    (4, 2, [0], [0]),                                # empty span clamps to bin 0
])
def test_ucb_span_bin_by_hand(block_size, num_bins, lengths, expected):
    out = ucb_span_bin(torch.tensor(lengths), block_size, num_bins)
    assert out.dtype == torch.long and out.shape == (len(lengths),)
    assert out.tolist() == expected


def _progress(num_masked, block_size, num_bins, *, counts_prompt_tail, num_decodable=None):
    decodable = None if num_decodable is None else torch.tensor(num_decodable)
    return ucb_progress_bin(torch.tensor(num_masked), block_size, num_bins, counts_prompt_tail=counts_prompt_tail,
                            num_decodable=decodable).tolist()


@pytest.mark.parametrize("counts_prompt_tail", [False, True])
@pytest.mark.parametrize("block_size, num_bins, num_masked, expected", [
    # No prompt tail in the block (block-aligned prompt, or any later block): decoded = B - |M_t| in both
    # conventions; floor(decoded / B * bins), clamped.
    (4, 2, [4, 3, 2, 1, 0], [0, 0, 1, 1, 1]),
    (4, 3, [4, 3, 2, 1, 0], [0, 0, 1, 2, 2]),
    (32, 2, [32, 17, 16, 15, 0], [0, 0, 1, 1, 1]),
    (32, 3, [22, 21, 11, 10], [0, 1, 1, 2]),          # decoded 10, 11, 21, 22: x 3/32 = 0.94, 1.03, 1.97, 2.06
    (1, 2, [1, 0], [0, 1]),                           # B = 1 needs no special case
])
def test_ucb_progress_bin_block_aligned_both_conventions(counts_prompt_tail, block_size, num_bins, num_masked,
                                                         expected):
    out = _progress(num_masked, block_size, num_bins, counts_prompt_tail=counts_prompt_tail,
                    num_decodable=[block_size] * len(num_masked))
    assert out == expected


def test_ucb_progress_counts_prompt_tail_fast_dllm_v2_convention():
    # Fast-dLLM v2 reference: decoded = non-mask positions of the (sub-)block = B - |M_t|, the tail included.
    # B = 4 with a 3-token prompt tail and its one mask still open: decoded = 3 -> 3/4.
    assert _progress([1], 4, 2, counts_prompt_tail=True) == [1]                       # 1.5 -> 1
    assert _progress([1], 4, 3, counts_prompt_tail=True) == [2]                       # 2.25 -> 2
    # num_decodable is not read in this convention.
    assert _progress([1], 4, 3, counts_prompt_tail=True, num_decodable=[1]) == [2]
    # B = 32, 10-token prompt tail: 22 masks at the block's start, then 20, 15, 11, 5, 0 (decoded 10, 12, 17,
    # 21, 27, 32): x 3/32 = 0.94, 1.13, 1.59, 1.97, 2.53, 3 -> clamp; x 2/32 = 0.63, 0.75, 1.06, 1.31, 1.69, 2.
    masks = [22, 20, 15, 11, 5, 0]
    assert _progress(masks, 32, 3, counts_prompt_tail=True) == [0, 1, 1, 1, 2, 2]
    assert _progress(masks, 32, 2, counts_prompt_tail=True) == [0, 0, 1, 1, 1, 1]


def test_ucb_progress_leaves_out_prompt_tail_sdar_convention():
    # SDAR reference: a per-block counter starts at 0 and grows by the tokens each step commits, so
    # decoded = (B - tail) - |M_t| = num_decodable - |M_t|; the denominator stays B.
    # B = 4, 3-token tail, its one mask open: decoded 0 (Fast-dLLM v2 convention: 3); once committed: 1/4.
    assert _progress([1, 0], 4, 2, counts_prompt_tail=False, num_decodable=[1, 1]) == [0, 0]   # 0, 0.5
    assert _progress([1, 0], 4, 3, counts_prompt_tail=False, num_decodable=[1, 1]) == [0, 0]   # 0, 0.75
    # B = 32, 10-token tail (22 decodable), masks 22, 20, 15, 11, 5, 0: decoded 0, 2, 7, 11, 17, 22;
    # x 3/32 = 0, 0.19, 0.66, 1.03, 1.59, 2.06; x 2/32 = 0, 0.13, 0.44, 0.69, 1.06, 1.38.
    masks = [22, 20, 15, 11, 5, 0]
    assert _progress(masks, 32, 3, counts_prompt_tail=False, num_decodable=[22] * 6) == [0, 0, 0, 1, 1, 2]
    assert _progress(masks, 32, 2, counts_prompt_tail=False, num_decodable=[22] * 6) == [0, 0, 0, 0, 1, 1]
    # Rows with different tails in one batch.
    assert _progress([1, 2, 0], 4, 2, counts_prompt_tail=False, num_decodable=[1, 4, 4]) == [0, 1, 1]
    with pytest.raises(ValueError, match="num_decodable"):
        _progress([1], 4, 2, counts_prompt_tail=False)


def test_ucb_entropy_bin_by_hand():
    assert _bins(ucb_entropy_bin, [0.0, 0.49, 0.5, 0.99, 1.0], 2) == [0, 0, 1, 1, 1]
    assert _bins(ucb_entropy_bin, [0.0, 0.33, 0.34, 0.66, 0.67, 1.0], 3) == [0, 0, 1, 1, 2, 2]
    assert _bins(ucb_entropy_bin, [float("nan"), -1e-7], 2) == [0, 0]
    assert _bins(ucb_entropy_bin, [0.7], 1) == [0]


def test_ucb_bins_match_reference_float_formula_exhaustively():
    # The reference computes int((L - 1) / (B - 1) * bins) and int(decoded / B * bins) in Python floats; the float64
    # tensors reproduce it bit for bit, including edges where float rounding differs from exact arithmetic
    # (e.g. B = 12, L = 4, 55 bins: 3/11*55 = 14.999... -> 14, exact would be 15).
    for block_size in (2, 3, 4, 7, 8, 12, 16, 22, 23, 32):
        for num_bins in (1, 2, 3, 4, 22, 55):
            lengths = torch.arange(1, block_size + 1)
            expected = [min(num_bins - 1, int((L - 1) / (block_size - 1) * num_bins)) for L in range(1, block_size + 1)]
            assert ucb_span_bin(lengths, block_size, num_bins).tolist() == expected, (block_size, num_bins)
            # Every prompt tail 0 .. B - 1 and every mask count: the reference's int(decoded / B * bins).
            for tail in range(block_size):
                m = torch.arange(block_size - tail + 1)
                for counts_tail in (False, True):
                    expected = [min(num_bins - 1, int(((block_size - k) if counts_tail else (block_size - tail - k))
                                                      / block_size * num_bins)) for k in m.tolist()]
                    out = ucb_progress_bin(m, block_size, num_bins, counts_prompt_tail=counts_tail,
                                           num_decodable=torch.full_like(m, block_size - tail))
                    assert out.tolist() == expected, (block_size, num_bins, tail, counts_tail)
    assert ucb_span_bin(torch.tensor([4]), 12, 55).tolist() == [14]


def test_ucb_context_buckets_shape_and_policy_bucket():
    span, masked, ent = torch.tensor([1, 4, 2]), torch.tensor([1, 4, 2]), torch.tensor([1.0, 0.0, 0.4])
    decodable = torch.tensor([4, 4, 3])                  # the third row has a 1-token prompt tail
    out = ucb_context_buckets(span, masked, ent, 4, (3, 3, 2), counts_prompt_tail=True, num_decodable=decodable)
    assert out.shape == (3, 3) and out.dtype == torch.long
    assert out.tolist() == [[0, 2, 1], [2, 0, 0], [1, 1, 0]]          # decoded 3, 0, 2: x 3/4 = 2.25, 0, 1.5
    out = ucb_context_buckets(span, masked, ent, 4, (3, 3, 2), counts_prompt_tail=False, num_decodable=decodable)
    assert out.tolist() == [[0, 2, 1], [2, 0, 0], [1, 0, 0]]          # decoded 3, 0, 1: the tail row drops to 0.75
    ctx = RoutingContext(span_length=2, block_size=4, num_masked=2, num_decodable=3, mean_normalized_entropy=0.4)
    assert UCBPolicy(1.0, 3, 3, 2, counts_prompt_tail=True).bucket(ctx) == (1, 1, 0)   # from the context
    pol = UCBPolicy(1.0, 3, 3, 2, counts_prompt_tail=False)
    assert pol.bucket(ctx) == (1, 0, 0)                  # decoded = 3 - 2 = 1 -> floor(0.75) = 0
    ctx.ucb_bucket = (2, 0, 1)
    assert pol.bucket(ctx) == (2, 0, 1)                  # precomputed (batched) bucket wins


def _ucb_ctx(masked, decodable):
    return RoutingContext(span_length=1, block_size=4, num_masked=masked, num_decodable=decodable,
                          mean_normalized_entropy=0.1)


@pytest.mark.parametrize("counts_prompt_tail,buckets,same,unvisited", [
    # Fast-dLLM v2: ctx_tail (3-token prompt tail, 1 mask) and ctx_half (no tail, 2 masks) share (0, 1, 0);
    # ctx_quarter (no tail, 3 masks) is (0, 0, 0).
    (True, [(0, 1, 0), (0, 1, 0), (0, 0, 0)], "half", "quarter"),
    # SDAR: ctx_tail (decoded 0 in the block) shares (0, 0, 0) with ctx_quarter (decoded 1: 1/4 * 2 = 0.5), and
    # ctx_half (decoded 2) is (0, 1, 0).
    (False, [(0, 0, 0), (0, 1, 0), (0, 0, 0)], "quarter", "half"),
])
def test_ucb_decisions_use_reference_buckets(counts_prompt_tail, buckets, same, unvisited):
    """Each progress convention, bins (2, 2, 2), B = 4: the buckets, then UCB exploits the bucket it has seen and
    explores the one it has not."""
    ctx = {"tail": _ucb_ctx(1, 1), "half": _ucb_ctx(2, 4), "quarter": _ucb_ctx(3, 4)}
    pol = UCBPolicy(beta=0.0, span_bins=2, progress_bins=2, entropy_bins=2, counts_prompt_tail=counts_prompt_tail)
    assert [pol.bucket(ctx[k]) for k in ("tail", "half", "quarter")] == buckets
    assert pol.decide(ctx["tail"]) is True
    pol.observe(0, True)                                 # verify: reward 0
    assert pol.decide(ctx["tail"]) is False
    pol.observe(1, False)                                # no verify: reward 1
    assert pol.decide(ctx[same]) is False                # same bucket: exploits "no verify"
    pol.observe(1, False)
    assert pol.decide(ctx[unvisited]) is True            # a bucket never visited: +inf, tie -> verify


def test_family_patches_select_ucb_progress_convention():
    """Each family follows its S2D2 reference: SDAR (`SDAR/generate_ssd_policy.py`) leaves the prompt tail out,
    Fast-dLLM v2 (`Fast-dLLM-v2/generate_policy_utils.py`) counts it; LLaDA2 (no UCB in its reference) follows
    SDAR; Qwen and the causal-LM fallback inherit the base default (SDAR's)."""
    from model_patches.base import FamilyPatch
    from model_patches.causal_lm import CausalLMPatch
    from model_patches.fast_dllm_v2 import FastDLLMV2Patch
    from model_patches.llada2 import LLaDA2Patch
    from model_patches.qwen import QwenPatch
    from model_patches.sdar import SDARPatch

    assert FamilyPatch.ucb_progress_counts_prompt_tail is False
    assert SDARPatch.ucb_progress_counts_prompt_tail is False
    assert FastDLLMV2Patch.ucb_progress_counts_prompt_tail is True
    assert LLaDA2Patch.ucb_progress_counts_prompt_tail is False
    assert "ucb_progress_counts_prompt_tail" not in vars(QwenPatch)
    assert "ucb_progress_counts_prompt_tail" not in vars(CausalLMPatch)
    assert QwenPatch.ucb_progress_counts_prompt_tail is CausalLMPatch.ucb_progress_counts_prompt_tail is False


def _patch(name):
    from model_patches.fast_dllm_v2 import FastDLLMV2Patch
    from model_patches.sdar import SDARPatch

    return {"sdar": SDARPatch, "fast_dllm_v2": FastDLLMV2Patch}[name]()


@pytest.mark.parametrize("family, expected", [
    # Row 0: 3-token tail, 1 mask: decoded 3 (Fast-dLLM v2) or 0 (SDAR) -> x 3/4 = 2.25 or 0.
    # Row 1: fresh block, no tail: decoded 0 in both.
    # Row 2: 1-token tail, 2 masks: decoded 2 (Fast-dLLM v2) or 1 (SDAR) -> 1.5 or 0.75.
    ("fast_dllm_v2", [(0, 2, 1), (2, 0, 0), (1, 1, 0)]),
    ("sdar", [(0, 0, 1), (2, 0, 0), (1, 0, 0)]),
])
def test_s2d2_routing_context_buckets_from_block_state(family, expected):
    """The strategy's routing contexts carry the §5.6 buckets of a crafted block (prompt tail sharing it), with
    the progress convention of the target's family patch."""
    from types import SimpleNamespace

    from hf_dllm_spec import S2D2Config
    from hf_dllm_spec.strategies.block_diffusion import BlockState
    from hf_dllm_spec.strategies.s2d2 import S2D2Strategy

    M, V = 99, 8
    patch = _patch(family)
    session = SimpleNamespace(batch_size=3, sampler=SimpleNamespace(do_sample=False, logits_processor=[]), stream=None,
                              follow=lambda select, add=None: None,
                              target=SimpleNamespace(alignment="position", patch=patch))
    config = S2D2Config(block_size=4, do_verify_policy="contextual_bandit_ucb", ucb_span_length_bins=3,
                        ucb_block_progress_bins=3, ucb_entropy_bins=2)
    strategy = S2D2Strategy(config, session)
    assert all(p.counts_prompt_tail is patch.ucb_progress_counts_prompt_tail for p in strategy.policies)
    undecided = _b([[F, F, F, T],                        # 3-token prompt tail, one mask: L = 1
                    [T, T, T, T],                        # fresh block: L = 4
                    [F, T, T, F]])                       # 1-token tail, a decided token at 3: L = 2
    block = BlockState(tokens=torch.where(undecided, M, 7), undecided=undecided, start=torch.tensor([8, 12, 4]),
                       num_fixed=torch.tensor([3, 0, 1]), step=torch.zeros(3, dtype=torch.long),
                       post_steps=torch.zeros(3, dtype=torch.long), mask_token_id=M)
    probs = torch.zeros(3, 4, V)
    probs[0] = 1.0 / V                                   # normalised entropy 1 -> bin 1
    probs[1, :, 0] = 1.0                                 # 0 -> bin 0
    probs[2, :, :2] = 0.5                                # log 2 / log 8 = 1/3 -> bin 0
    confidence = probs.max(dim=-1).values
    start, end = first_masked_span(block.masked)
    contexts = strategy.routing_contexts(block, probs, confidence, start, end)
    assert [(c.span_start, c.span_length, c.num_masked, c.num_decodable) for c in contexts] == \
        [(3, 1, 1, 1), (0, 4, 4, 4), (1, 2, 2, 3)]
    # floor((L-1)/3*3), floor(decoded/4*3), floor(e*2)
    assert [c.ucb_bucket for c in contexts] == expected
    assert [strategy.policies[i].bucket(c) for i, c in enumerate(contexts)] == expected
    # The per-context path (no precomputed bucket) agrees with the batched one.
    for c, e in zip(contexts, expected):
        c.ucb_bucket = None
        assert UCBPolicy(1.0, 3, 3, 2, counts_prompt_tail=patch.ucb_progress_counts_prompt_tail).bucket(c) == e


def test_the_dynamic_rule_is_strictly_above_the_threshold():
    """`low_confidence_dynamic` commits positions whose confidence is above the threshold (SDAR's `confidence >
    threshold`): one exactly at it is not confident, so k = 1 takes the top one alone."""
    masked = torch.tensor([[True, True, True]])
    confidence = torch.tensor([[0.5, 0.5, 0.25]])
    got = select_transfer("low_confidence_dynamic", masked=masked, confidence=confidence, num_tokens=1,
                          confidence_threshold=0.5)
    assert got.tolist() == [[True, False, False]]
    above = select_transfer("low_confidence_dynamic", masked=masked, confidence=confidence, num_tokens=1,
                            confidence_threshold=0.49)
    assert above.tolist() == [[True, True, False]]


def test_a_sampled_token_reports_its_own_probability():
    """`Sampler.choose` returns the chosen token's probability as its confidence, also when sampling drew a token
    other than the argmax (the commit rule ranks positions by it)."""
    from transformers import LogitsProcessorList

    from hf_dllm_spec.maths.sampling import Sampler

    probs = torch.tensor([[0.4, 0.35, 0.25]]).expand(64, 3).contiguous()
    sampler = Sampler(LogitsProcessorList(), True, [], generator=torch.Generator().manual_seed(0))
    tokens, confidence = sampler.choose(probs)
    assert len(set(tokens.tolist())) == 3                          # draws other than the argmax happened
    assert torch.equal(confidence, probs.gather(-1, tokens[:, None])[:, 0])


def test_s2d2_dynamic_score_counts_masked_positions_only(sdar_model, monkeypatch):
    """Eq. 6's N_hi counts the still-masked positions above the confidence threshold, never committed ones: at every
    routing decision it is at most |M_t|, and once positions are committed below a low threshold it is less than
    the block's confident positions."""
    import hf_dllm_spec.strategies.s2d2 as s2d2

    seen = []
    score, columns = s2d2.verify_score, s2d2.S2D2Strategy.routing_columns

    def spied_score(k_hat, *, num_confident, **kwargs):
        seen.append([num_confident.clone()])
        return score(k_hat, num_confident=num_confident, **kwargs)

    def spied_columns(self, block, draft_probs, confidence, start, end):
        out = columns(self, block, draft_probs, confidence, start, end)
        seen[-1] += [out["num_masked"].clone(), (confidence > self.config.confidence_threshold).sum(dim=1)]
        return out

    monkeypatch.setattr(s2d2, "verify_score", spied_score)
    monkeypatch.setattr(s2d2.S2D2Strategy, "routing_columns", spied_columns)
    sdar_model.generate(torch.tensor([[5, 17, 42, 8, 23]]), decoding_strategy="s2d2", max_new_tokens=12,
                        eos_token_id=None, do_verify_policy="score_threshold",
                        do_verify_score_type="difference_dynamic", confidence_threshold=1e-4, steps_per_block=4,
                        min_ssd_span_length=4)
    assert seen and all(len(s) == 3 for s in seen)
    assert all((n_hi <= masked).all() for n_hi, masked, _ in seen)
    assert any((n_hi < everywhere).any() for n_hi, _, everywhere in seen)      # committed positions were confident


def test_concat_segments_second_sees_all_of_the_first_whatever_its_pattern():
    """The second segment sees every position of the first, whatever the first's own pattern (here the identity:
    each of its positions sees only itself), and the first never sees the second."""
    out = concat_segments(torch.eye(2, dtype=torch.bool), torch.ones(1, 1, dtype=torch.bool))
    assert out.tolist() == [[True, False, False], [False, True, False], [True, True, True]]
