"""Speculative acceptance: pure tensor maths, no model and no config.

Notation (variable -> paper symbol):
    target_probs -> q (S2D2 Alg. 3), p_AR (DEER Eq. 5-6), p_theta (SimSD Eq. 2)
    draft_probs  -> p (S2D2 Alg. 3), q_theta (DEER Eq. 5-6), p_phi (SimSD Eq. 2)

Vocabulary (vLLM `RejectionSampler`): an *accepted* token is a draft that passed; a *recovered* token is drawn
from the residual distribution after the first rejection; a *bonus* token is drawn from the target after the
last draft when every draft passed.

RNG consumption order of :func:`rejection_sample` (a change to it is a behaviour change): one `torch.rand(L)`
call for the `L` uniforms, then, only after a rejection, one `torch.multinomial` draw from the residual; or,
only when every draft passed and `bonus_probs` is given, one draw from `bonus_probs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Lower clamp on the draft probability of the drafted token (S2D2 reference code).
MIN_DRAFT_PROB = 1e-12


@dataclass
class VerificationResult:
    """What a verification commits.

    Attributes:
        num_accepted (`int`): number of leading drafts that passed, in tokens.
        token_ids (`torch.Tensor` of shape `(num_accepted + extra,)`, int64): the committed tokens: the accepted
            drafts, then the recovered or bonus token when there is one.
        recovered (`bool`): the last committed token was drawn from the residual after a rejection.
        bonus (`bool`): the last committed token was drawn from `bonus_probs` after full acceptance.
    """

    num_accepted: int
    token_ids: torch.Tensor
    recovered: bool = False
    bonus: bool = False


def acceptance_probability(
    target_probs_of_draft: torch.Tensor, draft_probs_of_draft: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """Per-position acceptance probability min(1, (t(y) / d(y))^gamma).

    Args:
        target_probs_of_draft (`torch.Tensor` of shape `(L,)`): target probability of each drafted token, q_i.
        draft_probs_of_draft (`torch.Tensor` of shape `(L,)`): draft probability of each drafted token, p_i;
            clamped below at 1e-12.
        gamma (`float`, defaults to 1.0): ratio tempering exponent (S2D2 App. A.8, `ssd_ratio_tempering_factor`).
            gamma = 1 is the lossless test of Leviathan et al.; other values trade acceptance for fidelity.

    Returns:
        `torch.Tensor` of shape `(L,)` with values in [0, 1]. Source: S2D2 Algorithm 3 line 16.
    """
    ratio = target_probs_of_draft / draft_probs_of_draft.clamp_min(MIN_DRAFT_PROB)
    if gamma != 1.0:
        ratio = ratio.pow(gamma)
    return ratio.clamp(max=1.0)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Normalised max(0, target - draft), the distribution of the recovered token after a rejection.

    If the residual has zero mass (target equals draft, or float round-off), the target distribution is
    returned instead: a rejection then has probability zero, and dividing by the zero sum would give NaN.

    Args:
        target_probs (`torch.Tensor` of shape `(..., V)`): target distribution t.
        draft_probs (`torch.Tensor` of shape `(..., V)`): draft distribution d.

    Returns:
        `torch.Tensor` of shape `(..., V)` summing to 1 over the last axis. Source: S2D2 Algorithm 3 line 19,
        DEER Eq. 6, strategies.md §1.
    """
    residual = (target_probs - draft_probs).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(residual.dtype).tiny), target_probs)


def output_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Exact distribution of the committed token at one position: draft, accept test, residual on reject.

    P(x) = d(x) a(x) + (1 - sum_y d(y) a(y)) r(x) with a = min(1, (t/d)^gamma) and r the residual. For gamma = 1
    this equals `target_probs` (the losslessness identity tested in float64).

    Args:
        target_probs, draft_probs (`torch.Tensor` of shape `(V,)`).
        gamma (`float`): as in :func:`acceptance_probability`.

    Returns:
        `torch.Tensor` of shape `(V,)`.
    """
    accept = acceptance_probability(target_probs, draft_probs, gamma)
    accept = torch.where(draft_probs > 0, accept, torch.zeros_like(accept))
    accepted_mass = draft_probs * accept
    return accepted_mass + (1.0 - accepted_mass.sum()) * residual_distribution(target_probs, draft_probs)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    bonus_probs: torch.Tensor | None = None,
    gamma: float = 1.0,
    allow_resample: bool = True,
    generator: torch.Generator | None = None,
) -> VerificationResult:
    """Speculative rejection sampling over `L` drafts, left to right, stopping at the first rejection.

    Args:
        draft_token_ids (`torch.Tensor` of shape `(L,)`, int64): drafted tokens, y_i.
        draft_probs (`torch.Tensor` of shape `(L, V)`, float32): draft distribution at each position after the
            same processing as the target, p in S2D2 Algorithm 3.
        target_probs (`torch.Tensor` of shape `(L, V)`, float32): verifier distribution at each position
            given the drafts to its left, q in S2D2 Algorithm 3.
        bonus_probs (`torch.Tensor` of shape `(V,)`, *optional*): target distribution after the last draft;
            when given and every draft passes, one bonus token is drawn from it (AR targets; S2D2 has none).
        gamma (`float`, defaults to 1.0): ratio tempering exponent.
        allow_resample (`bool`, defaults to True): on rejection draw the recovered token from the residual;
            if False, commit the rejected draft token itself (SDAR reference, `allow_resample=False`).
        generator (`torch.Generator`, *optional*): source of the uniforms and of the residual draw.

    Returns:
        `VerificationResult`. Lossless (committed tokens follow the target) when the drafts were sampled from
        `draft_probs`, gamma = 1 and `allow_resample` (strategies.md §1).

    Raises:
        ValueError: if the shapes disagree.
    """
    num_drafts = draft_token_ids.shape[0]
    if draft_probs.shape[0] != num_drafts or target_probs.shape != draft_probs.shape:
        raise ValueError(
            f"rejection_sample: shapes disagree: draft_token_ids {tuple(draft_token_ids.shape)}, "
            f"draft_probs {tuple(draft_probs.shape)}, target_probs {tuple(target_probs.shape)}; "
            "expected (L,), (L, V), (L, V)."
        )
    rows = torch.arange(num_drafts, device=draft_token_ids.device)
    accept_prob = acceptance_probability(
        target_probs[rows, draft_token_ids], draft_probs[rows, draft_token_ids], gamma
    )
    uniforms = torch.rand(num_drafts, generator=generator, device=accept_prob.device, dtype=accept_prob.dtype)
    rejected = (uniforms >= accept_prob).nonzero()
    if rejected.numel() == 0:
        if bonus_probs is None:
            return VerificationResult(num_drafts, draft_token_ids.clone())
        bonus = torch.multinomial(bonus_probs, 1, generator=generator)
        return VerificationResult(num_drafts, torch.cat([draft_token_ids, bonus]), bonus=True)
    first = int(rejected[0, 0])
    if not allow_resample:
        return VerificationResult(first, draft_token_ids[: first + 1].clone())
    residual = residual_distribution(target_probs[first], draft_probs[first])
    recovered = torch.multinomial(residual, 1, generator=generator)
    return VerificationResult(first, torch.cat([draft_token_ids[:first], recovered]), recovered=True)


def greedy_match(
    draft_token_ids: torch.Tensor, target_probs: torch.Tensor, *, bonus_probs: torch.Tensor | None = None
) -> VerificationResult:
    """Deterministic verification: accept while the draft equals the target argmax.

    At the first mismatch the target argmax is committed (recovered) and the scan stops; if every draft
    matches and `bonus_probs` is given, its argmax is the bonus token. With an exact target this reproduces
    greedy target decoding token for token. Not in the S2D2 paper (whose reference draws uniforms even at
    temperature 0): a documented deviation, strategies.md §5.4.

    Args:
        draft_token_ids (`torch.Tensor` of shape `(L,)`, int64).
        target_probs (`torch.Tensor` of shape `(L, V)`): or target logits; only the argmax is used.
        bonus_probs (`torch.Tensor` of shape `(V,)`, *optional*).

    Returns:
        `VerificationResult`.
    """
    target_ids = target_probs.argmax(dim=-1)
    mismatch = (target_ids != draft_token_ids).nonzero()
    if mismatch.numel() == 0:
        if bonus_probs is None:
            return VerificationResult(draft_token_ids.shape[0], draft_token_ids.clone())
        bonus = bonus_probs.argmax().reshape(1)
        return VerificationResult(draft_token_ids.shape[0], torch.cat([draft_token_ids, bonus]), bonus=True)
    first = int(mismatch[0, 0])
    return VerificationResult(first, target_ids[: first + 1].clone(), recovered=True)
