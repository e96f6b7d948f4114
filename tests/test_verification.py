"""Rejection sampling: exact identity in float64, Monte Carlo chi-square with a negative control, greedy match."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from hf_dllm_spec import verification
from hf_dllm_spec.verification import (
    acceptance_probability,
    greedy_match,
    output_distribution,
    rejection_sample,
    residual_distribution,
)


def _dist(values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum()


CASES = {
    "equal": (_dist([1, 2, 3, 4, 0, 0, 1, 1]), _dist([1, 2, 3, 4, 0, 0, 1, 1])),
    "disjoint_supports": (_dist([1, 1, 0, 0, 0, 0, 0, 0]), _dist([0, 0, 1, 3, 0, 0, 0, 0])),
    "draft_zero_where_target_positive": (_dist([0, 5, 1, 0, 2, 0, 0, 0]), _dist([3, 1, 1, 1, 1, 1, 0, 0])),
    "one_hot_target": (_dist([1, 1, 1, 1, 1, 1, 1, 1]), _dist([0, 0, 0, 1, 0, 0, 0, 0])),
    "random": (torch.rand(8, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).softmax(0),
               torch.rand(8, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).softmax(0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_output_distribution_equals_target_exactly(case):
    draft, target = CASES[case]
    torch.testing.assert_close(output_distribution(target, draft), target, atol=1e-12, rtol=0)


def test_output_distribution_with_warpers_on_both_sides():
    """Top-k applied to draft and target alike keeps the identity (strategies.md §1)."""
    logits_d = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, 3.0], dtype=torch.float64)
    logits_t = torch.tensor([0.0, 2.5, 0.5, 1.0, -2.0, 1.0], dtype=torch.float64)

    def topk_probs(lg, k=3, temperature=0.7):
        lg = lg / temperature
        kth = lg.topk(k).values[-1]
        return torch.where(lg >= kth, lg, torch.tensor(float("-inf"), dtype=lg.dtype)).softmax(0)

    target = topk_probs(logits_t)
    torch.testing.assert_close(output_distribution(target, topk_probs(logits_d)), target, atol=1e-12, rtol=0)


def test_tempering_breaks_the_identity():
    """gamma != 1 is a documented trade-off, not lossless: the identity must then fail."""
    draft, target = CASES["random"]
    assert (output_distribution(target, draft, gamma=0.5) - target).abs().max() > 1e-3


def test_acceptance_probability_values():
    t = torch.tensor([0.2, 0.5, 0.0])
    d = torch.tensor([0.4, 0.25, 0.1])
    torch.testing.assert_close(acceptance_probability(t, d), torch.tensor([0.5, 1.0, 0.0]))
    torch.testing.assert_close(acceptance_probability(t, d, gamma=2.0), torch.tensor([0.25, 1.0, 0.0]))


def test_residual_zero_mass_falls_back_to_target():
    t = _dist([1, 2, 3, 4])
    torch.testing.assert_close(residual_distribution(t, t.clone()), t)
    torch.testing.assert_close(residual_distribution(_dist([1, 1, 0, 0]), _dist([1, 0, 0, 0])),
                               torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64))


def _first_token_histogram(draft, target, n, seed, k=3):
    """Draw k drafts from `draft` per trial (independent positions) and record the first committed token."""
    g = torch.Generator().manual_seed(seed)
    vocab = draft.shape[0]
    counts = torch.zeros(vocab)
    draft_k, target_k = draft.float().expand(k, -1), target.float().expand(k, -1)
    for _ in range(n):
        tokens = torch.multinomial(draft_k, 1, generator=g).squeeze(-1)
        res = rejection_sample(tokens, draft_k, target_k, generator=g)
        counts[res.token_ids[0]] += 1
    return counts


def _chi2_pvalue(counts, probs):
    """Chi-square p-value of `counts` against `probs`; a token the target never emits fails outright."""
    counts, probs = counts.double(), probs.double()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "tokens outside the target's support were emitted"
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return chisquare(counts[keep].numpy(), expected.numpy()).pvalue


def test_monte_carlo_reproduces_target_and_negative_control_fails(monkeypatch):
    draft = _dist([4, 1, 1, 1, 3, 0, 2, 1]).float()
    target = _dist([1, 3, 2, 0, 1, 2, 1, 4]).float()
    counts = _first_token_histogram(draft, target, 20_000, seed=0)
    assert _chi2_pvalue(counts, target) > 1e-3
    # Negative control: always accepting returns the draft distribution, which the same test must reject.
    monkeypatch.setattr(verification, "acceptance_probability", lambda t, d, gamma=1.0: torch.ones_like(t))
    counts_bad = _first_token_histogram(draft, target, 20_000, seed=0)
    with pytest.raises(AssertionError):
        assert _chi2_pvalue(counts_bad, target) > 1e-3


def test_seeded_determinism_and_no_global_rng():
    draft, target = CASES["random"]
    d, t = draft.float().expand(5, -1), target.float().expand(5, -1)
    tokens = torch.tensor([0, 1, 2, 3, 4])
    state = torch.random.get_rng_state()
    a = rejection_sample(tokens, d, t, generator=torch.Generator().manual_seed(7))
    b = rejection_sample(tokens, d, t, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert a.num_accepted == b.num_accepted and torch.equal(a.token_ids, b.token_ids)


def test_extreme_logits_accept_and_reject_deterministically():
    vocab = 6
    sure = torch.full((2, vocab), -10.0).softmax(-1)
    draft = torch.nn.functional.one_hot(torch.tensor([1, 2]), vocab).float()
    target = torch.nn.functional.one_hot(torch.tensor([1, 4]), vocab).float()
    res = rejection_sample(torch.tensor([1, 2]), draft, target, generator=torch.Generator().manual_seed(0))
    assert res.num_accepted == 1 and res.token_ids.tolist() == [1, 4] and res.recovered
    res = rejection_sample(torch.tensor([1, 2]), draft, draft.clone(), bonus_probs=target[1],
                           generator=torch.Generator().manual_seed(0))
    assert res.num_accepted == 2 and res.token_ids.tolist() == [1, 2, 4] and res.bonus
    res = rejection_sample(torch.tensor([1, 2]), draft, target, allow_resample=False,
                           generator=torch.Generator().manual_seed(0))
    assert res.token_ids.tolist() == [1, 2] and not res.recovered
    assert sure.shape == (2, vocab)


def test_greedy_match():
    target = torch.tensor([[0.1, 0.9, 0.0], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    res = greedy_match(torch.tensor([1, 1, 2]), target)
    assert res.num_accepted == 1 and res.token_ids.tolist() == [1, 0] and res.recovered
    res = greedy_match(torch.tensor([1, 0, 2]), target, bonus_probs=torch.tensor([0.0, 0.2, 0.8]))
    assert res.num_accepted == 3 and res.token_ids.tolist() == [1, 0, 2, 2] and res.bonus


def test_inputs_not_modified_in_place():
    draft, target = CASES["random"]
    d, t = draft.float().expand(3, -1).clone(), target.float().expand(3, -1).clone()
    d0, t0 = d.clone(), t.clone()
    rejection_sample(torch.tensor([0, 1, 2]), d, t, generator=torch.Generator().manual_seed(1))
    assert torch.equal(d, d0) and torch.equal(t, t0)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shapes disagree"):
        rejection_sample(torch.tensor([0, 1]), torch.rand(3, 4), torch.rand(3, 4))
