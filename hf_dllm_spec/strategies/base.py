"""Strategy interface: one class per `decoding_strategy`, built from a validated config and a session."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..configuration import DecodingConfig
from ..outputs import SpecDecodingStats
from ..runner import ModelRunner
from ..sampling import Sampler


@dataclass
class DecodingSession:
    """Everything a strategy needs for one `generate` call (batch 1), resolved and validated up front.

    Attributes:
        prompt_ids (`torch.Tensor` of shape `(P,)`, int64): the prompt.
        runner (`ModelRunner`): the decoding model with its cache (the target / self-drafting model).
        sampler (`Sampler`): logits -> distributions and tokens; holds the generator.
        stats (`SpecDecodingStats`): counters, updated in place.
        mask_token_id (`int` or `None`): the family's mask token.
        stop_token_ids (`list[int]`): generation stops after the block in which one of them is committed.
        max_new_tokens (`int`): budget in tokens (whole blocks are decoded, the caller trims).
        stop_check (`callable`): `(generated_ids (n,)) -> bool`, the caller's extra stopping criteria.
    """

    prompt_ids: torch.Tensor
    runner: ModelRunner
    sampler: Sampler
    stats: SpecDecodingStats
    mask_token_id: int | None
    stop_token_ids: list[int]
    max_new_tokens: int
    stop_check: Any = None


class DecodingStrategy(ABC):
    """Base class. Subclasses set the metadata and implement :meth:`decode`.

    Attributes:
        name (`str`): the `decoding_strategy` value.
        config_class (`type[DecodingConfig]`).
        paper (`str`): source of the algorithm.
        lossless (`bool`): whether outputs follow the target distribution exactly.
        requires_mask_token (`bool`): whether the model needs a mask token.
        supports_batch (`bool`): whether batch size > 1 is supported.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[DecodingConfig]]
    paper: ClassVar[str] = ""
    lossless: ClassVar[bool] = False
    requires_mask_token: ClassVar[bool] = True
    supports_batch: ClassVar[bool] = False

    def __init__(self, config: DecodingConfig, session: DecodingSession) -> None:
        self.config, self.session = config, session

    @abstractmethod
    def decode(self) -> torch.Tensor:
        """Run the decoding loop; return the committed tokens after the prompt, `(n,)` int64 (untrimmed)."""

    def should_stop(self, generated: torch.Tensor) -> bool:
        """Stop after a stop id, at the token budget, or when the caller's criteria say so."""
        s = self.session
        if generated.shape[0] >= s.max_new_tokens:
            return True
        if s.stop_token_ids and torch.isin(generated, torch.tensor(s.stop_token_ids, device=generated.device)).any():
            return True
        return bool(s.stop_check is not None and s.stop_check(generated))
