"""S2D2: training-free self-speculative decoding for block diffusion.

Han et al., "Fast Decoding for Diffusion LLMs via Training-Free Self-Speculation", arXiv 2603.25702:
Algorithm 3 (the block sampler), Algorithm 4 (routing), Eq. 3 (2L verifier mask), Eq. 5-6 (routing score),
App. A.5-A.8. Reference-code details and the recommended choices: shared/reference/strategies.md §5.

The same model drafts (block diffusion) and verifies (block size 1). Per denoising step: draft every masked
position; take the first contiguous masked span C_t; a routing policy decides whether to verify it; if so,
one verifier forward over `[block with drafts | MASK copy]` with the Eq. 3 mask and duplicated positions gives
the AR-mode distribution q at every span position, and speculative acceptance commits the accepted prefix
plus one recovered token; otherwise the block-diffusion rule commits tokens. Not lossless (§4.4): only C_t is
verified, routing may skip, and drafting/caching stay block-diffusion unless `cache_ver`/`draft_ver`.
"""

from __future__ import annotations

import math

import torch

from ..configuration import S2D2Config
from ..masks import verifier_2l_mask
from ..routing import (
    HysteresisPolicy,
    MinimumSpanPolicy,
    RoutingContext,
    RoutingPolicy,
    ScoreThresholdPolicy,
    UCBPolicy,
    acceptance_estimates,
    expected_accepted_length,
    verify_score,
)
from ..sampling import entropy
from ..verification import greedy_match, rejection_sample
from .block_diffusion import BlockDiffusionStrategy, BlockState


def first_masked_span(masked: torch.Tensor) -> tuple[int, int]:
    """C_t: `[start, end)` of the first contiguous run of True in `masked` `(B,)`; `(B, B)` if none."""
    idx = masked.nonzero()
    if idx.numel() == 0:
        return masked.shape[0], masked.shape[0]
    start = int(idx[0, 0])
    after = (~masked[start:]).nonzero()
    end = start + int(after[0, 0]) if after.numel() else masked.shape[0]
    return start, end


def build_policy(config: S2D2Config) -> RoutingPolicy:
    """The routing policy named by `do_verify_policy`, with its thresholds (Algorithm 4, App. A.6)."""
    if config.do_verify_policy == "mask_span_length":
        return MinimumSpanPolicy(config.min_ssd_span_length)
    if config.do_verify_policy == "score_threshold":
        return ScoreThresholdPolicy(config.do_verify_score_threshold)
    if config.do_verify_policy == "score_hysteresis":
        return HysteresisPolicy(config.hysteresis_threshold_on, config.hysteresis_threshold_off)
    return UCBPolicy(config.ucb_beta, config.ucb_span_length_bins, config.ucb_block_progress_bins,
                     config.ucb_entropy_bins)


class S2D2Strategy(BlockDiffusionStrategy):
    """S2D2 self-speculation inside block diffusion (arXiv 2603.25702, Algorithms 3-4).

    Acceptance is `s2d2_acceptance`: "stochastic" (Alg. 3: accept with min(1, (q/p)^gamma), residual
    (q - p)+ on the first rejection) or "greedy_match" (accept iff the draft is the verifier argmax, commit the
    argmax at the first mismatch; deterministic, a documented deviation from the paper). The RNG order per
    step is: the sampler's draft draw for all B positions, then the verifier's uniforms and residual draw.
    """

    name = "s2d2"
    config_class = S2D2Config
    paper = "Fast Decoding for Diffusion LLMs via Training-Free Self-Speculation, arXiv:2603.25702"
    lossless = False

    def __init__(self, config: S2D2Config, session, *, block_size: int) -> None:
        super().__init__(config, session, block_size=block_size)
        self.policy = build_policy(config)
        self.acceptance = config.s2d2_acceptance or ("stochastic" if session.sampler.do_sample else "greedy_match")

    def denoise_step(self, block: BlockState, logits: torch.Tensor) -> None:
        """Algorithm 3, one step: draft, route, then verify the span or fall back to the confidence rule."""
        sampler = self.session.sampler
        draft_probs = sampler.probs(logits)                                  # (B, V)
        draft_tokens, confidence = sampler.choose(draft_probs)               # (B,), (B,)
        span = first_masked_span(block.masked)
        verify = self.policy.decide(self.routing_context(block, draft_probs, confidence, span))
        if verify:
            committed = self.verify_span(block, draft_probs, draft_tokens, span)
        else:
            committed = self.commit_by_rule(block, draft_probs, draft_tokens, confidence)
        self.policy.observe(committed, verify)

    def routing_context(self, block: BlockState, draft_probs: torch.Tensor, confidence: torch.Tensor,
                        span: tuple[int, int]) -> RoutingContext:
        """Numbers Algorithm 4 needs; the score (Eq. 5-6) and entropies only when the policy uses them."""
        cfg, masked = self.config, block.masked
        ctx = RoutingContext(span_length=span[1] - span[0], block_size=self.block_size,
                             num_masked=int(masked.sum()), num_decodable=self.block_size - block.num_fixed)
        if self.policy.needs_score:
            alpha = acceptance_estimates(
                cfg.token_acceptance_estimator, draft_probs[span[0]:span[1]], confidence[span[0]:span[1]],
                margin_threshold=cfg.ssd_confidence_margin_threshold, entropy_temperature=cfg.ssd_entropy_temperature,
                entropy_threshold=cfg.ssd_entropy_threshold, confidence_power=cfg.ssd_confidence_power,
                margin_coef=cfg.ssd_confidence_margin_coef,
            )
            num_confident = int(((confidence > cfg.confidence_threshold) & masked).sum())
            ctx.score = verify_score(expected_accepted_length(alpha), score_type=cfg.do_verify_score_type,
                                     penalty_coef=cfg.score_penalty_coef, num_confident=num_confident)
        if self.policy.needs_entropy:
            rows = draft_probs[span[0]:span[1]] if cfg.ucb_entropy_source == "span" else draft_probs[masked]
            ctx.mean_normalized_entropy = float(entropy(rows).mean()) / math.log(draft_probs.shape[-1])
        return ctx

    def verify_span(self, block: BlockState, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                    span: tuple[int, int]) -> int:
        """Verifier forward (Eq. 3, full-block form) and acceptance over the span; returns tokens committed.

        Input `[x~ | MASK x B]` (x~ = block with every mask filled by its draft), positions repeated twice,
        cache read-only. The logits of the MASK copy at position r are the block-size-1 prediction for r.
        """
        s, B = self.session, self.block_size
        filled = torch.where(block.masked, draft_tokens, block.tokens)
        ids = torch.cat([filled, torch.full_like(filled, s.mask_token_id)])
        positions = torch.cat([block.positions, block.positions])
        logits = s.runner.forward(ids, positions, verifier_2l_mask(B, ids.device), kind="verify",
                                  logits_to_keep=B - span[0])                        # rows B+span[0] .. 2B-1
        target_probs = s.sampler.probs(logits[: span[1] - span[0]])                  # (L, V)
        span_tokens = draft_tokens[span[0]:span[1]]
        if self.acceptance == "greedy_match":
            result = greedy_match(span_tokens, target_probs)
        else:
            result = rejection_sample(span_tokens, draft_probs[span[0]:span[1]], target_probs,
                                      gamma=self.config.ssd_ratio_tempering_factor,
                                      allow_resample=self.config.allow_resample, generator=s.sampler.generator)
        committed = result.token_ids.shape[0]
        block.tokens[span[0]:span[0] + committed] = result.token_ids
        s.stats.observe_verification(span[1] - span[0], result.num_accepted, result.recovered, result.bonus)
        if not result.recovered:  # allow_resample=False commits the rejected draft itself: a fallback token
            s.stats.num_fallback_tokens += committed - result.num_accepted
        return committed
