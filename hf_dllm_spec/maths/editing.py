"""Token editing: rules that re-decide committed positions of the current block (LLaDA2.1 token-to-token, T2T).

The block-diffusion loop calls an :class:`EditRule` at each denoising step with the step's proposal, before the
step's mask-to-token commits (those touch masked positions only, so the order does not change the result, and
S2D2's verifier sees the edited block, as in the S2D2 reference on LLaDA2.1). A position is editable when it is
committed and not a prompt token; the rule returns which editable positions take the proposed token. A block
ends when no mask is left and the last step edited nothing, or after `max_post_steps` steps that began with a
full block (LLaDA2.1's Hub `generate`; LLaDA2.1 tech report §2 Eq. 1-3; `strategies.md` §3). Without a rule
(the default) none of this runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..configuration import DecodingConfig
from ..validation import check_int, check_range, invalid


class EditRule:
    """Base class of token-editing rules.

    Attributes:
        max_post_steps (`int`): denoising steps allowed after the block is full, for editing only (LLaDA2.1
            `max_post_steps`); 0 ends the block as soon as no mask is left.
    """

    max_post_steps: int = 0

    def __call__(self, *, tokens: torch.Tensor, editable: torch.Tensor, probs: torch.Tensor,
                 proposal: torch.Tensor, confidence: torch.Tensor) -> torch.Tensor:
        """Positions to overwrite with `proposal`.

        Args:
            tokens (`torch.Tensor` of shape `(N, B)`, int64): the block before this step's commits.
            editable (`torch.Tensor` of shape `(N, B)`, bool): committed, not prompt.
            probs (`torch.Tensor` of shape `(N, B, V)`, float32): this step's processed distribution.
            proposal (`torch.Tensor` of shape `(N, B)`, int64): this step's chosen token per position.
            confidence (`torch.Tensor` of shape `(N, B)`, float32): probability of `proposal`.

        Returns:
            `torch.Tensor` of shape `(N, B)`, bool (only editable positions where the proposal differs count).
        """
        raise NotImplementedError


class ThresholdEditRule(EditRule):
    """LLaDA2.1 T2T (tech report Eq. 2): edit where the proposal differs and its probability exceeds tau_edit.

    Args:
        editing_threshold (`float`): tau_edit in (0, 1]; 1.0 never edits (S2D2's "editing off").
        max_post_steps (`int`): see :class:`EditRule`.
    """

    def __init__(self, editing_threshold: float, max_post_steps: int = 0) -> None:
        self.editing_threshold, self.max_post_steps = editing_threshold, max_post_steps

    def __call__(self, *, tokens, editable, probs, proposal, confidence):
        return confidence > self.editing_threshold       # the loop keeps editable positions whose proposal differs


@dataclass
class EditingConfig(DecodingConfig):
    """LLaDA2.1's decoding parameters beside the block-diffusion ones (Hub `generate`; `strategies.md` §3).

    Args:
        editing_threshold (`float`, *optional*): tau_edit of token-to-token editing, in (0, 1]; committed (non-prompt)
            tokens of the current block are replaced by the step's proposal when it differs and its probability
            exceeds it. `None` turns editing off (LLaDA2.0 behaviour); 1.0 never edits but keeps the post steps.
        max_post_steps (`int`, defaults to 0): with editing, denoising steps allowed after the block is full (the
            Hub default is 16; the S2D2 evaluations use 0). A block also ends at the first such step without an
            edit.
        num_to_transfer (`int`, *optional*): k, the least number of masks a step commits (LLaDA2.1: the masks above
            `confidence_threshold` if at least k, else the k most confident). `None` takes k from the
            `steps_per_block` schedule (LLaDA2.0, SDAR).
    """

    editing_threshold: float | None = None
    max_post_steps: int = 0
    num_to_transfer: int | None = None

    def validate(self) -> None:
        if self.editing_threshold is not None:
            check_range("editing_threshold", self.editing_threshold, low=0.0, high=1.0, low_open=True,
                        fix="pass a probability such as 0.9 (LLaDA2.1 Hub default), or None for no editing")
        check_int("max_post_steps", self.max_post_steps, 0, "pass 0 (no editing-only steps) or e.g. 16")
        if self.num_to_transfer is not None:
            check_int("num_to_transfer", self.num_to_transfer, 1, "pass 1 (LLaDA2.1 default), or None for the "
                      "steps_per_block schedule")
            # Mixed into block-diffusion configs, which own `steps_per_block`: the two would silently compete.
            if getattr(self, "steps_per_block", None) is not None:
                raise invalid("steps_per_block", self.steps_per_block, f"not be combined with `num_to_transfer` "
                              f"(={self.num_to_transfer}), which replaces the steps schedule (LLaDA2.1)",
                              "drop `steps_per_block`, or pass num_to_transfer=None (preset 'llada2.0') to use it")

    def edit_rule(self) -> EditRule | None:
        """The :class:`ThresholdEditRule` these parameters describe, or `None` without editing."""
        if self.editing_threshold is None:
            return None
        return ThresholdEditRule(self.editing_threshold, self.max_post_steps)
