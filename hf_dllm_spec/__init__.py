"""hf-dllm-spec: speculative decoding for diffusion language models inside Hugging Face transformers.

>>> import hf_dllm_spec
>>> hf_dllm_spec.register_auto_classes()     # SDAR checkpoints load with AutoModelForCausalLM, no remote code
>>> out = model.generate(ids, decoding_strategy="s2d2", max_new_tokens=64)            # doctest: +SKIP
>>> out = qwen3.generate(ids, custom_generate=hf_dllm_spec.custom_generate,
...                      decoding_strategy="s2d2", mask_token_id=mask_id)              # doctest: +SKIP

Importing the package, or any module of it, registers nothing and loads submodules only when one of the
names below is first used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0.dev0"

_EXPORTS = {
    "ARConfig": "strategies.block_diffusion",
    "BlockDiffusionConfig": "strategies.block_diffusion",
    "S2D2Config": "strategies.s2d2",
    "FastDLLMV2Config": "strategies.fast_dllm_v2",
    "DeerConfig": "strategies.deer",
    "SimSDConfig": "strategies.simsd",
    "LLaDA2DecodingConfig": "strategies.llada2",
    "DeerCandidateGenerator": "integration.candidate_generator",
    "deer_assisted_generate": "integration.candidate_generator",
    "DecodingConfig": "configuration",
    "DrafterConfig": "configuration",
    "DecodingStrategy": "strategies.base",
    "DecodingStrategyName": "strategies.registry",
    "STRATEGIES": "strategies.registry",
    "config_class_for": "strategies.registry",
    "get_strategy": "strategies.registry",
    "register_strategy": "strategies.registry",
    "resolve_config": "strategies.registry",
    "DllmGenerationMixin": "integration.mixin",
    "dllm_generate": "integration.generate",
    "RowFeed": "integration.rows",
    "RowRequest": "integration.rows",
    "EditRule": "maths.editing",
    "EditingConfig": "maths.editing",
    "ThresholdEditRule": "maths.editing",
    "GenerateDllmOutput": "outputs",
    "SpecDecodingStats": "outputs",
    "export_checkpoint": "hub.export",
    "clear_static_state": "runtime.static",
    "configure_static_runtime": "runtime.static",
    "static_states": "runtime.static",
}

__all__ = sorted([*_EXPORTS, "custom_generate", "register_auto_classes"])


def register_auto_classes() -> None:
    """Register the families with their own model classes (SDAR, Fast-dLLM v2, LLaDA2) with `AutoConfig` /
    `AutoModelForCausalLM`.

    The one place hf_dllm_spec touches the Auto classes; idempotent. See `model_patches.register_auto_classes`.
    """
    import model_patches

    model_patches.register_auto_classes()


def __getattr__(name: str) -> Any:
    if name == "custom_generate":  # alias: ``model.generate(custom_generate=hf_dllm_spec.custom_generate, ...)``
        name = "dllm_generate"
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'hf_dllm_spec' has no attribute {name!r}")
