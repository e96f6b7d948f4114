"""One registry: `decoding_strategy` name -> strategy class (its config class is `strategy.config_class`).

Third-party strategies register with :func:`register_strategy`; `generate(decoding_strategy=...)`, the
parameter routing of the `custom_generate` callable and the error messages all read this table.
"""

from __future__ import annotations

import sys
from enum import Enum
from typing import Any

from transformers import GenerationConfig

from ..configuration import DecodingConfig, merge_parameters
from .base import DecodingStrategy
from .block_diffusion import ARStrategy, BlockDiffusionStrategy
from .deer import DeerStrategy
from .fast_dllm_v2 import FastDLLMV2Strategy
from .llada2 import LLaDA2Strategy
from .s2d2 import S2D2Strategy
from .simsd import SimSDStrategy
from ..validation import check_choice

STRATEGIES: dict[str, type[DecodingStrategy]] = {}


class DecodingStrategyName(str, Enum):
    """Values of `generate(decoding_strategy=...)` for the built-in strategies."""

    AR = "ar"
    BLOCK_DIFFUSION = "block_diffusion"
    S2D2 = "s2d2"
    FAST_DLLM_V2 = "fast_dllm_v2"
    DEER = "deer"
    SIMSD = "simsd"
    LLADA2 = "llada2"


def register_strategy(strategy: type[DecodingStrategy]) -> type[DecodingStrategy]:
    """Add `strategy` under `strategy.name` (replacing an entry of that name); usable as a class decorator.

    Its config's parameters become keyword arguments of `hf_dllm_spec.dllm_generate` (so `generate` routes them).
    """
    STRATEGIES[strategy.name] = strategy
    generation = sys.modules.get(f"{__package__}.generation")
    if generation is not None and hasattr(generation, "refresh_signature"):
        generation.refresh_signature()
    return strategy


for _strategy in (ARStrategy, BlockDiffusionStrategy, S2D2Strategy, FastDLLMV2Strategy, DeerStrategy, SimSDStrategy,
                  LLaDA2Strategy):
    register_strategy(_strategy)


def get_strategy(decoding_strategy: str) -> type[DecodingStrategy]:
    """The strategy class of a name.

    Raises:
        ValueError: for an unknown `decoding_strategy`, listing the valid names.
    """
    value = decoding_strategy.value if isinstance(decoding_strategy, Enum) else decoding_strategy
    check_choice("decoding_strategy", value, tuple(STRATEGIES), f"pass one of {', '.join(map(repr, STRATEGIES))}")
    return STRATEGIES[value]


def config_class_for(decoding_strategy: str) -> type[DecodingConfig]:
    """The config class of a strategy name (see :func:`get_strategy` for the errors)."""
    return get_strategy(decoding_strategy).config_class


def strategy_parameter_names() -> tuple[str, ...]:
    """Every parameter of every registered strategy config, in a stable order."""
    names: list[str] = []
    for strategy in STRATEGIES.values():
        names += [n for n in strategy.config_class.parameter_names() if n not in names]
    return tuple(names)


def resolve_config(
    decoding_strategy: str,
    *,
    generation_config: GenerationConfig | None = None,
    strategy_config: DecodingConfig | None = None,
    preset: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> DecodingConfig:
    """The validated config of `decoding_strategy`, merged field by field (see
    :func:`~hf_dllm_spec.configuration.merge_parameters`): stored < preset < strategy_config < keywords.

    Raises:
        ValueError: unknown strategy, preset or parameter; out-of-range value; a `strategy_config` of another
            strategy.
    """
    return merge_parameters(config_class_for(decoding_strategy), generation_config=generation_config,
                            preset=preset, strategy_config=strategy_config, overrides=overrides)
