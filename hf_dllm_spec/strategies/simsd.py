"""SimSD: a small dLLM drafts a block step by step, a large dLLM of the same family verifies every draft in one forward.

Cui et al., "SimSD: Simple Speculative Decoding in Diffusion Language Models", §3.1 (Eq. 1, position encoding
alignment), §3.2 (Eq. 2), §3.3 (Eq. 3); the reference code (airevo2/SimSD-release) ships no licence, so this is
written from the paper and `strategies.md` §6, whose recommendations it follows where paper and code disagree.

One cycle per row (batched; every row denoises its own block of B positions on the block grid from position 0;
the block's known part, SimSD's "leftover", is the prompt tail plus earlier commits):

1. draft: the drafter denoises ``[known | MASK x n]`` (its cache read-only) until every position is revealed,
   recording the step at which each position was revealed (the step map) and its draft distribution at that
   step. The drafter's schedule is `remasking_strategy` / `steps_per_block` / `confidence_threshold` (the
   published protocols: `low_confidence_static`, one reveal per step);
2. verify: one target forward (cache read-only). `verify_layout="paired"` (the paper): ``[data | mask slots]``
   with the token-level temporal causal mask (:func:`~hf_dllm_spec.maths.masks.temporal_verify_mask`, Eq. 1), mask slot
   k at data position k's RoPE position. `verify_layout="stacked"`: one copy of the block per reveal step, copy s
   holding the block as it was before step s (full attention inside each copy): exact, at s times the query;
3. accept in position order (default, the reference; position order can accept a token whose context held
   drafts to its right, revealed earlier, that are then truncated; `verify_order="temporal"` walks the reveal
   order, the consistent one, and is experimental) with `greedy_match` (default) or rejection sampling
   (min(1, t/d), residual (t - d)+, the target when the residual has no mass); the first rejected position gets
   the target's token. Commit rule `truncate`: committed tokens join the block's known part and the block is
   re-drafted until full. A block with fewer than `min_draft_len` masks left is finished by the target alone,
   one most-confident token per forward (the paper's rule for R < gamma);
4. a full block enters both caches, fused with each model's next forward: caches hold only full committed
   blocks.

Right-shifted families (Fast-dLLM v2) run on the stacked layout only: a right-shifted model predicts position k
from row k - 1, which in the paired layout saw the block as of k - 1's own reveal step; in a stacked copy it saw
the copy's state (the first position of every copy comes from the token before the block).

Exactness (paper §4.3): in the paired layout a mask slot's keys are data rows that saw the block as it was at
*their own* reveal step, so beyond the first layer its logits approximate the separate target forward over the
block state before the slot's step. For a one-layer target they are equal; the stacked layout is equal for any
depth. With an exact layout and one reveal per drafter step (`steps_per_block` unset or B), greedy SimSD with
greedy_match reproduces the target's own block diffusion along the drafter's reveal order: with a left-to-right
drafter (`remasking_strategy="sequential"`, preset `simsd-exact`) that is the target's own sequential block
diffusion, token for token, for any drafter (tested). With several reveals per step, a truncated commit
conditions a position on a neighbour revealed in the same step, which the target's own decoding never does.
Rejection sampling keeps each position's distribution only for left-to-right reveals: a confidence rule picks
positions by their sampled tokens, so the drafter's distribution is not the proposal. Other reveal orders and
the paired layout on deeper targets are approximations: SimSD is not claimed lossless.

Compiled cycle (issue 34; the static runtime with `compile_config` on both models, greedy or seeded, greedy_match
or rejection sampling, either layout): each drafter step is one compiled function on the drafter
(:func:`simsd_draft_step`: forward, unmasking rule, step map, with rejection sampling the drafter's distribution at
each reveal; one host read, the rows still drafting) and verify + commit one compiled function on the target
(:func:`simsd_verify_step`: the paired layout at its full width 2B, which gives the compacted layout's logits, or
the stacked one; the acceptance rule, the EOS gate, the commits and the next blocks; one host read, the cycle's).
The maths are the eager cycle's methods (:meth:`SimSDStrategy.reveal`, :meth:`SimSDStrategy.accept`, ...). Seeded:
every random number the eager cycle draws is drawn before the compiled call that uses it, from the same
generators in the same order, into fixed buffers (the drafter's token draws, :meth:`SimSDStrategy.draft_noise`;
the verification's uniforms and noise, the EOS gate's replacement noise for every row and the target's own draws,
:meth:`SimSDStrategy.verify_draws`), and the steps choose with pure functions of them
(:func:`~hf_dllm_spec.maths.sampling.categorical_from_noise`,
:func:`~hf_dllm_spec.maths.verification.rejection_sample` with `draws`): the eager tokens from the same seeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..configuration import DrafterConfig
from ..maths.masks import full_mask, temporal_verify_mask
from ..maths.sampling import Sampler, draw_exponential, draw_verification, entropy, step_processors
from ..maths.unmasking import first_masked_span, scheduled_tokens, select_transfer
from ..tracing import device_constant, recording_step
from ..validation import check_choice, check_int, check_range, invalid
from ..maths.verification import ACCEPTANCE_RULES, VerificationResult, greedy_match, rejection_sample
from .block_diffusion import (BlockDiffusionConfig, BlockDiffusionStrategy, BlockState, continuing_rows,
                              output_vocab_size, traceable_step_methods)

VERIFY_LAYOUTS = ("paired", "stacked")
VERIFY_ORDERS = ("position", "temporal")


@dataclass
class SimSDConfig(BlockDiffusionConfig, DrafterConfig):
    """SimSD (Cui et al. §3; `strategies.md` §6). Needs `draft_model=`: a diffusion LM of the target's family with
    the same tokenizer, block size and alignment (right-shifted families such as Fast-dLLM v2 need
    `verify_layout="stacked"`).

    Args:
        block_size (`int`, *optional*): B, the block size of both models (`None`: the target's trained one).
        remasking_strategy (`str`, defaults to "low_confidence_static"), steps_per_block (`int`, *optional*),
            confidence_threshold (`float`, defaults to 0.85), eb_threshold (`float`): the drafter's denoising
            schedule (see :class:`BlockDiffusionConfig`); "sequential" reveals left to right (the exact case).
        acceptance (`str`, *optional*): "greedy_match" (the published protocols) or "rejection_sampling"; `None`
            picks greedy_match without sampling and rejection_sampling with `do_sample=True`.
        verify_order (`str`, defaults to "position"): "position" (the reference) or "temporal" (the paper's reveal
            order; experimental).
        verify_layout (`str`, defaults to "paired"): "paired" (the paper's one-pass layout, 2B query tokens) or
            "stacked" (one block copy per reveal step: exact, up to B x B query tokens).
        min_draft_len (`int`, defaults to 1): blocks with fewer masks left are finished by the target alone,
            one most-confident token per forward (1: always draft, the reference; B: the paper's "target finishes
            a short remainder"); at most the block size.
        eos_min_prob (`float`, defaults to 0.0): EOS gate; a stop id that arrives only as the target's correction
            token is replaced by the target's best other token unless the target's own probability of it is at
            least this (0 = off).
        draft_block_size (`int`, *optional*): the drafter's block size; must equal `block_size`.

    `sub_block_size`, `cache_ver`, `draft_ver` and `fuse_cache_write=False` do not apply and are refused.

    Raises:
        ValueError: for an out-of-range or unknown value, naming the parameter.
    """

    decoding_strategy: ClassVar[str] = "simsd"
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        # The published protocols (SimSD §4.1 / reference configs): static confidence, one reveal per step.
        "simsd-paper": {"remasking_strategy": "low_confidence_static", "acceptance": "greedy_match"},
        # Left-to-right drafts verified exactly: greedy output equals the target's sequential block diffusion.
        "simsd-exact": {"remasking_strategy": "sequential", "verify_layout": "stacked"},
        # Fewer drafter forwards: the drafter reveals every position above the threshold per step.
        "simsd-dynamic": {"remasking_strategy": "low_confidence_dynamic", "confidence_threshold": 0.9},
    }

    remasking_strategy: str = "low_confidence_static"
    acceptance: str | None = None
    verify_order: str = "position"
    verify_layout: str = "paired"
    min_draft_len: int = 1
    eos_min_prob: float = 0.0

    def validate(self) -> None:
        BlockDiffusionConfig.validate(self)
        DrafterConfig.validate(self)
        if self.acceptance is not None:
            check_choice("acceptance", self.acceptance, ACCEPTANCE_RULES, "pass acceptance='greedy_match'")
        check_choice("verify_order", self.verify_order, VERIFY_ORDERS, "pass verify_order='position'")
        check_choice("verify_layout", self.verify_layout, VERIFY_LAYOUTS, "pass verify_layout='paired'")
        check_int("min_draft_len", self.min_draft_len, 1, "pass 1 to always draft, or B to let the target finish "
                  "short remainders")
        check_range("eos_min_prob", self.eos_min_prob, low=0.0, high=1.0,
                    fix="pass a probability in [0, 1]; 0 turns the EOS gate off")
        for name, default in (("sub_block_size", None), ("cache_ver", False), ("draft_ver", False),
                              ("fuse_cache_write", True)):
            if getattr(self, name) != default:
                raise invalid(name, getattr(self, name), f"keep its default ({default!r}) for "
                              "decoding_strategy='simsd' (the drafter denoises whole blocks; full blocks are stored "
                              "with each model's next forward)", f"drop `{name}`")


@dataclass
class Drafts:
    """One drafted block per row.

    Attributes:
        tokens (`torch.Tensor` of shape `(N, B)`, int64): the block with every position filled.
        reveal_step (`torch.Tensor` of shape `(N, B)`, int64): the step map: 0 for positions known before drafting,
            1.. for the drafter step that revealed the position (target-only rows: 1 at every masked position).
        probs (`torch.Tensor` of shape `(N, B, V)`, float32): the drafter's processed distribution at each
            position at its reveal step (meaningless where nothing was drafted; `(N, B, 1)` zeros when no row
            drafted).
        drafting (`torch.Tensor` of shape `(N,)`, bool): rows that drafted (the rest are finished by the target).
    """

    tokens: torch.Tensor
    reveal_step: torch.Tensor
    probs: torch.Tensor
    drafting: torch.Tensor

    @property
    def drafted(self) -> torch.Tensor:
        """`(N, B)` bool, positions whose token came from the drafter."""
        return (self.reveal_step > 0) & self.drafting[:, None]


def verification_order(drafted: torch.Tensor, reveal_step: torch.Tensor, order: str) -> torch.Tensor:
    """The order in which each row's drafted positions are verified, drafted positions first.

    Args:
        drafted (`torch.Tensor` of shape `(N, B)`, bool), reveal_step (`torch.Tensor` of shape `(N, B)`, int64).
        order (`str`): "position" (left to right) or "temporal" (by reveal step, then position).

    Returns:
        `torch.Tensor` of shape `(N, B)`, int64: a permutation of 0..B-1 per row.
    """
    width = drafted.shape[1]
    pos = torch.arange(width, device=drafted.device)[None]
    key = pos if order == "position" else reveal_step * width + pos
    key = torch.where(drafted, key, key + (width + 1) * width)          # undrafted positions last
    return key.argsort(dim=1, stable=True)


def compact_paired_layout(ids: torch.Tensor, positions: torch.Tensor, reveal_step: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop the query tokens of the paired layout whose outputs and keys nobody needs, per row.

    Data rows revealed at a row's last step are seen by no mask slot (a slot sees data revealed strictly before
    its own step), and mask slots of known positions are dummies: both go. Rows keep their order; shorter rows are
    padded with tokens that see only themselves (and the cache) and that nobody sees. The mask slots' logits are
    unchanged (the kept rows see exactly the keys they saw in the full layout).

    Args:
        ids, positions (`torch.Tensor` of shape `(N, 2B)`, int64): the full paired layout `[data | mask slots]`.
        reveal_step (`torch.Tensor` of shape `(N, B)`, int64): the step map (0 = known).

    Returns:
        `(ids, positions, intra, slot)`: the compact query `(N, W)`, its visibility `(N, W, W)` bool (Eq. 1 on the
        kept tokens), and `slot` `(N, B)` int64, the compact index of each position's mask slot (0 for known
        positions, whose slot is not read).
    """
    width = reveal_step.shape[1]
    last = reveal_step.max(dim=1, keepdim=True).values
    keep = torch.cat([reveal_step < last, reveal_step > 0], dim=1)                   # (N, 2B)
    kept = int(keep.sum(dim=1).max())
    order = keep.long().argsort(dim=1, descending=True, stable=True)[:, :kept]        # kept first, in layout order
    real = keep.gather(1, order)                                                      # (N, W); False = padding
    full = temporal_verify_mask(reveal_step)
    rows = full.gather(1, order[:, :, None].expand(-1, -1, 2 * width))
    intra = rows.gather(2, order[:, None, :].expand(-1, kept, -1))
    eye = torch.eye(kept, dtype=torch.bool, device=ids.device)
    intra = (intra & real[:, None, :]) | eye
    where = torch.zeros_like(keep, dtype=torch.long).scatter(1, order, torch.arange(kept, device=ids.device)
                                                             .expand_as(order))
    return ids.gather(1, order), positions.gather(1, order), intra, where[:, width:]


def gate_stop_tokens(committed_ids: torch.Tensor, result: VerificationResult, target_probs: torch.Tensor,
                     stop_token_ids: list[int], min_prob: float, sampler: Sampler,
                     draft_probs: torch.Tensor | None = None, noise: torch.Tensor | None = None) -> torch.Tensor:
    """SimSD's EOS gate (`eos_min_prob`, `strategies.md` §6.6): a stop id that arrives only as the correction token
    (after a rejection) while the target gives it less than `min_prob` is replaced by the target's best other
    token (greedy_match) or, with `draft_probs` (rejection sampling), one drawn from the residual (t - d)+
    without the stop ids (the target without them where that residual has no mass).

    Args:
        committed_ids (`torch.Tensor` of shape `(N, L)`, int64): committed tokens in verification order.
        result (`VerificationResult`): the verification that produced them.
        target_probs (`torch.Tensor` of shape `(N, L, V)`): target distributions in the same order.
        stop_token_ids (`list[int]`), min_prob (`float`): the gate.
        sampler (`Sampler`): picks the replacement (argmax, or a draw from its generator).
        draft_probs (`torch.Tensor` of shape `(N, L, V)`, *optional*): the draft distributions (rejection sampling).
        noise (`torch.Tensor` of shape `(N, V)` float32, *optional*): when sampling, the replacement's `Exp(1)` noise,
            drawn beforehand for every row whether the gate fires or not (:meth:`SimSDStrategy.accept`); None draws
            from the sampler's generator here, for the rows where it fires only.

    Returns:
        `torch.Tensor` of shape `(N, L)`, int64.
    """
    rows = torch.arange(committed_ids.shape[0], device=committed_ids.device)
    slot = result.num_accepted.clamp(max=committed_ids.shape[1] - 1)
    probs = target_probs[rows, slot]                                                  # (N, V)
    stop = device_constant(tuple(stop_token_ids), torch.long, probs.device)      # (a capture copies no host list)
    token = committed_ids[rows, slot]
    below = probs.gather(1, token.clamp(min=0)[:, None])[:, 0] < min_prob
    gated = result.recovered & torch.isin(token, stop) & below
    if not recording_step() and not bool(gated.any()):     # (a compiled cycle computes both ways)
        return committed_ids
    other = probs.index_fill(1, stop, 0.0)
    if draft_probs is not None:
        residual = (probs - draft_probs[rows, slot]).clamp_min(0.0).index_fill(1, stop, 0.0)
        other = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, other)
    other = other / other.sum(dim=1, keepdim=True).clamp_min(torch.finfo(other.dtype).tiny)
    replacement, _ = sampler.choose(other, draw=gated, noise=noise)
    out = committed_ids.clone()
    out[rows, slot] = torch.where(gated, replacement, token)
    return out


class SimSDStrategy(BlockDiffusionStrategy):
    """SimSD decoding, batched; see the module docstring and :class:`SimSDConfig`."""

    name = "simsd"
    config_class = SimSDConfig
    paper = "Cui et al., SimSD: Simple Speculative Decoding in Diffusion Language Models (§3, Eq. 1-3)"
    lossless = False
    uses_drafter = True
    requires_draft_mask_token = True
    #: Both models diffusion LMs of one family and one alignment (position-aligned SDAR / LLaDA2, or right-shifted
    #: Fast-dLLM v2, which needs `verify_layout="stacked"`: checked when the strategy starts).
    target_kind = "diffusion"
    drafter_kind = "same_family"
    per_row_stops = False           # the EOS gate (`eos_min_prob`) reads the stop ids
    #: The compiled cycle's masks left in each row's block, on the host (from each cycle's read); None when eager.
    masks_left: list[int] | None = None

    def __init__(self, config: SimSDConfig, session) -> None:
        super().__init__(config, session)
        s = session
        if s.target.alignment == "right_shift" and config.verify_layout == "paired":
            raise invalid("verify_layout", "paired", "be 'stacked' for a right-shifted family (Fast-dLLM v2): a "
                          "right-shifted model predicts position k from row k - 1, which in the paired layout saw the "
                          "block at k - 1's own reveal step", "pass verify_layout='stacked'")
        if config.min_draft_len > self.block_size:
            raise invalid("min_draft_len", config.min_draft_len, f"be at most the block size ({self.block_size})",
                          f"pass min_draft_len={self.block_size} to let the target finish every partial block")
        self.acceptance = s.resolve_acceptance(config.acceptance)
        self.draft_sampler = s.draft_sampler()
        self._draws: dict[tuple, torch.Tensor] = {}     # the compiled cycle's buffers of random numbers (draw_buffer)

    # -- the loop ------------------------------------------------------------------------------------------------
    def decode(self) -> list[torch.Tensor]:
        s, B = self.session, self.block_size
        lengths = torch.tensor([p.shape[0] for p in s.prompts], device=s.target.device)
        aligned = (lengths // B) * B
        self.prefill(aligned)
        self.prefill(aligned.to(s.drafter.device), s.drafter)            # the drafter's ids on its own device
        block = self.first_blocks(aligned)
        blocks_done = [s.prompts[0].new_empty(0) for _ in range(s.batch_size)]    # full blocks, per prompt
        generated = [g.clone() for g in blocks_done]
        host_done: list[list[int]] = [[] for _ in range(s.batch_size)]          # blocks_done, read on the host
        pending: tuple | None = None
        if self.compiled_step:        # each block's masks, known on the host (first blocks: B minus the prompt tail)
            self.masks_left = [B - p.shape[0] % B for p in s.prompts]
        while True:
            if s.admission is not None:   # continuous batching: rows join between two cycles
                block, pending = self.admit(block, pending, blocks_done, generated, host_done)
                if self.masks_left is not None:           # joining rows: their first blocks' masks
                    self.masks_left += [B - s.prompts[p].shape[0] % B for p in s.stats.active[len(self.masks_left):]]
            if not block.tokens.shape[0]:
                break
            if self.compiled_step:
                # 1-3 as compiled functions (the static runtime with `compile_config`), which also prepare step 4's
                # next blocks; the cycle's read comes back from the last one (with a streamer, the drafts too)
                done, read, advanced, proposal = self.compiled_cycle(block, pending)
                if proposal is not None:    # streamed after the read, in the eager cycle's order of calls
                    first_masked, drafts = proposal
                    fixed = read[0][1]
                    known = host_done[s.stats.active[0]] + drafts[fixed:max(first_masked, fixed)]
                    self.stream_draft(_host_tensor(known), _host_tensor(drafts[first_masked:]))
            else:
                drafts = self.draft(block, pending)
                if s.stream is not None:       # the drafter's proposal for the undecided positions, before verify
                    final = torch.cat([blocks_done[s.stats.active[0]], self.final_prefix(block, 0)])
                    self.stream_draft(final, drafts.tokens[0, int(block.first_masked[0]):])
                target_probs = self.session.sampler.probs(self.verify(block, drafts, pending))
                self.commit(block, drafts, target_probs)
                done = ~block.undecided.any(dim=1)
                # the cycle's one host read: which rows finished, each block's committed prefix and its tokens
                read = torch.cat([done[:, None].long(), block.num_fixed[:, None], block.first_masked[:, None],
                                  block.tokens], dim=1).tolist()
            done_rows, finished, streamed = [bool(row[0]) for row in read], [], []
            for i, (is_done, fixed, first_masked, *tokens) in enumerate(read):
                prompt_index, end = s.stats.active[i], max(first_masked, fixed)
                generated[prompt_index] = torch.cat([blocks_done[prompt_index], block.tokens[i, fixed:end]])
                host_ids = host_done[prompt_index] + tokens[fixed:end]
                if i == 0:
                    streamed = host_ids                         # a streamer's row (batch 1), as read on the host
                if is_done:
                    blocks_done[prompt_index], host_done[prompt_index] = generated[prompt_index], host_ids
                if self.should_stop(prompt_index, generated[prompt_index], host_ids):
                    finished.append(i)
            if s.stream is not None:
                s.stream.push(_host_tensor(streamed) if self.compiled_step else generated[s.stats.active[0]])
            if self.compiled_step:
                pending = self.take_next_blocks(block, advanced, done, done_rows, finished)
            else:
                continuing, any_continuing = continuing_rows(done, done_rows, finished)
                pending = (block.tokens.clone(), block.positions, continuing) if any_continuing else None
                block.restart(continuing)
            if finished:
                pending = self.drop_rows(block, done_rows, finished, pending)
        return generated

    def drop_rows(self, block: BlockState, done_rows: list[bool], finished: list[int],
                  pending: tuple | None) -> tuple | None:
        """:meth:`BlockDiffusionStrategy.drop_rows`, the compiled cycle's mask counts following."""
        if self.masks_left is not None:
            gone = set(finished)
            self.masks_left = [m for i, m in enumerate(self.masks_left) if i not in gone]
        return super().drop_rows(block, done_rows, finished, pending)

    def prefill_joining(self, first: int, aligned: torch.Tensor, prompts: list[torch.Tensor]) -> None:
        """Store the joining rows' prompts in the target's and the drafter's caches."""
        super().prefill_joining(first, aligned, prompts)
        drafter = self.session.drafter
        drafter.store_joining_rows(first, lambda runner: self.prefill(aligned.to(drafter.device), runner, prompts))

    # -- 1. draft ------------------------------------------------------------------------------------------------
    def draft(self, block: BlockState, pending: tuple | None) -> Drafts:
        """Let the drafter denoise every row's block until full, recording the step map (read-only cache; the
        first forward also stores `pending` blocks). Rows below `min_draft_len` masks skip drafting."""
        s, cfg = self.session, self.config
        num_masks = block.undecided.sum(dim=1)                                          # (N,)
        drafting = num_masks >= cfg.min_draft_len
        undecided = block.undecided & drafting[:, None]
        tokens = block.tokens.clone()
        reveal_step = torch.zeros_like(tokens)
        probs_at_reveal: torch.Tensor | None = None
        step = 0
        while True:
            still = undecided.any(dim=1)
            still_rows = still.tolist()                           # the drafter step's one host read
            if not any(still_rows):
                break
            ids = torch.where(undecided, s.draft_mask_token_id, tokens)
            logits = self.drafter_forward(ids, block.positions, full_mask(self.block_size, ids.device), pending,
                                          kind="draft", rows=still_rows)
            pending = None
            tokens, undecided, reveal_step, transfer, probs = self.reveal(
                logits, tokens, undecided, reveal_step, num_masks, torch.full_like(num_masks, step), still)
            step += 1
            probs_at_reveal = probs if probs_at_reveal is None else torch.where(transfer[..., None], probs,
                                                                               probs_at_reveal)
            s.stats.accumulate("num_denoising_steps", still.long())
        if pending is not None:                       # nothing drafted this cycle: store the blocks on their own
            self.drafter_forward(block.tokens, block.positions, full_mask(self.block_size, block.tokens.device),
                                 pending, kind="cache_write")
        if probs_at_reveal is None:
            probs_at_reveal = torch.zeros(*tokens.shape, 1, device=tokens.device)
        return self.with_target_alone(block.undecided, Drafts(tokens, reveal_step, probs_at_reveal, drafting))

    def with_target_alone(self, undecided: torch.Tensor, drafts: Drafts) -> Drafts:
        """`drafts` whose rows that did not draft (`drafts.drafting` false) read the target at every masked position
        of `undecided` `(N, B)`: step 1, MASK in the verified block (a function of tensors)."""
        target_only = undecided & ~drafts.drafting[:, None]
        return Drafts(torch.where(target_only, self.session.mask_token_id, drafts.tokens),
                      torch.where(target_only, 1, drafts.reveal_step), drafts.probs, drafts.drafting)

    def reveal(self, logits: torch.Tensor, tokens: torch.Tensor, undecided: torch.Tensor, reveal_step: torch.Tensor,
               num_masks: torch.Tensor, step: torch.Tensor, still: torch.Tensor,
               noise: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """One drafter step's maths (a function of tensors): the drafter's distribution, its choice and the
        drafter's unmasking rule (`remasking_strategy` over the `steps_per_block` schedule of the row's masks).

        Args:
            logits (`(N, B, V)`): the drafter's logits for the block; tokens, undecided, reveal_step (`(N, B)`): the
                draft so far, its masks and its step map; num_masks (`(N,)`): masks the draft started with; step
                (`(N,)`): drafter steps taken; still (`(N,)` bool): rows still drafting (the positions they draw).
            noise (`(N, B, V)` float32, *optional*): when the drafter samples, the draw made before the step
                (:meth:`draft_noise`, a compiled step); None draws here.

        Returns:
            `(tokens, undecided, reveal_step, transfer, probs)`: the draft, masks and step map after this step
            (revealed positions get step + 1), the revealed positions `(N, B)` bool and the drafter's processed
            distribution `(N, B, V)`.
        """
        cfg = self.config
        probs = self.draft_sampler.probs(logits)
        chosen, confidence = self.draft_sampler.choose(probs, draw=still[:, None].expand_as(undecided), noise=noise)
        transfer = select_transfer(
            cfg.remasking_strategy, masked=undecided, confidence=confidence,
            num_tokens=scheduled_tokens(num_masks.clamp(min=1), self.steps_per_block, step),
            confidence_threshold=cfg.confidence_threshold, eb_threshold=cfg.eb_threshold,
            entropies=entropy(probs) if cfg.remasking_strategy == "entropy_bounded" else None,
        )
        return (torch.where(transfer, chosen, tokens), undecided & ~transfer,
                torch.where(transfer, step[:, None] + 1, reveal_step), transfer, probs)

    def drafter_forward(self, ids: torch.Tensor, positions: torch.Tensor, intra: torch.Tensor, pending: tuple | None,
                        *, kind: str, rows=None) -> torch.Tensor:
        """:meth:`forward_with_pending` on the drafter, which keeps its own device and dtype: `ids` / `positions`
        `(N, q)`, `intra` and the `pending` blocks go to the drafter's execution device, the logits `(N, q, V)`
        float32 come back to the target's (where they are sampled and compared); no-ops on one device. The
        drafter's cache stays where its layers run."""
        s = self.session
        device = s.drafter.device
        if pending is not None:
            pending = tuple(t.to(device) for t in pending)
        logits = self.forward_with_pending(s.drafter, ids.to(device), positions.to(device), intra.to(device), pending,
                                           kind=kind, rows=rows)
        return logits.to(s.target.device)

    # -- 2. verify -----------------------------------------------------------------------------------------------
    def verify(self, block: BlockState, drafts: Drafts, pending: tuple | None) -> torch.Tensor:
        """One target forward; returns the target logits for every block position, `(N, B, V)`, each read where
        that position is still masked in the block state before its reveal step."""
        s, B = self.session, self.block_size
        if self.config.verify_layout == "paired":
            ids, positions = self.paired_query(drafts.tokens, block.positions)
            ids, positions, intra, slot = compact_paired_layout(ids, positions, drafts.reveal_step)
            logits = self.forward_with_pending(s.target, ids, positions, intra, pending, kind="verify",
                                               rows=self.count_target_alone(drafts))
            return logits.gather(1, slot[..., None].expand(-1, -1, logits.shape[-1]))
        ids, positions, intra = self.stacked_query(drafts, block.positions, int(drafts.reveal_step.max()))
        logits = self.forward_with_pending(s.target, ids, positions, intra, pending, kind="verify",
                                           rows=self.count_target_alone(drafts))
        if s.target.alignment == "right_shift":
            # Position 0 of a copy is predicted from the token before the block (the carry, or the last token of the
            # block stored in this forward), identical for every copy; the runner's shift would read the previous
            # copy's last row, so every copy takes copy 1's.
            logits = logits.clone()
            logits[:, B::B] = logits[:, :1]
        return self.stacked_logits(logits, drafts.reveal_step)

    def stacked_query(self, drafts: Drafts, positions: torch.Tensor,
                      num_copies: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stacked layout: copy s = 1..`num_copies` holds the block as it was before reveal step s (full
        attention inside each copy, copies apart). Returns ids and positions `(N, S * B)` and the block-diagonal
        visibility `(S * B, S * B)` bool; copies past a row's last step are complete blocks nobody reads."""
        B, device = self.block_size, positions.device
        copy = torch.arange(1, num_copies + 1, device=device)[None, :, None]           # (1, S, 1)
        before = drafts.reveal_step[:, None, :] < copy                                  # (N, S, B) known at copy s
        ids = torch.where(before, drafts.tokens[:, None, :], self.session.mask_token_id).reshape(-1, num_copies * B)
        copy_of = torch.arange(num_copies * B, device=device) // B
        return ids, positions.repeat(1, num_copies), copy_of[:, None] == copy_of[None, :]

    def stacked_logits(self, logits: torch.Tensor, reveal_step: torch.Tensor) -> torch.Tensor:
        """The stacked layout's logits `(N, S * B, V)` read per block position at the copy of its reveal step,
        `(N, B, V)`."""
        B = self.block_size
        index = (reveal_step - 1).clamp(min=0) * B + torch.arange(B, device=logits.device)[None]
        return logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))

    @property
    def verify_width(self) -> int:
        """The compiled verify step's query width: 2B (paired) or S x B (stacked, S = the most drafter steps a
        block can take: `steps_per_block`, each step revealing at least its scheduled count)."""
        B = self.block_size
        return 2 * B if self.config.verify_layout == "paired" else min(self.steps_per_block, B) * B

    def paired_query(self, draft_tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The paired layout `[data | mask slots]` (SimSD §3.1): ids and RoPE positions `(N, 2B)` each, mask slot k
        at data position k's position; its visibility is :func:`~hf_dllm_spec.maths.masks.temporal_verify_mask`."""
        ids = torch.cat([draft_tokens, torch.full_like(draft_tokens, self.session.mask_token_id)], dim=1)
        return ids, torch.cat([positions, positions], dim=1)

    def count_target_alone(self, drafts: Drafts) -> torch.Tensor | None:
        """Rows that did not draft use this target forward as a plain denoising step: count it as one (a draft
        forward and a denoising step) and return the rows the verify counter serves (None: all)."""
        if self.config.min_draft_len == 1:
            return None                                   # every block with a mask drafts
        s = self.session
        for i, drafting in enumerate(drafts.drafting.tolist()):
            if not drafting:
                s.stats.row(i).count_forward("draft")
                s.stats.row(i).num_denoising_steps += 1
        return drafts.drafting

    # -- 3. accept and commit ------------------------------------------------------------------------------------
    def commit(self, block: BlockState, drafts: Drafts, target_probs: torch.Tensor) -> None:
        """Accept drafts (position or temporal order), commit them and the correction token into `block`; rows
        that did not draft commit the target's most confident masked position."""
        n = block.tokens.shape[0]
        block.tokens, block.undecided, result, num_drafts, alone = self.accept(block.tokens, block.undecided, drafts,
                                                                               target_probs)
        s = self.session
        rows = torch.arange(n, device=block.tokens.device)
        s.stats.observe_verification(rows, num_drafts, result.num_accepted, result.recovered,
                                     torch.zeros_like(result.recovered))
        s.stats.accumulate("num_fallback_tokens", alone.sum(dim=1))
        s.stats.accumulate("num_committed_tokens", result.num_tokens + alone.sum(dim=1))

    def accept(self, tokens: torch.Tensor, undecided: torch.Tensor, drafts: Drafts, target_probs: torch.Tensor,
               draws: tuple[torch.Tensor, torch.Tensor] | None = None, noise: torch.Tensor | None = None,
               gate_noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, VerificationResult,
                                                                torch.Tensor, torch.Tensor]:
        """Step 3 as a function of tensors (no host read under greedy_match but the EOS gate's early exit, which a
        compiled cycle skips): the verification in `verify_order`, the EOS gate, the commits.

        Random numbers, sampling, in this order: rejection sampling's (`draws`), the EOS gate's replacement noise
        for every row (when the gate is on: drawn whether it fires or not, so that the amount drawn does not depend
        on the verification and a compiled cycle draws it before its step), the target's tokens for the rows
        finished alone (`noise`).

        Args:
            tokens, undecided (`(N, B)`): the block before this cycle's commits.
            drafts (`Drafts`): this cycle's drafts; target_probs (`(N, B, V)`): the target's distribution per block
                position (:meth:`verify`).
            draws (`tuple`, *optional*): rejection sampling's random numbers, drawn before the step
                (:meth:`verify_draws`, a compiled step); None draws them here.
            noise (`(N, B, V)` float32, *optional*): when sampling with `min_draft_len > 1`, the draw of the target's
                tokens for the rows finished alone, made before the step; None draws here.
            gate_noise (`(N, V)` float32, *optional*): when sampling with the EOS gate, its replacement's noise made
                before the step (:func:`gate_stop_tokens`); None draws here.

        Returns:
            `(tokens, undecided, result, num_drafts, alone)`: the block after the commits, the verification (in
            verification order), drafted positions per row `(N,)`, and the positions the target committed alone
            `(N, B)` bool (rows below `min_draft_len`).
        """
        s = self.session
        drafted = drafts.drafted
        order = verification_order(drafted, drafts.reveal_step, self.config.verify_order)       # (N, B)
        num_drafts = drafted.sum(dim=1)
        vocab = target_probs.shape[-1]
        draft_ids = drafts.tokens.gather(1, order)
        target_ordered = target_probs.gather(1, order[..., None].expand(-1, -1, vocab))
        draft_ordered = None
        if self.acceptance == "greedy_match":
            result = greedy_match(draft_ids, target_ordered, num_drafts=num_drafts)
        else:
            draft_probs = drafts.probs.expand(-1, -1, vocab) if drafts.probs.shape[-1] == 1 else drafts.probs
            draft_ordered = draft_probs.gather(1, order[..., None].expand(-1, -1, vocab))
            result = rejection_sample(draft_ids, draft_ordered, target_ordered, num_drafts=num_drafts,
                                      generator=s.sampler.generator, draws=draws)
        committed_ids = result.token_ids[:, : order.shape[1]]
        if self.config.eos_min_prob > 0 and s.stop_token_ids:
            if s.sampler.do_sample and gate_noise is None:
                gate_noise = s.sampler.draw_noise(target_probs.new_empty(tokens.shape[0], vocab), tokens.shape[0])
            committed_ids = gate_stop_tokens(committed_ids, result, target_ordered, s.stop_token_ids,
                                             self.config.eos_min_prob, s.sampler, draft_probs=draft_ordered,
                                             noise=gate_noise)
        in_order = torch.arange(order.shape[1], device=order.device)[None] < result.num_tokens[:, None]
        commit = torch.zeros_like(in_order).scatter(1, order, in_order)
        values = torch.zeros_like(tokens).scatter(1, order, committed_ids.clamp(min=0))
        # rows finished by the target alone: its most confident masked position, one token per forward
        alone = torch.zeros_like(commit)
        if self.config.min_draft_len > 1:
            target_ids, confidence = s.sampler.choose(target_probs, noise=noise)
            alone = select_transfer("low_confidence_static", masked=undecided & ~drafts.drafting[:, None],
                                    confidence=confidence, num_tokens=1)
            values = torch.where(alone, target_ids, values)
        return (torch.where(commit | alone, values, tokens), undecided & ~commit & ~alone, result, num_drafts, alone)

    # -- the cycle as compiled functions (runtime/step.py) -------------------------------------------------------
    #: The methods a compiled cycle runs; a subclass that overrides one of them runs the eager cycle, unless the
    #: class defining the override says `traceable_step = True` in its own body.
    COMPILED_CYCLE_METHODS = ("reveal", "with_target_alone", "paired_query", "stacked_query", "stacked_logits",
                              "accept", "with_pending", "store_mask")
    traceable_step = True

    def runs_compiled_step(self) -> bool:
        """Whether each cycle runs as compiled functions (:func:`simsd_draft_step` per drafter step on the
        drafter, then :func:`simsd_verify_step` on the target, through `StaticModelRunner.run_step`; one host read
        each): the static runtime with `compile_config` for both models on one device, position-aligned; greedy or
        sampled (`do_sample=True`, a shared generator or one per row: every random number the eager cycle draws is
        drawn before the compiled call that uses it, in the eager order, :meth:`draft_noise` /
        :meth:`verify_draws`), greedy_match or rejection sampling, with transformers' position-independent
        processors (per-request ones of a continuous batch too, :func:`~hf_dllm_spec.maths.sampling.
        step_processors`); either layout (the stacked one at its most copies, `steps_per_block`), either verification
        order, any `min_draft_len`, the EOS gate (sampling: its replacement's noise drawn for every row before the
        step, :meth:`accept`); any drafter schedule; continuous batching; a streamer (batch 1: the committed tokens
        and the drafter's proposal from the cycle's read, :meth:`compiled_cycle`); a class whose cycle methods are
        traceable (:data:`COMPILED_CYCLE_METHODS`). Else the eager cycle. Called by the block-diffusion constructor
        (config and session only)."""
        s = self.session
        return (getattr(s.target, "runs_compiled_steps", False) and getattr(s.drafter, "runs_compiled_steps", False)
                and s.drafter.device == s.target.device
                and step_processors(s.sampler.logits_processor)
                and traceable_step_methods(type(self), self.COMPILED_CYCLE_METHODS))

    @property
    def step_key(self) -> tuple:
        """What SimSD's compiled functions specialise on besides their shapes: the drafter's rule (the
        block-diffusion key), the drafter's sampler and mask, the acceptance rule, the layout, the verification
        order, `min_draft_len`, the EOS gate and whether a streamer reads the drafts (a wider read)."""
        s, cfg = self.session, self.config
        return (*super().step_key, "simsd", s.draft_mask_token_id, self.draft_sampler.step_key, self.acceptance,
                cfg.verify_layout, cfg.verify_order, s.stream is not None, cfg.min_draft_len, cfg.eos_min_prob,
                tuple(s.stop_token_ids) if cfg.eos_min_prob > 0 else ())

    def draw_buffer(self, name: str, runner, shape: tuple[int, ...]) -> torch.Tensor:
        """A compiled cycle's fixed buffer `(R, *shape)` float32 for random numbers drawn before a step, `R` the
        `runner`'s :attr:`step_rows` (rows past the batch are padding); one per name and `R`, kept across cycles (a
        captured graph reads it at a fixed address), filled in place."""
        key = (name, runner.step_rows)
        if key not in self._draws:
            self._draws[key] = torch.ones(runner.step_rows, *shape, device=runner.device)
        return self._draws[key]

    def draft_noise(self, rows: list[bool]) -> torch.Tensor | None:
        """When the drafter samples, one compiled drafter step's random draw, made before it: the `Exp(1)` noise
        `(R, B, V)` of the multinomial :meth:`reveal` draws over every row's block (a shared generator: every row,
        one call; per-row generators: the `rows` still drafting, each from its own, as the eager draft draws);
        :func:`~hf_dllm_spec.maths.sampling.categorical_from_noise` gives its tokens in the step. None when
        greedy."""
        s = self.session
        if not self.draft_sampler.do_sample:
            return None
        noise = self.draw_buffer("draft", s.drafter, (self.block_size, output_vocab_size(s.drafter.model)))
        widths = [self.block_size if drafting else 0 for drafting in rows]
        return draw_exponential(noise, self.draft_sampler.generator, widths=widths)

    def verify_draws(self, num_drafts: list[int]) -> tuple:
        """The compiled verify step's random numbers, drawn before it in the eager order (:meth:`accept`): with
        rejection sampling the uniforms `(R, B)` and `Exp(1)` noise `(R, V)` of
        :func:`~hf_dllm_spec.maths.sampling.draw_verification` (`num_drafts`: each row's drafts, known on the host:
        per-row generators draw that many uniforms); then, sampling, the EOS gate's replacement noise `(R, V)` when
        the gate is on, and the noise `(R, B, V)` of the target's token draw for the rows finished alone when
        `min_draft_len > 1`. Returns `(uniforms, noise, gate noise, alone noise)`, None where nothing is drawn."""
        s, B = self.session, self.block_size
        target = s.target
        if self.acceptance != "rejection_sampling":              # greedy: nothing (sampling verifies by rejection)
            return None, None, None, None
        vocab = output_vocab_size(target.model)
        uniforms, noise = self.draw_buffer("uniforms", target, (B,)), self.draw_buffer("verify", target, (vocab,))
        draw_verification(torch.tensor(num_drafts), B, vocab, s.sampler.generator, device=target.device,
                          dtype=torch.float32, out=(uniforms, noise))          # their first N rows, in place
        gate = alone = None
        if s.sampler.do_sample and self.config.eos_min_prob > 0 and s.stop_token_ids:
            gate = s.sampler.draw_noise(self.draw_buffer("gate", target, (vocab,)), len(num_drafts))
        if s.sampler.do_sample and self.config.min_draft_len > 1:
            alone = s.sampler.draw_noise(self.draw_buffer("alone", target, (B, vocab)), len(num_drafts))
        return uniforms, noise, gate, alone

    def compiled_cycle(self, block: BlockState,
                       pending: tuple | None) -> tuple[torch.Tensor, list, tuple, tuple | None]:
        """One cycle of every row as compiled functions: :func:`simsd_draft_step` until no row has a mask left in
        its draft (the first call also stores `pending` in the drafter's cache; each call's read is its rows still
        drafting), then :func:`simsd_verify_step` (the verify forward, storing `pending` in the target's cache,
        greedy_match, the commits, the done flags, the next blocks and the cycle's read); updates `block` and the
        counters as the eager cycle does.

        Returns:
            `(done, read, advanced, proposal)`: `(N,)` bool; per row `[done, num_fixed, first_masked, *block
            tokens]`; the next blocks for :meth:`take_next_blocks`; with a streamer (batch 1) `(first masked
            position before the commits, the drafted block's tokens)` from the same read, else None.
        """
        s, B = self.session, self.block_size
        drafting = [count >= self.config.min_draft_len for count in self.masks_left]     # on the host
        # with min_draft_len > 1 always a tensor (a None in some cycles would be a second graph of the verify key)
        flags = (None if self.config.min_draft_len == 1
                 else torch.tensor(drafting, device=block.tokens.device))
        store = pending is not None
        stored = pending if store else (None, None, None)
        tokens, step = block.tokens, torch.zeros_like(block.start)
        undecided = block.undecided if flags is None else block.undecided & flags[:, None]
        reveal_step = torch.zeros_like(tokens)
        sampled = self.acceptance == "rejection_sampling"     # the drafts' distributions are verified too
        draft_probs = (torch.zeros(*tokens.shape, output_vocab_size(s.drafter.model), device=tokens.device)
                       if sampled else None)
        still = drafting                       # every block has a mask when a cycle starts
        while any(still):
            tokens, undecided, reveal_step, step, read, *probs = s.drafter.run_step(
                simsd_draft_step, self, ("simsd-draft", *self.step_key),
                (tokens, undecided, reveal_step, step, block.start, *stored, self.draft_noise(still), draft_probs),
                q=2 * B if store else B, store_len=B if store else 0, logits_to_keep=B, kind="draft", rows=still)
            draft_probs = probs[0] if sampled else None
            for i in (i for i, flag in enumerate(still) if flag):
                s.stats.row(i).num_denoising_steps += 1
            still = [bool(flag) for flag in read.tolist()]      # the drafter step's one host read
            stored, store = (None, None, None), False
        if store:                                 # nothing drafted this cycle: store the blocks on their own
            self.drafter_forward(block.tokens, block.positions, full_mask(B, block.tokens.device), pending,
                                 kind="cache_write")
        for i in (i for i, d in enumerate(drafting) if not d):    # the verify forward is their denoising step
            s.stats.row(i).count_forward("draft")
            s.stats.row(i).num_denoising_steps += 1
        if tokens is block.tokens:            # no row drafted: two arguments, one tensor (a guard would fail)
            tokens = tokens.clone()
        draws = self.verify_draws([m if d else 0 for m, d in zip(self.masks_left, drafting)])
        tokens, undecided, done, read, *advanced = s.target.run_step(
            simsd_verify_step, self, ("simsd-verify", *self.step_key),
            (block.tokens, block.undecided, block.start, block.num_fixed, block.step, block.post_steps, tokens,
             reveal_step, flags, *(pending if pending is not None else (None, None, None)), draft_probs, *draws),
            q=self.verify_width + (B if pending is not None else 0), store_len=B if pending is not None else 0,
            logits_to_keep=B if self.config.verify_layout == "paired" else self.verify_width, kind="verify",
            rows=None if flags is None else drafting)
        rows = read.tolist()                                    # the verify step's one host read
        proposal = None
        if s.stream is not None:                       # its last columns: the drafts the eager cycle streams
            proposal = rows[0][-(B + 1)], rows[0][-B:]
            for row in rows:
                del row[-(B + 1):]
        for i, row in enumerate(rows):
            num_drafts, accepted, recovered, committed, alone, self.masks_left[i] = row[-6:]
            stats = s.stats.row(i)
            stats.observe_verification(num_drafts, accepted, bool(recovered), False)
            stats.num_fallback_tokens += alone
            stats.num_committed_tokens += committed + alone
            del row[-6:]
        block.tokens, block.undecided = tokens, undecided
        return done, rows, tuple(advanced), proposal


def _host_tensor(ids: list[int]) -> torch.Tensor:
    """Token ids read on the host as a CPU int64 tensor `(n,)` (what a streamer is given, no device read)."""
    return torch.tensor(ids, dtype=torch.long)


def simsd_draft_step(strategy: SimSDStrategy, runner, shape: tuple, lengths: torch.Tensor, tokens: torch.Tensor,
                     undecided: torch.Tensor, reveal_step: torch.Tensor, step: torch.Tensor, start: torch.Tensor,
                     pending_tokens: torch.Tensor | None = None, pending_positions: torch.Tensor | None = None,
                     pending_rows: torch.Tensor | None = None, noise: torch.Tensor | None = None,
                     draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """One drafter step of SimSD's draft (§3.2, step 1) as a function of tensors, what `StaticModelRunner.run_step`
    compiles on the drafter: the drafter's forward over `[draft | MASK where undecided]` (full attention inside
    the block, the cache read-only; the pending finished blocks stored first), then :meth:`SimSDStrategy.reveal`.
    Nothing here reads the host or changes Python state.

    Args:
        strategy (`SimSDStrategy`), runner (`StaticModelRunner`, the drafter's), shape (`tuple`), lengths (`(N,)`):
            from `run_step`.
        tokens, undecided, reveal_step (`(N, B)`): the draft so far, its masks, its step map (0 = not revealed in
            this cycle); step (`(N,)`): drafter steps taken this cycle; start (`(N,)`): each block's first position.
        pending_tokens, pending_positions (`(N, B)`), pending_rows (`(N,)` bool): the finished blocks to store, or
            None.
        noise (`(N, B, V)` float32, *optional*): when the drafter samples, this step's draw
            (:meth:`SimSDStrategy.draft_noise`).
        draft_probs (`(N, B, V)` float32, *optional*): with rejection sampling, the drafter's distribution at each
            position's reveal step so far (zeros before the first step).

    Returns:
        `(lengths, tokens, undecided, reveal_step, step, still[, draft_probs])`: the drafter's new write positions,
        the draft, its masks and step map after this step, `step + 1`, the rows with a mask left `(N,)` bool (the
        read), and with `draft_probs` the distributions updated at the positions this step revealed.
    """
    B = strategy.block_size
    positions = start[:, None] + torch.arange(B, device=start.device)[None]
    still = undecided.any(dim=1)
    num_masks = undecided.sum(dim=1) + (reveal_step > 0).sum(dim=1)            # the masks the draft started with
    ids = torch.where(undecided, strategy.session.draft_mask_token_id, tokens)
    pending = None if pending_tokens is None else (pending_tokens, pending_positions, pending_rows)
    ids, positions, intra, store_len, store_valid = strategy.with_pending(ids, positions, full_mask(B, ids.device),
                                                                          pending)
    logits, lengths = runner.step_forward(shape, ids, positions, intra, lengths, store_len=store_len,
                                          store_valid=store_valid, logits_to_keep=B)
    tokens, undecided, reveal_step, transfer, probs = strategy.reveal(logits, tokens, undecided, reveal_step,
                                                                      num_masks, step, still, noise)
    outputs = (lengths, tokens, undecided, reveal_step, step + 1, undecided.any(dim=1))
    if draft_probs is None:
        return outputs
    return (*outputs, torch.where(transfer[..., None], probs, draft_probs))


def simsd_verify_step(strategy: SimSDStrategy, runner, shape: tuple, lengths: torch.Tensor, tokens: torch.Tensor,
                      undecided: torch.Tensor, start: torch.Tensor, num_fixed: torch.Tensor, step: torch.Tensor,
                      post_steps: torch.Tensor, draft_tokens: torch.Tensor, reveal_step: torch.Tensor,
                      drafting: torch.Tensor | None = None, pending_tokens: torch.Tensor | None = None,
                      pending_positions: torch.Tensor | None = None, pending_rows: torch.Tensor | None = None,
                      draft_probs: torch.Tensor | None = None, uniforms: torch.Tensor | None = None,
                      noise: torch.Tensor | None = None, gate_noise: torch.Tensor | None = None,
                      alone_noise: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """SimSD's verify and commit (§3.1-3.3, steps 2-3) as a function of tensors, what `StaticModelRunner.run_step`
    compiles on the target: one target forward over the paired layout at its full width 2B (every row's data and
    mask slots, Eq. 1's :func:`~hf_dllm_spec.maths.masks.temporal_verify_mask`; the pending finished blocks stored
    first), greedy_match over each row's drafts (:meth:`SimSDStrategy.accept`, with the EOS gate), the commits,
    the done flags, the cycle's read and the next blocks.

    The full width gives the compacted layout's logits (:func:`compact_paired_layout`): the tokens it drops (mask
    slots of known positions, data rows of a row's last reveal step) are keys of no mask slot and of no kept data
    row, so every mask slot attends over the same keys with the same values.

    Args:
        tokens, undecided, start, num_fixed, step, post_steps: the :class:`BlockState` fields before this cycle's
            commits, `(N, B)` / `(N,)`.
        draft_tokens, reveal_step (`(N, B)`): the drafted block and its step map (:func:`simsd_draft_step`).
        drafting (`(N,)` bool, *optional*): the rows that drafted (None: all); the others are finished by the target
            alone (`min_draft_len`).
        pending_tokens, pending_positions (`(N, B)`), pending_rows (`(N,)` bool): the finished blocks to store, or
            None.
        draft_probs (`(N, B, V)` float32, *optional*): rejection sampling: the drafter's distributions
            (:func:`simsd_draft_step`). uniforms (`(N, B)`), noise (`(N, V)`), gate_noise (`(N, V)`), alone_noise
            (`(N, B, V)`), *optional*: the random numbers drawn before the step
            (:meth:`SimSDStrategy.verify_draws`).

    Returns:
        `(lengths, tokens, undecided, done, read, *next, positions)`: the target's new write positions; the block
        after the commits `(N, B)`; the finished rows `(N,)`; the read `(N, 9 + B)` int64, per row `[done,
        num_fixed, first_masked, *block tokens, drafts, accepted, recovered, committed, committed by the target
        alone, masks of the next cycle's block]` (with a streamer then `[first masked position before the commits,
        *drafted block]`); the next blocks (every
        :attr:`BlockState.FIELDS`, finished blocks restarted) and this cycle's block positions `(N, B)`.
    """
    B = strategy.block_size
    s = strategy.session
    block = BlockState(tokens, undecided, start, num_fixed, step, post_steps, s.mask_token_id)
    drafting = torch.ones_like(start, dtype=torch.bool) if drafting is None else drafting
    probs = torch.zeros(*tokens.shape, 1, device=tokens.device) if draft_probs is None else draft_probs
    drafts = strategy.with_target_alone(undecided, Drafts(draft_tokens, reveal_step, probs, drafting))
    paired = strategy.config.verify_layout == "paired"
    if paired:
        ids, positions = strategy.paired_query(drafts.tokens, block.positions)
        intra = temporal_verify_mask(drafts.reveal_step)
    else:
        ids, positions, intra = strategy.stacked_query(drafts, block.positions, strategy.verify_width // B)
    pending = None if pending_tokens is None else (pending_tokens, pending_positions, pending_rows)
    ids, positions, intra, store_len, store_valid = strategy.with_pending(ids, positions, intra, pending)
    logits, lengths = runner.step_forward(shape, ids, positions, intra, lengths, store_len=store_len,
                                          store_valid=store_valid, logits_to_keep=B if paired else ids.shape[1]
                                          - store_len)            # paired: the mask slots; stacked: every copy
    if not paired:
        logits = strategy.stacked_logits(logits, drafts.reveal_step)
    tokens, undecided, result, num_drafts, alone = strategy.accept(
        tokens, undecided, drafts, s.sampler.probs(logits), None if uniforms is None else (uniforms, noise),
        alone_noise, gate_noise)
    done = ~undecided.any(dim=1)
    after = BlockState(tokens.clone(), undecided.clone(), start.clone(), num_fixed.clone(), step.clone(),
                       post_steps.clone(), block.mask_token_id)
    after.restart(done)
    counters = [num_drafts, result.num_accepted, result.recovered.long(), result.num_tokens, alone.sum(dim=1),
                after.undecided.sum(dim=1)]
    # with a streamer, also the drafts it is shown: the first masked position before the commits, the drafted block
    streamed = [block.first_masked[:, None], drafts.tokens] if s.stream is not None else []
    read = torch.cat([done[:, None].long(), num_fixed[:, None], first_masked_span(undecided)[0][:, None], tokens,
                      torch.stack(counters, dim=1), *streamed], dim=1)
    return (lengths, tokens, undecided, done, read, *(getattr(after, name) for name in BlockState.FIELDS),
            block.positions)
