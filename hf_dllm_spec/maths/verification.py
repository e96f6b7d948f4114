"""Speculative acceptance: pure tensor maths, no model and no config.

Notation (variable -> paper symbol):
    target_probs -> q (S2D2 Alg. 3), p_AR (DEER Eq. 5-6), p_theta (SimSD Eq. 2)
    draft_probs  -> p (S2D2 Alg. 3), q_theta (DEER Eq. 5-6), p_phi (SimSD Eq. 2)

Vocabulary (vLLM `RejectionSampler`): an *accepted* token is a draft that passed; a *recovered* token is drawn
from the residual distribution after the first rejection; a *bonus* token is drawn from the target after the
last draft when every draft passed.

Every function takes batch-leading tensors: `N` rows of `L` drafts over a vocabulary of `V`; rows may have
fewer drafts than `L` (`num_drafts`).

RNG consumption order of :func:`rejection_sample` (a change to it is a behaviour change), made by
:func:`~hf_dllm_spec.maths.sampling.draw_verification` before any decision, so that the amount drawn does not
depend on which rows reject (a compiled step draws the same numbers beforehand, fixed-shape buffers, no random
state inside): one `torch.rand(N, L)` call for the uniforms; then, unless `allow_resample=False` without
`bonus_probs`, one `Exp(1)` draw `(N, V)` for every row, in one call: row i's recovered or bonus token is
`argmax(dist / noise[i])`, what `torch.multinomial(dist, 1)` draws from the same numbers
(:func:`~hf_dllm_spec.maths.sampling.categorical_from_noise`); a row that needs neither leaves its noise unused.
With one generator per row (:class:`~hf_dllm_spec.maths.sampling.RowGenerators`), row i draws from generator i:
its `num_drafts[i]` uniforms, then its `V` exponentials (what it draws verified alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import Generators, categorical_from_noise, draw_verification

#: The `acceptance` rules of the strategies with a separate drafter (DEER, SimSD).
ACCEPTANCE_RULES = ("rejection_sampling", "greedy_match")

#: Lower clamp on the draft probability of the drafted token (S2D2 reference code).
MIN_DRAFT_PROB = 1e-12


@dataclass
class VerificationResult:
    """What a verification commits, per row of a batch.

    Attributes:
        num_accepted (`torch.Tensor` of shape `(N,)`, int64): leading drafts that passed, in tokens.
        token_ids (`torch.Tensor` of shape `(N, L + 1)`, int64): the committed tokens of each row, left-aligned:
            the accepted drafts, then the recovered or bonus token when there is one; -1 after them.
        num_tokens (`torch.Tensor` of shape `(N,)`, int64): committed tokens per row (``num_accepted`` plus one
            when a recovered, bonus or (``allow_resample=False``) rejected draft token follows).
        recovered (`torch.Tensor` of shape `(N,)`, bool): the last committed token was drawn from the residual (or
            is the target argmax) after a rejection.
        bonus (`torch.Tensor` of shape `(N,)`, bool): the last committed token was drawn from `bonus_probs` after
            full acceptance.
    """

    num_accepted: torch.Tensor
    token_ids: torch.Tensor
    num_tokens: torch.Tensor
    recovered: torch.Tensor
    bonus: torch.Tensor

    def row(self, n: int) -> torch.Tensor:
        """Committed tokens of row `n`, `(num_tokens[n],)` int64."""
        return self.token_ids[n, : int(self.num_tokens[n])]


def acceptance_probability(
    target_probs_of_draft: torch.Tensor, draft_probs_of_draft: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """Per-position acceptance probability min(1, (t(y) / d(y))^gamma).

    Args:
        target_probs_of_draft (`torch.Tensor` of any shape, e.g. `(N, L)`): target probability of each drafted
            token, q_i.
        draft_probs_of_draft (`torch.Tensor` of the same shape): draft probability of each drafted token, p_i;
            clamped below at 1e-12.
        gamma (`float`, defaults to 1.0): ratio tempering exponent (S2D2 App. A.8, `ssd_ratio_tempering_factor`).
            gamma = 1 is the lossless test of Leviathan et al.; other values trade acceptance for fidelity.

    Returns:
        `torch.Tensor` of the input shape with values in [0, 1]. Source: S2D2 Algorithm 3 line 16.
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
        DEER Eq. 6, Leviathan et al. 2023 / Chen et al. 2023.
    """
    residual = (target_probs - draft_probs).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(residual.dtype).tiny), target_probs)


def output_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Exact distribution of the committed token at one position: draft, accept test, residual on reject.

    P(x) = d(x) a(x) + (1 - sum_y d(y) a(y)) r(x) with a = min(1, (t/d)^gamma) and r the residual. For gamma = 1
    this equals `target_probs` (the losslessness identity tested in float64).

    Args:
        target_probs, draft_probs (`torch.Tensor` of shape `(..., V)`).
        gamma (`float`): as in :func:`acceptance_probability`.

    Returns:
        `torch.Tensor` of shape `(..., V)`.
    """
    accept = acceptance_probability(target_probs, draft_probs, gamma)
    accept = torch.where(draft_probs > 0, accept, torch.zeros_like(accept))
    accepted_mass = draft_probs * accept
    rejected_mass = 1.0 - accepted_mass.sum(dim=-1, keepdim=True)
    return accepted_mass + rejected_mass * residual_distribution(target_probs, draft_probs)


def _draft_lengths(draft_token_ids: torch.Tensor, num_drafts: torch.Tensor | None) -> torch.Tensor:
    n, length = draft_token_ids.shape
    if num_drafts is None:
        return torch.full((n,), length, dtype=torch.long, device=draft_token_ids.device)
    return num_drafts.to(device=draft_token_ids.device, dtype=torch.long)


def _first(flags: torch.Tensor, default: torch.Tensor) -> torch.Tensor:
    """Index of the first True per row of `flags` `(N, L)`, else `default` `(N,)` (also for L = 0)."""
    if flags.shape[1] == 0:
        return default.clone()
    return torch.where(flags.any(dim=-1), flags.float().argmax(dim=-1), default)


def _commit(draft_token_ids: torch.Tensor, first: torch.Tensor, last_token: torch.Tensor,
            has_last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `[drafts[:first] | last_token if has_last]`, padded with -1: `(N, L + 1)` and lengths `(N,)`."""
    n, length = draft_token_ids.shape
    idx = torch.arange(length + 1, device=draft_token_ids.device)[None]
    padded = torch.cat([draft_token_ids, draft_token_ids.new_full((n, 1), -1)], dim=1)
    out = torch.where(idx < first[:, None], padded, torch.full_like(padded, -1))
    out = torch.where((idx == first[:, None]) & has_last[:, None], last_token[:, None], out)
    return out, first + has_last.long()


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    num_drafts: torch.Tensor | None = None,
    bonus_probs: torch.Tensor | None = None,
    gamma: float = 1.0,
    allow_resample: bool = True,
    generator: Generators = None,
    draws: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> VerificationResult:
    """Speculative rejection sampling over a batch of drafts, left to right, stopping at the first rejection.

    Args:
        draft_token_ids (`torch.Tensor` of shape `(N, L)`, int64): drafted tokens y_i per row (any value past a
            row's `num_drafts`).
        draft_probs (`torch.Tensor` of shape `(N, L, V)`, float32): draft distribution at each position after the
            same processing as the target, p in S2D2 Algorithm 3.
        target_probs (`torch.Tensor` of shape `(N, L, V)`, float32): verifier distribution at each position
            given the drafts to its left, q in S2D2 Algorithm 3.
        num_drafts (`torch.Tensor` of shape `(N,)`, int64, *optional*): drafts per row (ragged spans); `L` when
            omitted.
        bonus_probs (`torch.Tensor` of shape `(N, V)`, *optional*): target distribution after the last draft;
            when given, rows whose drafts all pass draw one bonus token from it (AR targets; S2D2 has none).
        gamma (`float`, defaults to 1.0): ratio tempering exponent.
        allow_resample (`bool`, defaults to True): on rejection draw the recovered token from the residual;
            if False, commit the rejected draft token itself (SDAR reference, `allow_resample=False`).
        generator (`torch.Generator` or `RowGenerators`, *optional*): source of the uniforms and of the residual /
            bonus draws; per-row generators: one per row of `draft_token_ids` (module docstring: the order).
        draws (`tuple`, *optional*): the random numbers, drawn beforehand by
            :func:`~hf_dllm_spec.maths.sampling.draw_verification` (`generator` is then not used): uniforms
            `(R, L)` and `Exp(1)` noise `(R, V)` (None when `allow_resample=False` without `bonus_probs`), `R >= N`
            (rows past `N` are padding). Given, the function is a pure function of tensors, with no host read (what
            a compiled step runs).

    Returns:
        `VerificationResult`. Lossless (committed tokens follow the target) when the drafts were sampled from
        `draft_probs`, gamma = 1 and `allow_resample` (Leviathan et al. 2023; DEER App. E Lemma E.1).

    Raises:
        ValueError: if the shapes disagree.
    """
    if draft_token_ids.dim() != 2 or draft_probs.shape[:2] != draft_token_ids.shape or (
            target_probs.shape != draft_probs.shape):
        raise ValueError(
            f"rejection_sample: shapes disagree: draft_token_ids {tuple(draft_token_ids.shape)}, "
            f"draft_probs {tuple(draft_probs.shape)}, target_probs {tuple(target_probs.shape)}; "
            "expected (N, L), (N, L, V), (N, L, V)."
        )
    n, length = draft_token_ids.shape
    lengths = _draft_lengths(draft_token_ids, num_drafts)
    ids = draft_token_ids.clamp(min=0)[..., None]
    accept_prob = acceptance_probability(target_probs.gather(-1, ids)[..., 0], draft_probs.gather(-1, ids)[..., 0],
                                         gamma)                                              # (N, L)
    if draws is None:
        draws = draw_verification(lengths, length, target_probs.shape[-1], generator, device=accept_prob.device,
                                  dtype=accept_prob.dtype, noise=allow_resample or bonus_probs is not None)
    uniforms, noise = draws[0][:n], None if draws[1] is None else draws[1][:n]
    in_span = torch.arange(length, device=lengths.device)[None] < lengths[:, None]
    rejected = (uniforms >= accept_prob) & in_span
    any_rejected = rejected.any(dim=-1)
    first = _first(rejected, lengths)                                                         # (N,)
    last = torch.full_like(first, -1)
    at_first = first.clamp(max=max(length - 1, 0))[:, None]
    if not allow_resample and length:
        last = torch.where(any_rejected, draft_token_ids.gather(-1, at_first)[:, 0], last)
    elif length:
        index = at_first[..., None].expand(-1, 1, target_probs.shape[-1])
        residual = residual_distribution(target_probs.gather(1, index)[:, 0], draft_probs.gather(1, index)[:, 0])
        last = torch.where(any_rejected, categorical_from_noise(residual, noise), last)
    recovered = any_rejected if allow_resample else torch.zeros_like(any_rejected)
    bonus = torch.zeros_like(any_rejected)
    if bonus_probs is not None:
        bonus = ~any_rejected
        last = torch.where(bonus, categorical_from_noise(bonus_probs, noise), last)
    token_ids, num_tokens = _commit(draft_token_ids, first, last, last >= 0)
    return VerificationResult(first, token_ids, num_tokens, recovered, bonus)


def greedy_match(
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    num_drafts: torch.Tensor | None = None,
    bonus_probs: torch.Tensor | None = None,
) -> VerificationResult:
    """Deterministic verification: accept while the draft equals the target argmax.

    At the first mismatch the target argmax is committed (recovered) and the scan stops; if every draft
    matches and `bonus_probs` is given, its argmax is the bonus token. With an exact target this reproduces
    greedy target decoding token for token. Not in the S2D2 paper (whose reference draws uniforms even at
    temperature 0 and resamples from the residual): a documented deviation.

    Args:
        draft_token_ids (`torch.Tensor` of shape `(N, L)`, int64).
        target_probs (`torch.Tensor` of shape `(N, L, V)`): or target logits; only the argmax is used.
        num_drafts (`torch.Tensor` of shape `(N,)`, *optional*): drafts per row; `L` when omitted.
        bonus_probs (`torch.Tensor` of shape `(N, V)`, *optional*).

    Returns:
        `VerificationResult`.
    """
    n, length = draft_token_ids.shape
    lengths = _draft_lengths(draft_token_ids, num_drafts)
    target_ids = target_probs.argmax(dim=-1)                                                 # (N, L)
    in_span = torch.arange(length, device=lengths.device)[None] < lengths[:, None]
    mismatch = (target_ids != draft_token_ids) & in_span
    any_mismatch = mismatch.any(dim=-1)
    first = _first(mismatch, lengths)
    last = torch.full_like(first, -1)
    if length:
        last = torch.where(any_mismatch, target_ids.gather(-1, first.clamp(max=length - 1)[:, None])[:, 0], last)
    bonus = torch.zeros_like(any_mismatch)
    if bonus_probs is not None:
        last = torch.where(any_mismatch, last, bonus_probs.argmax(dim=-1))
        bonus = ~any_mismatch
    token_ids, num_tokens = _commit(draft_token_ids, first, last, last >= 0)
    return VerificationResult(first, token_ids, num_tokens, any_mismatch, bonus)


def span_writes(result: VerificationResult, span_start: torch.Tensor,
                block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a verification's committed tokens go in a block: each row's tokens at block positions
    `span_start .. span_start + num_tokens - 1` (S2D2 Algorithm 3: the accepted prefix of C_t, then the recovered
    token).

    Args:
        result (`VerificationResult`): of `M` rows (`token_ids` `(M, L + 1)`, `num_tokens` `(M,)`).
        span_start (`torch.Tensor` of shape `(M,)`, int64): the first block position of each row's span.
        block_size (`int`): B, in tokens.

    Returns:
        `(write, token_ids)`, each `(M, B)`: the positions written (bool) and the token each written position gets
        (int64; meaningless where `write` is False).
    """
    relative = torch.arange(block_size, device=span_start.device)[None] - span_start[:, None]      # (M, B)
    write = (relative >= 0) & (relative < result.num_tokens[:, None])
    return write, result.token_ids.gather(1, relative.clamp(0, result.token_ids.shape[1] - 1))

