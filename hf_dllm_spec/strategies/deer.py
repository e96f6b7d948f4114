"""DEER: a diffusion drafter proposes a whole block in one forward, an AR target verifies it losslessly.

Cheng et al., "Draft with Diffusion, Verify with Autoregressive Models" (arXiv 2512.15176): §3.2, Eq. 5-6,
Algorithm 1, App. E (Lemma E.1). No public code exists; where the paper contradicts itself this follows
`strategies.md` §7 (stop at the first rejection; recovered token from the residual; stop at any committed stop
id).

One cycle per row (batched):

1. the drafter (:class:`~hf_dllm_spec.strategies.drafting.OneStepDrafter`) reads the verified prefix once and proposes
   k tokens y_1..y_k ~ q_theta(. | x_{1:j}) (argmax at T = 0), the drafter's MASK suppressed; near the budget
   a row verifies fewer drafts, the first ones of a block of k masks drafted as always (so a row's drafts do not
   depend on the other rows of a batch);
2. one target forward over ``[x_j | y_1 .. y_k]`` (x_j: the last committed token, not yet in the target's
   cache) stores all k + 1 tokens and gives p_AR at every draft position plus the bonus position;
3. acceptance left to right (`verification.rejection_sample`: min(1, p/q), residual max(0, p - q), bonus
   from p after full acceptance; `greedy_match` at T = 0), stopping at the first rejection;
4. the target cache drops the rejected drafts (`ModelRunner.discard_tail`: `DynamicCache.crop` of what every
   row drops, a validity mask for the rest), so it equals a fresh prefill of the committed tokens; the
   recovered or bonus token is the next cycle's x_j.

Greedy DEER reproduces the target's greedy `generate` token for token; with sampling the output follows the
target's distribution exactly (Leviathan et al. 2023; DEER App. E), for any drafter. The drafter only sets the
speed: without D2A alignment (`recipes`, objective ``d2a``) acceptance is low.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..configuration import DrafterConfig, check_int
from .drafting import DRAFT_ATTENTIONS, SEP_POSITIONS, OneStepDrafter
from ..maths.masks import causal_mask, left_pad
from ..validation import check_choice, invalid
from ..maths.verification import ACCEPTANCE_RULES, greedy_match, rejection_sample
from .base import DecodingStrategy


@dataclass
class DeerConfig(DrafterConfig):
    """DEER (arXiv 2512.15176 §3.2, Algorithm 1; `strategies.md` §7).

    Args:
        block_size (`int`, defaults to 32): k, tokens drafted per cycle by one drafter forward (the paper's
            block size; App. B.2 sweeps 4-32, its main tables imply 32).
        acceptance (`str`, *optional*): "rejection_sampling" (lossless speculative sampling, Eq. 5-6) or
            "greedy_match" (accept iff the draft is the target's argmax; commit the argmax at the first
            mismatch). `None` picks "greedy_match" without sampling and "rejection_sampling" with
            `do_sample=True`. Greedy match with sampling is refused (it would not follow the target).
        draft_attention (`str`, defaults to "causal_prefix"): the drafter's layout, "causal_prefix" (cached
            causal prefix, full attention inside the drafted block: block-diffusion drafters and the D2A
            recipe) or "full" (bidirectional over everything, recomputed each cycle: Open-dCoder-style).
        sep_token_id (`int`, *optional*): a SEP token appended to the drafted block (DEER Stage I); none by
            default. sep_position (`str`, defaults to "after_masks"): "after_masks" or "before_masks".
        draft_block_size: inherited; unused by DEER (k is `block_size`, whatever the drafter's trained size).

    Raises:
        ValueError: for an out-of-range or unknown value, naming the parameter.
    """

    decoding_strategy: ClassVar[str] = "deer"
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        # DEER App. B.2 sweeps k in {4, 8, 16, 32}; the main tables use 32.
        "deer-k4": {"block_size": 4},
        "deer-k8": {"block_size": 8},
        "deer-k16": {"block_size": 16},
        "deer-k32": {"block_size": 32},
    }

    block_size: int = 32
    acceptance: str | None = None
    draft_attention: str = "causal_prefix"
    sep_token_id: int | None = None
    sep_position: str = "after_masks"

    def validate(self) -> None:
        super().validate()
        check_int("block_size", self.block_size, 1, "pass the number of tokens to draft per cycle, e.g. 16")
        if self.acceptance is not None:
            check_choice("acceptance", self.acceptance, ACCEPTANCE_RULES, "pass acceptance='rejection_sampling'")
        check_choice("draft_attention", self.draft_attention, DRAFT_ATTENTIONS, "pass draft_attention='causal_prefix'")
        if self.sep_token_id is not None:
            check_int("sep_token_id", self.sep_token_id, 0, "pass a token id of the drafter's vocabulary, or None")
        check_choice("sep_position", self.sep_position, SEP_POSITIONS, "pass sep_position='after_masks'")


class DeerStrategy(DecodingStrategy):
    """DEER decoding, batched; see the module docstring and :class:`DeerConfig`."""

    name = "deer"
    config_class = DeerConfig
    paper = "Cheng et al., Draft with Diffusion, Verify with Autoregressive Models, arXiv 2512.15176"
    lossless = True
    requires_mask_token = False
    uses_drafter = True
    requires_draft_mask_token = True
    decodes_whole_blocks = False        # k drafts per cycle, never beyond the budget (`num_drafts`)
    per_row_stops = True
    per_row_sampling = True

    @classmethod
    def check_block_sizes(cls, block_size: int, draft_block_size: int | None) -> None:
        """Any k works with any drafter (k is not the drafter's trained block size)."""

    @classmethod
    def check_models(cls, target, target_patch, drafter, drafter_patch) -> None:
        """The target must be an autoregressive (right-shifted, non-diffusion) causal LM.

        Raises:
            ValueError: naming `model` for a diffusion target.
        """
        if target_patch.is_diffusion_lm or target_patch.alignment_of(target) != "right_shift":
            raise invalid("model", type(target).__name__, "be an autoregressive causal LM for "
                          "decoding_strategy='deer' (DEER verifies with an AR target, e.g. Qwen2/Qwen3)",
                          "pass the AR model as the model and the diffusion model as draft_model=")

    def __init__(self, config: DeerConfig, session) -> None:
        super().__init__(config, session)
        s = session
        self.acceptance = s.resolve_acceptance(config.acceptance)
        self.draft_sampler = s.draft_sampler()
        self.drafter = OneStepDrafter(s.drafter, s.draft_mask_token_id, draft_attention=config.draft_attention,
                                      sep_token_id=config.sep_token_id, sep_position=config.sep_position)
        s.follow(self.drafter.select_rows, self.drafter.add_rows)

    # -- the loop ------------------------------------------------------------------------------------------------
    def decode(self) -> list[torch.Tensor]:
        s = self.session
        device = s.target.device
        self.prefill(s.target, s.prompts)
        self.last = torch.stack([p[-1] for p in s.prompts]).to(device)                 # x_j, not in the cache
        self.next_pos = torch.tensor([p.shape[0] - 1 for p in s.prompts], device=device)
        self.new_tokens = [p.to(device) for p in s.prompts]                               # drafter's input
        self.generated = [s.prompts[0].new_empty(0, device=device) for _ in range(s.batch_size)]
        self.host_generated: list[list[int]] = [[] for _ in range(s.batch_size)]   # the same, read on the host
        while True:
            if s.admission is not None:   # continuous batching: any cycle boundary is a join point
                self.admit()
            if not s.stats.active:
                break
            self.finish_rows(*self.cycle())
        return self.generated

    def prefill(self, runner, prompts: list[torch.Tensor]) -> None:
        """Store every prompt token but the last of `prompts` (one per row of `runner`) in `runner`'s cache (the
        last is fed with the drafts)."""
        lengths = [p.shape[0] - 1 for p in prompts]
        width = max(lengths)
        if width == 0:
            return
        device = runner.device
        ids, valid, pos = left_pad([p[:-1] for p in prompts], device)
        with runner.timer.span("prefill"):
            runner.forward(ids, pos, causal_mask(width, device), kind="prefill", store_len=width, store_valid=valid,
                           logits_to_keep=1, rows=[n > 0 for n in lengths])

    def admit(self) -> None:
        """Continuous batching, between two cycles: cancelled rows leave; joining rows enter with their prompts
        stored in the target's cache by one prefill of their own (all but the last token, which the next cycle
        feeds with the drafts); the drafter reads their whole prompts in its next forward."""
        s = self.session
        cancelled = s.cancelled_rows()
        if cancelled:
            self.keep_rows([i for i in range(len(s.stats.active)) if i not in set(cancelled)])
        rows = s.joining_rows()
        if not rows:
            return
        first = len(s.stats.active)
        indices = s.add_rows(rows)
        prompts = [s.prompts[i] for i in indices]
        s.target.store_joining_rows(first, lambda runner: self.prefill(runner, prompts))
        device = s.target.device
        self.last = torch.cat([self.last, torch.stack([p[-1] for p in prompts]).to(device)])
        self.next_pos = torch.cat([self.next_pos, torch.tensor([p.shape[0] - 1 for p in prompts], device=device)])
        self.new_tokens = self.new_tokens + [p.to(device) for p in prompts]
        self.generated += [p.new_empty(0, device=device) for p in prompts]
        self.host_generated += [[] for _ in prompts]

    def num_drafts(self) -> tuple[int, torch.Tensor]:
        """k for this cycle (never beyond the budget) and drafts per row `(N,)`: a row one token short of its
        budget drafts nothing and takes one AR step."""
        s = self.session
        per_row = [min(max(s.budget_of(i) - self.generated[i].shape[0] - 1, 0), self.config.block_size)
                   for i in s.stats.active]                                  # on the host: no device read
        return max(per_row, default=0), torch.tensor(per_row, dtype=torch.long, device=s.target.device)

    def cycle(self) -> tuple[list[torch.Tensor], list[list[int]]]:
        """One draft/verify cycle for every active row; returns each row's committed tokens `(n_i,)` and the same
        tokens as read on the host (the cycle's one device read)."""
        s = self.session
        k, per_row = self.num_drafts()
        n = self.last.shape[0]
        if k:
            # The drafter keeps its own device: it reads the ids there, its block logits come back here. It always
            # drafts a whole block of `block_size` masks (full attention inside it: fewer masks would change the
            # first ones' logits), so a row's drafts never depend on the budgets of the other rows in the batch.
            draft_logits = self.drafter.draft(self.new_tokens, self.config.block_size)[:, :k]
            draft_logits = draft_logits.to(self.last.device)                                       # (N, k, V)
            draft_probs = self.draft_sampler.probs(draft_logits)
            drawn = torch.arange(k, device=per_row.device)[None] < per_row[:, None]             # a row's own k
            draft_ids, _ = self.draft_sampler.choose(draft_probs, draw=drawn)                   # (N, k)
        else:
            draft_probs = torch.zeros(n, 0, 1, device=self.last.device)
            draft_ids = self.last.new_zeros(n, 0)
        if s.stream is not None:          # the drafter's proposals, before the target verifies them
            self.stream_draft(self.generated[s.stats.active[0]], draft_ids[0, :int(per_row[0])])
        query = torch.cat([self.last[:, None], draft_ids], dim=1)                              # (N, k + 1)
        positions = self.next_pos[:, None] + torch.arange(k + 1, device=query.device)[None]
        aligned = s.target.forward(query, positions, causal_mask(k + 1, query.device), kind="verify",
                                   store_len=k + 1)
        target_logits = torch.cat([aligned[:, 1:], s.target.carry[:, None]], dim=1)            # (N, k + 1, V)
        target_probs = s.sampler.probs(target_logits)
        rows = torch.arange(n, device=query.device)
        bonus_probs = target_probs[rows, per_row]
        if self.acceptance == "greedy_match":
            result = greedy_match(draft_ids, target_probs[:, :k], num_drafts=per_row, bonus_probs=bonus_probs)
        else:
            if not k:
                draft_probs = target_probs.new_zeros(n, 0, target_probs.shape[-1])
            result = rejection_sample(draft_ids, draft_probs, target_probs[:, :k], num_drafts=per_row,
                                      bonus_probs=bonus_probs, generator=s.sampler.generator)
        accepted = result.num_accepted
        s.target.discard_tail(k - accepted, carry=target_logits[rows, accepted])
        drafted = per_row > 0           # a row without drafts took one plain AR step: a fallback token
        s.stats.observe_verification(rows, per_row, accepted, result.recovered, result.bonus & drafted, width=k)
        s.stats.accumulate("num_fallback_tokens", ~drafted)
        s.stats.accumulate("num_committed_tokens", result.num_tokens)
        read = torch.cat([result.num_tokens[:, None], result.token_ids], dim=1).tolist()   # the cycle's host read
        committed = [result.token_ids[i, :row[0]] for i, row in enumerate(read)]
        self.last = torch.stack([c[-1] for c in committed])
        self.next_pos = self.next_pos + result.num_tokens
        self.new_tokens = committed
        return committed, [row[1:1 + row[0]] for row in read]

    def finish_rows(self, committed: list[torch.Tensor], committed_ids: list[list[int]]) -> None:
        """Append each row's tokens (`committed_ids`: the same on the host), stream, and drop the rows that stop
        (stop id, budget, criteria)."""
        s = self.session
        done = []
        for i, tokens in enumerate(committed):
            prompt_index = s.stats.active[i]
            self.generated[prompt_index] = torch.cat([self.generated[prompt_index], tokens])
            self.host_generated[prompt_index].extend(committed_ids[i])
            done.append(self.should_stop(prompt_index, self.generated[prompt_index], self.host_generated[prompt_index]))
        if s.stream is not None:
            s.stream.push(self.generated[s.stats.active[0]])
        if any(done):
            self.keep_rows([i for i, d in enumerate(done) if not d])

    def keep_rows(self, keep: list[int]) -> None:
        """Keep the batch rows `keep`, in that order (finished or cancelled rows leave)."""
        index = torch.tensor(keep, dtype=torch.long, device=self.last.device)
        self.session.select_rows(index)         # runners, generators, counters, the drafter's own state
        self.last, self.next_pos = self.last[index], self.next_pos[index]
        self.new_tokens = [self.new_tokens[i] for i in keep]
