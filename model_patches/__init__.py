"""Model-family adapters: one module per family, reached through :func:`get_patch`.

Importing this package registers nothing. :func:`register_auto_classes` (also `hf_dllm_spec.register_auto_classes`)
is the one place that registers the families with their own model classes (SDAR, Fast-dLLM v2, LLaDA2) with `AutoConfig` /
`AutoModelForCausalLM` under their Hub `model_type`, so Hub checkpoints load without `trust_remote_code`.
"""

from __future__ import annotations

from .base import ALIGNMENTS, FamilyPatch
from .causal_lm import CausalLMPatch
from .llada2 import LLaDA2MoeConfig, LLaDA2MoeModel, LLaDA2MoeModelLM, LLaDA2Patch
from .fast_dllm_v2 import Fast_dLLM_QwenConfig, Fast_dLLM_QwenForCausalLM, Fast_dLLM_QwenModel, FastDLLMV2Patch
from .qwen import QwenPatch
from .sdar import SDARConfig, SDARForCausalLM, SDARModel, SDARPatch

PATCHES: tuple[FamilyPatch, ...] = (SDARPatch(), FastDLLMV2Patch(), LLaDA2Patch(), QwenPatch())
#: Serves any other decoder-only transformers causal LM (autoregressive): `ar` and DEER targets.
CAUSAL_LM_PATCH = CausalLMPatch()


def register_auto_classes() -> None:
    """Register every family's `(config, causal-LM)` classes with `AutoConfig` / `AutoModelForCausalLM`.

    Idempotent. Afterwards `AutoModelForCausalLM.from_pretrained(<SDAR checkpoint>)` builds `SDARForCausalLM`
    (transformers' Qwen3 modeling plus `generate(decoding_strategy=...)`) without remote code.
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    for patch in PATCHES:
        for config_class, model_class in patch.auto_classes:
            AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
            AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
        for config_class, model_class in patch.base_model_classes:
            AutoModel.register(config_class, model_class, exist_ok=True)


def get_patch(model) -> FamilyPatch:
    """The family adapter for a loaded model, chosen by `model.config.model_type`; any other decoder-only
    transformers causal LM gets :class:`CausalLMPatch` (autoregressive).

    Raises:
        NotImplementedError: for a model type no patch serves, listing the supported ones.
    """
    model_type = getattr(model.config, "model_type", None)
    for patch in PATCHES:
        if model_type in patch.model_types:
            return patch
    if CausalLMPatch.serves(model):
        return CAUSAL_LM_PATCH
    supported = ", ".join(repr(t) for p in PATCHES for t in p.model_types)
    raise NotImplementedError(
        f"`model.config.model_type` (={model_type!r}) has no family patch in hf_dllm_spec; supported model types: "
        f"{supported}, and any decoder-only causal LM of transformers (autoregressive). Load a supported family, "
        "or add a FamilyPatch in model_patches/."
    )


__all__ = ["ALIGNMENTS", "CAUSAL_LM_PATCH", "CausalLMPatch", "FamilyPatch", "FastDLLMV2Patch", "Fast_dLLM_QwenConfig", "Fast_dLLM_QwenForCausalLM",
           "Fast_dLLM_QwenModel", "LLaDA2MoeConfig", "LLaDA2MoeModel", "LLaDA2MoeModelLM", "LLaDA2Patch", "PATCHES", "QwenPatch", "SDARConfig", "SDARForCausalLM", "SDARModel", "SDARPatch",
           "get_patch", "register_auto_classes"]
