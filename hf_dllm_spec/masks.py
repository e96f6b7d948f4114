"""Attention patterns as pure functions.

Every builder returns a bool matrix, True = may attend, rows = queries, columns = keys. The runner adds the
cache columns (:func:`with_cache_prefix`) and converts to the additive float mask transformers needs
(:func:`to_additive`; a 4D bool mask is silently wrong with the eager attention, platform.md).
"""

from __future__ import annotations

import torch


def causal_mask(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Token-causal pattern, `(length, length)` bool: row i sees j <= i (block size 1)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def full_mask(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """All-visible pattern, `(length, length)` bool: one block under block diffusion."""
    return torch.ones(length, length, dtype=torch.bool, device=device)


def block_causal_mask(
    length: int, block_size: int, *, start: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    """Block-causal pattern over tokens at absolute positions ``start .. start + length - 1``.

    Blocks are counted from absolute position 0 (families.md §0 rule 1): row i sees column j iff
    ``(start + j) // block_size <= (start + i) // block_size``. Block size 1 gives :func:`causal_mask`.

    Returns:
        `torch.Tensor` of shape `(length, length)`, bool.
    """
    block_id = (torch.arange(length, device=device) + start) // block_size
    return block_id[None, :] <= block_id[:, None]


def partially_causal_draft_mask(
    block_size: int, first_masked: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """S2D2 Eq. 4, the drafting mask of AR-like decoding (`draft_ver`).

    With j the first masked index of the block, rows < j (the decoded prefix) are causal among themselves and
    see nothing from j on; rows >= j see the whole block. The prefix K/V then equal those of a causal forward.

    Returns:
        `torch.Tensor` of shape `(block_size, block_size)`, bool.
    """
    mask = full_mask(block_size, device)
    mask[:first_masked] = causal_mask(block_size, device)[:first_masked]
    return mask


def verifier_2l_mask(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """S2D2 Eq. 3: M_ver = [[A_L, 0], [A_L^<, I_L]] over the input [drafted block | MASK copy].

    First half row i (a drafted or committed token) sees first-half j <= i; second-half row i (a MASK at the
    same position as i) sees first-half j < i and itself. The logits of second-half row i are then exactly the
    block-size-1 (AR mode) prediction for position i given everything to its left.

    Returns:
        `torch.Tensor` of shape `(2 * length, 2 * length)`, bool.
    """
    mask = torch.zeros(2 * length, 2 * length, dtype=torch.bool, device=device)
    mask[:length, :length] = causal_mask(length, device)
    mask[length:, :length] = causal_mask(length, device).tril(-1)
    mask[length:, length:] = torch.eye(length, dtype=torch.bool, device=device)
    return mask


def concat_segments(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Pattern of two segments where the second sees all of the first and the first never sees the second.

    Used to fuse a finished block's cache write with the next block's first denoising forward.

    Args:
        first (`torch.Tensor` of shape `(a, a)`), second (`torch.Tensor` of shape `(b, b)`).

    Returns:
        `torch.Tensor` of shape `(a + b, a + b)`, bool.
    """
    a, b = first.shape[0], second.shape[0]
    mask = torch.zeros(a + b, a + b, dtype=torch.bool, device=first.device)
    mask[:a, :a] = first
    mask[a:, :a] = True
    mask[a:, a:] = second
    return mask


def with_cache_prefix(intra: torch.Tensor, cache_len: int) -> torch.Tensor:
    """Prepend `cache_len` columns every query row sees: `(q, q) -> (q, cache_len + q)` bool."""
    prefix = torch.ones(intra.shape[0], cache_len, dtype=torch.bool, device=intra.device)
    return torch.cat([prefix, intra], dim=1)


def to_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool `(q, kv)` -> additive float `(1, 1, q, kv)`: 0 where allowed, `finfo(dtype).min` elsewhere."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    out.masked_fill_(~mask, torch.finfo(dtype).min)
    return out[None, None]
