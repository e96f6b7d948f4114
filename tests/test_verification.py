"""Rejection sampling: exact identity in float64, Monte Carlo chi-square with a negative control, greedy match.

Batch-leading API: drafts `(N, L)`, distributions `(N, L, V)`, results per row.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from hf_dllm_spec.maths import verification
from hf_dllm_spec.maths.sampling import draw_verification
from hf_dllm_spec.maths.verification import (
    acceptance_probability,
    greedy_match,
    output_distribution,
    rejection_sample,
    residual_distribution,
)


def _dist(values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum()


def _one_hot(ids, vocab) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.as_tensor(ids), vocab).float()


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


def test_output_distribution_identity_batched():
    """All CASES stacked into one `(N, V)` call (and an `(N, 1, V)` one): every row equals its target."""
    draft = torch.stack([d for d, _ in CASES.values()])
    target = torch.stack([t for _, t in CASES.values()])
    out = output_distribution(target, draft)
    assert out.shape == target.shape
    for n in range(len(CASES)):
        torch.testing.assert_close(out[n], target[n], atol=1e-12, rtol=0)
    torch.testing.assert_close(output_distribution(target[:, None], draft[:, None])[:, 0], target, atol=1e-12,
                               rtol=0)
    # rows are not all the same target (the identity is checked per row, not broadcast from one)
    assert (target[1] - target[2]).abs().max() > 0.1
    # negative control in the same batched form: tempering breaks the identity on the rows where draft != target
    tempered = output_distribution(target, draft, gamma=0.5)
    assert (tempered[4] - target[4]).abs().max() > 1e-3


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
    # batched (N, L)
    torch.testing.assert_close(acceptance_probability(torch.stack([t, d]), torch.stack([d, t])),
                               torch.tensor([[0.5, 1.0, 0.0], [1.0, 0.5, 1.0]]))


def test_residual_zero_mass_falls_back_to_target():
    t = _dist([1, 2, 3, 4])
    torch.testing.assert_close(residual_distribution(t, t.clone()), t)
    torch.testing.assert_close(residual_distribution(_dist([1, 1, 0, 0]), _dist([1, 0, 0, 0])),
                               torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64))
    # batched: the fallback is per row
    out = residual_distribution(torch.stack([t, _dist([1, 1, 0, 0])]), torch.stack([t.clone(), _dist([1, 0, 0, 0])]))
    torch.testing.assert_close(out, torch.stack([t, torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)]))


# -- Monte Carlo, batched ----------------------------------------------------------------------------------------
# Position-dependent (draft, target) pairs: position i of every row uses pair i, so the token committed at
# position i must follow target i (conditioned on reaching it), including the residual draw at the right position.
MC_PAIRS = [
    (_dist([4, 1, 1, 1, 3, 0, 2, 1]).float(), _dist([1, 3, 2, 0, 1, 2, 1, 4]).float()),
    (_dist([1, 1, 1, 1, 1, 1, 1, 1]).float(), _dist([0, 0, 5, 1, 1, 0, 2, 1]).float()),
    (_dist([2, 2, 1, 0, 1, 3, 1, 1]).float(), _dist([1, 1, 3, 1, 0, 2, 1, 1]).float()),
]
MC_ROWS = 20_000


def _batched_committed(seed, rows=MC_ROWS):
    """One `rejection_sample` call over `rows` rows of k = 3 drafts sampled from the per-position drafts."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.stack([d for d, _ in MC_PAIRS])                  # (k, V)
    target = torch.stack([t for _, t in MC_PAIRS])
    k, vocab = draft.shape
    tokens = torch.multinomial(draft.repeat(rows, 1), 1, generator=g).view(rows, k)
    return rejection_sample(tokens, draft.expand(rows, k, vocab), target.expand(rows, k, vocab), generator=g)


def _chi2_pvalue(counts, probs):
    """Chi-square p-value of `counts` against `probs`; a token the target never emits fails outright."""
    counts, probs = counts.double(), probs.double()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "tokens outside the target's support were emitted"
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return chisquare(counts[keep].numpy(), expected.numpy()).pvalue


def _histogram(tokens, vocab):
    return torch.bincount(tokens, minlength=vocab).float()


def test_monte_carlo_reproduces_target_and_negative_control_fails(monkeypatch):
    vocab = MC_PAIRS[0][0].shape[0]
    res = _batched_committed(seed=0)
    assert res.token_ids.shape == (MC_ROWS, 4) and (res.num_tokens >= 1).all()
    assert torch.equal(res.num_tokens, res.num_accepted + res.recovered.long())
    first = res.token_ids[:, 0]
    assert _chi2_pvalue(_histogram(first, vocab), MC_PAIRS[0][1]) > 1e-3
    # later positions, among the rows whose drafts before them passed
    for i in (1, 2):
        reached = res.num_accepted >= i
        assert int(reached.sum()) > 2_000
        assert _chi2_pvalue(_histogram(res.token_ids[reached, i], vocab), MC_PAIRS[i][1]) > 1e-3
    # Negative control: always accepting returns the draft distribution, which the same test must reject.
    monkeypatch.setattr(verification, "acceptance_probability", lambda t, d, gamma=1.0: torch.ones_like(t))
    bad = _batched_committed(seed=0)
    assert (bad.num_accepted == 3).all()
    with pytest.raises(AssertionError):
        assert _chi2_pvalue(_histogram(bad.token_ids[:, 0], vocab), MC_PAIRS[0][1]) > 1e-3


def test_monte_carlo_negative_control_residual_at_wrong_position(monkeypatch):
    """A recovered token drawn from the residual of a different position would show in the chi-square."""
    vocab = MC_PAIRS[0][0].shape[0]
    real = verification.residual_distribution
    # always use position 2's pair for the residual, whatever the rejected position
    monkeypatch.setattr(verification, "residual_distribution",
                        lambda t, d: real(MC_PAIRS[2][1].expand_as(t), MC_PAIRS[2][0].expand_as(d)))
    bad = _batched_committed(seed=0)
    with pytest.raises(AssertionError):
        assert _chi2_pvalue(_histogram(bad.token_ids[:, 0], vocab), MC_PAIRS[0][1]) > 1e-3


# -- determinism and RNG -----------------------------------------------------------------------------------------
def test_seeded_determinism_and_no_global_rng():
    draft, target = CASES["random"]
    d, t = draft.float().expand(1, 5, -1), target.float().expand(1, 5, -1)
    tokens = torch.tensor([[0, 1, 2, 3, 4]])
    state = torch.random.get_rng_state()
    a = rejection_sample(tokens, d, t, generator=torch.Generator().manual_seed(7))
    b = rejection_sample(tokens, d, t, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.token_ids, b.token_ids)
    # batched, with bonus and ragged rows: same seed -> same result, other seeds differ, global RNG untouched
    n = 64
    d, t = draft.float().expand(n, 5, -1), target.float().expand(n, 5, -1)
    tokens = torch.randint(0, 8, (n, 5), generator=torch.Generator().manual_seed(0))
    kwargs = dict(num_drafts=torch.arange(n) % 6, bonus_probs=t[:, 0])
    state = torch.random.get_rng_state()
    runs = [rejection_sample(tokens, d, t, generator=torch.Generator().manual_seed(s), **kwargs) for s in (7, 7, 8)]
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(runs[0].token_ids, runs[1].token_ids) and torch.equal(runs[0].num_tokens, runs[1].num_tokens)
    assert torch.equal(runs[0].recovered, runs[1].recovered) and torch.equal(runs[0].bonus, runs[1].bonus)
    assert not torch.equal(runs[0].token_ids, runs[2].token_ids)


def _random_drafts(seed: int, n: int, length: int, vocab: int):
    """A seeded generator and, drawn from it in this order: draft and target distributions `(n, length, vocab)`,
    bonus distributions `(n, vocab)` and draft tokens `(n, length)`."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.rand(n, length, vocab, generator=g).softmax(-1)
    target = torch.rand(n, length, vocab, generator=g).softmax(-1)
    bonus_probs = torch.rand(n, vocab, generator=g).softmax(-1)
    return g, draft, target, bonus_probs, torch.randint(0, vocab, (n, length), generator=g)


def test_rng_consumption_order_matches_docstring():
    """uniforms = one rand(N, L); then one Exp(1) draw (N, V) for every row, whatever it rejects; a row's recovered
    or bonus token is the multinomial draw from those numbers."""
    n, length, vocab = 40, 3, 8
    g, draft, target, bonus_probs, tokens = _random_drafts(11, n, length, vocab)
    num_drafts = torch.randint(0, length + 1, (n,), generator=g)
    used = torch.Generator().manual_seed(5)
    res = rejection_sample(tokens, draft, target, num_drafts=num_drafts, bonus_probs=bonus_probs, generator=used)
    # the same computation by hand, one row at a time, from the same stream
    g = torch.Generator().manual_seed(5)
    uniforms = torch.rand(n, length, generator=g)
    first, rejected_rows = [], []
    for r in range(n):
        stop = int(num_drafts[r])
        for i in range(int(num_drafts[r])):
            y = int(tokens[r, i])
            accept = min(1.0, float(target[r, i, y] / draft[r, i, y]))
            if float(uniforms[r, i]) >= accept:
                stop = i
                rejected_rows.append(r)
                break
        first.append(stop)
    assert res.num_accepted.tolist() == first
    assert 0 < len(rejected_rows) < n
    dists = torch.stack([residual_distribution(target[r, first[r]], draft[r, first[r]]) if r in rejected_rows
                         else bonus_probs[r] for r in range(n)])
    expected_last = torch.multinomial(dists, 1, generator=g)[:, 0].tolist()       # one call, every row
    assert torch.equal(used.get_state(), g.get_state())                           # the generator is left the same
    for r in range(n):
        assert res.row(r).tolist() == tokens[r, : first[r]].tolist() + [expected_last[r]], r
        assert bool(res.recovered[r]) == (r in rejected_rows) and bool(res.bonus[r]) == (r not in rejected_rows)
        assert (res.token_ids[r, first[r] + 1:] == -1).all()
    # drawn beforehand (what a compiled step does), into larger buffers: the same result
    g.set_state(torch.Generator().manual_seed(5).get_state())
    buffers = (torch.zeros(n + 3, length), torch.zeros(n + 3, vocab))
    draws = draw_verification(num_drafts, length, vocab, g, device=torch.device("cpu"), dtype=torch.float32,
                              out=buffers)
    again = rejection_sample(tokens, draft, target, num_drafts=num_drafts, bonus_probs=bonus_probs, draws=draws)
    assert torch.equal(again.token_ids, res.token_ids) and torch.equal(again.recovered, res.recovered)
    assert torch.equal(g.get_state(), used.get_state())


def test_rejection_sample_with_draws_compiles_without_graph_break():
    """Given its draws, rejection sampling is a pure function of tensors (fullgraph) with the eager tokens."""
    n, length, vocab = 6, 4, 10
    _, draft, target, bonus_probs, tokens = _random_drafts(3, n, length, vocab)
    num_drafts = torch.tensor([0, 1, 4, 4, 2, 3])
    draws = draw_verification(num_drafts, length, vocab, torch.Generator().manual_seed(1),
                              device=torch.device("cpu"), dtype=torch.float32)

    def verify(*args):
        res = rejection_sample(*args[:3], num_drafts=args[3], bonus_probs=args[4], draws=(args[5], args[6]))
        return res.token_ids, res.num_tokens, res.recovered, res.bonus

    args = (tokens, draft, target, num_drafts, bonus_probs, *draws)
    compiled = torch.compile(verify, fullgraph=True, backend="eager")(*args)
    for a, b in zip(compiled, verify(*args)):
        assert torch.equal(a, b)
    eager = rejection_sample(tokens, draft, target, num_drafts=num_drafts, bonus_probs=bonus_probs,
                             generator=torch.Generator().manual_seed(1))
    assert torch.equal(compiled[0], eager.token_ids)


# -- deterministic cases -----------------------------------------------------------------------------------------
def test_extreme_logits_accept_and_reject_deterministically():
    vocab = 6
    draft = _one_hot([[1, 2]], vocab)                      # (1, 2, V)
    target = _one_hot([[1, 4]], vocab)
    tokens = torch.tensor([[1, 2]])
    res = rejection_sample(tokens, draft, target, generator=torch.Generator().manual_seed(0))
    assert res.num_accepted.tolist() == [1] and res.row(0).tolist() == [1, 4] and res.recovered.tolist() == [True]
    assert res.token_ids.tolist() == [[1, 4, -1]] and not res.bonus.any()
    res = rejection_sample(tokens, draft, draft.clone(), bonus_probs=target[:, 1],
                           generator=torch.Generator().manual_seed(0))
    assert res.num_accepted.tolist() == [2] and res.row(0).tolist() == [1, 2, 4] and res.bonus.tolist() == [True]
    assert not res.recovered.any()
    res = rejection_sample(tokens, draft, target, allow_resample=False, generator=torch.Generator().manual_seed(0))
    assert res.row(0).tolist() == [1, 2] and res.num_accepted.tolist() == [1] and not res.recovered.any()
    # no bonus, all accepted: only the drafts
    res = rejection_sample(tokens, draft, draft.clone(), generator=torch.Generator().manual_seed(0))
    assert res.row(0).tolist() == [1, 2] and not res.recovered.any() and not res.bonus.any()


def _truncated(x, n, k):
    return x[n:n + 1, :k]


def test_ragged_rejection_sample_rows_equal_single_rows():
    """Rows with different `num_drafts` in one call: per-row deterministic outcome, equal to one-row calls."""
    vocab = 7
    # row: (drafts, draft one-hot ids, target one-hot ids, num_drafts); position past num_drafts is junk that
    # would be rejected (target != draft) if it were looked at.
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6], [1, 1, 1], [2, 3, 4], [0, 6, 5]])
    target_ids = torch.tensor([[1, 2, 3], [4, 0, 0], [0, 0, 0], [2, 3, 5], [1, 1, 1]])
    num_drafts = torch.tensor([3, 1, 2, 2, 0])
    draft_probs, target_probs = _one_hot(drafts, vocab), _one_hot(target_ids, vocab)
    bonus_ids = torch.tensor([6, 3, 2, 1, 5])
    bonus_probs = _one_hot(bonus_ids, vocab)
    expected = {
        True: ([3, 1, 0, 2, 0], [[1, 2, 3, 6], [4, 3], [0], [2, 3, 1], [5]],
               [False, False, True, False, False], [True, True, False, True, True]),
        False: ([3, 1, 0, 2, 0], [[1, 2, 3], [4], [0], [2, 3], []],
                [False, False, True, False, False], [False, False, False, False, False]),
    }
    for with_bonus in (True, False):
        kwargs = dict(bonus_probs=bonus_probs) if with_bonus else {}
        res = rejection_sample(drafts, draft_probs, target_probs, num_drafts=num_drafts,
                               generator=torch.Generator().manual_seed(0), **kwargs)
        accepted, rows, recovered, bonus = expected[with_bonus]
        assert res.num_accepted.tolist() == accepted
        assert [res.row(n).tolist() for n in range(5)] == rows
        assert res.recovered.tolist() == recovered and res.bonus.tolist() == bonus
        assert res.num_tokens.tolist() == [len(r) for r in rows]
        for n in range(5):
            assert (res.token_ids[n, int(res.num_tokens[n]):] == -1).all()
            k = int(num_drafts[n])
            if k == 0:
                continue
            single = rejection_sample(_truncated(drafts, n, k), _truncated(draft_probs, n, k),
                                      _truncated(target_probs, n, k), generator=torch.Generator().manual_seed(9),
                                      **({"bonus_probs": bonus_probs[n:n + 1]} if with_bonus else {}))
            assert single.row(0).tolist() == res.row(n).tolist()
            assert single.num_accepted.item() == res.num_accepted[n].item()
            assert single.recovered.item() == res.recovered[n].item() and single.bonus.item() == res.bonus[n].item()
    # allow_resample=False commits the rejected draft itself, per row
    res = rejection_sample(drafts, draft_probs, target_probs, num_drafts=num_drafts, allow_resample=False,
                           generator=torch.Generator().manual_seed(0))
    assert [res.row(n).tolist() for n in range(5)] == [[1, 2, 3], [4], [1], [2, 3], []]
    assert not res.recovered.any()


def test_greedy_match():
    target = torch.tensor([[[0.1, 0.9, 0.0], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]])
    res = greedy_match(torch.tensor([[1, 1, 2]]), target)
    assert res.num_accepted.tolist() == [1] and res.row(0).tolist() == [1, 0] and res.recovered.tolist() == [True]
    assert res.token_ids.tolist() == [[1, 0, -1, -1]] and not res.bonus.any()
    res = greedy_match(torch.tensor([[1, 0, 2]]), target, bonus_probs=torch.tensor([[0.0, 0.2, 0.8]]))
    assert res.num_accepted.tolist() == [3] and res.row(0).tolist() == [1, 0, 2, 2] and res.bonus.tolist() == [True]
    assert not res.recovered.any()
    res = greedy_match(torch.tensor([[1, 0, 2]]), target)
    assert res.row(0).tolist() == [1, 0, 2] and not res.recovered.any() and not res.bonus.any()


def test_greedy_match_ragged_rows_equal_single_rows():
    g = torch.Generator().manual_seed(2)
    n, length, vocab = 16, 4, 5
    target = torch.rand(n, length, vocab, generator=g)
    argmax = target.argmax(-1)
    # drafts: the target argmax up to a per-row mismatch point (possibly past the row's span)
    mismatch_at = torch.randint(0, length + 1, (n,), generator=g)
    drafts = torch.where(torch.arange(length)[None] < mismatch_at[:, None], argmax, (argmax + 1) % vocab)
    num_drafts = torch.randint(0, length + 1, (n,), generator=g)
    num_drafts[:3] = torch.tensor([0, 2, length])
    mismatch_at[1] = 3                                      # junk mismatch past the span of row 1 is ignored
    drafts[1] = torch.where(torch.arange(length) < 3, argmax[1], (argmax[1] + 1) % vocab)
    bonus_probs = torch.rand(n, vocab, generator=g)
    for kwargs in ({}, {"bonus_probs": bonus_probs}):
        res = greedy_match(drafts, target, num_drafts=num_drafts, **kwargs)
        assert res.token_ids.shape == (n, length + 1)
        for r in range(n):
            k, m = int(num_drafts[r]), int(mismatch_at[r])
            accepted = min(k, m)
            assert res.num_accepted[r].item() == accepted
            if k == 0:
                want = [int(bonus_probs[r].argmax())] if kwargs else []
            else:
                single = greedy_match(drafts[r:r + 1, :k], target[r:r + 1, :k],
                                      **({"bonus_probs": bonus_probs[r:r + 1]} if kwargs else {}))
                assert single.num_accepted.item() == accepted
                assert single.recovered.item() == res.recovered[r].item()
                assert single.bonus.item() == res.bonus[r].item()
                want = single.row(0).tolist()
            tail = [int(argmax[r, m])] if m < k else ([int(bonus_probs[r].argmax())] if kwargs else [])
            assert want == drafts[r, :accepted].tolist() + tail
            assert res.row(r).tolist() == want, r
            assert (res.token_ids[r, len(want):] == -1).all()
            assert res.recovered[r].item() == (m < k)
            assert res.bonus[r].item() == (bool(kwargs) and m >= k)
        assert res.recovered.any() and (~res.recovered).any()


def test_inputs_not_modified_in_place():
    draft, target = CASES["random"]
    d, t = draft.float().expand(2, 3, -1).clone(), target.float().expand(2, 3, -1).clone()
    tokens, bonus, num = torch.tensor([[0, 1, 2], [3, 4, 5]]), t[:, 0].clone(), torch.tensor([3, 1])
    d0, t0, tokens0, bonus0, num0 = d.clone(), t.clone(), tokens.clone(), bonus.clone(), num.clone()
    rejection_sample(tokens, d, t, num_drafts=num, bonus_probs=bonus, generator=torch.Generator().manual_seed(1))
    greedy_match(tokens, t, num_drafts=num, bonus_probs=bonus)
    assert torch.equal(d, d0) and torch.equal(t, t0) and torch.equal(tokens, tokens0)
    assert torch.equal(bonus, bonus0) and torch.equal(num, num0)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shapes disagree"):
        rejection_sample(torch.tensor([[0, 1]]), torch.rand(1, 3, 4), torch.rand(1, 3, 4))
    with pytest.raises(ValueError, match="shapes disagree"):
        rejection_sample(torch.tensor([0, 1, 2]), torch.rand(3, 4), torch.rand(3, 4))      # old unbatched form
    with pytest.raises(ValueError, match="shapes disagree"):
        rejection_sample(torch.tensor([[0, 1, 2]]), torch.rand(1, 3, 4), torch.rand(1, 3, 5))
