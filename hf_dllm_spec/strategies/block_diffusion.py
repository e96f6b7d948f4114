"""Block-diffusion decoding with confidence-based unmasking (S2D2 paper Algorithms 1-2).

Block grid from absolute position 0; the prompt's aligned part is prefilled, its tail shares the first block
with the masks and is never edited. Denoising forwards read the cache; each finished block is written once,
either in its own forward (`fuse_cache_write=False`, the reference accounting) or together with the next
block's first denoising forward (`fuse_cache_write=True`, default): one input `[finished block | next block]`
whose first rows see only the cache and themselves, so their K/V are exactly those of a separate write.
Block size 1 is autoregressive decoding of the same model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..configuration import ARConfig, BlockDiffusionConfig
from ..masks import block_causal_mask, causal_mask, concat_segments, full_mask, partially_causal_draft_mask
from ..sampling import entropy
from ..timing import now
from ..unmasking import num_transfer_tokens, select_transfer
from .base import DecodingStrategy


@dataclass
class BlockState:
    """The block being denoised.

    Attributes:
        tokens (`torch.Tensor` of shape `(B,)`, int64): block content, MASK where undecided.
        start (`int`): absolute position of `tokens[0]`.
        num_fixed (`int`): leading prompt-tail positions (never edited, never verified).
        schedule (`list[int]`): tokens to commit per denoising step (`num_transfer_tokens`).
        mask_token_id (`int`).
        step (`int`): denoising steps taken in this block.
    """

    tokens: torch.Tensor
    start: int
    num_fixed: int
    schedule: list[int]
    mask_token_id: int
    step: int = 0

    @property
    def masked(self) -> torch.Tensor:
        """`(B,)` bool, positions still masked."""
        return self.tokens == self.mask_token_id

    @property
    def positions(self) -> torch.Tensor:
        """`(B,)` int64 absolute positions."""
        return torch.arange(self.start, self.start + self.tokens.shape[0], device=self.tokens.device)

    @property
    def scheduled_tokens(self) -> int:
        """k for this step; steps past the schedule reuse its last entry."""
        return self.schedule[min(self.step, len(self.schedule) - 1)]


class BlockDiffusionStrategy(DecodingStrategy):
    """Block diffusion with `low_confidence_dynamic` / `_static`, `sequential` or `entropy_bounded` unmasking.

    Source: S2D2 (arXiv 2603.25702) Algorithms 1-2; SDAR `block_diffusion_generate` (strategies.md §2).
    """

    name = "block_diffusion"
    config_class = BlockDiffusionConfig
    paper = "S2D2 Algorithms 1-2 (arXiv 2603.25702); SDAR block_diffusion_generate"
    lossless = False

    def __init__(self, config, session, *, block_size: int) -> None:
        super().__init__(config, session)
        self.block_size = block_size
        self.steps_per_block = config.steps_per_block or block_size

    # -- Algorithm 1: the outer loop -------------------------------------------------------------------------
    def decode(self) -> torch.Tensor:
        s, B = self.session, self.block_size
        device = s.prompt_ids.device
        aligned = (s.prompt_ids.shape[0] // B) * B
        if aligned:
            self.prefill(s.prompt_ids[:aligned])
        generated = torch.empty(0, dtype=torch.long, device=device)
        tail, pending = s.prompt_ids[aligned:], None
        start = aligned
        while True:
            block = self.new_block(tail, start)
            while bool(block.masked.any()):
                logits = self.draft_forward(block, pending)
                pending = None
                self.denoise_step(block, logits)
                block.step += 1
            new_tokens = block.tokens[block.num_fixed:]
            s.stats.num_committed_tokens += new_tokens.shape[0]
            generated = torch.cat([generated, new_tokens])
            stop = self.should_stop(generated)
            if not self.config.fuse_cache_write:
                self.write_block(block)
            elif not stop:
                pending = block
            if stop:
                return generated
            tail, start = tail[:0], start + B

    def new_block(self, tail: torch.Tensor, start: int) -> BlockState:
        """A block of `block_size` positions: the prompt tail, then masks."""
        s = self.session
        masks = torch.full((self.block_size - tail.shape[0],), s.mask_token_id, dtype=torch.long, device=tail.device)
        schedule = num_transfer_tokens(masks.shape[0], min(self.steps_per_block, masks.shape[0]))
        return BlockState(torch.cat([tail, masks]), start, tail.shape[0], schedule, s.mask_token_id)

    # -- forwards ---------------------------------------------------------------------------------------------
    def store_mask(self, length: int, start: int) -> torch.Tensor:
        """Visibility among tokens being stored: token-causal with `cache_ver`, else block-causal."""
        device = self.session.prompt_ids.device
        if self.config.cache_ver:
            return causal_mask(length, device)
        return block_causal_mask(length, self.block_size, start=start, device=device)

    def prefill(self, prompt: torch.Tensor) -> None:
        """Store the block-aligned prompt (1 forward, counted as prefill)."""
        s = self.session
        t0 = now(s.runner.device)
        positions = torch.arange(prompt.shape[0], device=prompt.device)
        s.runner.forward(prompt, positions, self.store_mask(prompt.shape[0], 0), kind="prefill",
                         store_len=prompt.shape[0], logits_to_keep=1)
        s.stats.prefill_time_s += now(s.runner.device) - t0

    def write_block(self, block: BlockState) -> None:
        """Separate cache-write forward of a finished block (Algorithm 1 line 5; 1 forward)."""
        self.session.runner.forward(block.tokens, block.positions, self.store_mask(self.block_size, block.start),
                                    kind="cache_write", store_len=self.block_size, logits_to_keep=1)

    def draft_mask(self, block: BlockState) -> torch.Tensor:
        """Visibility inside the block while denoising: full, or S2D2 Eq. 4 with `draft_ver`."""
        device = block.tokens.device
        if self.config.draft_ver:
            masked = block.masked.nonzero()
            first = int(masked[0, 0]) if masked.numel() else self.block_size
            return partially_causal_draft_mask(self.block_size, first, device)
        return full_mask(self.block_size, device)

    def draft_forward(self, block: BlockState, pending: BlockState | None) -> torch.Tensor:
        """Denoising forward of the block (cache read-only), fused with the write of `pending` if given.

        Returns:
            `torch.Tensor` of shape `(B, V)`, float32 draft logits of the block.
        """
        s = self.session
        ids, positions, intra, store_len = block.tokens, block.positions, self.draft_mask(block), 0
        if pending is not None:
            ids = torch.cat([pending.tokens, ids])
            positions = torch.cat([pending.positions, positions])
            intra = concat_segments(self.store_mask(self.block_size, pending.start), intra)
            store_len = self.block_size
        s.stats.num_denoising_steps += 1
        return s.runner.forward(ids, positions, intra, kind="draft", store_len=store_len,
                                logits_to_keep=self.block_size)

    # -- Algorithm 2: one denoising step -----------------------------------------------------------------------
    def denoise_step(self, block: BlockState, logits: torch.Tensor) -> None:
        """Draw tokens for every position and commit masked ones by the confidence rule."""
        probs = self.session.sampler.probs(logits)
        tokens, confidence = self.session.sampler.choose(probs)
        self.commit_by_rule(block, probs, tokens, confidence)

    def commit_by_rule(self, block: BlockState, probs: torch.Tensor, tokens: torch.Tensor,
                       confidence: torch.Tensor) -> int:
        """Commit the positions `remasking_strategy` selects; return how many (>= 1 while masks remain)."""
        cfg = self.config
        transfer = select_transfer(
            cfg.remasking_strategy, masked=block.masked, confidence=confidence, num_tokens=block.scheduled_tokens,
            confidence_threshold=cfg.confidence_threshold, eb_threshold=cfg.eb_threshold,
            entropies=entropy(probs) if cfg.remasking_strategy == "entropy_bounded" else None,
        )
        block.tokens[transfer] = tokens[transfer]
        committed = int(transfer.sum())
        self.session.stats.num_fallback_tokens += committed
        return committed


class ARStrategy(BlockDiffusionStrategy):
    """Autoregressive decoding of a block-diffusion model: block size 1 (S2D2's AR baseline)."""

    name = "ar"
    config_class = ARConfig
    paper = "S2D2 §5 AR baseline (block size 1)"

