"""Slow, obviously correct decoders used as test oracles: no cache, no fused writes, no speculation.

Every denoising step re-runs the whole sequence `[prompt | finished blocks | current block]` through the
model with the block-causal mask of the block grid (blocks counted from position 0), exactly the visibility
the cached loop encodes. Greedy only.
"""

from __future__ import annotations

import torch

from ..maths.masks import block_causal_mask, to_additive
from ..maths.unmasking import num_transfer_tokens, select_transfer


@torch.no_grad()
def reference_block_diffusion_generate(
    model,
    prompt_ids: torch.Tensor,
    *,
    mask_token_id: int,
    block_size: int,
    max_new_tokens: int,
    remasking_strategy: str = "low_confidence_static",
    confidence_threshold: float = 0.85,
    steps_per_block: int | None = None,
) -> torch.Tensor:
    """Greedy block diffusion by full recomputation (S2D2 Algorithms 1-2 without a cache).

    Args:
        model: a position-aligned model taking a 4D float mask and explicit `position_ids`.
        prompt_ids (`torch.Tensor` of shape `(P,)`).
        mask_token_id (`int`), block_size (`int`), max_new_tokens (`int`): whole blocks are decoded until
            at least `max_new_tokens` tokens exist; no stop ids.
        remasking_strategy, confidence_threshold, steps_per_block: as in `BlockDiffusionConfig`.

    Returns:
        `torch.Tensor` of shape `(n,)`, the generated tokens (whole blocks, untrimmed). Block size 1 gives
        greedy AR decoding of the same model.
    """
    seq = prompt_ids.clone()
    generated = 0
    aligned = (prompt_ids.shape[0] // block_size) * block_size
    block_start = aligned
    while generated < max_new_tokens:
        num_masks = block_size - (seq.shape[0] - block_start)
        seq = torch.cat([seq, torch.full((num_masks,), mask_token_id, dtype=torch.long, device=seq.device)])
        schedule = num_transfer_tokens(block_size, steps_per_block or block_size)     # the block's (SDAR)
        step = 0
        while bool((seq[block_start:] == mask_token_id).any()):
            positions = torch.arange(seq.shape[0], device=seq.device)[None]
            mask = to_additive(block_causal_mask(positions, block_size), model.dtype)
            logits = model(input_ids=seq[None], position_ids=positions, attention_mask=mask).logits[0, block_start:]
            logits = logits.float()
            logits[:, mask_token_id] = float("-inf")
            probs = torch.softmax(logits, dim=-1)
            conf, tokens = probs.max(dim=-1)
            masked = seq[block_start:] == mask_token_id
            transfer = select_transfer(remasking_strategy, masked=masked[None], confidence=conf[None],
                                       num_tokens=schedule[min(step, len(schedule) - 1)],
                                       confidence_threshold=confidence_threshold)[0]
            seq[block_start:][transfer] = tokens[transfer]
            step += 1
        generated += num_masks
        block_start += block_size
    return seq[prompt_ids.shape[0]:]
