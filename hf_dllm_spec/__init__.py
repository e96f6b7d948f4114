"""hf-dllm-spec: speculative decoding for diffusion language models inside Hugging Face transformers.

>>> import hf_dllm_spec                      # registers the model families with the Auto classes
>>> out = model.generate(ids, decoding_strategy="s2d2", max_new_tokens=64)            # doctest: +SKIP
>>> out = qwen3.generate(ids, custom_generate=hf_dllm_spec.dllm_generate,
...                      decoding_strategy="s2d2", mask_token_id=mask_id)              # doctest: +SKIP
"""

from __future__ import annotations

from .configuration import (
    ARConfig,
    BlockDiffusionConfig,
    DecodingConfig,
    DecodingStrategyName,
    S2D2Config,
    config_class_for,
    resolve_config,
)
from .generation import DllmGenerationMixin, dllm_generate
from .outputs import GenerateDllmOutput, SpecDecodingStats

custom_generate = dllm_generate  #: alias: ``model.generate(custom_generate=hf_dllm_spec.custom_generate, ...)``

import model_patches  # noqa: E402  (registers SDAR with AutoConfig / AutoModelForCausalLM)

__version__ = "0.1.0.dev0"

__all__ = [
    "ARConfig",
    "BlockDiffusionConfig",
    "DecodingConfig",
    "DecodingStrategyName",
    "DllmGenerationMixin",
    "GenerateDllmOutput",
    "S2D2Config",
    "SpecDecodingStats",
    "config_class_for",
    "custom_generate",
    "dllm_generate",
    "model_patches",
    "resolve_config",
]
