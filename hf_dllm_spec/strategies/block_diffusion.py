"""Block-diffusion decoding with confidence-based unmasking (S2D2 paper Algorithms 1-2), batched.

Block grid from absolute position 0, per row: each row's prompt (padding ignored) has its block-aligned part
prefilled and its tail shares the row's first block with the masks; the tail is never edited. Every row keeps
its own block (start position, prompt tail, schedule step); one forward per step serves the whole batch, rows
finish blocks at different steps, and a finished row leaves the batch. Denoising forwards read the cache; each
finished block is written once, either in its own forward (`fuse_cache_write=False`, the reference accounting)
or together with the row's next block's first denoising forward (`fuse_cache_write=True`, default): one input
`[finished block | next block]` whose first rows see only the cache and themselves, so their K/V are exactly
those of a separate write. Rows with nothing to write in that forward store padding that nobody sees
(runner.py). Block size 1 is autoregressive decoding of the same model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..configuration import DecodingConfig
from ..maths.editing import EditingConfig, EditRule, ThresholdEditRule
from ..maths.masks import block_causal_mask, concat_segments, full_mask, left_pad, partially_causal_draft_mask
from ..maths.sampling import entropy, step_processors
from ..maths.unmasking import REMASKING_STRATEGIES, first_masked_span, scheduled_tokens, select_transfer
from ..tracing import recording_step
from ..validation import check_bool, check_choice, check_int, check_range, invalid
from .base import DecodingStrategy


@dataclass
class BlockDiffusionConfig(DecodingConfig):
    """Block-diffusion decoding with confidence-based unmasking (S2D2 paper Algorithms 1-2).

    Args:
        block_size (`int`, *optional*): tokens per block, counted from absolute position 0. `None` uses the
            checkpoint's trained block size (`config.block_size`); other sizes run off-distribution with a
            warning.
        steps_per_block (`int`, *optional*): denoising steps S of the commit schedule; `None` = block_size
            (one token per step at least). Steps past S reuse the last schedule entry until the block is full.
        remasking_strategy (`str`, defaults to "low_confidence_dynamic"): commit rule, see `unmasking.py`.
        confidence_threshold (`float`, defaults to 0.85): tau of the dynamic rule, probability in (0, 1];
            1.0 gives static decoding.
        eb_threshold (`float`, defaults to 0.35): entropy budget in nats of `entropy_bounded`.
        sub_block_size (`int`, *optional*): decode each block in sub-blocks of this many tokens, strictly left to
            right: a step commits only inside the sub-block of the first masked position (Fast-dLLM v2's
            `small_block_size`). `None` = the whole block. Must divide the block size.
        cache_ver (`bool`, defaults to False): AR-like caching: prefill and block writes use a token-causal
            mask, so the cache equals what block size 1 would store (S2D2 §4.2).
        draft_ver (`bool`, defaults to False): partially causal drafting mask (S2D2 Eq. 4).
        fuse_cache_write (`bool`, defaults to True): write a finished block's K/V in the same forward as the
            next block's first denoising step (exact; saves one forward per block, so AR costs one forward per
            token). False reproduces the reference accounting: one separate write forward per finished block,
            the last one included. On a right-shifted model a separate write also yields the next block's first
            token: its logits are the last stored token's (Fast-dLLM v2's rule, see `commit_from_carry`).
    """

    decoding_strategy: ClassVar[str] = "block_diffusion"

    block_size: int | None = None
    steps_per_block: int | None = None
    remasking_strategy: str = "low_confidence_dynamic"
    confidence_threshold: float = 0.85
    eb_threshold: float = 0.35
    sub_block_size: int | None = None
    cache_ver: bool = False
    draft_ver: bool = False
    fuse_cache_write: bool = True

    def validate(self) -> None:
        if self.block_size is not None:
            check_int("block_size", self.block_size, 1, "pass a positive number of tokens, e.g. 4")
        if self.steps_per_block is not None:
            check_int("steps_per_block", self.steps_per_block, 1, "pass at least one denoising step per block")
            if self.block_size is not None and self.steps_per_block > self.block_size:
                raise invalid("steps_per_block", self.steps_per_block,
                              f"be at most `block_size` (={self.block_size})",
                              "use steps_per_block <= block_size (one token per step at least)")
        if self.sub_block_size is not None:
            check_int("sub_block_size", self.sub_block_size, 1, "pass a positive number of tokens dividing the "
                      "block size, e.g. 8 for blocks of 32")
            if self.block_size is not None and self.block_size % self.sub_block_size:
                raise invalid("sub_block_size", self.sub_block_size, f"divide `block_size` (={self.block_size}; "
                              "the checkpoint's trained block size unless given)",
                              "pass a divisor of the block size (sub_block_size=...), or None for whole blocks")
        check_choice("remasking_strategy", self.remasking_strategy, REMASKING_STRATEGIES)
        check_range("confidence_threshold", self.confidence_threshold, low=0.0, high=1.0, low_open=True,
                    fix="pass a probability such as 0.85 (1.0 gives static decoding)")
        check_range("eb_threshold", self.eb_threshold, low=0.0, low_open=True,
                    fix="pass a positive entropy budget in nats, e.g. 0.35")
        for name in ("cache_ver", "draft_ver", "fuse_cache_write"):
            check_bool(name, getattr(self, name))


@dataclass
class ARConfig(BlockDiffusionConfig):
    """Autoregressive decoding of a block-diffusion model: block size 1 (the S2D2 AR baseline).

    With `fuse_cache_write=True` each token costs one forward, like a real AR model.
    """

    decoding_strategy: ClassVar[str] = "ar"

    block_size: int | None = 1

    def validate(self) -> None:
        super().validate()
        if self.block_size != 1:
            raise invalid("block_size", self.block_size, "be 1 for decoding_strategy='ar'",
                          "drop `block_size`, or use decoding_strategy='block_diffusion' for larger blocks")


@dataclass
class BlockState:
    """The block each row is denoising.

    Attributes:
        tokens (`torch.Tensor` of shape `(N, B)`, int64): block content, MASK where undecided.
        undecided (`torch.Tensor` of shape `(N, B)`, bool): positions still masked (kept apart from the token
            ids, so a placeholder id can never be mistaken for a decided token).
        start (`torch.Tensor` of shape `(N,)`, int64): absolute position of `tokens[:, 0]`.
        num_fixed (`torch.Tensor` of shape `(N,)`, int64): leading prompt-tail positions (never edited).
        step (`torch.Tensor` of shape `(N,)`, int64): denoising steps taken in this block.
        post_steps (`torch.Tensor` of shape `(N,)`, int64): steps that began with no mask (token editing).
        mask_token_id (`int`).
    """

    tokens: torch.Tensor
    undecided: torch.Tensor
    start: torch.Tensor
    num_fixed: torch.Tensor
    step: torch.Tensor
    post_steps: torch.Tensor
    mask_token_id: int

    @property
    def masked(self) -> torch.Tensor:
        """`(N, B)` bool, positions still masked."""
        return self.undecided

    @property
    def offsets(self) -> torch.Tensor:
        """`(1, B)` int64, 0 .. B-1."""
        return torch.arange(self.tokens.shape[1], device=self.tokens.device)[None]

    @property
    def positions(self) -> torch.Tensor:
        """`(N, B)` int64 absolute positions."""
        return self.start[:, None] + self.offsets

    @property
    def fixed(self) -> torch.Tensor:
        """`(N, B)` bool, prompt-tail positions."""
        return self.offsets < self.num_fixed[:, None]

    @property
    def first_masked(self) -> torch.Tensor:
        """`(N,)` int64, index of each row's first masked position (B when none)."""
        return first_masked_span(self.masked)[0]

    @property
    def num_masks(self) -> torch.Tensor:
        """`(N,)` int64, masks the block started with (positions that are not prompt)."""
        return self.tokens.shape[1] - self.num_fixed

    def restart(self, rows: torch.Tensor) -> None:
        """Move the rows where `rows` `(N,)` is true to their next block: all masks, B positions further on."""
        self.tokens.masked_fill_(rows[:, None], self.mask_token_id)
        self.undecided.masked_fill_(rows[:, None], True)
        self.start += rows.long() * self.tokens.shape[1]
        for counter in (self.num_fixed, self.step, self.post_steps):
            counter.masked_fill_(rows, 0)

    FIELDS = ("tokens", "undecided", "start", "num_fixed", "step", "post_steps")

    def select(self, index: torch.Tensor) -> None:
        """Keep the rows `index` `(M,)`."""
        for name in self.FIELDS:
            setattr(self, name, getattr(self, name)[index])

    def extend(self, other: "BlockState") -> None:
        """Append the rows of `other` (rows that joined the batch)."""
        for name in self.FIELDS:
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))


def continuing_rows(done: torch.Tensor, done_rows: list[bool], finished: list[int]) -> tuple[torch.Tensor, bool]:
    """The rows whose block finished and that go on to a next block: `(N,)` bool, and whether there is any (decided
    on the host from `done_rows`, the step's read of `done`, and the stopping rows `finished`: no device read)."""
    stopping = set(finished)
    if not stopping:
        return done, any(done_rows)
    continuing = done.clone()
    continuing[finished] = False
    return continuing, any(d and i not in stopping for i, d in enumerate(done_rows))


class BlockDiffusionStrategy(DecodingStrategy):
    """Block diffusion with `low_confidence_dynamic` / `_static`, `sequential` or `entropy_bounded` unmasking.

    Source: S2D2 (arXiv 2603.25702) Algorithms 1-2; SDAR's `block_diffusion_generate` (JetAstra/SDAR).
    Subclasses change one denoising step (:meth:`denoise_step`); an :class:`~hf_dllm_spec.maths.editing.EditRule` in
    `edit_rule` (built from the config when it is an :class:`~hf_dllm_spec.maths.editing.EditingConfig` with
    `editing_threshold`) re-decides committed tokens of the current block at every step.
    """

    name = "block_diffusion"
    config_class = BlockDiffusionConfig
    paper = "S2D2 Algorithms 1-2 (arXiv 2603.25702); SDAR block_diffusion_generate"
    lossless = False
    per_row_stops = True
    per_row_sampling = True
    edit_rule: EditRule | None = None

    def __init__(self, config, session) -> None:
        super().__init__(config, session)
        self.block_size = config.block_size          # resolved by the call's plan (the checkpoint's when unset)
        self.steps_per_block = config.steps_per_block or self.block_size
        self.sub_block_size = config.sub_block_size or self.block_size
        # Right-shifted model, separate cache writes: a new block's first token is committed from the carry.
        self.first_from_carry = session.target.alignment == "right_shift" and not config.fuse_cache_write
        self._full_mask: torch.Tensor | None = None            # (B, B), built once
        editing = isinstance(config, EditingConfig)
        rule = config.edit_rule() if editing else None
        if rule is not None:
            self.edit_rule = rule
        # LLaDA2.1: a fixed least number of commits per step instead of the steps_per_block schedule.
        self.num_to_transfer = config.num_to_transfer if editing else None
        self._edited: torch.Tensor | None = None                # (N,) bool, rows with an edit this step
        # Greedy steps whose consumers read only each position's token and confidence skip the full distribution.
        self.full_probs = (session.sampler.do_sample or config.remasking_strategy == "entropy_bounded"
                           or self.edit_rule is not None)
        self._step_key: tuple | None = None          # step_key's part fixed for the call
        self._noise: dict[int, torch.Tensor] = {}               # step_noise's buffers, per rows bucket
        # Batch 1 with a streamer: what a compiled step's read adds for it (:meth:`stream_read`): the first masked
        # position after the step, then the draft canvas when the streamer takes drafts.
        stream = session.stream
        self.streams_drafts = stream is not None and stream.takes_drafts and self.block_size > 1
        self.stream_columns = 0 if stream is None else 1 + self.block_size * self.streams_drafts
        self.compiled_step = self.runs_compiled_step()
        # Separate cache writes as compiled calls too: the write, the next blocks and (right-shifted models,
        # greedy) the carry's commits (:func:`cache_write_step`). A sampled carry commit draws for the restarted
        # rows only (per-row generators), which stays eager.
        self.compiled_write = (self.compiled_step and not config.fuse_cache_write
                               and not (self.first_from_carry and session.sampler.do_sample))

    # -- Algorithm 1: the outer loop, every row at its own pace ------------------------------------------------
    def decode(self) -> list[torch.Tensor]:
        s, B = self.session, self.block_size
        lengths = torch.tensor([p.shape[0] for p in s.prompts], device=s.target.device)
        aligned = (lengths // B) * B
        self.prefill(aligned)
        block = self.first_blocks(aligned)
        self.commit_from_carry(block)
        generated = [s.prompts[0].new_empty(0) for _ in range(s.batch_size)]
        host: list[list[int]] = [[] for _ in range(s.batch_size)]       # the same tokens, as read on the host
        pending: tuple | None = None      # finished blocks to store in the next forward (see draft_forward)
        while True:
            if s.admission is not None:   # continuous batching: any step is a join point (rows keep their pace)
                block, pending = self.admit(block, pending, generated, host)
            if not block.tokens.shape[0]:
                break
            first_masked = None           # batch 1 with a streamer: the block's first mask after the step
            if self.first_from_carry and self.block_size == 1:
                # the carry decided every block (a block of B > 1 always keeps a mask after the carry's commit:
                # a prompt tail fills fewer than B positions, and an unfinished block is not restarted)
                done = torch.ones_like(block.start, dtype=torch.bool)
                read = step_read(done, block.num_fixed, block.tokens).tolist()
                first_masked = self.block_size
            elif self.compiled_step:
                # 1-2 as one compiled function (the static runtime with `compile_config`), which also prepares
                # step 3's next blocks; with a streamer its read carries what the stream shows
                done, read, advanced, streamed = self.compiled_denoise(block, pending)
                if streamed is not None:
                    first_masked = streamed[0]
                    if self.streams_drafts:
                        self.stream_canvas(streamed[1:], read[0][1], host[s.stats.active[0]])
            else:
                # 1. one denoising forward for every row, storing last step's finished blocks on the way
                began_full = ~block.masked.any(dim=1) if self.edit_rule is not None else None
                logits = self.draft_forward(block, pending)
                if s.stream is not None:
                    self.stream_proposal(block, logits, host[s.stats.active[0]])
                # 2. edit and commit tokens; which rows finished their block
                self.denoise_step(block, logits)
                done = self.finish_step(block, began_full)
                block.step += 1
                # the step's one host read: which rows finished, where their new tokens start, the block's tokens
                read = step_read(done, block.num_fixed, block.tokens).tolist()
                if s.stream is not None:
                    first_masked = int(block.first_masked[0])
            done_rows = [bool(row[0]) for row in read]
            if s.stream is not None:
                self.stream_step(read[0], first_masked, host[s.stats.active[0]])
            pending = None
            if not any(done_rows):
                continue
            # 3. append finished blocks, decide stops, schedule the cache writes, start the next blocks
            finished = self.collect_finished_blocks(block, done_rows, generated, read, host)
            if self.compiled_step and self.config.fuse_cache_write:
                pending = self.take_next_blocks(block, advanced, done, done_rows, finished)
            else:
                pending = self.schedule_writes(block, done, done_rows, finished)
            # 4. finished rows leave the batch
            if finished:
                pending = self.drop_rows(block, done_rows, finished, pending)
        return generated

    def admit(self, block: BlockState, pending: tuple | None,
              *per_prompt: list) -> tuple[BlockState, tuple | None]:
        """Continuous batching, between two steps: cancelled rows leave, joining rows enter.

        A joining row gets its block-aligned prompt stored by one prefill forward of the joining rows alone, moved
        into their rows of the cache (the running rows get padding columns that no query sees), then its first
        block (prompt tail and masks) beside the running rows' blocks, which go on where they were: every row keeps
        its own block, step and schedule, so a row's tokens are those of its own batch-1 call.

        Args:
            per_prompt (`list`): the loop's lists indexed by prompt (tokens `(n,)` or host lists), each extended
                with an empty entry per joining row.

        Returns:
            `(block, pending)` for the batch after the change.
        """
        s = self.session
        cancelled = s.cancelled_rows()
        if cancelled:
            pending = self.drop_rows(block, [False] * block.tokens.shape[0], cancelled, pending)
        rows = s.joining_rows()
        if not rows:
            return block, pending
        running = block.tokens.shape[0]
        indices = s.add_rows(rows)
        prompts = [s.prompts[i] for i in indices]
        for values in per_prompt:
            values.extend(prompts[0].new_empty(0) if isinstance(values[0], torch.Tensor) else [] for _ in rows)
        lengths = torch.tensor([p.shape[0] for p in prompts], device=s.target.device)
        aligned = (lengths // self.block_size) * self.block_size
        self.prefill_joining(running, aligned, prompts)
        block.extend(self.first_blocks(aligned, prompts))
        self.commit_from_carry(block)           # only joining rows can start a block without position 0
        if pending is not None:                 # joining rows store nothing in the next forward
            tokens, positions, flags = pending
            pending = (torch.cat([tokens, tokens.new_zeros(len(rows), tokens.shape[1])]),
                       torch.cat([positions, positions.new_zeros(len(rows), positions.shape[1])]),
                       torch.cat([flags, flags.new_zeros(len(rows))]))
        return block, pending

    def stream_step(self, read: list[int], first_masked: int, generated: list[int]) -> None:
        """Batch 1, after a denoising step: the block's committed prefix left of its first mask as final tokens
        (not with token editing, which may still change them), from the step's read (host values only, no device
        read): `read` the row's `[done, num_fixed, *block tokens]` (:func:`step_read`), `first_masked` its block's
        first masked position after the step (B when none), `generated` the row's finished blocks as read."""
        if self.edit_rule is None:
            fixed = read[1]
            prefix = read[2 + fixed:2 + max(first_masked, fixed)]
            self.session.stream.push(torch.tensor(generated + prefix, dtype=torch.long))

    def stream_proposal(self, block: BlockState, logits: torch.Tensor, generated: list[int]) -> None:
        """Batch 1, before a denoising step commits (the eager step): :meth:`stream_canvas` of
        :meth:`draft_canvas` over the step's logits `(1, B, V)`; `generated`: the row's finished blocks as read.
        No drafts at block size 1 (AR)."""
        if self.streams_drafts:
            self.stream_canvas(self.draft_canvas(block, logits)[0].tolist(), int(block.num_fixed[0]), generated)

    def draft_canvas(self, block: BlockState, logits: torch.Tensor) -> torch.Tensor:
        """`(N, B)` int64, each row's block before the step commits with its undecided positions filled with the
        model's most likely token (argmax of the step's logits `(N, B, V)`, MASK excluded: the "argmax canvas" of
        transformers' diffusion models; nothing is drawn, so decoding is unchanged). A function of tensors (a
        compiled step returns it in its read)."""
        scores = logits.clone()
        scores[..., self.session.mask_token_id] = float("-inf")
        return torch.where(block.masked, scores.argmax(dim=-1), block.tokens)

    def stream_canvas(self, canvas: list[int], fixed: int, generated: list[int]) -> None:
        """Batch 1: show the row's block `canvas` (:meth:`draft_canvas`, read on the host; `fixed` its prompt tail)
        after the streamed tokens as a draft (`stream_draft`); `generated`: the row's finished blocks as read."""
        start = fixed + max(self.session.stream.sent - len(generated), 0)   # this block's tokens already streamed
        self.stream_draft(torch.tensor(generated + canvas[fixed:start], dtype=torch.long),
                          torch.tensor(canvas[start:], dtype=torch.long))

    def stream_read(self, block: BlockState, undecided: torch.Tensor,
                    logits: torch.Tensor | None = None) -> torch.Tensor:
        """The columns a compiled step's read adds for a streamer (:attr:`stream_columns`; none without one), `(N, k)`
        int64: the first masked position after the step (`undecided` `(N, B)`, B when none), then with `logits` (a
        streamer that takes drafts) the :meth:`draft_canvas` of `block` as the step began."""
        columns = [first_masked_span(undecided)[0][:, None]] if self.stream_columns else []
        if self.streams_drafts and logits is not None:
            columns.append(self.draft_canvas(block, logits))
        return torch.cat(columns, dim=1) if columns else undecided.new_zeros(undecided.shape[0], 0, dtype=torch.long)

    def collect_finished_blocks(self, block: BlockState, done_rows: list[bool], generated: list[torch.Tensor],
                                read: list[list[int]], host: list[list[int]]) -> list[int]:
        """Append each finished block to its row's output; return the batch indices of rows that stop.

        Args:
            read (`list[list[int]]`): per batch row, `[done, num_fixed, *block tokens]` as read on the host this step.
            host (`list[list[int]]`): per prompt, its `generated` tokens on the host (extended here), so the stop
                decision reads nothing more from the device.
        """
        s, finished = self.session, []
        for i in (i for i, is_done in enumerate(done_rows) if is_done):
            prompt_index, fixed = s.stats.active[i], read[i][1]
            new_tokens = block.tokens[i, fixed:]
            s.stats.row(i).num_committed_tokens += new_tokens.shape[0]
            generated[prompt_index] = torch.cat([generated[prompt_index], new_tokens])
            host[prompt_index].extend(read[i][2 + fixed:])
            if s.stream is not None:
                s.stream.push(torch.tensor(host[prompt_index], dtype=torch.long))
            if self.should_stop(prompt_index, generated[prompt_index], host[prompt_index]):
                finished.append(i)
        return finished

    def schedule_writes(self, block: BlockState, done: torch.Tensor, done_rows: list[bool],
                        finished: list[int]) -> tuple | None:
        """Store finished blocks now (`fuse_cache_write=False`) or in the next forward; restart their rows.

        Returns:
            `(tokens (N, B), positions (N, B), rows (N,) bool)` of the blocks the next forward stores, or None.
        """
        continuing, any_continuing = continuing_rows(done, done_rows, finished)
        if self.compiled_write:
            self.compiled_cache_write(block, done, done_rows, continuing)
            return None
        if not self.config.fuse_cache_write:
            self.write_blocks(block, done, done_rows)
        pending = None
        if self.config.fuse_cache_write and any_continuing:
            pending = (block.tokens.clone(), block.positions, continuing)
        block.restart(continuing)
        self.commit_from_carry(block)
        return pending

    def take_next_blocks(self, block: BlockState, advanced: tuple, done: torch.Tensor, done_rows: list[bool],
                         finished: list[int]) -> tuple | None:
        """:meth:`schedule_writes` after a compiled step, which computed the next blocks already (`advanced`:
        every finished block restarted, and the finished blocks' positions; the stopping rows among them leave the
        batch next): the finished blocks of the continuing rows are stored by the next forward."""
        continuing, any_continuing = continuing_rows(done, done_rows, finished)
        pending = (block.tokens, advanced[-1], continuing) if any_continuing else None
        block.tokens, block.undecided, block.start, block.num_fixed, block.step, block.post_steps = advanced[:-1]
        return pending

    def commit_from_carry(self, block: BlockState) -> None:
        """Right-shifted model, separate writes: commit each row's masked block position 0 from the carry.

        The prediction for a block's first position is the logits of the last stored token (Fast-dLLM v2: "the
        first token of each block from the last logit of the previous block's cache write"); nothing inside the
        block can change it, so it is drawn (sampler transform, generator) before the block's first denoising
        forward. The Fast-dLLM v2 reference takes the argmax even when sampling; here the same transform as every
        other token is used (identical at temperature 0). No-op for position-aligned models and fused writes.
        """
        carry = self.session.target.carry
        if not self.first_from_carry or carry is None:
            return
        rows = block.undecided[:, 0]
        if not bool(rows.any()):
            return
        self.session.stats.accumulate("num_fallback_tokens", self.take_from_carry(block, carry, rows[:, None]))

    def take_from_carry(self, block: BlockState, carry: torch.Tensor, draw: torch.Tensor | None = None) -> torch.Tensor:
        """Commit each row's masked block position 0 from `carry` `(N, V)` (a function of tensors, shared by
        :meth:`commit_from_carry` and :func:`cache_write_step`); `draw` `(N, 1)` bool: the rows that draw (per-row
        generators). Returns the tokens committed per row `(N,)`."""
        take = block.undecided & (block.offsets == 0)
        sampler = self.session.sampler
        first, _ = sampler.choose(sampler.probs(carry[:, None, :]), draw=draw)                # (N, 1)
        block.tokens = torch.where(take, first, block.tokens)
        block.undecided = block.undecided & ~take
        return take.sum(dim=1)

    def drop_rows(self, block: BlockState, done_rows: list[bool], finished: list[int],
                  pending: tuple | None) -> tuple | None:
        """Remove the `finished` rows from the batch (they stop costing compute); return `pending` for the rest."""
        gone = set(finished)
        index = torch.tensor([i for i in range(len(done_rows)) if i not in gone], dtype=torch.long,
                             device=block.tokens.device)
        self.select_rows(index)
        block.select(index)
        if pending is None:
            return None
        pending = tuple(t[index] for t in pending)
        return pending if bool(pending[2].any()) else None

    def first_blocks(self, aligned: torch.Tensor, prompts: list[torch.Tensor] | None = None) -> BlockState:
        """Each row's first block: its prompt tail, then masks (`prompts`: the session's when None)."""
        s, B = self.session, self.block_size
        prompts = s.prompts if prompts is None else prompts
        tokens = torch.full((len(prompts), B), s.mask_token_id, dtype=torch.long, device=aligned.device)
        for n, prompt in enumerate(prompts):
            tail = prompt[int(aligned[n]):]
            tokens[n, : tail.shape[0]] = tail
        zeros = torch.zeros_like(aligned)
        num_fixed = torch.tensor([p.shape[0] for p in prompts], device=aligned.device) - aligned
        undecided = torch.arange(B, device=aligned.device)[None] >= num_fixed[:, None]
        return BlockState(tokens, undecided, aligned.clone(), num_fixed, zeros.clone(), zeros.clone(),
                          s.mask_token_id)

    def select_rows(self, index: torch.Tensor) -> None:
        """Drop finished rows from every per-row structure (the session owns them: runners, sampler, counters)."""
        self.session.select_rows(index)

    def final_prefix(self, block: BlockState, row: int) -> torch.Tensor:
        """Committed tokens of `row`'s block left of its first mask (final without token editing), `(n,)`."""
        start, end = int(block.num_fixed[row]), int(block.first_masked[row])
        return block.tokens[row, start:max(end, start)]

    # -- forwards ---------------------------------------------------------------------------------------------
    def store_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """Visibility among tokens being stored, `(N, q, q)`: token-causal with `cache_ver`, else block-causal."""
        return block_causal_mask(positions, 1 if self.config.cache_ver else self.block_size)

    def prefill(self, aligned: torch.Tensor, runner=None, prompts: list[torch.Tensor] | None = None) -> None:
        """Store each row's block-aligned prompt, left-padded to the longest (1 forward, counted as prefill), in
        `runner`'s cache (default: the target's); `prompts`: one per batch row (the session's when None; an empty
        one stores nothing for its row)."""
        s = self.session
        runner = runner if runner is not None else s.target
        prompts = s.prompts if prompts is None else prompts
        longest = int(aligned.max())
        if longest == 0:
            return
        ids, valid, positions = left_pad([p[: int(a)] for p, a in zip(prompts, aligned)], aligned.device)
        with runner.timer.span("prefill"):
            runner.forward(ids, positions, self.store_mask(positions), kind="prefill", store_len=longest,
                           store_valid=valid, logits_to_keep=1, rows=(aligned > 0).tolist())

    def prefill_joining(self, first: int, aligned: torch.Tensor, prompts: list[torch.Tensor]) -> None:
        """Store the prompts of the rows `first ..` that join the batch (:meth:`admit`), `aligned` `(k,)` their
        block-aligned lengths: one prefill forward of those rows alone, moved into their rows of the target's cache
        (:meth:`~hf_dllm_spec.runtime.runner.ModelRunner.store_joining_rows`)."""
        self.session.target.store_joining_rows(first, lambda runner: self.prefill(aligned, runner, prompts))

    def write_blocks(self, block: BlockState, rows: torch.Tensor, row_flags: list[bool]) -> None:
        """Separate cache-write forward of the finished blocks of `rows` `(N,)` (Algorithm 1 line 5; 1 forward)."""
        B = self.block_size
        self.session.target.forward(block.tokens, block.positions, self.store_mask(block.positions),
                                    kind="cache_write", store_len=B, store_valid=rows[:, None].expand(-1, B),
                                    logits_to_keep=1, rows=row_flags)

    def draft_mask(self, block: BlockState) -> torch.Tensor:
        """Visibility inside the block while denoising: full `(B, B)`, or S2D2 Eq. 4 `(N, B, B)` with `draft_ver`."""
        if self.config.draft_ver:
            return partially_causal_draft_mask(self.block_size, block.first_masked)
        if recording_step():                     # a graph would read a kept tensor at its address of this call
            return full_mask(self.block_size, block.tokens.device)
        if self._full_mask is None:
            self._full_mask = full_mask(self.block_size, block.tokens.device)
        return self._full_mask

    def draft_forward(self, block: BlockState, pending: tuple | None) -> torch.Tensor:
        """Denoising forward of every row's block (cache read-only), fused with the write of `pending` blocks.

        Args:
            pending (`tuple`, *optional*): `(tokens (N, B), positions (N, B), rows (N,) bool)` of finished blocks
                to store in this forward; rows that are false store padding.

        Returns:
            `torch.Tensor` of shape `(N, B, V)`, float32 draft logits of each row's block.
        """
        s = self.session
        for i in range(block.tokens.shape[0]):
            s.stats.row(i).num_denoising_steps += 1
        return self.forward_with_pending(s.target, block.tokens, block.positions, self.draft_mask(block), pending,
                                         kind="draft")

    def forward_with_pending(self, runner, ids: torch.Tensor, positions: torch.Tensor, intra: torch.Tensor,
                             pending: tuple | None, *, kind: str, rows=None) -> torch.Tensor:
        """`runner.forward` over `ids` `(N, q)` (read-only), storing the `pending` finished blocks first when given
        (rows whose flag is false store padding); returns the logits of the `ids` part, `(N, q, V)`."""
        q = ids.shape[1]
        ids, positions, intra, store_len, store_valid = self.with_pending(ids, positions, intra, pending)
        return runner.forward(ids, positions, intra, kind=kind, store_len=store_len, store_valid=store_valid,
                              logits_to_keep=q, rows=rows)

    def with_pending(self, ids: torch.Tensor, positions: torch.Tensor, intra: torch.Tensor,
                     pending: tuple | None) -> tuple:
        """The query of :meth:`forward_with_pending`: `(ids, positions, intra, store_len, store_valid)`, the
        `pending` blocks `(tokens, positions, rows)` first (stored; padding in rows whose flag is false)."""
        if pending is None:
            return ids, positions, intra, 0, None
        tokens, pending_positions, pending_rows = pending
        return (torch.cat([tokens, ids], dim=1), torch.cat([pending_positions, positions], dim=1),
                concat_segments(self.store_mask(pending_positions), intra), self.block_size,
                pending_rows[:, None].expand(-1, self.block_size))

    # -- Algorithm 2: one denoising step -----------------------------------------------------------------------
    def current_sub_block(self, block: BlockState) -> torch.Tensor:
        """`(N, B)` bool: the positions of each row's current sub-block (the one holding its first mask)."""
        sub = block.offsets // self.sub_block_size                                 # (1, B)
        return sub == (block.first_masked // self.sub_block_size)[:, None]

    def decodable(self, block: BlockState) -> torch.Tensor:
        """`(N, B)` bool: masked positions a step may commit (the current sub-block's; all with whole blocks)."""
        if self.sub_block_size == self.block_size:
            return block.masked
        return block.masked & self.current_sub_block(block)

    def denoise_step(self, block: BlockState, logits: torch.Tensor) -> None:
        """Draw tokens for every position, edit committed ones (if editing), commit masked ones by the rule."""
        probs, tokens, confidence = self.propose(logits)
        self.apply_edits(block, probs, tokens, confidence)
        self.commit_by_rule(block, probs, tokens, confidence)

    def propose(self, logits: torch.Tensor,
                noise: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """This step's processed distribution `(N, B, V)`, chosen tokens and confidences `(N, B)`; the
        distribution is None where :attr:`full_probs` is False (greedy, and nothing reads it:
        :meth:`Sampler.greedy`). `noise` `(N, B, V)`: when sampling, the draw made beforehand (a compiled step,
        :meth:`step_noise`); None draws here."""
        if not self.full_probs:
            return None, *self.session.sampler.greedy(logits)
        probs = self.session.sampler.probs(logits)
        tokens, confidence = self.session.sampler.choose(probs, noise=noise)
        return probs, tokens, confidence

    def apply_edits(self, block: BlockState, probs: torch.Tensor, tokens: torch.Tensor,
                    confidence: torch.Tensor) -> None:
        """Token editing (LLaDA2.1 T2T) of committed, non-prompt positions of each row's block; no-op without an
        edit rule. Runs before the step's commits (disjoint positions), so a verifier sees the edited block."""
        if self.edit_rule is None:
            return
        edits = self.edits(block, probs, tokens, confidence)
        block.tokens = torch.where(edits, tokens, block.tokens)
        self._edited = edits.any(dim=1)
        self.session.stats.accumulate("num_edited_tokens", edits.sum(dim=1))

    def edits(self, block: BlockState, probs: torch.Tensor, tokens: torch.Tensor,
              confidence: torch.Tensor) -> torch.Tensor:
        """`(N, B)` bool, the positions the edit rule overwrites with `tokens` this step: committed, not prompt,
        a different proposal, and the rule's test (a pure function of tensors)."""
        editable = ~block.masked & ~block.fixed
        return self.edit_rule(tokens=block.tokens, editable=editable, probs=probs, proposal=tokens,
                              confidence=confidence) & editable & (tokens != block.tokens)

    def commit_by_rule(self, block: BlockState, probs: torch.Tensor, tokens: torch.Tensor,
                       confidence: torch.Tensor, rows: torch.Tensor | None = None,
                       num_tokens: torch.Tensor | int | None = None) -> torch.Tensor:
        """Commit the positions `remasking_strategy` selects in `rows` (all if None), at least `num_tokens` (k; None:
        this step's :meth:`tokens_per_step`); return `(N,)` counts."""
        transfer = self.transfer(block, probs, confidence, rows, num_tokens)
        block.tokens = torch.where(transfer, tokens, block.tokens)
        block.undecided = block.undecided & ~transfer
        committed = transfer.sum(dim=1)
        self.session.stats.accumulate("num_fallback_tokens", committed)
        return committed

    def transfer(self, block: BlockState, probs: torch.Tensor | None, confidence: torch.Tensor,
                 rows: torch.Tensor | None = None, num_tokens: torch.Tensor | int | None = None) -> torch.Tensor:
        """`(N, B)` bool, the positions `remasking_strategy` commits this step in `rows` (all if None), at least
        `num_tokens` (None: :meth:`tokens_per_step`)."""
        cfg = self.config
        masked = self.decodable(block)
        masked = masked if rows is None else masked & rows[:, None]
        num_tokens = self.tokens_per_step(block) if num_tokens is None else num_tokens
        return select_transfer(
            cfg.remasking_strategy, masked=masked, confidence=confidence, num_tokens=num_tokens,
            confidence_threshold=cfg.confidence_threshold, eb_threshold=cfg.eb_threshold,
            entropies=entropy(probs) if cfg.remasking_strategy == "entropy_bounded" else None,
        )

    def tokens_per_step(self, block: BlockState) -> torch.Tensor | int:
        """k, the least commits of this step (clamped to the masks left by the rule): `num_to_transfer` (LLaDA2.1),
        else entry `step` of the `steps_per_block` schedule over the block (:meth:`scheduled_masks`), `(N,)` or an
        int."""
        if self.num_to_transfer is not None:
            return self.num_to_transfer
        return scheduled_tokens(self.scheduled_masks(block), self.steps_per_block, block.step)

    def scheduled_masks(self, block: BlockState) -> torch.Tensor:
        """`(N,)` the masks the `steps_per_block` schedule spreads over: the whole block, also a first block that
        holds a prompt tail (the SDAR and LLaDA2.0 references' `get_num_transfer_tokens(block_length, steps)`; k is
        clamped to the masks left)."""
        return torch.full_like(block.num_masks, self.block_size)

    def finish_step(self, block: BlockState, began_full: torch.Tensor | None) -> torch.Tensor:
        """`(N,)` bool, the rows whose block is complete: no mask left, and with editing (`began_full` `(N,)`: the
        step began without a mask) also no edit in a post step, or `max_post_steps` post steps taken."""
        edited, self._edited = self._edited, None
        return self.block_complete(block, began_full, edited)

    def block_complete(self, block: BlockState, began_full: torch.Tensor | None,
                       edited: torch.Tensor | None) -> torch.Tensor:
        """:meth:`finish_step` as a function of tensors: `edited` `(N,)` bool, the rows with an edit this step (None:
        none); advances `block.post_steps` (a new tensor) by the rows that began full."""
        full = ~block.masked.any(dim=1)
        if self.edit_rule is None:
            return full
        block.post_steps = block.post_steps + began_full.long()
        fired = edited if edited is not None else torch.zeros_like(full)
        return full & ((began_full & ~fired) | (block.post_steps >= self.edit_rule.max_post_steps))

    # -- the step as one compiled function (runtime/step.py) --------------------------------------------------
    #: The methods a compiled step runs. A subclass that overrides one of them runs the eager step, unless the class
    #: defining the override says in its own body that its step methods are functions of tensors as well
    #: (`traceable_step = True`; not inherited, :func:`traceable_step_methods`).
    COMPILED_STEP_METHODS = ("draft_forward", "forward_with_pending", "with_pending", "draft_mask", "store_mask",
                             "denoise_step", "propose", "apply_edits", "edits", "commit_by_rule", "transfer",
                             "decodable", "current_sub_block", "tokens_per_step", "scheduled_masks", "finish_step",
                             "block_complete", "stream_read", "draft_canvas")
    traceable_step = True

    def runs_compiled_step(self) -> bool:
        """Whether each denoising step runs as one compiled function (:func:`denoising_step` through
        `StaticModelRunner.run_step`): the static runtime with `compile_config`, fused or separate cache writes (the
        writes compiled too, :attr:`compiled_write`), on a position-aligned model or a right-shifted one (Fast-dLLM
        v2, AR on an AR checkpoint: the step takes the carry as a tensor and returns it after storing); greedy, or
        sampling with transformers' position-independent warpers, the call's or each row's in a continuous batch
        (:func:`~hf_dllm_spec.maths.sampling.step_processors`; the random draw made before the step,
        :meth:`step_noise`); any
        remasking rule, whole blocks or sub-blocks; LLaDA2.1 token editing (`ThresholdEditRule`) and
        `num_to_transfer`; a streamer (batch 1: the read carries what it shows, :meth:`stream_read`); `cache_ver`
        and `draft_ver` (the masks built inside the step); a class whose step methods are traceable
        (:data:`COMPILED_STEP_METHODS`). Else the eager step."""
        s = self.session
        processors = s.sampler.logits_processor
        served = (getattr(s.target, "runs_compiled_carry_steps", False) if s.target.alignment == "right_shift"
                  else getattr(s.target, "runs_compiled_steps", False))
        return (served and step_processors(processors)
                and (self.edit_rule is None or type(self.edit_rule) is ThresholdEditRule)
                and traceable_step_methods(type(self), self.COMPILED_STEP_METHODS))

    @property
    def step_key(self) -> tuple:
        """What a compiled step specialises on besides its shapes: the strategy's class, rule and parameters, the
        caching and drafting masks, the edit rule's (built once per call), the sampler's (:attr:`Sampler.step_key`,
        read each step: a row joining with new sampling settings changes it)."""
        if self._step_key is None:
            cfg, rule = self.config, self.edit_rule
            self._step_key = (type(self).__qualname__, self.block_size, self.sub_block_size, self.steps_per_block,
                              cfg.remasking_strategy, cfg.confidence_threshold, cfg.eb_threshold, cfg.cache_ver,
                              cfg.draft_ver, self.num_to_transfer,
                              None if rule is None else (rule.editing_threshold, rule.max_post_steps),
                              self.session.mask_token_id, self.stream_columns)
        return (*self._step_key, self.session.sampler.step_key)

    @property
    def step_counters(self) -> tuple[str, ...]:
        """The per-row counters a compiled step returns in its read (last columns, in this order)."""
        return ("num_fallback_tokens",) + (("num_edited_tokens",) if self.edit_rule is not None else ())

    def step_noise(self, rows: int) -> torch.Tensor | None:
        """When sampling, the random draw of a compiled step, made before it (the step's choice is then a pure
        function, :func:`~hf_dllm_spec.maths.sampling.categorical_from_noise`): `Exp(1)` noise `(R, B, V)` float32
        for the `rows` rows of the batch, drawn by the sampler's generator(s) as the eager step's multinomial draws
        (:meth:`Sampler.draw_noise`: the same tokens, the generators left at the same state), in a buffer kept
        across steps and filled in place (a captured graph reads it at a fixed address); `R` is the runner's
        :attr:`step_rows` (the rows after `rows` are padding), one buffer per `R` (not a view of a larger one: the
        compiled step would guard on its base). None when greedy."""
        s = self.session
        if not s.sampler.do_sample:
            return None
        bucket = s.target.step_rows
        if bucket not in self._noise:
            self._noise[bucket] = torch.ones(bucket, self.block_size, output_vocab_size(s.target.model),
                                             device=s.target.device)
        return s.sampler.draw_noise(self._noise[bucket], rows)

    def step_carry(self, rows: int) -> torch.Tensor | None:
        """A compiled step's carry argument: on a right-shifted model the logits of each of the `rows` rows' last
        stored token, `(N, V)` (zeros before anything is stored: what the eager runner takes); None otherwise."""
        target = self.session.target
        if target.alignment != "right_shift":
            return None
        if target.carry is None:
            return torch.zeros(rows, output_vocab_size(target.model), device=target.device)
        return target.carry

    def compiled_denoise(self, block: BlockState, pending: tuple | None) -> tuple[torch.Tensor, list, tuple]:
        """One denoising step of every row as one compiled call (:func:`denoising_step`): the draft forward
        (storing `pending`), the proposal, edits and commits, the done flags and the step's read; updates `block`
        and the counters as the eager step does.

        Returns:
            `(done, read, advanced, streamed)`: `(N,)` bool; the step's one host read, per row `[done, num_fixed,
            *block tokens]` (:func:`step_read`; the counters each row adds, :attr:`step_counters`, are read with it,
            straight into its counters); the next blocks for :meth:`take_next_blocks`; with a streamer, row 0's
            :meth:`stream_read` columns as read (`[first masked, *draft canvas]`), else None.
        """
        s, B = self.session, self.block_size
        n = block.tokens.shape[0]
        for i in range(n):
            s.stats.row(i).num_denoising_steps += 1
        carry = self.step_carry(n)
        tensors = (block.tokens, block.undecided, block.start, block.num_fixed, block.step, block.post_steps,
                   *(pending if pending is not None else (None, None, None)), self.step_noise(n), carry)
        block.tokens, block.undecided, block.step, block.post_steps, done, read, *advanced = s.target.run_step(
            denoising_step, self, self.step_key, tensors, q=B if pending is None else 2 * B,
            store_len=0 if pending is None else B, logits_to_keep=B, kind="draft", sets_carry=carry is not None)
        rows, names = read.tolist(), self.step_counters
        streamed = self.take_stream_columns(rows)
        for i, row in enumerate(rows):
            stats = s.stats.row(i)
            for name, value in zip(names, row[-len(names):]):
                setattr(stats, name, getattr(stats, name) + value)
            del row[-len(names):]
        return done, rows, tuple(advanced), streamed

    def take_stream_columns(self, rows: list[list]) -> list[int] | None:
        """Cut the :meth:`stream_read` columns off the end of each row of a step's read (in place); return row 0's
        as ints, or None without a streamer."""
        if not self.stream_columns:
            return None
        streamed = [int(v) for v in rows[0][-self.stream_columns:]]
        for row in rows:
            del row[-self.stream_columns:]
        return streamed

    def compiled_cache_write(self, block: BlockState, done: torch.Tensor, done_rows: list[bool],
                             continuing: torch.Tensor) -> None:
        """:meth:`schedule_writes` with separate cache writes as one compiled call (:func:`cache_write_step`): the
        write of the finished blocks (`done` `(N,)`, `done_rows` its host read), the `continuing` rows' next
        blocks and the carry's commits; updates `block`, the runner's carry and the counters as the eager path."""
        s = self.session
        carry = self.step_carry(done.shape[0])
        if continuing is done:                                  # two arguments, one tensor: a guard would fail
            continuing = done.clone()
        tensors = (block.tokens, block.positions, done, continuing, block.undecided, block.start, block.num_fixed,
                   block.step, block.post_steps, carry)
        (block.tokens, block.undecided, block.start, block.num_fixed, block.step, block.post_steps,
         committed) = s.target.run_step(cache_write_step, self, ("cache_write", *self.step_key), tensors,
                                        q=self.block_size, store_len=self.block_size, logits_to_keep=1,
                                        kind="cache_write", rows=done_rows, sets_carry=carry is not None)
        if carry is not None:
            s.stats.accumulate("num_fallback_tokens", committed)


def cache_write_step(strategy: BlockDiffusionStrategy, runner, shape: tuple, lengths: torch.Tensor,
                     tokens: torch.Tensor, positions: torch.Tensor, done: torch.Tensor, continuing: torch.Tensor,
                     undecided: torch.Tensor, start: torch.Tensor, num_fixed: torch.Tensor, step: torch.Tensor,
                     post_steps: torch.Tensor, carry: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Algorithm 1's separate cache write as a function of tensors (what `StaticModelRunner.run_step` compiles):
    store the finished blocks (`done` rows; the others store padding), start the `continuing` rows' next blocks
    (:meth:`BlockState.restart`) and, on a right-shifted model, commit each new block's first token from the carry
    the write leaves (greedy; :meth:`~BlockDiffusionStrategy.commit_from_carry`). Nothing here reads the host.

    Args:
        strategy (`BlockDiffusionStrategy`), runner (`StaticModelRunner`), shape (`tuple`), lengths (`(N,)`): as in
            :func:`denoising_step`.
        tokens, positions (`(N, B)` int64): the blocks; done, continuing (`(N,)` bool): rows whose block is stored,
            rows that go on to a next block.
        undecided, start, num_fixed, step, post_steps: the other :class:`BlockState` fields.
        carry (`torch.Tensor` of shape `(N, V)`, *optional*): a right-shifted model's carry (None: position-aligned).

    Returns:
        `(lengths, [carry,] tokens, undecided, start, num_fixed, step, post_steps, committed)`: the new write
        positions, the carry after the write (right-shifted models only), the next blocks' fields and the tokens
        committed from the carry per row `(N,)` (Fast-dLLM v2's first token of each block).
    """
    B = strategy.block_size
    out = runner.step_forward(shape, tokens, positions, strategy.store_mask(positions), lengths, store_len=B,
                              store_valid=done[:, None].expand(-1, B), logits_to_keep=1, carry=carry,
                              return_carry=carry is not None)
    block = BlockState(tokens.clone(), undecided.clone(), start.clone(), num_fixed.clone(), step.clone(),
                       post_steps.clone(), strategy.session.mask_token_id)
    block.restart(continuing)
    committed = torch.zeros_like(start)
    if carry is not None:
        carry = out[2]
        committed = strategy.take_from_carry(block, carry)
    return (out[1], *(() if carry is None else (carry,)), block.tokens, block.undecided, block.start,
            block.num_fixed, block.step, block.post_steps, committed)


def traceable_step_methods(cls: type, names: tuple[str, ...]) -> bool:
    """Whether each method `names` of `cls` comes from a class that says `traceable_step = True` in its own body."""
    return all(vars(next(c for c in cls.__mro__ if name in vars(c))).get("traceable_step", False) for name in names)


def output_vocab_size(model) -> int:
    """V, the width of `model`'s logits (its output embeddings' rows; `config.vocab_size` without them)."""
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else model.config.get_text_config().vocab_size


def step_read(done: torch.Tensor, num_fixed: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The one tensor a step reads on the host, `(N, 2 + B)` int64: per row whether its block finished, its prompt
    tail length, its block's tokens."""
    return torch.cat([done[:, None].long(), num_fixed[:, None].to(done.device), tokens.to(done.device)], dim=1)


def draft_and_propose(strategy: BlockDiffusionStrategy, runner, shape: tuple, lengths: torch.Tensor,
                      block: BlockState, pending: tuple | None, noise: torch.Tensor | None,
                      carry: torch.Tensor | None) -> tuple:
    """The start of a compiled step (:func:`denoising_step`, S2D2's draft step): the draft forward of each row's
    block under the strategy's draft mask (`runner.step_forward`, storing the `pending` finished blocks
    `(tokens, positions, rows)` first) and the proposal (:meth:`BlockDiffusionStrategy.propose`, with `noise` when
    sampling). Returns `(lengths (N,), carry or None, logits (N, B, V), (probs (N, B, V), proposal (N, B),
    confidence (N, B)))`."""
    ids, positions, intra, store_len, store_valid = strategy.with_pending(block.tokens, block.positions,
                                                                          strategy.draft_mask(block), pending)
    logits, lengths, carry = runner.step_forward(shape, ids, positions, intra, lengths, store_len=store_len,
                                                 store_valid=store_valid, logits_to_keep=strategy.block_size,
                                                 carry=carry, return_carry=True)
    return lengths, carry, logits, strategy.propose(logits, noise)


def denoising_step(strategy: BlockDiffusionStrategy, runner, shape: tuple, lengths: torch.Tensor,
                   tokens: torch.Tensor, undecided: torch.Tensor, start: torch.Tensor, num_fixed: torch.Tensor,
                   step: torch.Tensor, post_steps: torch.Tensor, pending_tokens: torch.Tensor | None = None,
                   pending_positions: torch.Tensor | None = None, pending_rows: torch.Tensor | None = None,
                   noise: torch.Tensor | None = None, carry: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """One denoising step of every row as a function of tensors (Algorithm 2 with Algorithm 1's fused cache
    write), what `StaticModelRunner.run_step` compiles: the draft forward of each row's block
    (`runner.step_forward`, storing the pending finished blocks first), the proposal (the argmax, or a token drawn
    with `noise`, the random draw made before the step), token edits (LLaDA2.1), the commits of the remasking rule,
    the done flags (with editing: the post steps), the step's read; and the next blocks of the rows whose block
    finished (:meth:`BlockState.restart`), so that Algorithm 1's block change costs no eager work. The strategy's
    own methods decide, as in its eager step; nothing here reads the host or changes Python state.

    Args:
        strategy (`BlockDiffusionStrategy`): its rule and parameters (:meth:`~BlockDiffusionStrategy.transfer`).
        runner (`StaticModelRunner`), shape (`tuple`), lengths (`torch.Tensor` of shape `(N,)`): from `run_step`.
        tokens, undecided, start, num_fixed, step, post_steps: the :class:`BlockState` fields, `(N, B)` / `(N,)`.
        pending_tokens, pending_positions (`(N, B)`), pending_rows (`(N,)` bool): the finished blocks to store, or
            None.
        noise (`torch.Tensor` of shape `(N, B, V)`, float32, *optional*): when sampling,
            :meth:`~BlockDiffusionStrategy.step_noise`.
        carry (`torch.Tensor` of shape `(N, V)`, *optional*): a right-shifted model's carry (None: position-aligned).

    Returns:
        `(lengths, [carry,] tokens, undecided, step, post_steps, done, read, *next)`: the new write positions
        `(N,)`, the carry after the step (right-shifted models only: changed where the step stored a block), the
        block's new tokens and masks `(N, B)`, the steps and post steps taken `(N,)`, the finished rows `(N,)` bool,
        :func:`step_read` with the counters of :attr:`~BlockDiffusionStrategy.step_counters`, then a streamer's
        columns (:meth:`~BlockDiffusionStrategy.stream_read`); `next`:
        the next step's `tokens, undecided, start, num_fixed, step, post_steps` (finished blocks restarted) and the
        positions `(N, B)` of this step's blocks.
    """
    block = BlockState(tokens, undecided, start, num_fixed, step, post_steps, strategy.session.mask_token_id)
    began_full = ~block.masked.any(dim=1) if strategy.edit_rule is not None else None
    pending = None if pending_tokens is None else (pending_tokens, pending_positions, pending_rows)
    lengths, carry, logits, (probs, proposal, confidence) = draft_and_propose(strategy, runner, shape, lengths,
                                                                              block, pending, noise, carry)
    began = BlockState(tokens, undecided, start, num_fixed, step, post_steps, block.mask_token_id)
    counts, edited = [], None
    if strategy.edit_rule is not None:
        edits = strategy.edits(block, probs, proposal, confidence)
        block.tokens = torch.where(edits, proposal, block.tokens)
        edited, counts = edits.any(dim=1), [edits.sum(dim=1)]
    transfer = strategy.transfer(block, probs, confidence)
    block.tokens = torch.where(transfer, proposal, block.tokens)
    block.undecided = block.undecided & ~transfer
    done = strategy.block_complete(block, began_full, edited)
    read = torch.cat([step_read(done, num_fixed, block.tokens), torch.stack([transfer.sum(dim=1), *counts], dim=1),
                      strategy.stream_read(began, block.undecided, logits)], dim=1)
    after = BlockState(block.tokens.clone(), block.undecided.clone(), start.clone(), num_fixed.clone(), step + 1,
                       block.post_steps.clone(), block.mask_token_id)
    after.restart(done)
    return (lengths, *(() if carry is None else (carry,)), block.tokens, block.undecided, step + 1, block.post_steps,
            done, read, after.tokens, after.undecided, after.start, after.num_fixed, after.step, after.post_steps,
            block.positions)


class ARStrategy(BlockDiffusionStrategy):
    """Autoregressive decoding of a block-diffusion model: block size 1 (S2D2's AR baseline).

    On a right-shifted model (every AR checkpoint) this is plain greedy / sampled AR decoding.
    """

    name = "ar"
    config_class = ARConfig
    paper = "S2D2 §5 AR baseline (block size 1)"
