"""S2D2: training-free self-speculative decoding for block diffusion, batched.

Han et al., "Fast Decoding for Diffusion LLMs via Training-Free Self-Speculation", arXiv 2603.25702:
Algorithm 3 (the block sampler), Algorithm 4 (routing), Eq. 3 (2L verifier mask), Eq. 5-6 (routing score),
App. A.5-A.8; where the paper leaves details open, the S2D2 reference implementation (`phymhan/S2D2`).

The same model drafts (block diffusion) and verifies (block size 1). Per denoising step and per row: draft
every masked position; take the row's first contiguous masked span C_t; the row's routing policy decides
whether to verify it; one verifier forward serves every row that verifies (layout below), and speculative
acceptance commits each row's accepted prefix plus one recovered token; the other rows commit by the
block-diffusion rule. Not lossless (§4.4): only C_t is verified, routing may skip, and drafting/caching stay
block-diffusion unless `cache_ver`/`draft_ver`.

Verifier layout by alignment: a position-aligned model reads the AR-mode prediction for block position r at
the MASK copy of r in `[x~ | MASK x B]` with the Eq. 3 mask and duplicated positions; a right-shifted model
reads it at row r - 1 of `[x~]` under a causal mask (the runner's shift gives row r the prediction for r).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..configuration import check_bool, check_int
from ..maths.editing import EditingConfig
from ..maths.masks import causal_mask, verifier_2l_mask
from ..maths.routing import (
    ESTIMATORS,
    POLICIES,
    SCORE_TYPES,
    UCB_ENTROPY_SOURCES,
    HysteresisPolicy,
    MinimumSpanPolicy,
    RoutingContext,
    RoutingPolicy,
    ScoreThresholdPolicy,
    UCBPolicy,
    acceptance_estimates,
    expected_accepted_length,
    ucb_context_buckets,
    verify_score,
)
from ..maths.sampling import entropy, rows_of
from ..maths.unmasking import first_masked_span
from ..validation import check_choice, check_range, invalid
from ..maths.verification import greedy_match, rejection_sample
from .block_diffusion import BlockDiffusionConfig, BlockDiffusionStrategy, BlockState

_SDAR_AR_CACHING = {"cache_ver": True, "draft_ver": True, "token_acceptance_estimator": "soft_entropy_negexp"}
_FAST_DLLM_V2 = {"block_size": 32, "confidence_threshold": 0.9, "fuse_cache_write": False,
                 "token_acceptance_estimator": "soft_entropy_negexp"}
# S2D2 §5.1 Table 3 (LLaDA2.1-mini) with the S2D2 README's routing; editing on, no editing-only post steps
# (the S2D2 CLI's max_post_steps=0), one mask at least per unverified step.
_LLADA21 = {"block_size": 32, "max_post_steps": 0, "num_to_transfer": 1, "do_verify_policy": "score_threshold",
            "do_verify_score_type": "difference_static", "score_penalty_coef": 4.0}
_FAST_DLLM_V2_HYSTERESIS = {"do_verify_policy": "score_hysteresis", "hysteresis_threshold_on": 1.0,
                            "hysteresis_threshold_off": -5.0, "do_verify_score_type": "difference_dynamic",
                            "score_penalty_coef": 1.0}


@dataclass
class S2D2Config(BlockDiffusionConfig, EditingConfig):
    """S2D2 self-speculative block diffusion (arXiv 2603.25702, Algorithms 3-4, Eq. 3-6, App. A.5-A.8).

    Inherits the block-diffusion parameters (the fallback rule is `remasking_strategy`) and LLaDA2.1's token
    editing (`editing_threshold`, `max_post_steps`, `num_to_transfer`; off by default): edits are computed from
    the draft before verification, the verifier reads the edited block, and they apply at every step (S2D2 §5 on
    LLaDA2.1; `strategies.md` §5.7). Routing:

    Args:
        do_verify_policy (`str`, defaults to "mask_span_length"): one of "mask_span_length",
            "score_threshold", "score_hysteresis", "contextual_bandit_ucb".
        min_ssd_span_length (`int`, defaults to 1): tau_span; 1 verifies at every step.
        do_verify_score_threshold (`float`, defaults to 0.0): tau_score.
        do_verify_score_type (`str`, defaults to "difference_dynamic"): Eq. 6 static or dynamic score.
        score_penalty_coef (`float`, defaults to 2.0): c of Eq. 6, >= 0.
        hysteresis_threshold_on / hysteresis_threshold_off (`float`, defaults to 0.0 / -1.0): on > off.
        token_acceptance_estimator (`str`, defaults to "hard_margin_threshold"): alpha_i of Eq. 5 (the paper's
            main experiments use "soft_entropy_negexp"; the presets do).
        ssd_confidence_margin_threshold (`float`, 0.05), ssd_entropy_temperature (`float`, 1.0),
        ssd_entropy_threshold (`float`, 0.5), ssd_confidence_power (`float`, 1.0),
        ssd_confidence_margin_coef (`float`, 1.0): estimator parameters.
        ucb_beta (`float`, 1.0), ucb_span_length_bins / ucb_block_progress_bins / ucb_entropy_bins (`int`, 2),
        ucb_entropy_source (`str`, "span" or "masked"): UCB bandit (App. A.6).
    Acceptance:
        ssd_ratio_tempering_factor (`float`, defaults to 1.0): gamma of min(1, (q/p)^gamma), > 0 (App. A.8).
        allow_resample (`bool`, defaults to True): draw the recovered token from (q - p)+ on rejection; False
            commits the rejected draft (SDAR reference).
        s2d2_acceptance (`str`, *optional*): "stochastic" (rejection sampling, Alg. 3) or "greedy_match"
            (accept iff draft = verifier argmax; deterministic; a documented deviation). `None` picks
            "greedy_match" without sampling and "stochastic" with `do_sample=True`.
    """

    decoding_strategy: ClassVar[str] = "s2d2"
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        # S2D2 §5.1 Table 1 and the S2D2 reference implementation's README commands; all with
        # low_confidence_dynamic 0.85 as the fallback.
        "sdar-1.7b-config-a": {"block_size": 4, "do_verify_policy": "mask_span_length", "min_ssd_span_length": 2,
                               "token_acceptance_estimator": "soft_entropy_negexp"},
        "sdar-1.7b-config-b": {"block_size": 32, "do_verify_policy": "mask_span_length", "min_ssd_span_length": 1,
                               **_SDAR_AR_CACHING},
        "sdar-4b-config-a": {"block_size": 16, "do_verify_policy": "mask_span_length", "min_ssd_span_length": 1,
                             **_SDAR_AR_CACHING},
        "sdar-4b-config-b": {"block_size": 32, "do_verify_policy": "mask_span_length", "min_ssd_span_length": 1,
                             **_SDAR_AR_CACHING},
        "sdar-8b-config-a": {"block_size": 4, "do_verify_policy": "score_threshold", "do_verify_score_threshold": 0.0,
                             "do_verify_score_type": "difference_static", "score_penalty_coef": 1.0,
                             **_SDAR_AR_CACHING},
        "sdar-8b-config-b": {"block_size": 16, "do_verify_policy": "score_threshold", "do_verify_score_threshold": 0.0,
                             "do_verify_score_type": "difference_static", "score_penalty_coef": 0.0,
                             **_SDAR_AR_CACHING},
        # S2D2 §5.1 Table 2 (Fast-dLLM v2 7B): blocks of 32, threshold 0.9 fallback, no AR caching, separate
        # cache writes as the family decoder; the paper's text gives sub-blocks of 16 for config-B and 8 for its
        # baseline, so both are offered.
        "fast-dllm-v2-config-a": {**_FAST_DLLM_V2, "sub_block_size": 4, **_FAST_DLLM_V2_HYSTERESIS},
        "fast-dllm-v2-config-b": {**_FAST_DLLM_V2, "sub_block_size": 16, **_FAST_DLLM_V2_HYSTERESIS},
        "fast-dllm-v2-config-b-sb8": {**_FAST_DLLM_V2, "sub_block_size": 8, **_FAST_DLLM_V2_HYSTERESIS},
        "fast-dllm-v2-config-c": {**_FAST_DLLM_V2, "sub_block_size": 32, "do_verify_policy": "mask_span_length",
                                  "min_ssd_span_length": 8},
        # S2D2 §5.1 Table 3 (LLaDA2.1-mini): "Quality" tau_mask 0.7 / tau_edit 0.5 with tau_score 0, and
        # "Conservative" 0.95 / 0.9 with tau_score -5; static score, c = 4.
        "llada2.1-mini-quality": {**_LLADA21, "confidence_threshold": 0.7, "editing_threshold": 0.5,
                                  "do_verify_score_threshold": 0.0},
        "llada2.1-mini-conservative": {**_LLADA21, "confidence_threshold": 0.95, "editing_threshold": 0.9,
                                       "do_verify_score_threshold": -5.0},
    }

    do_verify_policy: str = "mask_span_length"
    min_ssd_span_length: int = 1
    do_verify_score_threshold: float = 0.0
    do_verify_score_type: str = "difference_dynamic"
    score_penalty_coef: float = 2.0
    hysteresis_threshold_on: float = 0.0
    hysteresis_threshold_off: float = -1.0
    token_acceptance_estimator: str = "hard_margin_threshold"
    ssd_confidence_margin_threshold: float = 0.05
    ssd_entropy_temperature: float = 1.0
    ssd_entropy_threshold: float = 0.5
    ssd_confidence_power: float = 1.0
    ssd_confidence_margin_coef: float = 1.0
    ucb_beta: float = 1.0
    ucb_span_length_bins: int = 2
    ucb_block_progress_bins: int = 2
    ucb_entropy_bins: int = 2
    ucb_entropy_source: str = "span"
    ssd_ratio_tempering_factor: float = 1.0
    allow_resample: bool = True
    s2d2_acceptance: str | None = None

    def stochastic_acceptance(self) -> tuple[str, str] | None:
        """`("s2d2_acceptance", "stochastic")` when asked for (Alg. 3's random acceptance)."""
        return ("s2d2_acceptance", "stochastic") if self.s2d2_acceptance == "stochastic" else None

    def validate(self) -> None:
        super().validate()
        EditingConfig.validate(self)
        check_choice("do_verify_policy", self.do_verify_policy, POLICIES)
        check_int("min_ssd_span_length", self.min_ssd_span_length, 1, "pass 1 to verify at every step")
        check_choice("do_verify_score_type", self.do_verify_score_type, SCORE_TYPES)
        check_choice("token_acceptance_estimator", self.token_acceptance_estimator, ESTIMATORS)
        check_choice("ucb_entropy_source", self.ucb_entropy_source, UCB_ENTROPY_SOURCES)
        for name in ("do_verify_score_threshold", "hysteresis_threshold_on", "hysteresis_threshold_off"):
            check_range(name, getattr(self, name), fix="pass a finite number")
        check_range("score_penalty_coef", self.score_penalty_coef, low=0.0, fix="pass c >= 0, e.g. 2.0")
        if self.hysteresis_threshold_on <= self.hysteresis_threshold_off:
            raise invalid("hysteresis_threshold_on", self.hysteresis_threshold_on,
                          f"be greater than `hysteresis_threshold_off` (={self.hysteresis_threshold_off})",
                          "raise the on threshold or lower the off threshold")
        check_range("ssd_ratio_tempering_factor", self.ssd_ratio_tempering_factor, low=0.0, low_open=True,
                    fix="pass gamma > 0; 1.0 is the unmodified rejection test")
        check_range("ssd_confidence_margin_threshold", self.ssd_confidence_margin_threshold, low=0.0, high=1.0,
                    fix="pass a probability margin such as 0.05")
        check_range("ssd_entropy_temperature", self.ssd_entropy_temperature, low=0.0, low_open=True,
                    fix="pass beta > 0, e.g. 1.0")
        check_range("ssd_entropy_threshold", self.ssd_entropy_threshold, low=0.0, high=1.0, low_open=True,
                    fix="pass a normalised entropy in (0, 1], e.g. 0.5")
        check_range("ssd_confidence_power", self.ssd_confidence_power, low=0.0, low_open=True,
                    fix="pass an exponent > 0, e.g. 1.0")
        check_range("ssd_confidence_margin_coef", self.ssd_confidence_margin_coef, low=0.0, low_open=True,
                    fix="pass a slope > 0, e.g. 1.0")
        check_range("ucb_beta", self.ucb_beta, low=0.0, fix="pass an exploration weight >= 0, e.g. 1.0")
        for name in ("ucb_span_length_bins", "ucb_block_progress_bins", "ucb_entropy_bins"):
            check_int(name, getattr(self, name), 1, "pass a number of bins >= 1, e.g. 2")
        check_bool("allow_resample", self.allow_resample)
        if self.s2d2_acceptance is not None:
            check_choice("s2d2_acceptance", self.s2d2_acceptance, ("greedy_match", "stochastic"),
                         "pass 'greedy_match', 'stochastic', or None for the default of the sampling mode")


def build_policy(config: "S2D2Config", *, ucb_counts_prompt_tail: bool) -> RoutingPolicy:
    """The routing policy named by `do_verify_policy`, with its thresholds (Algorithm 4, App. A.6).

    `ucb_counts_prompt_tail` is the target family's UCB progress convention
    (`FamilyPatch.ucb_progress_counts_prompt_tail`, see :func:`~hf_dllm_spec.maths.routing.ucb_progress_bin`); the
    other policies ignore it.
    """
    if config.do_verify_policy == "mask_span_length":
        return MinimumSpanPolicy(config.min_ssd_span_length)
    if config.do_verify_policy == "score_threshold":
        return ScoreThresholdPolicy(config.do_verify_score_threshold)
    if config.do_verify_policy == "score_hysteresis":
        return HysteresisPolicy(config.hysteresis_threshold_on, config.hysteresis_threshold_off)
    return UCBPolicy(config.ucb_beta, config.ucb_span_length_bins, config.ucb_block_progress_bins,
                     config.ucb_entropy_bins, counts_prompt_tail=ucb_counts_prompt_tail)


class S2D2Strategy(BlockDiffusionStrategy):
    """S2D2 self-speculation inside block diffusion (arXiv 2603.25702, Algorithms 3-4).

    Acceptance is `s2d2_acceptance`: "stochastic" (Alg. 3: accept with min(1, (q/p)^gamma), residual
    (q - p)+ on the first rejection) or "greedy_match" (accept iff the draft is the verifier argmax, commit the
    argmax at the first mismatch; deterministic, a documented deviation from the paper). Each row has its own
    routing policy state. The RNG order per step is: the sampler's draft draw for all N x B positions, then
    the verifier's uniforms and residual draws for the verifying rows (verification.py).
    """

    name = "s2d2"
    config_class = S2D2Config
    paper = "Fast Decoding for Diffusion LLMs via Training-Free Self-Speculation, arXiv:2603.25702"
    lossless = False
    #: Verify with the span-width layout (True) or the full 2B / B layout of Eq. 3 (False: the slow reference the
    #: narrow one is tested against; same tokens and forwards).
    narrow_verifier: bool = True

    def __init__(self, config: S2D2Config, session) -> None:
        super().__init__(config, session)
        # The UCB progress convention follows the target family's S2D2 reference (FamilyPatch attribute).
        tail = session.target.patch.ucb_progress_counts_prompt_tail
        self._new_policy = lambda: build_policy(config, ucb_counts_prompt_tail=tail)
        self.policies = [self._new_policy() for _ in range(session.batch_size)]
        session.follow(self._select_policies, self._add_policies)
        self._verify_masks: dict[tuple[int, int], torch.Tensor] = {}     # Eq. 3 patterns by (span end, start)
        self.acceptance = config.s2d2_acceptance or ("stochastic" if session.sampler.do_sample else "greedy_match")
        policy = self.policies[0]
        self.full_probs = (self.full_probs or self.acceptance == "stochastic" or policy.needs_score
                           or policy.needs_entropy)

    def _select_policies(self, index: torch.Tensor) -> None:
        """Each row's routing policy follows its row (a session follower)."""
        self.policies = [self.policies[i] for i in index.tolist()]

    def _add_policies(self, count: int) -> None:
        """Rows that join the batch start with a fresh routing policy each (a session follower)."""
        self.policies.extend(self._new_policy() for _ in range(count))

    def denoise_step(self, block: BlockState, logits: torch.Tensor) -> None:
        """Algorithm 3, one step for every row: draft, route, then verify the span or fall back to the rule."""
        draft_probs, draft_tokens, confidence = self.propose(logits)         # (N, B, V), (N, B), (N, B)
        self.apply_edits(block, draft_probs, draft_tokens, confidence)      # LLaDA2.1: the verifier sees edits
        start, end = first_masked_span(block.masked)
        if self.sub_block_size < self.block_size:                           # C_t ends with its sub-block
            end = torch.minimum(end, (start // self.sub_block_size + 1) * self.sub_block_size)
        contexts = self.routing_contexts(block, draft_probs, confidence, start, end)
        # A row without a mask (an editing-only post step) has nothing to verify: its policy is not consulted.
        routed = [ctx.span_length > 0 for ctx in contexts]
        decisions = [r and policy.decide(ctx) for policy, ctx, r in zip(self.policies, contexts, routed)]
        verify = torch.tensor(decisions, device=block.tokens.device)
        committed = torch.zeros_like(block.start)
        if any(decisions):
            spans = [(c.span_start, c.span_start + c.span_length) for c, d in zip(contexts, decisions) if d]
            committed = committed + self.verify_spans(block, draft_probs, draft_tokens, start, end, decisions,
                                                      min(a for a, _ in spans), max(b for _, b in spans),
                                                      max(b - a for a, b in spans))
        if not all(decisions):
            committed = committed + self.commit_by_rule(block, draft_probs, draft_tokens, confidence, rows=~verify)
        if any(policy.needs_feedback for policy in self.policies):
            for policy, count, decided, r in zip(self.policies, committed.tolist(), decisions, routed):
                if r:
                    policy.observe(count, decided)

    def routing_contexts(self, block: BlockState, draft_probs: torch.Tensor, confidence: torch.Tensor,
                         start: torch.Tensor, end: torch.Tensor) -> list[RoutingContext]:
        """Numbers Algorithm 4 needs, per row; the score (Eq. 5-6) and entropies only when the policy uses them.

        With sub-blocks, everything is counted in the current sub-block (S2D2 §5 on Fast-dLLM v2: N_hi, |M_t|,
        the UCB span and progress bins relative to the sub-block size).
        """
        cfg, masked, policy, unit = self.config, self.decodable(block), self.policies[0], self.sub_block_size
        span = (block.offsets >= start[:, None]) & (block.offsets < end[:, None])      # (N, B)
        decodable = block.num_masks if unit == self.block_size else \
            (self.current_sub_block(block) & ~block.fixed).sum(dim=1)
        columns: dict[str, Any] = {
            "span_start": start, "span_length": end - start, "num_masked": masked.sum(dim=1),
            "num_decodable": decodable,
        }
        if policy.needs_score:
            alpha = acceptance_estimates(
                cfg.token_acceptance_estimator, draft_probs, confidence,
                margin_threshold=cfg.ssd_confidence_margin_threshold, entropy_temperature=cfg.ssd_entropy_temperature,
                entropy_threshold=cfg.ssd_entropy_threshold, confidence_power=cfg.ssd_confidence_power,
                margin_coef=cfg.ssd_confidence_margin_coef,
            )
            num_confident = ((confidence > cfg.confidence_threshold) & masked).sum(dim=1)
            columns["score"] = verify_score(expected_accepted_length(alpha, span), score_type=cfg.do_verify_score_type,
                                            penalty_coef=cfg.score_penalty_coef, num_confident=num_confident)
        if policy.needs_entropy:
            rows = span if cfg.ucb_entropy_source == "span" else masked
            ent = (entropy(draft_probs) * rows).sum(dim=1) / rows.sum(dim=1).clamp(min=1)
            columns["mean_normalized_entropy"] = ent / math.log(draft_probs.shape[-1])
        if isinstance(policy, UCBPolicy):
            # S2D2 App. A.6 buckets, on the device. The progress bin's decoded is B - num_masked (prompt tail
            # counted, Fast-dLLM v2 reference) or num_decodable - num_masked (SDAR reference), per the family.
            columns["ucb_bucket"] = ucb_context_buckets(columns["span_length"], columns["num_masked"],
                                                        columns["mean_normalized_entropy"], unit, policy.bins,
                                                        counts_prompt_tail=policy.counts_prompt_tail,
                                                        num_decodable=columns["num_decodable"])  # (N, 3)
        # One device-to-host copy per step: the columns packed as float64 (exact for counts and for float32 values).
        layout, width = [], 0
        for name, value in columns.items():
            n = 1 if value.dim() == 1 else value.shape[1]
            layout.append((name, slice(width, width + n), value.dim() == 1,
                           float if value.is_floating_point() else int))
            width += n
        packed = torch.cat([v.reshape(v.shape[0], -1).double() for v in columns.values()], dim=1).tolist()
        return [RoutingContext(block_size=unit, **{
                    name: cast(row[cols][0]) if scalar else tuple(map(cast, row[cols]))
                    for name, cols, scalar, cast in layout})
                for row in packed]

    def verify_spans(self, block: BlockState, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                     start: torch.Tensor, end: torch.Tensor, decisions: list[bool], first_start: int,
                     last_end: int, width: int) -> torch.Tensor:
        """One verifier forward for the batch and acceptance over each verifying row's span.

        x~ = block with every mask filled by its draft; cache read-only. Rows that do not verify ride along in
        the forward and are ignored. The forward is no wider than the spans need (:attr:`narrow_verifier`): with
        S = `first_start` and E = `last_end` (the least span start and the greatest span end of the verifying
        rows) a position-aligned model reads `[x~[:E] | MASK copies of S..E-1]`, width E + (E - S) instead of
        2B, and a right-shifted one `x~[:E]` instead of B; the logits read are those of the full layout (each
        kept query sees the same keys), so the tokens are the same (tested against the full layout). `width`: the
        longest span of the verifying rows (from the routing contexts, already on the host).

        Returns:
            `torch.Tensor` of shape `(N,)`, int64, tokens committed per row (0 for rows that do not verify).
        """
        s, B = self.session, self.block_size
        first, last = (first_start, last_end) if self.narrow_verifier else (0, B)
        filled = torch.where(block.masked, draft_tokens, block.tokens)[:, :last]
        positions = block.positions[:, :last]
        keep = last - first
        if s.target.alignment == "position":       # Eq. 3: read the MASK copies
            ids = torch.cat([filled, torch.full_like(filled[:, first:], s.mask_token_id)], dim=1)
            positions = torch.cat([positions, positions[:, first:]], dim=1)
            intra = self._verify_masks.get((last, first))
            if intra is None:
                intra = self._verify_masks[last, first] = verifier_2l_mask(last, ids.device, span_start=first)
        else:                                      # right shift: row r - 1 of a causal pass predicts r
            ids, intra = filled, causal_mask(last, filled.device)
        logits = s.target.forward(ids, positions, intra, kind="verify", logits_to_keep=keep, rows=decisions)
        rows = torch.tensor([i for i, d in enumerate(decisions) if d], device=filled.device)     # (M,)
        lengths = (end - start)[rows]
        idx = (start[rows, None] + torch.arange(width, device=rows.device)[None]).clamp(max=last - 1)  # (M, L)
        span_tokens = draft_tokens[rows].gather(1, idx)
        target_logits = logits[rows[:, None], idx - first]                                 # (M, L, V)
        if self.acceptance == "greedy_match":       # the argmax only: no softmax over the vocabulary
            result = greedy_match(span_tokens, s.sampler.scores(target_logits, rows), num_drafts=lengths)
        else:
            target_probs = s.sampler.probs(target_logits, rows)
            span_draft_probs = draft_probs[rows[:, None], idx]
            result = rejection_sample(span_tokens, span_draft_probs, target_probs, num_drafts=lengths,
                                      gamma=self.config.ssd_ratio_tempering_factor,
                                      allow_resample=self.config.allow_resample,
                                      generator=rows_of(s.sampler.generator, rows))
        # Commit each row's tokens at block positions start .. start + num_tokens - 1.
        relative = block.offsets - start[rows, None]                                      # (M, B)
        write = (relative >= 0) & (relative < result.num_tokens[:, None])
        committed_ids = result.token_ids.gather(1, relative.clamp(0, result.token_ids.shape[1] - 1))
        block.tokens[rows] = torch.where(write, committed_ids, block.tokens[rows])
        block.undecided[rows] = block.undecided[rows] & ~write
        self.observe_verification(rows, lengths, result, width)
        committed = torch.zeros_like(block.start)
        committed[rows] = result.num_tokens
        return committed

    def observe_verification(self, rows: torch.Tensor, lengths: torch.Tensor, result, width: int) -> None:
        """Add the verification counters of the verifying `rows` to the per-row statistics (on the device;
        `width`: `lengths.max()`, known on the host)."""
        stats = self.session.stats
        stats.observe_verification(rows, lengths, result.num_accepted, result.recovered, result.bonus, width=width)
        # allow_resample=False commits the rejected draft itself: a fallback token, not a recovered one.
        stats.accumulate("num_fallback_tokens",
                         (result.num_tokens - result.num_accepted) * ~(result.recovered | result.bonus), rows)
