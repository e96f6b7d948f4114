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

Compiled step (issue 34; the static runtime with `compile_config`, greedy or seeded): a step is
one or two compiled functions, each one forward and one host read. :func:`s2d2_draft_step` drafts, computes the
routing numbers and commits every row by the block-diffusion rule as if no row verified; the host reads that with
the routing numbers and the policies decide; if some row verifies, :func:`s2d2_verify_step` runs the verifier
forward (the full `[x~ | MASK x B]` layout of Eq. 3: one width per key; `x~` under a causal mask on a
right-shifted model, whose carry both steps take), the acceptance over each verifying row's span and its commits,
keeping the first call's commits for the other rows. LLaDA2.1's token edits are applied in the draft step, before
C_t and the routing numbers, so the verifier reads the edited block.

Random numbers (a change to their order is a behaviour change), the same in the eager and the compiled step, per
step: first the draft's tokens, one draw for all N x B positions (`Sampler.choose`; per-row generators: row r
draws its B positions); then, when some row verifies with stochastic acceptance, the verification's numbers for the
verifying rows only, in row order (`rejection_sample` over them, `rows_of(generator, rows)`;
:func:`~hf_dllm_spec.maths.sampling.draw_verification`: uniforms `(M, L)` with L the longest verified span, then one
`Exp(1)` row of V per verifying row for its recovered token, whether it rejects or not, none with
`allow_resample=False`). Which rows verify and their span lengths are decided on the host from the draft step's read,
so the compiled step draws everything before each call: the draft's noise into a fixed buffer
(:meth:`~S2D2Strategy.step_noise`, as block diffusion) before :func:`s2d2_draft_step`, the verification's numbers
(:meth:`~S2D2Strategy.verify_draws`) before :func:`s2d2_verify_step`; given them, both are pure functions of tensors.
Between steps, a right-shifted model's separate cache writes draw each new block's first token from the carry
(eager when sampling, as block diffusion).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..maths.editing import EditingConfig, ThresholdEditRule
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
from ..maths.sampling import draw_verification, entropy, rows_of, step_processors
from ..maths.unmasking import first_masked_span
from ..tracing import recording_step
from ..validation import check_bool, check_choice, check_int, check_range, invalid
from ..maths.verification import greedy_match, rejection_sample, span_writes
from .base import RowStates
from .block_diffusion import (BlockDiffusionConfig, BlockDiffusionStrategy, BlockState, draft_and_propose,
                             output_vocab_size, step_read)

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
        hysteresis_threshold_on (`float`, defaults to 0.0): "score_hysteresis" switches verification on when
            the score reaches it (Alg. 4); greater than `hysteresis_threshold_off`.
        hysteresis_threshold_off (`float`, defaults to -1.0): "score_hysteresis" switches verification off when
            the score falls below it.
        token_acceptance_estimator (`str`, defaults to "hard_margin_threshold"): alpha_i of Eq. 5 (the paper's
            main experiments use "soft_entropy_negexp"; the presets do).
        ssd_confidence_margin_threshold (`float`, defaults to 0.05): "hard_margin_threshold": alpha_i = 1 when
            the top-1 minus top-2 draft probability reaches it, in [0, 1].
        ssd_entropy_temperature (`float`, defaults to 1.0): "soft_entropy_negexp": alpha_i = exp(-t * H_i / log V).
        ssd_entropy_threshold (`float`, defaults to 0.5): "hard_entropy_threshold": alpha_i = 1 when H_i / log V
            is below it.
        ssd_confidence_power (`float`, defaults to 1.0): "soft_confidence_power": alpha_i = confidence ** power.
        ssd_confidence_margin_coef (`float`, defaults to 1.0): "soft_clipped_linear_margin": alpha_i =
            clip(coef * margin, 0, 1).
        ucb_beta (`float`, defaults to 1.0): "contextual_bandit_ucb": weight of the exploration bonus
            (App. A.6, Eq. 16-18).
        ucb_span_length_bins (`int`, defaults to 2): "contextual_bandit_ucb": bins of the span length |C_t|.
        ucb_block_progress_bins (`int`, defaults to 2): "contextual_bandit_ucb": bins of the block's progress.
        ucb_entropy_bins (`int`, defaults to 2): "contextual_bandit_ucb": bins of the normalised entropy.
        ucb_entropy_source (`str`, defaults to "span"): "contextual_bandit_ucb": mean entropy over the span C_t
            ("span") or over every masked position ("masked").
    Acceptance:
        ssd_ratio_tempering_factor (`float`, defaults to 1.0): gamma of min(1, (p/q)^gamma), p the verifier's
            probability of the draft, q the drafter's; > 0 (App. A.8).
        allow_resample (`bool`, defaults to True): draw the recovered token from (p - q)+ on rejection; False
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

    def check_acceptance(self, do_sample: bool) -> None:
        """greedy_match (`s2d2_acceptance="greedy_match"`, the default under `do_sample=False`) reads neither
        `allow_resample` nor `ssd_ratio_tempering_factor` (they shape the random rule of Alg. 3).

        Raises:
            ValueError: either set to other than its default under greedy_match.
        """
        if self.s2d2_acceptance == "stochastic" or (self.s2d2_acceptance is None and do_sample):
            return
        for name, default in (("allow_resample", True), ("ssd_ratio_tempering_factor", 1.0)):
            if getattr(self, name) != default:
                raise invalid(name, getattr(self, name), "be left at its default under greedy_match acceptance (the "
                              "default of do_sample=False: a draft is accepted iff it is the verifier's argmax, and "
                              "the verifier's argmax replaces the first mismatch), which does not read it",
                              f"drop `{name}`, or pass s2d2_acceptance='stochastic' (with do_sample=True, or with "
                              "a generator to reproduce the reference code's random acceptance of argmax drafts)")

    def validate(self) -> None:
        super().validate()
        EditingConfig.validate(self)
        check_choice("do_verify_policy", self.do_verify_policy, POLICIES)
        check_int("min_ssd_span_length", self.min_ssd_span_length, 1, "pass 1 to verify at every step")
        span = self.sub_block_size or self.block_size          # the longest span C_t (None: not resolved yet)
        if self.do_verify_policy == "mask_span_length" and span is not None and self.min_ssd_span_length > span:
            raise invalid("min_ssd_span_length", self.min_ssd_span_length, f"be at most the longest masked span "
                          f"({span}, the {'sub-' if self.sub_block_size else ''}block size): a longer one never "
                          "verifies (plain block diffusion)", f"pass min_ssd_span_length <= {span}, e.g. 1 to verify "
                          "at every step")
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

    Acceptance is `s2d2_acceptance`: "stochastic" (Alg. 3: accept with min(1, (p/q)^gamma), p the verifier's
    probability, q the drafter's; residual (p - q)+ on the first rejection) or "greedy_match" (accept iff the
    draft is the verifier argmax, commit the argmax at the first mismatch; deterministic, a documented deviation
    from the paper). Each row has its own routing policy state. The RNG order per step is: the sampler's draft
    draw for all N x B positions, then the verifier's uniforms and residual draws for the verifying rows (the
    module docstring).
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
        self.ucb_counts_prompt_tail = tail
        self.policies = RowStates(lambda: build_policy(config, ucb_counts_prompt_tail=tail), session.batch_size)
        session.follow(self.policies.select_rows, self.policies.add_rows)    # each row's policy follows its row
        self._verify_masks: dict[tuple[int, int], torch.Tensor] = {}     # Eq. 3 patterns by (span end, start)
        self._draws: dict[int, tuple] = {}                                # verify_draws' buffers, per rows bucket
        self.acceptance = config.s2d2_acceptance or ("stochastic" if session.sampler.do_sample else "greedy_match")
        # What every row's policy needs from a step (the same for all rows; it never decides): which routing
        # numbers to compute, and their layout in the step's read (`routing_columns`, `read_contexts`).
        policy = self.routing_needs = self.policies.make()
        self.routing_fields = [("span_start", 1, int), ("span_length", 1, int), ("num_masked", 1, int),
                               ("num_decodable", 1, int)]
        if policy.needs_score:
            self.routing_fields.append(("score", 1, float))
        if policy.needs_entropy:
            self.routing_fields.append(("mean_normalized_entropy", 1, float))
        if isinstance(policy, UCBPolicy):
            self.routing_fields.append(("ucb_bucket", 3, int))
        self.full_probs = (self.full_probs or self.acceptance == "stochastic" or policy.needs_score
                           or policy.needs_entropy)

    def denoise_step(self, block: BlockState, logits: torch.Tensor) -> None:
        """Algorithm 3, one step for every row: draft, route, then verify the span or fall back to the rule."""
        draft_probs, draft_tokens, confidence = self.propose(logits)         # (N, B, V), (N, B), (N, B)
        self.apply_edits(block, draft_probs, draft_tokens, confidence)      # LLaDA2.1: the verifier sees edits
        start, end = self.current_span(block)
        contexts = self.routing_contexts(block, draft_probs, confidence, start, end)
        # A row without a mask (an editing-only post step) has nothing to verify: its policy is not consulted.
        routed = [ctx.span_length > 0 for ctx in contexts]
        decisions = [r and policy.decide(ctx) for policy, ctx, r in zip(self.policies, contexts, routed)]
        verify = torch.tensor(decisions, device=block.tokens.device)
        committed = torch.zeros_like(block.start)
        if any(decisions):
            spans = [(c.span_start, c.span_start + c.span_length) for c, d in zip(contexts, decisions) if d]
            least = self.least_commits(block) if self.tops_up else None          # before the verification commits
            verified = self.verify_spans(block, draft_probs, draft_tokens, start, end, decisions,
                                         min(a for a, _ in spans), max(b for _, b in spans),
                                         max(b - a for a, b in spans))
            committed = committed + verified
            if least is not None:
                committed = committed + self.top_up(block, draft_probs, draft_tokens, confidence, verify, verified,
                                                    least)
        if not all(decisions):
            committed = committed + self.commit_by_rule(block, draft_probs, draft_tokens, confidence, rows=~verify)
        if any(policy.needs_feedback for policy in self.policies):
            for policy, count, decided, r in zip(self.policies, committed.tolist(), decisions, routed):
                if r:
                    policy.observe(count, decided)

    @property
    def tops_up(self) -> bool:
        """Whether the schedule may ask more than one commit of a step (`steps_per_block` below the block size,
        `num_to_transfer` above 1): then a verified step is topped up to it (:meth:`top_up`)."""
        return (self.num_to_transfer or 1) > 1 or self.steps_per_block < self.block_size

    def least_commits(self, block: BlockState) -> torch.Tensor:
        """min(k, masks) per row `(N,)`: the commits the schedule asks of this step (k, :meth:`tokens_per_step`)
        clamped to the row's decodable masks, counted before the step commits anything."""
        masks = self.decodable(block).sum(dim=1)
        return torch.minimum(torch.as_tensor(self.tokens_per_step(block), device=masks.device), masks)

    def top_up(self, block: BlockState, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
               confidence: torch.Tensor, verify: torch.Tensor, verified: torch.Tensor,
               least: torch.Tensor) -> torch.Tensor:
        """The reference's commits after a verification (`strategies.md` §5.4): a verifying row that committed
        fewer than `least` tokens (min(k, masks), :meth:`least_commits`) commits the rest by the fallback rule
        over its masks left, from this step's drafts (fallback tokens). Only when the schedule asks more than
        one commit of a step (`steps_per_block` below the block size, `num_to_transfer` above 1).

        Args:
            verify (`(N,)` bool): the verifying rows. verified (`(N,)` int64): their verification's commits.
            least (`(N,)` int64): from :meth:`least_commits`.

        Returns:
            `torch.Tensor` of shape `(N,)`, int64: the commits added per row.
        """
        left = torch.where(verify, least - verified, torch.zeros_like(verified)).clamp(min=0)
        if not bool((left > 0).any()):
            return torch.zeros_like(verified)
        return self.commit_by_rule(block, draft_probs, draft_tokens, confidence, rows=left > 0, num_tokens=left)

    def current_span(self, block: BlockState) -> tuple[torch.Tensor, torch.Tensor]:
        """C_t per row, `[start, end)` `(N,)` each: the first contiguous masked span, ending with its sub-block."""
        start, end = first_masked_span(block.masked)
        if self.sub_block_size < self.block_size:
            end = torch.minimum(end, (start // self.sub_block_size + 1) * self.sub_block_size)
        return start, end

    def routing_contexts(self, block: BlockState, draft_probs: torch.Tensor, confidence: torch.Tensor,
                         start: torch.Tensor, end: torch.Tensor) -> list[RoutingContext]:
        """Numbers Algorithm 4 needs, per row (:meth:`routing_columns`), read on the host in one copy."""
        return self.read_contexts(pack_columns(self.routing_columns(block, draft_probs, confidence, start,
                                                                    end)).tolist())

    def read_contexts(self, rows: list[list[float]]) -> list[RoutingContext]:
        """The routing contexts of the rows of :func:`pack_columns` as read on the host (:attr:`routing_fields`:
        names, widths and types of its columns)."""
        contexts = []
        for row in rows:
            values, at = {}, 0
            for name, width, cast in self.routing_fields:
                values[name] = cast(row[at]) if width == 1 else tuple(map(cast, row[at:at + width]))
                at += width
            contexts.append(RoutingContext(block_size=self.sub_block_size, **values))
        return contexts

    def routing_columns(self, block: BlockState, draft_probs: torch.Tensor | None, confidence: torch.Tensor,
                        start: torch.Tensor, end: torch.Tensor) -> dict[str, torch.Tensor]:
        """Numbers Algorithm 4 needs, per row, as device tensors (no host read): the span C_t, |M_t|, the
        decodable positions; the score (Eq. 5-6) and entropies only when the policy uses them; the UCB buckets.

        With sub-blocks, everything is counted in the current sub-block (S2D2 §5 on Fast-dLLM v2: N_hi, |M_t|,
        the UCB span and progress bins relative to the sub-block size).

        Returns:
            `dict` of :attr:`routing_fields`' names, in their order, to `(N,)` (the UCB bucket `(N, 3)`) tensors.
        """
        cfg, masked, policy, unit = self.config, self.decodable(block), self.routing_needs, self.sub_block_size
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
        return columns

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
        ids, positions, intra = self.verifier_query(block, draft_tokens, first, last)
        logits = s.target.forward(ids, positions, intra, kind="verify", logits_to_keep=last - first, rows=decisions)
        rows = torch.tensor([i for i, d in enumerate(decisions) if d], device=ids.device)        # (M,)
        lengths = (end - start)[rows]
        idx = span_index(start[rows], width, last)                                         # (M, L)
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
        write, committed_ids = span_writes(result, start[rows], B)                         # (M, B)
        block.tokens[rows] = torch.where(write, committed_ids, block.tokens[rows])
        block.undecided[rows] = block.undecided[rows] & ~write
        self.observe_verification(rows, lengths, result, width)
        committed = torch.zeros_like(block.start)
        committed[rows] = result.num_tokens
        return committed

    def verifier_query(self, block: BlockState, draft_tokens: torch.Tensor, first: int,
                       last: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The verifier forward's query over `x~` (every mask of `block` filled by its draft `(N, B)`) up to block
        position `last`: position-aligned, `[x~[:last] | MASK copies of first..last-1]` with their positions and
        the Eq. 3 mask; right-shifted, `x~[:last]` under a causal mask (row r - 1 predicts r).

        Returns:
            `(ids, positions, intra)`: `(N, q)`, `(N, q)` and `(q, q)` bool, q = `2 * last - first` or `last`.
        """
        s = self.session
        filled = torch.where(block.masked, draft_tokens, block.tokens)[:, :last]
        positions = block.positions[:, :last]
        if s.target.alignment == "position":       # Eq. 3: read the MASK copies
            ids = torch.cat([filled, torch.full_like(filled[:, first:], s.mask_token_id)], dim=1)
            return ids, torch.cat([positions, positions[:, first:]], dim=1), self.verifier_mask(last, first,
                                                                                                 ids.device)
        return filled, positions, causal_mask(last, filled.device)

    def verifier_mask(self, last: int, first: int, device: torch.device) -> torch.Tensor:
        """:func:`~hf_dllm_spec.maths.masks.verifier_2l_mask` `(last, span_start=first)`, kept per `(last, first)`
        (built in the graph inside a compiled step, where the cache would be Python state)."""
        if recording_step():
            return verifier_2l_mask(last, device, span_start=first)
        mask = self._verify_masks.get((last, first))
        if mask is None:
            mask = self._verify_masks[last, first] = verifier_2l_mask(last, device, span_start=first)
        return mask

    def observe_verification(self, rows: torch.Tensor, lengths: torch.Tensor, result, width: int) -> None:
        """Add the verification counters of the verifying `rows` to the per-row statistics (on the device;
        `width`: `lengths.max()`, known on the host)."""
        stats = self.session.stats
        stats.observe_verification(rows, lengths, result.num_accepted, result.recovered, result.bonus, width=width)
        # allow_resample=False commits the rejected draft itself: a fallback token, not a recovered one.
        stats.accumulate("num_fallback_tokens",
                         (result.num_tokens - result.num_accepted) * ~(result.recovered | result.bonus), rows)

    # -- the step as compiled functions (runtime/step.py) -------------------------------------------------------
    #: S2D2's own methods its compiled step runs (with the block-diffusion ones it runs, see
    #: :meth:`runs_compiled_step`); a subclass that overrides one of them runs the eager step.
    COMPILED_S2D2_METHODS = ("denoise_step", "current_span", "routing_columns", "read_contexts", "verifier_query",
                             "verifier_mask", "compiled_denoise")

    def runs_compiled_step(self) -> bool:
        """Whether each denoising step runs as compiled functions (:func:`s2d2_draft_step`, then
        :func:`s2d2_verify_step` when a row verifies, through `StaticModelRunner.run_step`): the static runtime
        with `compile_config`, on a position-aligned model or a right-shifted one (Fast-dLLM v2: the steps take the
        carry), greedy or sampled (transformers' position-independent warpers, per row too in a continuous batch:
        :func:`~hf_dllm_spec.maths.sampling.step_processors`; the draft noise and the verification's draws made
        before each call, :meth:`step_noise`, :meth:`verify_draws`), greedy_match or stochastic acceptance, any
        routing policy, `low_confidence_dynamic` / `low_confidence_static` fallback, whole blocks or sub-blocks,
        fused or separate cache writes (compiled too), `cache_ver` and `draft_ver`, LLaDA2.1's token editing
        (`ThresholdEditRule`, post steps) and `num_to_transfer` of 1, a streamer (batch 1: the reads carry what it
        shows), a subclass that keeps the step's methods. Else the eager step (also when the schedule asks more than
        one commit of a step: the top-up of a verified step, :meth:`top_up`, runs eager). Called by the
        block-diffusion constructor (config and session only)."""
        s, cfg = self.session, self.config
        served = (getattr(s.target, "runs_compiled_carry_steps", False) if s.target.alignment == "right_shift"
                  else getattr(s.target, "runs_compiled_steps", False))
        return (served and not self.tops_up and step_processors(s.sampler.logits_processor)
                and cfg.remasking_strategy in ("low_confidence_dynamic", "low_confidence_static")
                and (self.edit_rule is None or type(self.edit_rule) is ThresholdEditRule)
                and all(getattr(type(self), name) is getattr(BlockDiffusionStrategy, name)
                        for name in BlockDiffusionStrategy.COMPILED_STEP_METHODS if name != "denoise_step")
                and all(getattr(type(self), name) is getattr(S2D2Strategy, name)
                        for name in self.COMPILED_S2D2_METHODS))

    @property
    def step_key(self) -> tuple:
        """What S2D2's compiled steps specialise on besides their shapes (the block-diffusion key: the fallback rule,
        the caching masks): the routing and the acceptance parameters."""
        cfg = self.config
        return (*super().step_key, "s2d2", self.ucb_counts_prompt_tail, self.acceptance,
                cfg.allow_resample, cfg.ssd_ratio_tempering_factor,
                *(getattr(cfg, name) for name in ROUTING_PARAMETERS))

    def compiled_denoise(self, block: BlockState, pending: tuple | None) -> tuple[torch.Tensor, list, tuple]:
        """Algorithm 3, one step for every row, as compiled functions: :func:`s2d2_draft_step` (the draft forward,
        storing `pending`, and the fallback commits of every row), the policies' decisions on the host from its
        read, then :func:`s2d2_verify_step` (the verifier forward) only when some row verifies; updates `block`
        and the counters as the eager step does.

        Returns:
            `(done, read, advanced, streamed)` as :meth:`BlockDiffusionStrategy.compiled_denoise`: `(N,)` bool; per
            row `[done, num_fixed, *block tokens]`; the next blocks for :meth:`take_next_blocks`; with a streamer,
            row 0's `[first masked, *draft canvas]` (the canvas of the draft step's read, the first mask of the
            step's last read), else None.
        """
        s, B = self.session, self.block_size
        stats = [s.stats.row(i) for i in range(block.tokens.shape[0])]
        for row in stats:
            row.num_denoising_steps += 1
        if not self.config.draft_ver:
            self.draft_mask(block)                        # built once, outside the compiled code
        before = (block.tokens, block.undecided, block.start, block.num_fixed, block.step, block.post_steps)
        carry = self.step_carry(len(stats))
        outputs = s.target.run_step(
            s2d2_draft_step, self, ("draft", *self.step_key),
            (*before, *(pending if pending is not None else (None, None, None)), self.step_noise(len(stats)), carry),
            q=B if pending is None else 2 * B, store_len=0 if pending is None else B, logits_to_keep=B, kind="draft",
            sets_carry=carry is not None)
        nxt = 6 + len(BlockState.FIELDS) + 1                # the step's outputs, the next blocks, then the draft's
        tokens, undecided, step, post_steps, done, read = outputs[:6]
        advanced, (draft_tokens, start, end, edited_tokens, flags, *draft_probs) = outputs[6:nxt], outputs[nxt:]
        values = read.tolist()                            # the draft forward's one read
        streamed = self.take_stream_columns(values)
        rows = [[int(v) for v in row[:2 + B]] for row in values]
        committed = [int(row[2 + B]) for row in values]
        counters = len(self.step_counters)                # the rule's commits, then the edits (token editing)
        if self.edit_rule is not None:
            for row, values_row in zip(stats, values):
                row.num_edited_tokens += int(values_row[3 + B])
        contexts = self.read_contexts([row[2 + B + counters:] for row in values])
        routed = [ctx.span_length > 0 for ctx in contexts]
        decisions = [r and policy.decide(ctx) for policy, ctx, r in zip(self.policies, contexts, routed)]
        if any(decisions):
            verify = torch.tensor(decisions, device=block.tokens.device)
            draws = (self.verify_draws(decisions, [ctx.span_length for ctx in contexts])
                     if self.acceptance == "stochastic" else (None, None))
            tokens, undecided, step, post_steps, done, read, *advanced = s.target.run_step(
                s2d2_verify_step, self, ("verify", *self.step_key),
                (*before, draft_tokens, start, end, verify, tokens, undecided, edited_tokens, flags,
                 *(draft_probs or (None,)), *draws, self.step_carry(len(stats))),
                q=2 * B if carry is None else B, store_len=0, logits_to_keep=B, kind="verify", rows=decisions)
            values = read.tolist()                        # the verifier forward's one read
            if streamed is not None:                      # its first mask after the verifying rows' commits
                streamed[0] = int(values[0].pop())
            for i, row in enumerate(values):
                rows[i] = row[:2 + B]
                if decisions[i]:
                    num_tokens, accepted, recovered, bonus = row[2 + B:]
                    stats[i].observe_verification(contexts[i].span_length, accepted, bool(recovered), bool(bonus))
                    stats[i].num_fallback_tokens += (num_tokens - accepted) * (not (recovered or bonus))
                    committed[i] = num_tokens
        for row, count, decided in zip(stats, committed, decisions):
            if not decided:
                row.num_fallback_tokens += count
        if any(policy.needs_feedback for policy in self.policies):
            for policy, count, decided, r in zip(self.policies, committed, decisions, routed):
                if r:
                    policy.observe(count, decided)
        block.tokens, block.undecided, block.step, block.post_steps = tokens, undecided, step, post_steps
        return done, rows, tuple(advanced), streamed

    def verify_draws(self, decisions: list[bool], span_lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stochastic acceptance in a compiled step: every random number the eager verification of this step draws
        (:meth:`verify_spans`: `rejection_sample` over the verifying rows, `rows_of(generator, rows)`, drafts of the
        longest span's width), drawn before :func:`s2d2_verify_step` by
        :func:`~hf_dllm_spec.maths.sampling.draw_verification` from the same generators in the same order and amount
        (the rows and their span lengths are known on the host from the draft step's read), into buffers kept per
        rows bucket (a captured graph reads them at fixed addresses).

        Args:
            decisions (`list[bool]`): per batch row, whether its policy verifies (some does).
            span_lengths (`list[int]`): per batch row, |C_t|.

        Returns:
            `(uniforms, noise)`: `(R, B)` float32, the verifying rows' uniforms in their order (row k of the buffer is
            the k-th verifying row's, its first `width` columns drawn), and `(R, V)` float32 `Exp(1)` noise for their
            recovered tokens (None with `allow_resample=False`); `R` the runner's `step_rows`.
        """
        s = self.session
        target, resample = s.target, self.config.allow_resample
        bucket = target.step_rows
        if bucket not in self._draws:
            self._draws[bucket] = (torch.ones(bucket, self.block_size, device=target.device),
                                   torch.ones(bucket, output_vocab_size(target.model), device=target.device)
                                   if resample else None)
        uniforms, noise = self._draws[bucket]
        rows = [i for i, d in enumerate(decisions) if d]
        width = max(span_lengths[i] for i in rows)
        lengths = torch.tensor([span_lengths[i] for i in rows])                  # on the host: no read to draw
        drawn, _ = draw_verification(lengths, width, 0 if noise is None else noise.shape[1],
                                     rows_of(s.sampler.generator, rows), device=target.device, dtype=torch.float32,
                                     noise=resample, out=(None, noise))
        uniforms[:len(rows), :width].copy_(drawn)
        return uniforms, noise


#: The S2D2 parameters that shape a step (its compiled steps' key).
ROUTING_PARAMETERS = ("do_verify_policy", "min_ssd_span_length", "do_verify_score_threshold", "do_verify_score_type",
                      "score_penalty_coef", "hysteresis_threshold_on", "hysteresis_threshold_off",
                      "token_acceptance_estimator", "ssd_confidence_margin_threshold", "ssd_entropy_temperature",
                      "ssd_entropy_threshold", "ssd_confidence_power", "ssd_confidence_margin_coef", "ucb_beta",
                      "ucb_span_length_bins", "ucb_block_progress_bins", "ucb_entropy_bins", "ucb_entropy_source",
                      "s2d2_acceptance")


def pack_columns(columns: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-row columns `(N,)` / `(N, k)` side by side as one `(N, K)` float64 tensor, so the host reads them in one
    copy (exact for counts and token ids below 2**53 and for float32 values)."""
    return torch.cat([value.reshape(value.shape[0], -1).double() for value in columns.values()], dim=1)


def span_index(start: torch.Tensor, width: int, end: int) -> torch.Tensor:
    """`(N, width)` int64 block positions `start .. start + width - 1` of each row's span, clamped below `end`
    (positions past a row's span are never read)."""
    return (start[:, None] + torch.arange(width, device=start.device)[None]).clamp(max=end - 1)


def step_outputs(strategy: S2D2Strategy, block: BlockState, tokens: torch.Tensor, undecided: torch.Tensor,
                 counters: torch.Tensor, flags: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What an S2D2 compiled step returns after its commits: the block's new `tokens` / `undecided` `(N, B)`, the
    steps and post steps taken, the finished rows (:meth:`~BlockDiffusionStrategy.block_complete`: with token
    editing, `flags` `(N, 2)` bool says which rows began the step without a mask and which had an edit), the step's
    read (:func:`~hf_dllm_spec.strategies.block_diffusion.step_read` then `counters` `(N, k)`), the next blocks
    (every :attr:`BlockState.FIELDS`, finished blocks restarted) and this step's block positions."""
    after = BlockState(tokens, undecided, block.start, block.num_fixed, block.step, block.post_steps,
                       block.mask_token_id)
    editing = strategy.edit_rule is not None
    done = strategy.block_complete(after, flags[:, 0] if editing else None, flags[:, 1] if editing else None)
    step = block.step + 1
    read = torch.cat([step_read(done, block.num_fixed, tokens), counters.to(tokens.dtype)], dim=1)
    nxt = BlockState(tokens.clone(), undecided.clone(), block.start.clone(), block.num_fixed.clone(), step.clone(),
                     after.post_steps.clone(), block.mask_token_id)
    nxt.restart(done)
    return (tokens, undecided, step, after.post_steps, done, read, *(getattr(nxt, name) for name in BlockState.FIELDS),
            block.positions)


def s2d2_draft_step(strategy: S2D2Strategy, runner, shape: tuple, lengths: torch.Tensor, tokens: torch.Tensor,
                    undecided: torch.Tensor, start: torch.Tensor, num_fixed: torch.Tensor, step: torch.Tensor,
                    post_steps: torch.Tensor, pending_tokens: torch.Tensor | None = None,
                    pending_positions: torch.Tensor | None = None, pending_rows: torch.Tensor | None = None,
                    noise: torch.Tensor | None = None, carry: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The first half of one S2D2 step (Algorithm 3) as a function of tensors, what `StaticModelRunner.run_step`
    compiles: the draft forward of each row's block (storing the pending finished blocks first), the draft
    (:meth:`~S2D2Strategy.propose`), the span C_t and the routing numbers (:meth:`~S2D2Strategy.routing_columns`),
    and every row's commits by the block-diffusion rule as if no row verified, with its done flags, read and next
    blocks: the whole step when no policy verifies. Nothing here reads the host or changes Python state.

    Args:
        strategy (`S2D2Strategy`), runner (`StaticModelRunner`), shape (`tuple`), lengths (`(N,)`): as
            :func:`~hf_dllm_spec.strategies.block_diffusion.denoising_step`.
        tokens, undecided, start, num_fixed, step, post_steps: the :class:`BlockState` fields, `(N, B)` / `(N,)`.
        pending_tokens, pending_positions (`(N, B)`), pending_rows (`(N,)` bool): the finished blocks to store, or
            None.
        noise (`torch.Tensor` of shape `(N, B, V)`, float32, *optional*): when sampling, the draft's random draw made
            before the step (:meth:`~BlockDiffusionStrategy.step_noise`).
        carry (`torch.Tensor` of shape `(N, V)`, *optional*): a right-shifted model's carry (None: position-aligned).

    Returns:
        `(lengths, [carry,] tokens, undecided, step, post_steps, done, read, *next, positions, draft_tokens,
        span_start, span_end, edited_tokens, flags[, draft_probs])` (the carry after the forward on a right-shifted
        model; the block after LLaDA2.1's token edits, which the verifier reads, and :func:`step_outputs`' flags):
        :func:`step_outputs` of the rule's commits, whose read `(N, 3 + B + K)` float64 has the committed count and
        then the :func:`pack_columns` of the routing columns after the block's tokens (then a streamer's columns,
        :meth:`~BlockDiffusionStrategy.stream_read`, with the draft canvas of the block as the step began); the
        drafts `(N, B)` and C_t `[span_start, span_end)` `(N,)` for :func:`s2d2_verify_step`, and with stochastic
        acceptance the draft distribution `(N, B, V)` float32 (p of Algorithm 3).
    """
    block = BlockState(tokens, undecided, start, num_fixed, step, post_steps, strategy.session.mask_token_id)
    began_full = ~block.masked.any(dim=1)
    pending = None if pending_tokens is None else (pending_tokens, pending_positions, pending_rows)
    lengths, carry, logits, (draft_probs, draft_tokens, confidence) = draft_and_propose(
        strategy, runner, shape, lengths, block, pending, noise, carry)
    edits = torch.zeros_like(block.undecided)
    if strategy.edit_rule is not None:                                      # LLaDA2.1: the verifier sees edits
        edits = strategy.edits(block, draft_probs, draft_tokens, confidence)
        block.tokens = torch.where(edits, draft_tokens, block.tokens)
    span_start, span_end = strategy.current_span(block)
    columns = strategy.routing_columns(block, draft_probs, confidence, span_start, span_end)
    transfer = strategy.transfer(block, draft_probs, confidence)            # the fallback, every row
    counts = [transfer.sum(dim=1)] + ([edits.sum(dim=1)] if strategy.edit_rule is not None else [])
    flags = torch.stack([began_full, edits.any(dim=1)], dim=1)
    out = step_outputs(strategy, block, torch.where(transfer, draft_tokens, block.tokens), undecided & ~transfer,
                       torch.stack(counts, dim=1), flags)
    began = BlockState(tokens, undecided, start, num_fixed, step, post_steps, block.mask_token_id)
    read = torch.cat([out[5].double(), pack_columns(columns),
                      strategy.stream_read(began, undecided & ~transfer, logits).double()], dim=1)
    return (lengths, *(() if carry is None else (carry,)), *out[:5], read, *out[6:], draft_tokens, span_start, span_end,
            block.tokens, flags, *((draft_probs,) if strategy.acceptance == "stochastic" else ()))


def s2d2_verify_step(strategy: S2D2Strategy, runner, shape: tuple, lengths: torch.Tensor, tokens: torch.Tensor,
                     undecided: torch.Tensor, start: torch.Tensor, num_fixed: torch.Tensor, step: torch.Tensor,
                     post_steps: torch.Tensor, draft_tokens: torch.Tensor, span_start: torch.Tensor,
                     span_end: torch.Tensor, verify: torch.Tensor, fallback_tokens: torch.Tensor,
                     fallback_undecided: torch.Tensor, edited_tokens: torch.Tensor, flags: torch.Tensor,
                     draft_probs: torch.Tensor | None = None, uniforms: torch.Tensor | None = None,
                     noise: torch.Tensor | None = None, carry: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The second half of one S2D2 step, run when some row verifies: the verifier forward over `x~` (the full
    `[x~ | MASK x B]` layout with the Eq. 3 mask on a position-aligned model, `x~` under a causal mask on a
    right-shifted one, whose `carry` predicts the block's first position; read-only), greedy_match of each row's
    drafted span C_t against the verifier's argmax (or stochastic acceptance: `rejection_sample` with the draws made
    before the step, :meth:`~S2D2Strategy.verify_draws`), and the commits of the verifying rows (accepted prefix, then
    the verifier's token at the first mismatch, or the recovered token); the other rows keep
    :func:`s2d2_draft_step`'s commits. A function of tensors, what `StaticModelRunner.run_step` compiles.

    Args:
        tokens, undecided, start, num_fixed, step, post_steps: the block before this step, as
            :func:`s2d2_draft_step` got it.
        draft_tokens (`(N, B)`), span_start, span_end (`(N,)`): from :func:`s2d2_draft_step`.
        verify (`(N,)` bool): the rows whose policy verifies.
        fallback_tokens, fallback_undecided (`(N, B)`): the block after :func:`s2d2_draft_step`'s commits.
        edited_tokens (`(N, B)`), flags (`(N, 2)` bool): the block after the draft's token edits and
            :func:`step_outputs`' flags, from :func:`s2d2_draft_step`.
        draft_probs (`(N, B, V)`), uniforms (`(R, B)`), noise (`(R, V)` or None): stochastic acceptance only (None
            with greedy_match): the draft distribution from :func:`s2d2_draft_step` and
            :meth:`~S2D2Strategy.verify_draws` (row k of the draws belongs to the k-th verifying row).
        carry (`torch.Tensor` of shape `(N, V)`, *optional*): a right-shifted model's carry (None: position-aligned).

    Returns:
        `(lengths, tokens, undecided, step, post_steps, done, read, *next, positions)`: :func:`step_outputs`, whose read
        `(N, 6 + B)` int64 ends with each row's committed tokens, accepted drafts, and whether the last committed
        token was recovered or a bonus (S2D2: never a bonus), then with a streamer the block's first mask after the
        step (:meth:`~BlockDiffusionStrategy.stream_read` without the canvas).
    """
    B = strategy.block_size
    block = BlockState(edited_tokens, undecided, start, num_fixed, step, post_steps, strategy.session.mask_token_id)
    ids, positions, intra = strategy.verifier_query(block, draft_tokens, 0, B)
    logits, lengths = runner.step_forward(shape, ids, positions, intra, lengths, logits_to_keep=B, carry=carry)
    idx = span_index(span_start, B, B)                                                      # (N, B)
    target_logits = logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1]))       # (N, B, V)
    span_drafts, num_drafts, sampler = draft_tokens.gather(1, idx), span_end - span_start, strategy.session.sampler
    if strategy.acceptance == "greedy_match":
        result = greedy_match(span_drafts, sampler.scores(target_logits), num_drafts=num_drafts)
    else:
        slot = (verify.long().cumsum(0) - 1).clamp(min=0)                   # the draws of the k-th verifying row
        cfg = strategy.config
        result = rejection_sample(span_drafts, draft_probs.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1])),
                                  sampler.probs(target_logits), num_drafts=num_drafts,
                                  gamma=cfg.ssd_ratio_tempering_factor, allow_resample=cfg.allow_resample,
                                  draws=(uniforms[slot], None if noise is None else noise[slot]))
    write, committed = span_writes(result, span_start, B)
    write = write & verify[:, None]
    rows = verify[:, None]
    after = torch.where(rows, undecided & ~write, fallback_undecided)
    counters = torch.stack([result.num_tokens, result.num_accepted, result.recovered.long(), result.bonus.long(),
                            *strategy.stream_read(block, after).unbind(dim=1)], dim=1)
    return (lengths, *step_outputs(strategy, block,
                                   torch.where(write, committed, torch.where(rows, edited_tokens, fallback_tokens)),
                                   after, counters, flags))
