"""S2D2 verification routing: acceptance estimators, verify score and policies (S2D2 §4.3, Alg. 4, App. A.5-A.6).

Estimators map the **draft** distribution over the first contiguous masked span to per-position acceptance
proxies alpha_i in [0, 1]; Eq. 5 turns them into the expected accepted prefix length
K_hat = sum_k prod_{i<=k} alpha_i; Eq. 6 into a score s = K_hat - c (static) or s = K_hat - c * N_hi (dynamic).
Policies decide from these whether the verifier forward is worth its cost.

Comparisons follow the paper (`>=` for the margin estimator, §4.3, and for turning hysteresis on, Algorithm 4;
the S2D2 reference implementation uses `>`); they differ only at equality.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .sampling import entropy, top2_margin

ESTIMATORS = (
    "hard_margin_threshold",
    "soft_entropy_negexp",
    "soft_renyi_2_entropy",
    "hard_entropy_threshold",
    "soft_confidence_power",
    "soft_clipped_linear_margin",
)
SCORE_TYPES = ("difference_dynamic", "difference_static")
POLICIES = ("mask_span_length", "score_threshold", "score_hysteresis", "contextual_bandit_ucb")
UCB_ENTROPY_SOURCES = ("span", "masked")


def acceptance_estimates(
    estimator: str,
    draft_probs: torch.Tensor,
    confidence: torch.Tensor,
    *,
    margin_threshold: float = 0.05,
    entropy_temperature: float = 1.0,
    entropy_threshold: float = 0.5,
    confidence_power: float = 1.0,
    margin_coef: float = 1.0,
) -> torch.Tensor:
    """Per-position acceptance proxies alpha_i over a span (S2D2 Eq. 5 inputs, App. A.5).

    Args:
        estimator (`str`): one of :data:`ESTIMATORS`:
            ``hard_margin_threshold`` 1[m_i >= margin_threshold] (m_i = top-1 minus top-2 probability);
            ``soft_entropy_negexp`` exp(-entropy_temperature * H_i / log V);
            ``soft_renyi_2_entropy`` sum_v d_i(v)^2;
            ``hard_entropy_threshold`` 1[H_i / log V < entropy_threshold];
            ``soft_confidence_power`` d_i(y_i)^confidence_power (y_i the drafted token);
            ``soft_clipped_linear_margin`` clip(margin_coef * m_i, 0, 1).
        draft_probs (`torch.Tensor` of shape `(..., V)`, e.g. `(N, B, V)`): processed draft distribution.
        confidence (`torch.Tensor` of shape `(...)`): draft probability of each drafted token.

    Returns:
        `torch.Tensor` of shape `(...)`, float32 in [0, 1].

    Raises:
        ValueError: for an unknown estimator.
    """
    log_vocab = math.log(draft_probs.shape[-1])
    if estimator == "hard_margin_threshold":
        return (top2_margin(draft_probs) >= margin_threshold).float()
    if estimator == "soft_entropy_negexp":
        return torch.exp(-entropy_temperature * entropy(draft_probs) / log_vocab)
    if estimator == "soft_renyi_2_entropy":
        return draft_probs.pow(2).sum(dim=-1)
    if estimator == "hard_entropy_threshold":
        return (entropy(draft_probs) / log_vocab < entropy_threshold).float()
    if estimator == "soft_confidence_power":
        return confidence.pow(confidence_power)
    if estimator == "soft_clipped_linear_margin":
        return (margin_coef * top2_margin(draft_probs)).clamp(0.0, 1.0)
    raise ValueError(
        f"`token_acceptance_estimator` (={estimator!r}) must be one of {', '.join(map(repr, ESTIMATORS))}; "
        "pick one of them."
    )


def expected_accepted_length(alpha: torch.Tensor, span: torch.Tensor | None = None) -> torch.Tensor:
    """S2D2 Eq. 5: K_hat = sum_{k=1}^{L} prod_{i=1}^{k} alpha_i, in tokens, per row; -inf for an empty span.

    Args:
        alpha (`torch.Tensor` of shape `(N, B)`): acceptance proxies.
        span (`torch.Tensor` of shape `(N, B)`, bool, *optional*): the row's span C_t (a contiguous run);
            alpha outside it is ignored. All positions when omitted.

    Returns:
        `torch.Tensor` of shape `(N,)`, float32.
    """
    span = torch.ones_like(alpha, dtype=torch.bool) if span is None else span
    # Eq. 5 over the span only: positions before the span contribute factor 1, after it the product is cut to 0.
    started = span.long().cumsum(dim=-1) > 0
    factors = torch.where(span, alpha, torch.where(started, torch.zeros_like(alpha), torch.ones_like(alpha)))
    k_hat = (torch.cumprod(factors, dim=-1) * span).sum(dim=-1)
    return torch.where(span.any(dim=-1), k_hat, torch.full_like(k_hat, float("-inf")))


def verify_score(k_hat, *, score_type: str, penalty_coef: float, num_confident):
    """S2D2 Eq. 6: s = K_hat - c (static) or s = K_hat - c * N_hi (dynamic); elementwise over a batch.

    Args:
        k_hat (`float` or `torch.Tensor` of shape `(N,)`): expected accepted prefix length, in tokens.
        score_type (`str`): ``difference_static`` or ``difference_dynamic``.
        penalty_coef (`float`): c.
        num_confident (`int` or `torch.Tensor` of shape `(N,)`): N_hi, masked positions of the block whose draft
            confidence exceeds the confidence threshold (tokens the fallback would commit anyway).
    """
    if score_type == "difference_static":
        return k_hat - penalty_coef
    if score_type == "difference_dynamic":
        return k_hat - penalty_coef * num_confident
    raise ValueError(
        f"`do_verify_score_type` (={score_type!r}) must be one of {', '.join(map(repr, SCORE_TYPES))}; "
        "pick one of them."
    )


@dataclass
class RoutingContext:
    """What a policy sees at one denoising step (S2D2 Algorithm 4 inputs, reduced to numbers).

    Attributes:
        span_length (`int`): |C_t|, length of the first contiguous masked span, in tokens.
        span_start (`int`): index of C_t's first position in the block.
        block_size (`int`): B, in tokens.
        num_masked (`int`): |M_t|, masked positions in the block.
        num_decodable (`int`): positions of the block that are not prompt (B minus the prompt tail). The UCB
            progress bin uses it where the family does not count the prompt tail as decoded (SDAR convention,
            :func:`ucb_progress_bin`).
        score (`float`): s of Eq. 6 (computed only when the policy needs it, else nan).
        mean_normalized_entropy (`float`): mean H_i / log V over the UCB entropy source (else nan).
        ucb_bucket (`tuple[int, int, int]`, *optional*): the UCB context bucket, when the caller computed it
            batched with :func:`ucb_context_buckets`; `UCBPolicy.bucket` computes it from the fields above
            otherwise (same function, same result).
    """

    span_length: int
    block_size: int
    num_masked: int
    num_decodable: int
    span_start: int = 0
    score: float = float("nan")
    mean_normalized_entropy: float = float("nan")
    ucb_bucket: tuple[int, int, int] | None = None


# -- UCB context buckets (S2D2 App. A.6, Eq. 16) ----------------------------------------------------------------------
# The S2D2 reference implementation's UCB bucketing formulas, in float64 and in its operation order (divide, times
# the bin count, floor), so a bin equals the double-precision value, e.g. Python's `int((L - 1) / (B - 1) * bins)`,
# even where rounding makes it differ from exact arithmetic (B = 12, L = 4, 55 bins: 14, not 15); then clamped.


def _floor_bin(value: torch.Tensor, num_bins: int) -> torch.Tensor:
    return torch.floor(value * num_bins).clamp(0, num_bins - 1).long()


def ucb_span_bin(span_length: torch.Tensor, block_size: int, num_bins: int) -> torch.Tensor:
    """Span-length bin, linear over [1, B]: floor((L - 1) / (B - 1) * bins), clamped to [0, bins - 1].

    The S2D2 reference implementation's UCB bucketing (App. A.6). L = 1 is bin 0, L = B the last bin. B = 1,
    where the formula is 0 / 0, is bin 0, as in the reference (no division happens). An empty span (L = 0)
    clamps to bin 0.

    Args:
        span_length (`torch.Tensor` of shape `(N,)`, int): L = |C_t|, in tokens.
        block_size (`int`): B, in tokens (the sub-block for a sub-block decoder).
        num_bins (`int`): `ucb_span_length_bins`, >= 1.

    Returns:
        `torch.Tensor` of shape `(N,)`, int64 in [0, num_bins - 1].
    """
    span_length = torch.as_tensor(span_length)
    if block_size <= 1:
        return torch.zeros_like(span_length, dtype=torch.long)
    return _floor_bin((span_length.double() - 1.0) / (block_size - 1), num_bins)


def ucb_progress_bin(num_masked: torch.Tensor, block_size: int, num_bins: int, *, counts_prompt_tail: bool,
                     num_decodable: torch.Tensor | None = None) -> torch.Tensor:
    """Block-progress bin: floor(decoded / B * bins), clamped to [0, bins - 1] (S2D2 App. A.6, Eq. 16 context).

    The paper's "fraction of already unmasked tokens in the current block" leaves open whether a prompt tail that
    shares the block counts; the two reference implementations differ, and `counts_prompt_tail` picks one
    (a family property, `FamilyPatch.ucb_progress_counts_prompt_tail`):

    - ``False`` (SDAR reference, `SDAR/generate_ssd_policy.py::block_diffusion_generate`: a per-block counter
      set to 0 when the block starts and increased by the tokens each step commits): decoded = (B - tail) - |M_t|,
      the tokens decoded inside the block, so every block starts at progress 0.
    - ``True`` (Fast-dLLM v2 reference, `Fast-dLLM-v2/generate_policy_utils.py::generate_ssd_policy`: the
      non-mask positions of the current sub-block): decoded = B - |M_t|, so a block that starts with a prompt
      tail starts with progress tail / B.

    Both give the same bin when the block holds no prompt tail (a block-aligned prompt, every later block). The
    denominator is B in both (B = 1 needs no special case). Computed in float64 in the reference's operation
    order (divide, times the bin count, floor).

    Args:
        num_masked (`torch.Tensor` of shape `(N,)`, int): |M_t|, masked positions of the block.
        block_size (`int`): B, in tokens (the sub-block for a sub-block decoder).
        num_bins (`int`): `ucb_block_progress_bins`, >= 1.
        counts_prompt_tail (`bool`): the convention above.
        num_decodable (`torch.Tensor` of shape `(N,)`, int, *optional*): B - tail, positions of the block that
            are not prompt; required when `counts_prompt_tail` is False, unused otherwise.

    Returns:
        `torch.Tensor` of shape `(N,)`, int64 in [0, num_bins - 1].

    Raises:
        ValueError: if `counts_prompt_tail` is False and `num_decodable` is missing.
    """
    num_masked = torch.as_tensor(num_masked)
    if counts_prompt_tail:
        decoded = block_size - num_masked.double()
    else:
        if num_decodable is None:
            raise ValueError("`num_decodable` is needed when the UCB progress does not count the prompt tail "
                             "(counts_prompt_tail=False); pass B minus the prompt tail of each row's block.")
        decoded = torch.as_tensor(num_decodable, device=num_masked.device).double() - num_masked.double()
    return _floor_bin(decoded / block_size, num_bins)


def ucb_entropy_bin(mean_normalized_entropy: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Entropy bin: floor(e * bins), clamped to [0, bins - 1], e = mean H_i / log V over the entropy source.

    S2D2 App. A.6 (source: the span C_t or all masks, `ucb_entropy_source`). Computed in float64 so the
    batched and the per-context paths agree at bin edges. A nan entropy falls in bin 0.

    Args:
        mean_normalized_entropy (`torch.Tensor` of shape `(N,)`, float): e in [0, 1].
        num_bins (`int`): `ucb_entropy_bins`, >= 1.

    Returns:
        `torch.Tensor` of shape `(N,)`, int64 in [0, num_bins - 1].
    """
    value = torch.as_tensor(mean_normalized_entropy).double()
    return _floor_bin(torch.nan_to_num(value, nan=0.0), num_bins)


def ucb_context_buckets(span_length: torch.Tensor, num_masked: torch.Tensor, mean_normalized_entropy: torch.Tensor,
                        block_size: int, bins: tuple[int, int, int], *, counts_prompt_tail: bool,
                        num_decodable: torch.Tensor | None = None) -> torch.Tensor:
    """UCB context bucket b_t of S2D2 Eq. 16 per row: (span bin, progress bin, entropy bin), App. A.6.

    Args:
        span_length (`torch.Tensor` of shape `(N,)`, int): |C_t|.
        num_masked (`torch.Tensor` of shape `(N,)`, int): |M_t|.
        mean_normalized_entropy (`torch.Tensor` of shape `(N,)`, float): mean H_i / log V.
        block_size (`int`): B.
        bins (`tuple[int, int, int]`): (`ucb_span_length_bins`, `ucb_block_progress_bins`, `ucb_entropy_bins`).
        counts_prompt_tail (`bool`): progress convention of the family, see :func:`ucb_progress_bin`.
        num_decodable (`torch.Tensor` of shape `(N,)`, int, *optional*): B minus the prompt tail; required when
            `counts_prompt_tail` is False.

    Returns:
        `torch.Tensor` of shape `(N, 3)`, int64, on the inputs' device (no host sync).
    """
    span_bins, progress_bins, entropy_bins = bins
    return torch.stack([
        ucb_span_bin(span_length, block_size, span_bins),
        ucb_progress_bin(num_masked, block_size, progress_bins, counts_prompt_tail=counts_prompt_tail,
                         num_decodable=num_decodable),
        ucb_entropy_bin(mean_normalized_entropy, entropy_bins),
    ], dim=-1)


class RoutingPolicy:
    """Base of the routing policies: `decide` once per denoising step, then `observe` its outcome."""

    name: str = ""
    needs_score: bool = False
    needs_entropy: bool = False
    needs_feedback: bool = False     # whether `observe` uses its arguments (costs a host sync per step)

    def decide(self, ctx: RoutingContext) -> bool:
        """Return True to run the verifier forward at this step."""
        raise NotImplementedError

    def observe(self, num_decoded: int, verified: bool) -> None:
        """Outcome of the step just decided: tokens committed and whether verification ran."""


class MinimumSpanPolicy(RoutingPolicy):
    """Verify iff |C_t| >= tau_span (`min_ssd_span_length`); tau_span = 1 always verifies. Alg. 4."""

    name = "mask_span_length"

    def __init__(self, min_span_length: int) -> None:
        self.min_span_length = min_span_length

    def decide(self, ctx: RoutingContext) -> bool:
        return ctx.span_length >= self.min_span_length


class ScoreThresholdPolicy(RoutingPolicy):
    """Verify iff s >= tau_score (`do_verify_score_threshold`). Alg. 4."""

    name = "score_threshold"
    needs_score = True

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def decide(self, ctx: RoutingContext) -> bool:
        return ctx.score >= self.threshold


class HysteresisPolicy(RoutingPolicy):
    """Two-threshold switch (Alg. 4): OFF -> ON iff s >= tau_on, ON -> OFF iff s < tau_off; verify iff ON.

    The state starts OFF and persists across blocks for the whole `generate` call.
    """

    name = "score_hysteresis"
    needs_score = True

    def __init__(self, threshold_on: float, threshold_off: float) -> None:
        self.threshold_on, self.threshold_off = threshold_on, threshold_off
        self.on = False

    def decide(self, ctx: RoutingContext) -> bool:
        if self.on and ctx.score < self.threshold_off:
            self.on = False
        elif not self.on and ctx.score >= self.threshold_on:
            self.on = True
        return self.on


class UCBPolicy(RoutingPolicy):
    """Contextual bandit with upper confidence bounds (S2D2 App. A.6, Eq. 16-18).

    Context bucket b = (span-length bin over [1, B], block-progress bin over [0, 1], entropy bin over [0, 1]),
    with the S2D2 reference implementation's bucketing (:func:`ucb_context_buckets`): floor((L - 1) / (B - 1) *
    bins), floor(decoded / B * bins), floor(e * bins), each clamped to the last bin. decoded follows the family's
    reference (`counts_prompt_tail`, :func:`ucb_progress_bin`): B - |M_t| counting a prompt tail that shares the
    block (Fast-dLLM v2), or (B - tail) - |M_t|, only tokens decoded in the block (SDAR). Action a in
    {0: no verification, 1: verify} maximises mu_hat[a, b] + beta * sqrt(log t / n[a, b]) (Eq. 16), t the number
    of decisions so far including this one; an unvisited (a, b) scores +inf and ties choose verify. Reward
    (Eq. 18): tokens committed this step divided by 2 if verification ran, else by 1. State lives for one
    `generate` call.

    Args:
        beta (`float`): exploration weight.
        span_bins, progress_bins, entropy_bins (`int`): bins per context dimension.
        counts_prompt_tail (`bool`): the progress convention of the target family
            (`FamilyPatch.ucb_progress_counts_prompt_tail`).
    """

    name = "contextual_bandit_ucb"
    needs_entropy = True
    needs_feedback = True

    def __init__(self, beta: float, span_bins: int, progress_bins: int, entropy_bins: int, *,
                 counts_prompt_tail: bool) -> None:
        self.beta = beta
        self.bins = (span_bins, progress_bins, entropy_bins)
        #: Progress convention (:func:`ucb_progress_bin`), from `FamilyPatch.ucb_progress_counts_prompt_tail`.
        self.counts_prompt_tail = counts_prompt_tail
        self.counts: dict[tuple, list[int]] = {}
        self.reward_sums: dict[tuple, list[float]] = {}
        self.num_decisions = 0
        self._pending: tuple | None = None

    def bucket(self, ctx: RoutingContext) -> tuple[int, int, int]:
        """Context bucket of Eq. 16 for this step: `ctx.ucb_bucket` if the caller computed it (batched), else
        :func:`ucb_context_buckets` on the context's numbers."""
        if ctx.ucb_bucket is not None:
            return tuple(ctx.ucb_bucket)
        row = ucb_context_buckets(torch.tensor([ctx.span_length]), torch.tensor([ctx.num_masked]),
                                  torch.tensor([ctx.mean_normalized_entropy], dtype=torch.float64),
                                  ctx.block_size, self.bins, counts_prompt_tail=self.counts_prompt_tail,
                                  num_decodable=torch.tensor([ctx.num_decodable]))
        return tuple(row[0].tolist())

    def decide(self, ctx: RoutingContext) -> bool:
        self.num_decisions += 1
        bucket = self.bucket(ctx)
        counts = self.counts.setdefault(bucket, [0, 0])
        sums = self.reward_sums.setdefault(bucket, [0.0, 0.0])
        values = []
        for action in (0, 1):
            if counts[action] == 0:
                values.append(float("inf"))
            else:
                bonus = self.beta * math.sqrt(math.log(self.num_decisions) / counts[action])
                values.append(sums[action] / counts[action] + bonus)
        verify = values[1] >= values[0]
        self._pending = bucket
        return verify

    def observe(self, num_decoded: int, verified: bool) -> None:
        if self._pending is None:
            return
        action = int(verified)
        self.counts[self._pending][action] += 1
        self.reward_sums[self._pending][action] += num_decoded / (2.0 if verified else 1.0)
        self._pending = None
