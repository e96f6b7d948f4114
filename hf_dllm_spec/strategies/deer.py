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

Compiled cycle (issue 34; the static runtime with `compile_config`): a cycle is two compiled functions, each one
forward: :func:`deer_draft_step` (step 1: the drafter stores each row's new committed tokens, left-padded to k + 1
(the first cycle: the prompts, left-padded to a width bucket), and proposes the block) and :func:`deer_verify_step`
(steps 2-4: the target forward, the acceptance rule with the recovered or bonus token, the discard of the rejected
drafts and the new carry, the next cycle's inputs and the cycle's one host read). Near the budget a row verifies
fewer drafts (`num_drafts` as a mask) over the same width k. Seeded, every random number the eager cycle draws is
drawn before the step that uses it, in the eager order, from the call's generators (shared or per row) into fixed
buffers (the drafter's `Exp(1)` noise, then the verification's uniforms and noise), and the steps choose with pure
functions: the eager tokens. A streamer (batch 1) gets the committed tokens and the drafts from the cycle's read.

Greedy DEER reproduces the target's greedy `generate` token for token; with sampling the output follows the
target's distribution exactly (Leviathan et al. 2023; DEER App. E), for any drafter. The drafter only sets the
speed: without D2A alignment (`recipes`, objective ``d2a``) acceptance is low.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import LogitsProcessorList

from ..configuration import DrafterConfig
from .drafting import DRAFT_ATTENTIONS, SEP_POSITIONS, OneStepDrafter, draft_block_layout
from ..maths.masks import causal_mask, left_pad
from ..runtime.static import width_bucket
from ..validation import check_choice, check_int
from ..maths.sampling import RowProcessors, draw_exponential, draw_verification, step_processors
from ..maths.verification import ACCEPTANCE_RULES, greedy_match, rejection_sample
from .base import DecodingStrategy
from .block_diffusion import output_vocab_size


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
            default.
        sep_position (`str`, defaults to "after_masks"): where the SEP token goes, "after_masks" or
            "before_masks".
        draft_block_size: inherited and refused (:attr:`unused_fields`): k is `block_size`, whatever the drafter's
            trained size.

    Raises:
        ValueError: for an out-of-range or unknown value, naming the parameter.
    """

    decoding_strategy: ClassVar[str] = "deer"
    unused_fields: ClassVar[tuple[str, ...]] = ("draft_block_size",)
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
    target_kind = "autoregressive"      # the verifier
    decodes_whole_blocks = False        # k drafts per cycle, never beyond the budget (`num_drafts`)
    per_row_stops = True
    per_row_sampling = True

    @classmethod
    def check_block_sizes(cls, block_size: int, draft_block_size: int | None) -> None:
        """Any k works with any drafter (k is not the drafter's trained block size)."""

    def __init__(self, config: DeerConfig, session) -> None:
        super().__init__(config, session)
        s = session
        self.acceptance = s.resolve_acceptance(config.acceptance)
        self.draft_sampler = s.draft_sampler()
        self.drafter = OneStepDrafter(s.drafter, s.draft_mask_token_id, draft_attention=config.draft_attention,
                                      sep_token_id=config.sep_token_id, sep_position=config.sep_position)
        s.follow(self.drafter.select_rows, self.drafter.add_rows)
        self.compiled = self.runs_compiled_cycle()
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None   # compiled cycle: the drafter's next input
        self._host_tensors: dict[tuple, torch.Tensor] = {}
        self._buffers: dict[tuple, torch.Tensor] = {}      # the compiled steps' random draws, per rows bucket

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
        # The first cycle compiled too, but not without a carry (one-token prompts): the eager cycle then. (A
        # compiled step that would be the first writer of a cache runs eagerly: StaticModelRunner.run_step.)
        if self.compiled:
            self.pending = self.first_input()
        while True:
            if s.admission is not None:   # continuous batching: any cycle boundary is a join point
                self.admit()
            if not s.stats.active:
                break
            self.finish_rows(*(self.compiled_cycle() if self.pending is not None else self.cycle()))
        return self.generated

    def first_input(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The compiled draft step's input when some rows bring their whole prompts (a call's first cycle, the cycle
        after rows join): every row's new tokens left-padded to the prompts' width bucket (at least k + 1); None
        (the eager cycle) while the target has no carry (every prompt one token: nothing was prefilled)."""
        if self.session.target.carry is None:
            return None
        width = max(t.shape[0] for t in self.new_tokens)
        return self.drafter.pad(self.new_tokens, max(self.config.block_size + 1, width_bucket(width)))

    def prefill(self, runner, prompts: list[torch.Tensor]) -> None:
        """Store every prompt token but the last of `prompts` (one per row of `runner`) in `runner`'s cache (the
        last is fed with the drafts)."""
        lengths = [p.shape[0] - 1 for p in prompts]
        width = max(lengths)
        if width == 0:
            return
        device = runner.device
        ids, valid, pos = left_pad([p[:-1] for p in prompts], device)
        rows = [n > 0 for n in lengths]
        with runner.timer.span("prefill"):
            if self.compiled and runner is self.session.target:
                self.compiled_prefill(ids, valid, pos, rows)
            else:
                runner.forward(ids, pos, causal_mask(width, device), kind="prefill", store_len=width,
                               store_valid=valid, logits_to_keep=1, rows=rows)

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
        if self.compiled:                 # the drafter reads the joining rows' whole prompts: a wider first input
            self.pending = self.first_input()

    def num_drafts(self) -> tuple[int, list[int], torch.Tensor]:
        """k for this cycle (never beyond the budget) and drafts per row, on the host and `(N,)` on the device: a
        row one token short of its budget drafts nothing and takes one AR step."""
        per_row = self.host_drafts()
        return (max(per_row, default=0), per_row,
                torch.tensor(per_row, dtype=torch.long, device=self.session.target.device))

    def host_drafts(self) -> list[int]:
        """Drafts per row this cycle, on the host (no device read): k, fewer near the row's budget."""
        s = self.session
        return [min(max(s.budget_of(i) - self.generated[i].shape[0] - 1, 0), self.config.block_size)
                for i in s.stats.active]

    def cycle(self) -> tuple[list[torch.Tensor], list[list[int]]]:
        """One draft/verify cycle for every active row; returns each row's committed tokens `(n_i,)` and the same
        tokens as read on the host (the cycle's one device read)."""
        s = self.session
        k, drafts, per_row = self.num_drafts()
        n = self.last.shape[0]
        if k:
            # The drafter keeps its own device: it reads the ids there, its block logits come back here. It always
            # drafts a whole block of `block_size` masks (full attention inside it: fewer masks would change the
            # first ones' logits), so a row's drafts never depend on the budgets of the other rows in the batch.
            draft_logits = self.drafter.draft(self.new_tokens, self.config.block_size,
                                              rows=[d > 0 for d in drafts])[:, :k]    # counted where it drafts
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
        if self.compiled:                 # the next cycles compile: the drafter's input as a fixed-width buffer
            self.pending = self.drafter.pad(committed, self.config.block_size + 1)
        return committed, [row[1:1 + row[0]] for row in read]

    # -- the cycle as compiled functions (runtime/step.py) ------------------------------------------------------
    def runs_compiled_cycle(self) -> bool:
        """Whether cycles run as compiled functions (:func:`deer_draft_step` or :func:`deer_full_draft_step`, then
        :func:`deer_verify_step`, through `StaticModelRunner.run_step`): the static runtime with `compile_config` on
        both models (a right-shifted target, a position-aligned drafter), either acceptance rule (greedy or seeded:
        the random numbers are drawn before each step, :meth:`draft_noise`, :meth:`verification_draws`), either
        drafter layout ("full": each row's context at its width bucket, :meth:`compiled_draft`), no logits
        processors beyond transformers' list (one for every row) or, in a continuous batch, per-request
        position-independent warpers (:func:`~hf_dllm_spec.maths.sampling.step_processors`), a streamer or none,
        continuous batching (the cycle after rows join reads their whole prompts at their width bucket,
        :meth:`first_input`), a subclass that keeps the cycle's methods. Else the eager cycle. (A call whose
        prompts are all one token runs its first cycle eagerly: nothing was prefilled, the target has no carry.)"""
        s = self.session
        plain = all(type(sampler.logits_processor) in (LogitsProcessorList, list)
                    or (type(sampler.logits_processor) is RowProcessors and step_processors(sampler.logits_processor))
                    for sampler in (s.sampler, self.draft_sampler))
        return (getattr(s.target, "runs_compiled_carry_steps", False)
                and getattr(s.drafter, "runs_compiled_steps", False)
                and plain and type(self.drafter) is OneStepDrafter
                and all(getattr(type(self), name) is getattr(DeerStrategy, name) for name in self.COMPILED_METHODS))

    #: The methods the compiled cycle replaces or relies on; a subclass that overrides one runs the eager cycle.
    COMPILED_METHODS = ("cycle", "compiled_cycle", "compiled_draft", "first_input", "host_drafts", "num_drafts",
                        "draft_noise", "verification_draws")

    @property
    def step_key(self) -> tuple:
        """What DEER's compiled steps specialise on besides their shapes: k, the drafter's block layout and both
        samplers' settings."""
        cfg, drafter = self.config, self.drafter
        return (cfg.block_size, drafter.mask_token_id, drafter.sep_token_id, drafter.sep_position,
                self.acceptance, self.session.sampler.step_key, self.draft_sampler.step_key)

    def host_tensor(self, values: list[int], device: torch.device) -> torch.Tensor:
        """`values` as an int64 tensor on `device`, made once per distinct value (drafts per row change near the
        budget only)."""
        key = (tuple(values), device)
        if key not in self._host_tensors:
            self._host_tensors[key] = torch.tensor(values, dtype=torch.long, device=device)
        return self._host_tensors[key]

    def compiled_prefill(self, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
                         rows: list[bool]) -> None:
        """The target's prefill as a compiled function (:func:`deer_prefill_step`): the left-padded prompts but their
        last tokens `(N, w)` (`valid`, `positions` as :func:`~hf_dllm_spec.maths.masks.left_pad` gives them), padded
        in front to the width bucket of w (one compiled step per bucket), stored; the carry becomes the logits of
        each row's last stored token. Counted as the eager prefill (one forward of kind "prefill" for `rows`)."""
        target = self.session.target
        width = width_bucket(ids.shape[1])
        front = (width - ids.shape[1], 0)
        ids, valid, positions = (torch.nn.functional.pad(t, front) for t in (ids, valid, positions))
        no_carry = ids.new_zeros(ids.shape[0], 1, dtype=torch.float32)    # broadcast: a row storing nothing keeps 0
        target.run_step(deer_prefill_step, self, ("deer-prefill", width), (ids, valid, positions, no_carry),
                        q=width, store_len=width, logits_to_keep=1, kind="prefill", rows=rows, sets_carry=True)

    def buffer(self, name: str, shape: tuple[int, ...], device: torch.device, fill: float = 1.0) -> torch.Tensor:
        """A compiled step's fixed input buffer `shape` (float32, filled with `fill` when made), kept across cycles and
        filled in place (a captured graph reads it at a fixed address); one per name and shape, never a view of a
        larger one (the compiled step would guard on its base)."""
        key = (name, shape, device)
        if key not in self._buffers:
            self._buffers[key] = torch.full(shape, fill, device=device)
        return self._buffers[key]

    def draft_noise(self, drafts: list[int]) -> torch.Tensor | None:
        """When the drafter samples, the random draw of the eager cycle's draft choice, made before the compiled
        drafter step (:func:`~hf_dllm_spec.maths.sampling.categorical_from_noise` then gives its tokens, the
        generators left at the same state): `Exp(1)` noise `(R, k, V)` float32 (`R`: the drafter's
        :attr:`step_rows`). The eager cycle draws the first `max(drafts)` positions of every row with a shared
        generator (one multinomial), row r's first `drafts[r]` positions from its own generator with per-row
        generators (:func:`~hf_dllm_spec.maths.sampling.draw_exponential` with `widths`); the other positions keep
        older noise (their drafts are masked). None when greedy.

        Args:
            drafts (`list[int]`): drafts per row this cycle (:meth:`host_drafts`), on the host.
        """
        sampler, runner = self.draft_sampler, self.session.drafter
        if not sampler.do_sample:
            return None
        noise = self.buffer("draft-noise", (runner.step_rows, self.config.block_size, output_vocab_size(runner.model)),
                            runner.device)
        return draw_exponential(noise, sampler.generator, widths=drafts)

    def verification_draws(self, drafts: list[int]) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """With rejection sampling, every random number the eager cycle's verification draws, drawn before the
        compiled verify step (:func:`~hf_dllm_spec.maths.sampling.draw_verification` with the eager cycle's lengths
        and width `max(drafts)`): uniforms `(R, k)` and `Exp(1)` noise `(R, V)` float32 for the recovered or bonus
        token (`R`: the target's :attr:`step_rows`; columns past `max(drafts)` are unread). `(None, None)` with
        greedy_match.

        Args:
            drafts (`list[int]`): drafts per row this cycle, on the host (read there for per-row generators).
        """
        if self.acceptance != "rejection_sampling":
            return None, None
        s = self.session
        target = s.target
        rows, vocab = target.step_rows, output_vocab_size(target.model)
        uniforms = self.buffer("uniforms", (rows, self.config.block_size), target.device)
        noise = self.buffer("verify-noise", (rows, vocab), target.device)
        draw_verification(self.host_tensor(drafts, torch.device("cpu")), max(drafts), vocab, s.sampler.generator,
                          device=target.device, dtype=torch.float32, out=(uniforms[:, :max(drafts)], noise))
        return uniforms, noise

    def compiled_cycle(self) -> tuple[list[torch.Tensor], list[list[int]]]:
        """One draft/verify cycle as compiled functions: :func:`deer_draft_step` on the drafter (skipped when no
        row drafts), :func:`deer_verify_step` on the target, one host read; the random numbers drawn before each
        step, in the eager cycle's order (:meth:`draft_noise`, :meth:`verification_draws`); counters and the
        streamer's drafts (from the read) as the eager :meth:`cycle`.

        Returns:
            as :meth:`cycle`.
        """
        s, k = self.session, self.config.block_size
        drafts = self.host_drafts()
        device = self.last.device
        per_row = self.host_tensor(drafts, device)
        sampled = self.acceptance == "rejection_sampling"
        if max(drafts):
            draft_ids, *draft_probs = self.compiled_draft(drafts)
            draft_ids = _on(draft_ids, device)
            draft_probs = _on(draft_probs[0], device) if sampled else None
        else:                             # every row one token short of its budget: one AR step, no drafter
            draft_ids = self.last.new_zeros(self.last.shape[0], k)
            draft_probs = (self.buffer("no-draft-probs", (s.target.step_rows, k, output_vocab_size(s.target.model)),
                                       device, fill=0.0) if sampled else None)
        self.last, self.next_pos, new_ids, new_valid, read = s.target.run_step(
            deer_verify_step, self, ("deer-verify", *self.step_key),
            (self.last, self.next_pos, draft_ids, per_row, s.target.carry, draft_probs,
             *self.verification_draws(drafts)),
            q=k + 1, store_len=k + 1, logits_to_keep=k + 1, kind="verify", sets_carry=True)
        self.pending = (_on(new_ids, self.drafter.runner.device), _on(new_valid, self.drafter.runner.device))
        values = read.tolist()                                                   # the cycle's one host read
        if s.stream is not None:          # the drafter's proposals (batch 1), from the read, before the commit
            final = torch.tensor(self.host_generated[s.stats.active[0]], dtype=torch.long)
            self.stream_draft(final, torch.tensor(values[0][5 + k:5 + k + drafts[0]], dtype=torch.long))
        committed, committed_ids = [], []
        for i, (row, drafted) in enumerate(zip(values, drafts)):
            num_tokens, accepted, recovered, bonus = row[:4]
            stats = s.stats.row(i)
            stats.observe_verification(drafted, accepted, bool(recovered), bool(bonus) and drafted > 0)
            stats.num_fallback_tokens += int(drafted == 0)      # a row without drafts took one plain AR step
            stats.num_committed_tokens += num_tokens
            committed_ids.append(row[4:4 + num_tokens])
            committed.append(new_ids[i, k + 1 - num_tokens:])
        self.new_tokens = committed
        return committed, committed_ids

    def compiled_draft(self, drafts: list[int]) -> list[torch.Tensor]:
        """Step 1 of a compiled cycle on the drafter: :func:`deer_draft_step` over the new committed tokens
        (:attr:`pending`; "causal_prefix") or :func:`deer_full_draft_step` over each row's whole context, left-padded
        to its width bucket ("full"). Returns the drafts `(R, k)` and, with rejection sampling, q_theta `(R, k, V)`.
        """
        s, k, drafter = self.session, self.config.block_size, self.drafter
        b = len(draft_block_layout(k, drafter.mask_token_id, drafter.sep_token_id, drafter.sep_position)[0])
        noise = self.draft_noise(drafts)
        drafting = [d > 0 for d in drafts]                                      # counted where it drafts
        if self.config.draft_attention == "full":
            drafter.extend_context(self.new_tokens)
            ids, valid = drafter.pad(drafter.context, width_bucket(max(c.shape[0] for c in drafter.context)))
            m = ids.shape[1]
            return s.drafter.run_step(deer_full_draft_step, self, ("deer-draft-full", m, *self.step_key),
                                      (ids, valid, noise), q=m + b, store_len=0, logits_to_keep=b, kind="draft",
                                      rows=drafting)
        new_ids, new_valid = self.pending
        m = new_ids.shape[1]                      # k + 1 (the first cycle, after a join: a width bucket)
        seen, *out = s.drafter.run_step(deer_draft_step, self, ("deer-draft", m, *self.step_key),
                                        (drafter.lengths, new_ids, new_valid, noise),
                                        q=m + b, store_len=m, logits_to_keep=b, kind="draft",
                                        rows=drafting)
        drafter.lengths = seen
        return out

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
        if s.stream is not None:          # batch 1: the tokens read on the host (no device read)
            s.stream.push(torch.tensor(self.host_generated[s.stats.active[0]], dtype=torch.long))
        if any(done):
            self.keep_rows([i for i, d in enumerate(done) if not d])

    def keep_rows(self, keep: list[int]) -> None:
        """Keep the batch rows `keep`, in that order (finished or cancelled rows leave)."""
        index = torch.tensor(keep, dtype=torch.long, device=self.last.device)
        self.session.select_rows(index)         # runners, generators, counters, the drafter's own state
        self.last, self.next_pos = self.last[index], self.next_pos[index]
        self.new_tokens = [self.new_tokens[i] for i in keep]
        if self.pending is not None:
            rows = index.to(self.pending[0].device)
            self.pending = (self.pending[0][rows], self.pending[1][rows])


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`, without a `.to` call (an operation dispatched per cycle) when it is there already."""
    return tensor if tensor.device == device else tensor.to(device)


def deer_prefill_step(strategy: DeerStrategy, runner, shape: tuple, lengths: torch.Tensor, ids: torch.Tensor,
                      valid: torch.Tensor, positions: torch.Tensor, carry: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The target's prefill (every prompt token but the last, causal, stored) as a function of tensors, what
    `StaticModelRunner.run_step` compiles (`sets_carry`).

    Args:
        ids, valid, positions (`(N, W)`): the left-padded tokens, their real columns and positions.
        carry (`(N, V)` or `(N, 1)` zeros): the carry before them (nothing stored yet).

    Returns:
        `(lengths, carry)`: the write positions after the prefill `(N,)` and the logits of each row's last stored
        token `(N, V)` (`carry` for a row that stores nothing).
    """
    width = ids.shape[1]
    _, lengths, carry = runner.step_forward(shape, ids, positions, causal_mask(width, ids.device), lengths,
                                            store_len=width, store_valid=valid, logits_to_keep=1, carry=carry,
                                            return_carry=True)
    return lengths, carry


def deer_draft_step(strategy: DeerStrategy, runner, shape: tuple, lengths: torch.Tensor, seen: torch.Tensor,
                    new_ids: torch.Tensor, new_valid: torch.Tensor,
                    noise: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Step 1 of a DEER cycle (§3.2, Eq. 5) as a function of tensors, what `StaticModelRunner.run_step` compiles on
    the drafter: one drafter forward stores each row's new committed tokens (left-padded to the fixed width k + 1)
    and reads the block of k masks (:meth:`~hf_dllm_spec.strategies.drafting.OneStepDrafter.block_query`), then the
    drafts y_1..y_k ~ q_theta (the draft sampler's choice: the argmax at T = 0, else the draw from `noise`; the
    drafter's MASK suppressed). Nothing here reads the host or changes Python state.

    Args:
        strategy (`DeerStrategy`), runner (`StaticModelRunner`, the drafter's), shape (`tuple`): as `run_step` passes
            them; lengths (`(N,)` int64): the drafter's write positions.
        seen (`(N,)` int64): committed tokens the drafter stored before this cycle.
        new_ids (`(N, m)` int64), new_valid (`(N, m)` bool): the tokens committed by the last cycle, left-padded to
            m = k + 1 (from :func:`deer_verify_step`); the first cycle: the prompts, left-padded to a width bucket.
        noise (`(N, k, V)` float32, *optional*): when sampling, the draw made beforehand
            (:meth:`DeerStrategy.draft_noise`).

    Returns:
        `(lengths, seen, draft_ids)`: the drafter's new write positions and committed tokens seen `(N,)`, and the
        drafts `(N, k)` int64; with rejection sampling also q_theta, the draft distributions `(N, k, V)` float32.
    """
    drafter, k = strategy.drafter, strategy.config.block_size
    ids, _, slots = draft_block_layout(k, drafter.mask_token_id, drafter.sep_token_id, drafter.sep_position)
    query, positions, intra = drafter.block_query(new_ids, new_valid, seen, k)
    logits, lengths = runner.step_forward(shape, query, positions, intra, lengths, store_len=new_ids.shape[1],
                                          store_valid=new_valid, logits_to_keep=len(ids))
    return (lengths, seen + new_valid.sum(dim=1), *propose_drafts(strategy, logits[:, slots[0]:slots[-1] + 1], noise))


def deer_full_draft_step(strategy: DeerStrategy, runner, shape: tuple, lengths: torch.Tensor, ids: torch.Tensor,
                         valid: torch.Tensor, noise: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Step 1 of a DEER cycle with the "full" drafter layout (DEER App. F) as a function of tensors, what
    `StaticModelRunner.run_step` compiles on the drafter: one drafter forward over each row's whole context and the
    block (:meth:`~hf_dllm_spec.strategies.drafting.OneStepDrafter.full_query`, nothing stored), then the drafts
    as :func:`deer_draft_step` chooses them.

    Args:
        strategy, runner, shape, lengths: as :func:`deer_draft_step` (`lengths` stays: nothing is stored).
        ids (`(N, W)` int64), valid (`(N, W)` bool): each row's context, left-padded to its width bucket W.
        noise (`(N, k, V)` float32, *optional*): as :func:`deer_draft_step`.

    Returns:
        `(lengths, draft_ids)`, with rejection sampling also q_theta: as :func:`deer_draft_step`, without `seen`.
    """
    drafter, k = strategy.drafter, strategy.config.block_size
    slots = draft_block_layout(k, drafter.mask_token_id, drafter.sep_token_id, drafter.sep_position)[2]
    query, positions, intra = drafter.full_query(ids, valid, k)
    logits, lengths = runner.step_forward(shape, query, positions, intra, lengths, logits_to_keep=len(slots))
    return (lengths, *propose_drafts(strategy, logits[:, slots[0]:slots[-1] + 1], noise))


def propose_drafts(strategy: DeerStrategy, logits: torch.Tensor, noise: torch.Tensor | None) -> tuple:
    """The drafts y_1..y_k ~ q_theta from the drafter's block logits `(N, k, V)`: the draft sampler's choice (the
    argmax at T = 0, else the draw from `noise`; the drafter's MASK suppressed). Returns `(draft_ids,)` `(N, k)`,
    with rejection sampling `(draft_ids, draft_probs)` (q_theta `(N, k, V)` float32)."""
    draft_probs = strategy.draft_sampler.probs(logits)
    draft_ids, _ = strategy.draft_sampler.choose(draft_probs, noise=noise)
    return (draft_ids, draft_probs) if strategy.acceptance == "rejection_sampling" else (draft_ids,)


def deer_verify_step(strategy: DeerStrategy, runner, shape: tuple, lengths: torch.Tensor, last: torch.Tensor,
                     next_pos: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor, carry: torch.Tensor,
                     draft_probs: torch.Tensor | None = None, uniforms: torch.Tensor | None = None,
                     noise: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Steps 2-4 of a DEER cycle as a function of tensors, what `StaticModelRunner.run_step` compiles on the target
    (`sets_carry`): one target forward over `[x_j | y_1 .. y_k]` stores all k + 1 tokens and gives p_AR at every
    draft position and the bonus position (the aligned logits after x_j, then the new carry); the acceptance rule
    (greedy_match, or rejection sampling from the draws made beforehand) over each row's `num_drafts` drafts with
    the recovered or bonus token; the rejected drafts are discarded (the write
    positions move back by k - accepted) and the carry becomes the logits of the last kept token; then the next
    cycle's x_j, positions and the drafter's input, and the cycle's read. Nothing here reads the host.

    Args:
        last (`(N,)` int64): x_j, each row's last committed token (not in the target's cache).
        next_pos (`(N,)` int64): its position.
        draft_ids (`(N, k)` int64): the drafts (any value past a row's `num_drafts`).
        num_drafts (`(N,)` int64): drafts each row verifies (k; fewer near its budget).
        carry (`(N, V)`): the target's carry (the logits of each row's last stored token).
        draft_probs (`(N, k, V)` float32), uniforms (`(N, k)`), noise (`(N, V)`), *optional*: rejection sampling's
            draft distributions and its random numbers (:meth:`DeerStrategy.verification_draws`).

    Returns:
        `(lengths, carry, last, next_pos, new_ids, new_valid, read)`: the target's write positions after the discard
        `(N,)`, the new carry `(N, V)`, the next x_j and its position `(N,)`, the committed tokens left-padded to
        k + 1 with their validity `(N, k + 1)` (the drafter's next input), and the read `(N, 4 + k + 1)` int64: per
        row the committed tokens, accepted drafts, whether the last token was recovered or a bonus, then the
        committed tokens (-1 after them).
    """
    k = draft_ids.shape[1]
    device = draft_ids.device
    query = torch.cat([last[:, None], draft_ids], dim=1)                                     # (N, k + 1)
    positions = next_pos[:, None] + torch.arange(k + 1, device=device)[None]
    aligned, lengths, stored_carry = runner.step_forward(shape, query, positions, causal_mask(k + 1, device), lengths,
                                                         store_len=k + 1, carry=carry, return_carry=True)
    target_logits = torch.cat([aligned[:, 1:], stored_carry[:, None]], dim=1)                # (N, k + 1, V)
    target_probs = strategy.session.sampler.probs(target_logits)                             # (N, k + 1, V)
    bonus_probs = target_probs.gather(1, num_drafts[:, None, None].expand(-1, 1, target_probs.shape[-1]))[:, 0]
    if strategy.acceptance == "greedy_match":
        result = greedy_match(draft_ids, target_probs[:, :k], num_drafts=num_drafts, bonus_probs=bonus_probs)
    else:
        result = rejection_sample(draft_ids, draft_probs, target_probs[:, :k], num_drafts=num_drafts,
                                  bonus_probs=bonus_probs, draws=(uniforms, noise))
    accepted, num_tokens = result.num_accepted, result.num_tokens
    lengths = lengths - (k - accepted)                                     # the rejected drafts' columns go
    vocab = target_logits.shape[-1]
    carry = target_logits.gather(1, accepted[:, None, None].expand(-1, 1, vocab))[:, 0]
    source = torch.arange(k + 1, device=device)[None] - (k + 1 - num_tokens)[:, None]        # right-aligned
    new_valid = source >= 0
    new_ids = torch.where(new_valid, result.token_ids.gather(1, source.clamp(min=0)), 0)
    read = torch.cat([torch.stack([num_tokens, accepted, result.recovered.long(), result.bonus.long()], dim=1),
                      result.token_ids, draft_ids], dim=1)
    last = result.token_ids.gather(1, (num_tokens - 1)[:, None])[:, 0]        # the next x_j (stride 1: a guard)
    return lengths, carry, last, next_pos + num_tokens, new_ids, new_valid, read
