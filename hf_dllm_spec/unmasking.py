"""Which masked positions a denoising step commits (S2D2 Algorithm 2; strategies.md §2.3).

Pure functions over one block. Rules (`remasking_strategy`):

- ``sequential``: the first k masked positions, left to right.
- ``low_confidence_static``: the k most confident masked positions.
- ``low_confidence_dynamic``: every masked position with confidence > `confidence_threshold` when there are
  at least k of them, else the k most confident (always at least one: Fast-dLLM #42).
- ``entropy_bounded``: masked positions by ascending per-position entropy; the shortest prefix whose
  cumulative entropy reaches `eb_threshold`, at least k. (The SDAR reference computes its "entropy" from
  the scalar confidence and leaves the transfer set uninitialised; not copied.)

k is the schedule of :func:`num_transfer_tokens` clamped to the masks left.
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


def select_transfer(
    rule: str,
    *,
    masked: torch.Tensor,
    confidence: torch.Tensor,
    num_tokens: int,
    confidence_threshold: float = 0.85,
    entropies: torch.Tensor | None = None,
    eb_threshold: float = 0.35,
) -> torch.Tensor:
    """Positions to commit this step.

    Args:
        rule (`str`): one of :data:`REMASKING_STRATEGIES`.
        masked (`torch.Tensor` of shape `(B,)`, bool): positions still masked.
        confidence (`torch.Tensor` of shape `(B,)`, float32): probability of the chosen token per position.
        num_tokens (`int`): k, tokens the schedule asks for; clamped to [1, number of masks].
        confidence_threshold (`float`): tau of the dynamic rule, a probability in (0, 1].
        entropies (`torch.Tensor` of shape `(B,)`, *optional*): per-position entropy in nats (entropy_bounded).
        eb_threshold (`float`): cumulative entropy budget in nats (entropy_bounded).

    Returns:
        `torch.Tensor` of shape `(B,)`, bool, a subset of `masked` with at least one True when any is masked.

    Raises:
        ValueError: for an unknown rule, or `entropy_bounded` without `entropies`.
    """
    num_masked = int(masked.sum())
    transfer = torch.zeros_like(masked)
    if num_masked == 0:
        return transfer
    k = max(1, min(num_tokens, num_masked))
    masked_idx = masked.nonzero().squeeze(-1)
    if rule == "sequential":
        transfer[masked_idx[:k]] = True
        return transfer
    if rule in ("low_confidence_static", "low_confidence_dynamic"):
        conf = confidence[masked_idx]
        if rule == "low_confidence_dynamic":
            confident = conf > confidence_threshold
            if int(confident.sum()) >= k:
                transfer[masked_idx[confident]] = True
                return transfer
        transfer[masked_idx[conf.topk(k).indices]] = True
        return transfer
    if rule == "entropy_bounded":
        if entropies is None:
            raise ValueError("select_transfer: `entropy_bounded` needs per-position `entropies` of shape (B,).")
        ent = entropies[masked_idx]
        order = ent.argsort()
        cumulative = ent[order].cumsum(0)
        reached = (cumulative >= eb_threshold).nonzero()
        count = int(reached[0, 0]) + 1 if reached.numel() else num_masked
        transfer[masked_idx[order[: max(count, k)]]] = True
        return transfer
    raise ValueError(
        f"`remasking_strategy` (={rule!r}) must be one of {', '.join(map(repr, REMASKING_STRATEGIES))}; "
        "pick one of them."
    )
