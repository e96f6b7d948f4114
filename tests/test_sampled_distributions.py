"""Sampled decoding against exact distributions: the processed distribution of the sampler equals transformers'
own; S2D2's stochastic acceptance (Algorithm 3) and SimSD's exact setting reproduce the verifier's distribution
end to end, on the first two tokens jointly (the second one is drafted and verified after the first).

A tiny random SDAR model of 12 tokens (mask 11) keeps every joint distribution of two tokens small (144 cells), so
a chi-square on a few thousand samples has power against the errors it names (negative controls included).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY
from scipy.stats import chisquare
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hf_dllm_spec.maths.masks import block_causal_mask, causal_mask, to_additive
from hf_dllm_spec.maths.sampling import Sampler
from hf_dllm_spec.strategies import s2d2
from model_patches.sdar import SDARConfig, SDARForCausalLM

VOCAB, MASK = 12, 11
PROMPT = torch.tensor([[3, 5, 2, 7]])              # one whole block: the first new token opens a block
ROWS = 4_000
WARPERS = dict(temperature=0.7, top_k=6, top_p=0.9)


def _warpers() -> LogitsProcessorList:
    """The warpers transformers' `generate` builds for :data:`WARPERS`, in its order."""
    return LogitsProcessorList([TemperatureLogitsWarper(WARPERS["temperature"]), TopKLogitsWarper(WARPERS["top_k"]),
                                TopPLogitsWarper(WARPERS["top_p"])])


def test_the_sampler_applies_transformers_warpers_in_their_order():
    """Temperature, top-k then top-p, as transformers applies them (top-p before the temperature keeps another
    set of tokens: the reversed order is checked to differ on these logits, so the test can fail)."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 3
    expected = torch.softmax(_warpers()(None, logits.clone()), dim=-1)
    got = Sampler(_warpers(), do_sample=True, suppress_token_ids=[]).probs(logits)
    assert torch.allclose(got, expected, atol=1e-6)
    reversed_order = LogitsProcessorList(list(_warpers())[::-1])
    assert not torch.allclose(torch.softmax(reversed_order(None, logits.clone()), dim=-1), expected, atol=1e-3)


def _small(seed: int) -> SDARForCausalLM:
    torch.manual_seed(seed)
    config = dict(TINY, vocab_size=VOCAB, initializer_range=0.08)
    return SDARForCausalLM(SDARConfig(block_size=4, mask_token_id=MASK, **config)).eval()


@pytest.fixture(scope="module")
def small_sdar():
    return _small(21)


def _next(model, prefix: list[int], block_size: int) -> torch.Tensor:
    """The model's distribution of the token after `PROMPT + prefix`, read at a mask token: under a token-causal mask
    (`block_size=1`, S2D2's AR mode) or the rest of its block masked under the block-causal mask (the target's own
    sequential block diffusion); processed by :data:`WARPERS`, the mask token suppressed; `(V,)` float64."""
    known = torch.cat([PROMPT[0], torch.tensor(prefix, dtype=torch.long)])
    end = known.shape[0] + 1 if block_size == 1 else (known.shape[0] // block_size + 1) * block_size
    ids = torch.cat([known, torch.full((end - known.shape[0],), MASK)])
    positions = torch.arange(end)
    mask = causal_mask(end) if block_size == 1 else block_causal_mask(positions, block_size)
    with torch.no_grad():
        logits = model(input_ids=ids[None], position_ids=positions[None],
                       attention_mask=to_additive(mask[None], torch.float32)).logits[0, known.shape[0]]
    logits[MASK] = float("-inf")
    return torch.softmax(_warpers()(None, logits[None].clone())[0].double(), dim=-1)


def _joint(model, block_size: int) -> torch.Tensor:
    """p(x1, x2) of the first two new tokens, `(V * V,)` as `x1 * V + x2` (:func:`_next`)."""
    first = _next(model, [], block_size)
    return torch.cat([first[x] * _next(model, [x], block_size) for x in range(VOCAB)])


def _pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of `counts` against `probs`; cells expected below 5 pooled into one; 0 for a count where
    `probs` is 0 (outside the support)."""
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    expected = probs * counts.sum()
    keep = expected >= 5
    observed, wanted = counts[keep], expected[keep]
    if float(expected[~keep].sum()) > 0:
        observed = torch.cat([observed, counts[~keep].sum()[None]])
        wanted = torch.cat([wanted, expected[~keep].sum()[None]])
    return chisquare(observed.numpy(), (wanted * observed.sum() / wanted.sum()).numpy()).pvalue


def _pair_counts(model, seed: int = 0, **strategy) -> torch.Tensor:
    """Counts of the first two new tokens over `ROWS` sampled rows (`x1 * V + x2`), `(V * V,)` float64."""
    ids = PROMPT.expand(ROWS, -1)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, **WARPERS, max_new_tokens=2,
                         eos_token_id=None, pad_token_id=0, generator=torch.Generator().manual_seed(seed), **strategy)
    pairs = out[:, PROMPT.shape[1]:]
    return torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB).double()


#: S2D2 with every draft verified and rejection sampling.
S2D2_VERIFIED = dict(decoding_strategy="s2d2", block_size=4, s2d2_acceptance="stochastic", min_ssd_span_length=1,
                     cache_ver=True, draft_ver=True)


def test_s2d2_stochastic_acceptance_samples_the_verifier_distribution(small_sdar, monkeypatch):
    """S2D2 with every draft verified (`min_ssd_span_length=1`, `cache_ver`, `draft_ver`) and rejection sampling:
    the first two tokens follow the verifier's AR-mode distribution under the call's warpers, jointly (S2D2 Alg. 3).
    Negative control: the draft and verifier distributions swapped in the acceptance test fails it."""
    joint = _joint(small_sdar, 1)
    assert _pvalue(_pair_counts(small_sdar, **S2D2_VERIFIED), joint) > 1e-3
    real = s2d2.rejection_sample
    monkeypatch.setattr(s2d2, "rejection_sample", lambda tokens, draft, target, **kw: real(tokens, target, draft, **kw))
    assert _pvalue(_pair_counts(small_sdar, **S2D2_VERIFIED), joint) < 1e-6


def test_simsd_exact_samples_the_targets_own_block_diffusion(small_sdar, monkeypatch):
    """SimSD's exact setting (`preset="simsd-exact"`: left-to-right reveals, the stacked layout) with another small
    model drafting: the first two tokens follow the target's own sequential block diffusion under the warpers,
    jointly (the second token is drafted after the first and verified at its own position). Negative control: the
    target's distribution instead of the residual after a rejection fails it."""
    kwargs = dict(decoding_strategy="simsd", preset="simsd-exact", draft_model=_small(22))
    joint = _joint(small_sdar, 4)
    assert _pvalue(_pair_counts(small_sdar, **kwargs), joint) > 1e-3
    monkeypatch.setattr("hf_dllm_spec.maths.verification.residual_distribution", lambda t, d: t)
    assert _pvalue(_pair_counts(small_sdar, **kwargs), joint) < 1e-6
