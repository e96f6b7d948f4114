"""Strategy registry: `decoding_strategy` name -> strategy class."""

from __future__ import annotations

from .base import DecodingSession, DecodingStrategy
from .block_diffusion import ARStrategy, BlockDiffusionStrategy, BlockState
from .s2d2 import S2D2Strategy, first_masked_span

STRATEGIES: dict[str, type[DecodingStrategy]] = {
    cls.name: cls for cls in (ARStrategy, BlockDiffusionStrategy, S2D2Strategy)
}

__all__ = ["ARStrategy", "BlockDiffusionStrategy", "BlockState", "DecodingSession", "DecodingStrategy",
           "S2D2Strategy", "STRATEGIES", "first_masked_span"]
