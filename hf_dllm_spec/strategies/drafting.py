"""One-step block drafting (DEER §3.2, Eq. 5): k draft distributions from one drafter forward.

Given each row's verified prefix x_{1:j}, one forward of a diffusion drafter over ``[prefix | MASK x k]``
(plus an optional SEP token) yields q_theta(. | x_{1:j}) at the k masked positions. Each draft conditions on
the prefix only, never on the other drafts.

Two attention layouts (``draft_attention``):

- ``"causal_prefix"`` (default): the prefix is causal and stored in the drafter's KV cache; the masked block
  sees the whole prefix and itself (full attention inside the block) and is read-only. Committed tokens never
  change, so the cached prefix equals a fresh forward (tested): each cycle feeds only the newly committed
  tokens plus the masks. This is how block-diffusion drafters (SDAR) attend, and the layout the D2A recipe
  (`recipes/objectives.py`, ``d2a``) trains.
- ``"full"``: bidirectional attention over prefix and block (Open-dCoder-style drafters, families.md §6); a KV
  cache would be invalid once the suffix changes, so every cycle recomputes the whole context (DEER App. F).

Alignment follows the drafter's family: a right-shifted drafter (Open-dCoder, Fast-dLLM v2) scores the first
draft from the last prefix position; the runner applies the shift.

SEP (``sep_token_id``, DEER Stage I's continuation-boundary marker): ``"after_masks"`` appends it at position
j + k (the paper's Fig. 3), ``"before_masks"`` puts it first in the block, sharing position j with the first
mask (the masks keep positions j .. j + k - 1, so draft i is at position j + i either way). Without a SEP token
(the default) the block is just the masks.
"""

from __future__ import annotations

import torch

from ..maths.masks import causal_mask, concat_segments, full_mask, left_pad
from ..runtime.runner import ModelRunner
from ..tracing import device_constant
from ..validation import invalid

DRAFT_ATTENTIONS = ("causal_prefix", "full")
SEP_POSITIONS = ("after_masks", "before_masks")


def draft_block_layout(num_draft_tokens: int, mask_token_id: int, sep_token_id: int | None,
                       sep_position: str) -> tuple[list[int], list[int], list[int]]:
    """Token ids, position offsets (from the first position after the prefix) and draft slots of the block.

    The layout :class:`OneStepDrafter` decodes with (the ``d2a`` training objective of `recipes` trains the
    "causal_prefix" attention without SEP tokens, the case with `sep_token_id=None`).

    Args:
        num_draft_tokens (`int`): k.
        mask_token_id (`int`): the drafter's mask token.
        sep_token_id (`int` or `None`): the SEP token, none when `None`.
        sep_position (`str`): "after_masks" or "before_masks".

    Returns:
        `(token_ids, offsets, slots)`: lists of length k (+ 1 with SEP); `slots[i]` is the block index of draft
        i, whose position offset is i.

    Raises:
        ValueError: for an unknown `sep_position`.
    """
    if sep_position not in SEP_POSITIONS:
        raise invalid("sep_position", sep_position, f"be one of {SEP_POSITIONS}", "pass sep_position='after_masks'")
    k = num_draft_tokens
    if sep_token_id is None:
        return [mask_token_id] * k, list(range(k)), list(range(k))
    if sep_position == "after_masks":
        return [mask_token_id] * k + [sep_token_id], list(range(k + 1)), list(range(k))
    return [sep_token_id] + [mask_token_id] * k, [0] + list(range(k)), list(range(1, k + 1))


class OneStepDrafter:
    """A diffusion drafter that proposes k tokens per forward, conditioned on the verified prefix only.

    Args:
        runner (`ModelRunner`): the drafter, with its own (empty) cache and batch.
        mask_token_id (`int`): the drafter's mask token.
        draft_attention (`str`, defaults to "causal_prefix"): see the module docstring.
        sep_token_id (`int`, *optional*), sep_position (`str`, defaults to "after_masks"): the SEP token.

    Usage: call :meth:`draft` with each row's tokens committed since the previous call (the whole prompt the
    first time); it returns the raw draft logits of the k masked positions.

    Raises:
        ValueError: for an unknown `draft_attention` or `sep_position`.
    """

    def __init__(self, runner: ModelRunner, mask_token_id: int, *, draft_attention: str = "causal_prefix",
                 sep_token_id: int | None = None, sep_position: str = "after_masks") -> None:
        if draft_attention not in DRAFT_ATTENTIONS:
            raise invalid("draft_attention", draft_attention, f"be one of {DRAFT_ATTENTIONS}",
                          "pass draft_attention='causal_prefix' (block-diffusion drafters) or 'full'")
        draft_block_layout(1, mask_token_id, sep_token_id, sep_position)       # validates sep_position
        self.runner, self.mask_token_id = runner, mask_token_id
        self.draft_attention, self.sep_token_id, self.sep_position = draft_attention, sep_token_id, sep_position
        n, device = runner.batch_size, runner.device
        self.lengths = torch.zeros(n, dtype=torch.long, device=device)   # "causal_prefix": tokens stored, per row
        self.context = [torch.empty(0, dtype=torch.long, device=device) for _ in range(n)]   # "full" only

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the rows `index` `(M,)` int64, in that order, of this drafter's own state (the runner's rows are
        selected by its owner, the session)."""
        index = index.to(self.runner.device)
        self.lengths = self.lengths[index]
        self.context = [self.context[i] for i in index.tolist()]

    def add_rows(self, count: int) -> None:
        """Rows that join the batch have seen nothing yet (their first :meth:`draft` reads their whole prompts)."""
        device = self.runner.device
        self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(count)])
        self.context += [torch.empty(0, dtype=torch.long, device=device) for _ in range(count)]

    def draft(self, new_tokens: list[torch.Tensor], num_draft_tokens: int, rows: list[bool] | None = None
              ) -> torch.Tensor:
        """One drafter forward; returns the raw logits of the k draft positions.

        Args:
            new_tokens (`list[torch.Tensor]`): per row, the tokens committed since the previous call, `(m_n,)`
                int64 (the prompt on the first call; may be empty).
            num_draft_tokens (`int`): k >= 1.
            rows (`list[bool]`, *optional*): the rows whose drafts are used, for the per-row counters (all when
                omitted): a row that drafts nothing this cycle is not charged the forward.

        Returns:
            `torch.Tensor` of shape `(N, k, V)`, float32: entry i scores the token at position j + i, where j is
            the row's committed length (q_theta(. | x_{1:j}) of DEER Eq. 5).
        """
        runner, device = self.runner, self.runner.device
        ids, _, slots = draft_block_layout(num_draft_tokens, self.mask_token_id, self.sep_token_id, self.sep_position)
        if self.draft_attention == "full":
            self.extend_context(new_tokens)
            padded, valid, _ = left_pad(self.context, device)
            query, positions, intra = self.full_query(padded, valid, num_draft_tokens)
            return runner.forward(query, positions, intra, kind="draft", logits_to_keep=len(ids), rows=rows)[:, slots]
        counts = torch.tensor([t.shape[0] for t in new_tokens], dtype=torch.long, device=device)
        padded, valid, _ = left_pad(new_tokens, device)
        query, positions, intra = self.block_query(padded, valid, self.lengths, num_draft_tokens)
        self.lengths = self.lengths + counts
        width = padded.shape[1]
        logits = runner.forward(query, positions, intra, kind="draft", store_len=width,
                                store_valid=valid if width else None, logits_to_keep=len(ids), rows=rows)
        return logits[:, slots]

    def extend_context(self, new_tokens: list[torch.Tensor]) -> None:
        """The "full" layout: append each row's new committed tokens `(m_n,)` to its context (kept on the host
        side as a list of `(L_n,)` tensors on the drafter's device; :meth:`full_query` takes the lengths from it)."""
        device = self.runner.device
        self.context = [torch.cat([c, t.to(device)]) for c, t in zip(self.context, new_tokens)]

    def pad(self, new_tokens: list[torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's new committed tokens `(m_n,)` (m_n <= `width`) left-padded to `width`, on the drafter's device:
        `(ids, valid)`, `(N, width)` int64 and bool, the fixed-width input of :meth:`block_query`."""
        ids, valid, _ = left_pad([t.to(self.runner.device) for t in new_tokens], self.runner.device)
        front = width - ids.shape[1]
        return torch.nn.functional.pad(ids, (front, 0)), torch.nn.functional.pad(valid, (front, 0))

    def block_tokens(self, num_draft_tokens: int, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft block of :func:`draft_block_layout` as tensors: its ids `(rows, b)` int64 and position offsets
        `(1, b)` int64 (b: k, plus one with SEP), built on the device (:func:`~hf_dllm_spec.tracing.device_constant`:
        also inside a captured step)."""
        ids, offsets, _ = draft_block_layout(num_draft_tokens, self.mask_token_id, self.sep_token_id,
                                             self.sep_position)
        return (device_constant(ids, torch.long, device)[None].expand(rows, -1),
                device_constant(offsets, torch.long, device)[None])

    def full_query(self, ids: torch.Tensor, valid: torch.Tensor,
                   num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The "full" drafter query of one :meth:`draft` (DEER App. F): each row's whole context, then the drafted
        block, bidirectional over both; nothing is stored (the context is recomputed every cycle). A function of
        tensors (no host read): a compiled DEER cycle builds it at the context's width bucket.

        Args:
            ids (`torch.Tensor` of shape `(N, W)`, int64): each row's context (:meth:`extend_context`), left-padded.
            valid (`torch.Tensor` of shape `(N, W)`, bool): the real columns (padding first).
            num_draft_tokens (`int`): k.

        Returns:
            `(query, positions, intra)`: `(N, W + b)` ids and positions (b: k, plus one with SEP; the context at
            0 .. L_n - 1, padding at 0, the block from L_n) and the `(N, W + b, W + b)` bool visibility (padding
            seen by nobody but itself); the drafts are read at the block's `slots` (:func:`draft_block_layout`).
        """
        device = ids.device
        n, width = ids.shape
        block_ids, offsets = self.block_tokens(num_draft_tokens, n, device)
        b = block_ids.shape[1]
        prefix_pos = (valid.cumsum(dim=1) - 1).clamp(min=0)
        block_pos = valid.sum(dim=1)[:, None] + offsets
        see = torch.cat([valid, valid.new_ones(n, b)], dim=1)
        intra = see[:, None, :] | torch.eye(width + b, dtype=torch.bool, device=device)
        return torch.cat([ids, block_ids], dim=1), torch.cat([prefix_pos, block_pos], dim=1), intra

    def block_query(self, new_ids: torch.Tensor, new_valid: torch.Tensor, seen: torch.Tensor,
                    num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The "causal_prefix" drafter query of one :meth:`draft`: each row's new tokens (stored, causal) then the
        drafted block (read-only, full attention inside it, seeing the whole prefix). A function of tensors (no
        host read): a compiled DEER cycle builds it at a fixed width.

        Args:
            new_ids (`torch.Tensor` of shape `(N, m)`, int64): each row's new committed tokens, left-padded.
            new_valid (`torch.Tensor` of shape `(N, m)`, bool): the real columns (padding first).
            seen (`torch.Tensor` of shape `(N,)`, int64): committed tokens the drafter stored before them.
            num_draft_tokens (`int`): k.

        Returns:
            `(query, positions, intra)`: `(N, m + b)` ids and positions (b: k, plus one with SEP) and the `(m + b,
            m + b)` bool visibility; the first m are the tokens to store (`store_valid=new_valid`), the drafts are
            read at the block's `slots` (:func:`draft_block_layout`).
        """
        device = new_ids.device
        block_ids, offsets = self.block_tokens(num_draft_tokens, new_ids.shape[0], device)
        width, b = new_ids.shape[1], block_ids.shape[1]
        end = seen + new_valid.sum(dim=1)                                     # the prefix length after them
        prefix_pos = (end[:, None] - width + torch.arange(width, device=device)[None]).clamp(min=0)
        block_pos = end[:, None] + offsets
        query = torch.cat([new_ids, block_ids], dim=1)
        positions = torch.cat([prefix_pos, block_pos], dim=1)
        return query, positions, concat_segments(causal_mask(width, device), full_mask(b, device))
