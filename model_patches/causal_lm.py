"""Any other transformers causal LM (Llama, Mistral, Gemma, Phi, ...): autoregressive, right-shifted.

The fallback of :func:`model_patches.get_patch` for a `model_type` that transformers maps to a causal-LM class
and no family patch claims. Such a model runs the strategies that need no mask token on the target: `ar`, and
as DEER's target (`decoding_strategy="deer"`); its forward takes the explicit 4D additive mask and
`position_ids` the runner passes, as transformers 5.x models do.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from .base import FamilyPatch


class CausalLMPatch(FamilyPatch):
    """The fallback adapter for any other decoder-only transformers causal LM (see the module docstring):
    autoregressive (`is_diffusion_lm` False, no native strategy), right-shifted alignment. It claims no
    `model_type`; :func:`model_patches.get_patch` picks it when :meth:`serves` says so."""

    family = "transformers causal LM"
    model_types = ()
    alignment = "right_shift"
    is_diffusion_lm = False
    native_strategy = None

    @staticmethod
    def serves(model: PreTrainedModel) -> bool:
        """Whether transformers maps the model's `model_type` to a causal-LM class (decoder-only)."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config = model.config
        return (getattr(config, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                and not getattr(config, "is_encoder_decoder", False))
