"""Token editing: a rule that re-decides committed positions of the current block (LLaDA2.1 T2T hook).

The block-diffusion loop calls an :class:`EditRule` after each denoising step with the step's proposal. A
position is editable when it was already committed when the step began and is not a prompt token; the rule
returns which editable positions take the proposed token. A block ends when no mask is left and the last step
edited nothing, or after `max_post_steps` steps that began with a full block (LLaDA2.1's Hub `generate`; the
LLaDA2.1 tech report §2 Eq. 1-3). Without a rule
(the default) none of this runs.
"""

from __future__ import annotations

import torch


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
            tokens (`torch.Tensor` of shape `(N, B)`, int64): the block after this step's commits.
            editable (`torch.Tensor` of shape `(N, B)`, bool): committed before this step, not prompt.
            probs (`torch.Tensor` of shape `(N, B, V)`, float32): this step's processed distribution.
            proposal (`torch.Tensor` of shape `(N, B)`, int64): this step's chosen token per position.
            confidence (`torch.Tensor` of shape `(N, B)`, float32): probability of `proposal`.

        Returns:
            `torch.Tensor` of shape `(N, B)`, bool (only editable positions where the proposal differs count).
        """
        raise NotImplementedError
