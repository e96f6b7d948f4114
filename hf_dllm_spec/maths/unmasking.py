"""Which masked positions a denoising step commits (S2D2 Algorithm 2; SDAR's `block_diffusion_generate`).

Pure functions over a batch of blocks, `(N, B)`; every row is decided on its own. Rules
(`remasking_strategy`):

- ``sequential``: the first k masked positions, left to right.
- ``low_confidence_static``: the k most confident masked positions (ties: the leftmost first).
- ``low_confidence_dynamic``: every masked position with confidence > `confidence_threshold` when there are
  at least k of them, else the k most confident (always at least one: Fast-dLLM #42).
- ``entropy_bounded``: masked positions by ascending per-position entropy; the shortest prefix whose
  cumulative entropy reaches `eb_threshold`, at least k. (The SDAR reference computes its "entropy" from
  the scalar confidence and leaves the transfer set uninitialised; not copied.)

k is the schedule of :func:`num_transfer_tokens` clamped to [1, masks left] (0 for a row without masks).
:func:`first_masked_span` gives each row's first contiguous masked span (S2D2's C_t; its start is the first
masked position used by the drafting mask and by streaming).
"""

from __future__ import annotations

import torch

REMASKING_STRATEGIES = ("low_confidence_dynamic", "low_confidence_static", "sequential", "entropy_bounded")


def num_transfer_tokens(block_size: int, steps: int) -> list[int]:
    """Tokens to commit at each of `steps` denoising steps of a block of `block_size` masks.

    base = block_size // steps; the first block_size % steps steps get one more.
    Examples: (4, 4) -> [1, 1, 1, 1]; (8, 3) -> [3, 3, 2].

    Returns:
        `list[int]` of length `steps`, summing to `block_size`. Source: SDAR `get_num_transfer_tokens`.
    """
    base, extra = divmod(block_size, steps)
    return [base + 1 if s < extra else base for s in range(steps)]


def scheduled_tokens(num_masks: torch.Tensor, steps_per_block: int, step: torch.Tensor) -> torch.Tensor:
    """k for each row this step: entry `step` of ``num_transfer_tokens(num_masks, min(steps_per_block, num_masks))``.

    Steps past the schedule reuse its last entry.

    Args:
        num_masks (`torch.Tensor` of shape `(N,)`, int64): masks the row's block started with (>= 1).
        steps_per_block (`int`): S.
        step (`torch.Tensor` of shape `(N,)`, int64): denoising steps already taken in the row's block.

    Returns:
        `torch.Tensor` of shape `(N,)`, int64, tokens to commit.
    """
    steps = num_masks.clamp(max=steps_per_block)
    base, extra = num_masks // steps, num_masks % steps
    s = torch.minimum(step, steps - 1)
    return base + (s < extra).long()


def _rank(score: torch.Tensor, descending: bool) -> torch.Tensor:
    """Rank of each entry in its row under a stable sort, `(N, B) -> (N, B)` int64."""
    order = score.argsort(dim=-1, descending=descending, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(score.shape[-1], device=score.device).expand_as(order))
    return rank


def select_transfer(
    rule: str,
    *,
    masked: torch.Tensor,
    confidence: torch.Tensor,
    num_tokens: torch.Tensor | int,
    confidence_threshold: float = 0.85,
    entropies: torch.Tensor | None = None,
    eb_threshold: float = 0.35,
) -> torch.Tensor:
    """Positions to commit this step, per row.

    Args:
        rule (`str`): one of :data:`REMASKING_STRATEGIES`.
        masked (`torch.Tensor` of shape `(N, B)`, bool): positions still masked.
        confidence (`torch.Tensor` of shape `(N, B)`, float32): probability of the chosen token per position.
        num_tokens (`torch.Tensor` of shape `(N,)` or `int`): k, tokens the schedule asks for; clamped to
            [1, masks left].
        confidence_threshold (`float`): tau of the dynamic rule, a probability in (0, 1].
        entropies (`torch.Tensor` of shape `(N, B)`, *optional*): per-position entropy in nats (entropy_bounded).
        eb_threshold (`float`): cumulative entropy budget in nats (entropy_bounded).

    Returns:
        `torch.Tensor` of shape `(N, B)`, bool, a subset of `masked` with at least one True in every row that
        has a mask.

    Raises:
        ValueError: for an unknown rule, or `entropy_bounded` without `entropies`.
    """
    num_masked = masked.sum(dim=-1)
    k = (num_tokens.expand_as(num_masked) if isinstance(num_tokens, torch.Tensor)
         else torch.full_like(num_masked, num_tokens))        # (a device fill: no host copy in a CUDA graph)
    k = torch.minimum(k.clamp(min=1), num_masked)[:, None]                      # (N, 1)
    if rule == "sequential":
        return masked & (masked.long().cumsum(dim=-1) <= k)
    if rule in ("low_confidence_static", "low_confidence_dynamic"):
        score = confidence.masked_fill(~masked, float("-inf"))
        top_k = masked & (_rank(score, descending=True) < k)
        if rule == "low_confidence_static":
            return top_k
        confident = masked & (confidence > confidence_threshold)
        enough = confident.sum(dim=-1, keepdim=True) >= k
        return torch.where(enough, confident, top_k)
    if rule == "entropy_bounded":
        if entropies is None:
            raise ValueError("select_transfer: `entropy_bounded` needs per-position `entropies` of shape (N, B).")
        score = entropies.masked_fill(~masked, float("inf"))
        cumulative = score.sort(dim=-1, stable=True).values.cumsum(dim=-1)     # masked first; inf after them
        reached = cumulative >= eb_threshold
        first = torch.where(reached.any(dim=-1), reached.float().argmax(dim=-1) + 1, num_masked)
        count = torch.minimum(first, num_masked)[:, None]
        return masked & (_rank(score, descending=False) < torch.maximum(count, k))
    raise ValueError(
        f"`remasking_strategy` (={rule!r}) must be one of {', '.join(map(repr, REMASKING_STRATEGIES))}; "
        "pick one of them."
    )


def first_masked_span(masked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """C_t per row: `[start, end)` of the first contiguous run of True in `masked` `(N, B)`; `(B, B)` if none.

    Returns:
        `(start, end)`, each `torch.Tensor` of shape `(N,)`, int64.
    """
    width = masked.shape[1]
    idx = torch.arange(width, device=masked.device)[None]
    has_mask = masked.any(dim=1)
    none = torch.full(has_mask.shape, width, dtype=torch.long, device=masked.device)
    start = torch.where(has_mask, masked.float().argmax(dim=1).long(), none)
    after = ~masked & (idx >= start[:, None])
    end = torch.where(after.any(dim=1), after.float().argmax(dim=1).long(), torch.full_like(start, width))
    return start, torch.where(has_mask, end, start)
