"""Decoding strategies, one module per paper; each module holds the strategy and its config.

The name -> strategy table is `hf_dllm_spec.strategies.registry`.
"""

from __future__ import annotations

from .base import DecodingSession, DecodingStrategy
from .block_diffusion import ARConfig, ARStrategy, BlockDiffusionConfig, BlockDiffusionStrategy, BlockState
from .deer import DeerConfig, DeerStrategy
from .fast_dllm_v2 import FastDLLMV2Config, FastDLLMV2Strategy
from ..maths.unmasking import first_masked_span
from .s2d2 import S2D2Config, S2D2Strategy
from .simsd import SimSDConfig, SimSDStrategy

__all__ = ["ARConfig", "ARStrategy", "BlockDiffusionConfig", "BlockDiffusionStrategy", "BlockState",
           "DecodingSession", "DecodingStrategy", "DeerConfig", "DeerStrategy", "FastDLLMV2Config",
           "FastDLLMV2Strategy", "S2D2Config", "S2D2Strategy", "SimSDConfig", "SimSDStrategy", "first_masked_span"]
