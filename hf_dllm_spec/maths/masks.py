"""Attention patterns as pure functions.

Every builder returns a bool tensor, True = may attend, rows = queries, columns = keys. Builders whose pattern
is the same for every row of a batch return `(q, q)`; builders that depend on per-row positions return
`(N, q, q)`. The runner broadcasts `(q, q)` over the batch, adds the cache columns (per-row validity of the
stored tokens) and converts to the additive float mask transformers needs (:func:`to_additive`; a 4D bool mask
is silently wrong with the eager attention in transformers 5.x; a float additive mask is right with both sdpa
and eager).
"""

from __future__ import annotations

import torch


def causal_mask(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Token-causal pattern, `(length, length)` bool: row i sees j <= i (block size 1)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def left_padded_valid(lengths: torch.Tensor | list[int], width: int,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """Real (non-padding) columns of left-padded rows, `(N, width)` bool: True in the last `lengths[n]` columns."""
    lengths = torch.as_tensor(lengths, device=device)
    return torch.arange(width, device=lengths.device)[None] >= (width - lengths)[:, None]


def left_pad(rows: list[torch.Tensor], device: torch.device | str | None = None,
             starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad token rows to the longest one.

    Args:
        rows (`list[torch.Tensor]`): N rows of token ids, `(L_n,)` int64 (may be empty).
        device: where the outputs live.
        starts (`torch.Tensor` of shape `(N,)`, int64, *optional*): the absolute position of each row's first
            token; 0 when omitted.

    Returns:
        `(ids, valid, positions)`, each `(N, W)` with W = max L_n: ids (padding 0), the real columns
        (:func:`left_padded_valid`), and absolute positions (padding clamped to 0; nobody sees it).
    """
    sizes = [r.shape[0] for r in rows]
    lengths = torch.tensor(sizes, dtype=torch.long, device=device)
    width = max(sizes, default=0)                                            # on the host: no device read
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for n, row in enumerate(rows):
        if row.shape[0]:
            ids[n, width - row.shape[0]:] = row
    start = starts if starts is not None else torch.zeros_like(lengths)
    positions = ((start + lengths)[:, None] - width + torch.arange(width, device=device)[None]).clamp(min=0)
    return ids, left_padded_valid(lengths, width, device), positions


def full_mask(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """All-visible pattern, `(length, length)` bool: one block under block diffusion."""
    return torch.ones(length, length, dtype=torch.bool, device=device)


def block_causal_mask(positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block-causal pattern over tokens at the given absolute positions.

    Blocks are counted from absolute position 0, prompt included, as in SDAR, Fast-dLLM v2 and LLaDA2 (a prompt
    tail shares the first generation block): row i sees column j iff
    ``positions[j] // block_size <= positions[i] // block_size``. Block size 1 gives the token-causal pattern.

    Args:
        positions (`torch.Tensor` of shape `(N, q)` or `(q,)`, int64): absolute position of each query token.
        block_size (`int`): block size in tokens.

    Returns:
        `torch.Tensor` of shape `(N, q, q)` (or `(q, q)`), bool.
    """
    block_id = positions // block_size
    return block_id[..., None, :] <= block_id[..., :, None]


def partially_causal_draft_mask(block_size: int, first_masked: torch.Tensor) -> torch.Tensor:
    """S2D2 Eq. 4, the drafting mask of AR-like decoding (`draft_ver`), one per row.

    With j the first masked index of the row's block, rows < j (the decoded prefix) are causal among themselves
    and see nothing from j on; rows >= j see the whole block. The prefix K/V then equal those of a causal forward.

    Args:
        block_size (`int`): B, in tokens.
        first_masked (`torch.Tensor` of shape `(N,)`, int64): j per row (B when the block has no mask).

    Returns:
        `torch.Tensor` of shape `(N, B, B)`, bool.
    """
    idx = torch.arange(block_size, device=first_masked.device)
    row, col = idx[None, :, None], idx[None, None, :]
    prefix_row = row < first_masked[:, None, None]
    return torch.where(prefix_row, col <= row, torch.ones_like(prefix_row))


def verifier_2l_mask(length: int, device: torch.device | str | None = None, span_start: int = 0) -> torch.Tensor:
    """S2D2 Eq. 3: M_ver = [[A_L, 0], [A_L^<, I_L]] over the input [drafted block | MASK copy].

    First half row i (a drafted or committed token) sees first-half j <= i; second-half row i (a MASK at the
    same position as i) sees first-half j < i and itself. The logits of second-half row i are then exactly the
    block-size-1 (AR mode) prediction for position i given everything to its left (position-aligned models).

    With `span_start` = S > 0 the MASK copies cover positions S..L-1 only (the span-width verifier: the copies
    of positions before the span are never read, and the first half ends where the span ends, so the caller
    passes L = the span end). Each kept copy sees exactly what it sees in the full layout, so its logits are
    the same; the width is L + (L - S) instead of 2B.

    Args:
        length (`int`): L, the first half's length (B for the full layout, the span end for the narrow one).
        span_start (`int`, defaults to 0): S, the first position with a MASK copy, 0 <= S < L.

    Returns:
        `torch.Tensor` of shape `(2L - S, 2L - S)`, bool.
    """
    copies = length - span_start
    mask = torch.zeros(length + copies, length + copies, dtype=torch.bool, device=device)
    mask[:length, :length] = causal_mask(length, device)
    mask[length:, :length] = causal_mask(length, device).tril(-1)[span_start:]
    mask[length:, length:] = torch.eye(copies, dtype=torch.bool, device=device)
    return mask


def temporal_verify_mask(reveal_step: torch.Tensor) -> torch.Tensor:
    """SimSD Eq. 1, the token-level temporal causal mask of the paired layout ``[data section | mask section]``.

    Both sections cover the same B block positions (mask slot k copies data position k's RoPE position). With
    tau = `reveal_step` (0 = known before drafting: the prompt tail and earlier commits, SimSD's "leftover"):

    - data row i sees data j iff tau(j) <= tau(i) (leftover rows see the leftover only);
    - data row i (drafted) sees mask slot j iff tau(j) > tau(i) (leftover rows never see data or masks, the
      reference's deliberate deviation from native SDAR);
    - mask slot i (drafted) sees data j iff tau(j) < tau(i), leftover included;
    - mask slot i sees mask slot j iff tau(j) >= tau(i), both drafted.

    Mask slot i thus sees the block as it was just before reveal step tau(i) and data row i as just after it.
    Mask slots of leftover positions are dummies that see only themselves (their logits are never read).
    Each slot's *keys* carry the hidden states of their own step, so beyond the first layer the slot's logits
    approximate a separate forward over that block state (exact for one layer; SimSD §4.3).

    Args:
        reveal_step (`torch.Tensor` of shape `(N, B)`, int64): the drafter's step map, 0 for known positions and
            1.. for the step at which each drafted position was revealed (equal steps: revealed together).

    Returns:
        `torch.Tensor` of shape `(N, 2B, 2B)`, bool. Source: SimSD (Cui et al.) §3.1 Eq. 1; `strategies.md` §6.3.
    """
    width = reveal_step.shape[1]
    t_row, t_col = reveal_step[:, :, None], reveal_step[:, None, :]
    drafted_row, drafted_col = t_row > 0, t_col > 0
    data_data = t_col <= t_row
    data_mask = (t_col > t_row) & drafted_row
    mask_data = (t_col < t_row) & drafted_row
    eye = torch.eye(width, dtype=torch.bool, device=reveal_step.device)
    mask_mask = ((t_col >= t_row) & drafted_row & drafted_col) | eye
    return torch.cat([torch.cat([data_data, data_mask], dim=2), torch.cat([mask_data, mask_mask], dim=2)], dim=1)


def concat_segments(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Pattern of two segments where the second sees all of the first and the first never sees the second.

    Used to fuse a finished block's cache write with the next block's first denoising forward.

    Args:
        first (`torch.Tensor` of shape `(N, a, a)` or `(a, a)`), second (`(N, b, b)` or `(b, b)`).

    Returns:
        `torch.Tensor` of shape `(N, a + b, a + b)` (`(a + b, a + b)` when both are unbatched), bool.
    """
    batch = torch.broadcast_shapes(first.shape[:-2], second.shape[:-2])
    a, b = first.shape[-1], second.shape[-1]
    mask = torch.zeros(*batch, a + b, a + b, dtype=torch.bool, device=first.device)
    mask[..., :a, :a] = first
    mask[..., a:, :a] = True
    mask[..., a:, a:] = second
    return mask


def to_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool `(N, q, kv)` -> additive float `(N, 1, q, kv)`: 0 where allowed, `finfo(dtype).min` elsewhere."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    out.masked_fill_(~mask, torch.finfo(dtype).min)
    return out[:, None]
